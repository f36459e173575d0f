//! [`Mqtt`]: one rumqttc client (MQTT 5 or 3.1.1) behind one type, with the events bucketd cares
//! about normalised into [`MqttEvent`]. Sets up the persistent session, manual acknowledgements,
//! the in-flight window and packet size limits. Knows nothing about decoding or storage.
//!
//! The event loop runs in a task of its own that hands events over one at a time: rumqttc's
//! `poll` is not cancel-safe while it connects, and a connect dropped after the broker took the
//! CONNECT leaves a session behind that the next attempt finds "present", without the
//! subscriptions bucketd never got to send (a daemon that never subscribes). The task polls only
//! when the last event was taken, so backpressure is as if the ingest loop polled itself.

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{Notify, mpsc};

use crate::ack::AckToken;
use crate::config::{MqttConfig, Protocol, Subscription};
use crate::link::{MqttEvent, PollError, Publish};
use crate::secret::Secret;

// Boxed event loops: the two differ in size by kilobytes and one exists per session.
enum Client {
    V4 {
        client: rumqttc::AsyncClient,
        eventloop: Box<rumqttc::EventLoop>,
    },
    V5 {
        client: rumqttc::v5::AsyncClient,
        eventloop: Box<rumqttc::v5::EventLoop>,
    },
}

/// Whether the TCP ACKs of what the client reads go out at once (`TCP_QUICKACK`, which the
/// vendored rumqttc re-arms after every read; Linux and Android only): the flush policy then
/// believes a broker's stall sooner (`crate::batcher`).
pub const QUICK_ACKS: bool = cfg!(any(target_os = "linux", target_os = "android"));

/// Outgoing QoS 1/2 publishes the client keeps state for. bucketd publishes only QoS 0 (Sparkplug
/// rebirth requests); rumqttc
/// preallocates a slot per possible packet id (for MQTT 5 by default all 65,535 of them: 14 MB
/// of the 21 MB idle RSS before this was set).
const OUTGOING_INFLIGHT: u16 = 8;

/// The request side of a client (both rumqttc handles are cheap clones).
enum Requests {
    V4(rumqttc::AsyncClient),
    V5(rumqttc::v5::AsyncClient),
}

/// One session's client: requests go out through it, events come from its event loop's task.
pub struct Mqtt {
    requests: Requests,
    subscriptions: Vec<(String, u8)>,
    /// The event loop, until the first poll moves it into its task.
    driver: Option<Driver>,
    events: Option<mpsc::Receiver<Result<MqttEvent, PollError>>>,
    /// Lets the task reconnect after it reported a lost connection (the caller's backoff).
    resume: Arc<Notify>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// The event loop, driven by its own task ([`Driver::run`]).
struct Driver {
    client: Client,
    subscriptions: Vec<(String, u8)>,
    /// Whether the connection is up (a CONNACK came and no error since).
    up: bool,
    /// When the first poll of the current connection attempt began.
    attempt: Option<std::time::Instant>,
    /// `mqtt.max_packet_size` and `mqtt.max_packet_size_to_drop`, in bytes.
    max_packet: usize,
    max_packet_to_drop: usize,
    /// MQTT 3.1.1: the incoming limit was raised for this connection attempt, to take in and
    /// reject a message larger than `max_packet` ([`oversized_v4`]).
    raised: bool,
    /// The connection failed after its last read had queued events: those are handed over
    /// first, then this ([`Driver::poll_client`]).
    failure: Option<PollError>,
}

impl Drop for Mqtt {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl Mqtt {
    /// Builds the client of session `session` (0-based, below `cfg.sessions`): its client id
    /// and filters are [`MqttConfig::session_client_id`] and [`MqttConfig::session_filter`].
    /// Nothing connects until the first [`Mqtt::poll`].
    pub fn new(
        cfg: &MqttConfig,
        session: usize,
        password: Option<&Secret>,
        tls: Option<&TlsClientConfig>,
        subscriptions: &[Subscription],
    ) -> Mqtt {
        let cap = crate::limits::ack_request_capacity(cfg.receive_maximum);
        let password = password.map(|p| p.expose().to_owned()).unwrap_or_default();
        let transport = || transport(tls);
        let client_id = cfg.session_client_id(session);
        let client = match cfg.protocol {
            Protocol::V311 => {
                let mut o = rumqttc::MqttOptions::new(&client_id, &cfg.host, cfg.port);
                o.set_clean_session(false)
                    .set_inflight(OUTGOING_INFLIGHT)
                    .set_manual_acks(true)
                    .set_keep_alive(cfg.keep_alive)
                    .set_max_packet_size(cfg.max_packet_bytes, cfg.max_packet_bytes)
                    .set_transport(transport());
                if let Some((user, _)) = &cfg.credentials {
                    o.set_credentials(user, password);
                }
                let (client, mut eventloop) = rumqttc::AsyncClient::new(o, cap);
                let network = &mut eventloop.network_options;
                network.set_connection_timeout(cfg.connect_timeout.as_secs().max(1));
                network.set_tcp_quickack(true);
                Client::V4 {
                    client,
                    eventloop: Box::new(eventloop),
                }
            }
            Protocol::V5 => {
                let mut o = rumqttc::v5::MqttOptions::new(&client_id, &cfg.host, cfg.port);
                o.set_clean_start(false)
                    .set_outgoing_inflight_upper_limit(OUTGOING_INFLIGHT)
                    .set_manual_acks(true)
                    .set_keep_alive(cfg.keep_alive)
                    .set_receive_maximum(Some(cfg.receive_maximum))
                    .set_max_packet_size(Some(
                        u32::try_from(cfg.max_packet_bytes)
                            .expect("config validation keeps mqtt.max_packet_size below 256 MiB"),
                    ))
                    .set_session_expiry_interval(Some(
                        u32::try_from(cfg.session_expiry.as_secs()).expect(
                            "config validation keeps mqtt.session_expiry within u32 seconds",
                        ),
                    ))
                    .set_connection_timeout(cfg.connect_timeout.as_secs().max(1))
                    .set_transport(transport());
                if let Some((user, _)) = &cfg.credentials {
                    o.set_credentials(user, password);
                }
                let mut network = o.network_options();
                network.set_tcp_quickack(true);
                o.set_network_options(network);
                let (client, eventloop) = rumqttc::v5::AsyncClient::new(o, cap);
                Client::V5 {
                    client,
                    eventloop: Box::new(eventloop),
                }
            }
        };
        let subscriptions: Vec<(String, u8)> = subscriptions
            .iter()
            .map(|s| (cfg.session_filter(&s.filter), s.qos))
            .collect();
        let requests = match &client {
            Client::V4 { client, .. } => Requests::V4(client.clone()),
            Client::V5 { client, .. } => Requests::V5(client.clone()),
        };
        Mqtt {
            requests,
            subscriptions: subscriptions.clone(),
            driver: Some(Driver {
                client,
                up: false,
                attempt: None,
                subscriptions,
                max_packet: cfg.max_packet_bytes,
                max_packet_to_drop: cfg.max_packet_bytes_to_drop,
                raised: false,
                failure: None,
            }),
            events: None,
            resume: Arc::new(Notify::new()),
            task: None,
        }
    }

