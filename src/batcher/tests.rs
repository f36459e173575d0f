use std::collections::VecDeque;

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

/// What a simulated run measured.
#[derive(Debug)]
struct Run {
    /// Time until all but a last partial batch was acknowledged (that one waits for the
    /// interval, and is counted in the commits).
    elapsed: Duration,
    commits: u32,
    stalls: u32,
    /// Commits of a known window the moment it was full.
    full: u32,
    intervals: u32,
}

/// A simulated broker and network.
#[derive(Debug, Clone, Copy)]
struct Net {
    /// The most QoS 1 messages the broker has unacknowledged.
    broker_window: u64,
    /// Round trip: a message reaches us, and our acks reach the broker, half of it later.
    rtt: Duration,
    /// With Nagle's algorithm on towards a receiver that delays its TCP ACKs by this much:
    /// after a send, the broker holds what becomes available until the delayed ACK comes, or
    /// until our acknowledgements (which carry the TCP ACK) arrive.
    delayed_ack: Option<Duration>,
    /// Every `qos0_every`-th message is QoS 0: the broker sends it whatever its window.
    qos0_every: Option<u64>,
    /// The time one message takes on the wire: a burst arrives spread out, not at one instant.
    per_message: Duration,
    /// Sessions on one shared subscription, served in turn as rumqttd and Mosquitto do: the
    /// broker stops when the session whose turn it is has `broker_window` unacknowledged.
    sessions: u16,
    /// From the `n`-th release on, our acks reach the broker this much later than the round
    /// trip says (a broker or a machine under load): its refill comes too late to be an echo.
    late_refills: Option<(u32, Duration)>,
}

impl Net {
    fn strict(broker_window: u64) -> Net {
        Net {
            broker_window,
            rtt: Duration::ZERO,
            delayed_ack: None,
            qos0_every: None,
            per_message: Duration::from_micros(50),
            sessions: 1,
            late_refills: None,
        }
    }
}

