//! The configuration as written: the serde types every layer (defaults, file, environment)
//! deserializes into, unknown keys refused. Nothing here is validated yet (`validate`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

use super::{ConfigError, DEFAULT_TOML, ENV_PREFIX};
use crate::decode::{Format, TimestampUnit};

/// The configuration as written, before validation. Field names are the config keys.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub mqtt: RawMqtt,
    pub store: RawStore,
    pub batch: RawBatch,
    pub limits: RawLimits,
    pub http: RawHttp,
    pub upstream: RawUpstream,
    pub central: RawCentral,
    pub query_node: RawQueryNode,
    pub log: RawLog,
    pub subscriptions: Vec<RawSubscription>,
}

/// `[query_node]`: `bucketd query-node` serving the fleet's PostgreSQL (docs/FLEET.md).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawQueryNode {
    pub postgres: String,
    pub password_file: String,
    #[serde(with = "humantime_serde")]
    pub series_refresh: Duration,
    pub max_series: usize,
    pub max_rows_per_query: usize,
    #[serde(with = "humantime_serde")]
    pub statement_timeout: Duration,
}

/// `[central]`: what a central (`format = "delta"` subscriptions) allows each gateway.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawCentral {
    /// Retired with the shared-subscription centrals: refused when set, with what to do.
    #[serde(default, skip_serializing)]
    pub claims_postgres: Option<toml::Value>,
    #[serde(default, skip_serializing)]
    pub claims_password_file: Option<toml::Value>,
    #[serde(default, skip_serializing)]
    pub claims_keep_entries: Option<toml::Value>,
    pub max_series_per_gateway: usize,
    pub max_buckets_per_message: usize,
    pub max_position_jump: u64,
}

/// `[upstream]`: forwarding bucket deltas to the fleet tier.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub target: String,
    pub gateway_id: String,
    pub postgres: String,
    pub mqtt_host: String,
    pub mqtt_port: u16,
    pub mqtt_username: String,
    pub mqtt_client_id: String,
    pub password_file: String,
    pub outbox_max_entries: usize,
    pub batch_entries: usize,
    #[serde(with = "humantime_serde")]
    pub retry_delay_max: Duration,
    #[serde(with = "humantime_serde")]
    pub postgres_retention: Duration,
    /// `[upstream.mqtt_tls]`: TLS to the upstream broker, as `[mqtt.tls]`.
    pub mqtt_tls: RawTls,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawHttp {
    pub bind: String,
    pub token_file: String,
    pub metrics_token_file: String,
    pub max_buckets_per_query: usize,
    pub max_points_per_query: u64,
    pub max_raw_readings: usize,
    pub max_connections: usize,
    pub max_concurrent_queries: usize,
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    pub max_connections_per_address: usize,
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    pub allowed_hosts: Vec<String>,
    #[serde(with = "humantime_serde")]
    pub lookback: Duration,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawMqtt {
    pub host: String,
    pub port: u16,
    pub client_id: String,
    pub protocol: Protocol,
    #[serde(with = "humantime_serde")]
    pub keep_alive: Duration,
    pub username: String,
    pub password_file: String,
    pub receive_maximum: u16,
    pub broker_window: u16,
    pub sessions: u16,
    pub max_packet_size: ByteSize,
    pub max_packet_size_to_drop: ByteSize,
    #[serde(with = "humantime_serde")]
    pub session_expiry: Duration,
    #[serde(with = "humantime_serde")]
    pub reconnect_delay_min: Duration,
    #[serde(with = "humantime_serde")]
    pub reconnect_delay_max: Duration,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    pub sparkplug_host_id: String,
    pub tls: RawTls,
}

/// `[mqtt.tls]`: the files, never their contents.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub enabled: bool,
    pub ca_file: String,
    pub cert_file: String,
    pub key_file: String,
}

/// The MQTT version (`mqtt.protocol`). Written as users write it: `"v5"`, `"5"`, `"5.0"`,
/// `"mqtt5"`, `5`; `"v311"`, `"v3.1.1"`, `"3.1.1"`, `"311"`, `311` (any case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    V5,
    V311,
}

impl std::str::FromStr for Protocol {
    type Err = String;

    fn from_str(s: &str) -> Result<Protocol, String> {
        let lower = s.trim().to_ascii_lowercase();
        let version = lower
            .strip_prefix("mqtt")
            .unwrap_or(&lower)
            .trim_start_matches([' ', '-']);
        match version.strip_prefix('v').unwrap_or(version) {
            "5" | "5.0" => Ok(Protocol::V5),
            "311" | "3.1.1" => Ok(Protocol::V311),
            _ => Err(format!(
                "unknown MQTT version `{s}`: write \"5\" or \"3.1.1\" (MQTT 3.1 is not supported)"
            )),
        }
    }
}

