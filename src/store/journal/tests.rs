use std::fs::File;

use super::*;

fn redo_of(log: &[u8]) -> Redo<'_> {
    Redo {
        series: vec![],
        log,
        fingerprints: b"",
        applied: vec![],
        outbox: None,
    }
}

fn open(path: &Path, id: u64, capacity: u64) -> Result<Journal, JournalError> {
    Journal::open(path.to_owned(), id, capacity, |p| {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(p)?;
        Ok(Box::new(f) as Box<dyn JournalFile>)
    })
}

/// The records a replay for `next_seq` applies: (seq, log bytes).
fn replayed(j: &mut Journal, next_seq: u64) -> Result<Vec<(u64, Vec<u8>)>, JournalError> {
    let mut out = Vec::new();
    j.replay(next_seq, |seq, redo| {
        out.push((seq, redo.log.to_vec()));
        Ok::<(), JournalError>(())
    })?;
    Ok(out)
}

#[test]
fn a_redo_reads_back_as_written_and_nothing_else_parses() {
    let redo = Redo {
        series: vec![(7, "greenhouse/temperature"), (8, "boiler/t")],
        log: b"log record",
        fingerprints: &[1; 32],
        applied: vec![("gw-1", b"pos".as_slice())],
        outbox: Some(OutboxRedo {
            trim_below: 3,
            key: 12,
            doc: b"bson",
        }),
    };
    let mut bytes = Vec::new();
    redo.encode(&mut bytes);
    assert_eq!(Redo::parse(&bytes), Some(redo.clone()));
    // Every shorter prefix, and the record with a byte more, is refused.
    for n in 0..bytes.len() {
        assert_eq!(Redo::parse(&bytes[..n]), None, "prefix of {n} bytes");
    }
    bytes.push(0);
    assert_eq!(Redo::parse(&bytes), None);
}

#[test]
fn records_replay_in_order_from_the_next_commit_the_database_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.journal");
    let mut j = open(&path, 42, MIN_JOURNAL_BYTES).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), MIN_JOURNAL_BYTES);
    for seq in 10..15u64 {
        assert!(j.append(seq, &redo_of(&seq.to_le_bytes())).unwrap());
    }
    drop(j);
    let mut j = open(&path, 42, MIN_JOURNAL_BYTES).unwrap();
    // The database holds up to 11: 12, 13, 14 apply.
    let got = replayed(&mut j, 12).unwrap();
    assert_eq!(
        got,
        (12..15u64)
            .map(|s| (s, s.to_le_bytes().to_vec()))
            .collect::<Vec<_>>()
    );
    // A database that holds them all takes nothing.
    let mut j = open(&path, 42, MIN_JOURNAL_BYTES).unwrap();
    assert!(replayed(&mut j, 15).unwrap().is_empty());
    assert_eq!(Journal::pending(&path, 42, 13).unwrap(), 2);
}

#[test]
fn released_records_are_overwritten_in_turn_and_never_applied_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.journal");
    let mut j = open(&path, 1, MIN_JOURNAL_BYTES).unwrap();
    for seq in 0..5u64 {
        assert!(j.append(seq, &redo_of(&[seq as u8; 300])).unwrap());
    }
    // The database durable through 4: those records are free, and with a database that holds
    // them nothing applies.
    j.release_below(5);
    assert_eq!(j.used(), 0);
    for seq in 5..7u64 {
        assert!(j.append(seq, &redo_of(&[seq as u8; 10])).unwrap());
    }
    drop(j);
    let mut j = open(&path, 1, MIN_JOURNAL_BYTES).unwrap();
    let got = replayed(&mut j, 5).unwrap();
    assert_eq!(got.iter().map(|r| r.0).collect::<Vec<_>>(), vec![5, 6]);
    let mut j = open(&path, 1, MIN_JOURNAL_BYTES).unwrap();
    assert!(replayed(&mut j, 7).unwrap().is_empty());
}

