use proptest::prelude::*;

use super::*;

/// A bucket's delta as the batcher builds it: readings folded in arrival order.
fn fold(readings: &[(i64, f64)], params: SketchParams) -> Summary {
    let mut s = Summary::with_params(readings[0].0, readings[0].1, params);
    for &(ts, v) in &readings[1..] {
        s.push(ts, v);
    }
    s
}

fn reading() -> impl Strategy<Value = (i64, f64)> {
    (
        any::<i64>(),
        prop_oneof![-1e6f64..1e6, Just(0.0), Just(-0.0), Just(f64::MAX)],
    )
}

/// A reading as devices send them: a whole number of milliseconds into its bucket, a value of
/// two decimals (version 2 codes them short).
fn device_reading(start: i64) -> impl Strategy<Value = (i64, f64)> {
    (0i64..3_600_000, -100_000i64..100_000).prop_map(move |(ms, n)| {
        (
            base_ns(start).wrapping_add(ms * 1_000_000),
            n as f64 / 100.0,
        )
    })
}

/// (series id, start, readings, kept raw, readings folded into a summary from elsewhere).
type Case = (u64, i64, Vec<(i64, f64)>, bool, bool);

fn case() -> impl Strategy<Value = Case> {
    (any::<u64>(), any::<i64>(), any::<bool>()).prop_flat_map(|(id, start, device)| {
        let readings = if device {
            prop::collection::vec(device_reading(start).boxed(), 1..20).boxed()
        } else {
            prop::collection::vec(reading().boxed(), 1..20).boxed()
        };
        (
            Just(id),
            Just(start),
            readings,
            any::<bool>(),
            any::<bool>(),
        )
    })
}

proptest! {
    /// Every entry comes back bit for bit: its summary (folded again for the readings form,
    /// stored for the others) and its raw readings in arrival order.
    #[test]
    fn records_round_trip(mut cases in prop::collection::vec(case(), 0..12)) {
        cases.sort_by_key(|c| (c.0, c.1));
        cases.dedup_by_key(|c| (c.0, c.1));
        let params = SketchParams::DEFAULT;
        let summaries: Vec<Summary> = cases
            .iter()
            .map(|(_, _, readings, _, merged)| {
                let mut s = fold(readings, params);
                if *merged {
                    // A delta merged in: the raw readings are no longer all of the summary.
                    s.merge(&Summary::with_params(5, 1.5, params));
                }
                s
            })
            .collect();
        let entries: Vec<EntryIn<'_>> = cases
            .iter()
            .zip(&summaries)
            .map(|((id, start, readings, raw, _), s)| EntryIn {
                series_id: *id,
                start: *start,
                summary: s,
                raw: raw.then_some(readings.as_slice()),
            })
            .collect();
        let mut bytes = Vec::new();
        encode(&entries, params, &mut bytes);
        let record = Record::parse(&bytes).unwrap();
        let back: Vec<Entry<'_>> = record.entries().collect::<Result<_, _>>().unwrap();
        prop_assert_eq!(back.len(), entries.len());
        for (got, want) in back.iter().zip(&entries) {
            prop_assert_eq!((got.series_id, got.start), (want.series_id, want.start));
            prop_assert_eq!(&got.summary().unwrap(), want.summary);
            let mut raw = Vec::new();
            got.raw_into(&mut raw).unwrap();
            let want_raw = want.raw.unwrap_or(&[]);
            prop_assert_eq!(raw.len(), want_raw.len());
            for (a, b) in raw.iter().zip(want_raw) {
                prop_assert_eq!((a.0, a.1.to_bits()), (b.0, b.1.to_bits()));
            }
            prop_assert_eq!(got.has_raw(), want.raw.is_some());
        }
    }

    /// A damaged record (cut short or with a changed byte) is an error, never a panic.
    #[test]
    fn damaged_records_are_errors_not_panics(
        cases in prop::collection::vec(case(), 1..6),
        cut in any::<prop::sample::Index>(),
        flip in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let params = SketchParams::DEFAULT;
        let summaries: Vec<Summary> = cases.iter().map(|c| fold(&c.2, params)).collect();
        let entries: Vec<EntryIn<'_>> = cases
            .iter()
            .zip(&summaries)
            .map(|(c, s)| EntryIn { series_id: c.0, start: c.1, summary: s, raw: c.3.then_some(c.2.as_slice()) })
            .collect();
        let mut bytes = Vec::new();
        encode(&entries, params, &mut bytes);
        // With the intact record's index too: a lookup through an index that does not fit
        // the bytes must end in an error or a wrong answer, never a panic.
        let mut sorted = cases.clone();
        sorted.sort_by_key(|c| (c.0, c.1));
        sorted.dedup_by_key(|c| (c.0, c.1));
        let index = (sorted.len() == cases.len() && sorted.iter().zip(&cases).all(|(a, b)| (a.0, a.1) == (b.0, b.1)))
            .then(|| RecordIndex::of(&bytes).unwrap());
        let touch = |b: &[u8]| {
            if let Ok(r) = Record::parse(b) {
                for e in r.entries() {
                    let Ok(e) = e else { break };
                    let _ = e.summary();
                    let _ = e.raw_into(&mut Vec::new());
                }
                for c in cases.iter().filter(|_| index.is_some()) {
                    for e in r.entries_of(index.as_ref().unwrap(), c.0) {
                        let Ok(e) = e else { break };
                        let _ = e.merge_into(&mut Summary::with_params(0, 1.0, params));
                    }
                }
            }
        };
        let short = &bytes[..cut.index(bytes.len())];
        touch(short);
        prop_assert!(
            Record::parse(short).is_err()
                || Record::parse(short).unwrap().entries().any(|e| e.is_err()),
            "a record cut short is reported"
        );
        let mut changed = bytes.clone();
        let at = flip.index(changed.len());
        changed[at] = byte;
        touch(&changed);
    }
}

