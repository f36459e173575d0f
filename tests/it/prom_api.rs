//! The Prometheus API (`/prom`) against a running daemon with a real broker and a real redb
//! file, read by clients nobody here wrote: `promtool query` (Prometheus's own Go client;
//! required in CI, which installs it) and the requests Grafana's Prometheus data source sends
//! when a panel loads. Every value is compared with a ground truth computed here.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use bucketd::config::Protocol;
use bucketd::daemon::{self, RunningDaemon};
use bucketd::export::number;
use serde_json::{Value, json};

use crate::support::*;

const TOKEN: &str = "prom-test-token";

/// Readings of `day/{t,h}` and `night/{t,h}` every 12 minutes of the UTC day two days ago
/// (night/h skips hour 9), as JSON with device timestamps.
fn two_sensors(topics: &Topics) -> (i64, Workload) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let day = (now / 86_400 - 2) * 86_400;
    let mut w = Workload::default();
    for (n, sensor) in ["day", "night"].into_iter().enumerate() {
        for hour in 0..24i64 {
            for k in 0..5i64 {
                let ts = day + hour * 3600 + k * 720 + 7;
                let t = (hour * 10 + k) as f64 / 4.0 - 10.0 * n as f64;
                let h = 40.0 + ((hour * 7 + k * 3) % 11) as f64 * 1.5;
                let mut fields = vec![("t", t)];
                if !(sensor == "night" && hour == 9) {
                    fields.push(("h", h));
                }
                let body: Vec<String> = fields
                    .iter()
                    .map(|(m, v)| format!("\"{m}\": {}", number(*v)))
                    .collect();
                w.messages.push((
                    topics.json(sensor),
                    format!("{{\"ts\": {ts}, {}}}", body.join(", ")).into_bytes(),
                ));
                for (m, v) in fields {
                    w.readings.push(Expected {
                        series: format!("{sensor}/{m}"),
                        ts: Some(ts * 1_000_000_000),
                        value: v,
                    });
                }
            }
        }
    }
    (day, w)
}

/// A daemon with the workload ingested, and an API token if `token`.
pub async fn daemon_with_data(token: bool) -> (tempfile::TempDir, RunningDaemon, i64, Workload) {
    daemon_keeping(token, true).await
}

/// [`daemon_with_data`], keeping the raw readings (`store_raw`) or not (as past
/// `store.raw_retention`).
pub async fn daemon_keeping(
    token: bool,
    store_raw: bool,
) -> (tempfile::TempDir, RunningDaemon, i64, Workload) {
    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let mut raw = raw_config(&broker, Protocol::V5, &dir.path().join("b.redb"), &topics);
    for sub in &mut raw.subscriptions {
        sub.store_raw = store_raw;
    }
    if token {
        let file = dir.path().join("token");
        std::fs::write(&file, TOKEN).unwrap();
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        raw.http.token_file = file.display().to_string();
    }
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    let (day, work) = two_sensors(&topics);
    publish_paced(&broker, &work.messages, 1, Some(d.stats.clone())).await;
    wait_ingested(&d, work.readings.len() as u64, 0).await;
    (dir, d, day, work)
}

pub fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// Runs `promtool query <args>` against the daemon's `/prom`, with the token as a header when
/// `token` (promtool 2.42 has `--header` for `range` only); its stdout, or its output as the
/// error. `None` outside CI when promtool is not installed.
fn promtool(d: &RunningDaemon, args: &[&str], token: bool) -> Option<Result<String, String>> {
    let server = format!("http://{}/prom", d.http_addr);
    let (last, flags) = args[1..]
        .split_last()
        .expect("a subcommand and its argument");
    let mut cmd = Command::new("promtool");
    cmd.arg("query").arg(args[0]);
    if token {
        cmd.arg(format!("--header=Authorization=Bearer {TOKEN}"));
    }
    cmd.args(flags).arg(&server).arg(last);
    match cmd.output() {
        Ok(out) if out.status.success() => Some(Ok(String::from_utf8(out.stdout).unwrap())),
        Ok(out) => Some(Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))),
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("promtool not run ({e}); CI installs it");
            None
        }
        Err(e) => panic!("promtool is required in CI: {e}"),
    }
}

