//! Throwaway Redis servers for tests: started from `redis-server` on a free loopback port,
//! with no persistence, killed on drop (and by a watchdog if the test process dies first),
//! restartable on the same port, and clusterable with `redis-cli --cluster create`.
//! A failure to start puts the server's log in the panic message.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The shared Redis the tests use: `IDEMPOTENT_REDIS_URL`, default `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("IDEMPOTENT_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A store on `url` (unsafe configurations only warned about), or a panic that says how to
/// start Redis.
pub async fn connect(url: &str) -> idempotency::redis::RedisStore {
    connect_with(url, true).await
}

/// [`connect`], with the fast claim (`SET ... NX GET`) on or off (every claim by script).
pub async fn connect_with(url: &str, fast_claims: bool) -> idempotency::redis::RedisStore {
    connect_with_clock_error(url, fast_claims, None).await
}

/// [`connect_with`], accepting `max_error` as the error of the store's reading of the
/// server's clock (`fast_claim_max_error`; the store's default when `None`). A store behind
/// the test proxy needs it: on a loaded machine the reading through the proxy can be less
/// precise than the default 1 ms, and every claim would then go to the script instead of
/// the fast `SET ... NX GET` a test may wait for.
pub async fn connect_with_clock_error(
    url: &str,
    fast_claims: bool,
    max_error: Option<Duration>,
) -> idempotency::redis::RedisStore {
    use idempotency::redis::{RedisStore, UnsafeConfig};
    let mut builder = RedisStore::builder(url)
        .on_unsafe_config(UnsafeConfig::Warn)
        .fast_claims(fast_claims);
    if let Some(max_error) = max_error {
        builder = builder.fast_claim_max_error(max_error);
    }
    match builder.build().await {
        Ok(store) => store,
        Err(err) => panic!(
            "Redis is not reachable at {url}: {err:?}\n\
             start it with: redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no"
        ),
    }
}

