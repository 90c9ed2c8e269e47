//! A primary found through Redis Sentinel, followed across failovers.
//!
//! **Finding the primary.** Every sentinel is asked (`SENTINEL MASTER <service>` and
//! `SENTINEL REPLICAS <service>`, all at once, each within the lookup timeout). Sentinels
//! that see the primary down or a failover in progress do not count; of the others, the
//! answer with the highest configuration epoch wins (a sentinel that has not yet heard of the
//! last failover names the old primary with an older epoch), and the node it names must
//! answer as a master. While a sentinel sees a
//! failover under way (or the primary objectively down), no primary of that epoch or an older
//! one is confirmed: the sentinels that have not heard of the failover yet name the old
//! primary, which, if it stalled and came back, answers as a master until it is demoted, and
//! loses what it took then. The leader of the failover may not answer; the replicas are asked
//! too, and a replica promoted by a failover under way vetoes it ([`succession`]). The
//! replicas and the sentinels are asked (again) after the primary answered, so that a
//! primary that answers late (it stalled, and resumed while a replica was promoted) is not
//! confirmed on answers older than its own. The store never moves to a primary of an older
//! epoch than the one it uses.
//!
//! **Following it.** Commands go to that primary through one auto-reconnecting connection,
//! as to a standalone server. `READONLY` (a demoted primary) or a refused connection (the
//! command was not applied) makes the store look the primary up again and, if it moved, send
//! the command once more to the new one. A connection that drops or does not answer in time
//! (the command may have been applied) makes the primary *suspect*: the error goes back to
//! the caller, which resolves it as every unknown outcome is resolved, and no further command
//! is sent until a lookup confirms a primary. A primary that stalled, lost its role to a
//! replica, and then came back is therefore never written to in the moment before the
//! sentinels demote it (writes it took then would be lost with its data).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::{
    AsyncConnectionConfig, Client, Cmd, ErrorKind, Pipeline, RedisConnectionInfo, RedisError,
    ServerErrorKind, Value,
};

use crate::error::{StoreError, StoreErrorKind};
use crate::store::redis::sentinel_url::SentinelTarget;
use crate::store::redis::succession::{self, Listed};

/// The current primary's connection, and the sentinels that name it.
pub(super) struct Primary {
    finder: Finder,
    current: RwLock<Current>,
    /// Held while the sentinels are asked after a failed command; when they were last asked.
    following: tokio::sync::Mutex<Option<Instant>>,
    /// Set when a command's connection failed under it: nothing is sent until a lookup
    /// confirms a primary.
    suspect: AtomicBool,
}

/// The least time between two lookups after failed commands: while the sentinels still name
/// a primary that does not answer, failed commands do not each ask them again.
const MIN_LOOKUP_INTERVAL: Duration = Duration::from_millis(100);

/// The sentinels, and how to connect to the primary they name.
struct Finder {
    target: SentinelTarget,
    sentinels: Vec<Client>,
    /// The primary's database and credentials.
    node: RedisConnectionInfo,
    config: ConnectionManagerConfig,
    /// Timeouts of the connections a lookup opens.
    probe: AsyncConnectionConfig,
    /// How long one lookup may take in all.
    lookup_timeout: Duration,
}

#[derive(Clone)]
struct Current {
    conn: ConnectionManager,
    /// The primary's address, as the sentinels gave it.
    addr: (String, u16),
    /// The configuration epoch the sentinels named it with.
    epoch: u64,
    /// Counts the primaries followed: 0 for the first.
    generation: u64,
}

/// What one sentinel says of the service.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Named {
    addr: (String, u16),
    epoch: u64,
    /// The sentinel sees the primary down, or a failover under way.
    doubtful: bool,
    /// The sentinel sees a failover of this primary under way, or the primary objectively
    /// down (the quorum agrees): no primary of this epoch or an older one is confirmed then.
    failing_over: bool,
    /// The replicas the sentinel lists.
    replicas: Vec<Listed>,
}

