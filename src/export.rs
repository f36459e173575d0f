//! `bucketd export`: buckets of a database file as NDJSON or CSV, one bucket per line. The
//! formatting is pure; [`crate::store::StoreReader`] does the reading.

use std::io::Write;

use serde_json::json;

use crate::doc::BucketDoc;
use crate::reading::Timestamp;
use crate::summary::Summary;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    Ndjson,
    Csv,
}

/// The aggregates of a window `[start, end)` (seconds) as the HTTP API and export show them:
/// times in RFC 3339 UTC with milliseconds, numbers in shortest round-trip form.
pub fn summary_json(
    start: i64,
    end: i64,
    s: &Summary,
) -> serde_json::Map<String, serde_json::Value> {
    let point = |p: &crate::summary::Point| json!({"ts": Timestamp::from_nanos(p.ts).to_rfc3339_millis(), "value": p.value});
    let value = json!({
        "start": Timestamp::from_secs(start).to_rfc3339_millis(),
        "end": Timestamp::from_secs(end).to_rfc3339_millis(),
        "count": s.count,
        "sum": s.total(),
        "min": s.min,
        "max": s.max,
        "mean": s.mean,
        "stddev": s.stddev(),
        "first": point(&s.first),
        "last": point(&s.last),
        "p50": s.quantile(0.5),
        "p90": s.quantile(0.9),
        "p99": s.quantile(0.99),
        // A counter's increase over the readings, resets counted; null where the
        // bucket does not know it. A rollup's joins its buckets': a meter's kWh per day.
        "increase": s.inc,
    });
    match value {
        serde_json::Value::Object(map) => map,
        _ => unreachable!("json! of an object literal is an object"),
    }
}

/// The JSON object of one stored bucket: [`summary_json`] plus the series names, `m2`, `pages`
/// and `schema_version`.
pub fn bucket_json(doc: &BucketDoc) -> serde_json::Value {
    let mut map = serde_json::Map::new();
    map.insert("series".into(), json!(doc.series));
    map.insert("sensor".into(), json!(doc.sensor));
    map.insert("metric".into(), json!(doc.metric));
    map.extend(summary_json(doc.start, doc.end, &doc.summary()));
    map.insert("m2".into(), json!(doc.m2));
    map.insert("pages".into(), json!(doc.pages));
    map.insert("schema_version".into(), json!(doc.schema_version));
    serde_json::Value::Object(map)
}

pub const CSV_HEADER: &str = "series,sensor,metric,start,end,count,sum,min,max,mean,m2,stddev,\
first_ts,first_value,last_ts,last_value,p50,p90,p99,pages";

/// One CSV line (no newline) in the column order of [`CSV_HEADER`].
pub fn bucket_csv(doc: &BucketDoc) -> String {
    let s = doc.summary();
    let fields = [
        csv_text(&doc.series),
        csv_text(&doc.sensor),
        csv_text(&doc.metric),
        Timestamp::from_secs(doc.start).to_rfc3339_millis(),
        Timestamp::from_secs(doc.end).to_rfc3339_millis(),
        doc.count.to_string(),
        number(s.total()),
        number(doc.min),
        number(doc.max),
        number(doc.mean),
        number(doc.m2),
        number(s.stddev()),
        Timestamp::from_nanos(doc.first.ts).to_rfc3339_millis(),
        number(doc.first.value),
        Timestamp::from_nanos(doc.last.ts).to_rfc3339_millis(),
        number(doc.last.value),
        s.quantile(0.5).map_or(String::new(), number),
        s.quantile(0.9).map_or(String::new(), number),
        s.quantile(0.99).map_or(String::new(), number),
        doc.pages.to_string(),
    ];
    fields.join(",")
}

/// The bucket starts (whole seconds) of `from <= start < to`, as `/api/v1/buckets` takes them:
/// a bucket starting at 10:00:00 is before a `from` of 10:00:00.5 and before a `to` of
/// 10:00:00.5 too. Unbounded ends are open.
pub fn bucket_range(from: Option<Timestamp>, to: Option<Timestamp>) -> (i64, i64) {
    (
        from.map_or(i64::MIN, Timestamp::ceil_secs),
        to.map_or(i64::MAX, Timestamp::ceil_secs),
    )
}

/// Shortest representation that parses back to the same f64 (`1e+300`, not 301 digits).
pub fn number(v: f64) -> String {
    if v.is_finite() {
        serde_json::to_string(&v).expect("finite floats serialize")
    } else {
        v.to_string()
    }
}

