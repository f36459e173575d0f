//! A message in any payload format: the first byte picks the format, the rest is the payload.
//! No input may panic; every reading decoded must be finite, within the accepted times and
//! named as the API accepts. Sparkplug's payload is read as a DBIRTH, then as a DDATA naming
//! what the birth taught (aliases), with births of its own (a run does not depend on the last).
#![no_main]

use std::sync::OnceLock;

use bucketd::config::{Config, Subscription};
use bucketd::decode::{Births, DecodeContext, Decoded, Format, Template, decode_with};
use bucketd::reading::{Timestamp, validate_series};
use libfuzzer_sys::fuzz_target;

const NOW_S: i64 = 1_763_719_200;

/// Each format's subscription and the topic a message of it comes on.
fn cases() -> &'static [(Subscription, &'static [u8])] {
    static CASES: OnceLock<Vec<(Subscription, &'static [u8])>> = OnceLock::new();
    CASES.get_or_init(|| {
        let base = Config::load(None, Vec::new()).unwrap().subscriptions[1].clone();
        let with = |format: Format, filter: &str, template: &str| {
            let mut s = base.clone();
            s.format = format;
            s.filter = filter.into();
            s.template = Template::parse(template).unwrap();
            s.timestamp_field = None;
            s
        };
        let mut json = with(
            Format::Json,
            "devices/+/telemetry",
            "devices/{sensor}/telemetry",
        );
        json.timestamp_field = Some("ts".into());
        vec![
            (
                with(Format::Value, "sensors/+/+", "sensors/{sensor}/{metric}"),
                b"sensors/s1/temp".as_slice(),
            ),
            (json, b"devices/s1/telemetry"),
            (
                with(Format::Influx, "telegraf/#", "telegraf/#"),
                b"telegraf/s1",
            ),
            (
                with(Format::Senml, "senml/+", "senml/{sensor}"),
                b"senml/s1",
            ),
            (
                with(Format::SparkplugB, "spBv1.0/#", "spBv1.0/#"),
                b"spBv1.0/plant/DBIRTH/edge1/s1",
            ),
            (
                with(
                    Format::Delta,
                    "bucketd/+/deltas",
                    "bucketd/{gateway}/deltas",
                ),
                b"bucketd/gw-1/deltas",
            ),
        ]
    })
}

fn check(out: &Decoded, ctx: &DecodeContext) {
    for r in out.readings() {
        assert!(r.value.is_finite(), "{} {}", r.series, r.value);
        assert!(r.ts >= ctx.oldest && r.ts <= ctx.newest, "{}", r.series);
        assert!(validate_series(r.series).is_ok(), "{:?}", r.series);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, payload)) = data.split_first() else {
        return;
    };
    let cases = cases();
    let (sub, topic) = &cases[usize::from(pick) % cases.len()];
    let ctx = DecodeContext {
        received: Timestamp::from_secs(NOW_S),
        oldest: Timestamp::from_secs(NOW_S - 30 * 86_400),
        newest: Timestamp::from_secs(NOW_S + 600),
        max_payload_bytes: 1 << 20,
    };
    let mut births = Births::default();
    let mut out = Decoded::default();
    if decode_with(sub, topic, payload, &ctx, &mut births, &mut out).is_ok() {
        check(&out, &ctx);
    }
    if sub.format == Format::SparkplugB {
        let data_topic = b"spBv1.0/plant/DDATA/edge1/s1";
        if decode_with(sub, data_topic, payload, &ctx, &mut births, &mut out).is_ok() {
            check(&out, &ctx);
        }
    }
});
