//! Fuzzing a central's whole admission path with forged and damaged delta messages (issue 20):
//! decode -> admission -> batcher -> commit (a real redb file, its commit log and checkpoints)
//! -> the query rollup and its JSON. Nothing a message carries may panic, and what is stored is
//! exactly what admission let through.
//!
//! `cargo test` runs `CASES_DEFAULT` cases; `BUCKETD_FUZZ_CASES=N` runs more (the longer run
//! in the issue note).

use std::collections::BTreeMap;

use proptest::prelude::*;

use bucketd::admit::{Admitter, Message, Verdict};
use bucketd::batcher::{Batcher, FlushPolicy};
use bucketd::config::{Durability, GatewayLimits, Limits};
use bucketd::decode::{Format, Subscription, Template, TimestampUnit};
use bucketd::delta::shapes::{Nest, with_nested};
use bucketd::delta::{DeltaMessage, Position};
use bucketd::doc::{BucketDoc, PointDoc};
use bucketd::reading::Timestamp;
use bucketd::series::SeriesSet;
use bucketd::sketch::{Sketch, SketchParams};
use bucketd::store::{Store, StoreSettings};
use bucketd::summary::Summary;

const CASES_DEFAULT: u32 = 256;
const NOW_S: i64 = 1_763_719_200; // 2025-11-21T10:00:00Z
const WIDTH: i64 = 3600;
const GATEWAYS: [&str; 3] = ["gw-1", "gw-2", "gw/3"];
const SERIES: [&str; 5] = ["a/t", "b/t", "c/rh", "d/x", "no-slash"];
const ORIGIN: &str = "2026-11-22T12:00:00.000Z";
const CENTRAL: SketchParams = SketchParams {
    alpha: 0.02,
    max_bins: 32,
};

fn cases() -> u32 {
    std::env::var("BUCKETD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES_DEFAULT)
}

/// A float, often one that breaks arithmetic.
fn float() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => -1e3f64..1e3,
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(f64::NEG_INFINITY),
        1 => Just(f64::MAX),
        1 => Just(-f64::MAX),
        1 => Just(-0.0),
        1 => any::<f64>(),
    ]
}

/// An integer, often an extreme one.
fn int() -> impl Strategy<Value = i64> {
    prop_oneof![
        2 => -10i64..10,
        1 => Just(i64::MAX),
        1 => Just(i64::MIN),
        1 => any::<i64>(),
    ]
}

/// One change that makes an honest bucket a forged or damaged one.
#[derive(Debug, Clone)]
enum Forge {
    Count(i64),
    Start(i64),
    End(i64),
    /// Start and end at once.
    Span(i64, i64),
    Sum(f64),
    SumComp(f64),
    Min(f64),
    Max(f64),
    Mean(f64),
    M2(f64),
    First(i64, f64),
    Last(f64),
    SketchBytes(Vec<u8>),
    /// A sketch with these settings and one bin of this count.
    Sketch(f64, u32, u64),
}

fn forge() -> impl Strategy<Value = Forge> {
    // Weighted toward what overflowed or panicked before issue 20: huge counts (merged several
    // times into one bucket), extreme spans, and sketches with huge bins.
    prop_oneof![
        4 => prop_oneof![Just(i64::MAX), Just(i64::MAX / 2 + 1), int()].prop_map(Forge::Count),
        1 => int().prop_map(Forge::Start),
        1 => int().prop_map(Forge::End),
        2 => (int(), int()).prop_map(|(a, b)| Forge::Span(a, b)),
        1 => float().prop_map(Forge::Sum),
        1 => float().prop_map(Forge::SumComp),
        1 => float().prop_map(Forge::Min),
        1 => float().prop_map(Forge::Max),
        1 => float().prop_map(Forge::Mean),
        1 => float().prop_map(Forge::M2),
        1 => (int(), float()).prop_map(|(t, v)| Forge::First(t, v)),
        1 => float().prop_map(Forge::Last),
        1 => prop::collection::vec(any::<u8>(), 0..24).prop_map(Forge::SketchBytes),
        4 => (
            prop_oneof![Just(0.01), Just(1e-4), Just(0.2), 1e-9f64..0.999],
            prop_oneof![Just(16u32), Just(65_536), Just(u32::MAX), any::<u32>()],
            prop_oneof![1u64..10, Just(u64::MAX), Just(u64::MAX / 2 + 1)],
        )
            .prop_map(|(a, b, n)| Forge::Sketch(a, b, n)),
    ]
}

