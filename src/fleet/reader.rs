//! The query node's reads (`bucketd query-node`, docs/FLEET.md): the fleet's buckets in
//! PostgreSQL through a read-only connection, each gateway's series as stored
//! (`<gateway>:<sensor>/<metric>`), and fleet-wide series (`*:<sensor>/<metric>`) whose buckets
//! are every gateway's of that sensor and metric merged here, sketches included: a fleet p99 is
//! the p99 of the merged sketch, not an average of p99s.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::doc::BucketDoc;
use crate::secret::Secret;
use crate::sketch::Sketch;
use crate::source::{BucketSource, ReadError};
use crate::summary::{Point, Summary};

/// The gateway part of a fleet-wide series' name: `*:<sensor>/<metric>` (no gateway id has
/// a `*`: `reading::valid_gateway_id`).
pub const FLEET_PREFIX: &str = "*:";

/// The rows of some series (`$1`, each of the gateway at the same place in `$7`) over a range,
/// in series then time order: the primary key on each month partition the range touches, one
/// probe per series. At most `$5` rows. A sketch longer than `$6` bytes (more than any bucketd
/// writes: [`sketch_bytes_max`]) is not sent: NULL in its place (issue 52: a gateway role's row
/// with a 20 MB sketch took a query node from 8 to 580 MiB a query). The gateways named: on
/// Citus, distributed by `gateway_id`, only their shards are read.
const BUCKETS: &str = "
SELECT b.series, b.start, b.count, b.sum, b.sum_comp, b.min, b.max, b.first_ts_ns,
    b.first_value, b.last_ts_ns, b.last_value, b.mean, b.m2,
    CASE WHEN octet_length(b.sketch) <= $6 THEN b.sketch END,
    CASE WHEN b.inc_count = b.count THEN b.inc END
FROM unnest($1::text[], $7::text[]) AS k(series, gateway_id)
JOIN bucketd_buckets b ON b.gateway_id = k.gateway_id AND b.series = k.series
WHERE b.gateway_id = ANY($7) AND b.start >= $2 AND b.start < $3 AND b.width_secs = $4
ORDER BY b.series, b.start
LIMIT $5";

/// The gateways, at most `$1`, for [`GATEWAY_SERIES`]: every gateway that wrote a row has its
/// position row.
const GATEWAYS: &str = "SELECT gateway_id FROM bucketd_gateways ORDER BY gateway_id LIMIT $1";

/// One gateway's (`$1`) series names, at most `$2`: one probe of the primary key
/// `(gateway_id, series, start)` per series (a skip scan: PostgreSQL has none built in). The
/// gateway named in every part, so that Citus runs it on the gateway's shard (it refuses a
/// recursive query without a filter on the distribution column).
const GATEWAY_SERIES: &str = "
WITH RECURSIVE s(series) AS (
    (SELECT series FROM bucketd_buckets WHERE gateway_id = $1 ORDER BY series LIMIT 1)
    UNION ALL
    SELECT (SELECT b.series FROM bucketd_buckets b WHERE b.gateway_id = $1 AND b.series > s.series
            ORDER BY b.series LIMIT 1)
    FROM s WHERE s.series IS NOT NULL
)
SELECT series FROM s WHERE series IS NOT NULL LIMIT $2";

/// Every series name, at most `$1`, on a table keyed `(series, start)` (an earlier release's):
/// the same skip scan over the whole key.
const SERIES: &str = "
WITH RECURSIVE s(series) AS (
    (SELECT series FROM bucketd_buckets ORDER BY series LIMIT 1)
    UNION ALL
    SELECT (SELECT b.series FROM bucketd_buckets b WHERE b.series > s.series
            ORDER BY b.series LIMIT 1)
    FROM s WHERE s.series IS NOT NULL
)
SELECT series FROM s WHERE series IS NOT NULL LIMIT $1";

/// [`SERIES`] where the server cannot run a recursive query over the whole table (Citus, on a
/// table distributed by `series` as earlier docs said): a scan of every row.
const SERIES_SCAN: &str = "SELECT DISTINCT series FROM bucketd_buckets ORDER BY series LIMIT $1";

