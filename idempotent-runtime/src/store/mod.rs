//! The [`Store`] trait: a few atomic, owner-checked primitives that every backend provides.
//!
//! A store keeps one record per operation [`Key`](crate::Key):
//!
//! - `InProgress { token, fence, lease_until }` while an owner runs the handler;
//! - `Completed { token, fence, result? }` once the owner completed it;
//! - `Released { fence }` after the owner gave the claim back (the fence is kept so the next
//!   owner's fence is still higher).
//!
//! Every record expires `ttl` after it was written. Times are the store's own clock, never
//! the caller's. There is no public get-then-set pair: a claim is one atomic operation and
//! every later write checks the caller's token.
//!
//! # Writing a store
//!
//! A backend implements two traits:
//!
//! - [`Store`], what the engine calls on every handler run: `claim`, `complete`, `release`,
//!   `renew` and `read` (the batch methods, `release_acquired`, `is_completed`,
//!   `claim_and_is_completed`, the result limit and the name have defaults);
//! - [`OperatorStore`], what an operator's tools call: `reopen`, `scan` and `delete`.
//!   [`Admin`](crate::admin::Admin) and the `idempotent-admin` command line take only a store
//!   that implements it, and so do the stores that wrap others ([`TieredStore`],
//!   [`CombiningStore`]); [`connect`] returns one ([`SharedOperatorStore`]).
//!
//! Neither trait has a method that fails for want of an implementation: a store that lacks
//! the operator's methods is refused by the compiler where an operator would use it, not at
//! run time. The helpers [`next_fence`], [`clamped_millis`] and
//! [`ClaimRequest::record_lifetime`] give the numbers every backend must agree on, and
//! [`claim_answer`] what a claim answers for the record it finds. The conformance suite in
//! the repository's `tests/` checks every rule of both traits; run it against a new backend
//! before trusting it.
//!
//! A store that counts the claims of another, with both traits passed on to it:
//!
//! ```
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idempotent_runtime::admin::Admin;
//! use idempotent_runtime::store::{Expect, OperatorStore, ScanCursor, ScanPage};
//! use idempotent_runtime::{
//!     BoxFuture, Claim, ClaimRequest, Completion, Key, MemoryStore, Record, Store, StoreError,
//!     Token,
//! };
//!
//! struct Counted<S> {
//!     inner: S,
//!     claims: AtomicU64,
//! }
//!
//! impl<S: Store> Store for Counted<S> {
//!     fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
//!         self.claims.fetch_add(1, Ordering::Relaxed);
//!         self.inner.claim(req)
//!     }
//!     fn complete<'a>(
//!         &'a self,
//!         key: &'a Key,
//!         token: &'a Token,
//!         completion: &'a Completion,
//!     ) -> BoxFuture<'a, Result<bool, StoreError>> {
//!         self.inner.complete(key, token, completion)
//!     }
//!     fn release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<bool, StoreError>> {
//!         self.inner.release(key, token)
//!     }
//!     fn renew<'a>(
//!         &'a self,
//!         key: &'a Key,
//!         token: &'a Token,
//!         lease: Duration,
//!     ) -> BoxFuture<'a, Result<bool, StoreError>> {
//!         self.inner.renew(key, token, lease)
//!     }
//!     fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
//!         self.inner.read(key)
//!     }
//! }
//!
//! impl<S: OperatorStore> OperatorStore for Counted<S> {
//!     fn reopen<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<bool, StoreError>> {
//!         self.inner.reopen(key, token)
//!     }
//!     fn scan<'a>(
//!         &'a self,
//!         prefix: &'a str,
//!         cursor: &'a ScanCursor,
//!         limit: usize,
//!     ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
//!         self.inner.scan(prefix, cursor, limit)
//!     }
//!     fn delete<'a>(&'a self, key: &'a Key, expect: Expect<'a>) -> BoxFuture<'a, Result<bool, StoreError>> {
//!         self.inner.delete(key, expect)
//!     }
//! }
//!
//! let store = Arc::new(Counted { inner: MemoryStore::new(), claims: AtomicU64::new(0) });
//! // Without the `OperatorStore` impl, this line would not compile.
//! let admin = Admin::new(store.clone());
//! # let _ = admin;
//! ```

mod answer;
mod combining;
mod contract;
pub(crate) mod deadline;
mod fingerprint;
#[cfg(feature = "memory")]
pub mod memory;
mod operator;
mod redact;
#[cfg(feature = "redis")]
pub mod redis;
mod request;
mod rules;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod sql;
mod tiered;
mod token;
mod url;

pub use answer::{claim_answer, Claim, ClaimAnswer, Record, RecordState};
pub use combining::CombiningStore;
pub use contract::{BoxFuture, IntoStore, SharedStore, Store};
pub use fingerprint::Fingerprint;
pub use operator::{
    Expect, IntoOperatorStore, OperatorStore, ScanCursor, ScanPage, SharedOperatorStore,
};
pub use request::{AcquiredClaim, ClaimRequest, Completion, End, Ending};
pub use rules::{clamped_millis, next_fence, DEFAULT_MAX_RESULT_SIZE, MAX_DURATION, MIN_DURATION};
pub use tiered::TieredStore;
pub use token::Token;
pub use url::{connect, ConnectError};
