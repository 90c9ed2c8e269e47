//! [`Operation`]: one idempotent call, from its claim to its answer.

use std::future::Future;
use std::sync::Arc;

use futures_util::FutureExt as _;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use crate::codec;
use crate::default_store::default_store;
use crate::engine::current::Current;
use crate::engine::decide::{decide, Busy, Next, Waiting};
use crate::engine::handler::{Done, DoneCheck, HandlerResult, NoDone};
use crate::engine::idempotency::Idempotency;
use crate::engine::owner::{Claimed, Owner, Settled};
use crate::engine::pending::PendingClaim;
use crate::engine::watch::{watch, Watched};
use crate::error::{Error, StoreError, StoreErrorKind};
use crate::key::{Key, KeyError, KeyPart};
use crate::metrics;
use crate::policy::{OnError, OnLostLease, OnStoreError};
use crate::store::{ClaimRequest, Fingerprint, Token};

struct Codec<T> {
    encode: fn(&T) -> Result<Vec<u8>, Error>,
    decode: fn(&[u8]) -> Result<T, Error>,
}

impl<T> Clone for Codec<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Codec<T> {}

/// One idempotent call: built by [`Idempotency::operation`] (or the attribute), run by
/// [`Operation::run`].
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotent_runtime::{Error, Idempotency, Key, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let guard = Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
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
    guard: Idempotency,
    key: Result<Key, KeyError>,
    fingerprint: Option<Fingerprint>,
    outcomes: Outcomes<R>,
    done: D,
}

/// How a run's outcome is stored: replay codecs and the error policy.
pub(crate) struct Outcomes<R: HandlerResult> {
    replay: Option<Codec<R::Ok>>,
    errors: Option<Codec<R::Err>>,
    on_error: Option<fn(&R::Err) -> OnError>,
    on_replay: Option<fn(&Key)>,
}

impl<R: HandlerResult> Clone for Outcomes<R> {
    fn clone(&self) -> Self {
        Outcomes {
            replay: self.replay,
            errors: self.errors,
            on_error: self.on_error,
            on_replay: self.on_replay,
        }
    }
}

impl<R: HandlerResult> Outcomes<R> {
    /// Stores `Ok` values and replays them ([`Operation::replay`]).
    pub(crate) fn with_replay(mut self) -> Self
    where
        R::Ok: Serialize + DeserializeOwned,
    {
        self.replay = Some(Codec {
            encode: |value| codec::encode(codec::OK, value),
            decode: codec::decode,
        });
        self
    }

    /// Classifies errors ([`Operation::on_error`]).
    pub(crate) fn with_on_error(mut self, classify: fn(&R::Err) -> OnError) -> Self {
        self.on_error = Some(classify);
        self
    }

    /// Stores errors and replays them ([`Operation::store_errors`]).
    pub(crate) fn with_store_errors(mut self) -> Self
    where
        R::Err: Serialize + DeserializeOwned,
    {
        self.errors = Some(Codec {
            encode: |err| codec::encode(codec::ERR, err),
            decode: codec::decode,
        });
        if self.on_error.is_none() {
            self.on_error = Some(|_| OnError::Store);
        }
        self
    }

    /// Calls `hook` on every replay ([`Operation::on_replay`]).
    pub(crate) fn with_on_replay(mut self, hook: fn(&Key)) -> Self {
        self.on_replay = Some(hook);
        self
    }

    /// Replays `Ok` values with the caller's own encoding (`encode` writes [`codec::OK`]
    /// first).
    #[cfg(all(
        feature = "http",
        any(feature = "postgres", feature = "mysql", feature = "sqlite")
    ))]
    pub(crate) fn replaying(
        encode: fn(&R::Ok) -> Result<Vec<u8>, Error>,
        decode: fn(&[u8]) -> Result<R::Ok, Error>,
    ) -> Self {
        Outcomes {
            replay: Some(Codec { encode, decode }),
            errors: None,
            on_error: None,
            on_replay: None,
        }
    }

    /// The stored form of a successful run's value: `None` without replay.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub(crate) fn encode_ok(&self, value: &R::Ok) -> Result<Option<Vec<u8>>, Error> {
        self.replay
            .as_ref()
            .map(|codec| (codec.encode)(value))
            .transpose()
    }
}

