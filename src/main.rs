//! The `bucketd` command: parses the command line, loads the config, sets up logging, runs the
//! requested command and maps its outcome to an exit code (78 = `EX_CONFIG` for configuration
//! errors of `run`, so systemd does not restart-loop on them; 1 for everything else).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use bucketd::config::{self, Config, LogFormat, RawConfig};
use bucketd::daemon::{self, StartError};
use bucketd::export::{self, ExportFormat};
use bucketd::query::QueryFormat;
use bucketd::reading::Timestamp;
use bucketd::store::StoreReader;
use clap::{Parser, Subcommand};

/// `EX_CONFIG` from sysexits.h: a configuration error; restarting will not help.
const EXIT_CONFIG: u8 = 78;

#[derive(Parser)]
#[command(
    name = "bucketd",
    version,
    about = "MQTT time-series ingestion into hourly buckets, for edge gateways",
    long_about = "bucketd subscribes to an MQTT broker, folds sensor readings into hourly buckets \
(count, sum, min, max, first, last, mean, variance) and keeps them in a redb file. Each QoS 1 \
message is acknowledged only after its readings are on disk.\n\nWith no command, `bucketd` runs \
the daemon (`bucketd run`).",
    after_help = "Configuration layers: built-in defaults (config/default.toml), then --config FILE, \
then BUCKETD__SECTION__KEY environment variables."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Configuration file (TOML), when no command is given (`bucketd run`).
    #[arg(long, short, value_name = "FILE")]
    config: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon until SIGTERM or Ctrl-C (the default command). Exits 78 on a
    /// configuration error.
    Run {
        /// Configuration file (TOML).
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Serve the query API, the Prometheus API and the chart page from the fleet's PostgreSQL
    /// (`[query_node]`) until SIGTERM or Ctrl-C: every gateway's series, and fleet-wide ones
    /// (`*:sensor/metric`) merged across gateways. No broker, no database file.
    #[cfg(feature = "postgres")]
    QueryNode {
        /// Configuration file (TOML).
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Validate the configuration and print the effective config; exit 1 on an error.
    CheckConfig {
        /// Configuration file (TOML).
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Print the buckets of a database file, one per line, while the daemon is stopped.
    Export {
        /// The redb database file.
        #[arg(long, value_name = "FILE")]
        db: PathBuf,
        /// Only this series (`sensor/metric`).
        #[arg(long, value_name = "NAME")]
        series: Option<String>,
        /// Buckets starting at or after this time (RFC 3339 or epoch seconds).
        #[arg(long, value_name = "T", value_parser = parse_time)]
        from: Option<Timestamp>,
        /// Buckets starting before this time (RFC 3339 or epoch seconds).
        #[arg(long, value_name = "T", value_parser = parse_time)]
        to: Option<Timestamp>,
        /// Output format.
        #[arg(long, value_enum, default_value = "ndjson")]
        format: ExportFormat,
        /// Print raw readings (series, ts, value) in timestamp order instead of buckets.
        #[arg(long)]
        raw: bool,
    },
    /// Give a database file's free space back to the filesystem (daemon stopped).
    Compact {
        /// The redb database file.
        #[arg(long, value_name = "FILE")]
        db: PathBuf,
    },
    /// Ask a running daemon through its HTTP API.
    Query {
        /// The daemon's HTTP address (its http.bind).
        #[arg(
            long,
            env = "BUCKETD_URL",
            default_value = "http://127.0.0.1:9470",
            global = true
        )]
        url: String,
        /// Output format.
        #[arg(long, value_enum, default_value = "table", global = true)]
        format: QueryFormat,
        /// File holding the bearer token of the daemon's API (its `http.token_file`).
        #[arg(long, env = "BUCKETD_TOKEN_FILE", value_name = "FILE", global = true)]
        token_file: Option<PathBuf>,
        #[command(subcommand)]
        what: QueryCommand,
    },
}

