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

impl DeltaMessage {
    /// Decodes a message from the network: its shape is checked on the raw bytes first
    /// ([`within_depth`]), so no message can make the deserialiser recurse past
    /// [`crate::limits::DELTA_DEPTH_MAX`] levels. `None`: not a delta message.
    pub fn decode(bytes: &[u8]) -> Option<DeltaMessage> {
        if !within_depth(bytes, crate::limits::DELTA_DEPTH_MAX) {
            return None;
        }
        bson::deserialize_from_slice(bytes).ok()
    }
}

/// Whether `bytes` is one well-formed BSON document whose documents, arrays and code scopes nest
/// at most `max` deep (the root is level 1). Iterative, with one lazy element iterator per open
/// level: bounded by `max`, whatever the input, and linear in its length.
pub fn within_depth(bytes: &[u8], max: usize) -> bool {
    use bson::RawBsonRef;
    use bson::spec::ElementType;
    let Ok(root) = bson::RawDocument::from_bytes(bytes) else {
        return false;
    };
    let mut open = vec![root.iter_elements()];
    while let Some(level) = open.last_mut() {
        let Some(element) = level.next() else {
            open.pop();
            continue;
        };
        let Ok(element) = element else {
            return false;
        };
        let nested = matches!(
            element.element_type(),
            ElementType::EmbeddedDocument
                | ElementType::Array
                | ElementType::JavaScriptCodeWithScope
        );
        if !nested {
            continue;
        }
        if open.len() >= max {
            return false;
        }
        let inner = match element.value() {
            Ok(RawBsonRef::Document(d)) => d,
            Ok(RawBsonRef::JavaScriptCodeWithScope(c)) => c.scope,
            Ok(RawBsonRef::Array(a)) => match bson::RawDocument::from_bytes(a.as_bytes()) {
                Ok(d) => d,
                Err(_) => return false,
            },
            _ => return false,
        };
        open.push(inner.iter_elements());
    }
    true
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

    /// Whether `self`, arriving after `last` was applied from the same gateway's database,
    /// could have come from its outbox: at most `max_jump` entries on (an outbox numbers its
    /// entries one by one and holds a bounded number). A copy (at or before `last`) is
    /// plausible; it is told apart elsewhere. A forged `seq = i64::MAX` otherwise made every
    /// later real message a copy. Positions of different databases are not compared.
    pub fn plausible_after(&self, last: &Position, max_jump: u64) -> bool {
        if !self.same_origin(last) {
            return true;
        }
        let ahead = self.seq.saturating_sub(last.seq);
        u64::try_from(ahead).map_or(true, |n| n <= max_jump)
    }

    /// Whether both come from one database; a position without an origin (recorded before
    /// origins existed) is taken for the same.
    pub fn same_origin(&self, other: &Position) -> bool {
        self.origin == other.origin || self.origin.is_empty() || other.origin.is_empty()
    }
}

/// Builds BSON of any shape for the tests and the fuzzers, without recursion (a serialiser that
/// recursed would overflow where the decoder must not). Public for the fuzzers under `tests/`;
/// nothing in the daemon calls it, and the linker leaves it out.
#[doc(hidden)]
pub mod shapes {
    /// How one level holds the next.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Nest {
        Document,
        Array,
        /// JavaScript code with a scope document (BSON type 0x0F).
        CodeWithScope,
    }

    impl Nest {
        fn element_type(self) -> u8 {
            match self {
                Nest::Document => 0x03,
                Nest::Array => 0x04,
                Nest::CodeWithScope => 0x0F,
            }
        }

        /// Bytes a level adds in front of its document (code with scope: total length, code).
        fn header_bytes(self) -> usize {
            if self == Nest::CodeWithScope {
                4 + 4 + 2
            } else {
                0
            }
        }
    }

    fn put_len(out: &mut Vec<u8>, n: usize) {
        out.extend_from_slice(
            &i32::try_from(n)
                .expect("test shapes fit BSON")
                .to_le_bytes(),
        );
    }

    /// `doc` (one BSON document) with one more element `key` whose value nests `levels` levels
    /// (at least 1), each held as `kinds[level % kinds.len()]`, the innermost holding `width`
    /// int32 elements. The message's depth grows by `levels`.
    pub fn with_nested(
        doc: &[u8],
        key: &str,
        kinds: &[Nest],
        levels: usize,
        width: usize,
    ) -> Vec<u8> {
        assert!(levels >= 1 && !kinds.is_empty());
        let kind = |i: usize| kinds[i % kinds.len()];
        const CHILD_KEY: &[u8] = b"0\0";
        // Sizes from the innermost level out: each level's document, then its value.
        let mut doc_size = vec![0usize; levels];
        let mut value_size = vec![0usize; levels];
        for i in (0..levels).rev() {
            doc_size[i] = if i + 1 == levels {
                4 + width * (1 + CHILD_KEY.len() + 4) + 1
            } else {
                4 + 1 + CHILD_KEY.len() + value_size[i + 1] + 1
            };
            value_size[i] = kind(i).header_bytes() + doc_size[i];
        }
        let mut value = Vec::with_capacity(value_size[0]);
        for i in 0..levels {
            if kind(i) == Nest::CodeWithScope {
                put_len(&mut value, value_size[i]);
                put_len(&mut value, 2);
                value.extend_from_slice(b"x\0");
            }
            put_len(&mut value, doc_size[i]);
            if i + 1 < levels {
                value.push(kind(i + 1).element_type());
                value.extend_from_slice(CHILD_KEY);
            } else {
                for n in 0..width {
                    value.push(0x10);
                    value.extend_from_slice(CHILD_KEY);
                    value.extend_from_slice(&i32::try_from(n).unwrap_or(0).to_le_bytes());
                }
            }
        }
        value.resize(value.len() + levels, 0);
        assert_eq!(value.len(), value_size[0]);
        let mut out = doc[..doc.len() - 1].to_vec();
        out.push(kind(0).element_type());
        out.extend_from_slice(key.as_bytes());
        out.push(0);
        out.extend_from_slice(&value);
        out.push(0);
        let total = out.len();
        out[..4].copy_from_slice(&i32::try_from(total).expect("fits").to_le_bytes());
        out
    }
}