/// An honest bucket (a few readings in one of the last hours, or 15-minute wide) and what to
/// forge in it.
#[derive(Debug, Clone)]
struct BucketSpec {
    series: usize,
    hours_ago: i64,
    quarter: Option<i64>,
    values: Vec<f64>,
    forged: Vec<Forge>,
}

fn bucket() -> impl Strategy<Value = BucketSpec> {
    (
        prop_oneof![4 => 0..2usize, 1 => 0..SERIES.len()],
        // Mostly the last two hours, so that buckets meet; some beyond limits.max_age (30 h).
        prop_oneof![4 => 0i64..2, 1 => 0i64..48],
        prop::option::of(0i64..4),
        prop::collection::vec(-50f64..50.0, 1..6),
        prop_oneof![1 => Just(Vec::new()), 2 => prop::collection::vec(forge(), 1..3)],
    )
        .prop_map(|(series, hours_ago, quarter, values, forged)| BucketSpec {
            series,
            hours_ago,
            quarter,
            values,
            forged,
        })
}

#[derive(Debug, Clone)]
struct MessageSpec {
    topic_gateway: usize,
    gateway: usize,
    origin: &'static str,
    seq: i64,
    part: i32,
    buckets: Vec<BucketSpec>,
    /// Overwrite a byte of the BSON: (position modulo its length, value).
    corrupt: Option<(usize, u8)>,
    /// One more field of any shape (issue 41: deep nesting overflowed the stack).
    shape: Option<Shape>,
}

/// An extra field: its key (unknown, or a real field's name given twice), how each level holds
/// the next, how deep it nests and how wide its innermost level is.
#[derive(Debug, Clone)]
struct Shape {
    key: &'static str,
    kinds: Vec<Nest>,
    levels: usize,
    width: usize,
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        prop_oneof![
            Just("unknown"),
            Just("buckets"),
            Just("origin"),
            Just("seq")
        ],
        prop::collection::vec(
            prop_oneof![
                Just(Nest::Document),
                Just(Nest::Array),
                Just(Nest::CodeWithScope)
            ],
            1..4,
        ),
        // Around the bound mostly; sometimes thousands of levels.
        prop_oneof![
            6 => 1usize..=bucketd::limits::DELTA_DEPTH_MAX + 2,
            1 => 100usize..9_000,
        ],
        prop_oneof![4 => 0usize..4, 1 => 0usize..2_000],
    )
        .prop_map(|(key, kinds, levels, width)| Shape {
            key,
            kinds,
            levels,
            width,
        })
}

fn message() -> impl Strategy<Value = MessageSpec> {
    (
        prop_oneof![4 => Just(0), 1 => 0..GATEWAYS.len()],
        prop_oneof![6 => Just(None), 1 => (0..GATEWAYS.len()).prop_map(Some)],
        prop_oneof![8 => Just(ORIGIN), 1 => Just(""), 1 => Just("yesterday")],
        prop_oneof![8 => 0i64..6, 1 => int()],
        prop_oneof![8 => 0i32..2, 1 => any::<i32>()],
        prop::collection::vec(bucket(), 0..5),
        prop_oneof![6 => Just(None), 1 => any::<(usize, u8)>().prop_map(Some)],
        prop_oneof![4 => Just(None), 1 => shape().prop_map(Some)],
    )
        .prop_map(
            |(topic_gateway, gateway, origin, seq, part, buckets, corrupt, shape)| MessageSpec {
                topic_gateway,
                gateway: gateway.unwrap_or(topic_gateway),
                origin,
                seq,
                part,
                buckets,
                corrupt,
                shape,
            },
        )
}

