//! Telling a reconnect's resends from new messages that reuse a packet id, by their order. Pure:
//! fingerprints in, verdicts out; the ingest task holds the messages themselves.
//!
//! A receive-time message is identified by its session, packet id, topic and payload
//! ([`crate::dedup`]), and a copy only when the broker marks it DUP. A broker may give a packet id
//! to a new message as soon as the one it carried is acknowledged (MQTT 3.1.1 §2.3.1; HiveMQ
//! hands out the lowest free id), so a new message can have the fingerprint of one already
//! counted, and if its first delivery is lost (to a crash before its commit, or on the wire with
//! the connection), its resend looks exactly like the earlier message's copy. The window of
//! fingerprints alone cannot tell them apart; the order of the resends can:
//!
//! - After a reconnect with its session kept, a broker first resends, in their original order and
//!   with DUP, every QoS 1/2 message of the session it has not seen acknowledged, and only then
//!   sends new ones (MQTT 3.1.1 §4.4, §4.6; 5.0 §4.4, §4.6).
//! - bucketd acknowledges in arrival order and the broker reads the acknowledgements in order, so
//!   the messages it still holds unacknowledged are the *last* ones bucketd received on the
//!   session (a tail of the session's [sequence](Resends::counted)), then ones bucketd never got.
//!
//! So the copies in a resend burst are exactly a tail of the sequence, complete to its last
//! message, at the burst's start. A burst is held ([`Burst::hold`]) until it ends: at the first
//! new (not DUP) QoS 1/2 message, when it has been quiet for a while (the caller keeps the
//! time), or when full ([`Burst::is_full`]). [`Resends::end_burst`] then counts as copies the
//! longest tail of the sequence that the burst begins with; a held message after those is new if
//! the sequence knows its fingerprint (a packet id reused), and follows the plain window rule
//! otherwise (a fingerprint stored before sequences were, or by a session that no longer exists).
//!
//! A burst that went quiet may not be over: a broker can resend fewer messages than it had
//! unacknowledged, and the rest only after acknowledgements (Mosquitto 2.0.11 restored from its
//! persistence file resends 20 at a time to an MQTT 3.1.1 client it had sent many more). When
//! the held messages repeat a stretch of the sequence that stops short of its end, and the
//! session has never been given a packet id twice within its sequence (so that no new message
//! can have an old one's fingerprint: Mosquitto and EMQX count ids up to 65,535), they are that
//! stretch's copies; the rest come later and the window recognises them.
//!
//! That leaves one ambiguity: new messages that repeat the sequence's last messages exactly (same
//! ids, topics and payloads, in order) read as the broker resending those. For messages bucketd
//! received, [`Resends::counted`] prevents it: it says when the uncommitted part of a session's
//! sequence has become such a repetition, and the batch is then committed at once (a commit that
//! would have come at the next flush anyway: a repetition is a whole batch again). It says so
//! too for the first message with the fingerprint of one before it while the committed sequence
//! shows no packet id given twice, so that after a crash the stored sequence shows the broker
//! giving ids again (and a pause in its resends is not taken for a stall): once per run at most,
//! and never with a broker that counts ids up. What remains is a crash during such a commit, or a
//! repetition's end still on the wire when the connection or the process dies: see
//! docs/RELIABILITY.md.

use std::collections::{HashSet, VecDeque};

use crate::dedup::{Fingerprint, Tag};

/// The multiplier of the rolling hashes that compare a session's uncommitted messages with the
/// tail before them (odd, so that multiplication mod 2^64 loses nothing).
const HASH_BASE: u64 = 0x9e37_79b9_7f4a_7c15;

/// One message of a session's sequence.
#[derive(Debug, Clone, Copy)]
struct Entry {
    fp: Fingerprint,
    pkid: u16,
    /// Its arrival number (`crate::ack::AckToken::arrival`); 0 for one read from the store.
    arrival: u64,
    /// The broker has read its ack ([`Resends::confirm`]): it is never resent.
    confirmed: bool,
}

