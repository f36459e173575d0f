//! The expressions bucketd answers, as [`super::parse`] gives them: selectors and their label
//! matchers, range selections, functions, aggregations and binary operations, and the series
//! labels they match.

use std::collections::BTreeMap;

use super::{REGEX_NESTING_MAX, REGEX_SIZE_MAX};
use crate::summary::Summary;

/// A field of a bucket, as the metric `bucketd_bucket_<field>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Field {
    Count,
    Sum,
    Min,
    Max,
    Mean,
    Stddev,
    P50,
    P90,
    P99,
}

impl Field {
    pub const ALL: [Field; 9] = [
        Field::Count,
        Field::Sum,
        Field::Min,
        Field::Max,
        Field::Mean,
        Field::Stddev,
        Field::P50,
        Field::P90,
        Field::P99,
    ];

    pub fn metric_name(self) -> &'static str {
        match self {
            Field::Count => "bucketd_bucket_count",
            Field::Sum => "bucketd_bucket_sum",
            Field::Min => "bucketd_bucket_min",
            Field::Max => "bucketd_bucket_max",
            Field::Mean => "bucketd_bucket_mean",
            Field::Stddev => "bucketd_bucket_stddev",
            Field::P50 => "bucketd_bucket_p50",
            Field::P90 => "bucketd_bucket_p90",
            Field::P99 => "bucketd_bucket_p99",
        }
    }

    /// The help text of `/api/v1/metadata`.
    pub fn help(self) -> &'static str {
        match self {
            Field::Count => "Readings in the bucket.",
            Field::Sum => "Sum of the readings in the bucket.",
            Field::Min => "Smallest reading in the bucket.",
            Field::Max => "Largest reading in the bucket.",
            Field::Mean => "Mean of the readings in the bucket.",
            Field::Stddev => "Standard deviation (population) of the readings in the bucket.",
            Field::P50 => "Median of the readings in the bucket (quantile sketch).",
            Field::P90 => "90th percentile of the readings in the bucket (quantile sketch).",
            Field::P99 => "99th percentile of the readings in the bucket (quantile sketch).",
        }
    }

    /// The field of `s`; `None` when the summary cannot give it (a quantile of a sketch that
    /// does not hold every reading).
    pub fn value(self, s: &Summary) -> Option<f64> {
        match self {
            Field::Count => Some(s.count as f64),
            Field::Sum => Some(s.total()),
            Field::Min => Some(s.min),
            Field::Max => Some(s.max),
            Field::Mean => Some(s.mean),
            Field::Stddev => Some(s.stddev()),
            Field::P50 => s.quantile(0.5),
            Field::P90 => s.quantile(0.9),
            Field::P99 => s.quantile(0.99),
        }
    }
}

/// The labels a stored series has, besides `__name__`; a query node's series have
/// [`GATEWAY`] too.
pub const LABELS: [&str; 3] = ["metric", "sensor", "series"];

/// The label of a query node's series naming their gateway: the id, or `*` for a fleet-wide
/// series (the merge of every gateway's series of that sensor and metric).
pub const GATEWAY: &str = "gateway";

/// The gateway of a fleet-wide series.
pub const FLEET_WIDE: &str = "*";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MatchOp {
    Equal,
    NotEqual,
    Regex,
    NotRegex,
}

/// One label matcher: `label op "value"`.
#[derive(Debug, Clone)]
pub struct Matcher {
    pub(super) label: String,
    pub(super) op: MatchOp,
    pub(super) value: String,
    /// The anchored expression, for `=~` and `!~`.
    pub(super) regex: Option<regex_lite::Regex>,
}

impl Matcher {
    pub(super) fn new(label: String, op: MatchOp, value: String) -> Result<Matcher, String> {
        let compile = |pattern: &str| {
            regex_lite::RegexBuilder::new(pattern)
                .size_limit(REGEX_SIZE_MAX)
                .nest_limit(REGEX_NESTING_MAX)
                .build()
                .map_err(|e| format!("label matcher {label}: bad regular expression: {e}"))
        };
        let regex = match op {
            MatchOp::Regex | MatchOp::NotRegex => {
                // A whole expression on its own first: `a)|(.*` would otherwise close the
                // anchoring group and match everything (issue 41).
                compile(&value)?;
                Some(compile(&format!("^(?:{value})$"))?)
            }
            MatchOp::Equal | MatchOp::NotEqual => None,
        };
        Ok(Matcher {
            label,
            op,
            value,
            regex,
        })
    }

