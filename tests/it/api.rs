//! The HTTP API and metrics against a running daemon with a real broker: every endpoint, every
//! documented error, rollups against a ground truth computed here, `bucketd query`, and the
//! `/metrics` text checked by `promtool` (required in CI, which installs it).

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bucketd::config::Protocol;
use bucketd::daemon::{self, RunningDaemon};
use bucketd::export::number;
use bucketd::reading::Timestamp;
use bucketd::stats::Stats;
use serde_json::Value;

use crate::on_every_broker;
use crate::support::*;

const WAIT: Duration = Duration::from_mins(1);

/// Asserts a 4xx/5xx JSON error whose message mentions `needle`.
async fn assert_error(d: &RunningDaemon, path: &str, status: u16, needle: &str) {
    let (got, body) = get_json(d, path).await;
    assert_eq!(got, status, "{path}: {body}");
    let message = body["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{path}: {body}"));
    assert!(
        message.contains(needle),
        "{path}: {message:?} lacks {needle:?}"
    );
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Readings of series `day/t` covering every hour of the UTC day two days ago, several per
/// hour, published as JSON with device timestamps.
fn full_day(topics: &Topics) -> (i64, Workload) {
    let day = (now_secs() / 86_400 - 2) * 86_400;
    let mut w = Workload::default();
    for hour in 0..24 {
        for k in 0..5i64 {
            let ts_s = day + hour * 3600 + k * 700 + 13;
            let value = (hour * 10 + k) as f64 / 4.0 - 30.0;
            w.messages.push((
                topics.json("day"),
                format!("{{\"ts\": {ts_s}, \"t\": {}}}", number(value)).into_bytes(),
            ));
            w.readings.push(Expected {
                series: "day/t".into(),
                ts: Some(ts_s * 1_000_000_000),
                value,
            });
        }
    }
    (day, w)
}

