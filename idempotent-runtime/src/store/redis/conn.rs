//! The connection (one server or a cluster), and redis-rs errors as [`StoreError`]s.

use ::redis::aio::{ConnectionLike, ConnectionManager};
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Cmd, ErrorKind, RedisError, Script, ServerErrorKind, Value};

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::redis::sentinel::SharedPrimary;

/// The error code of the script's reply about a value it cannot read as a record.
const CORRUPT: &str = "IDEMPOTENT_CORRUPT";

#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    /// The primary Sentinel names, followed across failovers.
    Sentinel(SharedPrimary),
    Cluster(ClusterConnection),
}

impl Conn {
    pub(super) async fn query(&self, cmd: &::redis::Cmd) -> Result<Value, RedisError> {
        match self {
            Conn::Single(c) => {
                let mut c = c.clone();
                c.req_packed_command(cmd).await
            }
            // Boxed: a call that follows a failover is a large future, and every store call
            // holds this one (on one server or a cluster, a pointer and a connection handle).
            Conn::Sentinel(primary) => Box::pin(primary.query(cmd)).await,
            Conn::Cluster(c) => {
                let mut c = c.clone();
                c.req_packed_command(cmd).await
            }
        }
    }

    /// Whether keys are spread over a cluster's nodes (otherwise one server has them all).
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self, Conn::Cluster(_))
    }

    /// Counts the primaries followed behind Sentinel (0 for a server reached directly, and
    /// before the first failover).
    pub(super) fn generation(&self) -> u64 {
        match self {
            Conn::Sentinel(primary) => primary.generation(),
            Conn::Single(_) | Conn::Cluster(_) => 0,
        }
    }

    /// Loads `lua` into the server's script cache (`SCRIPT LOAD`): after a restart, a
    /// failover or a `SCRIPT FLUSH`, calls of it are answered `NOSCRIPT` until then.
    pub(super) async fn load(&self, lua: &Lua) -> Result<(), RedisError> {
        self.query(::redis::cmd("SCRIPT").arg("LOAD").arg(lua.code))
            .await
            .and_then(Value::extract_error)
            .map(drop)
    }

    /// Sends `cmd`, a call of `lua`, a server's error reply as an error; when the server does
    /// not have the script (a restarted server, `SCRIPT FLUSH`, a new primary), loads it and
    /// sends the call again, up to [`SCRIPT_SENDS`] sends in all.
    pub(super) async fn eval(&self, lua: &Lua, cmd: &Cmd) -> Result<Value, RedisError> {
        let mut sends = 1;
        loop {
            match self.query(cmd).await.and_then(Value::extract_error) {
                Err(err) if is_no_script(&err) && sends < SCRIPT_SENDS => {
                    self.load(lua).await?;
                    sends += 1;
                }
                other => return other,
            }
        }
    }
}

/// How many times a script call is sent in all when the server answers `NOSCRIPT` (nothing
/// was run), the script loaded before each new send. One load is not always enough: behind
/// Sentinel, the load may reach a demoted primary that lacks the script, and the call, refused
/// there, move on to the new primary, which lacks it too (a script's writes reach replicas as
/// plain commands, never the script).
pub(super) const SCRIPT_SENDS: usize = 3;

/// Whether `err` is the server's `NOSCRIPT`.
pub(super) fn is_no_script(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

/// A script the store calls by its SHA-1 (`EVALSHA`). A call is one command built in one
/// buffer ([`Lua::call`]), which redis-rs's `ScriptInvocation` would build from a buffer per
/// argument and then copy.
pub(super) struct Lua {
    script: Script,
    code: &'static str,
}

impl Lua {
    pub(super) fn new(code: &'static str) -> Lua {
        Lua {
            script: Script::new(code),
            code,
        }
    }

    /// `EVALSHA <sha1> 1 <key>`: a call of the script on `key`, to which the caller adds the
    /// arguments; sized for the store's calls (at most 8 words, 160 bytes of arguments past
    /// the key), so that building it does not grow it.
    pub(super) fn call(&self, key: &[u8]) -> Cmd {
        let mut cmd = Cmd::with_capacity(9, 48 + key.len() + 160);
        cmd.arg("EVALSHA");
        cmd.arg(self.script.get_hash()).arg(1).arg(key);
        cmd
    }
}

pub(super) fn connect_error(name: &str, err: RedisError) -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        format!("cannot connect to {name}"),
    )
    .with_source(err)
}

/// Maps a redis-rs error to a store error, keeping it as the source.
pub(super) fn command_error(err: RedisError) -> StoreError {
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
pub(super) fn script_error(key: &Key, err: RedisError) -> StoreError {
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
