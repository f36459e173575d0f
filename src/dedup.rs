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

/// A 128-bit hash (XXH3-128) of what identifies one message. Stable across releases: it is
/// stored.
pub type Fingerprint = u128;

/// Bytes of one stored fingerprint.
pub const FINGERPRINT_BYTES: usize = 16;

/// Where a receive-time message came from: its session (0-based) and packet id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketId {
    pub session: u16,
    pub pkid: u16,
}

/// The fingerprint of a message. `id` is `Some` for receive-time messages (see the module docs).
pub fn fingerprint(topic: &[u8], payload: &[u8], id: Option<PacketId>) -> Fingerprint {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    match id {
        None => h.update(&[0]),
        // Session 0 hashes as before sessions existed: stored windows stay valid.
        Some(PacketId { session: 0, pkid }) => {
            h.update(&[1]);
            h.update(&pkid.to_le_bytes());
        }
        Some(PacketId { session, pkid }) => {
            h.update(&[2]);
            h.update(&session.to_le_bytes());
            h.update(&pkid.to_le_bytes());
        }
    }
    // Length-prefixed so that topic/payload boundaries cannot shift.
    h.update(&(topic.len() as u64).to_le_bytes());
    h.update(topic);
    h.update(payload);
    h.digest128()
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

/// Marks the tagged encoding: its length, 20 bytes a fingerprint plus this byte, is odd, so it
/// is never taken for the untagged one (16 bytes a fingerprint) of format version 2.
const TAGGED: u8 = 1;

/// Encodes tagged fingerprints for storage: the fingerprints (16 bytes each, little-endian),
/// then their tags (session and packet id, 2 bytes each, little-endian; session 65535 for none),
/// then [`TAGGED`]; nothing for none.
pub fn encode(fps: &[(Fingerprint, Tag)]) -> Vec<u8> {
    if fps.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(fps.len() * (FINGERPRINT_BYTES + TAG_BYTES) + 1);
    out.extend(fps.iter().flat_map(|(fp, _)| fp.to_le_bytes()));
    for (_, tag) in fps {
        let (session, pkid) = tag.map_or((NO_SESSION, 0), |t| (t.session, t.pkid));
        out.extend(session.to_le_bytes());
        out.extend(pkid.to_le_bytes());
    }
    out.push(TAGGED);
    out
}

/// How many fingerprints [`encode`]d bytes hold (either encoding); `None` if they are neither.
pub fn count(bytes: &[u8]) -> Option<usize> {
    if bytes.len().is_multiple_of(FINGERPRINT_BYTES) {
        return Some(bytes.len() / FINGERPRINT_BYTES);
    }
    let (&last, rest) = bytes.split_last()?;
    (last == TAGGED && rest.len().is_multiple_of(FINGERPRINT_BYTES + TAG_BYTES))
        .then_some(rest.len() / (FINGERPRINT_BYTES + TAG_BYTES))
}

/// Decodes [`encode`]d fingerprints, oldest first; the untagged encoding of format version 2
/// gives `None` tags. `None` if the bytes are neither encoding.
pub fn decode(bytes: &[u8]) -> Option<impl Iterator<Item = (Fingerprint, Tag)> + '_> {
    let n = count(bytes)?;
    let tagged = !bytes.len().is_multiple_of(FINGERPRINT_BYTES);
    let (fps, tags) = bytes.split_at(n * FINGERPRINT_BYTES);
    let u16_at = |at: usize| u16::from_le_bytes([tags[at], tags[at + 1]]);
    Some((0..n).map(move |i| {
        let at = i * FINGERPRINT_BYTES;
        let fp = u128::from_le_bytes(
            fps[at..at + FINGERPRINT_BYTES]
                .try_into()
                .expect("16 bytes"),
        );
        let tag = Some(i * TAG_BYTES)
            .filter(|_| tagged)
            .map(|at| PacketId {
                session: u16_at(at),
                pkid: u16_at(at + 2),
            })
            .filter(|t| t.session != NO_SESSION);
        (fp, tag)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_tell_topic_payload_and_packet_id_apart() {
        let base = fingerprint(b"a/b", b"1", None);
        assert_eq!(base, fingerprint(b"a/b", b"1", None));
        assert_ne!(base, fingerprint(b"a/b", b"2", None));
        assert_ne!(base, fingerprint(b"a/c", b"1", None));
        // The topic/payload boundary is part of the identity.
        assert_ne!(
            fingerprint(b"a/b1", b"", None),
            fingerprint(b"a/b", b"1", None)
        );
        let id = |session, pkid| Some(PacketId { session, pkid });
        assert_ne!(base, fingerprint(b"a/b", b"1", id(0, 0)));
        assert_ne!(
            fingerprint(b"a/b", b"1", id(0, 1)),
            fingerprint(b"a/b", b"1", id(0, 2))
        );
        // Packet ids are per session: the same id on two sessions is two messages.
        assert_ne!(
            fingerprint(b"a/b", b"1", id(0, 1)),
            fingerprint(b"a/b", b"1", id(1, 1))
        );
        assert_ne!(
            fingerprint(b"a/b", b"1", id(1, 2)),
            fingerprint(b"a/b", b"1", id(2, 1))
        );
    }

    #[test]
    fn fingerprints_are_stable_across_releases() {
        // Stored in the database: a change here makes every stored window useless. The value
        // was checked against Python's `xxhash.xxh3_128_hexdigest(b"\x00" + (15).to_bytes(8, "little")
        // + b"sensors/t1/temp21.5")`.
        assert_eq!(
            format!("{:032x}", fingerprint(b"sensors/t1/temp", b"21.5", None)),
            "4df731ca9ffc38ae190788baa51a9fc2"
        );
    }

    #[test]
    fn the_window_forgets_the_oldest_first() {
        let mut w = Window::new(3, [1, 2, 3]);
        assert!(w.contains(1) && w.contains(3));
        w.insert(4);
        assert!(!w.contains(1), "the oldest went first");
        assert!(w.contains(2) && w.contains(4));
        w.insert(5);
        assert!(!w.contains(2));
        assert_eq!(w.len(), 3);
        let empty = Window::new(0, [1]);
        assert!(!empty.contains(1) && empty.is_empty());
    }

    /// A fingerprint inserted again stays until its last insertion leaves the window, as in the
    /// stored window (the last `capacity` insertions); it used to keep its first place and be
    /// forgotten in memory while the file still had it.
    #[test]
    fn a_fingerprint_inserted_again_stays_as_long_as_its_last_insertion() {
        let mut w = Window::new(3, [1, 2, 3]);
        w.insert(1); // 2, 3, 1
        w.insert(4); // 3, 1, 4
        assert!(w.contains(1), "its second insertion is still in the window");
        assert!(!w.contains(2));
        w.insert(1); // 1, 4, 1
        w.insert(5); // 4, 1, 5
        w.insert(6); // 1, 5, 6
        assert!(w.contains(1));
        w.insert(7); // 5, 6, 7
        assert!(!w.contains(1), "gone with its last insertion");
        assert!(w.repeats.is_empty(), "{:?}", w.repeats);
        // The same as a window rebuilt from the stored insertions.
        let stored = [1, 2, 3, 1, 4, 1, 5, 6, 7];
        let rebuilt = Window::new(3, stored);
        for fp in 1..=7 {
            assert_eq!(rebuilt.contains(fp), w.contains(fp), "{fp}");
        }
    }

    #[test]
    fn encoding_round_trips() {
        let id = |session, pkid| Some(PacketId { session, pkid });
        let fps = [
            (0, id(0, 1)),
            (1, id(3, 65535)),
            (u128::MAX, None),
            (0x0123_4567_89ab_cdef_0011_2233_4455_6677, id(15, 0)),
        ];
        let bytes = encode(&fps);
        assert_eq!(bytes.len(), 4 * 20 + 1);
        assert_eq!(count(&bytes), Some(4));
        assert_eq!(decode(&bytes).unwrap().collect::<Vec<_>>(), fps);
        assert!(encode(&[]).is_empty());
        assert_eq!(decode(&[]).unwrap().count(), 0);
        for cut in [1, 15, 17, 20, 79] {
            assert!(decode(&bytes[..cut]).is_none(), "{cut} bytes");
        }
        let mut wrong_marker = bytes.clone();
        *wrong_marker.last_mut().unwrap() = 2;
        assert!(decode(&wrong_marker).is_none());
    }

    /// Files of format version 2 store fingerprints without tags: they still decode, as
    /// belonging to no resend sequence.
    #[test]
    fn untagged_fingerprints_of_format_2_decode_without_a_sequence() {
        let fps: [u128; 2] = [7, u128::MAX - 1];
        let bytes: Vec<u8> = fps.iter().flat_map(|fp| fp.to_le_bytes()).collect();
        assert_eq!(count(&bytes), Some(2));
        assert_eq!(
            decode(&bytes).unwrap().collect::<Vec<_>>(),
            [(7, None), (u128::MAX - 1, None)]
        );
    }
}
