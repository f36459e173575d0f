//! What the evaluator does with values once read: a range function over a window's readings
//! or samples, the aggregations, and binary operations between numbers and series.

use std::collections::{BTreeMap, BTreeSet};

use super::{Labels, Refusal, Series, Value, unnamed};
use crate::promql::{AggOp, BinOp, Func, Group, Grouping, Matching};
use crate::summary::Summary;

/// A range function over the readings of a range, from their merged summary.
pub(super) fn of_readings(func: Func, q: f64, m: &Summary) -> Option<f64> {
    Some(match func {
        Func::AvgOverTime => m.mean,
        Func::MinOverTime => m.min,
        Func::MaxOverTime => m.max,
        Func::SumOverTime => m.total(),
        Func::CountOverTime => m.count as f64,
        Func::LastOverTime => m.last.value,
        Func::QuantileOverTime => match q {
            q if q.is_nan() => f64::NAN,
            q if q < 0.0 => f64::NEG_INFINITY,
            q if q > 1.0 => f64::INFINITY,
            q => m.quantile(q)?,
        },
        Func::StddevOverTime => m.stddev(),
        Func::StdvarOverTime => m.variance(),
        Func::PresentOverTime => 1.0,
        _ => return None,
    })
}

/// A counter or trend function ([`Func::needs_times`]) of a window's readings `raw` (ms,
/// value; in time order), evaluated at `t` (ms) over `[start, end]` (the window, `range_ms`
/// long), as Prometheus 2.x computes it: `rate`, `increase` and `delta` extrapolated to the
/// window's edges (by at most half the average spacing past the readings, never below a
/// counter's zero), a decrease counted as a reset by `rate`, `increase`, `irate` and `resets`;
/// `deriv` and `predict_linear` by least squares with compensated sums. `None` where
/// Prometheus gives no point (fewer than two readings, or two at the same time for `irate`).
pub(super) fn of_timed(
    func: Func,
    params: &[f64],
    raw: &[(i64, f64)],
    t: i64,
    (start, end, range_ms): (i64, i64, i64),
) -> Option<f64> {
    let (&(first_t, first), &(last_t, last)) = (raw.first()?, raw.last()?);
    let secs = |ms: i64| ms as f64 / 1000.0;
    match func {
        Func::Changes => {
            let n = raw
                .windows(2)
                .filter(|w| w[1].1 != w[0].1 && !(w[1].1.is_nan() && w[0].1.is_nan()))
                .count();
            return Some(n as f64);
        }
        Func::Resets => {
            return Some(raw.windows(2).filter(|w| w[1].1 < w[0].1).count() as f64);
        }
        _ => {}
    }
    if raw.len() < 2 {
        return None;
    }
    match func {
        Func::Irate | Func::Idelta => {
            let (prev_t, prev) = raw[raw.len() - 2];
            let value = if func == Func::Irate && last < prev {
                last
            } else {
                last - prev
            };
            if last_t == prev_t {
                return None;
            }
            Some(if func == Func::Irate {
                value / secs(last_t - prev_t)
            } else {
                value
            })
        }
        Func::Deriv => Some(linear_regression(raw, first_t).0),
        Func::PredictLinear => {
            let (slope, intercept) = linear_regression(raw, t);
            Some(slope * params.first()? + intercept)
        }
        Func::HoltWinters => {
            // Double exponential smoothing, as Prometheus's holt_winters.
            let (sf, tf) = (*params.first()?, *params.get(1)?);
            let (mut s0, mut s1) = (0.0, raw[0].1);
            let mut b = raw[1].1 - raw[0].1;
            for (i, &(_, v)) in raw.iter().enumerate().skip(1) {
                let x = sf * v;
                if i > 1 {
                    b = tf * (s1 - s0) + (1.0 - tf) * b;
                }
                let y = (1.0 - sf) * (s1 + b);
                (s0, s1) = (s1, x + y);
            }
            Some(s1)
        }
        _ => {
            let counter = func != Func::Delta;
            let mut result = last - first;
            if counter {
                let mut previous = 0.0;
                for &(_, v) in raw {
                    if v < previous {
                        result += previous;
                    }
                    previous = v;
                }
            }
            Some(extrapolated(
                func,
                result,
                ((first_t, first), (last_t, last), raw.len() as u64),
                (start, end, range_ms),
            ))
        }
    }
}

