//! The forwarder: ships the outbox ([`crate::store::OutboxDoc`], one entry per commit) to the
//! fleet tier, exactly once: PostgreSQL, or an upstream MQTT broker where a central bucketd
//! merges the deltas.
//!
//! MQTT: each entry is published at QoS 1 to `bucketd/<gateway_id>/deltas` as BSON
//! [`DeltaMessage`]s (split into parts of at most [`MESSAGE_BYTES_MAX`]), and acknowledged to
//! the store only once the broker has acknowledged every message of the batch. Each message
//! names its position (database origin, seq, part); a batch sent again (after a crash or a lost
//! connection) repeats positions the central bucketd has applied, and it does not apply them
//! again ([`crate::applied`]).
//!
//! PostgreSQL: each batch of entries is applied in one SQL transaction that first locks the gateway's row in
//! `bucketd_gateways` and reads its `last_seq`, applies only the entries above it (increments
//! with `INSERT ... ON CONFLICT DO UPDATE`; sketches merged here from the locked row), and sets
//! `last_seq` to the batch's last entry. Only after that transaction commits are the entries
//! acknowledged to the store, which trims them at its next commit. A crash or a lost connection
//! anywhere in between means the batch is sent again, and the transaction skips what it already
//! applied. `deploy/postgres/schema.sql` is the schema.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{UpstreamConfig, UpstreamTarget};
use crate::decode::DeltaMessage;
use crate::secret::Secret;
use crate::sketch::Sketch;
use crate::stats::Stats;
use crate::store::{OutboxDoc, OutboxShared, StoreReader};

/// The schema, run (idempotently) at every connection.
pub const SCHEMA: &str = include_str!("../deploy/postgres/schema.sql");

/// Largest delta message: below a central bucketd's default `limits.max_payload_bytes` (64 KiB).
pub const MESSAGE_BYTES_MAX: usize = 48 * 1024;
/// Longest wait for the broker's acknowledgements of one batch.
const PUBACK_TIMEOUT: Duration = Duration::from_secs(30);

/// How often the outbox is looked at when it was empty.
const IDLE_POLL: Duration = Duration::from_millis(500);
/// First wait after a failure; doubles up to `upstream.retry_delay_max`.
const RETRY_MIN: Duration = Duration::from_millis(500);
/// Key of the advisory lock that serialises schema creation between gateways.
const SCHEMA_LOCK: i64 = 0x0062_7563_6b65_7464; // "bucketd" in ASCII

const UPSERT: &str = "
INSERT INTO bucketd_buckets AS t (series, start, gateway_id, sensor, metric, width_secs, count,
    sum, sum_comp, min, max, first_ts_ns, first_value, last_ts_ns, last_value, mean, m2, sketch)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)
ON CONFLICT (series, start) DO UPDATE SET
    count = t.count + excluded.count,
    sum = t.sum + excluded.sum,
    sum_comp = t.sum_comp + excluded.sum_comp,
    min = LEAST(t.min, excluded.min),
    max = GREATEST(t.max, excluded.max),
    first_ts_ns = CASE WHEN (excluded.first_ts_ns, excluded.first_value) < (t.first_ts_ns, t.first_value)
        THEN excluded.first_ts_ns ELSE t.first_ts_ns END,
    first_value = CASE WHEN (excluded.first_ts_ns, excluded.first_value) < (t.first_ts_ns, t.first_value)
        THEN excluded.first_value ELSE t.first_value END,
    last_ts_ns = CASE WHEN (excluded.last_ts_ns, excluded.last_value) > (t.last_ts_ns, t.last_value)
        THEN excluded.last_ts_ns ELSE t.last_ts_ns END,
    last_value = CASE WHEN (excluded.last_ts_ns, excluded.last_value) > (t.last_ts_ns, t.last_value)
        THEN excluded.last_value ELSE t.last_value END,
    mean = t.mean * (t.count::float8 / (t.count + excluded.count))
        + excluded.mean * (excluded.count::float8 / (t.count + excluded.count)),
    m2 = t.m2 + excluded.m2 + (excluded.mean - t.mean) * (excluded.mean - t.mean)
        * (t.count::float8 / (t.count + excluded.count)) * excluded.count,
    sketch = excluded.sketch";

pub struct Forwarder {
    pub config: UpstreamConfig,
    pub password: Option<Secret>,
    pub reader: StoreReader,
    pub outbox: Arc<OutboxShared>,
    pub stats: Arc<Stats>,
    /// The store's creation time ([`StoreReader::created_at`]): names this database upstream.
    pub origin: String,
}

