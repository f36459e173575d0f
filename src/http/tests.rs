use axum::body::Body;
use axum::http::Request;
use tower::ServiceExt;

use super::*;
use crate::config::Durability;
use crate::store::{Store, StoreSettings};

/// With every flush slot taken, a further `POST /api/v1/flush` is a 429 and never reaches
/// the ingest task, so its waiter list stays bounded.
fn test_state(
    dir: &tempfile::TempDir,
    flush_slots: usize,
) -> (ApiState, mpsc::Receiver<FlushRequest>, Store) {
    let store = Store::open(&StoreSettings {
        path: dir.path().join("h.redb"),
        bucket_width_secs: 3600,
        durability: Durability::Immediate,
        quick_repair: true,
        cache_bytes: 1 << 20,
        page_capacity: 1000,
        dedup_window: 0,
        outbox_max_entries: 0,
        journal_bytes: 1 << 20,
    })
    .unwrap();
    let (flush, requests) = mpsc::channel(16);
    let state = ApiState {
        source: Arc::new(store.reader()),
        stats: Arc::new(Stats::new(0)),
        metrics: Arc::new(Metrics::new()),
        flush: Some(flush),
        flush_slots: Arc::new(tokio::sync::Semaphore::new(flush_slots)),
        bucket_width_secs: 3600,
        max_buckets_per_query: 10,
        max_points_per_query: 1000,
        max_raw_readings: 10,
        api_token: None,
        metrics_token: None,
        query_slots: Arc::new(tokio::sync::Semaphore::new(4)),
        request_timeout: Duration::from_secs(10),
        lookback: Duration::from_mins(5),
        allowed_hosts: Arc::from([]),
    };
    // The store stays open while the reader is used (dropping it closes the file).
    (state, requests, store)
}