impl Primary {
    /// Finds the primary and connects to it.
    pub(super) async fn connect(
        target: SentinelTarget,
        config: ConnectionManagerConfig,
        probe_timeout: Duration,
        lookup_timeout: Duration,
        name: &str,
    ) -> Result<Primary, StoreError> {
        let sentinels = target
            .sentinels
            .iter()
            .map(|url| Client::open(url.as_str()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|err| {
                StoreError::new(
                    StoreErrorKind::Rejected,
                    format!("invalid sentinel addresses in {name}"),
                )
                .with_source(err)
            })?;
        let mut node = RedisConnectionInfo::default().set_db(target.db);
        if let Some(user) = &target.username {
            node = node.set_username(user);
        }
        if let Some(password) = &target.password {
            node = node.set_password(password);
        }
        let finder = Finder {
            target,
            sentinels,
            node,
            config,
            probe: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(probe_timeout))
                .set_response_timeout(Some(probe_timeout)),
            lookup_timeout,
        };
        let (named, client) = finder.find(name).await?;
        let conn = finder.connect(client).await?;
        Ok(Primary {
            finder,
            current: RwLock::new(Current {
                conn,
                addr: named.addr,
                epoch: named.epoch,
                generation: 0,
            }),
            following: tokio::sync::Mutex::new(None),
            suspect: AtomicBool::new(false),
        })
    }

    /// The service name.
    pub(super) fn service(&self) -> &str {
        &self.finder.target.service
    }

    /// The address of the primary commands go to now.
    pub(super) fn address(&self) -> String {
        let (host, port) = self.current().addr;
        format!("{host}:{port}")
    }

    /// How many times the store moved to another primary.
    pub(super) fn generation(&self) -> u64 {
        self.current().generation
    }

    fn current(&self) -> Current {
        match self.current.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }
}

impl Finder {
    /// Asks every sentinel, and returns the primary of the highest epoch among those no
    /// sentinel doubts, checked to answer as a master, then named again by the sentinels and
    /// vetoed by none of its replicas.
    ///
    /// The sentinels and the replicas are asked again after the primary answered, not with
    /// it: the primary's answer can come late (a stalled primary answers once it resumes),
    /// and a failover may have promoted a replica meanwhile. Every answer the confirmation
    /// rests on is then at least as recent as the primary's own.
    async fn find(&self, name: &str) -> Result<(Named, Client), StoreError> {
        let service = &self.target.service;
        let unavailable = |why: String| StoreError::new(StoreErrorKind::Unavailable, why);
        let (named, lists) = self.named(name).await?;
        let client = succession::client(&named.addr, &self.node).map_err(|err| {
            unavailable(format!("cannot address the primary of `{service}`")).with_source(err)
        })?;
        let (host, port) = (&named.addr.0, named.addr.1);
        let primary = tokio::time::timeout(self.lookup_timeout, self.replication(&client)).await;
        let primary = match primary {
            Ok(Ok(info)) => match succession::Replication::parse(&info) {
                Some(primary) if primary.master => primary,
                Some(_) => {
                    return Err(unavailable(format!(
                        "the node {host}:{port} the sentinels name for `{service}` is not a writable primary (it answers as a replica)"
                    )))
                }
                None => {
                    return Err(unavailable(format!(
                        "the node {host}:{port} the sentinels name for `{service}` answered INFO replication without its role or history: {info:?}"
                    )))
                }
            },
            Ok(Err(err)) => {
                return Err(unavailable(format!(
                    "the primary {host}:{port} of `{service}` does not answer"
                ))
                .with_source(err))
            }
            Err(_) => {
                return Err(unavailable(format!(
                    "the primary {host}:{port} of `{service}` did not answer within {:?}",
                    self.lookup_timeout
                )))
            }
        };
        // The sentinels again, and every replica a sentinel reaches (see `succession`), at
        // once, now that the primary answered.
        let replicas = succession::to_ask(lists.iter().map(Vec::as_slice), &named.addr);
        let asked_replicas = futures_util::future::join_all(replicas.iter().map(|addr| async {
            let client = succession::client(addr, &self.node).ok()?;
            let info = tokio::time::timeout(self.lookup_timeout, self.replication(&client));
            succession::Replication::parse(&info.await.ok()?.ok()?)
        }));
        let (again, answered) = futures_util::future::join(self.named(name), asked_replicas).await;
        let (again, _) = again?;
        if again.addr != named.addr || again.epoch != named.epoch {
            return Err(unavailable(format!(
                "the sentinels of {name} named {host}:{port} the primary of `{service}` (epoch {}), then {}:{} (epoch {}) while it was checked; \
                 no primary is confirmed until they agree",
                named.epoch, again.addr.0, again.addr.1, again.epoch
            )));
        }
        let answered: Vec<_> = replicas.into_iter().zip(answered).collect();
        if let Some(why) = succession::veto(&primary, &answered) {
            return Err(unavailable(format!(
                "the sentinels of {name} name {host}:{port} the primary of `{service}`, but {why}; \
                 no primary is confirmed until the sentinels name the new one"
            )));
        }
        Ok((named, client))
    }

