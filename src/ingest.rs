//! The ingest task: owns the MQTT sessions and the [`Batcher`]. It decodes every PUBLISH,
//! merges its readings into the open batch, hands due batches to the writer thread, and sends the
//! acknowledgements of a batch, in arrival order, once the writer reports it committed.
//!
//! Nothing inside the loop blocks: decoding and merging are in-memory, the writer runs on its own
//! thread, and acks go through `try_ack` into a request channel sized for two full windows. When
//! the open batch is full while a commit runs, the loop stops reading from the broker until the
//! commit ends (backpressure: the broker holds the rest).
//!
//! With `mqtt.sessions = N` the loop drives N connections (one shared subscription) the same
//! way: one batch and one commit for all of them; each ack goes back on the session, and the
//! connection, its message came on.
//!
//! After a reconnect, the broker's resends (DUP) are held, their acks in the batch in arrival
//! order, until their burst ends: at the first new message, after [`RESEND_QUIET_MIN`] (or four
//! handshake times) without a resend, or at `mqtt.receive_maximum` held; no batch is handed over
//! meanwhile. Then they are admitted in order, told apart by [`crate::resend`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::ack::AckToken;
use crate::admit::{Admitted, Admitter, Message, Verdict};
use crate::batcher::{Batcher, FlushReason};
use crate::http::FlushRequest;
use crate::limits::{RESEND_QUIET_MIN, SHUTDOWN_DRAIN_MAX};
use crate::mqtt::{Backoff, Mqtt, MqttEvent, PollError};
use crate::reading::Timestamp;
use crate::reject::DecodeError;
use crate::resend::{BurstEnd, BurstPart};
use crate::stats::Stats;
use crate::store::CommitError;
use crate::writer::{Committed, Writer};

/// Why ingestion stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("commit failed; nothing of the failed batch was acknowledged: {0}")]
    Commit(#[from] CommitError),
    #[error("the writer thread stopped unexpectedly")]
    WriterGone,
}

/// One MQTT session (`mqtt.sessions`) and the state of its connection.
#[allow(clippy::struct_excessive_bools)] // connection facts, each read on its own
pub struct Session {
    mqtt: Mqtt,
    backoff: Backoff,
    /// Counts CONNACKs; a token from an older connection is never sent.
    connection: u64,
    connected: bool,
    /// The broker has this session's subscriptions (on this connection).
    subscribed: bool,
    /// The session had its subscriptions at least once (readiness).
    ever_subscribed: bool,
    /// Arrival numbers of the acks queued to the client and not yet written to the socket, in
    /// order (bounded by the client's request channel).
    acks_unwritten: VecDeque<u64>,
    /// What the broker has confirmed reading ([`Pings`]).
    pings: Pings,
    /// Acks waiting for room in the client's request channel, in arrival order. rumqttc writes
    /// one request per poll, so a broker that sends past its window (Mosquitto before 2.0.13
    /// does) can fill the channel; nothing is dropped, the rest waits here. Bounded by what the
    /// broker sends unacknowledged.
    ack_backlog: VecDeque<AckToken>,
    /// Whether the "broker exceeds its window" warning was logged on this connection.
    warned_window: bool,
    /// While the connection is down: when to try again.
    reconnect_at: Option<Instant>,
    /// The resends of a reconnect's burst, held until it ends (see the module docs).
    held: Vec<HeldMessage>,
    /// When the burst began or last grew; with `held`, when it ends.
    burst_at: Instant,
    /// The last connection's handshake time.
    handshake: std::time::Duration,
}

/// A resend held in its burst: what admitting it again needs.
struct HeldMessage {
    topic: Bytes,
    payload: Bytes,
    pkid: u16,
    qos: u8,
    received: Timestamp,
    /// Its ack token's arrival number.
    arrival: u64,
    at: std::time::Instant,
}

