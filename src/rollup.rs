//! Rollups: hourly buckets merged into coarser windows (`step`) for queries. Pure.
//!
//! Windows are aligned to UTC midnight: a step that divides a day starts at midnight and every
//! step after it; a step of whole days starts at midnight of every n-th day counted from the
//! epoch, and a step of whole weeks starts on Monday.

use crate::doc::BucketDoc;
use crate::summary::Summary;

const DAY_SECS: i64 = 86_400;
const WEEK_SECS: i64 = 7 * DAY_SECS;
/// 1970-01-05, the first Monday after the epoch.
const FIRST_MONDAY_SECS: i64 = 4 * DAY_SECS;

/// One window of a rollup: `[start, end)` in seconds and the merge of its buckets.
#[derive(Debug, Clone, PartialEq)]
pub struct Window {
    pub start: i64,
    pub end: i64,
    pub summary: Summary,
}

/// Parses a step (`1h`, `1d`, `7d`, ...) for buckets of `width_secs`: it must be a whole
/// multiple of the bucket width, and either divide a day or be whole days.
pub fn parse_step(text: &str, width_secs: i64) -> Result<i64, String> {
    let d = humantime::parse_duration(text)
        .map_err(|e| format!("`{text}` is not a duration like 1h, 1d or 7d ({e})"))?;
    let secs = i64::try_from(d.as_secs()).map_err(|_| format!("`{text}` is too long"))?;
    let fits = d.subsec_nanos() == 0
        && secs > 0
        && secs % width_secs == 0
        && (DAY_SECS % secs == 0 || secs % DAY_SECS == 0);
    if fits {
        Ok(secs)
    } else {
        Err(format!(
            "`{text}` must be a multiple of the bucket width ({width_secs}s) that divides a day \
             or is a whole number of days"
        ))
    }
}

