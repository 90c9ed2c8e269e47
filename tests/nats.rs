//! Consumers on a real NATS JetStream server (`NATS_URL`, default `127.0.0.1:4222`) with
//! exact counts: duplicates filtered, a batch claimed with `Guard::run_batch` and settled
//! message by message, a failing handler naked then terminated, a consumer process killed
//! mid-handler, and a store outage during consumption. Effects are counted in a PostgreSQL
//! business table (`IDEMPOTENT_BUSINESS_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`); the store is the Redis at
//! `IDEMPOTENT_REDIS_URL` (default `redis://127.0.0.1:6379`) or one the test starts.
//!
//! Every test creates its own stream and PostgreSQL schema (unique names) and removes them.
//! A missing server fails the test with the command that starts it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/brokers.rs"]
mod brokers;
#[allow(dead_code, unreachable_pub)]
#[path = "../examples/seed_load_test/business.rs"]
mod business;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, stream, Message};
use brokers::{unique, wait_for, AppError, ChildConsumer, Kitchen, OrderMessage};
use business::{Business, Effect, Tally};
use futures_util::StreamExt;
use idempotency::broker::{nats, Decision, Policy, Summary};
use idempotency::{Guard, Key, SharedStore};
use redis_server::RedisServer;

/// A stream, a pull consumer, a business schema and a tenant of one test; removed on drop,
/// also when the test fails.
struct Fixture {
    client: async_nats::Client,
    js: jetstream::Context,
    stream: String,
    subject: String,
    consumer: PullConsumer,
    tenant: String,
    schema: String,
    orders: Business,
}

impl Fixture {
    /// A stream and a durable pull consumer `worker` with explicit acks and `ack_wait`.
    async fn new(orders: u32, ack_wait: Duration) -> Fixture {
        let tenant = unique("nats");
        let client = brokers::nats().await;
        let js = jetstream::new(client.clone());
        let stream_name = format!("IDEMPOTENT_TEST_{tenant}");
        let subject = format!("idempotent.test.{tenant}");
        let created = js
            .create_stream(stream::Config {
                name: stream_name.clone(),
                subjects: vec![subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| {
                panic!("cannot create a stream (is JetStream enabled, `-js`?): {e}")
            });
        let consumer = created
            .create_consumer(pull::Config {
                durable_name: Some("worker".into()),
                ack_policy: AckPolicy::Explicit,
                ack_wait,
                ..Default::default()
            })
            .await
            .unwrap();
        let schema = format!("idempotent_{tenant}");
        let orders = brokers::business(&schema, orders).await;
        Fixture {
            client,
            js,
            stream: stream_name,
            subject,
            consumer,
            tenant,
            schema,
            orders,
        }
    }

    async fn publish(&self, messages: &[OrderMessage]) {
        for msg in messages {
            self.js
                .publish(self.subject.clone(), msg.to_bytes().into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }

    async fn settled(&self) -> i64 {
        self.orders.progress().await.unwrap().0
    }

    async fn tally(&self) -> Tally {
        self.orders.tally().await.unwrap()
    }

    /// Waits until the consumer has nothing pending and nothing unacknowledged.
    async fn drained(&self) {
        let consumer = self.consumer.clone();
        wait_for(
            "the consumer to be drained",
            Duration::from_secs(10),
            || {
                let mut consumer = consumer.clone();
                async move {
                    let info = consumer.info().await.unwrap();
                    info.num_pending == 0 && info.num_ack_pending == 0
                }
            },
        )
        .await;
    }

    fn kitchen(&self, store: SharedStore, work: Duration) -> Arc<Kitchen> {
        Arc::new(Kitchen {
            orders: self.orders.clone(),
            store,
            work,
            seen: brokers::Seen::default(),
        })
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let (stream, schema, tenant) = (
            self.stream.clone(),
            self.schema.clone(),
            self.tenant.clone(),
        );
        brokers::cleanup_in_thread(move || async move {
            brokers::delete_tenant_keys(&tenant);
            if let Ok(client) = async_nats::connect(brokers::nats_url()).await {
                let _ = jetstream::new(client).delete_stream(&stream).await;
            }
            let _ = Business::drop_schema(&brokers::business_url(), &schema).await;
        });
    }
}

/// Runs `nats::consume` with `kitchen`'s handler in a task, until the returned sender fires.
fn consume(
    consumer: PullConsumer,
    concurrency: usize,
    policy: Policy,
    kitchen: Arc<Kitchen>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<Summary, nats::Error>>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let stop = async {
            let _ = stopped.await;
        };
        nats::consume(
            &consumer,
            concurrency,
            policy,
            stop,
            move |message: Message| {
                let kitchen = kitchen.clone();
                async move {
                    let redelivered = nats::deliveries(&message).is_some_and(|n| n > 1);
                    kitchen.handle(&message.payload, redelivered).await
                }
            },
        )
        .await
    });
    (stop, task)
}

fn policy() -> Policy {
    Policy::new()
        .retry_delay(Duration::from_millis(100))
        .in_progress_delay(Duration::from_millis(50))
}

/// 30 orders × 3 identical messages, 10 handlers at once: exactly 30 effects and 30
/// executions, 60 messages acknowledged as duplicates, nothing pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_are_filtered_with_exact_counts() {
    let fx = Fixture::new(30, Duration::from_secs(30)).await;
    fx.publish(&brokers::messages(&fx.tenant, 30, 3)).await;
    let kitchen = fx.kitchen(
        brokers::store(&brokers::redis_url()).await,
        Duration::from_millis(20),
    );

    let (stop, task) = consume(fx.consumer.clone(), 10, policy(), kitchen.clone());
    wait_for(
        "90 messages with a final outcome",
        Duration::from_secs(60),
        || async { fx.settled().await == 90 },
    )
    .await;
    let _ = stop.send(());
    let summary = task.await.unwrap().unwrap();
    fx.client.flush().await.unwrap();

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
        "every nak is a duplicate met while its first copy ran: {summary:?}"
    );
    assert_eq!((summary.dead_lettered, summary.unsettled), (0, 0));
    assert_eq!(kitchen.seen.acked_before_effect.load(Ordering::SeqCst), 0);
    fx.drained().await;
}

