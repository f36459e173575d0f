//! End-to-end ingest comparison: one publisher sends a fixed QoS 1 workload to a real broker and,
//! in the same run, each of these subscribers takes it in turn, each as its own process so that
//! its CPU time, peak RSS and bytes written are its own (`/proc/<pid>`):
//! 1. `null`: the limit. rumqttc, QoS 1, acknowledging each message as it arrives, nothing else.
//! 2. `sqlite`: the common alternative on gateways. Each message upserted into SQLite (WAL,
//!    `ON CONFLICT DO UPDATE` incrementing count and sum, min/max, `synchronous=FULL` so the commit
//!    is durable like bucketd's), one transaction per message, acknowledged after it; and
//!    `sqlite-1000`: the same with one transaction per 1,000 messages, acknowledged after it.
//! 3. `bucketd`: the real binary at its default settings, and 4. `bucketd-durable`: at its most
//!    durable ones (`durability = "two_phase"`, quick repair on; quick repair, on by default,
//!    already makes every commit two-phase, so the two commit alike); and 5. `bucketd-noraw`:
//!    default settings without raw readings (`store_raw = false`: summaries only, like the
//!    SQLite table); and 6. `bucketd-visible`: default settings, checkpoints 10 minutes apart as
//!    shipped, with a dashboard beside it (20 panels refreshed every 100 ms while the publisher
//!    publishes), then one `/api/v1/buckets` query per series round after round until every
//!    count is right (`dashboard`): its line gives both "acknowledged" (the readings committed)
//!    and "visible to queries" against the null (issue 53).
//!
//! Measured from the first publish to the last message received (null) or the last reading
//! committed (the others): the sustained rate, CPU seconds per million readings, peak RSS and
//! bytes written to disk per reading; for bucketd also each message's latency from publish to
//! commit (p50, p99; meaningful at a fixed rate, `BENCH_RATE`, where nothing queues), and the
//! p99 of the messages whose commit waited for a checkpoint (with their share).
//! Before them, the storage engines alone, without MQTT ("anchors"): SQLite and bucketd's store,
//! one transaction per reading and batched. Every run checks what was ingested: the counts, and the sum
//! of all values, of SQLite's table and bucketd's buckets (it panics otherwise), so a short run
//! is the CI smoke test: `BENCH_MESSAGES=2000 BENCH_RUNS=1 cargo bench --bench ingest_e2e`.
//!
//! `cargo bench --bench ingest_e2e` runs the whole comparison (docs/PERFORMANCE.md). The broker is
//! a Mosquitto the benchmark starts on a free port with unlimited queues and in-flight window
//! (`mosquitto` must be on PATH), or the one named by `BUCKETD_BENCH_MQTT=host:port`.
//! Knobs: `BENCH_MESSAGES` (default 200000), `BENCH_SERIES` (1000), `BENCH_READINGS_PER_MESSAGE`
//! (1 = `value` payloads; more = JSON arrays), `BENCH_RATE` (messages/s; 0 = flat out),
//! `BENCH_RUNS` (3), `BENCH_CHECKPOINT_SECS` (10: bucketd's `store.checkpoint_interval` in the
//! runs; 0: the shipped 10 minutes; bucketd's bytes are counted from after its start-up through
//! its own shutdown, so its last fold is in them either way), `BENCH_QR=0` (quick repair off: the storage-alone store and `bucketd`),
//! `BENCH_CACHE_MIB` (bucketd's `store.cache_size` in MiB; default 16), `BENCH_WINDOW` (a strict
//! broker instead: an in-process rumqttd that sends each subscriber at most that many messages
//! unacknowledged; at 1, a line under bucketd's row gives the bound 1 / (round trip + commit),
//! the round trip being the null's period, and bucketd's ratio to it), `BENCH_PROTOCOL=v311`
//! (bucketd over MQTT 3.1.1; default 5),
//! `BENCH_RTT_MS` (bucketd reaches the broker through a delay line adding that round trip),
//! `BENCH_MOSQUITTO_INFLIGHT` (the own Mosquitto's `max_inflight_messages`; default 0, none),
//! `BENCH_MOSQUITTO_NODELAY=1` (its `set_tcp_nodelay true`: Nagle's algorithm off),
//! `BENCH_SESSIONS` (bucketd's `mqtt.sessions`; default 1), `BENCH_RECEIVE_MAX` (bucketd's
//! `mqtt.receive_maximum`: over MQTT 5 a window Mosquitto enforces per session),
//! `BENCH_BROKER_WINDOW` (bucketd's `mqtt.broker_window`: the window stated, not learned),
//! `BENCH_JOURNAL_MIB` (bucketd's `store.journal_size` in MiB; 0: no journal, every commit a
//! durable redb transaction),
//! `BENCH_PIN=1` (Linux, two CPUs or more: the publisher, the benchmark's own threads and its
//! own Mosquitto on CPU 0, each subscriber and the dashboard on CPU 1, so that a subscriber's
//! CPU does not slow the broker it is measured against: is the subscriber the bottleneck?),
//! `BENCH_BIN` (the bucketd binary to run, for an A/B of two builds under one harness; default
//! the one built with this benchmark), `BENCH_DASHBOARD=flat` (`bucketd-visible`'s dashboard
//! asks every series round after round from the first publish, a new connection a query: the
//! closed loop of earlier rounds),
//! `BENCH_ONLY` (comma-separated contender names, `anchors` for the storage
//! alone), `BENCH_STORE_READINGS` (readings of the anchors; default the workload's, at most
//! 200000).

// Benchmark runs read top to bottom; the 100-line limit (clippy.toml) holds the library.
#![allow(clippy::too_many_lines)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bucketd::config::{Protocol, RawConfig, RawSubscription};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde_json::{Value, json};

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

struct Workload {
    messages: Vec<(String, Vec<u8>)>,
    readings: u64,
    /// The sum of every value, to check what was stored.
    sum: f64,
    /// Messages per second; 0: flat out.
    rate: f64,
    /// Series the messages go round.
    series: usize,
}

