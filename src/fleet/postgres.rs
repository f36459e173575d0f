//! PostgreSQL for the fleet tier: connecting (schema applied once, under an advisory lock,
//! unless the role may not: `deploy/postgres/roles.sql`),
//! and applying a gateway's outbox entries exactly once ([`apply`]). Used by the forwarder and
//! by the claims of central instances ([`super::claims`]).

use std::time::{Duration, UNIX_EPOCH};

use tracing::warn;

use crate::secret::Secret;
use crate::sketch::Sketch;
use crate::store::OutboxDoc;

/// The schema, run (idempotently) at every connection.
pub const SCHEMA: &str = include_str!("../../deploy/postgres/schema.sql");

/// Key of the advisory lock that serialises schema creation between gateways.
const SCHEMA_LOCK: i64 = 0x0062_7563_6b65_7464; // "bucketd" in ASCII

const UPSERT: &str = "
INSERT INTO bucketd_buckets AS t (series, start, gateway_id, sensor, metric, width_secs, count,
    sum, sum_comp, min, max, first_ts_ns, first_value, last_ts_ns, last_value, mean, m2, sketch)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)
ON CONFLICT (series, start) DO UPDATE SET
    count = t.count + excluded.count,
    sum = t.sum + excluded.sum,
    sum_comp = t.sum_comp + excluded.sum_comp,
    min = LEAST(t.min, excluded.min),
    max = GREATEST(t.max, excluded.max),
    first_ts_ns = CASE WHEN (excluded.first_ts_ns, excluded.first_value) < (t.first_ts_ns, t.first_value)
        THEN excluded.first_ts_ns ELSE t.first_ts_ns END,
    first_value = CASE WHEN (excluded.first_ts_ns, excluded.first_value) < (t.first_ts_ns, t.first_value)
        THEN excluded.first_value ELSE t.first_value END,
    last_ts_ns = CASE WHEN (excluded.last_ts_ns, excluded.last_value) > (t.last_ts_ns, t.last_value)
        THEN excluded.last_ts_ns ELSE t.last_ts_ns END,
    last_value = CASE WHEN (excluded.last_ts_ns, excluded.last_value) > (t.last_ts_ns, t.last_value)
        THEN excluded.last_value ELSE t.last_value END,
    mean = t.mean * (t.count::float8 / (t.count + excluded.count))
        + excluded.mean * (excluded.count::float8 / (t.count + excluded.count)),
    m2 = t.m2 + excluded.m2 + (excluded.mean - t.mean) * (excluded.mean - t.mean)
        * (t.count::float8 / (t.count + excluded.count)) * excluded.count,
    sketch = excluded.sketch";

/// Why a password for `conninfo` (in it, or from its password file) would reach someone who
/// is not the server: the connection goes over the network (not a socket or loopback) and does
/// not check the server's certificate (`sslmode` disable or prefer, or require without
/// `sslrootcert`). MQTT warns alike; `None` when it is safe or there is no password.
pub fn password_exposure(key: &str, conninfo: &str, password_file: bool) -> Option<String> {
    use crate::config::SslMode;
    let tls = crate::config::pg_tls(conninfo).ok()?;
    let verified = match tls.mode {
        SslMode::Disable | SslMode::Prefer => false,
        SslMode::Require => tls.root_cert.is_some(),
        SslMode::VerifyCa | SslMode::VerifyFull => true,
    };
    let config: tokio_postgres::Config = tls.conninfo.parse().ok()?;
    if verified || (!password_file && config.get_password().is_none()) {
        return None;
    }
    let remote: Vec<String> = config
        .get_hosts()
        .iter()
        .filter_map(|host| match host {
            tokio_postgres::config::Host::Tcp(name) => Some(name.clone()),
            #[cfg(unix)]
            tokio_postgres::config::Host::Unix(_) => None,
        })
        .chain(config.get_hostaddrs().iter().map(ToString::to_string))
        .filter(|host| !crate::config::is_loopback_host(host))
        .collect();
    if remote.is_empty() {
        return None;
    }
    let mode = match tls.mode {
        SslMode::Disable => "disable: no TLS",
        SslMode::Prefer => "prefer: TLS if offered, the certificate not checked",
        _ => "require without sslrootcert: the certificate not checked",
    };
    Some(format!(
        "The PostgreSQL password of {key} goes to {} without a check of the server's \
         certificate (sslmode={mode}): whoever sits on the path can take it. Set \
         sslmode=verify-full and sslrootcert=<the server's CA file> in {key}.",
        remote.join(", ")
    ))
}

