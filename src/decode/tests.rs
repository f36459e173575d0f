// Test scenarios read top to bottom; the 100-line limit (clippy.toml) holds the library.
#![allow(clippy::too_many_lines)]
use super::*;
use crate::config::Config;

const NOW_S: i64 = 1_763_719_200; // 2025-11-21T10:00:00Z

fn ctx() -> DecodeContext {
    DecodeContext {
        received: Timestamp::from_secs(NOW_S),
        oldest: Timestamp::from_secs(NOW_S - 30 * 86_400),
        newest: Timestamp::from_secs(NOW_S + 600),
        max_payload_bytes: 1024,
    }
}

/// The two subscriptions of config/default.toml: [0] value, [1] json.
fn subs() -> Vec<Subscription> {
    Config::load(None, Vec::new()).unwrap().subscriptions
}

fn json_sub(f: impl FnOnce(&mut Subscription)) -> Subscription {
    let mut s = subs().remove(1);
    f(&mut s);
    s
}

fn run(sub: &Subscription, topic: &str, payload: &[u8]) -> Result<Decoded, DecodeError> {
    let mut out = Decoded::default();
    decode(sub, topic.as_bytes(), payload, &ctx(), &mut out).map(|()| out)
}

fn readings(sub: &Subscription, topic: &str, payload: &str) -> Vec<(String, i64, f64)> {
    let d = run(sub, topic, payload.as_bytes()).unwrap();
    assert!(d.rejected.is_empty(), "{:?}", d.rejected);
    d.readings()
        .map(|r| (r.series.to_owned(), r.ts.as_nanos(), r.value))
        .collect()
}

/// A timestamp field's value as the streaming decoder would have read it.
fn scalar(v: serde_json::Value) -> Scalar<'static> {
    match v {
        serde_json::Value::Number(n) => Scalar::Num(if let Some(u) = n.as_u64() {
            Num::U(u)
        } else if let Some(i) = n.as_i64() {
            Num::I(i)
        } else {
            Num::F(n.as_f64().unwrap())
        }),
        serde_json::Value::String(s) => Scalar::Str(s.into()),
        _ => Scalar::Other,
    }
}

const NOW_NS: i64 = NOW_S * 1_000_000_000;

#[test]
fn value_payloads_take_names_from_the_topic_and_the_receive_time() {
    let s = &subs()[0];
    assert_eq!(
        readings(s, "sensors/s1/temperature", " 21.5\n"),
        [("s1/temperature".to_owned(), NOW_NS, 21.5)]
    );
    assert_eq!(readings(s, "sensors/s1/t", "-4e-3")[0].2, -0.004);
}

#[test]
fn value_payload_rejections_have_reasons() {
    let s = &subs()[0];
    let cases: [(&str, &[u8], DecodeError); 8] = [
        ("sensors/s1/t", b"", DecodeError::EmptyPayload),
        ("sensors/s1/t", b"  ", DecodeError::EmptyPayload),
        ("sensors/s1/t", b"warm", DecodeError::InvalidNumber),
        ("sensors/s1/t", b"NaN", DecodeError::NonFinite),
        ("sensors/s1/t", b"-inf", DecodeError::NonFinite),
        ("sensors/s1/t", b"1e999", DecodeError::NonFinite),
        ("sensors/s1/t", b"\xff\xfe", DecodeError::InvalidUtf8),
        ("sensors/s1/t/extra", b"1", DecodeError::TopicMismatch),
    ];
    for (topic, payload, want) in cases {
        assert_eq!(run(s, topic, payload).unwrap_err(), want, "{payload:?}");
    }
    assert_eq!(
        run(s, "sensors/s1/t", &[b'1'; 1025]).unwrap_err(),
        DecodeError::PayloadTooLarge
    );
    assert_eq!(
        decode(s, b"sensors/\xff/t", b"1", &ctx(), &mut Decoded::default()).unwrap_err(),
        DecodeError::InvalidUtf8
    );
}

#[test]
fn values_come_back_bit_for_bit() {
    let s = &subs()[0];
    for v in [
        f64::MAX,
        -f64::MAX,
        f64::MIN_POSITIVE,
        5e-324, // smallest subnormal
        0.1,
        1.0 / 3.0,
        -0.0,
        123_456_789.123_456_79,
    ] {
        let text = crate::export::number(v);
        let got = readings(s, "sensors/a/b", &text)[0].2;
        assert_eq!(got.to_bits(), v.to_bits(), "{text}");
        let got = readings(
            &subs()[1],
            "devices/a/telemetry",
            &format!("{{\"x\":{text}}}"),
        )[0]
        .2;
        assert_eq!(got.to_bits(), v.to_bits(), "json {text}");
    }
}

#[test]
fn json_object_fields_are_metrics_with_the_payload_timestamp() {
    let s = &subs()[1];
    let mut got = readings(
        s,
        "devices/d7/telemetry",
        r#"{"ts": 1763719200123, "temperature": 21.5, "humidity": 40, "status": "ok", "on": true, "nested": {"x": 1}}"#,
    );
    got.sort_by(|a, b| a.0.cmp(&b.0));
    let ts = 1_763_719_200_123 * 1_000_000;
    assert_eq!(
        got,
        [
            ("d7/humidity".to_owned(), ts, 40.0),
            ("d7/nested.x".to_owned(), ts, 1.0),
            ("d7/on".to_owned(), ts, 1.0),
            ("d7/temperature".to_owned(), ts, 21.5)
        ]
    );
}

#[test]
fn json_arrays_are_batches_and_each_reading_keeps_its_own_timestamp() {
    let s = &subs()[1];
    let got = readings(
        s,
        "devices/d7/telemetry",
        r#"[{"ts": 1763719100, "t": 1}, {"ts": "2025-11-21T10:00:00.5Z", "t": 2}, {"t": 3}]"#,
    );
    assert_eq!(
        got,
        [
            ("d7/t".to_owned(), 1_763_719_100 * 1_000_000_000, 1.0),
            ("d7/t".to_owned(), NOW_NS + 500_000_000, 2.0),
            ("d7/t".to_owned(), NOW_NS, 3.0),
        ]
    );
}

#[test]
fn timestamp_units_by_magnitude_and_by_config() {
    let auto = TimestampUnit::Auto;
    let n = |v: serde_json::Value, unit| parse_timestamp(&scalar(v), unit).map(Timestamp::as_nanos);
    let want = Some(NOW_NS);
    assert_eq!(n(serde_json::json!(NOW_S), auto), want);
    assert_eq!(n(serde_json::json!(NOW_S * 1000), auto), want);
    assert_eq!(n(serde_json::json!(NOW_S * 1_000_000), auto), want);
    assert_eq!(n(serde_json::json!(NOW_NS), auto), want);
    assert_eq!(
        n(serde_json::json!(1_763_719_200.25), auto),
        Some(NOW_NS + 250_000_000)
    );
    assert_eq!(n(serde_json::json!(NOW_S * 1000), TimestampUnit::Ms), want);
    assert_eq!(
        n(serde_json::json!(NOW_S), TimestampUnit::Ms),
        Some(NOW_NS / 1000)
    );
    assert_eq!(
        n(serde_json::json!("2025-11-21T11:00:00+01:00"), auto),
        want
    );
    assert_eq!(n(serde_json::json!("yesterday"), auto), None);
    assert_eq!(n(serde_json::json!(true), auto), None);
    assert_eq!(
        n(serde_json::json!(i64::MAX), TimestampUnit::S),
        None,
        "overflow"
    );
}

