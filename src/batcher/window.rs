//! The broker's in-flight window, learned from how it answers our releases: when the open batch
//! ([`super::Batcher`]) holds a full window, and what a commit's stall teaches. Pure: the caller
//! passes the time in.
//!
//! The broker's own window may be full ([`FlushReason::Stall`]). Brokers may enforce a smaller
//! window than we ask for (MQTT 3.1.1 has no way to ask: upstream Mosquitto stops at 20, EMQX at
//! 32, AWS `IoT` Core at 100, rumqttd at its `max_inflight_count`), and then send nothing until we
//! acknowledge. Once that window `W` is known (`mqtt.broker_window`, or learned), a batch holding
//! `W` unacknowledged messages of this connection is committed at once
//! ([`FlushReason::BrokerWindow`]).
//!
//! Learning `W`: a full window shows as the broker going quiet while our acknowledgements are
//! pending, right after a release (acknowledgements sent, or a new connection) let it send. A quiet
//! gap alone is not proof. A broker with Nagle's algorithm on (Mosquitto's default,
//! `set_tcp_nodelay false`) holds small packets until our kernel acknowledges the previous ones,
//! and with acknowledgements batched we send nothing it could ride on, so the TCP delayed ACK (40
//! ms and more on Linux) paces delivery into bursts with quiet gaps of 10-45 ms, and our release
//! ends a gap at once. (bucketd's client asks Linux never to leave a read to the delayed ACK,
//! `TCP_QUICKACK`, which ends those gaps at the source; elsewhere they remain.) Taking those gaps
//! for stalls committed every burst (70 commits/s of 14 readings at 1,000 messages/s, 5x the bytes
//! written per reading). So a stall is proven only by a quiet period that outlasts any delayed ACK
//! ([`QUIET_CONFIRM`]) in a batch that began as the echo of a release (within [`ECHO_MAX`] plus the
//! connection's handshake time, so a 150 ms round trip is no obstacle; with quick ACKs within
//! [`ECHO_FAST`] plus it), after a release that found the broker quiet (nothing for the short quiet
//! below). The unacknowledged count at that stall is the broker's window: from then on a batch that
//! reaches it commits without waiting. The quiet counts from our release when that came after the
//! batch's last message: until then the broker may be waiting for the acks we hold (a batch that
//! arrives during a commit holds the rest of a window whose other part is being committed), so only
//! a quiet after the release shows where the broker stops. A window does not shrink within a
//! connection: a stall at fewer messages than the window seen is a pause in traffic, committed and
//! learned from no further.
//!
//! Where our TCP ACKs go out at once (`FlushPolicy::quick_acks`: Linux; within a millisecond or two
//! while they coalesce, [`Learner::acks_may_wait`]), a broker's Nagle gap lasts about the round
//! trip of that ACK, so a shorter quiet is proof when the batch looks like a window and nothing
//! else: it began at once after the release (within the handshake time plus
//! [`ECHO_FAST`]: a broker with a backlog refills within a round trip), it holds at least two
//! messages, and they came as one burst (on average closer together than [`BURST_RATIO`] times less
//! than the quiet: a steady stream that dense would be quiet that long about once in 3,000 gaps).
//! That quiet ([`Learner::quiet_fast`]) is twice the handshake time, at least [`QUIET_FAST_MIN`]:
//! 20 ms on a LAN, the first window learned in one such pause instead of 250 ms. A steady stream
//! rarely shows that shape (a message right after the release, a second within a few ms, then
//! nothing for 20 ms); when it does, the window learned is forgotten at its next larger batch
//! (below). A window of 1 (never two messages) is learned by the long quiet. A learned window is
//! committed the moment a batch holds it if the batch came that densely; a batch that reached it at
//! a slower pace waits a quiet of [`BURST_RATIO`] times its mean gap first, so that a window
//! learned by chance from a slow stream does not commit every few messages.
//!
//! A window is believed only once the broker has shown that it waits for our acknowledgements: it
//! was quiet before our release, and it sent again within a round trip after it. Publishers with a
//! period of their own (devices that report together, every 100 ms) meet a release at any point of
//! their cycle, and a flush interval anchored at one of their bursts ends at another, so a burst
//! that runs on across a commit, or begins a while after the release, proves nothing; taking such
//! bursts for a window of 20 had a broker without one commit every burst, 10 times a second. On a
//! broker without a window, bucketd then commits once per `flush_interval`
//! (`a_broker_without_a_window_gets_one_commit_per_interval...`).
//!
//! The first window of a connection has no release before it to echo (the broker sends when the
//! publishers do). Once per connection, a burst followed by that short quiet (without quick ACKs:
//! the long one) is committed as a probe (`FlushReason::Stall`, nothing learned): if the broker
//! stopped at its window, it refills it right after the release, and that refill proves the window
//! as above. A device's burst spends the one probe on a commit; a refill that does not come teaches
//! nothing. The count only covers QoS 1/2 messages of the current connection: QoS 0 messages flow
//! past a full window, and tokens of an earlier connection are not the broker's to count. If the
//! broker ever has more than `W` messages unacknowledged (it sent more while a commit ran), its
//! window is larger and `W` is forgotten; a new connection forgets it too (it may be another
//! broker).
//!
//! A busy machine reads a refill late. The broker answers at once, but when the loop is not running
//! (a gateway under a burst; two cores running the test suite) it reads the refill only when it
//! runs again, all together, stamped later than an echo may start (9-11 ms against 5 ms plus the
//! handshake, on two busy cores); a broker waiting for a core answers late itself. So the round
//! trip an echo is measured against is also taken as it is now: a PINGREQ goes out right behind
//! every release's acknowledgements (a marker, [`Learner::release_pinged`]), and a broker handles a
//! connection's packets in order, so it sends the refill our acks let it before answering the
//! marker (Mosquitto, the scripted broker of the tests) or at once after. A batch that begins
//! before that answer, or within the echo's slack after it, is an echo however late it is read; on
//! an idle machine the answer comes within a millisecond, stricter than the handshake's rule, which
//! stays for a client that could not write the marker. The rules below remain for what no marker
//! covers. Three rules keep such a refill from waiting for the interval, none of which lets
//! publishers' traffic pass for a window for long: right after the probe, a burst within
//! [`ECHO_MAX`] of its release proves the window after the long quiet (a publisher with a shorter
//! period is never that quiet); a window just learned gets one late refill committed after the long
//! quiet too; and a confirmed window's refill that comes late is believed as an echo while the
//! broker's refills have come as echoes more often than late (`Belief::Confirmed`: each echo earns
//! trust, each late refill committed spends it). Publishers whose bursts are the window's size come
//! as echoes by chance only, so their late bursts soon find no trust, wait for the interval, and
//! outgrow the window.
//!
//! With several sessions (`mqtt.sessions = N`, one shared subscription) each session has its own
//! window `W`, and the counts above are per session. A broker that hands a shared group's messages
//! out in turn (rumqttd, Mosquitto) stops the whole group when the next session in turn is full, so
//! the sessions fill together. A batch is then due when any session's window is full, or when half
//! of the `N x W` in flight is in the batch: the commit of one half overlaps the arrival of the
//! other, so the broker need not stop at all while commits keep up. Under load a broker reads the
//! sessions' acks one socket at a time (and Mosquitto queues each session's share while the others
//! go on), so one session's refill may come whole before the others' begin: while the last
//! release's marker pings are unanswered, the others' refills are on their way, and one full window
//! waits for them.

