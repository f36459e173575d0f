//! [`Store`]: the redb file. Table definitions, key and document encoding, schema version, and
//! the upsert-and-increment commit. The only module that imports `redb`.
//!
//! Tables:
//! - `series_by_name`: `&str` (`sensor/metric`) -> `u64` id; `series_by_id`: the reverse. Ids are
//!   dense, starting at 0.
//! - `buckets`: `(series_id: u64, start: i64)` -> BSON [`BucketDoc`]. redb orders integer tuples
//!   numerically, so one series' buckets are contiguous and in time order.
//! - `pages`: `(series_id: u64, start: i64, page_no: u32)` -> BSON [`PageDoc`]: the raw readings
//!   of a bucket, at most `page_capacity` per page, in arrival order ([`crate::page`]).
//! - `meta`: `&str` -> `&str`: `format_version`, `bucket_width_secs`, `created_at`.
//! - `dedup`: `u64` commit sequence number -> the [`crate::dedup`] fingerprints of the messages
//!   that commit counted (16 bytes each). Written in the same transaction as the buckets, and
//!   trimmed to the last `limits.dedup_window` fingerprints. The last entry is always kept: its
//!   key is the sequence number of the last commit, which tells a retry whether a commit whose
//!   outcome was unknown (an I/O error) landed.
//! - `applied`: `&str` gateway id -> BSON [`crate::applied::Position`], the last delta message
//!   applied from that gateway (central instances only), written with the buckets it changed.
//! - `outbox`: see [`outbox`] (gateways with an `[upstream]` only).

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::batcher::Batch;
use crate::config::Durability;
use crate::sketch::Sketch;
use crate::summary::{Point, Summary};

mod outbox;
pub use outbox::{OutboxDoc, OutboxShared};

const SERIES_BY_NAME: TableDefinition<&str, u64> = TableDefinition::new("series_by_name");
const SERIES_BY_ID: TableDefinition<u64, &str> = TableDefinition::new("series_by_id");
const BUCKETS: TableDefinition<(u64, i64), &[u8]> = TableDefinition::new("buckets");
const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
const PAGES: TableDefinition<(u64, i64, u32), &[u8]> = TableDefinition::new("pages");
const DEDUP: TableDefinition<u64, &[u8]> = TableDefinition::new("dedup");
const APPLIED: TableDefinition<&str, &[u8]> = TableDefinition::new("applied");

/// Version of the table layout, in `meta.format_version`.
pub const FORMAT_VERSION: u32 = 1;
/// Version of the bucket document, in every document's `schema_version`. Version 1 had no
/// `sketch`; such documents read with an empty sketch, and their quantiles are unknown.
pub const SCHEMA_VERSION: i32 = 2;

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
    /// Most outbox entries kept for the upstream ([`outbox`]); 0: no outbox (no `[upstream]`).
    pub outbox_max_entries: usize,
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
    #[error(
        "cannot open database file {path}: {source}; check that the directory exists and is \
         writable by this user"
    )]
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
        "database file {path} has format version {found}, this bucketd reads version {FORMAT_VERSION}; \
         use the bucketd release that wrote it"
    )]
    UnsupportedFormat { path: PathBuf, found: String },
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
}

/// The stored page document (schema version 1): a [`crate::page::EncodedPage`] plus its time
/// range, so that a reader can skip pages without decoding them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PageDoc {
    pub schema_version: i32,
    pub count: i32,
    pub min_ts: i64,
    pub max_ts: i64,
    /// Nanoseconds per stored timestamp unit.
    pub unit: i64,
    /// Decimal digits of the value encoding, or -1 for XOR-encoded values.
    pub decimals: i32,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// Where the encoder stopped ([`crate::page::Tail`]), so appends need no decoding.
    pub tail_ts: i64,
    pub tail_delta: i64,
    pub tail_value: i64,
    pub tail_lead: i32,
    pub tail_trail: i32,
    pub tail_bits: i32,
}

/// Version of the page document.
pub const PAGE_SCHEMA_VERSION: i32 = 1;

impl PageDoc {
    pub fn of(readings: &[(i64, f64)]) -> PageDoc {
        PageDoc::from_encoded(crate::page::encode(readings))
    }

