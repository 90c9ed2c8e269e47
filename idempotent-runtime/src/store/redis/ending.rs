//! Completions and releases: the `ending.lua` calls, alone and pipelined.

use std::sync::atomic::Ordering;

use ::redis::Value;

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::redis::batch::{no_script, send_again};
use crate::store::redis::claim::SHORT_PIPELINE;
use crate::store::redis::conn::{command_error, script_error};
use crate::store::redis::store::RedisStore;
use crate::store::redis::wire::{fast_completion, fast_release, in_progress_head, int};
use crate::store::{clamped_millis, AcquiredClaim, Completion, End, Ending, Store, Token};

impl RedisStore {
    /// The `ending.lua` call of a completion; a result larger than the store takes is
    /// refused before it is sent.
    pub(super) fn complete_cmd(
        &self,
        key: &Key,
        token: &Token,
        completion: &Completion,
    ) -> Result<::redis::Cmd, StoreError> {
        let result: &[u8] = completion.result.as_deref().unwrap_or_default();
        if result.len() > self.inner.max_result_size {
            // Never sent: an argument above `proto-max-bulk-len` closes the connection.
            return Err(StoreError::new(
                StoreErrorKind::Rejected,
                format!(
                    "a result of {} bytes for `{key}` is larger than this store takes ({} bytes)",
                    result.len(),
                    self.inner.max_result_size
                ),
            ));
        }
        let ttl = clamped_millis(completion.ttl);
        let mut cmd = self.inner.ending.call(key.as_bytes());
        // A claim this store's fast claim may have written: the owner writes that record
        // again and the completed one, and the script compares and sets (three arguments).
        let fast = completion
            .claim
            .as_ref()
            .filter(|_| self.inner.fast_claims)
            .and_then(|claim| {
                let lease = claim
                    .lease
                    .filter(|&lease| self.inner.clock.fast_durations(lease, completion.ttl))?;
                fast_completion(token, claim, clamped_millis(lease), result)
            });
        if let Some((claimed, completed)) = fast {
            cmd.arg(ttl).arg(claimed).arg(completed);
            return Ok(cmd);
        }
        cmd.arg("complete")
            .arg(token.as_bytes())
            .arg(ttl)
            .arg(result);
        if let Some(head) = completion
            .claim
            .as_ref()
            .and_then(|claim| in_progress_head(token, claim))
        {
            cmd.arg(head);
        }
        Ok(cmd)
    }

    /// Ends `items` in one pipeline (to the node of `slot` on a cluster). When the server
    /// answers `NOSCRIPT` (a restart, a failover, `SCRIPT FLUSH`), the script is loaded and
    /// those items are sent again in one more pipeline. Items a cluster node does not serve
    /// (`MOVED` and the like), and on a cluster those answered `NOSCRIPT`, are sent again one
    /// by one.
    pub(super) async fn end_pipelined(
        &self,
        items: &[&Ending],
        slot: u16,
    ) -> Vec<Result<bool, StoreError>> {
        let ended = self
            .reloading(&self.inner.ending, items, |sent| async move {
                self.end_pipelined_once(&sent, slot).await
            })
            .await;
        let mut answers = Vec::with_capacity(items.len());
        for (item, answer) in items.iter().zip(ended) {
            answers.push(match answer {
                Some(answer) => answer,
                // Sent again alone (with its own `WAIT` in durable mode).
                None => match &item.action {
                    End::Complete(completion) => {
                        self.complete(&item.key, &item.token, completion).await
                    }
                    End::Release => self.release(&item.key, &item.token).await,
                },
            });
        }
        answers
    }