async fn api_answers_from_the_store(broker: Broker, protocol: Protocol) {
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let cfg = config(&raw_config(
        &broker,
        protocol,
        &dir.path().join("b.redb"),
        &topics,
    ));
    let d = daemon::start(&cfg).unwrap();
    let (status, body) = http("GET", format!("http://{}/healthz", d.http_addr)).await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    wait_subscribed(&d).await;
    let (status, ready) = get_json(&d, "/readyz").await;
    assert_eq!(status, 200, "{ready}");

    let (
        day,
        Workload {
            messages, readings, ..
        },
    ) = full_day(&topics);
    let other = workload(&topics, 31, 300, 6);
    publish_paced(&broker, &messages, 1, Some(d.stats.clone())).await;
    publish_paced(&broker, &other.messages, 1, Some(d.stats.clone())).await;
    wait_ingested(
        &d,
        (readings.len() + other.readings.len()) as u64,
        other.rejected_total(),
    )
    .await;

    // Series: every name, sorted, split into sensor and metric.
    let (status, series) = get_json(&d, "/api/v1/series").await;
    assert_eq!(status, 200);
    let mut want: Vec<String> = readings
        .iter()
        .chain(&other.readings)
        .map(|r| r.series.clone())
        .collect();
    want.sort();
    want.dedup();
    let got: Vec<&str> = series["series"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        series["series"][0]["sensor"],
        want[0].split('/').next().unwrap()
    );

    // Hourly buckets of the day: 24, each equal to the truth of its hour.
    let hourly_truth = truth(&readings, 3600);
    let path = format!(
        "/api/v1/buckets?series=day/t&from={day}&to={}",
        day + 86_400
    );
    let (status, hourly) = get_json(&d, &path).await;
    assert_eq!(status, 200, "{hourly}");
    assert_eq!(hourly["step"], "1h");
    let buckets = hourly["buckets"].as_array().unwrap();
    assert_eq!(buckets.len(), 24);
    for b in buckets {
        let start = Timestamp::parse(b["start"].as_str().unwrap())
            .unwrap()
            .as_nanos()
            / 1_000_000_000;
        let want = &hourly_truth[&("day/t".to_owned(), Some(start))];
        assert_window(
            b,
            want.count,
            want.sum,
            want.min,
            want.max,
            want.variance.sqrt(),
            want.first,
            want.last,
        );
    }

    // Daily rollup: the merge of the 24 hours equals the day's truth computed directly.
    let (status, daily) = get_json(&d, &format!("{path}&step=1d")).await;
    assert_eq!(status, 200, "{daily}");
    assert_eq!(daily["step"], "1d");
    let days = daily["buckets"].as_array().unwrap();
    assert_eq!(days.len(), 1);
    assert_eq!(
        days[0]["start"],
        Timestamp::from_secs(day).to_rfc3339_millis()
    );
    assert_eq!(
        days[0]["end"],
        Timestamp::from_secs(day + 86_400).to_rfc3339_millis()
    );
    let values: Vec<f64> = readings.iter().map(|r| r.value).collect();
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let stddev = (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).sqrt();
    let first = readings
        .iter()
        .map(|r| (r.ts.unwrap(), r.value))
        .min_by_key(|p| p.0);
    let last = readings
        .iter()
        .map(|r| (r.ts.unwrap(), r.value))
        .max_by_key(|p| p.0);
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    assert_window(
        &days[0],
        values.len() as i64,
        values.iter().sum(),
        min,
        max,
        stddev,
        first,
        last,
    );
    assert!(close(days[0]["mean"].as_f64().unwrap(), mean, 1e-12));
    // Quantiles of the rollup come from the merged hourly sketches: within 1% of the exact.
    let mut sorted = values.clone();
    sorted.sort_by(f64::total_cmp);
    for (name, q) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)] {
        let exact = type7(&sorted, q);
        let got = days[0][name].as_f64().unwrap();
        assert!(quantile_close(got, exact), "{name}: {got} vs {exact:?}");
    }

    // Six-hour windows: four of them, 30 readings each.
    let (_, quarter) = get_json(&d, &format!("{path}&step=6h")).await;
    let counts: Vec<u64> = quarter["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["count"].as_u64().unwrap())
        .collect();
    assert_eq!(counts, [30, 30, 30, 30]);

    // `from` is inclusive on bucket starts, `to` exclusive; RFC 3339 works like epoch seconds.
    let from = Timestamp::from_secs(day + 3600).to_rfc3339_millis();
    let to = Timestamp::from_secs(day + 3 * 3600).to_rfc3339_millis();
    let (_, two) = get_json(
        &d,
        &format!("/api/v1/buckets?series=day/t&from={from}&to={to}"),
    )
    .await;
    assert_eq!(two["buckets"].as_array().unwrap().len(), 2);

    // Raw readings of the day, in timestamp order, and a limit that truncates.
    let raw_path = format!("/api/v1/raw?series=day/t&from={day}&to={}", day + 86_400);
    let (status, raw) = get_json(&d, &raw_path).await;
    assert_eq!(status, 200, "{raw}");
    let mut want_raw: Vec<(i64, f64)> = readings.iter().map(|r| (r.ts.unwrap(), r.value)).collect();
    want_raw.sort_by_key(|r| r.0);
    let got_raw: Vec<(String, f64)> = raw["readings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["ts"].as_str().unwrap().to_owned(),
                r["value"].as_f64().unwrap(),
            )
        })
        .collect();
    let want_text: Vec<(String, f64)> = want_raw
        .iter()
        .map(|(ts, v)| (Timestamp::from_nanos(*ts).to_rfc3339_millis(), *v))
        .collect();
    assert_eq!(got_raw, want_text);
    assert_eq!(raw["truncated"], false);
    let (_, limited) = get_json(&d, &format!("{raw_path}&limit=7")).await;
    assert_eq!(limited["readings"].as_array().unwrap().len(), 7);
    assert_eq!(limited["truncated"], true);
    assert_eq!(limited["readings"][6]["value"], want_raw[6].1);

    // Every documented error.
    let b = "/api/v1/buckets";
    assert_error(
        &d,
        &format!("{b}?from={day}&to={}", day + 1),
        400,
        "`series`",
    )
    .await;
    assert_error(
        &d,
        &format!("{b}?series=day/t&to={}", day + 1),
        400,
        "`from`",
    )
    .await;
    assert_error(&d, &format!("{b}?series=day/t&from={day}"), 400, "`to`").await;
    assert_error(
        &d,
        &format!("{b}?series=day/t&from=yesterday&to={day}"),
        400,
        "`from`",
    )
    .await;
    assert_error(
        &d,
        &format!("{b}?series=day/t&from={day}&to={day}"),
        400,
        "before `to`",
    )
    .await;
    assert_error(
        &d,
        &format!("{b}?series=day/t&from={}&to={day}", day + 1),
        400,
        "before `to`",
    )
    .await;
    assert_error(
        &d,
        &format!("{b}?series=nope&from={day}&to={}", day + 1),
        400,
        "`series`",
    )
    .await;
    assert_error(
        &d,
        &format!("{b}?series=no/such&from={day}&to={}", day + 1),
        404,
        "no series",
    )
    .await;
    assert_error(&d, &format!("{path}&step=90m"), 400, "`step`").await;
    assert_error(&d, &format!("{path}&step=often"), 400, "`step`").await;
    assert_error(
        &d,
        &format!("{b}?series=day/t&from=0&to={day}"),
        400,
        "max_buckets_per_query",
    )
    .await;
    for (query, status, needle) in [
        ("series=no/such", 404, "no series"),
        ("series=day/t&limit=0", 400, "`limit`"),
        ("series=day/t&limit=many", 400, "`limit`"),
        ("limit=5", 400, "`series`"),
    ] {
        let path = format!("/api/v1/raw?{query}&from={day}&to={}", day + 1);
        assert_error(&d, &path, status, needle).await;
    }
    assert_error(
        &d,
        &format!("/api/v1/raw?series=day/t&from={day}&to={day}"),
        400,
        "before `to`",
    )
    .await;
    assert_error(&d, "/api/v2/nothing", 404, "no such endpoint").await;

    // `bucketd query` prints the same answers.
    let url = format!("http://{}", d.http_addr);
    let from = day.to_string();
    let to = (day + 86_400).to_string();
    let out = query(
        &url,
        &[
            "buckets", "--series", "day/t", "--from", &from, "--to", &to, "--step", "1d",
            "--format", "json",
        ],
    );
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), daily);
    let table = query(
        &url,
        &["buckets", "--series", "day/t", "--from", &from, "--to", &to],
    );
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 25, "header and 24 hours:\n{table}");
    assert!(lines[0].starts_with("start"));
    assert!(lines[1].starts_with(&Timestamp::from_secs(day).to_rfc3339_millis()));
    let csv = query(&url, &["series", "--format", "csv"]);
    assert_eq!(csv.lines().count(), want.len() + 1);
    assert!(csv.contains("day/t,day,t\n"));
    let failed = Command::new(env!("CARGO_BIN_EXE_bucketd"))
        .args([
            "query", "--url", &url, "buckets", "--series", "no/such", "--from", &from, "--to", &to,
        ])
        .output()
        .unwrap();
    assert_eq!(failed.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&failed.stderr).contains("no series `no/such` (HTTP 404)"));

    check_metrics(&d, &other.rejected).await;
    d.stop().await.unwrap();
}

