use super::*;

fn record(entries: &[(u64, i64, f64)]) -> Vec<u8> {
    let summaries: Vec<Summary> = entries.iter().map(|e| Summary::of(e.1, e.2)).collect();
    let ins: Vec<crate::commitlog::EntryIn<'_>> = entries
        .iter()
        .zip(&summaries)
        .map(|(e, s)| crate::commitlog::EntryIn {
            series_id: e.0,
            start: e.1,
            summary: s,
            raw: None,
        })
        .collect();
    let mut out = Vec::new();
    crate::commitlog::encode(&ins, crate::sketch::SketchParams::DEFAULT, &mut out);
    out
}

#[test]
fn a_run_merges_each_bucket_in_commit_order_and_a_closed_run_takes_no_more_commits() {
    let mut runs = Runs::default();
    runs.add(1, &record(&[(1, 0, 1.0), (2, 0, 5.0)]));
    runs.add(2, &record(&[(1, 0, 2.0), (1, 3600, 7.0)]));
    runs.close();
    runs.add(3, &record(&[(1, 0, 4.0)]));
    let all = runs.all();
    assert_eq!(all.len(), 2);
    assert_eq!(
        (all[0].first, all[0].last, all[1].first, all[1].last),
        (1, 2, 3, 3)
    );
    let Some(Series::Cached(b)) = all[0].series(1) else {
        panic!("series 1 merged");
    };
    let mut want = Summary::of(0, 1.0);
    want.push(0, 2.0);
    assert_eq!(b[&0].summary, want);
    assert_eq!(b[&3600].summary.count, 1);
    assert!(
        all[1].series(2).is_none(),
        "series 2 is not in the second run"
    );
    assert_eq!(runs.buckets, 4);
    runs.drop_through(2);
    assert_eq!((runs.all().len(), runs.buckets), (1, 1));
}

#[test]
fn a_series_past_the_bound_is_spilled_and_gives_its_room_back() {
    let mut runs = Runs::default();
    let max = crate::limits::MERGED_BUCKETS as i64 / 2;
    let many: Vec<(u64, i64, f64)> = (0..max - 1).map(|i| (1, i * 3600, 1.0)).collect();
    runs.add(1, &record(&many));
    runs.add(2, &record(&[(2, 0, 1.0), (2, 3600, 1.0)]));
    let run = &runs.all()[0];
    assert!(!run.spilled(1));
    assert!(run.spilled(2), "its second bucket found no room");
    assert_eq!(runs.buckets, crate::limits::MERGED_BUCKETS / 2 - 1);
    runs.add(3, &record(&[(3, 0, 1.0)]));
    assert!(
        !runs.all()[0].spilled(3),
        "series 2's bucket was given back"
    );
    runs.add(4, &record(&[(4, 0, 1.0)]));
    assert!(runs.all()[0].spilled(4));
}

#[test]
fn a_third_run_while_two_wait_merges_nothing() {
    let mut runs = Runs::default();
    for seq in 1..=3 {
        runs.add(seq, &record(&[(1, 0, 1.0)]));
        runs.close();
    }
    let all = runs.all();
    assert!(!all[0].spilled(1) && !all[1].spilled(1));
    assert!(
        all[2].spilled(1),
        "checkpoints failed twice: the third run is read whole"
    );
    runs.drop_through(2);
    runs.add(4, &record(&[(1, 0, 1.0)]));
    assert!(
        !runs.all()[1].spilled(1),
        "one run waits again: the next one merges"
    );
}

#[test]
fn an_unreadable_record_leaves_its_run_read_from_the_records() {
    let mut runs = Runs::default();
    runs.add(1, &record(&[(1, 0, 1.0)]));
    runs.add(2, b"\x09 not a record");
    let run = &runs.all()[0];
    assert!(run.spilled(1) && run.spilled(77));
    assert_eq!(runs.buckets, 0);
}
