//! The embedded in-memory store: no server, correct under multi-threaded contention.
//!
//! Records live in a sharded map; each shard is a mutex held only for the few instructions
//! of one primitive (never across an `.await`), so claims of different keys rarely contend.
//! Expired records are dropped lazily when touched, and a shard is swept whenever it has
//! doubled since its last sweep (or has seen as many claims as it holds records): whatever
//! the mix of new keys and duplicates, a shard holds at most twice the records live at its
//! last sweep (or 1,024), for a constant cost per claim. Time is the store's own monotonic
//! [`Clock`] (fences also read its wall time, [`Clock::unix_micros`]); a [`ManualClock`]
//! makes lease and expiry tests instant and exact.
//!
//! Durations are taken in whole milliseconds within
//! [`MIN_DURATION`](crate::store::MIN_DURATION) ..= [`MAX_DURATION`](crate::store::MAX_DURATION),
//! as on every backend.
//!
//! It is the right store for demos, tests of code that uses the framework, and single-process
//! services whose dedup window need not survive a restart. Records are lost when the process
//! exits.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hashbrown::HashTable;

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::{
    clamped_millis, next_fence, BoxFuture, Claim, ClaimRequest, Completion, Expect, Fingerprint,
    OperatorStore, Record, RecordState, ScanCursor, ScanPage, Store, Token,
    DEFAULT_MAX_RESULT_SIZE,
};

/// A monotonic clock for the [`MemoryStore`].
pub trait Clock: Send + Sync + 'static {
    /// Time elapsed since an arbitrary, fixed origin.
    fn now(&self) -> Duration;

    /// Microseconds since the Unix epoch: the fence of a key without a record (see
    /// [`next_fence`]), which must keep growing across a process restart. The default reads
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

const SHARDS: usize = 64;
/// A shard holding fewer records than this is never swept for its size.
const SWEEP_FLOOR: usize = 1024;

#[derive(Debug, Clone)]
enum State {
    InProgress { lease_until: Duration },
    Completed { result: Option<Arc<[u8]>> },
    Released,
}

#[derive(Debug, Clone)]
struct Entry {
    state: State,
    token: Token,
    fence: u64,
    fingerprint: Option<Fingerprint>,
    expires_at: Duration,
    /// When the record entered its state (renewals do not count).
    since: Duration,
}

/// A record in a shard's table, with its key's hash (the store's keyed SipHash), computed
/// once per operation and kept for the table's growth.
struct Slot {
    key: Key,
    hash: u64,
    entry: Entry,
}

fn slot_hash(slot: &Slot) -> u64 {
    slot.hash
}

#[derive(Default)]
struct Shard {
    map: HashTable<Slot>,
    /// Records left by the last sweep.
    swept_len: usize,
    /// Operations since the last sweep.
    ops_since_sweep: usize,
    /// No record expires before this: a sweep before it has nothing to drop.
    next_expiry: Duration,
}

impl Shard {
    /// Drops expired records when the map has doubled since the last sweep (fresh keys pay
    /// for it: at least half the records scanned were inserted since), or when as many
    /// operations as records have passed (duplicates pay for it). Either way a sweep costs a
    /// constant per operation, and the map holds at most twice the records live at the last
    /// sweep, or [`SWEEP_FLOOR`]. A sweep before the earliest expiry scans nothing.
    fn maybe_sweep(&mut self, now: Duration) {
        self.ops_since_sweep += 1;
        let len = self.map.len();
        if len >= self.swept_len.saturating_mul(2).max(SWEEP_FLOOR)
            || self.ops_since_sweep >= len.max(SWEEP_FLOOR)
        {
            self.sweep(now);
        }
    }

