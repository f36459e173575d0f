//! [`Batcher`]: the open batch. Readings are merged into per-bucket [`Summary`]s in memory and the
//! acknowledgement tokens of the messages they came from are kept in arrival order; the flush
//! policy decides when the batch must be committed. Pure: the caller passes the time in.
//!
//! The flush policy commits when the first of these holds:
//! - `flush_interval` has passed since the batch's first message;
//! - `max_pending_readings` readings are pending;
//! - half of the broker's in-flight window (`receive_maximum`) is waiting for acknowledgement.
//!   A strict broker sends nothing more once the window is full, so waiting for the interval
//!   would cap throughput at `window / flush_interval`; flushing at half the window keeps the
//!   other half flowing while the commit runs;
//! - the broker has stalled on a window smaller than the configured one. Brokers may enforce a
//!   smaller window than we ask for (rumqttd: 100 whatever the Receive Maximum; a v3.1.1 broker's
//!   own limit, which the client cannot learn), so the policy also recognises the signature of a
//!   full window: the batch's messages arrived right after our previous acknowledgements were
//!   released (the broker was waiting for them), and then the stream went quiet for much longer
//!   than the gaps between those messages. Ordinary traffic rarely shows both: a steady stream has
//!   no quiet gap many times its own spacing, and a batch that began long after the last release
//!   was not released by it. A broker window of 1 gives no spacing to judge by: set
//!   `receive_maximum = 1` for such a broker.
//!
//!   One ordinary delivery does show both: a broker with Nagle's algorithm on (Mosquitto's default,
//!   `set_tcp_nodelay false`) holds small packets until our kernel acknowledges the previous ones,
//!   and with acknowledgements batched we send nothing it could ride on, so the TCP delayed ACK
//!   (40 ms and more on Linux) paces delivery into bursts with quiet gaps of 10-45 ms, and our
//!   release ends a gap at once. Taking those gaps for stalls committed every burst (70 commits/s
//!   of 14 readings at 1,000 messages/s, 5x the bytes written per reading). So a quiet period
//!   proves a stall only when it outlasts any delayed ACK ([`QUIET_CONFIRM`]); the number of
//!   unacknowledged messages at that stall is the broker's window, and from then on a batch that
//!   reaches exactly that number stalls after the short quiet period. More messages than that
//!   without a release prove the window larger, and it is learned again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ack::AckToken;
use crate::sketch::SketchParams;
use crate::summary::Summary;

/// A bucket: (series name, bucket start in seconds since the epoch).
pub type BucketKey = (Arc<str>, i64);

/// When a batch is committed.
#[derive(Debug, Clone, Copy)]
pub struct FlushPolicy {
    pub flush_interval: Duration,
    pub max_pending_readings: usize,
    /// The broker's in-flight window for QoS 1/2 messages.
    pub window: u16,
}

impl FlushPolicy {
    /// Unacknowledged messages at which a flush is due: half the window, at least one.
    pub fn ack_threshold(&self) -> usize {
        (usize::from(self.window) / 2).max(1)
    }
}

/// A batch whose first message arrived within this time after the previous acknowledgements
/// were released counts as released by them (an "echo").
pub const ECHO_MAX: Duration = Duration::from_millis(100);
/// The shortest quiet period taken for a stalled window, once the window is known.
pub const QUIET_MIN: Duration = Duration::from_millis(10);
/// The quiet period that proves a stall while the broker's window is not known: longer than
/// a TCP delayed ACK (Linux: 40-200 ms), which a broker using Nagle's algorithm waits for.
pub const QUIET_CONFIRM: Duration = Duration::from_millis(250);
/// The quiet period that marks a stall, in multiples of the batch's mean message spacing.
pub const QUIET_SPACINGS: u32 = 8;

/// Why a batch is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushReason {
    Interval,
    Readings,
    AckWindow,
    /// The broker stopped sending right after releasing messages: its window is full.
    Stall,
    /// Asked for: `POST /api/v1/flush`, or shutdown.
    Request,
}

impl FlushReason {
    pub const ALL: [FlushReason; 5] = [
        FlushReason::Interval,
        FlushReason::Readings,
        FlushReason::AckWindow,
        FlushReason::Stall,
        FlushReason::Request,
    ];

    /// The metric label value.
    pub fn label(self) -> &'static str {
        match self {
            FlushReason::Interval => "interval",
            FlushReason::Readings => "readings",
            FlushReason::AckWindow => "ack_window",
            FlushReason::Stall => "stall",
            FlushReason::Request => "request",
        }
    }
}

