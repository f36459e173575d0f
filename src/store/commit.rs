//! The upsert-and-increment commit: a batch encoded as one commit log record, made durable in
//! the journal (or, without one, in a durable redb transaction), then what the store keeps of
//! it advanced (the pending commits readers share, the sequence, the log's bytes, the dedup
//! log, the series); and a failed commit's redo, applied again once the file is reopened.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::{
    APPLIED, CommitError, CommitStats, DEDUP, NewSeries, OutboxShared, Redo, SERIES_BY_ID,
    SERIES_BY_NAME, Store, StoreSettings, journal, log, outbox, pending,
};
use crate::batcher::Batch;
use crate::config::Durability;

/// The commit state the store advances with every commit and every checkpoint, owned in one
/// place: the next sequence number, where commits become durable (the journal), the commits
/// waiting to be folded (shared with the readers), the log's bytes and the dedup log. A commit
/// advances all of them together ([`Store::committed`], after the record is durable); a
/// checkpoint's last part takes back what it folded (`store::log`).
#[derive(Default)]
pub(super) struct Commits {
    /// Sequence number of the next commit.
    pub(super) next_seq: u64,
    /// The `dedup` table's entries: (commit sequence number, fingerprints), oldest first.
    pub(super) dedup_log: VecDeque<(u64, usize)>,
    /// Fingerprints in `dedup_log`.
    pub(super) dedup_total: usize,
    /// Bytes of the log's records and of the fingerprints stored since the last checkpoint.
    pub(super) log_bytes: u64,
    /// The record being encoded, kept to reuse its allocation.
    pub(super) record_buf: Vec<u8>,
    /// Where commits become durable; `None` without one (`journal_bytes = 0`) and between a
    /// failed reopen and the next successful one.
    pub(super) journal: Option<journal::Journal>,
    /// Journaled commits not in redb yet (`store::pending`), shared with the readers.
    pub(super) pending: pending::SharedPending,
    /// The last commit made durable in redb itself (no journal), encoded as a journal record
    /// would be, until its transaction has committed: if that failed, the file may show it
    /// after a reopen from the page cache alone ([`Store::confirm_landed`]).
    pub(super) unconfirmed: Option<(u64, Vec<u8>)>,
}

/// Where a commit became durable.
pub(super) enum DurableIn {
    /// In the journal: it waits in memory, readers seeing it, for a checkpoint to fold it.
    Journal(pending::PendingCommit),
    /// In the file's `log` table, by a durable transaction of its own.
    File,
}

impl Commits {
    /// Commit `seq` (its `record`, and that many fingerprints) is durable where `landed` says:
    /// the commits waiting take it, the log's bytes grow by its record, the dedup log by its
    /// fingerprints, and the next commit takes the next number. Called once per commit, after
    /// the journal's write or the file's transaction succeeded, never before.
    pub(super) fn landed(
        &mut self,
        seq: u64,
        record: Vec<u8>,
        landed: DurableIn,
        fingerprints: usize,
    ) {
        self.log_bytes = self.log_bytes.saturating_add(record.len() as u64);
        match landed {
            DurableIn::Journal(commit) => pending::push(&self.pending, commit),
            DurableIn::File => {
                pending::push_logged(&self.pending, seq, &record);
                self.durable_committed();
            }
        }
        self.record_buf = record;
        self.dedup_log.push_back((seq, fingerprints));
        self.dedup_total += fingerprints;
        self.next_seq = seq + 1;
        // A failed durable commit's redo is for its own sequence number only: once a commit
        // lands there or after it (the retry, through the journal or not), applying it again
        // would count a batch twice and overwrite newer outbox entries.
        if self.unconfirmed.as_ref().is_some_and(|(s, _)| *s <= seq) {
            self.unconfirmed = None;
        }
    }

    /// A checkpoint's last part committed: the commits through `through` are folded (their
    /// `bytes` of records gone from the log) and the dedup entries `trimmed` (sorted) deleted.
    pub(super) fn folded(&mut self, through: u64, bytes: u64, trimmed: &[u64]) {
        pending::drop_through(&self.pending, through);
        self.durable_committed();
        self.log_bytes = self.log_bytes.saturating_sub(bytes);
        self.dedup_log
            .retain(|(s, _)| trimmed.binary_search(s).is_err());
        self.dedup_total = self.dedup_log.iter().map(|e| e.1).sum();
    }

    /// After a durable transaction committed: the file holds every commit before the first
    /// pending one, and their journal records are no longer live.
    pub(super) fn durable_committed(&mut self) {
        let first_pending = pending::commits(&self.pending).first().map(|c| c.seq);
        if let Some(j) = &mut self.journal {
            j.release_below(first_pending.unwrap_or(u64::MAX));
        }
    }
}

