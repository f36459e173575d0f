//! The commit log and the checkpoint: the records not folded yet (the `log` table's, left by a
//! journal's replay or a commit without the journal, then the pending commits'), folded into
//! the bucket documents and raw pages by key range, part by part ([`Store::checkpoint_part`],
//! [`FoldCursor`]); readers merge what is not folded ([`super::unfolded`]).

use std::collections::{BTreeMap, BTreeSet};

use redb::{ReadableTable, TableDefinition};

use super::records::visit_record;
use super::{
    APPLIED, BUCKETS, CommitError, DEDUP, META, PAGES, SERIES_BY_ID, SERIES_BY_NAME, Store,
    append_pages,
};
use crate::commitlog::{Entry, RecordIndex};
use crate::doc::BucketDoc;
use crate::summary::Summary;

pub(super) const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");

/// The tables a checkpoint part folds from and into, opened in its transaction.
struct PartTables<'a, 't> {
    log: &'a LogTable<'t>,
    buckets: &'a DocTable<'t>,
    pages: &'a mut PageTable<'t>,
}

/// What a checkpoint part folds: the runs of the commits it covers (and, of those, the pending
/// commits), from its cursor, for these bucket keys.
struct Part<'a> {
    runs: &'a [&'a super::merged::Run],
    in_fold: &'a [&'a super::pending::PendingCommit],
    cursor: FoldCursor,
    keys: &'a BTreeSet<(u64, i64)>,
}

/// The tables a checkpoint part writes, opened in its transaction.
type LogTable<'t> = redb::Table<'t, u64, &'static [u8]>;
type DocTable<'t> = redb::Table<'t, (u64, i64), &'static [u8]>;
type PageTable<'t> = redb::Table<'t, (u64, i64, u32), &'static [u8]>;

/// What one checkpoint part did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointStats {
    /// Log records the fold covers; deleted by its last part.
    pub records: usize,
    /// Bucket documents written, and of those, new.
    pub buckets_written: usize,
    pub buckets_created: usize,
    /// Log bytes the fold freed (its last part).
    pub bytes: u64,
    /// The fold is not finished: buckets above this part's range are left (the part's budget
    /// was reached).
    pub more: bool,
}

/// A checkpoint under way: it folds the commits up to `through`, bucket by bucket in key order,
/// a range of at most a part's budget of buckets at a time; the buckets below `from` hold those
/// commits already. Written with each part into `meta` (`fold_cursor`), so that readers, and a
/// restart after a crash, skip what is folded; removed by the last part, which deletes the
/// folded records. So each bucket is rewritten once per checkpoint however many parts it takes,
/// and a part's work is bounded by the documents it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FoldCursor {
    pub through: u64,
    pub from: (u64, i64),
}

impl FoldCursor {
    const KEY: &'static str = "fold_cursor";

    /// A new checkpoint of every commit up to `through`.
    fn new(through: u64) -> FoldCursor {
        FoldCursor {
            through,
            from: (0, i64::MIN),
        }
    }

    /// Whether the entry of bucket `key` in commit `seq` is in the documents already.
    pub(super) fn folded(&self, seq: u64, key: (u64, i64)) -> bool {
        seq <= self.through && key < self.from
    }

    /// Whether commit `seq`'s entry for `key` is this checkpoint's to fold still.
    fn due(&self, seq: u64, key: (u64, i64)) -> bool {
        seq <= self.through && key >= self.from
    }

    /// The one in `meta`, if a checkpoint is under way.
    pub(super) fn read(
        meta: &impl ReadableTable<&'static str, &'static str>,
    ) -> Result<Option<FoldCursor>, redb::Error> {
        let Some(v) = meta.get(Self::KEY)? else {
            return Ok(None);
        };
        let text = v.value();
        let mut parts = text.split(' ');
        let mut next = || parts.next().and_then(|p| p.parse::<i64>().ok());
        match (next(), next(), next()) {
            (Some(through), Some(id), Some(start)) if through >= 0 && id >= 0 => {
                Ok(Some(FoldCursor {
                    through: through as u64,
                    from: (id as u64, start),
                }))
            }
            _ => Err(redb::Error::Corrupted(format!(
                "meta {}: unreadable value {text:?}",
                Self::KEY
            ))),
        }
    }

