//! Evaluating a parsed query at a grid of times, over buckets. Pure: the caller reads the
//! buckets (one `fetch` for every selector of the query).
//!
//! What a selector is worth at a time `t` (docs/PROMETHEUS.md, "What a point is"):
//! - plain, with a step up to the bucket width: the bucket that contains `t`; an instant query
//!   looks back one bucket when that one has no readings yet (the first minutes of an hour);
//! - plain, with a coarser step (a whole number of buckets): the window `[t, t + step)` of the
//!   query's own grid (Grafana's, aligned to its time zone), its buckets merged exactly;
//! - in a range function `f(v[r])`: the buckets that overlap `[t - r, t)`: at a bucket boundary
//!   exactly `r` of them, at other times the one in progress as well. Over `bucketd_reading`
//!   they merge (so `quantile_over_time(0.99, bucketd_reading[1d])` is the day's p99 of the
//!   readings, interpolated as Prometheus does); over a field each bucket is one sample.
//!
//! `offset d` moves `t` back by `d`; `@ t` fixes it. A subquery's expression is evaluated at a
//! grid of its own (the multiples of its step its windows need), and each selector is read at
//! the grid it is evaluated at ([`place`]).

use std::collections::{BTreeMap, BTreeSet};

use super::{
    At, Expr, Field, Func, LOOKBACK_MS, POINTS_PER_SERIES_MAX, SUBQUERY_STEP_MS, Select,
    SeriesLabels, Subquery,
};
use crate::doc::BucketDoc;
use crate::summary::Summary;

mod ops;
mod windows;

use self::ops::{aggregate, binary, of_readings, of_samples, of_timed};
use self::windows::{Exact, Sliding, Stored};

/// The times a query is evaluated at: `start + k * step` for `k` in `0..count`, in
/// milliseconds since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    pub start_ms: i64,
    pub step_ms: i64,
    pub count: u64,
    /// An instant query: a plain selector looks back one bucket.
    pub look_back: bool,
    /// How far back (ms) a plain `bucketd_reading` selector looks for a reading: `[t - this, t]`.
    pub lookback_ms: i64,
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
            look_back: false,
            lookback_ms: LOOKBACK_MS,
        })
    }

    /// The grid of an instant query.
    pub fn instant(at_ms: i64) -> Grid {
        Grid {
            start_ms: at_ms,
            step_ms: 1,
            count: 1,
            look_back: true,
            lookback_ms: LOOKBACK_MS,
        }
    }

    /// The same grid with a plain `bucketd_reading` selector looking back `ms` (`http.lookback`).
    #[must_use]
    pub fn looking_back(self, ms: i64) -> Grid {
        Grid {
            lookback_ms: ms,
            ..self
        }
    }

    /// What identifies it among a query's grids (its subqueries' and `@`'s).
    fn key(&self) -> GridKey {
        (self.start_ms, self.step_ms, self.count)
    }

    /// The grid a selector `s` is read at in this one: the same, or its `@` time alone.
    fn of(&self, s: &Select) -> Grid {
        match s.at {
            Some(At::Ms(ms)) => Grid {
                start_ms: ms,
                count: 1,
                ..*self
            },
            _ => *self,
        }
    }

    /// The grid a subquery's expression is evaluated at for the points of this one: from the
    /// first multiple of its step at or after the first point's window start to the last
    /// point (each moved by its offset, or its `@` time), as Prometheus aligns it. Refused
    /// past `max_points` times.
    fn of_subquery(&self, q: &Subquery, max_points: u64) -> Result<Grid, Refusal> {
        let (first, last) = match q.at {
            Some(At::Ms(ms)) => (ms, ms),
            _ => (self.start_ms, self.last_ms()),
        };
        let shift = q.offset_secs.saturating_mul(1000);
        let step = q.step_ms.unwrap_or(SUBQUERY_STEP_MS);
        let lo = first.saturating_sub(shift).saturating_sub(q.range_ms);
        let mut start = lo.div_euclid(step).saturating_mul(step);
        if start < lo {
            start = start.saturating_add(step);
        }
        let end = last.saturating_sub(shift);
        let count = if end < start {
            0
        } else {
            u64::try_from((i128::from(end) - i128::from(start)) / i128::from(step) + 1)
                .unwrap_or(u64::MAX)
        };
        if count > max_points {
            return Err(Refusal::TooLarge(format!(
                "a subquery evaluates its expression at {count} times: more than \
                 http.max_points_per_query ({max_points}); use a coarser step ([{}:1h]) or a \
                 shorter range",
                format_ms(q.range_ms)
            )));
        }
        Ok(Grid {
            start_ms: start,
            step_ms: step,
            count,
            look_back: false,
            lookback_ms: self.lookback_ms,
        })
    }

    /// Its times, in order (ms).
    pub fn times(&self) -> impl Iterator<Item = i64> + '_ {
        (0..self.count).map(|k| self.at(k))
    }

    fn last_ms(&self) -> i64 {
        self.at(self.count.saturating_sub(1))
    }

    /// Time `k` of the grid: never past its end (`Grid::range`), so it fits an i64, though
    /// `k x step` alone may not (a client's grid across all of time, two steps of 2^62 ms).
    fn at(&self, k: u64) -> i64 {
        let t = i128::from(self.start_ms) + i128::from(k) * i128::from(self.step_ms);
        i64::try_from(t).unwrap_or(if t < 0 { i64::MIN } else { i64::MAX })
    }
}

/// The window (ms) a plain selector's point merges: the bucket for steps up to its width, else
/// the step, which must then be a whole number of buckets.
pub fn window_ms(step_ms: i64, width_secs: i64) -> Result<i64, Refusal> {
    let width_ms = width_secs.saturating_mul(1000);
    if step_ms <= width_ms {
        Ok(width_ms)
    } else if step_ms % width_ms == 0 {
        Ok(step_ms)
    } else {
        let w = crate::rollup::format_step(width_secs);
        Err(Refusal::Unsupported(format!(
            "step {}: a step coarser than the bucket width ({w}) must be a whole number of \
             buckets (2 x {w}, 5 x {w}, 1d, ...); or use a step up to {w}",
            format_ms(step_ms)
        )))
    }
}