/// On Citus, a query's tasks on one worker run at once, each on a connection of its own kept
/// for the next query: a fleet-wide series reads a shard of every gateway, and Citus otherwise
/// runs a worker's tasks one after another on its one cached connection, opening a second only
/// after 10 ms (issue 57: the SQL of a fleet-wide day 3.3-3.9 -> 2.8 ms with two shards a
/// worker). `citus.sql` makes one shard a worker, where this changes nothing; a table of more
/// (shard counts are the operator's) takes two connections a worker at most, opened once and
/// kept, not one new connection a task. On a plain PostgreSQL these are placeholders that
/// nothing reads.
const CITUS_READS: &str = "SET citus.executor_slow_start_interval = 0; \
     SET citus.max_adaptive_executor_pool_size = 2; SET citus.max_cached_conns_per_worker = 2";

/// What a query node reads and how much (`[query_node]`).
#[derive(Debug, Clone)]
pub struct NodeSettings {
    /// libpq connection string of a read-only role, without the password.
    pub conninfo: String,
    pub password: Option<Secret>,
    /// The width of the buckets it serves (`store.bucket_width`); rows of another width are
    /// not read.
    pub width_secs: i64,
    /// Connections to PostgreSQL: one per query served at once (`http.max_concurrent_queries`).
    pub connections: usize,
    /// How old the series list may get before a query reads it again.
    pub series_refresh: Duration,
    /// Most series listed (gateways' series; the fleet-wide ones come on top).
    pub max_series: usize,
    /// Most rows one query reads (a fleet-wide series reads one per gateway and bucket).
    pub max_rows: usize,
    /// PostgreSQL's `statement_timeout` on the node's connections.
    pub statement_timeout: Duration,
}

/// The series as last listed: gateways' names, and for each `<sensor>/<metric>` the gateways'
/// series that the fleet-wide one merges.
struct SeriesList {
    at: Instant,
    names: Vec<String>,
    members: BTreeMap<String, Vec<String>>,
}

struct Conn {
    client: tokio_postgres::Client,
    buckets: tokio_postgres::Statement,
    /// How the table is keyed: which way the series are listed.
    key: super::postgres::Key,
}

/// A failed statement as a read error that names the server's SQLSTATE and message.
#[allow(clippy::needless_pass_by_value)] // the shape `map_err` passes
fn failed(e: tokio_postgres::Error) -> ReadError {
    ReadError::failed(super::postgres::describe(&e))
}

/// Read access to the fleet's PostgreSQL, for the HTTP layer ([`BucketSource`]). Its calls
/// block (on the blocking pool) while the runtime it was made in runs the queries.
pub struct FleetReader(Arc<Reader>);

struct Reader {
    settings: NodeSettings,
    runtime: tokio::runtime::Handle,
    pool: Vec<Arc<tokio::sync::Mutex<Option<Conn>>>>,
    next: AtomicUsize,
    series: std::sync::Mutex<Option<Arc<SeriesList>>>,
    /// Held while the series list is read again, so that one query (or one refresh behind a
    /// stale list) reads it, not each.
    listing: Arc<tokio::sync::Mutex<()>>,
}

impl FleetReader {
    /// A reader whose connections are made as queries need them (PostgreSQL may be down when
    /// the node starts: `/readyz` says so). Must be called inside a Tokio runtime.
    pub fn new(settings: NodeSettings) -> FleetReader {
        let pool = (0..settings.connections.max(1))
            .map(|_| Arc::new(tokio::sync::Mutex::new(None)))
            .collect();
        FleetReader(Arc::new(Reader {
            settings,
            runtime: tokio::runtime::Handle::current(),
            pool,
            next: AtomicUsize::new(0),
            series: std::sync::Mutex::new(None),
            listing: Arc::new(tokio::sync::Mutex::new(())),
        }))
    }
}

impl Reader {
    /// A free connection (the next one round the pool if none is), connected if it is not.
    async fn conn(&self) -> Result<tokio::sync::OwnedMutexGuard<Option<Conn>>, ReadError> {
        let n = self.pool.len();
        let first = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let free = (0..n).find_map(|i| self.pool[(first + i) % n].clone().try_lock_owned().ok());
        let mut slot = match free {
            Some(slot) => slot,
            None => self.pool[first].clone().lock_owned().await,
        };
        if slot.as_ref().is_none_or(|c| c.client.is_closed()) {
            *slot = None;
            let client = super::postgres::client(
                &self.settings.conninfo,
                self.settings.password.as_ref(),
                "bucketd query node".to_owned(),
            )
            .await
            .map_err(|e| ReadError::failed(format!("connecting to PostgreSQL: {e:#}")))?;
            let timeout = self.settings.statement_timeout.as_millis();
            client
                .batch_execute(&format!(
                    "SET default_transaction_read_only = on; SET statement_timeout = {timeout}; \
                     {CITUS_READS}"
                ))
                .await
                .map_err(failed)?;
            let buckets = client.prepare(BUCKETS).await.map_err(failed)?;
            let key = super::postgres::Key::of(&client).await.map_err(failed)?;
            *slot = Some(Conn {
                client,
                buckets,
                key,
            });
        }
        Ok(slot)
    }

