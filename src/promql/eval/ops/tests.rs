//! The numbers of the range functions and aggregations, against ground truths that do not
//! share their rule: a constant series (mean exactly its value, deviation exactly 0, whatever
//! its magnitude or sign), and integer series whose mean and variance are computed exactly in
//! 128-bit integers.

use proptest::prelude::*;

use super::*;
use crate::promql::{AggOp, Func, Grouping};

/// `op` over `values` as one group of series at one time.
fn across(op: AggOp, values: &[f64]) -> f64 {
    let many: Vec<Series> = values
        .iter()
        .enumerate()
        .map(|(i, &v)| Series {
            labels: BTreeMap::from([("i".to_owned(), i.to_string())]),
            points: vec![(0, v)],
        })
        .collect();
    let out = aggregate(op, 0.0, &Grouping::By(Vec::new()), many);
    assert_eq!(out.len(), 1);
    out[0].points[0].1
}

/// Any finite value, from the smallest subnormal to the largest, of either sign.
fn any_finite() -> impl Strategy<Value = f64> {
    prop_oneof![
        -1e6f64..1e6,
        (-300i32..300, any::<bool>()).prop_map(|(e, neg)| {
            let v = 10f64.powi(e) * 1.234_567_891_234_5;
            if neg { -v } else { v }
        }),
        Just(f64::MIN_POSITIVE),
        Just(-f64::MAX / 4.0),
        Just(5e-324),
    ]
}

proptest! {
    /// A stuck sensor: every function and aggregation answers as Prometheus's does for a
    /// constant, exactly.
    #[test]
    fn a_constant_series_has_its_value_as_mean_and_no_deviation(
        v in any_finite(),
        n in 1usize..400,
    ) {
        let values = vec![v; n];
        let at = |f| of_samples(f, 0.0, &values).unwrap();
        prop_assert_eq!(at(Func::AvgOverTime), v);
        prop_assert_eq!(at(Func::StddevOverTime), 0.0);
        prop_assert_eq!(at(Func::StdvarOverTime), 0.0);
        prop_assert_eq!(at(Func::AvgOverTime) - at(Func::LastOverTime), 0.0);
        prop_assert_eq!(across(AggOp::Avg, &values), v);
        prop_assert_eq!(across(AggOp::Stddev, &values), 0.0);
        prop_assert_eq!(across(AggOp::Stdvar, &values), 0.0);
    }

    /// Integer readings (as counters and most sensors send them, scaled): the sum, mean and
    /// population variance against their exact values in 128-bit integers.
    #[test]
    fn integer_series_answer_within_1e_9_of_the_exact_values(
        ints in prop::collection::vec(-(1i64 << 40)..(1i64 << 40), 1..300),
    ) {
        let values: Vec<f64> = ints.iter().map(|&i| i as f64).collect();
        let n = ints.len() as i128;
        let sum: i128 = ints.iter().map(|&i| i128::from(i)).sum();
        let sum_sq: i128 = ints.iter().map(|&i| i128::from(i) * i128::from(i)).sum();
        let exact_mean = sum as f64 / n as f64;
        // Var = (n Σx² - (Σx)²) / n², exact up to the final division.
        let exact_var = (n * sum_sq - sum * sum) as f64 / (n * n) as f64;
        let close = |got: f64, want: f64| (got - want).abs() <= 1e-9 * want.abs().max(1.0);
        let at = |f| of_samples(f, 0.0, &values).unwrap();
        prop_assert_eq!(at(Func::SumOverTime), sum as f64);
        prop_assert!(close(at(Func::AvgOverTime), exact_mean), "{} {}", at(Func::AvgOverTime), exact_mean);
        prop_assert!(close(at(Func::StdvarOverTime), exact_var), "{} {}", at(Func::StdvarOverTime), exact_var);
        prop_assert!(close(across(AggOp::Avg, &values), exact_mean));
        prop_assert!(close(across(AggOp::Stdvar, &values), exact_var));
    }
}

/// Infinities as Prometheus keeps them: a mean once infinite stays so, and opposite
/// infinities give NaN.
#[test]
fn infinite_values_give_infinite_or_nan_means_as_in_prometheus() {
    let inf = f64::INFINITY;
    let avg = |v: &[f64]| of_samples(Func::AvgOverTime, 0.0, v).unwrap();
    assert_eq!(avg(&[1.0, inf, 2.0]), inf);
    assert_eq!(avg(&[inf, inf]), inf);
    assert!(avg(&[inf, -inf]).is_nan());
    assert_eq!(across(AggOp::Avg, &[1.0, -inf, 3.0]), -inf);
    assert_eq!(
        of_samples(Func::SumOverTime, 0.0, &[1.0, inf]).unwrap(),
        inf
    );
}