    pub(super) fn matches(&self, value: &str) -> bool {
        match (&self.op, &self.regex) {
            (MatchOp::Equal, _) => value == self.value,
            (MatchOp::NotEqual, _) => value != self.value,
            (MatchOp::Regex, Some(r)) => r.is_match(value),
            (MatchOp::NotRegex, Some(r)) => !r.is_match(value),
            (MatchOp::Regex | MatchOp::NotRegex, None) => false,
        }
    }
}

/// A series selector: `bucketd_bucket_mean{sensor="boiler"}`, `{__name__=~"...", ...}`.
#[derive(Debug, Clone)]
pub struct Selector {
    pub(super) matchers: Vec<Matcher>,
}

/// The labels of one stored series.
#[derive(Debug, Clone, Copy)]
pub struct SeriesLabels<'a> {
    pub series: &'a str,
    /// On a query node, the gateway (`*` for a fleet-wide series); none on a gateway.
    pub gateway: Option<&'a str>,
    pub sensor: &'a str,
    pub metric: &'a str,
}

impl<'a> SeriesLabels<'a> {
    /// The labels of the stored series `name`: `sensor/metric` on a gateway;
    /// `gateway:sensor/metric` on a query node (`fleet`), the gateway a label of its own.
    pub fn of(name: &'a str, fleet: bool) -> SeriesLabels<'a> {
        let (gateway, rest) = match name.split_once(':') {
            Some((gateway, rest)) if fleet => (Some(gateway), rest),
            _ => (None, name),
        };
        let (sensor, metric) = rest.split_once('/').unwrap_or((rest, ""));
        SeriesLabels {
            series: name,
            gateway,
            sensor,
            metric,
        }
    }

    /// The labels of each of `names`.
    pub fn all(names: &'a [String], fleet: bool) -> Vec<SeriesLabels<'a>> {
        names.iter().map(|n| SeriesLabels::of(n, fleet)).collect()
    }

    /// Whether it is a fleet-wide series, which only a selector naming it selects.
    pub fn fleet_wide(&self) -> bool {
        self.gateway == Some(FLEET_WIDE)
    }

    pub(super) fn get(&self, label: &str) -> &'a str {
        match label {
            "series" => self.series,
            "sensor" => self.sensor,
            "metric" => self.metric,
            GATEWAY => self.gateway.unwrap_or(""),
            // Prometheus: a label a series does not have has the empty value.
            _ => self
                .tags()
                .find(|(k, _)| *k == label)
                .map_or("", |(_, v)| v),
        }
    }

    /// The sensor's tags as labels: a sensor named as an `InfluxDB` series key,
    /// `measurement,key=value,...` (what the line protocol decoder names it), has a label per
    /// tag whose key is a label name that is not one of bucketd's own ([`LABELS`],
    /// [`GATEWAY`], `__`-prefixed); the first of a repeated key. None unless every part after
    /// the measurement is `key=value`.
    pub fn tags(&self) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        let parts = tag_parts(self.sensor);
        let mut seen: Vec<&'a str> = Vec::new();
        parts.into_iter().flatten().filter(move |(k, _)| {
            let fresh = !seen.contains(k) && !reserved_label(k);
            seen.push(k);
            fresh
        })
    }

    /// The Prometheus name of the series' readings, as Telegraf's Prometheus serializer names
    /// a line protocol field: `<measurement>_<field>`, the field alone for the measurement
    /// `prometheus` (Telegraf's Prometheus input), characters a metric name cannot hold as
    /// `_`. A sensor that is no series key is its own measurement.
    pub fn native_name(&self) -> String {
        let measurement = match tag_parts(self.sensor) {
            Some(_) => self.sensor.split(',').next().unwrap_or(self.sensor),
            None => self.sensor,
        };
        if measurement == "prometheus" {
            metric_name_of(self.metric)
        } else {
            metric_name_of(&format!("{measurement}_{}", self.metric))
        }
    }

    /// The labels of the readings named by [`SeriesLabels::native_name`]: the tags, and the
    /// gateway on a query node; as the series would be in a Prometheus that scraped them.
    pub fn native_labels(&self) -> BTreeMap<String, String> {
        let mut labels: BTreeMap<String, String> = self
            .tags()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        labels.insert("__name__".to_owned(), self.native_name());
        if let Some(gateway) = self.gateway {
            labels.insert(GATEWAY.to_owned(), gateway.to_owned());
        }
        labels
    }

    /// All labels of the metric `field` of this series.
    pub fn with_name(&self, field: Field) -> BTreeMap<String, String> {
        self.named(field.metric_name())
    }

