//! Configuration: layered loading (built-in defaults, `--config FILE`, `BUCKETD__SECTION__KEY`
//! environment variables) into [`RawConfig`], then validation into the typed [`Config`] the rest
//! of the daemon uses. Knows nothing about MQTT sockets or redb files beyond their settings.
//!
//! `config/default.toml` is compiled in and is the defaults layer, so the documented defaults and
//! the real ones cannot drift apart.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

pub use crate::decode::Subscription;
use crate::decode::{Format, Template, TimestampUnit};

/// The defaults layer: `config/default.toml`, verbatim.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// Prefix of environment overrides: `BUCKETD__MQTT__HOST=...`.
pub const ENV_PREFIX: &str = "BUCKETD";

/// The longest `batch.flush_interval`.
pub const FLUSH_INTERVAL_MAX: Duration = Duration::from_hours(24);

/// The largest `limits.dedup_window`: its hash table is allocated up front, at twice the window.
pub const DEDUP_WINDOW_MAX: usize = 1 << 20;

/// The most `mqtt.sessions`: each is a connection with its own client state and window.
pub const SESSIONS_MAX: u16 = 16;

/// A configuration that cannot be used. The message names the key and says what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Parse(String),
    #[error("invalid value for `{key}`: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

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

/// `[query_node]`, validated.
#[derive(Debug, Clone)]
pub struct QueryNodeConfig {
    /// libpq key=value or URL, without the password; empty: no query node configured.
    pub conninfo: String,
    pub password_file: Option<PathBuf>,
    pub series_refresh: Duration,
    pub max_series: usize,
    pub max_rows_per_query: usize,
    pub statement_timeout: Duration,
}

fn validate_query_node(raw: &RawQueryNode) -> Result<QueryNodeConfig, ConfigError> {
    if !raw.postgres.is_empty() {
        validate_pg_tls("query_node.postgres", &raw.postgres)?;
    }
    for (key, n) in [
        ("query_node.max_series", raw.max_series),
        ("query_node.max_rows_per_query", raw.max_rows_per_query),
    ] {
        if n == 0 {
            return Err(invalid(key, "must be at least 1"));
        }
    }
    if raw.statement_timeout.is_zero() || raw.statement_timeout > Duration::from_hours(1) {
        return Err(invalid(
            "query_node.statement_timeout",
            "must be greater than 0 and at most 1h",
        ));
    }
    Ok(QueryNodeConfig {
        conninfo: raw.postgres.clone(),
        password_file: non_empty_path(&raw.password_file),
        series_refresh: raw.series_refresh,
        max_series: raw.max_series,
        max_rows_per_query: raw.max_rows_per_query,
        statement_timeout: raw.statement_timeout,
    })
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

/// What one gateway may use at a central (`[central]`), so that no gateway can exhaust what the
/// others need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatewayLimits {
    /// Series per gateway (`<gateway>:<sensor>/<metric>`); within `limits.max_series`.
    pub max_series: usize,
    /// Buckets in one delta message.
    pub max_buckets_per_message: usize,
    /// Entries a gateway's position may move on past the last one applied (its outbox's bound).
    pub max_position_jump: u64,
}

impl Default for GatewayLimits {
    /// The defaults of `config/default.toml`.
    fn default() -> GatewayLimits {
        GatewayLimits {
            max_series: 1000,
            max_buckets_per_message: 1000,
            max_position_jump: 100_000,
        }
    }
}

/// Why the central keys of the shared-subscription mode are refused, with what to do instead.
const SHARED_CENTRALS_RETIRED: &str = "central instances sharing a subscription are retired: \
     each held part of every bucket in its own file, with no query that merged them \
     (docs/FLEET.md, \"Several centrals\"). A fleet past one central forwards its gateways to \
     PostgreSQL (upstream.target = \"postgres\") and queries it with `bucketd query-node`; or \
     give each central its own gateways' topics (bucketd/site-1/deltas, ...)";

/// Refuses the retired claims keys of `[central]` when they are set.
fn validate_central(raw: &RawCentral) -> Result<(), ConfigError> {
    let set = [
        ("central.claims_postgres", raw.claims_postgres.is_some()),
        (
            "central.claims_password_file",
            raw.claims_password_file.is_some(),
        ),
        (
            "central.claims_keep_entries",
            raw.claims_keep_entries.is_some(),
        ),
    ];
    match set.iter().find(|(_, set)| *set) {
        Some((key, _)) => Err(invalid(*key, SHARED_CENTRALS_RETIRED)),
        None => Ok(()),
    }
}

/// A DNS name as a `Host` header carries it: labels of letters, digits and `-`, joined by `.`.
fn valid_host_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

fn validate_gateway_limits(
    raw: &RawCentral,
    limits: &Limits,
) -> Result<GatewayLimits, ConfigError> {
    if raw.max_series_per_gateway == 0 {
        return Err(invalid(
            "central.max_series_per_gateway",
            "must be at least 1",
        ));
    }
    if raw.max_buckets_per_message == 0 {
        return Err(invalid(
            "central.max_buckets_per_message",
            "must be at least 1",
        ));
    }
    if raw.max_position_jump == 0 {
        return Err(invalid("central.max_position_jump", "must be at least 1"));
    }
    Ok(GatewayLimits {
        // limits.max_series bounds every gateway's together.
        max_series: raw.max_series_per_gateway.min(limits.max_series),
        max_buckets_per_message: raw.max_buckets_per_message,
        max_position_jump: raw.max_position_jump,
    })
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

/// Where the deltas go.
#[derive(Debug, Clone)]
pub enum UpstreamTarget {
    /// libpq key=value or URL, without the password.
    #[cfg(feature = "postgres")]
    Postgres { conninfo: String },
    /// A broker (or cluster) where a central bucketd subscribes to `bucketd/+/deltas`.
    Mqtt {
        host: String,
        port: u16,
        username: Option<String>,
        client_id: String,
        /// `[upstream.mqtt_tls]`; `None`: plain TCP.
        tls: Option<TlsFiles>,
    },
}

/// Forwarding to the fleet tier, when `upstream.target` is set.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    pub gateway_id: String,
    pub target: UpstreamTarget,
    pub password_file: Option<PathBuf>,
    pub outbox_max_entries: usize,
    pub batch_entries: usize,
    pub retry_delay_max: Duration,
    /// `upstream.postgres_retention`: fleet retention by month partitions; `None`: off.
    pub postgres_retention: Option<Duration>,
}

