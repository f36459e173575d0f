//! The HTTP server (axum): `/metrics`, `/healthz`, `/readyz`, the query API under `/api/v1`, and
//! with feature `ui` the chart page at `/` and the Prometheus API under `/prom` (`crate::prom`).
//! Reads run in redb read transactions on the blocking pool: they never block ingestion or the
//! writer. Every error is a 4xx/5xx with `{"error": "..."}` naming the bad parameter.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;
use crate::reading::{Timestamp, validate_series};
use crate::rollup;
use crate::secret::Secret;
use crate::stats::Stats;
use crate::store::StoreReader;

/// A request to commit everything pending; answered with the readings committed.
pub type FlushRequest = oneshot::Sender<u64>;

/// How long `POST /api/v1/flush` waits for its commit.
pub const FLUSH_WAIT_MAX: Duration = Duration::from_secs(30);

#[derive(Clone)]
pub struct ApiState {
    pub reader: StoreReader,
    pub stats: Arc<Stats>,
    pub metrics: Arc<Metrics>,
    pub flush: mpsc::Sender<FlushRequest>,
    /// Flush requests being served; more are refused with 429, so the ingest task never holds
    /// more waiters than permits.
    pub flush_slots: Arc<tokio::sync::Semaphore>,
    pub bucket_width_secs: i64,
    pub max_buckets_per_query: usize,
    /// `http.max_points_per_query`, for the Prometheus API.
    pub max_points_per_query: u64,
    pub max_raw_readings: usize,
    /// Bearer token for `/api/*` (`http.token_file`); `None`: open.
    pub api_token: Option<Arc<Secret>>,
    /// Bearer token for `/metrics` (`http.metrics_token_file`); `None`: open.
    pub metrics_token: Option<Arc<Secret>>,
    /// Query API requests served at once (`http.max_concurrent_queries`); more wait their turn.
    pub query_slots: Arc<tokio::sync::Semaphore>,
}

pub fn router(state: ApiState) -> Router {
    // Queries take turns (inside the token check: a refused request takes none); a flush has
    // its own bound and holds no answer in memory.
    let queries = Router::new()
        .route("/api/v1/series", get(series))
        .route("/api/v1/buckets", get(buckets))
        .route("/api/v1/raw", get(raw));
    #[cfg(feature = "ui")]
    let queries = queries.nest_service(
        "/prom",
        crate::prom::router(crate::prom::PromState {
            reader: state.reader.clone(),
            bucket_width_secs: state.bucket_width_secs,
            max_points: state.max_points_per_query,
        }),
    );
    let queries = queries.route_layer(from_fn_with_state(state.query_slots.clone(), take_turn));
    let api = Router::new()
        .route("/api/v1/flush", post(flush))
        .route("/api/v1/rejected", get(rejected))
        .merge(queries)
        .route_layer(from_fn_with_state(
            Guard {
                token: state.api_token.clone(),
                stats: state.stats.clone(),
            },
            require_token,
        ));
    let metrics = Router::new()
        .route("/metrics", get(metrics))
        .route_layer(from_fn_with_state(
            Guard {
                token: state.metrics_token.clone(),
                stats: state.stats.clone(),
            },
            require_token,
        ));
    let open = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz));
    #[cfg(feature = "ui")]
    let open = open.merge(crate::chart::routes());
    open.merge(api)
        .merge(metrics)
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .with_state(state)
}

/// What bounds the server's connections (`[http]`).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections open at once; one more is closed as it arrives (counted).
    pub max_connections: usize,
    /// A connection that has not sent a whole request head within this time is closed, idle
    /// keep-alive connections included.
    pub header_read_timeout: Duration,
}

