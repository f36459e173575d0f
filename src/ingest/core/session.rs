//! One MQTT session's state in the core: its connection ([`Link`]), the acks released and not
//! yet written ([`Acks`]), the pings that confirm them ([`Pings`]), and a reconnect's resends held
//! until their burst ends (a [`Burst`] of [`HeldMessage`]s: bodies and fingerprints together). A
//! connection that begins or ends resets what was of it here, in one place
//! ([`SessionState::connected`], [`SessionState::lost`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::ack::AckToken;
use crate::limits::RESEND_QUIET_MIN;
use crate::link::Backoff;
use crate::reading::Timestamp;
use crate::resend::Burst;

/// A session's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Link {
    /// The client is connecting (at start, or resumed after a wait).
    Connecting,
    /// Connected; the broker has the session's subscriptions or they were asked for.
    Up(Subscriptions),
    /// The connection was lost; the client is resumed at `retry_at`.
    Waiting { retry_at: Instant },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Subscriptions {
    Requested,
    /// The broker has (some of) them on this connection.
    Granted,
}

/// One MQTT session (`mqtt.sessions`) and the state of its connection.
pub(super) struct SessionState {
    pub(super) link: Link,
    pub(super) backoff: Backoff,
    /// Counts CONNACKs; a token from an older connection is never sent.
    pub(super) connection: u64,
    /// The session had its subscriptions at least once (readiness).
    pub(super) ever_subscribed: bool,
    pub(super) acks: Acks,
    /// What the broker has confirmed reading ([`Pings`]).
    pub(super) pings: Pings,
    /// Whether the "broker exceeds its window" warning was logged on this connection.
    pub(super) warned_window: bool,
    /// A reconnect's burst of resends, open from a CONNACK with the session kept until it
    /// ends (see the module docs of [`super`]): what it holds is admitted then.
    pub(super) burst: Option<Burst<HeldMessage>>,
    /// Most messages a burst holds: what the broker may have unacknowledged on the session.
    burst_max: usize,
    /// When the burst began or last grew; with what it holds, when it ends.
    pub(super) burst_at: Instant,
    /// The last connection's handshake time.
    pub(super) handshake: Duration,
}

/// A connection's acks released by a commit and not yet on the wire, in arrival order.
#[derive(Default)]
pub(super) struct Acks {
    /// Taken by the client, not yet written to the socket (arrival numbers; bounded by the
    /// client's request channel).
    pub(super) unwritten: VecDeque<u64>,
    /// Waiting for room in the client's request channel. rumqttc writes one request per poll,
    /// so a broker that sends past its window (Mosquitto before 2.0.13 does) can fill the
    /// channel; nothing is dropped, the rest waits here. Bounded by what the broker sends
    /// unacknowledged.
    pub(super) backlog: VecDeque<AckToken>,
}

impl Acks {
    pub(super) fn owed(&self) -> usize {
        self.unwritten.len() + self.backlog.len()
    }
}

/// A resend held in its burst: what admitting it again needs, beside the fingerprint and
/// arrival number the [`Burst`] keeps.
pub(super) struct HeldMessage {
    pub(super) topic: Bytes,
    pub(super) payload: Bytes,
    pub(super) pkid: u16,
    pub(super) qos: u8,
    pub(super) received: Timestamp,
    pub(super) at: Instant,
}

/// A connection's pings, which tell which of its acks the broker has read. A broker handles a
/// connection's packets in order and answers each PINGREQ, so a PINGRESP says it has read every
/// ack written before the PINGREQ it answers; a message whose ack the broker has read is never
/// resent, so a later burst of resends cannot hold its copy (`crate::resend`, where this tells
/// a new message on a reused packet id from a resend when their contents are the same).
#[derive(Debug, Default)]
pub(super) struct Pings {
    /// The first arrival number of this connection: its acks are those of later arrivals.
    pub(super) first_arrival: u64,
    /// Arrival number of the last ack written on this connection (0: none yet).
    pub(super) written_through: u64,
    /// `written_through` at each PINGREQ written and not answered yet, oldest first (ours and
    /// the keep-alive ones; at most a few: ours only while fewer than
    /// [`MARKERS_IN_FLIGHT_MAX`] are, and rumqttc ends the connection when a keep-alive ping
    /// goes unanswered until the next).
    pub(super) sent: VecDeque<u64>,
    /// A PINGREQ asked for is in the client's request channel.
    pub(super) queued: bool,
    /// The marker of the last release on this connection ([`Marker`]).
    pub(super) marker: Marker,
}

/// A PINGREQ right behind a release's acks. Its answer confirms them ([`Pings`]) and tells the
/// batcher how soon a refill may come as things are now
/// ([`crate::batcher::Batcher::release_pinged`]). Cost: 2 bytes each way per commit, written
/// with the acks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum Marker {
    #[default]
    None,
    /// Acks through this arrival number were released; a PINGREQ written after them is asked
    /// for.
    Wanted { through: u64 },
    /// One went out after them; its answer is awaited.
    Sent { through: u64 },
}

