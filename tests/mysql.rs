//! The MySQL store on a real MariaDB: the conformance suite (one table per case, also on the
//! statements MySQL gets), the business-transaction API, batched expiry, exact-byte keys (no
//! collation), the statements a claim sends, fences from the database's clock, corrupt rows,
//! results the server or the table refuses (`max_allowed_packet`, a smaller column), and the
//! longest durations.
//!
//! Needs MariaDB (or MySQL) at `IDEMPOTENT_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod conformance;
#[path = "support/sql_cases.rs"]
mod sql_cases;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::sync::Arc;
use std::time::Duration;

use idempotency::sql::sqlx::{self, AssertSqlSafe};
use idempotency::sql::MySqlStore;
use idempotency::store::{
    BoxFuture, Claim, Completion, Ending, SharedOperatorStore, Store, StoreErrorKind,
};
use idempotency::{Key, SharedStore};

use sql_cases::{acquired, req, Harness};
use sql_tables::{Scratch, Server};

struct MySql {
    store: Arc<MySqlStore>,
    // Dropped after the store: drops the case's tables. Its name is the case's namespace.
    table: Scratch,
}

impl conformance::Backend for MySql {
    fn namespace(&self) -> &str {
        self.table.name()
    }
    fn store(&self) -> SharedStore {
        self.store.clone()
    }
    fn lose_data<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let sql = format!(
                "DELETE FROM {} WHERE LEFT(record_key, ?) = ?",
                self.store.table()
            );
            sqlx::query(AssertSqlSafe(sql))
                .bind(i64::try_from(prefix.len()).unwrap())
                .bind(prefix.as_bytes())
                .execute(self.store.pool())
                .await
                .unwrap();
        })
    }
}

impl conformance::OperatorBackend for MySql {
    fn operator_store(&self) -> SharedOperatorStore {
        self.store.clone()
    }
}

async fn store_on(table: &Scratch) -> MySqlStore {
    MySqlStore::builder(table.url())
        .table(table.name().to_string())
        .build()
        .await
        .unwrap()
}

async fn mysql() -> MySql {
    let table = Scratch::table(Server::MySql);
    MySql {
        store: Arc::new(store_on(&table).await),
        table,
    }
}

conformance_suite!(mysql);

/// The conformance suite on concurrent single calls sent as batches (`CombiningStore`).
mod combined_calls {
    use super::*;

    async fn mysql_combined() -> conformance::Combined<MySql> {
        conformance::Combined::new(mysql().await, 8)
    }

    conformance_suite!(mysql_combined);
}

/// The conformance suite, the batch, corrupt-row, resent-claim and transaction cases on the
/// statements MySQL gets (no `INSERT ... RETURNING`: a claim statement, then a read of a
/// record it did not take), which this MariaDB would otherwise never run.
mod plain_claims {
    use super::*;

    async fn mysql_plain() -> MySql {
        let table = Scratch::table(Server::MySql);
        let store = MySqlStore::builder(table.url())
            .table(table.name().to_string())
            .plain_claims(true)
            .build()
            .await
            .unwrap();
        MySql {
            store: Arc::new(store),
            table,
        }
    }

    conformance_suite!(mysql_plain);

    #[tokio::test]
    async fn batch_answers_as_single_claims_would() {
        let b = mysql_plain().await;
        sql_cases::batch_answers_as_single_claims_would::<Maria>(&b.store).await;
    }

    #[tokio::test]
    async fn corrupt_records_are_reported_as_corrupt() {
        let b = mysql_plain().await;
        sql_cases::corrupt_records_are_reported_as_corrupt::<Maria>(&b.store).await;
    }

    #[tokio::test]
    async fn claim_sent_again_with_its_token_is_acquired() {
        let b = mysql_plain().await;
        sql_cases::claim_sent_again_with_its_token_is_acquired::<Maria>(&b.store).await;
    }

