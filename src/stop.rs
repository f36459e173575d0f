//! A stop asked for by a signal, for the work that runs before the daemon's tasks (and their
//! cancellation token) exist: making the journal at a first start writes up to
//! `store.journal_size` (1 GiB at most, about 50 s on an SD card), and a SIGTERM meanwhile must
//! end it rather than wait for it. Set by `main`'s signal task; read by `store::journal`.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// A signal asked the process to stop.
pub fn request() {
    REQUESTED.store(true, Ordering::SeqCst);
}

/// Whether a signal asked the process to stop.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}
