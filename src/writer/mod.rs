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
            let store = &self.store;
            // Unknown (the file refuses a read): fold, which reopens it first.
            let unfolded = || store.has_unfolded().unwrap_or(true);
            if self
                .schedule
                .journal_filling(used, room, unfolded, Instant::now())
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
        Err(e) if e.retryable() => Ok(Err(e)),
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
            // What the part's transaction held (its buckets' documents, redb's dirty pages)
            // goes back to the system, not to a heap that keeps it for the next part.
            crate::metrics::release_free_memory();
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
mod tests;
