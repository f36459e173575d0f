//! The outbox: what every commit changed, kept for the upstream forwarder (`fleet::forwarder`).
//!
//! Table `outbox`: entry sequence number -> BSON [`OutboxDoc`], the per-bucket deltas of a
//! commit (each a [`BucketDoc`] holding only the readings the commit added). Written in the same
//! transaction as the buckets, so a delta exists exactly when its readings do. Sequence numbers
//! only grow, one by one: the next entry is numbered one above the newest (the first of a file,
//! by its commit's sequence number; files of earlier releases numbered entries by commit, so their
//! older entries may have gaps). A commit trims acknowledged entries and writes its own in one
//! transaction, so the table is never empty once written, and the numbering survives restarts. A central refuses a position further
//! past the last one it applied than an outbox can hold (`central.max_position_jump`). A late
//! reading for an old hour is a delta for that hour like any other.
//!
//! Bounded by `upstream.outbox_max_entries`: at the bound, a commit's deltas are merged into
//! the newest entry instead of a new one (summaries are mergeable) while that keeps it to at
//! most [`MERGE_BUCKETS_MAX`] buckets (else the commit starts an entry: an outage adds one per
//! 256 buckets it brings, and no commit rewrites more than one such entry), unless that entry
//! may have been shipped: its sequence number then names content the upstream may already hold, and
//! merging into it would lose (PostgreSQL skips a sequence number it applied) or double (a
//! copy with other bytes) what it held. So a commit at the bound takes [`OutboxShared`]'s gate
//! until it has committed, and the forwarder reads and marks what it ships under the same gate
//! ([`OutboxShared::read_for_shipping`]); entries found at open count as shipped (an earlier
//! process may have sent them). The outbox then exceeds its bound by one entry per such
//! change of hands. The entries shrink only when the upstream has acknowledged them:
//! [`OutboxShared::acked_below`], trimmed by the next commit (no write transaction of its own,
//! no extra SD-card writes).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};

use super::{BucketDoc, CommitError};
use crate::batcher::Batch;

pub(super) const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("outbox");

/// One outbox entry: the deltas of one commit (or of several, merged at the bound).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutboxDoc {
    pub seq: i64,
    /// When the (first) commit of this entry happened, nanoseconds since the Unix epoch.
    pub created_ns: i64,
    pub buckets: Vec<BucketDoc>,
}

impl OutboxDoc {
    pub fn decode(bytes: &[u8]) -> Result<OutboxDoc, bson::error::Error> {
        bson::deserialize_from_slice(bytes)
    }

    fn encode(&self) -> Vec<u8> {
        bson::serialize_to_vec(self).expect("an OutboxDoc has only BSON-representable fields")
    }

    /// Readings the entry represents.
    pub fn readings(&self) -> u64 {
        self.buckets.iter().map(|b| b.count as u64).sum()
    }
}

/// Shared between the store (writer thread) and the forwarder.
#[derive(Debug, Default)]
pub struct OutboxShared {
    /// Every entry below this sequence number is applied upstream: trim them.
    pub acked_below: AtomicU64,
    /// Entries below this sequence number may have been shipped: do not merge into them.
    sending_below: AtomicU64,
    /// Orders an at-bound commit's choice of entry (through its commit) against
    /// [`OutboxShared::read_for_shipping`].
    gate: Mutex<()>,
    /// Entries in the table (as of the last commit), and the newest entry's sequence number.
    pub entries: AtomicU64,
    pub newest_seq: AtomicU64,
    /// Creation time of the oldest entry not yet acknowledged (ns since the epoch; 0: none).
    pub oldest_ns: AtomicI64,
}

impl OutboxShared {
    /// Records that the upstream has applied every entry up to `seq`.
    pub fn ack(&self, seq: u64) {
        self.acked_below.fetch_max(seq + 1, Ordering::Relaxed);
    }

    /// For the forwarder: reads entries to ship with `read` and marks them shipped, both under
    /// the gate, so that no commit merges into an entry once it may have been read. Only what
    /// was read is marked: a forwarder retrying through an outage keeps marking its first batch,
    /// and the commits at the bound go on merging into the newest entry.
    pub fn read_for_shipping<E>(
        &self,
        read: impl FnOnce() -> Result<Vec<OutboxDoc>, E>,
    ) -> Result<Vec<OutboxDoc>, E> {
        let _gate = self
            .gate
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entries = read()?;
        if let Some(last) = entries.last() {
            let seq = u64::try_from(last.seq).expect("sequence numbers are not negative");
            self.sending_below.fetch_max(seq + 1, Ordering::Relaxed);
        }
        Ok(entries)
    }
}

/// What a commit writes to the outbox ([`super::journal::OutboxRedo`] borrows it).
#[derive(Debug)]
pub(super) struct OutboxWrite {
    /// Entries below this key are acknowledged upstream: removed.
    pub trim_below: u64,
    /// The entry written: this commit's, or the newest one with this commit merged in.
    pub key: u64,
    pub doc: Vec<u8>,
}

