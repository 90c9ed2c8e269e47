//! Properties of key encoding: distinct part tuples never share a key, every key stays
//! within its bound however long its parts are, and no part can move the Redis Cluster hash
//! tag: the tag is always the whole encoded-parts section.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;

use idempotency::key::{MAX_KEY_LEN, MAX_PARTS, MAX_PART_LEN};
use idempotency::{Key, KeyPart};
use proptest::prelude::*;

/// Parts drawn to provoke ambiguous joins: separators, braces, escapes, digits and arbitrary
/// bytes.
fn part() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(prop::sample::select(b":,{}#%0127BDv".to_vec()), 1..8),
        prop::collection::vec(any::<u8>(), 1..40),
        prop::collection::vec(any::<u8>(), 100..MAX_PART_LEN),
    ]
}

/// Tuples short enough to stay inline.
fn short_tuple() -> impl Strategy<Value = Vec<Vec<u8>>> {
    let short = prop_oneof![
        prop::collection::vec(prop::sample::select(b":,{}#%0127BDv".to_vec()), 1..8),
        prop::collection::vec(any::<u8>(), 1..8),
    ];
    prop::collection::vec(short, 1..4)
}

fn tuple() -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop::collection::vec(part(), 1..5)
}

fn key_of(prefix: &str, version: u32, parts: &[Vec<u8>]) -> Key {
    let refs: Vec<&dyn KeyPart> = parts.iter().map(|p| p as &dyn KeyPart).collect();
    Key::new(prefix, version, &refs).unwrap()
}

/// The bytes Redis Cluster hashes for `key`: those between the first `{` and the next `}`
/// after it when that is not empty, otherwise the whole key.
fn hash_tag(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{') {
        if let Some(len) = key[open + 1..].iter().position(|&b| b == b'}') {
            if len > 0 {
                return &key[open + 1..open + 1 + len];
            }
        }
    }
    key
}

/// CRC16-XMODEM (polynomial 0x1021, initial value 0), the checksum Redis Cluster uses.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The Redis Cluster slot of `key`.
fn slot(key: &[u8]) -> u16 {
    crc16(hash_tag(key)) % 16384
}

/// The parts section of the first key format, which wrote every part as it was:
/// `<len>:<bytes>`, comma-separated.
fn verbatim_section(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(format!("{}:", part.len()).as_bytes());
        out.extend_from_slice(part);
    }
    out
}

/// Reads `section` as a format 1 parts section, if it is one.
fn parse_verbatim(section: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut parts = Vec::new();
    let mut rest = section;
    loop {
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        let len: usize = std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()?;
        rest = rest[digits..].strip_prefix(b":")?;
        parts.push(rest.get(..len)?.to_vec());
        rest = &rest[len..];
        if rest.is_empty() {
            break;
        }
        rest = rest.strip_prefix(b",")?;
    }
    // Only what the format 1 encoder wrote (no leading zeros, say).
    (verbatim_section(&parts) == section).then_some(parts)
}

/// The encoded-parts section: what follows the `{` after `:v<version>:`, without the final `}`.
fn parts_section(key: &Key) -> &[u8] {
    let bytes = key.as_bytes();
    let open = bytes.iter().position(|&b| b == b'{').unwrap();
    assert_eq!(bytes.last(), Some(&b'}'), "{key:?}");
    &bytes[open + 1..bytes.len() - 1]
}

