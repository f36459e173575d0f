//! Recognising redelivered messages. QoS 1 is at-least-once: a message committed but whose
//! PUBACK never reached the broker (a crash or a dropped connection between commit and ack) is
//! sent again, and counting it again would break every bucket it touched.
//!
//! Every message that produced readings leaves a [`Fingerprint`] in a bounded window of the
//! most recent messages. The window lives in memory for the ingest task and, batch by batch, in
//! the same redb transaction as the buckets the messages changed ([`crate::store`]), so after a
//! crash it is exactly as durable as the counts it protects. A message whose fingerprint is in
//! the window is acknowledged and not counted again.
//!
//! What identifies a message:
//! - **Device-timestamped** (every reading's time came from the payload): the topic and the
//!   payload. The same payload on the same topic is the same readings, so any copy within the
//!   window is a duplicate, whatever the broker does with packet ids or the DUP flag.
//! - **Receive-time** (some reading took the time of arrival): identical payloads are distinct
//!   readings, so the fingerprint adds the packet id (and, with `mqtt.sessions` > 1, the session:
//!   packet ids are per session), and only a copy the broker marks as a redelivery (DUP = 1,
//!   MQTT 3.1.1 §3.3.1.1 / 5.0 §3.3.1.1) is dropped.
//!
//! See docs/RELIABILITY.md for the resulting guarantee.

use std::collections::{HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// A hash of what identifies one message: its SipHash-2-4 under the database's key
/// ([`Fingerprinter`]; before issue 52 the low 64 bits of an unkeyed XXH3-128, see
/// [`fingerprint`]). The type keeps 128 bits; the high ones are 0. Stable across releases: it
/// is stored. 64 bits against a window
/// of at most 1,048,576 fingerprints: a new message is taken for a copy with a chance below
/// 2^-44 (one in 17 trillion). Releases before issue 42 stored all 128 bits; those read back as
/// their low 64 ([`decode`]), so stored windows stay valid.
pub type Fingerprint = u128;

/// Bytes of one fingerprint as stored before issue 42 (16) and since (8).
pub const FINGERPRINT_BYTES: usize = 16;
const FINGERPRINT_BYTES_COMPACT: usize = 8;

/// Where a receive-time message came from: its session (0-based) and packet id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketId {
    pub session: u16,
    pub pkid: u16,
}

/// The secret the fingerprints of one database are keyed with (`meta.fingerprint_key`, made
/// with the file): with it, SipHash-2-4, a keyed pseudo-random function. Unkeyed, a 64-bit
/// XXH3 of a message can be computed by anyone, and a device that can predict another's next
/// message could publish one of its own that hashes the same, so that the other is taken for
/// a copy and dropped (issue 52).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct FingerprintKey([u64; 2]);

impl std::fmt::Debug for FingerprintKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FingerprintKey(..)")
    }
}

impl FingerprintKey {
    /// The key of 16 secret bytes (the store draws them from the operating system's random
    /// source: this module does no I/O).
    pub fn from_bytes(bytes: [u8; 16]) -> FingerprintKey {
        let (a, b) = bytes.split_at(8);
        let word = |w: &[u8]| u64::from_le_bytes(w.try_into().expect("8 bytes"));
        FingerprintKey([word(a), word(b)])
    }

    /// As stored: 32 hex digits.
    pub fn to_hex(self) -> String {
        format!("{:016x}{:016x}", self.0[0], self.0[1])
    }

    pub fn parse(text: &str) -> Option<FingerprintKey> {
        if text.len() != 32 || !text.is_ascii() {
            return None;
        }
        let (a, b) = text.split_at(16);
        Some(FingerprintKey([
            u64::from_str_radix(a, 16).ok()?,
            u64::from_str_radix(b, 16).ok()?,
        ]))
    }
}

