//! Binding values to the SQL store's statements, the same for every database: a batch's
//! claims, endings and keys, a statement's [`Arg`]s, the rows of placeholders of a batch
//! statement's text, and the statement functions every dialect shares (`statement_fns!`). The
//! SQL texts themselves are in `dialect.rs`.

use std::time::Duration;

use sqlx::error::BoxDynError;
use sqlx::{Arguments, Database, IntoArguments};

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

/// `template` with its slot (the first `slot`: each statement has one) replaced by `count`
/// items: `first`, then `sep` and `item` for each one after it (the rows of placeholders of a
/// batch statement, one per item). Written in one pass into a string of the final size: a
/// batch of 100 claims is some 20 kB of text. A template without the slot is returned as it
/// is.
#[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
pub(crate) fn with_rows(
    template: &str,
    slot: &str,
    count: usize,
    (first, sep, item): (&str, &str, &str),
) -> String {
    let Some((head, tail)) = template.split_once(slot) else {
        return template.to_owned();
    };
    let rows = match count {
        0 => 0,
        n => first.len() + (n - 1) * (sep.len() + item.len()),
    };
    let mut out = String::with_capacity(head.len() + rows + tail.len());
    out.push_str(head);
    if count > 0 {
        out.push_str(first);
        for _ in 1..count {
            out.push_str(sep);
            out.push_str(item);
        }
    }
    out.push_str(tail);
    out
}

/// `sql` with the values `add` adds, in arguments made to hold `count` of them (`size` bytes):
/// what a query's `bind` would do value by value, without moving the query for each value and
/// growing its buffers as they fill (on a batch of 100 claims, 600 values).
///
/// # Errors
///
/// [`sqlx::Error::Encode`] when a value cannot be encoded.
fn query_of<'q, DB>(
    sql: impl sqlx::SqlSafeStr,
    (count, size): (usize, usize),
    add: impl FnOnce(&mut DB::Arguments) -> Result<(), BoxDynError>,
) -> Result<sqlx::query::Query<'q, DB, DB::Arguments>, sqlx::Error>
where
    DB: Database,
    DB::Arguments: IntoArguments<DB>,
{
    let mut args = DB::Arguments::default();
    args.reserve(count, size);
    add(&mut args).map_err(sqlx::Error::Encode)?;
    Ok(sqlx::query_with(sql, args))
}

/// `sql` with each ending's `(key, token, result, ttl, complete?)` bound, in order: the rows
/// of the batch ending statements that take one row of placeholders per item.
#[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
pub(crate) fn bind_endings<'q, DB>(
    sql: impl sqlx::SqlSafeStr,
    items: &[&Ending],
    tick: Duration,
) -> Result<sqlx::query::Query<'q, DB, DB::Arguments>, sqlx::Error>
where
    DB: Database,
    DB::Arguments: IntoArguments<DB>,
    for<'t> &'t [u8]: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<&'t [u8]>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    i64: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    let size = items
        .iter()
        .map(|item| item.key.as_bytes().len() + ending_args(item, tick).0.map_or(0, <[u8]>::len))
        .sum::<usize>()
        + items.len() * 48;
    query_of(sql, (items.len() * 5, size), |args: &mut DB::Arguments| {
        for item in items {
            let (result, ttl, complete) = ending_args(item, tick);
            args.add(item.key.as_bytes())?;
            args.add(&item.token.as_bytes()[..])?;
            args.add(result)?;
            args.add(ttl)?;
            args.add(i64::from(complete))?;
        }
        Ok(())
    })
}