    #[tokio::test]
    async fn business_transaction_commits_or_rolls_back_with_its_record() {
        let b = mysql_plain().await;
        let payments = Scratch::table(Server::MySql);
        sql_cases::business_transaction_commits_or_rolls_back_with_its_record::<Maria>(
            &b.store,
            payments.name(),
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_transactions_on_one_key_wait_for_the_first() {
        let b = mysql_plain().await;
        let payments = Scratch::table(Server::MySql);
        sql_cases::concurrent_transactions_on_one_key_wait_for_the_first::<Maria>(
            &b.store,
            payments.name(),
        )
        .await;
    }
}

struct Maria;

impl Harness for Maria {
    type Db = sqlx::MySql;
    fn count<'a>(store: &'a MySqlStore, table: &'a str) -> BoxFuture<'a, i64> {
        Box::pin(async move {
            let sql = format!("SELECT COUNT(*) FROM {table}");
            sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(store.pool())
                .await
                .unwrap()
        })
    }
    fn create_payments<'a>(store: &'a MySqlStore, table: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let sql = format!(
                "CREATE TABLE {table} (payment VARCHAR(64) PRIMARY KEY, amount BIGINT) ENGINE = InnoDB"
            );
            sqlx::query(AssertSqlSafe(sql))
                .execute(store.pool())
                .await
                .unwrap();
        })
    }
    fn corruptions() -> &'static [&'static str] {
        // `token` and `fingerprint` are `BINARY(16)`: MariaDB pads or refuses other lengths.
        &["fence = -5", "state = 'done'"]
    }
    fn corrupt<'a>(store: &'a MySqlStore, key: &'a Key, assignment: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let table = store.table();
            // MariaDB names the table's only check constraint `CONSTRAINT_1`.
            let unchecked = format!("ALTER TABLE {table} DROP CONSTRAINT IF EXISTS CONSTRAINT_1");
            sqlx::query(AssertSqlSafe(unchecked))
                .execute(store.pool())
                .await
                .unwrap();
            let sql = format!("UPDATE {table} SET {assignment} WHERE record_key = ?");
            let done = sqlx::query(AssertSqlSafe(sql))
                .bind(key.as_bytes())
                .execute(store.pool())
                .await
                .unwrap();
            assert_eq!(done.rows_affected(), 1, "{assignment}");
        })
    }
    fn limit_results<'a>(store: &'a MySqlStore) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            // At most 255 bytes: a longer value is "data too long" in strict mode.
            let sql = format!("ALTER TABLE {} MODIFY result TINYBLOB NULL", store.table());
            sqlx::query(AssertSqlSafe(sql))
                .execute(store.pool())
                .await
                .unwrap();
        })
    }
    fn insert_payment<'c>(
        conn: &'c mut sqlx::MySqlConnection,
        table: &'c str,
        payment: &'c str,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let sql = format!("INSERT INTO {table} (payment, amount) VALUES (?, 1250)");
            sqlx::query(AssertSqlSafe(sql))
                .bind(payment)
                .execute(conn)
                .await?;
            Ok(())
        })
    }
}

