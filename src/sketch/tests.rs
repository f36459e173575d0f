use proptest::prelude::*;

use super::*;

/// xorshift: deterministic samples.
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit().max(1e-300), self.unit());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

fn sketch_of(values: &[f64], params: SketchParams) -> Sketch {
    let mut s = Sketch::new(params);
    for v in values {
        s.add(*v);
    }
    s
}

/// The exact quantile `q` of `sorted` by Hyndman and Fan's definition 7 (numpy's default,
/// Prometheus's `quantile_over_time`), written from the definition, not from the sketch's code:
/// `h = (n - 1) q`, `x[floor(h)] + (h - floor(h)) (x[floor(h) + 1] - x[floor(h)])`. Returns the
/// value and the two neighbours it lies between.
pub(crate) fn type7(sorted: &[f64], q: f64) -> (f64, f64, f64) {
    let h = (sorted.len() - 1) as f64 * q;
    let (i, frac) = (h.floor() as usize, h - h.floor());
    let lo = sorted[i];
    let hi = sorted[(i + 1).min(sorted.len() - 1)];
    (lo + frac * (hi - lo), lo, hi)
}

/// Every quantile from 0 to 1 in steps of 1% is within `alpha` of the exact type-7 value (of
/// the larger neighbour's magnitude when the neighbours' signs differ).
fn assert_within_alpha(name: &str, values: &[f64], params: SketchParams) {
    let s = sketch_of(values, params);
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    for step in 0..=100 {
        let q = f64::from(step) / 100.0;
        let (exact, lo, hi) = type7(&sorted, q);
        let got = s.quantile(q).unwrap();
        let bound = params.alpha * lo.abs().max(hi.abs()) * (1.0 + 1e-9);
        assert!(
            (got - exact).abs() <= bound,
            "{name}: q={q} exact {exact} got {got}"
        );
    }
}

/// Issue 44: the sketch took the rank `floor(q (n - 1))`, so p99 of two readings was the
/// smaller and of 1..9 and 100 was 8.94; Prometheus's `quantile_over_time` gives 19.9 and
/// 91.81. The summary's quantile (exact min and max at the ends) gives them within the
/// sketch's accuracy; these numbers are numpy's `np.quantile(x, 0.99)`.
#[test]
fn small_buckets_have_the_quantiles_prometheus_gives() {
    let summary = |values: &[f64]| {
        let mut s = crate::summary::Summary::with_params(0, values[0], SketchParams::DEFAULT);
        for &v in &values[1..] {
            s.push(0, v);
        }
        s
    };
    let two = summary(&[10.0, 20.0]);
    assert_eq!(two.quantile(0.99), Some(19.9));
    assert_eq!(two.quantile(0.5), Some(15.0));
    assert_eq!(two.quantile(0.0), Some(10.0));
    let ten = summary(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 100.0]);
    let p99 = ten.quantile(0.99).unwrap();
    assert!((p99 - 91.81).abs() <= 0.01 * 100.0, "{p99}");
    let p50 = ten.quantile(0.5).unwrap();
    assert!((p50 - 5.5).abs() <= 0.01 * 6.0, "{p50}");
    let p90 = ten.quantile(0.9).unwrap();
    assert!((p90 - 18.1).abs() <= 0.01 * 100.0, "{p90}");
}

#[test]
fn quantiles_of_known_distributions_are_within_the_relative_accuracy() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let n = 20_000;
    let uniform: Vec<f64> = (0..n).map(|_| 1.0 + 999.0 * rng.unit()).collect();
    let normal: Vec<f64> = (0..n).map(|_| 20.0 + 5.0 * rng.normal()).collect();
    let pareto: Vec<f64> = (0..n)
        .map(|_| 1.0 / (1.0 - rng.unit()).powf(1.0 / 1.2))
        .collect();
    let constant = vec![21.5; 1000];
    let negative: Vec<f64> = (0..n).map(|_| -1.0 - 999.0 * rng.unit()).collect();
    let mixed: Vec<f64> = (0..n)
        .map(|i| {
            if i % 7 == 0 {
                0.0
            } else {
                100.0 * rng.normal()
            }
        })
        .collect();
    let tiny: Vec<f64> = (0..n).map(|_| 1e-300 * (1.0 + rng.unit())).collect();
    let huge: Vec<f64> = (0..n).map(|_| 1e300 * (1.0 + 100.0 * rng.unit())).collect();
    let extremes = vec![
        f64::MIN_POSITIVE,
        1e-200,
        1.0,
        1e200,
        f64::MAX,
        -f64::MAX,
        -f64::MIN_POSITIVE,
    ];
    for alpha in [0.01, 0.02, 0.05] {
        let params = SketchParams {
            alpha,
            max_bins: 1 << 16,
        };
        for (name, values) in [
            ("uniform", &uniform),
            ("normal", &normal),
            ("pareto", &pareto),
            ("constant", &constant),
            ("negative", &negative),
            ("mixed with zeros", &mixed),
            ("tiny", &tiny),
            ("huge", &huge),
            ("extremes", &extremes),
        ] {
            assert_within_alpha(name, values, params);
        }
    }
}

