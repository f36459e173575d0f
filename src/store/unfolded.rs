//! What a reader merges of the commits not folded yet ([`Unfolded::read`]): run by run, a
//! series' merged buckets ([`super::merged`]) or its entries in the run's records, found with
//! their indexes; the checkpoint folds the same.

use std::collections::BTreeMap;

use redb::ReadableTable;

use super::log::{FoldCursor, LOG};
use super::records::{visit_indexed, visit_record};
use super::view::View;
use crate::commitlog::{Entry, RecordIndex};
use crate::summary::Summary;

/// What the log holds for some buckets, for a reader: the deltas in commit order, and the raw
/// readings in arrival order.
#[derive(Debug, Default)]
pub(super) struct Unfolded {
    pub deltas: BTreeMap<(u64, i64), Summary>,
    pub raw: BTreeMap<(u64, i64), Vec<(i64, f64)>>,
    /// Raw readings per bucket (with the deltas): what the fold appends to its pages.
    pub raw_counts: BTreeMap<(u64, i64), u64>,
}

/// Which buckets a reader wants: of the series `ids` (sorted; all when `None`), starting in
/// `starts` (seconds).
#[derive(Debug, Clone, Copy)]
pub(super) struct Which<'a> {
    pub ids: Option<&'a [u64]>,
    pub starts: (i64, i64),
}

impl Which<'_> {
    fn wants(&self, key: (u64, i64)) -> bool {
        (self.starts.0..self.starts.1).contains(&key.1)
            && self.ids.is_none_or(|ids| ids.binary_search(&key.0).is_ok())
    }
}

impl Unfolded {
    /// For the buckets `which` names: the unfolded deltas (merged in commit order onto `base`,
    /// the stored document's summary when there is one), or with `raw_only` only their raw
    /// readings (a raw read needs no summary, and folding one per entry is the costly part).
    /// Run by run ([`super::merged`]): a series' buckets merged in the run, else its entries
    /// in the run's records, found with their indexes ([`visit_indexed`]); a run without the
    /// series is passed over. So a read's cost follows what it asks for, not how much waits to
    /// be folded, and it merges what the checkpoint will fold, the same way.
    pub(super) fn read(
        view: &View,
        which: Which<'_>,
        raw_only: bool,
        base: impl Fn(u64, i64) -> Result<Option<Summary>, redb::Error>,
    ) -> Result<Unfolded, redb::Error> {
        let mut read = Reading {
            out: Unfolded::default(),
            which,
            raw_only,
            cursor: view.cursor,
            base,
        };
        let table = match view.tx.open_table(LOG) {
            Ok(table) => Some(table),
            // A file opened read-only before its first open by this release (format 1).
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => return Err(e.into()),
        };
        let mut after = view.logged().last().map_or(0, |l| l.0.saturating_add(1));
        for run in view.runs() {
            after = after.max(run.last.saturating_add(1));
            let holds = |seq: u64| -> Result<bool, redb::Error> {
                Ok(match (view.is_pending(seq), &table) {
                    (Some(waits), _) => waits,
                    (None, Some(t)) => t.get(seq)?.is_some(),
                    (None, None) => false,
                })
            };
            let (first, last) = (holds(run.first)?, holds(run.last)?);
            if !first && !last {
                continue;
            }
            // The run's merged deltas stand for its commits when the view holds all of them
            // and a checkpoint under way folded all of them or none (a checkpoint folds whole
            // runs: anything else is read entry by entry).
            let whole = !raw_only
                && first
                && last
                && read
                    .cursor
                    .is_none_or(|c| run.last <= c.through || run.first > c.through);
            if whole {
                read.merged(run)?;
            }
            let from_records = |id: u64| match run.series(id) {
                None => false,
                Some(super::merged::Series::Spilled) => true,
                Some(super::merged::Series::Cached(_)) => !whole,
            };
            let ids: Option<Vec<u64>> = which
                .ids
                .map(|ids| ids.iter().copied().filter(|&id| from_records(id)).collect());
            if ids.as_ref().is_some_and(Vec::is_empty) || (ids.is_none() && whole && !run.spills())
            {
                continue;
            }
            let mut visit = |seq: u64, e: &Entry<'_>| {
                if which.ids.is_none() && !from_records(e.series_id) {
                    return Ok(());
                }
                read.entry(seq, e)
            };
            visit_run(view, table.as_ref(), run, ids.as_deref(), &mut visit)?;
        }
        // The `log` table's records committed after the view's runs were taken: read whole.
        if let Some(table) = &table {
            for row in table.range(after..)? {
                let (key, value) = row?;
                visit_record(key.value(), value.value(), |seq, e| read.entry(seq, e))?;
            }
        }
        Ok(read.out)
    }
}

