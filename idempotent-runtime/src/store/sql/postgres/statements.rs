//! The SQL PostgreSQL is sent, written for the default table `idempotent_records`.

/// The database's clock in microseconds since the Unix epoch: the fence of a key that has no
/// record ([`next_fence`](crate::store::next_fence)). `statement_timestamp()` is one instant
/// for the whole statement.
macro_rules! clock_fence {
    () => {
        "(EXTRACT(EPOCH FROM statement_timestamp()) * 1000000)::int8"
    };
}

/// The columns of a record row (`$r` is `r.` or empty) hold what the store can read: a fence
/// that is not negative, a 16-byte token, a 16-byte fingerprint or none. Claims never take,
/// and owner-checked writes never change, a row that fails this: it is reported as corrupt.
macro_rules! readable {
    ($r:literal) => {
        concat!(
            $r,
            "fence >= 0 AND octet_length(",
            $r,
            "token) = 16 AND (",
            $r,
            "fingerprint IS NULL OR octet_length(",
            $r,
            "fingerprint) = 16)"
        )
    };
}

/// The `ON CONFLICT` part of both claim statements: takes the record when it is free
/// (expired, or readable and released, or readable, in progress with a run-out lease and no
/// other payload). The fence is one more than the record's, or, once the record expired, the
/// clock's fence (`EXCLUDED.fence`) if that is higher, so fences never repeat for a key.
macro_rules! take_if_free {
    () => {
        concat!(
            "ON CONFLICT (record_key) DO UPDATE SET
        token = EXCLUDED.token,
        fence = CASE WHEN r.expires_at <= statement_timestamp()
                     THEN GREATEST(r.fence + 1, EXCLUDED.fence) ELSE r.fence + 1 END,
        state = 'in_progress',
        lease_until = EXCLUDED.lease_until,
        result = NULL,
        fingerprint = EXCLUDED.fingerprint,
        created_at = CASE WHEN r.expires_at <= statement_timestamp()
                          THEN EXCLUDED.created_at ELSE r.created_at END,
        updated_at = EXCLUDED.updated_at,
        expires_at = EXCLUDED.expires_at
    WHERE r.expires_at <= statement_timestamp()
       OR (",
            readable!("r."),
            "
           AND (r.state = 'released'
                OR (r.state = 'in_progress' AND r.lease_until <= statement_timestamp()
                    AND NOT (r.fingerprint IS NOT NULL AND EXCLUDED.fingerprint IS NOT NULL
                             AND r.fingerprint <> EXCLUDED.fingerprint))))"
        )
    };
}

/// The new record's state, `'in_progress'`, computed by a call that sets
/// `synchronous_commit` to `off` for the current transaction only (`set_config(..., true)`,
/// as `SET LOCAL` does): the autocommit transaction of the claim statement commits without
/// waiting for its WAL to reach the disk.
macro_rules! async_state {
    () => {
        "CASE WHEN set_config('synchronous_commit', 'off', true) = 'off' THEN 'in_progress' END"
    };
}

/// The insert of a claim with `$state` for the new record's state (an expression that is
/// `'in_progress'`): the record a key that has none gets, fenced by the clock.
macro_rules! insert_claim {
    ($state:expr) => {
        concat!(
            "\
INSERT INTO idempotent_records AS r
        (record_key, prefix, token, fence, state, lease_until, result, fingerprint,
         created_at, updated_at, expires_at)
    VALUES ($1, $2, $3, ",
            clock_fence!(),
            ", ",
            $state,
            ",
            statement_timestamp() + $4 * INTERVAL '1 microsecond',
            NULL, $5, statement_timestamp(), statement_timestamp(),
            statement_timestamp() + $6 * INTERVAL '1 microsecond')"
        )
    };
}

/// [`CLAIM`], with `$state` for the new record's state (an expression that is
/// `'in_progress'`).
macro_rules! claim_statement {
    ($state:expr) => {
        concat!(
            "WITH taken AS (\n    ",
            insert_claim!($state),
            "
    ",
            take_if_free!(),
            "
    RETURNING r.state, r.token, r.fence, r.fingerprint, r.result, 0::int8 AS lease_left
)
SELECT state, token, fence, fingerprint, result, lease_left FROM taken
UNION ALL
SELECT state, token, fence, fingerprint, result,
       GREATEST(0, (EXTRACT(EPOCH FROM lease_until - statement_timestamp()) * 1000000)::int8)
FROM idempotent_records
WHERE record_key = $1 AND expires_at > statement_timestamp()
  AND NOT EXISTS (SELECT 1 FROM taken)"
        )
    };
}

