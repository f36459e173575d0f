//! The commit log table and the checkpoint: each commit appends one [`crate::commitlog`] record
//! under its sequence number (keys only grow, so redb writes only the tree's right-hand edge);
//! [`Store::checkpoint`] folds every record into the bucket documents and raw pages and deletes
//! them, in one transaction; readers merge the records not folded yet ([`Unfolded`]).

use std::collections::BTreeMap;

use redb::{ReadableTable, TableDefinition};

use super::{
    APPLIED, BUCKETS, CommitError, DEDUP, PAGES, SERIES_BY_ID, SERIES_BY_NAME, Store, append_pages,
};
use crate::commitlog::{Entry, Record};
use crate::doc::BucketDoc;
use crate::summary::Summary;

pub(super) const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");

/// What one checkpoint did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointStats {
    /// Log records folded (and deleted).
    pub records: usize,
    /// Bucket documents written, and of those, new.
    pub buckets_written: usize,
    pub buckets_created: usize,
    /// Log and dedup bytes the checkpoint freed.
    pub bytes: u64,
    /// Records are left to fold (the part's budget was reached).
    pub more: bool,
}

fn corrupt_record(seq: u64) -> impl Fn(crate::commitlog::Corrupt) -> redb::Error {
    move |_| redb::Error::Corrupted(format!("commit log record {seq} is unreadable"))
}

/// Calls `visit` with every entry of every record in `table`, oldest record first.
fn visit_entries<T: ReadableTable<u64, &'static [u8]>>(
    table: &T,
    visit: impl FnMut(&Entry<'_>) -> Result<(), redb::Error>,
) -> Result<usize, redb::Error> {
    Ok(visit_oldest(table, u64::MAX, None, visit)?.records)
}

/// The oldest records a visit took.
#[derive(Debug, Clone, Copy, Default)]
struct Visited {
    records: usize,
    /// Sequence number of the last record visited.
    last: Option<u64>,
    /// Bytes of the records visited.
    bytes: u64,
}

/// Calls `visit` with every entry of the oldest records in `table`, oldest first, until they
/// hold `budget` bytes or `until` has passed (at least one record).
fn visit_oldest<T: ReadableTable<u64, &'static [u8]>>(
    table: &T,
    budget: u64,
    until: Option<std::time::Instant>,
    mut visit: impl FnMut(&Entry<'_>) -> Result<(), redb::Error>,
) -> Result<Visited, redb::Error> {
    let mut done = Visited::default();
    for row in table.iter()? {
        if done.records > 0
            && (done.bytes >= budget || until.is_some_and(|t| std::time::Instant::now() >= t))
        {
            break;
        }
        let (key, value) = row?;
        let seq = key.value();
        let bytes = value.value();
        let record = Record::parse(bytes).map_err(corrupt_record(seq))?;
        for entry in record.entries() {
            visit(&entry.map_err(corrupt_record(seq))?)?;
        }
        done.records += 1;
        done.last = Some(seq);
        done.bytes = done.bytes.saturating_add(bytes.len() as u64);
    }
    Ok(done)
}

/// Bytes of the log's records, at open.
pub(super) fn bytes(tx: &redb::ReadTransaction) -> Result<u64, redb::Error> {
    let table = tx.open_table(LOG)?;
    let mut total = 0u64;
    for row in table.iter()? {
        total = total.saturating_add(row?.1.value().len() as u64);
    }
    Ok(total)
}

/// What the log holds for some buckets, for a reader: the deltas in commit order, and the raw
/// readings in arrival order.
#[derive(Debug, Default)]
pub(super) struct Unfolded {
    pub deltas: BTreeMap<(u64, i64), Summary>,
    pub raw: BTreeMap<(u64, i64), Vec<(i64, f64)>>,
    /// Raw readings per bucket (with the deltas): what the fold appends to its pages.
    pub raw_counts: BTreeMap<(u64, i64), u64>,
}

