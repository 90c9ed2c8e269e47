//! The Redis backend: standalone Redis or Redis Cluster, through redis-rs.
//!
//! Every primitive is one server-side script (`record.lua`), loaded once and called by its
//! SHA-1 (`EVALSHA`); after a `SCRIPT FLUSH` or a server restart the `NOSCRIPT` reply makes
//! the client load it again and retry, transparently. Leases and expiry use the server's
//! clock (`TIME`, `PX`), never the client's.
//!
//! A record is one Redis string holding state, token, fingerprint, fence, lease end and
//! result, so one key per record and one Redis Cluster slot (the key's `{...}` hash tag
//! keeps the slot stable across versions that might add keys).
//!
//! # Connections
//!
//! A standalone server is reached through one auto-reconnecting multiplexed connection
//! ([`ConnectionManager`]) shared by every handler; a cluster through redis-rs's async
//! cluster client, which follows `MOVED` and `ASK` redirections. Both have a response and a
//! connection timeout ([`RedisStore::builder`]).
//!
//! # Safety checks
//!
//! At connection, the store reads `INFO` (and `CONFIG GET`, where allowed) and
//!
//! - refuses (or, by option, warns about) an eviction policy other than `noeviction`: an
//!   `allkeys-*` policy drops completed records, and `volatile-*` policies are as unsafe here
//!   since every record has a TTL (`volatile-ttl` evicts the in-flight claims first);
//! - refuses a replica (writes would fail or be lost);
//! - warns when neither RDB snapshots nor AOF are enabled (a restart forgets every record);
//! - remembers the server's `run_id`; when a later reconnection finds another one, it logs
//!   "dedup history may be lost" and counts it ([`RedisStore::history_resets`]).
//!
//! A managed Redis that hides `INFO` or `CONFIG` gives "cannot verify" warnings instead.
//!
//! # What Redis can and cannot promise
//!
//! Redis acknowledges a write before it is durable: a restart without persistence, a
//! failover to a replica that had not received the write, or an eviction loses records. A
//! lost record makes the next duplicate run again. Keep effects exactly-once with a check at
//! the effect: the `done` fallback (asked whenever a claim is acquired), a status
//! compare-and-set, or the fence. [`RedisStoreBuilder::wait_for_replicas`] adds a `WAIT`
//! after each acquired claim, which narrows (does not close) the failover window.
//!
//! An `OOM` reply (memory full under `noeviction`) is a store error: the call fails closed.
//!
//! # Records it cannot read
//!
//! A value under a record's key that the script cannot parse (written by something else, cut
//! short, an unknown state letter, a non-numeric fence) or a key of another Redis type is
//! [`StoreErrorKind::Corrupt`] for every operation, and is left as it is: never taken for a
//! free key, never overwritten.
//!
//! # Fences, durations, result sizes
//!
//! A key without a record is acquired with the server's clock in microseconds (`TIME`) as
//! its fence, a key with one with its fence + 1
//! ([`next_fence`](crate::store::next_fence)). Durations are sent as
//! [`clamped_millis`]. A stored result is at most
//! [`max_result_size`](RedisStoreBuilder::max_result_size) bytes, and never more than the
//! server's `proto-max-bulk-len` allows.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClient;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Client, RedisError, Script, Value};

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::url::redact;
use crate::store::{
    clamped_millis, BoxFuture, Claim, ClaimRequest, Completion, Fingerprint, Record, RecordState,
    Store, Token, DEFAULT_MAX_RESULT_SIZE,
};

const SCRIPT: &str = include_str!("record.lua");

/// The error code of the script's reply about a value it cannot read as a record.
const CORRUPT: &str = "IDEMPOTENT_CORRUPT";

/// Redis' default `proto-max-bulk-len` (512 MiB): the largest argument a server takes, assumed
/// when `CONFIG GET` is not allowed.
const DEFAULT_PROTO_MAX_BULK_LEN: usize = 512 << 20;

/// Room left in an argument for a record's other fields (state, token, fingerprint, fence,
/// lease end): a stored result is at most `proto-max-bulk-len` less this.
const RECORD_OVERHEAD: usize = 128;

/// The largest fence or time a record holds: above it, Lua's numbers are not exact integers.
const MAX_EXACT: u64 = (1 << 53) - 2;

