//! Fixtures of the outbox tests: an outbox in a scratch table of PostgreSQL, MariaDB or
//! SQLite, a RabbitMQ queue of the test's own, messages.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency::outbox::{self, Message, MessageId, Outbox, OutboxDialect};
use idempotency::sql::sqlx::{self, MySqlPool, PgPool, SqlitePool};
use idempotency::store::Token;
use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;

use super::sql_tables::{Scratch, Server};

pub fn unique(prefix: &str) -> String {
    let token = format!("{:?}", Token::generate());
    format!("{prefix}_{}", &token[6..token.len() - 1])
}

pub async fn rabbitmq() -> lapin::Connection {
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

/// An outbox in a table of its own, and what removes it (tables, a database file) on drop.
pub struct Fixture<DB: OutboxDialect> {
    pub outbox: Outbox<DB>,
    // The scratch tables of the outbox and of an idempotency store (or a database file).
    pub _cleanup: Vec<Box<dyn Any>>,
    pub records_table: String,
}

impl<DB: OutboxDialect> Fixture<DB> {
    pub async fn new(pool: sqlx::Pool<DB>, table: &str, cleanup: Vec<Box<dyn Any>>) -> Self {
        let outbox = Outbox::with_table(pool, table).unwrap();
        outbox.create_table().await.unwrap();
        // A second time is harmless.
        outbox.create_table().await.unwrap();
        Fixture {
            outbox,
            _cleanup: cleanup,
            records_table: format!("{table}_r"),
        }
    }
}

pub async fn postgres() -> Fixture<sqlx::Postgres> {
    let table = Scratch::table(Server::Postgres);
    let records = Scratch::table(Server::Postgres);
    let pool = PgPool::connect(table.url()).await.unwrap();
    let name = table.name().to_string();
    let mut fixture = Fixture::new(pool, &name, vec![Box::new(table)]).await;
    fixture.records_table = records.name().to_string();
    fixture._cleanup.push(Box::new(records));
    fixture
}

pub async fn mariadb() -> Fixture<sqlx::MySql> {
    let table = Scratch::table(Server::MySql);
    let records = Scratch::table(Server::MySql);
    let pool = MySqlPool::connect(table.url()).await.unwrap();
    let name = table.name().to_string();
    let mut fixture = Fixture::new(pool, &name, vec![Box::new(table)]).await;
    fixture.records_table = records.name().to_string();
    fixture._cleanup.push(Box::new(records));
    fixture
}

/// A database file in the temporary directory, removed (with its journal files) on drop.
pub struct TempFile(pub std::path::PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut path = self.0.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}

pub async fn sqlite() -> Fixture<sqlx::Sqlite> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let file = TempFile(std::env::temp_dir().join(format!(
        "{}-{}-{}.db",
        unique("outbox"),
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )));
    let pool = SqlitePool::connect(&format!("sqlite:{}?mode=rwc", file.0.display()))
        .await
        .unwrap();
    Fixture::new(pool, "outbox", vec![Box::new(file)]).await
}

/// A RabbitMQ queue of the test's own (deleted on drop), and a publisher routing to it.
pub struct Queue {
    pub channel: lapin::Channel,
    pub name: String,
}

impl Queue {
    pub async fn new(conn: &lapin::Connection) -> Queue {
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
    pub async fn drain(&self) -> Vec<lapin::message::BasicGetMessage> {
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

    pub async fn delete(self) {
        let _ = self
            .channel
            .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

/// Enqueues `messages` in one transaction and commits it through the outbox (which wakes
/// this process's relays on every database).
pub async fn enqueue<DB: OutboxDialect>(
    outbox: &Outbox<DB>,
    messages: &[Message],
) -> Vec<MessageId> {
    let mut tx = outbox.pool().begin().await.unwrap();
    let mut ids = Vec::new();
    for message in messages {
        ids.push(outbox.enqueue(&mut tx, message).await.unwrap());
    }
    outbox.commit(tx).await.unwrap();
    ids
}

pub fn order(n: u32, destination: &str) -> Message {
    Message::new(
        "order",
        format!("A-{n}"),
        "order.created",
        destination,
        format!("{{\"order\":{n}}}").into_bytes(),
    )
    .header("tenant", "acme")
}

pub async fn publisher(conn: &lapin::Connection) -> outbox::rabbitmq::Publisher {
    outbox::rabbitmq::Publisher::new(conn.create_channel().await.unwrap(), "")
        .await
        .unwrap()
}
