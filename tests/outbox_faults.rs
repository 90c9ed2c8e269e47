//! The outbox under faults, on PostgreSQL, MariaDB and SQLite with a real RabbitMQ: a row
//! that cannot be read (another producer wrote it) fails alone and goes dead while the rest of
//! its batch is published; the operator inspects and discards a stuck row; a message a
//! broker cannot carry is refused at `enqueue`; a database that goes silent (through a TCP
//! proxy that holds its replies) ends the relay's round at the lease instead of stopping it,
//! and one that never answers a request to listen leaves the relay polling.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/outbox_fixtures.rs"]
mod outbox_fixtures;
#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::outbox::{
    self, Discarded, InvalidMessage, Message, MessageId, MessageState, Outbox, OutboxDialect, Relay,
};
use idempotency::sql::sqlx;
use idempotency::store::StoreErrorKind;
use outbox_fixtures::{
    enqueue, mariadb, order, postgres, publisher, rabbitmq, sqlite, Fixture, Queue,
};
use proxy::Proxy;
use sql_tables::Server;

/// Writes `assignment` on row `id` as another producer would (ids are hex: safe to inline).
async fn tamper<DB: OutboxDialect>(outbox: &Outbox<DB>, id: &MessageId, assignment: &str)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let sql = format!(
        "UPDATE {} SET {assignment} WHERE id = '{}'",
        outbox.table(),
        id.as_str()
    );
    let mut conn = outbox.pool().acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut *conn)
        .await
        .unwrap();
}

fn message_ids(got: &[lapin::message::BasicGetMessage]) -> Vec<String> {
    got.iter()
        .map(|m| {
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// A row whose headers another producer wrote as `{"retries": 3}` fails alone: the rows
/// before and after it in the batch are published, its attempts are counted, and it goes
/// `dead` at `max_attempts`, listed with why it cannot be read; `get` says it is corrupt.
async fn an_unreadable_row_fails_alone_and_goes_dead<DB: OutboxDialect>(fixture: Fixture<DB>)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let ids = enqueue(
        outbox,
        &[
            order(1, &queue.name),
            order(2, &queue.name),
            order(3, &queue.name),
        ],
    )
    .await;
    tamper(outbox, &ids[1], r#"headers = '{"retries": 3}'"#).await;
    let relay = Relay::new(outbox.clone(), publisher(&conn).await)
        .max_attempts(2)
        .backoff(Duration::ZERO, Duration::ZERO);

    let stats = relay.run_once().await.unwrap();
    assert_eq!(
        (stats.claimed, stats.published, stats.failed, stats.dead),
        (3, 2, 1, 0)
    );
    assert_eq!(
        message_ids(&queue.drain().await),
        vec![ids[0].to_string(), ids[2].to_string()]
    );
    let err = outbox.get(&ids[1]).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Corrupt, "{err}");

    let stats = relay.run_once().await.unwrap();
    assert_eq!(
        (stats.claimed, stats.published, stats.failed, stats.dead),
        (1, 0, 1, 1)
    );
    assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    let dead = outbox.dead(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message.id, ids[1]);
    assert_eq!(dead[0].message.attempts, 2);
    let why = dead[0]
        .unreadable
        .as_deref()
        .expect("why it cannot be read");
    assert!(why.contains("headers"), "{why}");
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("cannot be read"),
        "{dead:?}"
    );
    assert!(queue.drain().await.is_empty());
    let counts = outbox.counts().await.unwrap();
    assert_eq!((counts.pending, counts.published, counts.dead), (0, 2, 1));
    assert!(outbox.discard(&ids[1]).await.unwrap());
    queue.delete().await;
}

/// A publisher whose broker never confirms.
struct Stalled;

impl outbox::Publisher for Stalled {
    fn publish<'a>(
        &'a self,
        _message: &'a outbox::OutboxMessage,
    ) -> idempotency::store::BoxFuture<'a, Result<(), outbox::PublishError>> {
        Box::pin(std::future::pending())
    }
}

