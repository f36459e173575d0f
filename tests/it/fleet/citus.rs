//! The fleet on a Citus cluster (issue 57): a coordinator and two workers this test starts
//! from an installed Citus (`shared_preload_libraries = 'citus'` on the local PostgreSQL's
//! binaries, `pg_config`'s), the tables distributed as docs/FLEET.md ("Citus") says. Skipped,
//! with a note, where Citus is not installed (CI does not build it: README, "Tests").
//!
//! Checked against the readings: three gateways forward exactly once through a `kill -9`; a
//! query node reads every series and answers buckets, fleet-wide quantiles and the Prometheus
//! API as the readings say; a gateway's least-rights role reaches no other gateway's rows on
//! any shard; and each gateway's batch is routed to the one worker holding its shard.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::pg::connect;
use super::*;

/// A Citus cluster on this machine: node 0 the coordinator, the others workers; stopped and
/// removed when dropped.
pub struct Cluster {
    dir: tempfile::TempDir,
    bindir: PathBuf,
    pub ports: Vec<u16>,
    /// PostgreSQL refuses to run as root: the nodes run as `postgres` then.
    run_as: Option<String>,
}

/// The database every node holds (Citus keeps its node list per database).
pub const DB: &str = "fleet";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn pg_config(arg: &str) -> Option<PathBuf> {
    let out = Command::new("pg_config").arg(arg).output().ok()?;
    out.status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

impl Cluster {
    /// Starts a coordinator and `workers` workers, with database [`DB`] and the citus
    /// extension in each and the workers added; `None`, saying why, when Citus is not
    /// installed.
    pub async fn start(workers: usize) -> Option<Cluster> {
        let (Some(bindir), Some(libdir)) = (pg_config("--bindir"), pg_config("--pkglibdir")) else {
            eprintln!("Citus test not run: pg_config not found (README, \"Tests\")");
            return None;
        };
        if !libdir.join("citus.so").exists() {
            eprintln!(
                "Citus test not run: {} is not installed (README, \"Tests\", says how to build it)",
                libdir.join("citus.so").display()
            );
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("bucketd-citus")
            .tempdir()
            .unwrap();
        // SAFETY: geteuid has no preconditions.
        let run_as = (unsafe { libc::geteuid() } == 0).then(|| "postgres".to_owned());
        if let Some(user) = &run_as {
            let id = |flag: &str| -> u32 {
                let out = Command::new("id").args([flag, user]).output().unwrap();
                String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
            };
            std::os::unix::fs::chown(dir.path(), Some(id("-u")), Some(id("-g"))).unwrap();
        }
        let mut cluster = Cluster {
            dir,
            bindir,
            ports: Vec::new(),
            run_as,
        };
        for node in 0..=workers {
            let port = free_port();
            cluster.init(node, port);
            cluster.ports.push(port);
        }
        for port in &cluster.ports {
            let admin = connect(&conninfo(*port, "postgres", "postgres")).await;
            admin
                .batch_execute(&format!("CREATE DATABASE {DB}"))
                .await
                .unwrap();
            let db = connect(&conninfo(*port, DB, "postgres")).await;
            db.batch_execute("CREATE EXTENSION citus").await.unwrap();
        }
        let coordinator = cluster.admin().await;
        coordinator
            .execute(
                "SELECT citus_set_coordinator_host('127.0.0.1', $1)",
                &[&i32::from(cluster.ports[0])],
            )
            .await
            .unwrap();
        for port in &cluster.ports[1..] {
            coordinator
                .execute(
                    "SELECT citus_add_node('127.0.0.1', $1)",
                    &[&i32::from(*port)],
                )
                .await
                .unwrap();
        }
        Some(cluster)
    }

    fn command(&self, program: &str) -> Command {
        let path = self.bindir.join(program);
        match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(path);
                c
            }
            None => Command::new(path),
        }
    }

    fn data(&self, node: usize) -> PathBuf {
        self.dir.path().join(format!("node{node}"))
    }

    /// initdb and start node `node` on `port`.
    fn init(&self, node: usize, port: u16) {
        let data = self.data(node);
        let ok = self
            .command("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .output()
            .unwrap();
        assert!(ok.status.success(), "initdb: {ok:?}");
        let conf = format!(
            "port = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             shared_preload_libraries = 'citus'\nmax_prepared_transactions = 100\n\
             fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n\
             citus.log_remote_commands = off\n",
            self.dir.path().display()
        );
        let file = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&file).unwrap();
        text.push_str(&conf);
        std::fs::write(&file, text).unwrap();
        let log = self.dir.path().join(format!("node{node}.log"));
        let ok = self
            .command("pg_ctl")
            .args(["-w", "-D"])
            .arg(&data)
            .arg("-l")
            .arg(&log)
            .arg("start")
            .output()
            .unwrap();
        assert!(
            ok.status.success(),
            "pg_ctl start: {ok:?}\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// libpq key=value for [`DB`] on the coordinator, as `user`.
    pub fn conninfo(&self, user: &str) -> String {
        conninfo(self.ports[0], DB, user)
    }

    /// The coordinator's [`DB`] as the superuser.
    pub async fn admin(&self) -> tokio_postgres::Client {
        connect(&self.conninfo("postgres")).await
    }

    /// The coordinator's log so far (what a failed statement said).
    pub fn coordinator_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("node0.log")).unwrap_or_default()
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.coordinator_log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("the coordinator's log, last lines:");
            for line in tail.into_iter().rev() {
                eprintln!("  {line}");
            }
        }
        for node in 0..self.ports.len() {
            let _ = self
                .command("pg_ctl")
                .args(["-m", "immediate", "-D"])
                .arg(self.data(node))
                .arg("stop")
                .output();
        }
    }
}

