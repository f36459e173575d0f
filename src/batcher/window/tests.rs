//! The learner on its own, table by table: each row a script of what the broker and the loop did
//! (times in ms from the connection), and when the rules of the module docs say the window is
//! full, worked out by hand from those rules (the constants' values are in each row's note).
use super::*;

use FlushReason::{BrokerWindow, Stall};

/// One thing that happened, at a time in ms after the connection (`Connect` is at 0).
#[derive(Debug, Clone, Copy)]
enum Step {
    /// QoS 1/2 messages of `session`, one a ms from `from`.
    Msgs { session: usize, from: u64, n: u64 },
    /// The batch is taken for `reason`.
    Take { at: u64, reason: FlushReason },
    /// Its acks are queued (a release).
    Release { at: u64 },
    /// A marker PINGREQ goes out behind the release.
    Ping,
    /// Its answer comes.
    Answer { at: u64 },
    /// A session connects again.
    Reconnect { session: u16, at: u64 },
}

use Step::{Answer, Msgs, Ping, Reconnect, Release, Take};

/// `n` messages of `session`, one a ms from `from`.
const fn msgs(session: usize, from: u64, n: u64) -> Step {
    Msgs { session, from, n }
}

/// The batch taken at `at` for `reason`.
const fn take(at: u64, reason: FlushReason) -> Step {
    Take { at, reason }
}

struct Case {
    name: &'static str,
    quick_acks: bool,
    stated: Option<u16>,
    sessions: u16,
    steps: &'static [Step],
    /// When the window counts as full after the steps, and why.
    full_at: Option<(u64, FlushReason)>,
    /// The window learned after the steps.
    seen: Option<usize>,
}

fn policy(c: &Case) -> FlushPolicy {
    FlushPolicy {
        // The long quiet is QUIET_CONFIRM (250 ms) with a 1 s interval.
        flush_interval: Duration::from_secs(1),
        max_pending_readings: usize::MAX,
        window: 100,
        broker_window: c.stated,
        sessions: c.sessions,
        quick_acks: c.quick_acks,
    }
}

/// Plays a case's steps on a learner connected at `t0` (handshake 0 ms): what it says then.
fn play(c: &Case, t0: Instant) -> (Option<(u64, FlushReason)>, Learner) {
    let ms = |m: u64| t0 + Duration::from_millis(m);
    let mut l = Learner::new(policy(c));
    for s in 0..c.sessions {
        l.connected(s, t0, Duration::ZERO);
    }
    for step in c.steps {
        match *step {
            Msgs { session, from, n } => {
                for i in 0..n {
                    l.arrived(ms(from + i), Duration::ZERO);
                    l.ack(session);
                }
            }
            Take { at, reason } => l.take_for(reason, ms(at)),
            Release { at } => l.released(ms(at)),
            Ping => l.release_pinged(),
            Answer { at } => l.release_answered(ms(at)),
            Reconnect { session, at } => l.connected(session, ms(at), Duration::ZERO),
        }
    }
    let full = l
        .full_at()
        .map(|(at, why)| (at.duration_since(t0).as_millis() as u64, why));
    (full, l)
}

/// The defaults of a row: one session, no quick ACKs, no window stated; not full and nothing
/// learned after its steps.
const ONE: Case = Case {
    name: "",
    quick_acks: false,
    stated: None,
    sessions: 1,
    steps: &[],
    full_at: None,
    seen: None,
};

