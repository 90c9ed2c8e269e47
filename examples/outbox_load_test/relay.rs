//! `--relay`: one outbox relay process. It publishes the run's outbox through RabbitMQ
//! (publisher confirms) or NATS JetStream until its stdin closes, and reports every
//! publication on stdout, one line each, so the parent counts them even for a relay it
//! killed:
//!
//! - `sending <id>` before a publication, `confirmed <id>` once the broker confirmed it,
//!   `failed <id> <error>` when it did not;
//! - `held <id>`: after a `hold` line on stdin, the next confirmed publication is held
//!   before it returns, so the relay never marks that row: the parent kills the process
//!   there, between the broker's confirmation and the mark;
//! - `connection-lost <error>`: the broker closed the connection; the relay finishes its
//!   round (its publications fail, and are retried later) and exits with status 3 (the
//!   parent starts another).

use std::io::BufRead;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_util::StreamExt;
use idempotency::outbox::{
    self, Outbox, OutboxMessage, PostgresOutbox, PublishError, Publisher, Relay,
};
use idempotency::store::BoxFuture;
use lapin::{Connection, ConnectionProperties};
use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;

use crate::{
    report, BoxError, Broker, Setup, EXIT_CONNECTION_LOST, RELAY_BATCH, RELAY_LEASE, RELAY_POLL,
};

/// Why the relay stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Running,
    /// Stdin closed: the parent stops the run.
    Asked,
    /// The broker closed the connection.
    ConnectionLost,
}

/// A publisher that reports each publication and, once asked, holds after a confirmation.
struct Reporting<P> {
    inner: P,
    hold: Arc<AtomicBool>,
}

impl<P: Publisher> Publisher for Reporting<P> {
    fn publish<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            let id = message.id.as_str();
            report(format_args!("sending {id}"));
            let published = self.inner.publish(message).await;
            match &published {
                Ok(()) => report(format_args!("confirmed {id}")),
                Err(err) => report(format_args!("failed {id} {err}")),
            }
            if published.is_ok() && self.hold.swap(false, Ordering::SeqCst) {
                // The broker has the message; the relay has not marked its row. Stay here
                // until the parent's SIGKILL.
                report(format_args!("held {id}"));
                std::future::pending::<()>().await;
            }
            published
        })
    }
}

/// The relay process; returns its exit status.
pub(crate) async fn run(setup: &Setup) -> Result<i32, BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .connect(&setup.business_url)
        .await?;
    let outbox = Outbox::with_table(pool, &setup.outbox_table())?;
    let hold = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = watch::channel(Stop::Running);
    let stop_tx = Arc::new(stop_tx);

    // Stdin: `hold` lines, then EOF when the parent stops the run.
    {
        let (hold, stop_tx) = (hold.clone(), stop_tx.clone());
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                if line.trim() == "hold" {
                    hold.store(true, Ordering::SeqCst);
                }
            }
            stop_tx.send_if_modified(|stop| set(stop, Stop::Asked));
        });
    }

    match setup.broker {
        Broker::RabbitMq => {
            let name = setup.connection_name("relay");
            let conn = Connection::connect(
                &setup.amqp_url,
                ConnectionProperties::default().with_connection_name(name.as_str().into()),
            )
            .await?;
            watch_connection(&conn, stop_tx.clone());
            let channel = conn.create_channel().await?;
            let publisher = outbox::rabbitmq::Publisher::new(channel.clone(), "").await?;
            relay(outbox, publisher, hold, stop_rx.clone()).await?;
            if *stop_rx.borrow() != Stop::ConnectionLost {
                let _ = channel.close(200, "relay stopped".into()).await;
                let _ = conn.close(200, "relay stopped".into()).await;
            }
        }
        Broker::Nats => {
            let client = async_nats::connect(&setup.nats_url).await?;
            let publisher =
                outbox::nats::Publisher::new(async_nats::jetstream::new(client.clone()));
            relay(outbox, publisher, hold, stop_rx.clone()).await?;
            let _ = client.flush().await;
        }
    }
    let stopped = *stop_rx.borrow();
    Ok(match stopped {
        Stop::ConnectionLost => EXIT_CONNECTION_LOST,
        _ => 0,
    })
}

async fn relay<P: Publisher>(
    outbox: PostgresOutbox,
    publisher: P,
    hold: Arc<AtomicBool>,
    mut stop: watch::Receiver<Stop>,
) -> Result<(), BoxError> {
    let relay = Relay::new(
        outbox,
        Reporting {
            inner: publisher,
            hold,
        },
    )
    .lease(RELAY_LEASE)
    .batch(RELAY_BATCH)
    .poll(RELAY_POLL);
    let stopped = async move {
        let _ = stop.wait_for(|stop| *stop != Stop::Running).await;
    };
    relay.run(stopped).await?;
    Ok(())
}

/// Sets `stop` to `to` unless it is set already; whether it changed.
fn set(stop: &mut Stop, to: Stop) -> bool {
    if *stop == Stop::Running {
        *stop = to;
        true
    } else {
        false
    }
}

/// Reports a connection the broker closed, and stops the relay.
fn watch_connection(conn: &Connection, stop_tx: Arc<watch::Sender<Stop>>) {
    let mut events = conn.events_listener();
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            if let lapin::Event::Error(err) = event {
                report(format_args!("connection-lost {err}"));
                stop_tx.send_if_modified(|stop| set(stop, Stop::ConnectionLost));
                return;
            }
        }
    });
}