    fn write(
        &self,
        meta: &mut redb::Table<'_, &'static str, &'static str>,
    ) -> Result<(), redb::Error> {
        let text = format!("{} {} {}", self.through, self.from.0, self.from.1);
        meta.insert(Self::KEY, text.as_str())?;
        Ok(())
    }
}

/// The key right after `key`.
fn successor(key: (u64, i64)) -> (u64, i64) {
    match key.1.checked_add(1) {
        Some(start) => (key.0, start),
        None => (key.0.saturating_add(1), i64::MIN),
    }
}

/// Calls `visit` with every entry of the records in `table` up to commit `through`, oldest
/// record first, with its commit's number; returns the bytes of those records.
fn visit_table<T: ReadableTable<u64, &'static [u8]>>(
    table: &T,
    through: u64,
    mut visit: impl FnMut(u64, &Entry<'_>) -> Result<(), redb::Error>,
) -> Result<u64, redb::Error> {
    let mut bytes = 0u64;
    for row in table.range(..=through)? {
        let (key, value) = row?;
        let record = value.value();
        visit_record(key.value(), record, &mut visit)?;
        bytes = bytes.saturating_add(record.len() as u64);
    }
    Ok(bytes)
}

/// What [`scan`] finds in the `log` table: its records' bytes, their indexes and their runs.
pub(super) type Scanned = (u64, Vec<super::pending::LoggedIndex>, super::merged::Runs);

/// Bytes of the log's records, their indexes for the readers ([`super::pending::Logged`]) and
/// their runs ([`super::merged`], cut after commit `cut`, where a checkpoint under way ends):
/// at open, after the journal's replay, and when the file is read again after a write error.
pub(super) fn scan(tx: &redb::ReadTransaction, cut: Option<u64>) -> Result<Scanned, redb::Error> {
    let table = tx.open_table(LOG)?;
    let mut total = 0u64;
    let mut indexes = Vec::new();
    let mut runs = super::merged::Runs::default();
    for row in table.iter()? {
        let (key, value) = row?;
        let (seq, record) = (key.value(), value.value());
        total = total.saturating_add(record.len() as u64);
        let index = RecordIndex::of(record).ok().map(std::sync::Arc::new);
        indexes.push((seq, index));
        if let Some(cut) = cut.filter(|&c| seq > c) {
            runs.close_through(cut);
        }
        runs.add(seq, record);
    }
    if let Some(cut) = cut {
        // The checkpoint under way folds no commit after it.
        runs.close_through(cut);
    }
    Ok((total, indexes, runs))
}

/// A bucket being folded: its summary so far, the stored document (if any), and its page count.
/// Raw readings go to the pages as each entry is read: they are not held (a full log holds
/// ~200,000), and pages written earlier in the same transaction are changed in memory.
struct Folding {
    summary: Summary,
    stored: Option<BucketDoc>,
    /// Raw pages after the readings appended so far.
    pages: i32,
}

impl Folding {
    /// The stored document (if any) with the bucket's summary so far.
    fn new(stored: Option<BucketDoc>, summary: Summary) -> Folding {
        Folding {
            summary,
            pages: stored.as_ref().map_or(0, |d| d.pages),
            stored,
        }
    }
}

impl Store {
    /// Bytes in the commit log (records and the fingerprints stored since the last
    /// checkpoint): what the next checkpoint folds.
    pub fn log_bytes(&self) -> u64 {
        self.commits.log_bytes
    }

    /// Whether anything waits to be folded: a checkpoint under way, a pending commit, or a
    /// record in the `log` table. Read from the state itself, not from [`Store::log_bytes`]
    /// (a count kept beside it, which only schedules checkpoints): a count that drifted must
    /// not end a checkpoint early, or leave commits waiting in the journal while a commit
    /// goes durably past them (issue 51).
    pub fn has_unfolded(&self) -> Result<bool, CommitError> {
        if self.fold.is_some() || !super::pending::commits(&self.commits.pending).is_empty() {
            return Ok(true);
        }
        let tx = redb::ReadableDatabase::begin_read(self.open_db()?).map_err(redb::Error::from)?;
        Ok(redb::ReadableTable::first(&tx.open_table(LOG)?)?.is_some())
    }

