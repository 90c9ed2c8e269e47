//! The PostgreSQL store on a real server: the conformance suite (one table per case), the
//! business-transaction API, batched expiry, exact-byte keys, schema-qualified tables, fences
//! from the database's clock, corrupt rows, refused results, the longest durations, and a
//! database that goes away mid-run (a cluster this test starts, stops and starts again).
//!
//! Needs PostgreSQL at `IDEMPOTENT_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`) and the server binaries (`initdb`, `pg_ctl`)
//! under `/usr/lib/postgresql/*/bin`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod conformance;
#[path = "support/pg_cluster.rs"]
mod pg_cluster;
#[path = "support/sql_cases.rs"]
mod sql_cases;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::sql::sqlx::{self, AssertSqlSafe};
use idempotency::sql::PostgresStore;
use idempotency::store::{BoxFuture, RecordState, SharedOperatorStore, Store, StoreErrorKind};
use idempotency::{Action, Error, Idempotency, Key, SharedStore};

use pg_cluster::PgCluster;
use sql_cases::{acquired, req, Harness};
use sql_tables::{Scratch, Server};

struct Postgres {
    store: Arc<PostgresStore>,
    // Dropped after the store: drops the case's tables. Its name is the case's namespace.
    _table: Scratch,
}

impl conformance::Backend for Postgres {
    fn namespace(&self) -> &str {
        self._table.name()
    }
    fn store(&self) -> SharedStore {
        self.store.clone()
    }
    fn lose_data<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let sql = format!(
                "DELETE FROM {} WHERE substring(record_key FROM 1 FOR $1) = $2",
                self.store.table()
            );
            sqlx::query(AssertSqlSafe(sql))
                .bind(i32::try_from(prefix.len()).unwrap())
                .bind(prefix.as_bytes())
                .execute(self.store.pool())
                .await
                .unwrap();
        })
    }
}

impl conformance::OperatorBackend for Postgres {
    fn operator_store(&self) -> SharedOperatorStore {
        self.store.clone()
    }
}

async fn store_on(table: &Scratch) -> PostgresStore {
    PostgresStore::builder(table.url())
        .table(table.name().to_string())
        .build()
        .await
        .unwrap()
}

async fn postgres() -> Postgres {
    let table = Scratch::table(Server::Postgres);
    Postgres {
        store: Arc::new(store_on(&table).await),
        _table: table,
    }
}

conformance_suite!(postgres);

/// The conformance suite on concurrent single calls sent as batches (`CombiningStore`).
mod combined_calls {
    use super::*;

    async fn postgres_combined() -> conformance::Combined<Postgres> {
        conformance::Combined::new(postgres().await, 8)
    }

    conformance_suite!(postgres_combined);

    /// 150 orders, each delivered three times, ten deliveries in flight, on a store that
    /// sends them as batches (at most two on their way): every order runs exactly once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_deliveries_sent_as_batches_run_each_order_once() {
        let backend = postgres().await;
        let combined = idempotency::store::CombiningStore::new(backend.store.clone(), 2);
        let guard = Idempotency::new(Duration::from_secs(3600))
            .lease(Duration::from_secs(5))
            .store(Arc::new(combined));
        let ledger = Arc::new(Ledger::default());
        deliver_all(&guard, &ledger, orders(0..150, 3)).await;
        assert_eq!(ledger.executions(), 150);
        let effects = ledger.effects.lock().unwrap().clone();
        assert_eq!(effects.len(), 150);
        assert!(effects.values().all(|&n| n == 1), "{effects:?}");
        for order in effects.keys() {
            let key = Key::new("order:consume", 1, &[order]).unwrap();
            let record = backend.store.read(&key).await.unwrap().unwrap();
            assert_eq!(record.state, RecordState::Completed, "{order}");
        }
    }
}

/// The conformance suite, the batch, corrupt-row, resent-claim and transaction cases on the
/// claim statements sent alone, with no insert-only claim before them: the statements that
/// otherwise only meet keys that have a record insert here every fresh key too.
mod plain_claims {
    use super::*;

    async fn postgres_plain() -> Postgres {
        let table = Scratch::table(Server::Postgres);
        let store = PostgresStore::builder(table.url())
            .table(table.name().to_string())
            .plain_claims(true)
            .build()
            .await
            .unwrap();
        assert_eq!(store.statements().claim_fresh(), None);
        assert_eq!(store.statements().claim_many_fresh(), None);
        Postgres {
            store: Arc::new(store),
            _table: table,
        }
    }

    conformance_suite!(postgres_plain);