/// Issue 51: one damaged bucket document failed every answer that read it, a fleet-wide
/// Prometheus query included, with only "reading the store failed". The JSON API now names
/// the damaged series; the Prometheus API answers the other series and names it in
/// `warnings`, Prometheus's place for a partial answer.
#[tokio::test]
async fn a_damaged_series_is_named_and_the_others_answered() {
    let dir = tempfile::tempdir().unwrap();
    let (state, _, mut store) = test_state(&dir, 1);
    let mut b = crate::batcher::Batcher::by_hand();
    let now = std::time::Instant::now();
    for (series, v) in [("a/t", 1.0), ("b/t", 2.0), ("c/t", 3.0)] {
        b.push_reading(Arc::from(series), Timestamp::from_secs(3600), v, true, now);
    }
    store.commit(&b.take().0).unwrap();
    store.checkpoint().unwrap();
    store.damage_bucket("b/t", 3600);
    let app = router(state);
    let range = "from=0&to=7200";
    let (status, _, body) = call(
        &app,
        "GET",
        &format!("/api/v1/buckets?series=b/t&{range}"),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        body.contains("series b/t could not be read") && body.contains("bucketd export"),
        "{body}"
    );
    let (status, _, body) = call(
        &app,
        "GET",
        &format!("/api/v1/buckets?series=c/t&{range}"),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    if cfg!(feature = "ui") {
        for path in [
            "/prom/api/v1/query?query=bucketd_bucket_count&time=7200",
            "/prom/api/v1/query_range?query=bucketd_bucket_count&start=3600&end=7200&step=3600",
        ] {
            let (status, _, body) = call(&app, "GET", path, &[]).await;
            assert_eq!(status, StatusCode::OK, "{path}: {body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            let mut sensors: Vec<&str> = v["data"]["result"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["metric"]["sensor"].as_str().unwrap())
                .collect();
            sensors.sort_unstable();
            assert_eq!(sensors, ["a", "c"], "{path}: {body}");
            let warnings = v["warnings"].as_array().unwrap();
            assert_eq!(warnings.len(), 1, "{path}: {body}");
            assert!(
                warnings[0].as_str().unwrap().contains("series b/t"),
                "{body}"
            );
        }
        // A request that reads nothing damaged has no warnings.
        let (_, _, body) = call(
            &app,
            "GET",
            "/prom/api/v1/query?query=bucketd_bucket_count%7Bsensor%3D%22a%22%7D&time=7200",
            &[],
        )
        .await;
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["data"]["result"].as_array().unwrap().len(), 1, "{body}");
        assert!(v.get("warnings").is_none(), "{body}");
    }
}

/// Issue 52: `/api/v1/raw` is written a chunk at a time; across chunk boundaries (0, 1, 64,
/// 65 and 200 readings) it is the JSON it was when built whole, reading for reading.
#[tokio::test]
async fn a_streamed_raw_answer_is_the_whole_json_chunk_by_chunk() {
    for n in [0usize, 1, 64, 65, 200] {
        let readings: Vec<(i64, f64)> = (0..n)
            .map(|i| {
                (
                    1_763_719_200_000_000_000 + i as i64 * 1_500_000,
                    i as f64 / 4.0 - 3.0,
                )
            })
            .collect();
        let whole = json!({
            "series": "a/\"t\"",
            "readings": readings
                .iter()
                .map(|(ts, v)| json!({"ts": Timestamp::from_nanos(*ts).to_rfc3339_millis(), "value": v}))
                .collect::<Vec<_>>(),
            "truncated": n == 65,
        });
        let response = raw_answer("a/\"t\"", readings, n == 65);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        let body = axum::body::to_bytes(response.into_body(), 1 << 24)
            .await
            .unwrap();
        let got: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(got, whole, "{n} readings");
    }
}

/// Issue 53: the query turn runs the request in a task of its own, so a client that hung
/// up left its query running to the end. The turn now gives the request a flag
/// ([`crate::source::Hangup`]) that is set when the server drops the request (the client
/// went away), which the Prometheus API's evaluation stops on; a request answered in full
/// never sees it set.
#[tokio::test]
async fn a_request_whose_client_has_gone_sees_its_hangup_flag_set() {
    use crate::source::Hangup;
    use axum::Extension;
    let (started, mut running) = mpsc::channel::<()>(1);
    let (report, mut seen) = mpsc::channel::<bool>(1);
    let release = Arc::new(tokio::sync::Notify::new());
    let released = release.clone();
    let handler = move |Extension(hangup): Extension<Hangup>| {
        let (started, report, released) = (started.clone(), report.clone(), released.clone());
        async move {
            started.send(()).await.unwrap();
            // Until the flag is set (looked at every 5 ms), or the test lets it finish.
            let set = loop {
                if hangup.0.load(Ordering::Relaxed) {
                    break true;
                }
                tokio::select! {
                    () = released.notified() => break false,
                    () = tokio::time::sleep(Duration::from_millis(5)) => {}
                }
            };
            report.send(set).await.unwrap();
            "done"
        }
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(1));
    let app = Router::new()
        .route("/q", get(handler))
        .route_layer(from_fn_with_state(slots, take_turn));
    // The client hangs up while the request runs.
    let request = app
        .clone()
        .oneshot(Request::get("/q").body(Body::empty()).unwrap());
    let waiting = tokio::spawn(request);
    running.recv().await.unwrap();
    waiting.abort();
    let set = tokio::time::timeout(Duration::from_secs(10), seen.recv()).await;
    assert!(
        matches!(set, Ok(Some(true))),
        "the flag is set when the request is dropped: {set:?}"
    );
    // A request answered in full: its flag stays clear while it runs.
    let answered = tokio::spawn({
        let app = app.clone();
        async move { call(&app, "GET", "/q", &[]).await }
    });
    running.recv().await.unwrap();
    release.notify_one();
    assert!(!seen.recv().await.unwrap());
    let (status, _, body) = answered.await.unwrap();
    assert_eq!((status, body.as_str()), (StatusCode::OK, "done"));
}

/// The dead letters are readable: a central's operator can see which gateway sent what.
#[tokio::test]
async fn rejected_messages_are_listed_with_their_reason_topic_and_payload() {
    let dir = tempfile::tempdir().unwrap();
    let (mut state, _requests, _store) = test_state(&dir, 1);
    state.stats = Arc::new(Stats::new(2));
    state.stats.reject(
        crate::reject::DecodeError::InvalidJson,
        b"devices/d1/x",
        b"{",
        crate::reading::Timestamp::now(),
    );
    state.stats.reject(
        crate::reject::DecodeError::GatewayMismatch,
        b"bucketd/site-1/deltas",
        &[0xff, 0x00],
        crate::reading::Timestamp::now(),
    );
    let request = Request::get("/api/v1/rejected")
        .body(Body::empty())
        .unwrap();
    let response = router(state).oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    let list = v["rejected"].as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(
        (&list[0]["reason"], &list[0]["topic"], &list[0]["payload"]),
        (&json!("invalid_json"), &json!("devices/d1/x"), &json!("{"))
    );
    assert_eq!(list[1]["reason"], "gateway_mismatch");
    assert_eq!(list[1]["count"], 1);
    assert_eq!(list[1]["payload"], Value::Null, "not UTF-8");
    assert_eq!(list[1]["payload_hex"], "ff00");
    assert!(Timestamp::parse(list[1]["at"].as_str().unwrap()).is_some());
}

#[tokio::test]
async fn flush_requests_past_the_limit_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (state, mut requests, _store) = test_state(&dir, 0);
    let request = Request::post("/api/v1/flush").body(Body::empty()).unwrap();
    let response = router(state).oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(
        requests.try_recv().is_err(),
        "nothing reached the ingest task"
    );
}

