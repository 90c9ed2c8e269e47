//! Operation keys: a readable prefix, a version and an injective encoding of the parts.
//!
//! A key looks like `order:consume:v1:{8:A-100231,3:a17}`:
//!
//! - the **prefix** is kept readable so operators can find records with `SCAN` or `LIKE`;
//! - the **version** lets a team change what a key means on purpose (bump it) instead of by
//!   accident;
//! - the **parts** are each written as `<length>:<bytes>`, so `("1:2", "3")` and
//!   `("1", "2:3")` can never produce the same key, whatever bytes the parts contain;
//! - a part holding a brace is written `<length>%<escaped bytes>` instead: `%` becomes `%25`,
//!   `{` becomes `%7B` and `}` becomes `%7D`, and the length counts the escaped bytes, so
//!   `"a}b"` is `5%a%7Db`. The `%` after the length says the part is escaped; parts without
//!   braces (ordinary identifiers) are written as they are, `%` included;
//! - the parts sit inside `{...}`, a Redis Cluster hash tag, so every Redis key that belongs
//!   to one record hashes to the same slot. Since no brace is left inside, the tag is always
//!   the whole parts section: a part cannot end it early to choose the slot (Redis hashes the
//!   bytes between the first `{` and the next `}`);
//! - when the encoded parts are longer than [`MAX_INLINE_PARTS`] bytes they are replaced by
//!   `#` and the hex SHA-256 of their encoding, so a key never grows past [`MAX_KEY_LEN`] bytes.
//!   An inline encoding always starts with a digit, so a hashed key can never equal an inline one.
//!
//! Keys are exact bytes: a part may hold any bytes, including invalid UTF-8.
//!
//! # Format changes
//!
//! Format 2 (current) escapes parts that hold a brace, as above. Format 1 wrote every part
//! as `<length>:<bytes>`, braces included, so such a part could end the hash tag early. Keys
//! whose parts hold no brace are the same in both formats, so their records carry over an
//! upgrade. A key with an escaped part is new: no format 1 key has a `%` right after a part's
//! length, so it never equals the format 1 key of another tuple; but a record written by
//! format 1 for a part holding a brace is not found by format 2 (a duplicate of such a
//! message arriving across the upgrade runs again unless the handler's `done` check answers).

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// Longest accepted prefix, in bytes.
pub const MAX_PREFIX_LEN: usize = 128;
/// Most parts a key may have.
pub const MAX_PARTS: usize = 16;
/// Longest accepted single part, in bytes. Longer input is almost always a payload passed by
/// mistake where a business identifier was meant; use a [`Fingerprint`](crate::Fingerprint)
/// for payloads.
pub const MAX_PART_LEN: usize = 4096;
/// Encoded parts longer than this are stored as their SHA-256 digest.
pub const MAX_INLINE_PARTS: usize = 128;
/// Upper bound on the length of any encoded key, in bytes.
pub const MAX_KEY_LEN: usize = MAX_PREFIX_LEN + ":v4294967295:{}".len() + MAX_INLINE_PARTS;

mod part;

pub use part::KeyPart;