fn validate_upstream(raw: &RawUpstream) -> Result<Option<UpstreamConfig>, ConfigError> {
    let tls = validate_tls(&raw.mqtt_tls, UPSTREAM_TLS)?;
    match raw.target.as_str() {
        "" => return Ok(None),
        "postgres" | "mqtt" => {}
        other => {
            return Err(invalid(
                "upstream.target",
                format!("unknown target {other:?}; expected \"\" (off), \"postgres\" or \"mqtt\""),
            ));
        }
    }
    if !crate::reading::valid_gateway_id(&raw.gateway_id) {
        return Err(invalid(
            "upstream.gateway_id",
            "must be 1-64 letters, digits, \"-\", \"_\" or \".\" (it names this gateway upstream)",
        ));
    }
    let target = if raw.target == "postgres" {
        if tls.is_some() {
            return Err(invalid(
                "upstream.mqtt_tls.enabled",
                "is for upstream.target = \"mqtt\"; for PostgreSQL, set sslmode in \
                 upstream.postgres",
            ));
        }
        if raw.postgres.is_empty() {
            return Err(invalid(
                "upstream.postgres",
                "must be set when upstream.target = \"postgres\"",
            ));
        }
        validate_pg_tls("upstream.postgres", &raw.postgres)?;
        #[cfg(not(feature = "postgres"))]
        return Err(not_built("upstream.target", &["postgres"]));
        #[cfg(feature = "postgres")]
        UpstreamTarget::Postgres {
            conninfo: raw.postgres.clone(),
        }
    } else {
        if raw.mqtt_host.is_empty() {
            return Err(invalid(
                "upstream.mqtt_host",
                "must be set when upstream.target = \"mqtt\"",
            ));
        }
        UpstreamTarget::Mqtt {
            host: raw.mqtt_host.clone(),
            port: raw.mqtt_port,
            username: (!raw.mqtt_username.is_empty()).then(|| raw.mqtt_username.clone()),
            client_id: if raw.mqtt_client_id.is_empty() {
                format!("bucketd-fwd-{}", raw.gateway_id)
            } else {
                raw.mqtt_client_id.clone()
            },
            tls,
        }
    };
    if raw.outbox_max_entries == 0 {
        return Err(invalid("upstream.outbox_max_entries", "must be at least 1"));
    }
    let batch_max = raw
        .outbox_max_entries
        .min(crate::limits::UPSTREAM_BATCH_ENTRIES_MAX);
    if raw.batch_entries == 0 || raw.batch_entries > batch_max {
        return Err(invalid(
            "upstream.batch_entries",
            format!(
                "must be between 1 and upstream.outbox_max_entries, at most {}",
                crate::limits::UPSTREAM_BATCH_ENTRIES_MAX
            ),
        ));
    }
    if raw.retry_delay_max.is_zero() {
        return Err(invalid("upstream.retry_delay_max", "must be more than 0"));
    }
    Ok(Some(UpstreamConfig {
        gateway_id: raw.gateway_id.clone(),
        target,
        password_file: non_empty_path(&raw.password_file),
        outbox_max_entries: raw.outbox_max_entries,
        batch_entries: raw.batch_entries,
        retry_delay_max: raw.retry_delay_max,
        postgres_retention: (!raw.postgres_retention.is_zero()).then_some(raw.postgres_retention),
    }))
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
    #[serde(default = "default_true")]
    pub store_raw: bool,
}

fn default_qos() -> u8 {
    1
}

fn default_true() -> bool {
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

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub mqtt: MqttConfig,
    pub store: StoreConfig,
    pub batch: BatchConfig,
    pub limits: Limits,
    pub http: HttpConfig,
    /// Forwarding to the fleet tier; `None`: off, and no outbox is kept.
    pub upstream: Option<UpstreamConfig>,
    /// What one gateway may use at a central.
    pub gateway_limits: GatewayLimits,
    /// `bucketd query-node`'s PostgreSQL and bounds.
    pub query_node: QueryNodeConfig,
    pub log: RawLog,
    pub subscriptions: Vec<Subscription>,
}

#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub bind: std::net::SocketAddr,
    /// Bearer token guarding `/api/*`, read from this file at start ([`crate::secret`]).
    pub token_file: Option<PathBuf>,
    /// Bearer token guarding `/metrics`, separately (a scraper needs no query rights).
    pub metrics_token_file: Option<PathBuf>,
    pub max_buckets_per_query: usize,
    /// Stored buckets one `/prom` query may read, and points (or label sets) it may answer.
    pub max_points_per_query: u64,
    pub max_raw_readings: usize,
    /// Open HTTP connections at once; more are closed as they come (counted).
    pub max_connections: usize,
    /// Query API requests (series, buckets, raw) served at once; more wait for a turn.
    pub max_concurrent_queries: usize,
    /// A connection that has not sent a whole request head in this time is closed.
    pub header_read_timeout: Duration,
    /// Open connections from one IP address; more are closed as they come (counted).
    pub max_connections_per_address: usize,
    /// A request's body must have arrived within this time of its head, and a response that
    /// the client does not read for this long ends its connection.
    pub request_timeout: Duration,
    /// Host names (besides IP addresses and `localhost`) that requests may name while no token
    /// guards their endpoints: DNS rebinding cannot reach an open API.
    pub allowed_hosts: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct MqttConfig {
    pub host: String,
    pub port: u16,
    pub client_id: String,
    pub protocol: Protocol,
    pub keep_alive: Duration,
    /// Username and the file holding the password; the password itself is read at connect time.
    pub credentials: Option<(String, Option<PathBuf>)>,
    pub receive_maximum: u16,
    /// The in-flight window the broker enforces, when stated (`mqtt.broker_window`, 0: learn it).
    pub broker_window: Option<u16>,
    /// Persistent sessions sharing the subscriptions (`mqtt.sessions`), each with its own window.
    pub sessions: u16,
    pub max_packet_bytes: usize,
    /// Over MQTT 3.1.1, a message up to this size that is larger than `max_packet_bytes` is
    /// taken in on a reconnect with a larger limit and rejected, instead of resetting every
    /// connection it is redelivered on.
    pub max_packet_bytes_to_drop: usize,
    pub session_expiry: Duration,
    pub reconnect_delay_min: Duration,
    pub reconnect_delay_max: Duration,
    pub connect_timeout: Duration,
    /// TLS to the broker, when `mqtt.tls.enabled`.
    pub tls: Option<TlsFiles>,
}

