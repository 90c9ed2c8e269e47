//! The parent's side of the broker: the run's durable queue (RabbitMQ) or stream and
//! durable pull consumer (NATS JetStream), what is still outstanding in them, the broker's
//! own counts for the report, cutting a client's connection, and the clean-up.

use std::process::Command;

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, stream};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};

use crate::{redact, BoxError, Broker, Setup, NATS_ACK_WAIT};

pub(crate) enum Admin {
    RabbitMq {
        conn: Connection,
        channel: Channel,
        queue: String,
        dead: String,
    },
    Nats {
        js: jetstream::Context,
        stream: String,
        durable: String,
    },
}

impl Admin {
    /// Connects and creates the run's queue (a durable quorum queue, with a dead-letter
    /// queue) or stream and consumer. The error names the missing service.
    pub(crate) async fn create(setup: &Setup) -> Result<Admin, BoxError> {
        match setup.broker {
            Broker::RabbitMq => {
                let conn = Connection::connect(
                    &setup.amqp_url,
                    ConnectionProperties::default()
                        .with_connection_name(setup.connection_name("admin").as_str().into()),
                )
                .await
                .map_err(|e| {
                    format!(
                        "RabbitMQ is not reachable at {} ({e}); start it with `rabbitmq-server -detached`",
                        redact(&setup.amqp_url)
                    )
                })?;
                let channel = conn.create_channel().await?;
                let queue = setup.destination.clone();
                let dead = format!("{queue}.dead");
                let durable = QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                };
                channel
                    .queue_declare(dead.as_str().into(), durable, FieldTable::default())
                    .await?;
                let mut args = FieldTable::default();
                args.insert(
                    "x-queue-type".into(),
                    AMQPValue::LongString("quorum".into()),
                );
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
                    .await?;
                Ok(Admin::RabbitMq {
                    conn,
                    channel,
                    queue,
                    dead,
                })
            }
            Broker::Nats => {
                let client = async_nats::connect(&setup.nats_url).await.map_err(|e| {
                    format!(
                        "NATS is not reachable at {} ({e}); start it with JetStream enabled: `nats-server -js`",
                        setup.nats_url
                    )
                })?;
                let js = jetstream::new(client);
                let stream = js
                    .create_stream(stream::Config {
                        name: setup.stream.clone(),
                        subjects: vec![setup.destination.clone()],
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| {
                        format!(
                            "NATS at {} did not create a JetStream stream ({e}); is JetStream enabled? Start the server with `nats-server -js`",
                            setup.nats_url
                        )
                    })?;
                stream
                    .create_consumer(pull::Config {
                        durable_name: Some(setup.durable.clone()),
                        ack_policy: AckPolicy::Explicit,
                        ack_wait: NATS_ACK_WAIT,
                        ..Default::default()
                    })
                    .await?;
                Ok(Admin::Nats {
                    js,
                    stream: setup.stream.clone(),
                    durable: setup.durable.clone(),
                })
            }
        }
    }

    /// What the broker says is still to be delivered or acknowledged: on RabbitMQ the
    /// queue's ready messages (the unacknowledged ones are not counted: stop the consumers
    /// first to have them back), on NATS the consumer's pending and unacknowledged ones.
    pub(crate) async fn outstanding(&self) -> Result<u64, BoxError> {
        match self {
            Admin::RabbitMq { channel, queue, .. } => Ok(u64::from(
                channel
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions::default().passive(),
                        FieldTable::default(),
                    )
                    .await?
                    .message_count(),
            )),
            Admin::Nats {
                js,
                stream,
                durable,
            } => {
                let info = js
                    .get_consumer_from_stream::<pull::Config, _, _>(durable, stream)
                    .await?
                    .get_info()
                    .await?;
                Ok(info.num_pending + info.num_ack_pending as u64)
            }
        }
    }

    /// Messages the consumers dead-lettered (RabbitMQ's dead-letter queue); `None` on NATS,
    /// where a terminated message is not kept anywhere.
    pub(crate) async fn dead_lettered(&self) -> Result<Option<u64>, BoxError> {
        match self {
            Admin::RabbitMq { channel, dead, .. } => Ok(Some(u64::from(
                channel
                    .queue_declare(
                        dead.as_str().into(),
                        QueueDeclareOptions::default().passive(),
                        FieldTable::default(),
                    )
                    .await?
                    .message_count(),
            ))),
            Admin::Nats { .. } => Ok(None),
        }
    }

    /// Messages the stream stored (NATS: its duplicate window drops a second publication of
    /// a `Nats-Msg-Id`); `None` on RabbitMQ, which keeps no such count for a queue.
    pub(crate) async fn stored(&self) -> Result<Option<u64>, BoxError> {
        match self {
            Admin::RabbitMq { .. } => Ok(None),
            Admin::Nats { js, stream, .. } => {
                let info = js.get_stream(stream).await?.get_info().await?;
                Ok(Some(info.state.messages))
            }
        }
    }

    /// Deletes the queues or the stream (and its consumer).
    pub(crate) async fn delete(self) {
        match self {
            Admin::RabbitMq {
                conn,
                channel,
                queue,
                dead,
            } => {
                for name in [&queue, &dead] {
                    let _ = channel
                        .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
                let _ = channel.close(200, "done".into()).await;
                let _ = conn.close(200, "done".into()).await;
            }
            Admin::Nats { js, stream, .. } => {
                let _ = js.delete_stream(&stream).await;
            }
        }
    }
}

/// Closes the RabbitMQ connection whose client named itself `name`, from the broker's side
/// (`rabbitmqctl close_connection`), as a broker restart or a load balancer would: the
/// client sees its connection closed under it. Needs `rabbitmqctl` on this machine, allowed
/// to reach the node (root, or the `rabbitmq` user).
pub(crate) fn cut_connection(name: &str) -> Result<(), String> {
    let listed = Command::new("rabbitmqctl")
        .args([
            "--quiet",
            "list_connections",
            "--no-table-headers",
            "pid",
            "client_properties",
        ])
        .output()
        .map_err(|e| format!("cannot run rabbitmqctl ({e})"))?;
    if !listed.status.success() {
        return Err(format!(
            "rabbitmqctl list_connections failed: {}",
            String::from_utf8_lossy(&listed.stderr).trim()
        ));
    }
    // One line per connection: its pid (`<rabbit@host.1.2.0>`), a tab, its client
    // properties, the connection name among them as a quoted string.
    let listed = String::from_utf8_lossy(&listed.stdout);
    let quoted = format!("\"{name}\"");
    let pid = listed
        .lines()
        .find(|line| line.contains(&quoted))
        .and_then(|line| line.split('\t').next())
        .ok_or_else(|| format!("RabbitMQ lists no connection named {name}"))?;
    let closed = Command::new("rabbitmqctl")
        .args([
            "--quiet",
            "close_connection",
            pid,
            "outbox load test: connection cut",
        ])
        .output()
        .map_err(|e| format!("cannot run rabbitmqctl ({e})"))?;
    if !closed.status.success() {
        return Err(format!(
            "rabbitmqctl close_connection failed: {}",
            String::from_utf8_lossy(&closed.stderr).trim()
        ));
    }
    Ok(())
}
