use super::*;
use crate::config::{Checkpoint, Durability};
use crate::store::{Faults, Landed, StoreSettings};

fn settings(path: &std::path::Path) -> StoreSettings {
    StoreSettings {
        path: path.to_owned(),
        bucket_width_secs: 3600,
        durability: Durability::Immediate,
        quick_repair: true,
        cache_bytes: 1 << 20,
        page_capacity: 1000,
        dedup_window: 64,
        outbox_max_entries: 0,
        journal_bytes: 8 << 20,
    }
}

fn one_reading(series: &str, secs: i64) -> Batch {
    let mut b = crate::batcher::Batcher::by_hand();
    b.push_reading(
        Arc::from(series),
        Timestamp::from_secs(secs),
        1.0,
        true,
        Instant::now(),
    );
    b.take().0
}

/// A writer that checkpoints whenever anything is logged (1 byte), retention never.
fn eager(store: Store, stats: Arc<Stats>) -> (Writer, std::thread::JoinHandle<Store>) {
    spawn(
        store,
        stats,
        Arc::new(Metrics::new()),
        Upkeep {
            checkpoint: Checkpoint {
                interval: Duration::from_hours(1),
                bytes: 1,
            },
            retention: Retention {
                raw: Duration::from_hours(24 * 365 * 100),
                buckets: Duration::from_hours(24 * 365 * 100),
                interval: Duration::from_hours(1),
                batch: 1000,
            },
        },
        CancellationToken::new(),
    )
}

/// Issue 42: after a failed fsync, the commit was taken for landed when the reopened file
/// showed it, although that came from the page cache (Linux keeps a failed fsync's pages,
/// marked clean: they may never reach the disk). Now such a commit is applied again in a
/// transaction that commits durably before it counts: after the power fails, the file
/// still holds it. Without a journal (every commit a durable redb transaction), both
/// durability settings.
#[test]
fn a_commit_whose_fsync_failed_counts_only_once_it_is_durable() {
    // The first sync of the commit failing leaves it out of the file; the second (after
    // redb wrote its header) leaves it in the page cache only: both are covered. (Without
    // the re-application, the file did not even open after the power cut.)
    for (durability, skip, quick_repair) in crate::store::FAILING_SYNCS {
        let dir = tempfile::tempdir().unwrap();
        let s = StoreSettings {
            journal_bytes: 0,
            durability,
            quick_repair,
            ..settings(&dir.path().join("f.redb"))
        };
        let faults = Arc::new(Faults::default());
        let mut store = Store::open_with_faults(&s, Some(faults.clone())).unwrap();
        store.commit(&one_reading("a/t", 100)).unwrap();
        // Writes wait in the (simulated) page cache; the next fsync fails.
        faults.arm_power_cut(u64::MAX, crate::store::Cut::Nothing);
        faults.fail_sync_after(skip);
        let stats = Stats::new(0);
        commit_retrying(
            &mut store,
            &one_reading("a/t", 200),
            &stats,
            &CancellationToken::new(),
        )
        .expect("committed after the retry");
        assert_eq!(
            Stats::get(&stats.commit_errors),
            1,
            "{durability:?}, sync {skip}, quick repair {quick_repair}"
        );
        // The power fails: what only the page cache held is gone.
        faults.arm_power_cut(1, crate::store::Cut::Nothing);
        let _ = store.commit(&one_reading("a/t", 300));
        drop(store);
        let store = Store::open(&s).unwrap();
        let docs = store.reader().buckets(Some("a/t"), 0, 3600).unwrap();
        assert_eq!(
            docs.iter().map(|d| d.count).sum::<i64>(),
            2,
            "{durability:?}, sync {skip}: the acknowledged commits, once each"
        );
    }
}