    /// This page with `readings` appended; `None` if the page is damaged.
    pub fn append(&self, readings: &[(i64, f64)]) -> Option<PageDoc> {
        crate::page::append(&self.encoded()?, readings).map(PageDoc::from_encoded)
    }

    /// The readings in arrival order; `None` if the document is damaged.
    pub fn readings(&self) -> Option<Vec<(i64, f64)>> {
        crate::page::decode(&self.encoded()?)
    }

    fn from_encoded(p: crate::page::EncodedPage) -> PageDoc {
        let small = |v: u32| i32::try_from(v).expect("tail fields are below 64");
        PageDoc {
            schema_version: PAGE_SCHEMA_VERSION,
            count: i32::try_from(p.count).expect("page_capacity is validated below 2^31"),
            min_ts: p.min_ts,
            max_ts: p.max_ts,
            unit: p.unit,
            decimals: p.decimals,
            data: p.data,
            tail_ts: p.tail.ts,
            tail_delta: p.tail.delta,
            tail_value: p.tail.value as i64, // BSON has no u64: the bits, reinterpreted
            tail_lead: small(p.tail.lead),
            tail_trail: small(p.tail.trail),
            tail_bits: small(p.tail.bits),
        }
    }

    fn encoded(&self) -> Option<crate::page::EncodedPage> {
        let small = |v: i32| u32::try_from(v).ok().filter(|v| *v <= 64);
        Some(crate::page::EncodedPage {
            count: u32::try_from(self.count).ok()?,
            min_ts: self.min_ts,
            max_ts: self.max_ts,
            unit: self.unit,
            decimals: self.decimals,
            data: self.data.clone(),
            tail: crate::page::Tail {
                ts: self.tail_ts,
                delta: self.tail_delta,
                value: self.tail_value as u64,
                lead: small(self.tail_lead)?,
                trail: small(self.tail_trail)?,
                bits: small(self.tail_bits).filter(|b| *b < 8)?,
            },
        })
    }

    fn from_bytes(bytes: &[u8]) -> Option<PageDoc> {
        bson::deserialize_from_slice(bytes).ok()
    }

    fn to_bytes(&self) -> Vec<u8> {
        bson::serialize_to_vec(self).expect("a PageDoc has only BSON-representable fields")
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

/// What one retention pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpireStats {
    pub pages: usize,
    pub buckets: usize,
    /// The pass stopped at its budget: more is due.
    pub more: bool,
}

/// What one commit wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    pub buckets_written: usize,
    pub buckets_created: usize,
    pub series_created: usize,
}

/// `first` / `last` in a stored document.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PointDoc {
    /// Nanoseconds since the Unix epoch.
    pub ts: i64,
    pub value: f64,
}

/// The stored bucket document (schema version 1). Field names follow the MongoDB bucket pattern
/// so exported documents load into a collection as they are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketDoc {
    pub schema_version: i32,
    pub series: String,
    pub sensor: String,
    pub metric: String,
    /// Bucket start and end, seconds since the Unix epoch; `end` is exclusive.
    pub start: i64,
    pub end: i64,
    pub count: i64,
    /// Compensated sum: the sum is `sum + sum_comp`.
    pub sum: f64,
    pub sum_comp: f64,
    pub min: f64,
    pub max: f64,
    pub first: PointDoc,
    pub last: PointDoc,
    pub mean: f64,
    pub m2: f64,
    /// Raw reading pages of this bucket (none until raw storage exists).
    pub pages: i32,
    /// The quantile sketch ([`Sketch::encode`]), as BSON binary. Absent in version 1.
    #[serde(default, with = "serde_bytes")]
    pub sketch: Vec<u8>,
}

impl BucketDoc {
    pub fn new(series: &str, start: i64, width_secs: i64, s: &Summary) -> BucketDoc {
        let (sensor, metric) = crate::reading::split_series(series);
        BucketDoc {
            schema_version: SCHEMA_VERSION,
            series: series.to_owned(),
            sensor: sensor.to_owned(),
            metric: metric.to_owned(),
            start,
            end: start + width_secs,
            count: i64::try_from(s.count).expect("bucket counts stay below 2^63"),
            sum: s.sum,
            sum_comp: s.sum_comp,
            min: s.min,
            max: s.max,
            first: PointDoc {
                ts: s.first.ts,
                value: s.first.value,
            },
            last: PointDoc {
                ts: s.last.ts,
                value: s.last.value,
            },
            mean: s.mean,
            m2: s.m2,
            pages: 0,
            sketch: s.sketch.encode(),
        }
    }