/// Event-driven simulation of the ingest loop against a broker that never has more than
/// `broker_window` QoS 1 messages unacknowledged. Messages become available at `schedule` times
/// (offsets from the start); the broker delivers an available message as soon as its window
/// has room (a QoS 0 one at once). Commits take `commit`. Runs until every QoS 1 message is
/// acknowledged.
fn simulate(p: FlushPolicy, net: Net, schedule: &[Duration], commit: Duration) -> Run {
    let total = schedule.len() as u64;
    let is_qos0 = |i: u64| net.qos0_every.is_some_and(|k| i % k == k - 1);
    let qos1_total = (0..total).filter(|&i| !is_qos0(i)).count() as u64;
    assert_eq!(p.sessions, net.sessions, "the policy knows the sessions");
    let half = net.rtt / 2;
    let mut b = Batcher::new(p, 3600);
    let start = Instant::now();
    let mut now = start;
    for session in 0..net.sessions {
        b.connected(session, now, net.rtt);
    }
    let sessions = usize::from(net.sessions);
    let turn_of = |i: u64| (i % u64::from(net.sessions)) as usize;
    let mut sent = 0u64;
    // Per session: QoS 1 messages the broker sent and has not had acknowledged.
    let mut unacked = vec![0u64; sessions];
    let mut acked = 0u64;
    let mut committing: Option<(Instant, Vec<AckToken>)> = None;
    let mut arriving: VecDeque<(Instant, u64)> = VecDeque::new(); // on the way to us
    // On the way to the broker: acks per session.
    let mut acks_arriving: VecDeque<(Instant, Vec<u64>)> = VecDeque::new();
    let mut run = Run {
        elapsed: Duration::ZERO,
        commits: 0,
        stalls: 0,
        full: 0,
        intervals: 0,
    };
    // What the final batch holds when it is not a whole half window or broker window: that
    // waits for the interval.
    let tail =
        qos1_total % (p.ack_threshold() as u64).min(net.broker_window * u64::from(net.sessions));
    // When the broker's socket last sent, and whether our acks just gave it a TCP ACK.
    let mut last_send = start;
    let mut ack_came = true;
    let mut releases = 0u32;
    let done = qos1_total - tail;
    while acked < qos1_total {
        // Acknowledgements reach the broker.
        while let Some((at, _)) = acks_arriving.front()
            && *at <= now
        {
            let (_, n) = acks_arriving.pop_front().unwrap();
            for (u, n) in unacked.iter_mut().zip(n) {
                *u -= n;
                acked += n;
            }
            ack_came = true;
        }
        if acked >= done && run.elapsed.is_zero() {
            run.elapsed = now - start;
        }
        if acked == qos1_total {
            break;
        }
        // The broker sends what is available while its window has room (and Nagle lets it).
        let may_send = ack_came || net.delayed_ack.is_none_or(|d| now >= last_send + d);
        while may_send
            && sent < total
            && (is_qos0(sent) || unacked[turn_of(sent)] < net.broker_window)
            && start + schedule[sent as usize] <= now
        {
            let on_wire = arriving.back().map_or(now, |a| a.0.max(now));
            arriving.push_back((on_wire.max(now + half) + net.per_message, sent));
            unacked[turn_of(sent)] += u64::from(!is_qos0(sent));
            sent += 1;
            last_send = now;
            ack_came = false;
        }
        // The ingest loop reads what arrived unless the batch is full.
        while !b.is_full() {
            let Some(&(at, i)) = arriving.front() else {
                break;
            };
            if at > now {
                break;
            }
            arriving.pop_front();
            b.push(Arc::from("s/m"), Timestamp::from_secs(0), 1.0, now);
            if !is_qos0(i) {
                b.arrived(now);
                let session = u16::try_from(turn_of(i)).unwrap();
                b.push_ack(
                    AckToken {
                        session,
                        ..token(i + 1)
                    },
                    now,
                );
            }
        }
        // A finished commit releases its acks.
        if let Some((_, acks)) = committing.take_if(|(done_at, _)| *done_at <= now) {
            let mut per_session = vec![0u64; sessions];
            for a in &acks {
                per_session[usize::from(a.session)] += 1;
            }
            releases += 1;
            let late = net
                .late_refills
                .filter(|(from, _)| releases >= *from)
                .map_or(Duration::ZERO, |(_, d)| d);
            acks_arriving.push_back((now + half + late, per_session));
            b.released(now);
            continue;
        }
        // Hand a due batch to an idle writer.
        if let Some(reason) = b.flush_reason(now).filter(|_| committing.is_none()) {
            run.commits += 1;
            run.stalls += u32::from(reason == FlushReason::Stall);
            run.full += u32::from(reason == FlushReason::BrokerWindow);
            run.intervals += u32::from(reason == FlushReason::Interval);
            let (_batch, acks) = b.take_for(reason, now);
            committing = Some((now + commit, acks));
            continue;
        }
        // Otherwise time moves to the next event: a commit ending, a flush falling due, a
        // message or acks arriving, or the next message becoming available while the window
        // has room.
        let next_message = (sent < total
            && (is_qos0(sent) || unacked[turn_of(sent)] < net.broker_window))
            .then(|| {
                let available = start + schedule[sent as usize];
                net.delayed_ack
                    .filter(|_| !ack_came)
                    .map_or(available, |d| available.max(last_send + d))
            });
        let next_arrival = arriving.front().map(|a| a.0).filter(|_| !b.is_full());
        let next = [
            committing.as_ref().map(|c| c.0),
            // The ingest loop waits for no deadline while a commit runs.
            b.deadline().filter(|_| committing.is_none()),
            next_message,
            next_arrival,
            acks_arriving.front().map(|a| a.0),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or_else(|| {
            panic!(
                "with messages outstanding, some event is always ahead: sent {sent}, acked \
                 {acked}, unacked {unacked:?}, arriving {}, pending {}, {run:?}",
                arriving.len(),
                b.pending_acks()
            )
        });
        assert!(next > now, "time must advance");
        now = next;
    }
    run
}

fn flat_out(n: usize) -> Vec<Duration> {
    vec![Duration::ZERO; n]
}

/// One session asking for a window of 4,096, flush interval 1 s, nothing stated: the window,
/// if any, is the broker's to show.
fn learning_policy(quick_acks: bool) -> FlushPolicy {
    FlushPolicy {
        flush_interval: Duration::from_secs(1),
        max_pending_readings: 1_000_000,
        window: 4096,
        broker_window: None,
        sessions: 1,
        quick_acks,
    }
}

/// (broker window, flush interval ms, round trip ms, every how many messages one is QoS 0,
/// quick ACKs): every combination of the windows given with the intervals, round trips, QoS
/// mixes and ACK modes the window tests cover.
fn cases(windows: &[u64]) -> Vec<(u64, u64, u64, Option<u64>, bool)> {
    let mut out = Vec::new();
    for &w in windows {
        for flush_ms in [200, 1000, 3_600_000] {
            for rtt_ms in [0, 150] {
                for qos0_every in [None, Some(3)] {
                    for quick_acks in [false, true] {
                        out.push((w, flush_ms, rtt_ms, qos0_every, quick_acks));
                    }
                }
            }
        }
    }
    out
}

/// The longest the first window may take to be learned: the long quiet ([`QUIET_CONFIRM`], or
/// three quarters of a shorter interval), or with quick ACKs and a window of two or more the
/// short one (twice the handshake time, which the simulation makes the round trip, at least
/// [`QUIET_FAST_MIN`]).
fn learning(p: &FlushPolicy, broker_window: u64, rtt: Duration) -> Duration {
    let long = QUIET_CONFIRM.min(p.flush_interval / 4 * 3);
    if p.quick_acks && broker_window >= 2 {
        (rtt * 2).max(QUIET_FAST_MIN).min(long)
    } else {
        long
    }
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
            broker_window: None,
            sessions: 1,
            quick_acks: false,
        };
        let total = (4 * usize::from(window)).max(10_000);
        let commit = Duration::from_millis(5);
        let net = Net::strict(u64::from(window));
        let run = simulate(p, net, &flat_out(total), commit);
        let commits_needed = total.div_ceil(p.ack_threshold());
        let on_wire = net.per_message * u32::try_from(total).unwrap();
        assert!(
            run.elapsed <= commit * u32::try_from(commits_needed + 1).unwrap() + on_wire,
            "window {window}: {run:?} for {commits_needed} commits"
        );
    }
}

