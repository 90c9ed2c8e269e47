//! The transactional outbox on PostgreSQL, published to a real RabbitMQ (publisher confirms)
//! and a real NATS JetStream: commit and rollback, the outbox id as the message id, relays in
//! parallel, retries, dead-lettering and the operator API, the wake-up on commit, purging.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::collections::HashSet;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idempotency::outbox::{self, Message, MessageId, Outbox, Relay};
use idempotency::sql::sqlx::PgPool;
use idempotency::Token;
use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use sql_tables::{Scratch, Server};

fn unique(prefix: &str) -> String {
    let token = format!("{:?}", Token::generate());
    format!("{prefix}_{}", &token[6..token.len() - 1])
}

async fn rabbitmq() -> lapin::Connection {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "RabbitMQ is not reachable at {url}: {e}; start it with: rabbitmq-server -detached"
            )
        })
}

/// An outbox in a table of its own, and its pool.
async fn outbox() -> (Scratch, Outbox) {
    let table = Scratch::table(Server::Postgres);
    let pool = PgPool::connect(table.url()).await.unwrap();
    let outbox = Outbox::with_table(pool, table.name()).unwrap();
    outbox.create_table().await.unwrap();
    // A second time is harmless.
    outbox.create_table().await.unwrap();
    (table, outbox)
}

/// A RabbitMQ queue of the test's own (deleted on drop), and a publisher routing to it.
struct Queue {
    channel: lapin::Channel,
    name: String,
}

impl Queue {
    async fn new(conn: &lapin::Connection) -> Queue {
        let channel = conn.create_channel().await.unwrap();
        let name = unique("outbox");
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        Queue { channel, name }
    }

    /// Every message in the queue, taken.
    async fn drain(&self) -> Vec<lapin::message::BasicGetMessage> {
        let mut got = Vec::new();
        while let Some(message) = self
            .channel
            .basic_get(self.name.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            got.push(message);
        }
        got
    }

