//! Workloads: topics of one test, a deterministic generator, and messages with the readings and
//! rejections they must cause.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use bucketd::config::RawSubscription;
use bucketd::export::number;

use super::{Expected, unique};

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

/// Messages to publish, the readings they must produce, and the rejections they must cause.
#[derive(Default)]
pub struct Workload {
    pub messages: Vec<(String, Vec<u8>)>,
    pub readings: Vec<Expected>,
    pub rejected: BTreeMap<&'static str, u64>,
}

impl Workload {
    pub fn extend(&mut self, other: Workload) {
        self.messages.extend(other.messages);
        self.readings.extend(other.readings);
        for (k, v) in other.rejected {
            *self.rejected.entry(k).or_default() += v;
        }
    }

    pub fn rejected_total(&self) -> u64 {
        self.rejected.values().sum()
    }
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// About `readings` readings over several series and the last three hours: JSON objects and
/// arrays with device timestamps (ms, seconds, RFC 3339), out of order and across hour
/// boundaries, plus value payloads; `bad` malformed messages mixed in.
pub fn workload(topics: &Topics, seed: u64, readings: usize, bad: usize) -> Workload {
    workload_with(topics, seed, readings, bad, true)
}

/// [`workload`] with only device-timestamped readings: every message is recognisable as a
/// redelivery whatever the broker does with DUP (rumqttd never sets it).
pub fn stamped_workload(topics: &Topics, seed: u64, readings: usize) -> Workload {
    workload_with(topics, seed, readings, 0, false)
}

fn workload_with(
    topics: &Topics,
    seed: u64,
    readings: usize,
    bad: usize,
    receive_time: bool,
) -> Workload {
    let mut rng = Rng::new(seed);
    let now = now_secs();
    let mut w = Workload::default();
    let sensors = ["d0", "d1", "d2", "d3"];
    let metrics = ["temperature", "humidity"];
    while w.readings.len() < readings {
        if rng.below(4) == 0 && receive_time {
            // A value payload: stamped with the receive time.
            let sensor = ["s0", "s1"][rng.below(2) as usize];
            let v = rng.value();
            w.messages
                .push((topics.value(sensor, "level"), number(v).into_bytes()));
            w.readings.push(Expected {
                series: format!("{sensor}/level"),
                ts: None,
                value: v,
            });
            continue;
        }
        let sensor = sensors[rng.below(4) as usize];
        let objects = 1 + rng.below(8) as usize;
        let mut items = Vec::new();
        for _ in 0..objects {
            let ts_ms = (now - 3 * 3600) * 1000 + rng.below(3 * 3600 * 1000 - 1000) as i64;
            let ts_field = match rng.below(3) {
                0 => format!("{ts_ms}"),
                // Whole seconds: the reading's time is the second.
                1 => format!("{}", ts_ms / 1000),
                _ => format!(
                    "\"{}\"",
                    bucketd::reading::Timestamp::from_nanos(ts_ms * 1_000_000).to_rfc3339_millis()
                ),
            };
            let ts_ns = if ts_field.len() == 10 {
                ts_ms / 1000 * 1_000_000_000
            } else {
                ts_ms * 1_000_000
            };
            let mut fields = vec![format!("\"ts\": {ts_field}"), "\"status\": \"ok\"".into()];
            for metric in metrics {
                if rng.below(3) > 0 {
                    let v = rng.value();
                    fields.push(format!("\"{metric}\": {}", number(v)));
                    w.readings.push(Expected {
                        series: format!("{sensor}/{metric}"),
                        ts: Some(ts_ns),
                        value: v,
                    });
                }
            }
            items.push(format!("{{{}}}", fields.join(", ")));
        }
        let payload = if items.len() == 1 && rng.below(2) == 0 {
            items.pop().unwrap()
        } else {
            format!("[{}]", items.join(", "))
        };
        // An item without any metric makes a whole message without readings: count it.
        if !payload.contains("temperature") && !payload.contains("humidity") {
            *w.rejected.entry("no_readings").or_default() += 1;
        }
        w.messages.push((topics.json(sensor), payload.into_bytes()));
    }
    let old = (now - 40 * 86_400) * 1000;
    let bad_messages: [(String, &[u8], &str); 6] = [
        (topics.value("s0", "level"), b"warm", "invalid_number"),
        (topics.value("s0", "level"), b"NaN", "non_finite"),
        (topics.value("s1", "level"), b"", "empty_payload"),
        (topics.json("d0"), b"{\"temperature\": 2", "invalid_json"),
        (topics.json("d1"), b"{\"status\": \"ok\"}", "no_readings"),
        (topics.json("d2"), b"[1, 2]", "not_an_object"),
    ];
    for i in 0..bad {
        let (topic, payload, reason) = &bad_messages[i % bad_messages.len()];
        let at = rng.below(w.messages.len() as u64) as usize;
        w.messages.insert(at, (topic.clone(), payload.to_vec()));
        *w.rejected.entry(reason).or_default() += 1;
    }
    let too_old = format!("{{\"ts\": {old}, \"temperature\": 1}}");
    w.messages.push((topics.json("d3"), too_old.into_bytes()));
    *w.rejected.entry("timestamp_out_of_range").or_default() += 1;
    w
}