/// Why a key could not be built. Returned inside [`Error::InvalidKey`](crate::Error::InvalidKey).
///
/// A consumer should dead-letter the message: retrying cannot make a bad key good.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The prefix is empty.
    #[error("the key prefix is empty")]
    EmptyPrefix,
    /// The prefix is longer than [`MAX_PREFIX_LEN`] bytes.
    #[error("the key prefix is {len} bytes long; at most {MAX_PREFIX_LEN} are allowed")]
    PrefixTooLong {
        /// The prefix's length in bytes.
        len: usize,
    },
    /// The prefix holds a character that is not allowed (`{`, `}`, white space or a control
    /// character): braces would break the Redis Cluster hash tag.
    #[error("the key prefix contains {found:?}; braces, white space and control characters are not allowed")]
    InvalidPrefix {
        /// The offending character.
        found: char,
    },
    /// No parts were given.
    #[error("an idempotency key needs at least one part")]
    NoParts,
    /// More than [`MAX_PARTS`] parts were given.
    #[error("an idempotency key has {count} parts; at most {MAX_PARTS} are allowed")]
    TooManyParts {
        /// How many parts were given.
        count: usize,
    },
    /// A part wrote no bytes (an empty string, say): an empty identifier is almost always a
    /// missing field, and would make every such message a duplicate of the first.
    #[error("key part {index} is empty")]
    EmptyPart {
        /// Zero-based position of the part.
        index: usize,
    },
    /// A part is longer than [`MAX_PART_LEN`] bytes.
    #[error("key part {index} is {len} bytes long; at most {MAX_PART_LEN} are allowed")]
    PartTooLong {
        /// Zero-based position of the part.
        index: usize,
        /// The part's length in bytes.
        len: usize,
    },
    /// A text given to [`Key::parse`] is not an encoded key
    /// (`<prefix>:v<version>:{<parts>}`).
    #[error("not an encoded idempotency key: {why}")]
    NotAKey {
        /// What is wrong with it.
        why: &'static str,
    },
}

/// An encoded operation key. Cheap to clone.
///
/// ```
/// use idempotent_runtime::Key;
///
/// let a = Key::new("order:consume", 1, &[&"1:2", &"3"])?;
/// let b = Key::new("order:consume", 1, &[&"1", &"2:3"])?;
/// assert_ne!(a, b);
/// assert_eq!(a.to_string(), "order:consume:v1:{3:1:2,1:3}");
///
/// // A part holding a brace is escaped, so the hash tag stays the whole `{...}`.
/// let c = Key::new("order:consume", 1, &[&"A-1}"])?;
/// assert_eq!(c.to_string(), "order:consume:v1:{6%A-1%7D}");
/// # Ok::<(), idempotent_runtime::KeyError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    bytes: Arc<[u8]>,
    prefix_len: usize,
}

/// The largest scratch buffer a thread keeps between keys; one grown past it by a long part is
/// let go.
const SCRATCH_KEPT: usize = 4 * 1024;

