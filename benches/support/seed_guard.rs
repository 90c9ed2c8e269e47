//! What the benches' hand-written guards share, the seed article's way: its compare-and-set
//! completion script, a random owner token, and the cleanup of a run's keys. Included with
//! `#[path = "support/seed_guard.rs"] mod seed_guard;`.

// Each bench uses only some of these.
#![allow(dead_code)]

use redis::aio::ConnectionManager;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The seed's completion: store the result only while the token still owns the key.
pub(crate) const COMPLETE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
";

/// A random 128-bit number (owner tokens, run tags), from the standard library's random
/// hasher keys.
pub(crate) fn rand_u128() -> u128 {
    use std::hash::{BuildHasher, RandomState};
    let state = RandomState::new();
    (u128::from(state.hash_one(1u8)) << 64) | u128::from(state.hash_one(2u8))
}

/// Deletes every key matching `pattern` (`SCAN` + `UNLINK`); how many were removed.
pub(crate) async fn delete_matching(
    conn: &mut ConnectionManager,
    pattern: &str,
) -> Result<u64, BoxError> {
    let mut removed = 0;
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        if !keys.is_empty() {
            removed += redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<u64>(conn)
                .await?;
        }
        if next == 0 {
            return Ok(removed);
        }
        cursor = next;
    }
}