    /// The series list. Read at the first query; after that, a list older than
    /// `series_refresh` is still answered with while one task reads it again behind it (with
    /// 64,000 series a read takes 0.7 s, which no query should wait for).
    async fn series_list(self: &Arc<Self>) -> Result<Arc<SeriesList>, ReadError> {
        let current = self.series.lock().expect("no panic holds it").clone();
        if let Some(list) = current {
            if list.at.elapsed() >= self.settings.series_refresh
                && let Ok(listing) = self.listing.clone().try_lock_owned()
            {
                let me = self.clone();
                tokio::spawn(async move {
                    let _listing = listing;
                    if let Err(e) = me.read_series().await {
                        tracing::warn!(error = %e, "Reading the fleet's series list failed; the last one is used.");
                    }
                });
            }
            return Ok(list);
        }
        let _listing = self.listing.lock().await;
        if let Some(list) = self.series.lock().expect("no panic holds it").clone() {
            return Ok(list);
        }
        self.read_series().await
    }

    /// Reads the series list from PostgreSQL and keeps it.
    async fn read_series(&self) -> Result<Arc<SeriesList>, ReadError> {
        let conn = self.conn().await?;
        let conn = conn.as_ref().expect("connected by conn()");
        let rows = list_series(conn, self.settings.max_series).await?;
        if rows.len() >= self.settings.max_series {
            tracing::warn!(
                max = self.settings.max_series,
                "The fleet's PostgreSQL holds more series than query_node.max_series: the node \
                 lists the first ones by name. Raise query_node.max_series."
            );
        }
        let mut names: Vec<String> = Vec::with_capacity(rows.len() * 2);
        let mut members: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for name in rows {
            if let Some((_, rest)) = name.split_once(':') {
                members
                    .entry(rest.to_owned())
                    .or_default()
                    .push(name.clone());
            }
            names.push(name);
        }
        names.extend(members.keys().map(|rest| format!("{FLEET_PREFIX}{rest}")));
        names.sort_unstable();
        let list = Arc::new(SeriesList {
            at: Instant::now(),
            names,
            members,
        });
        *self.series.lock().expect("no panic holds it") = Some(list.clone());
        Ok(list)
    }

    async fn read_buckets(
        self: &Arc<Self>,
        names: &[&str],
        from: i64,
        to: i64,
    ) -> Result<BTreeMap<String, Vec<BucketDoc>>, ReadError> {
        let mut out = BTreeMap::new();
        if from >= to || names.is_empty() {
            return Ok(out);
        }
        let fleet = names.iter().any(|n| n.starts_with(FLEET_PREFIX));
        let list = if fleet {
            Some(self.series_list().await?)
        } else {
            None
        };
        // The stored series to read, and which asked-for name each one feeds.
        let mut wanted: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for &name in names {
            match (name.strip_prefix(FLEET_PREFIX), &list) {
                (Some(rest), Some(list)) => {
                    for member in list.members.get(rest).into_iter().flatten() {
                        wanted.entry(member).or_default().push(name);
                    }
                }
                _ => wanted.entry(name).or_default().push(name),
            }
        }
        let keys: Vec<&str> = wanted.keys().copied().collect();
        // Each series' gateway (the part before its `:`), for the key and Citus's shards.
        let gateways: Vec<&str> = keys
            .iter()
            .map(|k| k.split_once(':').map_or("", |(g, _)| g))
            .collect();
        let max = self.settings.max_rows;
        let conn = self.conn().await?;
        let conn = conn.as_ref().expect("connected by conn()");
        let limit = i64::try_from(max).unwrap_or(i64::MAX).saturating_add(1);
        let rows = conn
            .client
            .query(
                &conn.buckets,
                &[
                    &keys,
                    &time(from),
                    &time(to),
                    &i32::try_from(self.settings.width_secs).unwrap_or(i32::MAX),
                    &limit,
                    &sketch_bytes_max(),
                    &gateways,
                ],
            )
            .await
            .map_err(failed)?;
        if rows.len() > max {
            return Err(ReadError::TooLarge(format!(
                "the query reads more than query_node.max_rows ({max}) buckets of the fleet; \
                 narrow the range or the series"
            )));
        }
        // Fleet-wide names: every member's bucket merged per start.
        let mut merged: BTreeMap<(&str, i64), Summary> = BTreeMap::new();
        for row in &rows {
            let (series, start, summary) = decode_row(row).map_err(|e| damaged(row, &wanted, e))?;
            for &name in wanted.get(series.as_str()).into_iter().flatten() {
                if name.starts_with(FLEET_PREFIX) {
                    match merged.entry((name, start)) {
                        std::collections::btree_map::Entry::Vacant(v) => {
                            v.insert(summary.clone());
                        }
                        std::collections::btree_map::Entry::Occupied(mut o) => {
                            o.get_mut().merge(&summary);
                            // Different gateways' counters: their readings would join as one
                            // counter's where one's came before the other's. Unknown; a fleet
                            // total is the sum of the gateways' increases.
                            o.get_mut().inc = None;
                        }
                    }
                } else {
                    let doc = BucketDoc::new(name, start, self.settings.width_secs, &summary);
                    out.entry(name.to_owned())
                        .or_insert_with(Vec::new)
                        .push(doc);
                }
            }
        }
        for ((name, start), summary) in merged {
            let doc = BucketDoc::new(name, start, self.settings.width_secs, &summary);
            out.entry(name.to_owned())
                .or_insert_with(Vec::new)
                .push(doc);
        }
        Ok(out)
    }
}

