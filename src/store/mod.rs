//! [`Store`]: the redb shell. Table definitions, keys, the file's format version, opening, and
//! the upsert-and-increment commit; the documents it keeps are [`crate::doc`]'s. The only module
//! that imports `redb`. Split by noun: [`StoreReader`] (`reader`), retention and compaction
//! (`retention`), the outbox (`outbox`), the journal (`journal`: where a commit becomes durable)
//! and the fault seam for tests (`faults`).
//!
//! A commit is durable once its record is in the journal (`<path>.journal`, one write and one
//! `fdatasync`); it then waits in memory (`store::pending`), where readers see it, until a
//! checkpoint folds it into redb in a durable transaction (`store::log`). Opening the file
//! applies the journal's records that it lacks. Without a journal (`store.journal_size = 0`)
//! every commit is a durable redb transaction.
//!
//! Tables:
//! - `log`: `u64` commit sequence number -> a [`crate::commitlog`] record: what that commit
//!   added, until a checkpoint folds it into `buckets` and `pages` (`store::log`). Written by a
//!   journal's replay and by commits without the journal: its keys only grow.
//! - `series_by_name`: `&str` (`sensor/metric`) -> `u64` id; `series_by_id`: the reverse. Ids
//!   start at 0; a new series takes one above the highest. Retention deletes a series whose last
//!   bucket it deleted (nothing else refers to its id then: the log is folded first), so a
//!   lapsed series frees its place in `limits.max_series` ([`Store::take_forgotten`]).
//! - `buckets`: `(series_id: u64, start: i64)` -> BSON [`BucketDoc`] as of the last checkpoint.
//!   redb orders integer tuples numerically, so one series' buckets are contiguous and in time
//!   order.
//! - `pages`: `(series_id: u64, start: i64, page_no: u32)` -> BSON [`PageDoc`]: the raw readings
//!   of a bucket, at most `page_capacity` per page, in arrival order ([`crate::page`]).
//! - `meta`: `&str` -> `&str`: `format_version`, `bucket_width_secs`, `created_at`.
//! - `dedup`: `u64` commit sequence number -> the [`crate::dedup`] fingerprints of the messages
//!   that commit counted, each with the session and packet id that put it in a resend sequence
//!   ([`crate::dedup::encode`]: ~11 bytes each). Written in the same transaction as the log record,
//!   and trimmed to the last `limits.dedup_window` fingerprints by each checkpoint. The last entry is always kept: its
//!   key is the sequence number of the last commit, which tells a retry whether a commit whose
//!   outcome was unknown (an I/O error) landed.
//! - `applied`: `&str` gateway id -> BSON [`crate::delta::Position`], the last delta message
//!   applied from that gateway (central instances only), written with the buckets it changed.
//! - `outbox`: see `store::outbox` (gateways with an `[upstream]` only).

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};

use crate::config::Durability;
use crate::doc::{BucketDoc, PageDoc};

mod commit;
#[cfg(any(test, feature = "fault-injection"))]
mod faults;
mod journal;
mod log;
mod merged;
mod outbox;
mod pending;
mod placement;
mod reader;
mod records;
mod recovery;
mod retention;
mod unfolded;
mod view;

use self::commit::{apply_outbox, apply_redo};

#[cfg(test)]
pub(crate) use faults::FAILING_SYNCS;
#[cfg(any(test, feature = "fault-injection"))]
pub use faults::{Cut, Faults, Landed};
pub use journal::{JournalError, Redo, path_for as journal_path};
pub use log::CheckpointStats;
pub use outbox::{OutboxDoc, OutboxShared};
pub use reader::StoreReader;
pub use retention::{ExpireStats, compact};

const SERIES_BY_NAME: TableDefinition<&str, u64> = TableDefinition::new("series_by_name");
const SERIES_BY_ID: TableDefinition<u64, &str> = TableDefinition::new("series_by_id");
const BUCKETS: TableDefinition<(u64, i64), &[u8]> = TableDefinition::new("buckets");
const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
const PAGES: TableDefinition<(u64, i64, u32), &[u8]> = TableDefinition::new("pages");
const DEDUP: TableDefinition<u64, &[u8]> = TableDefinition::new("dedup");
const APPLIED: TableDefinition<&str, &[u8]> = TableDefinition::new("applied");

/// Version of the table layout, in `meta.format_version`. 2: the commit log (`log`); 3: `dedup`
/// entries carry the resend sequence of each fingerprint ([`crate::dedup::encode`]); 4 (issue
/// 42): compact `dedup` entries, version-2 `log` records, and `meta.fold_cursor` while a
/// checkpoint is under way, none of which a format-3 release reads right. Older files are
/// migrated when opened: a version-1 file gets its `log` table; the `dedup` entries and `log`
/// records of versions 1 to 3 stay as they are and are read as written.
pub const FORMAT_VERSION: u32 = 4;
/// Settings the store needs, from `[store]`.
#[derive(Debug, Clone)]
pub struct StoreSettings {
    pub path: PathBuf,
    pub bucket_width_secs: i64,
    pub durability: Durability,
    pub quick_repair: bool,
    pub cache_bytes: usize,
    /// Most raw readings per page.
    pub page_capacity: u32,
    /// Fingerprints of recent messages kept for recognising redeliveries.
    pub dedup_window: usize,
    /// Most outbox entries kept for the upstream (`store::outbox`); 0: no outbox (no `[upstream]`).
    pub outbox_max_entries: usize,
    /// Size of the journal file (`store.journal_size`); 0: no journal, every commit a durable
    /// redb transaction.
    pub journal_bytes: u64,
}

