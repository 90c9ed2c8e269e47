//! The engine: claim → run (with lease renewal) → complete or release, and the one place a
//! call's outcome is concluded.
//!
//! - [`Idempotency`] (`idempotency.rs`) holds the settings shared by many calls, and checks
//!   their durations once (`Lifetime`).
//! - [`Operation`] (`operation.rs`) is one call: built from an [`Idempotency`] and a key,
//!   refined with a fingerprint, a replay codec, an error policy and a business-status check,
//!   and run. The `#[idempotent]` attribute expands to one.
//! - [`Batch`] (`batch.rs`) is many calls claimed in one store call; its items' completions
//!   and releases go to the store together through `coalesce.rs`.
//! - `bound.rs` runs a call whose claim lives in the caller's transaction (SQL stores).
//! - [`Lock`] (`lock.rs`) is a fenced lease lock built on the same claim, renewal and release.
//! - `decide.rs` maps a claim's answer and the in-progress policy to the next step, for
//!   every door; `conclude.rs` is where every door's outcome is traced, counted and answered;
//!   `results.rs` is what a call keeps of its results (replay, error policy); `run.rs` runs
//!   the body under an owned claim, or unguarded when the store failed and the policy says so.
//! - `pending.rs` is the claim round trip (single and batch), bounded and finished in the
//!   background when its caller is gone; `owner.rs` owns an acquired claim to its completion
//!   or release, including cancellation and completions that fail.
//! - `watch.rs` renews the lease while a body runs and notices a lost lease.
//! - `deadline.rs` bounds every store call of an owner's path; `loss.rs` reports a completion
//!   lost after its caller was told it succeeded.
//! - `handler.rs` is what a handler returns and the business-status checks; [`Current`]
//!   (`current.rs`) is the claim as the body sees it.

mod batch;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod bound;
mod claimed;
mod coalesce;
mod conclude;
mod current;
mod deadline;
mod decide;
mod handler;
mod idempotency;
mod join;
mod lock;
mod loss;
mod operation;
mod owner;
mod pending;
mod results;
mod run;
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
pub(crate) use results::Results;

/// The type states of an [`Operation`]: with or without a business-status check
/// ([`Operation::done`]). They appear in signatures only; nothing here is built by hand.
pub mod state {
    #[doc(hidden)]
    pub use super::handler::OnceCheck;
    pub use super::handler::{BusinessCheck, Check, CheckEach, ItemCheck, NoCheck};
}
