//! The forwarder: ships the outbox ([`crate::store::OutboxDoc`], one entry per commit) to the
//! fleet tier, exactly once: PostgreSQL, or an upstream MQTT broker where a central bucketd
//! merges the deltas.
//!
//! MQTT: each entry is published at QoS 1 to `bucketd/<gateway_id>/deltas` as BSON
//! [`DeltaMessage`]s (split into parts of at most [`DELTA_MESSAGE_BYTES_MAX`]), and acknowledged to
//! the store only once the broker has acknowledged every message of the batch. Each message
//! names its position (database origin, seq, part); a batch sent again (after a crash or a lost
//! connection) repeats positions the central bucketd has applied, and it does not apply them
//! again ([`super::applied`]).
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
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{UpstreamConfig, UpstreamTarget};
use crate::delta::DeltaMessage;
use crate::doc::BucketDoc;
use crate::limits::DELTA_MESSAGE_BYTES_MAX;
use crate::secret::Secret;
use crate::stats::Stats;
use crate::store::{OutboxDoc, OutboxShared, StoreReader};

/// Longest wait for the broker's acknowledgements of one batch.
const PUBACK_TIMEOUT: Duration = Duration::from_secs(30);

/// How often the outbox is looked at when it was empty.
const IDLE_POLL: Duration = Duration::from_millis(500);
/// How often fleet retention (`upstream.postgres_retention`) looks for partitions to drop.
#[cfg(feature = "postgres")]
const RETENTION_EVERY: Duration = Duration::from_hours(1);
/// First wait after a failure; doubles up to `upstream.retry_delay_max`.
const RETRY_MIN: Duration = Duration::from_millis(500);

/// Ships the outbox upstream until cancelled ([`Forwarder::run`]).
pub struct Forwarder {
    pub config: UpstreamConfig,
    pub password: Option<Secret>,
    pub reader: StoreReader,
    pub outbox: Arc<OutboxShared>,
    pub stats: Arc<Stats>,
    /// The store's creation time ([`StoreReader::created_at`]): names this database upstream.
    pub origin: String,
    /// TLS to the upstream broker (`[upstream.mqtt_tls]`), built at start.
    pub tls: Option<crate::mqtt::TlsClientConfig>,
}

/// A connection to the upstream.
enum Sink {
    #[cfg(feature = "postgres")]
    Postgres(Box<super::postgres::FleetDb>),
    Mqtt(rumqttc::AsyncClient, Box<rumqttc::EventLoop>),
}