fn conninfo(port: u16, db: &str, user: &str) -> String {
    format!("host=127.0.0.1 port={port} user={user} dbname={db}")
}

/// The fleet's tables on `cluster` as docs/FLEET.md ("Citus") sets them up: schema.sql,
/// citus.sql and roles.sql on the coordinator; then a login role for each of `gateways` in the
/// gateway group and `reader` in the reader group (Citus makes each on every worker too).
async fn fleet_tables(cluster: &Cluster, gateways: &[&str], reader: &str) {
    let admin = cluster.admin().await;
    for (file, sql) in [
        ("schema.sql", bucketd::fleet::postgres::SCHEMA),
        (
            "citus.sql",
            include_str!("../../../deploy/postgres/citus.sql"),
        ),
        (
            "roles.sql",
            include_str!("../../../deploy/postgres/roles.sql"),
        ),
    ] {
        admin.batch_execute(sql).await.unwrap_or_else(|e| {
            panic!(
                "{file}: {}\n{}",
                bucketd::fleet::postgres::describe(&e),
                cluster.coordinator_log()
            )
        });
    }
    for g in gateways {
        admin
            .batch_execute(&format!("CREATE ROLE \"{g}\" LOGIN IN ROLE {DB}_gateway"))
            .await
            .unwrap();
    }
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{reader}\" LOGIN IN ROLE {DB}_reader"
        ))
        .await
        .unwrap();
}

/// Three gateways forward to Citus through their least-rights roles, one killed with
/// `kill -9` while forwarding and restarted: every reading lands exactly once, each bucket as
/// the readings say; a gateway's upsert is routed to one shard; and a gateway's role reaches
/// no other gateway's rows, through the coordinator or on any worker's shards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_forward_to_citus_exactly_once_through_a_kill_9() {
    let Some(cluster) = Cluster::start(2).await else {
        return;
    };
    let ids = ["cz-a", "cz-b", "cz-c"];
    fleet_tables(&cluster, &ids, "cz-reader").await;
    let pg = cluster.admin().await;
    let broker = Broker::hermetic();
    let gateways = [
        gateway(&broker, ids[0], 0xC17A, 3000, &cluster.conninfo(ids[0])),
        gateway(&broker, ids[1], 0xC17B, 1500, &cluster.conninfo(ids[1])),
        gateway(&broker, ids[2], 0xC17C, 800, &cluster.conninfo(ids[2])),
    ];
    let mut daemons = start_subscribed(&gateways);
    for g in &gateways {
        publish_all(&broker, &g.work.messages, 1).await;
    }
    // cz-a killed once some of its readings are in and before all are.
    let a = &gateways[0];
    until_forwarded(&pg, &a.id, 1).await;
    let (status, _) = daemons[0].take().unwrap().kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    let forwarded = pg_count(&pg, &a.id).await;
    daemons[0] = Some(restart(&a.config).0);
    all_forwarded_then_stopped(&pg, &gateways, &mut daemons).await;
    for g in &gateways {
        let rows = rows_of(&pg, &g.id).await;
        assert_eq!(
            rows.iter().map(|d| d.count).sum::<i64>(),
            g.work.readings.len() as i64,
            "{}: readings in Citus (cz-a had {forwarded} of {} when killed)",
            g.id,
            a.work.readings.len()
        );
        assert_matches_truth(&rows, &truth(&g.work.readings, 3600));
    }
    routed_to_one_shard(&cluster).await;
    no_reach_into_other_gateways(&cluster, "cz-b", "cz-a").await;
}