    #[tokio::test]
    async fn corrupt_records_are_reported_as_corrupt() {
        let b = postgres_plain().await;
        sql_cases::corrupt_records_are_reported_as_corrupt::<Pg>(&b.store).await;
    }

    #[tokio::test]
    async fn batch_answers_as_single_claims_would() {
        let b = postgres_plain().await;
        sql_cases::batch_answers_as_single_claims_would::<Pg>(&b.store).await;
    }

    #[tokio::test]
    async fn claim_sent_again_with_its_token_is_acquired() {
        let b = postgres_plain().await;
        sql_cases::claim_sent_again_with_its_token_is_acquired::<Pg>(&b.store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_transactions_on_one_key_wait_for_the_first() {
        let b = postgres_plain().await;
        let payments = Scratch::table(Server::Postgres);
        sql_cases::concurrent_transactions_on_one_key_wait_for_the_first::<Pg>(
            &b.store,
            payments.name(),
        )
        .await;
    }
}

struct Pg;

impl Harness for Pg {
    type Db = sqlx::Postgres;
    fn count<'a>(store: &'a PostgresStore, table: &'a str) -> BoxFuture<'a, i64> {
        Box::pin(async move {
            let sql = format!("SELECT COUNT(*) FROM {table}");
            sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(store.pool())
                .await
                .unwrap()
        })
    }
    fn create_payments<'a>(store: &'a PostgresStore, table: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let sql = format!("CREATE TABLE {table} (payment TEXT PRIMARY KEY, amount BIGINT)");
            sqlx::query(AssertSqlSafe(sql))
                .execute(store.pool())
                .await
                .unwrap();
        })
    }
    fn insert_payment<'c>(
        conn: &'c mut sqlx::PgConnection,
        table: &'c str,
        payment: &'c str,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let sql = format!("INSERT INTO {table} (payment, amount) VALUES ($1, 1250)");
            sqlx::query(AssertSqlSafe(sql))
                .bind(payment)
                .execute(conn)
                .await?;
            Ok(())
        })
    }
    fn corruptions() -> &'static [&'static str] {
        &[
            "fence = -5",
            "state = 'done'",
            "token = '\\x0102'::bytea",
            "fingerprint = '\\x01'::bytea",
        ]
    }
    fn corrupt<'a>(
        store: &'a PostgresStore,
        key: &'a Key,
        assignment: &'a str,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let table = store.table();
            let bare = table.rsplit('.').next().unwrap_or(table);
            let unchecked =
                format!("ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {bare}_state_check");
            sqlx::query(AssertSqlSafe(unchecked))
                .execute(store.pool())
                .await
                .unwrap();
            let sql = format!("UPDATE {table} SET {assignment} WHERE record_key = $1");
            let done = sqlx::query(AssertSqlSafe(sql))
                .bind(key.as_bytes())
                .execute(store.pool())
                .await
                .unwrap();
            assert_eq!(done.rows_affected(), 1, "{assignment}");
        })
    }
    fn limit_results<'a>(store: &'a PostgresStore) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let table = store.table();
            let bare = table.rsplit('.').next().unwrap_or(table);
            let sql = format!(
                "ALTER TABLE {table} ADD CONSTRAINT {bare}_small_result \
                 CHECK (octet_length(result) <= 100)"
            );
            sqlx::query(AssertSqlSafe(sql))
                .execute(store.pool())
                .await
                .unwrap();
        })
    }
    fn count_claim_statements<'a>(store: &'a PostgresStore) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            // Every claim is an `INSERT`: a statement-level trigger fires once per statement,
            // whatever it inserted or updated.
            let table = store.table();
            let statements = [
                format!("CREATE TABLE {table}_claims (n BIGINT NOT NULL)"),
                format!("INSERT INTO {table}_claims VALUES (0)"),
                format!(
                    "CREATE FUNCTION {table}_count() RETURNS trigger LANGUAGE plpgsql AS $$ \
                     BEGIN UPDATE {table}_claims SET n = n + 1; RETURN NULL; END $$"
                ),
                // A trigger's name takes no schema: it lives in its table's.
                format!(
                    "CREATE TRIGGER {}_count AFTER INSERT ON {table} \
                     FOR EACH STATEMENT EXECUTE FUNCTION {table}_count()",
                    table.rsplit('.').next().unwrap_or(table)
                ),
            ];
            for sql in statements {
                sqlx::query(AssertSqlSafe(sql))
                    .execute(store.pool())
                    .await
                    .unwrap();
            }
        })
    }
    fn claim_statements<'a>(store: &'a PostgresStore) -> BoxFuture<'a, Option<i64>> {
        Box::pin(async move {
            let sql = format!("SELECT n FROM {}_claims", store.table());
            Some(
                sqlx::query_scalar(AssertSqlSafe(sql))
                    .fetch_one(store.pool())
                    .await
                    .unwrap(),
            )
        })
    }
}

