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

/// A client of `protocol` whose ACKs may wait (`Mqtt::set_ack_coalescing`), connected to a
/// broker the test plays with Nagle's algorithm on (Mosquitto's default), the broker's end as a
/// blocking socket for a thread of its own, and a QoS 0 PUBLISH to "t" with a 16-byte payload of
/// 7s (no subscription needed).
#[cfg(target_os = "linux")]
async fn nagle_broker(protocol: Protocol) -> (Driver, std::net::TcpStream, Vec<u8>) {
    let (listener, mqtt, mut driver) = client(protocol).await;
    mqtt.set_ack_coalescing(true);
    let connack: &[u8] = match protocol {
        Protocol::V311 => &[0x20, 2, 0, 0],
        Protocol::V5 => &[0x20, 3, 0, 0, 0],
    };
    let (connected, stream) = tokio::join!(driver.poll_client(), accept(&listener, connack));
    assert!(
        matches!(connected, Ok(MqttEvent::Connected { .. })),
        "{connected:?}"
    );
    drop(mqtt);
    let broker = stream.into_std().unwrap();
    broker.set_nonblocking(false).unwrap();
    broker.set_nodelay(false).unwrap();
    // MQTT 5 adds an empty property length.
    let publish = match protocol {
        Protocol::V311 => [&[0x30, 19, 0, 1, b't'][..], &[7u8; 16]].concat(),
        Protocol::V5 => [&[0x30, 20, 0, 1, b't', 0][..], &[7u8; 16]].concat(),
    };
    (driver, broker, publish)
}

/// Polls `driver` until its next PUBLISH, which must be the test's.
#[cfg(target_os = "linux")]
async fn next_publish(driver: &mut Driver) {
    loop {
        match driver.poll_client().await {
            Ok(MqttEvent::Publish(p)) => {
                assert_eq!(&p.payload[..], &[7u8; 16], "unchanged");
                return;
            }
            Ok(_) => {}
            Err(e) => panic!("{e:?}"),
        }
    }
}

/// An ACK that a read leaves owed (the read came within `ACK_COALESCE` of the last ACK,
/// vendor/rumqttc/src/quickack.rs) goes out on its timer, within a millisecond or two: a Nagle
/// broker's next write, held until then, is never left to the kernel's delayed ACK (40 ms).
/// Each round: message A (its read is answered at once: the last ACK was long ago), B once A was
/// read (its read comes right after that ACK: owed), C once B was read (held by Nagle until B is
/// acknowledged). Measured: C's write to its read. Without the timer it is ~40 ms.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_a_read_leaves_owed_goes_out_within_a_millisecond_or_two() {
    use std::io::Write;
    use std::time::Instant;
    const ROUNDS: usize = 7;
    for protocol in [Protocol::V311, Protocol::V5] {
        let (mut driver, mut broker, publish) = nagle_broker(protocol).await;
        let (read, reads) = std::sync::mpsc::channel::<()>();
        let writer = std::thread::spawn(move || {
            let mut late = Vec::new();
            for _ in 0..ROUNDS {
                // Long after the last ACK: A's read is answered at once.
                std::thread::sleep(Duration::from_millis(5));
                broker.write_all(&publish).unwrap();
                reads.recv().unwrap();
                broker.write_all(&publish).unwrap();
                reads.recv().unwrap();
                let written = Instant::now();
                broker.write_all(&publish).unwrap();
                reads.recv().unwrap();
                late.push(written.elapsed());
            }
            late
        });
        for _ in 0..ROUNDS * 3 {
            next_publish(&mut driver).await;
            read.send(()).unwrap();
        }
        let mut late = writer.join().unwrap();
        late.sort_unstable();
        // The median round: a busy machine may delay a round or two.
        assert!(
            late[ROUNDS / 2] < Duration::from_millis(15),
            "{protocol:?}: C came late by {late:?}"
        );
    }
}

/// The data segments a socket has sent (Linux's `TCP_INFO`), or `None` where the call does not
/// give the whole structure (qemu's user mode passes only an `int` for `SOL_TCP` options).
#[cfg(target_os = "linux")]
fn data_segments_sent(socket: &std::net::TcpStream) -> Option<u32> {
    use std::os::fd::AsRawFd;
    // SAFETY: `info` is a plain C structure for the kernel to fill; `len` says its size.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::tcp_info>()).ok()?;
        let done = libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &raw mut len,
        );
        let whole = usize::try_from(len).ok()? == std::mem::size_of::<libc::tcp_info>();
        (done == 0 && whole).then_some(info.tcpi_data_segs_out)
    }
}

/// A Nagle broker that writes each message on its own, far more often than once a millisecond,
/// reaches us gathered into about a segment per millisecond or two (our ACKs wait up to
/// `ACK_COALESCE`, vendor/rumqttc/src/quickack.rs), not a segment per write or two as with an
/// ACK per read. (Every message comes: the test waits for all 400.)
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nagle_brokers_writes_come_gathered_into_few_segments() {
    use std::io::Write;
    use std::time::Instant;
    const MESSAGES: usize = 400;
    for protocol in [Protocol::V311, Protocol::V5] {
        let (mut driver, mut broker, publish) = nagle_broker(protocol).await;
        let writer = std::thread::spawn(move || {
            let start = Instant::now();
            for _ in 0..MESSAGES {
                broker.write_all(&publish).unwrap();
                // A message every ~25 us, spun rather than slept (a sleep is a millisecond).
                let next = Instant::now() + Duration::from_micros(25);
                while Instant::now() < next {
                    std::hint::spin_loop();
                }
            }
            (broker, start.elapsed())
        });
        for _ in 0..MESSAGES {
            next_publish(&mut driver).await;
        }
        let (broker, writing) = writer.join().unwrap();
        if let Some(segments) = data_segments_sent(&broker) {
            // The CONNACK's segment, then one per ACK: one for every millisecond or two of
            // writing (the timer that sends an owed ACK has a resolution of a millisecond).
            let bound = 5 + 2 * u32::try_from(writing.as_millis()).unwrap();
            assert!(
                segments <= bound && segments < u32::try_from(MESSAGES / 4).unwrap(),
                "{protocol:?}: {segments} segments for {MESSAGES} writes in {writing:?}"
            );
        }
    }
}
