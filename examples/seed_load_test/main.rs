//! The seed article's load test, reproduced on real servers: 1,000 orders × 3 identical
//! messages (same business key, distinct message ids) on a RabbitMQ queue, 50 concurrent
//! consumers doing 50 ms of work each, and the effects counted in a PostgreSQL business
//! table.
//!
//! Each order row moves `INIT` → `CONSUMED` by compare-and-set, and every applied effect
//! appends a ledger row in the same transaction. The handler is guarded by the engine with
//! `done = <is the order CONSUMED?>`, so effects stay exact even when the store forgets.
//! Required, in every mode: exactly 1,000 effects (ledger rows), 0 messages acknowledged as
//! duplicates whose order is not `CONSUMED` (wrongly filtered), 0 orders still `INIT` (lost).
//! Without faults: 2,000 filtered and 1,000 handler executions.
//!
//! Modes:
//! - (none): 50 concurrent handlers in this process (prefetch 50), on the store at
//!   `IDEMPOTENT_STORE_URL` (default `redis://127.0.0.1:6379`).
//! - `--kill-consumers`: 5 consumer processes (this program re-run with `--consumer`), 10
//!   concurrent handlers each; three times during the run the one with the most handlers in
//!   flight is killed with SIGKILL and started again. RabbitMQ redelivers its unacknowledged
//!   messages; their claims are taken over when the 3 s lease runs out, or answered by `done`.
//! - `--restart-redis`: a `redis-server` this program starts (free port, no persistence) is
//!   killed mid-run and started again empty after 500 ms; claims fail closed meanwhile
//!   (messages redelivered), and afterwards the empty store is corrected by `done`.
//!   `IDEMPOTENT_STORE_URL` is ignored.
//!
//! Executions above 1,000 are re-runs that a kill or a restart forced; the program says how
//! many. Handler executions are counted in PostgreSQL, so those of killed processes count.
//! The last line is `effects=<n> filtered=<n> wrong=<n> lost=<n> executions=<n>
//! claim_p99_ms=<x>` (on Redis, in-process, followed by `raw_set_nx_p99_ms=<x>
//! claim_p99_over_raw=<x>`: the p99 of a raw `SET key token NX PX lease` the same consumers
//! send next to each claim, and the ratio; the target is at most 1.2); the exit status is
//! non-zero unless effects = 1,000, wrong = 0 and
//! lost = 0. The queue, the schema and the run's store keys are removed at the end.
//!
//! Needs: RabbitMQ on 127.0.0.1:5672 (`AMQP_URL`), PostgreSQL at
//! `IDEMPOTENT_BUSINESS_URL` (default `postgres://postgres@127.0.0.1:5432/test`), a store (see
//! above; `redis-server` installed for `--restart-redis`).
//!
//! ```text
//! cargo run --release --example seed_load_test
//! cargo run --release --example seed_load_test -- --kill-consumers
//! cargo run --release --example seed_load_test -- --restart-redis
//! IDEMPOTENT_STORE_URL=postgres://postgres@127.0.0.1:5432/test cargo run --release --example seed_load_test
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod business;
mod redis_server;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use business::{Business, Effect};
use idempotency::broker::{rabbitmq, Redelivery, Settle, Summary};
use idempotency::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Record, Store, StoreError, Token,
};
use idempotency::{Idempotency, Key, SharedStore};
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};

const ORDERS: u32 = 1_000;
const COPIES: u32 = 3;
const CONSUMERS: usize = 50;
const PROCESSES: usize = 5;
const WORK: Duration = Duration::from_millis(50);
const LEASE: Duration = Duration::from_secs(3);
const TTL: Duration = Duration::from_secs(3600);
/// Effects after which a consumer process is killed (`--kill-consumers`).
const KILL_AT: [i64; 3] = [150, 400, 650];
/// Effects after which Redis is restarted empty (`--restart-redis`).
const RESTART_AT: i64 = 400;
const DEADLINE: Duration = Duration::from_secs(100);

