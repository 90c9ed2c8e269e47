//! The business side of the seed's load test, in PostgreSQL: the orders whose status moves
//! `INIT` → `CONSUMED` by compare-and-set, a ledger row per applied effect (in the same
//! transaction), a row per handler execution (committed on its own, so executions of
//! consumers killed mid-handler are counted too), and each message's final outcome,
//! recorded before the message is acknowledged.
//!
//! Everything lives in a schema of its own, created for the run and dropped at the end.
//! `tests/rabbitmq.rs` and `tests/nats.rs` count their effects with the same tables.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

/// The business database of one run.
#[derive(Clone)]
pub(crate) struct Business {
    pool: PgPool,
}

/// What a handler did to an order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Effect {
    /// The compare-and-set moved the order to `CONSUMED`: the effect is applied by us.
    Applied,
    /// The order was `CONSUMED` already: nothing was applied.
    AlreadyApplied,
}

/// The final tallies of a run.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// Ledger rows: effects applied.
    pub(crate) effects: i64,
    /// Messages acknowledged as duplicates that did not apply the effect themselves.
    pub(crate) filtered: i64,
    /// Messages acknowledged as duplicates whose order is not `CONSUMED`.
    pub(crate) wrong: i64,
    /// Orders still `INIT`.
    pub(crate) lost: i64,
    /// Handler executions (bodies started), across every consumer process.
    pub(crate) executions: i64,
    /// Executions that never finished (their consumer was killed mid-handler).
    pub(crate) interrupted: i64,
    /// Messages whose handler ran but found the order consumed already.
    pub(crate) absorbed: i64,
    /// Orders applied more than once (must be 0: one ledger row per order).
    pub(crate) doubled: i64,
}

impl Business {
    /// Connects to `url` with `schema` as the search path.
    pub(crate) async fn connect(
        url: &str,
        schema: &str,
        connections: u32,
    ) -> Result<Business, sqlx::Error> {
        let options = PgConnectOptions::from_str(url)?.options([("search_path", schema)]);
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await?;
        Ok(Business { pool })
    }