    /// The next event. Cancel-safe. After an error (the connection is down) the next event
    /// comes only after [`Mqtt::resume`]: the caller decides when to reconnect.
    pub async fn poll(&mut self) -> Result<MqttEvent, PollError> {
        std::future::poll_fn(|cx| self.poll_event(cx)).await
    }

    /// [`Mqtt::poll`] as a poll function, for waiting on several sessions at once. Starts the
    /// event loop's task on the first call (inside the runtime).
    pub fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Result<MqttEvent, PollError>> {
        if let Some(driver) = self.driver.take() {
            // One event handed over at a time: the task polls again only once it is taken.
            let (tx, rx) = mpsc::channel(1);
            self.task = Some(tokio::spawn(driver.run(tx, self.resume.clone())));
            self.events = Some(rx);
        }
        let Some(events) = self.events.as_mut() else {
            return Poll::Pending;
        };
        events.poll_recv(cx).map(|event| {
            event.unwrap_or_else(|| {
                Err(PollError {
                    message: "the MQTT event loop's task stopped".into(),
                    refused: false,
                    tls: false,
                })
            })
        })
    }

    /// Lets the event loop reconnect after the error it reported.
    pub fn resume(&self) {
        self.resume.notify_one();
    }
}

impl Driver {
    /// Polls the event loop and hands each event over, waiting for `resume` after an error.
    async fn run(
        mut self,
        events: mpsc::Sender<Result<MqttEvent, PollError>>,
        resume: Arc<Notify>,
    ) {
        loop {
            let event = self.poll().await;
            let failed = event.is_err();
            if events.send(event).await.is_err() {
                return; // The session is gone.
            }
            if failed {
                resume.notified().await;
            }
        }
    }

    /// Drives the connection and returns the next event. Not cancel-safe while connecting
    /// (see the module docs): only [`Driver::run`] calls it.
    async fn poll(&mut self) -> Result<MqttEvent, PollError> {
        if !self.up {
            self.attempt.get_or_insert_with(std::time::Instant::now);
        }
        let event = self.poll_client().await;
        match &event {
            Ok(MqttEvent::Connected { .. }) => self.up = true,
            Err(_) => {
                self.up = false;
                self.attempt = None;
            }
            Ok(_) => {}
        }
        event
    }