    /// Asks every sentinel: the primary of the highest epoch among those no sentinel doubts,
    /// when no sentinel sees a failover of that epoch or a later one under way, and every
    /// answering sentinel's list of replicas.
    async fn named(&self, name: &str) -> Result<(Named, Vec<Vec<Listed>>), StoreError> {
        let service = &self.target.service;
        let unavailable = |why: String| StoreError::new(StoreErrorKind::Unavailable, why);
        let asked = futures_util::future::join_all(
            self.sentinels.iter().map(|sentinel| self.ask(sentinel)),
        );
        let answers = tokio::time::timeout(self.lookup_timeout, asked)
            .await
            .map_err(|_| {
                unavailable(format!(
                    "the sentinels of {name} did not answer within {:?}",
                    self.lookup_timeout
                ))
            })?;
        let mut unknown = 0;
        let mut last_error = None;
        let mut best: Option<Named> = None;
        // The newest epoch a sentinel sees failing over: while a failover is under way the
        // sentinels that have not heard of it yet name the old primary, no longer down if it
        // came back, and it still answers as a master; what it takes then is lost
        // when the sentinels demote it.
        let mut failing_over: Option<u64> = None;
        // Every answering sentinel's list of replicas.
        let mut lists: Vec<Vec<Listed>> = Vec::new();
        for answer in answers {
            if let Ok(Some(named)) = &answer {
                lists.push(named.replicas.clone());
            }
            match answer {
                Ok(Some(named)) if !named.doubtful => {
                    if best.as_ref().is_none_or(|b| named.epoch > b.epoch) {
                        best = Some(named);
                    }
                }
                Ok(Some(named)) => {
                    if named.failing_over {
                        failing_over = failing_over.max(Some(named.epoch));
                    }
                }
                Ok(None) => unknown += 1,
                Err(err) => last_error = Some(err),
            }
        }
        let Some(named) = best else {
            if unknown == self.sentinels.len() {
                return Err(unavailable(format!(
                    "no sentinel of {name} knows the service `{service}`"
                )));
            }
            let err = unavailable(format!(
                "no sentinel of {name} names a primary for `{service}` that it does not doubt"
            ));
            return Err(match last_error {
                Some(source) => err.with_source(source),
                None => err,
            });
        };
        if let Some(epoch) = failing_over.filter(|&epoch| named.epoch <= epoch) {
            return Err(unavailable(format!(
                "a sentinel of {name} sees a failover of `{service}` under way (epoch {epoch}); \
                 no primary is confirmed until it ends"
            )));
        }
        Ok((named, lists))
    }