/// What to do when the server's configuration is unsafe for idempotency records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum UnsafeConfig {
    /// Refuse to connect, with [`StoreErrorKind::Unsafe`]. The default.
    #[default]
    Refuse,
    /// Connect and log a warning.
    Warn,
}

/// What the safety checks found, as returned by [`RedisStore::check`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// The server's `run_id` (the first node's, on a cluster).
    pub run_id: Option<String>,
    /// Problems that make records unsafe (eviction policy, replica role).
    pub unsafe_config: Vec<String>,
    /// Weaknesses worth knowing (no persistence) and checks that could not be made.
    pub warnings: Vec<String>,
}

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Conn {
    async fn query(&self, cmd: &::redis::Cmd) -> Result<Value, RedisError> {
        match self.clone() {
            Conn::Single(mut c) => c.req_packed_command(cmd).await,
            Conn::Cluster(mut c) => c.req_packed_command(cmd).await,
        }
    }

    async fn invoke(
        &self,
        invocation: &::redis::ScriptInvocation<'_>,
    ) -> Result<Value, RedisError> {
        match self.clone() {
            Conn::Single(mut c) => invocation.invoke_async(&mut c).await,
            Conn::Cluster(mut c) => invocation.invoke_async(&mut c).await,
        }
    }
}

/// Builds a [`RedisStore`] with non-default settings.
///
/// ```no_run
/// use std::time::Duration;
/// use idempotent_runtime::redis::{RedisStore, UnsafeConfig};
///
/// # async fn f() -> Result<(), idempotent_runtime::StoreError> {
/// let store = RedisStore::builder("redis://127.0.0.1:6379")
///     .response_timeout(Duration::from_millis(500))
///     .on_unsafe_config(UnsafeConfig::Warn)
///     .build()
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisStoreBuilder {
    target: Target,
    /// What error messages call the server: the URL without its password.
    name: String,
    response_timeout: Duration,
    connection_timeout: Duration,
    on_unsafe_config: UnsafeConfig,
    wait_for_replicas: Option<(u32, Duration)>,
    max_result_size: usize,
}

impl RedisStoreBuilder {
    fn new(target: Target, name: String) -> RedisStoreBuilder {
        RedisStoreBuilder {
            target,
            name,
            response_timeout: Duration::from_secs(1),
            connection_timeout: Duration::from_secs(1),
            on_unsafe_config: UnsafeConfig::default(),
            wait_for_replicas: None,
            max_result_size: DEFAULT_MAX_RESULT_SIZE,
        }
    }

    /// How long a command may wait for its reply (default 1 s). A reply that does not come
    /// in time is an unknown outcome, resolved by reading the record back.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How long a connection attempt may take (default 1 s).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// What to do about an unsafe server configuration (default: refuse).
    pub fn on_unsafe_config(mut self, policy: UnsafeConfig) -> Self {
        self.on_unsafe_config = policy;
        self
    }

