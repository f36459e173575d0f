//! [`Stats`]: the daemon's counters and gauges, shared by the tasks that move them and the code
//! that reports them. Plain atomics: no labels built from topics or device ids, so the set is
//! fixed and small. The dead-letter ring keeps the last few rejected payloads for inspection.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use crate::batcher::FlushReason;
use crate::reading::Timestamp;
use crate::reject::DecodeError;

/// Longest payload prefix kept in a dead letter.
pub const DEAD_LETTER_BYTES_MAX: usize = 256;
/// Longest topic prefix kept in a dead letter (an MQTT topic may be 64 KiB).
pub const DEAD_LETTER_TOPIC_BYTES_MAX: usize = 256;

/// One rejected message or reading, as kept in the dead-letter ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// When the message came (a reconnect's resends are refused when their burst ends).
    pub at: Timestamp,
    pub reason: &'static str,
    pub topic: String,
    /// The payload, truncated to [`DEAD_LETTER_BYTES_MAX`] bytes.
    pub payload: Vec<u8>,
    /// Readings of the message refused for this reason (the message itself counts as one).
    pub count: u64,
}

#[derive(Debug, Default)]
pub struct Stats {
    pub messages_received: AtomicU64,
    /// Readings committed to the store.
    pub readings_ingested: AtomicU64,
    rejected: [AtomicU64; DecodeError::ALL.len()],
    pub flushes: AtomicU64,
    flush_reasons: [AtomicU64; FlushReason::ALL.len()],
    pub buckets_written: AtomicU64,
    /// Checkpoints done, and the bytes in the commit log now.
    pub checkpoints: AtomicU64,
    pub log_bytes: AtomicU64,
    /// Raw pages and buckets deleted by retention.
    pub pages_expired: AtomicU64,
    pub buckets_expired: AtomicU64,
    pub pending_readings: AtomicU64,
    pub unacked_messages: AtomicU64,
    pub acks_sent: AtomicU64,
    pub series: AtomicU64,
    pub store_bytes: AtomicU64,
    pub connected: AtomicBool,
    pub subscribed: AtomicBool,
    pub reconnects: AtomicU64,
    /// Failed polls: connection losses and failed connection attempts.
    pub connection_errors: AtomicU64,
    /// Redelivered messages recognised and not counted again ([`crate::dedup`]).
    pub duplicates: AtomicU64,
    /// Messages that carry no readings by design (Sparkplug DEATH, command and STATE).
    pub control_messages: AtomicU64,
    /// Commits that failed (and were retried after reopening the file).
    pub commit_errors: AtomicU64,
    /// Checkpoints that failed (and were tried again after a backoff).
    pub checkpoint_errors: AtomicU64,
    /// HTTP requests refused for a missing or wrong bearer token.
    pub http_unauthorized: AtomicU64,
    /// HTTP connections closed on arrival because `http.max_connections` were open.
    pub http_connections_refused: AtomicU64,
    /// False from a failed commit until a commit succeeds again.
    pub store_failing: AtomicBool,
    /// Forwarding to the fleet tier (`fleet::forwarder`): entries and readings applied
    /// upstream, failed attempts, entries waiting and the creation time of the oldest (ns).
    pub upstream_entries: AtomicU64,
    pub upstream_readings: AtomicU64,
    pub upstream_errors: AtomicU64,
    /// Readings of buckets older than `upstream.postgres_retention`, not forwarded.
    pub upstream_expired: AtomicU64,
    pub upstream_connected: AtomicBool,
    pub upstream_pending_entries: AtomicU64,
    pub upstream_oldest_pending_ns: AtomicI64,
    /// Whether forwarding is configured (the upstream metrics are reported only then).
    pub upstream_enabled: AtomicBool,
    dead_letters: Mutex<VecDeque<DeadLetter>>,
    dead_letters_max: usize,
}

impl Stats {
    pub fn new(dead_letters_max: usize) -> Stats {
        Stats {
            dead_letters_max,
            ..Stats::default()
        }
    }

    /// Counts a message refused as a whole, and keeps it in the dead letters.
    pub fn reject(&self, reason: DecodeError, topic: &[u8], payload: &[u8], at: Timestamp) {
        self.reject_all(&[reason], topic, payload, at);
    }

