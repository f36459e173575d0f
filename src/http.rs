//! The HTTP server (axum): `/metrics`, `/healthz`, `/readyz`, the query API under `/api/v1`, and
//! with feature `ui` the chart page at `/` and the Prometheus API under `/prom` (`crate::prom`).
//! Reads run in redb read transactions on the blocking pool: they never block ingestion or the
//! writer. Every error is a 4xx/5xx with `{"error": "..."}` naming the bad parameter.
//!
//! What a client can hold is bounded (docs/RELIABILITY.md, "Threat model"): connections in all
//! and per address, a request head's and a body's time, a body's size, an unread answer's time,
//! and query turns, which a request takes only once its body is in and keeps until its read in
//! the blocking pool has ended (a client that hangs up does not free it early). Without a token,
//! an endpoint answers only requests that name this server by address, `localhost` or
//! `http.allowed_hosts`, and no cross-site POST.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
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
use crate::source::{ReadError, Source, damaged_message};
use crate::stats::Stats;

/// A request to commit everything pending; answered with the readings committed.
pub type FlushRequest = oneshot::Sender<u64>;

/// How long `POST /api/v1/flush` waits for its commit.
pub const FLUSH_WAIT_MAX: Duration = Duration::from_secs(30);

#[derive(Clone)]
pub struct ApiState {
    /// What queries read: the daemon's store, or (a query node) the fleet's PostgreSQL.
    pub source: Source,
    pub stats: Arc<Stats>,
    pub metrics: Arc<Metrics>,
    /// Where `POST /api/v1/flush` goes (the ingest task); `None` on a query node, where nothing
    /// is ever pending: it answers that nothing was committed.
    pub flush: Option<mpsc::Sender<FlushRequest>>,
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
    /// `http.request_timeout`: the most a request's body may take after its head.
    pub request_timeout: Duration,
    /// `http.lookback`: how far back a plain `bucketd_reading` looks (the Prometheus API).
    pub lookback: Duration,
    /// `http.allowed_hosts`, lower case: names an open endpoint answers to besides addresses and
    /// `localhost`.
    pub allowed_hosts: Arc<[String]>,
}

/// Largest request body (a Prometheus API form: a query of at most 4 KiB, a few `match[]`).
pub const BODY_BYTES_MAX: usize = 64 * 1024;
/// Largest request head (request line and headers; past it, 431): a target of
/// [`URI_BYTES_MAX`] and the headers of any client.
pub const HEAD_BYTES_MAX: usize = 64 * 1024;
/// Longest request target (path and query string): the API's parameters are a series name
/// and a few times; Grafana and promtool send their queries as form bodies.
pub const URI_BYTES_MAX: usize = 16 * 1024;

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
            source: state.source.clone(),
            bucket_width_secs: state.bucket_width_secs,
            max_points: state.max_points_per_query,
            lookback_ms: i64::try_from(state.lookback.as_millis()).unwrap_or(i64::MAX),
            unreadable: crate::source::Unreadable::default(),
            notes: crate::promql::Notes::default(),
            hangup: None,
        }),
    );
    let queries = queries.route_layer(from_fn_with_state(state.query_slots.clone(), take_turn));
    let guard = |token: &Option<Arc<Secret>>| Guard {
        token: token.clone(),
        stats: state.stats.clone(),
        allowed_hosts: state.allowed_hosts.clone(),
    };
    let api = Router::new()
        .route("/api/v1/flush", post(flush))
        .route("/api/v1/rejected", get(rejected))
        .merge(queries)
        .route_layer(from_fn_with_state(guard(&state.api_token), require_token));
    let metrics = Router::new()
        .route("/metrics", get(metrics))
        .route_layer(from_fn_with_state(
            guard(&state.metrics_token),
            require_token,
        ));
    let open = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz));
    #[cfg(feature = "ui")]
    let open = open.merge(crate::chart::routes());
    let timeout = state.request_timeout;
    open.merge(api)
        .merge(metrics)
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .with_state(state)
        .layer(from_fn_with_state(timeout, whole_request))
}

/// Every request: its target at most [`URI_BYTES_MAX`] bytes, and its body read whole (at most
/// [`BODY_BYTES_MAX`], within `timeout`) before anything else sees it, so no handler waits on a client while holding a query turn; and
/// every answer marked `nosniff`. A body too slow or too large ends the connection.
async fn whole_request(State(timeout): State<Duration>, request: Request, next: Next) -> Response {
    let target = request
        .uri()
        .path_and_query()
        .map_or(0, |pq| pq.as_str().len());
    if target > URI_BYTES_MAX {
        let mut response = ApiError::new(
            StatusCode::URI_TOO_LONG,
            format!("the request target is longer than {URI_BYTES_MAX} bytes"),
        )
        .into_response();
        nosniff(&mut response);
        return response;
    }
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(timeout, axum::body::to_bytes(body, BODY_BYTES_MAX)).await;
    let refused = match read {
        Ok(Ok(bytes)) => {
            let request = Request::from_parts(parts, axum::body::Body::from(bytes));
            let mut response = next.run(request).await;
            nosniff(&mut response);
            return response;
        }
        Ok(Err(_)) => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {BODY_BYTES_MAX} bytes"),
        ),
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within http.request_timeout ({})",
                humantime::format_duration(timeout)
            ),
        ),
    };
    let mut response = refused.into_response();
    nosniff(&mut response);
    // The rest of the body is never read: the connection cannot carry another request.
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

