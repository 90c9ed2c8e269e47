//! Throwaway tables (and PostgreSQL schemas) for the SQL test suites.
//!
//! Every test case gets its own names, `idem_<unix seconds>_<random>`, so cases run in
//! parallel on one server. A [`Scratch`] drops what it named when it is dropped: on a thread
//! of its own, with a connection of its own and a runtime of its own, and waits for it, so the
//! drop is synchronous and also happens when the case panics (a `Drop` that only spawns the
//! cleanup on the test's runtime is lost when the runtime shuts down). A process killed
//! outright cannot run drops: every run therefore first drops what earlier runs left behind,
//! by name prefix, once it is more than an hour old (so concurrent runs never touch each
//! other's names).
//!
//! Tests that need a server fail loudly when it is missing, with the command that starts it.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotency::sql::sqlx::{self, Connection, Executor, Row};

const PREFIX: &str = "idem_";
const LEFTOVER_AGE: Duration = Duration::from_secs(3600);

/// The servers the suites use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    Postgres,
    MySql,
}

impl Server {
    /// The URL from `IDEMPOTENT_POSTGRES_URL` / `IDEMPOTENT_MYSQL_URL`, or the local default.
    pub fn url(self) -> String {
        let (var, default) = match self {
            Server::Postgres => (
                "IDEMPOTENT_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            Server::MySql => ("IDEMPOTENT_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
        };
        std::env::var(var).unwrap_or_else(|_| default.to_string())
    }

    fn name(self) -> &'static str {
        match self {
            Server::Postgres => "PostgreSQL",
            Server::MySql => "MariaDB",
        }
    }

    fn start_hint(self) -> &'static str {
        match self {
            Server::Postgres => {
                "start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`"
            }
            Server::MySql => {
                "start it with `start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd`"
            }
        }
    }

    /// Panics with the command that starts the server when nothing listens at its address.
    /// Never skips: a suite that needs a server must fail without it.
    pub fn require(self) -> String {
        let url = self.url();
        let host_port = url
            .split("://")
            .nth(1)
            .and_then(|rest| rest.rsplit('@').next())
            .and_then(|rest| rest.split('/').next())
            .unwrap_or_default()
            .to_string();
        let reachable = host_port
            .to_socket_addrs()
            .ok()
            .and_then(|mut addrs| addrs.next())
            .is_some_and(|addr| TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok());
        assert!(
            reachable,
            "{} is not reachable at {host_port}: {}",
            self.name(),
            self.start_hint()
        );
        static SWEPT: [Once; 2] = [Once::new(), Once::new()];
        SWEPT[self as usize].call_once(|| sweep_leftovers(self, &url));
        url
    }
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A name no other case, process or run uses: `idem_<unix seconds>_<random><counter>`.
pub fn unique_name() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let token = format!("{:?}", idempotency::store::Token::generate());
    // `Token(<32 hex digits>)`: the first 16 are per process, the rest a counter.
    let salt = &token[6..14];
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{PREFIX}{secs}_{salt}{n}")
}

/// What a [`Scratch`] drops.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    /// A records table and its migrations table, or a plain table.
    Table,
    /// A PostgreSQL schema, with everything in it.
    Schema,
}

/// A uniquely named table (or schema) that is dropped with this guard.
pub struct Scratch {
    server: Server,
    url: String,
    name: String,
    kind: Kind,
}

impl Scratch {
    /// A table name for this case.
    pub fn table(server: Server) -> Scratch {
        let url = server.require();
        Scratch {
            server,
            url,
            name: unique_name(),
            kind: Kind::Table,
        }
    }

    /// A PostgreSQL schema name for this case.
    pub fn schema() -> Scratch {
        let url = Server::Postgres.require();
        Scratch {
            server: Server::Postgres,
            url,
            name: unique_name(),
            kind: Kind::Schema,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let statements = match self.kind {
            Kind::Table => vec![
                format!("DROP TABLE IF EXISTS {}", self.name),
                format!("DROP TABLE IF EXISTS {}_migrations", self.name),
            ],
            Kind::Schema => vec![format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name)],
        };
        if let Err(err) = run_blocking(self.server, &self.url, statements) {
            // Leftovers are swept by a later run; do not turn a passing case into a failure,
            // nor a panicking one into an abort.
            eprintln!("could not drop {}: {err}", self.name);
        }
    }
}