/// Why the database file could not be opened. Each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum StoreOpenError {
    #[error(
        "database file {path} is in use by another process (is bucketd already running?); \
         stop it, or read through its HTTP API with `bucketd query`"
    )]
    Locked { path: PathBuf },
    #[error("database file {path} does not exist")]
    Missing { path: PathBuf },
    #[error("cannot open database file {path}: {source}; {}", io_advice(.source))]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "database file {path} is damaged or not a bucketd database ({source}); move it aside \
         and restart to begin a new one, or restore a backup"
    )]
    Corrupt { path: PathBuf, source: redb::Error },
    #[error(
        "database file {path} was created with bucket_width {stored}s but the config says {configured}s; \
         set store.bucket_width back, or use a new file"
    )]
    WidthMismatch {
        path: PathBuf,
        stored: i64,
        configured: i64,
    },
    #[error(
        "database file {path} has format version {found}, this bucketd reads versions 1 to \
         {FORMAT_VERSION}; use the bucketd release that wrote it"
    )]
    UnsupportedFormat { path: PathBuf, found: String },
    #[error(
        "database file {path} was not closed cleanly (a power cut, a crash or kill -9) and needs \
         the recovery that bucketd does when it opens the file (it also applies the journal's \
         commits); start bucketd once, then read it"
    )]
    NeedsRecovery { path: PathBuf },
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(
        "database file {path}: its journal {journal} holds {commits} acknowledged commit(s) that the \
         file does not (bucketd stopped without a clean shutdown); start bucketd once to apply \
         them, then read the file"
    )]
    JournalPending {
        path: PathBuf,
        journal: PathBuf,
        commits: usize,
    },
}

/// What an operator can do about an I/O error opening the file. Nothing about it is damaged:
/// the file and its journal keep every acknowledged commit, and the next start goes on.
fn io_advice(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::StorageFull => {
            "the disk is full: free space on it and start bucketd again (the file and its \
             journal keep every acknowledged commit; do not move them aside)"
        }
        std::io::ErrorKind::PermissionDenied
        | std::io::ErrorKind::NotFound
        | std::io::ErrorKind::ReadOnlyFilesystem => {
            "check that the directory exists and is writable by this user"
        }
        _ => {
            "the disk reported an error (a failing card?); nothing was discarded: fix the disk \
             and start bucketd again, keeping the file and its journal"
        }
    }
}

/// A commit that failed; nothing of the batch is acknowledged. After an I/O error redb refuses
/// every further call until the file is reopened ([`Store::reopen`]).
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("the database is closed after a write error and could not be reopened yet")]
    Closed,
    #[error("redb: {0}")]
    Redb(#[from] redb::Error),
    #[error("stored bucket document for series id {series_id} at {start} is unreadable: {source}")]
    Decode {
        series_id: u64,
        start: i64,
        source: bson::error::Error,
    },
    #[error("raw page {page_no} of series id {series_id} at {start} is unreadable")]
    Page {
        series_id: u64,
        start: i64,
        page_no: u32,
    },
    #[error("outbox entry {seq} is unreadable: {source}")]
    Outbox {
        seq: u64,
        source: bson::error::Error,
    },
    #[error("writing the journal failed: {0}")]
    Journal(std::io::Error),
    #[error(
        "commits waiting in the journal were not folded before a commit that does not fit in it; \
         nothing was written (it is retried after the next checkpoint)"
    )]
    Unfolded,
}

impl From<JournalError> for CommitError {
    /// A live record read back unreadable: damage.
    fn from(e: JournalError) -> Self {
        CommitError::Redb(redb::Error::Corrupted(e.to_string()))
    }
}

impl CommitError {
    /// Whether trying again (after [`Store::reopen`]) can clear it: a failing or full disk, a
    /// closed file, commits not folded yet (the retry folds first). Damage cannot. Every
    /// variant is named, so that a new one is classified where it is added.
    pub fn retryable(&self) -> bool {
        match self {
            CommitError::Closed | CommitError::Journal(_) | CommitError::Unfolded => true,
            CommitError::Redb(_) => !self.is_damage(),
            CommitError::Decode { .. } | CommitError::Page { .. } | CommitError::Outbox { .. } => {
                false
            }
        }
    }

    /// Whether this is damage to what is stored (an unreadable document, page or record), which
    /// no retry fixes, rather than a failing disk.
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            CommitError::Decode { .. }
                | CommitError::Page { .. }
                | CommitError::Outbox { .. }
                | CommitError::Redb(redb::Error::Corrupted(_))
        )
    }
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for CommitError {
            fn from(e: $t) -> Self {
                CommitError::Redb(e.into())
            }
        }
    )*};
}
from_redb!(
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError,
    redb::SetDurabilityError
);

