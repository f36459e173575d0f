//! Crash safety: `kill -9` the daemon binary while a publisher streams QoS 1 readings through a
//! real broker, restart it each time, and at the end every bucket must equal the ground truth
//! exactly: nothing lost (the broker redelivers what was not acknowledged), and nothing counted
//! twice (redeliveries of what was already committed are recognised). Every other kill comes at
//! a random moment (mid-batch, mid-commit, between commit and acknowledgement); the others the
//! moment the daemon logs that a checkpoint starts (checkpoints every second here), so they
//! land during the checkpoint's transaction or right after it.
//!
//! `BUCKETD_CRASH_CYCLES=N` sets the number of kill/restart cycles (default 5, fast enough for
//! CI); a soak run uses 50 or more. Each run prints its figures on stderr
//! (`cargo test --test it crash -- --nocapture`), as docs/RELIABILITY.md records them.

use std::collections::BTreeMap;
use std::time::Duration;

use bucketd::config::Protocol;
use bucketd::store::StoreReader;

use crate::on_every_broker;
use crate::support::*;

/// Messages per second the publisher sends: a fleet's steady stream, and slow enough that what
/// the broker queues while the daemon restarts stays far below Mosquitto's default
/// `max_queued_messages` (1000), which would otherwise drop messages on the broker's side.
const RATE: u32 = 1000;

fn cycles() -> u32 {
    std::env::var("BUCKETD_CRASH_CYCLES")
        .ok()
        .map_or(5, |v| v.parse().expect("BUCKETD_CRASH_CYCLES is a number"))
}

async fn kill_9_under_load_loses_nothing_and_counts_nothing_twice(
    broker: Broker,
    protocol: Protocol,
) {
    kill_9_with_sessions(broker, protocol, 1).await;
}

on_every_broker!(kill_9_under_load_loses_nothing_and_counts_nothing_twice);

/// The same with `mqtt.sessions = 4`: four persistent sessions on one shared subscription, each
/// killed mid-window, redelivering on its own reconnect. On a Mosquitto of the test's own
/// (rumqttd 0.20 forgets a shared group whose members all disconnect) and on the external broker.
mod four_sessions {
    use bucketd::config::Protocol;

    use crate::own_mosquitto::OwnMosquitto;
    use crate::support::Broker;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn own_mosquitto_v311() {
        let mosquitto = OwnMosquitto::start(false, "");
        super::kill_9_with_sessions(Broker::own(&mosquitto), Protocol::V311, 4).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn own_mosquitto_v5() {
        let mosquitto = OwnMosquitto::start(false, "");
        super::kill_9_with_sessions(Broker::own(&mosquitto), Protocol::V5, 4).await;
    }

    /// A broker that enforces its window of 20 and hands a shared group's messages out in turn.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(upstream_mosquitto),
        ignore = "needs upstream Mosquitto 2.0.21: .ci/mosquitto-upstream builds it (apt-get source)"
    )]
    async fn upstream_mosquitto_v311() {
        let Some((_mosquitto, broker)) = Broker::upstream_mosquitto() else {
            return;
        };
        super::kill_9_with_sessions(broker, Protocol::V311, 4).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn external_v311() {
        let Some(broker) = Broker::external() else {
            eprintln!("not run: BUCKETD_TEST_MQTT is not set");
            return;
        };
        super::kill_9_with_sessions(broker, Protocol::V311, 4).await;
    }
}

