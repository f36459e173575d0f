//! Faults under the daemon: a disk that fills up (writes fail with ENOSPC, injected under
//! redb through `bucketd::store::Faults`, the seam a real full card exercises the same way:
//! redb sees an I/O error from its storage backend) and a broker that goes away.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bucketd::config::Protocol;
use bucketd::daemon;
use bucketd::stats::Stats;
use bucketd::store::{Faults, StoreReader};

use crate::on_every_broker;
use crate::support::*;

const WAIT: Duration = Duration::from_mins(1);

/// The disk fills up mid-stream: commits fail and are retried, nothing is acknowledged, the
/// open batch stops at `max_pending_readings` and the broker holds the rest; `/readyz` and the
/// metrics say so. When space returns, everything is committed exactly once.
async fn a_full_disk_holds_back_acks_and_recovers_without_loss(broker: Broker, protocol: Protocol) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let mut raw = raw_config(&broker, protocol, &db, &topics);
    raw.batch.max_pending_readings = 300;
    let faults = Arc::new(Faults::default());
    let d = daemon::start_with_faults(&config(&raw), Some(faults.clone())).unwrap();
    let stats = d.stats.clone();
    wait_subscribed(&d).await;
    let before = stamped_workload(&topics, 41, 1000);
    publish_paced(&broker, &before.messages, 1, Some(stats.clone())).await;
    wait_ingested(&d, before.readings.len() as u64, before.rejected_total()).await;
    eventually(WAIT, "every acknowledgement written", || {
        Stats::get(&stats.unacked_messages) == 0
    })
    .await;
    let acks_before = Stats::get(&stats.acks_sent);

    faults.fail_writes.store(true, Relaxed);
    let during = stamped_workload(&topics, 42, 1500);
    publish_all(&broker, &during.messages, 1).await;
    eventually(WAIT, "a failed commit", || {
        Stats::get(&stats.commit_errors) > 0
    })
    .await;
    let (status, ready) = get_json(&d, "/readyz").await;
    assert_eq!((status, &ready["store_writable"]), (503, &false.into()));
    let (_, metrics) = crate::support::http("GET", format!("http://{}/metrics", d.http_addr)).await;
    assert!(
        metrics.contains("\nbucketd_store_writable 0\n"),
        "{metrics}"
    );
    // Backpressure: the daemon takes messages until its open batch is full or the broker's
    // in-flight window is (whichever comes first; Mosquitto's is 20 messages, rumqttd's 100),
    // and the retries go on.
    let failed = faults.failed.load(Relaxed);
    eventually(WAIT, "more attempts to write", || {
        faults.failed.load(Relaxed) > failed + 2
    })
    .await;
    let held = Stats::get(&stats.pending_readings);
    eprintln!(
        "while failing: {held} readings pending, {} messages unacknowledged, {} commit errors",
        Stats::get(&stats.unacked_messages),
        Stats::get(&stats.commit_errors)
    );
    assert!(held <= 300 + 8 * 2, "pending readings stay bounded: {held}");
    assert!(
        Stats::get(&stats.messages_received)
            < (before.messages.len() + during.messages.len()) as u64,
        "the broker holds the rest"
    );
    assert_eq!(
        Stats::get(&stats.acks_sent),
        acks_before,
        "nothing is acknowledged while commits fail"
    );
    assert_eq!(
        Stats::get(&stats.readings_ingested),
        before.readings.len() as u64
    );

    faults.fail_writes.store(false, Relaxed);
    let total = (before.readings.len() + during.readings.len()) as u64;
    wait_ingested(&d, total, before.rejected_total() + during.rejected_total()).await;
    assert!(!stats.store_failing.load(Relaxed));
    assert_eq!(get_json(&d, "/readyz").await.0, 200);
    d.stop().await.unwrap();
    let mut all = before;
    all.extend(during);
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    assert_matches_truth(&docs, &truth(&all.readings, 3600));
}

on_every_broker!(a_full_disk_holds_back_acks_and_recovers_without_loss);

