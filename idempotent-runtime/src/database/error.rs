//! sqlx errors as [`StoreError`]s: the right [`StoreErrorKind`], the sqlx error kept as the
//! source.

use sqlx::migrate::MigrateError;

use crate::database::{DbFailure, SqlDatabase};
use crate::error::{StoreError, StoreErrorKind};

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

/// Converts a sqlx error met during `what` (`"claim"`, `"complete"`...).
pub(crate) fn store_error<D: SqlDatabase>(
    err: sqlx::Error,
    phase: Phase,
    what: &str,
) -> StoreError {
    let kind = kind::<D>(&err, phase);
    StoreError::new(
        kind,
        format!("{} {what} failed", <D as sqlx::Database>::NAME),
    )
    .with_source(err)
}

/// Whether an autocommit statement that failed with `err` was rolled back by a conflict and
/// may be sent again.
pub(crate) fn is_conflict<D: SqlDatabase>(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .is_some_and(|db| D::classify(db) == DbFailure::Conflict)
}

/// Converts a migration failure.
pub(crate) fn migrate_error<D: SqlDatabase>(err: MigrateError) -> StoreError {
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

fn kind<D: SqlDatabase>(err: &sqlx::Error, phase: Phase) -> StoreErrorKind {
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