/// What one commit wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Bucket deltas in the commit's log record.
    pub buckets_written: usize,
    pub series_created: usize,
    /// Bytes of the log record and fingerprints.
    pub log_bytes: usize,
}

/// The open database, owned by the writer thread (one writer). Readers share the same handle
/// through [`Store::reader`]; redb's MVCC read transactions never block the writer.
pub struct Store {
    /// `None` only between a failed reopen and the next successful one.
    db: Option<Arc<redb::Database>>,
    /// The same handle for readers ([`StoreReader`]); emptied while the file is reopened, since
    /// redb's file lock lasts as long as any handle does.
    shared: SharedDb,
    path: PathBuf,
    settings: StoreSettings,
    /// Every series in the file, name -> id; bounded by `limits.max_series` through the ingest
    /// side, which refuses new series past the limit.
    series: HashMap<Arc<str>, u64>,
    /// The id the next new series takes: one above the highest in the file.
    next_series_id: u64,
    /// Series retention deleted, not yet reported to the ingest side ([`Store::take_forgotten`]);
    /// a commit that brings one back takes it off.
    forgotten: Vec<Arc<str>>,
    /// How this file's messages are fingerprinted (its key, read or made at the first open).
    fingerprinter: Option<crate::dedup::Fingerprinter>,
    /// Test seam: injected write faults, see [`Faults`].
    #[cfg(any(test, feature = "fault-injection"))]
    faults: Option<Arc<Faults>>,
    /// The outbox's state, shared with the forwarder.
    outbox: Arc<OutboxShared>,
    /// The checkpoint under way, if one is (`meta` holds it too).
    fold: Option<log::FoldCursor>,
    /// A write transaction of the file itself (a checkpoint part, a retention pass, a
    /// `sync_file`) failed on I/O: redb refuses every call on this handle, and what the page
    /// cache shows of the failed transaction may never reach the disk. The next such
    /// transaction first reopens the file from the disk ([`Store::recover`]), keeping the
    /// journal and the commits waiting in it.
    needs_recovery: bool,
    /// What a commit advances: the sequence, the journal, the commits waiting, the log's bytes
    /// and the dedup log ([`commit::Commits`]).
    commits: commit::Commits,
}

type SharedDb = Arc<RwLock<Option<Arc<redb::Database>>>>;

impl Drop for Store {
    /// Closes the file for readers too: a `StoreReader` still alive (an HTTP connection task
    /// that has not ended yet) then gets "being reopened" instead of keeping the file and its
    /// lock open after the daemon stopped.
    fn drop(&mut self) {
        if let Ok(mut shared) = self.shared.write() {
            *shared = None;
        }
    }
}

impl Store {
    /// Opens (or creates) the database file and checks its format and bucket width.
    pub fn open(settings: &StoreSettings) -> Result<Store, StoreOpenError> {
        let mut store = Store::unloaded(settings);
        store.load()?;
        if store.commits.journal.is_some() {
            // Once a start: whether the journal's units are the card's (docs/STORAGE.md).
            placement::log_placement(&journal::path_for(&store.path));
        }
        Ok(store)
    }

    /// [`Store::open`], with write faults injected under redb when `faults` is given (tests).
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn open_with_faults(
        settings: &StoreSettings,
        faults: Option<Arc<Faults>>,
    ) -> Result<Store, StoreOpenError> {
        let mut store = Store::unloaded(settings);
        store.faults = faults;
        store.load()?;
        Ok(store)
    }

    fn unloaded(settings: &StoreSettings) -> Store {
        Store {
            db: None,
            shared: Arc::new(RwLock::new(None)),
            path: settings.path.clone(),
            settings: settings.clone(),
            series: HashMap::new(),
            next_series_id: 0,
            forgotten: Vec::new(),
            fingerprinter: None,
            #[cfg(any(test, feature = "fault-injection"))]
            faults: None,
            outbox: Arc::new(OutboxShared::default()),
            fold: None,
            needs_recovery: false,
            commits: commit::Commits::default(),
        }
    }

    fn create_db(&self, builder: &redb::Builder) -> Result<redb::Database, redb::DatabaseError> {
        #[cfg(any(test, feature = "fault-injection"))]
        if let Some(faults) = &self.faults {
            return faults::create(builder, &self.path, faults.clone());
        }
        builder.create(&self.path)
    }

    /// Opens redb's file.
    fn open_file(&mut self) -> Result<(), redb::DatabaseError> {
        let mut builder = redb::Builder::new();
        builder.set_cache_size(self.settings.cache_bytes);
        self.db = Some(Arc::new(self.create_db(&builder)?));
        Ok(())
    }

