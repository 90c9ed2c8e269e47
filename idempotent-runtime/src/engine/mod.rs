//! The engine: claim → run (with lease renewal) → complete or release.
//!
//! - [`Guard`] (`guard.rs`) holds the settings shared by many calls, and runs batches.
//! - [`Operation`] (`operation.rs`) is one call: built from a guard and a key, refined with a
//!   fingerprint, a replay codec, an error policy and a business-status check, and run.
//! - `decide.rs` maps a claim's outcome and the policy to the next step, for every path.
//! - `owner.rs` owns a claim from its round trip to its completion or release, including
//!   cancellation and completions that fail.
//! - `watch.rs` renews the lease while a body runs and notices a lost lease.
//! - [`Current`] (`current.rs`) is the claim as the body sees it.
//!
//! The `#[idempotent]` attribute expands to an [`Operation`].

mod current;
mod decide;
mod guard;
mod handler;
mod operation;
mod owner;
mod watch;

pub use current::{current, Current};
pub use guard::Guard;
pub use handler::HandlerResult;
pub use operation::Operation;

/// The type states of an [`Operation`]: with or without a business-status check
/// ([`Operation::done`]). They appear in signatures only; nothing here is built by hand.
pub mod state {
    pub use super::handler::{Done, DoneCheck, NoDone};
}