/// The series of a matrix or vector, by their `series` label (or `metric` after an
/// aggregation), with (time in seconds, value) points.
fn by_series(result: &Value) -> BTreeMap<String, Vec<(f64, f64)>> {
    let point = |p: &Value| {
        (
            p[0].as_f64().unwrap(),
            p[1].as_str().unwrap().parse::<f64>().unwrap(),
        )
    };
    result
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {result}"))
        .iter()
        .map(|s| {
            let m = &s["metric"];
            let key = m["series"]
                .as_str()
                .or(m["metric"].as_str())
                .unwrap_or("")
                .to_owned();
            let points = match s.get("values") {
                Some(values) => values.as_array().unwrap().iter().map(point).collect(),
                None => vec![point(&s["value"])],
            };
            (key, points)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_reads_the_buckets_through_the_prometheus_api() {
    let (_dir, d, day, work) = daemon_with_data(false).await;
    let truth = truth(&work.readings, 3600);
    let (start, end) = (day.to_string(), (day + 23 * 3600).to_string());

    // Hourly means of one sensor: both its series, 24 points each, equal to the truth.
    let Some(out) = promtool(
        &d,
        &[
            "range",
            "-o",
            "json",
            &format!("--start={start}"),
            &format!("--end={end}"),
            "--step=1h",
            r#"bucketd_bucket_mean{sensor="day"}"#,
        ],
        false,
    ) else {
        return;
    };
    let got = by_series(&serde_json::from_str(&out.unwrap()).unwrap());
    assert_eq!(got.keys().collect::<Vec<_>>(), ["day/h", "day/t"]);
    for (series, points) in &got {
        assert_eq!(points.len(), 24, "{series}");
        for (t, v) in points {
            let want = &truth[&(series.clone(), Some(*t as i64))];
            assert!(close(*v, want.mean), "{series} @{t}: {v} vs {}", want.mean);
        }
    }

    // A step of a day merges the day's buckets exactly: every reading of the day.
    let out = promtool(
        &d,
        &[
            "range",
            "-o",
            "json",
            &format!("--start={start}"),
            &format!("--end={}", day + 3600),
            "--step=24h",
            r#"{__name__=~"bucketd_bucket_(count|max|sum)", series="night/h"}"#,
        ],
        false,
    )
    .unwrap()
    .unwrap();
    let result: Value = serde_json::from_str(&out).unwrap();
    let night_h: Vec<&crate::support::Expected> = work
        .readings
        .iter()
        .filter(|r| r.series == "night/h")
        .collect();
    let field = |name: &str| -> f64 {
        let s = result
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["metric"]["__name__"] == name)
            .unwrap_or_else(|| panic!("no {name} in {result}"));
        assert_eq!(s["values"].as_array().unwrap().len(), 1, "{s}");
        s["values"][0][1].as_str().unwrap().parse().unwrap()
    };
    assert_eq!(field("bucketd_bucket_count"), night_h.len() as f64);
    assert_eq!(field("bucketd_bucket_count"), 23.0 * 5.0, "hour 9 has none");
    let max = night_h.iter().map(|r| r.value).fold(f64::MIN, f64::max);
    assert_eq!(field("bucketd_bucket_max"), max);
    let sum: f64 = night_h.iter().map(|r| r.value).sum();
    assert!(close(field("bucketd_bucket_sum"), sum));

    // An instant query: the bucket containing the time; p99 as the JSON API gives it, and
    // within the sketch's accuracy of the exact quantile.
    let at = day + 7 * 3600 + 1800;
    let out = promtool(
        &d,
        &[
            "instant",
            "-o",
            "json",
            &format!("--time={at}"),
            r#"bucketd_bucket_p99{series="day/t"}"#,
        ],
        false,
    )
    .unwrap()
    .unwrap();
    let got = by_series(&serde_json::from_str(&out).unwrap());
    let (t, p99) = got["day/t"][0];
    assert_eq!(t, at as f64);
    let (_, buckets) = request(
        &d,
        "GET",
        "/api/v1/buckets",
        &[
            ("series", "day/t".into()),
            ("from", (day + 7 * 3600).to_string()),
            ("to", (day + 8 * 3600).to_string()),
        ],
    )
    .await;
    assert_eq!(json!(p99), buckets["buckets"][0]["p99"], "{buckets}");
    let want = &truth[&("day/t".to_owned(), Some(day + 7 * 3600))];
    assert_quantile(p99, want, 0.99, "p99 over the Prometheus API");

    // An aggregation: readings of `t` per hour over both sensors.
    let out = promtool(
        &d,
        &[
            "range",
            "-o",
            "json",
            &format!("--start={}", day + 8 * 3600),
            &format!("--end={}", day + 10 * 3600),
            "--step=1h",
            r#"sum by (metric) (bucketd_bucket_count{metric=~"t|h"})"#,
        ],
        false,
    )
    .unwrap()
    .unwrap();
    let got = by_series(&serde_json::from_str(&out).unwrap());
    let t = |h: i64| (day + h * 3600) as f64;
    assert_eq!(got["t"], [(t(8), 10.0), (t(9), 10.0), (t(10), 10.0)]);
    assert_eq!(got["h"], [(t(8), 10.0), (t(9), 5.0), (t(10), 10.0)]);

    // Label values.
    let out = promtool(&d, &["labels", "sensor"], false).unwrap().unwrap();
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), ["day", "night"]);

    // What is not supported is a bad_data error naming it; no token, no answer.
    let err = promtool(&d, &["instant", "histogram_count(bucketd_reading)"], false)
        .unwrap()
        .unwrap_err();
    assert!(
        err.contains("bad_data") && err.contains("function `histogram_count` is not supported"),
        "{err}"
    );
    d.stop().await.unwrap();
}