/// The insert-only claim sent before [`CLAIM`], with `$state` as in [`claim_statement!`]:
/// it takes a key that has no record, as [`CLAIM`] would, and leaves any record alone
/// (`DO NOTHING` waits for a concurrent insert of the key to commit or roll back, then
/// conflicts with its row). It returns the new record, or no row, in which case [`CLAIM`]
/// follows. The server does a fraction of [`CLAIM`]'s work for it: no `DO UPDATE` clause
/// to plan and no second branch to report a record it did not take.
macro_rules! claim_fresh_statement {
    ($state:expr) => {
        concat!(
            insert_claim!($state),
            "
ON CONFLICT (record_key) DO NOTHING
RETURNING state, token, fence, fingerprint, result, 0::int8 AS lease_left"
        )
    };
}

pub(super) const CLAIM_FRESH: &str = claim_fresh_statement!("'in_progress'");

/// [`CLAIM_FRESH`] committed asynchronously, as [`CLAIM_ASYNC`].
pub(super) const CLAIM_FRESH_ASYNC: &str = claim_fresh_statement!(async_state!());

/// Takes the key when its record is free (absent, expired, released, or in progress with a
/// run-out lease and no other payload), and reports the record either way.
///
/// `ON CONFLICT DO UPDATE` locks the conflicting row and evaluates `WHERE` on its latest
/// committed version, so exactly one of any number of concurrent claims takes a free record.
/// When it does not take it, `taken` is empty and the second branch reports the record as
/// of the statement's snapshot; `end` sends the statement again in the rare case that
/// the snapshot shows a free record (it changed while the statement waited for the lock).
pub(super) const CLAIM: &str = claim_statement!("'in_progress'");

/// [`CLAIM`] committed asynchronously: the state's expression turns `synchronous_commit`
/// off for the statement's own transaction (see `SqlStoreBuilder::asynchronous_claims`).
pub(super) const CLAIM_ASYNC: &str = claim_statement!(async_state!());

/// The rows of a batch claim: six parallel arrays (key, prefix, token, lease, fingerprint,
/// ttl) and each row's place in them. The lease and ttl arrays hold one value when every
/// item of the batch shares it (see [`insert_claims!`]): `unnest` pads them with `NULL`s.
macro_rules! batch_input {
    () => {
        "\
WITH input AS (
    SELECT * FROM unnest($1::bytea[], $2::text[], $3::bytea[], $4::int8[], $5::bytea[],
                         $6::int8[])
        WITH ORDINALITY AS i(record_key, prefix, token, lease, fingerprint, ttl, ord)
)"
    };
}

