//! The part of PromQL that bucketd answers, over its buckets: parsing here, evaluating a query
//! at a grid of times in [`eval`]. Pure (the caller reads the buckets).
//!
//! What is supported (docs/PROMETHEUS.md): selectors of the metrics `bucketd_bucket_<field>`
//! with the labels `series`, `sensor` and `metric` (`=`, `!=`, `=~`, `!~`), with `offset`; the
//! readings themselves as `bucketd_reading` inside range functions; the `*_over_time` functions
//! over a whole number of buckets, `absent` and `absent_over_time`; the aggregations `sum`,
//! `avg`, `min`, `max`, `count`, `stddev`, `stdvar`, `quantile`, `topk` and `bottomk` with `by`
//! or `without`; arithmetic (`+ - * / % ^`) and comparisons (`== != < > <= >=`, with `bool`)
//! between numbers and series or between series (one to one, `on` / `ignoring`). Anything else
//! is an error that names what is not supported.

use std::collections::BTreeMap;

use crate::summary::Summary;

/// Longest query text.
pub const QUERY_BYTES_MAX: usize = 4096;
/// Most compiled size of one regular expression (the regex engine's limit): with at most
/// [`MATCHERS_MAX`] matchers per selector, what a client's query compiles stays small. Label
/// filters (`boil.*|attic`) take a few KiB; matching is linear in the input anyway.
const REGEX_SIZE_MAX: usize = 32 * 1024;
/// Most label matchers in one selector.
pub const MATCHERS_MAX: usize = 8;
/// Deepest nesting of parentheses, signs and aggregations in a query.
const NESTING_MAX: usize = 64;
/// Deepest nesting in a regular expression.
const REGEX_NESTING_MAX: u32 = 64;
/// Most points per series in one answer, as Prometheus refuses more.
pub const POINTS_PER_SERIES_MAX: u64 = 11_000;

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
enum MatchOp {
    Equal,
    NotEqual,
    Regex,
    NotRegex,
}

/// One label matcher: `label op "value"`.
#[derive(Debug, Clone)]
pub struct Matcher {
    label: String,
    op: MatchOp,
    value: String,
    /// The anchored expression, for `=~` and `!~`.
    regex: Option<regex_lite::Regex>,
}

impl Matcher {
    fn new(label: String, op: MatchOp, value: String) -> Result<Matcher, String> {
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

    fn matches(&self, value: &str) -> bool {
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
    matchers: Vec<Matcher>,
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

    fn get(&self, label: &str) -> &'a str {
        match label {
            "series" => self.series,
            "sensor" => self.sensor,
            "metric" => self.metric,
            GATEWAY => self.gateway.unwrap_or(""),
            // Prometheus: a label a series does not have has the empty value.
            _ => "",
        }
    }

    /// All labels of the metric `field` of this series.
    pub fn with_name(&self, field: Field) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::from([
            ("__name__".to_owned(), field.metric_name().to_owned()),
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

/// The metric whose samples are the readings themselves: inside a range function the buckets
/// of the range merge exactly (`quantile_over_time(0.99, bucketd_reading{..}[1d])` is the p99
/// of the day's readings); as a plain selector, the last raw reading within [`LOOKBACK_MS`].
pub const READINGS: &str = "bucketd_reading";

/// How far back a plain `bucketd_reading` selector looks for a reading unless told
/// (`http.lookback`, [`Grid::looking_back`]): Prometheus's default look-back delta, 5 minutes.
pub const LOOKBACK_MS: i64 = 5 * 60 * 1000;

impl Selector {
    /// Whether the `__name__` matchers accept [`READINGS`].
    pub fn selects_readings(&self) -> bool {
        self.matchers
            .iter()
            .filter(|m| m.label == "__name__")
            .all(|m| m.matches(READINGS))
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
        (!labels.fleet_wide() || self.names_fleet_wide(labels))
            && self
                .matchers
                .iter()
                .filter(|m| m.label != "__name__")
                .all(|m| m.matches(labels.get(&m.label)))
    }

    fn names_fleet_wide(&self, labels: &SeriesLabels) -> bool {
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
}

impl AggOp {
    fn of(name: &str) -> Option<AggOp> {
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
            _ => return None,
        })
    }

    /// Whether it takes a number before the vector.
    fn takes_parameter(self) -> bool {
        matches!(self, AggOp::Quantile | AggOp::Topk | AggOp::Bottomk)
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
}

impl Func {
    fn of(name: &str) -> Option<Func> {
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
            _ => return None,
        })
    }

    /// Whether its (last) argument is a range selector.
    pub fn over_time(self) -> bool {
        self != Func::Absent
    }
}

/// A binary operator, by PromQL's precedence from `^` (highest) to the comparisons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinOp {
    Pow,
    Mul,
    Div,
    Mod,
    Add,
    Sub,
    Eq,
    Ne,
    Lt,
    Gt,
    Le,
    Ge,
}

impl BinOp {
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
            BinOp::Add => a + b,
            BinOp::Sub => a - b,
            BinOp::Eq => truth(a == b),
            BinOp::Ne => truth(a != b),
            BinOp::Lt => truth(a < b),
            BinOp::Gt => truth(a > b),
            BinOp::Le => truth(a <= b),
            BinOp::Ge => truth(a >= b),
        }
    }
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
}

