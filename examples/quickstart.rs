//! Quickstart: one attribute makes a message consumer and a request handler safe against
//! duplicates.
//!
//! What it shows, on the embedded in-memory store (no server needed), or on any backend named
//! by `IDEMPOTENT_STORE_URL` (`redis://127.0.0.1:6379`, ...) with no change to the handlers:
//! 1. a first delivery that runs the handler;
//! 2. a duplicate delivery (same order and activity, new message id) that is filtered;
//! 3. a request handler whose duplicate gets the first run's result replayed;
//! 4. a failure that gives the claim back, and the redelivery that then succeeds.
//!
//! Run it with:
//!
//! ```text
//! cargo run --example quickstart
//! IDEMPOTENT_STORE_URL=redis://127.0.0.1:6379 cargo run --example quickstart
//! ```

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use idempotency::{idempotent, Action};
use serde::{Deserialize, Serialize};

/// A message from the order service: "cook this free-meal order for this activity".
#[derive(Debug, Clone)]
struct OrderMessage {
    message_id: &'static str,
    order_id: String,
    activity_id: &'static str,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotency::Error),
    #[error("the kitchen service timed out")]
    KitchenTimeout,
}

/// The business side effect we must apply exactly once per order and activity.
#[derive(Default)]
struct Kitchen {
    meals_cooked: AtomicU32,
    fail_next: AtomicBool,
}

impl Kitchen {
    async fn cook(&self, order_id: &str) -> Result<u32, AppError> {
        if self.fail_next.swap(false, Ordering::SeqCst) {
            return Err(AppError::KitchenTimeout);
        }
        let n = self.meals_cooked.fetch_add(1, Ordering::SeqCst) + 1;
        println!("      kitchen: cooking order {order_id} (meal #{n})");
        Ok(n)
    }
}

/// The consumer. The key is the business unit (order + activity), not the message id: a
/// producer retry carries a new message id but is the same business action.
#[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.activity_id], ttl = 3600)]
async fn on_order(msg: &OrderMessage, kitchen: &Kitchen) -> Result<(), AppError> {
    kitchen.cook(&msg.order_id).await?;
    Ok(())
}

#[derive(Debug, Serialize, Deserialize)]
struct Coupon {
    code: String,
}

/// A request handler: a duplicate (a double click, a client retry) gets the same coupon back.
#[idempotent(prefix = "coupon:grant", keys = [user_id, campaign], ttl = 86400, replay)]
async fn grant_coupon(
    user_id: u64,
    campaign: &str,
    issued: &AtomicU32,
) -> Result<Coupon, AppError> {
    let n = issued.fetch_add(1, Ordering::SeqCst) + 1;
    Ok(Coupon {
        code: format!("{campaign}-{user_id}-{n:04}"),
    })
}

/// What a consumer would do with the message, from the handler's outcome.
fn settle(outcome: &Result<(), AppError>) -> String {
    match outcome {
        Ok(()) => "handler ran -> ack".to_string(),
        Err(AppError::Idempotency(e)) => format!("{e} -> {}", action(e.action())),
        Err(e) => format!("handler failed ({e}); claim released -> nack, redeliver"),
    }
}

fn action(action: Action) -> &'static str {
    match action {
        Action::Ack => "ack",
        Action::Redeliver => "nack, redeliver",
        Action::DeadLetter => "dead-letter",
        _ => "see the docs",
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Set once at start-up: handlers use it unless their attribute names a store.
    let url = std::env::var("IDEMPOTENT_STORE_URL").unwrap_or_else(|_| "memory:".into());
    idempotency::set_default_store(idempotency::connect(&url).await?)?;
    println!("store: {url}");
    // A tag per run, so a run against a persistent store does not meet the last run's records.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis()
        % 1_000_000;
    let kitchen = Kitchen::default();

    println!("1. first delivery");
    let first = OrderMessage {
        message_id: "msg-1",
        order_id: format!("A-1001-{run}"),
        activity_id: "free-meal-2026",
    };
    println!(
        "   {} -> {}",
        first.message_id,
        settle(&on_order(&first, &kitchen).await)
    );

    println!("2. duplicate delivery (producer retry, new message id)");
    let retry = OrderMessage {
        message_id: "msg-2",
        ..first.clone()
    };
    println!(
        "   {} -> {}",
        retry.message_id,
        settle(&on_order(&retry, &kitchen).await)
    );

    println!("3. replayed result");
    let issued = AtomicU32::new(0);
    let campaign = format!("spring-{run}");
    let coupon = grant_coupon(7, &campaign, &issued).await?;
    println!("   first request:   coupon {}", coupon.code);
    let again = grant_coupon(7, &campaign, &issued).await?;
    println!(
        "   double click:    coupon {} (replayed, not issued again)",
        again.code
    );

    println!("4. failure releases the claim; the redelivery succeeds");
    let order = OrderMessage {
        message_id: "msg-3",
        order_id: format!("A-1002-{run}"),
        activity_id: "free-meal-2026",
    };
    kitchen.fail_next.store(true, Ordering::SeqCst);
    println!(
        "   {} -> {}",
        order.message_id,
        settle(&on_order(&order, &kitchen).await)
    );
    println!(
        "   {} (redelivered) -> {}",
        order.message_id,
        settle(&on_order(&order, &kitchen).await)
    );

    let meals = kitchen.meals_cooked.load(Ordering::SeqCst);
    let coupons = issued.load(Ordering::SeqCst);
    println!();
    println!("meals cooked: {meals} (2 orders), coupons issued: {coupons} (1 request)");
    if meals != 2 || coupons != 1 {
        return Err("an effect was applied more than once".into());
    }
    Ok(())
}
