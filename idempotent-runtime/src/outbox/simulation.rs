//! The relay's rounds under faults, in a deterministic simulation: a seeded scheduler runs
//! several relays' rounds ([`Settings::round`], the code `Relay::run_once` runs) at once over
//! one table of rows in memory, on Tokio's paused clock, and decides everything a deployment
//! leaves to chance:
//!
//! - at every statement: answered, refused before being applied, applied with its answer lost,
//!   or applied and never answered (the relay abandons it at the lease), each after a delay;
//! - at every publication: confirmed, refused (the row's fault), the broker unreachable, never
//!   confirmed, or confirmed after the claim ran out (the relay gives up at its deadline);
//! - a relay that dies: its round dropped at any point;
//! - between rounds: how long a relay waits.
//!
//! The rows in memory follow the outbox's statements (`claim`, `failed`, `release`,
//! `published`), which `tests/outbox.rs` and `tests/outbox_faults.rs` check on the real
//! databases: what a real database cannot do is run a hundred thousand of these schedules, so
//! the table here stands in for it. After every schedule it checks:
//!
//! 1. every publication, from its start to its end (confirmed, failed or abandoned), is made
//!    while the publishing relay's claim on the row is live: no two relays ever publish a row
//!    at the same time;
//! 2. a row is marked published only by a relay that the broker confirmed it to, under the
//!    token of that claim; a failed attempt is recorded only for a publication that was not
//!    confirmed (refused, or abandoned at the deadline) or a row that cannot be read;
//! 3. every round ends (a round the scheduler does not drop), however the database and the
//!    broker answer;
//! 4. once the faults stop and a last relay runs, every row ends published (confirmed at least
//!    once) or dead (after a failure of its own), and none is held.
//!
//! `RELAY_SIM_SCHEDULES` sets how many schedules run (default 3,000), `RELAY_SIM_SEED` replays
//! one with a trace of every step. A violation prints its seed.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{StoreError, StoreErrorKind};
use crate::outbox::dialect::ReadRow;
use crate::outbox::publish::{PublishError, Publisher};
use crate::outbox::round::{RowSource, Settings};
use crate::outbox::{MessageId, OutboxMessage};
use crate::store::{BoxFuture, Token};

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A duration in `0..max`, in whole milliseconds.
    fn millis(&mut self, max: Duration) -> Duration {
        Duration::from_millis(self.below(max.as_millis() as u64 + 1))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Pending,
    Published,
    Dead,
}

struct Row {
    id: String,
    state: State,
    attempts: u32,
    next_at: Instant,
    token: Option<Token>,
    claimed_until: Option<Instant>,
    /// Written by another producer: the relay cannot read it.
    unreadable: bool,
}

/// How a statement or a publication goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Answered,
    Refused,
    AnswerLost,
    NeverAnswered,
    /// A publication only: the broker is unreachable.
    Unreachable,
    /// A publication only: confirmed, after the claim ran out.
    Late,
}

struct World {
    rows: Vec<Row>,
    rng: Rng,
    /// Whose claim each token is.
    owner: BTreeMap<Token16, usize>,
    /// Publications the broker confirmed: (token, row).
    confirmed: BTreeSet<(Token16, String)>,
    /// Publications that ended without a confirmation: (token, row).
    unconfirmed: BTreeSet<(Token16, String)>,
    faults: bool,
    lease: Duration,
    violations: Vec<String>,
    trace: Option<Vec<String>>,
}

type Token16 = [u8; 16];

impl World {
    fn note(&mut self, what: impl FnOnce() -> String) {
        if let Some(trace) = self.trace.as_mut() {
            trace.push(format!("{:?} {}", Instant::now(), what()));
        }
    }

    fn fate(&mut self, publication: bool) -> Fate {
        if !self.faults {
            return Fate::Answered;
        }
        let fates: &[Fate] = if publication {
            &[
                Fate::Answered,
                Fate::Answered,
                Fate::Answered,
                Fate::Refused,
                Fate::Unreachable,
                Fate::NeverAnswered,
                Fate::Late,
            ]
        } else {
            &[
                Fate::Answered,
                Fate::Answered,
                Fate::Answered,
                Fate::Refused,
                Fate::AnswerLost,
                Fate::NeverAnswered,
            ]
        };
        fates[self.rng.below(fates.len() as u64) as usize]
    }

    fn delay(&mut self) -> Duration {
        if !self.faults {
            return Duration::ZERO;
        }
        let most = self.lease / 4;
        self.rng.millis(most)
    }

