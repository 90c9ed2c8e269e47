//! Opening the store. Record commands never change the schema: an SQL store is built
//! without its migration, and a missing records table is reported with how to create it
//! (no SQLite file is created either); only `migrate` creates the table. Failures keep their
//! cause chain (refused, wrong password, unknown database), and a URL that names no backend
//! or does not parse is bad input.

use std::error::Error;
use std::sync::Arc;

use idempotency::sql::sqlx;
use idempotency::sql::{MySqlStore, PostgresStore, SqliteStore};
use idempotency::store::{ConnectError, SharedOperatorStore, StoreError, StoreErrorKind};

use crate::Failure;

/// `err` and its causes, joined by `: `.
pub(crate) fn chain(err: &(dyn Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Whether a cause of `err` is a URL or setting sqlx could not parse.
fn is_configuration(err: &(dyn Error + 'static)) -> bool {
    let mut source = Some(err);
    while let Some(cause) = source {
        if let Some(sqlx::Error::Configuration(_)) = cause.downcast_ref::<sqlx::Error>() {
            return true;
        }
        source = cause.source();
    }
    false
}

/// A failure to open the store: bad input for a URL or table name that cannot be used,
/// the store's failure otherwise; with the cause chain.
fn open_failure(err: StoreError) -> Failure {
    let text = format!("cannot open the store: {}", chain(&err));
    if err.kind() == StoreErrorKind::Unsafe || is_configuration(&err) {
        Failure::Input(text)
    } else {
        Failure::Store(text)
    }
}

/// Builds an SQL store on `url` (and `table`), migrating it only when `migrate`.
macro_rules! sql_builder {
    ($store:ty, $url:expr, $table:expr, $migrate:expr) => {{
        let mut builder = <$store>::builder($url).migrate($migrate);
        if let Some(table) = $table {
            builder = builder.table(table.to_string());
        }
        builder.build().await.map_err(open_failure)?
    }};
}

/// Opens the store at `url`, on `table` for an SQL store, migrating only when `migrate`:
/// a store with the operator's methods, as every command needs.
pub(crate) async fn open(
    url: &str,
    table: Option<&str>,
    migrate: bool,
) -> Result<SharedOperatorStore, Failure> {
    let scheme = url.split(':').next().unwrap_or_default();
    match scheme {
        "postgres" | "postgresql" => {
            reach::<sqlx::PgConnection>(url).await?;
            let store = sql_builder!(PostgresStore, url, table, migrate);
            if !migrate {
                let found: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
                    .bind(store.table())
                    .fetch_one(store.pool())
                    .await
                    .map_err(|e| probe_failure(&e))?;
                require_table(found.is_some(), store.table())?;
            }
            Ok(Arc::new(store))
        }
        "mysql" | "mariadb" => {
            reach::<sqlx::MySqlConnection>(url).await?;
            let store = sql_builder!(MySqlStore, url, table, migrate);
            if !migrate {
                let found: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM information_schema.tables \
                     WHERE table_schema = DATABASE() AND table_name = ?",
                )
                .bind(store.table())
                .fetch_one(store.pool())
                .await
                .map_err(|e| probe_failure(&e))?;
                require_table(found > 0, store.table())?;
            }
            Ok(Arc::new(store))
        }
        "sqlite" => {
            if !migrate {
                require_sqlite_file(url)?;
            }
            let store = sql_builder!(SqliteStore, url, table, migrate);
            if !migrate {
                let found: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
                )
                .bind(store.table())
                .fetch_one(store.pool())
                .await
                .map_err(|e| probe_failure(&e))?;
                require_table(found > 0, store.table())?;
            }
            Ok(Arc::new(store))
        }
        _ => {
            let known = matches!(scheme, "memory" | "redis" | "rediss")
                || scheme.starts_with("redis+")
                || scheme.starts_with("rediss+");
            if known && table.is_some() {
                return Err(Failure::Input(format!(
                    "--table names the records table of an SQL store; a `{scheme}:` store has none"
                )));
            }
            idempotency::connect(url).await.map_err(|err| match err {
                ConnectError::Store(err) => open_failure(err),
                other => Failure::Input(chain(&other)),
            })
        }
    }
}

/// One connection on `url` first, closed at once: a pool that cannot connect only says it
/// timed out, while this says why (refused, wrong password, unknown database, a URL that
/// does not parse).
async fn reach<C: sqlx::Connection>(url: &str) -> Result<(), Failure> {
    match C::connect(url).await {
        Ok(conn) => {
            let _ = conn.close().await;
            Ok(())
        }
        Err(err) => {
            let text = format!(
                "cannot open the store: could not connect to the idempotency store: {}",
                chain(&err)
            );
            Err(match err {
                sqlx::Error::Configuration(_) => Failure::Input(text),
                _ => Failure::Store(text),
            })
        }
    }
}

fn probe_failure(err: &sqlx::Error) -> Failure {
    Failure::Store(format!("cannot look for the records table: {}", chain(err)))
}

fn require_table(found: bool, table: &str) -> Result<(), Failure> {
    if found {
        return Ok(());
    }
    let option = if table == "idempotent_records" {
        String::new()
    } else {
        format!(" --table {table}")
    };
    Err(Failure::Store(format!(
        "the database has no records table `{table}`: no store was ever opened on it (or --table names another table); create it with `idempotent-admin --store <url>{option} migrate`, or by opening the store from the application once (its builder migrates unless told not to)"
    )))
}

/// A read of an SQLite file that does not exist is refused rather than creating the file.
fn require_sqlite_file(url: &str) -> Result<(), Failure> {
    if url.contains(":memory:") || url.contains("mode=memory") {
        return Ok(());
    }
    let rest = url.trim_start_matches("sqlite:");
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    let path = rest.split('?').next().unwrap_or_default();
    if std::path::Path::new(path).exists() {
        return Ok(());
    }
    Err(Failure::Store(format!(
        "there is no SQLite database at `{path}`: no store was ever opened there; create it with `idempotent-admin --store <url> migrate`, or by opening the store from the application once"
    )))
}
