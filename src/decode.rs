//! Turns one MQTT message (topic, payload) into readings, or into rejections with a reason.
//! Pure: the caller supplies the receive time and the clock-derived bounds; nothing here does I/O.
//!
//! Message-level faults (bad JSON, wrong topic, oversized payload) reject the whole message once.
//! Reading-level faults (a non-finite value, a timestamp out of range, a bad name) reject only that
//! reading; the message's other readings are kept.

use serde::{Deserialize, Serialize};

use crate::delta::{DeltaMessage, Position};
use crate::limits;
use crate::reading::{Timestamp, validate_name};
pub use crate::reject::DecodeError;

/// How a subscription's payloads are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// The payload is one number, e.g. `21.5`; sensor and metric come from the topic.
    Value,
    /// A JSON object, or an array of them; every number or boolean in it is a metric, named
    /// by its keys joined with `.` (`ENERGY.Power`), below `root` when one is given.
    Json,
    /// InfluxDB line protocol, one or more lines; sensor = the measurement and its sorted tags,
    /// metric = the field key.
    Influx,
    /// A SenML pack (RFC 8428, JSON); sensor = the base name, metric = the record's name.
    Senml,
    /// Sparkplug B 3.0 (Eclipse Tahu's protobuf); sensor = `<group>:<edge node>[:<device>]`,
    /// metric = the metric's name.
    #[serde(rename = "sparkplug_b")]
    SparkplugB,
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
    /// `{gateway}`: the gateway a delta message comes from (`format = "delta"`).
    Gateway,
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
                "{gateway}" => Level::Gateway,
                "{_}" | "+" => Level::Skip,
                "#" if i + 1 == parts.len() => Level::Rest,
                p if p.contains(['{', '}', '+', '#']) => {
                    return Err(format!(
                        "level `{p}` is not a literal, {{sensor}}, {{metric}}, {{gateway}}, {{_}}, + \
                         or a final #"
                    ));
                }
                p => Level::Literal(p.to_owned()),
            };
            if levels.contains(&level)
                && matches!(level, Level::Sensor | Level::Metric | Level::Gateway)
            {
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

    pub fn has_gateway(&self) -> bool {
        self.levels.contains(&Level::Gateway)
    }

    /// Whether every topic the filter can match has the levels this template expects: equal
    /// level counts (or a trailing `#` in both), literals equal to the filter's literals, and
    /// names taken only from wildcard levels (a gateway also from a literal: a central may
    /// subscribe to each gateway's topic by name).
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
                Level::Gateway => *theirs != "#",
                Level::Rest => *theirs == "#",
            })
    }

    /// Takes the named levels from a topic; `None` when the topic does not fit the template.
    pub fn capture<'t>(&self, topic: &'t str) -> Option<Captured<'t>> {
        let mut got = Captured::default();
        let mut parts = topic.split('/');
        for level in &self.levels {
            if level == &Level::Rest {
                return Some(got);
            }
            let part = parts.next()?;
            match level {
                Level::Literal(l) if l != part => return None,
                Level::Sensor => got.sensor = Some(part),
                Level::Metric => got.metric = Some(part),
                Level::Gateway => got.gateway = Some(part),
                _ => {}
            }
        }
        parts.next().is_none().then_some(got)
    }
}

/// The levels a [`Template`] names, taken from one topic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Captured<'t> {
    pub sensor: Option<&'t str>,
    pub metric: Option<&'t str>,
    pub gateway: Option<&'t str>,
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
    /// `format = "json"`: the dotted path of the object that holds the metrics (from the
    /// payload's top); `None`: the whole object.
    pub root: Option<String>,
    /// `format = "json"`: the only metrics taken, as dotted paths from `root`.
    pub fields: Option<Vec<String>>,
    /// `format = "sparkplug_b"`: how long to wait before asking an edge node for its births
    /// again; `None`: never ask.
    pub rebirth_interval: Option<std::time::Duration>,
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
/// Reused from message to message: once warm, decoding allocates nothing per reading.
#[derive(Debug, Default, Clone)]
pub struct Decoded {
    /// The readings' series names, back to back; each reading holds its range.
    names: String,
    readings: Vec<(std::ops::Range<usize>, Timestamp, f64)>,
    /// Bucket summaries of a [`Format::Delta`] message.
    pub deltas: Vec<Delta>,
    pub rejected: Vec<DecodeError>,
    /// Some reading took the receive time (the payload had no timestamp for it).
    pub receive_time: bool,
    /// A delta message's gateway and position in its stream (`fleet::applied`).
    pub delta_from: Option<(String, Position)>,
    /// The message carries no readings by design (a Sparkplug DEATH, command or STATE).
    pub control: bool,
    /// A Sparkplug rebirth request to publish (topic, payload): a DATA message named an
    /// alias no BIRTH defined.
    pub rebirth: Option<(String, Vec<u8>)>,
    scratch: json::Scratch,
}

/// One decoded reading, borrowing its series name from the [`Decoded`] that holds it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadingRef<'a> {
    pub series: &'a str,
    pub ts: Timestamp,
    pub value: f64,
}