/// Records go round the file: a commit's record goes after the last one or, when it does not fit
/// before the end, at the first record's place, never over a live one; the replay follows the
/// run across the end. Many rounds, with records of every size up to a few pages, released
/// as a database would (a few commits behind), each replay exactly the live records in order.
#[test]
fn records_go_round_the_file_and_replay_across_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.journal");
    let mut j = open(&path, 2, MIN_JOURNAL_BYTES).unwrap();
    let pages = (MIN_JOURNAL_BYTES - UNIT_BYTES) / UNIT_BYTES;
    let mut next = crate::test_rng::below(0x2545_f491_4f6c_dd1d);
    let (mut durable, mut wraps, mut last_at) = (0u64, 0, 0u64);
    for seq in 0..(pages * 6) {
        let len = next(3 * PAGE_BYTES) as usize;
        let body = vec![seq as u8; len];
        if !j.append(seq, &redo_of(&body)).unwrap() {
            // Full: the database folds what is live, as a checkpoint would.
            durable = seq;
            j.release_below(durable);
            assert!(
                j.append(seq, &redo_of(&body)).unwrap(),
                "fits once released"
            );
        }
        let at = j.live.back().unwrap().1;
        assert_eq!(at % UNIT_BYTES, 0);
        wraps += usize::from(at < last_at);
        last_at = at;
        // The live records never overlap.
        let mut spans: Vec<(u64, u64)> = j.live.iter().map(|&(_, a, f)| (a, a + f)).collect();
        spans.sort_unstable();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "{spans:?}");
        assert!(
            spans
                .iter()
                .all(|&(a, e)| a >= UNIT_BYTES && e <= MIN_JOURNAL_BYTES)
        );
        if next(4) == 0 {
            durable = (seq + 1).saturating_sub(next(6)).max(durable);
            j.release_below(durable);
        }
        if seq % 37 == 0 {
            // A crash: what the database lacks comes back, in order, across the end.
            let mut again = open(&path, 2, MIN_JOURNAL_BYTES).unwrap();
            let got = replayed(&mut again, durable).unwrap();
            assert_eq!(
                got.iter().map(|r| r.0).collect::<Vec<_>>(),
                (durable..=seq).collect::<Vec<_>>(),
                "after commit {seq}"
            );
            for (s, log) in got {
                assert!(log.iter().all(|&b| b == s as u8), "commit {s}'s own record");
            }
        }
    }
    assert!(wraps >= 3, "{wraps} rounds");
}

#[test]
fn a_torn_or_damaged_last_record_ends_the_replay_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.journal");
    let mut j = open(&path, 9, MIN_JOURNAL_BYTES).unwrap();
    for seq in 0..3u64 {
        assert!(j.append(seq, &redo_of(&[seq as u8; 100])).unwrap());
    }
    // Each record starts on a program unit.
    let third = 3 * UNIT_BYTES;
    let record_len = RECORD_HEADER_BYTES as u64 + 100 + 6;
    drop(j);
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    // Any byte of the last record changed, or the record cut short (zeros past a prefix).
    for at in [0, 5, 15, 25, record_len - 1] {
        let original = {
            let mut b = [0u8; 1];
            JournalFile::read_at(&File::open(&path).unwrap(), third + at, &mut b).unwrap();
            b[0]
        };
        JournalFile::write_at(&file, third + at, &[original ^ 0x40]).unwrap();
        let mut j = open(&path, 9, MIN_JOURNAL_BYTES).unwrap();
        let got = replayed(&mut j, 0).unwrap();
        assert_eq!(got.len(), 2, "byte {at} of the last record changed");
        JournalFile::write_at(&file, third + at, &[original]).unwrap();
    }
    JournalFile::write_at(&file, third + 30, &[0u8; 80]).unwrap();
    let mut j = open(&path, 9, MIN_JOURNAL_BYTES).unwrap();
    assert_eq!(replayed(&mut j, 0).unwrap().len(), 2);
}

