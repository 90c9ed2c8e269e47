//! [`RedisStore`]: the shared connection, the script calls, and the [`Store`] primitives.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::Value;

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::redis::batch::{send_again, SlotMap};
use crate::store::redis::clock::{fast_durations, Estimate, ServerClock};
use crate::store::redis::conn::{command_error, script_error, Conn, Lua};
use crate::store::redis::wire::{
    claim_cmd, decode_claim, decode_record, fast_claim_record, fast_completion, in_progress_head,
    int, parse_record, text,
};
use crate::store::{
    clamped_millis, BoxFuture, Claim, ClaimRequest, Completion, Expect, OperatorStore, Record,
    RecordState, ScanCursor, ScanPage, Settle, Settlement, Store, Token,
};

pub(super) const SCRIPT: &str = include_str!("record.lua");
/// Completion and release: the hot path's writes, in a script of their own.
pub(super) const SETTLE: &str = include_str!("settle.lua");

pub(super) struct Inner {
    pub(super) conn: Conn,
    pub(super) script: Lua,
    pub(super) settle: Lua,
    pub(super) wait_for_replicas: Option<(u32, Duration)>,
    pub(super) run_id: Mutex<Option<String>>,
    pub(super) history_resets: AtomicU64,
    pub(super) recheck: AtomicBool,
    pub(super) max_result_size: usize,
    /// Whether a fresh key may be claimed with one `SET ... NX GET` (standalone Redis 7.0 or
    /// later, not turned off).
    pub(super) fast_claims: bool,
    pub(super) clock: ServerClock,
    /// A cluster's slots by node, for batches.
    pub(super) slots: SlotMap,
}

/// The Redis [`Store`]. Cheap to clone: clones share one connection.
///
/// ```no_run
/// use std::sync::Arc;
/// use idempotent_runtime::RedisStore;
///
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// idempotent_runtime::set_default_store(Arc::new(store))?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    pub(super) inner: Arc<Inner>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner.conn {
            Conn::Single(_) => "standalone",
            Conn::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore").field("kind", &kind).finish()
    }
}

impl RedisStore {
    /// How many times a reconnection found a different server `run_id` (a restart or a
    /// failover): each time, records written before may be gone.
    pub fn history_resets(&self) -> u64 {
        self.inner.history_resets.load(Ordering::Relaxed)
    }
}

impl RedisStore {
    /// Sends `cmd`, a call of `lua` on `key`.
    async fn call(&self, key: &Key, lua: &Lua, cmd: &::redis::Cmd) -> Result<Value, StoreError> {
        match self.inner.conn.eval(lua, cmd).await {
            Ok(value) => {
                if self.inner.recheck.load(Ordering::Relaxed)
                    && self.inner.recheck.swap(false, Ordering::AcqRel)
                {
                    self.recheck_run_id().await;
                }
                Ok(value)
            }
            Err(err) => {
                if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() {
                    self.inner.recheck.store(true, Ordering::Release);
                }
                Err(script_error(key, err))
            }
        }
    }

    /// After a reconnection: a new `run_id` means a restarted or failed-over server.
    async fn recheck_run_id(&self) {
        let Ok(value) = self
            .inner
            .conn
            .query(::redis::cmd("INFO").arg("server"))
            .await
        else {
            self.inner.recheck.store(true, Ordering::Release);
            return;
        };
        let info = text(&value);
        let Some(now) = info
            .lines()
            .find_map(|l| l.strip_prefix("run_id:"))
            .map(|s| s.trim().to_string())
        else {
            return;
        };
        let Ok(mut known) = self.inner.run_id.lock() else {
            return;
        };
        if known.as_deref().is_some_and(|old| old != now) {
            self.inner.history_resets.fetch_add(1, Ordering::Relaxed);
            crate::metrics::history_reset(self.name());
            tracing::error!(
                old = known.as_deref().unwrap_or_default(),
                new = %now,
                "the Redis server changed (restart or failover): dedup history may be lost"
            );
        }
        *known = Some(now);
    }

