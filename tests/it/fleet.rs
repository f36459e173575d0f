//! Forwarding to the fleet tier.
//!
//! PostgreSQL: three gateways (the `bucketd`
//! binary, each its own broker session and redb file) forward their bucket deltas into one
//! database; one is killed with `kill -9` while its forwarding transaction is open and is
//! restarted; the SQL table must equal the merged ground truth of all three workloads exactly,
//! every delta applied once.
//!
//! PostgreSQL: `BUCKETD_TEST_POSTGRES` (libpq key=value of a role that may create databases),
//! by default the local server's socket as the current user (`host=/var/run/postgresql
//! user=$USER dbname=postgres`: Debian's peer authentication; the README's test section makes
//! the role). The test creates a database of its own and drops it at the end.
//!
//! MQTT: two gateways forward through an upstream Mosquitto of the test's own to a central
//! bucketd (`format = "delta"`) while that broker is stopped and restarted; and two central
//! instances split the deltas with a shared subscription. The central buckets must equal the
//! merged ground truth exactly.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant, UNIX_EPOCH};

use bucketd::config::Protocol;
use bucketd::store::{BucketDoc, PointDoc, StoreReader};

use crate::cli::{Daemon, write_config};
use crate::ingest::{Workload, stamped_workload};
use crate::support::{
    Broker, Pace, Topics, assert_matches_truth, publish_all, publish_with, raw_config, truth,
    unique,
};

fn admin_conninfo() -> String {
    if let Ok(conninfo) = std::env::var("BUCKETD_TEST_POSTGRES") {
        return conninfo;
    }
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()
        .filter(|u| !u.is_empty())
        // SAFETY: geteuid has no preconditions.
        .or_else(|| (unsafe { libc::geteuid() } == 0).then(|| "root".to_owned()))
        .expect("USER is not set: set it, or BUCKETD_TEST_POSTGRES");
    format!("host=/var/run/postgresql user={user} dbname=postgres")
}

/// libpq key=value for database `name`, as the admin role.
fn conninfo_of(name: &str) -> String {
    let base: Vec<String> = admin_conninfo()
        .split_whitespace()
        .filter(|kv| !kv.starts_with("dbname="))
        .map(str::to_owned)
        .collect();
    format!("{} dbname={name}", base.join(" "))
}

/// A database of the test's own, dropped when this is.
struct TestDb {
    name: String,
    admin: tokio_postgres::Client,
}

async fn connect(conninfo: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot reach PostgreSQL at {conninfo:?} ({e}): start it (the README's test \
                 section) or point BUCKETD_TEST_POSTGRES at one"
            )
        });
    tokio::spawn(conn);
    client
}

impl TestDb {
    async fn create() -> TestDb {
        let admin = connect(&admin_conninfo()).await;
        let name = unique("bucketd_it").replace('-', "_").to_lowercase();
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        TestDb { name, admin }
    }

    /// libpq key=value for the test database.
    fn conninfo(&self) -> String {
        conninfo_of(&self.name)
    }

    async fn drop_it(self) {
        self.admin
            .batch_execute(&format!("DROP DATABASE {} WITH (FORCE)", self.name))
            .await
            .unwrap();
    }
}

struct Gateway {
    id: String,
    db: PathBuf,
    config: PathBuf,
    topics: Topics,
    work: Workload,
    _dir: tempfile::TempDir,
}

fn gateway(broker: &Broker, id: &str, seed: u64, readings: usize, pg: &str) -> Gateway {
    gateway_to(broker, id, seed, readings, |raw| {
        raw.upstream.target = "postgres".into();
        raw.upstream.postgres = pg.to_owned();
    })
}

fn gateway_to(
    broker: &Broker,
    id: &str,
    seed: u64,
    readings: usize,
    tweak: impl FnOnce(&mut bucketd::config::RawConfig),
) -> Gateway {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let mut raw = raw_config(broker, Protocol::V5, &db, &topics);
    // Many commits, and few entries per upstream transaction: many transactions to interrupt.
    raw.batch.flush_interval = Duration::from_millis(20);
    raw.upstream.gateway_id = id.to_owned();
    raw.upstream.batch_entries = 4;
    raw.upstream.retry_delay_max = Duration::from_millis(500);
    tweak(&mut raw);
    let config = write_config(dir.path(), &raw);
    Gateway {
        id: id.to_owned(),
        db,
        config,
        work: stamped_workload(&topics, seed, readings),
        topics,
        _dir: dir,
    }
}

