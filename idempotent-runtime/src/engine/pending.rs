//! Claim round trips that finish even when their caller is gone, and the background work that
//! gives an unowned claim back.
//!
//! - [`claim`] resolves a lost claim reply by reading the record back by token.
//! - [`PendingClaim`] and [`PendingBatch`] are the single and batch claim round trips: bounded
//!   ([`call_bound`]), and finished on the runtime when their caller is dropped or gives up, so
//!   a claim that lands late is given back.
//! - [`give_back`] releases a claim, token-checked, retrying while the store fails;
//!   [`run_detached`] runs such work without a caller.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::engine::deadline::{bounded, call_bound};
use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::{BoxFuture, Claim, ClaimRequest, RecordState, SharedStore, Token};

/// The longest pause between two attempts to give a claim back.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Claims, resolving a lost reply by reading the record back by token: a claim that was
/// applied but whose reply was lost is ours, never a duplicate. When the outcome stays unknown
/// (the read-back fails too), the claim may be applied with no one to own it: it is given back
/// in the background, token-checked, so the key is not left blocked.
pub(crate) async fn claim(
    store: &SharedStore,
    req: &ClaimRequest,
    first: Result<Claim, StoreError>,
) -> Result<Claim, StoreError> {
    let unknown = match first {
        Err(err) if err.is_outcome_unknown() => err,
        other => return other,
    };
    tracing::debug!(error = %unknown, "claim reply lost; reading the record back");
    // The read is bounded (abandoning a read changes nothing); the claim sent again is not,
    // since one abandoned in flight may still land: the bound of the caller's round trip
    // ([`PendingClaim`]) covers it, and what lands then is given back.
    let read = bounded(call_bound(req.lease), "read", store.read(&req.key));
    let resolved = match read.await {
        Ok(Some(record))
            if record.token == req.token
                && matches!(record.state, RecordState::InProgress { .. }) =>
        {
            Ok(Claim::Acquired {
                fence: record.fence,
            })
        }
        // Not ours: the claim was not applied, so it is safe to send again.
        Ok(_) => store.claim(req).await,
        Err(err) => Err(err),
    };
    if resolved.is_err() {
        let (store, key, token) = (store.clone(), req.key.clone(), req.token);
        let give_up_at = tokio::time::Instant::now() + req.record_lifetime();
        run_detached(give_back(store, key, token, req.lease, give_up_at));
    }
    resolved
}

/// [`claim`] for a caller that may be dropped while it reads a lost reply back (an item of a
/// batch), bounded like a claim round trip: dropped or timed out then, the resolution is
/// finished in the background as a [`PendingClaim`]'s is, and what it acquired given back.
pub(crate) async fn claim_or_give_back(
    store: &SharedStore,
    req: &ClaimRequest,
    first: Result<Claim, StoreError>,
) -> Result<Claim, StoreError> {
    if !matches!(&first, Err(err) if err.is_outcome_unknown()) {
        return first;
    }
    PendingClaim::resolving(store, Arc::new(req.clone()), first).await
}

/// Gives a claim back, token-checked, retrying with backoff while the store fails, until it
/// answers or `give_up_at` (by then the record has expired on its own).
pub(crate) async fn give_back(
    store: SharedStore,
    key: Key,
    token: Token,
    lease: Duration,
    give_up_at: tokio::time::Instant,
) {
    let mut backoff = Duration::from_millis(10);
    loop {
        match bounded(call_bound(lease), "release", store.release(&key, &token)).await {
            Ok(_) => return,
            Err(err) if err.is_permanent() || tokio::time::Instant::now() >= give_up_at => {
                tracing::warn!(key = %key, error = %err, "claim could not be given back; its lease will run out instead");
                return;
            }
            Err(err) => {
                tracing::debug!(key = %key, error = %err, "giving the claim back failed; retrying");
            }
        }
        tokio::time::sleep(backoff).await;
        // At least every third of the lease: the key is free soon after the store is back.
        backoff = (backoff * 2).min(MAX_BACKOFF).min(lease / 3);
    }
}

