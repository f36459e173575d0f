//! PostgreSQL's partitioned fleet table (issue 43), driven through bucketd's own apply
//! (`fleet::postgres`) against the machine's PostgreSQL: a batch across a month boundary, many
//! gateways at once, fleet retention dropping a month while gateways write, and a table of an
//! older release refused and then migrated. Ground truth: the readings themselves.

use std::collections::BTreeMap;
use std::time::{Duration, UNIX_EPOCH};

use bucketd::doc::BucketDoc;
use bucketd::fleet::postgres::{self, FleetDb};
use bucketd::sketch::SketchParams;
use bucketd::store::OutboxDoc;
use bucketd::summary::Summary;

use super::pg::{TestDb, connect};

const HOUR: i64 = 3600;

/// The first second of the month `back` months before the current one (UTC).
fn month_start(back: u32) -> i64 {
    use chrono::Datelike;
    let now = chrono::Utc::now();
    let months = now.year() * 12 + now.month0() as i32 - back as i32;
    chrono::NaiveDate::from_ymd_opt(months.div_euclid(12), months.rem_euclid(12) as u32 + 1, 1)
        .unwrap()
        .and_hms_opt(0, 0, 0)
        .unwrap()
        .and_utc()
        .timestamp()
}

/// A bucket delta of `series` at `start` holding `values` (timestamps one second apart).
fn delta(series: &str, start: i64, values: &[f64]) -> BucketDoc {
    let mut s = Summary::with_params(start * 1_000_000_000, values[0], SketchParams::DEFAULT);
    for (i, &v) in values.iter().enumerate().skip(1) {
        s.push((start + i as i64) * 1_000_000_000, v);
    }
    BucketDoc::new(series, start, HOUR, &s)
}

fn entry(seq: i64, buckets: Vec<BucketDoc>) -> OutboxDoc {
    OutboxDoc {
        seq,
        created_ns: 0,
        buckets,
    }
}

/// Applies one entry of `gateway` holding `buckets`, without retention.
async fn apply_one(db: &mut FleetDb, gateway: &str, seq: i64, buckets: Vec<BucketDoc>) -> u64 {
    postgres::apply(db, gateway, "o", &[entry(seq, buckets)], None)
        .await
        .unwrap()
        .readings
}

async fn open(conninfo: &str, gateway: &str) -> FleetDb {
    FleetDb::open(conninfo, None, format!("bucketd {gateway}"))
        .await
        .unwrap()
}

/// The partition holding `t` (seconds).
fn partition_of(t: i64) -> String {
    let d = chrono::DateTime::from_timestamp(t, 0).unwrap();
    format!("bucketd_buckets_{}", d.format("y%Ym%m"))
}

