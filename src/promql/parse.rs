//! The parser: tokens to an [`Expr`] by precedence climbing, with the nesting and matcher
//! bounds checked as it goes, and what the evaluator cannot take refused after.

use super::ast::{
    AggOp, At, BinOp, Expr, Func, Group, Grouping, MatchOp, Matcher, Matching, MathFn, Select,
    Selector, Subquery,
};
use super::lex::{Token, lex};
use super::{MATCHERS_MAX, NESTING_MAX, QUERY_BYTES_MAX};

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
                at: None,
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
pub(super) fn check(expr: &Expr, range_allowed: bool) -> Result<(), String> {
    match expr {
        Expr::Number(_) => Ok(()),
        Expr::Select(s) => match (s.range_secs.is_some(), range_allowed) {
            (true, false) => Err("a range selector ([1h]) goes inside a range function like \
                 avg_over_time(bucketd_reading{series=\"boiler/temp\"}[1h])"
                .into()),
            (false, true) => Err("this function takes a range selector, like x[1h]".into()),
            _ => Ok(()),
        },
        Expr::Subquery(q) => check_subquery(q, range_allowed),
        Expr::Call(Func::Map(m), args) => check_map(*m, args),
        Expr::Str(_) => Err("a string goes only in label_replace and label_join".into()),
        Expr::Call(f @ (Func::LabelReplace | Func::LabelJoin), args) => check_relabel(*f, args),
        Expr::Call(f @ (Func::Time | Func::Vector | Func::Scalar | Func::Date(_)), args) => {
            check_time_call(*f, args)
        }
        Expr::Call(Func::HistogramQuantile, args) => {
            if args.len() != 2 || args[0].number().is_none() || args[1].number().is_some() {
                return Err("histogram_quantile takes a number and series, like \
                     histogram_quantile(0.9, sum by (le) (rate(x_bucket[5m])))"
                    .into());
            }
            check(&args[1], false)
        }
        Expr::Call(f @ (Func::Pi | Func::HoltWinters | Func::PredictLinear), args) => {
            check_numbered_call(*f, args)
        }
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
            match (op, parameter.as_deref()) {
                (AggOp::CountValues, Some(Expr::Str(label))) => check_label_name(label)?,
                (AggOp::CountValues, _) => {
                    return Err(
                        "count_values takes a label name, like count_values(\"value\", v)".into(),
                    );
                }
                (_, Some(p)) if p.number().is_none() => {
                    return Err("an aggregation's parameter must be a number".into());
                }
                _ => {}
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
            if op.is_set() && (lhs.number().is_some() || rhs.number().is_some()) {
                return Err(format!(
                    "set operator `{}` is only between series, not numbers",
                    format!("{op:?}").to_lowercase()
                ));
            }
            check(lhs, false)?;
            check(rhs, false)
        }
        Expr::Negate(e) => check(e, false),
    }
}

/// [`check`] of a subquery: only as a range function's argument, of series.
fn check_subquery(q: &Subquery, range_allowed: bool) -> Result<(), String> {
    if !range_allowed {
        return Err("a subquery ([1d:1h]) goes inside a range function, like \
             max_over_time(rate(bucketd_reading{series=\"meter/kwh\"}[5m])[1d:1h])"
            .into());
    }
    if q.inner.number().is_some() {
        return Err("a subquery is of series, not of a number".into());
    }
    check(&q.inner, false)
}

/// [`check`] of `pi()`, `holt_winters` and `predict_linear`: their numbers and their range.
fn check_numbered_call(f: Func, args: &[Expr]) -> Result<(), String> {
    match f {
        Func::Pi => {
            if args.is_empty() {
                Ok(())
            } else {
                Err("pi() takes no argument".into())
            }
        }
        Func::HoltWinters => {
            let factor = |a: &Expr| a.number().is_some_and(|f| f > 0.0 && f < 1.0);
            if args.len() != 3 || !factor(&args[1]) || !factor(&args[2]) {
                return Err(
                    "holt_winters takes a range selector, a smoothing factor and a trend factor, \
                     each factor between 0 and 1 (exclusive)"
                        .into(),
                );
            }
            check(&args[0], true)
        }
        _ => {
            if args.len() != 2 || args[1].number().is_none() {
                return Err(
                    "predict_linear takes a range selector and a number of seconds, like \
                     predict_linear(bucketd_reading{series=\"tank/level\"}[6h], 86400)"
                        .into(),
                );
            }
            check(&args[0], true)
        }
    }
}