#[derive(Debug, Serialize, Deserialize)]
struct OrderMessage {
    message_id: String,
    order_id: String,
    activity_id: String,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] idempotency::Error),
    #[error("business database error")]
    Business(#[from] sqlx::Error),
    #[error("malformed message")]
    Malformed(#[from] serde_json::Error),
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

/// Everything a consumer needs; the same in this process and in `--consumer` children.
struct Setup {
    amqp_url: String,
    business_url: String,
    store_url: String,
    queue: String,
    schema: String,
    prefix: String,
}

impl Setup {
    fn to_env(&self, cmd: &mut Command) {
        cmd.env("SEED_AMQP_URL", &self.amqp_url)
            .env("SEED_BUSINESS_URL", &self.business_url)
            .env("SEED_STORE_URL", &self.store_url)
            .env("SEED_QUEUE", &self.queue)
            .env("SEED_SCHEMA", &self.schema)
            .env("SEED_PREFIX", &self.prefix);
    }

    fn from_env() -> Result<Setup, std::env::VarError> {
        Ok(Setup {
            amqp_url: std::env::var("SEED_AMQP_URL")?,
            business_url: std::env::var("SEED_BUSINESS_URL")?,
            store_url: std::env::var("SEED_STORE_URL")?,
            queue: std::env::var("SEED_QUEUE")?,
            schema: std::env::var("SEED_SCHEMA")?,
            prefix: std::env::var("SEED_PREFIX")?,
        })
    }
}

/// Counts what the handlers of one process saw.
#[derive(Default)]
struct Counters {
    store_errors: AtomicU64,
    in_progress: AtomicU64,
    /// Times the business check said "already CONSUMED" (the store did not know, or the
    /// owner finished meanwhile).
    done: AtomicU64,
}

/// The handler's context.
struct Context {
    guard: Idempotency,
    business: Business,
    prefix: String,
    counters: Counters,
}

/// The consumer: the seed's handler, guarded by the engine with the business check.
async fn on_order(cx: Arc<Context>, delivery: rabbitmq::Message) -> Result<Effect, AppError> {
    let msg: OrderMessage = serde_json::from_slice(&delivery.data)?;
    let key = Key::new(&cx.prefix, 1, &[&msg.order_id, &msg.activity_id])
        .map_err(idempotency::Error::from)?;
    let (business, counters, order_id) = (&cx.business, &cx.counters, msg.order_id.as_str());
    let result: Result<Effect, AppError> = cx
        .guard
        .operation(key)
        .done(|| async move {
            let consumed = business.is_consumed(order_id).await;
            if matches!(consumed, Ok(true)) {
                counters.done.fetch_add(1, Ordering::Relaxed);
            }
            consumed
        })
        .run(async {
            Ok(business
                .consume(&msg.order_id, &msg.message_id, WORK)
                .await?)
        })
        .await;
    // Each message's final outcome is recorded before it is acknowledged.
    let outcome = match &result {
        Ok(Effect::Applied) => Some("executed"),
        Ok(Effect::AlreadyApplied) => Some("absorbed"),
        Err(AppError::Idempotency(err)) if err.is_duplicate() => Some("filtered"),
        Err(AppError::Idempotency(idempotency::Error::Store(_))) => {
            cx.counters.store_errors.fetch_add(1, Ordering::Relaxed);
            None
        }
        Err(AppError::Idempotency(idempotency::Error::InProgress { .. })) => {
            cx.counters.in_progress.fetch_add(1, Ordering::Relaxed);
            None
        }
        Err(_) => None,
    };
    if let Some(outcome) = outcome {
        business
            .settle(&msg.message_id, &msg.order_id, outcome)
            .await?;
    }
    result
}

/// A store that times successful claims and, where the store is Redis, times next to each
/// claim the raw `SET key token NX PX lease` a hand-written consumer would send (on a
/// connection of its own to the same server, to a probe key under the run's prefix).
struct Timed {
    inner: SharedStore,
    samples: Mutex<Vec<u32>>,
    raw: Option<(redis::aio::ConnectionManager, String)>,
    raw_samples: Mutex<Vec<u32>>,
}

impl Timed {
    fn take(&self) -> Vec<u32> {
        std::mem::take(&mut *self.samples.lock().unwrap())
    }

    fn take_raw(&self) -> Vec<u32> {
        std::mem::take(&mut *self.raw_samples.lock().unwrap())
    }

    async fn raw_set_nx(&self, token: &Token) {
        let Some((conn, prefix)) = &self.raw else {
            return;
        };
        let key = format!("{prefix}:raw-probe:{token:?}");
        let start = Instant::now();
        let set: redis::RedisResult<Option<String>> = redis::cmd("SET")
            .arg(&key)
            .arg(&token.as_bytes()[..])
            .arg("NX")
            .arg("PX")
            .arg(LEASE.as_millis() as u64)
            .query_async(&mut conn.clone())
            .await;
        if set.is_ok() {
            let micros = u32::try_from(start.elapsed().as_micros()).unwrap_or(u32::MAX);
            self.raw_samples.lock().unwrap().push(micros);
        }
    }
}

impl Store for Timed {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            // Half the claims send the raw command first, half after, so neither side is
            // always timed on the busier moment.
            let raw_first = req.token.as_bytes()[8] & 1 == 0;
            if raw_first {
                self.raw_set_nx(&req.token).await;
            }
            let start = Instant::now();
            let claim = self.inner.claim(req).await;
            if claim.is_ok() {
                let micros = u32::try_from(start.elapsed().as_micros()).unwrap_or(u32::MAX);
                self.samples.lock().unwrap().push(micros);
            }
            if !raw_first {
                self.raw_set_nx(&req.token).await;
            }
            claim
        })
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.complete(key, token, completion)
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.release(key, token)
    }
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.renew(key, token, lease)
    }
    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.inner.read(key)
    }
}

