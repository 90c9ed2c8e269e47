//! The embedded in-memory store: no server, correct under multi-threaded contention.
//!
//! Records live in a sharded map; each shard is a mutex held only for the few instructions
//! of one primitive (never across an `.await`), so claims of different keys rarely contend.
//! Expired records are dropped lazily when touched and in amortised sweeps, so memory stays
//! proportional to the live records. Time is the store's own monotonic [`Clock`]; a
//! [`ManualClock`] makes lease and expiry tests instant and exact.
//!
//! It is the right store for demos, tests of code that uses the framework, and single-process
//! services whose dedup window need not survive a restart. Records are lost when the process
//! exits.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::StoreError;
use crate::key::Key;
use crate::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Fingerprint, Record, RecordState, Store, Token,
};

/// A monotonic clock for the [`MemoryStore`].
pub trait Clock: Send + Sync + 'static {
    /// Time elapsed since an arbitrary, fixed origin.
    fn now(&self) -> Duration;
}

/// The system's monotonic clock.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    origin: Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
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
        let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(nanos, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Duration {
        (**self).now()
    }
}

const SHARDS: usize = 64;
const MIN_SWEEP_INTERVAL: usize = 1024;

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
}

#[derive(Default)]
struct Shard {
    map: HashMap<Key, Entry>,
    ops_since_sweep: usize,
}

impl Shard {
    /// Drops expired records once enough operations have passed to pay for a full scan.
    fn maybe_sweep(&mut self, now: Duration) {
        self.ops_since_sweep += 1;
        if self.ops_since_sweep >= self.map.len().max(MIN_SWEEP_INTERVAL) {
            self.ops_since_sweep = 0;
            self.map.retain(|_, e| e.expires_at > now);
        }
    }

    /// The live record of `key`, dropping it first if it has expired.
    fn live(&mut self, key: &Key, now: Duration) -> Option<&mut Entry> {
        if self.map.get(key).is_some_and(|e| e.expires_at <= now) {
            self.map.remove(key);
        }
        self.map.get_mut(key)
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
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            clock: Arc::new(clock),
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
            lock(shard).map.retain(|_, e| e.expires_at > now);
        }
    }

    /// Forgets every record (for an operator clearing a held key, or tests).
    pub fn clear(&self) {
        for shard in self.shards.iter() {
            lock(shard).map.clear();
        }
    }

    fn shard(&self, key: &Key) -> MutexGuard<'_, Shard> {
        let index = (self.hasher.hash_one(key) as usize) % self.shards.len();
        lock(&self.shards[index])
    }

    fn claim_now(&self, req: &ClaimRequest) -> Claim {
        let now = self.clock.now();
        let mut shard = self.shard(&req.key);
        shard.maybe_sweep(now);
        let mismatch = |e: &Entry| match (e.fingerprint, req.fingerprint) {
            (Some(stored), Some(given)) => stored != given,
            _ => false,
        };
        let previous_fence = match shard.live(&req.key, now) {
            None => 0,
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
                State::Released => entry.fence,
                _ if mismatch(entry) => return Claim::Mismatch { fence: entry.fence },
                // An InProgress record whose lease ran out: take it over.
                _ => entry.fence,
            },
        };
        let fence = previous_fence + 1;
        shard.map.insert(
            req.key.clone(),
            Entry {
                state: State::InProgress {
                    lease_until: now + req.lease,
                },
                token: req.token,
                fence,
                fingerprint: req.fingerprint,
                expires_at: now + req.ttl.max(req.lease),
            },
        );
        Claim::Acquired { fence }
    }

    fn complete_now(&self, key: &Key, token: &Token, completion: &Completion) -> bool {
        let now = self.clock.now();
        let mut shard = self.shard(key);
        let Some(entry) = shard.live(key, now) else {
            return false;
        };
        if entry.token != *token {
            return false;
        }
        match entry.state {
            State::InProgress { .. } => {
                entry.state = State::Completed {
                    result: completion.result.as_deref().map(Arc::from),
                };
                entry.expires_at = now + completion.ttl;
                true
            }
            State::Completed { .. } => true,
            State::Released => false,
        }
    }

    fn release_now(&self, key: &Key, token: &Token) -> bool {
        let now = self.clock.now();
        let mut shard = self.shard(key);
        match shard.live(key, now) {
            Some(entry)
                if entry.token == *token && matches!(entry.state, State::InProgress { .. }) =>
            {
                entry.state = State::Released;
                true
            }
            _ => false,
        }
    }

    fn renew_now(&self, key: &Key, token: &Token, lease: Duration) -> bool {
        let now = self.clock.now();
        let mut shard = self.shard(key);
        match shard.live(key, now) {
            Some(entry)
                if entry.token == *token && matches!(entry.state, State::InProgress { .. }) =>
            {
                let lease_until = now + lease;
                entry.state = State::InProgress { lease_until };
                entry.expires_at = entry.expires_at.max(lease_until);
                true
            }
            _ => false,
        }
    }

    fn read_now(&self, key: &Key) -> Option<Record> {
        let now = self.clock.now();
        let mut shard = self.shard(key);
        let entry = shard.live(key, now)?;
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
        Some(Record {
            state,
            token: entry.token,
            fence: entry.fence,
            fingerprint: entry.fingerprint,
            result,
        })
    }
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
}
