//! Turns one MQTT message (topic, payload) into readings, or into rejections with a reason.
//! Pure: the caller supplies the receive time and the clock-derived bounds; nothing here does I/O.
//!
//! Message-level faults (bad JSON, wrong topic, oversized payload) reject the whole message once.
//! Reading-level faults (a non-finite value, a timestamp out of range, a bad name) reject only that
//! reading; the message's other readings are kept.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::delta::{DeltaMessage, Position};
use crate::reading::{Reading, Timestamp, validate_name};
pub use crate::reject::DecodeError;

/// How a subscription's payloads are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// The payload is one number, e.g. `21.5`; sensor and metric come from the topic.
    Value,
    /// A JSON object, or an array of them; every numeric top-level field is a metric.
    Json,
    /// A bucketd delta message (BSON [`DeltaMessage`]) from a gateway's forwarder: bucket
    /// summaries, merged as they are; series become `<gateway_id>:<sensor>/<metric>`.
    Delta,
}

/// Unit of numeric timestamps in payloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TimestampUnit {
    /// Decide by magnitude: below 1e11 seconds, below 1e14 milliseconds, below 1e17
    /// microseconds, else nanoseconds (each boundary is past the year 5000 in the smaller unit).
    #[default]
    Auto,
    S,
    Ms,
    Us,
    Ns,
}

/// One level of a topic template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Level {
    Literal(String),
    Sensor,
    Metric,
    Skip,
    /// `#`: any number of remaining levels (last level only).
    Rest,
}

/// A topic template such as `sensors/{sensor}/{metric}`, matched level by level.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    levels: Vec<Level>,
}

impl Template {
    pub fn parse(text: &str) -> Result<Template, String> {
        if text.is_empty() {
            return Err("must not be empty".into());
        }
        let parts: Vec<&str> = text.split('/').collect();
        let mut levels = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            let level = match *part {
                "{sensor}" => Level::Sensor,
                "{metric}" => Level::Metric,
                "{_}" | "+" => Level::Skip,
                "#" if i + 1 == parts.len() => Level::Rest,
                p if p.contains(['{', '}', '+', '#']) => {
                    return Err(format!(
                        "level `{p}` is not a literal, {{sensor}}, {{metric}}, {{_}}, + or a final #"
                    ));
                }
                p => Level::Literal(p.to_owned()),
            };
            if levels.contains(&level) && matches!(level, Level::Sensor | Level::Metric) {
                return Err(format!("`{part}` appears twice"));
            }
            levels.push(level);
        }
        Ok(Template { levels })
    }

    pub fn has_sensor(&self) -> bool {
        self.levels.contains(&Level::Sensor)
    }

    pub fn has_metric(&self) -> bool {
        self.levels.contains(&Level::Metric)
    }

    /// Whether every topic the filter can match has the levels this template expects: equal
    /// level counts (or a trailing `#` in both), literals equal to the filter's literals, and
    /// names taken only from wildcard levels.
    pub fn fits_filter(&self, filter: &str) -> bool {
        let filter_levels: Vec<&str> = filter.split('/').collect();
        let ends_open = |l: &[&str]| l.last() == Some(&"#");
        let ours_open = self.levels.last() == Some(&Level::Rest);
        if ours_open != ends_open(&filter_levels) || self.levels.len() != filter_levels.len() {
            return false;
        }
        self.levels
            .iter()
            .zip(&filter_levels)
            .all(|(ours, theirs)| match ours {
                Level::Literal(l) => l == theirs || *theirs == "+",
                Level::Sensor | Level::Metric | Level::Skip => *theirs == "+",
                Level::Rest => *theirs == "#",
            })
    }

    /// Takes (sensor, metric) from a topic; `None` when the topic does not fit the template.
    pub fn capture<'t>(&self, topic: &'t str) -> Option<(Option<&'t str>, Option<&'t str>)> {
        let mut sensor = None;
        let mut metric = None;
        let mut parts = topic.split('/');
        for level in &self.levels {
            if level == &Level::Rest {
                return Some((sensor, metric));
            }
            let part = parts.next()?;
            match level {
                Level::Literal(l) if l != part => return None,
                Level::Sensor => sensor = Some(part),
                Level::Metric => metric = Some(part),
                _ => {}
            }
        }
        parts.next().is_none().then_some((sensor, metric))
    }
}

/// One validated subscription: the MQTT filter plus how to turn its messages into readings.
#[derive(Debug, Clone)]
pub struct Subscription {
    pub filter: String,
    pub qos: u8,
    pub template: Template,
    pub format: Format,
    pub timestamp_field: Option<String>,
    pub timestamp_unit: TimestampUnit,
    pub sensor_field: Option<String>,
    pub store_raw: bool,
}

/// What decoding needs besides the message: the receive time and the accepted time range.
#[derive(Debug, Clone, Copy)]
pub struct DecodeContext {
    pub received: Timestamp,
    pub oldest: Timestamp,
    pub newest: Timestamp,
    pub max_payload_bytes: usize,
}

