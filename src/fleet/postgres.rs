//! PostgreSQL for the fleet tier: connecting (schema applied once, under an advisory lock,
//! unless the role may not: `deploy/postgres/roles.sql`),
//! and applying a gateway's outbox entries exactly once ([`apply`]). Used by the forwarder and
//! by the query node's reader ([`super::reader`]).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, UNIX_EPOCH};

use tokio_postgres::types::ToSql;
use tracing::warn;

use crate::doc::BucketDoc;
use crate::secret::Secret;
use crate::sketch::Sketch;
use crate::store::OutboxDoc;
use crate::summary::Summary;

/// The schema, run (idempotently) at every connection.
pub const SCHEMA: &str = include_str!("../../deploy/postgres/schema.sql");

/// Key of the advisory lock that serialises schema creation between gateways.
const SCHEMA_LOCK: i64 = 0x0062_7563_6b65_7464; // "bucketd" in ASCII

/// The columns a bucket row is written with, `gateway_id` third, each with its type: the upsert
/// names them and casts each parameter ([`upsert_text`]).
const COLUMNS: [(&str, &str); 23] = [
    ("series", "text"),
    ("start", "timestamptz"),
    ("gateway_id", "text"),
    ("sensor", "text"),
    ("metric", "text"),
    ("width_secs", "int4"),
    ("count", "int8"),
    ("sum", "float8"),
    ("sum_comp", "float8"),
    ("min", "float8"),
    ("max", "float8"),
    ("first_ts_ns", "int8"),
    ("first_value", "float8"),
    ("last_ts_ns", "int8"),
    ("last_value", "float8"),
    ("mean", "float8"),
    ("m2", "float8"),
    ("sketch", "bytea"),
    ("p50", "float8"),
    ("p90", "float8"),
    ("p99", "float8"),
    ("inc", "float8"),
    ("inc_count", "int8"),
];

/// How a conflicting row takes a delta: counts and sums added, extremes and first/last
/// compared, mean and M2 combined (Chan), the sketch and quantiles as the forwarder merged them,
/// the counter increase joined where one's readings follow the other's in time (else NULL:
/// unknown, as `Summary::merge`), its count added while the row's was whole.
const ADD_DELTA: &str = "
    count = t.count + excluded.count,
    sum = t.sum + excluded.sum,
    sum_comp = t.sum_comp + excluded.sum_comp,
    min = LEAST(t.min, excluded.min),
    max = GREATEST(t.max, excluded.max),
    first_ts_ns = CASE WHEN (excluded.first_ts_ns, excluded.first_value) < (t.first_ts_ns, t.first_value)
        THEN excluded.first_ts_ns ELSE t.first_ts_ns END,
    first_value = CASE WHEN (excluded.first_ts_ns, excluded.first_value) < (t.first_ts_ns, t.first_value)
        THEN excluded.first_value ELSE t.first_value END,
    last_ts_ns = CASE WHEN (excluded.last_ts_ns, excluded.last_value) > (t.last_ts_ns, t.last_value)
        THEN excluded.last_ts_ns ELSE t.last_ts_ns END,
    last_value = CASE WHEN (excluded.last_ts_ns, excluded.last_value) > (t.last_ts_ns, t.last_value)
        THEN excluded.last_value ELSE t.last_value END,
    mean = t.mean * (t.count::float8 / (t.count + excluded.count))
        + excluded.mean * (excluded.count::float8 / (t.count + excluded.count)),
    m2 = t.m2 + excluded.m2 + (excluded.mean - t.mean) * (excluded.mean - t.mean)
        * (t.count::float8 / (t.count + excluded.count)) * excluded.count,
    sketch = excluded.sketch,
    p50 = excluded.p50,
    p90 = excluded.p90,
    p99 = excluded.p99,
    inc = CASE
        WHEN (excluded.first_ts_ns, excluded.first_value) >= (t.last_ts_ns, t.last_value)
        THEN t.inc + excluded.inc + CASE WHEN excluded.first_value < t.last_value
            THEN excluded.first_value ELSE excluded.first_value - t.last_value END
        WHEN (t.first_ts_ns, t.first_value) >= (excluded.last_ts_ns, excluded.last_value)
        THEN t.inc + excluded.inc + CASE WHEN t.first_value < excluded.last_value
            THEN t.first_value ELSE t.first_value - excluded.last_value END
        END,
    inc_count = CASE WHEN t.inc_count = t.count THEN t.inc_count + excluded.inc_count END";

/// A batch's rows into the staging table (`schema.sql`), binary: the batch's token, then
/// [`COLUMNS`] in order.
fn copy_text() -> String {
    let names: Vec<&str> = COLUMNS.iter().map(|c| c.0).collect();
    format!(
        "COPY bucketd_staging (batch, {}) FROM STDIN (FORMAT binary)",
        names.join(", ")
    )
}

