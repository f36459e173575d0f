//! What one MQTT session's client reports to the ingest core, and how long the core waits
//! before letting it connect again: plain data, no I/O. The client ([`crate::mqtt`]) makes
//! these from rumqttc's packets and errors; the core ([`crate::ingest::core`]) acts on them.

use std::time::Duration;

use bytes::Bytes;

/// The events the ingest loop acts on.
#[derive(Debug)]
pub enum MqttEvent {
    /// CONNACK: connected; `session_present` says whether the broker kept our session.
    /// `handshake`: from the first poll of the attempt to the CONNACK (TCP, TLS, CONNECT): a
    /// round trip or more.
    Connected {
        session_present: bool,
        handshake: Duration,
    },
    /// SUBACK: `refused` lists the filters the broker refused.
    Subscribed {
        refused: Vec<String>,
    },
    Publish(Publish),
    /// This many PUBACKs or PUBRECs were written to the socket (the event loop writes the acks
    /// queued together in one write, and their events come as one).
    AcksSent(usize),
    /// Our DISCONNECT was written to the socket.
    DisconnectSent,
    /// A PINGREQ was written to the socket (asked for with [`crate::mqtt::Mqtt::try_ping`], or
    /// rumqttc's keep-alive ping), after the acks of every `AcksSent` before it.
    PingSent,
    /// A PINGRESP came: the broker has read everything written before the oldest PINGREQ not
    /// answered yet (brokers handle a connection's packets in order and answer each PINGREQ).
    PingAnswered,
    /// Anything else (pings, outgoing subscribe, ...).
    Other,
}

/// A PUBLISH as the broker sent it.
#[derive(Debug, Clone)]
pub struct Publish {
    pub topic: Bytes,
    pub payload: Bytes,
    pub pkid: u16,
    pub qos: u8,
    /// DUP: the broker says this may be a redelivery.
    pub dup: bool,
}

/// Why a poll failed: the connection is down, and the next poll reconnects.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PollError {
    pub message: String,
    /// The broker refused the connection (bad credentials, client id refused, ...): retrying
    /// alone will not fix it, the operator must.
    pub refused: bool,
    /// The TLS handshake or TLS setup failed (certificate not trusted, wrong host name, ...).
    pub tls: bool,
}

/// Capped exponential backoff for reconnects: `min`, doubling to `max`, reset on success.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
    pub attempts: u32,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Backoff {
        Backoff {
            min,
            max,
            next: min,
            attempts: 0,
        }
    }

    /// The delay before the next attempt; doubles the one after.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        self.attempts += 1;
        delay
    }

    pub fn reset(&mut self) {
        self.next = self.min;
        self.attempts = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(500), Duration::from_secs(3));
        let delays: Vec<_> = (0..5).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [500, 1000, 2000, 3000, 3000]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(500));
    }
}