use std::time::{Duration, Instant};

use super::{FlushPolicy, FlushReason};

/// A batch whose first message arrived within this time (plus the connection's handshake time,
/// about a round trip or two) after the previous acknowledgements were released counts as
/// released by them (an "echo").
pub const ECHO_MAX: Duration = Duration::from_millis(100);
/// The most a connection's handshake time widens the echo window.
pub const HANDSHAKE_MAX: Duration = Duration::from_secs(1);
/// The quiet period that proves a stall: longer than a TCP delayed ACK (Linux: 40-200 ms),
/// which a broker using Nagle's algorithm waits for.
pub const QUIET_CONFIRM: Duration = Duration::from_millis(250);

/// Confirming quiets ([`QUIET_CONFIRM`]) after a refill that fills a confirmed window too late to
/// be an echo before it counts as the broker's stall.
pub const LATE_REFILL_QUIETS: u32 = 4;
/// The most late refills of a confirmed window believed as echoes on the strength of earlier
/// echoes ([`Belief::Confirmed`]).
pub const TRUST_MAX: u32 = 16;
/// With quick ACKs: the shortest quiet that proves the stall of a burst (see the module docs).
pub const QUIET_FAST_MIN: Duration = Duration::from_millis(20);
/// With quick ACKs: a burst that began within this time (plus the handshake time) after the
/// release is the broker refilling its window.
pub const ECHO_FAST: Duration = Duration::from_millis(5);
/// With quick ACKs: how many times the burst's mean gap between messages the quiet must be.
pub const BURST_RATIO: u32 = 8;
/// The fewest unacknowledged messages at which a batch is due ([`FlushPolicy::ack_threshold`])
/// for our TCP ACKs to wait (see [`Learner::acks_may_wait`]).
pub const ACKS_WAIT_THRESHOLD_MIN: usize = 256;