    /// The aggregates. A missing (version 1) or unreadable sketch reads as empty, so that the
    /// bucket's quantiles are unknown rather than wrong.
    pub fn summary(&self) -> Summary {
        let sketch = Sketch::decode(&self.sketch)
            .unwrap_or_else(|| Sketch::new(crate::sketch::SketchParams::DEFAULT));
        Summary {
            count: u64::try_from(self.count).unwrap_or(0),
            sum: self.sum,
            sum_comp: self.sum_comp,
            min: self.min,
            max: self.max,
            first: Point {
                ts: self.first.ts,
                value: self.first.value,
            },
            last: Point {
                ts: self.last.ts,
                value: self.last.value,
            },
            mean: self.mean,
            m2: self.m2,
            sketch,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        bson::serialize_to_vec(self).expect("a BucketDoc has only BSON-representable fields")
    }

    pub fn decode(bytes: &[u8]) -> Result<BucketDoc, bson::error::Error> {
        bson::deserialize_from_slice(bytes)
    }
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
    /// Sequence number of the next commit.
    next_seq: u64,
    /// The `dedup` table's entries: (commit sequence number, fingerprints), oldest first.
    dedup_log: VecDeque<(u64, usize)>,
    /// Fingerprints in `dedup_log`.
    dedup_total: usize,
    /// Test seam: injected write faults, see [`Faults`].
    faults: Option<Arc<Faults>>,
    /// The outbox's state, shared with the forwarder.
    outbox: Arc<OutboxShared>,
}

type SharedDb = Arc<RwLock<Option<Arc<redb::Database>>>>;

/// Write faults injected under redb, for tests of what bucketd does when the disk fails: while
/// `fail_writes` is set every write, resize and sync of the file fails with "No space left on
/// device", as a full SD card does; `sync_delay` slows every fsync, as a worn one does. Reads
/// are untouched.
#[derive(Debug, Default)]
pub struct Faults {
    pub fail_writes: std::sync::atomic::AtomicBool,
    pub sync_delay_micros: std::sync::atomic::AtomicU64,
    /// Failed writes, resizes and syncs so far.
    pub failed: std::sync::atomic::AtomicU64,
}

#[derive(Debug)]
struct FaultyBackend {
    inner: redb::backends::FileBackend,
    faults: Arc<Faults>,
}

impl FaultyBackend {
    fn check(&self) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.faults.fail_writes.load(Relaxed) {
            self.faults.failed.fetch_add(1, Relaxed);
            return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
        }
        Ok(())
    }
}

impl redb::StorageBackend for FaultyBackend {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.check()?;
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        self.check()?;
        let delay = self.faults.sync_delay_micros.load(Relaxed);
        if delay > 0 {
            std::thread::sleep(std::time::Duration::from_micros(delay));
        }
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.check()?;
        self.inner.write(offset, data)
    }
    fn close(&self) -> std::io::Result<()> {
        self.inner.close()
    }
    fn try_lock_range(
        &self,
        start: std::ops::Bound<u64>,
        end: std::ops::Bound<u64>,
    ) -> Result<bool, redb::BackendError> {
        self.inner.try_lock_range(start, end)
    }
    fn try_lock_shared_range(
        &self,
        start: std::ops::Bound<u64>,
        end: std::ops::Bound<u64>,
    ) -> Result<bool, redb::BackendError> {
        self.inner.try_lock_shared_range(start, end)
    }
    fn lock_range(
        &self,
        start: std::ops::Bound<u64>,
        end: std::ops::Bound<u64>,
    ) -> Result<(), redb::BackendError> {
        self.inner.lock_range(start, end)
    }
    fn lock_shared_range(
        &self,
        start: std::ops::Bound<u64>,
        end: std::ops::Bound<u64>,
    ) -> Result<(), redb::BackendError> {
        self.inner.lock_shared_range(start, end)
    }
    fn unlock_range(
        &self,
        start: std::ops::Bound<u64>,
        end: std::ops::Bound<u64>,
    ) -> Result<(), redb::BackendError> {
        self.inner.unlock_range(start, end)
    }
    fn query_lock_range(
        &self,
        start: std::ops::Bound<u64>,
        end: std::ops::Bound<u64>,
    ) -> Result<bool, redb::BackendError> {
        self.inner.query_lock_range(start, end)
    }
}

