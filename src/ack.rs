//! [`AckToken`]: what a PUBACK (or PUBREC) needs, taken from an incoming PUBLISH. Acks leave in
//! arrival order, and only after the commit holding the message (MQTT-4.6.0-2).

/// The acknowledgement owed for one QoS 1/2 message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckToken {
    /// Arrival sequence number across the daemon's life; strictly increasing.
    pub arrival: u64,
    /// The connection the message came on. A packet id means nothing on a later connection
    /// (the broker may reuse it), so tokens of an older connection are never sent.
    pub connection: u64,
    /// The session (`mqtt.sessions`, 0-based) the message came on, whose connection sends the
    /// ack; `connection` counts that session's connections.
    pub session: u16,
    pub pkid: u16,
    /// 1 or 2.
    pub qos: u8,
}

/// One of the daemon's MQTT sessions (`mqtt.sessions`, 0-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(u16);

impl SessionId {
    pub const fn new(n: u16) -> SessionId {
        SessionId(n)
    }

    /// The sessions of a daemon with `count` of them. Config validation keeps `count` within
    /// `config::SESSIONS_MAX` (16), far below `u16::MAX`: the ids beyond are not made.
    pub fn all(count: usize) -> impl Iterator<Item = SessionId> {
        (0..u16::try_from(count).unwrap_or(u16::MAX)).map(SessionId)
    }

    /// The session at `index`, if an id can name it.
    pub fn from_index(index: usize) -> Option<SessionId> {
        u16::try_from(index).ok().map(SessionId)
    }

    pub const fn get(self) -> u16 {
        self.0
    }

    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}
