//! Ground truth: the exact aggregates a set of readings must produce, and the assertions that
//! compare stored buckets with it, field by field.

use std::collections::BTreeMap;

use bucketd::doc::BucketDoc;

/// One expected reading: series, timestamp (ns, `None` when the receive time is used), value.
#[derive(Debug, Clone)]
pub struct Expected {
    pub series: String,
    pub ts: Option<i64>,
    pub value: f64,
}

/// The exact aggregates a set of readings must produce.
#[derive(Debug, Clone, PartialEq)]
pub struct Truth {
    pub count: i64,
    pub sum: f64,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
    pub variance: f64,
    pub first: Option<(i64, f64)>,
    pub last: Option<(i64, f64)>,
    /// The values in ascending order, for exact quantiles.
    pub sorted: Vec<f64>,
    /// A counter's increase over the readings in time order, as Prometheus computes it (last
    /// minus first plus the value before each decrease); `None` without device times or with
    /// two readings at one time (no one order).
    pub increase: Option<f64>,
}

impl Truth {
    /// The exact quantile `q` by Hyndman and Fan's definition 7 (numpy's default, Prometheus's
    /// `quantile_over_time`), from the sorted readings: `h = (n - 1) q`, then
    /// `x[floor(h)] + (h - floor(h)) (x[floor(h) + 1] - x[floor(h)])`. Also the two neighbours.
    pub fn quantile(&self, q: f64) -> (f64, f64, f64) {
        type7(&self.sorted, q)
    }
}

/// The exact quantile `q` of ascending `x` by Hyndman and Fan's definition 7, and the two
/// neighbours it lies between ([`Truth::quantile`]).
pub fn type7(x: &[f64], q: f64) -> (f64, f64, f64) {
    let h = (x.len() - 1) as f64 * q;
    let (i, frac) = (h.floor() as usize, h - h.floor());
    let (lo, hi) = (x[i], x[(i + 1).min(x.len() - 1)]);
    (lo + frac * (hi - lo), lo, hi)
}

/// Whether `p` is within the sketch's 1% of the exact type-7 quantile (of the larger
/// neighbour's magnitude when the two neighbours' signs differ: each is estimated within 1%).
pub fn quantile_close(p: f64, (exact, lo, hi): (f64, f64, f64)) -> bool {
    (p - exact).abs() <= 0.01 * lo.abs().max(hi.abs()) * (1.0 + 1e-9)
}

/// (series, bucket start); no start for readings stamped with the receive time.
pub type TruthKey = (String, Option<i64>);

/// Ground truth per (series, bucket start) for readings with device timestamps, and per series
/// (all buckets together) for readings stamped with the receive time.
pub fn truth(readings: &[Expected], width_secs: i64) -> BTreeMap<TruthKey, Truth> {
    let mut groups: BTreeMap<TruthKey, Vec<(Option<i64>, f64)>> = BTreeMap::new();
    for r in readings {
        let start =
            r.ts.map(|ts| ts.div_euclid(1_000_000_000).div_euclid(width_secs) * width_secs);
        groups
            .entry((r.series.clone(), start))
            .or_default()
            .push((r.ts, r.value));
    }
    groups
        .into_iter()
        .map(|(key, values)| {
            let n = values.len() as f64;
            // Exact-ish reference: sum in sorted order of magnitude with f64, compared with
            // a relative tolerance by the caller.
            let sum: f64 = values.iter().map(|v| v.1).sum();
            let mean = sum / n;
            let variance = values.iter().map(|v| (v.1 - mean).powi(2)).sum::<f64>() / n;
            let timed: Vec<(i64, f64)> = values
                .iter()
                .filter_map(|(ts, v)| ts.map(|ts| (ts, *v)))
                .collect();
            let order = |a: &(i64, f64), b: &(i64, f64)| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1));
            let increase = {
                let mut sorted = timed.clone();
                sorted.sort_by(order);
                let distinct = sorted.windows(2).all(|w| w[0].0 < w[1].0);
                (timed.len() == values.len() && distinct).then(|| {
                    let mut result = sorted[sorted.len() - 1].1 - sorted[0].1;
                    for w in sorted.windows(2) {
                        if w[1].1 < w[0].1 {
                            result += w[0].1;
                        }
                    }
                    result
                })
            };
            let t = Truth {
                count: values.len() as i64,
                sum,
                min: values.iter().map(|v| v.1).fold(f64::INFINITY, f64::min),
                max: values.iter().map(|v| v.1).fold(f64::NEG_INFINITY, f64::max),
                mean,
                variance,
                first: timed.iter().copied().min_by(order),
                last: timed.iter().copied().max_by(order),
                sorted: {
                    let mut v: Vec<f64> = values.iter().map(|v| v.1).collect();
                    v.sort_by(f64::total_cmp);
                    v
                },
                increase,
            };
            (key, t)
        })
        .collect()
}

