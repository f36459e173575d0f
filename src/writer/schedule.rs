//! When the writer thread does its upkeep between batches: checkpoints (by time, by log size,
//! by a filling journal, part by part), retention passes after them, and the backoff after a
//! failed checkpoint. Pure: every decision takes `now` and the store's figures, and the thread
//! (`super::spawn`) does the I/O it decides on.

use std::time::{Duration, Instant};

use crate::config::Checkpoint;

/// What a checkpoint part came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fold {
    /// Nothing is left to fold.
    Done,
    /// More is left (the part's time ran out).
    More,
    /// It failed and changed nothing (an I/O error: a full disk, a failing card): tried again
    /// after a [`Backoff`].
    Failed,
    /// A stored document or record cannot be read: no later try can fold past it. The writer
    /// stops (the daemon exits 1, with the damaged key in the log), rather than keep everything
    /// it cannot fold in memory and retry for ever.
    Damaged,
}

/// What the writer does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Go on with what it was doing.
    Go,
    /// Skip the rest of this turn: wait for the next batch or deadline.
    Skip,
    /// Stop the writer (damage).
    Stop,
}

/// After a checkpoint failed: no trigger starts another before `until`.
#[derive(Debug, Default, Clone, Copy)]
struct Backoff {
    until: Option<Instant>,
    delay: Duration,
}

impl Backoff {
    fn allows(&self, now: Instant) -> bool {
        self.until.is_none_or(|t| now >= t)
    }

    fn until(&self, now: Instant) -> Instant {
        self.until.unwrap_or(now)
    }

    fn failed(&mut self, now: Instant, most: Duration) {
        self.delay =
            (self.delay * 2).clamp(Duration::from_secs(1), most.max(Duration::from_secs(1)));
        self.until = Some(now + self.delay);
    }
}

/// The writer's upkeep schedule.
#[derive(Debug)]
pub struct Schedule {
    checkpoint: Checkpoint,
    retention_interval: Duration,
    /// The next retention pass (sooner while a pass leaves work behind).
    next_pass: Instant,
    next_checkpoint: Instant,
    /// A checkpoint is part-way: fold the next part as soon as no batch waits.
    folding: bool,
    backoff: Backoff,
}

impl Schedule {
    /// The first retention pass runs soon after start, then every interval; the log a previous
    /// run left is folded by the first checkpoint, one interval on.
    pub fn new(checkpoint: Checkpoint, retention_interval: Duration, now: Instant) -> Schedule {
        Schedule {
            checkpoint,
            retention_interval,
            next_pass: now + Duration::from_secs(1).min(retention_interval),
            next_checkpoint: now + checkpoint.interval,
            folding: false,
            backoff: Backoff::default(),
        }
    }

    /// Whether to fold a part of the log now: part-way through a checkpoint, at its interval, or
    /// with `log_bytes` past its size; never during a backoff.
    pub fn fold_due(&self, now: Instant, log_bytes: u64) -> bool {
        (self.folding || now >= self.next_checkpoint || log_bytes >= self.checkpoint.bytes)
            && self.backoff.allows(now)
    }

    /// A checkpoint part came to `fold`. A failed part changes nothing (one transaction): the
    /// log stays, reads still include it, and the next try waits (every trigger alike).
    pub fn folded(&mut self, fold: Fold, now: Instant) -> Step {
        self.folding = fold == Fold::More;
        match fold {
            Fold::More => {}
            Fold::Done => {
                self.backoff = Backoff::default();
                self.next_checkpoint = now + self.checkpoint.interval;
            }
            Fold::Failed => {
                // Tried again when the backoff ends, batches or not: the log is still there,
                // and a quiet gateway would otherwise wait a whole interval (issue 51).
                self.backoff.failed(now, self.checkpoint.interval);
                self.next_checkpoint = self.backoff.until(now);
            }
            Fold::Damaged => return Step::Stop,
        }
        Step::Go
    }

    /// The journal holds `used` of `room` bytes. Three quarters full: `true` if the file must
    /// be made durable now (nothing waits to be folded: `unfolded`, asked only then, reads the
    /// store's state); with commits waiting, their fold begins instead, part by part, which
    /// frees the records folded.
    pub fn journal_filling(
        &mut self,
        used: u64,
        room: u64,
        unfolded: impl FnOnce() -> bool,
        now: Instant,
    ) -> bool {
        if used == 0 || used < room / 4 * 3 || !self.backoff.allows(now) {
            return false;
        }
        if unfolded() {
            self.folding = true;
            return false;
        }
        true
    }

    /// How long to wait for a batch before the next upkeep.
    pub fn wait(&self, now: Instant) -> Duration {
        if self.folding {
            return Duration::ZERO;
        }
        self.next_pass
            .min(self.next_checkpoint.max(self.backoff.until(now)))
            .saturating_duration_since(now)
    }

    /// No batch came within [`Schedule::wait`]: whether the retention pass is due now. During
    /// a backoff it waits for the backoff's end.
    pub fn pass_due(&mut self, now: Instant) -> bool {
        if self.folding || now < self.next_pass {
            return false;
        }
        if !self.backoff.allows(now) {
            self.next_pass = self.backoff.until(now);
            return false;
        }
        true
    }

