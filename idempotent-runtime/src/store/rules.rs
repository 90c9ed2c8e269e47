//! The numbers every backend agrees on: the range of durations and how they are rounded,
//! the largest result taken by default, and the fence of a new acquisition.

use std::time::Duration;

/// The shortest `ttl` or `lease` accepted: one millisecond.
pub const MIN_DURATION: Duration = Duration::from_millis(1);

/// The longest `ttl` or `lease` accepted: 36,500 days (about a century), what every backend
/// can add to its clock without overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(36_500 * 24 * 3600);

/// The largest stored result a store takes by default: 1 MiB. A result above the store's
/// [`max_result_size`](super::Store::max_result_size) completes its record without it: duplicates
/// get [`Error::Duplicate`](crate::Error::Duplicate) instead of a replay, and the handler
/// never runs again.
pub const DEFAULT_MAX_RESULT_SIZE: usize = 1 << 20;

/// `d` in whole milliseconds, rounded up and clamped to [`MIN_DURATION`] ..=
/// [`MAX_DURATION`]: how every backend turns a duration into its own units, so that one
/// duration means the same on all of them.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::store::{clamped_millis, MAX_DURATION};
///
/// assert_eq!(clamped_millis(Duration::from_micros(1500)), 2);
/// assert_eq!(clamped_millis(Duration::ZERO), 1);
/// assert_eq!(clamped_millis(Duration::MAX), MAX_DURATION.as_millis() as u64);
/// ```
pub fn clamped_millis(d: Duration) -> u64 {
    let d = d.clamp(MIN_DURATION, MAX_DURATION);
    let millis = d.as_millis() + u128::from(d.subsec_nanos() % 1_000_000 != 0);
    u64::try_from(millis).unwrap_or(u64::MAX)
}

/// The fence of a new acquisition: one more than the record's fence when the key has a record
/// (live, released, or an expired lease being taken over), and the store's clock in
/// microseconds since the Unix epoch when it has none. The clock keeps fences growing across
/// record expiry, when the previous fence is gone: a key would have to be acquired more than
/// once per microsecond, over its record's whole life, for a fence to repeat.
///
/// ```
/// use idempotent_runtime::store::next_fence;
///
/// assert_eq!(next_fence(None, 1_700_000_000_000_000), 1_700_000_000_000_000);
/// assert_eq!(next_fence(Some(41), 1_700_000_000_000_000), 42);
/// assert_eq!(next_fence(None, 0), 1);
/// ```
pub fn next_fence(previous: Option<u64>, now_micros: u64) -> u64 {
    match previous {
        Some(fence) => fence.saturating_add(1),
        None => now_micros.max(1),
    }
}
