//! The payload formats against `json` on the same readings (issue 54): one device's 20 metrics
//! at one time, as each format carries them, decoded over and over. Reports readings per second
//! and allocations per reading for each, and each format's time per reading as a ratio of the
//! flat `json` object's, measured in the same run (rounds interleaved, median of the rounds).
//!
//! Then what the target names, the daemon's CPU at a gateway's rate: for each format, the
//! built `bucketd run` (shipped defaults, one subscription of that format) on a Mosquitto of its
//! own, a publisher sending one device's 20 metrics ten times a second (200 readings a second,
//! timestamped as sent; Sparkplug's DBIRTH first, then DDATA by alias) for
//! `FORMATS_DAEMON_SECS` (default 60); the daemon's CPU (all its threads' time on a CPU,
//! `/proc/<pid>/task/*/schedstat`) from the first publish until every reading is committed, per
//! second and as a ratio of `json`'s; `FORMATS_DAEMON_ROUNDS` rounds (default 2), formats
//! interleaved, medians.
//!
//! `cargo bench --bench formats` (`FORMATS_ROUNDS`, default 15; `FORMATS_MESSAGES` per round,
//! default 20,000; `FORMATS_DAEMON_SECS=0` for the decoders alone).

// Set-up reads top to bottom; the 100-line limit (clippy.toml) holds the library.
#![allow(clippy::too_many_lines)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;
use std::time::Instant;

use bucketd::config::{Config, Subscription};
use bucketd::decode::sparkplug::{Metric, Payload, Value};
use bucketd::decode::{Births, DecodeContext, Decoded, Format, Template, decode_with};
use bucketd::reading::Timestamp;
use prost::Message;

#[path = "../tests/shared/bucketd_child.rs"]
mod bucketd_child;
#[path = "../tests/shared/own_mosquitto.rs"]
mod own_mosquitto;
#[path = "../tests/shared/prom.rs"]
mod prom;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// Counts this thread's allocations (the decoder runs on the benchmark's thread).
struct Counting;

// SAFETY: every call goes to `System` unchanged; the count is a const thread-local `Cell`.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        unsafe { System.alloc(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

const NOW_S: i64 = 1_763_719_200;
const METRICS: usize = 20;

fn ctx() -> DecodeContext {
    DecodeContext {
        received: Timestamp::from_secs(NOW_S),
        oldest: Timestamp::from_secs(NOW_S - 30 * 86_400),
        newest: Timestamp::from_secs(NOW_S + 600),
        max_payload_bytes: 1 << 20,
    }
}

fn value(i: usize) -> f64 {
    20.0 + i as f64 * 0.37
}

/// One format's case: its subscription, topic, payload and the births state it reads with.
struct Case {
    name: &'static str,
    sub: Subscription,
    topic: String,
    payload: Vec<u8>,
    births: Births,
}