/// A connection to the upstream.
enum Sink {
    Postgres(tokio_postgres::Client),
    Mqtt(rumqttc::AsyncClient, Box<rumqttc::EventLoop>),
}

impl Forwarder {
    fn upstream_name(&self) -> &'static str {
        match self.config.target {
            UpstreamTarget::Postgres { .. } => "PostgreSQL",
            UpstreamTarget::Mqtt { .. } => "the upstream MQTT broker",
        }
    }

    pub async fn run(self, cancel: CancellationToken) {
        let mut sink: Option<Sink> = None;
        // The last entry known to be applied upstream (this run).
        let mut applied: Option<u64> = None;
        let mut failures = 0u32;
        let name = self.upstream_name();
        info!(gateway_id = %self.config.gateway_id, "Forwarding bucket deltas to {name}.");
        loop {
            let wait = match self.step(&mut sink, &mut applied).await {
                Ok(true) => {
                    if failures > 0 {
                        info!("Forwarding to {name} again.");
                    }
                    failures = 0;
                    continue;
                }
                Ok(false) => IDLE_POLL,
                Err(e) => {
                    failures += 1;
                    sink = None;
                    self.stats.upstream_errors.fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .upstream_connected
                        .store(false, Ordering::Relaxed);
                    // The first failure and then every power of two: an outage of hours does not
                    // flood the log, and the operator sees it is still failing.
                    if failures.is_power_of_two() {
                        warn!(
                            error = format!("{e:#}"),
                            attempt = failures,
                            "Forwarding to {name} failed; the outbox keeps every delta and \
                             retries. Check upstream.{} and that it is reachable.",
                            match self.config.target {
                                UpstreamTarget::Postgres { .. } => "postgres",
                                UpstreamTarget::Mqtt { .. } => "mqtt_host",
                            }
                        );
                    }
                    (RETRY_MIN * 2u32.saturating_pow(failures.min(16) - 1))
                        .min(self.config.retry_delay_max)
                }
            };
            // While idle, an MQTT connection is kept alive (its pings are sent from polls).
            let idle = async {
                match &mut sink {
                    Some(Sink::Mqtt(_, events)) => {
                        let deadline = tokio::time::Instant::now() + wait;
                        while let Ok(event) = tokio::time::timeout_at(deadline, events.poll()).await
                        {
                            if event.is_err() {
                                return true;
                            }
                        }
                        false
                    }
                    _ => {
                        tokio::time::sleep(wait).await;
                        false
                    }
                }
            };
            tokio::select! {
                () = cancel.cancelled() => return,
                lost = idle => if lost { sink = None },
            }
        }
    }

    /// Ships one batch; `Ok(false)` when the outbox had nothing to ship.
    async fn step(
        &self,
        sink: &mut Option<Sink>,
        applied: &mut Option<u64>,
    ) -> anyhow::Result<bool> {
        let origin = &self.origin;
        let (reader, outbox) = (self.reader.clone(), self.outbox.clone());
        let (after, max) = (*applied, self.config.batch_entries);
        // Marked as read: an entry may not change once it may have been shipped.
        let entries = tokio::task::spawn_blocking(move || {
            outbox.read_for_shipping(|| reader.outbox(after, max))
        })
        .await??;
        self.report_lag(*applied, entries.first());
        let Some(last) = entries.last() else {
            return Ok(false);
        };
        let upto = u64::try_from(last.seq)?;
        if sink.is_none() {
            *sink = Some(self.connect().await?);
            self.stats.upstream_connected.store(true, Ordering::Relaxed);
        }
        let shipped = match sink.as_mut().expect("connected above") {
            Sink::Postgres(db) => apply(db, &self.config.gateway_id, origin, &entries).await?,
            Sink::Mqtt(client, events) => {
                publish(client, events, &self.config.gateway_id, origin, &entries).await?
            }
        };
        self.outbox.ack(upto);
        *applied = Some(upto);
        self.stats
            .upstream_entries
            .fetch_add(entries.len() as u64, Ordering::Relaxed);
        self.stats
            .upstream_readings
            .fetch_add(shipped, Ordering::Relaxed);
        Ok(true)
    }

    /// Entries not yet forwarded, and the age of the oldest, as gauges.
    fn report_lag(&self, applied: Option<u64>, oldest: Option<&OutboxDoc>) {
        let newest = self.outbox.newest_seq.load(Ordering::Relaxed);
        let entries = self.outbox.entries.load(Ordering::Relaxed);
        let pending = match (oldest, applied) {
            (None, _) => 0,
            (Some(_), Some(a)) => newest.saturating_sub(a),
            (Some(_), None) => entries,
        };
        self.stats
            .upstream_pending_entries
            .store(pending, Ordering::Relaxed);
        let oldest_ns = oldest.map_or(0, |d| d.created_ns);
        self.stats
            .upstream_oldest_pending_ns
            .store(oldest_ns, Ordering::Relaxed);
    }

    async fn connect(&self) -> anyhow::Result<Sink> {
        let conninfo = match &self.config.target {
            UpstreamTarget::Postgres { conninfo } => conninfo,
            UpstreamTarget::Mqtt {
                host,
                port,
                username,
                client_id,
            } => {
                let mut opts = rumqttc::MqttOptions::new(client_id, host, *port);
                opts.set_keep_alive(Duration::from_secs(30))
                    .set_clean_session(true)
                    .set_max_packet_size(MESSAGE_BYTES_MAX + 4096, MESSAGE_BYTES_MAX + 4096);
                if let Some(user) = username {
                    let password = self.password.as_ref().map_or("", |p| p.expose());
                    opts.set_credentials(user, password);
                }
                let (client, mut events) = rumqttc::AsyncClient::new(opts, 1024);
                loop {
                    let event = tokio::time::timeout(PUBACK_TIMEOUT, events.poll()).await??;
                    if let rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_)) = event {
                        break;
                    }
                }
                info!("Connected to the upstream MQTT broker.");
                return Ok(Sink::Mqtt(client, Box::new(events)));
            }
        };
        let name = format!("bucketd {}", self.config.gateway_id);
        let client = connect_postgres(conninfo, self.password.as_ref(), name, SCHEMA).await?;
        info!("Connected to PostgreSQL.");
        Ok(Sink::Postgres(client))
    }
}