/// The gateway's rows in PostgreSQL, as bucket documents under the gateway's own series names.
async fn rows_of(pg: &tokio_postgres::Client, gateway: &str) -> Vec<BucketDoc> {
    let rows = pg
        .query(
            "SELECT series, start, width_secs, count, sum, sum_comp, min, max, first_ts_ns,
                    first_value, last_ts_ns, last_value, mean, m2, sketch, sensor, metric
             FROM bucketd_buckets WHERE gateway_id = $1",
            &[&gateway],
        )
        .await
        .unwrap();
    rows.iter()
        .map(|r| {
            let series: String = r.get(0);
            let local = series
                .strip_prefix(&format!("{gateway}:"))
                .expect("series are prefixed by the gateway id")
                .to_owned();
            let start: std::time::SystemTime = r.get(1);
            let start = start.duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
            let width: i32 = r.get(2);
            BucketDoc {
                schema_version: bucketd::store::SCHEMA_VERSION,
                series: local,
                sensor: r.get(15),
                metric: r.get(16),
                start,
                end: start + i64::from(width),
                count: r.get(3),
                sum: r.get(4),
                sum_comp: r.get(5),
                min: r.get(6),
                max: r.get(7),
                first: PointDoc {
                    ts: r.get(8),
                    value: r.get(9),
                },
                last: PointDoc {
                    ts: r.get(10),
                    value: r.get(11),
                },
                mean: r.get(12),
                m2: r.get(13),
                pages: 0,
                sketch: r.get(14),
            }
        })
        .collect()
}

async fn pg_count(pg: &tokio_postgres::Client, gateway: &str) -> i64 {
    pg.query_one(
        "SELECT COALESCE(SUM(count), 0)::bigint FROM bucketd_buckets WHERE gateway_id = $1",
        &[&gateway],
    )
    .await
    .map(|r| r.get(0))
    .unwrap_or(0) // the tables appear with the first gateway's connection
}

