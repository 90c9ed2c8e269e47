//! The part of the SQL store that differs per database, behind a sealed trait: SQL texts,
//! how a pool is opened, how the claim statement reports its outcome, error codes.
//!
//! Everything else (the store, the transactional API, purging, migrations, error kinds, the
//! reading of a claim's outcome) is written once in the parent module.

use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::pool::PoolOptions;
use sqlx::Pool;

use crate::database::{SqlDatabase, TableName};
use crate::store::sql::record::{RecordRow, Step};
use crate::store::sql::DEFAULT_TABLE;
use crate::store::{clamped_millis, BoxFuture, ClaimRequest, Ending};

/// A value bound to a statement parameter.
#[derive(Debug, Clone, Copy)]
pub enum Arg<'a> {
    /// Bytes (a key, a token).
    Bytes(&'a [u8]),
    /// Bytes or NULL (a result).
    MaybeBytes(Option<&'a [u8]>),
    /// An integer (a duration in the dialect's tick, a batch size).
    Int(i64),
    /// Text (a key prefix).
    Text(&'a str),
}

/// The SQL of one dialect, written for the default table `idempotent_records`.
#[derive(Debug, Clone, Copy)]
pub struct Templates {
    /// The claim statement.
    pub claim: &'static str,
    /// Reads a record for a claim that did not take it (may lock it, in a transaction).
    pub seen: &'static str,
    /// Completes: parameters `result, ttl, key, token`.
    pub complete: &'static str,
    /// Releases: parameters `key, token`.
    pub release: &'static str,
    /// Renews: parameters `lease, lease, key, token`.
    pub renew: &'static str,
    /// Makes a record of any state released, dropping its result: parameters `key, token`.
    pub reopen: &'static str,
    /// Reads a live record: parameter `key`.
    pub read: &'static str,
    /// Deletes at most a batch of expired records: parameter `batch`.
    pub purge: &'static str,
    /// A page of live records for an operator, `record_key` first, then the record columns,
    /// age and expiry: parameters `after, below, prefix, limit`.
    pub scan: &'static str,
    /// Deletes a live record that has the token: parameters `key, token`.
    pub delete: &'static str,
    /// Deletes the row of a key if it is not a readable record: parameter `key`.
    pub delete_corrupt: &'static str,
    /// The claim statement committed asynchronously (PostgreSQL); empty where the database
    /// has no such option.
    pub claim_async: &'static str,
    /// The batch claim statement committed asynchronously (PostgreSQL); empty otherwise.
    pub claim_many_async: &'static str,
    /// Completes and releases a batch of distinct keys in one statement; empty when the
    /// dialect ends a batch one key at a time. It may hold a `{rows}` marker that the
    /// store replaces with one row of placeholders per item.
    pub complete_many: &'static str,
    /// The claim statement for a batch of distinct keys, returning `record_key` before the
    /// record columns; empty when the dialect claims a batch one key at a time. It may hold a
    /// `{rows}` marker that the store replaces with one row of placeholders per key.
    pub claim_many: &'static str,
    /// Reads the live records of keys a batch claim did not take (on MySQL, that a batch
    /// ending did not resolve), `record_key` first; empty when not needed. It may hold a `{keys}` marker that the
    /// store replaces with one placeholder per key.
    pub seen_many: &'static str,
    /// A claim that only inserts: it takes an absent key and leaves any record alone, and
    /// is sent before the claim that answers the keys it did not take
    /// ([`claim_reporting`](Templates::claim_reporting) on MariaDB, [`claim`](Templates::claim)
    /// on PostgreSQL). Empty where the claim statement is sent alone; dropped when the
    /// server cannot send it or its follower ([`DialectImpl::reports_claims`]).
    pub claim_fresh: &'static str,
    /// [`claim_fresh`](Templates::claim_fresh) committed asynchronously (PostgreSQL); empty
    /// otherwise.
    pub claim_fresh_async: &'static str,
    /// The insert-only claim of a batch of distinct keys, sent before the batch claim that
    /// claims the others ([`claim_many`](Templates::claim_many) on PostgreSQL, which answers
    /// in one row the positions (from 1) of the keys it took (`NULL` when all) and their
    /// fences; [`claim_many_reporting`](Templates::claim_many_reporting) on MariaDB, which
    /// returns each key's row and whether it inserted it); empty otherwise, and dropped as
    /// [`claim_fresh`](Templates::claim_fresh) is.
    pub claim_many_fresh: &'static str,
    /// [`claim_many_fresh`](Templates::claim_many_fresh) committed asynchronously
    /// (PostgreSQL); empty otherwise.
    pub claim_many_fresh_async: &'static str,
    /// The claim statement, returning the record it leaves (the record columns, as
    /// [`seen`](Templates::seen) reads them). Empty where the claim reports its outcome
    /// otherwise; dropped when the server cannot send it ([`DialectImpl::reports_claims`]).
    pub claim_reporting: &'static str,
    /// The batch claim statement, returning `record_key` and the record columns of every
    /// key it was given, so that no read follows it. Empty where the batch claim reports its
    /// records otherwise; dropped when the server cannot send it
    /// ([`DialectImpl::reports_claims`]).
    pub claim_many_reporting: &'static str,
}

/// The SQL of one store: the templates, rendered for its table.
#[derive(Debug)]
pub struct Statements {
    pub(crate) claim: Arc<str>,
    // PostgreSQL's claim statement reports the record itself.
    #[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
    pub(crate) seen: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) release: Arc<str>,
    pub(crate) renew: Arc<str>,
    pub(crate) reopen: Arc<str>,
    pub(crate) read: Arc<str>,
    pub(crate) purge: Arc<str>,
    pub(crate) scan: Arc<str>,
    pub(crate) delete: Arc<str>,
    pub(crate) delete_corrupt: Arc<str>,
    pub(crate) complete_many: Arc<str>,
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    pub(crate) claim_many: Arc<str>,
    #[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
    pub(crate) seen_many: Arc<str>,
    pub(crate) claim_fresh: Arc<str>,
    pub(crate) claim_many_fresh: Arc<str>,
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) claim_reporting: Arc<str>,
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) claim_many_reporting: Arc<str>,
}