/// A parsed query.
#[derive(Debug, Clone)]
pub enum Expr {
    Number(f64),
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
        lhs: Box<Expr>,
        rhs: Box<Expr>,
    },
    Negate(Box<Expr>),
}

impl Expr {
    /// The selectors in the query, in order.
    pub fn selects(&self) -> Vec<&Select> {
        let mut out = Vec::new();
        self.walk(&mut |e| {
            if let Expr::Select(s) = e {
                out.push(s);
            }
        });
        out
    }

    fn walk<'a>(&'a self, f: &mut impl FnMut(&'a Expr)) {
        f(self);
        match self {
            Expr::Number(_) | Expr::Select(_) => {}
            Expr::Call(_, args) => args.iter().for_each(|a| a.walk(f)),
            Expr::Aggregate {
                parameter, inner, ..
            } => {
                if let Some(p) = parameter {
                    p.walk(f);
                }
                inner.walk(f);
            }
            Expr::Binary { lhs, rhs, .. } => {
                lhs.walk(f);
                rhs.walk(f);
            }
            Expr::Negate(e) => e.walk(f),
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
            } if !op.is_comparison() || *bool_result => {
                Some(op.apply(lhs.number()?, rhs.number()?))
            }
            _ => None,
        }
    }
}

/// Parses a series selector as the label and series endpoints take it in `match[]`: any
/// selector, `bucketd_reading` included (it names series there, not samples).
pub fn parse_series_selector(text: &str) -> Result<Selector, String> {
    if text.len() > QUERY_BYTES_MAX {
        return Err(format!(
            "the selector is longer than {QUERY_BYTES_MAX} bytes"
        ));
    }
    let mut p = Parser {
        tokens: lex(text)?,
        at: 0,
        depth: 0,
    };
    let expr = p.expr()?;
    match (expr, p.peek()) {
        (
            Expr::Select(Select {
                selector,
                range_secs: None,
                offset_secs: 0,
            }),
            None,
        ) => Ok(selector),
        _ => Err(format!("`{text}` is not a series selector")),
    }
}

/// Parses `text`. The error says what is wrong or not supported, for a `bad_data` answer.
pub fn parse(text: &str) -> Result<Expr, String> {
    if text.len() > QUERY_BYTES_MAX {
        return Err(format!("the query is longer than {QUERY_BYTES_MAX} bytes"));
    }
    let tokens = lex(text)?;
    let mut p = Parser {
        tokens,
        at: 0,
        depth: 0,
    };
    let expr = p.expr()?;
    if let Some(t) = p.peek() {
        return Err(format!("unexpected {} after the expression", t.describe()));
    }
    check(&expr, false)?;
    Ok(expr)
}

