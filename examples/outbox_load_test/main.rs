//! The transactional outbox end to end, on real servers, with processes killed and
//! connections cut: an order service writes 1,000 orders, each with its `order.created`
//! message in the same PostgreSQL transaction (`Outbox::enqueue`); 2 relay processes
//! (`Relay::run`) publish the outbox to RabbitMQ (a durable quorum queue, publisher
//! confirms) or NATS JetStream (a stream); 3 consumer processes apply each message's effect
//! with `#[idempotent(prefix = ..., keys = [message_id], ...)]`, keyed on the outbox id that
//! travels as the message id (AMQP `message_id`, `Nats-Msg-Id`), and the effects are counted
//! in PostgreSQL.
//!
//! Delivery is at least once at every hop, so the run makes duplicates happen and shows that
//! none of them becomes a second effect:
//! - a relay is SIGKILLed between the broker's confirmation and the relay's mark, twice: its
//!   publisher, asked to (a `hold` line on its stdin), stops right after a confirmation, and
//!   the parent kills it there. The rows it had claimed are published by the other relays
//!   once its 2 s claim runs out, the held one a second time;
//! - RabbitMQ closes a relay's connection and a consumer's connection from its side
//!   (`rabbitmqctl close_connection`) while orders are still coming in: the relay's
//!   publication in flight, if any, fails and is retried later, the consumer's
//!   unacknowledged deliveries are redelivered to the other consumers, and each process
//!   exits and is started again (as a supervisor would). Not done on NATS;
//! - a consumer with handlers in flight (each 20 ms of work) is SIGKILLed, twice, and started
//!   again: its messages are redelivered, their claims taken over when the 2 s lease runs
//!   out, or answered by the handler's `done` check (is there an effect row already?).
//!
//! The `effects` table has no unique constraint on the message id: an effect applied twice
//! would be two rows. The last line is `orders=1000 published=<n> effects=1000
//! duplicates_delivered=<n> duplicate_effects=0 lost=0 dead_lettered=0`: `published` counts
//! the publications the broker confirmed (reported by the relays, the killed ones
//! included); `duplicates_delivered` the deliveries the consumers filtered as duplicates;
//! `effects` the message ids with an effect row; `duplicate_effects` those with more than
//! one; `lost` the orders whose message produced no effect; `dead_lettered` the outbox rows
//! that went `dead`. The exit status is non-zero unless duplicate_effects, lost and
//! dead_lettered are 0. On NATS the stream's duplicate window drops a second publication of
//! a `Nats-Msg-Id` itself, so only the consumers' own redeliveries reach them twice.
//!
//! Everything of the run is named after it and removed at the end: the PostgreSQL schema
//! `outbox_load_<run>` (tables `orders`, `effects`, `outbox`, and `idempotency`, the
//! idempotency store's records: the PostgreSQL store, on the consumers' business pool),
//! and the queue and its dead-letter queue, or the stream and its consumer. A run takes
//! about 10 s.
//!
//! Needs: PostgreSQL at `IDEMPOTENT_BUSINESS_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); RabbitMQ on 127.0.0.1:5672 (`AMQP_URL`), and
//! `rabbitmqctl` on this machine for the connection cuts (skipped, and said so, without
//! it); or, with `--broker nats`, NATS with JetStream on 127.0.0.1:4222 (`NATS_URL`). No
//! Redis. `RUST_LOG` shows more of the library's logs (errors only by default).
//!
//! ```text
//! cargo run --release --example outbox_load_test
//! cargo run --release --example outbox_load_test -- --broker nats
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod broker;
mod business;
mod consumer;
mod relay;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use broker::Admin;
use business::Business;
use idempotency::outbox::Outbox;
use idempotency::sql::PostgresStore;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

