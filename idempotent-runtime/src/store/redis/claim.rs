//! Claims: the fast claim (`SET ... NX GET`) and the server's clock it is decided by,
//! claims by script, and the pipelines of a batch.

use std::sync::atomic::Ordering;
use std::time::Duration;

use ::redis::Value;

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::redis::batch::{no_script, send_again};
use crate::store::redis::clock::Estimate;
use crate::store::redis::conn::{command_error, script_error, Conn};
use crate::store::redis::store::completed_reply;
use crate::store::redis::store::RedisStore;
use crate::store::redis::wire::{claim_cmd, decode_claim, fast_claim_record, parse_record};
use crate::store::Store as _;
use crate::store::{claim_answer, clamped_millis, Claim, ClaimAnswer, ClaimRequest, RecordState};

impl RedisStore {
    /// Every claim in one pipeline: one round trip where the fast claim decides them all. With
    /// the fast claim on (see [`fast_claim`](Self::fast_claim)), the pipeline is of `SET ... NX
    /// GET`s and the items they cannot decide (a released record, a run-out lease, a value that
    /// is no record) follow in a second pipeline of scripts; otherwise it is of scripts.
    pub(super) async fn claim_pipelined(
        &self,
        reqs: &[&ClaimRequest],
        slot: u16,
    ) -> Vec<Result<Claim, StoreError>> {
        match self.claim_fast_pipelined(reqs).await {
            Some(claims) => claims,
            None => self.claim_scripted(reqs, slot).await,
        }
    }

    /// The fast claims of a batch, as one pipeline of `SET ... NX GET`s, then the script for
    /// the items they leave undecided; `None` when the fast claim does not apply now.
    async fn claim_fast_pipelined(
        &self,
        reqs: &[&ClaimRequest],
    ) -> Option<Vec<Result<Claim, StoreError>>> {
        if !self.inner.fast_claims {
            return None;
        }
        let now = std::time::Instant::now();
        self.refresh_clock(now);
        self.inner.clock.of_server(self.inner.conn.generation());
        let at = self.inner.clock.estimate(now)?;
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        let mut fast = Vec::with_capacity(reqs.len());
        for req in reqs {
            let cmd = self
                .inner
                .clock
                .fast_durations(req.lease, req.ttl)
                .then(|| fast_claim_cmd(req, at))
                .flatten();
            fast.push(cmd.is_some());
            if let Some(cmd) = cmd {
                pipe.add_command(cmd);
            }
        }
        let (mut replies, replicated) = if fast.iter().any(|&f| f) {
            match self.pipeline_waited(pipe, 0).await {
                Ok((replies, replicated)) => (replies.into_iter(), replicated),
                Err(err) => {
                    if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() {
                        self.inner.recheck.store(true, Ordering::Release);
                    }
                    // Every item may have been applied: each is resolved by token (given
                    // back, in durable mode).
                    let mut claims: Vec<_> = reqs
                        .iter()
                        .map(|req| Some(Err(script_error(&req.key, err.clone()))))
                        .collect();
                    self.settle_claims(reqs, &mut claims, false).await;
                    return Some(claims.into_iter().map(answered).collect());
                }
            }
        } else {
            (Vec::new().into_iter(), true)
        };
        let mut claims: Vec<Option<Result<Claim, StoreError>>> = Vec::with_capacity(reqs.len());
        let mut scripted = Vec::new();
        for (req, fast) in reqs.iter().zip(fast) {
            let decided = if fast {
                match replies.next() {
                    Some(Value::ServerError(err)) if err.code() == "WRONGTYPE" => None,
                    Some(Value::ServerError(err)) => Some(Err(script_error(&req.key, err.into()))),
                    Some(reply) => fast_claim_reply(req, at, reply).map(Ok),
                    None => Some(Err(short_pipeline())),
                }
            } else {
                None
            };
            if decided.is_none() {
                scripted.push(*req);
            }
            claims.push(decided);
        }
        self.settle_claims(reqs, &mut claims, replicated).await;
        let mut rest = if scripted.is_empty() {
            Vec::new().into_iter()
        } else {
            self.claim_scripted(&scripted, 0).await.into_iter()
        };
        Some(
            claims
                .into_iter()
                .map(|claim| answered(claim.or_else(|| rest.next())))
                .collect(),
        )
    }

