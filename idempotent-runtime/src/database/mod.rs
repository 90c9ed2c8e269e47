//! What the SQL store and the outbox share about a database: the facts that differ per
//! database (its name, whether a table name may carry a schema, the unit of durations in its
//! statements, what its error codes mean), validated table names, and sqlx errors as
//! [`StoreError`](crate::error::StoreError)s.
//!
//! Both the SQL store ([`SqlStore`](crate::sql::SqlStore)) and the outbox build on this
//! module; it knows neither of them.

use std::time::Duration;

use sqlx::error::DatabaseError;

mod error;
mod failure;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
mod table;

pub(crate) use error::{is_conflict, migrate_error, store_error, Phase};
pub(crate) use failure::DbFailure;
pub(crate) use table::TableName;

/// A SQL database the crate speaks, as far as the SQL store and the outbox share it: its
/// name is sqlx's [`Database::NAME`](sqlx::Database::NAME). Sealed: implemented for sqlx's
/// `Postgres`, `MySql` and `Sqlite` only, as the database features enable them.
#[allow(unreachable_pub)] // reachable as a supertrait of `Dialect`, but not nameable
pub trait SqlDatabase: sqlx::Database {
    /// Whether a table name may be `schema.table`.
    const SCHEMA_QUALIFIED: bool;
    /// The unit of durations in statements and of `lease_left` in record rows.
    const TICK: Duration;

    /// What a database error says about the failed statement.
    fn classify(err: &dyn DatabaseError) -> DbFailure;
}

/// `millis` milliseconds in `tick`s (a microsecond or a millisecond), saturating. The
/// milliseconds are a duration already rounded and clamped by the rule every store follows
/// ([`clamped_millis`](crate::store::clamped_millis)).
pub(crate) fn ticks(millis: u64, tick: Duration) -> i64 {
    let per_milli = (Duration::from_millis(1).as_nanos() / tick.as_nanos().max(1)).max(1);
    let ticks = u128::from(millis) * per_milli;
    i64::try_from(ticks).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn milliseconds_become_ticks() {
        let micro = Duration::from_micros(1);
        let milli = Duration::from_millis(1);
        assert_eq!(ticks(300, micro), 300_000);
        assert_eq!(ticks(2, milli), 2);
        assert_eq!(ticks(u64::MAX, micro), i64::MAX);
    }
}
