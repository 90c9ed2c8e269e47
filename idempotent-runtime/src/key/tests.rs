//! Unit tests of the key encoding, its parsing back and its printed form.

use super::*;

#[test]
fn texts_that_are_not_keys_are_refused() {
    for text in [
        "",
        "p",
        "p:v1:",
        "p:v1:{}",
        "p:v1:{1:a",
        "p:v1:{1:{a}",
        "p:{1:a}",
        "p:vx:{1:a}",
        "p:v99999999999:{1:a}",
        ":v1:{1:a}",
        "p q:v1:{1:a}",
        "p:v1{1:a}",
    ] {
        assert!(Key::parse(text).is_err(), "{text:?}");
    }
    let key = Key::parse("order:consume:v2:{1:a,2:bc}").unwrap();
    assert_eq!(key.prefix(), "order:consume");
    assert_eq!(key, Key::new("order:consume", 2, &[&"a", &"bc"]).unwrap());
}

#[test]
fn separator_inside_parts_does_not_collide() {
    let a = Key::new("p", 1, &[&"1:2", &"3"]).unwrap();
    let b = Key::new("p", 1, &[&"1", &"2:3"]).unwrap();
    let c = Key::new("p", 1, &[&"1,2:3"]).unwrap();
    assert_ne!(a, b);
    assert_ne!(a, c);
    assert_ne!(b, c);
}

#[test]
fn version_and_prefix_are_part_of_the_key() {
    let v1 = Key::new("p", 1, &[&7u32]).unwrap();
    let v2 = Key::new("p", 2, &[&7u32]).unwrap();
    let q = Key::new("q", 1, &[&7u32]).unwrap();
    assert_ne!(v1, v2);
    assert_ne!(v1, q);
    assert_eq!(v1.prefix(), "p");
    assert_eq!(v1.to_string(), "p:v1:{1:7}");
}

#[test]
fn long_parts_are_hashed_and_bounded() {
    let long = "x".repeat(MAX_PART_LEN);
    let key = Key::new("order", 1, &[&long, &long]).unwrap();
    assert!(key.is_hashed());
    assert!(key.as_bytes().len() <= MAX_KEY_LEN);
    assert!(key.to_string().starts_with("order:v1:{#"));
    let other = Key::new("order", 1, &[&long, &"y".repeat(MAX_PART_LEN)]).unwrap();
    assert_ne!(key, other);
}

#[test]
fn bad_input_is_a_typed_error() {
    assert_eq!(Key::new("", 1, &[&1u8]), Err(KeyError::EmptyPrefix));
    assert_eq!(
        Key::new("a{b", 1, &[&1u8]),
        Err(KeyError::InvalidPrefix { found: '{' })
    );
    assert_eq!(
        Key::new("a b", 1, &[&1u8]),
        Err(KeyError::InvalidPrefix { found: ' ' })
    );
    assert_eq!(
        Key::new(&"p".repeat(MAX_PREFIX_LEN + 1), 1, &[&1u8]),
        Err(KeyError::PrefixTooLong {
            len: MAX_PREFIX_LEN + 1
        })
    );
    assert_eq!(Key::new("p", 1, &[]), Err(KeyError::NoParts));
    assert_eq!(
        Key::new("p", 1, &[&"a", &""]),
        Err(KeyError::EmptyPart { index: 1 })
    );
    let big = vec![0u8; MAX_PART_LEN + 1];
    assert_eq!(
        Key::new("p", 1, &[&big]),
        Err(KeyError::PartTooLong {
            index: 0,
            len: MAX_PART_LEN + 1
        })
    );
    let many: Vec<&dyn KeyPart> = vec![&1u8; MAX_PARTS + 1];
    assert_eq!(
        Key::new("p", 1, &many),
        Err(KeyError::TooManyParts {
            count: MAX_PARTS + 1
        })
    );
}

#[test]
fn braces_are_escaped_and_the_length_counts_escaped_bytes() {
    let key = Key::new("orders", 1, &[&"2:}x"]).unwrap();
    assert_eq!(key.to_string(), "orders:v1:{6%2:%7Dx}");
    let key = Key::new("p", 1, &[&"%{}", &"%"]).unwrap();
    assert_eq!(key.to_string(), "p:v1:{9%%25%7B%7D,1:%}");
    // The escaped form of a part is not the same key as its escape text written plainly.
    let literal = Key::new("p", 1, &[&"a%7Db"]).unwrap();
    let brace = Key::new("p", 1, &[&"a}b"]).unwrap();
    assert_ne!(literal, brace);
    assert_eq!(literal.to_string(), "p:v1:{5:a%7Db}");
    assert_eq!(brace.to_string(), "p:v1:{5%a%7Db}");
}

#[test]
fn escaped_long_parts_are_hashed_and_bounded() {
    let braces = "}".repeat(MAX_PART_LEN);
    let key = Key::new(&"p".repeat(MAX_PREFIX_LEN), u32::MAX, &[&braces]).unwrap();
    assert!(key.is_hashed());
    assert!(key.as_bytes().len() <= MAX_KEY_LEN);
}

