//! `--consumer`: one consumer process. It applies each `order.created` message's effect
//! once, keyed on the message id (the outbox id), with `#[idempotent]` on the PostgreSQL
//! store, until its stdin closes, and reports on stdout, one line each:
//!
//! - `start <id>` when the handler's body starts (its work takes 20 ms, then the effect row
//!   is inserted);
//! - `done <id>`: the `done` business check found the effect already applied (a previous
//!   owner applied it and died before recording it, say);
//! - `outcome <kind> <id>` when the handler returned, before the message is settled: kind is
//!   `applied`, `duplicate`, `in-progress`, `store-error`, `lost-ownership`, `malformed` or
//!   `failed`;
//! - `connection-lost <error>`: the broker closed the connection; handlers in flight finish
//!   (their messages cannot be acknowledged any more: the broker redelivers them to the
//!   other consumers), and the process exits with status 3 (the parent starts another).

use std::io::Read;
use std::sync::Arc;

use futures_util::StreamExt;
use idempotency::broker::{nats, rabbitmq, Redelivery, Settle};
use idempotency::idempotent;
use idempotency::sql::PostgresStore;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use serde::Deserialize;

use crate::business::Business;
use crate::{
    report, BoxError, Broker, Setup, CONCURRENCY, EXIT_CONNECTION_LOST, IN_PROGRESS_DELAY, WORK,
};

/// The `order.created` payload.
#[derive(Debug, Deserialize)]
struct OrderCreated {
    order_id: String,
    amount_cents: i32,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotency::Error),
    #[error("business database error")]
    Business(#[from] sqlx::Error),
    #[error("malformed message: {0}")]
    Malformed(String),
}

impl Settle for AppError {
    fn idempotency_error(&self) -> Option<&idempotency::Error> {
        match self {
            AppError::Idempotency(err) => Some(err),
            _ => None,
        }
    }
    fn is_permanent(&self) -> bool {
        matches!(self, AppError::Malformed(_))
    }
}

/// The effect: a row in `effects`, after 20 ms of work.
struct Effects {
    business: Business,
}

impl Effects {
    /// The `done` check: is there an effect row for this message already?
    async fn applied(&self, message_id: &str) -> Result<bool, sqlx::Error> {
        let applied: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM effects WHERE message_id = $1)")
                .bind(message_id)
                .fetch_one(self.business.pool())
                .await?;
        if applied {
            report(format_args!("done {message_id}"));
        }
        Ok(applied)
    }

    async fn apply(&self, message_id: &str, order: &OrderCreated) -> Result<(), sqlx::Error> {
        report(format_args!("start {message_id}"));
        tokio::time::sleep(WORK).await;
        sqlx::query("INSERT INTO effects (message_id, order_id, pid) VALUES ($1, $2, $3)")
            .bind(message_id)
            .bind(&order.order_id)
            .bind(i32::try_from(std::process::id()).unwrap_or(i32::MAX))
            .execute(self.business.pool())
            .await?;
        Ok(())
    }
}

/// The consumer's handler: its effect happens once per message id, however often the
/// message is published or delivered.
#[idempotent(
    prefix = "outbox-load:order-created",
    keys = [message_id],
    ttl = 3600,
    lease = 2,
    done = effects.applied(message_id)
)]
async fn on_order_created(
    message_id: &str,
    order: &OrderCreated,
    effects: &Effects,
) -> Result<(), AppError> {
    if order.amount_cents <= 0 {
        return Err(AppError::Malformed(format!(
            "amount {}",
            order.amount_cents
        )));
    }
    effects.apply(message_id, order).await?;
    Ok(())
}

/// One delivery: its message id (the broker's), its payload.
async fn handle(
    effects: &Effects,
    message_id: Option<String>,
    payload: &[u8],
) -> Result<(), AppError> {
    let Some(message_id) = message_id else {
        report(format_args!("outcome malformed -"));
        return Err(AppError::Malformed("no message id".into()));
    };
    let result = match serde_json::from_slice::<OrderCreated>(payload) {
        Ok(order) => on_order_created(&message_id, &order, effects).await,
        Err(err) => Err(AppError::Malformed(err.to_string())),
    };
    let kind = match &result {
        Ok(()) => "applied",
        Err(AppError::Idempotency(err)) if err.is_duplicate() => "duplicate",
        Err(AppError::Idempotency(idempotency::Error::InProgress { .. })) => "in-progress",
        Err(AppError::Idempotency(idempotency::Error::Store(_))) => "store-error",
        Err(AppError::Idempotency(idempotency::Error::LostOwnership { .. })) => "lost-ownership",
        Err(AppError::Malformed(_)) => "malformed",
        Err(_) => "failed",
    };
    report(format_args!("outcome {kind} {message_id}"));
    result
}

