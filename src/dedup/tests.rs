use super::*;

#[test]
fn fingerprints_tell_topic_payload_and_packet_id_apart() {
    let base = fingerprint(b"a/b", b"1", None);
    assert_eq!(base, fingerprint(b"a/b", b"1", None));
    assert_ne!(base, fingerprint(b"a/b", b"2", None));
    assert_ne!(base, fingerprint(b"a/c", b"1", None));
    // The topic/payload boundary is part of the identity.
    assert_ne!(
        fingerprint(b"a/b1", b"", None),
        fingerprint(b"a/b", b"1", None)
    );
    let id = |session, pkid| Some(PacketId { session, pkid });
    assert_ne!(base, fingerprint(b"a/b", b"1", id(0, 0)));
    assert_ne!(
        fingerprint(b"a/b", b"1", id(0, 1)),
        fingerprint(b"a/b", b"1", id(0, 2))
    );
    // Packet ids are per session: the same id on two sessions is two messages.
    assert_ne!(
        fingerprint(b"a/b", b"1", id(0, 1)),
        fingerprint(b"a/b", b"1", id(1, 1))
    );
    assert_ne!(
        fingerprint(b"a/b", b"1", id(1, 2)),
        fingerprint(b"a/b", b"1", id(2, 1))
    );
}

/// Issue 52: fingerprints were an unkeyed XXH3 anyone can compute, so a device that can
/// predict another's message could publish one that hashes the same and have the other
/// dropped as a copy. Keyed, the fingerprint depends on a secret the device does not have:
/// what it can compute (the unkeyed hash) is not what the window holds, and two keys give
/// unrelated fingerprints of the same message.
#[test]
fn keyed_fingerprints_are_not_what_anyone_can_compute() {
    let key = FingerprintKey::from_bytes(*b"a secret of 16 b");
    let other = FingerprintKey::from_bytes(*b"another secret..");
    let keyed = Fingerprinter::new(Some(key), false);
    let (topic, payload) = (&b"sensors/t1/temp"[..], &b"21.5"[..]);
    let id = keyed.ident(topic, payload, None);
    assert_ne!(id.keyed, fingerprint(topic, payload, None));
    assert_eq!(
        id.unkeyed, None,
        "no fingerprint from before the key to look for"
    );
    assert_ne!(
        id.keyed,
        Fingerprinter::new(Some(other), false)
            .ident(topic, payload, None)
            .keyed
    );
    // Stable for one key (it is stored), and still telling messages apart.
    assert_eq!(id, keyed.ident(topic, payload, None));
    assert_ne!(id.keyed, keyed.ident(topic, b"21.6", None).keyed);
    assert_ne!(
        id.keyed,
        keyed.ident(b"sensors/t1/tem", b"p21.5", None).keyed
    );
    let pkid = |pkid| Some(PacketId { session: 0, pkid });
    assert_ne!(
        keyed.ident(topic, payload, pkid(1)).keyed,
        keyed.ident(topic, payload, pkid(2)).keyed
    );
    // As stored and read back.
    assert_eq!(FingerprintKey::parse(&key.to_hex()), Some(key));
    assert_eq!(FingerprintKey::parse("zz"), None);
    // A window holding what a forged message would leave (the victim's unkeyed hash: a
    // crafted collision) does not hold the victim's message.
    let mut w = Window::new(8, []);
    w.insert(fingerprint(topic, payload, None));
    assert!(!w.holds(id));
    // While a window may hold fingerprints from before the key, both are looked for.
    let upgraded = Fingerprinter::new(Some(key), true).ident(topic, payload, None);
    assert_eq!(upgraded.keyed, id.keyed);
    assert!(w.holds(upgraded));
}

#[test]
fn fingerprints_are_stable_across_releases() {
    // Stored in the database: a change here makes every stored window useless. The value
    // was checked against Python's `xxhash.xxh3_128_hexdigest(b"\x00" + (15).to_bytes(8, "little")
    // + b"sensors/t1/temp21.5")`.
    assert_eq!(
        format!("{:016x}", fingerprint(b"sensors/t1/temp", b"21.5", None)),
        "190788baa51a9fc2"
    );
}

#[test]
fn the_window_forgets_the_oldest_first() {
    let mut w = Window::new(3, [1, 2, 3]);
    assert!(w.contains(1) && w.contains(3));
    w.insert(4);
    assert!(!w.contains(1), "the oldest went first");
    assert!(w.contains(2) && w.contains(4));
    w.insert(5);
    assert!(!w.contains(2));
    assert_eq!(w.len(), 3);
    let empty = Window::new(0, [1]);
    assert!(!empty.contains(1) && empty.is_empty());
}

