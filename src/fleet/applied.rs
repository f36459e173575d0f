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
//! new, not copies. The last positions of the databases a gateway used before are kept too
//! ([`RETIRED_ORIGINS_MAX`]): one forged message with a new origin used to reset the gateway's
//! position, so that captured old messages applied again; now they are still copies of their
//! own stream, and the real stream goes on where it was.
//!
//! Bounded by the number of gateways, each of which holds at least one series
//! (`limits.max_series`: a gateway's first position is recorded only with a bucket that
//! counted), times the databases kept per gateway.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::admit::DeltaLedger;
use crate::delta::Position;

/// Databases a gateway used before its current one whose last positions are kept: a message of
/// one of them is told as a copy or a continuation of that stream, whichever gateway sent it.
pub const RETIRED_ORIGINS_MAX: usize = 4;

/// How a retired origin's position is keyed in the store, beside the gateway's own key:
/// `<gateway>#<slot>` (a gateway id has no `#`).
fn retired_key(gateway: &str, slot: usize) -> String {
    format!("{gateway}#{slot}")
}

/// One gateway's streams: its current database's last position, and those of the databases it
/// used before (the most recent [`RETIRED_ORIGINS_MAX`], oldest first).
#[derive(Debug, Clone)]
struct Streams {
    current: Position,
    retired: Vec<Position>,
    /// When a change of its database was last logged as a warning ([`ORIGIN_WARN_EVERY`]).
    warned_at: Option<Instant>,
}

/// A gateway's change of database is warned about at most this often; the others go to the
/// debug log (issue 52: messages alternating between two origins logged a warning each,
/// ~400 KiB a thousand messages).
const ORIGIN_WARN_EVERY: Duration = Duration::from_mins(1);

/// The last position applied per gateway and database.
#[derive(Debug, Default)]
pub struct Applied {
    by_gateway: HashMap<String, Streams>,
}

impl Applied {
    /// From the store's entries: `<gateway>` -> its current position, `<gateway>#<slot>` -> a
    /// retired one.
    pub fn new(stored: impl IntoIterator<Item = (String, Position)>) -> Applied {
        let mut current = HashMap::new();
        let mut retired: HashMap<String, Vec<(usize, Position)>> = HashMap::new();
        for (key, at) in stored {
            match key.split_once('#') {
                Some((gateway, slot)) => {
                    let slot = slot.parse().unwrap_or(usize::MAX);
                    retired
                        .entry(gateway.to_owned())
                        .or_default()
                        .push((slot, at));
                }
                None => {
                    current.insert(key, at);
                }
            }
        }
        let by_gateway = current
            .into_iter()
            .map(|(gateway, current)| {
                let mut old = retired.remove(&gateway).unwrap_or_default();
                old.sort_by_key(|(slot, _)| *slot);
                let retired = old
                    .into_iter()
                    .map(|(_, at)| at)
                    .filter(|at| at.origin != current.origin)
                    .take(RETIRED_ORIGINS_MAX)
                    .collect();
                (
                    gateway,
                    Streams {
                        current,
                        retired,
                        warned_at: None,
                    },
                )
            })
            .collect();
        Applied { by_gateway }
    }

    pub fn len(&self) -> usize {
        self.by_gateway.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_gateway.is_empty()
    }
}

impl DeltaLedger for Applied {
    fn knows(&self, gateway: &str) -> bool {
        self.by_gateway.contains_key(gateway)
    }

    fn last(&self, gateway: &str, origin: &str) -> Option<&Position> {
        let streams = self.by_gateway.get(gateway)?;
        if streams.current.origin == origin || streams.current.origin.is_empty() {
            return Some(&streams.current);
        }
        streams.retired.iter().find(|at| at.origin == origin)
    }

    /// Records that the message at `at` from `gateway` is applied. A change of database is
    /// logged with both origins; the one left keeps its last position (a message of it later
    /// is a copy or its continuation, not a new stream), and every position kept for the
    /// gateway is returned to be stored.
    fn insert(&mut self, gateway: &str, at: Position) -> Vec<(String, Position)> {
        let Some(streams) = self.by_gateway.get_mut(gateway) else {
            self.by_gateway.insert(
                gateway.to_owned(),
                Streams {
                    current: at.clone(),
                    retired: Vec::new(),
                    warned_at: None,
                },
            );
            return vec![(gateway.to_owned(), at)];
        };
        if streams.current.same_origin(&at) {
            streams.current = at.clone();
            return vec![(gateway.to_owned(), at)];
        }
        let now = Instant::now();
        if streams
            .warned_at
            .is_none_or(|t| now.duration_since(t) >= ORIGIN_WARN_EVERY)
        {
            streams.warned_at = Some(now);
            warn!(
                gateway,
                was = %streams.current.origin,
                now = %at.origin,
                "A gateway's deltas now come from another database (origin): a new one numbers \
                 its entries from the start. If the gateway's database was not replaced, someone \
                 else publishes as it: check the broker's ACL for its topic. If two gateways \
                 share this id, give each its own upstream.gateway_id: their deltas cannot be \
                 told apart. Further changes of this gateway's database are logged at most once \
                 a minute (debug: each)."
            );
        } else {
            debug!(gateway, was = %streams.current.origin, now = %at.origin, "A gateway's deltas come from another database again.");
        }
        streams.retired.retain(|old| old.origin != at.origin);
        let left = std::mem::replace(&mut streams.current, at.clone());
        streams.retired.push(left);
        if streams.retired.len() > RETIRED_ORIGINS_MAX {
            streams.retired.remove(0);
        }
        let mut out = vec![(gateway.to_owned(), at)];
        out.extend(
            streams
                .retired
                .iter()
                .enumerate()
                .map(|(slot, old)| (retired_key(gateway, slot), old.clone())),
        );
        out
    }
}

#[cfg(test)]
mod tests;
