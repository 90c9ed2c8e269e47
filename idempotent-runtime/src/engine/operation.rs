//! [`Operation`]: one idempotent call, from its claim to its answer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::FutureExt as _;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use crate::default_store::default_store;
use crate::engine::claimed::Claimed;
use crate::engine::conclude::{quiet, Refusal, Report};
use crate::engine::current::Current;
use crate::engine::decide::{decide, Busy, Next, Waiting};
use crate::engine::handler::{BusinessCheck, Check, DoneKey, HandlerResult, NoCheck};
use crate::engine::idempotency::Idempotency;
use crate::engine::owner::Owner;
use crate::engine::pending::PendingClaim;
use crate::engine::results::Results;
use crate::engine::run::{own, run_unguarded, unwrap_req};
use crate::error::Error;
use crate::key::{Key, KeyError, KeyPart};
use crate::metrics;
use crate::policy::{OnError, OnStoreError};
use crate::store::Fingerprint;

/// One idempotent call: built by [`Idempotency::operation`] (or the attribute), run by
/// [`Operation::run`].
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotent_runtime::{Error, Idempotency, Key, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let payments = Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
/// let key = Key::new("payment:capture", 1, &[&"pay-1"]).unwrap();
///
/// let first: Result<String, Error> = payments
///     .operation(key.clone())
///     .fingerprint(&[&"EUR", &1250u64])
///     .replay()
///     .run(async { Ok("receipt-1".to_string()) })
///     .await;
/// let replayed: Result<String, Error> = payments
///     .operation(key)
///     .fingerprint(&[&"EUR", &1250u64])
///     .replay()
///     .run(async { Ok("never runs".to_string()) })
///     .await;
/// assert_eq!(first.unwrap(), replayed.unwrap());
/// # }
/// ```
#[must_use = "an operation does nothing until `.run(...).await`"]
pub struct Operation<R: HandlerResult, D = NoCheck> {
    settings: Idempotency,
    key: Result<Key, KeyError>,
    fingerprint: Option<Fingerprint>,
    results: Results<R>,
    done: D,
    /// A key whose completed record means the effect is applied.
    done_key: Option<Key>,
}

impl<R: HandlerResult, D> Operation<R, D> {
    /// An operation with these settings (a batch item that waits for a live owner).
    pub(crate) fn of_parts(
        settings: Idempotency,
        key: Key,
        fingerprint: Option<Fingerprint>,
        results: Results<R>,
        done: D,
    ) -> Operation<R, D> {
        Operation {
            settings,
            key: Ok(key),
            fingerprint,
            results,
            done,
            done_key: None,
        }
    }
}

impl<R: HandlerResult> Operation<R> {
    pub(crate) fn new(settings: Idempotency, key: Result<Key, KeyError>) -> Operation<R> {
        Operation {
            settings,
            key,
            fingerprint: None,
            results: Results::default(),
            done: NoCheck,
            done_key: None,
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
        self.results = self.results.with_replay();
        self
    }

    /// Like [`replay`](Self::replay), with the caller's own encoding of the value (the HTTP
    /// layer's binary form of a response). `encode` writes [`codec::OK`](crate::codec::OK) first.
    #[cfg(any(feature = "http", feature = "grpc"))]
    pub(crate) fn replay_with(
        mut self,
        encode: fn(&R::Ok) -> Result<Vec<u8>, Error>,
        decode: fn(&[u8]) -> Result<R::Ok, Error>,
    ) -> Self {
        self.results = self.results.with_replay_codec(encode, decode);
        self
    }

    /// Counts the effect as applied when the record under `key` is completed (the HTTP
    /// layer's request under the previous key layout): checked as a business check is, before
    /// the business check. The first claim reads it in its own round trip where the store can
    /// ([`Store::claim_and_is_completed`](crate::store::Store::claim_and_is_completed)), beside
    /// it otherwise.
    #[cfg(feature = "http")]
    pub(crate) fn done_if_completed(mut self, key: Option<Key>) -> Self {
        self.done_key = key;
        self
    }

    /// Decides, per handler error, what happens to the claim. Without it every error
    /// releases the claim ([`OnError::Release`]).
    pub fn on_error(mut self, classify: fn(&R::Err) -> OnError) -> Self {
        self.results = self.results.with_on_error(classify);
        self
    }

    /// Stores handler errors and replays them to duplicates (every error, unless
    /// [`on_error`](Self::on_error) classifies them otherwise).
    pub fn store_errors(mut self) -> Self
    where
        R::Err: Serialize + DeserializeOwned,
    {
        self.results = self.results.with_store_errors();
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
        self.results = self.results.with_on_replay(hook);
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
    pub fn done<F, Fut, X>(self, check: F) -> Operation<R, Check<F>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool, X>>,
        R::Err: From<X>,
    {
        Operation {
            settings: self.settings,
            key: self.key,
            fingerprint: self.fingerprint,
            results: self.results,
            done: Check(check),
            done_key: self.done_key,
        }
    }
}

impl<R, D> Operation<R, D>
where
    R: HandlerResult,
    D: BusinessCheck,
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
    /// let payments = Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
    /// let key = Key::new("balance:deduct", 1, &[&"user-7", &"tx-1"]).unwrap();
    /// let out: Result<String, Error> = payments
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
        Started::Unstarted {
            start: Some(move |span: tracing::Span| self.execute(Some(body), span)),
        }
        .map(R::from_result)
    }

    /// `body` is an `Option` so that [`own`] can take it out of this future in place: a
    /// body passed on by value would be stored again in each future it passes through.
    async fn execute<B, F>(self, mut body: Option<B>, span: tracing::Span) -> Result<R::Ok, R::Err>
    where
        B: FnOnce(Current) -> F,
        F: Future<Output = R>,
    {
        let Operation {
            mut settings,
            key,
            fingerprint,
            results,
            mut done,
            done_key,
        } = self;
        let key = key.map_err(Error::from)?;
        span.record("key", tracing::field::display(&key));
        let lifetime = settings.lifetime()?;
        let Some(store) = settings.store.take().or_else(default_store) else {
            return Err(Error::NoStore.into());
        };
        let report = Report::new(span, store.name());
        let req = Arc::new(lifetime.request(key, fingerprint));
        let mut waiting = Waiting::new(settings.in_progress);
        let name = store.name();
        let mut first_wait: Option<metrics::Started> = None;
        // The first claim reads the done key with it; later checks read it anew.
        let mut done_key = done_key.map(|key| DoneKey { key, read: None });
        let mut first = true;
        loop {
            let sent_at = tokio::time::Instant::now();
            let mut pending = match done_key.as_ref() {
                Some(done_key) if std::mem::take(&mut first) => {
                    PendingClaim::checking(&store, &req, &done_key.key)
                }
                _ => PendingClaim::new(&store, &req),
            };
            let claimed = (&mut pending).await;
            if let Some(done_key) = done_key.as_mut() {
                done_key.read = pending.read();
            }
            drop(pending);
            metrics::claim_duration(&req.key, name, metrics::Started::at(sent_at));
            let claim = match claimed {
                Ok(claim) => claim,
                Err(err) => {
                    metrics::store_error(name, err.kind());
                    let req = unwrap_req(req);
                    return match settings.on_store_error {
                        OnStoreError::FailOpen => {
                            run_unguarded(&report, store, req, &err, &mut body).await
                        }
                        _ => report.refuse(req.key, Refusal::Store(err), &results),
                    };
                }
            };
            let next = decide(claim, settings.in_progress, &mut waiting);
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
            report.fence(next.fence());
            let refusal = match next {
                Next::Run { fence } => {
                    let claimed = Claimed::new(store, unwrap_req(req), fence, sent_at);
                    let owner = Owner::new(Arc::new(claimed));
                    let on_lost = settings.on_lost_lease;
                    let done = (done_key.as_mut(), &mut done);
                    return own(&report, owner, done, &results, on_lost, &mut body).await;
                }
                Next::Completed { result, .. } => Refusal::Completed(result),
                Next::Mismatch { .. } => Refusal::Mismatch,
                Next::Busy { fence, then } => {
                    if let Some(done_key) = done_key.as_mut() {
                        if done_key
                            .applied(&store, req.lease)
                            .await
                            .map_err(Error::Store)?
                        {
                            return report.refuse(
                                unwrap_req(req).key,
                                Refusal::DoneBefore,
                                &results,
                            );
                        }
                    }
                    if let Some(check) = done.start() {
                        if check.await? {
                            return report.refuse(
                                unwrap_req(req).key,
                                Refusal::DoneBefore,
                                &results,
                            );
                        }
                    }
                    match then {
                        Busy::Retry(pause) => {
                            first_wait.get_or_insert_with(metrics::Started::now);
                            tokio::time::sleep(pause).await;
                            continue;
                        }
                        Busy::Skip => Refusal::Skipped,
                        Busy::Reject => Refusal::InProgress { fence },
                    }
                }
            };
            return report.refuse(unwrap_req(req).key, refusal, &results);
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`Operation::run_with`]: until its first poll, what starts the call (the
    /// operation and its body); then the call, in its span.
    ///
    /// The span is made at the first poll, as an `async fn` would make it, so that it is a
    /// child of the span the future runs in. The call then takes the place of what started
    /// it, in at most one move of the call's future (some kilobytes; a `lazy(..).then(..)`
    /// chain would move it twice), and the operation and the body are not kept beside it, as
    /// an `async` block around the call would keep them.
    #[project = StartedProj]
    enum Started<S, F> {
        Unstarted { start: Option<S> },
        Running {
            #[pin]
            call: tracing::instrument::Instrumented<F>,
        },
    }
}

impl<S, F> Future for Started<S, F>
where
    S: FnOnce(tracing::Span) -> F,
    F: Future,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        loop {
            match self.as_mut().project() {
                StartedProj::Running { call } => return call.poll(cx),
                StartedProj::Unstarted { start } => {
                    // `start` only builds the call's future (nothing of the caller's runs in
                    // it), and the state moves on right after it is taken.
                    let Some(start) = start.take() else {
                        unreachable!("an idempotent call lost what starts it")
                    };
                    let span = quiet(tracing::debug_span!(
                        "idempotency",
                        key = tracing::field::Empty,
                        fence = tracing::field::Empty,
                        outcome = tracing::field::Empty,
                    ));
                    let call = start(span.clone()).instrument(span);
                    self.set(Started::Running { call });
                }
            }
        }
    }
}

impl Idempotency {
    /// One call on `key`, to refine and [`run`](Operation::run).
    pub fn operation<R: HandlerResult>(&self, key: Key) -> Operation<R> {
        Operation::new(self.clone(), Ok(key))
    }

    /// Runs `body` at most once for `key`, with these settings: a shorthand for
    /// `self.operation(key).run(body)`.
    pub fn run<R, F>(&self, key: Key, body: F) -> impl Future<Output = R>
    where
        R: HandlerResult,
        F: Future<Output = R>,
    {
        self.operation(key).run(body)
    }
}
