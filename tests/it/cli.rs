//! The `bucketd` binary as an operator runs it: SIGTERM commits, acknowledges and exits 0;
//! `export` prints every bucket and says clearly when a running daemon holds the file;
//! configuration errors exit 78 and name the key.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use bucketd::config::Protocol;

use crate::on_every_broker;
use crate::support::*;

/// `readings=N` from a "Committed batch." debug line.
fn committed_readings(line: &str) -> u64 {
    if !line.contains("Committed batch.") {
        return 0;
    }
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("readings="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

pub fn export(args: &[&str]) -> std::process::Output {
    Command::new(BIN).arg("export").args(args).output().unwrap()
}

async fn sigterm_commits_and_export_reads_it_back(broker: Broker, protocol: Protocol) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let config = write_config(dir.path(), &raw_config(&broker, protocol, &db, &topics));
    let work = workload(&topics, 7, 1000, 0);

    let daemon = Daemon::start(&config);
    daemon.wait_for_line("saying it subscribed", |l| {
        l.contains("Subscribed to every")
    });
    publish_all(&broker, &work.messages, 1).await;
    let mut committed = 0;
    let total = work.readings.len() as u64;
    daemon.wait_for_line("committing every reading", |l| {
        committed += committed_readings(l);
        committed >= total
    });
    assert_eq!(committed, total);

    // While the daemon holds the file, export refuses clearly.
    let held = export(&["--db", db.to_str().unwrap()]);
    assert_eq!(held.status.code(), Some(1));
    let message = String::from_utf8_lossy(&held.stderr);
    assert!(message.contains("in use by another process"), "{message}");

    let compact = |db: &Path| {
        Command::new(BIN)
            .args(["compact", "--db"])
            .arg(db)
            .output()
            .unwrap()
    };
    let held = compact(&db);
    assert_eq!(held.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&held.stderr).contains("in use by another process"));

    let (status, log) = daemon.terminate();
    assert_eq!(status.code(), Some(0), "SIGTERM exits 0; log: {log:#?}");
    assert!(
        log.iter().any(|l| l.contains("Shut down cleanly.")),
        "{log:#?}"
    );

    // NDJSON export: every field of every bucket against the ground truth.
    let out = export(&["--db", db.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let docs: Vec<bucketd::doc::BucketDoc> = lines.iter().map(doc_from_export).collect();
    let truth = truth(&work.readings, 3600);
    assert_matches_truth_but_quantiles(&docs, &truth);
    // Quantiles as exported, against the exact ones (buckets with device timestamps).
    for line in &lines {
        let start = bucketd::reading::Timestamp::parse(line["start"].as_str().unwrap()).unwrap();
        let key = (
            line["series"].as_str().unwrap().to_owned(),
            Some(start.as_nanos() / 1_000_000_000),
        );
        if let Some(want) = truth.get(&key) {
            for (name, q) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)] {
                assert_quantile(line[name].as_f64().unwrap(), want, q, &format!("{key:?}"));
            }
        }
    }

    // Filters: one series, a time range; CSV has a header and one line per bucket.
    let series = "d1/temperature";
    let want: Vec<_> = docs.iter().filter(|d| d.series == series).collect();
    let from = want[1].start.to_string();
    let csv = export(&[
        "--db",
        db.to_str().unwrap(),
        "--series",
        series,
        "--from",
        &from,
        "--format",
        "csv",
    ]);
    let csv = String::from_utf8(csv.stdout).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines[0], bucketd::export::CSV_HEADER);
    assert_eq!(lines.len() - 1, want.len() - 1, "{csv}");
    assert!(
        lines[1..]
            .iter()
            .all(|l| l.starts_with("d1/temperature,d1,temperature,"))
    );
    let to = bucketd::reading::Timestamp::from_secs(want[1].start).to_rfc3339_millis();
    let until = export(&[
        "--db",
        db.to_str().unwrap(),
        "--series",
        series,
        "--to",
        &to,
    ]);
    assert_eq!(String::from_utf8(until.stdout).unwrap().lines().count(), 1);

    // Raw readings: one line per reading with a device timestamp, in timestamp order.
    let raw = export(&[
        "--db",
        db.to_str().unwrap(),
        "--raw",
        "--series",
        series,
        "--format",
        "csv",
    ]);
    let raw = String::from_utf8(raw.stdout).unwrap();
    let mut want: Vec<(i64, f64)> = work
        .readings
        .iter()
        .filter(|r| r.series == series)
        .map(|r| (r.ts.unwrap(), r.value))
        .collect();
    want.sort_by_key(|r| r.0);
    let want: Vec<String> = want
        .iter()
        .map(|(ts, v)| {
            let ts = bucketd::reading::Timestamp::from_nanos(*ts).to_rfc3339_millis();
            format!("{series},{ts},{}", bucketd::export::number(*v))
        })
        .collect();
    let mut lines = raw.lines();
    assert_eq!(lines.next(), Some("series,ts,value"));
    assert_eq!(lines.collect::<Vec<_>>(), want);

    // Compaction keeps every bucket and reading.
    let before = export(&["--db", db.to_str().unwrap(), "--raw"]).stdout;
    let compacted = compact(&db);
    assert!(
        compacted.status.success(),
        "{}",
        String::from_utf8_lossy(&compacted.stderr)
    );
    assert!(String::from_utf8_lossy(&compacted.stdout).contains("bytes ->"));
    assert_eq!(
        export(&["--db", db.to_str().unwrap(), "--raw"]).stdout,
        before
    );

    let unknown = export(&["--db", db.to_str().unwrap(), "--series", "nope/x"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no series `nope/x`"));
}

on_every_broker!(sigterm_commits_and_export_reads_it_back);

/// Issue 51: a checkpoint that met a damaged document logged "bucketd stops", but the daemon
/// ran on until its next commit (minutes, or for ever on a quiet gateway), and `bucketd
/// export`, which that message recommends for reading "what is undamaged", refused the whole
/// file. Now the daemon stops at once with exit 1, and export writes every other series and
/// names the damaged one (exit 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_document_stops_the_daemon_and_export_reads_the_rest() {
    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("d.redb");
    let topics = Topics::new();
    let mut raw = raw_config(&broker, Protocol::V5, &db, &topics);
    raw.store.checkpoint_interval = Duration::from_secs(1);
    let config = write_config(dir.path(), &raw);
    let daemon = Daemon::start(&config);
    daemon.wait_for_line("saying it subscribed", |l| {
        l.contains("Subscribed to every")
    });
    let messages = [
        (topics.value("a", "x"), b"1".to_vec()),
        (topics.value("b", "x"), b"2".to_vec()),
    ];
    publish_all(&broker, &messages, 1).await;
    let mut committed = 0;
    daemon.wait_for_line("committing both readings", |l| {
        committed += committed_readings(l);
        committed >= 2
    });
    assert!(daemon.terminate().0.success());
    // The document of the series holding 1.0 garbled, as a failing card would.
    let damaged = {
        let reader = bucketd::store::StoreReader::open(&db).unwrap();
        let names = reader.series().unwrap();
        let total = |n: &str| reader.buckets(Some(n), i64::MIN, i64::MAX).unwrap()[0].count;
        assert_eq!(names.len(), 2);
        let name = names.into_iter().find(|n| {
            let docs = reader.buckets(Some(n), i64::MIN, i64::MAX).unwrap();
            docs[0].summary().total() == 1.0
        });
        let name = name.unwrap();
        assert_eq!(total(&name), 1);
        name
    };
    {
        use redb::ReadableTable;
        let file = redb::Database::open(&db).unwrap();
        let tx = file.begin_write().unwrap();
        {
            let by_name: redb::TableDefinition<&str, u64> =
                redb::TableDefinition::new("series_by_name");
            let buckets: redb::TableDefinition<(u64, i64), &[u8]> =
                redb::TableDefinition::new("buckets");
            let id = tx
                .open_table(by_name)
                .unwrap()
                .get(damaged.as_str())
                .unwrap()
                .unwrap()
                .value();
            let mut table = tx.open_table(buckets).unwrap();
            let key = {
                let mut range = table.range((id, i64::MIN)..=(id, i64::MAX)).unwrap();
                range.next().unwrap().unwrap().0.value()
            };
            table
                .insert(key, b"\x05\x00\x00\x00\x42garbage".as_slice())
                .unwrap();
        }
        tx.commit().unwrap();
    }
    let out = export(&["--db", db.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{stdout}");
    assert_eq!(lines[0]["sum"].as_f64(), Some(2.0), "{stdout}");
    assert!(
        stderr.contains(&format!("series `{damaged}` is unreadable")),
        "{stderr}"
    );
    // A reading of the damaged series: the checkpoint a second later meets the damage, and the
    // daemon stops by itself, with nothing else coming.
    let daemon = Daemon::start(&config);
    // The broker kept the session and its subscriptions.
    daemon.wait_for_line("saying it connected", |l| {
        l.contains("Connected to the MQTT broker")
    });
    publish_all(&broker, &messages[..1], 1).await;
    daemon.wait_for_line("naming the damage", |l| {
        l.contains("The database file is damaged")
    });
    let (status, _) = daemon
        .exits_within(Duration::from_secs(30))
        .expect("the daemon stops by itself once its writer has stopped");
    assert_eq!(status.code(), Some(1));
}

/// Rebuilds a stored document from an exported line, through the exported fields only.
pub fn doc_from_export(v: &serde_json::Value) -> bucketd::doc::BucketDoc {
    use bucketd::reading::Timestamp;
    use bucketd::summary::{Point, Summary};
    let ts = |s: &serde_json::Value| Timestamp::parse(s.as_str().unwrap()).unwrap().as_nanos();
    let start = ts(&v["start"]) / 1_000_000_000;
    let summary = Summary {
        count: v["count"].as_u64().unwrap(),
        sum: v["sum"].as_f64().unwrap(),
        sum_comp: 0.0,
        min: v["min"].as_f64().unwrap(),
        max: v["max"].as_f64().unwrap(),
        first: Point {
            ts: ts(&v["first"]["ts"]),
            value: v["first"]["value"].as_f64().unwrap(),
        },
        last: Point {
            ts: ts(&v["last"]["ts"]),
            value: v["last"]["value"].as_f64().unwrap(),
        },
        mean: v["mean"].as_f64().unwrap(),
        m2: v["m2"].as_f64().unwrap(),
        // Quantiles are checked from the exported p50/p90/p99 below, not rebuilt.
        sketch: bucketd::sketch::Sketch::new(bucketd::sketch::SketchParams::DEFAULT),
        // Not exported.
        inc: None,
    };
    for q in ["p50", "p90", "p99"] {
        let p = v[q].as_f64().unwrap_or_else(|| panic!("{q} in {v}"));
        assert!(
            summary.min <= p && p <= summary.max,
            "{q} {p} within min..max"
        );
    }
    let doc = bucketd::doc::BucketDoc::new(v["series"].as_str().unwrap(), start, 3600, &summary);
    assert_eq!(ts(&v["end"]) / 1_000_000_000, doc.end);
    assert_eq!(v["sensor"], doc.sensor.as_str());
    assert_eq!(v["stddev"].as_f64().unwrap(), summary.stddev());
    doc
}

/// `run` exits 78 (`EX_CONFIG`, so systemd does not restart-loop); `check-config` exits 1 as
/// DESIGN.md specifies for a validation tool. Both name the key.
#[test]
fn configuration_errors_name_the_key_and_exit_78_from_run() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[batch]\nflush_interval = \"soon\"\n").unwrap();
    for (args, code) in [
        (vec!["check-config", "--config"], 1),
        (vec!["run", "--config"], 78),
        (vec!["--config"], 78),
    ] {
        let out = Command::new(BIN).args(&args).arg(&bad).output().unwrap();
        assert_eq!(out.status.code(), Some(code), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("batch.flush_interval"), "{args:?}: {err}");
    }
    let out = Command::new(BIN)
        .arg("run")
        .env("BUCKETD__MQTT__NOPE", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope"));
}

#[test]
fn check_config_prints_the_effective_config_without_secrets() {
    let out = Command::new(BIN)
        .arg("check-config")
        .env("BUCKETD__MQTT__PORT", "1999")
        .env("BUCKETD__MQTT__USERNAME", "gw")
        .env("BUCKETD__MQTT__PASSWORD_FILE", "/run/credentials/mqtt")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("port = 1999"), "{text}");
    assert!(text.contains("[[subscriptions]]"), "{text}");
    let reparsed: toml::Table = text.parse().unwrap();
    assert_eq!(reparsed["mqtt"]["username"].as_str(), Some("gw"));
}