/// A pending row that keeps failing is inspected (state, attempts, last error, why it cannot
/// be read, whether a relay holds it) and discarded with `force_discard`; plain `discard`
/// takes dead rows only; a row a relay is publishing right now, or a published one, is not
/// discarded, and the outcome says why.
async fn a_stuck_row_is_inspected_and_discarded_by_force<DB: OutboxDialect>(fixture: Fixture<DB>)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let ids = enqueue(outbox, &[order(1, &queue.name), order(2, &queue.name)]).await;
    tamper(outbox, &ids[0], "headers = 'not json'").await;
    let relay = Relay::new(outbox.clone(), publisher(&conn).await)
        .backoff(Duration::from_secs(3600), Duration::from_secs(3600));
    let stats = relay.run_once().await.unwrap();
    assert_eq!((stats.claimed, stats.published, stats.failed), (2, 1, 1));

    let stuck = outbox.inspect(&ids[0]).await.unwrap().expect("the row");
    assert_eq!(stuck.state, MessageState::Pending);
    assert_eq!(stuck.message.attempts, 1);
    assert!(!stuck.claimed);
    assert!(stuck.unreadable.as_deref().unwrap().contains("headers"));
    assert!(stuck
        .last_error
        .as_deref()
        .unwrap()
        .contains("cannot be read"));
    let published = outbox.inspect(&ids[1]).await.unwrap().expect("the row");
    assert_eq!(published.state, MessageState::Published);
    assert_eq!(published.unreadable, None);
    assert_eq!(
        published.message.headers.get("tenant").map(String::as_str),
        Some("acme")
    );
    assert!(outbox
        .inspect(&MessageId::generate())
        .await
        .unwrap()
        .is_none());

    assert!(
        !outbox.discard(&ids[0]).await.unwrap(),
        "only dead rows without force"
    );
    assert_eq!(
        outbox.force_discard(&ids[1]).await.unwrap(),
        Discarded::Published
    );
    assert_eq!(
        outbox.force_discard(&ids[0]).await.unwrap(),
        Discarded::Deleted
    );
    assert!(outbox.inspect(&ids[0]).await.unwrap().is_none());
    assert_eq!(
        outbox.force_discard(&ids[0]).await.unwrap(),
        Discarded::NotFound
    );

    // A row a relay is publishing right now stays.
    let held = enqueue(outbox, &[order(3, &queue.name)]).await;
    let stalled = Relay::new(outbox.clone(), Stalled).lease(Duration::from_secs(60));
    let publishing = tokio::spawn(async move { stalled.run_once().await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !outbox.inspect(&held[0]).await.unwrap().unwrap().claimed {
        assert!(tokio::time::Instant::now() < deadline, "never claimed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        outbox.force_discard(&held[0]).await.unwrap(),
        Discarded::Claimed
    );
    assert!(outbox.inspect(&held[0]).await.unwrap().is_some());
    publishing.abort();
    queue.delete().await;
}

/// A routing key, event type or header name longer than AMQP's 255-byte short strings is
/// refused by `enqueue` with a typed error, in the caller's transaction, which stays usable;
/// a row with such a routing key written by another producer fails alone in the relay (no
/// panic) and goes dead, and the rest of its batch is published.
async fn a_message_too_long_for_the_broker_is_refused_and_never_panics_the_relay<
    DB: OutboxDialect,
>(
    fixture: Fixture<DB>,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let long = "k".repeat(256);
    let mut tx = outbox.pool().begin().await.unwrap();
    for (message, field) in [
        (order(1, &long), "destination"),
        (
            Message::new("order", "A-1", long.as_str(), &queue.name, b"{}".to_vec()),
            "event_type",
        ),
        (
            order(1, &queue.name).header(long.as_str(), "v"),
            "header name",
        ),
    ] {
        let err = outbox.enqueue(&mut tx, &message).await.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Rejected, "{err}");
        let invalid = std::error::Error::source(&err)
            .and_then(|e| e.downcast_ref::<InvalidMessage>())
            .expect("an InvalidMessage source");
        assert_eq!(invalid.field(), field, "{invalid}");
        assert_eq!(invalid.len(), 256);
        assert!(message.validate().is_err());
    }
    // 255 bytes fit, and the transaction is still usable.
    let fits = order(2, &queue.name).header("h".repeat(255), "v");
    assert!(fits.validate().is_ok());
    let first = outbox.enqueue(&mut tx, &fits).await.unwrap();
    let other = outbox
        .enqueue(&mut tx, &order(3, &queue.name))
        .await
        .unwrap();
    let last = outbox
        .enqueue(&mut tx, &order(4, &queue.name))
        .await
        .unwrap();
    outbox.commit(tx).await.unwrap();
    tamper(outbox, &other, &format!("destination = '{long}'")).await;

    let relay = Relay::new(outbox.clone(), publisher(&conn).await)
        .max_attempts(1)
        .backoff(Duration::ZERO, Duration::ZERO);
    let stats = relay.run_once().await.unwrap();
    assert_eq!(
        (stats.claimed, stats.published, stats.failed, stats.dead),
        (3, 2, 1, 1)
    );
    assert_eq!(
        message_ids(&queue.drain().await),
        vec![first.to_string(), last.to_string()]
    );
    let dead = outbox.dead(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message.id, other);
    assert!(
        dead[0].last_error.as_deref().unwrap().contains("255"),
        "{dead:?}"
    );
    // The publisher still works after refusing it.
    enqueue(outbox, &[order(5, &queue.name)]).await;
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    queue.delete().await;
}

/// Durations of `Duration::MAX` (meaning "never give up") are clamped to the longest supported
/// duration instead of overflowing the clock: the relay claims and publishes as usual, and a
/// failed row waits (instead of panicking the relay on every round).
async fn durations_of_duration_max_are_clamped<DB: OutboxDialect>(fixture: Fixture<DB>)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let outbox = &fixture.outbox;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    enqueue(outbox, &[order(1, &queue.name)]).await;
    let relay = Relay::new(outbox.clone(), publisher(&conn).await)
        .lease(Duration::MAX)
        .backoff(Duration::MAX, Duration::MAX)
        .poll(Duration::MAX);
    let stats = relay.run_once().await.unwrap();
    assert_eq!((stats.claimed, stats.published), (1, 1), "{stats:?}");
    queue.delete().await;
}