    /// The `INFO replication` text of the node `client` addresses.
    async fn replication(&self, client: &Client) -> Result<String, RedisError> {
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&self.probe)
            .await?;
        ::redis::cmd("INFO")
            .arg("replication")
            .query_async::<String>(&mut conn)
            .await
    }

    /// One sentinel's view of the service: `None` when it does not know it.
    async fn ask(&self, sentinel: &Client) -> Result<Option<Named>, RedisError> {
        let mut conn = sentinel
            .get_multiplexed_async_connection_with_config(&self.probe)
            .await?;
        // The service and its replicas, in one round trip; a server error (an unknown
        // service) is a reply here, not the pipeline's failure.
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        pipe.cmd("SENTINEL")
            .arg("MASTER")
            .arg(&self.target.service)
            .cmd("SENTINEL")
            .arg("REPLICAS")
            .arg(&self.target.service);
        let mut replies = pipe.query_async::<Vec<Value>>(&mut conn).await?.into_iter();
        let (reply, replicas) = (replies.next(), replies.next());
        let fields: Vec<(String, String)> = match reply {
            Some(Value::ServerError(err)) => {
                let err = RedisError::from(err);
                if err.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
                    || err.to_string().contains("No such master")
                {
                    return Ok(None);
                }
                return Err(err);
            }
            Some(entry) => match succession::fields(&entry, text) {
                Some(fields) => fields,
                None => return Ok(None),
            },
            None => return Ok(None),
        };
        let field = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        let (Some(ip), Some(port)) = (field("ip"), field("port").and_then(|p| p.parse().ok()))
        else {
            return Ok(None);
        };
        let flags = field("flags").unwrap_or_default();
        let flagged = |names: &[&str]| {
            names
                .iter()
                .any(|flag| flags.split(',').any(|f| f == *flag))
        };
        Ok(Some(Named {
            addr: (ip.to_string(), port),
            epoch: field("config-epoch")
                .and_then(|e| e.parse().ok())
                .unwrap_or(0),
            doubtful: flagged(&["s_down", "o_down", "failover_in_progress", "disconnected"]),
            failing_over: flagged(&["o_down", "failover_in_progress"]),
            replicas: replicas.map_or_else(Vec::new, |r| succession::listed(&r, text)),
        }))
    }

    /// Connects to the primary `client` names.
    async fn connect(&self, client: Client) -> Result<ConnectionManager, StoreError> {
        let addr = client.get_connection_info().addr().to_string();
        ConnectionManager::new_with_config(client, self.config.clone())
            .await
            .map_err(|err| {
                StoreError::new(
                    StoreErrorKind::Unavailable,
                    format!(
                        "cannot connect to the primary {addr} of `{}`",
                        self.target.service
                    ),
                )
                .with_source(err)
            })
    }
}

/// A reply as text.
fn text(value: &Value) -> String {
    match value {
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(n) => n.to_string(),
        _ => String::new(),
    }
}

impl Primary {
    /// Looks the primary up (one caller at a time, at most every [`MIN_LOOKUP_INTERVAL`]; a
    /// caller that waited for another's lookup uses its answer) and moves to it if it is
    /// another node of the same or a later epoch. Clears the suspicion when a lookup named a
    /// primary. Whether commands now go to another primary than at `seen`.
    async fn follow(&self, seen: u64) -> bool {
        let mut last = self.following.lock().await;
        if self.generation() != seen {
            return true;
        }
        if last.is_some_and(|at| at.elapsed() < MIN_LOOKUP_INTERVAL) {
            return false;
        }
        let found = self.finder.find(self.service()).await;
        *last = Some(Instant::now());
        let (named, client) = match found {
            Ok(found) => found,
            Err(err) => {
                tracing::debug!(error = %err, "no primary confirmed after a failed command");
                return false;
            }
        };
        let current = self.current();
        if named.addr == current.addr || named.epoch < current.epoch {
            // The same primary (its connection reconnects by itself), or an older view.
            self.suspect.store(false, Ordering::Release);
            return false;
        }
        let conn = match self.finder.connect(client).await {
            Ok(conn) => conn,
            Err(err) => {
                tracing::warn!(error = %err, "cannot connect to the new Redis primary");
                return false;
            }
        };
        let Ok(mut current) = self.current.write() else {
            return false;
        };
        tracing::warn!(
            service = %self.finder.target.service,
            from = %format!("{}:{}", current.addr.0, current.addr.1),
            to = %format!("{}:{}", named.addr.0, named.addr.1),
            epoch = named.epoch,
            "the Redis primary changed (failover): commands go to the new primary"
        );
        *current = Current {
            conn,
            addr: named.addr,
            epoch: named.epoch,
            generation: seen + 1,
        };
        self.suspect.store(false, Ordering::Release);
        true
    }

