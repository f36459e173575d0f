//! The deltas waiting to be folded, merged per bucket as they are committed: a read of one
//! series then merges one summary per bucket and run, whatever the number of commits waiting
//! instead of every entry of every commit.
//!
//! The commits are cut into [`Run`]s: a run is closed when a checkpoint begins, so that a
//! checkpoint folds whole runs, and the fold merges the same merged summaries onto the stored
//! documents as the readers do. Merging in another grouping gives sums and variances that may
//! differ in the last bits; merging the same runs gives the documents a reader saw, bit for bit.
//!
//! Bounded by [`crate::limits::MERGED_BUCKETS`], half of it a run ([`Runs::add`]): a series
//! whose bucket would go past it is marked [`Series::Spilled`] for the run, and is read (and
//! folded) entry by entry from the run's records, as when nothing was merged. A run whose record could not be read holds nothing
//! merged ([`Run::series`] answers `Spilled` for all).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::commitlog::{Corrupt, Entry, Record};
use crate::summary::Summary;

/// A bucket's deltas in one run, merged in commit order, and its raw readings' count.
#[derive(Debug, Clone)]
pub(super) struct Merged {
    pub summary: Summary,
    pub raw: u64,
}

impl Merged {
    /// The merged deltas onto `base` (a stored summary), or alone: the one rule of the readers
    /// and the checkpoint, so that both give the same bits.
    pub(super) fn onto(&self, base: Option<Summary>) -> Summary {
        match base {
            Some(mut s) => {
                s.merge(&self.summary);
                s
            }
            None => self.summary.clone(),
        }
    }
}

/// One series in a run.
#[derive(Debug, Clone)]
pub(super) enum Series {
    /// Its buckets' merged deltas, by start.
    Cached(BTreeMap<i64, Merged>),
    /// Past the bound: read from the run's records.
    Spilled,
}

/// Consecutive commits `first..=last` folded by the same checkpoint.
#[derive(Debug, Clone)]
pub(super) struct Run {
    pub first: u64,
    pub last: u64,
    /// A checkpoint began after it: no commit joins it any more.
    closed: bool,
    /// A record could not be read: nothing is merged, every series is read from the records.
    unreadable: bool,
    series: HashMap<u64, Arc<Series>>,
    /// Buckets in `series`.
    buckets: usize,
    /// How many more buckets it may merge.
    room: usize,
}

const SPILLED: &Series = &Series::Spilled;

impl Run {
    fn new(seq: u64, room: usize) -> Run {
        Run {
            first: seq,
            last: seq,
            closed: false,
            unreadable: false,
            series: HashMap::new(),
            buckets: 0,
            room,
        }
    }

    /// Series `id` in the run: `None` when none of its commits holds it.
    pub(super) fn series(&self, id: u64) -> Option<&Series> {
        if self.unreadable {
            return Some(SPILLED);
        }
        self.series.get(&id).map(|s| &**s)
    }

    /// The series with merged buckets, in no particular order.
    pub(super) fn cached(&self) -> impl Iterator<Item = (u64, &BTreeMap<i64, Merged>)> {
        self.series
            .iter()
            .filter(|_| !self.unreadable)
            .filter_map(|(&id, s)| match &**s {
                Series::Cached(b) => Some((id, b)),
                Series::Spilled => None,
            })
    }

    /// Whether some series' entries of this run are read from its records.
    pub(super) fn spills(&self) -> bool {
        self.unreadable || self.series.values().any(|s| matches!(**s, Series::Spilled))
    }

    /// Whether series `id`'s entries of this run are read from its records.
    pub(super) fn spilled(&self, id: u64) -> bool {
        matches!(self.series(id), Some(Series::Spilled))
    }

