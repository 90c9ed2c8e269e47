//! A primary found through Redis Sentinel, followed across failovers.
//!
//! The store asks the sentinels for the service's primary (redis-rs checks that the node it
//! names answers `ROLE` as a master) and talks to it through one auto-reconnecting
//! connection, as to a standalone server. A reply that says the node is no longer the primary
//! (`READONLY`, a demoted server) and a connection that fails (refused, dropped, no reply in
//! time: a dead or paused primary) make it ask the sentinels again; when they name another
//! node, later commands go there. A command refused with `READONLY` or by a refused
//! connection was not applied, so it is sent once more to the new primary; a command whose
//! connection dropped or timed out may have been applied, so its error goes back to the
//! caller, which resolves it as every unknown outcome is resolved (by reading the record).
//! No write is ever sent to a node the sentinels did not name as the primary at the time.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use ::redis::{Cmd, ErrorKind, Pipeline, RedisConnectionInfo, RedisError, ServerErrorKind, Value};

use crate::error::{StoreError, StoreErrorKind};

/// Where a Sentinel deployment is, as a `redis+sentinel://` URL gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SentinelTarget {
    /// The sentinels, as `redis://host:port` URLs.
    pub(super) sentinels: Vec<String>,
    /// The service (master) name the sentinels monitor.
    pub(super) service: String,
    /// The database on the primary.
    pub(super) db: i64,
    /// Credentials for the primary (`user`, `password`).
    pub(super) username: Option<String>,
    pub(super) password: Option<String>,
}

/// Parses `redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]`;
/// `None` for another scheme, an error for a malformed Sentinel URL.
pub(super) fn sentinel_target(url: &str) -> Option<Result<SentinelTarget, StoreError>> {
    let rest = url.strip_prefix("redis+sentinel://")?;
    let bad = |why: &str| {
        StoreError::new(
            StoreErrorKind::Rejected,
            format!(
                "invalid Sentinel URL ({why}): expected \
                 `redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]`"
            ),
        )
    };
    Some((|| {
        let (authority, path) = rest.split_once('/').ok_or_else(|| bad("no service name"))?;
        let (credentials, hosts) = match authority.rsplit_once('@') {
            Some((credentials, hosts)) => (Some(credentials), hosts),
            None => (None, authority),
        };
        let (username, password) = match credentials {
            None => (None, None),
            Some(c) => match c.split_once(':') {
                Some((user, password)) => (
                    Some(user).filter(|u| !u.is_empty()).map(decode),
                    Some(decode(password)),
                ),
                None => (Some(decode(c)), None),
            },
        };
        let sentinels: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| {
                if h.contains(':') {
                    format!("redis://{h}")
                } else {
                    format!("redis://{h}:26379")
                }
            })
            .collect();
        if sentinels.is_empty() {
            return Err(bad("no sentinel address"));
        }
        let mut parts = path.splitn(2, '/');
        let service = parts.next().unwrap_or_default();
        if service.is_empty() {
            return Err(bad("no service name"));
        }
        let db = match parts.next().filter(|d| !d.is_empty()) {
            None => 0,
            Some(d) => d.parse().map_err(|_| bad("the database is not a number"))?,
        };
        Ok(SentinelTarget {
            sentinels,
            service: decode(service),
            db,
            username,
            password,
        })
    })())
}

