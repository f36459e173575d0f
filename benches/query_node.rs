//! The query node over the fleet's PostgreSQL (docs/FLEET.md, "Query nodes"): a partitioned
//! table of `BENCH_GATEWAYS` gateways (default 64) x `BENCH_SERIES` series (default 100) x
//! `BENCH_DAYS` days of hourly rows (default 35), each row with a real sketch of 60 readings;
//! then `bucketd query-node` (in this process, over HTTP) answers, `BENCH_RUNS` times each
//! (default 20, after one warm-up): 30 days of one gateway's series, one day of a fleet-wide
//! series (every gateway's buckets merged per hour, sketches included), the same fleet p99 through
//! the Prometheus API, and the series list read cold. Beside each: the SQL alone (`EXPLAIN
//! ANALYZE`'s execution time of the rows it reads) and the plan's index, same run.
//!
//! `cargo bench --bench query_node`. PostgreSQL: `BENCH_POSTGRES` (libpq key=value of a role
//! that may create databases), by default the local socket as the current user. The database
//! (`bucketd_bench_query_node`) is kept for a next run with the same sizes (`BENCH_FRESH=1`
//! makes it again).

use std::time::{Duration, Instant};

#[path = "shared/pg.rs"]
mod pg;
use pg::conninfo_of;
use pg::{admin_conninfo, connect, env_or};

use bucketd::sketch::SketchParams;
use bucketd::summary::Summary;

const DB: &str = "bucketd_bench_query_node";

/// The database: `BENCH_DATABASE`, made beforehand (a Citus coordinator's, whose every node
/// needs the extension: docs/FLEET.md, "Citus"; its tables emptied and filled again when they
/// do not hold the sizes asked for), else [`DB`], made here.
fn database() -> String {
    std::env::var("BENCH_DATABASE").unwrap_or_else(|_| DB.to_owned())
}

/// Makes the table (unless it holds the sizes asked for already); returns the first hour.
async fn fill(gateways: i64, series: i64, days: i64) -> i64 {
    let admin = connect(&admin_conninfo()).await;
    let last = (chrono::Utc::now().timestamp() / 86_400) * 86_400;
    let first = last - days * 86_400;
    let want = gateways * series * days * 24;
    let exists = !admin
        .query(
            "SELECT 1 FROM pg_database WHERE datname = $1",
            &[&database()],
        )
        .await
        .unwrap()
        .is_empty();
    if exists && std::env::var("BENCH_FRESH").as_deref() != Ok("1") {
        let db = connect(&conninfo_of(&database())).await;
        let row = db
            .query_one(
                "SELECT count(*), min(extract(epoch FROM start))::int8 FROM bucketd_buckets",
                &[],
            )
            .await
            .unwrap();
        let (n, start): (i64, Option<i64>) = (row.get(0), row.get(1));
        if n == want {
            println!("reusing {}: {n} rows", database());
            return start.unwrap_or(first);
        }
    }
    if std::env::var("BENCH_DATABASE").is_err() {
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {DB} WITH (FORCE)"))
            .await
            .unwrap();
        admin
            .batch_execute(&format!("CREATE DATABASE {DB}"))
            .await
            .unwrap();
    }
    let db = connect(&conninfo_of(&database())).await;
    db.batch_execute(bucketd::fleet::postgres::SCHEMA)
        .await
        .unwrap();
    db.batch_execute("TRUNCATE bucketd_buckets, bucketd_gateways")
        .await
        .unwrap();
    // The partitions: one per month the rows touch.
    let months: Vec<std::time::SystemTime> = (0..=days / 28 + 1)
        .map(|k| {
            std::time::UNIX_EPOCH
                + Duration::from_secs(u64::try_from(first + k * 28 * 86_400).unwrap())
        })
        .collect();
    db.execute("SELECT bucketd_ensure_partitions($1)", &[&months])
        .await
        .unwrap();
    // A real sketch: 60 readings spread over two decades.
    let mut s = Summary::with_params(0, 1.0, SketchParams::DEFAULT);
    for i in 1..60 {
        s.push(i, 1.0 + i as f64 * 1.7);
    }
    let sketch = s.sketch.encode();
    let began = Instant::now();
    // One statement per gateway (a few hundred thousand rows each).
    for g in 0..gateways {
        db.execute(
            "INSERT INTO bucketd_buckets (series, start, gateway_id, sensor, metric, width_secs,
                 count, sum, sum_comp, min, max, first_ts_ns, first_value, last_ts_ns,
                 last_value, mean, m2, sketch, p50, p90, p99)
             SELECT format('gw-%s:s%s/temp', $1::int8, s), to_timestamp(t), 'gw-' || $1::int8,
                 's' || s, 'temp', 3600, 60, 60 * (50 + $1::int8 + s), 0, 1 + $1::int8,
                 101 + $1::int8 + s, t * 1000000000, 1, (t + 3599) * 1000000000, 2,
                 50 + $1::int8 + s, 1000, $4, 50, 90, 99
             FROM generate_series(0, $2::int8 - 1) s,
                  generate_series($3::int8, $3::int8 + $5::int8 - 3600, 3600) t",
            &[&g, &series, &first, &sketch, &(days * 86_400)],
        )
        .await
        .unwrap();
    }
    // Each gateway's position row, as its first batch makes it: the node lists a gateway's
    // series from it (every gateway that wrote a row has one).
    db.execute(
        "INSERT INTO bucketd_gateways (gateway_id, last_seq)
         SELECT 'gw-' || g, 0 FROM generate_series(0, $1::int8 - 1) g",
        &[&gateways],
    )
    .await
    .unwrap();
    db.batch_execute("VACUUM ANALYZE bucketd_buckets")
        .await
        .unwrap();
    println!(
        "filled {}: {want} rows in {:.1} s",
        database(),
        began.elapsed().as_secs_f64()
    );
    first
}

