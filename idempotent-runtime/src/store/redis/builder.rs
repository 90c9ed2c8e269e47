//! [`RedisStoreBuilder`]: connecting, and the safety checks on the server's configuration.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClient;
use ::redis::{Client, Value};

use crate::error::{StoreError, StoreErrorKind};
use crate::store::redact::redact;
#[cfg(doc)]
use crate::store::Store;
use crate::store::DEFAULT_MAX_RESULT_SIZE;

use crate::store::redis::batch::SlotMap;
use crate::store::redis::clock::{ServerClock, DEFAULT_MAX_ERROR, MAX_FAST_CLAIM_ERROR};
use crate::store::redis::conn::{command_error, connect_error, Conn, Lua};
use crate::store::redis::sentinel::Primary;
use crate::store::redis::sentinel_url::{sentinel_target, SentinelTarget};
use crate::store::redis::store::{Inner, RedisStore, ENDING, READ, SCRIPT};
use crate::store::redis::wire::text;

/// Redis' default `proto-max-bulk-len` (512 MiB): the largest argument a server takes, assumed
/// when `CONFIG GET` is not allowed.
const DEFAULT_PROTO_MAX_BULK_LEN: usize = 512 << 20;

/// Room left in an argument for a record's other fields (state, token, fingerprint, fence,
/// lease end): a stored result is at most `proto-max-bulk-len` less this.
const RECORD_OVERHEAD: usize = 128;

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
    /// The server's `redis_version` (the first node's, on a cluster).
    pub version: Option<String>,
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
    fast_claims: bool,
    fast_claim_max_error: Duration,
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
            fast_claims: true,
            fast_claim_max_error: DEFAULT_MAX_ERROR,
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

    /// Durable claims, renewals and completions: each counts only once `replicas` replicas
    /// acknowledged it, waiting at most `timeout` (`WAIT`, sent in one pipeline with the
    /// write, so it costs no extra round trip). A claim that is not replicated in time is
    /// given back and the call fails closed (the handler does not run); a completion that is
    /// not is retried in the background until it is, and never released; a renewal that is
    /// not counts as failed. With `replicas` equal to the number of replicas Sentinel may
    /// promote, a failover keeps every claim and completion the store reported; with fewer,
    /// it keeps them when the promoted replica is one that acknowledged. The reply timeout
    /// grows by `timeout`. A batch is one pipeline with one `WAIT` behind its writes, whose
    /// verdict is every item's (an unreplicated batch of claims is given back whole).
    /// Standalone servers and Sentinel only.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use idempotent_runtime::RedisStore;
    ///
    /// # async fn f() -> Result<(), idempotent_runtime::StoreError> {
    /// let store = RedisStore::builder("redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/orders")
    ///     .wait_for_replicas(1, Duration::from_millis(200))
    ///     .build()
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
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

    /// Whether a key without a record may be claimed with one native command (default: on,
    /// where it applies). The claim is then `SET key <record> NX PX <lifetime> GET`, whose
    /// value already is the in-progress record, instead of the claim script: a first delivery
    /// and a duplicate each cost the server one `SET` rather than a script run. The record's
    /// fence and lease end come from the server's clock as the store last read it (`TIME`,
    /// refreshed every half second), moved forward by the client's monotonic clock, with a
    /// bound on the error; the fast claim is used only while that bound is at most a
    /// millisecond ([`fast_claim_max_error`](Self::fast_claim_max_error)) and for leases and
    /// ttls of at least a second, so fences still grow across expiry. The claim is recorded at the estimate's upper bound (the fence, in
    /// microseconds; its millisecond for the claim's time and the lease's start), so that the
    /// owner's completion can name the record byte for byte; the lease therefore ends at most
    /// 2 ms late, never earlier than the millisecond's rounding. A record the `SET` finds that
    /// needs a decision on the server's clock (a released record, a lease at or near its end,
    /// a value that is no record) is claimed by the script, as without the fast claim.
    ///
    /// It applies to standalone servers of version 7.0 or later (`SET ... NX GET`); a
    /// cluster or an older server always uses the script.
    pub fn fast_claims(mut self, enabled: bool) -> Self {
        self.fast_claims = enabled;
        self
    }

    /// The largest error of the estimate of the server's clock that the fast claim accepts
    /// (default 1 ms, at most 100 ms; see [`fast_claims`](Self::fast_claims)). The estimate's
    /// error is half the round trip of the store's last precise `TIME` reading, grown by the
    /// time since: over a network whose round trip is longer than 2 ms (another zone, a
    /// loaded link), readings are less precise than the default accepts and claims go through
    /// the script, which costs the server more. A larger bound keeps them fast, and costs
    /// this: the fast claim is then used only for leases and ttls of at least a thousand times
    /// the bound (1 s at the default, 20 s at 20 ms), so that fences keep growing across
    /// expiry, and a fast-claimed lease may end up to twice the bound later than it would on
    /// the server's own clock (never earlier: an owner's lease is never shorter than it
    /// thinks).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::RedisStore;
    ///
    /// let builder = RedisStore::builder("redis://10.0.0.5:6379")
    ///     .fast_claim_max_error(Duration::from_millis(5));
    /// # drop(builder);
    /// ```
    ///
    /// A bound over 100 ms makes [`build`](Self::build) fail with
    /// [`StoreErrorKind::Rejected`].
    pub fn fast_claim_max_error(mut self, bound: Duration) -> Self {
        self.fast_claim_max_error = bound;
        self
    }

    /// Connects and runs the safety checks.
    ///
    /// `redis://` and `rediss://` URLs name a standalone server; `redis+cluster://` and
    /// `rediss+cluster://` URLs list cluster nodes separated by commas
    /// (`redis+cluster://10.0.0.1:7000,10.0.0.2:7000`); a `redis+sentinel://` URL lists
    /// sentinels and names the service whose primary the store uses, with an optional
    /// database and credentials for the primary:
    /// `redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]`
    /// (`redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/orders`; a host
    /// without a port is on 26379). See [`RedisStore::sentinel`].
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Unavailable`] when the server cannot be reached (for Sentinel: no
    /// sentinel answers, none knows the service, or the node they name is not a writable
    /// primary), [`StoreErrorKind::Unsafe`] when its configuration is refused,
    /// [`StoreErrorKind::Rejected`] for a malformed Sentinel URL or a
    /// [`fast_claim_max_error`](Self::fast_claim_max_error) over 100 ms.
    pub async fn build(self) -> Result<RedisStore, StoreError> {
        let name = self.name.as_str();
        if self.fast_claim_max_error > MAX_FAST_CLAIM_ERROR {
            return Err(StoreError::new(
                StoreErrorKind::Rejected,
                format!(
                    "`fast_claim_max_error` is {:?}, over the largest accepted, {MAX_FAST_CLAIM_ERROR:?}",
                    self.fast_claim_max_error
                ),
            ));
        }
        let cluster = match &self.target {
            Target::Url(url) => cluster_nodes(url).is_some(),
            Target::Client(_) | Target::Sentinel(_) => false,
            Target::Cluster(_) => true,
        };
        if cluster && self.wait_for_replicas.is_some() {
            return Err(StoreError::new(
                StoreErrorKind::Unsafe,
                "`wait_for_replicas` is supported on standalone servers and behind Sentinel only",
            ));
        }
        let conn = match self.target.clone() {
            Target::Url(url) if url.starts_with("redis+sentinel://") => {
                let target = sentinel_target(&url).unwrap_or_else(|| {
                    Err(StoreError::new(
                        StoreErrorKind::Rejected,
                        "not a Sentinel URL",
                    ))
                })?;
                self.sentinel(target).await?
            }
            Target::Sentinel(target) => self.sentinel(*target).await?,
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
                // Decided below, once the server's version is known.
                fast_claims: false,
                clock: ServerClock::new(self.fast_claim_max_error),
                slots: SlotMap::default(),
                conn,
                script: Lua::new(SCRIPT),
                ending: Lua::new(ENDING),
                reading: Lua::new(READ),
                wait_for_replicas: self.wait_for_replicas,
                run_id: Mutex::new(None),
                history_resets: AtomicU64::new(0),
                recheck: AtomicBool::new(false),
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
            *run_id = health.run_id.clone();
        }
        let standalone = !store.inner.conn.is_cluster();
        let set_nx_get = health
            .version
            .as_deref()
            .and_then(|v| v.split('.').next()?.parse::<u32>().ok())
            .is_some_and(|major| major >= 7);
        if self.fast_claims && standalone && set_nx_get {
            // The first reading of the server's clock, so the first claims can be fast. Claims
            // go through the script until a reading succeeds.
            if let Err(err) = store.read_clock().await {
                tracing::debug!(server = %name, error = %err, "cannot read the server's clock yet");
            }
            let mut inner = Arc::into_inner(store.inner).ok_or_else(|| {
                StoreError::new(StoreErrorKind::Protocol, "the new store is shared")
            })?;
            inner.fast_claims = true;
            return Ok(RedisStore {
                inner: Arc::new(inner),
            });
        }
        Ok(store)
    }

    fn manager_config(&self) -> ConnectionManagerConfig {
        // A durable write's reply waits for its `WAIT` too.
        let waited = self.wait_for_replicas.map_or(Duration::ZERO, |(_, t)| t);
        ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.response_timeout + waited))
            .set_connection_timeout(Some(self.connection_timeout))
            .set_number_of_retries(2)
    }

    async fn single(&self, client: Client) -> Result<Conn, StoreError> {
        let conn = ConnectionManager::new_with_config(client, self.manager_config())
            .await
            .map_err(|e| connect_error(&self.name, e))?;
        Ok(Conn::Single(conn))
    }

    async fn sentinel(&self, target: SentinelTarget) -> Result<Conn, StoreError> {
        // The sentinels, then the primary they name, then the sentinels and replicas again.
        let probe = self.connection_timeout.max(self.response_timeout);
        let lookup = 2 * (self.connection_timeout + self.response_timeout);
        let primary =
            Primary::connect(target, self.manager_config(), probe, lookup, &self.name).await?;
        Ok(Conn::Sentinel(Arc::new(primary)))
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
    Sentinel(Box<SentinelTarget>),
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

    /// A builder for the primary of `service`, found through the Redis Sentinels at
    /// `sentinels` (`host:port` each) and followed across failovers: after a failover the
    /// store moves to the new primary by itself, and never sends a write to a replica. The
    /// same as a `redis+sentinel://` URL ([`builder`](Self::builder)).
    ///
    /// ```no_run
    /// use idempotent_runtime::RedisStore;
    ///
    /// # async fn f() -> Result<(), idempotent_runtime::StoreError> {
    /// let store = RedisStore::sentinel(["10.0.0.1:26379", "10.0.0.2:26379", "10.0.0.3:26379"], "orders")
    ///     .build()
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn sentinel<I, S>(sentinels: I, service: &str) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let sentinels: Vec<String> = sentinels
            .into_iter()
            .map(|s| format!("redis://{}", s.as_ref().trim_start_matches("redis://")))
            .collect();
        let name = format!("the Sentinel service `{service}` ({})", sentinels.join(","));
        RedisStoreBuilder::new(
            Target::Sentinel(Box::new(SentinelTarget {
                sentinels,
                service: service.to_string(),
                db: 0,
                username: None,
                password: None,
            })),
            redact(&name),
        )
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
        health.version = field("redis_version").map(str::to_string);
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
        if let Conn::Sentinel(primary) = &self.inner.conn {
            self.check_replicas(primary.service(), &mut health).await;
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
}

