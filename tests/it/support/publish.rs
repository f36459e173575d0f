//! Publishing workloads: a QoS 1 publisher that waits for the broker's PUBACKs, paced or flat
//! out, and the end-of-stream markers.

use std::time::Duration;

use super::{Broker, unique};

/// Most messages a paced publisher keeps ahead of the consumer. Mosquitto by default queues at
/// most 1000 QoS 1 messages per subscriber beyond its in-flight window and drops the rest
/// (`max_queued_messages`), so a flat-out publisher can lose messages on a shared test broker
/// through no fault of the daemon.
pub const AHEAD_MAX: u64 = 500;

/// End-of-stream markers for `messages`: one empty payload (rejected as `empty_payload`) on
/// every topic they use. MQTT orders messages per topic only (3.1.1 §4.6 "ordered topic"), and
/// brokers do deliver different topics out of order: rumqttd keeps a log per subscription filter
/// and, after a reconnect, resumes each on its own, so a single marker on a topic of its own can
/// arrive before the rest. Once every marker is rejected, every message before it on its topic
/// has arrived. The caller's workload must contain no empty payloads of its own.
pub fn markers(messages: &[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
    let topics: std::collections::BTreeSet<&String> = messages.iter().map(|m| &m.0).collect();
    topics
        .into_iter()
        .map(|t| (t.clone(), Vec::new()))
        .collect()
}

/// Publishes every message with `qos` and returns once the broker has acknowledged all of them
/// (QoS 1), so they are the broker's responsibility from then on.
pub async fn publish_all(broker: &Broker, messages: &[(String, Vec<u8>)], qos: u8) {
    publish_paced(broker, messages, qos, None).await;
}

/// Like [`publish_all`], but stays at most [`AHEAD_MAX`] messages ahead of what `consumer`
/// has received.
pub async fn publish_paced(
    broker: &Broker,
    messages: &[(String, Vec<u8>)],
    qos: u8,
    consumer: Option<std::sync::Arc<bucketd::stats::Stats>>,
) {
    let pace = consumer.map_or(Pace::Flat, Pace::Consumer);
    publish_with(broker, messages, qos, pace).await;
}

/// How fast a publisher goes.
pub enum Pace {
    Flat,
    /// At most [`AHEAD_MAX`] messages ahead of what this in-process daemon has received.
    Consumer(std::sync::Arc<bucketd::stats::Stats>),
    /// This many messages per second: a device fleet's steady stream. Keeps what a broker
    /// queues while the daemon restarts below the broker's queue limit (Mosquitto's
    /// `max_queued_messages` is 1000 by default).
    Rate(u32),
    /// Bursts of `size` messages, one every `every`: devices that report together.
    Bursts {
        size: usize,
        every: Duration,
    },
}

pub async fn publish_with(broker: &Broker, messages: &[(String, Vec<u8>)], qos: u8, pace: Pace) {
    let consumer = match &pace {
        Pace::Consumer(c) => Some(c.clone()),
        _ => None,
    };
    let rate = match pace {
        Pace::Rate(r) => Some(r),
        _ => None,
    };
    let bursts = match pace {
        Pace::Bursts { size, every } => Some((size.max(1), every)),
        _ => None,
    };
    use rumqttc::{AsyncClient, Event, MqttOptions, Outgoing, Packet, QoS};
    let mut opts = MqttOptions::new(unique("pub"), broker.host.clone(), broker.v311_port);
    opts.set_keep_alive(Duration::from_secs(30))
        .set_max_packet_size(1 << 20, 1 << 20)
        .set_inflight(100);
    let (client, mut eventloop) = AsyncClient::new(opts, 1000);
    let qos = rumqttc::qos(qos).unwrap();
    let total = messages.len();
    let messages = messages.to_vec();
    let publisher = tokio::spawn(async move {
        let started = tokio::time::Instant::now();
        let base = consumer
            .as_ref()
            .map_or(0, |c| bucketd::stats::Stats::get(&c.messages_received));
        for (sent, (topic, payload)) in messages.into_iter().enumerate() {
            if let Some(c) = &consumer {
                let ahead = || {
                    sent as u64
                        - (bucketd::stats::Stats::get(&c.messages_received) - base).min(sent as u64)
                };
                while ahead() > AHEAD_MAX {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            if let Some(rate) = rate {
                let due = started + Duration::from_secs_f64(sent as f64 / f64::from(rate));
                tokio::time::sleep_until(due).await;
            }
            if let Some((size, every)) = bursts {
                let burst = u32::try_from(sent / size).unwrap_or(u32::MAX);
                tokio::time::sleep_until(started + every * burst).await;
            }
            client.publish(topic, qos, false, payload).await.unwrap();
        }
        client
    });
    let mut acked = 0;
    let mut sent = 0;
    let deadline = tokio::time::Instant::now()
        + Duration::from_mins(1)
        + rate.map_or(Duration::ZERO, |r| {
            Duration::from_secs_f64(total as f64 / f64::from(r))
        });
    loop {
        let done = match qos {
            QoS::AtMostOnce => sent == total,
            _ => acked == total,
        };
        if done {
            break;
        }
        let event = tokio::time::timeout_at(deadline, eventloop.poll())
            .await
            .expect("publishing took over 60 s")
            .expect("publisher connection failed");
        match event {
            Event::Incoming(Packet::PubAck(_) | Packet::PubComp(_)) => acked += 1,
            Event::Outgoing(Outgoing::Publish(_)) => sent += 1,
            _ => {}
        }
    }
    let client = publisher.await.unwrap();
    client.disconnect().await.unwrap();
    // Drive the event loop until the DISCONNECT is written.
    while let Ok(Ok(event)) = tokio::time::timeout(Duration::from_secs(5), eventloop.poll()).await {
        if matches!(event, Event::Outgoing(Outgoing::Disconnect)) {
            break;
        }
    }
}
