//! Over MQTT: two gateways forward through an upstream Mosquitto of the test's own to a central
//! bucketd while that broker is stopped and restarted; two central instances split the deltas
//! with a shared subscription; a late copy is not applied twice; narrower buckets fold. The
//! central buckets must equal the merged ground truth exactly.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_forward_over_mqtt_through_an_upstream_restart() {
    let broker = Broker::hermetic();
    let mut upstream = OwnMosquitto::start(true, "");
    let central = central(&upstream, "bucketd/+/deltas");
    let mut gateways = [
        mqtt_gateway(&broker, &upstream, "gw-m1", 0xDE17A),
        mqtt_gateway(&broker, &upstream, "gw-m2", 0xDE17B),
    ];
    let mut addrs: Vec<(Daemon, String)> = gateways.iter().map(|g| restart(&g.config)).collect();
    for g in &gateways {
        publish_all(&broker, &g.work.messages, 1).await;
    }
    let first: i64 = gateways.iter().map(|g| g.work.readings.len() as i64).sum();
    until_metric("the central has the first workloads", async || {
        metric(&central.addr, "bucketd_readings_ingested_total").await >= first as f64
    })
    .await;
    // gw-m1 killed with everything forwarded but its outbox not yet trimmed (that happens at
    // its next commit): restarted, it publishes those entries again, and the central must
    // recognise every one of them.
    let (status, _) = addrs.remove(0).0.kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    addrs.insert(0, restart(&gateways[0].config));
    until_metric("the restarted gw-m1 sent its entries again", async || {
        metric(&addrs[0].1, "bucketd_upstream_forwarded_entries_total").await >= 1.0
    })
    .await;
    until_metric("the central saw them again", async || {
        metric(&central.addr, "bucketd_duplicates_total").await >= 1.0
    })
    .await;
    assert_eq!(
        metric(&central.addr, "bucketd_readings_ingested_total").await,
        first as f64,
        "entries sent again were counted again"
    );

    // The upstream broker goes away; the gateways go on ingesting and keep their deltas.
    upstream.down();
    let seconds: Vec<Workload> = gateways
        .iter()
        .enumerate()
        .map(|(i, g)| stamped_workload(&g.topics, 0xDE17C + i as u64, 700))
        .collect();
    let mut before = Vec::new();
    for (_, addr) in &addrs {
        before.push(metric(addr, "bucketd_readings_ingested_total").await);
    }
    for w in &seconds {
        publish_all(&broker, &w.messages, 1).await;
    }
    for ((w, (_, addr)), before) in seconds.iter().zip(&addrs).zip(before) {
        let want = before + w.readings.len() as f64;
        until_metric("the gateway committed its second workload", async || {
            metric(addr, "bucketd_readings_ingested_total").await >= want
        })
        .await;
        until_metric("the gateway noticed the upstream is gone", async || {
            metric(addr, "bucketd_upstream_errors_total").await >= 1.0
        })
        .await;
    }
    upstream.up();
    for (g, w) in gateways.iter_mut().zip(seconds) {
        g.work.extend(w);
    }
    let total: i64 = gateways.iter().map(|g| g.work.readings.len() as i64).sum();
    until_metric("the central has every reading", async || {
        metric(&central.addr, "bucketd_readings_ingested_total").await >= total as f64
    })
    .await;
    // The central's query API answers for a gateway's series.
    let series = format!("{}:{}", gateways[1].id, gateways[1].work.readings[0].series);
    let want: i64 = gateways[1]
        .work
        .readings
        .iter()
        .filter(|r| format!("{}:{}", gateways[1].id, r.series) == series)
        .count() as i64;
    let now = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let (status, body) = crate::support::http(
        "GET",
        format!(
            "http://{}/api/v1/buckets?series={series}&from={}&to={}",
            central.addr,
            now - 6 * 3600,
            now + 3600
        ),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    let counted: i64 = answer["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["count"].as_i64().unwrap())
        .sum();
    assert_eq!(counted, want, "{series} through the central's API");
    for (d, _) in addrs {
        assert!(d.terminate().0.success());
    }
    assert!(central.daemon.terminate().0.success());
    let docs = merged(std::slice::from_ref(&central.db));
    assert_eq!(
        docs.iter().map(|d| d.count).sum::<i64>(),
        total,
        "applied once"
    );
    let want = fleet_truth(&[
        (&gateways[0].id, &gateways[0].work),
        (&gateways[1].id, &gateways[1].work),
    ]);
    assert_eq!(docs.len(), want.len());
    assert_matches_truth(&docs, &want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_central_instances_share_the_deltas_and_together_hold_the_totals() {
    let broker = Broker::hermetic();
    let upstream = OwnMosquitto::start(false, "");
    let centrals = [
        central(&upstream, "$share/central/bucketd/+/deltas"),
        central(&upstream, "$share/central/bucketd/+/deltas"),
    ];
    let gateways = [
        mqtt_gateway(&broker, &upstream, "gw-s1", 0x5A1),
        mqtt_gateway(&broker, &upstream, "gw-s2", 0x5A2),
    ];
    let daemons: Vec<(Daemon, String)> = gateways.iter().map(|g| restart(&g.config)).collect();
    for g in &gateways {
        publish_all(&broker, &g.work.messages, 1).await;
    }
    let total: i64 = gateways.iter().map(|g| g.work.readings.len() as i64).sum();
    until_metric("the centrals together have every reading", async || {
        metric(&centrals[0].addr, "bucketd_readings_ingested_total").await
            + metric(&centrals[1].addr, "bucketd_readings_ingested_total").await
            >= total as f64
    })
    .await;
    let each = [
        metric(&centrals[0].addr, "bucketd_readings_ingested_total").await,
        metric(&centrals[1].addr, "bucketd_readings_ingested_total").await,
    ];
    assert!(
        each[0] > 0.0 && each[1] > 0.0,
        "both centrals took a share: {each:?}"
    );
    for (d, _) in daemons {
        assert!(d.terminate().0.success());
    }
    let mut dbs = Vec::new();
    let mut dirs = Vec::new();
    for c in centrals {
        assert!(c.daemon.terminate().0.success());
        dbs.push(c.db);
        dirs.push(c._dir);
    }
    let docs = merged(&dbs);
    assert_eq!(docs.iter().map(|d| d.count).sum::<i64>(), total);
    let want = fleet_truth(&[
        (&gateways[0].id, &gateways[0].work),
        (&gateways[1].id, &gateways[1].work),
    ]);
    assert_matches_truth(&docs, &want);
}

/// The central keeps, per gateway, the last (sequence number, part) it applied, in its redb
/// file with the buckets: a copy is recognised however late it comes, after the central's
/// restart too; a gateway whose database was replaced numbers from the start again, and those
/// entries are new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_central_applies_each_gateway_entry_once_however_late_the_copy() {
    let broker = Broker::hermetic();
    let upstream = OwnMosquitto::start(true, "");
    let central = central(&upstream, "bucketd/+/deltas");
    let (spy, seen) = record_deltas(&upstream).await;
    let first = mqtt_gateway(&broker, &upstream, "gw-r", 0xC0FE);
    let (daemon, _) = restart(&first.config);
    publish_all(&broker, &first.work.messages, 1).await;
    let n1 = first.work.readings.len() as f64;
    until_metric("the central has the first workload", async || {
        metric(&central.addr, "bucketd_readings_ingested_total").await >= n1
    })
    .await;
    assert!(daemon.terminate().0.success());

    // Every message again, after the central restarted (its memory is gone; the copies are
    // far older than any window of recent messages).
    assert!(central.daemon.terminate().0.success());
    let (daemon, addr) = restart(&central.config);
    let copies: Vec<(String, Vec<u8>)> = seen.lock().unwrap().clone();
    assert!(copies.len() >= 2, "{}", copies.len());
    let upstream_broker = as_broker(&upstream);
    publish_all(&upstream_broker, &copies, 1).await;
    until_metric("the central saw every copy", async || {
        metric(&addr, "bucketd_duplicates_total").await >= copies.len() as f64
    })
    .await;
    assert_eq!(
        metric(&addr, "bucketd_readings_ingested_total").await,
        0.0,
        "copies were applied again"
    );

    // The gateway's database replaced: a new file numbers its entries from the start.
    let second = mqtt_gateway(&broker, &upstream, "gw-r", 0xC0FF);
    let (gw, _) = restart(&second.config);
    publish_all(&broker, &second.work.messages, 1).await;
    let n2 = second.work.readings.len() as f64;
    until_metric(
        "the central has the replaced gateway's workload",
        async || metric(&addr, "bucketd_readings_ingested_total").await >= n2,
    )
    .await;
    assert!(gw.terminate().0.success());
    let (status, lines) = daemon.terminate();
    assert!(status.success());
    assert!(
        lines
            .iter()
            .any(|l| l.contains("now come from another database")),
        "the central says the gateway's database changed"
    );
    spy.abort();
    let docs = merged(std::slice::from_ref(&central.db));
    let want = fleet_truth(&[("gw-r", &first.work), ("gw-r", &second.work)]);
    assert_eq!(docs.iter().map(|d| d.count).sum::<i64>(), (n1 + n2) as i64);
    assert_matches_truth(&docs, &want);
}

/// A gateway with narrower buckets than the central (15 minutes into an hour): its deltas fold
/// into the central's buckets exactly. One with wider buckets (2 hours) cannot be split: its
/// deltas are rejected with `bucket_width_mismatch`, counted, and nothing of it is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_central_folds_narrower_gateway_buckets_and_rejects_wider_ones() {
    let broker = Broker::hermetic();
    let upstream = OwnMosquitto::start(false, "");
    let central = central(&upstream, "bucketd/+/deltas");
    let narrow = mqtt_gateway_with(&broker, &upstream, "gw-15m", 0x15, |raw| {
        raw.store.bucket_width = Duration::from_mins(15);
    });
    let wide = mqtt_gateway_with(&broker, &upstream, "gw-2h", 0x7200, |raw| {
        raw.store.bucket_width = Duration::from_hours(2);
    });
    let daemons: Vec<(Daemon, String)> = [&narrow, &wide]
        .iter()
        .map(|g| restart(&g.config))
        .collect();
    for g in [&narrow, &wide] {
        publish_all(&broker, &g.work.messages, 1).await;
    }
    let n = narrow.work.readings.len() as f64;
    until_metric(
        "the central has the narrow gateway's readings",
        async || metric(&central.addr, "bucketd_readings_ingested_total").await >= n,
    )
    .await;
    until_metric("the wide gateway's deltas were rejected", async || {
        metric(
            &central.addr,
            "bucketd_readings_rejected_total{reason=\"bucket_width_mismatch\"}",
        )
        .await
            >= 1.0
    })
    .await;
    for (d, _) in daemons {
        assert!(d.terminate().0.success());
    }
    assert!(central.daemon.terminate().0.success());
    let docs = merged(std::slice::from_ref(&central.db));
    assert!(docs.iter().all(|d| d.series.starts_with("gw-15m:")));
    assert_eq!(docs.iter().map(|d| d.count).sum::<i64>(), n as i64);
    assert_matches_truth(&docs, &fleet_truth(&[("gw-15m", &narrow.work)]));
}
