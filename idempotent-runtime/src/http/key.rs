//! The `Idempotency-Key` header: found under one of the configured names, read as a
//! structured-field string (RFC 8941, as the IETF draft defines it) or, leniently, as a bare
//! token.

use http::{HeaderMap, HeaderName};

/// What the request carries as its idempotency key.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum KeyHeader {
    /// No header under any configured name.
    Missing,
    /// A header that is not one valid key; the reason, for the problem's detail.
    Invalid(String),
    /// The key, unescaped.
    Key(String),
}

/// Reads the key from `headers`, under any of `names`. More than one value (the same header
/// twice, or two names at once) is invalid: which one would be the key?
pub(crate) fn read(headers: &HeaderMap, names: &[HeaderName], max_len: usize) -> KeyHeader {
    let mut values = names.iter().flat_map(|name| headers.get_all(name));
    let Some(value) = values.next() else {
        return KeyHeader::Missing;
    };
    if values.next().is_some() {
        return KeyHeader::Invalid("the request has more than one idempotency key header".into());
    }
    match parse(value.as_bytes()) {
        Ok(key) if key.is_empty() => KeyHeader::Invalid("the idempotency key is empty".into()),
        Ok(key) if key.len() > max_len => KeyHeader::Invalid(format!(
            "the idempotency key is {} characters long; at most {max_len} are accepted",
            key.len()
        )),
        Ok(key) => KeyHeader::Key(key),
        Err(why) => KeyHeader::Invalid(format!("the idempotency key {why}")),
    }
}

/// A structured-field string (`"..."`, printable ASCII, `\"` and `\\` escapes), or a bare
/// token of visible ASCII without quotes, backslashes, commas or semicolons (what most clients
/// send: a UUID).
fn parse(raw: &[u8]) -> Result<String, &'static str> {
    let raw = trim(raw);
    let Some(quoted) = raw.strip_prefix(b"\"") else {
        return match raw
            .iter()
            .all(|&b| b.is_ascii_graphic() && !matches!(b, b'"' | b'\\' | b',' | b';'))
        {
            // Only ASCII bytes: the conversion cannot fail.
            true => Ok(String::from_utf8_lossy(raw).into_owned()),
            false => Err("is neither a quoted string nor a token of visible ASCII characters"),
        };
    };
    let mut key = String::with_capacity(quoted.len());
    let mut bytes = quoted.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => key.push(char::from(escaped)),
                _ => return Err("has a backslash that escapes neither `\"` nor `\\`"),
            },
            b'"' => {
                return match bytes.next() {
                    None => Ok(key),
                    Some(_) => Err("has characters after its closing quote"),
                }
            }
            0x20..=0x7e => key.push(char::from(b)),
            _ => return Err("has a character outside printable ASCII"),
        }
    }
    Err("has no closing quote")
}

fn trim(raw: &[u8]) -> &[u8] {
    let start = raw.iter().position(|&b| b != b' ' && b != b'\t');
    let end = raw.iter().rposition(|&b| b != b' ' && b != b'\t');
    match (start, end) {
        (Some(start), Some(end)) => &raw[start..=end],
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use http::HeaderValue;

    fn names() -> Vec<HeaderName> {
        vec![
            HeaderName::from_static("idempotency-key"),
            HeaderName::from_static("x-idempotency-key"),
        ]
    }

    fn one(value: &[u8]) -> KeyHeader {
        let mut headers = HeaderMap::new();
        headers.insert("idempotency-key", HeaderValue::from_bytes(value).unwrap());
        read(&headers, &names(), 255)
    }

    #[test]
    fn quoted_strings_and_tokens_are_keys() {
        let key = |s: &str| KeyHeader::Key(s.to_owned());
        assert_eq!(one(b"\"8e03978e-40d5-43e8\""), key("8e03978e-40d5-43e8"));
        assert_eq!(one(b"8e03978e-40d5-43e8"), key("8e03978e-40d5-43e8"));
        assert_eq!(one(br#""a \"b\" \\ c""#), key(r#"a "b" \ c"#));
        assert_eq!(one(b"  tok  "), key("tok"));
        assert_eq!(one(b"\" spaced key \""), key(" spaced key "));
    }

    #[test]
    fn malformed_values_are_invalid() {
        for bad in [
            &b"\"open"[..],
            b"\"a\" trailing",
            b"\"a\", \"b\"",
            b"a, b",
            b"a;b",
            b"two words",
            b"\"bad \\x escape\"",
            b"\"tab\tinside\"",
            "\"caf\u{e9}\"".as_bytes(),
            "caf\u{e9}".as_bytes(),
        ] {
            assert!(
                matches!(one(bad), KeyHeader::Invalid(_)),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn empty_and_long_keys_are_invalid() {
        assert!(matches!(one(b""), KeyHeader::Invalid(why) if why.contains("empty")));
        assert!(matches!(one(b"\"\""), KeyHeader::Invalid(why) if why.contains("empty")));
        let long = "k".repeat(256);
        assert!(matches!(one(long.as_bytes()), KeyHeader::Invalid(why) if why.contains("256")));
        assert_eq!(
            one(&long.as_bytes()[1..]),
            KeyHeader::Key(long[1..].to_owned())
        );
    }

    #[test]
    fn missing_and_repeated_headers() {
        assert_eq!(read(&HeaderMap::new(), &names(), 255), KeyHeader::Missing);
        let mut twice = HeaderMap::new();
        twice.append("idempotency-key", HeaderValue::from_static("a"));
        twice.append("idempotency-key", HeaderValue::from_static("a"));
        assert!(matches!(read(&twice, &names(), 255), KeyHeader::Invalid(_)));
        let mut both = HeaderMap::new();
        both.insert("idempotency-key", HeaderValue::from_static("a"));
        both.insert("x-idempotency-key", HeaderValue::from_static("a"));
        assert!(matches!(read(&both, &names(), 255), KeyHeader::Invalid(_)));
        let mut legacy = HeaderMap::new();
        legacy.insert("x-idempotency-key", HeaderValue::from_static("a"));
        assert_eq!(read(&legacy, &names(), 255), KeyHeader::Key("a".into()));
    }
}
