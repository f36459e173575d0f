//! Retention and compaction: deleting raw pages and buckets past their age in bounded passes
//! ([`Store::expire`]), and compacting a file no daemon holds ([`compact`]).

use std::path::Path;
use std::sync::Arc;

use redb::ReadableTable;

use super::{
    BUCKETS, CommitError, PAGES, SERIES_BY_ID, SERIES_BY_NAME, Store, StoreOpenError, open_error,
};
use crate::doc::BucketDoc;

/// What one retention pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpireStats {
    pub pages: usize,
    pub buckets: usize,
    /// Series whose last bucket went: deleted too.
    pub series: usize,
    /// The pass stopped at its budget: more is due.
    pub more: bool,
}

impl Store {
    /// One bounded retention pass, in one write transaction: deletes raw pages of buckets
    /// starting before `raw_before` and bucket documents (with any pages left) starting before
    /// `buckets_before` (seconds), at most `max` entries. A bucket whose pages go keeps its
    /// summary with `pages = 0`. A series left with no bucket is deleted too, and its name kept
    /// for [`Store::take_forgotten`].
    pub fn expire(
        &mut self,
        raw_before: i64,
        buckets_before: i64,
        max: usize,
    ) -> Result<ExpireStats, CommitError> {
        let result = self
            .recovered()
            .and_then(|()| self.expire_once(raw_before, buckets_before, max));
        self.note_failure(result)
    }

    /// [`Store::expire`], once.
    fn expire_once(
        &mut self,
        raw_before: i64,
        buckets_before: i64,
        max: usize,
    ) -> Result<ExpireStats, CommitError> {
        let mut stats = ExpireStats::default();
        // Fold the log first when it touches what may be deleted: a bucket deleted here must not
        // come back from a log entry.
        if self.log_reaches_before(raw_before.max(buckets_before))? {
            self.checkpoint()?;
        }
        // A series whose buckets all expire keeps its name while a commit waiting to be folded
        // adds to it (a sensor back after its retention): the fold needs the name.
        let waiting = self.unfolded_series()?;
        let tx = self.durable_tx()?;
        let mut emptied_series: Vec<u64> = Vec::new();
        {
            let mut pages = tx.open_table(PAGES)?;
            let mut buckets = tx.open_table(BUCKETS)?;
            let mut ids: Vec<u64> = self.series.values().copied().collect();
            ids.sort_unstable();
            'series: for id in ids {
                // Pages first (they are the bulk), then whole buckets.
                let page_keys = first_keys(
                    &pages,
                    (id, i64::MIN, 0)..(id, raw_before.max(buckets_before), 0),
                    max - stats.pages - stats.buckets,
                )?;
                let mut emptied: Vec<i64> = Vec::new();
                for key in &page_keys {
                    pages.remove(key)?;
                    if emptied.last() != Some(&key.1) {
                        emptied.push(key.1);
                    }
                }
                stats.pages += page_keys.len();
                for start in emptied.into_iter().filter(|s| *s >= buckets_before) {
                    // The budget may have cut a bucket's pages short: only a bucket with no
                    // page left says `pages = 0`.
                    if pages
                        .range((id, start, 0)..=(id, start, u32::MAX))?
                        .next()
                        .is_some()
                    {
                        continue;
                    }
                    let doc = buckets
                        .get((id, start))?
                        .map(|v| BucketDoc::decode(v.value()));
                    if let Some(Ok(doc)) = doc {
                        let doc = BucketDoc { pages: 0, ..doc };
                        buckets.insert((id, start), doc.encode().as_slice())?;
                    }
                }
                let budget = max - stats.pages - stats.buckets;
                let bucket_keys =
                    first_keys(&buckets, (id, i64::MIN)..(id, buckets_before), budget)?;
                for key in &bucket_keys {
                    buckets.remove(key)?;
                }
                stats.buckets += bucket_keys.len();
                let left = |start: i64| (id, start);
                if !bucket_keys.is_empty()
                    && !waiting.contains(&id)
                    && buckets
                        .range(left(i64::MIN)..=left(i64::MAX))?
                        .next()
                        .is_none()
                {
                    // Pages live under their bucket: none can be left without one.
                    emptied_series.push(id);
                }
                if stats.pages + stats.buckets >= max {
                    stats.more = true;
                    break 'series;
                }
            }
        }
        if stats.pages + stats.buckets == 0 {
            // Nothing due: no durable commit (its header and allocator state) for nothing.
            tx.abort()?;
            return Ok(stats);
        }
        let mut names: Vec<Arc<str>> = Vec::with_capacity(emptied_series.len());
        if !emptied_series.is_empty() {
            let mut by_name = tx.open_table(SERIES_BY_NAME)?;
            let mut by_id = tx.open_table(SERIES_BY_ID)?;
            for id in &emptied_series {
                if let Some(name) = by_id.remove(id)? {
                    let name: Arc<str> = Arc::from(name.value());
                    by_name.remove(&*name)?;
                    names.push(name);
                }
            }
        }
        tx.commit()?;
        self.commits.durable_committed();
        stats.series = names.len();
        for name in names {
            self.series.remove(&name);
            self.forgotten.push(name);
        }
        Ok(stats)
    }
}

/// The first `max` keys of `range` in `table`.
fn first_keys<K: redb::Key + 'static, V: redb::Value + 'static>(
    table: &redb::Table<K, V>,
    range: std::ops::Range<K::SelfType<'_>>,
    max: usize,
) -> Result<Vec<K::SelfType<'static>>, redb::StorageError>
where
    for<'a> K::SelfType<'a>: ToOwned<Owned = K::SelfType<'static>>,
{
    let mut out = Vec::new();
    for entry in table.range(range)?.take(max) {
        out.push(entry?.0.value().to_owned());
    }
    Ok(out)
}

/// Compacts a database file that no daemon holds: moves data down and truncates the freed
/// tail. Returns the file size before and after.
pub fn compact(path: &Path) -> Result<(u64, u64), StoreOpenError> {
    if !path.exists() {
        return Err(StoreOpenError::Missing {
            path: path.to_owned(),
        });
    }
    let size = || std::fs::metadata(path).map_or(0, |m| m.len());
    let before = size();
    let mut db = redb::Builder::new()
        .open(path)
        .map_err(|e| open_error(path, e))?;
    loop {
        match db.compact() {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                return Err(StoreOpenError::Corrupt {
                    path: path.to_owned(),
                    source: e.into(),
                });
            }
        }
    }
    drop(db);
    Ok((before, size()))
}
