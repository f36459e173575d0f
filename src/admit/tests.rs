//! Admission without a broker: each decision `Ingest::on_publish` used to make inline.

use std::time::Duration;

use super::*;
use crate::config::GatewayLimits;
use crate::decode::{Template, TimestampUnit};
use crate::delta::DeltaMessage;
use crate::doc::BucketDoc;

const NOW_S: i64 = 1_763_719_200; // 2025-11-21T10:00:00Z
const NOW: Timestamp = Timestamp::from_secs(NOW_S);

fn sub(filter: &str, template: &str, format: Format) -> Subscription {
    Subscription {
        filter: filter.into(),
        qos: 1,
        template: Template::parse(template).unwrap(),
        format,
        timestamp_field: Some("ts".into()),
        timestamp_unit: TimestampUnit::Auto,
        sensor_field: None,
        root: None,
        fields: None,
        rebirth_interval: None,
        store_raw: format == Format::Json,
    }
}

/// The last position per gateway, as a central's ledger keeps it (the fleet tier's is tested
/// in `fleet::applied`).
#[derive(Default)]
struct Ledger(std::collections::HashMap<String, Position>);

impl DeltaLedger for Ledger {
    fn knows(&self, gateway: &str) -> bool {
        self.0.contains_key(gateway)
    }
    fn last(&self, gateway: &str, origin: &str) -> Option<&Position> {
        self.0.get(gateway).filter(|last| last.origin == origin)
    }
    fn insert(&mut self, gateway: &str, at: Position) -> Vec<(String, Position)> {
        self.0.insert(gateway.to_owned(), at.clone());
        vec![(gateway.to_owned(), at)]
    }
}

fn admitter(max_series: usize) -> Admitter {
    admitter_with(max_series, SeriesSet::new(max_series, max_series, []))
}

fn admitter_with(max_series: usize, series: SeriesSet) -> Admitter {
    admitter_of(
        vec![
            sub("sensors/+/+", "sensors/{sensor}/{metric}", Format::Value),
            sub(
                "devices/+/telemetry",
                "devices/{sensor}/telemetry",
                Format::Json,
            ),
            sub(
                "bucketd/+/deltas",
                "bucketd/{gateway}/deltas",
                Format::Delta,
            ),
        ],
        max_series,
        series,
        Some(Box::new(Ledger::default())),
    )
}

/// An admitter of these subscriptions, with room for `max_series` series.
fn admitter_of(
    subscriptions: Vec<Subscription>,
    max_series: usize,
    series: SeriesSet,
    ledger: Option<Box<dyn DeltaLedger>>,
) -> Admitter {
    Admitter::new(
        subscriptions,
        Limits {
            max_series,
            max_series_per_sensor: max_series,
            max_payload_bytes: 65_536,
            max_age: Duration::from_hours(720),
            max_future: Duration::from_mins(5),
            dead_letters: 4,
            dedup_window: 16,
        },
        3600,
        series,
        Window::new(16, []),
        Resends::new(1, 16, []),
        ledger,
    )
}

fn message<'a>(topic: &'a str, payload: &'a [u8]) -> Message<'a> {
    Message {
        topic: topic.as_bytes(),
        payload,
        pkid: 7,
        qos: 1,
        dup: false,
        session: 0,
        received: NOW,
        burst: None,
        arrival: 1,
    }
}

/// (verdict, readings as (series, value), rejected, has a fingerprint).
fn admit(a: &mut Admitter, m: &Message) -> (Verdict, Vec<(String, f64)>, Vec<DecodeError>, bool) {
    let out = a.admit(m);
    let readings = out
        .readings
        .iter()
        .map(|(s, _, v)| (s.to_string(), *v))
        .collect();
    (
        out.verdict,
        readings,
        out.rejected.clone(),
        out.fingerprint.is_some(),
    )
}

