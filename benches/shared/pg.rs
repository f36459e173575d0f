//! What the PostgreSQL benchmarks share: their settings from the environment and the server
//! they use (`BENCH_POSTGRES`, libpq key=value of a role that may create databases; by default
//! the local socket as the current user).
#![allow(dead_code)] // each benchmark uses its part

pub fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub fn admin_conninfo() -> String {
    std::env::var("BENCH_POSTGRES").unwrap_or_else(|_| {
        let user = std::env::var("USER")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "root".into());
        format!("host=/var/run/postgresql user={user} dbname=postgres")
    })
}

/// libpq key=value for database `db` on the same server, as the same role.
pub fn conninfo_of(db: &str) -> String {
    let base: Vec<String> = admin_conninfo()
        .split_whitespace()
        .filter(|kv| !kv.starts_with("dbname="))
        .map(str::to_owned)
        .collect();
    format!("{} dbname={db}", base.join(" "))
}

pub async fn connect(conninfo: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {conninfo:?}: {e}"));
    tokio::spawn(conn);
    client
}