/// The `data` of a Prometheus API answer, after checking that it is a success.
fn success((status, body): (u16, Value)) -> Value {
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("success")),
        "{body}"
    );
    body["data"].clone()
}

/// A `query_range` form as Grafana posts it: the query, start and end in seconds, the step.
fn range_form(query: &str, start: i64, end: i64, step: &str) -> [(&'static str, String); 4] {
    [
        ("query", query.to_owned()),
        ("start", start.to_string()),
        ("end", end.to_string()),
        ("step", step.to_owned()),
    ]
}

/// One request as Grafana's data source makes it to `/prom` + `path`.
async fn grafana(
    d: &RunningDaemon,
    method: &'static str,
    path: &str,
    form: &[(&str, String)],
) -> (u16, Value) {
    request(d, method, &format!("/prom{path}"), form).await
}

/// One request with the token (as a header, as Grafana's custom headers send it) and `form` as
/// a POST body or the URL's query; the JSON answer.
async fn request(
    d: &RunningDaemon,
    method: &'static str,
    path: &str,
    form: &[(&str, String)],
) -> (u16, Value) {
    let url = format!("http://{}{path}", d.http_addr);
    let body = serde_urlencoded::to_string(form).unwrap();
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let auth = format!("Bearer {TOKEN}");
        let response = match method {
            "POST" => agent
                .post(&url)
                .header("Authorization", &auth)
                .header("Content-Type", "application/x-www-form-urlencoded")
                .send(body.as_bytes()),
            _ => agent
                .get(format!("{url}?{body}"))
                .header("Authorization", &auth)
                .call(),
        }
        .unwrap();
        let status = response.status().as_u16();
        let text = response.into_body().read_to_string().unwrap();
        let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{url}: {e}: {text}"));
        (status, value)
    })
    .await
    .unwrap()
}

