//! The outbox's table and broker as each simulated relay sees them: its statements and its
//! publications, each with a fate the world decides.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::StoreError;
use crate::outbox::dialect::ReadRow;
use crate::outbox::publish::{PublishError, Publisher};
use crate::outbox::round::RowSource;
use crate::outbox::{MessageId, OutboxMessage};
use crate::store::{BoxFuture, Token};

use super::world::{lock, statement, Fate, State, World};

/// One relay's view of the table.
pub(super) struct Source {
    pub(super) world: Arc<Mutex<World>>,
    pub(super) relay: usize,
}

impl RowSource for Source {
    fn claim<'a>(
        &'a self,
        token: &'a Token,
        lease: Duration,
        batch: u32,
    ) -> BoxFuture<'a, Result<Vec<ReadRow>, StoreError>> {
        Box::pin(statement(&self.world, "claim", move |w| {
            let now = Instant::now();
            w.owner.insert(*token.as_bytes(), self.relay);
            let mut taken = Vec::new();
            for row in &mut w.rows {
                if taken.len() >= batch as usize {
                    break;
                }
                let free = row.claimed_until.is_none_or(|until| until < now);
                if row.state == State::Pending && row.next_at <= now && free {
                    row.token = Some(*token);
                    row.claimed_until = Some(now + lease);
                    row.attempts += 1;
                    taken.push(ReadRow {
                        message: message(&row.id, row.attempts),
                        unreadable: row.unreadable.then(|| "written elsewhere".to_owned()),
                    });
                }
            }
            let relay = self.relay;
            let ids: Vec<String> = taken.iter().map(|r| r.message.id.to_string()).collect();
            w.note(|| format!("relay {relay} claims {ids:?}"));
            taken
        }))
    }

    fn failed<'a>(
        &'a self,
        token: &'a Token,
        id: &'a str,
        _error: &'a str,
        max_attempts: u32,
        backoff: Duration,
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(statement(&self.world, "failed", move |w| {
            let now = Instant::now();
            let key = (*token.as_bytes(), id.to_owned());
            let Some(index) = w
                .rows
                .iter()
                .position(|r| r.id == id && r.token == Some(*token))
            else {
                return 0;
            };
            if !w.unconfirmed.contains(&key) && !w.rows[index].unreadable {
                let relay = self.relay;
                w.violations.push(format!(
                    "relay {relay} recorded a failure of row {id} that no publication of its claim had"
                ));
            }
            let row = &mut w.rows[index];
            row.state = if row.attempts >= max_attempts {
                State::Dead
            } else {
                State::Pending
            };
            row.next_at = now + backoff;
            row.token = None;
            row.claimed_until = None;
            1
        }))
    }

    fn release<'a>(&'a self, token: &'a Token) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(statement(&self.world, "release", move |w| {
            let mut released = 0;
            for row in &mut w.rows {
                if row.token == Some(*token) && row.state == State::Pending {
                    row.attempts = row.attempts.saturating_sub(1);
                    row.token = None;
                    row.claimed_until = None;
                    released += 1;
                }
            }
            released
        }))
    }

    fn published<'a>(
        &'a self,
        token: &'a Token,
        ids: &'a [&'a str],
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(statement(&self.world, "published", move |w| {
            let mut marked = 0;
            for id in ids {
                let key = (*token.as_bytes(), (*id).to_owned());
                if !w.confirmed.contains(&key) {
                    let relay = self.relay;
                    w.violations.push(format!(
                        "relay {relay} marked row {id} published without a confirmation under its claim"
                    ));
                }
                if let Some(row) = w
                    .rows
                    .iter_mut()
                    .find(|r| r.id == *id && r.token == Some(*token))
                {
                    row.state = State::Published;
                    row.token = None;
                    row.claimed_until = None;
                    marked += 1;
                }
            }
            marked
        }))
    }
}

fn message(id: &str, attempts: u32) -> OutboxMessage {
    OutboxMessage {
        id: MessageId::from_string(id.to_owned()),
        aggregate_type: "order".into(),
        aggregate_id: id.to_owned(),
        event_type: "order.created".into(),
        destination: "orders".into(),
        payload: Vec::new(),
        headers: BTreeMap::new(),
        attempts,
    }
}

/// One relay's broker.
pub(super) struct Broker {
    pub(super) world: Arc<Mutex<World>>,
    pub(super) relay: usize,
}

/// Checks, as a publication ends however it ends (dropped at the relay's deadline included),
/// that the claim still holds, and records an unconfirmed end.
pub(super) struct Publishing {
    pub(super) world: Arc<Mutex<World>>,
    pub(super) relay: usize,
    pub(super) id: String,
    pub(super) token: Option<Token>,
    pub(super) confirmed: bool,
}

impl Drop for Publishing {
    fn drop(&mut self) {
        let mut w = lock(&self.world);
        w.check_held(self.relay, &self.id, "ended");
        if let (false, Some(token)) = (self.confirmed, self.token) {
            w.unconfirmed.insert((*token.as_bytes(), self.id.clone()));
        }
    }
}

impl Publisher for Broker {
    fn publish<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            let id = message.id.to_string();
            let copy = message.destination != "orders";
            let (fate, delay, lease, token) = {
                let mut w = lock(&self.world);
                w.check_held(self.relay, &id, "started");
                let token = w.rows.iter().find(|r| r.id == id).and_then(|r| r.token);
                let fate = w.fate(true);
                let relay = self.relay;
                w.note(|| format!("relay {relay} publishes {id} (copy: {copy}): {fate:?}"));
                (fate, w.delay(), w.lease, token)
            };
            let mut publishing = Publishing {
                world: self.world.clone(),
                relay: self.relay,
                id: id.clone(),
                // A dead-letter copy neither confirms nor fails the row.
                token: if copy { None } else { token },
                confirmed: false,
            };
            tokio::time::sleep(delay).await;
            match fate {
                Fate::Refused => Err(PublishError::new("refused")),
                Fate::Unreachable => Err(PublishError::unavailable("unreachable")),
                Fate::NeverAnswered | Fate::AnswerLost => std::future::pending().await,
                Fate::Late | Fate::Answered => {
                    if fate == Fate::Late {
                        tokio::time::sleep(lease).await;
                    }
                    if let (false, Some(token)) = (copy, token) {
                        lock(&self.world)
                            .confirmed
                            .insert((*token.as_bytes(), id.clone()));
                    }
                    publishing.confirmed = true;
                    Ok(())
                }
            }
        })
    }
}
