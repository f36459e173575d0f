//! systemd's service notifications (`sd_notify(3)`): READY=1 once the store is open and the
//! broker has our subscriptions, WATCHDOG=1 from the ingest loop itself (so a loop that stops
//! turning gets the service restarted), STOPPING=1 when shutdown begins. Without systemd
//! (`NOTIFY_SOCKET` unset) every call does nothing.

use std::time::Duration;

use sd_notify::NotifyState;
use tracing::debug;

fn send(state: NotifyState<'_>) {
    if let Err(e) = sd_notify::notify(&[state]) {
        debug!(error = %e, "Could not notify the service manager.");
    }
}

pub fn ready() {
    send(NotifyState::Ready);
}

pub fn stopping() {
    send(NotifyState::Stopping);
}

pub fn watchdog() {
    send(NotifyState::Watchdog);
}

/// How often to ping the watchdog: half of `WatchdogSec` (`WATCHDOG_USEC`), as systemd advises;
/// `None` when no watchdog is set for this process.
pub fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled()
        .filter(|d| !d.is_zero())
        .map(|d| d / 2)
}
