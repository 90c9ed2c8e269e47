//! [`Fingerprint`]: the digest of a request's payload.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::key::KeyPart;

/// A digest of a request's payload, stored with the claim so that a duplicate key with a
/// different payload is refused ([`Error::PayloadMismatch`](crate::Error::PayloadMismatch)).
///
/// It is the first 16 bytes of the SHA-256 of the parts' injective encoding: stable across
/// processes, platforms and releases.
///
/// ```
/// use idempotent_runtime::Fingerprint;
///
/// let a = Fingerprint::of(&[&"EUR", &1250u64]);
/// let b = Fingerprint::of(&[&"EUR", &1251u64]);
/// assert_ne!(a, b);
/// assert_eq!(a, Fingerprint::of(&[&"EUR", &1250u64]));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 16]);

impl Fingerprint {
    /// The fingerprint of some values, in order.
    pub fn of(parts: &[&dyn KeyPart]) -> Fingerprint {
        let mut hasher = Sha256::new();
        let mut scratch = Vec::new();
        for part in parts {
            scratch.clear();
            part.write_key_part(&mut scratch);
            hasher.update((scratch.len() as u64).to_le_bytes());
            hasher.update(&scratch);
        }
        Fingerprint::truncate(&hasher.finalize())
    }

    /// The fingerprint of a raw payload (a request body, say).
    pub fn of_bytes(payload: &[u8]) -> Fingerprint {
        Fingerprint::truncate(&Sha256::digest(payload))
    }

    /// A fingerprint from its 16 bytes, as read back from a store.
    pub fn from_bytes(bytes: [u8; 16]) -> Fingerprint {
        Fingerprint(bytes)
    }

    /// The fingerprint's bytes, as written to a store.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    fn truncate(digest: &[u8]) -> Fingerprint {
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        Fingerprint(bytes)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut hex = Vec::with_capacity(32);
        crate::key::push_hex(&mut hex, &self.0);
        write!(f, "Fingerprint({})", String::from_utf8_lossy(&hex))
    }
}
