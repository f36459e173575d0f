//! The fault seam: write faults injected under redb and the journal ([`Faults`]), for tests of
//! what bucketd does when the disk fails. Compiled only for tests (`feature = "fault-injection"`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

/// Write faults injected under redb and the journal (one disk), for tests of what bucketd does
/// when the disk fails: while `fail_writes` is set every write, resize and sync of either file
/// fails with "No space left on device", as a full SD card does; `sync_delay` slows every fsync,
/// as a worn one does. Reads are untouched.
#[derive(Debug, Default)]
pub struct Faults {
    pub fail_writes: std::sync::atomic::AtomicBool,
    /// Like `fail_writes`, for the database file only: the journal goes on (commits succeed,
    /// checkpoints fail).
    pub fail_db_writes: std::sync::atomic::AtomicBool,
    pub sync_delay_micros: std::sync::atomic::AtomicU64,
    /// Failed writes, resizes and syncs so far.
    pub failed: std::sync::atomic::AtomicU64,
    /// The process is killed ([`Faults::kill`]): nothing it writes from now on reaches the
    /// files, not even what its destructors would write; the caches stay.
    killed: std::sync::atomic::AtomicBool,
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
    /// All of them but the last; then every 4 KiB page the last one touched is, each by a draw
    /// from `seed`, as it was before that write (reverted), as the write left it, or torn as
    /// flash without power-loss protection can leave it: in the journal the whole page garbled,
    /// including the bytes of it the write did not change (an earlier record's tail, say), and
    /// with a program unit set ([`Faults::set_program_unit`]) each other page of the units
    /// the write touched garbled by a draw too (one in three), however long ago it was synced;
    /// in the database file a mix of old and new 512-byte sectors (redb, like SQLite, counts on
    /// a write not damaging bytes outside its range).
    Pages { seed: u64 },
}

/// What of the writes of a sync that fails with EIO reached the disk all the same: the kernel
/// writes pages back in its own order before the sync, and one that failed says nothing of the
/// others.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Landed {
    /// None of them: all are ghosts.
    #[default]
    Nothing,
    /// Those to the file's first page (redb's header, pointing at the new tree), not the others:
    /// a data page lost behind a landed header.
    FirstPage,
    /// All of them: the error came after the data was on the disk.
    All,
    /// All of them, in the device's volatile write cache only: read back from the device (a
    /// dropped page cache does not lose them) until the power fails, when they are gone; a later
    /// sync of the same file that succeeds (a cache flush) puts them on the medium.
    Volatile,
}

/// Tests of a failed fsync: the durability settings (commit mode, quick repair) and which of a
/// commit's fsyncs fails (0: its first, 1: the one after redb wrote its header), each of a
/// one- and a two-phase commit, with and without quick repair.
#[cfg(test)]
pub(crate) const FAILING_SYNCS: [(crate::config::Durability, u32, bool); 7] = {
    use crate::config::Durability::{Immediate, TwoPhase};
    [
        (Immediate, 0, true),
        (Immediate, 1, true),
        (TwoPhase, 0, true),
        (TwoPhase, 1, true),
        // Without quick repair, a one-phase commit syncs once.
        (Immediate, 0, false),
        (TwoPhase, 0, false),
        (TwoPhase, 1, false),
    ]
};

/// The unit a card programs at once.
pub const PAGE_BYTES: u64 = 4096;
const SECTOR_BYTES: usize = 512;

/// The simulated power supply of the disk holding both files: once armed, writes stay in a
/// "page cache" (seen by reads) until a sync of their file puts them on it; the `ops`-th write
/// or sync from arming (of either file) fails, and what reaches the files of the unsynced
/// writes, in the order they were made, is decided by [`Cut`]. From then on every write, resize
/// and sync fails: the process is gone as far as the files are concerned.
#[derive(Debug, Default)]
struct Power {
    armed: Option<(u64, Cut)>,
    cache: Vec<(Target, u64, Vec<u8>)>,
    /// Writes whose sync failed: still read back (the page cache keeps them, marked clean, as
    /// Linux does after a failed fsync) but never written by a later sync; gone at a power cut.
    /// With `true`, in the device's volatile cache instead ([`Landed::Volatile`]): not dropped
    /// with the page cache, and written by the next sync of their file that succeeds.
    ghosts: Vec<(Target, u64, Vec<u8>, bool)>,
    /// A sync fails with EIO, and its writes become ghosts: the one after this many more.
    fail_sync_after: Option<u32>,
    /// What of a failing sync's writes reached the disk anyway (the kernel wrote some back
    /// before the error).
    failed_sync_landed: Landed,
    off: bool,
    /// The journal's program unit (0: a page): a [`Cut::Pages`] may also garble the other pages
    /// of each unit the torn write touched, synced earlier or not ([`Faults::set_program_unit`]).
    unit: u64,
    /// Handles on the two files, for writing what a cut leaves.
    files: [Option<Arc<File>>; 2],
}

