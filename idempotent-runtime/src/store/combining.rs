//! Concurrent single calls sent as batches: [`CombiningStore`]. (A batch of the engine's
//! combines its own items' completions the same way, privately: see `engine/coalesce.rs`.)

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::deadline::call_bound;
use crate::store::{
    BoxFuture, Claim, ClaimRequest, Completion, End, Ending, Expect, IntoOperatorStore,
    OperatorStore, Record, ScanCursor, ScanPage, SharedOperatorStore, Store, Token,
};

/// The most items one combined batch carries.
const MAX_BATCH: usize = 100;

/// The longest a batch may go unanswered when none of its items names a lease.
const DEFAULT_BATCH_TIMEOUT: Duration = Duration::from_secs(5);

type Claimed = oneshot::Sender<Result<Claim, StoreError>>;
type Ended = oneshot::Sender<Result<bool, StoreError>>;

/// A store that sends concurrent claims, completions and releases together, as
/// [`claim_many`](Store::claim_many) and [`complete_many`](Store::complete_many) batches of
/// the store it wraps.
///
/// A call is sent at once while fewer than `max_in_flight` batches are on their way; beyond
/// that it waits, and every call that arrived meanwhile goes with it in the next batch. An
/// idle store adds no delay; a busy one sends one statement (one commit, on SQL) for many
/// calls instead of one each. It pays where a batch is one statement: PostgreSQL's batch
/// claim and batch ending, and MariaDB's (10.5 and later, whose batch claim is one
/// statement with `RETURNING` for fresh keys, and a second one for keys that had a row).
/// On MySQL a batch claim is a statement and a read: measure before using it there. On Redis, whose batches are pipelines, it saves little. The
/// measured figures are in the performance section of the repository's README, and
/// `benches/sql.rs` measures them again.
///
/// Every call is answered as the wrapped store answers it alone: a batch's answers are per
/// item ([`Store::complete_many`]'s contract), two claims of one key never share a batch,
/// and the endings of one key are sent in the order they were made, one batch after the
/// other. A call whose caller went away before its batch was sent is not sent; a claim
/// acquired for a caller that went away while its batch was on its way is released at once
/// (a direct call would keep the key until the lease ran out). Batch calls
/// (`claim_many`, `complete_many`) and every other method go to the wrapped store directly.
///
/// Every batch is bounded, so a batch that never answers (a silent connection) holds its
/// place among the `max_in_flight` for a bounded time only, and calls of other keys go on
/// being served: a batch of claims waits at most half its shortest lease, a batch of
/// endings half the shortest lease its completions name, and either at most
/// [`batch_timeout`](CombiningStore::batch_timeout) (5 s by default). Past it, the claims are
/// answered [`StoreErrorKind::Unavailable`] (so their callers fail closed and do not send them
/// again under the same token) and whatever they acquired once the batch lands is released;
/// the endings are answered [`StoreErrorKind::OutcomeUnknown`] (the caller reads the record
/// back; a completion or release that lands late is token-checked).
///
/// It sends its batches from tasks of the Tokio runtime the calls are made on; called
/// outside a Tokio runtime, each call goes to the wrapped store directly.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idempotent_runtime::store::CombiningStore;
/// use idempotent_runtime::{Idempotency, MemoryStore};
///
/// // On SQL stores, at most as many batches in flight as the pool has connections.
/// let store = CombiningStore::new(Arc::new(MemoryStore::new()), 8);
/// let guard = Idempotency::new(Duration::from_secs(3600)).store(Arc::new(store));
/// # let _ = guard;
/// ```
pub struct CombiningStore {
    shared: Arc<Shared>,
}

struct Shared {
    inner: SharedOperatorStore,
    max_in_flight: usize,
    batch_timeout: Duration,
    queues: Mutex<Queues>,
}

#[derive(Default)]
struct Queues {
    claims: VecDeque<(ClaimRequest, Claimed)>,
    endings: VecDeque<(Ending, Ended)>,
    /// The keys of the endings on their way.
    ending_keys: HashSet<Vec<u8>>,
    /// Batches on their way, or senders about to take one.
    senders: usize,
    /// The kind of batch the next sender takes first, so neither queue waits on the other.
    claims_next: bool,
}

enum Work {
    Claims(Vec<(ClaimRequest, Claimed)>),
    Endings(Vec<(Ending, Ended)>),
}