fn workload(prefix: &str, messages: usize, series: usize, per_message: usize) -> Workload {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut out = Vec::with_capacity(messages);
    let mut sum = 0.0;
    for i in 0..messages {
        let s = i % series;
        if per_message == 1 {
            let value = format!("{}.{}", 20 + i % 10, i % 997);
            sum += value.parse::<f64>().unwrap();
            out.push((
                format!("{prefix}/sensors/s{s}/temperature"),
                value.into_bytes(),
            ));
        } else {
            let items: Vec<String> = (0..per_message)
                .map(|k| {
                    let ts = now_ms - 3_600_000 + ((i * per_message + k) as u64 % 3_600_000);
                    let value = format!("{}.{}", 20 + k % 10, i % 997);
                    sum += value.parse::<f64>().unwrap();
                    format!("{{\"ts\":{ts},\"temperature\":{value}}}")
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
        sum,
        rate: 0.0,
        series,
    }
}

/// Publishes everything at QoS 1, as fast as the broker takes it (`rate` 0) or at `rate`
/// messages per second; returns when every PUBACK is in, with the instant each message was
/// handed to the client.
async fn publish(
    host: String,
    port: u16,
    messages: Vec<(String, Vec<u8>)>,
    rate: f64,
) -> Vec<Instant> {
    let mut opts = MqttOptions::new(format!("bench-pub-{}", std::process::id()), host, port);
    opts.set_keep_alive(Duration::from_secs(30))
        .set_inflight(1000)
        .set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut eventloop) = AsyncClient::new(opts, 10_000);
    let total = messages.len();
    // Held until every PUBACK is in: dropping the last client ends the event loop.
    let _keep = client.clone();
    let sender = tokio::spawn(async move {
        let start = tokio::time::Instant::now();
        let mut sent = Vec::with_capacity(messages.len());
        for (i, (topic, payload)) in messages.into_iter().enumerate() {
            if rate > 0.0 {
                // The timer's resolution is a millisecond: at high rates, small bursts.
                tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
            }
            sent.push(Instant::now());
            client
                .publish(topic, QoS::AtLeastOnce, false, payload)
                .await
                .unwrap();
        }
        sent
    });
    let mut acked = 0;
    while acked < total {
        if let Event::Incoming(Packet::PubAck(_)) = eventloop.poll().await.unwrap() {
            acked += 1;
        }
    }
    sender.await.unwrap()
}

/// CPU time, peak RSS and bytes written of a process (`self` or a pid), from `/proc`.
#[derive(Debug, Clone, Copy)]
struct Usage {
    cpu_s: f64,
    peak_rss_kib: u64,
    write_bytes: u64,
}

fn usage(pid: &str) -> Usage {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces): utime and stime are 14 and 15.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu_s = (fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap()) / ticks;
    let field = |file: &str, key: &str| -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/{file}"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("{key} in /proc/{pid}/{file}"))
    };
    Usage {
        cpu_s,
        peak_rss_kib: field("status", "VmHWM:"),
        write_bytes: field("io", "write_bytes:"),
    }
}

// ---- The child roles: `BENCH_ROLE=null|sqlite`, started by the parent. --------------------

/// A subscriber child: subscribes to `BENCH_PREFIX/#`, prints `subscribed`, takes
/// `BENCH_EXPECT` messages, then prints one JSON line with its end time, usage and (sqlite) the
/// table's totals, and exits.
/// The null subscriber as `sessions` sessions on one shared subscription (`BENCH_SESSIONS`, as
/// bucketd's `mqtt.sessions`): the same broker path as bucketd's, acknowledging at once.
async fn null_shared(host: &str, port: u16, prefix: &str, expect: usize, sessions: usize) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let received = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(tokio::sync::Notify::new());
    let mut subscribed = Vec::new();
    for i in 0..sessions {
        let mut opts = MqttOptions::new(format!("bench-null-{prefix}-{i}"), host, port);
        opts.set_keep_alive(Duration::from_secs(30))
            .set_manual_acks(true)
            .set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut eventloop) = AsyncClient::new(opts, expect + 1000);
        client
            .subscribe(
                format!("$share/bench-null-{prefix}/{prefix}/#"),
                QoS::AtLeastOnce,
            )
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        subscribed.push(rx);
        let (received, done) = (received.clone(), done.clone());
        tokio::spawn(async move {
            let mut tx = Some(tx);
            loop {
                match eventloop.poll().await.unwrap() {
                    Event::Incoming(Packet::SubAck(_)) => {
                        if let Some(tx) = tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Event::Incoming(Packet::Publish(p)) => {
                        client.try_ack(&p).unwrap();
                        if received.fetch_add(1, Ordering::Relaxed) + 1 == expect {
                            done.notify_one();
                        }
                    }
                    _ => {}
                }
            }
        });
    }
    for rx in subscribed {
        rx.await.unwrap();
    }
    println!("subscribed");
    done.notified().await;
    let end_ns = now_ns();
    let u = usage("self");
    println!(
        "{}",
        json!({"end_ns": end_ns.to_string(), "cpu_s": u.cpu_s, "peak_rss_kib": u.peak_rss_kib,
               "write_bytes": u.write_bytes, "count": received.load(Ordering::Relaxed), "sum": 0.0})
    );
}

