//! The integration tests: one binary (`cargo test --test it`), one module per theme. End-to-end
//! tests run against the in-process rumqttd and, when `BUCKETD_TEST_MQTT=host:port` is set,
//! against that broker too (CI points it at Mosquitto).

// Test scenarios read top to bottom; the 100-line limit (clippy.toml) holds the library.
#![allow(clippy::too_many_lines)]

/// A Mosquitto of the test's own (shared with the benchmarks).
#[path = "../shared/own_mosquitto.rs"]
mod own_mosquitto;
/// The in-process rumqttd (shared with the benchmarks).
#[path = "../shared/own_rumqttd.rs"]
mod own_rumqttd;
/// Reading `/metrics` text (shared with the benchmarks).
#[path = "../shared/prom.rs"]
mod prom;
mod support;

/// The HTTP API, `bucketd query` and `/metrics`.
mod api;
/// The chart page at `/` in headless Chromium.
#[cfg(feature = "ui")]
mod chart;
/// The `bucketd` binary: SIGTERM shutdown, export, exit codes.
mod cli;
/// `kill -9` under load: nothing lost, nothing counted twice.
mod crash;
/// A full disk and a broker that restarts.
mod faults;
/// The fleet tier: forwarding to PostgreSQL and to a central over MQTT; the query node.
mod fleet;
/// Payload formats as real devices send them, from the producer libraries people use.
mod formats;
/// End to end through a real broker and a real redb file: ground truth, restart, bad input.
mod ingest;
/// The import rules: no cycle among `src/`'s modules; the edge does not import the fleet.
mod layers;
/// The Prometheus API (`/prom`) through promtool and Grafana's requests.
#[cfg(feature = "ui")]
mod prom_api;
/// Prometheus's compliance query set, bucketd against Prometheus on the same readings.
#[cfg(feature = "ui")]
mod prom_compliance;
/// The same readings and requests to bucketd and to a real Prometheus, answers compared.
#[cfg(feature = "ui")]
mod prom_diff;
/// Every bug fixed so far and the test that guards it.
mod regression;
/// TLS, passwords, client certificates, credentials and HTTP tokens, against Mosquitto.
#[cfg(feature = "tls")]
mod security;
/// Strict broker windows: one commit per window, against a scripted broker that enforces one.
mod windows;

/// Runs an async scenario `fn(Broker, Protocol)` against every broker, as one test per broker
/// and protocol. Against the external broker, the test passes without running when
/// `BUCKETD_TEST_MQTT` is unset and says so on stderr.
#[macro_export]
macro_rules! on_every_broker {
    ($scenario:ident) => {
        mod $scenario {
            use bucketd::config::Protocol;

            use $crate::support::Broker;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rumqttd_v5() {
                super::$scenario(Broker::hermetic(), Protocol::V5).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rumqttd_v311() {
                super::$scenario(Broker::hermetic(), Protocol::V311).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn external_v5() {
                let Some(broker) = Broker::external() else {
                    eprintln!("not run: BUCKETD_TEST_MQTT is not set");
                    return;
                };
                super::$scenario(broker, Protocol::V5).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn external_v311() {
                let Some(broker) = Broker::external() else {
                    eprintln!("not run: BUCKETD_TEST_MQTT is not set");
                    return;
                };
                super::$scenario(broker, Protocol::V311).await;
            }
        }
    };
}
