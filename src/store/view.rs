//! One consistent view of the store for a reader: a read transaction, and the journaled commits
//! it does not hold yet ([`super::pending`]), with the checkpoint under way in it.

use std::sync::Arc;

use super::SERIES_BY_ID;
use super::log::FoldCursor;
use super::pending::Snapshot;

/// One consistent view: a read transaction, and the pending commits it does not hold yet.
pub(super) struct View {
    pub tx: redb::ReadTransaction,
    pub(super) pending: Snapshot,
    /// The last commit the transaction holds (its last `dedup` key): pending commits up to it
    /// were folded after the snapshot was taken.
    pub(super) folded_through: Option<u64>,
    /// The checkpoint under way in the transaction: what it folded is in the documents.
    pub cursor: Option<FoldCursor>,
}

impl View {
    /// The pending commits the transaction does not hold, oldest first.
    pub(super) fn pending(&self) -> impl Iterator<Item = &super::pending::PendingCommit> {
        self.pending.after(self.folded_through)
    }

    /// Whether commit `seq` is one of the snapshot's pending commits (`None`: it is not, so it
    /// is in the `log` table, if anywhere), and then whether the transaction lacks it still.
    pub(super) fn is_pending(&self, seq: u64) -> Option<bool> {
        self.pending
            .is_pending(seq)
            .then(|| self.folded_through.is_none_or(|f| seq > f))
    }

    /// The runs of the waiting commits the snapshot holds ([`super::merged`]).
    pub(super) fn runs(&self) -> &[Arc<super::merged::Run>] {
        self.pending.runs()
    }

    /// The indexes of the `log` table's records the snapshot holds.
    pub(super) fn logged(&self) -> &[(u64, Option<Arc<crate::commitlog::RecordIndex>>)] {
        self.pending.logged()
    }

    /// The id of `name` among the pending commits' new series (those a checkpoint folded since
    /// the snapshot was taken are in the transaction's tables, looked up first).
    pub(super) fn pending_id(&self, name: &str) -> Option<u64> {
        self.pending.id_of(name)
    }

    /// The name of series `id`: from the file, or a pending commit's new series.
    pub(super) fn name_of(&self, id: u64) -> Result<String, redb::Error> {
        let by_id = self.tx.open_table(SERIES_BY_ID)?;
        if let Some(name) = by_id.get(id)? {
            return Ok(name.value().to_owned());
        }
        self.pending
            .name_of(id)
            .map(ToString::to_string)
            .ok_or_else(|| redb::Error::Corrupted(format!("series id {id} has no name")))
    }
}