/// Median and slowest of `runs` timings of `f` (after one warm-up), in ms.
fn time(runs: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut ms: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    (ms[ms.len() / 2], ms[ms.len() - 1])
}

/// `EXPLAIN ANALYZE` of the node's bucket read (its statement, `fleet::reader`) for `series`
/// over `[from, to)`: the execution time (ms) and the index lines of the plan.
async fn explain(
    db: &tokio_postgres::Client,
    series: &[String],
    from: i64,
    to: i64,
) -> (f64, Vec<String>) {
    let gateways: Vec<&str> = series
        .iter()
        .map(|s| s.split_once(':').map_or("", |(g, _)| g))
        .collect();
    let rows = db
        .query(
            "EXPLAIN (ANALYZE, FORMAT TEXT)
             SELECT b.series, b.start, b.count, b.sum, b.sum_comp, b.min, b.max, b.first_ts_ns,
                 b.first_value, b.last_ts_ns, b.last_value, b.mean, b.m2, b.sketch
             FROM unnest($1::text[], $4::text[]) AS k(series, gateway_id)
             JOIN bucketd_buckets b ON b.gateway_id = k.gateway_id AND b.series = k.series
             WHERE b.gateway_id = ANY($4) AND b.start >= to_timestamp($2)
               AND b.start < to_timestamp($3) AND b.width_secs = 3600
             ORDER BY b.series, b.start",
            &[&series, &(from as f64), &(to as f64), &gateways],
        )
        .await
        .unwrap();
    let lines: Vec<String> = rows.iter().map(|r| r.get::<_, String>(0)).collect();
    let ms = lines
        .iter()
        .find_map(|l| l.trim().strip_prefix("Execution Time: "))
        .and_then(|t| t.trim_end_matches(" ms").parse().ok())
        .unwrap_or(f64::NAN);
    let mut index: Vec<String> = lines
        .iter()
        .filter(|l| l.contains("Index") && l.contains(" on "))
        .map(|l| {
            let l = l.trim().trim_start_matches("->  ");
            l.split("  (").next().unwrap_or(l).to_owned()
        })
        .collect();
    index.dedup();
    index.truncate(3);
    (ms, index)
}