async fn child(role: &str) {
    let host = std::env::var("BENCH_HOST").unwrap();
    let port: u16 = env_or("BENCH_PORT", 0);
    let prefix = std::env::var("BENCH_PREFIX").unwrap();
    let expect: usize = env_or("BENCH_EXPECT", 0);
    let sessions = env_or("BENCH_SESSIONS", 1usize);
    if role == "null" && sessions > 1 {
        null_shared(&host, port, &prefix, expect, sessions).await;
        return;
    }
    let mut opts = MqttOptions::new(format!("bench-{role}-{prefix}"), host, port);
    opts.set_keep_alive(Duration::from_secs(30))
        .set_manual_acks(true)
        .set_max_packet_size(1 << 20, 1 << 20);
    // Room for every acknowledgement: rumqttc writes them between incoming packets, and under
    // a flood (the broker's window is unlimited here) they queue up; `try_ack` must never fail.
    let (client, mut eventloop) = AsyncClient::new(opts, expect + 1000);
    client
        .subscribe(format!("{prefix}/#"), QoS::AtLeastOnce)
        .await
        .unwrap();
    let sync = std::env::var("BENCH_SQLITE_SYNC").unwrap_or_else(|_| "FULL".into());
    let mut sqlite = role
        .starts_with("sqlite")
        .then(|| Sqlite::open(&prefix, &sync));
    // Messages per transaction; their acknowledgements wait for its commit.
    let per_tx: usize = if role == "sqlite-1000" { 1000 } else { 1 };
    let mut unacked = Vec::with_capacity(per_tx);
    loop {
        if let Event::Incoming(Packet::SubAck(_)) = eventloop.poll().await.unwrap() {
            break;
        }
    }
    println!("subscribed");
    let mut received = 0;
    while received < expect {
        if let Event::Incoming(Packet::Publish(p)) = eventloop.poll().await.unwrap() {
            received += 1;
            let Some(db) = &mut sqlite else {
                client.try_ack(&p).unwrap();
                continue;
            };
            if unacked.is_empty() {
                db.conn.execute_batch("BEGIN").unwrap();
            }
            db.upsert_message(p.topic.as_bytes(), &p.payload);
            unacked.push(p);
            if unacked.len() == per_tx || received == expect {
                db.conn.execute_batch("COMMIT").unwrap();
                for p in unacked.drain(..) {
                    client.try_ack(&p).unwrap();
                }
            }
        }
    }
    let end_ns = now_ns();
    // The last acknowledgements go out with the next polls; the run is over either way.
    let u = usage("self");
    let (count, sum) = sqlite
        .as_ref()
        .map_or((received as u64, 0.0), Sqlite::totals);
    println!(
        "{}",
        json!({"end_ns": end_ns.to_string(), "cpu_s": u.cpu_s, "peak_rss_kib": u.peak_rss_kib,
               "write_bytes": u.write_bytes, "count": count, "sum": sum})
    );
}

/// One SQLite file with one row per (series, hour): the upsert-per-message alternative.
struct Sqlite {
    conn: rusqlite::Connection,
    _dir: tempfile::TempDir,
}

impl Sqlite {
    fn open(prefix: &str, sync: &str) -> Sqlite {
        let dir = tempfile::tempdir().unwrap();
        let conn = rusqlite::Connection::open(dir.path().join(format!("{prefix}.sqlite"))).unwrap();
        conn.execute_batch(&format!(
            "PRAGMA journal_mode=WAL; PRAGMA synchronous={sync};
             CREATE TABLE buckets (series TEXT NOT NULL, start INTEGER NOT NULL,
               count INTEGER NOT NULL, sum REAL NOT NULL, min REAL NOT NULL, max REAL NOT NULL,
               PRIMARY KEY (series, start)) WITHOUT ROWID;"
        ))
        .unwrap();
        Sqlite { conn, _dir: dir }
    }

    /// Every reading of one message, upserted in the open transaction.
    fn upsert_message(&mut self, topic: &[u8], payload: &[u8]) {
        let topic = std::str::from_utf8(topic).unwrap();
        let sensor = topic.split('/').nth(2).unwrap();
        let series = format!("{sensor}/temperature");
        let hour = |ms: i64| ms.div_euclid(3_600_000) * 3600;
        let readings: Vec<(i64, f64)> = if topic.ends_with("/telemetry") {
            let items: Vec<Value> = serde_json::from_slice(payload).unwrap();
            items
                .iter()
                .map(|o| {
                    (
                        hour(o["ts"].as_i64().unwrap()),
                        o["temperature"].as_f64().unwrap(),
                    )
                })
                .collect()
        } else {
            let now_ms = (now_ns() / 1_000_000) as i64;
            let value = std::str::from_utf8(payload).unwrap().parse().unwrap();
            vec![(hour(now_ms), value)]
        };
        for (start, value) in readings {
            self.upsert(&series, start, value);
        }
    }

    /// One reading upserted into its hour's row.
    fn upsert(&mut self, series: &str, start: i64, value: f64) {
        self.conn
            .prepare_cached(
                "INSERT INTO buckets (series, start, count, sum, min, max)
                 VALUES (?1, ?2, 1, ?3, ?3, ?3)
                 ON CONFLICT (series, start) DO UPDATE SET count = count + 1,
                   sum = sum + excluded.sum, min = min(min, excluded.min),
                   max = max(max, excluded.max)",
            )
            .unwrap()
            .execute(rusqlite::params![series, start, value])
            .unwrap();
    }

    fn totals(&self) -> (u64, f64) {
        self.conn
            .query_row("SELECT SUM(count), SUM(sum) FROM buckets", [], |r| {
                Ok((r.get::<_, i64>(0)? as u64, r.get(1)?))
            })
            .unwrap()
    }
}

// ---- Storage alone: the anchors, without MQTT, in this process. -------------------

/// `store.checkpoint_bytes` of the default config.
const CHECKPOINT_BYTES: u64 = 4 << 20;

/// One storage-alone contender's figures.
struct Anchor {
    name: &'static str,
    readings: usize,
    took: Duration,
    cpu_s: f64,
    write_bytes: u64,
}