#[derive(Subcommand)]
enum QueryCommand {
    /// List the series.
    Series,
    /// Buckets of one series, optionally rolled up (`--step 1d`).
    Buckets {
        /// The series (`sensor/metric`).
        #[arg(long, value_name = "NAME")]
        series: String,
        /// Buckets starting at or after this time (RFC 3339 or epoch seconds).
        #[arg(long, value_name = "T")]
        from: String,
        /// Buckets starting before this time (RFC 3339 or epoch seconds).
        #[arg(long, value_name = "T")]
        to: String,
        /// Merge buckets into windows of this length, aligned to UTC midnight (1d, 7d, 6h).
        #[arg(long, value_name = "DURATION")]
        step: Option<String>,
    },
    /// Raw readings of one series.
    Raw {
        /// The series (`sensor/metric`).
        #[arg(long, value_name = "NAME")]
        series: String,
        /// Readings at or after this time (RFC 3339 or epoch seconds).
        #[arg(long, value_name = "T")]
        from: String,
        /// Readings before this time (RFC 3339 or epoch seconds).
        #[arg(long, value_name = "T")]
        to: String,
        /// At most this many readings.
        #[arg(long)]
        limit: Option<u64>,
    },
}

fn parse_time(s: &str) -> Result<Timestamp, String> {
    Timestamp::parse(s).ok_or_else(|| {
        format!("`{s}` is not an RFC 3339 time (2026-11-21T10:00:00Z) or epoch seconds")
    })
}

fn main() -> ExitCode {
    bucketd::metrics::tune_allocator();
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Run { config: None }) {
        Command::Run { config } => run(config.or(cli.config).as_deref()),
        #[cfg(feature = "postgres")]
        Command::QueryNode { config } => query_node(config.or(cli.config).as_deref()),
        Command::CheckConfig { config } => check_config(config.or(cli.config).as_deref()),
        Command::Export {
            db,
            series,
            from,
            to,
            format,
            raw,
        } => export(&db, series.as_deref(), from, to, format, raw),
        Command::Query {
            url,
            format,
            token_file,
            what,
        } => query(&url, token_file.as_deref(), format, &what),
        Command::Compact { db } => match bucketd::store::compact(&db) {
            Ok((before, after)) => {
                println!("{}: {before} bytes -> {after} bytes", db.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("bucketd: {e}");
                ExitCode::FAILURE
            }
        },
    }
}

fn query(
    url: &str,
    token_file: Option<&std::path::Path>,
    format: QueryFormat,
    what: &QueryCommand,
) -> ExitCode {
    use bucketd::query::{Client, buckets_table, raw_table, render, series_table};
    let token = match token_file.map(|f| bucketd::secret::read("--token-file", f, None)) {
        None => None,
        Some(Ok(token)) => Some(token),
        Some(Err(e)) => {
            eprintln!("bucketd: {e}");
            return ExitCode::FAILURE;
        }
    };
    let client = Client::new(url, token);
    let (answer, table): (_, fn(&_) -> _) = match &what {
        QueryCommand::Series => (client.get("/api/v1/series", &[]), series_table),
        QueryCommand::Buckets {
            series,
            from,
            to,
            step,
        } => (
            client.get(
                "/api/v1/buckets",
                &[
                    ("series", Some(series)),
                    ("from", Some(from)),
                    ("to", Some(to)),
                    ("step", step.as_deref()),
                ],
            ),
            buckets_table,
        ),
        QueryCommand::Raw {
            series,
            from,
            to,
            limit,
        } => {
            let limit = limit.map(|l| l.to_string());
            (
                client.get(
                    "/api/v1/raw",
                    &[
                        ("series", Some(series)),
                        ("from", Some(from)),
                        ("to", Some(to)),
                        ("limit", limit.as_deref()),
                    ],
                ),
                raw_table,
            )
        }
    };
    match answer {
        Ok(answer) => {
            print!("{}", render(&answer, format, table));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bucketd: {e}");
            ExitCode::FAILURE
        }
    }
}

