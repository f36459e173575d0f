use super::*;

/// Session 0's tag with packet id `pkid`.
#[allow(clippy::unnecessary_wraps)] // a `Tag` is an `Option`
fn tag(pkid: u16) -> Tag {
    Some(crate::dedup::PacketId { session: 0, pkid })
}

/// A session 0 whose sequence is `committed`, each message with a packet id of its own, with a
/// burst open.
fn reconnected(committed: &[Fingerprint]) -> Resends {
    with_ids(committed, |i| i as u16)
}

/// Like [`reconnected`], with packet ids from `id(position)`.
fn with_ids(committed: &[Fingerprint], id: impl Fn(usize) -> u16) -> Resends {
    let recent = committed
        .iter()
        .enumerate()
        .map(|(i, &fp)| (fp, tag(id(i))));
    let mut r = Resends::new(1, 64, 16, recent);
    r.connected(0, true);
    r
}

/// Holds `resends` and ends the burst: `C` a copy, `N` new with a known fingerprint, `?` unknown.
fn burst(r: &mut Resends, resends: &[Fingerprint], end: BurstEnd) -> String {
    for &fp in resends {
        assert!(r.hold(0, fp));
    }
    r.end_burst(0, end)
        .into_iter()
        .map(|p| match p {
            BurstPart::Copy => 'C',
            BurstPart::New => 'N',
            BurstPart::Unknown => '?',
        })
        .collect()
}

use BurstEnd::{NewMessage, Pause};

#[test]
fn the_copies_are_the_tail_the_burst_begins_with() {
    // The broker had not read the acks of the last two: it resends them, then a new one.
    let mut r = reconnected(&[1, 2, 3, 4]);
    assert_eq!(burst(&mut r, &[3, 4, 9], NewMessage), "CC?");
    // All acks read: nothing but new messages.
    let mut r = reconnected(&[1, 2, 3, 4]);
    assert_eq!(burst(&mut r, &[9], Pause), "?");
}

/// The case of issue 19: the last batch was messages 1..4 (fingerprints 10 11 12 13); the broker
/// read its acks and gave the same packet ids to new messages with the same topics and payloads;
/// the first two reached bucketd and died with it uncommitted. Their resends match 10 and 11, but
/// a copy of 10 would have to be followed by copies of 11, 12 and 13: these are new. (The
/// sequence shows ids given twice: a stall of the broker's cannot explain them.)
#[test]
fn a_resend_that_begins_a_tail_but_does_not_finish_it_is_new() {
    let lowest_free = |i: usize| (i % 4) as u16 + 1;
    for end in [NewMessage, Pause] {
        let mut r = with_ids(&[1, 2, 3, 4, 10, 11, 12, 13], lowest_free);
        assert_eq!(burst(&mut r, &[10, 11], end), "NN", "{end:?}");
    }
}