/// A claim round trip that finishes even when its caller is dropped: the claim is then given
/// back as soon as it lands, so the key is not blocked for a lease.
///
/// It is bounded ([`call_bound`]): a round trip (with its read-back) that has not answered in
/// time answers [`StoreErrorKind::OutcomeUnknown`] to its caller, and is then finished in the
/// background as if the caller had been dropped. A claim abandoned in flight may still be
/// applied later; finishing it, rather than dropping it, is what lets it be given back then.
///
/// Made by [`checking`](Self::checking), it also reads whether another key's record is
/// completed ([`Store::is_completed`](crate::store::Store::is_completed)), in the claim's own
/// round trip where the store can ([`Store::claim_and_is_completed`]), beside it otherwise;
/// [`read`](Self::read) takes that answer once the claim is in.
///
/// [`Store::claim_and_is_completed`]: crate::store::Store::claim_and_is_completed
pub(crate) struct PendingClaim {
    store: SharedStore,
    req: Arc<ClaimRequest>,
    /// The claim (with its lost reply read back), and the read when it shares the claim's
    /// round trip.
    fut: Option<BoxFuture<'static, Answers>>,
    /// The read sent beside the claim, until it answers.
    read: Option<BoxFuture<'static, Result<bool, StoreError>>>,
    /// The claim's answer, while an acquired claim waits for the read beside it.
    claimed: Option<Result<Claim, StoreError>>,
    /// The read's answer, once in.
    read_answer: Option<Result<bool, StoreError>>,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// A claim's answer, and the read's when it came with it.
type Answers = (Result<Claim, StoreError>, Option<Result<bool, StoreError>>);

impl PendingClaim {
    pub(crate) fn new(store: &SharedStore, req: &Arc<ClaimRequest>) -> PendingClaim {
        let (s, r) = (store.clone(), req.clone());
        PendingClaim::of(
            store,
            req.clone(),
            Box::pin(async move {
                let first = s.claim(&r).await;
                (claim(&s, &r, first).await, None)
            }),
            None,
        )
    }

    /// A claim that also reads whether `other`'s record is completed: in one round trip when
    /// the store can send them together, else side by side. The claim answers as soon as it
    /// is in, unless it acquired the key: then it waits for the read too, within the same
    /// bound (its answer is then [`read`](Self::read)'s). A read that has not answered by then
    /// answers `OutcomeUnknown`, and is dropped: a read changes nothing. When the round trip
    /// that carried both lost its reply, the claim is read back and the read has no answer:
    /// [`read`](Self::read) gives none, and the check reads anew.
    pub(crate) fn checking(
        store: &SharedStore,
        req: &Arc<ClaimRequest>,
        other: &Key,
    ) -> PendingClaim {
        let (s, r) = (store.clone(), req.clone());
        match store
            .clone()
            .claim_and_is_completed(req.clone(), other.clone())
        {
            Some(both) => PendingClaim::of(
                store,
                req.clone(),
                Box::pin(async move {
                    let (first, read) = both.await;
                    // A lost reply lost the read's answer with the claim's: the read is
                    // sent again by the check that needs it, as a read changes nothing.
                    let read = match &first {
                        Err(err) if err.is_outcome_unknown() => None,
                        _ => Some(read),
                    };
                    (claim(&s, &r, first).await, read)
                }),
                None,
            ),
            None => {
                let (reader, other) = (store.clone(), other.clone());
                let read = Box::pin(async move { reader.is_completed(&other).await });
                let mut pending = PendingClaim::new(store, req);
                pending.read = Some(read);
                pending
            }
        }
    }

    fn of(
        store: &SharedStore,
        req: Arc<ClaimRequest>,
        fut: BoxFuture<'static, Answers>,
        read: Option<BoxFuture<'static, Result<bool, StoreError>>>,
    ) -> PendingClaim {
        PendingClaim {
            store: store.clone(),
            req,
            fut: Some(fut),
            read,
            claimed: None,
            read_answer: None,
            timer: None,
        }
    }

