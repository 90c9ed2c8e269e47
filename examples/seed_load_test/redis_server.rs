//! A throwaway `redis-server` for `--restart-redis`: a free loopback port, no persistence,
//! killed (SIGKILL) and started again empty on the same port.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) struct RedisServer {
    port: u16,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server on a free port.
    pub(crate) fn start() -> Result<RedisServer, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let mut server = RedisServer { port, child: None };
        server.spawn()?;
        Ok(server)
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server: every record is gone, as after a crash without persistence.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again, empty, on the same port.
    pub(crate) fn restart(&mut self) -> Result<(), String> {
        self.kill();
        self.spawn()
    }

    fn spawn(&mut self) -> Result<(), String> {
        let port = self.port.to_string();
        let child = Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start redis-server ({e}); install it with `apt-get install redis-server`"))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ping(self.port) {
            if Instant::now() > deadline {
                return Err(format!("redis-server on port {} did not start", self.port));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut reply = [0u8; 7];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}
