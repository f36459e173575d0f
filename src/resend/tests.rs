// Test scenarios read top to bottom; the 100-line limit (clippy.toml) holds the library.
#![allow(clippy::too_many_lines)]
use super::*;

/// Session 0's tag with packet id `pkid`.
#[allow(clippy::unnecessary_wraps)] // a `Tag` is an `Option`
fn tag(pkid: u16) -> Tag {
    Some(crate::dedup::PacketId { session: 0, pkid })
}

/// A session 0 whose sequence is `committed`, each message with a packet id of its own.
fn reconnected(committed: &[Fingerprint]) -> Resends {
    with_ids(committed, |i| i as u16)
}

/// Like [`reconnected`], with packet ids from `id(position)`.
fn with_ids(committed: &[Fingerprint], id: impl Fn(usize) -> u16) -> Resends {
    let recent = committed
        .iter()
        .enumerate()
        .map(|(i, &fp)| (fp, tag(id(i))));
    Resends::new(1, 64, recent)
}

/// Holds `resends` (arrival numbers from `arrival`) in a burst of session 0 and ends it: `C` a
/// copy, `N` new with a known fingerprint, `?` unknown.
fn burst_from(r: &mut Resends, arrival: u64, resends: &[Fingerprint], end: BurstEnd) -> String {
    let mut b = Burst::new(16);
    for (i, &fp) in resends.iter().enumerate() {
        b.hold(fp, arrival + i as u64, i);
    }
    let told = r.end_burst(0, b, end);
    assert!(
        told.iter().enumerate().all(|(i, (h, _))| h.body == i),
        "each message comes back with its own body, in order"
    );
    told.into_iter()
        .map(|(_, p)| match p {
            BurstPart::Copy => 'C',
            BurstPart::New => 'N',
            BurstPart::Unknown => '?',
        })
        .collect()
}

