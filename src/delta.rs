//! The delta wire format: what a gateway's forwarder publishes and a central admits.
//! [`DeltaMessage`] (one outbox entry, or one part of a large one, as BSON) and [`Position`]
//! (where a message sits in its gateway's stream). Pure values: no I/O.

use serde::{Deserialize, Serialize};

use crate::doc::BucketDoc;

/// What a gateway's forwarder publishes (`bucketd/<gateway_id>/deltas`): the bucket deltas of
/// one outbox entry (or one part of a large one), BSON.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DeltaMessage {
    pub gateway_id: String,
    /// When the gateway's database was created (RFC 3339): a new database numbers from 0.
    #[serde(default)]
    pub origin: String,
    pub seq: i64,
    /// Part of the entry, from 0 (large entries are split to fit a message).
    pub part: i32,
    pub buckets: Vec<BucketDoc>,
}

/// Where a delta message stands in its gateway's stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Position {
    /// The gateway database's creation time (RFC 3339); empty from gateways before 0.1.
    pub origin: String,
    pub seq: i64,
    pub part: i32,
}

impl Position {
    pub fn encode(&self) -> Vec<u8> {
        bson::serialize_to_vec(self).expect("a Position has only BSON-representable fields")
    }

    pub fn decode(bytes: &[u8]) -> Option<Position> {
        bson::deserialize_from_slice(bytes).ok()
    }

    /// Whether `self` is at or before `other` in the same stream.
    pub fn not_after(&self, other: &Position) -> bool {
        self.same_origin(other) && (self.seq, self.part) <= (other.seq, other.part)
    }

    /// Whether both come from one database; a position without an origin (recorded before
    /// origins existed) is taken for the same.
    pub fn same_origin(&self, other: &Position) -> bool {
        self.origin == other.origin || self.origin.is_empty() || other.origin.is_empty()
    }
}
