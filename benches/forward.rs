//! Forwarding throughput to PostgreSQL (docs/FLEET.md): an outbox of `BENCH_ENTRIES` commits
//! (default 100), each touching `BENCH_BUCKETS` buckets (default 1,000 series, one hour) with
//! `BENCH_READINGS_PER_BUCKET` readings each (default 10), is shipped by the real forwarder into
//! a fresh database; prints deltas/s and readings represented per second, min/median/max over
//! `BENCH_RUNS` (default 3), and checks the table's total count.
//!
//! `cargo bench --bench forward`. PostgreSQL: `BENCH_POSTGRES` (libpq key=value of a role that
//! may create databases), by default the local socket as the current user.
//! `BENCH_TARGET=mqtt cargo bench --bench forward`: to a Mosquitto the benchmark starts, where a
//! subscriber decodes every delta message and checks the readings they carry.
//! `BENCH_TARGET=central cargo bench --bench forward`: through that Mosquitto into a central
//! bucketd (in this process, `format = "delta"`), timed until the central has committed every
//! reading; each run does it twice, without and with `[central] claims_postgres` (a fresh
//! database), and prints the ratio.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bucketd::batcher::Batcher;
use bucketd::config::{Durability, UpstreamConfig, UpstreamTarget};
use bucketd::fleet::forwarder::Forwarder;
use bucketd::reading::Timestamp;
use bucketd::stats::Stats;
use bucketd::store::{Store, StoreSettings};

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn admin_conninfo() -> String {
    std::env::var("BENCH_POSTGRES").unwrap_or_else(|_| {
        let user = std::env::var("USER")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "root".into());
        format!("host=/var/run/postgresql user={user} dbname=postgres")
    })
}

async fn connect(conninfo: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {conninfo:?}: {e}"));
    tokio::spawn(conn);
    client
}

#[path = "../tests/shared/own_mosquitto.rs"]
mod own_mosquitto;

/// Subscribes to every delta message on `port`; returns the readings they carried once
/// `want` have arrived.
async fn count_deltas(port: u16, want: u64) -> tokio::task::JoinHandle<u64> {
    let mut opts = rumqttc::MqttOptions::new("bench-central", "127.0.0.1", port);
    opts.set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut events) = rumqttc::AsyncClient::new(opts, 100);
    client
        .subscribe("bucketd/+/deltas", rumqttc::QoS::AtLeastOnce)
        .await
        .unwrap();
    loop {
        if let rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_)) = events.poll().await.unwrap() {
            break;
        }
    }
    tokio::spawn(async move {
        let _client = client;
        let mut readings = 0u64;
        while readings < want {
            if let rumqttc::Event::Incoming(rumqttc::Packet::Publish(p)) =
                events.poll().await.unwrap()
            {
                let msg: bucketd::delta::DeltaMessage =
                    bson::deserialize_from_slice(&p.payload).unwrap();
                readings += msg.buckets.iter().map(|b| b.count as u64).sum::<u64>();
            }
        }
        readings
    })
}

/// A fresh database: its name and libpq key=value.
async fn create_db(admin: &tokio_postgres::Client, name: &str) -> String {
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let base: Vec<String> = admin_conninfo()
        .split_whitespace()
        .filter(|kv| !kv.starts_with("dbname="))
        .map(str::to_owned)
        .collect();
    format!("{} dbname={name}", base.join(" "))
}