fn doc_of(spec: &BucketSpec) -> BucketDoc {
    let (start, width) = match spec.quarter {
        Some(q) => (NOW_S - (spec.hours_ago + 1) * WIDTH + q * 900, 900),
        None => (NOW_S - (spec.hours_ago + 1) * WIDTH, WIDTH),
    };
    let ns = start * 1_000_000_000;
    let params = SketchParams {
        alpha: 0.01,
        max_bins: 2048,
    };
    let mut s = Summary::with_params(ns, spec.values[0], params);
    for (i, v) in spec.values.iter().enumerate().skip(1) {
        s.push(ns + i64::try_from(i).unwrap(), *v);
    }
    // A forger writes any name (`BucketDoc::new` takes only well-formed ones).
    let mut doc = BucketDoc {
        series: SERIES[spec.series].into(),
        ..BucketDoc::new("x/y", start, width, &s)
    };
    for f in &spec.forged {
        match f {
            Forge::Count(c) => doc.count = *c,
            Forge::Start(t) => doc.start = *t,
            Forge::End(t) => doc.end = *t,
            Forge::Span(a, b) => (doc.start, doc.end) = (*a, *b),
            Forge::Sum(v) => doc.sum = *v,
            Forge::SumComp(v) => doc.sum_comp = *v,
            Forge::Min(v) => doc.min = *v,
            Forge::Max(v) => doc.max = *v,
            Forge::Mean(v) => doc.mean = *v,
            Forge::M2(v) => doc.m2 = *v,
            Forge::First(t, v) => doc.first = PointDoc { ts: *t, value: *v },
            Forge::Last(v) => doc.last.value = *v,
            Forge::SketchBytes(b) => doc.sketch.clone_from(b),
            Forge::Sketch(alpha, max_bins, n) => {
                doc.sketch = forged_sketch(*alpha, *max_bins, *n);
            }
        }
    }
    doc
}

/// The encoding of a sketch with any settings and one bin of `n` (`Sketch::new` would refuse
/// settings no config allows; a forger writes the bytes).
fn forged_sketch(alpha: f64, max_bins: u32, n: u64) -> Vec<u8> {
    let mut honest = Sketch::new(SketchParams {
        alpha: 0.01,
        max_bins: 16,
    })
    .encode();
    honest[1..9].copy_from_slice(&alpha.to_le_bytes());
    let mut out = honest[..9].to_vec();
    put_varint(&mut out, u64::from(max_bins));
    put_varint(&mut out, 0); // zeros
    put_varint(&mut out, 1); // one positive bin
    put_varint(&mut out, 240); // bin index 120, zigzag-encoded
    put_varint(&mut out, n);
    put_varint(&mut out, 0); // no negative bins
    out
}

/// LEB128, as the sketch encoding writes its counts and indices (a forger's own copy: the
/// format is the contract, docs/STORAGE.md).
fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn payload_of(spec: &MessageSpec) -> Vec<u8> {
    let mut bytes = bson::serialize_to_vec(&DeltaMessage {
        gateway_id: GATEWAYS[spec.gateway].into(),
        origin: spec.origin.into(),
        seq: spec.seq,
        part: spec.part,
        buckets: spec.buckets.iter().map(doc_of).collect(),
    })
    .unwrap();
    if let Some(sh) = &spec.shape {
        bytes = with_nested(&bytes, sh.key, &sh.kinds, sh.levels, sh.width);
    }
    if let Some((at, value)) = spec.corrupt {
        let len = bytes.len();
        bytes[at % len] = value;
    }
    bytes
}

fn admitter() -> Admitter {
    let sub = Subscription {
        filter: "bucketd/+/deltas".into(),
        qos: 1,
        template: Template::parse("bucketd/{gateway}/deltas").unwrap(),
        format: Format::Delta,
        timestamp_field: None,
        timestamp_unit: TimestampUnit::Auto,
        sensor_field: None,
        root: None,
        fields: None,
        rebirth_interval: None,
        store_raw: false,
    };
    let limits = Limits {
        max_series: 12,
        max_series_per_sensor: 12,
        // Large enough for the deepest shapes to reach the parser.
        max_payload_bytes: 1 << 20,
        max_age: std::time::Duration::from_hours(30),
        max_future: std::time::Duration::from_mins(5),
        dead_letters: 0,
        dedup_window: 16,
    };
    Admitter::new(
        vec![sub],
        limits,
        WIDTH,
        SeriesSet::new(12, 12, []),
        bucketd::dedup::Window::new(16, []),
        bucketd::resend::Resends::new(1, 16, []),
        Some(Box::new(bucketd::fleet::applied::Applied::default())),
    )
    .with_gateway_limits(
        GatewayLimits {
            max_series: 5,
            max_buckets_per_message: 4,
            max_position_jump: 1000,
        },
        CENTRAL,
    )
}