thread_local! {
    /// Where a key is written before it is copied, once, into its shared buffer: one
    /// allocation a key, not two.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// The key of `prefix`, `version` and `parts`, written in this thread's scratch buffer, or in
/// a fresh one when that is in use (a key part that builds a key while it is written) or
/// already gone (a thread that is ending).
fn encode(prefix: &str, version: u32, parts: &[&dyn KeyPart]) -> Result<Arc<[u8]>, KeyError> {
    let kept = SCRATCH.try_with(|scratch| {
        let mut buffer = scratch.try_borrow_mut().ok()?;
        buffer.clear();
        let out = write_key(&mut buffer, prefix, version, parts).map(|()| Arc::from(&buffer[..]));
        if buffer.capacity() > SCRATCH_KEPT {
            *buffer = Vec::new();
        }
        Some(out)
    });
    match kept {
        Ok(Some(out)) => out,
        Ok(None) | Err(_) => {
            let mut buffer = Vec::new();
            write_key(&mut buffer, prefix, version, parts)?;
            Ok(Arc::from(buffer))
        }
    }
}

/// Writes the key of `prefix`, `version` and `parts` into `bytes` (empty): the header, then
/// each part written in place and encoded where it lies.
fn write_key(
    bytes: &mut Vec<u8>,
    prefix: &str,
    version: u32,
    parts: &[&dyn KeyPart],
) -> Result<(), KeyError> {
    bytes.reserve(prefix.len() + 16 + 64);
    bytes.extend_from_slice(prefix.as_bytes());
    bytes.extend_from_slice(b":v");
    push_decimal(bytes, u64::from(version));
    bytes.extend_from_slice(b":{");
    let body_start = bytes.len();
    for (index, part) in parts.iter().enumerate() {
        if index > 0 {
            bytes.push(b',');
        }
        let start = bytes.len();
        part.write_key_part(bytes);
        let len = bytes.len() - start;
        if len == 0 {
            return Err(KeyError::EmptyPart { index });
        }
        if len > MAX_PART_LEN {
            return Err(KeyError::PartTooLong { index, len });
        }
        encode_in_place(bytes, start);
    }
    if bytes.len() - body_start > MAX_INLINE_PARTS {
        let digest = Sha256::digest(&bytes[body_start..]);
        bytes.truncate(body_start);
        bytes.push(b'#');
        push_hex(bytes, &digest);
    }
    bytes.push(b'}');
    Ok(())
}

impl Key {
    /// Builds a key from a prefix, a version and the parts, in order.
    ///
    /// # Errors
    ///
    /// A [`KeyError`] when the prefix or a part breaks a rule listed on that type.
    pub fn new(prefix: &str, version: u32, parts: &[&dyn KeyPart]) -> Result<Key, KeyError> {
        validate_prefix(prefix)?;
        if parts.is_empty() {
            return Err(KeyError::NoParts);
        }
        if parts.len() > MAX_PARTS {
            return Err(KeyError::TooManyParts { count: parts.len() });
        }
        Ok(Key {
            bytes: encode(prefix, version, parts)?,
            prefix_len: prefix.len(),
        })
    }

    /// The key whose encoding is `encoded`, as [`Key::new`] wrote it
    /// (`<prefix>:v<version>:{<parts>}`): for operators and tools that have a key's text, from
    /// a store or a log line without escapes. The parts are taken as they are written.
    ///
    /// ```
    /// use idempotent_runtime::Key;
    ///
    /// let key = Key::new("order:consume", 1, &[&"A-1001", &"free-meal-2026"])?;
    /// assert_eq!(Key::parse(&key.to_string())?, key);
    /// assert!(Key::parse("order:consume:{1:a}").is_err());
    /// # Ok::<(), idempotent_runtime::KeyError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`KeyError::NotAKey`] when the text does not have that shape (no version, no braces,
    /// a brace inside the parts, longer than [`MAX_KEY_LEN`]), or the prefix's error from
    /// [`Key::new`]'s rules.
    pub fn parse(encoded: &str) -> Result<Key, KeyError> {
        Key::parse_bytes(encoded.as_bytes())
    }

    /// [`Key::parse`] on the stored bytes of a key, whose parts may be any bytes (invalid
    /// UTF-8 included): the key a store holds under `encoded`.
    ///
    /// ```
    /// use idempotent_runtime::Key;
    ///
    /// let key = Key::new("order:consume", 1, &[&[0xffu8, b'}']])?;
    /// assert_eq!(Key::parse_bytes(key.as_bytes())?, key);
    /// # Ok::<(), idempotent_runtime::KeyError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Key::parse`]; the prefix and version must be UTF-8.
    pub fn parse_bytes(encoded: &[u8]) -> Result<Key, KeyError> {
        let not = |why| KeyError::NotAKey { why };
        if encoded.len() > MAX_KEY_LEN {
            return Err(not("longer than any key"));
        }
        let open = encoded
            .iter()
            .position(|&b| b == b'{')
            .ok_or_else(|| not("no `{` before the parts"))?;
        let body = encoded[open + 1..]
            .strip_suffix(b"}")
            .ok_or_else(|| not("no `}` at the end"))?;
        if body.is_empty() || body.iter().any(|b| matches!(b, b'{' | b'}')) {
            return Err(not("the parts are empty or hold a brace"));
        }
        let head = std::str::from_utf8(&encoded[..open])
            .map_err(|_| not("the prefix is not UTF-8"))?
            .strip_suffix(':')
            .ok_or_else(|| not("no `:` before the parts"))?;
        let at = head.rfind(":v").ok_or_else(|| not("no `:v<version>`"))?;
        let version = &head[at + 2..];
        if version.is_empty() || !version.bytes().all(|b| b.is_ascii_digit()) {
            return Err(not("the version is not a number"));
        }
        version
            .parse::<u32>()
            .map_err(|_| not("the version is out of range"))?;
        let prefix = &head[..at];
        validate_prefix(prefix)?;
        Ok(Key {
            bytes: encoded.into(),
            prefix_len: prefix.len(),
        })
    }

    /// The key whose printed form (its [`Display`](fmt::Display), as logs and
    /// `idempotent-admin` show it) is `printed`: the inverse of `to_string`. Printable ASCII
    /// stands for itself, `\\`, `\'` and `\"` for a backslash and the quotes, `\t`, `\r`
    /// and `\n` for those controls, and `\xNN` (two hex digits) for any other byte; other
    /// characters stand for their UTF-8 bytes.
    ///
    /// ```
    /// use idempotent_runtime::Key;
    ///
    /// let key = Key::new("order:consume", 1, &[&"café", &[0xffu8, 0x00]])?;
    /// assert_eq!(key.to_string(), r"order:consume:v1:{5:caf\xc3\xa9,2:\xff\x00}");
    /// assert_eq!(Key::parse_escaped(&key.to_string())?, key);
    /// // Typed as it is, a character outside ASCII is its UTF-8 bytes.
    /// let typed = Key::parse_escaped("order:consume:v1:{5:café}")?;
    /// assert_eq!(typed, Key::new("order:consume", 1, &[&"café"])?);
    /// # Ok::<(), idempotent_runtime::KeyError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`KeyError::NotAKey`] for a `\` that starts no escape above, or what
    /// [`Key::parse_bytes`] refuses in the bytes it stands for.
    pub fn parse_escaped(printed: &str) -> Result<Key, KeyError> {
        let not = |why| KeyError::NotAKey { why };
        let mut bytes = Vec::with_capacity(printed.len());
        let mut rest = printed.as_bytes();
        while let Some((&b, tail)) = rest.split_first() {
            rest = tail;
            if b != b'\\' {
                bytes.push(b);
                continue;
            }
            let (&escape, tail) = rest
                .split_first()
                .ok_or_else(|| not("a `\\` ends the text"))?;
            rest = tail;
            bytes.push(match escape {
                b'\\' | b'\'' | b'"' => escape,
                b't' => b'\t',
                b'r' => b'\r',
                b'n' => b'\n',
                b'x' => {
                    let digit = |i: usize| rest.get(i).and_then(|&c| char::from(c).to_digit(16));
                    let (Some(high), Some(low)) = (digit(0), digit(1)) else {
                        return Err(not("`\\x` is not followed by two hex digits"));
                    };
                    rest = &rest[2..];
                    u8::try_from(high * 16 + low).map_err(|_| not("`\\x` is out of range"))?
                }
                _ => return Err(not(
                    "a `\\` starts no escape (`\\\\`, `\\'`, `\\\"`, `\\t`, `\\r`, `\\n`, `\\xNN`)",
                )),
            });
        }
        Key::parse_bytes(&bytes)
    }

    /// The encoded key, as stored.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The readable prefix the key was built with.
    pub fn prefix(&self) -> &str {
        // The prefix was validated as a `&str` and is stored unchanged at the front.
        std::str::from_utf8(&self.bytes[..self.prefix_len]).unwrap_or_default()
    }

    /// Whether the parts were long enough to be replaced by their digest.
    pub fn is_hashed(&self) -> bool {
        self.bytes
            .iter()
            .position(|&b| b == b'{')
            .is_some_and(|at| self.bytes.get(at + 1) == Some(&b'#'))
    }
}

impl fmt::Display for Key {
    /// Writes the key with bytes outside printable ASCII escaped (`\xNN`), as well as
    /// backslashes and quotes, for logs and operators; [`Key::parse_escaped`] reads it back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.bytes.escape_ascii(), f)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key(\"{}\")", self.bytes.escape_ascii())
    }
}