fn format_ms(ms: i64) -> String {
    if ms % 1000 == 0 {
        crate::rollup::format_step(ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// One series of an answer: its labels and points (time in milliseconds, value), in time order.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub labels: BTreeMap<String, String>,
    pub points: Vec<(i64, f64)>,
}

/// What a query gives: a number (the same at every time), or series.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Scalar(f64),
    Vector(Vec<Series>),
    /// A number that varies with time (`time()`, `scalar(v)`): its value at each time of the
    /// grid that has one.
    Timed(Vec<(i64, f64)>),
}

/// Why a query is not answered, by what the client must do about it; the text says what to
/// change. Each kind is one of Prometheus's `errorType`s ([`Refusal::error_type`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Not a query bucketd answers as written: a step or range that is not a whole number of
    /// buckets, a selector of the old fleet form, a range function without a range. Prometheus
    /// answers its own parameter checks so (`bad_data`).
    #[error("{0}")]
    Unsupported(String),
    /// Past `http.max_points_per_query`: narrow the selector or the range. Prometheus's engine
    /// answers its own sample limit as an `execution` error.
    #[error("{0}")]
    TooLarge(String),
    /// The expression has no answer on these series: many-to-many matching, several metrics
    /// under one range function (`execution`, as in Prometheus).
    #[error("{0}")]
    Execution(String),
}

impl Refusal {
    /// Prometheus's `errorType` for it.
    pub fn error_type(&self) -> &'static str {
        match self {
            Refusal::Unsupported(_) => "bad_data",
            Refusal::TooLarge(_) | Refusal::Execution(_) => "execution",
        }
    }
}

/// Why an evaluation stopped.
#[derive(Debug)]
pub enum EvalError<E> {
    /// Refused, before or while evaluating: the client's to change.
    Refused(Refusal),
    /// Reading the buckets failed.
    Read(E),
    /// [`Budget::cancel`] was set: no one waits for the answer.
    Cancelled,
}

/// What bounds one evaluation.
#[derive(Debug, Clone)]
pub struct Budget {
    /// Stored buckets read, and points in the answer, each at most this many.
    pub max_points: u64,
    /// Set when no one waits for the answer any more (its client hung up): the evaluation
    /// stops at its next point.
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// Where the evaluation says what it answered otherwise than asked (from buckets where the
    /// window's raw readings were over the budget): the answer's `warnings`. `None`: not told.
    pub notes: Option<Notes>,
}

/// What an answer says besides its data, at most [`NOTES_MAX`] of them.
pub type Notes = std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>;

/// Notes kept per answer: one per series at most, and a bounded number of series.
pub const NOTES_MAX: usize = 8;

impl Budget {
    /// Keeps `note` for the answer's warnings (the first [`NOTES_MAX`]).
    fn note(&self, note: impl FnOnce() -> String) {
        if let Some(notes) = &self.notes {
            let mut notes = notes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if notes.len() < NOTES_MAX {
                notes.insert(note());
            }
        }
    }

    fn cancelled(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// An evaluation at one grid: the query's, or a subquery's (which shares what was read).
#[derive(Clone, Copy)]
struct Ctx<'a> {
    budget: &'a Budget,
    grid: Grid,
    width_ms: i64,
    /// What a plain selector's point merges at this grid ([`window_ms`]); `None` where the
    /// step is not whole buckets (then the query has no plain field selector here: refused
    /// when planned).
    window_ms: Option<i64>,
    names: &'a [SeriesLabels<'a>],
    data: &'a BTreeMap<String, Stored>,
    /// Raw readings of the series a plain `bucketd_reading` selector matched.
    raw: &'a RawReadings,
    /// Raw readings of the series a range function over `bucketd_reading` matched, for
    /// windows answered exactly.
    exact: &'a ExactReadings,
    /// Readings the exact windows (and subqueries' windows) may still visit (summed over
    /// every point's window).
    work_left: &'a std::cell::Cell<u64>,
    /// Where the raw readings are when the source keeps none (a query node): what its notes
    /// say of a function that needs them.
    raw_elsewhere: Option<&'static str>,
}

/// A grid's identity: start, step, count (ms).
type GridKey = (i64, i64, u64);

/// A selector of the query with the grid it is read at (the query's, a subquery's, or its `@`
/// time alone) and what a plain selector's point merges there ([`window_ms`]).
#[derive(Clone, Copy)]
struct Placed<'e> {
    s: &'e Select,
    grid: Grid,
    window_ms: i64,
}

/// Every selector of `expr` evaluated at `grid`, placed ([`Placed`]); refused where a
/// subquery's grid is too large or a plain field selector is at a step that is not whole
/// buckets.
fn place<'e>(
    expr: &'e Expr,
    grid: Grid,
    width_secs: i64,
    max_points: u64,
    out: &mut Vec<Placed<'e>>,
) -> Result<(), Refusal> {
    let inner =
        |e: &'e Expr, out: &mut Vec<Placed<'e>>| place(e, grid, width_secs, max_points, out);
    match expr {
        Expr::Number(_) | Expr::Str(_) => {}
        Expr::Select(s) => {
            let window = window_ms(grid.step_ms, width_secs);
            let window_ms = match window {
                Ok(w) => w,
                Err(e) if s.range_secs.is_none() && !s.selector.fields().is_empty() => {
                    return Err(e);
                }
                Err(_) => width_secs.saturating_mul(1000),
            };
            out.push(Placed {
                s,
                grid: grid.of(s),
                window_ms,
            });
        }
        Expr::Subquery(q) => {
            let at = grid.of_subquery(q, max_points)?;
            place(&q.inner, at, width_secs, max_points, out)?;
        }
        Expr::Call(_, args) => {
            for a in args {
                inner(a, out)?;
            }
        }
        Expr::Aggregate {
            parameter,
            inner: e,
            ..
        } => {
            if let Some(p) = parameter {
                inner(p, out)?;
            }
            inner(e, out)?;
        }
        Expr::Binary { lhs, rhs, .. } => {
            inner(lhs, out)?;
            inner(rhs, out)?;
        }
        Expr::Negate(e) => inner(e, out)?,
    }
    Ok(())
}

/// The start (ms) of the bucket of width `w` (ms) holding `t`, saturating at the ends of an
/// i64 (an offset or range from a client can take a time that far).
fn bucket_of(t: i64, w: i64) -> i64 {
    t.div_euclid(w).saturating_mul(w)
}

/// The bucket starts (ms, `[from, to)`) a selector needs at `grid`.
fn needed(s: &Select, grid: Grid, width_ms: i64, window_ms: i64) -> (i64, i64) {
    let shift = s.offset_secs.saturating_mul(1000);
    let first = grid.start_ms.saturating_sub(shift);
    let last = grid.last_ms().saturating_sub(shift);
    match s.range_secs {
        Some(r) => (
            first
                .saturating_sub(r.saturating_mul(1000))
                .saturating_sub(width_ms)
                .saturating_add(1),
            last,
        ),
        None if window_ms == width_ms => {
            let back = if grid.look_back { width_ms } else { 0 };
            (
                bucket_of(first, width_ms).saturating_sub(back),
                bucket_of(last, width_ms).saturating_add(width_ms),
            )
        }
        None => (first, last.saturating_add(window_ms)),
    }
}