fn nosniff(response: &mut Response) {
    response.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
}

/// What bounds the server's connections (`[http]`).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections open at once; one more is closed as it arrives (counted).
    pub max_connections: usize,
    /// Connections open at once from one IP address; one more is closed as it arrives (counted).
    pub max_connections_per_address: usize,
    /// A connection that has not sent a whole request head within this time is closed, idle
    /// keep-alive connections included.
    pub header_read_timeout: Duration,
    /// A connection whose answer the client leaves unread this long is closed.
    pub write_stall_max: Duration,
}

/// Connections open per client address, bounded by `max_connections` entries (an address is
/// listed only while it has one open).
#[derive(Debug, Default)]
struct PerAddress(std::sync::Mutex<HashMap<std::net::IpAddr, usize>>);

/// One connection's place in [`PerAddress`], given back when the connection ends.
struct AddressSlot {
    table: Arc<PerAddress>,
    ip: std::net::IpAddr,
}

impl PerAddress {
    fn take(table: &Arc<PerAddress>, ip: std::net::IpAddr, max: usize) -> Option<AddressSlot> {
        let mut open = table
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = open.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(AddressSlot {
            table: table.clone(),
            ip,
        })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self
            .table
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
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
    let per_address = Arc::new(PerAddress::default());
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = cancel.cancelled() => break,
            // Reap finished connections as they go (the set is bounded by the slots).
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, most likely: wait a little rather than spin.
                tracing::warn!(error = %e, "Accepting an HTTP connection failed.");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let taken = slots.clone().try_acquire_owned().ok().and_then(|permit| {
            let ip = peer.ip().to_canonical();
            PerAddress::take(&per_address, ip, limits.max_connections_per_address)
                .map(|slot| (permit, slot))
        });
        let Some(held) = taken else {
            stats
                .http_connections_refused
                .fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let cancel = cancel.clone();
        connections.spawn(async move {
            let _held = held;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                // A request head of at most this much (hyper's default buffer takes ~400 KB):
                // what 32 connections can make the server hold stays ~2 MiB.
                .max_header_size(HEAD_BYTES_MAX);
            let stream = WriteDeadline::new(stream, limits.write_stall_max);
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

/// A stream whose writes fail once the peer has read nothing for `limit`: a client that asks
/// and never reads its answer cannot hold a connection (and its file descriptor) for ever.
struct WriteDeadline<S> {
    inner: S,
    limit: Duration,
    /// Armed while a write waits for the peer.
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<S> WriteDeadline<S> {
    fn new(inner: S, limit: Duration) -> WriteDeadline<S> {
        WriteDeadline {
            inner,
            limit,
            stalled: None,
        }
    }

    /// `Pending` stays pending until `limit` has passed without progress, then fails.
    fn judge<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        poll: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::task::Poll;
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let limit = self.limit;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client read nothing of its answer within http.request_timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let poll = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        self.judge(cx, poll)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let poll = std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.judge(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let poll = std::pin::Pin::new(&mut self.inner).poll_flush(cx);
        self.judge(cx, poll)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let poll = std::pin::Pin::new(&mut self.inner).poll_shutdown(cx);
        self.judge(cx, poll)
    }
}

/// The token one group of routes needs, where refusals are counted, and (while there is no
/// token) the names its requests may give in `Host`.
#[derive(Clone)]
struct Guard {
    token: Option<Arc<Secret>>,
    stats: Arc<Stats>,
    allowed_hosts: Arc<[String]>,
}

/// Queries being answered, all servers of the process together.
static QUERIES_IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// Runs the request once one of `slots` is free, holding it until the answer is ready and any
/// read it started in the blocking pool has ended: a few large answers and reads at a time,
/// whatever the number of clients. The request runs as a task of its own, so a client that
/// hangs up does not end it early: its turn is given back only when its work is done.
async fn take_turn(
    State(slots): State<Arc<tokio::sync::Semaphore>>,
    mut request: Request,
    next: Next,
) -> Response {
    let Ok(turn) = slots.acquire_owned().await else {
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "bucketd is shutting down")
            .into_response();
    };
    QUERIES_IN_FLIGHT.fetch_add(1, Ordering::AcqRel);
    // The work runs in a task of its own (the turn is held until it ends); this future is what
    // the server drops when the client hangs up, and the flag it then sets stops the query.
    let hangup = crate::source::Hangup::default();
    let _set_when_gone = hangup.on_drop();
    request.extensions_mut().insert(hangup);
    let work = tokio::spawn(async move {
        let response = next.run(request).await;
        drop(turn);
        // The last query of a burst gives its memory back (the answer's body is mapped on its
        // own and freed once sent: `metrics::tune_allocator`).
        if QUERIES_IN_FLIGHT.fetch_sub(1, Ordering::AcqRel) == 1 {
            tokio::spawn(async {
                tokio::time::sleep(crate::metrics::TRIM_AFTER_QUERIES).await;
                if QUERIES_IN_FLIGHT.load(Ordering::Acquire) == 0 {
                    tokio::task::spawn_blocking(crate::metrics::release_free_memory);
                }
            });
        }
        response
    });
    work.await
        .unwrap_or_else(|e| ApiError::internal(e).into_response())
}

/// Whether a request may reach an endpoint that has no token: its `Host` names this server
/// (an IP address, `localhost` or `*.localhost`, or a name in `http.allowed_hosts`), so that no
/// web page reaches it through DNS rebinding (which always sends the page's own name); and it
/// is no POST from a page of another site (a plain cross-site form needs no CORS preflight).
/// `Err` says what was refused.
fn same_site(request: &Request, allowed_hosts: &[String]) -> Result<(), &'static str> {
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or("\u{0}"))
        .or_else(|| {
            request
                .uri()
                .authority()
                .map(axum::http::uri::Authority::as_str)
        });
    let Some(host) = host else {
        // HTTP/1.0 without a Host: no browser sends that.
        return Ok(());
    };
    let name = host_name(host)
        .ok_or("the Host header is not a host name")?
        .to_ascii_lowercase();
    let named = name.parse::<std::net::IpAddr>().is_ok()
        || name == "localhost"
        || name.ends_with(".localhost")
        || allowed_hosts.iter().any(|a| a.eq_ignore_ascii_case(&name));
    if !named {
        return Err("the Host header names this server by a name not in http.allowed_hosts");
    }
    if request.method() == axum::http::Method::POST {
        let cross = headers
            .get("sec-fetch-site")
            .is_some_and(|v| v.as_bytes() == b"cross-site");
        let foreign_origin = headers.get(header::ORIGIN).is_some_and(|origin| {
            let origin = origin.to_str().unwrap_or("");
            let authority = origin.split_once("://").map_or("", |(_, rest)| rest);
            !authority.eq_ignore_ascii_case(host)
        });
        if cross || foreign_origin {
            return Err("a POST from a web page of another site");
        }
    }
    Ok(())
}

/// The name in a `Host` value (`name`, `name:port`, `[v6]:port`), lower-cased by the caller's
/// comparison; `None` when it is not one.
fn host_name(host: &str) -> Option<&str> {
    let name = if let Some(rest) = host.strip_prefix('[') {
        let (v6, port) = rest.split_once(']')?;
        if !(port.is_empty() || port.strip_prefix(':').is_some_and(valid_port)) {
            return None;
        }
        v6.parse::<std::net::Ipv6Addr>().ok()?;
        return Some(v6);
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if valid_port(port) => name,
            Some(_) => return None,
            None => host,
        }
    };
    let ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    ok.then_some(name)
}

fn valid_port(port: &str) -> bool {
    !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit())
}

/// Lets the request through when no token is configured (and it is [`same_site`]) or it
/// carries `Authorization: Bearer <token>`; else 401 with `WWW-Authenticate: Bearer`, counted
/// in `bucketd_http_unauthorized_total`, or 403 for a request of another site. The answer
/// never echoes what was sent.
async fn require_token(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    let Some(token) = guard.token else {
        if let Err(why) = same_site(&request, &guard.allowed_hosts) {
            guard
                .stats
                .http_unauthorized
                .fetch_add(1, Ordering::Relaxed);
            return ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "refused: {why}. Without http.token_file, bucketd answers only requests \
                     to its IP address, localhost or a name in http.allowed_hosts, and no POST \
                     from another site's page"
                ),
            )
            .into_response();
        }
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

