//! Durable writes ([`RedisStoreBuilder::wait_for_replicas`]): a claim, a renewal or a
//! completion counts only once `n` replicas have it.
//!
//! Each such write is sent in one pipeline with `WAIT n timeout` right behind it, on the same
//! connection, so the `WAIT` covers it: Redis answers `WAIT` once the replicas acknowledged
//! the primary's replication stream up to the connection's last command, and that stream is
//! in the order the primary applied the writes, so a write re-sent after a lost reply (a
//! completion already recorded by its token) is covered too. A `WAIT` on a connection of its
//! own would not be: after a reconnection, or behind Sentinel after a move to another primary,
//! it would count replicas for writes that are not the claim's.
//!
//! What a write that is not known to be replicated means, on each path, so that no failover
//! runs an effect twice:
//!
//! - **Claim.** An acquired claim that fewer than `n` replicas acknowledged in time is given
//!   back (released by its token) and the call fails closed
//!   ([`StoreErrorKind::Unavailable`]): the handler does not run on a claim a failover could
//!   lose. A claim whose reply was lost is given back the same way, rather than read back:
//!   reading it would say it exists, not that it is replicated.
//! - **Renewal.** Not replicated: the renewal fails, and the watchdog treats it as any failed
//!   renewal (it retries, and the lease-loss policy applies if the lease runs out).
//! - **Completion.** Not replicated, or its reply lost: the completion fails with
//!   [`StoreErrorKind::Unavailable`], so the engine retries it in the background (renewing the
//!   lease meanwhile) until a completion and its `WAIT` succeed together; it is never released,
//!   because the effect ran.
//!
//! A batch's items are sent as single durable calls, concurrently on the one connection.

use std::time::Duration;

use ::redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::redis::conn::{script_error, Conn, Lua};
use crate::store::redis::store::RedisStore;
use crate::store::ClaimRequest;

#[cfg(doc)]
use crate::store::redis::RedisStoreBuilder;

impl Conn {
    /// Sends `cmd` (a call of `lua`, when given) and `WAIT replicas timeout` in one pipeline:
    /// `cmd`'s reply (a server error as an error) and how many replicas acknowledged.
    async fn write_waited(
        &self,
        lua: Option<&Lua>,
        cmd: &Cmd,
        (replicas, timeout): (u32, Duration),
    ) -> Result<(Value, i64), RedisError> {
        let send = || async {
            let mut pipe = ::redis::pipe();
            pipe.ignore_errors();
            pipe.add_command(cmd.clone());
            pipe.cmd("WAIT")
                .arg(replicas)
                .arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
            let mut replies = self.pipeline(pipe, 0).await?.into_iter();
            let reply = replies.next().unwrap_or(Value::Nil).extract_error()?;
            let acked = match replies.next() {
                Some(Value::Int(n)) => n,
                _ => 0,
            };
            Ok::<_, RedisError>((reply, acked))
        };
        match send().await {
            Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let Some(lua) = lua else { return Err(err) };
                self.query(::redis::cmd("SCRIPT").arg("LOAD").arg(lua.code()))
                    .await
                    .and_then(Value::extract_error)?;
                send().await
            }
            other => other,
        }
    }
}

/// A write's reply, and whether the replicas the store waits for have it.
pub(super) struct Written {
    pub(super) reply: Value,
    pub(super) replicated: bool,
}

impl RedisStore {
    /// The replicas every claim, renewal and completion waits for, if any.
    pub(super) fn durable(&self) -> Option<(u32, Duration)> {
        self.inner.wait_for_replicas
    }

    /// Sends a write (a call of `lua`, when given): alone, or in durable mode with its
    /// `WAIT`. A server's error reply is an error.
    pub(super) async fn write(&self, lua: Option<&Lua>, cmd: &Cmd) -> Result<Written, RedisError> {
        match self.durable() {
            None => {
                let reply = match lua {
                    Some(lua) => self.inner.conn.eval(lua, cmd).await,
                    None => self
                        .inner
                        .conn
                        .query(cmd)
                        .await
                        .and_then(Value::extract_error),
                };
                let reply = self.answered(reply).await?;
                Ok(Written {
                    reply,
                    replicated: true,
                })
            }
            Some(wait) => {
                let waited = self.inner.conn.write_waited(lua, cmd, wait).await;
                let (reply, acked) = self.answered(waited).await?;
                Ok(Written {
                    reply,
                    replicated: acked >= i64::from(wait.0),
                })
            }
        }
    }

    /// A claim that may be held but is not known to be replicated (its `WAIT` fell short, or
    /// its reply was lost in durable mode): given back by its token, and the call fails
    /// closed.
    pub(super) async fn give_back(&self, req: &ClaimRequest, why: String) -> StoreError {
        if let Err(err) = self.by_token("release", &req.key, &req.token).await {
            tracing::warn!(key = %req.key, error = %err, "cannot give back a claim that was not replicated; it stays until its lease runs out");
        }
        StoreError::new(StoreErrorKind::Unavailable, why)
    }

    /// The error of a durable claim whose reply was lost: given back, failed closed.
    pub(super) async fn claim_unknown(&self, req: &ClaimRequest, err: RedisError) -> StoreError {
        let error = script_error(&req.key, err);
        if self.durable().is_none() || !error.is_outcome_unknown() {
            return error;
        }
        self.give_back(
            req,
            format!(
                "the claim's reply was lost, so its replication is unknown ({error}); given back"
            ),
        )
        .await
    }

    /// The error of a durable renewal or completion whose reply was lost: unavailable (not
    /// applied as far as the caller knows), so that it is sent again with its `WAIT` rather
    /// than read back.
    pub(super) fn write_unknown(&self, key: &Key, err: RedisError) -> StoreError {
        let error = script_error(key, err);
        if self.durable().is_some() && error.is_outcome_unknown() {
            return StoreError::new(
                StoreErrorKind::Unavailable,
                "the write's reply was lost, so its replication is unknown; send it again",
            )
            .with_source(error);
        }
        error
    }

    /// Why a write is not counted: fewer replicas than asked acknowledged it in time.
    pub(super) fn short(&self, what: &str) -> String {
        let (replicas, timeout) = self.durable().unwrap_or_default();
        format!("the {what} was not acknowledged by {replicas} replicas within {timeout:?}")
    }
}