/// Issue 51: the replay stopped quietly at the first unreadable record and logged "nothing
/// acknowledged was lost", even with whole records after it. A record of the middle of the run
/// damaged (a card whose program unit spans two records, a page the disk garbled) takes only
/// what it held with it if nothing follows it; with whole records after it the replay refuses,
/// naming the commit missing and the one found, and those records stay where they are.
#[test]
fn a_damaged_record_before_whole_ones_refuses_the_replay() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.journal");
    let mut j = open(&path, 9, MIN_JOURNAL_BYTES).unwrap();
    for seq in 10..15u64 {
        assert!(j.append(seq, &redo_of(&[seq as u8; 100])).unwrap());
    }
    drop(j);
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    // The third record (commit 12) garbled.
    let third = 3 * UNIT_BYTES;
    JournalFile::write_at(&file, third + 25, &[0xAA; 40]).unwrap();
    let mut j = open(&path, 9, MIN_JOURNAL_BYTES).unwrap();
    match replayed(&mut j, 10) {
        Err(
            e @ JournalError::Broken {
                missing: 12,
                found: 13,
                ..
            },
        ) => {
            let text = e.to_string();
            assert!(
                text.contains("commit 12") && text.contains("commit 13"),
                "{text}"
            );
        }
        other => panic!("the replay must refuse: {other:?}"),
    }
    // Replayed from the damaged one on (the database holds 10 to 12), nothing is missing.
    let mut j = open(&path, 9, MIN_JOURNAL_BYTES).unwrap();
    let got: Vec<u64> = replayed(&mut j, 13).unwrap().iter().map(|r| r.0).collect();
    assert_eq!(got, [13, 14]);
}

#[test]
fn a_journal_that_does_not_continue_the_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.journal");
    let mut j = open(&path, 5, MIN_JOURNAL_BYTES).unwrap();
    assert!(j.append(20, &redo_of(b"x")).unwrap());
    drop(j);
    // The database ends at 10 (an older copy of the file?): commits 10..20 are missing.
    let mut j = open(&path, 5, MIN_JOURNAL_BYTES).unwrap();
    let e = replayed(&mut j, 10).unwrap_err();
    assert!(
        matches!(
            e,
            JournalError::Gap {
                found: 20,
                expected: 10,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("move the journal aside"), "{e}");
    // Another database's journal.
    let e = open(&path, 6, MIN_JOURNAL_BYTES).err().unwrap();
    assert!(matches!(e, JournalError::Foreign { .. }), "{e}");
    // A damaged header.
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    JournalFile::write_at(&file, 3, b"?").unwrap();
    let e = open(&path, 5, MIN_JOURNAL_BYTES).err().unwrap();
    assert!(matches!(e, JournalError::BadHeader { .. }), "{e}");
}

#[test]
fn a_record_that_does_not_fit_is_not_written() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.journal");
    let mut j = open(&path, 3, MIN_JOURNAL_BYTES).unwrap();
    let big = vec![7u8; 20_000];
    let mut written = 0;
    while j.append(written, &redo_of(&big)).unwrap() {
        written += 1;
    }
    // 256 KiB: the header's 16 KiB unit, then seven records of two units each (20,028 bytes).
    assert_eq!(written, 7);
    let used = j.used();
    assert!(!j.append(written, &redo_of(&big)).unwrap());
    assert_eq!(j.used(), used, "nothing written");
    drop(j);
    let mut j = open(&path, 3, MIN_JOURNAL_BYTES).unwrap();
    assert_eq!(replayed(&mut j, 0).unwrap().len() as u64, written);
}

