//! Forwarding throughput to PostgreSQL (docs/FLEET.md): `BENCH_GATEWAYS` gateways at once
//! (default `1,16,64`), each an outbox of `BENCH_ENTRIES` commits (default 100), each touching
//! `BENCH_BUCKETS` buckets (default 1,000 series, one hour) with `BENCH_READINGS_PER_BUCKET`
//! readings each (default 10), shipped by the real forwarder into one fresh database; prints
//! deltas/s, rows written/s and readings represented per second, PostgreSQL's CPU (every
//! `postgres` process, from /proc) and WAL bytes (`pg_current_wal_lsn`) per delta,
//! min/median/max over `BENCH_RUNS` (default 3), and checks the table's total count.
//! `BENCH_SPREAD=1` puts each entry in an hour of its own, so that no two deltas of a batch
//! merge into one row (the worst case).
//!
//! `cargo bench --bench forward`. PostgreSQL: `BENCH_POSTGRES` (libpq key=value of a role that
//! may create databases), by default the local socket as the current user. `BENCH_DATABASE`:
//! a database of that server made beforehand, emptied before each run instead of a fresh one
//! (a Citus coordinator's: docs/FLEET.md, "Citus"; the WAL figures are then the coordinator's
//! alone, the CPU every `postgres` process's on the machine, workers' too).
//! `BENCH_TARGET=mqtt cargo bench --bench forward`: to a Mosquitto the benchmark starts, where a
//! subscriber decodes every delta message and checks the readings they carry.
//! `BENCH_TARGET=central cargo bench --bench forward`: through that Mosquitto into a central
//! bucketd (in this process, `format = "delta"`), timed until the central has committed every
//! reading.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[path = "shared/pg.rs"]
mod pg;
use pg::{admin_conninfo, connect, env_or};

use bucketd::batcher::Batcher;
use bucketd::config::{Durability, UpstreamConfig, UpstreamTarget};
use bucketd::fleet::forwarder::Forwarder;
use bucketd::reading::Timestamp;
use bucketd::stats::Stats;
use bucketd::store::{Store, StoreSettings};

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
    pg::conninfo_of(name)
}

/// One run to MQTT: fills an outbox, forwards it, returns (seconds, deltas, readings).
async fn run(entries: usize, buckets: usize, per_bucket: usize) -> (f64, u64, u64) {
    run_mqtt(entries, buckets, per_bucket).await
}

/// What `gateways` forwarders did at once into one PostgreSQL.
struct PgRun {
    took: f64,
    deltas: u64,
    readings: u64,
    /// Rows written: the batch's deltas merged per bucket.
    rows: u64,
    wal_bytes: f64,
    pg_cpu_secs: f64,
}

/// PostgreSQL's current WAL position.
async fn wal_lsn(c: &tokio_postgres::Client) -> String {
    c.query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0)
}

/// CPU seconds used so far by every process named `postgres` (the server and its backends).
fn postgres_cpu_secs() -> f64 {
    let mut ticks = 0u64;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        if !head.ends_with("(postgres") {
            continue;
        }
        // Fields after the name: state is 3rd overall; utime and stime are the 14th and 15th.
        let fields: Vec<&str> = rest.split_whitespace().collect();
        ticks += fields
            .get(11)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0);
        ticks += fields
            .get(12)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0);
    }
    // SAFETY: sysconf has no preconditions.
    ticks as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// `gateways` gateways, each with its own outbox of `entries` commits over `buckets` series,
