//! One MQTT session's state in the core: its connection ([`Link`]), the acks released and not
//! yet written ([`Acks`]), the pings that confirm them ([`Pings`]), and a reconnect's resends held
//! until their burst ends ([`HeldMessage`]). A connection that begins or ends resets what was
//! of it here, in one place ([`SessionState::reset_connection`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::ack::AckToken;
use crate::limits::RESEND_QUIET_MIN;
use crate::link::Backoff;
use crate::reading::Timestamp;

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
    /// The resends of a reconnect's burst, held until it ends (see the module docs of
    /// [`super`]).
    pub(super) held: Vec<HeldMessage>,
    /// When the burst began or last grew; with `held`, when it ends.
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

/// A resend held in its burst: what admitting it again needs.
pub(super) struct HeldMessage {
    pub(super) topic: Bytes,
    pub(super) payload: Bytes,
    pub(super) pkid: u16,
    pub(super) qos: u8,
    pub(super) received: Timestamp,
    /// Its ack token's arrival number.
    pub(super) arrival: u64,
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
    pub(super) fn new(backoff: Backoff, now: Instant) -> SessionState {
        SessionState {
            link: Link::Connecting,
            backoff,
            connection: 0,
            ever_subscribed: false,
            acks: Acks::default(),
            pings: Pings::default(),
            warned_window: false,
            held: Vec::new(),
            burst_at: now,
            handshake: Duration::ZERO,
        }
    }

    pub(super) fn is_up(&self) -> bool {
        matches!(self.link, Link::Up(_))
    }

    /// When the held burst ends for quiet; `None` with nothing held.
    pub(super) fn burst_deadline(&self) -> Option<Instant> {
        let quiet = RESEND_QUIET_MIN.max(4 * self.handshake);
        (!self.held.is_empty()).then_some(self.burst_at + quiet)
    }

    /// A CONNACK: connection `connection + 1` begins with the arrival `first_arrival`.
    pub(super) fn connected(&mut self, first_arrival: u64, handshake: Duration, now: Instant) {
        self.connection += 1;
        self.link = Link::Up(Subscriptions::Requested);
        self.reset_connection(first_arrival);
        self.warned_window = false;
        self.backoff.reset();
        // Held resends of the last connection are resent again on this one.
        self.held.clear();
        self.burst_at = now;
        self.handshake = handshake;
    }

    /// The connection was lost at `now`: the client is resumed after the returned delay.
    pub(super) fn lost(&mut self, now: Instant) -> Duration {
        self.reset_connection(u64::MAX);
        // Unacknowledged, the held resends come again with the next connection's burst.
        self.held.clear();
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