/// Which file a write is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Db = 0,
    Journal = 1,
}

impl Power {
    /// Counts one write or sync against an armed power cut; at the cut, puts on the files what
    /// [`Cut`] says of the unsynced writes, and fails this and every later operation.
    fn tick(&mut self) -> std::io::Result<()> {
        if self.off {
            return Err(power_off());
        }
        let Some((ops, cut)) = self.armed.as_mut() else {
            return Ok(());
        };
        *ops -= 1;
        if *ops > 0 {
            return Ok(());
        }
        let cache = std::mem::take(&mut self.cache);
        self.ghosts.clear();
        let cut = *cut;
        let (keep, torn, pages) = match cut {
            Cut::Nothing => (0, None, None),
            Cut::Prefix(n) => (n, None, None),
            Cut::Torn { n, bytes } => (n, Some(bytes), None),
            Cut::Pages { seed } => (cache.len().saturating_sub(1), None, Some(seed)),
        };
        for (target, at, data) in cache.iter().take(keep) {
            self.write_through(*target, *at, data)?;
        }
        if let (Some(bytes), Some((target, at, data))) = (torn, cache.get(keep)) {
            self.write_through(*target, *at, &data[..bytes.min(data.len())])?;
        }
        if let (Some(seed), Some((target, at, data))) = (pages, cache.get(keep)) {
            self.tear_pages(*target, *at, data, seed)?;
        }
        self.off = true;
        Err(power_off())
    }

    /// What [`Cut::Pages`] leaves of a write of `data` at `at` to `target`.
    fn tear_pages(&self, target: Target, at: u64, data: &[u8], seed: u64) -> std::io::Result<()> {
        let file = self.files[target as usize]
            .as_ref()
            .ok_or_else(|| std::io::Error::other("no handle on the file"))?;
        let mut rng = seed | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let end = at + data.len() as u64;
        // In the journal, the program units the write touched; elsewhere its pages.
        let unit = match target {
            Target::Journal => self.unit.max(PAGE_BYTES),
            Target::Db => PAGE_BYTES,
        };
        let (first, last) = (at / unit * unit, end.div_ceil(unit) * unit);
        // Pages past the file's end are not there to garble (the write would have grown it).
        let len = file.metadata()?.len();
        let limit = len.max(end);
        let mut page_at = first;
        while page_at < last {
            if page_at + PAGE_BYTES <= at || page_at >= end {
                // A page of the unit the write did not touch: garbled one time in three.
                if page_at < len && next() % 3 == 0 {
                    let garbled: Vec<u8> = (0..PAGE_BYTES).map(|_| (next() >> 24) as u8).collect();
                    let n = (len - page_at).min(PAGE_BYTES) as usize;
                    file.write_all_at(&garbled[..n], page_at)?;
                }
                page_at += PAGE_BYTES;
                continue;
            }
            let mut old = vec![0u8; PAGE_BYTES as usize];
            // Past the end of the file reads short: the rest stays zero.
            let _ = file.read_at(&mut old, page_at);
            let mut new = old.clone();
            let (from, to) = (at.max(page_at), end.min(page_at + PAGE_BYTES));
            new[(from - page_at) as usize..(to - page_at) as usize]
                .copy_from_slice(&data[(from - at) as usize..(to - at) as usize]);
            let left = match next() % 3 {
                0 => old,
                1 => new,
                _ if target == Target::Journal => {
                    (0..PAGE_BYTES).map(|_| (next() >> 24) as u8).collect()
                }
                _ => old
                    .chunks(SECTOR_BYTES)
                    .zip(new.chunks(SECTOR_BYTES))
                    .flat_map(|(o, n)| if next() % 2 == 0 { o } else { n })
                    .copied()
                    .collect(),
            };
            let n = (limit - page_at).min(PAGE_BYTES) as usize;
            file.write_all_at(&left[..n], page_at)?;
            page_at += PAGE_BYTES;
        }
        Ok(())
    }