    /// The row `id` is held by a live claim of `relay`'s: checked as a publication starts and
    /// as it ends.
    fn check_held(&mut self, relay: usize, id: &str, when: &str) {
        let now = Instant::now();
        let Some(row) = self.rows.iter().find(|r| r.id == id) else {
            self.violations
                .push(format!("relay {relay} published unknown row {id}"));
            return;
        };
        let holder = row.token.map(|t| self.owner.get(t.as_bytes()).copied());
        let live = row.claimed_until.is_some_and(|until| until > now);
        if holder != Some(Some(relay)) || !live {
            let violation = format!(
                "relay {relay} {when} publishing row {id} without a live claim of its own \
                 (holder {holder:?}, claimed until {:?}, now {now:?})",
                row.claimed_until
            );
            self.violations.push(violation);
        }
    }
}

fn lock(world: &Mutex<World>) -> MutexGuard<'_, World> {
    world
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A statement against the rows: its fate decided, applied (or not) by `apply`, answered (or
/// not) after delays.
async fn statement<T: Send>(
    world: &Mutex<World>,
    what: &'static str,
    apply: impl FnOnce(&mut World) -> T,
) -> Result<T, StoreError> {
    let (fate, before, after) = {
        let mut w = lock(world);
        let fate = w.fate(false);
        (fate, w.delay(), w.delay())
    };
    tokio::time::sleep(before).await;
    if fate == Fate::Refused {
        lock(world).note(|| format!("{what} refused"));
        return Err(StoreError::new(StoreErrorKind::Unavailable, "refused"));
    }
    let answer = {
        let mut w = lock(world);
        let answer = apply(&mut w);
        w.note(|| format!("{what} applied ({fate:?})"));
        answer
    };
    match fate {
        Fate::AnswerLost => Err(StoreError::new(StoreErrorKind::OutcomeUnknown, "lost")),
        Fate::NeverAnswered => std::future::pending().await,
        _ => {
            tokio::time::sleep(after).await;
            Ok(answer)
        }
    }
}

/// One relay's view of the table.
struct Source {
    world: Arc<Mutex<World>>,
    relay: usize,
}

impl RowSource for Source {
    fn claim<'a>(
        &'a self,
        token: &'a Token,
        lease: Duration,
        batch: u32,
    ) -> BoxFuture<'a, Result<Vec<ReadRow>, StoreError>> {
        Box::pin(statement(&self.world, "claim", move |w| {
            let now = Instant::now();
            w.owner.insert(*token.as_bytes(), self.relay);
            let mut taken = Vec::new();
            for row in &mut w.rows {
                if taken.len() >= batch as usize {
                    break;
                }
                let free = row.claimed_until.is_none_or(|until| until < now);
                if row.state == State::Pending && row.next_at <= now && free {
                    row.token = Some(*token);
                    row.claimed_until = Some(now + lease);
                    row.attempts += 1;
                    taken.push(ReadRow {
                        message: message(&row.id, row.attempts),
                        unreadable: row.unreadable.then(|| "written elsewhere".to_owned()),
                    });
                }
            }
            let relay = self.relay;
            let ids: Vec<String> = taken.iter().map(|r| r.message.id.to_string()).collect();
            w.note(|| format!("relay {relay} claims {ids:?}"));
            taken
        }))
    }

    fn failed<'a>(
        &'a self,
        token: &'a Token,
        id: &'a str,
        _error: &'a str,
        max_attempts: u32,
        backoff: Duration,
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(statement(&self.world, "failed", move |w| {
            let now = Instant::now();
            let key = (*token.as_bytes(), id.to_owned());
            let Some(index) = w
                .rows
                .iter()
                .position(|r| r.id == id && r.token == Some(*token))
            else {
                return 0;
            };
            if !w.unconfirmed.contains(&key) && !w.rows[index].unreadable {
                let relay = self.relay;
                w.violations.push(format!(
                    "relay {relay} recorded a failure of row {id} that no publication of its claim had"
                ));
            }
            let row = &mut w.rows[index];
            row.state = if row.attempts >= max_attempts {
                State::Dead
            } else {
                State::Pending
            };
            row.next_at = now + backoff;
            row.token = None;
            row.claimed_until = None;
            1
        }))
    }

    fn release<'a>(&'a self, token: &'a Token) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(statement(&self.world, "release", move |w| {
            let mut released = 0;
            for row in &mut w.rows {
                if row.token == Some(*token) && row.state == State::Pending {
                    row.attempts = row.attempts.saturating_sub(1);
                    row.token = None;
                    row.claimed_until = None;
                    released += 1;
                }
            }
            released
        }))
    }

    fn published<'a>(
        &'a self,
        token: &'a Token,
        ids: &'a [&'a str],
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(statement(&self.world, "published", move |w| {
            let mut marked = 0;
            for id in ids {
                let key = (*token.as_bytes(), (*id).to_owned());
                if !w.confirmed.contains(&key) {
                    let relay = self.relay;
                    w.violations.push(format!(
                        "relay {relay} marked row {id} published without a confirmation under its claim"
                    ));
                }
                if let Some(row) = w
                    .rows
                    .iter_mut()
                    .find(|r| r.id == *id && r.token == Some(*token))
                {
                    row.state = State::Published;
                    row.token = None;
                    row.claimed_until = None;
                    marked += 1;
                }
            }
            marked
        }))
    }
}