async fn count(store: &PostgresStore, table: &str) -> i64 {
    Pg::count(store, table).await
}

#[tokio::test]
async fn business_transaction_commits_or_rolls_back_with_its_record() {
    let records = Scratch::table(Server::Postgres);
    let payments = Scratch::table(Server::Postgres);
    let store = store_on(&records).await;
    sql_cases::business_transaction_commits_or_rolls_back_with_its_record::<Pg>(
        &store,
        payments.name(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_transactions_on_one_key_wait_for_the_first() {
    let records = Scratch::table(Server::Postgres);
    let payments = Scratch::table(Server::Postgres);
    let store = store_on(&records).await;
    sql_cases::concurrent_transactions_on_one_key_wait_for_the_first::<Pg>(&store, payments.name())
        .await;
}

#[tokio::test]
async fn expired_records_are_purged_in_batches() {
    let records = Scratch::table(Server::Postgres);
    sql_cases::expired_records_are_purged_in_batches::<Pg>(&store_on(&records).await).await;
}

/// A store on a table of its own, and the table (dropped after the store).
/// A store whose table is `records` in a scratch schema of its own (dropped with the
/// schema), and the table's qualified name.
async fn in_scratch_schema() -> (Scratch, String, PostgresStore) {
    let schema = Scratch::schema();
    let table = format!("{}.records", schema.name());
    let store = PostgresStore::builder(schema.url())
        .table(table.clone())
        .build()
        .await
        .unwrap();
    (schema, table, store)
}

async fn fresh() -> (Scratch, PostgresStore) {
    let records = Scratch::table(Server::Postgres);
    let store = store_on(&records).await;
    (records, store)
}

fresh_store_cases!(Pg, fresh);

/// The generic plan of a prepared statement is made once per connection and kept. Made on
/// a table that is empty and was never analyzed (a new deployment, a table just truncated),
/// a batch statement that joins its input with the table is a sequential scan of the table,
/// and every later batch on that connection scans the whole table as it grows. Made on a
/// table filled since it was last analyzed (thousands of live records, statistics of an
/// empty table), a batch statement that tests expiry with `expires_at > now` ANDs the key
/// lookup with a scan of the `expires_at` index, which reads an entry for every live record,
/// on every batch. The batch statements look their keys up by primary key alone: the
/// generic plans made on an empty table, on a filled one without statistics, and on one
/// with them must not scan the table, nor go through the `expires_at` index.
#[tokio::test]
async fn batch_statements_look_their_keys_up_on_a_table_without_statistics() {
    let (records, store) = fresh().await;
    let table = store.table().to_string();
    let mut conn = store.pool().acquire().await.unwrap();
    // No analyze may give the table statistics while the case looks at its plans.
    let setup = format!(
        "ALTER TABLE {table} SET (autovacuum_enabled = false);
         SET plan_cache_mode = force_generic_plan;"
    );
    sqlx::raw_sql(AssertSqlSafe(setup))
        .execute(&mut *conn)
        .await
        .unwrap();
    let claim_many = store.statements().claim_many().unwrap();
    let complete_many = store.statements().complete_many().unwrap();
    let statements = [
        (
            "claim_many",
            claim_many,
            "(ARRAY['\\x01'::bytea], ARRAY['p'], ARRAY['\\x02'::bytea], ARRAY[1::int8], \
             ARRAY[NULL::bytea], ARRAY[1::int8])",
        ),
        (
            "complete_many",
            complete_many,
            "(ARRAY['\\x01'::bytea], ARRAY['\\x02'::bytea], ARRAY[NULL::bytea], \
             ARRAY[1::int8], ARRAY[true])",
        ),
    ];
    // 6,000 live records, first without statistics (a table filled since it was truncated),
    // then analyzed.
    let populate = format!(
        "INSERT INTO {table} (record_key, prefix, token, fence, state, lease_until, result, \
         fingerprint, created_at, updated_at, expires_at) \
         SELECT int8send(g), 'p', decode(md5(g::text), 'hex'), 1, 'completed', now(), NULL, \
         NULL, now(), now(), now() + INTERVAL '1 hour' FROM generate_series(1, 6000) AS g"
    );
    let states = [
        ("empty, never analyzed", None),
        ("filled, never analyzed", Some(populate)),
        ("filled and analyzed", Some(format!("ANALYZE {table}"))),
    ];
    for (round, (state, before)) in states.into_iter().enumerate() {
        if let Some(before) = before {
            sqlx::raw_sql(AssertSqlSafe(before))
                .execute(&mut *conn)
                .await
                .unwrap();
        }
        for (name, sql, args) in &statements {
            let prepare = format!("PREPARE {name}{round} AS {sql}");
            sqlx::raw_sql(AssertSqlSafe(prepare))
                .execute(&mut *conn)
                .await
                .unwrap();
            let explain = format!("EXPLAIN (COSTS OFF) EXECUTE {name}{round}{args}");
            let lines: Vec<String> = sqlx::query_scalar(AssertSqlSafe(explain))
                .fetch_all(&mut *conn)
                .await
                .unwrap();
            let plan = lines.join("\n");
            assert!(
                plan.contains("_pkey"),
                "{name}, table {state}: no lookup by primary key:\n{plan}"
            );
            let scans = |line: &&str| {
                line.contains("Seq Scan on")
                    || (line.contains("Scan") && line.contains("expires_at"))
            };
            assert!(
                !plan.lines().any(|line| scans(&line)),
                "{name}, table {state}: scans the table:\n{plan}"
            );
        }
    }
    drop(conn);
    store.pool().close().await;
    drop(records);
}

/// A batch statement matches each row of the table to its item of the batch once. The items
/// arrive as arrays, and a plan that estimates too few of them (a generic plan counts an
/// array parameter as ten items) or too few rows of the table (a custom plan on a table
/// without statistics counts each test of a row's state or readability as true of half a
/// percent of rows) can join them by a nested loop that reads every item again for every
/// row: work that grows with the square of the batch (250,000 pairs rejected for 500 keys).
/// Whatever the table's statistics, in its generic plan and in the custom plans PostgreSQL
/// makes for a prepared statement's first executions, each statement rejects fewer pairs
/// than the batch has keys.
#[tokio::test]
async fn batch_statements_match_rows_to_items_in_one_pass() {
    const KEYS: usize = 100;
    let (records, store) = fresh().await;
    let table = store.table().to_string();
    let mut conn = store.pool().acquire().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE {table} SET (autovacuum_enabled = false)"
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    // Key `g` is `g` in 56 decimal digits (a key's usual length), its token `g` in 16 bytes.
    let array = |from: usize, bytes: &dyn Fn(usize) -> String| {
        let items: Vec<String> = (from..from + KEYS)
            .map(|g| format!("\"\\\\x{}\"", bytes(g)))
            .collect();
        format!("'{{{}}}'::bytea[]", items.join(","))
    };
    let key = |g: usize| {
        format!("{g:056}")
            .bytes()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let token = |g: usize| format!("{g:016x}{g:016x}");
    let repeat = |item: &str| format!("ARRAY[{}]", vec![item; KEYS].join(","));
    // Keys 1..=KEYS are held (in progress under their token), the next KEYS are fresh.
    let held = format!(
        "INSERT INTO {table} (record_key, prefix, token, fence, state, lease_until, result, \
         fingerprint, created_at, updated_at, expires_at) \
         SELECT convert_to(lpad(g::text, 56, '0'), 'UTF8'), 'p', int8send(g) || int8send(g), \
         1, 'in_progress', \
         now() + INTERVAL '1 hour', NULL, NULL, now(), now(), now() + INTERVAL '1 hour' \
         FROM generate_series(1, {KEYS}) AS g"
    );
    // A batch claim of the keys from `first` on, under new tokens (a minute's lease, no
    // fingerprint, an hour's ttl): fresh keys from `KEYS + 1`, held ones from 1.
    let claim_args = |first: usize| {
        format!(
            "({}, {}, {}, {}, {}, {})",
            array(first, &key),
            repeat("'p'"),
            array(KEYS + 1, &token),
            repeat("60000000::int8"),
            repeat("NULL::bytea"),
            repeat("3600000000::int8"),
        )
    };
    let statements = [
        (
            "claim_many_fresh",
            store.statements().claim_many_fresh().unwrap(),
            claim_args(KEYS + 1),
        ),
        (
            "claim_many",
            store.statements().claim_many().unwrap(),
            claim_args(1),
        ),
        (
            "complete_many",
            store.statements().complete_many().unwrap(),
            format!(
                "({}, {}, {}, {}, {})",
                array(1, &key),
                array(1, &token),
                repeat("'\\x72'::bytea"),
                repeat("3600000000::int8"),
                repeat("true"),
            ),
        ),
    ];
    let states = [
        ("empty, never analyzed", held.clone()),
        (
            "filled, never analyzed",
            format!(
                "{held}; INSERT INTO {table} (record_key, prefix, token, fence, state, \
                 lease_until, result, fingerprint, created_at, updated_at, expires_at) \
                 SELECT convert_to(lpad(g::text, 56, '0'), 'UTF8'), 'p', \
                 int8send(g) || int8send(g), 1, 'completed', now(), '\\x72', NULL, now(), \
                 now(), now() + INTERVAL '1 hour' \
                 FROM generate_series(1000001, 1004000) AS g"
            ),
        ),
        ("filled and analyzed", format!("ANALYZE {table}")),
    ];
    for (round, (state, before)) in states.into_iter().enumerate() {
        if round < 2 {
            sqlx::raw_sql(AssertSqlSafe(format!("TRUNCATE {table}")))
                .execute(&mut *conn)
                .await
                .unwrap();
        }
        sqlx::raw_sql(AssertSqlSafe(before))
            .execute(&mut *conn)
            .await
            .unwrap();
        for ((name, sql, args), mode) in statements
            .iter()
            .flat_map(|statement| ["generic", "custom"].map(|mode| (statement, mode)))
        {
            let prepare = format!(
                "SET plan_cache_mode = force_{mode}_plan; \
                 PREPARE {name}_{mode}{round} AS {sql}"
            );
            sqlx::raw_sql(AssertSqlSafe(prepare))
                .execute(&mut *conn)
                .await
                .unwrap();
            // Run, then undone: every statement sees the rows as `before` left them.
            sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
            let explain = format!(
                "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) EXECUTE {name}_{mode}{round}{args}"
            );
            let lines: Vec<String> = sqlx::query_scalar(AssertSqlSafe(explain))
                .fetch_all(&mut *conn)
                .await
                .unwrap();
            sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
            let plan = lines.join("\n");
            let rejected: usize = plan
                .lines()
                .filter_map(|line| line.trim().strip_prefix("Rows Removed by Join Filter: "))
                .map(|n| n.parse::<usize>().unwrap())
                .sum();
            assert!(
                rejected < KEYS,
                "{name}, {mode} plan, table {state}: {rejected} pairs rejected for {KEYS} \
                 keys:\n{plan}"
            );
        }
    }
    drop(conn);
    store.pool().close().await;
    drop(records);
}

/// A batch claim is two statements: the insert-only claim of its fresh keys, then the full
/// claim of the others. When the second one fails, the keys the first one took are still
/// acquired (their owners run, or give them back), and only the other keys' claims fail:
/// a failed claim means the key was not taken, so no key is left held by a claim that
/// reported failure. The failure is a trigger that refuses the full claim's statement.
#[tokio::test]
async fn a_failed_full_batch_claim_leaves_the_fresh_keys_acquired() {
    let (schema, table, store) = in_scratch_schema().await;
    let hour = Duration::from_secs(3600);
    let held = req(&Key::new("refused", 1, &[&"held"]).unwrap(), hour, hour);
    acquired(store.claim(&held).await);
    let refuse = [
        format!(
            "CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN IF current_query() LIKE '%DO UPDATE%' THEN \
             RAISE EXCEPTION 'full claim refused'; END IF; RETURN NULL; END $$",
            schema = schema.name()
        ),
        format!(
            "CREATE TRIGGER refuse AFTER INSERT ON {table} \
             FOR EACH STATEMENT EXECUTE FUNCTION {}.refuse()",
            schema.name()
        ),
    ];
    for sql in refuse {
        sqlx::query(AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .unwrap();
    }

    let fresh = req(&Key::new("refused", 1, &[&"fresh"]).unwrap(), hour, hour);
    let other = req(&held.key, hour, hour);
    let mut claims = store.claim_many(&[fresh.clone(), other]).await.into_iter();
    let fence = acquired(claims.next().unwrap());
    let record = store.read(&fresh.key).await.unwrap().unwrap();
    assert_eq!((record.token, record.fence), (fresh.token, fence));
    let refused = claims.next().unwrap().unwrap_err();
    assert!(!refused.is_outcome_unknown(), "{refused}");
    // The held key is untouched: still its first owner's.
    let record = store.read(&held.key).await.unwrap().unwrap();
    assert_eq!(record.token, held.token);
}

#[tokio::test]
async fn batch_answers_as_single_claims_would() {
    // In a scratch schema: the statement counter's table and function go with it, even when
    // the test fails.
    let (_schema, _, store) = in_scratch_schema().await;
    sql_cases::batch_answers_as_single_claims_would::<Pg>(&store).await;
}

#[tokio::test]
async fn corrupt_records_are_reported_as_corrupt() {
    let records = Scratch::table(Server::Postgres);
    sql_cases::corrupt_records_are_reported_as_corrupt::<Pg>(&store_on(&records).await).await;
}

#[tokio::test]
async fn result_above_the_store_limit_is_rejected() {
    let records = Scratch::table(Server::Postgres);
    let store = PostgresStore::builder(records.url())
        .table(records.name().to_string())
        .max_result_size(1024)
        .build()
        .await
        .unwrap();
    assert_eq!(store.max_result_size(), 1024);
    sql_cases::result_above_the_store_limit_is_rejected::<Pg>(&store).await;
}

#[tokio::test]
async fn result_size_limit_defaults_and_is_clamped_to_bytea() {
    let records = Scratch::table(Server::Postgres);
    let store = store_on(&records).await;
    assert_eq!(
        store.max_result_size(),
        idempotency::store::DEFAULT_MAX_RESULT_SIZE
    );
    let store = PostgresStore::builder(records.url())
        .table(records.name().to_string())
        .max_result_size(usize::MAX)
        .build()
        .await
        .unwrap();
    // A `bytea` value is at most 1 GiB; 64 KiB are left to the rest of the row.
    assert_eq!(store.max_result_size(), (1 << 30) - 1 - (64 << 10));
}

#[tokio::test]
async fn schema_qualified_table_is_created_with_its_schema() {
    let (schema, table, store) = in_scratch_schema().await;
    assert_eq!(store.table(), table);
    let key = Key::new("schema", 1, &[&1u8]).unwrap();
    let r = req(&key, Duration::from_secs(30), Duration::from_secs(60));
    acquired(store.claim(&r).await);
    assert_eq!(count(&store, &table).await, 1);
    // Migrating again is a no-op, recorded once.
    store.migrate().await.unwrap();
    let migrations = format!("{}.records_migrations", schema.name());
    assert_eq!(count(&store, &migrations).await, 1);
}

#[tokio::test]
async fn shipped_schema_file_matches_the_embedded_migration() {
    // A table created by hand from the shipped file is accepted as it is by `migrate`.
    let records = Scratch::table(Server::Postgres);
    let file = include_str!(
        "../idempotent-runtime/migrations/postgres/0001_create_idempotent_records.sql"
    );
    let sql = file.replace("idempotent_records", records.name());
    let store = PostgresStore::builder(records.url())
        .table(records.name().to_string())
        .migrate(false)
        .build()
        .await
        .unwrap();
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(store.pool())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let key = Key::new("by-hand", 1, &[&1u8]).unwrap();
    let r = req(&key, Duration::from_secs(30), Duration::from_secs(60));
    acquired(store.claim(&r).await);
}

#[tokio::test]
async fn invalid_table_names_are_refused_before_connecting() {
    for name in [
        "records; DROP TABLE users",
        "a.b.c",
        "1records",
        "\"quoted\"",
    ] {
        let err = PostgresStore::builder("postgres://nobody@127.0.0.1:1/none")
            .table(name)
            .build()
            .await
            .unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Unsafe, "{name}");
    }
}

#[tokio::test]
async fn store_on_the_application_pool_shares_its_connections() {
    let records = Scratch::table(Server::Postgres);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(3)
        .connect(records.url())
        .await
        .unwrap();
    let store = PostgresStore::from_pool(pool.clone())
        .table(records.name().to_string())
        .build()
        .await
        .unwrap();
    assert_eq!(store.pool().options().get_max_connections(), 3);
    let key = Key::new("from-pool", 1, &[&1u8]).unwrap();
    let r = req(&key, Duration::from_secs(30), Duration::from_secs(60));
    acquired(store.claim(&r).await);
    let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        records.name()
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rows, 1);
    let err = PostgresStore::from_pool(pool)
        .table(records.name().to_string())
        .max_connections(8)
        .build()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unsafe);
    assert!(err.to_string().contains("max_connections"), "{err}");
}

#[tokio::test]
async fn unreachable_database_is_unavailable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = PostgresStore::builder(&format!("postgres://postgres@127.0.0.1:{port}/test"))
        .acquire_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable);
    assert!(
        std::error::Error::source(&err).is_some(),
        "the sqlx error is kept"
    );
}

