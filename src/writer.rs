//! The writer thread: the only place that writes to redb. It takes one [`Batch`] at a time,
//! commits it in one durable write transaction, and reports back; the ingest task acknowledges
//! the batch's messages only on `Ok`. Between batches it runs retention: bounded passes that
//! delete expired raw pages and buckets, so a pass never holds up a commit for long. redb is
//! blocking, so this is an OS thread, not a task.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::batcher::Batch;
use crate::metrics::Metrics;
use crate::reading::Timestamp;
use crate::stats::Stats;
use crate::store::{CommitError, CommitStats, Store};

/// The result of one commit.
#[derive(Debug, Clone, Copy)]
pub struct Committed {
    pub stats: CommitStats,
    pub readings: usize,
    pub took: Duration,
}

/// Retention settings, from `[store]`.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    pub raw: Duration,
    pub buckets: Duration,
    /// Time between passes while nothing is expired.
    pub interval: Duration,
    /// Most pages and buckets deleted by one pass (one write transaction).
    pub batch: usize,
}

pub struct Writer {
    /// Capacity 1: one batch at the writer at a time; the ingest task only sends when it has
    /// no commit outstanding, so this never fills.
    pub batches: mpsc::SyncSender<Batch>,
    /// One result per batch, in order.
    pub results: tokio::sync::mpsc::Receiver<Result<Committed, CommitError>>,
}

/// Starts the writer thread. It runs until the batch sender is dropped or a commit fails, and
/// hands the store back when it ends.
pub fn spawn(
    mut store: Store,
    stats: Arc<Stats>,
    metrics: Arc<Metrics>,
    retention: Retention,
) -> (Writer, std::thread::JoinHandle<Store>) {
    let (batch_tx, batch_rx) = mpsc::sync_channel::<Batch>(1);
    let (result_tx, result_rx) = tokio::sync::mpsc::channel(1);
    let thread = std::thread::Builder::new()
        .name("bucketd-writer".into())
        .spawn(move || {
            // The first pass runs soon after start, then every interval (sooner while a pass
            // leaves work behind).
            let mut next_pass = Instant::now() + Duration::from_secs(1).min(retention.interval);
            loop {
                let wait = next_pass.saturating_duration_since(Instant::now());
                let batch = match batch_rx.recv_timeout(wait) {
                    Ok(batch) => batch,
                    Err(RecvTimeoutError::Timeout) => {
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
                    Err(RecvTimeoutError::Disconnected) => break,
                };
                let started = Instant::now();
                let result = store.commit(&batch).map(|s| Committed {
                    stats: s,
                    readings: batch.readings,
                    took: started.elapsed(),
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
                }
                if result_tx.blocking_send(result).is_err() || failed {
                    // The ingest side is gone, or redb refuses writes until reopened.
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

/// One bounded retention pass. Returns whether more is due.
fn expire(store: &mut Store, stats: &Stats, r: Retention) -> Result<bool, CommitError> {
    let now = Timestamp::now();
    let cutoff = |keep: Duration| {
        now.saturating_sub(keep)
            .as_nanos()
            .div_euclid(1_000_000_000)
    };
    let expired = store.expire(cutoff(r.raw), cutoff(r.buckets), r.batch)?;
    if expired.pages + expired.buckets > 0 {
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
            more = expired.more,
            "Deleted expired data."
        );
    }
    Ok(expired.more)
}