/// Issue 51: a failed commit (no journal) that split a leaf wrote new pages for keys it did
/// not change (the half of the leaf its keys did not go to); after a failed fsync those pages
/// were read back from the page cache, and `confirm_landed`, putting again only the commit's
/// own keys, made a durable tree over pages never written. The reopen now reads the file from
/// the disk: after a power cut, every series is there once, the old ones included.
#[test]
fn a_failed_commit_that_split_leaves_counts_once_and_keeps_the_keys_beside_it() {
    for (durability, skip, landed) in [
        (Durability::Immediate, 0, Landed::Nothing),
        (Durability::Immediate, 1, Landed::Nothing),
        (Durability::Immediate, 0, Landed::FirstPage),
        (Durability::TwoPhase, 1, Landed::Nothing),
        (Durability::TwoPhase, 1, Landed::All),
    ] {
        let case = format!("{durability:?}, sync {skip}, {landed:?}");
        let dir = tempfile::tempdir().unwrap();
        let s = StoreSettings {
            journal_bytes: 0,
            durability,
            ..settings(&dir.path().join("split.redb"))
        };
        // Series s0000/t .. s0399/t, then a few whose names fall between them: each goes
        // into a full leaf of the names' table, which splits into a half with the new name
        // and a half of old names only (a new page all the same).
        let batch_of = |names: &mut dyn Iterator<Item = String>| {
            let mut b = crate::batcher::Batcher::by_hand();
            for name in names {
                let at = Timestamp::from_secs(100);
                b.push_reading(Arc::from(name), at, 1.0, true, Instant::now());
            }
            b.take().0
        };
        let faults = Arc::new(Faults::default());
        let mut store = Store::open_with_faults(&s, Some(faults.clone())).unwrap();
        store
            .commit(&batch_of(&mut (0..400).map(|i| format!("s{i:04}/t"))))
            .unwrap();
        faults.arm_power_cut(u64::MAX, crate::store::Cut::Nothing);
        faults.fail_sync_landing(skip, landed);
        let stats = Stats::new(0);
        let between = batch_of(&mut (0..400).step_by(40).map(|i| format!("s{i:04}x/t")));
        commit_retrying(&mut store, &between, &stats, &CancellationToken::new())
            .expect("committed after the retry");
        assert_eq!(Stats::get(&stats.commit_errors), 1, "{case}");
        faults.arm_power_cut(1, crate::store::Cut::Nothing);
        let _ = store.commit(&one_reading("c/t", 300));
        drop(store);
        let store = Store::open(&s).unwrap_or_else(|e| panic!("{case}: {e}"));
        let docs = store.reader().buckets(None, 0, 3600).unwrap();
        let series: std::collections::BTreeSet<&str> =
            docs.iter().map(|d| d.series.as_str()).collect();
        assert_eq!(
            series.len(),
            410,
            "{case}: the cut commit of c/t is not there"
        );
        assert!(docs.iter().all(|d| d.count == 1), "{case}: once each");
    }
}

/// Issue 51: the journal's fsync of a commit's record fails. Whether or not the record
/// reached the disk (the kernel may have written it before the error), the reopen reads the
/// journal back from the disk, not from the page cache that still shows the record: a record
/// only the cache held is committed again, one on the disk is applied by the replay's
/// durable transaction. After a power cut, the commit counts once either way.
#[test]
fn a_commit_whose_journal_fsync_failed_counts_once_whether_or_not_its_record_landed() {
    for landed in [Landed::Nothing, Landed::All] {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(&dir.path().join("j.redb"));
        let faults = Arc::new(Faults::default());
        let mut store = Store::open_with_faults(&s, Some(faults.clone())).unwrap();
        store.commit(&one_reading("a/t", 100)).unwrap();
        faults.arm_power_cut(u64::MAX, crate::store::Cut::Nothing);
        faults.fail_sync_landing(0, landed);
        let stats = Stats::new(0);
        let cancel = CancellationToken::new();
        commit_retrying(&mut store, &one_reading("a/t", 200), &stats, &cancel)
            .expect("committed after the retry");
        assert_eq!(Stats::get(&stats.commit_errors), 1, "{landed:?}");
        faults.arm_power_cut(1, crate::store::Cut::Nothing);
        let _ = store.checkpoint();
        drop(store);
        let store = Store::open(&s).unwrap();
        let docs = store.reader().buckets(Some("a/t"), 0, 3600).unwrap();
        assert_eq!(docs.iter().map(|d| d.count).sum::<i64>(), 2, "{landed:?}");
    }
}

