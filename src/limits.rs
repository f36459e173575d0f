//! The bounds that depend on each other, in one place, each with the reason beside it and the
//! relation checked at compile time (or, where a config value takes part, at config
//! validation: see the note on each). Pure constants; every layer may use them.

use std::ops::RangeInclusive;
use std::time::Duration;

/// Requests the MQTT client's channel holds: the acknowledgements of two full windows (one
/// batch committing, one filling) plus room for SUBSCRIBE, PINGREQ and DISCONNECT. An ack that
/// does not fit waits in the ingest loop's backlog, in order, never dropped.
pub const fn ack_request_capacity(window: u16) -> usize {
    2 * window as usize + ACK_REQUEST_HEADROOM
}

/// Requests besides acknowledgements in the client's channel.
pub const ACK_REQUEST_HEADROOM: usize = 64;

/// A reconnect's burst of resends ends after this long without one (or four handshake times,
/// if longer), unless a new message ends it first (`crate::resend`). A broker writes its resends
/// back to back right after the CONNACK; ending a burst early could count the copies not yet
/// read as new, waiting longer only delays the first commit after a reconnect.
pub const RESEND_QUIET_MIN: Duration = Duration::from_millis(250);

/// How long shutdown waits for the last acknowledgements to reach the broker.
pub const SHUTDOWN_DRAIN_MAX: Duration = Duration::from_secs(10);

/// How long shutdown waits for the background tasks (forwarder, upkeep) to stop.
pub const TASKS_STOP_MAX: Duration = Duration::from_secs(10);

/// A final commit at shutdown on a slow SD card (the budget the stop timeout leaves for it).
pub const SHUTDOWN_COMMIT_BUDGET: Duration = Duration::from_secs(5);

/// `TimeoutStopSec=` of `deploy/bucketd.service` (a test reads the unit): systemd kills the
/// service after it, so a clean shutdown must fit well within.
pub const SYSTEMD_STOP_TIMEOUT: Duration = Duration::from_secs(30);

const _: () = assert!(
    SHUTDOWN_COMMIT_BUDGET.as_secs() + SHUTDOWN_DRAIN_MAX.as_secs() + TASKS_STOP_MAX.as_secs()
        < SYSTEMD_STOP_TIMEOUT.as_secs(),
    "a clean shutdown must end before systemd kills it"
);

/// `WatchdogSec=` of `deploy/bucketd.service` (a test reads the unit). The ingest loop pings
/// every half of it; nothing in that loop waits.
pub const SYSTEMD_WATCHDOG: Duration = Duration::from_secs(30);

/// Most outbox entries a gateway forwards in one batch (`upstream.batch_entries`, validated),
/// which is the most it sends again after a lost acknowledgement.
pub const UPSTREAM_BATCH_ENTRIES_MAX: usize = 1000;

/// Largest delta message a gateway publishes (one outbox entry is split into parts below it).
pub const DELTA_MESSAGE_BYTES_MAX: usize = 48 * 1024;

/// `limits.max_payload_bytes` by default (config/default.toml; a test compares them).
pub const MAX_PAYLOAD_BYTES_DEFAULT: usize = 64 * 1024;

const _: () = assert!(
    DELTA_MESSAGE_BYTES_MAX + 4096 <= MAX_PAYLOAD_BYTES_DEFAULT,
    "a central with default limits must accept every delta message, with room for the topic"
);

// Not a constant, so checked at config validation: `limits.dedup_window` must be at least
// `mqtt.receive_maximum`, since every message the broker may hold unacknowledged can come back
// after a crash and must be recognised (config.rs, "limits.dedup_window").

/// Smallest `store.checkpoint_bytes` (validated): below it checkpoints would come about as often
/// as commits, and each rewrites every bucket the log touched.
pub const MIN_CHECKPOINT_BYTES: u64 = 64 * 1024;

/// Bucket documents one checkpoint part writes at most (the writer folds the rest part by part,
/// committing batches in between, each bucket once per checkpoint): bounds how long a
/// checkpoint holds up commits, by what it writes. ~8 ms of documents on the development
/// machine, ~40 ms on a gateway core, plus the transaction's two syncs. A gateway's 200
/// sensors fold in one part.
pub const CHECKPOINT_PART_BUCKETS: usize = 256;

/// Buckets whose waiting deltas are kept merged for the readers (`store::merged`), over all
/// the commits waiting: ~0.3 KiB each with a small sketch, so ~5 MiB at most. A gateway's
/// thousand sensors use one or two buckets each between checkpoints; a series whose bucket
/// finds no room is read from the records instead, as fast as before the merging.
pub const MERGED_BUCKETS: usize = 16_384;

