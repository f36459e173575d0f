//! The writer thread: the only place that writes to redb. It takes one [`Batch`] at a time,
//! commits it in one durable write transaction, and reports back; the ingest task acknowledges
//! the batch's messages only on `Ok`. redb is blocking, so this is an OS thread, not a task.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::batcher::Batch;
use crate::metrics::Metrics;
use crate::stats::Stats;
use crate::store::{CommitError, CommitStats, Store};

/// The result of one commit.
#[derive(Debug, Clone, Copy)]
pub struct Committed {
    pub stats: CommitStats,
    pub readings: usize,
    pub took: Duration,
}

pub struct Writer {
    /// Capacity 1: one batch at the writer at a time; the ingest task only sends when it has
    /// no commit outstanding, so this never fills.
    pub batches: mpsc::Sender<Batch>,
    /// One result per batch, in order.
    pub results: mpsc::Receiver<Result<Committed, CommitError>>,
}

/// Starts the writer thread. It runs until the batch sender is dropped or a commit fails, and
/// hands the store back when it ends.
pub fn spawn(
    mut store: Store,
    stats: Arc<Stats>,
    metrics: Arc<Metrics>,
) -> (Writer, std::thread::JoinHandle<Store>) {
    let (batch_tx, mut batch_rx) = mpsc::channel::<Batch>(1);
    let (result_tx, result_rx) = mpsc::channel(1);
    let thread = std::thread::Builder::new()
        .name("bucketd-writer".into())
        .spawn(move || {
            while let Some(batch) = batch_rx.blocking_recv() {
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