/// `rate`, `increase` or `delta` of a window from its readings' `result` (the increase, resets
/// counted, or the difference), as Prometheus 2.x extrapolates it to the window's edges (by at
/// most half the average spacing past the first and last reading `(ms, value)`, of `n`
/// readings in all; never below a counter's zero).
fn extrapolated(
    func: Func,
    result: f64,
    ((first_t, first), (last_t, _), n): ((i64, f64), (i64, f64), u64),
    (start, end, range_ms): (i64, i64, i64),
) -> f64 {
    let secs = |ms: i64| ms as f64 / 1000.0;
    let counter = func != Func::Delta;
    let mut to_start = secs(first_t - start);
    let to_end = secs(end - last_t);
    let sampled = secs(last_t - first_t);
    let average = sampled / n.saturating_sub(1) as f64;
    if counter && result > 0.0 && first >= 0.0 {
        // Not past the counter's zero.
        to_start = to_start.min(sampled * (first / result));
    }
    let threshold = average * 1.1;
    let mut interval = sampled;
    interval += if to_start < threshold {
        to_start
    } else {
        average / 2.0
    };
    interval += if to_end < threshold {
        to_end
    } else {
        average / 2.0
    };
    let extrapolated = result * (interval / sampled);
    if func == Func::Rate {
        extrapolated / secs(range_ms)
    } else {
        extrapolated
    }
}

/// `rate`, `increase` or `delta` of a window of whole buckets (`buckets`, in time order) from
/// what each keeps: first and last readings, counts, and for a counter its increase
/// ([`Summary::inc`]) joined bucket to bucket as the readings would be. As Prometheus computes
/// it from the readings they hold; `Err` where a bucket's increase is unknown, `Ok(None)` where
/// Prometheus gives no point (fewer than two readings).
pub(super) fn counter_of_buckets(
    func: Func,
    buckets: &[Summary],
    window: (i64, i64, i64),
) -> Result<Option<f64>, UnknownIncrease> {
    let (Some(a), Some(b)) = (buckets.first(), buckets.last()) else {
        return Ok(None);
    };
    let n: u64 = buckets.iter().map(|s| s.count).sum();
    let ms = |ts: i64| ts.div_euclid(1_000_000);
    let result = if func == Func::Delta {
        b.last.value - a.first.value
    } else {
        let mut result = 0.0;
        for (k, s) in buckets.iter().enumerate() {
            result += s.inc.ok_or(UnknownIncrease)?;
            if k > 0 {
                result += crate::summary::counter_step(buckets[k - 1].last.value, s.first.value);
            }
        }
        result
    };
    if n < 2 {
        return Ok(None);
    }
    Ok(Some(extrapolated(
        func,
        result,
        (
            (ms(a.first.ts), a.first.value),
            (ms(b.last.ts), b.last.value),
            n,
        ),
        window,
    )))
}

/// A bucket of a counter window whose increase is not known: stored before bucketd kept it,
/// or merged from readings out of time order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct UnknownIncrease;

/// Least squares of `raw`'s values against their times in seconds from `intercept_at` (ms):
/// (slope, value at `intercept_at`), sums compensated; a constant series has slope 0.
fn linear_regression(raw: &[(i64, f64)], intercept_at: i64) -> (f64, f64) {
    let first = raw[0].1;
    if raw.iter().all(|r| r.1 == first) {
        if first.is_infinite() {
            return (f64::NAN, f64::NAN);
        }
        return (0.0, first);
    }
    let (mut n, mut x, mut y, mut xy, mut x2) =
        (0.0, (0.0, 0.0), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0));
    for &(t, v) in raw {
        n += 1.0;
        let dx = (t - intercept_at) as f64 / 1000.0;
        x = kahan_inc(dx, x.0, x.1);
        y = kahan_inc(v, y.0, y.1);
        xy = kahan_inc(dx * v, xy.0, xy.1);
        x2 = kahan_inc(dx * dx, x2.0, x2.1);
    }
    let (sx, sy, sxy, sx2) = (x.0 + x.1, y.0 + y.1, xy.0 + xy.1, x2.0 + x2.1);
    let cov = sxy - sx * sy / n;
    let var = sx2 - sx * sx / n;
    let slope = cov / var;
    (slope, sy / n - slope * sx / n)
}

