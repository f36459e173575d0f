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
    d.readings
        .into_iter()
        .map(|r| (r.series, r.ts.as_nanos(), r.value))
        .collect()
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
    let n = |v: serde_json::Value, unit| parse_timestamp(&v, unit).map(Timestamp::as_nanos);
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
    assert_eq!(d.readings.len(), 1);

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
    assert!(d.readings.is_empty());
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
    assert_eq!(t.capture("site/x/s1/t"), Some((Some("s1"), Some("t"))));
    assert_eq!(t.capture("other/x/s1/t"), None);
    assert_eq!(t.capture("site/x/s1"), None);
    assert_eq!(t.capture("site/x/s1/t/u"), None);
    let rest = Template::parse("a/{sensor}/#").unwrap();
    assert_eq!(rest.capture("a/s/b/c"), Some((Some("s"), None)));
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
fn strings_booleans_and_nulls_are_not_readings() {
    let s = &subs()[1];
    let t = "devices/d/telemetry";
    // A number sent as a string is not a metric: only numeric fields are (DESIGN.md).
    for payload in [
        r#"{"temperature": "21.5"}"#,
        r#"{"on": true, "off": false}"#,
        r#"{"x": null}"#,
        r#"{"nested": {"temperature": 1}}"#,
        r#"{"list": [1, 2]}"#,
    ] {
        assert_eq!(
            run(s, t, payload.as_bytes()).unwrap_err(),
            DecodeError::NoReadings,
            "{payload}"
        );
    }
    let d = run(s, t, br#"{"temperature": "21.5", "humidity": 40}"#).unwrap();
    assert_eq!(d.readings.len(), 1, "the numeric field still counts");
    // Huge but finite numbers are readings, exactly.
    let d = run(
        s,
        t,
        br#"{"a": 1.7976931348623157e308, "b": -18446744073709551616}"#,
    )
    .unwrap();
    assert_eq!(d.readings[0].value, f64::MAX);
    assert_eq!(d.readings[1].value, -18_446_744_073_709_551_616.0);
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
        assert!(d.readings.is_empty(), "{payload}");
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
        assert!(!out.readings.is_empty() || !out.rejected.is_empty());
        for r in &out.readings {
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
        s.template = Template::parse("bucketd/+/deltas").unwrap();
        s.format = Format::Delta;
        s.sensor_field = None;
    })
}

fn delta_payload(gateway: &str, series: &str, summary: &crate::summary::Summary) -> Vec<u8> {
    bson::serialize_to_vec(&DeltaMessage {
        gateway_id: gateway.into(),
        origin: "2026-11-22T12:00:00.000Z".into(),
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
    assert!(d.readings.is_empty());
    assert_eq!(d.deltas.len(), 1);
    assert_eq!(d.deltas[0].series, "gw-1:d0/t");
    assert_eq!((d.deltas[0].start, d.deltas[0].width_secs), (NOW_S, 3600));
    assert_eq!(d.deltas[0].summary.count, 2);
    assert_eq!(d.deltas[0].summary.max, 4.0);
    let position = crate::delta::Position {
        origin: "2026-11-22T12:00:00.000Z".into(),
        seq: 7,
        part: 0,
    };
    assert_eq!(d.delta_from, Some(("gw-1".into(), position.clone())));
    assert_eq!(
        crate::delta::delta_position(&delta_payload("gw-1", "d0/t", &s)),
        Some(("gw-1".into(), position))
    );
    assert_eq!(crate::delta::delta_position(b"21.5"), None);
}

#[test]
fn a_bad_delta_message_is_rejected_with_its_reason() {
    let s = crate::summary::Summary::of(NOW_NS, 1.5);
    let sub = delta_sub();
    let cases: [(&[u8], DecodeError); 4] = [
        (b"{\"not\": \"bson\"}", DecodeError::InvalidDelta),
        (&delta_payload("gw/1", "d0/t", &s), DecodeError::InvalidName),
        (
            &bson::serialize_to_vec(&DeltaMessage {
                gateway_id: "gw-1".into(),
                origin: String::new(),
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
                origin: String::new(),
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
