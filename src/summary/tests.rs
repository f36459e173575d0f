use proptest::prelude::*;

use super::*;

fn summary_of(readings: &[(i64, f64)]) -> Option<Summary> {
    let mut iter = readings.iter();
    let &(ts, v) = iter.next()?;
    let mut s = Summary::of(ts, v);
    for &(ts, v) in iter {
        s.push(ts, v);
    }
    Some(s)
}

fn merged(a: &Summary, b: &Summary) -> Summary {
    let mut m = a.clone();
    m.merge(b);
    m
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    a == b || (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-300)
}

/// Exact fields equal, approximate fields within the module doc's tolerances.
fn assert_equivalent(a: &Summary, b: &Summary) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.count, b.count);
    prop_assert_eq!(a.min.to_bits(), b.min.to_bits());
    prop_assert_eq!(a.max.to_bits(), b.max.to_bits());
    prop_assert_eq!(a.first.ts, b.first.ts);
    prop_assert_eq!(a.first.value.to_bits(), b.first.value.to_bits());
    prop_assert_eq!(a.last.ts, b.last.ts);
    prop_assert_eq!(a.last.value.to_bits(), b.last.value.to_bits());
    prop_assert_eq!(&a.sketch, &b.sketch, "sketches merge exactly");
    prop_assert!(
        close(a.total(), b.total(), 1e-12),
        "sum {} vs {}",
        a.total(),
        b.total()
    );
    prop_assert!(close(a.mean, b.mean, 1e-9), "mean {} vs {}", a.mean, b.mean);
    // m2 is a difference of large terms; compare it relative to the spread it measures.
    let scale = (a.max - a.min).powi(2) * a.count as f64;
    prop_assert!(
        (a.m2 - b.m2).abs() <= 1e-9 * scale.max(1e-300),
        "m2 {} vs {}",
        a.m2,
        b.m2
    );
    Ok(())
}

/// Readings: timestamps from a small range so equal timestamps occur; positive values so the
/// relative-sum tolerance is meaningful (mixed signs are checked separately, absolutely).
fn readings() -> impl Strategy<Value = Vec<(i64, f64)>> {
    prop::collection::vec((0i64..50, 0.001f64..1e6), 1..40)
}

proptest! {
    #[test]
    fn merge_is_commutative(a in readings(), b in readings()) {
        let (x, y) = (summary_of(&a).unwrap(), summary_of(&b).unwrap());
        assert_equivalent(&merged(&x, &y), &merged(&y, &x))?;
    }

    #[test]
    fn merge_is_associative(a in readings(), b in readings(), c in readings()) {
        let (x, y, z) = (summary_of(&a).unwrap(), summary_of(&b).unwrap(), summary_of(&c).unwrap());
        assert_equivalent(&merged(&merged(&x, &y), &z), &merged(&x, &merged(&y, &z)))?;
    }

    #[test]
    fn summary_of_concatenation_equals_merge_of_summaries(a in readings(), b in readings()) {
        let whole: Vec<_> = a.iter().chain(&b).copied().collect();
        let (x, y) = (summary_of(&a).unwrap(), summary_of(&b).unwrap());
        assert_equivalent(&summary_of(&whole).unwrap(), &merged(&x, &y))?;
    }

    #[test]
    fn aggregates_match_a_direct_computation(a in readings()) {
        let s = summary_of(&a).unwrap();
        let n = a.len() as f64;
        let mean = a.iter().map(|r| r.1).sum::<f64>() / n;
        let m2: f64 = a.iter().map(|r| (r.1 - mean).powi(2)).sum();
        prop_assert_eq!(s.count, a.len() as u64);
        prop_assert!(close(s.mean, mean, 1e-9));
        prop_assert!((s.m2 - m2).abs() <= 1e-6 * m2.max(1.0));
        let first = a.iter().copied().min_by(|p, q| p.0.cmp(&q.0).then(p.1.total_cmp(&q.1))).unwrap();
        let last = a.iter().copied().max_by(|p, q| p.0.cmp(&q.0).then(p.1.total_cmp(&q.1))).unwrap();
        prop_assert_eq!((s.first.ts, s.first.value), first);
        prop_assert_eq!((s.last.ts, s.last.value), last);
    }
}

#[test]
fn compensated_sum_keeps_small_terms_next_to_large_ones() {
    let mut s = Summary::of(0, 1e16);
    for i in 0..1000 {
        s.push(i, 1.0);
    }
    s.push(2000, -1e16);
    assert_eq!(s.total(), 1000.0);
}

#[test]
fn extreme_values_keep_exact_min_max_and_never_produce_nan() {
    let mut s = Summary::of(0, f64::MAX);
    s.push(1, -f64::MAX);
    s.push(2, f64::MIN_POSITIVE / 4.0); // subnormal
    assert_eq!(s.max, f64::MAX);
    assert_eq!(s.min, -f64::MAX);
    assert_eq!(s.last.value, f64::MIN_POSITIVE / 4.0);
    assert!(!s.mean.is_nan() && !s.m2.is_nan());
}

