//! The part of PromQL that bucketd answers, over its buckets: parsing, and evaluating a query at
//! a grid of times. Pure (the caller reads the buckets).
//!
//! What is supported (docs/PROMETHEUS.md): a selector of the metrics `bucketd_bucket_<field>`
//! with the labels `series`, `sensor` and `metric` (`=`, `!=`, `=~`, `!~`); the aggregations
//! `sum`, `avg`, `min`, `max` and `count`, `by` or `without` labels, over a selector; and number
//! arithmetic (`1+1`, which Grafana's "Save & test" sends). Anything else is an error that names
//! what is not supported.
//!
//! The value of a series at time `t` is its bucket that contains `t`; with a step coarser than
//! the bucket width, the window of that step (aligned as [`rollup::window_start`] aligns it)
//! that contains `t`, the buckets in it merged exactly, not sampled.

use std::collections::BTreeMap;

use crate::doc::BucketDoc;
use crate::rollup;
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

/// The labels a stored series has, besides `__name__`.
pub const LABELS: [&str; 3] = ["metric", "sensor", "series"];

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
    pub sensor: &'a str,
    pub metric: &'a str,
}

impl<'a> SeriesLabels<'a> {
    /// The labels of the stored series `name` (`sensor/metric`).
    pub fn of(name: &'a str) -> SeriesLabels<'a> {
        let (sensor, metric) = name.split_once('/').unwrap_or((name, ""));
        SeriesLabels {
            series: name,
            sensor,
            metric,
        }
    }

    fn get(&self, label: &str) -> &'a str {
        match label {
            "series" => self.series,
            "sensor" => self.sensor,
            "metric" => self.metric,
            // Prometheus: a label a series does not have has the empty value.
            _ => "",
        }
    }

    /// All labels of the metric `field` of this series.
    pub fn with_name(&self, field: Field) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("__name__".to_owned(), field.metric_name().to_owned()),
            ("metric".to_owned(), self.metric.to_owned()),
            ("sensor".to_owned(), self.sensor.to_owned()),
            ("series".to_owned(), self.series.to_owned()),
        ])
    }
}

impl Selector {
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

