//! Exactly-once effects for message consumers and HTTP handlers: one attribute on an async
//! handler, and every retry, redelivery or double click has its effect once.
//!
//! The first call claims the operation's key in one atomic store operation, runs the handler
//! under a renewed lease, and records the outcome; duplicates are filtered (or get the first
//! result replayed); a handler error gives the claim back so a redelivery can run; a crashed
//! owner's claim is taken over when its lease runs out; a store outage fails closed.
//!
//! ```
//! use std::sync::Arc;
//! use idempotency::{idempotent, MemoryStore};
//!
//! struct OrderMessage { order_id: String, activity_id: u32 }
//!
//! #[derive(Debug, thiserror::Error)]
//! enum AppError {
//!     #[error(transparent)]
//!     Idempotency(#[from] idempotency::Error),
//! }
//!
//! // The key is the business unit (order + activity), not the message id.
//! #[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.activity_id], ttl = 3600)]
//! async fn on_order(msg: &OrderMessage) -> Result<(), AppError> {
//!     // grant the coupon, capture the payment ...
//!     Ok(())
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! idempotency::set_default_store(Arc::new(MemoryStore::new()))?;
//! let msg = OrderMessage { order_id: "A-1001".into(), activity_id: 7 };
//! on_order(&msg).await?;                     // runs
//! let duplicate = on_order(&msg).await;      // filtered: the consumer acknowledges it
//! assert!(matches!(duplicate, Err(AppError::Idempotency(e)) if e.is_duplicate()));
//! # Ok(()) }
//! ```
//!
//! # The pieces
//!
//! - [`#[idempotent]`](macro@idempotent): the attribute, with every argument documented
//!   (`ttl`, `lease`, `on_in_progress`, `on_error`, `fingerprint`, `done`, `replay`, ...).
//! - [`Idempotency`] and [`Operation`]: the same machinery without the attribute, for closures and
//!   keys computed at run time; [`Idempotency::run_batch`] claims many keys in one round trip
//!   ([`Batch`]).
//! - [`current()`]: inside a handler, the claim's key and **fence**, to make the resource
//!   refuse a stale owner (`... WHERE fence < $fence`), and a lost-lease signal.
//! - [`Error`] and [`Error::action`]: every outcome as an [`Action`]: ack, redeliver or
//!   dead-letter.
//! - The policies: [`OnInProgress`], [`OnError`], [`OnStoreError`], [`OnLostLease`].
//! - The stores: [`connect`] and [`set_default_store`] (or [`with_default_store`] in tests),
//!   [`MemoryStore`]; a [`Key`] is built from [`KeyPart`]s.
//!
//! Everything else lives in a module of its own:
//!
//! | module | feature | what |
//! |---|---|---|
//! | [`store`] | | the [`store::Store`] trait and its records, for backends and tests; [`TieredStore`](store::TieredStore), [`CombiningStore`](store::CombiningStore) |
//! | [`memory`] | `memory` (default) | the in-memory store's builder and clocks ([`ManualClock`](memory::ManualClock) for tests) |
//! | `redis` | `redis` | `RedisStore`, standalone or Cluster |
//! | `sql` | `postgres`, `mysql`, `sqlite` | `PostgresStore`, `MySqlStore`, `SqliteStore`; claims in the business transaction (`run_in_tx`) |
//! | `outbox` | `postgres`, `mysql`, `sqlite` | the transactional outbox and its relay |
//! | `broker` | `rabbitmq`, `nats` | consume loops that settle each message by its outcome |
//! | `http` | `http` | `IdempotencyLayer`: HTTP `Idempotency-Key` for tower and axum |
//! | `grpc` | `grpc` | the attribute on tonic methods: prost replies replayed, outcomes as gRPC statuses; `IdempotencyLayer` keyed by metadata; `DetachLayer` |
//! | [`lock`] | | [`Lock`](lock::Lock), a fenced lease lock on any store |
//! | [`admin`] | | the operator's side: inspect, list, release, delete, purge |
//! | [`key`] | | key errors and limits |
//! | [`state`] | | the types in [`Operation`]'s and [`Batch`]'s signatures |
//!
//! With the feature `metrics`, the engine and the stores count and time every call through
//! the [`metrics`](https://docs.rs/metrics) facade; the series are listed in the repository's
//! `docs/guide/operating.md`.
//!
//! # Choosing a store
//!
//! | store | feature | for |
//! |---|---|---|
//! | [`MemoryStore`] | `memory` (default) | tests, demos, one process |
//! | `redis::RedisStore` | `redis` | a shared, fast window (standalone or Cluster) |
//! | `sql::PostgresStore`, `MySqlStore`, `SqliteStore` | `postgres`, `mysql`, `sqlite` | durable records, claims inside the business transaction (`run_in_tx`) |
//! | [`store::TieredStore`] | any two | Redis in front of SQL |
//! | [`store::CombiningStore`] | any | concurrent single calls sent as batches (one commit for many on PostgreSQL) |
//!
//! [`connect`] builds any of them from a URL (`redis://`, `redis+sentinel://`, `postgres://`, `mysql://`,
//! `sqlite:`, `memory:`). A store is a hint, not the truth: Redis loses acknowledged writes on
//! failover and restart, so exactly-once *effects* also need a check at the effect (the `done`
//! business check, a status compare-and-set, or the fence).
//!
//! # Guarantees
//!
//! The contract, rule by rule with the test that shows each, is `docs/semantics.md` in the
//! repository; every backend runs one conformance suite, and a deterministic simulation
//! checks the engine under store faults, lost replies and cancellation at every await point.
//!
//! This crate re-exports `idempotent-runtime` (the engine and stores) and `idempotent-macros`
//! (the attribute). The attribute expands to paths under `::idempotency`; with a renamed
//! dependency, or with `idempotent-runtime` used directly, say where the runtime is with
//! `crate = path`.
#![cfg_attr(docsrs, feature(doc_cfg))]