/// Every series name, at most `max`, sorted: per gateway on a table keyed by gateway, else over
/// the whole key, else (a server that refuses that) by scanning the table.
async fn list_series(conn: &Conn, max: usize) -> Result<Vec<String>, ReadError> {
    let client = &conn.client;
    let limit = |got: usize| i64::try_from(max.saturating_sub(got)).unwrap_or(i64::MAX);
    let mut names: Vec<String> = Vec::new();
    if conn.key == super::postgres::Key::Gateway {
        // Bounded as the list is: at most `max` gateways (each with a series or more, as a
        // gateway that applied a batch has).
        let gateways = client.query(GATEWAYS, &[&limit(0)]).await.map_err(failed)?;
        let each = client.prepare(GATEWAY_SERIES).await.map_err(failed)?;
        for gateway in gateways {
            let gateway: String = gateway.get(0);
            if names.len() >= max {
                break;
            }
            let rows = client
                .query(&each, &[&gateway, &limit(names.len())])
                .await
                .map_err(failed)?;
            names.extend(rows.iter().map(|r| r.get::<_, String>(0)));
        }
        names.sort_unstable();
        return Ok(names);
    }
    let rows = match client.query(SERIES, &[&limit(0)]).await {
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::FEATURE_NOT_SUPPORTED) => {
            tracing::warn!(
                error = %super::postgres::describe(&e),
                "The fleet's table is keyed (series, start) on a server that cannot skip-scan it \
                 (Citus): the series list scans every row. Re-key it \
                 (deploy/postgres/migrate-gateway-key.sql) and distribute it by gateway_id \
                 (deploy/postgres/citus.sql)."
            );
            client
                .query(SERIES_SCAN, &[&limit(0)])
                .await
                .map_err(failed)?
        }
        rows => rows.map_err(failed)?,
    };
    names.extend(rows.iter().map(|r| r.get::<_, String>(0)));
    Ok(names)
}

/// `secs` since the epoch as PostgreSQL's `timestamptz`, clamped to about 30,000 years either
/// way (within the 4713 BC to 294276 AD it holds): a client's far time must neither overflow
/// the microseconds tokio-postgres computes nor be refused by the server.
fn time(secs: i64) -> SystemTime {
    const FAR: i64 = 1_000_000_000_000;
    let secs = secs.clamp(-FAR, FAR);
    if secs >= 0 {
        UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
    }
}

/// The most bytes of a row's sketch the query node reads: a sketch at the largest bin bound
/// a gateway's config may have (`limits::SKETCH_MAX_BINS`).
fn sketch_bytes_max() -> i32 {
    let bins = *crate::limits::SKETCH_MAX_BINS.end();
    i32::try_from(Sketch::encoded_len_max(bins)).unwrap_or(i32::MAX)
}

