//! The outbox's `Relay` against the relay a user writes by hand with sqlx and lapin.
//!
//! Rows committed to PostgreSQL, one per transaction, published to a RabbitMQ queue of the
//! bench's own by ONE relay with publisher confirms, in one process:
//!
//! - **baseline**: a table of its own (`id`, `payload`, `created_at`, `published_at` and a
//!   partial index on unpublished rows); the producer inserts a row and `pg_notify`s in one
//!   statement; the relay `LISTEN`s, and per round, in one transaction, takes at most 100 rows
//!   with `SELECT ... WHERE published_at IS NULL ORDER BY created_at LIMIT 100 FOR UPDATE SKIP
//!   LOCKED`, publishes each (mandatory, persistent, `message_id` = the row's id) and awaits
//!   its confirm, marks the batch with one `UPDATE ... WHERE id = ANY($1)` and commits; it
//!   goes again at once after a full batch, else waits for a notification or polls each second;
//! - **outbox**: `Outbox::enqueue` in the producer's transaction, published by
//!   `Relay::new(outbox, rabbitmq::Publisher::new(channel, ""))` running `relay.run(stop)`
//!   (its defaults: batches of 100, one confirm awaited per message, polling each second).
//!
//! Each side makes two passes a round, with its table emptied and its relay started fresh
//! before each: a **throughput** pass (2,000 rows from 4 producers enqueuing as fast as they
//! can; rows/s from the first enqueue to the last row's arrival at a consumer of the queue)
//! and a **latency** pass (500 rows from one producer, one every 2 ms, so it measures the
//! relay's wake-up and publication, not queueing: the arrival of each message at the consumer,
//! matched by `message_id`, minus the instant its producer's `commit()` returned). Every pass
//! checks that each row arrived (it fails if one is lost), counts duplicates and checks that
//! no row is left unmarked. After a warm-up of each side, 5 rounds alternate the order; the
//! median of each side is kept.
//!
//! Needs PostgreSQL at `IDEMPOTENT_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`) and RabbitMQ at `AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`). The tables and the queue are named
//! `bench_outbox_<hex>` (unique to the run) and dropped at the end. Run it with:
//!
//! ```text
//! cargo bench --bench outbox --features postgres,rabbitmq
//! ```
//!
//! The last lines are the figures: `baseline_rows_per_s`, `outbox_rows_per_s` (through one
//! relay), `outbox_ratio` (outbox over baseline), then the committed-to-published latency of
//! the paced pass, `baseline_latency_p50_ms`, `baseline_latency_p99_ms`,
//! `outbox_latency_p50_ms`, `outbox_latency_p99_ms`, and this process's allocations per row
//! of the throughput passes (`baseline_allocations`, `outbox_allocations`: producers, relay
//! and consumer). With valgrind installed it then counts each side's instructions per row
//! under callgrind (see `support/instructions.rs`): `baseline_instructions`,
//! `outbox_instructions` and `outbox_instructions_ratio` (the baseline's count over the
//! outbox's: read as the throughput ratio is, the higher the better), a figure the machine's
//! load does not move and that leaves out PostgreSQL and RabbitMQ.
//! `IDEMPOTENT_BENCH_INSTRUCTIONS=0` skips it.

// A measurement program: failing loudly on a broken setup is the right behaviour.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/allocations.rs"]
mod allocations;
#[path = "support/instructions.rs"]
mod instructions;
#[path = "support/stats.rs"]
mod stats;

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use idempotency::outbox::{self, Message, MessageId, Outbox, Relay};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, ConnectionProperties};
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Transaction};
use stats::{figure, median, per_s, percentile};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
type Tx = Transaction<'static, Postgres>;
/// A spawned task's result.
type Task<T> = JoinHandle<Result<T, BoxError>>;
/// `(id, instant its commit returned)` of rows a producer committed.
type Commits = Vec<(String, Instant)>;