/// A range function over samples (one value per bucket), as Prometheus 2.x computes it: the
/// sum compensated (Kahan-Neumaier), the mean incremental and compensated, the variance by
/// Welford's online method with both running terms compensated. So a constant series has a
/// mean of exactly its value and a standard deviation of exactly 0 (the stuck-sensor alert
/// `stddev_over_time(x[1h]) == 0`), where a mean taken as sum / n and a second pass around it
/// left rounding residue of 1e-16 and more.
pub(super) fn of_samples(func: Func, q: f64, values: &[f64]) -> Option<f64> {
    let (&last, n) = (values.last()?, values.len() as f64);
    Some(match func {
        Func::AvgOverTime => mean_over_time(values),
        // Prometheus's rule: a NaN is passed over unless every value is NaN.
        Func::MinOverTime => values
            .iter()
            .fold(values[0], |m, &v| if v < m || m.is_nan() { v } else { m }),
        Func::MaxOverTime => values
            .iter()
            .fold(values[0], |m, &v| if v > m || m.is_nan() { v } else { m }),
        Func::SumOverTime => compensated_sum(values),
        Func::CountOverTime => n,
        Func::LastOverTime => last,
        Func::QuantileOverTime => type7(values, q),
        Func::StddevOverTime => variance_over_time(values).sqrt(),
        Func::StdvarOverTime => variance_over_time(values),
        Func::PresentOverTime => 1.0,
        _ => return None,
    })
}

/// One step of Kahan summation with Neumaier's improvement: `(sum + inc, compensation)`.
fn kahan_inc(inc: f64, sum: f64, c: f64) -> (f64, f64) {
    let t = sum + inc;
    let c = if sum.abs() >= inc.abs() {
        c + ((sum - t) + inc)
    } else {
        c + ((inc - t) + sum)
    };
    (t, c)
}

/// `sum_over_time`: compensated; an infinite sum is returned as it is.
fn compensated_sum(values: &[f64]) -> f64 {
    let (mut sum, mut c) = (0.0, 0.0);
    for &v in values {
        (sum, c) = kahan_inc(v, sum, c);
    }
    if sum.is_infinite() { sum } else { sum + c }
}

/// `avg_over_time`: the mean moved by `v / n - mean / n` at each value (no sum to overflow),
/// compensated; once infinite it stays so unless a value makes it NaN.
fn mean_over_time(values: &[f64]) -> f64 {
    let (mut mean, mut c, mut count) = (0.0f64, 0.0, 0.0);
    for &v in values {
        count += 1.0;
        if mean.is_infinite() && (v.is_finite() || (v.is_infinite() && (mean > 0.0) == (v > 0.0))) {
            continue;
        }
        (mean, c) = kahan_inc(v / count - mean / count, mean, c);
    }
    if mean.is_infinite() { mean } else { mean + c }
}

/// `stdvar_over_time`: Welford's online variance, mean and sum of squares compensated.
fn variance_over_time(values: &[f64]) -> f64 {
    let (mut count, mut mean, mut c_mean, mut aux, mut c_aux) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &v in values {
        count += 1.0;
        let delta = v - (mean + c_mean);
        (mean, c_mean) = kahan_inc(delta / count, mean, c_mean);
        (aux, c_aux) = kahan_inc(delta * (v - (mean + c_mean)), aux, c_aux);
    }
    (aux + c_aux) / count
}

/// What an aggregation keeps of a group at one time, as Prometheus's engine does: the sum from
/// the first value on, the mean incrementally, the variance by Welford's method.
struct Members {
    count: f64,
    sum: f64,
    mean: f64,
    m2: f64,
}

impl Members {
    fn of(values: &[f64]) -> Members {
        let first = values.first().copied().unwrap_or(f64::NAN);
        let mut g = Members {
            count: 1.0,
            sum: first,
            mean: first,
            m2: 0.0,
        };
        for &v in values.iter().skip(1) {
            g.count += 1.0;
            g.sum += v;
            let delta = v - g.mean;
            // `avg`'s mean and `stddev`'s are the engine's two (one divides each side).
            g.mean += delta / g.count;
            g.m2 += delta * (v - g.mean);
        }
        g
    }

