//! Shared test harness: brokers (an in-process rumqttd, and the external broker named by
//! `BUCKETD_TEST_MQTT`), a QoS 1 publisher that waits for the broker's PUBACKs, daemon configs,
//! `eventually` for polling assertions, and ground-truth bucket computation.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::net::TcpListener;
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bucketd::config::{Config, Protocol, RawConfig, RawSubscription};
use bucketd::store::BucketDoc;

/// A broker the tests can reach.
#[derive(Debug, Clone)]
pub struct Broker {
    pub name: &'static str,
    pub host: String,
    /// Port for MQTT 3.1.1 clients.
    pub v311_port: u16,
    /// Port for MQTT 5 clients (the same as `v311_port` on brokers that speak both on one port).
    pub v5_port: u16,
    /// Whether the broker sets DUP on redeliveries, as MQTT requires (rumqttd 0.20 does not).
    pub sets_dup: bool,
}

impl Broker {
    /// The in-process rumqttd, started once per test binary (it has no shutdown API).
    pub fn hermetic() -> Broker {
        static BROKER: OnceLock<Broker> = OnceLock::new();
        BROKER.get_or_init(start_rumqttd).clone()
    }

    /// The broker named by `BUCKETD_TEST_MQTT=host:port`, if set.
    pub fn external() -> Option<Broker> {
        let addr = std::env::var("BUCKETD_TEST_MQTT").ok()?;
        let (host, port) = addr
            .rsplit_once(':')
            .expect("BUCKETD_TEST_MQTT is host:port");
        let port: u16 = port.parse().expect("BUCKETD_TEST_MQTT port is a number");
        Some(Broker {
            name: "external",
            host: host.to_owned(),
            v311_port: port,
            v5_port: port,
            sets_dup: true,
        })
    }