/// Per session: the QoS 1/2 messages counted, in arrival order.
#[derive(Debug, Default)]
struct Sequence {
    known: VecDeque<Entry>,
    /// How many of `known` carry each packet id (65,536 counters once the first is counted).
    pkids: Vec<u16>,
    /// A packet id was given twice within the sequence (once true, it stays).
    reused: bool,
    /// ... among its committed messages (or those handed to the writer): the stored sequence
    /// shows it after a crash.
    reused_committed: bool,
    /// ... by a message of the open batch.
    reused_open: bool,
    /// The last `open` of `known` are in the open batch (not yet handed to the writer).
    open: usize,
    replay: Replay,
}

impl Sequence {
    /// Appends a message; `true` if its packet id is in the sequence already.
    fn push(&mut self, fp: Fingerprint, pkid: u16, arrival: u64, capacity: usize) -> bool {
        if self.pkids.is_empty() {
            self.pkids = vec![0; usize::from(u16::MAX) + 1];
        }
        let count = &mut self.pkids[usize::from(pkid)];
        let again = *count > 0;
        *count = count.saturating_add(1);
        self.reused |= again;
        self.known.push_back(Entry {
            fp,
            pkid,
            arrival,
            confirmed: false,
        });
        if self.known.len() > capacity
            && let Some(old) = self.known.pop_front()
        {
            let count = &mut self.pkids[usize::from(old.pkid)];
            *count = count.saturating_sub(1);
        }
        again
    }
}

/// Whether the open part of a sequence repeats the tail before it, kept up to date message by
/// message with rolling hashes (equal hashes are checked element by element).
#[derive(Debug)]
struct Replay {
    open_hash: u64,
    tail_hash: u64,
    /// `HASH_BASE` to the power of the open part's length.
    power: u64,
    /// The tail before the open part is shorter than the open part: no repetition possible until
    /// the next batch.
    exhausted: bool,
}

impl Default for Replay {
    fn default() -> Replay {
        Replay {
            open_hash: 0,
            tail_hash: 0,
            power: 1,
            exhausted: false,
        }
    }
}

/// A reconnect's burst of resends, held until it ends: the held messages in arrival order, each
/// with its fingerprint and arrival number (what [`Resends::end_burst`] tells them apart by) and
/// what the caller needs to admit it again (`T`), so that the two never part. Owned by the
/// session it came on (`crate::ingest`); a connection that begins or ends drops it
/// (unacknowledged, its messages come again with the next connection's burst).
#[derive(Debug)]
pub struct Burst<T> {
    held: Vec<Held<T>>,
    /// Most messages held (the caller ends a burst that [`Burst::is_full`]).
    max: usize,
}

/// A message held in a [`Burst`].
#[derive(Debug)]
pub struct Held<T> {
    pub fp: Fingerprint,
    /// Its ack token's arrival number.
    pub arrival: u64,
    pub body: T,
}

impl<T> Burst<T> {
    /// An empty burst that holds at most `max` messages (at least one).
    pub fn new(max: usize) -> Burst<T> {
        Burst {
            held: Vec::new(),
            max: max.max(1),
        }
    }

    /// Holds a resend; the caller ends a burst that [`Burst::is_full`] before the next.
    pub fn hold(&mut self, fp: Fingerprint, arrival: u64, body: T) {
        debug_assert!(
            !self.is_full(),
            "a full burst is ended before the next resend"
        );
        self.held.push(Held { fp, arrival, body });
    }