impl CombiningStore {
    /// Wraps `inner`, with at most `max_in_flight` batches on their way at once (at least
    /// one). For a SQL store, its pool's connection count. The operator's calls
    /// ([`OperatorStore`]) go to `inner` directly.
    pub fn new(inner: impl IntoOperatorStore, max_in_flight: usize) -> CombiningStore {
        CombiningStore {
            shared: Arc::new(Shared {
                inner: inner.into_operator_store(),
                max_in_flight: max_in_flight.max(1),
                batch_timeout: DEFAULT_BATCH_TIMEOUT,
                queues: Mutex::new(Queues::default()),
            }),
        }
    }

    /// The longest any batch may go unanswered (5 s by default; at least 100 ms), whatever
    /// the leases of its items. Set it when the store is built.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use idempotent_runtime::store::CombiningStore;
    /// use idempotent_runtime::MemoryStore;
    ///
    /// let store = CombiningStore::new(Arc::new(MemoryStore::new()), 8)
    ///     .batch_timeout(Duration::from_secs(2));
    /// # let _ = store;
    /// ```
    #[must_use]
    pub fn batch_timeout(mut self, timeout: Duration) -> CombiningStore {
        let timeout = timeout.max(call_bound(Duration::ZERO));
        match Arc::get_mut(&mut self.shared) {
            Some(shared) => shared.batch_timeout = timeout,
            None => tracing::warn!(
                "CombiningStore::batch_timeout is set before the store is used; ignored"
            ),
        }
        self
    }

    fn inner(&self) -> &SharedOperatorStore {
        &self.shared.inner
    }
}

impl std::fmt::Debug for CombiningStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CombiningStore")
            .field("inner", &self.shared.inner.name())
            .field("max_in_flight", &self.shared.max_in_flight)
            .finish_non_exhaustive()
    }
}

