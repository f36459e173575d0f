//! [`Batcher`]: the open batch. Readings are merged into per-bucket [`Summary`]s in memory and the
//! acknowledgement tokens of the messages they came from are kept in arrival order; the flush
//! policy decides when the batch must be committed. Pure: the caller passes the time in.
//!
//! The flush policy commits when the first of these holds:
//! - `flush_interval` has passed since the batch's first message;
//! - `max_pending_readings` readings are pending;
//! - half of the in-flight window we ask for (`receive_maximum`, times `mqtt.sessions`) is
//!   waiting for acknowledgement.
//!   A broker that honours it sends nothing more once it is full, so waiting for the interval
//!   would cap throughput at `window / flush_interval`; flushing at half keeps the other half
//!   flowing while the commit runs;
//! - the broker's own window is full ([`FlushReason::Stall`], [`FlushReason::BrokerWindow`]):
//!   brokers may enforce a smaller window than we ask for, and then send nothing until we
//!   acknowledge. The window is stated (`mqtt.broker_window`) or learned from how the broker
//!   answers our releases: [`window`], which owns the learning and the open batch's arrival
//!   times it goes by; this module owns the batch itself.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ack::AckToken;
use crate::sketch::SketchParams;
use crate::summary::Summary;

pub mod window;

pub use window::Learner;

/// A bucket: (series name, bucket start in seconds since the epoch).
pub type BucketKey = (Arc<str>, i64);

/// When a batch is committed.
#[derive(Debug, Clone, Copy)]
pub struct FlushPolicy {
    pub flush_interval: Duration,
    pub max_pending_readings: usize,
    /// The in-flight window we ask the broker for (`mqtt.receive_maximum`).
    pub window: u16,
    /// The window the broker enforces, when the operator states it (`mqtt.broker_window`).
    pub broker_window: Option<u16>,
    /// Sessions sharing the subscriptions (`mqtt.sessions`), each with its own window.
    pub sessions: u16,
    /// Our TCP ACKs never wait for the kernel's delayed ACK (`TCP_QUICKACK`, Linux; a
    /// millisecond or two at most while they coalesce, [`Learner::acks_may_wait`]): a broker's
    /// Nagle gaps last about a round trip, and a stall is believed after a shorter quiet (see
    /// the module docs).
    pub quick_acks: bool,
}

impl FlushPolicy {
    /// Unacknowledged messages at which a flush is due: half the window of all sessions, at
    /// least one.
    pub fn ack_threshold(&self) -> usize {
        (self.windows() / 2).max(1)
    }

    /// The windows we ask for, all sessions together.
    pub fn windows(&self) -> usize {
        usize::from(self.window) * usize::from(self.sessions.max(1))
    }
}

/// Why a batch is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushReason {
    Interval,
    Readings,
    AckWindow,
    /// The broker went quiet right after releasing messages, with our acknowledgements
    /// pending: its window is full, and this is how large it is (learned).
    Stall,
    /// The batch holds the broker's known window (`mqtt.broker_window`, or learned from a
    /// stall): it sends nothing more until we acknowledge.
    BrokerWindow,
    /// Asked for: `POST /api/v1/flush`, or shutdown.
    Request,
    /// The batch repeats the messages committed before it, packet ids and all: committed at
    /// once, so that their resends after a crash cannot pass for those (`crate::resend`).
    Replay,
}

impl FlushReason {
    pub const ALL: [FlushReason; 7] = [
        FlushReason::Interval,
        FlushReason::Readings,
        FlushReason::AckWindow,
        FlushReason::Stall,
        FlushReason::BrokerWindow,
        FlushReason::Request,
        FlushReason::Replay,
    ];

    /// The metric label value.
    pub fn label(self) -> &'static str {
        match self {
            FlushReason::Interval => "interval",
            FlushReason::Readings => "readings",
            FlushReason::AckWindow => "ack_window",
            FlushReason::Stall => "stall",
            FlushReason::BrokerWindow => "broker_window",
            FlushReason::Request => "request",
            FlushReason::Replay => "replay",
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
    /// ([`crate::dedup`]), in arrival order with their resend sequence tags, stored with the
    /// batch.
    pub fingerprints: Vec<(crate::dedup::Fingerprint, crate::dedup::Tag)>,
    /// The last delta message applied per gateway (`fleet::applied`), stored with the batch.
    pub applied: BTreeMap<String, crate::delta::Position>,
}

impl Batch {
    /// Whether there is nothing to store: no bucket, and no delta position (a central records
    /// a delta message's position even when each of its buckets was refused).
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty() && self.applied.is_empty()
    }
}

/// What the writer reports for a batch it committed.
#[derive(Debug, Clone, Default)]
pub struct Committed {
    pub readings: usize,
    /// Bucket deltas in the commit's log record.
    pub buckets: usize,
    pub took: Duration,
    /// Series that retention deleted since the last result (their last bucket expired), for
    /// the ingest side to forget: they no longer count against `limits.max_series`.
    pub forgotten: Vec<Arc<str>>,
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
    /// The broker's window, as far as learned, and the batch's arrivals it goes by.
    window: Learner,
}

impl Batcher {
    pub fn new(policy: FlushPolicy, bucket_width_secs: i64) -> Batcher {
        Batcher::with_sketch(policy, bucket_width_secs, SketchParams::DEFAULT)
    }