fn message(id: &str, attempts: u32) -> OutboxMessage {
    OutboxMessage {
        id: MessageId::from_string(id.to_owned()),
        aggregate_type: "order".into(),
        aggregate_id: id.to_owned(),
        event_type: "order.created".into(),
        destination: "orders".into(),
        payload: Vec::new(),
        headers: BTreeMap::new(),
        attempts,
    }
}

/// One relay's broker.
struct Broker {
    world: Arc<Mutex<World>>,
    relay: usize,
}

/// Checks, as a publication ends however it ends (dropped at the relay's deadline included),
/// that the claim still holds, and records an unconfirmed end.
struct Publishing {
    world: Arc<Mutex<World>>,
    relay: usize,
    id: String,
    token: Option<Token>,
    confirmed: bool,
}

impl Drop for Publishing {
    fn drop(&mut self) {
        let mut w = lock(&self.world);
        w.check_held(self.relay, &self.id, "ended");
        if let (false, Some(token)) = (self.confirmed, self.token) {
            w.unconfirmed.insert((*token.as_bytes(), self.id.clone()));
        }
    }
}

impl Publisher for Broker {
    fn publish<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            let id = message.id.to_string();
            let copy = message.destination != "orders";
            let (fate, delay, lease, token) = {
                let mut w = lock(&self.world);
                w.check_held(self.relay, &id, "started");
                let token = w.rows.iter().find(|r| r.id == id).and_then(|r| r.token);
                let fate = w.fate(true);
                let relay = self.relay;
                w.note(|| format!("relay {relay} publishes {id} (copy: {copy}): {fate:?}"));
                (fate, w.delay(), w.lease, token)
            };
            let mut publishing = Publishing {
                world: self.world.clone(),
                relay: self.relay,
                id: id.clone(),
                // A dead-letter copy neither confirms nor fails the row.
                token: if copy { None } else { token },
                confirmed: false,
            };
            tokio::time::sleep(delay).await;
            match fate {
                Fate::Refused => Err(PublishError::new("refused")),
                Fate::Unreachable => Err(PublishError::unavailable("unreachable")),
                Fate::NeverAnswered | Fate::AnswerLost => std::future::pending().await,
                Fate::Late | Fate::Answered => {
                    if fate == Fate::Late {
                        tokio::time::sleep(lease).await;
                    }
                    if let (false, Some(token)) = (copy, token) {
                        lock(&self.world)
                            .confirmed
                            .insert((*token.as_bytes(), id.clone()));
                    }
                    publishing.confirmed = true;
                    Ok(())
                }
            }
        })
    }
}

