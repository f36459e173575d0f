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
