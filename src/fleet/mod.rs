//! The fleet tier: what carries a gateway's buckets beyond it, and what a central does with
//! them. Attached to the edge pipeline at two seams only, and the edge never imports it:
//! - **the outbox** ([`crate::store::OutboxShared`]): every commit also records its per-bucket
//!   deltas; the [`forwarder`] ships them to PostgreSQL ([`postgres`]) or an upstream broker and
//!   acknowledges them back to the store;
//! - **the admission of a delta message** ([`crate::admit::DeltaLedger`]): a central asks
//!   [`applied`] whether a message was applied already.
//!
//! And one more way in, for queries: a query node's [`reader`] implements
//! [`crate::source::BucketSource`] over the fleet's PostgreSQL.

#[cfg(feature = "central")]
pub mod applied;
pub mod forwarder;
#[cfg(all(feature = "postgres", feature = "tls"))]
pub mod pg_tls;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "postgres")]
pub mod reader;