/// A time after the statement's timestamp, in microseconds, for each row of a batch claim:
/// the one value of the array parameter `$array` when it has one (every item shares it),
/// computed once for the statement as a scalar subquery; the row's own `$column` otherwise.
macro_rules! after_statement {
    ($array:literal, $column:literal) => {
        concat!(
            "CASE WHEN cardinality(",
            $array,
            "::int8[]) = 1
                THEN (SELECT statement_timestamp() + (",
            $array,
            "::int8[])[1] * INTERVAL '1 microsecond')
                ELSE statement_timestamp() + ",
            $column,
            " * INTERVAL '1 microsecond' END"
        )
    };
}

/// The insert of a batch claim's `input` rows in their order, with `$state` as in
/// [`insert_claim!`].
///
/// What is the same for every row is computed once for the statement, as a scalar subquery
/// (an init plan), not once per row: the clock's fence (a `numeric` computation), the state
/// (whose asynchronous form sets `synchronous_commit`), and the lease's end and the expiry
/// when every item shares its lease and its ttl, the common case, which the store then
/// binds as one-element arrays. On a batch of 100 fresh keys this is 14 % of the
/// insert-only claim's server instructions (counted on the backend under callgrind).
macro_rules! insert_claims {
    ($state:expr) => {
        concat!(
            "\
INSERT INTO idempotent_records AS r
        (record_key, prefix, token, fence, state, lease_until, result, fingerprint,
         created_at, updated_at, expires_at)
    SELECT record_key, prefix, token, (SELECT ",
            clock_fence!(),
            "), (SELECT ",
            $state,
            "),
           ",
            after_statement!("$4", "lease"),
            ",
           NULL::bytea, fingerprint, statement_timestamp(), statement_timestamp(),
           ",
            after_statement!("$6", "ttl"),
            "
    FROM input
    ORDER BY ord"
        )
    };
}

/// [`CLAIM_MANY`], with `$state` as in [`claim_statement!`].
macro_rules! claim_many_statement {
    ($state:expr) => {
        concat!(
            batch_input!(),
            ", taken AS (\n    ",
            insert_claims!($state),
            "
    ",
            take_if_free!(),
            "
    RETURNING r.record_key, r.state, r.token, r.fence, r.fingerprint, r.result,
              0::int8 AS lease_left
)
SELECT record_key, state, token, fence, fingerprint, result, lease_left FROM taken
UNION ALL
SELECT t.record_key, t.state, t.token, t.fence, t.fingerprint, t.result,
       GREATEST(0, (EXTRACT(EPOCH FROM t.lease_until - statement_timestamp()) * 1000000)::int8)
FROM idempotent_records AS t
WHERE t.record_key = ANY($1::bytea[])
  AND t.expires_at - statement_timestamp() > INTERVAL '0'
  AND t.record_key NOT IN (SELECT record_key FROM taken)"
        )
    };
}

/// The insert-only claim of a batch, sent before [`CLAIM_MANY`] as [`CLAIM_FRESH`] is before
/// [`CLAIM`], with `$state` as in [`claim_statement!`]: it takes the keys that have no
/// record, and answers in one row the positions (from 1) of the keys it took, `NULL` when it
/// took them all, and their fences (one per key taken). [`CLAIM_MANY`] follows for the keys
/// it did not take.
///
/// Every key it takes gets the same fence, the clock's at the statement's timestamp (a key
/// with no record has no fence to go on from), so the fences are aggregated in any order,
/// and the inserted rows are matched to their positions only when it did not take them all:
/// the join with the keys' positions is a scalar subquery that runs only then (on a batch of
/// 100 fresh keys, 0.05 ms of the statement's 0.8). It unnests the keys again rather than
/// reading `input`: a `WITH` query read twice is materialized, and `input` read once is
/// folded into the insert (5 % of the statement's server instructions).
macro_rules! claim_many_fresh_statement {
    ($state:expr) => {
        concat!(
            batch_input!(),
            ", taken AS (\n",
            insert_claims!($state),
            "
ON CONFLICT (record_key) DO NOTHING
RETURNING record_key, fence
)
SELECT CASE WHEN count(*) = cardinality($1::bytea[]) THEN NULL
            ELSE (SELECT coalesce(array_agg(i.ord ORDER BY i.ord), ARRAY[]::int8[])
                  FROM taken
                  JOIN unnest($1::bytea[]) WITH ORDINALITY AS i(record_key, ord)
                  USING (record_key)) END,
       coalesce(array_agg(t.fence), ARRAY[]::int8[])
FROM taken AS t"
        )
    };
}

pub(super) const CLAIM_MANY_FRESH: &str = claim_many_fresh_statement!("'in_progress'");

/// [`CLAIM_MANY_FRESH`] committed asynchronously, as [`CLAIM_ASYNC`].
pub(super) const CLAIM_MANY_FRESH_ASYNC: &str = claim_many_fresh_statement!(async_state!());

/// The claim of a batch of distinct keys: [`CLAIM`] over the rows of six parallel arrays
/// (key, prefix, token, lease, fingerprint, ttl; the lease and ttl arrays of one value when
/// the items share it), one statement whatever the outcomes. The
/// rows are inserted in the arrays' order (the store sorts them by key, so that concurrent
/// overlapping batches lock their rows in the same order). Each taken key is returned by
/// `taken`; the live record of every other key is returned as of the statement's snapshot,
/// as the single claim does. Rows come back in no particular order, `record_key` first.
///
/// The live records are looked up with `record_key = ANY($1)`, not by joining `input`: a
/// connection keeps the generic plan of a prepared statement, and a join planned while the
/// table was empty or never analyzed (a new table, one just truncated) is a sequential scan
/// that every later batch then pays in full as the table grows. `ANY` on the primary key is
/// an index lookup of the batch's keys on a new table and on an analyzed one (a truncated
/// one: see [`COMPLETE_MANY`]). Their expiry is
/// tested as `expires_at - now > 0`, which no index answers: written `expires_at > now`,
/// the generic plan made on a filled table without statistics ANDs the key lookup with a
/// scan of the `expires_at` index, which reads an entry for every live record, batch after
/// batch.
pub(super) const CLAIM_MANY: &str = claim_many_statement!("'in_progress'");

/// [`CLAIM_MANY`] committed asynchronously, as [`CLAIM_ASYNC`].
pub(super) const CLAIM_MANY_ASYNC: &str = claim_many_statement!(async_state!());

/// The record columns, then how long the record has been in its state and how long it has
/// left, in microseconds.
macro_rules! listed_columns {
    () => {
        "state, token, fence, fingerprint, result,
       GREATEST(0, (EXTRACT(EPOCH FROM lease_until - statement_timestamp()) * 1000000)::int8),
       GREATEST(0, (EXTRACT(EPOCH FROM statement_timestamp() - updated_at) * 1000000)::int8),
       GREATEST(0, (EXTRACT(EPOCH FROM expires_at - statement_timestamp()) * 1000000)::int8)"
    };
}

pub(super) const READ: &str = concat!(
    "SELECT ",
    listed_columns!(),
    "
FROM idempotent_records
WHERE record_key = $1 AND expires_at > statement_timestamp()"
);

/// A page of live records with the prefix `$3`, by key after `$1` and below `$2` (a range of
/// the primary key), at most `$4`.
pub(super) const SCAN: &str = concat!(
    "SELECT record_key, ",
    listed_columns!(),
    "
FROM idempotent_records
WHERE record_key > $1 AND record_key < $2 AND prefix = $3
  AND expires_at > statement_timestamp()
ORDER BY record_key
LIMIT $4"
);

/// Completes and releases the items of five parallel arrays (key, token, result, ttl,
/// complete?), each as [`COMPLETE`] or [`RELEASE`] would, and answers in one row: `NULL`
/// when it ended every item, otherwise the positions (from 1) of the items it ended (an
/// empty array when none; `array_agg` of no rows is `NULL`), gathered by a second read of
/// `ended` that runs only then. An item whose record is already completed by its token is
/// ended again (unchanged), as a retried completion is. `record_key = ANY($1)` makes the
/// rows an index lookup of the batch's keys on a new table and on an analyzed one, as in
/// [`CLAIM_MANY`]: joined with `input` alone, the generic plan made on a new table scans
/// the whole table. After a
/// `TRUNCATE`, until the table is analyzed again (autovacuum does within its naptime, a
/// minute by default), a connection's generic plan can still be a sequential scan with `ANY`
/// as its filter: measured at 6 to 11 ms a batch of 100 on 1,400 rows, growing with the
/// table, against 0.8 ms. Expiry is tested with no index, as in [`CLAIM_MANY`].
///
/// The items are numbered by a `generate_series` zipped with their `unnest` (`ROWS FROM`),
/// not `WITH ORDINALITY`: a generic plan estimates an `unnest` of a parameter at ten rows,
/// and on a table planned while nearly empty it joined the items to the rows by a nested
/// loop that read every item again for every row (3.4 ms a batch of 100, 70 ms one of 500,
/// against 0.7 and 3.2 joined by a hash). The series is estimated at a thousand rows, which
/// leaves the join a hash of the table's rows, whatever the table's statistics.
///
/// The tests of a row (its state, readability and expiry) and of a row against its item (a
/// completed record is ended again by a completion only) are written as two `CASE`s, which
/// the planner estimates as true of half the rows each and from which it draws no test of
/// its own. Written as plain conditions, a custom plan (PostgreSQL's plan for the first five
/// executions of a prepared statement on a connection, and for later ones while it costs
/// less than the generic plan, made with the arrays' values in place) on a table without
/// statistics estimated each test at half a percent of the rows, so one row of the table to
/// join, and joined by a nested loop again (3.6 ms a batch of 100 on 2,500 records, against
/// 0.9).
pub(super) const COMPLETE_MANY: &str = concat!(
    "\
WITH input AS (
    SELECT * FROM ROWS FROM (
        unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::int8[], $5::bool[]),
        generate_series(1::int8, cardinality($1::bytea[]))
    ) AS i(record_key, token, result, ttl, complete, n)
), ended AS (
UPDATE idempotent_records AS r SET
    result = CASE WHEN i.complete AND r.state = 'in_progress' THEN i.result ELSE r.result END,
    expires_at = CASE WHEN i.complete AND r.state = 'in_progress'
                      THEN statement_timestamp() + i.ttl * INTERVAL '1 microsecond'
                      ELSE r.expires_at END,
    updated_at = CASE WHEN r.state = 'in_progress' THEN statement_timestamp()
                      ELSE r.updated_at END,
    state = CASE WHEN i.complete THEN 'completed' ELSE 'released' END
FROM input AS i
WHERE r.record_key = ANY($1::bytea[]) AND r.record_key = i.record_key AND r.token = i.token
  AND CASE WHEN r.state IN ('in_progress', 'completed') AND ",
    readable!("r."),
    "
                AND r.expires_at - statement_timestamp() > INTERVAL '0'
           THEN true ELSE false END
  AND CASE WHEN r.state = 'in_progress' THEN true ELSE i.complete AND r.state = 'completed' END
RETURNING i.n
)
SELECT CASE WHEN count(*) = cardinality($1::bytea[]) THEN NULL
            ELSE (SELECT coalesce(array_agg(n), ARRAY[]::int8[]) FROM ended) END