/// Rows of a throughput pass, and the producer tasks enqueuing them as fast as they can.
const ROWS: usize = 2_000;
const PRODUCERS: usize = 4;
/// Rows of a latency pass, enqueued by one producer, one every `PACE`.
const PACED_ROWS: usize = 500;
const PACE: Duration = Duration::from_millis(2);
const ROUNDS: usize = 5;
/// Rows of the throughput pass a side runs under callgrind (and twice as many in the second
/// count).
const INSTRUCTION_ROWS: usize = 300;
/// The relay's defaults, which the baseline copies.
const BATCH: usize = 100;
const POLL: Duration = Duration::from_secs(1);
/// Connections of the pool the producers and the relay share (the relay's listener has its
/// own).
const POOL: u32 = 10;
/// The pause between starting a relay and the first enqueue (its listener connects).
const SETTLE: Duration = Duration::from_millis(100);
/// How long a pass waits for its last row before calling the missing ones lost.
const ARRIVAL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a pass keeps listening after its last row, for duplicates.
const GRACE: Duration = Duration::from_millis(100);
const PAYLOAD: &[u8] = br#"{"order":"A-1001","item":"pizza","quantity":2,"note":"outbox bench"}"#;

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Baseline,
    Outbox,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Baseline => "baseline",
            Side::Outbox => "outbox",
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Throughput,
    Latency,
}

/// What one pass measured.
struct Outcome {
    rows: usize,
    elapsed: Duration,
    /// Rows over first enqueue to last arrival.
    rows_per_s: f64,
    /// Rows over first enqueue to last commit: what the producers managed.
    enqueued_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    duplicates: usize,
    /// Messages of an earlier pass that arrived during this one.
    strays: usize,
    relay: String,
}

/// A relay running for a pass.
struct Running {
    /// Stops it.
    stop: oneshot::Sender<()>,
    /// Its task: a summary of what it did.
    task: Task<String>,
    /// Its publisher's channel, to close once it stopped.
    channel: lapin::Channel,
}

struct Bench {
    pool: PgPool,
    /// The publishers' connection (the consumer has its own).
    amqp: lapin::Connection,
    queue: String,
    outbox_table: String,
    baseline_table: String,
    /// `(message_id, arrival)` of every message the consumer receives.
    arrivals: mpsc::UnboundedReceiver<(String, Instant)>,
    /// Rows of a throughput pass (`ROWS`, but under callgrind).
    rows: usize,
}

/// Spawns `tasks` producers committing `rows` rows between them, one per transaction, each
/// written by `insert` (which returns the row's id); row `i` waits for `start + i * pace`
/// when paced. Each producer returns `(id, instant its commit returned)` per row.
fn spawn_producers<C, F>(
    pool: &PgPool,
    tasks: usize,
    rows: usize,
    pace: Option<Duration>,
    start: Instant,
    context: Arc<C>,
    insert: F,
) -> Vec<Task<Commits>>
where
    C: Send + Sync + 'static,
    F: for<'c> Fn(&'c C, &'c mut Tx) -> BoxFuture<'c, Result<String, BoxError>>
        + Copy
        + Send
        + 'static,
{
    (0..tasks)
        .map(|task| {
            let (pool, context) = (pool.clone(), context.clone());
            tokio::spawn(async move {
                let mut commits = Vec::with_capacity(rows / tasks + 1);
                for i in (task..rows).step_by(tasks) {
                    if let Some(pace) = pace {
                        let due = start + pace * u32::try_from(i)?;
                        tokio::time::sleep_until(due.into()).await;
                    }
                    let mut tx = pool.begin().await?;
                    let id = insert(&context, &mut tx).await?;
                    tx.commit().await?;
                    commits.push((id, Instant::now()));
                }
                Ok(commits)
            })
        })
        .collect()
}