    /// The connection to send on: the current primary's, once confirmed if it is suspect.
    async fn confirmed(&self) -> Result<Current, RedisError> {
        if self.suspect.load(Ordering::Acquire) {
            self.follow(self.generation()).await;
            if self.suspect.load(Ordering::Acquire) {
                return Err(RedisError::from((
                    ErrorKind::Client,
                    "the Redis primary is suspect (its connection failed) and no sentinel confirmed a primary yet; nothing was sent",
                )));
            }
        }
        Ok(self.current())
    }

    /// Sends `cmd` to the primary; see the module docs for what happens after a failover.
    pub(super) async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        let current = self.confirmed().await?;
        let mut conn = current.conn;
        let reply = conn.req_packed_command(cmd).await;
        match moved(&reply) {
            Moved::No => reply,
            Moved::NotApplied => {
                if self.follow(current.generation).await {
                    let mut conn = self.current().conn;
                    conn.req_packed_command(cmd).await
                } else {
                    reply
                }
            }
            Moved::Unknown => {
                self.suspect.store(true, Ordering::Release);
                self.follow(current.generation).await;
                reply
            }
        }
    }

    /// Sends `pipe` to the primary. A pipeline is not sent again: some of its commands may
    /// have been applied; the caller resolves each item.
    pub(super) async fn pipeline(&self, pipe: &Pipeline) -> Result<Vec<Value>, RedisError> {
        let current = self.confirmed().await?;
        let mut conn = current.conn;
        let replies: Result<Vec<Value>, RedisError> = pipe.query_async(&mut conn).await;
        let moved = match &replies {
            Ok(values) if values.iter().any(|v| {
                matches!(v, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::ReadOnly))
            }) =>
            {
                Moved::NotApplied
            }
            Ok(_) => Moved::No,
            Err(err) => moved_err(err),
        };
        match moved {
            Moved::No => {}
            Moved::NotApplied => {
                self.follow(current.generation).await;
            }
            Moved::Unknown => {
                self.suspect.store(true, Ordering::Release);
                self.follow(current.generation).await;
            }
        }
        replies
    }
}

/// What an error says about the primary.
enum Moved {
    /// Nothing.
    No,
    /// The node is not (or no longer) a writable primary, or it could not be reached: the
    /// command was not applied.
    NotApplied,
    /// The connection failed under the command: it may have been applied.
    Unknown,
}

fn moved(reply: &Result<Value, RedisError>) -> Moved {
    match reply {
        Ok(Value::ServerError(e)) if e.kind() == Some(ServerErrorKind::ReadOnly) => {
            Moved::NotApplied
        }
        Ok(_) => Moved::No,
        Err(err) => moved_err(err),
    }
}

fn moved_err(err: &RedisError) -> Moved {
    if err.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) || err.is_connection_refusal() {
        Moved::NotApplied
    } else if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() {
        Moved::Unknown
    } else {
        Moved::No
    }
}

impl std::fmt::Debug for Primary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Primary")
            .field("service", &self.service())
            .field("address", &self.address())
            .finish()
    }
}

/// Shared by clones of the store.
pub(super) type SharedPrimary = Arc<Primary>;
