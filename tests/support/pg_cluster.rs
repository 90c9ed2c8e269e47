//! A throwaway PostgreSQL cluster for tests that stop and restart their database: `initdb`
//! into a temporary directory, `pg_ctl` on a free loopback port, run as the `postgres`
//! system user when the tests run as root (PostgreSQL refuses to run as root). Stopped and
//! removed when dropped, also when the test panics; a watchdog process does the same if the
//! test process dies without dropping it. A failure to start puts the server's log in the
//! panic message.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One PostgreSQL cluster (trust authentication, user `postgres`, database `postgres`).
pub struct PgCluster {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
}

impl PgCluster {
    /// Creates and starts a cluster.
    pub fn start() -> PgCluster {
        let bin = bin_dir();
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("no free loopback port");
        let dir = std::env::temp_dir().join(format!("idempotent-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("cannot create the cluster's directory");
        let as_postgres = is_root();
        let cluster = PgCluster {
            bin,
            dir,
            port,
            as_postgres,
        };
        if as_postgres {
            let status = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&cluster.dir)
                .status()
                .expect("cannot run chown");
            assert!(
                status.success(),
                "cannot give {:?} to the postgres user",
                cluster.dir
            );
        }
        cluster.watchdog();
        let data = cluster.data();
        let out = cluster
            .command("initdb")
            .arg("-D")
            .arg(&data)
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .output()
            .expect("cannot run initdb");
        assert!(
            out.status.success(),
            "initdb failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.start_again();
        cluster
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the (stopped) cluster and waits until it accepts connections.
    pub fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.display()
        );
        let status = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.log())
            .args(["-w", "-t", "60", "-o", &options, "start"])
            .stdout(Stdio::null())
            .status()
            .expect("cannot run pg_ctl");
        assert!(
            status.success(),
            "PostgreSQL did not start on port {}; its log:\n{}",
            self.port,
            std::fs::read_to_string(self.log()).unwrap_or_default()
        );
    }

    /// Stops the cluster (`fast`: open sessions are disconnected, as in a failover or a
    /// restart) and waits until the port is closed.
    pub fn stop(&self) {
        let status = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "fast", "-w", "-t", "60", "stop"])
            .stdout(Stdio::null())
            .status()
            .expect("cannot run pg_ctl");
        assert!(
            status.success(),
            "PostgreSQL on port {} did not stop",
            self.port
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            assert!(Instant::now() < deadline, "port {} stays open", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("postgres.log")
    }

    fn command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        if self.as_postgres {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(program);
            cmd
        } else {
            Command::new(program)
        }
    }

    fn shell_command(&self, program: &str) -> String {
        let program = self.bin.join(program);
        if self.as_postgres {
            format!("runuser -u postgres -- {}", program.display())
        } else {
            program.display().to_string()
        }
    }

    /// Stops the cluster and removes its directory if this process dies without dropping it.
    fn watchdog(&self) {
        let script = format!(
            "while kill -0 {parent} 2>/dev/null; do sleep 0.5; done; \
             {pg_ctl} -D {data} -m immediate stop >/dev/null 2>&1; rm -rf {dir}",
            parent = std::process::id(),
            pg_ctl = self.shell_command("pg_ctl"),
            data = self.data().display(),
            dir = self.dir.display(),
        );
        let _ = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.data().join("postmaster.pid").exists() {
            let _ = self
                .command("pg_ctl")
                .arg("-D")
                .arg(self.data())
                .args(["-m", "immediate", "-w", "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The newest installed PostgreSQL's `bin` directory.
fn bin_dir() -> PathBuf {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("pg_ctl").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    match versions.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "no PostgreSQL server binaries under {}: install them with `apt-get install postgresql`",
            root.display()
        ),
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
        .unwrap_or(false)
}
