//! The [`Store`] trait: a few atomic, owner-checked primitives that every backend provides.
//!
//! A store keeps one record per operation [`Key`]:
//!
//! - `InProgress { token, fence, lease_until }` while an owner runs the handler;
//! - `Completed { token, fence, result? }` once the owner completed it;
//! - `Released { fence }` after the owner gave the claim back (the fence is kept so the next
//!   owner's fence is still higher).
//!
//! Every record expires `ttl` after it was written. Times are the store's own clock, never
//! the caller's. There is no public get-then-set pair: a claim is one atomic operation and
//! every later write checks the caller's token.
//!
//! # Writing a store
//!
//! A backend implements two traits:
//!
//! - [`Store`], what the engine calls on every handler run: `claim`, `complete`, `release`,
//!   `renew` and `read` (the batch methods, the result limit and the name have defaults);
//! - [`OperatorStore`], what an operator's tools call: `reopen`, `scan` and `delete`.
//!   [`Admin`](crate::admin::Admin) and the `idempotent-admin` command line take only a store
//!   that implements it, and so do the stores that wrap others ([`TieredStore`],
//!   [`CombiningStore`]); [`connect`] returns one ([`SharedOperatorStore`]).
//!
//! Neither trait has a method that fails for want of an implementation: a store that lacks
//! the operator's methods is refused by the compiler where an operator would use it, not at
//! run time. The helpers [`next_fence`] and [`clamped_millis`] give the numbers every
//! backend must agree on. The conformance suite in the repository's `tests/` checks every
//! rule of both traits; run it against a new backend before trusting it.
//!
//! A store that counts the claims of another, with both traits passed on to it:
//!
//! ```
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idempotent_runtime::admin::Admin;
//! use idempotent_runtime::store::{Expect, OperatorStore, ScanCursor, ScanPage};
//! use idempotent_runtime::{
//!     BoxFuture, Claim, ClaimRequest, Completion, Key, MemoryStore, Record, Store, StoreError,
//!     Token,
//! };
//!
//! struct Counted<S> {
//!     inner: S,
//!     claims: AtomicU64,
//! }
//!
//! impl<S: Store> Store for Counted<S> {
//!     fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
//!         self.claims.fetch_add(1, Ordering::Relaxed);
//!         self.inner.claim(req)
//!     }
//!     fn complete<'a>(
//!         &'a self,
//!         key: &'a Key,
//!         token: &'a Token,
//!         completion: &'a Completion,
//!     ) -> BoxFuture<'a, Result<bool, StoreError>> {
//!         self.inner.complete(key, token, completion)
//!     }
//!     fn release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<bool, StoreError>> {
//!         self.inner.release(key, token)
//!     }
//!     fn renew<'a>(
//!         &'a self,
//!         key: &'a Key,
//!         token: &'a Token,
//!         lease: Duration,
//!     ) -> BoxFuture<'a, Result<bool, StoreError>> {
//!         self.inner.renew(key, token, lease)
//!     }
//!     fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
//!         self.inner.read(key)
//!     }
//! }
//!
//! impl<S: OperatorStore> OperatorStore for Counted<S> {
//!     fn reopen<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<bool, StoreError>> {
//!         self.inner.reopen(key, token)
//!     }
//!     fn scan<'a>(
//!         &'a self,
//!         prefix: &'a str,
//!         cursor: &'a ScanCursor,
//!         limit: usize,
//!     ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
//!         self.inner.scan(prefix, cursor, limit)
//!     }
//!     fn delete<'a>(&'a self, key: &'a Key, expect: Expect<'a>) -> BoxFuture<'a, Result<bool, StoreError>> {
//!         self.inner.delete(key, expect)
//!     }
//! }
//!
//! let store = Arc::new(Counted { inner: MemoryStore::new(), claims: AtomicU64::new(0) });
//! // Without the `OperatorStore` impl, this line would not compile.
//! let admin = Admin::new(store.clone());
//! # let _ = admin;
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::error::StoreError;
use crate::key::{Key, KeyPart};

