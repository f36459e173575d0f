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
    let mut daemons = start_subscribed(&gateways);

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
    // Stop the gateways: every entry left in an outbox must be one PostgreSQL has applied.
    all_forwarded_then_stopped(&pg, &gateways, &mut daemons).await;
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

/// Issue 20: bucketd's PostgreSQL client honours libpq's `sslmode` over rustls, against the
/// machine's PostgreSQL with TLS on (Debian's snakeoil certificate; `.ci/run` turns TLS on if it
/// is off). Each connection reports whether it is encrypted (`pg_stat_ssl`), so `disable` in the
/// same run is the comparison; `verify-ca` and `verify-full` check the chain against
/// `sslrootcert` (the server's own certificate) and the host name.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_over_tls_honours_sslmode() {
    let admin = connect(&admin_conninfo()).await;
    let on: String = admin.query_one("SHOW ssl", &[]).await.unwrap().get(0);
    assert_eq!(
        on, "on",
        "PostgreSQL has TLS off: ALTER SYSTEM SET ssl = on; SELECT pg_reload_conf(); (.ci/run does it)"
    );
    let cert: String = admin
        .query_one("SHOW ssl_cert_file", &[])
        .await
        .unwrap()
        .get(0);
    let data: String = admin
        .query_one("SHOW data_directory", &[])
        .await
        .unwrap()
        .get(0);
    let cert = std::path::Path::new(&data).join(cert); // a relative path is in the data directory
    // The name the certificate is for (make-ssl-cert uses the machine's name).
    let san = std::process::Command::new("openssl")
        .args(["x509", "-noout", "-ext", "subjectAltName", "-in"])
        .arg(&cert)
        .output()
        .expect("openssl (Debian's ssl-cert, which PostgreSQL's package depends on)");
    let san = String::from_utf8(san.stdout).unwrap();
    let name = san
        .split(|c: char| c == ',' || c.is_whitespace())
        .find_map(|part| part.strip_prefix("DNS:"))
        .unwrap_or_else(|| panic!("no DNS name in {}: {san}", cert.display()))
        .to_owned();
    // TCP to the local server, as the admin role (trust on 127.0.0.1).
    let user = admin_conninfo()
        .split_whitespace()
        .find(|kv| kv.starts_with("user="))
        .unwrap_or("user=postgres")
        .to_owned();
    let encrypted = async |conninfo: String| -> Result<bool, String> {
        let client =
            bucketd::fleet::postgres::connect(&conninfo, None, "bucketd tls test".into(), "")
                .await
                .map_err(|e| format!("{e:#}"))?;
        let row = client
            .query_one(
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                &[],
            )
            .await
            .unwrap();
        Ok(row.get(0))
    };
    let at = |host: &str, mode: &str| {
        format!(
            "host={host} hostaddr=127.0.0.1 {user} dbname=postgres sslmode={mode} sslrootcert={}",
            cert.display()
        )
    };
    assert_eq!(encrypted(at("127.0.0.1", "disable")).await, Ok(false));
    assert_eq!(encrypted(at("127.0.0.1", "prefer")).await, Ok(true));
    assert_eq!(
        encrypted(format!(
            "host=127.0.0.1 {user} dbname=postgres sslmode=require"
        ))
        .await,
        Ok(true)
    );
    assert_eq!(encrypted(at("127.0.0.1", "verify-ca")).await, Ok(true));
    assert_eq!(encrypted(at(&name, "verify-full")).await, Ok(true));
    // The certificate is for `name`, not for 127.0.0.1.
    let e = encrypted(at("127.0.0.1", "verify-full")).await.unwrap_err();
    assert!(e.to_lowercase().contains("certificate"), "{e}");
    // A CA that did not sign the server's certificate.
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let rogue = dir.path().join("rogue-ca.pem");
    std::fs::write(&rogue, params.self_signed(&key).unwrap().pem()).unwrap();
    for mode in ["verify-ca", "require"] {
        let conninfo = format!(
            "host={name} hostaddr=127.0.0.1 {user} dbname=postgres sslmode={mode} sslrootcert={}",
            rogue.display()
        );
        let e = encrypted(conninfo).await.unwrap_err();
        assert!(e.to_lowercase().contains("certificate"), "{mode}: {e}");
    }
}