on_every_broker!(api_answers_from_the_store);

fn query(url: &str, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_bucketd"))
        .args(["query", "--url", url])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[allow(clippy::too_many_arguments)]
fn assert_window(
    b: &Value,
    count: i64,
    sum: f64,
    min: f64,
    max: f64,
    stddev: f64,
    first: Option<(i64, f64)>,
    last: Option<(i64, f64)>,
) {
    assert_eq!(b["count"].as_i64(), Some(count), "{b}");
    assert!(close(b["sum"].as_f64().unwrap(), sum, 1e-12), "{b}");
    assert_eq!(b["min"].as_f64(), Some(min), "{b}");
    assert_eq!(b["max"].as_f64(), Some(max), "{b}");
    assert!(
        (b["stddev"].as_f64().unwrap() - stddev).abs() <= 1e-9 * stddev.max(1.0),
        "{b}"
    );
    let point = |p: (i64, f64)| (Timestamp::from_nanos(p.0).to_rfc3339_millis(), p.1);
    let got = |v: &Value| {
        (
            v["ts"].as_str().unwrap().to_owned(),
            v["value"].as_f64().unwrap(),
        )
    };
    assert_eq!(got(&b["first"]), point(first.unwrap()), "{b}");
    assert_eq!(got(&b["last"]), point(last.unwrap()), "{b}");
}

/// `/metrics`: counters equal what the daemon did, rejections by reason, and the text passes
/// `promtool check metrics` (skipped with a note outside CI when promtool is not installed).
async fn check_metrics(d: &RunningDaemon, rejected: &BTreeMap<&'static str, u64>) {
    let (status, text) = http("GET", format!("http://{}/metrics", d.http_addr)).await;
    assert_eq!(status, 200);
    let value = |line_start: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {line_start} in\n{text}"))
    };
    assert_eq!(
        value("bucketd_readings_ingested_total ") as u64,
        Stats::get(&d.stats.readings_ingested)
    );
    assert_eq!(
        value("bucketd_messages_received_total ") as u64,
        Stats::get(&d.stats.messages_received)
    );
    for (reason, n) in rejected {
        let got = value(&format!(
            "bucketd_readings_rejected_total{{reason=\"{reason}\"}} "
        ));
        assert_eq!(got as u64, *n, "{reason}");
    }
    assert_eq!(value("bucketd_mqtt_connected "), 1.0);
    assert_eq!(value("bucketd_series ") as u64, Stats::get(&d.stats.series));
    assert!(value("bucketd_store_file_size_bytes ") > 0.0);
    assert!(value("process_resident_memory_bytes ") > 0.0);
    assert!(value("bucketd_flush_duration_seconds_count ") >= 1.0);
    assert_eq!(value("bucketd_store_writable "), 1.0);
    assert_eq!(value("bucketd_commit_errors_total "), 0.0);
    assert_eq!(
        value("bucketd_duplicates_total ") as u64,
        Stats::get(&d.stats.duplicates)
    );
    // The process has committed to its redb file, so storage writes were accounted.
    let written = value("bucketd_disk_written_bytes_total ");
    assert!(written > 0.0, "{written}");
    assert!(written as u64 <= bucketd::metrics::disk_written_bytes().unwrap());

    match Command::new("promtool")
        .arg("check")
        .arg("metrics")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(mut child) => {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(text.as_bytes())
                .unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "promtool check metrics failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("promtool not run ({e}); CI installs it");
        }
        Err(e) => panic!("promtool is required in CI: {e}"),
    }
}