const CASES: &[Case] = &[
    Case {
        name: "a stated window is full the moment the batch holds it",
        stated: Some(5),
        steps: &[msgs(0, 1, 5)],
        full_at: Some((5, BrokerWindow)),
        ..ONE
    },
    Case {
        name: "short of a stated window, an echo of the connection stalls after the long quiet",
        stated: Some(5),
        // First at 1 ms: within ECHO_MAX (100 ms) of the connection; last at 4 + 250.
        steps: &[msgs(0, 1, 4)],
        full_at: Some((254, Stall)),
        ..ONE
    },
    Case {
        name: "without quick ACKs an echo's burst stalls after the long quiet and teaches it",
        // 20 from 1 ms to 20 ms, quiet until 20 + 250: proven (an echo of a release that
        // found the broker quiet), so the count is learned.
        steps: &[msgs(0, 1, 20), take(270, Stall)],
        seen: Some(20),
        ..ONE
    },
    Case {
        name: "with quick ACKs a dense echo stalls after the short quiet",
        quick_acks: true,
        // First within ECHO_FAST (5 ms); 19 gaps of 1 ms x BURST_RATIO (8) under the short
        // quiet (QUIET_FAST_MIN, 20 ms) per gap: a burst. Last at 20, + 20 ms.
        steps: &[msgs(0, 1, 20)],
        full_at: Some((40, Stall)),
        ..ONE
    },
    Case {
        name: "a burst long after the release is only the connection's probe",
        // First at 500 ms: no echo (over 100 ms); a dense burst: the probe, after the long
        // quiet from its last (519 + 250); taken, it teaches nothing.
        steps: &[msgs(0, 500, 20), take(769, Stall)],
        ..ONE
    },
    Case {
        name: "the probe's refill, an echo of its release, proves the window",
        // The probe above, released at 800 (quiet since 519); 20 more at 801..820, within
        // ECHO_MAX: the refill, stalled after the long quiet (820 + 250), proves 20.
        steps: &[
            msgs(0, 500, 20),
            take(769, Stall),
            Release { at: 800 },
            msgs(0, 801, 20),
            take(1070, Stall),
        ],
        seen: Some(20),
        ..ONE
    },
    Case {
        name: "a refill after a release that did not find the broker quiet proves nothing",
        // The probe taken at the interval while the burst ran (its last at 519), released at
        // 525, within the short quiet (20 ms) of it: the broker was still sending, so the
        // 20 after it are no refill; the stall after them (545 + 250) teaches nothing.
        steps: &[
            msgs(0, 500, 20),
            take(520, FlushReason::Interval),
            Release { at: 525 },
            msgs(0, 526, 20),
            take(795, Stall),
        ],
        ..ONE
    },
    Case {
        name: "a learned window is full at once when an echo's burst reaches it",
        steps: &[
            msgs(0, 1, 20),
            take(270, Stall),
            Release { at: 300 },
            msgs(0, 301, 20),
        ],
        full_at: Some((320, BrokerWindow)),
        seen: Some(20),
        ..ONE
    },
    Case {
        name: "more unacknowledged than the learned window: it was not the broker's",
        // 20 learned, then 21 after the release: forgotten at the 21st, and the batch is
        // again a possible window, stalled after the long quiet (321 + 250).
        steps: &[
            msgs(0, 1, 20),
            take(270, Stall),
            Release { at: 300 },
            msgs(0, 301, 21),
        ],
        full_at: Some((571, Stall)),
        ..ONE
    },
    Case {
        name: "a stall at fewer than already sent unacknowledged is a pause, not a window",
        // 20 unacknowledged at once (the floor), then a release and 5 as an echo: no
        // window below 20; no stall while under the floor with none known.
        steps: &[
            msgs(0, 500, 20),
            take(769, Stall),
            Release { at: 800 },
            msgs(0, 801, 5),
        ],
        ..ONE
    },
    Case {
        name: "with four sessions one full window waits for the marker's answer",
        stated: Some(5),
        sessions: 4,
        // Session 0's window of 5 is full at 305, but the release's marker is unanswered:
        // the others' refills are on their way, and half of all four (10) is not reached.
        // Until the answer, an echo stalls after the long quiet (305 + 250).
        steps: &[Release { at: 300 }, Ping, msgs(0, 301, 5)],
        full_at: Some((555, Stall)),
        ..ONE
    },
    Case {
        name: "with four sessions the marker's answer makes one full window enough",
        stated: Some(5),
        sessions: 4,
        steps: &[
            Release { at: 300 },
            Ping,
            msgs(0, 301, 5),
            Answer { at: 306 },
        ],
        full_at: Some((305, BrokerWindow)),
        ..ONE
    },
    Case {
        name: "with four sessions half of all their windows is full whatever the marker",
        stated: Some(5),
        sessions: 4,
        steps: &[
            Release { at: 300 },
            Ping,
            msgs(0, 301, 4),
            msgs(1, 305, 4),
            msgs(2, 309, 2),
        ],
        full_at: Some((310, BrokerWindow)),
        ..ONE
    },
    Case {
        name: "with two sessions one session's stall teaches the window they share",
        sessions: 2,
        steps: &[msgs(0, 1, 20), take(270, Stall)],
        seen: Some(20),
        ..ONE
    },
    // The window learned is shared (one broker, one limit for each of its sessions), and a
    // reconnect of any session forgets it for all: the connection may be to another broker, or
    // to the same one restarted with another limit; learning it again costs a probe, where
    // keeping a wrong window would commit every few messages.
    Case {
        name: "one session's reconnect forgets the window learned for all",
        sessions: 2,
        steps: &[
            msgs(0, 1, 20),
            take(270, Stall),
            Reconnect {
                session: 1,
                at: 300,
            },
        ],
        ..ONE
    },
];

