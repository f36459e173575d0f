//! Prometheus metrics: every metric's name, unit and help text, the histogram buckets, and
//! rendering. The hot path only moves atomics in [`Stats`]; at scrape time they are copied into
//! a per-daemon Prometheus recorder (through the `metrics` facade with a local recorder, so two
//! daemons in one process, as in the tests, never share counters) and rendered.
//!
//! Naming: prefix `bucketd_`, base units in the name (`_seconds`, `_bytes`), counters end in
//! `_total`. Labels are bounded: a rejection `reason` or a flush `reason`, never a topic or a
//! sensor.

use std::time::Duration;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
    with_local_recorder,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use crate::batcher::FlushReason;
use crate::reject::DecodeError;
use crate::stats::Stats;

pub const MESSAGES_RECEIVED: &str = "bucketd_messages_received_total";
pub const READINGS_INGESTED: &str = "bucketd_readings_ingested_total";
pub const READINGS_REJECTED: &str = "bucketd_readings_rejected_total";
pub const FLUSHES: &str = "bucketd_flushes_total";
pub const FLUSH_DURATION: &str = "bucketd_flush_duration_seconds";
pub const FLUSH_READINGS: &str = "bucketd_flush_readings";
pub const BUCKETS_WRITTEN: &str = "bucketd_buckets_written_total";
pub const CHECKPOINTS: &str = "bucketd_checkpoints_total";
pub const CHECKPOINT_DURATION: &str = "bucketd_checkpoint_duration_seconds";
pub const LOG_BYTES: &str = "bucketd_commit_log_bytes";
pub const PAGES_EXPIRED: &str = "bucketd_pages_expired_total";
pub const BUCKETS_EXPIRED: &str = "bucketd_buckets_expired_total";
pub const PENDING_READINGS: &str = "bucketd_pending_readings";
pub const UNACKED_MESSAGES: &str = "bucketd_unacked_messages";
pub const ACKS_SENT: &str = "bucketd_acks_sent_total";
pub const SERIES: &str = "bucketd_series";
pub const STORE_FILE_SIZE: &str = "bucketd_store_file_size_bytes";
pub const MQTT_CONNECTED: &str = "bucketd_mqtt_connected";
pub const MQTT_RECONNECTS: &str = "bucketd_mqtt_reconnects_total";
pub const MQTT_CONNECTION_ERRORS: &str = "bucketd_mqtt_connection_errors_total";
pub const DUPLICATES: &str = "bucketd_duplicates_total";
pub const CONTROL_MESSAGES: &str = "bucketd_control_messages_total";
pub const HTTP_UNAUTHORIZED: &str = "bucketd_http_unauthorized_total";
pub const HTTP_CONNECTIONS_REFUSED: &str = "bucketd_http_connections_refused_total";
pub const COMMIT_ERRORS: &str = "bucketd_commit_errors_total";
pub const CHECKPOINT_ERRORS: &str = "bucketd_checkpoint_errors_total";
pub const STORE_WRITABLE: &str = "bucketd_store_writable";
pub const DISK_WRITTEN: &str = "bucketd_disk_written_bytes_total";
pub const UPSTREAM_ENTRIES: &str = "bucketd_upstream_forwarded_entries_total";
pub const UPSTREAM_READINGS: &str = "bucketd_upstream_forwarded_readings_total";
pub const UPSTREAM_ERRORS: &str = "bucketd_upstream_errors_total";
pub const UPSTREAM_EXPIRED: &str = "bucketd_upstream_expired_readings_total";
pub const UPSTREAM_CONNECTED: &str = "bucketd_upstream_connected";
pub const UPSTREAM_LAG_ENTRIES: &str = "bucketd_upstream_lag_entries";
pub const UPSTREAM_LAG_SECONDS: &str = "bucketd_upstream_lag_seconds";

/// Commit latency buckets, seconds: a fast disk commits in about a millisecond, an SD card in
/// tens to hundreds.
pub const FLUSH_DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Readings per commit: from a quiet gateway's handful per interval to a full batch.
pub const FLUSH_READINGS_BUCKETS: &[f64] = &[
    1.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 2500.0, 5000.0, 10_000.0, 50_000.0, 100_000.0,
];