    fn sweep(&mut self, now: Duration) {
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
    fn expires(&mut self, at: Duration) {
        self.next_expiry = self.next_expiry.min(at);
    }

    /// The live record of `key` (whose hash is `hash`), dropping it first if it has expired.
    fn live(&mut self, key: &Key, hash: u64, now: Duration) -> Option<&mut Entry> {
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
    fn put(&mut self, key: &Key, hash: u64, entry: Entry) {
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
    fn remove(&mut self, key: &Key, hash: u64) {
        if let Ok(found) = self.map.find_entry(hash, |slot| slot.key == *key) {
            found.remove();
        }
    }
}

/// The embedded in-memory [`Store`].
///
/// ```
/// use std::sync::Arc;
/// use idempotent_runtime::MemoryStore;
///
/// let store = Arc::new(MemoryStore::new());
/// idempotent_runtime::set_default_store(store.clone()).ok();
/// ```
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    max_result_size: usize,
}

/// Builds a [`MemoryStore`]: its clock and the largest result it stores.
///
/// ```
/// use std::sync::Arc;
/// use idempotent_runtime::memory::{ManualClock, MemoryStore};
/// use idempotent_runtime::Store;
///
/// let store = MemoryStore::builder()
///     .clock(Arc::new(ManualClock::new()))
///     .max_result_size(64 << 10)
///     .build();
/// assert_eq!(store.max_result_size(), 64 << 10);
/// ```
#[must_use]
pub struct MemoryStoreBuilder {
    clock: Arc<dyn Clock>,
    max_result_size: usize,
}

impl std::fmt::Debug for MemoryStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStoreBuilder")
            .field("max_result_size", &self.max_result_size)
            .finish_non_exhaustive()
    }
}

impl MemoryStoreBuilder {
    /// The store's clock (default: the system's, [`SystemClock`]).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The largest stored result, in bytes (default [`DEFAULT_MAX_RESULT_SIZE`], 1 MiB). A
    /// larger result completes its record without it: duplicates get no replay, and never
    /// run again. See [`Store::max_result_size`].
    pub fn max_result_size(mut self, bytes: usize) -> Self {
        self.max_result_size = bytes;
        self
    }

    /// An empty store.
    pub fn build(self) -> MemoryStore {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            clock: self.clock,
            max_result_size: self.max_result_size,
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .field("max_result_size", &self.max_result_size)
            .finish()
    }
}

impl MemoryStore {
    /// An empty store on the system's monotonic clock.
    pub fn new() -> MemoryStore {
        MemoryStore::with_clock(SystemClock::default())
    }

    /// An empty store on the given clock.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idempotent_runtime::memory::{ManualClock, MemoryStore};
    ///
    /// let clock = Arc::new(ManualClock::new());
    /// let store = MemoryStore::with_clock(clock.clone());
    /// # let _ = store;
    /// ```
    pub fn with_clock(clock: impl Clock) -> MemoryStore {
        MemoryStore::builder().clock(clock).build()
    }