    /// The event loop's next event, as an [`MqttEvent`]. When a connection fails after a read
    /// that queued several packets, rumqttc keeps the rest queued and hands them over after the
    /// next connection's CONNACK (MQTT 3.1.1) or before it (MQTT 5): a message of the old
    /// connection would pass for one of the new (its ack sent there, under a packet id that may
    /// name another message now). They come here before the failure instead: `Other` stands
    /// for the failure until they are taken.
    async fn poll_client(&mut self) -> Result<MqttEvent, PollError> {
        let failure = &mut self.failure;
        let link = Link {
            attempt: &mut self.attempt,
            subscriptions: &self.subscriptions,
            max_packet: (self.max_packet, self.max_packet_to_drop),
            raised: &mut self.raised,
        };
        match &mut self.client {
            Client::V4 { eventloop, .. } => {
                let polled = next_event!(failure, eventloop);
                let queued = |e: &rumqttc::EventLoop| !e.state.events.is_empty();
                match link.v4_event(polled, eventloop) {
                    Err(e) => failed(failure, queued(eventloop), e),
                    event => event,
                }
            }
            Client::V5 { eventloop, .. } => {
                let polled = next_event!(failure, eventloop);
                let queued = |e: &rumqttc::v5::EventLoop| !e.state.events.is_empty();
                match link.v5_event(polled, eventloop) {
                    Err(e) => failed(failure, queued(eventloop), e),
                    event => event,
                }
            }
        }
    }
}

/// What the normalisers of the two protocols' events read and update of the [`Driver`].
struct Link<'a> {
    attempt: &'a mut Option<std::time::Instant>,
    subscriptions: &'a [(String, u8)],
    /// `mqtt.max_packet_size` and `mqtt.max_packet_size_to_drop`, in bytes.
    max_packet: (usize, usize),
    raised: &'a mut bool,
}

impl Link<'_> {
    /// The connection attempt's time until its CONNACK.
    fn handshake(&mut self) -> Duration {
        self.attempt.take().map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// The filters a SUBACK refused, by its return codes in the order subscribed.
    fn refused<C>(&self, codes: &[C], failed: impl Fn(&C) -> Option<String>) -> Vec<String> {
        self.subscriptions
            .iter()
            .zip(codes)
            .filter_map(|((f, _), c)| failed(c).map(|why| format!("{f}{why}")))
            .collect()
    }

    /// An MQTT 3.1.1 event loop's event as an [`MqttEvent`].
    fn v4_event(
        mut self,
        polled: Result<rumqttc::Event, rumqttc::ConnectionError>,
        eventloop: &mut rumqttc::EventLoop,
    ) -> Result<MqttEvent, PollError> {
        use rumqttc::{Event, Outgoing, Packet};
        let is_ack = |e: &Event| {
            matches!(
                e,
                Event::Outgoing(Outgoing::PubAck(_) | Outgoing::PubRec(_))
            )
        };
        match polled {
            Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                if std::mem::take(self.raised) {
                    // This connection keeps the raised limit; the next one is normal.
                    let limit = self.max_packet.0;
                    eventloop.mqtt_options.set_max_packet_size(limit, limit);
                }
                Ok(MqttEvent::Connected {
                    session_present: ack.session_present,
                    handshake: self.handshake(),
                })
            }
            Ok(Event::Incoming(Packet::SubAck(ack))) => Ok(MqttEvent::Subscribed {
                refused: self.refused(&ack.return_codes, |c| {
                    matches!(c, rumqttc::SubscribeReasonCode::Failure).then(String::new)
                }),
            }),
            Ok(Event::Incoming(Packet::Publish(p))) => Ok(MqttEvent::Publish(Publish {
                topic: Bytes::from(p.topic),
                payload: p.payload,
                pkid: p.pkid,
                qos: p.qos as u8,
                dup: p.dup,
            })),
            Ok(e) if is_ack(&e) => Ok(MqttEvent::AcksSent(
                1 + take_acks_sent(&mut eventloop.state.events, is_ack),
            )),
            Ok(Event::Outgoing(Outgoing::Disconnect)) => Ok(MqttEvent::DisconnectSent),
            Ok(Event::Outgoing(Outgoing::PingReq)) => Ok(MqttEvent::PingSent),
            Ok(Event::Incoming(Packet::PingResp)) => Ok(MqttEvent::PingAnswered),
            Ok(_) => Ok(MqttEvent::Other),
            Err(e) => {
                let mut message = e.to_string();
                if let rumqttc::ConnectionError::MqttState(rumqttc::StateError::Deserialization(
                    rumqttc::mqttbytes::Error::PayloadSizeLimitExceeded(size),
                )) = &e
                {
                    message = oversized_v4(
                        &mut eventloop.mqtt_options,
                        *size,
                        self.max_packet.0,
                        self.max_packet.1,
                        self.raised,
                    );
                }
                Err(PollError {
                    refused: matches!(e, rumqttc::ConnectionError::ConnectionRefused(_)),
                    tls: tls_error_v4(&e),
                    message,
                })
            }
        }
    }

