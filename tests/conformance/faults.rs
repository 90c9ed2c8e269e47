//! Fault injection over a real store: [`Down`] refuses every command, [`Observed`] counts claims so
//! a case can wait for a caller to reach the store, [`LostReplies`] loses the reply of a command
//! the inner store applied.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use idempotency::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Expect, OperatorStore, Record, ScanCursor,
    ScanPage, Store, StoreError, StoreErrorKind, Token,
};
use idempotency::{Key, SharedStore};
use tokio::sync::Notify;

/// A store that is down: every command fails before reaching the inner store.
pub struct Down {
    inner: SharedStore,
}

impl Down {
    pub fn new(inner: SharedStore) -> Down {
        Down { inner }
    }
    fn refuse<T: Send + 'static>(&self) -> BoxFuture<'_, Result<T, StoreError>> {
        let _ = &self.inner;
        Box::pin(async {
            Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "connection refused",
            ))
        })
    }
}

impl Store for Down {
    fn claim<'a>(&'a self, _: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        self.refuse()
    }
    fn complete<'a>(
        &'a self,
        _: &'a Key,
        _: &'a Token,
        _: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.refuse()
    }
    fn release<'a>(&'a self, _: &'a Key, _: &'a Token) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.refuse()
    }
    fn renew<'a>(
        &'a self,
        _: &'a Key,
        _: &'a Token,
        _: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.refuse()
    }
    fn read<'a>(&'a self, _: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.refuse()
    }
}

/// The operator's calls fail too.
impl OperatorStore for Down {
    fn reopen<'a>(&'a self, _: &'a Key, _: &'a Token) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.refuse()
    }
    fn scan<'a>(
        &'a self,
        _: &'a str,
        _: &'a ScanCursor,
        _: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
        self.refuse()
    }
    fn delete<'a>(&'a self, _: &'a Key, _: Expect<'a>) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.refuse()
    }
}

/// A store that counts claims, so a case can wait for a caller to reach the store.
pub struct Observed {
    inner: SharedStore,
    claims: AtomicUsize,
    changed: Notify,
}

impl Observed {
    pub fn new(inner: SharedStore) -> Observed {
        Observed {
            inner,
            claims: AtomicUsize::new(0),
            changed: Notify::new(),
        }
    }
    /// Returns once at least `n` claims have been answered.
    pub async fn claims_reached(&self, n: usize) {
        loop {
            let changed = self.changed.notified();
            if self.claims.load(Ordering::SeqCst) >= n {
                return;
            }
            changed.await;
        }
    }
}

impl Store for Observed {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            let claim = self.inner.claim(req).await;
            self.claims.fetch_add(1, Ordering::SeqCst);
            self.changed.notify_waiters();
            claim
        })
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.complete(key, token, completion)
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.release(key, token)
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
}

/// A store whose next claim or complete reply is lost after the inner store applied it.
pub struct LostReplies {
    inner: SharedStore,
    lose_claim: std::sync::atomic::AtomicBool,
    lose_complete: std::sync::atomic::AtomicBool,
    lost: AtomicUsize,
    lost_claim: Mutex<Option<Claim>>,
}

impl LostReplies {
    pub fn new(inner: SharedStore) -> LostReplies {
        LostReplies {
            inner,
            lose_claim: false.into(),
            lose_complete: false.into(),
            lost: AtomicUsize::new(0),
            lost_claim: Mutex::new(None),
        }
    }
    pub fn lose_next_claim_reply(&self) {
        self.lose_claim.store(true, Ordering::SeqCst);
    }
    pub fn lose_next_complete_reply(&self) {
        self.lose_complete.store(true, Ordering::SeqCst);
    }
    pub fn lost(&self) -> usize {
        self.lost.load(Ordering::SeqCst)
    }
    /// The claim the store applied whose reply was lost last.
    pub fn lost_claim(&self) -> Option<Claim> {
        self.lost_claim.lock().unwrap().clone()
    }
    fn lost_reply<T>(
        &self,
        flag: &std::sync::atomic::AtomicBool,
        applied: T,
    ) -> Result<T, StoreError> {
        if flag.swap(false, Ordering::SeqCst) {
            self.lost.fetch_add(1, Ordering::SeqCst);
            drop(applied);
            Err(StoreError::new(
                StoreErrorKind::OutcomeUnknown,
                "reply lost",
            ))
        } else {
            Ok(applied)
        }
    }
}

impl Store for LostReplies {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            let applied = self.inner.claim(req).await?;
            if self.lose_claim.load(Ordering::SeqCst) {
                *self.lost_claim.lock().unwrap() = Some(applied.clone());
            }
            self.lost_reply(&self.lose_claim, applied)
        })
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let applied = self.inner.complete(key, token, completion).await?;
            self.lost_reply(&self.lose_complete, applied)
        })
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.release(key, token)
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
}
