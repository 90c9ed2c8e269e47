//! The part of the outbox that differs per database, behind a sealed trait: the SQL texts
//! (written for the default table `idempotent_outbox`), how a claimed batch is read, and how
//! relays are woken at commit.
//!
//! Every statement binds its parameters in the order they appear in the text, so the same
//! argument list serves `$n` (PostgreSQL) and `?` (MySQL, SQLite) placeholders.

use std::time::Duration;

use sqlx::Pool;

use crate::database::{SqlDatabase, TableName};
use crate::outbox::{DeadMessage, OutboxCounts, OutboxMessage, StoredMessage};
use crate::store::sql::Dialect;
use crate::store::{clamped_millis, BoxFuture};

/// A value bound to an outbox statement.
#[derive(Debug, Clone, Copy)]
#[allow(unreachable_pub)] // reachable through `OutboxDialectImpl`, but not nameable
pub enum Arg<'a> {
    /// Text.
    Text(&'a str),
    /// Bytes.
    Bytes(&'a [u8]),
    /// An integer (a duration in the database's tick, a count).
    Int(i64),
}

/// The SQL of one database, for the default table.
#[derive(Debug, Clone, Copy)]
pub struct OutboxTemplates {
    /// Creates the table and its indexes when missing (may be several statements).
    pub(crate) create: &'static str,
    /// Inserts a row: `id, aggregate_type, aggregate_id, event_type, destination, payload,
    /// headers` (and the channel to notify, where [`OutboxDialectImpl::NOTIFIES`]).
    pub(crate) enqueue: &'static str,
    /// Claims due rows: `token, lease (ticks), batch`. Returns the claimed rows in order
    /// where [`claimed`](OutboxTemplates::claimed) is empty.
    pub(crate) claim: &'static str,
    /// Reads the rows a claim took, oldest first: `token`; empty when the claim returns them.
    pub(crate) claimed: &'static str,
    /// Marks rows published: `token`, then the ids at the `{ids}` marker.
    pub(crate) published: &'static str,
    /// Records a failed attempt: `error, max_attempts, retry_in (ticks), id, token`.
    pub(crate) failed: &'static str,
    /// Reads a row: `id`.
    pub(crate) get: &'static str,
    /// Reads dead rows, oldest first, with `last_error` and `age` (seconds): `limit`.
    pub(crate) dead: &'static str,
    /// Puts a dead row back in the queue: `id`.
    pub(crate) retry: &'static str,
    /// Deletes a dead row: `id`.
    pub(crate) discard: &'static str,
    /// Deletes a `pending` or `dead` row that no live claim holds: `id`.
    pub(crate) force_discard: &'static str,
    /// Reads a row whatever its state, with `state`, `last_error`, `age` (seconds) and
    /// `claimed` (1 while a live claim holds it): `id`.
    pub(crate) inspect: &'static str,
    /// Gives back the rows a claim still holds, their attempt not counted: `token`.
    pub(crate) release: &'static str,
    /// Deletes published rows older than a duration: `older_than (ticks), limit`.
    pub(crate) purge: &'static str,
    /// Counts rows by state: columns `pending`, `published`, `dead`.
    pub(crate) counts: &'static str,
}

/// Counts rows by state, the same text on every database.
pub(crate) const COUNTS: &str = "SELECT COUNT(CASE WHEN state = 'pending' THEN 1 END) AS pending, \
     COUNT(CASE WHEN state = 'published' THEN 1 END) AS published, \
     COUNT(CASE WHEN state = 'dead' THEN 1 END) AS dead \
     FROM idempotent_outbox";

/// The statements of one outbox: the templates, rendered for its table.
#[derive(Debug)]
pub(crate) struct OutboxStatements {
    pub(crate) create: String,
    pub(crate) enqueue: String,
    pub(crate) claim: String,
    pub(crate) claimed: String,
    pub(crate) published: String,
    pub(crate) failed: String,
    pub(crate) get: String,
    pub(crate) dead: String,
    pub(crate) retry: String,
    pub(crate) discard: String,
    pub(crate) force_discard: String,
    pub(crate) inspect: String,
    pub(crate) release: String,
    pub(crate) purge: String,
    pub(crate) counts: String,
}

impl OutboxStatements {
    /// The marking statement for `n` ids: `{ids}` replaced by `n` placeholders after the
    /// token's (`$2, $3, ...` where placeholders are numbered, `?, ?, ...` elsewhere).
    pub(crate) fn published_many(&self, n: usize, numbered: bool) -> String {
        let mut ids = String::with_capacity(n * 5);
        for i in 0..n {
            if i > 0 {
                ids.push_str(", ");
            }
            if numbered {
                ids.push('$');
                ids.push_str(&(i + 2).to_string());
            } else {
                ids.push('?');
            }
        }
        self.published.replace("{ids}", &ids)
    }

    pub(crate) fn render(templates: &OutboxTemplates, table: &TableName) -> OutboxStatements {
        let render = |sql: &str| {
            table.render_for(sql, crate::outbox::DEFAULT_TABLE, &["_due", "_published"])
        };
        OutboxStatements {
            create: render(templates.create),
            enqueue: render(templates.enqueue),
            claim: render(templates.claim),
            claimed: render(templates.claimed),
            published: render(templates.published),
            failed: render(templates.failed),
            get: render(templates.get),
            dead: render(templates.dead),
            retry: render(templates.retry),
            discard: render(templates.discard),
            force_discard: render(templates.force_discard),
            inspect: render(templates.inspect),
            release: render(templates.release),
            purge: render(templates.purge),
            counts: render(templates.counts),
        }
    }
}

/// Something that resolves when a transaction that enqueued has committed, in any process
/// (PostgreSQL's `LISTEN`).
#[allow(unreachable_pub)] // reachable through `OutboxDialectImpl`, but not nameable
pub trait Listener: Send {
    /// Waits for the next notification; an error means notifications are lost for now.
    fn recv(&mut self) -> BoxFuture<'_, Result<(), sqlx::Error>>;
}

/// What makes a database an [`OutboxDialect`]: its outbox statements and the calls that
/// differ between databases. One idea with [`OutboxDialect`], split in two only to seal it:
/// this half is not nameable outside the crate, so no other type can implement it.
#[allow(unreachable_pub)] // reachable as the supertrait of `OutboxDialect`, but not nameable
pub trait OutboxDialectImpl: SqlDatabase {
    /// The statements.
    const OUTBOX: OutboxTemplates;
    /// Whether the enqueue statement notifies relays at commit itself (it then takes the
    /// channel as its last parameter).
    const NOTIFIES: bool;
    /// Whether placeholders are numbered (`$1`) rather than positional (`?`).
    const NUMBERED: bool;

    /// Runs the creation script.
    fn create<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c str,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// Executes a statement; returns the rows it matched.
    fn exec<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c str,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// Fetches message rows, each with what of it cannot be read.
    fn messages<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c str,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Vec<ReadRow>, sqlx::Error>>;

    /// Fetches rows as an operator sees them ([`OutboxDialectImpl::OUTBOX`]'s `inspect`).
    fn stored<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c str,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Vec<StoredMessage>, sqlx::Error>>;

    /// Fetches dead message rows.
    fn dead<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c str,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Vec<DeadMessage>, sqlx::Error>>;

    /// Fetches the counts.
    fn counts<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c str,
    ) -> BoxFuture<'c, Result<OutboxCounts, sqlx::Error>>;

    /// A listener for the commits of transactions that enqueued on `channel`, where the
    /// database has notifications; `None` elsewhere.
    fn listen<'p>(
        _pool: &'p Pool<Self>,
        _channel: &'p str,
    ) -> BoxFuture<'p, Result<Option<Box<dyn Listener>>, sqlx::Error>> {
        Box::pin(async { Ok(None) })
    }
}

