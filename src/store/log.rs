//! The commit log table and the checkpoint: each commit appends one [`crate::commitlog`] record
//! under its sequence number (keys only grow, so redb writes only the tree's right-hand edge);
//! [`Store::checkpoint`] folds every record into the bucket documents and raw pages and deletes
//! them, in one transaction; readers merge the records not folded yet ([`Unfolded`]).

use std::collections::BTreeMap;

use redb::{ReadableTable, TableDefinition};

use super::{BUCKETS, CommitError, DEDUP, PAGES, SERIES_BY_ID, Store, append_pages};
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
}

impl Unfolded {
    /// For the buckets `wanted` accepts: the unfolded deltas (merged in commit order onto
    /// `base`, the stored document's summary when there is one), or with `raw_only` only their
    /// raw readings (a raw read needs no summary, and folding one per entry is the costly part).
    pub(super) fn read(
        tx: &redb::ReadTransaction,
        wanted: impl Fn(u64, i64) -> bool,
        raw_only: bool,
        base: impl Fn(u64, i64) -> Result<Option<Summary>, redb::Error>,
    ) -> Result<Unfolded, redb::Error> {
        let table = match tx.open_table(LOG) {
            Ok(t) => t,
            // A file opened read-only before its first open by this release (format 1).
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Unfolded::default()),
            Err(e) => return Err(e.into()),
        };
        let mut out = Unfolded::default();
        visit_entries(&table, |e| {
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
            if let Some(have) = out.deltas.get_mut(&key) {
                have.merge(&delta);
            } else {
                out.deltas
                    .insert(key, merged_onto(base(key.0, key.1)?, &delta));
            }
            Ok(())
        })?;
        Ok(out)
    }
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
    /// deletes the folded records and trims
    /// the dedup table, in one durable transaction: a crash leaves either those records or
    /// their fold, never both or neither. Folding in commit order, part after part, gives the
    /// documents one fold of the whole log would, bit for bit, and readers merge the records
    /// still in the log onto them the same way. The file then holds every commit, and the
    /// journal starts over. Work is bounded by `budget` and `until` (the writer folds
    /// `limits::CHECKPOINT_PART_TIME` at a time, committing batches in between).
    pub fn checkpoint_part(
        &mut self,
        budget: u64,
        until: Option<std::time::Instant>,
    ) -> Result<CheckpointStats, CommitError> {
        let mut stats = CheckpointStats::default();
        let trimmed = self.dedup_trim();
        if self.log_bytes == 0 && trimmed.is_empty() {
            return Ok(stats);
        }
        let tx = self.durable_tx()?;
        let folded;
        {
            let mut log = tx.open_table(LOG)?;
            let mut buckets = tx.open_table(BUCKETS)?;
            let mut pages = tx.open_table(PAGES)?;
            let mut folding: BTreeMap<(u64, i64), Folding> = BTreeMap::new();
            let mut raw = Vec::new();
            let cap = self.settings.page_capacity;
            let visited = visit_oldest(&log, budget, until, |e| {
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
            })?;
            stats.records = visited.records;
            folded = visited;
            let by_id = tx.open_table(SERIES_BY_ID)?;
            let width = self.settings.bucket_width_secs;
            let mut buf = Vec::with_capacity(512);
            for ((id, start), f) in folding {
                stats.buckets_created += usize::from(f.stored.is_none());
                let mut doc = bucket_doc(f.stored, &f.summary, (id, start), width, &by_id)?;
                doc.pages = f.pages;
                buf.clear();
                bson::serialize_to_buffer(&doc, &mut buf)
                    .expect("a BucketDoc has only BSON-representable fields");
                buckets.insert((id, start), buf.as_slice())?;
                stats.buckets_written += 1;
            }
            if let Some(last) = visited.last {
                log.retain_in(..=last, |_, _| false)?;
                stats.more = log.first()?.is_some();
            }
            let mut dedup = tx.open_table(DEDUP)?;
            for &old in &trimmed {
                dedup.remove(old)?;
            }
        }
        tx.commit()?;
        self.durable_committed();
        // The folded records, and the fingerprints of their commits.
        let fingerprints: usize = self
            .dedup_log
            .iter()
            .filter(|(s, _)| folded.last.is_some_and(|last| *s <= last))
            .map(|e| e.1)
            .sum();
        stats.bytes = if stats.more {
            folded
                .bytes
                .saturating_add((fingerprints * crate::dedup::FINGERPRINT_BYTES) as u64)
        } else {
            self.log_bytes
        };
        self.log_bytes = if stats.more {
            self.log_bytes.saturating_sub(stats.bytes)
        } else {
            0
        };
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

/// The document of bucket `key` holding `summary`: `stored` with it, or a new one named from
/// the `series_by_id` table.
pub(super) fn bucket_doc(
    stored: Option<BucketDoc>,
    summary: &Summary,
    (id, start): (u64, i64),
    width_secs: i64,
    by_id: &impl ReadableTable<u64, &'static str>,
) -> Result<BucketDoc, redb::Error> {
    if let Some(doc) = stored {
        return Ok(doc.with_summary(summary));
    }
    let name = by_id
        .get(id)?
        .ok_or_else(|| redb::Error::Corrupted(format!("series id {id} has no name")))?;
    Ok(BucketDoc::new(name.value(), start, width_secs, summary))
}
