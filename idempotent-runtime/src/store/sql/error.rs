//! sqlx errors as [`StoreError`]s: the right [`StoreErrorKind`], the sqlx error kept as the
//! source.

use sqlx::migrate::MigrateError;

use crate::error::{StoreError, StoreErrorKind};
use crate::store::sql::driver::Driver;

/// Where a failure happened, which decides what an I/O error means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Getting a connection: nothing was sent.
    Connect,
    /// A statement that writes: an I/O error may come after the database applied it.
    Write,
    /// A statement that only reads: there is no outcome to lose.
    Read,
}

/// What a database's own error code says about a failed statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbFailure {
    /// The statement (or its transaction) was rolled back by a conflict: a deadlock, a
    /// serialization failure, a lock wait that timed out, a busy database. Sending an
    /// autocommit statement again is safe.
    Conflict,
    /// The server refused or aborted the statement without applying it: shutting down, out of
    /// connections or resources, the statement cancelled.
    Unavailable,
    /// The database is read-only (a replica, a read-only transaction).
    ReadOnly,
    /// The database refused this statement for good, without applying it: a value too large
    /// for the server or a column, data of the wrong type or out of range, a constraint.
    /// Sending it again fails the same way.
    Rejected,
    /// Anything else: a missing table or column, a syntax error, an internal error.
    Other,
}

/// Classifies a SQLSTATE, for the databases that report one (PostgreSQL, MySQL).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn sqlstate(code: &str) -> DbFailure {
    match code {
        // serialization_failure, deadlock_detected, lock_not_available
        "40001" | "40P01" | "55P03" => DbFailure::Conflict,
        // read_only_sql_transaction
        "25006" => DbFailure::ReadOnly,
        // data exceptions (string data right truncation, numeric value out of range, invalid
        // values), integrity constraint violations, program limits exceeded (a row too big)
        _ if ["22", "23", "54"]
            .iter()
            .any(|class| code.starts_with(class)) =>
        {
            DbFailure::Rejected
        }
        // connection exceptions, insufficient resources, operator intervention (shutdown,
        // cancelled statements), and the rest of "transaction rollback"
        _ if ["08", "53", "57", "40"]
            .iter()
            .any(|class| code.starts_with(class)) =>
        {
            DbFailure::Unavailable
        }
        _ => DbFailure::Other,
    }
}

/// Converts a sqlx error met during `what` (`"claim"`, `"complete"`...).
pub(crate) fn store_error<D: Driver>(err: sqlx::Error, phase: Phase, what: &str) -> StoreError {
    let kind = kind::<D>(&err, phase);
    StoreError::new(
        kind,
        format!("{} {what} failed", <D as sqlx::Database>::NAME),
    )
    .with_source(err)
}

/// Whether an autocommit statement that failed with `err` was rolled back by a conflict and
/// may be sent again.
pub(crate) fn is_conflict<D: Driver>(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .is_some_and(|db| D::classify(db) == DbFailure::Conflict)
}

/// Converts a migration failure.
pub(crate) fn migrate_error<D: Driver>(err: MigrateError) -> StoreError {
    let kind = match &err {
        MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _) => {
            kind::<D>(e, Phase::Write)
        }
        _ => StoreErrorKind::Protocol,
    };
    StoreError::new(
        kind,
        format!("{} migration failed", <D as sqlx::Database>::NAME),
    )
    .with_source(err)
}

fn kind<D: Driver>(err: &sqlx::Error, phase: Phase) -> StoreErrorKind {
    if phase == Phase::Connect {
        return StoreErrorKind::Unavailable;
    }
    match err {
        // A record row whose columns do not decode (a value of another type, written by hand
        // or by something else).
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => StoreErrorKind::Corrupt,
        // A value the driver cannot send.
        sqlx::Error::Encode(_) => StoreErrorKind::Rejected,
        sqlx::Error::Io(_) if phase == Phase::Write => StoreErrorKind::OutcomeUnknown,
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Configuration(_) => StoreErrorKind::Unavailable,
        sqlx::Error::Database(db) => match D::classify(&**db) {
            DbFailure::Conflict | DbFailure::Unavailable => StoreErrorKind::Unavailable,
            DbFailure::ReadOnly => StoreErrorKind::Unsafe,
            DbFailure::Rejected => StoreErrorKind::Rejected,
            DbFailure::Other => StoreErrorKind::Protocol,
        },
        _ => StoreErrorKind::Protocol,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    fn sqlstates_are_classified() {
        assert_eq!(sqlstate("40001"), DbFailure::Conflict);
        assert_eq!(sqlstate("40P01"), DbFailure::Conflict);
        assert_eq!(sqlstate("25006"), DbFailure::ReadOnly);
        assert_eq!(sqlstate("57P01"), DbFailure::Unavailable);
        assert_eq!(sqlstate("08006"), DbFailure::Unavailable);
        assert_eq!(sqlstate("53300"), DbFailure::Unavailable);
        // Seen from PostgreSQL: a check constraint, a bigint overflow. From MariaDB: data too
        // long for a column (1406), a check constraint (4025).
        assert_eq!(sqlstate("23514"), DbFailure::Rejected);
        assert_eq!(sqlstate("22003"), DbFailure::Rejected);
        assert_eq!(sqlstate("22001"), DbFailure::Rejected);
        assert_eq!(sqlstate("23000"), DbFailure::Rejected);
        assert_eq!(sqlstate("23505"), DbFailure::Rejected);
        assert_eq!(sqlstate("54000"), DbFailure::Rejected);
        assert_eq!(sqlstate("42P01"), DbFailure::Other);
        assert_eq!(sqlstate("XX000"), DbFailure::Other);
    }
}
