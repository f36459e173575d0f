use super::window::{ECHO_MAX, HANDSHAKE_MAX, QUIET_CONFIRM};
use super::*;
use crate::reading::Timestamp;

fn token(arrival: u64) -> AckToken {
    AckToken {
        arrival,
        connection: 1,
        session: 0,
        pkid: (arrival % 65_535 + 1) as u16,
        qos: 1,
    }
}

fn policy(window: u16) -> FlushPolicy {
    FlushPolicy {
        flush_interval: Duration::from_secs(1),
        max_pending_readings: 1000,
        window,
        broker_window: None,
        sessions: 1,
        quick_acks: false,
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

/// Found by the admission fuzzer (issue 20): two delta buckets counting `i64::MAX` readings each
/// overflowed the batch's reading count (a panic in debug builds; in release a wrap that hid a
/// full batch from `max_pending_readings`).
#[test]
fn huge_delta_counts_saturate_the_batch_reading_count() {
    let t0 = Instant::now();
    let mut b = Batcher::new(
        FlushPolicy {
            max_pending_readings: 1000,
            ..policy(100)
        },
        3600,
    );
    let mut huge = crate::summary::Summary::of(0, 1.0);
    huge.count = u64::try_from(i64::MAX).unwrap();
    for series in ["g:a/t", "g:b/t", "g:c/t"] {
        b.push_summary(Arc::from(series), 0, &huge, t0);
    }
    assert_eq!(b.pending_readings(), usize::MAX);
    assert_eq!(b.flush_reason(t0), Some(FlushReason::Readings));
}

#[test]
fn a_window_of_one_flushes_every_message() {
    let p = policy(1);
    assert_eq!(p.ack_threshold(), 1);
    assert_eq!(policy(u16::MAX).ack_threshold(), 32_767);
}

/// A batcher of `sessions` sessions, all connected, that learned a window of 5 on session 0
/// from a stall (the broker sent 5 and stopped); and when it did.
fn learned_five(sessions: u16) -> (Batcher, Instant) {
    let t0 = Instant::now();
    let p = FlushPolicy {
        flush_interval: Duration::from_hours(1),
        max_pending_readings: 1_000_000,
        window: 1024,
        broker_window: None,
        sessions,
        quick_acks: false,
    };
    let mut b = Batcher::new(p, 3600);
    for s in 0..sessions {
        b.connected(s, t0, Duration::ZERO);
    }
    for i in 1..=5 {
        b.arrived(t0, Duration::ZERO);
        b.push_ack(token(i), t0);
    }
    let stall = t0 + QUIET_CONFIRM;
    assert_eq!(b.flush_reason(stall), Some(FlushReason::Stall));
    let _ = b.take_for(FlushReason::Stall, stall);
    assert_eq!(b.window_seen(), Some(5));
    (b, stall)
}

/// A broker that honours the window we ask for but sends past a window wrongly learned (a pause
/// taken for a stall, then a larger burst): the learned window is forgotten as soon as the broker
/// has more unacknowledged, so commits go back to the half window.
#[test]
fn a_window_learned_wrong_is_forgotten_when_the_broker_sends_more() {
    let (mut b, stall) = learned_five(1);
    // While the commit runs, the broker keeps sending: it was not stopped by a window of 5.
    for i in 6..=8 {
        b.arrived(stall, Duration::ZERO);
        b.push_ack(token(i), stall);
    }
    assert_eq!(b.window_seen(), None);
    assert_eq!(b.flush_reason(stall), None);
}

/// After a reconnect, acks left from the old connection are not the new broker's to count: the
/// window learned on the new connection is what it sends, not that plus the leftovers.
#[test]
fn acks_of_an_earlier_connection_do_not_count_towards_the_window() {
    let t0 = Instant::now();
    let p = FlushPolicy {
        flush_interval: Duration::from_hours(1),
        max_pending_readings: 1_000_000,
        window: 1024,
        broker_window: Some(20),
        sessions: 1,
        quick_acks: false,
    };
    let mut b = Batcher::new(p, 3600);
    b.connected(0, t0, Duration::ZERO);
    for i in 1..=7 {
        b.arrived(t0, Duration::ZERO);
        b.push_ack(token(i), t0);
    }
    let t1 = t0 + Duration::from_millis(50);
    b.connected(0, t1, Duration::from_millis(3));
    for i in 8..27 {
        b.arrived(t1, Duration::ZERO);
        b.push_ack(token(i), t1);
        assert_eq!(b.flush_reason(t1), None, "{i}: 7 old + {} new", i - 7);
    }
    b.arrived(t1, Duration::ZERO);
    b.push_ack(token(27), t1);
    assert_eq!(b.flush_reason(t1), Some(FlushReason::BrokerWindow));
}

/// A connection whose handshake crawled (5 s: a broker under load) widens the echo window by at
/// most [`HANDSHAKE_MAX`]: a batch that began 2 s after the release was not released by it, so
/// its quiet proves nothing and teaches no window.
#[test]
fn a_slow_handshake_widens_the_echo_window_only_so_far() {
    let t0 = Instant::now();
    let mut b = Batcher::new(policy(1024), 3600);
    b.connected(0, t0, Duration::from_secs(5));
    let late = t0 + Duration::from_secs(2);
    b.arrived(late, Duration::ZERO);
    b.push_ack(token(1), late);
    assert_eq!(
        b.deadline(),
        Some(late + Duration::from_secs(1)),
        "the interval only"
    );
    let near = t0 + ECHO_MAX + HANDSHAKE_MAX;
    let mut b = Batcher::new(policy(1024), 3600);
    b.connected(0, t0, Duration::from_secs(5));
    b.arrived(near, Duration::ZERO);
    b.push_ack(token(1), near);
    assert_eq!(
        b.deadline(),
        Some(near + QUIET_CONFIRM),
        "an echo: the stall rule"
    );
}

/// Four sessions on a learned window of 20, as `windows::rumqttd_window_20_four_sessions` saw
/// it fail one run in six: while half of the windows was being committed, the next batch came
/// two messages short of the other half ([10, 10, 10, 8]) and went quiet, the broker waiting
/// for the acks being committed. The quiet before our release proves nothing: the batch waits
/// for the broker's refill after it and is committed as a full window, and the window stays 20
/// (it was once taken for a stall at the release and learned as 10, then forgotten and
/// learned again, a stall flush each). A later pause in traffic at fewer than 20 is committed
/// as a stall without shrinking the window.
#[test]
fn a_quiet_before_the_release_proves_no_stall_and_a_window_never_shrinks() {
    let hs = Duration::from_millis(7);
    let p = FlushPolicy {
        flush_interval: Duration::from_secs(1),
        max_pending_readings: 1_000_000,
        window: 4096,
        broker_window: None,
        sessions: 4,
        quick_acks: true,
    };
    let mut b = Batcher::new(p, 3600);
    let t0 = Instant::now();
    for s in 0..4 {
        b.connected(s, t0, hs);
    }
    let mut arrival = 0;
    let mut push = |b: &mut Batcher, counts: [u16; 4], at: Instant| {
        for (session, n) in (0..).zip(counts) {
            for _ in 0..n {
                arrival += 1;
                b.arrived(at, Duration::ZERO);
                b.push_ack(
                    AckToken {
                        session,
                        ..token(arrival)
                    },
                    at,
                );
            }
        }
    };
    let ms = Duration::from_millis;
    // The broker fills every session's window of 20 and stops; the refill proves it.
    push(&mut b, [20; 4], t0 + ms(1));
    let t = t0 + ms(1) + b.window.quiet_fast();
    assert_eq!(b.flush_reason(t), Some(FlushReason::Stall));
    let _ = b.take_for(FlushReason::Stall, t);
    assert_eq!(b.window_seen(), Some(20));
    // Half of the windows is committed...
    b.released(t + ms(2));
    push(&mut b, [10; 4], t + ms(3));
    assert_eq!(b.flush_reason(t + ms(3)), Some(FlushReason::BrokerWindow));
    let t = t + ms(3);
    let _ = b.take_for(FlushReason::BrokerWindow, t);
    // ...while the other half comes two short, then nothing while the commit runs 50 ms.
    push(&mut b, [10, 10, 10, 8], t + ms(1));
    let released = t + ms(50);
    b.released(released);
    assert_eq!(
        b.flush_reason(released),
        None,
        "the broker waited for our acks"
    );
    // The broker refills after the release: the batch holds half of the windows.
    push(&mut b, [0, 0, 0, 2], released + ms(1));
    assert_eq!(
        b.flush_reason(released + ms(1)),
        Some(FlushReason::BrokerWindow)
    );
    let _ = b.take_for(FlushReason::BrokerWindow, released + ms(1));
    assert_eq!(b.window_seen(), Some(20));
    // A pause in traffic at 3 unacknowledged: a stall commits it, the window stays 20.
    let released = released + ms(40);
    b.released(released);
    push(&mut b, [3, 0, 0, 0], released + ms(1));
    let t = released + ms(1) + b.window.quiet_fast();
    assert_eq!(b.flush_reason(t), Some(FlushReason::Stall));
    let _ = b.take_for(FlushReason::Stall, t);
    assert_eq!(b.window_seen(), Some(20));
}

/// Issue 42, seen once in CI under load (`windows::periodic_bursts_on_a_broker_without_a_window`,
/// three stall commits where at most two may be): devices report 20 messages every 100 ms on a
/// broker without a window. The interval flush, anchored at one burst, falls on another's start;
/// the commit's release came a few ms before a burst that was itself a few ms late, and the
/// broker had been quiet just before: that looked like the broker refilling a window of 20, and
/// was committed as a proven stall, though the broker had just had 200 messages unacknowledged
/// at once. A batch smaller than that proves no window while none is known.
#[test]
fn a_burst_right_after_a_release_proves_no_window_smaller_than_the_broker_has_sent() {
    let p = FlushPolicy {
        flush_interval: Duration::from_secs(1),
        max_pending_readings: 1_000_000,
        window: 4096,
        broker_window: None,
        sessions: 1,
        quick_acks: true,
    };
    let hs = Duration::from_millis(1);
    let ms = Duration::from_millis;
    let mut b = Batcher::new(p, 3600);
    let t0 = Instant::now();
    b.connected(0, t0, hs);
    let mut arrival = 0;
    let mut burst = |b: &mut Batcher, at: Instant| {
        for k in 0..20 {
            arrival += 1;
            let t = at + Duration::from_micros(50 * k);
            b.arrived(t, Duration::ZERO);
            b.push_ack(token(arrival), t);
        }
        at + Duration::from_micros(50 * 19)
    };
    // The first burst, 50 ms into the connection: the connection's one probe.
    let last = burst(&mut b, t0 + ms(50));
    let probe = last + b.window.quiet_fast();
    assert_eq!(b.flush_reason(probe), Some(FlushReason::Stall));
    let _ = b.take_for(FlushReason::Stall, probe);
    b.released(probe + ms(1));
    assert_eq!(b.window_seen(), None, "a probe teaches nothing");
    // Ten bursts, 100 ms apart: one interval's batch of 200, committed at its deadline.
    let opened = t0 + ms(150);
    for i in 0..10 {
        let last = burst(&mut b, opened + ms(100) * i);
        assert_eq!(
            b.flush_reason(last + b.window.quiet_fast()),
            None,
            "burst {i}"
        );
    }
    let deadline = opened + Duration::from_secs(1);
    assert_eq!(b.flush_reason(deadline), Some(FlushReason::Interval));
    let _ = b.take_for(FlushReason::Interval, deadline);
    // The commit takes 3 ms; the burst due at the deadline comes 4 ms late, right after the
    // release, densely, after a quiet: the shape of a broker refilling its window.
    b.released(deadline + ms(3));
    let last = burst(&mut b, deadline + ms(4));
    for wait in [b.window.quiet_fast(), QUIET_CONFIRM, ms(90)] {
        assert_eq!(
            b.flush_reason(last + wait),
            None,
            "20 unacknowledged after 200: no window, no stall"
        );
    }
    assert_eq!(b.window_seen(), None);
}

/// Issue 58, seen under load (`windows::periodic_bursts_on_a_broker_without_a_window::external_v5`,
/// a third commit where two may be): devices report 20 messages every 100 ms on a broker
/// without a window. The load stretched the handshake to 23 ms, the first burst came 27 ms
/// after the connection, inside the widened echo, and proved a "window of 20" by chance. The
/// next burst came 44 ms after that commit's release: late for an echo. A window just learned
/// must not commit such a burst at once (as a late refill read by a busy scheduler would be,
/// once an echo has confirmed the window): the next burst comes before the long quiet ends,
/// and the window is forgotten.
#[test]
fn a_window_proven_by_chance_commits_no_late_burst_of_periodic_publishers() {
    let p = FlushPolicy {
        flush_interval: Duration::from_secs(1),
        max_pending_readings: 1_000_000,
        window: 1024,
        broker_window: None,
        sessions: 1,
        quick_acks: true,
    };
    let ms = Duration::from_millis;
    let mut b = Batcher::new(p, 3600);
    let t0 = Instant::now();
    b.connected(0, t0, ms(23));
    let mut arrival = 0;
    let mut burst = |b: &mut Batcher, at: Instant| {
        for k in 0..20 {
            arrival += 1;
            let t = at + Duration::from_micros(370 * k);
            b.arrived(t, Duration::ZERO);
            b.push_ack(token(arrival), t);
        }
        at + Duration::from_micros(370 * 19)
    };
    let first = t0 + ms(27);
    let last = burst(&mut b, first);
    let proof = last + b.window.quiet_fast();
    assert_eq!(b.flush_reason(proof), Some(FlushReason::Stall));
    let _ = b.take_for(FlushReason::Stall, proof);
    assert_eq!(b.window_seen(), Some(20), "proven, by chance");
    b.released(proof + ms(1));
    // The next burst, 100 ms after the first: 44 ms after the release.
    let second = first + ms(100);
    let last = burst(&mut b, second);
    for at in [last, last + b.window.quiet_fast(), first + ms(199)] {
        assert_eq!(
            b.flush_reason(at),
            None,
            "a late burst of a window just learned"
        );
    }
    let _ = burst(&mut b, first + ms(200));
    assert_eq!(b.window_seen(), None, "40 unacknowledged: no window of 20");
}
