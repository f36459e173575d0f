//! Where the journal's bytes sit on the device, as the kernel says it: the filesystem (by its
//! magic number) and the physical extents of the file (`FS_IOC_FIEMAP`) with the partition's
//! offset on its disk (`/sys/dev/block/MAJ:MIN/start`). The journal gives each record 16 KiB
//! units of the file to itself so that a torn program of the card's unit cannot reach an
//! acknowledged record (docs/STORAGE.md); that holds on the device only if each file unit is
//! one 16 KiB-aligned stretch of the device. Checked once at start and said in the log: a
//! copy-on-write or log-structured filesystem (btrfs, F2FS, ZFS, bcachefs, NILFS) writes each
//! record somewhere new, and a misaligned extent puts a unit across two of the card's.
//!
//! What no check here can see: how the card's controller maps those device blocks to flash
//! (its FTL programs writes in arrival order; pages paired in one multi-level cell; erase blocks
//! of megabytes rewritten by garbage collection). Those stay the card's own guarantees.

use std::path::Path;

/// The journal's program unit (`journal::UNIT_BYTES`).
const UNIT: u64 = 16 * 1024;

/// One extent of the file: `length` bytes at file offset `logical`, device offset `physical`
/// (from the start of the filesystem's block device), with FIEMAP's flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Extent {
    pub logical: u64,
    pub physical: u64,
    pub length: u64,
    pub flags: u32,
}

/// `FIEMAP_EXTENT_*` flags under which the physical offset says nothing of where the bytes are.
const UNKNOWN_PLACE: u32 = 0x0000_0002 // UNKNOWN
    | 0x0000_0004 // DELALLOC
    | 0x0000_0008 // ENCODED
    | 0x0000_0080 // NOT_ALIGNED
    | 0x0000_0100 // DATA_INLINE
    | 0x0000_0200 // DATA_TAIL
    | 0x0000_2000; // SHARED (reflinked: a write moves it)

/// What the check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Placement {
    /// Every 16 KiB unit of the file is one 16 KiB-aligned stretch of the disk.
    Aligned { extents: usize },
    /// A filesystem that writes each change somewhere new (by name).
    CopyOnWrite(&'static str),
    /// An extent that puts units across the disk's 16 KiB boundaries: the first such, as file
    /// and disk offsets.
    Misaligned { logical: u64, disk: u64 },
    /// The kernel does not say (no FIEMAP on this filesystem, a device without a partition
    /// table entry, too many extents): why.
    Unknown(String),
}

/// Copy-on-write and log-structured filesystems, by `statfs` magic.
fn copy_on_write(magic: u64) -> Option<&'static str> {
    match magic {
        0x9123_683E => Some("btrfs"),
        0xF2F5_2010 => Some("F2FS"),
        0x2FC1_2FC1 => Some("ZFS"),
        0xCA45_1A4E => Some("bcachefs"),
        0x3434 => Some("NILFS"),
        _ => None,
    }
}

/// The verdict for a file on a filesystem with `magic`, whose device starts `partition_start`
/// bytes into its disk, laid out in `extents` (in file order).
pub(super) fn judge(magic: u64, partition_start: u64, extents: &[Extent]) -> Placement {
    if let Some(name) = copy_on_write(magic) {
        return Placement::CopyOnWrite(name);
    }
    if extents.is_empty() {
        return Placement::Unknown("the file has no extents on the device".into());
    }
    for e in extents {
        let disk = partition_start.saturating_add(e.physical);
        let end = e.logical.saturating_add(e.length);
        // An extent that begins or ends inside a unit (its last one may end at the file's
        // end, which is a unit boundary for the journal) splits that unit across two places.
        let misaligned = e.flags & UNKNOWN_PLACE != 0
            || disk % UNIT != e.logical % UNIT
            || e.logical % UNIT != 0
            || end % UNIT != 0;
        if misaligned {
            return Placement::Misaligned {
                logical: e.logical,
                disk,
            };
        }
    }
    Placement::Aligned {
        extents: extents.len(),
    }
}

