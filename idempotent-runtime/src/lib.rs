//! The runtime behind the `#[idempotent]` attribute: key encoding, the [`Store`] trait and
//! its backends, and the claim → run → complete / release engine.
//!
//! Most users depend on the `idempotency` crate, which re-exports this one together with the
//! attribute. Use this crate directly for the builder API ([`Idempotency`], [`Operation`]) or to
//! write a backend.
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use idempotent_runtime::{Error, Idempotency, Key, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Error> {
//! let orders = Idempotency::new(Duration::from_secs(3600)).store(Arc::new(MemoryStore::new()));
//! let key = Key::new("order:consume", 1, &[&"A-1001", &"spring-sale"])?;
//! let effect: Result<&str, Error> = orders.run(key, async { Ok("consumed") }).await;
//! assert_eq!(effect?, "consumed");
//! # Ok(()) }
//! ```
//!
//! # Features
//!
//! - `memory` (default): [`MemoryStore`], the embedded store.
//! - `redis`: `RedisStore`, on a standalone Redis or a Redis Cluster.
//! - `postgres`, `mysql`, `sqlite`: SQL stores through sqlx (`sql`), and the transactional
//!   outbox (`outbox`).
//! - `rabbitmq`: RabbitMQ consumers through lapin (`broker::rabbitmq`), and the outbox's
//!   RabbitMQ publisher.
//! - `nats`: NATS JetStream consumers through async-nats (`broker::nats`), and the outbox's
//!   JetStream publisher.
//! - `http`: HTTP `Idempotency-Key`, a tower layer for axum and other tower stacks (`http`).
//! - `grpc`: gRPC through tonic (`grpc`): replies of prost messages replayed, outcomes as
//!   gRPC statuses, and a tower layer keyed by `idempotency-key` metadata.
//! - `metrics`: counters and histograms through the `metrics` facade (the series are listed
//!   in [`metrics`]); the application installs the recorder.
//!
//! [`connect`] builds any of the stores from a URL.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod admin;
mod codec;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod database;
mod default_store;
mod engine;
mod error;
pub mod key;
pub mod metrics;
mod policy;
pub mod store;

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub mod broker;

#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http;

#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub mod grpc;

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite")))
)]
pub mod outbox;

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod in_tx;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;

pub use default_store::{default_store, set_default_store, with_default_store, AlreadySet};
pub use engine::{
    current, on_completion_lost, state, Batch, CompletionLost, Current, HandlerResult, Idempotency,
    Lock, LockGuard, LossReason, Operation,
};
pub use error::{Action, Error, StoreError, StoreErrorKind};
pub use key::{Key, KeyError, KeyPart};
pub use policy::{OnError, OnInProgress, OnLostLease, OnStoreError};
pub use store::{
    AcquiredClaim, BoxFuture, Claim, ClaimRequest, Completion, Fingerprint, IntoStore, Record,
    RecordState, SharedStore, Store, Token,
};

#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub use store::memory::{self, MemoryStore};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::redis::{self, RedisStore};
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite")))
)]
pub use store::sql;
pub use store::{connect, ConnectError};
