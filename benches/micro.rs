//! Micro-benchmarks of the hot paths: decode (value, JSON object, JSON array of 100), summary
//! merge, folding readings into the open batch, one commit of N touched buckets through the
//! journal (the default) and without one at each durability setting, and a range function over
//! a long window at a short step (`promql`), and one series' read with commits waiting to be
//! folded and without (`read`).
//!
//! `cargo bench --bench micro` (criterion; `-- decode` etc. to pick some). `MICRO_CACHE_MIB`
//! sets the stores' redb cache (default 16, as config/default.toml); `MICRO_CHECKPOINT_SERIES` the
//! active series of the checkpoint benchmark (default 10,000).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use bucketd::batcher::{Batch, Batcher};
use bucketd::config::{Config, Durability, Subscription};
use bucketd::decode::{DecodeContext, Decoded, decode};
use bucketd::reading::Timestamp;
use bucketd::store::{Store, StoreSettings};
use bucketd::summary::Summary;
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

const NOW_S: i64 = 1_763_719_200;

fn subscriptions() -> Vec<Subscription> {
    Config::load(None, Vec::new())
        .expect("the defaults load")
        .subscriptions
}

fn ctx() -> DecodeContext {
    let received = Timestamp::from_secs(NOW_S);
    DecodeContext {
        received,
        oldest: Timestamp::from_secs(NOW_S - 30 * 86_400),
        newest: Timestamp::from_secs(NOW_S + 600),
        max_payload_bytes: 1 << 20,
    }
}

fn bench_decode(c: &mut Criterion) {
    let subs = subscriptions();
    let (value, json) = (&subs[0], &subs[1]);
    let mut out = Decoded::default();
    let mut g = c.benchmark_group("decode");
    g.throughput(Throughput::Elements(1));
    g.bench_function("value", |b| {
        b.iter(|| {
            decode(
                value,
                b"sensors/s17/temperature",
                black_box(b"21.5"),
                &ctx(),
                &mut out,
            )
        });
    });
    let object = format!(
        "{{\"ts\": {}, \"temperature\": 21.5, \"humidity\": 40.25, \"status\": \"ok\"}}",
        NOW_S * 1000
    );
    g.throughput(Throughput::Elements(2));
    g.bench_function("json_object_2_readings", |b| {
        b.iter(|| {
            decode(
                json,
                b"devices/s17/telemetry",
                black_box(object.as_bytes()),
                &ctx(),
                &mut out,
            )
        });
    });
    let array = format!(
        "[{}]",
        (0..100)
            .map(|i| format!("{{\"ts\": {}, \"temperature\": 21.{i}}}", NOW_S * 1000 + i))
            .collect::<Vec<_>>()
            .join(",")
    );
    g.throughput(Throughput::Elements(100));
    g.bench_function("json_array_100_readings", |b| {
        b.iter(|| {
            decode(
                json,
                b"devices/s17/telemetry",
                black_box(array.as_bytes()),
                &ctx(),
                &mut out,
            )
        });
    });
    g.finish();
}

fn hour_summary(seed: u64) -> Summary {
    let mut x = seed | 1;
    let mut s = Summary::of(NOW_S * 1_000_000_000, 21.0);
    for i in 1..3600i64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push((NOW_S + i) * 1_000_000_000, 21.0 + (x % 100) as f64 / 100.0);
    }
    s
}

fn bench_merge(c: &mut Criterion) {
    let (a, b) = (hour_summary(1), hour_summary(2));
    let mut g = c.benchmark_group("summary");
    g.throughput(Throughput::Elements(1));
    g.bench_function("merge_two_hours_with_sketches", |bench| {
        bench.iter_batched(
            || a.clone(),
            |mut m| {
                m.merge(black_box(&b));
                m
            },
            BatchSize::SmallInput,
        );
    });
    g.bench_function("push_one_reading", |bench| {
        let mut s = a.clone();
        let mut i = 0i64;
        bench.iter(|| {
            i += 1;
            s.push(i, black_box(21.5));
        });
    });
    g.finish();
}