#[test]
fn one_reading_costs_at_most_twenty_one_bytes_in_the_readings_form() {
    let params = SketchParams::DEFAULT;
    let hour = 1_763_719_200i64;
    let readings: Vec<Vec<(i64, f64)>> = (0..1000i64)
        .map(|i| vec![(hour * 1_000_000_000 + i * 3_599_999_999, 21.5)])
        .collect();
    let summaries: Vec<Summary> = readings.iter().map(|r| fold(r, params)).collect();
    let entries: Vec<EntryIn<'_>> = (0..1000)
        .map(|i| EntryIn {
            series_id: i as u64,
            start: hour,
            summary: &summaries[i],
            raw: Some(&readings[i]),
        })
        .collect();
    let mut bytes = Vec::new();
    encode(&entries, params, &mut bytes);
    // Per entry: id <= 2 + start 1 (5 for the first) + kind 1 + length 1 + count 1 + timestamp
    // <= 7 (42 bits of nanoseconds into the hour) + value 8; the header is 11.
    assert!(bytes.len() <= 21 * 1000 + 15, "{} bytes", bytes.len());
}

/// Issue 42: a gateway whose 200 sensors report once a second commits 200 buckets of one
/// reading each per commit. Version 1 took ~20 bytes per reading kept raw (nanosecond time,
/// f64 value, body framing) and ~85 for one not kept raw (a whole summary); version 2 codes
/// the time in the record's unit and the value as its decimal digits, with no framing for a
/// single reading: one journal page holds such a commit.
#[test]
fn a_single_device_reading_costs_a_few_bytes() {
    let params = SketchParams::DEFAULT;
    let hour = 1_763_719_200i64;
    for raw in [true, false] {
        let readings: Vec<Vec<(i64, f64)>> = (0..200i64)
            .map(|i| {
                let ms = 1_000 * 600 + i * 37;
                vec![(
                    hour * 1_000_000_000 + ms * 1_000_000,
                    (2000 + i) as f64 / 100.0,
                )]
            })
            .collect();
        let summaries: Vec<Summary> = readings.iter().map(|r| fold(r, params)).collect();
        let entries: Vec<EntryIn<'_>> = (0..200)
            .map(|i| EntryIn {
                series_id: i as u64,
                start: hour,
                summary: &summaries[i],
                raw: raw.then_some(readings[i].as_slice()),
            })
            .collect();
        let mut bytes = Vec::new();
        encode(&entries, params, &mut bytes);
        // Per entry: id 1-2, start 1 (5 for the first), kind 1, time 3 (ms into the hour),
        // value 2: 9 bytes; the header is 15.
        assert!(
            bytes.len() <= 9 * 200 + 20,
            "raw {raw}: {} bytes",
            bytes.len()
        );
        let back: Vec<Summary> = Record::parse(&bytes)
            .unwrap()
            .entries()
            .map(|e| e.unwrap().summary().unwrap())
            .collect();
        assert_eq!(back, summaries, "raw {raw}: bit for bit");
    }
}

/// A record of `entries` (series id, start) pairs, each one reading of its own.
fn record_of(keys: &[(u64, i64)]) -> Vec<u8> {
    let params = SketchParams::DEFAULT;
    let summaries: Vec<Summary> = keys
        .iter()
        .map(|&(id, start)| Summary::with_params(base_ns(start) + 1_000_000, id as f64, params))
        .collect();
    let entries: Vec<EntryIn<'_>> = keys
        .iter()
        .zip(&summaries)
        .map(|(&(series_id, start), summary)| EntryIn {
            series_id,
            start,
            summary,
            raw: None,
        })
        .collect();
    let mut bytes = Vec::new();
    encode(&entries, params, &mut bytes);
    bytes
}

