//! The conformance suite: every rule of the semantics (`docs/semantics.md`, "Rules" and
//! "Operator actions"), written once, generic over the store. Each backend's test file
//! instantiates it with `conformance_suite!(make_backend)`, where `make_backend` is an async
//! fn returning an [`OperatorBackend`]: a [`Backend`] whose store also has the operator's
//! methods ([`OperatorStore`](idempotency::store::OperatorStore)), as every store of this
//! crate does. A store that implements [`Store`](idempotency::store::Store) alone runs the engine's
//! cases with `store_conformance_suite!(make_backend)`; the operator's cases (`admin`, and
//! `model`, whose sequences include an operator's reopening and deletion) need an
//! [`OperatorBackend`].
//!
//! Every case uses its own key prefix, so backends that share a server (Redis, SQL) can run
//! cases in parallel; the backend cleans its prefix up when dropped.
//!
//! Two wrappers inject faults a healthy store never produces on demand: [`Down`] (the store
//! refuses every command) and [`LostReplies`] (the store applies a command and the reply is
//! lost). Each backend's own test file also produces these cases with the real server
//! (killing it, cutting the connection) where that is possible.
//!
//! The cases live in one file per rule (`claim`, `lease`, `complete`, `release`,
//! `store_errors`, `done`, `fingerprint`, `cancellation`, `unknown_outcomes`), plus
//! `policies`, `batch`, `ending`, `admin` (the operator's API), `model` (the in-memory store
//! as a model of every other) and the fault wrappers in `faults`; this file holds the
//! [`Backend`] and [`OperatorBackend`] traits, the helpers they share and the lists of cases
//! ([`conformance_cases!`] for the engine's, [`operator_cases!`] for the operator's).

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency::store::{
    BoxFuture, Claim, ClaimRequest, CombiningStore, IntoStore, Record, SharedOperatorStore, Store,
    Token,
};
use idempotency::{Error, Idempotency, Key, SharedStore};
use serde::{Deserialize, Serialize};

mod admin;
mod batch;
mod bounds;
mod cancellation;
mod claim;
mod complete;
mod done;
mod ending;
mod faults;
mod fingerprint;
mod lease;
mod model;
mod policies;
mod release;
mod store_errors;
mod unknown_outcomes;

pub use admin::*;
pub use batch::*;
pub use bounds::*;
pub use cancellation::*;
pub use claim::*;
pub use complete::*;
pub use done::*;
pub use ending::*;
pub use faults::*;
pub use fingerprint::*;
pub use lease::*;
pub use model::*;
pub use policies::*;
pub use release::*;
pub use store_errors::*;
pub use unknown_outcomes::*;

/// A backend under test.
pub trait Backend: Send + Sync + 'static {
    /// A key prefix that only this backend instance uses; the backend deletes everything
    /// under it when dropped.
    fn namespace(&self) -> &str;
    /// The store under test.
    fn store(&self) -> SharedStore;
    /// Loses every record whose key starts with `prefix`, as a restarted server without
    /// persistence would.
    fn lose_data<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, ()>;
    /// Whether in-progress, completed and mismatch answers carry the owner's fence. A tiered
    /// store answers duplicates from its front, whose fences are its own (only an acquired
    /// claim carries the authoritative back's fence): there only the kind of answer is checked.
    fn answers_carry_the_owners_fence(&self) -> bool {
        true
    }
}

/// A backend whose store has the operator's methods too: the operator's cases run on it.
pub trait OperatorBackend: Backend {
    /// The store under test, with the operator's methods: the same store as
    /// [`Backend::store`].
    fn operator_store(&self) -> SharedOperatorStore;
}

/// `backend` behind a [`CombiningStore`]: the suite on concurrent single calls sent as
/// batches.
pub struct Combined<B> {
    backend: B,
    store: SharedOperatorStore,
}

impl<B: OperatorBackend> Combined<B> {
    pub fn new(backend: B, max_in_flight: usize) -> Combined<B> {
        let store =
            std::sync::Arc::new(CombiningStore::new(backend.operator_store(), max_in_flight));
        Combined { backend, store }
    }
}

