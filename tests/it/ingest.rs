//! End to end: readings published to a real broker end up in the redb file exactly as a ground
//! truth computed here says; a restart increments buckets instead of replacing them; messages
//! published while the daemon is down are delivered from its persistent session; bad payloads
//! are rejected, counted by reason, and do not stop ingestion.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bucketd::batcher::FlushReason;
use bucketd::config::Protocol;
use bucketd::daemon::{self};
use bucketd::decode::DecodeError;
use bucketd::stats::Stats;
use bucketd::store::StoreReader;

use crate::on_every_broker;
use crate::own_mosquitto::OwnMosquitto;
use crate::support::*;

const WAIT: Duration = Duration::from_mins(1);

fn rejected_by_reason(stats: &Stats) -> BTreeMap<&'static str, u64> {
    DecodeError::ALL
        .iter()
        .map(|e| (e.reason(), stats.rejected(*e)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

async fn ingest_matches_ground_truth_across_restarts(broker: Broker, protocol: Protocol) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let cfg = config(&raw_config(&broker, protocol, &db, &topics));

    // Phase 1: a few thousand readings with bad input mixed in.
    let first = workload(&topics, 1, 3000, 30);
    let d = daemon::start(&cfg).unwrap();
    wait_subscribed(&d).await;
    publish_paced(&broker, &first.messages, 1, Some(d.stats.clone())).await;
    wait_ingested(&d, first.readings.len() as u64, first.rejected_total()).await;
    assert_eq!(rejected_by_reason(&d.stats), first.rejected);
    assert_eq!(
        Stats::get(&d.stats.messages_received),
        first.messages.len() as u64
    );
    assert!(
        d.stats.dead_letters().iter().any(|l| l.payload == b"warm"),
        "rejected payloads are kept for inspection"
    );
    d.stop().await.unwrap();
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    assert_matches_truth(&docs, &truth(&first.readings, 3600));

    // Phase 2: published while the daemon is down (the broker queues them for its session),
    // then more after the restart. Buckets are incremented, not replaced.
    let queued = workload(&topics, 2, 500, 0);
    publish_all(&broker, &queued.messages, 1).await;
    let d = daemon::start(&cfg).unwrap();
    let later = workload(&topics, 3, 500, 5);
    wait_subscribed(&d).await;
    publish_paced(&broker, &later.messages, 1, Some(d.stats.clone())).await;
    let phase2_readings = (queued.readings.len() + later.readings.len()) as u64;
    let phase2_rejected = queued.rejected_total() + later.rejected_total();
    wait_ingested(&d, phase2_readings, phase2_rejected).await;
    let mut all = first;
    all.extend(queued);
    all.extend(later);
    d.stop().await.unwrap();
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    assert_matches_truth(&docs, &truth(&all.readings, 3600));
}

on_every_broker!(ingest_matches_ground_truth_across_restarts);

/// rumqttd enforces an in-flight window of 100 whatever the client asks for: it sends nothing
/// more until earlier messages are acknowledged. The daemon is configured for a window of 500
/// (so the half-window rule never fires) and a one-hour flush interval: a policy that waited
/// for either would deliver 100 messages an hour. The stall rule must get thousands through at
/// commit speed. (Mosquitto 2.0.11 does not enforce its window, so this runs on rumqttd only.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_broker_window_does_not_stall_a_long_flush_interval() {
    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let mut raw = raw_config(&broker, Protocol::V311, &db, &topics);
    raw.batch.flush_interval = Duration::from_hours(1);
    raw.mqtt.receive_maximum = 500;
    let cfg = config(&raw);
    let total = 6000;
    let messages: Vec<(String, Vec<u8>)> = (0..total)
        .map(|i| (topics.value("w", "x"), format!("{i}").into_bytes()))
        .collect();

    let d = daemon::start(&cfg).unwrap();
    wait_subscribed(&d).await;
    publish_paced(&broker, &messages, 1, Some(d.stats.clone())).await;
    // Every window is committed when the broker stalls on it, long before the interval.
    let stats = d.stats.clone();
    eventually(WAIT, "every reading to commit", || {
        Stats::get(&stats.readings_ingested) >= total
    })
    .await;
    // One stall teaches the window; the rest are committed the moment it is full again.
    let full =
        d.stats.flushes_by(FlushReason::Stall) + d.stats.flushes_by(FlushReason::BrokerWindow);
    assert!(full >= total / 100 - 1, "{full} commits of a full window");
    assert_eq!(d.stats.flushes_by(FlushReason::Interval), 0);
    d.stop().await.unwrap();
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    let count: i64 = docs.iter().map(|d| d.count).sum();
    assert_eq!(count, total as i64);
    let sum: f64 = docs.iter().map(|d| d.summary().total()).sum();
    assert_eq!(sum, (0..total).sum::<u64>() as f64);
}

