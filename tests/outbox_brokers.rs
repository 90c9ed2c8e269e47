//! The outbox relay when its broker goes away, through a TCP proxy that cuts, refuses and
//! stalls connections (the shared RabbitMQ and NATS servers keep running): an outage costs no
//! attempts, the RabbitMQ publisher reconnects (also when the relay starts while the broker
//! is down), a confirm that never comes times out, and the JetStream publisher publishes
//! again once its client reconnected.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/outbox_fixtures.rs"]
mod outbox_fixtures;
#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::net::SocketAddr;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idempotency::outbox::{self, MessageId, Outbox, OutboxDialect, Relay};
use outbox_fixtures::{
    enqueue, mariadb, order, postgres, rabbitmq, sqlite, unique, Fixture, Queue,
};
use proxy::Proxy;
use tokio::time::Instant;

const AMQP: &str = "127.0.0.1:5672";

/// A reconnecting publisher to RabbitMQ through `proxy`.
fn through(proxy: &Proxy) -> outbox::rabbitmq::Publisher {
    outbox::rabbitmq::Publisher::connect(format!("amqp://guest:guest@{}/%2f", proxy.addr()), "")
        .unwrap()
        .reconnect_backoff(Duration::from_millis(10), Duration::from_millis(100))
        .confirm_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_secs(2))
}

fn ids_of(got: &[lapin::message::BasicGetMessage]) -> Vec<String> {
    let mut ids: Vec<String> = got
        .iter()
        .map(|m| {
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .unwrap()
                .to_string()
        })
        .collect();
    ids.sort();
    ids
}

/// Runs rounds until `n` messages were published, for at most 10 s.
async fn publish_until<DB: OutboxDialect, P: outbox::Publisher>(relay: &Relay<DB, P>, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut published = 0;
    while published < n {
        assert!(Instant::now() < deadline, "{published} of {n} published");
        published += relay.run_once().await.unwrap().published;
        if published < n {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(published, n);
}

async fn attempts<DB: OutboxDialect>(outbox: &Outbox<DB>, id: &MessageId) -> u32 {
    outbox.get(id).await.unwrap().unwrap().attempts
}

/// The broker goes away after a publication: the rounds during the outage give their rows
/// back without counting an attempt (with `max_attempts(1)`, none goes dead); once it is
/// back the publisher opens a new connection and each row is published exactly once, on its
/// first counted attempt.
async fn an_outage_costs_no_attempts_and_the_publisher_reconnects<DB: OutboxDialect>(
    fixture: Fixture<DB>,
) {
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let proxy = Proxy::start(AMQP.parse::<SocketAddr>().unwrap()).await;
    let relay = Relay::new(outbox.clone(), through(&proxy))
        .max_attempts(1)
        .backoff(Duration::ZERO, Duration::ZERO);
    let mut ids = enqueue(outbox, &[order(1, &queue.name)]).await;
    assert_eq!(relay.run_once().await.unwrap().published, 1);

    proxy.down();
    let later = enqueue(outbox, &[order(2, &queue.name), order(3, &queue.name)]).await;
    for _ in 0..3 {
        let stats = relay.run_once().await.unwrap();
        assert_eq!((stats.published, stats.failed, stats.dead), (0, 0, 0));
        assert_eq!(stats.unavailable, 1, "{stats:?}");
    }
    for id in &later {
        assert_eq!(attempts(outbox, id).await, 0);
    }
    assert_eq!(outbox.counts().await.unwrap().pending, 2);

    proxy.up();
    publish_until(&relay, 2).await;
    ids.extend(later.iter().cloned());
    let mut expected: Vec<String> = ids.iter().map(ToString::to_string).collect();
    expected.sort();
    assert_eq!(ids_of(&queue.drain().await), expected);
    for id in &later {
        assert_eq!(attempts(outbox, id).await, 1);
    }
    let counts = outbox.counts().await.unwrap();
    assert_eq!((counts.pending, counts.published, counts.dead), (0, 3, 0));
    queue.delete().await;
}

macro_rules! cases {
    ($db:ident, $fixture:expr) => {
        mod $db {
            use super::*;

            #[tokio::test]
            async fn an_outage_costs_no_attempts_and_the_publisher_reconnects() {
                super::an_outage_costs_no_attempts_and_the_publisher_reconnects($fixture).await;
            }
        }
    };
}

cases!(on_postgres, postgres().await);
cases!(on_mariadb, mariadb().await);
cases!(on_sqlite, sqlite().await);

/// A relay built and started while the broker is down publishes once it is up, the row on
/// its first counted attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_starts_while_rabbitmq_is_down() {
    let fixture = postgres().await;
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let proxy = Proxy::start(AMQP.parse::<SocketAddr>().unwrap()).await;
    proxy.down();
    let relay = Relay::new(outbox.clone(), through(&proxy))
        .max_attempts(1)
        .poll(Duration::from_millis(20));
    let ids = enqueue(outbox, &[order(1, &queue.name)]).await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stopped.await;
            })
            .await
            .unwrap()
    });
    // Rounds meet the broker down for a while, and the row stays pending.
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.requests() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let counts = outbox.counts().await.unwrap();
    assert_eq!((counts.pending, counts.published, counts.dead), (1, 0, 0));
    proxy.up();
    let deadline = Instant::now() + Duration::from_secs(10);
    while outbox.counts().await.unwrap().published < 1 {
        assert!(
            Instant::now() < deadline,
            "not published after the broker came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(()).unwrap();
    let stats = running.await.unwrap();
    assert_eq!((stats.published, stats.dead), (1, 0));
    assert!(stats.unavailable >= 1, "{stats:?}");
    assert_eq!(attempts(outbox, &ids[0]).await, 1);
    assert_eq!(queue.drain().await.len(), 1);
    queue.delete().await;
}

/// A broker that takes the publication but never confirms: the publisher gives up after its
/// confirm timeout (the relay's 60 s claim is not waited out), the row is given back
/// uncounted, and a new connection publishes it once the broker answers again.
#[tokio::test]
async fn a_confirm_that_never_comes_times_out() {
    let fixture = postgres().await;
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let proxy = Proxy::start(AMQP.parse::<SocketAddr>().unwrap()).await;
    let relay = Relay::new(outbox.clone(), through(&proxy))
        .lease(Duration::from_secs(60))
        .max_attempts(1);
    enqueue(outbox, &[order(1, &queue.name)]).await;
    assert_eq!(relay.run_once().await.unwrap().published, 1);

    proxy.stall(true);
    let ids = enqueue(outbox, &[order(2, &queue.name)]).await;
    let started = Instant::now();
    let stats = relay.run_once().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        (stats.published, stats.failed, stats.unavailable),
        (0, 0, 1)
    );
    assert_eq!(attempts(outbox, &ids[0]).await, 0);
    proxy.stall(false);
    publish_until(&relay, 1).await;
    assert_eq!(attempts(outbox, &ids[0]).await, 1);
    // The stalled connection may still deliver its copy: at least once, never lost.
    let got = queue.drain().await.len();
    assert!((2..=3).contains(&got), "{got}");
    assert_eq!(outbox.counts().await.unwrap().dead, 0);
    queue.delete().await;
}