fn get(agent: &ureq::Agent, url: &str) -> String {
    let mut response = agent.get(url).call().unwrap();
    assert_eq!(response.status(), 200, "{url}");
    response.body_mut().read_to_string().unwrap()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let gateways = env_or("BENCH_GATEWAYS", 64i64);
    let series = env_or("BENCH_SERIES", 100i64);
    let days = env_or("BENCH_DAYS", 35i64);
    let runs = env_or("BENCH_RUNS", 20usize);
    let first = fill(gateways, series, days).await;
    let last_day = first + (days - 1) * 86_400;

    let mut raw = bucketd::config::RawConfig::load(None, Vec::new()).unwrap();
    raw.query_node.postgres = conninfo_of(&database());
    raw.http.bind = "127.0.0.1:0".into();
    raw.http.max_buckets_per_query = 10_000;
    let config = bucketd::config::Config::try_from(raw).unwrap();
    let node = bucketd::daemon::start_query_node(&config).unwrap();
    let base = format!("http://{}", node.http_addr);
    let db = connect(&conninfo_of(&database())).await;

    let one = "gw-7:s42/temp".to_owned();
    let members: Vec<String> = (0..gateways).map(|g| format!("gw-{g}:s42/temp")).collect();
    let (from30, to30) = (last_day - 29 * 86_400, last_day + 86_400);
    let (sql30, plan30) = explain(&db, std::slice::from_ref(&one), from30, to30).await;
    let (sql_fleet, plan_fleet) = explain(&db, &members, last_day, last_day + 86_400).await;

    let rows = series * gateways;
    let figures = tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let cold = Instant::now();
        let listed = get(&agent, &format!("{base}/api/v1/series"));
        let cold_ms = cold.elapsed().as_secs_f64() * 1000.0;
        assert!(listed.contains("*:s42/temp"), "{listed:.200}");
        let thirty = format!("{base}/api/v1/buckets?series={one}&from={from30}&to={to30}");
        let answer = get(&agent, &thirty);
        let hours = usize::try_from(days.min(30) * 24).unwrap();
        assert_eq!(answer.matches("\"count\"").count(), hours, "30 days of hours");
        let fleet = format!(
            "{base}/api/v1/buckets?series=*:s42/temp&from={last_day}&to={}",
            last_day + 86_400
        );
        let answer = get(&agent, &fleet);
        assert_eq!(answer.matches("\"count\"").count(), 24, "a day of hours");
        let prom = format!(
            "{base}/prom/api/v1/query_range?query=bucketd_bucket_p99%7Bseries%3D%22*%3As42%2Ftemp%22%7D&start={last_day}&end={}&step=3600",
            last_day + 23 * 3600
        );
        assert!(get(&agent, &prom).contains("\"values\""));
        vec![
            ("30 days of one series (/api/v1/buckets, 720 rows at most)", time(runs, || {
                get(&agent, &thirty);
            })),
            ("fleet-wide day, hourly, every gateway merged (/api/v1/buckets)", time(runs, || {
                get(&agent, &fleet);
            })),
            ("fleet-wide hourly p99 of a day (/prom query_range)", time(runs, || {
                get(&agent, &prom);
            })),
            ("series list, read cold (skip scan)", (cold_ms, cold_ms)),
        ]
    })
    .await
    .unwrap();
    println!(
        "\n{rows} series ({gateways} gateways x {series}), {days} days: {} rows",
        rows * days * 24
    );
    for (what, (median, max)) in &figures {
        println!("{what}: median {median:.1} ms, slowest {max:.1} ms (of {runs})");
    }
    println!("SQL alone, 30 days of one series: {sql30:.2} ms; plan: {plan30:?}");
    println!(
        "SQL alone, fleet-wide day ({} rows): {sql_fleet:.2} ms; plan: {plan_fleet:?}",
        gateways * 24
    );
    node.stop().await;
}
