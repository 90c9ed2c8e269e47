//! [`Batch`]: many idempotent calls at once, each as an [`Operation`] would run it, claimed
//! together and settled together.

use std::future::Future;
use std::sync::Arc;

use futures_util::future::join_all;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use crate::default_store::default_store;
use crate::engine::coalesce::{Coalescing, Forget};
use crate::engine::decide::{decide, Busy, Next, Waiting};
use crate::engine::handler::{DoneCheck, HandlerResult, ItemCheck, ItemDone, NoDone};
use crate::engine::idempotency::Idempotency;
use crate::engine::operation::{completed, own, Operation, Outcomes};
use crate::engine::owner::{Claimed, Owner};
use crate::engine::pending::{self, PendingBatch};
use crate::error::{Error, StoreError, StoreErrorKind};
use crate::key::Key;
use crate::policy::{OnError, OnStoreError};
use crate::store::{Claim, ClaimRequest, Fingerprint, SharedStore, Token};

/// The longest a batch item's completion waits for its siblings' (see `engine/coalesce.rs`).
const MAX_SETTLE_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

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
/// let guard = Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
/// let orders = || {
///     [Order { id: 1, cents: 500 }, Order { id: 2, cents: 900 }]
///         .into_iter()
///         .map(|o| (Key::new("order:charge", 1, &[&o.id]).unwrap(), o))
///         .collect::<Vec<_>>()
/// };
/// let charge = |o: Order| async move { Ok::<_, Error>(format!("receipt-{}", o.id)) };
/// let batch = || {
///     guard
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
pub struct Batch<T, R: HandlerResult, D = NoDone> {
    guard: Idempotency,
    fingerprint: Option<fn(&T) -> Fingerprint>,
    outcomes: Outcomes<R>,
    done: D,
}