/// The broker enforces a smaller window than the one asked for (upstream Mosquitto's v3.1.1
/// default: 20; EMQX: 32; AWS `IoT` Core and rumqttd: 100). The half-window rule never triggers: the
/// first window is learned from a stall, and from then on every window is committed the moment
/// it is full. One commit per window (plus the tail), none waiting for the interval, whatever
/// the interval, the round trip, or QoS 0 messages mixed in; and the time is the physical
/// limit (a round trip and a commit per window) plus the one learning pause ([`learning`]: with
/// quick ACKs and a window of two or more, twice the round trip and at least 20 ms, not 250 ms).
#[test]
fn a_broker_window_smaller_than_asked_for_commits_once_per_window() {
    let commit = Duration::from_millis(2);
    for (broker_window, flush_ms, rtt_ms, qos0_every, quick_acks) in cases(&[1, 2, 20, 32, 100]) {
        let p = FlushPolicy {
            flush_interval: Duration::from_millis(flush_ms),
            max_pending_readings: 1_000_000,
            window: 4096,
            broker_window: None,
            sessions: 1,
            quick_acks,
        };
        let net = Net {
            rtt: Duration::from_millis(rtt_ms),
            qos0_every,
            ..Net::strict(broker_window)
        };
        let windows = 50u32;
        let mut total = u64::from(windows) * broker_window;
        if let Some(k) = qos0_every {
            total = total * k / (k - 1);
        }
        let run = simulate(p, net, &flat_out(total as usize), commit);
        let case = format!(
            "window {broker_window}, flush {flush_ms} ms, rtt {rtt_ms} ms, qos0 \
             {qos0_every:?}, quick acks {quick_acks}: {run:?}"
        );
        assert!(run.intervals == 0, "{case}");
        assert!(run.commits <= windows + 1, "{case}");
        // One stall teaches the window; every later window is committed when full.
        assert!(run.stalls <= 1, "{case}");
        assert!(run.full + 1 >= windows, "{case}");
        let learning = learning(&p, broker_window, net.rtt);
        let on_wire = net.per_message * u32::try_from(total).unwrap();
        let limit = learning + (net.rtt + commit) * (windows + 1) + on_wire;
        assert!(run.elapsed <= limit, "{case}: over {limit:?}");
    }
}

