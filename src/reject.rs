//! Why a message or a reading was refused: [`DecodeError`], whose reason strings are the bounded
//! `reason` label of `bucketd_readings_rejected_total`. Pure; every layer above may name it.

/// Why a message or a reading was not ingested. The reason string is a bounded metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum DecodeError {
    #[error("empty payload")]
    EmptyPayload,
    #[error("payload larger than limits.max_payload_bytes")]
    PayloadTooLarge,
    #[error("topic does not match the subscription's template")]
    TopicMismatch,
    #[error("topic or payload is not valid UTF-8")]
    InvalidUtf8,
    #[error(
        "sensor or metric name is empty, longer than 128 bytes, or has control characters or '/'"
    )]
    InvalidName,
    #[error("payload is not a number")]
    InvalidNumber,
    #[error("payload is not valid JSON")]
    InvalidJson,
    #[error("JSON payload is not an object or an array of objects")]
    NotAnObject,
    #[error("message carries no numeric reading")]
    NoReadings,
    #[error("value is NaN or infinite")]
    NonFinite,
    #[error("timestamp is not a number or an RFC 3339 time")]
    InvalidTimestamp,
    #[error("timestamp is older than limits.max_age or beyond limits.max_future")]
    TimestampOutOfRange,
    #[error("limits.max_series reached; new series are refused")]
    SeriesLimit,
    #[error(
        "limits.max_series_per_sensor reached for this sensor; its new series are refused \
         (others' are not)"
    )]
    SensorLimit,
    #[error("payload is not a bucketd delta message (BSON with gateway_id, seq and buckets)")]
    InvalidDelta,
    #[error(
        "delta bucket width does not divide store.bucket_width (a gateway's buckets fold into a \
         central's wider ones, never into narrower ones): make the central's width a multiple \
         of the gateways'"
    )]
    BucketWidthMismatch,
    #[error(
        "the delta message's gateway_id is not the gateway its topic names \
         (bucketd/{{gateway}}/deltas): a publisher may only write as the gateway of its topic"
    )]
    GatewayMismatch,
    #[error(
        "a gateway's limit at this central (central.max_series_per_gateway or \
         central.max_buckets_per_message) reached; raise it if the gateway needs more"
    )]
    GatewayLimit,
    #[error(
        "a delta message's position jumps further past the last one applied from its gateway's \
         database than central.max_position_jump: no gateway's outbox could have sent it (if \
         this gateway's upstream.outbox_max_entries is larger, raise central.max_position_jump \
         to match)"
    )]
    PositionJump,
    #[error(
        "a line of InfluxDB line protocol is malformed (measurement[,tag=value] field=value \
         [timestamp]); the message's other lines are kept"
    )]
    InvalidLine,
    #[error(
        "a SenML record is not an object, has a field of the wrong type or an unknown \
         must-understand field (RFC 8428), or the pack is not an array; the other records are kept"
    )]
    InvalidSenml,
    #[error(
        "payload is not a Sparkplug B message bucketd reads (Eclipse Tahu's protobuf, not \
         compressed, at most 10,000 metrics), or its topic is not spBv1.0/<group>/<type>/<edge \
         node>[/<device>]"
    )]
    InvalidSparkplug,
    #[error(
        "a Sparkplug metric named by an alias no BIRTH of its edge node defined since bucketd \
         started: bucketd asked the edge node for a rebirth (NCMD Node Control/Rebirth)"
    )]
    UnknownAlias,
    #[error(
        "a Sparkplug metric that is null, a string, bytes, a date, a dataset or a template: \
         only numbers and booleans are readings"
    )]
    NotNumeric,
    #[error(
        "a Sparkplug DBIRTH (or NBIRTH) gives an alias that already names another metric of \
         its edge node (aliases are unique across a node and its devices); the birth's metrics \
         are refused, and bucketd asks for a rebirth when its DATA names them"
    )]
    AliasConflict,
    #[error(
        "a Sparkplug metric named by an alias whose birth did not fit: the edge node's share \
         of the birth store (limits: 4,000 names and aliases a node, 20,000 and 1,000 nodes in \
         all) is used; the node's other metrics and every other node's are read"
    )]
    BirthStoreFull,
    #[error(
        "a Sparkplug NDEATH whose bdSeq is not the edge node's current NBIRTH's (an old \
         session's death certificate, delivered late): ignored, the node stays online"
    )]
    StaleDeath,
}

impl DecodeError {
    /// Every variant, in a fixed order (the index of a variant is its counter slot).
    pub const ALL: [DecodeError; 27] = [
        DecodeError::EmptyPayload,
        DecodeError::PayloadTooLarge,
        DecodeError::TopicMismatch,
        DecodeError::InvalidUtf8,
        DecodeError::InvalidName,
        DecodeError::InvalidNumber,
        DecodeError::InvalidJson,
        DecodeError::NotAnObject,
        DecodeError::NoReadings,
        DecodeError::NonFinite,
        DecodeError::InvalidTimestamp,
        DecodeError::TimestampOutOfRange,
        DecodeError::SeriesLimit,
        DecodeError::InvalidDelta,
        DecodeError::BucketWidthMismatch,
        DecodeError::GatewayMismatch,
        DecodeError::GatewayLimit,
        DecodeError::SensorLimit,
        DecodeError::PositionJump,
        DecodeError::InvalidLine,
        DecodeError::InvalidSenml,
        DecodeError::InvalidSparkplug,
        DecodeError::UnknownAlias,
        DecodeError::NotNumeric,
        DecodeError::AliasConflict,
        DecodeError::BirthStoreFull,
        DecodeError::StaleDeath,
    ];

    /// The metric label value.
    pub fn reason(self) -> &'static str {
        match self {
            DecodeError::EmptyPayload => "empty_payload",
            DecodeError::PayloadTooLarge => "payload_too_large",
            DecodeError::TopicMismatch => "topic_mismatch",
            DecodeError::InvalidUtf8 => "invalid_utf8",
            DecodeError::InvalidName => "invalid_name",
            DecodeError::InvalidNumber => "invalid_number",
            DecodeError::InvalidJson => "invalid_json",
            DecodeError::NotAnObject => "not_an_object",
            DecodeError::NoReadings => "no_readings",
            DecodeError::NonFinite => "non_finite",
            DecodeError::InvalidTimestamp => "invalid_timestamp",
            DecodeError::TimestampOutOfRange => "timestamp_out_of_range",
            DecodeError::SeriesLimit => "series_limit",
            DecodeError::InvalidDelta => "invalid_delta",
            DecodeError::BucketWidthMismatch => "bucket_width_mismatch",
            DecodeError::GatewayMismatch => "gateway_mismatch",
            DecodeError::GatewayLimit => "gateway_limit",
            DecodeError::SensorLimit => "sensor_limit",
            DecodeError::PositionJump => "position_jump",
            DecodeError::InvalidLine => "invalid_line",
            DecodeError::InvalidSenml => "invalid_senml",
            DecodeError::InvalidSparkplug => "invalid_sparkplug",
            DecodeError::UnknownAlias => "unknown_alias",
            DecodeError::NotNumeric => "not_numeric",
            DecodeError::AliasConflict => "alias_conflict",
            DecodeError::BirthStoreFull => "birth_store_full",
            DecodeError::StaleDeath => "stale_death",
        }
    }

    pub fn index(self) -> usize {
        DecodeError::ALL
            .iter()
            .position(|e| *e == self)
            .expect("ALL lists every variant")
    }
}