FROM ended"
);

pub(super) const DELETE: &str = concat!(
    "DELETE FROM idempotent_records
WHERE record_key = $1 AND token = $2 AND expires_at > statement_timestamp()
  AND NOT (state = 'in_progress' AND lease_until > statement_timestamp())
  AND state IN ('in_progress', 'completed', 'released') AND ",
    readable!("")
);

pub(super) const DELETE_CORRUPT: &str = concat!(
    "DELETE FROM idempotent_records WHERE record_key = $1
  AND NOT (state IN ('in_progress', 'completed', 'released') AND ",
    readable!(""),
    ")"
);

pub(super) const COMPLETE: &str = concat!(
    "\
UPDATE idempotent_records SET
    result = CASE WHEN state = 'in_progress' THEN $1 ELSE result END,
    expires_at = CASE WHEN state = 'in_progress'
                      THEN statement_timestamp() + $2 * INTERVAL '1 microsecond'
                      ELSE expires_at END,
    updated_at = CASE WHEN state = 'in_progress' THEN statement_timestamp() ELSE updated_at END,
    state = 'completed'
WHERE record_key = $3 AND token = $4 AND state IN ('in_progress', 'completed')
  AND ",
    readable!(""),
    " AND expires_at > statement_timestamp()"
);

pub(super) const REOPEN: &str = concat!(
    "\
UPDATE idempotent_records SET state = 'released', result = NULL,
    updated_at = statement_timestamp()
WHERE record_key = $1 AND token = $2 AND state IN ('in_progress', 'completed', 'released')
  AND ",
    readable!(""),
    " AND expires_at > statement_timestamp()"
);

pub(super) const RELEASE: &str = concat!(
    "\
UPDATE idempotent_records SET state = 'released', updated_at = statement_timestamp()
WHERE record_key = $1 AND token = $2 AND state = 'in_progress'
  AND ",
    readable!(""),
    " AND expires_at > statement_timestamp()"
);

pub(super) const RENEW: &str = concat!(
    "\
UPDATE idempotent_records SET
    lease_until = statement_timestamp() + $1 * INTERVAL '1 microsecond',
    expires_at = GREATEST(expires_at, statement_timestamp() + $2 * INTERVAL '1 microsecond')
WHERE record_key = $3 AND token = $4 AND state = 'in_progress'
  AND ",
    readable!(""),
    " AND expires_at > statement_timestamp()"
);

/// The locked rows are skipped (a claim is reviving them), and the outer condition is
/// evaluated again on the row's latest version, so a record taken over after the inner
/// `SELECT` is never deleted.
pub(super) const PURGE: &str = "\
DELETE FROM idempotent_records
WHERE record_key IN (SELECT record_key FROM idempotent_records
                     WHERE expires_at <= statement_timestamp()
                     ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)
  AND expires_at <= statement_timestamp()";