/// A query node has nothing pending: its flush answers at once that nothing was committed,
/// with no task behind it to answer.
#[tokio::test]
async fn a_flush_without_an_ingest_task_commits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (mut state, _, _store) = test_state(&dir, 1);
    state.flush = None;
    let request = Request::post("/api/v1/flush").body(Body::empty()).unwrap();
    let response = router(state).oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body, json!({ "committed": 0 }));
}

/// An internal error tells the client where to look, not the file path or the cause.
#[tokio::test]
async fn internal_errors_keep_paths_and_causes_in_the_log() {
    let e = ApiError::internal("opening /var/lib/bucketd/bucketd.redb: Permission denied");
    assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(e.message.contains("error_id"), "{}", e.message);
    assert!(
        !e.message.contains("/var/lib") && !e.message.contains("Permission"),
        "{}",
        e.message
    );
}

#[test]
fn bearer_scheme_is_case_insensitive() {
    for (value, want) in [
        (&b"Bearer abc"[..], Some(&b"abc"[..])),
        (b"bearer abc", Some(b"abc")),
        (b"BEARER  abc", Some(b"abc")),
        (b"Basic abc", None),
        (b"Bearer", None),
        (b"Bearer ", None),
        (b"Bearerabc", None),
    ] {
        assert_eq!(bearer_credentials(value), want, "{value:?}");
    }
}

#[test]
fn an_open_api_off_loopback_is_warned_about() {
    let at = |s: &str| s.parse::<std::net::SocketAddr>().unwrap();
    let warning = exposure_warning(at("0.0.0.0:9470"), false).expect("warned");
    assert!(warning.contains("http.token_file"), "{warning}");
    assert!(exposure_warning(at("192.168.1.5:9470"), false).is_some());
    assert!(exposure_warning(at("[::]:9470"), false).is_some());
    assert!(exposure_warning(at("0.0.0.0:9470"), true).is_none());
    assert!(exposure_warning(at("127.0.0.1:9470"), false).is_none());
    assert!(exposure_warning(at("[::1]:9470"), false).is_none());
}