    async fn delete(self) {
        let _ = self
            .channel
            .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

async fn enqueue(outbox: &Outbox, messages: &[Message]) -> Vec<MessageId> {
    let mut tx = outbox.pool().begin().await.unwrap();
    let mut ids = Vec::new();
    for message in messages {
        ids.push(outbox.enqueue(&mut tx, message).await.unwrap());
    }
    tx.commit().await.unwrap();
    ids
}

fn order(n: u32, destination: &str) -> Message {
    Message::new(
        "order",
        format!("A-{n}"),
        "order.created",
        destination,
        format!("{{\"order\":{n}}}").into_bytes(),
    )
    .header("tenant", "acme")
}

/// A committed message is published once, with the outbox id as AMQP `message_id`, its event
/// type as `type`, its headers and payload; the row is marked published, then purged.
#[tokio::test]
async fn a_committed_message_is_published_with_its_id() {
    let (_table, outbox) = outbox().await;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let ids = enqueue(&outbox, &[order(1, &queue.name)]).await;
    let publisher = outbox::rabbitmq::Publisher::new(conn.create_channel().await.unwrap(), "")
        .await
        .unwrap();
    let relay = Relay::new(outbox.clone(), publisher);
    let stats = relay.run_once().await.unwrap();
    assert_eq!((stats.claimed, stats.published, stats.failed), (1, 1, 0));
    assert_eq!(relay.run_once().await.unwrap().claimed, 0);

    let got = queue.drain().await;
    assert_eq!(got.len(), 1);
    let delivery = &got[0].delivery;
    let properties = &delivery.properties;
    assert_eq!(
        properties.message_id().as_ref().unwrap().as_str(),
        ids[0].as_str()
    );
    assert_eq!(
        properties.kind().as_ref().unwrap().as_str(),
        "order.created"
    );
    assert_eq!(delivery.data, b"{\"order\":1}");
    let headers = properties.headers().as_ref().unwrap();
    assert!(matches!(
        headers.inner().get("tenant"),
        Some(AMQPValue::LongString(value)) if value.to_string() == "acme"
    ));
    let counts = outbox.counts().await.unwrap();
    assert_eq!((counts.pending, counts.published, counts.dead), (0, 1, 0));
    assert_eq!(
        outbox.purge_published(Duration::ZERO, 100).await.unwrap(),
        1
    );
    assert_eq!(outbox.counts().await.unwrap().published, 0);
    queue.delete().await;
}

/// A message enqueued in a transaction that rolls back never exists, so nothing is
/// published.
#[tokio::test]
async fn a_rolled_back_message_is_never_published() {
    let (_table, outbox) = outbox().await;
    let mut tx = outbox.pool().begin().await.unwrap();
    outbox.enqueue(&mut tx, &order(1, "nowhere")).await.unwrap();
    tx.rollback().await.unwrap();
    let conn = rabbitmq().await;
    let publisher = outbox::rabbitmq::Publisher::new(conn.create_channel().await.unwrap(), "")
        .await
        .unwrap();
    let stats = Relay::new(outbox.clone(), publisher)
        .run_once()
        .await
        .unwrap();
    assert_eq!(stats.claimed, 0);
    assert_eq!(outbox.counts().await.unwrap(), Default::default());
}

/// Three relays drain 300 rows in parallel, in batches of 20: every message reaches the
/// queue exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relays_in_parallel_publish_each_row_once() {
    let (_table, outbox) = outbox().await;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let mut expected = HashSet::new();
    for chunk in 0..10 {
        let messages: Vec<_> = (0..30)
            .map(|n| order(chunk * 30 + n, &queue.name))
            .collect();
        expected.extend(enqueue(&outbox, &messages).await);
    }
    let mut relays = Vec::new();
    for _ in 0..3 {
        let publisher = outbox::rabbitmq::Publisher::new(conn.create_channel().await.unwrap(), "")
            .await
            .unwrap();
        let relay = Relay::new(outbox.clone(), publisher).batch(20);
        relays.push(tokio::spawn(async move {
            let mut published = 0;
            loop {
                let stats = relay.run_once().await.unwrap();
                if stats.claimed == 0 {
                    return published;
                }
                published += stats.published;
            }
        }));
    }
    let mut published = 0;
    for relay in relays {
        published += relay.await.unwrap();
    }
    assert_eq!(published, 300);
    let got = queue.drain().await;
    let ids: Vec<_> = got
        .iter()
        .map(|m| {
            MessageId::from_string(
                m.delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .unwrap()
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(
        ids.len(),
        300,
        "a row was published more than once or not at all"
    );
    assert_eq!(ids.into_iter().collect::<HashSet<_>>(), expected);
    queue.delete().await;
}

/// A message no queue takes fails (mandatory publish, returned), is retried after its
/// backoff, and goes dead at its last attempt; an operator retries it once the queue exists,
/// and the next round publishes it. Discard removes a dead message.
#[tokio::test]
async fn failures_retry_then_go_dead_and_an_operator_retries() {
    let (_table, outbox) = outbox().await;
    let conn = rabbitmq().await;
    let missing = unique("outbox_missing");
    let ids = enqueue(&outbox, &[order(1, &missing), order(2, &missing)]).await;
    let publisher = outbox::rabbitmq::Publisher::new(conn.create_channel().await.unwrap(), "")
        .await
        .unwrap();
    let relay = Relay::new(outbox.clone(), publisher)
        .max_attempts(3)
        .backoff(Duration::ZERO, Duration::ZERO);
    for attempt in 1..=3 {
        let stats = relay.run_once().await.unwrap();
        assert_eq!((stats.claimed, stats.failed), (2, 2), "attempt {attempt}");
        assert_eq!(stats.dead, if attempt == 3 { 2 } else { 0 });
    }
    assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    let dead = outbox.dead(10).await.unwrap();
    assert_eq!(dead.len(), 2);
    assert_eq!(dead[0].message.attempts, 3);
    assert!(
        dead[0].last_error.as_deref().unwrap().contains(&missing),
        "{dead:?}"
    );

    // The operator creates the queue and retries the first; discards the second.
    let channel = conn.create_channel().await.unwrap();
    let queue = Queue {
        channel: channel.clone(),
        name: missing.clone(),
    };
    channel
        .queue_declare(
            missing.as_str().into(),
            QueueDeclareOptions {
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let (first, second) = (&dead[0].message.id, &dead[1].message.id);
    assert!(ids.contains(first) && ids.contains(second));
    assert!(outbox.retry(first).await.unwrap());
    assert!(
        !outbox.retry(first).await.unwrap(),
        "only a dead message is retried"
    );
    assert!(outbox.discard(second).await.unwrap());
    assert!(
        !outbox.discard(first).await.unwrap(),
        "only a dead message is discarded"
    );
    let stats = relay.run_once().await.unwrap();
    assert_eq!((stats.claimed, stats.published), (1, 1));
    let got = queue.drain().await;
    assert_eq!(got.len(), 1);
    let counts = outbox.counts().await.unwrap();
    assert_eq!((counts.pending, counts.published, counts.dead), (0, 1, 0));
    queue.delete().await;
}

/// `run` publishes a message as soon as its transaction commits (the notification), not at
/// its next poll a minute later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_publishes_on_commit() {
    let (_table, outbox) = outbox().await;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let publisher = outbox::rabbitmq::Publisher::new(conn.create_channel().await.unwrap(), "")
        .await
        .unwrap();
    let relay = Relay::new(outbox.clone(), publisher).poll(Duration::from_secs(60));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stopped.await;
            })
            .await
            .unwrap()
    });
    // The first message may be taken by the relay's first round or by a notification; the
    // second comes after that round, so only a notification can bring it before the poll.
    for n in 1..=2 {
        enqueue(&outbox, &[order(n, &queue.name)]).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while outbox.counts().await.unwrap().published < u64::from(n) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "message {n} not published"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    stop.send(()).unwrap();
    let stats = running.await.unwrap();
    assert_eq!(stats.published, 2);
    assert_eq!(queue.drain().await.len(), 2);
    queue.delete().await;
}

/// On NATS JetStream the outbox id is `Nats-Msg-Id`: a second publication of the same row
/// (a relay that died between the ack and the mark) is dropped by the stream's duplicate
/// window.
#[tokio::test]
async fn jetstream_drops_a_republished_row() {
    let (_table, outbox) = outbox().await;
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client = async_nats::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("NATS is not reachable at {url}: {e}"));
    let js = jetstream::new(client);
    let name = unique("OUTBOX").to_uppercase();
    let subject = format!("outbox.{}", name.to_lowercase());
    let stream = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    let ids = enqueue(&outbox, &[order(1, &subject)]).await;
    let publisher = outbox::nats::Publisher::new(js.clone());
    let relay = Relay::new(outbox.clone(), publisher.clone());
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    // The same row again, as a relay that died before marking it would send it.
    let message = outbox.get(&ids[0]).await.unwrap().expect("the row");
    outbox::Publisher::publish(&publisher, &message)
        .await
        .unwrap();
    let mut stream = stream;
    let info = stream.info().await.unwrap().clone();
    assert_eq!(info.state.messages, 1, "the stream kept a duplicate");
    let stored = stream
        .get_raw_message(info.state.first_sequence)
        .await
        .unwrap();
    assert_eq!(
        stored.headers.get("Nats-Msg-Id").map(|v| v.as_str()),
        Some(ids[0].as_str())
    );
    js.delete_stream(&name).await.unwrap();
}
