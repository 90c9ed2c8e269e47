//! A guarded request before anything is claimed: its key header, caller and body read, its
//! store key and fingerprint built.
//!
//! The key is the caller's and the client's key alone: per the IETF draft an
//! `Idempotency-Key` identifies one request, so its method, path and query belong to the
//! fingerprint, and the same key on another route is a payload mismatch rather than a second
//! run. The path is compared as a router reads it (see [`path`]).

use std::borrow::Cow;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::request::Parts;
use http::{header, Request, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use sha2::{Digest, Sha256};

use crate::http::body::{Body, BoxError};
use crate::http::key::{self, KeyHeader};
use crate::http::respond::reject;
use crate::http::{Config, Problem};
use crate::key::{hex_string, Key, KeyError};
use crate::store::Fingerprint;

/// The version in the key's layout: `<prefix>:v2:{scope, client key}`.
const KEY_VERSION: u32 = 2;

/// A guarded request, read and keyed, before anything is claimed.
pub(crate) struct Prepared {
    pub(crate) parts: Parts,
    pub(crate) bytes: Bytes,
    pub(crate) key: Key,
    pub(crate) fingerprint: Fingerprint,
    /// The key the same request had in the previous layout (`<prefix>:v1:{scope, method,
    /// path, client key}`), when the layer checks it ([`IdempotencyLayer::previous_layout`]).
    ///
    /// [`IdempotencyLayer::previous_layout`]: crate::http::IdempotencyLayer::previous_layout
    pub(crate) previous: Option<Key>,
}

impl Prepared {
    /// Whether the previous layout's record of this request says it was completed: a retry
    /// that spans an upgrade of the layer must not run the handler again. A read that has not
    /// answered within the engine's bound on a store call (half the lease) is an error. For a
    /// request run in the caller's transaction (the layer's own requests hand the key to the
    /// engine, which reads it with the claim).
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub(crate) async fn done_before(
        previous: Option<&Key>,
        config: &Config,
    ) -> Result<bool, crate::Error> {
        let Some(previous) = previous else {
            return Ok(false);
        };
        let Some(store) = config
            .idempotency
            .store
            .clone()
            .or_else(crate::default_store)
        else {
            return Ok(false);
        };
        // Bounded as every store call of an owner's path is: a read that never answers (a
        // custom store, a silent connection) is abandoned, and the engine gives the claim back.
        let bound = crate::store::deadline::call_bound(config.idempotency.lease_duration());
        Ok(crate::engine::bounded(
            bound,
            "previous layout's read",
            store.is_completed(previous),
        )
        .await?)
    }
}

/// What becomes of a request before anything is claimed.
pub(crate) enum Guarded<B> {
    /// Not guarded: its method, or no key where none is required.
    Pass(Request<B>),
    /// Refused with a problem.
    Answer(Response<Body>),
    /// To run under its key.
    Run(Prepared),
}

/// Reads the key, the scope and the body of `request` (only for the layer's methods when
/// `by_method`), and builds its key and fingerprint.
pub(crate) async fn prepare<B>(config: &Config, request: Request<B>, by_method: bool) -> Guarded<B>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let counts = &config.counts;
    if by_method && !config.methods.contains(request.method()) {
        counts.passed_through.fetch_add(1, Ordering::Relaxed);
        return Guarded::Pass(request);
    }
    let client_key = match key::read(request.headers(), &config.header_names, config.max_key_len) {
        KeyHeader::Key(key) => key,
        KeyHeader::Missing if !config.require_key => {
            counts.passed_through.fetch_add(1, Ordering::Relaxed);
            return Guarded::Pass(request);
        }
        KeyHeader::Missing => {
            let detail = format!(
                "{} requests need an {} header",
                request.method(),
                config
                    .header_names
                    .first()
                    .map_or("Idempotency-Key", |n| n.as_str())
            );
            return Guarded::Answer(reject(config, Problem::MissingKey, &detail));
        }
        KeyHeader::Invalid(why) => {
            return Guarded::Answer(reject(config, Problem::InvalidKey, &why))
        }
    };
    let (parts, body) = request.into_parts();
    let Some(scope) = (config.scope)(&parts) else {
        let detail = "the request has no caller to scope its idempotency key to";
        return Guarded::Answer(reject(config, Problem::MissingScope, detail));
    };
    let bytes = match read_request(&parts, body, config.max_request_body).await {
        Ok(bytes) => bytes,
        Err((problem, detail)) => return Guarded::Answer(reject(config, problem, &detail)),
    };
    let payload = match config.fingerprint {
        Some(custom) => custom(&parts, &bytes),
        None => payload(&parts, &bytes),
    };
    let fingerprint = fingerprint(&parts, &payload);
    let scope = hex_string(&Sha256::digest(scope.as_bytes())[..16]);
    // A path too long for a key part had no key in the previous layout either.
    let previous = config.previous_layout.then(|| {
        let parts: [&dyn crate::key::KeyPart; 4] = [
            &scope,
            &parts.method.as_str(),
            &parts.uri.path(),
            &client_key,
        ];
        Key::new(&config.prefix, 1, &parts).ok()
    });
    match Key::new(&config.prefix, KEY_VERSION, &[&scope, &client_key]) {
        Ok(key) => Guarded::Run(Prepared {
            parts,
            bytes,
            key,
            fingerprint,
            previous: previous.flatten(),
        }),
        // The client's key is longer than a key part can be (a `max_key_len` above it).
        Err(err @ KeyError::PartTooLong { index: 1, .. }) => {
            let detail = format!("the idempotency key is too long: {err}");
            Guarded::Answer(reject(config, Problem::InvalidKey, &detail))
        }
        Err(err) => Guarded::Answer(reject(config, Problem::Internal, &err.to_string())),
    }
}