    /// An MQTT 5 event loop's event as an [`MqttEvent`].
    fn v5_event(
        mut self,
        polled: Result<rumqttc::v5::Event, rumqttc::v5::ConnectionError>,
        eventloop: &mut rumqttc::v5::EventLoop,
    ) -> Result<MqttEvent, PollError> {
        use rumqttc::Outgoing;
        use rumqttc::v5::Event;
        use rumqttc::v5::mqttbytes::v5::{Packet, SubscribeReasonCode};
        let is_ack = |e: &Event| {
            matches!(
                e,
                Event::Outgoing(Outgoing::PubAck(_) | Outgoing::PubRec(_))
            )
        };
        match polled {
            Ok(Event::Incoming(Packet::ConnAck(ack))) => Ok(MqttEvent::Connected {
                session_present: ack.session_present,
                handshake: self.handshake(),
            }),
            Ok(Event::Incoming(Packet::SubAck(ack))) => Ok(MqttEvent::Subscribed {
                refused: self.refused(&ack.return_codes, |c| {
                    (!matches!(c, SubscribeReasonCode::Success(_))).then(|| format!(" ({c:?})"))
                }),
            }),
            Ok(Event::Incoming(Packet::Publish(p))) => Ok(MqttEvent::Publish(Publish {
                topic: p.topic,
                payload: p.payload,
                pkid: p.pkid,
                qos: p.qos as u8,
                dup: p.dup,
            })),
            Ok(e) if is_ack(&e) => Ok(MqttEvent::AcksSent(
                1 + take_acks_sent(&mut eventloop.state.events, is_ack),
            )),
            Ok(Event::Outgoing(Outgoing::Disconnect)) => Ok(MqttEvent::DisconnectSent),
            Ok(Event::Outgoing(Outgoing::PingReq)) => Ok(MqttEvent::PingSent),
            Ok(Event::Incoming(Packet::PingResp(_))) => Ok(MqttEvent::PingAnswered),
            Ok(_) => Ok(MqttEvent::Other),
            Err(e) => Err(PollError {
                refused: matches!(e, rumqttc::v5::ConnectionError::ConnectionRefused(_)),
                tls: tls_error_v5(&e),
                message: e.to_string(),
            }),
        }
    }
}

/// The event loop's next event; after a failure whose read left events queued, those first and
/// then the failure ([`Driver::poll_client`]). A macro: the two protocols' event loops share no
/// type.
macro_rules! next_event {
    ($failure:expr, $eventloop:expr) => {
        if $failure.is_some() {
            match $eventloop.state.events.pop_front() {
                Some(event) => Ok(event),
                None => return Err($failure.take().expect("checked above")),
            }
        } else {
            $eventloop.poll().await
        }
    };
}
use next_event;

/// A connection's failure `e`, unless events read before it are still `queued`: then it waits
/// in `failure`, and `Other` stands for it until they are taken.
fn failed(
    failure: &mut Option<PollError>,
    queued: bool,
    e: PollError,
) -> Result<MqttEvent, PollError> {
    if !queued {
        return Err(e);
    }
    *failure = Some(e);
    Ok(MqttEvent::Other)
}

/// Pops the events at the front of the event loop's queue that `is_ack` says are acks written
/// (the rest of a batch the event loop wrote together) and returns how many: one hand-over to
/// the ingest task for the batch instead of one each. Stops at the first other event, so the
/// order of events is kept.
fn take_acks_sent<E>(queued: &mut VecDeque<E>, is_ack: impl Fn(&E) -> bool) -> usize {
    let mut n = 0;
    while queued.front().is_some_and(&is_ack) {
        queued.pop_front();
        n += 1;
    }
    n
}

/// MQTT 3.1.1 has no way to tell the broker our packet size limit, so a QoS 1 message over it
/// resets the connection, and the broker redelivers it on the next one, forever. Up to
/// `max_packet_to_drop` the next connection takes packets of `size` in, so that the message
/// reaches admission, which rejects it (acknowledged, dead-lettered, `payload_too_large`); the
/// limit is back to normal for the connection after. Returns the error to report.
fn oversized_v4(
    options: &mut rumqttc::MqttOptions,
    size: usize,
    max_packet: usize,
    max_packet_to_drop: usize,
    raised: &mut bool,
) -> String {
    if size <= max_packet_to_drop {
        options.set_max_packet_size(size, max_packet);
        *raised = true;
        format!(
            "the broker sent a {size}-byte packet, over mqtt.max_packet_size ({max_packet}); \
             MQTT 3.1.1 cannot tell it the limit, so the next connection takes it in to reject it"
        )
    } else {
        format!(
            "the broker sent a {size}-byte packet, over mqtt.max_packet_size_to_drop \
             ({max_packet_to_drop}) too; it will redeliver it on every connection and nothing \
             else arrives meanwhile: remove it at the broker (or clear this client's session), \
             raise mqtt.max_packet_size_to_drop, or use MQTT 5, which tells the broker the limit"
        )
    }
}

