//! MySQL and MariaDB: the claim is one `INSERT ... ON DUPLICATE KEY UPDATE` with conditional
//! assignments, which reports an acquisition through `LAST_INSERT_ID(expr)` in the same
//! reply; a claim that did not take the key reads the record with a locking read.

use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::mysql::{MySql, MySqlConnection, MySqlDatabaseError};
use sqlx::pool::PoolOptions;
use sqlx::{AssertSqlSafe, Pool};

use crate::store::sql::driver::{statement_fns, ticks, Arg, Driver, Statements, Templates};
use crate::store::sql::error::{sqlstate, DbFailure};
use crate::store::sql::record::Step;
use crate::store::{BoxFuture, ClaimRequest};

/// Takes the key when its record is free (absent, expired, released, or in progress with a
/// run-out lease and no other payload); leaves any other record unchanged.
///
/// InnoDB locks the duplicate row exclusively before the `UPDATE` part runs, so exactly one
/// of any number of concurrent claims takes a free record. The `UPDATE` part's assignments
/// run left to right and each sees the columns assigned before it, so the "free" test is
/// evaluated only while the columns it reads (`state`, `lease_until`, `expires_at`,
/// `fingerprint`) are untouched: by `fence` and `token`. After `token` is assigned,
/// `token = VALUES(token)` says whether this claim took the record (tokens are never reused).
///
/// `LAST_INSERT_ID(n)` makes the reply carry `n`: the fence when the record was inserted
/// (1) or taken over (the new fence), and 0 when it was left alone. A 0 is answered by a
/// locking read of the record, so a server that did not report the value would cost a
/// round trip, never a wrong answer.
const CLAIM: &str = "\
INSERT INTO idempotent_records
    (record_key, prefix, token, fence, state, lease_until, result, fingerprint,
     created_at, updated_at, expires_at)
VALUES (?, ?, ?, LAST_INSERT_ID(1), 'in_progress', UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
        NULL, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
ON DUPLICATE KEY UPDATE
    fence = IF(expires_at <= UTC_TIMESTAMP(6) OR state = 'released'
                  OR (state = 'in_progress' AND lease_until <= UTC_TIMESTAMP(6)
                      AND NOT (fingerprint IS NOT NULL AND VALUES(fingerprint) IS NOT NULL
                               AND fingerprint <> VALUES(fingerprint))),
               LAST_INSERT_ID(IF(expires_at <= UTC_TIMESTAMP(6), 1, fence + 1)),
               fence + LAST_INSERT_ID(0)),
    created_at = IF(expires_at <= UTC_TIMESTAMP(6), VALUES(created_at), created_at),
    token = IF(expires_at <= UTC_TIMESTAMP(6) OR state = 'released'
                  OR (state = 'in_progress' AND lease_until <= UTC_TIMESTAMP(6)
                      AND NOT (fingerprint IS NOT NULL AND VALUES(fingerprint) IS NOT NULL
                               AND fingerprint <> VALUES(fingerprint))),
               VALUES(token), token),
    result = IF(token = VALUES(token), NULL, result),
    updated_at = IF(token = VALUES(token), VALUES(updated_at), updated_at),
    lease_until = IF(token = VALUES(token), VALUES(lease_until), lease_until),
    fingerprint = IF(token = VALUES(token), VALUES(fingerprint), fingerprint),
    expires_at = IF(token = VALUES(token), VALUES(expires_at), expires_at),
    state = IF(token = VALUES(token), 'in_progress', state)";

const READ: &str = "\
SELECT state, token, fence, fingerprint, result,
       GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until))
FROM idempotent_records
WHERE record_key = ? AND expires_at > UTC_TIMESTAMP(6)";

/// A locking read: it returns the latest committed version (not a transaction's snapshot)
/// and, inside a transaction, keeps the row locked like the claim did.
const SEEN: &str = "\
SELECT state, token, fence, fingerprint, result,
       GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until))
FROM idempotent_records
WHERE record_key = ? AND expires_at > UTC_TIMESTAMP(6)
FOR UPDATE";

