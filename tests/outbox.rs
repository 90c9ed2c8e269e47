//! The transactional outbox on PostgreSQL, MariaDB and SQLite, published to a real RabbitMQ
//! (publisher confirms) and a real NATS JetStream: commit and rollback, the outbox id as the
//! message id, relays in parallel, retries, dead-lettering and the operator API, the wake-up
//! on commit, purging, and the outbox in the same transaction as an idempotency claim. Every
//! case runs on every database (the `cases!` modules at the end).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/outbox_fixtures.rs"]
mod outbox_fixtures;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use idempotency::outbox::{self, MessageId, Outbox, OutboxDialect, Relay};
use idempotency::sql::sqlx::{self, PgPool};
use idempotency::sql::SqlStore;
use idempotency::store::Token;
use idempotency::{Error, Key};
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use outbox_fixtures::{
    enqueue, mariadb, order, postgres, publisher, rabbitmq, sqlite, unique, Fixture, Queue,
};

/// A committed message is published once, with the outbox id as AMQP `message_id`, its event
/// type as `type`, its headers and payload; the row is marked published, then purged.
async fn a_committed_message_is_published_with_its_id<DB: OutboxDialect>(fixture: Fixture<DB>) {
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let ids = enqueue(outbox, &[order(1, &queue.name)]).await;
    let relay = Relay::new(outbox.clone(), publisher(&conn).await);
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
    let stored = outbox.get(&ids[0]).await.unwrap().expect("the row");
    assert_eq!(stored.aggregate_id, "A-1");
    assert_eq!(stored.attempts, 1);
    let counts = outbox.counts().await.unwrap();
    assert_eq!((counts.pending, counts.published, counts.dead), (0, 1, 0));
    assert_eq!(
        outbox
            .purge_published(Duration::from_secs(3600), 100)
            .await
            .unwrap(),
        0,
        "published just now"
    );
    assert_eq!(
        outbox.purge_published(Duration::ZERO, 100).await.unwrap(),
        1
    );
    assert_eq!(outbox.counts().await.unwrap().published, 0);
    assert_eq!(outbox.get(&ids[0]).await.unwrap(), None);
    queue.delete().await;
}

/// A message enqueued in a transaction that rolls back never exists, so nothing is
/// published.
async fn a_rolled_back_message_is_never_published<DB: OutboxDialect>(fixture: Fixture<DB>) {
    let outbox = &fixture.outbox;
    let mut tx = outbox.pool().begin().await.unwrap();
    outbox.enqueue(&mut tx, &order(1, "nowhere")).await.unwrap();
    tx.rollback().await.unwrap();
    let conn = rabbitmq().await;
    let stats = Relay::new(outbox.clone(), publisher(&conn).await)
        .run_once()
        .await
        .unwrap();
    assert_eq!(stats.claimed, 0);
    assert_eq!(outbox.counts().await.unwrap(), Default::default());
}