// ---------------------------------------------------------------------------------------
// The database goes away mid-run.

/// A consumer's view of one business key: effects applied and handler executions.
#[derive(Default)]
struct Ledger {
    effects: Mutex<HashMap<String, u32>>,
    executions: AtomicUsize,
}

impl Ledger {
    fn applied(&self, order: &str) -> bool {
        self.effects.lock().unwrap().contains_key(order)
    }
    fn apply(&self, order: &str) {
        self.executions.fetch_add(1, Ordering::SeqCst);
        *self
            .effects
            .lock()
            .unwrap()
            .entry(order.to_string())
            .or_default() += 1;
    }
    fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }
}

/// One delivery of the message for `order`: the business-status check reads the ledger, so
/// an effect whose completion was lost with the database is not applied again.
async fn consume(guard: &Idempotency, ledger: &Ledger, order: &str) -> Result<(), Error> {
    let key = Key::new("order:consume", 1, &[&order])?;
    guard
        .operation(key)
        .done(|| async { Ok::<_, Error>(ledger.applied(order)) })
        .run(async {
            ledger.apply(order);
            tokio::time::sleep(Duration::from_millis(5)).await;
            Ok(())
        })
        .await
}

/// A broker: delivers every message, redelivers (after a pause) what the consumer asks to,
/// with at most 10 deliveries in flight, until every message is acknowledged. Returns how
/// many deliveries were redelivered.
async fn deliver_all(guard: &Idempotency, ledger: &Arc<Ledger>, messages: Vec<String>) -> usize {
    let limit = Arc::new(tokio::sync::Semaphore::new(10));
    let redelivered = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for order in messages {
        let (guard, ledger) = (guard.clone(), ledger.clone());
        let (limit, redelivered) = (limit.clone(), redelivered.clone());
        tasks.spawn(async move {
            loop {
                let out = {
                    let _permit = limit.acquire().await.unwrap();
                    consume(&guard, &ledger, &order).await
                };
                match out {
                    Ok(()) => return,
                    Err(err) => match err.action() {
                        Action::Ack => return,
                        Action::Redeliver => {
                            redelivered.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        _ => panic!("{order} was dead-lettered: {err:?}"),
                    },
                }
            }
        });
    }
    let all = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
    })
    .await;
    assert!(
        all.is_ok(),
        "messages were still unacknowledged after 120 s"
    );
    redelivered.load(Ordering::SeqCst)
}