    /// All labels of this series as `name`: bucketd's own, and the tags.
    pub fn named(&self, name: &str) -> BTreeMap<String, String> {
        let mut labels: BTreeMap<String, String> = self
            .tags()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        labels.extend([
            ("__name__".to_owned(), name.to_owned()),
            ("metric".to_owned(), self.metric.to_owned()),
            ("sensor".to_owned(), self.sensor.to_owned()),
            ("series".to_owned(), self.series.to_owned()),
        ]);
        if let Some(gateway) = self.gateway {
            labels.insert(GATEWAY.to_owned(), gateway.to_owned());
        }
        labels
    }
}

/// The `key=value` parts of a sensor named `measurement,key=value,...`; `None` when it has
/// none or one part is not a label name, `=` and a value.
fn tag_parts(sensor: &str) -> Option<impl Iterator<Item = (&str, &str)>> {
    let (_, tags) = sensor.split_once(',')?;
    let valid = tags.split(',').all(|part| {
        part.split_once('=')
            .is_some_and(|(k, v)| is_label_name(k) && !v.is_empty())
    });
    valid.then(|| tags.split(',').filter_map(|part| part.split_once('=')))
}

/// Whether `name` is one of the labels bucketd gives every series (a tag may not stand for it).
fn reserved_label(name: &str) -> bool {
    name.starts_with("__") || LABELS.contains(&name) || name == GATEWAY
}

/// Prometheus's label names: `[a-zA-Z_][a-zA-Z0-9_]*`.
pub fn is_label_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// A metric name made of `name` as Telegraf sanitizes one: a first character a name cannot
/// start with left out, any other character outside `[a-zA-Z0-9_:]` as `_`, then `_` trimmed
/// at both ends.
fn metric_name_of(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for (i, c) in name.chars().enumerate() {
        let first = c.is_ascii_alphabetic() || c == '_' || c == ':';
        if i == 0 {
            if first {
                out.push(c);
            }
        } else if first || c.is_ascii_digit() {
            out.push(c);
        } else {
            out.push('_');
        }
    }
    out.trim_matches('_').to_owned()
}

/// The metric whose samples are the readings themselves: inside a range function the buckets
/// of the range merge exactly (`quantile_over_time(0.99, bucketd_reading{..}[1d])` is the p99
/// of the day's readings); as a plain selector, the last raw reading within [`LOOKBACK_MS`].
pub const READINGS: &str = "bucketd_reading";

/// How far back a plain `bucketd_reading` selector looks for a reading unless told
/// (`http.lookback`, [`super::Grid::looking_back`]): Prometheus's default look-back delta, 5 minutes.
pub const LOOKBACK_MS: i64 = 5 * 60 * 1000;

impl Selector {
    /// Whether the `__name__` matchers accept [`READINGS`], or it names readings by their
    /// Prometheus names ([`Selector::native`]).
    pub fn selects_readings(&self) -> bool {
        self.accepts_name(READINGS) || self.native()
    }

    /// Whether every `__name__` matcher accepts `name`.
    fn accepts_name(&self, name: &str) -> bool {
        self.matchers
            .iter()
            .filter(|m| m.label == "__name__")
            .all(|m| m.matches(name))
    }

    /// Whether it names the readings by their Prometheus names
    /// ([`SeriesLabels::native_name`], `energy_kwh{site="north"}`): it has a `__name__`
    /// matcher, which takes neither [`READINGS`] nor a bucket field.
    pub fn native(&self) -> bool {
        self.matchers.iter().any(|m| m.label == "__name__")
            && !self.accepts_name(READINGS)
            && !Field::ALL
                .iter()
                .any(|f| self.accepts_name(f.metric_name()))
    }

    /// The labels of the readings of a series it selects: by their Prometheus name when it
    /// names them so, else as [`READINGS`].
    pub fn reading_labels(&self, series: &SeriesLabels) -> BTreeMap<String, String> {
        if self.native() {
            series.native_labels()
        } else {
            series.named(READINGS)
        }
    }

    /// Whether its `__name__` matchers name [`READINGS`] (there is at least one, and all
    /// accept it): a plain selector then answers the last reading within the look-back.
    pub fn names_readings(&self) -> bool {
        self.matchers.iter().any(|m| m.label == "__name__") && self.selects_readings()
    }

    /// Whether it selects [`READINGS`] and no bucket field.
    pub fn only_readings(&self) -> bool {
        self.selects_readings() && self.fields().is_empty()
    }

    /// The labels its `=` matchers name (not `__name__`): what `absent` answers with.
    pub fn equal_labels(&self) -> BTreeMap<String, String> {
        self.matchers
            .iter()
            .filter(|m| m.op == MatchOp::Equal && m.label != "__name__")
            .map(|m| (m.label.clone(), m.value.clone()))
            .collect()
    }

