//! The journal: the acknowledgement point of a commit. A preallocated file beside the database
//! (`<path>.journal`) to which each commit appends one record, a *redo* of everything the commit
//! writes to redb, with one write and one `fdatasync`; the commit is then held in memory
//! (`store::pending`) until a checkpoint folds it into redb durably, after which its record is
//! no longer live ([`Journal::release_below`]). Records go round the file: each goes after the
//! last, or at the first record's place when it does not fit before the end, never over a live
//! one. At open, the records the database file lacks are applied again ([`Journal::replay`]).
//!
//! Why: a durable redb commit writes the copy-on-write pages of every table it touched, the
//! allocator state (quick repair) and the header, with two `fdatasync`s, ~0.45 ms and ~2.8 KB
//! per reading at one commit per 20 messages; a journal record is the commit's bytes once, into
//! blocks that already exist (no file-size change, so no journal commit of the filesystem's).
//!
//! File: a header (magic, format version, the database's `journal_id`, a checksum) alone in the
//! first 16 KiB, then records, each starting on a 16 KiB unit boundary: payload length (u32
//! LE), commit sequence number (u64 LE), an xxh3-64 checksum (u64 LE) of those twelve bytes,
//! the payload and the journal id, then the payload ([`Redo`]), zeros to the end of its last
//! 4 KiB page; the rest of its last unit is not written. The file keeps its size; new records
//! overwrite old ones in place.
//!
//! Why units: an SD card programs whole pages, 4 KiB or more at once (8 and 16 KiB program
//! units are common), and one without power-loss protection can leave the unit it was
//! programming garbled or as it was before, pages of it the write did not touch included,
//! however long ago they were synced. With records packed back to back (format 1), each append
//! rewrote the page holding the tail of the acknowledged record before it; with records on
//! 4 KiB pages (format 2) it shared the unit with it. Either way a power cut could take the
//! last acknowledged record away, and the replay could not tell it from a torn one. Now no
//! write touches a unit that holds an acknowledged record: a cut can only cost the record
//! being written, which was never acknowledged. The cost: at least a unit of the journal per
//! commit (the journal holds `journal_size / 16 KiB` commits not yet folded); not bytes
//! written, since only the record's pages are. Formats 1 and 2 (an unclean stop of an older
//! release) are still read, then made anew as format 3.
//!
//! Which records are live: the checksum must hold, and the records that apply are the run whose
//! sequence numbers continue the database's (`next_seq`, `next_seq + 1`, ...): the replay finds
//! the record of `next_seq` wherever it is (a quick look at each page's header, the checksum
//! read only for a candidate), then follows the run, each next record right after the one
//! before or at the first record's place. Records from before have smaller numbers (a record
//! is overwritten only once the database holds it durably) and are skipped; the first record
//! that is torn, blank or out of sequence ends the run. A record that a power cut tore was never acknowledged: acknowledgements wait for its
//! `fdatasync`. The journal assumes less of the disk than redb and SQLite do (that a write does
//! not damage bytes outside the range written): only that a write damages no 16 KiB unit it does
//! not touch, and it touches no unit that holds an acknowledged record.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use crate::sketch::{get_varint, put_varint};

/// Bytes of the header of formats 1 and 2; records start here.
pub const HEADER_BYTES: u64 = 4096;
/// Bytes before each record's payload: length, sequence number, checksum.
pub const RECORD_HEADER_BYTES: usize = 20;
/// A record is written to the end of its last page of this size: the least a card writes.
pub const PAGE_BYTES: u64 = 4096;
/// Records start on multiples of this (format 3), and the header has a unit to itself: the
/// program unit assumed of a card, the most a cut can damage around a page it was writing.
pub const UNIT_BYTES: u64 = 16 * 1024;
#[cfg(test)]
use crate::limits::MIN_JOURNAL_BYTES;
const MAGIC: &[u8; 16] = b"bucketd journal\0";
/// Records on program-unit boundaries. Format 2 put them on page boundaries, format 1 packed
/// them back to back; both are read, then made anew.
const FORMAT: u32 = 3;
const FORMAT_PAGES: u32 = 2;
const FORMAT_PACKED: u32 = 1;
const REDO_V1: u8 = 1;