fn load_config(file: Option<&std::path::Path>) -> Result<(RawConfig, Config), ExitCode> {
    let result = RawConfig::load(file, std::env::vars())
        .and_then(|raw| Ok((raw.clone(), Config::try_from(raw)?)));
    result.map_err(|e| {
        eprintln!("bucketd: configuration error: {e}");
        ExitCode::from(EXIT_CONFIG)
    })
}

/// Prints the effective configuration. Exits 1 on an error, as a validation tool does; only
/// `run` uses 78 (`EX_CONFIG`), for systemd.
fn check_config(file: Option<&std::path::Path>) -> ExitCode {
    match load_config(file) {
        Ok((raw, _)) => {
            print!("{}", config::render(&raw));
            ExitCode::SUCCESS
        }
        Err(_) => ExitCode::FAILURE,
    }
}

/// Logs to stderr (the journal under systemd), filtered by `RUST_LOG` when it parses, else by
/// `log.level`: `level` or `target=level`, comma-separated (a `Targets` filter: no regex engine
/// in the binary, docs/EDGE.md).
fn init_logging(config: &Config) {
    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter: Targets = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| v.parse().ok())
        .or_else(|| config.log.level.parse().ok())
        .unwrap_or_else(|| Targets::new().with_default(tracing::Level::INFO));
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let registry = tracing_subscriber::registry().with(filter);
    match config.log.format {
        LogFormat::Full => registry.with(layer).init(),
        LogFormat::Compact => registry.with(layer.compact()).init(),
    }
}

/// The error and its causes, each cause only once: our messages often already name their
/// source ("cannot open FILE: Permission denied; ..."), and `{:#}` would repeat it.
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&cause);
        }
    }
    text
}

fn run(file: Option<&std::path::Path>) -> ExitCode {
    // One worker: the ingest loop is one task and every store read runs on the blocking pool, so
    // a second worker only moved the MQTT client's task and the HTTP tasks to another core,
    // a thread wake-up per hand-over (docs/PERFORMANCE.md, "One Tokio worker").
    serve(file, 1, |config, shutdown| {
        Box::pin(daemon::run(config, shutdown))
    })
}

#[cfg(feature = "postgres")]
fn query_node(file: Option<&std::path::Path>) -> ExitCode {
    // As before: two workers (one not measured here; its queries wait on PostgreSQL).
    serve(file, 2, |config, shutdown| {
        Box::pin(daemon::run_query_node(config, shutdown))
    })
}

type Served<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + 'a>>;

