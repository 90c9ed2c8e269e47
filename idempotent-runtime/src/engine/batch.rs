//! [`Batch`]: many idempotent calls at once, each as an [`Operation`] would run it, claimed
//! together, and completed (or released) together.

use std::future::Future;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use crate::default_store::default_store;
use crate::engine::claimed::Claimed;
use crate::engine::coalesce::{Coalescing, Forget};
use crate::engine::conclude::{Refusal, Report};
use crate::engine::current::Current;
use crate::engine::decide::{decide, Busy, Next, Waiting};
use crate::engine::handler::{BusinessCheck, CheckEach, HandlerResult, ItemCheck, NoCheck};
use crate::engine::idempotency::Idempotency;
use crate::engine::join::join_woken;
use crate::engine::operation::Operation;
use crate::engine::owner::Owner;
use crate::engine::pending::{self, PendingBatch};
use crate::engine::results::Results;
use crate::engine::run::{own, run_unguarded};
use crate::error::{Error, StoreError, StoreErrorKind};
use crate::key::Key;
use crate::metrics;
use crate::policy::{OnError, OnStoreError};
use crate::store::{Claim, ClaimRequest, Fingerprint, SharedStore};

/// Many idempotent calls at once, built by [`Idempotency::batch`] and refined like an
/// [`Operation`]: a payload fingerprint per item, replay of stored results, an error policy,
/// a business-status check per item. [`run`](Batch::run) claims every item's key in one
/// store call ([`Store::claim_many`](crate::Store::claim_many)), runs the acquired items
/// concurrently (each under its own lease renewal), and records their outcomes together
/// ([`Store::complete_many`](crate::Store::complete_many)): a consumer handling 100 messages
/// pays two round trips on Redis and PostgreSQL, not 101. Each item's answer is what
/// [`Operation::run`] would have returned for it alone.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotent_runtime::{Error, Fingerprint, Idempotency, Key, MemoryStore};
///
/// struct Order { id: u32, cents: u64 }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let charges = Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
/// let orders = || {
///     [Order { id: 1, cents: 500 }, Order { id: 2, cents: 900 }]
///         .into_iter()
///         .map(|o| (Key::new("order:charge", 1, &[&o.id]).unwrap(), o))
///         .collect::<Vec<_>>()
/// };
/// let charge = |o: Order| async move { Ok::<_, Error>(format!("receipt-{}", o.id)) };
/// let batch = || {
///     charges
///         .batch()
///         .fingerprint(|o: &Order| Fingerprint::of(&[&o.cents]))
///         .replay()
/// };
/// let first: Vec<Result<String, Error>> = batch().run(orders(), charge).await;
/// // Redelivered: nothing runs again; the receipts are replayed.
/// let again: Vec<Result<String, Error>> = batch().run(orders(), charge).await;
/// assert_eq!(first.into_iter().map(Result::unwrap).collect::<Vec<_>>(), ["receipt-1", "receipt-2"]);
/// assert_eq!(again.into_iter().map(Result::unwrap).collect::<Vec<_>>(), ["receipt-1", "receipt-2"]);
/// # }
/// ```
#[must_use = "a batch does nothing until `.run(...).await`"]
pub struct Batch<T, R: HandlerResult, D = NoCheck> {
    settings: Idempotency,
    fingerprint: Option<fn(&T) -> Fingerprint>,
    results: Results<R>,
    done: D,
}

impl<T, R: HandlerResult> Batch<T, R> {
    pub(crate) fn new(settings: Idempotency) -> Batch<T, R> {
        Batch {
            settings,
            fingerprint: None,
            results: Results::default(),
            done: NoCheck,
        }
    }
}

impl<T, R: HandlerResult, D> Batch<T, R, D> {
    /// Checks each item's payload: `fingerprint(item)` is stored with its claim, and a later
    /// call with the same key and another fingerprint fails with [`Error::PayloadMismatch`]
    /// ([`Operation::fingerprint`]).
    pub fn fingerprint(mut self, fingerprint: fn(&T) -> Fingerprint) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// Stores each item's `Ok` value and returns it to duplicates ([`Operation::replay`]).
    pub fn replay(mut self) -> Self
    where
        R::Ok: Serialize + DeserializeOwned,
    {
        self.results = self.results.with_replay();
        self
    }