impl MqttConfig {
    /// The client id of session `i` (0-based): the configured id with one session, so that
    /// a single-session daemon keeps the session it always had; `<client_id>-<i>` with more.
    pub fn session_client_id(&self, i: usize) -> String {
        if self.sessions > 1 {
            format!("{}-{i}", self.client_id)
        } else {
            self.client_id.clone()
        }
    }

    /// The filter a session subscribes to for a configured `filter`: with several sessions, a
    /// shared subscription (`$share/<client_id>/<filter>`) so that the broker hands each message
    /// to one of them; a filter that is already shared is left as the operator wrote it.
    pub fn session_filter(&self, filter: &str) -> String {
        if self.sessions > 1 && !filter.starts_with("$share/") {
            format!("$share/{}/{filter}", self.client_id)
        } else {
            filter.to_owned()
        }
    }
}

/// Where the TLS material is. Read at start ([`crate::tls`]); a relative `key_file` is looked
/// up in `$CREDENTIALS_DIRECTORY` like the other secrets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM CA certificates to trust; `None`: the system's roots.
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain and private key (PEM), for brokers that require one.
    pub client: Option<(PathBuf, PathBuf)>,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub path: PathBuf,
    pub bucket_width: Duration,
    pub durability: Durability,
    pub quick_repair: bool,
    pub cache_bytes: usize,
    pub sketch: crate::sketch::SketchParams,
    pub page_capacity: u32,
    pub retention: Retention,
    pub checkpoint: Checkpoint,
    /// Size of the journal file (`store.journal_size`); 0: none.
    pub journal_bytes: u64,
}

impl StoreConfig {
    /// `bucket_width` in seconds.
    pub fn bucket_width_secs(&self) -> i64 {
        // Validation keeps it a divisor of a day, at most 86,400.
        i64::try_from(self.bucket_width.as_secs()).unwrap_or(86_400)
    }
}

/// When the commit log is folded into the bucket documents, from `[store]`.
#[derive(Debug, Clone, Copy)]
pub struct Checkpoint {
    /// Longest time a commit stays in the log.
    pub interval: Duration,
    /// Log size (records and fingerprints) that brings the next checkpoint forward.
    pub bytes: u64,
}

/// Retention settings, from `[store]`.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    pub raw: Duration,
    pub buckets: Duration,
    /// Time between passes while nothing is expired.
    pub interval: Duration,
    /// Most pages and buckets deleted by one pass (one write transaction).
    pub batch: usize,
}

#[derive(Debug, Clone)]
pub struct BatchConfig {
    pub flush_interval: Duration,
    pub max_pending_readings: usize,
}