/// Upserts `readings` readings over `series` series (one hour) with `per_tx` readings per
/// transaction, into SQLite (`synchronous=NORMAL`, as in the anchors) or bucketd's
/// [`Store`] (default durability; readings folded into a batch in memory, one commit per
/// `per_tx`, as the daemon does), and checks the stored count and sum.
fn anchor(name: &'static str, readings: usize, series: usize, per_tx: usize) -> Anchor {
    use bucketd::batcher::Batcher;
    use bucketd::reading::Timestamp;
    use bucketd::store::{Store, StoreReader, StoreSettings};
    use std::sync::Arc;

    let names: Vec<Arc<str>> = (0..series)
        .map(|i| Arc::from(format!("s{i}/temperature")))
        .collect();
    let hour = (now_ns() / 1_000_000_000) as i64 / 3600 * 3600;
    let value = |i: usize| (200 + i % 100) as f64 / 10.0;
    let expected: f64 = (0..readings).map(value).sum();
    let dir = tempfile::tempdir().unwrap();
    let before = usage("self");
    let start = Instant::now();
    let (count, sum) = if name.starts_with("sqlite") {
        let mut db = Sqlite::open("anchor", "NORMAL");
        for chunk in (0..readings).collect::<Vec<_>>().chunks(per_tx) {
            db.conn.execute_batch("BEGIN").unwrap();
            for &r in chunk {
                db.upsert(&names[r % series], hour, value(r));
            }
            db.conn.execute_batch("COMMIT").unwrap();
        }
        db.totals()
    } else {
        let path = dir.path().join("anchor.redb");
        let raw = name.ends_with("raw");
        let mut store = Store::open(&StoreSettings {
            path: path.clone(),
            bucket_width_secs: 3600,
            durability: bucketd::config::Durability::Immediate,
            quick_repair: std::env::var("BENCH_QR").map_or(true, |v| v == "1"),
            cache_bytes: 16 << 20,
            page_capacity: 1000,
            dedup_window: 8192,
            outbox_max_entries: 0,
            journal_bytes: 8 << 20,
        })
        .unwrap();
        let mut batcher = Batcher::by_hand();
        let now = Instant::now();
        for r in 0..readings {
            let ts = Timestamp::from_secs(hour + (r / series) as i64 % 3600);
            batcher.push_reading(names[r % series].clone(), ts, value(r), raw, now);
            if (r + 1) % per_tx == 0 || r + 1 == readings {
                store.commit(&batcher.take().0).unwrap();
                // As the writer does flat out: a checkpoint once the log holds the default
                // `store.checkpoint_bytes`.
                if store.log_bytes() >= CHECKPOINT_BYTES {
                    store.checkpoint().unwrap();
                }
            }
        }
        // And the one that folds the rest: its writes count too.
        store.checkpoint().unwrap();
        drop(store);
        let docs = StoreReader::open(&path)
            .unwrap()
            .buckets(None, i64::MIN, i64::MAX)
            .unwrap();
        (
            docs.iter().map(|d| d.count as u64).sum(),
            docs.iter().map(|d| d.sum + d.sum_comp).sum(),
        )
    };
    let took = start.elapsed();
    let after = usage("self");
    assert_eq!(count, readings as u64, "{name}: readings stored");
    assert!(
        (sum - expected).abs() <= 1e-9 * expected,
        "{name}: sum {sum} != {expected}"
    );
    Anchor {
        name,
        readings,
        took,
        cpu_s: after.cpu_s - before.cpu_s,
        write_bytes: after.write_bytes - before.write_bytes,
    }
}

/// The anchors: SQLite and bucketd's store, one transaction per reading and batched.
fn anchors(readings: usize, series: usize, run: usize) {
    // One transaction per reading is slow (an fsync each): a tenth of the readings.
    let few = (readings / 10).max(series);
    for a in [
        anchor("sqlite/1", few, series, 1),
        anchor("sqlite/1000", readings, series, 1000),
        anchor("store/1", few / 4, series, 1),
        anchor("store/10000", readings, series, 10_000),
        anchor("store/10000+raw", readings, series, 10_000),
    ] {
        println!(
            "{:<16} {:>4} {:>12.0} {:>14.2} {:>14.1}",
            a.name,
            run,
            a.readings as f64 / a.took.as_secs_f64(),
            a.cpu_s / a.readings as f64 * 1e6,
            a.write_bytes as f64 / a.readings as f64,
        );
    }
}

// ---- The parent: runs each contender as a child process. ---------------------------------

struct Outcome {
    took: Duration,
    usage: Usage,
    count: u64,
    sum: f64,
    commits: Option<u64>,
    /// bucketd's mean commit (`bucketd_flush_duration_seconds`: batch to durable).
    mean_commit: Option<Duration>,
    /// Publish -> commit latency of every message, sorted (bucketd only).
    latencies: Vec<Duration>,
    /// Those of [`Outcome::latencies`] whose commit waited for a checkpoint, sorted.
    checkpointed: Vec<Duration>,
    /// `bucketd-visible`: when a dashboard's queries had seen every reading.
    visible: Option<Seen>,
}

/// `BENCH_PIN=1`: the CPU of the subscriber side (1) or of the rest (0), else `None`.
fn pinned(subscriber: bool) -> Option<usize> {
    (env_or("BENCH_PIN", 0u8) == 1).then_some(usize::from(subscriber))
}

/// Pins every thread of process `pid` (0: this one) to `cpu`; threads they start inherit it.
fn pin_process(pid: u32, cpu: usize) {
    let dir = if pid == 0 {
        "/proc/self/task".to_owned()
    } else {
        format!("/proc/{pid}/task")
    };
    for task in std::fs::read_dir(dir).unwrap() {
        let tid: libc::pid_t = task.unwrap().file_name().to_str().unwrap().parse().unwrap();
        pin_thread(tid, cpu);
    }
}

/// Pins thread `tid` (0: the calling one) to `cpu`.
fn pin_thread(tid: libc::pid_t, cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes within it, and
    // sched_setaffinity reads size_of::<cpu_set_t>() bytes of it.
    let done = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &raw const set)
    };
    assert_eq!(
        done, 0,
        "sched_setaffinity({tid}, cpu {cpu}): BENCH_PIN needs two CPUs"
    );
}

/// Starts the bench binary itself as a `role` child and waits until it has subscribed.
fn spawn_role(role: &str, host: &str, port: u16, prefix: &str, expect: usize) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("BENCH_ROLE", role)
        .env("BENCH_HOST", host)
        .env("BENCH_PORT", port.to_string())
        .env("BENCH_PREFIX", prefix)
        .env("BENCH_EXPECT", expect.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let stdout = child.stdout.as_mut().unwrap();
    let mut reader = BufReader::new(stdout);
    reader.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "subscribed", "{role} child");
    if let Some(cpu) = pinned(true) {
        pin_process(child.id(), cpu);
    }
    child
}

async fn run_role(role: &str, host: &str, port: u16, prefix: &str, w: Workload) -> Outcome {
    let child = spawn_role(role, host, port, prefix, w.messages.len());
    let start_ns = now_ns();
    let start = Instant::now();
    let publisher = tokio::spawn(publish(host.to_owned(), port, w.messages, w.rate));
    let output = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    let wall = start.elapsed();
    publisher.await.unwrap();
    assert!(output.status.success(), "{role} child failed");
    let text = String::from_utf8(output.stdout).unwrap();
    let report: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let end_ns: u128 = report["end_ns"].as_str().unwrap().parse().unwrap();
    let took = Duration::from_nanos((end_ns - start_ns) as u64);
    assert!(took <= wall);
    Outcome {
        took,
        usage: Usage {
            cpu_s: report["cpu_s"].as_f64().unwrap(),
            peak_rss_kib: report["peak_rss_kib"].as_u64().unwrap(),
            write_bytes: report["write_bytes"].as_u64().unwrap(),
        },
        count: report["count"].as_u64().unwrap(),
        sum: report["sum"].as_f64().unwrap(),
        commits: None,
        mean_commit: None,
        latencies: Vec::new(),
        checkpointed: Vec::new(),
        visible: None,
    }
}

