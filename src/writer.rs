//! The writer thread: the only place that writes to redb. It takes one [`Batch`] at a time,
//! appends it to the commit log (durable through the journal, `store::journal`), and reports
//! back; the ingest task acknowledges the batch's messages only on `Ok`. Between batches it runs
//! checkpoints (every `store.checkpoint_interval`, or once the log holds
//! `store.checkpoint_bytes`: the log folded into the bucket documents, and the file made durable;
//! a log that takes longer than `limits::CHECKPOINT_PART_TIME` to fold part by part, with the batches that come
//! meanwhile committed between the parts, so that no checkpoint holds up commits for long)
//! and, right after a checkpoint, retention: bounded passes that delete expired raw pages and
//! buckets, so neither holds up a commit for long. A journal three quarters full is emptied by
//! making the file durable early. When the batches end (shutdown) the file is made durable, so
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

use crate::batcher::Batch;
use crate::config::{Checkpoint, Retention};
use crate::metrics::Metrics;
use crate::reading::Timestamp;
use crate::stats::Stats;
use crate::store::{CommitError, CommitStats, Store};

/// The result of one commit.
#[derive(Debug, Clone)]
pub struct Committed {
    pub stats: CommitStats,
    pub readings: usize,
    pub took: Duration,
    /// Series that retention deleted since the last result (their last bucket expired), for
    /// the ingest side to forget: they no longer count against `limits.max_series`.
    pub forgotten: Vec<Arc<str>>,
}

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
    mut store: Store,
    stats: Arc<Stats>,
    metrics: Arc<Metrics>,
    upkeep: Upkeep,
    cancel: CancellationToken,
) -> (Writer, std::thread::JoinHandle<Store>) {
    let Upkeep {
        checkpoint,
        retention,
    } = upkeep;
    let (batch_tx, batch_rx) = mpsc::sync_channel::<Batch>(1);
    let (result_tx, result_rx) = tokio::sync::mpsc::channel(1);
    let thread = std::thread::Builder::new()
        .name("bucketd-writer".into())
        .spawn(move || {
            // The first pass runs soon after start, then every interval (sooner while a pass
            // leaves work behind).
            let mut next_pass = Instant::now() + Duration::from_secs(1).min(retention.interval);
            // The log a previous run left is folded by the first checkpoint, one interval on.
            let mut next_checkpoint = Instant::now() + checkpoint.interval;
            // A checkpoint is part-way: fold the next part as soon as no batch waits.
            let mut folding = false;
            stats.log_bytes.store(store.log_bytes(), Ordering::Relaxed);
            loop {
                if folding
                    || Instant::now() >= next_checkpoint
                    || store.log_bytes() >= checkpoint.bytes
                {
                    // A failed part changes nothing (one transaction): the log stays, reads
                    // still include it, and the next try comes an interval later.
                    folding = run_checkpoint(&mut store, &stats, &metrics);
                    if !folding {
                        next_checkpoint = Instant::now() + checkpoint.interval;
                    }
                }
                let (journal_used, journal_room) = store.journal_use();
                if journal_used > 0 && journal_used >= journal_room / 4 * 3 {
                    if store.log_bytes() > 0 {
                        // What the journal holds is pending: fold it, part by part, and the
                        // journal starts over once none is left.
                        folding = true;
                    } else if let Err(e) = store.sync_file() {
                        // A failure changes nothing: the next commit finds the journal full
                        // and commits durably in the file, or fails and reopens.
                        warn!(error = %e, "Could not make the database file durable; retrying later.");
                    }
                }
                let wait = if folding {
                    Duration::ZERO
                } else {
                    next_pass
                        .min(next_checkpoint)
                        .saturating_duration_since(Instant::now())
                };
                let batch = match batch_rx.recv_timeout(wait) {
                    Ok(batch) => batch,
                    Err(RecvTimeoutError::Timeout) if folding || Instant::now() < next_pass => {
                        continue;
                    }
                    Err(RecvTimeoutError::Timeout) => {
                        // Retention after a checkpoint: a bucket it deletes cannot come back
                        // from a log entry folded later. The log is folded in parts first,
                        // with batches between them, and the pass waits until it is.
                        folding = run_checkpoint(&mut store, &stats, &metrics);
                        if folding {
                            continue;
                        }
                        next_checkpoint = Instant::now() + checkpoint.interval;
                        next_pass = match expire(&mut store, &stats, retention) {
                            Ok(true) => Instant::now(), // more is due: go on after any batch
                            Ok(false) => Instant::now() + retention.interval,
                            Err(e) => {
                                // A failed pass changes nothing; commits go on, and a failing
                                // store shows up in the next commit.
                                warn!(error = %e, "Retention pass failed; retrying later.");
                                Instant::now() + retention.interval
                            }
                        };
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        // Shutdown: the file alone then holds every commit (for `bucketd export`,
                        // a copy, a downgrade). On failure the journal keeps them for the next start.
                        if let Err(e) = store.sync_file() {
                            warn!(
                                error = %e,
                                "Could not make the database file durable at shutdown; the \
                                 journal keeps every commit and the next start applies them."
                            );
                        }
                        break;
                    }
                };
                let started = Instant::now();
                let result =
                    commit_retrying(&mut store, &batch, &stats, &cancel).map(|s| Committed {
                        stats: s,
                        readings: batch.readings,
                        took: started.elapsed(),
                        forgotten: store.take_forgotten(),
                    });
                let failed = result.is_err();
                if let Ok(c) = &result {
                    metrics.record_commit(c.took, c.readings);
                    stats.flushes.fetch_add(1, Ordering::Relaxed);
                    stats
                        .buckets_written
                        .fetch_add(c.stats.buckets_written as u64, Ordering::Relaxed);
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
                if result_tx.blocking_send(result).is_err() || failed {
                    // The ingest side is gone, or the batch could not be committed for good.
                    break;
                }
            }
            store
        })
        .expect("spawning the writer thread");
    let writer = Writer {
        batches: batch_tx,
        results: result_rx,
    };
    (writer, thread)
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
    loop {
        let seq = store.next_seq();
        let err = match store.commit(batch) {
            Ok(s) => {
                if stats.store_failing.swap(false, Ordering::Relaxed) {
                    info!(attempt, "Commit succeeded again; the store is writable.");
                }
                return Ok(s);
            }
            Err(e @ (CommitError::Redb(_) | CommitError::Closed | CommitError::Journal(_))) => e,
            Err(e) => return Err(e),
        };
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
        if store.next_seq() > seq {
            info!("The failed commit had reached the disk after all; not applying it twice.");
            stats.store_failing.store(false, Ordering::Relaxed);
            return Ok(CommitStats::default());
        }
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

/// Folds a part of the commit log (`limits::CHECKPOINT_PART_TIME` of work) into the bucket documents,
/// if it holds anything, and returns whether more is left. A failure is logged and changes
/// nothing; a failing store shows up in the next commit, which reopens it.
fn run_checkpoint(store: &mut Store, stats: &Stats, metrics: &Metrics) -> bool {
    if store.log_bytes() == 0 {
        return false;
    }
    tracing::debug!(log_bytes = store.log_bytes(), "Checkpoint starting.");
    let started = Instant::now();
    let until = started + crate::limits::CHECKPOINT_PART_TIME;
    match store.checkpoint_part(u64::MAX, Some(until)) {
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
            c.more
        }
        Err(e) => {
            warn!(
                error = %e,
                log_bytes = store.log_bytes(),
                "Checkpoint failed; the commit log stays (reads include it). Retrying later."
            );
            false
        }
    }
}

/// One bounded retention pass. Returns whether more is due.
fn expire(store: &mut Store, stats: &Stats, r: Retention) -> Result<bool, CommitError> {
    let now = Timestamp::now();
    let cutoff = |keep: Duration| {
        now.saturating_sub(keep)
            .as_nanos()
            .div_euclid(1_000_000_000)
    };
    let expired = store.expire(cutoff(r.raw), cutoff(r.buckets), r.batch);
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
    use crate::store::StoreSettings;

    /// The writer folds a log far larger than one part (50 ms of work) to the end, whether the
    /// checkpoint interval or the retention pass comes first, and the log gauge follows it to 0:
    /// what `bucketd_commit_log_bytes` shows (a retention pass that folded the rest left the
    /// gauge at the first part's figure before).
    #[test]
    fn the_writer_folds_the_whole_log_part_by_part_and_the_gauge_follows() {
        for retention_first in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let mut store = Store::open(&StoreSettings {
                path: dir.path().join("w.redb"),
                bucket_width_secs: 3600,
                durability: Durability::Immediate,
                quick_repair: true,
                cache_bytes: 1 << 20,
                page_capacity: 1000,
                dedup_window: 64,
                outbox_max_entries: 0,
                journal_bytes: 8 << 20,
            })
            .unwrap();
            // A log of 400 commits, left by "an earlier run": folded by the writer's first
            // checkpoint (or retention pass).
            for i in 0..400i64 {
                let mut b = crate::batcher::Batcher::by_hand();
                let now = Instant::now();
                for k in 0..100 {
                    b.push_reading(
                        std::sync::Arc::from(format!("s{}/t", k % 50)),
                        Timestamp::from_nanos((i * 100 + k) * 1_000_000),
                        k as f64,
                        true,
                        now,
                    );
                }
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
