//! A failed fsync and what follows it (a kill, a reopen, a retry), a counter that drifted, a full
//! card at a restart: each path where an acknowledged reading could be lost or counted twice,
//! driven through the fault seam to the power cut that would show it.

use super::*;

const HOUR: i64 = 3600;

/// The smallest journal (15 records of one unit each): a few commits go round it.
fn small_journal(path: &Path) -> StoreSettings {
    StoreSettings {
        journal_bytes: crate::limits::MIN_JOURNAL_BYTES,
        ..settings(path)
    }
}

/// One reading of `c/t` per commit, `n` commits from `from` seconds on: more than go round
/// the smallest journal when `n` > 15.
fn commit_many(store: &mut Store, from: i64, n: i64) {
    for i in 0..n {
        store.commit(&batch(&[("c/t", from + i, 1.0)])).unwrap();
    }
}

/// Cuts the power now: what only a cache (the kernel's or the device's) held is gone.
fn cut_power(store: Store, faults: &Faults) {
    faults.hasten_power_cut();
    let mut store = store;
    let _ = store.checkpoint();
    let _ = store.commit(&batch(&[("z/t", 0, 0.0)]));
    assert!(faults.power_is_off(), "the power is off");
    drop(store);
}

/// A checkpoint's fsync fails (Linux keeps the pages it could not write, marked clean, and reads
/// them back; or the device keeps them in its volatile cache), and the process dies before it
/// reopens the file: a kill -9, the OOM killer, a stop timeout. The caches outlive the process
/// (the fault seam's outlive the `Store`). The next start read the failed fold as committed,
/// freed the folded commits' journal records, and new commits overwrote them: after the power
/// cut those readings were in neither file. Now a start reads the file from the disk, and frees
/// a record only after a durable transaction of its own has synced.
#[test]
fn a_start_after_a_failed_fsync_and_a_kill_trusts_no_cached_page() {
    // Every commit mode, and each of its fsyncs failing (faults::FAILING_SYNCS).
    for mode in faults::FAILING_SYNCS {
        for landed in [Landed::Nothing, Landed::FirstPage, Landed::Volatile] {
            kill_after_a_failed_fold(mode, landed);
        }
    }
}

/// A store (over `faults`) at `dir` in the given commit mode whose checkpoint of two readings
/// has just failed its fsync, `landed` saying what of it reached the device.
fn with_a_failed_fold(
    dir: &Path,
    (durability, skip, quick_repair): (Durability, u32, bool),
    landed: Landed,
) -> (StoreSettings, Store, Arc<Faults>) {
    let s = StoreSettings {
        durability,
        quick_repair,
        ..small_journal(&dir.join("fold.redb"))
    };
    let faults = Arc::new(Faults::default());
    let mut store = Store::open_with_faults(&s, Some(faults.clone())).unwrap();
    store
        .commit(&batch(&[("a/t", 10, 1.0), ("b/t", HOUR, 2.0)]))
        .unwrap();
    // From here writes wait in the (simulated) page cache until their file's sync.
    faults.arm_power_cut(u64::MAX, Cut::Nothing);
    faults.fail_sync_landing(skip, landed);
    assert!(store.checkpoint().is_err(), "the fsync fails");
    (s, store, faults)
}

/// What the file holds after the power cut: the failed fold's two readings and `n` of `c/t`.
fn the_fold_and(n: i64) -> BTreeMap<(String, i64), (i64, f64)> {
    [
        (("a/t".to_owned(), 0), (1, 1.0)),
        (("b/t".to_owned(), HOUR), (1, 2.0)),
        (("c/t".to_owned(), 2 * HOUR), (n, n as f64)),
    ]
    .into()
}

