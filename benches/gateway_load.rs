//! The gateway load (issue 42): what a gateway's SD card sees, next to SQLite on the same readings.
//!
//! Each case is `series` sensors sending one JSON reading a second each, for `BENCH_SECS`, in one
//! of three arrival patterns:
//! - `independent`: each sensor on its own phase within the second (devices on their own clocks);
//! - `burst1s`: every sensor at the top of each second (devices polled together);
//! - `burst100ms`: a tenth of the sensors every 100 ms (a poller working through its list).
//!
//! Each case runs its own Mosquitto (the system's, with its defaults: MQTT 5 clients get no
//! in-flight window from Debian's 2.0.11), one bucketd with the shipped defaults (`bucketd run`
//! on a config that changes only the broker, the file and the HTTP port), and one SQLite
//! subscriber (WAL, synchronous=FULL, one transaction a second upserting hourly rows, its
//! acknowledgements after its commit, its own checkpoints included), both on the same readings.
//!
//! Bytes are what each process wrote to the block layer (`/proc/<pid>/io` `write_bytes`), from
//! after start-up (bucketd subscribed, SQLite's table made) through each one's own shutdown, so
//! the last fold of what the journal held and SQLite's close are counted: folding less often
//! hides nothing in a short run. GB/day = bytes / the run's span × 86,400. The floor is one
//! 4 KiB page per durable commit a second: 0.354 GB/day.
//!
//! The cases run side by side (each with its own broker and processes), to keep the whole run
//! near `BENCH_SECS`; at these rates the machine is nearly idle.
//!
//! `cargo bench --bench gateway_load`; knobs: `BENCH_SECS` (default 660: one shipped 10-minute
//! checkpoint, then the shutdown's), `BENCH_SERIES` (default `200,10`), `BENCH_PATTERNS`
//! (default `independent,burst1s,burst100ms`), `BENCH_PROTOCOL=v311` for bucketd.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bucketd::config::{Protocol, RawConfig, RawSubscription};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde_json::{Value, json};

#[path = "../tests/shared/bucketd_child.rs"]
mod bucketd_child;
#[path = "../tests/shared/own_mosquitto.rs"]
mod own_mosquitto;
use bucketd_child::BucketdChild;
#[path = "../tests/shared/prom.rs"]
mod prom;
use prom::metric;