    /// The fields whose metric name the selector's `__name__` matchers accept.
    pub fn fields(&self) -> Vec<Field> {
        Field::ALL
            .into_iter()
            .filter(|f| {
                self.matchers
                    .iter()
                    .filter(|m| m.label == "__name__")
                    .all(|m| m.matches(f.metric_name()))
            })
            .collect()
    }

    /// Whether the series' own labels (not `__name__`) pass every matcher. A fleet-wide series
    /// must be named as well (`gateway="*"`, or `series="*:boiler/temp"`): selected by any
    /// selector, it would count its gateways' readings a second time in every aggregation.
    pub fn matches_series(&self, labels: &SeriesLabels) -> bool {
        if !labels.fleet_wide() || self.names_fleet_wide(labels) {
            // Named by their Prometheus name, the readings have its labels alone.
            let native = self.native();
            let get = |label: &str| match label {
                "series" | "sensor" | "metric" if native => "",
                _ => labels.get(label),
            };
            (!native || self.accepts_name(&labels.native_name()))
                && self
                    .matchers
                    .iter()
                    .filter(|m| m.label != "__name__")
                    .all(|m| m.matches(get(&m.label)))
        } else {
            false
        }
    }

    pub(super) fn names_fleet_wide(&self, labels: &SeriesLabels) -> bool {
        self.matchers.iter().any(|m| {
            m.op == MatchOp::Equal
                && ((m.label == GATEWAY && m.value == FLEET_WIDE)
                    || (m.label == "series" && m.value == labels.series))
        })
    }

    /// On a query node, a `sensor` matcher written for the names before the gateway became a
    /// label (`sensor="gw1:boiler"`): it matches no series' sensor but some `<gateway>:<sensor>`.
    /// The text says what to write instead.
    pub fn old_fleet_sensor(&self, series: &[SeriesLabels]) -> Option<String> {
        let m = self.matchers.iter().find(|m| {
            m.label == "sensor"
                && matches!(m.op, MatchOp::Equal | MatchOp::Regex)
                && !series.iter().any(|l| m.matches(l.sensor))
                && series.iter().any(|l| {
                    l.gateway
                        .is_some_and(|g| m.matches(&format!("{g}:{}", l.sensor)))
                })
        })?;
        let op = if m.op == MatchOp::Equal { "=" } else { "=~" };
        let example = match m.value.split_once(':') {
            Some((g, sensor)) if m.op == MatchOp::Equal => {
                format!("{GATEWAY}=\"{g}\", sensor=\"{sensor}\"")
            }
            _ => format!("{GATEWAY}=~\"<gateways>\", sensor=~\"<sensors>\""),
        };
        Some(format!(
            "sensor{op}\"{}\": on a query node the gateway is a label of its own and `sensor` \
             is the sensor without it; write {example} (fleet-wide series: {GATEWAY}=\"*\")",
            m.value
        ))
    }
}

/// An aggregation operator: `sum by (sensor) (...)`, `topk(3, ...)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AggOp {
    Sum,
    Avg,
    Min,
    Max,
    Count,
    Stddev,
    Stdvar,
    /// `quantile(φ, v)`: the φ-quantile of each group, interpolated as type 7.
    Quantile,
    Topk,
    Bottomk,
    /// `group(v)`: 1 for each group that has a series at that time.
    Group,
    /// `count_values("label", v)`: per group and value, how many series have it, the value
    /// in `label`.
    CountValues,
}

impl AggOp {
    pub(super) fn of(name: &str) -> Option<AggOp> {
        Some(match name.to_ascii_lowercase().as_str() {
            "sum" => AggOp::Sum,
            "avg" => AggOp::Avg,
            "min" => AggOp::Min,
            "max" => AggOp::Max,
            "count" => AggOp::Count,
            "stddev" => AggOp::Stddev,
            "stdvar" => AggOp::Stdvar,
            "quantile" => AggOp::Quantile,
            "topk" => AggOp::Topk,
            "bottomk" => AggOp::Bottomk,
            "group" => AggOp::Group,
            "count_values" => AggOp::CountValues,
            _ => return None,
        })
    }