/// Computes a database's fingerprints: keyed with its [`FingerprintKey`] and, while its window
/// may still hold fingerprints stored before it had one (a file made by a release before issue
/// 52), unkeyed as well, so that a redelivery of a message committed before the upgrade is
/// still recognised ([`Ident`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fingerprinter {
    /// `None`: unkeyed (tests, and tools reading a file without a key).
    key: Option<FingerprintKey>,
    legacy: bool,
}

impl Fingerprinter {
    pub fn new(key: Option<FingerprintKey>, legacy: bool) -> Fingerprinter {
        Fingerprinter { key, legacy }
    }

    /// What identifies a message (see [`fingerprint`]).
    pub fn ident(&self, topic: &[u8], payload: &[u8], id: Option<PacketId>) -> Ident {
        let Some(FingerprintKey([k0, k1])) = self.key else {
            return Ident {
                keyed: fingerprint(topic, payload, id),
                unkeyed: None,
            };
        };
        let mut h = siphasher::sip::SipHasher24::new_with_keys(k0, k1);
        frame(topic, payload, id, |bytes| {
            std::hash::Hasher::write(&mut h, bytes);
        });
        Ident {
            keyed: u128::from(std::hash::Hasher::finish(&h)),
            unkeyed: self.legacy.then(|| fingerprint(topic, payload, id)),
        }
    }
}

/// A message's fingerprint as stored from now on, and the one a release before issue 52 stored
/// for it, while a window may still hold those.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ident {
    pub keyed: Fingerprint,
    pub unkeyed: Option<Fingerprint>,
}

/// Feeds what identifies a message to `update`: a tag for its kind (with the packet id and
/// session of a receive-time message), then the topic, length-prefixed so that topic/payload
/// boundaries cannot shift, then the payload.
fn frame(topic: &[u8], payload: &[u8], id: Option<PacketId>, mut update: impl FnMut(&[u8])) {
    match id {
        None => update(&[0]),
        // Session 0 hashes as before sessions existed: stored windows stay valid.
        Some(PacketId { session: 0, pkid }) => {
            update(&[1]);
            update(&pkid.to_le_bytes());
        }
        Some(PacketId { session, pkid }) => {
            update(&[2]);
            update(&session.to_le_bytes());
            update(&pkid.to_le_bytes());
        }
    }
    update(&(topic.len() as u64).to_le_bytes());
    update(topic);
    update(payload);
}

/// The unkeyed fingerprint of a message, as releases before issue 52 stored it (and as a file
/// without a key has it). `id` is `Some` for receive-time messages (see the module docs).
pub fn fingerprint(topic: &[u8], payload: &[u8], id: Option<PacketId>) -> Fingerprint {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    frame(topic, payload, id, |bytes| h.update(bytes));
    u128::from(h.digest128() as u64)
}

/// The fingerprints of the most recent `capacity` messages, oldest first out, as the stored
/// window keeps them: a fingerprint inserted again (a distinct receive-time message that hashes
/// the same, its packet id reused) is kept until its last insertion leaves the window.
#[derive(Debug)]
pub struct Window {
    set: HashSet<Fingerprint, BuildHasherDefault<FoldHasher>>,
    order: VecDeque<Fingerprint>,
    /// How many more times than once a fingerprint is in `order` (rare: kept apart so that the
    /// set stays as small as a plain set).
    repeats: std::collections::HashMap<Fingerprint, u32, BuildHasherDefault<FoldHasher>>,
    capacity: usize,
}

impl Window {
    /// A window holding the last `capacity` of `recent` (given oldest first).
    pub fn new(capacity: usize, recent: impl IntoIterator<Item = Fingerprint>) -> Window {
        let mut w = Window {
            // Twice the window: removals leave tombstones, and a table at most half full
            // clears them in place; a fuller one would grow (allocate, copy) on the first
            // cleanup, mid-run. The steady state is this size either way.
            set: HashSet::with_capacity_and_hasher(
                capacity.saturating_mul(2),
                BuildHasherDefault::default(),
            ),
            order: VecDeque::with_capacity(capacity),
            repeats: std::collections::HashMap::default(),
            capacity,
        };
        for fp in recent {
            w.insert(fp);
        }
        w
    }