/// `POST /api/v1/flush` commits what is pending at once, whatever the flush interval, and says
/// how many readings it committed. QoS 0 messages are used so that nothing else (the ack
/// window, a stall) can trigger a commit first.
async fn flush_commits_everything_pending_now(broker: Broker, protocol: Protocol) {
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let mut raw = raw_config(&broker, protocol, &dir.path().join("b.redb"), &topics);
    raw.batch.flush_interval = Duration::from_hours(1);
    // QoS 0 end to end (rumqttd's v5 listener delivers at the subscription's QoS); and no raw
    // pages for these readings.
    for sub in &mut raw.subscriptions {
        sub.qos = 0;
        sub.store_raw = false;
    }
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    let url = format!("http://{}/api/v1/flush", d.http_addr);
    let (status, body) = http("POST", url.clone()).await;
    assert_eq!((status, body.as_str()), (200, "{\"committed\":0}"));

    let messages: Vec<(String, Vec<u8>)> = (0..40)
        .map(|i| (topics.value("q", "x"), format!("{i}").into_bytes()))
        .collect();
    publish_all(&broker, &messages, 0).await;
    let stats = d.stats.clone();
    eventually(WAIT, "40 QoS 0 messages to arrive", || {
        Stats::get(&stats.messages_received) == 40
    })
    .await;
    assert_eq!(
        Stats::get(&stats.readings_ingested),
        0,
        "nothing commits before the hour"
    );
    let (status, body) = http("POST", url.clone()).await;
    assert_eq!((status, body.as_str()), (200, "{\"committed\":40}"));
    assert_eq!(Stats::get(&stats.readings_ingested), 40);
    let (status, _) = http("GET", url).await;
    assert_eq!(status, 405, "flush is POST only");
    let (from, to) = (now_secs() - 7200, now_secs() + 3600);
    let (_, buckets) = get_json(
        &d,
        &format!("/api/v1/buckets?series=q/x&from={from}&to={to}"),
    )
    .await;
    let counts: u64 = buckets["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["count"].as_u64().unwrap())
        .sum();
    assert_eq!(counts, 40);
    let (_, raw) = get_json(&d, &format!("/api/v1/raw?series=q/x&from={from}&to={to}")).await;
    assert_eq!(
        raw["readings"].as_array().unwrap().len(),
        0,
        "store_raw = false keeps no pages"
    );
    d.stop().await.unwrap();
}

on_every_broker!(flush_commits_everything_pending_now);

/// `/readyz` and `bucketd_mqtt_connected` tell the truth while the broker is unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_broker_connection() {
    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let proxy = Proxy::start(&broker.host, broker.v5_port).await;
    let mut raw = raw_config(&broker, Protocol::V5, &dir.path().join("b.redb"), &topics);
    raw.mqtt.port = proxy.port;
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    assert_eq!(get_json(&d, "/readyz").await.0, 200);
    proxy.set_up(false);
    let stats = d.stats.clone();
    eventually(WAIT, "the outage to be noticed", || {
        !stats.connected.load(Ordering::Relaxed)
    })
    .await;
    let (status, body) = get_json(&d, "/readyz").await;
    assert_eq!(status, 503);
    assert_eq!(body["mqtt_connected"], false);
    assert_eq!(body["store_writable"], true);
    let (_, text) = http("GET", format!("http://{}/metrics", d.http_addr)).await;
    assert!(text.contains("\nbucketd_mqtt_connected 0\n"), "{text}");
    assert_eq!(
        http("GET", format!("http://{}/healthz", d.http_addr))
            .await
            .0,
        200
    );
    proxy.set_up(true);
    eventually(WAIT, "the reconnect", || {
        stats.subscribed.load(Ordering::Relaxed)
    })
    .await;
    assert_eq!(get_json(&d, "/readyz").await.0, 200);
    d.stop().await.unwrap();
}

