//! The engine: claim → run (with lease renewal) → complete or release.
//!
//! [`Guard`] holds the settings shared by many calls; [`Operation`] is one call, built from a
//! guard and a key, refined with a fingerprint, a replay codec, an error policy and a
//! business-status check, and run with [`Operation::run`]. The `#[idempotent]` attribute
//! expands to exactly this.

use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use crate::codec;
use crate::default_store::default_store;
use crate::error::{Error, StoreError};
use crate::key::{Key, KeyError, KeyPart};
use crate::policy::{default_lease, InProgress, OnError, OnStoreError};
use crate::store::{
    Claim, ClaimRequest, Completion, Fingerprint, IntoStore, RecordState, SharedStore, Store, Token,
};

/// The settings shared by many idempotent calls: store, ttl, lease and policies.
///
/// This is the API for code that cannot use the attribute: closures, keys computed at run
/// time, generic plumbing.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotent_runtime::{Error, Guard, Key, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let guard = Guard::new(Duration::from_secs(3600)).store(Arc::new(MemoryStore::new()));
/// let key = Key::new("coupon:grant", 1, &[&"user-7", &"spring-sale"]).unwrap();
///
/// let first: Result<u32, Error> = guard.run(key.clone(), async { Ok(42) }).await;
/// assert_eq!(first.unwrap(), 42);
///
/// let again: Result<u32, Error> = guard.run(key, async { Ok(43) }).await;
/// assert!(matches!(again, Err(Error::Duplicate { .. })));
/// # }
/// ```
#[derive(Clone)]
pub struct Guard {
    store: Option<SharedStore>,
    ttl: Duration,
    lease: Option<Duration>,
    in_progress: InProgress,
    on_store_error: OnStoreError,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("store", &self.store.as_ref().map(|_| "..."))
            .field("ttl", &self.ttl)
            .field("lease", &self.lease_duration())
            .field("in_progress", &self.in_progress)
            .field("on_store_error", &self.on_store_error)
            .finish()
    }
}

impl Guard {
    /// Settings with the given record ttl, the process-default store, the default lease
    /// (30 s, or a third of the ttl when that is shorter) and the default policies (reject
    /// in-progress duplicates, fail closed).
    ///
    /// Choose `ttl` to cover the worst handler time plus the broker's longest redelivery delay:
    /// a duplicate that arrives after the record expired runs again.
    pub fn new(ttl: Duration) -> Guard {
        Guard {
            store: None,
            ttl,
            lease: None,
            in_progress: InProgress::default(),
            on_store_error: OnStoreError::default(),
        }
    }

    /// Uses this store instead of the process default.
    pub fn store(mut self, store: impl IntoStore) -> Guard {
        self.store = Some(store.into_store());
        self
    }

    /// How long a claim stays live without renewal. While the handler runs the lease is
    /// renewed every third of it, so it only bounds how long a crashed owner blocks the key.
    pub fn lease(mut self, lease: Duration) -> Guard {
        self.lease = Some(lease);
        self
    }

    /// What to do when another owner holds a live claim.
    pub fn on_in_progress(mut self, policy: InProgress) -> Guard {
        self.in_progress = policy;
        self
    }

    /// What to do when the store fails before the handler ran.
    pub fn on_store_error(mut self, policy: OnStoreError) -> Guard {
        self.on_store_error = policy;
        self
    }

    /// The record ttl.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The effective lease: the one set, or the default for the ttl.
    pub fn lease_duration(&self) -> Duration {
        self.lease.unwrap_or_else(|| default_lease(self.ttl))
    }

    /// One call on `key`, to refine and [`run`](Operation::run).
    pub fn operation<R: HandlerResult>(&self, key: Key) -> Operation<R> {
        Operation::new(self.clone(), Ok(key))
    }

