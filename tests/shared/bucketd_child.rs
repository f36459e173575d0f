//! A `bucketd run` child process, for the benchmarks that measure what the daemon itself writes
//! (`ingest_e2e`, `gateway_load`): started on a rendered config, its log read line by line.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

pub struct BucketdChild {
    pub child: Child,
    /// Its log lines (stderr), from after the start.
    pub lines: Receiver<String>,
    pub metrics_url: String,
}

impl BucketdChild {
    /// Starts `bin` with `run` on `raw` (written as `dir/bucketd.toml`) and waits until
    /// `sessions` sessions have subscribed.
    pub fn start(
        bin: &str,
        raw: &bucketd::config::RawConfig,
        dir: &Path,
        sessions: u16,
    ) -> BucketdChild {
        let config_path = dir.join("bucketd.toml");
        std::fs::File::create(&config_path)
            .unwrap()
            .write_all(bucketd::config::render(raw).as_bytes())
            .unwrap();
        let mut child = Command::new(bin)
            .args(["run", "--config"])
            .arg(&config_path)
            .env("RUST_LOG", "bucketd=info")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut addr = None;
        let mut subscribed = 0;
        while subscribed < sessions {
            let line = lines
                .recv_timeout(Duration::from_mins(1))
                .expect("bucketd logs its start");
            if let Some(a) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("addr="))
            {
                addr = Some(a.to_owned());
            }
            subscribed += u16::from(line.contains("Subscribed to every"));
        }
        let metrics_url = format!("http://{}/metrics", addr.expect("the HTTP address"));
        BucketdChild {
            child,
            lines,
            metrics_url,
        }
    }

    /// Stops it (SIGTERM), waits for a clean exit, and returns the bytes it had written to
    /// storage when its store closed (its log's `disk_written_bytes`): its shutdown's fold of
    /// what the journal held included. Blocks.
    pub fn stop(mut self) -> u64 {
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        assert_eq!(
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) },
            0
        );
        let closed = self
            .lines
            .iter()
            .find_map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("disk_written_bytes="))
                    .map(|b| b.parse::<u64>().unwrap())
            })
            .expect("bucketd logs its bytes written when the store is closed");
        assert!(
            self.child.wait().unwrap().success(),
            "bucketd exits cleanly"
        );
        closed
    }
}
