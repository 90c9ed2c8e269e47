//! A response as the store keeps it for replay: status, the headers worth replaying, and the
//! body when it was small enough to keep. A compact binary form (the body is not JSON-escaped).

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::error::Error;

/// A response kept for replay.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stored {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    /// `None`: the response was completed, but its body was too large (or failed) to keep.
    pub(crate) body: Option<Bytes>,
}

/// Headers never replayed: hop-by-hop headers (RFC 9110 section 7.6.1), headers the server
/// sets per response (`Date`, the body's length), and cookies (a session must not be handed
/// to whoever retries).
const NEVER_STORED: [HeaderName; 11] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::DATE,
    header::SET_COOKIE,
    header::CONTENT_LENGTH,
];

/// The headers of `headers` worth storing, `sanitize` applied last.
pub(crate) fn storable(headers: &HeaderMap, sanitize: Option<fn(&mut HeaderMap)>) -> HeaderMap {
    // Headers named by `Connection` are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    // Copied header by header rather than cloned and then thinned: most responses have a
    // few headers, and a removal hashes its name.
    let mut kept = HeaderMap::with_capacity(headers.keys_len());
    for (name, value) in headers {
        if !(NEVER_STORED.contains(name) || named.contains(name) || name == super::REPLAYED) {
            kept.append(name.clone(), value.clone());
        }
    }
    if let Some(sanitize) = sanitize {
        sanitize(&mut kept);
    }
    kept
}

const VERSION: u8 = 1;

impl Stored {
    /// `tag`, then `1`, status (2 bytes), header count (2), each header as name length (2), name, value
    /// length (4), value; then `0` (no body) or `1`, body length (4), body.
    pub(crate) fn encode(&self, tag: u8) -> Result<Vec<u8>, Error> {
        let body_len = self.body.as_ref().map_or(0, Bytes::len);
        let mut out = Vec::with_capacity(16 + body_len + 64 * self.headers.len());
        out.push(tag);
        out.push(VERSION);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        out.extend_from_slice(&len_u16(self.headers.len())?.to_be_bytes());
        for (name, value) in &self.headers {
            out.extend_from_slice(&len_u16(name.as_str().len())?.to_be_bytes());
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(&len_u32(value.len())?.to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        match &self.body {
            None => out.push(0),
            Some(body) => {
                out.push(1);
                out.extend_from_slice(&len_u32(body.len())?.to_be_bytes());
                out.extend_from_slice(body);
            }
        }
        Ok(out)
    }

    /// Reads what [`encode`](Stored::encode) wrote after its tag; anything else is an [`Error::Codec`].
    pub(crate) fn decode(bytes: &[u8]) -> Result<Stored, Error> {
        let mut r = Reader(bytes);
        if r.take(1)? != [VERSION] {
            return Err(corrupt("an unknown version"));
        }
        let status = StatusCode::from_u16(r.u16()?).map_err(|_| corrupt("a bad status"))?;
        let count = r.u16()?;
        let mut headers = HeaderMap::with_capacity(usize::from(count));
        for _ in 0..count {
            let len = usize::from(r.u16()?);
            let name =
                HeaderName::from_bytes(r.take(len)?).map_err(|_| corrupt("a bad header name"))?;
            let len = r.u32()?;
            let value =
                HeaderValue::from_bytes(r.take(len)?).map_err(|_| corrupt("a bad header value"))?;
            headers.append(name, value);
        }
        let body = match r.take(1)? {
            [0] => None,
            [1] => {
                let len = r.u32()?;
                Some(Bytes::copy_from_slice(r.take(len)?))
            }
            _ => return Err(corrupt("a bad body marker")),
        };
        if !r.0.is_empty() {
            return Err(corrupt("trailing bytes"));
        }
        Ok(Stored {
            status,
            headers,
            body,
        })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if self.0.len() < n {
            return Err(corrupt("a truncated record"));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16, Error> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<usize, Error> {
        let b = self.take(4)?;
        usize::try_from(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            .map_err(|_| corrupt("a length this platform cannot hold"))
    }
}

fn len_u16(n: usize) -> Result<u16, Error> {
    u16::try_from(n).map_err(|_| too_large())
}

fn len_u32(n: usize) -> Result<u32, Error> {
    u32::try_from(n).map_err(|_| too_large())
}

fn too_large() -> Error {
    Error::Codec {
        op: "encoded",
        source: "a response part longer than the stored form holds".into(),
    }
}

fn corrupt(what: &'static str) -> Error {
    Error::Codec {
        op: "decoded",
        source: format!("a stored response with {what}").into(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn stored_responses_round_trip() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.append("x-multi", HeaderValue::from_static("a"));
        headers.append("x-multi", HeaderValue::from_static("b"));
        for body in [
            None,
            Some(Bytes::new()),
            Some(Bytes::from_static(b"{\"id\":1}\0\xff")),
        ] {
            let stored = Stored {
                status: StatusCode::CREATED,
                headers: headers.clone(),
                body,
            };
            assert_eq!(
                Stored::decode(&stored.encode(b'o').unwrap()[1..]).unwrap(),
                stored
            );
        }
    }

    #[test]
    fn damaged_records_are_codec_errors() {
        let stored = Stored {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Some(Bytes::from_static(b"body")),
        };
        let bytes = stored.encode(b'o').unwrap()[1..].to_vec();
        for cut in 0..bytes.len() {
            assert!(matches!(
                Stored::decode(&bytes[..cut]),
                Err(Error::Codec { .. })
            ));
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Stored::decode(&longer).is_err());
        let mut other_version = bytes;
        other_version[0] = 9;
        assert!(Stored::decode(&other_version).is_err());
    }

    #[test]
    fn hop_by_hop_dates_and_cookies_are_not_stored() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, HeaderValue::from_static("close, x-hop"));
        headers.insert("x-hop", HeaderValue::from_static("1"));
        headers.insert(
            header::SET_COOKIE,
            HeaderValue::from_static("session=secret"),
        );
        headers.insert(
            header::DATE,
            HeaderValue::from_static("Tue, 01 Dec 2026 00:00:00 GMT"),
        );
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::LOCATION, HeaderValue::from_static("/orders/1"));
        headers.insert("x-request-id", HeaderValue::from_static("r-1"));
        headers.insert(super::super::REPLAYED, HeaderValue::from_static("false"));
        headers.append(header::VARY, HeaderValue::from_static("accept"));
        headers.append(header::VARY, HeaderValue::from_static("origin"));
        let kept = storable(
            &headers,
            Some(|h: &mut HeaderMap| {
                h.remove("x-request-id");
            }),
        );
        assert_eq!(kept.len(), 3, "{kept:?}");
        assert_eq!(kept[header::LOCATION], "/orders/1");
        // Every value of a repeated header, in its order.
        let vary: Vec<_> = kept.get_all(header::VARY).iter().collect();
        assert_eq!(vary, ["accept", "origin"]);
    }
}