impl<B: OperatorBackend> OperatorBackend for Combined<B> {
    fn operator_store(&self) -> SharedOperatorStore {
        self.store.clone()
    }
}

impl<B: OperatorBackend> Backend for Combined<B> {
    fn namespace(&self) -> &str {
        self.backend.namespace()
    }
    fn store(&self) -> SharedStore {
        self.store.clone().into_store()
    }
    fn lose_data<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, ()> {
        self.backend.lose_data(prefix)
    }
    fn answers_carry_the_owners_fence(&self) -> bool {
        self.backend.answers_carry_the_owners_fence()
    }
}

/// Whether an answer's fence `seen` is the owner's fence `owner`, as far as `b` reports it.
fn same_fence(b: &impl Backend, seen: u64, owner: u64) -> bool {
    seen == owner || !b.answers_carry_the_owners_fence()
}

/// Asserts that `got` is `want`, fences included where `b` reports the owner's fence.
#[track_caller]
fn assert_answer(b: &impl Backend, got: Claim, want: Claim) {
    if b.answers_carry_the_owners_fence() {
        assert_eq!(got, want);
    } else {
        assert_eq!(
            std::mem::discriminant(&got),
            std::mem::discriminant(&want),
            "{got:?} is not {want:?}"
        );
    }
}

/// The handler error used by the suite.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
pub enum AppError {
    #[error("idempotency: {0}")]
    #[serde(skip)]
    Idem(String),
    #[error("business: {0}")]
    Business(String),
}

/// Keeps the framework's error inspectable in assertions.
#[derive(Debug, thiserror::Error)]
pub enum TestError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("business: {0}")]
    Business(String),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Idem(format!("{e:?}"))
    }
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A prefix no other case uses, under the backend's namespace.
pub fn unique_prefix(b: &impl Backend, case: &str) -> String {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{}:{case}:{n}", b.namespace())
}

/// A namespace no other backend instance (in this run or another) uses.
pub fn unique_namespace() -> String {
    let token = format!("{:?}", Token::generate());
    format!("conf:{}", &token[6..token.len() - 1])
}

pub fn key(prefix: &str, parts: &[&dyn idempotency::KeyPart]) -> Key {
    Key::new(prefix, 1, parts).unwrap()
}

pub fn guard(store: impl IntoStore) -> Idempotency {
    Idempotency::new(Duration::from_secs(60)).store(store)
}

pub fn req(key: &Key, lease: Duration) -> ClaimRequest {
    ClaimRequest::new(
        key.clone(),
        Token::generate(),
        lease,
        Duration::from_secs(60),
    )
}

