//! The SQL MySQL and MariaDB are sent, written for the default table
//! `idempotent_records`.

/// The database's clock in microseconds since the Unix epoch, in UTC whatever the session's
/// time zone: the fence of a key that has no record
/// ([`next_fence`](crate::store::next_fence)). `UTC_TIMESTAMP(6)` is one instant for the
/// whole statement.
macro_rules! clock_fence {
    () => {
        "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
    };
}

/// A free record: expired, or readable (a fence that is not negative; `token` and
/// `fingerprint` are `BINARY(16)`) and released or in progress with a run-out lease and no
/// other payload. A record that is not readable is never taken: it is reported as corrupt.
macro_rules! free {
    () => {
        "expires_at <= UTC_TIMESTAMP(6)
           OR (fence >= 0
               AND (state = 'released'
                    OR (state = 'in_progress' AND lease_until <= UTC_TIMESTAMP(6)
                        AND NOT (fingerprint IS NOT NULL AND VALUES(fingerprint) IS NOT NULL
                                 AND fingerprint <> VALUES(fingerprint)))))"
    };
}

/// The head of every claim: the table and its columns, up to `VALUES`.
macro_rules! insert_into {
    () => {
        "INSERT INTO idempotent_records
    (record_key, prefix, token, fence, state, lease_until, result, fingerprint,
     created_at, updated_at, expires_at)
VALUES "
    };
}

/// One row of the claim's `VALUES`: key, prefix, token, lease, fingerprint, ttl.
macro_rules! claim_row {
    () => {
        concat!(
            "(?, ?, ?, LAST_INSERT_ID(",
            clock_fence!(),
            "), 'in_progress',
        UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, NULL, ?,
        UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)"
        )
    };
}

/// The `ON DUPLICATE KEY UPDATE` of both claims (see [`CLAIM`]).
macro_rules! take_if_free {
    () => {
        concat!(
            "ON DUPLICATE KEY UPDATE
    fence = IF(",
            free!(),
            ",
               LAST_INSERT_ID(IF(expires_at <= UTC_TIMESTAMP(6),
                                 GREATEST(fence + 1, ",
            clock_fence!(),
            "),
                                 fence + 1)),
               fence + CAST(LAST_INSERT_ID(0) AS SIGNED)),
    created_at = IF(LAST_INSERT_ID() <> 0 AND expires_at <= UTC_TIMESTAMP(6),
                    VALUES(created_at), created_at),
    token = IF(LAST_INSERT_ID() <> 0, VALUES(token), token),
    result = IF(LAST_INSERT_ID() <> 0, NULL, result),
    updated_at = IF(LAST_INSERT_ID() <> 0, VALUES(updated_at), updated_at),
    lease_until = IF(LAST_INSERT_ID() <> 0, VALUES(lease_until), lease_until),
    fingerprint = IF(LAST_INSERT_ID() <> 0, VALUES(fingerprint), fingerprint),
    expires_at = IF(LAST_INSERT_ID() <> 0, VALUES(expires_at), expires_at),
    state = IF(LAST_INSERT_ID() <> 0, 'in_progress', state)"
        )
    };
}

/// Takes the key when its record is free (absent, expired, released, or in progress with a
/// run-out lease and no other payload); leaves any other record unchanged.
///
/// InnoDB locks the duplicate row exclusively before the `UPDATE` part runs, so exactly one
/// of any number of concurrent claims takes a free record. The `UPDATE` part's assignments
/// run left to right and each sees the columns assigned before it, so the "free" test is
/// made once, by the first assignment (`fence`), on the record as it was: it leaves the new
/// fence in `LAST_INSERT_ID()` when it takes the record, and 0 when it does not. Every later
/// assignment tests `LAST_INSERT_ID() <> 0` (within a statement, `LAST_INSERT_ID()` returns
/// the value last given to `LAST_INSERT_ID(expr)`), so a record that is not free, the
/// caller's own included, is left exactly as it was.
///
/// The new fence is one more than the record's, or, for an absent record, the clock's fence;
/// for an expired one, the higher of the two, so fences never repeat for a key.
///
/// `LAST_INSERT_ID(n)` makes the reply carry `n`: the fence when the record was inserted or
/// taken over, and 0 when it was left alone. A 0 is answered by a locking read of the
/// record, so a server that did not report the value would cost a round trip, never a wrong
/// answer.
pub(super) const CLAIM: &str = concat!(
    insert_into!(),
    claim_row!(),
    "
",
    take_if_free!()
);

/// The claim of a batch of distinct keys: [`CLAIM`] with one row per key (the store
/// replaces `{rows}` with [`CLAIM_ROW`] once per key). Each row's `ON DUPLICATE KEY UPDATE`
/// makes its own "free" test with its first assignment, which sets `LAST_INSERT_ID()` for
/// that row's later assignments, exactly as for a single claim. The statement reports
/// nothing per row: the store reads the batch's records after it ([`SEEN_MANY`]), and a
/// record that holds the item's token in progress is the item's acquisition.
pub(super) const CLAIM_MANY: &str = concat!(
    insert_into!(),
    "{rows}
",
    take_if_free!()
);

/// One row of [`CLAIM_MANY`].
pub(super) const CLAIM_ROW: &str = claim_row!();

/// The record columns a claim returns: those [`SEEN`] reads.
macro_rules! claimed_columns {
    () => {
        "state, token, fence, fingerprint, result,
       GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until))"
    };
}