mod combining;
pub(crate) mod deadline;
#[cfg(feature = "memory")]
pub mod memory;
mod operator;
mod redact;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod sql;
mod tiered;
mod url;

pub use combining::CombiningStore;
pub use operator::{
    Expect, IntoOperatorStore, OperatorStore, ScanCursor, ScanPage, SharedOperatorStore,
};
pub use tiered::TieredStore;
pub use url::{connect, ConnectError};

/// A boxed, sendable future, as returned by [`Store`] methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A store shared by handlers.
pub type SharedStore = Arc<dyn Store>;

/// The shortest `ttl` or `lease` accepted: one millisecond.
pub const MIN_DURATION: Duration = Duration::from_millis(1);

/// The longest `ttl` or `lease` accepted: 36,500 days (about a century), what every backend
/// can add to its clock without overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(36_500 * 24 * 3600);

/// The largest stored result a store takes by default: 1 MiB. A result above the store's
/// [`max_result_size`](Store::max_result_size) completes its record without it: duplicates
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

/// The atomic primitives an idempotency backend provides to the engine.
///
/// Implementations must make each method one atomic operation on the store (a Redis script,
/// one SQL statement, one critical section) and use the store's own clock for leases and
/// expiry. The conformance suite in the repository's `tests/` checks every rule; run it
/// against a new backend before trusting it. An operator's tools need the store's
/// [`OperatorStore`] methods too (see [Writing a store](self#writing-a-store)).
///
/// ```
/// use std::sync::Arc;
/// use idempotent_runtime::{Claim, ClaimRequest, Key, MemoryStore, Store, Token};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// let key = Key::new("doc", 1, &[&"a"])?;
/// let req = ClaimRequest::new(key, Token::generate(), Duration::from_secs(10), Duration::from_secs(60));
/// let Claim::Acquired { fence } = store.claim(&req).await? else { unreachable!() };
/// let mut other = req.clone();
/// other.token = Token::generate();
/// assert_eq!(store.claim(&other).await?, Claim::InProgress { fence });
/// # Ok(()) }
/// ```
pub trait Store: Send + Sync + 'static {
    /// Claims `req.key` for `req.token`, atomically:
    ///
    /// - no live record, or a `Released` one: write `InProgress` with the next fence, expiring
    ///   `ttl` from now, and return [`Claim::Acquired`];
    /// - an `InProgress` record whose lease has run out: take it over the same way (fence + 1,
    ///   new token), unless its fingerprint differs from `req`'s ([`Claim::Mismatch`]);
    /// - a live `InProgress` record: [`Claim::InProgress`], or [`Claim::Mismatch`] when both
    ///   fingerprints are set and differ;
    /// - a `Completed` record: [`Claim::Completed`] with its stored result, or
    ///   [`Claim::Mismatch`] when both fingerprints are set and differ.
    ///
    /// A claim by the token that already holds the live claim returns `Acquired` with the same
    /// fence, so a claim retried after a lost reply is harmless.
    ///
    /// The fence of an acquisition is [`next_fence`]: one more than the record's fence, or the
    /// store's clock in microseconds since the Unix epoch when the key has no record, so fences
    /// never repeat for a key, not even after its record expired.
    ///
    /// Durations outside [`MIN_DURATION`] ..= [`MAX_DURATION`] are clamped (see
    /// [`clamped_millis`]); the engine refuses them before they reach a store.
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>>;

    /// Claims several keys, each as [`claim`](Store::claim) would, in as few round trips as the
    /// backend allows (one pipeline on Redis). Each outcome is independent and comes back in
    /// the order of `reqs`. The default claims them one after another.
    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Vec<Result<Claim, StoreError>>> {
        Box::pin(async move {
            let mut claims = Vec::with_capacity(reqs.len());
            for req in reqs {
                claims.push(self.claim(req).await);
            }
            claims
        })
    }

    /// Marks the record `Completed` with `completion.result`, expiring `completion.ttl` from
    /// now, if `token` still owns it (the record is `InProgress` with this token, whether or
    /// not its lease ran out). Returns `true` when the record is completed by `token` (also when
    /// it already was, so a retried completion is harmless) and `false` when someone else owns
    /// the key now.
    ///
    /// `completion.claim`, when set, is the fence and fingerprint the claim was acquired
    /// with. A store may use it to recognise the owner's record with less work (Redis
    /// compares the record's head instead of parsing it), but the answer must be the one the
    /// token alone gives: a record whose fence differs is still completed if `token` owns it.
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Completes or releases several records, each as [`complete`](Store::complete) or
    /// [`release`](Store::release) would, in as few round trips as the backend allows (one
    /// pipeline on Redis, one pipeline per node on a cluster, one statement per kind on
    /// SQL). Each outcome is independent and comes back in the order of `items`. The engine
    /// settles a batch's items with it ([`Idempotency::run_batch`](crate::Idempotency::run_batch)).
    /// The default settles them one after another.
    fn complete_many<'a>(
        &'a self,
        items: &'a [Settlement],
    ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
        Box::pin(async move {
            let mut settled = Vec::with_capacity(items.len());
            for item in items {
                settled.push(item.send_alone(self).await);
            }
            settled
        })
    }

    /// Gives the claim back if `token` still owns it: the record becomes `Released` (keeping
    /// its fence) so the next claim acquires at once. Returns `false`, changing nothing, when
    /// `token` is not the owner: no one else's claim is ever removed.
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Extends the lease of `token`'s `InProgress` record to `lease` from now (and the
    /// record's expiry, if the lease would outlive it). Returns `false` when `token` no
    /// longer owns the key.
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Reads the record, for resolving a lost reply by token and for inspection. Never use
    /// it to decide whether to write: claims are atomic on their own.
    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>>;

    /// The largest stored result, in bytes, this store takes. The engine completes a record
    /// whose result is larger without the result (duplicates then get
    /// [`Error::Duplicate`](crate::Error::Duplicate), never a re-run). Backends never report
    /// more than they can take; the default is [`DEFAULT_MAX_RESULT_SIZE`].
    fn max_result_size(&self) -> usize {
        DEFAULT_MAX_RESULT_SIZE
    }

    /// A short name for the store's kind, as metrics and logs label it: `memory`, `redis`,
    /// `redis_cluster`, `postgresql`, `mysql`, `sqlite`, `tiered`; `custom` by default.
    fn name(&self) -> &'static str {
        "custom"
    }
}

