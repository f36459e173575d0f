//! The part of PromQL that bucketd answers, over its buckets: parsing here, evaluating a query
//! at a grid of times in [`eval`]. Pure (the caller reads the buckets).
//!
//! What is supported (docs/PROMETHEUS.md): selectors of the metrics `bucketd_bucket_<field>`
//! with the labels `series`, `sensor` and `metric` (`=`, `!=`, `=~`, `!~`), with `offset`; the
//! readings themselves as `bucketd_reading` inside range functions; the `*_over_time` functions
//! over a whole number of buckets, `absent` and `absent_over_time`; the aggregations `sum`,
//! `avg`, `min`, `max`, `count`, `stddev`, `stdvar`, `quantile`, `topk` and `bottomk` with `by`
//! or `without`; arithmetic (`+ - * / % ^`) and comparisons (`== != < > <= >=`, with `bool`)
//! between numbers and series or between series (one to one, `on` / `ignoring`). Anything else
//! is an error that names what is not supported.

/// Longest query text.
pub const QUERY_BYTES_MAX: usize = 4096;
/// Most compiled size of one regular expression (the regex engine's limit): with at most
/// [`MATCHERS_MAX`] matchers per selector, what a client's query compiles stays small. Label
/// filters (`boil.*|attic`) take a few KiB; matching is linear in the input anyway.
const REGEX_SIZE_MAX: usize = 32 * 1024;
/// Most label matchers in one selector.
pub const MATCHERS_MAX: usize = 8;
/// Deepest nesting of parentheses, signs and aggregations in a query.
const NESTING_MAX: usize = 64;
/// Deepest nesting in a regular expression.
const REGEX_NESTING_MAX: u32 = 64;
/// Most points per series in one answer, as Prometheus refuses more.
pub const POINTS_PER_SERIES_MAX: u64 = 11_000;

mod ast;
mod lex;
mod parse;

pub use self::ast::*;
pub use self::parse::{parse, parse_series_selector};

/// A value as Prometheus writes it in JSON: `"21.5"`, `"NaN"`, `"+Inf"`.
pub fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}

/// A time in milliseconds as Prometheus writes it: seconds, with the milliseconds when there
/// are any.
pub fn format_time(ms: i64) -> serde_json::Value {
    if ms % 1000 == 0 {
        serde_json::Value::from(ms / 1000)
    } else {
        serde_json::Value::from(ms as f64 / 1000.0)
    }
}

/// Parses a time parameter: float seconds since the epoch or RFC 3339. Milliseconds.
pub fn parse_time(text: &str) -> Result<i64, String> {
    if let Ok(secs) = text.parse::<f64>() {
        let ms = (secs * 1000.0).round();
        // Prometheus's own range: what an i64 of milliseconds holds, and finite.
        if ms.is_finite() && ms.abs() < 9.2e18 {
            return Ok(ms as i64);
        }
    } else if let Some(t) = crate::reading::Timestamp::parse(text) {
        return Ok(t.as_nanos().div_euclid(1_000_000));
    }
    Err(format!(
        "cannot parse {text:?} to a valid timestamp (float seconds or RFC 3339)"
    ))
}

/// Parses a duration parameter (`step`): float seconds, or Prometheus's units (`90s`, `1h30m`,
/// `1d`, `1w`, `1y` = 365 days, `500ms`). Milliseconds.
pub fn parse_duration(text: &str) -> Result<i64, String> {
    let bad = || format!("cannot parse {text:?} to a valid duration");
    if let Ok(secs) = text.parse::<f64>() {
        let ms = (secs * 1000.0).round();
        return if ms.is_finite() && ms.abs() < 9.2e18 {
            Ok(ms as i64)
        } else {
            Err(bad())
        };
    }
    let mut total: i64 = 0;
    let mut rest = text;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n: i64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit_ms: i64 = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "w" => 604_800_000,
            "y" => 31_536_000_000,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        total = n
            .checked_mul(unit_ms)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(bad)?;
    }
    Ok(total)
}

mod eval;
pub use eval::*;

#[cfg(test)]
mod tests;