/// The types of the batch's token and [`COLUMNS`], for the binary copy.
const COLUMN_TYPES: [tokio_postgres::types::Type; COLUMNS.len() + 1] = {
    use tokio_postgres::types::Type;
    [
        Type::INT8,
        Type::TEXT,
        Type::TIMESTAMPTZ,
        Type::TEXT,
        Type::TEXT,
        Type::TEXT,
        Type::INT4,
        Type::INT8,
        Type::FLOAT8,
        Type::FLOAT8,
        Type::FLOAT8,
        Type::FLOAT8,
        Type::INT8,
        Type::FLOAT8,
        Type::INT8,
        Type::FLOAT8,
        Type::FLOAT8,
        Type::FLOAT8,
        Type::BYTEA,
        Type::FLOAT8,
        Type::FLOAT8,
        Type::FLOAT8,
        Type::FLOAT8,
        Type::INT8,
    ]
};

/// The gateway's (`$1`) rows staged by this batch (its token, `$2`) into the table: one
/// `INSERT ... SELECT` that Citus runs on the gateway's shard (the two tables are co-located),
/// each conflict adding the delta.
///
/// The token is a random number of the batch's own: PostgreSQL refuses `COPY FROM` into a
/// table with row-level security, so a gateway's role may stage rows under another's id; rows
/// without the token of the batch that moves them are never moved. (Another batch's rows are
/// invisible until it commits, and it deletes them before it does.)
fn move_in_text(key: Key) -> String {
    let names: Vec<&str> = COLUMNS.iter().map(|c| c.0).collect();
    format!(
        "INSERT INTO bucketd_buckets AS t ({0}) SELECT {0} FROM bucketd_staging \
         WHERE gateway_id = $1 AND batch = $2 ON CONFLICT ({1}) DO UPDATE SET{ADD_DELTA}",
        names.join(", "),
        key.columns()
    )
}

/// The batch's staged rows (gateway `$1`, token `$2`), gone once moved in.
const CLEAR_STAGED: &str = "DELETE FROM bucketd_staging WHERE gateway_id = $1 AND batch = $2";

/// Whether this connection may stage rows: the table is there (`schema.sql` since issue 57) and
/// the role may insert and delete in it (`roles.sql`); else batches go as multi-row `VALUES`.
const MAY_STAGE: &str = "
SELECT coalesce(has_table_privilege(to_regclass('bucketd_staging'), 'INSERT, DELETE'), false)";

/// Rows per upsert statement, where rows cannot be staged: a batch is written by statements of these sizes (the largest
/// that fit first), pipelined. A multi-row `VALUES` whose rows all have one `gateway_id` is
/// what Citus routes to the one shard holding that gateway; an `INSERT ... SELECT FROM
/// unnest(...)` it pulls to the coordinator first (issue 57: 4.8x slower). 256 rows are 5,633
/// parameters, within PostgreSQL's 65,535.
const UPSERT_ROWS: [usize; 9] = [256, 128, 64, 32, 16, 8, 4, 2, 1];

/// The upsert of `rows` rows: `$1` the gateway, then each row's other 22 columns in
/// [`COLUMNS`] order; a conflict on `key` adds the delta to the row ([`ADD_DELTA`]).
fn upsert_text(key: Key, rows: usize) -> String {
    use std::fmt::Write as _;
    let names: Vec<&str> = COLUMNS.iter().map(|c| c.0).collect();
    let mut text = format!(
        "INSERT INTO bucketd_buckets AS t ({}) VALUES ",
        names.join(", ")
    );
    let mut n = 1;
    for r in 0..rows {
        text.push_str(if r == 0 { "(" } else { ", (" });
        for (i, (column, kind)) in COLUMNS.iter().enumerate() {
            if i > 0 {
                text.push_str(", ");
            }
            if *column == "gateway_id" {
                text.push_str("$1::text");
            } else {
                n += 1;
                let _ = write!(text, "${n}::{kind}");
            }
        }
        text.push(')');
    }
    let _ = write!(
        text,
        " ON CONFLICT ({}) DO UPDATE SET{ADD_DELTA}",
        key.columns()
    );
    text
}

/// The upsert of `rows` rows as a gateway's batch sends it to a table keyed by gateway: `$1`
/// the gateway, then 22 parameters a row (`series`, `start`, `sensor`, `metric`, `width_secs`,
/// `count`, `sum`, `sum_comp`, `min`, `max`, `first_ts_ns`, `first_value`, `last_ts_ns`,
/// `last_value`, `mean`, `m2`, `sketch`, `p50`, `p90`, `p99`, `inc`, `inc_count`). For `EXPLAIN`: the Citus test
/// checks that Citus routes it to one shard.
pub fn upsert_statement(rows: usize) -> String {
    upsert_text(Key::Gateway, rows)
}

/// The move of a gateway's (`$1`) rows staged by a batch (token `$2`) into a table keyed by
/// gateway, as a batch sends it. For `EXPLAIN`: the Citus test checks that Citus runs it on one shard.
pub fn move_in_statement() -> String {
    move_in_text(Key::Gateway)
}