/// The hand-written relay: see the file header. Returns a summary once `stop` resolves.
async fn baseline_relay(
    pool: PgPool,
    channel: lapin::Channel,
    table: String,
    queue: String,
    stop: impl Future<Output = ()>,
) -> Result<String, BoxError> {
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut listener = PgListener::connect_with(&pool).await?;
    listener.listen(&table).await?;
    let select: Arc<str> = format!(
        "SELECT id, payload FROM {table} WHERE published_at IS NULL \
         ORDER BY created_at LIMIT {BATCH} FOR UPDATE SKIP LOCKED"
    )
    .into();
    let mark: Arc<str> =
        format!("UPDATE {table} SET published_at = now() WHERE id = ANY($1)").into();
    let options = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let mut stop = std::pin::pin!(stop);
    let (mut rounds, mut empty, mut published) = (0u64, 0u64, 0usize);
    loop {
        rounds += 1;
        let mut tx = pool.begin().await?;
        let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(select.clone()))
            .fetch_all(&mut *tx)
            .await?;
        let mut ids = Vec::with_capacity(rows.len());
        for (id, payload) in rows {
            let properties = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_delivery_mode(2);
            let confirm = channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    options,
                    &payload,
                    properties,
                )
                .await?
                .await?;
            if !matches!(confirm, Confirmation::Ack(None)) {
                return Err(format!("baseline: message {id} not confirmed: {confirm:?}").into());
            }
            ids.push(id);
        }
        if ids.is_empty() {
            empty += 1;
        } else {
            sqlx::query(AssertSqlSafe(mark.clone()))
                .bind(&ids)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        published += ids.len();
        if ids.len() >= BATCH {
            continue;
        }
        tokio::select! {
            biased;
            () = &mut stop => {
                return Ok(format!("{rounds} rounds ({empty} empty), {published} published"));
            }
            woken = tokio::time::timeout(POLL, listener.recv()) => {
                if let Ok(Err(err)) = woken {
                    return Err(format!("baseline: notifications lost: {err}").into());
                }
            }
        }
    }
}

