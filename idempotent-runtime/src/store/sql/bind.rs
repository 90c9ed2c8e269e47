//! Binding values to the SQL store's statements, the same for every database: a batch's
//! claims and endings, a statement's [`Arg`]s, and the statement functions every dialect
//! shares (`statement_fns!`). The SQL texts themselves are in `dialect.rs`.

use std::time::Duration;

use sqlx::Database;

use crate::store::sql::dialect::{ticks, Arg};
use crate::store::{ClaimRequest, End, Ending};

/// The values a batch ending binds for `item`: its result (`None` for a release or a
/// completion without one), its ttl in `tick`s, and whether it completes.
pub(crate) fn ending_args(item: &Ending, tick: Duration) -> (Option<&[u8]>, i64, bool) {
    match &item.action {
        End::Complete(completion) => (
            completion.result.as_deref(),
            ticks(completion.ttl, tick),
            true,
        ),
        // The ttl is not read for a release.
        _ => (None, 1, false),
    }
}

/// Binds each ending's `(key, token, result, ttl, complete?)` to `query`, in order: the
/// rows of the batch ending statements that take one row of placeholders per item.
#[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
pub(crate) fn bind_endings<'q, DB>(
    mut query: sqlx::query::Query<'q, DB, DB::Arguments>,
    items: &[&'q Ending],
    tick: Duration,
) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: Database,
    for<'t> &'t [u8]: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<&'t [u8]>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    i64: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    for item in items {
        let (result, ttl, complete) = ending_args(item, tick);
        query = query
            .bind(item.key.as_bytes())
            .bind(&item.token.as_bytes()[..])
            .bind(result)
            .bind(ttl)
            .bind(i64::from(complete));
    }
    query
}

/// Binds each claim's `(key, prefix, token, lease, fingerprint, ttl)` to `query`, in order:
/// the rows of the batch claim statements that take one row of placeholders per key.
#[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
pub(crate) fn bind_claims<'q, DB>(
    mut query: sqlx::query::Query<'q, DB, DB::Arguments>,
    reqs: &[&'q ClaimRequest],
    tick: Duration,
) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: Database,
    for<'t> &'t [u8]: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<&'t [u8]>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> &'t str: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    i64: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    for req in reqs {
        query = query
            .bind(req.key.as_bytes())
            .bind(req.key.prefix())
            .bind(&req.token.as_bytes()[..])
            .bind(ticks(req.lease, tick))
            .bind(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
            .bind(ticks(req.record_lifetime(), tick));
    }
    query
}

/// Binds `args` to `query`, in order.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub(crate) fn bind<'q, DB>(
    mut query: sqlx::query::Query<'q, DB, DB::Arguments>,
    args: &[Arg<'_>],
) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: Database,
    for<'t> &'t [u8]: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<&'t [u8]>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> &'t str: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    i64: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    for arg in args {
        query = match *arg {
            Arg::Bytes(bytes) => query.bind(bytes),
            Arg::MaybeBytes(bytes) => query.bind(bytes),
            Arg::Int(n) => query.bind(n),
            Arg::Text(text) => query.bind(text),
        };
    }
    query
}

/// The `DialectImpl` methods that are the same text for every database (their types differ):
/// `execute`, `fetch` and `migrate`, for a connection type.
macro_rules! statement_fns {
    ($conn:ty) => {
        fn execute<'c>(
            conn: &'c mut $conn,
            sql: &'c std::sync::Arc<str>,
            args: &'c [$crate::store::sql::dialect::Arg<'c>],
        ) -> $crate::store::BoxFuture<'c, Result<u64, sqlx::Error>> {
            Box::pin(async move {
                let query = $crate::store::sql::bind::bind(
                    sqlx::query(sqlx::AssertSqlSafe(sql.clone())),
                    args,
                );
                Ok(query.execute(conn).await?.rows_affected())
            })
        }

        fn fetch<'c>(
            conn: &'c mut $conn,
            sql: &'c std::sync::Arc<str>,
            args: &'c [$crate::store::sql::dialect::Arg<'c>],
        ) -> $crate::store::BoxFuture<
            'c,
            Result<Option<$crate::store::sql::record::RecordRow>, sqlx::Error>,
        > {
            Box::pin(async move {
                let query = $crate::store::sql::bind::bind(
                    sqlx::query(sqlx::AssertSqlSafe(sql.clone())),
                    args,
                );
                let row = query.fetch_optional(conn).await?;
                row.as_ref()
                    .map($crate::store::sql::record::RecordRow::decode)
                    .transpose()
            })
        }

        fn fetch_keyed<'c>(
            conn: &'c mut $conn,
            sql: &'c std::sync::Arc<str>,
            args: &'c [$crate::store::sql::dialect::Arg<'c>],
        ) -> $crate::store::BoxFuture<
            'c,
            Result<
                Vec<(
                    Vec<u8>,
                    Result<$crate::store::sql::record::RecordRow, sqlx::Error>,
                )>,
                sqlx::Error,
            >,
        > {
            Box::pin(async move {
                let query = $crate::store::sql::bind::bind(
                    sqlx::query(sqlx::AssertSqlSafe(sql.clone())),
                    args,
                );
                let rows = query.fetch_all(conn).await?;
                rows.iter()
                    .map($crate::store::sql::record::RecordRow::decode_listed)
                    .collect()
            })
        }

        fn migrate<'c>(
            conn: &'c mut $conn,
            migrator: &'c mut sqlx::migrate::Migrator,
            migrations_table: &'c str,
        ) -> $crate::store::BoxFuture<'c, Result<(), $crate::error::StoreError>> {
            $crate::store::sql::migrate::LockedMigrate::migrate_locked(
                conn,
                migrator,
                migrations_table,
            )
        }
    };
}
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(unused_imports)
)]
pub(crate) use statement_fns;
