//! What the query surface (`http`, `prom`) reads, as a trait: the daemon's own redb file
//! ([`StoreReader`]), or a store the fleet tier attaches (the query node over PostgreSQL,
//! `fleet::reader`). Calls block: the HTTP layer makes them on the blocking pool.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::doc::BucketDoc;
use crate::store::StoreReader;

/// Why a read failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The store could not be read; the details are for the log, not the client.
    #[error("{0}")]
    Failed(Box<dyn std::error::Error + Send + Sync>),
    /// This source does not hold what was asked (raw readings on a query node); the text says
    /// where they are.
    #[error("{0}")]
    NotHere(&'static str),
    /// The query would read more than the source's bound; the text says what to narrow.
    #[error("{0}")]
    TooLarge(String),
    /// One series could not be read (a damaged document on the disk, a row in the fleet's
    /// PostgreSQL no bucketd wrote): the others can be, without it ([`buckets_around`]). The
    /// cause is for the log.
    #[error("series {series} could not be read: {cause}")]
    Damaged {
        series: String,
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// What a client is told of a series that could not be read (`detail`: where the log has the
/// cause).
pub fn damaged_message(series: &str, detail: &str) -> String {
    format!(
        "series {series} could not be read ({detail}); queries of other series are answered. \
         On a gateway or a central a document of it is damaged on the disk: `bucketd export`, \
         with bucketd stopped, writes every series it can read and names the others. On a query \
         node a row of it in PostgreSQL is not one a bucketd wrote: the log names the row"
    )
}

/// The series a query left out because they could not be read, named in its answer.
pub type Unreadable = std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>;

/// [`BucketSource::buckets_of`] around damaged series: each series whose documents cannot be
/// read is left out and added to `unreadable`, and the rest read again, so that one damaged
/// series takes only itself out of an answer (issue 51). Any other error is returned.
pub fn buckets_around(
    source: &dyn BucketSource,
    names: &[&str],
    from: i64,
    to: i64,
    unreadable: &Unreadable,
) -> Result<BTreeMap<String, Vec<BucketDoc>>, ReadError> {
    let mut left_out = unreadable
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    loop {
        let wanted: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| !left_out.contains(*n))
            .collect();
        match source.buckets_of(&wanted, from, to) {
            // Each round leaves out one more of `names`: at most `names.len()` rounds.
            Err(ReadError::Damaged { series, cause })
                if wanted.contains(&series.as_str()) && !left_out.contains(&series) =>
            {
                tracing::error!(
                    series = %series, error = %cause,
                    "A series could not be read and was left out of a query's answer: a damaged \
                     document on the disk (stop bucketd and run `bucketd export` to read every \
                     other series), or at a query node a row no bucketd wrote."
                );
                left_out.insert(series.clone());
                unreadable
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(series);
            }
            other => return other,
        }
    }
}

impl ReadError {
    pub fn failed(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> ReadError {
        ReadError::Failed(e.into())
    }
}

/// The buckets (and, where kept, raw readings) that queries read. Series are named as the
/// source stores them (`sensor/metric` on a gateway, `<gateway>:<sensor>/<metric>` at a central
/// or in the fleet's PostgreSQL).
pub trait BucketSource: Send + Sync {
    /// Every series name, sorted.
    fn series(&self) -> Result<Vec<String>, ReadError>;

    /// Whether `series` is stored.
    fn has_series(&self, series: &str) -> Result<bool, ReadError>;

    /// The buckets of each of `names` with `from <= start < to` (seconds), in time order;
    /// names not stored are left out.
    fn buckets_of(
        &self,
        names: &[&str],
        from: i64,
        to: i64,
    ) -> Result<BTreeMap<String, Vec<BucketDoc>>, ReadError>;

    /// The buckets of `series` with `from <= start < to` (seconds), in time order.
    fn buckets(&self, series: &str, from: i64, to: i64) -> Result<Vec<BucketDoc>, ReadError> {
        Ok(self
            .buckets_of(&[series], from, to)?
            .remove(series)
            .unwrap_or_default())
    }

    /// Raw readings of `series` with `from <= ts < to` (ns), in timestamp order, a bucket at a
    /// time; `visit` returns `false` to stop. Sources without raw readings say where they are.
    fn raw(&self, series: &str, from: i64, to: i64, visit: &mut Visit<'_>)
    -> Result<(), ReadError>;

    /// Whether its series are a fleet's (a query node's): named `<gateway>:<sensor>/<metric>`,
    /// and `*:<sensor>/<metric>` for the fleet-wide merge of every gateway's.
    fn fleet(&self) -> bool {
        false
    }

    /// Whether the source can answer now, for `/readyz`: `None` where readiness is the
    /// daemon's (its broker and store), `Some` for a source of its own (a query node's
    /// PostgreSQL).
    fn reachable(&self) -> Option<bool> {
        None
    }
}

/// What [`BucketSource::raw`] calls with each bucket's readings (timestamp ns, value);
/// `false` stops the read.
pub type Visit<'a> = dyn FnMut(&[(i64, f64)]) -> bool + 'a;

/// A source shared by the HTTP handlers.
pub type Source = Arc<dyn BucketSource>;

impl BucketSource for StoreReader {
    fn series(&self) -> Result<Vec<String>, ReadError> {
        StoreReader::series(self).map_err(ReadError::failed)
    }

    fn has_series(&self, series: &str) -> Result<bool, ReadError> {
        StoreReader::has_series(self, series).map_err(ReadError::failed)
    }

    fn buckets_of(
        &self,
        names: &[&str],
        from: i64,
        to: i64,
    ) -> Result<BTreeMap<String, Vec<BucketDoc>>, ReadError> {
        StoreReader::buckets_of(self, names, from, to).map_err(|e| {
            // Which series it was, if some alone fail and others do not (read only when the
            // whole read failed). When every one fails, the damage is not one series' (a
            // commit log record, say): the read failed.
            let mut failing = None;
            let mut readable = false;
            for name in names {
                match StoreReader::buckets(self, Some(name), from, to) {
                    Err(alone) if failing.is_none() => failing = Some((name, alone)),
                    Err(_) => {}
                    Ok(_) => readable = true,
                }
                if readable && failing.is_some() {
                    break;
                }
            }
            match failing {
                Some((name, alone)) if readable || names.len() == 1 => damaged(name, alone),
                _ => ReadError::failed(e),
            }
        })
    }

    fn buckets(&self, series: &str, from: i64, to: i64) -> Result<Vec<BucketDoc>, ReadError> {
        StoreReader::buckets(self, Some(series), from, to).map_err(|e| damaged(series, e))
    }

    fn raw(
        &self,
        series: &str,
        from: i64,
        to: i64,
        visit: &mut Visit<'_>,
    ) -> Result<(), ReadError> {
        StoreReader::raw(self, Some(series), from, to, |_, readings| visit(readings))
            .map_err(|e| damaged(series, e))
    }
}

/// A read of one series that failed: damage to its documents, unless the file itself failed.
fn damaged(series: &str, e: redb::Error) -> ReadError {
    match e {
        redb::Error::Corrupted(_) => ReadError::Damaged {
            series: series.to_owned(),
            cause: e.into(),
        },
        e => ReadError::failed(e),
    }
}

/// A request extension (set by the HTTP layer's query turn, `http::take_turn`): set when the
/// request's client has gone, so that a query no one waits for stops (issue 53).
#[derive(Clone, Debug, Default)]
pub struct Hangup(pub Arc<std::sync::atomic::AtomicBool>);

impl Hangup {
    /// Sets the flag when dropped: held by the part of the request that the server drops when
    /// the client hangs up.
    pub fn on_drop(&self) -> impl Drop + Send + use<> {
        struct SetOnDrop(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for SetOnDrop {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        SetOnDrop(self.0.clone())
    }
}