#[tokio::test]
async fn business_transaction_commits_or_rolls_back_with_its_record() {
    let records = Scratch::table(Server::MySql);
    let payments = Scratch::table(Server::MySql);
    let store = store_on(&records).await;
    sql_cases::business_transaction_commits_or_rolls_back_with_its_record::<Maria>(
        &store,
        payments.name(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_transactions_on_one_key_wait_for_the_first() {
    let records = Scratch::table(Server::MySql);
    let payments = Scratch::table(Server::MySql);
    let store = store_on(&records).await;
    sql_cases::concurrent_transactions_on_one_key_wait_for_the_first::<Maria>(
        &store,
        payments.name(),
    )
    .await;
}

#[tokio::test]
async fn expired_records_are_purged_in_batches() {
    let records = Scratch::table(Server::MySql);
    sql_cases::expired_records_are_purged_in_batches::<Maria>(&store_on(&records).await).await;
}

/// A store on a table of its own, and the table (dropped after the store).
async fn fresh() -> (Scratch, MySqlStore) {
    let records = Scratch::table(Server::MySql);
    let store = store_on(&records).await;
    (records, store)
}

fresh_store_cases!(Maria, fresh);

#[tokio::test]
async fn batch_answers_as_single_claims_would() {
    let records = Scratch::table(Server::MySql);
    sql_cases::batch_answers_as_single_claims_would::<Maria>(&store_on(&records).await).await;
}

#[tokio::test]
async fn corrupt_records_are_reported_as_corrupt() {
    let records = Scratch::table(Server::MySql);
    sql_cases::corrupt_records_are_reported_as_corrupt::<Maria>(&store_on(&records).await).await;
}

/// The largest result the store may take on this server: the `MEDIUMBLOB` column, and
/// `max_allowed_packet` less 64 KiB for the rest of the statement.
async fn capacity(store: &MySqlStore) -> usize {
    ((1 << 24) - 1).min(max_allowed_packet(store).await - (64 << 10))
}

#[tokio::test]
async fn result_size_limit_defaults_and_is_clamped_to_the_server() {
    let records = Scratch::table(Server::MySql);
    let store = store_on(&records).await;
    assert_eq!(
        store.max_result_size(),
        idempotency::store::DEFAULT_MAX_RESULT_SIZE
    );
    let store = MySqlStore::builder(records.url())
        .table(records.name().to_string())
        .max_result_size(usize::MAX)
        .build()
        .await
        .unwrap();
    assert_eq!(store.max_result_size(), capacity(&store).await);
}

/// With the limit as high as the server allows, a result of exactly that size is stored and
/// replayed (the limit is one the server really takes), and one byte more is refused.
#[tokio::test]
async fn result_above_the_store_limit_is_rejected() {
    let records = Scratch::table(Server::MySql);
    let store = MySqlStore::builder(records.url())
        .table(records.name().to_string())
        .max_result_size(usize::MAX)
        .build()
        .await
        .unwrap();
    assert_eq!(store.max_result_size(), capacity(&store).await);
    sql_cases::result_above_the_store_limit_is_rejected::<Maria>(&store).await;
}

/// The server's `max_allowed_packet`, in bytes.
async fn max_allowed_packet(store: &MySqlStore) -> usize {
    let packet: u64 = sqlx::query_scalar("SELECT CAST(@@max_allowed_packet AS UNSIGNED)")
        .fetch_one(store.pool())
        .await
        .unwrap();
    usize::try_from(packet).unwrap()
}

#[tokio::test]
async fn result_above_max_allowed_packet_is_rejected() {
    let records = Scratch::table(Server::MySql);
    let store = store_on(&records).await;
    let packet = max_allowed_packet(&store).await;
    let hour = Duration::from_secs(3600);
    let key = Key::new("packet", 1, &[&1u8]).unwrap();
    let owner = req(&key, hour, hour);
    acquired(store.claim(&owner).await);
    // Larger than the packet the server takes, and than the `MEDIUMBLOB` column.
    let big = Completion::new(Some(vec![7; packet.max(1 << 24) + 1024]), hour);
    let err = store.complete(&key, &owner.token, &big).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Rejected, "{err:?}");
    // Nothing was applied, and the store still works.
    let done = Completion::new(Some(b"small".to_vec()), hour);
    assert!(store.complete(&key, &owner.token, &done).await.unwrap());
}

/// How many statements of each of `kinds` (`COM_INSERT`, `COM_SELECT`, `COM_UPDATE`,
/// `COM_UPDATE_MULTI`...) the store's one connection has run (this read is one more
/// `SELECT`).
async fn session_counts<const N: usize>(store: &MySqlStore, kinds: [&str; N]) -> [u64; N] {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT VARIABLE_NAME, CAST(VARIABLE_VALUE AS CHAR) \
         FROM information_schema.SESSION_STATUS WHERE VARIABLE_NAME LIKE 'COM\\_%'",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    kinds.map(|kind| {
        let (_, value) = rows.iter().find(|(n, _)| n == kind).unwrap();
        value.parse().unwrap()
    })
}