/// Retention in a running daemon: with raw readings kept 1 h and buckets 2 h, the background
/// passes delete a five-hour-old bucket, the raw pages of a 90-minute-old one (its summary
/// stays), and leave the current hour alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_expired_pages_and_buckets_in_a_running_daemon() {
    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let mut raw = raw_config(&broker, Protocol::V5, &dir.path().join("b.redb"), &topics);
    raw.store.raw_retention = Duration::from_hours(1);
    raw.store.bucket_retention = Duration::from_hours(2);
    raw.store.retention_interval = Duration::from_millis(100);
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    let now = now_secs();
    let hour = |t: i64| t.div_euclid(3600) * 3600;
    // The middle reading's bucket starts at the previous full hour: within the last two hours
    // (bucket kept) and more than one hour ago (raw pages expired).
    let (old, middle, recent) = (now - 5 * 3600, hour(now) - 3600 + 1, now);
    let messages: Vec<(String, Vec<u8>)> = [old, middle, recent]
        .iter()
        .map(|t| {
            (
                topics.json("r"),
                format!("{{\"ts\": {t}, \"x\": 1.5}}").into_bytes(),
            )
        })
        .collect();
    publish_all(&broker, &messages, 1).await;
    let stats = d.stats.clone();
    eventually(
        WAIT,
        "retention to delete the old bucket and the middle pages",
        || {
            Stats::get(&stats.readings_ingested) == 3
                && Stats::get(&stats.buckets_expired) >= 1
                && Stats::get(&stats.pages_expired) >= 2
        },
    )
    .await;
    let (from, to) = (now - 6 * 3600, now + 3600);
    let (_, buckets) = get_json(
        &d,
        &format!("/api/v1/buckets?series=r/x&from={from}&to={to}"),
    )
    .await;
    let starts: Vec<&str> = buckets["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["start"].as_str().unwrap())
        .collect();
    let at = |t: i64| Timestamp::from_secs(hour(t)).to_rfc3339_millis();
    assert_eq!(
        starts,
        [at(middle), at(recent)],
        "the five-hour-old bucket is gone"
    );
    let (_, raw) = get_json(&d, &format!("/api/v1/raw?series=r/x&from={from}&to={to}")).await;
    let times: Vec<&str> = raw["readings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["ts"].as_str().unwrap())
        .collect();
    assert_eq!(
        times,
        [Timestamp::from_secs(recent).to_rfc3339_millis()],
        "only recent raw"
    );
    let (_, text) = http("GET", format!("http://{}/metrics", d.http_addr)).await;
    assert!(
        text.contains("\nbucketd_buckets_expired_total 1\n"),
        "{text}"
    );
    d.stop().await.unwrap();
}

/// Clients that open connections and never finish a request (idle, or a half-sent head) past
/// `http.max_connections`: each is closed by the server (at once past the cap, after
/// `http.header_read_timeout` within it), counted, and the daemon keeps answering probes,
/// ingesting, and reconnecting to the broker while more of them arrive. Before, every such
/// connection stayed open for as long as its client liked, each holding a file descriptor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_send_a_request_cannot_pile_up() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let proxy = Proxy::start(&broker.host, broker.v5_port).await;
    let mut raw = raw_config(&broker, Protocol::V5, &dir.path().join("b.redb"), &topics);
    raw.mqtt.port = proxy.port;
    raw.http.max_connections = 4;
    raw.http.header_read_timeout = Duration::from_millis(500);
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    let stats = d.stats.clone();
    let hold = |n: usize| {
        let addr = d.http_addr.to_string();
        async move {
            let mut held = Vec::new();
            for i in 0..n {
                let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
                if i % 4 == 0 {
                    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                        .await
                        .unwrap();
                }
                held.push(s);
            }
            held
        }
    };
    let closed_by_server = |mut held: Vec<tokio::net::TcpStream>| async move {
        for (i, s) in held.iter_mut().enumerate() {
            let mut answer = Vec::new();
            let read = tokio::time::timeout(WAIT, s.read_to_end(&mut answer)).await;
            assert!(read.is_ok(), "connection {i} is still open");
            let answer = String::from_utf8_lossy(&answer);
            assert!(
                !answer.contains(" 200 "),
                "connection {i} was served: {answer}"
            );
        }
    };

    closed_by_server(hold(16).await).await;
    assert!(
        Stats::get(&stats.http_connections_refused) >= 12,
        "past the cap of 4: {}",
        Stats::get(&stats.http_connections_refused)
    );
    let (status, _) = http("GET", format!("http://{}/healthz", d.http_addr)).await;
    assert_eq!(status, 200);

    // Ingestion and a broker reconnect while another wave holds connections.
    let held = hold(16).await;
    let messages: Vec<(String, Vec<u8>)> = (0..20)
        .map(|i| (topics.value("cap", "x"), format!("{i}").into_bytes()))
        .collect();
    publish_all(&broker, &messages, 1).await;
    wait_ingested(&d, 20, 0).await;
    proxy.set_up(false);
    eventually(WAIT, "the outage to be noticed", || {
        !stats.connected.load(Ordering::Relaxed)
    })
    .await;
    proxy.set_up(true);
    eventually(WAIT, "the reconnect", || {
        stats.subscribed.load(Ordering::Relaxed)
    })
    .await;
    closed_by_server(held).await;
    let (_, text) = http("GET", format!("http://{}/metrics", d.http_addr)).await;
    assert!(
        text.contains("bucketd_http_connections_refused_total"),
        "{text}"
    );
    d.stop().await.unwrap();
}