/// Issue 53: `quantile_over_time(0.99, bucketd_reading{..}[700h])` at `step=1s` over three
/// hours (10,801 points) of hourly buckets with ~100-bin sketches took 35 s a query, merging the
/// window's 700 buckets afresh at each point. `range_700h_step_1s`: the whole query now;
/// `one_700_bucket_window_afresh`: what the old evaluation paid at each of its 10,801 points
/// (the reference, in the same run). The Prometheus API is in the `ui` feature.
#[cfg(feature = "ui")]
fn bench_promql(c: &mut Criterion) {
    use bucketd::doc::BucketDoc;
    use bucketd::promql::{Grid, SeriesLabels, Value, parse};
    let wide_hour = |seed: u64, start: i64| {
        let mut x = seed | 1;
        let mut s = Summary::of(start * 1_000_000_000, 50.0);
        for i in 1..600i64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            s.push(
                (start + i * 6) * 1_000_000_000,
                10.0 + (x % 1000) as f64 / 10.0,
            );
        }
        s
    };
    let hours = 720i64;
    let first = NOW_S - hours * 3600;
    let docs: Vec<BucketDoc> = (0..hours)
        .map(|h| {
            let start = first + h * 3600;
            BucketDoc::new("s/t", start, 3600, &wide_hour(h as u64 + 1, start))
        })
        .collect();
    let names = vec!["s/t".to_owned()];
    let expr = parse("quantile_over_time(0.99, bucketd_reading{sensor=\"s\"}[700h])").unwrap();
    let grid = Grid::range((NOW_S - 3 * 3600) * 1000, NOW_S * 1000, 1000).unwrap();
    let mut g = c.benchmark_group("promql");
    g.sample_size(10);
    g.bench_function("range_700h_step_1s", |b| {
        b.iter(|| {
            let labels = SeriesLabels::all(&names, false);
            let value = in_memory(&expr, &labels, grid, &docs, &[]).unwrap();
            let Value::Vector(series) = value else {
                panic!("a vector")
            };
            assert_eq!(series[0].points.len(), 10_801);
            series
        });
    });
    let summaries: Vec<Summary> = docs.iter().map(BucketDoc::summary).collect();
    g.bench_function("one_700_bucket_window_afresh", |b| {
        b.iter(|| {
            let mut m = summaries[0].clone();
            for s in &summaries[1..=700] {
                m.merge(s);
            }
            black_box(m.quantile(0.99))
        });
    });
    bench_exact_windows(&mut g);
    bench_counters(&mut g);
    g.finish();
}