/// Reads until `pred` holds, for effects that a store applies on a background task (a
/// release after cancellation). Fails after five seconds.
async fn eventually<S: Store + ?Sized>(
    store: &S,
    key: &Key,
    pred: impl Fn(&Option<Record>) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let record = store.read(key).await.unwrap();
        if pred(&record) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition never held; last record: {record:?}"
        );
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Calls `$callback!($($args)*; <every case name>)`: the list of the cases of the engine's
/// [`Store`], for every [`Backend`].
#[macro_export]
macro_rules! conformance_cases {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback!($($args)*;
            concurrent_duplicates_run_the_handler_exactly_once,
            concurrent_store_claims_acquire_exactly_once,
            fence_grows_by_one_on_every_acquisition,
            fences_grow_across_record_expiry,
            completed_key_is_a_duplicate_and_replays_its_result,
            expired_lease_is_taken_over_with_the_next_fence,
            a_claim_with_a_read_answers_as_the_two_calls,
            watchdog_keeps_a_slow_handler_owner,
            handler_that_outlives_its_lease_loses_ownership,
            complete_and_renew_check_the_token,
            completing_a_missing_record_is_refused,
            a_completion_naming_its_claim_is_decided_by_the_token,
            error_releases_and_the_retry_runs,
            release_never_removes_another_owners_claim,
            a_release_naming_its_claim_is_decided_by_the_token,
            held_error_blocks_the_key,
            stored_error_is_replayed,
            store_outage_fails_closed,
            store_outage_releases_nothing,
            done_fallback_survives_lost_store_data,
            done_fallback_answers_an_in_progress_claim,
            failing_done_check_runs_nothing,
            payload_mismatch_is_refused,
            payload_mismatch_is_refused_while_in_progress,
            dropped_future_gives_its_claim_back,
            lost_claim_reply_is_resolved_as_ours,
            lost_complete_reply_is_resolved_as_completed,
            wait_policy_returns_the_owners_result,
            wait_policy_gives_up_after_its_bound,
            skip_policy_drops_the_duplicate,
            completed_record_expires_after_its_ttl,
            keys_with_separators_stay_distinct,
            retried_claim_by_the_same_owner_is_acquired_again,
            batch_settles_each_item_by_its_own_outcome,
            concurrent_overlapping_batches_run_each_key_once,
            failed_completion_never_gives_the_claim_back,
            dropped_call_after_the_body_completes_its_outcome,
            dropped_call_during_the_claim_gives_it_back,
            held_failure_survives_a_store_blip,
            result_the_store_cannot_take_completes_without_it,
            out_of_range_durations_are_refused_before_the_store,
            body_reads_its_key_and_fence,
            lost_lease_is_signalled_to_the_body,
            a_batch_is_completed_in_one_call,
            a_slow_batch_item_does_not_hold_the_others,
            a_batch_dropped_while_settling_still_records_every_outcome,
            complete_many_answers_as_single_endings_would,
            a_batch_checks_payloads_replays_and_asks_done_per_item,
            a_batch_claim_that_answers_fewer_items_fails_the_rest,
            a_batch_claim_keeps_each_items_lease_and_lifetime,
            a_failed_batch_ending_is_recorded_item_by_item,
            a_batch_ending_that_never_answers_is_bounded_and_each_item_completes_alone,
            leases_are_renewed_while_a_batch_ending_is_in_flight,
            a_completion_that_never_answers_is_bounded_and_read_back,
            a_completion_lost_after_the_caller_got_ok_is_reported,
            a_batch_claim_that_never_answers_fails_closed_and_gives_back
        );
    };
}

/// Calls `$callback!($($args)*; <every case name>)`: the list of the cases of the operator's
/// [`OperatorStore`](idempotency::store::OperatorStore), for every [`OperatorBackend`].
#[macro_export]
macro_rules! operator_cases {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback!($($args)*;
            an_operator_frees_a_stuck_key_with_its_fence,
            an_operator_unholds_a_held_key,
            an_operator_lists_the_records_of_a_prefix,
            an_operator_deletes_records_and_purges_a_prefix,
            an_operator_never_deletes_a_claim_renewed_after_the_read,
            every_sequence_is_answered_as_the_in_memory_store_answers_it
        );
    };
}

/// One `#[tokio::test]` per conformance case, the engine's and the operator's:
/// `conformance_suite!(make)` where `make` is an async fn returning an
/// `impl OperatorBackend`.
#[macro_export]
macro_rules! conformance_suite {
    ($make:path) => {
        $crate::conformance_cases!(conformance_tests!($make));
        $crate::operator_cases!(conformance_tests!($make));
    };
}

/// One `#[tokio::test]` per case of the engine's [`Store`] only:
/// `store_conformance_suite!(make)` where `make` is an async fn returning an `impl Backend`
/// whose store has no operator's methods.
#[macro_export]
macro_rules! store_conformance_suite {
    ($make:path) => {
        $crate::conformance_cases!(conformance_tests!($make));
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! conformance_tests {
    ($make:path; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                conformance::$case($make().await).await;
            }
        )*
    };
}

/// Every conformance case, the engine's and the operator's, one after another, inside one
/// async context: for backends whose server is expensive to start (a cluster), started once
/// for the whole sequence.
#[macro_export]
macro_rules! conformance_sequence {
    ($make:expr) => {
        $crate::conformance_cases!(conformance_sequence_of!($make));
        $crate::operator_cases!(conformance_sequence_of!($make));
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! conformance_sequence_of {
    ($make:expr; $($case:ident),* $(,)?) => {
        $(
            eprintln!("conformance case: {}", stringify!($case));
            conformance::$case($make.await).await;
        )*
    };
}