#[test]
fn slot_function_matches_redis() {
    // The check value of the Redis Cluster specification, and keys from the Redis manual.
    assert_eq!(crc16(b"123456789"), 0x31c3);
    assert_eq!(slot(b"somekey"), 11058);
    assert_eq!(slot(b"foo{hash_tag}"), slot(b"hash_tag"));
    assert_eq!(slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
}

#[test]
fn parts_starting_with_a_closing_brace_spread_over_slots() {
    let keys: Vec<Key> = (0..1_000)
        .map(|i| key_of("orders", 1, &[format!("}}{i}").into_bytes()]))
        .collect();
    let tags: HashSet<&[u8]> = keys.iter().map(|k| hash_tag(k.as_bytes())).collect();
    let slots: HashSet<u16> = keys.iter().map(|k| slot(k.as_bytes())).collect();
    assert_eq!(tags.len(), 1_000, "every key has its own hash tag");
    // 1,000 distinct tags over 16,384 slots: about 970 distinct slots expected.
    assert!(slots.len() > 900, "{} distinct slots", slots.len());
    for key in &keys {
        assert_eq!(hash_tag(key.as_bytes()), parts_section(key), "{key:?}");
    }
}

#[test]
fn braces_in_parts_are_escaped_readably() {
    let key = Key::new("orders", 1, &[&"2:}x", &"a{b%c"]).unwrap();
    assert_eq!(key.to_string(), "orders:v1:{6%2:%7Dx,9%a%7Bb%25c}");
    // Parts without braces are written as they are.
    let plain = Key::new("orders", 1, &[&"A-100%", &42u32]).unwrap();
    assert_eq!(plain.to_string(), "orders:v1:{6:A-100%,2:42}");
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
    fn the_hash_tag_is_the_whole_parts_section(parts in tuple(), prefix in "[a-z:]{1,16}") {
        let key = key_of(&prefix, 1, &parts);
        prop_assert_eq!(hash_tag(key.as_bytes()), parts_section(&key));
    }

    #[test]
    fn the_encoding_is_the_documented_one(parts in tuple(), version in 0u32..5) {
        // `<prefix>:v<version>:{<len>:<bytes>,...}`, a part with a brace as
        // `<escaped len>%<bytes with %, { and } percent-escaped>`: written out by hand here,
        // so a change of `Key::new`'s code can never change a key's bytes.
        let mut body = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                body.push(b',');
            }
            if part.iter().any(|b| matches!(b, b'{' | b'}')) {
                let mut escaped = Vec::new();
                for &b in part {
                    match b {
                        b'%' => escaped.extend_from_slice(b"%25"),
                        b'{' => escaped.extend_from_slice(b"%7B"),
                        b'}' => escaped.extend_from_slice(b"%7D"),
                        _ => escaped.push(b),
                    }
                }
                body.extend_from_slice(format!("{}%", escaped.len()).as_bytes());
                body.extend_from_slice(&escaped);
            } else {
                body.extend_from_slice(format!("{}:", part.len()).as_bytes());
                body.extend_from_slice(part);
            }
        }
        let key = key_of("p", version, &parts);
        let mut expected = format!("p:v{version}:{{").into_bytes();
        if body.len() <= idempotency::key::MAX_INLINE_PARTS {
            expected.extend_from_slice(&body);
            expected.push(b'}');
            prop_assert_eq!(key.as_bytes(), &expected[..]);
        } else {
            // Longer parts are replaced by `#` and their digest's 64 hex digits.
            expected.push(b'#');
            prop_assert!(key.is_hashed());
            prop_assert!(key.as_bytes().starts_with(&expected));
            prop_assert_eq!(key.as_bytes().len(), expected.len() + 64 + 1);
        }
    }

    #[test]
    fn an_encoded_key_parses_back_to_itself(parts in tuple(), prefix in "[a-z:]{1,16}", version in 0u32..5) {
        let key = key_of(&prefix, version, &parts);
        // `Key::parse` takes text: keys whose parts are not UTF-8 have none.
        if let Ok(text) = std::str::from_utf8(key.as_bytes()) {
            let parsed = Key::parse(text).unwrap();
            prop_assert_eq!(parsed.prefix(), key.prefix());
            prop_assert_eq!(parsed, key);
        }
    }

    #[test]
    fn braces_never_appear_inside_the_parts_section(parts in tuple()) {
        let key = key_of("p", 1, &parts);
        prop_assert!(!parts_section(&key).iter().any(|b| matches!(b, b'{' | b'}')), "{:?}", key);
    }

    #[test]
    fn parts_without_braces_keep_the_verbatim_encoding(parts in tuple()) {
        let key = key_of("p", 1, &parts);
        let verbatim = verbatim_section(&parts);
        if !key.is_hashed() && !verbatim.iter().any(|b| matches!(b, b'{' | b'}')) {
            prop_assert_eq!(parts_section(&key), &verbatim[..]);
        }
    }

    #[test]
    fn keys_never_equal_the_format_1_key_of_another_tuple(a in short_tuple()) {
        // Read as format 1, a key's parts are its own tuple or no format 1 key at all, so a
        // record written by format 1 is never found under another tuple. (Hashed keys digest
        // the same sections.)
        let key = key_of("p", 1, &a);
        prop_assert!(!key.is_hashed());
        if let Some(decoded) = parse_verbatim(parts_section(&key)) {
            prop_assert_eq!(decoded, a);
        }
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
