use proptest::prelude::*;

use super::*;

fn round_trip(readings: &[(i64, f64)]) -> Vec<(i64, f64)> {
    decode(&encode(readings)).expect("decodes")
}

fn bits(r: &[(i64, f64)]) -> Vec<(i64, u64)> {
    r.iter().map(|(t, v)| (*t, v.to_bits())).collect()
}

#[test]
fn a_temperature_every_second_costs_a_few_bits_per_reading() {
    let t0 = 1_763_719_200_000_000_000i64;
    let mut x = 1u64;
    let readings: Vec<(i64, f64)> = (0..1000)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let noise = (x % 5) as f64 / 10.0; // 0.0 ..= 0.4, one decimal as a sensor sends
            (
                t0 + i * 1_000_000_000,
                ((21.0 + noise) * 10.0).round() / 10.0,
            )
        })
        .collect();
    let page = encode(&readings);
    assert_eq!(page.unit, 1_000_000_000);
    assert_eq!(bits(&round_trip(&readings)), bits(&readings));
    assert!(
        page.data.len() < 1000 * 4,
        "{} bytes for 1000 readings",
        page.data.len()
    );
}

#[test]
fn extremes_round_trip_bit_for_bit() {
    let readings = [
        (i64::MIN, f64::MAX),
        (i64::MAX, -f64::MAX),
        (0, 5e-324),
        (0, -0.0),
        (-1, f64::MIN_POSITIVE),
        (7, 0.1),
        (7, 0.1),
        (3, 1e308),
    ];
    assert_eq!(bits(&round_trip(&readings)), bits(&readings));
    assert_eq!(encode(&readings).unit, 1);
}

#[test]
fn negative_zero_is_not_taken_for_a_decimal() {
    let readings = [(0, -0.0), (1_000_000_000, 1.5)];
    let page = encode(&readings);
    assert_eq!(page.decimals, -1);
    assert_eq!(bits(&round_trip(&readings)), bits(&readings));
}

#[test]
fn truncated_data_is_refused() {
    let mut page = encode(&[(0, 1.0), (1_000, 2.0), (2_000, 3.5)]);
    page.data.truncate(page.data.len() - 2);
    assert_eq!(decode(&page), None);
}

fn reading() -> impl Strategy<Value = (i64, f64)> {
    let ts = prop_oneof![
        any::<i64>(),
        (0i64..1_000).prop_map(|s| 1_763_719_200_000_000_000 + s * 1_000_000_000),
        (0i64..100_000).prop_map(|ms| 1_763_719_200_000_000_000 + ms * 1_000_000),
    ];
    let value = prop_oneof![
        any::<f64>().prop_filter("finite", |v| v.is_finite()),
        (-50.0f64..50.0),
        Just(21.5),
        (0u64..1u64 << 52).prop_map(f64::from_bits), // subnormals
    ];
    (ts, value)
}

proptest! {
    /// Appending to an encoded page equals encoding everything at once (when the new
    /// readings fit the page's form, byte for byte; otherwise in content).
    #[test]
    fn appending_equals_encoding_the_concatenation(
        a in prop::collection::vec(reading(), 1..100),
        b in prop::collection::vec(reading(), 0..100),
        c in prop::collection::vec(reading(), 0..20),
    ) {
        let all: Vec<(i64, f64)> = a.iter().chain(&b).chain(&c).copied().collect();
        let appended = append(&append(&encode(&a), &b).unwrap(), &c).unwrap();
        prop_assert_eq!(appended.count as usize, all.len());
        prop_assert_eq!(bits(&decode(&appended).unwrap()), bits(&all));
        let whole = encode(&all);
        if (whole.unit, whole.decimals) == (appended.unit, appended.decimals) {
            prop_assert_eq!(appended, whole);
        }
    }

    #[test]
    fn any_readings_round_trip_in_arrival_order(
        readings in prop::collection::vec(reading(), 1..300)
    ) {
        let page = encode(&readings);
        prop_assert_eq!(page.count as usize, readings.len());
        prop_assert_eq!(bits(&decode(&page).unwrap()), bits(&readings));
    }
}