/// What PromQL's types allow: a range selector only as a range function's argument, a range
/// function's argument a range selector of its own, parameters numbers, a comparison of two
/// numbers only with `bool`.
fn check(expr: &Expr, range_allowed: bool) -> Result<(), String> {
    match expr {
        Expr::Number(_) => Ok(()),
        Expr::Select(s) => match (s.range_secs.is_some(), range_allowed) {
            (true, false) => Err("a range selector ([1h]) goes inside a range function like \
                 avg_over_time(bucketd_reading{series=\"boiler/temp\"}[1h])"
                .into()),
            (false, true) => Err("this function takes a range selector, like x[1h]".into()),
            _ => Ok(()),
        },
        Expr::Call(func, args) => {
            let want = if *func == Func::QuantileOverTime {
                2
            } else {
                1
            };
            if args.len() != want {
                return Err(format!(
                    "the function takes {want} argument(s), got {}",
                    args.len()
                ));
            }
            if *func == Func::QuantileOverTime && args[0].number().is_none() {
                return Err("quantile_over_time's first argument must be a number".into());
            }
            check(&args[want - 1], func.over_time())
        }
        Expr::Aggregate {
            op,
            parameter,
            inner,
            ..
        } => {
            if op.takes_parameter() != parameter.is_some() {
                return Err(format!(
                    "{op:?} takes {} parameter",
                    if op.takes_parameter() { "a" } else { "no" }
                )
                .to_lowercase());
            }
            if parameter.as_ref().is_some_and(|p| p.number().is_none()) {
                return Err("an aggregation's parameter must be a number".into());
            }
            if inner.number().is_some() {
                return Err("an aggregation takes series, not a number".into());
            }
            check(inner, false)
        }
        Expr::Binary {
            op,
            bool_result,
            lhs,
            rhs,
            ..
        } => {
            if op.is_comparison()
                && !bool_result
                && lhs.number().is_some()
                && rhs.number().is_some()
            {
                return Err("comparisons between numbers must use the bool modifier".into());
            }
            check(lhs, false)?;
            check(rhs, false)
        }
        Expr::Negate(e) => check(e, false),
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Number(f64),
    /// A duration, in milliseconds (`5m`, `1h30m`).
    Duration(i64),
    Str(String),
    LBrace,
    RBrace,
    LParen,
    RParen,
    LBracket,
    RBracket,
    Comma,
    Eq,
    EqEq,
    Ne,
    Lt,
    Gt,
    Le,
    Ge,
    ReMatch,
    ReNotMatch,
    Plus,
    Minus,
    Star,
    Slash,
    Percent,
    Caret,
    /// Anything else PromQL has (`@`, `:` in a subquery, ...): not supported here.
    Unsupported(String),
}

impl Token {
    fn describe(&self) -> String {
        match self {
            Token::Ident(s) | Token::Unsupported(s) => format!("`{s}`"),
            Token::Number(n) => format!("number {n}"),
            Token::Duration(ms) => format!("duration {ms}ms"),
            Token::Str(s) => format!("string {s:?}"),
            other => format!("`{}`", other.symbol()),
        }
    }

    fn symbol(&self) -> &'static str {
        match self {
            Token::LBrace => "{",
            Token::RBrace => "}",
            Token::LParen => "(",
            Token::RParen => ")",
            Token::LBracket => "[",
            Token::RBracket => "]",
            Token::Comma => ",",
            Token::Eq => "=",
            Token::EqEq => "==",
            Token::Ne => "!=",
            Token::Lt => "<",
            Token::Gt => ">",
            Token::Le => "<=",
            Token::Ge => ">=",
            Token::ReMatch => "=~",
            Token::ReNotMatch => "!~",
            Token::Plus => "+",
            Token::Minus => "-",
            Token::Star => "*",
            Token::Slash => "/",
            Token::Percent => "%",
            Token::Caret => "^",
            _ => "",
        }
    }

    fn binary(&self) -> Option<BinOp> {
        Some(match self {
            Token::Caret => BinOp::Pow,
            Token::Star => BinOp::Mul,
            Token::Slash => BinOp::Div,
            Token::Percent => BinOp::Mod,
            Token::Plus => BinOp::Add,
            Token::Minus => BinOp::Sub,
            Token::EqEq => BinOp::Eq,
            Token::Ne => BinOp::Ne,
            Token::Lt => BinOp::Lt,
            Token::Gt => BinOp::Gt,
            Token::Le => BinOp::Le,
            Token::Ge => BinOp::Ge,
            _ => return None,
        })
    }
}