    /// Whether it takes a number before the vector.
    pub(super) fn takes_parameter(self) -> bool {
        matches!(
            self,
            AggOp::Quantile | AggOp::Topk | AggOp::Bottomk | AggOp::CountValues
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grouping {
    By(Vec<String>),
    Without(Vec<String>),
}

/// A function of a range of buckets at each time (`avg_over_time(v[1h])`), or of a vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Func {
    AvgOverTime,
    MinOverTime,
    MaxOverTime,
    SumOverTime,
    CountOverTime,
    LastOverTime,
    QuantileOverTime,
    StddevOverTime,
    StdvarOverTime,
    PresentOverTime,
    AbsentOverTime,
    /// `absent(v)`: 1 at each time `v` has no series.
    Absent,
    /// A function of each value of a vector (`abs(v)`, `round(v, 0.5)`, `clamp(v, 0, 100)`).
    Map(MathFn),
    /// The counter and trend functions: of the readings of a window with their times
    /// ([`Func::needs_times`]).
    Rate,
    Increase,
    Delta,
    Irate,
    Idelta,
    Changes,
    Resets,
    Deriv,
    /// `predict_linear(v[r], seconds)`.
    PredictLinear,
    /// `holt_winters(v[r], smoothing factor, trend factor)`.
    HoltWinters,
    /// `pi()`.
    Pi,
    /// `histogram_quantile(φ, v)`: over the series that differ only in `le`.
    HistogramQuantile,
    /// `label_replace(v, dst, replacement, src, regex)`.
    LabelReplace,
    /// `label_join(v, dst, separator, src...)`.
    LabelJoin,
    /// `time()`: the evaluation time, in seconds, a scalar at each time.
    Time,
    /// `vector(s)`: the scalar `s` as one series without labels.
    Vector,
    /// `scalar(v)`: the one value of `v` at each time, NaN where it has none or several.
    Scalar,
    /// The date functions of each value as seconds since the epoch, UTC (of `time()` without
    /// an argument).
    Date(DateFn),
    /// `timestamp(v)`: the time of each sample (a reading's own for a plain `bucketd_reading`
    /// selector, else the point's).
    Timestamp,
    /// `sort(v)`, `sort_desc(v)`: an instant answer ordered by value (NaN last).
    Sort,
    SortDesc,
}

/// `hour()` and the other date functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DateFn {
    Minute,
    Hour,
    DayOfWeek,
    DayOfMonth,
    DayOfYear,
    DaysInMonth,
    Month,
    Year,
}

impl DateFn {
    fn of(name: &str) -> Option<DateFn> {
        Some(match name {
            "minute" => DateFn::Minute,
            "hour" => DateFn::Hour,
            "day_of_week" => DateFn::DayOfWeek,
            "day_of_month" => DateFn::DayOfMonth,
            "day_of_year" => DateFn::DayOfYear,
            "days_in_month" => DateFn::DaysInMonth,
            "month" => DateFn::Month,
            "year" => DateFn::Year,
            _ => return None,
        })
    }

    /// Of `secs` seconds since the epoch, in UTC, as Go's `time` computes it (the fraction
    /// dropped); NaN for a time no calendar holds.
    pub fn apply(self, secs: f64) -> f64 {
        use chrono::{Datelike, Timelike};
        if !secs.is_finite() {
            return f64::NAN;
        }
        let Some(t) = chrono::DateTime::from_timestamp(secs as i64, 0) else {
            return f64::NAN;
        };
        f64::from(match self {
            DateFn::Minute => t.minute(),
            DateFn::Hour => t.hour(),
            DateFn::DayOfWeek => t.weekday().num_days_from_sunday(),
            DateFn::DayOfMonth => t.day(),
            DateFn::DayOfYear => t.ordinal(),
            DateFn::DaysInMonth => {
                let (y, m) = (t.year(), t.month());
                let next = if m == 12 {
                    chrono::NaiveDate::from_ymd_opt(y + 1, 1, 1)
                } else {
                    chrono::NaiveDate::from_ymd_opt(y, m + 1, 1)
                };
                next.and_then(|n| n.pred_opt()).map_or(0, |d| d.day())
            }
            DateFn::Month => t.month(),
            DateFn::Year => return f64::from(t.year()),
        })
    }
}

/// The functions of each value: Prometheus's math functions, computed as Go's `math` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MathFn {
    Abs,
    Ceil,
    Floor,
    Exp,
    Ln,
    Log2,
    Log10,
    Sqrt,
    Sgn,
    Deg,
    Rad,
    Sin,
    Cos,
    Tan,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Tanh,
    Asinh,
    Acosh,
    Atanh,
    /// `round(v, to_nearest = 1)`.
    Round,
    /// `clamp(v, min, max)`.
    Clamp,
    ClampMin,
    ClampMax,
}