impl Session {
    pub fn new(mqtt: Mqtt, backoff: Backoff) -> Session {
        Session {
            mqtt,
            backoff,
            connection: 0,
            connected: false,
            subscribed: false,
            ever_subscribed: false,
            acks_unwritten: VecDeque::new(),
            pings: Pings::default(),
            ack_backlog: VecDeque::new(),
            warned_window: false,
            reconnect_at: None,
            held: Vec::new(),
            burst_at: Instant::now(),
            handshake: std::time::Duration::ZERO,
        }
    }

    /// When the held burst ends for quiet; `None` with nothing held.
    fn burst_deadline(&self) -> Option<Instant> {
        let quiet = RESEND_QUIET_MIN.max(4 * self.handshake);
        (!self.held.is_empty()).then_some(self.burst_at + quiet)
    }

    /// Messages of this session acknowledged but not yet written to the socket.
    fn acks_owed(&self) -> usize {
        self.acks_unwritten.len() + self.ack_backlog.len()
    }

    /// Moves acks from the backlog into the client's request channel, in order, while it has
    /// room.
    fn send_acks(&mut self) {
        while let Some(ack) = self.ack_backlog.front() {
            if self.mqtt.try_ack(ack).is_err() {
                break; // Full: the next AcksSent event makes room.
            }
            self.acks_unwritten.push_back(ack.arrival);
            self.ack_backlog.pop_front();
        }
    }

    /// The connection began or ended: nothing of it is owed or awaited any more.
    fn reset_connection(&mut self, first_arrival: u64) {
        self.acks_unwritten.clear();
        self.ack_backlog.clear();
        self.pings = Pings {
            first_arrival,
            ..Pings::default()
        };
    }
}

/// A connection's pings, which tell which of its acks the broker has read. A broker handles a
/// connection's packets in order and answers each PINGREQ, so a PINGRESP says it has read every
/// ack written before the PINGREQ it answers; a message whose ack the broker has read is never
/// resent, so a later burst of resends cannot hold its copy (`crate::resend`, where this tells
/// a new message on a reused packet id from a resend when their contents are the same).
#[derive(Debug, Default)]
struct Pings {
    /// The first arrival number of this connection: its acks are those of later arrivals.
    first_arrival: u64,
    /// Arrival number of the last ack written on this connection (0: none yet).
    written_through: u64,
    /// `written_through` when the last PINGREQ was written.
    pinged_through: u64,
    /// `written_through` at each PINGREQ written and not answered yet, oldest first (ours and
    /// the keep-alive ones; at most a few: one of ours at a time, and rumqttc ends the
    /// connection when a keep-alive ping goes unanswered until the next).
    sent: VecDeque<u64>,
    /// A PINGREQ asked for is in the client's request channel.
    queued: bool,
    /// When to ask for one, if the session is still quiet then ([`crate::limits::PING_QUIET`]).
    due: Option<Instant>,
}