/// `server`'s URL with its `host:port` replaced by `addr` (a proxy in front of it), and the
/// address it replaced.
fn through(server: Server, addr: Option<SocketAddr>) -> (String, SocketAddr) {
    let url = server.url();
    let start = url.find("://").unwrap() + 3;
    let rest = &url[start..];
    let end = start + rest.find('/').unwrap_or(rest.len());
    let host_start = url[start..end]
        .rfind('@')
        .map_or(start, |at| start + at + 1);
    let upstream: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(&url[host_start..end])
        .unwrap()
        .next()
        .unwrap();
    let url = match addr {
        Some(addr) => format!("{}{addr}{}", &url[..host_start], &url[end..]),
        None => url,
    };
    (url, upstream)
}

/// The fixture's outbox table, reached through a proxy that can go silent.
async fn silent_outbox<DB: OutboxDialect>(
    fixture: &Fixture<DB>,
    server: Server,
) -> (Arc<Proxy>, Outbox<DB>) {
    let (_, upstream) = through(server, None);
    let proxy = Arc::new(Proxy::start(upstream).await);
    let (url, _) = through(server, Some(proxy.addr()));
    let pool = sqlx::Pool::<DB>::connect(&url).await.unwrap();
    let outbox = Outbox::with_table(pool, fixture.outbox.table()).unwrap();
    (proxy, outbox)
}