/// A connection's one probe: a burst committed with no window known, so that the broker's
/// refill can prove one (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    Unspent,
    /// The last batch taken was the probe (its messages of the fullest session: `size`): the
    /// next one may be its refill.
    JustTaken {
        size: usize,
    },
    /// The last batch taken was the probe, and the broker sent more before its release: the
    /// probe cut the window short (the publishers paused within it), and the next stall after
    /// an echo is the window's, though the release did not find the broker quiet.
    CutShort,
    Spent,
}

/// How far a learned window is believed to be the broker's (see [`Learner::full_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Belief {
    /// Learned from a stall; no refill of it has come as an echo of our release yet. `grace`:
    /// one refill that fills it late may still be committed after the long quiet.
    Learned { grace: bool },
    /// A refill that came as an echo of our release has filled it on this connection: the
    /// window is the broker's, not a lull of the publishers taken for one. `trust`: the refills
    /// that came as echoes less the late ones committed on their strength (at most
    /// [`TRUST_MAX`]); while some is left, a refill that fills the window late is committed
    /// as an echo would be.
    Confirmed { trust: u32 },
}

impl Belief {
    /// A window just learned.
    const LEARNED: Belief = Belief::Learned { grace: true };

    /// After a commit of the full window by a refill that came as an echo (`echo`) or late.
    fn after_refill(self, echo: bool) -> Belief {
        match (self, echo) {
            (Belief::Learned { .. }, true) => Belief::Confirmed { trust: 1 },
            (Belief::Confirmed { trust }, true) => Belief::Confirmed {
                trust: (trust + 1).min(TRUST_MAX),
            },
            (Belief::Learned { .. }, false) => Belief::Learned { grace: false },
            (Belief::Confirmed { trust }, false) => Belief::Confirmed {
                trust: trust.saturating_sub(1),
            },
        }
    }
}

/// The broker's window as far as learned, and the open batch's arrivals it goes by. One for
/// all sessions: a release (one commit's acks) lets every session's broker connection send
/// again at once, so what its answer proves is the broker's, which the sessions share; a
/// reconnect of any session forgets what was learned (another broker, or another limit, is
/// possible: relearning costs a probe, a wrong window a commit every few messages). The counts
/// are per session.
#[derive(Debug)]
pub struct Learner {
    policy: FlushPolicy,
    /// Arrival times of the batch's first and last QoS 1/2 message, and how many there were.
    first_arrival: Option<Instant>,
    /// How long the first one may have waited, ready, before the loop read it (its own
    /// scheduling delay: see [`Learner::arrived`]).
    first_lag: Duration,
    last_arrival: Option<Instant>,
    arrivals: u32,
    /// Per session: acks of the open batch that its current connection will send (the others
    /// belong to an earlier connection).
    current: Vec<usize>,
    /// Per session: acks of its current connection taken for commit and not released yet.
    committing: Vec<usize>,
    /// When acknowledgements (or a new connection) last let the broker send more.
    released_at: Option<Instant>,
    /// The last connection's handshake time (TCP, TLS, CONNECT to CONNACK): a round trip or
    /// more, which widens what counts as an echo.
    handshake: Duration,
    /// The broker's window, as the last proven stall showed it: unacknowledged messages at
    /// which it stops sending.
    window_seen: Option<usize>,
    /// The most messages one session's current connection has had unacknowledged at once: the
    /// broker's window, if it has one, is at least this. A stall at fewer is a pause in the
    /// publishers' traffic, not a full window (see [`Learner::below_floor`]).
    window_floor: usize,
    /// This connection's probe (see the module docs).
    probe: Probe,
    /// How far the known window is believed.
    belief: Belief,
    /// The last QoS 1/2 message's arrival, whichever batch it joined.
    latest_arrival: Option<Instant>,
    /// Whether nothing had arrived for [`Learner::quiet_fast`] when the last release came: the
    /// broker had stopped, as one waiting for our acknowledgements does. Only a refill after
    /// such a release proves a window (see [`Learner::fast_stall_at`]).
    released_after_quiet: bool,
    /// The last release's marker pings ([`Learner::release_pinged`]) whose answers have not
    /// come, and when the last of them came.
    marker_pings: u16,
    marker_answered_at: Option<Instant>,
    /// Whether the batch's first QoS 1/2 message came while a marker ping awaited its answer:
    /// within the broker's round trip as it is now (see [`Learner::answered_within`]).
    first_before_answer: bool,
    /// Whether a window learned on the last connection was told ([`Learner::newly_learned`]).
    told: bool,
    /// A window learned and not yet told.
    news: Option<usize>,
}