    async fn wait_for_replicas(&self) -> Result<(), StoreError> {
        let Some((replicas, timeout)) = self.inner.wait_for_replicas else {
            return Ok(());
        };
        let mut cmd = ::redis::cmd("WAIT");
        cmd.arg(replicas)
            .arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
        let acked = self.inner.conn.query(&cmd).await.map_err(command_error)?;
        match acked {
            Value::Int(n) if n >= i64::from(replicas) => Ok(()),
            other => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                format!("WAIT: {other:?} of {replicas} replicas acknowledged the claim"),
            )),
        }
    }
}

impl RedisStore {
    /// Every claim in one pipeline: one round trip where the fast claim decides them all. With
    /// the fast claim on (see [`fast_claim`](Self::fast_claim)), the pipeline is of `SET ... NX
    /// GET`s and the items they cannot decide (a released record, a run-out lease, a value that
    /// is no record) follow in a second pipeline of scripts; otherwise it is of scripts.
    async fn claim_pipelined(
        &self,
        reqs: &[&ClaimRequest],
        slot: u16,
    ) -> Vec<Result<Claim, StoreError>> {
        let mut claims = match self.claim_fast_pipelined(reqs).await {
            Some(claims) => claims,
            None => self.claim_scripted(reqs, slot).await,
        };
        if claims
            .iter()
            .any(|claim| matches!(claim, Ok(Claim::Acquired { .. })))
        {
            if let Err(err) = self.wait_for_replicas().await {
                let message = err.to_string();
                for claim in &mut claims {
                    if let Ok(Claim::Acquired { .. }) = claim {
                        *claim = Err(StoreError::new(err.kind(), message.clone()));
                    }
                }
            }
        }
        claims
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
        let at = self.inner.clock.estimate(now)?;
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        let mut fast = Vec::with_capacity(reqs.len());
        for req in reqs {
            let cmd = fast_claim_cmd(req, at);
            fast.push(cmd.is_some());
            if let Some(cmd) = cmd {
                pipe.add_command(cmd);
            }
        }
        let mut replies = if fast.iter().any(|&f| f) {
            match self.inner.conn.pipeline(pipe, 0).await {
                Ok(replies) => replies.into_iter(),
                Err(err) => {
                    if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() {
                        self.inner.recheck.store(true, Ordering::Release);
                    }
                    // Every item may have been applied: each is resolved by token.
                    return Some(
                        reqs.iter()
                            .map(|req| Err(script_error(&req.key, err.clone())))
                            .collect(),
                    );
                }
            }
        } else {
            Vec::new().into_iter()
        };
        let mut claims: Vec<Option<Result<Claim, StoreError>>> = Vec::with_capacity(reqs.len());
        let mut scripted = Vec::new();
        for (req, fast) in reqs.iter().zip(fast) {
            let decided = if fast {
                match replies.next() {
                    Some(Value::ServerError(err)) if err.code() == "WRONGTYPE" => None,
                    Some(Value::ServerError(err)) => Some(Err(script_error(&req.key, err.into()))),
                    Some(reply) => fast_claim_reply(req, at, reply).map(Ok),
                    None => Some(Err(StoreError::new(
                        StoreErrorKind::Protocol,
                        "a pipeline answered fewer replies than it was sent",
                    ))),
                }
            } else {
                None
            };
            if decided.is_none() {
                scripted.push(*req);
            }
            claims.push(decided);
        }
        let mut rest = if scripted.is_empty() {
            Vec::new().into_iter()
        } else {
            self.claim_scripted(&scripted, 0).await.into_iter()
        };
        Some(
            claims
                .into_iter()
                .map(|claim| {
                    claim.or_else(|| rest.next()).unwrap_or_else(|| {
                        Err(StoreError::new(
                            StoreErrorKind::Protocol,
                            "no reply for a claim",
                        ))
                    })
                })
                .collect(),
        )
    }

