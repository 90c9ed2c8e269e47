//! Ending a batch's items together: the first completion or release of each item of a
//! batch waits, briefly, for the others, and they go to the store in one
//! [`Store::complete_many`] (one round trip on Redis and SQL).
//!
//! [`Coalescing`] wraps the batch's store. An item's first `complete` or `release` joins the
//! pending endings (a round); they are sent when every item of the batch has either ended or
//! finished without ending ([`Coalescing::forget`]), or when the first of them has waited
//! [`Coalescing::new`]'s delay (a slow sibling never holds the others' completions for
//! longer, so their leases never come close to running out while they wait). The last item
//! in sends the round, or the round's first ending (its leader, the only one with a timer)
//! when the round is due, and every waiter gets its own item's answer.
//!
//! A round is one store call of its owners' path, and is treated as theirs would be: it is
//! bounded ([`call_bound`]) and the leases of the completions it carries are renewed while it
//! is in flight ([`watch_many`]), once for the round. An owner's first completion therefore
//! needs no timer of its own ([`Coalescing::complete_first`]); only a completion that failed
//! there goes on under its owner's own bound and watchdog.
//!
//! An item's later calls (a retried completion after a lost reply, the background retries of
//! [`Owner`](super::owner::Owner)) go to the store directly, as every other method does. A
//! batch whose sender is dropped mid-flight answers its waiters
//! [`StoreErrorKind::OutcomeUnknown`]: the engine then reads the record back by token, as after
//! any lost reply.
//!
//! This is the idea of [`CombiningStore`](crate::store::CombiningStore) (many calls, one round
//! trip), applied at one scope: `CombiningStore` is a store the application chooses, and
//! combines the claims, completions and releases of concurrent single calls across the
//! process; `Coalescing` is private to one batch, always on, and combines only its items'
//! first completion or release. Both send through [`Store::complete_many`].

use std::collections::HashSet;
use std::future::Future;
use std::hash::{BuildHasherDefault, Hasher};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::Notify;

use crate::engine::claimed::Claimed;
use crate::engine::deadline::{bounded, call_bound};
use crate::engine::watch::watch_many;
use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Ending, Record, SharedStore, Store, Token,
};

/// The longest a batch item's first ending waits for its siblings'.
const MAX_COMPLETION_DELAY: Duration = Duration::from_millis(20);

/// An ending waiting to be sent with its round, and its owner's claim for a completion the
/// engine sent (renewed while the round is in flight).
struct Pending {
    item: Ending,
    claim: Option<Arc<Claimed>>,
}

/// A round's answers, one slot per ending in the order they joined, shared by the round's
/// sender and its waiters: one allocation per round, not a channel per ending.
#[derive(Default)]
struct Answers {
    slots: Mutex<Answering>,
}

#[derive(Default)]
struct Answering {
    slots: Vec<Slot>,
    /// The round was answered, or abandoned: a slot without an answer then is an unknown
    /// outcome.
    closed: bool,
}

#[derive(Default)]
struct Slot {
    answer: Option<Result<bool, StoreError>>,
    waker: Option<Waker>,
}