/// How the fleet's table is keyed, found when a connection opens: by gateway, series and
/// start (tables made since issue 57, which Citus distributes by `gateway_id`), or by series and
/// start (made before; `deploy/postgres/migrate-gateway-key.sql` moves them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    Gateway,
    Series,
}

/// The primary key's columns of `bucketd_buckets`, in order.
const PRIMARY_KEY: &str = "
SELECT coalesce(array_agg(a.attname::text ORDER BY k.n), '{}')
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = to_regclass('bucketd_buckets') AND i.indisprimary";

impl Key {
    /// The key of the table `client` sees.
    pub async fn of(client: &tokio_postgres::Client) -> Result<Key, tokio_postgres::Error> {
        let columns: Vec<String> = client.query_one(PRIMARY_KEY, &[]).await?.get(0);
        Ok(
            if columns.first().map(String::as_str) == Some("gateway_id") {
                Key::Gateway
            } else {
                Key::Series
            },
        )
    }

    fn columns(self) -> &'static str {
        match self {
            Key::Gateway => "gateway_id, series, start",
            Key::Series => "series, start",
        }
    }
}

/// A PostgreSQL error as an operator can act on it: the server's message with its SQLSTATE,
/// detail and hint (tokio-postgres's own text is only "db error"), or the client's error.
pub fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let mut text = format!("{} {}: {}", db.severity(), db.code().code(), db.message());
            for (what, more) in [("detail", db.detail()), ("hint", db.hint())] {
                if let Some(more) = more {
                    use std::fmt::Write as _;
                    let _ = write!(text, " ({what}: {more})");
                }
            }
            text
        }
        None => format!(
            "{e}{}",
            std::error::Error::source(e).map_or(String::new(), |s| format!(": {s}"))
        ),
    }
}

/// [`describe`] for an error that may hold a PostgreSQL error somewhere in its chain.
pub fn describe_any(e: &anyhow::Error) -> String {
    match e
        .chain()
        .find_map(|c| c.downcast_ref::<tokio_postgres::Error>())
    {
        Some(pg) => format!("{e}: {}", describe(pg)),
        None => format!("{e:#}"),
    }
}

/// The gateway's position, its row made if missing and locked (a conflict's update takes the
/// row lock and returns the row as it was).
const CLAIM: &str = "
INSERT INTO bucketd_gateways AS g (gateway_id, last_seq) VALUES ($1, -1)
ON CONFLICT (gateway_id) DO UPDATE SET last_seq = g.last_seq
RETURNING last_seq, origin";

/// The stored rows of the batch's buckets: what the merged sketch and quantiles start from.
/// The gateway named too: Citus then reads the one shard holding the gateway's rows.
/// No row lock: the gateway's `bucketd_gateways` row, locked first, serialises every writer of
/// the gateway's rows (they are its own: `series` starts with its id).
const STORED: &str = "
SELECT b.series, b.start, b.count, b.min, b.max, b.sketch
FROM bucketd_buckets b
JOIN unnest($1::text[], $2::timestamptz[]) AS k(series, start)
  ON b.series = k.series AND b.start = k.start
WHERE b.gateway_id = $3";

/// Why a password for `conninfo` (in it, or from its password file) would reach someone who
/// is not the server: the connection goes over the network (not a socket or loopback) and does
/// not check the server's certificate (`sslmode` disable or prefer, or require without
/// `sslrootcert`). MQTT warns alike; `None` when it is safe or there is no password.
pub fn password_exposure(key: &str, conninfo: &str, password_file: bool) -> Option<String> {
    use crate::config::SslMode;
    let tls = crate::config::pg_tls(conninfo).ok()?;
    let verified = match tls.mode {
        SslMode::Disable | SslMode::Prefer => false,
        SslMode::Require => tls.root_cert.is_some(),
        SslMode::VerifyCa | SslMode::VerifyFull => true,
    };
    let config: tokio_postgres::Config = tls.conninfo.parse().ok()?;
    if verified || (!password_file && config.get_password().is_none()) {
        return None;
    }
    let remote: Vec<String> = config
        .get_hosts()
        .iter()
        .filter_map(|host| match host {
            tokio_postgres::config::Host::Tcp(name) => Some(name.clone()),
            #[cfg(unix)]
            tokio_postgres::config::Host::Unix(_) => None,
        })
        .chain(config.get_hostaddrs().iter().map(ToString::to_string))
        .filter(|host| !crate::config::is_loopback_host(host))
        .collect();
    if remote.is_empty() {
        return None;
    }
    let mode = match tls.mode {
        SslMode::Disable => "disable: no TLS",
        SslMode::Prefer => "prefer: TLS if offered, the certificate not checked",
        _ => "require without sslrootcert: the certificate not checked",
    };
    Some(format!(
        "The PostgreSQL password of {key} goes to {} without a check of the server's \
         certificate (sslmode={mode}): whoever sits on the path can take it. Set \
         sslmode=verify-full and sslrootcert=<the server's CA file> in {key}.",
        remote.join(", ")
    ))
}