#[path = "../tests/shared/prom.rs"]
mod prom;
use prom::metric;

/// bucketd as `variant`, connected to `bucketd_port`; the publisher to `port`.
async fn run_bucketd(
    host: &str,
    port: u16,
    bucketd_port: u16,
    prefix: &str,
    variant: &str,
    w: Workload,
) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let mut raw = RawConfig::load(None, Vec::new()).unwrap();
    raw.mqtt.host = host.to_owned();
    raw.mqtt.port = bucketd_port;
    raw.mqtt.protocol = bench_protocol();
    raw.mqtt.client_id = format!("bench-bucketd-{prefix}");
    let sessions = env_or("BENCH_SESSIONS", 1u16);
    raw.mqtt.sessions = sessions;
    raw.mqtt.receive_maximum = env_or("BENCH_RECEIVE_MAX", raw.mqtt.receive_maximum);
    if let Ok(w) = std::env::var("BENCH_BROKER_WINDOW") {
        raw.mqtt.broker_window = w.parse().unwrap();
    }
    raw.store.path = dir.path().join("bench.redb");
    raw.http.bind = "127.0.0.1:0".into();
    raw.subscriptions = RawSubscription::defaults_under(prefix);
    // Checkpoints more often than the default (10 minutes), so that the runs (5-20 s) include
    // them at a rate no lower than a steady stream would see (0: the default). Bytes written
    // are counted from after start-up through bucketd's own shutdown, which folds what is
    // left: all folding is in them, whatever the interval.
    let visible = variant == "bucketd-visible";
    // A dashboard's view is measured at the shipped checkpoints (10 minutes): the commits
    // wait unfolded, which is what the queries must read through.
    let checkpoint_secs = if visible {
        0
    } else {
        env_or("BENCH_CHECKPOINT_SECS", 10u64)
    };
    if checkpoint_secs > 0 {
        raw.store.checkpoint_interval = Duration::from_secs(checkpoint_secs);
    }
    if let Ok(mib) = std::env::var("BENCH_CACHE_MIB") {
        raw.store.cache_size = bytesize::ByteSize::mib(mib.parse().unwrap());
    }
    if std::env::var("BENCH_QR").is_ok_and(|v| v == "0") {
        raw.store.quick_repair = false;
    }
    if let Ok(mib) = std::env::var("BENCH_JOURNAL_MIB") {
        raw.store.journal_size = bytesize::ByteSize::mib(mib.parse().unwrap());
    }
    match variant {
        "bucketd-durable" => {
            raw.store.durability = bucketd::config::Durability::TwoPhase;
            raw.store.quick_repair = true;
        }
        "bucketd-noraw" => raw
            .subscriptions
            .iter_mut()
            .for_each(|s| s.store_raw = false),
        _ => {}
    }
    let bin = std::env::var("BENCH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_bucketd").into());
    let bucketd = BucketdChild::start(&bin, &raw, dir.path(), sessions);
    if let Some(cpu) = pinned(true) {
        pin_process(bucketd.child.id(), cpu);
    }
    let metrics_url = bucketd.metrics_url.clone();
    let pid = bucketd.child.id().to_string();
    // Start-up's writes (the file, the journal's zero-fill) are not the workload's.
    let written_before = usage(&pid).write_bytes;
    let readings = w.readings;
    let per_message = readings / w.messages.len() as u64;
    // At a fixed rate the polls are what times each commit: closer together. Flat out they
    // time only the end, and each costs bucketd a render of /metrics (with /proc reads) on the
    // CPU the broker and the publisher share: far apart until the last tenth, 10 ms in it.
    let poll_every = Duration::from_millis(if w.rate > 0.0 { 2 } else { 10 });
    let fixed_rate = w.rate > 0.0;
    let far_poll = move |done: u64| {
        if fixed_rate || done >= readings - readings / 10 {
            poll_every
        } else {
            Duration::from_millis(50)
        }
    };
    let start = Instant::now();
    // Set once the publisher has every PUBACK: the dashboard's cue to check every series.
    let published = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let dashboard = visible.then(|| {
        let base = metrics_url.trim_end_matches("/metrics").to_owned();
        let (series, messages) = (w.series, w.messages.len());
        let published = published.clone();
        std::thread::spawn(move || dashboard(&base, series, messages, start, &published))
    });
    let publisher = {
        let published = published.clone();
        let publishing = publish(host.to_owned(), port, w.messages, w.rate);
        tokio::spawn(async move {
            let sent = publishing.await;
            published.store(true, std::sync::atomic::Ordering::Release);
            sent
        })
    };
    let (took, usage, (commits, mean_commit), polls) = tokio::task::spawn_blocking(move || {
        let scrape = || {
            ureq::get(&metrics_url)
                .call()
                .unwrap()
                .into_body()
                .read_to_string()
                .unwrap()
        };
        // (when the answer was in, readings committed by then)
        let mut polls = Vec::new();
        loop {
            let text = scrape();
            let done = metric(&text, "bucketd_readings_ingested_total") as u64;
            let checkpoints = metric(&text, "bucketd_checkpoints_total") as u64;
            polls.push((Instant::now(), done, checkpoints));
            if done >= readings {
                let took = start.elapsed();
                let commits = metric(&text, "bucketd_flushes_total") as u64;
                // The commit's own time (the writer's, from batch to fsync): the bound a
                // strict window of 1 sets is 1 / (round trip + this).
                // By reason, e.g. "broker_window 999, stall 1".
                let reasons: Vec<String> = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("bucketd_flushes_total{reason=\""))
                    .filter_map(|l| l.split_once("\"} "))
                    .filter(|(_, n)| *n != "0")
                    .map(|(r, n)| format!("{r} {n}"))
                    .collect();
                let mean_commit = Duration::from_secs_f64(
                    metric(&text, "bucketd_flush_duration_seconds_sum")
                        / metric(&text, "bucketd_flush_duration_seconds_count").max(1.0),
                );
                eprintln!(
                    "  bucketd: {commits} commits ({}) of {:.3} ms on average; {} checkpoints, {:.1} ms in all",
                    reasons.join(", "),
                    1000.0 * mean_commit.as_secs_f64(),
                    metric(&text, "bucketd_checkpoint_duration_seconds_count"),
                    1000.0 * metric(&text, "bucketd_checkpoint_duration_seconds_sum"),
                );
                // Until the log is folded, at checkpoints no more than a minute apart: their
                // CPU is the run's too (their bytes are counted through the shutdown anyway).
                let mut waits = 0;
                while (1..=60).contains(&checkpoint_secs)
                    && metric(&scrape(), "bucketd_commit_log_bytes") > 0.0
                {
                    waits += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                let mut used = usage(&pid);
                // The polls cost bucketd CPU that ingest does not (500 scrapes/s at a fixed
                // rate): measured on as many scrapes now that it is idle, and taken off.
                let scrapes = polls.len() + waits;
                let extra = scrapes.clamp(200, 2000);
                let before = usage(&pid).cpu_s;
                for _ in 0..extra {
                    scrape();
                }
                let per_poll = (usage(&pid).cpu_s - before) / extra as f64;
                used.cpu_s = (used.cpu_s - per_poll * scrapes as f64).max(0.0);
                return (took, used, (Some(commits), Some(mean_commit)), polls);
            }
            std::thread::sleep(far_poll(done));
        }
    })
    .await
    .unwrap();
    let sent = publisher.await.unwrap();
    let visible = dashboard.map(|d| d.join().unwrap());
    let (latencies, checkpointed) = commit_latencies(&sent, per_message, &polls);
    // Through the shutdown: its fold of what the journal held is the workload's writing.
    let closed = bucketd.stop();
    let usage = Usage {
        write_bytes: closed - written_before,
        ..usage
    };
    let docs = bucketd::store::StoreReader::open(&raw.store.path)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    Outcome {
        took,
        usage,
        count: docs.iter().map(|d| d.count as u64).sum(),
        sum: docs.iter().map(|d| d.sum + d.sum_comp).sum(),
        commits,
        mean_commit,
        latencies,
        checkpointed,
        visible,
    }
}

