//! Claims: central instances on one shared subscription claim each delta message in
//! PostgreSQL, so that a copy given to the other instance is not applied twice; a central waits
//! for its claims database; one killed mid-stream loses nothing.

use super::*;

/// Two central instances on a round-robin shared subscription, claiming each delta message in
/// PostgreSQL: every message the gateways published is published again, twice, so that a copy
/// of each reaches the instance that did not apply the original. None is applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_central_instances_claim_each_delta_message_once() {
    let broker = Broker::hermetic();
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let upstream = OwnMosquitto::start(false, "");
    let claims = |raw: &mut bucketd::config::RawConfig| {
        raw.central.claims_postgres = conninfo.clone();
    };
    let filter = "$share/central/bucketd/+/deltas";
    let centrals = [
        central_with(&upstream, filter, claims),
        central_with(&upstream, filter, claims),
    ];
    let (spy, seen) = record_deltas(&upstream).await;
    let gateways = [
        mqtt_gateway(&broker, &upstream, "gw-c1", 0xC1A1),
        mqtt_gateway(&broker, &upstream, "gw-c2", 0xC1A2),
    ];
    let daemons: Vec<(Daemon, String)> = gateways.iter().map(|g| restart(&g.config)).collect();
    // Paced: many commits, so many delta messages.
    tokio::join!(
        publish_with(&broker, &gateways[0].work.messages, 1, Pace::Rate(500)),
        publish_with(&broker, &gateways[1].work.messages, 1, Pace::Rate(500)),
    );
    let total: i64 = gateways.iter().map(|g| g.work.readings.len() as i64).sum();
    let sum = async |name: &str| {
        metric(&centrals[0].addr, name).await + metric(&centrals[1].addr, name).await
    };
    until_metric("the centrals together have every reading", async || {
        sum("bucketd_readings_ingested_total").await >= total as f64
    })
    .await;
    for (d, _) in daemons {
        assert!(d.terminate().0.success());
    }

    let originals: Vec<(String, Vec<u8>)> = seen.lock().unwrap().clone();
    assert!(originals.len() >= 4, "{} delta messages", originals.len());
    // Twice, each time every copy to one instance, the other one the second time (a
    // rejected message between copies moves the round-robin on): each message's copy reaches
    // the instance that did not apply it.
    let junk = || {
        (
            "bucketd/not-a-gateway/deltas".to_owned(),
            b"moves the round-robin on".to_vec(),
        )
    };
    let mut copies = Vec::new();
    for round in 0..2 {
        if round == 1 {
            copies.push(junk());
        }
        for m in &originals {
            copies.push(m.clone());
            copies.push(junk());
        }
    }
    let upstream_broker = as_broker(&upstream);
    let received = sum("bucketd_messages_received_total").await;
    publish_all(&upstream_broker, &copies, 1).await;
    until_metric("every copy reached a central", async || {
        sum("bucketd_messages_received_total").await >= received + copies.len() as f64
    })
    .await;
    for c in &centrals {
        let (status, body) =
            crate::support::http("POST", format!("http://{}/api/v1/flush", c.addr)).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(
        sum("bucketd_duplicates_total").await,
        2.0 * originals.len() as f64,
        "every copy recognised"
    );
    let elsewhere = sum("bucketd_claimed_elsewhere_total").await;
    assert!(
        elsewhere >= 1.0,
        "no copy reached the instance that did not apply its original"
    );
    assert_eq!(sum("bucketd_readings_ingested_total").await, total as f64);
    assert_eq!(sum("bucketd_claim_errors_total").await, 0.0);
    spy.abort();
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
    // One claim per message, by one of the two instances.
    let pg = connect(&conninfo).await;
    let claimed: i64 = pg
        .query_one("SELECT count(*) FROM bucketd_claims", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(claimed, originals.len() as i64);
    drop(pg);
    testdb.drop_it().await;
}

/// While the claims database cannot be reached, a central applies no delta message (it cannot
/// know whether another instance has), counts the failures, leaves the messages to the broker,
/// and applies them once the database answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_central_waits_for_its_claims_database_and_then_applies_everything() {
    let broker = Broker::hermetic();
    let admin = connect(&admin_conninfo()).await;
    let name = unique("bucketd_claims").replace('-', "_").to_lowercase();
    let conninfo = conninfo_of(&name);
    let upstream = OwnMosquitto::start(false, "");
    let central = central_with(&upstream, "$share/central/bucketd/+/deltas", |raw| {
        raw.central.claims_postgres = conninfo.clone();
    });
    let gateway = mqtt_gateway(&broker, &upstream, "gw-w", 0xC1A3);
    let (daemon, _) = restart(&gateway.config);
    publish_all(&broker, &gateway.work.messages, 1).await;
    until_metric("the central failed to claim", async || {
        metric(&central.addr, "bucketd_claim_errors_total").await >= 2.0
    })
    .await;
    assert_eq!(
        metric(&central.addr, "bucketd_readings_ingested_total").await,
        0.0,
        "applied without a claim"
    );
    // The message waits for its claim, the ingest loop does not: it still answers a flush
    // request (served from its select loop), at once.
    let flushed = tokio::time::timeout(
        Duration::from_secs(5),
        http("POST", format!("http://{}/api/v1/flush", central.addr)),
    )
    .await
    .expect("the ingest loop answers while a claim waits");
    assert_eq!(flushed, (200, r#"{"committed":0}"#.to_owned()));
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let n = gateway.work.readings.len() as f64;
    until_metric("the central applied everything", async || {
        metric(&central.addr, "bucketd_readings_ingested_total").await >= n
    })
    .await;
    assert!(daemon.terminate().0.success());
    let (status, lines) = central.daemon.terminate();
    assert!(status.success());
    assert!(
        lines
            .iter()
            .any(|l| l.contains("Cannot claim a delta message") && l.contains(&name)),
        "the log names the problem"
    );
    let docs = merged(std::slice::from_ref(&central.db));
    assert_matches_truth(&docs, &fleet_truth(&[("gw-w", &gateway.work)]));
    admin
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await
        .unwrap();
}

/// A central in a shared group, with claims, killed with `kill -9` while the gateways stream
/// and restarted: what it had claimed but not committed comes back to it from its broker
/// session, and the two instances together hold every reading once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_central_killed_mid_stream_loses_nothing_and_applies_nothing_twice() {
    let broker = Broker::hermetic();
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let upstream = OwnMosquitto::start(false, "");
    let claims = |raw: &mut bucketd::config::RawConfig| {
        raw.central.claims_postgres = conninfo.clone();
    };
    let filter = "$share/central/bucketd/+/deltas";
    let [first, second] = [
        central_with(&upstream, filter, claims),
        central_with(&upstream, filter, claims),
    ];
    let gateways = [
        mqtt_gateway(&broker, &upstream, "gw-k1", 0xC1A5),
        mqtt_gateway(&broker, &upstream, "gw-k2", 0xC1A6),
    ];
    let daemons: Vec<(Daemon, String)> = gateways.iter().map(|g| restart(&g.config)).collect();
    let publishers: Vec<_> = gateways
        .iter()
        .map(|g| {
            let (broker, messages) = (broker.clone(), g.work.messages.clone());
            tokio::spawn(async move { publish_with(&broker, &messages, 1, Pace::Rate(300)).await })
        })
        .collect();
    until_metric("the first central is applying deltas", async || {
        metric(&first.addr, "bucketd_readings_ingested_total").await > 0.0
    })
    .await;
    let (status, _) = first.daemon.kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    // What the killed instance had committed, from its file (opened for writing: after a
    // kill redb repairs it first, as the restarted daemon would).
    let store = bucketd::store::Store::open(&bucketd::store::StoreSettings {
        path: first.db.clone(),
        bucket_width_secs: 3600,
        durability: bucketd::config::Durability::Immediate,
        quick_repair: true,
        cache_bytes: 4 << 20,
        page_capacity: 1000,
        dedup_window: 8192,
        outbox_max_entries: 0,
        journal_bytes: 1 << 20,
    })
    .unwrap();
    let before_kill: i64 = store
        .reader()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap()
        .iter()
        .map(|d| d.count)
        .sum();
    drop(store);
    let (restarted, addr) = restart(&first.config);
    for p in publishers {
        p.await.unwrap();
    }
    let total: i64 = gateways.iter().map(|g| g.work.readings.len() as i64).sum();
    until_metric("the centrals together have every reading", async || {
        before_kill as f64
            + metric(&addr, "bucketd_readings_ingested_total").await
            + metric(&second.addr, "bucketd_readings_ingested_total").await
            >= total as f64
    })
    .await;
    for a in [&addr, &second.addr] {
        let (status, body) = crate::support::http("POST", format!("http://{a}/api/v1/flush")).await;
        assert_eq!(status, 200, "{body}");
    }
    for (d, _) in daemons {
        assert!(d.terminate().0.success());
    }
    assert!(restarted.terminate().0.success());
    assert!(second.daemon.terminate().0.success());
    let docs = merged(&[first.db.clone(), second.db.clone()]);
    assert_eq!(
        docs.iter().map(|d| d.count).sum::<i64>(),
        total,
        "once each"
    );
    let want = fleet_truth(&[
        (&gateways[0].id, &gateways[0].work),
        (&gateways[1].id, &gateways[1].work),
    ]);
    assert_matches_truth(&docs, &want);
    drop((first._dir, second._dir));
    testdb.drop_it().await;
}

/// Issue 41: a claim at `seq % 256 == 0` trimmed the gateway's claims of every *other* origin,
/// so one message with a forged origin deleted the real database's claims (and a resend of its
/// newest batch could then be applied twice). A message now trims only its own database's
/// claims; another database's go only once they are older than any resend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_origin_cannot_trim_the_real_databases_claims() {
    use bucketd::delta::Position;
    use bucketd::fleet::claims::Claims;

    let testdb = TestDb::create().await;
    let config = bucketd::config::ClaimsConfig {
        conninfo: testdb.conninfo(),
        password_file: None,
        keep_entries: 1000,
    };
    let mut claims = Claims::new(config, None, "central-a".into());
    let at = |origin: &str, seq: i64| Position {
        origin: origin.into(),
        seq,
        part: 0,
    };
    let real = "2026-11-22T12:00:00.000Z";
    for seq in 1..=300 {
        assert!(claims.claim("gw-r", &at(real, seq)).await.unwrap());
    }
    let pg = connect(&testdb.conninfo()).await;
    let count = async |origin: &str| -> i64 {
        pg.query_one(
            "SELECT count(*) FROM bucketd_claims WHERE gateway_id = 'gw-r' AND origin = $1",
            &[&origin],
        )
        .await
        .unwrap()
        .get(0)
    };
    assert_eq!(count(real).await, 300);
    // Forged: another origin, at a position that trims.
    let forged = "2026-11-26T00:00:00.000Z";
    assert!(claims.claim("gw-r", &at(forged, 2048)).await.unwrap());
    assert_eq!(
        count(real).await,
        300,
        "the real database's claims are kept"
    );
    // Its own trim still works: 2048 - 1000 = 1048 keeps nothing of its own below that.
    assert!(claims.claim("gw-r", &at(real, 2304)).await.unwrap());
    assert_eq!(
        count(real).await,
        1,
        "the real database trims its own old claims"
    );
    // Another database's claims go once a week old.
    pg.execute(
        "UPDATE bucketd_claims SET claimed_at = now() - interval '8 days' WHERE origin = $1",
        &[&forged],
    )
    .await
    .unwrap();
    assert!(claims.claim("gw-r", &at(real, 2560)).await.unwrap());
    assert_eq!(count(forged).await, 0);
    drop(pg);
    testdb.drop_it().await;
}