fn batcher() -> Batcher {
    Batcher::with_sketch(
        FlushPolicy {
            flush_interval: std::time::Duration::from_secs(1),
            max_pending_readings: usize::MAX,
            window: 100,
            broker_window: None,
            sessions: 1,
            quick_acks: false,
        },
        WIDTH,
        CENTRAL,
    )
}

/// What the store should hold: per (series, start), the batches' summaries merged in commit
/// order (the order the store merges them in, so the comparison is bit for bit).
type Model = BTreeMap<(String, i64), Summary>;

/// Runs `batches` of messages through the whole path into a fresh file; checks every step.
fn run(batches: &[Vec<MessageSpec>], checkpoint_every: usize) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(&StoreSettings {
        path: dir.path().join("central.redb"),
        bucket_width_secs: WIDTH,
        durability: Durability::Immediate,
        quick_repair: false,
        cache_bytes: 1 << 20,
        page_capacity: 1000,
        dedup_window: 16,
        outbox_max_entries: 0,
        journal_bytes: 1 << 20,
    })
    .unwrap();
    let mut admit = admitter();
    let mut model = Model::new();
    let mut applied: BTreeMap<String, Position> = BTreeMap::new();
    let now = std::time::Instant::now();
    for (i, batch) in batches.iter().enumerate() {
        let mut b = batcher();
        for spec in batch {
            let payload = payload_of(spec);
            let topic = format!("bucketd/{}/deltas", GATEWAYS[spec.topic_gateway]);
            let out = admit.admit(&Message {
                topic: topic.as_bytes(),
                payload: &payload,
                pkid: 1,
                qos: 1,
                dup: false,
                session: 0,
                received: Timestamp::from_secs(NOW_S),
                burst: None,
                arrival: 1,
            });
            let counted = !out.summaries.is_empty();
            prop_assert_eq!(out.verdict == Verdict::New || !counted, true);
            // Too deep is refused as a whole, before anything in it is looked at.
            if let Some(sh) = spec.shape.as_ref().filter(|_| spec.corrupt.is_none()) {
                let depth = 1 + sh.levels;
                let want = depth > bucketd::limits::DELTA_DEPTH_MAX;
                // (Or refused earlier: a topic that names no gateway, say.)
                let refused = matches!(out.verdict, Verdict::Rejected(_));
                prop_assert!(!want || refused, "{} levels: {:?}", depth, out.verdict);
            }
            if counted {
                prop_assert_eq!(
                    spec.gateway,
                    spec.topic_gateway,
                    "written as another gateway"
                );
                // A valid position, as decoded: a corrupted byte can make another valid one
                // (seq -1 with its top byte zeroed is a large seq; a digit of the origin
                // another digit), which is then the message's.
                let (_, at) = out.applied.as_ref().expect("counted with its position");
                let origin = Timestamp::parse_rfc3339(&at.origin);
                prop_assert!(origin.is_some() && at.seq >= 0 && at.part >= 0, "{:?}", at);
                if spec.corrupt.is_none() {
                    prop_assert_eq!(
                        (at.origin.as_str(), at.seq, at.part),
                        (spec.origin, spec.seq, spec.part)
                    );
                }
            }
            let prefix = format!("{}:", GATEWAYS[spec.topic_gateway]);
            for (series, start, s) in &out.summaries {
                prop_assert!(series.starts_with(&prefix), "{}", series);
                prop_assert_eq!(start.rem_euclid(WIDTH), 0);
                prop_assert!(s.count > 0 && s.min <= s.max);
                prop_assert!(s.sum.is_finite() && s.mean.is_finite() && s.m2 >= 0.0);
                prop_assert_eq!(s.sketch.params(), CENTRAL);
                prop_assert!(s.sketch.bins() <= CENTRAL.max_bins as usize);
                b.push_summary(series.clone(), *start, s, now);
            }
            if let Some((gateway, at)) = out.applied.take() {
                // Every message that decoded leaves its position, counted or not once its
                // gateway is known (issue 41); one refused as a whole leaves none.
                prop_assert_eq!(out.verdict, Verdict::New, "a position of a refused message");
                prop_assert!(
                    counted || applied.contains_key(&gateway),
                    "a new gateway's position without a bucket that counted"
                );
                b.push_applied(&gateway, at.clone());
                applied.insert(gateway, at);
            }
        }
        let (batch, _) = b.take();
        for ((series, start), s) in &batch.buckets {
            model
                .entry((series.to_string(), *start))
                .and_modify(|m| m.merge(s))
                .or_insert_with(|| s.clone());
        }
        store.commit(&batch).unwrap();
        if (i + 1) % checkpoint_every == 0 {
            store.checkpoint().unwrap();
        }
        check_store(&store, &model)?;
    }
    prop_assert!(admit.series_count() <= 12);
    Ok(())
}