fn kill_after_a_failed_fold(mode: (Durability, u32, bool), landed: Landed) {
    let dir = tempfile::tempdir().unwrap();
    let (s, store, faults) = with_a_failed_fold(dir.path(), mode, landed);
    // Killed: no reopen, no recovery, no destructor's write. The caches stay.
    faults.kill();
    drop(store);
    faults.restart();
    let mut store = Store::open_with_faults(&s, Some(faults.clone())).unwrap();
    // The next records go where the failed fold's were, if they were freed; no fold (no
    // durable transaction) before the power fails.
    commit_many(&mut store, 2 * HOUR, 3);
    cut_power(store, &faults);
    let store = Store::open(&s).unwrap();
    assert_eq!(
        totals_of(&store.reader()),
        the_fold_and(3),
        "{mode:?} {landed:?}"
    );
}

/// The same fold, its fsync failed and its pages in the device's volatile cache, in a process
/// that lives on: the next write reopens the file (`Store::recover`), which reads the fold back
/// from the device. It freed the folded commits' records on that reading alone, with no fsync
/// that succeeded; the journal went round over them, and the power cut took the fold.
#[test]
fn a_fold_read_back_after_a_failed_fsync_frees_no_record_until_a_sync_succeeds() {
    for mode in faults::FAILING_SYNCS {
        for landed in [Landed::Volatile, Landed::Nothing, Landed::All] {
            reopen_after_a_failed_fold(mode, landed);
        }
    }
}

fn reopen_after_a_failed_fold(mode: (Durability, u32, bool), landed: Landed) {
    let dir = tempfile::tempdir().unwrap();
    let (s, mut store, faults) = with_a_failed_fold(dir.path(), mode, landed);
    // Reopens the file, reads the fold (or not) back; nothing left to fold.
    store.checkpoint().unwrap();
    assert_eq!(store.log_bytes(), store.recount_log_bytes());
    // Once round the journal (15 records): the last goes over the fold's record if it was
    // freed, and no fold runs before the power fails.
    commit_many(&mut store, 2 * HOUR, 15);
    cut_power(store, &faults);
    let store = Store::open(&s).unwrap();
    assert_eq!(
        totals_of(&store.reader()),
        the_fold_and(15),
        "{mode:?} {landed:?}"
    );
}

/// The mechanism under the test above, which redb's own repair at the reopen (a durable
/// commit of its own) already covers end to end in the simulation: after a reopen that reads a
/// failed fold back, the folded commits' records stay live until a durable transaction of this
/// handle has synced (here `sync_file`, which the writer runs once the journal is three
/// quarters full and nothing waits to be folded).
#[test]
fn records_read_back_as_folded_stay_live_until_a_durable_transaction_syncs() {
    let dir = tempfile::tempdir().unwrap();
    let mode = (Durability::Immediate, 1, true);
    let (_, mut store, _faults) = with_a_failed_fold(dir.path(), mode, Landed::Volatile);
    store.checkpoint().unwrap();
    assert!(!store.has_unfolded().unwrap(), "the fold is read back");
    assert!(store.journal_use().0 > 0, "its records are still live");
    store.sync_file().unwrap();
    assert_eq!(
        store.journal_use().0,
        0,
        "freed once a durable transaction synced"
    );
}