/// `/api/*` and `/metrics` each need their own token; probes stay open; a 401 never echoes
/// the token it was sent.
#[tokio::test]
async fn bearer_tokens_guard_the_api_and_metrics_separately() {
    let dir = tempfile::tempdir().unwrap();
    let (mut state, _requests, _store) = test_state(&dir, 1);
    let secret = |s: &str| {
        let f = dir.path().join(s);
        std::fs::write(&f, s).unwrap();
        Some(Arc::new(crate::secret::read("t", &f, None).unwrap()))
    };
    state.api_token = secret("api-token-1");
    state.metrics_token = secret("scrape-token-2");
    let stats = state.stats.clone();
    let app = router(state);
    let call = |path: &'static str, token: Option<&'static str>| {
        let app = app.clone();
        async move {
            let mut request = Request::get(path);
            if let Some(t) = token {
                request = request.header("authorization", format!("Bearer {t}"));
            }
            let response = app
                .oneshot(request.body(Body::empty()).unwrap())
                .await
                .unwrap();
            let status = response.status();
            let challenge = response.headers().get("www-authenticate").cloned();
            let body = axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .unwrap();
            (
                status,
                challenge,
                String::from_utf8_lossy(&body).into_owned(),
            )
        }
    };
    let cases = [
        ("/api/v1/series", None, StatusCode::UNAUTHORIZED),
        (
            "/api/v1/series",
            Some("api-token-"),
            StatusCode::UNAUTHORIZED,
        ),
        (
            "/api/v1/series",
            Some("scrape-token-2"),
            StatusCode::UNAUTHORIZED,
        ),
        ("/api/v1/series", Some("api-token-1"), StatusCode::OK),
        ("/metrics", None, StatusCode::UNAUTHORIZED),
        ("/metrics", Some("api-token-1"), StatusCode::UNAUTHORIZED),
        ("/metrics", Some("scrape-token-2"), StatusCode::OK),
        ("/healthz", None, StatusCode::OK),
        ("/readyz", None, StatusCode::SERVICE_UNAVAILABLE),
    ];
    for (path, token, want) in cases {
        let (status, challenge, body) = call(path, token).await;
        assert_eq!(status, want, "{path} with {token:?}: {body}");
        if want == StatusCode::UNAUTHORIZED {
            assert!(challenge.is_some(), "{path}: WWW-Authenticate");
            // Prometheus's error shape: Grafana shows the message only with it.
            let body: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(body["status"], "error", "{body}");
            assert!(body["error"].as_str().unwrap().contains("token"), "{body}");
            let body = body.to_string();
            assert!(
                !body.contains("token-"),
                "the answer echoes a token: {body}"
            );
        }
    }
    let refused = cases
        .iter()
        .filter(|(_, _, want)| *want == StatusCode::UNAUTHORIZED)
        .count() as u64;
    assert_eq!(Stats::get(&stats.http_unauthorized), refused);
}