const ORDERS: u32 = 1_000;
/// The order service writes an order (and its message) this often.
const ORDER_EVERY: Duration = Duration::from_millis(8);
const RELAYS: usize = 2;
const CONSUMERS: usize = 3;
/// Handlers at once in each consumer process.
pub(crate) const CONCURRENCY: usize = 8;
/// Each handler's work before it writes its effect.
pub(crate) const WORK: Duration = Duration::from_millis(20);
/// How long a relay's claim on its rows holds: a killed relay's rows wait this long.
pub(crate) const RELAY_LEASE: Duration = Duration::from_secs(2);
pub(crate) const RELAY_BATCH: u32 = 20;
pub(crate) const RELAY_POLL: Duration = Duration::from_millis(250);
/// The wait before a message whose key another owner holds is delivered again.
pub(crate) const IN_PROGRESS_DELAY: Duration = Duration::from_millis(250);
/// NATS redelivers a message not acknowledged within this (a killed consumer's).
pub(crate) const NATS_ACK_WAIT: Duration = Duration::from_secs(3);
/// A child's exit status when its broker connection was closed under it.
pub(crate) const EXIT_CONNECTION_LOST: i32 = 3;
/// Confirmed publications after which a relay is killed between a confirmation and its mark.
const RELAY_KILL_AT: [u64; 2] = [200, 550];
/// Confirmed publications after which a relay's RabbitMQ connection is cut.
const RELAY_CUT_AT: u64 = 300;
/// Effects after which a consumer is killed with handlers in flight.
const CONSUMER_KILL_AT: [i64; 2] = [120, 650];
/// Effects after which a consumer's RabbitMQ connection is cut.
const CONSUMER_CUT_AT: i64 = 350;
const DEADLINE: Duration = Duration::from_secs(120);

/// Where the relays publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Broker {
    RabbitMq,
    Nats,
}

impl Broker {
    fn name(self) -> &'static str {
        match self {
            Broker::RabbitMq => "RabbitMQ",
            Broker::Nats => "NATS JetStream",
        }
    }
}

/// Everything a relay or consumer process needs; passed to them in the environment.
pub(crate) struct Setup {
    pub(crate) broker: Broker,
    pub(crate) run_id: String,
    pub(crate) amqp_url: String,
    pub(crate) nats_url: String,
    pub(crate) business_url: String,
    pub(crate) schema: String,
    /// The queue (RabbitMQ) or subject (NATS) the messages go to.
    pub(crate) destination: String,
    /// The NATS stream and its durable consumer.
    pub(crate) stream: String,
    pub(crate) durable: String,
}

impl Setup {
    fn to_env(&self, cmd: &mut Command) {
        cmd.env(
            "OUTBOX_LOAD_BROKER",
            match self.broker {
                Broker::RabbitMq => "rabbitmq",
                Broker::Nats => "nats",
            },
        )
        .env("OUTBOX_LOAD_RUN", &self.run_id)
        .env("OUTBOX_LOAD_AMQP_URL", &self.amqp_url)
        .env("OUTBOX_LOAD_NATS_URL", &self.nats_url)
        .env("OUTBOX_LOAD_BUSINESS_URL", &self.business_url)
        .env("OUTBOX_LOAD_SCHEMA", &self.schema)
        .env("OUTBOX_LOAD_DESTINATION", &self.destination)
        .env("OUTBOX_LOAD_STREAM", &self.stream)
        .env("OUTBOX_LOAD_DURABLE", &self.durable);
    }

    fn from_env() -> Result<Setup, std::env::VarError> {
        let var = std::env::var;
        Ok(Setup {
            broker: if var("OUTBOX_LOAD_BROKER")? == "nats" {
                Broker::Nats
            } else {
                Broker::RabbitMq
            },
            run_id: var("OUTBOX_LOAD_RUN")?,
            amqp_url: var("OUTBOX_LOAD_AMQP_URL")?,
            nats_url: var("OUTBOX_LOAD_NATS_URL")?,
            business_url: var("OUTBOX_LOAD_BUSINESS_URL")?,
            schema: var("OUTBOX_LOAD_SCHEMA")?,
            destination: var("OUTBOX_LOAD_DESTINATION")?,
            stream: var("OUTBOX_LOAD_STREAM")?,
            durable: var("OUTBOX_LOAD_DURABLE")?,
        })
    }

    pub(crate) fn outbox_table(&self) -> String {
        format!("{}.outbox", self.schema)
    }

    pub(crate) fn store_table(&self) -> String {
        format!("{}.idempotency", self.schema)
    }

    /// The name this process gives its RabbitMQ connection (shown by `rabbitmqctl`).
    pub(crate) fn connection_name(&self, role: &str) -> String {
        self.connection_name_of(role, std::process::id())
    }

    fn connection_name_of(&self, role: &str, pid: u32) -> String {
        format!("outbox-load-{}-{role}-{pid}", self.run_id)
    }
}