/// One consuming process's connection: `concurrency` handlers at once.
struct Consumer {
    conn: Connection,
    channel: Channel,
    task: tokio::task::JoinHandle<Result<Summary, rabbitmq::Error>>,
    context: Arc<Context>,
    timed: Arc<Timed>,
}

impl Consumer {
    /// A consumer; `time_raw`: also time a raw `SET NX PX` next to each claim (on Redis).
    async fn start(
        setup: &Setup,
        concurrency: usize,
        time_raw: bool,
    ) -> Result<Consumer, Box<dyn std::error::Error + Send + Sync>> {
        let raw = if time_raw && setup.store_url.starts_with("redis://") {
            let client = redis::Client::open(setup.store_url.as_str())?;
            Some((
                redis::aio::ConnectionManager::new(client).await?,
                setup.prefix.clone(),
            ))
        } else {
            None
        };
        let timed = Arc::new(Timed {
            inner: idempotency::connect(&setup.store_url).await?,
            samples: Mutex::new(Vec::new()),
            raw,
            raw_samples: Mutex::new(Vec::new()),
        });
        let business = Business::connect(
            &setup.business_url,
            &setup.schema,
            u32::try_from(concurrency / 2 + 2).unwrap_or(8),
        )
        .await?;
        let context = Arc::new(Context {
            guard: Idempotency::new(TTL).lease(LEASE).store(timed.clone()),
            business,
            prefix: setup.prefix.clone(),
            counters: Counters::default(),
        });
        let conn = Connection::connect(&setup.amqp_url, ConnectionProperties::default()).await?;
        let channel = conn.create_channel().await?;
        channel
            .basic_qos(
                u16::try_from(concurrency).unwrap_or(u16::MAX),
                BasicQosOptions::default(),
            )
            .await?;
        let consumer = channel
            .basic_consume(
                setup.queue.as_str().into(),
                "seed".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let redelivery = Redelivery::new()
            .max_deliveries(10)
            .retry_delay(Duration::from_millis(200))
            .in_progress_delay(Duration::from_millis(100));
        let cx = context.clone();
        // A classic queue: a redelivery carries no count (see `rabbitmq::Queue`).
        let queue = rabbitmq::Queue::classic(consumer.queue().as_str());
        let task = tokio::spawn(rabbitmq::consume(
            consumer,
            queue,
            concurrency,
            redelivery,
            // Until the consumer is cancelled (`stop`).
            std::future::pending(),
            move |delivery| on_order(cx.clone(), delivery),
        ));
        Ok(Consumer {
            conn,
            channel,
            task,
            context,
            timed,
        })
    }

    /// Stops taking deliveries, finishes and settles those in flight.
    async fn stop(self) -> Result<Summary, Box<dyn std::error::Error + Send + Sync>> {
        self.channel
            .basic_cancel("seed".into(), BasicCancelOptions::default())
            .await?;
        let summary = self.task.await??;
        self.conn.close(200, "done".into()).await?;
        self.context.business.close().await;
        Ok(summary)
    }
}

/// `--consumer`: a child process consuming until its stdin closes; reports claim latencies
/// and, at the end, its summary on stdout.
async fn consumer_process() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let setup = Setup::from_env()?;
    let concurrency: usize = std::env::var("SEED_CONCURRENCY")?.parse()?;
    let consumer = Consumer::start(&setup, concurrency, false).await?;
    let (closed_tx, mut closed) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        let _ = closed_tx.send(());
    });
    let report = |samples: Vec<u32>| {
        if !samples.is_empty() {
            let line: Vec<String> = samples.iter().map(u32::to_string).collect();
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "claims {}", line.join(" "));
            let _ = out.flush();
        }
    };
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = &mut closed => break,
            _ = tick.tick() => report(consumer.timed.take()),
        }
    }
    let timed = consumer.timed.clone();
    let counters = consumer.context.clone();
    let summary = consumer.stop().await?;
    report(timed.take());
    println!(
        "summary {} {} {} {} {} {} {}",
        summary.acked,
        summary.redelivered,
        summary.dead_lettered,
        summary.unsettled,
        counters.counters.store_errors.load(Ordering::Relaxed),
        counters.counters.in_progress.load(Ordering::Relaxed),
        counters.counters.done.load(Ordering::Relaxed),
    );
    Ok(())
}

