//! The query node (issue 43): `bucketd query-node` serving the fleet's PostgreSQL through a
//! read-only role (`deploy/postgres/roles.sql`, the database's reader group). Gateways' deltas are applied
//! by bucketd's own batched apply; the answers are checked bucket by bucket against a ground
//! truth computed from the readings themselves (type-7 quantiles, `support::type7`), per
//! gateway and fleet-wide, and two nodes must answer alike.

use std::collections::BTreeMap;

use bucketd::fleet::postgres::{self, FleetDb, SCHEMA};
use bucketd::sketch::SketchParams;
use bucketd::store::OutboxDoc;
use bucketd::summary::Summary;
use serde_json::Value;

use super::pg::{TestDb, connect};
use super::*;

const HOUR: i64 = 3600;
const GATEWAYS: [&str; 3] = ["qn-a", "qn-b", "qn-c"];
const SERIES: [&str; 2] = ["boiler/temp", "pump/temp"];

/// The readings of `(gateway, series, hour)`: gateway `g`'s values lie around `1000 * g`, so
/// that a fleet-wide quantile differs from any average of the gateways' quantiles.
fn readings(g: usize, s: usize, h: i64, start: i64) -> Vec<(i64, f64)> {
    let n = 40 + (g * 7 + s * 5 + h as usize * 3) % 23;
    (0..n)
        .map(|i| {
            let v = 1000.0 * g as f64 + ((i * 37 + s * 11 + h as usize * 5) % 101) as f64 + 0.25;
            ((start + i as i64 * 60) * 1_000_000_000, v)
        })
        .collect()
}

fn summary(readings: &[(i64, f64)]) -> Summary {
    let mut s = Summary::with_params(readings[0].0, readings[0].1, SketchParams::DEFAULT);
    for &(ts, v) in &readings[1..] {
        s.push(ts, v);
    }
    s
}

fn sorted(mut values: Vec<f64>) -> Vec<f64> {
    values.sort_by(f64::total_cmp);
    values
}

/// `GET path` on the node at `addr`: its JSON, after checking the status.
async fn get(addr: &str, path: &str, status: u16) -> Value {
    let (got, body) = crate::support::http("GET", format!("http://{addr}{path}")).await;
    assert_eq!(got, status, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_nodes_answer_per_gateway_and_fleet_wide_as_the_readings_say() {
    let testdb = TestDb::create().await;
    let admin = connect(&testdb.conninfo()).await;
    admin.batch_execute(SCHEMA).await.unwrap();
    admin
        .batch_execute(include_str!("../../../deploy/postgres/roles.sql"))
        .await
        .unwrap();
    // Role names are global to the server: a unique one, dropped at the end.
    let role = unique("qn-reader").to_lowercase();
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN IN ROLE \"{}\"",
            testdb.group("reader")
        ))
        .await
        .unwrap();
    let as_reader = testdb.conninfo_as(&role);
    answers_as_the_readings_say(&testdb.conninfo(), &as_reader).await;
    testdb.drop_it().await;
    admin_drop_role(&role).await;
}