    /// Every claim by script in one pipeline. When the server answers `NOSCRIPT` (a restart,
    /// a failover, `SCRIPT FLUSH`), the script is loaded and those items are sent again in
    /// one more pipeline. Items a cluster node does not serve (`MOVED` and the like), and on a
    /// cluster those answered `NOSCRIPT`, are claimed again one by one.
    async fn claim_scripted(
        &self,
        reqs: &[&ClaimRequest],
        slot: u16,
    ) -> Vec<Result<Claim, StoreError>> {
        let mut claims = self
            .reloading(&self.inner.script, reqs, |sent| async move {
                self.claim_scripted_once(&sent, slot).await
            })
            .await;
        for (i, claim) in claims.iter_mut().enumerate() {
            if claim.is_none() {
                // Sent again alone (with its own `WAIT` in durable mode).
                *claim = Some(self.claim_one_by_script(reqs[i]).await);
            }
        }
        claims.into_iter().map(answered).collect()
    }

    /// One pipeline of claims by script: what it decided (settled for durable mode, `None`
    /// where an item must be sent again), and the positions the server answered `NOSCRIPT`.
    async fn claim_scripted_once(
        &self,
        reqs: &[&ClaimRequest],
        slot: u16,
    ) -> (Vec<Option<Result<Claim, StoreError>>>, Vec<usize>) {
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        for req in reqs {
            pipe.add_command(claim_cmd(&self.inner.script, req));
        }
        let (replies, replicated) = match self.pipeline_waited(pipe, slot).await {
            Ok(sent) => sent,
            Err(err) => {
                if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() {
                    self.inner.recheck.store(true, Ordering::Release);
                }
                let mut claims: Vec<_> = reqs
                    .iter()
                    .map(|_| Some(Err(command_error(err.clone()))))
                    .collect();
                self.settle_claims(reqs, &mut claims, false).await;
                return (claims, Vec::new());
            }
        };
        let mut claims = Vec::with_capacity(reqs.len());
        let mut unloaded = Vec::new();
        let mut replies = replies.into_iter();
        for (i, req) in reqs.iter().enumerate() {
            let claim = match replies.next() {
                None => Some(Err(short_pipeline())),
                Some(reply) if no_script(&reply) => {
                    unloaded.push(i);
                    None
                }
                Some(reply) => match (send_again(&reply), reply) {
                    (Some(moved), _) => {
                        if moved {
                            self.inner.slots.invalidate();
                        }
                        None
                    }
                    (None, Value::ServerError(err)) => {
                        Some(Err(script_error(&req.key, err.into())))
                    }
                    (None, reply) => Some(decode_claim(reply)),
                },
            };
            claims.push(claim);
        }
        self.settle_claims(reqs, &mut claims, replicated).await;
        (claims, unloaded)
    }

    /// One claim by script (which a `NOSCRIPT` reply reloads), without the replica wait.
    pub(super) async fn claim_one_by_script(
        &self,
        req: &ClaimRequest,
    ) -> Result<Claim, StoreError> {
        let cmd = claim_cmd(&self.inner.script, req);
        let written = match self.write(Some(&self.inner.script), &cmd).await {
            Ok(written) => written,
            Err(err) => return Err(self.claim_unknown(req, err).await),
        };
        let claim = decode_claim(written.reply)?;
        if matches!(claim, Claim::Acquired { .. }) && !written.replicated {
            return Err(self.give_back(req, self.short("claim")).await);
        }
        Ok(claim)
    }
}

impl RedisStore {
    /// Reads the server's clock (`TIME`) for the fast claim's estimate.
    pub(super) async fn read_clock(&self) -> Result<(), StoreError> {
        let server = self.inner.conn.generation();
        self.inner.clock.of_server(server);
        let sent = std::time::Instant::now();
        let reply = self
            .inner
            .conn
            .query(&::redis::cmd("TIME"))
            .await
            .map_err(command_error)?;
        let received = std::time::Instant::now();
        let field = |i: usize| match &reply {
            Value::Array(items) => match items.get(i) {
                Some(Value::BulkString(b)) => std::str::from_utf8(b).ok()?.parse::<u64>().ok(),
                _ => None,
            },
            _ => None,
        };
        match (field(0), field(1)) {
            // A reading of a primary the store has since left is dropped.
            (Some(seconds), Some(micros)) if self.inner.conn.generation() == server => {
                self.inner.clock.record(seconds, micros, sent, received);
                Ok(())
            }
            (Some(_), Some(_)) => Ok(()),
            _ => Err(StoreError::new(
                StoreErrorKind::Protocol,
                format!("unexpected TIME reply: {reply:?}"),
            )),
        }
    }

