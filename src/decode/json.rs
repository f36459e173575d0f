//! Streams a JSON payload's objects into readings without building a document tree: keys and
//! string values are borrowed from the payload, numbers are read as they pass, and the one
//! buffer an object needs is reused from message to message.
//!
//! Semantics are those of parsing into a `serde_json::Value` with `preserve_order` and walking
//! it: a repeated key keeps its first position and its last value; the whole payload must be
//! valid JSON before anything else is judged.

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use super::{DecodeContext, DecodeError, Decoded, Subscription};
use crate::reading::Timestamp;

/// A JSON number as the parser read it: `serde_json`'s own split into unsigned, negative and
/// fractional (or too large for 64 bits).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Num {
    U(u64),
    I(i64),
    F(f64),
}

impl Num {
    pub fn as_f64(self) -> f64 {
        match self {
            Num::U(u) => u as f64,
            Num::I(i) => i as f64,
            Num::F(f) => f,
        }
    }

    /// The integer, when the number was written as one that fits an `i64`.
    pub fn as_i64(self) -> Option<i64> {
        match self {
            Num::U(u) => i64::try_from(u).ok(),
            Num::I(i) => Some(i),
            Num::F(_) => None,
        }
    }
}

/// The value of a timestamp or sensor field.
#[derive(Debug, Clone, PartialEq)]
pub enum Scalar<'de> {
    Num(Num),
    Str(Cow<'de, str>),
    /// `true`, `null`, an object, an array.
    Other,
}

/// One field of an object other than the timestamp and sensor fields: its name, its number
/// (`None` when it is not one), and whether a later field of the same name replaced it.
type Field<'de> = (Cow<'de, str>, Option<Num>, bool);

/// The reusable part of decoding: an object's fields, kept between messages.
#[derive(Debug, Default, Clone)]
pub struct Scratch {
    pub(super) fields: Vec<Field<'static>>,
    /// The dotted path of the member being read.
    path: String,
}

impl Scratch {
    /// Gives back memory a huge object left behind (see `Decoded::clear`).
    pub(super) fn shrink(&mut self) {
        self.fields.shrink_to(4096);
        self.path.shrink_to(4096);
    }
}

/// Reuses `v`'s allocation for a vector of another lifetime (the in-place collect of an empty
/// vector keeps its buffer when the element layouts match, as they do here).
fn recycle<'b>(mut v: Vec<Field<'_>>) -> Vec<Field<'b>> {
    v.clear();
    v.into_iter().map(|_| unreachable!("empty")).collect()
}

/// Decodes a JSON payload (an object, or an array of objects) into `out`.
pub(super) fn decode(
    sub: &Subscription,
    topic_sensor: Option<&str>,
    payload: &[u8],
    ctx: &DecodeContext,
    out: &mut Decoded,
) -> Result<(), DecodeError> {
    let mut fields = recycle(std::mem::take(&mut out.scratch.fields));
    let path = std::mem::take(&mut out.scratch.path);
    let mut walk = Walk {
        sub,
        topic_sensor,
        ctx,
        out,
        fields: &mut fields,
        path,
        not_an_object: false,
    };
    let mut de = serde_json::Deserializer::from_slice(payload);
    let root = Shape {
        walk: &mut walk,
        root: true,
    };
    let parsed = root.deserialize(&mut de).and_then(|()| de.end());
    let not_an_object = walk.not_an_object;
    let path = walk.path;
    out.scratch.path = path;
    out.scratch.fields = recycle(fields);
    parsed.map_err(|e| verdict(payload, &e))?;
    if not_an_object {
        return Err(DecodeError::NotAnObject);
    }
    Ok(())
}

/// Why a JSON payload was refused as a whole: not UTF-8, a number past f64's range, or not
/// valid JSON.
pub(super) fn verdict(payload: &[u8], e: &serde_json::Error) -> DecodeError {
    if std::str::from_utf8(payload).is_err() {
        DecodeError::InvalidUtf8
    } else if e.to_string().starts_with("number out of range") {
        DecodeError::NonFinite
    } else {
        DecodeError::InvalidJson
    }
}

/// What the visitors share while walking one payload.
struct Walk<'w, 'de> {
    sub: &'w Subscription,
    topic_sensor: Option<&'w str>,
    ctx: &'w DecodeContext,
    out: &'w mut Decoded,
    fields: &'w mut Vec<Field<'de>>,
    /// The dotted path from the top of the object being read to the member being read
    /// (`ENERGY.Power`), reused from member to member.
    path: String,
    /// The root, or an item of the root array, was not an object: the message is rejected
    /// once the rest has been parsed (invalid JSON is the stronger verdict).
    not_an_object: bool,
}

/// The timestamp and sensor fields of one top-level object, wherever in it they were found.
#[derive(Default)]
struct Found<'de> {
    ts: Option<Scalar<'de>>,
    sensor: Option<Scalar<'de>>,
}