/// The outcome of decoding one message: its good readings and its reading-level rejections.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Decoded {
    pub readings: Vec<Reading>,
    /// Bucket summaries of a [`Format::Delta`] message.
    pub deltas: Vec<Delta>,
    pub rejected: Vec<DecodeError>,
    /// Some reading took the receive time (the payload had no timestamp for it).
    pub receive_time: bool,
    /// A delta message's gateway and position in its stream (`fleet::applied`).
    pub delta_from: Option<(String, Position)>,
}

impl Decoded {
    pub fn clear(&mut self) {
        self.readings.clear();
        self.deltas.clear();
        self.rejected.clear();
        self.receive_time = false;
        self.delta_from = None;
    }

    fn push(&mut self, ctx: &DecodeContext, sensor: &str, metric: &str, ts: Timestamp, value: f64) {
        let result = (|| {
            if !value.is_finite() {
                return Err(DecodeError::NonFinite);
            }
            if ts < ctx.oldest || ts > ctx.newest {
                return Err(DecodeError::TimestampOutOfRange);
            }
            validate_name(sensor)?;
            validate_name(metric)?;
            Ok(Reading::new(sensor, metric, ts, value))
        })();
        match result {
            Ok(reading) => self.readings.push(reading),
            Err(e) => self.rejected.push(e),
        }
    }
}

/// Decodes one message into `out` (cleared first). `Err` rejects the whole message.
pub fn decode(
    sub: &Subscription,
    topic: &[u8],
    payload: &[u8],
    ctx: &DecodeContext,
    out: &mut Decoded,
) -> Result<(), DecodeError> {
    out.clear();
    if payload.len() > ctx.max_payload_bytes {
        return Err(DecodeError::PayloadTooLarge);
    }
    if payload.iter().all(u8::is_ascii_whitespace) {
        return Err(DecodeError::EmptyPayload);
    }
    let topic = std::str::from_utf8(topic).map_err(|_| DecodeError::InvalidUtf8)?;
    let (sensor, metric) = sub
        .template
        .capture(topic)
        .ok_or(DecodeError::TopicMismatch)?;
    match sub.format {
        Format::Value => {
            let (Some(sensor), Some(metric)) = (sensor, metric) else {
                unreachable!("config validation requires {{sensor}} and {{metric}} for value")
            };
            let value = decode_value(payload)?;
            out.receive_time = true;
            out.push(ctx, sensor, metric, ctx.received, value);
        }
        Format::Json => decode_json(sub, sensor, payload, ctx, out)?,
        Format::Delta => decode_delta(payload, out)?,
    }
    if out.readings.is_empty() && out.deltas.is_empty() && out.rejected.is_empty() {
        return Err(DecodeError::NoReadings);
    }
    Ok(())
}

/// One bucket of a delta message.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    /// `<gateway_id>:<sensor>/<metric>`.
    pub series: String,
    pub start: i64,
    pub width_secs: i64,
    pub summary: crate::summary::Summary,
}

fn decode_delta(payload: &[u8], out: &mut Decoded) -> Result<(), DecodeError> {
    let msg: DeltaMessage =
        bson::deserialize_from_slice(payload).map_err(|_| DecodeError::InvalidDelta)?;
    if !crate::reading::valid_gateway_id(&msg.gateway_id) {
        return Err(DecodeError::InvalidName);
    }
    for b in &msg.buckets {
        let summary = b.summary();
        let sane = crate::reading::validate_series(&b.series).is_ok()
            && summary.count > 0
            && summary.min <= summary.max
            && summary.sum.is_finite()
            && b.end > b.start;
        if !sane {
            return Err(DecodeError::InvalidDelta);
        }
        out.deltas.push(Delta {
            series: format!("{}:{}", msg.gateway_id, b.series),
            start: b.start,
            width_secs: b.end - b.start,
            summary,
        });
    }
    out.delta_from = Some((
        msg.gateway_id,
        Position {
            origin: msg.origin,
            seq: msg.seq,
            part: msg.part,
        },
    ));
    Ok(())
}

fn decode_value(payload: &[u8]) -> Result<f64, DecodeError> {
    let text = std::str::from_utf8(payload).map_err(|_| DecodeError::InvalidUtf8)?;
    // Rust's float parser is correctly rounded, so the device's decimal maps to the nearest f64.
    let value: f64 = text
        .trim()
        .parse()
        .map_err(|_| DecodeError::InvalidNumber)?;
    if !value.is_finite() {
        return Err(DecodeError::NonFinite);
    }
    Ok(value)
}

