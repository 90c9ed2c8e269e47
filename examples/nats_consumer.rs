//! A NATS JetStream order consumer: one message at a time through an `#[idempotent]`
//! handler, then a whole batch whose keys are claimed in one store round trip.
//!
//! What it shows, on a real NATS server with JetStream:
//! 1. an order handler with `#[idempotent(prefix = "order:consume", keys = [msg.order_id,
//!    msg.activity_id], ttl = 3600)]`: a producer retry (new message id, same order and
//!    activity) is acknowledged without running the handler again. JetStream's own
//!    publish deduplication (`Nats-Msg-Id`) cannot catch it: the message id is new;
//! 2. a fetched batch run through `Idempotency::run_batch`: all keys claimed at once, the
//!    acquired items cooked concurrently, each message settled by its own outcome with
//!    `broker::nats::settle` (`+ACK`, `-NAK` with a delay, `+TERM`). The batch shares its
//!    keys with the attribute (same prefix and parts), so an order cooked in step 1 is a
//!    duplicate here; two copies of one order in the same batch: one runs, the other is
//!    "in progress", naked with a delay, and acknowledged as a duplicate on redelivery.
//!
//! It creates its own stream and pull consumer (names unique to the run) and deletes them.
//!
//! Needs: NATS with JetStream on 127.0.0.1:4222 (`NATS_URL` to change it) and a store: Redis
//! on 127.0.0.1:6379 by default, or any `IDEMPOTENT_STORE_URL` (`memory:` needs no server).
//!
//! ```text
//! cargo run --example nats_consumer
//! IDEMPOTENT_STORE_URL=memory: cargo run --example nats_consumer
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, stream};
use futures_util::StreamExt;
use idempotency::broker::{nats, Decision, Redelivery, Settle};
use idempotency::{idempotent, Idempotency, Key};
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
}

impl Settle for AppError {
    fn idempotency_error(&self) -> Option<&idempotency::Error> {
        match self {
            AppError::Idempotency(err) => Some(err),
        }
    }
}

/// The effect to apply once per order and activity.
#[derive(Default)]
struct Kitchen {
    meals: AtomicU32,
}

impl Kitchen {
    async fn cook(&self, _msg: &OrderMessage) -> Result<u32, AppError> {
        tokio::time::sleep(Duration::from_millis(20)).await;
        Ok(self.meals.fetch_add(1, Ordering::SeqCst) + 1)
    }
}

/// One message at a time: runs at most once per (order, activity).
#[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.activity_id], ttl = 3600)]
async fn on_order(msg: &OrderMessage, kitchen: &Kitchen) -> Result<u32, AppError> {
    kitchen.cook(msg).await
}

/// The key the attribute builds for a message, for the batch path.
fn order_key(msg: &OrderMessage) -> Result<Key, idempotency::key::KeyError> {
    Key::new("order:consume", 1, &[&msg.order_id, &msg.activity_id])
}

fn outcome(result: &Result<u32, AppError>) -> String {
    match result {
        Ok(meal) => format!("handler ran: meal #{meal} cooked"),
        Err(AppError::Idempotency(idempotency::Error::Duplicate { .. })) => {
            "duplicate: already processed, not run again".into()
        }
        Err(AppError::Idempotency(idempotency::Error::InProgress { .. })) => {
            "in progress: the same order is being cooked".into()
        }
        Err(err) => err.to_string(),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let store_url =
        std::env::var("IDEMPOTENT_STORE_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    idempotency::set_default_store(idempotency::connect(&store_url).await?)?;
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client = async_nats::connect(&nats_url).await.map_err(|e| {
        format!("NATS is not reachable at {nats_url} ({e}); start it with JetStream enabled (`nats-server -js`)")
    })?;
    let js = jetstream::new(client.clone());
    println!("store: {store_url}, broker: nats://{nats_url}");

    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis()
        % 1_000_000;
    let stream_name = format!("IDEMPOTENT_EXAMPLE_{run}");
    let subject = format!("idempotent.example.{run}.orders");
    let orders = js
        .create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await?;
    let consumer = orders
        .create_consumer(pull::Config {
            durable_name: Some("kitchen".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(10),
            ..Default::default()
        })
        .await?;
    println!("stream {stream_name}, consumer kitchen\n");

    let publish = |message_id: &str, order: &str| {
        let msg = OrderMessage {
            message_id: message_id.into(),
            order_id: format!("{order}-{run}"),
            activity_id: "free-meal-2026".into(),
        };
        let (js, subject) = (js.clone(), subject.clone());
        async move {
            js.publish(subject, serde_json::to_vec(&msg)?.into())
                .await?
                .await?;
            Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
        }
    };
    let redelivery = Redelivery::new().in_progress_delay(Duration::from_millis(300));
    let kitchen = Kitchen::default();

    println!("1. one message at a time (#[idempotent] handler)");
    publish("msg-1", "A-2001").await?;
    publish("msg-2", "A-2002").await?;
    publish("msg-3", "A-2001").await?; // a producer retry: new message id
    let mut messages = consumer
        .fetch()
        .max_messages(3)
        .expires(Duration::from_secs(2))
        .messages()
        .await?;
    while let Some(message) = messages.next().await {
        let message = message?;
        let msg: OrderMessage = serde_json::from_slice(&message.payload)?;
        let result = on_order(&msg, &kitchen).await;
        let decision = nats::settle(&message, &result, &redelivery).await?;
        println!(
            "   {:<6} order {:<14} {:<46} -> {decision}",
            msg.message_id,
            msg.order_id,
            outcome(&result)
        );
    }

    println!("2. a batch: every key claimed in one round trip (Idempotency::run_batch)");
    publish("msg-4", "A-2001").await?; // cooked in step 1
    publish("msg-5", "A-2003").await?;
    publish("msg-6", "A-2003").await?; // the same order, in the same batch
    publish("msg-7", "A-2004").await?;
    let guard = Idempotency::new(Duration::from_secs(3600));
    let mut settled = 0;
    while settled < 4 {
        let batch: Vec<jetstream::Message> = consumer
            .batch()
            .max_messages(10)
            .expires(Duration::from_secs(1))
            .messages()
            .await?
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        if batch.is_empty() {
            continue;
        }
        let decoded: Vec<OrderMessage> = batch
            .iter()
            .map(|m| serde_json::from_slice(&m.payload))
            .collect::<Result<_, _>>()?;
        let items = decoded
            .iter()
            .map(|msg| Ok((order_key(msg)?, msg)))
            .collect::<Result<Vec<_>, idempotency::key::KeyError>>()?;
        let results: Vec<Result<u32, AppError>> =
            guard.run_batch(items, |msg| kitchen.cook(msg)).await;
        println!("   batch of {}:", batch.len());
        for ((message, msg), result) in batch.iter().zip(&decoded).zip(&results) {
            let decision = nats::settle(message, result, &redelivery).await?;
            println!(
                "   {:<6} order {:<14} {:<46} -> {decision}",
                msg.message_id,
                msg.order_id,
                outcome(result)
            );
            if !matches!(decision, Decision::Redeliver { .. }) {
                settled += 1;
            }
        }
    }
    client.flush().await?;

    let meals = kitchen.meals.load(Ordering::SeqCst);
    println!();
    println!("meals cooked: {meals} (4 orders, 7 messages)");
    js.delete_stream(&stream_name).await?;
    if meals != 4 {
        return Err("an order was cooked more than once, or not at all".into());
    }
    Ok(())
}