/// Connects to PostgreSQL (`conninfo` without the password) and runs `schema`, idempotently,
/// under an advisory lock that serialises it with every other bucketd doing the same.
pub async fn connect(
    conninfo: &str,
    password: Option<&Secret>,
    application_name: String,
    schema: &str,
) -> anyhow::Result<tokio_postgres::Client> {
    // Config validation checked the TLS settings (and refused TLS in a build without it).
    let tls = crate::config::pg_tls(conninfo).map_err(anyhow::Error::msg)?;
    let mut config: tokio_postgres::Config = tls.conninfo.parse()?;
    if let Some(password) = password {
        config.password(password.expose());
    }
    config.application_name(application_name);
    config.connect_timeout(Duration::from_secs(10));
    let ended = |e: tokio_postgres::Error| {
        tracing::debug!(error = %e, "The PostgreSQL connection ended.");
    };
    #[cfg(feature = "tls")]
    let mut client = {
        let connector = super::pg_tls::connector(&tls, "sslmode").map_err(anyhow::Error::msg)?;
        let (client, connection) = config.connect(connector).await?;
        tokio::spawn(async move { connection.await.unwrap_or_else(ended) });
        client
    };
    #[cfg(not(feature = "tls"))]
    let mut client = {
        let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
        tokio::spawn(async move { connection.await.unwrap_or_else(ended) });
        client
    };
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
        .await?;
    // A gateway's own role (deploy/postgres/roles.sql) may not create or alter tables: an admin
    // made them, and the schema step is skipped.
    tx.batch_execute("SAVEPOINT bucketd_schema").await?;
    if let Err(e) = tx.batch_execute(schema).await {
        if e.code() != Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) {
            return Err(e.into());
        }
        tx.batch_execute("ROLLBACK TO SAVEPOINT bucketd_schema")
            .await?;
        tracing::debug!(error = %e, "This role may not create the schema; using the tables as they are.");
    }
    tx.commit().await?;
    Ok(client)
}