/// What a raw read gives (`raw` of [`evaluate`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Raw {
    /// The readings (ns, value) with `from <= ns < to`, in time order.
    Readings(Vec<(i64, f64)>),
    /// More than `at_most` of them.
    TooMany,
    /// The source keeps no raw readings (a query node); the text says where they are.
    NotKept(&'static str),
}

/// Evaluates `expr` at `grid` over the stored series `names`, reading what its selectors need
/// with one `fetch(names, from, to)` (per name, bucket starts in `[from, to)`, seconds, in time
/// order) and, for `bucketd_reading` (plain, and in range functions while the readings are
/// kept), `raw(name, from, to, at_most)`.
pub fn evaluate<E>(
    expr: &Expr,
    names: &[SeriesLabels<'_>],
    grid: Grid,
    width_secs: i64,
    budget: &Budget,
    fetch: impl FnOnce(&[&str], i64, i64) -> Result<BTreeMap<String, Vec<BucketDoc>>, E>,
    mut raw: impl FnMut(&str, i64, i64, u64) -> Result<Raw, E>,
) -> Result<Value, EvalError<E>> {
    let width_ms = width_secs.saturating_mul(1000);
    // `@ start()` and `@ end()` are the query's own times, inside subqueries too.
    let mut expr = expr.clone();
    expr.resolve_at(grid.start_ms, grid.last_ms());
    let mut placed = Vec::new();
    place(&expr, grid, width_secs, budget.max_points, &mut placed).map_err(EvalError::Refused)?;
    let (wanted, from, to) = plan(&placed, names, width_ms, budget).map_err(EvalError::Refused)?;
    let mut raw_left = budget.max_points;
    let plain = read_raw(&placed, names, &mut raw_left, &mut raw)?;
    let mut data = BTreeMap::new();
    if !wanted.is_empty() {
        let read = fetch(
            &wanted,
            from.div_euclid(1000),
            to.div_euclid(1000).saturating_add(1),
        )
        .map_err(EvalError::Read)?;
        for (name, docs) in read {
            let stored = Stored {
                starts: docs.iter().map(|d| d.start.saturating_mul(1000)).collect(),
                summaries: docs.iter().map(BucketDoc::summary).collect(),
            };
            data.insert(name, stored);
        }
    }
    let work = budget.max_points.saturating_mul(EXACT_WORK_PER_POINT);
    let stored = Read {
        width_ms,
        data: &data,
        work,
    };
    let (exact, raw_elsewhere) =
        read_exact(&placed, names, &stored, budget, &mut raw_left, &mut raw)?;
    let work_left = std::cell::Cell::new(work);
    let ctx = Ctx {
        budget,
        grid,
        width_ms,
        window_ms: window_ms(grid.step_ms, width_secs).ok(),
        names,
        data: &data,
        raw: &plain,
        exact: &exact,
        work_left: &work_left,
        raw_elsewhere,
    };
    let value = ctx.eval(&expr);
    if budget.cancelled() {
        return Err(EvalError::Cancelled);
    }
    let value = value.map_err(EvalError::Refused)?;
    Ok(match value {
        Value::Vector(series) => Value::Vector(
            series
                .into_iter()
                .filter(|s| !s.points.is_empty())
                .collect(),
        ),
        scalar @ (Value::Scalar(_) | Value::Timed(_)) => scalar,
    })
}

/// The buckets read for a query, of `width_ms`, by series name; and how many raw readings its
/// exact windows may visit ([`EXACT_WORK_PER_POINT`]).
struct Read<'d> {
    width_ms: i64,
    data: &'d BTreeMap<String, Stored>,
    work: u64,
}