/// Connects to PostgreSQL (`conninfo` without the password) and runs `schema`, idempotently,
/// under an advisory lock that serialises it with every other bucketd doing the same.
pub async fn connect(
    conninfo: &str,
    password: Option<&Secret>,
    application_name: String,
    schema: &str,
) -> anyhow::Result<tokio_postgres::Client> {
    let mut client = client(conninfo, password, application_name).await?;
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
        .await?;
    // On Citus, a change to a distributed table (an index a new release adds) and the
    // function definitions after it may not share a transaction over several connections per
    // node ("cannot run function command because there was a parallel operation"): one
    // connection per node. A placeholder setting, and harmless, on a server without Citus.
    tx.batch_execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
        .await?;
    // A gateway's own role (deploy/postgres/roles.sql) may not create or alter tables: an admin
    // made them, and the schema step is skipped.
    tx.batch_execute("SAVEPOINT bucketd_schema").await?;
    if let Err(e) = tx.batch_execute(schema).await {
        if e.code() != Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) {
            return Err(e.into());
        }
        tx.batch_execute("ROLLBACK TO SAVEPOINT bucketd_schema")
            .await?;
        tracing::debug!(error = %e, "This role may not create the schema; using the tables as they are.");
    }
    tx.commit().await?;
    Ok(client)
}

/// Connects to PostgreSQL (`conninfo` without the password, TLS as its `sslmode` says).
pub async fn client(
    conninfo: &str,
    password: Option<&Secret>,
    application_name: String,
) -> anyhow::Result<tokio_postgres::Client> {
    // Config validation checked the TLS settings (and refused TLS in a build without it).
    let tls = crate::config::pg_tls(conninfo).map_err(anyhow::Error::msg)?;
    let mut config: tokio_postgres::Config = tls.conninfo.parse()?;
    if let Some(password) = password {
        config.password(password.expose());
    }
    config.application_name(application_name);
    config.connect_timeout(Duration::from_secs(10));
    let ended = |e: tokio_postgres::Error| {
        tracing::debug!(error = %e, "The PostgreSQL connection ended.");
    };
    #[cfg(feature = "tls")]
    let client = {
        let connector = super::pg_tls::connector(&tls, "sslmode").map_err(anyhow::Error::msg)?;
        let (client, connection) = config.connect(connector).await?;
        tokio::spawn(async move { connection.await.unwrap_or_else(ended) });
        client
    };
    #[cfg(not(feature = "tls"))]
    let client = {
        let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
        tokio::spawn(async move { connection.await.unwrap_or_else(ended) });
        client
    };
    Ok(client)
}

/// A connection to the fleet's PostgreSQL with the statements of a batch prepared once.
pub struct FleetDb {
    client: tokio_postgres::Client,
    claim: tokio_postgres::Statement,
    stored: tokio_postgres::Statement,
    /// The upsert of each of [`UPSERT_ROWS`] rows, in that order.
    upserts: Vec<tokio_postgres::Statement>,
    /// Where rows can be staged ([`MAY_STAGE`]): the copy into the staging table, the move
    /// into the table, and the staged rows' delete.
    staging: Option<[tokio_postgres::Statement; 3]>,
    /// Months (`year * 12 + month - 1`) whose partition is known to exist.
    months: BTreeSet<i64>,
}

impl FleetDb {
    /// [`connect`]s (the schema applied) and prepares the batch's statements.
    pub async fn open(
        conninfo: &str,
        password: Option<&Secret>,
        application_name: String,
    ) -> anyhow::Result<FleetDb> {
        let client = connect(conninfo, password, application_name, SCHEMA).await?;
        let claim = client.prepare(CLAIM).await?;
        let stored = client.prepare(STORED).await?;
        let key = Key::of(&client).await?;
        let mut upserts = Vec::with_capacity(UPSERT_ROWS.len());
        for rows in UPSERT_ROWS {
            upserts.push(client.prepare(&upsert_text(key, rows)).await?);
        }
        let staging = if client.query_one(MAY_STAGE, &[]).await?.get(0) {
            Some([
                client.prepare(&copy_text()).await?,
                client.prepare(&move_in_text(key)).await?,
                client.prepare(CLEAR_STAGED).await?,
            ])
        } else {
            tracing::warn!(
                "This role may not stage rows in bucketd_staging (made by schema.sql and opened \
                 to gateways by roles.sql since issue 57): batches go as multi-row INSERTs, \
                 which Citus sends to its workers as text (3x slower there). Run schema.sql and \
                 roles.sql again as the tables' owner."
            );
            None
        };
        Ok(FleetDb {
            client,
            claim,
            stored,
            upserts,
            staging,
            months: BTreeSet::new(),
        })
    }

