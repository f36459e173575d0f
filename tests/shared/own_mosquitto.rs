//! A Mosquitto of the caller's own on a free port, with unlimited queues (the broker holds
//! whatever its subscriber does not take yet). Shared by the tests and the benchmarks through
//! `#[path]`. Needs the `mosquitto` binary (`apt-get install mosquitto`; `.ci/run` installs it),
//! or for [`OwnMosquitto::upstream`] the build of `.ci/mosquitto-upstream`.

// Each includer uses a different part.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Where `.ci/mosquitto-upstream` builds upstream Mosquitto (overridden by
/// `BUCKETD_TEST_MOSQUITTO_UPSTREAM=<path to the mosquitto binary>`).
pub const UPSTREAM: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/target/mosquitto-2.0.21/src/mosquitto"
);

pub struct OwnMosquitto {
    /// The broker binary: `mosquitto` on `PATH`, or an upstream build.
    program: PathBuf,
    child: Option<std::process::Child>,
    pub port: u16,
    conf: PathBuf,
    _dir: tempfile::TempDir,
}

impl OwnMosquitto {
    /// Starts it. With `persistence`, it keeps sessions and queued messages across
    /// [`OwnMosquitto::down`] and [`OwnMosquitto::up`]. `extra` is appended to its config.
    pub fn start(persistence: bool, extra: &str) -> OwnMosquitto {
        OwnMosquitto::start_with(persistence, "", extra)
    }

    /// [`OwnMosquitto::start`] with `head` placed before the first listener (for options that
    /// must come first, such as `per_listener_settings true`).
    pub fn start_with(persistence: bool, head: &str, extra: &str) -> OwnMosquitto {
        OwnMosquitto::start_program("mosquitto".into(), persistence, head, extra)
    }

    /// [`OwnMosquitto::start`] with upstream Mosquitto 2.0.21 (`.ci/mosquitto-upstream`), which
    /// enforces `max_inflight_messages` for MQTT 3.1.1 clients; `Err` says why it is missing.
    pub fn upstream(persistence: bool, extra: &str) -> Result<OwnMosquitto, String> {
        let program = std::env::var_os("BUCKETD_TEST_MOSQUITTO_UPSTREAM")
            .map_or_else(|| PathBuf::from(UPSTREAM), PathBuf::from);
        if !program.is_file() {
            return Err(format!(
                "no upstream Mosquitto at {} (.ci/mosquitto-upstream builds it)",
                program.display()
            ));
        }
        Ok(OwnMosquitto::start_program(program, persistence, "", extra))
    }

    fn start_program(program: PathBuf, persistence: bool, head: &str, extra: &str) -> OwnMosquitto {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        // Started as root, Mosquitto drops to the `mosquitto` user: it must be able to write
        // its persistence file here (else it logs an error and saves nothing).
        let mut perms = std::fs::metadata(dir.path()).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o777);
        std::fs::set_permissions(dir.path(), perms).unwrap();
        let conf = dir.path().join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "{head}\nlistener {port} 127.0.0.1\nallow_anonymous true\npersistence {persistence}\n\
                 persistence_location {}/\nmax_queued_messages 0\nlog_dest none\n{extra}",
                dir.path().display()
            ),
        )
        .unwrap();
        let mut broker = OwnMosquitto {
            program,
            child: None,
            port,
            conf,
            _dir: dir,
        };
        broker.up();
        broker
    }

    /// The broker's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the process (again) and waits until it accepts connections.
    pub fn up(&mut self) {
        let child = std::process::Command::new(&self.program)
            .arg("-c")
            .arg(&self.conf)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "starting {} (apt-get install mosquitto): {e}",
                    self.program.display()
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "mosquitto did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM: Mosquitto saves its sessions and queued messages (with persistence) and exits.
    pub fn down(&mut self) {
        let mut child = self.child.take().expect("running");
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        assert_eq!(
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) },
            0
        );
        assert!(child.wait().unwrap().success());
    }
}

impl Drop for OwnMosquitto {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