    /// The rest of a claim round trip whose first answer was `first`: a lost reply read back.
    fn resolving(
        store: &SharedStore,
        req: Arc<ClaimRequest>,
        first: Result<Claim, StoreError>,
    ) -> PendingClaim {
        let (s, r) = (store.clone(), req.clone());
        PendingClaim::of(
            store,
            req,
            Box::pin(async move { (claim(&s, &r, first).await, None) }),
            None,
        )
    }

    /// The answer of the read [`checking`](Self::checking) sent, once the claim answered:
    /// `None` when it was not waited for (the claim did not acquire the key first) or none
    /// was sent.
    pub(crate) fn read(&mut self) -> Option<Result<bool, StoreError>> {
        self.read_answer.take()
    }
}

impl Future for PendingClaim {
    type Output = Result<Claim, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(read) = this.read.as_mut() {
            if let Poll::Ready(answer) = read.as_mut().poll(cx) {
                this.read = None;
                this.read_answer = Some(answer);
            }
        }
        if this.claimed.is_none() {
            let Some(fut) = this.fut.as_mut() else {
                return Poll::Ready(Err(StoreError::new(
                    StoreErrorKind::Protocol,
                    "claim polled after it finished",
                )));
            };
            if let Poll::Ready((claimed, read)) = fut.as_mut().poll(cx) {
                this.fut = None;
                if read.is_some() {
                    this.read_answer = read;
                }
                this.claimed = Some(claimed);
            }
        }
        if let Some(claimed) = this.claimed.take() {
            // Only an acquired claim runs the check the read is for: another answer does not
            // wait for it.
            if this.read.is_none() || !matches!(claimed, Ok(Claim::Acquired { .. })) {
                this.read = None;
                return Poll::Ready(claimed);
            }
            this.claimed = Some(claimed);
        }
        // A claim answered on its first poll (an in-memory store) sets no timer.
        let bound = call_bound(this.req.lease);
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(bound)));
        std::task::ready!(timer.as_mut().poll(cx));
        if let Some(claimed) = this.claimed.take() {
            // Acquired, and the read beside it has not answered: the check fails, and the
            // claim is given back by its owner.
            this.read = None;
            this.read_answer = Some(Err(StoreError::new(
                StoreErrorKind::OutcomeUnknown,
                format!("no answer to the completed-state read within {bound:?}"),
            )));
            return Poll::Ready(claimed);
        }
        // `fut` stays: dropping `self` finishes it in the background and gives it back.
        Poll::Ready(Err(StoreError::new(
            StoreErrorKind::OutcomeUnknown,
            format!("no answer to the claim within {bound:?}"),
        )))
    }
}

impl Drop for PendingClaim {
    fn drop(&mut self) {
        // An acquired claim that waited for its read: its caller is gone before owning it.
        if let Some(Ok(Claim::Acquired { .. })) = self.claimed {
            let (store, req) = (self.store.clone(), self.req.clone());
            tracing::debug!(key = %req.key, "claim abandoned while its read was in flight; giving it back");
            let give_up_at = tokio::time::Instant::now() + req.record_lifetime();
            run_detached(give_back(
                store,
                req.key.clone(),
                req.token,
                req.lease,
                give_up_at,
            ));
            return;
        }
        let Some(fut) = self.fut.take() else {
            return;
        };
        let (store, req) = (self.store.clone(), self.req.clone());
        tracing::debug!(key = %req.key, "claim abandoned in flight; giving it back once it lands");
        let give_up_at = tokio::time::Instant::now() + req.record_lifetime();
        run_detached(async move {
            if let (Ok(Claim::Acquired { .. }), _) = fut.await {
                give_back(store, req.key.clone(), req.token, req.lease, give_up_at).await;
            }
        });
    }
}

