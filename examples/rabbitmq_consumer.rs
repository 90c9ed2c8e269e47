//! A RabbitMQ order consumer whose duplicates are filtered, whose failures are retried and
//! then dead-lettered, each message settled by its handler's outcome.
//!
//! What it shows, on a real RabbitMQ:
//! 1. an order handler with `#[idempotent(prefix = "order:consume", keys = [msg.order_id,
//!    msg.activity_id], ttl = 3600)]`: a producer retry (new message id, same order and
//!    activity) is acknowledged without running the handler again;
//! 2. `broker::rabbitmq::settle` turning each outcome into `basic.ack`, `basic.nack` with
//!    requeue, or `basic.reject` to the dead-letter queue, as the table in
//!    `idempotency::broker` says;
//! 3. a handler that keeps failing, redelivered until its third delivery (counted by the
//!    quorum queue's `x-delivery-count`) and then dead-lettered; a message with an empty
//!    order id, dead-lettered at once.
//!
//! It declares its own quorum queue and dead-letter queue (names unique to the run) and
//! deletes both at the end.
//!
//! Needs: RabbitMQ on 127.0.0.1:5672 (guest/guest; `AMQP_URL` to change it) and a store:
//! Redis on 127.0.0.1:6379 by default, or any `IDEMPOTENT_STORE_URL` (`memory:` needs no
//! server).
//!
//! ```text
//! cargo run --example rabbitmq_consumer
//! IDEMPOTENT_STORE_URL=memory: cargo run --example rabbitmq_consumer
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use idempotency::broker::rabbitmq::Queue;
use idempotency::broker::{rabbitmq, Decision, Redelivery, Settle};
use idempotency::idempotent;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};

/// "Cook this free-meal order for this activity."
#[derive(Debug, Serialize, Deserialize)]
struct OrderMessage {
    message_id: String,
    order_id: String,
    activity_id: String,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotency::Error),
    #[error("the kitchen is down")]
    KitchenDown,
}

/// Tells the broker integration which errors are idempotency outcomes (duplicates, a store
/// outage, ...) and which are the handler's own (retried, then dead-lettered).
impl Settle for AppError {
    fn idempotency_error(&self) -> Option<&idempotency::Error> {
        match self {
            AppError::Idempotency(err) => Some(err),
            AppError::KitchenDown => None,
        }
    }
}

/// The effect to apply once per order and activity.
#[derive(Default)]
struct Kitchen {
    meals: AtomicU32,
}

impl Kitchen {
    async fn cook(&self, msg: &OrderMessage) -> Result<u32, AppError> {
        if msg.order_id.starts_with("A-1004") {
            return Err(AppError::KitchenDown);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        Ok(self.meals.fetch_add(1, Ordering::SeqCst) + 1)
    }
}

/// The consumer's handler: runs at most once per (order, activity).
#[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.activity_id], ttl = 3600)]
async fn on_order(msg: &OrderMessage, kitchen: &Kitchen) -> Result<u32, AppError> {
    kitchen.cook(msg).await
}

fn outcome(result: &Result<u32, AppError>) -> String {
    match result {
        Ok(meal) => format!("handler ran: meal #{meal} cooked"),
        Err(AppError::Idempotency(idempotency::Error::Duplicate { .. })) => {
            "duplicate: already processed, not run again".into()
        }
        Err(AppError::Idempotency(idempotency::Error::InvalidKey(err))) => {
            format!("invalid key ({err})")
        }
        Err(err) => format!("{err}"),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let store_url =
        std::env::var("IDEMPOTENT_STORE_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    idempotency::set_default_store(idempotency::connect(&store_url).await?)?;
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let conn = Connection::connect(&amqp_url, ConnectionProperties::default())
        .await
        .map_err(|e| {
            format!("RabbitMQ is not reachable at {amqp_url} ({e}); start it with `rabbitmq-server -detached`")
        })?;
    println!("store: {store_url}, broker: {amqp_url}");

    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis()
        % 1_000_000;
    let queue = format!("idempotent.example.orders.{run}");
    let dead = format!("{queue}.dead");
    let channel = conn.create_channel().await?;

    // A quorum queue (it counts deliveries) whose rejected messages go to `dead`.
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(dead.as_str().into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(dead.as_str().into(), durable, FieldTable::default())
        .await?;
    channel
        .queue_declare(queue.as_str().into(), durable, args)
        .await?;
    println!("queue {queue} (dead letters: {dead})\n");

    // The producer side: a first delivery, a producer retry with a new message id, a
    // second order, an order whose handler keeps failing, and a message without an order id.
    let orders = [
        ("msg-1", format!("A-1001-{run}")),
        ("msg-2", format!("A-1001-{run}")),
        ("msg-3", format!("A-1002-{run}")),
        ("msg-4", format!("A-1004-{run}")),
        ("msg-5", String::new()),
    ];
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for (message_id, order_id) in &orders {
        let msg = OrderMessage {
            message_id: message_id.to_string(),
            order_id: order_id.clone(),
            activity_id: "free-meal-2026".into(),
        };
        channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &serde_json::to_vec(&msg)?,
                BasicProperties::default().with_message_id((*message_id).into()),
            )
            .await?
            .await?;
    }

    // The consumer side: deliveries are counted from the quorum queue's `x-delivery-count`.
    let source = Queue::quorum(queue.as_str());
    let redelivery = Redelivery::new()
        .max_deliveries(3)
        .retry_delay(Duration::from_millis(300));
    let kitchen = Kitchen::default();
    channel.basic_qos(1, BasicQosOptions::default()).await?;
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "example".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut finished = 0;
    let mut decisions: HashMap<String, u32> = HashMap::new();
    while finished < orders.len() {
        let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .map_err(|_| "no delivery within 10 s")?
            .ok_or("the consumer was cancelled")??;
        let msg: OrderMessage = serde_json::from_slice(&delivery.data)?;
        let result = on_order(&msg, &kitchen).await;
        let decision = rabbitmq::settle(&delivery, &source, &result, &redelivery).await?;
        let delivery_no = rabbitmq::deliveries(&delivery, &source)
            .map_or_else(|| "?".to_string(), |n| n.to_string());
        println!(
            "{:<6} order {:<16} delivery {delivery_no}  {:<50} -> {decision}",
            msg.message_id,
            format!("{:?}", msg.order_id),
            outcome(&result),
        );
        if !matches!(decision, Decision::Redeliver { .. }) {
            finished += 1;
            *decisions.entry(decision.to_string()).or_default() += 1;
        }
    }
    channel
        .basic_cancel("example".into(), BasicCancelOptions::default())
        .await?;

    // Dead-lettering is asynchronous inside the broker: wait (up to 5 s) for both messages.
    let passive = QueueDeclareOptions::default().passive();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let dead_count = loop {
        let count = channel
            .queue_declare(dead.as_str().into(), passive, FieldTable::default())
            .await?
            .message_count();
        if count >= 2 || tokio::time::Instant::now() >= deadline {
            break count;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let meals = kitchen.meals.load(Ordering::SeqCst);
    println!();
    println!(
        "meals cooked: {meals} (2 orders); acked: {}; dead-lettered: {} ({dead_count} in {dead})",
        decisions.get("ack").copied().unwrap_or(0),
        decisions.get("dead-letter").copied().unwrap_or(0),
    );

    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    channel
        .queue_delete(dead.as_str().into(), QueueDeleteOptions::default())
        .await?;
    conn.close(200, "done".into()).await?;

    if meals != 2 || dead_count != 2 {
        return Err("unexpected counts".into());
    }
    Ok(())
}