/// Rounds of `relay` until `id` is published, for at most 30 s.
async fn published_eventually<DB: OutboxDialect, P: outbox::Publisher>(
    relay: &Relay<DB, P>,
    outbox: &Outbox<DB>,
    id: &MessageId,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let round = relay.run_once().await;
        let row = outbox.inspect(id).await.unwrap().unwrap();
        if row.state == MessageState::Published {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never published: {round:?}, {row:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// When the database goes silent, and what the publisher answers once it has silenced it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Then {
    /// Before the round: its first statement is the claim.
    BeforeClaim,
    /// The broker confirmed: the relay's next statement is the mark.
    Confirm,
    /// The broker refused the message: the next statement records the failed attempt.
    Refuse,
    /// The broker cannot be reached: the next statement gives the rows back.
    Unreachable,
}

/// Silences `proxy` (the database's connection) on its first publication, then answers as
/// `then` says (publishing through `inner` for [`Then::Confirm`], and on every later call).
struct SilenceOnce<P> {
    inner: P,
    proxy: Arc<Proxy>,
    armed: AtomicBool,
    then: Then,
}

impl<P: outbox::Publisher> outbox::Publisher for SilenceOnce<P> {
    fn publish<'a>(
        &'a self,
        message: &'a outbox::OutboxMessage,
    ) -> idempotency::store::BoxFuture<'a, Result<(), outbox::PublishError>> {
        Box::pin(async move {
            if !self.armed.swap(false, Ordering::SeqCst) {
                return self.inner.publish(message).await;
            }
            match self.then {
                Then::BeforeClaim => self.inner.publish(message).await,
                Then::Confirm => {
                    self.inner.publish(message).await?;
                    self.proxy.stall(true);
                    Ok(())
                }
                Then::Refuse => {
                    self.proxy.stall(true);
                    Err(outbox::PublishError::new("refused"))
                }
                Then::Unreachable => {
                    self.proxy.stall(true);
                    Err(outbox::PublishError::unavailable("no connection"))
                }
            }
        })
    }
}

/// The database goes silent (through a proxy that holds its answers, the connection open):
/// before the claim, or right after a publication, before the statement that follows it (the
/// mark, the failed attempt, the give-back; or the pool's check of the connection before it)
/// is answered. The round ends once the lease has passed instead of waiting forever: an
/// unanswered claim with `OutcomeUnknown`. Once the database answers again the message goes
/// out: once more only when the broker had confirmed it and the mark did not land (at least
/// once: the consumer filters the duplicate); a claim that landed holds the row until it runs
/// out.
async fn the_database_goes_silent<DB: OutboxDialect>(
    fixture: Fixture<DB>,
    server: Server,
    then: Then,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let (proxy, silent) = silent_outbox(&fixture, server).await;
    let lease = Duration::from_secs(1);
    let publisher = SilenceOnce {
        inner: publisher(&conn).await,
        proxy: proxy.clone(),
        armed: AtomicBool::new(true),
        then,
    };
    let relay = Relay::new(silent, publisher)
        .lease(lease)
        .backoff(Duration::from_millis(100), Duration::from_millis(100));
    let ids = enqueue(&fixture.outbox, &[order(1, &queue.name)]).await;

    if then == Then::BeforeClaim {
        proxy.stall(true);
    }
    let round = tokio::time::timeout(lease * 10, relay.run_once())
        .await
        .expect("the round waited for a database that never answered");
    // Requests still reach the server while its answers are held, and the round waited a
    // whole lease: what was sent has landed, and nothing more is sent for it.
    let marked = fixture
        .outbox
        .inspect(&ids[0])
        .await
        .unwrap()
        .unwrap()
        .state
        == MessageState::Published;
    proxy.stall(false);
    if then == Then::BeforeClaim {
        let err = round.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::OutcomeUnknown, "{err}");
        published_eventually(&relay, &fixture.outbox, &ids[0]).await;
        assert_eq!(message_ids(&queue.drain().await), [ids[0].to_string()]);
        queue.delete().await;
        return;
    }
    let stats = round.unwrap();
    let expected = match then {
        Then::BeforeClaim => unreachable!("answered above"),
        Then::Confirm => (1, 0, 1, 0, 0),
        Then::Refuse => (1, 0, 0, 1, 0),
        Then::Unreachable => (1, 0, 0, 0, 1),
    };
    assert_eq!(
        (
            stats.claimed,
            stats.published,
            stats.unmarked,
            stats.failed,
            stats.unavailable
        ),
        expected,
        "{then:?}: {stats:?}"
    );

    published_eventually(&relay, &fixture.outbox, &ids[0]).await;
    let copies = match then {
        Then::Confirm if !marked => 2,
        _ => 1,
    };
    assert_eq!(
        message_ids(&queue.drain().await),
        vec![ids[0].to_string(); copies],
        "{then:?}"
    );
    queue.delete().await;
}

