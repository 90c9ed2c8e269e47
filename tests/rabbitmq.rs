//! Consumers on a real RabbitMQ (`AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`)
//! with exact counts: the broker suite (`tests/broker_suite`: duplicates filtered, a failing
//! handler retried then dead-lettered on a quorum queue, a consumer process killed
//! mid-handler, a store outage during consumption), and what is RabbitMQ's own: a failing
//! handler dead-lettered after exactly its deliveries (requeued on a quorum queue, or through
//! a dead-letter retry topology), forged delivery counters ignored. Effects are
//! counted in a PostgreSQL business table (`IDEMPOTENT_BUSINESS_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`); the store is the Redis at
//! `IDEMPOTENT_REDIS_URL` (default `redis://127.0.0.1:6379`) or one the test starts.
//!
//! Every test declares its own queues and PostgreSQL schema (unique names) and removes them.
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

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use broker_suite::{Broker, Running, Setup};
use brokers::{unique, wait_for, AppError, OrderMessage};
use business::{Business, Effect};
use idempotency::broker::rabbitmq::{Message, Queue};
use idempotency::broker::{rabbitmq, Redelivery, Summary};
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};

/// A queue with a dead-letter queue, a business schema and a tenant of one test; removed on
/// drop, also when the test fails.
struct Fixture {
    conn: Connection,
    channel: Channel,
    queue: String,
    dead: String,
    quorum: bool,
    tenant: String,
    schema: String,
    orders: Business,
}

impl Fixture {
    /// A classic queue, or a quorum queue (it counts deliveries: `x-delivery-count`).
    async fn declare(orders: u32, quorum: bool) -> Fixture {
        let tenant = unique("rabbitmq");
        let conn = brokers::rabbitmq().await;
        let channel = conn.create_channel().await.unwrap();
        let queue = format!("idempotent.test.{tenant}");
        let dead = format!("{queue}.dead");
        let durable = QueueDeclareOptions {
            durable: quorum,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(dead.as_str().into(), durable, FieldTable::default())
            .await
            .unwrap();
        let mut args = FieldTable::default();
        if quorum {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(dead.as_str().into()),
        );
        channel
            .queue_declare(queue.as_str().into(), durable, args)
            .await
            .unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let schema = format!("idempotent_{tenant}");
        let orders = brokers::business(&schema, orders).await;
        Fixture {
            conn,
            channel,
            queue,
            dead,
            quorum,
            tenant,
            schema,
            orders,
        }
    }

    async fn publish(&self, messages: &[OrderMessage]) {
        for msg in messages {
            self.channel
                .basic_publish(
                    "".into(),
                    self.queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &msg.to_bytes(),
                    BasicProperties::default().with_message_id(msg.message_id.as_str().into()),
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }

    /// A consumer on its own channel with `prefetch`.
    async fn consumer(&self, tag: &str, prefetch: u16) -> (Channel, lapin::Consumer) {
        let channel = self.conn.create_channel().await.unwrap();
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .unwrap();
        let consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                tag.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        (channel, consumer)
    }

    async fn ready(&self, queue: &str) -> u32 {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::default().passive(),
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    }
}

impl Broker for Fixture {
    type Message = Message;
    type Error = rabbitmq::Error;

    /// RabbitMQ redelivers a dead consumer's deliveries when its channel closes:
    /// `setup.ack_wait` does not apply.
    async fn new(orders: u32, setup: Setup) -> Fixture {
        Fixture::declare(orders, setup.counted).await
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
    ) -> Running<rabbitmq::Error>
    where
        F: Fn(Message) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Effect, AppError>> + Send + 'static,
    {
        let prefetch = u16::try_from(concurrency).unwrap();
        // The channel closes with the consumer, when the loop returns.
        let (_channel, consumer) = self.consumer("worker", prefetch).await;
        let queue = self.queue();
        Running::spawn(move |stop| {
            rabbitmq::consume(
                consumer,
                queue,
                concurrency,
                redelivery,
                stop.wait(),
                handler,
            )
        })
    }

    async fn drained(&self) {
        assert_eq!(self.ready(&self.queue).await, 0);
    }

    async fn dead_letters(&self) -> usize {
        self.ready(&self.dead).await as usize
    }

    fn child_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("CHILD_QUEUE", self.queue.clone()),
            ("CHILD_TENANT", self.tenant.clone()),
            ("CHILD_SCHEMA", self.schema.clone()),
        ]
    }

    async fn describe(&self) -> String {
        let passive = |queue: &str| {
            let queue = queue.to_owned();
            let channel = self.channel.clone();
            async move {
                channel
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions::default().passive(),
                        FieldTable::default(),
                    )
                    .await
                    .map(|q| {
                        format!(
                            "{} ready, {} consumers",
                            q.message_count(),
                            q.consumer_count()
                        )
                    })
                    .unwrap_or_else(|err| format!("unknown ({err})"))
            }
        };
        format!(
            "work queue: {}; dead-letter queue: {}",
            passive(&self.queue).await,
            passive(&self.dead).await
        )
    }
}