/// Issue 42: a checkpoint that kept failing was tried again before every batch (the bytes
/// trigger stays met), for ever. A failed checkpoint (here: the database file refuses every
/// write while the journal takes the commits) is tried again only after a backoff, whatever
/// the trigger, and the commits go on.
#[test]
fn a_failing_checkpoint_backs_off_while_commits_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Arc::new(Faults::default());
    let store =
        Store::open_with_faults(&settings(&dir.path().join("b.redb")), Some(faults.clone()))
            .unwrap();
    faults
        .fail_db_writes
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let stats = Arc::new(Stats::new(0));
    let (mut writer, thread) = eager(store, stats.clone());
    let started = Instant::now();
    for i in 0..50 {
        writer.batches.send(one_reading("a/t", 1000 + i)).unwrap();
        let result = writer.results.blocking_recv().expect("a result per batch");
        assert!(result.is_ok(), "commits go on through the journal");
    }
    let attempts = Stats::get(&stats.checkpoint_errors);
    assert!(attempts >= 1, "the checkpoint failed");
    let elapsed = started.elapsed();
    drop(writer);
    faults
        .fail_db_writes
        .store(false, std::sync::atomic::Ordering::Relaxed);
    let store = thread.join().unwrap();
    // From 1 s, doubling: at most a try a second (plus the first), not one per batch.
    let most = 2 + elapsed.as_secs();
    assert!(
        attempts <= most,
        "{attempts} failed tries in {elapsed:?} for 50 batches"
    );
    // Nothing lost: the next open applies the journal.
    drop(store);
    let store = Store::open(&settings(&dir.path().join("b.redb"))).unwrap();
    let docs = store.reader().buckets(Some("a/t"), 0, 3600).unwrap();
    assert_eq!(docs.iter().map(|d| d.count).sum::<i64>(), 50);
}

