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

use crate::api::get_json;
use crate::ingest::{stamped_workload, wait_ingested, wait_subscribed};
use crate::on_every_broker;
use crate::support::{
    Broker, Topics, assert_matches_truth, config, eventually, publish_all, publish_paced,
    raw_config, truth,
};

const WAIT: Duration = Duration::from_secs(60);

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
    let (_, metrics) = crate::api::http("GET", format!("http://{}/metrics", d.http_addr)).await;
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