// The everyday names: the attribute, its errors and policies, the builder API, the default
// store.
pub use idempotent_macros::idempotent;
pub use idempotent_runtime::{
    connect, current, default_store, on_completion_lost, set_default_store, with_default_store,
    Action, Batch, CompletionLost, Current, Error, Idempotency, Key, KeyPart, LossReason, OnError,
    OnInProgress, OnLostLease, OnStoreError, Operation, SharedStore,
};

#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub use idempotent_runtime::MemoryStore;

pub mod key {
    //! What a [`Key`](crate::Key) may hold: the error of a key that breaks a limit, and the
    //! limits.

    pub use idempotent_runtime::key::{
        KeyError, MAX_INLINE_PARTS, MAX_KEY_LEN, MAX_PARTS, MAX_PART_LEN, MAX_PREFIX_LEN,
    };
}

pub mod state {
    //! The types in the signatures of an [`Operation`](crate::Operation) and a
    //! [`Batch`](crate::Batch): what a handler returns, and whether a business-status check
    //! ([`Operation::done`](crate::Operation::done)) was given. Nothing here is built by hand.

    pub use idempotent_runtime::state::*;
    pub use idempotent_runtime::HandlerResult;
}

pub mod store {
    //! The [`Store`] trait and what its methods take and return: for writing a backend, for
    //! tests that drive a store directly, and for the stores that wrap others
    //! ([`TieredStore`], [`CombiningStore`]).
    //!
    //! [`connect`](crate::connect), [`SharedStore`](crate::SharedStore) and
    //! [`MemoryStore`](crate::MemoryStore) are at the crate root; each backend has its module
    //! (`memory`, `redis`, `sql`).

    // Every public item of `idempotent_runtime::store` but `connect`, `SharedStore` and the
    // backends' modules (which are at the crate root) is listed here: a trait or type added
    // to the runtime's `store` belongs in this list.
    pub use idempotent_runtime::store::{
        claim_answer, clamped_millis, next_fence, AcquiredClaim, BoxFuture, Claim, ClaimAnswer,
        ClaimRequest, CombiningStore, Completion, ConnectError, End, Ending, Expect, Fingerprint,
        IntoOperatorStore, IntoStore, OperatorStore, Record, RecordState, ScanCursor, ScanPage,
        SharedOperatorStore, Store, TieredStore, Token, DEFAULT_MAX_RESULT_SIZE, MAX_DURATION,
        MIN_DURATION,
    };
    pub use idempotent_runtime::{AlreadySet, StoreError, StoreErrorKind};
}

#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub mod memory {
    //! The in-memory store's builder and clocks; the store itself is
    //! [`MemoryStore`](crate::MemoryStore). A [`ManualClock`] makes lease and expiry tests
    //! instant and exact.

    pub use idempotent_runtime::memory::{Clock, ManualClock, MemoryStoreBuilder, SystemClock};
}

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use idempotent_runtime::redis;

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite")))
)]
pub use idempotent_runtime::{outbox, sql};

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "rabbitmq", feature = "nats"))))]
pub use idempotent_runtime::broker;

#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub use idempotent_runtime::http;

#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub use idempotent_runtime::grpc;

pub mod lock {
    //! [`Lock`]: a fenced lease lock on any store, for update-type operations that must not
    //! run at the same time but may run again (deduct a balance, rebuild a cache entry).

    pub use idempotent_runtime::{Lock, LockGuard};
}

pub use idempotent_runtime::admin;

// What the attribute's expansion calls (`::idempotency::__private::...`); not a public API.
#[doc(hidden)]
pub use idempotent_runtime::__private;

// The repository's README, compiled as a doctest so its examples never rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

// The guide's chapters (`docs/guide/`), compiled as doctests as the README is.
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/handlers.md")]
struct GuideHandlers;

#[cfg(doctest)]
#[doc = include_str!("../docs/guide/contract.md")]
struct GuideContract;

#[cfg(doctest)]
#[doc = include_str!("../docs/guide/stores.md")]
struct GuideStores;

#[cfg(doctest)]
#[doc = include_str!("../docs/guide/consumers.md")]
struct GuideConsumers;

#[cfg(doctest)]
#[doc = include_str!("../docs/guide/http.md")]
struct GuideHttp;

#[cfg(doctest)]
#[doc = include_str!("../docs/guide/grpc.md")]
struct GuideGrpc;

#[cfg(doctest)]
#[doc = include_str!("../docs/guide/locks-and-outbox.md")]
struct GuideLocksAndOutbox;

#[cfg(doctest)]
#[doc = include_str!("../docs/guide/operating.md")]
struct GuideOperating;

#[cfg(doctest)]
#[doc = include_str!("../docs/guide/performance.md")]
struct GuidePerformance;

#[cfg(doctest)]
#[doc = include_str!("../docs/guide/repository.md")]
struct GuideRepository;