pub struct Metrics {
    recorder: PrometheusRecorder,
    process: metrics_process::Collector,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(FLUSH_DURATION.into()), FLUSH_DURATION_BUCKETS)
            .expect("bucket list is not empty")
            .set_buckets_for_metric(Matcher::Full(FLUSH_READINGS.into()), FLUSH_READINGS_BUCKETS)
            .expect("bucket list is not empty")
            .set_buckets_for_metric(
                Matcher::Full(CHECKPOINT_DURATION.into()),
                FLUSH_DURATION_BUCKETS,
            )
            .expect("bucket list is not empty")
            .build_recorder();
        let process = metrics_process::Collector::default();
        with_local_recorder(&recorder, || {
            describe(&process);
            // Create the histograms so that they render (empty) before the first commit.
            let _ = histogram!(FLUSH_DURATION);
            let _ = histogram!(FLUSH_READINGS);
            let _ = histogram!(CHECKPOINT_DURATION);
        });
        Metrics { recorder, process }
    }

    /// Records one commit's duration and size.
    pub fn record_commit(&self, took: Duration, readings: usize) {
        with_local_recorder(&self.recorder, || {
            histogram!(FLUSH_DURATION).record(took.as_secs_f64());
            histogram!(FLUSH_READINGS).record(readings as f64);
        });
    }

    /// Records one checkpoint's duration.
    pub fn record_checkpoint(&self, took: Duration) {
        with_local_recorder(&self.recorder, || {
            histogram!(CHECKPOINT_DURATION).record(took.as_secs_f64());
        });
    }

    /// Drains histogram samples into their buckets. Call periodically: without it, samples
    /// accumulate in memory while nobody scrapes.
    pub fn run_upkeep(&self) {
        self.recorder.handle().run_upkeep();
    }

    /// The Prometheus text exposition of `stats` and the process.
    pub fn render(&self, stats: &Stats) -> String {
        with_local_recorder(&self.recorder, || {
            copy_stats(stats);
            if let Some(bytes) = disk_written_bytes() {
                counter!(DISK_WRITTEN).absolute(bytes);
            }
            self.process.collect();
        });
        self.recorder.handle().render()
    }
}