fn orders(range: std::ops::Range<u32>, copies: usize) -> Vec<String> {
    range
        .flat_map(|i| std::iter::repeat_n(format!("order-{i}"), copies))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_outage_fails_closed_and_processing_resumes() {
    let cluster = PgCluster::start();
    let store = Arc::new(
        PostgresStore::builder(&cluster.url())
            .max_connections(8)
            .acquire_timeout(Duration::from_millis(500))
            .build()
            .await
            .unwrap_or_else(|e| panic!("{e:?}; server log:\n{}", cluster.log_text())),
    );
    let guard = Idempotency::new(Duration::from_secs(3600))
        .lease(Duration::from_secs(2))
        .store(store.clone());
    let ledger = Arc::new(Ledger::default());

    // Up: 40 orders, each delivered three times.
    deliver_all(&guard, &ledger, orders(0..40, 3)).await;
    assert_eq!(ledger.executions(), 40);

    // A handler is running when the database goes away.
    let entered = Arc::new(tokio::sync::Notify::new());
    let finish = Arc::new(tokio::sync::Notify::new());
    let in_flight = {
        let (guard, ledger) = (guard.clone(), ledger.clone());
        let (entered, finish) = (entered.clone(), finish.clone());
        tokio::spawn(async move {
            let key = Key::new("order:consume", 1, &[&"order-in-flight"]).unwrap();
            guard
                .run(key, async {
                    entered.notify_one();
                    finish.notified().await;
                    // No renewal reaches the database: the lease runs out under the handler.
                    idempotency::current().unwrap().lost().await;
                    ledger.apply("order-in-flight");
                    Ok::<_, Error>(())
                })
                .await
        })
    };
    entered.notified().await;
    tokio::task::block_in_place(|| cluster.stop());

    // Down: every delivery fails closed. No handler runs, nothing is applied or lost.
    let mut refused = 0;
    for order in orders(40..80, 1) {
        match consume(&guard, &ledger, &order).await {
            Err(err @ Error::Store(_)) => {
                assert_eq!(err.action(), Action::Redeliver);
                refused += 1;
            }
            other => panic!("{order} did not fail closed: {other:?}"),
        }
    }
    assert_eq!(refused, 40);
    assert_eq!(ledger.executions(), 40);

    // The in-flight handler finishes while the database is down, after its lease ran out: its
    // effect is applied but its completion cannot be recorded, and another owner may take the
    // key, so the caller is told it lost ownership (the broker redelivers; the business check
    // finds the effect applied). The completion goes on being retried in the background.
    finish.notify_one();
    let lost = in_flight.await.unwrap();
    assert!(matches!(lost, Err(Error::LostOwnership { .. })), "{lost:?}");
    assert_eq!(ledger.executions(), 41);

    // Up again: the refused messages are redelivered (twice each), and so is the in-flight
    // one. Its record is still in progress; once its lease runs out the redelivery takes it
    // over and the business check finds the effect applied.
    tokio::task::block_in_place(|| cluster.start_again());
    let mut again = orders(40..80, 2);
    again.extend(["order-in-flight".to_string(), "order-in-flight".to_string()]);
    deliver_all(&guard, &ledger, again).await;

    // Exactly one effect per business key, and one handler execution per key.
    let effects = ledger.effects.lock().unwrap().clone();
    assert_eq!(effects.len(), 81);
    let twice: HashSet<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        twice.is_empty(),
        "effects applied more than once: {twice:?}"
    );
    assert_eq!(ledger.executions(), 81);
    for order in effects.keys() {
        let key = Key::new("order:consume", 1, &[order]).unwrap();
        let record = store.read(&key).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed, "{order}");
    }
}