/// The consumer process; returns its exit status.
pub(crate) async fn run(setup: &Setup) -> Result<i32, BoxError> {
    let business =
        Business::connect(&setup.business_url, &setup.schema, CONCURRENCY as u32 + 2).await?;
    // The idempotency records share the business pool, in the run's schema.
    let store = PostgresStore::from_pool(business.pool().clone())
        .table(setup.store_table())
        .migrate(false)
        .build()
        .await?;
    idempotency::set_default_store(Arc::new(store))?;
    let effects = Arc::new(Effects { business });
    let redelivery = Redelivery::new()
        .max_deliveries(10)
        .retry_delay(IN_PROGRESS_DELAY)
        .in_progress_delay(IN_PROGRESS_DELAY);

    // Stdin closes when the parent stops the run.
    let (closed_tx, closed) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        let _ = closed_tx.send(());
    });

    let status = match setup.broker {
        Broker::RabbitMq => {
            let name = setup.connection_name("consumer");
            let conn = Connection::connect(
                &setup.amqp_url,
                ConnectionProperties::default().with_connection_name(name.as_str().into()),
            )
            .await?;
            let mut events = conn.events_listener();
            tokio::spawn(async move {
                while let Some(event) = events.next().await {
                    if let lapin::Event::Error(err) = event {
                        report(format_args!("connection-lost {err}"));
                        return;
                    }
                }
            });
            let channel = conn.create_channel().await?;
            channel
                .basic_qos(CONCURRENCY as u16, BasicQosOptions::default())
                .await?;
            let consumer = channel
                .basic_consume(
                    setup.destination.as_str().into(),
                    "effects".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            let queue = rabbitmq::Queue::quorum(setup.destination.as_str());
            let mut task = tokio::spawn(rabbitmq::consume(
                consumer,
                queue,
                CONCURRENCY,
                redelivery,
                // Until the consumer is cancelled, or its connection closes.
                std::future::pending(),
                move |delivery: rabbitmq::Message| {
                    let effects = effects.clone();
                    async move {
                        let message_id = delivery
                            .properties
                            .message_id()
                            .as_ref()
                            .map(|id| id.to_string());
                        handle(&effects, message_id, &delivery.data).await
                    }
                },
            ));
            tokio::select! {
                _ = closed => {
                    channel
                        .basic_cancel("effects".into(), BasicCancelOptions::default())
                        .await?;
                    task.await??;
                    channel.close(200, "consumer stopped".into()).await?;
                    conn.close(200, "consumer stopped".into()).await?;
                    0
                }
                // The consumer ended by itself: its connection or channel closed. Handlers in
                // flight finished; their messages could not be acknowledged and are
                // redelivered to the other consumers.
                ended = &mut task => match ended? {
                    Ok(_) => 0,
                    Err(_) => EXIT_CONNECTION_LOST,
                },
            }
        }
        Broker::Nats => {
            let client = async_nats::connect(&setup.nats_url).await?;
            let js = async_nats::jetstream::new(client.clone());
            let consumer: async_nats::jetstream::consumer::PullConsumer = js
                .get_stream(&setup.stream)
                .await?
                .get_consumer(&setup.durable)
                .await?;
            let stop = async {
                let _ = closed.await;
            };
            nats::consume(
                &consumer,
                CONCURRENCY,
                redelivery,
                stop,
                move |message: async_nats::jetstream::Message| {
                    let effects = effects.clone();
                    async move {
                        let message_id = message
                            .headers
                            .as_ref()
                            .and_then(|headers| headers.get("Nats-Msg-Id"))
                            .map(|id| id.as_str().to_owned());
                        handle(&effects, message_id, &message.payload).await
                    }
                },
            )
            .await?;
            // Acks are published without waiting: send them before exiting.
            client.flush().await?;
            0
        }
    };
    Ok(status)
}
