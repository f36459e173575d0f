//! A Mosquitto of the caller's own on a free port, with unlimited queues (the broker holds
//! whatever its subscriber does not take yet). Shared by the tests and the benchmarks through
//! `#[path]`. Needs the `mosquitto` binary (`apt-get install mosquitto`; `.ci/run` installs it).

// Each includer uses a different part.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

pub struct OwnMosquitto {
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
            child: None,
            port,
            conf,
            _dir: dir,
        };
        broker.up();
        broker
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the process (again) and waits until it accepts connections.
    pub fn up(&mut self) {
        let child = std::process::Command::new("mosquitto")
            .arg("-c")
            .arg(&self.conf)
            .spawn()
            .expect("starting mosquitto (apt-get install mosquitto)");
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
