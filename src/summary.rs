//! [`Summary`]: the precomputed aggregates of one bucket, and the merge that makes "flush partial
//! buckets often and merge them on disk" correct. Pure; knows nothing about MQTT or redb.
//!
//! The merge is a commutative monoid (property-tested below):
//! - `count`, `min`, `max`, `first`, `last` are exact. `first`/`last` go by timestamp; equal
//!   timestamps are broken by the value's total order (`f64::total_cmp`), so the result does not
//!   depend on arrival or merge order.
//! - `sum` is kept as a Neumaier-compensated pair (`sum`, `sum_comp`); the reported sum
//!   `sum + sum_comp` is within a relative 1e-12 of the exact sum for any merge order of
//!   same-signed values. It is not bit-exact across merge orders: f64 addition is not associative.
//! - `mean` and `m2` (sum of squared deviations) merge with Chan et al.'s parallel formula;
//!   they are within a relative 1e-9 across merge orders.
//! - `sketch` (quantiles) merges exactly while it is under its bin bound (see [`Sketch`]).
//! - `inc`, a counter's increase over the readings in time order with resets counted, joins
//!   two summaries whose readings follow one another in time (one's first not before
//!   the other's last): the increases plus the step between them. Merged otherwise (readings
//!   interleaved in time: a late reading, two gateways' series) it is unknown (`None`) for good,
//!   as it is for a bucket stored before it existed; the merge stays commutative.

use crate::sketch::{Sketch, SketchParams};

/// A timestamped value, as in `first` and `last`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// Nanoseconds since the Unix epoch.
    pub ts: i64,
    pub value: f64,
}

/// The aggregates of a non-empty set of readings.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub count: u64,
    pub sum: f64,
    pub sum_comp: f64,
    pub min: f64,
    pub max: f64,
    pub first: Point,
    pub last: Point,
    pub mean: f64,
    pub m2: f64,
    pub sketch: Sketch,
    /// The increase of the readings as a counter's, in time order, each decrease a reset
    /// ([`counter_step`]); `None` where it cannot be known (see the module's notes).
    pub inc: Option<f64>,
}

/// A counter's increase from a reading `a` to the next one `b`, as Prometheus counts it: a
/// decrease is a reset, after which the counter counted from 0 to `b`.
pub fn counter_step(a: f64, b: f64) -> f64 {
    if b < a { b } else { b - a }
}

impl Summary {
    /// The summary of one reading, with the default sketch settings.
    pub fn of(ts: i64, value: f64) -> Summary {
        Summary::with_params(ts, value, SketchParams::DEFAULT)
    }

    /// The summary of one reading.
    pub fn with_params(ts: i64, value: f64, params: SketchParams) -> Summary {
        debug_assert!(value.is_finite(), "decode rejects non-finite values");
        let point = Point { ts, value };
        let mut sketch = Sketch::new(params);
        sketch.add(value);
        Summary {
            count: 1,
            sum: value,
            sum_comp: 0.0,
            min: value,
            max: value,
            first: point,
            last: point,
            mean: value,
            m2: 0.0,
            sketch,
            inc: Some(0.0),
        }
    }

    /// Adds one reading. Equivalent to merging `Summary::with_params(ts, value, ..)`, without
    /// building that summary (no allocation per reading).
    pub fn push(&mut self, ts: i64, value: f64) {
        let point = Point { ts, value };
        let one = Scalars {
            count: 1,
            sum: value,
            sum_comp: 0.0,
            min: value,
            max: value,
            first: point,
            last: point,
            mean: value,
            m2: 0.0,
            inc: Some(0.0),
        };
        self.merge_scalars(&one);
        self.sketch.add(value);
    }

    /// Merges `other` into `self`, as if `self` had seen `other`'s readings too.
    pub fn merge(&mut self, other: &Summary) {
        self.merge_scalars(&Scalars {
            count: other.count,
            sum: other.sum,
            sum_comp: other.sum_comp,
            min: other.min,
            max: other.max,
            first: other.first,
            last: other.last,
            mean: other.mean,
            m2: other.m2,
            inc: other.inc,
        });
        self.sketch.merge(&other.sketch);
    }