    /// Every claim by script in one pipeline. Items the server answers `NOSCRIPT` (the script
    /// was flushed) are claimed again one by one, which reloads it.
    async fn claim_scripted(
        &self,
        reqs: &[&ClaimRequest],
        slot: u16,
    ) -> Vec<Result<Claim, StoreError>> {
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        for req in reqs {
            pipe.add_command(claim_cmd(&self.inner.script, req));
        }
        let replies: Vec<Value> = match self.inner.conn.pipeline(pipe, slot).await {
            Ok(replies) => replies,
            Err(err) => {
                if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() {
                    self.inner.recheck.store(true, Ordering::Release);
                }
                return reqs
                    .iter()
                    .map(|_| Err(command_error(err.clone())))
                    .collect();
            }
        };
        let mut claims = Vec::with_capacity(reqs.len());
        let mut replies = replies.into_iter();
        for req in reqs {
            let claim = match replies.next() {
                None => Err(StoreError::new(
                    StoreErrorKind::Protocol,
                    "a pipeline answered fewer replies than it was sent",
                )),
                Some(reply) => match (send_again(&reply), reply) {
                    (Some(moved), _) => {
                        if moved {
                            self.inner.slots.invalidate();
                        }
                        self.claim_one_by_script(req).await
                    }
                    (None, Value::ServerError(err)) => Err(script_error(&req.key, err.into())),
                    (None, reply) => decode_claim(reply),
                },
            };
            claims.push(claim);
        }
        claims
    }

    /// One claim by script (which a `NOSCRIPT` reply reloads), without the replica wait.
    async fn claim_one_by_script(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let cmd = claim_cmd(&self.inner.script, req);
        decode_claim(self.call(&req.key, &self.inner.script, &cmd).await?)
    }
}

impl RedisStore {
    /// Reads the server's clock (`TIME`) for the fast claim's estimate.
    pub(super) async fn read_clock(&self) -> Result<(), StoreError> {
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
            (Some(seconds), Some(micros)) => {
                self.inner.clock.record(seconds, micros, sent, received);
                Ok(())
            }
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
    async fn fast_claim(&self, req: &ClaimRequest) -> Result<Option<Claim>, StoreError> {
        if !self.inner.fast_claims || !fast_durations(req.lease, req.ttl) {
            return Ok(None);
        }
        let now = std::time::Instant::now();
        self.refresh_clock(now);
        let Some(at) = self.inner.clock.estimate(now) else {
            return Ok(None);
        };
        let Some(cmd) = fast_claim_cmd(req, at) else {
            return Ok(None);
        };
        let reply = match self.inner.conn.query(&cmd).await {
            Ok(reply) => reply,
            // WRONGTYPE and the like: the script reports what the key holds.
            Err(err) if err.code() == Some("WRONGTYPE") => return Ok(None),
            Err(err) => {
                if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() {
                    self.inner.recheck.store(true, Ordering::Release);
                }
                return Err(script_error(&req.key, err));
            }
        };
        Ok(fast_claim_reply(req, at, reply))
    }
}

/// The fast claim of `req` at the estimate `at`: `SET key <in-progress record> NX PX
/// <lifetime> GET`; `None` for durations the fast claim is not used for or numbers out of the
/// script's range.
fn fast_claim_cmd(req: &ClaimRequest, at: Estimate) -> Option<::redis::Cmd> {
    if !fast_durations(req.lease, req.ttl) {
        return None;
    }
    let (lease, ttl) = (clamped_millis(req.lease), clamped_millis(req.ttl));
    let value = fast_claim_record(req, at.upper_us, lease)?;
    let key = req.key.as_bytes();
    let mut cmd = ::redis::Cmd::with_capacity(7, key.len() + value.len() + 32);
    cmd.arg("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(lease.max(ttl))
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

impl RedisStore {
    /// The `settle.lua` call of a completion; a result larger than the store takes is
    /// refused before it is sent.
    fn complete_cmd(
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
        let mut cmd = self.inner.settle.call(key.as_bytes());
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

    /// Settles `items` in one pipeline (to the node of `slot` on a cluster). Items the
    /// server answers `NOSCRIPT`, `MOVED` and the like are sent again one by one.
    async fn settle_pipelined(
        &self,
        items: &[&Settlement],
        slot: u16,
    ) -> Vec<Result<bool, StoreError>> {
        let mut settled: Vec<Option<Result<bool, StoreError>>> = Vec::with_capacity(items.len());
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        let mut sent = 0;
        for item in items {
            let cmd = match &item.action {
                Settle::Complete(completion) => {
                    self.complete_cmd(&item.key, &item.token, completion)
                }
                Settle::Release => {
                    let mut cmd = self.inner.settle.call(item.key.as_bytes());
                    cmd.arg("release").arg(item.token.as_bytes());
                    Ok(cmd)
                }
            };
            match cmd {
                Ok(cmd) => {
                    pipe.add_command(cmd);
                    sent += 1;
                    settled.push(None);
                }
                Err(err) => settled.push(Some(Err(err))),
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
            for (item, answer) in items.iter().zip(settled.iter_mut()) {
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
                                Settle::Complete(completion) => {
                                    self.complete(&item.key, &item.token, completion).await
                                }
                                Settle::Release => self.release(&item.key, &item.token).await,
                            }
                        }
                        (None, Value::ServerError(err)) => Err(script_error(&item.key, err.into())),
                        (None, reply) => int(&reply).map(|n| n == 1),
                    },
                });
            }
        }
        settled
            .into_iter()
            .map(|answer| {
                answer.unwrap_or_else(|| {
                    Err(StoreError::new(
                        StoreErrorKind::Protocol,
                        "no reply for a settlement",
                    ))
                })
            })
            .collect()
    }

