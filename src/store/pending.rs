//! The commits the journal holds and redb does not yet: each commit's record, fingerprints, new
//! series and gateway positions, kept in memory until a checkpoint folds them into the bucket
//! documents and raw pages ([`super::log`]). A commit then writes the card once (its journal
//! record) instead of twice (the record, and redb's copy-on-write pages of the `log` table as
//! well); readers merge these commits like the `log` table's ([`Snapshot`]).
//!
//! Bounded by the journal: a commit goes here only when its record is in the journal, and a
//! journal three quarters full is folded (`writer`). Reopening the file empties it: the journal's
//! replay puts the same commits into the `log` table.

use std::sync::{Arc, RwLock};

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
}

/// The pending commits, oldest first, shared with the readers: a commit appends (copying the
/// list of pointers only while a reader holds the old one), a checkpoint takes from the front.
pub(super) type SharedPending = Arc<RwLock<Arc<Vec<Arc<PendingCommit>>>>>;

/// What a reader merges: the pending commits it took before its read transaction began. Those
/// a checkpoint folded meanwhile (at or below the transaction's last `dedup` key, which every
/// fold writes) are in the transaction already and are skipped ([`Snapshot::after`]).
#[derive(Debug, Clone, Default)]
pub(super) struct Snapshot {
    commits: Arc<Vec<Arc<PendingCommit>>>,
}

impl Snapshot {
    pub(super) fn take(shared: &SharedPending) -> Snapshot {
        Snapshot {
            commits: shared
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        }
    }

    /// The newest commit's number, if any.
    pub(super) fn last_seq(&self) -> Option<u64> {
        self.commits.last().map(|c| c.seq)
    }

    /// The commits after `folded_through` (none when `None`: nothing folded), oldest first.
    pub(super) fn after(
        &self,
        folded_through: Option<u64>,
    ) -> impl Iterator<Item = &PendingCommit> {
        self.commits
            .iter()
            .filter(move |c| folded_through.is_none_or(|f| c.seq > f))
            .map(|c| &**c)
    }
}

/// Appends `commit` to the shared list.
pub(super) fn push(shared: &SharedPending, commit: PendingCommit) {
    let mut list = shared
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    Arc::make_mut(&mut list).push(Arc::new(commit));
}

/// Removes the commits up to `seq` (folded, and in redb now).
pub(super) fn drop_through(shared: &SharedPending, seq: u64) {
    let mut list = shared
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if list.first().is_some_and(|c| c.seq <= seq) {
        Arc::make_mut(&mut list).retain(|c| c.seq > seq);
    }
}

/// Empties the list (the journal's replay brings the same commits back in the `log` table).
pub(super) fn clear(shared: &SharedPending) {
    *shared
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(Vec::new());
}

/// The commits in the list now (for the writer, which alone changes it).
pub(super) fn now(shared: &SharedPending) -> Arc<Vec<Arc<PendingCommit>>> {
    shared
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}
