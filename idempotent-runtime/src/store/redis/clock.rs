//! The server's clock as the client can know it between two `TIME` calls: a reading moved
//! forward by the local monotonic time since, with a bound on how far off it may be. Of the
//! recent readings, the one with the smallest bound now is used, so one slow reply (a loaded
//! server or network) does not turn the fast claim off; a reading that contradicts it (the
//! server's clock was set) replaces it.
//!
//! The fast claim ([`RedisStore`](super::RedisStore)'s `SET ... NX GET`) writes a record
//! whose fence and lease end come from this estimate instead of a `TIME` call inside a
//! script. It is used only while the bound is small against the claim's durations (see
//! [`ServerClock::fast_durations`]); otherwise claims go through the script, on the server's
//! own clock.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
// The real monotonic clock, also in tests that pause tokio's time: the server's clock does
// not pause.
use std::time::{Duration, Instant};

/// How old a reading may be before it is refreshed (in the background; claims meanwhile use
/// the script once the reading is past [`MAX_AGE`]).
const REFRESH_AFTER: Duration = Duration::from_millis(500);
/// How soon the clock is read again after a reading that left no estimate precise enough for
/// the fast claim (a slow reply on a loaded machine, often the very first one): doubled after
/// each such reading in a row, up to [`REFRESH_AFTER`]. One slow reply then costs a few
/// milliseconds of scripted claims instead of half a second, and a link that is always too
/// slow is read at the usual pace after a few tries.
const RETRY_AFTER: Duration = Duration::from_millis(5);
/// How old a reading may be and still be used.
const MAX_AGE: Duration = Duration::from_secs(2);
/// The largest uncertainty the fast claim accepts unless configured otherwise
/// ([`RedisStoreBuilder::fast_claim_max_error`](super::RedisStoreBuilder::fast_claim_max_error)).
pub(crate) const DEFAULT_MAX_ERROR: Duration = Duration::from_millis(1);
/// The largest uncertainty the fast claim may be configured to accept.
pub(crate) const MAX_FAST_CLAIM_ERROR: Duration = Duration::from_millis(100);
/// How fast the client's monotonic clock and the server's clock may drift apart: 500 parts
/// per million, far above what NTP-disciplined clocks show.
const DRIFT_PER_US: u64 = 2_000; // one microsecond of error per 2,000 elapsed
/// The shortest lease and ttl a fast claim is used for at the default uncertainty: a record
/// written by one lives at least this long, a thousand times the largest uncertainty, so a
/// later acquisition of the same key after the record expired always reads a higher clock.
const MIN_FAST_DURATION: Duration = Duration::from_secs(1);
/// How many times the largest uncertainty a fast-claimed lease and ttl must be at least.
const DURATION_PER_ERROR: u32 = 1_000;

#[derive(Debug, Clone, Copy)]
struct Reading {
    /// The server's clock in microseconds since the Unix epoch, at `at`.
    server_us: u64,
    at: Instant,
    /// Half the round trip of the `TIME` call that read it, in microseconds.
    half_rtt_us: u64,
}

impl Reading {
    /// The reading's estimate at `now`: the server's clock in microseconds, and how far off
    /// it may be (the reading's own error, widened by the drift since).
    fn at(&self, now: Instant) -> Option<(u64, u64)> {
        let age = now.checked_duration_since(self.at)?;
        if age > MAX_AGE {
            return None;
        }
        let age_us = u64::try_from(age.as_micros()).ok()?;
        let error_us = self.half_rtt_us + age_us / DRIFT_PER_US + 1;
        Some((self.server_us.checked_add(age_us)?, error_us))
    }
}

/// The reading estimates are made from, and when the server's clock was last read.
#[derive(Debug, Default)]
struct Slot {
    reading: Option<Reading>,
    /// When the last `TIME` reply came, kept or not: refreshes are paced by it.
    last_read: Option<Instant>,
    /// How many readings in a row left no estimate precise enough for the fast claim.
    misses: u32,
}

impl Slot {
    /// How long after the last reply the clock is read again: [`REFRESH_AFTER`], or sooner
    /// while the readings are too imprecise to use (see [`RETRY_AFTER`]).
    fn refresh_after(&self) -> Duration {
        match self.misses {
            0 => REFRESH_AFTER,
            misses => RETRY_AFTER
                .saturating_mul(1 << (misses - 1).min(16))
                .min(REFRESH_AFTER),
        }
    }
}