/// What the children reported.
#[derive(Default)]
struct Reports {
    samples: Vec<u32>,
    summaries: Vec<[u64; 7]>,
}

/// A `--consumer` child.
struct ChildConsumer {
    child: Child,
    stdin: Option<ChildStdin>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl ChildConsumer {
    fn spawn(
        setup: &Setup,
        concurrency: usize,
        reports: &Arc<Mutex<Reports>>,
    ) -> std::io::Result<ChildConsumer> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("--consumer")
            .env("SEED_CONCURRENCY", concurrency.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        setup.to_env(&mut cmd);
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let reports = reports.clone();
        let reader = std::thread::spawn(move || {
            let Some(stdout) = stdout else { return };
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let mut words = line.split_whitespace();
                let mut reports = reports.lock().unwrap();
                match words.next() {
                    Some("claims") => reports
                        .samples
                        .extend(words.filter_map(|w| w.parse::<u32>().ok())),
                    Some("summary") => {
                        let mut summary = [0u64; 7];
                        for (slot, word) in summary.iter_mut().zip(words) {
                            *slot = word.parse().unwrap_or(0);
                        }
                        reports.summaries.push(summary);
                    }
                    _ => {}
                }
            }
        });
        Ok(ChildConsumer {
            child,
            stdin,
            reader: Some(reader),
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status, if the process exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGKILL, and wait for the process to be gone.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }

    /// Closes stdin (the child stops consuming, finishes its handlers and exits); waits up to
    /// `within`, then kills it.
    async fn stop(mut self, within: Duration) -> bool {
        drop(self.stdin.take());
        let deadline = Instant::now() + within;
        let clean = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break status.success(),
                Ok(None) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                _ => {
                    self.kill();
                    break false;
                }
            }
        };
        if let Some(reader) = self.reader.take() {
            let _ = tokio::task::spawn_blocking(move || reader.join()).await;
        }
        clean
    }
}

fn millis(micros: f64) -> f64 {
    micros / 1000.0
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--consumer") {
        if let Err(err) = consumer_process().await {
            eprintln!("consumer {}: {err}", std::process::id());
            std::process::exit(1);
        }
        return;
    }
    let kill_consumers = args.iter().any(|a| a == "--kill-consumers");
    let restart_redis = args.iter().any(|a| a == "--restart-redis");
    if let Some(unknown) = args
        .iter()
        .find(|a| !matches!(a.as_str(), "--kill-consumers" | "--restart-redis"))
    {
        eprintln!("unknown argument {unknown:?}; expected --kill-consumers and/or --restart-redis");
        std::process::exit(2);
    }
    match run(kill_consumers, restart_redis).await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(err) => {
            eprintln!("seed load test failed: {err}");
            let mut source = std::error::Error::source(&*err);
            while let Some(cause) = source {
                eprintln!("  caused by: {cause}");
                source = cause.source();
            }
            std::process::exit(1);
        }
    }
}