/// The store holds the model, and every query over it answers (hourly and daily rollups, as
/// JSON) with counts that add up.
fn check_store(store: &Store, model: &Model) -> Result<(), TestCaseError> {
    let docs = store.reader().buckets(None, i64::MIN, i64::MAX).unwrap();
    prop_assert_eq!(docs.len(), model.len());
    let mut by_series: BTreeMap<String, Vec<BucketDoc>> = BTreeMap::new();
    for doc in docs {
        let want = &model[&(doc.series.clone(), doc.start)];
        let got = doc.summary();
        if want.count < i64::MAX as u64 {
            // Past i64::MAX a document's count saturates (and the merge weights with it).
            prop_assert_eq!(&got, want);
        } else {
            prop_assert_eq!(doc.count, i64::MAX);
        }
        by_series.entry(doc.series.clone()).or_default().push(doc);
    }
    for docs in by_series.values() {
        let total = docs
            .iter()
            .fold(0u64, |n, d| n.saturating_add(d.summary().count));
        for step in [WIDTH, 86_400] {
            let windows = bucketd::rollup::rollup(docs, step);
            let counted = windows
                .iter()
                .fold(0u64, |n, w| n.saturating_add(w.summary.count));
            prop_assert_eq!(counted, total);
            for w in &windows {
                let json = bucketd::export::summary_json(w.start, w.end, &w.summary);
                prop_assert!(serde_json::to_string(&json).is_ok());
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn forged_delta_messages_never_panic_and_only_what_is_admitted_is_stored(
        batches in prop::collection::vec(prop::collection::vec(message(), 1..8), 1..5),
        checkpoint_every in 1usize..4,
    ) {
        run(&batches, checkpoint_every)?;
    }
}

/// The fuzzer's honest messages are not all refused: with nothing forged, every bucket is
/// stored, so the checks above see real data.
#[test]
fn honest_messages_pass_the_whole_path() {
    let spec = |seq: i64, gateway: usize| MessageSpec {
        topic_gateway: gateway,
        gateway,
        origin: ORIGIN,
        seq,
        part: 0,
        buckets: (0..3)
            .map(|i| BucketSpec {
                series: i,
                hours_ago: i64::try_from(i).unwrap(),
                quarter: (i == 1).then_some(2),
                values: vec![1.0, 2.5, -3.0],
                forged: Vec::new(),
            })
            .collect(),
        corrupt: None,
        shape: None,
    };
    let batches = vec![vec![spec(0, 0), spec(1, 0)], vec![spec(0, 1), spec(2, 0)]];
    run(&batches, 1).unwrap();
    let mut a = admitter();
    let payload = payload_of(&spec(0, 0));
    let out = a.admit(&Message {
        topic: b"bucketd/gw-1/deltas",
        payload: &payload,
        pkid: 1,
        qos: 1,
        dup: false,
        session: 0,
        received: Timestamp::from_secs(NOW_S),
        burst: None,
        arrival: 1,
    });
    assert_eq!(out.verdict, Verdict::New);
    assert_eq!(out.summaries.len(), 3);
    assert!(out.rejected.is_empty(), "{:?}", out.rejected);
}