    /// Decides, per handler error, what happens to the item's claim
    /// ([`Operation::on_error`]).
    pub fn on_error(mut self, classify: fn(&R::Err) -> OnError) -> Self {
        self.results = self.results.with_on_error(classify);
        self
    }

    /// Stores handler errors and replays them to duplicates ([`Operation::store_errors`]).
    pub fn store_errors(mut self) -> Self
    where
        R::Err: Serialize + DeserializeOwned,
    {
        self.results = self.results.with_store_errors();
        self
    }

    /// Calls `hook` with the key of each item answered with a stored result
    /// ([`Operation::on_replay`]).
    pub fn on_replay(mut self, hook: fn(&Key)) -> Self {
        self.results = self.results.with_on_replay(hook);
        self
    }

    /// Installs a business-status check per item: `check(item)` returns a future that says
    /// whether the item's effect is already applied ([`Operation::done`]). The future must
    /// not borrow the item (copy what it needs: the handler takes the item).
    pub fn done<F, Fut, X>(self, check: F) -> Batch<T, R, CheckEach<F>>
    where
        F: Fn(&T) -> Fut,
        Fut: Future<Output = Result<bool, X>>,
        R::Err: From<X>,
    {
        Batch {
            settings: self.settings,
            fingerprint: self.fingerprint,
            results: self.results,
            done: CheckEach(check),
        }
    }
}

impl<T, R, D> Batch<T, R, D>
where
    R: HandlerResult,
    D: ItemCheck<T>,
    R::Err: From<D::Error>,
{
    /// Runs `handler` for each item not run before, and returns each item's answer in input
    /// order (see the [type docs](Batch)). Items whose key is held by a live owner follow the
    /// in-progress policy (with [`OnInProgress::Wait`](crate::OnInProgress::Wait) they are
    /// claimed again one by one).
    pub async fn run<F, Fut>(self, items: Vec<(Key, T)>, handler: F) -> Vec<R>
    where
        F: Fn(T) -> Fut,
        Fut: Future<Output = R>,
    {
        let Batch {
            settings,
            fingerprint,
            results,
            done,
        } = self;
        let lifetime = settings.lifetime();
        let (lifetime, store) = match (lifetime, settings.store.clone().or_else(default_store)) {
            (Ok(lifetime), Some(store)) => (lifetime, store),
            _ => {
                // Every item fails alike, each with its own error value.
                let error = || settings.lifetime().err().unwrap_or(Error::NoStore);
                return items
                    .iter()
                    .map(|_| R::from_result(Err(error().into())))
                    .collect();
            }
        };
        let lease = lifetime.lease;
        let reqs: Arc<[ClaimRequest]> = items
            .iter()
            .map(|(key, item)| lifetime.request(key.clone(), fingerprint.map(|f| f(item))))
            .collect();
        let sent_at = tokio::time::Instant::now();
        let claims = PendingBatch::new(&store, &reqs).await;
        // A store that answered fewer items than it was given leaves the rest unanswered:
        // they fail (nothing runs for them) instead of shortening the answers.
        let unanswered = reqs.len().saturating_sub(claims.len());
        let claims = claims.into_iter().chain((0..unanswered).map(|_| {
            Err(StoreError::new(
                StoreErrorKind::Protocol,
                "the store's batch claim did not answer every item",
            ))
        }));
        // The items' completions and releases go to the store together.
        let batch = Coalescing::new(store, reqs.iter().map(|req| req.token), lease);
        let (settings, results, handler) = (&settings, &results, &handler);
        let runs = items.into_iter().zip(reqs.iter().cloned()).zip(claims).map(
            |(((_, item), req), first)| {
                let check = done.of(&item);
                let forget = Forget {
                    batch: batch.clone(),
                    token: req.token,
                };
                let span = Report::span(&req.key);
                let report = span.clone();
                async move {
                    let out = run_item(
                        settings, results, &forget, req, first, sent_at, item, check, handler,
                        report,
                    )
                    .await;
                    drop(forget);
                    R::from_result(out)
                }
                .instrument(span)
            },
        );
        join_woken(runs).await
    }
}

impl Idempotency {
    /// Many calls at once, to refine and [`run`](Batch::run): claimed in one store call and
    /// completed in one (see [`Batch`]).
    pub fn batch<T, R: HandlerResult>(&self) -> Batch<T, R> {
        Batch::new(self.clone())
    }