    /// Starts a background `TIME` reading when the estimate is getting old.
    fn refresh_clock(&self, now: std::time::Instant) {
        // Outside a tokio runtime there is nothing to refresh on: claims use the script.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !self.inner.clock.should_refresh(now) {
            return;
        }
        /// Ends the refresh also when its task is dropped (a runtime shutting down), so a
        /// later claim can start the next one.
        struct Refreshing(RedisStore);
        impl Drop for Refreshing {
            fn drop(&mut self) {
                self.0.inner.clock.done();
            }
        }
        let refreshing = Refreshing(self.clone());
        runtime.spawn(async move {
            if let Err(err) = refreshing.0.read_clock().await {
                tracing::debug!(error = %err, "cannot read the Redis server's clock");
            }
        });
    }

    /// The fast claim: one `SET key <in-progress record> NX PX <lifetime> GET`. `None` when
    /// it does not apply (a cluster, an old server, short durations, no precise clock
    /// estimate) or when the key's record needs the script to decide (a released record, a
    /// run-out lease, a value that is no record): the caller then runs the script.
    pub(super) async fn fast_claim(&self, req: &ClaimRequest) -> Result<Option<Claim>, StoreError> {
        let Some((cmd, at)) = self.fast_claim_now(req) else {
            return Ok(None);
        };
        let written = match self.write(None, &cmd).await {
            Ok(written) => written,
            // WRONGTYPE and the like: the script reports what the key holds.
            Err(err) if err.code() == Some("WRONGTYPE") => return Ok(None),
            Err(err) => return Err(self.claim_unknown(req, err).await),
        };
        let claim = fast_claim_reply(req, at, written.reply);
        if matches!(claim, Some(Claim::Acquired { .. })) && !written.replicated {
            return Err(self.give_back(req, self.short("claim")).await);
        }
        Ok(claim)
    }
}

impl RedisStore {
    /// The fast claim's command for `req` and the estimate of the server's clock it is made
    /// at; `None` when the fast claim does not apply now (see [`fast_claim`](Self::fast_claim)).
    fn fast_claim_now(&self, req: &ClaimRequest) -> Option<(::redis::Cmd, Estimate)> {
        if !self.inner.fast_claims || !self.inner.clock.fast_durations(req.lease, req.ttl) {
            return None;
        }
        let now = std::time::Instant::now();
        self.refresh_clock(now);
        self.inner.clock.of_server(self.inner.conn.generation());
        let at = self.inner.clock.estimate(now)?;
        // The durations were checked above.
        Some((fast_claim_cmd(req, at)?, at))
    }