/// Connects to PostgreSQL (`conninfo` without the password) and runs `schema`, idempotently,
/// under an advisory lock that serialises it with every other bucketd doing the same.
pub(crate) async fn connect_postgres(
    conninfo: &str,
    password: Option<&Secret>,
    application_name: String,
    schema: &str,
) -> anyhow::Result<tokio_postgres::Client> {
    let mut config: tokio_postgres::Config = conninfo.parse()?;
    if let Some(password) = password {
        config.password(password.expose());
    }
    config.application_name(application_name);
    config.connect_timeout(Duration::from_secs(10));
    let (mut client, connection) = config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "The PostgreSQL connection ended.");
        }
    });
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
        .await?;
    tx.batch_execute(schema).await?;
    tx.commit().await?;
    Ok(client)
}

/// The messages of one outbox entry: its buckets in parts of at most [`MESSAGE_BYTES_MAX`].
fn messages(gateway: &str, origin: &str, entry: &OutboxDoc) -> Vec<Vec<u8>> {
    let encode = |part: i32, buckets: Vec<crate::store::BucketDoc>| {
        bson::serialize_to_vec(&DeltaMessage {
            gateway_id: gateway.to_owned(),
            origin: origin.to_owned(),
            seq: entry.seq,
            part,
            buckets,
        })
        .expect("a DeltaMessage has only BSON-representable fields")
    };
    let mut out = Vec::new();
    let mut part = Vec::new();
    let mut bytes = 0;
    for b in &entry.buckets {
        let size = b.encode().len();
        if !part.is_empty() && bytes + size > MESSAGE_BYTES_MAX - 1024 {
            out.push(encode(out.len() as i32, std::mem::take(&mut part)));
            bytes = 0;
        }
        bytes += size;
        part.push(b.clone());
    }
    if !part.is_empty() || out.is_empty() {
        out.push(encode(out.len() as i32, part));
    }
    out
}

/// Publishes the entries at QoS 1 and waits for every PUBACK; returns the readings they hold.
async fn publish(
    client: &rumqttc::AsyncClient,
    events: &mut rumqttc::EventLoop,
    gateway: &str,
    origin: &str,
    entries: &[OutboxDoc],
) -> anyhow::Result<u64> {
    let topic = format!("bucketd/{gateway}/deltas");
    let payloads: Vec<Vec<u8>> = entries
        .iter()
        .flat_map(|e| messages(gateway, origin, e))
        .collect();
    let sent = payloads.len();
    // Published from a task of its own while this one polls: the client's request queue is
    // bounded, and only polling the event loop empties it.
    let publisher = {
        let client = client.clone();
        tokio::spawn(async move {
            for payload in payloads {
                client
                    .publish(&topic, rumqttc::QoS::AtLeastOnce, false, payload)
                    .await?;
            }
            Ok::<(), rumqttc::ClientError>(())
        })
    };
    let deadline = tokio::time::Instant::now() + PUBACK_TIMEOUT;
    let mut acked = 0;
    let polled = async {
        while acked < sent {
            let event = tokio::time::timeout_at(deadline, events.poll()).await??;
            if let rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_)) = event {
                acked += 1;
            }
        }
        Ok::<(), anyhow::Error>(())
    }
    .await;
    if polled.is_err() {
        publisher.abort();
    }
    polled?;
    publisher.await??;
    Ok(entries.iter().map(OutboxDoc::readings).sum())
}