/// A broker that sends more unacknowledged messages than the window bucketd asked for
/// (rumqttd ignores Receive Maximum and sends 100; Mosquitto 2.0.11 leaks past it) overflows
/// the client's request channel, which is sized for the window. Acknowledgements must then
/// wait their turn, in order, and nothing may be lost or counted twice.
async fn a_broker_that_exceeds_the_window_loses_nothing(broker: Broker, protocol: Protocol) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let mut raw = raw_config(&broker, protocol, &db, &topics);
    raw.mqtt.receive_maximum = 4;
    let cfg = config(&raw);
    let work = workload(&topics, 11, 3000, 10);
    let d = daemon::start(&cfg).unwrap();
    wait_subscribed(&d).await;
    publish_paced(&broker, &work.messages, 1, Some(d.stats.clone())).await;
    wait_ingested(&d, work.readings.len() as u64, work.rejected_total()).await;
    let stats = d.stats.clone();
    eventually(WAIT, "the unacknowledged gauge to reach 0", || {
        Stats::get(&stats.unacked_messages) == 0
    })
    .await;
    d.stop().await.unwrap();
    assert_eq!(
        Stats::get(&stats.acks_sent),
        work.messages.len() as u64,
        "every message acknowledged exactly once"
    );
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    assert_matches_truth(&docs, &truth(&work.readings, 3600));
}

on_every_broker!(a_broker_that_exceeds_the_window_loses_nothing);