/// Issue 41, as it was found: 40 clients that send the head of `POST /prom/api/v1/query` (or
/// `POST /api/v1/flush`) with `Content-Length: 65536` and never the body. Before, each held a
/// query turn while its handler waited for the body, with no timeout, and 32 of them filled
/// `http.max_connections`: no query was answered again and `/readyz` was refused. Now one
/// address holds at most `http.max_connections_per_address` connections (the rest are closed
/// and counted), the bodies are awaited before any turn is taken, and each slow request ends
/// with a 408 after `http.request_timeout`. All the while, another address is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_from_one_address_lock_out_no_one() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let mut raw = raw_config(&broker, Protocol::V5, &dir.path().join("s.redb"), &topics);
    raw.http.max_connections = 32;
    raw.http.max_connections_per_address = 8;
    raw.http.max_concurrent_queries = 4;
    raw.http.request_timeout = Duration::from_secs(3);
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    let stats = d.stats.clone();
    // The attacker: 127.0.0.2 (another address on the loopback interface).
    let mut slow = Vec::new();
    for i in 0..40 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut s = socket.connect(d.http_addr).await.unwrap();
        let path = if i % 2 == 0 {
            "/prom/api/v1/query"
        } else {
            "/api/v1/flush"
        };
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: \
             application/x-www-form-urlencoded\r\nContent-Length: 65536\r\n\r\nquery=1"
        );
        // A refused connection may be closed before the head is written.
        let _ = s.write_all(head.as_bytes()).await;
        slow.push(s);
    }
    eventually(
        WAIT,
        "the connections past the per-address cap to be refused",
        || Stats::get(&stats.http_connections_refused) >= 32,
    )
    .await;
    // Everyone else is answered meanwhile: queries, probes, the metrics.
    let (status, body) = http("GET", format!("http://{}/api/v1/series", d.http_addr)).await;
    assert_eq!(status, 200, "{body}");
    let (status, _) = http("GET", format!("http://{}/readyz", d.http_addr)).await;
    assert_eq!(status, 200);
    let (status, _) = http("GET", format!("http://{}/metrics", d.http_addr)).await;
    assert_eq!(status, 200);
    // Each slow request that was let in ends with a 408 and its connection closed; the others
    // were closed unanswered.
    let mut timed_out = 0;
    for (i, s) in slow.iter_mut().enumerate() {
        let mut answer = Vec::new();
        let read = tokio::time::timeout(WAIT, s.read_to_end(&mut answer)).await;
        assert!(read.is_ok(), "slow connection {i} is still open");
        let answer = String::from_utf8_lossy(&answer);
        if answer.starts_with("HTTP/1.1 408") {
            assert!(answer.contains("http.request_timeout"), "{answer}");
            timed_out += 1;
        } else {
            assert!(
                answer.is_empty(),
                "slow connection {i} was answered: {answer}"
            );
        }
    }
    assert_eq!(
        timed_out, 8,
        "one address's share of connections, each cut off"
    );
    d.stop().await.unwrap();
}