/// A child's report line on stdout (the parent reads them, even from a killed child).
pub(crate) fn report(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// What the children reported.
#[derive(Default)]
struct Reports {
    /// Publications started, confirmed by the broker, failed.
    sent: u64,
    confirmed: u64,
    failed: u64,
    /// Confirmed publications per message id.
    publications: HashMap<String, u32>,
    /// (relay pid, message id) of each relay holding after a confirmation.
    held: Vec<(u32, String)>,
    /// The relay that started a publication last.
    last_sender: u32,
    /// Handler bodies started.
    starts: u64,
    /// Handler outcomes by kind.
    outcomes: BTreeMap<String, u64>,
    /// Each message id's latest outcome.
    last_outcome: HashMap<String, String>,
    /// Bodies started and not returned, per consumer pid.
    in_flight: HashMap<u32, HashSet<String>>,
    /// Times the `done` check found the effect applied.
    done: u64,
}

impl Reports {
    fn read(&mut self, pid: u32, line: &str) {
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        match word {
            "sending" => {
                self.sent += 1;
                self.last_sender = pid;
            }
            "confirmed" => {
                self.confirmed += 1;
                *self.publications.entry(rest.to_owned()).or_default() += 1;
            }
            "failed" => self.failed += 1,
            "held" => self.held.push((pid, rest.to_owned())),
            "start" => {
                self.starts += 1;
                self.in_flight
                    .entry(pid)
                    .or_default()
                    .insert(rest.to_owned());
            }
            "done" => self.done += 1,
            "outcome" => {
                let (kind, id) = rest.split_once(' ').unwrap_or((rest, ""));
                *self.outcomes.entry(kind.to_owned()).or_default() += 1;
                self.last_outcome.insert(id.to_owned(), kind.to_owned());
                if let Some(running) = self.in_flight.get_mut(&pid) {
                    running.remove(id);
                }
            }
            _ => {}
        }
    }

    fn outcome(&self, kind: &str) -> u64 {
        self.outcomes.get(kind).copied().unwrap_or(0)
    }

    /// Message ids whose latest outcome sends them back to the broker.
    fn awaiting_redelivery(&self) -> usize {
        self.last_outcome
            .values()
            .filter(|kind| !matches!(kind.as_str(), "applied" | "duplicate" | "malformed"))
            .count()
    }

    fn handlers_in_flight(&self) -> usize {
        self.in_flight.values().map(HashSet::len).sum()
    }
}

/// A relay or consumer process.
struct Proc {
    role: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Proc {
    fn spawn(
        role: &'static str,
        setup: &Setup,
        reports: &Arc<Mutex<Reports>>,
    ) -> std::io::Result<Proc> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg(format!("--{role}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        setup.to_env(&mut cmd);
        let mut child = cmd.spawn()?;
        let pid = child.id();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let reports = reports.clone();
        let reader = std::thread::spawn(move || {
            let Some(stdout) = stdout else { return };
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                reports.lock().unwrap().read(pid, &line);
            }
        });
        Ok(Proc {
            role,
            child,
            stdin,
            reader: Some(reader),
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a line to the child's stdin.
    fn send(&mut self, line: &str) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "{line}");
            let _ = stdin.flush();
        }
    }

    /// The exit status, if the process exited.
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGKILL, and wait until the process is gone and its last lines are read.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }

    /// Closes stdin (the child finishes what it has in flight and exits); waits up to
    /// `within`, then kills it. Whether it exited cleanly.
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

/// A connection cut (`rabbitmqctl` takes a second or two, so it runs on the side).
enum Cut {
    NotYet,
    Running {
        pid: u32,
        task: tokio::task::JoinHandle<Result<(), String>>,
    },
    Done(bool),
}

impl Cut {
    fn start(setup: &Setup, role: &str, pid: u32) -> Cut {
        let name = setup.connection_name_of(role, pid);
        Cut::Running {
            pid,
            task: tokio::task::spawn_blocking(move || broker::cut_connection(&name)),
        }
    }

    /// Reports a cut that finished.
    async fn poll(&mut self, role: &str, started: Instant) {
        if let Cut::Running { pid, task } = self {
            if task.is_finished() {
                let pid = *pid;
                let result = task.await.unwrap_or_else(|e| Err(e.to_string()));
                match &result {
                    Ok(()) => println!(
                        "[{}] RabbitMQ closed the connection of {role} pid {pid} (rabbitmqctl close_connection)",
                        at(started)
                    ),
                    Err(err) => println!(
                        "[{}] connection cut of {role} pid {pid} not done: {err}",
                        at(started)
                    ),
                }
                *self = Cut::Done(result.is_ok());
            }
        }
    }

    fn running(&self) -> bool {
        matches!(self, Cut::Running { .. })
    }

    /// The process whose connection is being cut.
    fn target(&self) -> Option<u32> {
        match self {
            Cut::Running { pid, .. } => Some(*pid),
            _ => None,
        }
    }
}

fn at(started: Instant) -> String {
    format!("{:>5.2} s", started.elapsed().as_secs_f64())
}

#[tokio::main]
async fn main() {
    // The library's errors on stderr (`RUST_LOG` for more); lapin's own are left out, the
    // closed connections they would tell of are reported by the parent.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error,lapin=off"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    for (role, flag) in [("relay", "--relay"), ("consumer", "--consumer")] {
        if args.iter().any(|a| a == flag) {
            let status = match Setup::from_env() {
                Ok(setup) if role == "relay" => relay::run(&setup).await,
                Ok(setup) => consumer::run(&setup).await,
                Err(err) => Err(err.into()),
            };
            match status {
                Ok(status) => std::process::exit(status),
                Err(err) => {
                    eprintln!("{role} {}: {err}", std::process::id());
                    std::process::exit(1);
                }
            }
        }
    }
    let broker = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] | ["--broker", "rabbitmq"] => Broker::RabbitMq,
        ["--broker", "nats"] => Broker::Nats,
        ["--help"] | ["-h"] => {
            println!("usage: outbox_load_test [--broker rabbitmq|nats]  (see the header of examples/outbox_load_test/main.rs)");
            return;
        }
        _ => {
            eprintln!(
                "unexpected arguments {args:?}; usage: outbox_load_test [--broker rabbitmq|nats]"
            );
            std::process::exit(2);
        }
    };
    match run(broker).await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(err) => {
            eprintln!("outbox load test failed: {err}");
            let mut source = std::error::Error::source(&*err);
            while let Some(cause) = source {
                eprintln!("  caused by: {cause}");
                source = cause.source();
            }
            std::process::exit(1);
        }
    }
}

