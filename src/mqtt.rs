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
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Whether the TCP ACKs of what the client reads never wait for the kernel's delayed ACK
/// (`TCP_QUICKACK`, which the vendored rumqttc sets after reads; Linux and Android only): the
/// flush policy then believes a broker's stall sooner (`crate::batcher`). They wait up to a
/// millisecond for each other only while [`Mqtt::set_ack_coalescing`] says so.
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
    /// Whether the TCP ACKs of what the client reads may wait a little for the next one (the
    /// vendored rumqttc's ACK coalescing, read at every read): [`Mqtt::set_ack_coalescing`].
    coalescing: Arc<AtomicBool>,
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
        let coalescing = Arc::new(AtomicBool::new(false));
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
                network.set_tcp_ack_coalescing(coalescing.clone());
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
                network.set_tcp_ack_coalescing(coalescing.clone());
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
            coalescing,
        }
    }

    /// Lets the TCP ACKs of what the client reads wait up to a millisecond for the next (`on`),
    /// or sends each at once: the ingest core's [`crate::ingest::core::Core::acks_may_wait`].
    pub fn set_ack_coalescing(&self, on: bool) {
        self.coalescing.store(on, Ordering::Relaxed);
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
mod tests;