/// Issue 41: retention never freed a series, so `limits.max_series` was a lifetime cap (a
/// gateway that met it once refused every new sensor for ever). With room for two series,
/// one of which lapses: once retention has deleted its last bucket, a third series is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_series_whose_last_bucket_expires_frees_its_place() {
    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let mut raw = raw_config(&broker, Protocol::V5, &dir.path().join("f.redb"), &topics);
    raw.limits.max_series = 2;
    raw.store.raw_retention = Duration::from_hours(1);
    raw.store.bucket_retention = Duration::from_hours(2);
    raw.store.retention_interval = Duration::from_millis(100);
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    let stats = d.stats.clone();
    let now = now_secs();
    let reading = |sensor: &str, t: i64| {
        (
            topics.json(sensor),
            format!("{{\"ts\": {t}, \"x\": 1.5}}").into_bytes(),
        )
    };
    publish_all(
        &broker,
        &[reading("old", now - 5 * 3600), reading("keep", now)],
        1,
    )
    .await;
    wait_ingested(&d, 2, 0).await;
    eventually(WAIT, "retention to delete the lapsed series", || {
        Stats::get(&stats.buckets_expired) >= 1 && Stats::get(&stats.series) == 1
    })
    .await;
    // The next commit tells the ingest side; then a new series fits.
    publish_all(&broker, &[reading("keep", now + 1)], 1).await;
    wait_ingested(&d, 3, 0).await;
    publish_all(&broker, &[reading("new", now)], 1).await;
    wait_ingested(&d, 4, 0).await;
    let (_, series) = get_json(&d, "/api/v1/series").await;
    let names: Vec<&str> = series["series"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["keep/x", "new/x"]);
    assert_eq!(d.stats.rejected_total(), 0);
    d.stop().await.unwrap();
}