    /// A builder, to set the clock or the largest stored result.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            clock: Arc::new(SystemClock::default()),
            max_result_size: DEFAULT_MAX_RESULT_SIZE,
        }
    }

    /// How many records are held, counting expired ones not yet swept.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).map.len()).sum()
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every expired record now.
    pub fn purge_expired(&self) {
        let now = self.clock.now();
        for shard in self.shards.iter() {
            lock(shard).sweep(now);
        }
    }

    /// Forgets every record (for an operator clearing a held key, or tests).
    pub fn clear(&self) {
        for shard in self.shards.iter() {
            lock(shard).map.clear();
        }
    }

    /// The shard of `key`, locked, and the key's hash: bits 32..48 pick the shard, so the bits
    /// a shard's table uses (the lowest for the slot, the highest seven for its tag) stay spread
    /// within each shard.
    fn shard(&self, key: &Key) -> (MutexGuard<'_, Shard>, u64) {
        let hash = self.hasher.hash_one(key);
        let index = ((hash >> 32) & 0xffff) as usize % self.shards.len();
        (lock(&self.shards[index]), hash)
    }

    fn claim_now(&self, req: &ClaimRequest) -> Claim {
        let now = self.clock.now();
        let (mut shard, hash) = self.shard(&req.key);
        shard.maybe_sweep(now);
        let mismatch = |e: &Entry| match (e.fingerprint, req.fingerprint) {
            (Some(stored), Some(given)) => stored != given,
            _ => false,
        };
        let previous_fence = match shard.live(&req.key, hash, now) {
            None => None,
            Some(entry) => match &entry.state {
                // The same owner claiming again (a retry after a lost reply).
                State::InProgress { .. } if entry.token == req.token => {
                    return Claim::Acquired { fence: entry.fence }
                }
                State::Completed { result } if !mismatch(entry) => {
                    return Claim::Completed {
                        fence: entry.fence,
                        result: result.as_deref().map(<[u8]>::to_vec),
                    }
                }
                State::InProgress { lease_until } if *lease_until > now && !mismatch(entry) => {
                    return Claim::InProgress { fence: entry.fence }
                }
                State::Released => Some(entry.fence),
                _ if mismatch(entry) => return Claim::Mismatch { fence: entry.fence },
                // An InProgress record whose lease ran out: take it over.
                _ => Some(entry.fence),
            },
        };
        // The wall clock is read only when the key has no record.
        let now_micros = match previous_fence {
            Some(_) => 0,
            None => self.clock.unix_micros(),
        };
        let fence = next_fence(previous_fence, now_micros);
        let lease = clamped(req.lease);
        let expires_at = now + clamped(req.ttl).max(lease);
        shard.expires(expires_at);
        shard.put(
            &req.key,
            hash,
            Entry {
                state: State::InProgress {
                    lease_until: now + lease,
                },
                token: req.token,
                fence,
                fingerprint: req.fingerprint,
                expires_at,
                since: now,
            },
        );
        Claim::Acquired { fence }
    }

    fn complete_now(&self, key: &Key, token: &Token, completion: &Completion) -> bool {
        let now = self.clock.now();
        let (mut shard, hash) = self.shard(key);
        let Some(entry) = shard.live(key, hash, now) else {
            return false;
        };
        if entry.token != *token {
            return false;
        }
        let expires_at = now + clamped(completion.ttl);
        match entry.state {
            State::InProgress { .. } => {
                entry.state = State::Completed {
                    result: completion.result.as_deref().map(Arc::from),
                };
                entry.expires_at = expires_at;
                entry.since = now;
            }
            State::Completed { .. } => return true,
            State::Released => return false,
        }
        shard.expires(expires_at);
        true
    }

    fn release_now(&self, key: &Key, token: &Token) -> bool {
        let now = self.clock.now();
        let (mut shard, hash) = self.shard(key);
        match shard.live(key, hash, now) {
            Some(entry)
                if entry.token == *token && matches!(entry.state, State::InProgress { .. }) =>
            {
                entry.state = State::Released;
                entry.since = now;
                true
            }
            _ => false,
        }
    }

    fn reopen_now(&self, key: &Key, token: &Token) -> bool {
        let now = self.clock.now();
        let (mut shard, hash) = self.shard(key);
        match shard.live(key, hash, now) {
            Some(entry) if entry.token == *token => {
                entry.state = State::Released;
                entry.since = now;
                true
            }
            _ => false,
        }
    }

    fn renew_now(&self, key: &Key, token: &Token, lease: Duration) -> bool {
        let now = self.clock.now();
        let (mut shard, hash) = self.shard(key);
        match shard.live(key, hash, now) {
            Some(entry)
                if entry.token == *token && matches!(entry.state, State::InProgress { .. }) =>
            {
                let lease_until = now + clamped(lease);
                entry.state = State::InProgress { lease_until };
                entry.expires_at = entry.expires_at.max(lease_until);
                true
            }
            _ => false,
        }
    }

    fn read_now(&self, key: &Key) -> Option<Record> {
        let now = self.clock.now();
        let (mut shard, hash) = self.shard(key);
        let entry = shard.live(key, hash, now)?;
        Some(entry.record(now))
    }

    fn delete_now(&self, key: &Key, token: &Token) -> bool {
        let now = self.clock.now();
        let (mut shard, hash) = self.shard(key);
        match shard.live(key, hash, now) {
            // A live claim is never deleted: its owner may be running.
            Some(entry)
                if entry.token == *token
                    && !matches!(entry.state, State::InProgress { lease_until } if lease_until > now) =>
            {
                shard.remove(key, hash);
                true
            }
            _ => false,
        }
    }

    /// One shard's live records under `prefix` after `after`, at most `limit`, in key order.
    fn scan_now(
        &self,
        prefix: &str,
        cursor: &ScanCursor,
        limit: usize,
    ) -> Result<ScanPage, StoreError> {
        let (index, after) = parse_cursor(cursor, self.shards.len())?;
        let now = self.clock.now();
        let shard = lock(&self.shards[index]);
        let mut found: Vec<(&Key, &Entry)> = shard
            .map
            .iter()
            .map(|slot| (&slot.key, &slot.entry))
            .filter(|(key, entry)| {
                entry.expires_at > now
                    && key.prefix() == prefix
                    && after.as_deref().is_none_or(|after| key.as_bytes() > after)
            })
            .collect();
        found.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let limit = limit.max(1);
        let more = found.len() > limit;
        found.truncate(limit);
        let next = match found.last() {
            Some((key, _)) if more => Some(ScanCursor::new(format!(
                "{index}:{}",
                crate::key::hex_string(key.as_bytes())
            ))),
            _ if index + 1 < self.shards.len() => Some(ScanCursor::new(format!("{}:", index + 1))),
            _ => None,
        };
        let records = found
            .into_iter()
            .map(|(key, entry)| (key.clone(), Ok(entry.record(now))))
            .collect();
        Ok(ScanPage::new(records, next))
    }
}

