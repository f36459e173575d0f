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

/// What a simulated run measured.
#[derive(Debug)]
struct Run {
    /// Time until all but the last partial batch was acknowledged.
    elapsed: Duration,
    commits: u32,
    stalls: u32,
}

/// Event-driven simulation of the ingest loop against a broker that never has more than
/// `broker_window` messages unacknowledged. Messages become available at `schedule` times
/// (offsets from the start); the broker delivers an available message as soon as its window
/// has room. Commits take `commit`. Runs until every message that is not in the final partial
/// batch is acknowledged.
fn simulate(p: FlushPolicy, broker_window: u64, schedule: &[Duration], commit: Duration) -> Run {
    simulate_nagle(p, broker_window, schedule, commit, None)
}

/// [`simulate`], and with `delayed_ack` a broker using Nagle's algorithm towards a receiver
/// that delays its TCP ACKs by that much: after a send, the broker holds what becomes available
/// until the delayed ACK comes, or until our acknowledgements (which carry the TCP ACK) arrive.
fn simulate_nagle(
    p: FlushPolicy,
    broker_window: u64,
    schedule: &[Duration],
    commit: Duration,
    delayed_ack: Option<Duration>,
) -> Run {
    let total = schedule.len() as u64;
    let mut b = Batcher::new(p, 3600);
    let start = Instant::now();
    let mut now = start;
    b.released(now); // connected
    let mut sent = 0u64;
    let mut acked = 0u64;
    let mut committing: Option<(Instant, Vec<AckToken>)> = None;
    let mut queue: VecDeque<u64> = VecDeque::new(); // delivered, not yet read by the batcher
    let mut run = Run {
        elapsed: Duration::ZERO,
        commits: 0,
        stalls: 0,
    };
    let tail = (total % p.ack_threshold() as u64).max(1);
    // When the broker's socket last sent, and whether our acks just gave it a TCP ACK.
    let mut last_send = start;
    let mut ack_came = true;
    while acked < total - tail {
        // The broker sends what is available while its window has room (and Nagle lets it).
        let may_send = ack_came || delayed_ack.is_none_or(|d| now >= last_send + d);
        while may_send
            && sent < total
            && sent - acked < broker_window
            && start + schedule[sent as usize] <= now
        {
            queue.push_back(sent);
            sent += 1;
            last_send = now;
            ack_came = false;
        }
        // The ingest loop reads what arrived unless the batch is full.
        while !b.is_full() {
            let Some(i) = queue.pop_front() else { break };
            b.arrived(now);
            b.push(Arc::from("s/m"), Timestamp::from_secs(0), 1.0, now);
            b.push_ack(token(i), now);
        }
        // A finished commit releases its acks.
        if let Some((_, acks)) = committing.take_if(|(done_at, _)| *done_at <= now) {
            acked += acks.len() as u64;
            b.released(now);
            ack_came = true;
            continue;
        }
        // Hand a due batch to an idle writer.
        if let Some(reason) = b.flush_reason(now).filter(|_| committing.is_none()) {
            run.commits += 1;
            run.stalls += u32::from(reason == FlushReason::Stall);
            let (_batch, acks) = b.take_for(reason);
            committing = Some((now + commit, acks));
            continue;
        }
        // Otherwise time moves to the next event: a commit ending, a flush falling due, or the
        // next message becoming available while the window has room.
        let next_message = (sent < total && sent - acked < broker_window).then(|| {
            let available = start + schedule[sent as usize];
            delayed_ack.map_or(available, |d| available.max(last_send + d))
        });
        let next = [committing.as_ref().map(|c| c.0), b.deadline(), next_message]
            .into_iter()
            .flatten()
            .min()
            .expect("with messages outstanding, some event is always ahead");
        assert!(
            next > now || !queue.is_empty() || next_message == Some(now),
            "time must advance"
        );
        now = now.max(next);
    }
    run.elapsed = now - start;
    run
}

fn flat_out(n: usize) -> Vec<Duration> {
    vec![Duration::ZERO; n]
}