/// EXPLAIN of a gateway's upsert (two rows) on the coordinator: one task on one worker, not
/// the "pull to coordinator" an `INSERT ... SELECT FROM unnest` gets.
async fn routed_to_one_shard(cluster: &Cluster) {
    use tokio_postgres::types::ToSql;
    let admin = cluster.admin().await;
    let start = UNIX_EPOCH + Duration::from_hours(490_000);
    let (gateway, sensor, metric) = ("cz-a", "s", "m");
    let names = ["cz-a:s/m", "cz-a:s/n"];
    let (width, count, ns, x) = (3600_i32, 1_i64, 0_i64, 1.0_f64);
    let sketch: Vec<u8> = vec![1];
    let q: Option<f64> = Some(1.0);
    let mut params: Vec<&(dyn ToSql + Sync)> = vec![&gateway];
    for name in &names {
        params.extend([
            name as &(dyn ToSql + Sync),
            &start,
            &sensor,
            &metric,
            &width,
            &count,
            &x,
            &x,
            &x,
            &x,
            &ns,
            &x,
            &ns,
            &x,
            &x,
            &x,
            &sketch,
            &q,
            &q,
            &q,
        ]);
    }
    let statement = bucketd::fleet::postgres::upsert_statement(names.len());
    let plan = plan_of(&admin, &statement, &params).await;
    assert!(
        plan.contains("Task Count: 1") && !plan.contains("pull to coordinator"),
        "a gateway's upsert is routed to one shard:\n{plan}"
    );
    // The way a batch goes where the role may stage (roles.sql): staged rows moved in by one
    // INSERT ... SELECT that runs on the gateway's shard.
    let statement = bucketd::fleet::postgres::move_in_statement();
    let plan = plan_of(&admin, &statement, &[&gateway, &1_i64]).await;
    assert!(
        plan.contains("Task Count: 1")
            && !plan.contains("pull to coordinator")
            && !plan.contains("repartition"),
        "a gateway's staged rows are moved in on its shard:\n{plan}"
    );
}