fn lex(text: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let (token, len) = match c {
            c if c.is_whitespace() => {
                i += 1;
                continue;
            }
            '#' => break, // a comment to the end: PromQL allows them; one line is all we get
            '{' => (Token::LBrace, 1),
            '}' => (Token::RBrace, 1),
            '(' => (Token::LParen, 1),
            ')' => (Token::RParen, 1),
            '[' => (Token::LBracket, 1),
            ']' => (Token::RBracket, 1),
            ',' => (Token::Comma, 1),
            '+' => (Token::Plus, 1),
            '-' => (Token::Minus, 1),
            '*' => (Token::Star, 1),
            '/' => (Token::Slash, 1),
            '%' => (Token::Percent, 1),
            '^' => (Token::Caret, 1),
            '=' if next == Some('~') => (Token::ReMatch, 2),
            '=' if next == Some('=') => (Token::EqEq, 2),
            '=' => (Token::Eq, 1),
            '!' if next == Some('=') => (Token::Ne, 2),
            '!' if next == Some('~') => (Token::ReNotMatch, 2),
            '<' if next == Some('=') => (Token::Le, 2),
            '<' => (Token::Lt, 1),
            '>' if next == Some('=') => (Token::Ge, 2),
            '>' => (Token::Gt, 1),
            '"' | '\'' | '`' => {
                let (s, len) = string(&chars[i..])?;
                (Token::Str(s), len)
            }
            c if c.is_ascii_digit() || (c == '.' && next.is_some_and(|n| n.is_ascii_digit())) => {
                let len = chars[i..]
                    .iter()
                    .enumerate()
                    .take_while(|(k, d)| {
                        d.is_ascii_alphanumeric()
                            || **d == '.'
                            || ((**d == '+' || **d == '-')
                                && *k > 0
                                && matches!(chars[i + k - 1], 'e' | 'E'))
                    })
                    .count();
                let word: String = chars[i..i + len].iter().collect();
                let token = match word.parse::<f64>() {
                    Ok(n) => Token::Number(n),
                    Err(_) => parse_duration(&word)
                        .map_or_else(|_| Token::Unsupported(word), Token::Duration),
                };
                (token, len)
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let len = chars[i..]
                    .iter()
                    .take_while(|d| d.is_ascii_alphanumeric() || **d == '_' || **d == ':')
                    .count();
                let word: String = chars[i..i + len].iter().collect();
                let token = match word.to_ascii_lowercase().as_str() {
                    "inf" => Token::Number(f64::INFINITY),
                    "nan" => Token::Number(f64::NAN),
                    _ => Token::Ident(word),
                };
                (token, len)
            }
            other => (Token::Unsupported(other.to_string()), 1),
        };
        out.push(token);
        i += len;
    }
    Ok(out)
}

/// A quoted string at the start of `chars`, with PromQL's (Go's) escapes; backquotes take none.
/// Returns the text and the characters it took.
fn string(chars: &[char]) -> Result<(String, usize), String> {
    let quote = chars[0];
    let mut out = String::new();
    let mut i = 1;
    while i < chars.len() {
        let c = chars[i];
        if c == quote {
            return Ok((out, i + 1));
        }
        if c == '\\' && quote != '`' {
            let e = chars.get(i + 1).copied().ok_or("unterminated string")?;
            match e {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                'r' => out.push('\r'),
                '\\' | '"' | '\'' => out.push(e),
                // Regular expressions keep their own escapes: `\.` stays `\.`.
                other => {
                    out.push('\\');
                    out.push(other);
                }
            }
            i += 2;
            continue;
        }
        out.push(c);
        i += 1;
    }
    Err("unterminated string".into())
}