/// `state` is assigned last: the assignments before it test the old state.
const COMPLETE: &str = "\
UPDATE idempotent_records SET
    result = IF(state = 'in_progress', ?, result),
    expires_at = IF(state = 'in_progress', UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, expires_at),
    updated_at = IF(state = 'in_progress', UTC_TIMESTAMP(6), updated_at),
    state = 'completed'
WHERE record_key = ? AND token = ? AND state <> 'released' AND expires_at > UTC_TIMESTAMP(6)";

const RELEASE: &str = "\
UPDATE idempotent_records SET state = 'released', updated_at = UTC_TIMESTAMP(6)
WHERE record_key = ? AND token = ? AND state = 'in_progress' AND expires_at > UTC_TIMESTAMP(6)";

const RENEW: &str = "\
UPDATE idempotent_records SET
    lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
    expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND),
    updated_at = UTC_TIMESTAMP(6)
WHERE record_key = ? AND token = ? AND state = 'in_progress' AND expires_at > UTC_TIMESTAMP(6)";

/// Each row is deleted only if it is still expired when the delete reaches it.
const PURGE: &str = "\
DELETE FROM idempotent_records
WHERE expires_at <= UTC_TIMESTAMP(6)
ORDER BY expires_at
LIMIT ?";

// The migration's column sizes hold every key and prefix the key module can produce.
const _: () = assert!(crate::key::MAX_KEY_LEN <= 512 && crate::key::MAX_PREFIX_LEN <= 128);

impl Driver for MySql {
    const SCHEMA_QUALIFIED: bool = false;
    const TICK: Duration = Duration::from_micros(1);
    const SQL: Templates = Templates {
        claim: CLAIM,
        seen: SEEN,
        complete: COMPLETE,
        release: RELEASE,
        renew: RENEW,
        read: READ,
        purge: PURGE,
        // A batch is claimed one key at a time.
        claim_many: "",
        seen_many: "",
    };
    const MIGRATIONS: &'static [(i64, &'static str, &'static str)] = &[(
        1,
        "create idempotent_records",
        include_str!("../../../migrations/mysql/0001_create_idempotent_records.sql"),
    )];

    fn open(
        options: PoolOptions<Self>,
        url: &str,
    ) -> BoxFuture<'_, Result<Pool<Self>, sqlx::Error>> {
        Box::pin(options.connect(url))
    }

    fn claim<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Statements,
        req: &'c ClaimRequest,
    ) -> BoxFuture<'c, Result<Step, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(sql.claim.clone()))
                .bind(req.key.as_bytes())
                .bind(req.key.prefix())
                .bind(&req.token.as_bytes()[..])
                .bind(ticks(req.lease, Self::TICK))
                .bind(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
                .bind(ticks(req.ttl.max(req.lease), Self::TICK))
                .execute(&mut *conn)
                .await?;
            if done.last_insert_id() > 0 {
                return Ok(Step::Acquired(done.last_insert_id()));
            }
            let key = [Arg::Bytes(req.key.as_bytes())];
            Ok(Step::Seen(Self::fetch(conn, &sql.seen, &key).await?))
        })
    }

    statement_fns!(MySqlConnection);

    fn classify(err: &dyn DatabaseError) -> DbFailure {
        let number = err
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number);
        match number {
            // ER_LOCK_WAIT_TIMEOUT (the statement was rolled back), ER_LOCK_DEADLOCK
            Some(1205 | 1213) => DbFailure::Conflict,
            // ER_OPTION_PREVENTS_STATEMENT (--read-only), ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION
            Some(1290 | 1792) => DbFailure::ReadOnly,
            // ER_SERVER_SHUTDOWN, ER_QUERY_INTERRUPTED, ER_CON_COUNT_ERROR,
            // ER_CONNECTION_KILLED (MariaDB)
            Some(1053 | 1317 | 1040 | 1927) => DbFailure::Unavailable,
            _ => err.code().map_or(DbFailure::Other, |code| sqlstate(&code)),
        }
    }
}