/// In the commit's transaction: trims acknowledged entries, then decides where `batch`'s
/// deltas go (an entry under `seq`, or merged into the newest entry at the bound) and encodes
/// it; [`super::apply_redo`] writes it. Hold the returned guard until the transaction has
/// committed (or failed).
pub(super) fn plan<'a>(
    tx: &redb::WriteTransaction,
    shared: &'a OutboxShared,
    max_entries: usize,
    seq: u64,
    batch: &Batch,
    width_secs: i64,
) -> Result<(OutboxWrite, Option<MutexGuard<'a, ()>>), CommitError> {
    let mut table = tx.open_table(OUTBOX)?;
    // Entries are numbered one after another (not by commit): a central can then tell that a
    // position far past the last it applied could not have come from this outbox. Read before
    // the trim, which may take every entry.
    let next_key = table.last()?.map_or(seq, |(k, _)| k.value() + 1);
    let acked_below = shared.acked_below.load(Ordering::Relaxed);
    if acked_below > 0 {
        table.retain_in(..acked_below, |_, _| false)?;
    }
    let deltas = batch
        .buckets
        .iter()
        .map(|((series, start), delta)| BucketDoc::new(series, *start, width_secs, delta));
    // Only at the bound is the newest entry read (and copied): it may be large.
    let gate = (table.len()? as usize >= max_entries).then(|| {
        shared
            .gate
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    });
    let merge_into = if gate.is_some() {
        table
            .last()?
            .map(|(k, v)| (k.value(), v.value().to_vec()))
            .filter(|(k, _)| *k >= shared.sending_below.load(Ordering::Relaxed))
    } else {
        None
    };
    let deltas: Vec<BucketDoc> = deltas.collect();
    let merged = match merge_into {
        Some((key, bytes)) => {
            let doc = OutboxDoc::decode(&bytes)
                .map_err(|source| CommitError::Outbox { seq: key, source })?;
            merged(doc, &deltas)
        }
        None => None,
    };
    let doc = merged.unwrap_or_else(|| OutboxDoc {
        seq: i64::try_from(next_key).expect("fewer than 2^63 entries"),
        created_ns: crate::reading::Timestamp::now().as_nanos(),
        buckets: deltas,
    });
    let key = u64::try_from(doc.seq).expect("sequence numbers are not negative");
    let write = OutboxWrite {
        trim_below: acked_below,
        key,
        doc: doc.encode(),
    };
    Ok((write, gate))
}

/// Most buckets an entry holds by merging at the bound: what one commit at the bound rewrites
/// (about 80 KiB of documents with sketches), however long the upstream has been away.
pub const MERGE_BUCKETS_MAX: usize = 256;

/// `doc` (the newest entry) with `deltas` merged in, if that keeps it to at most
/// [`MERGE_BUCKETS_MAX`] buckets (or adds none). `None`: the commit starts an entry of its own.
/// An entry merged into again and again for a whole outage grew with every new hour and
/// series, and each commit rewrote all of it (issue 52: 28.5 MB per commit within a minute);
/// now an outage adds an entry per 256 buckets it brings (about one per bucket width at 256
/// series), and a commit rewrites at most one such entry.
fn merged(mut doc: OutboxDoc, deltas: &[BucketDoc]) -> Option<OutboxDoc> {
    let mut merged: BTreeMap<(String, i64), BucketDoc> = doc
        .buckets
        .drain(..)
        .map(|b| ((b.series.clone(), b.start), b))
        .collect();
    for d in deltas {
        let key = (d.series.clone(), d.start);
        if let Some(have) = merged.get_mut(&key) {
            let mut s = have.summary();
            s.merge(&d.summary());
            *have = have.clone().with_summary(&s);
        } else if merged.len() >= MERGE_BUCKETS_MAX {
            return None;
        } else {
            merged.insert(key, d.clone());
        }
    }
    doc.buckets = merged.into_values().collect();
    Some(doc)
}

/// After a commit's outbox write, in its transaction: the table's size, newest key and oldest
/// entry's time, into `shared`.
pub(super) fn note(
    tx: &redb::WriteTransaction,
    shared: &OutboxShared,
    key: u64,
) -> Result<(), CommitError> {
    let table = tx.open_table(OUTBOX)?;
    shared.entries.store(table.len()?, Ordering::Relaxed);
    shared.newest_seq.store(key, Ordering::Relaxed);
    let oldest = table.first()?.map_or(0, |(_, v)| created_ns(v.value()));
    shared.oldest_ns.store(oldest, Ordering::Relaxed);
    Ok(())
}

/// An entry's `created_ns`, read without decoding its buckets (0 if unreadable).
fn created_ns(entry: &[u8]) -> i64 {
    bson::RawDocument::from_bytes(entry)
        .ok()
        .and_then(|d| d.get_i64("created_ns").ok())
        .unwrap_or(0)
}

/// Up to `max` entries with a sequence number above `after` (all with `None`), oldest first.
pub(super) fn read(
    tx: &redb::ReadTransaction,
    after: Option<u64>,
    max: usize,
) -> Result<Vec<OutboxDoc>, redb::Error> {
    let table = match tx.open_table(OUTBOX) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut out = Vec::new();
    let from = after.map_or(0, |a| a.saturating_add(1));
    for entry in table.range(from..)?.take(max) {
        let (key, value) = entry?;
        let doc = OutboxDoc::decode(value.value()).map_err(|e| {
            redb::Error::Corrupted(format!("outbox entry {} is unreadable: {e}", key.value()))
        })?;
        out.push(doc);
    }
    Ok(out)
}

/// At open: the table's size, newest key and oldest entry's time, into `shared`.
pub(super) fn load(db: &redb::Database, shared: &OutboxShared) -> Result<(), redb::Error> {
    let tx = db.begin_read()?;
    let table = match tx.open_table(OUTBOX) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    shared.entries.store(table.len()?, Ordering::Relaxed);
    if let Some((k, _)) = table.last()? {
        shared.newest_seq.store(k.value(), Ordering::Relaxed);
        // An earlier process may have shipped any of them.
        shared.sending_below.store(k.value() + 1, Ordering::Relaxed);
    }
    let oldest = table.first()?.map_or(0, |(_, v)| created_ns(v.value()));
    shared.oldest_ns.store(oldest, Ordering::Relaxed);
    Ok(())
}