async fn run(
    kill_consumers: bool,
    restart_redis: bool,
) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    let run_id = format!(
        "{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
            % 1_000_000
    );
    let mut redis = if restart_redis {
        Some(redis_server::RedisServer::start()?)
    } else {
        None
    };
    let setup = Setup {
        amqp_url: std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
        business_url: std::env::var("IDEMPOTENT_BUSINESS_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
        store_url: match &redis {
            Some(server) => server.url(),
            None => std::env::var("IDEMPOTENT_STORE_URL")
                .unwrap_or_else(|_| "redis://127.0.0.1:6379".into()),
        },
        queue: format!("idempotent.seed.{run_id}"),
        schema: format!("idempotent_seed_{run_id}"),
        prefix: format!("seed:{run_id}:order:consume"),
    };
    println!(
        "seed load test: {ORDERS} orders x {COPIES} identical messages, {CONSUMERS} concurrent consumers, {} ms of work each{}{}",
        WORK.as_millis(),
        if kill_consumers { ", consumers killed mid-handler" } else { "" },
        if restart_redis { ", Redis restarted empty mid-run" } else { "" },
    );
    println!("store:    {} (keys {}:*)", setup.store_url, setup.prefix);
    println!(
        "broker:   {} (queue {})",
        redact(&setup.amqp_url),
        setup.queue
    );
    println!("business: {} (schema {})", setup.business_url, setup.schema);

    let conn = Connection::connect(&setup.amqp_url, ConnectionProperties::default())
        .await
        .map_err(|e| {
            format!("RabbitMQ is not reachable ({e}); start it with `rabbitmq-server -detached`")
        })?;
    let business = Business::create(&setup.business_url, &setup.schema, ORDERS)
        .await
        .map_err(|e| format!("PostgreSQL at {} is not usable: {e}", setup.business_url))?;

    let outcome = exercise(&setup, &conn, &business, redis.as_mut(), kill_consumers).await;

    // Clean up whatever happened.
    if let Ok(channel) = conn.create_channel().await {
        let dead = format!("{}.dead", setup.queue);
        let _ = channel
            .queue_delete(setup.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = channel
            .queue_delete(dead.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "done".into()).await;
    business.close().await;
    let _ = Business::drop_schema(&setup.business_url, &setup.schema).await;
    if redis.is_none() && setup.store_url.starts_with("redis://") {
        let (url, pattern) = (setup.store_url.clone(), format!("{}:*", setup.prefix));
        let _ = tokio::task::spawn_blocking(move || delete_keys(&url, &pattern)).await;
    }
    outcome
}

/// Publishes, consumes (with the faults of the mode), and reports.
async fn exercise(
    setup: &Setup,
    conn: &Connection,
    business: &Business,
    mut redis: Option<&mut redis_server::RedisServer>,
    kill_consumers: bool,
) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    let channel = conn.create_channel().await?;
    let dead = format!("{}.dead", setup.queue);
    channel
        .queue_declare(
            dead.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(dead.as_str().into()),
    );
    channel
        .queue_declare(
            setup.queue.as_str().into(),
            QueueDeclareOptions::default(),
            args,
        )
        .await?;

    // Copies 1 and 2 of an order side by side (consumed at the same time), copy 3 fifty
    // orders later (after the first has completed, usually).
    let started = Instant::now();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut order = Vec::with_capacity((ORDERS * COPIES) as usize);
    for n in 1..=ORDERS + 50 {
        if n <= ORDERS {
            order.push((n, 1));
            order.push((n, 2));
        }
        if n > 50 {
            order.push((n - 50, 3));
        }
    }
    let mut confirms = Vec::with_capacity(order.len());
    for (n, copy) in order {
        let msg = OrderMessage {
            message_id: format!("msg-{n:04}-{copy}"),
            order_id: Business::order_id(n),
            activity_id: "free-meal-2026".into(),
        };
        let properties = BasicProperties::default().with_message_id(msg.message_id.as_str().into());
        confirms.push(
            channel
                .basic_publish(
                    "".into(),
                    setup.queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &serde_json::to_vec(&msg)?,
                    properties,
                )
                .await?,
        );
    }
    for confirm in confirms {
        confirm.await?;
    }
    println!(
        "published {} messages in {:.1} s",
        ORDERS * COPIES,
        started.elapsed().as_secs_f64()
    );

    let started = Instant::now();
    let reports = Arc::new(Mutex::new(Reports::default()));
    let mut local = None;
    let mut children = Vec::new();
    if kill_consumers {
        for _ in 0..PROCESSES {
            children.push(ChildConsumer::spawn(
                setup,
                CONSUMERS / PROCESSES,
                &reports,
            )?);
        }
    } else {
        local = Some(Consumer::start(setup, CONSUMERS, true).await?);
    }

    let mut kills = KILL_AT.iter().peekable();
    let mut restarted = false;
    let mut killed_pids = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    let (settled, _) = loop {
        let (settled, effects) = business.progress().await?;
        if settled >= i64::from(ORDERS * COPIES) || Instant::now() > deadline {
            break (settled, effects);
        }
        if kill_consumers && kills.peek().is_some_and(|at| effects >= **at) {
            kills.next();
            // The process with the most handlers in flight.
            let mut busiest = (0, -1);
            for (i, child) in children.iter().enumerate() {
                let unfinished = business.unfinished(child.pid()).await?;
                if unfinished > busiest.1 {
                    busiest = (i, unfinished);
                }
            }
            let victim = &mut children[busiest.0];
            let pid = victim.pid();
            victim.kill();
            killed_pids.push(pid);
            let interrupted = business.unfinished_messages(pid).await?;
            *victim = ChildConsumer::spawn(setup, CONSUMERS / PROCESSES, &reports)?;
            println!(
                "[{:>5.2} s] effects {effects:>4}: consumer pid {pid} killed (SIGKILL) with {} handlers mid-way ({}); restarted as pid {}",
                started.elapsed().as_secs_f64(),
                interrupted.len(),
                interrupted.join(", "),
                children[busiest.0].pid()
            );
        }
        // A supervisor's job: a consumer that exited on its own (it could not reach the store
        // while Redis was down, say) is started again.
        for child in children.iter_mut() {
            if let Some(status) = child.exited() {
                let pid = child.pid();
                *child = ChildConsumer::spawn(setup, CONSUMERS / PROCESSES, &reports)?;
                println!(
                    "[{:>5.2} s] consumer pid {pid} exited ({status}); restarted as pid {}",
                    started.elapsed().as_secs_f64(),
                    child.pid()
                );
            }
        }
        if let Some(server) = redis.as_deref_mut() {
            if !restarted && effects >= RESTART_AT {
                restarted = true;
                server.kill();
                let down = Instant::now();
                tokio::time::sleep(Duration::from_millis(500)).await;
                tokio::task::block_in_place(|| server.restart())?;
                println!(
                    "[{:>5.2} s] effects {effects:>4}: Redis killed, restarted empty {:.1} s later",
                    started.elapsed().as_secs_f64(),
                    down.elapsed().as_secs_f64()
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let consumed_in = started.elapsed();

    // Stop the consumers: in-flight handlers finish and their messages are settled.
    let mut summary = [0u64; 7];
    let mut samples = Vec::new();
    let mut raw_samples = Vec::new();
    if let Some(consumer) = local {
        let timed = consumer.timed.clone();
        let context = consumer.context.clone();
        let s = consumer.stop().await?;
        summary = [
            s.acked,
            s.redelivered,
            s.dead_lettered,
            s.unsettled,
            context.counters.store_errors.load(Ordering::Relaxed),
            context.counters.in_progress.load(Ordering::Relaxed),
            context.counters.done.load(Ordering::Relaxed),
        ];
        samples = timed.take();
        raw_samples = timed.take_raw();
    }
    for child in children {
        let pid = child.pid();
        if !child.stop(Duration::from_secs(30)).await {
            println!("consumer pid {pid} did not stop cleanly");
        }
    }
    {
        let mut reports = reports.lock().unwrap();
        samples.append(&mut reports.samples);
        for s in &reports.summaries {
            for (total, n) in summary.iter_mut().zip(s) {
                *total += n;
            }
        }
    }

    let passive = QueueDeclareOptions::default().passive();
    let left = channel
        .queue_declare(setup.queue.as_str().into(), passive, FieldTable::default())
        .await?
        .message_count();
    let dead_lettered = channel
        .queue_declare(dead.as_str().into(), passive, FieldTable::default())
        .await?
        .message_count();
    let tally = business.tally().await?;

    samples.sort_unstable();
    let avg = if samples.is_empty() {
        0.0
    } else {
        samples.iter().map(|&s| f64::from(s)).sum::<f64>() / samples.len() as f64
    };
    let p99 = p99_of(&samples);
    raw_samples.sort_unstable();
    let raw_p99 = p99_of(&raw_samples);

    println!("consumed in {:.1} s", consumed_in.as_secs_f64());
    println!(
        "messages: {} published, {settled} with a final outcome: {} applied the effect, {} filtered as duplicates, {} ran and found the order consumed; {left} left in the queue, {dead_lettered} dead-lettered",
        ORDERS * COPIES,
        tally.effects,
        tally.filtered,
        tally.absorbed,
    );
    println!(
        "settling{}: acked {}, redelivered {} (another owner in progress {}, store errors {}), dead-lettered {}, unsettled {}; the business check answered \"already consumed\" {} times",
        if kill_consumers { " (consumers that stopped cleanly)" } else { "" },
        summary[0],
        summary[1],
        summary[5],
        summary[4],
        summary[2],
        summary[3],
        summary[6],
    );
    let reruns = tally.executions - tally.effects - tally.absorbed;
    println!(
        "handler executions: {} ({} re-runs forced by kills or restarts; {} cut short by a kill{})",
        tally.executions,
        reruns.max(0),
        tally.interrupted,
        if killed_pids.is_empty() {
            String::new()
        } else {
            format!(" in {} killed processes", killed_pids.len())
        },
    );
    println!(
        "claim latency: avg {:.2} ms, p99 {:.2} ms ({} claims)",
        millis(avg),
        millis(p99),
        samples.len()
    );
    // The raw command is timed by in-process consumers on Redis (not by child processes).
    let raw_line = if raw_samples.is_empty() {
        String::new()
    } else {
        println!(
            "raw SET NX PX sent by the same consumers: p99 {:.2} ms ({} commands); claim p99 / raw p99 = {:.2} (target <= 1.2)",
            millis(raw_p99),
            raw_samples.len(),
            p99 / raw_p99.max(1.0)
        );
        format!(
            " raw_set_nx_p99_ms={:.2} claim_p99_over_raw={:.2}",
            millis(raw_p99),
            p99 / raw_p99.max(1.0)
        )
    };
    println!(
        "processed={} filtered={} wrongly_filtered={} lost={} orders_applied_twice={}",
        tally.effects, tally.filtered, tally.wrong, tally.lost, tally.doubled
    );
    println!(
        "effects={} filtered={} wrong={} lost={} executions={} claim_p99_ms={:.2}{raw_line}",
        tally.effects,
        tally.filtered,
        tally.wrong,
        tally.lost,
        tally.executions,
        millis(p99)
    );
    Ok(tally.effects == i64::from(ORDERS) && tally.wrong == 0 && tally.lost == 0)
}

/// The nearest-rank 99th percentile of sorted `samples`, in microseconds (0 for none).
fn p99_of(samples: &[u32]) -> f64 {
    samples
        .get((samples.len() * 99).div_ceil(100).saturating_sub(1))
        .map_or(0.0, |&s| f64::from(s))
}

/// Removes the run's keys from the shared Redis.
fn delete_keys(url: &str, pattern: &str) -> redis::RedisResult<()> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_connection()?;
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg(pattern).query(&mut conn)?;
    for chunk in keys.chunks(500) {
        let _: redis::Value = redis::cmd("DEL").arg(chunk).query(&mut conn)?;
    }
    Ok(())
}

/// The URL without its password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(start), Some(at)) if at > start => {
            let userinfo = &url[start + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{user}:***{}", &url[..start + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}