impl Unfolded {
    /// For the buckets `wanted` accepts: the unfolded deltas (merged in commit order onto
    /// `base`, the stored document's summary when there is one), or with `raw_only` only their
    /// raw readings (a raw read needs no summary, and folding one per entry is the costly part).
    pub(super) fn read(
        view: &super::reader::View,
        wanted: impl Fn(u64, i64) -> bool,
        raw_only: bool,
        base: impl Fn(u64, i64) -> Result<Option<Summary>, redb::Error>,
    ) -> Result<Unfolded, redb::Error> {
        let mut out = Unfolded::default();
        let mut visit = |e: &Entry<'_>| {
            let key = (e.series_id, e.start);
            if !wanted(key.0, key.1) {
                return Ok(());
            }
            let corrupt = |_| {
                redb::Error::Corrupted(format!(
                    "a commit log entry of series id {} is unreadable",
                    key.0
                ))
            };
            if raw_only {
                if e.has_raw() {
                    e.raw_into(out.raw.entry(key).or_default())
                        .map_err(corrupt)?;
                }
                return Ok(());
            }
            let delta = e.summary().map_err(corrupt)?;
            if e.has_raw() {
                let n = if let Some(n) = e.raw_count() {
                    n
                } else {
                    let mut raw = Vec::new();
                    e.raw_into(&mut raw).map_err(corrupt)?;
                    raw.len() as u64
                };
                *out.raw_counts.entry(key).or_insert(0) += n;
            }
            if let Some(have) = out.deltas.get_mut(&key) {
                have.merge(&delta);
            } else {
                out.deltas
                    .insert(key, merged_onto(base(key.0, key.1)?, &delta));
            }
            Ok(())
        };
        // The `log` table's records (a journal's replay left them), then the pending commits:
        // in commit order, as a checkpoint folds them.
        match view.tx.open_table(LOG) {
            Ok(table) => {
                visit_entries(&table, &mut visit)?;
            }
            // A file opened read-only before its first open by this release (format 1).
            Err(redb::TableError::TableDoesNotExist(_)) => {}
            Err(e) => return Err(e.into()),
        }
        for commit in view.pending() {
            visit_record(commit.seq, &commit.record, &mut visit)?;
        }
        Ok(out)
    }
}