/// One write of [`Store::complete_many`]: `action` on `key`, if `token` still owns it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settlement {
    /// The operation key.
    pub key: Key,
    /// The owner's token.
    pub token: Token,
    /// Complete or release.
    pub action: Settle,
}

impl Settlement {
    /// A completion of `key` by `token`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::store::{Settle, Settlement};
    /// use idempotent_runtime::{Completion, Key, Token};
    ///
    /// let key = Key::new("order", 1, &[&7u32]).unwrap();
    /// let done = Settlement::complete(key, Token::generate(), Completion::new(None, Duration::from_secs(60)));
    /// assert!(matches!(done.action, Settle::Complete(_)));
    /// ```
    pub fn complete(key: Key, token: Token, completion: Completion) -> Settlement {
        Settlement {
            key,
            token,
            action: Settle::Complete(completion),
        }
    }

    /// A release of `key` by `token`.
    pub fn release(key: Key, token: Token) -> Settlement {
        Settlement {
            key,
            token,
            action: Settle::Release,
        }
    }

    /// Sends this settlement to `store` alone: its `complete` or `release`.
    pub(crate) fn send_alone<'a, S: Store + ?Sized>(
        &'a self,
        store: &'a S,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        match &self.action {
            Settle::Complete(completion) => store.complete(&self.key, &self.token, completion),
            Settle::Release => store.release(&self.key, &self.token),
        }
    }
}

/// What a [`Settlement`] does.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settle {
    /// [`Store::complete`] with this completion.
    Complete(Completion),
    /// [`Store::release`].
    Release,
}

