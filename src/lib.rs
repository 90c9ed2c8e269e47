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
//!   keys computed at run time; [`Idempotency::run_batch`] claims many keys in one round trip.
//! - [`current()`]: inside a handler, the claim's key and **fence**, to make the resource
//!   refuse a stale owner (`... WHERE fence < $fence`), and a lost-lease signal.
//! - [`Error`] and [`Error::action`]: every outcome as ack, redeliver or dead-letter;
//!   [`broker`] settles RabbitMQ and NATS messages from it (features `rabbitmq`, `nats`).
//!
//! # Choosing a store
//!
//! | store | feature | for |
//! |---|---|---|
//! | [`MemoryStore`] | `memory` (default) | tests, demos, one process |
//! | `RedisStore` | `redis` | a shared, fast window (standalone or Cluster) |
//! | `sql::PostgresStore`, `MySqlStore`, `SqliteStore` | `postgres`, `mysql`, `sqlite` | durable records, claims inside the business transaction (`run_in_tx`) |
//! | [`store::TieredStore`] | any two | Redis in front of SQL |
//! | [`store::CombiningStore`] | any | concurrent single calls sent as batches (one commit for many on PostgreSQL) |
//!
//! [`connect`] builds any of them from a URL (`redis://`, `postgres://`, `mysql://`,
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

pub use idempotent_macros::idempotent;
pub use idempotent_runtime::*;

// The repository's README, compiled as a doctest so its examples never rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
