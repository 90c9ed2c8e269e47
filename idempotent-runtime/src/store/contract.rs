//! The [`Store`] trait: the engine's atomic, owner-checked primitives, and the handles a
//! store is shared by ([`SharedStore`], [`IntoStore`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::error::StoreError;
use crate::key::Key;
use crate::store::{
    AcquiredClaim, Claim, ClaimRequest, Completion, End, Ending, Record, RecordState, Token,
    DEFAULT_MAX_RESULT_SIZE,
};

/// A boxed, sendable future, as returned by [`Store`] methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A store shared by handlers.
pub type SharedStore = Arc<dyn Store>;

/// The atomic primitives an idempotency backend provides to the engine.
///
/// Implementations must make each method one atomic operation on the store (a Redis script,
/// one SQL statement, one critical section) and use the store's own clock for leases and
/// expiry. The conformance suite in the repository's `tests/` checks every rule; run it
/// against a new backend before trusting it. An operator's tools need the store's
/// [`OperatorStore`](super::OperatorStore) methods too (see
/// [Writing a store](crate::store#writing-a-store)).
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
    /// The fence of an acquisition is [`next_fence`](super::next_fence): one more than the record's fence, or the
    /// store's clock in microseconds since the Unix epoch when the key has no record, so fences
    /// never repeat for a key, not even after its record expired.
    ///
    /// Durations outside [`MIN_DURATION`](super::MIN_DURATION) ..= [`MAX_DURATION`](super::MAX_DURATION) are clamped (see
    /// [`clamped_millis`](super::clamped_millis)); the engine refuses them before they reach a store.
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
    /// ends a batch's items with it ([`Idempotency::run_batch`](crate::Idempotency::run_batch)).
    /// The default ends them one after another.
    fn complete_many<'a>(
        &'a self,
        items: &'a [Ending],
    ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
        Box::pin(async move {
            let mut ended = Vec::with_capacity(items.len());
            for item in items {
                ended.push(item.send_alone(self).await);
            }
            ended
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

    /// [`release`](Store::release), naming the claim `token` acquired. A store may use
    /// `claim` to recognise the owner's record with less work (Redis compares the record its
    /// fast claim wrote, byte for byte, instead of parsing it), but the answer must be the
    /// one the token alone gives: a record whose fence or lease differs (renewed since) is
    /// still released if `token` owns it. The engine and [`Lock`](crate::Lock) release
    /// through it; the default calls [`release`](Store::release).
    fn release_acquired<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        claim: &'a AcquiredClaim,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let _ = claim;
        self.release(key, token)
    }

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

    /// Whether the live record under `key` is `Completed`: `false` when there is none or it
    /// is in progress or released. For a check that needs the state alone (the HTTP layer
    /// reads a request's key under the previous key layout this way, alongside every fresh
    /// claim), which a store may answer with less work than a [`read`](Store::read) (Redis:
    /// one `GET`, where a read also asks for the key's expiry and the server's time). A
    /// value that is not a record is the error `read` gives. The default calls `read`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::{Completion, ClaimRequest, Key, MemoryStore, Store, Token};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let key = Key::new("doc", 1, &[&"a"])?;
    /// let minute = Duration::from_secs(60);
    /// let req = ClaimRequest::new(key.clone(), Token::generate(), minute, minute);
    /// store.claim(&req).await?;
    /// assert!(!store.is_completed(&key).await?);
    /// store.complete(&key, &req.token, &Completion::new(None, minute)).await?;
    /// assert!(store.is_completed(&key).await?);
    /// # Ok(()) }
    /// ```
    fn is_completed<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let record = self.read(key).await?;
            Ok(record.is_some_and(|r| r.state == RecordState::Completed))
        })
    }

    /// [`claim`](Store::claim) `req` and [`is_completed`](Store::is_completed) `other`, sent
    /// together in one round trip, for a store that can: the engine asks it for the first claim
    /// of a call that is done when another key's record is completed (the HTTP layer's request
    /// under the previous key layout). Both answers come back together, each as its own method
    /// would give it: a claim's lost reply is an
    /// [`OutcomeUnknown`](crate::StoreErrorKind::OutcomeUnknown) error the engine resolves by
    /// reading the record back, as for `claim`.
    ///
    /// `None` (the default) when the store cannot send them together, and then the engine sends
    /// the two calls side by side. A store that answers the two over one connection (Redis: one
    /// pipeline, `[SET .. NX .. GET, GET]`) gains a round trip's work; one whose calls may
    /// answer apart should keep the default, since the engine waits for the read only when the
    /// claim acquired. A store behind a `Box` or a `&'static` reference answers `None`: the
    /// call needs the store's own `Arc`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use idempotent_runtime::{ClaimRequest, Key, MemoryStore, Store, Token};
    ///
    /// let store = Arc::new(MemoryStore::new());
    /// let minute = Duration::from_secs(60);
    /// let req = ClaimRequest::new(Key::new("doc", 2, &[&"a"]).unwrap(), Token::generate(), minute, minute);
    /// let previous = Key::new("doc", 1, &[&"a"]).unwrap();
    /// // The memory store answers every call at once: it has no round trip to share.
    /// assert!(store.claim_and_is_completed(Arc::new(req), previous).is_none());
    /// ```
    #[allow(clippy::type_complexity)]
    fn claim_and_is_completed(
        self: Arc<Self>,
        req: Arc<ClaimRequest>,
        other: Key,
    ) -> Option<BoxFuture<'static, (Result<Claim, StoreError>, Result<bool, StoreError>)>> {
        let _ = (req, other);
        None
    }

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

impl Ending {
    /// Sends this ending to `store` alone: its `complete` or `release`.
    pub(crate) fn send_alone<'a, S: Store + ?Sized>(
        &'a self,
        store: &'a S,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        match &self.action {
            End::Complete(completion) => store.complete(&self.key, &self.token, completion),
            End::Release => store.release(&self.key, &self.token),
        }
    }
}

/// Forwards every method of [`Store`] through a pointer to a store, but for the methods written
/// in its braces: only an `Arc` can hand [`Store::claim_and_is_completed`] the store's own
/// `Arc`, so a `Box` or a reference keeps its default.
macro_rules! forward_store {
    ($(#[$doc:meta])* impl<S> Store for $ty:ty { $($extra:tt)* }) => {
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
            fn release_acquired<'a>(
                &'a self,
                key: &'a Key,
                token: &'a Token,
                claim: &'a AcquiredClaim,
            ) -> BoxFuture<'a, Result<bool, StoreError>> {
                (**self).release_acquired(key, token, claim)
            }
            fn complete_many<'a>(
                &'a self,
                items: &'a [Ending],
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
            fn is_completed<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<bool, StoreError>> {
                (**self).is_completed(key)
            }
            $($extra)*
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
    impl<S> Store for Arc<S> {
        fn claim_and_is_completed(
            self: Arc<Self>,
            req: Arc<ClaimRequest>,
            other: Key,
        ) -> Option<BoxFuture<'static, (Result<Claim, StoreError>, Result<bool, StoreError>)>>
        {
            S::claim_and_is_completed(Arc::clone(&*self), req, other)
        }
    }
);
forward_store!(
    /// A boxed store is a store.
    impl<S> Store for Box<S> {}
);
forward_store!(
    /// A reference to a store that lives for the whole program (a `static`, or
    /// `Box::leak`) is a store.
    impl<S> Store for &'static S {}
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