/// The plan Citus makes for `statement` with `params`, as `EXPLAIN (COSTS OFF)` prints it.
async fn plan_of(
    admin: &tokio_postgres::Client,
    statement: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> String {
    let lines: Vec<String> = admin
        .query(&format!("EXPLAIN (COSTS OFF) {statement}"), params)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    lines.join("\n")
}

/// As `role` (a gateway), through the coordinator and on every worker's shards of the fleet's
/// tables: none of `other`'s rows is seen, changed, or made.
async fn no_reach_into_other_gateways(cluster: &Cluster, role: &str, other: &str) {
    let admin = cluster.admin().await;
    let theirs = pg_count(&admin, other).await;
    assert!(theirs > 0, "{other} has rows to reach for");
    let mine = connect(&cluster.conninfo(role)).await;
    assert_eq!(
        pg_count(&mine, other).await,
        0,
        "{role} sees {other}'s rows"
    );
    let changed = mine
        .execute(
            "UPDATE bucketd_buckets SET count = 0 WHERE gateway_id = $1",
            &[&other],
        )
        .await
        .unwrap();
    assert_eq!(changed, 0, "{role} changed {other}'s rows");
    let forged = mine
        .batch_execute(&format!(
            "INSERT INTO bucketd_buckets (series, start, gateway_id, sensor, metric, width_secs,
                 count, sum, sum_comp, min, max, first_ts_ns, first_value, last_ts_ns, last_value,
                 mean, m2, sketch)
             VALUES ('{other}:x/y', now(), '{other}', 'x', 'y', 3600, 1, 1, 0, 1, 1, 0, 1, 0, 1,
                 1, 0, '\\x01')"
        ))
        .await;
    assert!(forged.is_err(), "{role} wrote a row as {other}");
    // Every shard of both tables, on the worker holding it, queried directly.
    let shards = admin
        .query(
            "SELECT shard_name::text, nodeport FROM citus_shards
             WHERE table_name::text ~ '^bucketd_(buckets|gateways)'",
            &[],
        )
        .await
        .unwrap();
    assert!(
        // citus.sql: a shard a worker (two), of each table and month partition (at least one).
        shards.len() >= 2 * 3,
        "shards of both tables: {}",
        shards.len()
    );
    for shard in &shards {
        let (name, port): (String, i32) = (shard.get(0), shard.get(1));
        let on_worker = connect(&format!(
            "host=127.0.0.1 port={port} user={role} dbname={DB}"
        ))
        .await;
        let seen = on_worker
            .query_one(
                &format!("SELECT count(*) FROM {name} WHERE gateway_id = $1"),
                &[&other],
            )
            .await;
        if let Ok(row) = seen {
            assert_eq!(
                row.get::<_, i64>(0),
                0,
                "{role} sees {other}'s rows in {name}"
            );
        }
        let changed = on_worker
            .execute(
                &format!("UPDATE {name} SET gateway_id = gateway_id WHERE gateway_id = $1"),
                &[&other],
            )
            .await;
        assert!(
            matches!(changed, Ok(0) | Err(_)),
            "{role} changed {other}'s rows in {name}: {changed:?}"
        );
    }
}

/// Query nodes on Citus, reading as a member of the reader group: every series listed (a skip
/// scan per gateway, which Citus runs on the gateway's shard), each gateway's buckets and the
/// fleet-wide ones (sketches merged) as the readings say, the Prometheus API with the gateway
/// as a label, a new gateway's series listed without a query waiting: what the single-server
/// test checks (`super::query_node`), on the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_nodes_answer_on_citus_as_the_readings_say() {
    let Some(cluster) = Cluster::start(2).await else {
        return;
    };
    fleet_tables(&cluster, &[], "cz-reader").await;
    super::query_node::answers_as_the_readings_say(
        &cluster.conninfo("postgres"),
        &cluster.conninfo("cz-reader"),
    )
    .await;
}