    /// The connection, for statements of the caller's own.
    pub fn client(&self) -> &tokio_postgres::Client {
        &self.client
    }

    /// Drops the month partitions that ended at least `retention` ago (fleet retention);
    /// returns how many.
    pub async fn drop_partitions_older_than(&self, retention: Duration) -> anyhow::Result<i32> {
        let cutoff = std::time::SystemTime::now()
            .checked_sub(retention)
            .unwrap_or(UNIX_EPOCH);
        let row = self
            .client
            .query_one("SELECT bucketd_drop_partitions_before($1)", &[&cutoff])
            .await?;
        Ok(row.get(0))
    }

    /// Makes sure a partition holds each month of `starts` (seconds), in a transaction of its
    /// own: making one locks the parent table, which must not happen while this connection's
    /// batch transaction holds locks on it (two gateways would deadlock). A month another
    /// gateway's retention dropped after this connection saw it fails the next insert into it;
    /// the forwarder then reconnects, with the cache empty, and makes it again.
    async fn ensure_partitions(&mut self, starts: impl Iterator<Item = i64>) -> anyhow::Result<()> {
        let missing: BTreeSet<i64> = starts
            .filter_map(month_of)
            .filter(|m| !self.months.contains(m))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let firsts: Vec<std::time::SystemTime> = missing
            .iter()
            .filter_map(|&m| {
                let first = chrono::NaiveDate::from_ymd_opt(
                    i32::try_from(m.div_euclid(12)).ok()?,
                    u32::try_from(m.rem_euclid(12)).ok()? + 1,
                    1,
                )?;
                let secs = first.and_hms_opt(0, 0, 0)?.and_utc().timestamp();
                Some(UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?))
            })
            .collect();
        self.client
            .execute("SELECT bucketd_ensure_partitions($1)", &[&firsts])
            .await?;
        self.months.extend(missing);
        Ok(())
    }
}

/// The month of `start` (seconds since the epoch, UTC) as `year * 12 + month - 1`.
fn month_of(start: i64) -> Option<i64> {
    use chrono::Datelike;
    let t = chrono::DateTime::from_timestamp(start, 0)?;
    Some(i64::from(t.year()) * 12 + i64::from(t.month0()))
}

/// One bucket of a batch: its deltas merged, in entry order.
struct Merged<'a> {
    first: &'a BucketDoc,
    summary: Summary,
}

/// Applies the entries above the gateway's `last_seq` in one transaction, with a fixed number
/// of round trips whatever the batch holds (five): the transaction begun, the gateway's row
/// locked, the batch's stored rows read, every row written (statements of [`UPSERT_ROWS`]
/// rows) and the position moved (pipelined), the commit. Every statement names the gateway: on
/// Citus, distributed by `gateway_id`, the transaction runs on the one worker holding it. Month partitions the batch needs and this connection has not
/// seen are made first, in a transaction of their own. Returns the readings the applied entries
/// represent (none for a batch that was already applied) and those left out as older than
/// `expire`, the fleet retention.
pub async fn apply(
    db: &mut FleetDb,
    gateway: &str,
    origin: &str,
    entries: &[OutboxDoc],
    expire: Option<Duration>,
) -> anyhow::Result<Applied> {
    let prefix = format!("{gateway}:");
    // Buckets that ended before the fleet retention's cutoff are left out: their month's
    // partition is dropped or about to be, and writing them would make it again.
    let cutoff = expire.map_or(i64::MIN, |r| {
        let now = std::time::SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        i64::try_from(now.saturating_sub(r.as_secs())).unwrap_or(i64::MAX)
    });
    let kept = |b: &&BucketDoc| b.end > cutoff;
    // Every bucket of the batch, merged: the entries already applied are left out below, but
    // reading a few rows too many is cheaper than a round trip more.
    let keys: BTreeSet<(String, i64)> = entries
        .iter()
        .flat_map(|e| &e.buckets)
        .filter(kept)
        .map(|b| (format!("{prefix}{}", b.series), b.start))
        .collect();
    db.ensure_partitions(keys.iter().map(|k| k.1)).await?;
    let (series, starts) = key_arrays(keys.iter())?;
    let tx = db.client.transaction().await?;
    // The gateway's row, made if missing, locked for the transaction: every writer of its rows
    // waits here. Then what the rows hold (in this order: after the lock).
    let row = tx.query_one(&db.claim, &[&gateway]).await?;
    let stored = tx.query(&db.stored, &[&series, &starts, &gateway]).await?;
    let (mut last, stored_origin): (i64, String) = (row.get(0), row.get(1));
    // A replaced database numbers its entries from the start again (see `super::applied`).
    if !stored_origin.is_empty() && stored_origin != origin {
        warn!(
            gateway,
            was = %stored_origin,
            now = %origin,
            "PostgreSQL holds this gateway's deltas from another database; applying this one's \
             from its start. If two gateways share this id, give each its own upstream.gateway_id."
        );
        last = -1;
    }
    let mut merged: BTreeMap<(String, i64), Merged<'_>> = BTreeMap::new();
    let mut applied = Applied::default();
    for entry in entries.iter().filter(|e| e.seq > last) {
        for b in &entry.buckets {
            let count = u64::try_from(b.count)?;
            if !kept(&b) {
                applied.expired = applied.expired.saturating_add(count);
                continue;
            }
            applied.readings = applied.readings.saturating_add(count);
            match merged.entry((format!("{prefix}{}", b.series), b.start)) {
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(Merged {
                        first: b,
                        summary: b.summary(),
                    });
                }
                std::collections::btree_map::Entry::Occupied(mut o) => {
                    o.get_mut().summary.merge(&b.summary());
                }
            }
        }
    }
    let rows = Rows::of(&merged, &stored)?;
    let upto = entries.last().map_or(last, |e| e.seq);
    let advance = async {
        if upto > last {
            tx.execute(
                "UPDATE bucketd_gateways SET last_seq = $2, origin = $3, updated_at = now()
                 WHERE gateway_id = $1",
                &[&gateway, &upto, &origin],
            )
            .await?;
        }
        Ok::<_, tokio_postgres::Error>(())
    };
    write(
        &tx,
        db.staging.as_ref(),
        &db.upserts,
        &rows,
        gateway,
        advance,
    )
    .await?;
    tx.commit().await?;
    Ok(applied)
}