    /// One pipeline of endings: each item's answer (`None` where it must be sent again), and
    /// the positions the server answered `NOSCRIPT`. In durable mode, a completion the
    /// pipeline's `WAIT` did not cover, or whose reply was lost, is unavailable (sent again
    /// with its `WAIT`, never taken as applied).
    async fn end_pipelined_once(
        &self,
        items: &[&Ending],
        slot: u16,
    ) -> (Vec<Option<Result<bool, StoreError>>>, Vec<usize>) {
        let mut ended: Vec<Option<Result<bool, StoreError>>> = Vec::with_capacity(items.len());
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        let mut sent = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let cmd = match &item.action {
                End::Complete(completion) => self.complete_cmd(&item.key, &item.token, completion),
                End::Release => {
                    let mut cmd = self.inner.ending.call(item.key.as_bytes());
                    cmd.arg("release").arg(item.token.as_bytes());
                    Ok(cmd)
                }
            };
            match cmd {
                Ok(cmd) => {
                    pipe.add_command(cmd);
                    sent.push(i);
                    ended.push(None);
                }
                Err(err) => ended.push(Some(Err(err))),
            }
        }
        let mut unloaded = Vec::new();
        if sent.is_empty() {
            return (ended, unloaded);
        }
        let replies = self.pipeline_waited(pipe, slot).await;
        if let Err(err) = &replies {
            if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() {
                self.inner.recheck.store(true, Ordering::Release);
            }
        }
        let (replies, replicated) = match replies {
            Ok((replies, replicated)) => (replies.into_iter().map(Ok).collect(), replicated),
            Err(err) => (vec![Err(err); sent.len()], false),
        };
        let mut replies = replies.into_iter();
        for i in sent {
            let item = items[i];
            let reply = replies.next().unwrap_or_else(|| {
                Err(::redis::RedisError::from((
                    ::redis::ErrorKind::Parse,
                    SHORT_PIPELINE,
                )))
            });
            let completion = matches!(item.action, End::Complete(_));
            ended[i] = match reply {
                // Not known to be applied, in durable mode: sent again with its `WAIT`.
                Err(err) if completion => Some(Err(self.write_unknown(&item.key, err))),
                Err(err) => Some(Err(command_error(err))),
                Ok(reply) if no_script(&reply) => {
                    unloaded.push(i);
                    None
                }
                Ok(reply) => match (send_again(&reply), reply) {
                    (Some(moved), _) => {
                        if moved {
                            self.inner.slots.invalidate();
                        }
                        None
                    }
                    (None, Value::ServerError(err)) => {
                        Some(Err(script_error(&item.key, err.into())))
                    }
                    (None, reply) => Some(match int(&reply).map(|n| n == 1) {
                        // A completion its `WAIT` did not cover is not counted.
                        Ok(true) if completion && !replicated => Err(StoreError::new(
                            StoreErrorKind::Unavailable,
                            self.short("completion"),
                        )),
                        other => other,
                    }),
                },
            };
        }
        (ended, unloaded)
    }

    /// Releases `claim`, which `token` acquired: where this store's fast claim may have
    /// written it, the script compares the record with the one that claim wrote and, if it
    /// is unchanged (not renewed since), writes the released record the owner sent; any
    /// other value is released by token, as [`release`](Store::release) does.
    pub(super) async fn release_claim(
        &self,
        key: &Key,
        token: &Token,
        claim: &AcquiredClaim,
    ) -> Result<bool, StoreError> {
        let fast = claim
            .lease
            .filter(|&lease| {
                self.inner.fast_claims && lease >= self.inner.clock.min_fast_duration()
            })
            .and_then(|lease| fast_release(token, claim, clamped_millis(lease)));
        let Some((both, released)) = fast else {
            return self.by_token("release", key, token).await;
        };
        let (claimed, released) = both.split_at(released);
        let mut cmd = self.inner.ending.call(key.as_bytes());
        cmd.arg("release")
            .arg(token.as_bytes())
            .arg(claimed)
            .arg(released);
        Ok(int(&self.call(key, &self.inner.ending, &cmd).await?)? == 1)
    }

    /// Runs `ending.lua`'s token-only operation `op` (`release`, `reopen`) on `key`.
    pub(super) async fn by_token(
        &self,
        op: &'static str,
        key: &Key,
        token: &Token,
    ) -> Result<bool, StoreError> {
        let mut cmd = self.inner.ending.call(key.as_bytes());
        cmd.arg(op).arg(token.as_bytes());
        Ok(int(&self.call(key, &self.inner.ending, &cmd).await?)? == 1)
    }
}