impl Mqtt {
    /// Queues one SUBSCRIBE carrying every configured filter.
    pub fn subscribe_all(&self) -> Result<(), String> {
        match &self.requests {
            Requests::V4(client) => {
                let filters = self.subscriptions.iter().map(|(f, q)| {
                    rumqttc::SubscribeFilter::new(
                        f.clone(),
                        rumqttc::qos(*q)
                            .expect("config validation keeps a subscription's qos 0 or 1"),
                    )
                });
                client
                    .try_subscribe_many(filters)
                    .map_err(|e| e.to_string())
            }
            Requests::V5(client) => {
                use rumqttc::v5::mqttbytes::v5::Filter;
                let filters = self.subscriptions.iter().map(|(f, q)| {
                    Filter::new(
                        f.clone(),
                        rumqttc::v5::mqttbytes::qos(*q)
                            .expect("config validation keeps a subscription's qos 0 or 1"),
                    )
                });
                client
                    .try_subscribe_many(filters)
                    .map_err(|e| e.to_string())
            }
        }
    }

    /// Queues the acknowledgement for one message. It is written by a later [`Mqtt::poll`].
    pub fn try_ack(&self, token: &AckToken) -> Result<(), String> {
        match &self.requests {
            Requests::V4(client) => {
                let publish = rumqttc::Publish {
                    dup: false,
                    qos: rumqttc::qos(token.qos).expect("tokens are made for QoS 1/2"),
                    retain: false,
                    topic: String::new(),
                    pkid: token.pkid,
                    payload: Bytes::new(),
                };
                client.try_ack(&publish).map_err(|e| e.to_string())
            }
            Requests::V5(client) => {
                let mut publish = rumqttc::v5::mqttbytes::v5::Publish::new(
                    "",
                    rumqttc::v5::mqttbytes::qos(token.qos).expect("tokens are made for QoS 1/2"),
                    Bytes::new(),
                    None,
                );
                publish.pkid = token.pkid;
                client.try_ack(&publish).map_err(|e| e.to_string())
            }
        }
    }

    /// Queues a QoS 0 publish (a Sparkplug rebirth request).
    pub fn try_publish(&self, topic: &str, payload: Vec<u8>) -> Result<(), String> {
        match &self.requests {
            Requests::V4(c) => c
                .try_publish(topic, rumqttc::QoS::AtMostOnce, false, payload)
                .map_err(|e| e.to_string()),
            Requests::V5(c) => c
                .try_publish(
                    topic,
                    rumqttc::v5::mqttbytes::QoS::AtMostOnce,
                    false,
                    payload,
                )
                .map_err(|e| e.to_string()),
        }
    }

    /// Queues a PINGREQ, written after the acks queued before it; its answer
    /// ([`MqttEvent::PingAnswered`]) says the broker has read them.
    pub fn try_ping(&self) -> Result<(), String> {
        match &self.requests {
            Requests::V4(client) => client.try_ping().map_err(|e| e.to_string()),
            Requests::V5(client) => client.try_ping().map_err(|e| e.to_string()),
        }
    }

    /// Queues a DISCONNECT.
    pub fn try_disconnect(&self) -> Result<(), String> {
        match &self.requests {
            Requests::V4(client) => client.try_disconnect().map_err(|e| e.to_string()),
            Requests::V5(client) => client.try_disconnect().map_err(|e| e.to_string()),
        }
    }
}

/// The client's TLS settings (rustls); a build without the `tls` feature has none.
#[cfg(feature = "tls")]
pub type TlsClientConfig = std::sync::Arc<rustls::ClientConfig>;
/// The client's TLS settings; this build has no TLS (Cargo feature `tls`), so there are none.
#[cfg(not(feature = "tls"))]
pub type TlsClientConfig = std::convert::Infallible;

/// TCP, or TLS with `tls` (also the forwarder's, to an upstream broker).
#[cfg(feature = "tls")]
pub fn transport(tls: Option<&TlsClientConfig>) -> rumqttc::Transport {
    match tls {
        Some(config) => {
            rumqttc::Transport::tls_with_config(rumqttc::TlsConfiguration::Rustls(config.clone()))
        }
        None => rumqttc::Transport::tcp(),
    }
}

#[cfg(not(feature = "tls"))]
pub fn transport(tls: Option<&TlsClientConfig>) -> rumqttc::Transport {
    match tls {
        Some(never) => match *never {},
        None => rumqttc::Transport::tcp(),
    }
}

fn tls_error_v4(e: &rumqttc::ConnectionError) -> bool {
    #[cfg(feature = "tls")]
    if matches!(e, rumqttc::ConnectionError::Tls(_)) {
        return true;
    }
    tls_failure(e)
}

fn tls_error_v5(e: &rumqttc::v5::ConnectionError) -> bool {
    #[cfg(feature = "tls")]
    if matches!(e, rumqttc::v5::ConnectionError::Tls(_)) {
        return true;
    }
    tls_failure(e)
}

