//! An in-process rumqttd on two free ports (MQTT 3.1.1 and 5), for the tests and the
//! benchmarks; with `window`, it sends a client at most that many QoS 1 messages unacknowledged
//! (vendor/rumqttd/PATCHED.md; upstream: 100). It has no shutdown API: it lives as long as the
//! process.

use std::collections::HashMap;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use rumqttd::{ConnectionSettings, RouterConfig, ServerSettings};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding an ephemeral port")
        .port()
}

/// Starts the broker and returns its MQTT 3.1.1 and MQTT 5 ports once both accept connections.
pub fn start(window: Option<usize>) -> (u16, u16) {
    let v4 = free_port();
    let v5 = free_port();
    let server = |name: &str, port: u16| ServerSettings {
        name: name.to_owned(),
        listen: format!("127.0.0.1:{port}").parse().unwrap(),
        tls: None,
        next_connection_delay_ms: 1,
        connections: ConnectionSettings {
            connection_timeout_ms: 60_000,
            max_payload_size: 1 << 20,
            max_inflight_count: 500,
            auth: None,
            external_auth: None,
            dynamic_filters: true,
            max_outgoing_inflight: window,
        },
    };
    let config = rumqttd::Config {
        id: 0,
        router: RouterConfig {
            max_connections: 10_000,
            max_outgoing_packet_count: 200,
            max_segment_size: 100 << 20,
            max_segment_count: 10,
            ..Default::default()
        },
        v4: Some(HashMap::from([("1".to_owned(), server("v4", v4))])),
        v5: Some(HashMap::from([("1".to_owned(), server("v5", v5))])),
        ..Default::default()
    };
    std::thread::spawn(move || {
        rumqttd::Broker::new(config)
            .start()
            .expect("rumqttd starts");
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    for port in [v4, v5] {
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "rumqttd did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    (v4, v5)
}