/// What one try at a commit came to.
#[derive(Debug)]
pub(super) enum Appended {
    /// Durable (in the journal, or in the file), and the store's state advanced past it.
    Durable(CommitStats),
    /// The journal is full of commits not folded yet: nothing was written; fold, then commit.
    JournalFull,
}

/// What a commit does when the journal has no room for its record while commits wait in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Full {
    /// Come back ([`Appended::JournalFull`]): the caller folds the waiting commits first.
    Wait,
    /// Commit in the file itself (a durable transaction): nothing waits any more.
    CommitInFile,
}

impl Store {
    /// After a failed commit and [`Store::reopen`], when the file shows that commit (its
    /// sequence number is below [`Store::next_seq`]): makes sure it is on the disk before it is
    /// acknowledged. A failed fsync leaves the written pages in the page cache, marked clean:
    /// the reopened file reads them back although they may never reach the disk. So the
    /// commit's writes are applied again (puts of the same keys and values) in a transaction
    /// that commits durably. A commit that went through the journal needs nothing: the open's
    /// replay applied it in a durable transaction already. `Ok` once it is durable.
    pub fn confirm_landed(&mut self) -> Result<(), CommitError> {
        let Some((seq, bytes)) = self.commits.unconfirmed.take() else {
            return Ok(());
        };
        if seq >= self.commits.next_seq {
            return Ok(()); // It did not land; the caller commits it again.
        }
        let redo = Redo::parse(&bytes).ok_or_else(|| {
            CommitError::Redb(redb::Error::Corrupted(
                "the failed commit's own record is unreadable".into(),
            ))
        })?;
        let tx = self.durable_tx()?;
        apply_redo(&tx, seq, &redo)?;
        if let Err(e) = tx.commit() {
            self.commits.unconfirmed = Some((seq, bytes));
            return Err(e.into());
        }
        self.commits.durable_committed();
        Ok(())
    }

    /// Appends the batch to the commit log: its per-bucket deltas and raw readings as one
    /// record, and its message fingerprints, under the next commit sequence number. Durable
    /// through the journal (one record, synced), after which the commit waits in memory
    /// (`store::pending`) for a checkpoint to fold it: redb is not written at all, unless an
    /// outbox entry goes with it (a non-durable transaction of the outbox alone). Without a
    /// journal, or when the record does not fit in it even after folding what is pending (which
    /// frees every record), as one durable redb transaction. When this returns
    /// `Ok`, the batch survives a power cut and every reader sees it; [`Store::checkpoint`]
    /// later folds it into the bucket documents. After an error, [`Store::reopen`] and compare
    /// [`Store::next_seq`] to learn whether it landed.
    pub fn commit(&mut self, batch: &Batch) -> Result<CommitStats, CommitError> {
        if self.settings.outbox_max_entries > 0 {
            // The outbox is written to the file with every commit: after a failed write of
            // the file, reopened first.
            self.recovered()?;
        }
        match self.commit_once(batch, Full::Wait)? {
            Appended::Durable(stats) => Ok(stats),
            Appended::JournalFull => {
                // The journal is full of pending commits: fold them, which frees their records.
                self.checkpoint()?;
                match self.commit_once(batch, Full::CommitInFile)? {
                    Appended::Durable(stats) => Ok(stats),
                    Appended::JournalFull => unreachable!("a commit that may not wait is made"),
                }
            }
        }
    }

    /// Encodes `batch`'s buckets as a commit log record into `record`, naming the series it
    /// sees first (ids after the known ones): those, by name and in id order.
    pub(super) fn encode_record(
        &self,
        batch: &Batch,
        record: &mut Vec<u8>,
        stats: &mut CommitStats,
    ) -> NewSeries {
        let mut new_series: HashMap<Arc<str>, u64> = HashMap::new();
        let mut new_in_order: Vec<(u64, Arc<str>)> = Vec::new();
        let first_new_id = self.next_series_id;
        let mut entries = Vec::with_capacity(batch.buckets.len());
        for ((series, start), delta) in &batch.buckets {
            let id = if let Some(&id) = self.series.get(series).or(new_series.get(series)) {
                id
            } else {
                let id = first_new_id + new_series.len() as u64;
                new_series.insert(series.clone(), id);
                new_in_order.push((id, series.clone()));
                id
            };
            entries.push(crate::commitlog::EntryIn {
                series_id: id,
                start: *start,
                summary: delta,
                raw: batch.raw.get(&(series.clone(), *start)).map(Vec::as_slice),
            });
        }
        entries.sort_unstable_by_key(|e| (e.series_id, e.start));
        let params = batch
            .buckets
            .values()
            .next()
            .map_or(crate::sketch::SketchParams::DEFAULT, |s| s.sketch.params());
        record.clear();
        crate::commitlog::encode(&entries, params, record);
        stats.buckets_written = entries.len();
        (new_series, new_in_order)
    }

