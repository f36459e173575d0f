//! The core driven by scripted events on a fake clock: no broker, no writer, no Tokio.

use std::time::Duration;

use bytes::Bytes;

use super::*;
use crate::config::Limits;
use crate::decode::{Format, Subscription, Template, TimestampUnit};
use crate::dedup::Window;
use crate::limits::RESEND_QUIET_MIN;
use crate::resend::Resends;
use crate::series::SeriesSet;

const S0: SessionId = SessionId::new(0);
const WINDOW: u16 = 20;
const INTERVAL: Duration = Duration::from_secs(1);

/// A core of `sessions` sessions over `sensors/{sensor}/{metric}` (numbers as payloads),
/// flush interval 1 s, a window of 20 (stated), reconnect backoff 1 s to 8 s; and its counters.
fn core(sessions: u16) -> (Core<u32>, Arc<Stats>) {
    core_with(policy(sessions), start())
}

/// [`core`]'s flush policy.
fn policy(sessions: u16) -> crate::batcher::FlushPolicy {
    crate::batcher::FlushPolicy {
        flush_interval: INTERVAL,
        max_pending_readings: 1000,
        window: WINDOW,
        // Stated, so that the policy is the interval or half the window (the learning of an
        // unstated one is the batcher's, tested there and in `sim`).
        broker_window: Some(WINDOW),
        sessions,
        quick_acks: false,
    }
}

/// A core with this flush policy (and as many sessions), started at `now`.
pub(super) fn core_with(
    policy: crate::batcher::FlushPolicy,
    now: Instant,
) -> (Core<u32>, Arc<Stats>) {
    core_reading(policy, now, value_subscription())
}

pub(super) fn value_subscription() -> Subscription {
    Subscription {
        filter: "sensors/+/+".into(),
        qos: 1,
        template: Template::parse("sensors/{sensor}/{metric}").unwrap(),
        format: Format::Value,
        timestamp_field: None,
        timestamp_unit: TimestampUnit::Auto,
        sensor_field: None,
        root: None,
        fields: None,
        rebirth_interval: None,
        store_raw: false,
    }
}

/// [`core_with`], reading `subscription`.
fn core_reading(
    policy: crate::batcher::FlushPolicy,
    now: Instant,
    subscription: Subscription,
) -> (Core<u32>, Arc<Stats>) {
    core_remembering(policy, now, subscription, 64)
}

/// [`core_reading`], telling copies from the last `dedup` messages committed (and as many
/// per session in a reconnect's burst).
pub(super) fn core_remembering(
    policy: crate::batcher::FlushPolicy,
    now: Instant,
    subscription: Subscription,
    dedup: usize,
) -> (Core<u32>, Arc<Stats>) {
    let limits = Limits {
        max_series: 100,
        max_series_per_sensor: 100,
        max_payload_bytes: 65_536,
        max_age: Duration::from_hours(720),
        max_future: Duration::from_mins(5),
        dead_letters: 4,
        dedup_window: dedup,
    };
    let admit = Admitter::new(
        vec![subscription],
        limits,
        3600,
        SeriesSet::new(100, 100, []),
        Window::new(dedup, []),
        Resends::new(policy.sessions, dedup, []),
        None,
    );
    let stats = Arc::new(Stats::new(4));
    let parts = Parts {
        admit,
        batcher: Batcher::new(policy, 3600),
        stats: stats.clone(),
        sessions: policy.sessions,
        backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(8)),
        subscriptions: 1,
        window: policy.window,
    };
    (Core::new(parts, now), stats)
}