/// Forwards every method of [`Store`] through a pointer to a store.
macro_rules! forward_store {
    ($(#[$doc:meta])* impl<S> Store for $ty:ty) => {
        $(#[$doc])*
        impl<S: Store + ?Sized> Store for $ty {
            fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
                (**self).claim(req)
            }
            fn claim_many<'a>(
                &'a self,
                reqs: &'a [ClaimRequest],
            ) -> BoxFuture<'a, Vec<Result<Claim, StoreError>>> {
                (**self).claim_many(reqs)
            }
            fn complete<'a>(
                &'a self,
                key: &'a Key,
                token: &'a Token,
                completion: &'a Completion,
            ) -> BoxFuture<'a, Result<bool, StoreError>> {
                (**self).complete(key, token, completion)
            }
            fn release<'a>(
                &'a self,
                key: &'a Key,
                token: &'a Token,
            ) -> BoxFuture<'a, Result<bool, StoreError>> {
                (**self).release(key, token)
            }
            fn complete_many<'a>(
                &'a self,
                items: &'a [Settlement],
            ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
                (**self).complete_many(items)
            }
            fn renew<'a>(
                &'a self,
                key: &'a Key,
                token: &'a Token,
                lease: Duration,
            ) -> BoxFuture<'a, Result<bool, StoreError>> {
                (**self).renew(key, token, lease)
            }
            fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
                (**self).read(key)
            }
            fn max_result_size(&self) -> usize {
                (**self).max_result_size()
            }
            fn name(&self) -> &'static str {
                (**self).name()
            }
        }
    };
}

forward_store!(
    /// A shared store is a store.
    impl<S> Store for Arc<S>
);
forward_store!(
    /// A boxed store is a store.
    impl<S> Store for Box<S>
);
forward_store!(
    /// A reference to a store that lives for the whole program (a `static`, or
    /// `Box::leak`) is a store.
    impl<S> Store for &'static S
);

/// Converts a store handle into a [`SharedStore`]. Implemented for `Arc<S>` of any store,
/// for [`SharedStore`] itself, and for references to either.
///
/// ```
/// use std::sync::Arc;
/// use idempotent_runtime::{IntoStore, MemoryStore, SharedStore};
///
/// let store = Arc::new(MemoryStore::new());
/// let shared: SharedStore = (&store).into_store();
/// # let _ = shared;
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency store handle",
    note = "pass an `Arc` of a store, e.g. `Arc<MemoryStore>` or `idempotency::SharedStore`"
)]
pub trait IntoStore {
    /// The shared handle.
    fn into_store(self) -> SharedStore;
}

impl<S: Store> IntoStore for Arc<S> {
    fn into_store(self) -> SharedStore {
        self
    }
}

impl IntoStore for SharedStore {
    fn into_store(self) -> SharedStore {
        self
    }
}

impl<T: IntoStore + Clone> IntoStore for &T {
    fn into_store(self) -> SharedStore {
        self.clone().into_store()
    }
}

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

/// A digest of a request's payload, stored with the claim so that a duplicate key with a
/// different payload is refused ([`Error::PayloadMismatch`](crate::Error::PayloadMismatch)).
///
/// It is the first 16 bytes of the SHA-256 of the parts' injective encoding: stable across
/// processes, platforms and releases.
///
/// ```
/// use idempotent_runtime::Fingerprint;
///
/// let a = Fingerprint::of(&[&"EUR", &1250u64]);
/// let b = Fingerprint::of(&[&"EUR", &1251u64]);
/// assert_ne!(a, b);
/// assert_eq!(a, Fingerprint::of(&[&"EUR", &1250u64]));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 16]);

impl Fingerprint {
    /// The fingerprint of some values, in order.
    pub fn of(parts: &[&dyn KeyPart]) -> Fingerprint {
        let mut hasher = Sha256::new();
        let mut scratch = Vec::new();
        for part in parts {
            scratch.clear();
            part.write_key_part(&mut scratch);
            hasher.update((scratch.len() as u64).to_le_bytes());
            hasher.update(&scratch);
        }
        Fingerprint::truncate(&hasher.finalize())
    }

    /// The fingerprint of a raw payload (a request body, say).
    pub fn of_bytes(payload: &[u8]) -> Fingerprint {
        Fingerprint::truncate(&Sha256::digest(payload))
    }