/// A database an [`Outbox`](crate::outbox::Outbox) runs on: sqlx's
/// [`Postgres`](sqlx::Postgres), [`MySql`](sqlx::MySql) or [`Sqlite`](sqlx::Sqlite), as the
/// database features enable them. Sealed. Each is also a [`Dialect`], so an outbox's pool
/// serves a [`SqlStore`](crate::sql::SqlStore) too.
pub trait OutboxDialect: OutboxDialectImpl + Dialect {}

impl<DB: OutboxDialectImpl + Dialect> OutboxDialect for DB {}

/// A duration in a database's tick, by the rule every store follows (whole milliseconds,
/// rounded up, clamped), except that zero stays zero: a zero backoff makes a row due at once,
/// "published more than zero ago" means "published before now".
pub(crate) fn ticks<DB: OutboxDialectImpl>(duration: Duration) -> i64 {
    if duration.is_zero() {
        return 0;
    }
    crate::database::ticks(clamped_millis(duration), DB::TICK)
}

/// A message row as read: the message, and what of it cannot be read (written by another
/// producer: headers that are not a JSON object of strings, text that is not UTF-8). The
/// fields that cannot be read are empty in `message`.
#[derive(Debug)]
#[allow(unreachable_pub)] // reachable through `OutboxDialectImpl`, but not nameable
pub struct ReadRow {
    /// The message.
    pub message: OutboxMessage,
    /// Why a part of it cannot be read, if one cannot.
    pub unreadable: Option<String>,
}