impl<'de> Deserialize<'de> for Protocol {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Protocol, D::Error> {
        struct Version;
        impl serde::de::Visitor<'_> for Version {
            type Value = Protocol;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an MQTT version: \"5\" or \"3.1.1\"")
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Protocol, E> {
                s.parse().map_err(E::custom)
            }

            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Protocol, E> {
                self.visit_str(&n.to_string())
            }

            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Protocol, E> {
                self.visit_str(&n.to_string())
            }

            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Protocol, E> {
                self.visit_str(&n.to_string())
            }
        }
        d.deserialize_any(Version)
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    pub path: PathBuf,
    #[serde(with = "humantime_serde")]
    pub bucket_width: Duration,
    pub durability: Durability,
    pub quick_repair: bool,
    pub cache_size: ByteSize,
    pub sketch_accuracy: f64,
    pub sketch_max_bins: u32,
    pub page_capacity: u32,
    #[serde(with = "humantime_serde")]
    pub raw_retention: Duration,
    #[serde(with = "humantime_serde")]
    pub bucket_retention: Duration,
    #[serde(with = "humantime_serde")]
    pub retention_interval: Duration,
    pub retention_batch: usize,
    #[serde(with = "humantime_serde")]
    pub checkpoint_interval: Duration,
    pub checkpoint_bytes: ByteSize,
    pub journal_size: ByteSize,
}

/// How a commit reaches the disk. Both are durable before `commit()` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Durability {
    Immediate,
    TwoPhase,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawBatch {
    #[serde(with = "humantime_serde")]
    pub flush_interval: Duration,
    pub max_pending_readings: usize,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    pub max_series: usize,
    pub max_series_per_sensor: usize,
    pub max_payload_bytes: ByteSize,
    #[serde(with = "humantime_serde")]
    pub max_age: Duration,
    #[serde(with = "humantime_serde")]
    pub max_future: Duration,
    pub dead_letters: usize,
    pub dedup_window: usize,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    pub level: String,
    pub format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Full,
    Compact,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawSubscription {
    pub filter: String,
    /// How topics name the sensor and metric; absent: the filter itself (its `+` levels
    /// skipped), for subscriptions that take the sensor from the payload or need no names.
    #[serde(default)]
    pub template: Option<String>,
    pub format: Format,
    #[serde(default = "default_qos")]
    pub qos: u8,
    #[serde(default)]
    pub timestamp_field: Option<String>,
    #[serde(default)]
    pub timestamp_unit: TimestampUnit,
    #[serde(default)]
    pub sensor_field: Option<String>,
    #[serde(default)]
    pub root: Option<String>,
    #[serde(default)]
    pub fields: Option<Vec<String>>,
    /// `format = "sparkplug_b"`: the least time between two rebirth requests to one edge node
    /// (default 1m; "0s": never ask).
    #[serde(default, with = "humantime_serde")]
    pub rebirth_interval: Option<std::time::Duration>,
    #[serde(default = "default_true")]
    pub store_raw: bool,
}

pub(super) fn default_qos() -> u8 {
    1
}

pub(super) fn default_true() -> bool {
    true
}

impl RawSubscription {
    /// The two subscriptions of `config/default.toml` with every filter and template level
    /// placed under `prefix` (`{prefix}/sensors/+/+` and `{prefix}/devices/+/telemetry`):
    /// for tests and benchmarks that share a broker.
    pub fn defaults_under(prefix: &str) -> Vec<RawSubscription> {
        let defaults = RawConfig::load(None, Vec::new()).expect("the defaults load");
        defaults
            .subscriptions
            .into_iter()
            .map(|s| RawSubscription {
                filter: format!("{prefix}/{}", s.filter),
                template: s.template.map(|t| format!("{prefix}/{t}")),
                ..s
            })
            .collect()
    }
}

impl RawConfig {
    /// Loads the layers: built-in defaults, then `file` (if any), then the environment `env`
    /// (pass `std::env::vars()`; tests pass their own).
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<RawConfig, ConfigError> {
        use config::{Environment, File, FileFormat};

        let user_text = match file {
            Some(path) => {
                Some(
                    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                        path: path.to_owned(),
                        source,
                    })?,
                )
            }
            None => None,
        };
        // Arrays from two layers would be merged element by element; a file that lists its own
        // subscriptions replaces the default ones instead.
        let mut defaults: toml::Table = DEFAULT_TOML.parse().expect("default.toml is valid TOML");
        if let Some(text) = &user_text {
            let user: toml::Table = text.parse().map_err(|e: toml::de::Error| {
                ConfigError::Parse(format!(
                    "{}: {}",
                    file.expect("text came from a file").display(),
                    e.message()
                ))
            })?;
            if user.contains_key("subscriptions") {
                defaults.remove("subscriptions");
            }
        }
        let defaults = toml::to_string(&defaults).expect("a parsed table serializes");

        let env: config::Map<String, String> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with(&format!("{ENV_PREFIX}__")))
            .collect();
        let mut builder =
            config::Config::builder().add_source(File::from_str(&defaults, FileFormat::Toml));
        if let Some(text) = &user_text {
            builder = builder.add_source(File::from_str(text, FileFormat::Toml));
        }
        let built = builder
            .add_source(
                Environment::with_prefix(ENV_PREFIX)
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true)
                    .source(Some(env)),
            )
            .build()
            .map_err(|e| ConfigError::Parse(e.to_string()))?;
        built
            .try_deserialize()
            .map_err(|e| ConfigError::Parse(e.to_string()))
    }
}