/// The conformance suite on a store whose claims commit asynchronously: every rule holds.
mod asynchronous_claims {
    use super::*;

    async fn postgres_async() -> Postgres {
        let table = Scratch::table(Server::Postgres);
        let store = PostgresStore::builder(table.url())
            .table(table.name().to_string())
            .asynchronous_claims(true)
            .build()
            .await
            .unwrap();
        Postgres {
            store: Arc::new(store),
            _table: table,
        }
    }

    conformance_suite!(postgres_async);

    /// Only the autocommit claim turns `synchronous_commit` off, for its own transaction:
    /// the next statement on the same connection (a completion) runs with the server's
    /// setting, and a claim inside the caller's transaction leaves that transaction's
    /// setting alone.
    #[tokio::test]
    async fn only_the_claim_commits_asynchronously() {
        let table = Scratch::table(Server::Postgres);
        let pool = sqlx::pool::PoolOptions::<sqlx::Postgres>::new()
            .max_connections(1)
            .connect(table.url())
            .await
            .unwrap();
        let store = PostgresStore::from_pool(pool.clone())
            .table(table.name().to_string())
            .asynchronous_claims(true)
            .build()
            .await
            .unwrap();
        let statements = store.statements();
        let claims = [
            Some(statements.claim()),
            statements.claim_fresh(),
            statements.claim_many(),
            statements.claim_many_fresh(),
        ];
        for claim in claims {
            let claim = claim.expect("an insert-only claim is sent first");
            assert!(claim.contains("set_config('synchronous_commit'"), "{claim}");
        }
        let show = || async {
            let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
                .fetch_one(&pool)
                .await
                .unwrap();
            setting
        };
        let server = show().await;
        assert_ne!(server, "off", "the server itself commits asynchronously");
        let key = Key::new(&format!("{}:async", table.name()), 1, &[&1u8]).unwrap();
        let owner = req(&key, Duration::from_secs(60), Duration::from_secs(60));
        acquired(store.claim(&owner).await);
        // One connection: the claim ran on the connection `show` reads now.
        assert_eq!(show().await, server);
        let done = idempotency::store::Completion::new(None, Duration::from_secs(60));
        assert!(store.complete(&key, &owner.token, &done).await.unwrap());

        let other = Key::new(&format!("{}:async", table.name()), 1, &[&2u8]).unwrap();
        let mut tx = pool.begin().await.unwrap();
        let inside: Result<String, Error> = store
            .run_in_tx(&mut tx, other, Duration::from_secs(60), async |conn| {
                let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(|e| {
                        Error::Store(idempotency::store::StoreError::new(
                            StoreErrorKind::Unavailable,
                            e.to_string(),
                        ))
                    })?;
                Ok(setting)
            })
            .await;
        assert_eq!(
            inside.unwrap(),
            server,
            "the caller's transaction changed its setting"
        );
        tx.commit().await.unwrap();
    }
}