/// Issue 41: a request head is bounded (`http::HEAD_BYTES_MAX`, 64 KiB, against hyper's ~400 KB
/// default), so 32 connections hold at most ~2 MiB of heads: a head within it is answered, one
/// past it is a 431; answers far larger than the bound still go out whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_heads_are_bounded_and_large_answers_still_go_out() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let raw = raw_config(&broker, Protocol::V5, &dir.path().join("h.redb"), &topics);
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    // A head of exactly `head_bytes` bytes.
    let ask = |head_bytes: usize| {
        let addr = d.http_addr;
        async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            let frame =
                "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: \r\nConnection: close\r\n\r\n";
            let head = format!(
                "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: {}\r\nConnection: close\r\n\r\n",
                "a".repeat(head_bytes - frame.len())
            );
            assert_eq!(head.len(), head_bytes);
            let _ = s.write_all(head.as_bytes()).await;
            let mut answer = Vec::new();
            let _ = tokio::time::timeout(WAIT, s.read_to_end(&mut answer)).await;
            String::from_utf8_lossy(&answer).into_owned()
        }
    };
    let bound = bucketd::http::HEAD_BYTES_MAX;
    let at = ask(bound).await;
    assert!(
        at.starts_with("HTTP/1.1 200"),
        "{}",
        &at[..at.len().min(80)]
    );
    let past = ask(bound + 1).await;
    assert!(
        past.starts_with("HTTP/1.1 431"),
        "{}",
        &past[..past.len().min(80)]
    );
    // An answer of several times the bound: every reading of a day at one a second.
    let now = now_secs();
    let messages: Vec<(String, Vec<u8>)> = (0..20_000)
        .map(|i| {
            let t = now - 20_000 + i;
            (
                topics.json("big"),
                format!("{{\"ts\": {t}, \"x\": {i}}}").into_bytes(),
            )
        })
        .collect();
    publish_all(&broker, &messages, 1).await;
    wait_ingested(&d, 20_000, 0).await;
    let (status, body) = http(
        "GET",
        format!(
            "http://{}/api/v1/raw?series=big/x&from={}&to={}",
            d.http_addr,
            now - 30_000,
            now + 10
        ),
    )
    .await;
    assert_eq!(status, 200);
    assert!(body.len() > 8 * bound, "{} bytes", body.len());
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["readings"].as_array().unwrap().len(), 20_000);
    d.stop().await.unwrap();
}