/// Deletes every key matching `pattern` on one server.
pub fn delete_matching(url: &str, pattern: &str) {
    let Ok(client) = redis::Client::open(url) else {
        return;
    };
    let Ok(mut conn) = client.get_connection() else {
        return;
    };
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg(pattern)
        .query(&mut conn)
        .unwrap_or_default();
    for chunk in keys.chunks(500) {
        let _: Result<(), _> = redis::cmd("DEL").arg(chunk).query(&mut conn);
    }
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

/// One `redis-server` process.
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server with extra `redis-server` arguments (`["--maxmemory-policy", "allkeys-lru"]`).
    pub fn start(extra: &[&str]) -> RedisServer {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("idempotent-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("cannot create the server's directory");
        let mut server = RedisServer {
            port,
            dir,
            args: extra.iter().map(|s| s.to_string()).collect(),
            child: None,
        };
        server.spawn();
        server
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL): every record is lost, like a crash without persistence.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // The port is free once connecting fails.
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            assert!(
                Instant::now() < deadline,
                "redis on {} did not stop",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Pauses the server (SIGSTOP): it keeps its connections and answers nothing, like a
    /// server stalled by a long pause or cut off from the network.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Resumes a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.pid().expect("the server is not running");
        let status = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .expect("cannot run kill");
        assert!(status.success(), "kill -{signal} {pid} failed");
    }

    /// Starts the server again, empty, on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("redis.log")
    }

    fn spawn(&mut self) {
        let mut args: Vec<String> = vec![
            "--port".into(),
            self.port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--save".into(),
            "".into(),
            "--appendonly".into(),
            "no".into(),
            "--dir".into(),
            self.dir.display().to_string(),
            "--logfile".into(),
            self.log_path().display().to_string(),
        ];
        args.extend(self.args.iter().cloned());
        let child = Command::new("redis-server")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start redis-server ({e}); install it with `apt-get install redis-server`")
            });
        // A watchdog kills the server if this test process dies without dropping it.
        let _ = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while kill -0 {parent} 2>/dev/null && kill -0 {child} 2>/dev/null; do sleep 0.5; done; kill -9 {child} 2>/dev/null",
                parent = std::process::id(),
                child = child.id()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if ping(self.port) {
                return;
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
                panic!(
                    "redis-server on port {} did not start; its log:\n{log}",
                    self.port
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `redis-cli` against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    stream.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("cannot run redis-cli; install it with `apt-get install redis-tools`");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A Redis Cluster of `masters` servers and no replicas, on loopback.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(masters: usize) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..masters)
            .map(|_| {
                RedisServer::start(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("cannot run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        for node in &nodes {
            loop {
                let info = node.cli(&["cluster", "info"]);
                if info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_assigned:16384")
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the cluster never became ready:\n{info}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        RedisCluster { nodes }
    }

    /// A `redis+cluster://` URL listing every node.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }
}

/// A primary, its replicas and three sentinels monitoring it as the service `name`, on free
/// loopback ports; everything is killed on drop.
pub struct SentinelGroup {
    pub name: String,
    pub servers: Vec<RedisServer>,
    pub sentinels: Vec<Sentinel>,
}

/// One `redis-server --sentinel` process.
pub struct Sentinel {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl SentinelGroup {
    /// Starts a primary with `replicas` replicas (each with the extra `redis-server`
    /// arguments `extra`) and three sentinels (quorum 2, a primary is down after 1 s without
    /// a reply), and waits until every sentinel knows every replica and the other sentinels.
    pub fn start(replicas: usize, extra: &[&str]) -> SentinelGroup {
        let name = format!("svc{}", free_port());
        let primary = RedisServer::start(extra);
        let primary_port = primary.port().to_string();
        let mut servers = vec![primary];
        for _ in 0..replicas {
            let mut args = vec!["--replicaof", "127.0.0.1", primary_port.as_str()];
            args.extend_from_slice(extra);
            servers.push(RedisServer::start(&args));
        }
        let sentinels = (0..3)
            .map(|_| Sentinel::start(&name, servers[0].port()))
            .collect();
        let group = SentinelGroup {
            name,
            servers,
            sentinels,
        };
        group.wait_known(replicas);
        group
    }

    fn wait_known(&self, replicas: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        for s in &self.sentinels {
            loop {
                let known_replicas = s
                    .cli(&["sentinel", "replicas", &self.name])
                    .matches("flags")
                    .count();
                let known_sentinels = s
                    .cli(&["sentinel", "sentinels", &self.name])
                    .matches("flags")
                    .count();
                let linked = self.servers[1..].iter().all(|r| {
                    r.cli(&["info", "replication"])
                        .contains("master_link_status:up")
                });
                if known_replicas >= replicas && known_sentinels >= 2 && linked {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the sentinels never saw the whole group ({known_replicas} replicas, {known_sentinels} sentinels)"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// A `redis+sentinel://` URL naming every sentinel and the service.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis+sentinel://{}/{}", hosts.join(","), self.name)
    }

    /// The port of the node the sentinels name as the primary now (the first sentinel that
    /// answers).
    pub fn primary_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|s| {
            let out = s.cli(&["sentinel", "get-master-addr-by-name", &self.name]);
            out.lines().nth(1)?.trim().parse().ok()
        })
    }

    /// The server on `port`.
    pub fn server(&self, port: u16) -> &RedisServer {
        self.servers
            .iter()
            .find(|s| s.port() == port)
            .expect("no server of the group on this port")
    }

    /// The server on `port`, to kill, pause or resume.
    pub fn server_mut(&mut self, port: u16) -> &mut RedisServer {
        self.servers
            .iter_mut()
            .find(|s| s.port() == port)
            .expect("no server of the group on this port")
    }

    /// Waits until the sentinels name a primary other than `old` that answers as a master,
    /// and returns its port.
    pub fn wait_promoted(&self, old: u16) -> u16 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(port) = self.primary_port().filter(|&p| p != old) {
                if redis_cli(port, &["role"]).starts_with("master") {
                    return port;
                }
            }
            assert!(Instant::now() < deadline, "no replica was promoted");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Asks the sentinels for a failover now (`SENTINEL FAILOVER`: a replica is promoted, the
    /// old primary demoted to its replica) and waits for both; returns the new primary's
    /// port.
    pub fn failover(&self) -> u16 {
        let old = self.primary_port().expect("no sentinel names a primary");
        let out = self.sentinels[0].cli(&["sentinel", "failover", &self.name]);
        assert!(out.contains("OK"), "SENTINEL FAILOVER refused: {out}");
        let new = self.wait_promoted(old);
        self.demote(old, new);
        new
    }

    /// Waits until every sentinel names `new` as the primary and sees it healthy, then until
    /// `old` is its replica.
    ///
    /// The sentinels demote an old primary only once it has looked healthy to them for
    /// 8 s (four publish periods). On a loaded machine, with the group's 1 s down-after
    /// period, a slow reply restarts that wait, and it has outlasted a minute. So once every
    /// sentinel names `new` with no flag but `master` (right after a failover a sentinel's
    /// link to the new primary is `disconnected` until it reconnects, and a store does not
    /// count its answer then), this sends `old` the command the sentinels would send
    /// (`REPLICAOF <new>`), which agrees with their configuration.
    pub fn demote(&self, old: u16, new: u16) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let new_addr = new.to_string();
        while !self.sentinels.iter().all(|s| {
            let fields = s.cli(&["sentinel", "master", &self.name]);
            let mut lines = fields.lines().map(str::trim);
            let mut field = |name: &str| {
                lines
                    .by_ref()
                    .skip_while(|l| *l != name)
                    .nth(1)
                    .map(str::to_owned)
            };
            // `port` comes before `flags` in the reply.
            field("port").as_deref() == Some(new_addr.as_str())
                && field("flags").as_deref() == Some("master")
        }) {
            assert!(
                Instant::now() < deadline,
                "the sentinels never agreed on the new primary"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        if !redis_cli(old, &["role"]).starts_with("slave") {
            let out = redis_cli(old, &["replicaof", "127.0.0.1", &new_addr]);
            assert!(
                out.contains("OK"),
                "REPLICAOF refused by the old primary: {out}"
            );
        }
        while !redis_cli(old, &["role"]).starts_with("slave") {
            assert!(
                Instant::now() < deadline,
                "the old primary was never demoted"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Sentinel {
    fn start(service: &str, primary: u16) -> Sentinel {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("idempotent-sentinel-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("cannot create the sentinel's directory");
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/sentinel.log\n\
                 sentinel monitor {service} 127.0.0.1 {primary} 2\n\
                 sentinel down-after-milliseconds {service} 1000\n\
                 sentinel failover-timeout {service} 10000\n\
                 sentinel parallel-syncs {service} 1\n",
                dir = dir.display()
            ),
        )
        .expect("cannot write the sentinel's configuration");
        let child = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server --sentinel ({e})"));
        let _ = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while kill -0 {parent} 2>/dev/null && kill -0 {child} 2>/dev/null; do sleep 0.5; done; kill -9 {child} 2>/dev/null",
                parent = std::process::id(),
                child = child.id()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let sentinel = Sentinel {
            port,
            dir,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ping(port) {
            if Instant::now() > deadline {
                let log =
                    std::fs::read_to_string(sentinel.dir.join("sentinel.log")).unwrap_or_default();
                panic!("the sentinel on port {port} did not start; its log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        sentinel
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }

    /// Pauses the sentinel (SIGSTOP): it answers nothing and takes no step of a failover it
    /// leads until resumed.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Resumes a paused sentinel (SIGCONT).
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self
            .child
            .as_ref()
            .map(Child::id)
            .expect("the sentinel is not running");
        let status = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .expect("cannot run kill");
        assert!(status.success(), "kill -{signal} {pid} failed");
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