/// Batches of up to 10 fetched messages, every key of a batch claimed with one
/// `Guard::run_batch` (one pipeline on Redis), each message settled with its own result:
/// 20 orders × 3 copies give exactly 20 effects, 20 executions and 40 duplicates; a copy
/// that met its twin in the same batch is naked and acknowledged on redelivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_are_claimed_in_one_round_trip_and_settled_per_message() {
    let fx = Fixture::new(20, Duration::from_secs(30)).await;
    fx.publish(&brokers::messages(&fx.tenant, 20, 3)).await;
    let kitchen = fx.kitchen(
        brokers::store(&brokers::redis_url()).await,
        Duration::from_millis(10),
    );
    let guard = Guard::new(Duration::from_secs(600))
        .lease(Duration::from_secs(2))
        .store(kitchen.store.clone());
    let policy = policy();

    let mut decisions: HashMap<Decision, u32> = HashMap::new();
    let mut batches = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while fx.settled().await < 60 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out: {decisions:?}"
        );
        let batch: Vec<Message> = fx
            .consumer
            .batch()
            .max_messages(10)
            .expires(Duration::from_millis(300))
            .messages()
            .await
            .unwrap()
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap();
        if batch.is_empty() {
            continue;
        }
        batches += 1;
        let msgs: Vec<OrderMessage> = batch
            .iter()
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
            .collect();
        let items: Vec<(Key, &OrderMessage)> = msgs
            .iter()
            .map(|msg| {
                let key = Key::new(
                    "test:order:consume",
                    1,
                    &[&msg.tenant, &msg.order_id, &msg.activity_id],
                )
                .unwrap();
                (key, msg)
            })
            .collect();
        let results: Vec<Result<Effect, AppError>> = guard
            .run_batch(items, |msg| async {
                Ok(kitchen
                    .orders
                    .consume(&msg.order_id, &msg.message_id, kitchen.work)
                    .await?)
            })
            .await;
        assert_eq!(
            results.len(),
            batch.len(),
            "one result per message, in order"
        );
        for ((message, msg), result) in batch.iter().zip(&msgs).zip(&results) {
            kitchen.record(msg, result).await.unwrap();
            let decision = nats::settle(message, result, &policy).await.unwrap();
            *decisions.entry(decision).or_default() += 1;
        }
    }
    fx.client.flush().await.unwrap();

    let tally = fx.tally().await;
    assert_eq!(tally.effects, 20, "{tally:?}");
    assert_eq!(tally.executions, 20, "{tally:?}");
    assert_eq!(tally.filtered, 40, "{tally:?}");
    assert_eq!(
        (tally.wrong, tally.lost, tally.doubled, tally.absorbed),
        (0, 0, 0, 0)
    );
    let in_progress = kitchen.seen.in_progress.load(Ordering::SeqCst);
    assert!(in_progress > 0, "copies side by side meet in one batch");
    assert_eq!(decisions.get(&Decision::Ack), Some(&60), "{decisions:?}");
    assert_eq!(
        decisions.get(&Decision::Redeliver {
            delay: Duration::from_millis(50)
        }),
        Some(&u32::try_from(in_progress).unwrap()),
        "{decisions:?}"
    );
    assert_eq!(decisions.len(), 2, "{decisions:?}");
    assert!(
        batches >= 6,
        "60 messages in batches of at most 10: {batches}"
    );
    assert_eq!(kitchen.seen.acked_before_effect.load(Ordering::SeqCst), 0);
    fx.drained().await;
}

