//! Consumers on a real NATS JetStream server (`NATS_URL`, default `127.0.0.1:4222`) with
//! exact counts: the broker suite (`tests/broker_suite`: duplicates filtered, a failing
//! handler naked then terminated, a consumer process killed mid-handler, a store outage
//! during consumption), and a batch claimed with `Idempotency::run_batch` and settled message by
//! message. Effects are counted in a PostgreSQL
//! business table (`IDEMPOTENT_BUSINESS_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`); the store is the Redis at
//! `IDEMPOTENT_REDIS_URL` (default `redis://127.0.0.1:6379`) or one the test starts.
//!
//! Every test creates its own stream and PostgreSQL schema (unique names) and removes them.
//! A missing server fails the test with the command that starts it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod broker_suite;
#[path = "support/brokers.rs"]
mod brokers;
#[allow(dead_code, unreachable_pub)]
#[path = "../examples/seed_load_test/business.rs"]
mod business;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, stream, Message};
use broker_suite::{Broker, Running, Setup};
use brokers::{unique, wait_for, AppError, OrderMessage};
use business::{Business, Effect};
use futures_util::StreamExt;
use idempotency::broker::{nats, Decision, Delivery, Redelivery};
use idempotency::{Idempotency, Key};

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
    /// The stream sequences of the `MSG_TERMINATED` advisories of `worker`.
    terminated: Arc<Mutex<Vec<String>>>,
}

impl Fixture {
    /// A stream and a durable pull consumer `worker` with explicit acks and `ack_wait`.
    async fn create(orders: u32, ack_wait: Duration) -> Fixture {
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
        let mut advisories = client
            .subscribe(format!(
                "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{stream_name}.worker"
            ))
            .await
            .unwrap();
        client.flush().await.unwrap();
        let terminated: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = terminated.clone();
        tokio::spawn(async move {
            while let Some(advisory) = advisories.next().await {
                let advisory: serde_json::Value =
                    serde_json::from_slice(&advisory.payload).unwrap();
                seen.lock()
                    .unwrap()
                    .push(advisory["stream_seq"].to_string());
            }
        });
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
            terminated,
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
}

impl Broker for Fixture {
    type Message = Message;
    type Error = nats::Error;

    /// JetStream counts every delivery: `setup.counted` is always true.
    async fn new(orders: u32, setup: Setup) -> Fixture {
        Fixture::create(orders, setup.ack_wait).await
    }

    fn tenant(&self) -> &str {
        &self.tenant
    }

    fn orders(&self) -> &Business {
        &self.orders
    }

    async fn publish(&self, messages: &[OrderMessage]) {
        Fixture::publish(self, messages).await;
    }

    async fn consume<F, Fut>(
        &self,
        concurrency: usize,
        redelivery: Redelivery,
        handler: F,
    ) -> Running<nats::Error>
    where
        F: Fn(Message) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Effect, AppError>> + Send + 'static,
    {
        let consumer = self.consumer.clone();
        Running::spawn(move |stop| async move {
            nats::consume(&consumer, concurrency, redelivery, stop.wait(), handler).await
        })
    }

    async fn drained(&self) {
        self.client.flush().await.unwrap();
        Fixture::drained(self).await;
    }

    async fn dead_letters(&self) -> usize {
        self.terminated.lock().unwrap().len()
    }

    fn child_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("CHILD_STREAM", self.stream.clone()),
            ("CHILD_SCHEMA", self.schema.clone()),
        ]
    }

    async fn describe(&self) -> String {
        let mut consumer = self.consumer.clone();
        match consumer.info().await {
            Ok(info) => format!(
                "pending {}, ack_pending {}, redelivered {}, waiting pulls {}, \
                 delivered up to {}, acknowledged up to {}",
                info.num_pending,
                info.num_ack_pending,
                info.num_redelivered,
                info.num_waiting,
                info.delivered.stream_sequence,
                info.ack_floor.stream_sequence,
            ),
            Err(err) => format!("consumer info failed: {err}"),
        }
    }
}

broker_suite!(Fixture);

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

/// Batches of up to 10 fetched messages, every key of a batch claimed with one
/// `Idempotency::run_batch` (one pipeline on Redis), each message settled with its own result:
/// 20 orders × 3 copies give exactly 20 effects, 20 executions and 40 duplicates; a copy
/// that met its twin in the same batch is naked and acknowledged on redelivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_are_claimed_in_one_round_trip_and_settled_per_message() {
    let fx = Fixture::create(20, Duration::from_secs(30)).await;
    fx.publish(&brokers::messages(&fx.tenant, 20, 3)).await;
    let kitchen = fx.kitchen(
        brokers::store(&brokers::redis_url()).await,
        Duration::from_millis(10),
    );
    let guard = Idempotency::new(Duration::from_secs(600))
        .lease(Duration::from_secs(2))
        .store(kitchen.store.clone());
    let redelivery = broker_suite::redelivery();

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
            let decision = nats::settle(message, result, &redelivery).await.unwrap();
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
        let kitchen = broker_suite::child_kitchen(&schema).await;
        let redelivery = broker_suite::redelivery();
        Running::spawn(move |stop| async move {
            nats::consume(
                &consumer,
                1,
                redelivery,
                stop.wait(),
                move |message: Message| {
                    let kitchen = kitchen.clone();
                    async move {
                        let redelivered = message.deliveries() != Some(1);
                        kitchen.handle(&message.payload, redelivered).await
                    }
                },
            )
            .await
        })
        .until_killed()
        .await;
    });
}