/// A GET of `path` with these headers through the router; the status, the headers and the
/// body.
async fn call(
    app: &Router,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, axum::http::HeaderMap, String) {
    let mut request = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// Issue 41: every answer, errors and refusals included, carries `nosniff`, so that no
/// browser reads a device's payload (in `/api/v1/rejected`) as HTML or script.
#[tokio::test]
async fn every_answer_is_marked_nosniff() {
    let dir = tempfile::tempdir().unwrap();
    let (state, _, _store) = test_state(&dir, 1);
    let app = router(state);
    for (method, path) in [
        ("GET", "/api/v1/series"),
        ("GET", "/api/v1/rejected"),
        ("GET", "/api/v1/buckets"),
        ("GET", "/metrics"),
        ("GET", "/healthz"),
        ("GET", "/no/such/thing"),
        ("POST", "/api/v1/flush"),
    ] {
        let (status, headers, _) = call(&app, method, path, &[]).await;
        assert_eq!(
            headers
                .get("x-content-type-options")
                .map(axum::http::HeaderValue::as_bytes),
            Some(&b"nosniff"[..]),
            "{method} {path} ({status})"
        );
    }
}

/// Issue 41: without a token, a web page could read device payloads and flush through DNS
/// rebinding (its own name resolved to 127.0.0.1) or a cross-site form. An open endpoint
/// answers only a Host that is an address, `localhost` or listed, and no cross-site POST;
/// with a token, any Host.
#[tokio::test]
async fn without_a_token_only_requests_naming_this_server_are_answered() {
    let dir = tempfile::tempdir().unwrap();
    // No ingest task: a flush that gets through is a 503 at once.
    let (mut state, _, _store) = test_state(&dir, 1);
    state.allowed_hosts = Arc::from(["gateway-17.lan".to_owned()]);
    let stats = state.stats.clone();
    let app = router(state.clone());
    let get = |host: &'static str| {
        let app = app.clone();
        async move {
            call(&app, "GET", "/api/v1/series", &[("host", host)])
                .await
                .0
        }
    };
    for host in [
        "127.0.0.1:9470",
        "localhost:9470",
        "LOCALHOST",
        "[::1]:9470",
        "192.168.1.5",
        "gateway-17.lan:9470",
        "Gateway-17.LAN",
        "grafana.localhost:80",
    ] {
        assert_eq!(get(host).await, StatusCode::OK, "{host}");
    }
    for host in [
        "attacker.example:9470",
        "attacker.example",
        "127.0.0.1.attacker.example",
        "gateway-17.lan.attacker.example",
        "localhost:9470:1",
        "[::1",
        "a b",
        "",
    ] {
        assert_eq!(get(host).await, StatusCode::FORBIDDEN, "{host:?}");
    }
    let refused_so_far = Stats::get(&stats.http_unauthorized);
    assert_eq!(refused_so_far, 8, "refusals are counted");
    // The probes stay open to any Host.
    let (status, _, _) = call(&app, "GET", "/healthz", &[("host", "x.example")]).await;
    assert_eq!(status, StatusCode::OK);
    // A cross-site POST is refused before it reaches the flush (whose slot would answer).
    let post = |headers: &'static [(&'static str, &'static str)]| {
        let app = app.clone();
        async move { call(&app, "POST", "/api/v1/flush", headers).await }
    };
    for headers in [
        &[
            ("host", "127.0.0.1:9470"),
            ("origin", "http://attacker.example"),
        ][..],
        &[("host", "localhost:9470"), ("origin", "null")],
        &[
            ("host", "localhost:9470"),
            ("origin", "http://localhost:9471"),
        ],
        &[("host", "localhost:9470"), ("sec-fetch-site", "cross-site")],
    ] {
        let (status, _, body) = post(headers).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{headers:?}: {body}");
        assert!(body.contains("another site"), "{body}");
    }
    for headers in [
        &[
            ("host", "localhost:9470"),
            ("origin", "http://localhost:9470"),
        ][..],
        &[
            ("host", "localhost:9470"),
            ("sec-fetch-site", "same-origin"),
        ],
        &[("host", "127.0.0.1:9470")],
    ] {
        let (status, _, body) = post(headers).await;
        assert_ne!(status, StatusCode::FORBIDDEN, "{headers:?}: {body}");
    }
    // With a token, the token decides.
    let f = dir.path().join("token");
    std::fs::write(&f, "tok-1").unwrap();
    state.api_token = Some(Arc::new(crate::secret::read("t", &f, None).unwrap()));
    let app = router(state);
    let (status, _, _) = call(
        &app,
        "GET",
        "/api/v1/series",
        &[
            ("host", "attacker.example"),
            ("authorization", "Bearer tok-1"),
        ],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

/// Issue 41: a client that sent a request's head and never its body held one of the query
/// turns while the handler waited for the body, with no timeout: four of them locked every
/// query. The body is now read (within `http.request_timeout`) before a turn is taken, and
/// a body that does not come in time is a 408 that closes the connection.
#[tokio::test]
async fn a_body_that_never_comes_holds_no_query_turn_and_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let (mut state, _requests, _store) = test_state(&dir, 1);
    state.query_slots = Arc::new(tokio::sync::Semaphore::new(1));
    state.request_timeout = Duration::from_mins(1);
    let app = router(state.clone());
    // A body that says when it is first asked for, and never gives a byte.
    let (polled_tx, polled) = oneshot::channel::<()>();
    let mut polled_tx = Some(polled_tx);
    let never = futures_util::stream::poll_fn(move |_| {
        if let Some(tx) = polled_tx.take() {
            let _ = tx.send(());
        }
        std::task::Poll::<Option<Result<bytes::Bytes, std::io::Error>>>::Pending
    });
    let path = if cfg!(feature = "ui") {
        "/prom/api/v1/query"
    } else {
        "/api/v1/series"
    };
    let slow = Request::post(path)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from_stream(never))
        .unwrap();
    let slow = tokio::spawn(app.clone().oneshot(slow));
    polled.await.expect("the body is read");
    // The only query turn is free for others while the body is awaited.
    let fresh = tokio::time::timeout(
        Duration::from_secs(30),
        call(&app, "GET", "/api/v1/series", &[]),
    )
    .await
    .expect("a query is answered while a body is awaited");
    assert_eq!(fresh.0, StatusCode::OK);
    slow.abort();

    state.request_timeout = Duration::from_millis(200);
    let app = router(state);
    let never = futures_util::stream::pending::<Result<bytes::Bytes, std::io::Error>>();
    let slow = Request::post(path).body(Body::from_stream(never)).unwrap();
    let response = app.oneshot(slow).await.unwrap();
    assert_eq!(response.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(response.headers()["connection"], "close");
    // Too large is refused the same way.
    let big = Request::post("/api/v1/flush")
        .body(Body::from(vec![b'x'; BODY_BYTES_MAX + 1]))
        .unwrap();
    let dir2 = tempfile::tempdir().unwrap();
    let (state, _r, _s) = test_state(&dir2, 1);
    let response = router(state).oneshot(big).await.unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(response.headers()["connection"], "close");
}