impl<T, R: HandlerResult> Batch<T, R> {
    pub(crate) fn new(guard: Idempotency) -> Batch<T, R> {
        Batch {
            guard,
            fingerprint: None,
            outcomes: Outcomes::default(),
            done: NoDone,
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
        self.outcomes = self.outcomes.with_replay();
        self
    }

    /// Decides, per handler error, what happens to the item's claim
    /// ([`Operation::on_error`]).
    pub fn on_error(mut self, classify: fn(&R::Err) -> OnError) -> Self {
        self.outcomes = self.outcomes.with_on_error(classify);
        self
    }

    /// Stores handler errors and replays them to duplicates ([`Operation::store_errors`]).
    pub fn store_errors(mut self) -> Self
    where
        R::Err: Serialize + DeserializeOwned,
    {
        self.outcomes = self.outcomes.with_store_errors();
        self
    }

    /// Calls `hook` with the key of each item answered with a stored result
    /// ([`Operation::on_replay`]).
    pub fn on_replay(mut self, hook: fn(&Key)) -> Self {
        self.outcomes = self.outcomes.with_on_replay(hook);
        self
    }

    /// Installs a business-status check per item: `check(item)` returns a future that says
    /// whether the item's effect is already applied ([`Operation::done`]). The future must
    /// not borrow the item (copy what it needs: the handler takes the item).
    pub fn done<F, Fut, X>(self, check: F) -> Batch<T, R, ItemDone<F>>
    where
        F: Fn(&T) -> Fut,
        Fut: Future<Output = Result<bool, X>>,
        R::Err: From<X>,
    {
        Batch {
            guard: self.guard,
            fingerprint: self.fingerprint,
            outcomes: self.outcomes,
            done: ItemDone(check),
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
    /// in-progress policy (with [`InProgress::Wait`](crate::InProgress::Wait) they are
    /// claimed again one by one).
    pub async fn run<F, Fut>(self, items: Vec<(Key, T)>, handler: F) -> Vec<R>
    where
        F: Fn(T) -> Fut,
        Fut: Future<Output = R>,
    {
        let Batch {
            guard,
            fingerprint,
            outcomes,
            done,
        } = self;
        let store = match guard
            .check()
            .map(|()| guard.store.clone().or_else(default_store))
        {
            Ok(Some(store)) => store,
            _ => {
                // Every item fails alike, each with its own error value.
                let error = || guard.check().err().unwrap_or(Error::NoStore);
                return items
                    .iter()
                    .map(|_| R::from_result(Err(error().into())))
                    .collect();
            }
        };
        let lease = guard.lease_duration();
        let reqs: Arc<[ClaimRequest]> = items
            .iter()
            .map(|(key, item)| ClaimRequest {
                key: key.clone(),
                token: Token::generate(),
                lease,
                ttl: guard.ttl,
                fingerprint: fingerprint.map(|f| f(item)),
            })
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
        let batch = Coalescing::new(
            store,
            reqs.iter().map(|req| req.token),
            (lease / 10).min(MAX_SETTLE_DELAY),
        );
        let (guard, outcomes, handler) = (&guard, &outcomes, &handler);
        let runs = items.into_iter().zip(reqs.iter().cloned()).zip(claims).map(
            |(((_, item), req), first)| {
                let check = done.of(&item);
                let forget = Forget {
                    batch: batch.clone(),
                    token: req.token,
                };
                let span = tracing::debug_span!(
                    "idempotency",
                    key = %req.key,
                    fence = tracing::field::Empty,
                    outcome = tracing::field::Empty,
                );
                async move {
                    let out = settle_item(
                        guard, outcomes, &forget, req, first, sent_at, item, check, handler,
                    )
                    .await;
                    drop(forget);
                    R::from_result(out)
                }
                .instrument(span)
            },
        );
        join_all(runs).await
    }
}

/// One item of a batch, from its claim's outcome to its answer.
#[allow(clippy::too_many_arguments)]
async fn settle_item<T, R, C, F, Fut>(
    guard: &Idempotency,
    outcomes: &Outcomes<R>,
    batch: &Forget,
    req: ClaimRequest,
    first: Result<Claim, StoreError>,
    sent_at: tokio::time::Instant,
    item: T,
    mut check: C,
    handler: &F,
) -> Result<R::Ok, R::Err>
where
    R: HandlerResult,
    C: DoneCheck,
    R::Err: From<C::Error>,
    F: Fn(T) -> Fut,
    Fut: Future<Output = R>,
{
    let span = tracing::Span::current();
    let store: SharedStore = batch.batch.clone();
    let claim = match pending::claim_or_give_back(&store, &req, first).await {
        Ok(claim) => claim,
        Err(err) => {
            batch.batch.forget(&req.token);
            return match guard.on_store_error {
                OnStoreError::FailOpen => {
                    tracing::warn!(error = %err, "store failed; running unguarded (fail open)");
                    span.record("outcome", "fail_open");
                    handler(item).await.into_result()
                }
                _ => {
                    span.record("outcome", "store_error");
                    Err(Error::Store(err).into())
                }
            };
        }
    };
    let mut waiting = Waiting::new(guard.in_progress);
    let next = decide(claim, guard.in_progress, &mut waiting);
    if !matches!(next, Next::Run { .. }) {
        batch.batch.forget(&req.token);
    }
    match next {
        Next::Run { fence } => {
            span.record("fence", fence);
            let owner = Owner::new(Arc::new(Claimed::new(store, req, fence, sent_at)));
            own(
                owner,
                &mut check,
                outcomes,
                guard.on_lost_lease,
                &mut Some(|_| handler(item)),
            )
            .await
        }
        Next::Completed { fence, result } => {
            span.record("fence", fence);
            span.record("outcome", "completed");
            completed(req.key, result, outcomes)
        }
        Next::Mismatch { fence } => {
            span.record("fence", fence);
            span.record("outcome", "mismatch");
            Err(Error::PayloadMismatch { key: req.key }.into())
        }
        Next::Busy { fence, then } => {
            span.record("fence", fence);
            if let Some(done) = check.start() {
                if done.await? {
                    span.record("outcome", "done");
                    return Err(Error::Duplicate { key: req.key }.into());
                }
            }
            match then {
                Busy::Skip => {
                    span.record("outcome", "skipped");
                    Err(Error::Skipped { key: req.key }.into())
                }
                // Waiting for a live owner: claim again as a single call would. Boxed: a
                // single call's future is large, and would make every item's as large.
                Busy::Retry(_) => Box::pin(
                    Operation::of_parts(
                        guard.clone(),
                        req.key,
                        req.fingerprint,
                        outcomes.clone(),
                        check,
                    )
                    .run(handler(item)),
                )
                .await
                .into_result(),
                Busy::Reject => {
                    span.record("outcome", "in_progress");
                    Err(Error::InProgress {
                        key: req.key,
                        fence,
                    }
                    .into())
                }
            }
        }
    }
}