    /// Whether a commit not folded yet adds to a bucket that starts before `before` (seconds),
    /// or a checkpoint is under way. Retention deletes only buckets (and pages) older than its
    /// cutoffs; when no commit waiting touches one, none can come back from a later fold, and
    /// the pass need not fold first (which would rewrite every bucket the last seconds touched,
    /// right after the checkpoint that had just folded them).
    pub fn log_reaches_before(&self, before: i64) -> Result<bool, CommitError> {
        if self.fold.is_some() {
            return Ok(true);
        }
        let mut found = false;
        self.visit_unfolded(|_, e| {
            found |= e.start < before;
            Ok(())
        })?;
        Ok(found)
    }

    /// The series that a commit not folded yet adds to (in the log table or still in the
    /// journal only): retention must not delete their names, or the fold that follows finds
    /// readings of a series with no name (issue 51: a sensor back after its retention made
    /// every checkpoint fail, and the file unreadable).
    pub fn unfolded_series(&self) -> Result<std::collections::HashSet<u64>, CommitError> {
        let mut ids = std::collections::HashSet::new();
        self.visit_unfolded(|_, e| {
            ids.insert(e.series_id);
            Ok(())
        })?;
        Ok(ids)
    }

    /// Calls `visit` with every entry of every commit not folded yet: the `log` table's, then
    /// the pending commits' (in the journal only).
    fn visit_unfolded(
        &self,
        mut visit: impl FnMut(u64, &Entry<'_>) -> Result<(), redb::Error>,
    ) -> Result<(), CommitError> {
        let tx = redb::ReadableDatabase::begin_read(self.open_db()?).map_err(redb::Error::from)?;
        visit_table(&tx.open_table(LOG)?, u64::MAX, &mut visit)?;
        for commit in super::pending::commits(&self.commits.pending).iter() {
            visit_record(commit.seq, &commit.record, &mut visit)?;
        }
        Ok(())
    }

    /// Folds the whole commit log into the bucket documents and raw pages (see
    /// [`Store::checkpoint_part`]): a checkpoint under way is finished in one part, then the
    /// rest of the log is folded in another, so each touched bucket is rewritten at most twice.
    pub fn checkpoint(&mut self) -> Result<CheckpointStats, CommitError> {
        let mut total = CheckpointStats::default();
        // The one under way, then one of everything after it: two folds at most.
        for _ in 0..2 {
            let part = self.checkpoint_part(usize::MAX)?;
            total.records += part.records;
            total.buckets_written += part.buckets_written;
            total.buckets_created += part.buckets_created;
            total.bytes += part.bytes;
            debug_assert!(!part.more, "an unbounded part finishes its fold");
            if !self.has_unfolded()? {
                break;
            }
        }
        Ok(total)
    }

    /// One part of a checkpoint, in one durable transaction: folds the commits up to the
    /// checkpoint's `through` (the last commit when it began) into the next `budget` bucket
    /// documents in key order ([`FoldCursor`]): for each, reads the stored document once, merges
    /// the deltas onto it in commit order, appends the raw readings to its pages, and writes it
    /// once. The pending commits' new series are written with every part (the documents need
    /// their names); the last part, which reaches the end of the keys, also writes their
    /// fingerprints and gateway positions, deletes the folded `log` records, trims the dedup
    /// table, and drops the pending commits it folded: a crash leaves either the records or
    /// their fold for every bucket, never both or neither, and the cursor says which. Commits
    /// made between parts come after `through` and wait for the next checkpoint. Folding range
    /// after range gives the documents one fold of the whole log would, bit for bit.
    /// After an I/O error the next write transaction reopens the file first (`Store::recover`).
    pub fn checkpoint_part(&mut self, budget: usize) -> Result<CheckpointStats, CommitError> {
        let result = self.recovered().and_then(|()| self.fold_part(budget));
        self.note_failure(result)
    }

    /// [`Store::checkpoint_part`], once.
    fn fold_part(&mut self, budget: usize) -> Result<CheckpointStats, CommitError> {
        let mut stats = CheckpointStats::default();
        let pending = super::pending::commits(&self.commits.pending);
        let cursor = match self.fold {
            Some(c) => c,
            // From the state itself, never from `log_bytes` (a count that only schedules).
            None if !self.has_unfolded()? && self.dedup_trim(None).is_empty() => {
                return Ok(stats);
            }
            None => match self.commits.next_seq.checked_sub(1) {
                Some(last) => {
                    // Commits from now on wait for the next checkpoint: in a run of their own.
                    super::pending::close_run(&self.commits.pending);
                    FoldCursor::new(last)
                }
                None => return Ok(stats),
            },
        };
        let runs = super::pending::runs_now(&self.commits.pending);
        let runs: Vec<&super::merged::Run> = runs
            .iter()
            .take_while(|r| r.last <= cursor.through)
            .map(|r| &**r)
            .collect();
        let budget = budget.max(1);
        let in_fold: Vec<&super::pending::PendingCommit> = pending
            .iter()
            .take_while(|c| c.seq <= cursor.through)
            .map(|c| &**c)
            .collect();
        let tx = self.durable_tx()?;
        let folded_bytes;
        let next;
        let trimmed;
        {
            let mut log = tx.open_table(LOG)?;
            let mut buckets = tx.open_table(BUCKETS)?;
            let mut pages = tx.open_table(PAGES)?;
            let mut meta = tx.open_table(META)?;
            no_commit_outside(&runs, &log, &in_fold, cursor.through)?;
            let (keys, next_part, bytes) = part_keys(&log, &in_fold, cursor, budget, &mut stats)?;
            folded_bytes = bytes;
            next = next_part;
            let tables = PartTables {
                log: &log,
                buckets: &buckets,
                pages: &mut pages,
            };
            let part = Part {
                runs: &runs,
                in_fold: &in_fold,
                cursor,
                keys: &keys,
            };
            let folding = fold_entries(tables, &part, self.settings.page_capacity)?;
            // The pending commits' new series, named before the documents below need them
            // (with every part: a put of the same name and id again writes nothing new).
            let mut by_name = tx.open_table(SERIES_BY_NAME)?;
            let mut by_id = tx.open_table(SERIES_BY_ID)?;
            for commit in &in_fold {
                for (id, name) in &commit.series {
                    by_name.insert(&**name, *id)?;
                    by_id.insert(*id, &**name)?;
                }
            }
            if let Some(next) = next {
                next.write(&mut meta)?;
                trimmed = Vec::new();
            } else {
                trimmed = self.finish_fold(&tx, &mut log, &mut meta, &pending, &in_fold, cursor)?;
            }
            let width = self.settings.bucket_width_secs;
            write_folded(folding, &mut buckets, &by_id, width, &mut stats)?;
        }
        tx.commit()?;
        self.fold = next;
        stats.more = next.is_some();
        if next.is_none() {
            stats.bytes = folded_bytes;
            self.commits.folded(cursor.through, folded_bytes, &trimmed);
        }
        Ok(stats)
    }
}

/// A checkpoint part's fold: the log entries (table and pending commits) of the part's `keys`
/// merged onto their stored documents, raw readings appended to their pages. Run by run
/// ([`super::merged`]): a series' merged deltas of a run, or its entries where it spilled;
/// the readers merge the same, so a document after the fold is what they showed before it.
fn fold_entries(
    tables: PartTables<'_, '_>,
    part: &Part<'_>,
    cap: u32,
) -> Result<BTreeMap<(u64, i64), Folding>, CommitError> {
    let PartTables {
        log,
        buckets,
        pages,
    } = tables;
    let &Part {
        runs,
        in_fold,
        cursor,
        keys,
    } = part;
    let mut folding: BTreeMap<(u64, i64), Folding> = BTreeMap::new();
    let stored = |key: (u64, i64)| -> Result<Option<BucketDoc>, redb::Error> {
        buckets
            .get(key)?
            .map(|v| decode_bucket(key, v.value()))
            .transpose()
    };
    let mut raw = Vec::new();
    for run in runs {
        for (id, merged) in run.cached() {
            for (&start, m) in merged {
                let key = (id, start);
                if !keys.contains(&key) {
                    continue;
                }
                if let Some(f) = folding.get_mut(&key) {
                    f.summary.merge(&m.summary);
                    continue;
                }
                let stored = stored(key)?;
                let summary = m.onto(stored.as_ref().map(BucketDoc::summary));
                folding.insert(key, Folding::new(stored, summary));
            }
        }
        let mut visit = |seq: u64, e: &Entry<'_>| {
            let key = (e.series_id, e.start);
            if seq > cursor.through || !keys.contains(&key) {
                return Ok(());
            }
            let corrupt = |_| {
                redb::Error::Corrupted(format!(
                    "a commit log entry of series id {} is unreadable",
                    key.0
                ))
            };
            let spilled = run.spilled(key.0);
            let f = if let Some(f) = folding.get_mut(&key) {
                if spilled {
                    e.merge_into(&mut f.summary).map_err(corrupt)?;
                }
                f
            } else {
                debug_assert!(spilled, "a merged bucket's document is read above");
                let stored = stored(key)?;
                let summary = e
                    .onto(stored.as_ref().map(BucketDoc::summary))
                    .map_err(corrupt)?;
                folding.entry(key).or_insert(Folding::new(stored, summary))
            };
            if e.has_raw() {
                raw.clear();
                e.raw_into(&mut raw).map_err(corrupt)?;
                f.pages = append_pages(pages, key, f.pages, &raw, cap).map_err(|e| match e {
                    CommitError::Redb(e) => e,
                    other => redb::Error::Corrupted(other.to_string()),
                })?;
            }
            Ok(())
        };
        for row in log.range(run.first..=run.last)? {
            let (key, value) = row?;
            visit_record(key.value(), value.value(), &mut visit)?;
        }
        for commit in in_fold
            .iter()
            .filter(|c| (run.first..=run.last).contains(&c.seq))
        {
            visit_record(commit.seq, &commit.record, &mut visit)?;
        }
    }
    Ok(folding)
}