/// The layout earlier docs gave for Citus (keyed `(series, start)`, distributed by `series`,
/// `bucketd_gateways` a reference table): gateways still apply to it and a query node lists
/// its series (Citus refuses the skip scan there: the node scans, and says so); then the
/// migration docs/FLEET.md gives (undistribute, re-key, `citus.sql`) keeps every row, and the
/// same deltas merge into the same rows after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layout_distributed_by_series_is_read_and_migrated() {
    use bucketd::fleet::postgres::{self, FleetDb};
    let Some(cluster) = Cluster::start(2).await else {
        return;
    };
    let admin = cluster.admin().await;
    let old = postgres::SCHEMA.replace(
        "PRIMARY KEY (gateway_id, series, start)",
        "PRIMARY KEY (series, start)",
    );
    admin.batch_execute(&old).await.unwrap();
    admin
        .batch_execute(
            "SELECT create_distributed_table('bucketd_buckets', 'series');
             SELECT create_reference_table('bucketd_gateways');",
        )
        .await
        .unwrap();
    let hour = (std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        / 3600
        - 2)
        * 3600;
    let apply = async |gateway: &str, seq: i64, value: f64| {
        let mut db = FleetDb::open(
            &cluster.conninfo("postgres"),
            None,
            format!("bucketd {gateway}"),
        )
        .await
        .unwrap();
        let docs = ["s/a", "s/b"].map(|series| {
            let summary = bucketd::summary::Summary::of(hour * 1_000_000_000, value);
            BucketDoc::new(series, hour, 3600, &summary)
        });
        let entry = bucketd::store::OutboxDoc {
            seq,
            created_ns: 0,
            buckets: docs.to_vec(),
        };
        postgres::apply(&mut db, gateway, "origin", &[entry], None)
            .await
            .unwrap();
    };
    apply("cz-a", 0, 1.0).await;
    apply("cz-b", 0, 2.0).await;
    let counts = async || -> Vec<(String, i64)> {
        admin
            .query(
                "SELECT series, count FROM bucketd_buckets ORDER BY series",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    };
    let listed = async || -> String {
        let mut raw = bucketd::config::RawConfig::load(None, Vec::new()).unwrap();
        raw.query_node.postgres = cluster.conninfo("postgres");
        raw.http.bind = "127.0.0.1:0".into();
        let node =
            bucketd::daemon::start_query_node(&bucketd::config::Config::try_from(raw).unwrap())
                .unwrap();
        let (status, body) =
            crate::support::http("GET", format!("http://{}/api/v1/series", node.http_addr)).await;
        node.stop().await;
        assert_eq!(status, 200, "{body}");
        body
    };
    // The skip scan over the whole key is what Citus refuses here (issue 57: every query of a
    // node failed on it): the node's list below comes from its scan instead.
    let refused = admin
        .query(
            "WITH RECURSIVE s(series) AS (
                 (SELECT series FROM bucketd_buckets ORDER BY series LIMIT 1)
                 UNION ALL
                 SELECT (SELECT b.series FROM bucketd_buckets b WHERE b.series > s.series
                         ORDER BY b.series LIMIT 1)
                 FROM s WHERE s.series IS NOT NULL)
             SELECT series FROM s WHERE series IS NOT NULL",
            &[],
        )
        .await
        .expect_err("Citus refuses a recursive query without the distribution column");
    assert_eq!(
        refused.code(),
        Some(&tokio_postgres::error::SqlState::FEATURE_NOT_SUPPORTED),
        "{}",
        postgres::describe(&refused)
    );
    let names = ["cz-a:s/a", "cz-a:s/b", "cz-b:s/a", "cz-b:s/b", "*:s/a"];
    let body = listed().await;
    for name in names {
        assert!(body.contains(&format!("\"{name}\"")), "{name}: {body}");
    }
    let before = counts().await;
    assert_eq!(before.len(), 4);
    // The migration, as docs/FLEET.md gives it.
    admin
        .batch_execute(
            "SELECT undistribute_table('bucketd_buckets');
             SELECT undistribute_table('bucketd_gateways');",
        )
        .await
        .unwrap();
    admin
        .batch_execute(include_str!(
            "../../../deploy/postgres/migrate-gateway-key.sql"
        ))
        .await
        .unwrap();
    admin
        .batch_execute(include_str!("../../../deploy/postgres/citus.sql"))
        .await
        .unwrap();
    assert_eq!(
        postgres::Key::of(&admin).await.unwrap(),
        postgres::Key::Gateway
    );
    assert_eq!(counts().await, before, "every row kept");
    // A release that adds an index: the schema step of the next connection (as the tables'
    // owner) makes it on the distributed table, then redefines its functions, in one
    // transaction; Citus refused that mix unless told to use one connection per node.
    admin
        .batch_execute("DROP INDEX bucketd_staging_batch")
        .await
        .unwrap();
    apply("cz-a", 1, 3.0).await;
    let index = admin
        .query_one("SELECT to_regclass('bucketd_staging_batch')::text", &[])
        .await
        .unwrap()
        .get::<_, Option<String>>(0);
    assert_eq!(index.as_deref(), Some("bucketd_staging_batch"));
    let after = counts().await;
    assert_eq!(after.len(), 4, "merged into the rows, not new ones");
    assert_eq!(after[0], ("cz-a:s/a".to_owned(), 2));
    let body = listed().await;
    for name in names {
        assert!(body.contains(&format!("\"{name}\"")), "{name}: {body}");
    }
}