/// Three relays drain 300 rows in parallel, in batches of 20: every message reaches the
/// queue exactly once.
async fn relays_in_parallel_publish_each_row_once<DB: OutboxDialect>(fixture: Fixture<DB>) {
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let mut expected = HashSet::new();
    for chunk in 0..10 {
        let messages: Vec<_> = (0..30)
            .map(|n| order(chunk * 30 + n, &queue.name))
            .collect();
        expected.extend(enqueue(outbox, &messages).await);
    }
    let mut relays = Vec::new();
    for _ in 0..3 {
        let relay = Relay::new(outbox.clone(), publisher(&conn).await).batch(20);
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
/// backoff, and goes dead at its last attempt, with a copy to the broker's dead-letter
/// queue; an operator retries it once the queue exists,
/// and the next round publishes it. Discard removes a dead message.
async fn failures_retry_then_go_dead_and_an_operator_retries<DB: OutboxDialect>(
    fixture: Fixture<DB>,
) {
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let missing = unique("outbox_missing");
    let ids = enqueue(outbox, &[order(1, &missing), order(2, &missing)]).await;
    let dead_letters = Queue::new(&conn).await;
    let relay = Relay::new(outbox.clone(), publisher(&conn).await)
        .max_attempts(3)
        .backoff(Duration::ZERO, Duration::ZERO)
        .dead_letter_to(dead_letters.name.clone());
    for attempt in 1..=3 {
        let stats = relay.run_once().await.unwrap();
        assert_eq!((stats.claimed, stats.failed), (2, 2), "attempt {attempt}");
        assert_eq!(stats.dead, if attempt == 3 { 2 } else { 0 });
        assert_eq!(stats.dead_lettered, stats.dead);
    }
    // The broker's dead-letter queue got a copy of each, with where it was going and why
    // it failed.
    let copies = dead_letters.drain().await;
    assert_eq!(copies.len(), 2);
    let copied: HashSet<_> = copies
        .iter()
        .map(|m| {
            let properties = &m.delivery.properties;
            let headers = properties.headers().as_ref().unwrap().inner();
            assert!(matches!(
                headers.get("outbox-destination"),
                Some(AMQPValue::LongString(value)) if value.to_string() == missing
            ));
            assert!(matches!(
                headers.get("outbox-last-error"),
                Some(AMQPValue::LongString(value)) if value.to_string().contains(&missing)
            ));
            MessageId::from_string(properties.message_id().as_ref().unwrap().to_string())
        })
        .collect();
    assert_eq!(copied, ids.iter().cloned().collect());
    dead_letters.delete().await;
    assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    let dead = outbox.dead(10).await.unwrap();
    assert_eq!(dead.len(), 2);
    assert_eq!(dead[0].message.attempts, 3);
    assert!(
        dead[0].last_error.as_deref().unwrap().contains(&missing),
        "{dead:?}"
    );
    assert!(
        (0.0..60.0).contains(&dead[0].age_seconds),
        "{}",
        dead[0].age_seconds
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

/// A relay whose broker never confirms stops waiting before its claim runs out (so no two
/// relays ever publish a row at once), records the failed attempt with its token, and the
/// row goes to the next relay, which publishes it once.
///
/// The publish is timed from before the claim to the moment the relay abandons it (the
/// stalled future is dropped), so the statements around it do not count: the relay gives
/// up a tenth of the lease early, and the claim statement must fit in that tenth.
async fn a_relay_that_stalls_gives_the_row_back_before_its_claim_ends<DB: OutboxDialect>(
    fixture: Fixture<DB>,
) {
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let ids = enqueue(outbox, &[order(1, &queue.name)]).await;
    let lease = Duration::from_secs(1);
    let abandoned = Arc::new(Mutex::new(None));
    let stalled = Relay::new(
        outbox.clone(),
        Stalled {
            abandoned: abandoned.clone(),
        },
    )
    .lease(lease)
    .backoff(Duration::ZERO, Duration::ZERO);
    let started = Instant::now();
    let stats = stalled.run_once().await.unwrap();
    let abandoned = abandoned
        .lock()
        .unwrap()
        .expect("the stalled publish was abandoned");
    assert!(
        abandoned.duration_since(started) < lease,
        "waited past its claim: {:?}",
        abandoned.duration_since(started)
    );
    assert_eq!((stats.claimed, stats.published, stats.failed), (1, 0, 1));
    let row = outbox.get(&ids[0]).await.unwrap().expect("the row");
    assert_eq!(row.attempts, 1);

    let stats = Relay::new(outbox.clone(), publisher(&conn).await)
        .run_once()
        .await
        .unwrap();
    assert_eq!((stats.claimed, stats.published), (1, 1));
    assert_eq!(outbox.get(&ids[0]).await.unwrap().unwrap().attempts, 2);
    assert_eq!(queue.drain().await.len(), 1);
    queue.delete().await;
}

/// A publisher whose broker never confirms; it notes when the relay abandons the publish.
struct Stalled {
    abandoned: Arc<Mutex<Option<Instant>>>,
}

/// Notes the instant it is dropped.
struct NoteDrop(Arc<Mutex<Option<Instant>>>);

impl Drop for NoteDrop {
    fn drop(&mut self) {
        if let Ok(mut at) = self.0.lock() {
            *at = Some(Instant::now());
        }
    }
}

impl outbox::Publisher for Stalled {
    fn publish<'a>(
        &'a self,
        _message: &'a outbox::OutboxMessage,
    ) -> idempotency::store::BoxFuture<'a, Result<(), outbox::PublishError>> {
        let note = NoteDrop(self.abandoned.clone());
        Box::pin(async move {
            let _note = note;
            std::future::pending().await
        })
    }
}

/// `run` publishes a message as soon as its transaction commits through `Outbox::commit`,
/// not at its next poll a minute later.
async fn run_publishes_on_commit<DB: OutboxDialect>(fixture: Fixture<DB>) {
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let relay = Relay::new(outbox.clone(), publisher(&conn).await).poll(Duration::from_secs(60));
    let (stop, running) = spawn_run(relay);
    // The first message may be taken by the relay's first round or by the wake-up; the
    // second comes after that round, so only a wake-up can bring it before the poll.
    for n in 1..=2 {
        enqueue(outbox, &[order(n, &queue.name)]).await;
        wait_published(outbox, u64::from(n)).await;
    }
    stop.send(()).unwrap();
    let stats = running.await.unwrap();
    assert_eq!(stats.published, 2);
    assert_eq!(queue.drain().await.len(), 2);
    queue.delete().await;
}

/// Runs `relay` in a task until the sender is used; the task returns the relay's stats.
fn spawn_run<DB: OutboxDialect, P: outbox::Publisher + 'static>(
    relay: Relay<DB, P>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<outbox::RelayStats>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stopped.await;
            })
            .await
            .unwrap()
    });
    (stop, running)
}