    pub fn port(&self, protocol: Protocol) -> u16 {
        match protocol {
            Protocol::V5 => self.v5_port,
            Protocol::V311 => self.v311_port,
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding an ephemeral port")
        .port()
}

fn start_rumqttd() -> Broker {
    use rumqttd::{ConnectionSettings, RouterConfig, ServerSettings};
    if let Ok(path) = std::env::var("BUCKETD_TEST_BROKER_LOG") {
        let file = std::fs::File::create(&path).expect("creating the broker log");
        let _ = tracing_subscriber::fmt()
            .with_writer(std::sync::Mutex::new(file))
            .with_ansi(false)
            .with_env_filter("rumqttd=debug")
            .try_init();
    }
    let v4 = free_port();
    let v5 = free_port();
    let server = |name: &str, port: u16| ServerSettings {
        name: name.to_owned(),
        listen: format!("127.0.0.1:{port}").parse().unwrap(),
        tls: None,
        next_connection_delay_ms: 1,
        connections: ConnectionSettings {
            connection_timeout_ms: 60_000,
            max_payload_size: 1 << 20,
            max_inflight_count: 500,
            auth: None,
            external_auth: None,
            dynamic_filters: true,
        },
    };
    let config = rumqttd::Config {
        id: 0,
        router: RouterConfig {
            max_connections: 10_000,
            max_outgoing_packet_count: 200,
            max_segment_size: 100 << 20,
            max_segment_count: 10,
            ..Default::default()
        },
        v4: Some(HashMap::from([("1".to_owned(), server("v4", v4))])),
        v5: Some(HashMap::from([("1".to_owned(), server("v5", v5))])),
        ..Default::default()
    };
    std::thread::spawn(move || {
        rumqttd::Broker::new(config)
            .start()
            .expect("rumqttd starts");
    });
    for port in [v4, v5] {
        eventually_sync(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
    }
    Broker {
        name: "rumqttd",
        host: "127.0.0.1".into(),
        v311_port: v4,
        v5_port: v5,
        sets_dup: false,
    }
}

/// A name unique to this test process and call, for client ids and topic prefixes.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}{}x{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Polls `cond` until it holds; panics with `what` after `timeout`. For conditions that become
/// true through work elsewhere (never a sleep standing in for a wait).
pub async fn eventually(timeout: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn eventually_sync(timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out after {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Topics of one test: `{prefix}/sensors/{sensor}/{metric}` (value) and
/// `{prefix}/devices/{sensor}/telemetry` (json with `ts`).
#[derive(Debug, Clone)]
pub struct Topics {
    pub prefix: String,
}

impl Topics {
    pub fn new() -> Topics {
        Topics {
            prefix: unique("t"),
        }
    }

    pub fn value(&self, sensor: &str, metric: &str) -> String {
        format!("{}/sensors/{sensor}/{metric}", self.prefix)
    }

    pub fn json(&self, sensor: &str) -> String {
        format!("{}/devices/{sensor}/telemetry", self.prefix)
    }

    pub fn subscriptions(&self) -> Vec<RawSubscription> {
        RawSubscription::defaults_under(&self.prefix)
    }
}

/// A daemon config for `broker` with the store at `db` and `topics`' subscriptions.
pub fn raw_config(broker: &Broker, protocol: Protocol, db: &Path, topics: &Topics) -> RawConfig {
    let mut raw = RawConfig::load(None, Vec::new()).expect("defaults load");
    raw.mqtt.host = broker.host.clone();
    raw.mqtt.port = broker.port(protocol);
    raw.mqtt.protocol = protocol;
    raw.mqtt.client_id = format!("bucketd-{}", topics.prefix);
    raw.mqtt.reconnect_delay_min = Duration::from_millis(100);
    raw.mqtt.reconnect_delay_max = Duration::from_secs(1);
    raw.store.path = db.to_owned();
    raw.http.bind = "127.0.0.1:0".into();
    raw.store.cache_size = bytesize::ByteSize::mib(4);
    raw.batch.flush_interval = Duration::from_millis(200);
    raw.subscriptions = topics.subscriptions();
    raw
}

pub fn config(raw: &RawConfig) -> Config {
    Config::try_from(raw.clone()).expect("test config is valid")
}

/// Most messages a paced publisher keeps ahead of the consumer. Mosquitto by default queues at
/// most 1000 QoS 1 messages per subscriber beyond its in-flight window and drops the rest
/// (`max_queued_messages`), so a flat-out publisher can lose messages on a shared test broker
/// through no fault of the daemon.
pub const AHEAD_MAX: u64 = 500;

/// End-of-stream markers for `messages`: one empty payload (rejected as `empty_payload`) on
/// every topic they use. MQTT orders messages per topic only (3.1.1 §4.6 "ordered topic"), and
/// brokers do deliver different topics out of order: rumqttd keeps a log per subscription filter
/// and, after a reconnect, resumes each on its own, so a single marker on a topic of its own can
/// arrive before the rest. Once every marker is rejected, every message before it on its topic
/// has arrived. The caller's workload must contain no empty payloads of its own.
pub fn markers(messages: &[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
    let topics: std::collections::BTreeSet<&String> = messages.iter().map(|m| &m.0).collect();
    topics
        .into_iter()
        .map(|t| (t.clone(), Vec::new()))
        .collect()
}

/// Publishes every message with `qos` and returns once the broker has acknowledged all of them
/// (QoS 1), so they are the broker's responsibility from then on.
pub async fn publish_all(broker: &Broker, messages: &[(String, Vec<u8>)], qos: u8) {
    publish_paced(broker, messages, qos, None).await;
}

/// Like [`publish_all`], but stays at most [`AHEAD_MAX`] messages ahead of what `consumer`
/// has received.
pub async fn publish_paced(
    broker: &Broker,
    messages: &[(String, Vec<u8>)],
    qos: u8,
    consumer: Option<std::sync::Arc<bucketd::stats::Stats>>,
) {
    let pace = consumer.map_or(Pace::Flat, Pace::Consumer);
    publish_with(broker, messages, qos, pace).await;
}

/// How fast a publisher goes.
pub enum Pace {
    Flat,
    /// At most [`AHEAD_MAX`] messages ahead of what this in-process daemon has received.
    Consumer(std::sync::Arc<bucketd::stats::Stats>),
    /// This many messages per second: a device fleet's steady stream. Keeps what a broker
    /// queues while the daemon restarts below the broker's queue limit (Mosquitto's
    /// max_queued_messages is 1000 by default).
    Rate(u32),
}

pub async fn publish_with(broker: &Broker, messages: &[(String, Vec<u8>)], qos: u8, pace: Pace) {
    let consumer = match &pace {
        Pace::Consumer(c) => Some(c.clone()),
        _ => None,
    };
    let rate = match pace {
        Pace::Rate(r) => Some(r),
        _ => None,
    };
    use rumqttc::{AsyncClient, Event, MqttOptions, Outgoing, Packet, QoS};
    let mut opts = MqttOptions::new(unique("pub"), broker.host.clone(), broker.v311_port);
    opts.set_keep_alive(Duration::from_secs(30))
        .set_max_packet_size(1 << 20, 1 << 20)
        .set_inflight(100);
    let (client, mut eventloop) = AsyncClient::new(opts, 1000);
    let qos = rumqttc::qos(qos).unwrap();
    let total = messages.len();
    let messages = messages.to_vec();
    let publisher = tokio::spawn(async move {
        let started = tokio::time::Instant::now();
        let base = consumer
            .as_ref()
            .map_or(0, |c| bucketd::stats::Stats::get(&c.messages_received));
        for (sent, (topic, payload)) in messages.into_iter().enumerate() {
            if let Some(c) = &consumer {
                let ahead = || {
                    sent as u64
                        - (bucketd::stats::Stats::get(&c.messages_received) - base).min(sent as u64)
                };
                while ahead() > AHEAD_MAX {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            if let Some(rate) = rate {
                let due = started + Duration::from_secs_f64(sent as f64 / f64::from(rate));
                tokio::time::sleep_until(due).await;
            }
            client.publish(topic, qos, false, payload).await.unwrap();
        }
        client
    });
    let mut acked = 0;
    let mut sent = 0;
    let deadline = tokio::time::Instant::now()
        + Duration::from_secs(60)
        + rate.map_or(Duration::ZERO, |r| {
            Duration::from_secs_f64(total as f64 / f64::from(r))
        });
    loop {
        let done = match qos {
            QoS::AtMostOnce => sent == total,
            _ => acked == total,
        };
        if done {
            break;
        }
        let event = tokio::time::timeout_at(deadline, eventloop.poll())
            .await
            .expect("publishing took over 60 s")
            .expect("publisher connection failed");
        match event {
            Event::Incoming(Packet::PubAck(_) | Packet::PubComp(_)) => acked += 1,
            Event::Outgoing(Outgoing::Publish(_)) => sent += 1,
            _ => {}
        }
    }
    let client = publisher.await.unwrap();
    client.disconnect().await.unwrap();
    // Drive the event loop until the DISCONNECT is written.
    while let Ok(Ok(event)) = tokio::time::timeout(Duration::from_secs(5), eventloop.poll()).await {
        if matches!(event, Event::Outgoing(Outgoing::Disconnect)) {
            break;
        }
    }
}

/// A small deterministic generator (xorshift), so failures reproduce.
pub struct Rng(u64);

impl Rng {
    /// Distinct seeds give distinct streams (xorshift needs a non-zero state).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A value with a few decimals, sometimes negative or large.
    pub fn value(&mut self) -> f64 {
        let base = (self.below(2_000_001) as f64 - 1_000_000.0) / 1000.0;
        match self.below(20) {
            0 => base * 1e12,
            1 => base * 1e-9,
            _ => base,
        }
    }
}

/// One expected reading: series, timestamp (ns, `None` when the receive time is used), value.
#[derive(Debug, Clone)]
pub struct Expected {
    pub series: String,
    pub ts: Option<i64>,
    pub value: f64,
}

/// The exact aggregates a set of readings must produce.
#[derive(Debug, Clone, PartialEq)]
pub struct Truth {
    pub count: i64,
    pub sum: f64,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
    pub variance: f64,
    pub first: Option<(i64, f64)>,
    pub last: Option<(i64, f64)>,
    /// The values in ascending order, for exact quantiles.
    pub sorted: Vec<f64>,
}

impl Truth {
    /// The exact value of rank `floor(q * (count - 1))`, the rank the sketch estimates.
    pub fn quantile(&self, q: f64) -> f64 {
        self.sorted[(q * (self.sorted.len() - 1) as f64).floor() as usize]
    }
}

/// (series, bucket start); no start for readings stamped with the receive time.
pub type TruthKey = (String, Option<i64>);

/// Ground truth per (series, bucket start) for readings with device timestamps, and per series
/// (all buckets together) for readings stamped with the receive time.
pub fn truth(readings: &[Expected], width_secs: i64) -> BTreeMap<TruthKey, Truth> {
    let mut groups: BTreeMap<TruthKey, Vec<(Option<i64>, f64)>> = BTreeMap::new();
    for r in readings {
        let start =
            r.ts.map(|ts| ts.div_euclid(1_000_000_000).div_euclid(width_secs) * width_secs);
        groups
            .entry((r.series.clone(), start))
            .or_default()
            .push((r.ts, r.value));
    }
    groups
        .into_iter()
        .map(|(key, values)| {
            let n = values.len() as f64;
            // Exact-ish reference: sum in sorted order of magnitude with f64, compared with
            // a relative tolerance by the caller.
            let sum: f64 = values.iter().map(|v| v.1).sum();
            let mean = sum / n;
            let variance = values.iter().map(|v| (v.1 - mean).powi(2)).sum::<f64>() / n;
            let timed: Vec<(i64, f64)> = values
                .iter()
                .filter_map(|(ts, v)| ts.map(|ts| (ts, *v)))
                .collect();
            let order = |a: &(i64, f64), b: &(i64, f64)| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1));
            let t = Truth {
                count: values.len() as i64,
                sum,
                min: values.iter().map(|v| v.1).fold(f64::INFINITY, f64::min),
                max: values.iter().map(|v| v.1).fold(f64::NEG_INFINITY, f64::max),
                mean,
                variance,
                first: timed.iter().copied().min_by(order),
                last: timed.iter().copied().max_by(order),
                sorted: {
                    let mut v: Vec<f64> = values.iter().map(|v| v.1).collect();
                    v.sort_by(f64::total_cmp);
                    v
                },
            };
            (key, t)
        })
        .collect()
}

pub fn close(a: f64, b: f64, rel: f64) -> bool {
    a == b || (a - b).abs() <= rel * a.abs().max(b.abs())
}

/// The stored buckets of `series` (at `start`, or all of them) and their merged summary.
fn stored<'a>(
    docs: &'a [BucketDoc],
    series: &str,
    start: Option<i64>,
) -> (Vec<&'a BucketDoc>, bucketd::summary::Summary) {
    let mine: Vec<&BucketDoc> = docs
        .iter()
        .filter(|d| d.series == series && start.is_none_or(|s| d.start == s))
        .collect();
    assert!(!mine.is_empty(), "no bucket for {series} {start:?}");
    let mut merged = mine[0].summary();
    for d in &mine[1..] {
        merged.merge(&d.summary());
    }
    (mine, merged)
}

/// Compares stored buckets with the ground truth: every field of every bucket.
/// Readings without device timestamps are compared per series (their hour is the receive hour).
pub fn assert_matches_truth(docs: &[BucketDoc], truth: &BTreeMap<TruthKey, Truth>) {
    check_truth(docs, truth, true);
}

/// [`assert_matches_truth`] for documents rebuilt from an export, which carries quantiles but
/// not the sketch itself (the caller checks the exported quantiles).
pub fn assert_matches_truth_but_quantiles(docs: &[BucketDoc], truth: &BTreeMap<TruthKey, Truth>) {
    check_truth(docs, truth, false);
}

fn check_truth(docs: &[BucketDoc], truth: &BTreeMap<TruthKey, Truth>, quantiles: bool) {
    let mut seen = 0;
    for ((series, start), want) in truth {
        let (mine, got) = stored(docs, series, *start);
        let ctx = format!("{series} @ {start:?}: got {got:?}, want {want:?}");
        assert_eq!(got.count as i64, want.count, "count {ctx}");
        assert_extremes_exact(&got, want, &ctx);
        assert!(close(got.total(), want.sum, 1e-9), "sum {ctx}");
        assert!(close(got.mean, want.mean, 1e-9), "mean {ctx}");
        for q in [0.0, 0.5, 0.9, 0.99, 1.0].into_iter().filter(|_| quantiles) {
            let p = got.quantile(q).expect("the sketch covers the bucket");
            assert_quantile(p, want, q, &ctx);
        }
        let spread = (want.max - want.min).powi(2);
        assert!(
            (got.variance() - want.variance).abs() <= 1e-9 * spread.max(f64::MIN_POSITIVE),
            "variance {ctx}"
        );
        if want.first.is_some() {
            let d = mine[0];
            assert_eq!(d.end - d.start, 3600, "end {ctx}");
            let (sensor, metric) = series.split_once('/').unwrap();
            assert_eq!((d.sensor.as_str(), d.metric.as_str()), (sensor, metric));
        }
        seen += mine.len();
    }
    assert_eq!(seen, docs.len(), "buckets exist that no reading explains");
}

/// A quantile estimate within the sketch's 1% of the exact value of the same rank.
pub fn assert_quantile(p: f64, want: &Truth, q: f64, ctx: &str) {
    let exact = want.quantile(q);
    let ok = if exact == 0.0 {
        p == 0.0
    } else {
        ((p - exact) / exact).abs() <= 0.01 + 1e-9
    };
    assert!(ok, "p{} {p} vs exact {exact}: {ctx}", q * 100.0);
}

/// min, max, and (for device-timestamped readings) first and last, bit for bit.
fn assert_extremes_exact(got: &bucketd::summary::Summary, want: &Truth, ctx: &str) {
    assert_eq!(got.min.to_bits(), want.min.to_bits(), "min {ctx}");
    assert_eq!(got.max.to_bits(), want.max.to_bits(), "max {ctx}");
    if let (Some(first), Some(last)) = (want.first, want.last) {
        let bits = |p: (i64, f64)| (p.0, p.1.to_bits());
        assert_eq!(
            (got.first.ts, got.first.value.to_bits()),
            bits(first),
            "first {ctx}"
        );
        assert_eq!(
            (got.last.ts, got.last.value.to_bits()),
            bits(last),
            "last {ctx}"
        );
    }
}

/// A TCP proxy in front of a broker that a test can cut: while down, it closes every
/// connection and refuses new ones (accepts and closes them at once). A broker "outage" as
/// the daemon sees it, while the broker itself keeps the daemon's session.
pub struct Proxy {
    pub port: u16,
    up: tokio::sync::watch::Sender<bool>,
}

impl Proxy {
    pub async fn start(upstream_host: &str, upstream_port: u16) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (up, up_rx) = tokio::sync::watch::channel(true);
        let upstream = format!("{upstream_host}:{upstream_port}");
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                if !*up_rx.borrow() {
                    drop(client);
                    continue;
                }
                let mut down = up_rx.clone();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = down.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        Proxy { port, up }
    }

    pub fn set_up(&self, up: bool) {
        self.up.send_replace(up);
    }
}