/// `got`, or the type's default with the problem noted in `problems`.
pub(crate) fn readable<T: Default>(
    got: Result<T, sqlx::Error>,
    column: &str,
    problems: &mut Vec<String>,
) -> T {
    got.unwrap_or_else(|err| {
        problems.push(format!("{column}: {err}"));
        T::default()
    })
}

/// The headers column's text as a map, or the problem noted in `problems`.
pub(crate) fn headers(
    got: Result<String, sqlx::Error>,
    problems: &mut Vec<String>,
) -> std::collections::BTreeMap<String, String> {
    let text = readable(got, "headers", problems);
    serde_json::from_str(&text).unwrap_or_else(|err| {
        let mut shown: String = text.chars().take(80).collect();
        if shown.len() < text.len() {
            shown.push_str("...");
        }
        problems.push(format!(
            "headers {shown:?} are not a JSON object of strings: {err}"
        ));
        Default::default()
    })
}

/// The `OutboxDialectImpl` methods that are the same text for every database (their types
/// differ), for a database type. The message columns are read by name: `id`,
/// `aggregate_type`, `aggregate_id`, `event_type`, `destination`, `payload`, `headers`
/// (text), `attempts` (a 64-bit integer); dead rows add `last_error` and `age` (a double).
macro_rules! outbox_fns {
    ($db:ty) => {
        fn create<'c>(
            conn: &'c mut <$db as sqlx::Database>::Connection,
            sql: &'c str,
        ) -> $crate::store::BoxFuture<'c, Result<(), sqlx::Error>> {
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                    .execute(conn)
                    .await?;
                Ok(())
            })
        }

        fn exec<'c>(
            conn: &'c mut <$db as sqlx::Database>::Connection,
            sql: &'c str,
            args: &'c [$crate::outbox::dialect::Arg<'c>],
        ) -> $crate::store::BoxFuture<'c, Result<u64, sqlx::Error>> {
            Box::pin(async move {
                let query = outbox_fns!(@bind $db, sql, args);
                Ok(query.execute(conn).await?.rows_affected())
            })
        }

        fn messages<'c>(
            conn: &'c mut <$db as sqlx::Database>::Connection,
            sql: &'c str,
            args: &'c [$crate::outbox::dialect::Arg<'c>],
        ) -> $crate::store::BoxFuture<
            'c,
            Result<Vec<$crate::outbox::dialect::ReadRow>, sqlx::Error>,
        > {
            Box::pin(async move {
                let query = outbox_fns!(@bind $db, sql, args);
                let rows = query.fetch_all(conn).await?;
                rows.iter().map(|row| outbox_fns!(@message row)).collect()
            })
        }

        fn stored<'c>(
            conn: &'c mut <$db as sqlx::Database>::Connection,
            sql: &'c str,
            args: &'c [$crate::outbox::dialect::Arg<'c>],
        ) -> $crate::store::BoxFuture<
            'c,
            Result<Vec<$crate::outbox::StoredMessage>, sqlx::Error>,
        > {
            Box::pin(async move {
                use sqlx::Row as _;
                let query = outbox_fns!(@bind $db, sql, args);
                let rows = query.fetch_all(conn).await?;
                rows.iter()
                    .map(|row| {
                        let read = outbox_fns!(@message row)?;
                        let state: String = row.try_get("state")?;
                        let claimed: i64 = row.try_get("claimed")?;
                        Ok($crate::outbox::StoredMessage {
                            message: read.message,
                            unreadable: read.unreadable,
                            state: $crate::outbox::MessageState::parse(&state)
                                .ok_or_else(|| sqlx::Error::Decode(
                                    format!("unknown outbox state {state:?}").into(),
                                ))?,
                            last_error: row.try_get("last_error")?,
                            age_seconds: row.try_get("age")?,
                            claimed: claimed != 0,
                        })
                    })
                    .collect()
            })
        }

        fn dead<'c>(
            conn: &'c mut <$db as sqlx::Database>::Connection,
            sql: &'c str,
            args: &'c [$crate::outbox::dialect::Arg<'c>],
        ) -> $crate::store::BoxFuture<'c, Result<Vec<$crate::outbox::DeadMessage>, sqlx::Error>>
        {
            Box::pin(async move {
                use sqlx::Row as _;
                let query = outbox_fns!(@bind $db, sql, args);
                let rows = query.fetch_all(conn).await?;
                rows.iter()
                    .map(|row| {
                        let read = outbox_fns!(@message row)?;
                        Ok($crate::outbox::DeadMessage {
                            message: read.message,
                            unreadable: read.unreadable,
                            last_error: row.try_get("last_error")?,
                            age_seconds: row.try_get("age")?,
                        })
                    })
                    .collect()
            })
        }

        fn counts<'c>(
            conn: &'c mut <$db as sqlx::Database>::Connection,
            sql: &'c str,
        ) -> $crate::store::BoxFuture<'c, Result<$crate::outbox::OutboxCounts, sqlx::Error>> {
            Box::pin(async move {
                use sqlx::Row as _;
                let row = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                    .fetch_one(conn)
                    .await?;
                let count = |name: &str| -> Result<u64, sqlx::Error> {
                    let n: i64 = row.try_get(name)?;
                    Ok(u64::try_from(n).unwrap_or(0))
                };
                Ok($crate::outbox::OutboxCounts {
                    pending: count("pending")?,
                    published: count("published")?,
                    dead: count("dead")?,
                })
            })
        }
    };
    (@bind $db:ty, $sql:expr, $args:expr) => {{
        let mut query = sqlx::query::<$db>(sqlx::AssertSqlSafe($sql.to_owned()));
        for arg in $args {
            query = match *arg {
                $crate::outbox::dialect::Arg::Text(text) => query.bind(text),
                $crate::outbox::dialect::Arg::Bytes(bytes) => query.bind(bytes),
                $crate::outbox::dialect::Arg::Int(n) => query.bind(n),
            };
        }
        query
    }};
    (@message $row:expr) => {{
        use sqlx::Row as _;
        use $crate::outbox::dialect::{headers, readable};
        (|| -> Result<$crate::outbox::dialect::ReadRow, sqlx::Error> {
            let row = $row;
            // The id and the attempts are the relay's to count a failure: without them the
            // row is not an outbox row at all.
            let id: String = row.try_get("id")?;
            let attempts: i64 = row.try_get("attempts")?;
            let mut problems = Vec::new();
            let problems = &mut problems;
            let message = $crate::outbox::OutboxMessage {
                id: $crate::outbox::MessageId::from_string(id),
                aggregate_type: readable(row.try_get("aggregate_type"), "aggregate_type", problems),
                aggregate_id: readable(row.try_get("aggregate_id"), "aggregate_id", problems),
                event_type: readable(row.try_get("event_type"), "event_type", problems),
                destination: readable(row.try_get("destination"), "destination", problems),
                payload: readable(row.try_get("payload"), "payload", problems),
                headers: headers(row.try_get("headers"), problems),
                attempts: u32::try_from(attempts).unwrap_or(0),
            };
            let unreadable = if problems.is_empty() {
                None
            } else {
                Some(problems.join("; "))
            };
            Ok($crate::outbox::dialect::ReadRow { message, unreadable })
        })()
    }};
}
pub(crate) use outbox_fns;
