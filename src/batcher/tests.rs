use std::collections::VecDeque;

use super::*;
use crate::reading::Timestamp;

fn token(arrival: u64) -> AckToken {
    AckToken {
        arrival,
        connection: 1,
        pkid: (arrival % 65_535 + 1) as u16,
        qos: 1,
    }
}

fn policy(window: u16) -> FlushPolicy {
    FlushPolicy {
        flush_interval: Duration::from_secs(1),
        max_pending_readings: 1000,
        window,
    }
}

#[test]
fn readings_of_one_hour_merge_into_one_bucket_and_late_ones_into_their_own() {
    let now = Instant::now();
    let mut b = Batcher::new(policy(100), 3600);
    let s: Arc<str> = Arc::from("s1/t");
    b.push(s.clone(), Timestamp::from_secs(7200), 1.0, now);
    b.push(s.clone(), Timestamp::from_secs(10_799), 3.0, now);
    b.push(s.clone(), Timestamp::from_secs(3599), 5.0, now); // late, previous hour
    let (batch, acks) = b.take();
    assert!(acks.is_empty());
    assert_eq!(batch.readings, 3);
    assert_eq!(batch.buckets.len(), 2);
    let hour = &batch.buckets[&(s.clone(), 7200)];
    assert_eq!((hour.count, hour.min, hour.max), (2, 1.0, 3.0));
    assert_eq!(batch.buckets[&(s, 0)].count, 1);
    assert!(b.is_empty());
}

#[test]
fn flush_is_due_after_the_interval_counted_from_the_first_message() {
    let t0 = Instant::now();
    let mut b = Batcher::new(policy(100), 3600);
    assert_eq!(
        b.flush_reason(t0 + Duration::from_secs(10)),
        None,
        "empty batch never flushes"
    );
    b.push_ack(token(1), t0);
    assert_eq!(b.flush_reason(t0 + Duration::from_millis(999)), None);
    assert_eq!(b.deadline(), Some(t0 + Duration::from_secs(1)));
    assert_eq!(
        b.flush_reason(t0 + Duration::from_secs(1)),
        Some(FlushReason::Interval)
    );
}

#[test]
fn flush_is_due_at_half_the_window_long_before_the_interval() {
    let t0 = Instant::now();
    let mut b = Batcher::new(policy(20), 3600);
    for i in 0..9 {
        b.push_ack(token(i), t0);
    }
    assert_eq!(b.flush_reason(t0), None);
    b.push_ack(token(9), t0);
    assert_eq!(b.flush_reason(t0), Some(FlushReason::AckWindow));
    assert!(
        !b.is_full(),
        "the other half of the window stays open while committing"
    );
    for i in 10..20 {
        b.push_ack(token(i), t0);
    }
    assert!(b.is_full());
}

#[test]
fn flush_is_due_at_max_pending_readings() {
    let t0 = Instant::now();
    let mut b = Batcher::new(
        FlushPolicy {
            max_pending_readings: 3,
            ..policy(100)
        },
        3600,
    );
    let s: Arc<str> = Arc::from("s/m");
    for i in 0..3 {
        assert_eq!(b.flush_reason(t0), None);
        b.push(s.clone(), Timestamp::from_secs(i), 1.0, t0);
    }
    assert_eq!(b.flush_reason(t0), Some(FlushReason::Readings));
    assert!(b.is_full());
}

#[test]
fn a_window_of_one_flushes_every_message() {
    let p = policy(1);
    assert_eq!(p.ack_threshold(), 1);
    assert_eq!(policy(u16::MAX).ack_threshold(), 32_767);
}

/// A strict broker (it never has more than `window` unacknowledged messages out) feeding the
/// batcher with a one-hour flush interval, as an operator might configure to save SD writes.
/// Commits take `commit` of simulated time. If the policy waited for the interval, 10,000
/// messages through a window of 20 would take 500 simulated hours; the policy must instead get
/// them through at the rate of the commits, with no simulated hour ever passing.
#[test]
fn a_strict_broker_window_never_stalls_ingestion() {
    for window in [1u16, 2, 20, 100, 65_535] {
        let total = (4 * u64::from(window)).max(10_000);
        let commit = Duration::from_millis(5);
        let p = FlushPolicy {
            flush_interval: Duration::from_secs(3600),
            max_pending_readings: 100_000,
            window,
        };
        let mut b = Batcher::new(p, 3600);
        let start = Instant::now();
        let mut now = start;
        let mut sent = 0u64; // published by the broker
        let mut acked = 0u64;
        let mut committing: Option<(Instant, Vec<AckToken>)> = None;
        let mut queue: VecDeque<u64> = VecDeque::new(); // delivered, not yet read by the batcher
        // The last partial batch legitimately waits for the interval once traffic stops; every
        // message before it must be through without waiting.
        let before_tail = total - p.ack_threshold() as u64;
        while acked < before_tail {
            // The broker sends while its window has room.
            while sent < total && sent - acked < u64::from(window) {
                queue.push_back(sent);
                sent += 1;
            }
            // The ingest loop reads what arrived unless the batch is full.
            while !b.is_full() {
                let Some(i) = queue.pop_front() else { break };
                b.push(Arc::from("s/m"), Timestamp::from_secs(0), 1.0, now);
                b.push_ack(token(i), now);
            }
            // A finished commit releases its acks.
            if let Some((done_at, acks)) = committing.take_if(|(done_at, _)| *done_at <= now) {
                assert!(done_at <= now);
                acked += acks.len() as u64;
                continue;
            }
            // Hand a due batch to an idle writer.
            if committing.is_none() && b.flush_reason(now).is_some() {
                let (_batch, acks) = b.take();
                committing = Some((now + commit, acks));
                continue;
            }
            // Otherwise time moves to the next event: a commit ending or the flush deadline.
            let next = [committing.as_ref().map(|c| c.0), b.deadline()]
                .into_iter()
                .flatten()
                .min()
                .expect("with messages outstanding, some event is always ahead");
            now = now.max(next);
        }
        let elapsed = now - start;
        assert!(
            elapsed < Duration::from_secs(3600),
            "window {window}: {before_tail} messages took {elapsed:?} of simulated time"
        );
        // At least half a window per commit: never slower than the commits allow.
        let commits_needed = total.div_ceil(p.ack_threshold() as u64);
        assert!(
            elapsed <= commit * u32::try_from(commits_needed + 1).unwrap(),
            "window {window}: {elapsed:?} for {commits_needed} commits"
        );
    }
}