/// A broker that resends a window's worth and waits for acknowledgements before the rest
/// (Mosquitto 2.0.11 restored from its persistence file, MQTT 3.1.1): the burst pauses in the
/// middle of the tail. With packet ids never given twice, that stretch is copies.
#[test]
fn a_burst_that_pauses_in_the_middle_of_the_tail_is_its_copies() {
    let mut r = reconnected(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(burst(&mut r, &[2, 3], Pause), "CC");
    let mut r = reconnected(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(
        burst(&mut r, &[2, 3], NewMessage),
        "NN",
        "a new message: it was all"
    );
    let mut r = reconnected(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(burst(&mut r, &[2, 4], Pause), "NN", "not a stretch");
    let mut r = with_ids(&[1, 2, 3, 4, 5, 6], |i| (i % 3) as u16);
    assert_eq!(
        burst(&mut r, &[2, 3], Pause),
        "NN",
        "ids given twice: not a stall"
    );
}

/// New messages that repeat the whole tail read as its copies: the one ambiguity, which
/// `counted` keeps from arising for messages bucketd received.
#[test]
fn a_burst_that_repeats_a_whole_tail_is_taken_as_its_copies() {
    let mut r = reconnected(&[7, 7, 7]);
    assert_eq!(burst(&mut r, &[7], NewMessage), "C");
    let mut r = reconnected(&[7, 7, 7]);
    assert_eq!(burst(&mut r, &[7, 7, 7, 7], NewMessage), "CCCN");
    let mut r = reconnected(&[]);
    assert_eq!(burst(&mut r, &[7], Pause), "?");
}

#[test]
fn bursts_belong_to_a_connection_and_a_session() {
    let id = |session, pkid| Some(crate::dedup::PacketId { session, pkid });
    let mut r = Resends::new(
        2,
        64,
        2,
        [(1, id(0, 1)), (2, id(1, 1)), (3, None), (4, id(7, 1))],
    );
    assert!(r.knows(0, 1) && r.knows(1, 2));
    assert!(
        !r.knows(0, 2) && !r.knows(0, 3) && !r.knows(1, 4),
        "tags decide"
    );
    assert!(
        !r.in_burst(0) && !r.hold(0, 1),
        "no burst before a connection"
    );
    r.connected(0, false);
    assert!(!r.in_burst(0), "a new session: nothing is resent");
    r.connected(0, true);
    assert!(r.in_burst(0) && !r.in_burst(1));
    assert!(r.hold(0, 1) && !r.is_full(0));
    assert!(r.hold(0, 1) && r.is_full(0));
    assert!(!r.hold(0, 1), "full: the caller ends it");
    r.connected(0, true);
    assert_eq!(r.held(0), 0, "a new connection drops what the old one held");
    assert!(r.end_burst(0, Pause).is_empty());
    assert!(!r.in_burst(0));
    r.connected(1, true);
    assert!(r.hold(1, 2));
    r.disconnected(1);
    assert!(
        !r.in_burst(1) && r.held(1) == 0,
        "a lost connection drops its burst"
    );
}

#[test]
fn the_open_batch_repeating_the_tail_before_it_is_a_replay() {
    // Committed: 1 2 3 1 (packet ids 1 2 3 1: given twice already).
    let mut r = with_ids(&[1, 2, 3, 1], |i| (i % 3) as u16 + 1);
    assert!(!r.counted(0, 2, 2, true), "2 against 1");
    assert!(!r.counted(0, 3, 3, true), "2 3 against 3 1");
    assert!(r.counted(0, 1, 1, true), "2 3 1 against 2 3 1");
    assert!(!r.counted(0, 2, 2, true), "2 3 1 2 against 1 2 3 1");
    r.batch_taken();
    // A single message repeating the last one.
    assert!(r.counted(0, 2, 2, true));
    r.batch_taken();
    assert!(
        !r.counted(0, 5, 5, false) && !r.counted(0, 6, 6, false),
        "5 6 against 2 2"
    );
    // Other sessions and beyond the tail: nothing.
    assert!(!r.counted(5, 3, 3, true));
    let mut short = with_ids(&[1], |_| 1);
    assert!(
        !short.counted(0, 2, 2, false) && !short.counted(0, 1, 3, false),
        "the tail ran out"
    );
}

/// The first fingerprint seen again, on a session whose committed sequence shows no packet id
/// given twice, is committed at once: after a crash, the stored sequence must show that the
/// broker gives ids again, or a pause in its resends would pass for a stall.
#[test]
fn the_first_repeated_fingerprint_is_committed_at_once() {
    let mut r = with_ids(&[1, 2, 3], |i| i as u16 + 1);
    r.batch_taken();
    assert!(
        !r.counted(0, 9, 1, false),
        "an id given again, another fingerprint: no hurry"
    );
    assert!(r.counted(0, 2, 2, true), "a fingerprint again");
    assert!(
        r.counted(0, 3, 3, true),
        "not committed yet: still the first"
    );
    r.batch_taken();
    assert!(
        !r.counted(0, 8, 3, true),
        "committed: ids given twice show in the store"
    );
    // Stored with ids given twice: nothing to prove.
    let mut r = with_ids(&[1, 2, 1], |i| (i % 2) as u16 + 1);
    assert!(!r.counted(0, 7, 1, true));
}

/// A model of a broker and bucketd, to check the whole rule against what brokers do: a strict
/// window, packet ids handed out sequentially (Mosquitto, EMQX) or lowest free first (HiveMQ),
/// few distinct topics and payloads so that fingerprints repeat, acknowledgements read by the
/// broker some time after they are sent, and at random moments a crash (bucketd loses everything
/// not committed; the acks not yet read are lost) or a dropped connection (bucketd keeps its
/// memory). Messages are never lost on the wire: then nothing is ambiguous, and every message
/// must be counted exactly once.
mod model {
    use super::*;

    /// One message of the broker's: its serial number (the truth) and what it carries.
    #[derive(Debug, Clone, Copy)]
    struct Msg {
        serial: usize,
        topic: u8,
        payload: u8,
    }

    #[derive(Debug, Clone, Copy)]
    struct Delivery {
        msg: Msg,
        pkid: u16,
        dup: bool,
    }

    /// xorshift: deterministic choices.
    struct Rng(u64);

    impl Rng {
        fn new(seed: u64) -> Rng {
            Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n.max(1)
        }
    }

    fn fingerprint(d: &Delivery) -> Fingerprint {
        crate::dedup::fingerprint(
            &[d.msg.topic],
            &[d.msg.payload],
            Some(crate::dedup::PacketId {
                session: 0,
                pkid: d.pkid,
            }),
        )
    }

    struct Broker {
        queue: VecDeque<Msg>,
        in_flight: Vec<(u16, Msg)>,
        window: usize,
        lowest_free: bool,
        next_id: u16,
        /// Acks sent by bucketd, not yet read.
        acks: VecDeque<u16>,
        /// Resends at most this many at a reconnect, the rest (still with DUP) as acks make
        /// room, before anything new (Mosquitto 2.0.11 restored from persistence, MQTT 3.1.1).
        resend_window: Option<usize>,
        /// Still to resend after a reconnect; how many resends are unacknowledged.
        later: VecDeque<(u16, Msg)>,
        resent_unacked: Vec<u16>,
    }

    impl Broker {
        fn id(&mut self) -> u16 {
            if self.lowest_free {
                (1..=u16::MAX)
                    .find(|id| self.in_flight.iter().all(|(i, _)| i != id))
                    .expect("fewer than 65,535 in flight")
            } else {
                self.next_id = self.next_id % 60_000 + 1;
                self.next_id
            }
        }

        fn send(&mut self) -> Option<Delivery> {
            if let Some(&(pkid, msg)) = self.later.front() {
                if self.resent_unacked.len() >= self.resend_window.unwrap_or(usize::MAX) {
                    return None;
                }
                self.later.pop_front();
                self.resent_unacked.push(pkid);
                return Some(Delivery {
                    msg,
                    pkid,
                    dup: true,
                });
            }
            if self.in_flight.len() >= self.window {
                return None;
            }
            let msg = self.queue.pop_front()?;
            let pkid = self.id();
            self.in_flight.push((pkid, msg));
            Some(Delivery {
                msg,
                pkid,
                dup: false,
            })
        }

        fn read_ack(&mut self) {
            if let Some(id) = self.acks.pop_front() {
                self.in_flight.retain(|(i, _)| *i != id);
                self.resent_unacked.retain(|i| *i != id);
            }
        }

        /// What a reconnect resends at once; the rest waits in `later`.
        fn resend(&mut self) -> Vec<Delivery> {
            let n = self.resend_window.unwrap_or(usize::MAX);
            self.later = self.in_flight.iter().copied().collect();
            self.resent_unacked.clear();
            let mut out = Vec::new();
            while out.len() < n
                && let Some((pkid, msg)) = self.later.pop_front()
            {
                self.resent_unacked.push(pkid);
                out.push(Delivery {
                    msg,
                    pkid,
                    dup: true,
                });
            }
            out
        }
    }

    /// bucketd as this module's caller uses it. `ordered = false` is the rule before it: a DUP
    /// is a copy whenever its fingerprint is in the window.
    struct Bucketd {
        ordered: bool,
        capacity: usize,
        resends: Resends,
        /// Committed (fingerprint, packet id, serial), oldest first.
        stored: Vec<(Fingerprint, u16, usize)>,
        /// Counted and not committed.
        open: Vec<(Fingerprint, u16, usize)>,
        /// Packet ids to acknowledge at the next commit, in arrival order.
        unacked: Vec<u16>,
        held: Vec<Delivery>,
        commit_now: bool,
    }

    impl Bucketd {
        fn start(
            ordered: bool,
            capacity: usize,
            stored: Vec<(Fingerprint, u16, usize)>,
        ) -> Bucketd {
            let recent = stored.iter().map(|&(fp, pkid, _)| (fp, tag(pkid)));
            Bucketd {
                ordered,
                capacity,
                resends: Resends::new(1, capacity, 1024, recent),
                stored,
                open: Vec::new(),
                unacked: Vec::new(),
                held: Vec::new(),
                commit_now: false,
            }
        }

        fn live(&self, fp: Fingerprint) -> bool {
            let all: Vec<_> = self.stored.iter().chain(&self.open).collect();
            all[all.len().saturating_sub(self.capacity)..]
                .iter()
                .any(|(f, _, _)| *f == fp)
        }

        fn receive(&mut self, d: Delivery) {
            self.unacked.push(d.pkid);
            let fp = fingerprint(&d);
            if self.ordered {
                if !d.dup && self.resends.in_burst(0) {
                    self.end_burst(BurstEnd::NewMessage);
                }
                if d.dup && self.resends.hold(0, fp) {
                    self.held.push(d);
                    return;
                }
            }
            let copy = d.dup && self.live(fp);
            self.admit(d, copy);
        }

        fn admit(&mut self, d: Delivery, copy: bool) {
            if !copy {
                let fp = fingerprint(&d);
                let seen = self.live(fp);
                self.open.push((fp, d.pkid, d.msg.serial));
                self.commit_now |= self.resends.counted(0, fp, d.pkid, seen);
            }
        }

        fn end_burst(&mut self, end: BurstEnd) {
            let parts = self.resends.end_burst(0, end);
            for (d, part) in std::mem::take(&mut self.held).into_iter().zip(parts) {
                let copy = match part {
                    BurstPart::Copy => true,
                    BurstPart::New => false,
                    BurstPart::Unknown => self.live(fingerprint(&d)),
                };
                self.admit(d, copy);
            }
        }

        /// Commits and sends the acks.
        fn commit(&mut self, broker: &mut Broker) {
            if self.resends.in_burst(0) {
                self.end_burst(BurstEnd::Pause);
            }
            self.stored.append(&mut self.open);
            self.resends.batch_taken();
            self.commit_now = false;
            broker.acks.extend(self.unacked.drain(..));
        }
    }

    /// Runs `steps` random steps, then lets everything settle; returns how many times each
    /// message was counted.
    /// How the model's broker behaves.
    #[derive(Debug, Clone, Copy)]
    struct Kind {
        lowest_free: bool,
        window: usize,
        resend_window: Option<usize>,
    }

    fn run(seed: u64, ordered: bool, kind: Kind, steps: usize) -> Vec<usize> {
        let mut rng = Rng::new(seed);
        let messages = 400;
        let mut broker = Broker {
            queue: (0..messages)
                .map(|serial| Msg {
                    serial,
                    topic: rng.below(2) as u8,
                    payload: rng.below(2) as u8,
                })
                .collect(),
            in_flight: Vec::new(),
            window: kind.window,
            lowest_free: kind.lowest_free,
            next_id: 0,
            acks: VecDeque::new(),
            resend_window: kind.resend_window,
            later: VecDeque::new(),
            resent_unacked: Vec::new(),
        };
        let capacity = 64;
        let mut b = Bucketd::start(ordered, capacity, Vec::new());
        b.resends.connected(0, false);
        for _ in 0..steps {
            match rng.below(100) {
                0..=49 => {
                    if let Some(d) = broker.send() {
                        b.receive(d);
                        // The daemon starts such a commit at once; a crash during it is the
                        // one loss left (docs/RELIABILITY.md), which this model leaves out.
                        if b.commit_now {
                            b.commit(&mut broker);
                        }
                    }
                }
                50..=69 => broker.read_ack(),
                70..=84 => b.commit(&mut broker),
                95..=96 => {
                    // A crash: the acks on the wire may or may not arrive.
                    for _ in 0..rng.below(broker.acks.len() as u64 + 1) {
                        broker.read_ack();
                    }
                    broker.acks.clear();
                    b = Bucketd::start(ordered, capacity, std::mem::take(&mut b.stored));
                    reconnect(&mut b, &mut broker);
                }
                97..=98 => {
                    // The connection drops; bucketd lives on. Acks of this connection that
                    // were not sent die with it (the broker resends those messages).
                    for _ in 0..rng.below(broker.acks.len() as u64 + 1) {
                        broker.read_ack();
                    }
                    broker.acks.clear();
                    b.unacked.clear();
                    b.held.clear();
                    reconnect(&mut b, &mut broker);
                }
                _ => {}
            }
        }
        // Settle: no more failures.
        while !broker.queue.is_empty() || !broker.in_flight.is_empty() || !broker.later.is_empty() {
            while let Some(d) = broker.send() {
                b.receive(d);
            }
            b.commit(&mut broker);
            while !broker.acks.is_empty() {
                broker.read_ack();
            }
        }
        let mut counted = vec![0; messages];
        for &(_, _, serial) in &b.stored {
            counted[serial] += 1;
        }
        counted
    }

    fn reconnect(b: &mut Bucketd, broker: &mut Broker) {
        b.resends.connected(0, true);
        for d in broker.resend() {
            b.receive(d);
        }
    }

    fn lost_and_twice(counted: &[usize]) -> (usize, usize) {
        let lost = counted.iter().filter(|&&n| n == 0).count();
        let twice = counted.iter().map(|&n| n.saturating_sub(1)).sum();
        (lost, twice)
    }

    #[test]
    fn nothing_is_lost_or_counted_twice_whatever_the_broker_does_with_packet_ids() {
        let mut kinds = Vec::new();
        for lowest_free in [false, true] {
            for window in [1, 3, 20] {
                kinds.push(Kind {
                    lowest_free,
                    window,
                    resend_window: None,
                });
            }
        }
        // Mosquitto 2.0.11 restored from persistence: ids counted up, many unacknowledged,
        // resent a few at a time.
        for resend_window in [1, 2, 5] {
            kinds.push(Kind {
                lowest_free: false,
                window: 20,
                resend_window: Some(resend_window),
            });
        }
        for kind in kinds {
            for seed in 0..150 {
                let counted = run(seed, true, kind, 3_000);
                assert_eq!(lost_and_twice(&counted), (0, 0), "seed {seed}, {kind:?}");
            }
        }
    }

    /// The same model with the rule before this module: a broker that hands out the lowest free
    /// packet id makes it lose messages (and one that counts ids up does not), so the model can
    /// tell the rules apart.
    #[test]
    fn the_window_alone_loses_messages_when_packet_ids_are_reused() {
        let lost = |lowest_free| -> usize {
            let kind = Kind {
                lowest_free,
                window: 3,
                resend_window: None,
            };
            (0..50)
                .map(|seed| lost_and_twice(&run(seed, false, kind, 3_000)).0)
                .sum()
        };
        assert!(lost(true) > 10, "{}", lost(true));
        assert_eq!(lost(false), 0);
    }
}
