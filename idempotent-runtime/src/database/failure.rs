//! What a database's own error code says about a failed statement, shared by the databases
//! (which read the code) and the error mapping (which turns it into a [`StoreErrorKind`]).
//!
//! [`StoreErrorKind`]: crate::StoreErrorKind

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