/// Refuses to fold when a commit the checkpoint covers is in none of its runs: the fold goes run
/// by run and then deletes every record up to `through`, so such a commit would be lost. The
/// runs are made with every commit ([`super::pending`]); this is the guard that says so loudly.
fn no_commit_outside(
    runs: &[&super::merged::Run],
    log: &LogTable<'_>,
    in_fold: &[&super::pending::PendingCommit],
    through: u64,
) -> Result<(), CommitError> {
    let covered = |seq: u64| runs.iter().any(|r| (r.first..=r.last).contains(&seq));
    let mut logged = Vec::new();
    for row in log.range(..=through)? {
        logged.push(row?.0.value());
    }
    let outside = logged
        .into_iter()
        .chain(in_fold.iter().map(|c| c.seq))
        .find(|&seq| !covered(seq));
    debug_assert!(outside.is_none(), "commit {outside:?} is in no run");
    match outside {
        Some(seq) => Err(CommitError::Redb(redb::Error::Corrupted(format!(
            "commit {seq} waits in no run of merged deltas; not folded, so that nothing is lost \
             (a bug in bucketd: restart it, and please report this message)"
        )))),
        None => Ok(()),
    }
}

/// Writes the folded documents of a checkpoint part.
fn write_folded(
    folding: BTreeMap<(u64, i64), Folding>,
    buckets: &mut DocTable<'_>,
    by_id: &redb::Table<'_, u64, &'static str>,
    width: i64,
    stats: &mut CheckpointStats,
) -> Result<(), CommitError> {
    let mut buf = Vec::with_capacity(512);
    for ((id, start), f) in folding {
        stats.buckets_created += usize::from(f.stored.is_none());
        let mut doc = bucket_doc(f.stored, &f.summary, (id, start), width, |id| {
            stored_name(by_id, id)
        })?;
        doc.pages = f.pages;
        buf.clear();
        bson::serialize_to_buffer(&doc, &mut buf)
            .expect("a BucketDoc has only BSON-representable fields");
        buckets.insert((id, start), buf.as_slice())?;
        stats.buckets_written += 1;
    }
    Ok(())
}

