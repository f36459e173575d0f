#!/usr/bin/env bash
# Reruns the whole comparison of docs/PERFORMANCE.md on this machine: the end-to-end benchmark
# (null subscriber, SQLite per message and per 1,000 messages, bucketd default / most durable /
# without raw readings) on the one-reading-per-message workload, on JSON arrays of 100 readings,
# and with 10,000 series, with the storage engines alone before the first; publish -> commit
# latency at two fixed rates; three runs each (BENCH_RUNS), then the micro-benchmarks.
# Needs `mosquitto` on PATH. About 20 minutes on 2 cores, after the release build.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${BENCH_RUNS:-3}
echo "== one reading per message"
BENCH_RUNS=$runs cargo bench --bench ingest_e2e
echo "== JSON arrays of 100 readings per message"
BENCH_RUNS=$runs BENCH_MESSAGES=20000 BENCH_READINGS_PER_MESSAGE=100 cargo bench --bench ingest_e2e
echo "== 10,000 series"
BENCH_RUNS=$runs BENCH_SERIES=10000 BENCH_ONLY=null,bucketd cargo bench --bench ingest_e2e
echo "== latency at a fixed rate: 1,000 and 20,000 messages/s"
BENCH_RUNS=$runs BENCH_RATE=1000 BENCH_MESSAGES=20000 BENCH_ONLY=null,bucketd,bucketd-durable cargo bench --bench ingest_e2e
BENCH_RUNS=$runs BENCH_RATE=20000 BENCH_MESSAGES=200000 BENCH_ONLY=null,bucketd,bucketd-durable cargo bench --bench ingest_e2e
echo "== micro-benchmarks"
cargo bench --bench micro -- --warm-up-time 1 --measurement-time 2
