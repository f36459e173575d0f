//! The Sparkplug B host application's STATE (`mqtt.sparkplug_host_id`): edge nodes configured
//! to wait for a primary host publish only while it says it is online. Sparkplug 3.0 has the
//! host connect with a clean session and a Will (`spBv1.0/STATE/<host id>`, QoS 1, retained,
//! `{"online":false,"timestamp":<the CONNECT's time>}`), subscribe to its own STATE topic,
//! then publish its birth there (QoS 1, retained, `{"online":true,"timestamp":<the same>}`),
//! publish it again whenever it is delivered an offline STATE of its own, and publish its
//! death before a clean disconnect.
//!
//! Its own connection (`<mqtt.client_id>-state`, MQTT 3.1.1), not an ingest session: those
//! keep a persistent session so that nothing is lost while bucketd restarts, and the
//! specification asks a host's session to be clean. A new Will timestamp needs a new CONNECT
//! options, so each connection attempt builds its client afresh.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rumqttc::{AsyncClient, Event, LastWill, MqttOptions, Packet, QoS};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::MqttConfig;
use crate::mqtt::TlsClientConfig;
use crate::secret::Secret;

/// How long a clean stop waits for the broker to take the death.
const DEATH_WAIT: Duration = Duration::from_secs(2);

/// The STATE topic of host `host_id`.
pub fn topic(host_id: &str) -> String {
    format!("spBv1.0/STATE/{host_id}")
}

/// A STATE payload: `{"online":<online>,"timestamp":<ms>}`.
pub fn payload(online: bool, ms: u64) -> Vec<u8> {
    format!("{{\"online\":{online},\"timestamp\":{ms}}}").into_bytes()
}

/// Whether a STATE payload says offline (what bucketd answers with its birth again);
/// anything else, unreadable included, is left alone.
pub fn says_offline(payload: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(payload)
        .ok()
        .and_then(|v| v.get("online")?.as_bool())
        == Some(false)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The host's STATE connection.
pub struct HostState {
    pub mqtt: MqttConfig,
    pub host_id: String,
    pub password: Option<Secret>,
    pub tls: Option<TlsClientConfig>,
    /// Set once the ingest sessions hold their subscriptions: the birth waits for it, so that
    /// an edge node the birth releases publishes to a subscribed host
    /// (tck-id-message-flow-phid-sparkplug-subscription).
    pub stats: std::sync::Arc<crate::stats::Stats>,
}

/// How a connection ended.
enum Ended {
    Stopping(AsyncClient, Box<rumqttc::EventLoop>),
    /// The connection failed; whether it had been accepted (the backoff starts again).
    Lost(rumqttc::ConnectionError, bool),
}

impl HostState {
    fn options(&self, will_ms: u64) -> MqttOptions {
        let topic = topic(&self.host_id);
        let mut o = MqttOptions::new(
            format!("{}-state", self.mqtt.client_id),
            &self.mqtt.host,
            self.mqtt.port,
        );
        o.set_clean_session(true)
            .set_keep_alive(self.mqtt.keep_alive)
            .set_last_will(LastWill::new(
                topic,
                payload(false, will_ms),
                QoS::AtLeastOnce,
                true,
            ))
            .set_transport(crate::mqtt::transport(self.tls.as_ref()));
        if let Some((user, _)) = &self.mqtt.credentials {
            let password = self.password.as_ref().map(|p| p.expose().to_owned());
            o.set_credentials(user, password.unwrap_or_default());
        }
        o
    }

    /// Keeps the host's STATE published until `cancel`, then publishes its death.
    pub async fn run(self, cancel: CancellationToken) {
        while !self
            .stats
            .subscribed
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
        let mut delay = self.mqtt.reconnect_delay_min;
        loop {
            let will_ms = now_ms();
            let (client, mut events) = AsyncClient::new(self.options(will_ms), 16);
            events
                .network_options
                .set_connection_timeout(self.mqtt.connect_timeout.as_secs().max(1));
            match self.session(client, events, will_ms, &cancel).await {
                Ended::Stopping(client, events) => {
                    self.die(client, events).await;
                    return;
                }
                Ended::Lost(e, connected) => {
                    if connected {
                        delay = self.mqtt.reconnect_delay_min;
                    }
                    warn!(
                        error = %e,
                        "The Sparkplug host STATE connection failed; edge nodes waiting for this host see it offline until it reconnects."
                    );
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(self.mqtt.reconnect_delay_max);
        }
    }

    async fn session(
        &self,
        client: AsyncClient,
        mut events: rumqttc::EventLoop,
        will_ms: u64,
        cancel: &CancellationToken,
    ) -> Ended {
        let topic = topic(&self.host_id);
        let (mut born, mut connected) = (false, false);
        loop {
            let event = tokio::select! {
                () = cancel.cancelled() => return Ended::Stopping(client, Box::new(events)),
                event = events.poll() => event,
            };
            let birth = match event {
                Err(e) => return Ended::Lost(e, connected),
                Ok(Event::Incoming(Packet::ConnAck(_))) => {
                    connected = true;
                    // Subscribe to its own STATE first (tck-id-host-topic-phid-birth-sub-required).
                    let _ = client.try_subscribe(&topic, QoS::AtLeastOnce);
                    false
                }
                Ok(Event::Incoming(Packet::SubAck(_))) => true,
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    born && p.topic == topic && says_offline(&p.payload)
                }
                Ok(_) => false,
            };
            if birth {
                let _ = client.try_publish(&topic, QoS::AtLeastOnce, true, payload(true, will_ms));
                if !born {
                    info!(topic, "Published the Sparkplug host's STATE birth.");
                }
                born = true;
            }
        }
    }

    /// A clean stop: the death (QoS 1, retained), acknowledged, then DISCONNECT.
    async fn die(&self, client: AsyncClient, mut events: Box<rumqttc::EventLoop>) {
        let topic = topic(&self.host_id);
        if client
            .try_publish(&topic, QoS::AtLeastOnce, true, payload(false, now_ms()))
            .is_err()
        {
            return;
        }
        let acked = tokio::time::timeout(DEATH_WAIT, async {
            loop {
                match events.poll().await {
                    Ok(Event::Incoming(Packet::PubAck(_))) => return true,
                    Err(_) => return false,
                    Ok(_) => {}
                }
            }
        })
        .await
        .unwrap_or(false);
        if acked {
            // DISCONNECT written before the socket closes: else the broker publishes the Will
            // too, an offline STATE with the birth's older time.
            let _ = client.try_disconnect();
            let _ = tokio::time::timeout(DEATH_WAIT, async {
                while let Ok(event) = events.poll().await {
                    if matches!(event, Event::Outgoing(rumqttc::Outgoing::Disconnect)) {
                        return;
                    }
                }
            })
            .await;
            info!(topic, "Published the Sparkplug host's STATE death.");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_payloads_are_the_specifications_json() {
        let birth: serde_json::Value =
            serde_json::from_slice(&payload(true, 1_700_000_000_123)).unwrap();
        assert_eq!(
            birth,
            serde_json::json!({"online": true, "timestamp": 1_700_000_000_123_u64})
        );
        assert!(says_offline(&payload(false, 5)));
        assert!(!says_offline(&payload(true, 5)));
        assert!(!says_offline(b"garbage"));
        assert!(!says_offline(b"{\"online\":\"false\"}"));
        assert_eq!(topic("scada1"), "spBv1.0/STATE/scada1");
    }
}