/// A checkpoint part's bucket keys, where the next part begins, and the log bytes they hold.
type PartKeys = (BTreeSet<(u64, i64)>, Option<FoldCursor>, u64);

/// A checkpoint part's buckets: the `budget` smallest keys the checkpoint has left in the log
/// table and the pending commits it folds, where the next part begins (`None`: this part is
/// the last), and the bytes of log they hold.
fn part_keys(
    log: &LogTable<'_>,
    in_fold: &[&super::pending::PendingCommit],
    cursor: FoldCursor,
    budget: usize,
    stats: &mut CheckpointStats,
) -> Result<PartKeys, CommitError> {
    let mut folded_bytes = 0u64;
    let mut keys: BTreeSet<(u64, i64)> = BTreeSet::new();
    let mut beyond = false;
    {
        let mut note = |seq: u64, e: &Entry<'_>| {
            let key = (e.series_id, e.start);
            if cursor.due(seq, key) && keys.insert(key) && keys.len() > budget {
                keys.pop_last();
                beyond = true;
            }
            Ok(())
        };
        folded_bytes = folded_bytes.saturating_add(visit_table(log, cursor.through, &mut note)?);
        for commit in in_fold {
            visit_record(commit.seq, &commit.record, &mut note)?;
            stats.records += 1;
            folded_bytes = folded_bytes.saturating_add(commit.record.len() as u64);
        }
    }
    stats.records += log.range(..=cursor.through)?.count();
    let next = match (beyond, keys.last()) {
        (true, Some(&last)) => Some(FoldCursor {
            through: cursor.through,
            from: successor(last),
        }),
        _ => None,
    };
    Ok((keys, next, folded_bytes))
}