/// Calls `visit` with every entry of the record of commit `seq`.
fn visit_record(
    seq: u64,
    bytes: &[u8],
    mut visit: impl FnMut(&Entry<'_>) -> Result<(), redb::Error>,
) -> Result<(), redb::Error> {
    let record = Record::parse(bytes).map_err(corrupt_record(seq))?;
    for entry in record.entries() {
        visit(&entry.map_err(corrupt_record(seq))?)?;
    }
    Ok(())
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

impl Store {
    /// Bytes in the commit log (records and the fingerprints stored since the last
    /// checkpoint): what the next checkpoint folds.
    pub fn log_bytes(&self) -> u64 {
        self.log_bytes
    }

    /// Folds the whole commit log into the bucket documents and raw pages (see
    /// [`Store::checkpoint_part`]): as one part, so each touched bucket is rewritten once.
    pub fn checkpoint(&mut self) -> Result<CheckpointStats, CommitError> {
        self.checkpoint_part(u64::MAX, None)
    }

    /// Folds the oldest records of the commit log, up to `budget` bytes of them or as many as
    /// it folds until `until` (at least one record), into the bucket documents and raw pages,
    /// in one durable transaction, with what they bring besides (new series, fingerprints,
    /// gateway positions) and the trim of the dedup table: a crash leaves either those records
    /// or their fold, never both or neither. The oldest records are the `log` table's (a
    /// journal's replay left them there), then the pending commits'. Folding in commit order,
    /// part after part, gives the documents one fold of the whole log would, bit for bit, and
    /// readers merge what is left onto them the same way. Once nothing is left pending, the
    /// file holds every commit and the journal starts over. Work is bounded by `budget` and
    /// `until` (the writer folds `limits::CHECKPOINT_PART_TIME` at a time, committing batches
    /// in between).
    pub fn checkpoint_part(
        &mut self,
        budget: u64,
        until: Option<std::time::Instant>,
    ) -> Result<CheckpointStats, CommitError> {
        let mut stats = CheckpointStats::default();
        let pending = super::pending::now(&self.pending);
        if self.log_bytes == 0 && pending.is_empty() && self.dedup_trim(None).is_empty() {
            return Ok(stats);
        }
        let tx = self.durable_tx()?;
        let mut folded_bytes = 0u64;
        let mut last_pending: Option<u64> = None;
        let trimmed;
        {
            let mut log = tx.open_table(LOG)?;
            let mut buckets = tx.open_table(BUCKETS)?;
            let mut pages = tx.open_table(PAGES)?;
            let mut folding: BTreeMap<(u64, i64), Folding> = BTreeMap::new();
            let mut raw = Vec::new();
            let cap = self.settings.page_capacity;
            let mut visit = |e: &Entry<'_>| {
                let key = (e.series_id, e.start);
                let corrupt = |_| {
                    redb::Error::Corrupted(format!(
                        "a commit log entry of series id {} is unreadable",
                        key.0
                    ))
                };
                let delta = e.summary().map_err(corrupt)?;
                let f = if let Some(f) = folding.get_mut(&key) {
                    f.summary.merge(&delta);
                    f
                } else {
                    let stored = buckets
                        .get(key)?
                        .map(|v| decode_bucket(key, v.value()))
                        .transpose()?;
                    let summary = merged_onto(stored.as_ref().map(BucketDoc::summary), &delta);
                    folding.entry(key).or_insert(Folding {
                        summary,
                        pages: stored.as_ref().map_or(0, |d| d.pages),
                        stored,
                    })
                };
                if e.has_raw() {
                    raw.clear();
                    e.raw_into(&mut raw).map_err(corrupt)?;
                    f.pages =
                        append_pages(&mut pages, key, f.pages, &raw, cap).map_err(|e| match e {
                            CommitError::Redb(e) => e,
                            other => redb::Error::Corrupted(other.to_string()),
                        })?;
                }
                Ok(())
            };
            let visited = visit_oldest(&log, budget, until, &mut visit)?;
            stats.records = visited.records;
            folded_bytes = folded_bytes.saturating_add(visited.bytes);
            let log_left = match visited.last {
                Some(last) => {
                    log.retain_in(..=last, |_, _| false)?;
                    log.first()?.is_some()
                }
                None => false,
            };
            // Then the pending commits, oldest first, while the budget lasts.
            let mut folded: Vec<&super::pending::PendingCommit> = Vec::new();
            if !log_left {
                for commit in pending.iter() {
                    let over = folded_bytes >= budget
                        || until.is_some_and(|t| std::time::Instant::now() >= t);
                    if stats.records > 0 && over {
                        break;
                    }
                    visit_record(commit.seq, &commit.record, &mut visit)?;
                    stats.records += 1;
                    folded_bytes = folded_bytes.saturating_add(commit.record.len() as u64);
                    last_pending = Some(commit.seq);
                    folded.push(commit);
                }
            }
            stats.more = log_left || pending.len() > folded.len();
            // What the folded pending commits bring besides their deltas: their new series
            // (named before the documents below need them), fingerprints and positions.
            let mut by_name = tx.open_table(SERIES_BY_NAME)?;
            let mut by_id = tx.open_table(SERIES_BY_ID)?;
            for commit in &folded {
                for (id, name) in &commit.series {
                    by_name.insert(&**name, *id)?;
                    by_id.insert(*id, &**name)?;
                }
            }
            // Pending commits not folded here are not in the table: none of them is trimmed
            // (their fingerprints go in when they are folded).
            let below = match last_pending {
                Some(seq) => Some(seq + 1),
                None => pending.first().map(|c| c.seq),
            };
            trimmed = self.dedup_trim(below);
            let mut dedup = tx.open_table(DEDUP)?;
            for commit in &folded {
                if trimmed.binary_search(&commit.seq).is_err() {
                    dedup.insert(commit.seq, commit.fingerprints.as_slice())?;
                }
            }
            for &old in &trimmed {
                dedup.remove(old)?;
            }
            let mut applied = tx.open_table(APPLIED)?;
            for commit in &folded {
                for (key, at) in &commit.applied {
                    applied.insert(key.as_str(), at.as_slice())?;
                }
            }
            let width = self.settings.bucket_width_secs;
            let mut buf = Vec::with_capacity(512);
            for ((id, start), f) in folding {
                stats.buckets_created += usize::from(f.stored.is_none());
                let mut doc = bucket_doc(f.stored, &f.summary, (id, start), width, |id| {
                    stored_name(&by_id, id)
                })?;
                doc.pages = f.pages;
                buf.clear();
                bson::serialize_to_buffer(&doc, &mut buf)
                    .expect("a BucketDoc has only BSON-representable fields");
                buckets.insert((id, start), buf.as_slice())?;
                stats.buckets_written += 1;
            }
        }
        tx.commit()?;
        if let Some(seq) = last_pending {
            super::pending::drop_through(&self.pending, seq);
        }
        self.durable_committed();
        stats.bytes = folded_bytes;
        self.log_bytes = self.log_bytes.saturating_sub(folded_bytes);
        debug_assert!(stats.more || self.log_bytes == 0, "every record folded");
        if !stats.more {
            self.log_bytes = 0;
        }
        self.dedup_log
            .retain(|(s, _)| trimmed.binary_search(s).is_err());
        self.dedup_total = self.dedup_log.iter().map(|e| e.1).sum();
        Ok(stats)
    }
}

/// `delta` merged onto `base` (the stored summary), or `delta` alone.
fn merged_onto(base: Option<Summary>, delta: &Summary) -> Summary {
    if let Some(mut s) = base {
        s.merge(delta);
        s
    } else {
        delta.clone()
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