/// A handler that always fails runs on deliveries 1, 2 and 3 (`delivered` from the message
/// metadata), is naked in between and then terminated, with exactly one
/// `MSG_TERMINATED` advisory; one that fails once is redelivered and applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_handler_is_naked_then_terminated() {
    let fx = Fixture::new(2, Duration::from_secs(30)).await;
    let mut advisories = fx
        .client
        .subscribe(format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{}.worker",
            fx.stream
        ))
        .await
        .unwrap();
    fx.client.flush().await.unwrap();
    fx.publish(&[
        OrderMessage::new(&fx.tenant, 1, 1),
        OrderMessage::new(&fx.tenant, 2, 1),
    ])
    .await;
    let kitchen = fx.kitchen(
        brokers::store(&brokers::redis_url()).await,
        Duration::from_millis(1),
    );
    let attempts: Arc<Mutex<HashMap<String, Vec<u32>>>> = Arc::default();

    let policy = Policy::new()
        .max_deliveries(3)
        .retry_delay(Duration::from_millis(50));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (k, a, consumer) = (kitchen.clone(), attempts.clone(), fx.consumer.clone());
    let task = tokio::spawn(async move {
        let stop = async {
            let _ = stopped.await;
        };
        nats::consume(&consumer, 2, policy, stop, move |message: Message| {
            let (kitchen, attempts) = (k.clone(), a.clone());
            async move {
                let msg: OrderMessage = serde_json::from_slice(&message.payload)?;
                let delivered = nats::deliveries(&message).unwrap();
                let first = {
                    let mut attempts = attempts.lock().unwrap();
                    let seen = attempts.entry(msg.order_id.clone()).or_default();
                    seen.push(delivered);
                    seen.len() == 1
                };
                if msg.order_id == "order-0001" || first {
                    return Err(AppError::KitchenDown);
                }
                let result =
                    brokers::on_order(&msg, &kitchen.orders, &kitchen.store, kitchen.work).await;
                kitchen.record(&msg, &result).await?;
                result
            }
        })
        .await
    });
    let advisory = tokio::time::timeout(Duration::from_secs(30), advisories.next())
        .await
        .expect("no MSG_TERMINATED advisory within 30 s")
        .unwrap();
    assert!(
        String::from_utf8_lossy(&advisory.payload).contains("\"stream_seq\":1"),
        "the first message is the one terminated: {:?}",
        advisory.payload
    );
    wait_for("order-0002 applied", Duration::from_secs(30), || async {
        fx.settled().await == 1
    })
    .await;
    let _ = stop.send(());
    let summary = task.await.unwrap().unwrap();
    fx.client.flush().await.unwrap();
    fx.drained().await;

    let attempts = attempts.lock().unwrap().clone();
    assert_eq!(
        attempts.get("order-0001"),
        Some(&vec![1, 2, 3]),
        "{attempts:?}"
    );
    assert_eq!(
        attempts.get("order-0002"),
        Some(&vec![1, 2]),
        "{attempts:?}"
    );
    assert_eq!(summary.acked, 1, "{summary:?}");
    assert_eq!(summary.redelivered, 3, "{summary:?}");
    assert_eq!(summary.dead_lettered, 1, "{summary:?}");
    let tally = fx.tally().await;
    assert_eq!((tally.effects, tally.executions), (1, 1), "{tally:?}");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), advisories.next())
            .await
            .is_err(),
        "exactly one message is terminated"
    );
}