#[test]
fn a_device_message_becomes_readings_and_its_copy_is_recognised_by_its_content() {
    let mut a = admitter(100);
    let json = format!(r#"{{"ts": {NOW_S}, "temperature": 21.5, "humidity": 40}}"#);
    let m = message("devices/d1/telemetry", json.as_bytes());
    let (verdict, readings, rejected, fingerprint) = admit(&mut a, &m);
    assert_eq!(verdict, Verdict::New);
    assert_eq!(
        readings,
        [
            ("d1/temperature".into(), 21.5),
            ("d1/humidity".into(), 40.0)
        ]
    );
    assert!(rejected.is_empty() && fingerprint);
    assert!(
        a.admit(&m).store_raw,
        "the json subscription keeps raw readings"
    );
    // Device-timestamped: any copy is the same readings, DUP or not, whatever the packet id.
    let again = Message { pkid: 9, ..m };
    assert_eq!(admit(&mut a, &again).0, Verdict::Copy);
}

#[test]
fn identical_receive_time_messages_are_distinct_unless_the_broker_marks_a_redelivery() {
    let mut a = admitter(100);
    let m = message("sensors/s1/level", b"3.5");
    assert_eq!(admit(&mut a, &m).0, Verdict::New);
    // The same value again is a new reading (a sensor that reads the same twice)...
    assert_eq!(admit(&mut a, &m).0, Verdict::New);
    // ...but a redelivery (DUP) of a packet id already counted is a copy.
    assert_eq!(admit(&mut a, &Message { dup: true, ..m }).0, Verdict::Copy);
    // QoS 0 is never redelivered: no fingerprint is kept.
    let (verdict, _, _, fingerprint) = admit(&mut a, &Message { qos: 0, ..m });
    assert_eq!((verdict, fingerprint), (Verdict::New, false));
}

#[test]
fn a_message_that_cannot_be_decoded_is_rejected_as_a_whole() {
    let mut a = admitter(100);
    let cases: [(&str, &[u8], DecodeError); 4] = [
        ("elsewhere/x", b"1", DecodeError::TopicMismatch),
        ("sensors/s1/level", b"warm", DecodeError::InvalidNumber),
        ("sensors/s1/level", b"", DecodeError::EmptyPayload),
        ("devices/d1/telemetry", b"{", DecodeError::InvalidJson),
    ];
    for (topic, payload, reason) in cases {
        let (verdict, readings, _, fingerprint) = admit(&mut a, &message(topic, payload));
        assert_eq!(verdict, Verdict::Rejected(reason), "{topic} {payload:?}");
        assert!(readings.is_empty() && !fingerprint);
    }
}

#[test]
fn readings_past_the_series_limit_are_rejected_alone_and_leave_no_fingerprint() {
    let mut a = admitter(1);
    let json = format!(r#"{{"ts": {NOW_S}, "temperature": 1, "humidity": 2}}"#);
    let (verdict, readings, rejected, fingerprint) =
        admit(&mut a, &message("devices/d1/telemetry", json.as_bytes()));
    assert_eq!(verdict, Verdict::New);
    assert_eq!(readings, [("d1/temperature".into(), 1.0)]);
    assert_eq!(rejected, [DecodeError::SeriesLimit]);
    assert!(fingerprint);
    // Nothing counted: no fingerprint, so a later copy (after the limit is raised) is not
    // taken for one already counted.
    let other = format!(r#"{{"ts": {NOW_S}, "pressure": 3}}"#);
    let (_, readings, rejected, fingerprint) =
        admit(&mut a, &message("devices/d2/telemetry", other.as_bytes()));
    assert!(readings.is_empty() && !fingerprint);
    assert_eq!(rejected, [DecodeError::SeriesLimit]);
}

fn delta(seq: i64, width_secs: i64, start: i64) -> Vec<u8> {
    delta_for("gw-1", seq, width_secs, start)
}

fn delta_for(gateway: &str, seq: i64, width_secs: i64, start: i64) -> Vec<u8> {
    let summary = crate::summary::Summary::of(start * 1_000_000_000, 2.5);
    bson::serialize_to_vec(&DeltaMessage {
        gateway_id: gateway.into(),
        origin: "2026-11-22T12:00:00.000Z".into(),
        seq,
        part: 0,
        buckets: vec![BucketDoc::new("d0/t", start, width_secs, &summary)],
    })
    .unwrap()
}

#[test]
fn delta_buckets_fold_into_the_store_width_and_a_position_applied_is_a_copy() {
    let mut a = admitter(100);
    let quarter = NOW_S - 2700; // 09:15, a 15-minute bucket of the gateway
    let payload = delta(1, 900, quarter);
    let topic = "bucketd/gw-1/deltas";
    let out = a.admit(&message(topic, &payload));
    assert_eq!(out.verdict, Verdict::New);
    assert_eq!(out.summaries.len(), 1);
    let (series, start, summary) = &out.summaries[0];
    assert_eq!(
        (&**series, *start, summary.count),
        ("gw-1:d0/t", NOW_S - 3600, 1)
    );
    assert_eq!(
        out.applied.as_ref().map(|(g, at)| (g.as_str(), at.seq)),
        Some(("gw-1", 1))
    );
    assert!(
        out.fingerprint.is_none(),
        "told apart by position, not content"
    );
    // Applied: the same position again is a copy.
    assert_eq!(a.admit(&message(topic, &payload)).verdict, Verdict::Copy);
    // A later position is new.
    let next = delta(2, 3600, NOW_S);
    assert_eq!(a.admit(&message(topic, &next)).verdict, Verdict::New);
}

#[test]
fn a_delta_bucket_wider_than_the_store_width_is_rejected_alone() {
    let mut a = admitter(100);
    // A gateway's first position needs a bucket that counted (invented gateway ids must not
    // grow the positions without bound): not recorded, so not a copy later either.
    let unknown = delta_for("gw-9", 1, 7200, NOW_S - 3600);
    let out = a.admit(&message("bucketd/gw-9/deltas", &unknown));
    assert_eq!(out.rejected, [DecodeError::BucketWidthMismatch]);
    assert!(out.applied.is_none());
    let known = delta(0, 3600, NOW_S - 3600);
    assert_eq!(
        a.admit(&message("bucketd/gw-1/deltas", &known)).verdict,
        Verdict::New
    );
    let payload = delta(1, 7200, NOW_S - 3600);
    let out = a.admit(&message("bucketd/gw-1/deltas", &payload));
    assert_eq!(out.verdict, Verdict::New);
    assert!(out.summaries.is_empty());
    assert_eq!(out.rejected, [DecodeError::BucketWidthMismatch]);
    // Nothing applied, but the position is recorded (issue 41): positions step one by one as
    // the gateway numbers its entries, so that a jump can be told from a run of refusals; the
    // same message again is a copy.
    assert!(out.applied.is_some());
    let again = a.admit(&message("bucketd/gw-1/deltas", &payload));
    assert_eq!(again.verdict, Verdict::Copy);
}

/// A delta message from `gateway` with one 1-reading bucket per series, in the hour before NOW.
fn delta_of(gateway: &str, seq: i64, series: &[&str]) -> Vec<u8> {
    let start = NOW_S - 3600;
    let summary = crate::summary::Summary::of(start * 1_000_000_000, 2.5);
    bson::serialize_to_vec(&DeltaMessage {
        gateway_id: gateway.into(),
        origin: "2026-11-22T12:00:00.000Z".into(),
        seq,
        part: 0,
        buckets: series
            .iter()
            .map(|s| BucketDoc::new(s, start, 3600, &summary))
            .collect(),
    })
    .unwrap()
}

fn limited(max_series: usize, per_gateway: usize, per_message: usize) -> Admitter {
    admitter(max_series).with_gateway_limits(
        GatewayLimits {
            max_series: per_gateway,
            max_buckets_per_message: per_message,
            max_position_jump: 100,
        },
        crate::sketch::SketchParams::DEFAULT,
    )
}

/// Issue 20: one gateway could use up `limits.max_series` for all; now each has its share, and
/// what its share refuses is counted, not applied silently.
#[test]
fn a_gateway_cannot_use_up_the_series_of_the_others() {
    let mut a = limited(10, 2, 100);
    let out = a.admit(&message(
        "bucketd/gw-1/deltas",
        &delta_of("gw-1", 1, &["a/t", "b/t", "c/t"]),
    ));
    assert_eq!(out.verdict, Verdict::New);
    assert_eq!(out.summaries.len(), 2);
    assert_eq!(out.rejected, [DecodeError::GatewayLimit]);
    assert_eq!(out.gateway.as_deref(), Some("gw-1"));
    // Its known series still pass; another gateway has its own share.
    let out = a.admit(&message(
        "bucketd/gw-1/deltas",
        &delta_of("gw-1", 2, &["a/t", "d/t"]),
    ));
    assert_eq!(
        (out.summaries.len(), out.rejected.clone()),
        (1, vec![DecodeError::GatewayLimit])
    );
    let out = a.admit(&message(
        "bucketd/gw-2/deltas",
        &delta_of("gw-2", 1, &["a/t", "b/t"]),
    ));
    assert_eq!((out.summaries.len(), out.rejected.len()), (2, 0));
    assert_eq!(a.series_count(), 4);
}

/// Series stored before a restart count against their gateway's share.
#[test]
fn a_gateways_share_counts_the_series_already_stored() {
    let stored = ["gw-1:a/t", "gw-1:b/t", "local/t"].map(Arc::<str>::from);
    let mut a = Admitter::new(
        vec![sub(
            "bucketd/+/deltas",
            "bucketd/{gateway}/deltas",
            Format::Delta,
        )],
        admitter(0).limits.clone(),
        3600,
        SeriesSet::new(100, 100, stored),
        Window::new(16, []),
        Resends::new(1, 16, []),
        None,
    )
    .with_gateway_limits(
        GatewayLimits {
            max_series: 2,
            max_buckets_per_message: 100,
            max_position_jump: 100,
        },
        crate::sketch::SketchParams::DEFAULT,
    );
    let out = a.admit(&message(
        "bucketd/gw-1/deltas",
        &delta_of("gw-1", 1, &["c/t", "a/t"]),
    ));
    assert_eq!(
        (out.summaries.len(), out.rejected.clone()),
        (1, vec![DecodeError::GatewayLimit])
    );
}

#[test]
fn a_delta_message_with_more_buckets_than_the_limit_is_refused_as_a_whole() {
    let mut a = limited(100, 100, 2);
    let payload = delta_of("gw-1", 1, &["a/t", "b/t", "c/t"]);
    let out = a.admit(&message("bucketd/gw-1/deltas", &payload));
    assert_eq!(out.verdict, Verdict::Rejected(DecodeError::GatewayLimit));
    assert_eq!(out.gateway.as_deref(), Some("gw-1"));
    assert!(out.applied.is_none(), "not recorded as applied");
}

/// Issue 20: the topic names the gateway, and a message may only write as that gateway; one that
/// does not is refused before it can move the gateway's position.
#[test]
fn a_publisher_cannot_write_as_or_silence_another_gateway() {
    let mut a = admitter(100);
    let forged = bson::serialize_to_vec(&DeltaMessage {
        gateway_id: "site-2".into(),
        origin: "2026-11-22T12:00:00.000Z".into(),
        seq: i64::MAX,
        part: i32::MAX,
        buckets: Vec::new(),
    })
    .unwrap();
    let topic = "bucketd/site-1/deltas";
    assert_eq!(
        a.admit(&message(topic, &forged)).verdict,
        Verdict::Rejected(DecodeError::GatewayMismatch)
    );
    // Nor with an empty origin on its own topic (it matched every origin).
    let silencer = bson::serialize_to_vec(&DeltaMessage {
        gateway_id: "site-2".into(),
        origin: String::new(),
        seq: i64::MAX,
        part: i32::MAX,
        buckets: Vec::new(),
    })
    .unwrap();
    let topic = "bucketd/site-2/deltas";
    assert_eq!(
        a.admit(&message(topic, &silencer)).verdict,
        Verdict::Rejected(DecodeError::InvalidDelta)
    );
    // Nor with a negative position.
    let negative = bson::serialize_to_vec(&DeltaMessage {
        gateway_id: "site-2".into(),
        origin: "2026-11-22T12:00:00.000Z".into(),
        seq: i64::MIN,
        part: 0,
        buckets: Vec::new(),
    })
    .unwrap();
    assert_eq!(
        a.admit(&message(topic, &negative)).verdict,
        Verdict::Rejected(DecodeError::InvalidDelta)
    );
    // site-2's real messages are still new.
    let real = delta_of("site-2", 1, &["a/t"]);
    assert_eq!(a.admit(&message(topic, &real)).verdict, Verdict::New);
}

/// Issue 20: a delta's sketch is re-binned into this store's settings, so a gateway's settings
/// (or a forged bin bound) do not decide how large a central's bucket documents grow.
#[test]
fn a_delta_sketch_is_rebinned_into_the_central_settings() {
    use crate::sketch::SketchParams;
    let central = SketchParams {
        alpha: 0.02,
        max_bins: 16,
    };
    let mut a = admitter(100).with_gateway_limits(GatewayLimits::default(), central);
    let start = NOW_S - 3600;
    let gateway = SketchParams {
        alpha: 0.01,
        max_bins: 65_536,
    };
    let mut summary = crate::summary::Summary::with_params(start * 1_000_000_000, 1.0, gateway);
    for i in 1..1000 {
        summary.push(
            start * 1_000_000_000 + i,
            f64::from(i32::try_from(i).unwrap()) + 1.0,
        );
    }
    assert!(
        summary.sketch.bins() > 100,
        "more bins than the central keeps"
    );
    let doc = BucketDoc::new("a/t", start, 3600, &summary);
    let payload = bson::serialize_to_vec(&DeltaMessage {
        gateway_id: "gw-1".into(),
        origin: "2026-11-22T12:00:00.000Z".into(),
        seq: 1,
        part: 0,
        buckets: vec![doc],
    })
    .unwrap();
    let out = a.admit(&message("bucketd/gw-1/deltas", &payload));
    let got = &out.summaries[0].2.sketch;
    assert_eq!(got.params(), central);
    assert!(got.bins() <= 16, "{} bins", got.bins());
    assert_eq!(got.count(), 1000);
}

/// Decode -> admit -> batch once warm: admitting allocates nothing at all; a batch only when
/// one of its vectors grows, never once per reading.
#[test]
fn once_warm_a_reading_costs_no_allocation_from_decode_to_batch() {
    use crate::alloc_count::allocations;
    use crate::batcher::{Batcher, FlushPolicy};

    let mut a = admitter(100);
    // Every timestamp in the hour before NOW: one bucket per series.
    let one: Vec<String> = (0..8_000)
        .map(|i| {
            format!(
                r#"{{"ts": {}, "temperature": {i}.5, "rh": 40}}"#,
                NOW_S - 1 - i % 3_000
            )
        })
        .collect();
    let hundred: Vec<String> = (0..400)
        .map(|i| {
            let items: Vec<String> = (0..100)
                .map(|j| {
                    format!(
                        r#"{{"ts": {}, "temperature": {i}.{j}}}"#,
                        NOW_S - 1 - (i * 100 + j) % 3_000
                    )
                })
                .collect();
            format!("[{}]", items.join(","))
        })
        .collect();
    let topic = "devices/d1/telemetry";
    let now = std::time::Instant::now();
    // (allocations, readings) of admitting `payloads`, and of batching them into a new batch.
    let mut run = |payloads: &[String], batch: bool| {
        let mut b = Batcher::new(
            FlushPolicy {
                flush_interval: Duration::from_secs(1),
                max_pending_readings: usize::MAX,
                window: 100,
                broker_window: None,
                sessions: 1,
                quick_acks: false,
            },
            3600,
        );
        let mut readings = 0;
        let before = allocations();
        for p in payloads {
            let out = a.admit(&message(topic, p.as_bytes()));
            assert_eq!(out.verdict, Verdict::New);
            readings += out.readings.len();
            if batch {
                for (series, ts, value) in out.readings.drain(..) {
                    b.push_reading(series, ts, value, true, now);
                }
                let (fp, tag) = out.fingerprint.expect("device-timestamped");
                b.push_fingerprint(fp, tag);
            }
        }
        let allocated = allocations() - before;
        drop(b);
        (allocated, readings)
    };
    // Warm: the series exist, the dedup window is full, the buffers have grown. Each run
    // below admits messages it has not seen (a copy would be skipped).
    run(&one[7_900..], false);
    run(&hundred[380..], false);

    assert_eq!(run(&one[..2_000], false), (0, 2 * 2_000));
    assert_eq!(run(&hundred[..100], false), (0, 100 * 100));

    // Batches allocate when a vector (raw readings, fingerprints, a sketch's bins) doubles:
    // twice the readings add a handful, not one per reading (that would be thousands).
    let (half, _) = run(&one[2_000..4_000], true);
    let (full, readings) = run(&one[4_000..], true);
    assert_eq!(readings, 8_000);
    assert!(
        (full - half) * 100 < 4_000,
        "{half} then {full} allocations"
    );
    let (half, _) = run(&hundred[100..200], true);
    let (full, readings) = run(&hundred[200..], true);
    assert_eq!(readings, 20_000);
    assert!(
        (full - half) * 100 < 10_000,
        "{half} then {full} allocations"
    );
}

/// Issue 41: one device's message of thousands of fields used up `limits.max_series` for
/// every device. Its series stop at its sensor's share (counted as `sensor_limit`, the
/// message's other readings kept), and another device still gets new series.
#[test]
fn one_device_meets_its_own_series_share_and_leaves_room_for_others() {
    let mut a = admitter_with(1000, SeriesSet::new(1000, 10, []));
    let fields: Vec<String> = (0..4000).map(|i| format!(r#""m{i}": {i}"#)).collect();
    let json = format!(r#"{{"ts": {NOW_S}, {}}}"#, fields.join(", "));
    let m = message("devices/greedy/telemetry", json.as_bytes());
    let (verdict, readings, rejected, _) = admit(&mut a, &m);
    assert_eq!(verdict, Verdict::New);
    assert_eq!(readings.len(), 10);
    assert_eq!(rejected.len(), 3990);
    assert!(rejected.iter().all(|e| *e == DecodeError::SensorLimit));
    let json = format!(r#"{{"ts": {NOW_S}, "temperature": 21.5}}"#);
    let (_, readings, rejected, _) = admit(
        &mut a,
        &message("devices/modest/telemetry", json.as_bytes()),
    );
    assert_eq!(readings, [("modest/temperature".to_owned(), 21.5)]);
    assert!(rejected.is_empty());
}

fn delta_from(origin: &str, seq: i64) -> Vec<u8> {
    let summary = crate::summary::Summary::of((NOW_S - 60) * 1_000_000_000, 2.5);
    bson::serialize_to_vec(&DeltaMessage {
        gateway_id: "gw-1".into(),
        origin: origin.into(),
        seq,
        part: 0,
        buckets: vec![BucketDoc::new("d0/t", NOW_S - 3600, 3600, &summary)],
    })
    .unwrap()
}

/// Issue 41: a central accepted any position. One message with a gateway's real origin and
/// `seq = i64::MAX` made every later real message of that gateway a copy, for good. A position
/// further on than `central.max_position_jump` (100 here) is refused as a whole
/// (`position_jump`) and is not recorded: the real stream goes on. (Older
/// databases' streams: `fleet::applied`.)
#[test]
fn a_position_no_outbox_could_have_sent_is_refused_and_changes_nothing() {
    let mut a = limited(100, 100, 100);
    let topic = "bucketd/gw-1/deltas";
    let origin = "2026-11-22T12:00:00.000Z";
    let admit_at = |a: &mut Admitter, origin: &str, seq: i64| {
        let payload = delta_from(origin, seq);
        let out = a.admit(&message(topic, &payload));
        (out.verdict, out.applied.is_some())
    };
    assert_eq!(admit_at(&mut a, origin, 5), (Verdict::New, true));
    let refused = (Verdict::Rejected(DecodeError::PositionJump), false);
    // Issue 52: no warning per refused message here (one per message flooded the log); the
    // ingest loop logs refusals at its rate limit.
    let warned = crate::log_count::warnings(|| {
        for seq in [i64::MAX, 106, 1_000_000] {
            assert_eq!(admit_at(&mut a, origin, seq), refused, "seq {seq}");
        }
    });
    assert_eq!(warned, 0);
    // The real stream goes on: the next entry, then a jump within the bound.
    assert_eq!(admit_at(&mut a, origin, 6), (Verdict::New, true));
    assert_eq!(admit_at(&mut a, origin, 106), (Verdict::New, true));
    // Another database (the gateway's card replaced) starts its own stream, anywhere.
    let newer = "2026-11-25T08:00:00.000Z";
    assert_eq!(admit_at(&mut a, newer, 5_000), (Verdict::New, true));
    assert_eq!(admit_at(&mut a, newer, 5_101), refused);
}

/// Issue 41: at a central, a device's sensor named `site-1:x` made the series
/// `site-1:x/temperature`, which reads as gateway site-1's (and counted as none of its share).
/// A central refuses a `:` in a device's sensor; a gateway (no delta subscription) keeps it.
#[test]
fn a_device_sensor_cannot_pass_for_a_gateway_series_at_a_central() {
    let mut central = admitter(100);
    let json = format!(r#"{{"ts": {NOW_S}, "temperature": 21.5}}"#);
    let (verdict, readings, rejected, _) = admit(
        &mut central,
        &message("devices/site-1:x/telemetry", json.as_bytes()),
    );
    assert_eq!(verdict, Verdict::New);
    assert!(readings.is_empty());
    assert_eq!(rejected, [DecodeError::InvalidName]);
    let mut gateway = admitter_of(
        vec![sub(
            "devices/+/telemetry",
            "devices/{sensor}/telemetry",
            Format::Json,
        )],
        100,
        SeriesSet::new(100, 100, []),
        None,
    );
    let (_, readings, _, _) = admit(
        &mut gateway,
        &message("devices/aa:bb:cc/telemetry", json.as_bytes()),
    );
    assert_eq!(readings, [("aa:bb:cc/temperature".to_owned(), 21.5)]);
}
