//! bucketd: an MQTT time-series ingestion daemon for edge gateways. Devices publish readings to a
//! broker; bucketd folds them into hourly bucket summaries and keeps them in a redb file,
//! acknowledging each message only once its readings are durable; optionally it forwards the
//! buckets' deltas to a fleet tier. ARCHITECTURE.md has the picture; the layers below are
//! checked by `tests/it/layers.rs` (each module imports only from the ones above it in this list).
//!
//! # Layout
//! Pure values and logic:
//! - [`reject`]: why a message or reading was refused (`DecodeError`, the metric reasons).
//! - [`ack`]: what a PUBACK needs. [`dedup`]: message fingerprints and the recent window.
//!   [`resend`]: a reconnect's resends told from new messages by their order.
//! - [`sketch`]: the quantile sketch. [`page`]: the raw page codec.
//! - [`limits`]: bounds that depend on each other, asserted together.
//! - [`reading`]: `Timestamp`, `Reading`, series names. [`summary`]: `Summary` and its merge.
//! - [`series`]: the bounded set of known series names.
//! - [`doc`]: the stored documents. [`delta`]: the delta wire format (`DeltaMessage`, `Position`).
//! - [`decode`]: (topic, payload) -> readings or rejections with a reason.
//! - [`batcher`]: the open batch and the flush policy. [`config`]: `RawConfig` -> `Config`.
//! - [`admit`]: what one message becomes (decode, redelivery, width folding, interning).
//! - [`rollup`]: buckets merged into day/week windows. [`export`]: JSON/CSV formatting.
//! - `promql` (feature `ui`): the PromQL subset of the Prometheus query API, over buckets.
//!
//! Shells and tasks:
//! - [`stats`]: counters and gauges; [`metrics`]: their Prometheus rendering. [`stop`]: a
//!   signal's stop request, for the start-up's long work.
//! - [`secret`], `tls` (feature `tls`): secrets from files, the rustls client configuration.
//! - [`mqtt`]: the rumqttc client (v5 / v3.1.1). [`notify`]: systemd notifications.
//! - [`store`]: the redb file; the only importer of redb. [`query`]: `bucketd query`.
//! - [`source`]: what queries read (the store, or a query node's PostgreSQL attached by the
//!   fleet tier).
//! - [`writer`]: the writer thread; the only place that commits.
//! - `prom` (feature `ui`): the Prometheus HTTP API under `/prom` (for Grafana). `chart`
//!   (feature `ui`): the chart page at `/`. [`http`]: metrics, health and the query APIs.
//! - [`ingest`]: the MQTT loop: admit, batch, hand over, acknowledge after commit.
//! - [`fleet`]: forwarder, PostgreSQL, applied positions, the query node's reader
//!   (attached by `daemon` and `main` only).
//! - [`daemon`]: wiring and shutdown order.
//!
//! # Data flow
//! Edge: broker -> `ingest` (`Admitter::admit`, `Batcher::push_*`) -> `writer` (`Store::commit`:
//! one durable transaction with buckets, pages, fingerprints, positions and the outbox entry) ->
//! `ingest` (PUBACKs in arrival order).
//! Fleet: store outbox -> `fleet::forwarder` -> PostgreSQL (`fleet::postgres`, once by
//! `last_seq`) or an upstream broker -> a central's `ingest` (`format = "delta"`: admitted once
//! by position, `fleet::applied`) -> its own commit and PUBACKs.
//! Queries of the fleet: `bucketd query-node` -> `fleet::reader` (PostgreSQL) behind `http`.

pub mod ack;
pub mod admit;
#[cfg(test)]
mod alloc_count;
pub mod batcher;
#[cfg(feature = "ui")]
pub mod chart;
pub mod commitlog;
pub mod config;
pub mod conninfo;
pub mod daemon;
pub mod decode;
pub mod dedup;
pub mod delta;
pub mod doc;
pub mod export;
pub mod fleet;
pub mod http;
pub mod ingest;
pub mod limits;
pub mod link;
#[cfg(test)]
mod log_count;
pub mod metrics;
pub mod mqtt;
pub mod notify;
pub mod page;
#[cfg(feature = "ui")]
pub mod prom;
#[cfg(feature = "ui")]
pub mod promql;
pub mod query;
pub mod reading;
pub mod reject;
pub mod resend;
pub mod rollup;
pub mod secret;
pub mod series;
pub mod sketch;
pub mod source;
pub mod stats;
pub mod stop;
pub mod store;
pub mod summary;
#[cfg(test)]
mod test_rng;
#[cfg(feature = "tls")]
pub mod tls;
pub mod writer;