/// Drops what earlier runs left behind (killed before their drops ran), once per process.
fn sweep_leftovers(server: Server, url: &str) {
    let cutoff = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        .saturating_sub(LEFTOVER_AGE.as_secs());
    let server_url = url.to_string();
    let names = std::thread::spawn(move || {
        runtime().block_on(async move {
            let (tables, schemas) = match server {
                Server::Postgres => (
                    "SELECT tablename::text FROM pg_tables \
                     WHERE schemaname = current_schema() AND tablename LIKE 'idem\\_%'",
                    Some("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'idem\\_%'"),
                ),
                Server::MySql => (
                    "SELECT CAST(table_name AS CHAR) FROM information_schema.tables \
                     WHERE table_schema = DATABASE() AND table_name LIKE 'idem\\_%'",
                    None,
                ),
            };
            let mut found = Vec::new();
            match server {
                Server::Postgres => {
                    let mut conn = sqlx::PgConnection::connect(&server_url).await?;
                    for row in conn.fetch_all(tables).await? {
                        found.push((Kind::Table, row.try_get::<String, _>(0)?));
                    }
                    if let Some(schemas) = schemas {
                        for row in conn.fetch_all(schemas).await? {
                            found.push((Kind::Schema, row.try_get::<String, _>(0)?));
                        }
                    }
                }
                Server::MySql => {
                    let mut conn = sqlx::MySqlConnection::connect(&server_url).await?;
                    for row in conn.fetch_all(tables).await? {
                        found.push((Kind::Table, row.try_get::<String, _>(0)?));
                    }
                }
            }
            Ok::<_, sqlx::Error>(found)
        })
    })
    .join()
    .unwrap();
    let names = match names {
        Ok(names) => names,
        Err(err) => panic!("cannot list leftover test tables: {err}"),
    };
    let stale: Vec<String> = names
        .into_iter()
        .filter(|(_, name)| created_at(name).is_some_and(|secs| secs < cutoff))
        .map(|(kind, name)| match kind {
            Kind::Table => format!("DROP TABLE IF EXISTS {name}"),
            Kind::Schema => format!("DROP SCHEMA IF EXISTS {name} CASCADE"),
        })
        .collect();
    if !stale.is_empty() {
        if let Err(err) = run_blocking(server, url, stale) {
            eprintln!("could not drop leftover test tables: {err}");
        }
    }
}

/// The creation time encoded in a name made by [`unique_name`].
fn created_at(name: &str) -> Option<u64> {
    name.strip_prefix(PREFIX)?.split('_').next()?.parse().ok()
}

/// Runs statements on a fresh connection, on a thread and runtime of its own, and waits.
fn run_blocking(server: Server, url: &str, statements: Vec<String>) -> Result<(), String> {
    // One cleanup at a time per process keeps the number of extra connections small.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let url = url.to_string();
    std::thread::spawn(move || {
        runtime().block_on(async move {
            match server {
                Server::Postgres => {
                    let mut conn = sqlx::PgConnection::connect(&url).await?;
                    for sql in statements {
                        conn.execute(sqlx::AssertSqlSafe(sql)).await?;
                    }
                    conn.close().await
                }
                Server::MySql => {
                    let mut conn = sqlx::MySqlConnection::connect(&url).await?;
                    for sql in statements {
                        conn.execute(sqlx::AssertSqlSafe(sql)).await?;
                    }
                    conn.close().await
                }
            }
        })
    })
    .join()
    .map_err(|_| "the cleanup thread panicked".to_string())?
    .map_err(|e| e.to_string())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn names_carry_their_creation_time() {
    let name = unique_name();
    let secs = created_at(&name).unwrap();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(now - secs < 5, "{name}");
    assert!(name.len() <= 40, "{name}");
    assert_eq!(created_at("idempotent_records"), None);
}
