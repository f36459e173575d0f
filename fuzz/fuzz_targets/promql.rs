//! PromQL text from an HTTP client: the expression, series selector, time and duration parsers
//! must refuse what they cannot read, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = bucketd::promql::parse(text);
    let _ = bucketd::promql::parse_series_selector(text);
    let _ = bucketd::promql::parse_time(text);
    let _ = bucketd::promql::parse_duration(text);
});
