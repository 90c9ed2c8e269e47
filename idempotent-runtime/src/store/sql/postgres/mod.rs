//! PostgreSQL: the claim is one `INSERT ... ON CONFLICT DO UPDATE ... WHERE <free>` inside a
//! statement that also reports the record when the claim did not take it.

use std::sync::Arc;

use sqlx::pool::PoolOptions;
use sqlx::postgres::{PgArguments, PgConnection, Postgres};
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, Pool, Row};

use crate::database::SqlDatabase;
use crate::store::sql::bind::{ending_args, statement_fns};
use crate::store::sql::by_key::{by_position, claim_keys, ended_at, in_request_order};
use crate::store::sql::dialect::{ticks, DialectImpl, Statements, Templates, HEADROOM};
use crate::store::sql::record::{RecordRow, Step};
use crate::store::{BoxFuture, ClaimRequest, Ending};

mod statements;

use statements::{
    CLAIM, CLAIM_ASYNC, CLAIM_FRESH, CLAIM_FRESH_ASYNC, CLAIM_MANY, CLAIM_MANY_ASYNC,
    CLAIM_MANY_FRESH, CLAIM_MANY_FRESH_ASYNC, COMPLETE, COMPLETE_MANY, DELETE, DELETE_CORRUPT,
    PURGE, READ, RELEASE, RENEW, REOPEN, SCAN,
};

impl DialectImpl for Postgres {
    const SQL: Templates = Templates {
        claim: CLAIM,
        seen: READ,
        complete: COMPLETE,
        release: RELEASE,
        reopen: REOPEN,
        renew: RENEW,
        read: READ,
        purge: PURGE,
        scan: SCAN,
        delete: DELETE,
        delete_corrupt: DELETE_CORRUPT,
        complete_many: COMPLETE_MANY,
        claim_async: CLAIM_ASYNC,
        claim_many_async: CLAIM_MANY_ASYNC,
        claim_many: CLAIM_MANY,
        // The batch statement reports the records it did not take.
        seen_many: "",
        claim_fresh: CLAIM_FRESH,
        claim_fresh_async: CLAIM_FRESH_ASYNC,
        claim_many_fresh: CLAIM_MANY_FRESH,
        claim_many_fresh_async: CLAIM_MANY_FRESH_ASYNC,
        claim_reporting: "",
        claim_many_reporting: "",
    };
    const MIGRATIONS: &'static [(i64, &'static str, &'static str)] = &[(
        1,
        "create idempotent_records",
        include_str!("../../../../migrations/postgres/0001_create_idempotent_records.sql"),
    )];

    fn open(
        options: PoolOptions<Self>,
        url: &str,
    ) -> BoxFuture<'_, Result<Pool<Self>, sqlx::Error>> {
        Box::pin(options.connect(url))
    }

    /// Every PostgreSQL `INSERT` takes a `RETURNING` clause: the claim sends
    /// [`CLAIM_FRESH`] first, unless the store was built with `plain_claims`.
    fn reports_claims(_: &Pool<Self>) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        Box::pin(async { Ok(true) })
    }

    /// [`CLAIM_FRESH`], and when it met a row, [`CLAIM`]: an absent key is acquired in one
    /// round trip, any other claim is answered in two. Nothing happens between the two
    /// statements: the first one changed nothing when the second one is sent.
    fn claim<'c>(
        conn: &'c mut PgConnection,
        sql: &'c Statements,
        req: &'c ClaimRequest,
        fresh: bool,
    ) -> BoxFuture<'c, Result<Step, sqlx::Error>> {
        Box::pin(async move {
            let send = |statement: &Arc<str>| {
                sqlx::query(AssertSqlSafe(statement.clone()))
                    .bind(req.key.as_bytes())
                    .bind(req.key.prefix())
                    .bind(&req.token.as_bytes()[..])
                    .bind(ticks(req.lease, Self::TICK))
                    .bind(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
                    .bind(ticks(req.record_lifetime(), Self::TICK))
            };
            if fresh && !sql.claim_fresh.is_empty() {
                if let Some(row) = send(&sql.claim_fresh).fetch_optional(&mut *conn).await? {
                    return Ok(Step::Seen(Some(RecordRow::decode(&row)?)));
                }
            }
            let row = send(&sql.claim).fetch_optional(&mut *conn).await?;
            Ok(Step::Seen(row.as_ref().map(RecordRow::decode).transpose()?))
        })
    }

    const BATCH: usize = 500;

    /// [`CLAIM_MANY`]: the records of the keys it took and of those it did not.
    fn claim_batch<'c>(
        conn: &'c mut PgConnection,
        sql: &'c Statements,
        reqs: &'c [&'c ClaimRequest],
    ) -> BoxFuture<'c, Result<Vec<Step>, sqlx::Error>> {
        Box::pin(async move {
            let rows = bind_batch(&sql.claim_many, reqs).fetch_all(conn).await?;
            let mut seen = claim_keys(reqs);
            for row in &rows {
                let (key, step) = RecordRow::decode_keyed(row)?;
                seen.insert(&key, step);
            }
            Ok(in_request_order(seen))
        })
    }

    /// [`CLAIM_MANY_FRESH`]: a batch of fresh keys is claimed in one round trip, answered
    /// in one row of positions and fences; the store sends [`CLAIM_MANY`] for the other keys.
    fn claim_batch_fresh<'c>(
        conn: &'c mut PgConnection,
        sql: &'c Statements,
        reqs: &'c [&'c ClaimRequest],
    ) -> BoxFuture<'c, Result<Vec<Option<Step>>, sqlx::Error>> {
        Box::pin(async move {
            let row = bind_batch(&sql.claim_many_fresh, reqs)
                .fetch_one(conn)
                .await?;
            let taken = by_position(reqs.len(), row.try_get(0)?, row.try_get(1)?)?;
            Ok(taken.into_iter().map(|f| f.map(Step::taken)).collect())
        })
    }

    const COMPLETE_BATCH: usize = 500;

    fn complete_batch<'c>(
        conn: &'c mut PgConnection,
        sql: &'c Statements,
        items: &'c [&'c Ending],
    ) -> BoxFuture<'c, Result<Vec<bool>, sqlx::Error>> {
        Box::pin(async move {
            let keys: Vec<&[u8]> = items.iter().map(|item| item.key.as_bytes()).collect();
            let tokens: Vec<&[u8]> = items
                .iter()
                .map(|item| &item.token.as_bytes()[..])
                .collect();
            let (mut results, mut ttls, mut completes) = (Vec::new(), Vec::new(), Vec::new());
            for item in items {
                let (result, ttl, complete) = ending_args(item, Self::TICK);
                results.push(result);
                ttls.push(ttl);
                completes.push(complete);
            }
            let ended: Option<Vec<i64>> =
                sqlx::query_scalar(AssertSqlSafe(sql.complete_many.clone()))
                    .bind(&keys)
                    .bind(&tokens)
                    .bind(&results)
                    .bind(&ttls)
                    .bind(&completes)
                    .fetch_one(conn)
                    .await?;
            ended_at(items.len(), ended)
        })
    }

    /// A `bytea` value is at most 1 GiB; a row (and the message carrying it) no more.
    fn result_capacity(_: &Pool<Self>) -> BoxFuture<'_, Result<usize, sqlx::Error>> {
        Box::pin(async { Ok((1 << 30) - 1 - HEADROOM) })
    }

    statement_fns!(PgConnection);
}