/// The connection to the broker drops and stays down for a while (a proxy between daemon and
/// broker is cut), while devices keep publishing to the broker. The daemon notices, retries
/// with backoff, reconnects, resumes its session, and ingests everything the broker kept.
///
/// Delivery is at least once: acknowledgements still in transit when the connection dies are
/// lost with it, and the broker redelivers those messages. So nothing may be missing, min, max,
/// first and last must be exact (a duplicate does not change them), and the only readings
/// counted twice can be those of messages delivered before the cut.
async fn reconnects_and_resumes_its_session_after_an_outage(broker: Broker, protocol: Protocol) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let proxy = Proxy::start(&broker.host, broker.port(protocol)).await;
    let mut raw = raw_config(&broker, protocol, &db, &topics);
    raw.mqtt.port = proxy.port;
    let cfg = config(&raw);
    // Messages the cut catches between commit and acknowledgement are redelivered and must not
    // count twice. Receive-time readings are recognised by the DUP flag of the redelivery,
    // which rumqttd does not set (docs/RELIABILITY.md); Mosquitto does.
    let load = |seed, n| {
        if broker.sets_dup {
            workload(&topics, seed, n, 0)
        } else {
            stamped_workload(&topics, seed, n)
        }
    };
    let before = load(21, 1000);
    let during = load(22, 500);
    let after = load(23, 500);

    let d = daemon::start(&cfg).unwrap();
    let stats = d.stats.clone();
    wait_subscribed(&d).await;
    publish_paced(&broker, &before.messages, 1, Some(d.stats.clone())).await;
    wait_ingested(&d, before.readings.len() as u64, before.rejected_total()).await;

    proxy.set_up(false);
    eventually(WAIT, "the daemon to notice the outage", || {
        !stats.connected.load(Ordering::Relaxed)
    })
    .await;
    publish_all(&broker, &during.messages, 1).await;
    let errors = Stats::get(&stats.connection_errors);
    eventually(WAIT, "three reconnect attempts to fail", || {
        Stats::get(&stats.connection_errors) >= errors + 3
    })
    .await;
    assert!(!stats.connected.load(Ordering::Relaxed));
    proxy.set_up(true);
    eventually(WAIT, "the daemon to reconnect", || {
        stats.connected.load(Ordering::Relaxed)
    })
    .await;
    publish_paced(&broker, &after.messages, 1, Some(d.stats.clone())).await;
    // Markers on every topic say when everything has arrived (see `markers`).
    let all_messages: Vec<_> = [&before, &during, &after]
        .iter()
        .flat_map(|w| w.messages.iter().cloned())
        .collect();
    let markers = markers(&all_messages);
    publish_all(&broker, &markers, 1).await;
    eventually(WAIT, "the markers after every other message", || {
        stats.rejected(DecodeError::EmptyPayload) == markers.len() as u64
    })
    .await;
    let expected = (before.readings.len() + during.readings.len() + after.readings.len()) as u64;
    assert_eq!(Stats::get(&stats.reconnects), 1);
    d.stop().await.unwrap();
    assert_eq!(
        Stats::get(&stats.readings_ingested),
        expected,
        "none lost, none twice"
    );

    let mut all = before;
    all.extend(during);
    all.extend(after);
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    assert_matches_truth(&docs, &truth(&all.readings, 3600));
}

on_every_broker!(reconnects_and_resumes_its_session_after_an_outage);

/// Limits hold end to end: a device inventing series past `limits.max_series` gets counted
/// `series_limit` rejections (the known series keep being ingested), and a payload over
/// `limits.max_payload_bytes` is a counted `payload_too_large`, acknowledged, not a stall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn series_and_payload_limits_reject_and_count() {
    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let mut raw = raw_config(&broker, Protocol::V5, &dir.path().join("b.redb"), &topics);
    raw.limits.max_series = 3;
    raw.limits.max_payload_bytes = bytesize::ByteSize::kib(1);
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    let mut messages: Vec<(String, Vec<u8>)> = (0..5)
        .map(|i| (topics.value(&format!("dev{i}"), "t"), b"1.5".to_vec()))
        .collect();
    messages.push((topics.value("dev0", "t"), vec![b'1'; 2048]));
    messages.push((topics.value("dev1", "t"), b"2.5".to_vec()));
    publish_all(&broker, &messages, 1).await;
    wait_ingested(&d, 4, 3).await;
    assert_eq!(d.stats.rejected(DecodeError::SeriesLimit), 2);
    assert_eq!(d.stats.rejected(DecodeError::PayloadTooLarge), 1);
    let stats = d.stats.clone();
    d.stop().await.unwrap();
    assert_eq!(
        Stats::get(&stats.acks_sent),
        messages.len() as u64,
        "rejected ones acked too"
    );
    let reader = StoreReader::open(&dir.path().join("b.redb")).unwrap();
    assert_eq!(reader.series().unwrap(), ["dev0/t", "dev1/t", "dev2/t"]);
}