impl Learner {
    pub fn new(policy: FlushPolicy) -> Learner {
        let sessions = usize::from(policy.sessions.max(1));
        Learner {
            policy,
            first_arrival: None,
            first_lag: Duration::ZERO,
            last_arrival: None,
            arrivals: 0,
            current: vec![0; sessions],
            committing: vec![0; sessions],
            released_at: None,
            handshake: Duration::ZERO,
            window_seen: None,
            window_floor: 0,
            probe: Probe::Unspent,
            belief: Belief::LEARNED,
            latest_arrival: None,
            released_after_quiet: true,
            marker_pings: 0,
            marker_answered_at: None,
            first_before_answer: false,
            told: false,
            news: None,
        }
    }

    /// Records that a QoS 1/2 message arrived (whatever its fate). QoS 0 messages do not count:
    /// a broker sends them past a full window. `lag`: how long it may have waited, ready,
    /// before `now` because the loop itself was not running (its threads runnable but waiting
    /// for a core: the shell measures it); a busy machine's loop reads a refill that came at
    /// once tens of ms late, and only how soon the broker answered tells a refill from
    /// publishers' traffic (issue 58).
    pub fn arrived(&mut self, now: Instant, lag: Duration) {
        if self.first_arrival.is_none() {
            self.first_arrival = Some(now);
            self.first_lag = lag;
            self.first_before_answer = self.marker_pings > 0;
        }
        self.last_arrival = Some(now);
        self.latest_arrival = Some(now);
        self.arrivals = self.arrivals.saturating_add(1);
    }

    /// Records that the broker was allowed to send more: the acknowledgements of the batch
    /// taken last were queued.
    pub fn released(&mut self, now: Instant) {
        if matches!(self.probe, Probe::JustTaken { .. }) && self.fullest() > 0 {
            // The broker went on sending before the probe's release: the probe cut a window
            // short, and was no stall.
            self.probe = Probe::CutShort;
        }
        self.released_at = Some(now);
        self.released_after_quiet = self
            .latest_arrival
            .is_none_or(|t| now.saturating_duration_since(t) >= self.quiet_fast());
        self.committing.fill(0);
        self.marker_pings = 0;
        self.marker_answered_at = None;
    }

    /// A PINGREQ went out right behind the acknowledgements of the last release (on one
    /// session): a marker. The broker handles a connection's packets in order, so it answers
    /// the marker only after it has read those acknowledgements, and a broker that refills its
    /// window on them sends the refill before that answer, or at once after it. So a batch that
    /// begins before the answer (or within the echo's slack after it) came within the round
    /// trip as it is now, however late a loaded machine (ours, or the broker's) read it: an
    /// echo (issue 58; see [`Learner::answered_within`]).
    pub fn release_pinged(&mut self) {
        self.marker_pings = self.marker_pings.saturating_add(1);
        self.marker_answered_at = None;
    }

    /// The answer to a marker of the last release came ([`Learner::release_pinged`]).
    pub fn release_answered(&mut self, now: Instant) {
        if self.marker_pings == 0 {
            return;
        }
        self.marker_pings -= 1;
        if self.marker_pings == 0 {
            self.marker_answered_at = Some(now);
        }
    }

    /// A new connection of `session`, whose handshake took `handshake`: the broker may send its
    /// window at once, and it may be another broker (or another configuration) whose window is
    /// still to be learned, for every session (they share what is learned). Acks of the session
    /// already pending belong to the old connection and are never sent.
    pub fn connected(&mut self, session: u16, now: Instant, handshake: Duration) {
        self.released_at = Some(now);
        // A handshake that crawled (a broker under load, a slow TLS peer) says little about the
        // round trip; capped so that it cannot make every batch an echo.
        self.handshake = handshake.min(HANDSHAKE_MAX);
        if let Some(n) = self.current.get_mut(usize::from(session)) {
            *n = 0;
        }
        if let Some(n) = self.committing.get_mut(usize::from(session)) {
            *n = 0;
        }
        self.window_seen = None;
        self.window_floor = 0;
        self.probe = Probe::Unspent;
        self.belief = Belief::LEARNED;
        // Nothing has come on the new connection yet.
        self.released_after_quiet = true;
        self.marker_pings = 0;
        self.marker_answered_at = None;
        self.told = false;
    }

    /// The broker's window as learned from stalls, if one was.
    pub fn window_seen(&self) -> Option<usize> {
        self.window_seen
    }

