//! The ingest task: owns the MQTT connection and the [`Batcher`]. It decodes every PUBLISH,
//! merges its readings into the open batch, hands due batches to the writer thread, and sends the
//! acknowledgements of a batch, in arrival order, once the writer reports it committed.
//!
//! Nothing inside the loop blocks: decoding and merging are in-memory, the writer runs on its own
//! thread, and acks go through `try_ack` into a request channel sized for two full windows. When
//! the open batch is full while a commit runs, the loop stops reading from the broker until the
//! commit ends (backpressure: the broker holds the rest).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::ack::AckToken;
use crate::batcher::{Batcher, FlushReason};
use crate::config::{Limits, Subscription};
use crate::decode::{self, DecodeContext, DecodeError, Decoded};
use crate::dedup::{self, Window};
use crate::http::FlushRequest;
use crate::mqtt::{Backoff, Mqtt, MqttEvent, PollError};
use crate::reading::Timestamp;
use crate::series::SeriesSet;
use crate::stats::Stats;
use crate::store::CommitError;
use crate::writer::{Committed, Writer};

/// Longest wait between attempts to claim a delta message: below any watchdog interval.
const CLAIM_RETRY_MAX: Duration = Duration::from_secs(5);

/// How long shutdown waits for the last commit's acknowledgements to reach the broker.
pub const SHUTDOWN_DRAIN_MAX: Duration = Duration::from_secs(10);

/// Why ingestion stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("commit failed; nothing of the failed batch was acknowledged: {0}")]
    Commit(#[from] CommitError),
    #[error("the writer thread stopped unexpectedly")]
    WriterGone,
}

pub struct Ingest {
    pub mqtt: Mqtt,
    pub subscriptions: Vec<Subscription>,
    pub limits: Limits,
    pub batcher: Batcher,
    pub series: SeriesSet,
    pub stats: Arc<Stats>,
    pub writer: Writer,
    pub backoff: Backoff,
    /// The broker's in-flight window (`mqtt.receive_maximum`).
    pub window: u16,
    /// `POST /api/v1/flush`: commit everything pending now.
    pub flush_requests: mpsc::Receiver<FlushRequest>,
    /// Fingerprints of the most recent messages, for recognising redeliveries.
    pub dedup: Window,
    /// The last delta message applied per gateway ([`crate::applied`]).
    pub applied: crate::applied::Applied,
    /// With several central instances: who applies each delta message ([`crate::claims`]).
    pub claims: Option<crate::claims::Claims>,
}

/// A flush request waiting for the commits that cover what was pending when it came.
struct FlushWaiter {
    /// Batch sequence numbers `first..=last` hold what was pending.
    first: u64,
    last: u64,
    committed: u64,
    reply: FlushRequest,
}

/// The loop's state besides its parts.
struct State {
    /// Counts CONNACKs; a token from an older connection is never sent.
    connection: u64,
    connected: bool,
    /// Next arrival sequence number.
    arrival: u64,
    /// Acks of the batch at the writer, sent when it reports the commit.
    in_flight: Option<Vec<AckToken>>,
    /// Sequence number of the last batch sent to the writer.
    sent_seq: u64,
    /// Commit the open batch as soon as the writer is idle, whatever the policy says.
    force_flush: bool,
    flush_waiters: Vec<FlushWaiter>,
    /// Acks queued to the client and not yet written to the socket.
    acks_unwritten: usize,
    /// Acks waiting for room in the client's request channel, in arrival order. rumqttc writes
    /// one request per poll, so a broker that sends past its window (Mosquitto before 2.0.13
    /// does) can fill the channel; nothing is dropped, the rest waits here. Bounded by what the
    /// broker sends unacknowledged.
    ack_backlog: VecDeque<AckToken>,
    /// Whether the "broker exceeds its window" warning was logged on this connection.
    warned_window: bool,
    /// Whether the window learned from a stall was logged on this connection.
    told_window: bool,
    /// While the connection is down: when to try again.
    reconnect_at: Option<Instant>,
    /// Whether READY=1 went to systemd (once: the first time the broker has our subscriptions).
    ready_sent: bool,
    decoded: Decoded,
    /// The message being handled is a delta message another central instance claimed
    /// ([`crate::claims`]).
    claimed_elsewhere: bool,
}

