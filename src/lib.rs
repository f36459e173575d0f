//! bucketd: an MQTT time-series ingestion daemon for edge gateways. Devices publish readings to a
//! broker; bucketd folds them into hourly bucket summaries and keeps them in a redb file,
//! acknowledging each message only once its readings are durable.
//!
//! # Layout
//! - [`config`]: layered configuration, `RawConfig` -> validated `Config`.
//! - [`reading`]: `Timestamp`, `Reading`, series names. Pure.
//! - [`decode`]: (topic, payload) -> readings or rejections with a reason. Pure.
//! - [`summary`]: `Summary` and its merge (a commutative monoid). Pure.
//! - [`batcher`]: the open batch and the flush policy. Pure.
//! - [`series`]: the bounded set of known series names. Pure.
//! - [`store`]: the redb file; the only importer of redb.
//! - [`writer`]: the writer thread; the only place that commits.
//! - [`mqtt`], [`ack`]: the rumqttc client (v5 / v3.1.1) and acknowledgement tokens.
//! - [`ingest`]: the MQTT loop: decode, batch, hand over, acknowledge after commit.
//! - [`rollup`]: hourly buckets merged into day/week windows for queries. Pure.
//! - [`stats`]: counters and gauges; [`metrics`]: their Prometheus rendering.
//! - [`http`]: the HTTP server (metrics, health, query API); [`export`]: JSON/CSV formatting.
//! - [`secret`], [`tls`]: secrets read from files (`$CREDENTIALS_DIRECTORY`) and the rustls
//!   client configuration.
//! - [`daemon`]: wiring and shutdown order.
//!
//! # Data flow
//! broker -> `ingest` (decode, `Batcher::push`) -> `writer` (`Store::commit`: one durable
//! upsert-and-increment transaction) -> `ingest` (PUBACKs in arrival order).

pub mod ack;
pub mod applied;
pub mod batcher;
pub mod claims;
pub mod config;
pub mod daemon;
pub mod decode;
pub mod dedup;
pub mod export;
pub mod http;
pub mod ingest;
pub mod metrics;
pub mod mqtt;
pub mod notify;
pub mod page;
pub mod query;
pub mod reading;
pub mod rollup;
pub mod secret;
pub mod series;
pub mod sketch;
pub mod stats;
pub mod store;
pub mod summary;
pub mod tls;
pub mod upstream;
pub mod writer;