/// Loads the config, sets up logging and runs `task` on `workers` Tokio workers until it ends or
/// SIGTERM / Ctrl-C.
fn serve(
    file: Option<&std::path::Path>,
    workers: usize,
    task: impl for<'a> FnOnce(
        &'a Config,
        std::pin::Pin<Box<dyn std::future::Future<Output = ()> + 'a>>,
    ) -> Served<'a>,
) -> ExitCode {
    let config = match load_config(file) {
        Ok((_, config)) => config,
        Err(code) => return code,
    };
    init_logging(&config);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        // A query's blocking-pool thread ends a second after its last work (not ten), taking
        // its allocator cache back to the heap before the trim that follows a burst of
        // queries (`metrics::release_free_memory`).
        .thread_keep_alive(bucketd::metrics::BLOCKING_KEEP_ALIVE)
        .enable_all()
        .build()
        .expect("building the Tokio runtime");
    let result = runtime.block_on(async {
        // Before the daemon starts: a SIGTERM that arrives while it opens the store or during
        // its first messages must start a clean shutdown, not kill it (the default action).
        let shutdown = shutdown_signal().expect("installing the SIGTERM and SIGINT handlers");
        task(&config, Box::pin(shutdown)).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if stopped_while_starting(&e) => {
            // SIGTERM during the start's long work (making the journal): a clean stop.
            tracing::info!("{}", error_chain(&e));
            ExitCode::SUCCESS
        }
        Err(e) => {
            // Logging is up: one line on stderr (journald), not two.
            tracing::error!("{}", error_chain(&e));
            match e.downcast_ref::<StartError>() {
                Some(StartError::Config(_)) => ExitCode::from(EXIT_CONFIG),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

/// Whether `e` is the start's long work ended by a signal (`bucketd::stop`).
fn stopped_while_starting(e: &anyhow::Error) -> bool {
    bucketd::stop::requested()
        && e.chain().any(|c| {
            c.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::Interrupted)
        })
}

/// Installs the SIGTERM and SIGINT handlers now, and resolves when either signal arrives. The
/// signal is watched by a task of its own (on a worker thread), which also sets
/// `bucketd::stop`: the start-up runs on the thread that awaits the returned future, and its
/// long work (making the journal) must see the request while it runs.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        bucketd::stop::request();
        let _ = tx.send(());
    });
    Ok(async move {
        // The sender is dropped only with the runtime.
        let _ = rx.await;
    })
}

fn export(
    db: &std::path::Path,
    series: Option<&str>,
    from: Option<Timestamp>,
    to: Option<Timestamp>,
    format: ExportFormat,
    raw: bool,
) -> ExitCode {
    let reader = match StoreReader::open(db) {
        Ok(reader) => reader,
        Err(e) => {
            eprintln!("bucketd: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(name) = series {
        match reader.has_series(name) {
            Ok(true) => {}
            Ok(false) => {
                eprintln!("bucketd: no series `{name}` in {}", db.display());
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("bucketd: reading {}: {e}", db.display());
                return ExitCode::FAILURE;
            }
        }
    }
    if raw {
        let stdout = std::io::stdout();
        let mut out = std::io::BufWriter::new(stdout.lock());
        let from = from.map_or(i64::MIN, Timestamp::as_nanos);
        let to = to.map_or(i64::MAX, Timestamp::as_nanos);
        let mut written = match format {
            ExportFormat::Csv => writeln!(out, "series,ts,value"),
            ExportFormat::Ndjson => Ok(()),
        };
        let read = reader.raw(series, from, to, |name, readings| {
            if written.is_ok() {
                written = export::write_raw(&mut out, name, readings, format);
            }
            written.is_ok()
        });
        return match (read, written) {
            (Err(e), _) => {
                eprintln!("bucketd: reading {}: {e}", db.display());
                ExitCode::FAILURE
            }
            (Ok(()), Err(e)) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                eprintln!("bucketd: writing output: {e}");
                ExitCode::FAILURE
            }
            _ => ExitCode::SUCCESS,
        };
    }
    let (from, to) = export::bucket_range(from, to);
    // All at once; if that fails, series by series: what is readable is written, and each
    // series that is not is named (exit 1).
    let read = reader
        .buckets(series, from, to)
        .map(|docs| (docs, Vec::new()));
    let read = match read {
        Err(e) if series.is_none() => {
            eprintln!(
                "bucketd: reading {}: {e}; reading series by series",
                db.display()
            );
            reader.buckets_each(from, to)
        }
        read => read,
    };
    let (docs, unreadable) = match read {
        Ok(read) => read,
        Err(e) => {
            eprintln!("bucketd: reading {}: {e}", db.display());
            return ExitCode::FAILURE;
        }
    };
    for (name, e) in &unreadable {
        eprintln!("bucketd: series `{name}` is unreadable and left out: {e}");
    }
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    match export::write(&mut out, &docs, format) {
        Ok(()) if unreadable.is_empty() => ExitCode::SUCCESS,
        Ok(()) => ExitCode::FAILURE,
        // A closed pipe (`bucketd export | head`) is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bucketd: writing output: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_chain_names_each_cause_once() {
        let io = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let e = anyhow::Error::from(StartError::Http {
            addr: "127.0.0.1:9470".parse().unwrap(),
            source: io,
        });
        let text = error_chain(&e);
        assert_eq!(text.matches("address in use").count(), 1, "{text}");
        assert!(
            text.starts_with("cannot listen on http.bind 127.0.0.1:9470"),
            "{text}"
        );
        let wrapped = e.context("starting the daemon");
        let text = error_chain(&wrapped);
        assert!(
            text.starts_with("starting the daemon: cannot listen"),
            "{text}"
        );
    }
}