async fn kill_9_with_sessions(broker: Broker, protocol: Protocol, sessions: u16) {
    let cycles = cycles();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let mut raw = raw_config(&broker, protocol, &db, &topics);
    // Many small commits: many moments where a commit has landed and its acks have not.
    raw.batch.flush_interval = Duration::from_millis(20);
    raw.store.checkpoint_interval = Duration::from_secs(1);
    raw.mqtt.sessions = sessions;
    let config = write_config(dir.path(), &raw);
    // Receive-time readings are recognised by DUP, which rumqttd does not set.
    let seed = 0xC4A5 + u64::from(cycles);
    let readings = cycles as usize * 1500;
    let work = if broker.sets_dup {
        workload(&topics, seed, readings, 0)
    } else {
        stamped_workload(&topics, seed, readings)
    };

    let mut daemon = Daemon::start(&config);
    let mut subscribed = 0;
    daemon.wait_for_line("saying every session subscribed", |l| {
        subscribed += usize::from(l.contains("Subscribed to every"));
        subscribed == usize::from(sessions)
    });
    let publisher = {
        let (broker, messages) = (broker.clone(), work.messages.clone());
        tokio::spawn(async move { publish_with(&broker, &messages, 1, Pace::Rate(RATE)).await })
    };
    let mut logs = Vec::new();
    let mut rng = Rng::new(seed);
    let mut kills = 0;
    let (mut at_checkpoint, mut mid_checkpoint) = (0, 0);
    while kills < cycles {
        let checkpointing = kills % 2 == 1;
        if checkpointing {
            logs.extend(daemon.wait_for_line("starting a checkpoint", |l| {
                l.contains("Checkpoint starting.")
            }));
            at_checkpoint += 1;
        } else {
            // A random moment: mid-batch, mid-commit, between commit and acknowledgement.
            tokio::time::sleep(Duration::from_millis(50 + rng.below(400))).await;
        }
        let (status, lines) = daemon.kill();
        // The checkpoint had not logged its end: the kill came during its transaction.
        mid_checkpoint +=
            usize::from(checkpointing && !lines.iter().any(|l| l.contains("Checkpoint: folded")));
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
        logs.extend(lines);
        logs.push(format!("==== killed (cycle {}) ====", kills + 1));
        kills += 1;
        daemon = Daemon::start(&config);
    }
    publisher.await.unwrap();
    // Markers on every topic: once the daemon has rejected all of them, every earlier message
    // has reached it (see `markers` for why one marker is not enough). With several sessions,
    // as many rounds: the broker hands a shared group's messages out in turn, so every session
    // gets markers after the last of its messages.
    let markers = markers(&work.messages);
    let markers: Vec<_> = std::iter::repeat_n(markers, usize::from(sessions))
        .flatten()
        .collect();
    publish_all(&broker, &markers, 1).await;
    let mut marked = 0;
    logs.extend(daemon.wait_for_line("rejecting every marker", |l| {
        marked += usize::from(l.contains("Rejected message.") && l.contains("empty_payload"));
        marked == markers.len()
    }));
    let (status, lines) = daemon.terminate();
    assert!(status.success(), "clean exit after the crashes: {status}");
    logs.extend(lines);

    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    let truth = truth(&work.readings, 3600);
    let (lost, twice) = lost_and_twice(&docs, &truth);
    let skipped = logs
        .iter()
        .filter(|l| l.contains("Skipped a message already counted."))
        .count();
    eprintln!(
        "crash test ({} {protocol:?}, {sessions} sessions): {kills} kill -9 cycles ({at_checkpoint} as a checkpoint \
         started, {mid_checkpoint} of them before it logged its end), {} messages, {} readings published; counted {}; lost {lost}; counted twice \
         {twice}; redeliveries recognised {skipped}",
        broker.name,
        work.messages.len(),
        work.readings.len(),
        docs.iter().map(|d| d.count).sum::<i64>(),
    );
    if (lost, twice) != (0, 0) {
        report_loss(&db, &work.readings, &logs);
    }
    assert_eq!((lost, twice), (0, 0), "readings lost and counted twice");
    assert_matches_truth(&docs, &truth);
}