#[test]
fn a_journal_that_cannot_be_made_leaves_nothing_behind_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    // The rename into place fails: a directory with a file in it holds the journal's name.
    // (`Journal::open` makes no journal over an existing path, so `create` is called directly.)
    let path = dir.path().join("db.journal");
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("x"), b"x").unwrap();
    assert!(create(&path, 3, MIN_JOURNAL_BYTES).is_err());
    let tmp = dir.path().join("db.journal.new");
    assert!(!tmp.exists(), "the partial journal is removed");
    // A full disk is named, with what to do; other errors point at the directory.
    let full = JournalError::Io {
        path: tmp.clone(),
        source: io::Error::from_raw_os_error(28), // ENOSPC
    };
    let text = full.to_string();
    assert!(text.contains("the disk is full"), "{text}");
    assert!(text.contains("store.journal_size"), "{text}");
    let denied = JournalError::Io {
        path: tmp,
        source: io::Error::from(io::ErrorKind::PermissionDenied),
    };
    assert!(
        denied.to_string().contains("writable by this user"),
        "{denied}"
    );
}

/// Issue 51: making a journal of `store.journal_size` (up to 1 GiB, about 50 s on a card)
/// ignored SIGTERM until it was done. A stop request ends the zero fill within a mebibyte,
/// with an error that says nothing was lost, and leaves no partial file behind.
#[test]
fn a_stop_request_ends_the_zero_fill_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.journal");
    let asked = std::cell::Cell::new(0u32);
    // Asked at the start and after each mebibyte: the third time, stop.
    let stop = || {
        asked.set(asked.get() + 1);
        asked.get() == 3
    };
    let e = create_unless(&path, 3, 64 << 20, &stop).expect_err("stopped");
    assert_eq!(e.kind(), io::ErrorKind::Interrupted);
    assert_eq!(asked.get(), 3, "asked every mebibyte, not every page");
    assert!(!path.exists());
    assert!(
        !dir.path().join("db.journal.new").exists(),
        "the partial journal is removed"
    );
    let text = JournalError::Io { path, source: e }.to_string();
    assert!(
        text.contains("stopped by a signal") && text.contains("nothing was lost"),
        "{text}"
    );
    // Not asked to stop: made whole.
    create_unless(&dir.path().join("b.journal"), 3, 4 << 20, &|| false).unwrap();
    assert_eq!(
        std::fs::metadata(dir.path().join("b.journal"))
            .unwrap()
            .len(),
        4 << 20
    );
}

/// Issue 42: records were packed back to back, so each append rewrote the page holding the
/// tail of the record before it (acknowledged), and a card that garbles or reverts the page it
/// was writing in a power cut took that record away, and every one after it. Issue 51: a card
/// whose program unit is larger than a page can damage the other pages of the unit it was
/// programming, so each record now starts on a 16 KiB unit of its own: garbling the whole
/// unit the newest record starts in leaves the others.
#[test]
fn a_record_never_shares_a_program_unit_with_the_one_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.journal");
    let mut j = open(&path, 3, MIN_JOURNAL_BYTES).unwrap();
    // Sizes around a page and a unit: the next record starts on the next unit every time.
    let mut starts = Vec::new();
    for (seq, len) in [
        (0u64, 10usize),
        (1, 4000),
        (2, 4076),
        (3, 4077),
        (4, 9000),
        (5, 16_300),
        (6, 16_365),
        (7, 1),
    ] {
        starts.push(UNIT_BYTES + j.used());
        assert!(j.append(seq, &redo_of(&vec![seq as u8; len])).unwrap());
    }
    assert!(starts.iter().all(|s| s % UNIT_BYTES == 0), "{starts:?}");
    assert!(
        starts
            .windows(2)
            .zip([1, 1, 1, 1, 1, 1, 2])
            .all(|(w, units)| w[1] - w[0] == units * UNIT_BYTES),
        "a record takes the units it needs and no more: {starts:?}"
    );
    // The last record's unit garbled, every page of it: every earlier record is still there.
    let last = *starts.last().unwrap();
    drop(j);
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    JournalFile::write_at(&file, last, &[0xA5; UNIT_BYTES as usize]).unwrap();
    let mut j = open(&path, 3, MIN_JOURNAL_BYTES).unwrap();
    let got = replayed(&mut j, 0).unwrap();
    assert_eq!(
        got.iter().map(|r| r.0).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4, 5, 6]
    );
}
