//! Wiring: opens the store, starts the writer thread and the ingest task, and owns the shutdown
//! order. The only place that spawns long-lived workers.
//!
//! Shutdown: cancel -> ingest stops taking messages, commits the batch in flight and the open one,
//! acknowledges them, waits until the acks are written, disconnects -> the writer thread ends
//! when its channel closes -> the store is closed.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

use crate::admit::Admitter;
use crate::batcher::{Batcher, FlushPolicy};
use crate::config::Config;
use crate::ingest::{Core, Ingest, Parts};
use crate::limits::TASKS_STOP_MAX;
use crate::link::Backoff;
use crate::metrics::Metrics;
use crate::mqtt::Mqtt;
use crate::series::SeriesSet;
use crate::stats::Stats;
use crate::store::{Store, StoreOpenError, StoreSettings};

/// Why the daemon could not start. `Config` problems will not fix themselves on a restart
/// (exit 78); the others may.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Store(#[from] StoreOpenError),
    #[error(
        "cannot listen on http.bind {addr}: {source}; is another bucketd running? Set http.bind \
         to a free address"
    )]
    Http {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// A started daemon: its counters, addresses and the handle to stop it.
pub struct RunningDaemon {
    pub stats: Arc<Stats>,
    pub store_path: PathBuf,
    /// Where the HTTP server listens (the port is real when `http.bind` asked for port 0).
    pub http_addr: std::net::SocketAddr,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl RunningDaemon {
    /// Asks the daemon to stop (what SIGTERM does).
    pub fn shutdown(&self) {
        self.cancel.cancel();
    }

    /// Waits until the daemon has stopped: pending readings committed and acknowledged, store
    /// closed.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.task
            .await
            .map_err(|e| anyhow::anyhow!("the daemon task panicked: {e}"))?
    }

    /// Stops and waits.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown();
        self.wait().await
    }
}

/// Starts the daemon on the current Tokio runtime.
pub fn start(config: &Config) -> Result<RunningDaemon, StartError> {
    start_over(config, Store::open)
}

/// [`start`], with write faults injected under the database (tests of disk failures).
#[cfg(feature = "fault-injection")]
pub fn start_with_faults(
    config: &Config,
    faults: Option<Arc<crate::store::Faults>>,
) -> Result<RunningDaemon, StartError> {
    start_over(config, |settings| Store::open_with_faults(settings, faults))
}

