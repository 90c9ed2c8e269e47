//! The scenarios every broker integration must pass, written once against [`Broker`] and
//! run by `tests/rabbitmq.rs` and `tests/nats.rs` with their fixtures (`broker_suite!`):
//! duplicates filtered with exact counts, a failing (and a panicking) handler redelivered
//! then dead-lettered after exactly its deliveries, a consumer process killed mid-handler,
//! and a store outage during consumption. Effects are counted in the PostgreSQL business
//! table of the seed load test.

#![allow(
    dead_code,
    unreachable_pub,
    async_fn_in_trait,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::broker::{Delivery, Redelivery, Summary};
use idempotency::SharedStore;

use crate::brokers::{self, wait_for, AppError, ChildConsumer, Kitchen, OrderMessage};
use crate::business::{Business, Effect, Tally};
use crate::redis_server::RedisServer;

/// What a scenario needs of a broker's queue or stream.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    /// The broker counts redeliveries (a quorum queue on RabbitMQ; always on JetStream).
    pub counted: bool,
    /// How long the broker waits for an ack before redelivering (JetStream's `ack_wait`;
    /// RabbitMQ redelivers when the consumer's channel closes, and ignores it).
    pub ack_wait: Duration,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            counted: false,
            ack_wait: Duration::from_secs(30),
        }
    }
}

/// A consume loop running in a task until [`Running::stop`].
pub struct Running<E> {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<Summary, E>>,
}

impl<E: std::fmt::Debug> Running<E> {
    /// Spawns `consume(stop)`.
    pub fn spawn<C, Fut>(consume: C) -> Running<E>
    where
        C: FnOnce(Stopped) -> Fut,
        Fut: Future<Output = Result<Summary, E>> + Send + 'static,
        E: Send + 'static,
    {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(consume(Stopped(stopped)));
        Running { stop, task }
    }

    /// Stops taking messages, waits for those in flight, and returns the summary.
    pub async fn stop(self) -> Summary {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap()
    }

    /// Runs until the loop ends by itself (or the process is killed).
    pub async fn until_killed(self) {
        let _keep = self.stop;
        let _ = self.task.await;
    }
}

/// The `stop` future of a [`Running`] loop.
pub struct Stopped(tokio::sync::oneshot::Receiver<()>);

impl Stopped {
    pub async fn wait(self) {
        let _ = self.0.await;
    }
}

