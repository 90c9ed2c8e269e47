//! [`MemoryStore`]: its shards, its builder, and the engine's primitives.

use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::StoreError;
use crate::key::Key;
use crate::store::memory::clock::{Clock, SystemClock};
use crate::store::memory::shard::{clamped, lock, Entry, Shard, State, SHARDS};
use crate::store::{
    claim_answer, next_fence, BoxFuture, Claim, ClaimAnswer, ClaimRequest, Completion, Record,
    Store, Token, DEFAULT_MAX_RESULT_SIZE,
};

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
    pub(super) shards: Box<[Mutex<Shard>]>,
    pub(super) hasher: RandomState,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) max_result_size: usize,
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
    pub(super) fn shard(&self, key: &Key) -> (MutexGuard<'_, Shard>, u64) {
        let hash = self.hasher.hash_one(key);
        let index = ((hash >> 32) & 0xffff) as usize % self.shards.len();
        (lock(&self.shards[index]), hash)
    }

    fn claim_now(&self, req: &ClaimRequest) -> Claim {
        let now = self.clock.now();
        let (mut shard, hash) = self.shard(&req.key);
        shard.maybe_sweep(now);
        let fence = match shard.live(&req.key, hash, now) {
            Some(entry) => match claim_answer(req, entry.record(now)) {
                ClaimAnswer::Answer(claim) => return claim,
                ClaimAnswer::TakeOver { fence } => fence,
            },
            // The wall clock is read only when the key has no record.
            None => next_fence(None, self.clock.unix_micros()),
        };
        let lease = clamped(req.lease);
        let expires_at = now + clamped(req.record_lifetime());
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