impl<R: HandlerResult> Default for Outcomes<R> {
    fn default() -> Self {
        Outcomes {
            replay: None,
            errors: None,
            on_error: None,
            on_replay: None,
        }
    }
}

impl<R: HandlerResult, D> Operation<R, D> {
    /// An operation with these settings (a batch item that waits for a live owner).
    pub(crate) fn of_parts(
        guard: Idempotency,
        key: Key,
        fingerprint: Option<Fingerprint>,
        outcomes: Outcomes<R>,
        done: D,
    ) -> Operation<R, D> {
        Operation {
            guard,
            key: Ok(key),
            fingerprint,
            outcomes,
            done,
        }
    }
}

impl<R: HandlerResult> Operation<R> {
    pub(crate) fn new(guard: Idempotency, key: Result<Key, KeyError>) -> Operation<R> {
        Operation {
            guard,
            key,
            fingerprint: None,
            outcomes: Outcomes::default(),
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
        self.outcomes = self.outcomes.with_replay();
        self
    }

    /// Like [`replay`](Self::replay), with the caller's own encoding of the value (the HTTP
    /// layer's binary form of a response). `encode` writes [`codec::OK`] first.
    #[cfg(feature = "http")]
    pub(crate) fn replay_with(
        mut self,
        encode: fn(&R::Ok) -> Result<Vec<u8>, Error>,
        decode: fn(&[u8]) -> Result<R::Ok, Error>,
    ) -> Self {
        self.outcomes.replay = Some(Codec { encode, decode });
        self
    }

    /// Decides, per handler error, what happens to the claim. Without it every error
    /// releases the claim ([`OnError::Release`]).
    pub fn on_error(mut self, classify: fn(&R::Err) -> OnError) -> Self {
        self.outcomes = self.outcomes.with_on_error(classify);
        self
    }

    /// Stores handler errors and replays them to duplicates (every error, unless
    /// [`on_error`](Self::on_error) classifies them otherwise).
    pub fn store_errors(mut self) -> Self
    where
        R::Err: Serialize + DeserializeOwned,
    {
        self.outcomes = self.outcomes.with_store_errors();
        self
    }

    /// Calls `hook` with the key each time this call answers with a stored result (a value
    /// from [`replay`](Self::replay), an error from [`store_errors`](Self::store_errors))
    /// instead of running the body: the way to tell a replay from a fresh run (count it, log
    /// it) without changing what the body returns.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::{sync::Arc, time::Duration};
    /// use idempotent_runtime::{Error, Idempotency, Key, MemoryStore};
    ///
    /// static REPLAYS: AtomicUsize = AtomicUsize::new(0);
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let coupons = Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
    /// let key = Key::new("coupon:grant", 1, &[&"user-7"]).unwrap();
    /// for _ in 0..3 {
    ///     let code: Result<String, Error> = coupons
    ///         .operation(key.clone())
    ///         .replay()
    ///         .on_replay(|_key| {
    ///             REPLAYS.fetch_add(1, Ordering::Relaxed);
    ///         })
    ///         .run(async { Ok("SPRING-0001".to_owned()) })
    ///         .await;
    ///     assert_eq!(code.unwrap(), "SPRING-0001");
    /// }
    /// assert_eq!(REPLAYS.load(Ordering::Relaxed), 2);
    /// # }
    /// ```
    pub fn on_replay(mut self, hook: fn(&Key)) -> Self {
        self.outcomes = self.outcomes.with_on_replay(hook);
        self
    }

    /// Installs a business-status check: `check()` returns a future that says whether the
    /// effect is already applied (an order already `CONSUMED`, say).
    ///
    /// It is asked after an acquired claim, before the handler runs (a `true` completes the
    /// record and the call returns [`Error::Duplicate`] without running), and when the claim
    /// finds another owner's live claim (a `true` returns [`Error::Duplicate`] at once, leaving
    /// the record to its owner). This keeps effects exactly-once when the store lost its data,
    /// and when a completion retried in the background after the caller got `Ok` was lost
    /// (reported to [`on_completion_lost`](crate::on_completion_lost)).
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
            outcomes: self.outcomes,
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
    /// While `body` runs the lease is renewed every third of it, and [`current()`](crate::current)
    /// returns the claim (key, fence, lost-lease signal). If this future is dropped before
    /// `body` finished, the claim is given back (once an in-flight claim lands, if need be).
    /// Once `body` returned, its outcome is recorded and the claim is never given back: a
    /// completion the store does not take at once (an outage, a lost reply, this future
    /// dropped) is retried in the background while the lease is renewed.
    // Not an `async fn`: each `async fn` layer would keep its own copy of the operation and
    // the body in the future, which then grows with every layer.
    pub fn run<F>(self, body: F) -> impl Future<Output = R>
    where
        F: Future<Output = R>,
    {
        self.run_with(move |_| body)
    }

    /// Like [`run`](Self::run), with a body that receives its claim: key, fence, and the
    /// lost-lease signal.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotent_runtime::{Error, Idempotency, Key, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let guard = Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
    /// let key = Key::new("balance:deduct", 1, &[&"user-7", &"tx-1"]).unwrap();
    /// let out: Result<String, Error> = guard
    ///     .operation(key)
    ///     .run_with(|claim| async move {
    ///         // UPDATE balance SET amount = amount - 10, fence = $1
    ///         //  WHERE user_id = 'user-7' AND fence < $1
    ///         Ok(format!("deducted under fence {}", claim.fence()))
    ///     })
    ///     .await;
    /// assert!(out.unwrap().starts_with("deducted"));
    /// # }
    /// ```
    pub fn run_with<B, F>(self, body: B) -> impl Future<Output = R>
    where
        B: FnOnce(Current) -> F,
        F: Future<Output = R>,
    {
        // The span is made at the first poll, as an `async fn` would make it, so that it is a
        // child of the span the future runs in; `then` holds the operation, then the call, in
        // one place.
        futures_util::future::lazy(|_| {
            tracing::debug_span!(
                "idempotency",
                key = tracing::field::Empty,
                fence = tracing::field::Empty,
                outcome = tracing::field::Empty,
            )
        })
        .then(move |span| self.execute(Some(body)).instrument(span))
        .map(R::from_result)
    }

    /// `body` is an `Option` so that [`own`] can take it out of this future in place: a
    /// body passed on by value would be stored again in each future it passes through.
    async fn execute<B, F>(self, mut body: Option<B>) -> Result<R::Ok, R::Err>
    where
        B: FnOnce(Current) -> F,
        F: Future<Output = R>,
    {
        let Operation {
            mut guard,
            key,
            fingerprint,
            outcomes,
            mut done,
        } = self;
        let span = tracing::Span::current();
        let key = key.map_err(Error::from)?;
        span.record("key", tracing::field::display(&key));
        guard.check()?;
        let Some(store) = guard.store.take().or_else(default_store) else {
            return Err(Error::NoStore.into());
        };
        let req = Arc::new(ClaimRequest {
            key,
            token: Token::generate(),
            lease: guard.lease_duration(),
            ttl: guard.ttl,
            fingerprint,
        });
        let mut waiting = Waiting::new(guard.in_progress);
        let name = store.name();
        let mut first_wait: Option<metrics::Started> = None;
        loop {
            let sent_at = tokio::time::Instant::now();
            let claimed = PendingClaim::new(&store, &req).await;
            metrics::claim_duration(&req.key, name, metrics::Started::at(sent_at));
            let claim = match claimed {
                Ok(claim) => claim,
                Err(err) => {
                    metrics::store_error(name, err.kind());
                    return match guard.on_store_error {
                        OnStoreError::FailOpen => {
                            tracing::warn!(error = %err, "store failed; running unguarded (fail open)");
                            span.record("outcome", "fail_open");
                            metrics::outcome(&req.key, name, "fail_open");
                            let Some(body) = body.take() else {
                                return Err(Error::Store(body_taken()).into());
                            };
                            let unguarded = Claimed::new(store, unwrap_req(req), 0, sent_at);
                            let current = Current::new(Arc::new(unguarded));
                            current.clone().scope(body(current)).await.into_result()
                        }
                        _ => {
                            tracing::warn!(error = %err, "store failed; not running (fail closed)");
                            span.record("outcome", "store_error");
                            metrics::outcome(&req.key, name, "store_error");
                            Err(Error::Store(err).into())
                        }
                    };
                }
            };
            let next = decide(claim, guard.in_progress, &mut waiting);
            if let Some(since) = first_wait {
                if !matches!(
                    next,
                    Next::Busy {
                        then: Busy::Retry(_),
                        ..
                    }
                ) {
                    metrics::wait_duration(&req.key, name, since);
                }
            }
            match next {
                Next::Run { fence } => {
                    span.record("fence", fence);
                    let claimed = Claimed::new(store, unwrap_req(req), fence, sent_at);
                    let owner = Owner::new(Arc::new(claimed));
                    return own(owner, &mut done, &outcomes, guard.on_lost_lease, &mut body).await;
                }
                Next::Completed { fence, result } => {
                    span.record("fence", fence);
                    span.record("outcome", "completed");
                    metrics::outcome(&req.key, name, completed_label(&result, &outcomes));
                    return completed(unwrap_req(req).key, result, &outcomes);
                }
                Next::Mismatch { fence } => {
                    span.record("fence", fence);
                    span.record("outcome", "mismatch");
                    metrics::outcome(&req.key, name, "mismatch");
                    return Err(Error::PayloadMismatch {
                        key: unwrap_req(req).key,
                    }
                    .into());
                }
                Next::Busy { fence, then } => {
                    span.record("fence", fence);
                    if let Some(check) = done.start() {
                        if check.await? {
                            span.record("outcome", "done");
                            metrics::outcome(&req.key, name, "done_fallback");
                            return Err(Error::Duplicate {
                                key: unwrap_req(req).key,
                            }
                            .into());
                        }
                    }
                    match then {
                        Busy::Retry(pause) => {
                            first_wait.get_or_insert_with(metrics::Started::now);
                            tokio::time::sleep(pause).await;
                        }
                        Busy::Skip => {
                            span.record("outcome", "skipped");
                            metrics::outcome(&req.key, name, "skipped");
                            return Err(Error::Skipped {
                                key: unwrap_req(req).key,
                            }
                            .into());
                        }
                        Busy::Reject => {
                            span.record("outcome", "in_progress");
                            metrics::outcome(&req.key, name, "in_progress");
                            return Err(Error::InProgress {
                                key: unwrap_req(req).key,
                                fence,
                            }
                            .into());
                        }
                    }
                }
            }
        }
    }
}

/// The request back out of its `Arc` once no claim round trip holds it (a clone otherwise).
pub(crate) fn unwrap_req(req: Arc<ClaimRequest>) -> ClaimRequest {
    Arc::try_unwrap(req).unwrap_or_else(|shared| (*shared).clone())
}

/// The error of a call whose body was already taken: never returned, since every caller
/// hands its body over once.
fn body_taken() -> StoreError {
    StoreError::new(
        StoreErrorKind::Protocol,
        "internal: the handler of this call was already started",
    )
}

/// After an acquired claim: the business check, the body under the watchdog, then the
/// outcome recorded (or the claim given back when the body failed and the policy says so).
/// `body` is taken out where it starts, so the handler's future is stored once, in this
/// future, however many futures the body passed through before.
pub(crate) async fn own<R, D, B, F>(
    owner: Owner,
    done: &mut D,
    outcomes: &Outcomes<R>,
    on_lost: OnLostLease,
    body: &mut Option<B>,
) -> Result<R::Ok, R::Err>
where
    R: HandlerResult,
    D: DoneCheck,
    R::Err: From<D::Error>,
    B: FnOnce(Current) -> F,
    F: Future<Output = R>,
{
    let span = tracing::Span::current();
    let claim = owner.claim().clone();
    let name = claim.store.name();
    let _active = metrics::Active::new(&claim.key, name);
    let report = |label: &'static str| metrics::outcome(&claim.key, name, label);
    if let Some(check) = done.start() {
        match watch(std::pin::pin!(check), &claim, OnLostLease::Continue).await {
            Watched::Done(Ok(true)) => {
                span.record("outcome", "done");
                report("done_fallback");
                // The effect is applied: record it, never give the claim back.
                owner.settle(None).await;
                return Err(Error::Duplicate {
                    key: claim.key.clone(),
                }
                .into());
            }
            Watched::Done(Ok(false)) => {}
            Watched::Done(Err(err)) => {
                span.record("outcome", "done_check_failed");
                report("failed");
                owner.release().await;
                return Err(err.into());
            }
            Watched::Cancelled => {}
        }
    }

    let current = Current::new(claim.clone());
    let started = metrics::Started::now();
    // One expression without an await, so that nothing holds the body (or the future it
    // makes) but the pinned future polled below.
    let body = std::pin::pin!(match body.take() {
        Some(start) => current.clone().scope(start(current)),
        // Never: every caller hands its body over once. The owner, dropped, gives the claim
        // back.
        None => return Err(Error::Store(body_taken()).into()),
    });
    let watched = watch(body, &claim, on_lost).await;
    metrics::handler_duration(&claim.key, name, started);
    let out = match watched {
        Watched::Done(out) => out.into_result(),
        Watched::Cancelled => {
            span.record("outcome", "lost_ownership");
            report("lost_ownership");
            owner.release().await;
            return Err(Error::LostOwnership {
                key: claim.key.clone(),
                fence: claim.fence,
            }
            .into());
        }
    };
    match out {
        Ok(value) => {
            let result = outcomes.replay.as_ref().and_then(|codec| {
                (codec.encode)(&value)
                    .map_err(|err| tracing::error!(error = %err, "result could not be stored for replay"))
                    .ok()
            });
            match owner.settle(result).await {
                Settled::Recorded => {
                    span.record("outcome", "executed");
                    report("executed");
                    Ok(value)
                }
                Settled::Lost | Settled::Unconfirmed => {
                    span.record("outcome", "lost_ownership");
                    report("lost_ownership");
                    tracing::warn!("lost ownership before completing");
                    Err(Error::LostOwnership {
                        key: claim.key.clone(),
                        fence: claim.fence,
                    }
                    .into())
                }
                Settled::Deferred => {
                    // The effect is applied: reporting failure would make the broker redeliver
                    // and run it again. The completion is retried in the background.
                    span.record("outcome", "executed_unrecorded");
                    report("executed");
                    Ok(value)
                }
            }
        }
        Err(err) => {
            let policy = outcomes.on_error.map_or(OnError::Release, |f| f(&err));
            let stored = match (policy, &outcomes.errors) {
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
                    report("failed");
                    owner.release().await;
                }
                Some(result) => {
                    span.record("outcome", "failed_stored");
                    report("failed");
                    if owner.settle(Some(result)).await == Settled::Lost {
                        tracing::warn!("lost ownership before the failure could be stored");
                    }
                }
            }
            Err(err)
        }
    }
}