/// How many `INSERT`s and `SELECT`s the store's one connection has run (this read is one
/// more `SELECT`).
async fn statements(store: &MySqlStore) -> (u64, u64) {
    let [inserts, selects] = session_counts(store, ["COM_INSERT", "COM_SELECT"]).await;
    (inserts, selects)
}

/// An ending batch of one item is sent as that item's own `UPDATE`, which the server runs
/// for less than the multiple-table `UPDATE` of a batch (a `CombiningStore` sends a single
/// ending that way when its store is idle); two items are one multiple-table `UPDATE`.
#[tokio::test]
async fn a_batch_of_one_ending_is_a_single_update() {
    let records = Scratch::table(Server::MySql);
    let store = one_connection(&records, false).await;
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let claims: Vec<_> = (0..3u8)
        .map(|i| req(&Key::new("end-one", 1, &[&i]).unwrap(), lease, ttl))
        .collect();
    for claim in store.claim_many(&claims).await {
        acquired(claim);
    }
    let done = |r: &idempotency::store::ClaimRequest| {
        Ending::complete(r.key.clone(), r.token, Completion::new(None, ttl))
    };
    let kinds = ["COM_UPDATE", "COM_UPDATE_MULTI"];
    let before = session_counts(&store, kinds).await;
    let one = store.complete_many(&[done(&claims[0])]).await;
    let after = session_counts(&store, kinds).await;
    assert!(one.into_iter().all(|ended| ended.unwrap()));
    assert_eq!(
        [after[0] - before[0], after[1] - before[1]],
        [1, 0],
        "one item"
    );
    let two = store
        .complete_many(&[done(&claims[1]), done(&claims[2])])
        .await;
    let later = session_counts(&store, kinds).await;
    assert!(two.into_iter().all(|ended| ended.unwrap()));
    assert_eq!(
        [later[0] - after[0], later[1] - after[1]],
        [0, 1],
        "two items"
    );
}

/// A store with one connection, so that the session counters are the store's; with
/// `plain`, on the statements MySQL gets.
async fn one_connection(records: &Scratch, plain: bool) -> MySqlStore {
    MySqlStore::builder(records.url())
        .table(records.name().to_string())
        .max_connections(1)
        .plain_claims(plain)
        .build()
        .await
        .unwrap()
}

/// The `INSERT`s and `SELECT`s `call` sends on `store`'s one connection, and its output.
async fn counted<T>(
    store: &MySqlStore,
    call: impl std::future::Future<Output = T>,
) -> ((u64, u64), T) {
    let before = statements(store).await;
    let out = call.await;
    let after = statements(store).await;
    // The first read is one more `SELECT`.
    ((after.0 - before.0, after.1 - before.1 - 1), out)
}

/// The `(INSERT, SELECT)` statements each kind of claim sends.
struct Sent {
    fresh: (u64, u64),
    duplicate: (u64, u64),
    /// The owner's own claim sent again (its reply lost): its acquisition.
    again: (u64, u64),
    /// A takeover of a released record.
    takeover: (u64, u64),
    /// A batch of a held key and two fresh ones.
    batch: (u64, u64),
    /// A batch of fresh keys.
    fresh_batch: (u64, u64),
}