/// Runs `round`, or drops it after `crash` if one is given; a round that ends neither way
/// within `bound` is a violation.
async fn bounded_round(
    world: &Mutex<World>,
    relay: usize,
    round: impl Future<Output = Result<crate::outbox::RelayStats, StoreError>>,
    crash: Option<Duration>,
    bound: Duration,
) {
    let crash = async {
        match crash {
            Some(after) => tokio::time::sleep(after).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        () = crash => lock(world).note(|| format!("relay {relay} dies")),
        ended = tokio::time::timeout(bound, round) => match ended {
            Ok(stats) => lock(world).note(|| format!("relay {relay} round: {stats:?}")),
            Err(_) => lock(world)
                .violations
                .push(format!("relay {relay}'s round did not end within {bound:?}")),
        },
    }
}

/// One schedule from `seed`: its violations and, when `traced`, its trace.
fn schedule(seed: u64, traced: bool) -> (Vec<String>, Vec<String>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap_or_else(|e| panic!("a runtime: {e}"));
    runtime.block_on(async move {
        let mut rng = Rng(seed);
        let lease = Duration::from_millis(1_000);
        let settings = Settings {
            batch: 1 + rng.below(4) as u32,
            lease,
            max_attempts: 1 + rng.below(3) as u32,
            first_backoff: Duration::from_millis(10 + rng.below(100)),
            max_backoff: Duration::from_millis(200),
            poll: Duration::from_millis(50),
            dead_letter: (rng.below(2) == 0).then(|| "dead-letters".to_owned()),
        };
        let now = Instant::now();
        let rows = (0..1 + rng.below(6))
            .map(|n| Row {
                id: format!("{n:02}"),
                state: State::Pending,
                attempts: 0,
                next_at: now,
                token: None,
                claimed_until: None,
                unreadable: rng.below(8) == 0,
            })
            .collect();
        let relays = 1 + rng.below(3) as usize;
        let plans: Vec<Vec<(Duration, Option<Duration>)>> = (0..relays)
            .map(|_| {
                (0..1 + rng.below(5))
                    .map(|_| {
                        let wait = rng.millis(lease);
                        let crash = (rng.below(5) == 0).then(|| rng.millis(lease * 2));
                        (wait, crash)
                    })
                    .collect()
            })
            .collect();
        let world = Arc::new(Mutex::new(World {
            rows,
            rng,
            owner: BTreeMap::new(),
            confirmed: BTreeSet::new(),
            unconfirmed: BTreeSet::new(),
            faults: true,
            lease,
            violations: Vec::new(),
            trace: traced.then(Vec::new),
        }));
        // Every statement is bounded by the lease, every publication by the claim's deadline.
        let bound = lease * (settings.batch + 4) * 2;

        let mut tasks = tokio::task::JoinSet::new();
        for (relay, plan) in plans.into_iter().enumerate() {
            let (world, settings) = (world.clone(), settings.clone());
            tasks.spawn(async move {
                let source = Source {
                    world: world.clone(),
                    relay,
                };
                let broker = Broker {
                    world: world.clone(),
                    relay,
                };
                for (wait, crash) in plan {
                    tokio::time::sleep(wait).await;
                    let round = settings.round(&source, &broker);
                    bounded_round(&world, relay, round, crash, bound).await;
                }
            });
        }
        while tasks.join_next().await.is_some() {}

        // The faults stop; a last relay runs until nothing is due or held.
        lock(&world).faults = false;
        let last = relays;
        let source = Source {
            world: world.clone(),
            relay: last,
        };
        let broker = Broker {
            world: world.clone(),
            relay: last,
        };
        for _ in 0..50 {
            if lock(&world).rows.iter().all(|r| r.state != State::Pending) {
                break;
            }
            tokio::time::sleep(lease * 2).await;
            bounded_round(&world, last, settings.round(&source, &broker), None, bound).await;
        }
        let mut w = lock(&world);
        let mut ended = Vec::new();
        for row in &w.rows {
            let confirmed = w.confirmed.iter().any(|(_, id)| *id == row.id);
            let failed = row.unreadable || w.unconfirmed.iter().any(|(_, id)| *id == row.id);
            match row.state {
                State::Pending => ended.push(format!("row {} never delivered", row.id)),
                State::Published if !confirmed => {
                    ended.push(format!("row {} published, never confirmed", row.id));
                }
                State::Dead if !failed => {
                    ended.push(format!("row {} dead without a failure", row.id));
                }
                _ => {}
            }
        }
        w.violations.extend(ended);
        (
            std::mem::take(&mut w.violations),
            w.trace.take().unwrap_or_default(),
        )
    })
}

#[test]
fn relays_keep_their_invariants_under_every_schedule() {
    if let Ok(seed) = std::env::var("RELAY_SIM_SEED") {
        let seed: u64 = seed
            .parse()
            .unwrap_or_else(|e| panic!("RELAY_SIM_SEED: {e}"));
        let (violations, trace) = schedule(seed, true);
        for step in trace {
            println!("{step}");
        }
        assert!(violations.is_empty(), "seed {seed}: {violations:#?}");
        return;
    }
    let schedules: u64 = std::env::var("RELAY_SIM_SCHEDULES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3_000);
    let started = std::time::Instant::now();
    for seed in 0..schedules {
        let (violations, _) = schedule(seed, false);
        assert!(
            violations.is_empty(),
            "seed {seed} (replay with RELAY_SIM_SEED={seed}): {violations:#?}"
        );
    }
    println!(
        "schedules={schedules} violations=0 seconds={:.1}",
        started.elapsed().as_secs_f64()
    );
}