    /// Runs `handler` for a batch of items, claiming all their keys with one
    /// [`Store::claim_many`](crate::Store::claim_many) (one round trip on Redis) and
    /// recording their outcomes with one [`Store::complete_many`](crate::Store::complete_many):
    /// a shorthand for `self.batch().run(items, handler)`. Results come back in input order,
    /// each what [`Operation::run`] would have returned for that item alone. Acquired items
    /// run concurrently, each under its own lease renewal; items held by a live owner follow
    /// the in-progress policy (with [`OnInProgress::Wait`](crate::OnInProgress::Wait) they are claimed again one by one).
    /// For a fingerprint, replay or business check per item, use [`batch`](Self::batch).
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotent_runtime::{Error, Idempotency, Key, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let orders = Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
    /// let batch = |ids: &[u32]| {
    ///     ids.iter().map(|id| (Key::new("order", 1, &[id]).unwrap(), *id)).collect::<Vec<_>>()
    /// };
    /// let first: Vec<Result<u32, Error>> =
    ///     orders.run_batch(batch(&[1, 2]), |id| async move { Ok(id) }).await;
    /// assert_eq!(first.into_iter().collect::<Result<Vec<_>, _>>().unwrap(), [1, 2]);
    ///
    /// let second: Vec<Result<u32, Error>> =
    ///     orders.run_batch(batch(&[2, 3]), |id| async move { Ok(id) }).await;
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
        self.batch().run(items, handler).await
    }
}

/// One item of a batch, from its claim's outcome to its answer.
#[allow(clippy::too_many_arguments)]
async fn run_item<T, R, C, F, Fut>(
    settings: &Idempotency,
    results: &Results<R>,
    batch: &Forget,
    req: ClaimRequest,
    first: Result<Claim, StoreError>,
    sent_at: tokio::time::Instant,
    item: T,
    mut check: C,
    handler: &F,
    span: tracing::Span,
) -> Result<R::Ok, R::Err>
where
    R: HandlerResult,
    C: BusinessCheck,
    R::Err: From<C::Error>,
    F: Fn(T) -> Fut,
    Fut: Future<Output = R>,
{
    let store: SharedStore = batch.batch.clone();
    let report = Report::new(span, store.name());
    let body = move |_: Current| handler(item);
    let claim = match pending::claim_or_give_back(&store, &req, first).await {
        Ok(claim) => claim,
        Err(err) => {
            batch.batch.forget(&req.token);
            metrics::store_error(report.store(), err.kind());
            return match settings.on_store_error {
                OnStoreError::FailOpen => {
                    run_unguarded(&report, store, req, &err, &mut Some(body)).await
                }
                _ => report.refuse(req.key, Refusal::Store(err), results),
            };
        }
    };
    let mut waiting = Waiting::new(settings.in_progress);
    let next = decide(claim, settings.in_progress, &mut waiting);
    if !matches!(next, Next::Run { .. }) {
        batch.batch.forget(&req.token);
    }
    report.fence(next.fence());
    let refusal = match next {
        Next::Run { fence } => {
            let claim = Arc::new(Claimed::new(store, req, fence, sent_at));
            let owner = Owner::in_batch(claim, batch.batch.clone());
            let on_lost = settings.on_lost_lease;
            return own(
                &report,
                owner,
                (None, &mut check),
                results,
                on_lost,
                &mut Some(body),
            )
            .await;
        }
        Next::Completed { result, .. } => Refusal::Completed(result),
        Next::Mismatch { .. } => Refusal::Mismatch,
        Next::Busy { fence, then } => {
            if let Some(done) = check.start() {
                if done.await? {
                    return report.refuse(req.key, Refusal::DoneBefore, results);
                }
            }
            match then {
                Busy::Skip => Refusal::Skipped,
                Busy::Reject => Refusal::InProgress { fence },
                // Waiting for a live owner: claim again as a single call would (which
                // concludes on its own span, a child of this item's). Boxed: a single call's
                // future is large, and would make every item's as large.
                Busy::Retry(_) => {
                    return Box::pin(
                        Operation::of_parts(
                            settings.clone(),
                            req.key,
                            req.fingerprint,
                            results.clone(),
                            check,
                        )
                        .run_with(body),
                    )
                    .await
                    .into_result();
                }
            }
        }
    };
    report.refuse(req.key, refusal, results)
}
