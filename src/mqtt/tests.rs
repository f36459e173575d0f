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
