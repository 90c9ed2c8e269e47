//! How results are stored for replay: one tag byte, then JSON.
//!
//! The store treats results as opaque bytes. The engine writes `o` + JSON of the `Ok` value,
//! `e` + JSON of a stored error, or a lone `h` for a key held after a failure.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::Error;

pub(crate) const OK: u8 = b'o';
pub(crate) const ERR: u8 = b'e';
pub(crate) const HELD: u8 = b'h';

/// Encodes a value behind its tag.
pub(crate) fn encode<T: Serialize>(tag: u8, value: &T) -> Result<Vec<u8>, Error> {
    let mut out = vec![tag];
    serde_json::to_writer(&mut out, value).map_err(|e| Error::Codec {
        op: "encoded",
        source: Box::new(e),
    })?;
    Ok(out)
}

/// Decodes a value written by [`encode`], without its tag.
pub(crate) fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, Error> {
    serde_json::from_slice(body).map_err(|e| Error::Codec {
        op: "decoded",
        source: Box::new(e),
    })
}