/// Issue 41: a client that hung up freed its query turn while its read went on in the
/// blocking pool, so a connect-send-close loop ran any number of reads at once. The turn
/// is now given back only when the read has ended.
#[tokio::test]
async fn a_client_that_hangs_up_keeps_its_turn_until_its_read_ends() {
    let slots = Arc::new(tokio::sync::Semaphore::new(1));
    let (started_tx, started) = std::sync::mpsc::channel::<()>();
    let (finish, finish_rx) = std::sync::mpsc::channel::<()>();
    let finish_rx = Arc::new(std::sync::Mutex::new(finish_rx));
    let app = Router::new()
        .route(
            "/read",
            get(move || {
                let (started_tx, finish_rx) = (started_tx.clone(), finish_rx.clone());
                async move {
                    tokio::task::spawn_blocking(move || {
                        started_tx.send(()).unwrap();
                        let _ = finish_rx.lock().unwrap().recv();
                    })
                    .await
                    .unwrap();
                    "done"
                }
            }),
        )
        .route_layer(from_fn_with_state(slots.clone(), take_turn));
    let request = app.oneshot(Request::get("/read").body(Body::empty()).unwrap());
    let client = tokio::spawn(request);
    tokio::task::spawn_blocking(move || started.recv().unwrap())
        .await
        .unwrap();
    // The client hangs up mid-read.
    client.abort();
    assert!(client.await.unwrap_err().is_cancelled());
    assert_eq!(
        slots.available_permits(),
        0,
        "the read still holds the turn"
    );
    finish.send(()).unwrap();
    let back = tokio::time::timeout(Duration::from_mins(1), slots.acquire())
        .await
        .expect("the turn comes back once the read has ended");
    drop(back);
}