/// What the writer commits: the merged buckets of a contiguous run of messages, and the raw
/// readings (in arrival order) of the subscriptions that store them.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Batch {
    pub buckets: BTreeMap<BucketKey, Summary>,
    pub raw: BTreeMap<BucketKey, Vec<(i64, f64)>>,
    pub readings: usize,
    /// Fingerprints of the batch's messages that a redelivery could repeat
    /// ([`crate::dedup`]), stored with the batch.
    pub fingerprints: Vec<crate::dedup::Fingerprint>,
    /// The last delta message applied per gateway (`fleet::applied`), stored with the batch.
    pub applied: BTreeMap<String, crate::delta::Position>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }
}

/// The open batch plus its acknowledgement tokens.
#[derive(Debug)]
pub struct Batcher {
    policy: FlushPolicy,
    bucket_width_secs: i64,
    batch: Batch,
    acks: Vec<AckToken>,
    opened_at: Option<Instant>,
    sketch: SketchParams,
    /// Arrival times of the batch's first and last message, and how many messages it has.
    first_arrival: Option<Instant>,
    last_arrival: Option<Instant>,
    arrivals: u32,
    /// When acknowledgements (or a new connection) last let the broker send more.
    released_at: Option<Instant>,
    /// The broker's window, as the last proven stall showed it: unacknowledged messages at
    /// which it stops sending.
    window_seen: Option<usize>,
}

impl Batcher {
    pub fn new(policy: FlushPolicy, bucket_width_secs: i64) -> Batcher {
        Batcher::with_sketch(policy, bucket_width_secs, SketchParams::DEFAULT)
    }

    /// A batcher whose new buckets get sketches with `sketch` settings.
    pub fn with_sketch(
        policy: FlushPolicy,
        bucket_width_secs: i64,
        sketch: SketchParams,
    ) -> Batcher {
        assert!(
            bucket_width_secs > 0,
            "config validation guarantees a width"
        );
        Batcher {
            sketch,
            policy,
            bucket_width_secs,
            batch: Batch::default(),
            acks: Vec::new(),
            opened_at: None,
            first_arrival: None,
            last_arrival: None,
            arrivals: 0,
            released_at: None,
            window_seen: None,
        }
    }

    /// Records that a message arrived (every message, whatever its fate).
    pub fn arrived(&mut self, now: Instant) {
        self.first_arrival.get_or_insert(now);
        self.last_arrival = Some(now);
        self.arrivals = self.arrivals.saturating_add(1);
    }

    /// Records that the broker was allowed to send more: acknowledgements were queued, or a
    /// connection was (re)established.
    pub fn released(&mut self, now: Instant) {
        self.released_at = Some(now);
    }

    /// A new connection: the broker may send its window at once, and it may be another broker
    /// (or another configuration) whose window is still to be learned.
    pub fn connected(&mut self, now: Instant) {
        self.released(now);
        self.window_seen = None;
    }

    /// The broker's window as learned from stalls, if one was.
    pub fn window_seen(&self) -> Option<usize> {
        self.window_seen
    }

    /// When a stall would be recognised if nothing else arrives, for batches that qualify.
    fn stall_at(&self) -> Option<Instant> {
        let (first, last, released) = (self.first_arrival?, self.last_arrival?, self.released_at?);
        // A batch that began during the commit counts too: a broker whose window was not full
        // at the flush fills it meanwhile, then waits for this release.
        let echo = first.saturating_duration_since(released) <= ECHO_MAX;
        if self.acks.is_empty() || self.arrivals < 2 || !echo {
            return None;
        }
        let quiet = if self.window_seen == Some(self.acks.len()) {
            let spacing = last.duration_since(first) / (self.arrivals - 1);
            (spacing * QUIET_SPACINGS).max(QUIET_MIN)
        } else {
            QUIET_CONFIRM
        };
        Some(last + quiet.min(self.policy.flush_interval))
    }

    /// Merges one reading into its bucket.
    pub fn push(
        &mut self,
        series: Arc<str>,
        ts: crate::reading::Timestamp,
        value: f64,
        now: Instant,
    ) {
        self.push_reading(series, ts, value, false, now);
    }