async fn run(broker: Broker) -> Result<bool, BoxError> {
    let run_id = format!(
        "{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
            % 1_000_000
    );
    let setup = Setup {
        broker,
        amqp_url: std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
        nats_url: std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into()),
        business_url: std::env::var("IDEMPOTENT_BUSINESS_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
        schema: format!("outbox_load_{run_id}"),
        destination: format!("outbox-load.{run_id}.order-created"),
        stream: format!("OUTBOX_LOAD_{run_id}"),
        durable: "effects".into(),
        run_id,
    };
    println!(
        "outbox load test: {ORDERS} orders, each with its order.created message in one transaction; {RELAYS} relays ({} s claims) to {}; {CONSUMERS} consumers x {CONCURRENCY} handlers, {} ms of work each",
        RELAY_LEASE.as_secs(),
        broker.name(),
        WORK.as_millis(),
    );
    println!(
        "business: {} (schema {}: orders, effects, outbox, idempotency)",
        redact(&setup.business_url),
        setup.schema
    );
    match broker {
        Broker::RabbitMq => println!(
            "broker:   {} (quorum queue {})",
            redact(&setup.amqp_url),
            setup.destination
        ),
        Broker::Nats => println!(
            "broker:   nats://{} (stream {}, subject {}, consumer {})",
            setup.nats_url, setup.stream, setup.destination, setup.durable
        ),
    }

    let business = Business::create(&setup.business_url, &setup.schema)
        .await
        .map_err(|e| {
            format!(
                "PostgreSQL at {} is not usable ({e}); is it running? Start it with `service postgresql start`, or set IDEMPOTENT_BUSINESS_URL",
                redact(&setup.business_url)
            )
        });
    let outcome = match business {
        Ok(business) => {
            let outcome = match Admin::create(&setup).await {
                Ok(admin) => {
                    let outcome = exercise(&setup, &business, &admin).await;
                    admin.delete().await;
                    outcome
                }
                Err(err) => Err(err),
            };
            business.close().await;
            outcome
        }
        Err(err) => Err(err.into()),
    };
    // Clean up whatever happened.
    let _ = Business::drop_schema(&setup.business_url, &setup.schema).await;
    outcome
}

