//! A unary call's reply as [`IdempotencyLayer`](super::IdempotencyLayer) keeps it for replay:
//! its response headers, its body (the framed message) and its trailers (`grpc-status` and
//! the rest).
//!
//! ```text
//! 'o' 'c' 1                       tag (codec::OK), form, version
//! headers                         as in `reply.rs`: a count, then name/value pairs
//! trailers                        the same
//! 0 | 1, u32 length, body         1 and the body when it was kept, 0 when it was too large
//! ```

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Frame, SizeHint};

use super::reply::{codec_error, read_headers, write_headers, Reader};
use crate::codec;
use crate::error::Error;

const FORM: u8 = b'c';
const VERSION: u8 = 1;

/// A unary call's reply, kept for replay.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StoredCall {
    pub(crate) headers: HeaderMap,
    pub(crate) trailers: HeaderMap,
    /// `None`: the call completed, but its reply was larger than the layer keeps.
    pub(crate) body: Option<Bytes>,
}

impl StoredCall {
    /// The stored form, behind [`codec::OK`].
    pub(crate) fn encode(&self) -> Result<Vec<u8>, Error> {
        let body_len = self.body.as_ref().map_or(0, Bytes::len);
        let mut out = Vec::with_capacity(16 + body_len + 64 * (self.headers.len() + 2));
        out.extend_from_slice(&[codec::OK, FORM, VERSION]);
        write_headers(&mut out, &self.headers)?;
        write_headers(&mut out, &self.trailers)?;
        match &self.body {
            Some(body) => {
                let len = u32::try_from(body.len())
                    .map_err(|_| codec_error("encoded", "a reply larger than 4 GiB"))?;
                out.push(1);
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(body);
            }
            None => out.push(0),
        }
        Ok(out)
    }

    /// What [`encode`](Self::encode) wrote, without its tag.
    pub(crate) fn decode(stored: &[u8]) -> Result<StoredCall, Error> {
        let mut r = Reader(stored);
        let [form, version] = r.array::<2>()?;
        if form != FORM || version != VERSION {
            return Err(codec_error(
                "decoded",
                "not a gRPC call's reply of a known version",
            ));
        }
        let headers = read_headers(&mut r)?;
        let trailers = read_headers(&mut r)?;
        let body = match r.array::<1>()? {
            [0] => None,
            [1] => {
                let len = usize::try_from(u32::from_be_bytes(r.array::<4>()?))
                    .map_err(|_| codec_error("decoded", "a bad reply length"))?;
                Some(Bytes::copy_from_slice(r.take(len)?))
            }
            _ => return Err(codec_error("decoded", "a bad reply marker")),
        };
        if !r.0.is_empty() {
            return Err(codec_error("decoded", "bytes after the reply"));
        }
        Ok(StoredCall {
            headers,
            trailers,
            body,
        })
    }
}

/// A reply in one piece: its body, then its trailers.
#[derive(Debug)]
pub(crate) struct ReplyBody {
    body: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl ReplyBody {
    pub(crate) fn new(body: Bytes, trailers: HeaderMap) -> ReplyBody {
        ReplyBody {
            body: (!body.is_empty()).then_some(body),
            trailers: (!trailers.is_empty()).then_some(trailers),
        }
    }
}

impl http_body::Body for ReplyBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(body) = self.body.take() {
            return Poll::Ready(Some(Ok(Frame::data(body))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.body.as_ref().map_or(0, |b| b.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(body: Option<&'static [u8]>) -> StoredCall {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", "application/grpc".parse().unwrap());
        headers.insert("x-order-state", "created".parse().unwrap());
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        StoredCall {
            headers,
            trailers,
            body: body.map(Bytes::from_static),
        }
    }

    #[test]
    fn a_call_round_trips_with_and_without_its_body() {
        for stored in [call(Some(b"\x00\x00\x00\x00\x02\x08\x07")), call(None)] {
            let bytes = stored.encode().unwrap();
            assert_eq!(bytes[0], codec::OK);
            assert_eq!(StoredCall::decode(&bytes[1..]).unwrap(), stored);
        }
    }

    #[test]
    fn every_truncation_and_any_trailing_byte_is_an_error_not_a_panic() {
        let bytes = call(Some(b"\x00\x00\x00\x00\x02\x08\x07"))
            .encode()
            .unwrap();
        for cut in 1..bytes.len() {
            assert!(StoredCall::decode(&bytes[1..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = bytes[1..].to_vec();
        longer.push(0);
        assert!(StoredCall::decode(&longer).is_err());
        assert!(StoredCall::decode(b"g\x01").is_err());
    }
}
