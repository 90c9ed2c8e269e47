//! The claim a body runs under, readable from inside it.

use std::sync::Arc;

use crate::engine::claimed::Claimed;
use crate::key::Key;

tokio::task_local! {
    static CURRENT: Current;
}

/// The claim the running body holds: its key, its fence, and whether its lease is lost.
///
/// The fence is what makes a stale owner harmless: pass it to the resource and have the
/// resource refuse writes from an older fence
/// (`UPDATE ... SET ..., fence = $f WHERE id = $id AND fence < $f`). Fences grow on every
/// acquisition of a key and never repeat, not even after its record expired.
///
/// Inside a body run by the `#[idempotent]` attribute or [`Operation::run`](crate::Operation::run),
/// [`current()`] returns it; [`Operation::run_with`](crate::Operation::run_with) passes it as an
/// argument.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotent_runtime::{current, Error, Idempotency, Key, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let deductions = Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
/// let key = Key::new("stock:deduct", 1, &[&"sku-9"]).unwrap();
/// let fence: Result<u64, Error> = deductions
///     .run(key, async {
///         let claim = current().expect("inside an idempotent body");
///         // UPDATE stock SET qty = qty - 1, fence = $1 WHERE sku = $2 AND fence < $1
///         Ok(claim.fence())
///     })
///     .await;
/// assert!(fence.unwrap() > 0);
/// assert!(current().is_none());
/// # }
/// ```
#[derive(Clone)]
pub struct Current {
    claim: Arc<Claimed>,
}

impl std::fmt::Debug for Current {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Current")
            .field("key", &self.claim.key)
            .field("fence", &self.claim.fence)
            .field("lost", &self.claim.is_lost())
            .finish()
    }
}

impl Current {
    pub(crate) fn new(claim: Arc<Claimed>) -> Current {
        Current { claim }
    }

    /// The operation key.
    pub fn key(&self) -> &Key {
        &self.claim.key
    }

    /// The claim's fence: higher than that of every earlier owner of the key. Zero when the
    /// body runs unguarded (the store failed and the policy is
    /// [`OnStoreError::FailOpen`](crate::OnStoreError::FailOpen)): a resource that checks
    /// fences refuses such a write.
    pub fn fence(&self) -> u64 {
        self.claim.fence
    }

    /// Whether the lease is lost: another owner may hold the key now.
    pub fn is_lost(&self) -> bool {
        self.claim.is_lost()
    }

    /// Resolves once the lease is lost, for a body to `select!` on:
    ///
    /// ```
    /// # async fn long_work() {}
    /// # async fn f(claim: idempotent_runtime::Current) -> Result<(), &'static str> {
    /// tokio::select! {
    ///     () = long_work() => Ok(()),
    ///     () = claim.lost() => Err("lost the claim; stopping before the next step"),
    /// }
    /// # }
    /// ```
    pub async fn lost(&self) {
        self.claim.lost().await;
    }

    pub(crate) fn scope<F: std::future::Future>(
        self,
        fut: F,
    ) -> tokio::task::futures::TaskLocalFuture<Current, F> {
        CURRENT.scope(self, fut)
    }
}

/// The claim of the idempotent body this task is running, if any (see [`Current`]).
///
/// Bodies run by the `#[idempotent]` attribute and by [`Operation::run`](crate::Operation::run)
/// can call it; tasks the body spawns cannot (pass them the [`Current`]).
pub fn current() -> Option<Current> {
    CURRENT.try_with(Current::clone).ok()
}