/// Applies the entries above the gateway's `last_seq` in one transaction; returns the readings
/// they represent (0 for a batch that was already applied).
pub async fn apply(
    db: &mut tokio_postgres::Client,
    gateway: &str,
    origin: &str,
    entries: &[OutboxDoc],
) -> anyhow::Result<u64> {
    let tx = db.transaction().await?;
    tx.execute(
        "INSERT INTO bucketd_gateways (gateway_id, last_seq) VALUES ($1, -1)
         ON CONFLICT (gateway_id) DO NOTHING",
        &[&gateway],
    )
    .await?;
    let row = tx
        .query_one(
            "SELECT last_seq, origin FROM bucketd_gateways WHERE gateway_id = $1 FOR UPDATE",
            &[&gateway],
        )
        .await?;
    let (mut last, stored_origin): (i64, String) = (row.get(0), row.get(1));
    // A replaced database numbers its entries from the start again (see `super::applied`).
    if !stored_origin.is_empty() && stored_origin != origin {
        warn!(
            gateway,
            was = %stored_origin,
            now = %origin,
            "PostgreSQL holds this gateway's deltas from another database; applying this one's \
             from its start. If two gateways share this id, give each its own upstream.gateway_id."
        );
        last = -1;
    }
    let lock = tx
        .prepare("SELECT sketch FROM bucketd_buckets WHERE series = $1 AND start = $2 FOR UPDATE")
        .await?;
    let upsert = tx.prepare(UPSERT).await?;
    let mut readings = 0;
    for entry in entries.iter().filter(|e| e.seq > last) {
        for b in &entry.buckets {
            let series = format!("{gateway}:{}", b.series);
            let start = UNIX_EPOCH + Duration::from_secs(u64::try_from(b.start)?);
            let sketch = match tx.query_opt(&lock, &[&series, &start]).await? {
                Some(row) => merged_sketch(row.get(0), &b.sketch),
                None => b.sketch.clone(),
            };
            let width = i32::try_from(b.end.saturating_sub(b.start))?;
            tx.execute(
                &upsert,
                &[
                    &series,
                    &start,
                    &gateway,
                    &b.sensor,
                    &b.metric,
                    &width,
                    &b.count,
                    &b.sum,
                    &b.sum_comp,
                    &b.min,
                    &b.max,
                    &b.first.ts,
                    &b.first.value,
                    &b.last.ts,
                    &b.last.value,
                    &b.mean,
                    &b.m2,
                    &sketch,
                ],
            )
            .await?;
            readings += u64::try_from(b.count)?;
        }
    }
    let upto = entries.last().map_or(last, |e| e.seq);
    if upto > last {
        tx.execute(
            "UPDATE bucketd_gateways SET last_seq = $2, origin = $3, updated_at = now()
             WHERE gateway_id = $1",
            &[&gateway, &upto, &origin],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(readings)
}

/// The stored sketch merged with a delta's; an unreadable stored one is replaced (its
/// quantiles were unknown anyway), an unreadable delta leaves the stored one.
fn merged_sketch(stored: &[u8], delta: &[u8]) -> Vec<u8> {
    match (Sketch::decode(stored), Sketch::decode(delta)) {
        (Some(mut s), Some(d)) => {
            s.merge(&d);
            s.encode()
        }
        (None, _) => delta.to_vec(),
        (Some(_), None) => stored.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 41: `sslmode=prefer` (libpq's default) or `require` without a root certificate sent
    /// a password to a remote server without checking who it was, with no word of it (MQTT
    /// warns). Each case: (conninfo, a password file, warned).
    #[test]
    fn a_password_sent_unchecked_over_the_network_is_warned_about() {
        for (conninfo, file, warned) in [
            ("host=db.example user=u", true, true),
            ("host=db.example user=u password=x", false, true),
            ("host=db.example user=u sslmode=require", true, true),
            ("postgresql://u:x@db.example/f?sslmode=disable", false, true),
            ("host=10.0.0.5 user=u sslmode=prefer", true, true),
            ("host=db.example user=u", false, false),
            ("host=localhost user=u password=x", false, false),
            ("host=127.0.0.1 user=u", true, false),
            ("host=/run/postgresql user=u", true, false),
            (
                "host=db.example user=u sslmode=require sslrootcert=/etc/ca.pem",
                true,
                false,
            ),
            (
                "host=db.example user=u sslmode=verify-full sslrootcert=/etc/ca.pem",
                true,
                false,
            ),
            ("host=localhost,db.example user=u", true, true),
        ] {
            let warning = password_exposure("upstream.postgres", conninfo, file);
            assert_eq!(warning.is_some(), warned, "{conninfo}: {warning:?}");
            if let Some(w) = warning {
                assert!(w.contains("db.example") || w.contains("10.0.0.5"), "{w}");
                assert!(
                    w.contains("verify-full") && w.contains("upstream.postgres"),
                    "{w}"
                );
                assert!(!w.contains("password=x"), "{w}");
            }
        }
    }

    #[test]
    fn merged_sketch_holds_both_and_survives_a_damaged_side() {
        let params = crate::sketch::SketchParams::DEFAULT;
        let mut a = Sketch::new(params);
        let mut b = Sketch::new(params);
        for v in 1..=50 {
            a.add(f64::from(v));
            b.add(f64::from(v + 50));
        }
        let merged = Sketch::decode(&merged_sketch(&a.encode(), &b.encode())).unwrap();
        let mut want = a.clone();
        want.merge(&b);
        assert_eq!(merged.encode(), want.encode());
        assert_eq!(merged_sketch(b"junk", &b.encode()), b.encode());
        assert_eq!(merged_sketch(&a.encode(), b"junk"), a.encode());
    }
}