    /// Runs `settle.lua`'s token-only operation `op` (`release`, `reopen`) on `key`.
    async fn settle_by_token(
        &self,
        op: &'static str,
        key: &Key,
        token: &Token,
    ) -> Result<bool, StoreError> {
        let mut cmd = self.inner.settle.call(key.as_bytes());
        cmd.arg(op).arg(token.as_bytes());
        Ok(int(&self.call(key, &self.inner.settle, &cmd).await?)? == 1)
    }
}

/// What a claim answers for the record `old` that its `SET NX` found, as the script would
/// answer it, where the estimate suffices; `None` where the script must decide (a released
/// record, a lease that has run out or is within the estimate's error of it, a value that is
/// no record).
fn decide_existing(req: &ClaimRequest, old: &[u8], at: Estimate) -> Option<Claim> {
    let record = parse_record(old, i64::try_from(at.now_ms).ok()?)?;
    let fence = record.fence;
    let mismatch = matches!(
        (&req.fingerprint, &record.fingerprint),
        (Some(ours), Some(theirs)) if ours != theirs
    );
    match record.state {
        RecordState::InProgress { .. } if record.token == req.token => {
            Some(Claim::Acquired { fence })
        }
        RecordState::InProgress { .. } | RecordState::Completed if mismatch => {
            Some(Claim::Mismatch { fence })
        }
        RecordState::Completed => Some(Claim::Completed {
            fence,
            result: record.result,
        }),
        RecordState::InProgress { lease_left }
            if lease_left.as_micros() > u128::from(at.error_us) + 1_000 =>
        {
            Some(Claim::InProgress { fence })
        }
        _ => None,
    }
}