/// A batch larger than the journal goes into the file durably; its fsync fails, so its redo is
/// kept (`unconfirmed`) for `confirm_landed`. The reopen shows it did not land, and the retry
/// lands through the journal at the same sequence number, acknowledged, then folded. A later
/// journal fsync fails after its record landed, and `confirm_landed` applied the stale redo at
/// its old number: the batch counted twice (its `log` record back beside its fold), a newer
/// outbox entry overwritten. A redo now applies at most once: any commit that lands at or past
/// its number clears it.
#[test]
fn a_failed_durable_commit_redo_is_never_applied_after_a_retry_landed() {
    let dir = tempfile::tempdir().unwrap();
    let s = StoreSettings {
        outbox_max_entries: 100,
        ..small_journal(&dir.path().join("redo.redb"))
    };
    let faults = Arc::new(Faults::default());
    let mut store = Store::open_with_faults(&s, Some(faults.clone())).unwrap();
    store.commit(&batch(&[("a/t", 10, 1.0)])).unwrap();
    store.checkpoint().unwrap();
    // Larger than the whole journal: values that do not compress, 40,000 of them.
    let readings: Vec<(i64, f64)> = (0..40_000i64)
        .map(|k| {
            (
                HOUR * 1_000_000_000 + k * 1_000_003,
                (k as f64).sqrt() * 1.37,
            )
        })
        .collect();
    let big = raw_batch("big/t", &readings);
    faults.arm_power_cut(u64::MAX, Cut::Nothing);
    faults.fail_sync_landing(0, Landed::Nothing);
    let seq = store.next_seq();
    assert!(
        store.commit(&big).is_err(),
        "the durable commit's fsync fails"
    );
    store.reopen().unwrap();
    assert_eq!(store.next_seq(), seq, "it did not land");
    // The retry (here a batch that fits the journal) lands at that number.
    store.commit(&batch(&[("c/t", 2 * HOUR, 3.0)])).unwrap();
    store.checkpoint().unwrap();
    // A journal fsync fails after its record reached the disk: the reopen replays it, and the
    // writer makes sure the commit is durable before it acknowledges it.
    faults.fail_sync_landing(0, Landed::All);
    assert!(store.commit(&batch(&[("d/t", 3 * HOUR, 4.0)])).is_err());
    store.reopen().unwrap();
    assert!(store.next_seq() > seq + 1, "the failed commit landed");
    store.confirm_landed().unwrap();
    let want: BTreeMap<_, _> = [
        (("a/t".to_owned(), 0), (1, 1.0)),
        (("c/t".to_owned(), 2 * HOUR), (1, 3.0)),
        (("d/t".to_owned(), 3 * HOUR), (1, 4.0)),
    ]
    .into();
    assert_eq!(totals_of(&store.reader()), want, "counted once each");
    assert_eq!(outbox_totals(&store.reader()), want, "outbox");
    store
        .checkpoint()
        .expect("every waiting commit is in a run and folds");
    drop(store);
    let store = Store::open(&s).unwrap();
    assert_eq!(totals_of(&store.reader()), want, "after a restart");
    assert_eq!(
        outbox_totals(&store.reader()),
        want,
        "outbox after a restart"
    );
}

/// A commit too large for a journal that commits wait in is refused with `Unfolded` ("retried
/// after the next checkpoint"); the writer stopped on it instead. Every error whose message
/// promises a retry is one a retry may clear, and damage is not.
#[test]
fn every_commit_error_a_retry_can_clear_is_retried() {
    let io = || std::io::Error::from_raw_os_error(5);
    let cases = [
        (CommitError::Unfolded, true),
        (CommitError::Closed, true),
        (CommitError::Journal(io()), true),
        (CommitError::Redb(redb::Error::Io(io())), true),
        (
            CommitError::Redb(redb::Error::Corrupted("a page".into())),
            false,
        ),
        (
            CommitError::Page {
                series_id: 1,
                start: 0,
                page_no: 0,
            },
            false,
        ),
    ];
    for (e, retryable) in cases {
        assert_eq!(e.retryable(), retryable, "{e}");
        assert_eq!(e.is_damage(), !retryable, "{e}");
        if e.to_string().contains("retried") {
            assert!(e.retryable(), "says it is retried: {e}");
        }
    }
}

/// The log's byte count only schedules checkpoints: a count that drifted to 0 with a record in
/// the `log` table (a commit made without the journal) ended the checkpoint before it folded
/// anything, and the record waited for ever. The checkpoint asks the state instead.
#[test]
fn a_drifted_log_count_does_not_end_a_checkpoint_before_a_logged_record() {
    let dir = tempfile::tempdir().unwrap();
    let s = StoreSettings {
        journal_bytes: 0,
        ..settings(&dir.path().join("drift.redb"))
    };
    let mut store = Store::open(&s).unwrap();
    store.commit(&batch(&[("a/t", 10, 1.0)])).unwrap();
    assert!(store.has_unfolded().unwrap());
    store.commits.log_bytes = 0;
    store.checkpoint().unwrap();
    assert!(!store.has_unfolded().unwrap(), "folded");
    assert_eq!(store.recount_log_bytes(), 0);
    drop(store);
    let store = Store::open(&s).unwrap();
    assert_eq!(
        totals_of(&store.reader()),
        [(("a/t".to_owned(), 0), (1, 1.0))].into()
    );
}