/// Serves `app` on `listener` until `cancel`, then lets the requests in progress finish.
/// HTTP/1.1 only. A connection past `max_connections` is accepted and closed at once (not left
/// in the kernel's queue, where it would wait ahead of a probe); a half-sent request head is cut
/// off after `header_read_timeout`. So neither idle nor slow clients can take the file
/// descriptors that MQTT reconnects and store reopens need.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ConnectionLimits,
    stats: Arc<Stats>,
    cancel: tokio_util::sync::CancellationToken,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = cancel.cancelled() => break,
            // Reap finished connections as they go (the set is bounded by the slots).
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, most likely: wait a little rather than spin.
                tracing::warn!(error = %e, "Accepting an HTTP connection failed.");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            stats
                .http_connections_refused
                .fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let cancel = cancel.clone();
        connections.spawn(async move {
            let _permit = permit;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout);
            let connection =
                builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                () = cancel.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        });
    }
    while connections.join_next().await.is_some() {}
}

/// The token one group of routes needs, and where refusals are counted.
#[derive(Clone)]
struct Guard {
    token: Option<Arc<Secret>>,
    stats: Arc<Stats>,
}

/// Runs the request once one of `slots` is free, holding it until the answer is ready: a few
/// large answers at a time, whatever the number of clients.
async fn take_turn(
    State(slots): State<Arc<tokio::sync::Semaphore>>,
    request: Request,
    next: Next,
) -> Response {
    let Ok(_turn) = slots.acquire_owned().await else {
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "bucketd is shutting down")
            .into_response();
    };
    next.run(request).await
}

/// Lets the request through when no token is configured or it carries
/// `Authorization: Bearer <token>`; else 401 with `WWW-Authenticate: Bearer`, counted in
/// `bucketd_http_unauthorized_total`. The answer never echoes what was sent.
async fn require_token(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    let Some(token) = guard.token else {
        return next.run(request).await;
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer_credentials(v.as_bytes()));
    let message = match presented {
        Some(candidate) if token.matches(candidate) => return next.run(request).await,
        Some(_) => "the bearer token is not valid",
        None => "this endpoint needs `Authorization: Bearer <token>`",
    };
    guard
        .stats
        .http_unauthorized
        .fetch_add(1, Ordering::Relaxed);
    unauthorized(message)
}

/// The credentials of an `Authorization: Bearer <token>` value. The scheme is case-insensitive
/// (RFC 9110, 11.1) and may be followed by more than one space.
fn bearer_credentials(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let start = rest.iter().position(|b| *b != b' ')?;
    Some(&rest[start..])
}

/// Why binding `bind` without an API token deserves a warning: anyone who reaches the address
/// can read every series and trigger commits (`POST /api/v1/flush`, an fsync each). `None` on
/// a loopback address or with a token.
pub fn exposure_warning(bind: std::net::SocketAddr, api_token: bool) -> Option<String> {
    (!api_token && !bind.ip().is_loopback()).then(|| {
        format!(
            "The HTTP API on {bind} has no token: anyone who can reach it can read every series \
             and POST /api/v1/flush. Set http.token_file, or bind 127.0.0.1 if only this host \
             queries it."
        )
    })
}

fn unauthorized(message: &str) -> Response {
    let mut response = ApiError::new(StatusCode::UNAUTHORIZED, message).into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer realm=\"bucketd\""),
    );
    response
}

/// An error answer: a status and `{"error": message}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }

    fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    /// The details (file paths, the storage engine's words) go to the log only, under a number
    /// the client gets to quote.
    fn internal(e: impl std::fmt::Display) -> ApiError {
        static ERRORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = ERRORS.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::error!(error = %e, error_id = id, "Query failed.");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading the store failed (error_id {id} in bucketd's log)"),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(json!({ "error": self.message }))).into_response()
    }
}

type Params = Query<HashMap<String, String>>;

async fn metrics(State(s): State<ApiState>) -> Response {
    let text = s.metrics.render(&s.stats);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// 200 when the store is open (it is while the server runs) and the broker connection is up
/// with our subscriptions in place; 503 otherwise.
async fn readyz(State(s): State<ApiState>) -> Response {
    let connected = s.stats.connected.load(Ordering::Relaxed);
    let subscribed = s.stats.subscribed.load(Ordering::Relaxed);
    let writable = !s.stats.store_failing.load(Ordering::Relaxed);
    let ready = connected && subscribed && writable;
    let body = json!({"ready": ready, "store_writable": writable,
                      "mqtt_connected": connected, "subscribed": subscribed});
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

/// Runs a blocking store read off the async workers.
async fn read<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, redb::Error> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::internal)
}

