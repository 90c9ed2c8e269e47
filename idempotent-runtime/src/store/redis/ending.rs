//! Completions and releases: the `ending.lua` calls, alone and pipelined.

use std::sync::atomic::Ordering;

use ::redis::Value;

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::redis::batch::send_again;
use crate::store::redis::clock::{fast_durations, MIN_FAST_DURATION};
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
                    .filter(|&lease| fast_durations(lease, completion.ttl))?;
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

    /// Ends `items` in one pipeline (to the node of `slot` on a cluster). Items the
    /// server answers `NOSCRIPT`, `MOVED` and the like are sent again one by one.
    pub(super) async fn end_pipelined(
        &self,
        items: &[&Ending],
        slot: u16,
    ) -> Vec<Result<bool, StoreError>> {
        let mut ended: Vec<Option<Result<bool, StoreError>>> = Vec::with_capacity(items.len());
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        let mut sent = 0;
        for item in items {
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
                    sent += 1;
                    ended.push(None);
                }
                Err(err) => ended.push(Some(Err(err))),
            }
        }
        if sent > 0 {
            let replies = self.inner.conn.pipeline(pipe, slot).await;
            if let Err(err) = &replies {
                if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() {
                    self.inner.recheck.store(true, Ordering::Release);
                }
            }
            let mut replies = match replies {
                Ok(replies) => replies.into_iter().map(Ok).collect::<Vec<_>>().into_iter(),
                Err(err) => vec![Err(err); sent].into_iter(),
            };
            for (item, answer) in items.iter().zip(ended.iter_mut()) {
                if answer.is_some() {
                    continue;
                }
                let reply = replies.next().unwrap_or_else(|| {
                    Err(::redis::RedisError::from((
                        ::redis::ErrorKind::Parse,
                        "a pipeline answered fewer replies than it was sent",
                    )))
                });
                *answer = Some(match reply {
                    Err(err) => Err(command_error(err)),
                    Ok(reply) => match (send_again(&reply), reply) {
                        (Some(moved), _) => {
                            if moved {
                                self.inner.slots.invalidate();
                            }
                            match &item.action {
                                End::Complete(completion) => {
                                    self.complete(&item.key, &item.token, completion).await
                                }
                                End::Release => self.release(&item.key, &item.token).await,
                            }
                        }
                        (None, Value::ServerError(err)) => Err(script_error(&item.key, err.into())),
                        (None, reply) => int(&reply).map(|n| n == 1),
                    },
                });
            }
        }
        ended
            .into_iter()
            .map(|answer| {
                answer.unwrap_or_else(|| {
                    Err(StoreError::new(
                        StoreErrorKind::Protocol,
                        "no reply for an ending",
                    ))
                })
            })
            .collect()
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
            .filter(|&lease| self.inner.fast_claims && lease >= MIN_FAST_DURATION)
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