struct Parser {
    tokens: Vec<Token>,
    at: usize,
    /// Operands being parsed inside each other (parentheses, signs, calls, aggregations: each
    /// passes through [`Parser::unary`]).
    depth: usize,
}

/// The binary operators of each precedence level, lowest first; `^` is the last, and binds
/// to the right.
const LEVELS: [&[BinOp]; 4] = [
    &[
        BinOp::Eq,
        BinOp::Ne,
        BinOp::Lt,
        BinOp::Gt,
        BinOp::Le,
        BinOp::Ge,
    ],
    &[BinOp::Add, BinOp::Sub],
    &[BinOp::Mul, BinOp::Div, BinOp::Mod],
    &[BinOp::Pow],
];

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn next(&mut self) -> Option<Token> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t
    }

    fn peek_ident(&self, word: &str) -> bool {
        matches!(self.peek(), Some(Token::Ident(w)) if w.eq_ignore_ascii_case(word))
    }

    fn expect(&mut self, want: &Token) -> Result<(), String> {
        match self.next() {
            Some(t) if &t == want => Ok(()),
            Some(t) => Err(format!(
                "expected `{}`, found {}",
                want.symbol(),
                t.describe()
            )),
            None => Err(format!(
                "expected `{}` at the end of the query",
                want.symbol()
            )),
        }
    }

    fn expr(&mut self) -> Result<Expr, String> {
        self.level(0)
    }

    /// Operands joined by the operators of `LEVELS[level]`, left to right (`^`: right).
    fn level(&mut self, level: usize) -> Result<Expr, String> {
        if level == LEVELS.len() - 1 {
            let base = self.postfix()?;
            if self.peek().and_then(Token::binary) != Some(BinOp::Pow) {
                return Ok(base);
            }
            self.at += 1;
            let (bool_result, matching) = self.modifiers(BinOp::Pow)?;
            let exponent = self.unary()?;
            return Ok(binary(BinOp::Pow, bool_result, matching, base, exponent));
        }
        let mut acc = if level == 2 {
            self.unary()?
        } else {
            self.level(level + 1)?
        };
        while let Some(op) = self
            .peek()
            .and_then(Token::binary)
            .filter(|op| LEVELS[level].contains(op))
        {
            self.at += 1;
            let (bool_result, matching) = self.modifiers(op)?;
            let rhs = if level == 2 {
                self.unary()?
            } else {
                self.level(level + 1)?
            };
            acc = binary(op, bool_result, matching, acc, rhs);
        }
        Ok(acc)
    }

    /// `bool`, then `on (..)` or `ignoring (..)`, after a binary operator.
    fn modifiers(&mut self, op: BinOp) -> Result<(bool, Matching), String> {
        let bool_result = self.peek_ident("bool");
        if bool_result {
            if !op.is_comparison() {
                return Err("bool goes only after a comparison operator".into());
            }
            self.at += 1;
        }
        let matching = if self.peek_ident("on") {
            self.at += 1;
            Matching::On(self.labels()?)
        } else if self.peek_ident("ignoring") {
            self.at += 1;
            Matching::Ignoring(self.labels()?)
        } else {
            Matching::All
        };
        if self.peek_ident("group_left") || self.peek_ident("group_right") {
            return Err(
                "group_left and group_right (many-to-one matching) are not supported: bucketd \
                 matches series one to one"
                    .into(),
            );
        }
        Ok((bool_result, matching))
    }

    /// Every nesting passes here: the depth is bounded, so that no query can overflow the stack.
    fn unary(&mut self) -> Result<Expr, String> {
        if self.depth >= NESTING_MAX {
            return Err(format!("the query nests deeper than {NESTING_MAX} levels"));
        }
        self.depth += 1;
        let operand = match self.peek() {
            Some(Token::Minus) => {
                self.at += 1;
                self.unary().map(|e| Expr::Negate(Box::new(e)))
            }
            Some(Token::Plus) => {
                self.at += 1;
                self.unary()
            }
            _ => self.level(LEVELS.len() - 1),
        };
        self.depth -= 1;
        operand
    }

    /// A primary expression with a range (`[1h]`) and an offset (`offset 1d`) after it.
    fn postfix(&mut self) -> Result<Expr, String> {
        let mut expr = self.primary()?;
        if matches!(self.peek(), Some(Token::LBracket)) {
            self.at += 1;
            let ms = match self.next() {
                Some(Token::Duration(ms)) => ms,
                Some(Token::Number(n)) => (n * 1000.0) as i64,
                other => {
                    return Err(format!(
                        "expected a duration like 1h in [..], found {}",
                        other.map_or("the end".into(), |t| t.describe())
                    ));
                }
            };
            if matches!(self.peek(), Some(Token::Ident(s)) if s.starts_with(':')) {
                return Err("subqueries ([1h:5m]) are not supported".into());
            }
            self.expect(&Token::RBracket)?;
            let Expr::Select(s) = &mut expr else {
                return Err("a range ([1h]) goes after a series selector".into());
            };
            if ms <= 0 || ms % 1000 != 0 {
                return Err("a range must be a positive whole number of seconds".into());
            }
            s.range_secs = Some(ms / 1000);
        }
        if self.peek_ident("offset") {
            self.at += 1;
            let sign = if matches!(self.peek(), Some(Token::Minus)) {
                self.at += 1;
                -1
            } else {
                1
            };
            let ms = match self.next() {
                Some(Token::Duration(ms)) => ms,
                other => {
                    return Err(format!(
                        "expected a duration after offset, found {}",
                        other.map_or("the end".into(), |t| t.describe())
                    ));
                }
            };
            let Expr::Select(s) = &mut expr else {
                return Err("offset goes after a series selector".into());
            };
            if ms % 1000 != 0 {
                return Err("an offset must be a whole number of seconds".into());
            }
            s.offset_secs = sign * ms / 1000;
        }
        if let Some(t @ Token::Unsupported(_)) = self.peek() {
            return Err(format!("{} is not supported here", t.describe()));
        }
        Ok(expr)
    }

    fn primary(&mut self) -> Result<Expr, String> {
        match self.next() {
            Some(Token::Number(n)) => Ok(Expr::Number(n)),
            Some(Token::LParen) => {
                let inner = self.expr()?;
                self.expect(&Token::RParen)?;
                Ok(inner)
            }
            Some(Token::LBrace) => Ok(select(self.selector(None)?)),
            Some(Token::Ident(name)) => self.named(name),
            Some(t) => Err(format!("unexpected {}", t.describe())),
            None => Err("the query is empty or ends too early".into()),
        }
    }

    /// A metric name, an aggregation or a function. Aggregation keywords, as `by` and
    /// `without`, are case-insensitive (as in Prometheus: `SUM BY (sensor) (...)`).
    fn named(&mut self, name: String) -> Result<Expr, String> {
        let followed_by_group = matches!(self.peek(), Some(Token::LParen))
            || self.peek_ident("by")
            || self.peek_ident("without");
        if let Some(op) = AggOp::of(&name).filter(|_| followed_by_group) {
            return self.aggregate(op);
        }
        if matches!(self.peek(), Some(Token::LParen)) {
            let Some(func) = Func::of(&name) else {
                return Err(format!(
                    "the function `{name}` is not supported: bucketd answers the *_over_time \
                     functions (avg, min, max, sum, count, last, quantile, stddev, stdvar, \
                     present, absent) and absent (docs/PROMETHEUS.md)"
                ));
            };
            self.at += 1;
            let args = self.arguments()?;
            return Ok(Expr::Call(func, args));
        }
        let selector = if matches!(self.peek(), Some(Token::LBrace)) {
            self.at += 1;
            self.selector(Some(name))?
        } else {
            let name_matcher = Matcher::new("__name__".into(), MatchOp::Equal, name)?;
            Selector {
                matchers: vec![name_matcher],
            }
        };
        Ok(select(selector))
    }

    /// Comma-separated expressions up to `)` (the `(` taken). Each one passes through
    /// [`Parser::unary`], which bounds the nesting.
    fn arguments(&mut self) -> Result<Vec<Expr>, String> {
        let mut args = Vec::new();
        let result = loop {
            if matches!(self.peek(), Some(Token::RParen)) && args.is_empty() {
                self.at += 1;
                break Ok(());
            }
            match self.expr() {
                Ok(e) => args.push(e),
                Err(e) => break Err(e),
            }
            match self.next() {
                Some(Token::Comma) => {}
                Some(Token::RParen) => break Ok(()),
                other => {
                    break Err(format!(
                        "expected `,` or `)`, found {}",
                        other.map_or("the end of the query".into(), |t| t.describe())
                    ));
                }
            }
        };
        result.map(|()| args)
    }

    fn aggregate(&mut self, op: AggOp) -> Result<Expr, String> {
        let mut grouping = self.grouping()?;
        self.expect(&Token::LParen)?;
        let mut args = self.arguments()?;
        if grouping.is_none() {
            grouping = self.grouping()?;
        }
        let want = if op.takes_parameter() { 2 } else { 1 };
        if args.len() != want {
            return Err(format!(
                "{} takes {want} argument(s), like {}",
                format!("{op:?}").to_lowercase(),
                if op.takes_parameter() {
                    "topk(3, bucketd_bucket_max)"
                } else {
                    "avg by (sensor) (bucketd_bucket_mean{metric=\"temperature\"})"
                }
            ));
        }
        let inner = args.pop().expect("one argument at least");
        Ok(Expr::Aggregate {
            op,
            parameter: args.pop().map(Box::new),
            grouping: grouping.unwrap_or(Grouping::By(Vec::new())),
            inner: Box::new(inner),
        })
    }

    fn grouping(&mut self) -> Result<Option<Grouping>, String> {
        let without = if self.peek_ident("by") {
            false
        } else if self.peek_ident("without") {
            true
        } else {
            return Ok(None);
        };
        self.at += 1;
        let labels = self.labels()?;
        Ok(Some(if without {
            Grouping::Without(labels)
        } else {
            Grouping::By(labels)
        }))
    }

    /// `(label, ...)`.
    fn labels(&mut self) -> Result<Vec<String>, String> {
        match self.next() {
            Some(Token::LParen) => {}
            other => return Err(grouping_error(other)),
        }
        let mut labels = Vec::new();
        loop {
            match self.next() {
                Some(Token::RParen) => break,
                Some(Token::Ident(l)) => {
                    labels.push(l);
                    match self.next() {
                        Some(Token::Comma) => {}
                        Some(Token::RParen) => break,
                        other => return Err(grouping_error(other)),
                    }
                }
                other => return Err(grouping_error(other)),
            }
        }
        Ok(labels)
    }

    /// The matchers after `{`, up to and including `}`.
    fn selector(&mut self, name: Option<String>) -> Result<Selector, String> {
        let mut matchers = Vec::new();
        let named = name.is_some();
        if let Some(name) = name {
            matchers.push(Matcher::new("__name__".into(), MatchOp::Equal, name)?);
        }
        loop {
            let label = match self.next() {
                Some(Token::RBrace) => break,
                Some(Token::Ident(l)) => l,
                other => return Err(matcher_error(other)),
            };
            let op = match self.next() {
                Some(Token::Eq) => MatchOp::Equal,
                Some(Token::Ne) => MatchOp::NotEqual,
                Some(Token::ReMatch) => MatchOp::Regex,
                Some(Token::ReNotMatch) => MatchOp::NotRegex,
                other => return Err(matcher_error(other)),
            };
            let Some(Token::Str(value)) = self.next() else {
                return Err(format!(
                    "label matcher {label}: the value must be a quoted string"
                ));
            };
            // Label matchers between the braces (a metric name before them is not one).
            if matchers.len() - usize::from(named) >= MATCHERS_MAX {
                return Err(format!(
                    "a selector may have at most {MATCHERS_MAX} label matchers"
                ));
            }
            matchers.push(Matcher::new(label, op, value)?);
            match self.next() {
                Some(Token::Comma) => {}
                Some(Token::RBrace) => break,
                other => return Err(matcher_error(other)),
            }
        }
        // Prometheus's rule: a selector that matches everything is refused.
        if matchers.iter().all(|m| m.matches("")) {
            return Err(
                "a selector needs a metric name or a label matcher that does not match the \
                 empty value, like {sensor=\"boiler\"}"
                    .into(),
            );
        }
        Ok(Selector { matchers })
    }
}

