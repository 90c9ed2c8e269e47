//! SQLite's facts: plain table names, milliseconds, its result codes.

use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::sqlite::Sqlite;

use crate::database::failure::DbFailure;
use crate::database::SqlDatabase;

impl SqlDatabase for Sqlite {
    const SCHEMA_QUALIFIED: bool = false;
    const TICK: Duration = Duration::from_millis(1);

    fn classify(err: &dyn DatabaseError) -> DbFailure {
        // The primary result code is the low byte of the extended one.
        let code = err.code().and_then(|code| code.parse::<i64>().ok());
        match code.map(|code| code & 0xff) {
            // SQLITE_BUSY, SQLITE_LOCKED: another connection holds the lock
            Some(5 | 6) => DbFailure::Conflict,
            // SQLITE_READONLY
            Some(8) => DbFailure::ReadOnly,
            // SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN
            Some(10 | 13 | 14) => DbFailure::Unavailable,
            // SQLITE_TOOBIG, SQLITE_CONSTRAINT (checks, triggers' RAISE(ABORT)), SQLITE_MISMATCH
            Some(18..=20) => DbFailure::Rejected,
            _ => DbFailure::Other,
        }
    }
}