/// A broker's queue or stream, a business schema and a tenant of one test; removed on drop.
pub trait Broker: Sized + Send + Sync + 'static {
    /// A message of this broker, as the consume loop hands it to handlers.
    type Message: Delivery;
    /// The consume loop's error.
    type Error: std::fmt::Debug + Send + 'static;

    async fn new(orders: u32, setup: Setup) -> Self;
    fn tenant(&self) -> &str;
    fn orders(&self) -> &Business;
    async fn publish(&self, messages: &[OrderMessage]);
    /// Runs the broker's `consume` over this fixture's queue or stream in a task.
    async fn consume<F, Fut>(
        &self,
        concurrency: usize,
        redelivery: Redelivery,
        handler: F,
    ) -> Running<Self::Error>
    where
        F: Fn(Self::Message) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Effect, AppError>> + Send + 'static;
    /// Waits until every acknowledgement reached the broker and nothing is left to deliver.
    async fn drained(&self);
    /// How many messages were dead-lettered (RabbitMQ's dead-letter queue, JetStream's
    /// `MSG_TERMINATED` advisories).
    async fn dead_letters(&self) -> usize;
    /// The environment of the `child_consumer` process consuming this fixture.
    fn child_env(&self) -> Vec<(&'static str, String)>;
    /// The broker's own view of the queue or stream (counts of pending, unacknowledged and
    /// redelivered messages), printed when a scenario times out.
    async fn describe(&self) -> String {
        String::new()
    }

    async fn settled(&self) -> i64 {
        self.orders().progress().await.unwrap().0
    }

    async fn tally(&self) -> Tally {
        self.orders().tally().await.unwrap()
    }

    /// Waits until `messages` messages have a final outcome; on timeout, panics with what
    /// the business table, `kitchen` and the broker saw, so a stall can be told apart from a
    /// lost message.
    async fn wait_settled(&self, messages: i64, within: Duration, kitchen: &Kitchen) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let settled = self.settled().await;
            if settled == messages {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "timed out after {within:?} waiting for {messages} messages with a final \
                     outcome: {settled} have one\n  business: {:?}\n  handlers: {}\n  broker: {}",
                    self.tally().await,
                    kitchen.seen.describe(),
                    self.describe().await,
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn kitchen(&self, store: SharedStore, work: Duration) -> Arc<Kitchen> {
        Arc::new(Kitchen {
            orders: self.orders().clone(),
            store,
            work,
            seen: brokers::Seen::default(),
        })
    }

    /// Runs `kitchen`'s handler on every message.
    async fn consume_orders(
        &self,
        concurrency: usize,
        redelivery: Redelivery,
        kitchen: Arc<Kitchen>,
    ) -> Running<Self::Error> {
        self.consume(concurrency, redelivery, move |message: Self::Message| {
            let kitchen = kitchen.clone();
            async move {
                let redelivered = message.deliveries() != Some(1);
                kitchen.handle(message.payload(), redelivered).await
            }
        })
        .await
    }
}

/// The redelivery policy of the scenarios: quick retries.
pub fn redelivery() -> Redelivery {
    Redelivery::new()
        .retry_delay(Duration::from_millis(100))
        .in_progress_delay(Duration::from_millis(50))
}

/// The handler of a `child_consumer` process: records its execution, then works for a
/// minute, so it is always killed mid-handler.
pub async fn child_kitchen(schema: &str) -> Arc<Kitchen> {
    Arc::new(Kitchen {
        orders: Business::connect(&brokers::business_url(), schema, 2)
            .await
            .unwrap(),
        store: brokers::store(&brokers::redis_url()).await,
        work: Duration::from_secs(60),
        seen: brokers::Seen::default(),
    })
}

/// 30 orders × 3 identical messages, 10 handlers at once: exactly 30 effects and 30
/// executions, 60 messages acknowledged as duplicates, nothing left to deliver.
pub async fn duplicates_are_filtered_with_exact_counts<B: Broker>() {
    let fx = B::new(30, Setup::default()).await;
    fx.publish(&brokers::messages(fx.tenant(), 30, 3)).await;
    let kitchen = fx.kitchen(
        brokers::store(&brokers::redis_url()).await,
        Duration::from_millis(20),
    );

    let running = fx.consume_orders(10, redelivery(), kitchen.clone()).await;
    fx.wait_settled(90, Duration::from_secs(60), &kitchen).await;
    let summary = running.stop().await;

    let tally = fx.tally().await;
    assert_eq!(tally.effects, 30, "{tally:?}");
    assert_eq!(tally.filtered, 60, "{tally:?}");
    assert_eq!(tally.executions, 30, "{tally:?}");
    assert_eq!(
        (tally.wrong, tally.lost, tally.doubled, tally.absorbed),
        (0, 0, 0, 0)
    );
    assert_eq!(summary.acked, 90, "{summary:?}");
    assert_eq!(
        summary.redelivered,
        kitchen.seen.in_progress.load(Ordering::SeqCst),
        "every redelivery is a duplicate met while its first copy ran: {summary:?}"
    );
    assert_eq!((summary.dead_lettered, summary.unsettled), (0, 0));
    assert_eq!(kitchen.seen.acked_before_effect.load(Ordering::SeqCst), 0);
    fx.drained().await;
}

/// On a broker that counts deliveries: a handler that always fails runs on deliveries 1, 2
/// and 3 (as the broker counts them) and is then dead-lettered, exactly once; one that
/// panics on its first delivery is treated as failed, redelivered and applied once.
pub async fn failing_handler_is_redelivered_then_dead_lettered<B: Broker>() {
    let counted = Setup {
        counted: true,
        ..Setup::default()
    };
    let fx = B::new(2, counted).await;
    fx.publish(&[
        OrderMessage::new(fx.tenant(), 1, 1),
        OrderMessage::new(fx.tenant(), 2, 1),
    ])
    .await;
    let kitchen = fx.kitchen(
        brokers::store(&brokers::redis_url()).await,
        Duration::from_millis(1),
    );
    // order-0001 always fails; order-0002 panics on its first delivery.
    let attempts: Arc<Mutex<HashMap<String, Vec<Option<u32>>>>> = Arc::default();

    let redelivery = Redelivery::new()
        .max_deliveries(3)
        .retry_delay(Duration::from_millis(50));
    let (k, a) = (kitchen.clone(), attempts.clone());
    let running = fx
        .consume(2, redelivery, move |message: B::Message| {
            let (kitchen, attempts) = (k.clone(), a.clone());
            async move {
                let msg: OrderMessage = serde_json::from_slice(message.payload())?;
                let first = {
                    let mut attempts = attempts.lock().unwrap();
                    let seen = attempts.entry(msg.order_id.clone()).or_default();
                    seen.push(message.deliveries());
                    seen.len() == 1
                };
                if msg.order_id == "order-0001" {
                    return Err(AppError::KitchenDown);
                }
                assert!(!first, "the kitchen exploded (a panicking handler)");
                let result =
                    brokers::on_order(&msg, &kitchen.orders, &kitchen.store, kitchen.work).await;
                kitchen.record(&msg, &result).await?;
                result
            }
        })
        .await;
    wait_for(
        "the poison message dead-lettered and order-0002 applied",
        Duration::from_secs(30),
        || async { fx.dead_letters().await == 1 && fx.settled().await == 1 },
    )
    .await;
    let summary = running.stop().await;
    fx.drained().await;

    let attempts = attempts.lock().unwrap().clone();
    assert_eq!(
        attempts.get("order-0001"),
        Some(&vec![Some(1), Some(2), Some(3)]),
        "{attempts:?}"
    );
    assert_eq!(
        attempts.get("order-0002"),
        Some(&vec![Some(1), Some(2)]),
        "{attempts:?}"
    );
    assert_eq!(summary.acked, 1, "{summary:?}");
    assert_eq!(summary.redelivered, 3, "{summary:?}");
    assert_eq!(summary.dead_lettered, 1, "{summary:?}");
    let tally = fx.tally().await;
    assert_eq!((tally.effects, tally.executions), (1, 1), "{tally:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        fx.dead_letters().await,
        1,
        "exactly one message is dead-lettered"
    );
}

/// A real kill: a consumer process (the test binary re-run as `child_consumer`) is
/// SIGKILLed while its handler runs. The broker redelivers its unacknowledged message (on
/// the channel's close, or after a 2 s `ack_wait`); the dead owner's claim blocks the key
/// until its 2 s lease runs out, then the order is applied exactly once, and the
/// redelivered message is acknowledged as a duplicate.
pub async fn consumer_killed_mid_handler_is_redelivered_and_processed_once<B: Broker>() {
    let quick = Setup {
        ack_wait: Duration::from_secs(2),
        ..Setup::default()
    };
    let fx = B::new(3, quick).await;
    fx.publish(&brokers::messages(fx.tenant(), 3, 2)).await;

    let mut child = ChildConsumer::spawn("child_consumer", &fx.child_env());
    let victims = child.kill_mid_handler(fx.orders()).await;

    let kitchen = fx.kitchen(
        brokers::store(&brokers::redis_url()).await,
        Duration::from_millis(10),
    );
    let running = fx.consume_orders(4, redelivery(), kitchen.clone()).await;
    fx.wait_settled(6, Duration::from_secs(60), &kitchen).await;
    let summary = running.stop().await;

    let tally = fx.tally().await;
    assert_eq!(tally.effects, 3, "{tally:?}");
    assert_eq!(tally.executions, 4, "3 runs and the killed one: {tally:?}");
    assert_eq!(tally.interrupted, 1, "{tally:?}");
    assert_eq!(tally.filtered, 3, "{tally:?}");
    assert_eq!((tally.wrong, tally.lost, tally.doubled), (0, 0, 0));
    assert!(
        kitchen
            .seen
            .redelivered
            .lock()
            .unwrap()
            .contains(&victims[0]),
        "the killed consumer's message {victims:?} is redelivered"
    );
    assert_eq!(summary.acked, 6, "{summary:?}");
    assert_eq!(kitchen.seen.acked_before_effect.load(Ordering::SeqCst), 0);
    fx.drained().await;
}

/// The store (a Redis this test starts) is killed while 40 orders × 2 messages are being
/// consumed, then restarted empty: claims fail closed meanwhile (nothing runs, messages are
/// redelivered), and afterwards the `done` check stands in for the lost records. Every
/// order is applied exactly once, no message is acknowledged before its effect.
pub async fn store_outage_during_consumption_loses_nothing<B: Broker>() {
    let fx = B::new(40, Setup::default()).await;
    fx.publish(&brokers::messages(fx.tenant(), 40, 2)).await;
    let server = RedisServer::start(&[]);
    let kitchen = fx.kitchen(
        brokers::store(&server.url()).await,
        Duration::from_millis(50),
    );

    let running = fx.consume_orders(8, redelivery(), kitchen.clone()).await;
    wait_for("10 effects", Duration::from_secs(30), || async {
        fx.orders().progress().await.unwrap().1 >= 10
    })
    .await;
    let mut server = tokio::task::spawn_blocking(move || {
        let mut server = server;
        server.kill();
        server
    })
    .await
    .unwrap();
    wait_for(
        "claims failing on the dead store",
        Duration::from_secs(30),
        || async { kitchen.seen.store_errors.load(Ordering::SeqCst) >= 5 },
    )
    .await;
    let effects_during_outage = fx.orders().progress().await.unwrap().1;
    server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    fx.wait_settled(80, Duration::from_secs(60), &kitchen).await;
    let summary = running.stop().await;
    drop(server);

    let tally = fx.tally().await;
    assert_eq!(tally.effects, 40, "{tally:?}");
    assert_eq!(
        (tally.wrong, tally.lost, tally.doubled),
        (0, 0, 0),
        "{tally:?}"
    );
    assert_eq!(tally.filtered + tally.absorbed, 40, "{tally:?}");
    assert!(tally.executions >= 40, "{tally:?}");
    assert!(
        effects_during_outage < 40,
        "the outage came too late to matter"
    );
    assert_eq!(kitchen.seen.acked_before_effect.load(Ordering::SeqCst), 0);
    assert_eq!(summary.acked, 80, "{summary:?}");
    assert!(
        summary.redelivered >= kitchen.seen.store_errors.load(Ordering::SeqCst),
        "every store error is redelivered: {summary:?}"
    );
    assert_eq!((summary.dead_lettered, summary.unsettled), (0, 0));
    fx.drained().await;
}

/// The suite's tests for the fixture type `$broker`, at the top level of the including file
/// (the kill scenario re-runs its `child_consumer` test by name).
#[macro_export]
macro_rules! broker_suite {
    ($broker:ty) => {
        $crate::broker_suite!($broker;
            duplicates_are_filtered_with_exact_counts: 4,
            failing_handler_is_redelivered_then_dead_lettered: 2,
            consumer_killed_mid_handler_is_redelivered_and_processed_once: 4,
            store_outage_during_consumption_loses_nothing: 4,
        );
    };
    ($broker:ty; $($case:ident: $threads:literal),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = $threads)]
            async fn $case() {
                broker_suite::$case::<$broker>().await;
            }
        )*
    };
}