    /// A failed read: what a source does not hold is a 404 that says where it is; the rest
    /// is [`ApiError::internal`].
    fn read(e: ReadError) -> ApiError {
        match e {
            ReadError::NotHere(why) => ApiError::new(StatusCode::NOT_FOUND, why),
            ReadError::TooLarge(why) => ApiError::bad(why),
            ReadError::Failed(e) => ApiError::internal(e),
            ReadError::Damaged { series, cause } => {
                let e = ApiError::internal(cause);
                ApiError::new(e.status, damaged_message(&series, &e.message))
            }
        }
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
    /// `{"status":"error","errorType":..,"error":..}`: Prometheus's error shape, which the JSON
    /// API shares, so that a client of either (Grafana's Prometheus data source on a wrong token)
    /// shows the message instead of "no data".
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::REQUEST_TIMEOUT => "timeout",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable",
            s if s.is_server_error() => "internal",
            _ => "bad_data",
        };
        let body = json!({ "status": "error", "errorType": kind, "error": self.message });
        (self.status, axum::Json(body)).into_response()
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
/// with our subscriptions in place; 503 otherwise. A query node: 200 while its PostgreSQL
/// answers.
async fn readyz(State(s): State<ApiState>) -> Response {
    let source = s.source.clone();
    let reachable = tokio::task::spawn_blocking(move || source.reachable())
        .await
        .unwrap_or(Some(false));
    if let Some(reachable) = reachable {
        // A query node: ready when its store answers.
        let status = if reachable {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        let body = json!({"ready": reachable, "store_reachable": reachable});
        return (status, axum::Json(body)).into_response();
    }
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
    f: impl FnOnce() -> Result<T, ReadError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::read)
}

async fn series(State(s): State<ApiState>) -> Result<axum::Json<Value>, ApiError> {
    let source = s.source.clone();
    let names = read(move || source.series()).await?;
    let list: Vec<Value> = names
        .iter()
        .map(|name| {
            let (sensor, metric) = crate::reading::split_series(name);
            json!({"name": name, "sensor": sensor, "metric": metric})
        })
        .collect();
    Ok(axum::Json(json!({ "series": list })))
}

/// The dead letters (`limits.dead_letters`), oldest first: what was refused, why, how many of
/// its readings for that reason, the start of its topic, and the start of its payload, as text
/// when it is UTF-8 and always in hex (delta messages are BSON).
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
                "count": d.count,
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
    let source = s.source.clone();
    let name = series.clone();
    let docs = read(move || {
        if !source.has_series(&name)? {
            return Ok(None);
        }
        source.buckets(&name, from, to).map(Some)
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
    let source = s.source.clone();
    let name = series.clone();
    let answer = read(move || {
        if !source.has_series(&name)? {
            return Ok(None);
        }
        let mut out: Vec<(i64, f64)> = Vec::new();
        let mut truncated = false;
        source.raw(&name, from.as_nanos(), to.as_nanos(), &mut |readings| {
            let room = limit - out.len();
            truncated = readings.len() > room;
            out.extend_from_slice(&readings[..readings.len().min(room)]);
            !truncated && out.len() < limit
        })?;
        Ok(Some((out, truncated)))
    })
    .await?;
    let Some((readings, truncated)) = answer else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("parameter `series`: no series `{series}`"),
        ));
    };
    Ok(raw_answer(&series, readings, truncated))
}