/// A batch claim round trip that finishes even when its caller is dropped, like
/// [`PendingClaim`]: every key it acquired is then given back as soon as it lands.
///
/// Bounded like [`PendingClaim`] (by its shortest lease): a round trip that has not answered
/// in time fails every item closed ([`StoreErrorKind::Unavailable`]: the items must not claim
/// again with their tokens, since the abandoned claims may still land) and is finished in the
/// background, which gives back what it acquired.
pub(crate) struct PendingBatch {
    store: SharedStore,
    reqs: Arc<[ClaimRequest]>,
    fut: Option<BoxFuture<'static, Vec<Result<Claim, StoreError>>>>,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl PendingBatch {
    pub(crate) fn new(store: &SharedStore, reqs: &Arc<[ClaimRequest]>) -> PendingBatch {
        let (s, r) = (store.clone(), reqs.clone());
        PendingBatch {
            store: store.clone(),
            reqs: reqs.clone(),
            fut: Some(Box::pin(async move { s.claim_many(&r).await })),
            timer: None,
        }
    }
}

impl Future for PendingBatch {
    type Output = Vec<Result<Claim, StoreError>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(fut) = self.fut.as_mut() else {
            return Poll::Ready(Vec::new());
        };
        if let Poll::Ready(out) = fut.as_mut().poll(cx) {
            self.fut = None;
            return Poll::Ready(out);
        }
        let lease = self.reqs.iter().map(|req| req.lease).min();
        let bound = call_bound(lease.unwrap_or_default());
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(bound)));
        std::task::ready!(timer.as_mut().poll(cx));
        // `fut` stays: dropping `self` finishes it in the background and gives back.
        let unanswered = || {
            Err(StoreError::new(
                StoreErrorKind::Unavailable,
                format!("no answer to the batch claim within {bound:?}; it is finished in the background"),
            ))
        };
        Poll::Ready(self.reqs.iter().map(|_| unanswered()).collect())
    }
}

impl Drop for PendingBatch {
    fn drop(&mut self) {
        let Some(fut) = self.fut.take() else {
            return;
        };
        let (store, reqs) = (self.store.clone(), self.reqs.clone());
        let give_up_at = tokio::time::Instant::now() + Duration::from_secs(60);
        run_detached(async move {
            let claims = fut.await;
            // No one waits for these claims: give back every one that may hold its key (an
            // acquired one, or one whose reply was lost: the release is token-checked), all
            // at once, without reading any back.
            let give_backs = reqs.iter().zip(claims).filter_map(|(req, claim)| {
                let may_hold = match &claim {
                    Ok(claim) => matches!(claim, Claim::Acquired { .. }),
                    Err(err) => err.is_outcome_unknown(),
                };
                let give_up_at =
                    give_up_at.max(tokio::time::Instant::now() + req.record_lifetime());
                may_hold.then(|| {
                    give_back(
                        store.clone(),
                        req.key.clone(),
                        req.token,
                        req.lease,
                        give_up_at,
                    )
                })
            });
            futures_util::future::join_all(give_backs).await;
        });
    }
}

