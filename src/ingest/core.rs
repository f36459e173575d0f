//! The ingest loop's state machine: what each event (a packet from the broker, a commit, a
//! flush request, time passing) does to the sessions, the open batch and the acks owed, and
//! what the shell ([`super::Ingest`]) must do about it. No I/O, no Tokio and no clock: time
//! comes in with each call, actions go out in a list, and acks and pings are taken one at a
//! time by the shell as its clients have room ([`Core::outgoing`]).
//!
//! One owner for each piece of state: a session's link, acks, pings and reconnect burst (the
//! held resends, bodies and fingerprints together) live in its [`SessionState`]; the batch and
//! the broker windows in the [`Batcher`]; the sessions' sequences of counted messages, which
//! tell a burst's copies from new messages, in [`crate::resend`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tracing::{debug, error, info, warn};

use crate::ack::{AckToken, SessionId};
use crate::admit::{Admitted, Admitter, InBurst, Message, Verdict};
use crate::batcher::{Batch, Batcher, Committed, FlushReason};
use crate::link::{Backoff, MqttEvent, PollError, Publish};
use crate::reading::Timestamp;
use crate::reject::DecodeError;
use crate::resend::{BurstEnd, BurstPart, Held};

use self::session::{
    HeldMessage, Link, MARKERS_IN_FLIGHT_MAX, Marker, SessionState, Subscriptions,
};
use crate::stats::Stats;

/// The time of a step, on both clocks: `at` orders deadlines, `wall` stamps what arrives.
#[derive(Debug, Clone, Copy)]
pub struct Now {
    pub at: Instant,
    pub wall: Timestamp,
    /// How long the event may have waited, ready, before `at` because the loop was not
    /// running: its threads' time runnable but without a core while it waited for the event
    /// (the shell measures it where the system tells, [`Core::wants_lag`]); zero otherwise.
    pub lag: Duration,
}

/// What happened, as the shell saw it.
pub enum Event<R> {
    /// A session's client reported a packet read or written, or the connection's end.
    Mqtt(SessionId, Result<MqttEvent, PollError>),
    /// The writer committed the batch in flight (a commit that fails for good ends ingestion
    /// in the shell: nothing of it is acknowledged).
    Committed(Committed),
    /// `POST /api/v1/flush`: answered with the readings committed once what is pending is.
    Flush(R),
}

/// What the shell must do.
#[derive(Debug)]
pub enum Action<R> {
    /// Let the session's client connect again (its backoff is over).
    Resume(SessionId),
    /// Ask the broker for the session's subscriptions (a new session).
    Subscribe(SessionId),
    /// Hand this batch to the writer (nothing else is at the writer).
    Write(Batch),
    /// Answer a flush request with the readings its commits held.
    Answer(R, u64),
    /// Tell systemd the daemon is ready (once).
    Ready,
    /// Publish this message (QoS 0) on the session: a Sparkplug rebirth request (topic,
    /// payload).
    Publish(SessionId, String, Vec<u8>),
}

/// What a session has to send next ([`Core::outgoing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outgoing {
    Ack(AckToken),
    Ping,
}

/// Whether the loop takes new messages, or drains what it has at shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Running,
    /// Shutting down: messages still arriving are neither counted nor acknowledged (the broker
    /// keeps them for the next start).
    Draining,
}

/// A flush request waiting for the commits that cover what was pending when it came.
struct FlushWaiter<R> {
    /// Batch sequence numbers `first..=last` hold what was pending.
    first: u64,
    last: u64,
    committed: u64,
    reply: R,
}

/// What the core is built from.
pub struct Parts {
    /// Decides what each message becomes ([`crate::admit`]).
    pub admit: Admitter,
    pub batcher: Batcher,
    pub stats: Arc<Stats>,
    /// `mqtt.sessions`, at least one.
    pub sessions: u16,
    /// Each session's reconnect backoff, as configured.
    pub backoff: Backoff,
    /// Configured subscriptions, for the log and readiness.
    pub subscriptions: usize,
    /// The broker's in-flight window (`mqtt.receive_maximum`), per session.
    pub window: u16,
}