/// The first column of `sql`'s rows.
async fn column<T: for<'a> tokio_postgres::types::FromSql<'a>>(
    pg: &tokio_postgres::Client,
    sql: &str,
) -> Vec<T> {
    pg.query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Each row's partition, count and p99 column, by (series, start).
async fn rows(pg: &tokio_postgres::Client) -> BTreeMap<(String, i64), (String, i64, Option<f64>)> {
    pg.query(
        "SELECT series, extract(epoch FROM start)::bigint, tableoid::regclass::text, count, p99
         FROM bucketd_buckets",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| ((r.get(0), r.get(1)), (r.get(2), r.get(3), r.get(4))))
    .collect()
}

/// Within the sketch's 1% of the exact type-7 p-quantile of `values` (numpy's definition,
/// computed from the readings).
fn within(got: f64, values: &[f64], p: f64) -> bool {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    crate::support::quantile_close(got, crate::support::type7(&sorted, p))
}

/// One batch whose buckets fall in two months lands in two partitions, made as it needed them;
/// the p99 column is the p99 of everything the row holds (two batches' readings), and the same
/// batch sent again changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_across_a_month_boundary_lands_in_both_months_once() {
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let pg = connect(&conninfo).await;
    let mut db = open(&conninfo, "gw-month").await;
    let boundary = month_start(0);
    let (before, after) = (boundary - HOUR, boundary);
    let first: Vec<f64> = (1..=300).map(f64::from).collect();
    let second: Vec<f64> = (301..=1000).map(f64::from).collect();
    let batch = [
        entry(
            0,
            vec![delta("t/a", before, &first), delta("t/a", after, &first)],
        ),
        entry(1, vec![delta("t/a", before, &second)]),
    ];
    let done = postgres::apply(&mut db, "gw-month", "origin-1", &batch, None)
        .await
        .unwrap();
    assert_eq!(done.readings, 300 + 300 + 700);
    let got = rows(&pg).await;
    let key = |t: i64| ("gw-month:t/a".to_owned(), t);
    assert_eq!(got.len(), 2, "{got:?}");
    let (part, count, p99) = &got[&key(before)];
    assert_eq!(
        (part.as_str(), *count),
        (partition_of(before).as_str(), 1000)
    );
    let all: Vec<f64> = (1..=1000).map(f64::from).collect();
    assert!(within(p99.unwrap(), &all, 0.99), "{p99:?}");
    let (part, count, p99) = &got[&key(after)];
    assert_eq!((part.as_str(), *count), (partition_of(after).as_str(), 300));
    assert!(within(p99.unwrap(), &first, 0.99), "{p99:?}");
    // Sent again (a lost COMMIT answer): applied already, nothing changes.
    let again = postgres::apply(&mut db, "gw-month", "origin-1", &batch, None)
        .await
        .unwrap();
    assert_eq!(again.readings, 0);
    assert_eq!(rows(&pg).await, got);
    drop((db, pg));
    testdb.drop_it().await;
}

/// Sixteen gateways apply batches of 200 series at once into a month none of them has a
/// partition for yet: every reading lands once, and no transaction deadlocks or fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_gateways_at_once_each_reading_once() {
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let start = month_start(1);
    let mut tasks = Vec::new();
    for g in 0..16 {
        let conninfo = conninfo.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("gw-{g}");
            let mut db = open(&conninfo, &id).await;
            let mut total = 0;
            for seq in 0..5 {
                let buckets = (0..200)
                    .map(|s| delta(&format!("s{s}/v"), start + seq * HOUR, &[f64::from(g), 1.0]))
                    .collect();
                total += apply_one(&mut db, &id, seq, buckets).await;
            }
            total
        }));
    }
    let mut sent = 0;
    for t in tasks {
        sent += t.await.unwrap();
    }
    let pg = connect(&conninfo).await;
    let stored: i64 = pg
        .query_one("SELECT sum(count)::bigint FROM bucketd_buckets", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!((sent, stored), (16 * 5 * 200 * 2, 16 * 5 * 200 * 2));
    let per_gateway: Vec<i64> = column(
        &pg,
        "SELECT count(*) FROM bucketd_buckets GROUP BY gateway_id ORDER BY gateway_id",
    )
    .await;
    assert_eq!(per_gateway, vec![1000; 16]);
    drop(pg);
    testdb.drop_it().await;
}