/// `statement` ([`CLAIM_MANY`] or [`CLAIM_MANY_FRESH`]) with the six arrays of `reqs`; the
/// leases and the ttls as one value each when every item has the same (the statements then
/// compute the lease's end and the expiry once, not per row).
fn bind_batch<'q>(
    statement: &Arc<str>,
    reqs: &[&'q ClaimRequest],
) -> Query<'q, Postgres, PgArguments> {
    let keys: Vec<&[u8]> = reqs.iter().map(|req| req.key.as_bytes()).collect();
    let prefixes: Vec<&str> = reqs.iter().map(|req| req.key.prefix()).collect();
    let tokens: Vec<&[u8]> = reqs.iter().map(|req| &req.token.as_bytes()[..]).collect();
    let leases: Vec<i64> = reqs
        .iter()
        .map(|req| ticks(req.lease, Postgres::TICK))
        .collect();
    let fingerprints: Vec<Option<&[u8]>> = reqs
        .iter()
        .map(|req| req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
        .collect();
    let ttls: Vec<i64> = reqs
        .iter()
        .map(|req| ticks(req.record_lifetime(), Postgres::TICK))
        .collect();
    sqlx::query(AssertSqlSafe(statement.clone()))
        .bind(keys)
        .bind(prefixes)
        .bind(tokens)
        .bind(shared(leases))
        .bind(fingerprints)
        .bind(shared(ttls))
}

/// `values` as one value when they are all the same, as they are when a batch's items share
/// a policy.
fn shared(mut values: Vec<i64>) -> Vec<i64> {
    if values.windows(2).all(|pair| pair[0] == pair[1]) {
        values.truncate(1);
    }
    values
}