/// Issue 51: a failed checkpoint was retried on the same handle, which redb refuses for
/// ever after an I/O error: the log only grew until the journal filled (about 34 minutes at
/// default settings) and commits then failed too. Now the file is reopened from the disk
/// before the next try, keeping the journal's commits, so once the disk takes writes again
/// the checkpoint goes through by itself; commits never stop meanwhile.
#[test]
fn a_failed_checkpoint_goes_through_by_itself_once_the_fault_clears() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.redb");
    let faults = Arc::new(Faults::default());
    let store = Store::open_with_faults(&settings(&path), Some(faults.clone())).unwrap();
    faults
        .fail_db_writes
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let stats = Arc::new(Stats::new(0));
    let (mut writer, thread) = eager(store, stats.clone());
    let mut sent = 0;
    let mut send = |writer: &mut Writer| {
        writer
            .batches
            .send(one_reading("a/t", 1000 + sent))
            .unwrap();
        sent += 1;
        let result = writer.results.blocking_recv().expect("a result per batch");
        assert!(
            result.is_ok(),
            "commits go on through the journal: {result:?}"
        );
    };
    for _ in 0..20 {
        send(&mut writer);
    }
    // Two tries at least (the backoff's first wait is 1 s), the journal holding the commits.
    let deadline = Instant::now() + Duration::from_mins(2);
    while Stats::get(&stats.checkpoint_errors) < 2 {
        assert!(
            Instant::now() < deadline,
            "the checkpoint is not tried again"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(Stats::get(&stats.checkpoints), 0);
    faults
        .fail_db_writes
        .store(false, std::sync::atomic::Ordering::Relaxed);
    // The writer's next try (after its backoff) folds everything, with no batch to wake it.
    let deadline = Instant::now() + Duration::from_mins(2);
    while Stats::get(&stats.checkpoints) == 0 || stats.log_bytes.load(Ordering::Relaxed) > 0 {
        assert!(
            Instant::now() < deadline,
            "the checkpoint never went through"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    send(&mut writer);
    drop(writer);
    let store = thread.join().unwrap();
    let docs = store.reader().buckets(Some("a/t"), 0, 3600).unwrap();
    assert_eq!(docs.iter().map(|d| d.count).sum::<i64>(), sent);
    assert_eq!(
        store.journal_use().0,
        0,
        "shutdown made the file hold everything"
    );
}

/// Issue 42: a damaged document made every checkpoint fail, retried for ever, while the
/// log grew without bound. The writer stops at the first such failure, with the damaged key
/// in its log line, and hands the store back (the daemon then exits 1).
#[test]
fn a_damaged_document_stops_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(&settings(&dir.path().join("d.redb"))).unwrap();
    store.commit(&one_reading("a/t", 100)).unwrap();
    store.checkpoint().unwrap();
    store.damage_bucket("a/t", 0);
    let stats = Arc::new(Stats::new(0));
    let (mut writer, thread) = eager(store, stats);
    writer.batches.send(one_reading("a/t", 200)).unwrap();
    assert!(writer.results.blocking_recv().unwrap().is_ok());
    // The next round's checkpoint meets the damage: the writer ends by itself.
    let deadline = Instant::now() + Duration::from_mins(1);
    while !thread.is_finished() {
        assert!(Instant::now() < deadline, "the writer goes on");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        writer.results.blocking_recv().is_none(),
        "no more results: the writer has stopped"
    );
    let store = thread.join().unwrap();
    assert!(
        store.log_bytes() > 0,
        "what it could not fold stays in the journal"
    );
}

/// The writer folds a log of more buckets than one part writes to the end, whether the
/// checkpoint interval or the retention pass comes first, and the log gauge follows it to 0:
/// what `bucketd_commit_log_bytes` shows (a retention pass that folded the rest left the
/// gauge at the first part's figure before).
#[test]
fn the_writer_folds_the_whole_log_part_by_part_and_the_gauge_follows() {
    for retention_first in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(&settings(&dir.path().join("w.redb"))).unwrap();
        // A log of 400 commits over 600 series (more than two parts' budget), left by "an
        // earlier run": folded by the writer's first checkpoint (or retention pass).
        for i in 0..400i64 {
            let mut b = crate::batcher::Batcher::by_hand();
            let now = Instant::now();
            for k in 0..100 {
                b.push_reading(
                    std::sync::Arc::from(format!("s{}/t", (i * 100 + k) % 600)),
                    Timestamp::from_nanos((i * 100 + k) * 1_000_000),
                    k as f64,
                    true,
                    now,
                );
            }
            store.commit(&b.take().0).unwrap();
        }
        if retention_first {
            // A reading from 1919, older than the retention below: the pass must fold
            // first (it folds only a log that touches what it may delete), then delete it.
            let mut b = crate::batcher::Batcher::by_hand();
            let old = Timestamp::from_nanos(-1_600_000_000 * 1_000_000_000);
            b.push_reading(Arc::from("old/t"), old, 1.0, true, Instant::now());
            store.commit(&b.take().0).unwrap();
        }
        assert!(store.log_bytes() > 0);
        let stats = Arc::new(Stats::new(0));
        let (interval, pass) = if retention_first {
            (Duration::from_hours(1), Duration::from_millis(1))
        } else {
            (Duration::from_millis(1), Duration::from_hours(1))
        };
        let (writer, thread) = spawn(
            store,
            stats.clone(),
            Arc::new(Metrics::new()),
            Upkeep {
                checkpoint: Checkpoint {
                    interval,
                    bytes: u64::MAX,
                },
                retention: Retention {
                    raw: Duration::from_hours(24 * 365 * 100),
                    buckets: Duration::from_hours(24 * 365 * 100),
                    interval: pass,
                    batch: 1000,
                },
            },
            CancellationToken::new(),
        );
        // A guard against hanging, not a speed bound: under qemu on a busy 2-core CI machine
        // the fold took over a minute (armv7, .ci/arm).
        let deadline = Instant::now() + Duration::from_mins(5);
        // With the pass first, also until it has deleted the 1919 reading: the log is folded
        // (gauge 0) before the pass deletes, and a writer dropped in between never does.
        while stats.checkpoints.load(Ordering::Relaxed) == 0
            || stats.log_bytes.load(Ordering::Relaxed) > 0
            || (retention_first && stats.pages_expired.load(Ordering::Relaxed) == 0)
        {
            assert!(
                Instant::now() < deadline,
                "retention first {retention_first}: the gauge stays above 0"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(writer);
        let store = thread.join().unwrap();
        assert_eq!(store.log_bytes(), 0, "retention first {retention_first}");
        assert!(
            stats.checkpoints.load(Ordering::Relaxed) > 1,
            "retention first {retention_first}: folded in more than one part"
        );
        let mut readings = 0;
        store
            .reader()
            .raw(None, i64::MIN, i64::MAX, |_, r| {
                readings += r.len();
                true
            })
            .unwrap();
        assert_eq!(readings, 400 * 100, "retention first {retention_first}");
    }
}
