//! [`StoreReader`]: read access to the file, for `bucketd export` (a file no daemon holds) and
//! the HTTP API (the daemon's own open database). Never writes.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use redb::{ReadableDatabase, ReadableTable};

use super::log::{FoldCursor, bucket_doc, decode_bucket};
use super::outbox::{self, OutboxDoc};
use super::pending::{SharedPending, Snapshot};
use super::unfolded::{Unfolded, Which};
use super::view::View;
use super::{
    BUCKETS, DEDUP, META, PAGES, SERIES_BY_ID, SERIES_BY_NAME, SharedDb, StoreOpenError, open_error,
};
use crate::doc::{BucketDoc, PageDoc};

/// Read access: to a file no daemon holds (`bucketd export`), or to the daemon's own open
/// database (the HTTP API), whose journaled commits not yet in the file it merges
/// (`store::pending`). Cheap to clone.
#[derive(Clone)]
pub struct StoreReader {
    db: ReaderDb,
    pending: Option<SharedPending>,
    /// `store.page_capacity` of the writer, to tell how many pages a bucket's readings not yet
    /// folded will make (a file read on its own: the default).
    page_capacity: u32,
}

#[derive(Clone)]
enum ReaderDb {
    ReadOnly(Arc<redb::ReadOnlyDatabase>),
    Shared(SharedDb),
}

impl ReaderDb {
    fn begin_read(&self) -> Result<redb::ReadTransaction, redb::TransactionError> {
        match self {
            ReaderDb::ReadOnly(db) => db.begin_read(),
            ReaderDb::Shared(db) => {
                let db = db.read().expect("no panic while holding the lock").clone();
                match db {
                    Some(db) => db.begin_read(),
                    None => Err(redb::TransactionError::Storage(redb::StorageError::Io(
                        std::io::Error::other(
                            "the database is being reopened after a write error; retry shortly",
                        ),
                    ))),
                }
            }
        }
    }
}

/// Series that could not be read, with why ([`StoreReader::buckets_each`]).
pub type Unreadable = Vec<(String, redb::Error)>;

impl StoreReader {
    /// A reader over the daemon's own open database.
    pub(super) fn shared(db: SharedDb, pending: SharedPending, page_capacity: u32) -> StoreReader {
        StoreReader {
            db: ReaderDb::Shared(db),
            pending: Some(pending),
            page_capacity,
        }
    }