    /// Whether the series' own labels (not `__name__`) pass every matcher.
    pub fn matches_series(&self, labels: &SeriesLabels) -> bool {
        self.matchers
            .iter()
            .filter(|m| m.label != "__name__")
            .all(|m| m.matches(labels.get(&m.label)))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AggOp {
    Sum,
    Avg,
    Min,
    Max,
    Count,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grouping {
    By(Vec<String>),
    Without(Vec<String>),
}

/// A selector, aggregated or not.
#[derive(Debug, Clone)]
pub struct VectorExpr {
    pub selector: Selector,
    pub aggregate: Option<(AggOp, Grouping)>,
}

/// A parsed query.
#[derive(Debug, Clone)]
pub enum Expr {
    /// Number arithmetic, already computed.
    Scalar(f64),
    Vector(VectorExpr),
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
    let expr = p.sum()?;
    match p.peek() {
        None => Ok(expr),
        Some(t) => Err(format!("unexpected {} after the expression", t.describe())),
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Number(f64),
    Str(String),
    LBrace,
    RBrace,
    LParen,
    RParen,
    Comma,
    Eq,
    Ne,
    ReMatch,
    ReNotMatch,
    Plus,
    Minus,
    Star,
    Slash,
    /// Anything else PromQL has (`[5m]`, `==`, `^`, `%`, `@`, ...): not supported here.
    Unsupported(String),
}

impl Token {
    fn describe(&self) -> String {
        match self {
            Token::Ident(s) | Token::Unsupported(s) => format!("`{s}`"),
            Token::Number(n) => format!("number {n}"),
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
            Token::Comma => ",",
            Token::Eq => "=",
            Token::Ne => "!=",
            Token::ReMatch => "=~",
            Token::ReNotMatch => "!~",
            Token::Plus => "+",
            Token::Minus => "-",
            Token::Star => "*",
            Token::Slash => "/",
            _ => "",
        }
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
            ',' => (Token::Comma, 1),
            '+' => (Token::Plus, 1),
            '-' => (Token::Minus, 1),
            '*' => (Token::Star, 1),
            '/' => (Token::Slash, 1),
            '=' if next == Some('~') => (Token::ReMatch, 2),
            '=' if next == Some('=') => (Token::Unsupported("==".into()), 2),
            '=' => (Token::Eq, 1),
            '!' if next == Some('=') => (Token::Ne, 2),
            '!' if next == Some('~') => (Token::ReNotMatch, 2),
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
                // A duration (`5m`, of a range vector or an offset) is not supported.
                let token = word
                    .parse::<f64>()
                    .map_or_else(|_| Token::Unsupported(word), Token::Number);
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
    /// Operands being parsed inside each other (parentheses, signs, aggregations).
    depth: usize,
}

/// Something that can be a number or a selection of series, while parsing.
enum Operand {
    Number(f64),
    Vector(VectorExpr),
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn next(&mut self) -> Option<Token> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t
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

    fn sum(&mut self) -> Result<Expr, String> {
        let first = self.product()?;
        self.binary(first, &[Token::Plus, Token::Minus], Self::product)
            .map(|o| match o {
                Operand::Number(n) => Expr::Scalar(n),
                Operand::Vector(v) => Expr::Vector(v),
            })
    }

    fn product(&mut self) -> Result<Operand, String> {
        let first = self.unary()?;
        self.binary(first, &[Token::Star, Token::Slash], Self::unary)
    }

    /// Folds `first (op operand)*` for the operators `ops`: numbers only.
    fn binary(
        &mut self,
        mut acc: Operand,
        ops: &[Token],
        mut operand: impl FnMut(&mut Self) -> Result<Operand, String>,
    ) -> Result<Operand, String> {
        while let Some(op) = self.peek().filter(|t| ops.contains(t)).cloned() {
            self.at += 1;
            let right = operand(self)?;
            let (Operand::Number(a), Operand::Number(b)) = (&acc, &right) else {
                return Err(format!(
                    "the operator `{}` between series is not supported: bucketd answers \
                     selectors and sum/avg/min/max/count of them",
                    op.symbol()
                ));
            };
            acc = Operand::Number(match op {
                Token::Plus => a + b,
                Token::Minus => a - b,
                Token::Star => a * b,
                _ => a / b,
            });
        }
        Ok(acc)
    }

    /// Every nesting passes here: the depth is bounded, so that no query can overflow the stack.
    fn unary(&mut self) -> Result<Operand, String> {
        if self.depth >= NESTING_MAX {
            return Err(format!("the query nests deeper than {NESTING_MAX} levels"));
        }
        self.depth += 1;
        let operand = self.unary_unbounded();
        self.depth -= 1;
        operand
    }

    fn unary_unbounded(&mut self) -> Result<Operand, String> {
        match self.peek() {
            Some(Token::Minus) => {
                self.at += 1;
                match self.unary()? {
                    Operand::Number(n) => Ok(Operand::Number(-n)),
                    Operand::Vector(_) => Err("negating series is not supported".into()),
                }
            }
            Some(Token::Plus) => {
                self.at += 1;
                self.unary()
            }
            _ => self.primary(),
        }
    }

    fn primary(&mut self) -> Result<Operand, String> {
        let operand = match self.next() {
            Some(Token::Number(n)) => Operand::Number(n),
            Some(Token::LParen) => {
                let inner = self.sum()?;
                self.expect(&Token::RParen)?;
                match inner {
                    Expr::Scalar(n) => Operand::Number(n),
                    Expr::Vector(v) => Operand::Vector(v),
                }
            }
            Some(Token::LBrace) => Operand::Vector(VectorExpr {
                selector: self.selector(None)?,
                aggregate: None,
            }),
            Some(Token::Ident(name)) => self.named(name)?,
            Some(t) => return Err(format!("unexpected {}", t.describe())),
            None => return Err("the query is empty or ends too early".into()),
        };
        if let Some(t @ Token::Unsupported(_)) = self.peek() {
            return Err(format!(
                "{} is not supported: bucketd answers selectors, sum/avg/min/max/count of them \
                 and number arithmetic (no range vectors, offsets or comparisons)",
                t.describe()
            ));
        }
        Ok(operand)
    }

    /// A metric name, an aggregation, or a function (not supported). Aggregation keywords, as
    /// `by` and `without`, are case-insensitive (as in Prometheus: `SUM BY (sensor) (...)`).
    fn named(&mut self, name: String) -> Result<Operand, String> {
        let agg = match name.to_ascii_lowercase().as_str() {
            "sum" => Some(AggOp::Sum),
            "avg" => Some(AggOp::Avg),
            "min" => Some(AggOp::Min),
            "max" => Some(AggOp::Max),
            "count" => Some(AggOp::Count),
            _ => None,
        };
        let followed_by_group = matches!(self.peek(), Some(Token::LParen))
            || matches!(self.peek(), Some(Token::Ident(w))
                if w.eq_ignore_ascii_case("by") || w.eq_ignore_ascii_case("without"));
        if let Some(op) = agg.filter(|_| followed_by_group) {
            return self.aggregate(op).map(Operand::Vector);
        }
        if matches!(self.peek(), Some(Token::LParen)) {
            return Err(format!(
                "the function `{name}` is not supported: bucketd answers selectors and \
                 sum/avg/min/max/count of them"
            ));
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
        Ok(Operand::Vector(VectorExpr {
            selector,
            aggregate: None,
        }))
    }

    fn aggregate(&mut self, op: AggOp) -> Result<VectorExpr, String> {
        let mut grouping = self.grouping()?;
        self.expect(&Token::LParen)?;
        let inner = self.sum()?;
        self.expect(&Token::RParen)?;
        if grouping.is_none() {
            grouping = self.grouping()?;
        }
        let Expr::Vector(VectorExpr {
            selector,
            aggregate: None,
        }) = inner
        else {
            return Err("an aggregation here takes a series selector, like \
                        avg by (sensor) (bucketd_bucket_mean{metric=\"temperature\"})"
                .into());
        };
        Ok(VectorExpr {
            selector,
            aggregate: Some((op, grouping.unwrap_or(Grouping::By(Vec::new())))),
        })
    }

    fn grouping(&mut self) -> Result<Option<Grouping>, String> {
        let without = match self.peek() {
            Some(Token::Ident(w)) if w.eq_ignore_ascii_case("by") => false,
            Some(Token::Ident(w)) if w.eq_ignore_ascii_case("without") => true,
            _ => return Ok(None),
        };
        self.at += 1;
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
        Ok(Some(if without {
            Grouping::Without(labels)
        } else {
            Grouping::By(labels)
        }))
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

fn matcher_error(found: Option<Token>) -> String {
    let found = found.map_or("the end of the query".into(), |t| t.describe());
    format!("expected a label matcher like sensor=\"boiler\" or `}}`, found {found}")
}

fn grouping_error(found: Option<Token>) -> String {
    let found = found.map_or("the end of the query".into(), |t| t.describe());
    format!("expected a label list like by (sensor, metric), found {found}")
}

/// The times a query is evaluated at: `start + k * step` for `k` in `0..count`, in
/// milliseconds since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    pub start_ms: i64,
    pub step_ms: i64,
    pub count: u64,
}

impl Grid {
    /// The grid of a range query: `start` to `end` (both included) every `step`.
    pub fn range(start_ms: i64, end_ms: i64, step_ms: i64) -> Result<Grid, String> {
        if end_ms < start_ms {
            return Err("end timestamp must not be before start time".into());
        }
        if step_ms <= 0 {
            return Err(
                "zero or negative query resolution step widths are not accepted. Try a \
                 positive integer"
                    .into(),
            );
        }
        let count = (i128::from(end_ms) - i128::from(start_ms)) / i128::from(step_ms) + 1;
        let count = u64::try_from(count).unwrap_or(u64::MAX);
        if count > POINTS_PER_SERIES_MAX {
            return Err(format!(
                "exceeded maximum resolution of {POINTS_PER_SERIES_MAX} points per timeseries. \
                 Try decreasing the query resolution (?step=XX)"
            ));
        }
        Ok(Grid {
            start_ms,
            step_ms,
            count,
        })
    }

    /// The grid of an instant query.
    pub fn instant(at_ms: i64) -> Grid {
        Grid {
            start_ms: at_ms,
            step_ms: 1,
            count: 1,
        }
    }

    fn times(&self) -> impl Iterator<Item = i64> + '_ {
        (0..self.count).map(|k| self.start_ms + k as i64 * self.step_ms)
    }

    fn last_ms(&self) -> i64 {
        self.start_ms + (self.count as i64 - 1) * self.step_ms
    }
}

/// The window (seconds) whose summary is the value at a time: the bucket width for steps up to
/// it, else the step itself, which must then be a rollup step ([`rollup::parse_step`]'s rule).
pub fn window_secs(step_ms: i64, width_secs: i64) -> Result<i64, String> {
    if step_ms <= width_secs * 1000 {
        return Ok(width_secs);
    }
    if step_ms % 1000 != 0 {
        return Err(format!(
            "step {step_ms}ms: a step coarser than the bucket width ({width_secs}s) must be whole \
             seconds"
        ));
    }
    rollup::parse_step(&format!("{}s", step_ms / 1000), width_secs)
        .map_err(|e| format!("step: {e}; or use a step up to {width_secs}s"))
}

/// One series of an answer: its labels and points (time in milliseconds, value).
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub labels: BTreeMap<String, String>,
    pub points: Vec<(i64, f64)>,
}

/// Why an evaluation stopped.
#[derive(Debug)]
pub enum EvalError<E> {
    /// The query would read or return more than the limit; the text says what to narrow.
    TooLarge(String),
    /// Reading the buckets failed.
    Read(E),
}

/// What bounds one evaluation.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// Stored buckets read, and points in the answer, each at most this many.
    pub max_points: u64,
}

/// Evaluates `expr` at `grid` over the stored series `names`, reading the matched series'
/// buckets with one `fetch(names, from, to)` (per name, bucket starts in `[from, to)`, seconds,
/// in time order): the store passes over what it has not folded once for them all.
pub fn evaluate<E>(
    expr: &VectorExpr,
    names: &[String],
    grid: Grid,
    width_secs: i64,
    budget: Budget,
    fetch: impl FnOnce(&[&str], i64, i64) -> Result<BTreeMap<String, Vec<BucketDoc>>, E>,
) -> Result<Vec<Series>, EvalError<E>> {
    let window = window_secs(grid.step_ms, width_secs).map_err(EvalError::TooLarge)?;
    let fields = expr.selector.fields();
    let matched: Vec<SeriesLabels> = names
        .iter()
        .map(|n| SeriesLabels::of(n))
        .filter(|l| !fields.is_empty() && expr.selector.matches_series(l))
        .collect();
    let from = rollup::window_start(grid.start_ms.div_euclid(1000), window);
    let to = rollup::window_start(grid.last_ms().div_euclid(1000), window).saturating_add(window);
    let buckets = u64::try_from(to.saturating_sub(from) / width_secs).unwrap_or(u64::MAX);
    let reads = buckets.saturating_mul(matched.len() as u64);
    let points = grid
        .count
        .saturating_mul(fields.len() as u64)
        .saturating_mul(matched.len() as u64);
    if reads > budget.max_points || points > budget.max_points {
        return Err(EvalError::TooLarge(format!(
            "the query selects {} series x {} fields over {buckets} buckets ({} points): more than \
             http.max_points_per_query ({}); narrow the selector or the range, or use a coarser \
             step",
            matched.len(),
            fields.len(),
            points.max(reads),
            budget.max_points
        )));
    }
    let mut out = Vec::new();
    let wanted: Vec<&str> = matched.iter().map(|l| l.series).collect();
    let mut read = fetch(&wanted, from, to).map_err(EvalError::Read)?;
    for labels in matched {
        let docs = read.remove(labels.series).unwrap_or_default();
        let windows: BTreeMap<i64, Summary> = rollup::rollup(&docs, window)
            .into_iter()
            .map(|w| (w.start, w.summary))
            .collect();
        for &field in &fields {
            let points: Vec<(i64, f64)> = grid
                .times()
                .filter_map(|t| {
                    let s = windows.get(&rollup::window_start(t.div_euclid(1000), window))?;
                    Some((t, field.value(s)?))
                })
                .collect();
            if !points.is_empty() {
                out.push(Series {
                    labels: labels.with_name(field),
                    points,
                });
            }
        }
    }
    Ok(match &expr.aggregate {
        None => out,
        Some((op, grouping)) => aggregate(*op, grouping, out),
    })
}

/// PromQL's aggregation of `series` into groups: for each time, over the series of the group
/// that have a point then. `__name__` is dropped, as PromQL drops it.
fn aggregate(op: AggOp, grouping: &Grouping, series: Vec<Series>) -> Vec<Series> {
    // Per group: time -> (sum, count, min, max).
    type Acc = BTreeMap<i64, (f64, u64, f64, f64)>;
    let mut groups: BTreeMap<BTreeMap<String, String>, Acc> = BTreeMap::new();
    for s in series {
        let labels: BTreeMap<String, String> = s
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
        let acc = groups.entry(labels).or_default();
        for (t, v) in s.points {
            let e = acc
                .entry(t)
                .or_insert((0.0, 0, f64::INFINITY, f64::NEG_INFINITY));
            e.0 += v;
            e.1 += 1;
            e.2 = e.2.min(v);
            e.3 = e.3.max(v);
        }
    }
    groups
        .into_iter()
        .map(|(labels, acc)| Series {
            labels,
            points: acc
                .into_iter()
                .map(|(t, (sum, n, min, max))| {
                    let v = match op {
                        AggOp::Sum => sum,
                        AggOp::Avg => sum / n as f64,
                        AggOp::Min => min,
                        AggOp::Max => max,
                        AggOp::Count => n as f64,
                    };
                    (t, v)
                })
                .collect(),
        })
        .collect()
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

#[cfg(test)]
mod tests;