async fn wait_published<DB: OutboxDialect>(outbox: &Outbox<DB>, n: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while outbox.counts().await.unwrap().published < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "message {n} not published"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[derive(Debug)]
enum AppError {
    Idempotency(Error),
    // Read through `Debug`, in a failing assertion's message.
    #[allow(dead_code)]
    Outbox(idempotency::store::StoreError),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Idempotency(e)
    }
}

/// The idempotency claim, the business change (here: the message itself) and the message
/// commit as one in `run_in_tx`: a duplicate of a committed operation enqueues nothing, and a
/// rolled-back one leaves neither record nor message, so its retry enqueues once.
async fn the_outbox_commits_with_the_idempotency_record<DB: OutboxDialect>(fixture: Fixture<DB>) {
    let outbox = &fixture.outbox;
    let store = SqlStore::from_pool(outbox.pool().clone())
        .table(fixture.records_table.clone())
        .build()
        .await
        .unwrap();
    let ttl = Duration::from_secs(3600);
    let attempt = |key: &str, commit: bool| {
        let (store, outbox, key) = (&store, outbox, key.to_string());
        async move {
            let mut tx = outbox.pool().begin().await.unwrap();
            let key = Key::new("order:create", 1, &[&key]).unwrap();
            let out = store
                .run_in_tx(&mut tx, key, ttl, async |conn| {
                    outbox
                        .enqueue(conn, &order(7, "orders"))
                        .await
                        .map_err(AppError::Outbox)
                })
                .await;
            if commit && out.is_ok() {
                outbox.commit(tx).await.unwrap();
            } else {
                tx.rollback().await.unwrap();
            }
            out
        }
    };
    // Rolled back: nothing remains, so the retry runs and enqueues once.
    attempt("A-7", false).await.unwrap();
    assert_eq!(outbox.counts().await.unwrap().pending, 0);
    let id = attempt("A-7", true).await.unwrap();
    assert!(outbox.get(&id).await.unwrap().is_some());
    // A duplicate of the committed operation enqueues nothing.
    match attempt("A-7", true).await {
        Err(AppError::Idempotency(e)) if e.is_duplicate() => {}
        other => panic!("expected a duplicate, got {other:?}"),
    }
    assert_eq!(outbox.counts().await.unwrap().pending, 1);
}