    /// After every acquired claim, `WAIT` until `replicas` replicas acknowledged it, for at
    /// most `timeout`; fewer acknowledgements fail the call closed (the claim stays until its
    /// lease runs out). Costs one round trip per first delivery (duplicates are unaffected).
    /// Standalone servers only.
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait_for_replicas = Some((replicas, timeout));
        self
    }

    /// The largest stored result, in bytes (default
    /// [`DEFAULT_MAX_RESULT_SIZE`], 1 MiB). A larger result completes its record without it
    /// (duplicates get no replay, and never run again). The store never takes more than the
    /// server's `proto-max-bulk-len` allows (read with `CONFIG GET` at connection, 512 MiB where
    /// `CONFIG` is not allowed), less a few bytes for the record's other fields; see
    /// [`Store::max_result_size`] for the limit in force.
    pub fn max_result_size(mut self, bytes: usize) -> Self {
        self.max_result_size = bytes;
        self
    }

    /// Connects and runs the safety checks.
    ///
    /// `redis://` and `rediss://` URLs name a standalone server; `redis+cluster://` and
    /// `rediss+cluster://` URLs list cluster nodes separated by commas
    /// (`redis+cluster://10.0.0.1:7000,10.0.0.2:7000`).
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Unavailable`] when the server cannot be reached,
    /// [`StoreErrorKind::Unsafe`] when its configuration is refused.
    pub async fn build(self) -> Result<RedisStore, StoreError> {
        let name = self.name.as_str();
        let cluster = match &self.target {
            Target::Url(url) => cluster_nodes(url).is_some(),
            Target::Client(_) => false,
            Target::Cluster(_) => true,
        };
        if cluster && self.wait_for_replicas.is_some() {
            return Err(StoreError::new(
                StoreErrorKind::Unsafe,
                "`wait_for_replicas` is supported on standalone servers only",
            ));
        }
        let conn = match self.target.clone() {
            Target::Url(url) => match cluster_nodes(&url) {
                Some(nodes) => {
                    let client = ClusterClient::builder(nodes)
                        .response_timeout(self.response_timeout)
                        .connection_timeout(self.connection_timeout)
                        .build()
                        .map_err(|e| connect_error(name, e))?;
                    self.cluster(&client).await?
                }
                None => {
                    let client = Client::open(url.as_str()).map_err(|e| connect_error(name, e))?;
                    self.single(client).await?
                }
            },
            Target::Client(client) => self.single(*client).await?,
            Target::Cluster(client) => self.cluster(&client).await?,
        };
        let capacity = proto_max_bulk_len(&conn).await;
        let store = RedisStore {
            inner: Arc::new(Inner {
                max_result_size: self
                    .max_result_size
                    .min(capacity.saturating_sub(RECORD_OVERHEAD)),
                conn,
                script: Script::new(SCRIPT),
                wait_for_replicas: self.wait_for_replicas,
                run_id: Mutex::new(None),
                history_resets: AtomicU64::new(0),
                recheck: std::sync::atomic::AtomicBool::new(false),
            }),
        };
        let health = store.check().await?;
        for warning in &health.warnings {
            tracing::warn!(server = %name, "{warning}");
        }
        if !health.unsafe_config.is_empty() {
            let problems = health.unsafe_config.join("; ");
            match self.on_unsafe_config {
                UnsafeConfig::Refuse => {
                    return Err(StoreError::new(
                        StoreErrorKind::Unsafe,
                        format!("refusing {name}: {problems}"),
                    ))
                }
                UnsafeConfig::Warn => {
                    tracing::warn!(server = %name, "unsafe Redis configuration: {problems}")
                }
            }
        }
        if let Ok(mut run_id) = store.inner.run_id.lock() {
            *run_id = health.run_id;
        }
        Ok(store)
    }

    async fn single(&self, client: Client) -> Result<Conn, StoreError> {
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.response_timeout))
            .set_connection_timeout(Some(self.connection_timeout))
            .set_number_of_retries(2);
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| connect_error(&self.name, e))?;
        Ok(Conn::Single(conn))
    }

    async fn cluster(&self, client: &ClusterClient) -> Result<Conn, StoreError> {
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| connect_error(&self.name, e))?;
        Ok(Conn::Cluster(conn))
    }
}

/// Where a [`RedisStoreBuilder`] connects.
#[derive(Debug, Clone)]
enum Target {
    Url(String),
    Client(Box<Client>),
    Cluster(Box<ClusterClient>),
}

fn cluster_nodes(url: &str) -> Option<Vec<String>> {
    let (scheme, rest) = url.split_once("+cluster://")?;
    Some(
        rest.split(',')
            .filter(|n| !n.is_empty())
            .map(|node| format!("{scheme}://{node}"))
            .collect(),
    )
}

fn connect_error(name: &str, err: RedisError) -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        format!("cannot connect to {name}"),
    )
    .with_source(err)
}

struct Inner {
    conn: Conn,
    script: Script,
    wait_for_replicas: Option<(u32, Duration)>,
    run_id: Mutex<Option<String>>,
    history_resets: AtomicU64,
    recheck: std::sync::atomic::AtomicBool,
    max_result_size: usize,
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
    inner: Arc<Inner>,
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
    /// Connects with the default settings (1 s timeouts, unsafe configurations refused).
    ///
    /// # Errors
    ///
    /// As [`RedisStoreBuilder::build`].
    pub async fn connect(url: &str) -> Result<RedisStore, StoreError> {
        RedisStore::builder(url).build().await
    }

    /// A builder for non-default settings.
    pub fn builder(url: &str) -> RedisStoreBuilder {
        RedisStoreBuilder::new(Target::Url(url.to_string()), redact(url))
    }

    /// A builder on a redis-rs client the application already has (its TLS, credentials
    /// and protocol settings are kept; the store opens its own auto-reconnecting
    /// connection with the builder's timeouts).
    ///
    /// ```no_run
    /// use idempotent_runtime::RedisStore;
    ///
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379")?;
    /// let store = RedisStore::from_client(client).build().await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn from_client(client: ::redis::Client) -> RedisStoreBuilder {
        let name = redact(&client.get_connection_info().addr().to_string());
        RedisStoreBuilder::new(Target::Client(Box::new(client)), name)
    }

    /// A builder on a redis-rs cluster client the application already has (its own
    /// timeouts and retry settings apply).
    pub fn from_cluster_client(client: ClusterClient) -> RedisStoreBuilder {
        RedisStoreBuilder::new(
            Target::Cluster(Box::new(client)),
            "the Redis Cluster".to_string(),
        )
    }

    /// How many times a reconnection found a different server `run_id` (a restart or a
    /// failover): each time, records written before may be gone.
    pub fn history_resets(&self) -> u64 {
        self.inner.history_resets.load(Ordering::Relaxed)
    }

    /// Runs the safety checks now and reports what they found.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] when the server cannot be reached.
    pub async fn check(&self) -> Result<Health, StoreError> {
        let mut health = Health::default();
        let info = match self.inner.conn.query(&::redis::cmd("INFO")).await {
            Ok(value) => text(&value),
            Err(err) if !(err.is_io_error() || err.is_timeout()) => {
                health.warnings.push(format!(
                    "cannot verify the server's configuration: INFO refused ({err})"
                ));
                return Ok(health);
            }
            Err(err) => return Err(command_error(err)),
        };
        let field = |name: &str| -> Option<&str> {
            info.lines().find_map(|line| {
                line.strip_prefix(name)
                    .and_then(|rest| rest.strip_prefix(':'))
                    .map(str::trim)
            })
        };
        health.run_id = field("run_id").map(str::to_string);
        match field("maxmemory_policy") {
            Some("noeviction") => {}
            Some(policy) => health.unsafe_config.push(format!(
                "maxmemory-policy is `{policy}`: the server may evict idempotency records (set it to `noeviction`)"
            )),
            None => health
                .warnings
                .push("cannot verify the eviction policy: INFO has no maxmemory_policy".into()),
        }
        match field("role") {
            Some("master") | None => {}
            Some(role) => health
                .unsafe_config
                .push(format!("the server is a {role}: connect to the primary")),
        }
        let aof = field("aof_enabled") == Some("1");
        if !aof {
            match self
                .inner
                .conn
                .query(::redis::cmd("CONFIG").arg("GET").arg("save"))
                .await
            {
                Ok(value) => {
                    let rdb = config_value(&value).is_some_and(|save| !save.trim().is_empty());
                    if !rdb {
                        health.warnings.push(
                            "Redis has no persistence (neither RDB snapshots nor AOF): a restart forgets every record; use a `done` check".into(),
                        );
                    }
                }
                Err(_) => health.warnings.push(
                    "cannot verify persistence: CONFIG GET is not allowed on this server".into(),
                ),
            }
        }
        Ok(health)
    }

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

