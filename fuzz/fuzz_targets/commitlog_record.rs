//! A commit log record as the journal or the `log` table hands it back (a record whose
//! checksum holds may still be one no bucketd wrote): parsing it, walking its entries and
//! reading each one's summary and raw readings must not panic.
#![no_main]

use bucketd::commitlog::Record;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(record) = Record::parse(data) else {
        return;
    };
    let mut raw = Vec::new();
    for entry in record.entries() {
        let Ok(entry) = entry else {
            break;
        };
        let _ = entry.raw_count();
        if let Ok(summary) = entry.summary() {
            let _ = entry.onto(Some(summary));
        }
        raw.clear();
        let _ = entry.raw_into(&mut raw);
    }
});