/// Whether `outer` is a proper prefix of the dotted path `inner` at a `.` (`a.b` of `a.b.c`).
fn leads_to(outer: &str, inner: &str) -> bool {
    inner.len() > outer.len() && inner.starts_with(outer) && inner.as_bytes()[outer.len()] == b'.'
}

impl<'de> Walk<'_, 'de> {
    /// Reads one top-level object's members (nested objects too), then turns them into
    /// readings.
    fn object<A: MapAccess<'de>>(&mut self, map: A) -> Result<(), A::Error> {
        self.fields.clear();
        self.path.clear();
        let mut found = Found::default();
        self.members(map, &mut found, true)?;
        self.emit(found.ts.as_ref(), found.sensor.as_ref());
        Ok(())
    }

    /// Reads the members of the object at `self.path` (the top-level object's when `top`).
    fn members<A: MapAccess<'de>>(
        &mut self,
        mut map: A,
        found: &mut Found<'de>,
        top: bool,
    ) -> Result<(), A::Error> {
        while let Some(key) = map.next_key_seed(Key)? {
            let outer = self.path.len();
            if !top {
                self.path.push('.');
            }
            self.path.push_str(&key);
            let is_ts = Some(self.path.as_str()) == self.sub.timestamp_field.as_deref();
            let is_sensor = Some(self.path.as_str()) == self.sub.sensor_field.as_deref();
            if is_ts || is_sensor {
                let value = map.next_value_seed(AnyScalar)?;
                if is_ts {
                    found.ts = Some(value.clone());
                }
                if is_sensor {
                    found.sensor = Some(value);
                }
            } else {
                // Where the metric's name starts in the path: from the top, or past `root`.
                let name_at = match self.sub.root.as_deref() {
                    None => Some(0),
                    Some(root) => leads_to(root, &self.path).then_some(root.len() + 1),
                };
                let descend = name_at.is_some()
                    || self.sub.root.as_deref() == Some(self.path.as_str())
                    || [
                        &self.sub.root,
                        &self.sub.timestamp_field,
                        &self.sub.sensor_field,
                    ]
                    .iter()
                    .any(|p| p.as_deref().is_some_and(|p| leads_to(&self.path, p)));
                let value = map.next_value_seed(Member {
                    walk: self,
                    found,
                    descend,
                    metric: name_at.is_some(),
                })?;
                if let Some(name_at) = name_at {
                    let name = &self.path[name_at..];
                    let wanted = self
                        .sub
                        .fields
                        .as_ref()
                        .is_none_or(|only| only.iter().any(|f| f == name));
                    if wanted {
                        let name = if top && name_at == 0 {
                            key
                        } else {
                            Cow::Owned(name.to_owned())
                        };
                        self.fields.push((name, value, true));
                    }
                }
            }
            self.path.truncate(outer);
        }
        Ok(())
    }

    fn emit(&mut self, ts: Option<&Scalar<'de>>, sensor: Option<&Scalar<'de>>) {
        let out = &mut *self.out;
        let mut number = IntBuffer::default();
        let sensor = match (&self.sub.sensor_field, sensor) {
            (None, _) => self
                .topic_sensor
                .expect("config validation requires {sensor} without sensor_field"),
            (Some(_), Some(Scalar::Str(s))) => s.as_ref(),
            (Some(_), Some(&Scalar::Num(n @ (Num::U(_) | Num::I(_))))) => number.format(n),
            (Some(_), _) => {
                out.rejected.push(DecodeError::InvalidName);
                return;
            }
        };
        let ts = match ts {
            None => {
                out.receive_time = true;
                self.ctx.received
            }
            Some(value) => {
                let Some(ts) = parse_timestamp(value, self.sub.timestamp_unit) else {
                    out.rejected.push(DecodeError::InvalidTimestamp);
                    return;
                };
                ts
            }
        };
        keep_last_of_each_name(self.fields);
        for (key, value, kept) in self.fields.iter() {
            // Strings, nulls and arrays are not metrics.
            if let (true, Some(n)) = (kept, value) {
                out.push(self.ctx, sensor, key, ts, n.as_f64());
            }
        }
    }
}

