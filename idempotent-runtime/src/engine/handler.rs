//! What a handler returns, and the business-status checks an operation can ask.

use std::future::Future;
use std::time::Duration;

use crate::engine::deadline::{bounded, call_bound};
use crate::error::{Error, StoreError};
use crate::key::Key;
use crate::store::SharedStore;

/// The output of an idempotent handler: `Result<T, E>` where `E: From<idempotency::Error>`.
#[diagnostic::on_unimplemented(
    message = "idempotent handlers must return `Result<T, E>`, but this one returns `{Self}`",
    label = "not a `Result`",
    note = "the handler's error type must also implement `From<idempotency::Error>`"
)]
pub trait HandlerResult: Sized {
    /// The success type.
    type Ok;
    /// The error type.
    type Err: From<Error>;
    /// Splits the output.
    fn into_result(self) -> Result<Self::Ok, Self::Err>;
    /// Builds the output.
    fn from_result(result: Result<Self::Ok, Self::Err>) -> Self;
}

impl<T, E: From<Error>> HandlerResult for Result<T, E> {
    type Ok = T;
    type Err = E;
    fn into_result(self) -> Result<T, E> {
        self
    }
    fn from_result(result: Result<T, E>) -> Self {
        result
    }
}

/// A key whose completed record means a call's effect is applied already (the HTTP layer's
/// request under the previous key layout, completed before an upgrade): a check made, like a
/// business check, after an acquired claim and when the claim finds a live owner.
///
/// The first claim reads it in its own round trip ([`PendingClaim::checking`]), and the first
/// check takes that answer; a later check reads it anew, bounded as every store call of an
/// owner's path is.
///
/// [`PendingClaim::checking`]: crate::engine::pending::PendingClaim::checking
#[derive(Debug)]
pub(crate) struct DoneKey {
    pub(crate) key: Key,
    /// The answer read with the claim, until a check takes it.
    pub(crate) read: Option<Result<bool, StoreError>>,
}

impl DoneKey {
    /// Whether the record under the key is completed: the answer read with the claim, else a
    /// read now.
    pub(crate) async fn applied(
        &mut self,
        store: &SharedStore,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        if let Some(read) = self.read.take() {
            return read;
        }
        bounded(
            call_bound(lease),
            "completed-state read",
            store.is_completed(&self.key),
        )
        .await
    }
}

/// A business-status check for [`Operation::done`](crate::Operation::done): the type state
/// of an [`Operation`](crate::Operation) with ([`Check`]) or without ([`NoCheck`]) a check.
/// Sealed: only those two implement it.
pub trait BusinessCheck: sealed::Sealed {
    /// The check's error type.
    type Error;
    /// The check's future.
    type Future: Future<Output = Result<bool, Self::Error>>;
    /// Starts one check, or `None` when there is no check.
    fn start(&mut self) -> Option<Self::Future>;
}

/// No business-status check.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoCheck;

impl BusinessCheck for NoCheck {
    type Error = Error;
    type Future = std::future::Ready<Result<bool, Error>>;
    fn start(&mut self) -> Option<Self::Future> {
        None
    }
}

/// A business-status check installed by [`Operation::done`](crate::Operation::done).
#[derive(Debug, Clone, Copy)]
pub struct Check<F>(pub(crate) F);

impl<F, Fut, X> BusinessCheck for Check<F>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, X>>,
{
    type Error = X;
    type Future = Fut;
    fn start(&mut self) -> Option<Fut> {
        Some((self.0)())
    }
}

/// One batch item's check, started once (the batch made its future from the item before
/// the handler took the item); later starts have no check to make.
#[derive(Debug)]
pub struct OnceCheck<Fut>(pub(crate) Option<Fut>);

impl<Fut, X> BusinessCheck for OnceCheck<Fut>
where
    Fut: Future<Output = Result<bool, X>>,
{
    type Error = X;
    type Future = Fut;
    fn start(&mut self) -> Option<Fut> {
        self.0.take()
    }
}

/// The business-status check of a [`Batch`](crate::Batch)'s items: the type state of a
/// batch with ([`CheckEach`]) or without ([`NoCheck`]) a check. Sealed.
pub trait ItemCheck<T>: sealed::Sealed {
    /// The check's error type.
    type Error;
    /// One item's check.
    #[doc(hidden)]
    type Check: BusinessCheck<Error = Self::Error>;
    /// The check of `item`.
    #[doc(hidden)]
    fn of(&self, item: &T) -> Self::Check;
}

impl<T> ItemCheck<T> for NoCheck {
    type Error = Error;
    type Check = NoCheck;
    fn of(&self, _: &T) -> NoCheck {
        NoCheck
    }
}

/// A per-item business-status check installed by [`Batch::done`](crate::Batch::done).
#[derive(Debug, Clone, Copy)]
pub struct CheckEach<F>(pub(crate) F);

impl<T, F, Fut, X> ItemCheck<T> for CheckEach<F>
where
    F: Fn(&T) -> Fut,
    Fut: Future<Output = Result<bool, X>>,
{
    type Error = X;
    type Check = OnceCheck<Fut>;
    fn of(&self, item: &T) -> OnceCheck<Fut> {
        OnceCheck(Some((self.0)(item)))
    }
}

mod sealed {
    /// Keeps [`BusinessCheck`](super::BusinessCheck) and [`ItemCheck`](super::ItemCheck) to the
    /// engine's own type states.
    pub trait Sealed {}

    impl Sealed for super::NoCheck {}
    impl<F> Sealed for super::Check<F> {}
    impl<F> Sealed for super::OnceCheck<F> {}
    impl<F> Sealed for super::CheckEach<F> {}
}