/// The shard and the last key of a memory scan's cursor (`<shard>:<hex key>`).
fn parse_cursor(
    cursor: &ScanCursor,
    shards: usize,
) -> Result<(usize, Option<Vec<u8>>), StoreError> {
    if cursor.is_start() {
        return Ok((0, None));
    }
    let bad = || {
        StoreError::new(
            StoreErrorKind::Rejected,
            format!("`{cursor}` is not a cursor of a memory store"),
        )
    };
    let (index, key) = cursor.as_str().split_once(':').ok_or_else(bad)?;
    let index: usize = index.parse().map_err(|_| bad())?;
    if index >= shards {
        return Err(bad());
    }
    let key = if key.is_empty() {
        None
    } else {
        Some(crate::key::parse_hex(key).ok_or_else(bad)?)
    };
    Ok((index, key))
}

impl Entry {
    /// The record as [`Store::read`] returns it, at `now`.
    fn record(&self, now: Duration) -> Record {
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
fn clamped(d: Duration) -> Duration {
    Duration::from_millis(clamped_millis(d))
}

/// Locks a shard. A poisoned lock (a panic while it was held) is taken over: every primitive
/// leaves the map consistent before it can panic, so the data is still valid.
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Store for MemoryStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        let claim = self.claim_now(req);
        Box::pin(std::future::ready(Ok(claim)))
    }

    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let done = self.complete_now(key, token, completion);
        Box::pin(std::future::ready(Ok(done)))
    }

    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let released = self.release_now(key, token);
        Box::pin(std::future::ready(Ok(released)))
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let renewed = self.renew_now(key, token, lease);
        Box::pin(std::future::ready(Ok(renewed)))
    }

    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(std::future::ready(Ok(self.read_now(key))))
    }

    fn max_result_size(&self) -> usize {
        self.max_result_size
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}

impl OperatorStore for MemoryStore {
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let reopened = self.reopen_now(key, token);
        Box::pin(async move { Ok(reopened) })
    }

    /// One shard per page, in key order within it: a scan takes as many pages as the store
    /// has shards, at least.
    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        cursor: &'a ScanCursor,
        limit: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
        Box::pin(std::future::ready(self.scan_now(prefix, cursor, limit)))
    }

    /// Every record of this store is readable: `Expect::Corrupt` deletes nothing.
    fn delete<'a>(
        &'a self,
        key: &'a Key,
        expect: Expect<'a>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let deleted = match expect {
            Expect::Token(token) => self.delete_now(key, token),
            Expect::Corrupt => false,
        };
        Box::pin(std::future::ready(Ok(deleted)))
    }
}