    fn write_through(&self, target: Target, at: u64, data: &[u8]) -> std::io::Result<()> {
        self.files[target as usize]
            .as_ref()
            .ok_or_else(|| std::io::Error::other("no handle on the file"))?
            .write_all_at(data, at)
    }

    /// A sync of `target`: what the device holds of it in its volatile cache, then its cached
    /// writes, go to the file.
    fn flush(&mut self, target: Target) -> std::io::Result<()> {
        let ghosts = std::mem::take(&mut self.ghosts);
        let (device, rest): (Vec<_>, Vec<_>) =
            ghosts.into_iter().partition(|g| g.0 == target && g.3);
        self.ghosts = rest;
        for (_, at, data, _) in device {
            self.write_through(target, at, &data)?;
        }
        let cache = std::mem::take(&mut self.cache);
        let (mine, others): (Vec<_>, Vec<_>) = cache.into_iter().partition(|e| e.0 == target);
        self.cache = others;
        for (_, at, data) in mine {
            self.write_through(target, at, &data)?;
        }
        Ok(())
    }

    /// Unsynced writes of `target` over `out`, read from `offset`, in the order they were made.
    fn overlay(&self, target: Target, offset: u64, out: &mut [u8]) {
        let end = offset + out.len() as u64;
        let ghosts = self.ghosts.iter().map(|(t, at, d, _)| (t, at, d));
        for (t, at, data) in ghosts.chain(self.cache.iter().map(|(t, at, d)| (t, at, d))) {
            if *t != target {
                continue;
            }
            let (from, to) = (offset.max(*at), end.min(*at + data.len() as u64));
            if from < to {
                let (o, d) = ((from - offset) as usize, (from - at) as usize);
                let n = (to - from) as usize;
                out[o..o + n].copy_from_slice(&data[d..d + n]);
            }
        }
    }

    /// Where the cached writes (and ghosts) of `target` end: the file's length in the cache.
    fn cached_end(&self, target: Target) -> u64 {
        let ghosts = self.ghosts.iter().map(|(t, at, d, _)| (t, at, d));
        ghosts
            .chain(self.cache.iter().map(|(t, at, d)| (t, at, d)))
            .filter(|(t, _, _)| **t == target)
            .map(|(_, at, data)| at + data.len() as u64)
            .max()
            .unwrap_or(0)
    }

    /// Cached writes (and ghosts) of `target` past `len` dropped, those across it cut short.
    fn truncate(&mut self, target: Target, len: u64) {
        let keep = |t: Target, at: u64, data: &mut Vec<u8>| {
            if t != target || at + data.len() as u64 <= len {
                return true;
            }
            data.truncate(usize::try_from(len.saturating_sub(at)).unwrap_or(0));
            !data.is_empty()
        };
        self.cache.retain_mut(|(t, at, data)| keep(*t, *at, data));
        self.ghosts
            .retain_mut(|(t, at, data, _)| keep(*t, *at, data));
    }

    /// A write of `target`: cached while a cut is armed (and counted), else written.
    fn write(&mut self, target: Target, offset: u64, data: &[u8]) -> std::io::Result<bool> {
        if self.armed.is_some() {
            self.tick()?;
            self.cache.push((target, offset, data.to_vec()));
            return Ok(true);
        }
        Ok(false)
    }

    /// A sync of `target`: counted while a cut is armed, and its cached writes go to the file.
    fn sync(&mut self, target: Target) -> std::io::Result<()> {
        if self.armed.is_some() {
            self.tick()?;
            let fails = match &mut self.fail_sync_after {
                Some(0) => {
                    self.fail_sync_after = None;
                    true
                }
                Some(n) => {
                    *n -= 1;
                    false
                }
                None => false,
            };
            if fails {
                let cache = std::mem::take(&mut self.cache);
                let (mine, others): (Vec<_>, Vec<_>) =
                    cache.into_iter().partition(|e| e.0 == target);
                self.cache = others;
                let volatile = self.failed_sync_landed == Landed::Volatile;
                for (t, at, data) in mine {
                    let landed = match self.failed_sync_landed {
                        Landed::Nothing | Landed::Volatile => false,
                        Landed::FirstPage => at < PAGE_BYTES,
                        Landed::All => true,
                    };
                    if landed {
                        self.write_through(t, at, &data)?;
                    }
                    // Read back from the cache either way, until it is dropped (from the
                    // device's, until the power fails or a flush writes it).
                    self.ghosts.push((t, at, data, volatile));
                }
                return Err(std::io::Error::from_raw_os_error(5)); // EIO
            }
            self.flush(target)?;
        }
        Ok(())
    }
}

