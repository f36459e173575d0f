//! SenML packs (RFC 8428) in JSON (`format = "senml"`): an array of records, base fields
//! (`bn`, `bt`, `bv`, `bu`, `bver`, `bs`) applying to their record and every later one until
//! replaced.
//!
//! A record's resolved name is `bn` + `n`; its time `bt` + `t` in seconds, relative to the
//! receive time when below 2^28 (RFC 8428 section 4.5.3); its value `bv` + `v`, or `vb` as 1
//! or 0. Sensor = the resolved base name with a trailing `:`, `/` or `.` removed (the topic's
//! `{sensor}` when the pack has no base name), metric = `n` with `/` turned into `.`; a record
//! whose whole name is in `bn` splits it at its last `:`, `/` or `.`. String (`vs`) and data
//! (`vd`) values and sums (`s`) are skipped. A record that is not an object, has a field of
//! the wrong type, or a must-understand field (a name ending in `_`) bucketd does not know is
//! refused alone (`invalid_senml`); its base fields are not applied.

use serde_json::{Map, Value};

use super::{DecodeContext, DecodeError, Decoded};
use crate::reading::Timestamp;

/// Times below this are relative to the receive time (RFC 8428 section 4.5.3).
const RELATIVE_BELOW: f64 = 268_435_456.0;

/// The base fields in force.
#[derive(Default)]
struct Base {
    name: String,
    time: f64,
    value: f64,
}

/// What one record contributes once its fields are checked.
struct Record<'a> {
    base_name: Option<&'a str>,
    base_time: Option<f64>,
    base_value: Option<f64>,
    name: &'a str,
    time: f64,
    value: Option<Number>,
}

enum Number {
    Value(f64),
    Bool(bool),
}

pub(super) fn decode(
    topic_sensor: Option<&str>,
    payload: &[u8],
    ctx: &DecodeContext,
    out: &mut Decoded,
) -> Result<(), DecodeError> {
    let pack: Vec<Value> = serde_json::from_slice(payload).map_err(|e| {
        if std::str::from_utf8(payload).is_err() {
            DecodeError::InvalidUtf8
        } else if e.is_data() {
            DecodeError::InvalidSenml // valid JSON, but not an array
        } else {
            DecodeError::InvalidJson
        }
    })?;
    let mut base = Base::default();
    let mut name = String::new();
    for record in &pack {
        let Some(r) = record.as_object().and_then(read_record) else {
            out.rejected.push(DecodeError::InvalidSenml);
            continue;
        };
        if let Some(bn) = r.base_name {
            bn.clone_into(&mut base.name);
        }
        if let Some(bt) = r.base_time {
            base.time = bt;
        }
        if let Some(bv) = r.base_value {
            base.value = bv;
        }
        let value = match r.value {
            None => continue, // a string, data or sum record, or none at all
            Some(Number::Value(v)) => base.value + v,
            Some(Number::Bool(b)) => f64::from(u8::from(b)),
        };
        let Some(ts) = resolve_time(base.time + r.time, ctx.received) else {
            out.rejected.push(DecodeError::InvalidTimestamp);
            continue;
        };
        let (sensor, metric) = if r.name.is_empty() {
            // The whole name is in bn: split it at its last separator.
            match base.name.rfind([':', '/', '.']) {
                Some(at) if at + 1 < base.name.len() => {
                    (trim_separator(&base.name[..at]), &base.name[at + 1..])
                }
                _ => {
                    out.rejected.push(DecodeError::InvalidName);
                    continue;
                }
            }
        } else {
            (trim_separator(&base.name), r.name)
        };
        let sensor = match (sensor.is_empty(), topic_sensor) {
            (false, _) => sensor,
            (true, Some(topic)) => topic,
            (true, None) => {
                out.rejected.push(DecodeError::InvalidName);
                continue;
            }
        };
        name.clear();
        name.extend(metric.chars().map(|c| if c == '/' { '.' } else { c }));
        out.push(ctx, sensor, &name, ts, value);
    }
    Ok(())
}

/// The base name with one trailing `:`, `/` or `.` removed.
fn trim_separator(name: &str) -> &str {
    name.strip_suffix([':', '/', '.']).unwrap_or(name)
}

/// Seconds since the epoch (or, below 2^28, since `received`) as a timestamp.
fn resolve_time(t: f64, received: Timestamp) -> Option<Timestamp> {
    if !t.is_finite() {
        return None;
    }
    // Whole seconds exactly and the fraction apart, so that 1763719200.25 keeps its quarter
    // second (f64 nanoseconds at that magnitude step by 256).
    let whole = t.trunc();
    if whole.abs() >= 9.2e9 {
        return None; // past ±292 years of the epoch: no time a device could mean
    }
    let nanos = (whole as i64 * 1_000_000_000).checked_add(((t - whole) * 1e9).round() as i64)?;
    if t < RELATIVE_BELOW {
        received
            .as_nanos()
            .checked_add(nanos)
            .map(Timestamp::from_nanos)
    } else {
        Some(Timestamp::from_nanos(nanos))
    }
}

/// Checks one record's fields; `None` when one has the wrong type or an unknown field must be
/// understood.
fn read_record(o: &Map<String, Value>) -> Option<Record<'_>> {
    let number = |k: &str| match o.get(k) {
        None => Some(None),
        Some(v) => v.as_f64().map(Some),
    };
    let string = |k: &str| match o.get(k) {
        None => Some(None),
        Some(v) => v.as_str().map(Some),
    };
    const KNOWN: [&str; 15] = [
        "bn", "bt", "bu", "bv", "bs", "bver", "n", "u", "v", "vs", "vb", "vd", "s", "t", "ut",
    ];
    if o.keys()
        .any(|k| k.ends_with('_') && !KNOWN.contains(&k.as_str()))
    {
        return None;
    }
    let value = match (o.get("v"), o.get("vb")) {
        (Some(v), None) => Some(Number::Value(v.as_f64()?)),
        (None, Some(vb)) => Some(Number::Bool(vb.as_bool()?)),
        (None, None) => None,
        (Some(_), Some(_)) => return None, // a record has one value
    };
    // The other fields are checked for their type even where unused.
    for k in ["bs", "bver", "s", "ut"] {
        number(k)?;
    }
    for k in ["bu", "u", "vs", "vd"] {
        string(k)?;
    }
    Some(Record {
        base_name: string("bn")?,
        base_time: number("bt")?,
        base_value: number("bv")?,
        name: string("n")?.unwrap_or(""),
        time: number("t")?.unwrap_or(0.0),
        value,
    })
}