    /// [`Store::claim_and_is_completed`]: the fast claim and a `GET` of `other` in one
    /// pipeline (with its `WAIT` in durable mode). Where the fast claim does not apply, the
    /// claim and the read go side by side on the connection; where its reply leaves the
    /// claim to the script, the script follows.
    ///
    /// [`Store::claim_and_is_completed`]: crate::store::Store::claim_and_is_completed
    pub(super) async fn claim_reading(
        &self,
        req: &ClaimRequest,
        other: &Key,
    ) -> (Result<Claim, StoreError>, Result<bool, StoreError>) {
        let Some((cmd, at)) = self.fast_claim_now(req) else {
            return futures_util::future::join(self.claim(req), self.is_completed(other)).await;
        };
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        pipe.add_command(cmd);
        pipe.cmd("GET").arg(other.as_bytes());
        let sent = match (&self.inner.conn, self.durable()) {
            (Conn::Single(conn), None) => {
                let mut conn = conn.clone();
                pipe.query_async(&mut conn)
                    .await
                    .map(|replies| (replies, true))
            }
            // Boxed: a cluster's pipeline (never sent here), Sentinel's and a durable write's
            // are large futures, and this one is boxed whole as the claim is made.
            _ => Box::pin(self.pipeline_waited(pipe, 0)).await,
        };
        let (replies, replicated) = match self.answered(sent).await {
            Ok(sent) => sent,
            Err(err) => {
                let read = Err(script_error(other, err.clone()));
                return (Err(self.claim_unknown(req, err).await), read);
            }
        };
        let mut replies = replies.into_iter();
        let (claimed, read) = (replies.next(), replies.next());
        let read = match read {
            Some(value) => completed_reply(other, value),
            None => Err(short_pipeline()),
        };
        let claim = match claimed {
            // WRONGTYPE and the like: the script reports what the key holds.
            Some(Value::ServerError(err)) if err.code() == "WRONGTYPE" => None,
            Some(Value::ServerError(err)) => Some(Err(script_error(&req.key, err.into()))),
            Some(reply) => fast_claim_reply(req, at, reply).map(Ok),
            None => Some(Err(short_pipeline())),
        };
        let claim = match claim {
            Some(Ok(Claim::Acquired { .. })) if !replicated => {
                Err(self.give_back(req, self.short("claim")).await)
            }
            Some(claim) => claim,
            // Boxed: rare, and the pipeline's future is boxed whole as the claim is made.
            None => Box::pin(self.claim_one_by_script(req)).await,
        };
        (claim, read)
    }
}

/// What is said of the replies a pipeline did not send back.
pub(super) const SHORT_PIPELINE: &str = "a pipeline answered fewer replies than it was sent";

/// What a pipeline that answered fewer replies than it was sent says of them.
fn short_pipeline() -> StoreError {
    StoreError::new(StoreErrorKind::Protocol, SHORT_PIPELINE)
}

/// A batch item's claim, once every pipeline has answered.
fn answered(claim: Option<Result<Claim, StoreError>>) -> Result<Claim, StoreError> {
    claim.unwrap_or_else(|| {
        Err(StoreError::new(
            StoreErrorKind::Protocol,
            "no reply for a claim",
        ))
    })
}

/// The fast claim of `req` at the estimate `at`: `SET key <in-progress record> NX PX
/// <lifetime> GET`; `None` for numbers out of the script's range. The caller checks that the
/// fast claim is used for `req`'s durations ([`ServerClock::fast_durations`]).
///
/// [`ServerClock::fast_durations`]: crate::store::redis::clock::ServerClock::fast_durations
fn fast_claim_cmd(req: &ClaimRequest, at: Estimate) -> Option<::redis::Cmd> {
    let lease = clamped_millis(req.lease);
    let value = fast_claim_record(req, at.upper_us, lease)?;
    let key = req.key.as_bytes();
    let mut cmd = ::redis::Cmd::with_capacity(7, key.len() + value.len() + 32);
    cmd.arg("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(clamped_millis(req.record_lifetime()))
        .arg("GET");
    Some(cmd)
}

/// What the reply to [`fast_claim_cmd`] decides; `None` where the script must decide.
fn fast_claim_reply(req: &ClaimRequest, at: Estimate, reply: Value) -> Option<Claim> {
    match reply {
        Value::Nil => Some(Claim::Acquired { fence: at.upper_us }),
        Value::BulkString(old) => decide_existing(req, &old, at),
        _ => None,
    }
}

/// What a claim answers for the record `old` that its `SET NX` found, by the rule
/// ([`claim_answer`]) the script follows too, where the estimate suffices; `None` where the
/// script must decide (a record to take over, released or with a lease that has run out, a
/// lease within the estimate's error of running out, a value that is no record).
fn decide_existing(req: &ClaimRequest, old: &[u8], at: Estimate) -> Option<Claim> {
    let mut record = parse_record(old, i64::try_from(at.now_ms).ok()?)?;
    // A lease the estimate cannot be sure is live reads as run out: the script decides it.
    if let RecordState::InProgress { lease_left } = &mut record.state {
        let doubt = Duration::from_micros(at.error_us.saturating_add(1_000));
        *lease_left = lease_left.saturating_sub(doubt);
    }
    match claim_answer(req, record) {
        ClaimAnswer::Answer(claim) => Some(claim),
        ClaimAnswer::TakeOver { .. } => None,
    }
}
