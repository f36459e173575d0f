//! The commits the journal holds and redb does not yet: each commit's record, fingerprints, new
//! series and gateway positions, kept in memory until a checkpoint folds them into the bucket
//! documents and raw pages ([`super::log`]). A commit then writes the card once (its journal
//! record) instead of twice (the record, and redb's copy-on-write pages of the `log` table as
//! well); readers merge these commits like the `log` table's ([`Snapshot`]).
//!
//! Bounded by the journal: a commit goes here only when its record is in the journal, and a
//! journal three quarters full is folded (`writer`). Reopening the file empties it: the journal's
//! replay puts the same commits into the `log` table.
//!
//! Beside them, the readers' index of every waiting record ([`crate::commitlog::RecordIndex`],
//! about 30% of its bytes): of each pending commit, and of each record in the `log` table
//! ([`Logged`], as many as a checkpoint leaves there), so that a read of some series decodes
//! only their entries (issue 53).

use std::sync::{Arc, RwLock};

use crate::commitlog::RecordIndex;

/// One journaled commit not yet in redb.
#[derive(Debug)]
pub(super) struct PendingCommit {
    pub seq: u64,
    /// The [`crate::commitlog`] record.
    pub record: Vec<u8>,
    /// The fingerprints, as the `dedup` table keeps them ([`crate::dedup::encode`]).
    pub fingerprints: Vec<u8>,
    /// Series first seen in this commit: (id, name).
    pub series: Vec<(u64, Arc<str>)>,
    /// Gateways' applied positions: (key, [`crate::delta::Position::encode`]).
    pub applied: Vec<(String, Vec<u8>)>,
    /// Where each series' entries are in `record` (`None`: read it whole).
    pub index: Option<RecordIndex>,
}

impl PendingCommit {
    /// Commit `seq`, its record indexed, and its fingerprints.
    pub(super) fn new(seq: u64, record: Vec<u8>, fingerprints: Vec<u8>) -> PendingCommit {
        PendingCommit {
            seq,
            index: RecordIndex::of(&record).ok(),
            record,
            fingerprints,
            series: Vec::new(),
            applied: Vec::new(),
        }
    }

    /// With the series it adds and the gateway positions it applies.
    pub(super) fn with(
        self,
        series: Vec<(u64, Arc<str>)>,
        applied: Vec<(String, Vec<u8>)>,
    ) -> PendingCommit {
        PendingCommit {
            series,
            applied,
            ..self
        }
    }

    /// Calls `visit` with the record's entries of `ids` (sorted; every entry when `None`).
    pub(super) fn visit(
        &self,
        ids: Option<&[u64]>,
        visit: impl FnMut(u64, &crate::commitlog::Entry<'_>) -> Result<(), redb::Error>,
    ) -> Result<(), redb::Error> {
        super::log::visit_indexed(self.seq, &self.record, self.index.as_ref(), ids, visit)
    }
}

/// A `log` table record's commit number and index (`None`: read it whole).
pub(super) type LoggedIndex = (u64, Option<Arc<RecordIndex>>);

/// The `log` table's records the readers know the index of, oldest first. Records committed
/// after a reader's copy was taken are read whole.
pub(super) type Logged = Arc<Vec<LoggedIndex>>;

/// What waits to be folded, as the readers see it: the pending commits and the indexes of the
/// `log` table's records.
#[derive(Debug, Clone, Default)]
pub(super) struct Waiting {
    commits: Arc<Vec<Arc<PendingCommit>>>,
    logged: Logged,
}

/// The pending commits, oldest first, shared with the readers: a commit appends (copying the
/// list of pointers only while a reader holds the old one), a checkpoint takes from the front.
pub(super) type SharedPending = Arc<RwLock<Waiting>>;

/// What a reader merges: the pending commits it took before its read transaction began. Those
/// a checkpoint folded meanwhile (at or below the transaction's last `dedup` key, which every
/// fold writes) are in the transaction already and are skipped ([`Snapshot::after`]).
#[derive(Debug, Clone, Default)]
pub(super) struct Snapshot {
    waiting: Waiting,
}

impl Snapshot {
    pub(super) fn take(shared: &SharedPending) -> Snapshot {
        Snapshot {
            waiting: shared
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        }
    }

    /// The indexes of the `log` table's records when the snapshot was taken.
    pub(super) fn logged(&self) -> &[LoggedIndex] {
        &self.waiting.logged
    }

    /// The newest commit's number, if any.
    pub(super) fn last_seq(&self) -> Option<u64> {
        self.waiting.commits.last().map(|c| c.seq)
    }

    /// The commits after `folded_through` (none when `None`: nothing folded), oldest first.
    pub(super) fn after(
        &self,
        folded_through: Option<u64>,
    ) -> impl Iterator<Item = &PendingCommit> {
        self.waiting
            .commits
            .iter()
            .filter(move |c| folded_through.is_none_or(|f| c.seq > f))
            .map(|c| &**c)
    }
}

/// Appends `commit` to the shared list.
pub(super) fn push(shared: &SharedPending, commit: PendingCommit) {
    let mut waiting = write(shared);
    Arc::make_mut(&mut waiting.commits).push(Arc::new(commit));
}

/// Adds the index of the `log` table's record `seq`, once it is committed (records are
/// committed, and so indexed, in commit order).
pub(super) fn push_logged(shared: &SharedPending, seq: u64, record: &[u8]) {
    let index = RecordIndex::of(record).ok().map(Arc::new);
    let mut waiting = write(shared);
    Arc::make_mut(&mut waiting.logged).push((seq, index));
}

/// Sets the indexes of the `log` table's records (at open, after the journal's replay).
pub(super) fn set_logged(shared: &SharedPending, logged: Vec<LoggedIndex>) {
    write(shared).logged = Arc::new(logged);
}

/// Removes the commits up to `seq` and the indexes of the `log` records up to it (folded, and
/// in redb's documents now), once the transaction that folded them is committed.
pub(super) fn drop_through(shared: &SharedPending, seq: u64) {
    let mut waiting = write(shared);
    if waiting.commits.first().is_some_and(|c| c.seq <= seq) {
        Arc::make_mut(&mut waiting.commits).retain(|c| c.seq > seq);
    }
    if waiting.logged.first().is_some_and(|l| l.0 <= seq) {
        Arc::make_mut(&mut waiting.logged).retain(|l| l.0 > seq);
    }
}

/// Empties the list (the journal's replay brings the same commits back in the `log` table).
pub(super) fn clear(shared: &SharedPending) {
    *write(shared) = Waiting::default();
}

/// The commits in the list now (for the writer, which alone changes it).
pub(super) fn now(shared: &SharedPending) -> Arc<Vec<Arc<PendingCommit>>> {
    shared
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .commits
        .clone()
}

fn write(shared: &SharedPending) -> std::sync::RwLockWriteGuard<'_, Waiting> {
    shared
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