/// The server's clock, estimated from the most precise recent `TIME` reading.
#[derive(Debug)]
pub(super) struct ServerClock {
    slot: Mutex<Slot>,
    refreshing: AtomicBool,
    /// Which server the reading is of: the primary's generation behind Sentinel (0 for a
    /// server reached directly). Another server's clock is another clock.
    server: AtomicU64,
    /// The largest uncertainty an estimate may have, in microseconds.
    max_error_us: u64,
}

impl Default for ServerClock {
    fn default() -> ServerClock {
        ServerClock::new(DEFAULT_MAX_ERROR)
    }
}

/// What the fast claim writes: the estimated server time (the fence of a key without a
/// record) and how far off it may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Estimate {
    /// Microseconds since the Unix epoch: at least the server's clock now.
    pub(super) upper_us: u64,
    /// Milliseconds since the Unix epoch: the best estimate of the server's clock now.
    pub(super) now_ms: u64,
    /// How far off `now_ms` may be, in microseconds.
    pub(super) error_us: u64,
}

impl ServerClock {
    /// A clock whose estimates are used while their uncertainty is at most `max_error`.
    pub(super) fn new(max_error: Duration) -> ServerClock {
        ServerClock {
            slot: Mutex::default(),
            refreshing: AtomicBool::new(false),
            server: AtomicU64::new(0),
            max_error_us: u64::try_from(max_error.as_micros()).unwrap_or(u64::MAX),
        }
    }

    /// The shortest lease and ttl a fast claim is used for: [`MIN_FAST_DURATION`], or a
    /// thousand times a larger configured uncertainty.
    pub(super) fn min_fast_duration(&self) -> Duration {
        let error = Duration::from_micros(self.max_error_us);
        MIN_FAST_DURATION.max(error.saturating_mul(DURATION_PER_ERROR))
    }

    /// Whether a claim with `lease` and `ttl` may take the fast path at all.
    pub(super) fn fast_durations(&self, lease: Duration, ttl: Duration) -> bool {
        let min = self.min_fast_duration();
        lease >= min && ttl >= min
    }

    /// Records a `TIME` reply (`seconds`, `microseconds`) for a call sent at `sent` and
    /// answered at `received`.
    pub(super) fn record(&self, seconds: u64, micros: u64, sent: Instant, received: Instant) {
        let rtt = received.saturating_duration_since(sent);
        let half_rtt_us = u64::try_from(rtt.as_micros() / 2).unwrap_or(u64::MAX);
        let reading = Reading {
            // The server read its clock somewhere within the round trip: take the middle.
            server_us: seconds
                .saturating_mul(1_000_000)
                .saturating_add(micros)
                .saturating_add(half_rtt_us),
            at: received,
            half_rtt_us,
        };
        if let Ok(mut slot) = self.slot.lock() {
            slot.last_read = Some(slot.last_read.map_or(received, |last| last.max(received)));
            // Keep the older reading while, widened by its age, it is still the more precise
            // and the new one agrees with it: one slow reply (a loaded server or network)
            // does not turn the fast claim off. A new reading that contradicts it (the
            // server's clock was set) replaces it, however imprecise.
            let keep_old = slot.reading.and_then(|old| old.at(received)).is_some_and(
                |(old_us, old_error_us)| {
                    let agrees =
                        old_us.abs_diff(reading.server_us) <= old_error_us + reading.half_rtt_us;
                    agrees && old_error_us < reading.half_rtt_us + 1
                },
            );
            if !keep_old {
                slot.reading = Some(reading);
            }
            let precise = slot
                .reading
                .and_then(|kept| kept.at(received))
                .is_some_and(|(_, error_us)| error_us <= self.max_error_us);
            slot.misses = if precise {
                0
            } else {
                slot.misses.saturating_add(1)
            };
        }
    }

    /// The estimate at `now`, when a reading is fresh enough and precise enough for a fast
    /// claim; `None` otherwise.
    /// Forgets the reading when it is not of the server `generation` names (the primary
    /// changed): claims use the script until the new server's clock is read.
    pub(super) fn of_server(&self, generation: u64) {
        if self.server.swap(generation, Ordering::AcqRel) != generation {
            if let Ok(mut slot) = self.slot.lock() {
                *slot = Slot::default();
            }
        }
    }