impl Answers {
    fn lock(&self) -> MutexGuard<'_, Answering> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Hands each ending of the round its answer, in order (a store that answered fewer
    /// items than it was given leaves the rest unknown), and wakes its waiter.
    fn answer(&self, answers: impl Iterator<Item = Result<bool, StoreError>>) {
        let wakers: Vec<Waker> = {
            let mut answering = self.lock();
            answering.closed = true;
            let mut answers = answers;
            answering
                .slots
                .iter_mut()
                .filter_map(|slot| {
                    slot.answer = Some(answers.next().unwrap_or_else(|| Err(abandoned())));
                    slot.waker.take()
                })
                .collect()
        };
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Closes a round that will not be answered: its waiters get an unknown outcome.
    fn abandon(&self) {
        let wakers: Vec<Waker> = {
            let mut answering = self.lock();
            if answering.closed {
                return;
            }
            answering.closed = true;
            answering
                .slots
                .iter_mut()
                .filter_map(|slot| slot.waker.take())
                .collect()
        };
        wakers.into_iter().for_each(Waker::wake);
    }
}

/// A round of endings taken to be sent, and where their answers go. Dropped before it was
/// answered (its sender dropped mid-flight, or before it started), its waiters get an
/// unknown outcome.
struct Round {
    pending: Vec<Pending>,
    answers: Arc<Answers>,
}

impl Drop for Round {
    fn drop(&mut self) {
        self.answers.abandon();
    }
}

/// One ending's answer, once its round has it.
struct Answer {
    answers: Arc<Answers>,
    index: usize,
}

impl Future for Answer {
    type Output = Result<bool, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut answering = self.answers.lock();
        let closed = answering.closed;
        let Some(slot) = answering.slots.get_mut(self.index) else {
            return Poll::Ready(Err(abandoned()));
        };
        if let Some(answer) = slot.answer.take() {
            return Poll::Ready(answer);
        }
        if closed {
            return Poll::Ready(Err(abandoned()));
        }
        match &mut slot.waker {
            Some(waker) if waker.will_wake(cx.waker()) => {}
            waker => *waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

/// A batch's store: the first ending of each item is sent with the others'.
pub(crate) struct Coalescing {
    inner: SharedStore,
    max_delay: Duration,
    /// The bound on sending a round ([`call_bound`] of the batch's lease).
    bound: Duration,
    state: Mutex<State>,
    /// Wakes a round's leader when the last item that could still end went away.
    changed: Notify,
}

struct State {
    /// Items that may still end through the batch.
    waiting: HashSet<Token, BuildHasherDefault<TokenHasher>>,
    pending: Vec<Pending>,
    /// The answers of the pending endings' round.
    answers: Arc<Answers>,
    /// When the first pending ending arrived.
    since: Option<tokio::time::Instant>,
}

/// Hashes the batch's own tokens: fresh tokens the engine generated (a per-process salt and
/// counter), never input an adversary chooses, so a multiply-rotate hash does, for a fraction
/// of a keyed SipHash's cost (two lookups per batch item).
#[derive(Default)]
struct TokenHasher(u64);

impl Hasher for TokenHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl Coalescing {
    /// The store of a batch whose items own `tokens`, claimed with `lease`; an ending waits
    /// for the others at most a tenth of the lease, and never more than
    /// [`MAX_COMPLETION_DELAY`].
    pub(crate) fn new(
        inner: SharedStore,
        tokens: impl IntoIterator<Item = Token>,
        lease: Duration,
    ) -> Arc<Coalescing> {
        Arc::new(Coalescing {
            inner,
            max_delay: (lease / 10).min(MAX_COMPLETION_DELAY),
            bound: call_bound(lease),
            state: Mutex::new(State {
                waiting: tokens.into_iter().collect(),
                pending: Vec::new(),
                answers: Arc::default(),
                since: None,
            }),
            changed: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The item of `token` will not end through the batch (it did not acquire its key, or
    /// its call ended): the others stop waiting for it.
    pub(crate) fn forget(&self, token: &Token) {
        let mut state = self.lock();
        if state.waiting.remove(token) && state.waiting.is_empty() && !state.pending.is_empty() {
            drop(state);
            self.changed.notify_waiters();
        }
    }

    /// Joins `claim`'s first completion to the batch's pending endings, and answers it when
    /// the batch sends it: `None` when the claim's item is not waiting to end through the
    /// batch (it ended once already), for the caller to send on its own. The batch bounds and
    /// watches what it sends ([`flush`](Self::flush)), so the caller need not.
    pub(crate) async fn complete_first(
        &self,
        claim: &Arc<Claimed>,
        completion: &Completion,
    ) -> Option<Result<bool, StoreError>> {
        let item = Ending::complete(claim.key.clone(), claim.token, completion.clone());
        match self.join(item, Some(claim.clone())) {
            Ok(answer) => Some(self.wait(answer).await),
            Err(_) => None,
        }
    }

    /// The ending of `item`: through the batch when its item waits to end through it, else on
    /// its own.
    async fn end(&self, item: Ending) -> Result<bool, StoreError> {
        match self.join(item, None) {
            Ok(answer) => self.wait(answer).await,
            Err(item) => item.send_alone(&*self.inner).await,
        }
    }

    /// Adds `item` to the pending endings if its item may still end through the batch
    /// (`Err(item)` otherwise). The first of a round of endings leads it: it waits for the
    /// round to be due and sends it, unless the last item of the batch sends it first.
    // `Err` hands the caller its own ending back to send alone: a move, not a copy.
    #[allow(clippy::result_large_err)]
    fn join(&self, item: Ending, claim: Option<Arc<Claimed>>) -> Result<Joined, Ending> {
        let mut state = self.lock();
        if !state.waiting.remove(&item.token) {
            return Err(item);
        }
        let leads = state.pending.is_empty();
        if leads {
            state.since = Some(tokio::time::Instant::now());
        }
        let answer = Answer {
            answers: state.answers.clone(),
            index: state.pending.len(),
        };
        state.answers.lock().slots.push(Slot::default());
        state.pending.push(Pending { item, claim });
        // The last item that could end: the round is complete, and this caller sends it.
        let round = state.waiting.is_empty().then(|| take_round(&mut state));
        Ok(Joined {
            answer,
            leads,
            round,
        })
    }

    /// Waits for a joined ending's answer: sending its round when it is the last one in, or
    /// when it leads the round and the round is due.
    ///
    /// Only the leader of a round holds a timer and listens for the batch's last item going
    /// away; the others wait for their answer alone. The leader is the first ending of its
    /// round, and its future is only ever dropped with the whole batch's (an ending's bound,
    /// half the lease, is longer than a round's delay, a tenth of the lease at most, and a
    /// leader whose bound fires sees its round due first and sends it): so a round is never
    /// left without someone to send it while its endings wait.
    async fn wait(&self, joined: Joined) -> Result<bool, StoreError> {
        let Joined {
            mut answer,
            leads,
            round,
        } = joined;
        if let Some(round) = round {
            self.flush(round).await;
        } else if leads {
            loop {
                let notified = self.changed.notified();
                let mut notified = std::pin::pin!(notified);
                notified.as_mut().enable();
                let (round, due) = {
                    let mut state = self.lock();
                    // Set exactly while endings are pending; none pending means this
                    // ending's round was sent by another caller.
                    let due = state.since.map(|since| since + self.max_delay);
                    let ready = !state.pending.is_empty()
                        && (state.waiting.is_empty()
                            || due.is_some_and(|due| due <= tokio::time::Instant::now()));
                    let round = ready.then(|| take_round(&mut state));
                    (round, due.filter(|_| !ready))
                };
                if let Some(round) = round {
                    self.flush(round).await;
                    break;
                }
                let Some(due) = due else { break };
                tokio::select! {
                    answered = &mut answer => return answered,
                    () = &mut notified => {}
                    () = tokio::time::sleep_until(due) => {}
                }
            }
        }
        answer.await
    }

    /// Sends a round of endings and hands each waiter its answer. The round is bounded as
    /// one store call of an owner's path ([`call_bound`] of the batch's lease: past it, every
    /// ending in it is an unknown outcome, which its owner resolves by reading its record
    /// back), and the leases of the owners whose completions it carries are renewed while it
    /// is in flight ([`watch_many`]).
    async fn flush(&self, mut round: Round) {
        let pending = std::mem::take(&mut round.pending);
        let mut items = Vec::with_capacity(pending.len());
        let mut claims = Vec::new();
        for pending in pending {
            items.push(pending.item);
            claims.extend(pending.claim);
        }
        let send = async { Ok(self.inner.complete_many(&items).await) };
        let send = std::pin::pin!(bounded(self.bound, "batch's endings", send));
        match watch_many(send, &claims).await {
            Ok(ended) => round.answers.answer(ended.into_iter()),
            Err(err) => round.answers.answer(std::iter::repeat_with(|| {
                Err(StoreError::new(err.kind(), err.to_string()))
            })),
        }
    }
}

/// An ending that joined a round: its answer, whether it leads the round, and the round
/// itself when it completed it.
struct Joined {
    answer: Answer,
    leads: bool,
    round: Option<Round>,
}

/// The pending endings, taken to be sent; the next round gets answers of its own.
fn take_round(state: &mut State) -> Round {
    state.since = None;
    Round {
        pending: std::mem::take(&mut state.pending),
        answers: std::mem::take(&mut state.answers),
    }
}

fn abandoned() -> StoreError {
    StoreError::new(
        StoreErrorKind::OutcomeUnknown,
        "the batched ending carrying this item was abandoned",
    )
}

impl Store for Coalescing {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        self.inner.claim(req)
    }

    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Vec<Result<Claim, StoreError>>> {
        self.inner.claim_many(reqs)
    }

    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let item = Ending::complete(key.clone(), *token, completion.clone());
        Box::pin(self.end(item))
    }

    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.end(Ending::release(key.clone(), *token)))
    }

    fn complete_many<'a>(
        &'a self,
        items: &'a [Ending],
    ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
        self.inner.complete_many(items)
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.renew(key, token, lease)
    }

    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.inner.read(key)
    }