// A data table (each metric, its unit and help text), read best in one place.
#[allow(clippy::too_many_lines)]
fn describe(process: &metrics_process::Collector) {
    describe_counter!(MESSAGES_RECEIVED, Unit::Count, "MQTT messages received.");
    describe_counter!(
        READINGS_INGESTED,
        Unit::Count,
        "Readings committed to the store."
    );
    describe_counter!(
        READINGS_REJECTED,
        Unit::Count,
        "Rejections by reason: a message-level fault (bad JSON, wrong topic, oversized) counts \
         once per message, a reading-level fault (non-finite value, timestamp out of range) once \
         per reading."
    );
    describe_counter!(
        FLUSHES,
        Unit::Count,
        "Batches handed to the store by what triggered them."
    );
    describe_histogram!(
        FLUSH_DURATION,
        Unit::Seconds,
        "Time to commit one batch, until it is durable (its journal record written and fsynced, \
         or a durable redb transaction without the journal)."
    );
    describe_histogram!(FLUSH_READINGS, Unit::Count, "Readings per committed batch.");
    describe_counter!(
        BUCKETS_WRITTEN,
        Unit::Count,
        "Bucket increments committed (one per bucket a commit changed)."
    );
    describe_counter!(
        CHECKPOINTS,
        Unit::Count,
        "Checkpoint transactions: the commit log folded into the bucket documents \
         (store.checkpoint_interval); a log longer than 50 ms of work to fold takes several."
    );
    describe_histogram!(
        CHECKPOINT_DURATION,
        Unit::Seconds,
        "Time of one checkpoint transaction (a part of the commit log folded into the bucket documents)."
    );
    describe_gauge!(
        LOG_BYTES,
        Unit::Bytes,
        "Bytes in the commit log, not yet folded by a checkpoint (store.checkpoint_bytes)."
    );
    describe_counter!(
        PAGES_EXPIRED,
        Unit::Count,
        "Raw pages deleted by retention (store.raw_retention)."
    );
    describe_counter!(
        BUCKETS_EXPIRED,
        Unit::Count,
        "Buckets deleted by retention (store.bucket_retention)."
    );
    describe_gauge!(
        PENDING_READINGS,
        Unit::Count,
        "Readings received and not yet committed."
    );
    describe_gauge!(
        UNACKED_MESSAGES,
        Unit::Count,
        "QoS 1/2 messages received and not yet acknowledged to the broker."
    );
    describe_counter!(
        ACKS_SENT,
        Unit::Count,
        "Acknowledgements written to the broker."
    );
    describe_gauge!(SERIES, Unit::Count, "Distinct series known.");
    describe_gauge!(
        STORE_FILE_SIZE,
        Unit::Bytes,
        "Size of the redb database file."
    );
    describe_gauge!(
        MQTT_CONNECTED,
        Unit::Count,
        "1 while connected to the MQTT broker, else 0."
    );
    describe_counter!(
        MQTT_RECONNECTS,
        Unit::Count,
        "Connections to the broker lost after being established."
    );
    describe_counter!(
        MQTT_CONNECTION_ERRORS,
        Unit::Count,
        "Connection losses and failed connection attempts."
    );
    describe_counter!(
        DUPLICATES,
        Unit::Count,
        "Redelivered messages recognised as already counted: acknowledged, not counted again."
    );
    describe_counter!(
        CONTROL_MESSAGES,
        Unit::Count,
        "Messages that carry no readings by design (Sparkplug DEATH, command and STATE \
         messages, and BIRTH messages without numeric metrics): read for what they mean."
    );
    describe_counter!(
        HTTP_UNAUTHORIZED,
        Unit::Count,
        "HTTP requests refused (401) for a missing or wrong bearer token."
    );
    describe_counter!(
        HTTP_CONNECTIONS_REFUSED,
        Unit::Count,
        "HTTP connections closed on arrival because http.max_connections were open."
    );
    describe_counter!(
        COMMIT_ERRORS,
        Unit::Count,
        "Commits that failed (disk full, I/O error); the batch is retried, nothing is acknowledged meanwhile."
    );
    describe_counter!(
        CHECKPOINT_ERRORS,
        Unit::Count,
        "Checkpoints that failed (disk full, I/O error); tried again after a backoff, the commits waiting stay in the journal and in memory."
    );
    describe_counter!(
        DISK_WRITTEN,
        Unit::Bytes,
        "Bytes this process caused to be written to storage (/proc/self/io write_bytes): what wears the SD card."
    );
    describe_gauge!(
        STORE_WRITABLE,
        "1 while commits succeed, 0 from a failed commit until one succeeds again."
    );
    describe_counter!(
        UPSTREAM_ENTRIES,
        Unit::Count,
        "Outbox entries (one per commit) applied by the upstream ([upstream])."
    );
    describe_counter!(
        UPSTREAM_READINGS,
        Unit::Count,
        "Readings represented by the deltas applied upstream."
    );
    describe_counter!(
        UPSTREAM_EXPIRED,
        Unit::Count,
        "Readings not forwarded: their buckets are older than upstream.postgres_retention."
    );
    describe_counter!(
        UPSTREAM_ERRORS,
        Unit::Count,
        "Failed forwarding attempts (connection or SQL errors); the outbox keeps the deltas."
    );
    describe_gauge!(
        UPSTREAM_CONNECTED,
        "1 while connected to the upstream, else 0."
    );
    describe_gauge!(
        UPSTREAM_LAG_ENTRIES,
        Unit::Count,
        "Outbox entries not yet applied upstream."
    );
    describe_gauge!(
        UPSTREAM_LAG_SECONDS,
        Unit::Seconds,
        "Age of the oldest outbox entry not yet applied upstream (0: none)."
    );
    process.describe();
}

