//! The engine: claim → run (with lease renewal) → complete or release.
//!
//! - [`Idempotency`] (`idempotency.rs`) holds the settings shared by many calls, and runs batches.
//! - [`Operation`] (`operation.rs`) is one call: built from an [`Idempotency`] and a key, refined with a
//!   fingerprint, a replay codec, an error policy and a business-status check, and run.
//! - `bound.rs` runs a call whose claim lives in the caller's transaction (SQL stores).
//! - `decide.rs` maps a claim's outcome and the policy to the next step, for every path.
//! - `pending.rs` is the claim round trip (single and batch), bounded and finished in the
//!   background when its caller is gone; `owner.rs` owns an acquired claim to its completion
//!   or release, including cancellation and completions that fail.
//! - [`Lock`] (`lock.rs`) is a fenced lease lock built on the same claim, renewal and release.
//! - `watch.rs` renews the lease while a body runs and notices a lost lease.
//! - `deadline.rs` bounds every store call of an owner's path; `loss.rs` reports a completion
//!   lost after its caller was told it succeeded.
//! - [`Current`] (`current.rs`) is the claim as the body sees it.
//!
//! The `#[idempotent]` attribute expands to an [`Operation`].

mod batch;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod bound;
mod coalesce;
mod current;
mod deadline;
mod decide;
mod handler;
mod idempotency;
mod lock;
mod loss;
mod operation;
mod owner;
mod pending;
mod watch;

pub use batch::Batch;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) use bound::{run_bound, Bound, BoundCall};
pub use current::{current, Current};
pub(crate) use deadline::bounded;
pub use handler::HandlerResult;
pub use idempotency::Idempotency;
pub use lock::{Lock, LockGuard};
pub use loss::{on_completion_lost, CompletionLost, LossReason};
pub use operation::Operation;
#[cfg(all(
    feature = "http",
    any(feature = "postgres", feature = "mysql", feature = "sqlite")
))]
pub(crate) use operation::Outcomes;

/// The type states of an [`Operation`]: with or without a business-status check
/// ([`Operation::done`]). They appear in signatures only; nothing here is built by hand.
pub mod state {
    #[doc(hidden)]
    pub use super::handler::OnceDone;
    pub use super::handler::{Done, DoneCheck, ItemCheck, ItemDone, NoDone};
}
