//! After an I/O error: the file reopened from the disk, not from what the page cache shows of a
//! failed transaction (PostgreSQL's fsync lesson), and the store's view of it read back, the
//! journal and the commits waiting in it kept.

use redb::ReadableDatabase;

use super::{
    CommitError, META, Store, StoreOpenError, apply_outbox, log, pending, read_dedup_log,
    read_series,
};

impl Store {
    /// Closes and reopens the file: after an I/O error redb answers every call with an error
    /// until then. In-memory state is read back from the file, and the journal's records that
    /// it lacks are applied, so whatever the failed commit did or did not write, the store again
    /// agrees with the disk. Both files are read back from the disk, not the page cache
    /// ([`Store::drop_cached_pages`]): a failed transaction whose pages only the cache held is
    /// not built upon.
    pub fn reopen(&mut self) -> Result<(), StoreOpenError> {
        self.close_file();
        self.commits.journal = None;
        // `load` reads both files back from the disk.
        self.load()
    }

    /// Reopens the file after one of its own write transactions failed (a checkpoint part, a
    /// retention pass), keeping the journal and the commits waiting in it as they are: unlike
    /// [`Store::reopen`] it writes nothing but redb's own open, so while the disk still refuses
    /// the file's writes it fails alone and the journal goes on taking commits. The file is read
    /// back from the disk ([`Store::drop_cached_pages`]); whatever of the failed transaction is
    /// there (all of it or none: redb's open checks a header whose commit was not flushed, and
    /// falls back to the one before) is taken as it is, and the in-memory state is read again
    /// from the file and the waiting commits. No journal record is freed here: what the file
    /// shows is not known to be durable until a transaction of its own has synced.
    pub(super) fn recover(&mut self) -> Result<(), CommitError> {
        self.close_file();
        self.drop_cached_pages(false);
        self.open_file().map_err(redb::Error::from)?;
        let db = self.db.clone().expect("opened above");
        if let Err(e) = self.read_back(&db) {
            self.close_file();
            return Err(e);
        }
        self.shared
            .write()
            .expect("no panic while holding the lock")
            .clone_from(&self.db);
        self.needs_recovery = false;
        tracing::info!(
            path = %self.path.display(),
            "Reopened the database file after a failed write, read back from the disk; the \
             commits waiting in the journal are kept."
        );
        Ok(())
    }

    /// [`Store::recover`]'s reading of the reopened file: what it holds, and the pending commits
    /// on top of it.
    pub(super) fn read_back(&mut self, db: &redb::Database) -> Result<(), CommitError> {
        let (file_next, file_log) = read_dedup_log(db)?;
        // A fold whose commit failed may have landed after all: its commits are in the file.
        if let Some(last) = file_next.checked_sub(1) {
            // The runs are made again below, from what the file holds.
            drop(pending::drop_commits_through(&self.commits.pending, last));
        }
        let pending = pending::commits(&self.commits.pending);
        let next = pending.last().map_or(file_next, |c| c.seq + 1);
        if next != self.commits.next_seq {
            return Err(CommitError::Redb(redb::Error::Corrupted(format!(
                "reopened, the file and the journal end at commit {next}, the writer at {}",
                self.commits.next_seq
            ))));
        }
        let mut series = read_series(db)?;
        for c in pending.iter() {
            series.extend(c.series.iter().map(|(id, name)| (name.clone(), *id)));
        }
        // Series that a retention pass whose commit failed deleted after all.
        let gone = self.series.keys().filter(|n| !series.contains_key(*n));
        self.forgotten.extend(gone.cloned());
        let next_id = series.values().max().map_or(0, |id| id + 1);
        self.next_series_id = self.next_series_id.max(next_id);
        self.series = series;
        let mut dedup_log = file_log;
        for c in pending.iter() {
            let n = crate::dedup::count(&c.fingerprints).unwrap_or(0);
            dedup_log.push_back((c.seq, n));
        }
        self.commits.dedup_total = dedup_log.iter().map(|e| e.1).sum();
        self.commits.dedup_log = dedup_log;
        let tx = db.begin_read().map_err(redb::Error::from)?;
        let waiting: u64 = pending.iter().map(|c| c.record.len() as u64).sum();
        let meta = tx.open_table(META).map_err(redb::Error::from)?;
        self.fold = log::FoldCursor::read(&meta)?;
        drop(meta);
        let cut = self.fold.map(|c| c.through);
        let (log_bytes, logged, mut runs) = log::scan(&tx, cut)?;
        drop(tx);
        for c in pending.iter() {
            if let Some(cut) = cut.filter(|&cut| c.seq > cut) {
                runs.close_through(cut);
            }
            runs.add(c.seq, &c.record);
        }
        if let Some(cut) = cut {
            runs.close_through(cut);
        }
        self.commits.log_bytes = log_bytes + waiting;
        pending::set_logged(&self.commits.pending, logged, runs);
        self.reapply_outbox(db)?;
        // The file read back shows every commit before the first pending one, but no fsync of
        // this handle has succeeded: a fold whose fsync failed may be served from the device's
        // volatile cache. Their journal records stay live until a durable transaction of the
        // file commits (`Commits::durable_committed`, called by every one).
        Ok(())
    }

    /// The outbox writes of the journal's live records again, in one transaction that does not
    /// wait for the disk (as they were made): they were not durable, so the reopened file may lack
    /// them, and the journal holds them until a durable transaction does.
    pub(super) fn reapply_outbox(&self, db: &redb::Database) -> Result<(), CommitError> {
        let Some(j) = self
            .commits
            .journal
            .as_ref()
            .filter(|_| self.settings.outbox_max_entries > 0)
        else {
            return Ok(());
        };
        let mut tx = db.begin_write()?;
        j.live_records(|_, redo| match &redo.outbox {
            Some(o) => apply_outbox(&tx, o),
            None => Ok(()),
        })?;
        tx.set_durability(redb::Durability::None)?;
        tx.commit()?;
        Ok(())
    }

    /// Reopens the file if a write of it failed ([`Store::recover`]): first thing in every
    /// write of the file, before it reads the state the reopen may change.
    pub(super) fn recovered(&mut self) -> Result<(), CommitError> {
        if self.needs_recovery {
            self.recover()?;
        }
        Ok(())
    }

    /// A write transaction of the file failed: unless it is damage, the next one reopens the
    /// file first.
    pub(super) fn note_failure<T>(
        &mut self,
        result: Result<T, CommitError>,
    ) -> Result<T, CommitError> {
        if let Err(e) = &result
            && !e.is_damage()
        {
            self.needs_recovery = true;
        }
        result
    }
}