fn text(value: &Value) -> String {
    match value {
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::VerbatimString { text, .. } => text.clone(),
        // A cluster answers INFO per node: the first node speaks for the checks.
        Value::Map(entries) => entries.first().map(|(_, v)| text(v)).unwrap_or_default(),
        _ => String::new(),
    }
}

/// The server's `proto-max-bulk-len`, or Redis' default where `CONFIG GET` is not allowed.
async fn proto_max_bulk_len(conn: &Conn) -> usize {
    let mut cmd = ::redis::cmd("CONFIG");
    cmd.arg("GET").arg("proto-max-bulk-len");
    conn.query(&cmd)
        .await
        .ok()
        .and_then(|value| config_value(&value))
        .and_then(|len| len.trim().parse().ok())
        .unwrap_or(DEFAULT_PROTO_MAX_BULK_LEN)
}

fn config_value(value: &Value) -> Option<String> {
    match value {
        Value::Array(items) => items.get(1).map(text),
        Value::Map(entries) => entries.first().map(|(_, v)| text(v)),
        _ => None,
    }
}

/// Maps a redis-rs error to a store error, keeping it as the source.
fn command_error(err: RedisError) -> StoreError {
    let kind = if err.is_connection_refusal() {
        StoreErrorKind::Unavailable
    } else if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() {
        // The command may have been applied before the connection failed.
        StoreErrorKind::OutcomeUnknown
    } else {
        match err.kind() {
            ::redis::ErrorKind::Parse | ::redis::ErrorKind::UnexpectedReturnType => {
                StoreErrorKind::Protocol
            }
            // Server replies (OOM, READONLY, LOADING, CLUSTERDOWN, ...) mean "not applied".
            _ => StoreErrorKind::Unavailable,
        }
    };
    StoreError::new(kind, "redis command failed").with_source(err)
}