impl Statements {
    /// [`render`](Statements::render), with the asynchronously committed claims.
    pub(crate) fn render_async_claims(templates: &Templates, table: &TableName) -> Statements {
        let mut statements = Statements::render(templates, table);
        statements.claim = Arc::from(render(table, templates.claim_async));
        statements.claim_fresh = Arc::from(render(table, templates.claim_fresh_async));
        statements.claim_many_fresh = Arc::from(render(table, templates.claim_many_fresh_async));
        statements.claim_many = Arc::from(render(table, templates.claim_many_async));
        statements
    }

    pub(crate) fn render(templates: &Templates, table: &TableName) -> Statements {
        let render = |sql: &str| Arc::from(render(table, sql));
        Statements {
            claim: render(templates.claim),
            seen: render(templates.seen),
            complete: render(templates.complete),
            release: render(templates.release),
            renew: render(templates.renew),
            reopen: render(templates.reopen),
            read: render(templates.read),
            purge: render(templates.purge),
            scan: render(templates.scan),
            delete: render(templates.delete),
            delete_corrupt: render(templates.delete_corrupt),
            complete_many: render(templates.complete_many),
            claim_many: render(templates.claim_many),
            seen_many: render(templates.seen_many),
            claim_fresh: render(templates.claim_fresh),
            claim_many_fresh: render(templates.claim_many_fresh),
            claim_reporting: render(templates.claim_reporting),
            claim_many_reporting: render(templates.claim_many_reporting),
        }
    }

    /// Drops the statements that return rows from a write, for a server that cannot send
    /// them ([`DialectImpl::reports_claims`]): the claims are then the plain statements, followed
    /// by reads.
    pub(crate) fn without_reporting(mut self) -> Statements {
        let none: Arc<str> = Arc::from("");
        self.claim_fresh = none.clone();
        self.claim_many_fresh = none.clone();
        self.claim_reporting = none.clone();
        self.claim_many_reporting = none;
        self
    }

    /// The claim statement: one atomic statement that takes the key when its record is free.
    pub fn claim(&self) -> &str {
        &self.claim
    }

    /// The insert-only claim sent first on PostgreSQL and on MariaDB 10.5 and later, which
    /// acquires a key that has no row and leaves any row alone (the full
    /// [`claim`](Self::claim) follows it, returning the record, when the key had one), or
    /// `None` where the claim statement is sent alone.
    pub fn claim_fresh(&self) -> Option<&str> {
        Some(&*self.claim_fresh).filter(|sql| !sql.is_empty())
    }

    /// The completion statement (owner-checked).
    pub fn complete(&self) -> &str {
        &self.complete
    }

    /// The release statement (owner-checked).
    pub fn release(&self) -> &str {
        &self.release
    }

    /// The lease renewal statement (owner-checked).
    pub fn renew(&self) -> &str {
        &self.renew
    }

    /// The statement that reads a live record.
    pub fn read(&self) -> &str {
        &self.read
    }

