//! Claims: central instances that split delta messages with a shared subscription agree, in
//! PostgreSQL, which of them applies each message (`[central] claims_postgres`).
//!
//! Each instance applies a gateway's message at most once by its position ([`super::applied`]),
//! but a broker that hands a shared group's messages out round-robin can give a gateway's resend
//! (its PUBACK was lost) to an instance that did not apply the original. So before applying a
//! delta message an instance claims its `(gateway_id, origin, seq, part)` in `bucketd_claims`
//! (`deploy/postgres/claims.sql`): the first claim wins, and a message claimed by another
//! instance is a copy, acknowledged and not applied. Claiming again what it claimed itself
//! succeeds, so an instance that claimed, crashed before its commit and gets the broker's
//! redelivery (its session keeps it) applies it then. Nothing else is coordinated: each
//! instance's buckets stay its own.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::ClaimsConfig;
use crate::delta::Position;
use crate::ingest::ClaimRequest;
use crate::limits::{CLAIM_RETRY_MAX, CLAIM_TIMEOUT};
use crate::secret::Secret;
use crate::stats::Stats;

/// The schema, run (idempotently) at every connection.
pub const SCHEMA: &str = include_str!("../../deploy/postgres/claims.sql");

/// Claims first, then whichever instance holds the claim. Both parts read one snapshot, so
/// when another instance's claim committed while this statement ran, no row comes back: ask
/// again.
const CLAIM: &str = "
WITH mine AS (
    INSERT INTO bucketd_claims (gateway_id, origin, seq, part, instance)
    VALUES ($1, $2, $3, $4, $5)
    ON CONFLICT DO NOTHING
    RETURNING instance
)
SELECT instance FROM mine
UNION ALL
SELECT instance FROM bucketd_claims
WHERE gateway_id = $1 AND origin = $2 AND seq = $3 AND part = $4";

/// Every this many sequence numbers of a gateway, its old claims are deleted.
const TRIM_EVERY: i64 = 256;

/// Claims of a gateway's other databases are deleted once this old: a gateway resends only its
/// newest forwarding batch, within minutes; a week covers a central's long outage.
pub const CLAIMS_AGE_MAX: &str = "7 days";

/// Answers the ingest loop's claim requests until it stops sending them or `cancel`. While the
/// claims database is unreachable, the request waits and is tried again (at most
/// [`CLAIM_RETRY_MAX`] apart); the ingest loop meanwhile reads nothing from the broker, which
/// keeps the delta messages, but goes on committing, acknowledging and answering systemd.
pub async fn serve(
    mut claims: Claims,
    mut requests: mpsc::Receiver<ClaimRequest>,
    stats: Arc<Stats>,
    cancel: CancellationToken,
) {
    while let Some(request) = tokio::select! {
        () = cancel.cancelled() => None,
        r = requests.recv() => r,
    } {
        let mut failures = 0u32;
        let mine = loop {
            let attempt = tokio::select! {
                () = cancel.cancelled() => return,
                r = claims.claim(&request.gateway, &request.at) => r,
            };
            match attempt {
                Ok(mine) => break mine,
                Err(e) => {
                    failures += 1;
                    stats.claim_errors.fetch_add(1, Ordering::Relaxed);
                    if failures.is_power_of_two() {
                        warn!(
                            error = format!("{e:#}"),
                            attempt = failures,
                            "Cannot claim a delta message in PostgreSQL; delta messages wait \
                             (the broker keeps them) until it answers. Check \
                             central.claims_postgres and that the database is reachable."
                        );
                    }
                    let delay = Duration::from_millis(100)
                        .saturating_mul(2u32.saturating_pow(failures.min(9)))
                        .min(CLAIM_RETRY_MAX);
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        };
        if failures > 0 {
            info!("Claiming delta messages again.");
        }
        if !mine {
            stats.claimed_elsewhere.fetch_add(1, Ordering::Relaxed);
        }
        // The ingest loop may have stopped meanwhile; it then does not need the answer.
        let _ = request.reply.send(!mine);
    }
}

pub struct Claims {
    config: ClaimsConfig,
    password: Option<Secret>,
    /// This instance: its `mqtt.client_id`.
    instance: String,
    connection: Option<(tokio_postgres::Client, tokio_postgres::Statement)>,
}

impl Claims {
    pub fn new(config: ClaimsConfig, password: Option<Secret>, instance: String) -> Claims {
        Claims {
            config,
            password,
            instance,
            connection: None,
        }
    }

    /// Whether this instance is the one to apply the message at `at` from `gateway`.
    pub async fn claim(&mut self, gateway: &str, at: &Position) -> anyhow::Result<bool> {
        // A connection that went silent (no reset) must not hold the ingest loop for ever.
        let result = tokio::time::timeout(CLAIM_TIMEOUT, self.try_claim(gateway, at))
            .await
            .unwrap_or_else(|_| {
                Err(anyhow::anyhow!(
                    "no answer from the claims database within {CLAIM_TIMEOUT:?}"
                ))
            });
        if result.is_err() {
            self.connection = None;
        }
        result
    }

    async fn try_claim(&mut self, gateway: &str, at: &Position) -> anyhow::Result<bool> {
        if self.connection.is_none() {
            self.connection = Some(self.connect().await?);
        }
        let (client, claim) = self.connection.as_ref().expect("connected above");
        let owner = loop {
            let row = client
                .query_opt(
                    claim,
                    &[&gateway, &at.origin, &at.seq, &at.part, &self.instance],
                )
                .await?;
            if let Some(row) = row {
                break row.get::<_, String>(0);
            }
        };
        if at.part == 0 && at.seq % TRIM_EVERY == 0 {
            // Saturating: a position is checked (seq >= 0) before it is claimed, but a wrap
            // here would delete every claim of the gateway. A message trims only its own
            // database's claims: a forged origin deleted the real one's (issue 41). Other
            // databases' claims go once they are older than any resend ([`CLAIMS_AGE_MAX`]).
            let below = at.seq.saturating_sub(i64::from(self.config.keep_entries));
            client
                .execute(
                    "DELETE FROM bucketd_claims WHERE gateway_id = $1 AND ((origin = $2 AND \
                     seq < $3) OR (origin <> $2 AND claimed_at < now() - $4::text::interval))",
                    &[&gateway, &at.origin, &below, &CLAIMS_AGE_MAX],
                )
                .await?;
        }
        Ok(owner == self.instance)
    }

    async fn connect(&self) -> anyhow::Result<(tokio_postgres::Client, tokio_postgres::Statement)> {
        let name = format!("bucketd central {}", self.instance);
        let client =
            super::postgres::connect(&self.config.conninfo, self.password.as_ref(), name, SCHEMA)
                .await?;
        let claim = client.prepare(CLAIM).await?;
        info!("Connected to the claims database (central.claims_postgres).");
        Ok((client, claim))
    }
}
