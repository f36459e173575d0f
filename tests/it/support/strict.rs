//! A scripted MQTT broker that enforces its in-flight window exactly as strict brokers do
//! (upstream Mosquitto >= 2.0.13 for MQTT 3.1.1, EMQX, AWS IoT): at most `window` QoS 1 messages
//! unacknowledged, one more sent per PUBACK, the unacknowledged ones resent with DUP when the
//! session reconnects. QoS 0 messages are not held by the window: they trickle out one per
//! [`QOS0_GAP`] while QoS 1 messages wait, through the stalls, as a device's QoS 0 telemetry
//! would, and the rest at once after the last QoS 1 message is sent. It serves one subscriber
//! session; the test hands it the messages directly. MQTT 3.1.1 and 5 (rumqttc's packet codecs),
//! with an optional round trip added (half each way). Packet ids are numbered 1, 2, ... as
//! Mosquitto does, or ([`StrictBroker::reuse_ids`]) the lowest free id is taken, as a broker may.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;

use super::Broker;

/// The pace of QoS 0 messages.
pub const QOS0_GAP: Duration = Duration::from_millis(10);

/// What the broker saw, for the test's assertions.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// PUBACKs received for messages in flight.
    pub acked: usize,
    /// The most QoS 1 messages ever unacknowledged: never more than the window.
    pub max_in_flight: usize,
    /// Connections accepted (CONNECT answered).
    pub connections: usize,
    /// Messages sent again with DUP after a reconnect.
    pub resent: usize,
    /// The packet id of each message's first delivery, in order.
    pub ids: Vec<u16>,
    /// `acked` when the last PINGREQ was answered: the acks its PINGRESP confirms.
    pub acked_at_ping: usize,
}

#[derive(Default)]
struct Shared {
    /// The QoS 1 messages the test published: topic, payload.
    queue: Vec<(String, Bytes)>,
    /// The QoS 0 messages not sent yet.
    qos0: VecDeque<(String, Bytes)>,
    /// The next message of `queue` not sent yet.
    next: usize,
    /// QoS 1 messages sent and not acknowledged, in order: packet id and index in `queue`.
    in_flight: VecDeque<(u16, usize)>,
    last_pkid: u16,
    /// Give each message the lowest packet id not in flight instead of the next one.
    lowest_free: bool,
    /// Close the connection (after writing everything sent so far) once the message at this
    /// index of `queue` is sent.
    close_after: Option<usize>,
    /// The message at this index of `queue` is lost on the wire: in flight, never written; the
    /// connection closes instead.
    lose: Option<usize>,
    /// Whether the subscriber's session exists (it subscribed).
    subscribed: bool,
    seen: Seen,
}

pub struct StrictBroker {
    pub port: u16,
    shared: Arc<Mutex<Shared>>,
    wake: Arc<Notify>,
    cut: watch::Sender<u64>,
}

impl StrictBroker {
    pub async fn start(window: usize, round_trip: Duration) -> StrictBroker {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Mutex::new(Shared::default()));
        let wake = Arc::new(Notify::new());
        let (cut, cut_rx) = watch::channel(0u64);
        let (s, w) = (shared.clone(), wake.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                stream.set_nodelay(true).unwrap();
                let session = Session {
                    window,
                    half: round_trip / 2,
                    shared: s.clone(),
                    wake: w.clone(),
                    cut: cut_rx.clone(),
                };
                tokio::spawn(session.serve(stream));
            }
        });
        StrictBroker {
            port,
            shared,
            wake,
            cut,
        }
    }

    /// This broker as the tests' [`Broker`], for bucketd's configuration.
    pub fn target(&self) -> Broker {
        Broker {
            name: "strict",
            host: "127.0.0.1".into(),
            v311_port: self.port,
            v5_port: self.port,
            sets_dup: true,
        }
    }

    /// Queues messages for the subscriber.
    pub fn publish(&self, messages: &[(String, Vec<u8>)], qos: impl Fn(usize) -> u8) {
        let mut s = self.shared.lock().unwrap();
        for (i, (topic, payload)) in messages.iter().enumerate() {
            let m = (topic.clone(), Bytes::from(payload.clone()));
            if qos(i) == 0 {
                s.qos0.push_back(m);
            } else {
                s.queue.push(m);
            }
        }
        drop(s);
        self.wake.notify_waiters();
    }

    /// From now on each message takes the lowest packet id not in flight, so an id comes back
    /// as soon as its message is acknowledged (MQTT allows it; Mosquitto counts on instead).
    pub fn reuse_ids(&self) {
        self.shared.lock().unwrap().lowest_free = true;
    }

    /// Closes the subscriber's connection right after the next QoS 1 message to be published
    /// is sent: it reaches the subscriber, then the end of the stream, before any ack can
    /// come back (the session stays).
    pub fn close_after_next(&self) {
        let mut s = self.shared.lock().unwrap();
        s.close_after = Some(s.queue.len());
    }

    /// The next QoS 1 message to be published is lost on the wire with the connection: the
    /// broker counts it in flight (it resends it on the next connection) but the subscriber
    /// never gets it; the connection closes after what was sent before it.
    pub fn lose_next(&self) {
        let mut s = self.shared.lock().unwrap();
        s.lose = Some(s.queue.len());
    }

    /// Closes the subscriber's connection (the session stays).
    pub fn cut(&self) {
        self.cut.send_modify(|n| *n += 1);
    }

    pub fn seen(&self) -> Seen {
        self.shared.lock().unwrap().seen.clone()
    }

    /// Whether every message was sent, and every QoS 1 one acknowledged.
    pub fn drained(&self) -> bool {
        let s = self.shared.lock().unwrap();
        s.next == s.queue.len() && s.in_flight.is_empty() && s.qos0.is_empty()
    }
}