/// A repeated name keeps its first position and takes its last value; the later ones are
/// dropped. Quadratic in the fields of one object for small objects; sorted for large ones.
fn keep_last_of_each_name(fields: &mut [Field<'_>]) {
    const SMALL: usize = 32;
    if fields.len() <= SMALL {
        for i in 0..fields.len() {
            if !fields[i].2 {
                continue;
            }
            for j in i + 1..fields.len() {
                if fields[j].2 && fields[j].0 == fields[i].0 {
                    fields[i].1 = fields[j].1;
                    fields[j].2 = false;
                }
            }
        }
        return;
    }
    let mut order: Vec<usize> = (0..fields.len()).collect();
    order.sort_by(|&a, &b| fields[a].0.cmp(&fields[b].0).then(a.cmp(&b)));
    let mut i = 0;
    while i < order.len() {
        let first = order[i];
        let mut j = i + 1;
        while j < order.len() && fields[order[j]].0 == fields[first].0 {
            fields[order[j]].2 = false;
            j += 1;
        }
        fields[first].1 = fields[order[j - 1]].1;
        i = j;
    }
}

/// Formats an integer sensor id without allocating.
#[derive(Default)]
struct IntBuffer([u8; 20]);

impl IntBuffer {
    fn format(&mut self, n: Num) -> &str {
        let (negative, mut magnitude) = match n {
            Num::U(u) => (false, u),
            Num::I(i) => (i < 0, i.unsigned_abs()),
            Num::F(_) => unreachable!("only integers name a sensor"),
        };
        let mut at = self.0.len();
        loop {
            at -= 1;
            self.0[at] = b'0' + (magnitude % 10) as u8;
            magnitude /= 10;
            if magnitude == 0 {
                break;
            }
        }
        if negative {
            // 20 digits hold u64::MAX; a negative i64 has at most 19 digits, so a sign fits.
            at -= 1;
            self.0[at] = b'-';
        }
        std::str::from_utf8(&self.0[at..]).expect("ASCII digits")
    }
}

/// Parses a payload timestamp: a number in `unit` (or by magnitude), or an RFC 3339 string.
pub fn parse_timestamp(value: &Scalar<'_>, unit: super::TimestampUnit) -> Option<Timestamp> {
    use super::TimestampUnit;
    match value {
        Scalar::Num(n) => {
            let v = n.as_f64();
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
        Scalar::Str(s) => Timestamp::parse_rfc3339(s),
        Scalar::Other => None,
    }
}

/// The payload's root (an object, or an array of objects) or an item of the root array (an
/// object). Anything else marks the message as not an object and is read past.
struct Shape<'r, 'w, 'de> {
    walk: &'r mut Walk<'w, 'de>,
    root: bool,
}

impl<'de> DeserializeSeed<'de> for Shape<'_, '_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl Shape<'_, '_, '_> {
    fn not_an_object(self) {
        self.walk.not_an_object = true;
    }
}

impl<'de> Visitor<'de> for Shape<'_, '_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object or an array of objects")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        if self.walk.not_an_object {
            return drain_map(map); // rejected already: only the JSON's validity is left
        }
        self.walk.object(map)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        if !self.root {
            self.walk.not_an_object = true;
            return drain_seq(seq);
        }
        loop {
            let item = Shape {
                walk: &mut *self.walk,
                root: false,
            };
            if seq.next_element_seed(item)?.is_none() {
                break;
            }
        }
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        self.not_an_object();
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        self.not_an_object();
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        self.not_an_object();
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        self.not_an_object();
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        self.not_an_object();
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        self.not_an_object();
        Ok(())
    }
}

pub(super) fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_key_seed(Skip)?.is_some() {
        map.next_value_seed(Skip)?;
    }
    Ok(())
}

pub(super) fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element_seed(Skip)?.is_some() {}
    Ok(())
}

/// Any value, read and dropped. Unlike `IgnoredAny` (which `serde_json` skips without a depth
/// limit) it nests through `deserialize_any`, so the parser's recursion limit applies as it
/// does to every other part of the payload.
struct Skip;

impl<'de> DeserializeSeed<'de> for Skip {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Skip {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        drain_map(map)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        drain_seq(seq)
    }
}

/// An object key, borrowed unless it had escapes.
pub(super) struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Cow<'de, str>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key {
    type Value = Cow<'de, str>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(s))
    }
    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(s.to_owned()))
    }
}

/// A member's value: its number (`true` and `false` are 1 and 0) when it is a metric, `None`
/// for anything else; an object is read member by member when it holds metrics or leads to
/// `root` or the timestamp or sensor field, and skipped otherwise.
struct Member<'m, 'w, 'de> {
    walk: &'m mut Walk<'w, 'de>,
    found: &'m mut Found<'de>,
    descend: bool,
    metric: bool,
}

impl<'de> DeserializeSeed<'de> for Member<'_, '_, 'de> {
    type Value = Option<Num>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Member<'_, '_, 'de> {
    type Value = Option<Num>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(self.metric.then_some(Num::U(v)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(self.metric.then_some(Num::I(v)))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(self.metric.then_some(Num::F(v)))
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(self.metric.then_some(Num::U(u64::from(v))))
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        if self.descend {
            self.walk.members(map, self.found, false)?;
        } else {
            drain_map(map)?;
        }
        Ok(None)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        drain_seq(seq).map(|()| None)
    }
}

/// A timestamp or sensor field's value.
struct AnyScalar;

impl<'de> DeserializeSeed<'de> for AnyScalar {
    type Value = Scalar<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for AnyScalar {
    type Value = Scalar<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Scalar::Num(Num::U(v)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Scalar::Num(Num::I(v)))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Scalar::Num(Num::F(v)))
    }
    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Scalar::Str(Cow::Borrowed(s)))
    }
    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Scalar::Str(Cow::Owned(s.to_owned())))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Scalar::Other)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Scalar::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        drain_map(map).map(|()| Scalar::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        drain_seq(seq).map(|()| Scalar::Other)
    }
}