#[test]
fn json_rejections_are_per_message_or_per_reading() {
    let s = &subs()[1];
    let t = "devices/d/telemetry";
    assert_eq!(
        run(s, t, b"{not json").unwrap_err(),
        DecodeError::InvalidJson
    );
    assert_eq!(run(s, t, b"42").unwrap_err(), DecodeError::NotAnObject);
    assert_eq!(run(s, t, b"[1, 2]").unwrap_err(), DecodeError::NotAnObject);
    assert_eq!(
        run(s, t, br#"{"status": "ok"}"#).unwrap_err(),
        DecodeError::NoReadings
    );
    assert_eq!(run(s, t, b"[]").unwrap_err(), DecodeError::NoReadings);
    assert_eq!(
        run(s, t, b"{\"x\": 1e999}").unwrap_err(),
        DecodeError::NonFinite
    );
    assert_eq!(
        run(s, t, b"{\"x\": \"\xff\"}").unwrap_err(),
        DecodeError::InvalidUtf8
    );

    // A bad timestamp rejects that object's readings, never replaced by the receive time.
    let d = run(s, t, br#"[{"ts": "yesterday", "a": 1}, {"a": 2}]"#).unwrap();
    assert_eq!(d.rejected, [DecodeError::InvalidTimestamp]);
    assert_eq!(d.readings().len(), 1);

    let too_old = NOW_S - 31 * 86_400;
    let too_new = NOW_S + 601;
    let payload =
        format!(r#"[{{"ts": {too_old}, "a": 1}}, {{"ts": {too_new}, "a": 1}}, {{"a/b": 1}}]"#);
    let d = run(s, t, payload.as_bytes()).unwrap();
    assert_eq!(
        d.rejected,
        [
            DecodeError::TimestampOutOfRange,
            DecodeError::TimestampOutOfRange,
            DecodeError::InvalidName
        ]
    );
    assert!(d.readings().len() == 0);
}

#[test]
fn deeply_nested_json_is_rejected_not_a_stack_overflow() {
    let s = &subs()[1];
    let mut payload = "[".repeat(100_000);
    payload.push_str(&"]".repeat(100_000));
    let mut out = Decoded::default();
    let mut c = ctx();
    c.max_payload_bytes = 1 << 20;
    let e = decode(s, b"devices/d/telemetry", payload.as_bytes(), &c, &mut out).unwrap_err();
    assert_eq!(e, DecodeError::InvalidJson);
}

#[test]
fn sensor_field_takes_the_sensor_from_the_payload() {
    let mut sub = json_sub(|s| {
        s.template = Template::parse("gw/{_}/bulk").unwrap();
        s.sensor_field = Some("id".into());
    });
    let got = readings(
        &sub,
        "gw/x/bulk",
        r#"[{"id": "a", "v": 1}, {"id": 7, "v": 2}]"#,
    );
    assert_eq!(got[0].0, "a/v");
    assert_eq!(got[1].0, "7/v");
    let d = run(&sub, "gw/x/bulk", br#"[{"v": 1}, {"id": null, "v": 2}]"#).unwrap();
    assert_eq!(
        d.rejected,
        [DecodeError::InvalidName, DecodeError::InvalidName]
    );
    sub.timestamp_field = None;
    let got = readings(&sub, "gw/x/bulk", r#"{"id": "a", "ts": 5}"#);
    assert_eq!(
        got,
        [("a/ts".to_owned(), NOW_NS, 5.0)],
        "without timestamp_field, ts is a metric"
    );
}

#[test]
fn templates_capture_levels_and_check_literals() {
    let t = Template::parse("site/{_}/{sensor}/{metric}").unwrap();
    let got = |sensor, metric| {
        Some(super::Captured {
            sensor,
            metric,
            gateway: None,
        })
    };
    assert_eq!(t.capture("site/x/s1/t"), got(Some("s1"), Some("t")));
    assert_eq!(t.capture("other/x/s1/t"), None);
    assert_eq!(t.capture("site/x/s1"), None);
    assert_eq!(t.capture("site/x/s1/t/u"), None);
    let rest = Template::parse("a/{sensor}/#").unwrap();
    assert_eq!(rest.capture("a/s/b/c"), got(Some("s"), None));
    assert!(rest.fits_filter("a/+/#"));
    assert!(!rest.fits_filter("a/+/+"));
    assert!(Template::parse("a/{sensor}/{sensor}").is_err());
    assert!(Template::parse("a/{nope}").is_err());
    assert!(Template::parse("a/#/b").is_err());
}

#[test]
fn topic_filters_match_like_mqtt() {
    assert!(topic_matches("sensors/+/+", "sensors/a/b"));
    assert!(!topic_matches("sensors/+/+", "sensors/a"));
    assert!(topic_matches("sensors/#", "sensors"));
    assert!(topic_matches("sensors/#", "sensors/a/b/c"));
    assert!(topic_matches("$share/g/sensors/+", "sensors/a"));
    assert!(!topic_matches("+/x", "$SYS/x"));
    assert!(!topic_matches("a/b", "a/c"));
}

#[test]
fn every_reason_is_distinct_and_indexed() {
    for (i, e) in DecodeError::ALL.iter().enumerate() {
        assert_eq!(e.index(), i);
    }
    let mut reasons: Vec<_> = DecodeError::ALL.iter().map(|e| e.reason()).collect();
    reasons.sort_unstable();
    reasons.dedup();
    assert_eq!(reasons.len(), DecodeError::ALL.len());
}

#[test]
fn strings_nulls_and_arrays_are_not_readings() {
    let s = &subs()[1];
    let t = "devices/d/telemetry";
    // A number sent as a string is not a metric: only numbers and booleans are (README).
    for payload in [
        r#"{"temperature": "21.5"}"#,
        r#"{"x": null}"#,
        r#"{"nested": {"state": "ON", "list": [1, 2]}}"#,
        r#"{"list": [1, 2]}"#,
        r#"{"objects": [{"a": 1}]}"#,
    ] {
        assert_eq!(
            run(s, t, payload.as_bytes()).unwrap_err(),
            DecodeError::NoReadings,
            "{payload}"
        );
    }
    let d = run(s, t, br#"{"temperature": "21.5", "humidity": 40}"#).unwrap();
    assert_eq!(d.readings().len(), 1, "the numeric field still counts");
    // Huge but finite numbers are readings, exactly.
    let d = run(
        s,
        t,
        br#"{"a": 1.7976931348623157e308, "b": -18446744073709551616}"#,
    )
    .unwrap();
    assert_eq!(d.readings().next().unwrap().value, f64::MAX);
    assert_eq!(
        d.readings().nth(1).unwrap().value,
        -18_446_744_073_709_551_616.0
    );
}

#[test]
fn absurd_timestamps_are_rejected_with_a_reason() {
    let s = &subs()[1];
    let t = "devices/d/telemetry";
    let cases: [(&str, DecodeError); 8] = [
        (r#"{"ts": -1, "a": 1}"#, DecodeError::TimestampOutOfRange),
        (r#"{"ts": 0, "a": 1}"#, DecodeError::TimestampOutOfRange),
        (r#"{"ts": 1e300, "a": 1}"#, DecodeError::InvalidTimestamp),
        (
            r#"{"ts": 99999999999999999999999, "a": 1}"#,
            DecodeError::InvalidTimestamp,
        ),
        (
            r#"{"ts": "9999-12-31T23:59:59Z", "a": 1}"#,
            DecodeError::InvalidTimestamp,
        ),
        (
            r#"{"ts": "1970-01-01T00:00:00Z", "a": 1}"#,
            DecodeError::TimestampOutOfRange,
        ),
        (r#"{"ts": true, "a": 1}"#, DecodeError::InvalidTimestamp),
        (r#"{"ts": 1.5e9, "a": 1}"#, DecodeError::TimestampOutOfRange),
    ];
    for (payload, want) in cases {
        let d = run(s, t, payload.as_bytes()).unwrap();
        assert_eq!(d.rejected, [want], "{payload}");
        assert!(d.readings().len() == 0, "{payload}");
    }
}

#[test]
fn decoded_says_whether_a_reading_took_the_receive_time() {
    let (value, json) = (&subs()[0], &subs()[1]);
    assert!(run(value, "sensors/s/t", b"1").unwrap().receive_time);
    let t = "devices/d/telemetry";
    let stamped = format!(r#"[{{"ts": {NOW_S}, "a": 1}}, {{"ts": {NOW_S}, "b": 2}}]"#);
    assert!(!run(json, t, stamped.as_bytes()).unwrap().receive_time);
    let mixed = format!(r#"[{{"ts": {NOW_S}, "a": 1}}, {{"b": 2}}]"#);
    assert!(run(json, t, mixed.as_bytes()).unwrap().receive_time);
}

/// Payload fragments the structured fuzzer assembles: valid JSON pieces, broken ones, and
/// edge-case numbers, names and timestamps.
const FRAGMENTS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"ts\"",
    "\"a\"",
    "\"temperature\"",
    "\"sensor\"",
    "\"\"",
    "\"a/b\"",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "0",
    "-0",
    "1e308",
    "1e309",
    "-1e-320",
    "5e-324",
    "NaN",
    "Infinity",
    "null",
    "true",
    "\"2025-11-21T10:00:00Z\"",
    "\"2025-11-21T10:00:00.123+01:00\"",
    "1763719200",
    "1763719200000",
    "1763719200000000",
    "1763719200000000000",
    "9223372036854775807",
    "18446744073709551616",
    "\"yesterday\"",
    " ",
    "\n",
    "\u{feff}",
    "\u{e9}",
    "\\",
    "\"",
];

fn fragments() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop::sample::select(FRAGMENTS), 0..40)
        .prop_map(|parts| parts.concat().into_bytes())
}

fn check_decoded(result: Result<(), DecodeError>, out: &Decoded, c: &DecodeContext) {
    if result.is_ok() {
        assert!(out.readings().len() > 0 || !out.rejected.is_empty() || out.control);
        for r in out.readings() {
            assert!(r.value.is_finite(), "{r:?}");
            assert!(c.oldest <= r.ts && r.ts <= c.newest, "{r:?}");
            let (sensor, metric) = r.series.split_once('/').expect("sensor/metric");
            for name in [sensor, metric] {
                assert!(!name.is_empty() && name.len() <= crate::reading::NAME_BYTES_MAX);
                assert!(!name.contains('/') && !name.chars().any(char::is_control));
            }
        }
    }
}

use proptest::prelude::*;

fn fuzz_cases() -> u32 {
    std::env::var("BUCKETD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

proptest! {
    // The fuzz run in CI is bounded by the case count; `BUCKETD_FUZZ_CASES=1000000` runs longer.
    #![proptest_config(ProptestConfig { cases: fuzz_cases(), ..ProptestConfig::default() })]

    /// Any bytes, on any topic: a reading that is valid, or a rejection with a reason. Never a
    /// panic, a non-finite value, a timestamp out of range or a bad name.
    #[test]
    fn decoding_arbitrary_bytes_never_panics_and_yields_only_valid_readings(
        topic in prop::collection::vec(any::<u8>(), 0..40),
        payload in prop::collection::vec(any::<u8>(), 0..300),
        which in 0usize..2,
    ) {
        let s = &subs()[which];
        let c = ctx();
        let mut out = Decoded::default();
        let result = decode(s, &topic, &payload, &c, &mut out);
        check_decoded(result, &out, &c);
    }

    /// JSON-shaped input near the edges: the same guarantees.
    #[test]
    fn decoding_json_shaped_input_yields_only_valid_readings(
        payload in fragments(),
        sensor_field in any::<bool>(),
        sensor in "[a-z\\x{e9}/\\x00]{0,3}",
    ) {
        let s = json_sub(|s| if sensor_field { s.sensor_field = Some("sensor".into()) });
        let topic = format!("devices/{sensor}/telemetry");
        let c = ctx();
        let mut out = Decoded::default();
        let result = decode(&s, topic.as_bytes(), &payload, &c, &mut out);
        check_decoded(result, &out, &c);
    }
}

fn delta_sub() -> Subscription {
    json_sub(|s| {
        s.filter = "bucketd/+/deltas".into();
        s.template = Template::parse("bucketd/{gateway}/deltas").unwrap();
        s.format = Format::Delta;
        s.sensor_field = None;
    })
}

const ORIGIN: &str = "2026-11-22T12:00:00.000Z";

fn delta_payload(gateway: &str, series: &str, summary: &crate::summary::Summary) -> Vec<u8> {
    bson::serialize_to_vec(&DeltaMessage {
        gateway_id: gateway.into(),
        origin: ORIGIN.into(),
        seq: 7,
        part: 0,
        buckets: vec![crate::doc::BucketDoc::new(series, NOW_S, 3600, summary)],
    })
    .unwrap()
}

#[test]
fn a_delta_message_becomes_bucket_summaries_under_the_gateway_prefix() {
    let mut s = crate::summary::Summary::of(NOW_NS, 1.5);
    s.merge(&crate::summary::Summary::of(NOW_NS + 5, 4.0));
    let d = run(
        &delta_sub(),
        "bucketd/gw-1/deltas",
        &delta_payload("gw-1", "d0/t", &s),
    )
    .unwrap();
    assert!(d.readings().len() == 0);
    assert_eq!(d.deltas.len(), 1);
    assert_eq!(d.deltas[0].series, "gw-1:d0/t");
    assert_eq!((d.deltas[0].start, d.deltas[0].width_secs), (NOW_S, 3600));
    assert_eq!(d.deltas[0].summary.count, 2);
    assert_eq!(d.deltas[0].summary.max, 4.0);
    let position = crate::delta::Position {
        origin: ORIGIN.into(),
        seq: 7,
        part: 0,
    };
    assert_eq!(d.delta_from, Some(("gw-1".into(), position)));
}

#[test]
fn a_bad_delta_message_is_rejected_with_its_reason() {
    let s = crate::summary::Summary::of(NOW_NS, 1.5);
    let sub = delta_sub();
    // Issue 20: `end - start` overflowed for start = i64::MIN, end = i64::MAX.
    let span = |start: i64, end: i64| {
        bson::serialize_to_vec(&DeltaMessage {
            gateway_id: "gw-1".into(),
            origin: ORIGIN.into(),
            seq: 1,
            part: 0,
            buckets: vec![crate::doc::BucketDoc {
                start,
                end,
                ..crate::doc::BucketDoc::new("d0/t", NOW_S, 3600, &s)
            }],
        })
        .unwrap()
    };
    for (start, end) in [(i64::MIN, i64::MAX), (0, 0), (10, 5), (0, 86_401)] {
        assert_eq!(
            run(&sub, "bucketd/gw-1/deltas", &span(start, end)).unwrap_err(),
            DecodeError::InvalidDelta,
            "{start}..{end}"
        );
    }
    let cases: [(&[u8], DecodeError); 4] = [
        (b"{\"not\": \"bson\"}", DecodeError::InvalidDelta),
        (&delta_payload("gw/1", "d0/t", &s), DecodeError::InvalidName),
        (
            &bson::serialize_to_vec(&DeltaMessage {
                gateway_id: "gw-1".into(),
                origin: ORIGIN.into(),
                seq: 1,
                part: 0,
                buckets: vec![crate::doc::BucketDoc {
                    series: "no-slash".into(),
                    ..crate::doc::BucketDoc::new("d0/t", NOW_S, 3600, &s)
                }],
            })
            .unwrap(),
            DecodeError::InvalidDelta,
        ),
        (
            &bson::serialize_to_vec(&DeltaMessage {
                gateway_id: "gw-1".into(),
                origin: ORIGIN.into(),
                seq: 1,
                part: 0,
                buckets: Vec::new(),
            })
            .unwrap(),
            DecodeError::NoReadings,
        ),
    ];
    for (payload, want) in cases {
        assert_eq!(run(&sub, "bucketd/gw-1/deltas", payload).unwrap_err(), want);
    }
}

/// Issue 20: every field of a delta message is checked against what a central does with it.
/// Each case here was accepted before (and some then panicked or poisoned the store).
#[test]
fn a_forged_or_damaged_delta_message_is_refused_with_its_reason() {
    use crate::doc::{BucketDoc, PointDoc};
    use crate::sketch::{Sketch, SketchParams};

    let mut s = crate::summary::Summary::of(NOW_NS, 1.5);
    s.merge(&crate::summary::Summary::of(NOW_NS + 5, 4.0));
    let good = DeltaMessage {
        gateway_id: "gw-1".into(),
        origin: ORIGIN.into(),
        seq: 7,
        part: 0,
        buckets: vec![BucketDoc::new("d0/t", NOW_S, 3600, &s)],
    };
    let sub = delta_sub();
    let topic = "bucketd/gw-1/deltas";
    let bytes = |m: &DeltaMessage| bson::serialize_to_vec(m).unwrap();
    assert!(run(&sub, topic, &bytes(&good)).is_ok());
    let message = |f: &dyn Fn(&mut DeltaMessage)| {
        let mut m = good.clone();
        f(&mut m);
        m
    };
    let bucket = |f: &dyn Fn(&mut BucketDoc)| message(&|m| f(&mut m.buckets[0]));
    // The bucket's own two readings, so that only the settings are wrong.
    let sketch = |alpha: f64, max_bins: u32| {
        let mut k = Sketch::new(SketchParams { alpha, max_bins });
        k.add(1.5);
        k.add(4.0);
        k.encode()
    };
    // 40 readings: a sketch of 40 bins under the default settings (2,048 bins at most), its
    // `max_bins` then rewritten to 16 (both two-byte varints), as a forger would.
    let mut forty = crate::summary::Summary::of(NOW_NS, 1.0);
    for i in 1..40 {
        forty.merge(&crate::summary::Summary::of(
            NOW_NS + i,
            1.5f64.powi(i as i32),
        ));
    }
    let mut oversized = BucketDoc::new("d0/t", NOW_S, 3600, &forty);
    assert_eq!(oversized.sketch[9..11], [0x80, 0x10], "2048 as a varint");
    oversized.sketch[9..11].copy_from_slice(&[0x90, 0x00]);
    let nan = f64::NAN;
    let cases: Vec<(&str, DeltaMessage, DecodeError)> = vec![
        (
            "another gateway's id on gw-1's topic",
            message(&|m| m.gateway_id = "gw-2".into()),
            DecodeError::GatewayMismatch,
        ),
        (
            "no origin",
            message(&|m| m.origin.clear()),
            DecodeError::InvalidDelta,
        ),
        (
            "an origin that is not a time",
            message(&|m| m.origin = "x".repeat(20)),
            DecodeError::InvalidDelta,
        ),
        (
            "a negative seq",
            message(&|m| m.seq = i64::MIN),
            DecodeError::InvalidDelta,
        ),
        (
            "a negative part",
            message(&|m| m.part = -1),
            DecodeError::InvalidDelta,
        ),
        (
            "a NaN mean",
            bucket(&|b| b.mean = nan),
            DecodeError::InvalidDelta,
        ),
        (
            "a NaN m2",
            bucket(&|b| b.m2 = nan),
            DecodeError::InvalidDelta,
        ),
        (
            "a negative m2",
            bucket(&|b| b.m2 = -1.0),
            DecodeError::InvalidDelta,
        ),
        (
            "an infinite sum_comp",
            bucket(&|b| b.sum_comp = f64::INFINITY),
            DecodeError::InvalidDelta,
        ),
        (
            "a NaN first",
            bucket(&|b| b.first.value = nan),
            DecodeError::InvalidDelta,
        ),
        (
            "a NaN last",
            bucket(&|b| b.last.value = nan),
            DecodeError::InvalidDelta,
        ),
        (
            "first before the bucket",
            bucket(&|b| {
                b.first = PointDoc {
                    ts: NOW_NS - 1,
                    value: 1.5,
                }
            }),
            DecodeError::InvalidDelta,
        ),
        (
            "last at the bucket's end",
            bucket(&|b| b.last.ts = (NOW_S + 3600) * 1_000_000_000),
            DecodeError::InvalidDelta,
        ),
        (
            "a sketch of another gateway's impossible accuracy",
            bucket(&|b| b.sketch = sketch(0.5, 2048)),
            DecodeError::InvalidDelta,
        ),
        (
            "a sketch that never collapses",
            bucket(&|b| b.sketch = sketch(0.01, u32::MAX)),
            DecodeError::InvalidDelta,
        ),
        (
            "a damaged sketch",
            bucket(&|b| b.sketch = vec![1, 2, 3]),
            DecodeError::InvalidDelta,
        ),
        // Issue 52: buckets no bucketd could have written.
        (
            "a count of i64::MAX over a sketch of two",
            bucket(&|b| b.count = i64::MAX),
            DecodeError::InvalidDelta,
        ),
        (
            "a count its sketch does not hold",
            bucket(&|b| b.count = 3),
            DecodeError::InvalidDelta,
        ),
        (
            "a sketch with more bins than its own max_bins",
            bucket(&|b| *b = oversized.clone()),
            DecodeError::InvalidDelta,
        ),
        (
            "a mean above max",
            bucket(&|b| b.mean = 4.5),
            DecodeError::InvalidDelta,
        ),
        (
            "a first value below min",
            bucket(&|b| b.first.value = 1.0),
            DecodeError::InvalidDelta,
        ),
        (
            "a last value above max",
            bucket(&|b| b.last.value = 5.0),
            DecodeError::InvalidDelta,
        ),
        (
            "last before first",
            bucket(&|b| std::mem::swap(&mut b.first.ts, &mut b.last.ts)),
            DecodeError::InvalidDelta,
        ),
        // A counter's increase: each step between readings 1.5 and 4 rises at most 2.5 or
        // resets to one of them, so two readings cannot increase by more than 8 either way.
        (
            "a NaN counter increase",
            bucket(&|b| b.inc = Some(nan)),
            DecodeError::InvalidDelta,
        ),
        (
            "a counter increase its readings cannot reach",
            bucket(&|b| b.inc = Some(8.5)),
            DecodeError::InvalidDelta,
        ),
        (
            "a counter decrease its readings cannot reach",
            bucket(&|b| b.inc = Some(-9.0)),
            DecodeError::InvalidDelta,
        ),
    ];
    // The honest increase, and none (a gateway of a release before it), pass.
    assert_eq!(good.buckets[0].inc, Some(2.5));
    let unknown = message(&|m| m.buckets[0].inc = None);
    assert!(run(&sub, topic, &bytes(&unknown)).is_ok());
    // Without its forged `max_bins`, the 40-bin bucket is what a gateway sends.
    let honest = message(&|m| m.buckets[0] = BucketDoc::new("d0/t", NOW_S, 3600, &forty));
    assert!(run(&sub, topic, &bytes(&honest)).is_ok());
    for (what, m, want) in cases {
        assert_eq!(run(&sub, topic, &bytes(&m)).err(), Some(want), "{what}");
    }
    // A well-formed bucket dated beyond limits.max_future or before limits.max_age is refused
    // alone (it was stored, and one dated 2262 never expired).
    for start in [NOW_S + 7200, 9_214_646_400, 0] {
        let late = bucket(&|b| {
            *b = BucketDoc::new(
                "d0/t",
                start,
                3600,
                &crate::summary::Summary::of(start * 1_000_000_000, 1.0),
            );
        });
        let mut m = good.clone();
        m.buckets.extend(late.buckets);
        let d = run(&sub, topic, &bytes(&m)).unwrap();
        assert_eq!(d.deltas.len(), 1, "{start}");
        assert_eq!(d.rejected, [DecodeError::TimestampOutOfRange], "{start}");
    }
}

/// Issue 52: a central stores a delta's bucket as `<gateway>:<sensor>/<metric>`; a 64-byte
/// gateway id and a 64-byte sensor name make a 129-byte sensor name, which its API refuses. That bucket is refused
/// alone (as a name too long at the gateway would be); the rest of the message counts.
#[test]
fn a_delta_bucket_whose_stored_name_the_api_would_refuse_is_refused_alone() {
    let s = crate::summary::Summary::of(NOW_NS, 1.5);
    let gateway = "g".repeat(64);
    let long = format!("{}/t", "s".repeat(64));
    let message = DeltaMessage {
        gateway_id: gateway.clone(),
        origin: ORIGIN.into(),
        seq: 1,
        part: 0,
        buckets: vec![
            crate::doc::BucketDoc::new(&long, NOW_S, 3600, &s),
            crate::doc::BucketDoc::new("d0/t", NOW_S, 3600, &s),
        ],
    };
    let topic = format!("bucketd/{gateway}/deltas");
    let d = run(
        &delta_sub(),
        &topic,
        &bson::serialize_to_vec(&message).unwrap(),
    )
    .unwrap();
    assert_eq!(d.rejected, [DecodeError::InvalidName]);
    let stored: Vec<&str> = d.deltas.iter().map(|d| d.series.as_str()).collect();
    assert_eq!(stored, [format!("{gateway}:d0/t")]);
    assert!(crate::reading::validate_series(stored[0]).is_ok());
}

/// A verdict, the readings as (series, ns, value), the reading-level rejections.
type Outcome = (
    Result<(), DecodeError>,
    Vec<(String, i64, f64)>,
    Vec<DecodeError>,
);

/// A JSON document as written: every member of every object in order, repeated keys kept
/// (`serde_json`'s `Value` keeps one of them).
#[derive(Debug, Clone)]
enum Tree {
    Num(Num),
    Bool(bool),
    Str(String),
    Null,
    /// Its items (only the root array's matter: they are the objects).
    Array(Vec<Tree>),
    Object(Vec<(String, Tree)>),
}

impl<'de> serde::Deserialize<'de> for Tree {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Tree, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Tree;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Tree, E> {
                Ok(Tree::Num(Num::U(v)))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Tree, E> {
                Ok(Tree::Num(Num::I(v)))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Tree, E> {
                Ok(Tree::Num(Num::F(v)))
            }
            fn visit_bool<E>(self, v: bool) -> Result<Tree, E> {
                Ok(Tree::Bool(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Tree, E> {
                Ok(Tree::Str(v.to_owned()))
            }
            fn visit_unit<E>(self) -> Result<Tree, E> {
                Ok(Tree::Null)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Tree, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<Tree>()? {
                    items.push(item);
                }
                Ok(Tree::Array(items))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Tree, A::Error> {
                let mut members = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Tree>()? {
                    members.push((k, v));
                }
                Ok(Tree::Object(members))
            }
        }
        d.deserialize_any(V)
    }
}

/// A leaf as the decoder reads a timestamp or sensor field.
fn tree_scalar(t: &Tree) -> Scalar<'static> {
    match t {
        Tree::Num(n) => Scalar::Num(*n),
        Tree::Str(s) => Scalar::Str(std::borrow::Cow::Owned(s.clone())),
        _ => Scalar::Other,
    }
}

/// Every member of `o` as (dotted path, value), depth first; an object's own entry after its
/// members, except where the path is the timestamp or sensor field (read whole, not entered).
fn flatten<'t>(
    sub: &Subscription,
    prefix: Option<&str>,
    o: &'t [(String, Tree)],
    out: &mut Vec<(String, &'t Tree)>,
) {
    for (k, v) in o {
        let path = match prefix {
            None => k.clone(),
            Some(prefix) => format!("{prefix}.{k}"),
        };
        let whole =
            Some(&path) == sub.timestamp_field.as_ref() || Some(&path) == sub.sensor_field.as_ref();
        if let (Tree::Object(inner), false) = (v, whole) {
            flatten(sub, Some(&path), inner, out);
        }
        out.push((path, v));
    }
}

/// The JSON format as README defines it, read from a document tree with repeated keys kept:
/// every number or boolean below `root` (the whole object without one) is a metric named by its
/// dotted path from `root`, unless it is the timestamp or sensor field, or `fields` leaves it
/// out; a repeated name keeps its first place and its last value (an object, string or null as
/// its value is no number). The streaming decoder must agree with it on every payload.
fn reference_json(sub: &Subscription, topic: &str, payload: &[u8]) -> Outcome {
    let c = ctx();
    let mut readings = Vec::new();
    let mut rejected = Vec::new();
    let topic_sensor = sub.template.capture(topic).and_then(|c| c.sensor);
    if payload.iter().all(u8::is_ascii_whitespace) {
        return (Err(DecodeError::EmptyPayload), readings, rejected); // checked before parsing
    }
    let verdict = |e: serde_json::Error| {
        if std::str::from_utf8(payload).is_err() {
            DecodeError::InvalidUtf8
        } else if e.to_string().starts_with("number out of range") {
            DecodeError::NonFinite
        } else {
            DecodeError::InvalidJson
        }
    };
    let tree: Tree = match serde_json::from_slice(payload) {
        Ok(t) => t,
        Err(e) => return (Err(verdict(e)), readings, rejected),
    };
    let items: Vec<Vec<(String, Tree)>> = match tree {
        Tree::Array(items) => {
            let mut objects = Vec::new();
            for item in items {
                let Tree::Object(m) = item else {
                    return (Err(DecodeError::NotAnObject), readings, rejected);
                };
                objects.push(m);
            }
            objects
        }
        Tree::Object(m) => vec![m],
        _ => return (Err(DecodeError::NotAnObject), readings, rejected),
    };
    for o in &items {
        let mut members = Vec::new();
        flatten(sub, None, o, &mut members);
        let find = |want: &Option<String>| {
            want.as_ref().and_then(|w| {
                members
                    .iter()
                    .rev()
                    .find(|(p, _)| p == w)
                    .map(|(_, v)| tree_scalar(v))
            })
        };
        let sensor = match (&sub.sensor_field, find(&sub.sensor_field)) {
            (None, _) => topic_sensor.unwrap().to_owned(),
            (Some(_), Some(Scalar::Str(s))) => s.into_owned(),
            (Some(_), Some(Scalar::Num(n @ (Num::U(_) | Num::I(_))))) => match n {
                Num::U(u) => u.to_string(),
                Num::I(i) => i.to_string(),
                Num::F(_) => unreachable!(),
            },
            (Some(_), _) => {
                rejected.push(DecodeError::InvalidName);
                continue;
            }
        };
        let ts = match find(&sub.timestamp_field) {
            None => c.received,
            Some(v) => {
                let Some(ts) = parse_timestamp(&v, sub.timestamp_unit) else {
                    rejected.push(DecodeError::InvalidTimestamp);
                    continue;
                };
                ts
            }
        };
        // Metrics: named from root, first place and last value of each name.
        let mut metrics: Vec<(String, Option<f64>)> = Vec::new();
        for (path, v) in &members {
            if Some(path) == sub.timestamp_field.as_ref() || Some(path) == sub.sensor_field.as_ref()
            {
                continue;
            }
            let name = match &sub.root {
                None => path.clone(),
                Some(r) => match path
                    .strip_prefix(r.as_str())
                    .and_then(|p| p.strip_prefix('.'))
                {
                    Some(name) if !name.is_empty() => name.to_owned(),
                    _ => continue,
                },
            };
            if sub.fields.as_ref().is_some_and(|f| !f.contains(&name)) {
                continue;
            }
            let value = match v {
                Tree::Num(n) => Some(n.as_f64()),
                Tree::Bool(b) => Some(f64::from(u8::from(*b))),
                _ => None,
            };
            match metrics.iter_mut().find(|(n, _)| *n == name) {
                Some(m) => m.1 = value,
                None => metrics.push((name, value)),
            }
        }
        for (name, value) in metrics {
            let Some(value) = value else { continue };
            let mut d = Decoded::default();
            d.push(&c, &sensor, &name, ts, value);
            readings.extend(
                d.readings()
                    .map(|r| (r.series.to_owned(), r.ts.as_nanos(), r.value)),
            );
            rejected.append(&mut d.rejected);
        }
    }
    if readings.is_empty() && rejected.is_empty() {
        return (Err(DecodeError::NoReadings), readings, rejected);
    }
    (Ok(()), readings, rejected)
}

/// JSON objects whose keys repeat, escape, and name the timestamp and sensor fields; values of
/// every kind; sometimes inside an array with non-objects, sometimes cut short.
fn json_objects() -> impl Strategy<Value = String> {
    let key = prop::sample::select(
        &[
            "\"a\"",
            "\"b\"",
            "\"a\"",
            "\"\\u0061\"",
            "\"ts\"",
            "\"sensor\"",
            "\"a/b\"",
            "\"\"",
            "\"t\\u00e9\"",
            "\"k1\"",
            "\"k2\"",
            "\"k3\"",
        ][..],
    );
    let value = prop::sample::select(
        &[
            "1",
            "-2",
            "0.5",
            "1e308",
            "18446744073709551615",
            "-9223372036854775808",
            "1763719200",
            "1763719200.25",
            "1763719200000",
            "\"2025-11-21T10:00:00Z\"",
            "\"x\"",
            "\"s\\u0031\"",
            "true",
            "null",
            "[1, {\"a\": 2}]",
            "{\"a\": 1}",
            "{\"a\": {\"a\": 2, \"ts\": 1763719200}, \"k1\": true}",
            "17",
            "-17",
        ][..],
    );
    let object = prop::collection::vec((key, value), 0..40).prop_map(|fields| {
        let body: Vec<String> = fields.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        format!("{{{}}}", body.join(", "))
    });
    let item =
        prop_oneof![4 => object.clone(), 1 => Just("3".to_owned()), 1 => Just("[]".to_owned())];
    let array =
        prop::collection::vec(item, 0..4).prop_map(|items| format!("[{}]", items.join(",")));
    (
        prop_oneof![object, array],
        0usize..8,
        any::<prop::sample::Index>(),
    )
        .prop_map(|(text, cut, at)| {
            if cut == 0 && !text.is_empty() {
                text[..at.index(text.len())].to_owned() // cut short: invalid JSON
            } else {
                text
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: fuzz_cases(), ..ProptestConfig::default() })]

    /// The streaming JSON decoder reads every payload exactly as parsing a document tree did:
    /// the same readings in the same order, the same rejections, the same verdict.
    #[test]
    fn streaming_json_agrees_with_the_document_tree(
        payload in json_objects(),
        sensor_field in any::<bool>(),
        root in prop::option::of(Just("a")),
        fields in prop::option::of(Just(["a", "a.a", "k1"])),
        ts_path in prop::sample::select(&["ts", "a.ts", "a.a"][..]),
    ) {
        let s = json_sub(|s| {
            s.timestamp_field = Some(ts_path.into());
            if sensor_field { s.sensor_field = Some("sensor".into()) }
            s.root = root.map(Into::into);
            s.fields = fields.map(|f| f.iter().map(|&f| f.into()).collect());
        });
        let topic = "devices/dev/telemetry";
        let want = reference_json(&s, topic, payload.as_bytes());
        let mut out = Decoded::default();
        let mut c = ctx();
        c.max_payload_bytes = 1 << 20;
        let got = decode(&s, topic.as_bytes(), payload.as_bytes(), &c, &mut out);
        let readings: Vec<_> = out.readings().map(|r| (r.series.to_owned(), r.ts.as_nanos(), r.value)).collect();
        prop_assert_eq!(&got, &want.0, "{}", payload);
        if got.is_ok() {
            prop_assert_eq!(&readings, &want.1, "{}", payload);
            prop_assert_eq!(&out.rejected, &want.2, "{}", payload);
        }
    }
}

/// Issue 54: nested objects name their metrics by their keys joined with `.`; booleans are 1
/// and 0 (Tasmota's `ENERGY` object, Zigbee2MQTT's occupancy).
#[test]
fn nested_objects_and_booleans_are_metrics() {
    let s = json_sub(|s| s.timestamp_field = None);
    let got = readings(
        &s,
        "devices/plug/telemetry",
        r#"{"Time":"2026-11-27T10:00:00","ENERGY":{"Power":45,"Voltage":230,"Today":{"kWh":1.5}},"occupancy":true,"contact":false,"state":"ON"}"#,
    );
    let names: Vec<_> = got.iter().map(|r| (r.0.as_str(), r.2)).collect();
    assert_eq!(
        names,
        [
            ("plug/ENERGY.Power", 45.0),
            ("plug/ENERGY.Voltage", 230.0),
            ("plug/ENERGY.Today.kWh", 1.5),
            ("plug/occupancy", 1.0),
            ("plug/contact", 0.0),
        ]
    );
}

/// `root` picks the object whose members are the metrics; `timestamp_field` and
/// `sensor_field` are dotted paths from the payload's top (The Things Stack's uplink).
#[test]
fn root_fields_and_dotted_paths_pick_the_metrics_and_the_time() {
    let tts = r#"{
      "end_device_ids": {"device_id": "eui-70b3d57ed0000001", "application_ids": {"application_id": "farm"}},
      "received_at": "2025-11-21T09:59:05.123456789Z",
      "uplink_message": {
        "f_port": 1, "f_cnt": 42,
        "decoded_payload": {"temperature": 21.5, "humidity": 40, "battery": {"volts": 3.6}, "label": "x"},
        "rx_metadata": [{"rssi": -42}],
        "settings": {"data_rate": {"lora": {"spreading_factor": 7}}}
      }
    }"#;
    let s = json_sub(|s| {
        s.template = Template::parse("v3/+/devices/+/up").unwrap();
        s.filter = "v3/+/devices/+/up".into();
        s.sensor_field = Some("end_device_ids.device_id".into());
        s.timestamp_field = Some("received_at".into());
        s.root = Some("uplink_message.decoded_payload".into());
    });
    let topic = "v3/farm@ttn/devices/eui-70b3d57ed0000001/up";
    let got = readings(&s, topic, tts);
    let ts = Timestamp::parse_rfc3339("2025-11-21T09:59:05.123456789Z")
        .unwrap()
        .as_nanos();
    assert_eq!(
        got,
        [
            ("eui-70b3d57ed0000001/temperature".to_owned(), ts, 21.5),
            ("eui-70b3d57ed0000001/humidity".to_owned(), ts, 40.0),
            ("eui-70b3d57ed0000001/battery.volts".to_owned(), ts, 3.6),
        ]
    );
    // `fields`: only these, as paths from root.
    let only = json_sub(|x| {
        *x = s.clone();
        x.fields = Some(vec![
            "battery.volts".into(),
            "temperature".into(),
            "absent".into(),
        ]);
    });
    let names: Vec<_> = readings(&only, topic, tts)
        .into_iter()
        .map(|r| r.0)
        .collect();
    assert_eq!(
        names,
        [
            "eui-70b3d57ed0000001/temperature",
            "eui-70b3d57ed0000001/battery.volts"
        ]
    );
    // A root the payload does not have: no readings; a timestamp path that is not there: the
    // receive time.
    let missing = json_sub(|x| {
        *x = s.clone();
        x.root = Some("uplink_message.nothing".into());
    });
    assert_eq!(
        run(&missing, topic, tts.as_bytes()).unwrap_err(),
        DecodeError::NoReadings
    );
    let late = json_sub(|x| {
        *x = s.clone();
        x.timestamp_field = Some("uplink_message.received_at".into());
    });
    let d = run(&late, topic, tts.as_bytes()).unwrap();
    assert!(d.receive_time);
    assert!(d.readings().all(|r| r.ts == ctx().received));
}

#[test]
fn a_repeated_name_keeps_its_first_place_and_its_last_value() {
    let s = json_sub(|s| s.timestamp_field = Some("ts".into()));
    let t = "devices/d/telemetry";
    let got = readings(&s, t, r#"{"a": 1, "b": 2, "a": 3}"#);
    let names: Vec<_> = got.iter().map(|r| (r.0.as_str(), r.2)).collect();
    assert_eq!(names, [("d/a", 3.0), ("d/b", 2.0)]);
    // The same with more names than the small-object path handles.
    let mut fields: Vec<String> = (0..40).map(|i| format!(r#""k{i}": {i}"#)).collect();
    fields.push(r#""k3": 99"#.into());
    fields.push(r#""k\u0030": 98"#.into()); // "k0", escaped
    let got = readings(&s, t, &format!("{{{}}}", fields.join(",")));
    assert_eq!(got.len(), 40);
    assert_eq!((got[0].0.as_str(), got[0].2), ("d/k0", 98.0));
    assert_eq!((got[3].0.as_str(), got[3].2), ("d/k3", 99.0));
    // A later non-number replaces a number: no reading.
    assert_eq!(
        run(&s, t, br#"{"a": 1, "a": "x"}"#).unwrap_err(),
        DecodeError::NoReadings
    );
    // The last timestamp counts.
    let got = readings(&s, t, &format!(r#"{{"ts": 5, "a": 1, "ts": {NOW_S}}}"#));
    assert_eq!(got, [("d/a".to_owned(), NOW_NS, 1.0)]);
}

#[test]
fn invalid_json_outranks_a_non_object_item() {
    let s = &subs()[1];
    let t = "devices/d/telemetry";
    assert_eq!(
        run(s, t, b"[1, {\"a\": 1}]").unwrap_err(),
        DecodeError::NotAnObject
    );
    assert_eq!(
        run(s, t, b"[1, {\"a\": ").unwrap_err(),
        DecodeError::InvalidJson
    );
    assert_eq!(run(s, t, b"[[1], 2").unwrap_err(), DecodeError::InvalidJson);
}

#[test]
fn a_huge_message_does_not_keep_its_buffers() {
    let s = json_sub(|_| {});
    let mut c = ctx();
    c.max_payload_bytes = 1 << 20;
    let mut out = Decoded::default();
    let huge = format!(
        "{{{}}}",
        (0..20_000)
            .map(|i| format!(r#""m{i}": 1"#))
            .collect::<Vec<_>>()
            .join(",")
    );
    decode(&s, b"devices/d/telemetry", huge.as_bytes(), &c, &mut out).unwrap();
    assert_eq!(out.readings().len(), 20_000);
    decode(&s, b"devices/d/telemetry", br#"{"a": 1}"#, &c, &mut out).unwrap();
    assert!(out.readings.capacity() <= 4096 && out.names.capacity() <= 4096 * 32);
    assert!(out.scratch.fields.capacity() <= 4096);
}

/// Issue 41: a delta message whose unknown field nested ~9,000 empty documents overflowed the
/// ingest worker's stack in bson's deserialiser (SIGABRT; redelivered after the restart, so
/// every central crash-looped). The nesting is bounded on the raw bytes before the parse: at
/// the bound the message is decoded as usual, one level past it is refused, and 9,000 levels
/// (as documents, arrays or code scopes) are refused on a thread with a 128 KiB stack.
#[test]
fn delta_nesting_is_bounded_before_the_parse() {
    use crate::delta::shapes::{Nest, with_nested};
    use crate::limits::DELTA_DEPTH_MAX;
    let s = crate::summary::Summary::of(NOW_NS, 1.5);
    let honest = delta_payload("gw-1", "d0/t", &s);
    let sub = delta_sub();
    let all = [Nest::Document, Nest::Array, Nest::CodeWithScope];
    for kinds in [&all[..1], &all[1..2], &all[2..], &all[..]] {
        // The root is level 1: an extra field of `DEPTH_MAX - 1` levels is at the bound.
        let at_bound = with_nested(&honest, "unknown", kinds, DELTA_DEPTH_MAX - 1, 3);
        let d = run(&sub, "bucketd/gw-1/deltas", &at_bound).unwrap();
        assert_eq!(
            d.deltas.len(),
            1,
            "{kinds:?}: decoded as usual at the bound"
        );
        let past = with_nested(&honest, "unknown", kinds, DELTA_DEPTH_MAX, 3);
        assert_eq!(
            run(&sub, "bucketd/gw-1/deltas", &past).unwrap_err(),
            DecodeError::InvalidDelta,
            "{kinds:?}: one level past the bound"
        );
        let deep = with_nested(&honest, "unknown", kinds, 9_000, 0);
        let verdict = std::thread::Builder::new()
            .stack_size(128 * 1024)
            .spawn(move || {
                let mut c = ctx();
                c.max_payload_bytes = 1 << 20;
                let mut out = Decoded::default();
                decode(&delta_sub(), b"bucketd/gw-1/deltas", &deep, &c, &mut out)
            })
            .unwrap()
            .join()
            .expect("no stack overflow");
        assert_eq!(verdict, Err(DecodeError::InvalidDelta), "{kinds:?}");
    }
    // A wide message (thousands of elements in one level) is linear work, and decodes.
    let wide = with_nested(&honest, "unknown", &all[..1], 1, 8_000);
    let mut c = ctx();
    c.max_payload_bytes = 1 << 20;
    let mut out = Decoded::default();
    decode(&sub, b"bucketd/gw-1/deltas", &wide, &c, &mut out).unwrap();
    assert_eq!(out.deltas.len(), 1);
}

/// The depth check reads only well-formed BSON: a length that runs past the buffer, or a
/// nested document cut short, is refused, never read beyond.
#[test]
fn the_depth_check_refuses_malformed_bson() {
    use crate::delta::within_depth;
    let s = crate::summary::Summary::of(NOW_NS, 1.5);
    let honest = delta_payload("gw-1", "d0/t", &s);
    assert!(within_depth(&honest, 4));
    assert!(!within_depth(&honest, 3), "a real message nests 4 deep");
    assert!(!within_depth(&honest[..honest.len() - 1], 8));
    assert!(!within_depth(b"", 8));
    let mut long = honest.clone();
    long[0] = long[0].wrapping_add(1);
    assert!(!within_depth(&long, 8));
    // A nested document whose length runs past its parent.
    let mut bad = crate::delta::shapes::with_nested(
        &honest,
        "x",
        &[crate::delta::shapes::Nest::Document],
        2,
        0,
    );
    let at = honest.len() - 1 + 1 + 2; // the element's value, after its type and key
    bad[at] = 0x7f;
    assert!(!within_depth(&bad, 8));
}

/// Issue 41: every parser of network input has a nesting bound, tested at the bound and one
/// past it. JSON's is `serde_json`'s recursion limit ([`crate::limits::JSON_DEPTH_MAX`] levels,
/// the payload's own object counting as one): at the bound a payload decodes (its nested field
/// ignored) on a 256 KiB stack, an eighth of a Tokio worker's; one past it is `invalid_json`.
#[test]
fn json_nesting_is_bounded_at_the_limit_and_one_past_it() {
    use crate::limits::JSON_DEPTH_MAX;
    let run_nested = |depth: usize| {
        std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || {
                let payload = format!(
                    r#"{{"ts": {NOW_S}, "x": 1, "deep": {}{}}}"#,
                    "[".repeat(depth - 1),
                    "]".repeat(depth - 1)
                );
                let mut out = Decoded::default();
                let mut c = ctx();
                c.max_payload_bytes = 1 << 20;
                let r = decode(
                    &subs()[1],
                    b"devices/d/telemetry",
                    payload.as_bytes(),
                    &c,
                    &mut out,
                );
                r.map(|()| out.readings().len())
            })
            .unwrap()
            .join()
            .expect("no stack overflow")
    };
    assert_eq!(run_nested(JSON_DEPTH_MAX), Ok(1));
    assert_eq!(
        run_nested(JSON_DEPTH_MAX + 1),
        Err(DecodeError::InvalidJson)
    );
}

fn influx_sub() -> Subscription {
    json_sub(|s| {
        s.filter = "telegraf/#".into();
        s.template = Template::parse("telegraf/#").unwrap();
        s.format = Format::Influx;
        s.timestamp_field = None;
        s.sensor_field = None;
        s.timestamp_unit = TimestampUnit::Auto;
    })
}

/// Issue 54: line protocol as InfluxDB defines it (its reference's examples): tags sorted into
/// the sensor, every field type, escapes, the timestamp in nanoseconds by default.
#[test]
fn influx_lines_are_read_as_influxdb_reads_them() {
    let s = influx_sub();
    let ns = NOW_NS;
    let payload = format!(
        "# a comment\n\
         weather,site=north,area=a\\ b temp=21.5,hum=40i,count=7u,ok=true,bad=F,note=\"x, \\\"y\\\" z\" {ns}\n\
         \n\
         my\\ meas\\,1,t\\=k=v\\,1 f\\ 1=1e3,f\\=2=-2.5 {ns}\r\n\
         cpu usage=0.5\n"
    );
    let d = run(&s, "telegraf/host1", payload.as_bytes()).unwrap();
    assert!(d.rejected.is_empty(), "{:?}", d.rejected);
    let got: Vec<_> = d
        .readings()
        .map(|r| (r.series.to_owned(), r.ts.as_nanos(), r.value))
        .collect();
    let w = "weather,area=a b,site=north";
    assert_eq!(
        got,
        [
            (format!("{w}/temp"), ns, 21.5),
            (format!("{w}/hum"), ns, 40.0),
            (format!("{w}/count"), ns, 7.0),
            (format!("{w}/ok"), ns, 1.0),
            (format!("{w}/bad"), ns, 0.0),
            ("my meas,1,t=k=v,1/f 1".to_owned(), ns, 1000.0),
            ("my meas,1,t=k=v,1/f=2".to_owned(), ns, -2.5),
            ("cpu/usage".to_owned(), ctx().received.as_nanos(), 0.5),
        ]
    );
    assert!(d.receive_time, "the last line had no timestamp");
    // Seconds when configured.
    let secs = json_sub(|x| {
        *x = influx_sub();
        x.timestamp_unit = TimestampUnit::S;
    });
    let got = readings(&secs, "telegraf/x", &format!("m v=1 {NOW_S}"));
    assert_eq!(got, [("m/v".to_owned(), ns, 1.0)]);
}

/// A bad line is refused alone and counted; the message's good lines are kept.
#[test]
fn a_bad_influx_line_is_refused_alone() {
    let s = influx_sub();
    let bad = [
        "nofields",
        "m ",
        "m v=",
        "m v=abc",
        "m v=NaN",
        "m v=inf",
        "m v=1i2",
        "m,tag v=1",
        "m,=x v=1",
        "m,t= v=1",
        ",t=x v=1",
        "m v=\"unterminated",
        "m v=1 notatime",
        "m v=1 1 2",
        "m =1",
        "m v=1,",
        "m v=99999999999999999999i",
        "m v=-1u",
    ];
    for line in bad {
        let payload = format!("good a=1 {NOW_NS}\n{line}\ngood b=2 {NOW_NS}");
        let d = run(&s, "telegraf/x", payload.as_bytes()).unwrap();
        assert_eq!(d.rejected, [DecodeError::InvalidLine], "{line:?}");
        let names: Vec<_> = d.readings().map(|r| r.series.to_owned()).collect();
        assert_eq!(names, ["good/a", "good/b"], "{line:?}");
    }
    // Only string fields: nothing to store, not malformed.
    assert_eq!(
        run(&s, "telegraf/x", b"m s=\"x\"").unwrap_err(),
        DecodeError::NoReadings
    );
    // Per-reading faults as for every format: a repeated key keeps the last value.
    let d = run(&s, "telegraf/x", b"m v=1,v=2,w=1e999 1").unwrap();
    assert_eq!(
        d.rejected,
        [DecodeError::TimestampOutOfRange, DecodeError::NonFinite]
    );
    let d = run(&s, "telegraf/x", format!("m v=1,v=2 {NOW_NS}").as_bytes()).unwrap();
    assert_eq!(d.readings().map(|r| r.value).collect::<Vec<_>>(), [2.0]);
}

fn senml_sub() -> Subscription {
    json_sub(|s| {
        s.filter = "senml/+".into();
        s.template = Template::parse("senml/{sensor}").unwrap();
        s.format = Format::Senml;
        s.timestamp_field = None;
        s.sensor_field = None;
    })
}

/// Issue 54: RFC 8428's own examples (section 5): base names and times resolved, relative
/// times from the receive time, booleans 1/0, strings skipped.
#[test]
fn senml_packs_resolve_names_times_and_values_as_rfc_8428() {
    let s = senml_sub();
    // Section 5.1.2, "multiple datapoints": base name, base time, relative t.
    let pack = format!(
        r#"[
         {{"bn":"urn:dev:ow:10e2073a01080063:","bt":{NOW_S}.25,"bu":"A","bver":5,"n":"voltage","u":"V","v":120.1}},
         {{"n":"current","t":-5,"v":1.2}},
         {{"n":"current","t":-4,"v":1.3}},
         {{"n":"on/off","vb":true}},
         {{"n":"label","vs":"kitchen"}},
         {{"n":"blob","vd":"aGkgCg"}},
         {{"bn":"dev2/","bv":10,"n":"temp","v":1.5,"t":1}}
        ]"#
    );
    let got = readings(&s, "senml/fallback", &pack);
    let t = NOW_NS + 250_000_000;
    let dev = "urn:dev:ow:10e2073a01080063";
    assert_eq!(
        got,
        [
            (format!("{dev}/voltage"), t, 120.1),
            (format!("{dev}/current"), t - 5_000_000_000, 1.2),
            (format!("{dev}/current"), t - 4_000_000_000, 1.3),
            (format!("{dev}/on.off"), t, 1.0),
            ("dev2/temp".to_owned(), t + 1_000_000_000, 11.5),
        ]
    );
    // No base name: the topic's sensor; no time: the receive time; a relative time.
    let got = readings(
        &s,
        "senml/kitchen",
        r#"[{"n":"temp","v":21},{"n":"temp","t":-60,"v":20}]"#,
    );
    let now = ctx().received.as_nanos();
    assert_eq!(
        got,
        [
            ("kitchen/temp".to_owned(), now, 21.0),
            ("kitchen/temp".to_owned(), now - 60_000_000_000, 20.0)
        ]
    );
    // The whole name in bn: split at its last separator.
    let got = readings(
        &s,
        "senml/x",
        &format!(r#"[{{"bn":"urn:dev:mac:0024befffe804ff1:temp","t":{NOW_S},"v":3}}]"#),
    );
    assert_eq!(
        got,
        [("urn:dev:mac:0024befffe804ff1/temp".to_owned(), NOW_NS, 3.0)]
    );
}

/// A bad record is refused alone; its base fields do not apply; a pack that is not an array is
/// refused whole.
#[test]
fn a_bad_senml_record_is_refused_alone() {
    let s = senml_sub();
    let d = run(
        &s,
        "senml/k",
        br#"[{"n":"a","v":1},{"n":"b","v":"x"},{"bn":7,"n":"c","v":1},{"n":"d","v":1,"vb":true},{"n":"e","v":1,"x_":1},3,{"bn":"other/","n":"f","v":2}]"#,
    )
    .unwrap();
    let got: Vec<_> = d
        .readings()
        .map(|r| (r.series.to_owned(), r.value))
        .collect();
    assert_eq!(got, [("k/a".to_owned(), 1.0), ("other/f".to_owned(), 2.0)]);
    assert_eq!(d.rejected, [DecodeError::InvalidSenml; 5]);
    for (payload, e) in [
        (&br#"{"n":"a","v":1}"#[..], DecodeError::InvalidSenml),
        (b"[{\"n\":", DecodeError::InvalidJson),
        (b"[]", DecodeError::NoReadings),
    ] {
        assert_eq!(run(&s, "senml/k", payload).unwrap_err(), e);
    }
    let d = run(&s, "senml/k", br#"[{"n":"a","v":1,"t":1e300}]"#).unwrap();
    assert_eq!(d.rejected, [DecodeError::InvalidTimestamp]);
}

/// Input built from a format's own pieces, so that the fuzz reaches past the first check.
fn soup(pieces: &'static [&'static str], max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop::sample::select(pieces), 0..max)
        .prop_map(|p| p.concat().into_bytes())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: fuzz_cases(), ..ProptestConfig::default() })]

    /// Line protocol by shape: escapes at every end, quotes left open, fields without values,
    /// long lines and many of them; every outcome a verdict or valid readings, never a panic.
    #[test]
    fn influx_shapes_yield_only_valid_readings(
        payload in soup(&[
            "m", "weather", ",", " ", "=", "\\", "\"", "t", "1", "1i", "-2u", "1.5e3", "\n", "\r\n",
            "#", "\u{e9}", "/", "\0", "1763719200000000000", "-", "true", "F", "k", "v", "x\\ y",
            "  ", "\t",
        ], 60),
        repeat in 1usize..200,
    ) {
        let s = influx_sub();
        let mut c = ctx();
        c.max_payload_bytes = 1 << 20;
        let mut out = Decoded::default();
        let payload = payload.repeat(if repeat > 150 { repeat } else { 1 });
        let result = decode(&s, b"telegraf/x", &payload, &c, &mut out);
        check_decoded(result, &out, &c);
    }

    /// SenML by shape: base fields out of order, wrong types, nesting, must-understand fields,
    /// times at the relative boundary.
    #[test]
    fn senml_shapes_yield_only_valid_readings(
        payload in soup(&[
            "[", "]", "{", "}", ",", ":", "\"bn\"", "\"n\"", "\"v\"", "\"vb\"", "\"t\"", "\"bt\"",
            "\"bv\"", "\"s_\"", "\"d/e:\"", "\"\"", "1", "-5", "268435455.9", "1763719200.5",
            "true", "null", "1e400", "\"x\"", "[[[[", "]]]]",
        ], 80),
        sensor in "[a-z/]{0,2}",
    ) {
        let s = senml_sub();
        let c = ctx();
        let mut out = Decoded::default();
        let topic = format!("senml/{sensor}");
        let result = decode(&s, topic.as_bytes(), &payload, &c, &mut out);
        check_decoded(result, &out, &c);
    }
}

/// Nesting past the parser's limit (in a record, or in an unknown field of one) is refused as
/// the JSON format refuses it, not a stack overflow.
#[test]
fn deep_senml_nesting_is_refused() {
    let s = senml_sub();
    let mut c = ctx();
    c.max_payload_bytes = 1 << 20;
    let deep = "[".repeat(100_000) + &"]".repeat(100_000);
    for pack in [
        format!(r#"[{deep},{{"n":"a","v":1}}]"#),
        format!(r#"[{{"n":"a","v":1,"x":{deep}}}]"#),
    ] {
        let got = decode(&s, b"senml/k", pack.as_bytes(), &c, &mut Decoded::default());
        assert_eq!(got, Err(DecodeError::InvalidJson));
    }
}

mod sparkplug_b {
    use super::*;
    use crate::decode::sparkplug::{Metric, Payload, Value};
    use prost::Message;

    fn sub() -> Subscription {
        json_sub(|s| {
            s.filter = "spBv1.0/#".into();
            s.template = Template::parse("spBv1.0/#").unwrap();
            s.format = Format::SparkplugB;
            s.timestamp_field = None;
            s.sensor_field = None;
            s.rebirth_interval = Some(std::time::Duration::from_mins(1));
        })
    }

    fn metric(
        name: Option<&str>,
        alias: Option<u64>,
        datatype: Option<u32>,
        value: Option<Value>,
    ) -> Metric {
        Metric {
            name: name.map(Into::into),
            alias,
            datatype,
            value,
            ..Metric::default()
        }
    }

    fn payload(ts_ms: Option<u64>, metrics: Vec<Metric>) -> Vec<u8> {
        Payload {
            timestamp: ts_ms,
            metrics,
            // No seq: a test that numbers its messages sets them.
            seq: None,
            uuid: None,
        }
        .encode_to_vec()
    }

    fn at(
        births: &mut Births,
        topic: &str,
        payload: &[u8],
        received_s: i64,
    ) -> Result<Decoded, DecodeError> {
        let mut c = ctx();
        c.received = Timestamp::from_secs(received_s);
        let mut out = Decoded::default();
        decode_with(&sub(), topic.as_bytes(), payload, &c, births, &mut out).map(|()| out)
    }

    fn got(d: &Decoded) -> Vec<(String, i64, f64)> {
        d.readings()
            .map(|r| (r.series.to_owned(), r.ts.as_nanos(), r.value))
            .collect()
    }

    const MS: u64 = NOW_S as u64 * 1000;

    /// An NBIRTH of one Double metric `name` with alias 1.
    fn birth_of(name: &str) -> Vec<u8> {
        payload(
            Some(MS),
            vec![metric(
                Some(name),
                Some(1),
                Some(10),
                Some(Value::Double(0.0)),
            )],
        )
    }

    /// Issue 54: a BIRTH names the metrics and their aliases; DATA names them by alias; every
    /// numeric datatype reads as its value (signed ones from their two's complement).
    #[test]
    fn births_name_aliases_and_every_numeric_datatype_reads_as_its_value() {
        let mut births = Births::default();
        let birth = payload(
            Some(MS),
            vec![
                metric(Some("bdSeq"), None, Some(8), Some(Value::Long(0))),
                metric(
                    Some("Node Control/Rebirth"),
                    Some(0),
                    Some(11),
                    Some(Value::Boolean(false)),
                ),
                metric(
                    Some("Inputs/Temp"),
                    Some(1),
                    Some(9),
                    Some(Value::Float(21.5)),
                ),
                metric(Some("i8"), Some(2), Some(1), Some(Value::Int(0xFFFF_FFFF))),
                metric(Some("i16"), Some(3), Some(2), Some(Value::Int(0xFFFE))),
                metric(Some("i32"), Some(4), Some(3), Some(Value::Int(0x8000_0000))),
                metric(Some("i64"), Some(5), Some(4), Some(Value::Long(u64::MAX))),
                metric(Some("u32"), Some(6), Some(7), Some(Value::Int(u32::MAX))),
                // Tahu's JavaScript encoder sends UInt32 in long_value.
                metric(Some("u32l"), Some(12), Some(7), Some(Value::Long(900))),
                metric(Some("u64"), Some(7), Some(8), Some(Value::Long(1 << 40))),
                metric(Some("d"), Some(8), Some(10), Some(Value::Double(-0.125))),
                metric(Some("b"), Some(9), Some(11), Some(Value::Boolean(true))),
                metric(Some("label"), Some(10), Some(12), None),
                metric(Some("nothing"), Some(11), Some(9), None),
            ],
        );
        let d = at(&mut births, "spBv1.0/plant/NBIRTH/edge1", &birth, NOW_S).unwrap();
        let ns = NOW_NS;
        let s = "plant:edge1";
        assert_eq!(
            got(&d),
            [
                (format!("{s}/sparkplug.online"), ns, 1.0),
                (format!("{s}/Inputs.Temp"), ns, 21.5),
                (format!("{s}/i8"), ns, -1.0),
                (format!("{s}/i16"), ns, -2.0),
                (format!("{s}/i32"), ns, -2_147_483_648.0),
                (format!("{s}/i64"), ns, -1.0),
                (format!("{s}/u32"), ns, 4_294_967_295.0),
                (format!("{s}/u32l"), ns, 900.0),
                (format!("{s}/u64"), ns, 1_099_511_627_776.0),
                (format!("{s}/d"), ns, -0.125),
                (format!("{s}/b"), ns, 1.0),
            ]
        );
        // The string and the metric without a value: skipped and counted.
        assert_eq!(d.rejected, [DecodeError::NotNumeric; 2]);
        // DATA by alias, without datatypes (the birth's), at the metric's own time.
        let data = payload(
            Some(MS + 2000),
            vec![
                metric(None, Some(1), None, Some(Value::Float(22.0))),
                Metric {
                    timestamp: Some(MS + 1000),
                    ..metric(None, Some(2), None, Some(Value::Int(0x80)))
                },
            ],
        );
        let d = at(&mut births, "spBv1.0/plant/NDATA/edge1", &data, NOW_S).unwrap();
        assert_eq!(
            got(&d),
            [
                (format!("{s}/Inputs.Temp"), ns + 2_000_000_000, 22.0),
                (format!("{s}/i8"), ns + 1_000_000_000, -128.0)
            ]
        );
        assert!(d.rebirth.is_none());
        // A device's birth and data: its own sensor; aliases unique across the node.
        let dbirth = payload(
            Some(MS),
            vec![metric(
                Some("rpm"),
                Some(20),
                Some(7),
                Some(Value::Int(900)),
            )],
        );
        let d = at(
            &mut births,
            "spBv1.0/plant/DBIRTH/edge1/pump",
            &dbirth,
            NOW_S,
        )
        .unwrap();
        assert_eq!(
            got(&d),
            [
                ("plant:edge1:pump/sparkplug.online".to_owned(), ns, 1.0),
                ("plant:edge1:pump/rpm".to_owned(), ns, 900.0)
            ]
        );
        let ddata = payload(
            Some(MS),
            vec![metric(None, Some(20), None, Some(Value::Int(950)))],
        );
        let d = at(&mut births, "spBv1.0/plant/DDATA/edge1/pump", &ddata, NOW_S).unwrap();
        assert_eq!(got(&d), [("plant:edge1:pump/rpm".to_owned(), ns, 950.0)]);
    }

    /// An alias no BIRTH defined: counted, and a rebirth asked of the edge node at most once
    /// per interval; a DEATH forgets the node's aliases; DEATH, commands and STATE are control
    /// messages.
    #[test]
    fn an_unknown_alias_asks_for_a_rebirth_once_per_interval() {
        let mut births = Births::default();
        let data = payload(
            Some(MS),
            vec![metric(None, Some(1), None, Some(Value::Double(1.0)))],
        );
        let d = at(&mut births, "spBv1.0/g/NDATA/n", &data, NOW_S).unwrap();
        assert_eq!(d.rejected, [DecodeError::UnknownAlias]);
        let (topic, body) = d.rebirth.clone().expect("a rebirth request");
        assert_eq!(topic, "spBv1.0/g/NCMD/n");
        let asked = Payload::decode(&body[..]).unwrap();
        assert_eq!(asked.metrics.len(), 1);
        assert_eq!(
            asked.metrics[0].name.as_deref(),
            Some("Node Control/Rebirth")
        );
        assert_eq!(asked.metrics[0].datatype, Some(11));
        assert_eq!(asked.metrics[0].value, Some(Value::Boolean(true)));
        assert_eq!(asked.timestamp, Some(MS));
        // Not again within the minute; again after it.
        assert!(
            at(&mut births, "spBv1.0/g/NDATA/n", &data, NOW_S + 59)
                .unwrap()
                .rebirth
                .is_none()
        );
        assert!(
            at(&mut births, "spBv1.0/g/NDATA/n", &data, NOW_S + 60)
                .unwrap()
                .rebirth
                .is_some()
        );
        // Never when the interval is off.
        let off = json_sub(|s| {
            *s = sub();
            s.rebirth_interval = None;
        });
        let mut out = Decoded::default();
        decode_with(
            &off,
            b"spBv1.0/g/NDATA/other",
            &data,
            &ctx(),
            &mut births,
            &mut out,
        )
        .unwrap();
        assert!(out.rebirth.is_none());
        // The birth arrives: named; the node's death forgets it.
        let birth = birth_of("x");
        at(&mut births, "spBv1.0/g/NBIRTH/n", &birth, NOW_S).unwrap();
        assert_eq!(
            got(&at(&mut births, "spBv1.0/g/NDATA/n", &data, NOW_S).unwrap()).len(),
            1
        );
        for topic in [
            "spBv1.0/g/NCMD/n",
            "spBv1.0/g/DCMD/n/d",
            "spBv1.0/STATE/host1",
        ] {
            let d = at(&mut births, topic, b"", NOW_S).unwrap();
            assert!(d.control && d.readings().len() == 0, "{topic}");
        }
        // A device's death and the node's: offline, as a reading of `sparkplug.online`.
        let d = at(&mut births, "spBv1.0/g/DDEATH/n/d", b"", NOW_S).unwrap();
        assert_eq!(
            got(&d),
            [("g:n:d/sparkplug.online".to_owned(), NOW_NS, 0.0)]
        );
        let d = at(&mut births, "spBv1.0/g/NDEATH/n", b"", NOW_S + 1).unwrap();
        assert_eq!(
            got(&d),
            [(
                "g:n/sparkplug.online".to_owned(),
                NOW_NS + 1_000_000_000,
                0.0
            )]
        );
        let d = at(&mut births, "spBv1.0/g/NDATA/n", &data, NOW_S + 600).unwrap();
        assert_eq!(
            d.rejected,
            [DecodeError::UnknownAlias],
            "forgotten at NDEATH"
        );
        // A new NBIRTH replaces the node's aliases.
        let birth2 = birth_of("y");
        at(&mut births, "spBv1.0/g/NBIRTH/n", &birth2, NOW_S).unwrap();
        let d = at(&mut births, "spBv1.0/g/NDATA/n", &data, NOW_S).unwrap();
        assert_eq!(got(&d)[0].0, "g:n/y");
    }

    /// Bad input: a truncated or garbled payload, a topic that is not Sparkplug's, too many
    /// metrics, a compressed payload, a timestamp out of range: refused with a reason.
    #[test]
    fn bad_sparkplug_input_is_refused_with_a_reason() {
        let mut births = Births::default();
        let good = payload(
            Some(MS),
            vec![metric(Some("x"), None, Some(10), Some(Value::Double(1.0)))],
        );
        for cut in 1..good.len() {
            let r = at(&mut births, "spBv1.0/g/NDATA/n", &good[..cut], NOW_S);
            assert!(
                matches!(r, Err(DecodeError::InvalidSparkplug) | Ok(_)),
                "{cut}: {r:?}"
            );
        }
        assert_eq!(
            at(
                &mut births,
                "spBv1.0/g/NDATA/n",
                &good[..good.len() - 1],
                NOW_S
            )
            .unwrap_err(),
            DecodeError::InvalidSparkplug
        );
        for topic in [
            "spBv1.0/g/NDATA",
            "spBv1.0/g/NDATA/n/d",
            "spBv1.0/g/DDATA/n",
            "spBv1.0/g/XDATA/n",
            "spAv1.0/g/NDATA/n",
            "spBv1.0/g/NDATA/n/d/e",
        ] {
            assert_eq!(
                at(&mut births, topic, &good, NOW_S).unwrap_err(),
                DecodeError::TopicMismatch,
                "{topic}"
            );
        }
        // More metrics than the bound: refused before any is decoded.
        let many: Vec<u8> =
            std::iter::repeat_n([0x12u8, 0x00], crate::limits::SPARKPLUG_METRICS_MAX + 1)
                .flatten()
                .collect();
        let mut c = ctx();
        c.max_payload_bytes = 1 << 20;
        let r = decode_with(
            &sub(),
            b"spBv1.0/g/NDATA/n",
            &many,
            &c,
            &mut births,
            &mut Decoded::default(),
        );
        assert_eq!(r, Err(DecodeError::InvalidSparkplug));
        let compressed = Payload {
            uuid: Some("SPBV1.0_COMPRESSED".into()),
            ..Payload::default()
        }
        .encode_to_vec();
        assert_eq!(
            at(&mut births, "spBv1.0/g/NDATA/n", &compressed, NOW_S).unwrap_err(),
            DecodeError::InvalidSparkplug
        );
        let late = payload(
            Some(u64::MAX),
            vec![metric(Some("x"), None, Some(10), Some(Value::Double(1.0)))],
        );
        assert_eq!(
            at(&mut births, "spBv1.0/g/NDATA/n", &late, NOW_S)
                .unwrap()
                .rejected,
            [DecodeError::InvalidTimestamp]
        );
        // A value of the wrong kind for its datatype is no number.
        let wrong = payload(
            Some(MS),
            vec![metric(Some("x"), None, Some(9), Some(Value::Double(1.0)))],
        );
        assert_eq!(
            at(&mut births, "spBv1.0/g/NDATA/n", &wrong, NOW_S)
                .unwrap()
                .rejected,
            [DecodeError::NotNumeric]
        );
    }

    /// An NBIRTH of `n` Double metrics `m0..` with aliases from `first`, and `bdSeq`.
    fn big_birth(n: u64, first: u64, bd_seq: u64) -> Vec<u8> {
        let mut metrics = vec![metric(
            Some("bdSeq"),
            None,
            Some(8),
            Some(Value::Long(bd_seq)),
        )];
        metrics.extend((0..n).map(|i| {
            metric(
                Some(&format!("m{i}")),
                Some(first + i),
                Some(10),
                Some(Value::Double(1.0)),
            )
        }));
        payload(Some(MS), metrics)
    }

    /// An NDEATH of the session `bd_seq`.
    fn death(bd_seq: u64) -> Vec<u8> {
        payload(
            None,
            vec![metric(
                Some("bdSeq"),
                None,
                Some(8),
                Some(Value::Long(bd_seq)),
            )],
        )
    }

    fn big_ctx() -> DecodeContext {
        let mut c = ctx();
        c.max_payload_bytes = 1 << 20;
        c
    }

    fn decode_big(births: &mut Births, topic: &str, body: &[u8]) -> Decoded {
        let mut out = Decoded::default();
        decode_with(&sub(), topic.as_bytes(), body, &big_ctx(), births, &mut out).unwrap();
        out
    }

    /// DATA of aliases `aliases` (Double 2.0).
    fn data_of(aliases: impl IntoIterator<Item = u64>) -> Vec<u8> {
        payload(
            Some(MS),
            aliases
                .into_iter()
                .map(|a| metric(None, Some(a), None, Some(Value::Double(2.0))))
                .collect(),
        )
    }

    /// What births teach is bounded per node and in all: a node's births past its share keep
    /// what fit and its DATA by the rest is refused (`birth_store_full`), its readings by name
    /// still kept; four nodes of 3,000 aliased metrics (the attack) leave a fifth node room for
    /// all it names; a death gives the room back.
    #[test]
    fn what_births_teach_is_bounded_per_node_and_in_all() {
        use crate::limits::{SPARKPLUG_NAMES_MAX, SPARKPLUG_NODE_NAMES_MAX};
        let mut births = Births::default();
        for hog in 0..4 {
            let out = decode_big(
                &mut births,
                &format!("spBv1.0/g/NBIRTH/hog{hog}"),
                &big_birth(3000, 1, 0),
            );
            assert_eq!(
                out.readings().len(),
                3001,
                "a birth's readings count past the bound"
            );
            let refused = decode_big(
                &mut births,
                &format!("spBv1.0/g/NDATA/hog{hog}"),
                &data_of([2999]),
            );
            assert_eq!(
                refused.rejected,
                [DecodeError::BirthStoreFull],
                "refused alone, counted"
            );
            assert!(
                refused.rebirth.is_none(),
                "not asked again: it would not fit again"
            );
        }
        let (_, kept) = births.held();
        // Each its share (a name and an alias a metric: the last pair may not fit).
        assert!(
            (4 * (SPARKPLUG_NODE_NAMES_MAX - 1)..=4 * SPARKPLUG_NODE_NAMES_MAX).contains(&kept)
        );
        assert!(kept < SPARKPLUG_NAMES_MAX);
        // A new, honest node: all 20 readings by alias kept.
        decode_big(&mut births, "spBv1.0/g/NBIRTH/honest", &big_birth(20, 1, 0));
        let d = decode_big(&mut births, "spBv1.0/g/NDATA/honest", &data_of(1..=20));
        assert_eq!(d.readings().len(), 20);
        assert!(d.rejected.is_empty());
        // A death (of the current session) gives the room back.
        let death = death(0);
        decode_big(&mut births, "spBv1.0/g/NDEATH/hog0", &death);
        assert_eq!(
            births.held().1,
            kept + 41 - kept / 4,
            "the node's share back"
        );
        let long = "x".repeat(crate::reading::NAME_BYTES_MAX + 1);
        let too_long = payload(
            Some(MS),
            vec![metric(
                Some(&long),
                Some(1),
                Some(10),
                Some(Value::Double(1.0)),
            )],
        );
        let before = births.held().1;
        at(&mut births, "spBv1.0/g/NBIRTH/long", &too_long, NOW_S).unwrap();
        assert_eq!(
            births.held().1,
            before,
            "a name no series could have is not kept"
        );
    }

    /// Edge node places: entries that hold no births (left by DATA that named none: the
    /// invented-node attack) give way to a new node, least recently used first; when every
    /// place holds births, a new node's DATA is refused and counted, not asked again.
    #[test]
    fn invented_nodes_do_not_keep_a_real_one_out() {
        use crate::limits::SPARKPLUG_NODES_MAX;
        let mut births = Births::default();
        // Ten a second: within the rebirth requests all nodes may have, so each is asked and
        // leaves an entry.
        for node in 0..SPARKPLUG_NODES_MAX + 10 {
            let t = NOW_S + node as i64 / 10;
            let d = at(
                &mut births,
                &format!("spBv1.0/g/NDATA/fake{node}"),
                &data_of([7]),
                t,
            )
            .unwrap();
            assert_eq!(d.rejected, [DecodeError::UnknownAlias]);
            assert!(d.rebirth.is_some());
        }
        assert_eq!(births.held().0, SPARKPLUG_NODES_MAX);
        at(
            &mut births,
            "spBv1.0/g/NBIRTH/real",
            &big_birth(20, 1, 0),
            NOW_S,
        )
        .unwrap();
        let d = at(&mut births, "spBv1.0/g/NDATA/real", &data_of(1..=20), NOW_S).unwrap();
        assert_eq!(d.readings().len(), 20, "{:?}", d.rejected);
        // Every place holding births: the next new node is refused, counted.
        for node in 0..SPARKPLUG_NODES_MAX {
            at(
                &mut births,
                &format!("spBv1.0/g/NBIRTH/b{node}"),
                &big_birth(1, 1, 0),
                NOW_S,
            )
            .unwrap();
        }
        assert_eq!(births.held().0, SPARKPLUG_NODES_MAX);
        let d = at(&mut births, "spBv1.0/g/NDATA/late", &data_of([1]), NOW_S).unwrap();
        assert_eq!(d.rejected, [DecodeError::BirthStoreFull]);
        assert!(d.rebirth.is_none());
    }

    /// The rebirth limit holds across deaths and births: 200 spoofed NDEATH + unknown-alias
    /// NDATA pairs, or an honest node whose every NBIRTH lacks an alias it sends, get one
    /// request per interval; requests to all nodes together are bounded too.
    #[test]
    fn the_rebirth_limit_survives_deaths_and_births() {
        use crate::limits::{SPARKPLUG_REBIRTHS_BURST, SPARKPLUG_REBIRTHS_PER_SEC};
        let mut births = Births::default();
        at(
            &mut births,
            "spBv1.0/g/NBIRTH/n",
            &big_birth(2, 1, 3),
            NOW_S,
        )
        .unwrap();
        let death = death(3);
        let mut asked = 0;
        for i in 0..200 {
            at(&mut births, "spBv1.0/g/NDEATH/n", &death, NOW_S + i / 100).unwrap();
            let d = at(
                &mut births,
                "spBv1.0/g/NDATA/n",
                &data_of([9]),
                NOW_S + i / 100,
            )
            .unwrap();
            asked += usize::from(d.rebirth.is_some());
            // The node answers with its NBIRTH, which lacks alias 9.
            at(
                &mut births,
                "spBv1.0/g/NBIRTH/n",
                &big_birth(2, 1, 3),
                NOW_S + i / 100,
            )
            .unwrap();
        }
        assert_eq!(
            asked, 1,
            "once per rebirth_interval, deaths and births notwithstanding"
        );
        let d = at(&mut births, "spBv1.0/g/NDATA/n", &data_of([9]), NOW_S + 60).unwrap();
        assert!(d.rebirth.is_some(), "again after the interval");
        // 3,000 invented nodes within two seconds: the burst and two seconds' refill at most.
        let mut sent = 0;
        for node in 0..3000 {
            let t = NOW_S + 100 + node / 1500;
            let d = at(
                &mut births,
                &format!("spBv1.0/g/NDATA/x{node}"),
                &data_of([1]),
                t,
            )
            .unwrap();
            sent += u32::from(d.rebirth.is_some());
        }
        assert!(
            sent <= SPARKPLUG_REBIRTHS_BURST + SPARKPLUG_REBIRTHS_PER_SEC,
            "{sent}"
        );
        assert!(sent >= SPARKPLUG_REBIRTHS_BURST, "{sent}");
    }

    /// A death certificate is honoured only for the session it names (bdSeq); a DBIRTH whose
    /// alias names another metric of the node is refused, the node's readings unchanged; a
    /// missed `seq` asks for a rebirth.
    #[test]
    fn control_messages_change_only_the_state_they_name() {
        let mut births = Births::default();
        at(
            &mut births,
            "spBv1.0/g/NBIRTH/n",
            &big_birth(5, 1, 5),
            NOW_S,
        )
        .unwrap();
        let stale = death(4);
        let d = at(&mut births, "spBv1.0/g/NDEATH/n", &stale, NOW_S).unwrap();
        assert_eq!(d.rejected, [DecodeError::StaleDeath]);
        assert_eq!(d.readings().len(), 0, "no offline mark");
        let d = at(&mut births, "spBv1.0/g/NDATA/n", &data_of(1..=5), NOW_S).unwrap();
        assert_eq!(d.readings().len(), 5, "the live session's aliases kept");
        // A device birth reusing the node's alias 1: refused whole, alias 1 still the node's.
        let dbirth = payload(
            Some(MS),
            vec![
                metric(Some("other"), Some(1), Some(10), Some(Value::Double(7.0))),
                metric(Some("fine"), Some(77), Some(10), Some(Value::Double(7.0))),
            ],
        );
        let d = at(&mut births, "spBv1.0/g/DBIRTH/n/dev", &dbirth, NOW_S).unwrap();
        assert_eq!(d.rejected, [DecodeError::AliasConflict; 2]);
        assert_eq!(d.readings().len(), 0);
        let d = at(&mut births, "spBv1.0/g/NDATA/n", &data_of([1]), NOW_S).unwrap();
        assert_eq!(got(&d)[0].0, "g:n/m0");
        // A device's DATA cannot borrow the node's alias either.
        let d = at(&mut births, "spBv1.0/g/DDATA/n/dev", &data_of([1]), NOW_S).unwrap();
        assert_eq!(d.rejected, [DecodeError::UnknownAlias]);
        // seq: the NBIRTH's 0, then 1, then 3: one missed, a rebirth asked (the interval's
        // first: the DDATA above asked already, so move past it).
        let mut births = Births::default();
        let with_seq = |seq: u64, body: Vec<u8>| {
            let mut p = Payload::decode(&body[..]).unwrap();
            p.seq = Some(seq);
            p.encode_to_vec()
        };
        at(
            &mut births,
            "spBv1.0/g/NBIRTH/s",
            &with_seq(0, big_birth(1, 1, 0)),
            NOW_S,
        )
        .unwrap();
        let d = at(
            &mut births,
            "spBv1.0/g/NDATA/s",
            &with_seq(1, data_of([1])),
            NOW_S,
        )
        .unwrap();
        assert!(d.rebirth.is_none());
        let d = at(
            &mut births,
            "spBv1.0/g/NDATA/s",
            &with_seq(3, data_of([1])),
            NOW_S,
        )
        .unwrap();
        assert!(d.rebirth.is_some(), "seq 2 missed");
        assert_eq!(d.readings().len(), 1, "the message itself is read");
        let d = at(
            &mut births,
            "spBv1.0/g/NDATA/s",
            &with_seq(4, data_of([1])),
            NOW_S,
        )
        .unwrap();
        assert!(d.rebirth.is_none());
        let d = at(
            &mut births,
            "spBv1.0/g/NDATA/s",
            &with_seq(0, data_of([1])),
            NOW_S + 61,
        )
        .unwrap();
        assert!(d.rebirth.is_some(), "4 then 0 misses 5..=255");
    }

    /// Ids holding the separator stay apart: `:` and `%` are escaped in the sensor, ids
    /// without them named as before.
    #[test]
    fn ids_with_the_separator_do_not_collide() {
        let mut births = Births::default();
        let one = |births: &mut Births, topic: &str| {
            got(&at(births, topic, &birth_of("v"), NOW_S).unwrap())
                .into_iter()
                .map(|r| r.0)
                .filter(|s| s.ends_with("/v"))
                .collect::<Vec<_>>()
        };
        assert_eq!(one(&mut births, "spBv1.0/c9:b/NBIRTH/c"), ["c9%3Ab:c/v"]);
        assert_eq!(one(&mut births, "spBv1.0/c9/NBIRTH/b:c"), ["c9:b%3Ac/v"]);
        assert_eq!(one(&mut births, "spBv1.0/g/NBIRTH/N17:D"), ["g:N17%3AD/v"]);
        assert_eq!(one(&mut births, "spBv1.0/g/DBIRTH/N17/D"), ["g:N17:D/v"]);
        assert_eq!(one(&mut births, "spBv1.0/g/NBIRTH/50%"), ["g:50%25/v"]);
        assert_eq!(
            one(&mut births, "spBv1.0/plant/NBIRTH/edge-1"),
            ["plant:edge-1/v"]
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: fuzz_cases(), ..ProptestConfig::default() })]

        /// Sparkplug by shape: random wire bytes after a valid prefix, aliases out of range,
        /// huge counts; never a panic, only valid readings, the births bounded.
        #[test]
        fn sparkplug_shapes_yield_only_valid_readings(
            metrics in prop::collection::vec(
                (prop::option::of("[a-z/]{0,3}"), prop::option::of(0u64..4), prop::option::of(0u32..25), 0u8..6, any::<u64>()),
                0..20,
            ),
            tail in prop::collection::vec(any::<u8>(), 0..16),
            kind in prop::sample::select(&["NBIRTH", "NDATA", "DBIRTH", "DDATA", "NDEATH"][..]),
        ) {
            let mut births = Births::default();
            let metrics = metrics.into_iter().map(|(name, alias, datatype, v, bits)| {
                let value = match v {
                    0 => None,
                    1 => Some(Value::Int(bits as u32)),
                    2 => Some(Value::Long(bits)),
                    3 => Some(Value::Float(f32::from_bits(bits as u32))),
                    4 => Some(Value::Double(f64::from_bits(bits))),
                    _ => Some(Value::Boolean(bits & 1 == 1)),
                };
                Metric { timestamp: Some(MS - bits % 1000), ..metric(name.as_deref(), alias, datatype, value) }
            }).collect();
            let mut body = payload(Some(MS), metrics);
            body.extend(tail);
            let device = if kind.starts_with('D') { "/dev" } else { "" };
            let topic = format!("spBv1.0/g/{kind}/n{device}");
            let c = ctx();
            let mut out = Decoded::default();
            let result = decode_with(&sub(), topic.as_bytes(), &body, &c, &mut births, &mut out);
            check_decoded(result, &out, &c);
            prop_assert!(births.held().0 <= 1);
        }
    }
}

/// A SenML or Sparkplug metric name's `/` become `.`, every one, wherever it is.
#[test]
fn slashes_become_dots_in_metric_names() {
    let mut into = String::from("left over");
    for (name, want) in [
        ("temp", "temp"),
        ("Inputs/Temp", "Inputs.Temp"),
        ("a//b/", "a..b."),
        ("/", "."),
        ("", ""),
        ("ä/ö", "ä.ö"),
    ] {
        slashes_to_dots(name, &mut into);
        assert_eq!(into, want, "{name}");
    }
}