fn abandoned() -> StoreError {
    StoreError::new(
        StoreErrorKind::OutcomeUnknown,
        "the combined batch carrying this call was abandoned",
    )
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        self.queues
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts a sender if fewer than `max_in_flight` are running (called with a call queued).
    fn wake(self: &Arc<Self>, mut queues: MutexGuard<'_, Queues>) {
        if queues.senders < self.max_in_flight {
            queues.senders += 1;
            drop(queues);
            let shared = Arc::clone(self);
            tokio::spawn(async move { shared.send().await });
        }
    }

    /// Takes the next batch that can go, or, with none, retires this sender.
    fn take(&self) -> Option<Work> {
        let mut queues = self.lock();
        let claims_first = queues.claims_next;
        queues.claims_next = !claims_first;
        for claims in [claims_first, !claims_first] {
            let work = if claims {
                take_claims(&mut queues)
            } else {
                take_endings(&mut queues)
            };
            if work.is_some() {
                return work;
            }
        }
        queues.senders -= 1;
        None
    }

    /// Sends batches until none can go.
    async fn send(self: Arc<Self>) {
        /// Retires this sender if its batch never returns (the wrapped store panicked, or the
        /// runtime is shutting down) and starts another for the calls still queued, so that
        /// they are answered all the same.
        struct Retire<'a>(&'a Arc<Shared>, bool);
        impl Drop for Retire<'_> {
            fn drop(&mut self) {
                if !self.1 {
                    return;
                }
                let mut queues = self.0.lock();
                queues.senders -= 1;
                let queued = !queues.claims.is_empty() || !queues.endings.is_empty();
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    return;
                };
                if queued && queues.senders < self.0.max_in_flight {
                    queues.senders += 1;
                    drop(queues);
                    let shared = Arc::clone(self.0);
                    runtime.spawn(async move { shared.send().await });
                }
            }
        }
        while let Some(work) = self.take() {
            let mut retire = Retire(&self, true);
            match work {
                Work::Claims(batch) => self.send_claims(batch).await,
                Work::Endings(batch) => self.send_endings(batch).await,
            }
            retire.1 = false;
        }
    }

    async fn send_claims(&self, batch: Vec<(ClaimRequest, Claimed)>) {
        let (reqs, answers): (Vec<ClaimRequest>, Vec<Claimed>) = batch.into_iter().unzip();
        let reqs: Arc<[ClaimRequest]> = reqs.into();
        let leases = reqs.iter().map(|req| req.lease);
        let bound = self.bound(leases);
        let sent = {
            let (inner, reqs) = (self.inner.clone(), reqs.clone());
            Box::pin(async move { inner.claim_many(&reqs).await })
        };
        let claims = match within(bound, sent).await {
            Ok(claims) => claims,
            Err(sent) => {
                for answer in answers {
                    let _ = answer.send(Err(StoreError::new(
                        StoreErrorKind::Unavailable,
                        format!("the combined batch carrying this claim did not answer within {bound:?}; what it acquires is released"),
                    )));
                }
                // Finished in the background: a claim that lands late is given back.
                let inner = self.inner.clone();
                tokio::spawn(async move {
                    let claims = sent.await;
                    // All at once: one key whose release keeps failing holds back no other.
                    let give_backs = reqs
                        .iter()
                        .zip(claims)
                        .filter(|(_, claim)| may_hold(claim))
                        .map(|(req, _)| give_back(&inner, req));
                    futures_util::future::join_all(give_backs).await;
                });
                return;
            }
        };
        let mut claims = claims.into_iter();
        for (req, answer) in reqs.iter().zip(answers) {
            let claim = claims.next().unwrap_or_else(|| Err(abandoned()));
            if let Err(claim) = answer.send(claim) {
                // Its caller went away while the batch was on its way: give back what it may
                // hold.
                if may_hold(&claim) {
                    // On a task of its own: retries must not hold this sender's place.
                    let (inner, req) = (self.inner.clone(), req.clone());
                    tokio::spawn(async move { give_back(&inner, &req).await });
                }
            }
        }
    }

    async fn send_endings(&self, batch: Vec<(Ending, Ended)>) {
        /// The batch's keys are no longer on their way once it returned, or never will.
        struct Unmark<'a>(&'a Shared, &'a [Ending]);
        impl Drop for Unmark<'_> {
            fn drop(&mut self) {
                let mut queues = self.0.lock();
                for item in self.1 {
                    queues.ending_keys.remove(item.key.as_bytes());
                }
            }
        }
        let (items, answers): (Vec<Ending>, Vec<Ended>) = batch.into_iter().unzip();
        let leases = items.iter().filter_map(|item| match &item.action {
            End::Complete(completion) => completion.claim.and_then(|claim| claim.lease),
            _ => None,
        });
        let bound = self.bound(leases);
        let unmark = Unmark(self, &items);
        let ended = match within(bound, self.inner.complete_many(&items)).await {
            Ok(ended) => ended,
            // Dropped: a completion or release that lands late is token-checked.
            Err(_) => items
                .iter()
                .map(|_| {
                    Err(StoreError::new(
                        StoreErrorKind::OutcomeUnknown,
                        format!("the combined batch carrying this ending did not answer within {bound:?}"),
                    ))
                })
                .collect(),
        };
        drop(unmark);
        let mut ended = ended.into_iter();
        for answer in answers {
            let _ = answer.send(ended.next().unwrap_or_else(|| Err(abandoned())));
        }
    }
}

impl Shared {
    /// How long a batch whose items have `leases` may go unanswered.
    fn bound(&self, leases: impl Iterator<Item = Duration>) -> Duration {
        leases
            .map(call_bound)
            .min()
            .unwrap_or(self.batch_timeout)
            .min(self.batch_timeout)
    }
}

/// Whether a claim that answered `claim` may have left its token on the record: acquired, or
/// an outcome the store could not tell (a reply lost, a batch cut short). Releasing is
/// token-checked, so releasing one that was not applied changes nothing.
fn may_hold(claim: &Result<Claim, StoreError>) -> bool {
    match claim {
        Ok(claim) => matches!(claim, Claim::Acquired { .. }),
        Err(err) => err.is_outcome_unknown(),
    }
}

/// Releases `req`'s claim, token-checked, retrying with backoff (each attempt bounded) while
/// the store fails, until the record would have expired anyway.
async fn give_back(inner: &SharedOperatorStore, req: &ClaimRequest) {
    let give_up_at = tokio::time::Instant::now() + req.record_lifetime();
    let mut backoff = Duration::from_millis(10);
    loop {
        match within(call_bound(req.lease), inner.release(&req.key, &req.token)).await {
            Ok(Ok(_)) => return,
            Ok(Err(err)) if err.is_permanent() => {
                tracing::warn!(error = %err, "releasing a claim of an abandoned batch failed; the key is free once its lease runs out");
                return;
            }
            _ if tokio::time::Instant::now() >= give_up_at => return,
            _ => {}
        }
        tokio::time::sleep(backoff).await;
        // At least every third of the lease: the key is free soon after the store is back.
        backoff = (backoff * 2).min(Duration::from_secs(1)).min(req.lease / 3);
    }
}