impl Faults {
    /// Arms a power cut at the `ops`-th write or sync from now (1: the next one).
    pub fn arm_power_cut(&self, ops: u64, cut: Cut) {
        let mut power = self.power.lock().expect("not poisoned");
        power.armed = Some((ops.max(1), cut));
        power.cache.clear();
        power.ghosts.clear();
        power.off = false;
    }

    /// The sync after `skip` more (with a power cut armed, so that writes wait in the page
    /// cache) fails with EIO; its writes stay readable but never reach the disk (see
    /// `Power::ghosts`).
    pub fn fail_sync_after(&self, skip: u32) {
        self.fail_sync_landing(skip, Landed::Nothing);
    }

    /// [`Faults::fail_sync_after`], with `landed` of the failing sync's writes on the disk.
    pub fn fail_sync_landing(&self, skip: u32, landed: Landed) {
        let mut power = self.power.lock().expect("not poisoned");
        power.fail_sync_after = Some(skip);
        power.failed_sync_landed = landed;
    }

    /// Moves an armed power cut to the `ops`-th write or sync from now, with `cut`, keeping
    /// what waits in the simulated page cache ([`Faults::arm_power_cut`] starts afresh).
    pub fn rearm_power_cut(&self, ops: u64, cut: Cut) {
        let mut power = self.power.lock().expect("not poisoned");
        if power.armed.is_some() {
            power.armed = Some((ops.max(1), cut));
        }
    }

    /// Brings an armed power cut forward to the next write or sync (of whichever thread makes
    /// it): what the writes since the last sync leave is still decided by its [`Cut`].
    pub fn hasten_power_cut(&self) {
        let mut power = self.power.lock().expect("not poisoned");
        if let Some((ops, _)) = power.armed.as_mut() {
            *ops = 1;
        }
    }

    /// What dropping the kernel's cached pages does (`posix_fadvise(DONTNEED)`): the writes
    /// whose sync failed are no longer read back, of the database file and, with `journal`, of
    /// the journal too. Writes not synced yet stay (the kernel writes dirty pages first).
    pub fn drop_cached_pages(&self, journal: bool) {
        let mut power = self.power.lock().expect("not poisoned");
        // Those in the device's cache stay: they come from the device.
        power
            .ghosts
            .retain(|(t, _, _, on_device)| *on_device || (*t == Target::Journal && !journal));
    }

    /// The journal's program unit: a [`Cut::Pages`] may garble every page of the units its torn
    /// write touched (a card programs a unit at once, and can damage pages of it it was not
    /// asked to write). A page by default.
    pub fn set_program_unit(&self, bytes: u64) {
        self.power.lock().expect("not poisoned").unit = bytes;
    }

    /// A kill -9 of the process: from now until [`Faults::restart`] nothing it writes, resizes or
    /// syncs reaches either file (dropping its `Store` then runs no write the real process would
    /// not have made). What the page cache holds, ghosts of failed syncs included, stays, as the
    /// kernel's outlives a process.
    pub fn kill(&self) {
        self.killed
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// A new process starts on the same disk and page cache (after [`Faults::kill`]).
    pub fn restart(&self) {
        self.killed
            .store(false, std::sync::atomic::Ordering::Relaxed);
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

impl Faults {
    fn check(&self) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.killed.load(Relaxed) {
            return Err(std::io::Error::other(
                "simulated kill -9: the process is gone",
            ));
        }
        if self.fail_writes.load(Relaxed) {
            self.failed.fetch_add(1, Relaxed);
            return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
        }
        Ok(())
    }

    /// [`Faults::check`], and for the database file `fail_db_writes`.
    fn check_for(&self, target: Target) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        if target == Target::Db && self.fail_db_writes.load(Relaxed) {
            self.failed.fetch_add(1, Relaxed);
            return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
        }
        self.check()
    }

    /// A sync of `target`: the full-disk fault, the slow-sync delay, then the power supply.
    fn sync(&self, target: Target) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        self.check_for(target)?;
        let delay = self.sync_delay_micros.load(Relaxed);
        if delay > 0 {
            std::thread::sleep(std::time::Duration::from_micros(delay));
        }
        self.power.lock().expect("not poisoned").sync(target)
    }