/// `write_bytes` of `/proc/self/io`: bytes sent to the storage layer by this process (page
/// cache writeback included, as the kernel accounts it). `None` where there is no procfs.
pub fn disk_written_bytes() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("write_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

fn copy_stats(stats: &Stats) {
    counter!(MESSAGES_RECEIVED).absolute(Stats::get(&stats.messages_received));
    counter!(READINGS_INGESTED).absolute(Stats::get(&stats.readings_ingested));
    for reason in DecodeError::ALL {
        counter!(READINGS_REJECTED, "reason" => reason.reason()).absolute(stats.rejected(reason));
    }
    for reason in FlushReason::ALL {
        counter!(FLUSHES, "reason" => reason.label()).absolute(stats.flushes_by(reason));
    }
    counter!(BUCKETS_WRITTEN).absolute(Stats::get(&stats.buckets_written));
    counter!(CHECKPOINTS).absolute(Stats::get(&stats.checkpoints));
    gauge!(LOG_BYTES).set(Stats::get(&stats.log_bytes) as f64);
    counter!(PAGES_EXPIRED).absolute(Stats::get(&stats.pages_expired));
    counter!(BUCKETS_EXPIRED).absolute(Stats::get(&stats.buckets_expired));
    counter!(ACKS_SENT).absolute(Stats::get(&stats.acks_sent));
    counter!(MQTT_RECONNECTS).absolute(Stats::get(&stats.reconnects));
    counter!(MQTT_CONNECTION_ERRORS).absolute(Stats::get(&stats.connection_errors));
    counter!(DUPLICATES).absolute(Stats::get(&stats.duplicates));
    counter!(CONTROL_MESSAGES).absolute(Stats::get(&stats.control_messages));
    counter!(COMMIT_ERRORS).absolute(Stats::get(&stats.commit_errors));
    counter!(CHECKPOINT_ERRORS).absolute(Stats::get(&stats.checkpoint_errors));
    counter!(HTTP_UNAUTHORIZED).absolute(Stats::get(&stats.http_unauthorized));
    counter!(HTTP_CONNECTIONS_REFUSED).absolute(Stats::get(&stats.http_connections_refused));
    let failing = stats
        .store_failing
        .load(std::sync::atomic::Ordering::Relaxed);
    gauge!(STORE_WRITABLE).set(if failing { 0.0 } else { 1.0 });
    gauge!(PENDING_READINGS).set(Stats::get(&stats.pending_readings) as f64);
    gauge!(UNACKED_MESSAGES).set(Stats::get(&stats.unacked_messages) as f64);
    gauge!(SERIES).set(Stats::get(&stats.series) as f64);
    gauge!(STORE_FILE_SIZE).set(Stats::get(&stats.store_bytes) as f64);
    let connected = stats.connected.load(std::sync::atomic::Ordering::Relaxed);
    gauge!(MQTT_CONNECTED).set(if connected { 1.0 } else { 0.0 });
    if stats
        .upstream_enabled
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        counter!(UPSTREAM_ENTRIES).absolute(Stats::get(&stats.upstream_entries));
        counter!(UPSTREAM_READINGS).absolute(Stats::get(&stats.upstream_readings));
        counter!(UPSTREAM_ERRORS).absolute(Stats::get(&stats.upstream_errors));
        counter!(UPSTREAM_EXPIRED).absolute(Stats::get(&stats.upstream_expired));
        let up = stats
            .upstream_connected
            .load(std::sync::atomic::Ordering::Relaxed);
        gauge!(UPSTREAM_CONNECTED).set(if up { 1.0 } else { 0.0 });
        gauge!(UPSTREAM_LAG_ENTRIES).set(Stats::get(&stats.upstream_pending_entries) as f64);
        let oldest = stats
            .upstream_oldest_pending_ns
            .load(std::sync::atomic::Ordering::Relaxed);
        gauge!(UPSTREAM_LAG_SECONDS).set(age_secs(oldest));
    }
}

