//! PostgreSQL: three gateways (the `bucketd` binary, each its own broker session and redb file)
//! forward their bucket deltas into one database; one is killed with `kill -9` while its
//! forwarding transaction is open and is restarted; the SQL table must equal the merged ground
//! truth of all three workloads exactly, every delta applied once. And a gateway whose database
//! was replaced is applied from its start.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_forward_exactly_once_through_a_kill_9_mid_transaction() {
    let broker = Broker::hermetic();
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let pg = connect(&conninfo).await;
    let gateways = [
        gateway(&broker, "gw-a", 0xF1EE7, 1200, &conninfo),
        gateway(&broker, "gw-b", 0xF1EE8, 2500, &conninfo),
        gateway(&broker, "gw-c", 0xF1EE9, 600, &conninfo),
    ];
    let mut daemons: Vec<Option<Daemon>> = gateways
        .iter()
        .map(|g| {
            let d = Daemon::start(&g.config);
            d.wait_for_line("saying it subscribed", |l| {
                l.contains("Subscribed to every")
            });
            Some(d)
        })
        .collect();

    // gw-a's first workload, forwarded completely; the others stream meanwhile.
    let a = &gateways[0];
    publish_all(&broker, &a.work.messages, 1).await;
    for g in &gateways[1..] {
        publish_all(&broker, &g.work.messages, 1).await;
    }
    until_forwarded(&pg, &a.id, a.work.readings.len() as i64).await;
    // Killed right after forwarding: its outbox still holds entries PostgreSQL has applied
    // (they are trimmed at the next commit), and the restarted forwarder sends them again.
    // PostgreSQL must skip them: the count stays where it is.
    let (status, _) = daemons[0].take().unwrap().kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    let (restarted, addr) = restart(&a.config);
    daemons[0] = Some(restarted);
    let deadline = Instant::now() + Duration::from_mins(1);
    while metric(&addr, "bucketd_upstream_forwarded_entries_total").await == 0.0 {
        assert!(
            Instant::now() < deadline,
            "the restarted gw-a never forwarded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        pg_count(&pg, &a.id).await,
        a.work.readings.len() as i64,
        "entries sent again were applied again"
    );
    // Then hold a lock on every row gw-a has, so that the forwarding transaction of its second
    // workload (the same sensors and hours) stops in the middle, holding the gateway row.
    let second = stamped_workload(&a.topics, 0xF1EEA, 800);
    let mut blocker = connect(&conninfo).await;
    let lock = blocker.transaction().await.unwrap();
    lock.execute(
        "SELECT 1 FROM bucketd_buckets WHERE gateway_id = $1 FOR UPDATE",
        &[&a.id],
    )
    .await
    .unwrap();
    publish_all(&broker, &second.messages, 1).await;
    let application = format!("bucketd {}", a.id);
    let deadline = Instant::now() + Duration::from_mins(1);
    loop {
        let waiting = pg
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE application_name = $1 AND wait_event_type = 'Lock'",
                &[&application],
            )
            .await
            .unwrap()
            .get::<_, i64>(0);
        if waiting > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "gw-a's forwarder never blocked on the locked rows"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before_kill = pg_count(&pg, &a.id).await;
    let (status, _) = daemons[0].take().unwrap().kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    // The killed gateway's transaction never commits: releasing the lock lets its backend run
    // on, find the client gone and roll back.
    lock.rollback().await.unwrap();
    drop(blocker);
    assert_eq!(pg_count(&pg, &a.id).await, before_kill);
    daemons[0] = Some(restart(&a.config).0);

    let mut gateways = gateways;
    gateways[0].work.extend(second);
    for g in &gateways {
        until_forwarded(&pg, &g.id, g.work.readings.len() as i64).await;
    }
    // Stop the gateways: every entry left in an outbox must be one PostgreSQL has applied.
    for d in &mut daemons {
        let (status, _) = d.take().unwrap().terminate();
        assert!(status.success(), "clean exit: {status}");
    }
    for g in &gateways {
        let last_seq: i64 = pg
            .query_one(
                "SELECT last_seq FROM bucketd_gateways WHERE gateway_id = $1",
                &[&g.id],
            )
            .await
            .unwrap()
            .get(0);
        let left = StoreReader::open(&g.db)
            .unwrap()
            .outbox(Some(u64::try_from(last_seq).unwrap()), usize::MAX)
            .unwrap();
        assert!(
            left.is_empty(),
            "{}: {} entries never forwarded",
            g.id,
            left.len()
        );
        // Exactly the ground truth: every field of every bucket, quantiles included. A delta
        // applied twice would show in the counts.
        let rows = rows_of(&pg, &g.id).await;
        let want = truth(&g.work.readings, 3600);
        assert_eq!(
            rows.iter().map(|d| d.count).sum::<i64>(),
            g.work.readings.len() as i64,
            "{}: readings in PostgreSQL",
            g.id
        );
        assert_eq!(rows.len(), want.len(), "{}: buckets", g.id);
        assert_matches_truth(&rows, &want);
        // And the same as the gateway's own buckets.
        let local: BTreeMap<(String, i64), i64> = StoreReader::open(&g.db)
            .unwrap()
            .buckets(None, i64::MIN, i64::MAX)
            .unwrap()
            .into_iter()
            .map(|d| ((d.series, d.start), d.count))
            .collect();
        let upstream: BTreeMap<(String, i64), i64> = rows
            .into_iter()
            .map(|d| ((d.series, d.start), d.count))
            .collect();
        assert_eq!(
            upstream, local,
            "{}: PostgreSQL vs the gateway's buckets",
            g.id
        );
    }
    drop(pg);
    testdb.drop_it().await;
}

/// A gateway whose database was replaced (a new SD card, same `gateway_id`) numbers its outbox
/// from the start again: PostgreSQL must apply those entries, not take them for ones it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_with_a_replaced_database_is_applied_from_its_start() {
    let broker = Broker::hermetic();
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let pg = connect(&conninfo).await;
    let first = gateway(&broker, "gw-new-card", 0xCA4D, 800, &conninfo);
    let (daemon, _) = restart(&first.config);
    publish_all(&broker, &first.work.messages, 1).await;
    let n1 = first.work.readings.len() as i64;
    until_forwarded(&pg, &first.id, n1).await;
    assert!(daemon.terminate().0.success());
    let second = gateway(&broker, "gw-new-card", 0xCA4E, 300, &conninfo);
    let (daemon, _) = restart(&second.config);
    publish_all(&broker, &second.work.messages, 1).await;
    let n2 = second.work.readings.len() as i64;
    until_forwarded(&pg, &second.id, n1 + n2).await;
    let (status, lines) = daemon.terminate();
    assert!(status.success());
    assert!(
        lines
            .iter()
            .any(|l| l.contains("deltas from another database")),
        "the gateway says PostgreSQL knew another database under its id"
    );
    let rows = rows_of(&pg, &first.id).await;
    let mut readings = first.work.readings.clone();
    readings.extend(second.work.readings.iter().cloned());
    assert_eq!(rows.iter().map(|d| d.count).sum::<i64>(), n1 + n2);
    assert_matches_truth(&rows, &truth(&readings, 3600));
    drop(pg);
    testdb.drop_it().await;
}
