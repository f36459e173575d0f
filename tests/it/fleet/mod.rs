//! Forwarding to the fleet tier, one module per target; the helpers they share are here.
//!
//! PostgreSQL ([`postgres`], [`partitions`], [`query_node`]): `BUCKETD_TEST_POSTGRES` (libpq key=value of a role
//! that may create databases), by default the local server's socket as the current user
//! (`host=/var/run/postgresql user=$USER dbname=postgres`: Debian's peer authentication; the
//! README's test section makes the role). Each test creates a database of its own and drops it
//! at the end.
//!
//! MQTT ([`mqtt`]): gateways forward through an upstream Mosquitto of the test's
//! own to central bucketd instances (`format = "delta"`).

#![allow(dead_code)]
// What the target modules take through `use super::*` (a build may leave all of them out).
#![allow(unused_imports)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant, UNIX_EPOCH};

use bucketd::config::Protocol;
use bucketd::doc::{BucketDoc, PointDoc};
use bucketd::store::StoreReader;

use crate::own_mosquitto::OwnMosquitto;
use crate::support::*;

/// The fleet on a Citus cluster (skipped where Citus is not installed).
#[cfg(feature = "postgres")]
mod citus;
/// Gateways to central instances over an upstream broker.
/// A central's whole admission path fuzzed with forged and damaged delta messages.
#[cfg(feature = "central")]
mod fuzz;
#[cfg(feature = "central")]
mod mqtt;
#[cfg(feature = "postgres")]
mod partitions;
/// Gateways to PostgreSQL, exactly once through a `kill -9`.
#[cfg(feature = "postgres")]
mod postgres;
/// `bucketd query-node` over the fleet's PostgreSQL.
#[cfg(feature = "postgres")]
mod query_node;

pub struct Gateway {
    pub id: String,
    pub db: PathBuf,
    pub config: PathBuf,
    pub topics: Topics,
    pub work: Workload,
    pub _dir: tempfile::TempDir,
}