/// An [`Unfolded::read`] under way.
struct Reading<'a, B> {
    out: Unfolded,
    which: Which<'a>,
    raw_only: bool,
    cursor: Option<FoldCursor>,
    base: B,
}

impl<B: Fn(u64, i64) -> Result<Option<Summary>, redb::Error>> Reading<'_, B> {
    /// The wanted buckets' merged deltas of `run`.
    fn merged(&mut self, run: &super::merged::Run) -> Result<(), redb::Error> {
        let mut add = |id: u64, buckets: &BTreeMap<i64, super::merged::Merged>| {
            for (&start, m) in buckets.range(self.which.starts.0..self.which.starts.1) {
                let key = (id, start);
                // A checkpoint under way folded it into the document already.
                if self.cursor.is_some_and(|c| c.folded(run.last, key)) {
                    continue;
                }
                if m.raw > 0 {
                    *self.out.raw_counts.entry(key).or_insert(0) += m.raw;
                }
                if let Some(have) = self.out.deltas.get_mut(&key) {
                    have.merge(&m.summary);
                    continue;
                }
                let summary = m.onto((self.base)(id, start)?);
                self.out.deltas.insert(key, summary);
            }
            Ok::<(), redb::Error>(())
        };
        match self.which.ids {
            Some(ids) => {
                for &id in ids {
                    if let Some(super::merged::Series::Cached(b)) = run.series(id) {
                        add(id, b)?;
                    }
                }
            }
            None => {
                for (id, b) in run.cached() {
                    add(id, b)?;
                }
            }
        }
        Ok(())
    }

    /// One entry of commit `seq`, if its bucket is wanted and not folded yet.
    fn entry(&mut self, seq: u64, e: &Entry<'_>) -> Result<(), redb::Error> {
        let key = (e.series_id, e.start);
        // A checkpoint under way folded it into the document already.
        if !self.which.wants(key) || self.cursor.is_some_and(|c| c.folded(seq, key)) {
            return Ok(());
        }
        let corrupt = |_| {
            redb::Error::Corrupted(format!(
                "a commit log entry of series id {} is unreadable",
                key.0
            ))
        };
        if self.raw_only {
            if e.has_raw() {
                e.raw_into(self.out.raw.entry(key).or_default())
                    .map_err(corrupt)?;
            }
            return Ok(());
        }
        if e.has_raw() {
            let n = super::merged::raw_count(e).map_err(corrupt)?;
            *self.out.raw_counts.entry(key).or_insert(0) += n;
        }
        if let Some(have) = self.out.deltas.get_mut(&key) {
            e.merge_into(have).map_err(corrupt)?;
        } else {
            let summary = e.onto((self.base)(key.0, key.1)?).map_err(corrupt)?;
            self.out.deltas.insert(key, summary);
        }
        Ok(())
    }
}

/// Calls `visit` with the entries of series `ids` (sorted; all when `None`) of `run`'s
/// records in the view, in commit order: the `log` table's (those whose index says they
/// cannot hold one of `ids` are passed over, and a record the transaction no longer holds,
/// folded since, too), then the pending commits'.
fn visit_run<T: ReadableTable<u64, &'static [u8]>>(
    view: &View,
    table: Option<&T>,
    run: &super::merged::Run,
    ids: Option<&[u64]>,
    mut visit: impl FnMut(u64, &Entry<'_>) -> Result<(), redb::Error>,
) -> Result<(), redb::Error> {
    let range = run.first..=run.last;
    if let Some(table) = table {
        let logged = view.logged();
        let from = logged.partition_point(|l| l.0 < run.first);
        for (seq, index) in logged[from..].iter().take_while(|l| range.contains(&l.0)) {
            let index = index.as_deref();
            let none_held =
                |i: &RecordIndex| ids.is_some_and(|w| !w.iter().any(|&id| i.may_hold(id)));
            if index.is_some_and(none_held) {
                continue;
            }
            if let Some(record) = table.get(*seq)? {
                visit_indexed(*seq, record.value(), index, ids, &mut visit)?;
            }
        }
    }
    for commit in view.pending().filter(|c| range.contains(&c.seq)) {
        commit.visit(ids, &mut visit)?;
    }
    Ok(())
}