/// A strict broker whose window is the one configured, with a one-hour flush interval as an
/// operator might set to save SD writes. Waiting for the interval would take 500 simulated
/// hours for 10,000 messages through a window of 20; the policy must get them through at the
/// speed of the commits.
#[test]
fn a_strict_broker_window_never_stalls_ingestion() {
    for window in [1u16, 2, 20, 100, 65_535] {
        let p = FlushPolicy {
            flush_interval: Duration::from_hours(1),
            max_pending_readings: 1_000_000,
            window,
        };
        let total = (4 * usize::from(window)).max(10_000);
        let commit = Duration::from_millis(5);
        let run = simulate(p, u64::from(window), &flat_out(total), commit);
        let commits_needed = total.div_ceil(p.ack_threshold());
        assert!(
            run.elapsed <= commit * u32::try_from(commits_needed + 1).unwrap(),
            "window {window}: {run:?} for {commits_needed} commits"
        );
    }
}

/// The broker enforces a smaller window than the one configured (rumqttd: 100; EMQX's default
/// `max_inflight`: 32; Mosquitto's v3.1.1 default: 20). The half-window rule never triggers; the
/// stall rule must keep messages flowing at roughly one window per quiet period plus commit.
#[test]
fn a_broker_window_smaller_than_configured_is_detected_as_a_stall() {
    for broker_window in [2u64, 20, 32, 100, 1000] {
        let p = FlushPolicy {
            flush_interval: Duration::from_hours(1),
            max_pending_readings: 1_000_000,
            window: 4096,
        };
        let commit = Duration::from_millis(5);
        let run = simulate(p, broker_window, &flat_out(20_000), commit);
        let cycles = 20_000u32.div_ceil(u32::try_from(broker_window).unwrap());
        assert!(
            run.elapsed <= QUIET_CONFIRM + (QUIET_MIN + commit) * (cycles + 1),
            "broker window {broker_window}: {run:?} for {cycles} cycles"
        );
        assert!(
            run.stalls + 1 >= run.commits,
            "commits are stall commits: {run:?}"
        );
    }
}

/// A broker with Nagle's algorithm on (Mosquitto's default) delivers a steady stream in bursts
/// paced by our TCP delayed ACKs: quiet gaps of 40 ms, each ended at once by our release. That
/// is not a full window: commits must come at the half window or the interval, not per burst
/// (with a 10 ms quiet rule: one commit of ~40 messages every 40 ms).
#[test]
fn bursts_paced_by_delayed_acks_are_not_stalls() {
    let p = FlushPolicy {
        flush_interval: Duration::from_secs(1),
        max_pending_readings: 1_000_000,
        window: 1024,
    };
    let seconds = 20u32;
    let steady: Vec<Duration> = (0..seconds * 1000)
        .map(|ms| Duration::from_millis(u64::from(ms)))
        .collect();
    for delayed_ack in [15, 40, 45] {
        let delayed_ack = Some(Duration::from_millis(delayed_ack));
        let run = simulate_nagle(p, 1024, &steady, Duration::from_millis(2), delayed_ack);
        // At most the end of the stream, a real pause, may count as a stall.
        assert!(run.stalls <= 1, "{delayed_ack:?}: {run:?}");
        // 512 messages (half the window) per commit at 1,000 messages/s.
        assert!(run.commits <= 2 * seconds + 1, "{delayed_ack:?}: {run:?}");
    }
}

/// Ordinary traffic must not look like a stall: a steady stream (with jitter) and a bursty one
/// are committed about once per flush interval, not once per message or per burst.
#[test]
fn steady_and_bursty_traffic_do_not_trigger_stall_flushes() {
    let p = FlushPolicy {
        flush_interval: Duration::from_secs(1),
        max_pending_readings: 1_000_000,
        window: 4096,
    };
    let commit = Duration::from_millis(5);
    let seconds = 30u32;
    // Steady: one message every 30..70 ms.
    let mut t = Duration::ZERO;
    let mut x = 12345u64;
    let mut steady = Vec::new();
    while t < Duration::from_secs(seconds.into()) {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        t += Duration::from_millis(30 + (x >> 33) % 41);
        steady.push(t);
    }
    let run = simulate(p, 4096, &steady, commit);
    assert!(run.commits <= seconds + 1, "steady: {run:?}");
    // Bursty: five messages 1 ms apart every 300 ms.
    let bursty: Vec<Duration> = (0..seconds * 1000 / 300)
        .flat_map(|burst| (0..5).map(move |i| Duration::from_millis(u64::from(burst * 300 + i))))
        .collect();
    let run = simulate(p, 4096, &bursty, commit);
    assert!(run.commits <= 2 * seconds + 1, "bursty: {run:?}");
}