async fn series(State(s): State<ApiState>) -> Result<axum::Json<Value>, ApiError> {
    let reader = s.reader.clone();
    let names = read(move || reader.series()).await?;
    let list: Vec<Value> = names
        .iter()
        .map(|name| {
            let (sensor, metric) = crate::reading::split_series(name);
            json!({"name": name, "sensor": sensor, "metric": metric})
        })
        .collect();
    Ok(axum::Json(json!({ "series": list })))
}

/// The dead letters (`limits.dead_letters`), oldest first: what was refused, why, and the start
/// of its payload, as text when it is UTF-8 and always in hex (delta messages are BSON).
async fn rejected(State(s): State<ApiState>) -> axum::Json<Value> {
    use std::fmt::Write;
    let letters: Vec<Value> = s
        .stats
        .dead_letters()
        .into_iter()
        .map(|d| {
            let hex = d.payload.iter().fold(String::new(), |mut out, b| {
                let _ = write!(out, "{b:02x}");
                out
            });
            json!({
                "at": d.at.to_rfc3339_millis(),
                "reason": d.reason,
                "topic": d.topic,
                "payload": std::str::from_utf8(&d.payload).ok(),
                "payload_hex": hex,
            })
        })
        .collect();
    axum::Json(json!({ "rejected": letters }))
}

fn required<'a>(params: &'a HashMap<String, String>, name: &str) -> Result<&'a str, ApiError> {
    params
        .get(name)
        .map(String::as_str)
        .filter(|v| !v.is_empty())
        .ok_or_else(|| ApiError::bad(format!("missing parameter `{name}`")))
}

fn time_param(params: &HashMap<String, String>, name: &str) -> Result<Timestamp, ApiError> {
    let text = required(params, name)?;
    Timestamp::parse(text).ok_or_else(|| {
        ApiError::bad(format!(
            "parameter `{name}`: `{text}` is not an RFC 3339 time (2026-11-21T10:00:00Z) or epoch seconds"
        ))
    })
}

/// The validated `series`, `from` and `to` parameters, with `from` before `to`.
fn series_range(
    params: &HashMap<String, String>,
) -> Result<(String, Timestamp, Timestamp), ApiError> {
    let series = required(params, "series")?;
    validate_series(series).map_err(|_| {
        ApiError::bad(format!(
            "parameter `series`: `{series}` is not sensor/metric"
        ))
    })?;
    let from = time_param(params, "from")?;
    let to = time_param(params, "to")?;
    if from >= to {
        return Err(ApiError::bad(
            "parameters `from` and `to`: `from` must be before `to`",
        ));
    }
    Ok((series.to_owned(), from, to))
}

/// [`series_range`] with `[from, to)` in whole seconds for bucket starts.
fn range(params: &HashMap<String, String>) -> Result<(String, i64, i64), ApiError> {
    let (series, from, to) = series_range(params)?;
    Ok((series, from.ceil_secs(), to.ceil_secs()))
}

async fn buckets(State(s): State<ApiState>, Query(params): Params) -> Result<Response, ApiError> {
    let (series, from, to) = range(&params)?;
    let width = s.bucket_width_secs;
    let step = match params.get("step") {
        None => width,
        Some(text) => rollup::parse_step(text, width)
            .map_err(|e| ApiError::bad(format!("parameter `step`: {e}")))?,
    };
    let covered = (to - from).div_euclid(width) + 1;
    if covered > s.max_buckets_per_query as i64 {
        return Err(ApiError::bad(format!(
            "parameters `from` and `to`: the range covers {covered} buckets, more than \
             http.max_buckets_per_query ({}); narrow the range",
            s.max_buckets_per_query
        )));
    }
    let reader = s.reader.clone();
    let name = series.clone();
    let docs = read(move || {
        if !reader.has_series(&name)? {
            return Ok(None);
        }
        reader.buckets(Some(&name), from, to).map(Some)
    })
    .await?;
    let Some(docs) = docs else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("parameter `series`: no series `{series}`"),
        ));
    };
    let windows: Vec<Value> = rollup::rollup(&docs, step)
        .iter()
        .map(|w| Value::Object(crate::export::summary_json(w.start, w.end, &w.summary)))
        .collect();
    let step_text = rollup::format_step(step);
    Ok(
        axum::Json(json!({"series": series, "step": step_text, "buckets": windows}))
            .into_response(),
    )
}