/// A small filesystem of the test's own (tmpfs), unmounted when dropped; `None` where the test
/// cannot mount (not root, or no `CAP_SYS_ADMIN`).
struct SmallDisk(std::path::PathBuf, #[allow(dead_code)] tempfile::TempDir);

impl SmallDisk {
    fn mount(bytes: u64) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        mounted.then(|| SmallDisk(dir.path().to_owned(), dir))
    }

    /// Bytes free on it.
    fn free(&self) -> u64 {
        let out = std::process::Command::new("df")
            .args(["-B1", "--output=avail"])
            .arg(&self.0)
            .output()
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        text.lines().nth(1).unwrap().trim().parse().unwrap()
    }

    /// Fills it until `left` bytes are free.
    fn fill_to(&self, left: u64) {
        let filler = self.0.join("filler");
        let now = std::fs::metadata(&filler).map_or(0, |m| m.len());
        let grow = self.free().saturating_sub(left);
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&filler)
            .unwrap();
        let chunk = vec![1u8; 4096];
        let mut written = 0;
        while written < grow {
            let n = chunk.len().min(usize::try_from(grow - written).unwrap());
            std::io::Write::write_all(&mut &f, &chunk[..n]).unwrap();
            written += n as u64;
        }
        f.sync_all().unwrap();
        assert!(std::fs::metadata(&filler).unwrap().len() >= now);
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// `store.journal_size` changed on a nearly full card: the old journal was kept as `.old` and
/// the new one failed with "no space" at every start, with a message that did not say the
/// `.old` was safe to remove. Now the start removes it (its commits are in the file, synced
/// first) and goes on; where that is not enough, the message says how much room is needed.
#[test]
fn a_changed_journal_size_on_a_full_disk_removes_the_old_journal_and_starts() {
    let Some(disk) = SmallDisk::mount(8 << 20) else {
        eprintln!("not run: mounting a small tmpfs needs root (CAP_SYS_ADMIN)");
        return;
    };
    let path = disk.0.join("full.redb");
    let old = StoreSettings {
        journal_bytes: 2 << 20,
        ..settings(&path)
    };
    let mut store = Store::open(&old).unwrap();
    store.commit(&batch(&[("a/t", 10, 1.0)])).unwrap();
    // Unclean: the commit is in the journal alone.
    drop(store);
    let journal = journal_path(&path);
    let set_aside = journal::replaced_path(&journal);
    // Room for less than the new journal, but enough once the old one is gone.
    let new = StoreSettings {
        journal_bytes: 3 << 20,
        ..settings(&path)
    };
    disk.fill_to((3 << 20) - (1 << 20));
    let store = Store::open(&new).unwrap();
    assert!(!set_aside.exists(), "the old journal made room");
    assert_eq!(std::fs::metadata(&journal).unwrap().len(), 3 << 20);
    assert_eq!(
        totals_of(&store.reader()),
        [(("a/t".to_owned(), 0), (1, 1.0))].into()
    );
    drop(store);
    // Far too little room, with a `.old` again (set aside by this start): refused, saying so.
    let larger = StoreSettings {
        journal_bytes: 6 << 20,
        ..settings(&path)
    };
    disk.fill_to(1 << 20);
    let e = Store::open(&larger).err().expect("no room");
    let message = e.to_string();
    assert!(message.contains("no room to make the journal"), "{message}");
    assert!(message.contains("journal_size"), "{message}");
    assert!(message.contains("even after removing"), "{message}");
    let store = Store::open(&new).unwrap_or_else(|e| panic!("the old size still starts: {e}"));
    assert_eq!(
        totals_of(&store.reader()),
        [(("a/t".to_owned(), 0), (1, 1.0))].into()
    );
}
