//! Over MQTT: two gateways forward through an upstream Mosquitto of the test's own to a central
//! bucketd while that broker is stopped and restarted; a late copy is not applied twice;
//! narrower buckets fold. The
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

/// Issue 20, end to end: with the broker ACL of docs/FLEET.md ("Threat model") a gateway's broker
/// user cannot publish on another gateway's topic; and on its own topic a message naming another
/// gateway, or one without an origin (a wildcard that used to silence a gateway), is refused by
/// the central: counted, listed by `GET /api/v1/rejected` and logged with the gateway's name,
/// while its real messages are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_cannot_write_as_another_through_the_acl_or_the_payload() {
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};

    let auth = tempfile::tempdir().unwrap();
    // Mosquitto reads these after dropping to the `mosquitto` user.
    let mut perms = std::fs::metadata(auth.path()).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(auth.path(), perms).unwrap();
    let passwd = auth.path().join("passwd");
    for (i, (user, password)) in [("gw-a", "pw-a"), ("central", "pw-c")].iter().enumerate() {
        let create: &[&str] = if i == 0 { &["-c", "-b"] } else { &["-b"] };
        let status = std::process::Command::new("mosquitto_passwd")
            .args(create)
            .arg(&passwd)
            .args([user, password])
            .status()
            .expect("mosquitto_passwd (apt-get install mosquitto)");
        assert!(status.success());
    }
    let acl = auth.path().join("acl");
    std::fs::write(
        &acl,
        "pattern write bucketd/%u/deltas\nuser central\ntopic read bucketd/+/deltas\n",
    )
    .unwrap();
    for file in [&passwd, &acl] {
        let mut perms = std::fs::metadata(file).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o644);
        std::fs::set_permissions(file, perms).unwrap();
    }
    let upstream = OwnMosquitto::start(
        false,
        &format!(
            "allow_anonymous false\npassword_file {}\nacl_file {}\n",
            passwd.display(),
            acl.display()
        ),
    );
    let central_password = auth.path().join("central-password");
    std::fs::write(&central_password, "pw-c\n").unwrap();
    let central = central_with(&upstream, "bucketd/+/deltas", |raw| {
        raw.mqtt.username = "central".into();
        raw.mqtt.password_file = central_password.display().to_string();
    });

    let hour = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        / 3600
        * 3600;
    let message = |gateway: &str, origin: &str, seq: i64| {
        let summary = bucketd::summary::Summary::of(hour * 1_000_000_000, 21.5);
        bson::serialize_to_vec(&bucketd::delta::DeltaMessage {
            gateway_id: gateway.into(),
            origin: origin.into(),
            seq,
            part: 0,
            buckets: vec![BucketDoc::new("boiler/t", hour, 3600, &summary)],
        })
        .unwrap()
    };
    let origin = "2026-11-22T12:00:00.000Z";
    let connect = || {
        let mut opts = MqttOptions::new(unique("gw-a"), "127.0.0.1", upstream.port);
        opts.set_credentials("gw-a", "pw-a");
        AsyncClient::new(opts, 16)
    };
    // Another gateway's topic: the ACL drops it. (Mosquitto 2.0.11 then closes the 3.1.1
    // connection, and answers a denied QoS 1 PUBLISH with an MQTT 5 PUBACK; a connection of its
    // own, ended either way, keeps that out of the rest.) The broker has handled the PUBLISH
    // before the next connection exists: had it passed it, the central would get it first.
    let (client, mut events) = connect();
    client
        .publish(
            "bucketd/gw-b/deltas",
            QoS::AtMostOnce,
            false,
            message("gw-b", origin, 0),
        )
        .await
        .unwrap();
    client.disconnect().await.unwrap();
    loop {
        match events.poll().await {
            Ok(Event::Outgoing(rumqttc::Outgoing::Disconnect)) | Err(_) => break,
            Ok(_) => {}
        }
    }
    let (client, mut events) = connect();
    let sent = [
        // Its own topic, another gateway's name: gateway_mismatch.
        ("bucketd/gw-a/deltas", message("gw-b", origin, i64::MAX)),
        // Its own, with no origin and the last position: invalid_delta.
        ("bucketd/gw-a/deltas", message("gw-a", "", i64::MAX)),
        // Its own real message, published last: applied.
        ("bucketd/gw-a/deltas", message("gw-a", origin, 0)),
    ];
    for (topic, payload) in &sent {
        client
            .publish(*topic, QoS::AtLeastOnce, false, payload.clone())
            .await
            .unwrap();
    }
    let mut acked = 0;
    while acked < sent.len() {
        if let Event::Incoming(Packet::PubAck(_)) = events.poll().await.unwrap() {
            acked += 1;
        }
    }
    until_metric("the central applied gw-a's real message", async || {
        metric(&central.addr, "bucketd_readings_ingested_total").await >= 1.0
    })
    .await;
    let rejected = |reason: &'static str| {
        let addr = central.addr.clone();
        async move {
            metric(
                &addr,
                &format!("bucketd_readings_rejected_total{{reason=\"{reason}\"}}"),
            )
            .await
        }
    };
    assert_eq!(rejected("gateway_mismatch").await, 1.0);
    assert_eq!(rejected("invalid_delta").await, 1.0);
    let (status, body) =
        crate::support::http("GET", format!("http://{}/api/v1/rejected", central.addr)).await;
    assert_eq!(status, 200);
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
    let reasons: Vec<(&str, &str)> = listed["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["reason"].as_str().unwrap(), d["topic"].as_str().unwrap()))
        .collect();
    assert_eq!(
        reasons,
        [
            ("gateway_mismatch", "bucketd/gw-a/deltas"),
            ("invalid_delta", "bucketd/gw-a/deltas")
        ]
    );
    central
        .daemon
        .wait_for_line("naming the refused gateway", |l| {
            l.contains("refused a gateway's delta message") && l.contains("gw-a")
        });
    assert!(central.daemon.terminate().0.success());
    let docs = merged(std::slice::from_ref(&central.db));
    let series: Vec<&str> = docs.iter().map(|d| d.series.as_str()).collect();
    assert_eq!(series, ["gw-a:boiler/t"]);
    assert_eq!(docs[0].count, 1);
}