/// forwarded at once into one fresh database. `spread`: each entry in an hour of its own, so no
/// two deltas of a batch share a row (the worst case for the batch's merge).
async fn run_pg(
    gateways: usize,
    entries: usize,
    buckets: usize,
    per_bucket: usize,
    spread: bool,
    run: usize,
) -> PgRun {
    let admin = connect(&admin_conninfo()).await;
    // `BENCH_DATABASE`: a database made beforehand (a Citus cluster's, whose every node needs
    // the extension), its tables emptied before each run; else a fresh database each run.
    let fixed = std::env::var("BENCH_DATABASE").ok();
    let db = fixed
        .clone()
        .unwrap_or_else(|| format!("bucketd_bench_{}_{run}_{gateways}", std::process::id()));
    let conninfo = match &fixed {
        Some(db) => {
            let conninfo = pg::conninfo_of(db);
            let pg = connect(&conninfo).await;
            // The tables may not be made yet (the first gateway makes them).
            let _ = pg
                .batch_execute("TRUNCATE bucketd_buckets, bucketd_gateways")
                .await;
            conninfo
        }
        None => create_db(&admin, &db).await,
    };
    let outboxes: Vec<_> = (0..gateways)
        .map(|_| fill(entries, buckets, per_bucket, spread))
        .collect();
    let wal_start = wal_lsn(&admin).await;
    let cpu_start = postgres_cpu_secs();
    let cancel = tokio_util::sync::CancellationToken::new();
    let mut running = Vec::new();
    let started = Instant::now();
    for (g, (store, _)) in outboxes.iter().enumerate() {
        let target = UpstreamTarget::Postgres {
            conninfo: conninfo.clone(),
        };
        let (forwarder, stats) = forwarder_of(store, &format!("bench-{g}"), target, entries);
        running.push((tokio::spawn(forwarder.run(cancel.clone())), stats));
    }
    for (_, stats) in &running {
        wait_shipped(stats, entries).await;
    }
    let took = started.elapsed().as_secs_f64();
    let pg_cpu_secs = postgres_cpu_secs() - cpu_start;
    let wal_end = wal_lsn(&admin).await;
    cancel.cancel();
    for (task, _) in running {
        task.await.unwrap();
    }
    let wal_bytes: f64 = admin
        .query_one(
            "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::float8",
            &[&wal_end, &wal_start],
        )
        .await
        .unwrap()
        .get(0);
    let pg = connect(&conninfo).await;
    let total: i64 = pg
        .query_one("SELECT SUM(count)::bigint FROM bucketd_buckets", &[])
        .await
        .unwrap()
        .get(0);
    let readings = (gateways * entries * buckets * per_bucket) as u64;
    assert_eq!(total as u64, readings, "readings in PostgreSQL");
    drop(pg);
    if fixed.is_none() {
        admin
            .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
            .await
            .unwrap();
    }
    drop(outboxes);
    // Rows written: each batch of 16 entries writes each of its buckets once.
    let batches = entries.div_ceil(BATCH_ENTRIES);
    let rows_written = if spread {
        (gateways * entries * buckets) as u64
    } else {
        (gateways * batches * buckets) as u64
    };
    PgRun {
        took,
        deltas: (gateways * entries * buckets) as u64,
        readings,
        rows: rows_written,
        wal_bytes,
        pg_cpu_secs,
    }
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

/// Through a Mosquitto into a central bucketd; returns (seconds until the central committed
/// every reading, deltas, readings).
async fn run_central(entries: usize, buckets: usize, per_bucket: usize) -> (f64, u64, u64) {
    let broker = own_mosquitto::OwnMosquitto::start(false, "");
    let dir = tempfile::tempdir().unwrap();
    let mut raw = bucketd::config::RawConfig::load(None, Vec::new()).unwrap();
    raw.mqtt.host = "127.0.0.1".into();
    raw.mqtt.port = broker.port;
    raw.mqtt.client_id = format!("bench-central-{}", std::process::id());
    raw.store.path = dir.path().join("central.redb");
    raw.http.bind = "127.0.0.1:0".into();
    raw.batch.flush_interval = Duration::from_millis(50);
    raw.subscriptions = vec![bucketd::config::RawSubscription {
        filter: "bucketd/+/deltas".into(),
        template: Some("bucketd/{gateway}/deltas".into()),
        format: bucketd::decode::Format::Delta,
        qos: 1,
        timestamp_field: None,
        timestamp_unit: Default::default(),
        sensor_field: None,
        root: None,
        fields: None,
        rebirth_interval: None,
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

/// Entries per forwarding batch in these runs.
const BATCH_ENTRIES: usize = 16;

fn upstream(gateway_id: &str, target: UpstreamTarget, entries: usize) -> UpstreamConfig {
    UpstreamConfig {
        gateway_id: gateway_id.into(),
        target,
        password_file: None,
        outbox_max_entries: entries + 1,
        batch_entries: BATCH_ENTRIES,
        retry_delay_max: Duration::from_secs(1),
        postgres_retention: None,
    }
}

/// A store whose outbox holds `entries` commits, each of `per_bucket` readings in each of
/// `buckets` series: in the current hour, or with `spread` each entry an hour before the last.
fn fill(
    entries: usize,
    buckets: usize,
    per_bucket: usize,
    spread: bool,
) -> (Store, tempfile::TempDir) {
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
        let base = if spread { hour - e as i64 * 3600 } else { hour };
        for (i, name) in names.iter().enumerate() {
            for k in 0..per_bucket {
                let ts = Timestamp::from_secs(base + ((e * per_bucket + k) % 3600) as i64);
                b.push_reading(name.clone(), ts, (i % 50 + k) as f64 / 4.0, false, now);
            }
        }
        store.commit(&b.take().0).unwrap();
    }
    (store, dir)
}

/// A forwarder of `store`'s outbox as `gateway_id`, and its counters.
fn forwarder_of(
    store: &Store,
    gateway_id: &str,
    target: UpstreamTarget,
    entries: usize,
) -> (Forwarder, Arc<Stats>) {
    let stats = Arc::new(Stats::new(1));
    let forwarder = Forwarder {
        config: upstream(gateway_id, target, entries),
        password: None,
        tls: None,
        reader: store.reader(),
        outbox: store.outbox(),
        stats: stats.clone(),
        origin: store.reader().created_at().unwrap(),
    };
    (forwarder, stats)
}

/// Waits until the forwarder has shipped `entries` entries, failing on any error.
async fn wait_shipped(stats: &Stats, entries: usize) {
    while stats.upstream_entries.load(Ordering::Relaxed) < entries as u64 {
        assert_eq!(
            stats.upstream_errors.load(Ordering::Relaxed),
            0,
            "forwarding failed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Fills an outbox and forwards it to `target`; returns (when forwarding started, seconds until
/// every entry was acknowledged, deltas, readings, the store's directory).
async fn forward(
    entries: usize,
    buckets: usize,
    per_bucket: usize,
    target: UpstreamTarget,
) -> (Instant, f64, u64, u64, tempfile::TempDir) {
    let (store, dir) = fill(entries, buckets, per_bucket, false);
    let (forwarder, stats) = forwarder_of(&store, "bench", target, entries);
    let cancel = tokio_util::sync::CancellationToken::new();
    let started = Instant::now();
    let task = tokio::spawn(forwarder.run(cancel.clone()));
    wait_shipped(&stats, entries).await;
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
    if std::env::var("BENCH_TARGET").as_deref() == Ok("mqtt") {
        println!(
            "forwarding {entries} outbox entries x {buckets} bucket deltas ({per_bucket} \
             readings each) to MQTT, batch_entries {BATCH_ENTRIES}, {runs} run(s)"
        );
        let (mut deltas, mut readings) = (Vec::new(), Vec::new());
        for r in 1..=runs {
            let (took, d, n) = run(entries, buckets, per_bucket).await;
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
        return;
    }
    let gateways: Vec<usize> = std::env::var("BENCH_GATEWAYS")
        .unwrap_or_else(|_| "1,16,64".into())
        .split(',')
        .map(|g| {
            g.trim()
                .parse()
                .expect("BENCH_GATEWAYS: numbers, comma-separated")
        })
        .collect();
    let spread = std::env::var("BENCH_SPREAD").as_deref() == Ok("1");
    println!(
        "PostgreSQL: gateways at once, each forwarding {entries} outbox entries x {buckets} \
         bucket deltas ({per_bucket} readings each), batch_entries {BATCH_ENTRIES}, {}, \
         {runs} run(s)",
        if spread {
            "each entry in an hour of its own (no two deltas of a batch share a row)"
        } else {
            "every entry in the same hour (a batch's deltas merge into one row per series)"
        }
    );
    println!(
        "gateways  deltas/s (min/median/max)  rows written/s  readings/s  PG CPU ms per 1k deltas  \
         WAL B/delta  WAL B/row"
    );
    for &g in &gateways {
        let mut results = Vec::new();
        for r in 1..=runs {
            results.push(run_pg(g, entries, buckets, per_bucket, spread, r).await);
        }
        let per = |f: &dyn Fn(&PgRun) -> f64| mmm(results.iter().map(f).collect());
        println!(
            "{g:>8}  {:>25}  {:>14}  {:>10}  {:>22}  {:>11}  {:>9}",
            per(&|x| x.deltas as f64 / x.took),
            per(&|x| x.rows as f64 / x.took),
            per(&|x| x.readings as f64 / x.took),
            per(&|x| x.pg_cpu_secs / x.deltas as f64 * 1e6),
            per(&|x| x.wal_bytes / x.deltas as f64),
            per(&|x| x.wal_bytes / x.rows as f64),
        );
    }
}

/// `BENCH_TARGET=central`: the central's merge rate, each run.
async fn central_runs(entries: usize, buckets: usize, per_bucket: usize, runs: usize) {
    println!(
        "forwarding {entries} outbox entries x {buckets} bucket deltas ({per_bucket} readings \
         each) through Mosquitto into a central bucketd, {runs} run(s)"
    );
    let mut rates = Vec::new();
    for r in 1..=runs {
        let (took, d, n) = run_central(entries, buckets, per_bucket).await;
        println!(
            "run {r}: {:.0} deltas/s ({:.0} readings/s)",
            d as f64 / took,
            n as f64 / took
        );
        rates.push(d as f64 / took);
    }
    println!("central deltas/s min/median/max: {}", mmm(rates));
}