pub struct Ingest {
    /// The sessions (`mqtt.sessions`, at least one), indexed by [`AckToken::session`].
    pub sessions: Vec<Session>,
    /// Configured subscriptions, for the log and readiness.
    pub subscriptions: usize,
    /// Decides what each message becomes ([`crate::admit`]).
    pub admit: Admitter,
    pub batcher: Batcher,
    pub stats: Arc<Stats>,
    pub writer: Writer,
    /// The broker's in-flight window (`mqtt.receive_maximum`), per session.
    pub window: u16,
    /// `POST /api/v1/flush`: commit everything pending now.
    pub flush_requests: mpsc::Receiver<FlushRequest>,
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
#[allow(clippy::struct_excessive_bools)] // each read on its own
struct State {
    /// Next arrival sequence number.
    arrival: u64,
    /// Acks of the batch at the writer, sent when it reports the commit.
    in_flight: Option<Vec<AckToken>>,
    /// Sequence number of the last batch sent to the writer.
    sent_seq: u64,
    /// Commit the open batch as soon as the writer is idle, whatever the policy says.
    force_flush: bool,
    /// The open batch repeats the messages committed before it: commit it as soon as the writer
    /// is idle (`crate::resend`).
    replay_flush: bool,
    flush_waiters: Vec<FlushWaiter>,
    /// Whether the window learned from a stall was logged since the last connection.
    told_window: bool,
    /// The session polled first next time (the loop takes turns, so that none starves).
    turn: usize,
    /// Whether READY=1 went to systemd (once: the first time the broker has our subscriptions).
    ready_sent: bool,
    /// When a refusal of a gateway's delta message was last logged, per reason.
    gateway_warned: [Option<std::time::Instant>; DecodeError::ALL.len()],
}

impl Ingest {
    /// Runs until `cancel`, then commits what is pending, acknowledges it and disconnects.
    pub async fn run(mut self, cancel: CancellationToken) -> Result<(), IngestError> {
        let mut st = State {
            arrival: 0,
            in_flight: None,
            sent_seq: 0,
            force_flush: false,
            replay_flush: false,
            flush_waiters: Vec::new(),
            told_window: false,
            turn: 0,
            ready_sent: false,
            gateway_warned: [None; DecodeError::ALL.len()],
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
            self.end_quiet_bursts(&mut st, Instant::now());
            self.hand_over_due_batch(&mut st, Instant::now())?;
            // While resends are held no batch is handed over: wake when their burst ends.
            let deadline = self
                .sessions
                .iter()
                .filter_map(Session::burst_deadline)
                .min()
                .or_else(|| self.batcher.deadline().map(Instant::from_std));
            let reconnect_at = self.sessions.iter().filter_map(|s| s.reconnect_at).min();
            let ping_at = self.sessions.iter().filter_map(|s| s.pings.due).min();
            let can_poll =
                self.sessions.iter().any(|s| s.reconnect_at.is_none()) && !self.batcher.is_full();
            st.turn = st.turn.wrapping_add(1);
            tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                result = self.writer.results.recv(), if st.in_flight.is_some() => {
                    self.on_commit(&mut st, result)?;
                }
                () = sleep_until_opt(reconnect_at), if reconnect_at.is_some() => {
                    let now = Instant::now();
                    for s in &mut self.sessions {
                        if s.reconnect_at.is_some_and(|at| at <= now) {
                            s.reconnect_at = None;
                            s.mqtt.resume();
                        }
                    }
                }
                () = sleep_until_opt(deadline), if deadline.is_some() && st.in_flight.is_none() => {}
                () = sleep_until_opt(ping_at), if ping_at.is_some() => {
                    self.send_due_pings(Instant::now());
                }
                Some(reply) = self.flush_requests.recv() => self.on_flush_request(&mut st, reply),
                // systemd arms the watchdog once the service is ready.
                () = tick_opt(&mut watchdog), if watchdog.is_some() && st.ready_sent => {
                    crate::notify::watchdog();
                }
                (session, event) = poll_any(&mut self.sessions, st.turn, |_, s| s.reconnect_at.is_none()), if can_poll => {
                    self.on_event(&mut st, session, event, true);
                }
            }
        }
        self.shut_down(&mut st).await
    }

