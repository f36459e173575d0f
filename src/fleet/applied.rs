//! Applying each gateway's delta messages once at a central instance (`format = "delta"`).
//!
//! A gateway's forwarder numbers its outbox entries with an increasing sequence number and
//! publishes them in order, each split into parts numbered from 0 (`fleet::forwarder`); a copy
//! (a resend after a lost PUBACK, a redelivery after a crash) repeats a position the central
//! has seen. The central keeps, per gateway, the last position it applied, in the same redb
//! transaction as the buckets the message changed ([`crate::store`]): a message at or below it
//! is a copy, acknowledged and not applied, however long after the original it arrives.
//!
//! A position also names its *origin*, the gateway database's creation time: a gateway whose
//! database was replaced (a new SD card) numbers from the start again, and its messages are
//! new, not copies.
//!
//! Bounded by the number of gateways, each of which holds at least one series
//! (`limits.max_series`).

use std::collections::HashMap;

use tracing::warn;

use crate::admit::DeltaLedger;
use crate::delta::Position;

/// The last position applied per gateway.
#[derive(Debug, Default)]
pub struct Applied {
    by_gateway: HashMap<String, Position>,
}

impl Applied {
    pub fn new(stored: impl IntoIterator<Item = (String, Position)>) -> Applied {
        Applied {
            by_gateway: stored.into_iter().collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.by_gateway.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_gateway.is_empty()
    }
}

impl DeltaLedger for Applied {
    /// Whether the message at `at` from `gateway` was applied already.
    fn contains(&self, gateway: &str, at: &Position) -> bool {
        self.by_gateway
            .get(gateway)
            .is_some_and(|last| at.not_after(last))
    }

    /// Records that the message at `at` from `gateway` is applied.
    fn insert(&mut self, gateway: &str, at: Position) {
        match self.by_gateway.get_mut(gateway) {
            Some(last) => {
                if !last.same_origin(&at) {
                    warn!(
                        gateway,
                        was = %last.origin,
                        now = %at.origin,
                        "A gateway's deltas now come from another database (a new one numbers \
                         its entries from the start). If two gateways share this id, give each \
                         its own upstream.gateway_id: their deltas cannot be told apart."
                    );
                }
                *last = at;
            }
            None => {
                self.by_gateway.insert(gateway.to_owned(), at);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(origin: &str, seq: i64, part: i32) -> Position {
        Position {
            origin: origin.into(),
            seq,
            part,
        }
    }

    #[test]
    fn a_position_at_or_before_the_last_applied_is_a_copy_per_gateway_and_origin() {
        let mut a = Applied::default();
        assert!(!a.contains("g1", &at("o", 1, 0)));
        a.insert("g1", at("o", 5, 1));
        assert!(a.contains("g1", &at("o", 5, 1)));
        assert!(a.contains("g1", &at("o", 5, 0)));
        assert!(a.contains("g1", &at("o", 2, 7)));
        assert!(!a.contains("g1", &at("o", 5, 2)));
        assert!(!a.contains("g1", &at("o", 6, 0)));
        assert!(!a.contains("g2", &at("o", 1, 0)));
        // A replaced database numbers from the start again.
        assert!(!a.contains("g1", &at("p", 1, 0)));
        a.insert("g1", at("p", 1, 0));
        assert!(a.contains("g1", &at("p", 1, 0)));
        assert!(!a.contains("g1", &at("o", 1, 0)));
        assert_eq!(a.len(), 1);
        // Recorded before origins existed: the same stream.
        a.insert("g3", at("", 4, 0));
        assert!(a.contains("g3", &at("q", 4, 0)));
        assert!(!a.contains("g3", &at("q", 5, 0)));
        assert_eq!(
            Position::decode(&at("p", 1, 0).encode()),
            Some(at("p", 1, 0))
        );
    }
}