#[derive(Debug, Clone)]
pub struct Limits {
    pub max_series: usize,
    /// Series one sensor's readings may add (within `max_series`).
    pub max_series_per_sensor: usize,
    pub max_payload_bytes: usize,
    pub max_age: Duration,
    pub max_future: Duration,
    pub dead_letters: usize,
    /// Fingerprints of recent messages kept for recognising redeliveries ([`crate::dedup`]).
    pub dedup_window: usize,
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

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Config, ConfigError> {
        let mqtt = validate_mqtt(&raw.mqtt)?;
        let store = validate_store(&raw.store)?;

        // Deadlines are instants `flush_interval` ahead: an absurd interval must not overflow them.
        if raw.batch.flush_interval.is_zero() || raw.batch.flush_interval > FLUSH_INTERVAL_MAX {
            return Err(invalid(
                "batch.flush_interval",
                "must be greater than 0 and at most 1d (readings wait that long for a commit)",
            ));
        }
        if raw.batch.max_pending_readings == 0 {
            return Err(invalid("batch.max_pending_readings", "must be at least 1"));
        }
        let batch = BatchConfig {
            flush_interval: raw.batch.flush_interval,
            max_pending_readings: raw.batch.max_pending_readings,
        };

        if raw.limits.max_series == 0 {
            return Err(invalid("limits.max_series", "must be at least 1"));
        }
        let max_payload_bytes = usize::try_from(raw.limits.max_payload_bytes.as_u64())
            .map_err(|_| invalid("limits.max_payload_bytes", "too large"))?;
        if max_payload_bytes == 0 {
            return Err(invalid(
                "limits.max_payload_bytes",
                "must be greater than 0",
            ));
        }
        if max_payload_bytes >= mqtt.max_packet_bytes {
            return Err(invalid(
                "limits.max_payload_bytes",
                format!(
                    "must be smaller than mqtt.max_packet_size ({} bytes), which also carries the topic",
                    mqtt.max_packet_bytes
                ),
            ));
        }
        if raw.limits.dedup_window > DEDUP_WINDOW_MAX {
            return Err(invalid(
                "limits.dedup_window",
                "must be at most 1048576 (fingerprints are held in memory, ~40 bytes each)",
            ));
        }
        let redeliverable = usize::from(mqtt.receive_maximum) * usize::from(mqtt.sessions);
        if raw.limits.dedup_window < redeliverable {
            return Err(invalid(
                "limits.dedup_window",
                format!(
                    "must be at least mqtt.receive_maximum x mqtt.sessions ({redeliverable}): \
                     every message the broker may redeliver must fit in it"
                ),
            ));
        }
        if raw.limits.max_series_per_sensor == 0 {
            return Err(invalid(
                "limits.max_series_per_sensor",
                "must be at least 1",
            ));
        }
        let limits = Limits {
            max_series: raw.limits.max_series,
            max_series_per_sensor: raw.limits.max_series_per_sensor.min(raw.limits.max_series),
            max_payload_bytes,
            max_age: raw.limits.max_age,
            max_future: raw.limits.max_future,
            dead_letters: raw.limits.dead_letters,
            dedup_window: raw.limits.dedup_window,
        };

        let bind = raw.http.bind.parse().map_err(|_| {
            invalid(
                "http.bind",
                format!(
                    "`{}` is not an IP address and port like 127.0.0.1:9470",
                    raw.http.bind
                ),
            )
        })?;
        if raw.http.max_buckets_per_query == 0 {
            return Err(invalid("http.max_buckets_per_query", "must be at least 1"));
        }
        if raw.http.max_raw_readings == 0 {
            return Err(invalid("http.max_raw_readings", "must be at least 1"));
        }
        if !(1..=100_000_000).contains(&raw.http.max_points_per_query) {
            return Err(invalid(
                "http.max_points_per_query",
                "must be 1..=100000000 (an answer of that many points is held in memory)",
            ));
        }
        for (key, value, most) in [
            ("http.max_connections", raw.http.max_connections, 4096),
            (
                "http.max_concurrent_queries",
                raw.http.max_concurrent_queries,
                256,
            ),
        ] {
            if !(1..=most).contains(&value) {
                return Err(invalid(key, format!("must be 1..={most}")));
            }
        }
        for (key, value, what) in [
            (
                "http.header_read_timeout",
                raw.http.header_read_timeout,
                "a slow client's request head, not a query's run time",
            ),
            (
                "http.request_timeout",
                raw.http.request_timeout,
                "a slow client's request body or unread answer, not a query's run time",
            ),
        ] {
            if !(Duration::from_millis(100)..=Duration::from_mins(5)).contains(&value) {
                return Err(invalid(key, format!("must be 100ms..=5m ({what})")));
            }
        }
        if raw.http.max_connections_per_address == 0 {
            return Err(invalid(
                "http.max_connections_per_address",
                "must be at least 1",
            ));
        }
        if let Some(bad) = raw.http.allowed_hosts.iter().find(|h| !valid_host_name(h)) {
            return Err(invalid(
                "http.allowed_hosts",
                format!(
                    "`{bad}` is not a host name (letters, digits, \"-\" and \".\", without a \
                     port or scheme)"
                ),
            ));
        }
        let http = HttpConfig {
            bind,
            token_file: non_empty_path(&raw.http.token_file),
            metrics_token_file: non_empty_path(&raw.http.metrics_token_file),
            max_buckets_per_query: raw.http.max_buckets_per_query,
            max_points_per_query: raw.http.max_points_per_query,
            max_raw_readings: raw.http.max_raw_readings,
            max_connections: raw.http.max_connections,
            max_concurrent_queries: raw.http.max_concurrent_queries,
            header_read_timeout: raw.http.header_read_timeout,
            // Within all connections' bound (the smaller of the two).
            max_connections_per_address: raw
                .http
                .max_connections_per_address
                .min(raw.http.max_connections),
            request_timeout: raw.http.request_timeout,
            allowed_hosts: raw
                .http
                .allowed_hosts
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect(),
        };

        if !valid_log_filter(&raw.log.level) {
            return Err(invalid(
                "log.level",
                format!(
                    "`{}` is not a level or filter (error, warn, info, debug, trace)",
                    raw.log.level
                ),
            ));
        }

        if raw.subscriptions.is_empty() {
            return Err(invalid(
                "subscriptions",
                "at least one [[subscriptions]] table is needed",
            ));
        }
        let subscriptions = raw
            .subscriptions
            .iter()
            .enumerate()
            .map(|(i, s)| validate_subscription(i, s))
            .collect::<Result<Vec<_>, _>>()?;

        let upstream = validate_upstream(&raw.upstream)?;
        validate_central(&raw.central)?;
        let gateway_limits = validate_gateway_limits(&raw.central, &limits)?;
        let query_node = validate_query_node(&raw.query_node)?;
        Ok(Config {
            mqtt,
            store,
            batch,
            limits,
            http,
            upstream,
            gateway_limits,
            query_node,
            log: raw.log,
            subscriptions,
        })
    }
}