/// One 4 KiB page per second for a day, in GB: the floor for one durable commit a second.
const FLOOR_GB_PER_DAY: f64 = 4096.0 * 86_400.0 / 1e9;

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// `write_bytes` of a process (`self` or a pid): what it sent to the block layer.
fn written(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("write_bytes:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("write_bytes in /proc/<pid>/io")
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Pattern {
    Independent,
    Burst1s,
    Burst100ms,
}

impl Pattern {
    fn parse(s: &str) -> Pattern {
        match s {
            "independent" => Pattern::Independent,
            "burst1s" => Pattern::Burst1s,
            "burst100ms" => Pattern::Burst100ms,
            other => panic!("BENCH_PATTERNS: unknown pattern {other:?}"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Pattern::Independent => "independent",
            Pattern::Burst1s => "burst1s",
            Pattern::Burst100ms => "burst100ms",
        }
    }

    /// When each sensor publishes, as (offset from the start, sensor), in order.
    fn schedule(self, series: usize, secs: u64) -> Vec<(Duration, usize)> {
        let mut out = Vec::with_capacity(series * secs as usize);
        for k in 0..secs {
            let second = Duration::from_secs(k);
            for s in 0..series {
                let within = match self {
                    // A fixed, spread phase per sensor (golden-ratio steps, no clumps).
                    Pattern::Independent => (s as f64 * 0.618_033_988_75).fract(),
                    Pattern::Burst1s => 0.0,
                    // Tenths of the sensors in turn, one group every 100 ms.
                    Pattern::Burst100ms => (s * 10 / series) as f64 / 10.0,
                };
                out.push((second + Duration::from_secs_f64(within), s));
            }
        }
        out.sort_by_key(|(at, s)| (*at, *s));
        out
    }
}

/// A reading's value: deterministic, with a decimal, as a thermometer sends.
fn value(s: usize, k: usize) -> f64 {
    20.0 + ((s * 7 + k) % 50) as f64 / 10.0
}

// ---- The SQLite child: `BENCH_ROLE=sqlite`. -----------------------------------------------

/// Subscribes to `BENCH_PREFIX/#`, upserts every reading into an hourly row, commits once a
/// second (acknowledging what the commit held), and after `BENCH_EXPECT` readings closes the
/// database and prints one JSON line: bytes written after start-up, commits, count and sum.
async fn sqlite_child() {
    let host = std::env::var("BENCH_HOST").unwrap();
    let port: u16 = env_or("BENCH_PORT", 0);
    let prefix = std::env::var("BENCH_PREFIX").unwrap();
    let expect: usize = env_or("BENCH_EXPECT", 0);
    let dir = tempfile::tempdir().unwrap();
    let conn = rusqlite::Connection::open(dir.path().join("gateway.sqlite")).unwrap();
    conn.execute_batch(
        "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;
         CREATE TABLE buckets (series TEXT NOT NULL, start INTEGER NOT NULL,
           count INTEGER NOT NULL, sum REAL NOT NULL, min REAL NOT NULL, max REAL NOT NULL,
           first REAL NOT NULL, last REAL NOT NULL,
           PRIMARY KEY (series, start)) WITHOUT ROWID;",
    )
    .unwrap();
    let mut opts = MqttOptions::new(format!("bench-sqlite-{prefix}"), host, port);
    opts.set_keep_alive(Duration::from_secs(30))
        .set_manual_acks(true);
    let (client, mut eventloop) = AsyncClient::new(opts, expect + 1000);
    client
        .subscribe(format!("{prefix}/#"), QoS::AtLeastOnce)
        .await
        .unwrap();
    loop {
        if let Event::Incoming(Packet::SubAck(_)) = eventloop.poll().await.unwrap() {
            break;
        }
    }
    let start_bytes = written("self");
    println!("subscribed");
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut unacked = Vec::new();
    let (mut received, mut commits) = (0, 0u64);
    let mut open = false;
    while received < expect || !unacked.is_empty() {
        tokio::select! {
            event = eventloop.poll() => {
                let Event::Incoming(Packet::Publish(p)) = event.unwrap() else { continue };
                let doc: Value = serde_json::from_slice(&p.payload).unwrap();
                let sensor = p.topic.split('/').nth(2).unwrap();
                let start = doc["ts"].as_i64().unwrap().div_euclid(3_600_000) * 3600;
                if !open {
                    conn.execute_batch("BEGIN").unwrap();
                    open = true;
                }
                conn.prepare_cached(
                    "INSERT INTO buckets (series, start, count, sum, min, max, first, last)
                     VALUES (?1, ?2, 1, ?3, ?3, ?3, ?3, ?3)
                     ON CONFLICT (series, start) DO UPDATE SET count = count + 1,
                       sum = sum + excluded.sum, min = min(min, excluded.min),
                       max = max(max, excluded.max), last = excluded.last",
                )
                .unwrap()
                .execute(rusqlite::params![
                    format!("{sensor}/temperature"),
                    start,
                    doc["temperature"].as_f64().unwrap()
                ])
                .unwrap();
                unacked.push(p);
                received += 1;
            }
            _ = tick.tick() => {
                if open {
                    conn.execute_batch("COMMIT").unwrap();
                    open = false;
                    commits += 1;
                    for p in unacked.drain(..) {
                        client.try_ack(&p).unwrap();
                    }
                }
            }
        }
    }
    let (count, sum): (i64, f64) = conn
        .query_row("SELECT SUM(count), SUM(sum) FROM buckets", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    // The last connection's close checkpoints the WAL into the database: its shutdown.
    conn.close().unwrap();
    println!(
        "{}",
        json!({"bytes": written("self") - start_bytes, "commits": commits, "count": count, "sum": sum})
    );
}

// ---- The parent. ----------------------------------------------------------------------------

/// One case's figures.
struct Outcome {
    series: usize,
    pattern: Pattern,
    span: Duration,
    readings: u64,
    /// bucketd: bytes from subscribed to just before the stop, and through its shutdown.
    bucketd_running: u64,
    bucketd_total: u64,
    bucketd_commits: u64,
    bucketd_checkpoints: u64,
    sqlite_bytes: u64,
    sqlite_commits: u64,
}

fn gb_per_day(bytes: u64, span: Duration) -> f64 {
    bytes as f64 / span.as_secs_f64() * 86_400.0 / 1e9
}

fn bucketd_protocol() -> Protocol {
    match std::env::var("BENCH_PROTOCOL").as_deref() {
        Ok("v311") => Protocol::V311,
        _ => Protocol::V5,
    }
}

/// Publishes the pattern's readings at QoS 1 on time; returns when every PUBACK is in.
async fn publish(port: u16, prefix: String, series: usize, pattern: Pattern, secs: u64) -> f64 {
    let mut opts = MqttOptions::new(format!("bench-pub-{prefix}"), "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(30))
        .set_inflight(1000);
    let (client, mut eventloop) = AsyncClient::new(opts, 10_000);
    let schedule = pattern.schedule(series, secs);
    let total = schedule.len();
    let _keep = client.clone();
    let sender = tokio::spawn(async move {
        let start = tokio::time::Instant::now();
        let mut sum = 0.0;
        for (k, (at, s)) in schedule.into_iter().enumerate() {
            tokio::time::sleep_until(start + at).await;
            let v = value(s, k);
            sum += v;
            let payload = format!("{{\"ts\":{},\"temperature\":{v}}}", now_ms());
            client
                .publish(
                    format!("{prefix}/devices/s{s}/telemetry"),
                    QoS::AtLeastOnce,
                    false,
                    payload,
                )
                .await
                .unwrap();
        }
        sum
    });
    let mut acked = 0;
    while acked < total {
        if let Event::Incoming(Packet::PubAck(_)) = eventloop.poll().await.unwrap() {
            acked += 1;
        }
    }
    sender.await.unwrap()
}

async fn run_case(series: usize, pattern: Pattern, secs: u64) -> Outcome {
    let broker = own_mosquitto::OwnMosquitto::start(false, "");
    let port = broker.port;
    let prefix = format!("gl{}{series}{}", std::process::id(), pattern.name());
    let readings = series as u64 * secs;
    let dir = tempfile::tempdir().unwrap();
    // The shipped defaults; only where to connect, where to keep the file and what to read.
    let mut raw = RawConfig::load(None, Vec::new()).unwrap();
    raw.mqtt.host = "127.0.0.1".into();
    raw.mqtt.port = port;
    raw.mqtt.protocol = bucketd_protocol();
    raw.mqtt.client_id = format!("bench-bucketd-{prefix}");
    raw.store.path = dir.path().join("gateway.redb");
    raw.http.bind = "127.0.0.1:0".into();
    raw.subscriptions = RawSubscription::defaults_under(&prefix);
    let daemon = BucketdChild::start(env!("CARGO_BIN_EXE_bucketd"), &raw, dir.path(), 1);
    let metrics_url = daemon.metrics_url.clone();
    let scrape = move || {
        ureq::get(&metrics_url)
            .call()
            .unwrap()
            .into_body()
            .read_to_string()
            .unwrap()
    };
    let mut sqlite = Command::new(std::env::current_exe().unwrap())
        .env("BENCH_ROLE", "sqlite")
        .env("BENCH_HOST", "127.0.0.1")
        .env("BENCH_PORT", port.to_string())
        .env("BENCH_PREFIX", &prefix)
        .env("BENCH_EXPECT", readings.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut sqlite_out = BufReader::new(sqlite.stdout.take().unwrap());
    let mut line = String::new();
    sqlite_out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "subscribed", "the SQLite child");

    let before = tokio::task::spawn_blocking({
        let scrape = scrape.clone();
        move || scrape()
    })
    .await
    .unwrap();
    let (bytes0, commits0) = (
        metric(&before, "bucketd_disk_written_bytes_total") as u64,
        metric(&before, "bucketd_flushes_total") as u64,
    );
    let start = Instant::now();
    let sum = publish(port, prefix.clone(), series, pattern, secs).await;
    // Until bucketd has committed every reading (at most a flush interval later).
    let after = tokio::task::spawn_blocking({
        let scrape = scrape.clone();
        move || loop {
            let text = scrape();
            if metric(&text, "bucketd_readings_ingested_total") as u64 >= readings {
                return text;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap();
    let span = start.elapsed();
    let bucketd_commits = metric(&after, "bucketd_flushes_total") as u64 - commits0;
    let bucketd_checkpoints = metric(&after, "bucketd_checkpoints_total") as u64;
    let bucketd_running = metric(&after, "bucketd_disk_written_bytes_total") as u64 - bytes0;
    let closed = tokio::task::spawn_blocking(move || daemon.stop())
        .await
        .unwrap();
    let docs = bucketd::store::StoreReader::open(&raw.store.path)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    let stored: u64 = docs.iter().map(|d| d.count as u64).sum();
    let stored_sum: f64 = docs.iter().map(|d| d.sum + d.sum_comp).sum();
    assert_eq!(stored, readings, "bucketd stored every reading");
    assert!((stored_sum - sum).abs() <= 1e-9 * sum, "bucketd's sum");

    let report = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        sqlite_out.read_line(&mut line).unwrap();
        assert!(sqlite.wait().unwrap().success(), "the SQLite child");
        serde_json::from_str::<Value>(&line).unwrap()
    })
    .await
    .unwrap();
    assert_eq!(report["count"].as_u64(), Some(readings), "SQLite's count");
    assert!((report["sum"].as_f64().unwrap() - sum).abs() <= 1e-9 * sum);
    drop(broker);
    Outcome {
        series,
        pattern,
        span,
        readings,
        bucketd_running,
        bucketd_total: closed - bytes0,
        bucketd_commits,
        bucketd_checkpoints,
        sqlite_bytes: report["bytes"].as_u64().unwrap(),
        sqlite_commits: report["commits"].as_u64().unwrap(),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::var("BENCH_ROLE").as_deref() == Ok("sqlite") {
        sqlite_child().await;
        return;
    }
    // `cargo bench` passes `--bench`; a filter argument selects nothing here.
    let secs = env_or("BENCH_SECS", 660u64);
    let series: Vec<usize> = std::env::var("BENCH_SERIES")
        .unwrap_or_else(|_| "200,10".into())
        .split(',')
        .map(|s| s.parse().expect("BENCH_SERIES: numbers"))
        .collect();
    let patterns: Vec<Pattern> = std::env::var("BENCH_PATTERNS")
        .unwrap_or_else(|_| "independent,burst1s,burst100ms".into())
        .split(',')
        .map(Pattern::parse)
        .collect();
    println!(
        "gateway load: one JSON reading per sensor a second for {secs} s, bucketd (shipped \
         defaults, {:?}) and SQLite (WAL, synchronous=FULL, one transaction a second) on the \
         same readings, each case with its own Mosquitto; bytes through each one's shutdown",
        bucketd_protocol()
    );
    let mut cases = Vec::new();
    for &n in &series {
        for &p in &patterns {
            cases.push(tokio::spawn(run_case(n, p, secs)));
        }
    }
    println!(
        "{:>6} {:<12} {:>9} {:>11} {:>10} {:>9} {:>9} {:>8} {:>11} {:>9} {:>9} {:>8}",
        "series",
        "pattern",
        "readings",
        "bd GB/day",
        "(running)",
        "bd B/rd.",
        "commits/s",
        "ckpts",
        "SQL GB/day",
        "SQL c/s",
        "bd/SQL",
        "bd/floor"
    );
    for case in cases {
        let o = case.await.unwrap();
        let bd = gb_per_day(o.bucketd_total, o.span);
        let sql = gb_per_day(o.sqlite_bytes, o.span);
        println!(
            "{:>6} {:<12} {:>9} {:>11.3} {:>10.3} {:>9.1} {:>9.2} {:>8} {:>11.3} {:>9.2} {:>9.2} {:>8.2}",
            o.series,
            o.pattern.name(),
            o.readings,
            bd,
            gb_per_day(o.bucketd_running, o.span),
            o.bucketd_total as f64 / o.readings as f64,
            o.bucketd_commits as f64 / o.span.as_secs_f64(),
            o.bucketd_checkpoints,
            sql,
            o.sqlite_commits as f64 / o.span.as_secs_f64(),
            bd / sql,
            bd / FLOOR_GB_PER_DAY,
        );
    }
}
