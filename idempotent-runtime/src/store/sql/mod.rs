//! SQL stores through [sqlx]: [`PostgresStore`], [`MySqlStore`] (MySQL and MariaDB) and
//! [`SqliteStore`], one generic [`SqlStore`] with a small sealed part per database.
//!
//! ```no_run
//! use std::{sync::Arc, time::Duration};
//! use idempotent_runtime::{Error, Idempotency, Key};
//! use idempotent_runtime::sql::PostgresStore;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Builds a pool and creates the table if it is missing.
//! let store = Arc::new(PostgresStore::connect("postgres://app@db/orders").await?);
//! let _purger = store.spawn_purger(Duration::from_secs(60), 1_000);
//!
//! let guard = Idempotency::new(Duration::from_secs(3600)).store(store.clone());
//! let key = Key::new("order:consume", 1, &[&"A-1001"])?;
//! let out: Result<(), Error> = guard.run(key, async { Ok(()) }).await;
//! # out?; Ok(()) }
//! ```
//!
//! A store is built as every backend's is: [`SqlStore::connect`]`(url)` with the defaults,
//! [`SqlStore::builder`]`(url)` and [`SqlStoreBuilder::build`] for other settings, or
//! [`SqlStore::from_pool`]`(pool)` and [`SqlStoreBuilder::build`] on the application's own
//! sqlx pool.
//!
//! # Schema
//!
//! One table (default `idempotent_records`, configurable with [`SqlStoreBuilder::table`]), one row
//! per key: the key as exact bytes (`BYTEA`, `VARBINARY` or `BLOB`: no collation, no case
//! folding) as the primary key, its readable prefix, the owner's token, the fence, the state
//! (`in_progress`, `completed`, `released`), the lease end, the stored result, the payload
//! fingerprint, and created / updated / expires timestamps, with an index on the expiry.
//! Every time comes from the database's clock (`statement_timestamp()` on PostgreSQL,
//! `UTC_TIMESTAMP(6)` on MySQL, `julianday('now')` in milliseconds on SQLite), never from
//! the client's. A row whose expiry has passed no longer exists for the store; it is deleted
//! by [`SqlStore::purge_expired`] or the task [`SqlStore::spawn_purger`] starts.
//!
//! # Migrations
//!
//! [`SqlStore::connect`] creates the table when it is missing: it runs
//! [`SqlStore::migrate`], which applies the embedded migrations with sqlx's migrator and
//! records them in a table next to the store's, `<table>_migrations` (never in your own
//! `_sqlx_migrations`). To manage the schema with your own migration tool instead, copy the
//! plain SQL files shipped in this crate's `migrations/postgres/`, `migrations/mysql/` and
//! `migrations/sqlite/` directories (written for the default table name) into your
//! migrations, and build the store with [`SqlStoreBuilder::migrate`]`(false)`.
//!
//! # Claims
//!
//! Each claim is one statement that takes the key only when its record is free (absent,
//! expired, released, or in progress with a run-out lease and no other payload); nothing
//! ever reads a record and then decides to write it.
//!
//! - **PostgreSQL**: `INSERT ... ON CONFLICT (record_key) DO UPDATE SET ... WHERE <free>
//!   RETURNING ...`, inside a `WITH` whose outer query also returns the record when the
//!   claim did not take it: one round trip whatever the outcome. `ON CONFLICT DO UPDATE`
//!   locks the conflicting row and tests `WHERE` on its latest version, so of any number of
//!   concurrent claims exactly one takes a free record.
//! - **MySQL / MariaDB**: MySQL has no `RETURNING`, so the claim is
//!   `INSERT ... ON DUPLICATE KEY UPDATE` with conditional assignments: InnoDB locks the
//!   duplicate row before the update part runs, the first assignment (`fence`) makes the
//!   "free" test on the record as it was and leaves the new fence, or 0, in
//!   `LAST_INSERT_ID()`, and the later assignments test that value (assignments run left to
//!   right). The statement reports an acquisition in its own reply through
//!   `LAST_INSERT_ID(fence)`. On MySQL that is the claim: one round trip for every
//!   acquisition, and a claim that did not take the key reads the record with a locking read
//!   (a second round trip, for duplicates only). On MariaDB 10.5 and later (read from
//!   `VERSION()` when the store is built) a shorter statement goes first: the same row,
//!   inserted when the key has none, with an `ON DUPLICATE KEY UPDATE` that writes nothing
//!   (`fence = fence + 0`, which also resets `LAST_INSERT_ID()` to 0). A fresh key, the
//!   common case, is acquired by it alone, in less server time than the full statement takes.
//!   When the key had a row, the full claim follows with `RETURNING`, so the record it took
//!   or met comes back in the same reply: two round trips for a duplicate or a takeover, and
//!   no read. Both statements lock the row like the claim does.
//! - **SQLite**: `INSERT ... ON CONFLICT DO UPDATE ... WHERE <free> RETURNING ...`; SQLite runs
//!   one writing statement at a time. A claim that did not take the key reads the record.
//!   `sqlite::memory:` is one database shared by the pool's connections, kept alive by a
//!   connection the pool never closes.
//!
//! The fence of an acquisition is [`next_fence`](crate::store::next_fence): one more than
//! the record's when the key has one (live, released, or a run-out lease taken over); the
//! database's clock in microseconds since the Unix epoch when it has none (SQLite's clock
//! counts milliseconds: its fence is those times 1,000); and for a record that expired but is
//! not purged yet, the higher of the two. Fences therefore keep growing across expiry.
//!
//! A record row the store cannot read (an unknown state, a token or fingerprint that is not
//! 16 bytes, a negative fence, a column of another type) is never taken, changed or treated
//! as free: every call on its key, claim, complete, release, renew and read, fails with
//! [`StoreErrorKind::Corrupt`] until it expires or an operator repairs or deletes it. In a
//! batch, only that key's item fails.
//!
//! # Batches
//!
//! [`Store::claim_many`] answers each item as [`Store::claim`] would, in the order given.
//! A key that appears more than once is claimed once, by its first occurrence, in the batch;
//! its later occurrences are then claimed one by one, and meet the first one's claim as
//! separate claims would. The distinct keys are sent in key order, at most 500 per statement.
//!
//! - **PostgreSQL**: one statement per 500 keys, whatever the outcomes: the claim statement
//!   over `unnest` of six bound arrays (`INSERT ... SELECT ... FROM input ON CONFLICT
//!   (record_key) DO UPDATE SET ... WHERE <free> RETURNING record_key, ...`), with a
//!   `UNION ALL` branch that reports the records of the keys it did not take. Sorting the keys
//!   makes concurrent overlapping batches lock their rows in the same order. The batch
//!   statements find their rows by `record_key = ANY(keys)` and test expiry as
//!   `expires_at - now > 0`, so that every plan of them, the generic plan a connection keeps
//!   included, looks the keys up by primary key and never scans the table or the
//!   `expires_at` index, whatever the table's statistics.
//! - **SQLite**: per 500 keys, the claim statement over a `VALUES` list of bound rows, then
//!   one read of the keys it did not take (two statements on one connection, in autocommit
//!   like the single claim: SQLite has one writer at a time and no round trips).
//! - **MySQL / MariaDB**: per 500 keys, the claim statement with one `VALUES` row per key
//!   (each row's `ON DUPLICATE KEY UPDATE` tests and takes its own record, as the single
//!   claim does). On MariaDB 10.5 and later it returns every key's record (`RETURNING`): one
//!   statement. On MySQL one read of the batch's records follows it. A record in progress
//!   with the item's token is its acquisition.
//!
//! As for a single claim, an item whose reported record is free is claimed again on its own.
//! A batch statement that fails fails all of its items, with the error's kind.
//!
//! [`Store::complete_many`] ends (completes or releases) distinct keys with one statement
//! per 500 items (and per 4 MiB of results), in key order, on every database; a statement's
//! worth of one item is sent as that item's own completion or release, which the database
//! runs for less (a `CombiningStore` on an idle store sends batches of one):
//!
//! - **PostgreSQL**: `UPDATE ... FROM unnest(<five bound arrays>) ... RETURNING record_key`:
//!   each item ended as the single completion or release would, the ended keys returned.
//! - **SQLite**: the same `UPDATE ... FROM` over a `VALUES` list of bound rows.
//! - **MySQL / MariaDB**: a multiple-table `UPDATE ... JOIN (SELECT ? ... UNION ALL ...)` of
//!   the in-progress records; when it changed fewer rows than it was given, one read of the
//!   batch's records tells which items it ended (a record already completed by its token
//!   counts as completed, as for a retried single completion).
//!
//! An item the statement did not resolve is answered as a single write that matched nothing
//! (`false`, or [`StoreErrorKind::Corrupt`] for a record it
//! cannot read); later occurrences of a key and results larger than the store takes are
//! ended one by one.
//!
//! When the record a claim reports is free although the claim did not take it (it changed
//! between the write and the report: a concurrent first insert, a release), the claim
//! applied nothing for its token and is sent again. Every other answer is what an atomic
//! claim at the moment of the report returns. A claim sent again with the same token (a retry
//! after a lost reply) finds its own record and answers [`Claim::Acquired`] with its fence.
//!
//! Completion, release and renewal are single `UPDATE`s that check the token (and, for
//! release and renewal, that the record is in progress), so no one else's record is ever
//! changed. A released record keeps its fence.
//!
//! # In the business transaction
//!
//! [`SqlStore::run_in_tx`] (and the primitives [`SqlStore::claim_in`],
//! [`SqlStore::complete_in`], [`SqlStore::release_in`]) claim and complete inside the
//! caller's own sqlx transaction, so the record commits or rolls back with the business
//! change: a rolled-back transaction leaves the key claimable, a committed one makes every
//! later call a duplicate. While the transaction is open its claim holds the record's row
//! lock, so a concurrent duplicate waits for the commit (and then meets the completed record)
//! or the rollback (and then claims the key itself). Use the default `READ COMMITTED`
//! isolation on PostgreSQL: under `REPEATABLE READ` or `SERIALIZABLE` a concurrent duplicate
//! fails with a serialization error instead of waiting.
//!
//! # Durations and results
//!
//! Leases and ttls are sent in whole milliseconds, rounded up and clamped to
//! [`MIN_DURATION`] ..= [`MAX_DURATION`] ([`clamped_millis`](crate::store::clamped_millis)),
//! as on every store: `Duration::MAX` means 36,500 days.
//!
//! A stored result is at most [`Store::max_result_size`] bytes ([`SqlStoreBuilder::max_result_size`],
//! 1 MiB by default, never more than the database takes); [`Store::complete`] refuses a
//! larger one with [`StoreErrorKind::Rejected`] without sending it.
//!
//! # Errors
//!
//! A connection that cannot be had (server down, pool exhausted past its acquire timeout) is
//! [`StoreErrorKind::Unavailable`], as is a statement the server aborted (shutdown, deadlock,
//! serialization failure; autocommit statements are retried a few times first). An I/O error
//! after a writing statement was sent is [`StoreErrorKind::OutcomeUnknown`]: the engine reads
//! the record back by token. A statement the database refuses for good is
//! [`StoreErrorKind::Rejected`]: a value too large (MySQL's "packet bigger than
//! `max_allowed_packet`", 1153, although its SQLSTATE is the connection class 08), data too
//! long or out of range (SQLSTATE class 22), a constraint (class 23), a program limit (class
//! 54), SQLite's `TOOBIG`, `CONSTRAINT` and `MISMATCH`. A record that cannot be read is
//! [`StoreErrorKind::Corrupt`]. A read-only database is [`StoreErrorKind::Unsafe`]; any other
//! database error (a missing table, say) is [`StoreErrorKind::Protocol`]. The sqlx error is
//! always the [`source`](std::error::Error::source).

#[cfg(doc)]
use crate::error::StoreErrorKind;
#[cfg(doc)]
use crate::store::{Claim, Store, MAX_DURATION, MIN_DURATION};

mod bind;
mod builder;
mod by_key;
pub(crate) mod dialect;
mod exec;
mod migrate;
mod purge;
mod record;
mod store;
mod tx;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use builder::SqlStoreBuilder;
pub use dialect::{Dialect, Statements};
pub use purge::Purger;
pub use store::SqlStore;

/// The table of records used when none is configured.
pub const DEFAULT_TABLE: &str = "idempotent_records";

/// The sqlx this crate is built with, so the pools and transactions you pass in have the
/// same type.
pub use sqlx;

/// The idempotency store on PostgreSQL.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub type PostgresStore = SqlStore<sqlx::Postgres>;

/// The idempotency store on MySQL or MariaDB.
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub type MySqlStore = SqlStore<sqlx::MySql>;

/// The idempotency store on SQLite, in a file or in memory.
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub type SqliteStore = SqlStore<sqlx::Sqlite>;
