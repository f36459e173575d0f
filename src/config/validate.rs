//! From [`RawConfig`] to [`Config`]: each section checked on its own (`validate_<section>`),
//! then what spans sections; every refusal names its key and what to do.

use std::path::PathBuf;
use std::time::Duration;

use bytesize::ByteSize;

use super::{
    BatchConfig, Checkpoint, Config, ConfigError, DEDUP_WINDOW_MAX, FLUSH_INTERVAL_MAX,
    GatewayLimits, HttpConfig, Limits, MQTT_TLS, MqttConfig, QueryNodeConfig, RawBatch, RawCentral,
    RawConfig, RawHttp, RawLimits, RawLog, RawMqtt, RawQueryNode, RawStore, RawTls, RawUpstream,
    Retention, SESSIONS_MAX, SslMode, StoreConfig, TlsFiles, TlsKeys, UPSTREAM_TLS, UpstreamConfig,
    UpstreamTarget, pg_tls,
};
mod subscription;

use self::subscription::validate_subscriptions;

pub(super) fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

pub(super) fn validate_query_node(raw: &RawQueryNode) -> Result<QueryNodeConfig, ConfigError> {
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

/// Why the central keys of the shared-subscription mode are refused, with what to do instead.
pub(super) const SHARED_CENTRALS_RETIRED: &str = "central instances sharing a subscription are retired: \
     each held part of every bucket in its own file, with no query that merged them \
     (docs/FLEET.md, \"Several centrals\"). A fleet past one central forwards its gateways to \
     PostgreSQL (upstream.target = \"postgres\") and queries it with `bucketd query-node`; or \
     give each central its own gateways' topics (bucketd/site-1/deltas, ...)";

/// Refuses the retired claims keys of `[central]` when they are set.
pub(super) fn validate_central(raw: &RawCentral) -> Result<(), ConfigError> {
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
pub(super) fn valid_host_name(name: &str) -> bool {
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

pub(super) fn validate_gateway_limits(
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

pub(super) fn validate_upstream(raw: &RawUpstream) -> Result<Option<UpstreamConfig>, ConfigError> {
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

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Config, ConfigError> {
        let mqtt = validate_mqtt(&raw.mqtt)?;
        let store = validate_store(&raw.store)?;
        let batch = validate_batch(&raw.batch)?;
        let limits = validate_limits(&raw.limits, &mqtt)?;
        let http = validate_http(&raw.http)?;
        validate_log(&raw.log)?;
        let subscriptions = validate_subscriptions(&raw.subscriptions)?;
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

/// `[batch]`.
pub(super) fn validate_batch(raw: &RawBatch) -> Result<BatchConfig, ConfigError> {
    // Deadlines are instants `flush_interval` ahead: an absurd interval must not overflow them.
    if raw.flush_interval.is_zero() || raw.flush_interval > FLUSH_INTERVAL_MAX {
        return Err(invalid(
            "batch.flush_interval",
            "must be greater than 0 and at most 1d (readings wait that long for a commit)",
        ));
    }
    if raw.max_pending_readings == 0 {
        return Err(invalid("batch.max_pending_readings", "must be at least 1"));
    }
    let batch = BatchConfig {
        flush_interval: raw.flush_interval,
        max_pending_readings: raw.max_pending_readings,
    };
    Ok(batch)
}

/// `[limits]`, against `[mqtt]`'s packet size and windows.
pub(super) fn validate_limits(raw: &RawLimits, mqtt: &MqttConfig) -> Result<Limits, ConfigError> {
    if raw.max_series == 0 {
        return Err(invalid("limits.max_series", "must be at least 1"));
    }
    let max_payload_bytes = usize::try_from(raw.max_payload_bytes.as_u64())
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
    if raw.dedup_window > DEDUP_WINDOW_MAX {
        return Err(invalid(
            "limits.dedup_window",
            "must be at most 1048576 (fingerprints are held in memory, ~40 bytes each)",
        ));
    }
    let redeliverable = usize::from(mqtt.receive_maximum) * usize::from(mqtt.sessions);
    if raw.dedup_window < redeliverable {
        return Err(invalid(
            "limits.dedup_window",
            format!(
                "must be at least mqtt.receive_maximum x mqtt.sessions ({redeliverable}): \
                 every message the broker may redeliver must fit in it"
            ),
        ));
    }
    if raw.max_series_per_sensor == 0 {
        return Err(invalid(
            "limits.max_series_per_sensor",
            "must be at least 1",
        ));
    }
    let limits = Limits {
        max_series: raw.max_series,
        max_series_per_sensor: raw.max_series_per_sensor.min(raw.max_series),
        max_payload_bytes,
        max_age: raw.max_age,
        max_future: raw.max_future,
        dead_letters: raw.dead_letters,
        dedup_window: raw.dedup_window,
    };
    Ok(limits)
}

/// `[http]`.
pub(super) fn validate_http(raw: &RawHttp) -> Result<HttpConfig, ConfigError> {
    let bind = raw.bind.parse().map_err(|_| {
        invalid(
            "http.bind",
            format!(
                "`{}` is not an IP address and port like 127.0.0.1:9470",
                raw.bind
            ),
        )
    })?;
    if raw.max_buckets_per_query == 0 {
        return Err(invalid("http.max_buckets_per_query", "must be at least 1"));
    }
    if raw.max_raw_readings == 0 {
        return Err(invalid("http.max_raw_readings", "must be at least 1"));
    }
    if !(1..=100_000_000).contains(&raw.max_points_per_query) {
        return Err(invalid(
            "http.max_points_per_query",
            "must be 1..=100000000 (an answer of that many points is held in memory)",
        ));
    }
    for (key, value, most) in [
        ("http.max_connections", raw.max_connections, 4096),
        (
            "http.max_concurrent_queries",
            raw.max_concurrent_queries,
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
            raw.header_read_timeout,
            "a slow client's request head, not a query's run time",
        ),
        (
            "http.request_timeout",
            raw.request_timeout,
            "a slow client's request body or unread answer, not a query's run time",
        ),
    ] {
        if !(Duration::from_millis(100)..=Duration::from_mins(5)).contains(&value) {
            return Err(invalid(key, format!("must be 100ms..=5m ({what})")));
        }
    }
    if !(Duration::from_secs(1)..=Duration::from_hours(24)).contains(&raw.lookback) {
        return Err(invalid(
            "http.lookback",
            "must be 1s..=1d (how far back a plain bucketd_reading looks for a reading)",
        ));
    }
    if raw.max_connections_per_address == 0 {
        return Err(invalid(
            "http.max_connections_per_address",
            "must be at least 1",
        ));
    }
    if let Some(bad) = raw.allowed_hosts.iter().find(|h| !valid_host_name(h)) {
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
        token_file: non_empty_path(&raw.token_file),
        metrics_token_file: non_empty_path(&raw.metrics_token_file),
        max_buckets_per_query: raw.max_buckets_per_query,
        max_points_per_query: raw.max_points_per_query,
        max_raw_readings: raw.max_raw_readings,
        max_connections: raw.max_connections,
        max_concurrent_queries: raw.max_concurrent_queries,
        header_read_timeout: raw.header_read_timeout,
        // Within all connections' bound (the smaller of the two).
        max_connections_per_address: raw.max_connections_per_address.min(raw.max_connections),
        request_timeout: raw.request_timeout,
        lookback: raw.lookback,
        allowed_hosts: raw
            .allowed_hosts
            .iter()
            .map(|h| h.to_ascii_lowercase())
            .collect(),
    };
    Ok(http)
}

/// `[log]`.
pub(super) fn validate_log(raw: &RawLog) -> Result<(), ConfigError> {
    if !valid_log_filter(&raw.level) {
        return Err(invalid(
            "log.level",
            format!(
                "`{}` is not a level or filter (error, warn, info, debug, trace)",
                raw.level
            ),
        ));
    }
    Ok(())
}

pub(super) fn validate_mqtt(raw: &RawMqtt) -> Result<MqttConfig, ConfigError> {
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
    let host_id = &raw.sparkplug_host_id;
    if host_id.len() > 64
        || host_id.contains(['/', '+', '#'])
        || host_id.chars().any(char::is_control)
    {
        return Err(invalid(
            "mqtt.sparkplug_host_id",
            "must be at most 64 bytes without '/', '+', '#' or control characters: it is a topic \
             level (spBv1.0/STATE/<host id>); empty publishes no STATE",
        ));
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
        sparkplug_host_id: (!host_id.is_empty()).then(|| host_id.clone()),
    })
}

/// A setting that needs parts this build left out (Cargo features).
pub(super) fn not_built(key: &str, features: &[&str]) -> ConfigError {
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

pub(super) fn non_empty_path(s: &str) -> Option<PathBuf> {
    (!s.is_empty()).then(|| PathBuf::from(s))
}

pub(super) fn validate_tls(raw: &RawTls, keys: TlsKeys) -> Result<Option<TlsFiles>, ConfigError> {
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

/// `store.journal_size`: 0 (no journal), or within the limits (the first start zero-fills it).
fn validate_journal_size(size: ByteSize) -> Result<u64, ConfigError> {
    let bytes = size.as_u64();
    let range = crate::limits::MIN_JOURNAL_BYTES..=crate::limits::MAX_JOURNAL_BYTES;
    if bytes != 0 && !range.contains(&bytes) {
        return Err(invalid(
            "store.journal_size",
            format!(
                "must be 0 (no journal) or from {} to {}",
                ByteSize(*range.start()),
                ByteSize(*range.end())
            ),
        ));
    }
    Ok(bytes)
}

pub(super) fn validate_store(raw: &RawStore) -> Result<StoreConfig, ConfigError> {
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
    Ok(StoreConfig {
        journal_bytes: validate_journal_size(raw.journal_size)?,
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

/// A level (`info`) or a list of directives (`info,bucketd=debug`) with known level names.
pub(super) fn valid_log_filter(filter: &str) -> bool {
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

/// A PostgreSQL connection string's `sslmode` is one bucketd knows, and TLS is built in if it
/// asks for TLS.
pub(super) fn validate_pg_tls(key: &str, conninfo: &str) -> Result<(), ConfigError> {
    let tls = pg_tls(conninfo).map_err(|m| invalid(key, m))?;
    let wants_tls = !matches!(tls.mode, SslMode::Disable | SslMode::Prefer);
    if wants_tls && !cfg!(feature = "tls") {
        return Err(not_built(key, &["tls"]));
    }
    Ok(())
}
