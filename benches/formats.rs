//! The payload formats against `json` on the same readings (issue 54): one device's 20 metrics
//! at one time, as each format carries them, decoded over and over. Reports readings per second
//! and allocations per reading for each, and each format's time per reading as a ratio of the
//! flat `json` object's, measured in the same run (rounds interleaved, median of the rounds).
//!
//! `cargo bench --bench formats` (`FORMATS_ROUNDS`, default 15; `FORMATS_MESSAGES` per round,
//! default 20,000).

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
    let line = format!(
        "dev,site=s17 {} {}",
        (0..METRICS)
            .map(|i| format!("m{i}={}", value(i)))
            .collect::<Vec<_>>()
            .join(","),
        NOW_S * 1_000_000_000
    );
    let senml = format!(
        "[{}]",
        (0..METRICS)
            .map(|i| if i == 0 {
                format!(
                    "{{\"bn\":\"s17:\",\"bt\":{NOW_S},\"n\":\"m0\",\"v\":{}}}",
                    value(0)
                )
            } else {
                format!("{{\"n\":\"m{i}\",\"v\":{}}}", value(i))
            })
            .collect::<Vec<_>>()
            .join(",")
    );
    let metric = |i: usize, birth: bool| Metric {
        name: birth.then(|| format!("m{i}")),
        alias: Some(i as u64),
        datatype: Some(10),
        timestamp: Some(ms as u64),
        value: Some(Value::Double(value(i))),
        ..Metric::default()
    };
    let payload = |birth: bool| {
        Payload {
            timestamp: Some(ms as u64),
            metrics: (0..METRICS).map(|i| metric(i, birth)).collect(),
            seq: Some(1),
            uuid: None,
        }
        .encode_to_vec()
    };
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
            payload: line.into_bytes(),
            births: Births::default(),
        },
        Case {
            name: "senml (a pack of 20 records)",
            sub: with(Format::Senml, "senml/+", "senml/{sensor}"),
            topic: "senml/s17".into(),
            payload: senml.into_bytes(),
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
    // `cargo test --benches` runs this with `--test`-like arguments: one quick round then.
    let quick = std::env::args().any(|a| a == "--test" || a == "--bench")
        && std::env::args().all(|a| a != "--bench");
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
}