    /// Whether the window holds the message `id` names: its keyed fingerprint, or the unkeyed
    /// one a release before issue 52 stored for it.
    pub fn holds(&self, id: Ident) -> bool {
        self.contains(id.keyed) || id.unkeyed.is_some_and(|fp| self.contains(fp))
    }

    pub fn contains(&self, fp: Fingerprint) -> bool {
        self.set.contains(&fp)
    }

    /// Adds `fp` as the newest, forgetting the oldest insertion when full.
    pub fn insert(&mut self, fp: Fingerprint) {
        if self.capacity == 0 {
            return;
        }
        if self.order.len() == self.capacity
            && let Some(old) = self.order.pop_front()
        {
            match self.repeats.get_mut(&old) {
                Some(1) => {
                    self.repeats.remove(&old);
                }
                Some(n) => *n -= 1,
                None => {
                    self.set.remove(&old);
                }
            }
        }
        if !self.set.insert(fp) {
            *self.repeats.entry(fp).or_insert(0) += 1;
        }
        self.order.push_back(fp);
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

/// Fingerprints are already uniform hashes: the set folds them to 64 bits instead of hashing
/// them again.
#[derive(Default)]
struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u128` is used by `HashSet<u128>`; keep a correct fallback anyway.
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(b);
        }
    }

    fn write_u128(&mut self, v: u128) {
        self.0 = (v as u64) ^ ((v >> 64) as u64);
    }
}

/// Where a stored fingerprint's message came from: the session and packet id of a QoS 1/2
/// message, which put it in that session's resend sequence ([`crate::resend`]); `None` for a
/// QoS 0 message (never resent), or one stored before tags were (format version 2 and older).
pub type Tag = Option<PacketId>;

/// The stored session of a `None` tag.
const NO_SESSION: u16 = u16::MAX;

/// Bytes of one stored tag: session and packet id, little-endian.
const TAG_BYTES: usize = 4;

/// Marks the tagged encoding of format version 3 before issue 42: its length, 20 bytes a
/// fingerprint plus this byte, is odd, so it is never taken for the untagged one (16 bytes a
/// fingerprint) of format version 2.
const TAGGED: u8 = 1;

/// Marks the compact encoding (since issue 42): it ends with this byte and its length is 8 more
/// than a multiple of 16, so it is taken for neither older one (an untagged one is a multiple
/// of 16; a tagged one ends with [`TAGGED`]).
const COMPACT: u8 = 2;

/// Encodes tagged fingerprints for storage (in the journal and the `dedup` table), compactly:
/// the fingerprints (8 bytes each, little-endian), then their tags, each a byte (0: none, else
/// the session plus 1) and for a session the packet id (u16 little-endian); then the count (u32
/// little-endian), zeros to make the length 8 more than a multiple of 16, and [`COMPACT`];
/// nothing for none. 11 bytes a QoS 1 message's, against 20 before: a commit of 200 messages
/// fits its journal page with its readings.
pub fn encode(fps: &[(Fingerprint, Tag)]) -> Vec<u8> {
    if fps.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(fps.len() * (FINGERPRINT_BYTES_COMPACT + 3) + 24);
    out.extend(fps.iter().flat_map(|(fp, _)| (*fp as u64).to_le_bytes()));
    for (_, tag) in fps {
        match tag {
            None => out.push(0),
            Some(t) => {
                // Sessions are at most `mqtt.sessions` (16): the byte holds them.
                out.push(u8::try_from(t.session).map_or(u8::MAX, |s| s.saturating_add(1)));
                out.extend(t.pkid.to_le_bytes());
            }
        }
    }
    let n = u32::try_from(fps.len()).expect("far fewer than 2^32 messages in a commit");
    out.extend(n.to_le_bytes());
    while out.len() % 16 != 7 {
        out.push(0);
    }
    out.push(COMPACT);
    out
}

/// How many fingerprints [`encode`]d bytes hold (any encoding); `None` if they are none.
pub fn count(bytes: &[u8]) -> Option<usize> {
    Some(decode(bytes)?.count())
}

/// The compact encoding's fingerprints and tags, if `bytes` is one.
fn compact(bytes: &[u8]) -> Option<(&[u8], Vec<Tag>)> {
    let (&last, body) = bytes.split_last()?;
    if last != COMPACT || bytes.len() % 16 != 8 {
        return None;
    }
    // The count is just before the padding of at most 15 zeros: try each place it can be.
    for pad in 0..16usize {
        let Some(at) = body.len().checked_sub(4 + pad) else {
            break;
        };
        if body[at + 4..].iter().any(|b| *b != 0) {
            break;
        }
        let n = u32::from_le_bytes(body[at..at + 4].try_into().ok()?) as usize;
        let fps_len = n.checked_mul(FINGERPRINT_BYTES_COMPACT)?;
        if fps_len > at {
            continue;
        }
        let (fps, mut tags_bytes) = body[..at].split_at(fps_len);
        let mut tags = Vec::with_capacity(n);
        let parsed = (0..n).all(|_| match tags_bytes.split_first() {
            Some((0, rest)) => {
                tags.push(None);
                tags_bytes = rest;
                true
            }
            Some((&s, rest)) if rest.len() >= 2 => {
                let pkid = u16::from_le_bytes([rest[0], rest[1]]);
                tags.push(Some(PacketId {
                    session: u16::from(s - 1),
                    pkid,
                }));
                tags_bytes = &rest[2..];
                true
            }
            _ => false,
        });
        if parsed && tags_bytes.is_empty() {
            return Some((fps, tags));
        }
    }
    None
}

/// Decodes [`encode`]d fingerprints, oldest first, in any of the three encodings: compact,
/// tagged (format 3 before issue 42) and untagged (format 2, `None` tags); the older ones'
/// 128-bit fingerprints as their low 64 bits. `None` if the bytes are none of them.
pub fn decode(bytes: &[u8]) -> Option<impl Iterator<Item = (Fingerprint, Tag)> + '_> {
    let decoded: Vec<(Fingerprint, Tag)> = if bytes.is_empty() {
        Vec::new()
    } else if let Some((fps, tags)) = compact(bytes) {
        fps.chunks_exact(FINGERPRINT_BYTES_COMPACT)
            .zip(tags)
            .map(|(fp, tag)| {
                let fp = u64::from_le_bytes(fp.try_into().expect("a chunk of 8 bytes"));
                (u128::from(fp), tag)
            })
            .collect()
    } else {
        let tagged = !bytes.len().is_multiple_of(FINGERPRINT_BYTES);
        let n = if tagged {
            let (&last, rest) = bytes.split_last()?;
            let whole = last == TAGGED && rest.len().is_multiple_of(FINGERPRINT_BYTES + TAG_BYTES);
            whole.then_some(rest.len() / (FINGERPRINT_BYTES + TAG_BYTES))?
        } else {
            bytes.len() / FINGERPRINT_BYTES
        };
        let (fps, tags) = bytes.split_at(n * FINGERPRINT_BYTES);
        let u16_at = |at: usize| u16::from_le_bytes([tags[at], tags[at + 1]]);
        (0..n)
            .map(|i| {
                let at = i * FINGERPRINT_BYTES;
                let fp = u128::from_le_bytes(
                    fps[at..at + FINGERPRINT_BYTES]
                        .try_into()
                        .expect("a slice of 16 bytes"),
                );
                let tag = Some(i * TAG_BYTES)
                    .filter(|_| tagged)
                    .map(|at| PacketId {
                        session: u16_at(at),
                        pkid: u16_at(at + 2),
                    })
                    .filter(|t| t.session != NO_SESSION);
                (u128::from(fp as u64), tag)
            })
            .collect()
    };
    Some(decoded.into_iter())
}

#[cfg(test)]
mod tests;