/// Fleet retention drops a whole month partition while two gateways keep writing into the
/// current month: their rows are all there, the old month is gone, and a gateway with the
/// retention set leaves out (and counts) a delta of the dropped month instead of making the
/// partition again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_drops_a_month_while_gateways_write() {
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let (old, now) = (month_start(3), month_start(0));
    let mut seed = open(&conninfo, "gw-r0").await;
    apply_one(&mut seed, "gw-r0", 0, vec![delta("a/v", old, &[1.0])]).await;
    let writers: Vec<_> = (1..=2)
        .map(|g| {
            let conninfo = conninfo.clone();
            tokio::spawn(async move {
                let id = format!("gw-r{g}");
                let mut db = open(&conninfo, &id).await;
                let mut total = 0;
                for seq in 0..40 {
                    let buckets = (0..50)
                        .map(|s| delta(&format!("s{s}/v"), now, &[1.0, 2.0]))
                        .collect();
                    total += apply_one(&mut db, &id, seq, buckets).await;
                }
                total
            })
        })
        .collect();
    // 31 days: the month three back ended at least 59 days ago, the current one is running.
    let retention = Duration::from_hours(31 * 24);
    let dropped = seed.drop_partitions_older_than(retention).await.unwrap();
    let mut sent = 0;
    for w in writers {
        sent += w.await.unwrap();
    }
    assert_eq!(dropped, 1);
    let pg = connect(&conninfo).await;
    let months: Vec<String> = column(
        &pg,
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'bucketd_buckets'::regclass ORDER BY 1",
    )
    .await;
    assert_eq!(months, vec![partition_of(now)]);
    let stored: i64 = pg
        .query_one("SELECT sum(count)::bigint FROM bucketd_buckets", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!((sent, stored), (2 * 40 * 50 * 2, 2 * 40 * 50 * 2));
    // A late delta of the dropped month, from a gateway with the retention set: left out.
    let late = [entry(
        1,
        vec![delta("a/v", old, &[5.0, 6.0]), delta("a/v", now, &[7.0])],
    )];
    let done = postgres::apply(&mut seed, "gw-r0", "o", &late, Some(retention))
        .await
        .unwrap();
    assert_eq!((done.readings, done.expired), (1, 2));
    let old_rows: i64 = pg
        .query_one(
            "SELECT count(*) FROM bucketd_buckets WHERE start < $1",
            &[&(UNIX_EPOCH + Duration::from_secs(now as u64))],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(old_rows, 0, "the dropped month came back");
    drop((seed, pg));
    testdb.drop_it().await;
}

/// The table as releases before partitions made it.
const UNPARTITIONED: &str = "
CREATE TABLE bucketd_buckets (
    series text NOT NULL, start timestamptz NOT NULL, gateway_id text NOT NULL,
    sensor text NOT NULL, metric text NOT NULL, width_secs integer NOT NULL,
    count bigint NOT NULL, sum double precision NOT NULL, sum_comp double precision NOT NULL,
    min double precision NOT NULL, max double precision NOT NULL, first_ts_ns bigint NOT NULL,
    first_value double precision NOT NULL, last_ts_ns bigint NOT NULL,
    last_value double precision NOT NULL, mean double precision NOT NULL,
    m2 double precision NOT NULL, sketch bytea NOT NULL, PRIMARY KEY (series, start));
CREATE TABLE bucketd_gateways (gateway_id text PRIMARY KEY, last_seq bigint NOT NULL,
    origin text NOT NULL DEFAULT '', updated_at timestamptz NOT NULL DEFAULT now());";

/// A table an older release made is refused with the command that migrates it, not changed;
/// deploy/postgres/migrate-partitioned.sql moves its rows, and gateways then add to them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpartitioned_table_is_refused_and_the_migration_keeps_its_rows() {
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let pg = connect(&conninfo).await;
    pg.batch_execute(UNPARTITIONED).await.unwrap();
    let start = month_start(1);
    pg.execute(
        "INSERT INTO bucketd_buckets VALUES ('gw-old:t/a', $1, 'gw-old', 't', 'a', 3600, 2, 3.0,
             0.0, 1.0, 2.0, 0, 1.0, 1, 2.0, 1.5, 0.5, '\\x00')",
        &[&(UNIX_EPOCH + Duration::from_secs(start as u64))],
    )
    .await
    .unwrap();
    let refused = FleetDb::open(&conninfo, None, "bucketd gw-old".into())
        .await
        .err()
        .expect("an unpartitioned table is refused");
    let message = format!("{refused:#}");
    assert!(
        message.contains("not partitioned") && message.contains("migrate-partitioned.sql"),
        "{message}"
    );
    let migrate = include_str!("../../../deploy/postgres/migrate-partitioned.sql")
        .replace("\\ir schema.sql", postgres::SCHEMA);
    pg.batch_execute(&migrate).await.unwrap();
    let mut db = open(&conninfo, "gw-old").await;
    apply_one(&mut db, "gw-old", 0, vec![delta("t/a", start, &[4.0])]).await;
    let got = rows(&pg).await;
    let (_, count, _) = &got[&("gw-old:t/a".to_owned(), start)];
    assert_eq!(*count, 3, "the migrated row and the new delta");
    drop((db, pg));
    testdb.drop_it().await;
}

/// Issue 57: a table keyed `(series, start)` by a release before the gateway led the key keeps
/// working (gateways merge into it, a query node lists its series), and
/// `deploy/postgres/migrate-gateway-key.sql` re-keys it with every row kept, after which the
/// same deltas merge into the same rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_keyed_by_series_keeps_working_and_is_re_keyed() {
    let testdb = TestDb::create().await;
    let conninfo = testdb.conninfo();
    let pg = connect(&conninfo).await;
    let old = postgres::SCHEMA.replace(
        "PRIMARY KEY (gateway_id, series, start)",
        "PRIMARY KEY (series, start)",
    );
    assert_ne!(old, postgres::SCHEMA, "the schema names its key");
    pg.batch_execute(&old).await.unwrap();
    assert_eq!(postgres::Key::of(&pg).await.unwrap(), postgres::Key::Series);
    let start = month_start(0);
    let mut seq = 0;
    for gateway in ["gw-a", "gw-b"] {
        let mut db = open(&conninfo, gateway).await;
        for values in [[1.0, 2.0], [3.0, 4.0]] {
            let buckets = vec![delta("t/a", start, &values), delta("t/b", start, &values)];
            apply_one(&mut db, gateway, seq, buckets).await;
            seq += 1;
        }
    }
    let counts = |rows: BTreeMap<(String, i64), (String, i64, Option<f64>)>| -> Vec<(String, i64)> {
        rows.into_iter().map(|((s, _), (_, c, _))| (s, c)).collect()
    };
    let want: Vec<(String, i64)> = ["gw-a:t/a", "gw-a:t/b", "gw-b:t/a", "gw-b:t/b"]
        .into_iter()
        .map(|s| (s.to_owned(), 4))
        .collect();
    assert_eq!(counts(rows(&pg).await), want);
    // A query node lists the series over the old key.
    let mut raw = bucketd::config::RawConfig::load(None, Vec::new()).unwrap();
    raw.query_node.postgres = conninfo.clone();
    raw.http.bind = "127.0.0.1:0".into();
    let node = bucketd::daemon::start_query_node(&bucketd::config::Config::try_from(raw).unwrap())
        .unwrap();
    let (status, body) =
        crate::support::http("GET", format!("http://{}/api/v1/series", node.http_addr)).await;
    assert_eq!(status, 200, "{body}");
    for name in ["gw-a:t/a", "gw-b:t/b", "*:t/a"] {
        assert!(body.contains(&format!("\"{name}\"")), "{name}: {body}");
    }
    node.stop().await;
    // Re-keyed: every row kept, and a delta merges into its row as before.
    pg.batch_execute(include_str!(
        "../../../deploy/postgres/migrate-gateway-key.sql"
    ))
    .await
    .unwrap();
    assert_eq!(
        postgres::Key::of(&pg).await.unwrap(),
        postgres::Key::Gateway
    );
    assert_eq!(counts(rows(&pg).await), want);
    let mut db = open(&conninfo, "gw-a").await;
    apply_one(&mut db, "gw-a", seq, vec![delta("t/a", start, &[5.0])]).await;
    let got = rows(&pg).await;
    assert_eq!(got[&("gw-a:t/a".to_owned(), start)].1, 5);
    assert_eq!(got.len(), 4, "merged into its row, not a new one");
    // Running the migration again changes nothing.
    pg.batch_execute(include_str!(
        "../../../deploy/postgres/migrate-gateway-key.sql"
    ))
    .await
    .unwrap();
    drop((db, pg));
    testdb.drop_it().await;
}

