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
    /// A power supply that can fail ([`Faults::arm_power_cut`]).
    power: std::sync::Mutex<Power>,
}

/// What reaches the disk of the writes since the last sync when the power fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// None of them (the page cache is lost).
    Nothing,
    /// The first `n` of them, in order.
    Prefix(usize),
    /// The first `n`, and the first `bytes` of the next one (a torn page).
    Torn { n: usize, bytes: usize },
}

/// The simulated power supply: once armed, writes stay in a "page cache" (seen by reads) until
/// a sync puts them on the file; the `ops`-th write or sync from arming fails, and what reaches
/// the file of the unsynced writes is decided by [`Cut`]. From then on every write, resize and
/// sync fails: the process is gone as far as the file is concerned.
#[derive(Debug, Default)]
struct Power {
    armed: Option<(u64, Cut)>,
    cache: Vec<(u64, Vec<u8>)>,
    off: bool,
}

impl Faults {
    /// Arms a power cut at the `ops`-th write or sync from now (1: the next one).
    pub fn arm_power_cut(&self, ops: u64, cut: Cut) {
        let mut power = self.power.lock().expect("not poisoned");
        *power = Power {
            armed: Some((ops.max(1), cut)),
            ..Power::default()
        };
    }

    /// Whether the armed power cut has happened.
    pub fn power_is_off(&self) -> bool {
        self.power.lock().expect("not poisoned").off
    }
}

fn power_off() -> std::io::Error {
    std::io::Error::other("simulated power cut")
}

#[derive(Debug)]
struct FaultyBackend {
    inner: redb::backends::FileBackend,
    faults: Arc<Faults>,
}

impl FaultyBackend {
    /// Counts one write or sync against an armed power cut; at the cut, puts on the file what
    /// [`Cut`] says of the unsynced writes, and fails this and every later operation.
    fn tick(&self, power: &mut Power) -> std::io::Result<()> {
        if power.off {
            return Err(power_off());
        }
        let Some((ops, cut)) = power.armed.as_mut() else {
            return Ok(());
        };
        *ops -= 1;
        if *ops > 0 {
            return Ok(());
        }
        let cache = std::mem::take(&mut power.cache);
        let (keep, torn) = match *cut {
            Cut::Nothing => (0, None),
            Cut::Prefix(n) => (n, None),
            Cut::Torn { n, bytes } => (n, Some(bytes)),
        };
        for (at, data) in cache.iter().take(keep) {
            redb::StorageBackend::write(&self.inner, *at, data)?;
        }
        if let (Some(bytes), Some((at, data))) = (torn, cache.get(keep)) {
            redb::StorageBackend::write(&self.inner, *at, &data[..bytes.min(data.len())])?;
        }
        power.off = true;
        Err(power_off())
    }

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
        self.inner.read(offset, out)?;
        // The page cache: unsynced writes overlay the file, in the order they were made.
        let power = self.faults.power.lock().expect("not poisoned");
        let end = offset + out.len() as u64;
        for (at, data) in &power.cache {
            let (from, to) = (offset.max(*at), end.min(*at + data.len() as u64));
            if from < to {
                let (o, d) = ((from - offset) as usize, (from - at) as usize);
                let n = (to - from) as usize;
                out[o..o + n].copy_from_slice(&data[d..d + n]);
            }
        }
        Ok(())
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.check()?;
        if self.faults.power.lock().expect("not poisoned").off {
            return Err(power_off());
        }
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        self.check()?;
        let delay = self.faults.sync_delay_micros.load(Relaxed);
        if delay > 0 {
            std::thread::sleep(std::time::Duration::from_micros(delay));
        }
        let mut power = self.faults.power.lock().expect("not poisoned");
        if power.armed.is_some() {
            self.tick(&mut power)?;
            for (at, data) in std::mem::take(&mut power.cache) {
                self.inner.write(at, &data)?;
            }
        }
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.check()?;
        let mut power = self.faults.power.lock().expect("not poisoned");
        if power.armed.is_some() {
            self.tick(&mut power)?;
            power.cache.push((offset, data.to_vec()));
            return Ok(());
        }
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