/// The fleet's tables (made, with roles.sql) filled through bucketd's apply as `admin`, then
/// read by query nodes as `as_reader` (a member of the reader group): what they answer, checked
/// against the readings. Also run on a Citus cluster (`super::citus`).
pub async fn answers_as_the_readings_say(admin: &str, as_reader: &str) {
    let as_reader = as_reader.to_owned();
    // Three recent hours of every gateway's series, each bucket applied as two deltas (two
    // entries), so that PostgreSQL's upsert merges them as a forwarder's retries would.
    let first = (chrono::Utc::now().timestamp() / HOUR - 4) * HOUR;
    let mut truth: BTreeMap<(String, i64), Vec<f64>> = BTreeMap::new();
    let mut fleet: BTreeMap<(String, i64), Vec<f64>> = BTreeMap::new();
    for (g, gateway) in GATEWAYS.iter().enumerate() {
        let mut db = FleetDb::open(admin, None, format!("bucketd {gateway}"))
            .await
            .unwrap();
        let mut halves = [Vec::new(), Vec::new()];
        for (s, series) in SERIES.iter().enumerate() {
            for h in 0..3 {
                let start = first + h * HOUR;
                let rs = readings(g, s, h, start);
                let (a, b) = rs.split_at(rs.len() / 2);
                halves[0].push(BucketDoc::new(series, start, HOUR, &summary(a)));
                halves[1].push(BucketDoc::new(series, start, HOUR, &summary(b)));
                let values: Vec<f64> = rs.iter().map(|r| r.1).collect();
                truth
                    .entry((format!("{gateway}:{series}"), start))
                    .or_default()
                    .extend(&values);
                fleet
                    .entry((format!("*:{series}"), start))
                    .or_default()
                    .extend(&values);
            }
        }
        let entries: Vec<OutboxDoc> = halves
            .into_iter()
            .enumerate()
            .map(|(seq, buckets)| OutboxDoc {
                seq: seq as i64,
                created_ns: 0,
                buckets,
            })
            .collect();
        postgres::apply(&mut db, gateway, "origin", &entries, None)
            .await
            .unwrap();
    }

    // Two nodes, as behind a load balancer.
    let mut raw = bucketd::config::RawConfig::load(None, Vec::new()).unwrap();
    raw.query_node.postgres = as_reader.clone();
    raw.http.bind = "127.0.0.1:0".into();
    let config = bucketd::config::Config::try_from(raw).unwrap();
    let nodes = [
        bucketd::daemon::start_query_node(&config).unwrap(),
        bucketd::daemon::start_query_node(&config).unwrap(),
    ];
    let addrs: Vec<String> = nodes.iter().map(|n| n.http_addr.to_string()).collect();
    let addr = addrs[0].as_str();

    let listed = get(addr, "/api/v1/series", 200).await;
    let names: Vec<&str> = listed["series"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    let mut expected: Vec<String> = truth.keys().map(|k| k.0.clone()).collect();
    expected.extend(fleet.keys().map(|k| k.0.clone()));
    expected.sort();
    expected.dedup();
    assert_eq!(names, expected);

    let (from, to) = (first, first + 3 * HOUR);
    let mut averages_would_pass = 0;
    for (groups, fleet_wide) in [(&truth, false), (&fleet, true)] {
        let series: Vec<&String> = groups.keys().map(|k| &k.0).collect();
        for name in series
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>()
        {
            let path = format!("/api/v1/buckets?series={name}&from={from}&to={to}");
            let answer = get(addr, &path, 200).await;
            for other in &addrs[1..] {
                assert_eq!(get(other, &path, 200).await, answer, "{path}: nodes differ");
            }
            let buckets = answer["buckets"].as_array().unwrap();
            assert_eq!(buckets.len(), 3, "{path}");
            for (h, b) in buckets.iter().enumerate() {
                let start = first + h as i64 * HOUR;
                let values = sorted(groups[&(name.clone(), start)].clone());
                let what = format!("{name} at {start}");
                assert_eq!(
                    b["count"].as_u64().unwrap() as usize,
                    values.len(),
                    "{what}"
                );
                assert_eq!(b["min"].as_f64().unwrap(), values[0], "{what}");
                assert_eq!(
                    b["max"].as_f64().unwrap(),
                    *values.last().unwrap(),
                    "{what}"
                );
                let mean = values.iter().sum::<f64>() / values.len() as f64;
                assert!(
                    (b["mean"].as_f64().unwrap() - mean).abs() < 1e-9 * mean,
                    "{what}"
                );
                for (key, q) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)] {
                    let got = b[key].as_f64().unwrap();
                    let exact = type7(&values, q);
                    assert!(
                        quantile_close(got, exact),
                        "{what} {key}: {got} vs {exact:?}"
                    );
                }
                if fleet_wide {
                    // What averaging the gateways' p99s would give: the test must tell it apart.
                    let member =
                        |g: &str| sorted(truth[&(format!("{g}:{}", &name[2..]), start)].clone());
                    let avg = GATEWAYS
                        .iter()
                        .map(|g| type7(&member(g), 0.99).0)
                        .sum::<f64>()
                        / GATEWAYS.len() as f64;
                    if quantile_close(avg, type7(&values, 0.99)) {
                        averages_would_pass += 1;
                    }
                }
            }
        }
    }
    assert_eq!(
        averages_would_pass, 0,
        "the fleet's readings must tell a merge from an average"
    );

    // The Prometheus API reads the same buckets: the fleet-wide p99 per hour.
    let query = "bucketd_bucket_p99{series=\"*:boiler/temp\"}";
    let path = format!(
        "/prom/api/v1/query_range?query={}&start={from}&end={}&step=3600",
        query
            .replace('"', "%22")
            .replace('{', "%7B")
            .replace('}', "%7D"),
        to - HOUR
    );
    let prom = get(addr, &path, 200).await;
    let values = prom["data"]["result"][0]["values"].as_array().unwrap();
    assert_eq!(values.len(), 3, "{prom}");
    for (h, point) in values.iter().enumerate() {
        let start = first + h as i64 * HOUR;
        let got: f64 = point[1].as_str().unwrap().parse().unwrap();
        let exact = type7(
            &sorted(fleet[&("*:boiler/temp".into(), start)].clone()),
            0.99,
        );
        assert!(
            quantile_close(got, exact),
            "prom p99 at {start}: {got} vs {exact:?}"
        );
    }

    gateway_labels(addr, (from, to), &truth, &fleet).await;

    // Raw readings stay on the gateways; the node says so.
    let path = format!("/api/v1/raw?series=qn-a:boiler/temp&from={from}&to={to}");
    let refused = get(addr, &path, 404).await;
    assert!(
        refused["error"]
            .as_str()
            .unwrap()
            .contains("stay on the gateways"),
        "{refused}"
    );
    let ready = get(addr, "/readyz", 200).await;
    assert_eq!(ready["store_reachable"], true);

    // The reader role reads; it cannot write.
    let reader = connect(&as_reader).await;
    let e = reader
        .execute("UPDATE bucketd_gateways SET last_seq = 0", &[])
        .await
        .unwrap_err();
    assert!(format!("{e:?}").contains("permission denied"), "{e:?}");

    // A new gateway's series appear without a query waiting for the list: a stale list is
    // answered while one read behind it refreshes it (series_refresh 0 s here: always stale).
    let mut raw = bucketd::config::RawConfig::load(None, Vec::new()).unwrap();
    raw.query_node.postgres = as_reader.clone();
    raw.query_node.series_refresh = std::time::Duration::ZERO;
    raw.http.bind = "127.0.0.1:0".into();
    let eager = bucketd::daemon::start_query_node(&bucketd::config::Config::try_from(raw).unwrap())
        .unwrap();
    let eager_addr = eager.http_addr.to_string();
    let before = get(&eager_addr, "/api/v1/series", 200).await;
    assert!(!before.to_string().contains("qn-d:"), "{before}");
    let mut db = FleetDb::open(admin, None, "bucketd qn-d".into())
        .await
        .unwrap();
    let rs = readings(3, 0, 0, first);
    let doc = BucketDoc::new(SERIES[0], first, HOUR, &summary(&rs));
    postgres::apply(
        &mut db,
        "qn-d",
        "origin",
        &[OutboxDoc {
            seq: 0,
            created_ns: 0,
            buckets: vec![doc],
        }],
        None,
    )
    .await
    .unwrap();
    eventually_async(
        std::time::Duration::from_secs(30),
        "the new gateway's series to be listed",
        async || {
            get(&eager_addr, "/api/v1/series", 200)
                .await
                .to_string()
                .contains("qn-d:boiler/temp")
        },
    )
    .await;
    eager.stop().await;
    for node in nodes {
        node.stop().await;
    }
    drop(reader);
}