    /// Whether our TCP ACKs may wait a little for the next (the client's ACK coalescing,
    /// vendor/rumqttc/src/quickack.rs), so that a broker with Nagle's algorithm on sends a
    /// flood of small messages in fewer, larger segments: while no broker window is known
    /// (stated or learned) and a batch is due only at [`ACKS_WAIT_THRESHOLD_MIN`]
    /// unacknowledged messages or more. Where a batch waits for a few messages the broker holds
    /// until our ACK (its window's last, or the half of a small window we ask for), every ACK
    /// goes out at once: a waiting one would add its millisecond to every commit's cycle.
    pub fn acks_may_wait(&self) -> bool {
        self.broker_window().is_none() && self.policy.ack_threshold() >= ACKS_WAIT_THRESHOLD_MIN
    }

    /// Whether no QoS 1/2 message has arrived in the open batch yet.
    pub fn awaits_first_arrival(&self) -> bool {
        self.first_arrival.is_none()
    }

    /// Messages of `session`'s current connection in the open batch or taken for commit and
    /// not released yet.
    pub fn unacked_of(&self, session: usize) -> usize {
        self.current.get(session).copied().unwrap_or(0)
            + self.committing.get(session).copied().unwrap_or(0)
    }

    /// The window the broker enforces, as far as known: stated, or learned, whichever is
    /// smaller.
    fn broker_window(&self) -> Option<usize> {
        let stated = self.policy.broker_window.map(usize::from);
        match (stated, self.window_seen) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Acks of the open batch that the fullest session's current connection will send.
    fn fullest(&self) -> usize {
        self.current.iter().copied().max().unwrap_or(0)
    }

    /// Whether the open batch holds the known window `w`: one session's, or with several
    /// sessions half of all of theirs (see the module docs).
    fn holds_window(&self, w: usize) -> bool {
        let sessions = self.current.len();
        // With several sessions, one full window waits while the last release's marker pings
        // are unanswered: the broker has not read every session's acks yet, and their refills
        // are on their way (a round trip at most). A broker under load works through its
        // sockets one at a time, and Mosquitto's shared subscription queues each session's
        // share while the others go on, so one session fills first (issue 58: batches of
        // [5, 1, 20, 0] committed, 53 commits where 52 may be).
        let one_full = self.fullest() >= w && (sessions == 1 || self.marker_pings == 0);
        one_full
            || (sessions > 1 && self.current.iter().sum::<usize>() >= (sessions * w / 2).max(1))
    }

    /// When the broker's window counts as full, for batches that qualify, and why: at once when
    /// the batch holds the known window, else after a quiet period that proves a stall.
    pub fn full_at(&self) -> Option<(Instant, FlushReason)> {
        let (first, last) = (self.first_arrival?, self.last_arrival?);
        if self.fullest() == 0 {
            return None;
        }
        // A batch that began during the commit counts too: a broker whose window was not full
        // at the flush fills it meanwhile, then waits for this release.
        let echo = self.is_echo();
        if let Some(w) = self.broker_window()
            && self.holds_window(w)
        {
            let stated = self
                .policy
                .broker_window
                .is_some_and(|s| usize::from(s) == w);
            // A refill later than an echo is believed as one while the broker's refills have
            // come as echoes more often than late (`Belief::Confirmed`'s trust): a busy
            // scheduler (a gateway under a burst, two busy cores) reads a refill that came at
            // once only when the loop runs again, all of it together, stamped late (issue 58:
            // 9-11 ms after the release against an echo's 5 ms plus the handshake; the window
            // then waited for the interval). Publishers who send the window's count now and
            // then (a lull taken for a window) earn no trust: their bursts come as echoes by
            // chance only, so the late ones soon wait for the interval, and the batch
            // outgrows the window.
            let trusted = matches!(self.belief, Belief::Confirmed { trust } if trust > 0);
            let answered = echo || trusted;
            if stated || (answered && (self.is_burst(first, last) || self.is_dense(first, last))) {
                return Some((last, FlushReason::BrokerWindow));
            }
            if answered {
                // A learned window reached slowly: the count is believed after a quiet in
                // proportion to the batch's own pace (a stream that slow has gaps that long
                // anyway, and a window learned from one of them must not commit every few
                // messages).
                return Some((
                    last + self.paced_quiet(first, last),
                    FlushReason::BrokerWindow,
                ));
            }
            // A refill later than an echo (a broker or a machine under load) that fills the
            // window, in one burst or trickling in, with no trust to spend: the broker sends
            // nothing more until we acknowledge, so a quiet after it is a stall. (Without
            // this, nothing committed it before the interval: a full-suite run under load hung
            // `ingest::a_strict_broker_window_does_not_stall_a_long_flush_interval`.) A window
            // just learned gets one such refill after the long quiet: the first refill after
            // the proof came late under load (issue 58), and publishers whose period is shorter
            // than that quiet outgrow the window before it ends (a window learned by chance
            // from such bursts, 20 every 100 ms, costs no commit more). After that, and for a
            // confirmed window whose trust is spent, the quiet asked is four confirming
            // quiets: publishers that send exactly the window's count at a steady pace (five
            // every 300 ms) pause for less and commit at the interval as before; a late refill
            // costs this much, once.
            match self.belief {
                Belief::Learned { grace: true } => {
                    return Some((
                        self.quiet_from(last) + self.quiet_confirm(),
                        FlushReason::BrokerWindow,
                    ));
                }
                Belief::Confirmed { .. } => {
                    return Some((
                        self.quiet_from(last) + self.quiet_confirm() * LATE_REFILL_QUIETS,
                        FlushReason::BrokerWindow,
                    ));
                }
                Belief::Learned { grace: false } => {}
            }
        }
        if self.broker_window().is_none() && self.below_floor() {
            return None;
        }
        let quiet_from = self.quiet_from(last);
        let slow = echo.then(|| quiet_from + self.quiet_confirm());
        let fast = self.fast_stall_at(first, last);
        let probe = self.probe_at(first, last);
        let refill = self.probe_refill_at(first, last);
        [slow, fast, probe, refill]
            .into_iter()
            .flatten()
            .min()
            .map(|at| (at, FlushReason::Stall))
    }

    /// With no window known, once per connection: when a burst of two or more (however long
    /// after the release) counts as a possible full window, to be committed so that the refill
    /// can prove it (see the module docs): after the short quiet with quick ACKs, else the
    /// long one.
    fn probe_at(&self, first: Instant, last: Instant) -> Option<Instant> {
        (self.probe == Probe::Unspent && self.is_probe_burst(first, last))
            .then(|| self.quiet_from(last) + self.probe_quiet())
    }

    /// With no window known, right after the connection's probe, when the batch proves the
    /// window as the probe's refill (issue 58: with quick ACKs an echo must come within
    /// [`ECHO_FAST`] to prove it after the short quiet, and a busy scheduler read the refill
    /// too late for that):
    /// - after a probe that was the window: at least as many messages as the probe, in one
    ///   burst (or one message), that came within [`ECHO_MAX`] (plus the handshake time) of
    ///   the probe's release, which found the broker quiet: after the long quiet, as an echo
    ///   without quick ACKs does. Publishers with a period shorter than the long quiet are never
    ///   quiet that long; a longer period may pass once per connection, and the window learned
    ///   then commits no more than one burst at a time, at most as often as its period.
    /// - after a probe that cut a window short ([`Probe::CutShort`]): the rest of that window
    ///   and the refill, in one burst from the release on: after the probe's quiet, as the
    ///   probe itself.
    fn probe_refill_at(&self, first: Instant, last: Instant) -> Option<Instant> {
        if self.broker_window().is_some() {
            return None;
        }
        let answered = self.answered_within(ECHO_MAX);
        let burst = self.arrivals <= 1 || self.is_probe_dense(first, last);
        match self.probe {
            Probe::JustTaken { size }
                if answered
                    && self.released_after_quiet
                    && self.fullest() >= size.max(1)
                    && burst =>
            {
                Some(self.quiet_from(last) + self.quiet_confirm())
            }
            Probe::CutShort if answered && self.fullest() >= 2 && burst => {
                Some(self.quiet_from(last) + self.probe_quiet())
            }
            _ => None,
        }
    }

    /// Whether the open batch may be a full window with none known: two or more messages of a
    /// session, in a burst (closer together on average than [`BURST_RATIO`] times less than
    /// the probe's quiet).
    fn is_probe_burst(&self, first: Instant, last: Instant) -> bool {
        self.broker_window().is_none() && self.fullest() >= 2 && self.is_probe_dense(first, last)
    }

    /// Whether the batch's messages came closer together on average than [`BURST_RATIO`] times
    /// less than the probe's quiet.
    fn is_probe_dense(&self, first: Instant, last: Instant) -> bool {
        let gaps = self.arrivals.saturating_sub(1);
        last.saturating_duration_since(first) * BURST_RATIO <= self.probe_quiet() * gaps
    }

    /// The quiet after a burst that commits it as the probe: the short quiet with quick ACKs,
    /// else the long one.
    fn probe_quiet(&self) -> Duration {
        if self.policy.quick_acks {
            self.quiet_fast()
        } else {
            self.quiet_confirm()
        }
    }

    /// Whether the open batch holds fewer messages than the broker has already had
    /// unacknowledged at once on this connection: then it cannot be the broker's full window,
    /// and while none is known no quiet after it is a stall (with one known, a pause in traffic
    /// still commits as one, without shrinking it). Publishers that report together (20 every
    /// 100 ms) meet an interval flush anchored at one of their bursts right at another's start;
    /// under load a burst a few ms late then looked like the broker's refill of a window (issue
    /// 42: a stall "proven" at 20 after the broker had sent 200 unacknowledged).
    fn below_floor(&self) -> bool {
        self.fullest() < self.window_floor
    }

    /// Where the quiet that proves a stall starts: at the batch's last message, or at the
    /// release if that came later. Before our release the broker may be waiting for the acks we
    /// hold (a batch that arrived during a commit holds the rest of a window whose other part
    /// was being committed); only a quiet after it shows that the broker stopped at its window
    /// rather than at ours.
    fn quiet_from(&self, last: Instant) -> Instant {
        self.released_at.map_or(last, |r| r.max(last))
    }

    /// Whether a stall flush at `now` proves the broker's window: a burst that echoed the
    /// release, or the long quiet after an echo. Otherwise it was the connection's probe.
    fn stall_proven(&self, now: Instant) -> bool {
        let (Some(first), Some(last)) = (self.first_arrival, self.last_arrival) else {
            return false;
        };
        let echo = self.is_echo() && self.released_after_quiet;
        self.fast_stall_at(first, last).is_some()
            || (echo && now >= self.quiet_from(last) + self.quiet_confirm())
            || self
                .probe_refill_at(first, last)
                .is_some_and(|at| now >= at)
    }

    /// Whether a batch whose first message came at `first` is the broker's answer to our
    /// release: it came within a round trip of it (the handshake time), plus [`ECHO_FAST`] with
    /// quick ACKs, else plus [`ECHO_MAX`] (a broker's Nagle gap may hold it that long). Only a
    /// broker that held messages back for our acknowledgements answers that fast every time;
    /// publishers with a period of their own (a burst every 100 ms) do not, and neither their
    /// bursts nor their pauses may then pass for a window (issue 42: a "window of 20" learned
    /// from such bursts made a broker without one commit 10 times a second).
    fn is_echo(&self) -> bool {
        let slack = if self.policy.quick_acks {
            ECHO_FAST
        } else {
            ECHO_MAX
        };
        self.answered_within(slack)
    }

    /// Whether the batch's first message answered the last release within `slack` plus a
    /// round trip: measured from the release, the handshake's round trip
    /// ([`Learner::answered_in`]); or, where a marker ping went out behind the release's
    /// acknowledgements ([`Learner::release_pinged`]), the round trip as it is now: the
    /// message came before the marker's answer, or within `slack` after it. On an idle machine
    /// that answer comes within a millisecond, so the marker is the stricter test; under load
    /// (two busy cores, a gateway under a burst) our loop, the broker and the network are all
    /// slower, the answer with them, and a refill read 10 or 150 ms late is still known for
    /// one (issue 58: such refills waited for the flush interval).
    fn answered_within(&self, slack: Duration) -> bool {
        if self
            .answered_in()
            .is_some_and(|d| d <= slack + self.handshake)
        {
            return true;
        }
        let Some(first) = self.first_arrival else {
            return false;
        };
        self.first_before_answer
            || self
                .marker_answered_at
                .is_some_and(|a| first.saturating_duration_since(a) <= slack)
    }

    /// How soon after the last release the batch's first message may have come: its arrival
    /// less the loop's own delay in reading it ([`Learner::arrived`]), not before the release;
    /// 0 for a batch that began before the release (during the commit).
    fn answered_in(&self) -> Option<Duration> {
        let (first, released) = (self.first_arrival?, self.released_at?);
        Some(
            first
                .saturating_duration_since(released)
                .saturating_sub(self.first_lag),
        )
    }

    /// With quick ACKs, when a batch shaped like a broker's full window counts as stalled: a
    /// burst of two or more (see [`Learner::is_burst`]), then [`Learner::quiet_fast`] of quiet.
    ///
    /// Only a refill proves anything: the broker was quiet before our release (as one waiting
    /// for our acknowledgements is) and sent again after it. A publisher's burst that runs on
    /// across a commit (a flush interval anchored at one burst ends at the next) is neither,
    /// and must not pass for a window (issue 42).
    fn fast_stall_at(&self, first: Instant, last: Instant) -> Option<Instant> {
        let after_release = self.released_at.is_some_and(|r| first >= r);
        (self.policy.quick_acks
            && self.fullest() >= 2
            && after_release
            && self.released_after_quiet
            && self.is_burst(first, last))
        .then(|| self.quiet_from(last) + self.quiet_fast())
    }

    /// Whether the batch came as a broker refilling its window does: it began at once after
    /// the release (within the handshake time plus [`ECHO_FAST`]), and it is dense (see the
    /// module docs).
    fn is_burst(&self, first: Instant, last: Instant) -> bool {
        self.answered_within(ECHO_FAST) && (self.arrivals <= 1 || self.is_dense(first, last))
    }

    /// Whether the batch's two or more messages came on average [`BURST_RATIO`] times closer
    /// together than [`Learner::quiet_fast`].
    fn is_dense(&self, first: Instant, last: Instant) -> bool {
        let gaps = self.arrivals.saturating_sub(1);
        gaps > 0 && last.saturating_duration_since(first) * BURST_RATIO <= self.quiet_fast() * gaps
    }

    /// The quiet that proves a stall of a batch that came at its own pace: [`BURST_RATIO`]
    /// times its mean gap between messages, at least [`Learner::quiet_fast`], at most
    /// [`Learner::quiet_confirm`].
    fn paced_quiet(&self, first: Instant, last: Instant) -> Duration {
        let gaps = self.arrivals.saturating_sub(1).max(1);
        (last.saturating_duration_since(first) * BURST_RATIO / gaps)
            .max(self.quiet_fast())
            .min(self.quiet_confirm())
    }

    /// The quiet that proves a burst's stall with quick ACKs: twice the handshake time (a
    /// round trip or two, what a Nagle gap lasts when our ACKs go at once), at least
    /// [`QUIET_FAST_MIN`], at most [`Learner::quiet_confirm`].
    pub(super) fn quiet_fast(&self) -> Duration {
        (self.handshake * 2)
            .max(QUIET_FAST_MIN)
            .min(self.quiet_confirm())
    }

    /// The quiet period that proves a stall: [`QUIET_CONFIRM`], or with a shorter flush interval
    /// three quarters of it, so that the stall shows before the interval ends (the window is
    /// then learned, not waited for at every interval).
    fn quiet_confirm(&self) -> Duration {
        QUIET_CONFIRM.min(self.policy.flush_interval / 4 * 3)
    }

    /// An ack of `session`'s current connection joined the open batch.
    pub fn ack(&mut self, session: usize) {
        let (Some(current), Some(committing)) =
            (self.current.get_mut(session), self.committing.get(session))
        else {
            debug_assert!(false, "session {session} out of range");
            return;
        };
        *current += 1;
        self.window_floor = self.window_floor.max(*current + committing);
        if self.window_seen.is_some_and(|w| *current + committing > w) {
            // The broker sent more without a release: its window is larger.
            self.window_seen = None;
            self.belief = Belief::LEARNED;
        }
    }

    /// The open batch is taken for a flush due at `now` for `reason`. A proven stall teaches
    /// the broker's window: the messages the batch holds are what it sends unacknowledged; a
    /// probe teaches nothing (see the module docs).
    pub fn take_for(&mut self, reason: FlushReason, now: Instant) {
        // The connection's first commit with no window known spends its probe: a stall that
        // proves nothing, or (a window of 1 has no burst to probe) the interval.
        let probe = self.probe == Probe::Unspent
            && self.broker_window().is_none()
            && match reason {
                FlushReason::Stall => !self.stall_proven(now),
                FlushReason::Interval => true,
                _ => false,
            };
        let size = self.fullest();
        if reason == FlushReason::BrokerWindow {
            let echo = self.is_echo();
            self.belief = self.belief.after_refill(echo);
        }
        // A window does not shrink within a connection: a stall at fewer than the window
        // already seen is a pause in traffic, and teaches nothing.
        let seen = self.window_seen.max(Some(size));
        if reason == FlushReason::Stall && seen != self.window_seen && self.stall_proven(now) {
            if self.window_seen.is_none() && !self.told {
                self.told = true;
                self.news = seen;
            }
            self.window_seen = seen;
            self.belief = Belief::LEARNED;
        }
        self.taken();
        if probe {
            self.probe = Probe::JustTaken { size };
        }
    }

    /// The open batch is taken: its acks are being committed, and the next batch's arrivals
    /// are counted afresh.
    pub fn taken(&mut self) {
        self.committing.copy_from_slice(&self.current);
        self.current.fill(0);
        if matches!(self.probe, Probe::JustTaken { .. } | Probe::CutShort) {
            self.probe = Probe::Spent;
        }
        self.first_arrival = None;
        self.first_lag = Duration::ZERO;
        self.first_before_answer = false;
        self.last_arrival = None;
        self.arrivals = 0;
    }

    /// A window learned by the last batch taken where none was known, once per connection:
    /// for the caller's log line.
    pub fn newly_learned(&mut self) -> Option<usize> {
        self.news.take()
    }
}

#[cfg(test)]
mod tests;
