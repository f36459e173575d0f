//! The fault seam: write faults injected under redb ([`Faults`]), for tests of what bucketd does
//! when the disk fails. Compiled only for tests (`feature = "fault-injection"`).

use std::path::Path;
use std::sync::Arc;

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

/// Creates (or opens) the database at `path` over a [`FaultyBackend`].
pub(super) fn create(
    builder: &redb::Builder,
    path: &Path,
    faults: Arc<Faults>,
) -> Result<redb::Database, redb::DatabaseError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| redb::DatabaseError::Storage(redb::StorageError::Io(e)))
        .and_then(redb::backends::FileBackend::new)
        .and_then(|inner| builder.create_with_backend(FaultyBackend { inner, faults }))
}