    fn merge_scalars(&mut self, other: &Scalars) {
        let n_a = self.count as f64;
        let n_b = other.count as f64;
        // Saturates: deltas from a gateway are untrusted, and no input may panic.
        let count = self.count.saturating_add(other.count);
        let n = count as f64;

        let (sum, comp) = neumaier_add(self.sum, self.sum_comp, other.sum);
        self.sum = sum;
        self.sum_comp = comp + other.sum_comp;

        // Chan et al.: weights instead of `mean_a + delta * n_b / n`, so that means of values
        // near f64::MAX do not overflow through `delta`.
        let delta = other.mean - self.mean;
        let mean = self.mean * (n_a / n) + other.mean * (n_b / n);
        let m2 = self.m2 + other.m2 + delta * delta * (n_a / n) * n_b;
        self.mean = if mean.is_finite() { mean } else { self.mean };
        self.m2 = if m2.is_nan() { f64::INFINITY } else { m2 };

        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        // Joined where one's readings all follow the other's (before first and last move).
        self.inc = match (self.inc, other.inc) {
            (Some(a), Some(b)) if !earlier(&other.first, &self.last) => {
                Some(a + b + counter_step(self.last.value, other.first.value))
            }
            (Some(a), Some(b)) if !earlier(&self.first, &other.last) => {
                Some(a + b + counter_step(other.last.value, self.first.value))
            }
            _ => None,
        }
        .filter(|i| i.is_finite());
        if earlier(&other.first, &self.first) {
            self.first = other.first;
        }
        if earlier(&self.last, &other.last) {
            self.last = other.last;
        }
        self.count = count;
        debug_assert!(self.count > 0 && self.min <= self.max);
    }

    /// The value at quantile `q` by the interpolated rank of Prometheus's `quantile_over_time`
    /// (Hyndman-Fan type 7; [`Sketch::quantile`]), the lowest and highest ranks being the exact
    /// min and max and the others the sketch's estimates clamped to them: for readings 10 and 20,
    /// p99 is 19.9 exactly. `None` when the sketch does not cover every reading (a bucket written
    /// before sketches existed).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.sketch.count() != self.count {
            return None;
        }
        let last = self.count.saturating_sub(1);
        self.sketch.quantile_with(q, |rank| match rank {
            0 => Some(self.min),
            r if r >= last => Some(self.max),
            r => self
                .sketch
                .value_at_rank(r)
                .map(|v| v.clamp(self.min, self.max)),
        })
    }

    /// The compensated sum.
    pub fn total(&self) -> f64 {
        self.sum + self.sum_comp
    }

    /// Population variance (`m2 / count`).
    pub fn variance(&self) -> f64 {
        self.m2 / self.count as f64
    }

    /// Population standard deviation.
    pub fn stddev(&self) -> f64 {
        self.variance().sqrt()
    }
}

/// The exact aggregates of a summary, without its sketch.
struct Scalars {
    count: u64,
    sum: f64,
    sum_comp: f64,
    min: f64,
    max: f64,
    first: Point,
    last: Point,
    mean: f64,
    m2: f64,
    inc: Option<f64>,
}

/// Total order on points: by timestamp, then by value (`total_cmp`).
fn earlier(a: &Point, b: &Point) -> bool {
    (a.ts, TotalF64(a.value)) < (b.ts, TotalF64(b.value))
}

#[derive(PartialEq)]
struct TotalF64(f64);

impl PartialOrd for TotalF64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.0.total_cmp(&other.0))
    }
}

/// One step of Neumaier's compensated summation: returns (new sum, compensation increment
/// already added to `comp`).
fn neumaier_add(sum: f64, comp: f64, x: f64) -> (f64, f64) {
    let t = sum + x;
    if !t.is_finite() {
        // Overflow: the compensation is meaningless now; keep the infinity.
        return (t, 0.0);
    }
    let c = if sum.abs() >= x.abs() {
        (sum - t) + x
    } else {
        (x - t) + sum
    };
    (t, comp + c)
}

#[cfg(test)]
mod tests;
