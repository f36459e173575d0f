//! Shared test harness, one module per noun; everything is re-exported here, so theme modules
//! import `crate::support::{..}` and never each other.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

mod broker;
mod daemon;
mod http;
mod publish;
mod truth;
mod wait;
mod workload;

pub use broker::*;
pub use daemon::*;
pub use http::*;
pub use publish::*;
pub use truth::*;
pub use wait::*;
pub use workload::*;

/// Longest wait for anything a test waits on.
pub const WAIT: Duration = Duration::from_mins(1);

/// A name unique to this test process and call, for client ids and topic prefixes.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}{}x{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