    fn is_completed<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.is_completed(key)
    }

    fn max_result_size(&self) -> usize {
        self.inner.max_result_size()
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
}

/// Forgets its item when dropped: the end of an item's call, however it ended.
pub(crate) struct Forget {
    pub(crate) batch: Arc<Coalescing>,
    pub(crate) token: Token,
}

impl Drop for Forget {
    fn drop(&mut self) {
        self.batch.forget(&self.token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers with `slots` slots, and a waiter on each.
    fn waiting(slots: usize) -> (Arc<Answers>, Vec<Answer>) {
        let answers = Arc::new(Answers::default());
        answers.lock().slots.resize_with(slots, Slot::default);
        let waiters = (0..slots)
            .map(|index| Answer {
                answers: answers.clone(),
                index,
            })
            .collect();
        (answers, waiters)
    }

    #[tokio::test]
    async fn each_waiter_gets_its_own_answer_and_a_short_answer_leaves_the_rest_unknown() {
        let (answers, waiters) = waiting(3);
        let waited = tokio::spawn(futures_util::future::join_all(waiters));
        tokio::task::yield_now().await;
        answers.answer([Ok(true), Ok(false)].into_iter());
        let got = waited.await.expect("the waiters ran");
        assert!(matches!(got[0], Ok(true)));
        assert!(matches!(got[1], Ok(false)));
        assert!(matches!(&got[2], Err(e) if e.kind() == StoreErrorKind::OutcomeUnknown));
    }

    #[tokio::test]
    async fn a_round_dropped_before_it_was_answered_answers_unknown() {
        let (answers, waiters) = waiting(2);
        let waited = tokio::spawn(futures_util::future::join_all(waiters));
        tokio::task::yield_now().await;
        drop(Round {
            pending: Vec::new(),
            answers,
        });
        let got = waited.await.expect("the waiters ran");
        assert!(got
            .iter()
            .all(|answer| matches!(answer, Err(e) if e.kind() == StoreErrorKind::OutcomeUnknown)));
    }

    #[tokio::test]
    async fn an_answered_round_is_not_abandoned_when_dropped() {
        let (answers, waiters) = waiting(1);
        let round = Round {
            pending: Vec::new(),
            answers: answers.clone(),
        };
        answers.answer(std::iter::once(Ok(true)));
        drop(round);
        let got = futures_util::future::join_all(waiters).await;
        assert!(matches!(got[0], Ok(true)));
    }
}