/// The query string of a PromQL request, encoded.
fn promql(query: &str) -> String {
    serde_urlencoded::to_string([("query", query)]).unwrap()
}

/// Issue 55: on a query node the gateway is a label of its own and `sensor` the sensor without
/// it; a fleet-wide series is selected only when a query names it (`gateway="*"`), so that a
/// `sum` counts each reading once; a `sensor` written the old way is refused with what to
/// write. Checked against the readings' counts per hour.
async fn gateway_labels(
    addr: &str,
    (from, to): (i64, i64),
    truth: &BTreeMap<(String, i64), Vec<f64>>,
    fleet: &BTreeMap<(String, i64), Vec<f64>>,
) {
    let range = |query: &str| {
        format!(
            "/prom/api/v1/query_range?{}&start={from}&end={}&step=3600",
            promql(query),
            to - HOUR
        )
    };
    let hours: Vec<i64> = (0..3).map(|h| from + h * HOUR).collect();
    let per_hour = |answer: &Value| -> Vec<f64> {
        let result = answer["data"]["result"].as_array().unwrap();
        assert_eq!(result.len(), 1, "{answer}");
        result[0]["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p[1].as_str().unwrap().parse().unwrap())
            .collect()
    };
    let readings_of = |map: &BTreeMap<(String, i64), Vec<f64>>, start: i64| -> f64 {
        map.iter()
            .filter(|((_, s), _)| *s == start)
            .map(|(_, v)| v.len() as f64)
            .sum()
    };
    // Each reading once: the gateways' series only, unless the fleet-wide ones are named.
    let every: Vec<f64> = hours.iter().map(|&h| readings_of(truth, h)).collect();
    let answer = get(
        addr,
        &range(r#"sum(bucketd_bucket_count{metric="temp"})"#),
        200,
    )
    .await;
    assert_eq!(per_hour(&answer), every, "{answer}");
    let named = r#"sum(bucketd_bucket_count{metric="temp", gateway="*"})"#;
    let answer = get(addr, &range(named), 200).await;
    assert_eq!(
        per_hour(&answer),
        every,
        "the fleet-wide series hold the same readings"
    );
    assert_eq!(
        hours
            .iter()
            .map(|&h| readings_of(fleet, h))
            .collect::<Vec<_>>(),
        every
    );
    // Per gateway, by the label.
    let q = r#"sum by (gateway) (bucketd_bucket_count{metric="temp"})"#;
    let answer = get(addr, &range(q), 200).await;
    let result = answer["data"]["result"].as_array().unwrap();
    let gateways: Vec<&str> = result
        .iter()
        .map(|s| s["metric"]["gateway"].as_str().unwrap())
        .collect();
    assert_eq!(gateways, GATEWAYS, "{answer}");
    // One series' labels.
    let q = r#"bucketd_bucket_count{gateway="qn-b", sensor="boiler"}"#;
    let answer = get(addr, &range(q), 200).await;
    let want: Vec<f64> = hours
        .iter()
        .map(|&h| truth[&("qn-b:boiler/temp".to_owned(), h)].len() as f64)
        .collect();
    assert_eq!(per_hour(&answer), want);
    let labels = &answer["data"]["result"][0]["metric"];
    assert_eq!(
        labels,
        &serde_json::json!({"__name__": "bucketd_bucket_count", "gateway": "qn-b",
            "sensor": "boiler", "metric": "temp", "series": "qn-b:boiler/temp"}),
    );
    // The old way of naming a fleet-wide series still selects it.
    let q = r#"bucketd_bucket_count{series="*:pump/temp"}"#;
    let answer = get(addr, &range(q), 200).await;
    assert_eq!(answer["data"]["result"][0]["metric"]["gateway"], "*");
    // The label's values, and the old form of `sensor` refused with what to write.
    let listed = get(addr, "/prom/api/v1/label/gateway/values", 200).await;
    assert_eq!(
        listed["data"],
        serde_json::json!(["*", "qn-a", "qn-b", "qn-c"])
    );
    let q = format!(
        "/prom/api/v1/query?{}",
        promql(r#"bucketd_bucket_count{sensor="qn-a:boiler"}"#)
    );
    let refused = get(addr, &q, 400).await;
    let error = refused["error"].as_str().unwrap();
    assert!(
        error.contains(r#"gateway="qn-a", sensor="boiler""#),
        "{refused}"
    );
    // A counter function needs raw readings, which stay on the gateways: no point, and the
    // answer's warnings say where to ask; a gauge function over whole buckets is
    // answered from them.
    let q = r#"rate(bucketd_reading{gateway="qn-b", sensor="boiler"}[30m])"#;
    let answer = get(addr, &range(q), 200).await;
    assert_eq!(answer["data"]["result"], serde_json::json!([]), "{answer}");
    let warnings = answer["warnings"].to_string();
    assert!(
        warnings.contains("rate() needs the raw readings")
            && warnings.contains("ask the gateway's own /prom"),
        "{answer}"
    );
    // Over whole buckets, from each row's counter increase (checked against Prometheus in
    // prom_diff): a point at every hour with the hour before it.
    let q = r#"increase(bucketd_reading{gateway="qn-b", sensor="boiler"}[1h])"#;
    let answer = get(addr, &range(q), 200).await;
    assert!(answer.get("warnings").is_none(), "{answer}");
    let got = per_hour(&answer);
    assert_eq!(got.len(), 2, "{answer}");
    // The first: hour `from`'s readings, a minute apart from its start, as Prometheus takes
    // them (last minus first plus the value before each reset), extrapolated by half a spacing
    // past the last one (the window's end is far from it) and not before the first (at the
    // window's start).
    let values = &truth[&("qn-b:boiler/temp".to_owned(), from)];
    let mut increase = values[values.len() - 1] - values[0];
    for w in values.windows(2) {
        if w[1] < w[0] {
            increase += w[0];
        }
    }
    let sampled = (values.len() - 1) as f64 * 60.0;
    let want = increase * (sampled + 30.0) / sampled;
    assert!(
        (got[0] - want).abs() <= 1e-9 * want.abs(),
        "{} vs {want}: {answer}",
        got[0]
    );
    // A fleet-wide series merges different gateways' counters: no increase from its buckets
    // (the warning says so); the fleet's total is the sum of the gateways'.
    let q = r#"increase(bucketd_reading{series="*:boiler/temp"}[1h])"#;
    let answer = get(addr, &range(q), 200).await;
    assert_eq!(answer["data"]["result"], serde_json::json!([]), "{answer}");
    assert!(
        answer["warnings"]
            .to_string()
            .contains("do not know their counter increase"),
        "{answer}"
    );
    let q = r#"sum(increase(bucketd_reading{sensor="boiler", metric="temp"}[1h]))"#;
    assert_eq!(per_hour(&get(addr, &range(q), 200).await).len(), 2);
    let q = r#"count_over_time(bucketd_reading{gateway="qn-b", sensor="boiler"}[1h])"#;
    let answer = get(addr, &range(q), 200).await;
    assert!(answer.get("warnings").is_none(), "{answer}");
    let at_next_hour = &answer["data"]["result"][0]["values"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p[0].as_f64() == Some((from + HOUR) as f64))
        .unwrap_or_else(|| panic!("a point at the end of the first hour: {answer}"))[1];
    let want = truth[&("qn-b:boiler/temp".to_owned(), from)].len();
    assert_eq!(
        at_next_hour,
        &serde_json::json!(want.to_string()),
        "{answer}"
    );
}

async fn admin_drop_role(role: &str) {
    let admin = connect(&super::pg::admin_conninfo()).await;
    admin
        .batch_execute(&format!("DROP ROLE IF EXISTS \"{role}\""))
        .await
        .unwrap();
}

/// Issue 52, the separate round of attacks: one row a compromised gateway's role wrote into its
/// own series (a sketch that does not decode, or one of 2 MB) made every query that read it a 500, the
/// fleet-wide ones included, so one gateway could blind the whole fleet's dashboards. Now the
/// row takes out only the names it feeds (its series and the fleet-wide series it is part of),
/// named in Prometheus's `warnings`; every other series is answered as its readings say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_row_takes_only_the_series_it_feeds_out_of_a_query_nodes_answers() {
    let testdb = TestDb::create().await;
    let admin = connect(&testdb.conninfo()).await;
    admin.batch_execute(SCHEMA).await.unwrap();
    let start = (chrono::Utc::now().timestamp() / HOUR - 2) * HOUR;
    let mut counts = BTreeMap::new();
    for (g, gateway) in GATEWAYS.iter().enumerate() {
        let mut db = FleetDb::open(&testdb.conninfo(), None, format!("bucketd {gateway}"))
            .await
            .unwrap();
        let buckets: Vec<BucketDoc> = SERIES
            .iter()
            .enumerate()
            .map(|(s, series)| {
                let rs = readings(g, s, 0, start);
                counts.insert(format!("{gateway}:{series}"), rs.len());
                BucketDoc::new(series, start, HOUR, &summary(&rs))
            })
            .collect();
        let entry = OutboxDoc {
            seq: 0,
            created_ns: 0,
            buckets,
        };
        postgres::apply(&mut db, gateway, "origin", &[entry], None)
            .await
            .unwrap();
    }
    // One sketch that does not decode, one longer than any bucketd writes (2 MB: PostgreSQL
    // sends NULL in its place, so the node never holds it).
    for (series, sketch) in [
        ("qn-a:boiler/temp", "'\\x01ff'::bytea"),
        (
            "qn-b:boiler/temp",
            "'\\x01'::bytea || decode(repeat('00', 2000000), 'hex')",
        ),
    ] {
        let forged = admin
            .execute(
                &format!("UPDATE bucketd_buckets SET sketch = {sketch} WHERE series = '{series}'"),
                &[],
            )
            .await
            .unwrap();
        assert_eq!(forged, 1);
    }

    let mut raw = bucketd::config::RawConfig::load(None, Vec::new()).unwrap();
    raw.query_node.postgres = testdb.conninfo();
    raw.http.bind = "127.0.0.1:0".into();
    let node = bucketd::daemon::start_query_node(&bucketd::config::Config::try_from(raw).unwrap())
        .unwrap();
    let addr = node.http_addr.to_string();

    // Every series at once, as a dashboard's panel of all sensors asks: the gateways' series;
    // and the fleet-wide ones, named (`gateway="*"`).
    let mut answered = BTreeMap::new();
    for (query, left_out) in [
        (
            "bucketd_bucket_count",
            &["qn-a:boiler/temp", "qn-b:boiler/temp"][..],
        ),
        (
            "bucketd_bucket_count{gateway=\"*\"}",
            &["*:boiler/temp"][..],
        ),
    ] {
        let path = format!(
            "/prom/api/v1/query?{}&time={}",
            promql(query),
            start + HOUR / 2
        );
        let answer = get(&addr, &path, 200).await;
        let warnings = answer["warnings"].to_string();
        for left_out in left_out {
            assert!(warnings.contains(left_out), "{left_out} named: {answer}");
        }
        for r in answer["data"]["result"].as_array().unwrap() {
            let series = r["metric"]["series"].as_str().unwrap().to_owned();
            let count: usize = r["value"][1].as_str().unwrap().parse().unwrap();
            answered.insert(series, count);
        }
    }
    let mut expected: BTreeMap<String, usize> = counts
        .iter()
        .filter(|(name, _)| !["qn-a:boiler/temp", "qn-b:boiler/temp"].contains(&name.as_str()))
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    let fleet_pump: usize = GATEWAYS
        .iter()
        .map(|g| counts[&format!("{g}:pump/temp")])
        .sum();
    expected.insert("*:pump/temp".into(), fleet_pump);
    assert_eq!(answered, expected);

    // The JSON API names the series it cannot read, and answers the others.
    let (from, to) = (start, start + HOUR);
    let refused = get(
        &addr,
        &format!("/api/v1/buckets?series=qn-a:boiler/temp&from={from}&to={to}"),
        500,
    )
    .await;
    assert!(
        refused["error"]
            .as_str()
            .unwrap()
            .contains("series qn-a:boiler/temp could not be read"),
        "{refused}"
    );
    let other = get(
        &addr,
        &format!("/api/v1/buckets?series=qn-c:boiler/temp&from={from}&to={to}"),
        200,
    )
    .await;
    assert_eq!(
        other["buckets"][0]["count"].as_u64().unwrap() as usize,
        counts["qn-c:boiler/temp"]
    );
    node.stop().await;
    drop(admin);
    testdb.drop_it().await;
}