impl Bench {
    /// Empties `side`'s table.
    async fn truncate(&self, side: Side) -> Result<(), BoxError> {
        let table = match side {
            Side::Baseline => &self.baseline_table,
            Side::Outbox => &self.outbox_table,
        };
        sqlx::query(AssertSqlSafe(format!("TRUNCATE {table}")))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Starts `side`'s relay on a channel of its own.
    async fn start_relay(&self, side: Side) -> Result<Running, BoxError> {
        let channel = self.amqp.create_channel().await?;
        let (stop, stopped) = oneshot::channel::<()>();
        let stopped = async {
            let _ = stopped.await;
        };
        let task = match side {
            Side::Baseline => tokio::spawn(baseline_relay(
                self.pool.clone(),
                channel.clone(),
                self.baseline_table.clone(),
                self.queue.clone(),
                stopped,
            )),
            Side::Outbox => {
                let publisher = outbox::rabbitmq::Publisher::new(channel.clone(), "").await?;
                let outbox = Outbox::with_table(self.pool.clone(), &self.outbox_table)?;
                let relay = Relay::new(outbox, publisher);
                tokio::spawn(async move {
                    let stats = relay.run(stopped).await?;
                    Ok(format!(
                        "{} claimed, {} published, {} failed, {} unmarked",
                        stats.claimed, stats.published, stats.failed, stats.unmarked
                    ))
                })
            }
        };
        Ok(Running {
            stop,
            task,
            channel,
        })
    }

    /// Rows of `side`'s table not marked published.
    async fn unpublished(&self, side: Side) -> Result<i64, BoxError> {
        Ok(match side {
            Side::Baseline => {
                let sql = format!(
                    "SELECT COUNT(*) FROM {} WHERE published_at IS NULL",
                    self.baseline_table
                );
                sqlx::query_scalar(AssertSqlSafe(sql))
                    .fetch_one(&self.pool)
                    .await?
            }
            Side::Outbox => {
                let outbox = Outbox::with_table(self.pool.clone(), &self.outbox_table)?;
                let counts = outbox.counts().await?;
                i64::try_from(counts.pending + counts.dead)?
            }
        })
    }

    /// One pass of `side`: its table emptied, its relay started, the rows enqueued, every
    /// one waited for at the consumer, the relay stopped.
    async fn pass(&mut self, side: Side, kind: Kind) -> Result<Outcome, BoxError> {
        self.truncate(side).await?;
        let Running {
            stop,
            task: mut relay,
            channel,
        } = self.start_relay(side).await?;
        tokio::time::sleep(SETTLE).await;
        let (rows, tasks, pace) = match kind {
            Kind::Throughput => (self.rows, PRODUCERS, None),
            Kind::Latency => (PACED_ROWS, 1, Some(PACE)),
        };
        let start = Instant::now();
        let producers = match side {
            Side::Baseline => {
                let insert: Arc<str> = format!(
                    "WITH queued AS (INSERT INTO {t} (id, payload) VALUES ($1, $2)) \
                     SELECT pg_notify($3, '')",
                    t = self.baseline_table
                )
                .into();
                let context = Arc::new((insert, self.baseline_table.clone()));
                spawn_producers(
                    &self.pool,
                    tasks,
                    rows,
                    pace,
                    start,
                    context,
                    |(insert, channel), tx| {
                        Box::pin(async move {
                            let id = MessageId::generate().to_string();
                            sqlx::query(AssertSqlSafe(insert.clone()))
                                .bind(&id)
                                .bind(PAYLOAD)
                                .bind(channel)
                                .execute(&mut **tx)
                                .await?;
                            Ok(id)
                        })
                    },
                )
            }
            Side::Outbox => {
                let outbox = Outbox::with_table(self.pool.clone(), &self.outbox_table)?;
                let message = Message::new(
                    "order",
                    "A-1001",
                    "order.created",
                    self.queue.as_str(),
                    PAYLOAD.to_vec(),
                );
                spawn_producers(
                    &self.pool,
                    tasks,
                    rows,
                    pace,
                    start,
                    Arc::new((outbox, message)),
                    |(outbox, message), tx| {
                        Box::pin(async move { Ok(outbox.enqueue(tx, message).await?.to_string()) })
                    },
                )
            }
        };
        let mut commits = HashMap::with_capacity(rows);
        for producer in producers {
            commits.extend(producer.await??);
        }
        let last_commit = commits.values().max().copied().unwrap_or(start);

        let mut tally = Tally::default();
        let deadline = tokio::time::Instant::now() + ARRIVAL_TIMEOUT;
        while tally.arrived.len() < commits.len() {
            tokio::select! {
                arrival = tokio::time::timeout_at(deadline, self.arrivals.recv()) => match arrival {
                    Ok(Some((id, at))) => tally.note(&commits, id, at),
                    Ok(None) => return Err("the queue's consumer stopped".into()),
                    Err(_) => {
                        let _ = stop.send(());
                        return Err(format!(
                            "{}: {} of {} rows never arrived within {ARRIVAL_TIMEOUT:?}: rows lost",
                            side.name(),
                            commits.len() - tally.arrived.len(),
                            commits.len()
                        )
                        .into());
                    }
                },
                finished = &mut relay => {
                    return Err(format!(
                        "the {} relay stopped during the pass: {:?}",
                        side.name(),
                        finished?
                    )
                    .into());
                }
            }
        }
        let _ = stop.send(());
        let summary = relay.await??;
        let _ = channel.close(200, "pass done".into()).await;
        while let Ok(Some((id, at))) = tokio::time::timeout(GRACE, self.arrivals.recv()).await {
            tally.note(&commits, id, at);
        }
        let unpublished = self.unpublished(side).await?;
        if unpublished != 0 {
            return Err(format!(
                "{}: every row arrived but {unpublished} are not marked published",
                side.name()
            )
            .into());
        }

        let last_arrival = tally.arrived.values().max().copied().unwrap_or(start);
        let mut latencies: Vec<f64> = commits
            .iter()
            .map(|(id, committed)| {
                tally.arrived[id]
                    .saturating_duration_since(*committed)
                    .as_secs_f64()
                    * 1e3
            })
            .collect();
        latencies.sort_by(f64::total_cmp);
        let elapsed = last_arrival - start;
        Ok(Outcome {
            rows: commits.len(),
            elapsed,
            rows_per_s: per_s(commits.len(), elapsed),
            enqueued_per_s: per_s(commits.len(), last_commit - start),
            p50_ms: percentile(&latencies, 0.50),
            p99_ms: percentile(&latencies, 0.99),
            max_ms: percentile(&latencies, 1.0),
            duplicates: tally.duplicates,
            strays: tally.strays,
            relay: summary,
        })
    }
}

/// The messages a pass received.
#[derive(Default)]
struct Tally {
    /// The first arrival of each of the pass's rows.
    arrived: HashMap<String, Instant>,
    duplicates: usize,
    strays: usize,
}

impl Tally {
    fn note(&mut self, commits: &HashMap<String, Instant>, id: String, at: Instant) {
        if !commits.contains_key(&id) {
            self.strays += 1;
            return;
        }
        match self.arrived.entry(id) {
            Entry::Vacant(entry) => {
                entry.insert(at);
            }
            Entry::Occupied(_) => self.duplicates += 1,
        }
    }
}

/// The queue's consumer: sends `(message_id, arrival)` of every delivery.
async fn consume(
    conn: lapin::Connection,
    queue: String,
    arrivals: mpsc::UnboundedSender<(String, Instant)>,
) -> Result<(), BoxError> {
    let channel = conn.create_channel().await?;
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "bench_outbox_consumer".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    while let Some(delivery) = consumer.next().await {
        let at = Instant::now();
        let delivery = delivery?;
        let id = match delivery.properties.message_id() {
            Some(id) => id.to_string(),
            None => return Err("a message without a message_id".into()),
        };
        if arrivals.send((id, at)).is_err() {
            break;
        }
    }
    Ok(())
}

/// The warm-up, the rounds and the figures.
async fn measure(bench: &mut Bench) -> Result<(), BoxError> {
    // `IDEMPOTENT_BENCH_ONLY=<side>`: a warm-up and a throughput pass of `rows` rows of that
    // side alone: what callgrind counts.
    if let Some((only, rows)) = instructions::only(INSTRUCTION_ROWS)? {
        let side = [Side::Baseline, Side::Outbox]
            .into_iter()
            .find(|side| side.name() == only)
            .ok_or_else(|| format!("no side {only}: baseline or outbox"))?;
        bench.rows = 200;
        bench.pass(side, Kind::Throughput).await?;
        bench.rows = rows;
        bench.pass(side, Kind::Throughput).await?;
        return Ok(());
    }
    for side in [Side::Baseline, Side::Outbox] {
        for kind in [Kind::Throughput, Kind::Latency] {
            let outcome = bench.pass(side, kind).await?;
            check(side, &outcome);
        }
    }
    let (mut rates, mut p50s, mut p99s) = ([vec![], vec![]], [vec![], vec![]], [vec![], vec![]]);
    let mut allocs = [vec![], vec![]];
    for round in 0..ROUNDS {
        let order = if round % 2 == 0 {
            [Side::Baseline, Side::Outbox]
        } else {
            [Side::Outbox, Side::Baseline]
        };
        for side in order {
            let allocated = allocations::so_far();
            let fast = bench.pass(side, Kind::Throughput).await?;
            allocs[side as usize].push((allocations::so_far() - allocated) as f64 / ROWS as f64);
            check(side, &fast);
            let paced = bench.pass(side, Kind::Latency).await?;
            check(side, &paced);
            println!(
                "round {round} {:>8}: {:>6.0} rows/s ({} rows in {:.3} s, enqueued at {:.0} rows/s, \
                 queued p50 {:.1} ms p99 {:.1} ms); paced {} rows: p50 {:.2} ms p99 {:.2} ms \
                 max {:.2} ms; duplicates {}; relay: {}; {}",
                side.name(),
                fast.rows_per_s,
                fast.rows,
                fast.elapsed.as_secs_f64(),
                fast.enqueued_per_s,
                fast.p50_ms,
                fast.p99_ms,
                paced.rows,
                paced.p50_ms,
                paced.p99_ms,
                paced.max_ms,
                fast.duplicates + paced.duplicates + fast.strays + paced.strays,
                fast.relay,
                paced.relay,
            );
            let at = side as usize;
            rates[at].push(fast.rows_per_s);
            p50s[at].push(paced.p50_ms);
            p99s[at].push(paced.p99_ms);
        }
    }
    let (baseline, outbox) = (Side::Baseline as usize, Side::Outbox as usize);
    figure("baseline_rows_per_s", median(&rates[baseline]), 0);
    figure("outbox_rows_per_s", median(&rates[outbox]), 0);
    figure(
        "outbox_ratio",
        median(&rates[outbox]) / median(&rates[baseline]),
        3,
    );
    figure("baseline_latency_p50_ms", median(&p50s[baseline]), 2);
    figure("baseline_latency_p99_ms", median(&p99s[baseline]), 2);
    figure("outbox_latency_p50_ms", median(&p50s[outbox]), 2);
    figure("outbox_latency_p99_ms", median(&p99s[outbox]), 2);
    figure("baseline_allocations", median(&allocs[baseline]), 1);
    figure("outbox_allocations", median(&allocs[outbox]), 1);
    if instructions::enabled() {
        let by_hand = instructions::per_cycle(Side::Baseline.name(), INSTRUCTION_ROWS)?;
        let ours = instructions::per_cycle(Side::Outbox.name(), INSTRUCTION_ROWS)?;
        figure("baseline_instructions", by_hand, 0);
        figure("outbox_instructions", ours, 0);
        figure("outbox_instructions_ratio", by_hand / ours, 3);
    }
    Ok(())
}

/// Prints a pass's duplicates; every row arrived, or `pass` failed already.
fn check(side: Side, outcome: &Outcome) {
    if outcome.duplicates + outcome.strays > 0 {
        println!(
            "{}: {} duplicate deliveries, {} late messages of an earlier pass",
            side.name(),
            outcome.duplicates,
            outcome.strays
        );
    }
}

async fn run(pg_url: &str, amqp_url: &str) -> Result<(), BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(POOL)
        .connect(pg_url)
        .await
        .map_err(|e| {
            format!(
                "PostgreSQL is not reachable at {pg_url}: {e}\n(start it with\n  \
                 pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start\n\
                 or set IDEMPOTENT_POSTGRES_URL)"
            )
        })?;
    let connect = || async {
        lapin::Connection::connect(amqp_url, ConnectionProperties::default())
            .await
            .map_err(|e| {
                format!(
                    "RabbitMQ is not reachable at {amqp_url}: {e}\n(start it with\n  \
                     rabbitmq-server -detached\nor set AMQP_URL)"
                )
            })
    };
    let (amqp, consumer_conn) = (connect().await?, connect().await?);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64;
    let name = format!(
        "bench_outbox_{:08x}",
        (nanos ^ u64::from(std::process::id())) as u32
    );
    let (outbox_table, baseline_table) = (name.clone(), format!("{name}_baseline"));

