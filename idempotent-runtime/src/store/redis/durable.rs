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
//! A batch's claims or endings are sent in one pipeline with one `WAIT` behind them, whose
//! verdict is every item's: Redis answers a connection's commands in order and a `WAIT` holds
//! the connection until it is answered, so a `WAIT` per item would make the items wait one
//! after the other (a batch of 100 with a replica down would take 100 times the timeout, past
//! the response timeout, and the give-backs queued behind them with it). An item the pipeline
//! could not decide (a script the server had flushed, a released record the fast claim leaves
//! to the script) is sent again in a later pipeline or alone, with a `WAIT` of its own.

use std::time::Duration;

use ::redis::{Cmd, Pipeline, RedisError, Value};

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::redis::batch::no_script;
use crate::store::redis::conn::{is_no_script, script_error, Conn, Lua, SCRIPT_SENDS};
use crate::store::redis::store::RedisStore;
use crate::store::{BoxFuture, Claim, ClaimRequest};

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
            add_wait(&mut pipe, (replicas, timeout));
            let mut replies = self.pipeline(pipe, 0).await?.into_iter();
            let reply = replies.next().unwrap_or(Value::Nil).extract_error()?;
            let acked = match replies.next() {
                Some(Value::Int(n)) => n,
                _ => 0,
            };
            Ok::<_, RedisError>((reply, acked))
        };
        let mut sends = 1;
        loop {
            match (send().await, lua) {
                (Err(err), Some(lua)) if is_no_script(&err) && sends < SCRIPT_SENDS => {
                    self.load(lua).await?;
                    sends += 1;
                }
                (other, _) => return other,
            }
        }
    }
}

