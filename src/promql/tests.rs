use super::*;
use crate::doc::BucketDoc;
use crate::rollup;
use crate::summary::Summary;
use std::collections::BTreeMap;

const HOUR: i64 = 3600;
/// 2025-11-21T00:00Z, a midnight.
const DAY0: i64 = 1_763_683_200;

fn doc(series: &str, start: i64, values: &[f64]) -> BucketDoc {
    let mut s = Summary::of(start * 1_000_000_000, values[0]);
    for (i, v) in values[1..].iter().enumerate() {
        s.push((start + i as i64 + 1) * 1_000_000_000, *v);
    }
    BucketDoc::new(series, start, HOUR, &s)
}

fn select_of(text: &str) -> Select {
    match parse(text) {
        Ok(Expr::Select(s)) => s,
        other => panic!("{text}: {other:?}"),
    }
}

/// The aggregation at the top of `text`: its operator, grouping and what it aggregates.
fn aggregation(text: &str) -> (AggOp, Grouping, Expr) {
    match parse(text) {
        Ok(Expr::Aggregate {
            op,
            grouping,
            inner,
            ..
        }) => (op, grouping, *inner),
        other => panic!("{text}: {other:?}"),
    }
}

fn error(text: &str) -> String {
    match parse(text) {
        Err(e) => e,
        Ok(e) => panic!("{text} parsed: {e:?}"),
    }
}

fn selects(text: &str, series: &str) -> Vec<Field> {
    let v = select_of(text);
    if v.selector.matches_series(&SeriesLabels::of(series, false)) {
        v.selector.fields()
    } else {
        Vec::new()
    }
}