/// Readings missing from, and counted twice in, the stored buckets, by count. Receive-time
/// series (whose bucket the test cannot know) are compared over all their buckets.
fn lost_and_twice(
    docs: &[bucketd::doc::BucketDoc],
    truth: &BTreeMap<TruthKey, Truth>,
) -> (i64, i64) {
    let mut diff: BTreeMap<TruthKey, i64> = BTreeMap::new();
    for (key, t) in truth {
        *diff.entry(key.clone()).or_default() -= t.count;
    }
    for d in docs {
        let whole_series = (d.series.clone(), None);
        let key = if diff.contains_key(&whole_series) {
            whole_series
        } else {
            (d.series.clone(), Some(d.start))
        };
        *diff.entry(key).or_default() += d.count;
    }
    let lost = diff.values().filter(|d| **d < 0).map(|d| -d).sum();
    let twice = diff.values().filter(|d| **d > 0).sum();
    (lost, twice)
}

/// On a loss: which readings (by publish order) are missing from the raw pages, and the daemon's
/// logs, so that the failure can be read after the fact (a file in the temp directory).
fn report_loss(db: &std::path::Path, readings: &[crate::support::Expected], logs: &[String]) {
    let mut stored: BTreeMap<(String, i64, u64), usize> = BTreeMap::new();
    StoreReader::open(db)
        .unwrap()
        .raw(None, i64::MIN, i64::MAX, |series, rs| {
            for (ts, v) in rs {
                *stored
                    .entry((series.to_owned(), *ts, v.to_bits()))
                    .or_default() += 1;
            }
            true
        })
        .unwrap();
    let mut missing = Vec::new();
    for (i, r) in readings.iter().enumerate() {
        let Some(ts) = r.ts else { continue };
        match stored.get_mut(&(r.series.clone(), ts, r.value.to_bits())) {
            Some(n) if *n > 0 => *n -= 1,
            _ => missing.push(i),
        }
    }
    let path = std::env::temp_dir().join(format!("bucketd-crash-{}.log", std::process::id()));
    std::fs::write(&path, logs.join("\n")).unwrap();
    eprintln!(
        "missing readings (publish order, of {}): {missing:?}; daemon logs in {}",
        readings.len(),
        path.display()
    );
}