fn validate_mqtt(raw: &RawMqtt) -> Result<MqttConfig, ConfigError> {
    if raw.host.trim().is_empty() {
        return Err(invalid("mqtt.host", "must not be empty"));
    }
    if raw.port == 0 {
        return Err(invalid("mqtt.port", "must be 1..=65535"));
    }
    // MQTT strings are at most 65,535 bytes; brokers may accept less (3.1.1 promises only 23).
    if raw.client_id.is_empty() || raw.client_id.len() > 65_535 {
        return Err(invalid(
            "mqtt.client_id",
            "must be a non-empty, stable id (the broker keeps the session under it)",
        ));
    }
    if raw.receive_maximum == 0 {
        return Err(invalid("mqtt.receive_maximum", "must be 1..=65535"));
    }
    if !(1..=SESSIONS_MAX).contains(&raw.sessions) {
        return Err(invalid(
            "mqtt.sessions",
            format!("must be 1..={SESSIONS_MAX} (each session is a connection to the broker)"),
        ));
    }
    if raw.sessions > 1 && raw.client_id.contains(['/', '+', '#']) {
        return Err(invalid(
            "mqtt.client_id",
            "must not contain '/', '+' or '#' when mqtt.sessions > 1: it names the shared \
             subscription's group ($share/<client_id>/...)",
        ));
    }
    if raw.keep_alive < Duration::from_secs(5) {
        return Err(invalid("mqtt.keep_alive", "must be at least 5s"));
    }
    if raw.reconnect_delay_min.is_zero() || raw.reconnect_delay_min > raw.reconnect_delay_max {
        return Err(invalid(
            "mqtt.reconnect_delay_min",
            "must be greater than 0 and not above mqtt.reconnect_delay_max",
        ));
    }
    if raw.connect_timeout.is_zero() {
        return Err(invalid("mqtt.connect_timeout", "must be greater than 0"));
    }
    if u32::try_from(raw.session_expiry.as_secs()).is_err() {
        return Err(invalid("mqtt.session_expiry", "must fit in 2^32 seconds"));
    }
    let max_packet_bytes = usize::try_from(raw.max_packet_size.as_u64())
        .ok()
        .filter(|n| (1024..=256 << 20).contains(n))
        .ok_or_else(|| invalid("mqtt.max_packet_size", "must be between 1KiB and 256MiB"))?;
    let max_packet_bytes_to_drop = usize::try_from(raw.max_packet_size_to_drop.as_u64())
        .ok()
        .filter(|n| (max_packet_bytes..=256 << 20).contains(n))
        .ok_or_else(|| {
            invalid(
                "mqtt.max_packet_size_to_drop",
                "must be between mqtt.max_packet_size and 256MiB",
            )
        })?;
    let credentials = match (raw.username.is_empty(), raw.password_file.is_empty()) {
        (true, true) => None,
        (true, false) => {
            return Err(invalid(
                "mqtt.username",
                "must be set when mqtt.password_file is",
            ));
        }
        (false, true) => Some((raw.username.clone(), None)),
        (false, false) => Some((raw.username.clone(), non_empty_path(&raw.password_file))),
    };
    let tls = validate_tls(&raw.tls, MQTT_TLS)?;
    Ok(MqttConfig {
        tls,
        host: raw.host.clone(),
        port: raw.port,
        client_id: raw.client_id.clone(),
        protocol: raw.protocol,
        keep_alive: raw.keep_alive,
        credentials,
        receive_maximum: raw.receive_maximum,
        broker_window: (raw.broker_window > 0).then_some(raw.broker_window),
        sessions: raw.sessions,
        max_packet_bytes,
        max_packet_bytes_to_drop,
        session_expiry: raw.session_expiry,
        reconnect_delay_min: raw.reconnect_delay_min,
        reconnect_delay_max: raw.reconnect_delay_max,
        connect_timeout: raw.connect_timeout,
    })
}

/// A setting that needs parts this build left out (Cargo features).
fn not_built(key: &str, features: &[&str]) -> ConfigError {
    invalid(
        key,
        format!(
            "this bucketd was built without it (Cargo features: {}); use the full build, or \
             build with --features {}",
            features.join(", "),
            features.join(",")
        ),
    )
}

fn non_empty_path(s: &str) -> Option<PathBuf> {
    (!s.is_empty()).then(|| PathBuf::from(s))
}

/// Where a TLS table sits: `[mqtt.tls]` or `[upstream.mqtt_tls]`, and its broker's port key.
#[derive(Debug, Clone, Copy)]
pub struct TlsKeys {
    pub table: &'static str,
    pub port: &'static str,
}

pub const MQTT_TLS: TlsKeys = TlsKeys {
    table: "mqtt.tls",
    port: "mqtt.port",
};

pub const UPSTREAM_TLS: TlsKeys = TlsKeys {
    table: "upstream.mqtt_tls",
    port: "upstream.mqtt_port",
};

fn validate_tls(raw: &RawTls, keys: TlsKeys) -> Result<Option<TlsFiles>, ConfigError> {
    let t = keys.table;
    let named = !raw.ca_file.is_empty() || !raw.cert_file.is_empty() || !raw.key_file.is_empty();
    if !raw.enabled {
        if named {
            return Err(invalid(
                format!("{t}.enabled"),
                format!(
                    "TLS files are set but TLS is off; set {t}.enabled = true (and usually \
                     {} = 8883), or remove the files",
                    keys.port
                ),
            ));
        }
        return Ok(None);
    }
    let client = match (
        non_empty_path(&raw.cert_file),
        non_empty_path(&raw.key_file),
    ) {
        (None, None) => None,
        (Some(cert), Some(key)) => Some((cert, key)),
        (Some(_), None) => {
            return Err(invalid(
                format!("{t}.key_file"),
                format!("must be set when {t}.cert_file is"),
            ));
        }
        (None, Some(_)) => {
            return Err(invalid(
                format!("{t}.cert_file"),
                format!("must be set when {t}.key_file is"),
            ));
        }
    };
    if !cfg!(feature = "tls") {
        return Err(not_built(&format!("{t}.enabled"), &["tls"]));
    }
    Ok(Some(TlsFiles {
        ca_file: non_empty_path(&raw.ca_file),
        client,
    }))
}