fn binary(op: BinOp, bool_result: bool, matching: Matching, lhs: Expr, rhs: Expr) -> Expr {
    Expr::Binary {
        op,
        bool_result,
        matching,
        lhs: Box::new(lhs),
        rhs: Box::new(rhs),
    }
}

fn select(selector: Selector) -> Expr {
    Expr::Select(Select {
        selector,
        range_secs: None,
        offset_secs: 0,
    })
}

fn matcher_error(found: Option<Token>) -> String {
    let found = found.map_or("the end of the query".into(), |t| t.describe());
    format!("expected a label matcher like sensor=\"boiler\" or `}}`, found {found}")
}

fn grouping_error(found: Option<Token>) -> String {
    let found = found.map_or("the end of the query".into(), |t| t.describe());
    format!("expected a label list like by (sensor, metric), found {found}")
}

/// A value as Prometheus writes it in JSON: `"21.5"`, `"NaN"`, `"+Inf"`.
pub fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}

/// A time in milliseconds as Prometheus writes it: seconds, with the milliseconds when there
/// are any.
pub fn format_time(ms: i64) -> serde_json::Value {
    if ms % 1000 == 0 {
        serde_json::Value::from(ms / 1000)
    } else {
        serde_json::Value::from(ms as f64 / 1000.0)
    }
}