    /// Runs `handler` for a batch of items, claiming all their keys with one
    /// [`Store::claim_many`] (one round trip on Redis), and settles each item by its own
    /// outcome: results come back in input order, each what [`Operation::run`] would have
    /// returned for that item alone. Acquired items run concurrently, each under its own lease
    /// renewal; items held by a live owner follow the guard's in-progress policy (with
    /// [`InProgress::Wait`] they are claimed again one by one).
    ///
    /// Batches have no fingerprint, replay or business check; use [`Operation`] per item
    /// where those are needed.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotent_runtime::{Error, Guard, Key, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let guard = Guard::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
    /// let batch = |ids: &[u32]| {
    ///     ids.iter().map(|id| (Key::new("order", 1, &[id]).unwrap(), *id)).collect::<Vec<_>>()
    /// };
    /// let first: Vec<Result<u32, Error>> =
    ///     guard.run_batch(batch(&[1, 2]), |id| async move { Ok(id) }).await;
    /// assert_eq!(first.into_iter().collect::<Result<Vec<_>, _>>().unwrap(), [1, 2]);
    ///
    /// let second: Vec<Result<u32, Error>> =
    ///     guard.run_batch(batch(&[2, 3]), |id| async move { Ok(id) }).await;
    /// assert!(matches!(second[0], Err(Error::Duplicate { .. })));
    /// assert_eq!(second[1].as_ref().unwrap(), &3);
    /// # }
    /// ```
    pub async fn run_batch<T, F, Fut, R>(&self, items: Vec<(Key, T)>, handler: F) -> Vec<R>
    where
        F: Fn(T) -> Fut,
        Fut: Future<Output = R>,
        R: HandlerResult,
    {
        let Some(store) = self.store.clone().or_else(default_store) else {
            return items
                .iter()
                .map(|_| R::from_result(Err(Error::NoStore.into())))
                .collect();
        };
        let lease = self.lease_duration();
        let reqs: Vec<ClaimRequest> = items
            .iter()
            .map(|(key, _)| ClaimRequest {
                key: key.clone(),
                token: Token::generate(),
                lease,
                ttl: self.ttl,
                fingerprint: None,
            })
            .collect();
        let claims = store.claim_many(&reqs).await;
        let handler = &handler;
        let runs = items
            .into_iter()
            .zip(reqs)
            .zip(claims)
            .map(|(((_, item), req), first)| {
                let store = store.clone();
                let span = tracing::debug_span!(
                    "idempotent",
                    key = %req.key,
                    fence = tracing::field::Empty,
                    outcome = tracing::field::Empty,
                );
                async move {
                    R::from_result(self.settle_claimed(store, req, first, item, handler).await)
                }
                .instrument(span)
            });
        join_all(runs.map(Box::pin).collect()).await
    }

    /// One batch item, from its claim's outcome to its result.
    async fn settle_claimed<T, F, Fut, R>(
        &self,
        store: SharedStore,
        req: ClaimRequest,
        first: Result<Claim, StoreError>,
        item: T,
        handler: &F,
    ) -> Result<R::Ok, R::Err>
    where
        F: Fn(T) -> Fut,
        Fut: Future<Output = R>,
        R: HandlerResult,
    {
        let span = tracing::Span::current();
        let claim = match resolve_claim(&*store, &req, first).await {
            Ok(claim) => claim,
            Err(err) => {
                return match self.on_store_error {
                    OnStoreError::FailOpen => {
                        tracing::warn!(error = %err, "store failed; running unguarded (fail open)");
                        handler(item).await.into_result()
                    }
                    _ => {
                        span.record("outcome", "store_error");
                        Err(Error::Store(err).into())
                    }
                }
            }
        };
        match claim {
            Claim::Acquired { fence } => {
                span.record("fence", fence);
                let owner = Owner {
                    store,
                    key: req.key,
                    token: req.token,
                    armed: true,
                };
                let settle = Settle::<R>::default();
                own(
                    owner,
                    fence,
                    req.lease,
                    req.ttl,
                    &mut NoDone,
                    &settle,
                    handler(item),
                )
                .await
            }
            Claim::Completed { result, .. } => {
                span.record("outcome", "completed");
                completed(req.key, result, &Settle::<R>::default())
            }
            Claim::Mismatch { .. } => Err(Error::PayloadMismatch { key: req.key }.into()),
            Claim::InProgress { fence } => match self.in_progress {
                InProgress::Skip => Err(Error::Skipped { key: req.key }.into()),
                InProgress::Wait(_) => self.run(req.key, handler(item)).await.into_result(),
                _ => {
                    span.record("outcome", "in_progress");
                    Err(Error::InProgress {
                        key: req.key,
                        fence,
                    }
                    .into())
                }
            },
        }
    }