fn start() -> Instant {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// The fake clock: `ms` after the start.
fn at(ms: u64) -> Now {
    Now {
        at: start() + Duration::from_millis(ms),
        wall: Timestamp::from_secs(1_763_719_200),
        lag: Duration::ZERO,
    }
}

/// Feeds one event; returns what the core asked for.
pub(super) fn feed(c: &mut Core<u32>, event: Event<u32>, now: Now) -> Vec<Action<u32>> {
    let mut out = Vec::new();
    c.handle(event, now, &mut out);
    out
}

fn tick(c: &mut Core<u32>, now: Now) -> Vec<Action<u32>> {
    let mut out = Vec::new();
    c.tick(now, &mut out);
    out
}

pub(super) fn mqtt(session: SessionId, event: MqttEvent) -> Event<u32> {
    Event::Mqtt(session, Ok(event))
}

fn connected(session_present: bool) -> MqttEvent {
    MqttEvent::Connected {
        session_present,
        handshake: Duration::from_millis(2),
    }
}

fn publish(pkid: u16, value: f64, dup: bool) -> MqttEvent {
    MqttEvent::Publish(Publish {
        topic: Bytes::from_static(b"sensors/a/t"),
        payload: Bytes::from(value.to_string()),
        pkid,
        qos: 1,
        dup,
    })
}

fn lost() -> Event<u32> {
    Event::Mqtt(
        S0,
        Err(PollError {
            message: "connection reset".into(),
            refused: false,
            tls: false,
        }),
    )
}

pub(super) fn committed(readings: usize) -> Event<u32> {
    Event::Committed(Committed {
        readings,
        took: Duration::from_millis(5),
        ..Committed::default()
    })
}

/// The batches handed to the writer among `actions`: their readings.
fn written(actions: &[Action<u32>]) -> Vec<usize> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Write(b) => Some(b.readings),
            _ => None,
        })
        .collect()
}

/// Everything `session` has to send at `now`, taken as the client would (room for all).
fn drain_outgoing(c: &mut Core<u32>, session: SessionId) -> Vec<Outgoing> {
    let mut sent = Vec::new();
    while let Some(what) = c.outgoing(session) {
        c.taken(session, what, true);
        sent.push(what);
        if what == Outgoing::Ping {
            break;
        }
    }
    sent
}

fn pkids(sent: &[Outgoing]) -> Vec<u16> {
    sent.iter()
        .filter_map(|o| match o {
            Outgoing::Ack(a) => Some(a.pkid),
            Outgoing::Ping => None,
        })
        .collect()
}

/// A core whose one session is connected and subscribed at 0 ms.
fn connected_core() -> (Core<u32>, Arc<Stats>) {
    let (mut c, stats) = core(1);
    let out = feed(&mut c, mqtt(S0, connected(false)), at(0));
    assert!(matches!(out[..], [Action::Subscribe(S0)]), "{out:?}");
    let out = feed(
        &mut c,
        mqtt(S0, MqttEvent::Subscribed { refused: vec![] }),
        at(0),
    );
    assert!(matches!(out[..], [Action::Ready]), "{out:?}");
    (c, stats)
}