/// The answer for a key whose record is completed.
/// The metrics outcome of a claim that met a completed record with `result`: what
/// [`completed`] makes of it.
pub(crate) fn completed_label<R: HandlerResult>(
    result: &Option<Vec<u8>>,
    outcomes: &Outcomes<R>,
) -> &'static str {
    match result.as_deref().and_then(<[u8]>::split_first) {
        Some((&codec::OK, _)) if outcomes.replay.is_some() => "replayed",
        Some((&codec::ERR, _)) if outcomes.errors.is_some() => "replayed",
        Some((&codec::HELD, _)) => "held",
        _ => "duplicate",
    }
}

pub(crate) fn completed<R: HandlerResult>(
    key: Key,
    result: Option<Vec<u8>>,
    outcomes: &Outcomes<R>,
) -> Result<R::Ok, R::Err> {
    let replayed = |key: &Key| {
        if let Some(hook) = outcomes.on_replay {
            hook(key);
        }
    };
    match result.as_deref().and_then(<[u8]>::split_first) {
        Some((&codec::OK, body)) => match &outcomes.replay {
            Some(codec) => {
                let value = (codec.decode)(body)?;
                replayed(&key);
                Ok(value)
            }
            None => Err(Error::Duplicate { key }.into()),
        },
        Some((&codec::ERR, body)) => match &outcomes.errors {
            Some(codec) => {
                let err = (codec.decode)(body)?;
                replayed(&key);
                Err(err)
            }
            None => Err(Error::Duplicate { key }.into()),
        },
        Some((&codec::HELD, _)) => Err(Error::Held { key }.into()),
        _ => Err(Error::Duplicate { key }.into()),
    }
}