/// Smallest `store.journal_size` other than 0 (validated): the journal's header unit and 15
/// commits' records (each starts on a 16 KiB program unit).
pub const MIN_JOURNAL_BYTES: u64 = 256 * 1024;
/// Largest `store.journal_size` (validated): the journal is zero-filled at the first start, and
/// a size meant as bytes of something else ("16EiB") would write until the disk is full. 1 GiB
/// holds 65,535 commits, 18 hours of an outage of the checkpoint at a commit a second.
pub const MAX_JOURNAL_BYTES: u64 = 1 << 30;

/// `store.sketch_accuracy`, and the accuracy a delta's sketch may have at a central.
pub const SKETCH_ACCURACY: RangeInclusive<f64> = 0.0001..=0.2;

/// `store.sketch_max_bins`, and the bin bound a delta's sketch may have at a central (which
/// re-bins it into its own settings: see `admit`).
pub const SKETCH_MAX_BINS: RangeInclusive<u32> = 16..=65_536;

/// The most readings a delta's bucket may count per second of its width: a million a second
/// from one sensor is beyond any device; a count past it (`i64::MAX` for five readings) could
/// only be forged, and would pin the bucket at saturation for good (issue 52).
pub const DELTA_READINGS_PER_SEC_MAX: i64 = 1_000_000;

/// The widest bucket a delta may carry: a day (bucket widths divide a day).
pub const DELTA_WIDTH_SECS_MAX: i64 = 86_400;

/// The longest `origin` of a delta message (an RFC 3339 time).
pub const DELTA_ORIGIN_BYTES_MAX: usize = 64;

/// Deepest nesting of objects and arrays in a JSON payload, the payload's own object (or array)
/// counting as one: `serde_json`'s recursion limit (128 levels below its entry), which bucketd
/// keeps on. Deeper payloads are refused as `invalid_json`.
pub const JSON_DEPTH_MAX: usize = 127;

/// Sparkplug B: the metrics one payload may hold (counted on the wire before any is decoded).
pub const SPARKPLUG_METRICS_MAX: usize = 10_000;
/// Sparkplug B: the edge nodes whose births are kept.
pub const SPARKPLUG_NODES_MAX: usize = 1_000;
/// Sparkplug B: the metric names (and as many aliases) kept from births, all edge nodes
/// together: at most ~4 MiB (a name is at most `reading::NAME_BYTES_MAX` bytes).
pub const SPARKPLUG_NAMES_MAX: usize = 20_000;
/// Sparkplug B: the names and aliases one edge node's births may keep (its devices' too), so
/// that one node leaves room for the others.
pub const SPARKPLUG_NODE_NAMES_MAX: usize = 4_000;
/// Sparkplug B: rebirth requests sent at once at most, all nodes together, and how many more
/// each second allows (each node is asked at most once per `rebirth_interval`).
pub const SPARKPLUG_REBIRTHS_BURST: u32 = 100;
pub const SPARKPLUG_REBIRTHS_PER_SEC: u32 = 10;

/// Deepest nesting of documents and arrays in a delta message, checked on the raw bytes before
/// anything is deserialised (bson's deserialiser recurses once per level with no limit of its
/// own: 9,000 levels of an unknown field overflowed a worker's stack). A real message nests 4
/// deep: the message, `buckets`, a bucket, its `first`/`last`.
pub const DELTA_DEPTH_MAX: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    /// `key=value` of the unit file's `[Service]` section, as seconds.
    fn unit_secs(key: &str) -> u64 {
        let unit = include_str!("../deploy/bucketd.service");
        let value = unit
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("{key}= in deploy/bucketd.service"));
        value
            .trim()
            .strip_suffix('s')
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{key}={value} is in whole seconds"))
    }

    #[test]
    fn the_systemd_unit_agrees_with_the_limits() {
        assert_eq!(unit_secs("TimeoutStopSec"), SYSTEMD_STOP_TIMEOUT.as_secs());
        assert_eq!(unit_secs("WatchdogSec"), SYSTEMD_WATCHDOG.as_secs());
    }

    #[test]
    fn the_default_config_agrees_with_the_limits() {
        let defaults = crate::config::Config::load(None, Vec::new()).unwrap();
        assert_eq!(defaults.limits.max_payload_bytes, MAX_PAYLOAD_BYTES_DEFAULT);
        assert!(defaults.limits.dedup_window >= usize::from(defaults.mqtt.receive_maximum));
    }
}