/// The request body, whole, or why not.
pub(crate) async fn read_request<B>(
    parts: &Parts,
    body: B,
    max: usize,
) -> Result<Bytes, (Problem, String)>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        let detail = format!("the request body is larger than {max} bytes");
        (Problem::RequestTooLarge, detail)
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > max as u64) {
        return Err(too_large());
    }
    match Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(err) => Err((
            Problem::InvalidBody,
            format!("the request body could not be read: {err}"),
        )),
    }
}

/// The request's fingerprint: SHA-256 of the method, the path as [`path`] normalises it and
/// `payload` (the query and body's, or the application's fingerprint), each length-prefixed.
fn fingerprint(parts: &Parts, payload: &Fingerprint) -> Fingerprint {
    digest([
        parts.method.as_str().as_bytes(),
        &path(parts.uri.path()),
        payload.as_bytes(),
    ])
}

/// The default payload fingerprint: the query as [`query`] normalises it, and the body.
fn payload(parts: &Parts, body: &[u8]) -> Fingerprint {
    digest([&query(parts.uri.query().unwrap_or("")), body])
}

/// The first 16 bytes of the SHA-256 of `parts`, each length-prefixed.
fn digest<const N: usize>(parts: [&[u8]; N]) -> Fingerprint {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    let digest = hash.finalize();
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    Fingerprint::from_bytes(first)
}

/// The path as a router reads it: every percent-escape decoded (axum decodes each escape in
/// the path parameters it captures, reserved characters included) but those of `/` and `%`,
/// which stay escaped with uppercase hex, since `a%2Fb` is one segment and `a/b` two, and
/// `%2541` is the text `%41`. Letter case, trailing slashes and dot segments are left as they
/// are: the router tells them apart.
pub(crate) fn path(raw: &str) -> Cow<'_, [u8]> {
    normalise(raw, |b| b == b'/' || b == b'%')
}

/// The query per RFC 3986 section 6.2.2: escapes of unreserved characters decoded, the others
/// kept with uppercase hex (`%2B` is a plus sign where `+` may be a space, `%26` is not `&`).
pub(crate) fn query(raw: &str) -> Cow<'_, [u8]> {
    normalise(raw, |b| {
        !(b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'))
    })
}

/// `raw` with each `%XX` escape decoded, or kept with uppercase hex when `keep` says so; a `%`
/// without two hex digits after it is left as it is.
fn normalise(raw: &str, keep: impl Fn(u8) -> bool) -> Cow<'_, [u8]> {
    let bytes = raw.as_bytes();
    if !bytes.contains(&b'%') {
        return Cow::Borrowed(bytes);
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escape = match bytes.get(i..i + 3) {
            Some(&[b'%', hi, lo]) => hex(hi).zip(hex(lo)).map(|(hi, lo)| hi << 4 | lo),
            _ => None,
        };
        match escape {
            Some(decoded) if keep(decoded) => {
                out.push(b'%');
                out.extend(bytes[i + 1..i + 3].iter().map(u8::to_ascii_uppercase));
                i += 3;
            }
            Some(decoded) => {
                out.push(decoded);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    Cow::Owned(out)
}

fn hex(digit: u8) -> Option<u8> {
    char::from(digit)
        .to_digit(16)
        .and_then(|d| u8::try_from(d).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(raw: &str) -> String {
        String::from_utf8_lossy(&path(raw)).into_owned()
    }

    fn q(raw: &str) -> String {
        String::from_utf8_lossy(&query(raw)).into_owned()
    }

    #[test]
    fn paths_decode_all_but_slashes_and_percents() {
        assert_eq!(p("/pay/abc"), "/pay/abc");
        assert_eq!(p("/pay/%61%62c"), "/pay/abc");
        assert_eq!(p("/pay/a%40b"), "/pay/a@b");
        assert_eq!(p("/pay/x%2fy"), "/pay/x%2Fy");
        assert_eq!(p("/pay/x%2Fy"), "/pay/x%2Fy");
        assert_eq!(p("/pay/%2541"), "/pay/%2541");
        assert_eq!(p("/pay/%c3%A9"), "/pay/\u{e9}");
        // Left alone: what the router tells apart, and escapes that are not escapes.
        assert_eq!(p("/Pay/ABC/"), "/Pay/ABC/");
        assert_eq!(p("/pay/%zz%4"), "/pay/%zz%4");
        assert_eq!(p("/pay/%"), "/pay/%");
    }

    #[test]
    fn queries_decode_only_unreserved_characters() {
        assert_eq!(q("a=%61&b=%7e"), "a=a&b=~");
        assert_eq!(q("a=%2b&b=%26&c=+"), "a=%2B&b=%26&c=+");
        assert_eq!(q(""), "");
    }
}