/// The journal file's path for the database at `db`: `<db>.journal`.
pub fn path_for(db: &Path) -> PathBuf {
    let mut p = db.as_os_str().to_owned();
    p.push(".journal");
    PathBuf::from(p)
}

/// Where a journal that is made anew (another size, an older format, none wanted) is kept:
/// `<journal>.old`, replacing any earlier one.
pub fn replaced_path(journal: &Path) -> PathBuf {
    let mut p = journal.as_os_str().to_owned();
    p.push(".old");
    PathBuf::from(p)
}

/// I/O on the journal file: a plain file, or one under the test fault seam (`store::faults`).
pub(super) trait JournalFile: Send + Sync {
    fn read_at(&self, offset: u64, out: &mut [u8]) -> io::Result<()>;
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()>;
    fn sync(&self) -> io::Result<()>;
    fn len(&self) -> io::Result<u64>;
}

/// Opens an existing journal file for reading and writing, with readahead off: the replay at
/// open reads record by record, and readahead would bring the file into the page cache in large
/// folios, which Linux then counts whole as written (in `/proc/<pid>/io`, so in
/// `bucketd_disk_written_bytes_total`) each time a commit dirties a few bytes of one (the disk
/// writes only the changed blocks either way).
pub(super) fn open_file(path: &Path) -> io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random)?;
    Ok(file)
}

impl JournalFile for File {
    fn read_at(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, out, offset)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, data, offset)
    }
    fn sync(&self) -> io::Result<()> {
        self.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
}

/// Why the journal cannot be used. Each message names the file and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("journal {path}: {source}; {}", io_advice(.source))]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "no room to make the journal {path} ({bytes} bytes, `store.journal_size`){}: free that \
         much space on its disk, or set `store.journal_size` smaller (or 0 for none); the \
         database file holds every acknowledged commit, nothing is lost",
        .old_removed.as_ref().map(|p| format!(
            " even after removing {}, which an earlier start set aside (its commits are in the \
             database file)", p.display()
        )).unwrap_or_default()
    )]
    NoRoom {
        path: PathBuf,
        bytes: u64,
        old_removed: Option<PathBuf>,
    },
    #[error(
        "journal {path} belongs to another database file (journal id {found:016x}, the database's \
         {expected:016x}); if the database file was replaced or restored, move the journal aside \
         and start again"
    )]
    Foreign {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    #[error(
        "journal {path} is damaged: its header is not a bucketd journal's (it is written only \
         when the journal is made, so the disk changed it). It may still hold acknowledged \
         commits the database lacks: keep a copy of it, then move it aside and start again; \
         commits it held after the database's last checkpoint are then not applied"
    )]
    BadHeader { path: PathBuf },
    #[error(
        "journal {path} starts at commit {found} but the database file ends at commit {expected}: \
         commits in between are missing (was an older database file restored beside a newer \
         journal?); move the journal aside to start from the database file as it is"
    )]
    Gap {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    #[error(
        "journal {path} is damaged: the record of commit {missing} is unreadable, but the record \
         of commit {found} after it is whole, so going on would lose acknowledged commits. Keep a \
         copy of the journal and the database file. To start from the database file and the \
         commits before {missing} (and let `bucketd export` read it), move the journal aside"
    )]
    Broken {
        path: PathBuf,
        missing: u64,
        found: u64,
    },
    #[error("journal {path}: record of commit {seq} is unreadable although its checksum holds")]
    Record { path: PathBuf, seq: u64 },
}

/// What an operator can do about an I/O error on the journal.
fn io_advice(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::StorageFull => {
            "the disk is full: free space on it, or make store.journal_size smaller (the journal \
             is made at its full size at the first start); the journal keeps every acknowledged \
             commit, do not move it aside"
        }
        io::ErrorKind::PermissionDenied
        | io::ErrorKind::NotFound
        | io::ErrorKind::ReadOnlyFilesystem => {
            "check that the directory exists and is writable by this user"
        }
        io::ErrorKind::Interrupted => "nothing was lost",
        _ => {
            "the disk reported an error (a failing card?); the journal keeps every acknowledged \
             commit: fix the disk and start again, keeping the journal"
        }
    }
}