/// [`check`] of `label_replace` and `label_join`: series, then strings, the label names valid.
fn check_relabel(f: Func, args: &[Expr]) -> Result<(), String> {
    let strings = args.get(1..).unwrap_or_default();
    let ok = match f {
        Func::LabelReplace => args.len() == 5,
        _ => args.len() >= 3,
    } && strings.iter().all(|a| a.string().is_some());
    if !ok {
        return Err(format!(
            "{} takes series and then strings, like {}",
            f.name(),
            if f == Func::LabelReplace {
                "label_replace(v, \"dst\", \"$1\", \"src\", \"(.*)\")"
            } else {
                "label_join(v, \"dst\", \",\", \"src1\", \"src2\")"
            }
        ));
    }
    check_label_name(strings[0].string().unwrap_or_default())?;
    if f == Func::LabelJoin {
        for src in &strings[2..] {
            check_label_name(src.string().unwrap_or_default())?;
        }
    }
    check(&args[0], false)
}

/// A label name as Prometheus takes one: `[a-zA-Z_][a-zA-Z0-9_]*`.
fn check_label_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if first_ok && chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        Ok(())
    } else {
        Err(format!("invalid label name {name:?}"))
    }
}

/// [`check`] of `time()`, `vector(s)`, `scalar(v)` and the date functions.
fn check_time_call(f: Func, args: &[Expr]) -> Result<(), String> {
    let arity = match f {
        Func::Time => 0..=0,
        Func::Date(_) => 0..=1,
        _ => 1..=1,
    };
    if !arity.contains(&args.len()) {
        return Err(format!(
            "{}() takes {} argument(s), got {}",
            f.name(),
            if arity.start() == arity.end() {
                arity.start().to_string()
            } else {
                "0 or 1".into()
            },
            args.len()
        ));
    }
    if matches!(f, Func::Scalar | Func::Date(_)) && args.iter().any(|a| a.number().is_some()) {
        return Err(format!("{}() takes series, not a number", f.name()));
    }
    args.iter().try_for_each(|a| check(a, false))
}

/// [`check`] of a math function's call: its arity, numbers after the series.
fn check_map(m: MathFn, args: &[Expr]) -> Result<(), String> {
    if !m.arity().contains(&args.len()) {
        return Err(format!(
            "{} takes {} argument(s), got {}",
            format!("{m:?}").to_lowercase(),
            if m.arity().start() == m.arity().end() {
                m.arity().start().to_string()
            } else {
                format!("{} or {}", m.arity().start(), m.arity().end())
            },
            args.len()
        ));
    }
    if args[1..].iter().any(|a| a.number().is_none()) {
        return Err("a function's arguments after the series must be numbers".into());
    }
    if args[0].number().is_some() {
        return Err("this function takes series, not a number".into());
    }
    check(&args[0], false)
}

/// What `[..]` holds after its range.
enum Bracket {
    /// Nothing more: a range selector's range.
    Range,
    /// A subquery's step (ms), `None` for the default.
    Subquery(Option<i64>),
}

pub(super) struct Parser {
    pub(super) tokens: Vec<Token>,
    pub(super) at: usize,
    /// Operands being parsed inside each other (parentheses, signs, calls, aggregations: each
    /// passes through [`Parser::unary`]).
    pub(super) depth: usize,
}

/// The binary operators of each precedence level, lowest first; `^` is the last, and binds
/// to the right.
pub(super) const LEVELS: [&[BinOp]; 6] = [
    &[BinOp::Or],
    &[BinOp::And, BinOp::Unless],
    &[
        BinOp::Eq,
        BinOp::Ne,
        BinOp::Lt,
        BinOp::Gt,
        BinOp::Le,
        BinOp::Ge,
    ],
    &[BinOp::Add, BinOp::Sub],
    &[BinOp::Mul, BinOp::Div, BinOp::Mod, BinOp::Atan2],
    &[BinOp::Pow],
];