/// Power cuts under QoS 1 load: the daemon runs in process over the simulated power supply of
/// `bucketd::store::Faults` (writes since the last fsync sit in a page cache; at a random write
/// or fsync the power fails and none of them, a prefix, or a prefix and a torn part of the next
/// reach the file), while a publisher streams readings through a real broker. After each cut
/// the "dead" daemon is stopped (nothing it does reaches the file or the broker as an
/// acknowledgement any more: every commit fails) and a new one opens the same file, which the
/// cut may have left mid-commit or mid-checkpoint. At the end every bucket equals the ground
/// truth: what was acknowledged survived the cut exactly once, what was not the broker
/// redelivered, and a commit the cut interrupted but that reached the disk is recognised.
/// Half the cycles commit with `durability = "two_phase"`. `BUCKETD_POWER_CUT_CYCLES=N` sets
/// the cuts per broker and protocol (default 8); docs/RELIABILITY.md records a long run.
async fn power_cuts_under_load_lose_nothing_and_count_nothing_twice(
    broker: Broker,
    protocol: Protocol,
) {
    use std::sync::Arc;

    use bucketd::config::Durability;
    use bucketd::daemon;
    use bucketd::decode::DecodeError;
    use bucketd::stats::Stats;
    use bucketd::store::{Cut, Faults};

    let cycles: u32 = std::env::var("BUCKETD_POWER_CUT_CYCLES")
        .ok()
        .map_or(8, |v| {
            v.parse().expect("BUCKETD_POWER_CUT_CYCLES is a number")
        });
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let mut raw = raw_config(&broker, protocol, &db, &topics);
    raw.batch.flush_interval = Duration::from_millis(20);
    raw.store.checkpoint_interval = Duration::from_secs(1);
    let seed = 0x9C07 + u64::from(cycles);
    // A cut comes within the first few chunks in most cycles, and after about eight in every
    // fourth (below); one that has not come within `budget` chunks is brought forward to the
    // next write, so no cycle takes more than its budget and one more chunk: the workload
    // (messages hold 9 readings on average) covers the most the cycles can take. (Under load
    // commits hold more messages each, so the same number of writes took more chunks, and a
    // fixed four chunks a cycle ran out: issue 58.)
    let budget = |cycle: u32| if cycle % 4 == 3 { 12 } else { 4 };
    let most: usize = (0..cycles).map(|c| budget(c) + 1).sum();
    let readings = most * CHUNK * 9;
    // Receive-time readings are recognised by DUP, which rumqttd does not set.
    let work = if broker.sets_dup {
        workload(&topics, seed, readings, 0)
    } else {
        stamped_workload(&topics, seed, readings)
    };
    // The persistent session exists before the first cut, as on a gateway that has run before
    // (a cut before the first subscription would lose what the broker had no session for).
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    d.stop().await.unwrap();
    // Published a chunk at a time, until the power fails: an idle daemon writes nothing, so
    // the load goes on as long as the cut has not come.
    let mut chunks = work.messages.chunks(CHUNK);
    let mut rng = Rng::new(seed);
    let (mut at_open, mut in_commit, mut acked_at_cut, mut recognised) = (0, 0, 0, 0);
    // Messages published, and acknowledged by a daemon (redeliveries of what an earlier one
    // acknowledged not counted again): what the broker still holds is about the difference.
    let (mut published, mut acked_distinct) = (0u64, 0u64);
    let wait = Duration::from_mins(1);
    for cycle in 0..cycles {
        raw.store.durability = if cycle % 2 == 1 {
            Durability::TwoPhase
        } else {
            Durability::Immediate
        };
        let cut = match rng.below(4) {
            0 => Cut::Nothing,
            1 => Cut::Prefix(rng.below(8) as usize),
            2 => Cut::Torn {
                n: rng.below(8) as usize,
                bytes: 1 + rng.below(8192) as usize,
            },
            // Every page the last write touched garbled, reverted or written (issue 42).
            _ => Cut::Pages {
                seed: rng.below(u64::MAX),
            },
        };
        let faults = Arc::new(Faults::default());
        // Counted from the file's opening, which writes too: some cuts land there. A commit is
        // two operations (the journal's write and sync), so most cuts come within the first
        // chunk or two; every fourth cycle runs on to the first checkpoint (1 s, hundreds of
        // operations).
        let ops = if cycle % 4 == 3 { 400 } else { 60 };
        faults.arm_power_cut(1 + rng.below(ops), cut);
        let d = match daemon::start_with_faults(&config(&raw), Some(faults.clone())) {
            Ok(d) => d,
            Err(e) => {
                assert!(
                    faults.power_is_off(),
                    "cycle {cycle}: the daemon does not start: {e}"
                );
                at_open += 1;
                continue;
            }
        };
        let mut published_now = 0;
        while !faults.power_is_off() {
            // What the broker holds unacknowledged for the session stays under its queue limit
            // (Mosquitto: max_queued_messages, 1,000, and Debian's 2.0.11 counts a reconnected
            // session's in-flight messages against it): past it the broker drops messages, a
            // loss that is not the daemon's. So a chunk waits until the daemons have
            // acknowledged all but BACKLOG_MAX of what was published (or the power fails).
            wait_for_backlog(published, acked_distinct, &d.stats, || {
                faults.power_is_off()
            })
            .await;
            if faults.power_is_off() {
                break;
            }
            if published_now == budget(cycle) {
                faults.hasten_power_cut();
            }
            let chunk = chunks
                .next()
                .unwrap_or_else(|| panic!("cycle {cycle}: the workload ended before the cut"));
            publish_with(&broker, chunk, 1, Pace::Rate(RATE)).await;
            published += chunk.len() as u64;
            published_now += 1;
        }
        let stats = d.stats.clone();
        // Every write is the writer thread's, and a commit counts once its last write is done:
        // the commits counted now are the ones made before the cut. (Their acknowledgements
        // may still be on their way: a loaded scheduler runs the loop that sends them later
        // than the test sees the power go, issue 58.)
        let commits = Stats::get(&stats.flushes);
        in_commit += u32::from(Stats::get(&stats.commit_errors) > 0);
        // The process is gone as far as the file is concerned; stopping it commits nothing more.
        let _ = d.stop().await;
        assert_eq!(
            Stats::get(&stats.flushes),
            commits,
            "cycle {cycle}: no commit succeeds after the cut, so nothing is acknowledged after it"
        );
        let acks = Stats::get(&stats.acks_sent);
        acked_at_cut += acks;
        acked_distinct += acks.saturating_sub(Stats::get(&stats.duplicates));
        recognised += Stats::get(&stats.duplicates);
    }
    let d = daemon::start(&config(&raw)).unwrap();
    let stats = d.stats.clone();
    // The rest the same way: a chunk at a time, the broker's backlog kept under its limit (a
    // debug build behind a broker that enforces a window of 20, upstream Mosquitto over 3.1.1,
    // falls behind 1,000 messages/s, and the broker then drops what it cannot queue).
    for chunk in chunks {
        wait_for_backlog(published, acked_distinct, &stats, || false).await;
        publish_with(&broker, chunk, 1, Pace::Rate(RATE)).await;
        published += chunk.len() as u64;
    }
    let markers = markers(&work.messages);
    publish_all(&broker, &markers, 1).await;
    eventually(wait, "every marker", || {
        stats.rejected(DecodeError::EmptyPayload) == markers.len() as u64
    })
    .await;
    d.stop().await.unwrap();
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    let truth = truth(&work.readings, 3600);
    let (lost, twice) = lost_and_twice(&docs, &truth);
    eprintln!(
        "power cuts under load ({} {protocol:?}): {cycles} cuts ({at_open} while opening, \
         {in_commit} with a failed commit), {acked_at_cut} messages acknowledged before the cuts, \
         {} messages, {} readings published; counted {}; lost {lost}; counted twice {twice}; \
         redeliveries recognised {}",
        broker.name,
        work.messages.len(),
        work.readings.len(),
        docs.iter().map(|d| d.count).sum::<i64>(),
        recognised + Stats::get(&stats.duplicates),
    );
    if (lost, twice) != (0, 0) {
        report_loss(&db, &work.readings, &[]);
    }
    assert_eq!((lost, twice), (0, 0), "readings lost and counted twice");
    assert_matches_truth(&docs, &truth);
}

on_every_broker!(power_cuts_under_load_lose_nothing_and_count_nothing_twice);

/// Messages the power-cut test publishes at a time.
const CHUNK: usize = 100;

/// Most messages the power-cut test lets the broker hold unacknowledged before it publishes the
/// next chunk: with a chunk on top, well under Mosquitto's default queue limit of 1,000.
const BACKLOG_MAX: u64 = 400;

/// Waits (a minute at most) until the broker holds at most [`BACKLOG_MAX`] of the `published`
/// messages unacknowledged: all but what earlier daemons acknowledged (`acked_before`, copies
/// not counted again) and what `stats`' daemon has, or until `gone` (the power failed).
async fn wait_for_backlog(
    published: u64,
    acked_before: u64,
    stats: &bucketd::stats::Stats,
    gone: impl Fn() -> bool,
) {
    use bucketd::stats::Stats;
    let acked = || {
        acked_before + Stats::get(&stats.acks_sent).saturating_sub(Stats::get(&stats.duplicates))
    };
    let since = std::time::Instant::now();
    while published.saturating_sub(acked()) > BACKLOG_MAX
        && !gone()
        && since.elapsed() < Duration::from_mins(1)
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