    /// A fingerprint from its 16 bytes, as read back from a store.
    pub fn from_bytes(bytes: [u8; 16]) -> Fingerprint {
        Fingerprint(bytes)
    }

    /// The fingerprint's bytes, as written to a store.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    fn truncate(digest: &[u8]) -> Fingerprint {
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        Fingerprint(bytes)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut hex = Vec::with_capacity(32);
        crate::key::push_hex(&mut hex, &self.0);
        write!(f, "Fingerprint({})", String::from_utf8_lossy(&hex))
    }
}

/// What [`Store::claim`] is asked to do. Built with [`ClaimRequest::new`]; fields may be
/// added in later releases.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClaimRequest {
    /// The operation key.
    pub key: Key,
    /// The new owner's token.
    pub token: Token,
    /// How long the claim stays live without renewal.
    pub lease: Duration,
    /// How long the record is kept.
    pub ttl: Duration,
    /// The payload's fingerprint, if the caller checks payloads.
    pub fingerprint: Option<Fingerprint>,
}

/// The outcome of [`Store::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// The caller owns the key now. `fence` grows by one on every acquisition of the key.
    Acquired {
        /// The new fence.
        fence: u64,
    },
    /// The operation was completed before; `result` is what the first run stored.
    Completed {
        /// The fence of the completed run.
        fence: u64,
        /// The stored result, if any.
        result: Option<Vec<u8>>,
    },
    /// Another owner holds a live lease.
    InProgress {
        /// The fence of the live claim.
        fence: u64,
    },
    /// The key's record carries a different payload fingerprint.
    Mismatch {
        /// The fence of the existing record.
        fence: u64,
    },
}

/// What [`Store::complete`] writes. Built with [`Completion::new`]; fields may be added in
/// later releases.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Completion {
    /// The result to replay to duplicates, opaque to the store.
    pub result: Option<Vec<u8>>,
    /// How long the completed record is kept.
    pub ttl: Duration,
    /// The claim this completes, as its owner acquired it, when the owner knows it (see
    /// [`Completion::for_claim`]); `None` for a completion by token alone.
    pub claim: Option<AcquiredClaim>,
}

/// How a claim was acquired: its fence, the fingerprint and the lease it was sent with.
/// Carried by a [`Completion`] so that a store can recognise the owner's record cheaply; it
/// never changes what a completion decides (the token does).
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::{AcquiredClaim, Fingerprint};
///
/// let claim = AcquiredClaim::new(1_796_130_461_329_139, Some(Fingerprint::of(&[&"EUR"])))
///     .with_lease(Duration::from_secs(30));
/// assert_eq!(claim.fence, 1_796_130_461_329_139);
/// assert_eq!(claim.lease, Some(Duration::from_secs(30)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcquiredClaim {
    /// The fence [`Claim::Acquired`] answered.
    pub fence: u64,
    /// The fingerprint of the [`ClaimRequest`], if it had one.
    pub fingerprint: Option<Fingerprint>,
    /// The lease of the [`ClaimRequest`], when the owner names it.
    pub lease: Option<Duration>,
}

impl AcquiredClaim {
    /// The claim acquired with `fence`, sent with `fingerprint`.
    pub fn new(fence: u64, fingerprint: Option<Fingerprint>) -> AcquiredClaim {
        AcquiredClaim {
            fence,
            fingerprint,
            lease: None,
        }
    }

    /// The same claim, sent with a lease of `lease` ([`ClaimRequest::lease`]).
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> AcquiredClaim {
        self.lease = Some(lease);
        self
    }
}

/// The state of a stored record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// An owner holds (or held, if the lease ran out) the claim.
    InProgress {
        /// Time left on the lease; zero when it has run out.
        lease_left: Duration,
    },
    /// The operation completed.
    Completed,
    /// The owner gave the claim back.
    Released,
}