    /// A batcher for building batches by hand (tests, benchmarks), one-hour buckets: its flush
    /// policy is never consulted.
    pub fn by_hand() -> Batcher {
        Batcher::new(
            FlushPolicy {
                flush_interval: Duration::from_secs(1),
                max_pending_readings: usize::MAX,
                window: 1,
                broker_window: None,
                sessions: 1,
                quick_acks: false,
            },
            3600,
        )
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
            window: Learner::new(policy),
        }
    }

    /// The flush policy's `batch.flush_interval`.
    pub fn flush_interval(&self) -> Duration {
        self.policy.flush_interval
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
        // Saturating: a delta's count is a gateway's word (up to i64::MAX each).
        let readings = usize::try_from(summary.count).unwrap_or(usize::MAX);
        self.batch.readings = self.batch.readings.saturating_add(readings);
    }

    pub fn bucket_width_secs(&self) -> i64 {
        self.bucket_width_secs
    }

    /// Records the fingerprint of a message whose readings are in the batch, and the resend
    /// sequence it belongs to.
    pub fn push_fingerprint(&mut self, fp: crate::dedup::Fingerprint, tag: crate::dedup::Tag) {
        self.batch.fingerprints.push((fp, tag));
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
        self.window.ack(usize::from(ack.session));
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

    /// Whether the open batch has a bucket of `series` (its commit will store the series).
    pub fn holds_series(&self, series: &str) -> bool {
        let from: BucketKey = (Arc::from(series), i64::MIN);
        self.batch
            .buckets
            .range(from..)
            .next()
            .is_some_and(|((name, _), _)| &**name == series)
    }

    /// Whether the batch is due for commit at `now`, and why.
    pub fn flush_reason(&self, now: Instant) -> Option<FlushReason> {
        let opened_at = self.opened_at?;
        if self.batch.readings >= self.policy.max_pending_readings {
            Some(FlushReason::Readings)
        } else if self.acks.len() >= self.policy.ack_threshold() {
            Some(FlushReason::AckWindow)
        } else if let Some((at, reason)) = self.window.full_at()
            && now >= at
        {
            // Before the interval: a stall teaches the window.
            Some(reason)
        } else if now.duration_since(opened_at) >= self.policy.flush_interval {
            Some(FlushReason::Interval)
        } else {
            None
        }
    }

    /// When a flush falls due by time (the interval, or a stall if nothing else arrives), if
    /// anything is pending.
    pub fn deadline(&self) -> Option<Instant> {
        let interval = self.opened_at? + self.policy.flush_interval;
        Some(
            self.window
                .full_at()
                .map_or(interval, |(full, _)| full.min(interval)),
        )
    }

    /// Whether the batch may take no more messages until it is handed to the writer: the
    /// reading limit or the whole window is reached. The caller then stops reading from the broker.
    pub fn is_full(&self) -> bool {
        self.batch.readings >= self.policy.max_pending_readings
            || self.acks.len() >= self.policy.windows()
    }

    /// [`Batcher::take`] for a flush due at `now` for `reason`: what its commit teaches of
    /// the broker's window ([`Learner::take_for`]).
    pub fn take_for(&mut self, reason: FlushReason, now: Instant) -> (Batch, Vec<AckToken>) {
        self.window.take_for(reason, now);
        self.empty()
    }

    /// Takes the batch and its acks, leaving an empty batch behind.
    pub fn take(&mut self) -> (Batch, Vec<AckToken>) {
        self.window.taken();
        self.empty()
    }

    fn empty(&mut self) -> (Batch, Vec<AckToken>) {
        self.opened_at = None;
        (
            std::mem::take(&mut self.batch),
            std::mem::take(&mut self.acks),
        )
    }

    /// A QoS 1/2 message arrived ([`Learner::arrived`]).
    pub fn arrived(&mut self, now: Instant, lag: Duration) {
        self.window.arrived(now, lag);
    }

    /// The acks of the batch taken last were queued ([`Learner::released`]).
    pub fn released(&mut self, now: Instant) {
        self.window.released(now);
    }

    /// A marker PINGREQ went out behind the last release ([`Learner::release_pinged`]).
    pub fn release_pinged(&mut self) {
        self.window.release_pinged();
    }

    /// A marker's answer came ([`Learner::release_answered`]).
    pub fn release_answered(&mut self, now: Instant) {
        self.window.release_answered(now);
    }

    /// A new connection of `session` ([`Learner::connected`]).
    pub fn connected(&mut self, session: u16, now: Instant, handshake: Duration) {
        self.window.connected(session, now, handshake);
    }

    /// The broker's window as learned from stalls, if one was.
    pub fn window_seen(&self) -> Option<usize> {
        self.window.window_seen()
    }

    /// Whether our TCP ACKs may wait a little ([`Learner::acks_may_wait`]).
    pub fn acks_may_wait(&self) -> bool {
        self.window.acks_may_wait()
    }

    /// A window learned where none was known, once per connection ([`Learner::newly_learned`]).
    pub fn newly_learned(&mut self) -> Option<usize> {
        self.window.newly_learned()
    }

    /// Whether no QoS 1/2 message has arrived in the open batch yet.
    pub fn awaits_first_arrival(&self) -> bool {
        self.window.awaits_first_arrival()
    }

    /// Messages of `session`'s current connection in the open batch or taken for commit and
    /// not released yet.
    pub fn unacked_of(&self, session: usize) -> usize {
        self.window.unacked_of(session)
    }
}

#[cfg(test)]
mod tests;