/// Issue 54: every example configuration in `deploy/examples/` is valid, and says which format
/// it reads; each format the README's table lists has one.
#[test]
fn every_example_configuration_passes_check_config() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/examples");
    let mut formats = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let out = Command::new(BIN)
            .args(["check-config", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let effective: toml::Table = String::from_utf8(out.stdout).unwrap().parse().unwrap();
        let subs = effective["subscriptions"].as_array().unwrap();
        assert_eq!(
            subs.len(),
            1,
            "{}: one subscription, the example's",
            path.display()
        );
        formats.insert(subs[0]["format"].as_str().unwrap().to_owned());
    }
    assert_eq!(
        formats.into_iter().collect::<Vec<_>>(),
        ["influx", "json", "senml", "sparkplug_b"]
    );
}

#[test]
fn a_missing_password_file_is_a_configuration_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .arg("run")
        .env("BUCKETD__MQTT__USERNAME", "gw")
        .env("BUCKETD__MQTT__PASSWORD_FILE", dir.path().join("missing"))
        .env("BUCKETD__STORE__PATH", dir.path().join("b.redb"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("mqtt.password_file"));
}

#[test]
fn help_lists_every_command() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    for command in ["run", "check-config", "export"] {
        assert!(help.contains(command), "{help}");
    }
}