/// A record as returned by [`Store::read`]. Built with [`Record::new`] (for a third-party
/// store); fields may be added in later releases.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// The record's state.
    pub state: RecordState,
    /// The token of the record's last owner.
    pub token: Token,
    /// The record's fence.
    pub fence: u64,
    /// The fingerprint stored with the claim.
    pub fingerprint: Option<Fingerprint>,
    /// The stored result, for a completed record.
    pub result: Option<Vec<u8>>,
    /// How long the record has been in its state, on the store's clock: since the claim for
    /// an in-progress record (renewals do not count), since the completion or release
    /// otherwise. `None` where the store does not keep it (Redis keeps it for in-progress
    /// records only) or for records written before it was kept.
    pub age: Option<Duration>,
    /// Time until the record expires, on the store's clock, where the store reports it.
    pub expires_in: Option<Duration>,
}

impl ClaimRequest {
    /// A claim of `key` for `token`, live for `lease` without renewal, its record kept `ttl`,
    /// without a payload fingerprint.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::{ClaimRequest, Fingerprint, Key, Token};
    ///
    /// let key = Key::new("order", 1, &[&7u32]).unwrap();
    /// let req = ClaimRequest::new(key, Token::generate(), Duration::from_secs(30), Duration::from_secs(3600))
    ///     .with_fingerprint(Fingerprint::of(&[&"EUR", &1250u64]));
    /// assert!(req.fingerprint.is_some());
    /// ```
    pub fn new(key: Key, token: Token, lease: Duration, ttl: Duration) -> ClaimRequest {
        ClaimRequest {
            key,
            token,
            lease,
            ttl,
            fingerprint: None,
        }
    }

    /// The same claim, checking the payload's fingerprint.
    pub fn with_fingerprint(mut self, fingerprint: Fingerprint) -> ClaimRequest {
        self.fingerprint = Some(fingerprint);
        self
    }
}

impl Completion {
    /// A completion storing `result` (if any), the record kept `ttl` from now.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::Completion;
    ///
    /// let done = Completion::new(Some(b"receipt-1".to_vec()), Duration::from_secs(3600));
    /// assert_eq!(done.ttl, Duration::from_secs(3600));
    /// ```
    pub fn new(result: Option<Vec<u8>>, ttl: Duration) -> Completion {
        Completion {
            result,
            ttl,
            claim: None,
        }
    }

    /// The same completion, naming the claim it completes (see [`AcquiredClaim`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::{AcquiredClaim, Completion};
    ///
    /// let done = Completion::new(None, Duration::from_secs(3600))
    ///     .for_claim(AcquiredClaim::new(42, None));
    /// assert_eq!(done.claim.map(|c| c.fence), Some(42));
    /// ```
    #[must_use]
    pub fn for_claim(mut self, claim: AcquiredClaim) -> Completion {
        self.claim = Some(claim);
        self
    }
}

impl Record {
    /// A record in `state`, last owned by `token`, with `fence`, no fingerprint and no stored
    /// result: for third-party stores answering [`Store::read`].
    ///
    /// ```
    /// use idempotent_runtime::{Record, RecordState, Token};
    ///
    /// let record = Record::new(RecordState::Completed, Token::generate(), 42)
    ///     .with_result(Some(b"receipt".to_vec()));
    /// assert_eq!(record.fence, 42);
    /// ```
    pub fn new(state: RecordState, token: Token, fence: u64) -> Record {
        Record {
            state,
            token,
            fence,
            fingerprint: None,
            result: None,
            age: None,
            expires_in: None,
        }
    }

    /// The same record with a stored fingerprint.
    pub fn with_fingerprint(mut self, fingerprint: Option<Fingerprint>) -> Record {
        self.fingerprint = fingerprint;
        self
    }

    /// The same record with a stored result.
    pub fn with_result(mut self, result: Option<Vec<u8>>) -> Record {
        self.result = result;
        self
    }

    /// The same record with how long it has been in its state ([`Record::age`]).
    pub fn with_age(mut self, age: Option<Duration>) -> Record {
        self.age = age;
        self
    }

    /// The same record with the time until it expires ([`Record::expires_in`]).
    pub fn with_expires_in(mut self, expires_in: Option<Duration>) -> Record {
        self.expires_in = expires_in;
        self
    }
}