/// A fingerprint inserted again stays until its last insertion leaves the window, as in the
/// stored window (the last `capacity` insertions); it used to keep its first place and be
/// forgotten in memory while the file still had it.
#[test]
fn a_fingerprint_inserted_again_stays_as_long_as_its_last_insertion() {
    let mut w = Window::new(3, [1, 2, 3]);
    w.insert(1); // 2, 3, 1
    w.insert(4); // 3, 1, 4
    assert!(w.contains(1), "its second insertion is still in the window");
    assert!(!w.contains(2));
    w.insert(1); // 1, 4, 1
    w.insert(5); // 4, 1, 5
    w.insert(6); // 1, 5, 6
    assert!(w.contains(1));
    w.insert(7); // 5, 6, 7
    assert!(!w.contains(1), "gone with its last insertion");
    assert!(w.repeats.is_empty(), "{:?}", w.repeats);
    // The same as a window rebuilt from the stored insertions.
    let stored = [1, 2, 3, 1, 4, 1, 5, 6, 7];
    let rebuilt = Window::new(3, stored);
    for fp in 1..=7 {
        assert_eq!(rebuilt.contains(fp), w.contains(fp), "{fp}");
    }
}

#[test]
fn encoding_round_trips() {
    let id = |session, pkid| Some(PacketId { session, pkid });
    for n in [1usize, 2, 3, 7, 16, 200] {
        let fps: Vec<(Fingerprint, Tag)> = (0..n)
            .map(|i| {
                let fp = u128::from((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let tag = match i % 3 {
                    0 => None,
                    1 => id(0, u16::try_from(i).unwrap()),
                    _ => id(15, u16::MAX),
                };
                (fp, tag)
            })
            .collect();
        let bytes = encode(&fps);
        assert_eq!(bytes.len() % 16, 8, "never taken for an older encoding");
        assert_eq!(*bytes.last().unwrap(), COMPACT);
        assert_eq!(count(&bytes), Some(n));
        assert_eq!(decode(&bytes).unwrap().collect::<Vec<_>>(), fps);
        for cut in [1, bytes.len() / 2, bytes.len() - 1] {
            assert_ne!(
                decode(&bytes[..cut]).map(Iterator::collect::<Vec<_>>),
                Some(fps.clone()),
                "{cut} bytes"
            );
        }
    }
    assert!(encode(&[]).is_empty());
    assert_eq!(decode(&[]).unwrap().count(), 0);
    // 11 bytes a QoS 1 message's (8 + a session byte + the packet id), plus the trailer.
    let qos1: Vec<(Fingerprint, Tag)> = (0..200).map(|i| (i, id(0, 7))).collect();
    assert!(encode(&qos1).len() <= 200 * 11 + 20);
}

/// Files of format version 2 store 128-bit fingerprints without tags, and of version 3
/// before issue 42 with 4-byte tags: both still decode, as their low 64 bits (what the
/// fingerprint of the same message is now), the untagged ones in no resend sequence.
#[test]
fn older_encodings_decode_to_the_fingerprints_of_now() {
    let full: [u128; 2] = [u128::MAX - 1, 0x0123_4567_89ab_cdef_0011_2233_4455_6677];
    let low = |fp: u128| u128::from(fp as u64);
    let untagged: Vec<u8> = full.iter().flat_map(|fp| fp.to_le_bytes()).collect();
    assert_eq!(count(&untagged), Some(2));
    assert_eq!(
        decode(&untagged).unwrap().collect::<Vec<_>>(),
        [(low(full[0]), None), (low(full[1]), None)]
    );
    let mut tagged = untagged.clone();
    tagged.extend(NO_SESSION.to_le_bytes());
    tagged.extend(0u16.to_le_bytes());
    tagged.extend(3u16.to_le_bytes());
    tagged.extend(9u16.to_le_bytes());
    tagged.push(TAGGED);
    assert_eq!(
        decode(&tagged).unwrap().collect::<Vec<_>>(),
        [
            (low(full[0]), None),
            (
                low(full[1]),
                Some(PacketId {
                    session: 3,
                    pkid: 9
                })
            )
        ]
    );
    // The fingerprint of a message is the low half of its former one.
    let now = fingerprint(b"sensors/t1/temp", b"21.5", None);
    assert_eq!(now, low(0x4df7_31ca_9ffc_38ae_1907_88ba_a51a_9fc2));
}