/// JetStream through a proxy that is cut and restored: the rounds during the outage cost no
/// attempts, and once the client reconnected on its own the rows are published.
#[tokio::test]
async fn jetstream_publishes_after_its_connection_is_cut_and_restored() {
    let fixture = postgres().await;
    let outbox = &fixture.outbox;
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let direct = jetstream::new(async_nats::connect(&url).await.unwrap());
    let proxy = Proxy::start(url.parse::<SocketAddr>().unwrap()).await;
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .reconnect_delay_callback(|_| Duration::from_millis(50))
        .connect(proxy.addr().to_string())
        .await
        .unwrap();
    let mut js = jetstream::new(client.clone());
    js.set_timeout(Duration::from_millis(500));
    let name = unique("OUTBOX").to_uppercase();
    let subject = format!("outbox.{}", name.to_lowercase());
    direct
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    let relay = Relay::new(outbox.clone(), outbox::nats::Publisher::new(js))
        .max_attempts(1)
        .backoff(Duration::ZERO, Duration::ZERO);
    enqueue(outbox, &[order(1, &subject)]).await;
    assert_eq!(relay.run_once().await.unwrap().published, 1);

    proxy.down();
    let ids = enqueue(outbox, &[order(2, &subject)]).await;
    let stats = relay.run_once().await.unwrap();
    assert_eq!(
        (stats.published, stats.failed, stats.dead),
        (0, 0, 0),
        "{stats:?}"
    );
    assert_eq!(stats.unavailable, 1);
    assert_eq!(attempts(outbox, &ids[0]).await, 0);

    proxy.up();
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.connection_state() != async_nats::connection::State::Connected {
        assert!(Instant::now() < deadline, "the client did not reconnect");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    publish_until(&relay, 1).await;
    let mut stream = direct.get_stream(&name).await.unwrap();
    // The copy buffered during the outage carries the same Nats-Msg-Id: dropped.
    assert_eq!(stream.info().await.unwrap().state.messages, 2);
    assert_eq!(outbox.counts().await.unwrap().dead, 0);
    direct.delete_stream(&name).await.unwrap();
}
