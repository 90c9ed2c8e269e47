//! [`RedisStore`]: the shared connection, the script calls, and the [`Store`] primitives.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::aio::ConnectionManager;
use ::redis::{Script, Value};

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::redis::clock::{fast_durations, Estimate, ServerClock};
use crate::store::redis::conn::{command_error, script_error, Conn};
use crate::store::redis::wire::{
    claim_invocation, decode_claim, decode_record, in_progress_record, int, parse_record, text,
};
use crate::store::{
    clamped_millis, BoxFuture, Claim, ClaimRequest, Completion, Record, RecordState, Store, Token,
};

pub(super) const SCRIPT: &str = include_str!("record.lua");
/// Completion and release: the hot path's writes, in a script of their own.
pub(super) const SETTLE: &str = include_str!("settle.lua");

pub(super) struct Inner {
    pub(super) conn: Conn,
    pub(super) script: Script,
    pub(super) settle: Script,
    pub(super) wait_for_replicas: Option<(u32, Duration)>,
    pub(super) run_id: Mutex<Option<String>>,
    pub(super) history_resets: AtomicU64,
    pub(super) recheck: AtomicBool,
    pub(super) max_result_size: usize,
    /// Whether a fresh key may be claimed with one `SET ... NX GET` (standalone Redis 7.0 or
    /// later, not turned off).
    pub(super) fast_claims: bool,
    pub(super) clock: ServerClock,
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
    async fn call(
        &self,
        key: &Key,
        invocation: &::redis::ScriptInvocation<'_>,
    ) -> Result<Value, StoreError> {
        match self.inner.conn.invoke(invocation).await {
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
    /// Every claim in one pipeline: one round trip. Items the server answers `NOSCRIPT`
    /// (the script was flushed) are claimed again one by one, which reloads it.
    async fn claim_pipelined(
        &self,
        conn: &ConnectionManager,
        reqs: &[ClaimRequest],
    ) -> Vec<Result<Claim, StoreError>> {
        let invocations: Vec<_> = reqs
            .iter()
            .map(|req| claim_invocation(&self.inner.script, req))
            .collect();
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        for invocation in &invocations {
            pipe.invoke_script(invocation);
        }
        let replies: Vec<Value> = match pipe.query_async(&mut conn.clone()).await {
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
        let mut acquired = false;
        for (req, reply) in reqs.iter().zip(replies) {
            let claim = match reply {
                Value::ServerError(err)
                    if err.kind() == Some(::redis::ServerErrorKind::NoScript) =>
                {
                    self.claim(req).await
                }
                Value::ServerError(err) => Err(script_error(&req.key, err.into())),
                reply => decode_claim(reply),
            };
            acquired |= matches!(claim, Ok(Claim::Acquired { .. }));
            claims.push(claim);
        }
        if acquired {
            if let Err(err) = self.wait_for_replicas().await {
                let message = err.to_string();
                return claims
                    .into_iter()
                    .map(|claim| match claim {
                        Ok(Claim::Acquired { .. }) => {
                            Err(StoreError::new(err.kind(), message.clone()))
                        }
                        other => other,
                    })
                    .collect();
            }
        }
        claims
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
        let (lease, ttl) = (clamped_millis(req.lease), clamped_millis(req.ttl));
        let Some(value) = in_progress_record(req, at.upper_us, at.now_ms.saturating_add(lease))
        else {
            return Ok(None);
        };
        let mut cmd = ::redis::cmd("SET");
        cmd.arg(req.key.as_bytes())
            .arg(value)
            .arg("NX")
            .arg("PX")
            .arg(lease.max(ttl))
            .arg("GET");
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
        Ok(match reply {
            Value::Nil => Some(Claim::Acquired { fence: at.upper_us }),
            Value::BulkString(old) => decide_existing(req, &old, at),
            _ => None,
        })
    }
}

impl RedisStore {
    /// Runs `settle.lua`'s token-only operation `op` (`release`, `reopen`) on `key`.
    async fn settle_by_token(
        &self,
        op: &'static str,
        key: &Key,
        token: &Token,
    ) -> Result<bool, StoreError> {
        let mut invocation = self.inner.settle.prepare_invoke();
        invocation.key(key.as_bytes()).arg(op).arg(token.as_bytes());
        Ok(int(&self.call(key, &invocation).await?)? == 1)
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
                None => {
                    let invocation = claim_invocation(&self.inner.script, req);
                    decode_claim(self.call(&req.key, &invocation).await?)?
                }
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
            match &self.inner.conn {
                Conn::Single(conn) => self.claim_pipelined(conn, reqs).await,
                // Keys of a batch live in different slots; one claim at a time.
                Conn::Cluster(_) => {
                    let mut claims = Vec::with_capacity(reqs.len());
                    for req in reqs {
                        claims.push(self.claim(req).await);
                    }
                    claims
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
            let mut invocation = self.inner.settle.prepare_invoke();
            invocation
                .key(key.as_bytes())
                .arg("complete")
                .arg(token.as_bytes())
                .arg(clamped_millis(completion.ttl))
                .arg(result);
            Ok(int(&self.call(key, &invocation).await?)? == 1)
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.settle_by_token("release", key, token))
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut invocation = self.inner.script.prepare_invoke();
            invocation
                .key(key.as_bytes())
                .arg("renew")
                .arg(token.as_bytes())
                .arg(clamped_millis(lease));
            Ok(int(&self.call(key, &invocation).await?)? == 1)
        })
    }

    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            let mut invocation = self.inner.script.prepare_invoke();
            invocation.key(key.as_bytes()).arg("read");
            decode_record(key, self.call(key, &invocation).await?)
        })
    }

    fn max_result_size(&self) -> usize {
        self.inner.max_result_size
    }

    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.settle_by_token("reopen", key, token))
    }

    fn name(&self) -> &'static str {
        match self.inner.conn {
            Conn::Single(_) => "redis",
            Conn::Cluster(_) => "redis_cluster",
        }
    }
}