/// The packets the broker acts on, from either protocol.
enum In {
    Connect { v5: bool, clean: bool },
    Subscribe { pkid: u16, filters: usize },
    PubAck { pkid: u16 },
    PingReq,
    Disconnect,
    Other,
}

struct Session {
    window: usize,
    half: Duration,
    shared: Arc<Mutex<Shared>>,
    wake: Arc<Notify>,
    cut: watch::Receiver<u64>,
}

impl Session {
    async fn serve(self, stream: TcpStream) {
        let (mut rd, mut wr) = stream.into_split();
        let mut cut = self.cut.clone();
        cut.borrow_and_update();
        // Both directions go through delay lines of half the round trip.
        let (in_tx, mut in_rx) = mpsc::unbounded_channel::<(Instant, BytesMut)>();
        let (out_tx, mut out_rx) = mpsc::unbounded_channel::<(Instant, BytesMut)>();
        let reader = tokio::spawn(async move {
            let mut buf = BytesMut::with_capacity(4096);
            loop {
                while let Some(len) = frame_len(&buf) {
                    let packet = buf.split_to(len);
                    if in_tx.send((Instant::now(), packet)).is_err() {
                        return;
                    }
                }
                if rd.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                    return;
                }
            }
        });
        let half = self.half;
        let writer = tokio::spawn(async move {
            while let Some((at, bytes)) = out_rx.recv().await {
                tokio::time::sleep_until(at + half).await;
                if wr.write_all(&bytes).await.is_err() {
                    return;
                }
            }
        });
        let mut v5 = false;
        let mut connected = false;
        let mut qos0_tick = tokio::time::interval(QOS0_GAP);
        loop {
            // Registered before delivering: a publish after this wakes the loop.
            let wake = self.wake.notified();
            if connected && self.deliver(&out_tx, v5) {
                // What was sent goes out first, then the end of the stream.
                drop(out_tx);
                let _ = writer.await;
                reader.abort();
                return;
            }
            tokio::select! {
                packet = in_rx.recv() => {
                    let Some((at, bytes)) = packet else { break };
                    tokio::time::sleep_until(at + half).await;
                    match parse(&bytes, v5) {
                        In::Connect { v5: is_v5, clean } => {
                            v5 = is_v5;
                            connected = true;
                            let present = {
                                let mut s = self.shared.lock().unwrap();
                                s.seen.connections += 1;
                                // bucketd keeps its session; a clean one only drops the
                                // subscription here.
                                s.subscribed &= !clean;
                                s.subscribed
                            };
                            let _ = out_tx.send((Instant::now(), connack(v5, present)));
                            if present {
                                self.resend(&out_tx, v5);
                            }
                        }
                        In::Subscribe { pkid, filters } => {
                            self.shared.lock().unwrap().subscribed = true;
                            let _ = out_tx.send((Instant::now(), suback(v5, pkid, filters)));
                        }
                        In::PubAck { pkid } => {
                            let mut s = self.shared.lock().unwrap();
                            if let Some(i) = s.in_flight.iter().position(|m| m.0 == pkid) {
                                s.in_flight.remove(i);
                                s.seen.acked += 1;
                            }
                        }
                        In::PingReq => {
                            let mut s = self.shared.lock().unwrap();
                            s.seen.acked_at_ping = s.seen.acked;
                            let _ = out_tx.send((Instant::now(), pingresp(v5)));
                        }
                        In::Disconnect => break,
                        In::Other => {}
                    }
                }
                () = wake => {}
                _ = qos0_tick.tick(), if connected => {
                    let mut s = self.shared.lock().unwrap();
                    // One per tick while QoS 1 messages wait; the rest at once after them.
                    let n = if s.next < s.queue.len() { 1 } else { s.qos0.len() };
                    for _ in 0..n {
                        let Some((topic, payload)) = s.qos0.pop_front().filter(|_| s.subscribed) else {
                            break;
                        };
                        let _ = out_tx.send((Instant::now(), publish(v5, &topic, payload, 0, 0, false)));
                    }
                }
                _ = cut.changed() => break,
            }
        }
        reader.abort();
        writer.abort();
    }

    /// After a reconnect: every unacknowledged message again, in order, with DUP.
    fn resend(&self, out: &mpsc::UnboundedSender<(Instant, BytesMut)>, v5: bool) {
        let mut s = self.shared.lock().unwrap();
        let again: Vec<(u16, usize)> = s.in_flight.iter().copied().collect();
        for (pkid, i) in again {
            let (topic, payload) = s.queue[i].clone();
            let _ = out.send((Instant::now(), publish(v5, &topic, payload, 1, pkid, true)));
            s.seen.resent += 1;
        }
    }

    /// Sends what the window allows. Returns whether the connection is to close now
    /// ([`StrictBroker::close_after_next`], [`StrictBroker::lose_next`]).
    fn deliver(&self, out: &mpsc::UnboundedSender<(Instant, BytesMut)>, v5: bool) -> bool {
        let mut s = self.shared.lock().unwrap();
        if !s.subscribed {
            return false;
        }
        while s.next < s.queue.len() && s.in_flight.len() < self.window {
            let (topic, payload) = s.queue[s.next].clone();
            let pkid = if s.lowest_free {
                (1..=u16::MAX)
                    .find(|id| s.in_flight.iter().all(|m| m.0 != *id))
                    .expect("fewer than 65,535 in flight")
            } else {
                s.last_pkid % u16::MAX + 1
            };
            s.last_pkid = pkid;
            s.seen.ids.push(pkid);
            let i = s.next;
            s.in_flight.push_back((pkid, i));
            s.seen.max_in_flight = s.seen.max_in_flight.max(s.in_flight.len());
            s.next += 1;
            if s.lose == Some(i) {
                s.lose = None;
                return true;
            }
            let _ = out.send((Instant::now(), publish(v5, &topic, payload, 1, pkid, false)));
            if s.close_after == Some(i) {
                s.close_after = None;
                return true;
            }
        }
        false
    }
}