/// [`start`] over the store that `open` opens: the start-up's steps, in order. Everything that
/// can fail does so before the first task starts (a task would be left running).
fn start_over(
    config: &Config,
    open: impl FnOnce(&StoreSettings) -> Result<Store, StoreOpenError>,
) -> Result<RunningDaemon, StartError> {
    let state_dir = std::env::var_os("STATE_DIRECTORY").map(PathBuf::from);
    let store_path = config.resolved_store_path(state_dir.as_deref());
    let secrets = Secrets::load(config)?;
    secrets.warn_cleartext(config);
    let store = open(&store_settings(config, &store_path))?;
    let recovered = Recovered::from_store(config, &store, &store_path)?;
    let stats = Arc::new(Stats::new(config.limits.dead_letters));
    stats
        .series
        .store(recovered.series.len() as u64, Ordering::Relaxed);
    let server = HttpServer::bind(config)?;
    let metrics = Arc::new(Metrics::new());
    let (flush_tx, flush_rx) = tokio::sync::mpsc::channel(FLUSH_REQUESTS_MAX);
    let api = ApiParts {
        source: Arc::new(store.reader()),
        stats: stats.clone(),
        metrics: metrics.clone(),
        tokens: secrets.http,
        flush: Some(flush_tx),
    };

    let cancel = CancellationToken::new();
    // The background tasks (forwarder, metrics upkeep), joined at shutdown.
    let tasks = TaskTracker::new();
    if let Some(upstream) = &config.upstream {
        stats.upstream_enabled.store(true, Ordering::Relaxed);
        let forwarder = crate::fleet::forwarder::Forwarder {
            config: upstream.clone(),
            password: secrets.upstream_password,
            reader: store.reader(),
            outbox: store.outbox(),
            stats: stats.clone(),
            origin: recovered.origin.clone(),
            tls: secrets.upstream_tls,
        };
        tasks.spawn(forwarder.run(cancel.clone()));
    }
    if let Some(host_id) = &config.mqtt.sparkplug_host_id {
        // Without the `tls` feature the TLS settings are an (empty) Copy type.
        #[allow(clippy::clone_on_copy)]
        let state = crate::ingest::host_state::HostState {
            mqtt: config.mqtt.clone(),
            host_id: host_id.clone(),
            password: secrets.mqtt_password.clone(),
            tls: secrets.mqtt_tls.clone(),
            stats: stats.clone(),
        };
        tasks.spawn(state.run(cancel.clone()));
    }
    let (writer, writer_thread) = crate::writer::spawn(
        store,
        stats.clone(),
        metrics.clone(),
        crate::writer::Upkeep {
            checkpoint: config.store.checkpoint,
            retention: config.store.retention,
        },
        cancel.clone(),
    );
    let mqtt = MqttLink {
        password: secrets.mqtt_password.as_ref(),
        tls: secrets.mqtt_tls.as_ref(),
    };
    let ingest = new_ingest(config, &mqtt, recovered, stats.clone(), writer, flush_rx);
    info!(addr = %server.addr, "Serving /metrics and the query API.");
    let http_addr = server.addr;
    let http = server.serve(config, api, &tasks, &cancel);
    tasks.close();
    let task = tokio::spawn(run_ingest(
        ingest,
        cancel.clone(),
        writer_thread,
        http,
        tasks,
    ));
    Ok(RunningDaemon {
        stats,
        store_path,
        http_addr,
        cancel,
        task,
    })
}

/// The secrets and TLS settings of the daemon's connections, read once at start from the files
/// the config names (relative names in systemd's `$CREDENTIALS_DIRECTORY`).
struct Secrets {
    mqtt_password: Option<crate::secret::Secret>,
    mqtt_tls: Option<crate::mqtt::TlsClientConfig>,
    http: HttpSecrets,
    upstream_password: Option<crate::secret::Secret>,
    upstream_tls: Option<crate::mqtt::TlsClientConfig>,
}

impl Secrets {
    /// Reads every secret and TLS file the config names; a missing or unreadable one is a
    /// config error naming its key.
    fn load(config: &Config) -> Result<Secrets, StartError> {
        let credentials = crate::secret::credentials_directory();
        let secret = secret_files(credentials.clone());
        let mqtt_password = match &config.mqtt.credentials {
            Some((_, file)) => secret("mqtt.password_file", file)?,
            None => None,
        };
        #[cfg(feature = "tls")]
        let mqtt_tls = config
            .mqtt
            .tls
            .as_ref()
            .map(|files| {
                crate::tls::client_config(files, crate::config::MQTT_TLS, credentials.as_deref())
            })
            .transpose()
            .map_err(StartError::Config)?;
        // Config validation refuses `mqtt.tls` in a build without TLS.
        #[cfg(not(feature = "tls"))]
        let mqtt_tls = None;
        let upstream_tls = match config.upstream.as_ref().map(|u| &u.target) {
            #[cfg(feature = "tls")]
            Some(crate::config::UpstreamTarget::Mqtt {
                tls: Some(files), ..
            }) => Some(
                crate::tls::client_config(
                    files,
                    crate::config::UPSTREAM_TLS,
                    credentials.as_deref(),
                )
                .map_err(StartError::Config)?,
            ),
            _ => None,
        };
        Ok(Secrets {
            mqtt_password,
            mqtt_tls,
            http: HttpSecrets::load(config, &secret)?,
            upstream_password: match &config.upstream {
                Some(u) => secret("upstream.password_file", &u.password_file)?,
                None => None,
            },
            upstream_tls,
        })
    }