    pub fn is_full(&self) -> bool {
        self.held.len() >= self.max
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// The resend sequences of all sessions. See the module docs.
#[derive(Debug)]
pub struct Resends {
    sessions: Vec<Sequence>,
    /// Most messages kept per session (`limits.dedup_window`).
    capacity: usize,
}

/// What a held message turned out to be when its burst ended ([`Resends::end_burst`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BurstPart {
    /// A copy of a message counted already.
    Copy,
    /// New, with the fingerprint of a message in the sequence: a packet id given again.
    New,
    /// Not in the sequence: the window decides, as for any resend.
    Unknown,
}

/// Why a burst ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BurstEnd {
    /// A new message came: the broker has resent everything.
    NewMessage,
    /// Quiet for a while, or the burst full, or shutdown: the broker may be waiting for
    /// acknowledgements before it resends more.
    Pause,
}

impl Resends {
    /// `recent`: the stored fingerprints with their tags, oldest first; untagged ones, and those
    /// of sessions beyond `sessions`, are in no sequence.
    pub fn new(
        sessions: u16,
        capacity: usize,
        recent: impl IntoIterator<Item = (Fingerprint, Tag)>,
    ) -> Resends {
        let mut r = Resends {
            sessions: (0..sessions).map(|_| Sequence::default()).collect(),
            capacity,
        };
        for (fp, tag) in recent {
            if let Some(id) = tag
                && let Some(s) = r.sessions.get_mut(usize::from(id.session))
                && capacity > 0
            {
                s.push(fp, id.pkid, 0, capacity);
            }
        }
        for s in &mut r.sessions {
            s.reused_committed = s.reused;
        }
        r
    }

    /// Ends `session`'s burst: each held message with what it is, in arrival order (see the
    /// module docs). The caller then admits them in that order.
    pub fn end_burst<T>(
        &mut self,
        session: u16,
        burst: Burst<T>,
        end: BurstEnd,
    ) -> Vec<(Held<T>, BurstPart)> {
        let parts = self.tell_apart(session, &burst, end);
        burst.held.into_iter().zip(parts).collect()
    }

    /// What each message of `burst` is ([`Resends::end_burst`]).
    fn tell_apart<T>(&mut self, session: u16, burst: &Burst<T>, end: BurstEnd) -> Vec<BurstPart> {
        let Some(s) = self.sessions.get_mut(usize::from(session)) else {
            // A session beyond `mqtt.sessions` has no sequence: the window decides.
            return vec![BurstPart::Unknown; burst.len()];
        };
        let held: Vec<Fingerprint> = burst.held.iter().map(|h| h.fp).collect();
        let arrivals = burst.held.iter().map(|h| h.arrival);
        let n = s.known.len();
        let fps = || s.known.iter().map(|e| e.fp);
        // The broker has read the acks of confirmed messages and never resends those: a tail of
        // copies ends at the last one, and a stretch of copies holds none.
        let unconfirmed = s.known.iter().rev().take_while(|e| !e.confirmed).count();
        let stretch_at = |p: usize| {
            let stretch = || s.known.iter().skip(p).take(held.len());
            stretch().all(|e| !e.confirmed) && stretch().map(|e| e.fp).eq(held.iter().copied())
        };
        // Longest first: where the burst's start repeats a complete tail several times over
        // (the same fingerprints again and again), taking the most as copies is what the
        // broker did unless new messages repeated the tail exactly, which `counted` keeps
        // from happening to messages bucketd received.
        let tail = (1..=held.len().min(unconfirmed))
            .rev()
            .find(|&k| fps().skip(n - k).eq(held[..k].iter().copied()))
            .unwrap_or(0);
        let stretch = end == BurstEnd::Pause
            && tail < held.len()
            && !s.reused
            && (0..n.saturating_sub(held.len())).any(stretch_at);
        let copies = if stretch { held.len() } else { tail };
        let known: HashSet<Fingerprint> = fps().collect();
        if !stretch && (tail > 0 || (held.is_empty() && end == BurstEnd::NewMessage)) {
            // The broker resends the oldest message it holds first: it has read the acks of
            // everything before a tail of copies, or of everything when it resent nothing
            // before a new message.
            for e in s.known.range_mut(..n - tail) {
                e.confirmed = true;
            }
            // Each message of the tail is now acknowledged by its copy's ack, on this
            // connection: a ping after it confirms the message ([`Resends::confirm`]). The
            // arrival numbers stay in order: the copies came after everything in the sequence.
            for (e, arrival) in s.known.range_mut(n - tail..).zip(arrivals) {
                e.arrival = arrival;
            }
        }
        held.iter()
            .enumerate()
            .map(|(i, fp)| {
                if i < copies {
                    BurstPart::Copy
                } else if known.contains(fp) {
                    BurstPart::New
                } else {
                    BurstPart::Unknown
                }
            })
            .collect()
    }

