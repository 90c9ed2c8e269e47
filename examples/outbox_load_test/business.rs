//! The PostgreSQL side of the outbox load test: the order service's `orders` table, the
//! consumers' `effects` table, the outbox table and the idempotency store's table, all in a
//! schema of the run's own, created at the start and dropped at the end.
//!
//! `effects` has no unique constraint on the message id on purpose: an effect applied twice
//! shows as two rows, and the final tally counts them.

use std::str::FromStr;
use std::time::Duration;

use idempotency::outbox::{Message, MessageId, PostgresOutbox};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

/// The business database of one run, with `schema` as its search path.
#[derive(Clone)]
pub(crate) struct Business {
    pool: PgPool,
}

/// The final numbers, all read from PostgreSQL.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// Rows in `orders`.
    pub(crate) orders: i64,
    /// Distinct message ids with at least one effect row.
    pub(crate) effects: i64,
    /// Effect rows (more than `effects` if an effect was applied twice).
    pub(crate) effect_rows: i64,
    /// Message ids with more than one effect row.
    pub(crate) duplicate_effects: i64,
    /// Orders whose message never produced an effect.
    pub(crate) lost: i64,
}

impl Business {
    /// A pool on `url` whose connections use `schema` as their search path.
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

    /// Creates the run's schema with its `orders` and `effects` tables.
    pub(crate) async fn create(url: &str, schema: &str) -> Result<Business, sqlx::Error> {
        {
            // One connection, no retries: a server that is not there fails at once.
            let mut admin = PgConnection::connect(url).await?;
            sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                .execute(&mut admin)
                .await?;
            admin.close().await?;
        }
        let business = Business::connect(url, schema, 4).await?;
        sqlx::raw_sql(
            "CREATE TABLE orders (
                 id text PRIMARY KEY,
                 amount_cents integer NOT NULL,
                 message_id text NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT clock_timestamp()
             );
             -- One row per applied effect; deliberately no unique constraint on message_id.
             CREATE TABLE effects (
                 id bigserial PRIMARY KEY,
                 message_id text NOT NULL,
                 order_id text NOT NULL,
                 pid integer NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
             );
             CREATE INDEX effects_message_id ON effects (message_id);",
        )
        .execute(&business.pool)
        .await?;
        Ok(business)
    }

    /// Drops the run's schema and everything in it.
    pub(crate) async fn drop_schema(url: &str, schema: &str) -> Result<(), sqlx::Error> {
        let mut admin = PgConnection::connect(url).await?;
        sqlx::query(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&mut admin)
        .await?;
        admin.close().await?;
        Ok(())
    }

    /// The pool.
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The order service: order `n` and its `order.created` message, in one transaction.
    pub(crate) async fn create_order(
        &self,
        outbox: &PostgresOutbox,
        n: u32,
        destination: &str,
    ) -> Result<MessageId, Box<dyn std::error::Error + Send + Sync>> {
        let order_id = format!("order-{n:04}");
        let amount_cents = 500 + i32::try_from(n % 97).unwrap_or(0) * 25;
        let payload = serde_json::to_vec(&serde_json::json!({
            "order_id": order_id,
            "amount_cents": amount_cents,
        }))?;
        let message = Message::new("order", &order_id, "order.created", destination, payload);
        let mut tx = self.pool.begin().await?;
        let message_id = outbox.enqueue(&mut tx, &message).await?;
        sqlx::query("INSERT INTO orders (id, amount_cents, message_id) VALUES ($1, $2, $3)")
            .bind(&order_id)
            .bind(amount_cents)
            .bind(message_id.as_str())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(message_id)
    }

    /// Distinct message ids with an effect.
    pub(crate) async fn effects(&self) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("SELECT count(DISTINCT message_id) FROM effects")
            .fetch_one(&self.pool)
            .await
    }

    /// The run's final numbers.
    pub(crate) async fn tally(&self) -> Result<Tally, sqlx::Error> {
        let row: (i64, i64, i64, i64, i64) = sqlx::query_as(
            "SELECT
                 (SELECT count(*) FROM orders),
                 (SELECT count(DISTINCT message_id) FROM effects),
                 (SELECT count(*) FROM effects),
                 (SELECT count(*) FROM (SELECT message_id FROM effects
                      GROUP BY message_id HAVING count(*) > 1) d),
                 (SELECT count(*) FROM orders o
                      WHERE NOT EXISTS (SELECT 1 FROM effects e WHERE e.message_id = o.message_id))",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Tally {
            orders: row.0,
            effects: row.1,
            effect_rows: row.2,
            duplicate_effects: row.3,
            lost: row.4,
        })
    }

    /// Closes the pool.
    pub(crate) async fn close(&self) {
        self.pool.close().await;
    }
}