impl MathFn {
    fn of(name: &str) -> Option<MathFn> {
        Some(match name {
            "abs" => MathFn::Abs,
            "ceil" => MathFn::Ceil,
            "floor" => MathFn::Floor,
            "exp" => MathFn::Exp,
            "ln" => MathFn::Ln,
            "log2" => MathFn::Log2,
            "log10" => MathFn::Log10,
            "sqrt" => MathFn::Sqrt,
            "sgn" => MathFn::Sgn,
            "deg" => MathFn::Deg,
            "rad" => MathFn::Rad,
            "sin" => MathFn::Sin,
            "cos" => MathFn::Cos,
            "tan" => MathFn::Tan,
            "asin" => MathFn::Asin,
            "acos" => MathFn::Acos,
            "atan" => MathFn::Atan,
            "sinh" => MathFn::Sinh,
            "cosh" => MathFn::Cosh,
            "tanh" => MathFn::Tanh,
            "asinh" => MathFn::Asinh,
            "acosh" => MathFn::Acosh,
            "atanh" => MathFn::Atanh,
            "round" => MathFn::Round,
            "clamp" => MathFn::Clamp,
            "clamp_min" => MathFn::ClampMin,
            "clamp_max" => MathFn::ClampMax,
            _ => return None,
        })
    }

    /// How many arguments it takes: the vector and its numbers (`round`'s second is optional).
    pub fn arity(self) -> std::ops::RangeInclusive<usize> {
        match self {
            MathFn::Round => 1..=2,
            MathFn::Clamp => 3..=3,
            MathFn::ClampMin | MathFn::ClampMax => 2..=2,
            _ => 1..=1,
        }
    }

    /// The function of one value `v`, with the numbers after the vector in `p`; `None` where
    /// Prometheus gives no point (clamp with max below min).
    pub fn apply(self, v: f64, p: &[f64]) -> Option<f64> {
        // Go's math.Max and math.Min: NaN if either is (Rust's ignore it).
        let max = |a: f64, b: f64| {
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                a.max(b)
            }
        };
        let min = |a: f64, b: f64| {
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                a.min(b)
            }
        };
        let arg = |i: usize, default: f64| p.get(i).copied().unwrap_or(default);
        Some(match self {
            MathFn::Abs => v.abs(),
            MathFn::Ceil => v.ceil(),
            MathFn::Floor => v.floor(),
            MathFn::Exp => v.exp(),
            MathFn::Ln => v.ln(),
            MathFn::Log2 => v.log2(),
            MathFn::Log10 => v.log10(),
            MathFn::Sqrt => v.sqrt(),
            MathFn::Sgn => {
                if v < 0.0 {
                    -1.0
                } else if v > 0.0 {
                    1.0
                } else {
                    v
                }
            }
            MathFn::Deg => v * 180.0 / std::f64::consts::PI,
            MathFn::Rad => v * std::f64::consts::PI / 180.0,
            MathFn::Sin => v.sin(),
            MathFn::Cos => v.cos(),
            MathFn::Tan => v.tan(),
            MathFn::Asin => v.asin(),
            MathFn::Acos => v.acos(),
            MathFn::Atan => v.atan(),
            MathFn::Sinh => v.sinh(),
            MathFn::Cosh => v.cosh(),
            MathFn::Tanh => v.tanh(),
            MathFn::Asinh => v.asinh(),
            MathFn::Acosh => v.acosh(),
            MathFn::Atanh => v.atanh(),
            MathFn::Round => {
                // As Prometheus: the inverse first, so that 0.1 rounds as 1/10 does.
                let inverse = 1.0 / arg(0, 1.0);
                (v * inverse + 0.5).floor() / inverse
            }
            MathFn::Clamp => {
                let (lo, hi) = (arg(0, f64::NAN), arg(1, f64::NAN));
                if hi < lo {
                    return None;
                }
                max(lo, min(hi, v))
            }
            MathFn::ClampMin => max(arg(0, f64::NAN), v),
            MathFn::ClampMax => min(arg(0, f64::NAN), v),
        })
    }
}