    /// Adds one entry.
    fn add(&mut self, e: &Entry<'_>) -> Result<(), Corrupt> {
        let room = &mut self.room;
        let slot = self.series.entry(e.series_id);
        let series = match slot {
            std::collections::hash_map::Entry::Occupied(o) => Arc::make_mut(o.into_mut()),
            std::collections::hash_map::Entry::Vacant(v) => {
                let fresh = if *room == 0 {
                    Series::Spilled
                } else {
                    Series::Cached(BTreeMap::new())
                };
                Arc::make_mut(v.insert(Arc::new(fresh)))
            }
        };
        let Series::Cached(buckets) = series else {
            return Ok(());
        };
        let raw = raw_count(e)?;
        if let Some(m) = buckets.get_mut(&e.start) {
            e.merge_into(&mut m.summary)?;
            m.raw = m.raw.saturating_add(raw);
            return Ok(());
        }
        if *room == 0 {
            // Past the bound: the series is read from the records for this run.
            *room += buckets.len();
            self.buckets -= buckets.len();
            *series = Series::Spilled;
            return Ok(());
        }
        buckets.insert(
            e.start,
            Merged {
                summary: e.summary()?,
                raw,
            },
        );
        *room -= 1;
        self.buckets += 1;
        Ok(())
    }
}

/// How many raw readings `e` carries.
pub(super) fn raw_count(e: &Entry<'_>) -> Result<u64, Corrupt> {
    if !e.has_raw() {
        return Ok(0);
    }
    if let Some(n) = e.raw_count() {
        return Ok(n);
    }
    let mut raw = Vec::new();
    e.raw_into(&mut raw)?;
    Ok(raw.len() as u64)
}

/// Most buckets merged: [`crate::limits::MERGED_BUCKETS`] (tests lower it, to spill).
fn limit() -> usize {
    #[cfg(test)]
    if let Some(n) = LIMIT_FOR_TESTS.get() {
        return n;
    }
    crate::limits::MERGED_BUCKETS
}

#[cfg(test)]
thread_local! {
    /// Test seam: a lower bound than [`crate::limits::MERGED_BUCKETS`] on this thread.
    pub(super) static LIMIT_FOR_TESTS: std::cell::Cell<Option<usize>> =
        const { std::cell::Cell::new(None) };
}

/// The runs of the commits waiting, oldest first.
#[derive(Debug, Clone, Default)]
pub(super) struct Runs {
    runs: Vec<Arc<Run>>,
    /// Buckets merged in all runs.
    buckets: usize,
}

impl Runs {
    /// The runs, oldest first.
    pub(super) fn all(&self) -> &[Arc<Run>] {
        &self.runs
    }

    /// Adds commit `seq`'s record (commits come in order), to the open run or a new one.
    ///
    /// Each run may merge half the bound, decided by its own records alone, so that the runs
    /// read back from the file after a restart merge what the runs before it merged, and
    /// readers see the same sums bit for bit. There are two runs at most (the one a checkpoint
    /// folds, and the commits since) unless checkpoints failed: a third merges nothing.
    pub(super) fn add(&mut self, seq: u64, record: &[u8]) {
        if self.runs.last().is_none_or(|r| r.closed) {
            let room = if self.runs.len() < 2 { limit() / 2 } else { 0 };
            self.runs.push(Arc::new(Run::new(seq, room)));
        }
        let run = Arc::make_mut(self.runs.last_mut().expect("pushed above"));
        run.last = seq;
        if run.unreadable {
            return;
        }
        let before = run.buckets;
        let added = Record::parse(record)
            .and_then(|r| r.entries().try_for_each(|e| e.and_then(|e| run.add(&e))));
        if added.is_err() {
            run.unreadable = true;
            run.series.clear();
            run.buckets = 0;
        }
        self.buckets = self.buckets - before + run.buckets;
    }

    /// Closes the open run if it ends at or before `seq`: rebuilding the runs of a checkpoint
    /// under way, which folds the commits up to `seq`.
    pub(super) fn close_through(&mut self, seq: u64) {
        if self.runs.last().is_some_and(|r| r.last <= seq) {
            self.close();
        }
    }

    /// Closes the open run: a checkpoint of every commit so far begins.
    pub(super) fn close(&mut self) {
        if let Some(run) = self.runs.last_mut().filter(|r| !r.closed) {
            Arc::make_mut(run).closed = true;
        }
    }

    /// Drops the runs up to commit `seq` (folded). A checkpoint folds whole runs.
    pub(super) fn drop_through(&mut self, seq: u64) {
        debug_assert!(
            self.runs.iter().all(|r| r.last <= seq || r.first > seq),
            "a checkpoint folds whole runs"
        );
        let gone: usize = self
            .runs
            .iter()
            .filter(|r| r.last <= seq)
            .map(|r| r.buckets)
            .sum();
        self.runs.retain(|r| r.last > seq);
        self.buckets -= gone;
    }
}

#[cfg(test)]
mod tests;