/// Adds `WAIT replicas timeout` to `pipe`.
fn add_wait(pipe: &mut Pipeline, (replicas, timeout): (u32, Duration)) {
    pipe.cmd("WAIT")
        .arg(replicas)
        .arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
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
                // Boxed: the pipeline with its `WAIT` is a large future, and every claim and
                // completion holds this one; a durable write waits for replicas anyway.
                let waited = Box::pin(self.inner.conn.write_waited(lua, cmd, wait)).await;
                let (reply, acked) = self.answered(waited).await?;
                Ok(Written {
                    reply,
                    replicated: acked >= i64::from(wait.0),
                })
            }
        }
    }

    /// Sends a batch's pipeline of writes (to the node of `slot` on a cluster): their replies,
    /// and whether the replicas the store waits for have them all. In durable mode one `WAIT`
    /// follows the writes in the same pipeline and covers them all; a pipeline that answered
    /// fewer replies than it was sent counts as not replicated.
    pub(super) async fn pipeline_waited(
        &self,
        mut pipe: Pipeline,
        slot: u16,
    ) -> Result<(Vec<Value>, bool), RedisError> {
        let Some(wait) = self.durable() else {
            let replies = self.inner.conn.pipeline(pipe, slot).await?;
            return Ok((replies, true));
        };
        let writes = pipe.len();
        add_wait(&mut pipe, wait);
        let mut replies = self.inner.conn.pipeline(pipe, slot).await?;
        let acked = match replies.len() == writes + 1 {
            true => match replies.pop() {
                Some(Value::Int(n)) => n,
                _ => 0,
            },
            false => 0,
        };
        Ok((replies, acked >= i64::from(wait.0)))
    }

    /// Sends a batch's `items` in pipelines of calls of `lua`: `once` sends the items it is
    /// given and answers each (`None` where the item must be sent again alone), with the
    /// positions the server answered `NOSCRIPT`. When the server does not have the script (a
    /// restart, a failover, `SCRIPT FLUSH`), it is loaded once and those items are sent again
    /// in one more pipeline; on a cluster, or if the load fails, they are left unanswered,
    /// to be sent alone.
    pub(super) async fn reloading<'i, I, T, F, Fut>(
        &self,
        lua: &Lua,
        items: &[&'i I],
        mut once: F,
    ) -> Vec<Option<T>>
    where
        F: FnMut(Vec<&'i I>) -> Fut,
        Fut: std::future::Future<Output = (Vec<Option<T>>, Vec<usize>)>,
    {
        let mut answers: Vec<Option<T>> = items.iter().map(|_| None).collect();
        let mut pending: Vec<usize> = (0..items.len()).collect();
        let mut loaded = false;
        while !pending.is_empty() {
            let (decided, unloaded) = once(pending.iter().map(|&i| items[i]).collect()).await;
            let unloaded: Vec<usize> = unloaded.into_iter().map(|at| pending[at]).collect();
            for (&i, answer) in pending.iter().zip(decided) {
                answers[i] = answer;
            }
            let reload = !loaded
                && !unloaded.is_empty()
                && !self.inner.conn.is_cluster()
                && self.inner.conn.load(lua).await.is_ok();
            loaded = true;
            pending = if reload { unloaded } else { Vec::new() };
        }
        answers
    }

    /// In durable mode, the claims one batch pipeline decided (`None` for an item it left to
    /// a later call, which settles it): an acquired claim its pipeline's `WAIT` did not cover
    /// (`replicated` false) and a claim whose reply was lost are given back, all in one
    /// pipeline, and fail closed. Other answers stand.
    pub(super) async fn settle_claims(
        &self,
        reqs: &[&ClaimRequest],
        claims: &mut [Option<Result<Claim, StoreError>>],
        replicated: bool,
    ) {
        if self.durable().is_none() {
            return;
        }
        let mut given: Vec<&ClaimRequest> = Vec::new();
        for (req, claim) in reqs.iter().zip(claims.iter_mut()) {
            let why = match claim {
                Some(Ok(Claim::Acquired { .. })) if !replicated => self.short("claim"),
                Some(Err(err)) if err.is_outcome_unknown() => format!(
                    "the claim's reply was lost, so its replication is unknown ({err}); given back"
                ),
                _ => continue,
            };
            given.push(req);
            *claim = Some(Err(StoreError::new(StoreErrorKind::Unavailable, why)));
        }
        self.give_back_all(&given).await;
    }

    /// Releases `reqs`' claims by their tokens in one pipeline (and one more after loading a
    /// script the server did not have). A claim the pipeline did not release (its connection
    /// failed, or the server refused) is not sent again one by one, which on a silent
    /// connection would wait out the reply timeout once per item: its key stays held until
    /// its lease runs out, and the call has failed closed all the same.
    async fn give_back_all(&self, reqs: &[&ClaimRequest]) {
        if reqs.is_empty() {
            return;
        }
        let released = self
            .reloading(&self.inner.ending, reqs, |sent| async move {
                let mut pipe = ::redis::pipe();
                pipe.ignore_errors();
                for req in &sent {
                    let mut cmd = self.inner.ending.call(req.key.as_bytes());
                    cmd.arg("release").arg(req.token.as_bytes());
                    pipe.add_command(cmd);
                }
                let replies = match self.inner.conn.pipeline(pipe, 0).await {
                    Ok(replies) => replies,
                    Err(err) => {
                        let why = Some(Err(err.to_string()));
                        return (sent.iter().map(|_| why.clone()).collect(), Vec::new());
                    }
                };
                let mut unloaded = Vec::new();
                let mut replies = replies.into_iter();
                let answers = (0..sent.len())
                    .map(|i| match replies.next() {
                        Some(Value::Int(_)) => Some(Ok(())),
                        Some(reply) if no_script(&reply) => {
                            unloaded.push(i);
                            None
                        }
                        Some(other) => Some(Err(format!("{other:?}"))),
                        None => Some(Err("no reply".to_owned())),
                    })
                    .collect();
                (answers, unloaded)
            })
            .await;
        for (req, released) in reqs.iter().zip(released) {
            let why = match released {
                Some(Ok(())) => continue,
                Some(Err(why)) => why,
                None => "the server does not have the script".to_owned(),
            };
            tracing::warn!(key = %req.key, error = %why, "cannot give back a claim that was not replicated; it stays until its lease runs out");
        }
    }

    /// A claim that may be held but is not known to be replicated (its `WAIT` fell short, or
    /// its reply was lost in durable mode): given back by its token, and the call fails
    /// closed.
    ///
    /// Boxed: only a durable claim gives back, and every claim's future would hold this one.
    pub(super) fn give_back<'a>(
        &'a self,
        req: &'a ClaimRequest,
        why: String,
    ) -> BoxFuture<'a, StoreError> {
        Box::pin(async move {
            if let Err(err) = self.by_token("release", &req.key, &req.token).await {
                tracing::warn!(key = %req.key, error = %err, "cannot give back a claim that was not replicated; it stays until its lease runs out");
            }
            StoreError::new(StoreErrorKind::Unavailable, why)
        })
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
