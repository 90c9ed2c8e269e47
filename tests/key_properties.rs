//! Properties of key encoding: distinct part tuples never share a key, and every key stays
//! within its bound however long its parts are.

#![allow(clippy::unwrap_used)]

use idempotent::key::{MAX_KEY_LEN, MAX_PARTS, MAX_PART_LEN};
use idempotent::{Key, KeyPart};
use proptest::prelude::*;

/// Parts drawn to provoke ambiguous joins: separators, braces, digits and arbitrary bytes.
fn part() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(prop::sample::select(b":,{}#01v".to_vec()), 1..6),
        prop::collection::vec(any::<u8>(), 1..40),
        prop::collection::vec(any::<u8>(), 100..MAX_PART_LEN),
    ]
}

fn tuple() -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop::collection::vec(part(), 1..5)
}

fn key_of(prefix: &str, version: u32, parts: &[Vec<u8>]) -> Key {
    let refs: Vec<&dyn KeyPart> = parts.iter().map(|p| p as &dyn KeyPart).collect();
    Key::new(prefix, version, &refs).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn distinct_tuples_never_collide(a in tuple(), b in tuple()) {
        prop_assume!(a != b);
        prop_assert_ne!(key_of("p", 1, &a), key_of("p", 1, &b));
    }

    #[test]
    fn concatenation_does_not_collide(a in tuple()) {
        // Joining two neighbouring parts into one is a different tuple, so a different key.
        prop_assume!(a.len() >= 2 && a[0].len() + a[1].len() <= MAX_PART_LEN);
        let mut joined = a.clone();
        let second = joined.remove(1);
        joined[0].extend_from_slice(&second);
        prop_assert_ne!(key_of("p", 1, &a), key_of("p", 1, &joined));
    }

    #[test]
    fn prefixes_and_versions_never_collide(
        pa in "[a-z:]{1,12}", pb in "[a-z:]{1,12}", va in 1u32..20, vb in 1u32..20, parts in tuple()
    ) {
        prop_assume!((&pa, va) != (&pb, vb));
        prop_assert_ne!(key_of(&pa, va, &parts), key_of(&pb, vb, &parts));
    }

}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn long_keys_stay_bounded(
        parts in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..MAX_PART_LEN), 1..MAX_PARTS),
        prefix in "[a-z:]{1,128}",
    ) {
        let key = key_of(&prefix, u32::MAX, &parts);
        prop_assert!(key.as_bytes().len() <= MAX_KEY_LEN);
        prop_assert!(key.as_bytes().starts_with(prefix.as_bytes()));
    }

    #[test]
    fn keys_are_deterministic(parts in tuple()) {
        prop_assert_eq!(key_of("p", 1, &parts), key_of("p", 1, &parts));
    }
}
