//! Ending a batch's items together: the first completion or release of each item of a
//! batch waits, briefly, for the others, and they go to the store in one
//! [`Store::complete_many`] (one round trip on Redis and SQL).
//!
//! [`Coalescing`] wraps the batch's store. An item's first `complete` or `release` joins the
//! pending endings; they are sent when every item of the batch has either ended or
//! finished without ending ([`Coalescing::forget`]), or when the first of them has waited
//! [`Coalescing::new`]'s `max_delay` (a slow sibling never holds the others' completions for
//! longer, so their leases never come close to running out while they wait). Whoever finds
//! the batch ready sends it, and every waiter gets its own item's answer.
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
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, Notify};

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Ending, Record, SharedStore, Store, Token,
};

type Answer = oneshot::Sender<Result<bool, StoreError>>;

/// A batch's store: the first ending of each item is sent with the others'.
pub(crate) struct Coalescing {
    inner: SharedStore,
    max_delay: Duration,
    state: Mutex<State>,
    /// Wakes the waiters when the last item that could still end went away.
    changed: Notify,
}

struct State {
    /// Items that may still end through the batch.
    waiting: HashSet<Token, BuildHasherDefault<TokenHasher>>,
    pending: Vec<(Ending, Answer)>,
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
    /// The store of a batch whose items own `tokens`; an ending waits at most `max_delay`
    /// for the others.
    pub(crate) fn new(
        inner: SharedStore,
        tokens: impl IntoIterator<Item = Token>,
        max_delay: Duration,
    ) -> Arc<Coalescing> {
        Arc::new(Coalescing {
            inner,
            max_delay,
            state: Mutex::new(State {
                waiting: tokens.into_iter().collect(),
                pending: Vec::new(),
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

    async fn end(&self, item: Ending) -> Result<bool, StoreError> {
        let joined = {
            let mut state = self.lock();
            if state.waiting.remove(&item.token) {
                let (tx, rx) = oneshot::channel();
                state.pending.push((item, tx));
                state.since.get_or_insert_with(tokio::time::Instant::now);
                Ok(rx)
            } else {
                Err(item)
            }
        };
        let mut answer = match joined {
            Ok(answer) => answer,
            Err(item) => return item.send_alone(&*self.inner).await,
        };
        loop {
            let notified = self.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let (ready, due) = {
                let mut state = self.lock();
                // Set exactly while endings are pending; none pending means this item's
                // is on its way in another waiter's batch.
                let due = state.since.map(|since| since + self.max_delay);
                let ready = !state.pending.is_empty()
                    && (state.waiting.is_empty()
                        || due.is_some_and(|due| due <= tokio::time::Instant::now()));
                let ready = ready.then(|| {
                    state.since = None;
                    std::mem::take(&mut state.pending)
                });
                let due = due.filter(|_| ready.is_none());
                (ready, due)
            };
            if let Some(batch) = ready {
                self.flush(batch).await;
            }
            let deadline = due.unwrap_or_else(tokio::time::Instant::now);
            tokio::select! {
                answered = &mut answer => {
                    return answered.unwrap_or_else(|_| Err(abandoned()));
                }
                () = &mut notified => {}
                () = tokio::time::sleep_until(deadline), if due.is_some() => {}
            }
        }
    }

    /// Sends `batch` and hands each waiter its answer.
    async fn flush(&self, batch: Vec<(Ending, Answer)>) {
        let (items, answers): (Vec<Ending>, Vec<Answer>) = batch.into_iter().unzip();
        let ended = self.inner.complete_many(&items).await;
        let mut ended = ended.into_iter();
        for answer in answers {
            // A store that answered fewer items than it was given leaves the rest unknown.
            let _ = answer.send(ended.next().unwrap_or_else(|| Err(abandoned())));
        }
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