fn validate_store(raw: &RawStore) -> Result<StoreConfig, ConfigError> {
    const DAY_SECONDS: u64 = 86_400;
    let width = raw.bucket_width;
    if width.subsec_nanos() != 0
        || width.as_secs() == 0
        || !DAY_SECONDS.is_multiple_of(width.as_secs())
    {
        return Err(invalid(
            "store.bucket_width",
            format!(
                "{} does not divide a day into whole seconds (1h, 30m, 15m, 1d, ... do)",
                humantime::format_duration(width)
            ),
        ));
    }
    if raw.path.as_os_str().is_empty() {
        return Err(invalid("store.path", "must not be empty"));
    }
    let cache_bytes = usize::try_from(raw.cache_size.as_u64())
        .map_err(|_| invalid("store.cache_size", "too large for this machine"))?;
    if !crate::limits::SKETCH_ACCURACY.contains(&raw.sketch_accuracy) {
        return Err(invalid(
            "store.sketch_accuracy",
            "must be between 0.0001 and 0.2 (0.01 = quantiles within 1%)",
        ));
    }
    if !crate::limits::SKETCH_MAX_BINS.contains(&raw.sketch_max_bins) {
        return Err(invalid("store.sketch_max_bins", "must be 16..=65536"));
    }
    if !(1..=100_000).contains(&raw.page_capacity) {
        return Err(invalid("store.page_capacity", "must be 1..=100000"));
    }
    if raw.raw_retention > raw.bucket_retention {
        return Err(invalid(
            "store.raw_retention",
            "must not exceed store.bucket_retention (raw pages belong to their bucket)",
        ));
    }
    if raw.raw_retention < width {
        return Err(invalid(
            "store.raw_retention",
            "must be at least one store.bucket_width",
        ));
    }
    if raw.retention_interval.is_zero() {
        return Err(invalid(
            "store.retention_interval",
            "must be greater than 0",
        ));
    }
    if raw.retention_batch == 0 {
        return Err(invalid("store.retention_batch", "must be at least 1"));
    }
    if raw.checkpoint_interval < Duration::from_secs(1) {
        return Err(invalid(
            "store.checkpoint_interval",
            "must be at least 1s (every checkpoint rewrites the buckets the log touched)",
        ));
    }
    if raw.checkpoint_bytes.as_u64() < crate::limits::MIN_CHECKPOINT_BYTES {
        return Err(invalid(
            "store.checkpoint_bytes",
            format!(
                "must be at least {}",
                ByteSize(crate::limits::MIN_CHECKPOINT_BYTES)
            ),
        ));
    }
    let journal_bytes = raw.journal_size.as_u64();
    if journal_bytes != 0 && journal_bytes < crate::limits::MIN_JOURNAL_BYTES {
        return Err(invalid(
            "store.journal_size",
            format!(
                "must be 0 (no journal) or at least {}",
                ByteSize(crate::limits::MIN_JOURNAL_BYTES)
            ),
        ));
    }
    Ok(StoreConfig {
        journal_bytes,
        checkpoint: Checkpoint {
            interval: raw.checkpoint_interval,
            bytes: raw.checkpoint_bytes.as_u64(),
        },
        retention: Retention {
            raw: raw.raw_retention,
            buckets: raw.bucket_retention,
            interval: raw.retention_interval,
            batch: raw.retention_batch,
        },
        page_capacity: raw.page_capacity,
        sketch: crate::sketch::SketchParams {
            alpha: raw.sketch_accuracy,
            max_bins: raw.sketch_max_bins,
        },
        path: raw.path.clone(),
        bucket_width: width,
        durability: raw.durability,
        quick_repair: raw.quick_repair,
        cache_bytes,
    })
}

/// The template of a delta subscription without one: where a gateway's forwarder publishes.
pub const DELTA_TEMPLATE: &str = "bucketd/{gateway}/deltas";

fn validate_subscription(i: usize, raw: &RawSubscription) -> Result<Subscription, ConfigError> {
    let key = |k: &str| format!("subscriptions[{i}].{k}");
    validate_filter(&raw.filter).map_err(|m| invalid(key("filter"), m))?;
    let topic_filter = strip_share(&raw.filter);
    let template_text = match (&raw.template, raw.format) {
        (Some(t), _) => t.as_str(),
        // A gateway's forwarder publishes to bucketd/<gateway_id>/deltas.
        (None, Format::Delta) => DELTA_TEMPLATE,
        (None, _) => topic_filter,
    };
    let template = Template::parse(template_text).map_err(|m| invalid(key("template"), m))?;
    if !template.fits_filter(topic_filter) {
        return Err(invalid(
            key("template"),
            format!(
                "`{template_text}` does not line up with filter `{}`: give one template level per \
                 filter level",
                raw.filter
            ),
        ));
    }
    if raw.qos > 1 {
        // QoS 2 deliveries stalled after the broker's in-flight window against Mosquitto 2.0.11
        // in testing (PUBREC sent after the commit, no further messages); until that is
        // understood, refuse it rather than stall.
        return Err(invalid(
            key("qos"),
            "must be 0 or 1; QoS 2 is not supported yet (QoS 1 with acknowledgement after the \
             commit already loses nothing)",
        ));
    }
    if raw.format != Format::Delta && template.has_gateway() {
        return Err(invalid(
            key("template"),
            "{gateway} names a delta message's gateway; it needs format = \"delta\"",
        ));
    }
    match raw.format {
        Format::Value => {
            if !template.has_sensor() || !template.has_metric() {
                return Err(invalid(
                    key("template"),
                    "format \"value\" needs {sensor} and {metric} in the template",
                ));
            }
            if raw.sensor_field.is_some() || raw.timestamp_field.is_some() {
                return Err(invalid(
                    key("format"),
                    "sensor_field and timestamp_field need format = \"json\"",
                ));
            }
        }
        Format::Json => {
            if template.has_metric() {
                return Err(invalid(
                    key("template"),
                    "format \"json\" takes metric names from the payload's fields; remove {metric}",
                ));
            }
            if template.has_sensor() == raw.sensor_field.is_some() {
                return Err(invalid(
                    key("sensor_field"),
                    "give the sensor either as {sensor} in the template or as sensor_field, exactly one",
                ));
            }
        }
        Format::Delta => {
            if !template.has_gateway() {
                return Err(invalid(
                    key("template"),
                    format!(
                        "format \"delta\" needs {{gateway}} in the template, at the level where \
                         the topic names the gateway (\"{DELTA_TEMPLATE}\", which is also the \
                         default): a message's gateway_id must be the gateway of its topic"
                    ),
                ));
            }
            if template.has_sensor() || template.has_metric() {
                return Err(invalid(
                    key("template"),
                    "format \"delta\" takes series names from the payload; remove {sensor} and \
                     {metric}",
                ));
            }
            if raw.sensor_field.is_some() || raw.timestamp_field.is_some() {
                return Err(invalid(
                    key("format"),
                    "sensor_field and timestamp_field need format = \"json\"",
                ));
            }
            if raw.filter.starts_with("$share/") {
                return Err(invalid(key("filter"), SHARED_CENTRALS_RETIRED));
            }
            if !cfg!(feature = "central") {
                return Err(not_built(&key("format"), &["central"]));
            }
        }
    }
    for (name, field) in [
        ("timestamp_field", &raw.timestamp_field),
        ("sensor_field", &raw.sensor_field),
    ] {
        if field.as_deref().is_some_and(str::is_empty) {
            return Err(invalid(key(name), "must not be empty"));
        }
    }
    Ok(Subscription {
        filter: raw.filter.clone(),
        qos: raw.qos,
        template,
        format: raw.format,
        timestamp_field: raw.timestamp_field.clone(),
        timestamp_unit: raw.timestamp_unit,
        sensor_field: raw.sensor_field.clone(),
        store_raw: raw.store_raw,
    })
}