/// A row that [`decode_row`] refused, as the damage of the first asked-for name it feeds (a
/// gateway's series, or the fleet-wide one it is part of): the query is answered without that
/// name (`source::buckets_around`) rather than failed for every series (issue 52: one forged
/// row of a compromised gateway made every fleet-wide query a 500).
fn damaged(
    row: &tokio_postgres::Row,
    wanted: &BTreeMap<&str, Vec<&str>>,
    e: ReadError,
) -> ReadError {
    let feeds = row
        .try_get::<_, String>(0)
        .ok()
        .and_then(|series| wanted.get(series.as_str())?.first().copied());
    match (feeds, e) {
        (Some(name), ReadError::Failed(cause)) => ReadError::Damaged {
            series: name.to_owned(),
            cause,
        },
        (_, e) => e,
    }
}

/// A row of [`BUCKETS`] as its series, start (seconds) and summary. A row no bucketd wrote
/// (a negative count, a sketch that does not decode) is an error, not a guess.
fn decode_row(row: &tokio_postgres::Row) -> Result<(String, i64, Summary), ReadError> {
    let series: String = row.get(0);
    let start: SystemTime = row.get(1);
    let start = match start.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()),
        Err(e) => i64::try_from(e.duration().as_secs()).map(|s| -s),
    }
    .map_err(ReadError::failed)?;
    let count: i64 = row.get(2);
    let corrupt = |what: &str| ReadError::failed(format!("the row of {series} at {start}: {what}"));
    let count = u64::try_from(count).map_err(|_| corrupt("negative count"))?;
    let sketch: Option<&[u8]> = row.get(13);
    let sketch = sketch.ok_or_else(|| corrupt("a sketch larger than any bucketd writes"))?;
    let sketch =
        Sketch::decode_untrusted(sketch).ok_or_else(|| corrupt("the sketch does not decode"))?;
    let summary = Summary {
        count,
        sum: row.get(3),
        sum_comp: row.get(4),
        min: row.get(5),
        max: row.get(6),
        first: Point {
            ts: row.get(7),
            value: row.get(8),
        },
        last: Point {
            ts: row.get(9),
            value: row.get(10),
        },
        mean: row.get(11),
        m2: row.get(12),
        sketch,
        // Known while every delta of the row carried it (`schema.sql`).
        inc: row.get::<_, Option<f64>>(14).filter(|i| i.is_finite()),
    };
    Ok((series, start, summary))
}

impl BucketSource for FleetReader {
    fn series(&self) -> Result<Vec<String>, ReadError> {
        self.0
            .runtime
            .block_on(self.0.series_list())
            .map(|l| l.names.clone())
    }

    fn has_series(&self, series: &str) -> Result<bool, ReadError> {
        let list = self.0.runtime.block_on(self.0.series_list())?;
        Ok(list
            .names
            .binary_search_by(|n| n.as_str().cmp(series))
            .is_ok())
    }

    fn buckets_of(
        &self,
        names: &[&str],
        from: i64,
        to: i64,
    ) -> Result<BTreeMap<String, Vec<BucketDoc>>, ReadError> {
        self.0
            .runtime
            .block_on(self.0.read_buckets(names, from, to))
    }

    fn raw(
        &self,
        _series: &str,
        _from: i64,
        _to: i64,
        _visit: &mut crate::source::Visit<'_>,
    ) -> Result<(), ReadError> {
        Err(ReadError::NotHere(
            "raw readings stay on the gateways (their /api/v1/raw); the fleet's PostgreSQL \
             holds buckets only",
        ))
    }

    fn fleet(&self) -> bool {
        true
    }

    fn reachable(&self) -> Option<bool> {
        let ping = async {
            let conn = self.0.conn().await.ok()?;
            let client = &conn.as_ref()?.client;
            client.simple_query("SELECT 1").await.ok()
        };
        let answered = self
            .0
            .runtime
            .block_on(async { tokio::time::timeout(Duration::from_secs(2), ping).await });
        Some(matches!(answered, Ok(Some(_))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The far times a query can ask for stay within what tokio-postgres can encode
    /// (microseconds since 2000 in an i64).
    #[test]
    fn far_times_are_clamped_to_what_postgresql_holds() {
        for secs in [
            i64::MIN,
            i64::MIN / 2,
            -1,
            0,
            1_764_547_200,
            i64::MAX / 2,
            i64::MAX,
        ] {
            let t = time(secs);
            let micros = match t.duration_since(UNIX_EPOCH) {
                Ok(d) => d.as_micros(),
                Err(e) => e.duration().as_micros(),
            };
            assert!(micros < i64::MAX as u128 / 2, "{secs}: {micros}");
        }
        let now = time(1_764_547_200).duration_since(UNIX_EPOCH).unwrap();
        assert_eq!(now.as_secs(), 1_764_547_200, "a real time is kept as it is");
    }
}