    /// A consistent view: the pending commits are taken before the transaction begins, so that
    /// each commit is in one or the other (a checkpoint between the two is told by the
    /// transaction's last `dedup` key). A checkpoint under way in the transaction must not
    /// cover a commit newer than the snapshot (part of it would be in the documents and the
    /// rest nowhere): then both are taken again, which happens only when a commit and a part
    /// both fell between them.
    pub(super) fn view(&self) -> Result<View, redb::Error> {
        let mut attempts = 0;
        loop {
            let pending = self
                .pending
                .as_ref()
                .map(Snapshot::take)
                .unwrap_or_default();
            #[cfg(test)]
            between_for_tests::run();
            let tx = self.db.begin_read()?;
            let folded_through = match tx.open_table(DEDUP) {
                Ok(t) => t.last()?.map(|(k, _)| k.value()),
                Err(redb::TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(e.into()),
            };
            let cursor = match tx.open_table(META) {
                Ok(t) => FoldCursor::read(&t)?,
                Err(redb::TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(e.into()),
            };
            let covered = cursor.is_none_or(|c| {
                folded_through.is_some_and(|f| c.through <= f)
                    || pending.last_seq().is_some_and(|s| s >= c.through)
            });
            if covered {
                return Ok(View {
                    tx,
                    pending,
                    folded_through,
                    cursor,
                });
            }
            attempts += 1;
            if attempts == 100 {
                return Err(redb::Error::Io(std::io::Error::other(
                    "the store changed under 100 reads in a row; retry shortly",
                )));
            }
        }
    }

    /// Opens the file read-only. Fails with [`StoreOpenError::Locked`] while a daemon holds it,
    /// with [`StoreOpenError::NeedsRecovery`] after an unclean stop (redb repairs a file only
    /// when opening it for writing), and with [`StoreOpenError::JournalPending`] while its
    /// journal holds commits the file does not (the daemon's next start applies them).
    pub fn open(path: &Path) -> Result<StoreReader, StoreOpenError> {
        if !path.exists() {
            return Err(StoreOpenError::Missing {
                path: path.to_owned(),
            });
        }
        // From the disk, as `Store::load` reads them: a daemon that died after a failed fsync
        // leaves pages in the cache that the disk never got.
        super::drop_cached_pages(path);
        super::drop_cached_pages(&super::journal::path_for(path));
        let db = redb::Builder::new()
            .open_read_only(path)
            .map_err(|e| match e {
                redb::DatabaseError::RepairAborted => StoreOpenError::NeedsRecovery {
                    path: path.to_owned(),
                },
                e => open_error(path, e),
            })?;
        let reader = StoreReader {
            db: ReaderDb::ReadOnly(Arc::new(db)),
            pending: None,
            page_capacity: PAGE_CAPACITY_DEFAULT,
        };
        let journal = super::journal::path_for(path);
        if journal.exists() {
            let corrupt = |source| StoreOpenError::Corrupt {
                path: path.to_owned(),
                source,
            };
            let (id, next_seq) = reader.journal_state().map_err(corrupt)?;
            let commits = super::journal::Journal::pending(&journal, id, next_seq)?;
            if commits > 0 {
                return Err(StoreOpenError::JournalPending {
                    path: path.to_owned(),
                    journal,
                    commits,
                });
            }
        }
        Ok(reader)
    }

    /// The file's journal id and next commit sequence number.
    fn journal_state(&self) -> Result<(u64, u64), redb::Error> {
        let tx = self.db.begin_read()?;
        let id = tx
            .open_table(META)?
            .get("journal_id")?
            .and_then(|v| v.value().parse::<u64>().ok())
            .unwrap_or(0);
        let next_seq = tx
            .open_table(super::DEDUP)?
            .last()?
            .map_or(0, |(k, _)| k.value() + 1);
        Ok((id, next_seq))
    }

    /// Up to `max` outbox entries with a sequence number above `after` (all with `None`),
    /// oldest first. The forwarder reads through [`super::OutboxShared::read_for_shipping`].
    pub fn outbox(&self, after: Option<u64>, max: usize) -> Result<Vec<OutboxDoc>, redb::Error> {
        outbox::read(&self.db.begin_read()?, after, max)
    }

    /// Every series name, sorted.
    pub fn series(&self) -> Result<Vec<String>, redb::Error> {
        let view = self.view()?;
        let table = view.tx.open_table(SERIES_BY_NAME)?;
        let mut names = Vec::new();
        for entry in table.iter()? {
            names.push(entry?.0.value().to_owned());
        }
        let pending: Vec<String> = view
            .pending()
            .flat_map(|c| &c.series)
            .map(|(_, n)| n.to_string())
            .collect();
        if !pending.is_empty() {
            names.extend(pending);
            names.sort_unstable();
            names.dedup();
        }
        Ok(names)
    }

    /// Whether `series` is stored.
    pub fn has_series(&self, series: &str) -> Result<bool, redb::Error> {
        let view = self.view()?;
        let table = view.tx.open_table(SERIES_BY_NAME)?;
        Ok(table.get(series)?.is_some() || view.pending_id(series).is_some())
    }

    /// When the file was created (RFC 3339): names this database to an upstream, which
    /// tells a replaced database's sequence numbers from the old one's.
    pub fn created_at(&self) -> Result<String, redb::Error> {
        let tx = self.db.begin_read()?;
        let meta = tx.open_table(META)?;
        let created = meta.get("created_at")?;
        created
            .map(|v| v.value().to_owned())
            .ok_or_else(|| redb::Error::Corrupted("meta.created_at is missing".into()))
    }

    /// The bucket width the file was created with, in seconds.
    pub fn bucket_width_secs(&self) -> Result<i64, redb::Error> {
        let tx = self.db.begin_read()?;
        let meta = tx.open_table(META)?;
        let width = meta.get("bucket_width_secs")?;
        width
            .and_then(|v| v.value().parse().ok())
            .ok_or_else(|| redb::Error::Corrupted("meta.bucket_width_secs is missing".into()))
    }

    /// Raw readings of `series` (every series when `None`) with `from <= ts < to` (ns), one
    /// bucket at a time in time order, each bucket's readings sorted by timestamp (equal
    /// timestamps in arrival order). Readings still in the commit log come after the pages'
    /// (they arrived later). `visit` returns `false` to stop early.
    pub fn raw(
        &self,
        series: Option<&str>,
        from: i64,
        to: i64,
        mut visit: impl FnMut(&str, &[(i64, f64)]) -> bool,
    ) -> Result<(), redb::Error> {
        if from >= to {
            return Ok(());
        }
        let width = self.bucket_width_secs()?;
        let view = self.view()?;
        let pages = view.tx.open_table(PAGES)?;
        let ids = series_ids(&view, series)?;
        let first_start = from.div_euclid(1_000_000_000).div_euclid(width) * width;
        let end_start = to.div_euclid(1_000_000_000) + 1; // buckets starting before `to`
        let which = Which {
            ids: series.is_some().then_some(ids.as_slice()),
            starts: (first_start, end_start),
        };
        let mut unfolded = Unfolded::read(&view, which, true, |_, _| Ok(None))?.raw;
        let in_range = |r: &(i64, f64)| (from..to).contains(&r.0);
        for id in ids {
            let name = view.name_of(id)?;
            let mut bucket: Option<i64> = None;
            let mut readings: Vec<(i64, f64)> = Vec::new();
            // Ends the current bucket (adding its readings from the log) and any log-only
            // buckets before `next`; returns whether `visit` asked to stop.
            let mut flush =
                |bucket: Option<i64>, next: Option<i64>, readings: &mut Vec<(i64, f64)>| {
                    let mut emit = |readings: &mut Vec<(i64, f64)>| {
                        readings.sort_by_key(|r| r.0); // stable: equal timestamps keep arrival order
                        let stop = !readings.is_empty() && !visit(&name, readings);
                        readings.clear();
                        stop
                    };
                    if let Some(start) = bucket {
                        if let Some(logged) = unfolded.remove(&(id, start)) {
                            readings.extend(logged.into_iter().filter(in_range));
                        }
                        if emit(readings) {
                            return true;
                        }
                    }
                    let before = next.unwrap_or(i64::MAX);
                    while let Some(entry) = unfolded.first_entry() {
                        let (key_id, start) = *entry.key();
                        if key_id != id || (start >= before && next.is_some()) {
                            break;
                        }
                        readings.extend(entry.remove().into_iter().filter(in_range));
                        if emit(readings) {
                            return true;
                        }
                    }
                    false
                };
            if flush(None, Some(first_start), &mut readings) {
                return Ok(());
            }
            for entry in pages.range((id, first_start, 0)..(id, end_start, 0))? {
                let (key, value) = entry?;
                let (_, start, page_no) = key.value();
                if bucket != Some(start) {
                    if flush(bucket, Some(start), &mut readings) {
                        return Ok(());
                    }
                    bucket = Some(start);
                }
                let corrupt = || {
                    redb::Error::Corrupted(format!(
                        "raw page {page_no} of {name} at {start} is unreadable"
                    ))
                };
                let page = PageDoc::from_bytes(value.value()).ok_or_else(corrupt)?;
                if page.max_ts < from || page.min_ts >= to {
                    continue;
                }
                let decoded = page.readings().ok_or_else(corrupt)?;
                readings.extend(decoded.into_iter().filter(in_range));
            }
            if flush(bucket, None, &mut readings) {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Buckets of `series` (all series when `None`) with `from <= start < to` (seconds), in
    /// series-id then time order, with what the commit log holds for them merged in.
    pub fn buckets(
        &self,
        series: Option<&str>,
        from: i64,
        to: i64,
    ) -> Result<Vec<BucketDoc>, redb::Error> {
        if from >= to {
            return Ok(Vec::new());
        }
        let view = self.view()?;
        let ids = series_ids(&view, series)?;
        self.read_buckets(&view, &ids, series.is_some(), from, to)
    }

    /// Every series' buckets with `from <= start < to` (seconds), read series by series, and
    /// the series that could not be read with why: a damaged document or key takes only its
    /// own series with it (issue 51: `bucketd export` refused the whole file for one).
    /// An error here means not even the series' names could be read.
    pub fn buckets_each(
        &self,
        from: i64,
        to: i64,
    ) -> Result<(Vec<BucketDoc>, Unreadable), redb::Error> {
        let mut docs = Vec::new();
        let mut unreadable = Vec::new();
        for name in self.series()? {
            match self.buckets(Some(&name), from, to) {
                Ok(mut d) => docs.append(&mut d),
                Err(e) => unreadable.push((name, e)),
            }
        }
        Ok((docs, unreadable))
    }

    /// The buckets of each of `names` with `from <= start < to` (seconds), in time order, with
    /// what the commit log holds for them merged in: one pass over the log for them all (a
    /// query of many series read it once per series before, issue 42). Names not stored are
    /// left out.
    pub fn buckets_of(
        &self,
        names: &[&str],
        from: i64,
        to: i64,
    ) -> Result<BTreeMap<String, Vec<BucketDoc>>, redb::Error> {
        let mut out = BTreeMap::new();
        if from >= to || names.is_empty() {
            return Ok(out);
        }
        let view = self.view()?;
        let mut ids = Vec::with_capacity(names.len());
        for name in names {
            ids.extend(series_ids(&view, Some(name))?);
        }
        ids.sort_unstable();
        ids.dedup();
        for doc in self.read_buckets(&view, &ids, true, from, to)? {
            out.entry(doc.series.clone())
                .or_insert_with(Vec::new)
                .push(doc);
        }
        Ok(out)
    }

    /// The buckets of series `ids` (sorted) in `[from, to)`, in series-id then time order,
    /// with the log's entries of those series (`only`) or of every series (`ids` are all).
    fn read_buckets(
        &self,
        view: &View,
        ids: &[u64],
        only: bool,
        from: i64,
        to: i64,
    ) -> Result<Vec<BucketDoc>, redb::Error> {
        let buckets = view.tx.open_table(BUCKETS)?;
        let mut docs: BTreeMap<(u64, i64), BucketDoc> = BTreeMap::new();
        for &id in ids {
            for entry in buckets.range((id, from)..(id, to))? {
                let (key, value) = entry?;
                docs.insert(key.value(), decode_bucket(key.value(), value.value())?);
            }
        }
        let which = Which {
            ids: only.then_some(ids),
            starts: (from, to),
        };
        let unfolded = Unfolded::read(view, which, false, |id, start| {
            Ok(docs.get(&(id, start)).map(BucketDoc::summary))
        })?;
        if !unfolded.deltas.is_empty() {
            let width = self.bucket_width_secs()?;
            let pages = view.tx.open_table(PAGES)?;
            for (key, summary) in unfolded.deltas {
                let mut doc = bucket_doc(docs.remove(&key), &summary, key, width, |id| {
                    view.name_of(id)
                })?;
                // The pages the bucket will have once its readings are folded, so that it
                // reads the same before and after a checkpoint.
                let raw = unfolded.raw_counts.get(&key).copied().unwrap_or(0);
                if raw > 0 {
                    let last = match u32::try_from(doc.pages).ok().and_then(|p| p.checked_sub(1)) {
                        Some(page_no) => pages
                            .get((key.0, key.1, page_no))?
                            .and_then(|v| PageDoc::count_in(v.value()))
                            .map_or(0, |n| u64::try_from(n).unwrap_or(0)),
                        None => 0,
                    };
                    doc.pages = pages_after(doc.pages, last, raw, self.page_capacity);
                }
                docs.insert(key, doc);
            }
        }
        Ok(docs.into_values().collect())
    }
}

/// `store.page_capacity`'s default, for a file read on its own.
const PAGE_CAPACITY_DEFAULT: u32 = 1000;

/// A bucket's page count once `raw` more readings are appended as a checkpoint appends them
/// (`store::append_pages`): the last page (holding `last`) filled up to `cap`, then new ones.
fn pages_after(pages: i32, last: u64, raw: u64, cap: u32) -> i32 {
    let cap = u64::from(cap.max(1));
    let room = if pages > 0 {
        cap.saturating_sub(last)
    } else {
        0
    };
    let new = raw.saturating_sub(room).div_ceil(cap);
    pages.saturating_add(i32::try_from(new).unwrap_or(i32::MAX))
}

/// The id of `series`, or of every series when `None` (in id order), pending ones included.
fn series_ids(view: &View, series: Option<&str>) -> Result<Vec<u64>, redb::Error> {
    if let Some(name) = series {
        let by_name = view.tx.open_table(SERIES_BY_NAME)?;
        let stored = by_name.get(name)?.map(|id| id.value());
        Ok(stored
            .or_else(|| view.pending_id(name))
            .into_iter()
            .collect())
    } else {
        let by_id = view.tx.open_table(SERIES_BY_ID)?;
        let mut ids = Vec::new();
        for entry in by_id.iter()? {
            ids.push(entry?.0.value());
        }
        let pending: Vec<u64> = view
            .pending()
            .flat_map(|c| &c.series)
            .map(|(id, _)| *id)
            .collect();
        if !pending.is_empty() {
            ids.extend(pending);
            ids.sort_unstable();
            ids.dedup();
        }
        Ok(ids)
    }
}

/// Test seam: work run once between a view's snapshot of the pending commits and its read
/// transaction (the writer's commits and checkpoint parts that may fall there).
#[cfg(test)]
pub(super) mod between_for_tests {
    use std::cell::RefCell;

    thread_local! {
        static ONCE: RefCell<Option<Box<dyn FnOnce()>>> = RefCell::new(None);
    }

    /// Runs `work` in the next view taken on this thread.
    pub(in crate::store) fn set(work: Box<dyn FnOnce()>) {
        ONCE.with(|o| *o.borrow_mut() = Some(work));
    }

    pub(super) fn run() {
        if let Some(work) = ONCE.with(|o| o.borrow_mut().take()) {
            work();
        }
    }
}
