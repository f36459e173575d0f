//! Bytes on disk per raw reading, measured in one run for the same readings:
//! 1. bucketd's pages (delta-of-delta timestamps, decimal/XOR values) in the real store;
//! 2. the same store with raw storage off (bucket summaries only), to isolate the raw cost;
//! 3. the same readings as plain BSON arrays (`{ts: [..], value: [..]}` per page of 1000) in a
//!    redb table with the same keys and the same commit pattern.
//!
//! Signal: a temperature sensor reporting every second for a day, 21 °C ± noise, one decimal,
//! as devices send it; a commit every 60 s (the same for all three).
//!
//! `cargo bench --bench storage_size`

use std::sync::Arc;
use std::time::Instant;

use bucketd::batcher::{Batch, Batcher};
use bucketd::config::Durability;
use bucketd::doc::PageDoc;
use bucketd::reading::Timestamp;
use bucketd::store::{Store, StoreSettings};
use redb::{ReadableDatabase, TableDefinition};

const SECONDS: i64 = 86_400;
const COMMIT_EVERY: i64 = 60;
const PAGE: usize = 1000;

fn readings() -> Vec<(i64, f64)> {
    let t0 = 1_763_683_200i64; // midnight UTC
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut temp = 21.0f64;
    (0..SECONDS)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // A slow daily swing plus sensor noise, rounded to the sensor's 0.1 °C.
            let swing = 2.0 * (i as f64 / SECONDS as f64 * std::f64::consts::TAU).sin();
            let noise = ((x % 7) as f64 - 3.0) * 0.05;
            temp = 0.9 * temp + 0.1 * (21.0 + swing + noise);
            ((t0 + i) * 1_000_000_000, (temp * 10.0).round() / 10.0)
        })
        .collect()
}

fn batch(chunk: &[(i64, f64)], raw: bool) -> Batch {
    let mut b = Batcher::by_hand();
    let series: Arc<str> = Arc::from("greenhouse/temperature");
    let now = Instant::now();
    for &(ts, v) in chunk {
        b.push_reading(series.clone(), Timestamp::from_nanos(ts), v, raw, now);
    }
    b.take().0
}

fn store_size(path: &std::path::Path, data: &[(i64, f64)], raw: bool) -> u64 {
    let mut store = Store::open(&StoreSettings {
        path: path.to_owned(),
        bucket_width_secs: 3600,
        durability: Durability::Immediate,
        quick_repair: true,
        cache_bytes: 4 << 20,
        page_capacity: PAGE as u32,
        dedup_window: 8192,
        outbox_max_entries: 0,
        journal_bytes: 8 << 20,
    })
    .unwrap();
    for chunk in data.chunks(COMMIT_EVERY as usize) {
        store.commit(&batch(chunk, raw)).unwrap();
    }
    drop(store);
    std::fs::metadata(path).unwrap().len()
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ArrayPage {
    schema_version: i32,
    ts: Vec<i64>,
    value: Vec<f64>,
}

const ARRAYS: TableDefinition<(u64, i64, u32), &[u8]> = TableDefinition::new("pages");

/// The same readings as BSON array pages, appended the way bucketd appends its pages.
fn arrays_size(path: &std::path::Path, data: &[(i64, f64)]) -> u64 {
    let db = redb::Builder::new()
        .set_cache_size(4 << 20)
        .create(path)
        .unwrap();
    let mut page_no = 0u32;
    let mut open: Vec<(i64, f64)> = Vec::new();
    for chunk in data.chunks(COMMIT_EVERY as usize) {
        let mut tx = db.begin_write().unwrap();
        tx.set_durability(redb::Durability::Immediate).unwrap();
        tx.set_quick_repair(true);
        {
            let mut t = tx.open_table(ARRAYS).unwrap();
            for &r in chunk {
                if open.len() == PAGE {
                    open.clear();
                    page_no += 1;
                }
                open.push(r);
            }
            let doc = ArrayPage {
                schema_version: 1,
                ts: open.iter().map(|r| r.0).collect(),
                value: open.iter().map(|r| r.1).collect(),
            };
            let bytes = bson::serialize_to_vec(&doc).unwrap();
            t.insert((0, 0, page_no), bytes.as_slice()).unwrap();
        }
        tx.commit().unwrap();
    }
    let tx = db.begin_read().unwrap();
    drop(tx);
    drop(db);
    std::fs::metadata(path).unwrap().len()
}

fn main() {
    let data = readings();
    let n = data.len() as f64;
    let dir = tempfile::tempdir().unwrap();
    let with_raw = store_size(&dir.path().join("raw.redb"), &data, true);
    let summaries = store_size(&dir.path().join("summaries.redb"), &data, false);
    let arrays = arrays_size(&dir.path().join("arrays.redb"), &data);
    let empty = {
        let p = dir.path().join("empty.redb");
        drop(redb::Database::create(&p).unwrap());
        std::fs::metadata(&p).unwrap().len()
    };

    // Encoded page documents alone, for a full page of 1000 readings.
    let page = bson::serialize_to_vec(&PageDoc::of(&data[..PAGE]))
        .unwrap()
        .len();
    let array_page = bson::serialize_to_vec(&ArrayPage {
        schema_version: 1,
        ts: data[..PAGE].iter().map(|r| r.0).collect(),
        value: data[..PAGE].iter().map(|r| r.1).collect(),
    })
    .unwrap()
    .len();

    println!(
        "signal: {} readings (1/s for a day, 0.1 °C steps), a commit every {COMMIT_EVERY} s, pages of {PAGE}",
        data.len()
    );
    println!(
        "page document, 1000 readings: bucketd {page} B ({:.2} B/reading), BSON arrays {array_page} B ({:.2} B/reading), ratio {:.1}x",
        page as f64 / PAGE as f64,
        array_page as f64 / PAGE as f64,
        array_page as f64 / page as f64
    );
    println!("file, bucketd with raw pages:   {with_raw} B");
    println!("file, bucketd summaries only:   {summaries} B");
    println!("file, BSON array pages:         {arrays} B (empty redb file: {empty} B)");
    let per_reading = |raw: u64, base: u64| raw.saturating_sub(base) as f64 / n;
    let (ours, theirs) = (per_reading(with_raw, summaries), per_reading(arrays, empty));
    println!(
        "on disk per raw reading: bucketd {ours:.2} B, BSON arrays {theirs:.2} B, ratio {:.1}x",
        theirs / ours.max(f64::MIN_POSITIVE)
    );
    // The files keep their high-water mark; compaction shows what the data itself occupies.
    let compacted = |name: &str| bucketd::store::compact(&dir.path().join(name)).unwrap().1;
    let (with_raw, summaries, arrays) = (
        compacted("raw.redb"),
        compacted("summaries.redb"),
        compacted("arrays.redb"),
    );
    let (ours, theirs) = (per_reading(with_raw, summaries), per_reading(arrays, empty));
    println!(
        "after compaction: {with_raw} / {summaries} / {arrays} B; per raw reading: bucketd {ours:.2} B, \
         BSON arrays {theirs:.2} B, ratio {:.1}x",
        theirs / ours.max(f64::MIN_POSITIVE)
    );
}
