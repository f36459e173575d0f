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

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use super::json::{Key, drain_map, drain_seq};

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
#[derive(Default)]
struct Record<'a> {
    base_name: Option<Cow<'a, str>>,
    base_time: Option<f64>,
    base_value: Option<f64>,
    name: Option<Cow<'a, str>>,
    time: Option<f64>,
    value: Option<Number>,
}

#[derive(Clone, Copy)]
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
    // One pass over the pack: each record resolved as it is read, a bad one refused alone.
    // Names are short: one allocation each for the message, not one per doubling.
    let mut resolve = Resolve {
        base: Base {
            name: String::with_capacity(64),
            ..Base::default()
        },
        name: String::with_capacity(64),
        topic_sensor,
        ctx,
        out,
    };
    let mut de = serde_json::Deserializer::from_slice(payload);
    let parsed = de
        .deserialize_seq(Pack(&mut resolve))
        .and_then(|()| de.end());
    parsed.map_err(|e| {
        if e.is_data() && std::str::from_utf8(payload).is_ok() {
            DecodeError::InvalidSenml // valid JSON, but not an array
        } else {
            super::json::verdict(payload, &e)
        }
    })
}

/// The pack's state as its records go by: the base fields in force.
struct Resolve<'r> {
    base: Base,
    /// The metric name being built (reused).
    name: String,
    topic_sensor: Option<&'r str>,
    ctx: &'r DecodeContext,
    out: &'r mut Decoded,
}

impl Resolve<'_> {
    /// One record, or `None` for one that is not well formed.
    fn record(&mut self, r: Option<Record<'_>>) {
        let (base, out) = (&mut self.base, &mut *self.out);
        let Some(r) = r else {
            out.rejected.push(DecodeError::InvalidSenml);
            return;
        };
        if let Some(bn) = &r.base_name {
            bn.as_ref().clone_into(&mut base.name);
        }
        if let Some(bt) = r.base_time {
            base.time = bt;
        }
        if let Some(bv) = r.base_value {
            base.value = bv;
        }
        let value = match r.value {
            None => return, // a string, data or sum record, or none at all
            Some(Number::Value(v)) => base.value + v,
            Some(Number::Bool(b)) => f64::from(u8::from(b)),
        };
        let Some(ts) = resolve_time(base.time + r.time.unwrap_or(0.0), self.ctx.received) else {
            out.rejected.push(DecodeError::InvalidTimestamp);
            return;
        };
        let record_name = r.name.as_deref().unwrap_or("");
        let (sensor, metric) = if record_name.is_empty() {
            // The whole name is in bn: split it at its last separator.
            match base.name.rfind([':', '/', '.']) {
                Some(at) if at + 1 < base.name.len() => {
                    (trim_separator(&base.name[..at]), &base.name[at + 1..])
                }
                _ => {
                    out.rejected.push(DecodeError::InvalidName);
                    return;
                }
            }
        } else {
            (trim_separator(&base.name), record_name)
        };
        let sensor = match (sensor.is_empty(), self.topic_sensor) {
            (false, _) => sensor,
            (true, Some(topic)) => topic,
            (true, None) => {
                out.rejected.push(DecodeError::InvalidName);
                return;
            }
        };
        super::slashes_to_dots(metric, &mut self.name);
        out.push(self.ctx, sensor, &self.name, ts, value);
    }
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

/// The pack: each item a record, resolved as it is read.
struct Pack<'v, 'r>(&'v mut Resolve<'r>);

impl<'de> Visitor<'de> for Pack<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a SenML pack (an array of records)")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(record) = seq.next_element_seed(RecordSeed)? {
            self.0.record(record);
        }
        Ok(())
    }
}

/// One record: its fields, each of the type RFC 8428 gives it; `None` for an item that is not an
/// object, a field of another type, a record with two values, or an unknown must-understand
/// field (a name ending in `_`). Other unknown fields are read past.
struct RecordSeed;

impl<'de> DeserializeSeed<'de> for RecordSeed {
    type Value = Option<Record<'de>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

/// A field's value, of whatever type it was written with.
enum Field<'de> {
    Num(f64),
    Str(Cow<'de, str>),
    Bool(bool),
    Other,
}

struct FieldSeed;

impl<'de> DeserializeSeed<'de> for FieldSeed {
    type Value = Field<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FieldSeed {
    type Value = Field<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_u64<E>(self, v: u64) -> Result<Field<'de>, E> {
        Ok(Field::Num(v as f64))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Field<'de>, E> {
        Ok(Field::Num(v as f64))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Field<'de>, E> {
        Ok(Field::Num(v))
    }
    fn visit_bool<E>(self, v: bool) -> Result<Field<'de>, E> {
        Ok(Field::Bool(v))
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Field<'de>, E> {
        Ok(Field::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Field<'de>, E> {
        Ok(Field::Str(Cow::Owned(v.to_owned())))
    }
    fn visit_unit<E>(self) -> Result<Field<'de>, E> {
        Ok(Field::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Field<'de>, A::Error> {
        drain_map(map).map(|()| Field::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Field<'de>, A::Error> {
        drain_seq(seq).map(|()| Field::Other)
    }
}

impl<'de> Visitor<'de> for RecordSeed {
    type Value = Option<Record<'de>>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a SenML record (an object)")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut r = Record::default();
        let mut values = 0;
        let mut bad = false;
        // Keys and strings borrowed from the payload where they have no escapes.
        while let Some(key) = map.next_key_seed(Key)? {
            let field = map.next_value_seed(FieldSeed)?;
            match (key.as_ref(), field) {
                ("bn", Field::Str(s)) => r.base_name = Some(s),
                ("n", Field::Str(s)) => r.name = Some(s),
                ("bt", Field::Num(x)) => r.base_time = Some(x),
                ("bv", Field::Num(x)) => r.base_value = Some(x),
                ("t", Field::Num(x)) => r.time = Some(x),
                ("v", Field::Num(x)) => {
                    r.value = Some(Number::Value(x));
                    values += 1;
                }
                ("vb", Field::Bool(b)) => {
                    r.value = Some(Number::Bool(b));
                    values += 1;
                }
                ("vs" | "vd", Field::Str(_)) => values += 1,
                ("bu" | "u", Field::Str(_)) | ("bs" | "bver" | "s" | "ut", Field::Num(_)) => {}
                // A known field of another type.
                (
                    "bn" | "n" | "bt" | "bv" | "t" | "v" | "vb" | "vs" | "vd" | "bu" | "u" | "bs"
                    | "bver" | "s" | "ut",
                    _,
                ) => bad = true,
                (k, _) if k.ends_with('_') => bad = true,
                _ => {}
            }
        }
        Ok((!bad && values <= 1).then_some(r))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        drain_seq(seq).map(|()| None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}
