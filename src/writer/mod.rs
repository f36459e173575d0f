//! The writer thread: the only place that writes to redb. It takes one [`Batch`] at a time,
//! appends it to the commit log (durable through the journal, `store::journal`), and reports
//! back; the ingest task acknowledges the batch's messages only on `Ok`. Between batches it runs
//! checkpoints (every `store.checkpoint_interval`, or once the log holds
//! `store.checkpoint_bytes`, or a journal three quarters full: the log folded into the bucket
//! documents, and the file made durable; `limits::CHECKPOINT_PART_BUCKETS` documents a part,
//! with the batches that come meanwhile committed between the parts, so that no checkpoint
//! holds up commits for long) and, right after a checkpoint, retention: bounded passes that
//! delete expired raw pages and buckets, so neither holds up a commit for long. When the batches end (shutdown) the file is made durable, so
//! that it holds everything on its own. redb is blocking, so this is an OS thread, not a task.
//!
//! A commit that fails on I/O (a full disk, a failing card) is retried, after reopening the
//! file, with a capped backoff until it lands: the ingest task keeps filling the next batch up
//! to `max_pending_readings` and then stops reading, so the broker holds the rest. Nothing is
//! acknowledged meanwhile. Only shutdown ends the retries; the batch is then left to the
//! broker, which redelivers it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::batcher::{Batch, Committed};
use crate::config::{Checkpoint, Retention};
use crate::metrics::Metrics;
use crate::reading::Timestamp;
use crate::stats::Stats;
use crate::store::{CommitError, CommitStats, Store};

mod schedule;

use self::schedule::{Fold, Schedule, Step};

pub struct Writer {
    /// Capacity 1: one batch at the writer at a time; the ingest task only sends when it has
    /// no commit outstanding, so this never fills.
    pub batches: mpsc::SyncSender<Batch>,
    /// One result per batch, in order.
    pub results: tokio::sync::mpsc::Receiver<Result<Committed, CommitError>>,
}

/// First and longest wait before reopening the file after a failed commit.
pub const RETRY_DELAY_MIN: Duration = Duration::from_millis(100);
pub const RETRY_DELAY_MAX: Duration = Duration::from_secs(10);

/// When the writer does its upkeep, from `[store]`.
#[derive(Debug, Clone, Copy)]
pub struct Upkeep {
    pub checkpoint: Checkpoint,
    pub retention: Retention,
}

/// Starts the writer thread. It runs until the batch sender is dropped or a commit fails for
/// good (see the module docs), and hands the store back when it ends. `cancel` (shutdown) ends
/// commit retries.
pub fn spawn(
    store: Store,
    stats: Arc<Stats>,
    metrics: Arc<Metrics>,
    upkeep: Upkeep,
    cancel: CancellationToken,
) -> (Writer, std::thread::JoinHandle<Store>) {
    let (batch_tx, batch_rx) = mpsc::sync_channel::<Batch>(1);
    let (result_tx, result_rx) = tokio::sync::mpsc::channel(1);
    let mut thread = Thread {
        store,
        stats,
        metrics,
        retention: upkeep.retention,
        schedule: Schedule::new(upkeep.checkpoint, upkeep.retention.interval, Instant::now()),
        cancel,
    };
    let thread = std::thread::Builder::new()
        .name("bucketd-writer".into())
        .spawn(move || {
            thread.run(&batch_rx, &result_tx);
            thread.store
        })
        // At start, before anything is ingested: the daemon cannot run without its writer.
        .expect("the OS refused a thread at start (out of memory or threads)");
    let writer = Writer {
        batches: batch_tx,
        results: result_rx,
    };
    (writer, thread)
}

/// The writer thread's state.
struct Thread {
    store: Store,
    stats: Arc<Stats>,
    metrics: Arc<Metrics>,
    retention: Retention,
    schedule: Schedule,
    cancel: CancellationToken,
}