/// A level (`info`) or a list of directives (`info,bucketd=debug`) with known level names.
fn valid_log_filter(filter: &str) -> bool {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    !filter.trim().is_empty()
        && filter.split(',').all(|directive| {
            let level = directive.rsplit('=').next().unwrap_or("").trim();
            LEVELS.iter().any(|l| l.eq_ignore_ascii_case(level))
                || (directive.contains('=') && level.is_empty())
        })
        && filter
            .parse::<tracing_subscriber::filter::Targets>()
            .is_ok()
}

/// `$share/group/a/b` -> `a/b`: the template applies to the topic, not the share prefix.
fn strip_share(filter: &str) -> &str {
    filter
        .strip_prefix("$share/")
        .and_then(|rest| rest.split_once('/'))
        .map_or(filter, |(_group, f)| f)
}

fn validate_filter(filter: &str) -> Result<(), String> {
    let topic = strip_share(filter);
    if filter.starts_with("$share/") && topic == filter {
        return Err("a shared subscription is `$share/GROUP/FILTER`".into());
    }
    if topic.is_empty() || topic.len() > 65_535 {
        return Err("must not be empty".into());
    }
    let levels: Vec<&str> = topic.split('/').collect();
    for (i, level) in levels.iter().enumerate() {
        let wildcard_misused = (level.contains('+') && *level != "+")
            || (level.contains('#') && (*level != "#" || i + 1 != levels.len()));
        if wildcard_misused {
            return Err(format!(
                "`{filter}`: + must stand alone in a level and # alone in the last level"
            ));
        }
    }
    Ok(())
}

impl Config {
    /// Loads and validates in one step.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        Config::try_from(RawConfig::load(file, env)?)
    }

    /// The store path with a relative path resolved against `state_directory`
    /// (systemd's `$STATE_DIRECTORY`) when one is given.
    pub fn resolved_store_path(&self, state_directory: Option<&Path>) -> PathBuf {
        match state_directory {
            Some(dir) if self.store.path.is_relative() => dir.join(&self.store.path),
            _ => self.store.path.clone(),
        }
    }
}

/// The effective configuration as TOML, for `bucketd check-config`. It contains no secret: the
/// MQTT password stays in its file, and a password in a PostgreSQL connection string
/// (`upstream.postgres`, `query_node.postgres`) is shown as `***`.
pub fn render(raw: &RawConfig) -> String {
    let mut shown = raw.clone();
    shown.upstream.postgres = redact_conninfo(&raw.upstream.postgres);
    shown.query_node.postgres = redact_conninfo(&raw.query_node.postgres);
    toml::to_string_pretty(&shown).expect("RawConfig serializes to TOML")
}