/// Issue 54: a Sparkplug DATA message naming an alias no BIRTH gave becomes a rebirth request
/// the shell publishes on the message's session; a DEATH is counted as a control message, not
/// a rejection.
#[test]
fn an_unknown_sparkplug_alias_asks_the_shell_to_publish_a_rebirth() {
    let spb = Subscription {
        filter: "spBv1.0/#".into(),
        template: Template::parse("spBv1.0/#").unwrap(),
        format: Format::SparkplugB,
        rebirth_interval: Some(Duration::from_mins(1)),
        ..value_subscription()
    };
    let (mut c, stats) = core_reading(policy(2), start(), spb);
    let s1 = SessionId::all(2).nth(1).unwrap();
    for s in SessionId::all(2) {
        feed(&mut c, mqtt(s, connected(false)), at(0));
        feed(
            &mut c,
            mqtt(s, MqttEvent::Subscribed { refused: vec![] }),
            at(0),
        );
    }
    // NDATA: timestamp, one metric by alias 7 with a double.
    let mut metric = vec![0x10, 7, 0x69];
    metric.extend_from_slice(&1.5f64.to_le_bytes());
    let mut ndata = vec![0x08, 1, 0x12, metric.len() as u8];
    ndata.extend_from_slice(&metric);
    let publish = |topic: &'static [u8], payload: Vec<u8>| {
        MqttEvent::Publish(Publish {
            topic: Bytes::from_static(topic),
            payload: Bytes::from(payload),
            pkid: 0,
            qos: 0,
            dup: false,
        })
    };
    let out = feed(
        &mut c,
        mqtt(s1, publish(b"spBv1.0/g/NDATA/n", ndata.clone())),
        at(5),
    );
    let asked: Vec<_> = out
        .iter()
        .filter_map(|a| match a {
            Action::Publish(s, topic, _) => Some((*s, topic.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(asked, [(s1, "spBv1.0/g/NCMD/n".to_owned())], "{out:?}");
    assert_eq!(stats.rejected(DecodeError::UnknownAlias), 1);
    // Within the interval: counted, not asked again.
    let out = feed(
        &mut c,
        mqtt(S0, publish(b"spBv1.0/g/NDATA/n", ndata)),
        at(6),
    );
    assert!(
        !out.iter().any(|a| matches!(a, Action::Publish(..))),
        "{out:?}"
    );
    assert_eq!(stats.rejected(DecodeError::UnknownAlias), 2);
    feed(
        &mut c,
        mqtt(S0, publish(b"spBv1.0/g/NDEATH/n", Vec::new())),
        at(7),
    );
    // A death of a session bucketd never saw begin (no NBIRTH since it started): ignored,
    // counted.
    assert_eq!(stats.rejected(DecodeError::StaleDeath), 1);
    assert_eq!(stats.rejected_total(), 3);
}

#[test]
fn acks_leave_only_after_their_commit_and_in_arrival_order() {
    let (mut c, stats) = connected_core();
    for (pkid, t) in [(7, 10), (3, 20), (9, 30)] {
        assert!(feed(&mut c, mqtt(S0, publish(pkid, 1.5, false)), at(t)).is_empty());
    }
    assert_eq!(c.outgoing(S0), None, "nothing acked before the commit");
    // Due by the batcher's policy (a pause after a burst, or the interval from the first).
    let due = c.wake_at().unwrap();
    assert!(due > at(30).at && due <= at(1010).at, "{due:?}");
    assert!(written(&tick(&mut c, at(29))).is_empty());
    assert_eq!(written(&tick(&mut c, Now { at: due, ..at(0) })), [3]);
    assert!(c.committing());
    assert_eq!(c.wake_at(), None, "no deadline while the writer works");
    assert_eq!(c.outgoing(S0), None, "still nothing before the commit");
    assert!(feed(&mut c, committed(3), at(1020)).is_empty());
    assert_eq!(pkids(&drain_outgoing(&mut c, S0)), [7, 3, 9]);
    assert_eq!(stats.messages_received.load(Ordering::Relaxed), 3);
}

#[test]
fn an_ack_the_client_has_no_room_for_is_offered_again_first() {
    let (mut c, _) = connected_core();
    for pkid in 1..=3 {
        feed(&mut c, mqtt(S0, publish(pkid, 1.0, false)), at(0));
    }
    tick(&mut c, at(1000));
    feed(&mut c, committed(3), at(1001));
    let first = c.outgoing(S0).unwrap();
    c.taken(S0, first, true);
    let second = c.outgoing(S0).unwrap();
    c.taken(S0, second, false); // The request channel is full.
    assert_eq!(c.outgoing(S0), Some(second), "kept, in order");
    assert!(c.owes_acks(S0));
    assert_eq!(pkids(&drain_outgoing(&mut c, S0)), [2, 3]);
}

#[test]
fn a_reconnect_in_the_middle_of_a_commit_drops_the_old_connections_acks() {
    let (mut c, stats) = connected_core();
    feed(&mut c, mqtt(S0, publish(1, 1.0, false)), at(0));
    feed(&mut c, mqtt(S0, publish(2, 2.0, false)), at(5));
    assert_eq!(written(&tick(&mut c, at(1000))), [2]);
    // The connection drops while the writer commits; the session waits out its backoff.
    assert!(feed(&mut c, lost(), at(1001)).is_empty());
    assert!(!c.polls(S0), "not read while waiting to reconnect");
    assert_eq!(c.wake_at(), Some(at(2001).at), "backoff 1 s");
    assert!(tick(&mut c, at(2000)).is_empty());
    assert!(matches!(tick(&mut c, at(2001))[..], [Action::Resume(S0)]));
    assert!(c.polls(S0));
    // The broker kept the session: no subscribe, ready already told.
    assert!(feed(&mut c, mqtt(S0, connected(true)), at(2010)).is_empty());
    // The commit ends on the new connection: its acks name packet ids of the old one, which
    // may name other messages now; the broker resends those instead.
    feed(&mut c, committed(2), at(2020));
    assert_eq!(drain_outgoing(&mut c, S0), []);
    assert_eq!(stats.reconnects.load(Ordering::Relaxed), 1);
    // A message of the new connection is acked on it.
    feed(&mut c, mqtt(S0, publish(1, 3.0, false)), at(2030));
    tick(&mut c, at(3030));
    feed(&mut c, committed(1), at(3031));
    let sent = drain_outgoing(&mut c, S0);
    // The release's marker ping rides behind its ack.
    let [Outgoing::Ack(ack), Outgoing::Ping] = sent[..] else {
        panic!("{sent:?}")
    };
    assert_eq!((ack.pkid, ack.connection), (1, 2));
}

#[test]
fn a_reconnects_resends_are_held_until_a_new_message_ends_their_burst() {
    let (mut c, stats) = connected_core();
    feed(&mut c, lost(), at(10));
    tick(&mut c, at(1010));
    feed(&mut c, mqtt(S0, connected(true)), at(1020));
    // The broker resends two messages it had not seen acknowledged.
    feed(&mut c, mqtt(S0, publish(1, 1.0, true)), at(1021));
    feed(&mut c, mqtt(S0, publish(2, 2.0, true)), at(1022));
    assert_eq!(c.pending_readings(), 0, "held, not yet in the batch");
    assert_eq!(
        c.wake_at(),
        Some(at(1022).at + RESEND_QUIET_MIN),
        "the burst ends after a quiet"
    );
    // Not even a flush request hands a batch over while resends are held (their acks are in
    // it, their readings not yet).
    assert!(feed(&mut c, Event::Flush(9), at(1023)).is_empty());
    assert!(written(&tick(&mut c, at(1024))).is_empty());
    // A new message: the burst is over, the held ones join the batch first, in order.
    feed(&mut c, mqtt(S0, publish(3, 3.0, false)), at(1030));
    assert_eq!(c.pending_readings(), 3);
    assert_eq!(
        written(&tick(&mut c, at(1031))),
        [3],
        "the request's flush, at once"
    );
    let out = feed(&mut c, committed(3), at(2022));
    assert!(matches!(out[..], [Action::Answer(9, 3)]), "{out:?}");
    assert_eq!(pkids(&drain_outgoing(&mut c, S0)), [1, 2, 3]);
    assert_eq!(stats.duplicates.load(Ordering::Relaxed), 0);
}

#[test]
fn a_burst_of_resends_ends_after_a_quiet_and_copies_are_not_counted_twice() {
    let (mut c, stats) = connected_core();
    feed(&mut c, mqtt(S0, publish(1, 1.0, false)), at(0));
    tick(&mut c, at(1000));
    feed(&mut c, committed(1), at(1001));
    // The ack never reaches the broker: the connection drops first, and the message comes
    // again in the next connection's burst.
    feed(&mut c, lost(), at(1002));
    tick(&mut c, at(2002));
    feed(&mut c, mqtt(S0, connected(true)), at(2010));
    feed(&mut c, mqtt(S0, publish(1, 1.0, true)), at(2011));
    assert_eq!(c.pending_readings(), 0);
    let quiet_end = at(2011).at + RESEND_QUIET_MIN;
    assert_eq!(c.wake_at(), Some(quiet_end));
    let ms = u64::try_from((quiet_end - start()).as_millis()).unwrap();
    let mut batches = written(&tick(&mut c, at(ms)));
    assert_eq!(stats.duplicates.load(Ordering::Relaxed), 1);
    // Its ack is still owed on this connection: it rides the next commit (due at once or
    // later, by the batcher's policy), which adds no reading.
    if batches.is_empty() {
        let due = c.wake_at().unwrap();
        batches = written(&tick(&mut c, Now { at: due, ..at(0) }));
    }
    assert_eq!(batches, [0], "a copy of a counted message adds nothing");
    feed(&mut c, committed(0), at(3012));
    assert_eq!(pkids(&drain_outgoing(&mut c, S0)), [1]);
}

/// Every release is marked by a PINGREQ written right behind its acks (the batcher's measure of
/// the round trip as it is now: `batcher::Batcher::release_pinged`), and its answer confirms
/// them; no other ping is owed then.
#[test]
fn a_release_is_marked_by_a_ping_behind_its_acks() {
    let (mut c, _) = connected_core();
    feed(&mut c, mqtt(S0, publish(1, 1.0, false)), at(0));
    feed(&mut c, mqtt(S0, publish(2, 1.0, false)), at(1));
    tick(&mut c, at(1000));
    feed(&mut c, committed(2), at(1001));
    let ack = c.outgoing(S0).unwrap();
    c.taken(S0, ack, true);
    // The client's channel is full: the marker is asked for again, behind the acks still.
    assert!(matches!(c.outgoing(S0), Some(Outgoing::Ack(_))));
    let rest = drain_outgoing(&mut c, S0);
    assert!(
        matches!(rest[..], [Outgoing::Ack(_), Outgoing::Ping]),
        "{rest:?}"
    );
    assert_eq!(c.outgoing(S0), None, "one marker a release");
    feed(&mut c, mqtt(S0, MqttEvent::AcksSent(2)), at(1002));
    feed(&mut c, mqtt(S0, MqttEvent::PingSent), at(1002));
    feed(&mut c, mqtt(S0, MqttEvent::PingAnswered), at(1003));
    assert_eq!(c.wake_at(), None, "everything written is confirmed");
    assert_eq!(c.outgoing(S0), None);
}

/// A marker the client had no room for is asked for again, and a PINGREQ written before the
/// release's acks (rumqttc's keep-alive) marks nothing.
#[test]
fn a_marker_is_asked_for_until_a_ping_goes_out_behind_the_acks() {
    let (mut c, _) = connected_core();
    feed(&mut c, mqtt(S0, publish(1, 1.0, false)), at(0));
    tick(&mut c, at(1000));
    feed(&mut c, committed(1), at(1001));
    let ack = c.outgoing(S0).unwrap();
    c.taken(S0, ack, true);
    assert_eq!(pkids(&[ack]), [1]);
    assert_eq!(c.outgoing(S0), Some(Outgoing::Ping), "the marker");
    c.taken(S0, Outgoing::Ping, false);
    // A keep-alive ping goes out before the ack is written.
    feed(&mut c, mqtt(S0, MqttEvent::PingSent), at(1001));
    feed(&mut c, mqtt(S0, MqttEvent::PingAnswered), at(1001));
    assert_eq!(c.outgoing(S0), Some(Outgoing::Ping), "still wanted");
    c.taken(S0, Outgoing::Ping, true);
    assert_eq!(c.outgoing(S0), None, "queued");
    feed(&mut c, mqtt(S0, MqttEvent::AcksSent(1)), at(1002));
    feed(&mut c, mqtt(S0, MqttEvent::PingSent), at(1002));
    feed(&mut c, mqtt(S0, MqttEvent::PingAnswered), at(1003));
    assert_eq!(c.outgoing(S0), None);
    assert_eq!(c.wake_at(), None);
}

#[test]
fn a_flush_request_commits_at_once_and_is_answered_with_what_it_covered() {
    let (mut c, _) = connected_core();
    let out = feed(&mut c, Event::Flush(1), at(0));
    assert!(
        matches!(out[..], [Action::Answer(1, 0)]),
        "nothing pending: {out:?}"
    );
    feed(&mut c, mqtt(S0, publish(1, 1.0, false)), at(0));
    feed(&mut c, mqtt(S0, publish(2, 1.0, false)), at(1));
    assert!(feed(&mut c, Event::Flush(2), at(2)).is_empty());
    assert_eq!(
        written(&tick(&mut c, at(3))),
        [2],
        "long before the interval"
    );
    // A message during the commit joins the next batch; a second request covers both. It
    // commits once the interval since the last requested commit is over (issue 52).
    feed(&mut c, mqtt(S0, publish(3, 1.0, false)), at(4));
    assert!(feed(&mut c, Event::Flush(3), at(5)).is_empty());
    let out = feed(&mut c, committed(2), at(6));
    assert!(matches!(out[..], [Action::Answer(2, 2)]), "{out:?}");
    assert!(written(&tick(&mut c, at(7))).is_empty(), "not at once");
    let due = c.wake_at().unwrap();
    assert!(
        due <= at(1003).at,
        "at the latest the interval after the last one"
    );
    assert_eq!(written(&tick(&mut c, Now { at: due, ..at(0) })), [1]);
    let out = feed(&mut c, committed(1), at(1004));
    assert!(matches!(out[..], [Action::Answer(3, 3)]), "{out:?}");
}

/// Issue 52: a loop of `POST /api/v1/flush` on a gateway receiving 50 messages a second made a
/// commit (an fsync on the SD card) of every request, 48x the writes. Requests commit at once
/// at most once a `batch.flush_interval` (1 s here); the ones in between share the next
/// commit, which comes when that interval is over, and each is answered with what it covered.
#[test]
fn flush_requests_commit_at_most_once_an_interval_and_share_the_next_commit() {
    let (mut c, stats) = connected_core();
    let mut answered = Vec::new();
    let mut commits = Vec::new();
    // Two seconds: a request every 20 ms, a message every 200 ms (fewer than half the window
    // of 20 between commits, so that only the requests and the interval commit), each commit
    // taking 2 ms.
    for i in 0..100u32 {
        let t = u64::from(i) * 20;
        if i % 10 == 0 {
            let pkid = u16::try_from(i / 10 + 1).unwrap();
            feed(&mut c, mqtt(S0, publish(pkid, f64::from(i), false)), at(t));
        }
        let mut out = feed(&mut c, Event::Flush(i), at(t + 1));
        if let [n] = written(&tick(&mut c, at(t + 2)))[..] {
            commits.push(t + 2);
            out.extend(feed(&mut c, committed(n), at(t + 4)));
            drain_outgoing(&mut c, S0);
        }
        for a in out {
            if let Action::Answer(id, readings) = a {
                answered.push((id, readings));
            }
        }
    }
    // The first request at once, the next when the interval after it is over.
    assert_eq!(commits, [2, 1002]);
    assert_eq!(stats.flushes_by(FlushReason::Request), 2);
    // Requests 1 to 9 found nothing pending (the next message came at 200 ms), 10 to 50
    // shared the second commit (five readings), 51 to 59 found nothing pending again, 60 on
    // wait for the commit due at 2,002 ms.
    let mut want = vec![(0, 1)];
    want.extend((1..10).map(|i| (i, 0)));
    want.extend((10..=50).map(|i| (i, 5)));
    want.extend((51..60).map(|i| (i, 0)));
    assert_eq!(answered, want);
}

#[test]
fn shutdown_commits_what_is_pending_and_takes_nothing_new() {
    let (mut c, stats) = connected_core();
    feed(&mut c, mqtt(S0, publish(1, 1.0, false)), at(0));
    c.begin_drain();
    let mut out = Vec::new();
    assert!(!c.drain(at(1).at, &mut out));
    assert_eq!(
        written(&out),
        [1],
        "committed without waiting for the interval"
    );
    // A message arriving meanwhile is neither counted nor acknowledged.
    feed(&mut c, mqtt(S0, publish(2, 2.0, false)), at(2));
    assert_eq!(stats.messages_received.load(Ordering::Relaxed), 1);
    assert!(
        !c.drain(at(3).at, &mut Vec::new()),
        "the commit is still running"
    );
    feed(&mut c, committed(1), at(4));
    assert!(c.drain(at(5).at, &mut Vec::new()));
    assert!(c.owes_acks(S0));
    assert_eq!(pkids(&drain_outgoing(&mut c, S0)), [1]);
    assert!(c.owes_acks(S0), "until written to the socket");
    feed(&mut c, mqtt(S0, MqttEvent::AcksSent(1)), at(6));
    assert!(!c.owes_acks(S0));
}

/// A commit that fails for good never reaches the core (the shell stops, `IngestError`): until
/// the writer reports the batch committed, the core has no ack of it to give.
#[test]
fn a_batch_at_the_writer_releases_no_ack_until_it_is_committed() {
    let (mut c, _) = connected_core();
    feed(&mut c, mqtt(S0, publish(1, 1.0, false)), at(0));
    assert_eq!(written(&tick(&mut c, at(1000))), [1]);
    tick(&mut c, at(60_000));
    assert_eq!(c.outgoing(S0), None, "the commit is still running");
    feed(&mut c, committed(1), at(60_001));
    assert_eq!(pkids(&drain_outgoing(&mut c, S0)), [1]);
}

#[test]
fn readiness_waits_for_every_session_and_acks_go_back_on_their_own() {
    let (mut c, stats) = core(2);
    let s1 = SessionId::new(1);
    for s in [S0, s1] {
        feed(&mut c, mqtt(s, connected(false)), at(0));
    }
    let ok = || MqttEvent::Subscribed { refused: vec![] };
    assert!(feed(&mut c, mqtt(S0, ok()), at(1)).is_empty(), "one of two");
    assert!(!stats.subscribed.load(Ordering::Relaxed));
    assert!(matches!(
        feed(&mut c, mqtt(s1, ok()), at(2))[..],
        [Action::Ready]
    ));
    assert!(stats.subscribed.load(Ordering::Relaxed));
    feed(&mut c, mqtt(S0, publish(5, 1.0, false)), at(3));
    feed(&mut c, mqtt(s1, publish(5, 1.0, false)), at(4));
    feed(&mut c, mqtt(S0, publish(6, 1.0, false)), at(5));
    tick(&mut c, at(1003));
    feed(&mut c, committed(3), at(1004));
    assert_eq!(pkids(&drain_outgoing(&mut c, S0)), [5, 6]);
    assert_eq!(pkids(&drain_outgoing(&mut c, s1)), [5]);
}
