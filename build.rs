//! Tells the tests whether `.ci/mosquitto-upstream` has built upstream Mosquitto: where it has
//! not, the strict-window tests against it are compiled as ignored (`cfg(upstream_mosquitto)`
//! unset), so `cargo test` reports them as not run rather than as passed.

use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(upstream_mosquitto)");
    println!("cargo::rerun-if-env-changed=BUCKETD_TEST_MOSQUITTO_UPSTREAM");
    let target =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by Cargo")).join("target");
    // The script rewrites this file on every run. It is watched even before the script has run:
    // a watched path that does not exist would rerun this script, and so rebuild the crate, on
    // every build.
    let status = target.join("mosquitto-upstream.status");
    if !status.exists() {
        // Best effort: a read-only checkout only loses the rerun when the broker is built.
        let _ = std::fs::create_dir_all(&target)
            .and_then(|()| std::fs::write(&status, "not built: run .ci/mosquitto-upstream\n"));
    }
    println!("cargo::rerun-if-changed={}", status.display());
    let broker = std::env::var_os("BUCKETD_TEST_MOSQUITTO_UPSTREAM").map_or_else(
        || target.join("mosquitto-2.0.21/src/mosquitto"),
        PathBuf::from,
    );
    if broker.is_file() {
        println!("cargo::rustc-cfg=upstream_mosquitto");
    }
}