/// Over MQTT 3.1.1 the broker cannot learn `mqtt.max_packet_size`, so it sends a larger QoS 1
/// message anyway; the client library resets the connection, and the broker redelivers it on
/// the next one: before, nothing after it was ever ingested. Now the next connection takes it
/// in (up to `mqtt.max_packet_size_to_drop`) and admission rejects it, acknowledged; the
/// messages behind it arrive, and later connections are back to the normal limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_over_v311_is_rejected_not_redelivered_forever() {
    let mosquitto = OwnMosquitto::start(false, "");
    let broker = Broker::own(&mosquitto);
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let raw = raw_config(&broker, Protocol::V311, &dir.path().join("b.redb"), &topics);
    assert_eq!(raw.mqtt.max_packet_size, bytesize::ByteSize::kib(256));
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    let mut messages = vec![(topics.value("big", "t"), vec![b'1'; 400 << 10])];
    messages.extend((0..10).map(|i| (topics.value("small", "t"), format!("{i}").into_bytes())));
    publish_all(&broker, &messages, 1).await;
    wait_ingested(&d, 10, 1).await;
    assert_eq!(d.stats.rejected(DecodeError::PayloadTooLarge), 1);
    // One reset for the oversized packet, then nothing more: it was acknowledged.
    let stats = d.stats.clone();
    let more = vec![(topics.value("small", "t"), b"10".to_vec())];
    publish_all(&broker, &more, 1).await;
    wait_ingested(&d, 11, 1).await;
    d.stop().await.unwrap();
    assert_eq!(
        Stats::get(&stats.acks_sent),
        12,
        "the oversized one acked too"
    );
}

