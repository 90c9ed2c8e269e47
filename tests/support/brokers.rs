//! What the RabbitMQ and NATS tests share: connections that fail loudly when a server is
//! missing, unique names, the order handler (an `#[idempotent]` function with a `done`
//! check against the PostgreSQL business table of the seed load test), waiting on
//! conditions with deadlines, and consumer child processes to kill.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::collections::HashSet;
use std::future::Future;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idempotency::broker::Settle;
use idempotency::{idempotent, SharedStore};
use serde::{Deserialize, Serialize};

use crate::business::{Business, Effect};

pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const NATS_URL: &str = "127.0.0.1:4222";

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| AMQP_URL.into())
}

pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| NATS_URL.into())
}

pub fn redis_url() -> String {
    std::env::var("IDEMPOTENT_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub fn business_url() -> String {
    std::env::var("IDEMPOTENT_BUSINESS_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A name no other test or run uses: `<prefix>_<pid>_<n>_<millis>`.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        % 1_000_000;
    format!(
        "{prefix}_{}_{}_{millis}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

pub async fn rabbitmq() -> lapin::Connection {
    let url = amqp_url();
    match lapin::Connection::connect(&url, lapin::ConnectionProperties::default()).await {
        Ok(conn) => conn,
        Err(err) => panic!(
            "RabbitMQ is not reachable at {url}: {err}\n\
             start it with: rabbitmq-server -detached"
        ),
    }
}

pub async fn nats() -> async_nats::Client {
    let url = nats_url();
    match async_nats::connect(&url).await {
        Ok(client) => client,
        Err(err) => panic!(
            "NATS is not reachable at {url}: {err}\n\
             start it (with JetStream) with: start-stop-daemon --start --oknodo --background \
             --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server \
             -l /var/log/nats-server.log"
        ),
    }
}

pub async fn store(url: &str) -> SharedStore {
    match idempotency::connect(url).await {
        Ok(store) => store,
        Err(err) => panic!(
            "the store at {url} is not reachable: {err:?}\n\
             start Redis with: redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save \"\" --appendonly no"
        ),
    }
}

/// A business schema with `orders` orders in `INIT`.
pub async fn business(schema: &str, orders: u32) -> Business {
    let url = business_url();
    match Business::create(&url, schema, orders).await {
        Ok(business) => business,
        Err(err) => panic!(
            "PostgreSQL is not usable at {url}: {err}\n\
             start it with: service postgresql start"
        ),
    }
}

/// Waits until `check` is true, polling every 20 ms; panics with `what` after `within`.
pub async fn wait_for<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// "Cook this free-meal order for this activity", for one tenant (a test).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderMessage {
    pub message_id: String,
    pub tenant: String,
    pub order_id: String,
    pub activity_id: String,
}

impl OrderMessage {
    pub fn new(tenant: &str, order: u32, copy: u32) -> OrderMessage {
        OrderMessage {
            message_id: format!("msg-{order:04}-{copy}"),
            tenant: tenant.into(),
            order_id: Business::order_id(order),
            activity_id: "free-meal-2026".into(),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap()
    }
}

/// `orders` × `copies` messages (1 to 3 copies): copies 1 and 2 of an order side by side
/// (consumed at the same time), copy 3 a third of the orders later.
pub fn messages(tenant: &str, orders: u32, copies: u32) -> Vec<OrderMessage> {
    assert!((1..=3).contains(&copies), "1 to 3 copies");
    let gap = (orders / 3).max(1);
    let mut out = Vec::new();
    for n in 1..=orders + gap {
        if n <= orders {
            out.push(OrderMessage::new(tenant, n, 1));
            if copies >= 2 {
                out.push(OrderMessage::new(tenant, n, 2));
            }
        }
        if copies == 3 && n > gap {
            out.push(OrderMessage::new(tenant, n - gap, 3));
        }
    }
    out
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotency::Error),
    #[error("business database error")]
    Business(#[from] sqlx::Error),
    #[error("malformed message")]
    Malformed(#[from] serde_json::Error),
    #[error("the kitchen is down")]
    KitchenDown,
}

impl Settle for AppError {
    fn idempotency_error(&self) -> Option<&idempotency::Error> {
        match self {
            AppError::Idempotency(err) => Some(err),
            _ => None,
        }
    }
    fn is_permanent(&self) -> bool {
        matches!(self, AppError::Malformed(_))
    }
}

/// The order consumer: at most once per (tenant, order, activity); the business check
/// answers when the store lost its records or a dead owner's claim is still live.
#[idempotent(
    prefix = "test:order:consume",
    keys = [msg.tenant, msg.order_id, msg.activity_id],
    ttl = 600,
    lease = 2,
    store = store,
    done = orders.is_consumed(&msg.order_id)
)]
pub async fn on_order(
    msg: &OrderMessage,
    orders: &Business,
    store: &SharedStore,
    work: Duration,
) -> Result<Effect, AppError> {
    Ok(orders.consume(&msg.order_id, &msg.message_id, work).await?)
}

/// What the handlers of one consumer saw.
#[derive(Default)]
pub struct Seen {
    pub in_progress: AtomicU64,
    pub store_errors: AtomicU64,
    pub failures: AtomicU64,
    /// Messages acknowledged (as run or as duplicates) while their order was not consumed.
    pub acked_before_effect: AtomicU64,
    /// Message ids seen on a redelivery.
    pub redelivered: Mutex<HashSet<String>>,
}

impl Seen {
    /// The counts, as a timed-out test prints them.
    pub fn describe(&self) -> String {
        let mut redelivered: Vec<String> =
            self.redelivered.lock().unwrap().iter().cloned().collect();
        redelivered.sort();
        format!(
            "in_progress {}, store_errors {}, failures {}, acked_before_effect {}, redelivered {redelivered:?}",
            self.in_progress.load(Ordering::SeqCst),
            self.store_errors.load(Ordering::SeqCst),
            self.failures.load(Ordering::SeqCst),
            self.acked_before_effect.load(Ordering::SeqCst),
        )
    }
}

/// One consumer's handler state.
pub struct Kitchen {
    pub orders: Business,
    pub store: SharedStore,
    pub work: Duration,
    pub seen: Seen,
}

impl Kitchen {
    /// Decodes and handles one message, and records its final outcome (in the business
    /// database, before the caller settles it) or why it will be redelivered.
    pub async fn handle(&self, payload: &[u8], redelivered: bool) -> Result<Effect, AppError> {
        let msg: OrderMessage = serde_json::from_slice(payload)?;
        if redelivered {
            self.seen
                .redelivered
                .lock()
                .unwrap()
                .insert(msg.message_id.clone());
        }
        let result = on_order(&msg, &self.orders, &self.store, self.work).await;
        self.record(&msg, &result).await?;
        result
    }

    /// Records a final outcome (`executed`, `absorbed`, `filtered`) before the ack, checking
    /// that the order's effect is applied; counts the rest.
    pub async fn record(
        &self,
        msg: &OrderMessage,
        result: &Result<Effect, AppError>,
    ) -> Result<(), AppError> {
        let outcome = match result {
            Ok(Effect::Applied) => "executed",
            Ok(Effect::AlreadyApplied) => "absorbed",
            Err(AppError::Idempotency(err)) if err.is_duplicate() => "filtered",
            Err(AppError::Idempotency(idempotency::Error::InProgress { .. })) => {
                self.seen.in_progress.fetch_add(1, Ordering::SeqCst);
                return Ok(());
            }
            Err(AppError::Idempotency(idempotency::Error::Store(_))) => {
                self.seen.store_errors.fetch_add(1, Ordering::SeqCst);
                return Ok(());
            }
            Err(_) => {
                self.seen.failures.fetch_add(1, Ordering::SeqCst);
                return Ok(());
            }
        };
        if !self.orders.is_consumed(&msg.order_id).await? {
            self.seen.acked_before_effect.fetch_add(1, Ordering::SeqCst);
        }
        self.orders
            .settle(&msg.message_id, &msg.order_id, outcome)
            .await?;
        Ok(())
    }
}

/// A child process running one `#[ignore]`d test of the current test binary as a consumer;
/// killed (SIGKILL) on drop.
pub struct ChildConsumer {
    child: Child,
}

impl ChildConsumer {
    pub fn spawn(test: &str, env: &[(&str, String)]) -> ChildConsumer {
        let exe = std::env::current_exe().expect("no path to the test binary");
        let mut cmd = Command::new(exe);
        cmd.args([
            test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
        for (key, value) in env {
            cmd.env(key, value);
        }
        ChildConsumer {
            child: cmd
                .spawn()
                .expect("cannot re-run the test binary as a consumer"),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, then wait for the process to be gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether it exited already.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Waits until this consumer is in the middle of exactly one handler (per the business
    /// table), SIGKILLs it there, and returns the message ids that handler was running.
    pub async fn kill_mid_handler(&mut self, orders: &Business) -> Vec<String> {
        let pid = self.pid();
        {
            let child_alive = Mutex::new(&mut *self);
            wait_for(
                "the child's handler to start",
                Duration::from_secs(30),
                || async {
                    assert!(
                        !child_alive.lock().unwrap().exited(),
                        "the child consumer exited early"
                    );
                    orders.unfinished(pid).await.unwrap() == 1
                },
            )
            .await;
        }
        self.kill();
        let victims = orders.unfinished_messages(pid).await.unwrap();
        assert_eq!(
            victims.len(),
            1,
            "one handler was running when the child was killed"
        );
        victims
    }
}

impl Drop for ChildConsumer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Deletes a tenant's records from the shared Redis (they would expire with their ttl).
pub fn delete_tenant_keys(tenant: &str) {
    let Ok(client) = redis::Client::open(redis_url()) else {
        return;
    };
    let Ok(mut conn) = client.get_connection() else {
        return;
    };
    let pattern = format!("test:order:consume:v1:{{*:{tenant},*");
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg(pattern)
        .query(&mut conn)
        .unwrap_or_default();
    if !keys.is_empty() {
        let _: Result<redis::Value, _> = redis::cmd("DEL").arg(keys).query(&mut conn);
    }
}

/// Runs `cleanup` on a fresh runtime in a plain thread (the test's runtime may be gone, or
/// the test may be panicking).
pub fn cleanup_in_thread<F, Fut>(cleanup: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let _ = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(cleanup());
    })
    .join();
}