impl Store {
    /// Opens (or creates) the database file and checks its format and bucket width.
    pub fn open(settings: &StoreSettings) -> Result<Store, StoreOpenError> {
        Store::open_with_faults(settings, None)
    }

    /// [`Store::open`], with write faults injected under redb when `faults` is given (tests).
    pub fn open_with_faults(
        settings: &StoreSettings,
        faults: Option<Arc<Faults>>,
    ) -> Result<Store, StoreOpenError> {
        let mut store = Store {
            db: None,
            shared: Arc::new(RwLock::new(None)),
            path: settings.path.clone(),
            settings: settings.clone(),
            series: HashMap::new(),
            next_seq: 0,
            dedup_log: VecDeque::new(),
            dedup_total: 0,
            faults,
            outbox: Arc::new(OutboxShared::default()),
        };
        store.load()?;
        Ok(store)
    }

    /// Opens the file and reads the state kept in memory: series, commit sequence number and
    /// dedup log.
    fn load(&mut self) -> Result<(), StoreOpenError> {
        let path = self.path.clone();
        let builder = {
            let mut b = redb::Builder::new();
            b.set_cache_size(self.settings.cache_bytes);
            b
        };
        let db = match &self.faults {
            None => builder.create(&path),
            Some(faults) => std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(|e| redb::DatabaseError::Storage(redb::StorageError::Io(e)))
                .and_then(redb::backends::FileBackend::new)
                .and_then(|inner| {
                    builder.create_with_backend(FaultyBackend {
                        inner,
                        faults: faults.clone(),
                    })
                }),
        }
        .map_err(|e| match open_error(&path, e) {
            // Creating: a missing file is made, so "not found" means the directory is missing.
            StoreOpenError::Missing { path } => StoreOpenError::Io {
                path,
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            },
            other => other,
        })?;
        self.db = Some(Arc::new(db));
        let corrupt = |source| StoreOpenError::Corrupt {
            path: path.clone(),
            source,
        };
        self.init_meta().map_err(corrupt)??;
        let db = self.db.clone().expect("opened above");
        let db = &*db;
        self.series = read_series(db).map_err(corrupt)?;
        let (next_seq, log) = read_dedup_log(db).map_err(corrupt)?;
        self.next_seq = next_seq;
        self.dedup_total = log.iter().map(|e| e.1).sum();
        self.dedup_log = log;
        outbox::load(db, &self.outbox).map_err(corrupt)?;
        *self
            .shared
            .write()
            .expect("no panic while holding the lock") = self.db.clone();
        Ok(())
    }

    /// Closes and reopens the file: after an I/O error redb answers every call with an error
    /// until then. In-memory state is read back from the file, so whatever the failed commit
    /// did or did not write, the store again agrees with it.
    pub fn reopen(&mut self) -> Result<(), StoreOpenError> {
        *self
            .shared
            .write()
            .expect("no panic while holding the lock") = None;
        self.db = None;
        self.load()
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
        self.next_seq
    }

    /// The dedup window's fingerprints in the file, oldest first.
    pub fn recent_fingerprints(&self) -> Result<Vec<crate::dedup::Fingerprint>, redb::Error> {
        let tx = self.open_db().map_err(|_| closed_error())?.begin_read()?;
        let table = tx.open_table(DEDUP)?;
        let mut out = Vec::with_capacity(self.dedup_total);
        for entry in table.iter()? {
            let (key, value) = entry?;
            let fps = crate::dedup::decode(value.value()).ok_or_else(|| {
                redb::Error::Corrupted(format!("dedup entry {} is unreadable", key.value()))
            })?;
            out.extend(fps);
        }
        Ok(out)
    }