/// Issue 57: a batch goes through `bucketd_staging` (a binary COPY, then one INSERT ... SELECT)
/// where the gateway's role may stage, and as multi-row `VALUES` where it may not (the
/// `roles.sql` of an earlier release): both write the same rows. Two gateways, one each way,
/// apply the same deltas (a bucket written twice, so that the second merges); their rows must
/// hold the same numbers, and the staging table nothing afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_and_values_batches_write_the_same_rows() {
    let testdb = TestDb::create().await;
    let pg = connect(&testdb.conninfo()).await;
    pg.batch_execute(postgres::SCHEMA).await.unwrap();
    pg.batch_execute(include_str!("../../../deploy/postgres/roles.sql"))
        .await
        .unwrap();
    let group = testdb.group("gateway");
    let (staged, plain) = (
        crate::support::unique("st-a").to_lowercase(),
        crate::support::unique("st-b").to_lowercase(),
    );
    for role in [&staged, &plain] {
        pg.batch_execute(&format!("CREATE ROLE \"{role}\" LOGIN IN ROLE \"{group}\""))
            .await
            .unwrap();
    }
    // The second role may not stage, as before roles.sql granted it.
    pg.batch_execute(&format!(
        "REVOKE ALL ON bucketd_staging FROM \"{plain}\", \"{group}\""
    ))
    .await
    .unwrap();
    pg.batch_execute(&format!(
        "GRANT SELECT, INSERT, DELETE ON bucketd_staging TO \"{staged}\""
    ))
    .await
    .unwrap();
    let start = month_start(0);
    for role in [&staged, &plain] {
        let mut db = open(&testdb.conninfo_as(role), role).await;
        for (seq, values) in [[1.5, 9.0, -2.0], [4.0, 4.5, 100.25]].iter().enumerate() {
            let buckets = vec![
                delta("t/a", start, values),
                delta("t/b", start + HOUR, &values[..2]),
            ];
            apply_one(&mut db, role, seq as i64, buckets).await;
        }
    }
    // series, count, sum, min, max, mean, p99.
    type Numbers = Vec<(String, i64, f64, f64, f64, f64, Option<f64>)>;
    let numbers = async |role: &str| -> Numbers {
        pg.query(
            "SELECT split_part(series, ':', 2), count, sum + sum_comp, min, max, mean, p99
             FROM bucketd_buckets WHERE gateway_id = $1 ORDER BY series",
            &[&role],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            (
                r.get(0),
                r.get(1),
                r.get(2),
                r.get(3),
                r.get(4),
                r.get(5),
                r.get(6),
            )
        })
        .collect()
    };
    let (a, b) = (numbers(&staged).await, numbers(&plain).await);
    assert_eq!(a.len(), 2, "{a:?}");
    assert_eq!(a[0].1, 6, "t/a: both deltas merged: {a:?}");
    assert_eq!(a, b, "staged and VALUES batches write the same rows");
    let left: i64 = pg
        .query_one("SELECT count(*) FROM bucketd_staging", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "nothing stays staged");
    drop(pg);
    testdb.drop_it().await;
    let admin = connect(&super::pg::admin_conninfo()).await;
    admin
        .batch_execute(&format!("DROP ROLE IF EXISTS \"{staged}\", \"{plain}\""))
        .await
        .unwrap();
}
