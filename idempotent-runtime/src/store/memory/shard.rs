//! A shard of the store: its table of records, their expiry, and the lazy sweep.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hashbrown::HashTable;

use crate::key::Key;
use crate::store::{clamped_millis, Fingerprint, Record, RecordState, Token};

pub(super) const SHARDS: usize = 64;
/// A shard holding fewer records than this is never swept for its size.
const SWEEP_FLOOR: usize = 1024;

#[derive(Debug, Clone)]
pub(super) enum State {
    InProgress { lease_until: Duration },
    Completed { result: Option<Arc<[u8]>> },
    Released,
}

#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) state: State,
    pub(super) token: Token,
    pub(super) fence: u64,
    pub(super) fingerprint: Option<Fingerprint>,
    pub(super) expires_at: Duration,
    /// When the record entered its state (renewals do not count).
    pub(super) since: Duration,
}

/// A record in a shard's table, with its key's hash (the store's keyed SipHash), computed
/// once per operation and kept for the table's growth.
pub(super) struct Slot {
    pub(super) key: Key,
    pub(super) hash: u64,
    pub(super) entry: Entry,
}

fn slot_hash(slot: &Slot) -> u64 {
    slot.hash
}

#[derive(Default)]
pub(super) struct Shard {
    pub(super) map: HashTable<Slot>,
    /// Records left by the last sweep.
    pub(super) swept_len: usize,
    /// Operations since the last sweep.
    pub(super) ops_since_sweep: usize,
    /// No record expires before this: a sweep before it has nothing to drop.
    pub(super) next_expiry: Duration,
}

impl Shard {
    /// Drops expired records when the map has doubled since the last sweep (fresh keys pay
    /// for it: at least half the records scanned were inserted since), or when as many
    /// operations as records have passed (duplicates pay for it). Either way a sweep costs a
    /// constant per operation, and the map holds at most twice the records live at the last
    /// sweep, or [`SWEEP_FLOOR`]. A sweep before the earliest expiry scans nothing.
    pub(super) fn maybe_sweep(&mut self, now: Duration) {
        self.ops_since_sweep += 1;
        let len = self.map.len();
        if len >= self.swept_len.saturating_mul(2).max(SWEEP_FLOOR)
            || self.ops_since_sweep >= len.max(SWEEP_FLOOR)
        {
            self.sweep(now);
        }
    }

    pub(super) fn sweep(&mut self, now: Duration) {
        if self.next_expiry <= now {
            let mut next_expiry = Duration::MAX;
            self.map.retain(|slot| {
                let expires_at = slot.entry.expires_at;
                let live = expires_at > now;
                if live {
                    next_expiry = next_expiry.min(expires_at);
                }
                live
            });
            self.next_expiry = next_expiry;
        }
        self.swept_len = self.map.len();
        self.ops_since_sweep = 0;
        // A map that held far more records than it does now gives the memory back.
        if self.map.capacity() > 4 * self.swept_len.max(SWEEP_FLOOR) {
            self.map.shrink_to(2 * self.swept_len, slot_hash);
        }
    }

    /// Notes that a record now expires at `at`.
    pub(super) fn expires(&mut self, at: Duration) {
        self.next_expiry = self.next_expiry.min(at);
    }

    /// The live record of `key` (whose hash is `hash`), dropping it first if it has expired.
    pub(super) fn live(&mut self, key: &Key, hash: u64, now: Duration) -> Option<&mut Entry> {
        match self.map.find_entry(hash, |slot| slot.key == *key) {
            Ok(found) if found.get().entry.expires_at <= now => {
                found.remove();
                None
            }
            Ok(found) => Some(&mut found.into_mut().entry),
            Err(_) => None,
        }
    }

    /// Writes `entry` as the record of `key`, in place of the one it had.
    pub(super) fn put(&mut self, key: &Key, hash: u64, entry: Entry) {
        match self.map.find_mut(hash, |slot| slot.key == *key) {
            Some(slot) => slot.entry = entry,
            None => {
                let key = key.clone();
                self.map
                    .insert_unique(hash, Slot { key, hash, entry }, slot_hash);
            }
        }
    }

    /// Removes the record of `key`.
    pub(super) fn remove(&mut self, key: &Key, hash: u64) {
        if let Ok(found) = self.map.find_entry(hash, |slot| slot.key == *key) {
            found.remove();
        }
    }
}

impl Entry {
    /// The record as [`Store::read`](crate::Store::read) returns it, at `now`.
    pub(super) fn record(&self, now: Duration) -> Record {
        let entry = self;
        let (state, result) = match &entry.state {
            State::InProgress { lease_until } => (
                RecordState::InProgress {
                    lease_left: lease_until.saturating_sub(now),
                },
                None,
            ),
            State::Completed { result } => (
                RecordState::Completed,
                result.as_deref().map(<[u8]>::to_vec),
            ),
            State::Released => (RecordState::Released, None),
        };
        Record::new(state, entry.token, entry.fence)
            .with_fingerprint(entry.fingerprint)
            .with_result(result)
            .with_age(Some(now.saturating_sub(entry.since)))
            .with_expires_in(Some(entry.expires_at.saturating_sub(now)))
    }
}

/// `d` as every backend takes it: whole milliseconds within [`MIN_DURATION`] ..=
/// [`MAX_DURATION`](crate::store::MAX_DURATION), so adding it to the clock never overflows.
///
/// [`MIN_DURATION`]: crate::store::MIN_DURATION
pub(super) fn clamped(d: Duration) -> Duration {
    Duration::from_millis(clamped_millis(d))
}

/// Locks a shard. A poisoned lock (a panic while it was held) is taken over: every primitive
/// leaves the map consistent before it can panic, so the data is still valid.
pub(super) fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