proptest! {
    /// The index finds exactly the entries a pass over the whole record finds, for every
    /// series it holds and for series it does not (across seek points, many entries a series).
    #[test]
    fn an_index_finds_every_entry_of_a_series_and_no_other(
        mut keys in prop::collection::vec((0u64..300, -5i64..5), 0..400),
        absent in prop::collection::vec(300u64..100_000, 1..20),
    ) {
        keys.sort_unstable();
        keys.dedup();
        let keys: Vec<(u64, i64)> = keys.into_iter().map(|(id, h)| (id, h * 3600)).collect();
        let bytes = record_of(&keys);
        let record = Record::parse(&bytes).unwrap();
        let index = RecordIndex::of(&bytes).unwrap();
        prop_assert_eq!(index.entries() as usize, keys.len());
        let mut ids: Vec<u64> = keys.iter().map(|k| k.0).collect();
        ids.dedup();
        for id in ids.iter().copied().chain(absent) {
            let want: Vec<(u64, i64)> = keys.iter().copied().filter(|k| k.0 == id).collect();
            let got: Vec<(u64, i64)> = record
                .entries_of(&index, id)
                .map(|e| e.map(|e| (e.series_id, e.start)))
                .collect::<Result<_, _>>()
                .unwrap();
            prop_assert_eq!(got, want);
        }
    }

    /// An index is built only for a record in (series id, start) order, as records are
    /// written: one out of order is refused (its reader reads it whole), never half indexed.
    #[test]
    fn an_index_refuses_entries_out_of_order(
        mut keys in prop::collection::vec((0u64..50, 0i64..3), 2..60),
        swap in any::<prop::sample::Index>(),
    ) {
        keys.sort_unstable();
        keys.dedup();
        prop_assume!(keys.len() >= 2);
        let at = swap.index(keys.len() - 1);
        keys.swap(at, at + 1);
        prop_assert!(RecordIndex::of(&record_of(&keys)).is_err());
    }
}

/// Looking up a series a record does not hold decodes nothing most of the time: of 10,000 ids
/// absent from a record of 1,000 series, the filter lets through about 3% (5% at most), and
/// each of those decodes at most a seek interval's entries.
#[test]
fn an_index_passes_over_a_record_without_the_series() {
    let keys: Vec<(u64, i64)> = (0..1000).map(|id| (id * 7, 0)).collect();
    let bytes = record_of(&keys);
    let index = RecordIndex::of(&bytes).unwrap();
    let absent = (0..70_000u64).filter(|id| id % 7 != 0).take(10_000);
    let false_positives = absent.filter(|&id| index.may_hold(id)).count();
    assert!(
        false_positives < 500,
        "{false_positives} of 10,000 absent series may be held"
    );
    assert!(
        keys.iter().all(|k| index.may_hold(k.0)),
        "no false negative"
    );
    // The index beside the record: a seek point per 32 entries, a byte a series of filter.
    assert!(
        index.heap_bytes() * 2 < bytes.len(),
        "index {} bytes for a record of {}",
        index.heap_bytes(),
        bytes.len()
    );
}

proptest! {
    /// A single reading merged without its own summary gives the summary merging it would,
    /// bit for bit (readers and the checkpoint both merge this way, and a bucket must read the
    /// same before and after a checkpoint), whatever summary it lands on, at the record's
    /// accuracy or another.
    #[test]
    fn a_reading_merged_into_a_summary_is_its_summary_merged(
        base in prop::collection::vec(reading(), 1..30),
        one in reading(),
        start in -100i64..100,
        other_accuracy in any::<bool>(),
    ) {
        let params = SketchParams::DEFAULT;
        let base_params = if other_accuracy {
            SketchParams { alpha: 0.02, ..params }
        } else {
            params
        };
        let base = fold(&base, base_params);
        let delta = Summary::with_params(one.0, one.1, params);
        let mut bytes = Vec::new();
        encode(
            &[EntryIn { series_id: 1, start, summary: &delta, raw: None }],
            params,
            &mut bytes,
        );
        let record = Record::parse(&bytes).unwrap();
        let entry = record.entries().next().unwrap().unwrap();
        let mut want = base.clone();
        want.merge(&entry.summary().unwrap());
        let mut got = base.clone();
        entry.merge_into(&mut got).unwrap();
        prop_assert_eq!(format!("{got:?}"), format!("{want:?}"));
        prop_assert_eq!(
            format!("{:?}", entry.onto(Some(base)).unwrap()),
            format!("{want:?}")
        );
    }
}