/// A slow card (every fsync takes 50 ms): commits take long, the open batch fills to its
/// limit and bucketd stops reading; what it holds stays within `max_pending_readings` and the
/// broker's window, the broker holds the rest, and everything arrives exactly once.
async fn a_slow_store_bounds_what_is_pending(broker: Broker, protocol: Protocol) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let mut raw = raw_config(&broker, protocol, &db, &topics);
    raw.batch.max_pending_readings = 500;
    raw.mqtt.receive_maximum = 200;
    raw.limits.dedup_window = 200;
    let faults = Arc::new(Faults::default());
    faults.sync_delay_micros.store(50_000, Relaxed);
    let d = daemon::start_with_faults(&config(&raw), Some(faults.clone())).unwrap();
    let stats = d.stats.clone();
    wait_subscribed(&d).await;
    let work = stamped_workload(&topics, 61, 6000);
    let publisher = {
        let (broker, messages, stats) = (broker.clone(), work.messages.clone(), stats.clone());
        tokio::spawn(async move { publish_paced(&broker, &messages, 1, Some(stats)).await })
    };
    let (mut pending_max, mut unacked_max) = (0, 0);
    let total = work.readings.len() as u64;
    eventually(WAIT, "every reading", || {
        pending_max = pending_max.max(Stats::get(&stats.pending_readings));
        unacked_max = unacked_max.max(Stats::get(&stats.unacked_messages));
        Stats::get(&stats.readings_ingested) >= total
    })
    .await;
    publisher.await.unwrap();
    eprintln!(
        "slow store ({} {protocol:?}): {} flushes, at most {pending_max} readings pending and \
         {unacked_max} messages unacknowledged",
        broker.name,
        Stats::get(&stats.flushes)
    );
    // One message past the limit at most: 8 objects of 2 readings.
    assert!(pending_max <= 500 + 16, "pending readings: {pending_max}");
    d.stop().await.unwrap();
    assert_eq!(Stats::get(&stats.readings_ingested), total);
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    assert_matches_truth(&docs, &truth(&work.readings, 3600));
}

on_every_broker!(a_slow_store_bounds_what_is_pending);

use crate::own_mosquitto::OwnMosquitto;

/// The broker stops mid-stream (messages committed and not yet acknowledged, others still
/// queued for bucketd) and comes back a while later: bucketd retries with backoff, `/readyz`
/// and `bucketd_mqtt_connected` say it is down meanwhile, it resumes its session, and every
/// bucket ends equal to the ground truth: nothing the broker kept is lost, nothing is counted
/// twice.
async fn a_broker_restart_loses_nothing_and_counts_nothing_twice(protocol: Protocol) {
    if std::env::var_os("BUCKETD_TEST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("bucketd=debug")
            .with_test_writer()
            .try_init();
    }
    let mut mosquitto = OwnMosquitto::start(true, "");
    let broker = Broker::own(&mosquitto);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let raw = raw_config(&broker, protocol, &db, &topics);
    let d = daemon::start(&config(&raw)).unwrap();
    let stats = d.stats.clone();
    wait_subscribed(&d).await;

    let before = crate::support::workload(&topics, 51, 3000, 0);
    publish_all(&broker, &before.messages, 1).await;
    // Stop it while bucketd is still working through what was published.
    mosquitto.down();
    eventually(WAIT, "the daemon to notice", || {
        !stats.connected.load(Relaxed)
    })
    .await;
    let (status, ready) = get_json(&d, "/readyz").await;
    assert_eq!((status, &ready["mqtt_connected"]), (503, &false.into()));
    let (_, metrics) = crate::support::http("GET", format!("http://{}/metrics", d.http_addr)).await;
    assert!(
        metrics.contains("\nbucketd_mqtt_connected 0\n"),
        "{metrics}"
    );
    let errors = Stats::get(&stats.connection_errors);
    eventually(WAIT, "two reconnect attempts to fail", || {
        Stats::get(&stats.connection_errors) >= errors + 2
    })
    .await;
    assert!(
        Stats::get(&stats.messages_received) > 0,
        "something arrived before the stop"
    );

    mosquitto.up();
    eventually(WAIT, "the daemon to reconnect", || {
        stats.connected.load(Relaxed) && stats.subscribed.load(Relaxed)
    })
    .await;
    assert_eq!(get_json(&d, "/readyz").await.0, 200);
    let after = crate::support::workload(&topics, 52, 1000, 0);
    publish_paced(&broker, &after.messages, 1, Some(stats.clone())).await;
    let marker = vec![(topics.value("marker", "done"), b"done".to_vec())];
    publish_all(&broker, &marker, 1).await;
    let mut all = before;
    all.extend(after);
    // Every reading, and the marker. (Messages restored from the broker's persistence file are
    // not always delivered before newer ones, so the marker alone does not say "everything".)
    // Duplicates would push the count past the total; the exact comparison below catches them.
    let expected = all.readings.len() as u64;
    eventually(WAIT, "every reading and the marker", || {
        Stats::get(&stats.readings_ingested) >= expected
            && stats.rejected(bucketd::decode::DecodeError::InvalidNumber) == 1
    })
    .await;
    d.stop().await.unwrap();
    eprintln!(
        "broker restart ({protocol:?}): {} readings, {} redeliveries recognised",
        Stats::get(&stats.readings_ingested),
        Stats::get(&stats.duplicates)
    );
    assert_eq!(Stats::get(&stats.readings_ingested), expected);
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    assert_matches_truth(&docs, &truth(&all.readings, 3600));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_loses_nothing_and_counts_nothing_twice_v5() {
    a_broker_restart_loses_nothing_and_counts_nothing_twice(Protocol::V5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_loses_nothing_and_counts_nothing_twice_v311() {
    a_broker_restart_loses_nothing_and_counts_nothing_twice(Protocol::V311).await;
}