/// `expr` evaluated at `grid` over one series' buckets `docs` (`docs[0]`'s series) and its raw
/// readings `readings` (ns), at the default budget, as the Prometheus API evaluates it.
#[cfg(feature = "ui")]
fn in_memory(
    expr: &bucketd::promql::Expr,
    labels: &[bucketd::promql::SeriesLabels<'_>],
    grid: bucketd::promql::Grid,
    docs: &[bucketd::doc::BucketDoc],
    readings: &[(i64, f64)],
) -> Result<bucketd::promql::Value, bucketd::promql::EvalError<std::convert::Infallible>> {
    use bucketd::promql::{Budget, Raw, evaluate};
    let name = docs[0].series.clone();
    evaluate(
        expr,
        labels,
        grid,
        3600,
        &Budget {
            max_points: 100_000,
            cancel: None,
            notes: None,
        },
        |_, from, to| {
            let docs = docs.iter().filter(|d| (from..to).contains(&d.start));
            Ok([(name, docs.cloned().collect())].into_iter().collect())
        },
        |_, from, to, _| {
            let r = readings.iter().filter(|r| (from..to).contains(&r.0));
            Ok(Raw::Readings(r.copied().collect()))
        },
    )
}

/// A meter read every `every` seconds for `days` days (reset once a week): its hourly buckets
/// and its raw readings (ns, value).
#[cfg(feature = "ui")]
fn meter(days: i64, every: i64) -> (Vec<bucketd::doc::BucketDoc>, Vec<(i64, f64)>) {
    let first = NOW_S - days * 86_400;
    let readings: Vec<(i64, f64)> = (0..days * 86_400 / every)
        .map(|i| {
            let since_reset = (i * every) % (7 * 86_400);
            let ts = (first + i * every) * 1_000_000_000;
            (
                ts,
                since_reset as f64 * 0.01 + ((i * 7919) % 13) as f64 / 100.0,
            )
        })
        .collect();
    let docs = readings
        .chunks((3600 / every) as usize)
        .map(|hour| {
            let mut s = Summary::of(hour[0].0, hour[0].1);
            for &(ts, v) in &hour[1..] {
                s.push(ts, v);
            }
            bucketd::doc::BucketDoc::new("m/kwh", hour[0].0 / 1_000_000_000, 3600, &s)
        })
        .collect();
    (docs, readings)
}

/// A counter ([`meter`]) as dashboards chart it, `increase` over a month at step 1h and `rate(x[5m])` over a day at step 15s, each
/// against its `*_over_time` equivalent on the same windows and grid in the same run
/// (`max_over_time`, `avg_over_time`): what the counter functions cost over the raw readings.
#[cfg(feature = "ui")]
fn bench_counters(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    use bucketd::promql::{Grid, SeriesLabels, Value, parse};
    let names = vec!["m/kwh".to_owned()];
    let labels = SeriesLabels::all(&names, false);
    let month = meter(31, 60);
    let month_buckets = (month.0.clone(), Vec::new());
    let day = meter(1, 10);
    let cases = [
        (
            "month_increase_1h_step_1h",
            "increase",
            "[1h]",
            30 * 24,
            3_600_000,
            &month,
        ),
        (
            // The same month past store.raw_retention (no raw reading), on the hours: from
            // each bucket's counter increase.
            "month_increase_1h_step_1h_buckets",
            "increase",
            "[1h]",
            30 * 24,
            3_600_000,
            &month_buckets,
        ),
        (
            "month_max_over_time_1h_step_1h",
            "max_over_time",
            "[1h]",
            30 * 24,
            3_600_000,
            &month,
        ),
        (
            "day_rate_5m_step_15s",
            "rate",
            "[5m]",
            23 * 240,
            15_000,
            &day,
        ),
        (
            "day_avg_over_time_5m_step_15s",
            "avg_over_time",
            "[5m]",
            23 * 240,
            15_000,
            &day,
        ),
    ];
    for (id, f, range, steps, step_ms, (docs, readings)) in cases {
        let expr = parse(&format!("{f}(bucketd_reading{{sensor=\"m\"}}{range})")).unwrap();
        // Just before the hour, where the raw readings answer; on it, where only buckets do.
        let end = NOW_S * 1000 - if readings.is_empty() { 0 } else { 1000 };
        let grid = Grid::range(end - steps * step_ms, end, step_ms).unwrap();
        g.bench_function(id, |b| {
            b.iter(|| {
                let value = in_memory(&expr, &labels, grid, docs, readings).unwrap();
                let Value::Vector(series) = value else {
                    panic!("a vector")
                };
                // Every point answered, from the readings.
                assert_eq!(series[0].points.len() as i64, steps + 1, "{id}");
                series
            });
        });
    }
}

/// Issue 55: a day's Grafana panel of `max_over_time(bucketd_reading[1h])` at a one-minute step
/// (1,441 points) over a sensor read every 10 s, answered from its raw readings (each window
/// visited: ~360 readings a point) and, in the same run, from its buckets (raw pages gone): what
/// the exact windows cost against the buckets' sliding merge.
#[cfg(feature = "ui")]
fn bench_exact_windows(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    use bucketd::doc::BucketDoc;
    use bucketd::promql::{Grid, SeriesLabels, parse};
    let first = NOW_S - 25 * 3600;
    let readings: Vec<(i64, f64)> = (0..25 * 360)
        .map(|i| {
            let v = 20.0 + ((i * 7919) % 1000) as f64 / 100.0;
            ((first + i * 10) * 1_000_000_000, v)
        })
        .collect();
    let docs: Vec<BucketDoc> = readings
        .chunks(360)
        .map(|hour| {
            let mut s = Summary::of(hour[0].0, hour[0].1);
            for &(ts, v) in &hour[1..] {
                s.push(ts, v);
            }
            BucketDoc::new("s/t", hour[0].0 / 1_000_000_000, 3600, &s)
        })
        .collect();
    let names = vec!["s/t".to_owned()];
    let labels = SeriesLabels::all(&names, false);
    let expr = parse("max_over_time(bucketd_reading{sensor=\"s\"}[1h])").unwrap();
    let grid = Grid::range((NOW_S - 24 * 3600) * 1000, NOW_S * 1000, 60_000).unwrap();
    for (id, kept) in [
        ("day_1h_windows_step_1m_raw", true),
        ("day_1h_windows_step_1m_buckets", false),
    ] {
        g.bench_function(id, |b| {
            b.iter(|| {
                let readings: &[(i64, f64)] = if kept { &readings } else { &[] };
                in_memory(&expr, &labels, grid, &docs, readings).unwrap()
            });
        });
    }
}

/// Without the `ui` feature there is no Prometheus API to measure.
#[cfg(not(feature = "ui"))]
fn bench_promql(_: &mut Criterion) {}

/// 10,000 readings over 1,000 series in one hour, as one flush would hold them.
fn bench_batcher(c: &mut Criterion) {
    let names: Vec<Arc<str>> = (0..1000).map(|i| Arc::from(format!("s{i}/t"))).collect();
    let mut g = c.benchmark_group("batcher");
    g.throughput(Throughput::Elements(10_000));
    for raw in [false, true] {
        let id = if raw {
            "push_10000_with_raw"
        } else {
            "push_10000"
        };
        g.bench_function(id, |b| {
            b.iter(|| {
                let mut batcher = Batcher::by_hand();
                let now = Instant::now();
                for i in 0..10_000usize {
                    let ts = Timestamp::from_secs(NOW_S + (i / 1000) as i64);
                    batcher.push_reading(names[i % 1000].clone(), ts, 21.5, raw, now);
                }
                batcher.take()
            });
        });
    }
    g.finish();
}

/// The daemon's default `store.journal_size`.
const JOURNAL: u64 = 8 << 20;

/// A store in `dir` with the daemon's defaults, but for durability, quick repair and the
/// journal's size (0: none, every commit a durable redb transaction).
fn open_store(
    dir: &std::path::Path,
    durability: Durability,
    quick_repair: bool,
    journal_bytes: u64,
) -> Store {
    Store::open(&StoreSettings {
        path: dir.join("bench.redb"),
        bucket_width_secs: 3600,
        durability,
        quick_repair,
        // `MICRO_CACHE_MIB` compares redb cache sizes (default 16, as config/default.toml).
        cache_bytes: std::env::var("MICRO_CACHE_MIB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(16)
            << 20,
        page_capacity: 1000,
        dedup_window: 8192,
        outbox_max_entries: 0,
        journal_bytes,
    })
    .unwrap()
}

/// A batch touching `n` buckets (one series each), one reading per bucket.
fn batch_of(n: usize, second: i64) -> Batch {
    let mut b = Batcher::by_hand();
    let now = Instant::now();
    for i in 0..n {
        let ts = Timestamp::from_secs(NOW_S + second);
        b.push_reading(Arc::from(format!("s{i}/t")), ts, 21.5, false, now);
    }
    b.take().0
}

/// One commit of N touched buckets that already exist (the steady state: get, merge, put).
fn bench_commit(c: &mut Criterion) {
    let mut g = c.benchmark_group("commit");
    g.sample_size(20);
    for (name, durability, quick_repair, journal) in [
        ("journal", Durability::Immediate, true, JOURNAL),
        ("immediate+quick_repair", Durability::Immediate, true, 0),
        ("immediate", Durability::Immediate, false, 0),
        ("two_phase", Durability::TwoPhase, false, 0),
    ] {
        for n in [20usize, 100, 1_000, 10_000] {
            let dir = tempfile::tempdir().unwrap();
            let mut store = open_store(dir.path(), durability, quick_repair, journal);
            store.commit(&batch_of(n, 0)).unwrap();
            let mut second = 0;
            g.throughput(Throughput::Elements(n as u64));
            g.bench_function(format!("{name}/{n}_buckets"), |b| {
                b.iter_batched(
                    || {
                        second += 1;
                        batch_of(n, second % 3600)
                    },
                    |batch| store.commit(&batch).unwrap(),
                    BatchSize::PerIteration,
                );
            });
        }
    }
    g.finish();
}

/// The store path alone: 10,000 readings over 1,000 series (one flush at the default
/// `max_pending_readings`) folded into a batch and committed, into buckets that already exist.
fn bench_store_path(c: &mut Criterion) {
    let names: Vec<Arc<str>> = (0..1000).map(|i| Arc::from(format!("s{i}/t"))).collect();
    let mut g = c.benchmark_group("store_path");
    g.sample_size(20);
    g.throughput(Throughput::Elements(10_000));
    for raw in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut store = open_store(dir.path(), Durability::Immediate, true, JOURNAL);
        store.commit(&batch_of(1000, 0)).unwrap();
        let mut round = 0i64;
        let id = if raw {
            "fold_and_commit_10000_with_raw"
        } else {
            "fold_and_commit_10000"
        };
        g.bench_function(id, |b| {
            b.iter(|| {
                round += 1;
                let mut batcher = Batcher::by_hand();
                let now = Instant::now();
                for i in 0..10_000usize {
                    let ts = Timestamp::from_secs(NOW_S + (round * 10 + (i / 1000) as i64) % 3600);
                    batcher.push_reading(names[i % 1000].clone(), ts, 21.5, raw, now);
                }
                store.commit(&batcher.take().0).unwrap();
                // Flat out, the writer checkpoints once the log holds the default
                // `store.checkpoint_bytes`, and makes the file durable once the journal is
                // three quarters full: their share is part of the path.
                if store.log_bytes() >= 4 << 20 {
                    store.checkpoint().unwrap();
                }
                let (used, room) = store.journal_use();
                if used >= room / 4 * 3 {
                    store.sync_file().unwrap();
                }
            });
        });
    }
    g.finish();
}

/// One checkpoint at 10,000 active series (`MICRO_CHECKPOINT_SERIES` to change): a minute at
/// 1,000 messages/s (60,000 readings, six per series, raw kept) in 60 commits, folded into
/// buckets that already exist.
fn bench_checkpoint(c: &mut Criterion) {
    let series: usize = std::env::var("MICRO_CHECKPOINT_SERIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n >= 10)
        .unwrap_or(10_000);
    let per_commit = series / 10;
    let names: Vec<Arc<str>> = (0..series).map(|i| Arc::from(format!("s{i}/t"))).collect();
    let id = format!("fold_{series}_series_{}_readings", per_commit * 60);
    let mut g = c.benchmark_group("checkpoint");
    g.sample_size(10);
    g.throughput(Throughput::Elements(series as u64));
    let dir = tempfile::tempdir().unwrap();
    let mut store = open_store(dir.path(), Durability::Immediate, true, JOURNAL);
    let mut round = 0i64;
    let mut checkpoint_bytes = Vec::new();
    g.bench_function(&id, |b| {
        b.iter_custom(|iters| {
            let mut took = std::time::Duration::ZERO;
            for _ in 0..iters {
                for commit in 0..60 {
                    round += 1;
                    let mut batcher = Batcher::by_hand();
                    let now = Instant::now();
                    for i in 0..per_commit {
                        let series = &names[(commit * per_commit + i) % series];
                        let ts = Timestamp::from_secs(NOW_S + round % 3600);
                        batcher.push_reading(series.clone(), ts, 21.5, true, now);
                    }
                    store.commit(&batcher.take().0).unwrap();
                }
                let written = write_bytes();
                let started = Instant::now();
                store.checkpoint().unwrap();
                took += started.elapsed();
                checkpoint_bytes.push(write_bytes() - written);
            }
            took
        });
    });
    g.finish();
    checkpoint_bytes.sort_unstable();
    if let Some(median) = checkpoint_bytes.get(checkpoint_bytes.len() / 2) {
        println!(
            "checkpoint/{id}: {median} bytes written per checkpoint (median of {}; {:.1} per \
             reading folded)",
            checkpoint_bytes.len(),
            *median as f64 / (per_commit * 60) as f64
        );
    }
}

/// One series' buckets over a day, read while the commits waiting to be folded reach the
/// default `store.checkpoint_bytes` (4 MiB: about 600 commits of one reading for each of 1,000
/// series, raw kept, as after 50 minutes at 200 readings a second), and the same read once a
/// checkpoint folded them: the ratio is what the waiting commits cost a query. Two arrival
/// patterns: readings of the current time (`now`: 5 s of readings a commit, so each series has
/// one or two buckets waiting, their deltas merged as committed), and a backfill whose commits
/// each cover 140 s more of the day (`backfill`: 23 buckets a series, 23,000 in all, past the
/// merged bound of `limits::MERGED_BUCKETS`, so most series are read from the records).
fn bench_read(c: &mut Criterion) {
    let mut g = c.benchmark_group("read");
    g.sample_size(30);
    for (pattern, step_s) in [("now", 5i64), ("backfill", 140)] {
        let dir = tempfile::tempdir().unwrap();
        let mut store = open_store(dir.path(), Durability::Immediate, true, 32 << 20);
        let mut commits = 0i64;
        while store.log_bytes() < 4 << 20 {
            let mut batcher = Batcher::by_hand();
            let now = Instant::now();
            for i in 0..1000i64 {
                let name = Arc::from(format!("s{i}/t"));
                let ts = Timestamp::from_secs(NOW_S + (commits * step_s + i % step_s) % 86_400);
                batcher.push_reading(name, ts, 21.5 + (i % 10) as f64, true, now);
            }
            store.commit(&batcher.take().0).unwrap();
            commits += 1;
        }
        let reader = store.reader();
        let day = (NOW_S, NOW_S + 86_400);
        // A series past the first thousand buckets of the run: read from the records in the
        // backfill.
        let read = || {
            let got = reader.buckets_of(&["s777/t"], day.0, day.1).unwrap();
            assert_eq!(got["s777/t"].iter().map(|d| d.count).sum::<i64>(), commits);
            got
        };
        let buckets = read()["s777/t"].len();
        g.bench_function(format!("one_series_log_full/{pattern}"), |b| {
            b.iter(|| black_box(read()));
        });
        store.checkpoint().unwrap();
        g.bench_function(format!("one_series_folded/{pattern}"), |b| {
            b.iter(|| black_box(read()));
        });
        println!(
            "read/{pattern}: {commits} commits waiting, {} readings, {buckets} buckets read",
            commits * 1000
        );
    }
    g.finish();
}

/// Bytes this process has caused to be written to storage (`/proc/self/io`).
fn write_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("write_bytes:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("write_bytes in /proc/self/io")
}

criterion_group!(
    benches,
    bench_decode,
    bench_merge,
    bench_batcher,
    bench_commit,
    bench_store_path,
    bench_checkpoint,
    bench_read,
    bench_promql
);

criterion_main!(benches);