    /// Warns about each password that would cross the network in clear text, and an API open
    /// to the network without a token.
    fn warn_cleartext(&self, config: &Config) {
        if let Some(crate::config::UpstreamTarget::Mqtt {
            host,
            username: Some(_),
            ..
        }) = config.upstream.as_ref().map(|u| &u.target)
            && self.upstream_tls.is_none()
            && self.upstream_password.is_some()
            && !is_loopback(host)
        {
            tracing::warn!(
                host = %host,
                "The upstream MQTT password goes to the broker unencrypted: set \
                 upstream.mqtt_tls.enabled = true."
            );
        }
        #[cfg(feature = "postgres")]
        if let Some(u) = &config.upstream
            && let crate::config::UpstreamTarget::Postgres { conninfo } = &u.target
            && let Some(warning) = crate::fleet::postgres::password_exposure(
                "upstream.postgres",
                conninfo,
                u.password_file.is_some(),
            )
        {
            tracing::warn!("{warning}");
        }
        if config.mqtt.credentials.is_some()
            && self.mqtt_tls.is_none()
            && !is_loopback(&config.mqtt.host)
        {
            tracing::warn!(
                host = %config.mqtt.host,
                "The MQTT password goes to the broker unencrypted: set mqtt.tls.enabled = true."
            );
        }
        self.http.warn_exposure(config);
    }
}

/// The tokens that guard the HTTP API, read as every secret is ([`secret_files`]): by the edge
/// daemon with its other secrets ([`Secrets`]) and by a query node.
struct HttpSecrets {
    api_token: Option<crate::secret::Secret>,
    metrics_token: Option<crate::secret::Secret>,
}

impl HttpSecrets {
    fn load(config: &Config, secret: &SecretFiles) -> Result<HttpSecrets, StartError> {
        Ok(HttpSecrets {
            api_token: secret("http.token_file", &config.http.token_file)?,
            metrics_token: secret("http.metrics_token_file", &config.http.metrics_token_file)?,
        })
    }

    /// Warns about an API open to the network without a token.
    fn warn_exposure(&self, config: &Config) {
        if let Some(warning) =
            crate::http::exposure_warning(config.http.bind, self.api_token.is_some())
        {
            tracing::warn!("{warning}");
        }
    }
}

/// The store's settings from the config.
fn store_settings(config: &Config, path: &std::path::Path) -> StoreSettings {
    StoreSettings {
        path: path.to_path_buf(),
        bucket_width_secs: config.store.bucket_width_secs(),
        durability: config.store.durability,
        quick_repair: config.store.quick_repair,
        cache_bytes: config.store.cache_bytes,
        page_capacity: config.store.page_capacity,
        dedup_window: config.limits.dedup_window,
        outbox_max_entries: config.upstream.as_ref().map_or(0, |u| u.outbox_max_entries),
        journal_bytes: config.store.journal_bytes,
    }
}

/// What the store remembers of earlier runs that ingestion starts from: the messages counted
/// lately (copies and resends are told apart by them), the gateways' applied positions (a
/// central), the series known and when the store was created.
struct Recovered {
    dedup: crate::dedup::Window,
    resends: crate::resend::Resends,
    ledger: Option<Box<dyn crate::admit::DeltaLedger>>,
    series: SeriesSet,
    /// How the store's messages are fingerprinted (its key).
    fingerprinter: crate::dedup::Fingerprinter,
    /// The store's identity (when it was created): the forwarder's origin.
    origin: String,
}