    /// The statement that deletes one batch of expired records.
    pub fn purge(&self) -> &str {
        &self.purge
    }

    /// The statement that claims a batch of keys at once, or `None` when the database claims
    /// a batch one key at a time. On SQLite it holds a `{rows}` marker, replaced by one row
    /// of placeholders per key when it is sent.
    pub fn claim_many(&self) -> Option<&str> {
        Some(&*self.claim_many).filter(|sql| !sql.is_empty())
    }

    /// The insert-only claim of a batch, sent on PostgreSQL and on MariaDB 10.5 and later,
    /// which acquires the keys that have no row (the full batch claim follows for the
    /// others), or `None` where the batch claim is sent alone. On PostgreSQL it answers the
    /// positions and fences of the keys it took in one row; on MariaDB it holds a `{rows}`
    /// marker, as [`claim_many`](Self::claim_many) does, and returns each key's row.
    pub fn claim_many_fresh(&self) -> Option<&str> {
        Some(&*self.claim_many_fresh).filter(|sql| !sql.is_empty())
    }

    /// The statement that completes and releases a batch of keys at once (owner-checked), or
    /// `None` when the database ends a batch one key at a time. On MySQL and SQLite it
    /// holds a `{rows}` marker, replaced by one row of placeholders per item when it is sent.
    pub fn complete_many(&self) -> Option<&str> {
        Some(&*self.complete_many).filter(|sql| !sql.is_empty())
    }
}

/// What makes a database a [`Dialect`]: its statements and the calls that differ between
/// databases. One idea with [`Dialect`], split in two only to seal it: this half is not
/// nameable outside the crate, so no other type can implement it.
#[allow(unreachable_pub)] // reachable as the supertrait of `Dialect`, but not nameable
pub trait DialectImpl: SqlDatabase {
    /// The statements.
    const SQL: Templates;
    /// The migrations, oldest first: version, description, SQL for `idempotent_records`.
    const MIGRATIONS: &'static [(i64, &'static str, &'static str)];

    /// Opens a pool on `url` with `options` (tuned for the database where it needs it).
    fn open(
        options: PoolOptions<Self>,
        url: &str,
    ) -> BoxFuture<'_, Result<Pool<Self>, sqlx::Error>>;

    /// Whether the server takes the statements that return rows from a write
    /// ([`Templates::claim_reporting`] and the others), read from `pool` once when the store
    /// is built. The default: the dialect has none.
    fn reports_claims(pool: &Pool<Self>) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        let _ = pool;
        Box::pin(async { Ok(false) })
    }

    /// Sends the claim statement for `req` and reports what it did. `fresh` says whether
    /// the key may have no record: false once the caller has seen one (a later occurrence of
    /// a key in a batch, a claim sent again). A dialect that sends an insert-only claim first
    /// ([`Templates::claim_fresh`]) skips it when `fresh` is false, as it would only meet the
    /// row.
    fn claim<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c Statements,
        req: &'c ClaimRequest,
        fresh: bool,
    ) -> BoxFuture<'c, Result<Step, sqlx::Error>>;

    /// The most distinct keys [`claim_batch`](DialectImpl::claim_batch) claims in one statement;
    /// zero when the dialect claims a batch one key at a time.
    const BATCH: usize = 0;

    /// Claims `reqs` (distinct keys, at most [`BATCH`](DialectImpl::BATCH) of them) with one
    /// statement and reports, for each request in order, what it did. The default claims
    /// them one after another.
    fn claim_batch<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c Statements,
        reqs: &'c [&'c ClaimRequest],
    ) -> BoxFuture<'c, Result<Vec<Step>, sqlx::Error>> {
        Box::pin(async move {
            let mut steps = Vec::with_capacity(reqs.len());
            for req in reqs {
                steps.push(Self::claim(&mut *conn, sql, req, true).await?);
            }
            Ok(steps)
        })
    }

    /// Sends the insert-only claim of `reqs` ([`Templates::claim_many_fresh`], which the
    /// caller checked this dialect has: distinct keys, at most [`BATCH`](DialectImpl::BATCH)
    /// of them) and reports, for each request in order, the step of a key it took, or
    /// `None` for a key it left to [`claim_batch`](DialectImpl::claim_batch). The default
    /// takes none.
    fn claim_batch_fresh<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c Statements,
        reqs: &'c [&'c ClaimRequest],
    ) -> BoxFuture<'c, Result<Vec<Option<Step>>, sqlx::Error>> {
        let _ = (conn, sql);
        Box::pin(async move { Ok(reqs.iter().map(|_| None).collect()) })
    }

    /// The most endings [`complete_batch`](DialectImpl::complete_batch) sends in one statement;
    /// zero when the dialect ends a batch one key at a time.
    const COMPLETE_BATCH: usize = 0;

    /// Whether [`complete_batch`](DialectImpl::complete_batch) takes releases too; when `false`, a
    /// batch's releases (and every later ending of their keys) are sent one by one, after
    /// its completions.
    const BATCH_RELEASES: bool = true;

    /// Completes or releases `items` (distinct keys, at most
    /// [`COMPLETE_BATCH`](DialectImpl::COMPLETE_BATCH) of them, results within the statement's size)
    /// with one statement, and reports for each item, in order, whether it ended its
    /// record (an item that did not is answered by reading its record). Only called when
    /// `COMPLETE_BATCH` is not zero.
    fn complete_batch<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c Statements,
        items: &'c [&'c Ending],
    ) -> BoxFuture<'c, Result<Vec<bool>, sqlx::Error>> {
        let _ = (conn, sql, items);
        Box::pin(async {
            Err(sqlx::Error::Protocol(
                "this database ends a batch one key at a time".into(),
            ))
        })
    }

    /// Executes a statement; returns the rows it matched.
    fn execute<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c Arc<str>,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// Fetches keyed record rows (`record_key`, then the record columns); a row whose record
    /// columns do not decode is that key's error.
    #[allow(clippy::type_complexity)]
    fn fetch_keyed<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c Arc<str>,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Vec<(Vec<u8>, Result<RecordRow, sqlx::Error>)>, sqlx::Error>>;

    /// Fetches at most one record row.
    fn fetch<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c Arc<str>,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Option<RecordRow>, sqlx::Error>>;

    /// The largest stored result the database takes, in bytes, read from `pool` once when
    /// the store is built: the result column's capacity and the server's own limits, less
    /// [`HEADROOM`] for the rest of the statement or row.
    fn result_capacity(pool: &Pool<Self>) -> BoxFuture<'_, Result<usize, sqlx::Error>>;

    /// Runs `migrator`, whose migrations table is `migrations_table`, on `conn`, holding a
    /// lock that keeps other processes' migrations of the table out meanwhile.
    fn migrate<'c>(
        conn: &'c mut Self::Connection,
        migrator: &'c mut Migrator,
        migrations_table: &'c str,
    ) -> BoxFuture<'c, Result<(), crate::error::StoreError>>;
}

