//! The part of the outbox that differs per database, behind a sealed trait: the SQL texts
//! (written for the default table `idempotent_outbox`), how a claimed batch is read, and how
//! relays are woken at commit.
//!
//! Every statement binds its parameters in the order they appear in the text, so the same
//! argument list serves `$n` (PostgreSQL) and `?` (MySQL, SQLite) placeholders.

use std::time::Duration;

use sqlx::Pool;

use crate::outbox::{DeadMessage, OutboxCounts, OutboxMessage};
use crate::store::sql::table::TableName;
use crate::store::sql::Dialect;
use crate::store::BoxFuture;

/// A value bound to an outbox statement.
#[derive(Debug, Clone, Copy)]
#[allow(unreachable_pub)] // reachable through `OutboxDriver`, but not nameable
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
    /// headers` (and the channel to notify, where [`OutboxDriver::NOTIFIES`]).
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
            purge: render(templates.purge),
            counts: render(templates.counts),
        }
    }
}

/// Something that resolves when a transaction that enqueued has committed, in any process
/// (PostgreSQL's `LISTEN`).
#[allow(unreachable_pub)] // reachable through `OutboxDriver`, but not nameable
pub trait Listener: Send {
    /// Waits for the next notification; an error means notifications are lost for now.
    fn recv(&mut self) -> BoxFuture<'_, Result<(), sqlx::Error>>;
}

/// A database the outbox runs on. Sealed: implemented for sqlx's `Postgres`, `MySql` and
/// `Sqlite` only.
#[allow(unreachable_pub)] // reachable as the supertrait of `OutboxDialect`, but not nameable
pub trait OutboxDriver: Dialect {
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

    /// Fetches message rows.
    fn messages<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c str,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Vec<OutboxMessage>, sqlx::Error>>;

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
/// database features enable them. Sealed.
pub trait OutboxDialect: OutboxDriver {}

impl<DB: OutboxDriver> OutboxDialect for DB {}

/// A duration in a database's tick, by the rule every store follows (whole milliseconds,
/// rounded up, clamped), except that zero stays zero: a zero backoff makes a row due at once,
/// "published more than zero ago" means "published before now".
pub(crate) fn ticks<DB: OutboxDriver>(duration: Duration) -> i64 {
    if duration.is_zero() {
        return 0;
    }
    crate::store::sql::driver::ticks(duration, DB::TICK)
}

/// The `OutboxDriver` methods that are the same text for every database (their types
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
            args: &'c [$crate::outbox::driver::Arg<'c>],
        ) -> $crate::store::BoxFuture<'c, Result<u64, sqlx::Error>> {
            Box::pin(async move {
                let query = outbox_fns!(@bind $db, sql, args);
                Ok(query.execute(conn).await?.rows_affected())
            })
        }

        fn messages<'c>(
            conn: &'c mut <$db as sqlx::Database>::Connection,
            sql: &'c str,
            args: &'c [$crate::outbox::driver::Arg<'c>],
        ) -> $crate::store::BoxFuture<
            'c,
            Result<Vec<$crate::outbox::OutboxMessage>, sqlx::Error>,
        > {
            Box::pin(async move {
                let query = outbox_fns!(@bind $db, sql, args);
                let rows = query.fetch_all(conn).await?;
                rows.iter().map(|row| outbox_fns!(@message row)).collect()
            })
        }

        fn dead<'c>(
            conn: &'c mut <$db as sqlx::Database>::Connection,
            sql: &'c str,
            args: &'c [$crate::outbox::driver::Arg<'c>],
        ) -> $crate::store::BoxFuture<'c, Result<Vec<$crate::outbox::DeadMessage>, sqlx::Error>>
        {
            Box::pin(async move {
                use sqlx::Row as _;
                let query = outbox_fns!(@bind $db, sql, args);
                let rows = query.fetch_all(conn).await?;
                rows.iter()
                    .map(|row| {
                        Ok($crate::outbox::DeadMessage {
                            message: outbox_fns!(@message row)?,
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
                $crate::outbox::driver::Arg::Text(text) => query.bind(text),
                $crate::outbox::driver::Arg::Bytes(bytes) => query.bind(bytes),
                $crate::outbox::driver::Arg::Int(n) => query.bind(n),
            };
        }
        query
    }};
    (@message $row:expr) => {{
        use sqlx::Row as _;
        (|| -> Result<$crate::outbox::OutboxMessage, sqlx::Error> {
            let row = $row;
            let headers: String = row.try_get("headers")?;
            let headers: std::collections::BTreeMap<String, String> =
                serde_json::from_str(&headers).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
            let attempts: i64 = row.try_get("attempts")?;
            Ok($crate::outbox::OutboxMessage {
                id: $crate::outbox::MessageId::from_string(row.try_get("id")?),
                aggregate_type: row.try_get("aggregate_type")?,
                aggregate_id: row.try_get("aggregate_id")?,
                event_type: row.try_get("event_type")?,
                destination: row.try_get("destination")?,
                payload: row.try_get("payload")?,
                headers,
                attempts: u32::try_from(attempts).unwrap_or(0),
            })
        })()
    }};
}
pub(crate) use outbox_fns;