    let setup = amqp.create_channel().await?;
    setup
        .queue_declare(
            name.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let (send, arrivals) = mpsc::unbounded_channel();
    let consumer = tokio::spawn(consume(consumer_conn, name.clone(), send));
    let mut bench = Bench {
        pool: pool.clone(),
        amqp,
        queue: name.clone(),
        outbox_table,
        baseline_table,
        arrivals,
        rows: ROWS,
    };
    let measured = async {
        Outbox::with_table(pool.clone(), &bench.outbox_table)?
            .create_table()
            .await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {t} (id TEXT PRIMARY KEY, payload BYTEA NOT NULL, \
             created_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(), \
             published_at TIMESTAMPTZ); \
             CREATE INDEX {t}_unpublished ON {t} (created_at) WHERE published_at IS NULL",
            t = bench.baseline_table
        )))
        .execute(&pool)
        .await?;
        measure(&mut bench).await
    }
    .await;

    // Clean up whatever happened.
    let dropped = sqlx::query(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {}, {}",
        bench.outbox_table, bench.baseline_table
    )))
    .execute(&pool)
    .await;
    let deleted = setup
        .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
        .await;
    consumer.abort();
    measured?;
    dropped?;
    deleted?;
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    let pg_url = std::env::var("IDEMPOTENT_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string());
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_string());
    println!(
        "outbox bench: {ROWS} rows a throughput pass from {PRODUCERS} producers, {PACED_ROWS} \
         rows one every {PACE:?} a latency pass, {ROUNDS} rounds"
    );
    match run(&pg_url, &amqp_url).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}