impl Recovered {
    /// Reads it; a table that cannot be read is a corrupt store, named by its path.
    fn from_store(
        config: &Config,
        store: &Store,
        path: &std::path::Path,
    ) -> Result<Self, StartError> {
        let corrupt = |source| StoreOpenError::Corrupt {
            path: path.to_path_buf(),
            source,
        };
        let recent = store.recent_fingerprints().map_err(corrupt)?;
        let dedup =
            crate::dedup::Window::new(config.limits.dedup_window, recent.iter().map(|&(fp, _)| fp));
        let resends =
            crate::resend::Resends::new(config.mqtt.sessions, config.limits.dedup_window, recent);
        let applied = store.applied_positions().map_err(corrupt)?;
        // Keys with `#` hold the databases a gateway used before (`fleet::applied`).
        let gateways = applied.iter().filter(|(key, _)| !key.contains('#')).count();
        #[cfg(feature = "central")]
        let ledger: Option<Box<dyn crate::admit::DeltaLedger>> =
            Some(Box::new(crate::fleet::applied::Applied::new(applied)));
        // Config validation refuses `format = "delta"` in a build without the central.
        #[cfg(not(feature = "central"))]
        let ledger = None;
        let series = SeriesSet::new(
            config.limits.max_series,
            config.limits.max_series_per_sensor,
            store.series_names().cloned(),
        );
        let origin = store.reader().created_at().map_err(corrupt)?;
        info!(
            path = %path.display(),
            series = series.len(),
            recent_messages = dedup.len(),
            gateways,
            "Opened the store."
        );
        Ok(Recovered {
            dedup,
            resends,
            ledger,
            series,
            fingerprinter: store.fingerprinter(),
            origin,
        })
    }
}

/// What the MQTT sessions log in with.
struct MqttLink<'a> {
    password: Option<&'a crate::secret::Secret>,
    tls: Option<&'a crate::mqtt::TlsClientConfig>,
}

/// The ingest task: the MQTT sessions, the admission of messages from what the store
/// remembers, the batcher, and the channels to the writer and from `POST /api/v1/flush`.
fn new_ingest(
    config: &Config,
    link: &MqttLink<'_>,
    recovered: Recovered,
    stats: Arc<Stats>,
    writer: crate::writer::Writer,
    flush_requests: tokio::sync::mpsc::Receiver<crate::http::FlushRequest>,
) -> Ingest {
    let width_secs = config.store.bucket_width_secs();
    let policy = FlushPolicy {
        flush_interval: config.batch.flush_interval,
        max_pending_readings: config.batch.max_pending_readings,
        window: config.mqtt.receive_maximum,
        broker_window: config.mqtt.broker_window,
        sessions: config.mqtt.sessions,
        quick_acks: crate::mqtt::QUICK_ACKS,
    };
    let clients = (0..usize::from(config.mqtt.sessions))
        .map(|i| {
            Mqtt::new(
                &config.mqtt,
                i,
                link.password,
                link.tls,
                &config.subscriptions,
            )
        })
        .collect();
    info!(
        broker = %format!("{}:{}", config.mqtt.host, config.mqtt.port),
        client_id = %config.mqtt.client_id,
        sessions = config.mqtt.sessions,
        protocol = ?config.mqtt.protocol,
        tls = config.mqtt.tls.is_some(),
        window = config.mqtt.receive_maximum,
        "Starting ingestion."
    );
    let core = Core::new(
        Parts {
            admit: Admitter::new(
                config.subscriptions.clone(),
                config.limits.clone(),
                width_secs,
                recovered.series,
                recovered.dedup,
                recovered.resends,
                recovered.ledger,
            )
            .with_gateway_limits(config.gateway_limits, config.store.sketch)
            .with_fingerprinter(recovered.fingerprinter),
            batcher: Batcher::with_sketch(policy, width_secs, config.store.sketch),
            stats: stats.clone(),
            sessions: config.mqtt.sessions,
            backoff: Backoff::new(
                config.mqtt.reconnect_delay_min,
                config.mqtt.reconnect_delay_max,
            ),
            subscriptions: config.subscriptions.len(),
            window: config.mqtt.receive_maximum,
        },
        std::time::Instant::now(),
    );
    Ingest {
        core,
        clients,
        stats,
        writer,
        flush_requests,
    }
}

