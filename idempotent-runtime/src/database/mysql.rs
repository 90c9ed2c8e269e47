//! MySQL's and MariaDB's facts: plain table names, microseconds, SQLSTATEs and the server
//! error numbers whose SQLSTATE does not say what they mean.

use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::mysql::{MySql, MySqlDatabaseError};

use crate::database::failure::{sqlstate, DbFailure};
use crate::database::SqlDatabase;

impl SqlDatabase for MySql {
    const SCHEMA_QUALIFIED: bool = false;
    const TICK: Duration = Duration::from_micros(1);

    fn classify(err: &dyn DatabaseError) -> DbFailure {
        let number = err
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number);
        number
            .and_then(by_number)
            .unwrap_or_else(|| err.code().map_or(DbFailure::Other, |code| sqlstate(&code)))
    }
}

/// The server error numbers whose SQLSTATE does not say what they mean.
fn by_number(number: u16) -> Option<DbFailure> {
    Some(match number {
        // ER_LOCK_WAIT_TIMEOUT (the statement was rolled back), ER_LOCK_DEADLOCK
        1205 | 1213 => DbFailure::Conflict,
        // ER_OPTION_PREVENTS_STATEMENT (--read-only), ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION
        1290 | 1792 => DbFailure::ReadOnly,
        // ER_SERVER_SHUTDOWN, ER_QUERY_INTERRUPTED, ER_CON_COUNT_ERROR,
        // ER_CONNECTION_KILLED (MariaDB)
        1053 | 1317 | 1040 | 1927 => DbFailure::Unavailable,
        // ER_NET_PACKET_TOO_LARGE: the statement is larger than `max_allowed_packet` (SQLSTATE
        // 08S01, as for a lost connection; the server closes the connection after it).
        // ER_WARN_ALLOWED_PACKET_OVERFLOWED, ER_TOO_BIG_ROWSIZE,
        // ER_TRUNCATED_WRONG_VALUE_FOR_FIELD, ER_CHECK_CONSTRAINT_VIOLATED (MySQL; MariaDB's
        // ER_CONSTRAINT_FAILED is SQLSTATE 23000)
        1153 | 1301 | 1118 | 1366 | 3819 => DbFailure::Rejected,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permanent_errors_are_rejections() {
        // Seen from MariaDB 10.11: a result above `max_allowed_packet` is 1153 with SQLSTATE
        // 08S01, which alone would read as a lost connection.
        assert_eq!(by_number(1153), Some(DbFailure::Rejected));
        assert_eq!(sqlstate("08S01"), DbFailure::Unavailable);
        assert_eq!(by_number(1213), Some(DbFailure::Conflict));
        assert_eq!(by_number(1406), None);
        assert_eq!(sqlstate("22001"), DbFailure::Rejected);
    }
}