/// At most this many PINGREQs of a connection await their answers when a marker is asked for:
/// a broker slow to answer gets no more (the batcher then goes by the handshake's round trip).
pub(super) const MARKERS_IN_FLIGHT_MAX: usize = 4;

impl SessionState {
    /// `burst_max`: the most resends a reconnect's burst holds (at least one).
    pub(super) fn new(backoff: Backoff, burst_max: usize, now: Instant) -> SessionState {
        SessionState {
            link: Link::Connecting,
            backoff,
            connection: 0,
            ever_subscribed: false,
            acks: Acks::default(),
            pings: Pings::default(),
            warned_window: false,
            burst: None,
            burst_max,
            burst_at: now,
            handshake: Duration::ZERO,
        }
    }

    pub(super) fn is_up(&self) -> bool {
        matches!(self.link, Link::Up(_))
    }

    /// Whether the burst holds resends.
    pub(super) fn holds_resends(&self) -> bool {
        self.burst.as_ref().is_some_and(|b| !b.is_empty())
    }

    /// When the held burst ends for quiet; `None` with nothing held.
    pub(super) fn burst_deadline(&self) -> Option<Instant> {
        let quiet = RESEND_QUIET_MIN.max(4 * self.handshake);
        self.holds_resends().then_some(self.burst_at + quiet)
    }

    /// A CONNACK: connection `connection + 1` begins with the arrival `first_arrival`; with the
    /// session kept (`session_present`), a burst of resends may come first.
    pub(super) fn connected(
        &mut self,
        first_arrival: u64,
        session_present: bool,
        handshake: Duration,
        now: Instant,
    ) {
        self.connection += 1;
        self.link = Link::Up(Subscriptions::Requested);
        self.reset_connection(first_arrival);
        self.warned_window = false;
        self.backoff.reset();
        // Held resends of the last connection are resent again on this one.
        self.burst = session_present.then(|| Burst::new(self.burst_max));
        self.burst_at = now;
        self.handshake = handshake;
    }

    /// The connection was lost at `now`: the client is resumed after the returned delay.
    pub(super) fn lost(&mut self, now: Instant) -> Duration {
        self.reset_connection(u64::MAX);
        // Unacknowledged, the held resends come again with the next connection's burst.
        self.burst = None;
        let delay = self.backoff.next_delay();
        self.link = Link::Waiting {
            retry_at: now + delay,
        };
        delay
    }

    /// The connection began or ended: nothing of it is owed or awaited any more.
    fn reset_connection(&mut self, first_arrival: u64) {
        self.acks = Acks::default();
        self.pings = Pings {
            first_arrival,
            ..Pings::default()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(at: Instant) -> HeldMessage {
        HeldMessage {
            topic: Bytes::from_static(b"t"),
            payload: Bytes::from_static(b"1"),
            pkid: 1,
            qos: 1,
            received: Timestamp::from_secs(0),
            at,
        }
    }

    /// A burst belongs to one connection: a CONNACK with the session kept opens one, without
    /// it none; a new connection or a lost one drops what the old one held (unacknowledged,
    /// the broker resends it), with its fingerprints, which the burst keeps beside the bodies.
    #[test]
    fn a_burst_lives_and_dies_with_its_connection() {
        let t0 = Instant::now();
        let backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(3));
        let mut s = SessionState::new(backoff, 2, t0);
        assert!(s.burst.is_none() && s.burst_deadline().is_none());
        s.connected(1, false, Duration::ZERO, t0);
        assert!(s.burst.is_none(), "a new session: nothing is resent");
        s.connected(1, true, Duration::from_millis(100), t0);
        let burst = s
            .burst
            .as_mut()
            .expect("the session was kept: a burst may come");
        assert!(
            burst.is_empty() && s.burst_deadline().is_none(),
            "nothing held yet"
        );
        let burst = s.burst.as_mut().unwrap();
        burst.hold(7, 1, held(t0));
        burst.hold(8, 2, held(t0));
        assert!(
            burst.is_full(),
            "bounded by what the broker may have unacknowledged"
        );
        assert_eq!(
            s.burst_deadline(),
            Some(t0 + RESEND_QUIET_MIN.max(Duration::from_millis(400))),
            "four handshakes of quiet, at least the minimum"
        );
        s.connected(3, true, Duration::ZERO, t0);
        assert!(
            s.burst.as_ref().is_some_and(Burst::is_empty),
            "a new connection drops what the old one held"
        );
        s.burst.as_mut().unwrap().hold(9, 3, held(t0));
        s.lost(t0);
        assert!(s.burst.is_none(), "a lost connection drops its burst");
    }
}