/// The fixed header's length and the remaining length of the packet starting `buf`.
fn header(buf: &[u8]) -> Option<(usize, usize)> {
    let mut len = 0usize;
    for (i, b) in buf.iter().skip(1).take(4).enumerate() {
        len |= usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((i + 2, len));
        }
    }
    None
}

/// The length of the first whole packet in `buf`, if it is all there.
fn frame_len(buf: &[u8]) -> Option<usize> {
    let (header, len) = header(buf)?;
    (buf.len() >= header + len).then_some(header + len)
}

fn parse(bytes: &BytesMut, v5: bool) -> In {
    let mut b = bytes.clone();
    match bytes[0] >> 4 {
        12 => return In::PingReq,
        14 => return In::Disconnect,
        _ => {}
    }
    if bytes[0] >> 4 == 1 {
        // CONNECT: the protocol level follows the header and the name "MQTT".
        let (header, _) = header(bytes).expect("a whole packet");
        return if bytes[header + 6] == 5 {
            match rumqttc::v5::mqttbytes::v5::Packet::read(&mut b, None) {
                Ok(rumqttc::v5::mqttbytes::v5::Packet::Connect(c, _, _)) => In::Connect {
                    v5: true,
                    clean: c.clean_start,
                },
                other => panic!("bad v5 CONNECT: {other:?}"),
            }
        } else {
            match rumqttc::mqttbytes::v4::Packet::read(&mut b, 1 << 20) {
                Ok(rumqttc::mqttbytes::v4::Packet::Connect(c)) => In::Connect {
                    v5: false,
                    clean: c.clean_session,
                },
                other => panic!("bad v4 CONNECT: {other:?}"),
            }
        };
    }
    if v5 {
        use rumqttc::v5::mqttbytes::v5::Packet;
        match Packet::read(&mut b, None).expect("a v5 packet") {
            Packet::Subscribe(s) => In::Subscribe {
                pkid: s.pkid,
                filters: s.filters.len(),
            },
            Packet::PubAck(a) => In::PubAck { pkid: a.pkid },
            Packet::PingReq(_) => In::PingReq,
            Packet::Disconnect(_) => In::Disconnect,
            _ => In::Other,
        }
    } else {
        use rumqttc::mqttbytes::v4::Packet;
        match Packet::read(&mut b, 1 << 20).expect("a v4 packet") {
            Packet::Subscribe(s) => In::Subscribe {
                pkid: s.pkid,
                filters: s.filters.len(),
            },
            Packet::PubAck(a) => In::PubAck { pkid: a.pkid },
            Packet::PingReq => In::PingReq,
            Packet::Disconnect => In::Disconnect,
            _ => In::Other,
        }
    }
}

