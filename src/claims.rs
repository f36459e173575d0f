//! Claims: central instances that split delta messages with a shared subscription agree, in
//! PostgreSQL, which of them applies each message (`[central] claims_postgres`).
//!
//! Each instance applies a gateway's message at most once by its position ([`crate::applied`]),
//! but a broker that hands a shared group's messages out round-robin can give a gateway's resend
//! (its PUBACK was lost) to an instance that did not apply the original. So before applying a
//! delta message an instance claims its `(gateway_id, origin, seq, part)` in `bucketd_claims`
//! (`deploy/postgres/claims.sql`): the first claim wins, and a message claimed by another
//! instance is a copy, acknowledged and not applied. Claiming again what it claimed itself
//! succeeds, so an instance that claimed, crashed before its commit and gets the broker's
//! redelivery (its session keeps it) applies it then. Nothing else is coordinated: each
//! instance's buckets stay its own.

use std::time::Duration;

use tracing::info;

use crate::applied::Position;
use crate::config::ClaimsConfig;
use crate::secret::Secret;

/// The schema, run (idempotently) at every connection.
pub const SCHEMA: &str = include_str!("../deploy/postgres/claims.sql");

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

/// Longest wait for one claim (connecting included).
const CLAIM_TIMEOUT: Duration = Duration::from_secs(15);

/// Every this many sequence numbers of a gateway, its old claims are deleted.
const TRIM_EVERY: i64 = 256;

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
            let below = at.seq - i64::from(self.config.keep_entries);
            client
                .execute(
                    "DELETE FROM bucketd_claims WHERE gateway_id = $1 AND (origin <> $2 OR seq < $3)",
                    &[&gateway, &at.origin, &below],
                )
                .await?;
        }
        Ok(owner == self.instance)
    }

    async fn connect(&self) -> anyhow::Result<(tokio_postgres::Client, tokio_postgres::Statement)> {
        let name = format!("bucketd central {}", self.instance);
        let client = crate::upstream::connect_postgres(
            &self.config.conninfo,
            self.password.as_ref(),
            name,
            SCHEMA,
        )
        .await?;
        let claim = client.prepare(CLAIM).await?;
        info!("Connected to the claims database (central.claims_postgres).");
        Ok((client, claim))
    }
}