/// Reads the secret in the file a config key names (`None` when it names none), relative
/// names in `credentials` (systemd's `$CREDENTIALS_DIRECTORY`).
fn secret_files(credentials: Option<PathBuf>) -> Box<SecretFiles> {
    Box::new(move |key, file| {
        file.as_deref()
            .map(|f| crate::secret::read(key, f, credentials.as_deref()))
            .transpose()
            .map_err(StartError::Config)
    })
}

/// Reads the secret file a key names ([`secret_files`]).
type SecretFiles =
    dyn Fn(&str, &Option<PathBuf>) -> Result<Option<crate::secret::Secret>, StartError>;

/// What the HTTP layer serves: what it reads (`source`), the counters it shows, the tokens that
/// guard it and where flush requests go (`None` on a query node).
struct ApiParts {
    source: crate::source::Source,
    stats: Arc<Stats>,
    metrics: Arc<Metrics>,
    tokens: HttpSecrets,
    flush: Option<tokio::sync::mpsc::Sender<crate::http::FlushRequest>>,
}

/// The HTTP layer's state: `parts`, with `[http]`'s bounds.
fn api_state(config: &Config, parts: ApiParts) -> crate::http::ApiState {
    let ApiParts {
        source,
        stats,
        metrics,
        tokens,
        flush,
    } = parts;
    crate::http::ApiState {
        source,
        stats,
        metrics,
        flush,
        flush_slots: Arc::new(tokio::sync::Semaphore::new(FLUSH_REQUESTS_MAX)),
        bucket_width_secs: config.store.bucket_width_secs(),
        max_buckets_per_query: config.http.max_buckets_per_query,
        max_points_per_query: config.http.max_points_per_query,
        max_raw_readings: config.http.max_raw_readings,
        api_token: tokens.api_token.map(Arc::new),
        metrics_token: tokens.metrics_token.map(Arc::new),
        query_slots: Arc::new(tokio::sync::Semaphore::new(
            config.http.max_concurrent_queries,
        )),
        request_timeout: config.http.request_timeout,
        lookback: config.http.lookback,
        allowed_hosts: config.http.allowed_hosts.clone().into(),
    }
}

/// `[http]`'s connection bounds.
fn connection_limits(config: &Config) -> crate::http::ConnectionLimits {
    crate::http::ConnectionLimits {
        max_connections: config.http.max_connections,
        max_connections_per_address: config.http.max_connections_per_address,
        header_read_timeout: config.http.header_read_timeout,
        write_stall_max: config.http.request_timeout,
    }
}

/// The HTTP server, started alike by `bucketd run` and `bucketd query-node`: bound first, so
/// that an address in use fails the start before anything else runs, then serving.
struct HttpServer {
    listener: tokio::net::TcpListener,
    addr: std::net::SocketAddr,
}

impl HttpServer {
    /// Binds `http.bind`.
    fn bind(config: &Config) -> Result<HttpServer, StartError> {
        let listener = std::net::TcpListener::bind(config.http.bind)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(tokio::net::TcpListener::from_std)
            .map_err(|source| StartError::Http {
                addr: config.http.bind,
                source,
            })?;
        let addr = listener
            .local_addr()
            .expect("a listener bound without error has an address");
        Ok(HttpServer { listener, addr })
    }

    /// Serves `api` until `cancel` (the requests in progress finish first), with the metrics'
    /// upkeep among `tasks`.
    fn serve(
        self,
        config: &Config,
        api: ApiParts,
        tasks: &TaskTracker,
        cancel: &CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        tasks.spawn(upkeep(api.metrics.clone(), cancel.clone()));
        let stats = api.stats.clone();
        tokio::spawn(crate::http::serve(
            self.listener,
            crate::http::router(api_state(config, api)),
            connection_limits(config),
            stats,
            cancel.clone(),
        ))
    }
}