/// A CSV cell (RFC 4180): quoted when it holds a comma, quote or line break. Text that a
/// spreadsheet would run as a formula (first character `=`, `+`, `-`, `@`, tab or carriage
/// return, e.g. a sensor named `=HYPERLINK(...)` by a device) gets a leading `'`, which
/// spreadsheets show as text (OWASP's advice on CSV injection); numbers such as `-1.5` stay as
/// they are.
pub fn csv_text(s: &str) -> String {
    let formula = s.starts_with(['=', '+', '-', '@', '\t', '\r']) && s.parse::<f64>().is_err();
    let s = if formula {
        std::borrow::Cow::Owned(format!("'{s}"))
    } else {
        std::borrow::Cow::Borrowed(s)
    };
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.into_owned()
    }
}

/// Writes one bucket's raw readings of `series` (already in timestamp order) as NDJSON lines
/// `{"series", "ts", "value"}` or CSV rows `series,ts,value` (the caller writes the CSV header).
pub fn write_raw(
    out: &mut impl Write,
    series: &str,
    readings: &[(i64, f64)],
    format: ExportFormat,
) -> std::io::Result<()> {
    for (ts, value) in readings {
        let ts = Timestamp::from_nanos(*ts).to_rfc3339_millis();
        match format {
            ExportFormat::Ndjson => {
                serde_json::to_writer(
                    &mut *out,
                    &json!({"series": series, "ts": ts, "value": value}),
                )?;
                out.write_all(b"\n")?;
            }
            ExportFormat::Csv => writeln!(out, "{},{ts},{}", csv_text(series), number(*value))?,
        }
    }
    out.flush()
}

/// Writes `docs` in `format` to `out`.
pub fn write(
    out: &mut impl Write,
    docs: &[BucketDoc],
    format: ExportFormat,
) -> std::io::Result<()> {
    match format {
        ExportFormat::Ndjson => {
            for doc in docs {
                serde_json::to_writer(&mut *out, &bucket_json(doc))?;
                out.write_all(b"\n")?;
            }
        }
        ExportFormat::Csv => {
            writeln!(out, "{CSV_HEADER}")?;
            for doc in docs {
                writeln!(out, "{}", bucket_csv(doc))?;
            }
        }
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_in_shortest_round_trip_form() {
        for v in [0.1, 1e300, f64::MAX, f64::MIN_POSITIVE / 3.0, -21.5, 1.0] {
            assert_eq!(number(v).parse::<f64>().unwrap().to_bits(), v.to_bits());
        }
        assert!(number(1e300).len() <= 6, "{}", number(1e300));
        assert_eq!(number(21.5), "21.5");
    }

    /// `--from 10:00:00.5` excludes the 10:00:00 bucket, as the API does (it was included).
    #[test]
    fn a_fractional_from_or_to_bounds_buckets_as_the_api_does() {
        let at = |nanos: i64| Some(Timestamp::from_nanos(nanos));
        let ten = 36_000i64;
        assert_eq!(
            bucket_range(
                at(ten * 1_000_000_000 + 500_000_000),
                at((ten + 3600) * 1_000_000_000)
            ),
            (ten + 1, ten + 3600)
        );
        assert_eq!(
            bucket_range(None, at((ten + 3600) * 1_000_000_000 + 1)),
            (i64::MIN, ten + 3601)
        );
        assert_eq!(bucket_range(None, None), (i64::MIN, i64::MAX));
    }

    #[test]
    fn csv_defuses_formulas_but_keeps_numbers() {
        assert_eq!(
            csv_text("=HYPERLINK(\"http://x\",\"y\")"),
            "\"'=HYPERLINK(\"\"http://x\"\",\"\"y\"\")\""
        );
        for name in ["+1+1", "-2+3", "@SUM(A1)", "\tx", "=1"] {
            assert_eq!(csv_text(name), format!("'{name}"), "{name:?}");
        }
        assert_eq!(csv_text("\r=1"), "\"'\r=1\"");
        for plain in ["-1.5", "+3", "-inf", "1e-3", "kitchen", "a-b", "a=b", ""] {
            assert_eq!(csv_text(plain), plain, "{plain:?}");
        }
    }

    #[test]
    fn csv_quotes_names_with_commas_and_has_a_column_per_header() {
        let mut s = Summary::of(3_600_000_000_000, 1.5);
        s.push(3_600_000_000_001, 2.5);
        let doc = BucketDoc::new("a,b/t", 3600, 3600, &s);
        let line = bucket_csv(&doc);
        assert!(line.starts_with("\"a,b/t\",\"a,b\",t,1970-01-01T01:00:00.000Z,"));
        assert_eq!(
            line.split(',').count() - 2,
            CSV_HEADER.split(',').count(),
            "two commas are inside quotes"
        );
        let json = bucket_json(&doc);
        assert_eq!(json["count"], 2);
        assert_eq!(json["sum"], 4.0);
        assert_eq!(json["first"]["value"], 1.5);
        assert_eq!(json["last"]["ts"], "1970-01-01T01:00:00.000Z");
    }
}