impl Func {
    pub(super) fn of(name: &str) -> Option<Func> {
        if let Some(m) = MathFn::of(name) {
            return Some(Func::Map(m));
        }
        if let Some(d) = DateFn::of(name) {
            return Some(Func::Date(d));
        }
        Some(match name {
            "avg_over_time" => Func::AvgOverTime,
            "min_over_time" => Func::MinOverTime,
            "max_over_time" => Func::MaxOverTime,
            "sum_over_time" => Func::SumOverTime,
            "count_over_time" => Func::CountOverTime,
            "last_over_time" => Func::LastOverTime,
            "quantile_over_time" => Func::QuantileOverTime,
            "stddev_over_time" => Func::StddevOverTime,
            "stdvar_over_time" => Func::StdvarOverTime,
            "present_over_time" => Func::PresentOverTime,
            "absent_over_time" => Func::AbsentOverTime,
            "absent" => Func::Absent,
            "rate" => Func::Rate,
            "increase" => Func::Increase,
            "delta" => Func::Delta,
            "irate" => Func::Irate,
            "idelta" => Func::Idelta,
            "changes" => Func::Changes,
            "resets" => Func::Resets,
            "deriv" => Func::Deriv,
            "predict_linear" => Func::PredictLinear,
            "holt_winters" => Func::HoltWinters,
            "pi" => Func::Pi,
            "histogram_quantile" => Func::HistogramQuantile,
            "time" => Func::Time,
            "label_replace" => Func::LabelReplace,
            "label_join" => Func::LabelJoin,
            "vector" => Func::Vector,
            "scalar" => Func::Scalar,
            "timestamp" => Func::Timestamp,
            "sort" => Func::Sort,
            "sort_desc" => Func::SortDesc,
            _ => return None,
        })
    }

    /// Whether it takes a range selector.
    pub fn over_time(self) -> bool {
        !matches!(
            self,
            Func::Absent
                | Func::Pi
                | Func::HistogramQuantile
                | Func::Map(_)
                | Func::Time
                | Func::Vector
                | Func::Scalar
                | Func::Date(_)
                | Func::LabelReplace
                | Func::LabelJoin
                | Func::Timestamp
                | Func::Sort
                | Func::SortDesc
        )
    }

    /// Its name in a query.
    pub fn name(self) -> String {
        match self {
            Func::PredictLinear => "predict_linear".into(),
            Func::Map(m) => format!("{m:?}").to_lowercase(),
            Func::Date(d) => Func::snake(&format!("{d:?}")),
            f => Func::snake(&format!("{f:?}")),
        }
    }

    /// A variant's name in a query: `AvgOverTime` is `avg_over_time`.
    fn snake(camel: &str) -> String {
        let mut out = String::new();
        for (i, c) in camel.chars().enumerate() {
            if c.is_ascii_uppercase() && i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        }
        out
    }

    /// Whether it needs the readings of its window with their times (a counter's resets, a
    /// trend's slope), which no bucket summary keeps: answered where the raw readings are.
    pub fn needs_times(self) -> bool {
        matches!(
            self,
            Func::Rate
                | Func::Increase
                | Func::Delta
                | Func::Irate
                | Func::Idelta
                | Func::Changes
                | Func::Resets
                | Func::Deriv
                | Func::PredictLinear
                | Func::HoltWinters
        )
    }
}

/// A binary operator, by PromQL's precedence from `^` (highest) to the comparisons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinOp {
    Pow,
    Mul,
    Div,
    Mod,
    /// `a atan2 b`: Go's `math.Atan2(a, b)`, at the precedence of `*`.
    Atan2,
    Add,
    Sub,
    Eq,
    Ne,
    Lt,
    Gt,
    Le,
    Ge,
    /// The set operators: series of the left side whose labels (by the matching) the right
    /// side has at that time (`and`), has not (`unless`), or both sides' (`or`).
    And,
    Or,
    Unless,
}

impl BinOp {
    /// `and`, `or`, `unless`: between series only, by label sets, values untouched.
    pub fn is_set(self) -> bool {
        matches!(self, BinOp::And | BinOp::Or | BinOp::Unless)
    }

    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Gt | BinOp::Le | BinOp::Ge
        )
    }

    /// `a op b`: the value, or for a comparison 1 (true) or 0 (false).
    pub fn apply(self, a: f64, b: f64) -> f64 {
        let truth = |t: bool| if t { 1.0 } else { 0.0 };
        match self {
            BinOp::Pow => a.powf(b),
            BinOp::Mul => a * b,
            BinOp::Div => a / b,
            BinOp::Mod => a % b,
            BinOp::Atan2 => a.atan2(b),
            BinOp::Add => a + b,
            BinOp::Sub => a - b,
            BinOp::Eq => truth(a == b),
            BinOp::Ne => truth(a != b),
            BinOp::Lt => truth(a < b),
            BinOp::Gt => truth(a > b),
            BinOp::Le => truth(a <= b),
            BinOp::Ge => truth(a >= b),
            // Never between numbers (refused when parsed): no value of its own.
            BinOp::And | BinOp::Or | BinOp::Unless => f64::NAN,
        }
    }
}