fn validate_prefix(prefix: &str) -> Result<(), KeyError> {
    if prefix.is_empty() {
        return Err(KeyError::EmptyPrefix);
    }
    if prefix.len() > MAX_PREFIX_LEN {
        return Err(KeyError::PrefixTooLong { len: prefix.len() });
    }
    // The common prefix is printable ASCII: one pass over its bytes, without an early exit so
    // that it runs many bytes at a time. Among ASCII characters, the whitespace that is not a
    // control character is the space: printable and not a space is `!` to `~`.
    let plain = prefix.as_bytes().iter().fold(true, |plain, &b| {
        plain & (b'!'..=b'~').contains(&b) & (b != b'{') & (b != b'}')
    });
    if plain {
        return Ok(());
    }
    if let Some(found) = prefix
        .chars()
        .find(|c| matches!(c, '{' | '}') || c.is_whitespace() || c.is_control())
    {
        return Err(KeyError::InvalidPrefix { found });
    }
    Ok(())
}

/// Encodes the raw part that `out[start..]` holds as [`push_part`] writes it, in place: the
/// length prefix is moved in front of the bytes (a part holding a brace is escaped through a
/// copy, the rare case).
fn encode_in_place(out: &mut Vec<u8>, start: usize) {
    if out[start..].iter().any(|b| matches!(b, b'{' | b'}')) {
        let raw = out.split_off(start);
        push_part(out, &raw);
        return;
    }
    let len = out.len() - start;
    let before = out.len();
    push_decimal(out, len as u64);
    out.push(b':');
    let prefix_len = out.len() - before;
    out[start..].rotate_right(prefix_len);
}

