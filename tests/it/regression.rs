//! Every bug fixed so far whose story is in `git log`, one line each saying what broke, and the
//! test that fails if it comes back. The tests live with their theme (a unit test beside the
//! pure code it exercises, an end-to-end test in its theme module); this index is checked: each
//! test it names must exist, so it cannot silently go stale.

/// (commit, what broke, file, test function).
const BUGS: &[(&str, &str, &str, &str)] = &[
    (
        "fe7d625",
        "a connect dropped by select! left a 'present' session without subscriptions: never subscribed",
        "tests/it/crash.rs",
        "own_mosquitto_v5",
    ),
    (
        "fd428d1",
        "acks were dropped when rumqttc's request channel was full (a broker past its window)",
        "tests/it/ingest.rs",
        "a_broker_that_exceeds_the_window_loses_nothing",
    ),
    (
        "558b847",
        "a broker enforcing a window smaller than configured stalled ingestion until the interval",
        "src/ingest/core/sim.rs",
        "a_broker_window_smaller_than_asked_for_commits_once_per_window",
    ),
    (
        "59ef691",
        "a redelivery of a committed but unacknowledged message was counted twice",
        "tests/it/crash.rs",
        "kill_9_under_load_loses_nothing_and_counts_nothing_twice",
    ),
    (
        "891f27a",
        "Nagle-paced bursts (Mosquitto's default) were taken for a stalled window: 70 commits/s",
        "src/ingest/core/sim.rs",
        "bursts_paced_by_delayed_acks_are_not_stalls",
    ),
    (
        "d1c78a4",
        "the outbox merged into an entry a process before a restart may have shipped",
        "src/store/tests.rs",
        "at_its_bound_a_reopened_outbox_does_not_merge_into_entries_an_earlier_process_may_have_shipped",
    ),
    (
        "d1c78a4",
        "a commit merged into an outbox entry the forwarder had just read (lost or doubled)",
        "src/store/tests.rs",
        "an_entry_read_for_shipping_never_changes_while_commits_merge_at_the_bound",
    ),
    (
        "c43c174",
        "a forwarder retrying through an outage grew the outbox past its bound by one per retry",
        "src/store/tests.rs",
        "at_its_bound_the_outbox_merges_into_the_newest_entry_and_loses_nothing",
    ),
    (
        "060fddf",
        "a central's window of recent delta messages missed a late copy: applied twice",
        "tests/it/fleet/mqtt.rs",
        "a_central_applies_each_gateway_entry_once_however_late_the_copy",
    ),
    (
        "0ff01f2",
        "check-config exited 78 instead of 1 on a bad config",
        "tests/it/cli.rs",
        "configuration_errors_name_the_key_and_exit_78_from_run",
    ),
    (
        "4368bba",
        "the crash test 'lost' the tail of its stream: one end marker on its own topic arrived first",
        "tests/it/crash.rs",
        "kill_9_under_load_loses_nothing_and_counts_nothing_twice",
    ),
    (
        "0a4d3f4",
        "a strict broker's window was hidden by QoS 0 traffic (every message counted as an arrival)",
        "tests/it/windows.rs",
        "window_20_with_qos0_mixed_in",
    ),
    (
        "0a4d3f4",
        "a round trip over 100 ms made every batch a non-echo: a strict window was never learned",
        "tests/it/windows.rs",
        "window_20_round_trip_150ms",
    ),
    (
        "0a4d3f4",
        "after a reconnect, acks of the old connection were counted into the new broker's window",
        "tests/it/windows.rs",
        "window_20_reconnect_mid_stream",
    ),
    (
        "39101a5",
        "an oversized QoS 1 message over MQTT 3.1.1 reset every connection it was redelivered on",
        "tests/it/ingest.rs",
        "an_oversized_message_over_v311_is_rejected_not_redelivered_forever",
    ),
    (
        "f9894aa",
        "HTTP connections that never sent a request stayed open for good, each holding an fd",
        "tests/it/api.rs",
        "connections_that_never_send_a_request_cannot_pile_up",
    ),
    (
        "d298b7b",
        "a delta bucket counting i64::MAX, merged twice, aborted the central in a loop",
        "src/summary/tests.rs",
        "counts_from_untrusted_deltas_saturate_instead_of_panicking",
    ),
    (
        "2d734e0",
        "any publisher could write as any gateway, or silence one with a forged empty-origin position",
        "src/admit/tests.rs",
        "a_publisher_cannot_write_as_or_silence_another_gateway",
    ),
    (
        "2d734e0",
        "a repeated sketch bin index broke the counts and quantile reached unreachable!",
        "src/sketch/tests.rs",
        "a_repeated_or_descending_bin_index_is_refused_when_decoding",
    ),
    (
        "2d734e0",
        "one gateway could use up limits.max_series for every gateway of a central",
        "src/admit/tests.rs",
        "a_gateway_cannot_use_up_the_series_of_the_others",
    ),
    (
        "39c20e3",
        "a sketch saturated by merging was written to the commit log in bytes its decoder refused",
        "src/sketch/tests.rs",
        "a_sketch_saturated_by_merging_reads_back_as_written",
    ),
    (
        "39c20e3",
        "two i64::MAX-count deltas overflowed the batch's reading count",
        "src/batcher/tests.rs",
        "huge_delta_counts_saturate_the_batch_reading_count",
    ),
    (
        "d437059",
        "a connection's first window, which echoes no release, waited for the flush interval",
        "src/ingest/core/sim.rs",
        "the_first_window_of_a_connection_is_learned_from_its_refill",
    ),
    (
        "05d2db6",
        "a window learned from a slow random stream's chance pause committed every few messages",
        "src/ingest/core/sim.rs",
        "random_arrivals_are_not_taken_for_a_window_with_quick_acks",
    ),
    (
        "b897ff4",
        "a retention pass folded the log's rest and left bucketd_commit_log_bytes above 0",
        "src/writer/tests.rs",
        "the_writer_folds_the_whole_log_part_by_part_and_the_gauge_follows",
    ),
];

#[test]
fn every_fixed_bug_names_a_test_that_exists() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (commit, story, file, test) in BUGS {
        let text = std::fs::read_to_string(root.join(file))
            .unwrap_or_else(|e| panic!("{commit} ({story}): {file}: {e}"));
        assert!(
            text.contains(&format!("fn {test}(")),
            "{commit} ({story}): no `fn {test}` in {file}"
        );
    }
}
