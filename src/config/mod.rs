//! Configuration: layered loading (built-in defaults, `--config FILE`, `BUCKETD__SECTION__KEY`
//! environment variables) into [`RawConfig`], then validation into the typed [`Config`] the rest
//! of the daemon uses. Knows nothing about MQTT sockets or redb files beyond their settings.
//!
//! `config/default.toml` is compiled in and is the defaults layer, so the documented defaults and
//! the real ones cannot drift apart.

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use crate::decode::Subscription;

mod raw;
mod validate;

pub use self::raw::*;

/// The defaults layer: `config/default.toml`, verbatim.
pub const DEFAULT_TOML: &str = include_str!("../../config/default.toml");

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
    /// How far back a plain `bucketd_reading` selector of the Prometheus API looks for a raw
    /// reading (Prometheus's look-back delta).
    pub lookback: Duration,
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
    /// The Sparkplug host id bucketd publishes its STATE as (`mqtt.sparkplug_host_id`), when
    /// it is a primary host for edge nodes that wait for one.
    pub sparkplug_host_id: Option<String>,
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

/// The template of a delta subscription without one: where a gateway's forwarder publishes.
pub const DELTA_TEMPLATE: &str = "bucketd/{gateway}/deltas";

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

pub use crate::conninfo::{PgTls, SslMode, pg_tls, redact as redact_conninfo};

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

#[cfg(test)]
mod tests;