/// What the dashboard saw: when every series' count was right (from the first publish), and the
/// queries it asked while the publisher published and after.
struct Seen {
    at: Duration,
    during: usize,
    checks: usize,
}

/// Panels of the dashboard beside the ingest (`bucketd-visible`): series asked each refresh.
const DASHBOARD_PANELS: usize = 20;
/// How often the dashboard refreshes while the publisher publishes: 50 times as often as
/// Grafana's shortest refresh interval offered by default (5 s), a dashboard working hard.
const DASHBOARD_REFRESH: Duration = Duration::from_millis(100);
/// How often the dashboard asks for the last series while it waits for it to be complete.
const SENTINEL_EVERY: Duration = Duration::from_millis(2);
/// Connections the final check of every series spreads over (a browser's Grafana asks up to six
/// panels of a host at once).
const DASHBOARD_CONNECTIONS: usize = 4;

/// A Grafana-like dashboard beside bucketd while it ingests, then the measure of when every
/// reading is visible to queries (issue 53: "200,000 QoS 1 messages over 1,000 series, then one
/// `/api/v1/buckets` query per series until every count is right"). While the publisher
/// publishes: [`DASHBOARD_PANELS`] series (spread over all), one `/api/v1/buckets` query each,
/// every [`DASHBOARD_REFRESH`], over a kept-alive connection, as Grafana's client keeps them.
/// Once it has every PUBACK (`published`): the last message's series, every
/// [`SENTINEL_EVERY`] until its count is right (bucketd may still be taking the broker's
/// backlog), then one query per series (`s<k>/temperature`, the `value` workload's), round after
/// round over [`DASHBOARD_CONNECTIONS`] connections at once, until every series' count is right;
/// returns when that was. Its queries read through the commits waiting unfolded (the shipped
/// 10-minute checkpoints).
///
/// `BENCH_DASHBOARD=flat`: every series round after round from the first publish, on a new
/// connection a query, as earlier rounds measured (a closed loop that takes every CPU cycle it
/// can from the broker and the publisher on two cores: a stress figure, not a dashboard).
fn dashboard(
    base: &str,
    series: usize,
    messages: usize,
    start: Instant,
    published: &std::sync::atomic::AtomicBool,
) -> Seen {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // Beside bucketd: its queries' cost on the client side too is the subscriber's.
    if let Some(cpu) = pinned(true) {
        pin_thread(0, cpu);
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (from, to) = (now - 7200, now + 7200);
    let want = |k: usize| (messages / series + usize::from(k < messages % series)) as i64;
    let asked = AtomicUsize::new(0);
    // Whether series `k`'s count is right, asked through `agent` (a use-once one per query
    // without); an error is a no.
    let right = |agent: Option<&ureq::Agent>, k: usize| {
        asked.fetch_add(1, Ordering::Relaxed);
        let url = format!("{base}/api/v1/buckets?series=s{k}/temperature&from={from}&to={to}");
        let called = match agent {
            Some(agent) => agent.get(&url).call(),
            None => ureq::get(&url).call(),
        };
        let Ok(mut answer) = called else {
            return false;
        };
        let body: Value =
            serde_json::from_str(&answer.body_mut().read_to_string().unwrap()).unwrap();
        let count: i64 = body["buckets"]
            .as_array()
            .map_or(0, |b| b.iter().filter_map(|b| b["count"].as_i64()).sum());
        count == want(k)
    };
    let in_time = || {
        assert!(
            start.elapsed() < Duration::from_mins(10),
            "not all visible in 10 minutes"
        );
    };
    if std::env::var("BENCH_DASHBOARD").is_ok_and(|v| v == "flat") {
        let mut left: Vec<usize> = (0..series).collect();
        while !left.is_empty() {
            left.retain(|&k| !right(None, k));
            in_time();
        }
        return Seen {
            at: start.elapsed(),
            during: 0,
            checks: asked.into_inner(),
        };
    }
    let agent: ureq::Agent = ureq::Agent::config_builder().build().into();
    let panels: Vec<usize> = (0..DASHBOARD_PANELS.min(series))
        .map(|p| p * series / DASHBOARD_PANELS.min(series))
        .collect();
    let mut refresh = start;
    while !published.load(Ordering::Acquire) {
        for &k in &panels {
            right(Some(&agent), k);
        }
        // A refresh that took longer than the interval is not made up in a burst.
        refresh = (refresh + DASHBOARD_REFRESH).max(Instant::now());
        while Instant::now() < refresh && !published.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
        in_time();
    }
    let during = asked.load(Ordering::Relaxed);
    // The workload goes round the series, so the last message's series is the last to be
    // complete: asked alone every `SENTINEL_EVERY` until it is (the broker may still hold a
    // backlog for bucketd), then every series.
    let last = (messages + series - 1) % series;
    while !right(Some(&agent), last) {
        std::thread::sleep(SENTINEL_EVERY);
        in_time();
    }
    let at = std::thread::scope(|scope| {
        let checks: Vec<_> = (0..DASHBOARD_CONNECTIONS)
            .map(|c| {
                let (right, in_time) = (&right, &in_time);
                scope.spawn(move || {
                    if let Some(cpu) = pinned(true) {
                        pin_thread(0, cpu);
                    }
                    let agent: ureq::Agent = ureq::Agent::config_builder().build().into();
                    let mut left: Vec<usize> = (0..series)
                        .filter(|k| k % DASHBOARD_CONNECTIONS == c)
                        .collect();
                    while !left.is_empty() {
                        left.retain(|&k| !right(Some(&agent), k));
                        in_time();
                    }
                    start.elapsed()
                })
            })
            .collect();
        checks
            .into_iter()
            .map(|c| c.join().unwrap())
            .max()
            .expect("one connection at least")
    });
    Seen {
        at,
        during,
        checks: asked.into_inner() - during,
    }
}

/// Each message's publish -> commit latency, sorted: from the instant it was handed to the
/// publishing client to the first poll of `/metrics` that counted its readings as committed.
/// One publisher's messages reach bucketd in order and a commit takes every message received
/// before it, so message `i` is committed once `(i + 1) * per_message` readings are. An upper
/// bound, by at most the poll interval and one HTTP request. Second, the same for the messages
/// whose commit waited for a checkpoint (one finished between the last poll before the message
/// was published and the poll that saw it committed): the writer runs one at a time.
fn commit_latencies(
    sent: &[Instant],
    per_message: u64,
    polls: &[(Instant, u64, u64)],
) -> (Vec<Duration>, Vec<Duration>) {
    let mut out = Vec::with_capacity(sent.len());
    let mut checkpointed = Vec::new();
    let (mut p, mut before) = (0, 0);
    for (i, &at) in sent.iter().enumerate() {
        let needed = (i as u64 + 1) * per_message;
        while polls[p].1 < needed {
            p += 1;
        }
        while before + 1 < polls.len() && polls[before + 1].0 <= at {
            before += 1;
        }
        let latency = polls[p].0.saturating_duration_since(at);
        out.push(latency);
        if polls[p].2 > polls[before].2 {
            checkpointed.push(latency);
        }
    }
    out.sort_unstable();
    checkpointed.sort_unstable();
    (out, checkpointed)
}

/// The `q` quantile of sorted durations, in milliseconds ("-" when there are none).
fn quantile_ms(sorted: &[Duration], q: f64) -> String {
    if sorted.is_empty() {
        return "-".to_owned();
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    format!("{:.1}", sorted[i].as_secs_f64() * 1e3)
}

#[path = "../tests/shared/bucketd_child.rs"]
mod bucketd_child;
#[path = "../tests/shared/own_mosquitto.rs"]
mod own_mosquitto;
use bucketd_child::BucketdChild;
#[path = "../tests/shared/own_rumqttd.rs"]
mod own_rumqttd;

/// bucketd's protocol in the runs: `BENCH_PROTOCOL=v311`, or MQTT 5.
fn bench_protocol() -> Protocol {
    match std::env::var("BENCH_PROTOCOL").as_deref() {
        Ok("v311") => Protocol::V311,
        _ => Protocol::V5,
    }
}

const CONTENDERS: [&str; 7] = [
    "null",
    "sqlite",
    "sqlite-1000",
    "bucketd",
    "bucketd-durable",
    "bucketd-noraw",
    "bucketd-visible",
];

/// A TCP delay line in front of `host:port`: every chunk read from either side is written to the
/// other half of `rtt` later, in order (a long link: cellular, a cloud broker). Returns its port.
async fn delay_line(host: String, port: u16, rtt: Duration) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let local = listener.local_addr().unwrap().port();
    let one_way = rtt / 2;
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect((host.as_str(), port)).await else {
                continue;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            for (mut from, mut to) in [(cr, sw), (sr, cw)] {
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n) = from.read(&mut buf).await {
                        if n == 0
                            || tx
                                .send((Instant::now() + one_way, buf[..n].to_vec()))
                                .is_err()
                        {
                            break;
                        }
                    }
                });
                tokio::spawn(async move {
                    while let Some((at, bytes)) = rx.recv().await {
                        tokio::time::sleep_until(at.into()).await;
                        if to.write_all(&bytes).await.is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown().await;
                });
            }
        }
    });
    local
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if let Ok(role) = std::env::var("BENCH_ROLE") {
        child(&role).await;
        return;
    }
    let window: Option<usize> = std::env::var("BENCH_WINDOW")
        .ok()
        .map(|w| w.parse().expect("BENCH_WINDOW is a number"));
    // The publisher and the null subscriber speak MQTT 3.1.1; bucketd `bench_protocol()`.
    let (_broker, addr, bucketd_port) = if let Some(window) = window {
        // A broker that enforces its window, as upstream Mosquitto, EMQX and AWS IoT do.
        let (v4, v5) = own_rumqttd::start(Some(window));
        let bucketd_port = if bench_protocol() == Protocol::V311 {
            v4
        } else {
            v5
        };
        (None, format!("127.0.0.1:{v4}"), Some(bucketd_port))
    } else if let Ok(addr) = std::env::var("BUCKETD_BENCH_MQTT") {
        (None, addr, None)
    } else {
        // Unlimited in-flight too: every subscriber here acknowledges late.
        let inflight = env_or("BENCH_MOSQUITTO_INFLIGHT", 0u16);
        let broker = own_mosquitto::OwnMosquitto::start(
            false,
            &format!(
                "max_inflight_messages {inflight}\n{}",
                if env_or("BENCH_MOSQUITTO_NODELAY", 0u8) == 1 {
                    "set_tcp_nodelay true\n"
                } else {
                    ""
                }
            ),
        );
        let addr = broker.addr();
        if let Some(cpu) = pinned(false) {
            pin_process(broker.pid().expect("running"), cpu);
        }
        (Some(broker), addr, None)
    };
    if let Some(cpu) = pinned(false) {
        // The publisher, the polls and the storage-alone runs (and an in-process rumqttd).
        pin_process(0, cpu);
    }
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    let port: u16 = port.parse().expect("port");
    let mut bucketd_port = bucketd_port.unwrap_or(port);
    let rtt = Duration::from_millis(env_or("BENCH_RTT_MS", 0u64));
    if !rtt.is_zero() {
        bucketd_port = delay_line(host.to_owned(), bucketd_port, rtt).await;
    }
    let messages = env_or("BENCH_MESSAGES", 200_000usize);
    let series = env_or("BENCH_SERIES", 1000usize);
    let per_message = env_or("BENCH_READINGS_PER_MESSAGE", 1usize);
    let runs = env_or("BENCH_RUNS", 3usize);
    let rate = env_or("BENCH_RATE", 0.0f64);
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let contenders: Vec<&str> = CONTENDERS
        .into_iter()
        .filter(|c| only.is_empty() || only.split(',').any(|o| o == *c))
        // The dashboard queries the `value` workload's series.
        .filter(|c| *c != "bucketd-visible" || per_message == 1)
        .collect();
    let pace = if rate > 0.0 {
        format!("{rate} messages/s")
    } else {
        "flat out".to_owned()
    };
    let broker = window.map_or_else(
        || format!("broker {addr}"),
        |w| {
            format!(
                "rumqttd with an in-flight window of {w}, bucketd over {:?}",
                bench_protocol()
            )
        },
    );
    println!(
        "workload: {messages} QoS 1 messages ({pace}), {series} series, {per_message} \
         reading(s)/message, {broker}, {runs} run(s){}",
        if rtt.is_zero() {
            String::new()
        } else {
            format!(", bucketd through a delay line of {rtt:?} round trip")
        }
    );
    if only.is_empty() || only.split(',').any(|o| o == "anchors") {
        let readings = env_or(
            "BENCH_STORE_READINGS",
            (messages * per_message).min(200_000),
        );
        println!(
            "storage alone (no MQTT): {readings} readings over {series} series, one hour; \
             name/N = N readings per transaction (a tenth of the readings at N = 1, a fortieth \
             for store/1)"
        );
        println!(
            "{:<16} {:>4} {:>12} {:>14} {:>14}",
            "anchor", "run", "readings/s", "CPU s/M read.", "written B/rd."
        );
        for run in 1..=runs {
            anchors(readings, series, run);
        }
    }
    println!(
        "{:<16} {:>4} {:>12} {:>10} {:>14} {:>12} {:>14} {:>8} {:>8} {:>8} {:>18}",
        "contender",
        "run",
        "readings/s",
        "vs null",
        "CPU s/M read.",
        "peak RSS MiB",
        "written B/rd.",
        "commits",
        "p50 ms",
        "p99 ms",
        "ckpt p99 ms (msgs)"
    );
    let id = std::process::id();
    for run in 1..=runs {
        let mut null_rate = None;
        for contender in &contenders {
            let prefix = format!("bench{}{id}r{run}", contender.replace('-', ""));
            let w = Workload {
                rate,
                ..workload(&prefix, messages, series, per_message)
            };
            let (readings, sum) = (w.readings, w.sum);
            let outcome = match *contender {
                "null" | "sqlite" | "sqlite-1000" => {
                    run_role(contender, host, port, &prefix, w).await
                }
                bucketd => run_bucketd(host, port, bucketd_port, &prefix, bucketd, w).await,
            };
            // What was ingested is right, however fast.
            if *contender == "null" {
                assert_eq!(outcome.count, messages as u64, "null: messages");
            } else {
                assert_eq!(outcome.count, readings, "{contender}: readings stored");
                assert!(
                    (outcome.sum - sum).abs() <= 1e-9 * sum.abs(),
                    "{contender}: sum {} != {sum}",
                    outcome.sum
                );
            }
            let rate = readings as f64 / outcome.took.as_secs_f64();
            let null = *null_rate.get_or_insert(rate);
            println!(
                "{:<16} {:>4} {:>12.0} {:>10.2} {:>14.2} {:>12.1} {:>14.1} {:>8} {:>8} {:>8} {:>18}",
                contender,
                run,
                rate,
                rate / null,
                outcome.usage.cpu_s / readings as f64 * 1e6,
                outcome.usage.peak_rss_kib as f64 / 1024.0,
                outcome.usage.write_bytes as f64 / readings as f64,
                outcome
                    .commits
                    .map_or_else(|| "-".to_owned(), |c| c.to_string()),
                quantile_ms(&outcome.latencies, 0.5),
                quantile_ms(&outcome.latencies, 0.99),
                format!(
                    "{} ({:.1}%)",
                    quantile_ms(&outcome.checkpointed, 0.99),
                    100.0 * outcome.checkpointed.len() as f64
                        / outcome.latencies.len().max(1) as f64
                ),
            );
            if let Some(seen) = &outcome.visible {
                println!(
                    "  {contender}: acknowledged at {:.2}x null, visible to queries at {:.2}x null \
                     ({} dashboard queries while publishing, then {} until every series was \
                     right; checkpoints 10 minutes apart)",
                    rate / null,
                    readings as f64 / seen.at.as_secs_f64() / null,
                    seen.during,
                    seen.checks,
                );
            }
            // A window of 1 allows one message per round trip and commit; the null's period
            // is the round trip (its own work included).
            if window == Some(1)
                && let Some(commit) = outcome.mean_commit
            {
                let n = per_message as f64;
                let period = n / null;
                let bound = n / (period + commit.as_secs_f64());
                println!(
                    "  window 1: 1 / (null's period {:.1} µs + mean commit {:.3} ms) = {bound:.0} readings/s; {contender} at {:.2} of it",
                    1e6 * period,
                    1e3 * commit.as_secs_f64(),
                    rate / bound,
                );
            }
        }
    }
}