#[test]
fn the_bin_bound_holds_and_keeps_the_high_quantiles() {
    let mut rng = Rng(7);
    // Twelve decades of magnitude need about 1,400 bins at 1%; allow 1024, which cover the top
    // nine decades: the median and above stay within 1%.
    let values: Vec<f64> = (0..50_000)
        .map(|_| 10f64.powf(-6.0 + 12.0 * rng.unit()))
        .collect();
    let params = SketchParams {
        alpha: 0.01,
        max_bins: 1024,
    };
    let s = sketch_of(&values, params);
    assert!(s.bins() <= 1024, "{} bins", s.bins());
    assert_eq!(s.count(), 50_000);
    let mut sorted = values.clone();
    sorted.sort_by(f64::total_cmp);
    for q in [0.5, 0.9, 0.99, 1.0] {
        let exact = sorted[(q * (sorted.len() - 1) as f64) as usize];
        let got = s.quantile(q).unwrap();
        assert!(
            ((got - exact) / exact).abs() <= 0.01 + 1e-9,
            "q={q}: {got} vs {exact}"
        );
    }
    // Merging keeps the bound too.
    let mut merged = s.clone();
    merged.merge(&sketch_of(&values[..1000], params));
    assert!(merged.bins() <= 1024);
    assert_eq!(merged.count(), 51_000);
}

#[test]
fn sketches_of_another_accuracy_are_rebinned_on_merge() {
    let values: Vec<f64> = (1..=1000).map(f64::from).collect();
    let fine = sketch_of(
        &values,
        SketchParams {
            alpha: 0.01,
            max_bins: 4096,
        },
    );
    let mut coarse = Sketch::new(SketchParams {
        alpha: 0.05,
        max_bins: 4096,
    });
    coarse.merge(&fine);
    assert_eq!(coarse.count(), 1000);
    let p50 = coarse.quantile(0.5).unwrap();
    assert!((p50 - 500.0).abs() / 500.0 <= 0.01 + 0.05 + 1e-9, "{p50}");
}

#[test]
fn empty_and_corrupt_encodings() {
    let empty = Sketch::new(SketchParams::DEFAULT);
    assert_eq!(empty.quantile(0.5), None);
    assert_eq!(Sketch::decode(&empty.encode()), Some(empty));
    assert_eq!(Sketch::decode(&[]), None);
    assert_eq!(Sketch::decode(&[9, 0, 0]), None);
    let mut bytes = sketch_of(&[1.0, 2.0], SketchParams::DEFAULT).encode();
    bytes.push(0);
    assert_eq!(Sketch::decode(&bytes), None, "trailing bytes");
}

#[test]
fn an_hour_of_a_noisy_temperature_sketch_is_small() {
    let mut rng = Rng(3);
    let values: Vec<f64> = (0..3600).map(|_| 21.0 + 0.5 * rng.normal()).collect();
    let bytes = sketch_of(&values, SketchParams::DEFAULT).encode();
    assert!(bytes.len() < 400, "{} bytes", bytes.len());
}

fn value() -> impl Strategy<Value = f64> {
    prop_oneof![
        -1e6f64..1e6,
        Just(0.0),
        (1e-300f64..1e-290),
        (-1e300f64..-1e290),
    ]
}

proptest! {
    #[test]
    fn merge_equals_the_sketch_of_the_union(
        a in prop::collection::vec(value(), 0..200),
        b in prop::collection::vec(value(), 0..200),
    ) {
        let params = SketchParams { alpha: 0.01, max_bins: 1 << 16 };
        let mut merged = sketch_of(&a, params);
        merged.merge(&sketch_of(&b, params));
        let union: Vec<f64> = a.iter().chain(&b).copied().collect();
        prop_assert_eq!(&merged, &sketch_of(&union, params));
        prop_assert_eq!(Sketch::decode(&merged.encode()), Some(merged));
    }
}

/// Issue 20: a bin index delta that overflows (`prev + unzigzag(..)`) is a damaged sketch, not a
/// panic.
#[test]
fn a_bin_index_that_overflows_is_refused_when_decoding() {
    let mut bytes = vec![ENCODING_V1];
    bytes.extend_from_slice(&0.01f64.to_le_bytes());
    put_varint(&mut bytes, 64); // max_bins
    put_varint(&mut bytes, 0); // zeros
    put_varint(&mut bytes, 2); // positive bins
    put_varint(&mut bytes, zigzag(i64::from(i32::MAX)));
    put_varint(&mut bytes, 1);
    put_varint(&mut bytes, zigzag(i64::MAX));
    put_varint(&mut bytes, 1);
    put_varint(&mut bytes, 0); // negative bins
    assert!(Sketch::decode(&bytes).is_none());
}

