//! The store's clocks: [`Clock`], the system's [`SystemClock`], the tests' [`ManualClock`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A monotonic clock for the [`MemoryStore`](super::MemoryStore).
pub trait Clock: Send + Sync + 'static {
    /// Time elapsed since an arbitrary, fixed origin.
    fn now(&self) -> Duration;

    /// Microseconds since the Unix epoch: the fence of a key without a record (see
    /// [`next_fence`](crate::store::next_fence)), which must keep growing across a process restart. The default reads
    /// the system's wall clock (0 before the epoch).
    fn unix_micros(&self) -> u64 {
        wall_clock_micros()
    }
}

/// The system's wall clock in microseconds since the Unix epoch; 0 before the epoch.
fn wall_clock_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The system's monotonic clock, anchored to the wall clock for fences.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    origin: Instant,
    origin_unix_micros: u64,
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock {
            origin: Instant::now(),
            origin_unix_micros: wall_clock_micros(),
        }
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    /// The wall clock's time when this clock was created, plus the monotonic time since:
    /// it never goes back while the process runs, even if the wall clock is stepped back,
    /// and a restarted process starts again from the wall clock.
    fn unix_micros(&self) -> u64 {
        let since_origin = u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.origin_unix_micros.saturating_add(since_origin)
    }
}

/// A clock that moves only when told to: for exact tests of leases and expiry.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idempotent_runtime::memory::{Clock, ManualClock};
///
/// let clock = Arc::new(ManualClock::new());
/// clock.advance(Duration::from_secs(5));
/// assert_eq!(clock.now(), Duration::from_secs(5));
/// ```
#[derive(Debug, Default)]
pub struct ManualClock {
    nanos: AtomicU64,
}

impl ManualClock {
    /// A clock at zero.
    pub fn new() -> ManualClock {
        ManualClock::default()
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .nanos
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |nanos| {
                Some(nanos.saturating_add(by))
            });
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }

    /// The clock's own time, as if its origin were the Unix epoch: tests stay deterministic
    /// (a fresh clock gives fence 1).
    fn unix_micros(&self) -> u64 {
        self.nanos.load(Ordering::SeqCst) / 1_000
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Duration {
        (**self).now()
    }

    fn unix_micros(&self) -> u64 {
        (**self).unix_micros()
    }
}