    /// The last delta message applied per gateway ([`crate::applied`]).
    pub fn applied_positions(
        &self,
    ) -> Result<Vec<(String, crate::applied::Position)>, redb::Error> {
        let tx = self.open_db().map_err(|_| closed_error())?.begin_read()?;
        let table = tx.open_table(APPLIED)?;
        let mut out = Vec::new();
        for entry in table.iter()? {
            let (gateway, value) = entry?;
            let at = crate::applied::Position::decode(value.value()).ok_or_else(|| {
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
    fn init_meta(&mut self) -> Result<Result<(), StoreOpenError>, redb::Error> {
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
                Some(v) if v != FORMAT_VERSION.to_string() => {
                    Err(StoreOpenError::UnsupportedFormat {
                        path: self.path.clone(),
                        found: v,
                    })
                }
                Some(_) => {
                    let stored = meta
                        .get("bucket_width_secs")?
                        .and_then(|v| v.value().parse::<i64>().ok())
                        .unwrap_or(-1);
                    if stored == self.settings.bucket_width_secs {
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
        tx.commit()?;
        Ok(checked)
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
        StoreReader {
            db: ReaderDb::Shared(self.shared.clone()),
        }
    }

    /// Names of every stored series.
    pub fn series_names(&self) -> impl Iterator<Item = &Arc<str>> {
        self.series.keys()
    }

    pub fn series_count(&self) -> usize {
        self.series.len()
    }

    /// Size of the database file in bytes.
    pub fn file_bytes(&self) -> u64 {
        std::fs::metadata(&self.path).map_or(0, |m| m.len())
    }

    /// Upsert-and-increment: in one durable write transaction, for every bucket of the batch,
    /// read the stored summary (if any), merge the batch's summary into it, and write it back;
    /// record the batch's message fingerprints under the next commit sequence number. When this
    /// returns `Ok`, the batch is on disk. After an error, [`Store::reopen`] and compare
    /// [`Store::next_seq`] to learn whether it landed.
    pub fn commit(&mut self, batch: &Batch) -> Result<CommitStats, CommitError> {
        let mut stats = CommitStats::default();
        if batch.is_empty() {
            return Ok(stats);
        }
        let seq = self.next_seq;
        let trimmed = self.dedup_trim(batch.fingerprints.len());
        let mut tx = self.open_db()?.begin_write()?;
        // Acknowledgements wait for this commit, so it must be durable; say so explicitly.
        tx.set_durability(redb::Durability::Immediate)?;
        tx.set_two_phase_commit(self.settings.durability == Durability::TwoPhase);
        tx.set_quick_repair(self.settings.quick_repair);
        // Series first seen in this batch; joined to `self.series` only once the commit holds.
        let mut new_series: HashMap<Arc<str>, u64> = HashMap::new();
        {
            let mut by_name = tx.open_table(SERIES_BY_NAME)?;
            let mut by_id = tx.open_table(SERIES_BY_ID)?;
            let mut buckets = tx.open_table(BUCKETS)?;
            let mut pages = tx.open_table(PAGES)?;
            let first_new_id = self.series.len() as u64;
            let mut buf = Vec::with_capacity(512);
            for ((series, start), delta) in &batch.buckets {
                let id = match self.series.get(series).or(new_series.get(series)) {
                    Some(&id) => id,
                    None => {
                        let id = first_new_id + new_series.len() as u64;
                        by_name.insert(&**series, id)?;
                        by_id.insert(id, &**series)?;
                        new_series.insert(series.clone(), id);
                        id
                    }
                };
                let mut merged = match buckets.get((id, *start))? {
                    Some(stored) => {
                        let doc = BucketDoc::decode(stored.value()).map_err(|source| {
                            CommitError::Decode {
                                series_id: id,
                                start: *start,
                                source,
                            }
                        })?;
                        let mut summary = doc.summary();
                        summary.merge(delta);
                        doc.with_summary(&summary)
                    }
                    None => {
                        stats.buckets_created += 1;
                        BucketDoc::new(series, *start, self.settings.bucket_width_secs, delta)
                    }
                };
                if let Some(raw) = batch.raw.get(&(series.clone(), *start)) {
                    let cap = self.settings.page_capacity;
                    merged.pages = append_pages(&mut pages, (id, *start), merged.pages, raw, cap)?;
                }
                buf.clear();
                bson::serialize_to_buffer(&merged, &mut buf)
                    .expect("a BucketDoc has only BSON-representable fields");
                buckets.insert((id, *start), buf.as_slice())?;
                stats.buckets_written += 1;
            }
            let mut dedup = tx.open_table(DEDUP)?;
            dedup.insert(seq, crate::dedup::encode(&batch.fingerprints).as_slice())?;
            for &old in &trimmed {
                dedup.remove(old)?;
            }
            if !batch.applied.is_empty() {
                let mut applied = tx.open_table(APPLIED)?;
                for (gateway, at) in &batch.applied {
                    applied.insert(gateway.as_str(), at.encode().as_slice())?;
                }
            }
        }
        let gate = if self.settings.outbox_max_entries > 0 {
            outbox::record(
                &tx,
                &self.outbox,
                self.settings.outbox_max_entries,
                seq,
                batch,
                self.settings.bucket_width_secs,
            )?
        } else {
            None
        };
        tx.commit()?;
        drop(gate);
        stats.series_created = new_series.len();
        self.series.extend(new_series);
        self.dedup_log.retain(|(s, _)| !trimmed.contains(s));
        self.dedup_log.push_back((seq, batch.fingerprints.len()));
        self.dedup_total = self.dedup_log.iter().map(|e| e.1).sum();
        self.next_seq = seq + 1;
        Ok(stats)
    }

    /// The dedup entries that go when an entry of `adding` fingerprints is added: the oldest
    /// ones whose fingerprints all fall out of the window, and an empty entry, which is only
    /// kept while it is the last (its key gives [`Store::next_seq`]).
    fn dedup_trim(&self, adding: usize) -> Vec<u64> {
        let window = self.settings.dedup_window;
        let mut total = self.dedup_total + adding;
        let mut out = Vec::new();
        for &(seq, n) in &self.dedup_log {
            if total - n < window {
                break;
            }
            total -= n;
            out.push(seq);
        }
        if let Some(&(seq, 0)) = self.dedup_log.back()
            && out.last() != Some(&seq)
        {
            out.push(seq);
        }
        out
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

impl Store {
    /// One bounded retention pass, in one write transaction: deletes raw pages of buckets
    /// starting before `raw_before` and bucket documents (with any pages left) starting before
    /// `buckets_before` (seconds), at most `max` entries. A bucket whose pages go keeps its
    /// summary with `pages = 0`.
    pub fn expire(
        &mut self,
        raw_before: i64,
        buckets_before: i64,
        max: usize,
    ) -> Result<ExpireStats, CommitError> {
        let mut stats = ExpireStats::default();
        let mut tx = self.open_db()?.begin_write()?;
        tx.set_durability(redb::Durability::Immediate)?;
        tx.set_quick_repair(self.settings.quick_repair);
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
                if stats.pages + stats.buckets >= max {
                    stats.more = true;
                    break 'series;
                }
            }
        }
        tx.commit()?;
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
            Ok(true) => continue,
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

impl BucketDoc {
    /// This document with its aggregates replaced by `s` (names, start, pages kept).
    fn with_summary(self, s: &Summary) -> BucketDoc {
        BucketDoc {
            pages: self.pages,
            ..BucketDoc::new(&self.series, self.start, self.end - self.start, s)
        }
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
        log.push_back((
            key.value(),
            value.value().len() / crate::dedup::FINGERPRINT_BYTES,
        ));
    }
    let next = log.back().map_or(0, |&(seq, _)| seq + 1);
    Ok((next, log))
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

/// The id of `series`, or of every series when `None` (in id order).
fn series_ids(tx: &redb::ReadTransaction, series: Option<&str>) -> Result<Vec<u64>, redb::Error> {
    match series {
        Some(name) => {
            let by_name = tx.open_table(SERIES_BY_NAME)?;
            Ok(by_name
                .get(name)?
                .map(|id| id.value())
                .into_iter()
                .collect())
        }
        None => {
            let by_id = tx.open_table(SERIES_BY_ID)?;
            let mut ids = Vec::new();
            for entry in by_id.iter()? {
                ids.push(entry?.0.value());
            }
            Ok(ids)
        }
    }
}

/// Read access: to a file no daemon holds (`bucketd export`), or to the daemon's own open
/// database (the HTTP API). Cheap to clone.
#[derive(Clone)]
pub struct StoreReader {
    db: ReaderDb,
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

impl StoreReader {
    /// Opens the file read-only. Fails with [`StoreOpenError::Locked`] while a daemon holds it.
    pub fn open(path: &Path) -> Result<StoreReader, StoreOpenError> {
        if !path.exists() {
            return Err(StoreOpenError::Missing {
                path: path.to_owned(),
            });
        }
        let db = redb::Builder::new()
            .open_read_only(path)
            .map_err(|e| open_error(path, e))?;
        Ok(StoreReader {
            db: ReaderDb::ReadOnly(Arc::new(db)),
        })
    }

    /// Up to `max` outbox entries with a sequence number above `after` (all with `None`),
    /// oldest first. The forwarder reads through [`OutboxShared::read_for_shipping`].
    pub fn outbox(&self, after: Option<u64>, max: usize) -> Result<Vec<OutboxDoc>, redb::Error> {
        outbox::read(&self.db.begin_read()?, after, max)
    }

    /// Every series name, sorted.
    pub fn series(&self) -> Result<Vec<String>, redb::Error> {
        let tx = self.db.begin_read()?;
        let table = tx.open_table(SERIES_BY_NAME)?;
        let mut names = Vec::new();
        for entry in table.iter()? {
            names.push(entry?.0.value().to_owned());
        }
        Ok(names)
    }

    /// Whether `series` is stored.
    pub fn has_series(&self, series: &str) -> Result<bool, redb::Error> {
        let tx = self.db.begin_read()?;
        let table = tx.open_table(SERIES_BY_NAME)?;
        Ok(table.get(series)?.is_some())
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
    /// timestamps in arrival order). `visit` returns `false` to stop early.
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
        let tx = self.db.begin_read()?;
        let by_id = tx.open_table(SERIES_BY_ID)?;
        let pages = tx.open_table(PAGES)?;
        let ids = series_ids(&tx, series)?;
        let first_start = from.div_euclid(1_000_000_000).div_euclid(width) * width;
        let end_start = to.div_euclid(1_000_000_000) + 1; // buckets starting before `to`
        for id in ids {
            let name = by_id
                .get(id)?
                .map(|n| n.value().to_owned())
                .ok_or_else(|| redb::Error::Corrupted(format!("series id {id} has no name")))?;
            let mut bucket: Option<i64> = None;
            let mut readings: Vec<(i64, f64)> = Vec::new();
            let mut flush = |readings: &mut Vec<(i64, f64)>| {
                readings.sort_by_key(|r| r.0); // stable: equal timestamps keep arrival order
                let keep = !readings.is_empty() && !visit(&name, readings);
                readings.clear();
                keep
            };
            for entry in pages.range((id, first_start, 0)..(id, end_start, 0))? {
                let (key, value) = entry?;
                let (_, start, page_no) = key.value();
                if bucket != Some(start) {
                    if flush(&mut readings) {
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
                readings.extend(
                    decoded
                        .into_iter()
                        .filter(|(ts, _)| (from..to).contains(ts)),
                );
            }
            if flush(&mut readings) {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Buckets of `series` (all series when `None`) with `from <= start < to` (seconds), in
    /// series-id then time order.
    pub fn buckets(
        &self,
        series: Option<&str>,
        from: i64,
        to: i64,
    ) -> Result<Vec<BucketDoc>, redb::Error> {
        let tx = self.db.begin_read()?;
        let buckets = tx.open_table(BUCKETS)?;
        let ids = series_ids(&tx, series)?;
        let mut out = Vec::new();
        if from >= to {
            return Ok(out);
        }
        for id in ids {
            for entry in buckets.range((id, from)..(id, to))? {
                let (key, value) = entry?;
                let doc = BucketDoc::decode(value.value()).map_err(|e| {
                    redb::Error::Corrupted(format!(
                        "bucket document {:?} is unreadable: {e}",
                        key.value()
                    ))
                })?;
                out.push(doc);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