fn connack(v5: bool, session_present: bool) -> BytesMut {
    let mut out = BytesMut::new();
    if v5 {
        use rumqttc::v5::mqttbytes::v5::{ConnAck, ConnectReturnCode, Packet};
        Packet::ConnAck(ConnAck {
            session_present,
            code: ConnectReturnCode::Success,
            properties: None,
        })
        .write(&mut out, None)
        .unwrap();
    } else {
        use rumqttc::mqttbytes::v4::{ConnAck, ConnectReturnCode, Packet};
        Packet::ConnAck(ConnAck::new(ConnectReturnCode::Success, session_present))
            .write(&mut out, 1 << 20)
            .unwrap();
    }
    out
}

fn suback(v5: bool, pkid: u16, filters: usize) -> BytesMut {
    let mut out = BytesMut::new();
    if v5 {
        use rumqttc::v5::mqttbytes::QoS;
        use rumqttc::v5::mqttbytes::v5::{Packet, SubAck, SubscribeReasonCode};
        Packet::SubAck(SubAck {
            pkid,
            return_codes: vec![SubscribeReasonCode::Success(QoS::AtLeastOnce); filters],
            properties: None,
        })
        .write(&mut out, None)
        .unwrap();
    } else {
        use rumqttc::mqttbytes::QoS;
        use rumqttc::mqttbytes::v4::{Packet, SubAck, SubscribeReasonCode};
        Packet::SubAck(SubAck::new(
            pkid,
            vec![SubscribeReasonCode::Success(QoS::AtLeastOnce); filters],
        ))
        .write(&mut out, 1 << 20)
        .unwrap();
    }
    out
}

fn pingresp(v5: bool) -> BytesMut {
    let mut out = BytesMut::new();
    if v5 {
        use rumqttc::v5::mqttbytes::v5::{Packet, PingResp};
        Packet::PingResp(PingResp).write(&mut out, None).unwrap();
    } else {
        rumqttc::mqttbytes::v4::Packet::PingResp
            .write(&mut out, 1 << 20)
            .unwrap();
    }
    out
}

fn publish(v5: bool, topic: &str, payload: Bytes, qos: u8, pkid: u16, dup: bool) -> BytesMut {
    let mut out = BytesMut::new();
    if v5 {
        use rumqttc::v5::mqttbytes::v5::{Packet, Publish};
        Packet::Publish(Publish {
            dup,
            qos: rumqttc::v5::mqttbytes::qos(qos).expect("QoS 0 or 1"),
            retain: false,
            topic: Bytes::copy_from_slice(topic.as_bytes()),
            pkid,
            payload,
            properties: None,
        })
        .write(&mut out, None)
        .unwrap();
    } else {
        use rumqttc::mqttbytes::v4::{Packet, Publish};
        Packet::Publish(Publish {
            dup,
            qos: rumqttc::mqttbytes::qos(qos).expect("QoS 0 or 1"),
            retain: false,
            topic: topic.to_owned(),
            pkid,
            payload,
        })
        .write(&mut out, 1 << 20)
        .unwrap();
    }
    out
}