    /// Closes redb's file, for readers too ([`StoreReader`] then answers "being reopened").
    /// The handle is dropped here, not by a reader that happened to hold it: a handle dropped
    /// after a new one opened the file would write its allocator state and shutdown header over
    /// the new handle's commits (redb's file lock does not tell two handles of one process
    /// apart). Readers hold it only while they begin a transaction.
    fn close_file(&mut self) {
        *self
            .shared
            .write()
            .expect("no panic while holding the lock") = None;
        let Some(mut db) = self.db.take() else {
            return;
        };
        loop {
            match Arc::try_unwrap(db) {
                Ok(db) => {
                    drop(db);
                    return;
                }
                Err(held) => {
                    db = held;
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Drops the kernel's cached pages of the file (and of the journal, with `journal`), so that
    /// what is read next comes from the disk: after a failed fsync Linux keeps the pages it could
    /// not write, marked clean, and reads them back as if they were on the disk (PostgreSQL's
    /// "fsyncgate"). Best effort: pages still dirty stay (the kernel writes them first).
    fn drop_cached_pages(&self, journal: bool) {
        drop_cached_pages(&self.path);
        if journal {
            drop_cached_pages(&journal::path_for(&self.path));
        }
        #[cfg(any(test, feature = "fault-injection"))]
        if let Some(faults) = &self.faults {
            faults.drop_cached_pages(journal);
        }
    }

    /// Opens the file and reads the state kept in memory: series, commit sequence number and
    /// dedup log. Both files are read from the disk, not from the page cache: an earlier
    /// process (or this one, before [`Store::reopen`]) may have died after an fsync failed, and
    /// Linux keeps the pages it could not write, marked clean, and reads them back as if they
    /// were on the disk. Trusted, such a fold would move the file's next commit number past
    /// records that the replay then skips and frees, and new commits overwrite: after the next
    /// power cut or eviction those readings would be in neither file.
    fn load(&mut self) -> Result<(), StoreOpenError> {
        // Opened anew here: nothing for `recover` to do.
        self.needs_recovery = false;
        self.drop_cached_pages(true);
        let path = self.path.clone();
        self.open_file().map_err(|e| match open_error(&path, e) {
            // Creating: a missing file is made, so "not found" means the directory is missing.
            StoreOpenError::Missing { path } => StoreOpenError::Io {
                path,
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            },
            other => other,
        })?;
        // The journal's replay below brings back what was pending, into the `log` table.
        pending::clear(&self.commits.pending);
        let corrupt = |source| failed_open(&path, source);
        let journal_id = self.init_meta().map_err(corrupt)??;
        self.open_journal(journal_id)?;
        let db = self.db.clone().expect("opened above");
        let db = &*db;
        self.series = read_series(db).map_err(corrupt)?;
        self.next_series_id = self.series.values().max().map_or(0, |id| id + 1);
        let (next_seq, log) = read_dedup_log(db).map_err(corrupt)?;
        self.commits.next_seq = next_seq;
        self.commits.dedup_total = log.iter().map(|e| e.1).sum();
        self.commits.dedup_log = log;
        // Chosen once, at the first open: the admission keeps what it was given.
        if self.fingerprinter.is_none() {
            self.fingerprinter = Some(self.fingerprint_key().map_err(corrupt)?);
        }
        let tx = db.begin_read().map_err(|e| corrupt(e.into()))?;
        let meta = tx.open_table(META).map_err(|e| corrupt(e.into()))?;
        self.fold = log::FoldCursor::read(&meta).map_err(corrupt)?;
        drop(meta);
        let cut = self.fold.map(|c| c.through);
        let (log_bytes, logged, runs) = log::scan(&tx, cut).map_err(corrupt)?;
        self.commits.log_bytes = log_bytes;
        pending::set_logged(&self.commits.pending, logged, runs);
        drop(tx);
        outbox::load(db, &self.outbox).map_err(corrupt)?;
        self.shared
            .write()
            .expect("no panic while holding the lock")
            .clone_from(&self.db);
        Ok(())
    }

    /// The file's fingerprint key (`meta.fingerprint_key`), made (durably, with
    /// `meta.fingerprint_key_since`: the first commit whose fingerprints it keys) when the file
    /// has none: a new file, or one of a release before issue 52. While the dedup log still
    /// holds commits from before it, their unkeyed fingerprints are looked for too. Called
    /// after the journal's replay, whose records an older release may have written.
    fn fingerprint_key(&self) -> Result<crate::dedup::Fingerprinter, redb::Error> {
        use crate::dedup::{FingerprintKey, Fingerprinter};
        let db = self.db();
        let stored = {
            let tx = db.begin_read()?;
            let meta = tx.open_table(META)?;
            let key = meta
                .get("fingerprint_key")?
                .and_then(|v| FingerprintKey::parse(v.value()));
            let since = meta
                .get("fingerprint_key_since")?
                .and_then(|v| v.value().parse::<u64>().ok());
            key.zip(since)
        };
        let (key, since) = if let Some(stored) = stored {
            stored
        } else {
            let mut secret = [0u8; 16];
            let made = getrandom::fill(&mut secret)
                .map_err(|e| redb::Error::Io(std::io::Error::other(e)))
                .map(|()| FingerprintKey::from_bytes(secret))
                .and_then(|key| {
                    let tx = self.durable_tx().map_err(commit_to_redb)?;
                    {
                        let mut meta = tx.open_table(META)?;
                        meta.insert("fingerprint_key", key.to_hex().as_str())?;
                        let since = self.commits.next_seq.to_string();
                        meta.insert("fingerprint_key_since", since.as_str())?;
                    }
                    tx.commit()?;
                    Ok(key)
                });
            match made {
                Ok(key) => (key, self.commits.next_seq),
                Err(e) => {
                    // Unkeyed for this run (as before issue 52); made at the next start.
                    tracing::warn!(
                        error = %e,
                        "Could not store a fingerprint key in the database file; this run \
                         recognises redelivered messages by unkeyed fingerprints."
                    );
                    return Ok(Fingerprinter::default());
                }
            }
        };
        let legacy = self
            .commits
            .dedup_log
            .front()
            .is_some_and(|&(seq, _)| seq < since);
        Ok(Fingerprinter::new(Some(key), legacy))
    }

    /// The fingerprints of this file's messages (keyed with its key).
    pub fn fingerprinter(&self) -> crate::dedup::Fingerprinter {
        self.fingerprinter.unwrap_or_default()
    }

    /// Opens the journal (creating it when `journal_bytes` asks for one), and applies the records
    /// the file lacks in one durable transaction. A journal left from a run
    /// with one is applied even when this run has none, then removed; one of another size is
    /// made anew once applied.
    fn open_journal(&mut self, id: u64) -> Result<(), StoreOpenError> {
        let path = journal::path_for(&self.path);
        let wanted = self.settings.journal_bytes;
        self.commits.journal = None;
        if wanted == 0 && !path.exists() {
            return Ok(());
        }
        #[cfg(any(test, feature = "fault-injection"))]
        let faults = self.faults.clone();
        let open_file = |p: &Path| -> std::io::Result<Box<dyn journal::JournalFile>> {
            #[cfg(any(test, feature = "fault-injection"))]
            if let Some(f) = faults.clone() {
                return faults::open_journal(p, f);
            }
            Ok(Box::new(journal::open_file(p)?))
        };
        let mut j = match journal::Journal::open(path.clone(), id, wanted, open_file) {
            Err(JournalError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::StorageFull =>
            {
                self.make_room_for_journal(&path, wanted)?;
                journal::Journal::open(path.clone(), id, wanted, open_file)
                    .map_err(|e| no_room(e, &path, wanted))?
            }
            opened => opened?,
        };
        let db_path = self.path.clone();
        let corrupt = |source: redb::Error| failed_open(&db_path, source);
        let (next_seq, _) = read_dedup_log(self.db()).map_err(corrupt)?;
        let tx = self.durable_tx().map_err(|e| corrupt(commit_to_redb(e)))?;
        let applied = j.replay(next_seq, |seq, redo| {
            apply_redo(&tx, seq, redo).map_err(|e| corrupt(commit_to_redb(e)))
        })?;
        // Committed durably even with nothing to apply: the records of the commits the file
        // shows are overwritten from now on, and what the file shows may be a fold whose fsync
        // failed in an earlier process, still in the device's volatile cache. This fsync
        // flushes it, or fails and the open with it (the journal keeps them).
        tx.commit().map_err(|e| corrupt(e.into()))?;
        if applied > 0 {
            tracing::info!(
                commits = applied,
                journal = %path.display(),
                "Applied the journal's commits that the database file lacked (bucketd stopped \
                 without a clean shutdown); nothing acknowledged was lost."
            );
        }
        // The file holds every record now, durably.
        j.release_below(u64::MAX);
        // Made anew (now that the file holds its records) when its size changed, or when an
        // older release wrote it in a format this one only reads.
        if wanted == 0 || j.size() != wanted || !j.current_format() {
            drop(j);
            // Kept as `<journal>.old`, not deleted: if the disk damaged it in a way the replay
            // could not see (a format-1 journal has no pages to scan), its bytes are still there
            // to be read (issue 51).
            std::fs::rename(&path, journal::replaced_path(&path)).map_err(|source| {
                JournalError::Io {
                    path: path.clone(),
                    source,
                }
            })?;
            if wanted == 0 {
                return Ok(());
            }
            return self.open_journal(id);
        }
        self.commits.journal = Some(j);
        Ok(())
    }

    /// No room to make the journal (`wanted` bytes): a journal kept as `<journal>.old` when an
    /// earlier start made it anew is removed, once a durable transaction has synced the file,
    /// which holds its commits (it was set aside only after they were applied). Without one,
    /// the error says how much room is needed.
    fn make_room_for_journal(&self, path: &Path, wanted: u64) -> Result<(), StoreOpenError> {
        let old = journal::replaced_path(path);
        let no_room = || {
            StoreOpenError::from(JournalError::NoRoom {
                path: path.to_owned(),
                bytes: wanted,
                old_removed: None,
            })
        };
        if !old.exists() {
            return Err(no_room());
        }
        let corrupt = |source| failed_open(&self.path, source);
        let synced = self
            .durable_tx()
            .and_then(|tx| tx.commit().map_err(CommitError::from));
        synced.map_err(|e| corrupt(commit_to_redb(e)))?;
        std::fs::remove_file(&old).map_err(|source| JournalError::Io {
            path: old.clone(),
            source,
        })?;
        tracing::warn!(
            removed = %old.display(),
            journal = %path.display(),
            bytes = wanted,
            "No room to make the journal: removed the journal set aside at an earlier start \
             (its commits are in the database file, now synced) and trying again."
        );
        Ok(())
    }

    /// A write transaction that is durable when it commits, with the configured commit mode.
    fn durable_tx(&self) -> Result<redb::WriteTransaction, CommitError> {
        let mut tx = self.open_db()?.begin_write()?;
        tx.set_durability(redb::Durability::Immediate)?;
        tx.set_two_phase_commit(self.settings.durability == Durability::TwoPhase);
        tx.set_quick_repair(self.settings.quick_repair);
        Ok(tx)
    }

    /// Makes every commit durable in the file itself (one durable transaction, if the journal
    /// holds any), so that the file alone holds everything: at shutdown, before the file is
    /// read by `bucketd export` or copied.
    pub fn sync_file(&mut self) -> Result<(), CommitError> {
        self.recovered()?;
        if !pending::commits(&self.commits.pending).is_empty() {
            // Folded: the file then holds them, and their journal records are not live.
            self.checkpoint()?;
            return Ok(());
        }
        if self.commits.journal.as_ref().is_none_or(|j| j.used() == 0) {
            return Ok(());
        }
        let committed = self
            .durable_tx()
            .and_then(|tx| tx.commit().map_err(CommitError::from));
        self.note_failure(committed)?;
        self.commits.durable_committed();
        Ok(())
    }

    /// Bytes of the journal's live records (commits not folded yet), and the room it has (both
    /// 0 without a journal).
    pub fn journal_use(&self) -> (u64, u64) {
        self.commits
            .journal
            .as_ref()
            .map_or((0, 0), |j| (j.used(), j.room()))
    }

    fn db(&self) -> &redb::Database {
        self.db
            .as_deref()
            .expect("open: callers check `is_open` first")
    }

    fn open_db(&self) -> Result<&redb::Database, CommitError> {
        self.db.as_deref().ok_or(CommitError::Closed)
    }

    /// Sequence number of the next commit; one more than that of the last commit in the file.
    pub fn next_seq(&self) -> u64 {
        self.commits.next_seq
    }

    /// The dedup window's fingerprints in the file with their resend sequence tags, oldest
    /// first.
    pub fn recent_fingerprints(
        &self,
    ) -> Result<Vec<(crate::dedup::Fingerprint, crate::dedup::Tag)>, redb::Error> {
        let tx = self.open_db().map_err(|_| closed_error())?.begin_read()?;
        let table = tx.open_table(DEDUP)?;
        let mut out = Vec::with_capacity(self.commits.dedup_total);
        for entry in table.iter()? {
            let (key, value) = entry?;
            let fps = crate::dedup::decode(value.value()).ok_or_else(|| {
                redb::Error::Corrupted(format!("dedup entry {} is unreadable", key.value()))
            })?;
            out.extend(fps);
        }
        // Then the pending commits' (the writer alone changes the list: no fold between).
        for commit in pending::commits(&self.commits.pending).iter() {
            let fps = crate::dedup::decode(&commit.fingerprints).ok_or_else(|| {
                redb::Error::Corrupted(format!("dedup entry {} is unreadable", commit.seq))
            })?;
            out.extend(fps);
        }
        Ok(out)
    }

    /// The last delta message applied per gateway (`fleet::applied`).
    pub fn applied_positions(&self) -> Result<Vec<(String, crate::delta::Position)>, redb::Error> {
        let tx = self.open_db().map_err(|_| closed_error())?.begin_read()?;
        let table = tx.open_table(APPLIED)?;
        let mut out = Vec::new();
        for entry in table.iter()? {
            let (gateway, value) = entry?;
            let at = crate::delta::Position::decode(value.value()).ok_or_else(|| {
                redb::Error::Corrupted(format!(
                    "applied position of gateway {} is unreadable",
                    gateway.value()
                ))
            })?;
            out.push((gateway.value().to_owned(), at));
        }
        Ok(out)
    }

    /// Creates the tables and meta entries of a new file, or checks those of an existing one.
    /// Returns the file's journal id (`meta.journal_id`, made when missing), which ties the
    /// journal to this file.
    fn init_meta(&mut self) -> Result<Result<u64, StoreOpenError>, redb::Error> {
        let tx = self.db().begin_write()?;
        let checked = {
            let mut meta = tx.open_table(META)?;
            tx.open_table(SERIES_BY_NAME)?;
            tx.open_table(SERIES_BY_ID)?;
            tx.open_table(BUCKETS)?;
            tx.open_table(PAGES)?;
            tx.open_table(DEDUP)?;
            tx.open_table(APPLIED)?;
            tx.open_table(outbox::OUTBOX)?;
            tx.open_table(log::LOG)?;
            let format = meta.get("format_version")?.map(|v| v.value().to_owned());
            match format {
                None => {
                    meta.insert("format_version", FORMAT_VERSION.to_string().as_str())?;
                    meta.insert(
                        "bucket_width_secs",
                        self.settings.bucket_width_secs.to_string().as_str(),
                    )?;
                    meta.insert(
                        "created_at",
                        crate::reading::Timestamp::now()
                            .to_rfc3339_millis()
                            .as_str(),
                    )?;
                    Ok(())
                }
                Some(v)
                    if v != FORMAT_VERSION.to_string()
                        && !["1", "2", "3"].contains(&v.as_str()) =>
                {
                    Err(StoreOpenError::UnsupportedFormat {
                        path: self.path.clone(),
                        found: v,
                    })
                }
                Some(v) => {
                    let stored = meta
                        .get("bucket_width_secs")?
                        .and_then(|v| v.value().parse::<i64>().ok())
                        .unwrap_or(-1);
                    if stored == self.settings.bucket_width_secs {
                        if v != FORMAT_VERSION.to_string() {
                            // Format 1 is format 2 with an empty log (created above); format 2
                            // is format 3 with untagged fingerprints; format 3 is format 4
                            // with older encodings, which format 4 reads.
                            meta.insert("format_version", FORMAT_VERSION.to_string().as_str())?;
                            tracing::info!(
                                path = %self.path.display(),
                                from = %v,
                                to = FORMAT_VERSION,
                                "Migrated the database file to the current format; bucketd \
                                 releases before the migration cannot open it any more."
                            );
                        }
                        Ok(())
                    } else {
                        Err(StoreOpenError::WidthMismatch {
                            path: self.path.clone(),
                            stored,
                            configured: self.settings.bucket_width_secs,
                        })
                    }
                }
            }
        };
        let id = {
            let mut meta = tx.open_table(META)?;
            let stored = meta
                .get("journal_id")?
                .and_then(|v| v.value().parse::<u64>().ok());
            if let Some(id) = stored {
                id
            } else {
                let id = new_journal_id(&self.path);
                meta.insert("journal_id", id.to_string().as_str())?;
                id
            }
        };
        tx.commit()?;
        Ok(checked.map(|()| id))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The outbox's state, for the forwarder.
    pub fn outbox(&self) -> Arc<OutboxShared> {
        self.outbox.clone()
    }

    /// A reader over this open database, for queries while the daemon runs.
    pub fn reader(&self) -> StoreReader {
        StoreReader::shared(
            self.shared.clone(),
            self.commits.pending.clone(),
            self.settings.page_capacity,
        )
    }

    /// Names of every stored series.
    pub fn series_names(&self) -> impl Iterator<Item = &Arc<str>> {
        self.series.keys()
    }

    pub fn series_count(&self) -> usize {
        self.series.len()
    }

    /// Test seam: the bytes of every record not folded, counted again from the `log` table
    /// and the pending commits ([`Store::log_bytes`] keeps the same sum as they come and go).
    #[cfg(test)]
    pub(crate) fn recount_log_bytes(&self) -> u64 {
        let tx = self.db().begin_read().unwrap();
        let table = log::scan(&tx, None).unwrap().0;
        let pending: u64 = pending::commits(&self.commits.pending)
            .iter()
            .map(|c| c.record.len() as u64)
            .sum();
        table + pending
    }

    /// Test seam: overwrites the stored document of bucket (`series`, `start`) with bytes no
    /// reader can decode, durably: a damaged card, in one key.
    #[cfg(test)]
    pub(crate) fn damage_bucket(&mut self, series: &str, start: i64) {
        let id = self.series[series];
        let tx = self.durable_tx().unwrap();
        tx.open_table(BUCKETS)
            .unwrap()
            .insert((id, start), b"\x05\x00\x00\x00\x42garbage".as_slice())
            .unwrap();
        tx.commit().unwrap();
    }

    /// The series retention deleted since the last call (and no commit brought back), for the
    /// ingest side's [`crate::series::SeriesSet`] to forget.
    pub fn take_forgotten(&mut self) -> Vec<Arc<str>> {
        std::mem::take(&mut self.forgotten)
    }

    /// Size of the database file in bytes.
    pub fn file_bytes(&self) -> u64 {
        std::fs::metadata(&self.path).map_or(0, |m| m.len())
    }
}

/// Appends `raw` to the bucket's pages: fills the last page up to `cap`, then starts new ones.
/// Returns the new page count.
fn append_pages(
    table: &mut redb::Table<(u64, i64, u32), &[u8]>,
    (id, start): (u64, i64),
    pages: i32,
    raw: &[(i64, f64)],
    cap: u32,
) -> Result<i32, CommitError> {
    let cap = cap as usize;
    let mut next = u32::try_from(pages).unwrap_or(0);
    let mut rest = raw;
    if let Some(last) = next.checked_sub(1) {
        let damaged = CommitError::Page {
            series_id: id,
            start,
            page_no: last,
        };
        let stored = table
            .get((id, start, last))?
            .map(|v| PageDoc::from_bytes(v.value()));
        let page = stored.flatten().ok_or(CommitError::Page {
            series_id: id,
            start,
            page_no: last,
        })?;
        if (page.count as usize) < cap {
            // Appended to the page's bit stream without decoding it: O(new readings).
            let take = (cap - page.count as usize).min(rest.len());
            let grown = page.append(&rest[..take]).ok_or(damaged)?;
            rest = &rest[take..];
            table.insert((id, start, last), grown.to_bytes().as_slice())?;
        }
    }
    for chunk in rest.chunks(cap) {
        table.insert((id, start, next), PageDoc::of(chunk).to_bytes().as_slice())?;
        next += 1;
    }
    Ok(i32::try_from(next).expect("fewer than 2^31 pages per bucket"))
}

/// What went wrong reading or writing an open file while opening it: an I/O error (a full disk
/// while the tables are made or the journal replayed, a failing card) is one, never "damaged"
/// (whose advice, to move the file aside, would throw away acknowledged data); anything else
/// is damage.
fn failed_open(path: &Path, e: redb::Error) -> StoreOpenError {
    let path = path.to_owned();
    match e {
        redb::Error::Io(source) => StoreOpenError::Io { path, source },
        other => StoreOpenError::Corrupt {
            path,
            source: other,
        },
    }
}

fn open_error(path: &Path, e: redb::DatabaseError) -> StoreOpenError {
    let path = path.to_owned();
    match e {
        redb::DatabaseError::DatabaseAlreadyOpen => StoreOpenError::Locked { path },
        redb::DatabaseError::Storage(redb::StorageError::Io(source))
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            StoreOpenError::Missing { path }
        }
        // redb reports a wrong magic number or a truncated header as InvalidData.
        redb::DatabaseError::Storage(redb::StorageError::Io(source))
            if source.kind() != std::io::ErrorKind::InvalidData =>
        {
            StoreOpenError::Io { path, source }
        }
        other => StoreOpenError::Corrupt {
            path,
            source: other.into(),
        },
    }
}

/// The `dedup` table's entries, oldest first, and the next commit sequence number.
fn read_dedup_log(db: &redb::Database) -> Result<(u64, VecDeque<(u64, usize)>), redb::Error> {
    let tx = db.begin_read()?;
    let table = tx.open_table(DEDUP)?;
    let mut log = VecDeque::new();
    for entry in table.iter()? {
        let (key, value) = entry?;
        let n = crate::dedup::count(value.value()).ok_or_else(|| {
            redb::Error::Corrupted(format!("dedup entry {} is unreadable", key.value()))
        })?;
        log.push_back((key.value(), n));
    }
    let next = log.back().map_or(0, |&(seq, _)| seq + 1);
    Ok((next, log))
}

/// A journal id for a new file: unlikely to be any other file's (time, process, path).
fn new_journal_id(path: &Path) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&crate::reading::Timestamp::now().as_nanos().to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    h.update(path.as_os_str().as_encoded_bytes());
    h.digest()
}

/// The series a commit names first: by name, and in id order.
type NewSeries = (HashMap<Arc<str>, u64>, Vec<(u64, Arc<str>)>);

/// Drops the kernel's cached pages of the file at `path`, if it can (see
/// `Store::drop_cached_pages`).
fn drop_cached_pages(path: &Path) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Ok(file) = std::fs::File::open(path) {
        // Only advice: a failure leaves the cache as it is (redb's open still checks a header
        // whose commit was not flushed).
        let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed);
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = path;
}

/// The journal could not be made even after [`Store::make_room_for_journal`]: said as no room,
/// naming the `.old` it removed.
fn no_room(e: JournalError, path: &Path, wanted: u64) -> JournalError {
    match e {
        JournalError::Io { source, .. } if source.kind() == std::io::ErrorKind::StorageFull => {
            JournalError::NoRoom {
                path: path.to_owned(),
                bytes: wanted,
                old_removed: Some(journal::replaced_path(path)),
            }
        }
        e => e,
    }
}

/// A commit error as a redb error, for the open path's `Corrupt`.
fn commit_to_redb(e: CommitError) -> redb::Error {
    match e {
        CommitError::Redb(e) => e,
        CommitError::Journal(io) => redb::Error::Io(io),
        other => redb::Error::Corrupted(other.to_string()),
    }
}

fn closed_error() -> redb::Error {
    redb::Error::Io(std::io::Error::other(
        "the database is closed after a write error",
    ))
}

fn read_series(db: &redb::Database) -> Result<HashMap<Arc<str>, u64>, redb::Error> {
    let tx = db.begin_read()?;
    let table = tx.open_table(SERIES_BY_NAME)?;
    let mut series = HashMap::with_capacity(usize::try_from(table.len()?).unwrap_or(0));
    for entry in table.iter()? {
        let (name, id) = entry?;
        series.insert(Arc::from(name.value()), id.value());
    }
    Ok(series)
}

#[cfg(test)]
mod tests;
