//! Waiting for conditions that become true through work elsewhere (never a sleep standing in
//! for a wait).

use std::time::{Duration, Instant};

/// Polls `cond` until it holds; panics with `what` after `timeout`. For conditions that become
/// true through work elsewhere (never a sleep standing in for a wait).
pub async fn eventually(timeout: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn eventually_sync(timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out after {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// [`eventually`] for a condition that must itself wait (an HTTP scrape, a SQL query).
pub async fn eventually_async(timeout: Duration, what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