pub fn gateway_to(
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

/// Starts a gateway again; returns it and its HTTP address once it is subscribed.
pub fn restart(config: &std::path::Path) -> (Daemon, String) {
    let daemon = Daemon::start(config);
    let lines = daemon.wait_for_line("saying it is subscribed", |l| {
        l.contains("Subscribed to every") || l.contains("kept our session")
    });
    let addr = crate::support::http_addr(&lines);
    (daemon, addr)
}

/// `metric` (summed over its label sets) of the daemon at `addr`.
pub async fn metric(addr: &str, name: &str) -> f64 {
    let (status, body) = crate::support::http("GET", format!("http://{addr}/metrics")).await;
    assert_eq!(status, 200);
    crate::prom::metric(&body, name)
}

/// Waits until `cond` holds for the metric values it reads.
pub async fn until_metric(what: &str, cond: impl AsyncFnMut() -> bool) {
    eventually_async(Duration::from_secs(90), what, cond).await;
}

pub struct Central {
    pub daemon: Daemon,
    pub addr: String,
    pub db: PathBuf,
    pub config: PathBuf,
    pub _dir: tempfile::TempDir,
}

/// A central bucketd on the upstream broker, merging deltas from `filter`.
pub fn central(upstream: &OwnMosquitto, filter: &str) -> Central {
    central_with(upstream, filter, |_| {})
}

pub fn central_with(
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

pub fn mqtt_gateway(broker: &Broker, upstream: &OwnMosquitto, id: &str, seed: u64) -> Gateway {
    mqtt_gateway_with(broker, upstream, id, seed, |_| {})
}

pub fn mqtt_gateway_with(
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
pub fn merged(centrals: &[PathBuf]) -> Vec<BucketDoc> {
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
pub fn fleet_truth(
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

/// The upstream Mosquitto, for the test's own publishers.
pub fn as_broker(upstream: &OwnMosquitto) -> Broker {
    Broker {
        name: "upstream",
        host: "127.0.0.1".into(),
        v311_port: upstream.port,
        v5_port: upstream.port,
        sets_dup: true,
    }
}

/// Every message published on the upstream's delta topics, as a resend would repeat it.
pub async fn record_deltas(
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

// PostgreSQL helpers, for the PostgreSQL modules.
#[cfg(feature = "postgres")]
mod pg {
    use super::*;

    pub fn admin_conninfo() -> String {
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
    pub fn conninfo_of(name: &str) -> String {
        let base: Vec<String> = admin_conninfo()
            .split_whitespace()
            .filter(|kv| !kv.starts_with("dbname="))
            .map(str::to_owned)
            .collect();
        format!("{} dbname={name}", base.join(" "))
    }

    /// A database of the test's own, dropped when this is.
    pub struct TestDb {
        name: String,
        admin: tokio_postgres::Client,
    }

    pub async fn connect(conninfo: &str) -> tokio_postgres::Client {
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
        pub async fn create() -> TestDb {
            let admin = connect(&admin_conninfo()).await;
            let name = unique("bucketd_it").replace('-', "_").to_lowercase();
            admin
                .batch_execute(&format!("CREATE DATABASE {name}"))
                .await
                .unwrap();
            TestDb { name, admin }
        }

        /// libpq key=value for the test database.
        pub fn conninfo(&self) -> String {
            conninfo_of(&self.name)
        }

        /// [`TestDb::conninfo`], logging in as `user`.
        pub fn conninfo_as(&self, user: &str) -> String {
            let conninfo = self.conninfo();
            let words: Vec<&str> = conninfo
                .split_whitespace()
                .filter(|w| !w.starts_with("user="))
                .collect();
            format!("{} user={user}", words.join(" "))
        }

        /// The name of one of the database's group roles (`deploy/postgres/roles.sql`):
        /// `gateway`, `reader` or `maintainer`.
        pub fn group(&self, kind: &str) -> String {
            format!("{}_{kind}", self.name)
        }

        pub async fn drop_it(self) {
            self.admin
                .batch_execute(&format!("DROP DATABASE {} WITH (FORCE)", self.name))
                .await
                .unwrap();
            // Roles are global to the server: the groups roles.sql made for this database.
            let groups =
                ["gateway", "reader", "maintainer"].map(|k| format!("\"{}\"", self.group(k)));
            self.admin
                .batch_execute(&format!("DROP ROLE IF EXISTS {}", groups.join(", ")))
                .await
                .unwrap();
        }
    }

    /// The gateway's rows in PostgreSQL, as bucket documents under the gateway's own series names.
    pub async fn rows_of(pg: &tokio_postgres::Client, gateway: &str) -> Vec<BucketDoc> {
        let rows = pg
            .query(
                "SELECT series, start, width_secs, count, sum, sum_comp, min, max, first_ts_ns,
                        first_value, last_ts_ns, last_value, mean, m2, sketch, sensor, metric,
                        CASE WHEN inc_count = count THEN inc END
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
                    schema_version: bucketd::doc::SCHEMA_VERSION,
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
                    inc: r.get(17),
                }
            })
            .collect()
    }

    pub async fn pg_count(pg: &tokio_postgres::Client, gateway: &str) -> i64 {
        pg.query_one(
            "SELECT COALESCE(SUM(count), 0)::bigint FROM bucketd_buckets WHERE gateway_id = $1",
            &[&gateway],
        )
        .await
        .map_or(0, |r| r.get(0)) // the tables appear with the first gateway's connection
    }

    /// Waits until PostgreSQL holds at least `want` readings of `gateway`.
    pub async fn until_forwarded(pg: &tokio_postgres::Client, gateway: &str, want: i64) {
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

    /// Waits until PostgreSQL holds every reading of each of `gateways`, then stops each
    /// daemon, which must exit cleanly.
    pub async fn all_forwarded_then_stopped(
        pg: &tokio_postgres::Client,
        gateways: &[Gateway],
        daemons: &mut [Option<Daemon>],
    ) {
        for g in gateways {
            until_forwarded(pg, &g.id, g.work.readings.len() as i64).await;
        }
        for d in daemons {
            let (status, _) = d.take().unwrap().terminate();
            assert!(status.success(), "clean exit: {status}");
        }
    }

    /// Each of `gateways` started, once it says it subscribed.
    pub fn start_subscribed(gateways: &[Gateway]) -> Vec<Option<Daemon>> {
        gateways
            .iter()
            .map(|g| {
                let d = Daemon::start(&g.config);
                d.wait_for_line("saying it subscribed", |l| {
                    l.contains("Subscribed to every")
                });
                Some(d)
            })
            .collect()
    }

    pub fn gateway(broker: &Broker, id: &str, seed: u64, readings: usize, pg: &str) -> Gateway {
        gateway_to(broker, id, seed, readings, |raw| {
            raw.upstream.target = "postgres".into();
            raw.upstream.postgres = pg.to_owned();
        })
    }
}
#[cfg(feature = "postgres")]
use pg::*;