/// PostgreSQL: the connection a relay listens on goes silent as it asks to listen (`LISTEN`
/// held forever, the connection open): `run` gives up listening at the lease and polls, and
/// publishes the message once.
#[tokio::test]
async fn a_listen_the_database_never_answers_leaves_the_relay_polling() {
    let fixture = postgres().await;
    let conn = rabbitmq().await;
    let queue = Queue::new(&conn).await;
    let (proxy, silent) = silent_outbox(&fixture, Server::Postgres).await;
    proxy.stall_request(b"LISTEN");
    let relay = Relay::new(silent, publisher(&conn).await)
        .lease(Duration::from_secs(1))
        .poll(Duration::from_millis(50));
    let ids = enqueue(&fixture.outbox, &[order(1, &queue.name)]).await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stopped.await;
            })
            .await
    });

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while fixture
        .outbox
        .inspect(&ids[0])
        .await
        .unwrap()
        .unwrap()
        .state
        != MessageState::Published
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay waited for a database that never answered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(()).unwrap();
    let stats = running.await.unwrap().unwrap();
    assert_eq!((stats.claimed, stats.published), (1, 1), "{stats:?}");
    assert_eq!(
        proxy.stalled(),
        1,
        "the request to listen was not the one held"
    );
    assert_eq!(message_ids(&queue.drain().await), [ids[0].to_string()]);
    queue.delete().await;
}

/// The cases that need a server behind a proxy: PostgreSQL and MariaDB.
macro_rules! silent_cases {
    ($db:ident, $fixture:expr, $server:expr) => {
        mod $db {
            use super::*;

            #[tokio::test]
            async fn a_claim_the_database_never_answers_ends_the_round() {
                super::the_database_goes_silent($fixture, $server, Then::BeforeClaim).await;
            }

            #[tokio::test]
            async fn a_mark_the_database_never_answers_ends_the_round() {
                super::the_database_goes_silent($fixture, $server, Then::Confirm).await;
            }

            #[tokio::test]
            async fn a_failed_attempt_the_database_never_records_ends_the_round() {
                super::the_database_goes_silent($fixture, $server, Then::Refuse).await;
            }

            #[tokio::test]
            async fn a_give_back_the_database_never_answers_ends_the_round() {
                super::the_database_goes_silent($fixture, $server, Then::Unreachable).await;
            }
        }
    };
}

silent_cases!(silent_postgres, postgres().await, Server::Postgres);
silent_cases!(silent_mariadb, mariadb().await, Server::MySql);

/// Every case, on one database.
macro_rules! cases {
    ($db:ident, $fixture:expr) => {
        mod $db {
            use super::*;

            #[tokio::test]
            async fn an_unreadable_row_fails_alone_and_goes_dead() {
                super::an_unreadable_row_fails_alone_and_goes_dead($fixture).await;
            }

            #[tokio::test]
            async fn a_message_too_long_for_the_broker_is_refused_and_never_panics_the_relay() {
                super::a_message_too_long_for_the_broker_is_refused_and_never_panics_the_relay(
                    $fixture,
                )
                .await;
            }

            #[tokio::test]
            async fn durations_of_duration_max_are_clamped() {
                super::durations_of_duration_max_are_clamped($fixture).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stuck_row_is_inspected_and_discarded_by_force() {
                super::a_stuck_row_is_inspected_and_discarded_by_force($fixture).await;
            }
        }
    };
}

cases!(on_postgres, postgres().await);
cases!(on_mariadb, mariadb().await);
cases!(on_sqlite, sqlite().await);