/// Writes the batch's `rows` in `tx` and moves the gateway's position (`advance`), pipelined:
/// staged and moved in where the connection may stage, else as multi-row `VALUES`.
async fn write(
    tx: &tokio_postgres::Transaction<'_>,
    staging: Option<&[tokio_postgres::Statement; 3]>,
    upserts: &[tokio_postgres::Statement],
    rows: &Rows<'_>,
    gateway: &str,
    advance: impl std::future::Future<Output = Result<(), tokio_postgres::Error>>,
) -> Result<(), tokio_postgres::Error> {
    if let Some([copy, move_in, clear]) = staging
        && !rows.series.is_empty()
    {
        // Staged (a binary COPY: the values travel as PostgreSQL's own binary, to the worker
        // too on Citus), then moved in by one statement on the gateway's shard.
        let token = i64::from_ne_bytes(
            getrandom::u64()
                .unwrap_or_else(|_| {
                    // No random source: a token still unlike another batch's of this gateway.
                    let now = std::time::SystemTime::now().duration_since(UNIX_EPOCH);
                    now.map_or(0, |d| d.as_nanos() as u64)
                })
                .to_ne_bytes(),
        );
        let sink = tx.copy_in(copy).await?;
        let writer = tokio_postgres::binary_copy::BinaryCopyInWriter::new(sink, &COLUMN_TYPES);
        let mut writer = std::pin::pin!(writer);
        for i in 0..rows.series.len() {
            let row = rows.row(&gateway, i);
            let mut values: [&(dyn ToSql + Sync); COLUMNS.len() + 1] = [&token; COLUMNS.len() + 1];
            values[1..].copy_from_slice(&row);
            writer.as_mut().write(&values).await?;
        }
        writer.finish().await?;
        // Pipelined, in this order: the move, the delete, the position.
        let own: [&(dyn ToSql + Sync); 2] = [&gateway, &token];
        tokio::try_join!(tx.execute(move_in, &own), tx.execute(clear, &own), advance)?;
        return Ok(());
    }
    // The rows in statements of [`UPSERT_ROWS`] sizes, largest first.
    let mut chunks = Vec::new();
    let mut at = 0;
    for (size, statement) in UPSERT_ROWS.iter().zip(upserts) {
        while rows.series.len() - at >= *size {
            chunks.push((statement, rows.params(&gateway, at..at + size)));
            at += size;
        }
    }
    let write = futures_util::future::try_join_all(
        chunks
            .iter()
            .map(|(statement, params)| tx.execute(*statement, params)),
    );
    // Pipelined (one round trip): the two touch different tables, in either order.
    tokio::try_join!(write, advance)?;
    Ok(())
}

/// What a batch applied: the readings its deltas represent, and those left out as older than
/// the fleet retention.
#[derive(Debug, Default, Clone, Copy)]
pub struct Applied {
    pub readings: u64,
    pub expired: u64,
}

/// The keys as the two arrays the statements take.
fn key_arrays<'a>(
    keys: impl Iterator<Item = &'a (String, i64)>,
) -> anyhow::Result<(Vec<&'a str>, Vec<std::time::SystemTime>)> {
    let (mut series, mut starts) = (Vec::new(), Vec::new());
    for (s, start) in keys {
        series.push(s.as_str());
        starts.push(UNIX_EPOCH + Duration::from_secs(u64::try_from(*start)?));
    }
    Ok((series, starts))
}

