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