/// systemd's notify protocol, with a test socket standing in for systemd: READY=1 once the
/// broker has the subscriptions (not before), WATCHDOG=1 at half of `WATCHDOG_USEC` from the
/// ingest loop, STOPPING=1 on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_hears_ready_watchdog_and_stopping() {
    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let config = write_config(
        dir.path(),
        &raw_config(&broker, Protocol::V5, &dir.path().join("b.redb"), &topics),
    );
    let socket_path = dir.path().join("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let next = || {
        let mut buf = [0u8; 256];
        let n = socket.recv(&mut buf).expect("a notification within 30 s");
        String::from_utf8_lossy(&buf[..n]).trim().to_owned()
    };
    let daemon = Daemon::start_with_env(
        &config,
        &[
            ("NOTIFY_SOCKET", socket_path.as_os_str()),
            ("WATCHDOG_USEC", std::ffi::OsStr::new("200000")),
        ],
    );
    let lines = daemon.wait_for_line("saying it subscribed", |l| {
        l.contains("Subscribed to every")
    });
    assert!(
        lines
            .iter()
            .any(|l| l.contains("Pinging the systemd watchdog")),
        "{lines:#?}"
    );
    // The first message is READY (nothing is sent before the broker has the subscriptions).
    let mut seen = vec![next()];
    assert_eq!(seen[0], "READY=1", "READY first");
    // Pings keep coming: every 100 ms with WatchdogSec=200ms.
    let started = std::time::Instant::now();
    for _ in 0..5 {
        seen.push(next());
    }
    assert!(seen[1..].iter().all(|m| m == "WATCHDOG=1"), "{seen:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "pings every 100 ms"
    );
    let (status, _) = daemon.terminate();
    assert!(status.success());
    let mut last = Vec::new();
    socket.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 256];
    while let Ok(n) = socket.recv(&mut buf) {
        last.push(String::from_utf8_lossy(&buf[..n]).trim().to_owned());
    }
    assert!(last.iter().any(|m| m == "STOPPING=1"), "{last:?}");
}