/// Sends each kind of claim on a store with one connection (`plain`: the statements MySQL
/// gets) and checks its answer and the statements it sent.
async fn claims_send(plain: bool, expected: Sent) {
    let records = Scratch::table(Server::MySql);
    let store = one_connection(&records, plain).await;
    let key = Key::new("round-trips", 1, &[&1u8]).unwrap();
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));

    let owner = req(&key, lease, ttl);
    let (sent, first) = counted(&store, store.claim(&owner)).await;
    let fence = acquired(first);
    assert_eq!(sent, expected.fresh, "a fresh key");
    let (sent, duplicate) = counted(&store, store.claim(&req(&key, lease, ttl))).await;
    assert_eq!(duplicate.unwrap(), Claim::InProgress { fence });
    assert_eq!(sent, expected.duplicate, "a duplicate");
    let (sent, again) = counted(&store, store.claim(&owner)).await;
    assert_eq!(again.unwrap(), Claim::Acquired { fence });
    assert_eq!(sent, expected.again, "the owner's claim sent again");
    assert!(store.release(&key, &owner.token).await.unwrap());
    let (sent, takeover) = counted(&store, store.claim(&req(&key, lease, ttl))).await;
    assert_eq!(takeover.unwrap(), Claim::Acquired { fence: fence + 1 });
    assert_eq!(sent, expected.takeover, "a takeover of a released record");

    let fresh = |i: u8| req(&Key::new("round-trips", 1, &[&i]).unwrap(), lease, ttl);
    let batch = [req(&key, lease, ttl), fresh(2), fresh(3)];
    let (sent, claims) = counted(&store, store.claim_many(&batch)).await;
    assert_eq!(sent, expected.batch, "a batch");
    assert_eq!(
        claims[0].as_ref().unwrap(),
        &Claim::InProgress { fence: fence + 1 }
    );
    for claim in claims.into_iter().skip(1) {
        acquired(claim);
    }
    let batch = [fresh(4), fresh(5), fresh(6)];
    let (sent, claims) = counted(&store, store.claim_many(&batch)).await;
    assert_eq!(sent, expected.fresh_batch, "a batch of fresh keys");
    for claim in claims {
        acquired(claim);
    }
}

/// Claims on MariaDB (10.5 and later): a fresh key is acquired by one insert-only statement;
/// any other claim, a duplicate or a takeover, is answered by a second statement that
/// returns the record (`RETURNING`), with no read. A batch is the same: one insert-only
/// statement for its fresh keys, a second one for the keys that had a row.
#[tokio::test]
async fn mariadb_claims_fresh_keys_in_one_statement_and_others_in_two() {
    claims_send(
        false,
        Sent {
            fresh: (1, 0),
            duplicate: (2, 0),
            again: (2, 0),
            takeover: (2, 0),
            batch: (2, 0),
            fresh_batch: (1, 0),
        },
    )
    .await;
}

/// Claims on the statements MySQL gets (no `RETURNING`): one statement that reports an
/// acquisition in its reply, fresh key or takeover; a claim that did not take the key reads
/// the record it met. A batch is one statement and a read.
#[tokio::test]
async fn mysql_claims_report_acquisitions_in_the_reply_and_read_the_rest() {
    claims_send(
        true,
        Sent {
            fresh: (1, 0),
            duplicate: (1, 1),
            again: (1, 1),
            takeover: (1, 0),
            batch: (1, 1),
            fresh_batch: (1, 1),
        },
    )
    .await;
}

#[tokio::test]
async fn mariadb_urls_are_accepted() {
    let records = Scratch::table(Server::MySql);
    let url = records.url().replacen("mysql://", "mariadb://", 1);
    let store = MySqlStore::builder(&url)
        .table(records.name().to_string())
        .build()
        .await
        .unwrap();
    let key = Key::new("mariadb", 1, &[&1u8]).unwrap();
    let r = req(&key, Duration::from_secs(30), Duration::from_secs(60));
    acquired(store.claim(&r).await);
}

#[tokio::test]
async fn schema_qualified_names_are_refused() {
    let err = MySqlStore::builder("mysql://nobody@127.0.0.1:1/none")
        .table("other_db.records")
        .build()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unsafe);
}
