//! A TCP proxy that can lose a reply: it forwards a request to the server (which applies it)
//! and closes the client's connection instead of forwarding the reply. This is how a real
//! network loses the answer to a command that did take effect.

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
    dropped: AtomicUsize,
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
        let tasks = Arc::new(Mutex::new(JoinSet::new()));
        let accept = {
            let (shared, tasks) = (shared.clone(), tasks.clone());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
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

    /// The next request whose bytes contain `marker` reaches the server, but its reply is
    /// lost and the connection closed.
    pub fn lose_reply_to(&self, marker: &[u8]) {
        *self.shared.armed.lock().unwrap() = Some(marker.to_vec());
    }

    /// How many replies were lost.
    pub fn lost(&self) -> usize {
        self.shared.dropped.load(Ordering::SeqCst)
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
                {
                    let mut armed = shared.armed.lock().unwrap();
                    if let Some(marker) = armed.as_deref() {
                        if buf[..n].windows(marker.len()).any(|w| w == marker) {
                            swallow.store(true, Ordering::SeqCst);
                            *armed = None;
                        }
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