/// `mqtt.sessions = 4` on a broker that serves a shared group in turn and stops at the window
/// of the session whose turn it is (rumqttd, Mosquitto): the four windows fill together. After
/// the one learning pause, every commit takes half of the four windows, so that the other half
/// arrives while it runs: at most two commits per four windows and none for the interval; and the
/// time is within four windows per round trip plus two commits (one session: one window).
#[test]
fn four_sessions_commit_half_of_their_windows_at_a_time() {
    let commit = Duration::from_millis(2);
    let sessions = 4u16;
    for (broker_window, flush_ms, rtt_ms, qos0_every, quick_acks) in cases(&[1, 20, 32, 100]) {
        if flush_ms > 1000 {
            continue;
        }
        let p = FlushPolicy {
            flush_interval: Duration::from_millis(flush_ms),
            max_pending_readings: 1_000_000,
            window: 4096,
            broker_window: None,
            sessions,
            quick_acks,
        };
        let net = Net {
            rtt: Duration::from_millis(rtt_ms),
            qos0_every,
            sessions,
            ..Net::strict(broker_window)
        };
        let groups = 50u32; // of four windows each
        let group = broker_window * u64::from(sessions);
        let mut total = u64::from(groups) * group;
        if let Some(k) = qos0_every {
            total = total * k / (k - 1);
        }
        let run = simulate(p, net, &flat_out(total as usize), commit);
        let case = format!(
            "window {broker_window} x {sessions} sessions, flush {flush_ms} ms, rtt \
             {rtt_ms} ms, qos0 {qos0_every:?}, quick acks {quick_acks}: {run:?}"
        );
        assert!(run.intervals == 0, "{case}");
        assert!(run.stalls <= 1, "{case}");
        // A window of 1 is full at every message: what arrives during a commit
        // is the next batch, however small.
        let most = if broker_window == 1 { group } else { 2 } * u64::from(groups);
        assert!(u64::from(run.commits) <= most + 2, "{case}");
        assert!(run.full + 2 >= run.commits, "{case}");
        let learning = learning(&p, broker_window, net.rtt);
        let on_wire = net.per_message * u32::try_from(total).unwrap();
        let limit = learning + (net.rtt + commit * 2) * (groups + 1) + on_wire;
        assert!(run.elapsed <= limit, "{case}: over {limit:?}");
    }
}

/// The first window of a connection echoes no release: the publishers start two seconds after
/// the connection. With quick ACKs the connection's probe commits the first burst after the
/// short quiet and the broker's refill proves the window: learning takes two short quiets, not
/// the interval (without quick ACKs: two long ones); one commit more at most (the probe), none
/// for the interval.
#[test]
fn the_first_window_of_a_connection_is_learned_from_its_refill() {
    let commit = Duration::from_millis(2);
    let late = Duration::from_secs(2);
    for quick_acks in [false, true] {
        for broker_window in [2u64, 20, 100] {
            let p = learning_policy(quick_acks);
            let net = Net::strict(broker_window);
            let windows = 50u32;
            let total = u64::from(windows) * broker_window;
            let schedule = vec![late; total as usize];
            let run = simulate(p, net, &schedule, commit);
            let case = format!("window {broker_window}, quick acks {quick_acks}: {run:?}");
            assert_eq!(run.intervals, 0, "{case}");
            assert!(run.commits <= windows + 1, "{case}");
            let learning = if quick_acks {
                QUIET_FAST_MIN
            } else {
                QUIET_CONFIRM
            } * 2;
            let on_wire = net.per_message * u32::try_from(total).unwrap();
            let limit = late + learning + commit * (windows + 1) + on_wire;
            assert!(run.elapsed <= limit, "{case}: over {limit:?}");
        }
    }
}

