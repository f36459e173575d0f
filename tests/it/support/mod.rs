//! Shared test harness, one module per noun; everything is re-exported here, so theme modules
//! import `crate::support::{..}` and never each other.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

mod broker;
mod daemon;
mod http;
mod publish;
mod strict;
mod truth;
mod wait;
mod workload;

pub use broker::*;
pub use daemon::*;
pub use http::*;
pub use publish::*;
pub use strict::*;
pub use truth::*;
pub use wait::*;
pub use workload::*;

/// Longest wait for anything a test waits on.
pub const WAIT: Duration = Duration::from_mins(1);

/// A name unique to this test process and call, for client ids and topic prefixes. Unique
/// across runs too: a shared broker keeps persistent sessions from earlier runs, and process ids
/// come back (a daemon whose client id an earlier run used found that run's session, with its
/// subscriptions and queued messages, and never subscribed). Short enough for MQTT 3.1.1's
/// 23-byte client ids with `bucketd-` in front.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    static RUN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let run = RUN.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let mut n = (nanos ^ (u128::from(std::process::id()) << 64)) % 36u128.pow(7);
        let mut s = String::new();
        for _ in 0..7 {
            s.push(char::from_digit((n % 36) as u32, 36).unwrap());
            n /= 36;
        }
        s
    });
    format!("{prefix}{run}x{}", NEXT.fetch_add(1, Ordering::Relaxed))
}
