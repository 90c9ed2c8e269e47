//! PostgreSQL's facts: schema-qualified table names, microseconds, SQLSTATEs.

use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::postgres::Postgres;

use crate::database::failure::{sqlstate, DbFailure};
use crate::database::SqlDatabase;

impl SqlDatabase for Postgres {
    const SCHEMA_QUALIFIED: bool = true;
    const TICK: Duration = Duration::from_micros(1);

    fn classify(err: &dyn DatabaseError) -> DbFailure {
        err.code().map_or(DbFailure::Other, |code| sqlstate(&code))
    }
}
