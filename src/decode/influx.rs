//! InfluxDB line protocol (`format = "influx"`): one or more lines per message,
//! `measurement[,tag=value...] field=value[,field=value...] [timestamp]`, with the escapes
//! InfluxDB defines (a backslash before a comma, space or `=` in names; before `"` or a
//! backslash in string fields).
//!
//! Sensor = the measurement and its tags with the tags sorted by key (`weather,site=north`),
//! metric = the field key. Float, integer (`1i`), unsigned (`1u`) and boolean fields are
//! readings (booleans 1 and 0); string fields are skipped. The timestamp is in the
//! subscription's `timestamp_unit` (`auto` means nanoseconds here, as InfluxDB), else the
//! receive time. A malformed line is refused alone (`invalid_line`); the message's other lines
//! are kept.

use super::{DecodeContext, DecodeError, Decoded, Num, Scalar, Subscription, TimestampUnit};

/// Decodes every line of `payload` into `out`.
pub(super) fn decode(
    sub: &Subscription,
    payload: &[u8],
    ctx: &DecodeContext,
    out: &mut Decoded,
) -> Result<(), DecodeError> {
    let text = std::str::from_utf8(payload).map_err(|_| DecodeError::InvalidUtf8)?;
    let unit = match sub.timestamp_unit {
        TimestampUnit::Auto => TimestampUnit::Ns,
        unit => unit,
    };
    let mut line_buf = Line::default();
    for line in text.split('\n') {
        let line = line.trim_matches([' ', '\t', '\r']);
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match parse(line, &mut line_buf) {
            Some(()) => line_buf.emit(unit, ctx, out),
            None => out.rejected.push(DecodeError::InvalidLine),
        }
    }
    Ok(())
}

/// One parsed line: its sensor name, its fields (name, number or `None` for a string) and
/// its timestamp.
#[derive(Default)]
struct Line {
    sensor: String,
    tags: Vec<(String, String)>,
    fields: Vec<(String, Option<f64>)>,
    ts: Option<i64>,
}

impl Line {
    fn emit(&self, unit: TimestampUnit, ctx: &DecodeContext, out: &mut Decoded) {
        let ts = match self.ts {
            None => {
                out.receive_time = true;
                ctx.received
            }
            Some(t) => {
                let Some(ts) = super::parse_timestamp(&Scalar::Num(Num::I(t)), unit) else {
                    out.rejected.push(DecodeError::InvalidTimestamp);
                    return;
                };
                ts
            }
        };
        for (i, (name, value)) in self.fields.iter().enumerate() {
            // A repeated field key: the last one counts, as in InfluxDB.
            if self.fields[i + 1..].iter().any(|(later, _)| later == name) {
                continue;
            }
            if let Some(v) = value {
                out.push(ctx, &self.sensor, name, ts, *v);
            }
        }
    }
}

/// Reads a name up to an unescaped byte of `stops` (or the end), unescaping `\` before any
/// of `escapable`. Returns the name and the rest from the stop on.
fn name<'a>(s: &'a str, stops: &[u8], escapable: &[u8], into: &mut String) -> &'a str {
    into.clear();
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut from = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'\\' && i + 1 < bytes.len() && escapable.contains(&bytes[i + 1]) {
            into.push_str(&s[from..i]);
            from = i + 1;
            i += 2;
            continue;
        }
        if stops.contains(&b) {
            break;
        }
        i += 1;
    }
    into.push_str(&s[from..i]);
    &s[i..]
}

/// Parses `line` into `into`; `None` when it is malformed.
fn parse(line: &str, into: &mut Line) -> Option<()> {
    let mut measurement = String::new();
    let mut rest = name(line, b", ", b", \\", &mut measurement);
    if measurement.is_empty() {
        return None;
    }
    into.tags.clear();
    while let Some(after) = rest.strip_prefix(',') {
        let (mut key, mut value) = (String::new(), String::new());
        rest = name(after, b",= ", b",= \\", &mut key);
        rest = rest.strip_prefix('=')?;
        rest = name(rest, b", ", b",= \\", &mut value);
        if key.is_empty() || value.is_empty() {
            return None;
        }
        into.tags.push((key, value));
    }
    rest = rest.strip_prefix(' ')?.trim_start_matches(' ');
    into.fields.clear();
    loop {
        let mut key = String::new();
        rest = name(rest, b",= ", b",= \\", &mut key);
        rest = rest.strip_prefix('=')?;
        if key.is_empty() {
            return None;
        }
        let value;
        (value, rest) = field_value(rest)?;
        into.fields.push((key, value));
        match rest.as_bytes().first() {
            Some(b',') => rest = &rest[1..],
            Some(b' ') | None => break,
            Some(_) => return None,
        }
    }
    let rest = rest.trim_start_matches(' ');
    into.ts = if rest.is_empty() {
        None
    } else {
        Some(rest.parse::<i64>().ok()?)
    };
    // InfluxDB's series key: the measurement, then the tags sorted by key.
    into.tags.sort_by(|a, b| a.0.cmp(&b.0));
    into.sensor.clear();
    into.sensor.push_str(&measurement);
    for (k, v) in &into.tags {
        into.sensor.push(',');
        into.sensor.push_str(k);
        into.sensor.push('=');
        into.sensor.push_str(v);
    }
    Some(())
}

/// A field's value and the rest of the line after it: `Some(number)`, or `None` for a string.
fn field_value(s: &str) -> Option<(Option<f64>, &str)> {
    if let Some(body) = s.strip_prefix('"') {
        // A string: up to the closing unescaped quote (`\"` and `\\` are escapes).
        let bytes = body.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'\\' => i += 2,
                b'"' => return Some((None, &body[i + 1..])),
                _ => i += 1,
            }
        }
        return None;
    }
    let end = s.find([',', ' ']).unwrap_or(s.len());
    let (token, rest) = s.split_at(end);
    let value = match token {
        "t" | "T" | "true" | "True" | "TRUE" => 1.0,
        "f" | "F" | "false" | "False" | "FALSE" => 0.0,
        _ => {
            if let Some(int) = token.strip_suffix('i') {
                int.parse::<i64>().ok()? as f64
            } else if let Some(uint) = token.strip_suffix('u') {
                uint.parse::<u64>().ok()? as f64
            } else {
                // Digits, a sign, a point or an exponent only: Rust's parser would also
                // take `inf` and `NaN`, which InfluxDB refuses.
                let numeric = token
                    .bytes()
                    .all(|b| b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E'));
                if !numeric {
                    return None;
                }
                token.parse::<f64>().ok()?
            }
        }
    };
    Some((Some(value), rest))
}