impl RedisStore {
    /// Behind Sentinel: warns when the primary takes writes that no replica has (a write
    /// acknowledged just before a failover is then lost with the old primary).
    async fn check_replicas(&self, service: &str, health: &mut Health) {
        let mut cmd = ::redis::cmd("CONFIG");
        cmd.arg("GET").arg("min-replicas-to-write");
        match self.inner.conn.query(&cmd).await {
            Ok(value) => {
                let min = config_value(&value).and_then(|v| v.trim().parse::<u32>().ok());
                if min == Some(0) {
                    health.warnings.push(format!(
                        "the primary of `{service}` accepts writes with no replica attached \
                         (min-replicas-to-write 0): Redis replicates asynchronously, so a claim \
                         or completion acknowledged just before a failover can be lost, and the \
                         next delivery then runs again; use `wait_for_replicas` and a `done` \
                         check, or set min-replicas-to-write"
                    ));
                }
            }
            Err(_) => health.warnings.push(
                "cannot verify min-replicas-to-write: CONFIG GET is not allowed on this server"
                    .into(),
            ),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_list_their_nodes() {
        assert_eq!(
            cluster_nodes("redis+cluster://a:1,b:2"),
            Some(vec!["redis://a:1".to_string(), "redis://b:2".to_string()])
        );
        assert_eq!(cluster_nodes("redis://a:1"), None);
    }
}