    /// Runs `body` at most once for `key`, with this guard's settings: a shorthand for
    /// `self.operation(key).run(body)`.
    pub async fn run<R, F>(&self, key: Key, body: F) -> R
    where
        R: HandlerResult,
        F: Future<Output = R>,
    {
        self.operation(key).run(body).await
    }
}

/// The output of an idempotent handler: `Result<T, E>` where `E: From<idempotent::Error>`.
#[diagnostic::on_unimplemented(
    message = "idempotent handlers must return `Result<T, E>`, but this one returns `{Self}`",
    label = "not a `Result`",
    note = "the handler's error type must also implement `From<idempotent::Error>`"
)]
pub trait HandlerResult: Sized {
    /// The success type.
    type Ok;
    /// The error type.
    type Err: From<Error>;
    /// Splits the output.
    fn into_result(self) -> Result<Self::Ok, Self::Err>;
    /// Builds the output.
    fn from_result(result: Result<Self::Ok, Self::Err>) -> Self;
}

impl<T, E: From<Error>> HandlerResult for Result<T, E> {
    type Ok = T;
    type Err = E;
    fn into_result(self) -> Result<T, E> {
        self
    }
    fn from_result(result: Result<T, E>) -> Self {
        result
    }
}

/// A business-status check for [`Operation::done`]. Implemented by [`NoDone`] and by the
/// wrapper that `done` installs; not meant to be implemented by hand.
pub trait DoneCheck {
    /// The check's error type.
    type Error;
    /// The check's future.
    type Future: Future<Output = Result<bool, Self::Error>>;
    /// Starts one check, or `None` when there is no check.
    fn start(&mut self) -> Option<Self::Future>;
}

/// No business-status check.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoDone;

impl DoneCheck for NoDone {
    type Error = Error;
    type Future = std::future::Ready<Result<bool, Error>>;
    fn start(&mut self) -> Option<Self::Future> {
        None
    }
}

/// A business-status check installed by [`Operation::done`].
#[derive(Debug, Clone, Copy)]
pub struct Done<F>(F);

impl<F, Fut, X> DoneCheck for Done<F>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, X>>,
{
    type Error = X;
    type Future = Fut;
    fn start(&mut self) -> Option<Fut> {
        Some((self.0)())
    }
}

struct Codec<T> {
    encode: fn(&T) -> Result<Vec<u8>, Error>,
    decode: fn(&[u8]) -> Result<T, Error>,
}