impl Decoded {
    pub fn clear(&mut self) {
        // Kept for the next message up to a size ordinary payloads never need, so that one
        // huge message does not hold its memory for the life of the process.
        const KEEP_READINGS: usize = 4096;
        self.names.clear();
        self.names.shrink_to(KEEP_READINGS * 32);
        self.readings.clear();
        self.readings.shrink_to(KEEP_READINGS);
        self.scratch.shrink();
        self.deltas.clear();
        self.rejected.clear();
        self.receive_time = false;
        self.delta_from = None;
        self.control = false;
        self.rebirth = None;
    }

    /// The good readings, in payload order.
    pub fn readings(&self) -> impl ExactSizeIterator<Item = ReadingRef<'_>> {
        self.readings.iter().map(|(name, ts, value)| ReadingRef {
            series: &self.names[name.clone()],
            ts: *ts,
            value: *value,
        })
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
            validate_name(metric)
        })();
        match result {
            Ok(()) => {
                let start = self.names.len();
                self.names.push_str(sensor);
                self.names.push('/');
                self.names.push_str(metric);
                self.readings.push((start..self.names.len(), ts, value));
            }
            Err(e) => self.rejected.push(e),
        }
    }
}

/// `name` into `into` (cleared first) with each `/` turned into `.`: a SenML or Sparkplug
/// metric name as a bucketd metric. A piece at a time, not a char at a time (the names are
/// decoded once a reading).
fn slashes_to_dots(name: &str, into: &mut String) {
    into.clear();
    if !name.as_bytes().contains(&b'/') {
        into.push_str(name);
        return;
    }
    for (i, piece) in name.split('/').enumerate() {
        if i > 0 {
            into.push('.');
        }
        into.push_str(piece);
    }
}

/// Decodes one message into `out` (cleared first). `Err` rejects the whole message. Stateless:
/// a Sparkplug DATA message's aliases are unknown here (see [`decode_with`]).
pub fn decode(
    sub: &Subscription,
    topic: &[u8],
    payload: &[u8],
    ctx: &DecodeContext,
    out: &mut Decoded,
) -> Result<(), DecodeError> {
    decode_births(sub, topic, payload, ctx, None, out)
}

/// [`decode`], with what earlier Sparkplug BIRTH messages said (`births`, updated).
pub fn decode_with(
    sub: &Subscription,
    topic: &[u8],
    payload: &[u8],
    ctx: &DecodeContext,
    births: &mut Births,
    out: &mut Decoded,
) -> Result<(), DecodeError> {
    decode_births(sub, topic, payload, ctx, Some(births), out)
}