    /// Whether `fp` is in `session`'s sequence.
    #[cfg(test)]
    fn knows(&self, session: u16, fp: Fingerprint) -> bool {
        self.sessions
            .get(usize::from(session))
            .is_some_and(|s| s.known.iter().any(|e| e.fp == fp))
    }

    /// A QoS 1/2 message with fingerprint `fp`, packet id `pkid` and arrival number `arrival`
    /// was counted on `session` (it joins the open batch); `seen`: its fingerprint is in the
    /// window already. `true` when the batch should be committed now (see the module docs): the
    /// open batch's part of the sequence repeats, message for message, the tail just before it,
    /// or this is the first repeated fingerprint while the committed sequence shows no packet id
    /// given twice.
    pub fn counted(
        &mut self,
        session: u16,
        fp: Fingerprint,
        pkid: u16,
        arrival: u64,
        seen: bool,
    ) -> bool {
        let capacity = self.capacity;
        let Some(s) = self.sessions.get_mut(usize::from(session)) else {
            return false;
        };
        if capacity == 0 {
            return false;
        }
        s.reused_open |= s.push(fp, pkid, arrival, capacity);
        let first_reuse = seen && !s.reused_committed;
        s.open = (s.open + 1).min(s.known.len());
        let (n, j) = (s.known.len(), s.open);
        let r = &mut s.replay;
        // The tail of `j` messages before the open part: `known[n - 2j .. n - j]`.
        if r.exhausted || n < 2 * j {
            r.exhausted = true;
            return first_reuse;
        }
        let mix = |fp: Fingerprint| (fp as u64) ^ ((fp >> 64) as u64);
        r.tail_hash = r
            .tail_hash
            .wrapping_add(mix(s.known[n - 2 * j].fp).wrapping_mul(r.power));
        r.open_hash = r.open_hash.wrapping_mul(HASH_BASE).wrapping_add(mix(fp));
        r.power = r.power.wrapping_mul(HASH_BASE);
        let repeats = r.open_hash == r.tail_hash
            && s.known
                .range(n - 2 * j..n - j)
                .map(|e| e.fp)
                .eq(s.known.range(n - j..).map(|e| e.fp));
        first_reuse || repeats
    }

    /// The broker has read the acks of `session`'s messages with arrival numbers `from..=to`
    /// (those of one connection, written before a PINGREQ it answered): none of them is resent
    /// again, so none can be a copy in a later burst. Acks go out in arrival order, so
    /// confirmation within a connection grows from `from` without gaps; the walk stops at the
    /// first message confirmed already.
    pub fn confirm(&mut self, session: u16, from: u64, to: u64) {
        let Some(s) = self.sessions.get_mut(usize::from(session)) else {
            return;
        };
        for e in s.known.iter_mut().rev().skip_while(|e| e.arrival > to) {
            if e.arrival < from || e.confirmed {
                break;
            }
            e.confirmed = true;
        }
    }

    /// The open batch went to the writer: every session's open part starts over.
    pub fn batch_taken(&mut self) {
        for s in &mut self.sessions {
            s.open = 0;
            s.replay = Replay::default();
            s.reused_committed |= std::mem::take(&mut s.reused_open);
        }
    }
}

#[cfg(test)]
mod tests;
