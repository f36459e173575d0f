//! A stored or received quantile sketch: an untrusted one decodes within its own bounds, and
//! what decodes answers quantiles, merges and encodes again without panicking.
#![no_main]

use bucketd::sketch::Sketch;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(sketch) = Sketch::decode_untrusted(data) else {
        return;
    };
    assert!(sketch.bins() <= sketch.params().max_bins as usize);
    for q in [0.0, 0.5, 0.99, 1.0] {
        let _ = sketch.quantile(q);
    }
    let mut merged = Sketch::new(sketch.params());
    merged.merge(&sketch);
    merged.merge(&sketch);
    assert_eq!(merged.count(), sketch.count().saturating_mul(2));
    let again = Sketch::decode_untrusted(&sketch.encode()).expect("what it encodes decodes");
    assert_eq!(again.count(), sketch.count());
});