/// One run: fills an outbox, forwards it, returns (seconds, deltas, readings).
async fn run(entries: usize, buckets: usize, per_bucket: usize, run: usize) -> (f64, u64, u64) {
    if std::env::var("BENCH_TARGET").as_deref() == Ok("mqtt") {
        return run_mqtt(entries, buckets, per_bucket).await;
    }
    let admin = connect(&admin_conninfo()).await;
    let db = format!("bucketd_bench_{}_{run}", std::process::id());
    let conninfo = create_db(&admin, &db).await;

    let (_, took, deltas, readings, dir) = forward(
        entries,
        buckets,
        per_bucket,
        UpstreamTarget::Postgres {
            conninfo: conninfo.clone(),
        },
    )
    .await;
    drop(dir);
    let pg = connect(&conninfo).await;
    let total: i64 = pg
        .query_one("SELECT SUM(count)::bigint FROM bucketd_buckets", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(total as u64, readings, "readings in PostgreSQL");
    drop(pg);
    admin
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await
        .unwrap();
    (took, deltas, readings)
}

async fn run_mqtt(entries: usize, buckets: usize, per_bucket: usize) -> (f64, u64, u64) {
    let broker = own_mosquitto::OwnMosquitto::start(false, "");
    let want = (entries * buckets * per_bucket) as u64;
    let counter = count_deltas(broker.port, want).await;
    let target = UpstreamTarget::Mqtt {
        host: "127.0.0.1".into(),
        port: broker.port,
        username: None,
        client_id: "bench-forwarder".into(),
        tls: None,
    };
    let (_, took, deltas, readings, _dir) = forward(entries, buckets, per_bucket, target).await;
    assert_eq!(counter.await.unwrap(), readings, "readings received");
    (took, deltas, readings)
}

/// Through a Mosquitto into a central bucketd (with claims in PostgreSQL when `claims`);
/// returns (seconds until the central committed every reading, deltas, readings).
async fn run_central(
    entries: usize,
    buckets: usize,
    per_bucket: usize,
    claims: Option<String>,
) -> (f64, u64, u64) {
    let broker = own_mosquitto::OwnMosquitto::start(false, "");
    let dir = tempfile::tempdir().unwrap();
    let mut raw = bucketd::config::RawConfig::load(None, Vec::new()).unwrap();
    raw.mqtt.host = "127.0.0.1".into();
    raw.mqtt.port = broker.port;
    raw.mqtt.client_id = format!("bench-central-{}", std::process::id());
    raw.store.path = dir.path().join("central.redb");
    raw.http.bind = "127.0.0.1:0".into();
    raw.batch.flush_interval = Duration::from_millis(50);
    raw.central.claims_postgres = claims.unwrap_or_default();
    raw.subscriptions = vec![bucketd::config::RawSubscription {
        filter: "$share/central/bucketd/+/deltas".into(),
        template: Some("bucketd/{gateway}/deltas".into()),
        format: bucketd::decode::Format::Delta,
        qos: 1,
        timestamp_field: None,
        timestamp_unit: Default::default(),
        sensor_field: None,
        store_raw: false,
    }];
    let config = bucketd::config::Config::try_from(raw).unwrap();
    let central = bucketd::daemon::start(&config).unwrap();
    while !central.stats.subscribed.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let want = (entries * buckets * per_bucket) as u64;
    let target = UpstreamTarget::Mqtt {
        host: "127.0.0.1".into(),
        port: broker.port,
        username: None,
        client_id: "bench-forwarder".into(),
        tls: None,
    };
    let (started, _, deltas, readings, _gateway) =
        forward(entries, buckets, per_bucket, target).await;
    assert_eq!(readings, want);
    while Stats::get(&central.stats.readings_ingested) < want {
        assert_eq!(central.stats.rejected_total(), 0, "rejected deltas");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = started.elapsed().as_secs_f64();
    assert_eq!(Stats::get(&central.stats.readings_ingested), want);
    central.stop().await.unwrap();
    (took, deltas, readings)
}

/// Fills an outbox and forwards it to `target`; returns (when forwarding started, seconds until
/// every entry was acknowledged, deltas, readings, the store's directory).
async fn forward(
    entries: usize,
    buckets: usize,
    per_bucket: usize,
    target: UpstreamTarget,
) -> (Instant, f64, u64, u64, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(&StoreSettings {
        path: dir.path().join("bench.redb"),
        bucket_width_secs: 3600,
        durability: Durability::Immediate,
        quick_repair: true,
        cache_bytes: 16 << 20,
        page_capacity: 1000,
        dedup_window: 8192,
        outbox_max_entries: entries + 1,
        journal_bytes: 8 << 20,
    })
    .unwrap();
    let names: Vec<Arc<str>> = (0..buckets)
        .map(|i| Arc::from(format!("s{i}/temperature")))
        .collect();
    let hour = Timestamp::now().as_nanos() / 3_600_000_000_000 * 3600;
    for e in 0..entries {
        let mut b = Batcher::by_hand();
        let now = Instant::now();
        for (i, name) in names.iter().enumerate() {
            for k in 0..per_bucket {
                let ts = Timestamp::from_secs(hour + ((e * per_bucket + k) % 3600) as i64);
                b.push_reading(name.clone(), ts, (i % 50 + k) as f64 / 4.0, false, now);
            }
        }
        store.commit(&b.take().0).unwrap();
    }
    let stats = Arc::new(Stats::new(1));
    let forwarder = Forwarder {
        config: UpstreamConfig {
            gateway_id: "bench".into(),
            target,
            password_file: None,
            outbox_max_entries: entries + 1,
            batch_entries: 16,
            retry_delay_max: Duration::from_secs(1),
        },
        password: None,
        tls: None,
        reader: store.reader(),
        outbox: store.outbox(),
        stats: stats.clone(),
        origin: store.reader().created_at().unwrap(),
    };
    let cancel = tokio_util::sync::CancellationToken::new();
    let started = Instant::now();
    let task = tokio::spawn(forwarder.run(cancel.clone()));
    while stats.upstream_entries.load(Ordering::Relaxed) < entries as u64 {
        assert_eq!(
            stats.upstream_errors.load(Ordering::Relaxed),
            0,
            "forwarding failed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = started.elapsed().as_secs_f64();
    cancel.cancel();
    task.await.unwrap();
    let readings = (entries * buckets * per_bucket) as u64;
    (started, took, (entries * buckets) as u64, readings, dir)
}

fn mmm(mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    format!(
        "{:.0} / {:.0} / {:.0}",
        v[0],
        v[v.len() / 2],
        v[v.len() - 1]
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let entries = env_or("BENCH_ENTRIES", 100usize);
    let buckets = env_or("BENCH_BUCKETS", 1000usize);
    let per_bucket = env_or("BENCH_READINGS_PER_BUCKET", 10usize);
    let runs = env_or("BENCH_RUNS", 3usize);
    if std::env::var("BENCH_TARGET").as_deref() == Ok("central") {
        return central_runs(entries, buckets, per_bucket, runs).await;
    }
    println!(
        "forwarding {entries} outbox entries x {buckets} bucket deltas ({per_bucket} readings \
         each) to {}, batch_entries 16, {runs} run(s)",
        std::env::var("BENCH_TARGET").unwrap_or_else(|_| "postgres".into())
    );
    let (mut deltas, mut readings) = (Vec::new(), Vec::new());
    for r in 1..=runs {
        let (took, d, n) = run(entries, buckets, per_bucket, r).await;
        println!(
            "run {r}: {took:.2} s, {:.0} deltas/s, {:.0} readings/s",
            d as f64 / took,
            n as f64 / took
        );
        deltas.push(d as f64 / took);
        readings.push(n as f64 / took);
    }
    println!(
        "deltas/s min/median/max: {}; readings/s: {}",
        mmm(deltas),
        mmm(readings)
    );
}

/// `BENCH_TARGET=central`: each run without and then with claims, and their ratio.
async fn central_runs(entries: usize, buckets: usize, per_bucket: usize, runs: usize) {
    println!(
        "forwarding {entries} outbox entries x {buckets} bucket deltas ({per_bucket} readings \
         each) through Mosquitto into a central bucketd, without and with claims, {runs} run(s)"
    );
    let admin = connect(&admin_conninfo()).await;
    let (mut plain, mut claimed, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for r in 1..=runs {
        let (took, d, n) = run_central(entries, buckets, per_bucket, None).await;
        let db = format!("bucketd_bench_claims_{}_{r}", std::process::id());
        let conninfo = create_db(&admin, &db).await;
        let (took_c, _, _) = run_central(entries, buckets, per_bucket, Some(conninfo)).await;
        admin
            .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
            .await
            .unwrap();
        println!(
            "run {r}: {:.0} deltas/s ({:.0} readings/s) without claims, {:.0} deltas/s with; \
             time with/without {:.2}",
            d as f64 / took,
            n as f64 / took,
            d as f64 / took_c,
            took_c / took
        );
        plain.push(d as f64 / took);
        claimed.push(d as f64 / took_c);
        ratio.push(took_c / took * 100.0);
    }
    println!(
        "central deltas/s min/median/max: without claims {}; with claims {}; time with/without \
         (percent) {}",
        mmm(plain),
        mmm(claimed),
        mmm(ratio)
    );
}