/// Starts the processes, creates the orders, injects the faults, and reports.
async fn exercise(setup: &Setup, business: &Business, admin: &Admin) -> Result<bool, BoxError> {
    let outbox = Outbox::with_table(business.pool().clone(), &setup.outbox_table())?;
    outbox.create_table().await?;
    // The idempotency store's table (the consumers use it as it is).
    PostgresStore::from_pool(business.pool().clone())
        .table(setup.store_table())
        .build()
        .await?;

    let started = Instant::now();
    let reports = Arc::new(Mutex::new(Reports::default()));
    let mut relays = Vec::new();
    for _ in 0..RELAYS {
        relays.push(Proc::spawn("relay", setup, &reports)?);
    }
    let mut consumers = Vec::new();
    for _ in 0..CONSUMERS {
        consumers.push(Proc::spawn("consumer", setup, &reports)?);
    }

    // The order service: an order row and its message per transaction.
    let created = Arc::new(AtomicU32::new(0));
    let mut service = {
        let (business, outbox, created) = (business.clone(), outbox.clone(), created.clone());
        let destination = setup.destination.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(ORDER_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for n in 1..=ORDERS {
                tick.tick().await;
                business.create_order(&outbox, n, &destination).await?;
                created.store(n, Ordering::Relaxed);
            }
            Ok::<Duration, BoxError>(started.elapsed())
        })
    };
    let mut created_in = None;

    let rabbitmq = setup.broker == Broker::RabbitMq;
    let mut relay_kills = RELAY_KILL_AT.iter().peekable();
    let mut relays_killed = 0;
    // The relay asked to hold after its next confirmation.
    let mut holding: Option<u32> = None;
    let mut consumer_kills = CONSUMER_KILL_AT.iter().peekable();
    let mut consumers_killed = 0;
    let mut relay_cut = Cut::NotYet;
    let mut consumer_cut = Cut::NotYet;
    if rabbitmq && which("rabbitmqctl").is_none() {
        println!("connection cuts: skipped (no `rabbitmqctl` on this machine's PATH)");
        relay_cut = Cut::Done(false);
        consumer_cut = Cut::Done(false);
    }
    let deadline = started + DEADLINE;
    let mut effects_at = None;
    let mut passes = 0;
    let mut timed_out = false;

    loop {
        // Run until every order has its effect, the outbox is published, and the broker has
        // nothing left to deliver.
        loop {
            if created_in.is_none() && service.is_finished() {
                created_in = Some((&mut service).await??);
            }
            let effects = business.effects().await?;
            if effects >= i64::from(ORDERS) && effects_at.is_none() {
                effects_at = Some(started.elapsed());
            }
            // A process whose connection is being cut is not killed meanwhile, and the
            // relay holding for its kill is not cut.
            let cutting = [&relay_cut, &consumer_cut].map(Cut::target);
            let (confirmed, last_sender, held, busiest) = {
                let r = reports.lock().unwrap();
                // The consumer with the most handlers in flight.
                let busiest = consumers
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| !cutting.contains(&Some(c.pid())))
                    .map(|(i, c)| (i, r.in_flight.get(&c.pid()).map_or(0, HashSet::len)))
                    .max_by_key(|&(_, n)| n)
                    .filter(|&(_, n)| n > 0)
                    .map(|(i, _)| i);
                let held = holding.and_then(|pid| {
                    r.held
                        .iter()
                        .find(|(p, _)| *p == pid)
                        .map(|(_, id)| id.clone())
                });
                (r.confirmed, r.last_sender, held, busiest)
            };

            // A relay killed between the broker's confirmation and its mark.
            if holding.is_none() && relay_kills.peek().is_some_and(|at| confirmed >= **at) {
                // The relay that published last, unless its connection is being cut.
                let pids: Vec<u32> = relays.iter().map(Proc::pid).collect();
                let target = pick(&pids, last_sender, |pid| !cutting.contains(&Some(pid)));
                if let Some(slot) = target.and_then(|pid| pids.iter().position(|&p| p == pid)) {
                    relays[slot].send("hold");
                    holding = Some(pids[slot]);
                }
            }
            if let Some(pid) = holding {
                match relays.iter().position(|r| r.pid() == pid) {
                    // Gone meanwhile (its connection was cut): ask another.
                    None => holding = None,
                    Some(slot) => {
                        if let Some(id) = held {
                            relays[slot].kill();
                            relays[slot] = Proc::spawn("relay", setup, &reports)?;
                            relay_kills.next();
                            relays_killed += 1;
                            holding = None;
                            println!(
                                "[{}] relay pid {pid} killed (SIGKILL) after {} confirmed message {id} and before the relay marked it published ({confirmed} confirmed so far); restarted as pid {}",
                                at(started),
                                setup.broker.name(),
                                relays[slot].pid()
                            );
                        }
                    }
                }
            }

            // A relay's connection cut while it publishes.
            if rabbitmq && matches!(relay_cut, Cut::NotYet) && confirmed >= RELAY_CUT_AT {
                let pids: Vec<u32> = relays.iter().map(Proc::pid).collect();
                if let Some(pid) = pick(&pids, last_sender, |pid| Some(pid) != holding) {
                    relay_cut = Cut::start(setup, "relay", pid);
                }
            }
            relay_cut.poll("relay", started).await;

            // A consumer killed with handlers in flight.
            if let Some(slot) =
                busiest.filter(|_| consumer_kills.peek().is_some_and(|at| effects >= **at))
            {
                let pid = consumers[slot].pid();
                consumers[slot].kill();
                let interrupted: Vec<String> = reports
                    .lock()
                    .unwrap()
                    .in_flight
                    .remove(&pid)
                    .unwrap_or_default()
                    .into_iter()
                    .collect();
                consumers[slot] = Proc::spawn("consumer", setup, &reports)?;
                consumer_kills.next();
                consumers_killed += 1;
                println!(
                    "[{}] consumer pid {pid} killed (SIGKILL) at {effects} effects with {} handlers mid-way ({}); restarted as pid {}",
                    at(started),
                    interrupted.len(),
                    interrupted.join(", "),
                    consumers[slot].pid()
                );
            }

            // A consumer's connection cut while it works.
            if rabbitmq && matches!(consumer_cut, Cut::NotYet) && effects >= CONSUMER_CUT_AT {
                if let Some(slot) = busiest {
                    consumer_cut = Cut::start(setup, "consumer", consumers[slot].pid());
                }
            }
            consumer_cut.poll("consumer", started).await;

            // A supervisor's job: a process that exited by itself is started again.
            for list in [&mut relays, &mut consumers] {
                for proc in list.iter_mut() {
                    if let Some(status) = proc.exited() {
                        let (role, pid) = (proc.role, proc.pid());
                        proc.kill();
                        reports.lock().unwrap().in_flight.remove(&pid);
                        *proc = Proc::spawn(role, setup, &reports)?;
                        let why = if status.code() == Some(EXIT_CONNECTION_LOST) {
                            "its broker connection was closed".to_owned()
                        } else {
                            status.to_string()
                        };
                        println!(
                            "[{}] {role} pid {pid} exited ({why}); restarted as pid {}",
                            at(started),
                            proc.pid()
                        );
                    }
                }
            }

            if Instant::now() > deadline {
                timed_out = true;
                break;
            }
            // (A relay holding a confirmed message leaves its row pending.)
            let settled = created_in.is_some()
                && effects >= i64::from(ORDERS)
                && !relay_cut.running()
                && !consumer_cut.running();
            if settled && outbox.counts().await?.pending == 0 && admin.outstanding().await? == 0 {
                let r = reports.lock().unwrap();
                if r.handlers_in_flight() == 0 && r.awaiting_redelivery() == 0 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // Stop the consumers: handlers in flight finish and their messages are settled;
        // deliveries they had not started go back to the broker.
        for proc in consumers.drain(..) {
            let pid = proc.pid();
            if !proc.stop(Duration::from_secs(30)).await {
                println!("consumer pid {pid} did not stop cleanly");
            }
        }
        passes += 1;
        let left = admin.outstanding().await?;
        if left == 0 || timed_out || passes >= 5 {
            break;
        }
        println!(
            "[{}] {left} messages were back with the broker when the consumers stopped (unacknowledged until then); consuming them",
            at(started)
        );
        for _ in 0..CONSUMERS {
            consumers.push(Proc::spawn("consumer", setup, &reports)?);
        }
    }
    for proc in relays.drain(..) {
        let pid = proc.pid();
        if !proc.stop(Duration::from_secs(30)).await {
            println!("relay pid {pid} did not stop cleanly");
        }
    }
    let drained_in = started.elapsed();
    if !service.is_finished() {
        service.abort();
    }

    let tally = business.tally().await?;
    let counts = outbox.counts().await?;
    let left = admin.outstanding().await?;
    let consumer_dead = admin.dead_lettered().await?;
    let stored = admin.stored().await?;
    let r = reports.lock().unwrap();
    let republished: Vec<&String> = r
        .publications
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| id)
        .collect();
    let duplicates_delivered = r.outcome("duplicate");

    if timed_out {
        println!("stopped after {} s without finishing", DEADLINE.as_secs());
    }
    println!(
        "orders: {} created in {:.1} s (an order row and its message per transaction); every effect applied at {}; drained at {:.1} s",
        created.load(Ordering::Relaxed),
        created_in.map_or(f64::NAN, |d| d.as_secs_f64()),
        effects_at.map_or("never".to_owned(), |d| format!("{:.1} s", d.as_secs_f64())),
        drained_in.as_secs_f64()
    );
    println!(
        "relays: {} publications sent, {} confirmed by {}, {} failed (retried later); {} messages confirmed more than once{}",
        r.sent,
        r.confirmed,
        setup.broker.name(),
        r.failed,
        republished.len(),
        if republished.len() <= 8 && !republished.is_empty() {
            format!(
                " ({})",
                republished
                    .iter()
                    .map(|id| id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        } else {
            String::new()
        }
    );
    println!(
        "outbox: {} published, {} pending, {} dead",
        counts.published, counts.pending, counts.dead
    );
    match (stored, consumer_dead) {
        (Some(stored), _) => println!(
            "broker: the stream stored {stored} messages ({} publications dropped by its duplicate window); {left} outstanding",
            r.confirmed.saturating_sub(stored)
        ),
        (None, Some(dead)) => println!(
            "broker: {left} messages left in the queue, {dead} dead-lettered by the consumers"
        ),
        (None, None) => {}
    }
    println!(
        "consumers: {} handler bodies started, {} effects applied, {} deliveries filtered as duplicates ({} by the `done` check), {} in progress elsewhere (redelivered), {} store errors, {} lost ownership, {} failed, {} malformed",
        r.starts,
        r.outcome("applied"),
        duplicates_delivered,
        r.done,
        r.outcome("in-progress"),
        r.outcome("store-error"),
        r.outcome("lost-ownership"),
        r.outcome("failed"),
        r.outcome("malformed"),
    );
    println!(
        "effects: {} rows for {} message ids",
        tally.effect_rows, tally.effects
    );
    let cut = |cut: &Cut| match cut {
        Cut::Done(true) => 1,
        _ => 0,
    };
    println!(
        "faults: relays killed between confirm and mark {relays_killed}/{}, consumers killed mid-handler {consumers_killed}/{}, {}",
        RELAY_KILL_AT.len(),
        CONSUMER_KILL_AT.len(),
        if rabbitmq {
            format!("connections cut {}/2", cut(&relay_cut) + cut(&consumer_cut))
        } else {
            "no connection cut (RabbitMQ only)".to_owned()
        },
    );
    println!(
        "orders={} published={} effects={} duplicates_delivered={} duplicate_effects={} lost={} dead_lettered={}",
        tally.orders,
        r.confirmed,
        tally.effects,
        duplicates_delivered,
        tally.duplicate_effects,
        tally.lost,
        counts.dead
    );
    Ok(tally.orders == i64::from(ORDERS)
        && tally.duplicate_effects == 0
        && tally.lost == 0
        && counts.dead == 0)
}

/// `preferred` if it is among `pids` and `allowed`, else the first allowed one.
fn pick(pids: &[u32], preferred: u32, allowed: impl Fn(u32) -> bool) -> Option<u32> {
    pids.iter()
        .copied()
        .find(|&pid| pid == preferred && allowed(pid))
        .or_else(|| pids.iter().copied().find(|&pid| allowed(pid)))
}

/// The path of `program` on the PATH, if any.
fn which(program: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|path| path.is_file())
    })
}

/// The URL without its password.
pub(crate) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(start), Some(at)) if at > start => {
            let userinfo = &url[start + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{user}:***{}", &url[..start + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}