/// Readings per chunk of a streamed `/api/v1/raw` answer (about 3 KB of JSON).
const RAW_CHUNK_READINGS: usize = 64;

/// `{"series":..,"readings":[{"ts":..,"value":..},..],"truncated":..}`, written a chunk at a
/// time as the client reads it: what a request holds until its client has read the answer is
/// its readings (16 bytes each), not their JSON (issue 52: 32 slow clients of a 100,000-reading
/// answer held +280 MiB, as JSON values and then text).
fn raw_answer(series: &str, readings: Vec<(i64, f64)>, truncated: bool) -> Response {
    let head = format!(r#"{{"series":{},"readings":["#, json!(series)).into_bytes();
    let tail = format!(r#"],"truncated":{truncated}}}"#).into_bytes();
    let n = readings.len();
    let chunks = (0..n).step_by(RAW_CHUNK_READINGS).map(move |at| {
        let mut out = Vec::with_capacity(RAW_CHUNK_READINGS * 48);
        for (k, (ts, v)) in readings[at..n.min(at + RAW_CHUNK_READINGS)]
            .iter()
            .enumerate()
        {
            if at + k > 0 {
                out.push(b',');
            }
            let reading = json!({"ts": Timestamp::from_nanos(*ts).to_rfc3339_millis(), "value": v});
            serde_json::to_writer(&mut out, &reading).expect("JSON of a number and a string");
        }
        out
    });
    let body = std::iter::once(head)
        .chain(chunks)
        .chain(std::iter::once(tail))
        .map(|chunk| Ok::<_, std::convert::Infallible>(bytes::Bytes::from(chunk)));
    (
        [(header::CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(futures_util::stream::iter(body)),
    )
        .into_response()
}

async fn flush(State(s): State<ApiState>) -> Result<axum::Json<Value>, ApiError> {
    let Some(requests) = &s.flush else {
        return Ok(axum::Json(json!({ "committed": 0 })));
    };
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
    requests.try_send(tx).map_err(|e| match e {
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
mod tests;
