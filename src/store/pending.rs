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
//! only their entries.

use std::sync::{Arc, RwLock};

use super::merged::{Run, Runs};
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
        super::records::visit_indexed(self.seq, &self.record, self.index.as_ref(), ids, visit)
    }
}

/// A `log` table record's commit number and index (`None`: read it whole).
pub(super) type LoggedIndex = (u64, Option<Arc<RecordIndex>>);

/// The `log` table's records the readers know the index of, oldest first. Records committed
/// after a reader's copy was taken are read whole.
pub(super) type Logged = Arc<Vec<LoggedIndex>>;

/// What waits to be folded, as the readers see it: the pending commits, the indexes of the
/// `log` table's records, and the deltas of both merged per bucket ([`super::merged`]).
#[derive(Debug, Clone, Default)]
pub(super) struct Waiting {
    commits: Arc<Vec<Arc<PendingCommit>>>,
    logged: Logged,
    runs: Arc<Runs>,
    /// The pending commits' new series, both ways (a reader looks a name up once a bucket).
    names: Arc<Names>,
}

/// Series first seen in pending commits: by name and by id.
#[derive(Debug, Clone, Default)]
struct Names {
    ids: std::collections::HashMap<Arc<str>, u64>,
    names: std::collections::HashMap<u64, Arc<str>>,
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

    /// The runs of every waiting commit (pending and in the `log` table), oldest first.
    pub(super) fn runs(&self) -> &[Arc<Run>] {
        self.waiting.runs.all()
    }

    /// The id of `name`, a series a pending commit adds.
    pub(super) fn id_of(&self, name: &str) -> Option<u64> {
        self.waiting.names.ids.get(name).copied()
    }

    /// The name of series `id`, one a pending commit adds.
    pub(super) fn name_of(&self, id: u64) -> Option<&Arc<str>> {
        self.waiting.names.names.get(&id)
    }

    /// Whether commit `seq` is one of the pending commits.
    pub(super) fn is_pending(&self, seq: u64) -> bool {
        self.waiting
            .commits
            .binary_search_by_key(&seq, |c| c.seq)
            .is_ok()
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
    Arc::make_mut(&mut waiting.runs).add(commit.seq, &commit.record);
    if !commit.series.is_empty() {
        let names = Arc::make_mut(&mut waiting.names);
        for (id, name) in &commit.series {
            names.ids.insert(name.clone(), *id);
            names.names.insert(*id, name.clone());
        }
    }
    Arc::make_mut(&mut waiting.commits).push(Arc::new(commit));
}

/// Adds the index of the `log` table's record `seq`, once it is committed (records are
/// committed, and so indexed, in commit order).
pub(super) fn push_logged(shared: &SharedPending, seq: u64, record: &[u8]) {
    let index = RecordIndex::of(record).ok().map(Arc::new);
    let mut waiting = write(shared);
    Arc::make_mut(&mut waiting.runs).add(seq, record);
    Arc::make_mut(&mut waiting.logged).push((seq, index));
}

/// Sets the indexes of the `log` table's records and the runs of every waiting commit (at
/// open, after the journal's replay, and when the file is read again after a write error).
pub(super) fn set_logged(shared: &SharedPending, logged: Vec<LoggedIndex>, runs: Runs) {
    let mut waiting = write(shared);
    waiting.logged = Arc::new(logged);
    waiting.runs = Arc::new(runs);
}

/// Closes the open run: a checkpoint of every commit so far begins ([`super::merged`]).
pub(super) fn close_run(shared: &SharedPending) {
    Arc::make_mut(&mut write(shared).runs).close();
}

/// Removes the commits up to `seq` and the indexes of the `log` records up to it (folded, and
/// in redb's documents now), once the transaction that folded them is committed.
pub(super) fn drop_through(shared: &SharedPending, seq: u64) {
    let mut waiting = drop_commits_through(shared, seq);
    Arc::make_mut(&mut waiting.runs).drop_through(seq);
}

/// [`drop_through`], but for the runs: when the file is read back after a write error, and
/// the runs are made again from what it holds ([`super::log::scan`]).
pub(super) fn drop_commits_through(
    shared: &SharedPending,
    seq: u64,
) -> std::sync::RwLockWriteGuard<'_, Waiting> {
    let mut waiting = write(shared);
    if waiting.commits.first().is_some_and(|c| c.seq <= seq) {
        let gone = waiting.commits.iter().take_while(|c| c.seq <= seq);
        if gone.clone().any(|c| !c.series.is_empty()) {
            let mut names = (*waiting.names).clone();
            for (id, name) in gone.flat_map(|c| &c.series) {
                names.ids.remove(name);
                names.names.remove(id);
            }
            waiting.names = Arc::new(names);
        }
        Arc::make_mut(&mut waiting.commits).retain(|c| c.seq > seq);
    }
    if waiting.logged.first().is_some_and(|l| l.0 <= seq) {
        Arc::make_mut(&mut waiting.logged).retain(|l| l.0 > seq);
    }
    waiting
}

/// The runs now (for the writer, which alone changes them).
pub(super) fn runs_now(shared: &SharedPending) -> Vec<Arc<Run>> {
    shared
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .runs
        .all()
        .to_vec()
}

/// Empties the list (the journal's replay brings the same commits back in the `log` table).
pub(super) fn clear(shared: &SharedPending) {
    *write(shared) = Waiting::default();
}

/// The commits waiting, as the list holds them now: a shared copy, which the writer (which
/// alone changes the list) reads without holding the lock.
pub(super) fn commits(shared: &SharedPending) -> Arc<Vec<Arc<PendingCommit>>> {
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