    /// `avg`: the mean moved by `v / n - mean / n`, infinite means kept as Prometheus keeps
    /// them.
    fn avg(values: &[f64]) -> f64 {
        let mut mean = values.first().copied().unwrap_or(f64::NAN);
        let mut count = 1.0;
        for &v in values.iter().skip(1) {
            count += 1.0;
            if mean.is_infinite()
                && (v.is_finite() || (v.is_infinite() && (mean > 0.0) == (v > 0.0)))
            {
                continue;
            }
            mean += v / count - mean / count;
        }
        mean
    }
}

/// The φ-quantile of `values` by linear interpolation between closest ranks (Hyndman and
/// Fan's type 7, as Prometheus's `quantile` and `quantile_over_time`).
pub(super) fn type7(values: &[f64], q: f64) -> f64 {
    if q.is_nan() || values.is_empty() {
        return f64::NAN;
    }
    if q < 0.0 {
        return f64::NEG_INFINITY;
    }
    if q > 1.0 {
        return f64::INFINITY;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    let frac = rank - rank.floor();
    sorted[lo] + (sorted[hi] - sorted[lo]) * frac
}

/// PromQL's aggregation of `series` into groups, at each time over the series of the group
/// that have a point then. `__name__` is dropped, except by `topk` and `bottomk`, which keep
/// the series they pick as they are.
pub(super) fn aggregate(
    op: AggOp,
    param: f64,
    grouping: &Grouping,
    series: Vec<Series>,
) -> Vec<Series> {
    let key = |labels: &BTreeMap<String, String>| -> BTreeMap<String, String> {
        labels
            .iter()
            .filter(|(k, _)| {
                *k != "__name__"
                    && match grouping {
                        Grouping::By(keep) => keep.contains(k),
                        Grouping::Without(drop) => !drop.contains(k),
                    }
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    // Per group, per time: (series index, value).
    let mut groups: BTreeMap<Labels, BTreeMap<i64, Vec<(usize, f64)>>> = BTreeMap::new();
    for (i, s) in series.iter().enumerate() {
        let at = groups.entry(key(&s.labels)).or_default();
        for &(t, v) in &s.points {
            at.entry(t).or_default().push((i, v));
        }
    }
    if matches!(op, AggOp::Topk | AggOp::Bottomk) {
        let k = if param.is_finite() && param >= 1.0 {
            param as usize
        } else {
            0
        };
        let mut picked: Vec<Vec<(i64, f64)>> = vec![Vec::new(); series.len()];
        for at in groups.values() {
            for (&t, members) in at {
                let mut members = members.clone();
                members.sort_by(|a, b| match op {
                    AggOp::Topk => b.1.total_cmp(&a.1),
                    _ => a.1.total_cmp(&b.1),
                });
                for &(i, v) in members.iter().take(k) {
                    picked[i].push((t, v));
                }
            }
        }
        return series
            .into_iter()
            .zip(picked)
            .map(|(s, mut points)| {
                points.sort_by_key(|p| p.0);
                Series {
                    labels: s.labels,
                    points,
                }
            })
            .collect();
    }
    groups
        .into_iter()
        .map(|(labels, at)| Series {
            labels,
            points: at
                .into_iter()
                .map(|(t, members)| {
                    let values: Vec<f64> = members.iter().map(|m| m.1).collect();
                    let group = Members::of(&values);
                    let var = group.m2 / group.count;
                    let v = match op {
                        AggOp::Sum => group.sum,
                        AggOp::Avg => Members::avg(&values),
                        AggOp::Min => values.iter().copied().fold(f64::INFINITY, f64::min),
                        AggOp::Max => values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                        AggOp::Count => group.count,
                        AggOp::Stddev => var.sqrt(),
                        AggOp::Stdvar => var,
                        AggOp::Quantile => type7(&values, param),
                        AggOp::Group => 1.0,
                        AggOp::CountValues => unreachable!("count_values answers by itself"),
                        AggOp::Topk | AggOp::Bottomk => unreachable!("answered above"),
                    };
                    (t, v)
                })
                .collect(),
        })
        .collect()
}

/// `lhs op rhs`. Arithmetic drops `__name__`; a comparison keeps the left side's points where
/// it holds (its value and labels), or with `bool` gives 0 or 1 without `__name__`. Two vectors
/// pair their series one to one by `matching`, whose `on` or `ignoring` also decides the
/// result's labels, as in Prometheus.
pub(super) fn binary(
    op: BinOp,
    bool_result: bool,
    (matching, group): (&Matching, Option<&Group>),
    lhs: Value,
    rhs: Value,
) -> Result<Value, Refusal> {
    if op.is_set() {
        return match (lhs, rhs) {
            (Value::Vector(l), Value::Vector(r)) => Ok(Value::Vector(set(op, matching, l, r))),
            _ => Err(Refusal::Unsupported(
                "set operators (and, or, unless) are only between series".into(),
            )),
        };
    }
    let filter = op.is_comparison() && !bool_result;
    // One point: the result's value, or none where a comparison filters it out.
    let point = |a: f64, b: f64, keep: f64| {
        let r = op.apply(a, b);
        if filter {
            (r == 1.0).then_some(keep)
        } else {
            Some(r)
        }
    };
    // Prometheus 2.42 drops the metric name for arithmetic and `bool`, not for a filtering
    // comparison, nor for `atan2` (its `shouldDropMetricName` leaves it out).
    let keep_name = filter || op == BinOp::Atan2;
    let labels_of = |labels: BTreeMap<String, String>| {
        if keep_name { labels } else { unnamed(labels) }
    };
    match (lhs, rhs) {
        (Value::Vector(v), n @ (Value::Scalar(_) | Value::Timed(_))) => Ok(Value::Vector(
            with_number(v, &n, |a, b| point(a, b, a), labels_of),
        )),
        (n @ (Value::Scalar(_) | Value::Timed(_)), Value::Vector(v)) => Ok(Value::Vector(
            with_number(v, &n, |b, a| point(a, b, b), labels_of),
        )),
        (Value::Scalar(a), Value::Scalar(b)) => Ok(Value::Scalar(op.apply(a, b))),
        (a @ (Value::Scalar(_) | Value::Timed(_)), b @ (Value::Scalar(_) | Value::Timed(_))) => {
            if filter {
                return Err(Refusal::Unsupported(
                    "comparisons between numbers must use the bool modifier".into(),
                ));
            }
            let times = match (&a, &b) {
                (Value::Timed(p), _) | (_, Value::Timed(p)) => p.iter().map(|x| x.0).collect(),
                _ => Vec::new(),
            };
            let (a, b) = (Number::of(&a), Number::of(&b));
            Ok(Value::Timed(
                times
                    .into_iter()
                    .filter_map(|t| Some((t, op.apply(a.at(t)?, b.at(t)?))))
                    .collect(),
            ))
        }
        (Value::Vector(l), Value::Vector(r)) => {
            vectors(op, filter, (matching, group), l, r).map(Value::Vector)
        }
    }
}

/// Two sets of series paired by `matching`: one to one, or with `group_left`/`group_right`
/// many to one, as Prometheus pairs them. A filtering comparison keeps the left side's value;
/// the result's labels are the (many) side's (`on` keeps only its labels and `ignoring` drops
/// its own one to one; `__name__` only with a filtering comparison), then the labels
/// `group_*` names copied from the one side (deleted where it has none).
fn vectors(
    op: BinOp,
    filter: bool,
    (matching, group): (&Matching, Option<&Group>),
    l: Vec<Series>,
    r: Vec<Series>,
) -> Result<Vec<Series>, Refusal> {
    let key = |labels: &Labels| matched_labels(labels, matching);
    let right_many = group.is_some_and(|g| g.right);
    let (many, one) = if right_many { (r, l) } else { (l, r) };
    // Which side the one (or the many) is, for the errors.
    let side = |is_one: bool| {
        if is_one == right_many {
            "left"
        } else {
            "right"
        }
    };
    let mut ones: BTreeMap<Labels, &Series> = BTreeMap::new();
    for s in &one {
        if ones.insert(key(&s.labels), s).is_some() {
            return Err(Refusal::Execution(format!(
                "many-to-many matching: several series on the {} side have the labels {:?}; \
                 match on fewer labels with on (..) or ignoring (..)",
                side(true),
                key(&s.labels)
            )));
        }
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for s in many {
        let k = key(&s.labels);
        if group.is_none() && !seen.insert(k.clone()) {
            return Err(Refusal::Execution(format!(
                "many-to-many matching: several series on the {} side have the labels {k:?}; \
                 match on fewer labels with on (..) or ignoring (..), or name the many side \
                 with group_left or group_right",
                side(false)
            )));
        }
        let Some(other) = ones.get(&k) else {
            continue;
        };
        let theirs: BTreeMap<i64, f64> = other.points.iter().copied().collect();
        let points = s
            .points
            .iter()
            .filter_map(|&(t, v)| {
                let o = *theirs.get(&t)?;
                let (a, b) = if right_many { (o, v) } else { (v, o) };
                let r = op.apply(a, b);
                let value = if filter { (r == 1.0).then_some(a)? } else { r };
                Some((t, value))
            })
            .collect();
        // Prometheus 2.42 keeps the metric name for a filtering comparison and for `atan2`.
        let keep_name = filter || op == BinOp::Atan2;
        let mut labels = match (keep_name, matching, group) {
            (_, Matching::On(_), None) => k,
            (_, Matching::Ignoring(ignored), None) => {
                let mut l = if keep_name {
                    s.labels
                } else {
                    unnamed(s.labels)
                };
                l.retain(|name, _| !ignored.contains(name));
                l
            }
            (true, _, _) => s.labels,
            (false, _, _) => unnamed(s.labels),
        };
        if let Some(g) = group {
            for name in &g.include {
                match other.labels.get(name) {
                    Some(v) if !v.is_empty() => {
                        labels.insert(name.clone(), v.clone());
                    }
                    _ => {
                        labels.remove(name);
                    }
                }
            }
            if !seen.insert(labels.clone()) {
                return Err(Refusal::Execution(format!(
                    "multiple matches for the labels {labels:?}: the grouping labels must make \
                     each result's labels unique"
                )));
            }
        }
        out.push(Series { labels, points });
    }
    Ok(out)
}

/// A number operand at each time: a constant, or `time()`'s kind by time.
enum Number {
    Constant(f64),
    ByTime(BTreeMap<i64, f64>),
}

impl Number {
    fn of(v: &Value) -> Number {
        match v {
            Value::Timed(points) => Number::ByTime(points.iter().copied().collect()),
            Value::Scalar(x) => Number::Constant(*x),
            Value::Vector(_) => Number::Constant(f64::NAN),
        }
    }

    fn at(&self, t: i64) -> Option<f64> {
        match self {
            Number::Constant(x) => Some(*x),
            Number::ByTime(by) => by.get(&t).copied(),
        }
    }
}

/// Each series of `v` with the number `n` at each of its points: `point(series value, n)`,
/// which may filter the point out; labels by `labels_of`.
fn with_number(
    v: Vec<Series>,
    n: &Value,
    point: impl Fn(f64, f64) -> Option<f64>,
    labels_of: impl Fn(Labels) -> Labels,
) -> Vec<Series> {
    let n = Number::of(n);
    v.into_iter()
        .map(|s| Series {
            points: s
                .points
                .iter()
                .filter_map(|&(t, a)| Some((t, point(a, n.at(t)?)?)))
                .collect(),
            labels: labels_of(s.labels),
        })
        .collect()
}

/// `count_values("label", v)`: per group (by `grouping`, `__name__` dropped) and time, a
/// series per distinct value with `label` set to the value as Go formats it, counting the
/// series that have it then.
pub(super) fn count_values(label: &str, grouping: &Grouping, series: Vec<Series>) -> Vec<Series> {
    let mut out: BTreeMap<Labels, BTreeMap<i64, f64>> = BTreeMap::new();
    for s in series {
        let mut labels: Labels = s
            .labels
            .into_iter()
            .filter(|(k, _)| {
                k != "__name__"
                    && match grouping {
                        Grouping::By(keep) => keep.contains(k),
                        Grouping::Without(drop) => !drop.contains(k),
                    }
            })
            .collect();
        for (t, v) in s.points {
            labels.insert(label.to_owned(), go_float(v));
            *out.entry(labels.clone())
                .or_default()
                .entry(t)
                .or_insert(0.0) += 1.0;
        }
    }
    out.into_iter()
        .map(|(labels, at)| Series {
            labels,
            points: at.into_iter().collect(),
        })
        .collect()
}

/// `v` as Go's `strconv.FormatFloat(v, 'f', -1, 64)` writes it.
fn go_float(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{v}")
    }
}

/// `histogram_quantile(q, v)` as Prometheus 2.x: the series that differ only in `le` are one
/// histogram (labels without `le` and `__name__`); at each time its buckets, by upper bound,
/// equal bounds merged and counts made non-decreasing, give the q-quantile by linear
/// interpolation inside the bucket that holds its rank. NaN without a `+Inf` bucket, with
/// fewer than two buckets or no observations; a series whose `le` is no number is left out.
pub(super) fn histogram_quantile(q: f64, series: Vec<Series>) -> Vec<Series> {
    // Histograms of different metric names stay apart, as in Prometheus; the name is dropped.
    let mut histograms: BTreeMap<(Labels, Option<String>), Buckets> = BTreeMap::new();
    for s in series {
        let Some(le) = s.labels.get("le").and_then(|v| parse_bound(v)) else {
            continue;
        };
        let mut labels = s.labels;
        labels.remove("le");
        let name = labels.remove("__name__");
        let at = histograms.entry((labels, name)).or_default();
        for (t, count) in s.points {
            at.entry(t).or_default().push((le, count));
        }
    }
    histograms
        .into_iter()
        .map(|((labels, _), at)| Series {
            labels,
            points: at
                .into_iter()
                .map(|(t, buckets)| (t, bucket_quantile(q, buckets)))
                .collect(),
        })
        .collect()
}

/// A histogram's buckets at each time: (upper bound, cumulative count).
type Buckets = BTreeMap<i64, Vec<(f64, f64)>>;

/// An `le` label's value as Go's `ParseFloat` reads it (`+Inf`, `1e3`).
fn parse_bound(v: &str) -> Option<f64> {
    match v.to_ascii_lowercase().as_str() {
        "+inf" | "inf" | "infinity" | "+infinity" => Some(f64::INFINITY),
        "-inf" | "-infinity" => Some(f64::NEG_INFINITY),
        _ => v.parse().ok(),
    }
}

/// Prometheus's `bucketQuantile` over (upper bound, cumulative count) buckets.
fn bucket_quantile(q: f64, mut buckets: Vec<(f64, f64)>) -> f64 {
    if q.is_nan() {
        return f64::NAN;
    }
    if q < 0.0 {
        return f64::NEG_INFINITY;
    }
    if q > 1.0 {
        return f64::INFINITY;
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    if buckets.last().is_none_or(|b| b.0 != f64::INFINITY) {
        return f64::NAN;
    }
    let mut merged: Vec<(f64, f64)> = Vec::with_capacity(buckets.len());
    for (le, count) in buckets {
        match merged.last_mut() {
            Some(last) if last.0 == le => last.1 += count,
            _ => merged.push((le, count)),
        }
    }
    let mut max = f64::NEG_INFINITY;
    for b in &mut merged {
        if b.1 > max {
            max = b.1;
        } else {
            b.1 = max;
        }
    }
    if merged.len() < 2 {
        return f64::NAN;
    }
    let observations = merged[merged.len() - 1].1;
    if observations == 0.0 {
        return f64::NAN;
    }
    let mut rank = q * observations;
    let b = merged[..merged.len() - 1].partition_point(|x| x.1 < rank);
    if b == merged.len() - 1 {
        return merged[merged.len() - 2].0;
    }
    if b == 0 && merged[0].0 <= 0.0 {
        return merged[0].0;
    }
    let (mut start, end, mut count) = (0.0, merged[b].0, merged[b].1);
    if b > 0 {
        start = merged[b - 1].0;
        count -= merged[b - 1].1;
        rank -= merged[b - 1].1;
    }
    start + (end - start) * (rank / count)
}

/// `label_replace(v, dst, replacement, src, regex)` and `label_join(v, dst, sep, src...)`
/// (`strings` after the series), as Prometheus: the regex anchored at both ends, the
/// replacement expanded as Go's (`$1`, `${name}`), an empty result deleting the label; two
/// series left with the same labels are refused.
pub(super) fn relabel(
    f: Func,
    strings: &[&str],
    series: Vec<Series>,
) -> Result<Vec<Series>, Refusal> {
    let dst = strings[0];
    let regex = if f == Func::LabelReplace {
        let pattern = format!("^(?:{})$", strings[3]);
        Some(
            regex_lite::RegexBuilder::new(&pattern)
                .size_limit(1 << 20)
                .nest_limit(64)
                .build()
                .map_err(|e| {
                    Refusal::Unsupported(format!("label_replace: bad regular expression: {e}"))
                })?,
        )
    } else {
        None
    };
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(series.len());
    for mut s in series {
        let value = match &regex {
            Some(re) => {
                let src = s.labels.get(strings[2]).map_or("", String::as_str);
                match re.captures(src) {
                    Some(caps) => {
                        let mut v = String::new();
                        caps.expand(strings[1], &mut v);
                        Some(v)
                    }
                    None => None,
                }
            }
            None => Some(
                strings[2..]
                    .iter()
                    .map(|l| s.labels.get(*l).map_or("", String::as_str))
                    .collect::<Vec<_>>()
                    .join(strings[1]),
            ),
        };
        match value {
            Some(v) if v.is_empty() => {
                s.labels.remove(dst);
            }
            Some(v) => {
                s.labels.insert(dst.to_owned(), v);
            }
            None => {}
        }
        if !s.points.is_empty() && !seen.insert(s.labels.clone()) {
            return Err(Refusal::Execution(format!(
                "{}: two series would have the same labels {:?}",
                f.name(),
                s.labels
            )));
        }
        out.push(s);
    }
    Ok(out)
}

/// The labels two series are matched by: all but `__name__`, or `on`'s, or all but
/// `ignoring`'s.
fn matched_labels(labels: &Labels, matching: &Matching) -> Labels {
    labels
        .iter()
        .filter(|(k, _)| {
            *k != "__name__"
                && match matching {
                    Matching::All => true,
                    Matching::On(on) => on.contains(k),
                    Matching::Ignoring(ignored) => !ignored.contains(k),
                }
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// `lhs and/or/unless rhs`, time by time as Prometheus: the left side's points whose label
/// set (by `matching`, `__name__` never counted) the right side has a point for at that time
/// (`and`) or has not (`unless`); `or` adds the right side's points whose label set the left
/// side has no point for then. Series keep their labels and values, `__name__` included.
fn set(op: BinOp, matching: &Matching, l: Vec<Series>, r: Vec<Series>) -> Vec<Series> {
    let key = |labels: &Labels| matched_labels(labels, matching);
    // Per time, the label sets a side has a point for.
    let present = |side: &[Series]| -> BTreeMap<i64, BTreeSet<Labels>> {
        let mut at: BTreeMap<i64, BTreeSet<Labels>> = BTreeMap::new();
        for s in side {
            let k = key(&s.labels);
            for &(t, _) in &s.points {
                at.entry(t).or_default().insert(k.clone());
            }
        }
        at
    };
    let has = |at: &BTreeMap<i64, BTreeSet<Labels>>, t: i64, k: &Labels| {
        at.get(&t).is_some_and(|ks| ks.contains(k))
    };
    let keep = |side: Vec<Series>, other: &BTreeMap<i64, BTreeSet<Labels>>, want: bool| {
        side.into_iter()
            .filter_map(|s| {
                let k = key(&s.labels);
                let points: Vec<(i64, f64)> = s
                    .points
                    .into_iter()
                    .filter(|&(t, _)| has(other, t, &k) == want)
                    .collect();
                (!points.is_empty()).then_some(Series {
                    labels: s.labels,
                    points,
                })
            })
            .collect::<Vec<_>>()
    };
    match op {
        BinOp::And => keep(l, &present(&r), true),
        BinOp::Unless => keep(l, &present(&r), false),
        _ => {
            let left = present(&l);
            let mut out = l;
            out.extend(keep(r, &left, false));
            out
        }
    }
}

#[cfg(test)]
mod tests;

/// `sort` (ascending) and `sort_desc`: series by the value of their point (an instant query's
/// one), NaN last either way, as Prometheus orders them.
pub(super) fn sort_by_value(series: &mut [Series], descending: bool) {
    let value = |s: &Series| s.points.first().map_or(f64::NAN, |p| p.1);
    series.sort_by(|a, b| {
        let (x, y) = (value(a), value(b));
        match (x.is_nan(), y.is_nan()) {
            (true, true) => std::cmp::Ordering::Equal,
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            _ if descending => y.total_cmp(&x),
            _ => x.total_cmp(&y),
        }
    });
}