/// `bucketd query-node`: the query API, the Prometheus API and the chart page served from the
/// fleet's PostgreSQL (`[query_node]`, `fleet::reader`) until `shutdown`: no broker, no store,
/// nothing of its own to lose. `POST /api/v1/flush` answers that nothing was pending.
#[cfg(feature = "postgres")]
pub async fn run_query_node(
    config: &Config,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let node = start_query_node(config)?;
    shutdown.await;
    info!("Shutdown requested.");
    node.stop().await;
    Ok(())
}

/// A query node serving (`start_query_node`).
#[cfg(feature = "postgres")]
pub struct QueryNode {
    pub http_addr: std::net::SocketAddr,
    cancel: CancellationToken,
    http: tokio::task::JoinHandle<()>,
    /// The metrics' upkeep (`HttpServer::serve`).
    tasks: TaskTracker,
}

#[cfg(feature = "postgres")]
impl QueryNode {
    /// Stops serving: the requests in progress finish first.
    pub async fn stop(self) {
        self.cancel.cancel();
        let _ = self.http.await;
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// Starts a query node (inside a Tokio runtime): the HTTP server bound and serving.
#[cfg(feature = "postgres")]
pub fn start_query_node(config: &Config) -> Result<QueryNode, StartError> {
    let node = &config.query_node;
    if node.conninfo.is_empty() {
        return Err(StartError::Config(
            "query_node.postgres is empty: set it to the fleet's PostgreSQL (a read-only role, \
             deploy/postgres/roles.sql)"
                .into(),
        ));
    }
    let secret = secret_files(crate::secret::credentials_directory());
    let password = secret("query_node.password_file", &node.password_file)?;
    let tokens = HttpSecrets::load(config, &secret)?;
    if let Some(warning) = crate::fleet::postgres::password_exposure(
        "query_node.postgres",
        &node.conninfo,
        password.is_some(),
    ) {
        tracing::warn!("{warning}");
    }
    tokens.warn_exposure(config);
    let reader = crate::fleet::reader::FleetReader::new(crate::fleet::reader::NodeSettings {
        conninfo: node.conninfo.clone(),
        password,
        width_secs: config.store.bucket_width_secs(),
        connections: config.http.max_concurrent_queries,
        series_refresh: node.series_refresh,
        max_series: node.max_series,
        max_rows: node.max_rows_per_query,
        statement_timeout: node.statement_timeout,
    });
    let server = HttpServer::bind(config)?;
    let http_addr = server.addr;
    let api = ApiParts {
        source: Arc::new(reader),
        stats: Arc::new(Stats::new(config.limits.dead_letters)),
        metrics: Arc::new(Metrics::new()),
        tokens,
        flush: None,
    };
    let cancel = CancellationToken::new();
    let tasks = TaskTracker::new();
    info!(addr = %http_addr, "Serving the fleet's PostgreSQL: the query API, /prom and the chart page.");
    let http = server.serve(config, api, &tasks, &cancel);
    Ok(QueryNode {
        http_addr,
        cancel,
        http,
        tasks,
    })
}

/// `POST /api/v1/flush` requests served at once; more get a 429.
const FLUSH_REQUESTS_MAX: usize = 16;
/// How often histogram samples are folded into buckets when nobody scrapes.
const METRICS_UPKEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

async fn upkeep(metrics: Arc<Metrics>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(METRICS_UPKEEP_INTERVAL);
    loop {
        tokio::select! {
            _ = tick.tick() => metrics.run_upkeep(),
            () = cancel.cancelled() => return,
        }
    }
}

/// The shutdown order: ingestion commits and acknowledges what is pending and disconnects;
/// the HTTP server stops; the background tasks stop (they hold store readers); the writer
/// thread ends and the store, dropped last, closes the file.
async fn run_ingest(
    ingest: Ingest,
    cancel: CancellationToken,
    writer_thread: std::thread::JoinHandle<Store>,
    http: tokio::task::JoinHandle<()>,
    tasks: TaskTracker,
) -> anyhow::Result<()> {
    let result = ingest.run(cancel.clone()).await;
    // Ingestion may also end on an error: stop the HTTP server either way.
    cancel.cancel();
    let _ = http.await;
    if tokio::time::timeout(TASKS_STOP_MAX, tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            tasks = tasks.len(),
            "Background tasks did not stop within {TASKS_STOP_MAX:?}; closing the store anyway."
        );
    }
    // Ingest has dropped the batch sender (or a commit failed), so the writer thread ends and
    // hands back the store, which closes the file when dropped.
    let joined = tokio::task::spawn_blocking(move || writer_thread.join()).await;
    match joined {
        Ok(Ok(store)) => drop(store),
        Ok(Err(_)) | Err(_) => anyhow::bail!("the writer thread panicked"),
    }
    // What this run cost the card, its last writes included (the fold at shutdown).
    if let Some(bytes) = crate::metrics::disk_written_bytes() {
        info!(disk_written_bytes = bytes, "The store is closed.");
    }
    result.map_err(anyhow::Error::from)
}

/// Runs until `shutdown` resolves (SIGTERM / Ctrl-C in the binary), then stops cleanly.
pub async fn run(
    config: &Config,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let daemon = start(config)?;
    let cancel = daemon.cancel.clone();
    let mut task = daemon.task;
    tokio::select! {
        result = &mut task => {
            return result.map_err(|e| anyhow::anyhow!("the daemon task panicked: {e}"))?;
        }
        () = shutdown => {
            info!("Shutdown requested.");
            cancel.cancel();
        }
    }
    task.await
        .map_err(|e| anyhow::anyhow!("the daemon task panicked: {e}"))?
}

/// Whether `host` is this machine (a password sent there in clear text stays on it).
fn is_loopback(host: &str) -> bool {
    crate::config::is_loopback_host(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pairs: &[(&str, String)]) -> Config {
        let env = pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone()));
        Config::load(None, env).unwrap()
    }

    #[test]
    fn secrets_load_names_the_key_of_a_file_it_cannot_read_and_reads_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "t0ken\n").unwrap();
        let missing = dir.path().join("missing");
        let ok = config(&[("BUCKETD__HTTP__TOKEN_FILE", token.display().to_string())]);
        let secrets = Secrets::load(&ok).unwrap();
        assert_eq!(secrets.http.api_token.unwrap().expose(), "t0ken");
        assert!(secrets.mqtt_password.is_none() && secrets.http.metrics_token.is_none());
        let bad = config(&[(
            "BUCKETD__HTTP__METRICS_TOKEN_FILE",
            missing.display().to_string(),
        )]);
        let Err(StartError::Config(message)) = Secrets::load(&bad) else {
            panic!("a missing secret file is a config error");
        };
        assert!(message.contains("http.metrics_token_file"), "{message}");
    }

    #[test]
    fn recovered_from_a_store_holds_what_its_commits_left() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.redb");
        let c = config(&[("BUCKETD__STORE__PATH", path.display().to_string())]);
        let mut store = Store::open(&store_settings(&c, &path)).unwrap();
        let fresh = Recovered::from_store(&c, &store, &path).unwrap();
        assert_eq!((fresh.series.len(), fresh.dedup.len()), (0, 0));
        let mut batcher = Batcher::by_hand();
        batcher.push(
            Arc::from("s1/t"),
            crate::reading::Timestamp::from_secs(3600),
            1.5,
            std::time::Instant::now(),
        );
        batcher.push_fingerprint(7, crate::dedup::Tag::default());
        let (batch, _) = batcher.take();
        store.commit(&batch).unwrap();
        let again = Recovered::from_store(&c, &store, &path).unwrap();
        assert_eq!(again.series.len(), 1, "the series committed");
        assert_eq!(again.dedup.len(), 1, "the fingerprint committed");
        assert_eq!(again.origin, fresh.origin, "the store's identity stays");
    }
}