/// `group_left (...)` or `group_right (...)` after the matching: many series of one side to
/// one of the other, with the listed labels copied from the one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// `group_right`: the right side is the many.
    pub right: bool,
    pub include: Vec<String>,
}

/// How two vectors' series pair up: by every label but `__name__`, or `on (..)` / `ignoring (..)`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Matching {
    #[default]
    All,
    On(Vec<String>),
    Ignoring(Vec<String>),
}

/// A series selector with what PromQL puts after it: a range (`[1h]`, seconds) and an offset
/// (seconds, positive into the past).
#[derive(Debug, Clone)]
pub struct Select {
    pub selector: Selector,
    pub range_secs: Option<i64>,
    pub offset_secs: i64,
    /// `@ t`: evaluated at that time (before the offset) whatever the point's time.
    pub at: Option<At>,
}

impl Select {
    /// The time (ms) the selector is taken at for the point at `t`: its `@` time, or `t`, moved
    /// back by its offset. `@ start()` and `@ end()` are resolved before evaluating.
    pub fn time(&self, t: i64) -> i64 {
        let at = match self.at {
            Some(At::Ms(ms)) => ms,
            _ => t,
        };
        at.saturating_sub(self.offset_secs.saturating_mul(1000))
    }
}

/// The time after `@`: a number of seconds (kept in ms), or the query's start or end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    Ms(i64),
    Start,
    End,
}

impl At {
    /// Resolved against a query from `start` to `end` (ms).
    #[must_use]
    pub fn resolve(self, start: i64, end: i64) -> At {
        match self {
            At::Start => At::Ms(start),
            At::End => At::Ms(end),
            at @ At::Ms(_) => at,
        }
    }
}

/// A subquery, `inner[range:step]`: `inner` evaluated at every multiple of `step` (ms; the
/// default evaluation interval when `None`) within each point's window, as a range selector.
#[derive(Debug, Clone)]
pub struct Subquery {
    pub inner: Expr,
    pub range_ms: i64,
    pub step_ms: Option<i64>,
    pub offset_secs: i64,
    pub at: Option<At>,
}

/// A subquery's step when it names none: Prometheus's default `evaluation_interval`.
pub const SUBQUERY_STEP_MS: i64 = 60_000;

/// A parsed query.
#[derive(Debug, Clone)]
pub enum Expr {
    Number(f64),
    /// A string: only as an argument of `label_replace` and `label_join`.
    Str(String),
    Select(Select),
    Call(Func, Vec<Expr>),
    Aggregate {
        op: AggOp,
        parameter: Option<Box<Expr>>,
        grouping: Grouping,
        inner: Box<Expr>,
    },
    Binary {
        op: BinOp,
        /// `bool` after a comparison: 0 or 1 instead of filtering.
        bool_result: bool,
        matching: Matching,
        group: Option<Group>,
        lhs: Box<Expr>,
        rhs: Box<Expr>,
    },
    Negate(Box<Expr>),
    /// Only as a range function's argument.
    Subquery(Box<Subquery>),
}

impl Expr {
    /// `@ start()` and `@ end()` made the query's times (ms), everywhere in it.
    pub fn resolve_at(&mut self, start: i64, end: i64) {
        match self {
            Expr::Number(_) | Expr::Str(_) => {}
            Expr::Select(s) => s.at = s.at.map(|a| a.resolve(start, end)),
            Expr::Call(_, args) => args.iter_mut().for_each(|a| a.resolve_at(start, end)),
            Expr::Aggregate {
                parameter, inner, ..
            } => {
                if let Some(p) = parameter {
                    p.resolve_at(start, end);
                }
                inner.resolve_at(start, end);
            }
            Expr::Binary { lhs, rhs, .. } => {
                lhs.resolve_at(start, end);
                rhs.resolve_at(start, end);
            }
            Expr::Negate(e) => e.resolve_at(start, end),
            Expr::Subquery(q) => {
                q.at = q.at.map(|a| a.resolve(start, end));
                q.inner.resolve_at(start, end);
            }
        }
    }

    /// The text of a string literal.
    pub fn string(&self) -> Option<&str> {
        match self {
            Expr::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value of a query of numbers alone (`1+1`, Grafana's health check); `None` when it
    /// selects series.
    pub fn number(&self) -> Option<f64> {
        match self {
            Expr::Number(n) => Some(*n),
            Expr::Negate(e) => e.number().map(|n| -n),
            Expr::Binary {
                op,
                lhs,
                rhs,
                bool_result,
                ..
            } if !op.is_set() && (!op.is_comparison() || *bool_result) => {
                Some(op.apply(lhs.number()?, rhs.number()?))
            }
            _ => None,
        }
    }
}
