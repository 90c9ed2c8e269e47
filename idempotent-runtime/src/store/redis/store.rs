//! [`RedisStore`]: the shared connection, the script calls, and the [`Store`] primitives
//! (claims in `claim`, completions and releases in `ending`, the operator's in `scan`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::Value;

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::redis::batch::SlotMap;
use crate::store::redis::clock::ServerClock;
use crate::store::redis::conn::{script_error, Conn, Lua};
use crate::store::redis::wire::{decode_completed, decode_record, int, text};
use crate::store::{
    clamped_millis, AcquiredClaim, BoxFuture, Claim, ClaimRequest, Completion, Ending, Record,
    Store, Token,
};

pub(super) const SCRIPT: &str = include_str!("record.lua");
/// Completion and release: the hot path's writes, in a script of their own.
pub(super) const ENDING: &str = include_str!("ending.lua");
/// Reads on a cluster: the value, the server's time and the key's expiry, checked by the client.
pub(super) const READ: &str = include_str!("read.lua");

pub(super) struct Inner {
    pub(super) conn: Conn,
    pub(super) script: Lua,
    pub(super) ending: Lua,
    pub(super) reading: Lua,
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
            Conn::Sentinel(_) => "sentinel",
            Conn::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore").field("kind", &kind).finish()
    }
}

impl RedisStore {
    /// A read on one server (standalone, or Sentinel's primary): `GET`, `PTTL` and `TIME` in
    /// one pipeline, without a script (a script call costs the server several times the three
    /// commands). The commands are not one atomic step as `read.lua` is: a record written
    /// between the `GET` and the `PTTL` shows the later record's expiry, which only an
    /// operator's listing reads; the time is taken after the value, so an in-progress
    /// record's lease is never read as longer than it is. On a cluster, reads go through
    /// `read.lua`, which the cluster client routes and redirects.
    async fn read_plain(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        let mut pipe = ::redis::pipe();
        // A key of another type answers `GET` with an error, which is its answer here.
        pipe.ignore_errors();
        pipe.cmd("GET")
            .arg(key.as_bytes())
            .cmd("PTTL")
            .arg(key.as_bytes())
            .cmd("TIME");
        let replies = self
            .answered(self.inner.conn.pipeline(pipe, 0).await)
            .await
            .map_err(|err| script_error(key, err))?;
        let [value, pttl, time]: [Value; 3] = replies.try_into().map_err(|replies| {
            StoreError::new(
                StoreErrorKind::Protocol,
                format!("unexpected replies to a read: {replies:?}"),
            )
        })?;
        let value = match value {
            Value::ServerError(err) if err.code() == "WRONGTYPE" => {
                return Err(StoreError::new(
                    StoreErrorKind::Corrupt,
                    format!("the value under `{key}` is not a record: value of another type"),
                ))
            }
            Value::ServerError(err) => return Err(script_error(key, err.into())),
            value => value,
        };
        let now_ms = server_millis(&time).ok_or_else(|| {
            StoreError::new(
                StoreErrorKind::Protocol,
                format!("unexpected TIME reply: {time:?}"),
            )
        })?;
        decode_record(key, Value::Array(vec![value, Value::Int(now_ms), pttl]))
    }

    /// How many times a reconnection found a different server `run_id` (a restart or a
    /// failover): each time, records written before may be gone.
    pub fn history_resets(&self) -> u64 {
        self.inner.history_resets.load(Ordering::Relaxed)
    }
}

impl RedisStore {
    /// Sends `cmd`, a call of `lua` on `key`.
    pub(super) async fn call(
        &self,
        key: &Key,
        lua: &Lua,
        cmd: &::redis::Cmd,
    ) -> Result<Value, StoreError> {
        let reply = self.inner.conn.eval(lua, cmd).await;
        self.answered(reply)
            .await
            .map_err(|err| script_error(key, err))
    }