    /// Counts every refusal of one message (the message's, or each of its readings') and keeps
    /// one dead letter per reason, whatever the number of readings: a message of 10,000 bad
    /// fields costs 10,000 counter increments and a few bounded copies, not 10,000 copies of
    /// its topic. `at`: when the message came, the dead letters' stamp.
    pub fn reject_all(&self, reasons: &[DecodeError], topic: &[u8], payload: &[u8], at: Timestamp) {
        let mut per_reason = [0u64; DecodeError::ALL.len()];
        for reason in reasons {
            per_reason[reason.index()] += 1;
        }
        for (counter, n) in self.rejected.iter().zip(per_reason) {
            if n > 0 {
                counter.fetch_add(n, Ordering::Relaxed);
            }
        }
        if self.dead_letters_max == 0 || reasons.is_empty() {
            return;
        }
        let topic = truncated_text(topic, DEAD_LETTER_TOPIC_BYTES_MAX);
        let payload = &payload[..payload.len().min(DEAD_LETTER_BYTES_MAX)];
        let mut ring = self
            .dead_letters
            .lock()
            .expect("no panic while holding the lock");
        // In the order the reasons first appear in the message.
        for reason in reasons {
            let n = std::mem::take(&mut per_reason[reason.index()]);
            if n == 0 {
                continue;
            }
            if ring.len() == self.dead_letters_max {
                ring.pop_front();
            }
            ring.push_back(DeadLetter {
                at,
                reason: reason.reason(),
                topic: topic.clone(),
                payload: payload.to_vec(),
                count: n,
            });
        }
    }

    /// Counts why a batch was handed to the writer (shutdown flushes are not counted here).
    pub fn flush_started(&self, reason: FlushReason) {
        let i = FlushReason::ALL
            .iter()
            .position(|r| *r == reason)
            .expect("ALL lists every reason");
        self.flush_reasons[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn flushes_by(&self, reason: FlushReason) -> u64 {
        let i = FlushReason::ALL
            .iter()
            .position(|r| *r == reason)
            .expect("ALL lists every reason");
        self.flush_reasons[i].load(Ordering::Relaxed)
    }

    pub fn rejected(&self, reason: DecodeError) -> u64 {
        self.rejected[reason.index()].load(Ordering::Relaxed)
    }

    pub fn rejected_total(&self) -> u64 {
        self.rejected
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// The kept rejections, oldest first.
    pub fn dead_letters(&self) -> Vec<DeadLetter> {
        let ring = self
            .dead_letters
            .lock()
            .expect("no panic while holding the lock");
        ring.iter().cloned().collect()
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// `bytes` as text (invalid UTF-8 replaced), cut to at most `max` bytes at a character boundary.
fn truncated_text(bytes: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(max)]);
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letter_ring_keeps_the_newest_and_truncates() {
        let stats = Stats::new(2);
        stats.reject(
            DecodeError::InvalidJson,
            b"a",
            b"1",
            Timestamp::from_secs(7),
        );
        stats.reject(
            DecodeError::InvalidJson,
            b"b",
            &[b'x'; 1000],
            Timestamp::from_secs(8),
        );
        stats.reject(
            DecodeError::NonFinite,
            b"c",
            b"NaN",
            Timestamp::from_secs(9),
        );
        let letters = stats.dead_letters();
        assert_eq!(letters.len(), 2);
        assert_eq!(letters[0].topic, "b");
        assert_eq!(
            letters[0].at,
            Timestamp::from_secs(8),
            "stamped when it came"
        );
        assert_eq!(letters[0].payload.len(), DEAD_LETTER_BYTES_MAX);
        assert_eq!(letters[1].reason, "non_finite");
        assert_eq!(stats.rejected(DecodeError::InvalidJson), 2);
        assert_eq!(stats.rejected_total(), 3);
    }

    /// Issue 41: every rejected reading stored the whole topic in the dead letters, so a 60 KiB
    /// topic with 10,000 invalid fields copied ~600 MB and stalled ingestion for every device.
    /// Now one letter per message and reason, with the topic cut to a bounded length, and the
    /// counters still count every reading.
    #[test]
    fn one_dead_letter_per_message_and_reason_with_a_bounded_topic() {
        let stats = Stats::new(100);
        let topic = "é".repeat(30_000); // 60,000 bytes, two per character
        let mut reasons = vec![DecodeError::NonFinite; 10_000];
        reasons.push(DecodeError::InvalidName);
        reasons.push(DecodeError::NonFinite);
        stats.reject_all(
            &reasons,
            topic.as_bytes(),
            b"{...}",
            Timestamp::from_secs(1),
        );
        let letters = stats.dead_letters();
        assert_eq!(letters.len(), 2);
        assert_eq!(
            (letters[0].reason, letters[0].count),
            ("non_finite", 10_001)
        );
        assert_eq!((letters[1].reason, letters[1].count), ("invalid_name", 1));
        for l in &letters {
            assert!(
                l.topic.len() <= DEAD_LETTER_TOPIC_BYTES_MAX,
                "{}",
                l.topic.len()
            );
            assert!(l.topic.len() >= DEAD_LETTER_TOPIC_BYTES_MAX - 1);
            assert!(l.topic.chars().all(|c| c == 'é'));
        }
        assert_eq!(stats.rejected(DecodeError::NonFinite), 10_001);
        assert_eq!(stats.rejected(DecodeError::InvalidName), 1);
        // A cut inside a character, and bytes that are not UTF-8.
        assert_eq!(truncated_text("aé".as_bytes(), 2), "a");
        assert_eq!(truncated_text(b"a\xffb", 8), "a\u{fffd}b");
    }
}