/// Every case, on one database.
macro_rules! cases {
    ($db:ident, $fixture:expr) => {
        mod $db {
            use super::*;

            #[tokio::test]
            async fn a_committed_message_is_published_with_its_id() {
                super::a_committed_message_is_published_with_its_id($fixture).await;
            }

            #[tokio::test]
            async fn a_rolled_back_message_is_never_published() {
                super::a_rolled_back_message_is_never_published($fixture).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn relays_in_parallel_publish_each_row_once() {
                super::relays_in_parallel_publish_each_row_once($fixture).await;
            }

            #[tokio::test]
            async fn failures_retry_then_go_dead_and_an_operator_retries() {
                super::failures_retry_then_go_dead_and_an_operator_retries($fixture).await;
            }

            #[tokio::test]
            async fn a_relay_that_stalls_gives_the_row_back_before_its_claim_ends() {
                super::a_relay_that_stalls_gives_the_row_back_before_its_claim_ends($fixture).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn run_publishes_on_commit() {
                super::run_publishes_on_commit($fixture).await;
            }

            #[tokio::test]
            async fn the_outbox_commits_with_the_idempotency_record() {
                super::the_outbox_commits_with_the_idempotency_record($fixture).await;
            }
        }
    };
}

cases!(on_postgres, postgres().await);
cases!(on_mariadb, mariadb().await);
cases!(on_sqlite, sqlite().await);

/// On PostgreSQL a plain `commit` wakes relays in any process (`NOTIFY` is delivered at
/// commit): a relay that polls once a minute publishes within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_relays_are_notified_at_a_plain_commit() {
    let fixture = postgres().await;
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    // A relay on an outbox value of its own: `Outbox::commit` on this one cannot wake it.
    let relay_outbox = Outbox::with_table(outbox.pool().clone(), outbox.table()).unwrap();
    let relay = Relay::new(relay_outbox, publisher(&conn).await).poll(Duration::from_secs(60));
    let (stop, running) = spawn_run(relay);
    for n in 1..=2 {
        let mut tx = outbox.pool().begin().await.unwrap();
        outbox
            .enqueue(&mut tx, &order(n, &queue.name))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        wait_published(outbox, u64::from(n)).await;
    }
    stop.send(()).unwrap();
    assert_eq!(running.await.unwrap().published, 2);
    queue.delete().await;
}

/// A table whose qualified name is longer than PostgreSQL takes for a channel (a long schema
/// name): enqueue still notifies, and a relay on another outbox value of that table wakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_relays_are_notified_for_a_long_table_name() {
    use sqlx::Executor as _;

    let url = std::env::var("IDEMPOTENT_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let token = format!("{:?}", Token::generate());
    let schema = format!("outbox_long_schema_name_{}", &token[6..token.len() - 1]);
    let table = format!("{schema}.idempotent_outbox_of_orders");
    assert!(table.len() > 63, "{table}");
    let pool = PgPool::connect(&url).await.unwrap();
    pool.execute(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .await
        .unwrap();
    let outbox = Outbox::with_table(pool.clone(), &table).unwrap();
    outbox.create_table().await.unwrap();
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let relay_outbox = Outbox::with_table(pool.clone(), &table).unwrap();
    let relay = Relay::new(relay_outbox, publisher(&conn).await).poll(Duration::from_secs(60));
    let (stop, running) = spawn_run(relay);
    // The second message reaches a relay that already went idle: only the notification wakes
    // it before its minute of polling.
    for n in 1..=2 {
        let mut tx = pool.begin().await.unwrap();
        outbox
            .enqueue(&mut tx, &order(n, &queue.name))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        wait_published(&outbox, u64::from(n)).await;
    }
    stop.send(()).unwrap();
    assert_eq!(running.await.unwrap().published, 2);
    queue.delete().await;
    pool.execute(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .await
        .unwrap();
}

/// On NATS JetStream the outbox id is `Nats-Msg-Id`: a second publication of the same row
/// (a relay that died between the ack and the mark) is dropped by the stream's duplicate
/// window.
#[tokio::test]
async fn jetstream_drops_a_republished_row() {
    let fixture = postgres().await;
    let outbox = &fixture.outbox;
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
    let ids = enqueue(outbox, &[order(1, &subject)]).await;
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
