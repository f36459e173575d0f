use super::*;

/// Issue 52: messages alternating between two origins logged a warning each (~400 KiB a
/// thousand messages). The first change of database warns; the next ones within the minute
/// go to the debug log. (With the rate limit removed: 1,000 warnings.)
#[test]
fn origin_changes_warn_at_most_once_a_minute_per_gateway() {
    let mut a = Applied::default();
    let logged = crate::log_count::warnings(|| {
        for i in 0..1_000 {
            let origin = if i % 2 == 0 { "o1" } else { "o2" };
            a.insert("g1", at(origin, i, 0));
        }
        a.insert("g2", at("p1", 0, 0));
        a.insert("g2", at("p2", 1, 0));
    });
    assert_eq!(logged, 2, "one for g1, one for g2");
}

fn at(origin: &str, seq: i64, part: i32) -> Position {
    Position {
        origin: origin.into(),
        seq,
        part,
    }
}

#[test]
fn a_position_at_or_before_the_last_applied_is_a_copy_per_gateway_and_origin() {
    let mut a = Applied::default();
    assert!(!a.contains("g1", &at("o", 1, 0)));
    a.insert("g1", at("o", 5, 1));
    assert!(a.contains("g1", &at("o", 5, 1)));
    assert!(a.contains("g1", &at("o", 5, 0)));
    assert!(a.contains("g1", &at("o", 2, 7)));
    assert!(!a.contains("g1", &at("o", 5, 2)));
    assert!(!a.contains("g1", &at("o", 6, 0)));
    assert!(!a.contains("g2", &at("o", 1, 0)));
    // A replaced database numbers from the start again; the old one's messages are still
    // told by its own last position.
    assert!(!a.contains("g1", &at("p", 1, 0)));
    a.insert("g1", at("p", 1, 0));
    assert!(a.contains("g1", &at("p", 1, 0)));
    assert!(a.contains("g1", &at("o", 1, 0)));
    assert!(!a.contains("g1", &at("o", 6, 0)));
    assert_eq!(a.len(), 1);
    // Recorded before origins existed: the same stream.
    a.insert("g3", at("", 4, 0));
    assert!(a.contains("g3", &at("q", 4, 0)));
    assert!(!a.contains("g3", &at("q", 5, 0)));
    assert_eq!(
        Position::decode(&at("p", 1, 0).encode()),
        Some(at("p", 1, 0))
    );
}

/// Issue 41: one forged message with a new origin reset a gateway's position, so that
/// captured old messages of its real database applied again (counted twice). Each
/// database's last position is kept (the current one and the last few before it): the
/// old messages stay copies, the real stream goes on where it was, and what the store
/// keeps brings it all back after a restart.
#[test]
fn a_forged_origin_neither_resets_a_stream_nor_lets_old_messages_apply_again() {
    let real = "2026-11-22T12:00:00.000Z";
    let forged = "2026-11-26T00:00:00.000Z";
    let mut a = Applied::default();
    let mut stored: HashMap<String, Position> = HashMap::new();
    let record = |a: &mut Applied, stored: &mut HashMap<String, Position>, p: Position| {
        for (key, at) in a.insert("g1", p) {
            stored.insert(key, at);
        }
    };
    record(&mut a, &mut stored, at(real, 10, 0));
    record(&mut a, &mut stored, at(forged, 0, 0));
    for seq in 0..=10 {
        assert!(a.contains("g1", &at(real, seq, 0)), "captured {seq}");
    }
    assert!(
        !a.contains("g1", &at(real, 11, 0)),
        "the real stream goes on"
    );
    record(&mut a, &mut stored, at(real, 11, 0));
    assert!(
        a.contains("g1", &at(forged, 0, 0)),
        "the forged one is a copy now"
    );
    // A restart reads back the same.
    let b = Applied::new(stored.clone());
    assert!(b.contains("g1", &at(real, 11, 0)));
    assert!(!b.contains("g1", &at(real, 12, 0)));
    assert!(b.contains("g1", &at(forged, 0, 0)));
    // Bounded: the oldest retired database is forgotten past RETIRED_ORIGINS_MAX.
    for day in 0..=RETIRED_ORIGINS_MAX {
        record(
            &mut a,
            &mut stored,
            at(&format!("2026-12-0{}T00:00:00.000Z", day + 1), 0, 0),
        );
    }
    assert!(stored.len() <= 1 + RETIRED_ORIGINS_MAX, "{stored:?}");
    assert!(!a.contains("g1", &at(real, 0, 0)), "forgotten, the oldest");
    assert!(a.contains("g1", &at("2026-12-02T00:00:00.000Z", 0, 0)));
}