/// Checks the journal at `path` and says what it found in the log.
pub(super) fn log_placement(path: &Path) {
    match check(path) {
        Placement::Aligned { extents } => tracing::debug!(
            journal = %path.display(),
            extents,
            "The journal's 16 KiB units are 16 KiB-aligned on the disk: a torn write of one \
             cannot reach another record's unit."
        ),
        Placement::CopyOnWrite(fs) => tracing::warn!(
            journal = %path.display(),
            filesystem = fs,
            "The journal is on a copy-on-write filesystem: each record is written somewhere new \
             on the card, so the 16 KiB unit each record keeps to itself in the file is not one \
             on the card, and a power cut while a record is written may damage the one before \
             it, already acknowledged. Put the database on ext4 or XFS for that guarantee \
             (docs/STORAGE.md, \"Where the guarantees hold\")."
        ),
        Placement::Misaligned { logical, disk } => tracing::warn!(
            journal = %path.display(),
            file_offset = logical,
            disk_offset = disk,
            "The journal's blocks are not 16 KiB-aligned on the disk (partition or filesystem \
             blocks off the card's units): a record's unit can share the card's program unit \
             with its neighbour, and a power cut while one is written may damage the other. \
             Align the partition to 1 MiB and make the filesystem with 4 KiB blocks, or \
             `store.journal_size = 0` (docs/STORAGE.md, \"Where the guarantees hold\")."
        ),
        Placement::Unknown(why) => tracing::info!(
            journal = %path.display(),
            why = %why,
            "Could not tell where the journal's blocks are on the disk; the 16 KiB unit \
             guarantee is assumed, not checked."
        ),
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn check(path: &Path) -> Placement {
    use std::os::unix::fs::MetadataExt;
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) => return Placement::Unknown(format!("cannot open it: {e}")),
    };
    let magic = match rustix::fs::fstatfs(&file) {
        #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
        Ok(s) => (s.f_type as u32).into(),
        Err(e) => return Placement::Unknown(format!("statfs: {e}")),
    };
    if let Some(name) = copy_on_write(magic) {
        return Placement::CopyOnWrite(name);
    }
    let dev = match file.metadata() {
        Ok(m) => m.dev(),
        Err(e) => return Placement::Unknown(format!("stat: {e}")),
    };
    let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
    let sys = format!("/sys/dev/block/{major}:{minor}");
    if !Path::new(&sys).exists() {
        return Placement::Unknown(format!("device {major}:{minor} is not a block device"));
    }
    // A partition has `start` (in 512-byte sectors); a whole disk has none.
    let start = match std::fs::read_to_string(format!("{sys}/start")) {
        Ok(s) => match s.trim().parse::<u64>() {
            Ok(sectors) => sectors.saturating_mul(512),
            Err(_) => return Placement::Unknown(format!("{sys}/start is not a number")),
        },
        Err(_) => 0,
    };
    match fiemap::extents(&file) {
        Ok(extents) => judge(magic, start, &extents),
        Err(why) => Placement::Unknown(why),
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn check(_: &Path) -> Placement {
    Placement::Unknown("only Linux says where a file's blocks are".into())
}

#[cfg(any(target_os = "linux", target_os = "android"))]
mod fiemap {
    use super::Extent;

    /// `struct fiemap` without its extents (linux/fiemap.h).
    #[repr(C)]
    #[derive(Default)]
    struct Header {
        start: u64,
        length: u64,
        flags: u32,
        mapped_extents: u32,
        extent_count: u32,
        reserved: u32,
    }

    /// `struct fiemap_extent`.
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct RawExtent {
        logical: u64,
        physical: u64,
        length: u64,
        reserved64: [u64; 2],
        flags: u32,
        reserved: [u32; 3],
    }

    const BATCH: usize = 32;
    /// More extents than this and the journal is too fragmented to be worth judging.
    const MAX_EXTENTS: usize = 4096;
    const LAST: u32 = 0x1;

    #[repr(C)]
    #[derive(Default)]
    struct Request {
        header: Header,
        extents: [RawExtent; BATCH],
    }

    /// `FS_IOC_FIEMAP`: `_IOWR('f', 11, struct fiemap)`, sized by the header alone.
    const FS_IOC_FIEMAP: rustix::ioctl::Opcode =
        rustix::ioctl::opcode::read_write::<Header>(b'f', 11);

    /// The file's extents, in file order, or why the kernel does not say.
    pub(super) fn extents(file: &std::fs::File) -> Result<Vec<Extent>, String> {
        let mut out = Vec::new();
        let mut from = 0u64;
        loop {
            let mut req = Request::default();
            req.header.start = from;
            req.header.length = u64::MAX - from;
            req.header.extent_count = BATCH as u32;
            // SAFETY: `Request` is `struct fiemap` followed by room for `BATCH` extents, as
            // `extent_count` tells the kernel, which writes no more than that.
            let done = unsafe {
                rustix::ioctl::ioctl(
                    file,
                    rustix::ioctl::Updater::<FS_IOC_FIEMAP, Request>::new(&mut req),
                )
            };
            done.map_err(|e| format!("FIEMAP: {e}"))?;
            let n = (req.header.mapped_extents as usize).min(BATCH);
            if n == 0 {
                return Ok(out);
            }
            for e in &req.extents[..n] {
                out.push(Extent {
                    logical: e.logical,
                    physical: e.physical,
                    length: e.length,
                    flags: e.flags,
                });
                from = e.logical.saturating_add(e.length);
                if e.flags & LAST != 0 {
                    return Ok(out);
                }
            }
            if out.len() > MAX_EXTENTS {
                return Err(format!("more than {MAX_EXTENTS} extents"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn extent(logical: u64, physical: u64, length: u64) -> Extent {
        Extent {
            logical,
            physical,
            length,
            flags: 0,
        }
    }

    #[test]
    fn units_aligned_on_the_disk_pass_and_every_kind_of_misalignment_is_named() {
        let ext4 = 0xEF53;
        let aligned = [
            extent(0, 8 * MIB, 16 * MIB),
            extent(16 * MIB, 64 * MIB, 16 * MIB),
        ];
        assert_eq!(
            judge(ext4, MIB, &aligned),
            Placement::Aligned { extents: 2 }
        );
        // A partition that starts at sector 63 (the old DOS default).
        assert!(matches!(
            judge(ext4, 63 * 512, &aligned),
            Placement::Misaligned { logical: 0, .. }
        ));
        // Filesystem blocks of 4 KiB off the unit: the second extent starts 4 KiB late.
        let off = [
            extent(0, 8 * MIB, 16 * MIB),
            extent(16 * MIB, 64 * MIB + 4096, 16 * MIB),
        ];
        assert_eq!(
            judge(ext4, 0, &off),
            Placement::Misaligned {
                logical: 16 * MIB,
                disk: 64 * MIB + 4096
            }
        );
        // An extent that ends inside a unit splits it across two places on the disk.
        let split = [
            extent(0, 8 * MIB, 20 * 1024),
            extent(20 * 1024, 9 * MIB, MIB),
        ];
        assert!(matches!(
            judge(ext4, 0, &split),
            Placement::Misaligned { logical: 0, .. }
        ));
        // Data whose place the kernel does not know (delayed allocation) or that moves when
        // written (shared by a reflink).
        for flags in [0x4, 0x2000] {
            let e = [Extent {
                flags,
                ..extent(0, 8 * MIB, MIB)
            }];
            assert!(matches!(judge(ext4, 0, &e), Placement::Misaligned { .. }));
        }
        assert_eq!(
            judge(0x9123_683E, 0, &aligned),
            Placement::CopyOnWrite("btrfs")
        );
        assert_eq!(
            judge(0xF2F5_2010, 0, &aligned),
            Placement::CopyOnWrite("F2FS")
        );
        assert!(matches!(judge(ext4, 0, &[]), Placement::Unknown(_)));
    }

    /// The check on a real file of this machine's: a journal made as the store makes it has
    /// extents the kernel reports, each judged; on a filesystem without FIEMAP (tmpfs) the
    /// answer says it cannot tell.
    #[test]
    fn the_kernel_reports_the_extents_of_a_real_journal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        std::fs::write(&path, vec![1u8; 4 * MIB as usize]).unwrap();
        std::fs::File::open(&path).unwrap().sync_all().unwrap();
        let file = std::fs::File::open(&path).unwrap();
        #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
        let magic = u64::from(rustix::fs::fstatfs(&file).unwrap().f_type as u32);
        let verdict = check(&path);
        eprintln!("{}: filesystem {magic:#x}, {verdict:?}", path.display());
        // ext4 and XFS (these machines' and most gateways') report their extents.
        if [0xEF53, 0x5846_5342].contains(&magic) {
            let extents = fiemap::extents(&file).unwrap();
            let bytes: u64 = extents.iter().map(|e| e.length).sum();
            assert_eq!(bytes, 4 * MIB, "{extents:?}");
            assert!(
                matches!(
                    verdict,
                    Placement::Aligned { .. } | Placement::Misaligned { .. }
                ),
                "{verdict:?}"
            );
        }
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            let f = tempfile::NamedTempFile::new_in(shm).unwrap();
            std::fs::write(f.path(), vec![0u8; 64 * 1024]).unwrap();
            assert!(matches!(check(f.path()), Placement::Unknown(_)), "tmpfs");
        }
    }
}