/// A step as it is written back in answers: `1h`, `6h`, `1d`, `7d`, `30m`.
pub fn format_step(secs: i64) -> String {
    match secs {
        s if s % DAY_SECS == 0 => format!("{}d", s / DAY_SECS),
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// The start of the window of `step_secs` holding `t`.
pub fn window_start(t: i64, step_secs: i64) -> i64 {
    let origin = if step_secs % WEEK_SECS == 0 {
        FIRST_MONDAY_SECS
    } else {
        0
    };
    (t - origin).div_euclid(step_secs) * step_secs + origin
}

/// Merges `docs` (one series, in time order) into windows of `step_secs`.
pub fn rollup(docs: &[BucketDoc], step_secs: i64) -> Vec<Window> {
    let mut out: Vec<Window> = Vec::new();
    for doc in docs {
        let start = window_start(doc.start, step_secs);
        match out.last_mut() {
            Some(w) if w.start == start => w.summary.merge(&doc.summary()),
            _ => out.push(Window {
                start,
                end: start + step_secs,
                summary: doc.summary(),
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(start: i64, values: &[f64]) -> BucketDoc {
        let mut s = Summary::of(start * 1_000_000_000, values[0]);
        for (i, v) in values[1..].iter().enumerate() {
            s.push((start + i as i64 + 1) * 1_000_000_000, *v);
        }
        BucketDoc::new("s/m", start, 3600, &s)
    }

    #[test]
    fn steps_must_fit_the_bucket_width_and_the_day() {
        assert_eq!(parse_step("1h", 3600), Ok(3600));
        assert_eq!(parse_step("1d", 3600), Ok(86_400));
        assert_eq!(parse_step("7d", 3600), Ok(604_800));
        assert_eq!(parse_step("6h", 3600), Ok(21_600));
        for step in ["1h", "6h", "1d", "7d", "30m", "15s"] {
            assert_eq!(format_step(parse_step(step, 1).unwrap()), step);
        }
        assert!(parse_step("90m", 3600).is_err(), "not a multiple of 1h");
        assert!(parse_step("5h", 3600).is_err(), "does not divide a day");
        assert!(parse_step("30m", 3600).is_err(), "finer than a bucket");
        assert!(parse_step("soon", 3600).is_err());
        assert!(parse_step("0s", 3600).is_err());
    }

    #[test]
    fn windows_align_to_midnight_and_weeks_to_monday() {
        let t = 1_763_719_200 + 3 * 3600; // 2025-11-21T13:00Z, a Friday
        assert_eq!(window_start(t, 86_400), 1_763_683_200); // 2025-11-21T00:00Z
        assert_eq!(window_start(t, 6 * 3600), 1_763_726_400); // 12:00Z
        assert_eq!(window_start(t, WEEK_SECS), 1_763_337_600); // Monday 2025-11-17T00:00Z
        assert_eq!(window_start(-1, 86_400), -86_400);
    }

    /// Issue 20: three buckets of a day counting `i64::MAX` readings each (from a forged delta)
    /// aborted `/api/v1/buckets?step=1d` on the merge's `expect`; the count now saturates.
    #[test]
    fn a_daily_rollup_of_huge_counts_saturates() {
        let day = 1_763_683_200;
        let docs: Vec<BucketDoc> = (0..3)
            .map(|h| BucketDoc {
                count: i64::MAX,
                ..doc(day + h * 3600, &[1.0])
            })
            .collect();
        let windows = rollup(&docs, 86_400);
        assert_eq!(windows.len(), 1);
        assert_eq!(windows[0].summary.count, u64::MAX);
        let json =
            crate::export::summary_json(windows[0].start, windows[0].end, &windows[0].summary);
        assert_eq!(json["count"], serde_json::json!(u64::MAX));
    }

    /// A day's rollup of a meter's hours is the day's increase, resets counted: the
    /// readings 1 to 20 (two an hour), a reset to 5 at hour 10, then 6 to 32 increase by 19,
    /// then 5 (the reset: the counter counted from 0), then 27.
    #[test]
    fn a_daily_rollup_of_a_meter_is_its_increase() {
        let day = 1_763_683_200;
        let mut v = 0.0;
        let docs: Vec<BucketDoc> = (0..24)
            .map(|h| {
                let mut values = Vec::new();
                for _ in 0..2 {
                    v = if h == 10 && values.is_empty() {
                        5.0
                    } else {
                        v + 1.0
                    };
                    values.push(v);
                }
                doc(day + h * 3600, &values)
            })
            .collect();
        // The readings' steps: each rise, and at the reset the value it reset to.
        let readings: Vec<f64> = docs
            .iter()
            .flat_map(|d| [d.first.value, d.last.value])
            .collect();
        let want: f64 = readings
            .windows(2)
            .map(|w| if w[1] < w[0] { w[1] } else { w[1] - w[0] })
            .sum();
        assert_eq!(want, 19.0 + 5.0 + 27.0);
        let windows = rollup(&docs, 86_400);
        assert_eq!(windows.len(), 1);
        assert_eq!(windows[0].summary.inc, Some(want));
        let json =
            crate::export::summary_json(windows[0].start, windows[0].end, &windows[0].summary);
        assert_eq!(json["increase"], serde_json::json!(want));
    }

    #[test]
    fn a_daily_rollup_merges_the_hours_of_each_day() {
        let day = 1_763_683_200;
        let docs: Vec<BucketDoc> = (0..30)
            .map(|h| doc(day + h * 3600, &[h as f64, -(h as f64)]))
            .collect();
        let windows = rollup(&docs, 86_400);
        assert_eq!(windows.len(), 2);
        assert_eq!((windows[0].start, windows[0].end), (day, day + 86_400));
        assert_eq!(windows[0].summary.count, 48);
        assert_eq!(windows[1].summary.count, 12);
        assert_eq!(windows[0].summary.max, 23.0);
        assert_eq!(windows[0].summary.min, -23.0);
        assert_eq!(windows[0].summary.total(), 0.0);
        assert_eq!(windows[1].summary.first.ts, (day + 86_400) * 1_000_000_000);
    }
}