/// Issue 20: a central merges what gateways send, and a delta can carry `count = i64::MAX` twice
/// for one bucket. Merging saturates (it panicked: `checked_add(..).expect(..)`), and so does
/// the sketch; the document stores the count saturated at `i64::MAX` and its end saturated too.
#[test]
fn counts_from_untrusted_deltas_saturate_instead_of_panicking() {
    let mut big = Summary::of(0, 1.0);
    big.count = u64::MAX - 1;
    big.sketch.merge(&{
        let mut s = Summary::of(0, 1.0).sketch;
        for _ in 0..63 {
            let copy = s.clone();
            s.merge(&copy);
        }
        s
    });
    let mut merged = big.clone();
    merged.merge(&big);
    assert_eq!(merged.count, u64::MAX);
    merged.push(1, 2.0);
    assert_eq!(merged.count, u64::MAX);
    assert!(merged.sketch.quantile(0.5).is_some());
    let doc = crate::doc::BucketDoc::new("a/t", i64::MAX - 10, 3600, &merged);
    assert_eq!(doc.count, i64::MAX);
    assert_eq!(doc.end, i64::MAX);
}

/// A counter's increase as Prometheus 2.x computes it over readings in time order
/// (`extrapolatedRate`: last minus first, plus the value before each decrease).
fn prometheus_increase(sorted: &[(i64, f64)]) -> f64 {
    let mut result = sorted[sorted.len() - 1].1 - sorted[0].1;
    let mut previous = sorted[0].1;
    for &(_, v) in &sorted[1..] {
        if v < previous {
            result += previous;
        }
        previous = v;
    }
    result
}

/// A meter's readings: distinct, rising times; values that mostly climb and now and then reset.
fn meter() -> impl Strategy<Value = Vec<(i64, f64)>> {
    prop::collection::vec((1i64..1000, 0.0f64..50.0, prop::bool::weighted(0.1)), 1..60).prop_map(
        |steps| {
            let (mut t, mut v) = (0, 0.0);
            steps
                .into_iter()
                .map(|(dt, dv, reset)| {
                    t += dt;
                    v = if reset { dv } else { v + dv };
                    (t, v)
                })
                .collect()
        },
    )
}

proptest! {
    /// The counter increase of readings in time order, folded one by one or in
    /// consecutive parts merged in any order, is Prometheus's over the readings.
    #[test]
    fn the_counter_increase_of_consecutive_parts_is_prometheus_increase(
        readings in meter(),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..4),
        reversed in any::<bool>(),
    ) {
        let want = prometheus_increase(&readings);
        let whole = summary_of(&readings).unwrap();
        prop_assert!(close(whole.inc.unwrap(), want, 1e-9), "{:?} vs {want}", whole.inc);
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(readings.len())).collect();
        at.extend([0, readings.len()]);
        at.sort_unstable();
        at.dedup();
        let mut parts: Vec<Summary> = at.windows(2).filter_map(|w| summary_of(&readings[w[0]..w[1]])).collect();
        if reversed {
            parts.reverse();
        }
        let mut m = parts[0].clone();
        for p in &parts[1..] {
            m.merge(p);
        }
        prop_assert!(close(m.inc.unwrap(), want, 1e-9), "{:?} vs {want}", m.inc);
    }

    /// Merged in either order, the increase is the same, known or not.
    #[test]
    fn the_counter_increase_merges_commutatively(a in meter(), b in meter(), shift in 0i64..60_000) {
        let b: Vec<_> = b.iter().map(|&(t, v)| (t + shift, v)).collect();
        let (x, y) = (summary_of(&a).unwrap(), summary_of(&b).unwrap());
        let (xy, yx) = (merged(&x, &y).inc, merged(&y, &x).inc);
        prop_assert_eq!(xy.is_some(), yx.is_some());
        if let (Some(p), Some(q)) = (xy, yx) {
            prop_assert!(close(p, q, 1e-12));
        }
    }
}

/// A reading between two others already summarised cannot be placed: the increase becomes
/// unknown, for good (never a wrong number); before the first or after the last it joins.
#[test]
fn a_reading_out_of_time_order_makes_the_increase_unknown() {
    let mut s = summary_of(&[(10, 1.0), (30, 5.0)]).unwrap();
    assert_eq!(s.inc, Some(4.0));
    s.push(40, 2.0); // a reset after 5: the counter counted from 0 to 2
    assert_eq!(s.inc, Some(6.0));
    s.push(5, 0.5); // before the first
    assert_eq!(s.inc, Some(6.5));
    s.push(20, 3.0); // between 10 and 30
    assert_eq!(s.inc, None);
    s.push(50, 9.0);
    assert_eq!(s.inc, None);
    // Merging interleaved summaries (two gateways' counters) is unknown too.
    let (a, b) = (
        summary_of(&[(1, 1.0), (3, 2.0)]).unwrap(),
        summary_of(&[(2, 7.0)]).unwrap(),
    );
    assert_eq!(merged(&a, &b).inc, None);
}