    /// A write of `target`: the full-disk fault, then the power supply. `true` when the write
    /// stays in the simulated page cache (the caller must not write it).
    fn write(&self, target: Target, offset: u64, data: &[u8]) -> std::io::Result<bool> {
        self.check_for(target)?;
        self.power
            .lock()
            .expect("not poisoned")
            .write(target, offset, data)
    }

    fn register(&self, target: Target, file: File) {
        self.power.lock().expect("not poisoned").files[target as usize] = Some(Arc::new(file));
    }
}

impl redb::StorageBackend for FaultyBackend {
    fn len(&self) -> std::io::Result<u64> {
        // A write past the end makes the file longer at once, in the page cache.
        let power = self.faults.power.lock().expect("not poisoned");
        Ok(self.inner.len()?.max(power.cached_end(Target::Db)))
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        // Under the lock, the file and the overlay together: a sync between the two (another
        // thread's) would take its writes out of the overlay after the file was read without
        // them, and a reader would see the page as it was before.
        let power = self.faults.power.lock().expect("not poisoned");
        // After the cut the process is gone: nothing it could read would be the file's (its
        // own writes, in the page cache, went with the power).
        if power.off {
            return Err(power_off());
        }
        // Past the file's end on the disk (grown by cached writes): zeros under the overlay.
        let on_disk = self.inner.len()?;
        let end = offset + out.len() as u64;
        if end > on_disk {
            if end > on_disk.max(power.cached_end(Target::Db)) {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
            }
            let split = usize::try_from(on_disk.saturating_sub(offset)).unwrap_or(0);
            let (below, past) = out.split_at_mut(split.min(out.len()));
            if !below.is_empty() {
                self.inner.read(offset, below)?;
            }
            past.fill(0);
        } else {
            self.inner.read(offset, out)?;
        }
        // The page cache: unsynced writes overlay the file, in the order they were made.
        power.overlay(Target::Db, offset, out);
        Ok(())
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.faults.check_for(Target::Db)?;
        let mut power = self.faults.power.lock().expect("not poisoned");
        if power.off {
            return Err(power_off());
        }
        // A truncation drops the cached pages past the new end, as the kernel does: they must
        // not come back as the file grows again (read, or written by a later sync).
        power.truncate(Target::Db, len);
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.faults.sync(Target::Db)?;
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        if self.faults.write(Target::Db, offset, data)? {
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
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
    };
    let io = |e| redb::DatabaseError::Storage(redb::StorageError::Io(e));
    faults.register(Target::Db, open().map_err(io)?);
    open()
        .map_err(io)
        .and_then(redb::backends::FileBackend::new)
        .and_then(|inner| builder.create_with_backend(FaultyBackend { inner, faults }))
}

/// The journal file under the same faults (and power supply) as the database file.
struct FaultyJournal {
    inner: File,
    faults: Arc<Faults>,
}

impl super::journal::JournalFile for FaultyJournal {
    fn read_at(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        // Under the lock, as for the database file; nothing after the cut.
        let power = self.faults.power.lock().expect("not poisoned");
        if power.off {
            return Err(power_off());
        }
        self.inner.read_exact_at(out, offset)?;
        power.overlay(Target::Journal, offset, out);
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        if self.faults.write(Target::Journal, offset, data)? {
            return Ok(());
        }
        self.inner.write_all_at(data, offset)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.faults.sync(Target::Journal)?;
        self.inner.sync_data()
    }
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.inner.metadata()?.len())
    }
}

/// Opens the journal at `path` under `faults`.
pub(super) fn open_journal(
    path: &Path,
    faults: Arc<Faults>,
) -> std::io::Result<Box<dyn super::journal::JournalFile>> {
    faults.register(Target::Journal, super::journal::open_file(path)?);
    Ok(Box::new(FaultyJournal {
        inner: super::journal::open_file(path)?,
        faults,
    }))
}