/// The first claim MariaDB gets (see [`MySql::claim`](super::super::dialect::DialectImpl::claim)): [`CLAIM`]'s row,
/// inserted when the key has no row; a row that exists is left exactly as it was (the
/// assignment writes the value the column holds). The row's `LAST_INSERT_ID(fence)` is
/// evaluated before the duplicate is found, so the assignment resets it to 0: the reply
/// carries the new fence when the row was inserted, 0 when the key had one.
///
/// A fresh key, the common case, is claimed by this statement alone, which is shorter for
/// the server to run than [`CLAIM`] (whose `UPDATE` part is set up on every execution).
/// Like [`CLAIM`], it locks the duplicate row exclusively.
pub(super) const CLAIM_FRESH: &str = concat!(
    insert_into!(),
    claim_row!(),
    "
ON DUPLICATE KEY UPDATE fence = fence + CAST(LAST_INSERT_ID(0) AS SIGNED)"
);

/// [`CLAIM_FRESH`] with one row per key (the store replaces `{rows}` as in [`CLAIM_MANY`]):
/// the insert-only claim of a batch of distinct keys (MariaDB 10.5 and later), sent before
/// [`CLAIM_MANY_REPORTING`] as [`CLAIM_FRESH`] is before [`CLAIM_REPORTING`]. It inserts the
/// keys that have no row and leaves every other row exactly as it was, and returns each
/// key's row with `LAST_INSERT_ID()` as that row left it: the new fence for a row it
/// inserted (the row's own `LAST_INSERT_ID(fence)`), 0 for a row it left alone (the
/// assignment resets it). A key is the request's only when that value is not 0 and equals
/// the row's fence and the row holds the request's token; every other key goes to
/// [`CLAIM_MANY_REPORTING`], so a misreported value costs a statement, never a wrong answer.
pub(super) const CLAIM_MANY_FRESH: &str = concat!(
    insert_into!(),
    "{rows}
ON DUPLICATE KEY UPDATE fence = fence + CAST(LAST_INSERT_ID(0) AS SIGNED)
RETURNING record_key, token, fence, LAST_INSERT_ID()"
);

/// [`CLAIM`], returning the record it leaves: taken for the request (its token, in
/// progress) or the record it did not take, which is live (an expired record is always
/// free, so always taken). MariaDB 10.5 and later; what follows a [`CLAIM_FRESH`] that met
/// a row.
pub(super) const CLAIM_REPORTING: &str = concat!(
    insert_into!(),
    claim_row!(),
    "
",
    take_if_free!(),
    "
RETURNING ",
    claimed_columns!()
);

/// [`CLAIM_MANY`], returning `record_key` and the record columns of every key: each row as
/// [`CLAIM_REPORTING`] returns it, so that no read follows the claim. MariaDB 10.5 and
/// later.
pub(super) const CLAIM_MANY_REPORTING: &str = concat!(
    insert_into!(),
    "{rows}
",
    take_if_free!(),
    "
RETURNING record_key, ",
    claimed_columns!()
);

/// The record columns, then how long the record has been in its state and how long it has
/// left, in microseconds.
macro_rules! listed_columns {
    () => {
        "state, token, fence, fingerprint, result,
       GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until)),
       GREATEST(0, TIMESTAMPDIFF(MICROSECOND, updated_at, UTC_TIMESTAMP(6))),
       GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at))"
    };
}

pub(super) const READ: &str = concat!(
    "SELECT ",
    listed_columns!(),
    "
FROM idempotent_records
WHERE record_key = ? AND expires_at > UTC_TIMESTAMP(6)"
);