fn cases() -> Vec<Case> {
    let json = Config::load(None, Vec::new()).unwrap().subscriptions[1].clone();
    let with = |format: Format, filter: &str, template: &str| {
        let mut s = json.clone();
        s.format = format;
        s.filter = filter.into();
        s.template = Template::parse(template).unwrap();
        s.timestamp_field = None;
        s
    };
    let ms = NOW_S * 1000;
    let fields: Vec<String> = (0..METRICS)
        .map(|i| format!("\"m{i}\": {}", value(i)))
        .collect();
    let flat = format!("{{\"ts\": {ms}, {}}}", fields.join(", "));
    let nested = format!(
        "{{\"ts\": {ms}, \"ENERGY\": {{{}}}, \"Status\": {{{}}}}}",
        fields[..10].join(", "),
        fields[10..].join(", ")
    );
    // The same payloads as the daemon part publishes, at the fixed time (whole seconds: the
    // values are `value(i)` exactly).
    let line = daemon_payload(Format::Influx, ms, false);
    let senml = daemon_payload(Format::Senml, ms, false);
    let payload = |birth: bool| daemon_payload(Format::SparkplugB, ms, birth);
    let spb = with(Format::SparkplugB, "spBv1.0/#", "spBv1.0/#");
    // The data names its metrics by alias, after the birth that gave them.
    let mut births = Births::default();
    decode_with(
        &spb,
        b"spBv1.0/plant/DBIRTH/edge1/s17",
        &payload(true),
        &ctx(),
        &mut births,
        &mut Decoded::default(),
    )
    .unwrap();
    let mut json_ts = json.clone();
    json_ts.timestamp_field = Some("ts".into());
    vec![
        Case {
            name: "json (flat object: the baseline)",
            sub: json_ts.clone(),
            topic: "devices/s17/telemetry".into(),
            payload: flat.into_bytes(),
            births: Births::default(),
        },
        Case {
            name: "json (nested objects)",
            sub: json_ts,
            topic: "devices/s17/telemetry".into(),
            payload: nested.into_bytes(),
            births: Births::default(),
        },
        Case {
            name: "influx (one line, 20 fields)",
            sub: with(Format::Influx, "telegraf/#", "telegraf/#"),
            topic: "telegraf/s17".into(),
            payload: line,
            births: Births::default(),
        },
        Case {
            name: "senml (a pack of 20 records)",
            sub: with(Format::Senml, "senml/+", "senml/{sensor}"),
            topic: "senml/s17".into(),
            payload: senml,
            births: Births::default(),
        },
        Case {
            name: "sparkplug_b (DDATA by alias)",
            sub: spb,
            topic: "spBv1.0/plant/DDATA/edge1/s17".into(),
            payload: payload(false),
            births,
        },
    ]
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // `cargo test` builds this without optimisation (and passes no `--bench`): one quick round
    // of the decoders then, and no daemon part (a debug build's CPU measures nothing).
    let quick = cfg!(debug_assertions)
        || (std::env::args().any(|a| a == "--test") && std::env::args().all(|a| a != "--bench"));
    let rounds = if quick { 1 } else { env("FORMATS_ROUNDS", 15) };
    let messages = if quick {
        100
    } else {
        env("FORMATS_MESSAGES", 20_000)
    };
    let mut cases = cases();
    let mut out = Decoded::default();
    let c = ctx();
    // Each case decodes to the same 20 readings, or the comparison means nothing.
    for case in &mut cases {
        decode_with(
            &case.sub,
            case.topic.as_bytes(),
            &case.payload,
            &c,
            &mut case.births,
            &mut out,
        )
        .unwrap();
        assert_eq!(out.readings().len(), METRICS, "{}", case.name);
        assert!(out.rejected.is_empty(), "{}: {:?}", case.name, out.rejected);
        let mut values: Vec<f64> = out.readings().map(|r| r.value).collect();
        values.sort_by(f64::total_cmp);
        let mut want: Vec<f64> = (0..METRICS).map(value).collect();
        want.sort_by(f64::total_cmp);
        assert_eq!(values, want, "{}", case.name);
    }
    let mut per_reading: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let mut allocations = vec![0u64; cases.len()];
    for _ in 0..rounds {
        for (k, case) in cases.iter_mut().enumerate() {
            let before = ALLOCATIONS.with(Cell::get);
            let start = Instant::now();
            for _ in 0..messages {
                decode_with(
                    &case.sub,
                    case.topic.as_bytes(),
                    black_box(&case.payload),
                    &c,
                    &mut case.births,
                    &mut out,
                )
                .unwrap();
            }
            let secs = start.elapsed().as_secs_f64();
            allocations[k] = ALLOCATIONS.with(Cell::get) - before;
            per_reading[k].push(secs / (messages * METRICS) as f64);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let medians: Vec<f64> = per_reading.iter_mut().map(median).collect();
    println!(
        "{messages} messages of {METRICS} readings per format and round, {rounds} round(s), medians"
    );
    println!(
        "{:<36} {:>14} {:>14} {:>18}",
        "format", "readings/s", "allocs/reading", "time vs json flat"
    );
    for (k, case) in cases.iter().enumerate() {
        println!(
            "{:<36} {:>14.0} {:>14.2} {:>17.2}x",
            case.name,
            1.0 / medians[k],
            allocations[k] as f64 / (messages * METRICS) as f64,
            medians[k] / medians[0]
        );
    }
    let secs = env("FORMATS_DAEMON_SECS", 60);
    if !quick && secs > 0 {
        daemon_cpu(secs as u64, env("FORMATS_DAEMON_ROUNDS", 2));
    }
}

/// The formats the daemon part publishes, in the order of its table.
const DAEMON_FORMATS: [Format; 4] = [
    Format::Json,
    Format::Influx,
    Format::Senml,
    Format::SparkplugB,
];

/// The subscription of `format` under `prefix` (Sparkplug's topics are its own: `spBv1.0/...`,
/// the group named after `prefix`), and the topic one device publishes on.
fn daemon_subscription(format: Format, prefix: &str) -> (bucketd::config::RawSubscription, String) {
    let mut sub = bucketd::config::RawSubscription::defaults_under(prefix)
        .into_iter()
        .find(|s| s.format == Format::Json)
        .expect("a json subscription among the defaults");
    sub.format = format;
    sub.sensor_field = None;
    sub.timestamp_field = None;
    let (filter, template, topic) = match format {
        Format::Json => {
            sub.timestamp_field = Some("ts".into());
            (
                format!("{prefix}/devices/+/telemetry"),
                Some(format!("{prefix}/devices/{{sensor}}/telemetry")),
                format!("{prefix}/devices/s17/telemetry"),
            )
        }
        Format::Influx => (
            format!("{prefix}/telegraf/#"),
            None,
            format!("{prefix}/telegraf/s17"),
        ),
        Format::Senml => (
            format!("{prefix}/senml/+"),
            Some(format!("{prefix}/senml/{{sensor}}")),
            format!("{prefix}/senml/s17"),
        ),
        _ => (
            format!("spBv1.0/{prefix}/#"),
            None,
            format!("spBv1.0/{prefix}/DDATA/edge1/s17"),
        ),
    };
    sub.filter = filter;
    sub.template = template;
    (sub, topic)
}

/// One message of the device's 20 metrics at `ms`, in `format` (Sparkplug: by alias, or the
/// birth naming them when `birth`).
fn daemon_payload(format: Format, ms: i64, birth: bool) -> Vec<u8> {
    let v = |i: usize| value(i) + (ms % 1000) as f64 / 1000.0;
    match format {
        Format::Json => format!(
            "{{\"ts\": {ms}, {}}}",
            (0..METRICS)
                .map(|i| format!("\"m{i}\": {}", v(i)))
                .collect::<Vec<_>>()
                .join(", ")
        )
        .into_bytes(),
        Format::Influx => format!(
            "dev,site=s17 {} {}",
            (0..METRICS)
                .map(|i| format!("m{i}={}", v(i)))
                .collect::<Vec<_>>()
                .join(","),
            ms * 1_000_000
        )
        .into_bytes(),
        Format::Senml => format!(
            "[{}]",
            (0..METRICS)
                .map(|i| if i == 0 {
                    format!(
                        "{{\"bn\":\"s17:\",\"bt\":{}.{:03},\"n\":\"m0\",\"v\":{}}}",
                        ms / 1000,
                        ms % 1000,
                        v(0)
                    )
                } else {
                    format!("{{\"n\":\"m{i}\",\"v\":{}}}", v(i))
                })
                .collect::<Vec<_>>()
                .join(",")
        )
        .into_bytes(),
        _ => Payload {
            timestamp: Some(ms as u64),
            metrics: (0..METRICS)
                .map(|i| Metric {
                    name: birth.then(|| format!("m{i}")),
                    alias: Some(i as u64),
                    datatype: Some(10),
                    timestamp: Some(ms as u64),
                    value: Some(Value::Double(v(i))),
                    ..Metric::default()
                })
                .collect(),
            seq: Some(1),
            uuid: None,
        }
        .encode_to_vec(),
    }
}

/// The format's name in a configuration (`sparkplug_b`).
fn format_name(format: Format) -> String {
    serde_json::to_value(format)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// A process's CPU time so far, all its threads' (`/proc/<pid>/task/*/schedstat`: nanoseconds
/// on a CPU; `/proc/<pid>/stat` counts 10 ms ticks, too coarse for a daemon using ~2 ms a
/// second). Threads that have exited are not counted: bucketd's threads live as long as it does.
fn cpu_of(pid: u32) -> std::time::Duration {
    let mut nanos = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let path = task.unwrap().path().join("schedstat");
        if let Ok(text) = std::fs::read_to_string(path) {
            nanos += text
                .split_whitespace()
                .next()
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    std::time::Duration::from_nanos(nanos)
}

/// One run of `format`: the daemon's CPU seconds per second of the run.
fn daemon_run(broker: &own_mosquitto::OwnMosquitto, format: Format, secs: u64, run: usize) -> f64 {
    let prefix = format!(
        "fb{}r{run}{}",
        std::process::id(),
        format_name(format).replace('_', "")
    );
    let (sub, topic) = daemon_subscription(format, &prefix);
    let dir = tempfile::tempdir().unwrap();
    let mut raw = bucketd::config::RawConfig::load(None, Vec::new()).unwrap();
    raw.mqtt.host = "127.0.0.1".into();
    raw.mqtt.port = broker.port;
    raw.mqtt.client_id = format!("bench-{prefix}");
    raw.store.path = dir.path().join("gateway.redb");
    raw.http.bind = "127.0.0.1:0".into();
    raw.subscriptions = vec![sub];
    let daemon =
        bucketd_child::BucketdChild::start(env!("CARGO_BIN_EXE_bucketd"), &raw, dir.path(), 1);
    let pid = daemon.child.id();
    let messages = secs * 10;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let cpu0 = cpu_of(pid);
    let start = Instant::now();
    runtime.block_on(async {
        let mut options =
            rumqttc::MqttOptions::new(format!("pub-{prefix}"), "127.0.0.1", broker.port);
        options.set_keep_alive(std::time::Duration::from_secs(30));
        let (client, mut eventloop) = rumqttc::AsyncClient::new(options, 64);
        tokio::spawn(async move { while eventloop.poll().await.is_ok() {} });
        let now_ms = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as i64
        };
        if format == Format::SparkplugB {
            let birth = topic.replace("/DDATA/", "/DBIRTH/");
            client
                .publish(
                    birth,
                    rumqttc::QoS::AtLeastOnce,
                    false,
                    daemon_payload(format, now_ms(), true),
                )
                .await
                .unwrap();
        }
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
        for _ in 0..messages {
            tick.tick().await;
            client
                .publish(
                    &topic,
                    rumqttc::QoS::AtLeastOnce,
                    false,
                    daemon_payload(format, now_ms(), false),
                )
                .await
                .unwrap();
        }
    });
    // Until every reading is committed (the birth's too, for Sparkplug: it carries values).
    let expect = (messages + u64::from(format == Format::SparkplugB)) * METRICS as u64;
    loop {
        let text = ureq::get(&daemon.metrics_url)
            .call()
            .unwrap()
            .into_body()
            .read_to_string()
            .unwrap();
        let ingested = prom::metric(&text, "bucketd_readings_ingested_total") as u64;
        assert!(
            ingested <= expect,
            "{format:?}: {ingested} readings of {expect}"
        );
        if ingested == expect {
            break;
        }
        assert!(
            start.elapsed().as_secs() < secs + 60,
            "{format:?}: {ingested} of {expect} readings"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let cpu = cpu_of(pid).saturating_sub(cpu0);
    let span = start.elapsed();
    daemon.stop();
    cpu.as_secs_f64() / span.as_secs_f64()
}

/// The daemon part: each format's CPU at 200 readings a second against `json`'s.
fn daemon_cpu(secs: u64, rounds: usize) {
    let broker = own_mosquitto::OwnMosquitto::start(false, "");
    let mut per_second: Vec<Vec<f64>> = vec![Vec::new(); DAEMON_FORMATS.len()];
    for round in 0..rounds {
        for (k, format) in DAEMON_FORMATS.iter().enumerate() {
            per_second[k].push(daemon_run(&broker, *format, secs, round));
        }
    }
    println!(
        "\nthe daemon at 200 readings a second (10 messages of 20), {secs} s a run, {rounds} round(s), medians"
    );
    println!(
        "{:<12} {:>18} {:>12}",
        "format", "CPU ms a second", "vs json"
    );
    let medians: Vec<f64> = per_second
        .iter_mut()
        .map(|v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect();
    for (k, format) in DAEMON_FORMATS.iter().enumerate() {
        println!(
            "{:<12} {:>18.2} {:>11.2}x   (runs: {})",
            format_name(*format),
            medians[k] * 1000.0,
            medians[k] / medians[0],
            per_second[k]
                .iter()
                .map(|c| format!("{:.2}", c * 1000.0))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}
