//! End-to-end ingest benchmark: one publisher sends a fixed QoS 1 workload to a real broker and
//! we measure, in the same run,
//! 1. the limit: a null subscriber (rumqttc, QoS 1, acknowledging each message at once);
//! 2. bucketd (in-process, real redb file in a temporary directory), from first publish to the
//!    last reading committed.
//!
//! `cargo bench --bench ingest_e2e`. The broker is a Mosquitto the benchmark starts on a free
//! port with unlimited queues (`mosquitto` must be on PATH), or the one named by
//! `BUCKETD_BENCH_MQTT=host:port`. A broker with Mosquitto's default `max_queued_messages` (1000)
//! drops messages whenever a subscriber falls that far behind a flat-out publisher, and the run
//! would never finish.
//! Knobs: `BENCH_MESSAGES` (default 200000), `BENCH_SERIES` (1000), `BENCH_READINGS_PER_MESSAGE`
//! (1 = value payloads; more = JSON arrays).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bucketd::config::{Config, Protocol, RawConfig, RawSubscription};
use bucketd::stats::Stats;
use rumqttc::{AsyncClient, Event, MqttOptions, Outgoing, Packet, QoS};

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Workload {
    messages: Vec<(String, Vec<u8>)>,
    readings: u64,
}

fn workload(prefix: &str, messages: usize, series: usize, per_message: usize) -> Workload {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut out = Vec::with_capacity(messages);
    for i in 0..messages {
        let s = i % series;
        if per_message == 1 {
            out.push((
                format!("{prefix}/sensors/s{s}/temperature"),
                format!("{}.{}", 20 + i % 10, i % 997).into_bytes(),
            ));
        } else {
            let items: Vec<String> = (0..per_message)
                .map(|k| {
                    let ts = now_ms - 3_600_000 + ((i * per_message + k) as u64 % 3_600_000);
                    format!(
                        "{{\"ts\":{ts},\"temperature\":{}.{}}}",
                        20 + k % 10,
                        i % 997
                    )
                })
                .collect();
            out.push((
                format!("{prefix}/devices/s{s}/telemetry"),
                format!("[{}]", items.join(",")).into_bytes(),
            ));
        }
    }
    Workload {
        messages: out,
        readings: (messages * per_message) as u64,
    }
}

/// Publishes everything at QoS 1 as fast as the broker takes it.
async fn publish(host: &str, port: u16, messages: Vec<(String, Vec<u8>)>) {
    let mut opts = MqttOptions::new(format!("bench-pub-{}", std::process::id()), host, port);
    opts.set_keep_alive(Duration::from_secs(30))
        .set_inflight(1000)
        .set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut eventloop) = AsyncClient::new(opts, 10_000);
    let total = messages.len();
    tokio::spawn(async move {
        for (topic, payload) in messages {
            client
                .publish(topic, QoS::AtLeastOnce, false, payload)
                .await
                .unwrap();
        }
    });
    let mut acked = 0;
    while acked < total {
        if let Event::Incoming(Packet::PubAck(_)) = eventloop.poll().await.unwrap() {
            acked += 1;
        }
    }
}

/// The limit: receive and acknowledge each message at once, nothing else.
async fn null_subscriber(host: &str, port: u16, prefix: &str, w: Workload) -> Duration {
    let mut opts = MqttOptions::new(format!("bench-null-{prefix}"), host, port);
    opts.set_keep_alive(Duration::from_secs(30))
        .set_manual_acks(true)
        .set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut eventloop) = AsyncClient::new(opts, 10_000);
    client
        .subscribe(format!("{prefix}/#"), QoS::AtLeastOnce)
        .await
        .unwrap();
    loop {
        if let Event::Incoming(Packet::SubAck(_)) = eventloop.poll().await.unwrap() {
            break;
        }
    }
    let total = w.messages.len();
    let start = Instant::now();
    let (h, p) = (host.to_owned(), port);
    let publisher = tokio::spawn(async move { publish(&h, p, w.messages).await });
    let mut received = 0;
    while received < total {
        match eventloop.poll().await.unwrap() {
            Event::Incoming(Packet::Publish(publish)) => {
                client.try_ack(&publish).unwrap();
                received += 1;
            }
            Event::Outgoing(Outgoing::PubAck(_)) => {}
            _ => {}
        }
    }
    let took = start.elapsed();
    publisher.await.unwrap();
    took
}

async fn bucketd_run(host: &str, port: u16, prefix: &str, w: Workload) -> (Duration, u64) {
    let dir = tempfile::tempdir().unwrap();
    let mut raw = RawConfig::load(None, Vec::new()).unwrap();
    raw.mqtt.host = host.to_owned();
    raw.mqtt.port = port;
    raw.mqtt.protocol = Protocol::V5;
    raw.mqtt.client_id = format!("bench-bucketd-{prefix}");
    raw.store.path = dir.path().join("bench.redb");
    raw.http.bind = "127.0.0.1:0".into();
    raw.subscriptions = RawSubscription::defaults_under(prefix);
    let config = Config::try_from(raw).unwrap();
    let daemon = bucketd::daemon::start(&config).unwrap();
    while !daemon.stats.subscribed.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let readings = w.readings;
    let start = Instant::now();
    let (h, p) = (host.to_owned(), port);
    let publisher = tokio::spawn(async move { publish(&h, p, w.messages).await });
    while Stats::get(&daemon.stats.readings_ingested) < readings {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let took = start.elapsed();
    publisher.await.unwrap();
    let flushes = Stats::get(&daemon.stats.flushes);
    daemon.stop().await.unwrap();
    (took, flushes)
}

#[path = "../tests/shared/own_mosquitto.rs"]
mod own_mosquitto;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let (_broker, addr) = match std::env::var("BUCKETD_BENCH_MQTT") {
        Ok(addr) => (None, addr),
        Err(_) => {
            // Unlimited in-flight too: the null subscriber and bucketd both acknowledge late.
            let broker = own_mosquitto::OwnMosquitto::start(false, "max_inflight_messages 0\n");
            let addr = broker.addr();
            (Some(broker), addr)
        }
    };
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    let port: u16 = port.parse().expect("port");
    let messages = env_or("BENCH_MESSAGES", 200_000usize);
    let series = env_or("BENCH_SERIES", 1000usize);
    let per_message = env_or("BENCH_READINGS_PER_MESSAGE", 1usize);
    println!(
        "workload: {messages} QoS 1 messages, {series} series, {per_message} reading(s)/message, broker {addr}"
    );
    let id = std::process::id();
    let null = null_subscriber(
        host,
        port,
        &format!("benchnull{id}"),
        workload(&format!("benchnull{id}"), messages, series, per_message),
    )
    .await;
    let (ours, flushes) = bucketd_run(
        host,
        port,
        &format!("benchd{id}"),
        workload(&format!("benchd{id}"), messages, series, per_message),
    )
    .await;
    let rate = |d: Duration| messages as f64 / d.as_secs_f64();
    println!("null subscriber: {:>8.0} msg/s ({:.2?})", rate(null), null);
    println!(
        "bucketd:         {:>8.0} msg/s, {:>8.0} readings/s ({:.2?}, {flushes} commits)",
        rate(ours),
        rate(ours) * per_message as f64,
        ours
    );
    println!("bucketd / null: {:.2}", rate(ours) / rate(null));
}
