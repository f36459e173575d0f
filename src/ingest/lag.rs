//! The loop's own scheduling delay: how long its threads were runnable but without a core
//! while it waited for an event (Linux: the run-queue wait in `/proc/self/task/<tid>/schedstat`
//! of the threads the loop runs on).
//! On a busy machine the loop reads a message tens of milliseconds after it came; the core
//! needs to know how soon after its release the broker answered ([`super::Now::lag`]).
//! Elsewhere, or where the kernel keeps no such statistics, it is zero.

use std::time::{Duration, Instant};

/// The most threads remembered as having run the loop (a runtime's workers; 1 in the daemon).
const THREADS_MAX: usize = 16;

/// A measurement from before a wait to after it, over the threads that have run the loop.
#[derive(Debug, Default)]
pub(super) struct Lag {
    /// The threads (ids) the loop has run on: a task moves between a runtime's workers.
    threads: Vec<u32>,
    since: Option<(Instant, Duration)>,
}

impl Lag {
    /// Starts measuring (before the loop waits).
    pub(super) fn start(&mut self) {
        self.note_thread();
        self.since = runnable_wait(&self.threads).map(|w| (Instant::now(), w));
    }

    /// How long the loop's threads waited for a core since [`Lag::start`], at most the time
    /// since then; zero when not started or not measurable.
    pub(super) fn take(&mut self) -> Duration {
        let Some((at, before)) = self.since.take() else {
            return Duration::ZERO;
        };
        let lag = runnable_wait(&self.threads).map_or(Duration::ZERO, |now| {
            now.saturating_sub(before).min(at.elapsed())
        });
        // A thread it resumed on that was not known at the start counts from the next wait.
        self.note_thread();
        lag
    }

    fn note_thread(&mut self) {
        if let Some(tid) = current_thread()
            && !self.threads.contains(&tid)
            && self.threads.len() < THREADS_MAX
        {
            self.threads.push(tid);
        }
    }
}

/// This thread's id (Linux: `/proc/thread-self` links to `<pid>/task/<tid>`).
fn current_thread() -> Option<u32> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    std::fs::read_link("/proc/thread-self")
        .ok()?
        .file_name()?
        .to_str()?
        .parse()
        .ok()
}

/// The time `threads` have spent runnable but waiting for a core, summed (the second field of
/// `/proc/self/task/<tid>/schedstat`, in nanoseconds). A thread blocked on I/O or a timer adds
/// nothing: only a loop that wanted to run and could not. Other threads (the writer, HTTP, and
/// in the tests other daemons and brokers) are left out.
fn runnable_wait(threads: &[u32]) -> Option<Duration> {
    let mut total = 0u64;
    let mut any = false;
    for tid in threads {
        let Ok(text) = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")) else {
            continue;
        };
        if let Some(ns) = text
            .split_whitespace()
            .nth(1)
            .and_then(|f| f.parse::<u64>().ok())
        {
            total = total.saturating_add(ns);
            any = true;
        }
    }
    any.then(|| Duration::from_nanos(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread kept off the cores (more spinning threads than cores) shows run-queue wait; the
    /// measurement sees it and never reports more than the time it covered.
    #[test]
    fn a_busy_machine_shows_as_lag_and_an_idle_wait_does_not() {
        if current_thread().and_then(|t| runnable_wait(&[t])).is_none() {
            eprintln!("not run: no /proc/thread-self or schedstat here");
            return;
        }
        let mut lag = Lag::default();
        lag.start();
        let started = Instant::now();
        std::thread::sleep(Duration::from_millis(50));
        let idle = lag.take();
        assert!(idle <= started.elapsed(), "{idle:?}");
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinners: Vec<_> = (0..cores * 3)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        lag.start();
        let started = Instant::now();
        // Waking from each sleep, this thread waits for a core behind the spinners.
        for _ in 0..100 {
            std::thread::sleep(Duration::from_millis(2));
        }
        let busy = lag.take();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for s in spinners {
            s.join().unwrap();
        }
        assert!(busy > Duration::from_millis(2), "{busy:?}");
        assert!(
            busy <= started.elapsed() + Duration::from_millis(5),
            "{busy:?}"
        );
    }
}