/// Issue 20: with `deploy/postgres/roles.sql`, a gateway's own PostgreSQL role connects (the
/// schema step skipped: it may not create tables), applies its own entries, and can neither
/// write as another gateway nor touch another gateway's rows or `last_seq`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_role_touches_only_its_own_rows() {
    use bucketd::fleet::postgres::{FleetDb, SCHEMA, apply};
    use bucketd::store::OutboxDoc;

    let testdb = TestDb::create().await;
    let admin = connect(&testdb.conninfo()).await;
    admin.batch_execute(SCHEMA).await.unwrap();
    let roles = include_str!("../../../deploy/postgres/roles.sql");
    admin.batch_execute(roles).await.unwrap();
    admin
        .batch_execute(roles)
        .await
        .expect("roles.sql runs twice");
    // Role names are global to the server: unique ones, dropped at the end.
    let a = unique("gw-a").to_lowercase();
    let b = unique("gw-b").to_lowercase();
    for role in [&a, &b] {
        admin
            .batch_execute(&format!(
                "CREATE ROLE \"{role}\" LOGIN IN ROLE \"{}\"",
                testdb.group("gateway")
            ))
            .await
            .unwrap();
    }
    let as_role = |role: &str| testdb.conninfo_as(role);
    let hour = 1_763_719_200;
    let entry = |seq: i64, value: f64| OutboxDoc {
        seq,
        created_ns: 0,
        buckets: vec![BucketDoc::new(
            "boiler/t",
            hour,
            3600,
            &bucketd::summary::Summary::of(hour * 1_000_000_000, value),
        )],
    };
    let origin = "2026-11-22T12:00:00.000Z";
    let mut gw_a = FleetDb::open(&as_role(&a), None, "gw-a".into())
        .await
        .expect("connects without rights to create the schema");
    let mut gw_b = FleetDb::open(&as_role(&b), None, "gw-b".into())
        .await
        .unwrap();
    assert_eq!(
        apply(&mut gw_a, &a, origin, &[entry(0, 1.0)], None)
            .await
            .unwrap()
            .readings,
        1
    );
    assert_eq!(
        apply(&mut gw_b, &b, origin, &[entry(0, 2.0)], None)
            .await
            .unwrap()
            .readings,
        1
    );
    // Writing as the other gateway: refused by the policy, nothing applied.
    let e = apply(&mut gw_a, &b, origin, &[entry(1, 9.0)], None)
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("row-level security"), "{e:#}");
    // Touching the other's rows: invisible, so nothing changes; deleting is not granted.
    let changed = gw_a
        .client()
        .execute("UPDATE bucketd_gateways SET last_seq = 1000000", &[])
        .await
        .unwrap();
    assert_eq!(changed, 1, "its own row only");
    let changed = gw_a
        .client()
        .execute("UPDATE bucketd_buckets SET count = 0", &[])
        .await
        .unwrap();
    assert_eq!(changed, 1, "its own row only");
    assert!(
        gw_a.client()
            .execute("DELETE FROM bucketd_buckets", &[])
            .await
            .is_err()
    );
    assert!(
        gw_a.client()
            .batch_execute("DROP TABLE bucketd_gateways")
            .await
            .is_err()
    );
    // Issue 52: every function the schema defines, as a gateway. Fleet retention drops every
    // gateway's months: refused (it dropped the whole fleet with 'infinity'); making
    // partitions only makes months.
    let functions: Vec<String> = admin
        .query(
            "SELECT p.oid::regprocedure::text FROM pg_proc p \
             WHERE p.proname LIKE 'bucketd\\_%' ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        functions,
        [
            "bucketd_drop_partitions_before(timestamp with time zone)",
            "bucketd_ensure_partitions(timestamp with time zone[])"
        ],
        "a new function needs its case here"
    );
    let dropped = gw_a
        .client()
        .query_one("SELECT bucketd_drop_partitions_before('infinity')", &[])
        .await
        .unwrap_err();
    let why = dropped.as_db_error().map(|e| e.message().to_owned());
    assert!(
        why.as_deref()
            .is_some_and(|m| m.contains("permission denied")),
        "{dropped:?}"
    );
    let made: i32 = gw_a
        .client()
        .query_one(
            "SELECT bucketd_ensure_partitions(ARRAY[to_timestamp(1763719200)])",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(made, 0, "the month is there already");
    let seen: i64 = gw_a
        .client()
        .query_one("SELECT count(*) FROM bucketd_buckets", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(seen, 1, "the other gateway's rows are not visible");
    let (count, last): (i64, i64) = {
        let row = admin
            .query_one(
                "SELECT b.count, g.last_seq FROM bucketd_buckets b JOIN bucketd_gateways g \
                 USING (gateway_id) WHERE gateway_id = $1",
                &[&b],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(
        (count, last),
        (1, 0),
        "gw-b's row and position are as gw-b left them"
    );
    // Issue 52: another fleet's database on the same server. Its groups are its own (roles
    // are global: with one bucketd_gateway group, gw-a was a gateway of every fleet), and only
    // they may connect: gw-a cannot even log in there, let alone write as itself.
    let other = TestDb::create().await;
    let other_admin = connect(&other.conninfo()).await;
    other_admin.batch_execute(SCHEMA).await.unwrap();
    other_admin.batch_execute(roles).await.unwrap();
    let into_other = other.conninfo_as(&a);
    let refused = FleetDb::open(&into_other, None, "gw-a".into())
        .await
        .err()
        .expect("a gateway of one fleet may not connect to another's database");
    assert!(
        format!("{refused:#}").contains("permission denied for database"),
        "{refused:#}"
    );
    // And the groups of one fleet are not the other's.
    assert_ne!(testdb.group("gateway"), other.group("gateway"));
    drop(other_admin);
    other.drop_it().await;
    drop((gw_a, gw_b, admin));
    testdb.drop_it().await;
    let server = connect(&admin_conninfo()).await;
    for role in [&a, &b] {
        server
            .batch_execute(&format!("DROP ROLE \"{role}\""))
            .await
            .unwrap();
    }
}