    /// [`Store::commit`], once: [`Appended::JournalFull`] (nothing written) when the record does
    /// not fit in the journal while commits are pending, and `full` says to wait.
    pub(super) fn commit_once(
        &mut self,
        batch: &Batch,
        full: Full,
    ) -> Result<Appended, CommitError> {
        let mut stats = CommitStats::default();
        if batch.is_empty() {
            return Ok(Appended::Durable(stats));
        }
        let seq = self.commits.next_seq;
        let outbox_on = self.settings.outbox_max_entries > 0;
        let mut tx = if outbox_on {
            Some(self.open_db()?.begin_write()?)
        } else {
            None
        };
        let fingerprints = crate::dedup::encode(&batch.fingerprints);
        let mut record = std::mem::take(&mut self.commits.record_buf);
        // Series first seen in this batch; joined to `self.series` only once the commit holds.
        let (new_series, new_in_order) = self.encode_record(batch, &mut record, &mut stats);
        let applied: Vec<(String, Vec<u8>)> = batch
            .applied
            .iter()
            .map(|(gateway, at)| (gateway.clone(), at.encode()))
            .collect();
        let (outbox_write, gate) = match &tx {
            Some(tx) => {
                let (w, gate) = outbox::plan(
                    tx,
                    &self.outbox,
                    self.settings.outbox_max_entries,
                    seq,
                    batch,
                    self.settings.bucket_width_secs,
                )?;
                (Some(w), gate)
            }
            None => (None, None),
        };
        let redo = Redo {
            series: new_in_order.iter().map(|(id, n)| (*id, &**n)).collect(),
            log: &record,
            fingerprints: &fingerprints,
            applied: applied
                .iter()
                .map(|(g, at)| (g.as_str(), at.as_slice()))
                .collect(),
            outbox: outbox_write.as_ref().map(|w| journal::OutboxRedo {
                trim_below: w.trim_below,
                key: w.key,
                doc: &w.doc,
            }),
        };
        // Acknowledgements wait for this commit, so it must be durable: in the journal, or
        // else in redb itself.
        let journaled = match &mut self.commits.journal {
            Some(j) => j.append(seq, &redo).map_err(CommitError::Journal)?,
            None => false,
        };
        let pending = !pending::commits(&self.commits.pending).is_empty();
        if !journaled && pending && full == Full::Wait {
            // The journal is full of pending commits: the caller folds them first. Nothing
            // was written.
            self.commits.record_buf = record;
            return Ok(Appended::JournalFull);
        }
        if journaled {
            // Only the outbox goes to redb now, non-durably (the journal holds it too).
            if let (Some(tx), Some(o)) = (tx.take(), &redo.outbox) {
                commit_outbox(tx, o, outbox_write.as_ref(), &self.outbox)?;
            }
        } else {
            if pending {
                // A durable commit past commits that wait in the journal would move the file's
                // next commit number beyond them, and the replay after a power cut would skip
                // them as held. `commit` folds them first; should they still be there, refuse
                // (nothing written, nothing acknowledged) rather than lose them.
                self.commits.record_buf = record;
                return Err(CommitError::Unfolded);
            }
            let tx = match tx.take() {
                Some(tx) => tx,
                None => self.open_db()?.begin_write()?,
            };
            commit_durably(
                tx,
                seq,
                &redo,
                outbox_write.as_ref(),
                &self.settings,
                &self.outbox,
                &mut self.commits.unconfirmed,
            )?;
        }
        drop(redo);
        drop(gate);
        stats.series_created = new_series.len();
        stats.log_bytes = record.len() + fingerprints.len();
        let landed = if journaled {
            let commit = pending::PendingCommit::new(seq, record.clone(), fingerprints);
            DurableIn::Journal(commit.with(new_in_order, applied))
        } else {
            DurableIn::File
        };
        self.commits
            .landed(seq, record, landed, batch.fingerprints.len());
        self.series_added(new_series);
        Ok(Appended::Durable(stats))
    }

    /// A commit's new series join the known ones (and are no longer forgotten).
    fn series_added(&mut self, new_series: HashMap<Arc<str>, u64>) {
        self.next_series_id += new_series.len() as u64;
        if !self.forgotten.is_empty() {
            // Back in the file: the ingest side must keep counting it.
            self.forgotten.retain(|name| !new_series.contains_key(name));
        }
        self.series.extend(new_series);
    }