impl Store for RedisStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            let claim = match self.fast_claim(req).await? {
                Some(claim) => claim,
                None => self.claim_one_by_script(req).await?,
            };
            if let Claim::Acquired { .. } = claim {
                self.wait_for_replicas().await?;
            }
            Ok(claim)
        })
    }

    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Vec<Result<Claim, StoreError>>> {
        Box::pin(async move {
            let all: Vec<&ClaimRequest> = reqs.iter().collect();
            match &self.inner.conn {
                Conn::Single(_) => self.claim_pipelined(&all, 0).await,
                Conn::Cluster(_) => {
                    let groups = self
                        .inner
                        .slots
                        .groups(&self.inner.conn, reqs.iter().map(|req| &req.key))
                        .await;
                    let sent = groups.iter().map(|(slot, positions)| {
                        let group: Vec<&ClaimRequest> =
                            positions.iter().map(|&i| &reqs[i]).collect();
                        async move { self.claim_pipelined(&group, *slot).await }
                    });
                    let answers = futures_util::future::join_all(sent).await;
                    reassemble(reqs.len(), &groups, answers)
                }
            }
        })
    }

    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let cmd = self.complete_cmd(key, token, completion)?;
            Ok(int(&self.call(key, &self.inner.settle, &cmd).await?)? == 1)
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.settle_by_token("release", key, token))
    }

    /// One pipeline of `settle.lua` calls on a server, one per node on a cluster.
    fn complete_many<'a>(
        &'a self,
        items: &'a [Settlement],
    ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
        Box::pin(async move {
            let all: Vec<&Settlement> = items.iter().collect();
            match &self.inner.conn {
                Conn::Single(_) => self.settle_pipelined(&all, 0).await,
                Conn::Cluster(_) => {
                    let groups = self
                        .inner
                        .slots
                        .groups(&self.inner.conn, items.iter().map(|item| &item.key))
                        .await;
                    let sent = groups.iter().map(|(slot, positions)| {
                        let group: Vec<&Settlement> =
                            positions.iter().map(|&i| &items[i]).collect();
                        async move { self.settle_pipelined(&group, *slot).await }
                    });
                    let answers = futures_util::future::join_all(sent).await;
                    reassemble(items.len(), &groups, answers)
                }
            }
        })
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut cmd = self.inner.script.call(key.as_bytes());
            cmd.arg("renew")
                .arg(token.as_bytes())
                .arg(clamped_millis(lease));
            Ok(int(&self.call(key, &self.inner.script, &cmd).await?)? == 1)
        })
    }

    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            let mut cmd = self.inner.script.call(key.as_bytes());
            cmd.arg("read");
            decode_record(key, self.call(key, &self.inner.script, &cmd).await?)
        })
    }

    fn max_result_size(&self) -> usize {
        self.inner.max_result_size
    }

    fn name(&self) -> &'static str {
        match self.inner.conn {
            Conn::Single(_) => "redis",
            Conn::Cluster(_) => "redis_cluster",
        }
    }
}

impl OperatorStore for RedisStore {
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.settle_by_token("reopen", key, token))
    }

    /// `SCAN ... MATCH <prefix>:v*` on the server, or on each primary of a cluster in turn
    /// (the cursor names the primary by its position in the sorted list of primaries' addresses;
    /// a topology change during a scan may skip or repeat a node's keys), then each key found
    /// read by the script. Keys of the pattern that are no operation key are left out.
    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        cursor: &'a ScanCursor,
        limit: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
        Box::pin(async move {
            let bad = || {
                StoreError::new(
                    StoreErrorKind::Rejected,
                    format!("`{cursor}` is not a cursor of a Redis store"),
                )
            };
            let (node, position) = if cursor.is_start() {
                (0, 0u64)
            } else {
                match cursor.as_str().split_once(':') {
                    Some((node, position)) => (
                        node.parse::<usize>().map_err(|_| bad())?,
                        position.parse::<u64>().map_err(|_| bad())?,
                    ),
                    None => (0, cursor.as_str().parse::<u64>().map_err(|_| bad())?),
                }
            };
            let mut scan = ::redis::cmd("SCAN");
            scan.arg(position)
                .arg("MATCH")
                .arg(scan_pattern(prefix))
                .arg("COUNT")
                .arg(limit.clamp(1, 10_000));
            let (reply, nodes) = match &self.inner.conn {
                Conn::Single(_) => (self.inner.conn.query(&scan).await, 1),
                Conn::Cluster(cluster) => {
                    let primaries = primaries(&self.inner.conn).await?;
                    let Some((host, port)) = primaries.get(node).cloned() else {
                        return Err(bad());
                    };
                    let routing = ::redis::cluster_routing::RoutingInfo::SingleNode(
                        ::redis::cluster_routing::SingleNodeRoutingInfo::ByAddress { host, port },
                    );
                    (
                        cluster.clone().route_command(scan, routing).await,
                        primaries.len(),
                    )
                }
            };
            let reply = reply.map_err(command_error)?;
            let (next_position, keys) = scan_reply(reply)?;
            let next = match (next_position, node + 1 < nodes) {
                (0, false) => None,
                (0, true) => Some(ScanCursor::new(format!("{}:0", node + 1))),
                (position, _) if nodes == 1 => Some(ScanCursor::new(position.to_string())),
                (position, _) => Some(ScanCursor::new(format!("{node}:{position}"))),
            };
            let keys: Vec<Key> = keys
                .iter()
                .filter_map(|bytes| Key::parse_bytes(bytes).ok())
                .filter(|key| key.prefix() == prefix)
                .collect();
            let reads = futures_util::future::join_all(keys.iter().map(|key| self.read(key))).await;
            let mut records = Vec::with_capacity(keys.len());
            for (key, read) in keys.into_iter().zip(reads) {
                match read {
                    Ok(Some(record)) => records.push((key, Ok(record))),
                    // Expired between the scan and the read.
                    Ok(None) => {}
                    Err(err) if err.kind() == StoreErrorKind::Corrupt => {
                        records.push((key, Err(err)));
                    }
                    Err(err) => return Err(err),
                }
            }
            Ok(ScanPage::new(records, next))
        })
    }

    fn delete<'a>(
        &'a self,
        key: &'a Key,
        expect: Expect<'a>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut cmd = self.inner.script.call(key.as_bytes());
            match expect {
                Expect::Token(token) => cmd.arg("delete").arg(token.as_bytes()),
                Expect::Corrupt => cmd.arg("delete_corrupt"),
            };
            Ok(int(&self.call(key, &self.inner.script, &cmd).await?)? == 1)
        })
    }
}