/// What a query reads of the buckets: the series (names) its selectors match, and the bucket
/// starts (ms, `[from, to)`) they need; refused when that, or its answer, is larger than the
/// budget, or a selector is one bucketd cannot answer (the text says why).
fn plan<'n>(
    placed: &[Placed<'_>],
    names: &[SeriesLabels<'n>],
    width_ms: i64,
    budget: &Budget,
) -> Result<(Vec<&'n str>, i64, i64), Refusal> {
    let mut wanted: BTreeSet<&str> = BTreeSet::new();
    let (mut from, mut to) = (i64::MAX, i64::MIN);
    let mut points: u64 = 0;
    for &Placed { s, grid, window_ms } in placed {
        // Any range over the readings (exact from them where they are kept, else from the
        // buckets with a warning); a field's samples are whole buckets.
        let readings_only = s.selector.selects_readings() && s.selector.fields().is_empty();
        if let Some(r) = s.range_secs
            && (r.saturating_mul(1000) % width_ms != 0)
            && !readings_only
        {
            return Err(Refusal::Unsupported(format!(
                "a range must be a whole number of buckets ({}, {}, ...), not {}",
                format_ms(width_ms),
                format_ms(2 * width_ms),
                format_ms(r.saturating_mul(1000))
            )));
        }
        let sources = s.selector.fields().len() as u64
            + u64::from(s.range_secs.is_some() && s.selector.selects_readings());
        if let Some(hint) = s.selector.old_fleet_sensor(names) {
            return Err(Refusal::Unsupported(hint));
        }
        let matched: Vec<&str> = names
            .iter()
            .filter(|l| sources > 0 && s.selector.matches_series(l))
            .map(|l| l.series)
            .collect();
        points = points.saturating_add(
            grid.count
                .saturating_mul(sources)
                .saturating_mul(matched.len() as u64),
        );
        if !matched.is_empty() {
            let (a, b) = needed(s, grid, width_ms, window_ms);
            from = from.min(a);
            to = to.max(b);
            wanted.extend(matched);
        }
    }
    let buckets = if wanted.is_empty() {
        0
    } else {
        u64::try_from(to.saturating_sub(from) / width_ms + 1).unwrap_or(u64::MAX)
    };
    let reads = buckets.saturating_mul(wanted.len() as u64);
    if reads > budget.max_points || points > budget.max_points {
        return Err(Refusal::TooLarge(format!(
            "the query selects {} series over {buckets} buckets ({} points): more than \
             http.max_points_per_query ({}); narrow the selector or the range, or use a \
             coarser step",
            wanted.len(),
            points.max(reads),
            budget.max_points
        )));
    }
    Ok((wanted.into_iter().collect(), from, to))
}

type Labels = BTreeMap<String, String>;

/// Raw readings for exact windows, by series, selector offset (seconds) and range (ms).
type ExactReadings = BTreeMap<(String, i64, i64, GridKey), Exact>;

/// Raw readings (ns, value), in time order, by series and selector offset (seconds): the
/// offset decides the time range read, the grid being the query's.
type RawReadings = BTreeMap<(String, i64, GridKey), Vec<(i64, f64)>>;

/// The raw readings the plain `bucketd_reading` selectors of a query need: per matched series,
/// those from the look-back before the grid's first time to its last. At most `left`
/// readings in all (`http.max_points_per_query`, shared with [`read_exact`]): past that the
/// query is refused, naming the bound.
fn read_raw<E>(
    placed: &[Placed<'_>],
    names: &[SeriesLabels<'_>],
    left: &mut u64,
    raw: &mut impl FnMut(&str, i64, i64, u64) -> Result<Raw, E>,
) -> Result<RawReadings, EvalError<E>> {
    let mut out = RawReadings::new();
    let max = *left;
    for &Placed { s, grid, .. } in placed
        .iter()
        .filter(|p| p.s.range_secs.is_none() && p.s.selector.names_readings())
    {
        let shift = s.offset_secs.saturating_mul(1000);
        let first = grid
            .start_ms
            .saturating_sub(shift)
            .saturating_sub(grid.lookback_ms);
        let last = grid.last_ms().saturating_sub(shift);
        let (from, to) = (
            first.saturating_mul(1_000_000),
            last.saturating_add(1).saturating_mul(1_000_000),
        );
        for name in names
            .iter()
            .filter(|l| s.selector.matches_series(l))
            .map(|l| l.series)
        {
            let key = (name.to_owned(), s.offset_secs, grid.key());
            if out.contains_key(&key) {
                continue; // another selector of the query read the same range
            }
            let readings = match raw(name, from, to, *left).map_err(EvalError::Read)? {
                Raw::Readings(readings) => readings,
                Raw::TooMany => {
                    return Err(EvalError::Refused(Refusal::TooLarge(format!(
                        "bucketd_reading reads more than http.max_points_per_query ({max}) \
                         raw readings here; narrow the selector or the time range"
                    ))));
                }
                Raw::NotKept(why) => {
                    return Err(EvalError::Refused(Refusal::Unsupported(format!(
                        "a plain bucketd_reading selector answers the last raw reading, and \
                         {why}; use a range function (max_over_time(bucketd_reading{{..}}[1h])) \
                         or a bucket field (bucketd_bucket_last)"
                    ))));
                }
            };
            *left = left.saturating_sub(readings.len() as u64);
            out.insert(key, readings);
        }
    }
    Ok(out)
}

/// How many readings the exact windows of a query may visit in all, per point of
/// `http.max_points_per_query`: a window is visited whole at each point of the grid (the
/// readings of `[t - r, t]`, sorted for a quantile), so a fine step over a long range costs
/// points x window; past this, the series' windows come from its buckets, as beyond the raw
/// retention.
pub const EXACT_WORK_PER_POINT: u64 = 16;

impl Stored {
    /// The readings counted by the `buckets` buckets from `first` (ms) on, cumulated:
    /// `counted[k]` in the buckets before bucket `k`.
    fn counted(&self, first: i64, width: i64, buckets: usize) -> Vec<u64> {
        let mut counted = Vec::with_capacity(buckets + 1);
        counted.push(0_u64);
        for k in 0..buckets {
            let start = first + k as i64 * width;
            let (a, b) = self.span(start, start.saturating_add(1));
            let count: u64 = self.summaries[a..b].iter().map(|s| s.count).sum();
            counted.push(counted[k].saturating_add(count));
        }
        counted
    }
}

/// The fields and whether the readings a range function's selector `s` takes: one of them,
/// and the readings for a function that needs their times.
fn what_a_range_function_takes(func: Func, s: &Select) -> Result<(Vec<Field>, bool), Refusal> {
    let fields = s.selector.fields();
    let readings = s.selector.selects_readings();
    if func.needs_times() && !fields.is_empty() {
        return Err(Refusal::Unsupported(format!(
            "{}: the counter and trend functions take bucketd_reading (the readings \
             themselves, with their times), not a bucket field",
            func.name()
        )));
    }
    if usize::from(readings) + fields.len() > 1 {
        return Err(Refusal::Execution(format!(
            "{}: the selector matches several metrics of each series, which would give series \
             with the same labels; name one, like bucketd_reading or bucketd_bucket_max",
            func.name()
        )));
    }
    Ok((fields, readings))
}

/// What an answer says of a series some of whose windows, not whole buckets, were answered
/// from the buckets they touch.
fn from_buckets_note(name: &str, width_ms: i64) -> String {
    format!(
        "{name}: some windows are not whole buckets ({}) and their raw readings are not all \
         kept (or are over http.max_points_per_query): answered from the whole buckets they \
         touch, an estimate",
        format_ms(width_ms)
    )
}

/// What an answer says of a series a counter or trend function has no point for at some times:
/// their windows' raw readings are not all kept (or were over the budget), and, for `rate`,
/// `increase` and `delta` over whole buckets (`whole_buckets`), a bucket's counter increase is
/// not known either. `elsewhere`: where the raw readings are, on a query node.
fn needs_readings_note(
    name: &str,
    func: Func,
    (whole_buckets, elsewhere): (bool, Option<&str>),
) -> String {
    let f = func.name();
    let but = if whole_buckets {
        format!(
            ", and some of its buckets do not know their counter increase (stored before \
             bucketd kept it, or merged from readings out of time order), from which {f}() \
             answers whole-bucket windows"
        )
    } else if matches!(func, Func::Rate | Func::Increase | Func::Delta) {
        format!(
            "; from the buckets, {f}() answers windows of whole buckets ([1h], [1d] at times \
             on bucket boundaries)"
        )
    } else {
        String::new()
    };
    if let Some(why) = elsewhere {
        // A query node: the readings are on the gateway.
        return format!(
            "{name}: {f}() needs the raw readings of each window, with their times, and {why}\
             {but}: it has no point there; ask the gateway's own /prom for it"
        );
    }
    format!(
        "{name}: {f}() needs the raw readings of each window, with their times; where they are \
         not all kept (past store.raw_retention, store_raw = false, a central's or a query \
         node's buckets) or are over http.max_points_per_query, it has no point{but}"
    )
}

/// What an answer says of a series whose windows came from whole buckets although its raw
/// readings were asked for: they were over the query's budget.
fn estimated_note(name: &str, max_points: u64) -> String {
    format!(
        "{name}: the raw readings of its windows are more than http.max_points_per_query \
         ({max_points}) allows; answered from whole buckets (exact only where each window is \
         whole buckets). Ask for fewer series, a shorter range or a coarser step for the exact \
         answer"
    )
}

/// The raw readings of the range functions over `bucketd_reading`: per matched series, the
/// whole buckets its windows touch, kept where each bucket's raw readings are all there (their
/// count is the bucket's). Within `left` readings in all (shared with [`read_raw`]); a series
/// past it, or whose windows would visit more than `work` readings (told by its buckets'
/// counts, before reading), or a source that keeps no raw readings, is answered from its
/// buckets.
fn read_exact<E>(
    placed: &[Placed<'_>],
    names: &[SeriesLabels<'_>],
    stored: &Read<'_>,
    budget: &Budget,
    left: &mut u64,
    raw: &mut impl FnMut(&str, i64, i64, u64) -> Result<Raw, E>,
) -> Result<(ExactReadings, Option<&'static str>), EvalError<E>> {
    let (width, data, work) = (stored.width_ms, stored.data, stored.work);
    let mut out = BTreeMap::new();
    for &Placed { s, grid, .. } in placed
        .iter()
        .filter(|p| p.s.range_secs.is_some() && p.s.selector.selects_readings())
    {
        let shift = s.offset_secs.saturating_mul(1000);
        let range = s.range_secs.unwrap_or(0).saturating_mul(1000);
        let first = bucket_of(
            grid.start_ms.saturating_sub(shift).saturating_sub(range),
            width,
        );
        let end = bucket_of(grid.last_ms().saturating_sub(shift), width).saturating_add(width);
        let Ok(buckets) = usize::try_from(end.saturating_sub(first) / width) else {
            continue;
        };
        for name in names
            .iter()
            .filter(|l| s.selector.matches_series(l))
            .map(|l| l.series)
        {
            let key = (name.to_owned(), s.offset_secs, range, grid.key());
            let Some(stored) = data.get(name) else {
                continue; // no buckets: no readings
            };
            if out.contains_key(&key) {
                continue;
            }
            let counted = stored.counted(first, width, buckets);
            // Too many to read, or to visit: the buckets whole inside each window alone say so.
            let whole_inside = |t: i64| {
                let t0 = t.saturating_sub(shift);
                let a = t0
                    .saturating_sub(range)
                    .saturating_sub(first)
                    .saturating_add(width - 1)
                    .div_euclid(width);
                let b = t0
                    .saturating_sub(first)
                    .saturating_sub(width)
                    .div_euclid(width)
                    .saturating_add(1);
                match (usize::try_from(a), usize::try_from(b)) {
                    (Ok(a), Ok(b)) if a < b && b <= buckets => counted[b] - counted[a],
                    _ => 0,
                }
            };
            let visits = grid
                .times()
                .fold(0_u64, |n, t| n.saturating_add(whole_inside(t)));
            let (from, to) = (
                first.saturating_mul(1_000_000),
                end.saturating_mul(1_000_000),
            );
            let read = if counted[buckets] > *left || visits > work {
                Raw::TooMany
            } else {
                raw(name, from, to, *left).map_err(EvalError::Read)?
            };
            let readings = match read {
                Raw::Readings(readings) => readings,
                Raw::TooMany => {
                    budget.note(|| estimated_note(name, budget.max_points));
                    continue;
                }
                Raw::NotKept(why) => return Ok((out, Some(why))),
            };
            *left = left.saturating_sub(readings.len() as u64);
            let readings: Vec<(i64, f64)> = readings
                .into_iter()
                .map(|(ns, v)| (ns.div_euclid(1_000_000), v))
                .collect();
            // Readings per bucket against the bucket's count.
            let mut kept = vec![0_u64; buckets];
            for r in &readings {
                if let Some(k) =
                    usize::try_from(bucket_of(r.0, width).saturating_sub(first) / width)
                        .ok()
                        .and_then(|k| kept.get_mut(k))
                {
                    *k += 1;
                }
            }
            let mut incomplete = Vec::with_capacity(buckets + 1);
            incomplete.push(0_u32);
            for (k, kept) in kept.iter().enumerate() {
                let missing = incomplete[k] + u32::from(counted[k + 1] - counted[k] != *kept);
                incomplete.push(missing);
            }
            let exact = Exact {
                readings,
                first,
                width,
                incomplete,
            };
            out.insert(key, exact);
        }
    }
    Ok((out, None))
}

/// Labels without `__name__`.
fn unnamed(mut labels: BTreeMap<String, String>) -> BTreeMap<String, String> {
    labels.remove("__name__");
    labels
}

/// A range function's labels: its series' own, without `__name__` except for `last_over_time`,
/// which answers a sample as it was (Prometheus drops the name for every other function).
fn range_function_labels(func: Func, labels: Labels) -> Labels {
    if func == Func::LastOverTime {
        labels
    } else {
        unnamed(labels)
    }
}

impl<'a> Ctx<'a> {
    /// A function call: by what the function takes.
    fn call(&self, func: Func, args: &[Expr]) -> Result<Value, Refusal> {
        match func {
            f @ (Func::LabelReplace | Func::LabelJoin) => self.relabel(f, args),
            Func::Pi => Ok(Value::Scalar(std::f64::consts::PI)),
            Func::HistogramQuantile => Ok(Value::Vector(ops::histogram_quantile(
                args[0].number().unwrap_or(f64::NAN),
                self.vector(&args[1])?,
            ))),
            Func::Absent => {
                let inner = self.vector(&args[0])?;
                let labels = match &args[0] {
                    Expr::Select(s) => s.selector.equal_labels(),
                    _ => BTreeMap::new(),
                };
                Ok(Value::Vector(vec![self.absent(&inner, labels)]))
            }
            f @ (Func::Time | Func::Vector | Func::Scalar | Func::Date(_)) => self.of_time(f, args),
            Func::Map(m) => {
                let params: Vec<f64> = args[1..].iter().filter_map(Expr::number).collect();
                let series = self.vector(&args[0])?;
                Ok(Value::Vector(
                    series
                        .into_iter()
                        .map(|s| Series {
                            labels: unnamed(s.labels),
                            points: s
                                .points
                                .into_iter()
                                .filter_map(|(t, v)| Some((t, m.apply(v, &params)?)))
                                .collect(),
                        })
                        .filter(|s| !s.points.is_empty())
                        .collect(),
                ))
            }
            Func::Timestamp => Ok(Value::Vector(self.timestamps(&args[0])?)),
            f @ (Func::Sort | Func::SortDesc) => {
                let mut series = self.vector(&args[0])?;
                ops::sort_by_value(&mut series, f == Func::SortDesc);
                Ok(Value::Vector(series))
            }
            func => {
                // quantile_over_time's φ, predict_linear's seconds, holt_winters' factors.
                let params: Vec<f64> = args.iter().filter_map(Expr::number).collect();
                if let Some(q) = args.iter().find_map(|a| match a {
                    Expr::Subquery(q) => Some(q),
                    _ => None,
                }) {
                    return self.over_subquery(func, &params, q);
                }
                let Some(s) = args.iter().find_map(|a| match a {
                    Expr::Select(s) => Some(s),
                    _ => None,
                }) else {
                    return Err(Refusal::Unsupported(
                        "a range function takes a range selector or a subquery".into(),
                    ));
                };
                if func == Func::AbsentOverTime {
                    let present = self.over_time(Func::PresentOverTime, &params, s)?;
                    return Ok(Value::Vector(vec![
                        self.absent(&present, s.selector.equal_labels()),
                    ]));
                }
                self.over_time(func, &params, s).map(Value::Vector)
            }
        }
    }

    fn eval(&self, expr: &Expr) -> Result<Value, Refusal> {
        match expr {
            Expr::Number(n) => Ok(Value::Scalar(*n)),
            Expr::Str(_) => Err(Refusal::Unsupported(
                "a string goes only in label_replace and label_join".into(),
            )),
            Expr::Select(s) => Ok(Value::Vector(self.plain(s))),
            Expr::Call(func, args) => self.call(*func, args),
            Expr::Aggregate {
                op,
                parameter,
                grouping,
                inner,
            } => {
                if let (crate::promql::AggOp::CountValues, Some(label)) =
                    (op, parameter.as_deref().and_then(Expr::string))
                {
                    return Ok(Value::Vector(ops::count_values(
                        label,
                        grouping,
                        self.vector(inner)?,
                    )));
                }
                let param = parameter.as_ref().and_then(|p| p.number());
                Ok(Value::Vector(aggregate(
                    *op,
                    param.unwrap_or(f64::NAN),
                    grouping,
                    self.vector(inner)?,
                )))
            }
            Expr::Binary {
                op,
                bool_result,
                matching,
                group,
                lhs,
                rhs,
            } => binary(
                *op,
                *bool_result,
                (matching, group.as_ref()),
                self.eval(lhs)?,
                self.eval(rhs)?,
            ),
            Expr::Subquery(_) => Err(Refusal::Unsupported(
                "a subquery goes inside a range function".into(),
            )),
            Expr::Negate(e) => Ok(match self.eval(e)? {
                Value::Scalar(n) => Value::Scalar(-n),
                Value::Timed(points) => {
                    Value::Timed(points.into_iter().map(|(t, v)| (t, -v)).collect())
                }
                Value::Vector(series) => Value::Vector(
                    series
                        .into_iter()
                        .map(|s| Series {
                            labels: unnamed(s.labels),
                            points: s.points.into_iter().map(|(t, v)| (t, -v)).collect(),
                        })
                        .collect(),
                ),
            }),
        }
    }

    /// `label_replace` and `label_join`.
    fn relabel(&self, f: Func, args: &[Expr]) -> Result<Value, Refusal> {
        let strings: Vec<&str> = args[1..].iter().filter_map(Expr::string).collect();
        let series = self.vector(&args[0])?;
        ops::relabel(f, &strings, series).map(Value::Vector)
    }

    /// `time()`, `vector(s)`, `scalar(v)` and the date functions.
    fn of_time(&self, f: Func, args: &[Expr]) -> Result<Value, Refusal> {
        let now =
            || -> Vec<(i64, f64)> { self.grid.times().map(|t| (t, t as f64 / 1000.0)).collect() };
        Ok(match f {
            Func::Time => Value::Timed(now()),
            Func::Vector => {
                let points = match self.eval(&args[0])? {
                    Value::Scalar(n) => self.grid.times().map(|t| (t, n)).collect(),
                    Value::Timed(points) => points,
                    Value::Vector(_) => {
                        return Err(Refusal::Unsupported(
                            "vector() takes a number, found series".into(),
                        ));
                    }
                };
                Value::Vector(vec![Series {
                    labels: BTreeMap::new(),
                    points,
                }])
            }
            Func::Scalar => {
                let series = self.vector(&args[0])?;
                let mut at: BTreeMap<i64, (usize, f64)> = BTreeMap::new();
                for s in &series {
                    for &(t, v) in &s.points {
                        let e = at.entry(t).or_insert((0, v));
                        e.0 += 1;
                    }
                }
                Value::Timed(
                    self.grid
                        .times()
                        .map(|t| match at.get(&t) {
                            Some(&(1, v)) => (t, v),
                            _ => (t, f64::NAN),
                        })
                        .collect(),
                )
            }
            Func::Date(d) => {
                let series = match args.first() {
                    Some(a) => self.vector(a)?,
                    None => vec![Series {
                        labels: BTreeMap::new(),
                        points: now(),
                    }],
                };
                Value::Vector(
                    series
                        .into_iter()
                        .map(|s| Series {
                            labels: unnamed(s.labels),
                            points: s.points.into_iter().map(|(t, v)| (t, d.apply(v))).collect(),
                        })
                        .collect(),
                )
            }
            _ => unreachable!("of_time takes the time functions"),
        })
    }

    fn vector(&self, expr: &Expr) -> Result<Vec<Series>, Refusal> {
        match self.eval(expr)? {
            Value::Vector(v) => Ok(v),
            Value::Scalar(_) | Value::Timed(_) => Err(Refusal::Unsupported(
                "expected series, found a number".into(),
            )),
        }
    }

    /// The stored series a selector matches, with their buckets (none read: empty).
    fn matched<'s>(
        &'s self,
        s: &'s Select,
    ) -> impl Iterator<Item = (&'s SeriesLabels<'a>, &'s Stored)> + 's {
        static EMPTY: std::sync::OnceLock<Stored> = std::sync::OnceLock::new();
        let empty = EMPTY.get_or_init(Stored::default);
        self.names
            .iter()
            .filter(|l| s.selector.matches_series(l))
            .map(move |l| (l, self.data.get(l.series).unwrap_or(empty)))
    }

    /// A plain selector: each matched series' fields at each time.
    fn plain(&self, s: &Select) -> Vec<Series> {
        let w = self.width_ms;
        // Whole buckets here, else the query was refused when planned (`place`).
        let window_ms = self.window_ms.unwrap_or(w);
        let mut out = self.last_readings(s, false);
        let fields = s.selector.fields();
        for (labels, stored) in self.matched(s) {
            let at: Vec<(i64, Option<Summary>)> = self
                .grid
                .times()
                .map(|t| {
                    let t0 = s.time(t);
                    let summary = if window_ms == w {
                        let start = bucket_of(t0, w);
                        stored.merged(start, start.saturating_add(w)).or_else(|| {
                            self.grid
                                .look_back
                                .then(|| stored.merged(start.saturating_sub(w), start))
                                .flatten()
                        })
                    } else {
                        stored.merged(t0, t0.saturating_add(window_ms))
                    };
                    (t, summary)
                })
                .collect();
            for &field in &fields {
                let points = at
                    .iter()
                    .filter_map(|(t, s)| Some((*t, field.value(s.as_ref()?)?)))
                    .collect();
                out.push(Series {
                    labels: labels.with_name(field),
                    points,
                });
            }
        }
        out
    }

    /// A plain `bucketd_reading` selector, as Prometheus answers an instant vector selector: at
    /// each time `t`, each matched series' last raw reading in `[t - 5m, t]` (Prometheus 2.42's
    /// look-back; found by `.ci/heldout/promdiff`, a reading exactly 5 minutes back). With
    /// `times`, the reading's time (seconds, to the millisecond as Prometheus keeps it) for
    /// its value: `timestamp(bucketd_reading{..})`.
    fn last_readings(&self, s: &Select, times: bool) -> Vec<Series> {
        if !s.selector.names_readings() {
            return Vec::new();
        }
        let key = |series: &str| (series.to_owned(), s.offset_secs, self.grid.of(s).key());
        let mut out = Vec::new();
        for labels in self.names.iter().filter(|l| s.selector.matches_series(l)) {
            let Some(readings) = self.raw.get(&key(labels.series)) else {
                continue;
            };
            let points: Vec<(i64, f64)> = self
                .grid
                .times()
                .take_while(|_| !self.budget.cancelled())
                .filter_map(|t| {
                    let t0 = s.time(t).saturating_mul(1_000_000);
                    let after = t0.saturating_sub(self.grid.lookback_ms.saturating_mul(1_000_000));
                    // The last reading at or before t0.
                    let at = readings.partition_point(|r| r.0 <= t0);
                    let &(ts, value) = readings.get(at.checked_sub(1)?)?;
                    let value = if times {
                        ts.div_euclid(1_000_000) as f64 / 1000.0
                    } else {
                        value
                    };
                    // Prometheus 2.42's look-back includes its start (3.0 made it left-open).
                    (ts >= after).then_some((t, value))
                })
                .collect();
            out.push(Series {
                labels: s.selector.reading_labels(labels),
                points,
            });
        }
        out
    }

    /// A range function over a range selector: per matched series, over the readings (merged)
    /// and over each field's bucket values (samples).
    fn over_time(&self, func: Func, params: &[f64], s: &Select) -> Result<Vec<Series>, Refusal> {
        let q = params.first().copied().unwrap_or(f64::NAN);
        let range = s.range_secs.unwrap_or(0).saturating_mul(1000);
        let w = self.width_ms;
        let (fields, readings) = what_a_range_function_takes(func, s)?;
        let mut out = Vec::new();
        for (labels, stored) in self.matched(s) {
            let in_range = |t: i64| {
                let t0 = s.time(t);
                // Buckets overlapping [t0 - range, t0): starting after t0 - range - width.
                stored.span(
                    t0.saturating_sub(range).saturating_sub(w).saturating_add(1),
                    t0,
                )
            };
            if readings {
                // Exact windows where the raw readings are all kept (and within the work bound);
                // else the buckets. The windows only move forward as `t` grows: each bucket is
                // merged in and out a bounded number of times, not once per point (issue 53: a
                // 700-hour window at a one-second step merged 700 buckets at each of 10,801
                // points, 35 s a query).
                let exact = self.exact_for(labels.series, s);
                let mut values: Vec<f64> = Vec::new();
                let mut window = Sliding::new(&stored.summaries);
                let mut last: Option<((usize, usize), Option<f64>)> = None;
                let points = self
                    .grid
                    .times()
                    .take_while(|_| !self.budget.cancelled())
                    .filter_map(|t| {
                        let t0 = s.time(t);
                        let raw = exact.and_then(|e| e.window(t0.saturating_sub(range), t0));
                        if func.needs_times() {
                            let window = (t0.saturating_sub(range), t0, range);
                            let Some(raw) = raw else {
                                let whole = t0 % w == 0 && range % w == 0;
                                let span = whole.then(|| in_range(t));
                                let v = self.counter_of_buckets(func, labels, stored, span, window);
                                return Some((t, v?));
                            };
                            return Some((t, of_timed(func, params, raw, t, window)?));
                        }
                        if let Some(raw) = raw {
                            values.clear();
                            values.extend(raw.iter().map(|r| r.1));
                            return Some((t, of_samples(func, q, &values)?));
                        }
                        let span = in_range(t);
                        let value = match last {
                            Some((was, value)) if was == span => value,
                            _ => window.over(span).and_then(|m| of_readings(func, q, &m)),
                        };
                        last = Some((span, value));
                        if value.is_some() && (t0 % w != 0 || range % w != 0) {
                            // Whole buckets for a window that is not: never silently.
                            self.budget.note(|| from_buckets_note(labels.series, w));
                        }
                        Some((t, value?))
                    })
                    .collect();
                out.push(Series {
                    labels: range_function_labels(func, s.selector.reading_labels(labels)),
                    points,
                });
            }
            for &field in &fields {
                // Points whose window holds the same buckets share its value (a step shorter
                // than a bucket).
                let mut last: Option<((usize, usize), Option<f64>)> = None;
                let points = self
                    .grid
                    .times()
                    .take_while(|_| !self.budget.cancelled())
                    .filter_map(|t| {
                        let span = in_range(t);
                        let value = match last {
                            Some((was, value)) if was == span => value,
                            _ => {
                                let samples: Vec<f64> = stored.summaries[span.0..span.1]
                                    .iter()
                                    .filter_map(|s| field.value(s))
                                    .collect();
                                of_samples(func, q, &samples)
                            }
                        };
                        last = Some((span, value));
                        Some((t, value?))
                    })
                    .collect();
                out.push(Series {
                    labels: range_function_labels(func, labels.with_name(field)),
                    points,
                });
            }
        }
        Ok(out)
    }

    /// `rate`, `increase` or `delta` of a window whose raw readings are not all there, from its
    /// buckets where it is whole buckets (`span`, their indexes) and they know what it takes
    /// (a counter's increase); else no point, and the answer's warnings say why.
    fn counter_of_buckets(
        &self,
        func: Func,
        labels: &SeriesLabels<'_>,
        stored: &Stored,
        span: Option<(usize, usize)>,
        window: (i64, i64, i64),
    ) -> Option<f64> {
        let answers = matches!(func, Func::Rate | Func::Increase | Func::Delta);
        // Each point visits its window's buckets: within the query's work bound, as the exact
        // windows' readings are (past it, no point, and the warning says why).
        let left = self.work_left.get();
        if span.is_some_and(|(a, b)| (b - a) as u64 > left) {
            self.budget.note(|| {
                format!(
                    "{}: {}() over its buckets would visit more than {EXACT_WORK_PER_POINT} x \
                     http.max_points_per_query buckets in all; it has no point past that: use \
                     a coarser step or a shorter range",
                    labels.series,
                    func.name()
                )
            });
            return None;
        }
        let from_buckets = span.filter(|_| answers).map(|(a, b)| {
            self.work_left.set(left - (b - a) as u64);
            ops::counter_of_buckets(func, &stored.summaries[a..b], window)
        });
        if let Some(Ok(v)) = from_buckets {
            return v;
        }
        self.budget.note(|| {
            needs_readings_note(
                labels.series,
                func,
                (span.is_some() && answers, self.raw_elsewhere),
            )
        });
        None
    }

    /// The raw readings for the exact windows of `s` over `name`, if they were read and
    /// visiting every point's window stays within the query's work bound (which it then uses).
    fn exact_for(&self, name: &str, s: &Select) -> Option<&'a Exact> {
        let range = s.range_secs.unwrap_or(0).saturating_mul(1000);
        let grid = self.grid.of(s);
        let exact = self
            .exact
            .get(&(name.to_owned(), s.offset_secs, range, grid.key()))?;
        let mut visits: u64 = 0;
        for t in grid.times() {
            let t0 = s.time(t);
            let lo = exact
                .readings
                .partition_point(|r| r.0 < t0.saturating_sub(range));
            let hi = exact.readings.partition_point(|r| r.0 <= t0);
            visits = visits.saturating_add(hi.saturating_sub(lo) as u64);
        }
        let left = self.work_left.get();
        if visits > left {
            self.budget
                .note(|| estimated_note(name, self.budget.max_points));
            return None;
        }
        self.work_left.set(left - visits);
        Some(exact)
    }

    /// `timestamp(v)`: a plain `bucketd_reading` selector's readings' own times, as
    /// Prometheus gives a vector selector's samples' times; of anything else (a bucket
    /// field's point too), the point's time.
    fn timestamps(&self, arg: &Expr) -> Result<Vec<Series>, Refusal> {
        // A point's own time for its value, without the metric name.
        let at_its_time = |f: Series| Series {
            points: f
                .points
                .iter()
                .map(|&(t, _)| (t, t as f64 / 1000.0))
                .collect(),
            labels: unnamed(f.labels),
        };
        Ok(match arg {
            Expr::Select(s) if s.selector.names_readings() => {
                let fields = self.plain(s).into_iter().filter(|f| {
                    let name = f.labels.get("__name__").map(String::as_str);
                    Field::ALL
                        .iter()
                        .any(|field| name == Some(field.metric_name()))
                });
                let readings = self.last_readings(s, true).into_iter().map(|r| Series {
                    labels: unnamed(r.labels),
                    ..r
                });
                readings.chain(fields.map(at_its_time)).collect()
            }
            _ => self.vector(arg)?.into_iter().map(at_its_time).collect(),
        })
    }

    /// A range function over a subquery: its expression evaluated once at the subquery's grid
    /// (shared by every point), then each point's window `[t - range, t]` (moved by its offset,
    /// or at its `@` time) of those values, as over a range selector's samples.
    fn over_subquery(&self, func: Func, params: &[f64], q: &Subquery) -> Result<Value, Refusal> {
        let grid = self.grid.of_subquery(q, self.budget.max_points)?;
        let inner = Ctx {
            grid,
            window_ms: window_ms(grid.step_ms, self.width_ms / 1000).ok(),
            ..*self
        };
        let series = inner.vector(&q.inner)?;
        let shift = q.offset_secs.saturating_mul(1000);
        let time = |t: i64| match q.at {
            Some(At::Ms(ms)) => ms,
            _ => t,
        };
        let quantile = params.first().copied().unwrap_or(f64::NAN);
        let absent = func == Func::AbsentOverTime;
        let func = if absent { Func::PresentOverTime } else { func };
        let mut out = Vec::with_capacity(series.len());
        let mut values = Vec::new();
        for s in series {
            let mut points = Vec::new();
            for t in self.grid.times() {
                if self.budget.cancelled() {
                    break;
                }
                let t0 = time(t).saturating_sub(shift);
                let from = t0.saturating_sub(q.range_ms);
                let lo = s.points.partition_point(|p| p.0 < from);
                let hi = s.points.partition_point(|p| p.0 <= t0);
                let window = &s.points[lo..hi.max(lo)];
                // Each point's window is visited: bounded as the exact windows are.
                let left = self.work_left.get();
                if window.len() as u64 > left {
                    return Err(Refusal::TooLarge(format!(
                        "the subquery's windows visit more than {} values in all \
                         (http.max_points_per_query x {EXACT_WORK_PER_POINT}); use a coarser \
                         subquery step or a coarser query step",
                        self.budget.max_points.saturating_mul(EXACT_WORK_PER_POINT)
                    )));
                }
                self.work_left.set(left - window.len() as u64);
                let value = if func.needs_times() {
                    of_timed(func, params, window, t, (from, t0, q.range_ms))
                } else {
                    values.clear();
                    values.extend(window.iter().map(|p| p.1));
                    of_samples(func, quantile, &values)
                };
                if let Some(v) = value {
                    points.push((t, v));
                }
            }
            out.push(Series {
                labels: range_function_labels(func, s.labels),
                points,
            });
        }
        if absent {
            return Ok(Value::Vector(vec![self.absent(&out, BTreeMap::new())]));
        }
        Ok(Value::Vector(out))
    }

    /// 1 at each time no series of `present` has a point, with `labels`.
    fn absent(&self, present: &[Series], labels: BTreeMap<String, String>) -> Series {
        let seen: BTreeSet<i64> = present
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .collect();
        Series {
            labels,
            points: self
                .grid
                .times()
                .filter(|t| !seen.contains(t))
                .map(|t| (t, 1.0))
                .collect(),
        }
    }
}
