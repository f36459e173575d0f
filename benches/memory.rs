//! Memory under load: bucketd's peak RSS while a publisher floods it, with a normal and with an
//! artificially slowed store (every fsync delayed, as on a worn SD card), over many series.
//! What it holds is bounded by the config (`max_pending_readings`, `max_series`, the dedup
//! window, redb's cache); the broker holds the rest.
//!
//! `cargo bench --bench memory`. The daemon runs in this process (with nothing else of
//! size: the publisher is a child process, the broker a Mosquitto the benchmark starts with
//! unlimited queues), so this process's peak RSS (`VmHWM`) is the daemon's.
//! Knobs: `MEM_SERIES` (10000), `MEM_MESSAGES` (100000), `MEM_CHECKPOINT_SECS`
//! (`store.checkpoint_interval`; default 60), `MEM_SYNC_DELAY_MS` (0 and 50: each
//! value in a comma-separated list is one run, in a new process each).

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use bucketd::config::{Config, Protocol, RawConfig, RawSubscription};
use bucketd::decode::{Format, TimestampUnit};
use bucketd::stats::Stats;
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `VmRSS` or `VmHWM` of this process, in KiB.
fn proc_status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The child: publishes `messages` JSON messages, one reading each, round-robin over `series`
/// sensors, with device timestamps over the last hour.
async fn publisher(addr: &str, messages: usize, series: usize) {
    let (host, port) = addr.rsplit_once(':').unwrap();
    let mut opts = MqttOptions::new("mem-pub", host, port.parse().unwrap());
    opts.set_keep_alive(Duration::from_secs(30))
        .set_inflight(500);
    let (client, mut eventloop) = AsyncClient::new(opts, 1000);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    tokio::spawn(async move {
        for i in 0..messages {
            let payload = format!(
                "{{\"sensor\":\"s{}\",\"ts\":{},\"temperature\":{}.{}}}",
                i % series,
                now_ms - 3_600_000 + (i as u64 * 7919) % 3_600_000,
                15 + i % 20,
                i % 97
            );
            client
                .publish("mem/devices/gw/telemetry", QoS::AtLeastOnce, false, payload)
                .await
                .unwrap();
        }
    });
    let mut acked = 0;
    while acked < messages {
        if let Event::Incoming(Packet::PubAck(_)) = eventloop.poll().await.unwrap() {
            acked += 1;
        }
    }
}

async fn measure(addr: &str, messages: usize, series: usize, delay_ms: u64) {
    let (host, port) = addr.rsplit_once(':').unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut raw = RawConfig::load(None, Vec::new()).unwrap();
    raw.mqtt.host = host.to_owned();
    raw.mqtt.port = port.parse().unwrap();
    raw.mqtt.protocol = Protocol::V5;
    raw.mqtt.client_id = format!("mem-bucketd-{delay_ms}");
    raw.store.path = dir.path().join("mem.redb");
    raw.http.bind = "127.0.0.1:0".into();
    raw.limits.max_series = series.max(1);
    if let Ok(secs) = std::env::var("MEM_CHECKPOINT_SECS") {
        raw.store.checkpoint_interval = Duration::from_secs(secs.parse().unwrap());
    }
    let mut sub = RawSubscription::defaults_under("mem").remove(1);
    sub.format = Format::Json;
    sub.template = Some("mem/devices/{_}/telemetry".into());
    sub.sensor_field = Some("sensor".into());
    sub.timestamp_field = Some("ts".into());
    sub.timestamp_unit = TimestampUnit::Auto;
    raw.subscriptions = vec![sub];
    let config = Config::try_from(raw).unwrap();
    let faults = std::sync::Arc::new(bucketd::store::Faults::default());
    faults
        .sync_delay_micros
        .store(delay_ms * 1000, std::sync::atomic::Ordering::Relaxed);
    let daemon = bucketd::daemon::start_with_faults(&config, Some(faults)).unwrap();
    while !daemon
        .stats
        .subscribed
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let idle_kib = proc_status_kib("VmRSS:");
    let start = Instant::now();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .env("BUCKETD_MEM_PUBLISHER", addr)
        .env("MEM_MESSAGES", messages.to_string())
        .env("MEM_SERIES", series.to_string())
        .spawn()
        .unwrap();
    let (mut pending_max, mut unacked_max) = (0, 0);
    while Stats::get(&daemon.stats.readings_ingested) < messages as u64 {
        pending_max = pending_max.max(Stats::get(&daemon.stats.pending_readings));
        unacked_max = unacked_max.max(Stats::get(&daemon.stats.unacked_messages));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = start.elapsed();
    assert!(child.wait().unwrap().success());
    let ingest_peak_kib = proc_status_kib("VmHWM:");
    let flushes = Stats::get(&daemon.stats.flushes);
    let series_stored = Stats::get(&daemon.stats.series);
    daemon.stop().await.unwrap();
    println!(
        "memory: fsync delay {delay_ms} ms, {series_stored} series, {messages} readings in \
         {:.1} s ({flushes} commits): idle RSS {:.1} MiB, peak RSS {:.1} MiB while ingesting, \
         {:.1} MiB after the final checkpoint; at most {pending_max} readings pending, \
         {unacked_max} messages unacknowledged",
        took.as_secs_f64(),
        idle_kib as f64 / 1024.0,
        ingest_peak_kib as f64 / 1024.0,
        proc_status_kib("VmHWM:") as f64 / 1024.0,
    );
}

#[path = "../tests/shared/own_mosquitto.rs"]
mod own_mosquitto;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let messages = env_or("MEM_MESSAGES", 100_000usize);
    let series = env_or("MEM_SERIES", 10_000usize);
    if let Ok(addr) = std::env::var("BUCKETD_MEM_PUBLISHER") {
        publisher(&addr, messages, series).await;
        return;
    }
    if let Ok(run) = std::env::var("BUCKETD_MEM_RUN") {
        let (addr, delay) = run.rsplit_once(',').unwrap();
        measure(addr, messages, series, delay.parse().unwrap()).await;
        return;
    }
    // Each run in a process of its own, so that one run's peak is not the next one's floor.
    let broker = own_mosquitto::OwnMosquitto::start(false, "");
    let addr = broker.addr();
    let delays = std::env::var("MEM_SYNC_DELAY_MS").unwrap_or_else(|_| "0,50".into());
    for delay in delays.split(',') {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .env("BUCKETD_MEM_RUN", format!("{addr},{delay}"))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        for line in BufReader::new(child.stdout.take().unwrap()).lines() {
            println!("{}", line.unwrap());
        }
        assert!(child.wait().unwrap().success());
    }
    drop(broker);
}
