//! The stored form of a `tonic::Response<M>`: its metadata and its prost message.
//!
//! ```text
//! 'o' 'g' 1                       tag (codec::OK), form, version
//! u32 count                       metadata entries, then for each:
//!   u16 name length, name         lowercase, as on the wire (`-bin` for binary entries)
//!   u32 value length, value       as on the wire (a binary entry in base64)
//! message                         the rest: the message as prost encodes it
//! ```
//!
//! Integers are big-endian. A record that does not parse is a [`Error::Codec`], never a
//! panic.

use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::Response;

use crate::codec;
use crate::error::Error;

/// The form byte after the tag: a gRPC reply (the serde form starts with JSON instead).
const FORM: u8 = b'g';
const VERSION: u8 = 1;

pub(super) fn codec_error(op: &'static str, message: impl Into<String>) -> Error {
    let message: String = message.into();
    Error::Codec {
        op,
        source: message.into(),
    }
}

/// `response` as stored for replay, behind [`codec::OK`].
pub(crate) fn encode_reply<M: prost::Message>(response: &Response<M>) -> Result<Vec<u8>, Error> {
    let headers = response.metadata().as_ref();
    let message = response.get_ref();
    let mut out = Vec::with_capacity(8 + message.encoded_len() + 64 * headers.len());
    out.extend_from_slice(&[codec::OK, FORM, VERSION]);
    write_headers(&mut out, headers)?;
    message
        .encode(&mut out)
        .map_err(|e| codec_error("encoded", e.to_string()))?;
    Ok(out)
}

/// Writes `headers` as a count and name/value pairs (see the module documentation).
pub(super) fn write_headers(out: &mut Vec<u8>, headers: &http::HeaderMap) -> Result<(), Error> {
    let count = u32::try_from(headers.len())
        .map_err(|_| codec_error("encoded", "too many metadata entries"))?;
    out.extend_from_slice(&count.to_be_bytes());
    for (name, value) in headers {
        let name = name.as_str().as_bytes();
        let name_len = u16::try_from(name.len())
            .map_err(|_| codec_error("encoded", "a metadata name longer than 65535 bytes"))?;
        let value = value.as_bytes();
        let value_len = u32::try_from(value.len())
            .map_err(|_| codec_error("encoded", "a metadata value longer than 4 GiB"))?;
        out.extend_from_slice(&name_len.to_be_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&value_len.to_be_bytes());
        out.extend_from_slice(value);
    }
    Ok(())
}

/// Reads what [`write_headers`] wrote.
pub(super) fn read_headers(r: &mut Reader<'_>) -> Result<http::HeaderMap, Error> {
    let count = u32::from_be_bytes(r.array::<4>()?);
    let mut headers = http::HeaderMap::new();
    for _ in 0..count {
        let name_len = usize::from(u16::from_be_bytes(r.array::<2>()?));
        let name = http::HeaderName::from_bytes(r.take(name_len)?)
            .map_err(|_| codec_error("decoded", "a bad metadata name"))?;
        let value_len = usize::try_from(u32::from_be_bytes(r.array::<4>()?))
            .map_err(|_| codec_error("decoded", "a bad metadata length"))?;
        let value = http::HeaderValue::from_bytes(r.take(value_len)?)
            .map_err(|_| codec_error("decoded", "a bad metadata value"))?;
        headers.append(name, value);
    }
    Ok(headers)
}

/// A reader over a stored reply that fails instead of panicking on a short record.
pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if self.0.len() < n {
            return Err(codec_error("decoded", "a truncated gRPC reply"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
}

/// The response stored by [`encode_reply`] (without its tag), marked [`super::REPLAYED`].
pub(crate) fn decode_reply<M: prost::Message + Default>(body: &[u8]) -> Result<Response<M>, Error> {
    let mut r = Reader(body);
    let [form, version] = r.array::<2>()?;
    if form != FORM || version != VERSION {
        return Err(codec_error(
            "decoded",
            "not a gRPC reply of a known version (was `replay` changed on this method?)",
        ));
    }
    let headers = read_headers(&mut r)?;
    let message = M::decode(r.0).map_err(|e| codec_error("decoded", e.to_string()))?;
    let mut metadata = MetadataMap::from_headers(headers);
    metadata.insert(super::REPLAYED, MetadataValue::from_static("true"));
    Ok(Response::from_parts(
        metadata,
        message,
        tonic::Extensions::default(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Order {
        #[prost(uint64, tag = "1")]
        id: u64,
        #[prost(string, tag = "2")]
        customer: String,
    }

    #[test]
    fn a_reply_round_trips_with_its_metadata_and_is_marked_replayed() {
        let mut response = Response::new(Order {
            id: 7,
            customer: "c-1".into(),
        });
        response
            .metadata_mut()
            .insert("x-order-state", MetadataValue::from_static("created"));
        response
            .metadata_mut()
            .append("x-order-state", MetadataValue::from_static("paid"));
        response
            .metadata_mut()
            .insert_bin("x-receipt-bin", MetadataValue::from_bytes(b"\x00\xffok"));
        let stored = encode_reply(&response).unwrap();
        assert_eq!(stored[0], codec::OK);
        let replayed: Response<Order> = decode_reply(&stored[1..]).unwrap();
        assert_eq!(replayed.get_ref(), response.get_ref());
        let states: Vec<_> = replayed
            .metadata()
            .get_all("x-order-state")
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect();
        assert_eq!(states, ["created", "paid"]);
        assert_eq!(
            replayed
                .metadata()
                .get_bin("x-receipt-bin")
                .unwrap()
                .to_bytes()
                .unwrap(),
            &b"\x00\xffok"[..]
        );
        assert_eq!(
            replayed.metadata().get(crate::grpc::REPLAYED).unwrap(),
            "true"
        );
    }

    #[test]
    fn every_truncation_of_a_stored_reply_is_an_error_not_a_panic() {
        let mut response = Response::new(Order {
            id: 1,
            customer: "c".into(),
        });
        response
            .metadata_mut()
            .insert("x-a", MetadataValue::from_static("b"));
        let stored = encode_reply(&response).unwrap();
        // Cut inside the header and the metadata: every cut is refused. (A cut inside the
        // message may still decode as a shorter message, as protobuf allows.)
        let message_start = stored.len() - prost::Message::encoded_len(response.get_ref());
        for cut in 1..message_start {
            assert!(
                decode_reply::<Order>(&stored[1..cut]).is_err(),
                "cut at {cut} was accepted"
            );
        }
        assert!(decode_reply::<Order>(b"{\"id\":1}").is_err());
    }
}
