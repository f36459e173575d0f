//! Admission without a broker: each decision `Ingest::on_publish` used to make inline.

use std::time::Duration;

use super::*;
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
        store_raw: format == Format::Json,
    }
}

/// The last position per gateway, as a central's ledger keeps it (the fleet tier's is tested
/// in `fleet::applied`).
#[derive(Default)]
struct Ledger(std::collections::HashMap<String, Position>);

impl DeltaLedger for Ledger {
    fn contains(&self, gateway: &str, at: &Position) -> bool {
        self.0.get(gateway).is_some_and(|last| at.not_after(last))
    }
    fn insert(&mut self, gateway: &str, at: Position) {
        self.0.insert(gateway.to_owned(), at);
    }
}

fn admitter(max_series: usize) -> Admitter {
    Admitter::new(
        vec![
            sub("sensors/+/+", "sensors/{sensor}/{metric}", Format::Value),
            sub(
                "devices/+/telemetry",
                "devices/{sensor}/telemetry",
                Format::Json,
            ),
            sub("bucketd/+/deltas", "bucketd/+/deltas", Format::Delta),
        ],
        Limits {
            max_series,
            max_payload_bytes: 65_536,
            max_age: Duration::from_hours(720),
            max_future: Duration::from_mins(5),
            dead_letters: 4,
            dedup_window: 16,
        },
        3600,
        SeriesSet::new(max_series, []),
        Window::new(16, []),
        Some(Box::new(Ledger::default())),
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
        claimed_elsewhere: false,
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
    let summary = crate::summary::Summary::of(start * 1_000_000_000, 2.5);
    bson::serialize_to_vec(&DeltaMessage {
        gateway_id: "gw-1".into(),
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
    let quarter = NOW_S + 900; // 10:15, a 15-minute bucket of the gateway
    let payload = delta(1, 900, quarter);
    let topic = "bucketd/gw-1/deltas";
    assert!(a.claim_needed(topic.as_bytes(), &payload).is_some());
    let out = a.admit(&message(topic, &payload));
    assert_eq!(out.verdict, Verdict::New);
    assert_eq!(out.summaries.len(), 1);
    let (series, start, summary) = &out.summaries[0];
    assert_eq!((&**series, *start, summary.count), ("gw-1:d0/t", NOW_S, 1));
    assert_eq!(
        out.applied.as_ref().map(|(g, at)| (g.as_str(), at.seq)),
        Some(("gw-1", 1))
    );
    assert!(
        out.fingerprint.is_none(),
        "told apart by position, not content"
    );
    // Applied: the same position again is a copy, and needs no claim.
    assert!(a.claim_needed(topic.as_bytes(), &payload).is_none());
    assert_eq!(a.admit(&message(topic, &payload)).verdict, Verdict::Copy);
    // A later position is new; one another central instance claimed is a copy.
    let next = delta(2, 3600, NOW_S);
    let claimed = Message {
        claimed_elsewhere: true,
        ..message(topic, &next)
    };
    assert_eq!(a.admit(&claimed).verdict, Verdict::Copy);
    assert_eq!(a.admit(&message(topic, &next)).verdict, Verdict::New);
}

#[test]
fn a_delta_bucket_wider_than_the_store_width_is_rejected_alone() {
    let mut a = admitter(100);
    let payload = delta(1, 7200, NOW_S - 3600);
    let out = a.admit(&message("bucketd/gw-1/deltas", &payload));
    assert_eq!(out.verdict, Verdict::New);
    assert!(out.summaries.is_empty());
    assert_eq!(out.rejected, [DecodeError::BucketWidthMismatch]);
    // Nothing applied: the position is not recorded, so the message is not a copy later.
    assert!(out.applied.is_none());
    assert!(a.claim_needed(b"bucketd/gw-1/deltas", &payload).is_some());
}

#[test]
fn claims_are_only_for_delta_messages() {
    let a = admitter(100);
    assert!(a.claim_needed(b"sensors/s1/level", b"1").is_none());
    assert!(
        a.claim_needed(b"bucketd/gw-1/deltas", b"not bson")
            .is_none()
    );
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
                b.push_fingerprint(out.fingerprint.expect("device-timestamped"));
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