/// The consumer of [`consumer_killed_mid_handler_is_redelivered_and_processed_once`]: a
/// child process (this test binary re-run) whose handler records its execution and then
/// works for a minute, so it is always killed mid-handler. Does nothing when run without the
/// parent's environment.
#[test]
#[ignore = "a child process of consumer_killed_mid_handler_is_redelivered_and_processed_once"]
fn child_consumer() {
    let (Ok(stream), Ok(schema)) = (std::env::var("CHILD_STREAM"), std::env::var("CHILD_SCHEMA"))
    else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let js = jetstream::new(brokers::nats().await);
        let consumer: PullConsumer = js
            .get_stream(&stream)
            .await
            .unwrap()
            .get_consumer("worker")
            .await
            .unwrap();
        let kitchen = Arc::new(Kitchen {
            orders: Business::connect(&brokers::business_url(), &schema, 2)
                .await
                .unwrap(),
            store: brokers::store(&brokers::redis_url()).await,
            work: Duration::from_secs(60),
            seen: brokers::Seen::default(),
        });
        let (_stop, task) = consume(consumer, 1, policy(), kitchen);
        let _ = task.await;
    });
}

/// A real kill: a consumer process (the test binary re-run as [`child_consumer`]) is
/// SIGKILLed while its handler runs. JetStream redelivers the unacknowledged message after
/// `ack_wait` (2 s); the dead owner's claim blocks the key until its 2 s lease runs out, then
/// the order is applied exactly once, and the redelivered message is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumer_killed_mid_handler_is_redelivered_and_processed_once() {
    let fx = Fixture::new(3, Duration::from_secs(2)).await;
    fx.publish(&brokers::messages(&fx.tenant, 3, 2)).await;

    let mut child = ChildConsumer::spawn(
        "child_consumer",
        &[
            ("CHILD_STREAM", fx.stream.clone()),
            ("CHILD_SCHEMA", fx.schema.clone()),
        ],
    );
    let victims = child.kill_mid_handler(&fx.orders).await;

    let kitchen = fx.kitchen(
        brokers::store(&brokers::redis_url()).await,
        Duration::from_millis(10),
    );
    let (stop, task) = consume(fx.consumer.clone(), 4, policy(), kitchen.clone());
    wait_for(
        "6 messages with a final outcome",
        Duration::from_secs(30),
        || async { fx.settled().await == 6 },
    )
    .await;
    let _ = stop.send(());
    let summary = task.await.unwrap().unwrap();
    fx.client.flush().await.unwrap();

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
/// naked), and afterwards the `done` check stands in for the lost records. Every order is
/// applied exactly once, no message is acknowledged before its effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn store_outage_during_consumption_loses_nothing() {
    let fx = Fixture::new(40, Duration::from_secs(30)).await;
    fx.publish(&brokers::messages(&fx.tenant, 40, 2)).await;
    let server = RedisServer::start(&[]);
    let kitchen = fx.kitchen(
        brokers::store(&server.url()).await,
        Duration::from_millis(50),
    );

    let (stop, task) = consume(fx.consumer.clone(), 8, policy(), kitchen.clone());
    wait_for("10 effects", Duration::from_secs(30), || async {
        fx.orders.progress().await.unwrap().1 >= 10
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
    let effects_during_outage = fx.orders.progress().await.unwrap().1;
    server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    wait_for(
        "80 messages with a final outcome",
        Duration::from_secs(60),
        || async { fx.settled().await == 80 },
    )
    .await;
    let _ = stop.send(());
    let summary = task.await.unwrap().unwrap();
    fx.client.flush().await.unwrap();
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
        "every store error is naked: {summary:?}"
    );
    assert_eq!((summary.dead_lettered, summary.unsettled), (0, 0));
    fx.drained().await;
}