/// Runs `fut` to completion without a caller: at once if it finishes on its first poll (a
/// store that answers without waiting), otherwise on the current Tokio runtime. Without a
/// runtime it is dropped; the lease then runs out instead.
pub(crate) fn run_detached<F>(fut: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    let mut fut = Box::pin(fut);
    if fut
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
        .is_ready()
    {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            handle.spawn(fut);
        }
        Err(_) => tracing::warn!(
            "no Tokio runtime to finish a claim's cleanup; its lease will run out instead"
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;
    use crate::store::{Completion, Record, Store, Token};

    /// One key's claim, held by a token or not, and reads of another key's state that never
    /// answer: a read sent beside a claim that stays out, which no real store produces on cue.
    /// (The engine's tests use no backend; this is the least of a store the cases need.)
    #[derive(Default)]
    struct SilentReads {
        holder: Mutex<Option<Token>>,
    }

    impl SilentReads {
        fn holder(&self) -> Option<Token> {
            *self
                .holder
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }
        fn ends(&self, token: &Token) -> Result<bool, StoreError> {
            let mut holder = self
                .holder
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let held = holder.as_ref() == Some(token);
            if held {
                *holder = None;
            }
            Ok(held)
        }
    }

    impl Store for SilentReads {
        fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
            let mut holder = self
                .holder
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let claim = match *holder {
                Some(token) if token != req.token => Claim::InProgress { fence: 1 },
                _ => {
                    *holder = Some(req.token);
                    Claim::Acquired { fence: 1 }
                }
            };
            Box::pin(std::future::ready(Ok(claim)))
        }
        fn complete<'a>(
            &'a self,
            _: &'a Key,
            token: &'a Token,
            _: &'a Completion,
        ) -> BoxFuture<'a, Result<bool, StoreError>> {
            Box::pin(std::future::ready(self.ends(token)))
        }
        fn release<'a>(
            &'a self,
            _: &'a Key,
            token: &'a Token,
        ) -> BoxFuture<'a, Result<bool, StoreError>> {
            Box::pin(std::future::ready(self.ends(token)))
        }
        fn renew<'a>(
            &'a self,
            _: &'a Key,
            token: &'a Token,
            _: Duration,
        ) -> BoxFuture<'a, Result<bool, StoreError>> {
            Box::pin(std::future::ready(Ok(self.holder() == Some(*token))))
        }
        fn read<'a>(&'a self, _: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
            Box::pin(std::future::ready(Ok(None)))
        }
        fn is_completed<'a>(&'a self, _: &'a Key) -> BoxFuture<'a, Result<bool, StoreError>> {
            Box::pin(std::future::pending())
        }
    }

    fn setup() -> (Arc<SilentReads>, SharedStore, Arc<ClaimRequest>, Key) {
        let store = Arc::new(SilentReads::default());
        let shared: SharedStore = store.clone();
        let minute = Duration::from_secs(60);
        let key = Key::new("pending", 2, &[&"a"]).unwrap_or_else(|_| unreachable!());
        let other = Key::new("pending", 1, &[&"a"]).unwrap_or_else(|_| unreachable!());
        let req = Arc::new(ClaimRequest::new(key, Token::generate(), minute, minute));
        (store, shared, req, other)
    }

    /// An acquired claim waiting for its read, dropped (its caller gone): the claim is given
    /// back, not left for its lease to run out.
    #[tokio::test(start_paused = true)]
    async fn a_claim_dropped_while_its_read_is_out_is_given_back() {
        let (store, shared, req, other) = setup();
        let mut pending = PendingClaim::checking(&shared, &req, &other);
        let polled = futures_util::poll!(&mut pending);
        assert!(polled.is_pending(), "answered without its read: {polled:?}");
        assert_eq!(store.holder(), Some(req.token));
        drop(pending);
        assert_eq!(store.holder(), None, "the claim was kept");
    }

    /// A read that never answers is abandoned at the claim's bound: the acquired claim is
    /// answered, with the read's answer unknown (the check then fails, and the owner gives
    /// the claim back).
    #[tokio::test(start_paused = true)]
    async fn a_read_that_never_answers_is_unknown_at_the_bound() {
        let (_store, shared, req, other) = setup();
        let mut pending = PendingClaim::checking(&shared, &req, &other);
        let claimed = (&mut pending).await;
        assert!(matches!(claimed, Ok(Claim::Acquired { .. })), "{claimed:?}");
        let read = pending.read();
        assert!(
            matches!(&read, Some(Err(err)) if err.is_outcome_unknown()),
            "{read:?}"
        );
    }

    /// A claim that did not acquire the key does not wait for the read: a duplicate is
    /// answered at once.
    #[tokio::test(start_paused = true)]
    async fn a_claim_that_did_not_acquire_does_not_wait_for_its_read() {
        let (_store, shared, req, other) = setup();
        assert!(matches!(
            PendingClaim::new(&shared, &req).await,
            Ok(Claim::Acquired { .. })
        ));
        let mut duplicate = (*req).clone();
        duplicate.token = Token::generate();
        let mut pending = PendingClaim::checking(&shared, &Arc::new(duplicate), &other);
        let polled = futures_util::poll!(&mut pending);
        assert!(
            matches!(polled, Poll::Ready(Ok(Claim::InProgress { .. }))),
            "{polled:?}"
        );
        assert!(pending.read().is_none());
    }
}
