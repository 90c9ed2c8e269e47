//! How long one store call on an owner's path may go unanswered, derived from the lease: the
//! engine bounds each call of an owner with it, and [`CombiningStore`](super::CombiningStore)
//! each batch it sends, so the two agree.

use std::time::Duration;

/// The shortest bound, for the shortest leases: below it a healthy store's round trip on a
/// loaded machine would be cut.
const MIN_BOUND: Duration = Duration::from_millis(100);

/// Half the lease (at least 100 ms). The watchdog renews every third of the lease, so a
/// renewal that is cut is followed by another well before the lease runs out.
pub(crate) fn call_bound(lease: Duration) -> Duration {
    (lease / 2).max(MIN_BOUND)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_is_half_the_lease_and_never_below_the_minimum() {
        assert_eq!(call_bound(Duration::from_secs(30)), Duration::from_secs(15));
        assert_eq!(call_bound(Duration::from_millis(10)), MIN_BOUND);
    }
}