/// A broker may give a packet id to the next message as soon as the one it carried is
/// acknowledged. Receive-time readings with the same payload on the same topic then have the same
/// fingerprint (topic, payload, packet id): M1 ("1", id 1) is committed and acknowledged, M2
/// ("1", id 1 again) reaches bucketd, and the connection ends before M2's ack. The broker resends
/// M2 with DUP, which matches M1's fingerprint: it must be recognised as M2's copy (M2's first
/// delivery is in the batch), not lost and not counted twice. (For M2's first delivery lost on
/// the wire, see `a_reused_packet_id_after_a_confirmed_ack_lost_on_the_wire`.)
async fn a_packet_id_reused_for_the_same_payload(protocol: Protocol) {
    let broker = StrictBroker::start(100, Duration::ZERO).await;
    broker.reuse_ids();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let target = broker.target();
    let cfg = config(&raw_config(&target, protocol, &db, &topics));
    let d = daemon::start(&cfg).unwrap();
    let stats = d.stats.clone();
    wait_subscribed(&d).await;
    let m = vec![(topics.value("door", "open"), b"1".to_vec())];
    broker.publish(&m, |_| 1);
    eventually(WAIT, "M1 acknowledged", || broker.seen().acked == 1).await;
    broker.close_after_next();
    broker.publish(&m, |_| 1);
    eventually(WAIT, "M2 resent, committed and acknowledged", || {
        broker.drained() && Stats::get(&stats.readings_ingested) >= 2
    })
    .await;
    d.stop().await.unwrap();
    let seen = broker.seen();
    let ctx = format!("{protocol:?}: {seen:?}");
    assert_eq!(seen.ids, [1, 1], "M2 took M1's packet id: {ctx}");
    assert_eq!(seen.connections, 2, "{ctx}");
    assert_eq!(seen.resent, 1, "M2 again, with DUP and id 1: {ctx}");
    assert_eq!(
        Stats::get(&stats.duplicates),
        1,
        "the resend is a copy: {ctx}"
    );
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    let count: i64 = docs.iter().map(|d| d.count).sum();
    assert_eq!(count, 2, "M1 and M2, once each: {ctx}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_packet_id_reused_for_the_same_payload_v311() {
    a_packet_id_reused_for_the_same_payload(Protocol::V311).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_packet_id_reused_for_the_same_payload_v5() {
    a_packet_id_reused_for_the_same_payload(Protocol::V5).await;
}

/// The case of issue 19 as it was written: M1 ("1", id 1) is committed and acknowledged, and
/// the broker gives id 1 again to M2 ("1" again, the sensor's value held), whose first delivery
/// is lost on the wire with the connection. M2's resend matches M1 exactly, and a resend of M1
/// would look the same, had the broker not read M1's ack. bucketd asks for a PINGREQ after each
/// commit's acks; the broker answered it before M2 was sent, so M1's ack was read and M1 cannot
/// be resent: M2 is new. Without the ping confirmation the resend was taken for M1's copy: one
/// reading, not two.
async fn a_reused_packet_id_after_a_confirmed_ack_lost_on_the_wire(protocol: Protocol) {
    let broker = StrictBroker::start(100, Duration::ZERO).await;
    broker.reuse_ids();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let cfg = config(&raw_config(&broker.target(), protocol, &db, &topics));
    let d = daemon::start(&cfg).unwrap();
    let stats = d.stats.clone();
    wait_subscribed(&d).await;
    let m = vec![(topics.value("door", "open"), b"1".to_vec())];
    broker.publish(&m, |_| 1);
    eventually(WAIT, "M1's ack read, then a PINGREQ answered", || {
        broker.seen().acked_at_ping == 1
    })
    .await;
    // The PINGRESP goes out ahead of M2, which is lost: bucketd reads it, then the end of the
    // stream.
    broker.lose_next();
    broker.publish(&m, |_| 1);
    eventually(WAIT, "M2 resent and acknowledged", || {
        broker.drained() && broker.seen().acked == 2
    })
    .await;
    d.stop().await.unwrap();
    let seen = broker.seen();
    let ctx = format!("{protocol:?}: {seen:?}");
    assert_eq!(seen.ids, [1, 1], "M2 took M1's packet id: {ctx}");
    assert_eq!((seen.connections, seen.resent), (2, 1), "{ctx}");
    assert_eq!(Stats::get(&stats.duplicates), 0, "{ctx}");
    assert_eq!(stored_count(&db), 2, "M1 and M2: {ctx}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_packet_id_after_a_confirmed_ack_lost_on_the_wire_v311() {
    a_reused_packet_id_after_a_confirmed_ack_lost_on_the_wire(Protocol::V311).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_packet_id_after_a_confirmed_ack_lost_on_the_wire_v5() {
    a_reused_packet_id_after_a_confirmed_ack_lost_on_the_wire(Protocol::V5).await;
}

/// Four sensors that report the same value every round, through a broker that gives each round
/// the packet ids 1 to 4 again (the lowest free): every message of round three has the
/// fingerprint (topic, payload, packet id) of round two's. Rounds one and two are committed and
/// acknowledged.
fn round(topics: &Topics) -> Vec<(String, Vec<u8>)> {
    (0..4)
        .map(|i| (topics.value(&format!("s{i}"), "t"), b"21.5".to_vec()))
        .collect()
}

/// Round three's first message reaches bucketd; its second is lost on the wire with the
/// connection. The broker resends both with DUP: the first is a copy of what bucketd holds, the
/// second is new although round two's second message has its fingerprint (a copy of that one
/// would come before copies of round two's third and fourth, which are not resent). Telling
/// resends by the window alone dropped it: 11 readings, not 12 (`crate::resend` in the library).
async fn a_reused_packet_id_lost_on_the_wire(protocol: Protocol) {
    let broker = StrictBroker::start(100, Duration::ZERO).await;
    broker.reuse_ids();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let cfg = config(&raw_config(&broker.target(), protocol, &db, &topics));
    let d = daemon::start(&cfg).unwrap();
    let stats = d.stats.clone();
    wait_subscribed(&d).await;
    let round = round(&topics);
    for n in 1..=2 {
        broker.publish(&round, |_| 1);
        eventually(WAIT, "the round acknowledged", || {
            broker.seen().acked == 4 * n
        })
        .await;
    }
    broker.publish(&round[..1], |_| 1);
    broker.lose_next();
    broker.publish(&round[1..], |_| 1);
    eventually(WAIT, "twelve readings", || {
        broker.drained() && Stats::get(&stats.readings_ingested) >= 12
    })
    .await;
    d.stop().await.unwrap();
    let seen = broker.seen();
    let ctx = format!("{protocol:?}: {seen:?}");
    assert_eq!(seen.ids, [1, 2, 3, 4].repeat(3), "{ctx}");
    assert_eq!((seen.connections, seen.resent), (2, 2), "{ctx}");
    assert_eq!(
        Stats::get(&stats.duplicates),
        1,
        "the first resend only: {ctx}"
    );
    assert_eq!(stored_count(&db), 12, "{ctx}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_packet_id_lost_on_the_wire_v311() {
    a_reused_packet_id_lost_on_the_wire(Protocol::V311).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_packet_id_lost_on_the_wire_v5() {
    a_reused_packet_id_lost_on_the_wire(Protocol::V5).await;
}

/// Round three's first two messages reach bucketd, which dies (kill -9) before committing
/// them. After the restart the broker resends both: they repeat the start of round two, but
/// copies of round two would run to its end. Both are new: 10 readings. Telling resends by the
/// window alone dropped both: 8.
async fn a_reused_packet_id_uncommitted_at_a_crash(protocol: Protocol) {
    let broker = StrictBroker::start(100, Duration::ZERO).await;
    broker.reuse_ids();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let mut raw = raw_config(&broker.target(), protocol, &db, &topics);
    // Nothing commits unless asked (POST /api/v1/flush): round three waits for the kill. The
    // stated window keeps a quiet batch from passing for a full window.
    raw.batch.flush_interval = Duration::from_hours(24);
    raw.mqtt.broker_window = 100;
    let path = write_config(dir.path(), &raw);
    let daemon = Daemon::start(&path);
    let lines = daemon.wait_for_line("saying it subscribed", |l| {
        l.contains("Subscribed to every")
    });
    let addr = http_addr(&lines);
    let flush = format!("http://{addr}/api/v1/flush");
    let round = round(&topics);
    for n in 1..=2 {
        broker.publish(&round, |_| 1);
        eventually(WAIT, "the round sent", || broker.seen().ids.len() == 4 * n).await;
        eventually_async(WAIT, "the round acknowledged", async || {
            http("POST", flush.clone()).await;
            broker.seen().acked == 4 * n
        })
        .await;
    }
    // A sensor's next round comes well after the last acknowledgement (not as a broker's
    // refill of its window, which would be committed at once).
    tokio::time::sleep(Duration::from_millis(300)).await;
    daemon.lines_so_far();
    broker.publish(&round[..2], |_| 1);
    eventually_async(WAIT, "both received, unacknowledged", async || {
        let (_, metrics) = http("GET", format!("http://{addr}/metrics")).await;
        metrics.contains("\nbucketd_messages_received_total 10\n")
            && metrics.contains("\nbucketd_unacked_messages 2\n")
    })
    .await;
    let (_, rest) = daemon.kill();
    assert!(
        !rest.iter().any(|l| l.contains("Committed batch.")),
        "round three was committed before the kill: {rest:#?}"
    );
    let daemon = Daemon::start(&path);
    let lines = daemon.wait_for_line("saying it serves", |l| l.contains("Serving /metrics"));
    let flush = format!("http://{}/api/v1/flush", http_addr(&lines));
    eventually_async(WAIT, "the resends acknowledged", async || {
        http("POST", flush.clone()).await;
        broker.seen().acked == 10
    })
    .await;
    let (status, _) = daemon.terminate();
    assert!(status.success());
    let seen = broker.seen();
    let ctx = format!("{protocol:?}: {seen:?}");
    assert_eq!(seen.ids, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], "{ctx}");
    assert_eq!(seen.resent, 2, "{ctx}");
    assert_eq!(stored_count(&db), 10, "{ctx}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_packet_id_uncommitted_at_a_crash_v311() {
    a_reused_packet_id_uncommitted_at_a_crash(Protocol::V311).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_packet_id_uncommitted_at_a_crash_v5() {
    a_reused_packet_id_uncommitted_at_a_crash(Protocol::V5).await;
}

/// Readings in the buckets of the file at `db`.
fn stored_count(db: &std::path::Path) -> i64 {
    let docs = StoreReader::open(db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    docs.iter().map(|d| d.count).sum()
}