    /// Notes what a command's answer says of the connection: after a failed connection the
    /// next success checks whether the server is still the same one (its `run_id`).
    pub(super) async fn answered<T>(
        &self,
        reply: Result<T, ::redis::RedisError>,
    ) -> Result<T, ::redis::RedisError> {
        match &reply {
            Ok(_) => {
                if self.inner.recheck.load(Ordering::Relaxed)
                    && self.inner.recheck.swap(false, Ordering::AcqRel)
                {
                    // Boxed: it is rare, and every store call holds this future.
                    Box::pin(self.recheck_run_id()).await;
                }
            }
            Err(err) => {
                if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() {
                    self.inner.recheck.store(true, Ordering::Release);
                }
            }
        }
        reply
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
}

impl Store for RedisStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            match self.fast_claim(req).await? {
                Some(claim) => Ok(claim),
                None => self.claim_one_by_script(req).await,
            }
        })
    }

    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Vec<Result<Claim, StoreError>>> {
        Box::pin(async move {
            // In durable mode (never on a cluster), one pipeline with one `WAIT`.
            let all: Vec<&ClaimRequest> = reqs.iter().collect();
            match &self.inner.conn {
                Conn::Single(_) | Conn::Sentinel(_) => self.claim_pipelined(&all, 0).await,
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
            let written = match self.write(Some(&self.inner.ending), &cmd).await {
                Ok(written) => written,
                Err(err) => return Err(self.write_unknown(key, err)),
            };
            let completed = int(&written.reply)? == 1;
            if completed && !written.replicated {
                return Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    self.short("completion"),
                ));
            }
            Ok(completed)
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.by_token("release", key, token))
    }

    fn release_acquired<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        claim: &'a AcquiredClaim,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.release_claim(key, token, claim))
    }

    /// One pipeline of `ending.lua` calls on a server, one per node on a cluster.
    fn complete_many<'a>(
        &'a self,
        items: &'a [Ending],
    ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
        Box::pin(async move {
            // In durable mode (never on a cluster), one pipeline with one `WAIT`.
            let all: Vec<&Ending> = items.iter().collect();
            match &self.inner.conn {
                Conn::Single(_) | Conn::Sentinel(_) => self.end_pipelined(&all, 0).await,
                Conn::Cluster(_) => {
                    let groups = self
                        .inner
                        .slots
                        .groups(&self.inner.conn, items.iter().map(|item| &item.key))
                        .await;
                    let sent = groups.iter().map(|(slot, positions)| {
                        let group: Vec<&Ending> = positions.iter().map(|&i| &items[i]).collect();
                        async move { self.end_pipelined(&group, *slot).await }
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
            let written = match self.write(Some(&self.inner.script), &cmd).await {
                Ok(written) => written,
                Err(err) => return Err(self.write_unknown(key, err)),
            };
            let renewed = int(&written.reply)? == 1;
            if renewed && !written.replicated {
                return Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    self.short("renewal"),
                ));
            }
            Ok(renewed)
        })
    }

    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            if !self.inner.conn.is_cluster() {
                return self.read_plain(key).await;
            }
            let cmd = self.inner.reading.call(key.as_bytes());
            decode_record(key, self.call(key, &self.inner.reading, &cmd).await?)
        })
    }

    /// One `GET`, on a single server and on a cluster alike: a key Redis still holds is a
    /// live record, and a completed record's state needs neither its expiry nor the time.
    fn is_completed<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut get = ::redis::cmd("GET");
            get.arg(key.as_bytes());
            let reply = self.answered(self.inner.conn.query(&get).await).await;
            completed_reply(key, reply.map_err(|err| script_error(key, err))?)
        })
    }

    fn claim_and_is_completed(
        self: Arc<Self>,
        req: Arc<ClaimRequest>,
        other: Key,
    ) -> Option<BoxFuture<'static, (Result<Claim, StoreError>, Result<bool, StoreError>)>> {
        // A cluster may serve the two keys from different nodes.
        if self.inner.conn.is_cluster() {
            return None;
        }
        Some(Box::pin(
            async move { self.claim_reading(&req, &other).await },
        ))
    }

    fn max_result_size(&self) -> usize {
        self.inner.max_result_size
    }

    fn name(&self) -> &'static str {
        match self.inner.conn {
            Conn::Single(_) | Conn::Sentinel(_) => "redis",
            Conn::Cluster(_) => "redis_cluster",
        }
    }
}

/// What a `GET` of `key` answered, as [`Store::is_completed`] gives it.
pub(super) fn completed_reply(key: &Key, reply: Value) -> Result<bool, StoreError> {
    match reply {
        Value::ServerError(err) if err.code() == "WRONGTYPE" => Err(StoreError::new(
            StoreErrorKind::Corrupt,
            format!("the value under `{key}` is not a record: value of another type"),
        )),
        Value::ServerError(err) => Err(script_error(key, err.into())),
        value => decode_completed(key, &value),
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

/// The milliseconds since the Unix epoch in a `TIME` reply (seconds and microseconds).
fn server_millis(time: &Value) -> Option<i64> {
    let Value::Array(fields) = time else {
        return None;
    };
    let field = |i: usize| match fields.get(i) {
        Some(Value::BulkString(bytes)) => std::str::from_utf8(bytes).ok()?.parse::<i64>().ok(),
        _ => None,
    };
    field(0)?.checked_mul(1_000)?.checked_add(field(1)? / 1_000)
}