    /// Sends the open batch to the writer when it is due, the writer is idle and no resends are
    /// held (their acks are in the batch, their readings not yet).
    fn hand_over_due_batch(&mut self, st: &mut State, now: Instant) -> Result<(), IngestError> {
        if st.in_flight.is_some() || self.sessions.iter().any(|s| !s.held.is_empty()) {
            return Ok(());
        }
        if st.replay_flush {
            self.stats.flush_started(FlushReason::Replay);
            return self.send_batch(st, FlushReason::Replay);
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
        let (batch, acks) = self.batcher.take_for(reason, std::time::Instant::now());
        self.admit.resends().batch_taken();
        st.replay_flush = false;
        if learned.is_none()
            && !st.told_window
            && let Some(window) = self.batcher.window_seen()
        {
            // Once per connection. A pause in traffic can look like a stall too (a short
            // backlog sent at a reconnect, then nothing), so the message advises stating the
            // broker's configured limit, not the number seen.
            st.told_window = true;
            info!(
                window,
                "The broker stopped sending at {window} unacknowledged messages: taken as its \
                 in-flight window (fewer than mqtt.receive_maximum), so a batch is committed \
                 whenever it holds that many, until more are unacknowledged. A pause in traffic \
                 looks the same. If the broker enforces a window (MQTT 3.1.1: Mosquitto's \
                 max_inflight_messages, EMQX's max_inflight), state it in mqtt.broker_window to \
                 skip learning it on every connection, or raise the broker's limit for fewer, \
                 larger commits. If ingestion falls behind, mqtt.sessions opens several \
                 sessions, a window each (README, \"Broker settings\")."
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
        Self::answer_flush_waiters(st, committed.readings as u64);
        for series in &committed.forgotten {
            if !self.batcher.holds_series(series) {
                self.admit.forget_series(series);
            }
        }
        debug!(
            readings = committed.readings,
            buckets = committed.stats.buckets_written,
            acks = acks.len(),
            took_ms = committed.took.as_secs_f64() * 1e3,
            "Committed batch."
        );
        // A packet id from an earlier connection may name another message now; the broker
        // redelivers those messages instead.
        for ack in acks {
            if let Some(s) = self.sessions.get_mut(usize::from(ack.session))
                && s.connected
                && ack.connection == s.connection
            {
                s.ack_backlog.push_back(ack);
            }
        }
        for s in &mut self.sessions {
            s.send_acks();
        }
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

    fn answer_flush_waiters(st: &mut State, readings: u64) {
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

    fn on_event(
        &mut self,
        st: &mut State,
        session: usize,
        event: Result<MqttEvent, PollError>,
        accept: bool,
    ) {
        match event {
            Ok(MqttEvent::Publish {
                topic,
                payload,
                pkid,
                qos,
                dup,
            }) => {
                if accept {
                    self.on_publish(st, session, &topic, &payload, pkid, qos, dup);
                }
            }
            Ok(MqttEvent::AcksSent(n)) => {
                let s = &mut self.sessions[session];
                let written = s.acks_unwritten.len().min(n);
                if let Some(&last) = s.acks_unwritten.get(written.wrapping_sub(1)) {
                    s.pings.written_through = last;
                }
                s.acks_unwritten.drain(..written);
                s.send_acks();
                self.schedule_ping(session);
                self.stats.acks_sent.fetch_add(n as u64, Ordering::Relaxed);
                self.update_gauges(st);
            }
            Ok(MqttEvent::Connected {
                session_present,
                handshake,
            }) => {
                let s = &mut self.sessions[session];
                s.connection += 1;
                s.connected = true;
                s.subscribed = session_present;
                s.reset_connection(st.arrival + 1);
                s.warned_window = false;
                s.backoff.reset();
                // Held resends of the last connection are resent again on this one.
                s.held.clear();
                s.burst_at = Instant::now();
                s.handshake = handshake;
                st.told_window = false;
                let id = u16::try_from(session).expect("at most SESSIONS_MAX sessions");
                self.admit.resends().connected(id, session_present);
                self.batcher
                    .connected(id, std::time::Instant::now(), handshake);
                if session_present {
                    info!(
                        session,
                        "Connected to the MQTT broker; it kept our session and subscriptions."
                    );
                    self.on_subscribed(st, session);
                } else {
                    info!(
                        session,
                        "Connected to the MQTT broker with a new session; subscribing."
                    );
                    if let Err(e) = self.sessions[session].mqtt.subscribe_all() {
                        error!(session, error = %e, "Could not queue the subscription request.");
                    }
                }
                self.update_link_gauges();
            }
            Ok(MqttEvent::Subscribed { refused }) => {
                if refused.is_empty() {
                    info!(
                        session,
                        filters = self.subscriptions,
                        "Subscribed to every configured filter."
                    );
                    self.on_subscribed(st, session);
                } else {
                    error!(
                        session,
                        refused = ?refused,
                        "The broker refused subscriptions; check the filters and the broker's ACL."
                    );
                    if refused.len() < self.subscriptions {
                        // Degraded, but ingesting what it may.
                        self.on_subscribed(st, session);
                    }
                }
            }
            Ok(MqttEvent::PingSent) => {
                let p = &mut self.sessions[session].pings;
                p.sent.push_back(p.written_through);
                p.pinged_through = p.written_through;
                p.queued = false;
            }
            Ok(MqttEvent::PingAnswered) => {
                let s = &mut self.sessions[session];
                let p = &mut s.pings;
                if let Some(through) = p.sent.pop_front()
                    && through >= p.first_arrival
                {
                    let id = u16::try_from(session).expect("at most SESSIONS_MAX sessions");
                    self.admit.resends().confirm(id, p.first_arrival, through);
                }
                self.schedule_ping(session);
            }
            Ok(MqttEvent::Other | MqttEvent::DisconnectSent) => {}
            Err(e) => self.on_connection_lost(session, &e),
        }
    }

    /// The broker has (some of) `session`'s subscriptions. Once every session has had them and
    /// the store is open (the daemon opened it before ingesting): tell systemd, once.
    fn on_subscribed(&mut self, st: &mut State, session: usize) {
        let s = &mut self.sessions[session];
        s.subscribed = true;
        s.ever_subscribed = true;
        self.update_link_gauges();
        if !st.ready_sent && self.sessions.iter().all(|s| s.ever_subscribed) {
            st.ready_sent = true;
            crate::notify::ready();
        }
    }

    /// `connected` and `subscribed` (readiness) hold when they hold for every session.
    fn update_link_gauges(&self) {
        let all = |f: fn(&Session) -> bool| self.sessions.iter().all(f);
        self.stats
            .connected
            .store(all(|s| s.connected), Ordering::Relaxed);
        self.stats
            .subscribed
            .store(all(|s| s.connected && s.subscribed), Ordering::Relaxed);
    }

    fn on_connection_lost(&mut self, session: usize, e: &PollError) {
        let s = &mut self.sessions[session];
        let was_connected = s.connected;
        s.connected = false;
        s.subscribed = false;
        s.reset_connection(u64::MAX);
        // Unacknowledged, the held resends come again with the next connection's burst.
        s.held.clear();
        let id = u16::try_from(session).expect("at most SESSIONS_MAX sessions");
        self.admit.resends().disconnected(id);
        let delay = s.backoff.next_delay();
        let attempt = s.backoff.attempts;
        s.reconnect_at = Some(Instant::now() + delay);
        self.stats.connection_errors.fetch_add(1, Ordering::Relaxed);
        self.update_link_gauges();
        if was_connected {
            self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        if e.refused {
            error!(
                session,
                error = %e,
                retry_in = ?delay,
                attempt,
                "The MQTT broker refused the connection; check mqtt.username, the password file \
                 and mqtt.client_id."
            );
        } else if e.tls && (attempt == 1 || attempt.is_power_of_two()) {
            error!(
                session,
                error = %e,
                retry_in = ?delay,
                attempt,
                "The TLS connection to the MQTT broker failed; check mqtt.tls.ca_file (the CA \
                 that signed the broker's certificate), that the certificate names mqtt.host, \
                 and mqtt.tls.cert_file/key_file if the broker requires a client certificate."
            );
        } else if was_connected || attempt == 1 {
            warn!(
                session,
                error = %e,
                retry_in = ?delay,
                "MQTT connection lost; reconnecting. Unacknowledged messages will be redelivered."
            );
        } else {
            warn!(session, error = %e, retry_in = ?delay, attempt, "MQTT broker still unreachable.");
        }
    }

    #[allow(clippy::too_many_arguments)] // one PUBLISH, taken apart
    fn on_publish(
        &mut self,
        st: &mut State,
        session: usize,
        topic: &Bytes,
        payload: &Bytes,
        pkid: u16,
        qos: u8,
        dup: bool,
    ) {
        self.stats.messages_received.fetch_add(1, Ordering::Relaxed);
        let now = std::time::Instant::now();
        let id = u16::try_from(session).expect("at most SESSIONS_MAX sessions");
        if qos > 0 {
            self.batcher.arrived(now);
            if !dup && self.admit.resends().in_burst(id) {
                // The broker has resent everything: the burst is over.
                self.end_burst(st, session, BurstEnd::NewMessage);
            }
        }
        let received = Timestamp::now();
        let admitted = self.admit.admit(&Message {
            topic,
            payload,
            pkid,
            qos,
            dup,
            session: id,
            received,
            burst: None,
            // Its ack token's, made below.
            arrival: st.arrival + 1,
        });
        if admitted.verdict == Verdict::Held {
            let s = &mut self.sessions[session];
            s.held.push(HeldMessage {
                topic: topic.clone(),
                payload: payload.clone(),
                pkid,
                qos,
                received,
                arrival: st.arrival + 1,
                at: now,
            });
            s.burst_at = Instant::now();
            if self.admit.resends().is_full(id) {
                self.end_burst(st, session, BurstEnd::Pause);
            }
        } else {
            Self::apply(
                &mut self.batcher,
                &self.stats,
                st,
                admitted,
                topic,
                payload,
                now,
            );
        }
        if qos > 0 {
            let s = &self.sessions[session];
            if !s.warned_window && self.unacked_on(session) >= usize::from(self.window) {
                self.sessions[session].warned_window = true;
                warn!(
                    session,
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
                    connection: self.sessions[session].connection,
                    session: u16::try_from(session).expect("at most SESSIONS_MAX sessions"),
                    pkid,
                    qos,
                },
                now,
            );
        }
        self.update_gauges(st);
    }

    /// What an admitted message's verdict does: readings, buckets and its fingerprint to the
    /// batch, refusals and copies to the counters.
    fn apply(
        batcher: &mut Batcher,
        stats: &Stats,
        st: &mut State,
        admitted: &mut Admitted,
        topic: &[u8],
        payload: &[u8],
        now: std::time::Instant,
    ) {
        match admitted.verdict {
            Verdict::Rejected(e) => {
                debug!(reason = e.reason(), topic = %String::from_utf8_lossy(topic), "Rejected message.");
                stats.reject(e, topic, payload);
                if let Some(gateway) = &admitted.gateway {
                    warn_gateway(&mut st.gateway_warned, gateway, e, "message", now);
                }
            }
            Verdict::Copy => {
                stats.duplicates.fetch_add(1, Ordering::Relaxed);
                debug!(topic = %String::from_utf8_lossy(topic), "Skipped a message already counted.");
            }
            Verdict::New => {
                let raw = admitted.store_raw;
                for (series, ts, value) in admitted.readings.drain(..) {
                    batcher.push_reading(series, ts, value, raw, now);
                }
                for (series, start, summary) in admitted.summaries.drain(..) {
                    batcher.push_summary(series, start, &summary, now);
                }
                stats.reject_all(&admitted.rejected, topic, payload);
                if let Some(gateway) = &admitted.gateway {
                    for e in admitted.rejected.drain(..) {
                        warn_gateway(&mut st.gateway_warned, gateway, e, "bucket", now);
                    }
                }
                admitted.rejected.clear();
                if let Some((fp, tag)) = admitted.fingerprint {
                    batcher.push_fingerprint(fp, tag);
                }
                for (key, at) in admitted.retired.drain(..) {
                    batcher.push_applied(&key, at);
                }
                if let Some((gateway, at)) = admitted.applied.take() {
                    batcher.push_applied(&gateway, at);
                }
                st.replay_flush |= admitted.replay;
            }
            Verdict::Held => unreachable!("held messages are kept by the caller"),
        }
    }

    /// Whether `session` owes the broker a PINGREQ: acks written since its last one, nothing
    /// else unacknowledged (so that the answer confirms everything), and none queued or awaiting
    /// its answer.
    fn ping_owed(&self, session: usize) -> bool {
        let s = &self.sessions[session];
        let p = &s.pings;
        s.connected
            && self.batcher.unacked_of(session) == 0
            && s.acks_owed() == 0
            && !p.queued
            && p.sent.is_empty()
            && p.written_through > p.pinged_through
    }

    /// After acks were written or a ping answered: asks for a PINGREQ in
    /// [`crate::limits::PING_QUIET`] if `session` owes one ([`Pings`]). Confirmation is for a
    /// sensor slower than that and the round trip: the broker answers before its next message,
    /// which can then be told from a resend even if it is lost on the wire. A busy stream (its
    /// next message on its way before an answer could come) sends none.
    fn schedule_ping(&mut self, session: usize) {
        let owed = self.ping_owed(session);
        let p = &mut self.sessions[session].pings;
        p.due = owed.then(|| Instant::now() + crate::limits::PING_QUIET);
    }

    /// Asks for the PINGREQs that have come due, where still owed.
    fn send_due_pings(&mut self, now: Instant) {
        for session in 0..self.sessions.len() {
            if self.sessions[session].pings.due.is_some_and(|at| at <= now) {
                let owed = self.ping_owed(session);
                let s = &mut self.sessions[session];
                s.pings.due = None;
                if owed {
                    s.pings.queued = s.mqtt.try_ping().is_ok();
                }
            }
        }
    }

    /// Ends `session`'s burst of resends and admits what it held, in order, as
    /// [`crate::resend`] tells them apart. Their acks are in the batch already.
    fn end_burst(&mut self, st: &mut State, session: usize, end: BurstEnd) {
        let id = u16::try_from(session).expect("at most SESSIONS_MAX sessions");
        let parts = self.admit.resends().end_burst(id, end);
        let held = std::mem::take(&mut self.sessions[session].held);
        if held.is_empty() {
            return;
        }
        debug_assert_eq!(
            parts.len(),
            held.len(),
            "held here and in `resend` together"
        );
        let count = |part| parts.iter().filter(|p| **p == part).count();
        info!(
            session,
            resent = held.len(),
            copies = count(BurstPart::Copy),
            reused_ids = count(BurstPart::New),
            "The broker resent the messages it had not seen acknowledged; those counted already \
             are skipped (reused_ids: new messages on the packet ids of counted ones)."
        );
        for (h, part) in held.into_iter().zip(parts) {
            let admitted = self.admit.admit(&Message {
                topic: &h.topic,
                payload: &h.payload,
                pkid: h.pkid,
                qos: h.qos,
                dup: true,
                session: id,
                received: h.received,
                burst: Some(part),
                arrival: h.arrival,
            });
            Self::apply(
                &mut self.batcher,
                &self.stats,
                st,
                admitted,
                &h.topic,
                &h.payload,
                h.at,
            );
        }
        self.update_gauges(st);
    }

    /// Ends the bursts that have been quiet long enough.
    fn end_quiet_bursts(&mut self, st: &mut State, now: Instant) {
        for session in 0..self.sessions.len() {
            if self.sessions[session]
                .burst_deadline()
                .is_some_and(|at| at <= now)
            {
                self.end_burst(st, session, BurstEnd::Pause);
            }
        }
    }

    /// Messages received and not yet acknowledged on the wire.
    fn unacked(&self, st: &State) -> usize {
        self.batcher.pending_acks()
            + st.in_flight.as_ref().map_or(0, Vec::len)
            + self.sessions.iter().map(Session::acks_owed).sum::<usize>()
    }

    /// Messages of `session`'s current connection received and not yet acknowledged on the
    /// wire.
    fn unacked_on(&self, session: usize) -> usize {
        self.batcher.unacked_of(session) + self.sessions[session].acks_owed()
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
        // Held resends first: their acks are in the batch.
        for session in 0..self.sessions.len() {
            self.end_burst(st, session, BurstEnd::Pause);
        }
        loop {
            if st.in_flight.is_none() {
                if self.batcher.is_empty() {
                    break;
                }
                self.stats.flush_started(FlushReason::Request);
                self.send_batch(st, FlushReason::Request)?;
            }
            // Keep polling while the commit runs so the connections stay alive.
            let any_connected = self.sessions.iter().any(|s| s.connected);
            tokio::select! {
                result = self.writer.results.recv() => self.on_commit(st, result)?,
                (session, event) = poll_any(&mut self.sessions, st.turn, |_, s| s.connected), if any_connected => {
                    self.on_event(st, session, event, false);
                }
            }
        }
        let owes = |s: &Session| s.connected && s.acks_owed() > 0;
        while self.sessions.iter().any(owes) {
            if let Ok((session, event)) =
                tokio::time::timeout_at(deadline, poll_any(&mut self.sessions, 0, |_, s| owes(s)))
                    .await
            {
                self.on_event(st, session, event, false);
            } else {
                warn!(
                    unwritten = self.sessions.iter().map(Session::acks_owed).sum::<usize>(),
                    "Gave up waiting for acknowledgements to reach the broker; it will \
                     redeliver those messages."
                );
                break;
            }
        }
        // Poll each session until its DISCONNECT is written (its event loop then reports an
        // error or goes quiet).
        let mut closing: Vec<bool> = self
            .sessions
            .iter()
            .map(|s| s.connected && s.mqtt.try_disconnect().is_ok())
            .collect();
        let written = tokio::time::timeout_at(deadline, async {
            while closing.iter().any(|c| *c) {
                let open = closing.clone();
                let (session, event) = poll_any(&mut self.sessions, 0, |i, _| open[i]).await;
                if matches!(event, Err(_) | Ok(MqttEvent::DisconnectSent)) {
                    closing[session] = false;
                }
            }
        })
        .await;
        if written.is_err() {
            warn!("Timed out sending DISCONNECT to the broker.");
        }
        self.stats.connected.store(false, Ordering::Relaxed);
        info!("Shut down cleanly.");
        Ok(())
    }
}

/// An event and the session it came from.
type Polled = (usize, Result<MqttEvent, PollError>);

/// The first event of the sessions that `pick(index, session)` selects, with its session.
/// Turns rotate with `turn`, so that a busy session cannot starve the others. Cancel-safe.
async fn poll_any(
    sessions: &mut [Session],
    turn: usize,
    mut pick: impl FnMut(usize, &Session) -> bool,
) -> Polled {
    let n = sessions.len();
    std::future::poll_fn(|cx| {
        for k in 0..n {
            let i = (turn + k) % n;
            let s = &mut sessions[i];
            if pick(i, s)
                && let Poll::Ready(event) = s.mqtt.poll_event(cx)
            {
                return Poll::Ready((i, event));
            }
        }
        Poll::Pending
    })
    .await
}

/// Logs a refusal of a gateway's delta message (or one of its buckets) at a central, at most
/// once a minute per reason: a gateway that sends the same bad message on every retry must not
/// flood the log, and the counter (`bucketd_readings_rejected_total`) and the dead letters keep
/// every one.
fn warn_gateway(
    warned: &mut [Option<std::time::Instant>],
    gateway: &str,
    reason: DecodeError,
    what: &str,
    now: std::time::Instant,
) {
    const EVERY: std::time::Duration = std::time::Duration::from_mins(1);
    let last = &mut warned[reason.index()];
    if last.is_some_and(|t| now.duration_since(t) < EVERY) {
        return;
    }
    *last = Some(now);
    warn!(
        gateway,
        reason = reason.reason(),
        "A central refused a gateway's delta {what}: {reason}. It is counted in \
         bucketd_readings_rejected_total and kept in the dead letters (GET /api/v1/rejected); \
         the same refusal is logged at most once a minute."
    );
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