/// Maps a script's error: a value it cannot read as a record is [`StoreErrorKind::Corrupt`].
fn script_error(key: &Key, err: RedisError) -> StoreError {
    if err.code() == Some(CORRUPT) {
        let why = err.detail().unwrap_or_default();
        return StoreError::new(
            StoreErrorKind::Corrupt,
            format!("the value under `{key}` is not a record: {why}"),
        )
        .with_source(err);
    }
    command_error(err)
}

fn protocol(what: impl std::fmt::Display) -> StoreError {
    StoreError::new(
        StoreErrorKind::Protocol,
        format!("unexpected reply: {what}"),
    )
}

fn int(value: &Value) -> Result<i64, StoreError> {
    match value {
        Value::Int(n) => Ok(*n),
        other => Err(protocol(format_args!("{other:?}"))),
    }
}

fn fence(value: Option<&Value>) -> Result<u64, StoreError> {
    let n = value.map_or(Err(protocol("missing fence")), int)?;
    u64::try_from(n).map_err(|_| protocol("negative fence"))
}

fn decode_claim(value: Value) -> Result<Claim, StoreError> {
    let Value::Array(items) = value else {
        return Err(protocol(format_args!("{value:?}")));
    };
    let code = items
        .first()
        .map_or(Err(protocol("empty claim reply")), int)?;
    let fence = fence(items.get(1))?;
    Ok(match code {
        1 => Claim::Acquired { fence },
        2 => Claim::Completed {
            fence,
            result: match items.get(2) {
                Some(Value::BulkString(bytes)) if !bytes.is_empty() => Some(bytes.clone()),
                _ => None,
            },
        },
        3 => Claim::InProgress { fence },
        4 => Claim::Mismatch { fence },
        other => return Err(protocol(format_args!("claim code {other}"))),
    })
}

/// A record's decimal field: digits only, at most [`MAX_EXACT`].
fn number(field: &[u8]) -> Option<u64> {
    if field.is_empty() || !field.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(field)
        .ok()?
        .parse()
        .ok()
        .filter(|&n| n <= MAX_EXACT)
}

fn decode_record(key: &Key, value: Value) -> Result<Option<Record>, StoreError> {
    let Value::Array(items) = value else {
        return Err(protocol(format_args!("{value:?}")));
    };
    let now = items.get(1).map_or(Err(protocol("missing time")), int)?;
    let bytes = match items.first() {
        Some(Value::BulkString(bytes)) => bytes,
        Some(Value::Nil) | None => return Ok(None),
        Some(other) => return Err(protocol(format_args!("{other:?}"))),
    };
    parse_record(bytes, now).map(Some).ok_or_else(|| {
        StoreError::new(
            StoreErrorKind::Corrupt,
            format!("the value under `{key}` is not a record"),
        )
    })
}

/// A record in the script's format, read as strictly as the script reads it.
fn parse_record(bytes: &[u8], now_ms: i64) -> Option<Record> {
    let state = *bytes.first()?;
    let token: [u8; 16] = bytes.get(1..17)?.try_into().ok()?;
    let (fingerprint, rest) = match bytes.get(17)? {
        b'F' => {
            let fp: [u8; 16] = bytes.get(18..34)?.try_into().ok()?;
            (Some(Fingerprint::from_bytes(fp)), bytes.get(34..)?)
        }
        b'-' => (None, bytes.get(18..)?),
        _ => return None,
    };
    let mut fields = rest.splitn(3, |&b| b == b':');
    let fence = number(fields.next()?)?;
    let lease_end = i64::try_from(number(fields.next()?)?).ok()?;
    let result = fields.next()?;
    let state = match state {
        b'P' => RecordState::InProgress {
            lease_left: Duration::from_millis(
                u64::try_from(lease_end.saturating_sub(now_ms)).unwrap_or(0),
            ),
        },
        b'C' => RecordState::Completed,
        b'R' => RecordState::Released,
        _ => return None,
    };
    Some(Record {
        state,
        token: Token::from_bytes(token),
        fence,
        fingerprint,
        result: (!result.is_empty()).then(|| result.to_vec()),
    })
}