/// A window stated by the operator (`mqtt.broker_window`) needs no learning pause: the first
/// window already commits the moment it is full.
#[test]
fn a_stated_broker_window_commits_from_the_first_window_on() {
    let commit = Duration::from_millis(2);
    for broker_window in [1u16, 20] {
        let p = FlushPolicy {
            flush_interval: Duration::from_hours(1),
            max_pending_readings: 1_000_000,
            window: 4096,
            broker_window: Some(broker_window),
            sessions: 1,
            quick_acks: false,
        };
        let windows = 50u32;
        let total = windows as usize * usize::from(broker_window);
        let net = Net::strict(broker_window.into());
        let run = simulate(p, net, &flat_out(total), commit);
        assert_eq!(run.full, run.commits, "{run:?}");
        let on_wire = net.per_message * u32::try_from(total).unwrap();
        assert!(run.elapsed <= commit * windows + on_wire, "{run:?}");
    }
}

/// A broker that honours the window we ask for but sends past a window wrongly learned (a pause
/// taken for a stall, then a larger burst): the learned window is forgotten as soon as the broker
/// has more unacknowledged, so commits go back to the half window.
#[test]
fn a_window_learned_wrong_is_forgotten_when_the_broker_sends_more() {
    let t0 = Instant::now();
    let p = FlushPolicy {
        flush_interval: Duration::from_hours(1),
        max_pending_readings: 1_000_000,
        window: 1024,
        broker_window: None,
        sessions: 1,
        quick_acks: false,
    };
    let mut b = Batcher::new(p, 3600);
    b.connected(0, t0, Duration::ZERO);
    for i in 1..=5 {
        b.arrived(t0);
        b.push_ack(token(i), t0);
    }
    let stall = t0 + QUIET_CONFIRM;
    assert_eq!(b.flush_reason(stall), Some(FlushReason::Stall));
    let _ = b.take_for(FlushReason::Stall, stall);
    assert_eq!(b.window_seen(), Some(5));
    // While the commit runs, the broker keeps sending: it was not stopped by a window of 5.
    for i in 6..=8 {
        b.arrived(stall);
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
        b.arrived(t0);
        b.push_ack(token(i), t0);
    }
    let t1 = t0 + Duration::from_millis(50);
    b.connected(0, t1, Duration::from_millis(3));
    for i in 8..27 {
        b.arrived(t1);
        b.push_ack(token(i), t1);
        assert_eq!(b.flush_reason(t1), None, "{i}: 7 old + {} new", i - 7);
    }
    b.arrived(t1);
    b.push_ack(token(27), t1);
    assert_eq!(b.flush_reason(t1), Some(FlushReason::BrokerWindow));
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
        broker_window: None,
        sessions: 1,
        quick_acks: false,
    };
    let seconds = 20u32;
    let steady: Vec<Duration> = (0..seconds * 1000)
        .map(|ms| Duration::from_millis(u64::from(ms)))
        .collect();
    for delayed_ack in [15, 40, 45] {
        let delayed_ack = Some(Duration::from_millis(delayed_ack));
        let net = Net {
            delayed_ack,
            ..Net::strict(1024)
        };
        let run = simulate(p, net, &steady, Duration::from_millis(2));
        // At most the end of the stream, a real pause, may count as a stall.
        assert!(run.stalls <= 1, "{delayed_ack:?}: {run:?}");
        // 512 messages (half the window) per commit at 1,000 messages/s.
        assert!(run.commits <= 2 * seconds + 1, "{delayed_ack:?}: {run:?}");
    }
}

/// Ordinary traffic must not look like a stall: a steady stream (with jitter) and a bursty one
/// are committed about once per flush interval, not once per message or per burst, with quick
/// ACKs (the short quiet) as without.
#[test]
fn steady_and_bursty_traffic_do_not_trigger_stall_flushes() {
    for quick_acks in [false, true] {
        let p = learning_policy(quick_acks);
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
        let run = simulate(p, Net::strict(4096), &steady, commit);
        assert!(run.commits <= seconds + 1, "steady, {quick_acks}: {run:?}");
        // Bursty: five messages 1 ms apart every 300 ms.
        let bursty: Vec<Duration> = (0..seconds * 1000 / 300)
            .flat_map(|burst| {
                (0..5).map(move |i| Duration::from_millis(u64::from(burst * 300 + i)))
            })
            .collect();
        let run = simulate(p, Net::strict(4096), &bursty, commit);
        assert!(
            run.commits <= 2 * seconds + 1,
            "bursty, {quick_acks}: {run:?}"
        );
    }
}