    /// Creates the run's schema and tables, with `orders` orders in `INIT`.
    pub(crate) async fn create(
        url: &str,
        schema: &str,
        orders: u32,
    ) -> Result<Business, sqlx::Error> {
        {
            let admin = PgPoolOptions::new().max_connections(1).connect(url).await?;
            sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                .execute(&admin)
                .await?;
            admin.close().await;
        }
        let business = Business::connect(url, schema, 4).await?;
        sqlx::raw_sql(
            "CREATE TABLE orders (
                 id text PRIMARY KEY,
                 status text NOT NULL DEFAULT 'INIT' CHECK (status IN ('INIT', 'CONSUMED')),
                 consumed_by text
             );
             CREATE TABLE ledger (
                 id bigserial PRIMARY KEY,
                 order_id text NOT NULL,
                 message_id text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
             );
             CREATE TABLE executions (
                 id bigserial PRIMARY KEY,
                 order_id text NOT NULL,
                 message_id text NOT NULL,
                 pid integer NOT NULL,
                 finished boolean NOT NULL DEFAULT false
             );
             CREATE TABLE settled (
                 message_id text PRIMARY KEY,
                 order_id text NOT NULL,
                 outcome text NOT NULL
             );",
        )
        .execute(&business.pool)
        .await?;
        sqlx::query(
            "INSERT INTO orders (id) SELECT 'order-' || lpad(n::text, 4, '0') FROM generate_series(1, $1) AS n",
        )
        .bind(i64::from(orders))
        .execute(&business.pool)
        .await?;
        Ok(business)
    }

    /// Drops the run's schema.
    pub(crate) async fn drop_schema(url: &str, schema: &str) -> Result<(), sqlx::Error> {
        let admin = PgPoolOptions::new().max_connections(1).connect(url).await?;
        sqlx::query(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&admin)
        .await?;
        admin.close().await;
        Ok(())
    }

    /// The id of the `n`th order (from 1).
    pub(crate) fn order_id(n: u32) -> String {
        format!("order-{n:04}")
    }

    /// The `done` check: is the order's effect applied?
    pub(crate) async fn is_consumed(&self, order_id: &str) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar("SELECT status = 'CONSUMED' FROM orders WHERE id = $1")
            .bind(order_id)
            .fetch_one(&self.pool)
            .await
    }

    /// The handler's body: records the execution, works for `work`, then applies the effect
    /// by compare-and-set, with its ledger row in the same transaction.
    pub(crate) async fn consume(
        &self,
        order_id: &str,
        message_id: &str,
        work: Duration,
    ) -> Result<Effect, sqlx::Error> {
        let execution: i64 = sqlx::query_scalar(
            "INSERT INTO executions (order_id, message_id, pid) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(order_id)
        .bind(message_id)
        .bind(i32::try_from(std::process::id()).unwrap_or(i32::MAX))
        .fetch_one(&self.pool)
        .await?;

        tokio::time::sleep(work).await;

        let mut tx = self.pool.begin().await?;
        let moved = sqlx::query(
            "UPDATE orders SET status = 'CONSUMED', consumed_by = $2 WHERE id = $1 AND status = 'INIT'",
        )
        .bind(order_id)
        .bind(message_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if moved == 1 {
            sqlx::query("INSERT INTO ledger (order_id, message_id) VALUES ($1, $2)")
                .bind(order_id)
                .bind(message_id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;

        sqlx::query("UPDATE executions SET finished = true WHERE id = $1")
            .bind(execution)
            .execute(&self.pool)
            .await?;
        Ok(if moved == 1 {
            Effect::Applied
        } else {
            Effect::AlreadyApplied
        })
    }

    /// Records a message's final outcome (`executed`, `absorbed` or `filtered`), before it is
    /// acknowledged. A redelivered message overwrites its earlier outcome.
    pub(crate) async fn settle(
        &self,
        message_id: &str,
        order_id: &str,
        outcome: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO settled (message_id, order_id, outcome) VALUES ($1, $2, $3)
             ON CONFLICT (message_id) DO UPDATE SET outcome = EXCLUDED.outcome",
        )
        .bind(message_id)
        .bind(order_id)
        .bind(outcome)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// (messages with a final outcome, effects applied).
    pub(crate) async fn progress(&self) -> Result<(i64, i64), sqlx::Error> {
        sqlx::query_as("SELECT (SELECT count(*) FROM settled), (SELECT count(*) FROM ledger)")
            .fetch_one(&self.pool)
            .await
    }

    /// Handlers of process `pid` that started and never finished.
    pub(crate) async fn unfinished(&self, pid: u32) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("SELECT count(*) FROM executions WHERE pid = $1 AND NOT finished")
            .bind(i32::try_from(pid).unwrap_or(i32::MAX))
            .fetch_one(&self.pool)
            .await
    }

    /// The messages whose handlers process `pid` started and never finished.
    pub(crate) async fn unfinished_messages(&self, pid: u32) -> Result<Vec<String>, sqlx::Error> {
        sqlx::query_scalar("SELECT message_id FROM executions WHERE pid = $1 AND NOT finished")
            .bind(i32::try_from(pid).unwrap_or(i32::MAX))
            .fetch_all(&self.pool)
            .await
    }

    /// The run's final numbers.
    pub(crate) async fn tally(&self) -> Result<Tally, sqlx::Error> {
        let row: (i64, i64, i64, i64, i64, i64, i64, i64) = sqlx::query_as(
            "SELECT
                 (SELECT count(*) FROM ledger),
                 (SELECT count(*) FROM settled s WHERE s.outcome = 'filtered'
                      AND NOT EXISTS (SELECT 1 FROM ledger l WHERE l.message_id = s.message_id)),
                 (SELECT count(*) FROM settled s JOIN orders o ON o.id = s.order_id
                      WHERE s.outcome = 'filtered' AND o.status <> 'CONSUMED'),
                 (SELECT count(*) FROM orders WHERE status = 'INIT'),
                 (SELECT count(*) FROM executions),
                 (SELECT count(*) FROM executions WHERE NOT finished),
                 (SELECT count(*) FROM settled s WHERE s.outcome = 'absorbed'
                      AND NOT EXISTS (SELECT 1 FROM ledger l WHERE l.message_id = s.message_id)),
                 (SELECT count(*) FROM (SELECT order_id FROM ledger GROUP BY order_id HAVING count(*) > 1) d)",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Tally {
            effects: row.0,
            filtered: row.1,
            wrong: row.2,
            lost: row.3,
            executions: row.4,
            interrupted: row.5,
            absorbed: row.6,
            doubled: row.7,
        })
    }

    /// Closes the pool.
    pub(crate) async fn close(&self) {
        self.pool.close().await;
    }
}