/// Without TLS nothing fails for TLS reasons.
#[cfg(not(feature = "tls"))]
fn tls_failure(_: &(dyn std::error::Error + 'static)) -> bool {
    false
}

/// Whether `e` was caused by rustls (a handshake failure arrives as an I/O error wrapping it,
/// an alert from the broker sometimes only as text).
#[cfg(feature = "tls")]
fn tls_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(e);
    while let Some(err) = source {
        if err.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io.get_ref().is_some_and(
                <dyn std::error::Error + std::marker::Send + std::marker::Sync + 'static>::is::<
                    rustls::Error,
                >,
            )
        {
            return true;
        }
        source = err.source();
    }
    // Some paths keep only the text (a TLS alert from the broker read as an MQTT decoding
    // error): rustls' wording for an alert, such as a client certificate the broker requires.
    e.to_string().contains("received fatal alert")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both protocols' clients acknowledge TCP segments at once (vendor/rumqttc/PATCHED.md):
    /// without it a broker with Nagle's algorithm on paces each window by our delayed ACK.
    #[test]
    fn both_protocols_ask_for_quick_acks() {
        for protocol in [Protocol::V311, Protocol::V5] {
            let mut raw = crate::config::RawConfig::load(None, []).expect("the defaults load");
            raw.mqtt.protocol = protocol;
            let cfg = crate::config::Config::try_from(raw).expect("defaults are valid");
            let mqtt = Mqtt::new(&cfg.mqtt, 0, None, None, &cfg.subscriptions);
            let quickack = match &mqtt.driver.as_ref().expect("not started").client {
                Client::V4 { eventloop, .. } => eventloop.network_options.tcp_quickack(),
                Client::V5 { eventloop, .. } => eventloop.options.network_options().tcp_quickack(),
            };
            assert!(quickack, "{protocol:?}");
        }
    }

    /// Reads one MQTT packet (fixed header, remaining length, body) from `stream`.
    async fn read_packet(stream: &mut tokio::net::TcpStream) -> Vec<u8> {
        use tokio::io::AsyncReadExt;
        let mut packet = vec![stream.read_u8().await.expect("a packet")];
        let (mut len, mut shift) = (0usize, 0);
        loop {
            let b = stream.read_u8().await.expect("a remaining length");
            packet.push(b);
            len |= usize::from(b & 0x7f) << shift;
            shift += 7;
            if b & 0x80 == 0 {
                break;
            }
        }
        let start = packet.len();
        packet.resize(start + len, 0);
        stream
            .read_exact(&mut packet[start..])
            .await
            .expect("a body");
        packet
    }

    /// A client of `protocol` for a broker the test plays on `listener`, and its driver, not
    /// started (the test polls it).
    async fn client(protocol: Protocol) -> (tokio::net::TcpListener, Mqtt, Driver) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut raw = crate::config::RawConfig::load(None, []).expect("the defaults load");
        raw.mqtt.protocol = protocol;
        raw.mqtt.host = "127.0.0.1".into();
        raw.mqtt.port = listener.local_addr().unwrap().port();
        let cfg = crate::config::Config::try_from(raw).expect("valid");
        let mut mqtt = Mqtt::new(&cfg.mqtt, 0, None, None, &cfg.subscriptions);
        let driver = mqtt.driver.take().expect("not started");
        (listener, mqtt, driver)
    }

    /// The broker's side of a connection: takes the CONNECT, answers `connack`.
    async fn accept(listener: &tokio::net::TcpListener, connack: &[u8]) -> tokio::net::TcpStream {
        use tokio::io::AsyncWriteExt;
        let (mut stream, _) = listener.accept().await.unwrap();
        assert_eq!(read_packet(&mut stream).await[0], 0x10, "CONNECT");
        stream.write_all(connack).await.unwrap();
        stream
    }

    /// A connection that ends right after a read of several packets: rumqttc keeps the rest
    /// queued, and its 3.1.1 event loop handed them over after the next CONNACK, as if they had
    /// come on the new connection (their acks sent there). They come before the failure.
    #[tokio::test]
    async fn messages_read_before_a_connection_failed_come_before_the_failure() {
        use tokio::io::AsyncWriteExt;
        for protocol in [Protocol::V311, Protocol::V5] {
            let (listener, _mqtt, mut driver) = client(protocol).await;
            // CONNACK (session present), two QoS 1 PUBLISHes to topic "t" (ids 1 and 2), then
            // the end of the stream, in one write.
            let connack: &[u8] = match protocol {
                Protocol::V311 => &[0x20, 2, 1, 0],
                Protocol::V5 => &[0x20, 3, 1, 0, 0],
            };
            let publish = |id: u8| match protocol {
                Protocol::V311 => vec![0x32, 6, 0, 1, b't', 0, id, b'1'],
                Protocol::V5 => vec![0x32, 7, 0, 1, b't', 0, id, 0, b'1'],
            };
            let (connected, mut stream) =
                tokio::join!(driver.poll_client(), accept(&listener, connack));
            assert!(
                matches!(connected, Ok(MqttEvent::Connected { .. })),
                "{connected:?}"
            );
            let mut bytes = publish(1);
            bytes.extend(publish(2));
            stream.write_all(&bytes).await.unwrap();
            stream.shutdown().await.unwrap();
            let mut ids = Vec::new();
            let failure = loop {
                match driver.poll_client().await {
                    Ok(MqttEvent::Publish(Publish { pkid, .. })) => ids.push(pkid),
                    Ok(_) => {}
                    Err(e) => break e,
                }
            };
            assert_eq!(
                ids,
                [1, 2],
                "{protocol:?}: both before the failure ({failure})"
            );
            // The next connection begins with its CONNACK and nothing of the old one.
            let (next, _stream) = tokio::join!(driver.poll_client(), accept(&listener, connack));
            assert!(
                matches!(next, Ok(MqttEvent::Connected { .. })),
                "{protocol:?}: {next:?}"
            );
        }
    }

    /// Acks queued after the connection failed (the ingest task learns of it later) are not
    /// written on the next connection, where the broker resends their messages and a packet id
    /// may name another message: rumqttc dropped the PUBACKs it still had at the failure but
    /// wrote a PUBREC, and any ack queued later (vendor/rumqttc/PATCHED.md). A ping asked for
    /// goes out, and its answer comes as `PingAnswered`.
    #[tokio::test]
    async fn acks_queued_after_a_failure_stay_off_the_next_connection_and_pings_go_out() {
        use tokio::io::AsyncWriteExt;
        for protocol in [Protocol::V311, Protocol::V5] {
            let (listener, mqtt, mut driver) = client(protocol).await;
            let connack: &[u8] = match protocol {
                Protocol::V311 => &[0x20, 2, 1, 0],
                Protocol::V5 => &[0x20, 3, 1, 0, 0],
            };
            let (connected, mut stream) =
                tokio::join!(driver.poll_client(), accept(&listener, connack));
            assert!(matches!(connected, Ok(MqttEvent::Connected { .. })));
            stream.shutdown().await.unwrap();
            while driver.poll_client().await.is_ok() {}
            for qos in [1, 2] {
                let token = AckToken {
                    arrival: u64::from(qos),
                    connection: 1,
                    session: 0,
                    pkid: u16::from(qos),
                    qos,
                };
                mqtt.try_ack(&token).unwrap();
            }
            mqtt.try_ping().unwrap();
            let (next, mut stream) = tokio::join!(driver.poll_client(), accept(&listener, connack));
            assert!(matches!(next, Ok(MqttEvent::Connected { .. })), "{next:?}");
            let sent = driver.poll_client().await;
            assert!(
                matches!(sent, Ok(MqttEvent::PingSent)),
                "{protocol:?}: {sent:?}"
            );
            assert_eq!(
                read_packet(&mut stream).await[0],
                0xc0,
                "{protocol:?}: a PINGREQ first, no ack"
            );
            stream.write_all(&[0xd0, 0]).await.unwrap();
            let answered = driver.poll_client().await;
            assert!(
                matches!(answered, Ok(MqttEvent::PingAnswered)),
                "{protocol:?}: {answered:?}"
            );
        }
    }

    /// Publishes queued before a client's first connection keep its flow control
    /// (vendor/rumqttc/PATCHED.md, "No acks from an earlier connection"): the fleet forwarder,
    /// the tests and the benchmarks publish through this client. The patch's first form moved
    /// them to the queue of resends at the CONNACK, which skips flow control: the five past the
    /// limit each collided on a packet id and overwrote the one before (only the tenth went
    /// out), and each went out in a write of its own (the benchmark's publisher capped at
    /// ~1,650 messages/s).
    #[tokio::test]
    async fn publishes_queued_before_the_first_connection_keep_flow_control() {
        use tokio::io::AsyncWriteExt;
        use tokio::time::timeout;
        /// The next packet, a QoS 1 PUBLISH to "t" of one byte: its packet id and that byte.
        async fn next_publish(stream: &mut tokio::net::TcpStream) -> (u16, u8) {
            let packet = timeout(Duration::from_secs(5), read_packet(stream))
                .await
                .expect("a PUBLISH within 5 s");
            assert_eq!(packet[0], 0x32, "a QoS 1 PUBLISH: {packet:?}");
            (
                u16::from_be_bytes([packet[5], packet[6]]),
                *packet.last().unwrap(),
            )
        }
        for protocol in [Protocol::V311, Protocol::V5] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            // Ten publishes queued before the event loop first runs; five may be in flight.
            let (events, connack): (_, &[u8]) = match protocol {
                Protocol::V311 => {
                    let mut opts = rumqttc::MqttOptions::new("publisher", "127.0.0.1", port);
                    opts.set_inflight(5);
                    let (client, mut events) = rumqttc::AsyncClient::new(opts, 10);
                    for i in 1..=10u8 {
                        let qos = rumqttc::QoS::AtLeastOnce;
                        client.publish("t", qos, false, vec![i]).await.unwrap();
                    }
                    let task = tokio::spawn(async move {
                        let _client = client;
                        while events.poll().await.is_ok() {}
                    });
                    (task, &[0x20, 2, 0, 0])
                }
                Protocol::V5 => {
                    let mut opts = rumqttc::v5::MqttOptions::new("publisher", "127.0.0.1", port);
                    opts.set_outgoing_inflight_upper_limit(5);
                    let (client, mut events) = rumqttc::v5::AsyncClient::new(opts, 10);
                    for i in 1..=10u8 {
                        let qos = rumqttc::v5::mqttbytes::QoS::AtLeastOnce;
                        client.publish("t", qos, false, vec![i]).await.unwrap();
                    }
                    let task = tokio::spawn(async move {
                        let _client = client;
                        while events.poll().await.is_ok() {}
                    });
                    (task, &[0x20, 3, 0, 0, 0])
                }
            };
            let mut stream = accept(&listener, connack).await;
            let mut first = Vec::new();
            for _ in 0..5 {
                first.push(next_publish(&mut stream).await);
            }
            let payloads: Vec<u8> = first.iter().map(|&(_, byte)| byte).collect();
            assert_eq!(payloads, [1, 2, 3, 4, 5], "{protocol:?}");
            assert!(
                timeout(Duration::from_millis(200), read_packet(&mut stream))
                    .await
                    .is_err(),
                "{protocol:?}: nothing past the in-flight limit before an ack"
            );
            for (pkid, _) in first {
                let [hi, lo] = pkid.to_be_bytes();
                stream.write_all(&[0x40, 2, hi, lo]).await.unwrap();
            }
            let mut rest = Vec::new();
            for _ in 0..5 {
                rest.push(next_publish(&mut stream).await.1);
            }
            assert_eq!(rest, [6, 7, 8, 9, 10], "{protocol:?}: every one, in order");
            events.abort();
        }
    }

    /// The acks queued while the event loop was busy go out with one flush and come back as
    /// one event (vendor/rumqttc/PATCHED.md): one write and one TCP segment per window of
    /// acknowledgements instead of one each, and one hand-over to the ingest task.
    #[tokio::test]
    async fn queued_acks_go_out_together_and_come_back_as_one_event() {
        for protocol in [Protocol::V311, Protocol::V5] {
            let (listener, mqtt, mut driver) = client(protocol).await;
            let connack: &[u8] = match protocol {
                Protocol::V311 => &[0x20, 2, 0, 0],
                Protocol::V5 => &[0x20, 3, 0, 0, 0],
            };
            let (connected, mut stream) =
                tokio::join!(driver.poll_client(), accept(&listener, connack));
            assert!(
                matches!(connected, Ok(MqttEvent::Connected { .. })),
                "{connected:?}"
            );

            for pkid in 1..=5 {
                let token = AckToken {
                    arrival: u64::from(pkid),
                    connection: 1,
                    session: 0,
                    pkid,
                    qos: 1,
                };
                mqtt.try_ack(&token).unwrap();
            }
            let sent = driver.poll_client().await;
            assert!(
                matches!(sent, Ok(MqttEvent::AcksSent(5))),
                "{protocol:?}: {sent:?}"
            );
            for pkid in 1..=5u16 {
                let packet = read_packet(&mut stream).await;
                assert_eq!(packet[0], 0x40, "{protocol:?}: PUBACK");
                assert_eq!(packet[2..4], pkid.to_be_bytes(), "{protocol:?}: in order");
            }

            // A batch ends at a DISCONNECT: what was queued after it stays queued.
            let token = |pkid| AckToken {
                arrival: 0,
                connection: 1,
                session: 0,
                pkid,
                qos: 1,
            };
            mqtt.try_ack(&token(6)).unwrap();
            mqtt.try_disconnect().unwrap();
            mqtt.try_ack(&token(7)).unwrap();
            let sent = driver.poll_client().await;
            assert!(
                matches!(sent, Ok(MqttEvent::AcksSent(1))),
                "{protocol:?}: {sent:?}"
            );
            let sent = driver.poll_client().await;
            assert!(
                matches!(sent, Ok(MqttEvent::DisconnectSent)),
                "{protocol:?}: {sent:?}"
            );
            let queued = match &driver.client {
                Client::V4 { eventloop, .. } => eventloop.state.events.len(),
                Client::V5 { eventloop, .. } => eventloop.state.events.len(),
            };
            assert_eq!(
                queued, 0,
                "{protocol:?}: nothing written after the DISCONNECT"
            );
            assert_eq!(
                read_packet(&mut stream).await[0],
                0x40,
                "{protocol:?}: PUBACK 6"
            );
            assert_eq!(
                read_packet(&mut stream).await[0] & 0xf0,
                0xe0,
                "{protocol:?}: DISCONNECT"
            );
        }
    }

    #[test]
    fn take_acks_sent_stops_at_the_first_other_event() {
        let mut queued: VecDeque<char> = "aab a".chars().collect();
        assert_eq!(take_acks_sent(&mut queued, |c| *c == 'a'), 2);
        assert_eq!(queued.iter().collect::<String>(), "b a");
        assert_eq!(take_acks_sent(&mut queued, |c| *c == 'a'), 0);
    }

    #[test]
    fn request_channel_holds_two_full_windows_of_acks() {
        assert!(crate::limits::ack_request_capacity(u16::MAX) >= 2 * 65_535);
        assert!(crate::limits::ack_request_capacity(1) >= 2);
    }
}