/// Random (Poisson) arrivals at 20, 200 and 2,000 messages/s through a broker that enforces no
/// window, with quick ACKs: the short quiet rule must not turn chance gaps into commits. About
/// one commit per flush interval (the half window is never reached), a few more at most.
#[test]
fn random_arrivals_are_not_taken_for_a_window_with_quick_acks() {
    let p = FlushPolicy {
        flush_interval: Duration::from_secs(1),
        max_pending_readings: 1_000_000,
        window: 65_535,
        broker_window: None,
        sessions: 1,
        quick_acks: true,
    };
    let seconds = 60u32;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for rate in [20.0f64, 200.0, 2000.0] {
        let mut t = 0.0f64;
        let mut schedule = Vec::new();
        while t < f64::from(seconds) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            t += -(1.0 - u).ln() / rate;
            schedule.push(Duration::from_secs_f64(t));
        }
        let run = simulate(
            p,
            Net::strict(65_535),
            &schedule,
            Duration::from_micros(200),
        );
        assert!(
            run.commits <= seconds + seconds / 10,
            "{rate} messages/s: {run:?}"
        );
    }
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
    b.arrived(late);
    b.push_ack(token(1), late);
    assert_eq!(
        b.deadline(),
        Some(late + Duration::from_secs(1)),
        "the interval only"
    );
    let near = t0 + ECHO_MAX + HANDSHAKE_MAX;
    let mut b = Batcher::new(policy(1024), 3600);
    b.connected(0, t0, Duration::from_secs(5));
    b.arrived(near);
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
                b.arrived(at);
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
    let t = t0 + ms(1) + b.quiet_fast();
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
    let t = released + ms(1) + b.quiet_fast();
    assert_eq!(b.flush_reason(t), Some(FlushReason::Stall));
    let _ = b.take_for(FlushReason::Stall, t);
    assert_eq!(b.window_seen(), Some(20));
}