/// Writes one part: `<length>:<bytes>` when it holds no brace, otherwise `<length>%<escaped>`
/// with `%`, `{` and `}` percent-escaped and the length counting the escaped bytes.
fn push_part(out: &mut Vec<u8>, part: &[u8]) {
    if !part.iter().any(|b| matches!(b, b'{' | b'}')) {
        push_decimal(out, part.len() as u64);
        out.push(b':');
        out.extend_from_slice(part);
        return;
    }
    // Each escaped byte takes three.
    let escaped_len = part.len()
        + 2 * part
            .iter()
            .filter(|b| matches!(b, b'%' | b'{' | b'}'))
            .count();
    push_decimal(out, escaped_len as u64);
    out.push(b'%');
    for &b in part {
        match b {
            b'%' => out.extend_from_slice(b"%25"),
            b'{' => out.extend_from_slice(b"%7B"),
            b'}' => out.extend_from_slice(b"%7D"),
            _ => out.push(b),
        }
    }
}

/// Appends `n` in decimal (the formatting machinery costs several times more, on paths every
/// call takes: keys, and the Redis records' fields).
pub(crate) fn push_decimal(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

pub(crate) fn push_hex(out: &mut Vec<u8>, bytes: &[u8]) {
    for b in bytes {
        out.push(HEX[usize::from(b >> 4)]);
        out.push(HEX[usize::from(b & 0x0f)]);
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// `bytes` as lowercase hex.
#[cfg(any(
    feature = "http",
    feature = "memory",
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite"
))]
pub(crate) fn hex_string(bytes: &[u8]) -> String {
    bytes
        .iter()
        .flat_map(|b| [HEX[usize::from(b >> 4)], HEX[usize::from(b & 0x0f)]])
        .map(char::from)
        .collect()
}

/// The bytes that `text` writes in hex (either case), or `None` when it is not hex.
#[cfg(any(
    feature = "memory",
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite"
))]
pub(crate) fn parse_hex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    text.as_bytes()
        .chunks(2)
        .map(|pair| {
            let digit = |c: u8| char::from(c).to_digit(16);
            u8::try_from(digit(pair[0])? * 16 + digit(pair[1])?).ok()
        })
        .collect()
}

#[cfg(test)]
mod tests;