/// Parses a time parameter: float seconds since the epoch or RFC 3339. Milliseconds.
pub fn parse_time(text: &str) -> Result<i64, String> {
    if let Ok(secs) = text.parse::<f64>() {
        let ms = (secs * 1000.0).round();
        // Prometheus's own range: what an i64 of milliseconds holds, and finite.
        if ms.is_finite() && ms.abs() < 9.2e18 {
            return Ok(ms as i64);
        }
    } else if let Some(t) = crate::reading::Timestamp::parse(text) {
        return Ok(t.as_nanos().div_euclid(1_000_000));
    }
    Err(format!(
        "cannot parse {text:?} to a valid timestamp (float seconds or RFC 3339)"
    ))
}

/// Parses a duration parameter (`step`): float seconds, or Prometheus's units (`90s`, `1h30m`,
/// `1d`, `1w`, `1y` = 365 days, `500ms`). Milliseconds.
pub fn parse_duration(text: &str) -> Result<i64, String> {
    let bad = || format!("cannot parse {text:?} to a valid duration");
    if let Ok(secs) = text.parse::<f64>() {
        let ms = (secs * 1000.0).round();
        return if ms.is_finite() && ms.abs() < 9.2e18 {
            Ok(ms as i64)
        } else {
            Err(bad())
        };
    }
    let mut total: i64 = 0;
    let mut rest = text;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n: i64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit_ms: i64 = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "w" => 604_800_000,
            "y" => 31_536_000_000,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        total = n
            .checked_mul(unit_ms)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(bad)?;
    }
    Ok(total)
}

mod eval;
pub use eval::*;

#[cfg(test)]
mod tests;