/// A libpq connection string with its password replaced by `***`: in a URL
/// (`postgresql://user:secret@host/db`, `?password=secret`) or as `password=secret` /
/// `password='a secret'` in the key-value form.
pub fn redact_conninfo(conninfo: &str) -> String {
    const HIDDEN: &str = "***";
    if let Some(rest) = ["postgresql://", "postgres://"]
        .iter()
        .find_map(|scheme| conninfo.strip_prefix(scheme).map(|rest| (scheme, rest)))
    {
        let (scheme, rest) = rest;
        // The credentials run to an `@` even past a `/` or `?` (tokio-postgres reads them so: a
        // password may hold both), so they end at the last `@`; an `@` later in the query only
        // hides more than it must.
        let (userinfo, rest) = match rest.rsplit_once('@') {
            Some((userinfo, rest)) => (
                match userinfo.split_once(':') {
                    Some((user, _)) => format!("{user}:{HIDDEN}@"),
                    None => format!("{userinfo}@"),
                },
                rest,
            ),
            None => (String::new(), rest),
        };
        let (host, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
        let authority = format!("{userinfo}{host}");
        let tail = match tail.split_once('?') {
            Some((path, query)) => {
                let query: Vec<String> = query
                    .split('&')
                    .map(|kv| match kv.split_once('=') {
                        Some((k, _)) if k.eq_ignore_ascii_case("password") => {
                            format!("{k}={HIDDEN}")
                        }
                        _ => kv.to_owned(),
                    })
                    .collect();
                format!("{path}?{}", query.join("&"))
            }
            None => tail.to_owned(),
        };
        return format!("{scheme}{authority}{tail}");
    }
    // Key-value form: `key = value` pairs; a value is a word or single-quoted with \ escapes.
    let mut out = String::with_capacity(conninfo.len());
    let mut rest = conninfo;
    while let Some(at) = rest.find("password") {
        let (before, from) = rest.split_at(at);
        out.push_str(before);
        let after_key = &from["password".len()..];
        let boundary_before = before.is_empty() || before.ends_with(char::is_whitespace);
        let after_space = after_key.trim_start();
        let Some(value) = after_space.strip_prefix('=').filter(|_| boundary_before) else {
            out.push_str("password");
            rest = after_key;
            continue;
        };
        let value = value.trim_start();
        let end = if let Some(quoted) = value.strip_prefix('\'') {
            let mut escaped = false;
            let close = quoted.char_indices().find(|&(_, c)| {
                let close = c == '\'' && !escaped;
                escaped = c == '\\' && !escaped;
                close
            });
            close.map_or(value.len(), |(i, _)| i + 2)
        } else {
            value.find(char::is_whitespace).unwrap_or(value.len())
        };
        out.push_str("password=");
        out.push_str(HIDDEN);
        rest = &value[end..];
    }
    out.push_str(rest);
    out
}

/// A PostgreSQL connection string's `sslmode` is one bucketd knows, and TLS is built in if it
/// asks for TLS.
fn validate_pg_tls(key: &str, conninfo: &str) -> Result<(), ConfigError> {
    let tls = pg_tls(conninfo).map_err(|m| invalid(key, m))?;
    let wants_tls = !matches!(tls.mode, SslMode::Disable | SslMode::Prefer);
    if wants_tls && !cfg!(feature = "tls") {
        return Err(not_built(key, &["tls"]));
    }
    Ok(())
}

/// Whether `host` (a name or an address) is this machine: a password sent there crosses no
/// network.
pub fn is_loopback_host(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// libpq's `sslmode`, as bucketd's PostgreSQL client honours it (`fleet::pg_tls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS if the server offers it, else plain; the certificate is not checked (libpq's default).
    Prefer,
    /// TLS; the certificate is checked only when `sslrootcert` names the CA (as libpq does).
    Require,
    /// TLS with a certificate signed by `sslrootcert` (or a system CA); any host name.
    VerifyCa,
    /// TLS with a certificate signed by `sslrootcert` (or a system CA) for the host connected to.
    VerifyFull,
}

/// A connection string's TLS settings, taken out of it: tokio-postgres knows only `disable`,
/// `prefer` and `require`, and no `sslrootcert`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgTls {
    pub mode: SslMode,
    pub root_cert: Option<PathBuf>,
    /// The connection string for tokio-postgres: without `sslrootcert`, and with `sslmode`
    /// one it knows.
    pub conninfo: String,
}

/// The TLS settings of a libpq connection string (key-value or URL form); `Err` names a value
/// that is not one.
pub fn pg_tls(conninfo: &str) -> Result<PgTls, String> {
    let (mode, rest) = take_conninfo_option(conninfo, "sslmode");
    let (root_cert, rest) = take_conninfo_option(&rest, "sslrootcert");
    let mode = match mode.as_deref() {
        None | Some("prefer") => SslMode::Prefer,
        Some("disable") => SslMode::Disable,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        Some(other) => {
            return Err(format!(
                "sslmode={other} is not one of disable, prefer, require, verify-ca, verify-full"
            ));
        }
    };
    let theirs = match mode {
        SslMode::Disable => "disable",
        SslMode::Prefer => "prefer",
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => "require",
    };
    let url = ["postgresql://", "postgres://"]
        .iter()
        .any(|scheme| rest.starts_with(scheme));
    let conninfo = match (url, rest.contains('?')) {
        (true, true) => format!("{rest}&sslmode={theirs}"),
        (true, false) => format!("{rest}?sslmode={theirs}"),
        (false, _) => format!("{} sslmode={theirs}", rest.trim_end()),
    };
    Ok(PgTls {
        mode,
        root_cert: root_cert.filter(|p| !p.is_empty()).map(PathBuf::from),
        conninfo: conninfo.trim_start().to_owned(),
    })
}

/// Takes `key=value` out of a libpq connection string: its (last) value, and the string
/// without it. Key-value form: `key = value`, the value a word or single-quoted; URL form: a
/// query parameter.
fn take_conninfo_option(conninfo: &str, key: &str) -> (Option<String>, String) {
    if ["postgresql://", "postgres://"]
        .iter()
        .any(|scheme| conninfo.starts_with(scheme))
    {
        let Some((head, query)) = conninfo.split_once('?') else {
            return (None, conninfo.to_owned());
        };
        let mut value = None;
        let kept: Vec<&str> = query
            .split('&')
            .filter(|kv| match kv.split_once('=') {
                Some((k, v)) if k == key => {
                    value = Some(v.to_owned());
                    false
                }
                _ => true,
            })
            .collect();
        let out = if kept.is_empty() {
            head.to_owned()
        } else {
            format!("{head}?{}", kept.join("&"))
        };
        return (value, out);
    }
    let mut value = None;
    let mut out = String::with_capacity(conninfo.len());
    let mut rest = conninfo;
    while !rest.is_empty() {
        let start = rest.len() - rest.trim_start().len();
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        // One `k = v` pair.
        let key_end = rest
            .find(|c: char| c == '=' || c.is_whitespace())
            .unwrap_or(rest.len());
        let k = &rest[..key_end];
        let after = rest[key_end..].trim_start();
        let Some(v) = after.strip_prefix('=') else {
            out.push_str(rest);
            break;
        };
        let v = v.trim_start();
        let (text, end) = if let Some(quoted) = v.strip_prefix('\'') {
            let mut escaped = false;
            let mut text = String::new();
            let mut close = v.len();
            for (i, c) in quoted.char_indices() {
                if c == '\'' && !escaped {
                    close = i + 2;
                    break;
                }
                escaped = c == '\\' && !escaped;
                if !escaped {
                    text.push(c);
                }
            }
            (text, close)
        } else {
            let end = v.find(char::is_whitespace).unwrap_or(v.len());
            (v[..end].to_owned(), end)
        };
        let pair_len = rest.len() - v.len() + end;
        if k == key {
            value = Some(text);
        } else {
            out.push_str(&rest[..pair_len]);
        }
        rest = &rest[pair_len..];
    }
    (value, out)
}

#[cfg(test)]
mod tests;
