//! A TCP proxy that can lose a reply: it forwards a request to the server (which applies it)
//! and closes the client's connection instead of forwarding the reply. This is how a real
//! network loses the answer to a command that did take effect.
//!
//! It can also stall a request: the request is never forwarded and its connection goes
//! silent (open, no reply, no error), as a half-dead connection or a stalled server does.
//!
//! It can send the server a command of its own right before a client's request goes on (a
//! `SCRIPT FLUSH` between a load and the call that needs the script).
//!
//! In chaos mode it also does so at random, and cuts connections before a request reaches the
//! server, so a workload meets both kinds of fault on real connections.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

#[derive(Default)]
struct Shared {
    armed: Mutex<Option<Vec<u8>>>,
    /// How many requests holding the armed marker go through before the one that loses its
    /// reply.
    armed_skip: AtomicUsize,
    /// The armed request is stalled (never forwarded, connection silent) instead of losing
    /// its reply.
    armed_stalls: AtomicBool,
    dropped: AtomicUsize,
    stalled_requests: AtomicUsize,
    /// Chaos: per mille of requests cut before reaching the server, and of replies lost.
    cut_permille: AtomicUsize,
    lose_permille: AtomicUsize,
    rng: Mutex<u64>,
    cut: AtomicUsize,
    requests: AtomicUsize,
    /// Down: connections refused (accepted and closed at once).
    down: AtomicBool,
    /// Stalled: nothing from the server reaches the client, connections stay open.
    stalled: AtomicBool,
    /// How long each reply is held before it is passed on, in microseconds: a slow link.
    delay_us: AtomicUsize,
    /// The server, for the commands sent before a request (`before_requests`).
    upstream: Mutex<Option<SocketAddr>>,
    before: Mutex<Option<Before>>,
    /// How many commands were sent before a request.
    befores: AtomicUsize,
}

/// A command sent to the server before each of the next `left` requests holding `marker`.
struct Before {
    marker: Vec<u8>,
    left: usize,
    command: Vec<u8>,
}

impl Shared {
    /// A number below 1000.
    fn roll(&self) -> usize {
        let mut state = self.rng.lock().unwrap();
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        (*state % 1000) as usize
    }
}

pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    tasks: Arc<Mutex<JoinSet<()>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::default());
        *shared.upstream.lock().unwrap() = Some(upstream);
        let tasks = Arc::new(Mutex::new(JoinSet::new()));
        let accept = {
            let (shared, tasks) = (shared.clone(), tasks.clone());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    if shared.down.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        continue;
                    };
                    tasks
                        .lock()
                        .unwrap()
                        .spawn(relay(client, server, shared.clone()));
                }
            })
        };
        Proxy {
            addr,
            shared,
            tasks,
            accept,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next request whose bytes contain `marker` reaches the server, but its reply is
    /// lost and the connection closed.
    pub fn lose_reply_to(&self, marker: &[u8]) {
        self.lose_reply_to_nth(marker, 1);
    }

    /// The `n`th next request whose bytes contain `marker` (counting from 1) reaches the
    /// server, but its reply is lost and the connection closed; the ones before it go
    /// through untouched.
    pub fn lose_reply_to_nth(&self, marker: &[u8], n: usize) {
        let mut armed = self.shared.armed.lock().unwrap();
        self.shared
            .armed_skip
            .store(n.saturating_sub(1), Ordering::SeqCst);
        self.shared.armed_stalls.store(false, Ordering::SeqCst);
        *armed = Some(marker.to_vec());
    }

    /// The next request whose bytes contain `marker` is never forwarded, and its connection
    /// stays open and silent: no reply, no error, ever (until the proxy is dropped).
    pub fn stall_request(&self, marker: &[u8]) {
        let mut armed = self.shared.armed.lock().unwrap();
        self.shared.armed_skip.store(0, Ordering::SeqCst);
        self.shared.armed_stalls.store(true, Ordering::SeqCst);
        *armed = Some(marker.to_vec());
    }

    /// Before each of the next `count` requests whose bytes contain `marker` is forwarded,
    /// sends `command` (a RESP array) to the server on a connection of its own and waits for
    /// its reply: a change of the server's state that lands between two of a client's
    /// requests, at an exact place, whatever the timing.
    pub fn before_requests(&self, marker: &[u8], count: usize, command: &[&str]) {
        let mut resp = format!("*{}\r\n", command.len());
        for arg in command {
            resp.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
        }
        *self.shared.before.lock().unwrap() = Some(Before {
            marker: marker.to_vec(),
            left: count,
            command: resp.into_bytes(),
        });
    }

    /// How many commands `before_requests` sent.
    pub fn befores(&self) -> usize {
        self.shared.befores.load(Ordering::SeqCst)
    }

    /// How many requests were stalled.
    pub fn stalled(&self) -> usize {
        self.shared.stalled_requests.load(Ordering::SeqCst)
    }

    /// How many replies were lost.
    pub fn lost(&self) -> usize {
        self.shared.dropped.load(Ordering::SeqCst)
    }

    /// Chaos: from now on, of every thousand requests, `cut` have their connection cut before
    /// they reach the server and `lose` reach it but lose their reply. Seeded, so a run's
    /// faults are reproducible for the same traffic.
    pub fn chaos(&self, cut: usize, lose: usize, seed: u64) {
        *self.shared.rng.lock().unwrap() = seed | 1;
        self.shared.cut_permille.store(cut, Ordering::SeqCst);
        self.shared.lose_permille.store(lose, Ordering::SeqCst);
    }

    /// Ends chaos mode.
    pub fn calm(&self) {
        self.chaos(0, 0, 1);
    }

    /// How many requests (reads from a client) passed through.
    /// Holds each reply `delay` before passing it on, as a slow link does.
    pub fn delay_replies(&self, delay: std::time::Duration) {
        let micros = usize::try_from(delay.as_micros()).unwrap();
        self.shared.delay_us.store(micros, Ordering::SeqCst);
    }

    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Down: cuts every open connection and refuses new ones until `up`, as a server that
    /// went away.
    pub fn down(&self) {
        self.shared.down.store(true, Ordering::SeqCst);
        self.tasks.lock().unwrap().abort_all();
    }

    /// Takes connections again.
    pub fn up(&self) {
        self.shared.down.store(false, Ordering::SeqCst);
    }

    /// Holds everything the server sends (while `on`), the connections open: a server that
    /// never answers.
    pub fn stall(&self, on: bool) {
        self.shared.stalled.store(on, Ordering::SeqCst);
    }

    /// How many connections were cut before a request reached the server.
    pub fn cut(&self) -> usize {
        self.shared.cut.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.tasks.lock().unwrap().abort_all();
    }
}

