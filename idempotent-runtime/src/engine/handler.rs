//! What a handler returns, and the business-status checks an operation can ask.

use std::future::Future;

use crate::error::Error;

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

/// A business-status check for [`Operation::done`](crate::Operation::done): the type state
/// of an [`Operation`](crate::Operation) with ([`Done`]) or without ([`NoDone`]) a check.
/// Sealed: only those two implement it.
pub trait DoneCheck: sealed::Sealed {
    /// The check's error type.
    type Error;
    /// The check's future.
    type Future: Future<Output = Result<bool, Self::Error>>;
    /// Starts one check, or `None` when there is no check.
    fn start(&mut self) -> Option<Self::Future>;
}

/// No business-status check.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoDone;

impl DoneCheck for NoDone {
    type Error = Error;
    type Future = std::future::Ready<Result<bool, Error>>;
    fn start(&mut self) -> Option<Self::Future> {
        None
    }
}

/// A business-status check installed by [`Operation::done`](crate::Operation::done).
#[derive(Debug, Clone, Copy)]
pub struct Done<F>(pub(crate) F);

impl<F, Fut, X> DoneCheck for Done<F>
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
pub struct OnceDone<Fut>(pub(crate) Option<Fut>);

impl<Fut, X> DoneCheck for OnceDone<Fut>
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
/// batch with ([`ItemDone`]) or without ([`NoDone`]) a check. Sealed.
pub trait ItemCheck<T>: sealed::Sealed {
    /// The check's error type.
    type Error;
    /// One item's check.
    #[doc(hidden)]
    type Check: DoneCheck<Error = Self::Error>;
    /// The check of `item`.
    #[doc(hidden)]
    fn of(&self, item: &T) -> Self::Check;
}

impl<T> ItemCheck<T> for NoDone {
    type Error = Error;
    type Check = NoDone;
    fn of(&self, _: &T) -> NoDone {
        NoDone
    }
}

/// A per-item business-status check installed by [`Batch::done`](crate::Batch::done).
#[derive(Debug, Clone, Copy)]
pub struct ItemDone<F>(pub(crate) F);

impl<T, F, Fut, X> ItemCheck<T> for ItemDone<F>
where
    F: Fn(&T) -> Fut,
    Fut: Future<Output = Result<bool, X>>,
{
    type Error = X;
    type Check = OnceDone<Fut>;
    fn of(&self, item: &T) -> OnceDone<Fut> {
        OnceDone(Some((self.0)(item)))
    }
}

mod sealed {
    /// Keeps [`DoneCheck`](super::DoneCheck) and [`ItemCheck`](super::ItemCheck) to the
    /// engine's own type states.
    pub trait Sealed {}

    impl Sealed for super::NoDone {}
    impl<F> Sealed for super::Done<F> {}
    impl<F> Sealed for super::OnceDone<F> {}
    impl<F> Sealed for super::ItemDone<F> {}
}