impl Parser {
    pub(super) fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    pub(super) fn next(&mut self) -> Option<Token> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t
    }

    pub(super) fn peek_ident(&self, word: &str) -> bool {
        matches!(self.peek(), Some(Token::Ident(w)) if w.eq_ignore_ascii_case(word))
    }

    pub(super) fn expect(&mut self, want: &Token) -> Result<(), String> {
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

    pub(super) fn expr(&mut self) -> Result<Expr, String> {
        self.level(0)
    }

    /// Operands joined by the operators of `LEVELS[level]`, left to right (`^`: right).
    pub(super) fn level(&mut self, level: usize) -> Result<Expr, String> {
        if level == LEVELS.len() - 1 {
            let base = self.postfix()?;
            if self.peek().and_then(Token::binary) != Some(BinOp::Pow) {
                return Ok(base);
            }
            self.at += 1;
            let (bool_result, matching, group) = self.modifiers(BinOp::Pow)?;
            let exponent = self.unary()?;
            return Ok(binary(
                BinOp::Pow,
                (bool_result, matching, group),
                base,
                exponent,
            ));
        }
        // The multiplicative level takes signed operands (`2 * -x`).
        let signed = level == LEVELS.len() - 2;
        let mut acc = if signed {
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
            let modifiers = self.modifiers(op)?;
            let rhs = if signed {
                self.unary()?
            } else {
                self.level(level + 1)?
            };
            acc = binary(op, modifiers, acc, rhs);
        }
        Ok(acc)
    }

    /// `bool`, then `on (..)` or `ignoring (..)`, after a binary operator.
    pub(super) fn modifiers(
        &mut self,
        op: BinOp,
    ) -> Result<(bool, Matching, Option<Group>), String> {
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
        let group = if self.peek_ident("group_left") || self.peek_ident("group_right") {
            let right = self.peek_ident("group_right");
            self.at += 1;
            if matching == Matching::All {
                return Err(
                    "group_left and group_right go after on (...) or ignoring (...)".into(),
                );
            }
            if op.is_set() {
                return Err("no group_left or group_right with a set operator".into());
            }
            let include = if matches!(self.peek(), Some(Token::LParen)) {
                self.labels()?
            } else {
                Vec::new()
            };
            Some(Group { right, include })
        } else {
            None
        };
        Ok((bool_result, matching, group))
    }

    /// Every nesting passes here: the depth is bounded, so that no query can overflow the stack.
    pub(super) fn unary(&mut self) -> Result<Expr, String> {
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

    /// A primary expression with a range (`[1h]`) or a subquery's (`[1d:1h]`), then an offset
    /// (`offset 1d`) and an evaluation time (`@ 1700000000`, `@ end()`) in either order.
    pub(super) fn postfix(&mut self) -> Result<Expr, String> {
        let mut expr = self.primary()?;
        if matches!(self.peek(), Some(Token::LBracket)) {
            self.at += 1;
            let ms = match self.next() {
                Some(Token::Duration(ms)) => ms,
                Some(Token::Number(n)) if n.is_finite() => (n * 1000.0) as i64,
                other => {
                    return Err(format!(
                        "expected a duration like 1h in [..], found {}",
                        other.map_or("the end".into(), |t| t.describe())
                    ));
                }
            };
            let step = self.subquery_step()?;
            self.expect(&Token::RBracket)?;
            if ms <= 0 {
                return Err("a range must be positive".into());
            }
            if let Bracket::Subquery(step_ms) = step {
                expr = Expr::Subquery(Box::new(Subquery {
                    inner: expr,
                    range_ms: ms,
                    step_ms,
                    offset_secs: 0,
                    at: None,
                }));
            } else {
                let Expr::Select(s) = &mut expr else {
                    return Err("a range ([1h]) goes after a series selector; a subquery \
                         ([1h:5m]) after an expression"
                        .into());
                };
                if ms % 1000 != 0 {
                    return Err("a range must be a positive whole number of seconds".into());
                }
                s.range_secs = Some(ms / 1000);
            }
        }
        let (mut offset, mut at) = (false, false);
        loop {
            if self.peek_ident("offset") && !offset {
                self.at += 1;
                let secs = self.offset()?;
                *Self::modified(&mut expr, "offset")?.0 = secs;
                offset = true;
            } else if matches!(self.peek(), Some(Token::At)) && !at {
                self.at += 1;
                let time = self.at_time()?;
                *Self::modified(&mut expr, "@")?.1 = Some(time);
                at = true;
            } else {
                break;
            }
        }
        if let Some(t @ Token::Unsupported(_)) = self.peek() {
            return Err(format!("{} is not supported here", t.describe()));
        }
        Ok(expr)
    }

    /// After the range in `[..]`: a subquery's `:` and step, or nothing (a range selector).
    /// The lexer reads `:5m` as one word, and `: 5m` as two.
    fn subquery_step(&mut self) -> Result<Bracket, String> {
        let Some(Token::Ident(word)) = self.peek() else {
            return Ok(Bracket::Range);
        };
        let Some(rest) = word.strip_prefix(':') else {
            return Err(format!("expected `]` or `:`, found `{word}`"));
        };
        let rest = rest.to_owned();
        self.at += 1;
        let step = if rest.is_empty() {
            match self.peek() {
                Some(Token::Duration(ms)) => {
                    let ms = *ms;
                    self.at += 1;
                    Some(ms)
                }
                _ => None,
            }
        } else {
            Some(super::parse_duration(&rest).map_err(|e| format!("a subquery's step: {e}"))?)
        };
        if step.is_some_and(|ms| ms <= 0) {
            return Err("a subquery's step must be positive".into());
        }
        Ok(Bracket::Subquery(step))
    }

    /// The duration after `offset` (whole seconds, maybe negative).
    fn offset(&mut self) -> Result<i64, String> {
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
        if ms % 1000 != 0 {
            return Err("an offset must be a whole number of seconds".into());
        }
        Ok(sign * ms / 1000)
    }

    /// The time after `@`: seconds since the epoch, `start()` or `end()`.
    fn at_time(&mut self) -> Result<At, String> {
        let sign = if matches!(self.peek(), Some(Token::Minus)) {
            self.at += 1;
            -1.0
        } else {
            1.0
        };
        match self.next() {
            Some(Token::Number(n)) if n.is_finite() && (n * 1000.0).abs() < 9.2e18 => {
                Ok(At::Ms((sign * n * 1000.0).round() as i64))
            }
            Some(Token::Ident(name))
                if sign > 0.0
                    && (name == "start" || name == "end")
                    && matches!(self.peek(), Some(Token::LParen)) =>
            {
                self.at += 1;
                self.expect(&Token::RParen)?;
                Ok(if name == "start" { At::Start } else { At::End })
            }
            other => Err(format!(
                "expected a time after @ (seconds since the epoch, start() or end()), found {}",
                other.map_or("the end".into(), |t| t.describe())
            )),
        }
    }

    /// The offset and `@` of a selector or a subquery, for `what` after it.
    fn modified<'e>(
        expr: &'e mut Expr,
        what: &str,
    ) -> Result<(&'e mut i64, &'e mut Option<At>), String> {
        match expr {
            Expr::Select(s) => Ok((&mut s.offset_secs, &mut s.at)),
            Expr::Subquery(q) => Ok((&mut q.offset_secs, &mut q.at)),
            _ => Err(format!("{what} goes after a series selector or a subquery")),
        }
    }

    pub(super) fn primary(&mut self) -> Result<Expr, String> {
        match self.next() {
            Some(Token::Number(n)) => Ok(Expr::Number(n)),
            // Where a string may go is checked after parsing (`check`).
            Some(Token::Str(s)) => Ok(Expr::Str(s)),
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
    pub(super) fn named(&mut self, name: String) -> Result<Expr, String> {
        let followed_by_group = matches!(self.peek(), Some(Token::LParen))
            || self.peek_ident("by")
            || self.peek_ident("without");
        if let Some(op) = AggOp::of(&name).filter(|_| followed_by_group) {
            return self.aggregate(op);
        }
        if matches!(self.peek(), Some(Token::LParen)) {
            let Some(func) = Func::of(&name) else {
                return Err(format!(
                    "the function `{name}` is not supported: bucketd answers Prometheus 2.x's \
                     functions but the native-histogram ones (docs/PROMETHEUS.md lists them)"
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
    pub(super) fn arguments(&mut self) -> Result<Vec<Expr>, String> {
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

    pub(super) fn aggregate(&mut self, op: AggOp) -> Result<Expr, String> {
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

    pub(super) fn grouping(&mut self) -> Result<Option<Grouping>, String> {
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
    pub(super) fn labels(&mut self) -> Result<Vec<String>, String> {
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
    pub(super) fn selector(&mut self, name: Option<String>) -> Result<Selector, String> {
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

pub(super) fn binary(
    op: BinOp,
    (bool_result, matching, group): (bool, Matching, Option<Group>),
    lhs: Expr,
    rhs: Expr,
) -> Expr {
    Expr::Binary {
        op,
        bool_result,
        matching,
        group,
        lhs: Box::new(lhs),
        rhs: Box::new(rhs),
    }
}

pub(super) fn select(selector: Selector) -> Expr {
    Expr::Select(Select {
        selector,
        range_secs: None,
        offset_secs: 0,
        at: None,
    })
}

pub(super) fn matcher_error(found: Option<Token>) -> String {
    let found = found.map_or("the end of the query".into(), |t| t.describe());
    format!("expected a label matcher like sensor=\"boiler\" or `}}`, found {found}")
}

pub(super) fn grouping_error(found: Option<Token>) -> String {
    let found = found.map_or("the end of the query".into(), |t| t.describe());
    format!("expected a label list like by (sensor, metric), found {found}")
}