impl Fixture {
    /// The work queue, as its deliveries are counted.
    fn queue(&self) -> Queue {
        if self.quorum {
            Queue::quorum(self.queue.as_str())
        } else {
            Queue::classic(self.queue.as_str())
        }
    }
}

broker_suite!(Fixture);

impl Drop for Fixture {
    fn drop(&mut self) {
        let (queue, dead, schema) = (self.queue.clone(), self.dead.clone(), self.schema.clone());
        let tenant = self.tenant.clone();
        brokers::cleanup_in_thread(move || async move {
            brokers::delete_tenant_keys(&tenant);
            if let Ok(conn) =
                lapin::Connection::connect(&brokers::amqp_url(), Default::default()).await
            {
                if let Ok(channel) = conn.create_channel().await {
                    for name in [queue, dead] {
                        let _ = channel
                            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                            .await;
                    }
                }
                let _ = conn.close(200, "done".into()).await;
            }
            let _ = Business::drop_schema(&brokers::business_url(), &schema).await;
        });
    }
}

/// The consumer of [`consumer_killed_mid_handler_is_redelivered_and_processed_once`]: a
/// child process (this test binary re-run) whose handler records its execution and then
/// works for a minute, so it is always killed mid-handler. Does nothing when run without the
/// parent's environment.
#[test]
#[ignore = "a child process of consumer_killed_mid_handler_is_redelivered_and_processed_once"]
fn child_consumer() {
    let (Ok(queue), Ok(tenant), Ok(schema)) = (
        std::env::var("CHILD_QUEUE"),
        std::env::var("CHILD_TENANT"),
        std::env::var("CHILD_SCHEMA"),
    ) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let conn = brokers::rabbitmq().await;
        let channel = conn.create_channel().await.unwrap();
        channel
            .basic_qos(1, BasicQosOptions::default())
            .await
            .unwrap();
        let consumer = channel
            .basic_consume(
                queue.as_str().into(),
                tenant.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let kitchen = broker_suite::child_kitchen(&schema).await;
        let queue = Queue::classic(queue);
        let redelivery = broker_suite::redelivery();
        Running::spawn(move |stop| {
            rabbitmq::consume(
                consumer,
                queue,
                1,
                redelivery,
                stop.wait(),
                move |message: Message| {
                    let kitchen = kitchen.clone();
                    async move { kitchen.handle(&message.data, message.redelivered).await }
                },
            )
        })
        .until_killed()
        .await;
    });
}

/// Headers a publisher forges to look retried: `x-delivery-count` and an `x-death` entry
/// saying `queue` rejected the message a million times.
fn forged_counters(queue: &str) -> FieldTable {
    let mut death = FieldTable::default();
    death.insert("count".into(), AMQPValue::LongLongInt(1_000_000));
    death.insert("reason".into(), AMQPValue::LongString("rejected".into()));
    death.insert("queue".into(), AMQPValue::LongString(queue.into()));
    death.insert("exchange".into(), AMQPValue::LongString("".into()));
    death.insert(
        "routing-keys".into(),
        AMQPValue::FieldArray(vec![AMQPValue::LongString(queue.into())].into()),
    );
    death.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
    let mut headers = FieldTable::default();
    headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(1_000_000));
    headers.insert(
        "x-death".into(),
        AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
    );
    headers
}

