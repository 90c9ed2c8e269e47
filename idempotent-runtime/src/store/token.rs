//! [`Token`]: a claim's owner.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;

/// A claim's owner token: random per claim, never reused.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token([u8; 16]);

static TOKEN_SALT: LazyLock<u64> = LazyLock::new(|| {
    let mut buf = [0u8; 8];
    if getrandom::fill(&mut buf).is_err() {
        // No OS randomness: mix the clock and the process id so two processes still differ.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or_default();
        buf = (nanos ^ (u64::from(std::process::id()) << 32)).to_le_bytes();
    }
    u64::from_le_bytes(buf)
});
static TOKEN_COUNTER: AtomicU64 = AtomicU64::new(1);

impl Token {
    /// A fresh token: a random per-process salt and a per-process counter, so tokens never
    /// repeat within a process and collide across processes with probability 2^-64.
    pub fn generate() -> Token {
        let n = TOKEN_COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&TOKEN_SALT.to_le_bytes());
        bytes[8..].copy_from_slice(&n.to_le_bytes());
        Token(bytes)
    }

    /// A token from its 16 bytes, as read back from a store.
    pub fn from_bytes(bytes: [u8; 16]) -> Token {
        Token(bytes)
    }

    /// The token's bytes, as written to a store.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut hex = Vec::with_capacity(32);
        crate::key::push_hex(&mut hex, &self.0);
        write!(f, "Token({})", String::from_utf8_lossy(&hex))
    }
}