/// The answers of groups of a batch (`groups`: positions in the batch), in the batch's order.
fn reassemble<T>(
    len: usize,
    groups: &[(u16, Vec<usize>)],
    answers: Vec<Vec<Result<T, StoreError>>>,
) -> Vec<Result<T, StoreError>> {
    let mut ordered: Vec<Option<Result<T, StoreError>>> = (0..len).map(|_| None).collect();
    for ((_, positions), answers) in groups.iter().zip(answers) {
        for (&position, answer) in positions.iter().zip(answers) {
            ordered[position] = Some(answer);
        }
    }
    ordered
        .into_iter()
        .map(|answer| {
            answer.unwrap_or_else(|| {
                Err(StoreError::new(
                    StoreErrorKind::Protocol,
                    "no reply for a batch item",
                ))
            })
        })
        .collect()
}

/// The `SCAN MATCH` pattern of every operation key with `prefix`: the prefix with the glob's
/// special characters escaped, then `:v*`.
fn scan_pattern(prefix: &str) -> String {
    let mut pattern = String::with_capacity(prefix.len() + 4);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push_str(":v*");
    pattern
}

/// A `SCAN` reply: the next position and the keys.
fn scan_reply(reply: Value) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
    let protocol = |what: &str| {
        StoreError::new(
            StoreErrorKind::Protocol,
            format!("unexpected SCAN reply: {what}"),
        )
    };
    let Value::Array(mut items) = reply else {
        return Err(protocol("not an array"));
    };
    if items.len() != 2 {
        return Err(protocol("not two items"));
    }
    let keys = items.pop();
    let position = match items.pop() {
        Some(Value::BulkString(bytes)) => std::str::from_utf8(&bytes)
            .ok()
            .and_then(|s| s.parse::<u64>().ok()),
        _ => None,
    }
    .ok_or_else(|| protocol("no position"))?;
    let keys = match keys {
        Some(Value::Array(keys)) => keys
            .into_iter()
            .filter_map(|key| match key {
                Value::BulkString(bytes) => Some(bytes),
                _ => None,
            })
            .collect(),
        _ => return Err(protocol("no keys")),
    };
    Ok((position, keys))
}

/// The addresses of a cluster's primaries (`CLUSTER NODES`), sorted.
async fn primaries(conn: &Conn) -> Result<Vec<(String, u16)>, StoreError> {
    let reply = conn
        .query(::redis::cmd("CLUSTER").arg("NODES"))
        .await
        .map_err(command_error)?;
    let mut nodes: Vec<(String, u16)> = text(&reply)
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let address = fields.nth(1)?;
            let flags = fields.next()?;
            if !flags.split(',').any(|f| f == "master") || flags.contains("fail") {
                return None;
            }
            // `ip:port@cport[,hostname]`
            let address = address.split(['@', ',']).next()?;
            let (host, port) = address.rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?))
        })
        .collect();
    nodes.sort();
    nodes.dedup();
    if nodes.is_empty() {
        return Err(StoreError::new(
            StoreErrorKind::Unavailable,
            "the cluster reports no primary",
        ));
    }
    Ok(nodes)
}