/// The upsert's columns, one element per bucket.
#[derive(Default)]
struct Rows<'a> {
    series: Vec<&'a str>,
    start: Vec<std::time::SystemTime>,
    sensor: Vec<&'a str>,
    metric: Vec<&'a str>,
    width: Vec<i32>,
    count: Vec<i64>,
    sum: Vec<f64>,
    sum_comp: Vec<f64>,
    min: Vec<f64>,
    max: Vec<f64>,
    first_ts: Vec<i64>,
    first_value: Vec<f64>,
    last_ts: Vec<i64>,
    last_value: Vec<f64>,
    mean: Vec<f64>,
    m2: Vec<f64>,
    sketch: Vec<Vec<u8>>,
    quantiles: [Vec<Option<f64>>; 3],
    inc: Vec<Option<f64>>,
    inc_count: Vec<Option<i64>>,
}

impl<'a> Rows<'a> {
    /// The merged deltas as rows: each one's sketch merged with the stored row's, and the
    /// quantiles of what the row holds once written (its stored readings and the deltas').
    fn of(
        merged: &'a BTreeMap<(String, i64), Merged<'a>>,
        stored: &[tokio_postgres::Row],
    ) -> anyhow::Result<Rows<'a>> {
        let mut before: BTreeMap<(String, i64), Stored<'_>> = BTreeMap::new();
        for row in stored {
            let start: std::time::SystemTime = row.get(1);
            let secs = start.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let stored = Stored {
                count: row.get(2),
                min: row.get(3),
                max: row.get(4),
                sketch: row.get(5),
            };
            before.insert((row.get(0), i64::try_from(secs)?), stored);
        }
        let mut rows = Rows::default();
        for ((series, start), m) in merged {
            let delta = &m.summary;
            let count = i64::try_from(delta.count).unwrap_or(i64::MAX);
            let whole = whole(delta, before.get(&(series.clone(), *start)));
            rows.series.push(series);
            rows.start
                .push(UNIX_EPOCH + Duration::from_secs(u64::try_from(*start)?));
            rows.sensor.push(&m.first.sensor);
            rows.metric.push(&m.first.metric);
            rows.width
                .push(i32::try_from(m.first.end.saturating_sub(m.first.start))?);
            rows.count.push(count);
            rows.sum.push(delta.sum);
            rows.sum_comp.push(delta.sum_comp);
            rows.min.push(delta.min);
            rows.max.push(delta.max);
            rows.first_ts.push(delta.first.ts);
            rows.first_value.push(delta.first.value);
            rows.last_ts.push(delta.last.ts);
            rows.last_value.push(delta.last.value);
            rows.mean.push(delta.mean);
            rows.m2.push(delta.m2);
            for (q, out) in [0.5, 0.9, 0.99].into_iter().zip(&mut rows.quantiles) {
                out.push(whole.quantile(q));
            }
            rows.sketch.push(whole.sketch.encode());
            rows.inc.push(delta.inc);
            rows.inc_count.push(delta.inc.map(|_| count));
        }
        Ok(rows)
    }

    /// Row `i`'s values but the gateway: [`COLUMNS`] in order without `gateway_id`.
    fn values(&self, i: usize) -> [&(dyn ToSql + Sync); COLUMNS.len() - 1] {
        [
            &self.series[i],
            &self.start[i],
            &self.sensor[i],
            &self.metric[i],
            &self.width[i],
            &self.count[i],
            &self.sum[i],
            &self.sum_comp[i],
            &self.min[i],
            &self.max[i],
            &self.first_ts[i],
            &self.first_value[i],
            &self.last_ts[i],
            &self.last_value[i],
            &self.mean[i],
            &self.m2[i],
            &self.sketch[i],
            &self.quantiles[0][i],
            &self.quantiles[1][i],
            &self.quantiles[2][i],
            &self.inc[i],
            &self.inc_count[i],
        ]
    }

    /// Row `i` in [`COLUMNS`] order, for the binary copy.
    fn row<'p>(
        &'p self,
        gateway: &'p &'p str,
        i: usize,
    ) -> [&'p (dyn ToSql + Sync); COLUMNS.len()] {
        let v = self.values(i);
        let mut row: [&(dyn ToSql + Sync); COLUMNS.len()] = [gateway; COLUMNS.len()];
        row[..2].copy_from_slice(&v[..2]);
        row[3..].copy_from_slice(&v[2..]);
        row
    }

    /// The parameters of an upsert of the rows `rows` ([`upsert_text`]): the gateway, then
    /// each row's other columns.
    fn params<'p>(
        &'p self,
        gateway: &'p &'p str,
        rows: std::ops::Range<usize>,
    ) -> Vec<&'p (dyn ToSql + Sync)> {
        let mut params: Vec<&(dyn ToSql + Sync)> =
            Vec::with_capacity(1 + (COLUMNS.len() - 1) * rows.len());
        params.push(gateway);
        for i in rows {
            params.extend(self.values(i));
        }
        params
    }
}