/// The open journal, owned by the store (the writer thread).
pub(super) struct Journal {
    file: Box<dyn JournalFile>,
    path: PathBuf,
    id: u64,
    /// The file's size: the records fit below it.
    capacity: u64,
    /// Where the records start (after the header's page or unit).
    start: u64,
    /// Records start on multiples of this: 1 (format 1), a page (2) or a unit (3).
    unit: u64,
    /// Where the next record goes (or, if it does not fit before the end, the first record's
    /// place: the records go round).
    end: u64,
    /// The records whose commits the database does not hold durably yet, oldest first: (commit,
    /// offset, bytes taken). No append overwrites them.
    live: std::collections::VecDeque<(u64, u64, u64)>,
    /// Bytes the live records take.
    live_bytes: u64,
    /// The record being written, kept to reuse its allocation.
    buf: Vec<u8>,
    /// The file's format: [`FORMAT`], or [`FORMAT_PACKED`] (read, then made anew).
    format: u32,
}

impl Journal {
    /// Opens the journal of the database whose `journal_id` is `id`, creating it (`capacity`
    /// bytes, zero-filled, synced, then renamed into place) if it does not exist. `open_file`
    /// opens an existing file for reading and writing (the fault seam passes its own).
    pub(super) fn open(
        path: PathBuf,
        id: u64,
        capacity: u64,
        open_file: impl FnOnce(&Path) -> io::Result<Box<dyn JournalFile>>,
    ) -> Result<Journal, JournalError> {
        let io_err = |source| JournalError::Io {
            path: path.clone(),
            source,
        };
        if !path.exists() {
            create(&path, id, capacity).map_err(io_err)?;
        }
        let file = open_file(&path).map_err(io_err)?;
        let len = file.len().map_err(io_err)?;
        let mut header = [0u8; 40];
        if len < HEADER_BYTES {
            return Err(JournalError::BadHeader { path });
        }
        // An error reading it is the disk's, not damage to the journal.
        file.read_at(0, &mut header).map_err(io_err)?;
        let (found, format) =
            parse_header(&header).ok_or_else(|| JournalError::BadHeader { path: path.clone() })?;
        if found != id {
            return Err(JournalError::Foreign {
                path,
                found,
                expected: id,
            });
        }
        let (start, unit) = match format {
            FORMAT_PACKED => (HEADER_BYTES, 1),
            FORMAT_PAGES => (HEADER_BYTES, PAGE_BYTES),
            _ => (UNIT_BYTES, UNIT_BYTES),
        };
        if len < start {
            return Err(JournalError::BadHeader { path });
        }
        Ok(Journal {
            file,
            path,
            id,
            capacity: len,
            start,
            unit,
            end: start,
            live: std::collections::VecDeque::new(),
            live_bytes: 0,
            buf: Vec::new(),
            format,
        })
    }

    /// Whether the file is of the current format (an older one is only read, then made anew).
    pub(super) fn current_format(&self) -> bool {
        self.format == FORMAT
    }

    /// The bytes a record with a payload of `len` bytes takes, to where the next one starts.
    fn footprint(&self, len: usize) -> u64 {
        ((RECORD_HEADER_BYTES + len) as u64).div_ceil(self.unit) * self.unit
    }

    /// The file's size.
    pub(super) fn size(&self) -> u64 {
        self.capacity
    }

    /// Bytes the live records take (those whose commits the database does not hold durably).
    pub(super) fn used(&self) -> u64 {
        self.live_bytes
    }

    /// Bytes the records may take in all.
    pub(super) fn room(&self) -> u64 {
        self.capacity - self.start
    }