/// A database a [`SqlStore`](super::SqlStore) runs on: sqlx's [`Postgres`](sqlx::Postgres),
/// [`MySql`](sqlx::MySql) or [`Sqlite`](sqlx::Sqlite), as the database features enable them.
/// Sealed.
pub trait Dialect: DialectImpl {}

impl<DB: DialectImpl> Dialect for DB {}

/// What a stored result leaves to the rest of a statement or row (the key, the token, the
/// other columns, the protocol's framing) below a database's limit on one value or packet.
pub(crate) const HEADROOM: usize = 64 << 10;

/// A duration in `tick`s (a microsecond or a millisecond), by the rule every store follows
/// ([`clamped_millis`]): whole milliseconds, rounded up, within
/// [`MIN_DURATION`](crate::store::MIN_DURATION) ..= [`MAX_DURATION`](crate::store::MAX_DURATION),
/// so a lease is never zero and `now + duration` stays within every database's time range.
pub(crate) fn ticks(duration: Duration, tick: Duration) -> i64 {
    crate::database::ticks(clamped_millis(duration), tick)
}

/// A shipped template with `idempotent_records` (and the names derived from it) replaced by
/// `table`'s names. Only whole identifiers are replaced.
pub(crate) fn render(table: &TableName, template: &str) -> String {
    table.render_for(template, DEFAULT_TABLE, &["_expires_at"])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_whole_milliseconds_in_range() {
        use crate::store::MAX_DURATION;

        let micro = Duration::from_micros(1);
        let milli = Duration::from_millis(1);
        assert_eq!(ticks(Duration::from_millis(300), micro), 300_000);
        assert_eq!(ticks(Duration::from_nanos(1), micro), 1_000);
        assert_eq!(ticks(Duration::from_micros(1500), micro), 2_000);
        assert_eq!(ticks(Duration::from_micros(1500), milli), 2);
        assert_eq!(ticks(Duration::ZERO, milli), 1);
        let longest = i64::try_from(MAX_DURATION.as_micros()).unwrap();
        assert_eq!(ticks(Duration::MAX, micro), longest);
        assert_eq!(ticks(MAX_DURATION, micro), longest);
        assert_eq!(ticks(Duration::MAX, milli), longest / 1000);
    }
}
