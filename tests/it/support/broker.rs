//! Brokers the tests reach: the in-process rumqttd (started once per test binary) and the
//! external broker named by `BUCKETD_TEST_MQTT`; and a TCP proxy that can cut the connection.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use bucketd::config::Protocol;

use crate::own_mosquitto::OwnMosquitto;
use crate::own_rumqttd;

/// A broker the tests can reach.
#[derive(Debug, Clone)]
pub struct Broker {
    pub name: &'static str,
    pub host: String,
    /// Port for MQTT 3.1.1 clients.
    pub v311_port: u16,
    /// Port for MQTT 5 clients (the same as `v311_port` on brokers that speak both on one port).
    pub v5_port: u16,
    /// Whether the broker sets DUP on redeliveries, as MQTT requires (rumqttd 0.20 does not).
    pub sets_dup: bool,
}

impl Broker {
    /// The in-process rumqttd, started once per test binary (it has no shutdown API). It sends
    /// a client at most 100 QoS 1 messages unacknowledged, as upstream rumqttd does.
    pub fn hermetic() -> Broker {
        static BROKER: OnceLock<Broker> = OnceLock::new();
        BROKER.get_or_init(|| start_rumqttd(None)).clone()
    }

    /// An in-process rumqttd that sends a client at most `window` QoS 1 messages
    /// unacknowledged (vendor/rumqttd/PATCHED.md), started once per window and test binary.
    pub fn strict_rumqttd(window: usize) -> Broker {
        static BROKERS: Mutex<BTreeMap<usize, Broker>> = Mutex::new(BTreeMap::new());
        let mut brokers = BROKERS.lock().unwrap();
        brokers
            .entry(window)
            .or_insert_with(|| start_rumqttd(Some(window)))
            .clone()
    }

    /// A Mosquitto of the test's own ([`OwnMosquitto`]).
    pub fn own(m: &OwnMosquitto) -> Broker {
        Broker {
            name: "own-mosquitto",
            host: "127.0.0.1".into(),
            v311_port: m.port,
            v5_port: m.port,
            sets_dup: true,
        }
    }

    /// Upstream Mosquitto 2.0.21 of the test's own (`.ci/mosquitto-upstream`), with its default
    /// window for MQTT 3.1.1 clients (`max_inflight_messages 20`) and Nagle's algorithm on, as
    /// gateways meet it. The tests that call this are compiled as ignored where build.rs found
    /// no such build (`cfg(upstream_mosquitto)`); `None` (skipped with a note) outside CI if it
    /// went missing since.
    pub fn upstream_mosquitto() -> Option<(OwnMosquitto, Broker)> {
        match OwnMosquitto::upstream(false, "max_inflight_messages 20\n") {
            Ok(m) => {
                let broker = Broker {
                    name: "upstream-mosquitto",
                    ..Broker::own(&m)
                };
                Some((m, broker))
            }
            Err(e) if std::env::var_os("CI").is_none() => {
                eprintln!("skipped: {e}");
                None
            }
            Err(e) => panic!("upstream Mosquitto is required in CI: {e}"),
        }
    }

    /// The broker named by `BUCKETD_TEST_MQTT=host:port`, if set.
    pub fn external() -> Option<Broker> {
        let addr = std::env::var("BUCKETD_TEST_MQTT").ok()?;
        let (host, port) = addr
            .rsplit_once(':')
            .expect("BUCKETD_TEST_MQTT is host:port");
        let port: u16 = port.parse().expect("BUCKETD_TEST_MQTT port is a number");
        Some(Broker {
            name: "external",
            host: host.to_owned(),
            v311_port: port,
            v5_port: port,
            sets_dup: true,
        })
    }

    pub fn port(&self, protocol: Protocol) -> u16 {
        match protocol {
            Protocol::V5 => self.v5_port,
            Protocol::V311 => self.v311_port,
        }
    }
}

fn start_rumqttd(window: Option<usize>) -> Broker {
    // The log is the default broker's (one tracing subscriber per process).
    if let Some(path) = std::env::var_os("BUCKETD_TEST_BROKER_LOG").filter(|_| window.is_none()) {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        let file = std::fs::File::create(&path).expect("creating the broker log");
        let filter: tracing_subscriber::filter::Targets = "rumqttd=debug".parse().unwrap();
        let _ = tracing_subscriber::fmt()
            .with_writer(std::sync::Mutex::new(file))
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .finish()
            .with(filter)
            .try_init();
    }
    let (v4, v5) = own_rumqttd::start(window);
    Broker {
        name: "rumqttd",
        host: "127.0.0.1".into(),
        v311_port: v4,
        v5_port: v5,
        sets_dup: false,
    }
}

/// A TCP proxy in front of a broker that a test can cut: while down, it closes every
/// connection and refuses new ones (accepts and closes them at once). A broker "outage" as
/// the daemon sees it, while the broker itself keeps the daemon's session.
pub struct Proxy {
    pub port: u16,
    up: tokio::sync::watch::Sender<bool>,
}

impl Proxy {
    pub async fn start(upstream_host: &str, upstream_port: u16) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (up, up_rx) = tokio::sync::watch::channel(true);
        let upstream = format!("{upstream_host}:{upstream_port}");
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                if !*up_rx.borrow() {
                    drop(client);
                    continue;
                }
                let mut down = up_rx.clone();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = down.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        Proxy { port, up }
    }

    pub fn set_up(&self, up: bool) {
        self.up.send_replace(up);
    }
}