    /// The dedup entries a checkpoint deletes, in key order: the oldest ones whose
    /// fingerprints all fall out of the window, and empty ones, among the entries the file
    /// will hold (those below `below`: pending commits not folded by the checkpoint are not in
    /// it; `None`: all); never the last of those (its key gives [`Store::next_seq`] at the next
    /// open, and tells readers which pending commits the file holds).
    pub(super) fn dedup_trim(&self, below: Option<u64>) -> Vec<u64> {
        let window = self.settings.dedup_window;
        let mut total = self.commits.dedup_total;
        let held = |seq: u64| below.is_none_or(|b| seq < b);
        let last = self
            .commits
            .dedup_log
            .iter()
            .rev()
            .map(|e| e.0)
            .find(|s| held(*s));
        let mut out = Vec::new();
        let mut oldest = true;
        for &(seq, n) in &self.commits.dedup_log {
            if Some(seq) == last || !held(seq) {
                break;
            }
            if oldest && total - n >= window {
                total -= n;
                out.push(seq);
                continue;
            }
            oldest = false;
            if n == 0 {
                out.push(seq);
            }
        }
        out
    }
}

/// A journaled commit's outbox write, to redb without waiting for the disk (the journal holds
/// it durably).
pub(super) fn commit_outbox(
    mut tx: redb::WriteTransaction,
    o: &journal::OutboxRedo<'_>,
    outbox_write: Option<&outbox::OutboxWrite>,
    outbox_state: &OutboxShared,
) -> Result<(), CommitError> {
    apply_outbox(&tx, o)?;
    if let Some(w) = outbox_write {
        outbox::note(&tx, outbox_state, w.key)?;
    }
    tx.set_durability(redb::Durability::None)?;
    tx.commit()?;
    Ok(())
}

/// A commit without the journal (or one it has no room for): `redo` applied to redb durably
/// in `tx`. Its encoding is `unconfirmed` until redb reports the commit (a failure leaves it
/// there, for the reopen to learn whether it landed).
pub(super) fn commit_durably(
    tx: redb::WriteTransaction,
    seq: u64,
    redo: &Redo<'_>,
    outbox_write: Option<&outbox::OutboxWrite>,
    settings: &StoreSettings,
    outbox_state: &OutboxShared,
    unconfirmed: &mut Option<(u64, Vec<u8>)>,
) -> Result<(), CommitError> {
    let mut tx = tx;
    apply_redo(&tx, seq, redo)?;
    if let Some(w) = outbox_write {
        outbox::note(&tx, outbox_state, w.key)?;
    }
    tx.set_durability(redb::Durability::Immediate)?;
    tx.set_two_phase_commit(settings.durability == Durability::TwoPhase);
    tx.set_quick_repair(settings.quick_repair);
    let mut encoded = Vec::new();
    redo.encode(&mut encoded);
    *unconfirmed = Some((seq, encoded));
    tx.commit()?;
    *unconfirmed = None;
    Ok(())
}

/// Writes one commit's [`Redo`] into `tx` under sequence number `seq`: the live commit and a
/// journal replay both write through here, so they write the same.
pub(super) fn apply_redo(
    tx: &redb::WriteTransaction,
    seq: u64,
    redo: &Redo<'_>,
) -> Result<(), CommitError> {
    if !redo.series.is_empty() {
        let mut by_name = tx.open_table(SERIES_BY_NAME)?;
        let mut by_id = tx.open_table(SERIES_BY_ID)?;
        for &(id, name) in &redo.series {
            by_name.insert(name, id)?;
            by_id.insert(id, name)?;
        }
    }
    tx.open_table(log::LOG)?.insert(seq, redo.log)?;
    tx.open_table(DEDUP)?.insert(seq, redo.fingerprints)?;
    if !redo.applied.is_empty() {
        let mut applied = tx.open_table(APPLIED)?;
        for &(gateway, at) in &redo.applied {
            applied.insert(gateway, at)?;
        }
    }
    if let Some(o) = &redo.outbox {
        apply_outbox(tx, o)?;
    }
    Ok(())
}

/// Writes one commit's outbox entry into `tx` (see [`apply_redo`]).
pub(super) fn apply_outbox(
    tx: &redb::WriteTransaction,
    o: &journal::OutboxRedo<'_>,
) -> Result<(), CommitError> {
    let mut table = tx.open_table(outbox::OUTBOX)?;
    if o.trim_below > 0 {
        table.retain_in(..o.trim_below, |_, _| false)?;
    }
    table.insert(o.key, o.doc)?;
    Ok(())
}