/// A stored row's count, min, max and sketch: what its quantiles start from.
struct Stored<'r> {
    count: i64,
    min: f64,
    max: f64,
    sketch: &'r [u8],
}

/// What a row holds once `delta` is added to it, as far as its quantiles need: the count, min,
/// max and the sketches merged. A stored sketch that cannot be read is taken as empty, so the
/// row's quantiles read as unknown (NULL) rather than wrong.
fn whole(delta: &Summary, stored: Option<&Stored<'_>>) -> Summary {
    let mut whole = delta.clone();
    if let Some(row) = stored {
        let mut sketch =
            Sketch::decode(row.sketch).unwrap_or_else(|| Sketch::new(delta.sketch.params()));
        sketch.merge(&delta.sketch);
        whole.count = u64::try_from(row.count)
            .unwrap_or(0)
            .saturating_add(delta.count);
        whole.min = whole.min.min(row.min);
        whole.max = whole.max.max(row.max);
        whole.sketch = sketch;
    }
    whole
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 41: `sslmode=prefer` (libpq's default) or `require` without a root certificate sent
    /// a password to a remote server without checking who it was, with no word of it (MQTT
    /// warns). Each case: (conninfo, a password file, warned).
    #[test]
    fn a_password_sent_unchecked_over_the_network_is_warned_about() {
        for (conninfo, file, warned) in [
            ("host=db.example user=u", true, true),
            ("host=db.example user=u password=x", false, true),
            ("host=db.example user=u sslmode=require", true, true),
            ("postgresql://u:x@db.example/f?sslmode=disable", false, true),
            ("host=10.0.0.5 user=u sslmode=prefer", true, true),
            ("host=db.example user=u", false, false),
            ("host=localhost user=u password=x", false, false),
            ("host=127.0.0.1 user=u", true, false),
            ("host=/run/postgresql user=u", true, false),
            (
                "host=db.example user=u sslmode=require sslrootcert=/etc/ca.pem",
                true,
                false,
            ),
            (
                "host=db.example user=u sslmode=verify-full sslrootcert=/etc/ca.pem",
                true,
                false,
            ),
            ("host=localhost,db.example user=u", true, true),
        ] {
            let warning = password_exposure("upstream.postgres", conninfo, file);
            assert_eq!(warning.is_some(), warned, "{conninfo}: {warning:?}");
            if let Some(w) = warning {
                assert!(w.contains("db.example") || w.contains("10.0.0.5"), "{w}");
                assert!(
                    w.contains("verify-full") && w.contains("upstream.postgres"),
                    "{w}"
                );
                assert!(!w.contains("password=x"), "{w}");
            }
        }
    }

    /// The quantile columns are those of everything the row holds once written, with the
    /// edge's rule (clamped to the row's min and max), and unknown when the stored sketch is not
    /// readable. Ground truth: the readings themselves, not the sketch's rank rule.
    #[test]
    fn a_rows_quantiles_cover_the_stored_readings_and_the_deltas() {
        let params = crate::sketch::SketchParams::DEFAULT;
        let summary_of = |values: &[f64]| {
            let mut s = Summary::with_params(0, values[0], params);
            for (i, &v) in values.iter().enumerate().skip(1) {
                s.push(i64::try_from(i).unwrap(), v);
            }
            s
        };
        let old: Vec<f64> = (1..=900).map(f64::from).collect();
        let new: Vec<f64> = (901..=1000).map(f64::from).collect();
        let (stored, delta) = (summary_of(&old), summary_of(&new));
        let sketch = stored.sketch.encode();
        let row = Stored {
            count: i64::try_from(stored.count).unwrap(),
            min: stored.min,
            max: stored.max,
            sketch: &sketch,
        };
        let all = whole(&delta, Some(&row));
        assert_eq!(all.count, 1000);
        // 1..=1000 by numpy's definition (type 7): p50 500.5, p90 900.1, p99 990.01; the
        // sketch answers within 1% of the larger neighbour.
        for (q, exact) in [(0.5, 500.5), (0.9, 900.1), (0.99, 990.01)] {
            let got = all.quantile(q).unwrap();
            assert!(
                (got - exact).abs() <= f64::ceil(exact) * 0.01,
                "p{q}: {got} vs {exact}"
            );
        }
        // The delta alone says nothing of the stored readings: its median is above 900.
        assert!(delta.quantile(0.5).unwrap() > 900.0);
        // A damaged stored sketch: unknown, not the delta's quantiles.
        let damaged = Stored {
            sketch: b"junk",
            ..row
        };
        assert_eq!(whole(&delta, Some(&damaged)).quantile(0.5), None);
        // A new row: the delta's own.
        assert_eq!(whole(&delta, None).quantile(0.99), delta.quantile(0.99));
    }
}