impl Forwarder {
    fn upstream_name(&self) -> &'static str {
        match self.config.target {
            #[cfg(feature = "postgres")]
            UpstreamTarget::Postgres { .. } => "PostgreSQL",
            UpstreamTarget::Mqtt { .. } => "the upstream MQTT broker",
        }
    }

    pub async fn run(self, cancel: CancellationToken) {
        let mut sink: Option<Sink> = None;
        // The last entry known to be applied upstream (this run).
        let mut applied: Option<u64> = None;
        let mut failures = 0u32;
        // Fleet retention (upstream.postgres_retention): at the first connection, then hourly.
        #[cfg(feature = "postgres")]
        let mut retention_due = tokio::time::Instant::now();
        let name = self.upstream_name();
        info!(gateway_id = %self.config.gateway_id, "Forwarding bucket deltas to {name}.");
        loop {
            let stepped = self.step(&mut sink, &mut applied).await;
            #[cfg(feature = "postgres")]
            if let (Some(Sink::Postgres(db)), Some(retention)) =
                (&sink, self.config.postgres_retention)
                && tokio::time::Instant::now() >= retention_due
            {
                retention_due += RETENTION_EVERY;
                match db.drop_partitions_older_than(retention).await {
                    Ok(0) => {}
                    Ok(n) => info!(
                        partitions = n,
                        "Dropped the month partitions of bucketd_buckets older than \
                         upstream.postgres_retention."
                    ),
                    Err(e) => warn!(
                        error = describe(&e),
                        "Fleet retention failed; retrying in an hour. It drops every \
                         gateway's old months, so only members of the database's maintainer \
                         group may run it (<database>_maintainer): grant that role to this \
                         gateway's (deploy/postgres/roles.sql), or \
                         unset upstream.postgres_retention here and run it from one trusted \
                         role."
                    ),
                }
            }
            let wait = match stepped {
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
                            error = describe(&e),
                            attempt = failures,
                            "Forwarding to {name} failed; the outbox keeps every delta and \
                             retries. Check upstream.{} and that it is reachable{}.",
                            match self.config.target {
                                #[cfg(feature = "postgres")]
                                UpstreamTarget::Postgres { .. } => "postgres",
                                UpstreamTarget::Mqtt { .. } => "mqtt_host",
                            },
                            match self.config.target {
                                UpstreamTarget::Mqtt { .. } => {
                                    ", and that the broker lets this gateway's user publish \
                                     on its own delta topic (a broker ACL denial can close \
                                     the connection)"
                                }
                                #[cfg(feature = "postgres")]
                                UpstreamTarget::Postgres { .. } => "",
                            }
                        );
                    }
                    (RETRY_MIN * 2u32.saturating_pow(failures.min(16) - 1))
                        .min(self.config.retry_delay_max)
                }
            };
            // While idle, an MQTT connection is kept alive (its pings are sent from polls).
            let idle = async {
                if let Some(Sink::Mqtt(_, events)) = &mut sink {
                    let deadline = tokio::time::Instant::now() + wait;
                    while let Ok(event) = tokio::time::timeout_at(deadline, events.poll()).await {
                        if event.is_err() {
                            return true;
                        }
                    }
                    false
                } else {
                    tokio::time::sleep(wait).await;
                    false
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
            #[cfg(feature = "postgres")]
            Sink::Postgres(db) => {
                let retention = self.config.postgres_retention;
                let done = super::postgres::apply(
                    db,
                    &self.config.gateway_id,
                    origin,
                    &entries,
                    retention,
                )
                .await?;
                self.stats
                    .upstream_expired
                    .fetch_add(done.expired, Ordering::Relaxed);
                done.readings
            }
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
        match &self.config.target {
            #[cfg(feature = "postgres")]
            UpstreamTarget::Postgres { conninfo } => {
                let name = format!("bucketd {}", self.config.gateway_id);
                let db =
                    super::postgres::FleetDb::open(conninfo, self.password.as_ref(), name).await?;
                info!("Connected to PostgreSQL.");
                Ok(Sink::Postgres(Box::new(db)))
            }
            UpstreamTarget::Mqtt {
                host,
                port,
                username,
                client_id,
                tls: _,
            } => {
                let mut opts = rumqttc::MqttOptions::new(client_id, host, *port);
                opts.set_transport(crate::mqtt::transport(self.tls.as_ref()))
                    .set_keep_alive(Duration::from_secs(30))
                    .set_clean_session(true)
                    .set_max_packet_size(
                        DELTA_MESSAGE_BYTES_MAX + 4096,
                        DELTA_MESSAGE_BYTES_MAX + 4096,
                    );
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
                Ok(Sink::Mqtt(client, Box::new(events)))
            }
        }
    }
}

/// The messages of one outbox entry: its buckets in parts of at most [`DELTA_MESSAGE_BYTES_MAX`].
fn messages(gateway: &str, origin: &str, entry: &OutboxDoc) -> Vec<Vec<u8>> {
    let encode = |part: i32, buckets: Vec<BucketDoc>| {
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
        if !part.is_empty() && bytes + size > DELTA_MESSAGE_BYTES_MAX - 1024 {
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

/// An error for the log: with a PostgreSQL error in it, the server's SQLSTATE and message
/// (tokio-postgres's own text is only "db error").
fn describe(e: &anyhow::Error) -> String {
    #[cfg(feature = "postgres")]
    return super::postgres::describe_any(e);
    #[cfg(not(feature = "postgres"))]
    format!("{e:#}")
}