/// Seconds since `ns` (nanoseconds since the epoch); 0 for 0.
fn age_secs(ns: i64) -> f64 {
    if ns == 0 {
        return 0.0;
    }
    let now = crate::reading::Timestamp::now().as_nanos();
    (now.saturating_sub(ns)).max(0) as f64 / 1e9
}

/// How long an idle thread of tokio's blocking pool (where queries read) lives.
pub const BLOCKING_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(1);

/// How long after the last query of a burst its memory is trimmed: once the blocking-pool
/// threads that ran it have ended ([`BLOCKING_KEEP_ALIVE`]) and their allocator caches (glibc's
/// per-thread tcache, whose chunks pin the pages they lie in) are back in the heap.
pub const TRIM_AFTER_QUERIES: std::time::Duration = std::time::Duration::from_secs(2);

/// Returns the allocator's free pages to the system (glibc's `malloc_trim`): called when the
/// last query in flight has finished, so that memory a burst of queries used comes back.
pub fn release_free_memory() {
    #[cfg(all(any(target_os = "linux", target_os = "android"), target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Sets glibc's allocator up for a small gateway whose query bursts must not keep their memory
/// (call before any thread starts): two arenas, not eight per core (each thread of tokio's
/// blocking pool, where queries run, would otherwise keep one, and what a query freed stays in
/// it); blocks from 64 KiB up mapped on their own, so a query's large vectors go back to the
/// system when freed (a fixed threshold: glibc otherwise raises it to 32 MiB after the first
/// large free, and the next query's vectors stay in the heap); the heap's free top returned
/// past 128 KiB. Measured in docs/PERFORMANCE.md ("Memory after a query storm").
pub fn tune_allocator() {
    #[cfg(all(any(target_os = "linux", target_os = "android"), target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before other threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 128 * 1024);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_has_help_for_every_metric_and_bounded_labels() {
        let m = Metrics::new();
        let stats = Stats::new(4);
        stats.reject(
            DecodeError::NonFinite,
            b"t",
            b"NaN",
            crate::reading::Timestamp::now(),
        );
        stats.flush_started(FlushReason::Stall);
        m.record_commit(Duration::from_millis(3), 42);
        m.record_checkpoint(Duration::from_millis(30));
        let text = m.render(&stats);
        for name in [
            MESSAGES_RECEIVED,
            READINGS_INGESTED,
            READINGS_REJECTED,
            FLUSHES,
            FLUSH_DURATION,
            FLUSH_READINGS,
            BUCKETS_WRITTEN,
            CHECKPOINTS,
            CHECKPOINT_DURATION,
            LOG_BYTES,
            PAGES_EXPIRED,
            BUCKETS_EXPIRED,
            PENDING_READINGS,
            UNACKED_MESSAGES,
            ACKS_SENT,
            SERIES,
            STORE_FILE_SIZE,
            MQTT_CONNECTED,
            MQTT_RECONNECTS,
            MQTT_CONNECTION_ERRORS,
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
        ] {
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "no HELP for {name}:\n{text}"
            );
        }
        assert!(text.contains("bucketd_readings_rejected_total{reason=\"non_finite\"} 1"));
        assert!(text.contains("bucketd_readings_rejected_total{reason=\"invalid_json\"} 0"));
        assert!(text.contains("bucketd_flushes_total{reason=\"stall\"} 1"));
        assert!(text.contains("bucketd_flush_readings_bucket{le=\"50\"} 1"));
        assert!(text.contains("bucketd_flush_duration_seconds_bucket{le=\"0.0025\"} 0"));
        assert!(text.contains("bucketd_flush_duration_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("bucketd_checkpoint_duration_seconds_bucket{le=\"0.025\"} 0"));
        assert!(text.contains("bucketd_checkpoint_duration_seconds_bucket{le=\"0.05\"} 1"));
        let labelled = text
            .lines()
            .filter(|l| l.starts_with("bucketd_readings_rejected_total{"))
            .count();
        assert_eq!(labelled, DecodeError::ALL.len());
    }
}