impl Thread {
    /// Takes batches and does the upkeep between them until the batches end or a commit or a
    /// checkpoint fails for good.
    fn run(
        &mut self,
        batches: &mpsc::Receiver<Batch>,
        results: &tokio::sync::mpsc::Sender<Result<Committed, CommitError>>,
    ) {
        self.stats
            .log_bytes
            .store(self.store.log_bytes(), Ordering::Relaxed);
        loop {
            if self
                .schedule
                .fold_due(Instant::now(), self.store.log_bytes())
            {
                let fold = run_checkpoint(&mut self.store, &self.stats, &self.metrics);
                if self.schedule.folded(fold, Instant::now()) == Step::Stop {
                    break;
                }
            }
            let (used, room) = self.store.journal_use();
            if self
                .schedule
                .journal_filling(used, room, self.store.log_bytes(), Instant::now())
                && let Err(e) = self.store.sync_file()
            {
                // A failure changes nothing: the next commit finds the journal full and
                // commits durably in the file, or fails and reopens.
                warn!(error = %e, "Could not make the database file durable; retrying later.");
            }
            let batch = match batches.recv_timeout(self.schedule.wait(Instant::now())) {
                Ok(batch) => batch,
                Err(RecvTimeoutError::Timeout) => {
                    if self.schedule.pass_due(Instant::now()) && self.retention_pass() == Step::Stop
                    {
                        break;
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // Shutdown: the file alone then holds every commit (for `bucketd export`,
                    // a copy, a downgrade). On failure the journal keeps them for the next start.
                    if let Err(e) = self.store.sync_file() {
                        warn!(
                            error = %e,
                            "Could not make the database file durable at shutdown; the \
                             journal keeps every commit and the next start applies them."
                        );
                    }
                    break;
                }
            };
            let result = self.commit(&batch);
            let failed = result.is_err();
            if results.blocking_send(result).is_err() || failed {
                // The ingest side is gone, or the batch could not be committed for good.
                break;
            }
        }
    }

    /// A retention pass, after folding the log first when it touches what the pass may
    /// delete (otherwise the fold would rewrite what the last seconds touched for nothing).
    fn retention_pass(&mut self) -> Step {
        let (raw_before, buckets_before) = retention_cutoffs(self.retention);
        let fold_first = self
            .store
            .log_reaches_before(raw_before.max(buckets_before))
            .unwrap_or_else(|e| {
                warn!(error = %e, "Could not read the commit log; folding it first.");
                true
            });
        if fold_first {
            let fold = run_checkpoint(&mut self.store, &self.stats, &self.metrics);
            let step = self.schedule.folded_before_pass(fold, Instant::now());
            if step != Step::Go {
                return step;
            }
        }
        let more = expire(&mut self.store, &self.stats, self.retention)
            .inspect_err(|e| {
                // A failed pass changes nothing; commits go on, and a failing store shows up in
                // the next commit.
                warn!(error = %e, "Retention pass failed; retrying later.");
            })
            .ok();
        self.schedule.passed(more, Instant::now());
        Step::Go
    }

    /// Commits `batch` (retrying, `commit_retrying`) and updates the counters.
    fn commit(&mut self, batch: &Batch) -> Result<Committed, CommitError> {
        let started = Instant::now();
        let store = &mut self.store;
        let result = commit_retrying(store, batch, &self.stats, &self.cancel).map(|s| Committed {
            buckets: s.buckets_written,
            readings: batch.readings,
            took: started.elapsed(),
            forgotten: store.take_forgotten(),
        });
        if let Ok(c) = &result {
            let stats = &self.stats;
            self.metrics.record_commit(c.took, c.readings);
            stats.flushes.fetch_add(1, Ordering::Relaxed);
            stats
                .buckets_written
                .fetch_add(c.buckets as u64, Ordering::Relaxed);
            stats
                .readings_ingested
                .fetch_add(c.readings as u64, Ordering::Relaxed);
            stats
                .series
                .store(store.series_count() as u64, Ordering::Relaxed);
            stats
                .store_bytes
                .store(store.file_bytes(), Ordering::Relaxed);
            stats.log_bytes.store(store.log_bytes(), Ordering::Relaxed);
        }
        result
    }
}

/// Commits `batch`; on an I/O error reopens the file and tries again, with a capped backoff,
/// until it lands or `cancel`. Errors that a retry cannot fix (an unreadable stored document)
/// return at once.
fn commit_retrying(
    store: &mut Store,
    batch: &Batch,
    stats: &Stats,
    cancel: &CancellationToken,
) -> Result<CommitStats, CommitError> {
    let mut delay = RETRY_DELAY_MIN;
    let mut attempt = 1u32;
    // The batch's sequence number: a commit that did not land leaves it the next one.
    let seq = store.next_seq();
    let mut err = match retryable(store.commit(batch))? {
        Ok(s) => return Ok(s),
        Err(e) => e,
    };
    loop {
        stats.commit_errors.fetch_add(1, Ordering::Relaxed);
        let first = !stats.store_failing.swap(true, Ordering::Relaxed);
        if first {
            error!(
                error = %err,
                path = %store.path().display(),
                readings = batch.readings,
                "Commit failed; its messages stay unacknowledged and the broker keeps them. \
                 Retrying; if the disk is full, free space on it."
            );
        } else {
            warn!(error = %err, attempt, retry_in = ?delay, "Commit failed again; retrying.");
        }
        // Reopen (redb refuses every call after an I/O error until then), then learn whether
        // the failed commit landed after all.
        loop {
            if sleep_unless_cancelled(delay, cancel) {
                return Err(err);
            }
            delay = (delay * 2).min(RETRY_DELAY_MAX);
            match store.reopen() {
                Ok(()) => break,
                Err(e) => warn!(error = %e, retry_in = ?delay, "Could not reopen the database."),
            }
        }
        attempt += 1;
        let outcome = if store.next_seq() > seq {
            // The file shows it, but perhaps from the page cache alone: it is acknowledged
            // only once its writes are durable (applied again, or by the journal's replay).
            retryable(store.confirm_landed().map(|()| CommitStats::default()))?.inspect(|_| {
                info!(
                    "The failed commit is in the file after all, and now durable; not applying \
                     it twice."
                );
            })
        } else {
            retryable(store.commit(batch))?
        };
        match outcome {
            Ok(s) => {
                info!(attempt, "Commit succeeded again; the store is writable.");
                stats.store_failing.store(false, Ordering::Relaxed);
                return Ok(s);
            }
            Err(e) => err = e,
        }
    }
}

/// A commit's outcome, with the errors a retry after reopening may fix (a full disk, an I/O
/// error) inside and the others (damage) out.
fn retryable(
    result: Result<CommitStats, CommitError>,
) -> Result<Result<CommitStats, CommitError>, CommitError> {
    match result {
        Ok(s) => Ok(Ok(s)),
        Err(e) if e.is_damage() => Err(e),
        Err(e @ (CommitError::Redb(_) | CommitError::Closed | CommitError::Journal(_))) => {
            Ok(Err(e))
        }
        Err(e) => Err(e),
    }
}

/// Sleeps for `d`, waking early on `cancel`. Returns whether it was cancelled.
fn sleep_unless_cancelled(d: Duration, cancel: &CancellationToken) -> bool {
    const STEP: Duration = Duration::from_millis(50);
    let until = Instant::now() + d;
    loop {
        if cancel.is_cancelled() {
            return true;
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        std::thread::sleep(left.min(STEP));
    }
}

/// Folds a part of the commit log (`limits::CHECKPOINT_PART_BUCKETS` documents) into the bucket documents,
/// if it holds anything (see [`Fold`]). A failure changes nothing; a failing store shows up in
/// the next commit too, which reopens it.
fn run_checkpoint(store: &mut Store, stats: &Stats, metrics: &Metrics) -> Fold {
    if store.log_bytes() == 0 && !store.has_unfolded().unwrap_or(true) {
        return Fold::Done;
    }
    tracing::debug!(log_bytes = store.log_bytes(), "Checkpoint starting.");
    let started = Instant::now();
    match store.checkpoint_part(crate::limits::CHECKPOINT_PART_BUCKETS) {
        Ok(c) => {
            let took = started.elapsed();
            metrics.record_checkpoint(took);
            stats.checkpoints.fetch_add(1, Ordering::Relaxed);
            stats.log_bytes.store(store.log_bytes(), Ordering::Relaxed);
            stats
                .store_bytes
                .store(store.file_bytes(), Ordering::Relaxed);
            tracing::debug!(
                records = c.records,
                buckets = c.buckets_written,
                new_buckets = c.buckets_created,
                log_bytes = c.bytes,
                took_ms = took.as_millis(),
                more = c.more,
                "Checkpoint: folded the commit log into the bucket documents."
            );
            if c.more { Fold::More } else { Fold::Done }
        }
        Err(e) if e.is_damage() => {
            error!(
                error = %e,
                path = %store.path().display(),
                "The database file is damaged: a checkpoint cannot fold the commits past this \
                 key, so bucketd stops rather than hold them in memory for ever. Every \
                 acknowledged reading is in the file or its journal. Stop the service, keep a \
                 copy of both files, and restore the database file from a backup (or move both \
                 aside to start a new one); `bucketd export --db FILE` reads what is undamaged."
            );
            Fold::Damaged
        }
        Err(e) => {
            stats.checkpoint_errors.fetch_add(1, Ordering::Relaxed);
            warn!(
                error = %e,
                log_bytes = store.log_bytes(),
                "Checkpoint failed; the commit log stays (reads include it). Retrying later; if \
                 the disk is full, free space on it."
            );
            Fold::Failed
        }
    }
}

/// Retention's cutoffs now, seconds: raw pages of buckets starting before the first, and
/// buckets starting before the second, are due.
fn retention_cutoffs(r: Retention) -> (i64, i64) {
    let now = Timestamp::now();
    let cutoff = |keep: Duration| {
        now.saturating_sub(keep)
            .as_nanos()
            .div_euclid(1_000_000_000)
    };
    (cutoff(r.raw), cutoff(r.buckets))
}

/// One bounded retention pass. Returns whether more is due.
fn expire(store: &mut Store, stats: &Stats, r: Retention) -> Result<bool, CommitError> {
    let (raw_before, buckets_before) = retention_cutoffs(r);
    let expired = store.expire(raw_before, buckets_before, r.batch);
    // The pass folds what is left of the log first (after a failed part, all of it).
    stats.log_bytes.store(store.log_bytes(), Ordering::Relaxed);
    let expired = expired?;
    if expired.pages + expired.buckets > 0 {
        stats
            .series
            .store(store.series_count() as u64, Ordering::Relaxed);
        stats
            .pages_expired
            .fetch_add(expired.pages as u64, Ordering::Relaxed);
        stats
            .buckets_expired
            .fetch_add(expired.buckets as u64, Ordering::Relaxed);
        stats
            .store_bytes
            .store(store.file_bytes(), Ordering::Relaxed);
        info!(
            pages = expired.pages,
            buckets = expired.buckets,
            series = expired.series,
            more = expired.more,
            "Deleted expired data."
        );
    }
    Ok(expired.more)
}

#[cfg(test)]
mod tests {
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
            while stats.checkpoints.load(Ordering::Relaxed) == 0
                || stats.log_bytes.load(Ordering::Relaxed) > 0
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
}