pub fn close(a: f64, b: f64, rel: f64) -> bool {
    a == b || (a - b).abs() <= rel * a.abs().max(b.abs())
}

/// The stored buckets of `series` (at `start`, or all of them) and their merged summary.
fn stored<'a>(
    docs: &'a [BucketDoc],
    series: &str,
    start: Option<i64>,
) -> (Vec<&'a BucketDoc>, bucketd::summary::Summary) {
    let mine: Vec<&BucketDoc> = docs
        .iter()
        .filter(|d| d.series == series && start.is_none_or(|s| d.start == s))
        .collect();
    assert!(!mine.is_empty(), "no bucket for {series} {start:?}");
    let mut merged = mine[0].summary();
    for d in &mine[1..] {
        merged.merge(&d.summary());
    }
    (mine, merged)
}

/// Compares stored buckets with the ground truth: every field of every bucket.
/// Readings without device timestamps are compared per series (their hour is the receive hour).
pub fn assert_matches_truth(docs: &[BucketDoc], truth: &BTreeMap<TruthKey, Truth>) {
    check_truth(docs, truth, true);
}

/// [`assert_matches_truth`] for documents rebuilt from an export, which carries quantiles but
/// not the sketch itself (the caller checks the exported quantiles).
pub fn assert_matches_truth_but_quantiles(docs: &[BucketDoc], truth: &BTreeMap<TruthKey, Truth>) {
    check_truth(docs, truth, false);
}

fn check_truth(docs: &[BucketDoc], truth: &BTreeMap<TruthKey, Truth>, quantiles: bool) {
    let mut seen = 0;
    for ((series, start), want) in truth {
        let (mine, got) = stored(docs, series, *start);
        let ctx = format!("{series} @ {start:?}: got {got:?}, want {want:?}");
        assert_eq!(got.count as i64, want.count, "count {ctx}");
        assert_extremes_exact(&got, want, &ctx);
        assert!(close(got.total(), want.sum, 1e-9), "sum {ctx}");
        assert!(close(got.mean, want.mean, 1e-9), "mean {ctx}");
        // A bucket's counter increase, where it knows one, is the readings' (it may
        // not know: readings merged out of time order).
        if let (Some(inc), Some(truth)) = (got.inc, want.increase) {
            let scale = truth.abs() + want.count as f64 * want.min.abs().max(want.max.abs());
            assert!((inc - truth).abs() <= 1e-12 * scale, "increase {ctx}");
        }
        for q in [0.0, 0.5, 0.9, 0.99, 1.0].into_iter().filter(|_| quantiles) {
            let p = got.quantile(q).expect("the sketch covers the bucket");
            assert_quantile(p, want, q, &ctx);
        }
        let spread = (want.max - want.min).powi(2);
        assert!(
            (got.variance() - want.variance).abs() <= 1e-9 * spread.max(f64::MIN_POSITIVE),
            "variance {ctx}"
        );
        if want.first.is_some() {
            let d = mine[0];
            assert_eq!(d.end - d.start, 3600, "end {ctx}");
            let (sensor, metric) = series.split_once('/').unwrap();
            assert_eq!((d.sensor.as_str(), d.metric.as_str()), (sensor, metric));
        }
        seen += mine.len();
    }
    assert_eq!(seen, docs.len(), "buckets exist that no reading explains");
}

/// A quantile estimate within the sketch's 1% of the exact value of the same rank.
pub fn assert_quantile(p: f64, want: &Truth, q: f64, ctx: &str) {
    let exact = want.quantile(q);
    assert!(
        quantile_close(p, exact),
        "p{} {p} vs exact {exact:?}: {ctx}",
        q * 100.0
    );
}

/// min, max, and (for device-timestamped readings) first and last, bit for bit.
fn assert_extremes_exact(got: &bucketd::summary::Summary, want: &Truth, ctx: &str) {
    assert_eq!(got.min.to_bits(), want.min.to_bits(), "min {ctx}");
    assert_eq!(got.max.to_bits(), want.max.to_bits(), "max {ctx}");
    if let (Some(first), Some(last)) = (want.first, want.last) {
        let bits = |p: (i64, f64)| (p.0, p.1.to_bits());
        assert_eq!(
            (got.first.ts, got.first.value.to_bits()),
            bits(first),
            "first {ctx}"
        );
        assert_eq!(
            (got.last.ts, got.last.value.to_bits()),
            bits(last),
            "last {ctx}"
        );
    }
}