/// Issue 41 (the class of slow clients): an answer the client never reads ends its
/// connection after the limit, instead of holding it for ever.
#[tokio::test(start_paused = true)]
async fn a_write_the_peer_never_reads_fails_after_the_limit() {
    use tokio::io::AsyncWriteExt;
    let (near, _far) = tokio::io::duplex(64);
    let mut stream = WriteDeadline::new(near, Duration::from_secs(10));
    let started = tokio::time::Instant::now();
    let e = stream.write_all(&[0u8; 4096]).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    assert!(started.elapsed() >= Duration::from_secs(10));
    // A reader that keeps up is never cut off.
    let (near, mut far) = tokio::io::duplex(64);
    let mut stream = WriteDeadline::new(near, Duration::from_secs(10));
    let reader = tokio::spawn(async move {
        let mut all = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut far, &mut all)
            .await
            .unwrap();
        all.len()
    });
    stream.write_all(&[1u8; 4096]).await.unwrap();
    stream.shutdown().await.unwrap();
    drop(stream);
    assert_eq!(reader.await.unwrap(), 4096);
}

#[test]
fn host_names_are_read_like_a_host_header() {
    for (host, want) in [
        ("localhost", Some("localhost")),
        ("localhost:9470", Some("localhost")),
        ("[::1]:9470", Some("::1")),
        ("[::1]", Some("::1")),
        ("10.0.0.1:80", Some("10.0.0.1")),
        ("a:b", None),
        ("[::1]x", None),
        ("[zz]:1", None),
        (":80", None),
        ("a/b", None),
        ("a:123456", None),
    ] {
        assert_eq!(host_name(host), want, "{host}");
    }
}

/// Issue 41: the HTTP query string and form body are bounded, tested at the bound and one
/// past it.
#[tokio::test]
async fn request_targets_and_bodies_are_bounded_at_the_limit_and_one_past_it() {
    let dir = tempfile::tempdir().unwrap();
    let (state, _, _store) = test_state(&dir, 1);
    let app = router(state);
    let target = |n: usize| {
        let head = "/api/v1/series?pad=";
        format!("{head}{}", "a".repeat(n - head.len()))
    };
    let (status, _, _) = call(&app, "GET", &target(URI_BYTES_MAX), &[]).await;
    assert_eq!(status, StatusCode::OK);
    let (status, headers, body) = call(&app, "GET", &target(URI_BYTES_MAX + 1), &[]).await;
    assert_eq!(status, StatusCode::URI_TOO_LONG, "{body}");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    if cfg!(feature = "ui") {
        let form = |n: usize| {
            let head = "query=1&pad=";
            format!("{head}{}", "a".repeat(n - head.len()))
        };
        for (n, want) in [
            (BODY_BYTES_MAX, StatusCode::OK),
            (BODY_BYTES_MAX + 1, StatusCode::PAYLOAD_TOO_LARGE),
        ] {
            let request = Request::post("/prom/api/v1/query")
                .header("content-type", "application/x-www-form-urlencoded")
                .body(Body::from(form(n)))
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), want, "a body of {n} bytes");
        }
    }
}