/// Raw readings of one series in `[from, to)`, in timestamp order, at most `limit` (default and
/// cap: `http.max_raw_readings`); `truncated` says whether more were in the range.
async fn raw(State(s): State<ApiState>, Query(params): Params) -> Result<Response, ApiError> {
    let (series, from, to) = series_range(&params)?;
    let limit = match params.get("limit") {
        None => s.max_raw_readings,
        Some(text) => text
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=s.max_raw_readings).contains(n))
            .ok_or_else(|| {
                ApiError::bad(format!(
                    "parameter `limit`: `{text}` is not a number from 1 to http.max_raw_readings ({})",
                    s.max_raw_readings
                ))
            })?,
    };
    let reader = s.reader.clone();
    let name = series.clone();
    let answer = read(move || {
        if !reader.has_series(&name)? {
            return Ok(None);
        }
        let mut out: Vec<(i64, f64)> = Vec::new();
        let mut truncated = false;
        reader.raw(
            Some(&name),
            from.as_nanos(),
            to.as_nanos(),
            |_, readings| {
                let room = limit - out.len();
                truncated = readings.len() > room;
                out.extend_from_slice(&readings[..readings.len().min(room)]);
                !truncated && out.len() < limit
            },
        )?;
        Ok(Some((out, truncated)))
    })
    .await?;
    let Some((readings, truncated)) = answer else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("parameter `series`: no series `{series}`"),
        ));
    };
    let list: Vec<Value> = readings
        .iter()
        .map(|(ts, v)| json!({"ts": Timestamp::from_nanos(*ts).to_rfc3339_millis(), "value": v}))
        .collect();
    Ok(
        axum::Json(json!({"series": series, "readings": list, "truncated": truncated}))
            .into_response(),
    )
}

async fn flush(State(s): State<ApiState>) -> Result<axum::Json<Value>, ApiError> {
    let too_many = || {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too many flush requests are waiting; retry shortly",
        )
    };
    let _slot = s
        .flush_slots
        .clone()
        .try_acquire_owned()
        .map_err(|_| too_many())?;
    let (tx, rx) = oneshot::channel();
    let unavailable = || ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "bucketd is shutting down");
    s.flush.try_send(tx).map_err(|e| match e {
        mpsc::error::TrySendError::Full(_) => too_many(),
        mpsc::error::TrySendError::Closed(_) => unavailable(),
    })?;
    let committed = tokio::time::timeout(FLUSH_WAIT_MAX, rx)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "the commit did not finish within 30 s",
            )
        })?
        .map_err(|_| unavailable())?;
    Ok(axum::Json(json!({ "committed": committed })))
}

#[cfg(test)]
mod tests {
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
            reader: store.reader(),
            stats: Arc::new(Stats::new(0)),
            metrics: Arc::new(Metrics::new()),
            flush,
            flush_slots: Arc::new(tokio::sync::Semaphore::new(flush_slots)),
            bucket_width_secs: 3600,
            max_buckets_per_query: 10,
            max_points_per_query: 1000,
            max_raw_readings: 10,
            api_token: None,
            metrics_token: None,
            query_slots: Arc::new(tokio::sync::Semaphore::new(4)),
        };
        // The store stays open while the reader is used (dropping it closes the file).
        (state, requests, store)
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
        );
        state.stats.reject(
            crate::reject::DecodeError::GatewayMismatch,
            b"bucketd/site-1/deltas",
            &[0xff, 0x00],
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
                assert!(body.contains("\"error\""), "{body}");
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
}