/// `sql` with each claim's `(key, prefix, token, lease, fingerprint, ttl)` bound, in order:
/// the rows of the claim statements that take one row of placeholders per key.
#[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
pub(crate) fn bind_claims<'q, DB>(
    sql: impl sqlx::SqlSafeStr,
    reqs: &[&ClaimRequest],
    tick: Duration,
) -> Result<sqlx::query::Query<'q, DB, DB::Arguments>, sqlx::Error>
where
    DB: Database,
    DB::Arguments: IntoArguments<DB>,
    for<'t> &'t [u8]: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<&'t [u8]>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> &'t str: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    i64: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    // The key holds its prefix; the token and the fingerprint are 16 bytes, the integers 8,
    // and each value may take a few bytes of length.
    let size = reqs
        .iter()
        .map(|req| req.key.as_bytes().len())
        .sum::<usize>()
        * 2
        + reqs.len() * 80;
    query_of(sql, (reqs.len() * 6, size), |args: &mut DB::Arguments| {
        for req in reqs {
            args.add(req.key.as_bytes())?;
            args.add(req.key.prefix())?;
            args.add(&req.token.as_bytes()[..])?;
            args.add(ticks(req.lease, tick))?;
            args.add(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))?;
            args.add(ticks(req.record_lifetime(), tick))?;
        }
        Ok(())
    })
}

/// `sql` with `keys` bound, in order: the reads of a batch's records, which take one
/// placeholder per key.
#[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
pub(crate) fn bind_keys<'q, 'k, DB>(
    sql: impl sqlx::SqlSafeStr,
    keys: impl ExactSizeIterator<Item = &'k [u8]> + Clone,
) -> Result<sqlx::query::Query<'q, DB, DB::Arguments>, sqlx::Error>
where
    DB: Database,
    DB::Arguments: IntoArguments<DB>,
    for<'t> &'t [u8]: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    let size = keys.clone().map(|key| key.len() + 4).sum();
    query_of(sql, (keys.len(), size), |args: &mut DB::Arguments| {
        for key in keys {
            args.add(key)?;
        }
        Ok(())
    })
}

/// `sql` with `args` bound, in order.
///
/// # Errors
///
/// [`sqlx::Error::Encode`] when a value cannot be encoded.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub(crate) fn bind<'q, DB>(
    sql: impl sqlx::SqlSafeStr,
    args: &[Arg<'_>],
) -> Result<sqlx::query::Query<'q, DB, DB::Arguments>, sqlx::Error>
where
    DB: Database,
    DB::Arguments: IntoArguments<DB>,
    for<'t> &'t [u8]: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<&'t [u8]>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> &'t str: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    i64: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    let size = args
        .iter()
        .map(|arg| match *arg {
            Arg::Bytes(bytes) | Arg::MaybeBytes(Some(bytes)) => bytes.len() + 4,
            Arg::MaybeBytes(None) => 0,
            Arg::Int(_) => 8,
            Arg::Text(text) => text.len() + 4,
        })
        .sum();
    query_of(sql, (args.len(), size), |out: &mut DB::Arguments| {
        for arg in args {
            match *arg {
                Arg::Bytes(bytes) => out.add(bytes)?,
                Arg::MaybeBytes(bytes) => out.add(bytes)?,
                Arg::Int(n) => out.add(n)?,
                Arg::Text(text) => out.add(text)?,
            }
        }
        Ok(())
    })
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
                let query = $crate::store::sql::bind::bind(sqlx::AssertSqlSafe(sql.clone()), args)?;
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
                let query = $crate::store::sql::bind::bind(sqlx::AssertSqlSafe(sql.clone()), args)?;
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
                let query = $crate::store::sql::bind::bind(sqlx::AssertSqlSafe(sql.clone()), args)?;
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

#[cfg(test)]
mod tests {
    use super::with_rows;

    #[test]
    fn rows_are_written_in_place_of_the_slot_as_a_join_would_write_them() {
        let template = "INSERT INTO t VALUES {rows} ON DUPLICATE KEY UPDATE x = 1";
        for count in [0, 1, 2, 100] {
            let joined = vec!["(?, ?)"; count].join(", ");
            assert_eq!(
                with_rows(template, "{rows}", count, ("(?, ?)", ", ", "(?, ?)")),
                template.replace("{rows}", &joined)
            );
        }
        let union = with_rows(
            "({rows})",
            "{rows}",
            3,
            ("SELECT ? AS k", "", " UNION ALL SELECT ?"),
        );
        assert_eq!(
            union,
            "(SELECT ? AS k UNION ALL SELECT ? UNION ALL SELECT ?)"
        );
        assert_eq!(
            with_rows("no slot", "{rows}", 3, ("a", ",", "b")),
            "no slot"
        );
    }
}