/// The ingest loop's state; `R` answers a flush request (a channel's sender in the daemon).
pub struct Core<R> {
    sessions: Vec<SessionState>,
    admit: Admitter,
    batcher: Batcher,
    stats: Arc<Stats>,
    subscriptions: usize,
    window: u16,
    mode: Mode,
    /// Next arrival sequence number.
    arrival: u64,
    /// Acks of the batch at the writer, sent when it reports the commit.
    in_flight: Option<Vec<AckToken>>,
    /// Sequence number of the last batch sent to the writer.
    sent_seq: u64,
    /// Commit the open batch as soon as the writer is idle, whatever the policy says: a flush
    /// request, or a batch that repeats the messages committed before it (`crate::resend`;
    /// it wins: it covers the request's batch too).
    urgent: Option<FlushReason>,
    /// When the last requested commit went to the writer: a request commits at once at most
    /// once a `batch.flush_interval`, later ones share the next commit (issue 52: a loop of
    /// `POST /api/v1/flush` multiplied a gateway's writes 48x).
    requested_at: Option<Instant>,
    flush_waiters: Vec<FlushWaiter<R>>,
    /// Whether READY=1 went to systemd (once: the first time the broker has our subscriptions).
    ready: bool,
    /// When a refusal of a gateway's delta message was last logged, per reason.
    gateway_warned: [Option<Instant>; DecodeError::ALL.len()],
    /// When a Sparkplug rebirth request was last logged, and the requests sent since: a line
    /// a minute at most, whatever edge nodes (or a publisher inventing them) cause.
    rebirths_logged: (Option<Instant>, u64),
}

impl<R> Core<R> {
    pub fn new(parts: Parts, now: Instant) -> Core<R> {
        Core {
            sessions: (0..parts.sessions)
                // A reconnect's burst holds at most what the broker may have unacknowledged.
                .map(|_| SessionState::new(parts.backoff.clone(), usize::from(parts.window), now))
                .collect(),
            admit: parts.admit,
            batcher: parts.batcher,
            stats: parts.stats,
            subscriptions: parts.subscriptions,
            window: parts.window,
            mode: Mode::Running,
            arrival: 0,
            in_flight: None,
            sent_seq: 0,
            urgent: None,
            requested_at: None,
            flush_waiters: Vec::new(),
            ready: false,
            gateway_warned: [None; DecodeError::ALL.len()],
            rebirths_logged: (None, 0),
        }
    }

    /// The sessions, in order.
    pub fn session_ids(&self) -> impl Iterator<Item = SessionId> + use<R> {
        SessionId::all(self.sessions.len())
    }

    /// Whether the shell should read `session`'s client: not while it waits to reconnect, and
    /// while draining only a connected one.
    pub fn polls(&self, session: SessionId) -> bool {
        let s = &self.sessions[session.index()];
        match self.mode {
            Mode::Running => !matches!(s.link, Link::Waiting { .. }),
            Mode::Draining => s.is_up(),
        }
    }

    /// Whether the loop reads from the broker at all: not while the open batch is full and a
    /// commit runs (backpressure: the broker holds the rest).
    pub fn reads(&self) -> bool {
        !self.batcher.is_full() && self.session_ids().any(|s| self.polls(s))
    }

    /// Whether the next event's [`Now::lag`] counts: the next QoS 1/2 message would be the
    /// open batch's first, whose delay after the last release tells a broker's refill from
    /// publishers' traffic. (Measuring it costs a few system calls; once per batch.)
    pub fn wants_lag(&self) -> bool {
        self.batcher.awaits_first_arrival()
    }