/// Applies the entries above the gateway's `last_seq` in one transaction; returns the readings
/// they represent (0 for a batch that was already applied).
async fn apply(
    db: &mut tokio_postgres::Client,
    gateway: &str,
    origin: &str,
    entries: &[OutboxDoc],
) -> anyhow::Result<u64> {
    let tx = db.transaction().await?;
    tx.execute(
        "INSERT INTO bucketd_gateways (gateway_id, last_seq) VALUES ($1, -1)
         ON CONFLICT (gateway_id) DO NOTHING",
        &[&gateway],
    )
    .await?;
    let row = tx
        .query_one(
            "SELECT last_seq, origin FROM bucketd_gateways WHERE gateway_id = $1 FOR UPDATE",
            &[&gateway],
        )
        .await?;
    let (mut last, stored_origin): (i64, String) = (row.get(0), row.get(1));
    // A replaced database numbers its entries from the start again (see `crate::applied`).
    if !stored_origin.is_empty() && stored_origin != origin {
        warn!(
            gateway,
            was = %stored_origin,
            now = %origin,
            "PostgreSQL holds this gateway's deltas from another database; applying this one's \
             from its start. If two gateways share this id, give each its own upstream.gateway_id."
        );
        last = -1;
    }
    let lock = tx
        .prepare("SELECT sketch FROM bucketd_buckets WHERE series = $1 AND start = $2 FOR UPDATE")
        .await?;
    let upsert = tx.prepare(UPSERT).await?;
    let mut readings = 0;
    for entry in entries.iter().filter(|e| e.seq > last) {
        for b in &entry.buckets {
            let series = format!("{gateway}:{}", b.series);
            let start = UNIX_EPOCH + Duration::from_secs(u64::try_from(b.start)?);
            let sketch = match tx.query_opt(&lock, &[&series, &start]).await? {
                Some(row) => merged_sketch(row.get(0), &b.sketch),
                None => b.sketch.clone(),
            };
            let width = i32::try_from(b.end - b.start)?;
            tx.execute(
                &upsert,
                &[
                    &series,
                    &start,
                    &gateway,
                    &b.sensor,
                    &b.metric,
                    &width,
                    &b.count,
                    &b.sum,
                    &b.sum_comp,
                    &b.min,
                    &b.max,
                    &b.first.ts,
                    &b.first.value,
                    &b.last.ts,
                    &b.last.value,
                    &b.mean,
                    &b.m2,
                    &sketch,
                ],
            )
            .await?;
            readings += u64::try_from(b.count)?;
        }
    }
    let upto = entries.last().map_or(last, |e| e.seq);
    if upto > last {
        tx.execute(
            "UPDATE bucketd_gateways SET last_seq = $2, origin = $3, updated_at = now()
             WHERE gateway_id = $1",
            &[&gateway, &upto, &origin],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(readings)
}

/// The stored sketch merged with a delta's; an unreadable stored one is replaced (its
/// quantiles were unknown anyway), an unreadable delta leaves the stored one.
fn merged_sketch(stored: &[u8], delta: &[u8]) -> Vec<u8> {
    match (Sketch::decode(stored), Sketch::decode(delta)) {
        (Some(mut s), Some(d)) => {
            s.merge(&d);
            s.encode()
        }
        (None, _) => delta.to_vec(),
        (Some(_), None) => stored.to_vec(),
    }
}

/// Seconds since `ns` (nanoseconds since the epoch); 0 for 0.
pub fn age_secs(ns: i64) -> f64 {
    if ns == 0 {
        return 0.0;
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    (now - ns).max(0) as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_sketch_holds_both_and_survives_a_damaged_side() {
        let params = crate::sketch::SketchParams::DEFAULT;
        let mut a = Sketch::new(params);
        let mut b = Sketch::new(params);
        for v in 1..=50 {
            a.add(f64::from(v));
            b.add(f64::from(v + 50));
        }
        let merged = Sketch::decode(&merged_sketch(&a.encode(), &b.encode())).unwrap();
        let mut want = a.clone();
        want.merge(&b);
        assert_eq!(merged.encode(), want.encode());
        assert_eq!(merged_sketch(b"junk", &b.encode()), b.encode());
        assert_eq!(merged_sketch(&a.encode(), b"junk"), a.encode());
    }
}