#[test]
fn selectors_match_names_and_labels_with_all_four_operators() {
    assert_eq!(selects("bucketd_bucket_mean", "boiler/temp"), [Field::Mean]);
    assert_eq!(
        selects(r#"bucketd_bucket_p99{sensor="boiler"}"#, "boiler/temp"),
        [Field::P99]
    );
    assert!(selects(r#"bucketd_bucket_p99{sensor="boiler"}"#, "attic/temp").is_empty());
    assert!(selects(r#"bucketd_bucket_max{sensor!="boiler"}"#, "boiler/temp").is_empty());
    assert_eq!(
        selects(r#"bucketd_bucket_max{sensor!="boiler"}"#, "attic/temp"),
        [Field::Max]
    );
    // Regular expressions are anchored at both ends, as in Prometheus.
    assert!(selects(r#"bucketd_bucket_min{sensor=~"boil"}"#, "boiler/temp").is_empty());
    assert_eq!(
        selects(
            r#"bucketd_bucket_min{sensor=~"boil.*|attic"}"#,
            "attic/temp"
        ),
        [Field::Min]
    );
    assert!(selects(r#"bucketd_bucket_min{metric!~"te.*"}"#, "attic/temp").is_empty());
    assert_eq!(
        selects(
            r#"{__name__=~"bucketd_bucket_(mean|p50)", series="a/b"}"#,
            "a/b"
        ),
        [Field::Mean, Field::P50]
    );
    // Single quotes, backquotes, a trailing comma, escapes kept for the regular expression.
    assert_eq!(
        selects(r"bucketd_bucket_sum{series='a.b/c', }", "a.b/c"),
        [Field::Sum]
    );
    assert!(selects(r#"bucketd_bucket_sum{series=~"a\\.b/c"}"#, "aXb/c").is_empty());
    assert_eq!(
        selects(r"bucketd_bucket_sum{series=~`a\.b/c`}", "a.b/c"),
        [Field::Sum]
    );
    // A name that is not one of ours selects nothing; an unknown label has the empty value.
    assert!(selects("up", "a/b").is_empty());
    assert_eq!(
        selects(r#"bucketd_bucket_count{job=""}"#, "a/b"),
        [Field::Count]
    );
}

#[test]
fn numbers_are_computed_for_grafanas_health_check() {
    for (text, want) in [
        ("1+1", 2.0),
        ("2 * 3 - 4 / 2", 4.0),
        ("-(1 + 2)", -3.0),
        ("1.5e3", 1500.0),
        ("(2)", 2.0),
    ] {
        assert_eq!(parse(text).unwrap().number(), Some(want), "{text}");
    }
    assert!(parse("NaN").unwrap().number().is_some_and(f64::is_nan));
    assert_eq!(
        parse("2 ^ 3 ^ 2").unwrap().number(),
        Some(512.0),
        "^ binds right"
    );
    assert_eq!(
        parse("-2 ^ 2").unwrap().number(),
        Some(-4.0),
        "^ before the sign"
    );
    assert_eq!(parse("7 % 4 + 1").unwrap().number(), Some(4.0));
    assert_eq!(parse("1 < bool 2").unwrap().number(), Some(1.0));
}

#[test]
fn aggregations_parse_with_the_grouping_before_or_after() {
    let (op, grouping, _) = aggregation(r#"sum by (sensor) (bucketd_bucket_count{metric="t"})"#);
    assert_eq!(
        (op, grouping),
        (AggOp::Sum, Grouping::By(vec!["sensor".into()]))
    );
    let (op, grouping, _) =
        aggregation(r#"avg(bucketd_bucket_mean{metric="t"}) without (series, sensor)"#);
    assert_eq!(
        (op, grouping),
        (
            AggOp::Avg,
            Grouping::Without(vec!["series".into(), "sensor".into()])
        )
    );
    let (op, grouping, inner) = aggregation("max(bucketd_bucket_max)");
    assert_eq!((op, grouping), (AggOp::Max, Grouping::By(Vec::new())));
    assert!(matches!(inner, Expr::Select(s) if s.selector.fields() == [Field::Max]));
    // Keywords in any case, as Prometheus takes them (issue 44: `SUM`/`BY` were refused).
    let (op, grouping, _) = aggregation(r#"SUM BY (sensor) (bucketd_bucket_count{metric="t"})"#);
    assert_eq!(
        (op, grouping),
        (AggOp::Sum, Grouping::By(vec!["sensor".into()]))
    );
    let (op, grouping, _) = aggregation("Avg(bucketd_bucket_mean) WITHOUT (series)");
    assert_eq!(
        (op, grouping),
        (AggOp::Avg, Grouping::Without(vec!["series".into()]))
    );
    let (op, _, _) = aggregation("topk(3, bucketd_bucket_max)");
    assert_eq!(op, AggOp::Topk);
    let (op, _, _) = aggregation("quantile by (metric) (0.9, bucketd_bucket_mean)");
    assert_eq!(op, AggOp::Quantile);
}

#[test]
fn what_is_not_supported_is_named_in_the_error() {
    for (text, names) in [
        ("sort_by_label(bucketd_reading)", "function `sort_by_label`"),
        ("bucketd_bucket_count[5m]", "inside a range function"),
        (
            "avg_over_time(bucketd_bucket_count)",
            "takes a range selector",
        ),
        ("bucketd_reading[1h:5m]", "goes inside a range function"),
        ("avg_over_time(1[1h:5m])", "not of a number"),
        (
            "sum(bucketd_bucket_count) @ 100",
            "@ goes after a series selector",
        ),
        ("bucketd_bucket_count @ now()", "expected a time after @"),
        (
            "avg_over_time(bucketd_reading[1h:0s])",
            "step must be positive",
        ),
        ("1 == 1", "bool modifier"),
        ("bucketd_bucket_max + bool 1", "only after a comparison"),
        (
            "bucketd_bucket_max * group_left bucketd_bucket_min",
            "go after on (...) or ignoring",
        ),
        (
            "bucketd_bucket_max and on (sensor) group_left bucketd_bucket_min",
            "no group_left or group_right with a set operator",
        ),
        ("topk(bucketd_bucket_max)", "takes 2 argument"),
        (
            "topk(bucketd_bucket_max, bucketd_bucket_max)",
            "parameter must be a number",
        ),
        ("sum(1)", "takes series"),
        (
            "quantile_over_time(bucketd_reading[1h])",
            "takes 2 argument",
        ),
        (r#"{sensor=~".*"}"#, "a selector needs"),
        (r#"{sensor=""}"#, "a selector needs"),
        (r#"bucketd_bucket_max{sensor="a"#, "unterminated string"),
        (
            r#"bucketd_bucket_max{sensor=~"("}"#,
            "bad regular expression",
        ),
        (r"bucketd_bucket_max{sensor=boiler}", "quoted string"),
        ("sum by sensor (bucketd_bucket_max)", "label list"),
        ("", "empty"),
        ("1 +", "ends too early"),
        ("bucketd_bucket_max )", "after the expression"),
    ] {
        let e = error(text);
        assert!(e.contains(names), "{text}: {e}");
    }
    let long = format!(
        "bucketd_bucket_max{{series=\"{}\"}}",
        "a".repeat(QUERY_BYTES_MAX)
    );
    assert!(error(&long).contains("longer than"));
}

#[test]
fn times_and_durations_parse_as_prometheus_writes_them() {
    assert_eq!(parse_time("1763683200"), Ok(1_763_683_200_000));
    assert_eq!(parse_time("1763683200.123"), Ok(1_763_683_200_123));
    assert_eq!(parse_time("2025-11-21T00:00:00Z"), Ok(1_763_683_200_000));
    assert!(parse_time("yesterday").is_err());
    assert!(parse_time("1e300").is_err());
    assert!(parse_time("NaN").is_err());
    assert_eq!(parse_duration("15"), Ok(15_000));
    assert_eq!(parse_duration("0.5"), Ok(500));
    assert_eq!(parse_duration("1h30m"), Ok(5_400_000));
    assert_eq!(parse_duration("1d"), Ok(86_400_000));
    assert_eq!(parse_duration("1w"), Ok(604_800_000));
    assert_eq!(parse_duration("1y"), Ok(31_536_000_000));
    assert_eq!(parse_duration("250ms"), Ok(250));
    for bad in ["", "h", "1x", "5m3", "99999999999999999999y", "-"] {
        assert!(parse_duration(bad).is_err(), "{bad}");
    }
    assert_eq!(format_value(21.5), "21.5");
    assert_eq!(format_value(1e21), "1000000000000000000000");
    assert_eq!(format_value(f64::NEG_INFINITY), "-Inf");
    assert_eq!(
        format_time(1_763_683_200_000),
        serde_json::json!(1_763_683_200)
    );
    assert_eq!(
        format_time(1_763_683_200_500),
        serde_json::json!(1_763_683_200.5)
    );
}

const BUDGET: Budget = Budget {
    max_points: 10_000,
    cancel: None,
    notes: None,
};

/// What the store answers for `wanted` in `[from, to)`: their documents among `docs`.
fn fetch(
    docs: &[BucketDoc],
    wanted: &[&str],
    from: i64,
    to: i64,
) -> BTreeMap<String, Vec<BucketDoc>> {
    let mut out: BTreeMap<String, Vec<BucketDoc>> = BTreeMap::new();
    for d in docs {
        if wanted.contains(&d.series.as_str()) && (from..to).contains(&d.start) {
            out.entry(d.series.clone()).or_default().push(d.clone());
        }
    }
    out
}

fn eval(text: &str, docs: &[BucketDoc], grid: Grid) -> Vec<Series> {
    match try_eval(text, docs, grid) {
        Ok(Value::Vector(v)) => v,
        other => panic!("{text}: {other:?}"),
    }
}

fn try_eval(text: &str, docs: &[BucketDoc], grid: Grid) -> Result<Value, EvalError<()>> {
    let mut names: Vec<String> = docs.iter().map(|d| d.series.clone()).collect();
    names.dedup();
    evaluate(
        &parse(text).unwrap_or_else(|e| panic!("{text}: {e}")),
        &SeriesLabels::all(&names, false),
        grid,
        HOUR,
        &BUDGET,
        |wanted, from, to| Ok::<_, ()>(fetch(docs, wanted, from, to)),
        no_raw,
    )
}

/// What a source holding the raw readings `kept` answers for `[from, to)` (ns).
fn raw_between(kept: &[(i64, f64)], from: i64, to: i64, at_most: u64) -> Raw {
    let r: Vec<(i64, f64)> = kept
        .iter()
        .copied()
        .filter(|x| from <= x.0 && x.0 < to)
        .collect();
    if r.len() as u64 <= at_most {
        Raw::Readings(r)
    } else {
        Raw::TooMany
    }
}

/// A source without raw readings.
#[allow(clippy::unnecessary_wraps)]
fn no_raw(_: &str, _: i64, _: i64, _: u64) -> Result<Raw, ()> {
    Ok(Raw::Readings(Vec::new()))
}

fn hourly_docs() -> Vec<BucketDoc> {
    let mut docs = Vec::new();
    for series in ["a/t", "b/t"] {
        for h in 0..30 {
            // b has no reading in hour 5.
            if series == "b/t" && h == 5 {
                continue;
            }
            let base = if series == "a/t" { 0.0 } else { 100.0 };
            docs.push(doc(
                series,
                DAY0 + h * HOUR,
                &[base + h as f64, base - h as f64],
            ));
        }
    }
    docs
}

#[test]
fn a_point_is_the_bucket_that_contains_its_time() {
    let docs = hourly_docs();
    // Hourly steps: one point per bucket.
    let grid = Grid::range(DAY0 * 1000, (DAY0 + 3 * HOUR) * 1000, HOUR * 1000).unwrap();
    let out = eval(r#"bucketd_bucket_max{series="a/t"}"#, &docs, grid);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].labels["__name__"], "bucketd_bucket_max");
    assert_eq!(out[0].labels["sensor"], "a");
    assert_eq!(out[0].labels["metric"], "t");
    let t = |h: i64| (DAY0 + h * HOUR) * 1000;
    assert_eq!(
        out[0].points,
        [(t(0), 0.0), (t(1), 1.0), (t(2), 2.0), (t(3), 3.0)]
    );
    // Finer steps: the bucket's value holds over its hour.
    let grid = Grid::range(t(1), t(2), 15 * 60 * 1000).unwrap();
    let out = eval(r#"bucketd_bucket_count{series="b/t"}"#, &docs, grid);
    let values: Vec<f64> = out[0].points.iter().map(|p| p.1).collect();
    assert_eq!(values, [2.0; 5]);
    // A missing bucket is a missing point, not a zero.
    let grid = Grid::range(t(4), t(6), HOUR * 1000).unwrap();
    let out = eval(r#"bucketd_bucket_mean{series="b/t"}"#, &docs, grid);
    assert_eq!(out[0].points, [(t(4), 100.0), (t(6), 100.0)]);
    // An instant query.
    let out = eval(
        r#"bucketd_bucket_min{sensor="a"}"#,
        &docs,
        Grid::instant(t(7) + 1234),
    );
    assert_eq!(out[0].points, [(t(7) + 1234, -7.0)]);
}

#[test]
fn a_step_coarser_than_a_bucket_merges_its_buckets_exactly() {
    let docs = hourly_docs();
    let day = 86_400_000;
    let grid = Grid::range(DAY0 * 1000, DAY0 * 1000 + day, day).unwrap();
    let out = eval(
        r#"{__name__=~"bucketd_bucket_(count|sum|min|max|mean|stddev|p50)", series="a/t"}"#,
        &docs,
        grid,
    );
    let merged: Vec<Summary> = rollup::rollup(
        &docs
            .iter()
            .filter(|d| d.series == "a/t")
            .cloned()
            .collect::<Vec<_>>(),
        86_400,
    )
    .into_iter()
    .map(|w| w.summary)
    .collect();
    assert_eq!(merged.len(), 2);
    for s in &out {
        let field = Field::ALL
            .into_iter()
            .find(|f| f.metric_name() == s.labels["__name__"])
            .unwrap();
        let want: Vec<(i64, f64)> = merged
            .iter()
            .enumerate()
            .map(|(i, m)| (DAY0 * 1000 + i as i64 * day, field.value(m).unwrap()))
            .collect();
        assert_eq!(s.points, want, "{field:?}");
    }
    assert_eq!(out.len(), 7);
    // The first day: 48 readings from -23 to 23, the second 12.
    let count = out
        .iter()
        .find(|s| s.labels["__name__"] == "bucketd_bucket_count")
        .unwrap();
    assert_eq!(count.points[0].1, 48.0);
    assert_eq!(count.points[1].1, 12.0);
    // A step that is no whole number of buckets is refused, naming the rule (issue 44: 5h was
    // refused as not dividing a day; it is five buckets).
    let grid = Grid::range(DAY0 * 1000, DAY0 * 1000 + day, 90 * 60 * 1000).unwrap();
    let e = try_eval("bucketd_bucket_max", &docs, grid);
    assert!(
        matches!(&e, Err(EvalError::Refused(Refusal::Unsupported(m))) if m.contains("whole number of buckets")),
        "{e:?}"
    );
    let grid = Grid::range(DAY0 * 1000, DAY0 * 1000 + day, 5 * HOUR * 1000).unwrap();
    let out = eval(r#"bucketd_bucket_count{series="a/t"}"#, &docs, grid);
    let counts: Vec<f64> = out[0].points.iter().map(|p| p.1).collect();
    assert_eq!(counts, [10.0; 5], "five buckets of two readings a point");
}

#[test]
fn aggregations_follow_promql_over_the_series_present_at_each_time() {
    let docs = hourly_docs();
    let t = |h: i64| (DAY0 + h * HOUR) * 1000;
    let grid = Grid::range(t(4), t(5), HOUR * 1000).unwrap();
    let by_op = |op: &str| {
        let out = eval(
            &format!(r#"{op}(bucketd_bucket_max{{metric="t"}})"#),
            &docs,
            grid,
        );
        assert_eq!(out.len(), 1, "{op}");
        assert!(out[0].labels.is_empty(), "{op}: {:?}", out[0].labels);
        out[0].points.clone()
    };
    // Hour 4: a's max 4, b's 104; hour 5: only a (5).
    assert_eq!(by_op("sum"), [(t(4), 108.0), (t(5), 5.0)]);
    assert_eq!(by_op("avg"), [(t(4), 54.0), (t(5), 5.0)]);
    assert_eq!(by_op("min"), [(t(4), 4.0), (t(5), 5.0)]);
    assert_eq!(by_op("max"), [(t(4), 104.0), (t(5), 5.0)]);
    assert_eq!(by_op("count"), [(t(4), 2.0), (t(5), 1.0)]);
    let out = eval(
        r#"sum by (sensor) (bucketd_bucket_count{metric="t"})"#,
        &docs,
        grid,
    );
    let sensors: Vec<&str> = out.iter().map(|s| s.labels["sensor"].as_str()).collect();
    assert_eq!(sensors, ["a", "b"]);
    assert_eq!(out[1].points, [(t(4), 2.0)]);
    let out = eval(
        r#"max without (series, sensor) (bucketd_bucket_max{metric="t"})"#,
        &docs,
        grid,
    );
    assert_eq!(out.len(), 1);
    assert_eq!(
        out[0].labels,
        BTreeMap::from([("metric".to_owned(), "t".to_owned())])
    );
}

#[test]
fn a_query_past_the_budget_is_refused_before_reading() {
    let names: Vec<String> = (0..50).map(|i| format!("s{i}/t")).collect();
    let day = 86_400_000;
    let grid = Grid::range(DAY0 * 1000, DAY0 * 1000 + 30 * day, day).unwrap();
    let mut reads = 0;
    let e = evaluate(
        &parse(r#"bucketd_bucket_mean{metric="t"}"#).unwrap(),
        &SeriesLabels::all(&names, false),
        grid,
        HOUR,
        &Budget {
            max_points: 10_000,
            cancel: None,
            notes: None,
        },
        |_, _, _| {
            reads += 1;
            Ok::<_, ()>(BTreeMap::new())
        },
        no_raw,
    );
    // 50 series x 31 days of hourly buckets = 37,200 buckets to read.
    let Err(EvalError::Refused(Refusal::TooLarge(m))) = e else {
        panic!("not refused: {e:?}")
    };
    assert!(m.contains("http.max_points_per_query (10000)"), "{m}");
    assert_eq!(reads, 0);
    assert!(Grid::range(0, 11_000_000, 1000).is_err(), "11,001 points");
    assert!(Grid::range(0, 10_999_000, 1000).is_ok());
    assert!(Grid::range(10, 0, 1000).is_err());
    assert!(Grid::range(0, 10, 0).is_err());
    assert!(Grid::range(i64::MIN, i64::MAX, 1).is_err(), "no overflow");
}

/// Deep nesting is an error, not a stack overflow (which would abort the daemon: the query
/// comes from any HTTP client).
#[test]
fn deep_nesting_is_refused_before_it_overflows_the_stack() {
    for deep in [
        format!("{}1{}", "(".repeat(2000), ")".repeat(2000)),
        format!("{}1", "-".repeat(4000)),
        format!("{}1", "+(".repeat(1000)),
        format!(
            "sum({}bucketd_bucket_max{})",
            "(".repeat(1000),
            ")".repeat(1000)
        ),
    ] {
        let e = error(&deep);
        assert!(e.contains("nests deeper than 64"), "{e}");
    }
    let regex = format!(
        "bucketd_bucket_max{{series=~\"{}a{}\"}}",
        "(".repeat(500),
        ")".repeat(500)
    );
    assert!(error(&regex).contains("bad regular expression"));
    let fine = format!("{}1{}", "(".repeat(60), ")".repeat(60));
    assert_eq!(parse(&fine).unwrap().number(), Some(1.0));
}

proptest::proptest! {
    /// Any query text, made of PromQL's pieces in any order, parses to a query or an error and
    /// evaluates without a panic (an HTTP client chooses it).
    #[test]
    fn any_query_parses_or_fails_cleanly(
        pieces in proptest::collection::vec(
            proptest::sample::select(vec![
                "bucketd_bucket_mean", "sum", "avg", "count", "by", "without", "(", ")", "{", "}",
                ",", "=", "!=", "=~", "!~", "\"a.*\"", "'t'", "`(`", "sensor", "series",
                "__name__", "1", "2.5e3", "-", "+", "*", "/", "[5m]", "offset", "rate", "Inf",
                "NaN", "\"\\", "#", " ", "\u{e9}", "==", "@", "bucketd_reading", "[1h]", "[2h]",
                "avg_over_time", "quantile_over_time", "absent", "topk", "bool", "on", "ignoring",
                ">", "<=", "^", "%", "1h", "0.5",
            ]),
            0..40,
        ),
        step in 1i64..200_000_000,
    ) {
        let text: String = pieces.concat();
        if let Ok(e) = parse(&text) {
            let docs = hourly_docs();
            let grid = Grid::range(DAY0 * 1000, (DAY0 + 30 * HOUR) * 1000, step).unwrap();
            let names = vec!["a/t".to_owned(), "b/t".to_owned()];
            let _ = evaluate(
                &e,
                &SeriesLabels::all(&names, false),
                grid,
                HOUR,
                &BUDGET,
                |wanted, from, to| Ok::<_, ()>(fetch(&docs, wanted, from, to)),
                no_raw,
            );
        }
    }
}

/// What a query can make the daemon compile is bounded: matchers per selector, and the size of
/// each regular expression.
#[test]
fn matchers_and_their_regular_expressions_are_bounded() {
    let nine: Vec<String> = (0..9).map(|i| format!("l{i}=~\"a.*\"")).collect();
    let e = error(&format!("bucketd_bucket_max{{{}}}", nine.join(",")));
    assert!(e.contains("at most 8 label matchers"), "{e}");
    assert!(parse(&format!("bucketd_bucket_max{{{}}}", nine[..8].join(","))).is_ok());
    // Issue 41: nine label matchers without a metric name got through (the count was taken
    // before the ninth was added).
    let e = error(&format!("{{{}}}", nine.join(",")));
    assert!(e.contains("at most 8 label matchers"), "{e}");
    assert!(parse(&format!("{{{}}}", nine[..8].join(","))).is_ok());
    let e = error(r#"bucketd_bucket_max{series=~"(a{100}){100}"}"#);
    assert!(e.contains("bad regular expression"), "{e}");
    assert!(parse(r#"bucketd_bucket_max{series=~"(boiler|attic|kitchen)/t.*"}"#).is_ok());
}

/// Issue 41: a `)` in a regular expression closed the `^(?:...)$` anchoring group, so
/// `sensor=~"x)|(.*"` matched every series (and slipped past the rule that a selector must not
/// match everything). An expression must be whole on its own.
#[test]
fn a_regular_expression_cannot_escape_its_anchors() {
    for bad in [
        r#"bucketd_bucket_max{sensor=~"x)|(.*"}"#,
        r#"{sensor=~"x)|(.*"}"#,
        r#"{sensor!~"x)|(^$"}"#,
        r#"bucketd_bucket_max{series=~"a)"}"#,
    ] {
        let e = error(bad);
        assert!(
            e.contains("bad regular expression") || e.contains("needs a metric name"),
            "{bad}: {e}"
        );
    }
    assert_eq!(
        selects(r#"bucketd_bucket_max{sensor=~"(a)|(b)"}"#, "a/t"),
        [Field::Max]
    );
}
/// Issue 41: every parser of network input has bounds tested at the bound and one past it.
/// PromQL's: [`NESTING_MAX`] levels (the innermost operand counting as one) and
/// [`QUERY_BYTES_MAX`] bytes of text.
#[test]
fn query_nesting_and_length_are_bounded_at_the_limit_and_one_past_it() {
    let parens = |n: usize| format!("{}1{}", "(".repeat(n), ")".repeat(n));
    assert_eq!(parse(&parens(NESTING_MAX - 1)).unwrap().number(), Some(1.0));
    assert!(error(&parens(NESTING_MAX)).contains("nests deeper than 64"));
    let signs = |n: usize| format!("{}1", "-".repeat(n));
    assert!(parse(&signs(NESTING_MAX - 1)).is_ok());
    assert!(error(&signs(NESTING_MAX)).contains("nests deeper than 64"));
    let sized = |n: usize| {
        let frame = r#"bucketd_bucket_max{series=""}"#.len();
        format!(
            r#"bucketd_bucket_max{{series="{}"}}"#,
            "a".repeat(n - frame)
        )
    };
    assert_eq!(sized(QUERY_BYTES_MAX).len(), QUERY_BYTES_MAX);
    assert!(parse(&sized(QUERY_BYTES_MAX)).is_ok());
    assert!(error(&sized(QUERY_BYTES_MAX + 1)).contains("longer than"));
}

/// `t` hours after DAY0, in milliseconds.
fn at(h: i64) -> i64 {
    (DAY0 + h * HOUR) * 1000
}

/// The value of the single series `text` gives at time `t`.
fn one(text: &str, t: i64) -> Option<f64> {
    let out = eval(
        text,
        &hourly_docs(),
        Grid::range(t, t, HOUR * 1000).unwrap(),
    );
    assert!(out.len() <= 1, "{text}: {out:?}");
    out.first().and_then(|s| s.points.first()).map(|p| p.1)
}

/// A subquery evaluates its expression at the multiples of its step in each point's
/// window `[t - range, t]`, both ends in; `@` fixes the time whatever the point's.
#[test]
fn subqueries_and_at_take_the_times_they_name() {
    // a/t's hourly maximum is its hour (hourly_docs): the bucket maxima of hours 2..=5.
    let q = |f: &str| format!(r#"{f}(bucketd_bucket_max{{series="a/t"}}[3h:1h])"#);
    assert_eq!(one(&q("max_over_time"), at(5)), Some(5.0));
    assert_eq!(one(&q("min_over_time"), at(5)), Some(2.0));
    assert_eq!(one(&q("count_over_time"), at(5)), Some(4.0));
    // Half past: the multiples 3h..=5h of the step, three of them.
    assert_eq!(one(&q("count_over_time"), at(5) + 1_800_000), Some(3.0));
    // With an offset, and at a fixed time.
    let q = r#"min_over_time(bucketd_bucket_max{series="a/t"}[2h:1h] offset 1h)"#;
    assert_eq!(one(q, at(9)), Some(6.0));
    for t in [at(1), at(20)] {
        let q = format!(
            r#"sum_over_time(bucketd_bucket_max{{series="a/t"}}[2h:1h] @ {})"#,
            at(9) / 1000
        );
        assert_eq!(one(&q, t), Some(7.0 + 8.0 + 9.0));
        assert_eq!(
            one(r#"bucketd_bucket_max{series="a/t"} @ end()"#, t),
            Some(((t - at(0)) / 3_600_000) as f64)
        );
    }
    // Nested: the largest of three hourly 2-hour means.
    let q = r#"max_over_time(avg_over_time(bucketd_bucket_max{series="a/t"}[1h:1h])[2h:1h])"#;
    assert_eq!(one(q, at(10)), Some(9.5));
    // A subquery's times are bounded before anything is evaluated.
    let e = try_eval(
        r#"max_over_time(bucketd_bucket_max{series="a/t"}[1000d:1s])"#,
        &hourly_docs(),
        Grid::instant(at(5)),
    );
    let Err(EvalError::Refused(Refusal::TooLarge(m))) = e else {
        panic!("not refused: {e:?}")
    };
    assert!(m.contains("subquery"), "{m}");
}

/// Issue 44: Grafana aligns a range's start to the step in the browser's time zone; windows
/// follow the query's own grid (`[t, t + step)`), not UTC midnights. Here UTC-2's midnights.
#[test]
fn windows_follow_the_querys_grid() {
    let docs = hourly_docs();
    let day = 86_400_000;
    let grid = Grid::range(at(2), at(2) + day, day).unwrap();
    let out = eval(
        r#"{__name__=~"bucketd_bucket_(count|min|max)", series="a/t"}"#,
        &docs,
        grid,
    );
    let get = |name: &str| {
        out.iter()
            .find(|s| s.labels["__name__"] == name)
            .unwrap()
            .points
            .clone()
    };
    // a's readings are +h and -h in hour h: hours 2..=25, then 26..=29.
    assert_eq!(get("bucketd_bucket_count"), [(at(2), 48.0), (at(26), 8.0)]);
    assert_eq!(get("bucketd_bucket_min"), [(at(2), -25.0), (at(26), -29.0)]);
    assert_eq!(get("bucketd_bucket_max"), [(at(2), 25.0), (at(26), 29.0)]);
}

/// Issue 44: an instant query (a stat panel, an alert rule) in the first minutes of an hour
/// found the new bucket empty and answered nothing; it looks back one bucket. A range query
/// does not (a gap stays a gap).
#[test]
fn an_instant_query_looks_back_one_bucket() {
    let docs = hourly_docs();
    let q = r#"bucketd_bucket_max{series="a/t"}"#;
    let five_past = at(30) + 300_000;
    let out = eval(q, &docs, Grid::instant(five_past));
    assert_eq!(out[0].points, [(five_past, 29.0)]);
    let out = eval(q, &docs, Grid::instant(at(29) + 300_000));
    assert_eq!(
        out[0].points,
        [(at(29) + 300_000, 29.0)],
        "the current bucket first"
    );
    assert!(
        eval(q, &docs, Grid::instant(at(32))).is_empty(),
        "one bucket back, no more"
    );
    let range = Grid::range(at(30), at(30), HOUR * 1000).unwrap();
    assert!(eval(q, &docs, range).is_empty());
}

/// The range functions over the readings: the buckets overlapping `[t - r, t)` merged, checked
/// against the readings themselves (a's are +h and -h in hour h).
#[test]
fn range_functions_over_the_readings_merge_their_buckets() {
    let readings = |hours: std::ops::Range<i64>| -> Vec<f64> {
        let mut v: Vec<f64> = hours.flat_map(|h| [h as f64, -(h as f64)]).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let r = readings(6..12);
    let q = |f: &str| {
        one(
            &format!(r#"{f}(bucketd_reading{{series="a/t"}}[6h])"#),
            at(12),
        )
    };
    assert_eq!(q("count_over_time"), Some(r.len() as f64));
    assert_eq!(q("min_over_time"), Some(-11.0));
    assert_eq!(q("max_over_time"), Some(11.0));
    assert_eq!(q("sum_over_time"), Some(0.0));
    assert_eq!(q("avg_over_time"), Some(0.0));
    assert_eq!(q("last_over_time"), Some(-11.0), "hour 11's second reading");
    let var = r.iter().map(|v| v * v).sum::<f64>() / r.len() as f64;
    assert!((q("stdvar_over_time").unwrap() - var).abs() < 1e-9);
    assert!((q("stddev_over_time").unwrap() - var.sqrt()).abs() < 1e-9);
    // Type 7, computed here from the readings: rank 0.9 * 11 = 9.9 between 9 and 10.
    let p90 = one(
        r#"quantile_over_time(0.9, bucketd_reading{series="a/t"}[6h])"#,
        at(12),
    )
    .unwrap();
    assert!((p90 - 9.9).abs() <= 0.01 * 10.0, "{p90}");
    // Between bucket boundaries the bucket in progress counts too: hours 6..=12.
    let mid = one(
        r#"count_over_time(bucketd_reading{series="a/t"}[6h])"#,
        at(12) + 1_800_000,
    );
    assert_eq!(mid, Some(readings(6..13).len() as f64));
    // Labels: the series', no metric name.
    let out = eval(
        r#"max_over_time(bucketd_reading{sensor="a"}[2h])"#,
        &hourly_docs(),
        Grid::instant(at(3)),
    );
    assert_eq!(
        out[0].labels,
        BTreeMap::from([
            ("metric".to_owned(), "t".to_owned()),
            ("sensor".to_owned(), "a".to_owned()),
            ("series".to_owned(), "a/t".to_owned()),
        ])
    );
    // Over a field's samples (whole buckets), a range that is not a whole number of them is
    // refused, naming the rule; over the readings any range is answered (from the readings
    // where kept, else from the buckets with a warning: `an_answer_from_buckets...`).
    let at_3 = |q: &str| try_eval(q, &hourly_docs(), Grid::instant(at(3)));
    let refused = |q: &str, says: &str| {
        let e = at_3(q);
        assert!(
            matches!(&e, Err(EvalError::Refused(Refusal::Unsupported(m))) if m.contains(says)),
            "{q}: {e:?}"
        );
    };
    refused(
        r#"avg_over_time(bucketd_bucket_mean{series="a/t"}[90m])"#,
        "whole number of buckets",
    );
    assert!(at_3(r#"avg_over_time(bucketd_reading{series="a/t"}[90m])"#).is_ok());
    // The counter functions need the readings' times, which a field's samples are not.
    refused(
        r#"rate(bucketd_bucket_count{series="a/t"}[2h])"#,
        "take bucketd_reading",
    );
}

/// Over a field, each bucket is one sample, as Prometheus would take a gauge scraped hourly.
#[test]
fn range_functions_over_a_field_take_each_bucket_as_a_sample() {
    let a = |f: &str| format!(r#"{f}(bucketd_bucket_max{{series="a/t"}}[3h])"#);
    assert_eq!(one(&a("max_over_time"), at(7)), Some(6.0), "hours 4, 5, 6");
    assert_eq!(one(&a("avg_over_time"), at(7)), Some(5.0));
    assert_eq!(one(&a("sum_over_time"), at(7)), Some(15.0));
    let b = r#"count_over_time(bucketd_bucket_max{series="b/t"}[3h])"#;
    assert_eq!(one(b, at(7)), Some(2.0), "b has no hour 5");
    let median = r#"quantile_over_time(0.5, bucketd_bucket_max{series="a/t"}[4h])"#;
    assert_eq!(one(median, at(8)), Some(5.5), "type 7 of 4, 5, 6, 7");
}

#[test]
fn offset_moves_the_time_back() {
    assert_eq!(
        one(r#"bucketd_bucket_max{series="a/t"} offset 2h"#, at(10)),
        Some(8.0)
    );
    assert_eq!(
        one(
            r#"max_over_time(bucketd_reading{series="a/t"}[1h] offset 1d)"#,
            at(27)
        ),
        Some(2.0)
    );
}

#[test]
fn arithmetic_and_comparisons_follow_promql() {
    let docs = hourly_docs();
    // Fahrenheit: the metric name goes, the series' labels stay.
    let out = eval(
        r#"bucketd_bucket_max{series="a/t"} * 1.8 + 32"#,
        &docs,
        Grid::instant(at(10)),
    );
    assert_eq!(out[0].points[0].1, 50.0);
    assert!(!out[0].labels.contains_key("__name__"));
    assert_eq!(out[0].labels["series"], "a/t");
    // A comparison filters and keeps the left side as it is; `bool` gives 0 and 1.
    let grid = Grid::range(at(19), at(22), HOUR * 1000).unwrap();
    let out = eval(r#"bucketd_bucket_max{sensor="a"} > 20"#, &docs, grid);
    assert_eq!(out[0].points, [(at(21), 21.0), (at(22), 22.0)]);
    assert_eq!(out[0].labels["__name__"], "bucketd_bucket_max");
    let out = eval(r#"bucketd_bucket_max{sensor="a"} > bool 20"#, &docs, grid);
    let values: Vec<f64> = out[0].points.iter().map(|p| p.1).collect();
    assert_eq!(values, [0.0, 0.0, 1.0, 1.0]);
    let out = eval(r#"20 < bucketd_bucket_max{sensor="a"}"#, &docs, grid);
    assert_eq!(out[0].points, [(at(21), 21.0), (at(22), 22.0)]);
    // Between series: one to one by their labels but the name, or on (..).
    let spread = one(
        r#"bucketd_bucket_max{sensor="a"} - bucketd_bucket_min{sensor="a"}"#,
        at(3),
    );
    assert_eq!(spread, Some(6.0));
    let out = eval(
        r#"bucketd_bucket_max{sensor="b"} - on (metric) bucketd_bucket_max{sensor="a"}"#,
        &docs,
        Grid::instant(at(3)),
    );
    assert_eq!(out[0].points[0].1, 100.0);
    assert_eq!(
        out[0].labels,
        BTreeMap::from([("metric".to_owned(), "t".to_owned())])
    );
    let out = eval(
        r#"bucketd_bucket_max{sensor="b"} - ignoring (sensor, series) bucketd_bucket_max{sensor="a"}"#,
        &docs,
        Grid::instant(at(3)),
    );
    assert_eq!(out[0].points[0].1, 100.0);
    let e = try_eval(
        "bucketd_bucket_max - on (metric) bucketd_bucket_max",
        &docs,
        Grid::instant(at(3)),
    );
    assert!(
        matches!(&e, Err(EvalError::Refused(Refusal::Execution(m))) if m.contains("many-to-many")),
        "{e:?}"
    );
    let out = eval(
        r#"-bucketd_bucket_max{sensor="a"}"#,
        &docs,
        Grid::instant(at(3)),
    );
    assert_eq!(out[0].points[0].1, -3.0);
    // Issue 55: a filtering comparison applies on (..) and ignoring (..) to its labels too, as
    // Prometheus does for every one-to-one match: `on` keeps its labels only; `ignoring` drops
    // its own and keeps the name.
    let out = eval(
        r#"bucketd_bucket_max{sensor="a"} < on (metric) bucketd_bucket_max{sensor="b"}"#,
        &docs,
        Grid::instant(at(3)),
    );
    assert_eq!(out[0].points[0].1, 3.0, "the left side's value");
    assert_eq!(
        out[0].labels,
        BTreeMap::from([("metric".to_owned(), "t".to_owned())])
    );
    let out = eval(
        r#"bucketd_bucket_max{sensor="a"} < ignoring (sensor, series) bucketd_bucket_max{sensor="b"}"#,
        &docs,
        Grid::instant(at(3)),
    );
    assert_eq!(
        out[0].labels,
        BTreeMap::from([
            ("__name__".to_owned(), "bucketd_bucket_max".to_owned()),
            ("metric".to_owned(), "t".to_owned())
        ])
    );
}

/// Issue 55: `last_over_time` keeps the metric name (a sample as it was), as Prometheus does;
/// every other range function drops it.
#[test]
fn last_over_time_keeps_the_metric_name() {
    let docs = hourly_docs();
    for (query, name) in [
        (
            r#"last_over_time(bucketd_reading{sensor="a"}[2h])"#,
            "bucketd_reading",
        ),
        (
            r#"last_over_time(bucketd_bucket_max{sensor="a"}[2h])"#,
            "bucketd_bucket_max",
        ),
    ] {
        let out = eval(query, &docs, Grid::instant(at(3)));
        assert_eq!(
            out[0].labels.get("__name__").map(String::as_str),
            Some(name),
            "{query}"
        );
        assert_eq!(out[0].labels["series"], "a/t");
    }
    let out = eval(
        r#"max_over_time(bucketd_bucket_max{sensor="a"}[2h])"#,
        &docs,
        Grid::instant(at(3)),
    );
    assert!(!out[0].labels.contains_key("__name__"));
}

/// The "sensor went silent" alert: `absent` gives 1 where nothing is, with the labels its
/// selector names.
#[test]
fn absent_answers_where_nothing_is() {
    let docs = hourly_docs();
    let grid = Grid::range(at(4), at(6), HOUR * 1000).unwrap();
    let out = eval(r#"absent(bucketd_bucket_max{series="b/t"})"#, &docs, grid);
    assert_eq!(out[0].points, [(at(5), 1.0)], "b has no hour 5");
    assert_eq!(
        out[0].labels,
        BTreeMap::from([("series".to_owned(), "b/t".to_owned())])
    );
    let out = eval(
        r#"absent(bucketd_bucket_max{series="nope/x"})"#,
        &docs,
        grid,
    );
    assert_eq!(out[0].points.len(), 3);
    assert!(eval(r#"absent(bucketd_bucket_max{sensor="a"})"#, &docs, grid).is_empty());
    let silent = r#"absent_over_time(bucketd_reading{series="b/t"}[1h])"#;
    assert_eq!(one(silent, at(6)), Some(1.0), "hour 5 had nothing");
    assert_eq!(one(silent, at(7)), None);
}

#[test]
fn topk_bottomk_quantile_and_stddev_aggregate_as_promql_does() {
    let docs = hourly_docs();
    let grid = Grid::instant(at(4));
    let out = eval(r#"topk(1, bucketd_bucket_max{metric="t"})"#, &docs, grid);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].labels["series"], "b/t");
    assert_eq!(
        out[0].labels["__name__"], "bucketd_bucket_max",
        "kept as it is"
    );
    let out = eval(r#"bottomk(1, bucketd_bucket_max{metric="t"})"#, &docs, grid);
    assert_eq!(out[0].labels["series"], "a/t");
    assert_eq!(
        one(r#"quantile(0.5, bucketd_bucket_max{metric="t"})"#, at(4)),
        Some(54.0)
    );
    assert_eq!(
        one(r#"stddev(bucketd_bucket_max{metric="t"})"#, at(4)),
        Some(50.0)
    );
    assert_eq!(
        one(r#"count(bucketd_bucket_max{metric="t"} > 50)"#, at(4)),
        Some(1.0)
    );
}

/// Every query of the example dashboard (`deploy/grafana/bucketd-dashboard.json`, docs/
/// PROMETHEUS.md) is one bucketd answers, with its series variable filled in.
#[test]
fn the_example_dashboards_queries_all_parse() {
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../../deploy/grafana/bucketd-dashboard.json")).unwrap();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            // Grafana's own variable, at least four scrape intervals: 1h as the data source is
            // set up (docs/PROMETHEUS.md), 5m to take a range that is not whole buckets.
            for interval in ["4h", "5m"] {
                exprs.push(
                    expr.replace("$series", "a/t")
                        .replace("$__rate_interval", interval),
                );
            }
        }
    }
    assert!(exprs.len() >= 20, "{exprs:?}");
    for e in &exprs {
        let parsed = parse(e).unwrap_or_else(|err| panic!("{e}: {err}"));
        let out = evaluate(
            &parsed,
            &SeriesLabels::all(&["a/t".to_owned()], false),
            Grid::range(at(0), at(29), HOUR * 1000).unwrap(),
            HOUR,
            &BUDGET,
            |wanted, from, to| Ok::<_, ()>(fetch(&hourly_docs(), wanted, from, to)),
            no_raw,
        );
        assert!(out.is_ok(), "{e}: {out:?}");
    }
}

/// An offset or a range as large as a duration can be moves times past what an i64 of
/// milliseconds holds: the arithmetic saturates, and the query answers (nothing there, or the
/// budget's refusal) instead of overflowing (a client chooses both).
#[test]
fn huge_offsets_and_ranges_saturate() {
    let docs = hourly_docs();
    for q in [
        r#"bucketd_bucket_max{series="a/t"} offset 106751991167d"#,
        r#"bucketd_bucket_max{series="a/t"} offset -106751991167d"#,
        r#"max_over_time(bucketd_reading{series="a/t"}[106751991167d])"#,
        r#"max_over_time(bucketd_reading{series="a/t"}[1h] offset 106751991167d)"#,
        r#"max_over_time(bucketd_bucket_max{series="a/t"}[106751991167d:1h])"#,
        r#"max_over_time(bucketd_bucket_max{series="a/t"}[1h:1h] offset -106751991167d)"#,
        r#"bucketd_bucket_max{series="a/t"} @ 9000000000000000"#,
        r#"max_over_time(bucketd_reading{series="a/t"}[1h:1h] @ -9000000000000000)"#,
        r#"max_over_time(bucketd_bucket_max{series="a/t"}[1h] @ 9000000000000000 offset -106751991167d)"#,
    ] {
        for grid in [
            Grid::instant(at(3)),
            Grid::range(at(0), at(3), HOUR * 1000).unwrap(),
        ] {
            match try_eval(q, &docs, grid) {
                Ok(Value::Vector(v)) => assert!(v.is_empty(), "{q}: {v:?}"),
                Err(EvalError::Refused(_)) => {}
                other => panic!("{q}: {other:?}"),
            }
        }
    }
}

/// Issue 53: a query whose client has gone is stopped. With the budget's flag set (as the HTTP
/// layer sets it when the client hangs up), the evaluation ends as cancelled, not with an
/// answer no one reads; unset, the same query is answered.
#[test]
fn a_query_no_one_waits_for_is_cancelled() {
    let docs: Vec<BucketDoc> = (0..48)
        .map(|h| doc("a/t", DAY0 + h * HOUR, &[1.0, 2.0]))
        .collect();
    let names = vec!["a/t".to_owned()];
    let grid = Grid::range(DAY0 * 1000, (DAY0 + 47 * HOUR) * 1000, 60_000).unwrap();
    let expr = parse(r#"max_over_time(bucketd_reading{sensor="a"}[24h])"#).unwrap();
    let run = |flag: bool| {
        let budget = Budget {
            cancel: Some(std::sync::Arc::new(std::sync::atomic::AtomicBool::new(
                flag,
            ))),
            ..BUDGET
        };
        evaluate(
            &expr,
            &SeriesLabels::all(&names, false),
            grid,
            HOUR,
            &budget,
            |w, f, t| Ok::<_, ()>(fetch(&docs, w, f, t)),
            no_raw,
        )
    };
    assert!(matches!(run(true), Err(EvalError::Cancelled)));
    let Ok(Value::Vector(series)) = run(false) else {
        panic!("answered")
    };
    // Every point but the first, whose window (the day before it) holds no bucket.
    assert_eq!(series[0].points.len(), 47 * 60);
}

/// Issue 55: a plain `bucketd_reading` selector answers as Prometheus's instant vector selector
/// does: at each time, the last raw reading within the 5-minute look-back, with its name; in
/// `absent` too. Its raw reads count against the query budget.
#[test]
fn a_plain_reading_selector_answers_the_last_reading_within_the_look_back() {
    let minute = 60_000_000_000_i64; // ns
    let t0 = at(10) * 1_000_000; // ns
    // a/t: readings at 10:00, 10:02 and 10:20; b/t: none.
    let raw: BTreeMap<String, Vec<(i64, f64)>> = BTreeMap::from([(
        "a/t".to_owned(),
        vec![(t0, 1.0), (t0 + 2 * minute, 2.0), (t0 + 20 * minute, 3.0)],
    )]);
    let names = vec!["a/t".to_owned(), "b/t".to_owned()];
    let run = |text: &str, grid: Grid, max_points: u64| {
        let mut asked = Vec::new();
        let value = evaluate(
            &parse(text).unwrap(),
            &SeriesLabels::all(&names, false),
            grid,
            HOUR,
            &Budget {
                max_points,
                cancel: None,
                notes: None,
            },
            |_, _, _| Ok::<_, ()>(BTreeMap::new()),
            |series: &str, from, to, at_most| {
                asked.push((series.to_owned(), from, to));
                let kept = raw.get(series).map_or(&[][..], Vec::as_slice);
                Ok(raw_between(kept, from, to, at_most))
            },
        );
        (value, asked)
    };
    // A range query every minute from 10:00 to 10:30.
    let grid = Grid::range(at(10), at(10) + 30 * 60_000, 60_000).unwrap();
    let (value, asked) = run(r#"bucketd_reading{sensor=~"a|b"}"#, grid, 100);
    let Ok(Value::Vector(series)) = value else {
        panic!("{value:?}")
    };
    assert_eq!(series.len(), 1, "b has no reading: no series");
    assert_eq!(series[0].labels["__name__"], "bucketd_reading");
    assert_eq!(series[0].labels["series"], "a/t");
    let minutes: Vec<(i64, f64)> = series[0]
        .points
        .iter()
        .map(|&(t, v)| ((t - at(10)) / 60_000, v))
        .collect();
    // 10:00-10:01 the first, 10:02-10:07 the second (the look-back includes its start, as in
    // Prometheus 2.42: 10:02 is 5 minutes before 10:07), none until 10:20, then the third to
    // 10:25.
    let want: Vec<(i64, f64)> = (0..=1)
        .map(|m| (m, 1.0))
        .chain((2..=7).map(|m| (m, 2.0)))
        .chain((20..=25).map(|m| (m, 3.0)))
        .collect();
    assert_eq!(minutes, want);
    // Read from the look-back before the first time to the last time.
    assert_eq!(asked.len(), 2);
    assert!(
        asked.iter().all(|(_, from, to)| *from == t0 - 5 * minute
            && *to == (at(10) + 30 * 60_000 + 1) * 1_000_000)
    );
    // absent: 1 where a/t has no reading within the look-back.
    let (value, _) = run(
        r#"absent(bucketd_reading{series="a/t"})"#,
        Grid::instant(at(10) + 10 * 60_000),
        100,
    );
    let Ok(Value::Vector(series)) = value else {
        panic!("{value:?}")
    };
    assert_eq!(series[0].points, [(at(10) + 10 * 60_000, 1.0)]);
    // The raw reads count against the budget.
    let (value, _) = run(r#"bucketd_reading{series="a/t"}"#, grid, 2);
    let Err(EvalError::Refused(Refusal::TooLarge(m))) = value else {
        panic!("{value:?}")
    };
    assert!(m.contains("raw readings"), "{m}");
}

/// Readings of `a/t` every minute for six hours from DAY0, rising with some noise (so that a
/// window's extremes and median are not its buckets'), and their hourly buckets.
fn minute_readings() -> (Vec<(i64, f64)>, Vec<BucketDoc>) {
    let readings: Vec<(i64, f64)> = (0..6 * 60)
        .map(|m| {
            let v = m as f64 + ((m * 37) % 61) as f64 / 100.0;
            ((DAY0 + m * 60 + 5) * 1_000_000_000, v)
        })
        .collect();
    let docs = readings
        .chunks(60)
        .map(|hour| {
            let mut s = Summary::of(hour[0].0, hour[0].1);
            for &(ts, v) in &hour[1..] {
                s.push(ts, v);
            }
            BucketDoc::new("a/t", hour[0].0 / 1_000_000_000 / HOUR * HOUR, HOUR, &s)
        })
        .collect();
    (readings, docs)
}

/// Evaluates `text` over `docs`, with the raw readings `kept` (those of earlier hours lost, as
/// past `store.raw_retention`), within `max_points`.
fn eval_kept(
    text: &str,
    docs: &[BucketDoc],
    kept: &[(i64, f64)],
    grid: Grid,
    max_points: u64,
) -> Vec<(i64, f64)> {
    let budget = Budget {
        max_points,
        cancel: None,
        notes: None,
    };
    match evaluate_kept(text, docs, kept, grid, &budget) {
        Ok(Value::Vector(v)) if v.len() == 1 => v[0].points.clone(),
        other => panic!("{text}: {other:?}"),
    }
}

/// The readings whose raw pages are kept: hours 0-1 lost theirs, hours 2-5 kept.
fn kept_from_hour_2(readings: &[(i64, f64)]) -> Vec<(i64, f64)> {
    readings
        .iter()
        .copied()
        .filter(|r| r.0 >= at(2) * 1_000_000)
        .collect()
}

/// Issue 55: a range function over `bucketd_reading` answers from the raw readings with
/// Prometheus's window `[t - r, t]` while every bucket the window touches holds all its raw
/// readings, and from the buckets otherwise (raw pages past `store.raw_retention`), and when
/// visiting every window would pass the query's work bound.
#[test]
fn range_functions_are_exact_where_the_raw_readings_are_kept() {
    let (readings, docs) = minute_readings();
    let kept = kept_from_hour_2(&readings);
    // Half past each hour from 1:30 to 5:30.
    let grid = Grid::range(at(1) + 1_800_000, at(5) + 1_800_000, HOUR * 1000).unwrap();
    let in_window = |t: i64, r: i64| -> Vec<f64> {
        readings
            .iter()
            .filter(|x| t - r <= x.0 / 1_000_000 && x.0 / 1_000_000 <= t)
            .map(|x| x.1)
            .collect()
    };
    let in_buckets = |t: i64, r: i64| -> Vec<f64> {
        // The whole hours overlapping [t - r, t): starting in (t - r - 1h, t).
        readings
            .iter()
            .filter(|x| {
                let start = x.0 / 1_000_000_000 / HOUR * HOUR * 1000;
                t - r - 3_600_000 < start && start < t
            })
            .map(|x| x.1)
            .collect()
    };
    let max = |v: Vec<f64>| v.into_iter().fold(f64::NEG_INFINITY, f64::max);
    let got = eval_kept(
        r#"max_over_time(bucketd_reading{series="a/t"}[1h])"#,
        &docs,
        &kept,
        grid,
        10_000,
    );
    let hour = 3_600_000;
    for (t, v) in got {
        // 1:30 and 2:30 touch hours 0-1 (lost): the buckets; later windows: the readings.
        let want = if t < at(3) {
            max(in_buckets(t, hour))
        } else {
            max(in_window(t, hour))
        };
        assert_eq!(v, want, "at {}", (t - at(0)) / 60_000);
        if t >= at(3) {
            assert_ne!(
                v,
                max(in_buckets(t, hour)),
                "the windows tell the two apart"
            );
        }
    }
    // A quantile from the readings is the readings' (type 7, by hand: the median of an odd
    // count is the middle one). At 4:30:05 the window holds the readings at both its ends.
    let t = at(4) + 1_805_000;
    let got = eval_kept(
        r#"quantile_over_time(0.5, bucketd_reading{series="a/t"}[1h])"#,
        &docs,
        &kept,
        Grid::instant(t),
        10_000,
    );
    let mut window = in_window(t, hour);
    window.sort_by(f64::total_cmp);
    assert_eq!(window.len(), 61);
    assert_eq!(got, [(t, window[30])]);
    // Past the work bound (every point's window visited: 61 points x ~120 readings = ~7,300
    // visits, over 16 x 400), the buckets answer; within it (16 x 1,000), the readings.
    let fine = Grid::range(at(4), at(5), 60_000).unwrap();
    let q = r#"count_over_time(bucketd_reading{series="a/t"}[2h])"#;
    let count_of = |f: &dyn Fn(i64, i64) -> Vec<f64>| -> Vec<(i64, f64)> {
        fine.times()
            .map(|t| (t, f(t, 2 * hour).len() as f64))
            .collect()
    };
    assert_eq!(
        eval_kept(q, &docs, &kept, fine, 1_000),
        count_of(&in_window)
    );
    assert_eq!(eval_kept(q, &docs, &kept, fine, 400), count_of(&in_buckets));
}

/// [`eval_kept`]'s evaluation, its outcome as it is.
fn evaluate_kept(
    text: &str,
    docs: &[BucketDoc],
    kept: &[(i64, f64)],
    grid: Grid,
    budget: &Budget,
) -> Result<Value, EvalError<()>> {
    let names = vec!["a/t".to_owned()];
    evaluate(
        &parse(text).unwrap(),
        &SeriesLabels::all(&names, false),
        grid,
        HOUR,
        budget,
        |wanted, from, to| Ok::<_, ()>(fetch(docs, wanted, from, to)),
        |_, from, to, at_most| Ok(raw_between(kept, from, to, at_most)),
    )
}

/// A grid that spans the whole range of an i64 (a few points, a step of whole hours near 2^63
/// ms: within the point limit) over a range function of the readings that matches nothing, and one that matches:
/// answered or refused, never an overflow (the exact windows' bucket arithmetic, issue 55).
#[test]
fn exact_windows_take_a_grid_across_all_of_time() {
    let (readings, docs) = minute_readings();
    let step = i64::MAX / 3_600_000 * 3_600_000;
    let grid = Grid::range(i64::MIN + 1, i64::MAX - 1, step).unwrap();
    for text in [
        r#"max_over_time(bucketd_reading{series="nothing"}[1h])"#,
        r#"max_over_time(bucketd_reading{series="a/t"}[1h] offset -1h)"#,
    ] {
        match evaluate_kept(text, &docs, &readings, grid, &BUDGET) {
            Ok(Value::Vector(v)) => assert!(v.iter().all(|s| s.points.is_empty()), "{text}"),
            Err(EvalError::Refused(Refusal::TooLarge(m))) => {
                assert!(m.contains("max_points"), "{text}: {m}");
            }
            other => panic!("{text}: {other:?}"),
        }
    }
}

/// `and`, `or`, `unless` time by time (hour 5: only a has a point), with `on`/`ignoring`, the
/// left side's labels and values kept (`__name__` too); refused between numbers.
#[test]
fn set_operators_keep_the_left_sides_points_by_label_set_at_each_time() {
    let docs = hourly_docs();
    let t = |h: i64| (DAY0 + h * HOUR) * 1000;
    let grid = Grid::range(t(4), t(6), HOUR * 1000).unwrap();
    let a = r#"bucketd_bucket_max{sensor="a"}"#;
    let b = r#"bucketd_bucket_min{sensor="b"}"#;
    let points = |q: &str| -> Vec<(String, Vec<(i64, f64)>)> {
        eval(q, &docs, grid)
            .into_iter()
            .map(|s| {
                (
                    s.labels.get("__name__").cloned().unwrap_or_default(),
                    s.points,
                )
            })
            .collect()
    };
    // By every label but the name: a's and b's sensors differ, so nothing pairs.
    assert!(points(&format!("{a} and {b}")).is_empty());
    assert_eq!(
        points(&format!("{a} unless {b}")),
        [(
            "bucketd_bucket_max".into(),
            vec![(t(4), 4.0), (t(5), 5.0), (t(6), 6.0)]
        )]
    );
    // On the metric alone they pair where both have a point (not hour 5).
    assert_eq!(
        points(&format!("{a} and on (metric) {b}")),
        [("bucketd_bucket_max".into(), vec![(t(4), 4.0), (t(6), 6.0)])]
    );
    assert_eq!(
        points(&format!("{a} unless ignoring (sensor, series) {b}")),
        [("bucketd_bucket_max".into(), vec![(t(5), 5.0)])]
    );
    // `or`: the left side, then the right side's points at times the left has no such set.
    assert_eq!(
        points(&format!("{b} or on (metric) {a}")),
        [
            (
                "bucketd_bucket_min".into(),
                vec![(t(4), 96.0), (t(6), 94.0)]
            ),
            ("bucketd_bucket_max".into(), vec![(t(5), 5.0)]),
        ]
    );
    // Lowest precedence: `or` below `and`, both below comparisons and arithmetic.
    assert_eq!(
        points(&format!(
            "{a} > 4 and on (metric) {b} or on (metric) {a} * 0 + 1"
        ))
        .into_iter()
        .map(|p| p.1)
        .collect::<Vec<_>>(),
        [vec![(t(6), 6.0)], vec![(t(4), 1.0), (t(5), 1.0)]],
        "((a > 4) and b) or (a * 0 + 1): the left side only at 6 (a > 4 at 5 and 6, b not at \
         5), the right side where the left has nothing"
    );
    for bad in ["1 and 1", "bucketd_bucket_max or 1"] {
        assert!(error(bad).contains("only between series"), "{bad}");
    }
    assert!(
        parse("bucketd_bucket_max AND bucketd_bucket_min").is_ok(),
        "any case"
    );
}

/// Prometheus's math functions of each value, as Go computes them, with their argument checks.
#[test]
fn math_functions_map_each_value_and_drop_the_name() {
    let docs = vec![doc("a/t", DAY0, &[-2.5, 2.25])];
    let grid = Grid::instant((DAY0 + 60) * 1000);
    let one = |q: &str| -> Option<f64> {
        let out = eval(q, &docs, grid);
        assert!(
            out.iter().all(|s| !s.labels.contains_key("__name__")),
            "{q}"
        );
        out.first().map(|s| s.points[0].1)
    };
    let min = r#"bucketd_bucket_min{sensor="a"}"#;
    let max = r#"bucketd_bucket_max{sensor="a"}"#;
    assert_eq!(one(&format!("abs({min})")), Some(2.5));
    assert_eq!(one(&format!("ceil({min})")), Some(-2.0));
    assert_eq!(one(&format!("floor({min})")), Some(-3.0));
    // Go's rule: floor(v * (1 / to_nearest) + 0.5) / (1 / to_nearest): -2.5 rounds up.
    assert_eq!(one(&format!("round({min})")), Some(-2.0));
    assert_eq!(one(&format!("round({max}, 0.5)")), Some(2.5));
    assert_eq!(one(&format!("sgn({min})")), Some(-1.0));
    assert_eq!(one(&format!("sqrt({max})")), Some(1.5));
    assert!(one(&format!("sqrt({min})")).unwrap().is_nan());
    assert!(one(&format!("ln({min})")).unwrap().is_nan());
    assert_eq!(one(&format!("log2(abs({min}) * 0 + 8)")), Some(3.0));
    assert_eq!(one(&format!("exp({max} * 0)")), Some(1.0));
    assert_eq!(one(&format!("clamp({min}, -1, 1)")), Some(-1.0));
    assert_eq!(one(&format!("clamp_min({min}, 0)")), Some(0.0));
    assert_eq!(one(&format!("clamp_max({max}, 2)")), Some(2.0));
    assert_eq!(
        one(&format!("clamp({max}, 5, 1)")),
        None,
        "max below min: no point"
    );
    assert!(
        one(&format!("clamp_min({max}, NaN)")).unwrap().is_nan(),
        "Go's math.Max"
    );
    assert_eq!(one(&format!("deg(rad({max}))")), Some(2.25));
    for (bad, says) in [
        ("abs(1)", "takes series"),
        ("clamp(bucketd_bucket_max, 1)", "takes 3 argument"),
        (
            "round(bucketd_bucket_max, bucketd_bucket_min)",
            "must be numbers",
        ),
        ("abs(bucketd_bucket_max[1h])", "inside a range function"),
    ] {
        assert!(error(bad).contains(says), "{bad}: {}", error(bad));
    }
}

/// Integer literals as Go's `ParseInt(s, 0, 64)` reads them first, as Prometheus does.
#[test]
fn hexadecimal_and_octal_literals_parse_as_in_prometheus() {
    for (text, want) in [
        ("0x3d", 61.0),
        ("0X10", 16.0),
        ("010", 8.0),
        ("09", 9.0),
        ("1e3", 1000.0),
        ("0.5", 0.5),
        ("0", 0.0),
    ] {
        let e = parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(e.number(), Some(want), "{text}");
    }
}

/// Past the work bound a range function's windows come from whole buckets (above): the answer
/// says so for that series, never silently; within it, nothing is said.
#[test]
fn an_answer_from_buckets_where_readings_were_asked_for_says_so() {
    let (readings, docs) = minute_readings();
    let kept = kept_from_hour_2(&readings);
    let fine = Grid::range(at(4), at(5), 60_000).unwrap();
    let q = r#"count_over_time(bucketd_reading{series="a/t"}[2h])"#;
    let notes_at = |max_points: u64| -> Vec<String> {
        let notes = Notes::default();
        let budget = Budget {
            max_points,
            cancel: None,
            notes: Some(notes.clone()),
        };
        evaluate_kept(q, &docs, &kept, fine, &budget).unwrap();
        notes.lock().unwrap().iter().cloned().collect()
    };
    assert!(notes_at(1_000).is_empty(), "{:?}", notes_at(1_000));
    let said = notes_at(400);
    assert!(said.iter().all(|n| n.starts_with("a/t: ")), "{said:?}");
    assert!(
        said.iter()
            .any(|n| n.contains("http.max_points_per_query (400)")
                && n.contains("from whole buckets")),
        "{said:?}"
    );
}

/// `time()` and the date functions' arguments, checked when parsed; a comparison between two
/// numbers that vary with time needs `bool`, as between literals.
#[test]
fn time_and_date_functions_check_their_arguments() {
    for (bad, says) in [
        ("time(1)", "takes 0 argument"),
        ("hour(1)", "takes series"),
        ("scalar(1)", "takes series"),
        ("vector()", "takes 1 argument"),
        ("day_of_week(bucketd_reading, bucketd_reading)", "0 or 1"),
    ] {
        assert!(error(bad).contains(says), "{bad}: {}", error(bad));
    }
    let grid = Grid::range(DAY0 * 1000, (DAY0 + 2 * HOUR) * 1000, HOUR * 1000).unwrap();
    let e = try_eval("time() > 5", &[], grid);
    assert!(
        matches!(&e, Err(EvalError::Refused(Refusal::Unsupported(m))) if m.contains("bool")),
        "{e:?}"
    );
    match try_eval("time() > bool 5", &[], grid) {
        Ok(Value::Timed(points)) => assert_eq!(points.len(), 3),
        other => panic!("{other:?}"),
    }
}

/// `label_replace` and `label_join` take strings where Prometheus does and nowhere else; their
/// label names and regular expressions are checked.
#[test]
fn relabelling_functions_check_their_strings() {
    for (bad, says) in [
        (r#""text""#, "only in label_replace"),
        (r#"bucketd_bucket_max + "x""#, "only in label_replace"),
        (
            r#"label_replace(bucketd_bucket_max, "d", "$1", "s")"#,
            "takes series and then strings",
        ),
        (
            r#"label_join(bucketd_bucket_max, "d")"#,
            "takes series and then strings",
        ),
        (
            r#"label_replace(bucketd_bucket_max, "1d", "$1", "s", "(.*)")"#,
            "invalid label name",
        ),
        (
            r#"label_join(bucketd_bucket_max, "d", ",", "a-b")"#,
            "invalid label name",
        ),
    ] {
        assert!(error(bad).contains(says), "{bad}: {}", error(bad));
    }
    let docs = hourly_docs();
    let grid = Grid::instant((DAY0 + 3 * HOUR) * 1000);
    let e = try_eval(
        r#"label_replace(bucketd_bucket_max{metric="t"}, "x", "$1", "series", "(")"#,
        &docs,
        grid,
    );
    assert!(
        matches!(&e, Err(EvalError::Refused(Refusal::Unsupported(m))) if m.contains("bad regular expression")),
        "{e:?}"
    );
    // Two series made one: refused, as Prometheus refuses a vector with a label set twice.
    let e = try_eval(
        r#"label_replace(label_replace(label_replace(bucketd_bucket_max{metric="t"}, "sensor", "", "sensor", ".*"), "series", "", "series", ".*"), "x", "1", "metric", ".*")"#,
        &docs,
        grid,
    );
    assert!(
        matches!(&e, Err(EvalError::Refused(Refusal::Execution(m))) if m.contains("same labels")),
        "{e:?}"
    );
}

/// Past the raw readings, `increase` over whole buckets answers from each bucket's
/// counter increase, each point visiting its window's buckets within the query's work bound
/// (16 x `http.max_points_per_query`); past it, no point, and the answer says why.
#[test]
fn a_counter_from_buckets_visits_its_windows_within_the_work_bound() {
    // A meter rising 1 a second in each of 150 hours (three readings an hour).
    let docs: Vec<BucketDoc> = (0..150)
        .map(|h| {
            let v = h as f64 * 10.0;
            doc("m/kwh", DAY0 + h * HOUR, &[v, v + 1.0, v + 2.0])
        })
        .collect();
    let grid = Grid::range(at(75), at(149), HOUR * 1000).unwrap();
    let run = |q: &str, max_points: u64| {
        let notes = Notes::default();
        let budget = Budget {
            max_points,
            cancel: None,
            notes: Some(notes.clone()),
        };
        let out = evaluate(
            &parse(q).unwrap(),
            &SeriesLabels::all(&["m/kwh".to_owned()], false),
            grid,
            HOUR,
            &budget,
            |wanted, from, to| Ok::<_, ()>(fetch(&docs, wanted, from, to)),
            no_raw,
        )
        .unwrap();
        let Value::Vector(series) = out else {
            panic!("{q}: {out:?}")
        };
        let said: Vec<String> = notes.lock().unwrap().iter().cloned().collect();
        (series.first().map_or(0, |s| s.points.len()), said)
    };
    // 75 points of 70-bucket windows: 5,250 visits, within 16 x 1,000; not within 16 x 200.
    let q = r#"increase(bucketd_reading{series="m/kwh"}[70h])"#;
    let (points, said) = run(q, 1_000);
    assert_eq!((points, said.len()), (75, 0), "{said:?}");
    let (points, said) = run(q, 200);
    assert!(points < 75, "{points}");
    assert!(
        said.iter()
            .any(|n| n.contains("would visit more than 16 x")),
        "{said:?}"
    );
}

/// A sensor named as a line protocol series key gives its tags as labels; its readings also
/// answer to the name Telegraf's Prometheus serializer gives them, with the tags alone.
#[test]
fn tags_are_labels_and_readings_answer_to_their_prometheus_names() {
    let l = SeriesLabels::of("weather,site=north,zone=2/temperature", false);
    assert_eq!(l.get("site"), "north");
    assert_eq!(l.get("zone"), "2");
    assert_eq!(l.native_name(), "weather_temperature");
    let p = SeriesLabels::of("prometheus,instance=h:9100,job=node/node_load1", false);
    assert_eq!(p.native_name(), "node_load1");
    assert_eq!(p.get("instance"), "h:9100");
    // Not a series key, or a tag that would stand for bucketd's own labels: no tag labels.
    for (series, name) in [
        ("boiler/temp", "boiler_temp"),
        ("a,b/t", "a_b_t"),
        ("a,1x=2/t", "a_1x_2_t"),
        ("9dev-1/t", "dev_1_t"),
    ] {
        let l = SeriesLabels::of(series, false);
        assert_eq!(l.tags().count(), 0, "{series}");
        assert_eq!(l.native_name(), name, "{series}");
    }
    let r = SeriesLabels::of("m,sensor=x,series=y,__name__=z,k=1,k=2/t", false);
    assert_eq!(r.tags().collect::<Vec<_>>(), [("k", "1")]);
    assert_eq!(
        r.named(READINGS)["sensor"],
        "m,sensor=x,series=y,__name__=z,k=1,k=2"
    );

    let docs: Vec<BucketDoc> = [
        "weather,site=north/temperature",
        "weather,site=south/temperature",
        "weather,site=north/humidity",
    ]
    .iter()
    .map(|s| doc(s, DAY0, &[1.0, 3.0]))
    .collect();
    let grid = Grid::instant((DAY0 + 1800) * 1000);
    let out = eval(
        r#"max_over_time(weather_temperature{site="north"}[1h])"#,
        &docs,
        grid,
    );
    assert_eq!(out.len(), 1);
    assert_eq!(
        out[0].labels,
        BTreeMap::from([("site".into(), "north".into())])
    );
    let out = eval(
        r#"last_over_time({__name__=~"weather_.+"}[1h])"#,
        &docs,
        grid,
    );
    let names: Vec<&str> = out.iter().map(|s| s.labels["__name__"].as_str()).collect();
    assert_eq!(names.len(), 3, "{out:?}");
    assert!(names.contains(&"weather_humidity"));
    // bucketd's own names keep their labels, the tags added; `by` a tag groups.
    let out = eval(
        r#"sum by (site) (count_over_time(bucketd_reading{metric="temperature"}[1h]))"#,
        &docs,
        grid,
    );
    let sites: Vec<&str> = out.iter().map(|s| s.labels["site"].as_str()).collect();
    assert_eq!(sites, ["north", "south"]);
    // A matcher on bucketd's own labels does not reach a series named natively.
    assert!(
        eval(
            r#"max_over_time(weather_temperature{sensor!=""}[1h])"#,
            &docs,
            grid
        )
        .is_empty()
    );
    assert!(eval("max_over_time(nonexistent[1h])", &docs, grid).is_empty());
}