    pub(super) fn estimate(&self, now: Instant) -> Option<Estimate> {
        let reading = self.slot.lock().ok()?.reading?;
        let (mid_us, error_us) = reading.at(now)?;
        if error_us > self.max_error_us {
            return None;
        }
        Some(Estimate {
            upper_us: mid_us.checked_add(error_us)?,
            now_ms: mid_us / 1_000,
            error_us,
        })
    }

    /// Whether a refresh should start now: the reading is missing, getting old, or too
    /// imprecise to use (see [`RETRY_AFTER`]), and no refresh is running. The caller that gets
    /// `true` must call [`done`](Self::done).
    pub(super) fn should_refresh(&self, now: Instant) -> bool {
        let stale = match self.slot.lock() {
            Ok(slot) => slot
                .last_read
                .is_none_or(|at| now.saturating_duration_since(at) >= slot.refresh_after()),
            Err(_) => false,
        };
        stale
            && self
                .refreshing
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }

    /// Ends a refresh that [`should_refresh`](Self::should_refresh) started.
    pub(super) fn done(&self) {
        self.refreshing.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_estimate_moves_with_local_time_and_widens_with_age() {
        let clock = ServerClock::default();
        let sent = Instant::now();
        assert_eq!(clock.estimate(sent), None, "no reading yet");
        assert!(clock.should_refresh(sent));
        assert!(!clock.should_refresh(sent), "one refresh at a time");
        let received = sent + Duration::from_micros(200);
        clock.record(1_700_000_000, 500, sent, received);
        clock.done();

        let at = clock.estimate(received).unwrap();
        assert_eq!(at.error_us, 101);
        assert_eq!(at.upper_us, 1_700_000_000_000_000 + 500 + 100 + 101);
        assert_eq!(at.now_ms, 1_700_000_000_000);

        let later = received + Duration::from_millis(400);
        let moved = clock.estimate(later).unwrap();
        assert_eq!(moved.error_us, 101 + 200);
        assert_eq!(moved.upper_us, at.upper_us + 400_000 + 200);
        assert!(!clock.should_refresh(later));
        assert!(
            clock.should_refresh(received + Duration::from_millis(500)),
            "refreshed at 500 ms"
        );
        clock.done();
        assert_eq!(
            clock.estimate(received + Duration::from_millis(2_100)),
            None,
            "too old"
        );
        assert_eq!(clock.estimate(sent), None, "before the reading");
    }

    #[test]
    fn an_imprecise_reading_is_not_used_and_a_precise_one_is_kept() {
        let clock = ServerClock::default();
        let sent = Instant::now();
        let slow = sent + Duration::from_millis(3);
        clock.record(1_700_000_000, 0, sent, slow);
        assert_eq!(clock.estimate(slow), None);
        // A precise reading replaces it; a less precise one right after does not.
        let fast = slow + Duration::from_micros(100);
        clock.record(1_700_000_000, 3_000, slow, fast);
        let precise = clock.estimate(fast).unwrap();
        assert_eq!(precise.error_us, 51);
        clock.record(
            1_700_000_000,
            3_100,
            fast,
            fast + Duration::from_micros(900),
        );
        assert_eq!(clock.estimate(fast).unwrap().error_us, 51);
    }

    #[test]
    fn an_imprecise_reading_is_read_again_soon_then_less_and_less_often() {
        // The store's first reading, taken while it is built, came late (a loaded machine):
        // the clock is read again after 5 ms, not 500, then after twice as long each time a
        // reading is still too imprecise, up to the usual 500 ms.
        let clock = ServerClock::default();
        let mut at = Instant::now();
        let mut waits = Vec::new();
        for _ in 0..9 {
            let received = at + Duration::from_millis(3);
            clock.record(1_700_000_000, 0, at, received);
            assert_eq!(
                clock.estimate(received),
                None,
                "1.5 ms of error is over 1 ms"
            );
            let mut wait = Duration::ZERO;
            while !clock.should_refresh(received + wait) {
                wait += Duration::from_millis(1);
            }
            clock.done();
            waits.push(wait.as_millis());
            at = received + wait;
        }
        assert_eq!(waits, [5, 10, 20, 40, 80, 160, 320, 500, 500]);

        // A precise reading: the usual pace again, and the next imprecise one starts over.
        let received = at + Duration::from_micros(200);
        clock.record(1_700_000_000, 0, at, received);
        assert!(clock.estimate(received).is_some());
        assert!(!clock.should_refresh(received + Duration::from_millis(499)));
        assert!(clock.should_refresh(received + Duration::from_millis(500)));
        clock.done();
        let late = received + Duration::from_secs(3);
        let answered = late + Duration::from_millis(3);
        clock.record(1_700_000_003, 0, late, answered);
        assert!(!clock.should_refresh(answered + Duration::from_millis(4)));
        assert!(clock.should_refresh(answered + Duration::from_millis(5)));
        clock.done();
    }

    #[test]
    fn a_slow_refresh_keeps_the_older_reading_while_it_is_the_more_precise() {
        // A loaded server or network answers a refresh slowly: its reading alone would turn
        // the fast claim off, and every claim would cost the server a script run until the
        // next refresh, the more so the more it is loaded.
        let clock = ServerClock::default();
        let sent = Instant::now();
        let received = sent + Duration::from_micros(200);
        clock.record(1_700_000_000, 0, sent, received);
        let refresh = received + Duration::from_millis(600);
        assert!(clock.should_refresh(refresh));
        let slow = refresh + Duration::from_millis(3);
        clock.record(1_700_000_000, 603_200, refresh, slow);
        clock.done();
        let at = clock
            .estimate(slow)
            .expect("the older reading is still precise enough");
        assert_eq!(
            at.error_us,
            100 + 301 + 1,
            "the older reading, widened by its age"
        );
        assert_eq!(at.upper_us, 1_700_000_000_000_000 + 100 + 603_000 + 402);
        // The slow answer counts as a refresh: the next one is not due at once.
        assert!(!clock.should_refresh(slow));
        assert!(clock.should_refresh(slow + Duration::from_millis(500)));
        clock.done();
        // Once the older reading has aged past the bound, no estimate is given.
        assert_eq!(
            clock.estimate(received + Duration::from_millis(1_900)),
            None
        );
    }

    #[test]
    fn a_reading_that_contradicts_the_kept_one_replaces_it() {
        // The server's clock was stepped: the new reading is right whatever its precision.
        let clock = ServerClock::default();
        let sent = Instant::now();
        let received = sent + Duration::from_micros(200);
        clock.record(1_700_000_000, 0, sent, received);
        let refresh = received + Duration::from_millis(600);
        let answered = refresh + Duration::from_millis(3);
        clock.record(1_700_000_005, 0, refresh, answered);
        let at = clock.estimate(answered + Duration::from_micros(100));
        assert_eq!(at, None, "the new reading is too imprecise to use");
        let precise = answered + Duration::from_micros(100);
        clock.record(1_700_000_005, 1_000, answered, precise);
        let at = clock
            .estimate(precise)
            .expect("a precise reading of the stepped clock");
        assert_eq!(at.now_ms, 1_700_000_005_001);
    }

    #[test]
    fn only_long_durations_take_the_fast_path() {
        let clock = ServerClock::default();
        let s = Duration::from_secs(1);
        assert!(clock.fast_durations(s, s));
        assert!(!clock.fast_durations(s - Duration::from_millis(1), s));
        assert!(!clock.fast_durations(s, Duration::from_millis(10)));
    }

    #[test]
    fn a_larger_accepted_error_uses_less_precise_readings_for_longer_durations_only() {
        let clock = ServerClock::new(Duration::from_millis(20));
        let sent = Instant::now();
        let received = sent + Duration::from_millis(10);
        clock.record(1_700_000_000, 0, sent, received);
        let at = clock
            .estimate(received)
            .expect("5 ms of error is under 20 ms");
        assert_eq!(at.error_us, 5_001);
        assert_eq!(
            ServerClock::default().estimate(received),
            None,
            "a fresh clock has no reading"
        );
        // A thousand times the bound: 20 s.
        assert_eq!(clock.min_fast_duration(), Duration::from_secs(20));
        let long = Duration::from_secs(30);
        assert!(clock.fast_durations(long, long));
        assert!(!clock.fast_durations(Duration::from_secs(19), long));
        let precise = ServerClock::default();
        precise.record(1_700_000_000, 0, sent, received);
        assert_eq!(precise.estimate(received), None, "over the default 1 ms");
    }
}