async fn relay(client: TcpStream, server: TcpStream, shared: Arc<Shared>) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let swallow = Arc::new(AtomicBool::new(false));
    let up = {
        let (shared, swallow) = (shared.clone(), swallow.clone());
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match client_rx.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let mut stall = false;
                {
                    let mut armed = shared.armed.lock().unwrap();
                    if let Some(marker) = armed.as_deref() {
                        if buf[..n].windows(marker.len()).any(|w| w == marker) {
                            let skip = shared.armed_skip.load(Ordering::SeqCst);
                            if skip > 0 {
                                shared.armed_skip.store(skip - 1, Ordering::SeqCst);
                            } else if shared.armed_stalls.load(Ordering::SeqCst) {
                                stall = true;
                                *armed = None;
                            } else {
                                swallow.store(true, Ordering::SeqCst);
                                *armed = None;
                            }
                        }
                    }
                }
                let before = {
                    let mut before = shared.before.lock().unwrap();
                    match before.as_mut() {
                        Some(b)
                            if b.left > 0
                                && buf[..n].windows(b.marker.len()).any(|w| w == b.marker) =>
                        {
                            b.left -= 1;
                            Some(b.command.clone())
                        }
                        _ => None,
                    }
                };
                if let Some(command) = before {
                    let upstream = shared.upstream.lock().unwrap().unwrap();
                    let mut side = TcpStream::connect(upstream).await.unwrap();
                    side.write_all(&command).await.unwrap();
                    let mut reply = [0u8; 256];
                    let read = side.read(&mut reply).await.unwrap();
                    assert!(read > 0, "the server closed the side connection");
                    shared.befores.fetch_add(1, Ordering::SeqCst);
                }
                if stall {
                    shared.stalled_requests.fetch_add(1, Ordering::SeqCst);
                    // Keep both halves open and say nothing more, ever.
                    let _open = (&client_rx, &server_tx);
                    std::future::pending::<()>().await;
                }
                shared.requests.fetch_add(1, Ordering::SeqCst);
                let (cut, lose) = (
                    shared.cut_permille.load(Ordering::SeqCst),
                    shared.lose_permille.load(Ordering::SeqCst),
                );
                if cut + lose > 0 {
                    let roll = shared.roll();
                    if roll < cut {
                        shared.cut.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    if roll < cut + lose {
                        swallow.store(true, Ordering::SeqCst);
                    }
                }
                if server_tx.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    let down = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            while shared.stalled.load(Ordering::SeqCst) {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            let delay = shared.delay_us.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_micros(delay as u64)).await;
            }
            if swallow.load(Ordering::SeqCst) {
                shared.dropped.fetch_add(1, Ordering::SeqCst);
                let _ = client_tx.shutdown().await;
                return;
            }
            if client_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    // Whichever side ends first closes the whole relay.
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}