/// Bytes of a sketch with the given positive bins as (index step, count) pairs.
fn encoded_with_positive_bins(bins: &[(i64, u64)]) -> Vec<u8> {
    let mut bytes = vec![ENCODING_V1];
    bytes.extend_from_slice(&0.01f64.to_le_bytes());
    put_varint(&mut bytes, 64); // max_bins
    put_varint(&mut bytes, 0); // zeros
    put_varint(&mut bytes, bins.len() as u64);
    for (step, n) in bins {
        put_varint(&mut bytes, zigzag(*step));
        put_varint(&mut bytes, *n);
    }
    put_varint(&mut bytes, 0); // negative bins
    bytes
}

/// Issue 20: a repeated bin index used to overwrite the first bin while `count` counted both, so
/// the counts no longer added up and `quantile` reached `unreachable!`.
#[test]
fn a_repeated_or_descending_bin_index_is_refused_when_decoding() {
    assert!(Sketch::decode(&encoded_with_positive_bins(&[(5, 3), (2, 1)])).is_some());
    assert!(Sketch::decode(&encoded_with_positive_bins(&[(5, 3), (0, 1)])).is_none());
    assert!(Sketch::decode(&encoded_with_positive_bins(&[(5, 3), (-1, 1)])).is_none());
}

/// Issue 20: bins that saturated on their own (merged from untrusted deltas) sum past `u64`;
/// a quantile then answers from the bins instead of overflowing or reaching `unreachable!`.
#[test]
fn quantiles_of_saturated_counts_answer_without_panicking() {
    let bytes = encoded_with_positive_bins(&[(5, u64::MAX / 2 + 1), (1, u64::MAX / 2)]);
    let mut s = Sketch::decode(&bytes).expect("the counts add up to u64::MAX");
    let other = s.clone();
    s.merge(&other);
    assert_eq!(s.count(), u64::MAX, "saturated");
    let low = s.quantile(0.0).unwrap();
    let high = s.quantile(1.0).unwrap();
    assert!(low > 0.0 && high > low, "{low} {high}");
}

/// Found by the admission fuzzer (issue 20): a sketch whose counts saturated on merge wrote
/// bytes that its own decoder refused (`checked_add` of the bins), so the commit log entry
/// holding it was unreadable and the central's checkpoints failed.
#[test]
fn a_sketch_saturated_by_merging_reads_back_as_written() {
    let mut s = Sketch::decode(&encoded_with_positive_bins(&[(5, u64::MAX)])).unwrap();
    s.add(0.0);
    assert_eq!(s.count(), u64::MAX);
    assert_eq!(Sketch::decode(&s.encode()), Some(s));
}

/// Issue 52: a sketch with more bins than its own `max_bins` (64 here) was decoded whole and
/// kept: 2,000 deltas of 30,000 bins grew a central to 0.9 GiB. From outside it is refused
/// before its bins are read; a stored one (written before the fix from such a delta) reads
/// back collapsed to its bound, its count whole.
#[test]
fn a_sketch_over_its_own_bin_bound_is_refused_from_outside_and_collapsed_when_stored() {
    let at_bound = vec![(1, 1); 64];
    let bytes = encoded_with_positive_bins(&at_bound);
    assert_eq!(Sketch::decode_untrusted(&bytes).map(|s| s.bins()), Some(64));
    let over = vec![(1, 1); 30_000];
    let bytes = encoded_with_positive_bins(&over);
    assert!(bytes.len() <= Sketch::encoded_len_max(30_000));
    assert!(Sketch::decode_untrusted(&bytes).is_none());
    let stored = Sketch::decode(&bytes).expect("a stored sketch still reads");
    assert_eq!((stored.bins(), stored.count()), (64, 30_000));
    // What it reads back as is what it writes: within its bound.
    assert_eq!(Sketch::decode_untrusted(&stored.encode()), Some(stored));
}

/// Every sketch `encode` writes fits `encoded_len_max` of its bins, whatever its counts.
#[test]
fn encoded_len_max_bounds_what_encode_writes() {
    let params = SketchParams {
        alpha: 0.0001,
        max_bins: 512,
    };
    let mut s = Sketch::new(params);
    for i in 0..5_000 {
        let v = if i % 2 == 0 { 1.0001f64 } else { -1.0001f64 };
        s.add_n(v.powi(i * 97), u64::MAX / 3);
    }
    s.add_n(0.0, u64::MAX);
    assert_eq!(s.bins(), 512);
    assert!(s.encode().len() <= Sketch::encoded_len_max(512));
}