/// The requests Grafana's Prometheus data source sends when a dashboard panel loads (and its
/// "Save & test"): build info, the health check `1+1`, label names and values, the metric
/// metadata, and the range query as a POST form with start/end in float seconds and a numeric
/// step. Each answer in Prometheus's shape, the values equal to the truth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grafanas_requests_get_prometheus_answers() {
    let (_dir, d, day, work) = daemon_with_data(true).await;
    let truth = truth(&work.readings, 3600);
    let ok = success;
    let build = ok(grafana(&d, "GET", "/api/v1/status/buildinfo", &[]).await);
    assert!(build["version"].is_string(), "{build}");
    // On load Grafana asks for the rules (its alerting page shows "Errors loading rules" on a
    // 404): none, in Prometheus's shape.
    let rules = ok(grafana(&d, "GET", "/api/v1/rules", &[]).await);
    assert_eq!(rules, json!({"groups": []}));

    let now = format!("{}.123", day + 2 * 86_400);
    let health = ok(grafana(
        &d,
        "POST",
        "/api/v1/query",
        &[("query", "1+1".into()), ("time", now.clone())],
    )
    .await);
    assert_eq!(
        health,
        json!({"resultType": "scalar", "result": [day as f64 + 2.0 * 86_400.0 + 0.123, "2"]})
    );

    let range = [
        ("start", format!("{}.000", day - 86_400)),
        ("end", format!("{}.999", day + 86_400)),
    ];
    let labels = ok(grafana(&d, "POST", "/api/v1/labels", &range).await);
    assert_eq!(labels, json!(["__name__", "metric", "sensor", "series"]));
    let names = ok(grafana(&d, "GET", "/api/v1/label/__name__/values", &range).await);
    // bucketd's ten names, and each series' Prometheus name (`<sensor>_<metric>`).
    assert_eq!(names.as_array().unwrap().len(), 10 + 4, "{names}");
    for native in ["day_h", "day_t", "night_h", "night_t"] {
        assert!(
            names.as_array().unwrap().contains(&json!(native)),
            "{names}"
        );
    }
    assert!(
        names
            .as_array()
            .unwrap()
            .contains(&json!("bucketd_reading"))
    );
    assert!(
        names
            .as_array()
            .unwrap()
            .contains(&json!("bucketd_bucket_p90"))
    );
    let values = ok(grafana(
        &d,
        "GET",
        "/api/v1/label/series/values",
        &[("match[]", r#"{sensor="night"}"#.into())],
    )
    .await);
    assert_eq!(values, json!(["night/h", "night/t"]));
    let meta = ok(grafana(&d, "GET", "/api/v1/metadata", &[]).await);
    assert_eq!(meta["bucketd_bucket_mean"][0]["type"], "gauge");
    let series = ok(grafana(
        &d,
        "GET",
        "/api/v1/series",
        &[("match[]", r#"bucketd_bucket_max{sensor="day"}"#.into())],
    )
    .await);
    assert_eq!(
        series,
        json!([
            {"__name__": "bucketd_bucket_max", "metric": "h", "sensor": "day", "series": "day/h"},
            {"__name__": "bucketd_bucket_max", "metric": "t", "sensor": "day", "series": "day/t"},
        ])
    );
    // Issue 55: the plain readings selector Explore writes when a user picks the metric: the
    // last reading within Prometheus's 5-minute look-back, from the raw readings.
    let mut day_h: Vec<(i64, f64)> = work
        .readings
        .iter()
        .filter(|r| r.series == "day/h")
        .map(|r| (r.ts.expect("device time"), r.value))
        .collect();
    day_h.sort_by_key(|r| r.0);
    let (ts, _) = day_h[day_h.len() / 2];
    let at_ms = ts / 1_000_000 + 1000;
    let want = day_h
        .iter()
        .rev()
        .find(|r| r.0 <= at_ms * 1_000_000)
        .filter(|r| at_ms * 1_000_000 - r.0 < 300_000_000_000)
        .map(|r| r.1)
        .expect("a reading within the look-back");
    let instant = ok(grafana(
        &d,
        "GET",
        "/api/v1/query",
        &[
            ("query", r#"bucketd_reading{series="day/h"}"#.into()),
            ("time", format!("{}.{:03}", at_ms / 1000, at_ms % 1000)),
        ],
    )
    .await);
    assert_eq!(
        instant["result"][0]["metric"]["__name__"],
        "bucketd_reading"
    );
    assert_eq!(
        instant["result"][0]["value"][1],
        json!(bucketd::promql::format_value(want)),
        "{instant}"
    );
    // Grafana's metric browser narrows with `match[]=<the chosen metric>`; choosing
    // the readings' metric, which `/label/__name__/values` lists, was a 400.
    let readings = [("match[]", r#"bucketd_reading{sensor="day"}"#.to_owned())];
    let series = ok(grafana(&d, "GET", "/api/v1/series", &readings).await);
    assert_eq!(
        series,
        json!([
            {"__name__": "bucketd_reading", "metric": "h", "sensor": "day", "series": "day/h"},
            {"__name__": "bucketd_reading", "metric": "t", "sensor": "day", "series": "day/t"},
        ])
    );
    let labels = ok(grafana(&d, "GET", "/api/v1/labels", &readings).await);
    assert_eq!(labels, json!(["__name__", "metric", "sensor", "series"]));
    let names = ok(grafana(&d, "GET", "/api/v1/label/__name__/values", &readings).await);
    assert_eq!(names, json!(["bucketd_reading"]));
    let either = [(
        "match[]",
        r#"{__name__=~"bucketd_reading|bucketd_bucket_max", series="day/h"}"#.to_owned(),
    )];
    let names = ok(grafana(&d, "GET", "/api/v1/label/__name__/values", &either).await);
    assert_eq!(names, json!(["bucketd_bucket_max", "bucketd_reading"]));

    // The panel's query: hourly max of day/h over its day, the step Grafana computed (900 s
    // here: the hour's value at each quarter).
    let mut form = vec![
        ("query", r#"bucketd_bucket_max{series="day/h"}"#.to_owned()),
        ("start", format!("{day}.000")),
        ("end", format!("{}.000", day + 86_400 - 900)),
        ("step", "900".into()),
    ];
    let data = ok(grafana(&d, "POST", "/api/v1/query_range", &form).await);
    assert_eq!(data["resultType"], "matrix");
    let got = by_series(&data["result"]);
    assert_eq!(got["day/h"].len(), 96);
    for (t, v) in &got["day/h"] {
        let hour = (*t as i64).div_euclid(3600) * 3600;
        assert_eq!(*v, truth[&("day/h".to_owned(), Some(hour))].max, "@{t}");
    }
    // The same as GET.
    let (_, get) = grafana(&d, "GET", "/api/v1/query_range", &form).await;
    assert_eq!(get["data"], data);

    // Errors in Prometheus's shape.
    form.retain(|(k, _)| *k != "step");
    let (status, body) = grafana(&d, "POST", "/api/v1/query_range", &form).await;
    assert_eq!(status, 400);
    assert_eq!(body["status"], "error");
    assert_eq!(body["errorType"], "bad_data");
    assert!(body["error"].as_str().unwrap().contains("step"), "{body}");
    form.push(("step", "90m".into()));
    let (status, body) = grafana(&d, "POST", "/api/v1/query_range", &form).await;
    assert_eq!(
        (status, &body["errorType"]),
        (400, &json!("bad_data")),
        "{body}"
    );
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("whole number of buckets"),
        "{body}"
    );
    let (status, body) = grafana(&d, "GET", "/api/v1/series", &[]).await;
    assert_eq!(
        (status, &body["errorType"]),
        (400, &json!("bad_data")),
        "{body}"
    );
    let many: Vec<(&str, String)> = (0..9)
        .map(|i| ("match[]", format!("{{sensor=~\"s{i}.*\"}}")))
        .collect();
    let (status, body) = grafana(&d, "POST", "/api/v1/series", &many).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("at most 8 match[]"),
        "{body}"
    );

    // The token guards /prom as it guards /api: Prometheus's Go client with and without it.
    let query = [
        "range",
        "-o",
        "json",
        &format!("--start={day}"),
        &format!("--end={}", day + 3600),
        "--step=1h",
        r#"bucketd_bucket_count{series="day/t"}"#,
    ];
    if let Some(with) = promtool(&d, &query, true) {
        let got = by_series(&serde_json::from_str(&with.unwrap()).unwrap());
        assert_eq!(
            got["day/t"],
            [(day as f64, 5.0), ((day + 3600) as f64, 5.0)]
        );
        let without = promtool(&d, &query, false).unwrap().unwrap_err();
        assert!(without.contains("401"), "{without}");
    }
    d.stop().await.unwrap();
}

/// Issue 44: what gauge dashboards and alert rules send, answered from the buckets as
/// Prometheus would answer from the readings: range functions over a day, arithmetic, the
/// "went silent" alert, steps of whole buckets, and label endpoints honouring start, end and
/// limit. Ground truth: the readings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alert_queries_match_the_readings() {
    let (_dir, d, day, work) = daemon_with_data(true).await;
    let truth = truth(&work.readings, 3600);
    let ok = success;
    let instant = async |query: &str, at: i64| {
        let data = ok(grafana(
            &d,
            "POST",
            "/api/v1/query",
            &[("query", query.to_owned()), ("time", at.to_string())],
        )
        .await);
        let result = data["result"].as_array().unwrap().clone();
        assert_eq!(result.len(), 1, "{query}: {data}");
        result[0]["value"][1]
            .as_str()
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    let readings = |series: &str| -> Vec<f64> {
        let mut v: Vec<f64> = work
            .readings
            .iter()
            .filter(|r| r.series == series)
            .map(|r| r.value)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let end = day + 86_400;
    let all = readings("day/t");
    let p99 = instant(
        r#"quantile_over_time(0.99, bucketd_reading{series="day/t"}[1d])"#,
        end,
    )
    .await;
    assert!(
        quantile_close(p99, type7(&all, 0.99)),
        "{p99} vs {:?}",
        type7(&all, 0.99)
    );
    let max = instant(r#"max_over_time(bucketd_reading{series="day/h"}[1d])"#, end).await;
    assert_eq!(max, *readings("day/h").last().unwrap());
    let count = instant(
        r#"count_over_time(bucketd_reading{series="night/h"}[1d])"#,
        end,
    )
    .await;
    assert_eq!(count as usize, readings("night/h").len());
    let mean = instant(r#"avg_over_time(bucketd_reading{series="day/t"}[1d])"#, end).await;
    let exact = all.iter().sum::<f64>() / all.len() as f64;
    assert!(close(mean, exact), "{mean} vs {exact}");
    // An hour's value a day later, shifted back.
    let shifted = instant(
        r#"bucketd_bucket_max{series="day/t"} offset 1d"#,
        end + 3 * 3600,
    )
    .await;
    assert_eq!(
        shifted,
        truth[&("day/t".to_owned(), Some(day + 3 * 3600))].max
    );

    // Fahrenheit, hourly.
    let form = range_form(
        r#"bucketd_bucket_mean{series="day/t"} * 1.8 + 32"#,
        day,
        day + 5 * 3600,
        "3600",
    );
    let data = ok(grafana(&d, "POST", "/api/v1/query_range", &form).await);
    let values = data["result"][0]["values"].as_array().unwrap();
    assert_eq!(values.len(), 6);
    for v in values {
        let t = v[0].as_i64().unwrap();
        let got: f64 = v[1].as_str().unwrap().parse().unwrap();
        let want = truth[&("day/t".to_owned(), Some(t))].mean * 1.8 + 32.0;
        assert!(close(got, want), "@{t}: {got} vs {want}");
    }
    assert!(data["result"][0]["metric"].get("__name__").is_none());

    // The "went silent" alert: night/h has no reading in hour 9.
    let form = range_form(
        r#"absent_over_time(bucketd_reading{series="night/h"}[1h])"#,
        day + 9 * 3600,
        day + 11 * 3600,
        "3600",
    );
    let data = ok(grafana(&d, "POST", "/api/v1/query_range", &form).await);
    assert_eq!(
        data["result"][0]["values"],
        json!([[day + 10 * 3600, "1"]]),
        "{data}"
    );
    assert_eq!(data["result"][0]["metric"], json!({"series": "night/h"}));

    // A step of five buckets, on the query's own grid (Grafana's, here UTC-3's midnight).
    let form = range_form(
        r#"bucketd_bucket_count{series="day/t"}"#,
        day + 3 * 3600,
        day + 13 * 3600,
        "5h",
    );
    let data = ok(grafana(&d, "POST", "/api/v1/query_range", &form).await);
    assert_eq!(
        data["result"][0]["values"],
        json!([
            [day + 3 * 3600, "25"],
            [day + 8 * 3600, "25"],
            [day + 13 * 3600, "25"]
        ])
    );

    // A daily panel in a browser at UTC+2: Grafana aligns start and end to the step in the
    // browser's offset (its `alignRange(start, end, step, utcOffsetSec)`, in
    // packages/grafana-prometheus/src/datasource.ts: floor((t + offset) / step) * step -
    // offset), so its points are local midnights, and each day's point is that local day.
    let align = |t: i64, step: i64, offset: i64| (t + offset).div_euclid(step) * step - offset;
    let (start, end) = (
        align(day + 3600, 86_400, 7200),
        align(day + 86_400, 86_400, 7200),
    );
    assert_eq!((start, end), (day - 7200, day + 86_400 - 7200));
    let form = range_form(
        r#"bucketd_bucket_count{series="day/t"}"#,
        start,
        end,
        "86400",
    );
    let data = ok(grafana(&d, "POST", "/api/v1/query_range", &form).await);
    let local_day = |from: i64, to: i64| {
        work.readings
            .iter()
            .filter(|r| r.series == "day/t")
            .filter(|r| (from * 1_000_000_000..to * 1_000_000_000).contains(&r.ts.unwrap()))
            .count()
    };
    assert_eq!(
        data["result"][0]["values"],
        json!([
            [start, local_day(start, end).to_string()],
            [end, local_day(end, end + 86_400).to_string()]
        ])
    );

    // Label endpoints honour start, end and limit.
    let later = [
        ("start", (day + 10 * 86_400).to_string()),
        ("end", (day + 11 * 86_400).to_string()),
    ];
    assert_eq!(
        ok(grafana(&d, "GET", "/api/v1/labels", &later).await),
        json!([])
    );
    assert_eq!(
        ok(grafana(&d, "GET", "/api/v1/label/series/values", &later).await),
        json!([])
    );
    let during = [
        ("start", day.to_string()),
        ("end", (day + 3600).to_string()),
        ("limit", "1".into()),
    ];
    assert_eq!(
        ok(grafana(&d, "GET", "/api/v1/label/series/values", &during).await),
        json!(["day/h"])
    );
    d.stop().await.unwrap();
}