/// Percent-decodes a URL part (`%40` for `@` in a password).
fn decode(part: &str) -> String {
    let bytes = part.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                let (h, l) = (hex(h).unwrap_or(0), hex(l).unwrap_or(0));
                out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The current primary's connection, and the sentinels that name it.
pub(super) struct Primary {
    finder: Finder,
    current: RwLock<Current>,
    /// Held while the sentinels are asked after a failed command; when they were last asked.
    following: tokio::sync::Mutex<Option<Instant>>,
}

/// The least time between two lookups after failed commands: while the sentinels still name
/// a primary that does not answer, failed commands do not each ask them again.
const MIN_LOOKUP_INTERVAL: Duration = Duration::from_millis(100);

/// The sentinels, and how to connect to the primary they name.
struct Finder {
    target: SentinelTarget,
    node: SentinelNodeConnectionInfo,
    config: ConnectionManagerConfig,
    /// How long one lookup through the sentinels may take.
    lookup_timeout: Duration,
    /// Asked one lookup at a time.
    sentinel: tokio::sync::Mutex<Sentinel>,
}

#[derive(Clone)]
struct Current {
    conn: ConnectionManager,
    /// The primary's address, as the sentinels gave it.
    addr: String,
    /// Counts the primaries followed: 0 for the first.
    generation: u64,
}

impl Primary {
    /// Finds the primary and connects to it.
    pub(super) async fn connect(
        target: SentinelTarget,
        config: ConnectionManagerConfig,
        lookup_timeout: Duration,
        name: &str,
    ) -> Result<Primary, StoreError> {
        let sentinel = Sentinel::build(target.sentinels.clone()).map_err(|err| {
            StoreError::new(
                StoreErrorKind::Rejected,
                format!("invalid sentinel addresses in {name}"),
            )
            .with_source(err)
        })?;
        let mut info = RedisConnectionInfo::default().set_db(target.db);
        if let Some(user) = &target.username {
            info = info.set_username(user);
        }
        if let Some(password) = &target.password {
            info = info.set_password(password);
        }
        let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(info);
        let finder = Finder {
            target,
            node,
            config,
            lookup_timeout,
            sentinel: tokio::sync::Mutex::new(sentinel),
        };
        let (conn, addr) = finder.lookup(name).await?;
        Ok(Primary {
            finder,
            current: RwLock::new(Current {
                conn,
                addr,
                generation: 0,
            }),
            following: tokio::sync::Mutex::new(None),
        })
    }

    /// The service name.
    pub(super) fn service(&self) -> &str {
        &self.finder.target.service
    }

    /// The address of the primary commands go to now.
    pub(super) fn address(&self) -> String {
        self.current().addr
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
    /// Asks the sentinels for the primary and connects to it.
    async fn lookup(&self, name: &str) -> Result<(ConnectionManager, String), StoreError> {
        let client = self.find(name).await?;
        self.connect(client).await
    }

    /// Asks the sentinels which node is the primary (checked to answer `ROLE` as a master).
    async fn find(&self, name: &str) -> Result<::redis::Client, StoreError> {
        let service = &self.target.service;
        let unavailable = |why: String| StoreError::new(StoreErrorKind::Unavailable, why);
        let mut sentinel = self.sentinel.lock().await;
        let asked = sentinel.async_master_for(service, Some(&self.node));
        match tokio::time::timeout(self.lookup_timeout, asked).await {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(err)) if err.kind() == ErrorKind::MasterNameNotFoundBySentinel => {
                Err(unavailable(format!(
                    "no sentinel of {name} names a writable primary for the service `{service}` \
                     (an unknown service name, or a primary that is not a master)"
                ))
                .with_source(err))
            }
            Ok(Err(err)) => Err(unavailable(format!(
                "cannot find the primary of `{service}` through {name}"
            ))
            .with_source(err)),
            Err(_) => Err(unavailable(format!(
                "the sentinels of {name} did not name a primary for `{service}` within {:?}",
                self.lookup_timeout
            ))),
        }
    }

    /// Connects to the primary `client` names.
    async fn connect(
        &self,
        client: ::redis::Client,
    ) -> Result<(ConnectionManager, String), StoreError> {
        let addr = client.get_connection_info().addr().to_string();
        let conn = ConnectionManager::new_with_config(client, self.config.clone())
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
            })?;
        Ok((conn, addr))
    }
}

impl Primary {
    /// After an error that may mean the primary changed: asks the sentinels again (one caller
    /// at a time, at most every [`MIN_LOOKUP_INTERVAL`]; a caller that waited for another's
    /// lookup uses its answer) and moves to the primary they name. Whether commands now go to
    /// another primary than at `seen`.
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
        let client = match found {
            Ok(client) => client,
            Err(err) => {
                tracing::debug!(error = %err, "no primary found after a failed command");
                return false;
            }
        };
        let addr = client.get_connection_info().addr().to_string();
        if addr == self.current().addr {
            // The same primary: its connection reconnects by itself.
            return false;
        }
        let (conn, addr) = match self.finder.connect(client).await {
            Ok(found) => found,
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
            from = %current.addr,
            to = %addr,
            "the Redis primary changed (failover): commands go to the new primary"
        );
        *current = Current {
            conn,
            addr,
            generation: seen + 1,
        };
        true
    }

    /// Sends `cmd` to the primary; see the module docs for what happens after a failover.
    pub(super) async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        let current = self.current();
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
                self.follow(current.generation).await;
                reply
            }
        }
    }

    /// Sends `pipe` to the primary. A pipeline is not sent again: some of its commands may
    /// have been applied; the caller resolves each item.
    pub(super) async fn pipeline(&self, pipe: &Pipeline) -> Result<Vec<Value>, RedisError> {
        let current = self.current();
        let mut conn = current.conn;
        let replies: Result<Vec<Value>, RedisError> = pipe.query_async(&mut conn).await;
        let follow = match &replies {
            Ok(values) => values.iter().any(|v| {
                matches!(v, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::ReadOnly))
            }),
            Err(err) => !matches!(moved_err(err), Moved::No),
        };
        if follow {
            self.follow(current.generation).await;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_name_their_sentinels_service_and_database() {
        let t = sentinel_target("redis+sentinel://a:26379,b:26380,c/orders/2")
            .unwrap()
            .unwrap();
        assert_eq!(
            t.sentinels,
            ["redis://a:26379", "redis://b:26380", "redis://c:26379"]
        );
        assert_eq!((t.service.as_str(), t.db), ("orders", 2));
        assert_eq!((t.username, t.password), (None, None));

        let t = sentinel_target("redis+sentinel://app:p%40ss@a:1/main")
            .unwrap()
            .unwrap();
        assert_eq!(t.username.as_deref(), Some("app"));
        assert_eq!(t.password.as_deref(), Some("p@ss"));
        let t = sentinel_target("redis+sentinel://:secret@a:1/main")
            .unwrap()
            .unwrap();
        assert_eq!((t.username, t.password.as_deref()), (None, Some("secret")));

        assert!(sentinel_target("redis://a:1").is_none());
        for bad in [
            "redis+sentinel://a:1",
            "redis+sentinel://a:1/",
            "redis+sentinel:///main",
            "redis+sentinel://a:1/main/x",
        ] {
            let err = sentinel_target(bad).unwrap().unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::Rejected, "{bad}");
        }
    }
}