/// One idempotent call: built by [`Guard::operation`] (or the attribute), run by
/// [`Operation::run`].
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotent_runtime::{Error, Guard, Key, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let guard = Guard::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
/// let key = Key::new("payment:capture", 1, &[&"pay-1"]).unwrap();
///
/// let first: Result<String, Error> = guard
///     .operation(key.clone())
///     .fingerprint(&[&"EUR", &1250u64])
///     .replay()
///     .run(async { Ok("receipt-1".to_string()) })
///     .await;
/// let replayed: Result<String, Error> = guard
///     .operation(key)
///     .fingerprint(&[&"EUR", &1250u64])
///     .replay()
///     .run(async { Ok("never runs".to_string()) })
///     .await;
/// assert_eq!(first.unwrap(), replayed.unwrap());
/// # }
/// ```
#[must_use = "an operation does nothing until `.run(...).await`"]
pub struct Operation<R: HandlerResult, D = NoDone> {
    guard: Guard,
    key: Result<Key, KeyError>,
    fingerprint: Option<Fingerprint>,
    settle: Settle<R>,
    done: D,
}

/// How a run's outcome is stored: replay codecs and the error policy.
struct Settle<R: HandlerResult> {
    replay: Option<Codec<R::Ok>>,
    errors: Option<Codec<R::Err>>,
    on_error: Option<fn(&R::Err) -> OnError>,
}

impl<R: HandlerResult> Default for Settle<R> {
    fn default() -> Self {
        Settle {
            replay: None,
            errors: None,
            on_error: None,
        }
    }
}

impl<R: HandlerResult> Operation<R> {
    pub(crate) fn new(guard: Guard, key: Result<Key, KeyError>) -> Operation<R> {
        Operation {
            guard,
            key,
            fingerprint: None,
            settle: Settle::default(),
            done: NoDone,
        }
    }
}

impl<R: HandlerResult, D> Operation<R, D> {
    /// Checks the payload: the fingerprint of `parts` is stored with the claim, and a later
    /// call with the same key and a different fingerprint fails with
    /// [`Error::PayloadMismatch`].
    pub fn fingerprint(self, parts: &[&dyn KeyPart]) -> Self {
        self.fingerprint_of(Fingerprint::of(parts))
    }

    /// Like [`fingerprint`](Self::fingerprint), with a fingerprint computed elsewhere (of a
    /// raw request body, say).
    pub fn fingerprint_of(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// Stores the `Ok` value of the first run and returns it to duplicates, instead of
    /// [`Error::Duplicate`].
    pub fn replay(mut self) -> Self
    where
        R::Ok: Serialize + DeserializeOwned,
    {
        self.settle.replay = Some(Codec {
            encode: |value| codec::encode(codec::OK, value),
            decode: codec::decode,
        });
        self
    }

    /// Decides, per handler error, what happens to the claim. Without it every error
    /// releases the claim ([`OnError::Release`]).
    pub fn on_error(mut self, classify: fn(&R::Err) -> OnError) -> Self {
        self.settle.on_error = Some(classify);
        self
    }

    /// Stores handler errors and replays them to duplicates (every error, unless
    /// [`on_error`](Self::on_error) classifies them otherwise).
    pub fn store_errors(mut self) -> Self
    where
        R::Err: Serialize + DeserializeOwned,
    {
        self.settle.errors = Some(Codec {
            encode: |err| codec::encode(codec::ERR, err),
            decode: codec::decode,
        });
        if self.settle.on_error.is_none() {
            self.settle.on_error = Some(|_| OnError::Store);
        }
        self
    }

    /// Installs a business-status check: `check()` returns a future that says whether the
    /// effect is already applied (an order already `CONSUMED`, say).
    ///
    /// It is asked after an acquired claim, before the handler runs (a `true` completes the
    /// record and the call returns [`Error::Duplicate`] without running), and when the claim
    /// finds another owner's live claim (a `true` returns [`Error::Duplicate`] at once, leaving
    /// the record to its owner). This keeps effects exactly-once when the store lost its data.
    /// A check that fails gives the claim back and returns its error: nothing runs.
    pub fn done<F, Fut, X>(self, check: F) -> Operation<R, Done<F>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool, X>>,
        R::Err: From<X>,
    {
        Operation {
            guard: self.guard,
            key: self.key,
            fingerprint: self.fingerprint,
            settle: self.settle,
            done: Done(check),
        }
    }
}

impl<R, D> Operation<R, D>
where
    R: HandlerResult,
    D: DoneCheck,
    R::Err: From<D::Error>,
{
    /// Runs `body` at most once for the key and returns its output, or the outcome of the
    /// claim: a replayed result, or an error that converts into the handler's error type
    /// ([`Error::Duplicate`], [`Error::InProgress`], [`Error::Store`], ...).
    ///
    /// While `body` runs the lease is renewed every third of it. If this future is dropped
    /// before it finishes, the claim is given back.
    pub async fn run<F>(self, body: F) -> R
    where
        F: Future<Output = R>,
    {
        let span = tracing::debug_span!(
            "idempotent",
            key = tracing::field::Empty,
            fence = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        R::from_result(self.execute(body).instrument(span).await)
    }

    async fn execute<F>(self, body: F) -> Result<R::Ok, R::Err>
    where
        F: Future<Output = R>,
    {
        let Operation {
            mut guard,
            key,
            fingerprint,
            settle,
            mut done,
        } = self;
        let span = tracing::Span::current();
        let key = key.map_err(Error::from)?;
        span.record("key", tracing::field::display(&key));
        let Some(store) = guard.store.take().or_else(default_store) else {
            return Err(Error::NoStore.into());
        };
        let lease = guard.lease_duration();
        let ttl = guard.ttl;
        let req = ClaimRequest {
            key,
            token: Token::generate(),
            lease,
            ttl,
            fingerprint,
        };
        let wait_until = match guard.in_progress {
            InProgress::Wait(max) => Some(tokio::time::Instant::now() + max),
            _ => None,
        };
        let mut backoff = Duration::from_millis(5);

        let fence = loop {
            let claim = match claim(&*store, &req).await {
                Ok(claim) => claim,
                Err(err) => match guard.on_store_error {
                    OnStoreError::FailOpen => {
                        tracing::warn!(error = %err, "store failed; running unguarded (fail open)");
                        span.record("outcome", "fail_open");
                        return body.await.into_result();
                    }
                    _ => {
                        tracing::warn!(error = %err, "store failed; not running (fail closed)");
                        span.record("outcome", "store_error");
                        return Err(Error::Store(err).into());
                    }
                },
            };
            match claim {
                Claim::Acquired { fence } => break fence,
                Claim::Completed { result, fence } => {
                    span.record("fence", fence);
                    span.record("outcome", "completed");
                    return completed(req.key, result, &settle);
                }
                Claim::Mismatch { fence } => {
                    span.record("fence", fence);
                    span.record("outcome", "mismatch");
                    return Err(Error::PayloadMismatch { key: req.key }.into());
                }
                Claim::InProgress { fence } => {
                    span.record("fence", fence);
                    if let Some(check) = done.start() {
                        if check.await? {
                            span.record("outcome", "done");
                            return Err(Error::Duplicate { key: req.key }.into());
                        }
                    }
                    match (guard.in_progress, wait_until) {
                        (InProgress::Skip, _) => {
                            span.record("outcome", "skipped");
                            return Err(Error::Skipped { key: req.key }.into());
                        }
                        (InProgress::Wait(_), Some(until))
                            if tokio::time::Instant::now() < until =>
                        {
                            let left = until - tokio::time::Instant::now();
                            tokio::time::sleep(backoff.min(left)).await;
                            backoff = (backoff * 2).min(Duration::from_millis(250));
                        }
                        _ => {
                            span.record("outcome", "in_progress");
                            return Err(Error::InProgress {
                                key: req.key,
                                fence,
                            }
                            .into());
                        }
                    }
                }
            }
        };
        span.record("fence", fence);

        let owner = Owner {
            store,
            key: req.key,
            token: req.token,
            armed: true,
        };
        own(owner, fence, lease, ttl, &mut done, &settle, body).await
    }
}

/// After an acquired claim: the business check, the handler under the watchdog, then
/// completion or release.
#[allow(clippy::too_many_arguments)]
async fn own<R, D, F>(
    mut owner: Owner,
    fence: u64,
    lease: Duration,
    ttl: Duration,
    done: &mut D,
    settle: &Settle<R>,
    body: F,
) -> Result<R::Ok, R::Err>
where
    R: HandlerResult,
    D: DoneCheck,
    R::Err: From<D::Error>,
    F: Future<Output = R>,
{
    let span = tracing::Span::current();
    if let Some(check) = done.start() {
        match watch(check, &owner, lease).await {
            Ok(true) => {
                span.record("outcome", "done");
                let completion = Completion { result: None, ttl };
                if let Err(err) = owner.complete(&completion).await {
                    tracing::warn!(error = %err, "could not mark a done operation completed");
                }
                owner.armed = false;
                return Err(Error::Duplicate {
                    key: owner.key.clone(),
                }
                .into());
            }
            Ok(false) => {}
            Err(err) => {
                span.record("outcome", "done_check_failed");
                owner.release().await;
                return Err(err.into());
            }
        }
    }

    match watch(body, &owner, lease).await.into_result() {
        Ok(value) => {
            let result = match &settle.replay {
                None => None,
                Some(codec) => match (codec.encode)(&value) {
                    Ok(bytes) => Some(bytes),
                    Err(err) => {
                        tracing::error!(error = %err, "result could not be stored for replay");
                        None
                    }
                },
            };
            match owner.complete(&Completion { result, ttl }).await {
                Ok(true) => {
                    span.record("outcome", "executed");
                    Ok(value)
                }
                Ok(false) => {
                    span.record("outcome", "lost_ownership");
                    tracing::warn!("lost ownership before completing");
                    Err(Error::LostOwnership {
                        key: owner.key.clone(),
                        fence,
                    }
                    .into())
                }
                Err(err) => {
                    // The effect is applied: reporting failure would make the broker
                    // redeliver and run it again. The record stays in progress until its
                    // lease runs out.
                    span.record("outcome", "executed_unrecorded");
                    tracing::error!(error = %err, "effect applied but its completion could not be recorded");
                    Ok(value)
                }
            }
        }
        Err(err) => {
            let policy = settle.on_error.map_or(OnError::Release, |f| f(&err));
            let stored = match (policy, &settle.errors) {
                (OnError::Release, _) => None,
                (OnError::Store, Some(codec)) => Some((codec.encode)(&err).unwrap_or_else(|e| {
                    tracing::error!(error = %e, "handler error could not be stored; holding the key");
                    vec![codec::HELD]
                })),
                (OnError::Hold, _) | (OnError::Store, None) => Some(vec![codec::HELD]),
            };
            match stored {
                None => {
                    span.record("outcome", "released");
                    owner.release().await;
                }
                Some(result) => {
                    span.record("outcome", "failed_stored");
                    let completion = Completion {
                        result: Some(result),
                        ttl,
                    };
                    if let Err(e) = owner.complete(&completion).await {
                        tracing::warn!(error = %e, "could not store the failure");
                    }
                    owner.armed = false;
                }
            }
            Err(err)
        }
    }
}

/// The answer for a key whose record is completed.
fn completed<R: HandlerResult>(
    key: Key,
    result: Option<Vec<u8>>,
    settle: &Settle<R>,
) -> Result<R::Ok, R::Err> {
    match result.as_deref().and_then(<[u8]>::split_first) {
        Some((&codec::OK, body)) => match &settle.replay {
            Some(codec) => Ok((codec.decode)(body)?),
            None => Err(Error::Duplicate { key }.into()),
        },
        Some((&codec::ERR, body)) => match &settle.errors {
            Some(codec) => Err((codec.decode)(body)?),
            None => Err(Error::Duplicate { key }.into()),
        },
        Some((&codec::HELD, _)) => Err(Error::Held { key }.into()),
        _ => Err(Error::Duplicate { key }.into()),
    }
}

/// Claims, resolving a lost reply by reading the record back by token: a claim that was
/// applied but whose reply was lost is ours, never a duplicate.
async fn claim(store: &dyn Store, req: &ClaimRequest) -> Result<Claim, StoreError> {
    resolve_claim(store, req, store.claim(req).await).await
}

/// Resolves a claim's lost reply (see [`claim`]).
async fn resolve_claim(
    store: &dyn Store,
    req: &ClaimRequest,
    first: Result<Claim, StoreError>,
) -> Result<Claim, StoreError> {
    match first {
        Err(err) if err.is_outcome_unknown() => {
            tracing::debug!(error = %err, "claim reply lost; reading the record back");
            match store.read(&req.key).await? {
                Some(record)
                    if record.token == req.token
                        && matches!(record.state, RecordState::InProgress { .. }) =>
                {
                    Ok(Claim::Acquired {
                        fence: record.fence,
                    })
                }
                // Not ours: the claim was not applied, so it is safe to send again.
                _ => store.claim(req).await,
            }
        }
        other => other,
    }
}

/// The current owner of a claim. Dropped while armed (the handler's future was cancelled, or
/// panicked), it gives the claim back.
struct Owner {
    store: SharedStore,
    key: Key,
    token: Token,
    armed: bool,
}

impl Owner {
    /// Completes, resolving a lost reply by reading the record back by token.
    async fn complete(&mut self, completion: &Completion) -> Result<bool, StoreError> {
        let first = self
            .store
            .complete(&self.key, &self.token, completion)
            .await;
        let result = match first {
            Err(err) if err.is_outcome_unknown() => {
                tracing::debug!(error = %err, "completion reply lost; reading the record back");
                match self.store.read(&self.key).await? {
                    Some(record) if record.token == self.token => match record.state {
                        RecordState::Completed => Ok(true),
                        RecordState::InProgress { .. } => {
                            self.store
                                .complete(&self.key, &self.token, completion)
                                .await
                        }
                        RecordState::Released => Ok(false),
                    },
                    _ => Ok(false),
                }
            }
            other => other,
        };
        if result.is_ok() {
            self.armed = false;
        }
        result
    }

    async fn release(&mut self) {
        self.armed = false;
        match self.store.release(&self.key, &self.token).await {
            Ok(true) => {}
            Ok(false) => tracing::debug!("release skipped: the claim is no longer ours"),
            Err(err) => {
                tracing::warn!(error = %err, "release failed; the lease will run out instead")
            }
        }
    }
}

struct NoopWaker;

impl Wake for NoopWaker {
    fn wake(self: Arc<Self>) {}
}

impl Drop for Owner {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let store = self.store.clone();
        let key = self.key.clone();
        let token = self.token;
        let mut release = Box::pin(async move { store.release(&key, &token).await });
        // Try at once: a store that answers without waiting (the memory store) is released
        // before `drop` returns. Otherwise finish on the runtime, if there is one; without a
        // runtime the lease runs out instead.
        let waker = Waker::from(Arc::new(NoopWaker));
        if release
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending()
        {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(release);
            }
        }
        tracing::debug!(key = %self.key, "claim given back after cancellation");
    }
}

/// Polls every future to completion, concurrently, and returns their outputs in order.
async fn join_all<F: Future + Unpin>(mut futures: Vec<F>) -> Vec<F::Output> {
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match Pin::new(future).poll(cx) {
                    Poll::Ready(value) => *output = Some(value),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

/// Drives `fut` while renewing the owner's lease every third of it.
async fn watch<F: Future>(fut: F, owner: &Owner, lease: Duration) -> F::Output {
    let mut fut = pin!(fut);
    // A future that finishes on its first poll needs no timer.
    if let Poll::Ready(out) = poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
        return out;
    }
    let every = (lease / 3).max(Duration::from_millis(1));
    let mut renewing = true;
    let mut next = tokio::time::Instant::now() + every;
    loop {
        tokio::select! {
            biased;
            out = fut.as_mut() => return out,
            () = tokio::time::sleep_until(next), if renewing => {
                next = tokio::time::Instant::now() + every;
                match owner.store.renew(&owner.key, &owner.token, lease).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!("lease lost while the handler runs; completion will be refused");
                        renewing = false;
                    }
                    Err(err) => tracing::warn!(error = %err, "lease renewal failed; retrying"),
                }
            }
        }
    }
}