    /// Calls `apply` with every live record for a database whose next commit is `next_seq`, in
    /// order (see the module docs), and returns how many there were. The journal's write position
    /// is left after the last live record, and they stay live until
    /// [`Journal::release_below`] (once the database holds them durably).
    pub(super) fn replay<E: From<JournalError>>(
        &mut self,
        next_seq: u64,
        mut apply: impl FnMut(u64, &Redo<'_>) -> Result<(), E>,
    ) -> Result<usize, E> {
        if self.format == FORMAT_PACKED {
            return self.replay_packed(next_seq, apply);
        }
        let mut payload = Vec::new();
        // The record of commit `next_seq`, wherever the ring put it; a later commit without it
        // means commits are missing.
        let mut first = None;
        let mut later: Option<u64> = None;
        let mut at = self.start;
        while at + RECORD_HEADER_BYTES as u64 <= self.capacity {
            if let Some(seq) = self.seq_at(at).filter(|&s| s >= next_seq)
                && self.record_at(at, &mut payload).is_some()
            {
                if seq == next_seq {
                    first = Some(at);
                    break;
                }
                later = Some(later.map_or(seq, |l| l.min(seq)));
            }
            at += self.unit;
        }
        let Some(mut at) = first else {
            if let Some(found) = later {
                return Err(JournalError::Gap {
                    path: self.path.clone(),
                    found,
                    expected: next_seq,
                }
                .into());
            }
            self.end = self.start;
            return Ok(0);
        };
        let mut expected = next_seq;
        loop {
            // The next record follows this one, or starts the ring again.
            let (seq, len) = match self.record_at(at, &mut payload) {
                Some((seq, len)) if seq == expected => (seq, len),
                _ if at != self.start => match self.record_at(self.start, &mut payload) {
                    Some((seq, len)) if seq == expected => {
                        at = self.start;
                        (seq, len)
                    }
                    _ => break,
                },
                _ => break,
            };
            let redo = Redo::parse(&payload).ok_or_else(|| JournalError::Record {
                path: self.path.clone(),
                seq,
            })?;
            apply(seq, &redo)?;
            let footprint = self.footprint(len);
            self.live.push_back((seq, at, footprint));
            self.live_bytes += footprint;
            expected += 1;
            at += footprint;
        }
        // A run ends at the record a power cut tore, which was never acknowledged, so nothing
        // after it was written. A whole record of a later commit means the disk damaged an
        // acknowledged one: refuse rather than lose it and every one after it (issue 51).
        if let Some(found) = self.first_record_from(expected, &mut payload) {
            return Err(JournalError::Broken {
                path: self.path.clone(),
                missing: expected,
                found,
            }
            .into());
        }
        self.end = at;
        Ok(self.live.len())
    }

    /// The smallest sequence number at or above `seq` of a whole record anywhere in the file.
    fn first_record_from(&self, seq: u64, payload: &mut Vec<u8>) -> Option<u64> {
        let mut found: Option<u64> = None;
        let mut at = self.start;
        while at + RECORD_HEADER_BYTES as u64 <= self.capacity {
            if let Some(s) = self.seq_at(at).filter(|&s| s >= seq)
                && found.is_none_or(|f| s < f)
                && self.record_at(at, payload).is_some()
            {
                found = Some(s);
            }
            at += self.unit;
        }
        found
    }

    /// [`Journal::replay`] of a format-1 journal: records packed from the first, started over
    /// after each durable commit.
    fn replay_packed<E: From<JournalError>>(
        &mut self,
        next_seq: u64,
        mut apply: impl FnMut(u64, &Redo<'_>) -> Result<(), E>,
    ) -> Result<usize, E> {
        let mut at = HEADER_BYTES;
        let mut expected = next_seq;
        let mut applied = 0;
        let mut payload = Vec::new();
        while let Some((seq, len)) = self.record_at(at, &mut payload) {
            if seq < expected && applied == 0 {
                // Held by the database already (written before its last durable commit).
                at += self.footprint(len);
                continue;
            }
            if seq != expected {
                if applied == 0 && seq > expected {
                    return Err(JournalError::Gap {
                        path: self.path.clone(),
                        found: seq,
                        expected,
                    }
                    .into());
                }
                break; // An older record after the live run: the end.
            }
            let redo = Redo::parse(&payload).ok_or_else(|| JournalError::Record {
                path: self.path.clone(),
                seq,
            })?;
            apply(seq, &redo)?;
            applied += 1;
            expected += 1;
            at += self.footprint(len);
        }
        self.end = at;
        Ok(applied)
    }

    /// Calls `visit` with every live record, oldest first, read back from the file.
    pub(super) fn live_records<E: From<JournalError>>(
        &self,
        mut visit: impl FnMut(u64, &Redo<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut payload = Vec::new();
        for &(seq, at, _) in &self.live {
            let redo = match self.record_at(at, &mut payload) {
                Some((s, _)) if s == seq => Redo::parse(&payload),
                _ => None,
            };
            let redo = redo.ok_or_else(|| JournalError::Record {
                path: self.path.clone(),
                seq,
            })?;
            visit(seq, &redo)?;
        }
        Ok(())
    }

    /// The sequence number a record header at `at` claims, unchecked (a quick look before the
    /// checksum is read).
    fn seq_at(&self, at: u64) -> Option<u64> {
        let mut head = [0u8; RECORD_HEADER_BYTES];
        self.file.read_at(at, &mut head).ok()?;
        let (len, seq, _) = header_fields(head);
        (len > 0).then_some(seq)
    }

    /// How many live records a database whose next commit is `next_seq` and whose journal id
    /// is `id` lacks in the journal at `path` (0 when there is none), without changing it: a
    /// reader of a file no daemon holds.
    pub(super) fn pending(path: &Path, id: u64, next_seq: u64) -> Result<usize, JournalError> {
        if !path.exists() {
            return Ok(0);
        }
        let mut j = Journal::open(path.to_owned(), id, 0, |p| {
            Ok(Box::new(File::open(p)?) as Box<dyn JournalFile>)
        })?;
        j.replay(next_seq, |_, _| Ok::<(), JournalError>(()))
    }

    /// Reads the record at `at` into `payload` if one is there whose checksum holds: its
    /// sequence number and payload length.
    fn record_at(&self, at: u64, payload: &mut Vec<u8>) -> Option<(u64, usize)> {
        let mut head = [0u8; RECORD_HEADER_BYTES];
        if at + RECORD_HEADER_BYTES as u64 > self.capacity {
            return None;
        }
        self.file.read_at(at, &mut head).ok()?;
        let (len, seq, sum) = header_fields(head);
        let len = len as usize;
        let body_at = at + RECORD_HEADER_BYTES as u64;
        if len == 0 || body_at + len as u64 > self.capacity {
            return None;
        }
        payload.resize(len, 0);
        self.file.read_at(body_at, payload).ok()?;
        (checksum(&head[0..12], payload, self.id) == sum).then_some((seq, len))
    }

    /// Where a record taking `footprint` bytes goes: after the last one, or if it does not fit
    /// before the end of the file, at the first record's place; never over a live record.
    /// `None` when it fits nowhere.
    fn place(&self, footprint: u64) -> Option<u64> {
        let (start, end, cap) = (self.start, self.end, self.capacity);
        let fits_before =
            |at: u64, limit: u64| at.checked_add(footprint).is_some_and(|e| e <= limit);
        match self.live.front() {
            None if fits_before(end, cap) => Some(end),
            None => fits_before(start, cap).then_some(start),
            // The live records run from `tail` to `end`: free after them and before them.
            Some(&(_, tail, _)) if end > tail => {
                if fits_before(end, cap) {
                    Some(end)
                } else {
                    fits_before(start, tail).then_some(start)
                }
            }
            // They go round the end of the file: free between them.
            Some(&(_, tail, _)) => fits_before(end, tail).then_some(end),
        }
    }

    /// Appends the record of commit `seq` holding `redo`, and syncs it: when this returns `Ok`
    /// the record survives a power cut. `false` (nothing written) when it does not fit.
    pub(super) fn append(&mut self, seq: u64, redo: &Redo<'_>) -> io::Result<bool> {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        buf.resize(RECORD_HEADER_BYTES, 0);
        redo.encode(&mut buf);
        let len = buf.len() - RECORD_HEADER_BYTES;
        let footprint = self.footprint(len);
        let Some(at) = self.place(footprint) else {
            self.buf = buf;
            return Ok(false);
        };
        let len32 = u32::try_from(len).expect("a record fits in the journal, far below 4 GiB");
        buf[0..4].copy_from_slice(&len32.to_le_bytes());
        buf[4..12].copy_from_slice(&seq.to_le_bytes());
        let sum = checksum(&buf[0..12], &buf[RECORD_HEADER_BYTES..], self.id);
        buf[12..20].copy_from_slice(&sum.to_le_bytes());
        // To the end of its last page: the page holds this record and nothing else. The rest
        // of its last unit is left as it was (nothing live is there), not written.
        let pages = ((RECORD_HEADER_BYTES + len) as u64).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        buf.resize(
            usize::try_from(pages.min(footprint)).expect("a record fits in memory"),
            0,
        );
        let written = self.file.write_at(at, &buf).and_then(|()| self.file.sync());
        self.buf = buf;
        written?;
        self.end = at + footprint;
        self.live.push_back((seq, at, footprint));
        self.live_bytes += footprint;
        Ok(true)
    }

    /// The records of commits before `seq` are no longer live: the database holds them
    /// durably. Nothing is written; their pages are overwritten as new records come round, and
    /// a scan tells old records apart by their sequence numbers.
    pub(super) fn release_below(&mut self, seq: u64) {
        while let Some(&(s, _, footprint)) = self.live.front() {
            if s >= seq {
                break;
            }
            self.live.pop_front();
            self.live_bytes -= footprint;
        }
    }
}

fn checksum(head: &[u8], payload: &[u8], id: u64) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(head);
    h.update(payload);
    h.update(&id.to_le_bytes());
    h.digest()
}

fn header_bytes(id: u64) -> [u8; 40] {
    let mut h = [0u8; 40];
    h[0..16].copy_from_slice(MAGIC);
    h[16..20].copy_from_slice(&FORMAT.to_le_bytes());
    h[24..32].copy_from_slice(&id.to_le_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&h[0..32]);
    h[32..40].copy_from_slice(&sum.to_le_bytes());
    h
}

/// The journal id and format of a header, if it is one of a format this release reads.
fn parse_header(h: &[u8; 40]) -> Option<(u64, u32)> {
    let sum = u64::from_le_bytes(h[32..40].try_into().expect("h is 40 bytes: 32..40 is 8"));
    let format = u32::from_le_bytes(h[16..20].try_into().expect("h is 40 bytes: 16..20 is 4"));
    (h[0..16] == MAGIC[..]
        && [FORMAT, FORMAT_PAGES, FORMAT_PACKED].contains(&format)
        && xxhash_rust::xxh3::xxh3_64(&h[0..32]) == sum)
        .then(|| {
            let id = u64::from_le_bytes(h[24..32].try_into().expect("h is 40 bytes: 24..32 is 8"));
            (id, format)
        })
}

/// Writes a new journal at `path`: the header, zeros up to `capacity` (so that later writes
/// overwrite blocks that exist), synced under a temporary name (`<path>.new`) and renamed into
/// place. On failure (a full disk, most likely) the partial file is removed, so that a failed
/// first start does not leave up to `capacity` bytes taken on a full card.
/// A SIGTERM (`crate::stop`) ends the zero fill within a mebibyte, as an `Interrupted` error.
fn create(path: &Path, id: u64, capacity: u64) -> io::Result<()> {
    create_unless(path, id, capacity, &crate::stop::requested)
}

/// [`create`], ended by `stop`.
fn create_unless(path: &Path, id: u64, capacity: u64, stop: &dyn Fn() -> bool) -> io::Result<()> {
    let tmp = {
        let mut p = path.as_os_str().to_owned();
        p.push(".new");
        PathBuf::from(p)
    };
    create_via(&tmp, path, id, capacity, stop).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// How often the zero fill asks whether to stop: every 256 pages (1 MiB).
const STOP_CHECK_PAGES: u64 = 256;

fn create_via(
    tmp: &Path,
    path: &Path,
    id: u64,
    capacity: u64,
    stop: &dyn Fn() -> bool,
) -> io::Result<()> {
    {
        let file = File::create(tmp)?;
        // A page at a time: the page cache then holds the file in single pages, and a commit
        // dirties (and Linux counts as written, in /proc/<pid>/io) one page, not a large folio
        // of the zero-fill (the disk writes only the changed blocks either way).
        let zeros = vec![0u8; 4096];
        let mut at = 0;
        while at < capacity {
            if at % (STOP_CHECK_PAGES * 4096) == 0 && stop() {
                return Err(io::Error::new(
                    io::ErrorKind::Interrupted,
                    "stopped by a signal while the journal was being made (it is made again at \
                     the next start)",
                ));
            }
            let n = zeros
                .len()
                .min(usize::try_from(capacity - at).unwrap_or(usize::MAX));
            JournalFile::write_at(&file, at, &zeros[..n])?;
            at += n as u64;
        }
        JournalFile::write_at(&file, 0, &header_bytes(id))?;
        file.sync_all()?;
    }
    std::fs::rename(tmp, path)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// One commit's writes to the database, as the journal keeps them: applying it to the tables
/// (`store::apply_redo`) writes exactly what the commit wrote. Every write is a put of a key
/// (or, for the outbox, the removal of the acknowledged entries below a key), so applying a
/// record twice writes the same as once. Borrowed: the live commit builds it from its own
/// buffers, a replay from the journal's bytes. Pure.
#[derive(Debug, Clone, PartialEq)]
pub struct Redo<'a> {
    /// Series first seen in the commit: (id, name).
    pub series: Vec<(u64, &'a str)>,
    /// The commit log record ([`crate::commitlog`]).
    pub log: &'a [u8],
    /// The fingerprints ([`crate::dedup::encode`]).
    pub fingerprints: &'a [u8],
    /// Gateways' applied positions: (gateway, [`crate::delta::Position::encode`]).
    pub applied: Vec<(&'a str, &'a [u8])>,
    pub outbox: Option<OutboxRedo<'a>>,
}

/// A commit's outbox write: entries below `trim_below` removed (acknowledged upstream), then
/// `doc` stored under `key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxRedo<'a> {
    pub trim_below: u64,
    pub key: u64,
    pub doc: &'a [u8],
}

impl<'a> Redo<'a> {
    /// Appends the payload: a version byte, then varint counts and lengths before each part.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(REDO_V1);
        put_varint(out, self.series.len() as u64);
        for (id, name) in &self.series {
            put_varint(out, *id);
            put_bytes(out, name.as_bytes());
        }
        put_bytes(out, self.log);
        put_bytes(out, self.fingerprints);
        put_varint(out, self.applied.len() as u64);
        for (gateway, at) in &self.applied {
            put_bytes(out, gateway.as_bytes());
            put_bytes(out, at);
        }
        match &self.outbox {
            None => out.push(0),
            Some(o) => {
                out.push(1);
                put_varint(out, o.trim_below);
                put_varint(out, o.key);
                put_bytes(out, o.doc);
            }
        }
    }

    /// The payload's parts, or `None` if it is not one [`Redo::encode`] wrote.
    pub fn parse(mut r: &'a [u8]) -> Option<Redo<'a>> {
        let r = &mut r;
        if take(r, 1)? != [REDO_V1] {
            return None;
        }
        let n = get_varint(r)?;
        let mut series = Vec::new();
        for _ in 0..n {
            let id = get_varint(r)?;
            series.push((id, std::str::from_utf8(get_bytes(r)?).ok()?));
        }
        let log = get_bytes(r)?;
        let fingerprints = get_bytes(r)?;
        let n = get_varint(r)?;
        let mut applied = Vec::new();
        for _ in 0..n {
            let gateway = std::str::from_utf8(get_bytes(r)?).ok()?;
            applied.push((gateway, get_bytes(r)?));
        }
        let outbox = match take(r, 1)? {
            [0] => None,
            [1] => Some(OutboxRedo {
                trim_below: get_varint(r)?,
                key: get_varint(r)?,
                doc: get_bytes(r)?,
            }),
            _ => return None,
        };
        r.is_empty().then_some(Redo {
            series,
            log,
            fingerprints,
            applied,
            outbox,
        })
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn take<'a>(r: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if r.len() < n {
        return None;
    }
    let (head, rest) = r.split_at(n);
    *r = rest;
    Some(head)
}

fn get_bytes<'a>(r: &mut &'a [u8]) -> Option<&'a [u8]> {
    let n = usize::try_from(get_varint(r)?).ok()?;
    take(r, n)
}

/// A record header's fields, little-endian: the body's length, its sequence number and its
/// checksum (taken apart by pattern: no slice of it can be out of range).
fn header_fields(head: [u8; RECORD_HEADER_BYTES]) -> (u32, u64, u64) {
    let [
        l0,
        l1,
        l2,
        l3,
        s0,
        s1,
        s2,
        s3,
        s4,
        s5,
        s6,
        s7,
        c0,
        c1,
        c2,
        c3,
        c4,
        c5,
        c6,
        c7,
    ] = head;
    (
        u32::from_le_bytes([l0, l1, l2, l3]),
        u64::from_le_bytes([s0, s1, s2, s3, s4, s5, s6, s7]),
        u64::from_le_bytes([c0, c1, c2, c3, c4, c5, c6, c7]),
    )
}

#[cfg(test)]
mod tests;