/// Both of the above: a stateless decode makes its empty births only for a Sparkplug message
/// (a `HashMap`'s random keys cost ~12 ns, a tenth of a one-reading message's decode).
fn decode_births(
    sub: &Subscription,
    topic: &[u8],
    payload: &[u8],
    ctx: &DecodeContext,
    births: Option<&mut Births>,
    out: &mut Decoded,
) -> Result<(), DecodeError> {
    out.clear();
    if payload.len() > ctx.max_payload_bytes {
        return Err(DecodeError::PayloadTooLarge);
    }
    // A Sparkplug DEATH or command may be empty, and protobuf bytes may all be "whitespace".
    if sub.format != Format::SparkplugB && payload.iter().all(u8::is_ascii_whitespace) {
        return Err(DecodeError::EmptyPayload);
    }
    let topic = std::str::from_utf8(topic).map_err(|_| DecodeError::InvalidUtf8)?;
    let captured = sub
        .template
        .capture(topic)
        .ok_or(DecodeError::TopicMismatch)?;
    let sensor = captured.sensor;
    match sub.format {
        Format::Value => {
            let (Some(sensor), Some(metric)) = (sensor, captured.metric) else {
                unreachable!("config validation requires {{sensor}} and {{metric}} for value")
            };
            let value = decode_value(payload)?;
            out.receive_time = true;
            out.push(ctx, sensor, metric, ctx.received, value);
        }
        Format::Json => json::decode(sub, sensor, payload, ctx, out)?,
        Format::Influx => influx::decode(sub, payload, ctx, out)?,
        Format::Senml => senml::decode(sensor, payload, ctx, out)?,
        Format::SparkplugB => {
            let mut none = Births::default();
            let births = births.unwrap_or(&mut none);
            sparkplug::decode(topic, payload, ctx, sub.rebirth_interval, births, out)?;
        }
        Format::Delta => {
            // Config validation requires {gateway} in a delta subscription's template.
            let gateway = captured.gateway.ok_or(DecodeError::TopicMismatch)?;
            decode_delta(gateway, payload, ctx, out)?;
        }
    }
    if out.readings.is_empty() && out.deltas.is_empty() && out.rejected.is_empty() && !out.control {
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

/// Decodes a delta message that came on `topic_gateway`'s topic. Nothing a gateway sends is
/// trusted (see the threat model in docs/FLEET.md): the message is refused as a whole when it
/// names another gateway than its topic, has no origin, a negative position, or a bucket that
/// could not have come from a bucketd (an impossible span, a non-finite or negative moment,
/// first/last outside the bucket, a damaged sketch or one with settings no gateway can have);
/// a well-formed bucket outside `limits.max_age` / `limits.max_future` is refused alone.
fn decode_delta(
    topic_gateway: &str,
    payload: &[u8],
    ctx: &DecodeContext,
    out: &mut Decoded,
) -> Result<(), DecodeError> {
    let msg = DeltaMessage::decode(payload).ok_or(DecodeError::InvalidDelta)?;
    if !crate::reading::valid_gateway_id(&msg.gateway_id) {
        return Err(DecodeError::InvalidName);
    }
    if msg.gateway_id != topic_gateway {
        return Err(DecodeError::GatewayMismatch);
    }
    let origin_ok = msg.origin.len() <= limits::DELTA_ORIGIN_BYTES_MAX
        && crate::reading::Timestamp::parse_rfc3339(&msg.origin).is_some();
    if !origin_ok || msg.seq < 0 || msg.part < 0 {
        return Err(DecodeError::InvalidDelta);
    }
    for b in &msg.buckets {
        let (width_secs, summary) = delta_bucket(b).ok_or(DecodeError::InvalidDelta)?;
        let end = Timestamp::from_secs(b.end);
        if end <= ctx.oldest || Timestamp::from_secs(b.start) > ctx.newest {
            out.rejected.push(DecodeError::TimestampOutOfRange);
            continue;
        }
        // Stored as `<gateway>:<sensor>/<metric>`, a name this central's API must accept: a
        // long gateway id and a long sensor name together may not (issue 52: acknowledged
        // data no query could read). Refused alone, as a sensor name the gateway's own
        // limits allowed.
        let series = format!("{}:{}", msg.gateway_id, b.series);
        if let Err(e) = crate::reading::validate_series(&series) {
            out.rejected.push(e);
            continue;
        }
        out.deltas.push(Delta {
            series,
            start: b.start,
            width_secs,
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

/// A delta bucket's width and summary, or `None` if no bucketd could have sent it.
fn delta_bucket(b: &crate::doc::BucketDoc) -> Option<(i64, crate::summary::Summary)> {
    // A bucket is at most a day wide (bucket widths divide a day); `end - start` of any two
    // i64s could overflow.
    let width = b
        .end
        .checked_sub(b.start)
        .filter(|w| (1..=limits::DELTA_WIDTH_SECS_MAX).contains(w))?;
    crate::reading::validate_series(&b.series).ok()?;
    // first and last are readings of this bucket: nanoseconds within [start, end).
    let span = b.start.checked_mul(1_000_000_000)?..b.end.checked_mul(1_000_000_000)?;
    let finite = [b.sum, b.sum_comp, b.mean, b.m2, b.first.value, b.last.value];
    let within = |v: f64| b.min <= v && v <= b.max; // false for NaN
    // The mean is computed, merge after merge: a rounding's worth outside is no forgery.
    let slack = 1e-9 * b.min.abs().max(b.max.abs());
    let mean_within = b.min - slack <= b.mean && b.mean <= b.max + slack;
    let sane = b.count > 0
        && b.count <= width.saturating_mul(limits::DELTA_READINGS_PER_SEC_MAX)
        && b.min <= b.max
        && finite.iter().all(|v| v.is_finite())
        && b.m2 >= 0.0
        && mean_within
        && within(b.first.value)
        && within(b.last.value)
        && span.contains(&b.first.ts)
        && span.contains(&b.last.ts)
        && b.first.ts <= b.last.ts
        && b.inc.is_none_or(|inc| inc_possible(inc, b));
    if !sane {
        return None;
    }
    // An empty sketch is a schema 1 document (quantiles unknown); any other must decode, with
    // settings a gateway's config can have, within its own bin bound, counting the bucket's
    // readings (issue 52: `count = i64::MAX` over a sketch of five saturated the bucket for
    // good).
    if b.sketch.is_empty() {
        return Some((width, b.summary()));
    }
    let sketch = crate::sketch::Sketch::decode_untrusted(&b.sketch)?;
    let params = sketch.params();
    let ok = limits::SKETCH_ACCURACY.contains(&params.alpha)
        && limits::SKETCH_MAX_BINS.contains(&params.max_bins)
        && i64::try_from(sketch.count()).is_ok_and(|n| n == b.count);
    ok.then(|| (width, b.summary_with(sketch)))
}

/// Whether `inc` can be a counter increase of `b`'s readings: each of the `count - 1` steps
/// between them is a rise (at most `max - min`) or a reset (to a reading), so each is at most
/// twice the largest magnitude.
fn inc_possible(inc: f64, b: &crate::doc::BucketDoc) -> bool {
    let largest = b.min.abs().max(b.max.abs());
    let bound = (b.count.saturating_sub(1) as f64) * 2.0 * largest;
    inc.is_finite() && inc.abs() <= bound * (1.0 + 1e-9) + f64::MIN_POSITIVE
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

mod influx;
mod json;
mod senml;
pub mod sparkplug;
pub use json::{Num, Scalar, parse_timestamp};
pub use sparkplug::Births;

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