/// Issue 42: on a broker without an in-flight window (Debian's Mosquitto, MQTT 5), 20 messages
/// every 100 ms made bucketd learn a "window of 20" from the bursts and commit 10 to 20 times a
/// second, 4x the bytes an SD card took at one commit a second; a single message and a pause
/// taught a window of 1 likewise. Whatever the pattern, the round trip or the commit time, a
/// broker that never stops at a window gets one commit per `flush_interval` (plus the
/// connection's one probe and the bursts around its first moments), over a minute.
#[test]
fn a_broker_without_a_window_gets_one_commit_per_interval_whatever_the_pattern() {
    // (messages per burst, period): independent devices, one burst a second, 20 every 100 ms...
    let patterns: [(usize, u64); 8] = [
        (1, 5),
        (200, 1000),
        (20, 100),
        (5, 50),
        (20, 250),
        (1, 300),
        (3, 700),
        (1, 1000),
    ];
    let commits = |secs: u64, burst: usize, period_ms: u64, p: FlushPolicy, net: Net, commit| {
        let mut schedule = Vec::new();
        for k in 0..(secs * 1000 / period_ms) {
            for j in 0..burst {
                let at =
                    Duration::from_millis(k * period_ms) + Duration::from_micros(j as u64 * 30);
                schedule.push(at);
            }
        }
        simulate(p, net, &schedule, commit)
    };
    for quick_acks in [false, true] {
        for (burst, period_ms) in patterns {
            for rtt_ms in [0u64, 1, 20] {
                for commit_us in [100u64, 1_000, 5_000] {
                    let p = FlushPolicy {
                        window: 1024,
                        ..learning_policy(quick_acks)
                    };
                    let net = Net {
                        rtt: Duration::from_millis(rtt_ms),
                        ..Net::strict(u64::MAX)
                    };
                    let commit = Duration::from_micros(commit_us);
                    let minute = commits(60, burst, period_ms, p, net, commit);
                    let two = commits(120, burst, period_ms, p, net, commit);
                    let case = format!(
                        "{burst} every {period_ms} ms, rtt {rtt_ms} ms, commit {commit_us} us, \
                         quick ACKs {quick_acks}: {minute:?}, {two:?}"
                    );
                    // The start: the probe, and a window learned by chance and forgotten.
                    assert!(minute.commits <= 60 + 6, "{case}");
                    // Then exactly one commit per interval.
                    assert!(two.commits - minute.commits <= 60 + 1, "{case}");
                }
            }
        }
    }
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
            b.arrived(t);
            b.push_ack(token(arrival), t);
        }
        at + Duration::from_micros(50 * 19)
    };
    // The first burst, 50 ms into the connection: the connection's one probe.
    let last = burst(&mut b, t0 + ms(50));
    let probe = last + b.quiet_fast();
    assert_eq!(b.flush_reason(probe), Some(FlushReason::Stall));
    let _ = b.take_for(FlushReason::Stall, probe);
    b.released(probe + ms(1));
    assert_eq!(b.window_seen(), None, "a probe teaches nothing");
    // Ten bursts, 100 ms apart: one interval's batch of 200, committed at its deadline.
    let opened = t0 + ms(150);
    for i in 0..10 {
        let last = burst(&mut b, opened + ms(100) * i);
        assert_eq!(b.flush_reason(last + b.quiet_fast()), None, "burst {i}");
    }
    let deadline = opened + Duration::from_secs(1);
    assert_eq!(b.flush_reason(deadline), Some(FlushReason::Interval));
    let _ = b.take_for(FlushReason::Interval, deadline);
    // The commit takes 3 ms; the burst due at the deadline comes 4 ms late, right after the
    // release, densely, after a quiet: the shape of a broker refilling its window.
    b.released(deadline + ms(3));
    let last = burst(&mut b, deadline + ms(4));
    for wait in [b.quiet_fast(), QUIET_CONFIRM, ms(90)] {
        assert_eq!(
            b.flush_reason(last + wait),
            None,
            "20 unacknowledged after 200: no window, no stall"
        );
    }
    assert_eq!(b.window_seen(), None);
}

/// `ingest::a_strict_broker_window_does_not_stall_a_long_flush_interval` hung under CPU load
/// (2 of 2 runs with two busy loops beside it): with the window learned (100), a refill that
/// came later than an echo filled the window and went quiet, and nothing committed it: the
/// learned window commits only echoes, and a quiet after a batch that is no echo proved nothing.
/// A batch that fills a window an echo has confirmed and then goes quiet is committed after
/// [`LATE_REFILL_QUIETS`] confirming quiets, however late it came.
#[test]
fn a_late_refill_of_a_known_window_is_committed_after_a_quiet() {
    let commit = Duration::from_millis(2);
    // Refills in one burst (with quick ACKs and without), and trickling in (10 ms a message:
    // no burst; without quick ACKs, whose probe needs a burst to learn the first window).
    for (per_message, quick_acks) in [
        (Duration::from_micros(50), false),
        (Duration::from_micros(50), true),
        (Duration::from_millis(10), false),
    ] {
        // The daemon's test: a one-hour interval, so that only the window rules commit.
        let p = FlushPolicy {
            flush_interval: Duration::from_hours(1),
            ..learning_policy(quick_acks)
        };
        let late = Duration::from_millis(400);
        let net = Net {
            late_refills: Some((4, late)),
            per_message,
            ..Net::strict(100)
        };
        let windows = 30u32;
        let run = simulate(p, net, &flat_out(windows as usize * 100), commit);
        let case = format!("{per_message:?} a message, quick acks {quick_acks}: {run:?}");
        assert_eq!(run.intervals, 0, "{case}");
        assert!(run.commits <= windows + 2, "{case}");
        let on_wire = per_message * windows * 100;
        let limit = (late + QUIET_CONFIRM * LATE_REFILL_QUIETS + commit) * windows
            + on_wire
            + Duration::from_secs(1);
        assert!(run.elapsed <= limit, "{case}: over {limit:?}");
    }
}