    /// Whether a batch is at the writer.
    pub fn committing(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Whether the clients' TCP ACKs may wait a little for the next (the batcher's rule,
    /// [`crate::batcher::Learner::acks_may_wait`]); the shell tells the clients.
    pub fn acks_may_wait(&self) -> bool {
        self.batcher.acks_may_wait()
    }

    /// Whether systemd was told the daemon is ready (its watchdog is armed then).
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// When [`Core::tick`] has something to do next: a reconnect, and while no batch is at the
    /// writer the end of a burst, a batch falling due or a held-back flush request's turn.
    pub fn wake_at(&self) -> Option<Instant> {
        let reconnect = self.sessions.iter().filter_map(|s| match s.link {
            Link::Waiting { retry_at } => Some(retry_at),
            _ => None,
        });
        // While resends are held no batch is handed over: wake when their burst ends.
        let deadline = self
            .sessions
            .iter()
            .filter_map(SessionState::burst_deadline)
            .min()
            .or_else(|| {
                let request = self.request_held_until();
                [self.batcher.deadline(), request]
                    .into_iter()
                    .flatten()
                    .min()
            })
            .filter(|_| self.in_flight.is_none());
        reconnect.chain(deadline).min()
    }

    /// Until when a pending flush request waits for its turn: a `batch.flush_interval` after
    /// the last requested commit. `None` with no request pending.
    fn request_held_until(&self) -> Option<Instant> {
        let interval = self.batcher.flush_interval();
        (self.urgent == Some(FlushReason::Request))
            .then(|| self.requested_at.map(|t| t + interval))
            .flatten()
    }

    /// Time passed: resumes the sessions whose backoff is over, ends the bursts that have been
    /// quiet long enough, and hands the open batch to the writer when it is due.
    pub fn tick(&mut self, now: Now, out: &mut Vec<Action<R>>) {
        for (id, s) in SessionId::all(self.sessions.len()).zip(&mut self.sessions) {
            if let Link::Waiting { retry_at } = s.link
                && retry_at <= now.at
            {
                s.link = Link::Connecting;
                out.push(Action::Resume(id));
            }
        }
        for id in self.session_ids() {
            if self.sessions[id.index()]
                .burst_deadline()
                .is_some_and(|at| at <= now.at)
            {
                self.end_burst(id, BurstEnd::Pause);
            }
        }
        self.hand_over_due_batch(now.at, out);
    }

    /// What `session` has to send next: its released acks in arrival order, then the release's
    /// marker PINGREQ ([`Marker`]). The shell offers it to the client and reports with
    /// [`Core::taken`].
    pub fn outgoing(&self, session: SessionId) -> Option<Outgoing> {
        let s = &self.sessions[session.index()];
        if let Some(ack) = s.acks.backlog.front() {
            return Some(Outgoing::Ack(*ack));
        }
        let p = &s.pings;
        (s.is_up()
            && matches!(p.marker, Marker::Wanted { .. })
            && !p.queued
            && p.sent.len() < MARKERS_IN_FLIGHT_MAX)
            .then_some(Outgoing::Ping)
    }

    /// The client took what [`Core::outgoing`] returned (`taken`), or had no room for it.
    pub fn taken(&mut self, session: SessionId, what: Outgoing, taken: bool) {
        let s = &mut self.sessions[session.index()];
        match what {
            // Not taken: the client's channel is full; its next AcksSent makes room.
            Outgoing::Ack(ack) => {
                if taken {
                    s.acks.unwritten.push_back(ack.arrival);
                    s.acks.backlog.pop_front();
                }
            }
            Outgoing::Ping => s.pings.queued = taken,
        }
    }

    /// Handles one event.
    pub fn handle(&mut self, event: Event<R>, now: Now, out: &mut Vec<Action<R>>) {
        match event {
            Event::Mqtt(session, Ok(event)) => self.on_mqtt(session, event, now, out),
            Event::Mqtt(session, Err(e)) => self.on_connection_lost(session, &e, now.at),
            Event::Committed(committed) => self.on_commit(&committed, now.at, out),
            Event::Flush(reply) => self.on_flush_request(reply, out),
        }
    }

    /// Sends the open batch to the writer when it is due, the writer is idle and no resends are
    /// held (their acks are in the batch, their readings not yet).
    fn hand_over_due_batch(&mut self, now: Instant, out: &mut Vec<Action<R>>) {
        if self.in_flight.is_some() || self.sessions.iter().any(SessionState::holds_resends) {
            return;
        }
        let held = self.request_held_until().is_some_and(|until| now < until);
        let urgent = if held { None } else { self.urgent.take() };
        if let Some(reason) = urgent.or_else(|| self.batcher.flush_reason(now)) {
            self.send_batch(reason, now, out);
        }
    }

    fn send_batch(&mut self, reason: FlushReason, now: Instant, out: &mut Vec<Action<R>>) {
        debug_assert!(
            self.in_flight.is_none(),
            "one batch at the writer at a time"
        );
        self.stats.flush_started(reason);
        let (batch, acks) = self.batcher.take_for(reason, now);
        self.admit.resends().batch_taken();
        // Whatever its reason, the batch holds what an urgent commit was for.
        self.urgent = None;
        if reason == FlushReason::Request {
            self.requested_at = Some(now);
        }
        if let Some(window) = self.batcher.newly_learned() {
            // Once per connection. A pause in traffic can look like a stall too (a short
            // backlog sent at a reconnect, then nothing), so the message advises stating the
            // broker's configured limit, not the number seen.
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
        self.in_flight = Some(acks);
        self.sent_seq += 1;
        out.push(Action::Write(batch));
        self.update_gauges();
    }

    fn on_commit(&mut self, committed: &Committed, now: Instant, out: &mut Vec<Action<R>>) {
        let Some(acks) = self.in_flight.take() else {
            // The shell waits for a result only with a batch at the writer.
            debug_assert!(false, "a commit result with no batch at the writer");
            return;
        };
        self.answer_flush_waiters(committed.readings as u64, out);
        for series in &committed.forgotten {
            if !self.batcher.holds_series(series) {
                self.admit.forget_series(series);
            }
        }
        debug!(
            readings = committed.readings,
            buckets = committed.buckets,
            acks = acks.len(),
            took_ms = committed.took.as_secs_f64() * 1e3,
            "Committed batch."
        );
        // A packet id from an earlier connection may name another message now; the broker
        // redelivers those messages instead.
        for ack in acks {
            if let Some(s) = self.sessions.get_mut(usize::from(ack.session))
                && s.is_up()
                && ack.connection == s.connection
            {
                s.acks.backlog.push_back(ack);
                s.pings.marker = Marker::Wanted {
                    through: ack.arrival,
                };
            }
        }
        self.batcher.released(now);
        self.update_gauges();
    }

    /// `POST /api/v1/flush`: covers the batch at the writer (if any) and the open batch (if
    /// any, committed as soon as the writer is idle); answered when the last of them commits.
    fn on_flush_request(&mut self, reply: R, out: &mut Vec<Action<R>>) {
        let in_flight = self.in_flight.is_some().then_some(self.sent_seq);
        let open = (!self.batcher.is_empty()).then_some(self.sent_seq + 1);
        let (Some(first), Some(last)) = (in_flight.or(open), open.or(in_flight)) else {
            out.push(Action::Answer(reply, 0)); // Nothing pending.
            return;
        };
        if open.is_some() {
            self.urgent.get_or_insert(FlushReason::Request);
        }
        self.flush_waiters.push(FlushWaiter {
            first,
            last,
            committed: 0,
            reply,
        });
    }

    fn answer_flush_waiters(&mut self, readings: u64, out: &mut Vec<Action<R>>) {
        let seq = self.sent_seq;
        for w in &mut self.flush_waiters {
            if (w.first..=w.last).contains(&seq) {
                w.committed += readings;
            }
        }
        for w in self.flush_waiters.extract_if(.., |w| w.last <= seq) {
            out.push(Action::Answer(w.reply, w.committed));
        }
    }

    fn on_mqtt(
        &mut self,
        session: SessionId,
        event: MqttEvent,
        now: Now,
        out: &mut Vec<Action<R>>,
    ) {
        let i = session.index();
        match event {
            MqttEvent::Publish(publish) => {
                if self.mode == Mode::Running {
                    self.on_publish(session, &publish, now, out);
                }
            }
            MqttEvent::AcksSent(n) => {
                let s = &mut self.sessions[i];
                let written = s.acks.unwritten.len().min(n);
                if let Some(&last) = s.acks.unwritten.get(written.wrapping_sub(1)) {
                    s.pings.written_through = last;
                }
                s.acks.unwritten.drain(..written);
                self.stats.acks_sent.fetch_add(n as u64, Ordering::Relaxed);
                self.update_gauges();
            }
            MqttEvent::Connected {
                session_present,
                handshake,
            } => self.on_connected(session, session_present, handshake, now.at, out),
            MqttEvent::Subscribed { refused } => {
                if refused.is_empty() {
                    info!(
                        session = i,
                        filters = self.subscriptions,
                        "Subscribed to every configured filter."
                    );
                    self.on_subscribed(session, out);
                } else {
                    error!(
                        session = i,
                        refused = ?refused,
                        "The broker refused subscriptions; check the filters and the broker's ACL."
                    );
                    if refused.len() < self.subscriptions {
                        // Degraded, but ingesting what it may.
                        self.on_subscribed(session, out);
                    }
                }
            }
            MqttEvent::PingSent => {
                let p = &mut self.sessions[i].pings;
                p.sent.push_back(p.written_through);
                p.queued = false;
                // Any PINGREQ written after the release's acks marks it, ours or keep-alive's.
                if let Marker::Wanted { through } = p.marker
                    && p.written_through >= through
                {
                    p.marker = Marker::Sent { through };
                    self.batcher.release_pinged();
                }
            }
            MqttEvent::PingAnswered => {
                let p = &mut self.sessions[i].pings;
                let answered = p.sent.pop_front();
                if let (Some(through), Marker::Sent { through: marked }) = (answered, p.marker)
                    && through >= marked
                {
                    p.marker = Marker::None;
                    self.batcher.release_answered(now.at);
                }
                if let Some(through) = answered
                    && through >= p.first_arrival
                {
                    let first = p.first_arrival;
                    self.admit.resends().confirm(session.get(), first, through);
                }
            }
            MqttEvent::Other | MqttEvent::DisconnectSent => {}
        }
    }

    fn on_connected(
        &mut self,
        session: SessionId,
        session_present: bool,
        handshake: Duration,
        now: Instant,
        out: &mut Vec<Action<R>>,
    ) {
        self.sessions[session.index()].connected(self.arrival + 1, session_present, handshake, now);
        self.batcher.connected(session.get(), now, handshake);
        if session_present {
            info!(
                session = session.index(),
                "Connected to the MQTT broker; it kept our session and subscriptions."
            );
            self.on_subscribed(session, out);
        } else {
            info!(
                session = session.index(),
                "Connected to the MQTT broker with a new session; subscribing."
            );
            out.push(Action::Subscribe(session));
        }
        self.update_link_gauges();
    }

    /// The broker has (some of) `session`'s subscriptions. Once every session has had them and
    /// the store is open (the daemon opened it before ingesting): tell systemd, once.
    fn on_subscribed(&mut self, session: SessionId, out: &mut Vec<Action<R>>) {
        let s = &mut self.sessions[session.index()];
        s.link = Link::Up(Subscriptions::Granted);
        s.ever_subscribed = true;
        self.update_link_gauges();
        if !self.ready && self.sessions.iter().all(|s| s.ever_subscribed) {
            self.ready = true;
            out.push(Action::Ready);
        }
    }

    /// `connected` and `subscribed` (readiness) hold when they hold for every session.
    fn update_link_gauges(&self) {
        let all = |f: fn(&SessionState) -> bool| self.sessions.iter().all(f);
        self.stats
            .connected
            .store(all(SessionState::is_up), Ordering::Relaxed);
        self.stats.subscribed.store(
            all(|s| s.link == Link::Up(Subscriptions::Granted)),
            Ordering::Relaxed,
        );
    }

    fn on_connection_lost(&mut self, session: SessionId, e: &PollError, now: Instant) {
        let s = &mut self.sessions[session.index()];
        let was_connected = s.is_up();
        let delay = s.lost(now);
        let attempt = s.backoff.attempts;
        self.stats.connection_errors.fetch_add(1, Ordering::Relaxed);
        self.update_link_gauges();
        if was_connected {
            self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        log_connection_lost(session, e, delay, attempt, was_connected);
    }

    /// A PUBLISH: admitted into the batch (its ack with it), or held in a reconnect's burst.
    fn on_publish(
        &mut self,
        session: SessionId,
        publish: &Publish,
        now: Now,
        out: &mut Vec<Action<R>>,
    ) {
        let Publish {
            topic,
            payload,
            pkid,
            qos,
            dup,
        } = publish;
        let (pkid, qos, dup) = (*pkid, *qos, *dup);
        self.stats.messages_received.fetch_add(1, Ordering::Relaxed);
        let id = session.get();
        if qos > 0 {
            self.batcher.arrived(now.at, now.lag);
            if !dup && self.sessions[session.index()].burst.is_some() {
                // The broker has resent everything: the burst is over.
                self.end_burst(session, BurstEnd::NewMessage);
            }
        }
        let arrival = self.arrival + 1; // Its ack token's, made below.
        let message = Message {
            topic,
            payload,
            pkid,
            qos,
            dup,
            session: id,
            received: now.wall,
            burst: self.sessions[session.index()]
                .burst
                .is_some()
                .then_some(InBurst::Open),
            arrival,
        };
        let admitted = self.admit.admit(&message);
        if let Verdict::Held(fp) = admitted.verdict {
            let s = &mut self.sessions[session.index()];
            let held = HeldMessage {
                topic: topic.clone(),
                payload: payload.clone(),
                pkid,
                qos,
                received: now.wall,
                at: now.at,
            };
            let Some(burst) = &mut s.burst else {
                // Admission holds a resend only when told the burst is open (above). Were it
                // otherwise, the message goes unacknowledged and the broker sends it again.
                debug_assert!(false, "a resend held with no burst open");
                return;
            };
            burst.hold(fp, arrival, held);
            s.burst_at = now.at;
            if burst.is_full() {
                self.end_burst(session, BurstEnd::Pause);
            }
        } else {
            if let Some((topic, payload)) = admitted.rebirth.take() {
                let (last, since) = &mut self.rebirths_logged;
                *since += 1;
                if last.is_none_or(|at| now.at.duration_since(at) >= Duration::from_mins(1)) {
                    info!(
                        session = id,
                        topic,
                        requests = *since,
                        "Asked Sparkplug edge nodes for their births again (DATA named an alias no BIRTH defined, or a message was missed); requests since the last such line: {since}; at most one line a minute.",
                    );
                    (*last, *since) = (Some(now.at), 0);
                }
                out.push(Action::Publish(session, topic, payload));
            }
            let urgent = apply(
                &mut self.batcher,
                &self.stats,
                &mut self.gateway_warned,
                admitted,
                &message,
                now.at,
            );
            if urgent {
                self.urgent = Some(FlushReason::Replay);
            }
        }
        if qos > 0 {
            self.warn_past_window(session);
            self.arrival = arrival;
            let connection = self.sessions[session.index()].connection;
            self.batcher.push_ack(
                AckToken {
                    arrival,
                    connection,
                    session: id,
                    pkid,
                    qos,
                },
                now.at,
            );
        }
        self.update_gauges();
    }

    /// Warns, once a connection, when the broker sends past the window we asked for.
    fn warn_past_window(&mut self, session: SessionId) {
        let unacked = self.unacked_on(session);
        let s = &mut self.sessions[session.index()];
        if !s.warned_window && unacked >= usize::from(self.window) {
            s.warned_window = true;
            warn!(
                session = session.index(),
                window = self.window,
                "The broker sent more unacknowledged messages than the in-flight window \
                 (mqtt.receive_maximum). It does not honour the window (Mosquitto before \
                 2.0.13 has this bug); bucketd keeps up, but after a crash redeliveries \
                 beyond limits.dedup_window messages could be counted twice. Upgrade the \
                 broker or raise limits.dedup_window."
            );
        }
    }

    /// Ends `session`'s burst of resends and admits what it held, in order, as
    /// [`crate::resend`] tells them apart. Their acks are in the batch already.
    fn end_burst(&mut self, session: SessionId, end: BurstEnd) {
        let Some(burst) = self.sessions[session.index()].burst.take() else {
            return;
        };
        let held = self.admit.resends().end_burst(session.get(), burst, end);
        if held.is_empty() {
            return;
        }
        let count = |part| held.iter().filter(|(_, p)| *p == part).count();
        info!(
            session = session.index(),
            resent = held.len(),
            copies = count(BurstPart::Copy),
            reused_ids = count(BurstPart::New),
            "The broker resent the messages it had not seen acknowledged; those counted already \
             are skipped (reused_ids: new messages on the packet ids of counted ones)."
        );
        for (Held { arrival, body, .. }, part) in held {
            let message = Message {
                topic: &body.topic,
                payload: &body.payload,
                pkid: body.pkid,
                qos: body.qos,
                dup: true,
                session: session.get(),
                received: body.received,
                burst: Some(InBurst::Told(part)),
                arrival,
            };
            let admitted = self.admit.admit(&message);
            let urgent = apply(
                &mut self.batcher,
                &self.stats,
                &mut self.gateway_warned,
                admitted,
                &message,
                body.at,
            );
            if urgent {
                self.urgent = Some(FlushReason::Replay);
            }
        }
        self.update_gauges();
    }

    /// Messages received and not yet acknowledged on the wire.
    fn unacked(&self) -> usize {
        self.batcher.pending_acks()
            + self.in_flight.as_ref().map_or(0, Vec::len)
            + self.sessions.iter().map(|s| s.acks.owed()).sum::<usize>()
    }

    /// Messages of `session`'s current connection received and not yet acknowledged on the
    /// wire.
    fn unacked_on(&self, session: SessionId) -> usize {
        self.batcher.unacked_of(session.index()) + self.sessions[session.index()].acks.owed()
    }

    fn update_gauges(&self) {
        self.stats
            .pending_readings
            .store(self.batcher.pending_readings() as u64, Ordering::Relaxed);
        self.stats
            .unacked_messages
            .store(self.unacked() as u64, Ordering::Relaxed);
    }

    /// Shutdown begins: no new message is taken, and the held resends are admitted (their acks
    /// are in the batch).
    pub fn begin_drain(&mut self) {
        self.mode = Mode::Draining;
        info!(
            pending_readings = self.batcher.pending_readings(),
            "Shutting down: committing pending readings."
        );
        for id in self.session_ids() {
            self.end_burst(id, BurstEnd::Pause);
        }
    }

    /// While draining: hands what is pending to the writer when it is idle. `true` once
    /// everything is committed.
    pub fn drain(&mut self, now: Instant, out: &mut Vec<Action<R>>) -> bool {
        if self.in_flight.is_some() {
            return false;
        }
        if self.batcher.is_empty() {
            return true;
        }
        self.send_batch(FlushReason::Request, now, out);
        false
    }

    /// Whether `session` is connected and has acks not yet written to the socket.
    pub fn owes_acks(&self, session: SessionId) -> bool {
        let s = &self.sessions[session.index()];
        s.is_up() && s.acks.owed() > 0
    }

    /// Acks not yet written, over all sessions.
    pub fn acks_owed(&self) -> usize {
        self.sessions.iter().map(|s| s.acks.owed()).sum()
    }

    /// Whether `session` is connected.
    pub fn is_up(&self, session: SessionId) -> bool {
        self.sessions[session.index()].is_up()
    }

    /// The open batch's readings.
    pub fn pending_readings(&self) -> usize {
        self.batcher.pending_readings()
    }
}

/// What an admitted message's verdict does: readings, buckets and its fingerprint to the
/// batch, refusals and copies to the counters. `true` when the batch must be committed as soon
/// as the writer is idle (it repeats messages committed before it: `crate::resend`).
fn apply(
    batcher: &mut Batcher,
    stats: &Stats,
    gateway_warned: &mut [Option<Instant>],
    admitted: &mut Admitted,
    message: &Message<'_>,
    now: Instant,
) -> bool {
    let (topic, payload) = (message.topic, message.payload);
    match admitted.verdict {
        Verdict::Rejected(e) => {
            debug!(reason = e.reason(), topic = %String::from_utf8_lossy(topic), "Rejected message.");
            stats.reject(e, topic, payload, message.received);
            if let Some(gateway) = &admitted.gateway {
                warn_gateway(gateway_warned, gateway, e, "message", now);
            }
            false
        }
        Verdict::Copy => {
            stats.duplicates.fetch_add(1, Ordering::Relaxed);
            debug!(topic = %String::from_utf8_lossy(topic), "Skipped a message already counted.");
            false
        }
        Verdict::New => {
            if admitted.control {
                stats.control_messages.fetch_add(1, Ordering::Relaxed);
            }
            let raw = admitted.store_raw;
            for (series, ts, value) in admitted.readings.drain(..) {
                batcher.push_reading(series, ts, value, raw, now);
            }
            for (series, start, summary) in admitted.summaries.drain(..) {
                batcher.push_summary(series, start, &summary, now);
            }
            stats.reject_all(&admitted.rejected, topic, payload, message.received);
            if let Some(gateway) = &admitted.gateway {
                for e in admitted.rejected.drain(..) {
                    warn_gateway(gateway_warned, gateway, e, "bucket", now);
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
            admitted.replay
        }
        // The caller keeps held messages; nothing of them is applied until their burst ends.
        Verdict::Held(_) => false,
    }
}

/// The log line of a lost (or refused) connection, by what went wrong and how often.
fn log_connection_lost(
    session: SessionId,
    e: &PollError,
    delay: Duration,
    attempt: u32,
    was_connected: bool,
) {
    let session = session.index();
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

/// Logs a refusal of a gateway's delta message (or one of its buckets) at a central, at most
/// once a minute per reason: a gateway that sends the same bad message on every retry must not
/// flood the log, and the counter (`bucketd_readings_rejected_total`) and the dead letters keep
/// every one.
fn warn_gateway(
    warned: &mut [Option<Instant>],
    gateway: &str,
    reason: DecodeError,
    what: &str,
    now: Instant,
) {
    const EVERY: Duration = Duration::from_mins(1);
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

mod session;

#[cfg(test)]
mod acks;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