fn decode_json(
    sub: &Subscription,
    topic_sensor: Option<&str>,
    payload: &[u8],
    ctx: &DecodeContext,
    out: &mut Decoded,
) -> Result<(), DecodeError> {
    let root: Value = serde_json::from_slice(payload).map_err(|e| {
        if std::str::from_utf8(payload).is_err() {
            DecodeError::InvalidUtf8
        } else if e.to_string().starts_with("number out of range") {
            DecodeError::NonFinite
        } else {
            DecodeError::InvalidJson
        }
    })?;
    match &root {
        Value::Object(object) => decode_object(sub, topic_sensor, object, ctx, out),
        Value::Array(items) => {
            for item in items {
                let Value::Object(object) = item else {
                    return Err(DecodeError::NotAnObject);
                };
                decode_object(sub, topic_sensor, object, ctx, out);
            }
        }
        _ => return Err(DecodeError::NotAnObject),
    }
    Ok(())
}

fn decode_object(
    sub: &Subscription,
    topic_sensor: Option<&str>,
    object: &serde_json::Map<String, Value>,
    ctx: &DecodeContext,
    out: &mut Decoded,
) {
    let sensor_owned;
    let sensor = match &sub.sensor_field {
        None => topic_sensor.expect("config validation requires {sensor} without sensor_field"),
        Some(field) => match object.get(field) {
            Some(Value::String(s)) => s.as_str(),
            Some(Value::Number(n)) if n.is_u64() || n.is_i64() => {
                sensor_owned = n.to_string();
                sensor_owned.as_str()
            }
            _ => {
                out.rejected.push(DecodeError::InvalidName);
                return;
            }
        },
    };
    let ts = match sub.timestamp_field.as_ref().and_then(|f| object.get(f)) {
        None => {
            out.receive_time = true;
            ctx.received
        }
        Some(value) => {
            if let Some(ts) = parse_timestamp(value, sub.timestamp_unit) {
                ts
            } else {
                out.rejected.push(DecodeError::InvalidTimestamp);
                return;
            }
        }
    };
    for (key, value) in object {
        let is_special =
            Some(key) == sub.timestamp_field.as_ref() || Some(key) == sub.sensor_field.as_ref();
        if is_special {
            continue;
        }
        // Non-numeric fields (status strings, flags, nested objects) are not metrics.
        if let Value::Number(n) = value {
            let value = n.as_f64().expect("serde_json numbers are f64-convertible");
            out.push(ctx, sensor, key, ts, value);
        }
    }
}

/// Parses a payload timestamp: a number in `unit` (or by magnitude), or an RFC 3339 string.
pub fn parse_timestamp(value: &Value, unit: TimestampUnit) -> Option<Timestamp> {
    match value {
        Value::Number(n) => {
            let v = n.as_f64()?;
            if !v.is_finite() {
                return None;
            }
            let unit = match unit {
                TimestampUnit::Auto => {
                    let magnitude = v.abs();
                    if magnitude < 1e11 {
                        TimestampUnit::S
                    } else if magnitude < 1e14 {
                        TimestampUnit::Ms
                    } else if magnitude < 1e17 {
                        TimestampUnit::Us
                    } else {
                        TimestampUnit::Ns
                    }
                }
                unit => unit,
            };
            let nanos_per_unit = match unit {
                TimestampUnit::S => 1_000_000_000_i64,
                TimestampUnit::Ms => 1_000_000,
                TimestampUnit::Us => 1_000,
                TimestampUnit::Ns | TimestampUnit::Auto => 1,
            };
            // Integers are scaled exactly; fractional values (e.g. 1763719200.123 s) via f64.
            if let Some(i) = n.as_i64() {
                i.checked_mul(nanos_per_unit).map(Timestamp::from_nanos)
            } else {
                // Whole units exactly, the fraction separately, so that 1763719200.25 s keeps
                // its quarter second instead of f64's ~256 ns steps at that magnitude.
                let whole = v.trunc();
                let fraction = ((v - whole) * nanos_per_unit as f64).round() as i64;
                if whole.abs() >= 9.2e18 {
                    return None;
                }
                (whole as i64)
                    .checked_mul(nanos_per_unit)
                    .and_then(|n| n.checked_add(fraction))
                    .map(Timestamp::from_nanos)
            }
        }
        Value::String(s) => Timestamp::parse_rfc3339(s),
        _ => None,
    }
}

#[cfg(test)]
mod tests;

/// Whether `topic` matches the MQTT topic filter `filter` (`+` one level, `#` the rest; a
/// `$share/group/` prefix is ignored). Topics starting with `$` match no leading wildcard.
pub fn topic_matches(filter: &str, topic: &str) -> bool {
    let filter = filter
        .strip_prefix("$share/")
        .and_then(|rest| rest.split_once('/'))
        .map_or(filter, |(_group, f)| f);
    if topic.starts_with('$') && (filter.starts_with('+') || filter.starts_with('#')) {
        return false;
    }
    let mut f = filter.split('/');
    let mut t = topic.split('/');
    loop {
        match (f.next(), t.next()) {
            (Some("#"), _) | (None, None) => return true,
            (Some("+"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            _ => return false,
        }
    }
}
