//! The domain values: [`Timestamp`] (UTC nanoseconds), [`Reading`] and series names. No I/O.

use std::fmt;

use crate::reject::DecodeError;

/// Longest sensor or metric name, in bytes.
pub const NAME_BYTES_MAX: usize = 128;

/// A point in time: nanoseconds since the Unix epoch, UTC (1677..2262).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(i64);

impl Timestamp {
    pub const fn from_nanos(nanos: i64) -> Timestamp {
        Timestamp(nanos)
    }

    pub const fn from_secs(secs: i64) -> Timestamp {
        Timestamp(secs.saturating_mul(1_000_000_000))
    }

    pub const fn as_nanos(self) -> i64 {
        self.0
    }

    /// The first whole second at or after this time. A bucket (starting on a whole second) is in
    /// `[from, to)` exactly when its start is in `[from.ceil_secs(), to.ceil_secs())`.
    pub const fn ceil_secs(self) -> i64 {
        self.0.div_euclid(1_000_000_000) + (self.0.rem_euclid(1_000_000_000) != 0) as i64
    }

    /// The current time from the system clock.
    pub fn now() -> Timestamp {
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Timestamp(i64::try_from(since.as_nanos()).unwrap_or(i64::MAX))
    }

    #[must_use]
    pub fn saturating_add(self, d: std::time::Duration) -> Timestamp {
        Timestamp(
            self.0
                .saturating_add(i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
        )
    }

    #[must_use]
    pub fn saturating_sub(self, d: std::time::Duration) -> Timestamp {
        Timestamp(
            self.0
                .saturating_sub(i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
        )
    }

    /// Start (in whole seconds since the epoch) of the bucket of `width_secs` holding this time.
    pub fn bucket_start(self, width_secs: i64) -> i64 {
        self.0.div_euclid(1_000_000_000).div_euclid(width_secs) * width_secs
    }

    /// Parses RFC 3339 (`2026-11-21T10:00:00.123Z`, any offset) or plain epoch seconds.
    pub fn parse(text: &str) -> Option<Timestamp> {
        if let Ok(secs) = text.parse::<i64>() {
            return secs.checked_mul(1_000_000_000).map(Timestamp);
        }
        Timestamp::parse_rfc3339(text)
    }

    pub fn parse_rfc3339(text: &str) -> Option<Timestamp> {
        let parsed = chrono::DateTime::parse_from_rfc3339(text).ok()?;
        parsed.timestamp_nanos_opt().map(Timestamp)
    }

    /// RFC 3339 UTC with milliseconds, e.g. `2026-11-21T10:00:00.123Z`.
    pub fn to_rfc3339_millis(self) -> String {
        chrono::DateTime::from_timestamp_nanos(self.0)
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339_millis())
    }
}

/// One sensor reading. `series` is the series name `sensor/metric`.
#[derive(Debug, Clone, PartialEq)]
pub struct Reading {
    pub series: String,
    pub ts: Timestamp,
    pub value: f64,
}

impl Reading {
    /// Builds a reading from already validated names.
    pub fn new(sensor: &str, metric: &str, ts: Timestamp, value: f64) -> Reading {
        let mut series = String::with_capacity(sensor.len() + 1 + metric.len());
        series.push_str(sensor);
        series.push('/');
        series.push_str(metric);
        Reading { series, ts, value }
    }
}

/// Splits a series name into (sensor, metric). Names never contain `/`, so the split is unique.
pub fn split_series(series: &str) -> (&str, &str) {
    series
        .split_once('/')
        .expect("series names are built as sensor/metric")
}

/// A sensor or metric name is 1..=128 bytes of UTF-8 without control characters and without `/`.
pub fn validate_name(name: &str) -> Result<(), DecodeError> {
    let ok = !name.is_empty()
        && name.len() <= NAME_BYTES_MAX
        && !name.chars().any(|c| c == '/' || c.is_control());
    if ok {
        Ok(())
    } else {
        Err(DecodeError::InvalidName)
    }
}

/// A gateway id (`upstream.gateway_id`, and the `gateway_id` of a delta message): 1..=64 ASCII
/// letters, digits, `-`, `_` or `.`, so that `<gateway_id>:<sensor>` is a valid sensor name.
pub fn valid_gateway_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Validates a full series name `sensor/metric`.
pub fn validate_series(series: &str) -> Result<(), DecodeError> {
    let (sensor, metric) = series.split_once('/').ok_or(DecodeError::InvalidName)?;
    validate_name(sensor)?;
    validate_name(metric)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceil_secs_rounds_up_to_the_next_whole_second_either_side_of_the_epoch() {
        assert_eq!(Timestamp::from_secs(36_000).ceil_secs(), 36_000);
        assert_eq!(
            Timestamp::from_nanos(36_000_500_000_000).ceil_secs(),
            36_001
        );
        assert_eq!(Timestamp::from_nanos(-1).ceil_secs(), 0);
        assert_eq!(Timestamp::from_nanos(-1_500_000_000).ceil_secs(), -1);
        assert_eq!(
            Timestamp::from_nanos(i64::MAX).ceil_secs(),
            i64::MAX / 1_000_000_000 + 1
        );
        assert_eq!(
            Timestamp::from_nanos(i64::MIN).ceil_secs(),
            i64::MIN / 1_000_000_000
        );
    }

    #[test]
    fn bucket_start_floors_negative_times_too() {
        assert_eq!(Timestamp::from_secs(7199).bucket_start(3600), 3600);
        assert_eq!(Timestamp::from_secs(7200).bucket_start(3600), 7200);
        assert_eq!(Timestamp::from_nanos(-1).bucket_start(3600), -3600);
    }

    #[test]
    fn rfc3339_with_offset_and_epoch_seconds_parse_to_the_same_instant() {
        let a = Timestamp::parse("2025-11-21T11:00:00+01:00").unwrap();
        let b = Timestamp::parse("2025-11-21T10:00:00Z").unwrap();
        let c = Timestamp::parse("1763719200").unwrap();
        assert_eq!(a, b);
        assert_eq!(b, c);
        assert_eq!(b.to_rfc3339_millis(), "2025-11-21T10:00:00.000Z");
        assert_eq!(Timestamp::parse("yesterday"), None);
    }

    #[test]
    fn names_reject_slash_control_empty_and_long() {
        assert!(validate_name("temp").is_ok());
        assert!(validate_name("température").is_ok());
        assert!(validate_name("").is_err());
        assert!(validate_name("a/b").is_err());
        assert!(validate_name("a\nb").is_err());
        assert!(validate_name(&"x".repeat(128)).is_ok());
        assert!(validate_name(&"x".repeat(129)).is_err());
    }
}