impl RedisStore {
    fn claim_invocation(&self, req: &ClaimRequest) -> ::redis::ScriptInvocation<'_> {
        let fingerprint: &[u8] = req.fingerprint.as_ref().map_or(&[], |f| f.as_bytes());
        let mut invocation = self.inner.script.prepare_invoke();
        invocation
            .key(req.key.as_bytes())
            .arg("claim")
            .arg(req.token.as_bytes())
            .arg(clamped_millis(req.lease))
            .arg(clamped_millis(req.ttl))
            .arg(fingerprint);
        invocation
    }

    /// Every claim in one pipeline: one round trip. Items the server answers `NOSCRIPT`
    /// (the script was flushed) are claimed again one by one, which reloads it.
    async fn claim_pipelined(
        &self,
        conn: &ConnectionManager,
        reqs: &[ClaimRequest],
    ) -> Vec<Result<Claim, StoreError>> {
        let invocations: Vec<_> = reqs.iter().map(|req| self.claim_invocation(req)).collect();
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

impl Store for RedisStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            let invocation = self.claim_invocation(req);
            let claim = decode_claim(self.call(&req.key, &invocation).await?)?;
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
            let mut invocation = self.inner.script.prepare_invoke();
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
        Box::pin(async move {
            let mut invocation = self.inner.script.prepare_invoke();
            invocation
                .key(key.as_bytes())
                .arg("release")
                .arg(token.as_bytes());
            Ok(int(&self.call(key, &invocation).await?)? == 1)
        })
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_through_the_wire_format() {
        let token = Token::generate();
        let mut bytes = vec![b'P'];
        bytes.extend_from_slice(token.as_bytes());
        bytes.push(b'F');
        bytes.extend_from_slice(&[7u8; 16]);
        bytes.extend_from_slice(b"12:5000:");
        let record = parse_record(&bytes, 3000).unwrap();
        assert_eq!(record.token, token);
        assert_eq!(record.fence, 12);
        assert_eq!(record.fingerprint, Some(Fingerprint::from_bytes([7; 16])));
        assert_eq!(
            record.state,
            RecordState::InProgress {
                lease_left: Duration::from_secs(2)
            }
        );
        assert_eq!(record.result, None);

        let mut done = vec![b'C'];
        done.extend_from_slice(token.as_bytes());
        done.extend_from_slice(b"-3:0:o:{\"a\":1}");
        let record = parse_record(&done, 0).unwrap();
        assert_eq!(record.state, RecordState::Completed);
        assert_eq!(record.fingerprint, None);
        assert_eq!(record.result.as_deref(), Some(&b"o:{\"a\":1}"[..]));
    }

    #[test]
    fn values_that_are_not_records_are_refused() {
        let token = Token::generate();
        let shaped = |state: u8, marker: u8, fields: &[u8]| {
            let mut v = vec![state];
            v.extend_from_slice(token.as_bytes());
            v.push(marker);
            v.extend_from_slice(fields);
            v
        };
        assert!(parse_record(&shaped(b'C', b'-', b"1796000000000000:0:"), 0).is_some());
        for bad in [
            Vec::new(),
            b"P".to_vec(),
            shaped(b'X', b'-', b"7:0:"),
            shaped(b'C', b'?', b"7:0:"),
            shaped(b'C', b'F', b"7:0:"),
            shaped(b'C', b'-', b"seven:0:"),
            shaped(b'C', b'-', b"+7:0:"),
            shaped(b'C', b'-', b":0:"),
            shaped(b'C', b'-', b"7:-1:"),
            shaped(b'C', b'-', b"7:0"),
            shaped(b'C', b'-', b"9007199254740991:0:"),
        ] {
            assert_eq!(
                parse_record(&bad, 0),
                None,
                "{:?}",
                String::from_utf8_lossy(&bad)
            );
        }
    }

    #[test]
    fn cluster_urls_list_their_nodes() {
        assert_eq!(
            cluster_nodes("redis+cluster://a:1,b:2"),
            Some(vec!["redis://a:1".to_string(), "redis://b:2".to_string()])
        );
        assert_eq!(cluster_nodes("redis://a:1"), None);
    }
}