/// Waits until PostgreSQL holds at least `want` readings of `gateway`.
async fn until_forwarded(pg: &tokio_postgres::Client, gateway: &str, want: i64) {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let have = pg_count(pg, gateway).await;
        if have >= want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{gateway}: {have} of {want} readings forwarded after 90 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts a gateway again; returns it and its HTTP address once it is subscribed.
fn restart(config: &std::path::Path) -> (Daemon, String) {
    let daemon = Daemon::start(config);
    let lines = daemon.wait_for_line("saying it is subscribed", |l| {
        l.contains("Subscribed to every") || l.contains("kept our session")
    });
    let addr = crate::security::http_addr(&lines);
    (daemon, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_forward_exactly_once_through_a_kill_9_mid_transaction() {
    let broker = Broker::hermetic();
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let pg = connect(&conninfo).await;
    let gateways = [
        gateway(&broker, "gw-a", 0xF1EE7, 1200, &conninfo),
        gateway(&broker, "gw-b", 0xF1EE8, 2500, &conninfo),
        gateway(&broker, "gw-c", 0xF1EE9, 600, &conninfo),
    ];
    let mut daemons: Vec<Option<Daemon>> = gateways
        .iter()
        .map(|g| {
            let d = Daemon::start(&g.config);
            d.wait_for_line("saying it subscribed", |l| {
                l.contains("Subscribed to every")
            });
            Some(d)
        })
        .collect();

    // gw-a's first workload, forwarded completely; the others stream meanwhile.
    let a = &gateways[0];
    publish_all(&broker, &a.work.messages, 1).await;
    for g in &gateways[1..] {
        publish_all(&broker, &g.work.messages, 1).await;
    }
    until_forwarded(&pg, &a.id, a.work.readings.len() as i64).await;
    // Killed right after forwarding: its outbox still holds entries PostgreSQL has applied
    // (they are trimmed at the next commit), and the restarted forwarder sends them again.
    // PostgreSQL must skip them: the count stays where it is.
    let (status, _) = daemons[0].take().unwrap().kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    let (restarted, addr) = restart(&a.config);
    daemons[0] = Some(restarted);
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(&addr, "bucketd_upstream_forwarded_entries_total").await == 0.0 {
        assert!(
            Instant::now() < deadline,
            "the restarted gw-a never forwarded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        pg_count(&pg, &a.id).await,
        a.work.readings.len() as i64,
        "entries sent again were applied again"
    );
    // Then hold a lock on every row gw-a has, so that the forwarding transaction of its second
    // workload (the same sensors and hours) stops in the middle, holding the gateway row.
    let second = stamped_workload(&a.topics, 0xF1EEA, 800);
    let mut blocker = connect(&conninfo).await;
    let lock = blocker.transaction().await.unwrap();
    lock.execute(
        "SELECT 1 FROM bucketd_buckets WHERE gateway_id = $1 FOR UPDATE",
        &[&a.id],
    )
    .await
    .unwrap();
    publish_all(&broker, &second.messages, 1).await;
    let application = format!("bucketd {}", a.id);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let waiting = pg
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE application_name = $1 AND wait_event_type = 'Lock'",
                &[&application],
            )
            .await
            .unwrap()
            .get::<_, i64>(0);
        if waiting > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "gw-a's forwarder never blocked on the locked rows"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before_kill = pg_count(&pg, &a.id).await;
    let (status, _) = daemons[0].take().unwrap().kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    // The killed gateway's transaction never commits: releasing the lock lets its backend run
    // on, find the client gone and roll back.
    lock.rollback().await.unwrap();
    drop(blocker);
    assert_eq!(pg_count(&pg, &a.id).await, before_kill);
    daemons[0] = Some(restart(&a.config).0);

    let mut gateways = gateways;
    gateways[0].work.extend(second);
    for g in &gateways {
        until_forwarded(&pg, &g.id, g.work.readings.len() as i64).await;
    }
    // Stop the gateways: every entry left in an outbox must be one PostgreSQL has applied.
    for d in daemons.iter_mut() {
        let (status, _) = d.take().unwrap().terminate();
        assert!(status.success(), "clean exit: {status}");
    }
    for g in &gateways {
        let last_seq: i64 = pg
            .query_one(
                "SELECT last_seq FROM bucketd_gateways WHERE gateway_id = $1",
                &[&g.id],
            )
            .await
            .unwrap()
            .get(0);
        let left = StoreReader::open(&g.db)
            .unwrap()
            .outbox(Some(u64::try_from(last_seq).unwrap()), usize::MAX)
            .unwrap();
        assert!(
            left.is_empty(),
            "{}: {} entries never forwarded",
            g.id,
            left.len()
        );
        // Exactly the ground truth: every field of every bucket, quantiles included. A delta
        // applied twice would show in the counts.
        let rows = rows_of(&pg, &g.id).await;
        let want = truth(&g.work.readings, 3600);
        assert_eq!(
            rows.iter().map(|d| d.count).sum::<i64>(),
            g.work.readings.len() as i64,
            "{}: readings in PostgreSQL",
            g.id
        );
        assert_eq!(rows.len(), want.len(), "{}: buckets", g.id);
        assert_matches_truth(&rows, &want);
        // And the same as the gateway's own buckets.
        let local: BTreeMap<(String, i64), i64> = StoreReader::open(&g.db)
            .unwrap()
            .buckets(None, i64::MIN, i64::MAX)
            .unwrap()
            .into_iter()
            .map(|d| ((d.series, d.start), d.count))
            .collect();
        let upstream: BTreeMap<(String, i64), i64> = rows
            .into_iter()
            .map(|d| ((d.series, d.start), d.count))
            .collect();
        assert_eq!(
            upstream, local,
            "{}: PostgreSQL vs the gateway's buckets",
            g.id
        );
    }
    drop(pg);
    testdb.drop_it().await;
}

/// A gateway whose database was replaced (a new SD card, same `gateway_id`) numbers its outbox
/// from the start again: PostgreSQL must apply those entries, not take them for ones it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_with_a_replaced_database_is_applied_from_its_start() {
    let broker = Broker::hermetic();
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let pg = connect(&conninfo).await;
    let first = gateway(&broker, "gw-new-card", 0xCA4D, 800, &conninfo);
    let (daemon, _) = restart(&first.config);
    publish_all(&broker, &first.work.messages, 1).await;
    let n1 = first.work.readings.len() as i64;
    until_forwarded(&pg, &first.id, n1).await;
    assert!(daemon.terminate().0.success());
    let second = gateway(&broker, "gw-new-card", 0xCA4E, 300, &conninfo);
    let (daemon, _) = restart(&second.config);
    publish_all(&broker, &second.work.messages, 1).await;
    let n2 = second.work.readings.len() as i64;
    until_forwarded(&pg, &second.id, n1 + n2).await;
    let (status, lines) = daemon.terminate();
    assert!(status.success());
    assert!(
        lines
            .iter()
            .any(|l| l.contains("deltas from another database")),
        "the gateway says PostgreSQL knew another database under its id"
    );
    let rows = rows_of(&pg, &first.id).await;
    let mut readings = first.work.readings.clone();
    readings.extend(second.work.readings.iter().cloned());
    assert_eq!(rows.iter().map(|d| d.count).sum::<i64>(), n1 + n2);
    assert_matches_truth(&rows, &truth(&readings, 3600));
    drop(pg);
    testdb.drop_it().await;
}

// ---- Over MQTT, to central bucketd instances. ---------------------------------------------

use crate::own_mosquitto::OwnMosquitto;

/// `metric` (summed over its label sets) of the daemon at `addr`.
async fn metric(addr: &str, name: &str) -> f64 {
    let (status, body) = crate::api::http("GET", format!("http://{addr}/metrics")).await;
    assert_eq!(status, 200);
    crate::prom::metric(&body, name)
}

/// Waits until `cond` holds for the metric values it reads.
async fn until_metric(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !cond().await {
        assert!(Instant::now() < deadline, "{what} within 90 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Central {
    daemon: Daemon,
    addr: String,
    db: PathBuf,
    config: PathBuf,
    _dir: tempfile::TempDir,
}

/// A central bucketd on the upstream broker, merging deltas from `filter`.
fn central(upstream: &OwnMosquitto, filter: &str) -> Central {
    central_with(upstream, filter, |_| {})
}

fn central_with(
    upstream: &OwnMosquitto,
    filter: &str,
    tweak: impl FnOnce(&mut bucketd::config::RawConfig),
) -> Central {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("central.redb");
    let mut raw = bucketd::config::RawConfig::load(None, Vec::new()).unwrap();
    raw.mqtt.host = "127.0.0.1".into();
    raw.mqtt.port = upstream.port;
    raw.mqtt.protocol = Protocol::V5;
    raw.mqtt.client_id = unique("central");
    raw.mqtt.reconnect_delay_min = Duration::from_millis(100);
    raw.mqtt.reconnect_delay_max = Duration::from_millis(500);
    raw.store.path = db.clone();
    raw.http.bind = "127.0.0.1:0".into();
    raw.batch.flush_interval = Duration::from_millis(50);
    raw.subscriptions = vec![bucketd::config::RawSubscription {
        filter: filter.to_owned(),
        template: "bucketd/+/deltas".into(),
        format: bucketd::decode::Format::Delta,
        qos: 1,
        timestamp_field: None,
        timestamp_unit: Default::default(),
        sensor_field: None,
        store_raw: false,
    }];
    tweak(&mut raw);
    let config = write_config(dir.path(), &raw);
    let (daemon, addr) = restart(&config);
    Central {
        daemon,
        addr,
        db,
        config,
        _dir: dir,
    }
}

fn mqtt_gateway(broker: &Broker, upstream: &OwnMosquitto, id: &str, seed: u64) -> Gateway {
    mqtt_gateway_with(broker, upstream, id, seed, |_| {})
}

fn mqtt_gateway_with(
    broker: &Broker,
    upstream: &OwnMosquitto,
    id: &str,
    seed: u64,
    tweak: impl FnOnce(&mut bucketd::config::RawConfig),
) -> Gateway {
    gateway_to(broker, id, seed, 1000, |raw| {
        raw.upstream.target = "mqtt".into();
        raw.upstream.mqtt_host = "127.0.0.1".into();
        raw.upstream.mqtt_port = upstream.port;
        tweak(raw);
    })
}

/// Every central's buckets merged per (series, start): what the fleet holds.
fn merged(centrals: &[PathBuf]) -> Vec<BucketDoc> {
    let mut by_key: BTreeMap<(String, i64), BucketDoc> = BTreeMap::new();
    for db in centrals {
        for d in StoreReader::open(db)
            .unwrap()
            .buckets(None, i64::MIN, i64::MAX)
            .unwrap()
        {
            match by_key.get_mut(&(d.series.clone(), d.start)) {
                Some(have) => {
                    let mut s = have.summary();
                    s.merge(&d.summary());
                    let fresh = BucketDoc::new(&have.series, have.start, have.end - have.start, &s);
                    *have = fresh;
                }
                None => {
                    by_key.insert((d.series.clone(), d.start), d);
                }
            }
        }
    }
    by_key.into_values().collect()
}

/// The gateways' ground truth under the central's series names (`<gateway_id>:<series>`).
fn fleet_truth(
    gateways: &[(&str, &Workload)],
) -> BTreeMap<crate::support::TruthKey, crate::support::Truth> {
    let mut readings = Vec::new();
    for (id, work) in gateways {
        for r in &work.readings {
            let mut r = r.clone();
            r.series = format!("{id}:{}", r.series);
            readings.push(r);
        }
    }
    truth(&readings, 3600)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_forward_over_mqtt_through_an_upstream_restart() {
    let broker = Broker::hermetic();
    let mut upstream = OwnMosquitto::start(true, "");
    let central = central(&upstream, "bucketd/+/deltas");
    let mut gateways = [
        mqtt_gateway(&broker, &upstream, "gw-m1", 0xDE17A),
        mqtt_gateway(&broker, &upstream, "gw-m2", 0xDE17B),
    ];
    let mut addrs: Vec<(Daemon, String)> = gateways.iter().map(|g| restart(&g.config)).collect();
    for g in &gateways {
        publish_all(&broker, &g.work.messages, 1).await;
    }
    let first: i64 = gateways.iter().map(|g| g.work.readings.len() as i64).sum();
    until_metric("the central has the first workloads", async || {
        metric(&central.addr, "bucketd_readings_ingested_total").await >= first as f64
    })
    .await;
    // gw-m1 killed with everything forwarded but its outbox not yet trimmed (that happens at
    // its next commit): restarted, it publishes those entries again, and the central must
    // recognise every one of them.
    let (status, _) = addrs.remove(0).0.kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    addrs.insert(0, restart(&gateways[0].config));
    until_metric("the restarted gw-m1 sent its entries again", async || {
        metric(&addrs[0].1, "bucketd_upstream_forwarded_entries_total").await >= 1.0
    })
    .await;
    until_metric("the central saw them again", async || {
        metric(&central.addr, "bucketd_duplicates_total").await >= 1.0
    })
    .await;
    assert_eq!(
        metric(&central.addr, "bucketd_readings_ingested_total").await,
        first as f64,
        "entries sent again were counted again"
    );

    // The upstream broker goes away; the gateways go on ingesting and keep their deltas.
    upstream.down();
    let seconds: Vec<Workload> = gateways
        .iter()
        .enumerate()
        .map(|(i, g)| stamped_workload(&g.topics, 0xDE17C + i as u64, 700))
        .collect();
    let mut before = Vec::new();
    for (_, addr) in &addrs {
        before.push(metric(addr, "bucketd_readings_ingested_total").await);
    }
    for w in &seconds {
        publish_all(&broker, &w.messages, 1).await;
    }
    for ((w, (_, addr)), before) in seconds.iter().zip(&addrs).zip(before) {
        let want = before + w.readings.len() as f64;
        until_metric("the gateway committed its second workload", async || {
            metric(addr, "bucketd_readings_ingested_total").await >= want
        })
        .await;
        until_metric("the gateway noticed the upstream is gone", async || {
            metric(addr, "bucketd_upstream_errors_total").await >= 1.0
        })
        .await;
    }
    upstream.up();
    for (g, w) in gateways.iter_mut().zip(seconds) {
        g.work.extend(w);
    }
    let total: i64 = gateways.iter().map(|g| g.work.readings.len() as i64).sum();
    until_metric("the central has every reading", async || {
        metric(&central.addr, "bucketd_readings_ingested_total").await >= total as f64
    })
    .await;
    // The central's query API answers for a gateway's series.
    let series = format!("{}:{}", gateways[1].id, gateways[1].work.readings[0].series);
    let want: i64 = gateways[1]
        .work
        .readings
        .iter()
        .filter(|r| format!("{}:{}", gateways[1].id, r.series) == series)
        .count() as i64;
    let now = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let (status, body) = crate::api::http(
        "GET",
        format!(
            "http://{}/api/v1/buckets?series={series}&from={}&to={}",
            central.addr,
            now - 6 * 3600,
            now + 3600
        ),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    let counted: i64 = answer["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["count"].as_i64().unwrap())
        .sum();
    assert_eq!(counted, want, "{series} through the central's API");
    for (d, _) in addrs {
        assert!(d.terminate().0.success());
    }
    assert!(central.daemon.terminate().0.success());
    let docs = merged(std::slice::from_ref(&central.db));
    assert_eq!(
        docs.iter().map(|d| d.count).sum::<i64>(),
        total,
        "applied once"
    );
    let want = fleet_truth(&[
        (&gateways[0].id, &gateways[0].work),
        (&gateways[1].id, &gateways[1].work),
    ]);
    assert_eq!(docs.len(), want.len());
    assert_matches_truth(&docs, &want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_central_instances_share_the_deltas_and_together_hold_the_totals() {
    let broker = Broker::hermetic();
    let upstream = OwnMosquitto::start(false, "");
    let centrals = [
        central(&upstream, "$share/central/bucketd/+/deltas"),
        central(&upstream, "$share/central/bucketd/+/deltas"),
    ];
    let gateways = [
        mqtt_gateway(&broker, &upstream, "gw-s1", 0x5A1),
        mqtt_gateway(&broker, &upstream, "gw-s2", 0x5A2),
    ];
    let daemons: Vec<(Daemon, String)> = gateways.iter().map(|g| restart(&g.config)).collect();
    for g in &gateways {
        publish_all(&broker, &g.work.messages, 1).await;
    }
    let total: i64 = gateways.iter().map(|g| g.work.readings.len() as i64).sum();
    until_metric("the centrals together have every reading", async || {
        metric(&centrals[0].addr, "bucketd_readings_ingested_total").await
            + metric(&centrals[1].addr, "bucketd_readings_ingested_total").await
            >= total as f64
    })
    .await;
    let each = [
        metric(&centrals[0].addr, "bucketd_readings_ingested_total").await,
        metric(&centrals[1].addr, "bucketd_readings_ingested_total").await,
    ];
    assert!(
        each[0] > 0.0 && each[1] > 0.0,
        "both centrals took a share: {each:?}"
    );
    for (d, _) in daemons {
        assert!(d.terminate().0.success());
    }
    let mut dbs = Vec::new();
    let mut dirs = Vec::new();
    for c in centrals {
        assert!(c.daemon.terminate().0.success());
        dbs.push(c.db);
        dirs.push(c._dir);
    }
    let docs = merged(&dbs);
    assert_eq!(docs.iter().map(|d| d.count).sum::<i64>(), total);
    let want = fleet_truth(&[
        (&gateways[0].id, &gateways[0].work),
        (&gateways[1].id, &gateways[1].work),
    ]);
    assert_matches_truth(&docs, &want);
}

/// The upstream Mosquitto, for the test's own publishers.
fn as_broker(upstream: &OwnMosquitto) -> Broker {
    Broker {
        name: "upstream",
        host: "127.0.0.1".into(),
        v311_port: upstream.port,
        v5_port: upstream.port,
        sets_dup: true,
    }
}

/// Every message published on the upstream's delta topics, as a resend would repeat it.
async fn record_deltas(
    upstream: &OwnMosquitto,
) -> (
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::Mutex<Vec<(String, Vec<u8>)>>>,
) {
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
    let mut opts = MqttOptions::new(unique("spy"), "127.0.0.1", upstream.port);
    opts.set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut events) = AsyncClient::new(opts, 100);
    client
        .subscribe("bucketd/+/deltas", QoS::AtLeastOnce)
        .await
        .unwrap();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(10), events.poll()).await;
        if let Event::Incoming(Packet::SubAck(_)) = event.unwrap().unwrap() {
            break;
        }
    }
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let into = seen.clone();
    let task = tokio::spawn(async move {
        let _client = client;
        while let Ok(event) = events.poll().await {
            if let Event::Incoming(Packet::Publish(p)) = event {
                let topic = p.topic.clone();
                into.lock().unwrap().push((topic, p.payload.to_vec()));
            }
        }
    });
    (task, seen)
}

/// The central keeps, per gateway, the last (sequence number, part) it applied, in its redb
/// file with the buckets: a copy is recognised however late it comes, after the central's
/// restart too; a gateway whose database was replaced numbers from the start again, and those
/// entries are new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_central_applies_each_gateway_entry_once_however_late_the_copy() {
    let broker = Broker::hermetic();
    let upstream = OwnMosquitto::start(true, "");
    let central = central(&upstream, "bucketd/+/deltas");
    let (spy, seen) = record_deltas(&upstream).await;
    let first = mqtt_gateway(&broker, &upstream, "gw-r", 0xC0FE);
    let (daemon, _) = restart(&first.config);
    publish_all(&broker, &first.work.messages, 1).await;
    let n1 = first.work.readings.len() as f64;
    until_metric("the central has the first workload", async || {
        metric(&central.addr, "bucketd_readings_ingested_total").await >= n1
    })
    .await;
    assert!(daemon.terminate().0.success());

    // Every message again, after the central restarted (its memory is gone; the copies are
    // far older than any window of recent messages).
    assert!(central.daemon.terminate().0.success());
    let (daemon, addr) = restart(&central.config);
    let copies: Vec<(String, Vec<u8>)> = seen.lock().unwrap().clone();
    assert!(copies.len() >= 2, "{}", copies.len());
    let upstream_broker = as_broker(&upstream);
    publish_all(&upstream_broker, &copies, 1).await;
    until_metric("the central saw every copy", async || {
        metric(&addr, "bucketd_duplicates_total").await >= copies.len() as f64
    })
    .await;
    assert_eq!(
        metric(&addr, "bucketd_readings_ingested_total").await,
        0.0,
        "copies were applied again"
    );

    // The gateway's database replaced: a new file numbers its entries from the start.
    let second = mqtt_gateway(&broker, &upstream, "gw-r", 0xC0FF);
    let (gw, _) = restart(&second.config);
    publish_all(&broker, &second.work.messages, 1).await;
    let n2 = second.work.readings.len() as f64;
    until_metric(
        "the central has the replaced gateway's workload",
        async || metric(&addr, "bucketd_readings_ingested_total").await >= n2,
    )
    .await;
    assert!(gw.terminate().0.success());
    let (status, lines) = daemon.terminate();
    assert!(status.success());
    assert!(
        lines
            .iter()
            .any(|l| l.contains("now come from another database")),
        "the central says the gateway's database changed"
    );
    spy.abort();
    let docs = merged(std::slice::from_ref(&central.db));
    let want = fleet_truth(&[("gw-r", &first.work), ("gw-r", &second.work)]);
    assert_eq!(docs.iter().map(|d| d.count).sum::<i64>(), (n1 + n2) as i64);
    assert_matches_truth(&docs, &want);
}

/// Two central instances on a round-robin shared subscription, claiming each delta message in
/// PostgreSQL: every message the gateways published is published again, twice, so that a copy
/// of each reaches the instance that did not apply the original. None is applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_central_instances_claim_each_delta_message_once() {
    let broker = Broker::hermetic();
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let upstream = OwnMosquitto::start(false, "");
    let claims = |raw: &mut bucketd::config::RawConfig| {
        raw.central.claims_postgres = conninfo.clone();
    };
    let filter = "$share/central/bucketd/+/deltas";
    let centrals = [
        central_with(&upstream, filter, claims),
        central_with(&upstream, filter, claims),
    ];
    let (spy, seen) = record_deltas(&upstream).await;
    let gateways = [
        mqtt_gateway(&broker, &upstream, "gw-c1", 0xC1A1),
        mqtt_gateway(&broker, &upstream, "gw-c2", 0xC1A2),
    ];
    let daemons: Vec<(Daemon, String)> = gateways.iter().map(|g| restart(&g.config)).collect();
    // Paced: many commits, so many delta messages.
    tokio::join!(
        publish_with(&broker, &gateways[0].work.messages, 1, Pace::Rate(500)),
        publish_with(&broker, &gateways[1].work.messages, 1, Pace::Rate(500)),
    );
    let total: i64 = gateways.iter().map(|g| g.work.readings.len() as i64).sum();
    let sum = async |name: &str| {
        metric(&centrals[0].addr, name).await + metric(&centrals[1].addr, name).await
    };
    until_metric("the centrals together have every reading", async || {
        sum("bucketd_readings_ingested_total").await >= total as f64
    })
    .await;
    for (d, _) in daemons {
        assert!(d.terminate().0.success());
    }

    let originals: Vec<(String, Vec<u8>)> = seen.lock().unwrap().clone();
    assert!(originals.len() >= 4, "{} delta messages", originals.len());
    // Twice, each time every copy to one instance, the other one the second time (a
    // rejected message between copies moves the round-robin on): each message's copy reaches
    // the instance that did not apply it.
    let junk = || {
        (
            "bucketd/not-a-gateway/deltas".to_owned(),
            b"moves the round-robin on".to_vec(),
        )
    };
    let mut copies = Vec::new();
    for round in 0..2 {
        if round == 1 {
            copies.push(junk());
        }
        for m in &originals {
            copies.push(m.clone());
            copies.push(junk());
        }
    }
    let upstream_broker = as_broker(&upstream);
    let received = sum("bucketd_messages_received_total").await;
    publish_all(&upstream_broker, &copies, 1).await;
    until_metric("every copy reached a central", async || {
        sum("bucketd_messages_received_total").await >= received + copies.len() as f64
    })
    .await;
    for c in &centrals {
        let (status, body) =
            crate::api::http("POST", format!("http://{}/api/v1/flush", c.addr)).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(
        sum("bucketd_duplicates_total").await,
        2.0 * originals.len() as f64,
        "every copy recognised"
    );
    let elsewhere = sum("bucketd_claimed_elsewhere_total").await;
    assert!(
        elsewhere >= 1.0,
        "no copy reached the instance that did not apply its original"
    );
    assert_eq!(sum("bucketd_readings_ingested_total").await, total as f64);
    assert_eq!(sum("bucketd_claim_errors_total").await, 0.0);
    spy.abort();
    let mut dbs = Vec::new();
    let mut dirs = Vec::new();
    for c in centrals {
        assert!(c.daemon.terminate().0.success());
        dbs.push(c.db);
        dirs.push(c._dir);
    }
    let docs = merged(&dbs);
    assert_eq!(docs.iter().map(|d| d.count).sum::<i64>(), total);
    let want = fleet_truth(&[
        (&gateways[0].id, &gateways[0].work),
        (&gateways[1].id, &gateways[1].work),
    ]);
    assert_matches_truth(&docs, &want);
    // One claim per message, by one of the two instances.
    let pg = connect(&conninfo).await;
    let claimed: i64 = pg
        .query_one("SELECT count(*) FROM bucketd_claims", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(claimed, originals.len() as i64);
    drop(pg);
    testdb.drop_it().await;
}

/// While the claims database cannot be reached, a central applies no delta message (it cannot
/// know whether another instance has), counts the failures, leaves the messages to the broker,
/// and applies them once the database answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_central_waits_for_its_claims_database_and_then_applies_everything() {
    let broker = Broker::hermetic();
    let admin = connect(&admin_conninfo()).await;
    let name = unique("bucketd_claims").replace('-', "_").to_lowercase();
    let conninfo = conninfo_of(&name);
    let upstream = OwnMosquitto::start(false, "");
    let central = central_with(&upstream, "$share/central/bucketd/+/deltas", |raw| {
        raw.central.claims_postgres = conninfo.clone();
    });
    let gateway = mqtt_gateway(&broker, &upstream, "gw-w", 0xC1A3);
    let (daemon, _) = restart(&gateway.config);
    publish_all(&broker, &gateway.work.messages, 1).await;
    until_metric("the central failed to claim", async || {
        metric(&central.addr, "bucketd_claim_errors_total").await >= 2.0
    })
    .await;
    assert_eq!(
        metric(&central.addr, "bucketd_readings_ingested_total").await,
        0.0,
        "applied without a claim"
    );
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let n = gateway.work.readings.len() as f64;
    until_metric("the central applied everything", async || {
        metric(&central.addr, "bucketd_readings_ingested_total").await >= n
    })
    .await;
    assert!(daemon.terminate().0.success());
    let (status, lines) = central.daemon.terminate();
    assert!(status.success());
    assert!(
        lines
            .iter()
            .any(|l| l.contains("Cannot claim a delta message") && l.contains(&name)),
        "the log names the problem"
    );
    let docs = merged(std::slice::from_ref(&central.db));
    assert_matches_truth(&docs, &fleet_truth(&[("gw-w", &gateway.work)]));
    admin
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await
        .unwrap();
}

/// A gateway with narrower buckets than the central (15 minutes into an hour): its deltas fold
/// into the central's buckets exactly. One with wider buckets (2 hours) cannot be split: its
/// deltas are rejected with `bucket_width_mismatch`, counted, and nothing of it is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_central_folds_narrower_gateway_buckets_and_rejects_wider_ones() {
    let broker = Broker::hermetic();
    let upstream = OwnMosquitto::start(false, "");
    let central = central(&upstream, "bucketd/+/deltas");
    let narrow = mqtt_gateway_with(&broker, &upstream, "gw-15m", 0x15, |raw| {
        raw.store.bucket_width = Duration::from_secs(15 * 60);
    });
    let wide = mqtt_gateway_with(&broker, &upstream, "gw-2h", 0x7200, |raw| {
        raw.store.bucket_width = Duration::from_secs(2 * 3600);
    });
    let daemons: Vec<(Daemon, String)> = [&narrow, &wide]
        .iter()
        .map(|g| restart(&g.config))
        .collect();
    for g in [&narrow, &wide] {
        publish_all(&broker, &g.work.messages, 1).await;
    }
    let n = narrow.work.readings.len() as f64;
    until_metric(
        "the central has the narrow gateway's readings",
        async || metric(&central.addr, "bucketd_readings_ingested_total").await >= n,
    )
    .await;
    until_metric("the wide gateway's deltas were rejected", async || {
        metric(
            &central.addr,
            "bucketd_readings_rejected_total{reason=\"bucket_width_mismatch\"}",
        )
        .await
            >= 1.0
    })
    .await;
    for (d, _) in daemons {
        assert!(d.terminate().0.success());
    }
    assert!(central.daemon.terminate().0.success());
    let docs = merged(std::slice::from_ref(&central.db));
    assert!(docs.iter().all(|d| d.series.starts_with("gw-15m:")));
    assert_eq!(docs.iter().map(|d| d.count).sum::<i64>(), n as i64);
    assert_matches_truth(&docs, &fleet_truth(&[("gw-15m", &narrow.work)]));
}

/// A central in a shared group, with claims, killed with `kill -9` while the gateways stream
/// and restarted: what it had claimed but not committed comes back to it from its broker
/// session, and the two instances together hold every reading once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_central_killed_mid_stream_loses_nothing_and_applies_nothing_twice() {
    let broker = Broker::hermetic();
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let upstream = OwnMosquitto::start(false, "");
    let claims = |raw: &mut bucketd::config::RawConfig| {
        raw.central.claims_postgres = conninfo.clone();
    };
    let filter = "$share/central/bucketd/+/deltas";
    let [first, second] = [
        central_with(&upstream, filter, claims),
        central_with(&upstream, filter, claims),
    ];
    let gateways = [
        mqtt_gateway(&broker, &upstream, "gw-k1", 0xC1A5),
        mqtt_gateway(&broker, &upstream, "gw-k2", 0xC1A6),
    ];
    let daemons: Vec<(Daemon, String)> = gateways.iter().map(|g| restart(&g.config)).collect();
    let publishers: Vec<_> = gateways
        .iter()
        .map(|g| {
            let (broker, messages) = (broker.clone(), g.work.messages.clone());
            tokio::spawn(async move { publish_with(&broker, &messages, 1, Pace::Rate(300)).await })
        })
        .collect();
    until_metric("the first central is applying deltas", async || {
        metric(&first.addr, "bucketd_readings_ingested_total").await > 0.0
    })
    .await;
    let (status, _) = first.daemon.kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    // What the killed instance had committed, from its file (opened for writing: after a
    // kill redb repairs it first, as the restarted daemon would).
    let store = bucketd::store::Store::open(&bucketd::store::StoreSettings {
        path: first.db.clone(),
        bucket_width_secs: 3600,
        durability: bucketd::config::Durability::Immediate,
        quick_repair: true,
        cache_bytes: 4 << 20,
        page_capacity: 1000,
        dedup_window: 8192,
        outbox_max_entries: 0,
    })
    .unwrap();
    let before_kill: i64 = store
        .reader()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap()
        .iter()
        .map(|d| d.count)
        .sum();
    drop(store);
    let (restarted, addr) = restart(&first.config);
    for p in publishers {
        p.await.unwrap();
    }
    let total: i64 = gateways.iter().map(|g| g.work.readings.len() as i64).sum();
    until_metric("the centrals together have every reading", async || {
        before_kill as f64
            + metric(&addr, "bucketd_readings_ingested_total").await
            + metric(&second.addr, "bucketd_readings_ingested_total").await
            >= total as f64
    })
    .await;
    for a in [&addr, &second.addr] {
        let (status, body) = crate::api::http("POST", format!("http://{a}/api/v1/flush")).await;
        assert_eq!(status, 200, "{body}");
    }
    for (d, _) in daemons {
        assert!(d.terminate().0.success());
    }
    assert!(restarted.terminate().0.success());
    assert!(second.daemon.terminate().0.success());
    let docs = merged(&[first.db.clone(), second.db.clone()]);
    assert_eq!(
        docs.iter().map(|d| d.count).sum::<i64>(),
        total,
        "once each"
    );
    let want = fleet_truth(&[
        (&gateways[0].id, &gateways[0].work),
        (&gateways[1].id, &gateways[1].work),
    ]);
    assert_matches_truth(&docs, &want);
    drop((first._dir, second._dir));
    testdb.drop_it().await;
}