/// `fut`'s output, or `fut` back, unfinished, once `bound` has passed.
async fn within<F: std::future::Future + Unpin>(
    bound: Duration,
    mut fut: F,
) -> Result<F::Output, F> {
    tokio::select! {
        out = &mut fut => Ok(out),
        () = tokio::time::sleep(bound) => Err(fut),
    }
}

/// The queued claims that can go together, oldest first: one per key (another claim of a
/// key waits for the next batch), none whose caller went away.
fn take_claims(queues: &mut Queues) -> Option<Work> {
    let mut batch = Vec::new();
    let mut keys = HashSet::new();
    let mut kept = VecDeque::new();
    while let Some((req, answer)) = queues.claims.pop_front() {
        if answer.is_closed() {
            continue;
        }
        if batch.len() < MAX_BATCH && keys.insert(req.key.as_bytes().to_vec()) {
            batch.push((req, answer));
        } else {
            kept.push_back((req, answer));
        }
    }
    queues.claims = kept;
    (!batch.is_empty()).then_some(Work::Claims(batch))
}

/// The queued endings that can go together, oldest first: those of keys with no
/// ending on its way, every ending of one key in one batch in order (the wrapped
/// store answers them as it would one after the other). Endings go even when their
/// caller went away: a completion records an effect that ran.
fn take_endings(queues: &mut Queues) -> Option<Work> {
    let mut batch = Vec::new();
    let mut kept = VecDeque::new();
    let mut blocked: HashSet<Vec<u8>> = HashSet::new();
    let mut taken: HashSet<Vec<u8>> = HashSet::new();
    while let Some((item, answer)) = queues.endings.pop_front() {
        let key = item.key.as_bytes();
        let goes = !blocked.contains(key)
            && !queues.ending_keys.contains(key)
            && (batch.len() < MAX_BATCH || taken.contains(key));
        if goes {
            taken.insert(key.to_vec());
            batch.push((item, answer));
        } else {
            // Later endings of this key wait behind this one.
            blocked.insert(key.to_vec());
            kept.push_back((item, answer));
        }
    }
    queues.endings = kept;
    if batch.is_empty() {
        return None;
    }
    queues.ending_keys.extend(taken);
    Some(Work::Endings(batch))
}

impl Store for CombiningStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            if tokio::runtime::Handle::try_current().is_err() {
                return self.inner().claim(req).await;
            }
            let (tx, rx) = oneshot::channel();
            {
                let mut queues = self.shared.lock();
                queues.claims.push_back((req.clone(), tx));
                self.shared.wake(queues);
            }
            rx.await.unwrap_or_else(|_| Err(abandoned()))
        })
    }

    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Vec<Result<Claim, StoreError>>> {
        self.inner().claim_many(reqs)
    }

    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.end(Ending::complete(key.clone(), *token, completion.clone())))
    }

    fn complete_many<'a>(
        &'a self,
        items: &'a [Ending],
    ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
        self.inner().complete_many(items)
    }

    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.end(Ending::release(key.clone(), *token)))
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner().renew(key, token, lease)
    }

    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.inner().read(key)
    }

    fn is_completed<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner().is_completed(key)
    }

    fn max_result_size(&self) -> usize {
        self.inner().max_result_size()
    }

    fn name(&self) -> &'static str {
        self.inner().name()
    }
}

impl OperatorStore for CombiningStore {
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner().reopen(key, token)
    }

    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        cursor: &'a ScanCursor,
        limit: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
        self.inner().scan(prefix, cursor, limit)
    }

    fn delete<'a>(
        &'a self,
        key: &'a Key,
        expect: Expect<'a>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner().delete(key, expect)
    }
}

impl CombiningStore {
    async fn end(&self, item: Ending) -> Result<bool, StoreError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return item.send_alone(&**self.inner()).await;
        }
        let (tx, rx) = oneshot::channel();
        {
            let mut queues = self.shared.lock();
            queues.endings.push_back((item, tx));
            self.shared.wake(queues);
        }
        rx.await.unwrap_or_else(|_| Err(abandoned()))
    }
}