#[test]
fn when_the_window_is_full_and_what_is_learned() {
    let t0 = Instant::now();
    for c in CASES {
        let (full, l) = play(c, t0);
        assert_eq!(full, c.full_at, "{}: full at", c.name);
        assert_eq!(l.window_seen(), c.seen, "{}: learned", c.name);
    }
}

/// The log line's news: a window learned where none was known, once per connection.
#[test]
fn a_learned_window_is_news_once_per_connection() {
    let t0 = Instant::now();
    let ms = |m: u64| t0 + Duration::from_millis(m);
    let c = &CASES[2];
    let (_, mut l) = play(c, t0);
    assert_eq!(l.newly_learned(), Some(20));
    assert_eq!(l.newly_learned(), None, "told once");
    // Forgotten (more than 20 sent) and learned again on the same connection: no news.
    for i in 0..21 {
        l.arrived(ms(280 + i), Duration::ZERO);
        l.ack(0);
    }
    l.take_for(Stall, ms(600));
    l.released(ms(900));
    for i in 0..21 {
        l.arrived(ms(901 + i), Duration::ZERO);
        l.ack(0);
    }
    l.take_for(Stall, ms(1200));
    assert_eq!(l.window_seen(), Some(21));
    assert_eq!(l.newly_learned(), None, "once per connection");
    // A new connection: news again.
    l.connected(0, ms(1300), Duration::ZERO);
    for i in 0..21 {
        l.arrived(ms(1301 + i), Duration::ZERO);
        l.ack(0);
    }
    l.take_for(Stall, ms(1600));
    assert_eq!(l.newly_learned(), Some(21));
}

/// The counts per session: what each current connection has unacknowledged, the open batch's
/// and the batch at the writer's, until the release.
#[test]
fn unacknowledged_counts_are_per_session_until_the_release() {
    const C: Case = Case {
        sessions: 2,
        steps: &[msgs(0, 1, 3), msgs(1, 4, 2)],
        ..ONE
    };
    let t0 = Instant::now();
    let (_, mut l) = play(&C, t0);
    assert_eq!((l.unacked_of(0), l.unacked_of(1)), (3, 2));
    l.taken();
    l.ack(0);
    assert_eq!(
        (l.unacked_of(0), l.unacked_of(1)),
        (4, 2),
        "taken, not yet released"
    );
    l.released(t0 + Duration::from_millis(10));
    assert_eq!((l.unacked_of(0), l.unacked_of(1)), (1, 0));
    l.connected(0, t0 + Duration::from_millis(20), Duration::ZERO);
    assert_eq!(l.unacked_of(0), 0, "a new connection's count starts over");
    assert_eq!(l.unacked_of(7), 0, "no such session");
}

/// Our TCP ACKs may wait (the client's coalescing) only while no broker window is known and a
/// batch is due at `ACKS_WAIT_THRESHOLD_MIN` (256) unacknowledged messages or more: half the
/// 1,024 window asked for by default, not half of 256; never with a window stated or learned,
/// and again once a new connection forgot the learned one.
#[test]
fn acks_wait_only_while_no_window_holds_a_batch_to_a_few_messages() {
    let t0 = Instant::now();
    let ms = |m: u64| t0 + Duration::from_millis(m);
    let asked = |window: u16, stated: Option<u16>| {
        let c = Case { stated, ..ONE };
        Learner::new(FlushPolicy {
            window,
            ..policy(&c)
        })
    };
    assert!(
        asked(1024, None).acks_may_wait(),
        "the defaults: half of 1,024"
    );
    assert!(asked(512, None).acks_may_wait(), "half of 512 is 256");
    assert!(!asked(256, None).acks_may_wait(), "half of 256 is 128");
    assert!(!asked(1024, Some(1024)).acks_may_wait(), "a stated window");
    // Learned as in the row "without quick ACKs an echo's burst stalls after the long quiet
    // and teaches it" (20 from 1 ms, taken at 270 ms).
    let mut l = asked(1024, None);
    l.connected(0, t0, Duration::ZERO);
    for i in 0..20 {
        l.arrived(ms(1 + i), Duration::ZERO);
        l.ack(0);
    }
    l.take_for(Stall, ms(270));
    assert_eq!(l.window_seen(), Some(20));
    assert!(!l.acks_may_wait(), "a learned window");
    l.taken();
    l.connected(0, ms(400), Duration::ZERO);
    assert_eq!(l.window_seen(), None, "a new connection forgets it");
    assert!(l.acks_may_wait(), "and the ACKs may wait again");
}