    /// Merges one reading into its bucket and, with `store_raw`, keeps it for the raw pages.
    pub fn push_reading(
        &mut self,
        series: Arc<str>,
        ts: crate::reading::Timestamp,
        value: f64,
        store_raw: bool,
        now: Instant,
    ) {
        self.opened_at.get_or_insert(now);
        let key = (series, ts.bucket_start(self.bucket_width_secs));
        if store_raw {
            self.batch
                .raw
                .entry(key.clone())
                .or_default()
                .push((ts.as_nanos(), value));
        }
        match self.batch.buckets.get_mut(&key) {
            Some(summary) => summary.push(ts.as_nanos(), value),
            None => {
                self.batch
                    .buckets
                    .insert(key, Summary::with_params(ts.as_nanos(), value, self.sketch));
            }
        }
        self.batch.readings += 1;
    }

    /// Merges a bucket summary (a gateway's delta) into its bucket.
    pub fn push_summary(&mut self, series: Arc<str>, start: i64, summary: &Summary, now: Instant) {
        self.opened_at.get_or_insert(now);
        match self.batch.buckets.get_mut(&(series.clone(), start)) {
            Some(have) => have.merge(summary),
            None => {
                self.batch.buckets.insert((series, start), summary.clone());
            }
        }
        self.batch.readings += usize::try_from(summary.count).unwrap_or(usize::MAX);
    }

    pub fn bucket_width_secs(&self) -> i64 {
        self.bucket_width_secs
    }

    /// Records the fingerprint of a message whose readings are in the batch.
    pub fn push_fingerprint(&mut self, fp: crate::dedup::Fingerprint) {
        self.batch.fingerprints.push(fp);
    }

    /// Records that a gateway's delta message up to `at` is in the batch.
    pub fn push_applied(&mut self, gateway: &str, at: crate::delta::Position) {
        self.batch.applied.insert(gateway.to_owned(), at);
    }

    /// Records the acknowledgement a message needs once everything before it is committed.
    pub fn push_ack(&mut self, ack: AckToken, now: Instant) {
        self.opened_at.get_or_insert(now);
        debug_assert!(
            self.acks
                .last()
                .is_none_or(|prev| prev.arrival < ack.arrival),
            "acks are pushed in arrival order"
        );
        self.acks.push(ack);
        if self.window_seen.is_some_and(|w| self.acks.len() > w) {
            // The broker sent more without a release: its window is larger.
            self.window_seen = None;
        }
    }

    pub fn pending_readings(&self) -> usize {
        self.batch.readings
    }

    pub fn pending_acks(&self) -> usize {
        self.acks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.opened_at.is_none()
    }

    /// Whether the batch is due for commit at `now`, and why.
    pub fn flush_reason(&self, now: Instant) -> Option<FlushReason> {
        let opened_at = self.opened_at?;
        if self.batch.readings >= self.policy.max_pending_readings {
            Some(FlushReason::Readings)
        } else if self.acks.len() >= self.policy.ack_threshold() {
            Some(FlushReason::AckWindow)
        } else if now.duration_since(opened_at) >= self.policy.flush_interval {
            Some(FlushReason::Interval)
        } else if self.stall_at().is_some_and(|at| now >= at) {
            Some(FlushReason::Stall)
        } else {
            None
        }
    }

    /// When a flush falls due by time (the interval, or a stall if nothing else arrives), if
    /// anything is pending.
    pub fn deadline(&self) -> Option<Instant> {
        let interval = self.opened_at? + self.policy.flush_interval;
        Some(
            self.stall_at()
                .map_or(interval, |stall| stall.min(interval)),
        )
    }

    /// Whether the batch may take no more messages until it is handed to the writer: the
    /// reading limit or the whole window is reached. The caller then stops reading from the broker.
    pub fn is_full(&self) -> bool {
        self.batch.readings >= self.policy.max_pending_readings
            || self.acks.len() >= usize::from(self.policy.window)
    }

    /// [`Batcher::take`] for a flush due for `reason`. A stall flush teaches the broker's
    /// window: the messages it holds are what the broker sends without acknowledgements.
    pub fn take_for(&mut self, reason: FlushReason) -> (Batch, Vec<AckToken>) {
        if reason == FlushReason::Stall && self.window_seen.is_none() {
            self.window_seen = Some(self.acks.len());
        }
        self.take()
    }

    /// Takes the batch and its acks, leaving an empty batch behind.
    pub fn take(&mut self) -> (Batch, Vec<AckToken>) {
        self.opened_at = None;
        self.first_arrival = None;
        self.last_arrival = None;
        self.arrivals = 0;
        (
            std::mem::take(&mut self.batch),
            std::mem::take(&mut self.acks),
        )
    }
}

#[cfg(test)]
mod tests;