/// [`burst_from`] with arrival numbers that say nothing (0).
fn burst(r: &mut Resends, resends: &[Fingerprint], end: BurstEnd) -> String {
    burst_from(r, 0, resends, end)
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
fn sequences_belong_to_a_session() {
    let id = |session, pkid| Some(crate::dedup::PacketId { session, pkid });
    let mut r = Resends::new(
        2,
        64,
        [(1, id(0, 1)), (2, id(1, 1)), (3, None), (4, id(7, 1))],
    );
    assert!(r.knows(0, 1) && r.knows(1, 2));
    assert!(
        !r.knows(0, 2) && !r.knows(0, 3) && !r.knows(1, 4),
        "tags decide"
    );
    // A burst is told apart against its own session's sequence.
    assert_eq!(burst(&mut r, &[1], NewMessage), "C");
    let mut b = Burst::new(4);
    b.hold(1, 0, ());
    assert_eq!(r.end_burst(1, b, NewMessage)[0].1, BurstPart::Unknown);
    // A session beyond the sequences: the window decides.
    let mut b = Burst::new(4);
    b.hold(4, 0, ());
    assert_eq!(r.end_burst(7, b, NewMessage)[0].1, BurstPart::Unknown);
}

#[test]
fn a_burst_is_full_at_its_bound() {
    let mut b = Burst::new(2);
    assert!(b.is_empty() && !b.is_full());
    b.hold(1, 1, ());
    assert!(!b.is_empty() && !b.is_full());
    b.hold(1, 2, ());
    assert!(b.is_full() && b.len() == 2);
    assert!(Burst::<()>::new(0).max == 1, "at least one message");
}

#[test]
fn the_open_batch_repeating_the_tail_before_it_is_a_replay() {
    // Committed: 1 2 3 1 (packet ids 1 2 3 1: given twice already).
    let mut r = with_ids(&[1, 2, 3, 1], |i| (i % 3) as u16 + 1);
    assert!(!r.counted(0, 2, 2, 0, true), "2 against 1");
    assert!(!r.counted(0, 3, 3, 0, true), "2 3 against 3 1");
    assert!(r.counted(0, 1, 1, 0, true), "2 3 1 against 2 3 1");
    assert!(!r.counted(0, 2, 2, 0, true), "2 3 1 2 against 1 2 3 1");
    r.batch_taken();
    // A single message repeating the last one.
    assert!(r.counted(0, 2, 2, 0, true));
    r.batch_taken();
    assert!(
        !r.counted(0, 5, 5, 0, false) && !r.counted(0, 6, 6, 0, false),
        "5 6 against 2 2"
    );
    // Other sessions and beyond the tail: nothing.
    assert!(!r.counted(5, 3, 3, 0, true));
    let mut short = with_ids(&[1], |_| 1);
    assert!(
        !short.counted(0, 2, 2, 0, false) && !short.counted(0, 1, 3, 0, false),
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
        !r.counted(0, 9, 1, 0, false),
        "an id given again, another fingerprint: no hurry"
    );
    assert!(r.counted(0, 2, 2, 0, true), "a fingerprint again");
    assert!(
        r.counted(0, 3, 3, 0, true),
        "not committed yet: still the first"
    );
    r.batch_taken();
    assert!(
        !r.counted(0, 8, 3, 0, true),
        "committed: ids given twice show in the store"
    );
    // Stored with ids given twice: nothing to prove.
    let mut r = with_ids(&[1, 2, 1], |i| (i % 2) as u16 + 1);
    assert!(!r.counted(0, 7, 1, 0, true));
}

/// Messages counted on a connection (fingerprints `fps`, packet id 1 each: a broker that hands
/// out the lowest free id), arrival numbers from 1.
fn counted_on_one_connection(fps: &[Fingerprint]) -> Resends {
    let mut r = Resends::new(1, 64, []);
    for (i, &fp) in fps.iter().enumerate() {
        r.counted(0, fp, 1, i as u64 + 1, false);
    }
    r.batch_taken();
    r
}

/// The case of issue 19 as written: M1 counted, acknowledged, and its ack confirmed by a ping;
/// M2, with M1's fingerprint, lost on the wire. Its resend is new. Unconfirmed, it would be
/// taken for M1's copy.
#[test]
fn a_confirmed_message_is_never_a_copy() {
    let mut r = counted_on_one_connection(&[5]);
    r.confirm(0, 1, 1);
    assert_eq!(burst(&mut r, &[5], NewMessage), "N");
    let mut r = counted_on_one_connection(&[5]);
    assert_eq!(burst(&mut r, &[5], NewMessage), "C");
    // Confirmed up to the second of three: the third can still be resent.
    let mut r = counted_on_one_connection(&[5, 6, 7]);
    r.confirm(0, 1, 2);
    assert_eq!(burst(&mut r, &[7, 9], NewMessage), "C?");
    // A confirmation covers its connection's arrivals only.
    let mut r = counted_on_one_connection(&[5]);
    r.confirm(0, 2, 9);
    assert_eq!(burst(&mut r, &[5], NewMessage), "C");
}

/// A burst tells what the broker holds: everything before its tail of copies was read, and the
/// tail's messages are now acknowledged by their copies' acks (later arrival numbers), which a
/// ping on the new connection confirms. A burst of nothing before a new message: all read.
#[test]
fn a_burst_confirms_what_the_broker_did_not_resend() {
    let mut r = counted_on_one_connection(&[5, 6]);
    assert_eq!(burst_from(&mut r, 10, &[6], NewMessage), "C");
    assert_eq!(
        burst(&mut r, &[5], NewMessage),
        "N",
        "5 was not resent: read"
    );
    let mut r = counted_on_one_connection(&[5, 6]);
    burst_from(&mut r, 10, &[6], NewMessage);
    r.confirm(0, 10, 10);
    assert_eq!(
        burst(&mut r, &[6], NewMessage),
        "N",
        "the copy's ack confirmed 6"
    );
    let mut r = counted_on_one_connection(&[5, 6]);
    burst(&mut r, &[], NewMessage);
    assert_eq!(
        burst(&mut r, &[6], NewMessage),
        "N",
        "nothing resent: all read"
    );
    // Quiet is no proof: the resends may still be on their way.
    let mut r = counted_on_one_connection(&[5, 6]);
    burst(&mut r, &[], Pause);
    assert_eq!(burst(&mut r, &[6], NewMessage), "C");
}

/// A model of a broker and bucketd, to check the whole rule against what brokers do: a strict
/// window, packet ids handed out sequentially (Mosquitto, EMQX) or lowest free first (HiveMQ),
/// few distinct topics and payloads so that fingerprints repeat, acknowledgements and pings read
/// by the broker some time after they are sent, and at random moments a crash (bucketd loses
/// everything not committed; the acks not yet read are lost) or a dropped connection (bucketd
/// keeps its memory). Two kinds of wire: one that delivers each packet at once (nothing is lost
/// on it, so nothing is ambiguous and every message must be counted exactly once), and one where
/// packets take a while and a dropped connection loses those still on it.
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

    /// From the broker to bucketd.
    #[derive(Debug, Clone, Copy)]
    enum Down {
        Publish(Delivery),
        PingResp,
    }

    /// From bucketd to the broker: an ack (with the arrival number of its message) or a ping.
    #[derive(Debug, Clone, Copy)]
    enum Up {
        Ack(u16, u64),
        PingReq,
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
        /// Published, not yet sent; still to be published (a publisher slower than the round
        /// trip, with `Kind::paced`).
        queue: VecDeque<Msg>,
        unpublished: VecDeque<Msg>,
        in_flight: Vec<(u16, Msg)>,
        window: usize,
        lowest_free: bool,
        next_id: u16,
        /// Sent by bucketd, not yet read.
        up: VecDeque<Up>,
        /// Sent to bucketd, not yet received.
        down: VecDeque<Down>,
        /// Resends at most this many at a reconnect, the rest (still with DUP) as acks make
        /// room, before anything new (Mosquitto 2.0.11 restored from persistence, MQTT 3.1.1).
        resend_window: Option<usize>,
        /// Still to resend after a reconnect; how many resends are unacknowledged.
        later: VecDeque<(u16, Msg)>,
        resent_unacked: Vec<u16>,
        /// The arrival number of the last ack read.
        read_through: u64,
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

        /// Reads the next ack or ping; a ping is answered.
        fn read(&mut self) {
            match self.up.pop_front() {
                Some(Up::Ack(id, arrival)) => {
                    self.in_flight.retain(|(i, _)| *i != id);
                    self.resent_unacked.retain(|i| *i != id);
                    self.read_through = self.read_through.max(arrival);
                }
                Some(Up::PingReq) => self.down.push_back(Down::PingResp),
                None => {}
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

    /// Which rule bucketd follows.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Rule {
        /// Before this module: a DUP is a copy whenever its fingerprint is in the window.
        Window,
        /// Resends told apart by their order.
        Order,
        /// ... and acks confirmed by pings ([`Resends::confirm`]).
        Pings,
    }

    /// bucketd as this module's caller uses it.
    struct Bucketd {
        rule: Rule,
        capacity: usize,
        resends: Resends,
        /// Committed (fingerprint, packet id, serial), oldest first.
        stored: Vec<(Fingerprint, u16, usize)>,
        /// Counted and not committed.
        open: Vec<(Fingerprint, u16, usize)>,
        /// Acks owed at the next commit (packet id, arrival number), in arrival order.
        unacked: Vec<(u16, u64)>,
        /// The reconnect burst, as a session holds it.
        burst: Option<Burst<Delivery>>,
        commit_now: bool,
        /// The last arrival number given.
        arrival: u64,
        /// The connection's first arrival number, the last ack written, the last ack a ping
        /// followed, the pings not answered yet, the last arrival confirmed.
        first_arrival: u64,
        written_through: u64,
        pinged_through: u64,
        pings: VecDeque<u64>,
        confirmed_through: u64,
    }

    impl Bucketd {
        fn start(
            rule: Rule,
            capacity: usize,
            stored: Vec<(Fingerprint, u16, usize)>,
            arrival: u64,
        ) -> Bucketd {
            let recent = stored.iter().map(|&(fp, pkid, _)| (fp, tag(pkid)));
            Bucketd {
                rule,
                capacity,
                resends: Resends::new(1, capacity, recent),
                stored,
                open: Vec::new(),
                unacked: Vec::new(),
                burst: None,
                commit_now: false,
                arrival,
                first_arrival: arrival + 1,
                written_through: 0,
                pinged_through: 0,
                pings: VecDeque::new(),
                confirmed_through: 0,
            }
        }

        fn live(&self, fp: Fingerprint) -> bool {
            self.stored
                .iter()
                .chain(&self.open)
                .rev()
                .take(self.capacity)
                .any(|(f, _, _)| *f == fp)
        }

        fn receive(&mut self, down: Down, broker: &mut Broker) {
            let d = match down {
                Down::Publish(d) => d,
                Down::PingResp => {
                    if let Some(through) = self.pings.pop_front()
                        && through >= self.first_arrival
                    {
                        self.resends.confirm(0, self.first_arrival, through);
                        self.confirmed_through = through;
                    }
                    self.ping_if_due(broker);
                    return;
                }
            };
            self.arrival += 1;
            let arrival = self.arrival;
            self.unacked.push((d.pkid, arrival));
            let fp = fingerprint(&d);
            if self.rule != Rule::Window {
                if !d.dup && self.burst.is_some() {
                    self.end_burst(BurstEnd::NewMessage);
                }
                if d.dup
                    && let Some(b) = self.burst.as_mut().filter(|b| !b.is_full())
                {
                    b.hold(fp, arrival, d);
                    return;
                }
            }
            let copy = d.dup && self.live(fp);
            self.admit(d, arrival, copy);
        }

        fn admit(&mut self, d: Delivery, arrival: u64, copy: bool) {
            if !copy {
                let fp = fingerprint(&d);
                let seen = self.live(fp);
                self.open.push((fp, d.pkid, d.msg.serial));
                self.commit_now |= self.resends.counted(0, fp, d.pkid, arrival, seen);
            }
        }

        fn end_burst(&mut self, end: BurstEnd) {
            let Some(burst) = self.burst.take() else {
                return;
            };
            for (
                Held {
                    arrival, body: d, ..
                },
                part,
            ) in self.resends.end_burst(0, burst, end)
            {
                let copy = match part {
                    BurstPart::Copy => true,
                    BurstPart::New => false,
                    BurstPart::Unknown => self.live(fingerprint(&d)),
                };
                self.admit(d, arrival, copy);
            }
        }

        /// Commits and sends the acks, and a ping after them when due.
        fn commit(&mut self, broker: &mut Broker) {
            // Quiet for long enough (the ingest task ends no empty burst for quiet).
            if self.burst.as_ref().is_some_and(|b| !b.is_empty()) {
                self.end_burst(BurstEnd::Pause);
            }
            self.stored.append(&mut self.open);
            self.resends.batch_taken();
            self.commit_now = false;
            if let Some(&(_, last)) = self.unacked.last() {
                self.written_through = last;
            }
            broker
                .up
                .extend(self.unacked.drain(..).map(|(pkid, a)| Up::Ack(pkid, a)));
            self.ping_if_due(broker);
        }

        /// As `ingest::Ingest::ping_if_due`: one ping at a time, after acks not pinged yet, with
        /// nothing else unacknowledged.
        fn ping_if_due(&mut self, broker: &mut Broker) {
            if self.rule == Rule::Pings
                && self.unacked.is_empty()
                && self.pings.is_empty()
                && self.written_through > self.pinged_through
            {
                broker.up.push_back(Up::PingReq);
                self.pings.push_back(self.written_through);
                self.pinged_through = self.written_through;
            }
        }

        /// A new connection: the resends come first.
        fn reconnect(&mut self, broker: &mut Broker) {
            self.first_arrival = self.arrival + 1;
            self.written_through = 0;
            self.pinged_through = 0;
            self.pings.clear();
            self.burst = Some(Burst::new(1024));
            // A reconnect's resends come within the time a burst is held open.
            for d in broker.resend() {
                self.receive(Down::Publish(d), broker);
            }
        }
    }

    /// How the model's broker and wire behave.
    #[derive(Debug, Clone, Copy)]
    #[allow(clippy::struct_excessive_bools)] // independent knobs of the model
    struct Kind {
        lowest_free: bool,
        window: usize,
        resend_window: Option<usize>,
        /// Packets take a while, and those on the wire when a connection drops are lost.
        slow_wire: bool,
        /// Messages are published now and then, not all at the start.
        paced: bool,
        /// bucketd crashes now and then (else its connection drops instead).
        crashes: bool,
    }

    /// What became of the messages: how many times each was counted, and which were sent while
    /// the broker had read an ack that bucketd had not seen confirmed (the window where a new
    /// message with a copy's fingerprint, lost on the wire, reads as that copy).
    struct Outcome {
        counted: Vec<usize>,
        exposed: Vec<bool>,
    }

    /// Runs `steps` random steps, then lets everything settle.
    fn run(seed: u64, rule: Rule, kind: Kind, steps: usize) -> Outcome {
        let mut rng = Rng::new(seed);
        let messages = 400;
        let all: VecDeque<Msg> = (0..messages)
            .map(|serial| Msg {
                serial,
                topic: rng.below(2) as u8,
                payload: rng.below(2) as u8,
            })
            .collect();
        let (queue, unpublished) = if kind.paced {
            (VecDeque::new(), all)
        } else {
            (all, VecDeque::new())
        };
        let mut broker = Broker {
            queue,
            unpublished,
            in_flight: Vec::new(),
            window: kind.window,
            lowest_free: kind.lowest_free,
            next_id: 0,
            up: VecDeque::new(),
            down: VecDeque::new(),
            resend_window: kind.resend_window,
            later: VecDeque::new(),
            resent_unacked: Vec::new(),
            read_through: 0,
        };
        let capacity = 64;
        let mut exposed = vec![false; messages];
        let mut b = Bucketd::start(rule, capacity, Vec::new(), 0);
        for _ in 0..steps {
            match rng.below(100) {
                0..=49 => {
                    if let Some(d) = broker.send() {
                        exposed[d.msg.serial] |= broker.read_through > b.confirmed_through;
                        broker.down.push_back(Down::Publish(d));
                    }
                }
                50..=69 => broker.read(),
                70..=84 => b.commit(&mut broker),
                95..=96 if kind.crashes => {
                    // A crash: the acks on the wire may or may not arrive.
                    for _ in 0..rng.below(broker.up.len() as u64 + 1) {
                        broker.read();
                    }
                    broker.up.clear();
                    broker.down.clear();
                    // bucketd forgets what was confirmed: every message the broker holds
                    // unacknowledged is exposed.
                    for (_, m) in &broker.in_flight {
                        exposed[m.serial] = true;
                    }
                    let stored = std::mem::take(&mut b.stored);
                    b = Bucketd::start(rule, capacity, stored, b.arrival);
                    b.reconnect(&mut broker);
                }
                95..=98 => {
                    // The connection drops; bucketd lives on. Acks of this connection that
                    // were not sent die with it (the broker resends those messages).
                    for _ in 0..rng.below(broker.up.len() as u64 + 1) {
                        broker.read();
                    }
                    broker.up.clear();
                    broker.down.clear();
                    b.unacked.clear();
                    b.burst = None;
                    b.reconnect(&mut broker);
                }
                _ => {}
            }
            if kind.paced
                && rng.below(100) < 4
                && let Some(m) = broker.unpublished.pop_front()
            {
                broker.queue.push_back(m);
            }
            // What the broker sent arrives: at once, or one packet now and then.
            let arrive = if kind.slow_wire {
                usize::from(rng.below(100) < 40)
            } else {
                broker.down.len()
            };
            for _ in 0..arrive {
                if let Some(down) = broker.down.pop_front() {
                    b.receive(down, &mut broker);
                    // The daemon starts such a commit at once; a crash during it is the
                    // one loss left (docs/RELIABILITY.md), which this model leaves out.
                    if b.commit_now {
                        b.commit(&mut broker);
                    }
                }
            }
        }
        // Settle: no more failures.
        broker.queue.append(&mut broker.unpublished);
        while !broker.queue.is_empty()
            || !broker.in_flight.is_empty()
            || !broker.later.is_empty()
            || !broker.down.is_empty()
        {
            while let Some(d) = broker.send() {
                broker.down.push_back(Down::Publish(d));
            }
            while let Some(down) = broker.down.pop_front() {
                b.receive(down, &mut broker);
            }
            b.commit(&mut broker);
            while !broker.up.is_empty() {
                broker.read();
            }
        }
        let mut counted = vec![0; messages];
        for &(_, _, serial) in &b.stored {
            counted[serial] += 1;
        }
        Outcome { counted, exposed }
    }

    impl Outcome {
        fn lost_and_twice(&self) -> (usize, usize) {
            let lost = self.counted.iter().filter(|&&n| n == 0).count();
            let twice = self.counted.iter().map(|&n| n.saturating_sub(1)).sum();
            (lost, twice)
        }

        /// Lost messages that were not exposed.
        fn lost_unexposed(&self) -> usize {
            self.counted
                .iter()
                .zip(&self.exposed)
                .filter(|&(&n, &e)| n == 0 && !e)
                .count()
        }
    }

    /// Seeds per kind of broker: 60, or `BUCKETD_MODEL_SEEDS` (fewer under qemu, `.ci/arm`, which
    /// runs the model ~10x slower).
    fn seeds() -> u64 {
        std::env::var("BUCKETD_MODEL_SEEDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60)
    }

    fn kinds(slow_wire: bool) -> Vec<Kind> {
        let mut kinds = Vec::new();
        for lowest_free in [false, true] {
            for window in [1, 3, 20] {
                for paced in [false, true] {
                    kinds.push(Kind {
                        lowest_free,
                        window,
                        resend_window: None,
                        slow_wire,
                        paced,
                        crashes: !paced,
                    });
                }
            }
        }
        // Mosquitto 2.0.11 restored from persistence: ids counted up, many unacknowledged,
        // resent a few at a time.
        for resend_window in [1, 2, 5] {
            kinds.push(Kind {
                lowest_free: false,
                window: 20,
                resend_window: Some(resend_window),
                slow_wire,
                paced: false,
                crashes: true,
            });
        }
        kinds
    }

    #[test]
    fn nothing_is_lost_or_counted_twice_whatever_the_broker_does_with_packet_ids() {
        for kind in kinds(false) {
            for rule in [Rule::Order, Rule::Pings] {
                for seed in 0..seeds() {
                    let outcome = run(seed, rule, kind, 3_000);
                    assert_eq!(
                        outcome.lost_and_twice(),
                        (0, 0),
                        "seed {seed}, {rule:?}, {kind:?}"
                    );
                }
            }
        }
    }

    /// Messages lost on the wire with their connection. A resend then may have the fingerprint
    /// of a message counted (a packet id given again) and match the tail of counted messages,
    /// and only the broker knows whether it had read that tail's acks: pings tell bucketd. With
    /// pings, nothing is counted twice, and a message is lost only if it was *exposed*: sent
    /// while the broker had read an ack that bucketd had not seen confirmed (its PINGRESP still
    /// to come, or lost with the connection), or held by the broker when bucketd crashed (which
    /// forgets confirmations). Without pings, more are lost; most with a publisher slower than
    /// the round trip (a sensor), where the broker has read the ping before the next message.
    #[test]
    fn pings_confirm_acks_so_that_messages_lost_on_the_wire_are_told_from_copies() {
        // Lost with lowest free ids, (paced, backlogged): with pings, without.
        let (mut with, mut without) = ([0; 2], [0; 2]);
        for kind in kinds(true) {
            for seed in 0..seeds() {
                let pings = run(seed, Rule::Pings, kind, 3_000);
                let (lost, twice) = pings.lost_and_twice();
                assert_eq!(
                    (twice, pings.lost_unexposed()),
                    (0, 0),
                    "seed {seed}, {kind:?}"
                );
                let order = run(seed, Rule::Order, kind, 3_000);
                assert_eq!(order.lost_and_twice().1, 0, "seed {seed}, {kind:?}");
                if kind.lowest_free {
                    with[usize::from(!kind.paced)] += lost;
                    without[usize::from(!kind.paced)] += order.lost_and_twice().0;
                } else {
                    assert_eq!(lost, 0, "ids counted up: seed {seed}, {kind:?}");
                }
            }
        }
        eprintln!(
            "lost on the wire, lowest free ids, (paced, backlogged): {with:?} with pings, \
             {without:?} without"
        );
        assert!(with[0] * 3 < without[0] * 2, "{with:?} against {without:?}");
        assert!(with[1] < without[1], "{with:?} against {without:?}");
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
                slow_wire: false,
                paced: false,
                crashes: true,
            };
            (0..50)
                .map(|seed| run(seed, Rule::Window, kind, 3_000).lost_and_twice().0)
                .sum()
        };
        assert!(lost(true) > 10, "{}", lost(true));
        assert_eq!(lost(false), 0);
    }
}