impl super::Store {
    /// A checkpoint's last part: the folded records go, with what they brought besides (their
    /// fingerprints and gateway positions); returns the dedup entries trimmed.
    fn finish_fold(
        &self,
        tx: &redb::WriteTransaction,
        log: &mut LogTable<'_>,
        meta: &mut redb::Table<'_, &'static str, &'static str>,
        pending: &[std::sync::Arc<super::pending::PendingCommit>],
        in_fold: &[&super::pending::PendingCommit],
        cursor: FoldCursor,
    ) -> Result<Vec<u64>, CommitError> {
        // The last part: the folded records go, with what they brought besides.
        meta.remove(FoldCursor::KEY)?;
        log.retain_in(..=cursor.through, |_, _| false)?;
        // Pending commits after the checkpoint are not in the table: none of them is
        // trimmed (their fingerprints go in when they are folded).
        let below = pending
            .iter()
            .find(|c| c.seq > cursor.through)
            .map(|c| c.seq);
        let trimmed = self.dedup_trim(below);
        let mut dedup = tx.open_table(DEDUP)?;
        for commit in in_fold {
            if trimmed.binary_search(&commit.seq).is_err() {
                dedup.insert(commit.seq, commit.fingerprints.as_slice())?;
            }
        }
        for &old in &trimmed {
            dedup.remove(old)?;
        }
        let mut applied = tx.open_table(APPLIED)?;
        for commit in in_fold {
            for (key, at) in &commit.applied {
                applied.insert(key.as_str(), at.as_slice())?;
            }
        }
        Ok(trimmed)
    }
}

pub(super) fn decode_bucket(key: (u64, i64), bytes: &[u8]) -> Result<BucketDoc, redb::Error> {
    BucketDoc::decode(bytes)
        .map_err(|e| redb::Error::Corrupted(format!("bucket document {key:?} is unreadable: {e}")))
}

/// The document of bucket `key` holding `summary`: `stored` with it, or a new one named by
/// `name_of` (the series' name for its id).
pub(super) fn bucket_doc(
    stored: Option<BucketDoc>,
    summary: &Summary,
    (id, start): (u64, i64),
    width_secs: i64,
    name_of: impl FnOnce(u64) -> Result<String, redb::Error>,
) -> Result<BucketDoc, redb::Error> {
    if let Some(doc) = stored {
        return Ok(doc.with_summary(summary));
    }
    Ok(BucketDoc::new(&name_of(id)?, start, width_secs, summary))
}

/// The name of series `id` in the `series_by_id` table.
fn stored_name(
    by_id: &impl ReadableTable<u64, &'static str>,
    id: u64,
) -> Result<String, redb::Error> {
    by_id
        .get(id)?
        .map(|n| n.value().to_owned())
        .ok_or_else(|| redb::Error::Corrupted(format!("series id {id} has no name")))
}
