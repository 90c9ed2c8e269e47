//! Settling one delivery: acknowledge, requeue after a delay, or dead-letter (reject, or
//! park in a retry topology).

use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicNackOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions,
};
use lapin::{BasicProperties, Confirmation};

use super::error::Error;
use super::queue::{deliveries, Parking, Queue};
use crate::broker::{Decision, Redelivery, Settle};

/// Settles `delivery` from its handler's `result`, per the [table](crate::broker): `basic.ack`;
/// `basic.nack` with requeue after holding it for the [`Redelivery`]'s delay; or `basic.reject`
/// without requeue (to the queue's dead-letter exchange). In a
/// [retry topology](Queue::retry_through_dead_letter_exchange) a delivery to redeliver is
/// rejected at once, and one to dead-letter is parked, then acknowledged. `queue` is the
/// queue `delivery` came from. Returns what it did.
///
/// Call it only after the handler returned: the effect is applied (or known to be) before
/// the message is acknowledged.
///
/// # Errors
///
/// [`Error::Amqp`] when the channel failed while settling, [`Error::Unsettled`] when the
/// delivery can no longer be settled (its channel closed, or it was settled before),
/// [`Error::NotParked`] when a dead letter could not be parked. Either way RabbitMQ
/// redelivers the message if it was not acknowledged.
///
/// ```no_run
/// use idempotent_runtime::broker::{rabbitmq, Redelivery};
/// use rabbitmq::{lapin::message::Delivery, Queue};
///
/// # async fn apply(_: &[u8]) -> Result<(), idempotent_runtime::Error> { Ok(()) }
/// async fn on_delivery(delivery: Delivery, queue: &Queue, redelivery: &Redelivery) -> Result<(), rabbitmq::Error> {
///     let result = apply(&delivery.data).await;
///     let decision = rabbitmq::settle(&delivery, queue, &result, redelivery).await?;
///     println!("delivery {} -> {decision}", delivery.delivery_tag);
///     Ok(())
/// }
/// ```
pub async fn settle<T, E: Settle>(
    delivery: &Delivery,
    queue: &Queue,
    result: &Result<T, E>,
    redelivery: &Redelivery,
) -> Result<Decision, Error> {
    let decision = redelivery.decide(result, deliveries(delivery, queue));
    match decision {
        Decision::Ack => ack(delivery).await?,
        Decision::Redeliver { delay } => redeliver(delivery, queue, delay).await?,
        Decision::DeadLetter => dead_letter(delivery, queue).await?,
    }
    Ok(decision)
}

pub(super) async fn ack(delivery: &Delivery) -> Result<(), Error> {
    let settled = delivery.acker.ack(BasicAckOptions::default()).await?;
    settled_or_not(settled, delivery)
}

pub(super) async fn redeliver(
    delivery: &Delivery,
    queue: &Queue,
    delay: Duration,
) -> Result<(), Error> {
    let settled = if queue.parking.is_some() {
        // Through the dead-letter exchange to the retry queue, which holds it for its TTL.
        delivery
            .acker
            .reject(BasicRejectOptions { requeue: false })
            .await?
    } else {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        delivery.acker.nack(requeue()).await?
    };
    settled_or_not(settled, delivery)
}

pub(super) async fn dead_letter(delivery: &Delivery, queue: &Queue) -> Result<(), Error> {
    let settled = match &queue.parking {
        Some(parking) => match park(parking, &delivery.data, &delivery.properties).await {
            Ok(true) => delivery.acker.ack(BasicAckOptions::default()).await?,
            parked => {
                // Not lost: back to the queue, to be parked on a later delivery.
                delivery.acker.nack(requeue()).await?;
                return Err(parked.err().unwrap_or(Error::NotParked {
                    delivery_tag: delivery.delivery_tag,
                }));
            }
        },
        None => {
            delivery
                .acker
                .reject(BasicRejectOptions { requeue: false })
                .await?
        }
    };
    settled_or_not(settled, delivery)
}

fn settled_or_not(settled: bool, delivery: &Delivery) -> Result<(), Error> {
    if settled {
        Ok(())
    } else {
        Err(Error::Unsettled {
            delivery_tag: delivery.delivery_tag,
        })
    }
}

fn requeue() -> BasicNackOptions {
    BasicNackOptions {
        multiple: false,
        requeue: true,
    }
}

/// Publishes a dead letter to the parking queue and waits for RabbitMQ's confirmation;
/// `false` when RabbitMQ refused it or could not route it.
async fn park(parking: &Parking, data: &[u8], properties: &BasicProperties) -> Result<bool, Error> {
    if !parking.channel.status().confirm() {
        parking
            .channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
    }
    let mandatory = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let confirmation = parking
        .channel
        .basic_publish(
            parking.exchange.as_str().into(),
            parking.routing_key.as_str().into(),
            mandatory,
            data,
            properties.clone(),
        )
        .await?
        .await?;
    Ok(match confirmation {
        Confirmation::Ack(returned) => returned.is_none(),
        Confirmation::Nack(_) | Confirmation::NotRequested => false,
    })
}