/// A message published with forged delivery counters on a classic queue: its first failure
/// redelivers it (the counters are the publisher's, not RabbitMQ's), and its second delivery
/// is applied. Nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_delivery_counters_are_not_trusted() {
    let fx = Fixture::declare(1, false).await;
    let msg = OrderMessage::new(&fx.tenant, 1, 1);
    fx.channel
        .basic_publish(
            "".into(),
            fx.queue.as_str().into(),
            BasicPublishOptions::default(),
            &msg.to_bytes(),
            BasicProperties::default()
                .with_message_id(msg.message_id.as_str().into())
                .with_headers(forged_counters(&fx.queue)),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let kitchen = fx.kitchen(
        brokers::store(&brokers::redis_url()).await,
        Duration::from_millis(1),
    );
    let executions: Arc<Mutex<u32>> = Arc::default();

    let (channel, consumer) = fx.consumer("worker", 1).await;
    let redelivery = Redelivery::new()
        .max_deliveries(3)
        .retry_delay(Duration::from_millis(20));
    let (k, e) = (kitchen.clone(), executions.clone());
    let queue = rabbitmq::Queue::classic(consumer.queue().as_str());
    let task = tokio::spawn(rabbitmq::consume(
        consumer,
        queue,
        1,
        redelivery,
        std::future::pending(),
        move |delivery: Message| {
            let (kitchen, executions) = (k.clone(), e.clone());
            async move {
                let msg: OrderMessage = serde_json::from_slice(&delivery.data)?;
                let first = {
                    let mut executions = executions.lock().unwrap();
                    *executions += 1;
                    *executions == 1
                };
                if first {
                    return Err(AppError::KitchenDown);
                }
                let result =
                    brokers::on_order(&msg, &kitchen.orders, &kitchen.store, kitchen.work).await;
                kitchen.record(&msg, &result).await?;
                result
            }
        },
    ));
    wait_for(
        "the message settled, applied or dead-lettered",
        Duration::from_secs(30),
        || async { fx.settled().await == 1 || fx.ready(&fx.dead).await == 1 },
    )
    .await;
    channel
        .basic_cancel("worker".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    let summary = task.await.unwrap().unwrap();

    assert_eq!(
        (summary.redelivered, summary.acked, summary.dead_lettered),
        (1, 1, 0),
        "{summary:?}"
    );
    assert_eq!(*executions.lock().unwrap(), 2);
    assert_eq!(fx.tally().await.effects, 1);
    assert_eq!(fx.ready(&fx.dead).await, 0);
    assert_eq!(fx.ready(&fx.queue).await, 0);
}

/// The delivery count [`rabbitmq::deliveries`] gave each execution of a handler.
type Executions = Arc<Mutex<Vec<Option<u32>>>>;

/// Runs a handler that always fails on `consumer`'s deliveries and records what
/// [`rabbitmq::deliveries`] says for each execution.
fn consume_failing(
    consumer: lapin::Consumer,
    queue: Queue,
    redelivery: Redelivery,
) -> (
    tokio::task::JoinHandle<Result<Summary, rabbitmq::Error>>,
    Executions,
) {
    let executions = Executions::default();
    let (e, q) = (executions.clone(), queue.clone());
    let task = tokio::spawn(rabbitmq::consume(
        consumer,
        queue,
        1,
        redelivery,
        std::future::pending(),
        move |delivery: Message| {
            e.lock().unwrap().push(rabbitmq::deliveries(&delivery, &q));
            async { Err::<(), _>(AppError::KitchenDown) }
        },
    ));
    (task, executions)
}

/// On a quorum queue, failures requeued with `basic.nack`: a message whose handler always
/// fails runs on exactly `max_deliveries` deliveries, counted 1, 2, 3, 4 from RabbitMQ's
/// `x-delivery-count`, then is dead-lettered. The counters its publisher forged are ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queue_dead_letters_after_exactly_max_deliveries() {
    const MAX: u32 = 4;
    let fx = Fixture::declare(0, true).await;
    fx.channel
        .basic_publish(
            "".into(),
            fx.queue.as_str().into(),
            BasicPublishOptions::default(),
            b"{}",
            BasicProperties::default().with_headers(forged_counters(&fx.queue)),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    let (channel, consumer) = fx.consumer("worker", 1).await;
    let redelivery = Redelivery::new()
        .max_deliveries(MAX)
        .retry_delay(Duration::from_millis(20));
    let (task, executions) =
        consume_failing(consumer, Queue::quorum(fx.queue.as_str()), redelivery);
    wait_for(
        "the message dead-lettered",
        Duration::from_secs(30),
        || async { fx.ready(&fx.dead).await == 1 },
    )
    .await;
    channel
        .basic_cancel("worker".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    let summary = task.await.unwrap().unwrap();

    let executions = executions.lock().unwrap().clone();
    assert_eq!(executions, [Some(1), Some(2), Some(3), Some(4)]);
    assert_eq!(
        (
            summary.redelivered,
            summary.dead_lettered,
            summary.acked,
            summary.unsettled
        ),
        (u64::from(MAX) - 1, 1, 0, 0),
        "{summary:?}"
    );
    assert_eq!(fx.ready(&fx.queue).await, 0);
}

/// A retry topology of one test: `work` dead-letters to `retry`, whose message TTL sends
/// messages back to `work` through its own dead-letter exchange; dead letters are parked in
/// `parked`. The three queues are removed on drop, also when the test fails.
struct RetryTopology {
    _conn: Connection,
    /// In confirm mode: publishes the test's message and the parked dead letters.
    channel: Channel,
    consumer_channel: Channel,
    work: String,
    retry: String,
    parked: String,
}

impl RetryTopology {
    async fn new(quorum: bool) -> RetryTopology {
        let name = unique("retry");
        let conn = brokers::rabbitmq().await;
        let channel = conn.create_channel().await.unwrap();
        let work = format!("idempotent.test.{name}");
        let retry = format!("{work}.retry");
        let parked = format!("{work}.parked");
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let dead_letters_to = |target: &str| {
            let mut args = FieldTable::default();
            args.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            args.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(target.into()),
            );
            args
        };
        let mut work_args = dead_letters_to(&retry);
        if quorum {
            work_args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        let mut retry_args = dead_letters_to(&work);
        retry_args.insert("x-message-ttl".into(), AMQPValue::LongInt(50));
        channel
            .queue_declare(work.as_str().into(), durable, work_args)
            .await
            .unwrap();
        channel
            .queue_declare(retry.as_str().into(), durable, retry_args)
            .await
            .unwrap();
        channel
            .queue_declare(parked.as_str().into(), durable, FieldTable::default())
            .await
            .unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let consumer_channel = conn.create_channel().await.unwrap();
        consumer_channel
            .basic_qos(1, BasicQosOptions::default())
            .await
            .unwrap();
        RetryTopology {
            _conn: conn,
            channel,
            consumer_channel,
            work,
            retry,
            parked,
        }
    }

    async fn ready(&self, queue: &str) -> u32 {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::default().passive(),
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    }

    /// Publishes one message, with a forged `x-delivery-count`, and consumes `work` with a
    /// handler that always fails; returns once the message is parked, with what the
    /// consumer did and the count of each execution.
    async fn fail_until_parked(&self, queue: Queue, max: u32) -> (Summary, Vec<Option<u32>>) {
        let mut forged = FieldTable::default();
        forged.insert("x-delivery-count".into(), AMQPValue::LongLongInt(1_000_000));
        self.channel
            .basic_publish(
                "".into(),
                self.work.as_str().into(),
                BasicPublishOptions::default(),
                b"{}",
                BasicProperties::default().with_headers(forged),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        let consumer = self
            .consumer_channel
            .basic_consume(
                self.work.as_str().into(),
                "worker".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        // The delays of `Redelivery` are not used: the retry queue's TTL is the delay.
        let redelivery = Redelivery::new()
            .max_deliveries(max)
            .retry_delay(Duration::from_secs(3600));
        let (task, executions) = consume_failing(consumer, queue, redelivery);
        wait_for("the message parked", Duration::from_secs(30), || async {
            self.ready(&self.parked).await == 1
        })
        .await;
        self.consumer_channel
            .basic_cancel("worker".into(), BasicCancelOptions::default())
            .await
            .unwrap();
        let summary = task.await.unwrap().unwrap();
        let executions = executions.lock().unwrap().clone();
        assert_eq!(self.ready(&self.work).await, 0);
        assert_eq!(self.ready(&self.retry).await, 0);
        (summary, executions)
    }
}

impl Drop for RetryTopology {
    fn drop(&mut self) {
        let queues = [self.work.clone(), self.retry.clone(), self.parked.clone()];
        brokers::cleanup_in_thread(move || async move {
            if let Ok(conn) =
                lapin::Connection::connect(&brokers::amqp_url(), Default::default()).await
            {
                if let Ok(channel) = conn.create_channel().await {
                    for name in queues {
                        let _ = channel
                            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                            .await;
                    }
                }
                let _ = conn.close(200, "done".into()).await;
            }
        });
    }
}

/// A retry topology on a classic work queue: each failure is rejected into the retry queue
/// and comes back after its TTL, so the message's `x-death` gains two entries per cycle (the
/// work queue's `rejected`, the retry queue's `expired`); only the first counts. A handler
/// that always fails runs on exactly `max_deliveries` deliveries, then the message is parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_topology_parks_after_exactly_max_deliveries() {
    const MAX: u32 = 4;
    let topology = RetryTopology::new(false).await;
    let queue = Queue::classic(topology.work.as_str()).retry_through_dead_letter_exchange(
        topology.channel.clone(),
        "",
        &topology.parked,
    );
    let (summary, executions) = topology.fail_until_parked(queue, MAX).await;

    assert_eq!(executions, [Some(1), Some(2), Some(3), Some(4)]);
    assert_eq!(
        (
            summary.redelivered,
            summary.dead_lettered,
            summary.acked,
            summary.unsettled
        ),
        (u64::from(MAX) - 1, 1, 0, 0),
        "{summary:?}"
    );
}

/// The same retry topology on a quorum work queue, whose `x-delivery-count` starts again
/// each time the message comes back from the retry queue: exactly `max_deliveries`
/// deliveries, then the message is parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_topology_on_a_quorum_queue_parks_after_exactly_max_deliveries() {
    const MAX: u32 = 3;
    let topology = RetryTopology::new(true).await;
    let queue = Queue::quorum(topology.work.as_str()).retry_through_dead_letter_exchange(
        topology.channel.clone(),
        "",
        &topology.parked,
    );
    let (summary, executions) = topology.fail_until_parked(queue, MAX).await;

    assert_eq!(executions, [Some(1), Some(2), Some(3)]);
    assert_eq!(
        (
            summary.redelivered,
            summary.dead_lettered,
            summary.acked,
            summary.unsettled
        ),
        (u64::from(MAX) - 1, 1, 0, 0),
        "{summary:?}"
    );
}

/// A dead letter whose parking queue does not exist (RabbitMQ cannot route it) is not lost:
/// the delivery is requeued and reported unsettled, and the message stays in the topology.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_that_cannot_be_parked_is_requeued() {
    let topology = RetryTopology::new(false).await;
    topology
        .channel
        .basic_publish(
            "".into(),
            topology.work.as_str().into(),
            BasicPublishOptions::default(),
            b"{}",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let nowhere = format!("{}.nowhere", topology.work);
    let queue = Queue::classic(topology.work.as_str()).retry_through_dead_letter_exchange(
        topology.channel.clone(),
        "",
        &nowhere,
    );
    let consumer = topology
        .consumer_channel
        .basic_consume(
            topology.work.as_str().into(),
            "worker".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let (task, executions) = consume_failing(consumer, queue, Redelivery::new().max_deliveries(1));
    wait_for(
        "three deliveries of the message",
        Duration::from_secs(30),
        || async { executions.lock().unwrap().len() >= 3 },
    )
    .await;
    topology
        .consumer_channel
        .basic_cancel("worker".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    let summary = task.await.unwrap().unwrap();

    assert_eq!(
        (summary.dead_lettered, summary.acked),
        (0, 0),
        "{summary:?}"
    );
    assert!(summary.unsettled >= 1, "{summary:?}");
    wait_for(
        "the message back in the work or retry queue",
        Duration::from_secs(30),
        || async {
            topology.ready(&topology.work).await + topology.ready(&topology.retry).await == 1
        },
    )
    .await;
    assert_eq!(topology.ready(&topology.parked).await, 0);
}