#[test]
fn the_printed_form_reads_back_as_the_same_key() {
    let parts: [&[u8]; 9] = [
        b"caf\xc3\xa9",
        &[0xff, 0x00, 0x80],
        b"a}b{c%",
        b"back\\slash\\x41",
        b"quotes ' and \"",
        b"tab\tcr\rnl\n",
        b"spaces and, commas: colons",
        &[0x7f, 0x1b, b'\\'],
        b"\\",
    ];
    for part in parts {
        let key = Key::new("p:q", 3, &[&part]).unwrap();
        let printed = key.to_string();
        assert!(printed.is_ascii(), "{printed}");
        assert_eq!(Key::parse_escaped(&printed).unwrap(), key, "{printed}");
        assert_eq!(Key::parse_bytes(key.as_bytes()).unwrap(), key);
    }
    let hashed = Key::new("p", 1, &[&[0xffu8; 200]]).unwrap();
    assert_eq!(Key::parse_escaped(&hashed.to_string()).unwrap(), hashed);
    for bad in [
        r"p:v1:{1:\}",
        r"p:v1:{1:\q}",
        r"p:v1:{1:\x4}",
        r"p:v1:{1:\xzz}",
        r"p:v1:{2:a\",
    ] {
        assert!(Key::parse_escaped(bad).is_err(), "{bad}");
    }
    // An escaped brace is still a brace: the parts may hold none.
    assert!(Key::parse_escaped(r"p:v1:{1:\x7d}").is_err());
    assert!(Key::parse_bytes(b"p\xff:v1:{1:a}").is_err());
}

#[test]
fn non_utf8_bytes_are_kept_exactly() {
    let a = Key::new("p", 1, &[&[0xffu8, 0x00]]).unwrap();
    let b = Key::new("p", 1, &[&[0xfeu8, 0x00]]).unwrap();
    assert_ne!(a, b);
    assert_eq!(&a.as_bytes()[..8], b"p:v1:{2:");
    assert_eq!(a.to_string(), "p:v1:{2:\\xff\\x00}");
}

#[test]
fn a_prefix_is_refused_for_the_same_characters_on_either_path() {
    // The rule, as the character path states it; the byte path must agree on every ASCII
    // character, and non-ASCII ones take the character path.
    let refused = |c: char| matches!(c, '{' | '}') || c.is_whitespace() || c.is_control();
    let samples = (0u8..=0x7f)
        .map(char::from)
        .chain(['é', '\u{85}', '\u{a0}', '\u{2003}', '\u{3000}', '注']);
    for c in samples {
        let prefix = format!("order{c}consume");
        assert_eq!(
            Key::new(&prefix, 1, &[&"7"]).is_err(),
            refused(c),
            "{c:?} (U+{:04X})",
            u32::from(c)
        );
    }
}

/// A part that builds a key of its own while it is written, and writes that key's text.
struct Nested;

impl KeyPart for Nested {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        match Key::new("inner", 3, &[&"a"]) {
            Ok(inner) => out.extend_from_slice(inner.as_bytes()),
            Err(_) => out.extend_from_slice(b"no inner key"),
        }
    }
}

#[test]
fn a_part_that_builds_a_key_while_it_is_written_gets_both_keys_right() {
    let key = Key::new("outer", 1, &[&"x", &Nested, &"y"]).unwrap();
    let inner = Key::new("inner", 3, &[&"a"]).unwrap();
    assert_eq!(inner.to_string(), "inner:v3:{1:a}");
    let expected = Key::new("outer", 1, &[&"x", &inner.to_string(), &"y"]).unwrap();
    assert_eq!(key, expected);
}

#[test]
fn a_key_after_a_refused_or_long_one_carries_nothing_of_it() {
    let first = Key::new("p", 1, &[&"abc", &7u32]).unwrap();
    // Refused after a part was written: an empty part, and a part over the limit.
    assert!(matches!(
        Key::new("q", 2, &[&"left over", &""]),
        Err(KeyError::EmptyPart { index: 1 })
    ));
    let over = "z".repeat(MAX_PART_LEN + 1);
    assert!(matches!(
        Key::new("q", 2, &[&"left over", &over]),
        Err(KeyError::PartTooLong { index: 1, .. })
    ));
    assert_eq!(Key::new("p", 1, &[&"abc", &7u32]).unwrap(), first);
    // The longest key there is, hashed, then a short one.
    let long = "x".repeat(MAX_PART_LEN);
    let parts: Vec<&dyn KeyPart> = vec![&long; MAX_PARTS];
    assert!(Key::new("p", 1, &parts).unwrap().is_hashed());
    let again = Key::new("p", 1, &[&"abc", &7u32]).unwrap();
    assert_eq!(again, first);
    assert_eq!(again.to_string(), "p:v1:{3:abc,1:7}");
}

#[test]
fn keys_built_on_many_threads_are_each_their_own() {
    let threads: Vec<_> = (0..4u32)
        .map(|thread| {
            std::thread::spawn(move || {
                (0..200u32)
                    .map(|n| Key::new("t", thread, &[&n]).map(|key| key.to_string()))
                    .collect::<Result<Vec<_>, _>>()
            })
        })
        .collect();
    for (thread, handle) in threads.into_iter().enumerate() {
        let keys = handle.join().unwrap().unwrap();
        for (n, key) in keys.iter().enumerate() {
            let n = n.to_string();
            assert_eq!(key, &format!("t:v{thread}:{{{}:{n}}}", n.len()));
        }
    }
}