/// A value of any parameter, often an extreme one.
fn nasty_value() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    prop_oneof![
        Just(i64::MAX.to_string()),
        Just(i64::MIN.to_string()),
        Just("9223372036854775807000".to_owned()),
        Just("-9223372036854775".to_owned()),
        Just("1e308".to_owned()),
        Just("-1e308".to_owned()),
        Just("NaN".to_owned()),
        Just("inf".to_owned()),
        Just("0".to_owned()),
        Just("-1".to_owned()),
        Just("1763719200".to_owned()),
        Just("9999-12-31T23:59:59Z".to_owned()),
        Just("0000-01-01T00:00:00Z".to_owned()),
        Just("2026-11-21T10:00:00+23:59".to_owned()),
        Just("99999999999999h".to_owned()),
        Just("1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y1y".to_owned()),
        Just("0.0001".to_owned()),
        Just("1ms".to_owned()),
        Just("7d".to_owned()),
        Just("a/t".to_owned()),
        Just("bucketd_bucket_mean".to_owned()),
        Just(r#"bucketd_bucket_mean{series=~".+"}"#.to_owned()),
        Just(r#"sum by (sensor) (bucketd_bucket_max{sensor!=""})"#.to_owned()),
        Just("-(-(-1))".to_owned()),
        "[ -~]{0,40}",
        any::<String>(),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Issue 41, the class: whatever a client puts in any parameter of any endpoint, the
    /// answer is a 2xx or 4xx (never a 5xx, never a panic: arithmetic on its numbers is
    /// checked), over a store that holds data.
    #[test]
    fn any_parameter_value_is_answered_or_refused_never_a_crash(
        values in proptest::collection::vec(nasty_value(), 6),
        post in proptest::bool::ANY,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let (state, _, mut store) = test_state(&dir, 1);
            let mut b = crate::batcher::Batcher::by_hand();
            let now = std::time::Instant::now();
            for h in 0..48i64 {
                let ts = Timestamp::from_secs(1_763_719_200 - h * 3600);
                b.push_reading(Arc::from("a/t"), ts, h as f64, true, now);
            }
            store.commit(&b.take().0).unwrap();
            let app = router(state);
            let enc = |v: &str| {
                v.bytes().fold(String::new(), |mut out, b| {
                    if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                        out.push(char::from(b));
                    } else {
                        use std::fmt::Write;
                        let _ = write!(out, "%{b:02X}");
                    }
                    out
                })
            };
            let v: Vec<String> = values.iter().map(|v| enc(v)).collect();
            let mut paths = vec![
                format!("/api/v1/buckets?series={}&from={}&to={}&step={}", v[0], v[1], v[2], v[3]),
                format!("/api/v1/buckets?series=a/t&from={}&to={}&step={}", v[1], v[2], v[3]),
                format!("/api/v1/raw?series=a/t&from={}&to={}&limit={}", v[1], v[2], v[4]),
                format!("/api/v1/raw?series={}&from={}&to={}", v[0], v[1], v[2]),
            ];
            if cfg!(feature = "ui") {
                paths.extend([
                    format!("/prom/api/v1/query_range?query={}&start={}&end={}&step={}", v[0], v[1], v[2], v[3]),
                    format!("/prom/api/v1/query_range?query=bucketd_bucket_mean&start={}&end={}&step={}", v[1], v[2], v[3]),
                    format!("/prom/api/v1/query?query={}&time={}", v[5], v[1]),
                    format!("/prom/api/v1/query?query=bucketd_bucket_count&time={}", v[1]),
                    format!("/prom/api/v1/series?match[]={}&start={}&end={}", v[0], v[1], v[2]),
                    format!("/prom/api/v1/labels?match[]={}", v[5]),
                    format!("/prom/api/v1/label/{}/values?match[]={}", v[4], v[0]),
                    format!("/prom/api/v1/metadata?metric={}&limit={}", v[0], v[4]),
                ]);
            }
            for path in paths {
                let method = if post && path.starts_with("/prom") { "POST" } else { "GET" };
                let (path, body) = match path.split_once('?') {
                    Some((p, q)) if method == "POST" => (p.to_owned(), q.to_owned()),
                    _ => (path.clone(), String::new()),
                };
                let request = Request::builder()
                    .method(method)
                    .uri(&path)
                    .header("content-type", "application/x-www-form-urlencoded")
                    .body(Body::from(body))
                    .unwrap();
                let response = app.clone().oneshot(request).await.unwrap();
                let status = response.status();
                proptest::prop_assert!(
                    status.is_success() || status.is_client_error(),
                    "{} {}: {}", method, path, status
                );
            }
            Ok(())
        })?;
    }
}