    /// Retention after a checkpoint: a bucket it deletes cannot come back from a log entry
    /// folded later. When the log reaches what the pass may delete it is folded first, in parts
    /// with batches between them, and the pass waits until it is: `fold` is what a part came to.
    pub fn folded_before_pass(&mut self, fold: Fold, now: Instant) -> Step {
        match fold {
            Fold::More => {
                self.folding = true;
                Step::Skip
            }
            Fold::Done => {
                self.backoff = Backoff::default();
                self.next_checkpoint = now + self.checkpoint.interval;
                Step::Go
            }
            Fold::Failed => {
                self.backoff.failed(now, self.checkpoint.interval);
                self.next_pass = self.backoff.until(now);
                Step::Skip
            }
            Fold::Damaged => Step::Stop,
        }
    }

    /// A retention pass ended: `Some(true)` left work behind (go on after any batch),
    /// `Some(false)` finished, `None` failed (a failed pass changes nothing; try again at the
    /// interval).
    pub fn passed(&mut self, more: Option<bool>, now: Instant) {
        self.next_pass = match more {
            Some(true) => now,
            Some(false) | None => now + self.retention_interval,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_mins(1);

    fn schedule(t0: Instant) -> Schedule {
        let checkpoint = Checkpoint {
            interval: Duration::from_mins(5),
            bytes: 1000,
        };
        Schedule::new(checkpoint, Duration::from_hours(1), t0)
    }

    #[test]
    fn a_checkpoint_is_due_by_time_or_by_size_and_folds_part_by_part() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        assert!(!s.fold_due(t0, 999));
        assert!(s.fold_due(t0, 1000), "the log's size brings it forward");
        assert!(s.fold_due(t0 + 5 * MIN, 0), "its interval");
        assert_eq!(s.folded(Fold::More, t0), Step::Go);
        assert!(s.fold_due(t0, 0), "part-way: the next part at once");
        assert_eq!(s.wait(t0), Duration::ZERO);
        assert_eq!(s.folded(Fold::Done, t0 + MIN), Step::Go);
        assert!(!s.fold_due(t0 + 5 * MIN, 0), "counted from the fold's end");
        assert!(s.fold_due(t0 + 6 * MIN, 0));
    }

    #[test]
    fn a_failed_checkpoint_backs_off_every_trigger_and_damage_stops() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        s.folded(Fold::Failed, t0);
        assert!(!s.fold_due(t0, 5000), "not even by size during the backoff");
        assert_eq!(
            s.wait(t0),
            Duration::from_secs(1),
            "tried again when the backoff ends, without a batch"
        );
        assert!(!s.journal_filling(900, 1000, || true, t0));
        assert!(
            s.fold_due(t0 + Duration::from_secs(1), 5000),
            "1 s, then doubling"
        );
        s.folded(Fold::Failed, t0);
        assert!(!s.fold_due(t0 + Duration::from_secs(1), 5000));
        assert!(s.fold_due(t0 + Duration::from_secs(2), 5000));
        assert_eq!(s.folded(Fold::Damaged, t0), Step::Stop);
    }

    #[test]
    fn a_filling_journal_folds_the_log_or_syncs_the_file() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        assert!(!s.journal_filling(749, 1000, || true, t0));
        assert!(!s.fold_due(t0, 10));
        assert!(
            !s.journal_filling(750, 1000, || true, t0),
            "a log to fold: no sync"
        );
        assert!(s.fold_due(t0, 10), "the fold begins");
        let mut s = schedule(t0);
        assert!(
            s.journal_filling(750, 1000, || false, t0),
            "nothing to fold: sync the file"
        );
        assert!(!s.journal_filling(0, 0, || false, t0), "no journal");
    }

    #[test]
    fn retention_waits_for_its_interval_the_fold_before_it_and_a_backoff() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        assert_eq!(
            s.wait(t0),
            Duration::from_secs(1),
            "the first pass soon after start"
        );
        assert!(!s.pass_due(t0));
        let t1 = t0 + Duration::from_secs(1);
        assert!(s.pass_due(t1));
        assert_eq!(s.folded_before_pass(Fold::More, t1), Step::Skip);
        assert!(!s.pass_due(t1), "not while the fold is part-way");
        assert_eq!(s.folded(Fold::Done, t1), Step::Go);
        assert!(s.pass_due(t1));
        s.passed(Some(true), t1);
        assert!(s.pass_due(t1), "work left: again after any batch");
        s.passed(Some(false), t1);
        assert!(!s.pass_due(t1 + 59 * MIN));
        assert!(s.pass_due(t1 + 60 * MIN));
        assert_eq!(
            s.folded_before_pass(Fold::Failed, t1 + 60 * MIN),
            Step::Skip
        );
        assert!(!s.pass_due(t1 + 60 * MIN), "waits out the backoff");
        assert!(s.pass_due(t1 + 61 * MIN));
    }
}