/// A page of live records with the prefix given third, by key after the first parameter and
/// below the second (a range of the primary key), at most the fourth.
pub(super) const SCAN: &str = concat!(
    "SELECT record_key, ",
    listed_columns!(),
    "
FROM idempotent_records
WHERE record_key > ? AND record_key < ? AND prefix = ? AND expires_at > UTC_TIMESTAMP(6)
ORDER BY record_key
LIMIT ?"
);

/// Completes and releases a batch of in-progress records: the store replaces the `{rows}`
/// marker with one `SELECT ? ...` of `(key, token, result, ttl, complete?)` per item, joined
/// by `UNION ALL`. Only in-progress records are ended (a multiple-table `UPDATE` assigns in
/// no particular order, so no assignment may read a column another one writes): an item
/// whose record is already ended is answered by reading its record.
pub(super) const COMPLETE_MANY: &str = "\
UPDATE idempotent_records AS r
JOIN ({rows}) AS i ON r.record_key = i.k AND r.token = i.t
SET r.result = IF(i.c = 1, i.res, r.result),
    r.expires_at = IF(i.c = 1, UTC_TIMESTAMP(6) + INTERVAL i.ttl MICROSECOND, r.expires_at),
    r.updated_at = UTC_TIMESTAMP(6),
    r.state = IF(i.c = 1, 'completed', 'released')
WHERE r.state = 'in_progress' AND r.fence >= 0 AND r.expires_at > UTC_TIMESTAMP(6)";

/// The live records of a batch's keys, `record_key` first; the store replaces `{keys}` with
/// one `?` per key.
pub(super) const SEEN_MANY: &str = concat!(
    "SELECT record_key, ",
    listed_columns!(),
    "
FROM idempotent_records
WHERE record_key IN ({keys}) AND expires_at > UTC_TIMESTAMP(6)"
);

pub(super) const DELETE: &str = "\
DELETE FROM idempotent_records
WHERE record_key = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6)
  AND NOT (state = 'in_progress' AND lease_until > UTC_TIMESTAMP(6))
  AND fence >= 0 AND state IN ('in_progress', 'completed', 'released')";

/// `token` and `fingerprint` are `BINARY(16)`: a negative fence or an unknown state (a table
/// whose check was dropped) is what makes a record unreadable.
pub(super) const DELETE_CORRUPT: &str = "\
DELETE FROM idempotent_records
WHERE record_key = ? AND NOT (fence >= 0 AND state IN ('in_progress', 'completed', 'released'))";

/// A locking read: it returns the latest committed version (not a transaction's snapshot)
/// and, inside a transaction, keeps the row locked like the claim did.
pub(super) const SEEN: &str = concat!(
    "SELECT ",
    claimed_columns!(),
    "
FROM idempotent_records
WHERE record_key = ? AND expires_at > UTC_TIMESTAMP(6)
FOR UPDATE"
);

/// `state` is assigned last: the assignments before it test the old state. A record that is
/// not readable (an unknown state, a negative fence) is left alone, and reported as corrupt.
pub(super) const COMPLETE: &str = "\
UPDATE idempotent_records SET
    result = IF(state = 'in_progress', ?, result),
    expires_at = IF(state = 'in_progress', UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, expires_at),
    updated_at = IF(state = 'in_progress', UTC_TIMESTAMP(6), updated_at),
    state = 'completed'
WHERE record_key = ? AND token = ? AND state IN ('in_progress', 'completed') AND fence >= 0
  AND expires_at > UTC_TIMESTAMP(6)";

pub(super) const REOPEN: &str = "\
UPDATE idempotent_records SET state = 'released', result = NULL, updated_at = UTC_TIMESTAMP(6)
WHERE record_key = ? AND token = ? AND state IN ('in_progress', 'completed', 'released')
  AND fence >= 0 AND expires_at > UTC_TIMESTAMP(6)";

pub(super) const RELEASE: &str = "\
UPDATE idempotent_records SET state = 'released', updated_at = UTC_TIMESTAMP(6)
WHERE record_key = ? AND token = ? AND state = 'in_progress' AND fence >= 0
  AND expires_at > UTC_TIMESTAMP(6)";

pub(super) const RENEW: &str = "\
UPDATE idempotent_records SET
    lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
    expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
WHERE record_key = ? AND token = ? AND state = 'in_progress' AND fence >= 0
  AND expires_at > UTC_TIMESTAMP(6)";

/// Each row is deleted only if it is still expired when the delete reaches it.
pub(super) const PURGE: &str = "\
DELETE FROM idempotent_records
WHERE expires_at <= UTC_TIMESTAMP(6)
ORDER BY expires_at
LIMIT ?";
