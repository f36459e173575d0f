//! Daemons under test: configs for a broker and a store, the `bucketd` binary as a child
//! process (`Daemon`, with its log lines), and waiting on an in-process daemon's counters.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

use bucketd::config::{Config, Protocol, RawConfig};
use bucketd::daemon::RunningDaemon;
use bucketd::stats::Stats;

use super::{Broker, Topics, WAIT, eventually};

/// A daemon config for `broker` with the store at `db` and `topics`' subscriptions.
pub fn raw_config(broker: &Broker, protocol: Protocol, db: &Path, topics: &Topics) -> RawConfig {
    let mut raw = RawConfig::load(None, Vec::new()).expect("defaults load");
    raw.mqtt.host = broker.host.clone();
    raw.mqtt.port = broker.port(protocol);
    raw.mqtt.protocol = protocol;
    raw.mqtt.client_id = format!("bucketd-{}", topics.prefix);
    raw.mqtt.reconnect_delay_min = Duration::from_millis(100);
    raw.mqtt.reconnect_delay_max = Duration::from_secs(1);
    raw.store.path = db.to_owned();
    raw.http.bind = "127.0.0.1:0".into();
    raw.store.cache_size = bytesize::ByteSize::mib(4);
    raw.batch.flush_interval = Duration::from_millis(200);
    raw.subscriptions = topics.subscriptions();
    raw
}

pub fn config(raw: &RawConfig) -> Config {
    Config::try_from(raw.clone()).expect("test config is valid")
}

pub const BIN: &str = env!("CARGO_BIN_EXE_bucketd");

pub fn write_config(dir: &Path, raw: &RawConfig) -> std::path::PathBuf {
    let path = dir.join("bucketd.toml");
    std::fs::write(&path, bucketd::config::render(raw)).unwrap();
    path
}

/// The daemon as a child process whose stderr lines arrive on a channel.
pub struct Daemon {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Daemon {
    pub fn start(config: &Path) -> Daemon {
        Daemon::start_with_env(config, &[])
    }

    pub fn start_with_env(config: &Path, env: &[(&str, &std::ffi::OsStr)]) -> Daemon {
        let mut child = Command::new(BIN)
            .args(["run", "--config"])
            .arg(config)
            .env("RUST_LOG", "bucketd=debug")
            .envs(env.iter().copied())
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Daemon { child, lines }
    }

    /// Reads log lines until `f` returns true for one; returns every line read.
    pub fn wait_for_line(&self, what: &str, mut f: impl FnMut(&str) -> bool) -> Vec<String> {
        let mut seen = Vec::new();
        // One deadline for all lines: a chatty log (trace level) must not keep it waiting.
        let deadline = std::time::Instant::now() + Duration::from_mins(1);
        loop {
            let line = self
                .lines
                .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
                .unwrap_or_else(|_| panic!("no log line {what} within 60 s; saw {seen:#?}"));
            let done = f(&line);
            seen.push(line);
            if done {
                return seen;
            }
        }
    }

    /// The log lines that came so far and were not read.
    pub fn lines_so_far(&self) -> Vec<String> {
        self.lines.try_iter().collect()
    }

    pub fn terminate(self) -> (std::process::ExitStatus, Vec<String>) {
        self.signal(libc::SIGTERM)
    }

    /// Waits for the daemon to exit by itself, at most `within`; `None` if it still runs
    /// then (it is killed).
    pub fn exits_within(
        mut self,
        within: Duration,
    ) -> Option<(std::process::ExitStatus, Vec<String>)> {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let rest: Vec<String> = self.lines.iter().collect();
                return Some((status, rest));
            }
            if std::time::Instant::now() >= deadline {
                let _ = self.kill();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `kill -9`: no shutdown, no commit, no acknowledgement; a power cut as far as the
    /// process can tell (the page cache survives, see docs/RELIABILITY.md).
    pub fn kill(self) -> (std::process::ExitStatus, Vec<String>) {
        self.signal(libc::SIGKILL)
    }

    fn signal(mut self, signal: libc::c_int) -> (std::process::ExitStatus, Vec<String>) {
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0);
        let status = self.child.wait().unwrap();
        let rest: Vec<String> = self.lines.iter().collect();
        (status, rest)
    }
}

/// `Serving ... addr=HOST:PORT` from the daemon's log.
pub fn http_addr(lines: &[String]) -> String {
    lines
        .iter()
        .find(|l| l.contains("Serving /metrics"))
        .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("addr=")))
        .expect("the daemon logs its HTTP address")
        .to_owned()
}

/// Waits until `d` has committed `readings` and counted `rejected` rejections.
pub async fn wait_ingested(d: &RunningDaemon, readings: u64, rejected: u64) {
    let stats = d.stats.clone();
    eventually(
        WAIT,
        &format!("{readings} readings and {rejected} rejections"),
        || Stats::get(&stats.readings_ingested) >= readings && stats.rejected_total() >= rejected,
    )
    .await;
    // Nothing more arrives: the counts are exact, not "at least".
    assert_eq!(
        Stats::get(&stats.readings_ingested),
        readings,
        "readings ingested"
    );
    assert_eq!(stats.rejected_total(), rejected, "rejections");
}

pub async fn wait_subscribed(d: &RunningDaemon) {
    let stats = d.stats.clone();
    eventually(WAIT, "the daemon to subscribe", || {
        stats.subscribed.load(Ordering::Relaxed)
    })
    .await;
}