impl Ingest {
    /// Runs until `cancel`, then commits what is pending, acknowledges it and disconnects.
    pub async fn run(mut self, cancel: CancellationToken) -> Result<(), IngestError> {
        let mut st = State {
            connection: 0,
            connected: false,
            arrival: 0,
            in_flight: None,
            sent_seq: 0,
            force_flush: false,
            flush_waiters: Vec::new(),
            acks_unwritten: 0,
            ack_backlog: VecDeque::new(),
            warned_window: false,
            told_window: false,
            reconnect_at: None,
            ready_sent: false,
            decoded: Decoded::default(),
            claimed_elsewhere: false,
        };
        // Pinged from this loop, not from a task of its own: if the loop stops turning, systemd
        // stops hearing from it and restarts the service.
        let mut watchdog = crate::notify::watchdog_interval().map(|every| {
            info!(every = ?every, "Pinging the systemd watchdog.");
            let mut interval = tokio::time::interval(every);
            // Ticks missed while not yet ready are not made up in a burst.
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval
        });
        loop {
            self.hand_over_due_batch(&mut st, Instant::now())?;
            let deadline = self.batcher.deadline().map(Instant::from_std);
            let reconnect_at = st.reconnect_at;
            let can_poll = reconnect_at.is_none() && !self.batcher.is_full();
            tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                result = self.writer.results.recv(), if st.in_flight.is_some() => {
                    self.on_commit(&mut st, result)?;
                }
                () = sleep_until_opt(reconnect_at), if reconnect_at.is_some() => {
                    st.reconnect_at = None;
                }
                () = sleep_until_opt(deadline), if deadline.is_some() && st.in_flight.is_none() => {}
                Some(reply) = self.flush_requests.recv() => self.on_flush_request(&mut st, reply),
                // systemd arms the watchdog once the service is ready.
                _ = tick_opt(&mut watchdog), if watchdog.is_some() && st.ready_sent => {
                    crate::notify::watchdog();
                }
                event = self.mqtt.poll(), if can_poll => {
                    match self.claimed_elsewhere(&event, &cancel).await {
                        Some(elsewhere) => {
                            st.claimed_elsewhere = elsewhere;
                            self.on_event(&mut st, event, true);
                        }
                        // Shutdown while the claims database was unreachable: the message
                        // stays unacknowledged, and the broker keeps it.
                        None => break,
                    }
                }
            }
        }
        self.shut_down(&mut st).await
    }

    /// Sends the open batch to the writer when it is due and the writer is idle.
    fn hand_over_due_batch(&mut self, st: &mut State, now: Instant) -> Result<(), IngestError> {
        if st.in_flight.is_some() {
            return Ok(());
        }
        if st.force_flush {
            st.force_flush = false;
            self.stats.flush_started(FlushReason::Request);
            return self.send_batch(st, FlushReason::Request);
        }
        match self.batcher.flush_reason(now.into_std()) {
            Some(reason) => {
                self.stats.flush_started(reason);
                self.send_batch(st, reason)
            }
            None => Ok(()),
        }
    }

    fn send_batch(&mut self, st: &mut State, reason: FlushReason) -> Result<(), IngestError> {
        debug_assert!(st.in_flight.is_none(), "one batch at the writer at a time");
        let learned = self.batcher.window_seen();
        let (batch, acks) = self.batcher.take_for(reason);
        if learned.is_none()
            && !st.told_window
            && let Some(window) = self.batcher.window_seen()
        {
            // Once per connection: a pause in traffic can look like a stall too.
            st.told_window = true;
            info!(
                window,
                "The broker stops sending at {window} unacknowledged messages, fewer than \
                 mqtt.receive_maximum; committing whenever it does. Raise its in-flight limit \
                 (Mosquitto: max_inflight_messages) for fewer, larger commits."
            );
        }
        st.in_flight = Some(acks);
        st.sent_seq += 1;
        // Never full: one batch at the writer at a time (checked above).
        self.writer
            .batches
            .try_send(batch)
            .map_err(|_| IngestError::WriterGone)?;
        self.update_gauges(st);
        Ok(())
    }

    fn on_commit(
        &mut self,
        st: &mut State,
        result: Option<Result<Committed, CommitError>>,
    ) -> Result<(), IngestError> {
        let committed = result.ok_or(IngestError::WriterGone)??;
        let acks = st
            .in_flight
            .take()
            .expect("a result answers the batch in flight");
        self.answer_flush_waiters(st, committed.readings as u64);
        debug!(
            readings = committed.readings,
            buckets = committed.stats.buckets_written,
            acks = acks.len(),
            took_ms = committed.took.as_secs_f64() * 1e3,
            "Committed batch."
        );
        // A packet id from an earlier connection may name another message now; the broker
        // redelivers those messages instead.
        let current = acks
            .into_iter()
            .filter(|ack| st.connected && ack.connection == st.connection);
        st.ack_backlog.extend(current);
        self.send_acks(st);
        self.batcher.released(std::time::Instant::now());
        self.update_gauges(st);
        Ok(())
    }

    /// `POST /api/v1/flush`: covers the batch at the writer (if any) and the open batch (if
    /// any, committed as soon as the writer is idle); answered when the last of them commits.
    fn on_flush_request(&mut self, st: &mut State, reply: FlushRequest) {
        let in_flight = st.in_flight.is_some().then_some(st.sent_seq);
        let open = (!self.batcher.is_empty()).then_some(st.sent_seq + 1);
        let (Some(first), Some(last)) = (in_flight.or(open), open.or(in_flight)) else {
            let _ = reply.send(0); // Nothing pending.
            return;
        };
        st.force_flush |= open.is_some();
        st.flush_waiters.push(FlushWaiter {
            first,
            last,
            committed: 0,
            reply,
        });
    }

    fn answer_flush_waiters(&mut self, st: &mut State, readings: u64) {
        let seq = st.sent_seq;
        for w in &mut st.flush_waiters {
            if (w.first..=w.last).contains(&seq) {
                w.committed += readings;
            }
        }
        for w in st.flush_waiters.extract_if(.., |w| w.last <= seq) {
            let _ = w.reply.send(w.committed); // The requester may have given up.
        }
    }

    /// Moves acks from the backlog into the client's request channel, in order, while it has
    /// room.
    fn send_acks(&mut self, st: &mut State) {
        while let Some(ack) = st.ack_backlog.front() {
            if self.mqtt.try_ack(ack).is_err() {
                break; // Full: the next AckSent event makes room.
            }
            st.ack_backlog.pop_front();
            st.acks_unwritten += 1;
        }
    }

    /// With claims ([`crate::claims`]): whether `event` is a delta message another central
    /// instance claimed. Waits, retrying, while the claims database is unreachable; `None` if
    /// shutdown comes first.
    async fn claimed_elsewhere(
        &mut self,
        event: &Result<MqttEvent, PollError>,
        cancel: &CancellationToken,
    ) -> Option<bool> {
        let Some(claims) = self.claims.as_mut() else {
            return Some(false);
        };
        let Ok(MqttEvent::Publish { topic, payload, .. }) = event else {
            return Some(false);
        };
        let delta = std::str::from_utf8(topic)
            .ok()
            .and_then(|t| {
                self.subscriptions
                    .iter()
                    .find(|s| decode::topic_matches(&s.filter, t))
            })
            .is_some_and(|s| s.format == decode::Format::Delta);
        // Not a delta message (decoding says why), or a copy of one applied here.
        let Some((gateway, at)) = delta.then(|| decode::delta_position(payload)).flatten() else {
            return Some(false);
        };
        if self.applied.contains(&gateway, &at) {
            return Some(false);
        }
        let mut failures = 0u32;
        loop {
            match claims.claim(&gateway, &at).await {
                Ok(mine) => {
                    if failures > 0 {
                        info!("Claiming delta messages again.");
                    }
                    if !mine {
                        self.stats.claimed_elsewhere.fetch_add(1, Ordering::Relaxed);
                    }
                    return Some(!mine);
                }
                Err(e) => {
                    failures += 1;
                    self.stats.claim_errors.fetch_add(1, Ordering::Relaxed);
                    if failures.is_power_of_two() {
                        warn!(
                            error = format!("{e:#}"),
                            attempt = failures,
                            "Cannot claim a delta message in PostgreSQL; delta messages wait \
                             (the broker keeps them) until it answers. Check \
                             central.claims_postgres and that the database is reachable."
                        );
                    }
                    let delay = Duration::from_millis(100)
                        .saturating_mul(2u32.saturating_pow(failures.min(9)))
                        .min(CLAIM_RETRY_MAX);
                    // The loop is alive, only waiting: systemd must not restart it for that.
                    crate::notify::watchdog();
                    tokio::select! {
                        () = cancel.cancelled() => return None,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    fn on_event(&mut self, st: &mut State, event: Result<MqttEvent, PollError>, accept: bool) {
        match event {
            Ok(MqttEvent::Publish {
                topic,
                payload,
                pkid,
                qos,
                dup,
            }) => {
                if accept {
                    self.on_publish(st, &topic, &payload, pkid, qos, dup);
                }
            }
            Ok(MqttEvent::AckSent) => {
                st.acks_unwritten = st.acks_unwritten.saturating_sub(1);
                self.stats.acks_sent.fetch_add(1, Ordering::Relaxed);
                self.send_acks(st);
                self.update_gauges(st);
            }
            Ok(MqttEvent::Connected { session_present }) => {
                st.connection += 1;
                st.connected = true;
                st.acks_unwritten = 0;
                st.ack_backlog.clear();
                st.warned_window = false;
                st.told_window = false;
                self.batcher.connected(std::time::Instant::now());
                self.backoff.reset();
                self.stats.connected.store(true, Ordering::Relaxed);
                if session_present {
                    info!("Connected to the MQTT broker; it kept our session and subscriptions.");
                    self.stats.subscribed.store(true, Ordering::Relaxed);
                    self.on_ready(st);
                } else {
                    info!("Connected to the MQTT broker with a new session; subscribing.");
                    if let Err(e) = self.mqtt.subscribe_all() {
                        error!(error = %e, "Could not queue the subscription request.");
                    }
                }
            }
            Ok(MqttEvent::Subscribed { refused }) => {
                if refused.is_empty() {
                    info!(
                        filters = self.subscriptions.len(),
                        "Subscribed to every configured filter."
                    );
                    self.stats.subscribed.store(true, Ordering::Relaxed);
                    self.on_ready(st);
                } else {
                    error!(
                        refused = ?refused,
                        "The broker refused subscriptions; check the filters and the broker's ACL."
                    );
                    let any_ok = refused.len() < self.subscriptions.len();
                    self.stats.subscribed.store(any_ok, Ordering::Relaxed);
                    if any_ok {
                        self.on_ready(st); // degraded, but ingesting what it may
                    }
                }
            }
            Ok(MqttEvent::Other | MqttEvent::DisconnectSent) => {}
            Err(e) => self.on_connection_lost(st, &e),
        }
    }

    /// The store is open (the daemon opened it before ingesting) and the broker has our
    /// subscriptions: tell systemd, once.
    fn on_ready(&self, st: &mut State) {
        if !st.ready_sent {
            st.ready_sent = true;
            crate::notify::ready();
        }
    }

    fn on_connection_lost(&mut self, st: &mut State, e: &PollError) {
        let was_connected = st.connected;
        self.stats.connection_errors.fetch_add(1, Ordering::Relaxed);
        st.connected = false;
        st.acks_unwritten = 0;
        st.ack_backlog.clear();
        self.stats.connected.store(false, Ordering::Relaxed);
        self.stats.subscribed.store(false, Ordering::Relaxed);
        if was_connected {
            self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        let delay = self.backoff.next_delay();
        let attempt = self.backoff.attempts;
        if e.refused {
            error!(
                error = %e,
                retry_in = ?delay,
                attempt,
                "The MQTT broker refused the connection; check mqtt.username, the password file \
                 and mqtt.client_id."
            );
        } else if e.tls && (attempt == 1 || attempt.is_power_of_two()) {
            error!(
                error = %e,
                retry_in = ?delay,
                attempt,
                "The TLS connection to the MQTT broker failed; check mqtt.tls.ca_file (the CA \
                 that signed the broker's certificate), that the certificate names mqtt.host, \
                 and mqtt.tls.cert_file/key_file if the broker requires a client certificate."
            );
        } else if was_connected || attempt == 1 {
            warn!(
                error = %e,
                retry_in = ?delay,
                "MQTT connection lost; reconnecting. Unacknowledged messages will be redelivered."
            );
        } else {
            warn!(error = %e, retry_in = ?delay, attempt, "MQTT broker still unreachable.");
        }
        st.reconnect_at = Some(Instant::now() + delay);
    }

    fn on_publish(
        &mut self,
        st: &mut State,
        topic: &Bytes,
        payload: &Bytes,
        pkid: u16,
        qos: u8,
        dup: bool,
    ) {
        let elsewhere = std::mem::take(&mut st.claimed_elsewhere);
        self.stats.messages_received.fetch_add(1, Ordering::Relaxed);
        let now = std::time::Instant::now();
        self.batcher.arrived(now);
        let received = Timestamp::now();
        let ctx = DecodeContext {
            received,
            oldest: received.saturating_sub(self.limits.max_age),
            newest: received.saturating_add(self.limits.max_future),
            max_payload_bytes: self.limits.max_payload_bytes,
        };
        let subscription = std::str::from_utf8(topic)
            .map_err(|_| DecodeError::InvalidUtf8)
            .and_then(|t| {
                self.subscriptions
                    .iter()
                    .find(|s| decode::topic_matches(&s.filter, t))
                    .ok_or(DecodeError::TopicMismatch)
            });
        let store_raw = subscription.is_ok_and(|s| s.store_raw);
        let result =
            subscription.and_then(|sub| decode::decode(sub, topic, payload, &ctx, &mut st.decoded));
        match result {
            Err(e) => {
                debug!(reason = e.reason(), topic = %String::from_utf8_lossy(topic), "Rejected message.");
                self.stats.reject(e, topic, payload);
            }
            Ok(()) => {
                // See `crate::dedup` for what identifies a message and when a copy is dropped.
                let receive_time = st.decoded.receive_time;
                let fp = match (receive_time, qos) {
                    (false, _) => Some(dedup::fingerprint(topic, payload, None)),
                    (true, 0) => None, // never redelivered, and identical copies are distinct
                    (true, _) => Some(dedup::fingerprint(topic, payload, Some(pkid))),
                };
                // Delta messages are told apart by their position instead (`crate::applied`).
                let fp = fp.filter(|_| st.decoded.delta_from.is_none());
                let redelivered = elsewhere
                    || match &st.decoded.delta_from {
                        Some((gateway, at)) => self.applied.contains(gateway, at),
                        None => {
                            fp.is_some_and(|fp| (dup || !receive_time) && self.dedup.contains(fp))
                        }
                    };
                if redelivered {
                    self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                    debug!(topic = %String::from_utf8_lossy(topic), dup, "Skipped a message already counted.");
                    st.decoded.clear();
                } else {
                    let mut counted = false;
                    for reading in st.decoded.readings.drain(..) {
                        match self.series.intern(&reading.series) {
                            Ok(series) => {
                                counted = true;
                                self.batcher.push_reading(
                                    series,
                                    reading.ts,
                                    reading.value,
                                    store_raw,
                                    now,
                                );
                            }
                            Err(e) => self.stats.reject(e, topic, payload),
                        }
                    }
                    for delta in st.decoded.deltas.drain(..) {
                        // A gateway's narrower bucket folds into the central's (15 min into
                        // an hour: summaries merge); a wider one cannot be split.
                        let width = self.batcher.bucket_width_secs();
                        if width % delta.width_secs != 0
                            || delta.start.rem_euclid(delta.width_secs) != 0
                        {
                            self.stats
                                .reject(DecodeError::BucketWidthMismatch, topic, payload);
                            continue;
                        }
                        let start = delta.start.div_euclid(width) * width;
                        match self.series.intern(&delta.series) {
                            Ok(series) => {
                                counted = true;
                                self.batcher
                                    .push_summary(series, start, &delta.summary, now);
                            }
                            Err(e) => self.stats.reject(e, topic, payload),
                        }
                    }
                    for e in st.decoded.rejected.drain(..) {
                        self.stats.reject(e, topic, payload);
                    }
                    if let Some(fp) = fp.filter(|_| counted) {
                        self.dedup.insert(fp);
                        self.batcher.push_fingerprint(fp);
                    }
                    if let Some((gateway, at)) = st.decoded.delta_from.take().filter(|_| counted) {
                        self.batcher.push_applied(&gateway, at.clone());
                        self.applied.insert(&gateway, at);
                    }
                }
            }
        }
        if qos > 0 {
            if !st.warned_window && self.unacked(st) >= usize::from(self.window) {
                st.warned_window = true;
                warn!(
                    window = self.window,
                    "The broker sent more unacknowledged messages than the in-flight window \
                     (mqtt.receive_maximum). It does not honour the window (Mosquitto before \
                     2.0.13 has this bug); bucketd keeps up, but after a crash redeliveries \
                     beyond limits.dedup_window messages could be counted twice. Upgrade the \
                     broker or raise limits.dedup_window."
                );
            }
            st.arrival += 1;
            self.batcher.push_ack(
                AckToken {
                    arrival: st.arrival,
                    connection: st.connection,
                    pkid,
                    qos,
                },
                now,
            );
        }
        self.update_gauges(st);
    }

    /// Messages received and not yet acknowledged on the wire.
    fn unacked(&self, st: &State) -> usize {
        self.batcher.pending_acks()
            + st.in_flight.as_ref().map_or(0, Vec::len)
            + st.ack_backlog.len()
            + st.acks_unwritten
    }

    fn update_gauges(&self, st: &State) {
        self.stats
            .pending_readings
            .store(self.batcher.pending_readings() as u64, Ordering::Relaxed);
        self.stats
            .unacked_messages
            .store(self.unacked(st) as u64, Ordering::Relaxed);
    }

    /// Shutdown: commit the commit in flight and the open batch, acknowledge them, wait until
    /// the acks are written, then disconnect. Messages arriving meanwhile are not acknowledged;
    /// the broker keeps them for the next start.
    async fn shut_down(mut self, st: &mut State) -> Result<(), IngestError> {
        let deadline = Instant::now() + SHUTDOWN_DRAIN_MAX;
        crate::notify::stopping();
        info!(
            pending_readings = self.batcher.pending_readings(),
            "Shutting down: committing pending readings."
        );
        loop {
            if st.in_flight.is_none() {
                if self.batcher.is_empty() {
                    break;
                }
                self.stats.flush_started(FlushReason::Request);
                self.send_batch(st, FlushReason::Request)?;
            }
            // Keep polling while the commit runs so the connection stays alive.
            tokio::select! {
                result = self.writer.results.recv() => self.on_commit(st, result)?,
                event = self.mqtt.poll(), if st.connected => self.on_event(st, event, false),
            }
        }
        while st.connected && (st.acks_unwritten > 0 || !st.ack_backlog.is_empty()) {
            match tokio::time::timeout_at(deadline, self.mqtt.poll()).await {
                Ok(event) => self.on_event(st, event, false),
                Err(_) => {
                    warn!(
                        unwritten = st.acks_unwritten,
                        "Gave up waiting for acknowledgements to reach the broker; it will \
                         redeliver those messages."
                    );
                    break;
                }
            }
        }
        if st.connected && self.mqtt.try_disconnect().is_ok() {
            // Poll until the DISCONNECT is written (the event loop then reports an error or
            // goes quiet).
            let written = tokio::time::timeout_at(deadline, async {
                while let Ok(event) = self.mqtt.poll().await {
                    if matches!(event, MqttEvent::DisconnectSent) {
                        break;
                    }
                }
            })
            .await;
            if written.is_err() {
                warn!("Timed out sending DISCONNECT to the broker.");
            }
        }
        self.stats.connected.store(false, Ordering::Relaxed);
        info!("Shut down cleanly.");
        Ok(())
    }
}

async fn tick_opt(interval: &mut Option<tokio::time::Interval>) {
    match interval {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
