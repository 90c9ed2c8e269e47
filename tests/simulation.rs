//! A deterministic simulation of the engine under faults, in the spirit of FoundationDB's
//! simulator: a seeded scheduler drives several concurrent callers of the real engine over the
//! real `MemoryStore`, through every door: single calls (`Operation::run_with`, replay on,
//! sometimes a business `done` check, sometimes holding the key on error), batches of one or
//! two keys (`Batch`), gRPC methods (`replay_grpc` of a prost reply, errors as `Status`,
//! behind the real `grpc::DetachLayer`), HTTP requests through the real
//! `http::IdempotencyLayer` (the body as the handler, its response sometimes streamed with an
//! await point before its last frame, sometimes with another request body under the same key,
//! sometimes looking for the previous key layout's record, which one key
//! has, completed before an upgrade: read with the claim in one command where the simulated
//! store sends the two together, as Redis does, beside it otherwise), unary gRPC calls through the real
//! `grpc::IdempotencyLayer` (a real tonic client and a real tonic handler of the body, in
//! process, keyed by metadata, sometimes with another message under the same key), calls through a `CombiningStore` or a `TieredStore` (two
//! simulated stores, the front of which can lose its data at any step), lock holders (`Lock`),
//! and an operator's actions (`Admin`: `force_release`, `delete`, `purge`, `unhold`) racing
//! them. It decides everything a real deployment leaves to chance:
//!
//! - at every store command: applied and answered, refused before being applied, applied with
//!   its reply lost, never answered (not applied), applied and never answered, applied and
//!   answered unavailable (a durable write its replicas did not acknowledge; a claim is given
//!   back, or its give-back is lost), or left in flight for later (and possibly applied after
//!   its caller is gone); a tiered store's front answers every command, as a store with a
//!   reply timeout does, a command it never answers as a timeout;
//! - at every await point of a caller: poll it now, later, or drop it (a timeout, a client
//!   hanging up; a gRPC call or an HTTP request that started then goes on in its layer's
//!   task);
//! - between steps: let background tasks run, or move the clock (the store's clock and Tokio's
//!   are the same paused clock) past leases and ttls.
//!
//! After every schedule it checks:
//!
//! 1. per key, effects <= 1 + the losses reported (owners told `LostOwnership`, completions
//!    the store refused, completions lost after `Ok` handed to the `on_completion_lost` hook,
//!    callers dropped after their effect) plus the completed records an operator deleted on
//!    purpose; with `done` (not HTTP's keys, which have none), effects applied while
//!    their owner held the live claim <= 1 (an owner stalled past its lease is what the fence
//!    at the resource is for: the engine cannot stop it);
//! 2. no owner whose body returned `Ok` ever gives its claim back (an operator's
//!    `force_release` is the operator's, not the owner's);
//! 3. no operator delete removes a claim whose lease is live when the delete lands;
//! 4. a lock holder whose guard says the lock is held is the store's live holder;
//! 5. every caller answers, though some store commands never do; once every caller is gone and
//!    a lease has passed, no key is in progress, except one whose claim the store applied and
//!    never answered, or whose give-back was lost, or abandoned at a tiered store's front (its
//!    lease is all that frees it);
//! 6. every duplicate answer follows an applied effect, and every replayed value is one a body
//!    of that key returned;
//! 7. a gRPC call or an HTTP request whose client left after it started still ends (its
//!    answer, or its layer's count of it, is there, or its layer has nothing running), and a
//!    loss it would have told its client counts as told (a call through the gRPC layer, whose
//!    answer is not seen, counts its effect as a loss);
//! 8. the HTTP request completed under the previous key layout never runs (unless an operator
//!    deleted that record).
//!
//! `SIM_SCHEDULES` sets how many schedules run (default 100,000 in release builds, 2,000 in
//! debug builds), `SIM_SEED` replays one seed with a trace of every step. A violation prints its
//! seed and a shrunk schedule. The test ends with one line:
//! `schedules=<n> violations=0 seconds=<s>`.
//!
//! `cargo test --release --all-features --test simulation -- --nocapture`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use idempotency::admin::Admin;
use idempotency::grpc::DetachLayer;
use idempotency::http::IdempotencyLayer;
use idempotency::lock::Lock;
use idempotency::memory::Clock;
use idempotency::store::{
    BoxFuture, Claim, ClaimRequest, CombiningStore, Completion, End, Ending, Expect, OperatorStore,
    Record, RecordState, ScanCursor, ScanPage, Store, StoreError, StoreErrorKind, TieredStore,
    Token,
};
use idempotency::{Error, Idempotency, Key, KeyPart, MemoryStore, OnError, SharedStore};
use tower::{Layer as _, ServiceExt as _};

const LEASE: Duration = Duration::from_millis(300);
const TTL: Duration = Duration::from_secs(5);

/// The caller of every HTTP request, `sim`, as the HTTP layer puts it in a key: the first 16
/// bytes of its SHA-256, in hex.
fn http_scope() -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(b"sim")[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

// ---------------------------------------------------------------------------------------
// Choices: a seeded generator, or a recorded list replayed (and shrunk).

struct Choices {
    state: u64,
    replay: Option<Vec<u32>>,
    at: usize,
    taken: Vec<u32>,
}

impl Choices {
    fn seeded(seed: u64) -> Choices {
        Choices {
            state: seed ^ 0x9E37_79B9_7F4A_7C15,
            replay: None,
            at: 0,
            taken: Vec::new(),
        }
    }

    fn replaying(choices: Vec<u32>) -> Choices {
        Choices {
            state: 0,
            replay: Some(choices),
            at: 0,
            taken: Vec::new(),
        }
    }

    /// A number below `n` (n >= 1).
    fn pick(&mut self, n: u32) -> u32 {
        let raw = match &self.replay {
            Some(list) => list.get(self.at).copied().unwrap_or(0),
            None => {
                // splitmix64
                self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = self.state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                ((z ^ (z >> 31)) >> 32) as u32
            }
        };
        self.at += 1;
        let value = raw % n;
        self.taken.push(value);
        value
    }

    /// True with probability `num / den`.
    fn chance(&mut self, num: u32, den: u32) -> bool {
        self.pick(den) < num
    }
}

// ---------------------------------------------------------------------------------------
// The store: every command waits in flight until the scheduler ends it.

/// The store's clock is Tokio's paused clock, so leases, ttls and the engine's timers move
/// together.
struct TokioClock {
    origin: tokio::time::Instant,
}

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        tokio::time::Instant::now() - self.origin
    }
    fn unix_micros(&self) -> u64 {
        1_000_000 + self.now().as_micros() as u64
    }
}

#[derive(Debug, Clone)]
enum Command {
    Claim(ClaimRequest),
    Complete(Key, Token, Completion),
    Release(Key, Token),
    Renew(Key, Token, Duration),
    Read(Key),
    /// An operator's delete: of a record with this token, or of a value that is no record.
    Delete(Key, Option<Token>),
    /// An operator's release (`force_release`): frees a claim on purpose, live or not.
    ForceRelease(Key, Token),
    Reopen(Key, Token),
    Scan(String, ScanCursor, usize),
    /// A batch claim: one round trip, as every built-in store sends it.
    ClaimMany(Vec<ClaimRequest>),
    /// A batch ending: one round trip.
    CompleteMany(Vec<Ending>),
    /// A claim and a read of another key's state in one round trip
    /// (`Store::claim_and_is_completed`), as the Redis store pipelines them: applied together,
    /// answered together, lost together.
    ClaimReading(ClaimRequest, Key),
}

#[derive(Debug)]
enum Reply {
    Claim(Result<Claim, StoreError>),
    Bool(Result<bool, StoreError>),
    Read(Result<Option<Record>, StoreError>),
    Scan(Result<ScanPage, StoreError>),
    Claims(Vec<Result<Claim, StoreError>>),
    Bools(Vec<Result<bool, StoreError>>),
    ClaimRead(Result<Claim, StoreError>, Result<bool, StoreError>),
}

struct InFlight {
    id: u64,
    /// Sent to the front layer of a `TieredStore`.
    front: bool,
    /// The keys a release to the front layer gives back (by index).
    front_releases: Vec<usize>,
    /// Its reply reached its caller.
    delivered: bool,
    command: Command,
    reply: Option<Reply>,
    waker: Option<Waker>,
    /// Ended: the scheduler no longer chooses it.
    ended: bool,
}

#[derive(Default)]
struct World {
    next_id: u64,
    in_flight: Vec<InFlight>,
    /// Fences of owners whose body returned `Ok`, per key index.
    ok_fences: BTreeMap<usize, BTreeSet<u64>>,
    /// The fences of owners that lost their key, per key index: their completion was refused
    /// by the store, they were told `LostOwnership`, or their loss went to the hook.
    losers: BTreeMap<usize, BTreeSet<u64>>,
    /// The fence each acquired claim's token got.
    token_fences: BTreeMap<Vec<u8>, u64>,
    /// Completed records an operator deleted (an explicit "run it again"), per key index.
    rerun_by_operator: BTreeMap<usize, usize>,
    /// Keys with a command the store applied and never answered, or a claim whose give-back
    /// was lost: a claim that may hold the key until its lease runs out, with no one to give
    /// it back.
    applied_unanswered: BTreeSet<usize>,
    violations: Vec<String>,
    trace: Option<Vec<String>>,
}

impl World {
    fn log(&mut self, line: impl FnOnce() -> String) {
        if let Some(trace) = &mut self.trace {
            trace.push(line());
        }
    }
}

struct SimStore {
    inner: MemoryStore,
    world: Arc<Mutex<World>>,
    keys: Vec<Key>,
    /// The front layer of a `TieredStore` (the back is the record of truth, which the checks
    /// read): its commands are scheduled and faulted alike, but its records count for
    /// nothing the checks look at (its fences, refusals and give-backs are not an owner's).
    is_front: bool,
    /// The back's handle on the front layer, to end the front's commands.
    front: Option<Arc<SimStore>>,
    /// Sends a claim and a read of another key together when asked
    /// (`Store::claim_and_is_completed`), as the Redis store does; else answers `None`, and
    /// the engine sends the two apart.
    reads_with_claims: bool,
}

impl SimStore {
    fn key_index(&self, key: &Key) -> usize {
        self.keys
            .iter()
            .position(|k| k == key)
            .unwrap_or(usize::MAX)
    }

    fn send(&self, command: Command) -> Sent {
        let mut world = self.world.lock().unwrap();
        let id = world.next_id;
        world.next_id += 1;
        let front = self.is_front;
        world.log(|| {
            let layer = if front { "front " } else { "" };
            format!("  send #{id} {layer}{}", describe(&command))
        });
        let front_releases = match &command {
            Command::Release(key, _) if front => vec![self.key_index(key)],
            Command::CompleteMany(items) if front => items
                .iter()
                .filter(|item| matches!(item.action, End::Release))
                .map(|item| self.key_index(&item.key))
                .collect(),
            _ => Vec::new(),
        };
        world.in_flight.push(InFlight {
            id,
            front,
            front_releases,
            delivered: false,
            command,
            reply: None,
            waker: None,
            ended: false,
        });
        Sent {
            id,
            world: self.world.clone(),
        }
    }

    /// Applies a command to the real store, checking rule 2 on the way.
    fn apply(&self, command: &Command, world: &mut World) -> Reply {
        match command {
            Command::Claim(req) => Reply::Claim(self.claim_now(req, world)),
            Command::ClaimReading(req, other) => Reply::ClaimRead(
                self.claim_now(req, world),
                ready(self.inner.is_completed(other)),
            ),
            Command::Complete(key, token, completion) => {
                Reply::Bool(self.complete_now(key, token, completion, world))
            }
            Command::Release(key, token) => Reply::Bool(self.release_now(key, token, world)),
            Command::ClaimMany(reqs) => {
                let claims = ready(self.inner.claim_many(reqs));
                for (req, claim) in reqs.iter().zip(&claims) {
                    if let Ok(Claim::Acquired { fence }) = claim {
                        world
                            .token_fences
                            .insert(req.token.as_bytes().to_vec(), *fence);
                    }
                }
                Reply::Claims(claims)
            }
            Command::CompleteMany(items) => Reply::Bools(
                items
                    .iter()
                    .map(|item| match &item.action {
                        End::Complete(c) => self.complete_now(&item.key, &item.token, c, world),
                        _ => self.release_now(&item.key, &item.token, world),
                    })
                    .collect(),
            ),
            Command::Renew(key, token, lease) => {
                Reply::Bool(ready(self.inner.renew(key, token, *lease)))
            }
            Command::Read(key) => Reply::Read(ready(self.inner.read(key))),
            Command::Delete(key, token) => {
                let before: Option<Record> = ready(self.inner.read(key)).unwrap_or(None);
                let expect = match token {
                    Some(token) => Expect::Token(token),
                    None => Expect::Corrupt,
                };
                let out = ready(self.inner.delete(key, expect));
                if let (Ok(true), Some(record)) = (&out, &before) {
                    match record.state {
                        RecordState::InProgress { lease_left } if !lease_left.is_zero() => {
                            world.violations.push(format!(
                                "an operator deleted the live claim on `{key}` (fence {})",
                                record.fence
                            ));
                        }
                        RecordState::Completed => {
                            *world
                                .rerun_by_operator
                                .entry(self.key_index(key))
                                .or_default() += 1;
                        }
                        _ => {}
                    }
                }
                Reply::Bool(out)
            }
            Command::Reopen(key, token) => Reply::Bool(ready(self.inner.reopen(key, token))),
            Command::ForceRelease(key, token) => Reply::Bool(ready(self.inner.release(key, token))),
            Command::Scan(prefix, cursor, limit) => {
                Reply::Scan(ready(self.inner.scan(prefix, cursor, *limit)))
            }
        }
    }

    /// A claim, noting the fence an acquired one got.
    fn claim_now(&self, req: &ClaimRequest, world: &mut World) -> Result<Claim, StoreError> {
        let claim = ready(self.inner.claim(req));
        if let Ok(Claim::Acquired { fence }) = &claim {
            world
                .token_fences
                .insert(req.token.as_bytes().to_vec(), *fence);
        }
        claim
    }

    /// A completion, counting a refused one (its owner had lost the key).
    fn complete_now(
        &self,
        key: &Key,
        token: &Token,
        completion: &Completion,
        world: &mut World,
    ) -> Result<bool, StoreError> {
        let out = ready(self.inner.complete(key, token, completion));
        if let Ok(false) = out {
            if let Some(&fence) = world.token_fences.get(token.as_bytes().as_slice()) {
                world
                    .losers
                    .entry(self.key_index(key))
                    .or_default()
                    .insert(fence);
            }
        }
        out
    }

    /// A release, checking rule 2: an owner whose body returned `Ok` never gives it back.
    fn release_now(&self, key: &Key, token: &Token, world: &mut World) -> Result<bool, StoreError> {
        let before: Option<Record> = ready(self.inner.read(key)).unwrap();
        if let Some(record) = before {
            if record.token == *token
                && matches!(record.state, RecordState::InProgress { .. })
                && world
                    .ok_fences
                    .get(&self.key_index(key))
                    .is_some_and(|f| f.contains(&record.fence))
            {
                world.violations.push(format!(
                    "the owner of `{key}` (fence {}) gave its claim back after its body returned Ok",
                    record.fence
                ));
            }
        }
        ready(self.inner.release(key, token))
    }

    /// Ends in-flight command number `index` with `fault`: 0 applied and answered, 1 refused
    /// before being applied, 2 applied with its reply lost, 3 never answered and never applied
    /// (a request lost on a silent connection), 4 applied and never answered (a silent
    /// connection after the server applied it), 5 applied and answered "unavailable" (a
    /// durable Redis write its replicas did not acknowledge: a claim it acquired is given
    /// back by its token before the answer, any other write stays applied), 6 the same with
    /// the give-back lost (the claims it acquired stay held, with no owner, until their
    /// leases run out).
    fn end(&self, index: usize, fault: u32) {
        let front = self.world.lock().unwrap().in_flight[index].front;
        match &self.front {
            Some(layer) if front => layer.end_here(index, fault),
            _ => self.end_here(index, fault),
        }
    }

    /// [`end`](Self::end) for a command sent to this store.
    fn end_here(&self, index: usize, fault: u32) {
        let mut guard = self.world.lock().unwrap();
        let command = guard.in_flight[index].command.clone();
        // The front's records count for nothing the checks look at: its bookkeeping goes to a
        // scratch world.
        let mut scratch = World::default();
        let world: &mut World = if self.is_front {
            &mut scratch
        } else {
            &mut guard
        };
        let reply = match fault {
            1 => Some(fail(&command, StoreErrorKind::Unavailable)),
            // The front layer answers every command, as a store with a reply timeout does (the
            // tiered store awaits its writes to the front without a bound of its own): a
            // command it never answers is answered as a timeout, applied or not.
            3 if self.is_front => Some(fail(&command, StoreErrorKind::OutcomeUnknown)),
            2 | 4 if fault == 2 || self.is_front => {
                self.apply(&command, world);
                Some(fail(&command, StoreErrorKind::OutcomeUnknown))
            }
            3 => None,
            5 | 6 => {
                let reply = self.apply(&command, world);
                for req in acquired(&command, &reply) {
                    if fault == 5 {
                        let _ = ready(self.inner.release(&req.key, &req.token));
                    } else {
                        world.applied_unanswered.insert(self.key_index(&req.key));
                    }
                }
                Some(fail(&command, StoreErrorKind::Unavailable))
            }
            4 => {
                self.apply(&command, world);
                let claimed: Vec<usize> = match &command {
                    Command::Claim(req) | Command::ClaimReading(req, _) => {
                        vec![self.key_index(&req.key)]
                    }
                    Command::ClaimMany(reqs) => {
                        reqs.iter().map(|req| self.key_index(&req.key)).collect()
                    }
                    _ => Vec::new(),
                };
                world.applied_unanswered.extend(claimed);
                None
            }
            _ => Some(self.apply(&command, world)),
        };
        let mut world = guard;
        let id = world.in_flight[index].id;
        world.log(|| {
            format!(
                "  end #{id} {} -> {reply:?}",
                [
                    "applied",
                    "refused",
                    "applied, reply lost",
                    "never answered",
                    "applied, never answered",
                    "applied, answered unavailable",
                    "applied, answered unavailable, give-back lost"
                ][fault as usize]
            )
        });
        let entry = &mut world.in_flight[index];
        entry.ended = true;
        if let Some(reply) = reply {
            entry.reply = Some(reply);
            if let Some(waker) = entry.waker.take() {
                waker.wake();
            }
        }
    }

    fn unsettled(&self) -> Vec<usize> {
        let world = self.world.lock().unwrap();
        (0..world.in_flight.len())
            .filter(|&i| !world.in_flight[i].ended)
            .collect()
    }
}

/// The claims `command` acquired, as `reply` says.
fn acquired<'a>(command: &'a Command, reply: &Reply) -> Vec<&'a ClaimRequest> {
    match (command, reply) {
        (Command::Claim(req), Reply::Claim(Ok(Claim::Acquired { .. })))
        | (Command::ClaimReading(req, _), Reply::ClaimRead(Ok(Claim::Acquired { .. }), _)) => {
            vec![req]
        }
        (Command::ClaimMany(reqs), Reply::Claims(claims)) => reqs
            .iter()
            .zip(claims)
            .filter(|(_, c)| matches!(c, Ok(Claim::Acquired { .. })))
            .map(|(req, _)| req)
            .collect(),
        _ => Vec::new(),
    }
}

/// The answer of a memory store future, which is ready at once.
fn ready<T>(mut fut: BoxFuture<'_, T>) -> T {
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("the memory store answers at once"),
    }
}

fn fail(command: &Command, kind: StoreErrorKind) -> Reply {
    let err = StoreError::new(kind, "simulated fault");
    match command {
        Command::Claim(_) => Reply::Claim(Err(err)),
        Command::ClaimReading(..) => {
            Reply::ClaimRead(Err(err), Err(StoreError::new(kind, "simulated fault")))
        }
        Command::Read(_) => Reply::Read(Err(err)),
        Command::Scan(..) => Reply::Scan(Err(err)),
        Command::ClaimMany(reqs) => Reply::Claims(
            reqs.iter()
                .map(|_| Err(StoreError::new(kind, "simulated fault")))
                .collect(),
        ),
        Command::CompleteMany(items) => Reply::Bools(
            items
                .iter()
                .map(|_| Err(StoreError::new(kind, "simulated fault")))
                .collect(),
        ),
        _ => Reply::Bool(Err(err)),
    }
}

fn describe(command: &Command) -> String {
    match command {
        Command::Claim(req) => format!("claim {} token {:?}", req.key, req.token),
        Command::ClaimReading(req, other) => {
            format!("claim {} token {:?} reading {other}", req.key, req.token)
        }
        Command::Complete(key, token, c) => format!(
            "complete {key} token {token:?} result {:?}",
            c.result.as_ref().map(Vec::len)
        ),
        Command::Release(key, token) => format!("release {key} token {token:?}"),
        Command::Renew(key, token, _) => format!("renew {key} token {token:?}"),
        Command::Read(key) => format!("read {key}"),
        Command::Delete(key, token) => format!("operator delete {key} token {token:?}"),
        Command::Reopen(key, token) => format!("operator reopen {key} token {token:?}"),
        Command::ForceRelease(key, token) => format!("operator release {key} token {token:?}"),
        Command::Scan(prefix, cursor, _) => format!("operator scan {prefix} from {cursor}"),
        Command::ClaimMany(reqs) => format!(
            "claim_many {:?}",
            reqs.iter()
                .map(|r| (r.key.to_string(), r.token))
                .collect::<Vec<_>>()
        ),
        Command::CompleteMany(items) => format!(
            "complete_many {:?}",
            items
                .iter()
                .map(|i| (
                    i.key.to_string(),
                    i.token,
                    matches!(i.action, End::Complete(_))
                ))
                .collect::<Vec<_>>()
        ),
    }
}

/// The caller's side of an in-flight command.
struct Sent {
    id: u64,
    world: Arc<Mutex<World>>,
}

impl Sent {
    fn poll_reply(&self, cx: &mut Context<'_>) -> Poll<Reply> {
        let mut world = self.world.lock().unwrap();
        let Some(entry) = world.in_flight.iter_mut().find(|e| e.id == self.id) else {
            panic!("command #{} vanished", self.id);
        };
        match entry.reply.take() {
            Some(reply) => {
                entry.delivered = true;
                Poll::Ready(reply)
            }
            None => {
                entry.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// A give-back to the front layer that its caller stopped waiting for (the engine's bound on
/// a store call ran out while the front held it) never reaches the back: the tiered store
/// releases the back only once the front answered. The back's claim is then held until its
/// lease ends, as one whose give-back was lost.
impl Drop for Sent {
    fn drop(&mut self) {
        let mut world = self.world.lock().unwrap();
        let World {
            in_flight,
            applied_unanswered,
            ..
        } = &mut *world;
        if let Some(entry) = in_flight.iter_mut().find(|e| e.id == self.id) {
            if !entry.delivered {
                applied_unanswered.extend(entry.front_releases.iter().copied());
            }
        }
    }
}

fn sent<T: Send + 'static>(sent: Sent, unpack: fn(Reply) -> Option<T>) -> BoxFuture<'static, T> {
    Box::pin(async move {
        let reply = std::future::poll_fn(|cx| sent.poll_reply(cx)).await;
        unpack(reply).expect("a reply of the command's kind")
    })
}

impl Store for SimStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        sent(self.send(Command::Claim(req.clone())), |r| match r {
            Reply::Claim(c) => Some(c),
            _ => None,
        })
    }
    fn claim_and_is_completed(
        self: Arc<Self>,
        req: Arc<ClaimRequest>,
        other: Key,
    ) -> Option<BoxFuture<'static, (Result<Claim, StoreError>, Result<bool, StoreError>)>> {
        if !self.reads_with_claims {
            return None;
        }
        let command = Command::ClaimReading((*req).clone(), other);
        Some(sent(self.send(command), |r| match r {
            Reply::ClaimRead(claim, read) => Some((claim, read)),
            _ => None,
        }))
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        sent(
            self.send(Command::Complete(key.clone(), *token, completion.clone())),
            bool_reply,
        )
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        sent(self.send(Command::Release(key.clone(), *token)), bool_reply)
    }
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        sent(
            self.send(Command::Renew(key.clone(), *token, lease)),
            bool_reply,
        )
    }
    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        sent(self.send(Command::Read(key.clone())), |r| match r {
            Reply::Read(r) => Some(r),
            _ => None,
        })
    }
    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Vec<Result<Claim, StoreError>>> {
        sent(self.send(Command::ClaimMany(reqs.to_vec())), |r| match r {
            Reply::Claims(c) => Some(c),
            _ => None,
        })
    }
    fn complete_many<'a>(
        &'a self,
        items: &'a [Ending],
    ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
        sent(
            self.send(Command::CompleteMany(items.to_vec())),
            |r| match r {
                Reply::Bools(b) => Some(b),
                _ => None,
            },
        )
    }
}

impl OperatorStore for SimStore {
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        sent(self.send(Command::Reopen(key.clone(), *token)), bool_reply)
    }
    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        cursor: &'a ScanCursor,
        limit: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
        let command = Command::Scan(prefix.to_owned(), cursor.clone(), limit);
        sent(self.send(command), |r| match r {
            Reply::Scan(r) => Some(r),
            _ => None,
        })
    }
    fn delete<'a>(
        &'a self,
        key: &'a Key,
        expect: Expect<'a>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let token = match expect {
            Expect::Token(token) => Some(*token),
            _ => None,
        };
        sent(self.send(Command::Delete(key.clone(), token)), bool_reply)
    }
}

/// The store as an operator's actions reach it: the same commands, but its releases are
/// the operator's (`force_release` frees a claim on purpose), not an owner giving its claim
/// back.
struct OperatorView(Arc<SimStore>);

impl Store for OperatorView {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        self.0.claim(req)
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.0.complete(key, token, completion)
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        sent(
            self.0.send(Command::ForceRelease(key.clone(), *token)),
            bool_reply,
        )
    }
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.0.renew(key, token, lease)
    }
    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.0.read(key)
    }
}

impl OperatorStore for OperatorView {
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.0.reopen(key, token)
    }
    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        cursor: &'a ScanCursor,
        limit: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
        self.0.scan(prefix, cursor, limit)
    }
    fn delete<'a>(
        &'a self,
        key: &'a Key,
        expect: Expect<'a>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.0.delete(key, expect)
    }
}

fn bool_reply(reply: Reply) -> Option<Result<bool, StoreError>> {
    match reply {
        Reply::Bool(b) => Some(b),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------
// Callers and their bodies.

#[derive(Debug, Clone, PartialEq, Eq)]
enum AppError {
    Idem(String),
    Business,
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Idem(match e {
            Error::Duplicate { .. } => "duplicate".into(),
            Error::InProgress { .. } => "in_progress".into(),
            Error::LostOwnership { .. } => "lost_ownership".into(),
            Error::Store(_) => "store".into(),
            other => format!("{other:?}"),
        })
    }
}

/// Per key: effects applied (all of them, and those applied by the store's live owner of the
/// key at that moment), and the values bodies returned.
#[derive(Default)]
struct Effects {
    applied: Vec<u32>,
    by_live_owner: Vec<u32>,
    values: Vec<BTreeSet<u64>>,
}

/// The fence a body applied its effect under, once it did.
type Ran = Arc<Mutex<Option<u64>>>;

/// What a caller was told for one of its keys.
struct Answer {
    key: usize,
    /// The fence its body applied the effect under, once it did (so an `Ok` is its own value,
    /// not a replay).
    ran: Ran,
    out: Result<u64, AppError>,
}

/// A caller: a single call, a batch, an operator's action, a lock holder, a gRPC call or an
/// HTTP request. It answers once, for each of its keys (operators and lock holders answer
/// nothing the checks look at).
struct Caller {
    future: Pin<Box<dyn Future<Output = Vec<Answer>>>>,
    /// A door whose call runs to its end when its client leaves once it started: what the
    /// checks read of that end.
    detached: Option<Detached>,
    /// Whether it was polled (the server received the call).
    started: bool,
    /// Its keys, each with the fence its body applied the effect under, once it did: a
    /// caller dropped after its effect is a loss the law counts (its message is redelivered).
    rans: Vec<(usize, Ran)>,
}

/// How a call whose client left is seen to end, for the checks: its client is gone, but it
/// must still end, and a loss it would have told its client is still a loss.
enum Detached {
    /// A gRPC method behind the real `grpc::DetachLayer`: the method's answer, once it ended.
    Grpc(Arc<Mutex<Option<Result<u64, AppError>>>>),
    /// A request through the real `http::IdempotencyLayer` (its own layer, so its counts are
    /// this request's): it ended once it is counted.
    Http(IdempotencyLayer),
    /// A call through the real `grpc::IdempotencyLayer` (its own layer): it ended once the
    /// layer has no call running. Its answer is not seen, so its effect counts as a loss, as
    /// a caller's dropped after its effect does.
    GrpcLayer(idempotency::grpc::IdempotencyLayer),
}

impl Detached {
    /// Whether the call ended, and whether it ended telling its client of a loss (ownership
    /// lost after its effect). An HTTP run that ran its effect and answered a problem can
    /// only have lost its claim (a completion the store did not answer is answered `Ok`, its
    /// loss reported to the hook): its counts do not say which problem.
    async fn ended(&self) -> (bool, bool) {
        match self {
            Detached::GrpcLayer(layer) => (layer.shutdown(Duration::ZERO).await, true),
            Detached::Grpc(answer) => match &*answer.lock().unwrap() {
                None => (false, false),
                Some(out) => (
                    true,
                    matches!(out, Err(AppError::Idem(kind)) if kind == "lost_ownership"),
                ),
            },
            Detached::Http(layer) => {
                let counts = layer.counts();
                let ends = counts.fresh + counts.replayed + counts.released + counts.rejected;
                (ends == 1, counts.rejected == 1)
            }
        }
    }
}

/// A streamed response body: `text`, then a last frame of one space after `pause` await
/// points (the layer sends the first frame with the head, and holds the last one back until
/// the key is completed).
fn frames(
    text: String,
    pause: u32,
) -> impl futures_util::Stream<Item = Result<axum::body::Bytes, Infallible>> + Send {
    use futures_util::StreamExt as _;
    let first = futures_util::stream::once(async move { Ok(axum::body::Bytes::from(text)) });
    first.chain(futures_util::stream::once(async move {
        Steps(pause).await;
        Ok(axum::body::Bytes::from_static(b" "))
    }))
}

/// What an HTTP client was told, read back as the other callers' answers: the value of a
/// `201` (fresh or replayed), `Business` for the handler's own `500`, and the layer's
/// problems by their `type` (a lost claim is the `internal` problem that says so).
async fn from_http(
    response: http::Response<idempotency::http::Body>,
    seeded: bool,
) -> Result<u64, AppError> {
    let status = response.status();
    let problem = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|t| t == "application/problem+json");
    let body = axum::body::to_bytes(axum::body::Body::new(response.into_body()), usize::MAX)
        .await
        .expect("the layer's body is whole");
    if !problem {
        return match status.as_u16() {
            201 => Ok(std::str::from_utf8(&body).unwrap().trim().parse().unwrap()),
            500 => Err(AppError::Business),
            other => Err(AppError::Idem(format!("status {other}"))),
        };
    }
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let slug = problem["type"]
        .as_str()
        .unwrap()
        .rsplit('#')
        .next()
        .unwrap();
    let detail = problem["detail"].as_str().unwrap_or_default();
    let kind = match slug {
        "in-flight" => "in_progress",
        // Completed under the previous layout, before the upgrade: not this layout's effect.
        "already-processed" if seeded => "already_processed",
        "already-processed" => "duplicate",
        "store-unavailable" => "store",
        "internal" if detail.starts_with("lost ownership") => "lost_ownership",
        other => other,
    };
    Err(AppError::Idem(kind.to_owned()))
}

/// A unary gRPC call's message: another payload under the same key is another call.
#[derive(Clone, PartialEq, prost::Message)]
struct SimRequest {
    #[prost(string, tag = "1")]
    payload: String,
}

/// The tonic handler of a gRPC call through the layer: its body, run once.
struct SimMethod(Option<Body>);

impl tonic::server::UnaryService<SimRequest> for SimMethod {
    type Response = SimReply;
    type Future = BoxFuture<'static, Result<tonic::Response<SimReply>, tonic::Status>>;

    fn call(&mut self, _: tonic::Request<SimRequest>) -> Self::Future {
        let body = self.0.take().expect("one call");
        Box::pin(async move { to_grpc(body.await) })
    }
}

/// A gRPC method's reply: the value, as a prost message.
#[derive(Clone, PartialEq, prost::Message)]
struct SimReply {
    #[prost(uint64, tag = "1")]
    value: u64,
}

/// The body's outcome as a tonic method returns it.
fn to_grpc(out: Result<u64, AppError>) -> Result<tonic::Response<SimReply>, tonic::Status> {
    match out {
        Ok(value) => Ok(tonic::Response::new(SimReply { value })),
        Err(AppError::Business) => Err(tonic::Status::internal("business")),
        Err(AppError::Idem(kind)) => Err(tonic::Status::unknown(kind)),
    }
}

/// What a gRPC client was told, read back as the other callers' answers: the code of each
/// outcome (`grpc::code`), and the message where two outcomes share a code.
fn from_grpc(out: Result<tonic::Response<SimReply>, tonic::Status>) -> Result<u64, AppError> {
    use tonic::Code;
    let status = match out {
        Ok(reply) => return Ok(reply.into_inner().value),
        Err(status) => status,
    };
    let kind = match status.code() {
        Code::Internal if status.message() == "business" => return Err(AppError::Business),
        Code::AlreadyExists => "duplicate".to_owned(),
        Code::Aborted if status.message().starts_with("lost ownership") => {
            "lost_ownership".to_owned()
        }
        Code::Aborted => "in_progress".to_owned(),
        Code::Unavailable => "store".to_owned(),
        _ => format!("{:?}: {}", status.code(), status.message()),
    };
    Err(AppError::Idem(kind))
}

/// The item of a batch caller.
struct Item {
    key: usize,
    value: u64,
    steps: u32,
    fails: bool,
    ran: Ran,
}

/// The completions lost after their caller got `Ok` that the engine reported (the hook of
/// `idempotency::on_completion_lost`, installed once): one of the losses the law counts.
fn lost_completions() -> &'static Mutex<Vec<idempotency::CompletionLost>> {
    static LOST: Mutex<Vec<idempotency::CompletionLost>> = Mutex::new(Vec::new());
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        idempotency::on_completion_lost(|lost| LOST.lock().unwrap().push(lost.clone()));
    });
    &LOST
}

/// A batch's answers, one per item, with the item's key and whether its body ran.
fn answers(rans: Vec<(usize, Ran)>, outs: Vec<Result<u64, AppError>>) -> Vec<Answer> {
    rans.into_iter()
        .zip(outs)
        .map(|((key, ran), out)| Answer { key, ran, out })
        .collect()
}

/// Returns `Pending` `n` times (waking itself): await points where a caller can be dropped.
struct Steps(u32);

impl Future for Steps {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 == 0 {
            return Poll::Ready(());
        }
        self.0 -= 1;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// A body: waits `steps` polls (await points where it can be dropped), then applies its effect
/// and returns in the same poll, or fails without an effect.
struct Body {
    steps: u32,
    fails: bool,
    store: Arc<SimStore>,
    key: usize,
    value: u64,
    effects: Arc<Mutex<Effects>>,
    world: Arc<Mutex<World>>,
    ran: Ran,
}

impl Future for Body {
    type Output = Result<u64, AppError>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.steps > 0 {
            self.steps -= 1;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let fence = idempotency::current().expect("the body's claim").fence();
        if self.fails {
            return Poll::Ready(Err(AppError::Business));
        }
        *self.ran.lock().unwrap() = Some(fence);
        let record = ready(self.store.inner.read(&self.store.keys[self.key])).unwrap();
        let live_owner = record.is_some_and(|r| {
            r.fence == fence
                && matches!(r.state, RecordState::InProgress { lease_left } if lease_left > Duration::ZERO)
        });
        let mut effects = self.effects.lock().unwrap();
        effects.applied[self.key] += 1;
        effects.by_live_owner[self.key] += u32::from(live_owner);
        effects.values[self.key].insert(self.value);
        self.world
            .lock()
            .unwrap()
            .ok_fences
            .entry(self.key)
            .or_default()
            .insert(fence);
        Poll::Ready(Ok(self.value))
    }
}

// ---------------------------------------------------------------------------------------
// One schedule.

struct Outcome {
    violations: Vec<String>,
    trace: Vec<String>,
}

fn run_schedule(choices: &mut Choices, traced: bool) -> Outcome {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(schedule(choices, traced))
}

async fn schedule(choices: &mut Choices, traced: bool) -> Outcome {
    lost_completions().lock().unwrap().clear();
    let world = Arc::new(Mutex::new(World {
        trace: traced.then(Vec::new),
        ..World::default()
    }));
    let n_keys = 1 + choices.pick(2) as usize;
    let mut keys: Vec<Key> = (0..n_keys)
        .map(|i| Key::new("sim", 1, &[&(i as u64)]).unwrap())
        .collect();
    // Then as many keys of HTTP requests (`POST /sim/<j>` with `Idempotency-Key: k<j>`, from
    // the caller `sim`), as the layer makes them: `http:v2:{hashed caller, client key}`.
    let http_scope = http_scope();
    keys.extend((0..n_keys).map(|j| {
        let parts: [&dyn KeyPart; 2] = [&http_scope, &format!("k{j}")];
        Key::new("http", 2, &parts).unwrap()
    }));
    // Then as many keys of unary gRPC calls through `grpc::IdempotencyLayer` (metadata
    // `idempotency-key: k<j>`, from the same caller): `grpc:v1:{hashed caller, client key}`.
    keys.extend((0..n_keys).map(|j| {
        let parts: [&dyn KeyPart; 2] = [&http_scope, &format!("k{j}")];
        Key::new("grpc", 1, &parts).unwrap()
    }));
    let origin = tokio::time::Instant::now();
    let reads_with_claims = choices.chance(1, 2);
    // The front layer, used by schedules whose callers go through a `TieredStore`.
    let front = Arc::new(SimStore {
        inner: MemoryStore::with_clock(TokioClock { origin }),
        world: world.clone(),
        keys: keys.clone(),
        is_front: true,
        front: None,
        reads_with_claims,
    });
    let store = Arc::new(SimStore {
        inner: MemoryStore::with_clock(TokioClock { origin }),
        world: world.clone(),
        keys: keys.clone(),
        is_front: false,
        front: Some(front.clone()),
        reads_with_claims,
    });
    let shared: SharedStore = store.clone();
    let with_done = choices.chance(1, 3);
    let effects = Arc::new(Mutex::new(Effects {
        applied: vec![0; keys.len()],
        by_live_owner: vec![0; keys.len()],
        values: vec![BTreeSet::new(); keys.len()],
    }));
    let log = |line: String| world.lock().unwrap().log(|| line);
    log(format!(
        "keys={n_keys} done_check={with_done} reads_with_claims={reads_with_claims}"
    ));
    // HTTP layers look for a request's record under the previous key layout, and the first
    // HTTP key may have one, completed before an upgrade: no request of it may run.
    let previous_layout = choices.chance(1, 2);
    let seeded = (previous_layout && choices.chance(1, 2)).then_some(n_keys);
    if seeded.is_some() {
        let parts: [&dyn KeyPart; 4] = [&http_scope, &"POST", &"/sim/0", &"k0"];
        let previous = Key::new("http", 1, &parts).unwrap();
        let hour = Duration::from_secs(3600);
        let owner = ClaimRequest::new(previous.clone(), Token::generate(), hour, hour);
        assert!(matches!(
            ready(store.inner.claim(&owner)),
            Ok(Claim::Acquired { .. })
        ));
        let done = Completion::new(None, hour);
        assert!(ready(store.inner.complete(&previous, &owner.token, &done)).unwrap());
    }
    log(format!(
        "previous_layout={previous_layout} seeded={seeded:?}"
    ));

    let with_hold = choices.chance(1, 4);
    let lock_keys: Vec<Key> = (0..2u64)
        .map(|i| Key::new("simlock", 1, &[&i]).unwrap())
        .collect();
    let combined = choices.chance(1, 4);
    let tiered = !combined && choices.chance(1, 3);
    let engine_store: SharedStore = if combined {
        // Batches without a lease to go by (releases) wait at most a lease, so that quiescing
        // (twice a lease of quiet) sees them through.
        let combining = CombiningStore::new(store.clone(), 1 + choices.pick(2) as usize);
        Arc::new(combining.batch_timeout(LEASE))
    } else if tiered {
        Arc::new(TieredStore::new(front.clone(), store.clone()))
    } else {
        shared.clone()
    };
    // An operator reaches the store the callers use: both layers of a tiered one.
    let operator_store: Arc<dyn OperatorStore> = if tiered {
        Arc::new(TieredStore::new(
            Arc::new(OperatorView(front.clone())),
            Arc::new(OperatorView(store.clone())),
        ))
    } else {
        Arc::new(OperatorView(store.clone()))
    };
    log(format!(
        "hold={with_hold} combining={combined} tiered={tiered}"
    ));
    let body = {
        let (store, effects, world) = (store.clone(), effects.clone(), world.clone());
        move |key: usize, value: u64, steps: u32, fails: bool, ran: &Ran| Body {
            steps,
            fails,
            store: store.clone(),
            key,
            value,
            effects: effects.clone(),
            world: world.clone(),
            ran: ran.clone(),
        }
    };

    let n_callers = 2 + choices.pick(4) as usize;
    let mut waiting: Vec<Caller> = Vec::new();
    for i in 0..n_callers {
        let guard = Idempotency::new(TTL)
            .lease(LEASE)
            .store(engine_store.clone());
        let hold = |_: &AppError| OnError::Hold;
        let mut rans_of: Vec<(usize, Ran)> = Vec::new();
        let mut detached = None;
        let future: Pin<Box<dyn Future<Output = Vec<Answer>>>> = match choices.pick(14) {
            // A batch of one or two keys.
            5 | 6 => {
                let first = choices.pick(n_keys as u32) as usize;
                let mut item_keys = vec![first];
                if n_keys > 1 && choices.chance(1, 2) {
                    item_keys.push((first + 1) % n_keys);
                }
                let items: Vec<(Key, Item)> = item_keys
                    .iter()
                    .enumerate()
                    .map(|(n, &key)| {
                        let item = Item {
                            key,
                            value: (1000 + i * 10 + n) as u64,
                            steps: choices.pick(4),
                            fails: choices.chance(1, 5),
                            ran: Arc::new(Mutex::new(None)),
                        };
                        (keys[key].clone(), item)
                    })
                    .collect();
                let rans: Vec<(usize, Ran)> = items
                    .iter()
                    .map(|(_, item)| (item.key, item.ran.clone()))
                    .collect();
                rans_of.clone_from(&rans);
                let handler = {
                    let body = body.clone();
                    move |item: Item| body(item.key, item.value, item.steps, item.fails, &item.ran)
                };
                let mut batch = guard.batch::<Item, Result<u64, AppError>>().replay();
                if with_hold {
                    batch = batch.on_error(hold);
                }
                log(format!("caller {i}: batch of keys {item_keys:?}"));
                if with_done {
                    let effects = effects.clone();
                    let batch = batch.done(move |item: &Item| {
                        let done = effects.lock().unwrap().applied[item.key] > 0;
                        async move { Ok::<_, AppError>(done) }
                    });
                    Box::pin(async move {
                        let outs = batch.run(items, handler).await;
                        answers(rans, outs)
                    })
                } else {
                    Box::pin(async move {
                        let outs = batch.run(items, handler).await;
                        answers(rans, outs)
                    })
                }
            }
            // An operator's action on an operation key, through the store itself.
            7 | 9 => {
                let at = choices.pick(keys.len() as u32) as usize;
                let key = keys[at].clone();
                let prefix = ["sim", "http", "grpc"][at / n_keys];
                let action = choices.pick(4);
                let admin = Admin::new(operator_store.clone()).timeout(LEASE);
                log(format!("caller {i}: operator action {action} on {key}"));
                Box::pin(async move {
                    match action {
                        0 => {
                            if let Ok(Some(seen)) = admin.inspect(&key).await {
                                let _ = admin.force_release(&key, seen.fence).await;
                            }
                        }
                        1 => drop(admin.delete(&key).await),
                        2 => drop(admin.purge(prefix).await),
                        _ => drop(admin.unhold(&key).await),
                    }
                    Vec::new()
                })
            }
            // A lock holder: while its guard says the lock is held, the store must agree.
            8 => {
                let lock_key = lock_keys[choices.pick(2) as usize].clone();
                let locks = Lock::new(engine_store.clone(), LEASE);
                let (steps, unlock) = (choices.pick(4), choices.chance(1, 2));
                let (store, world) = (store.clone(), world.clone());
                log(format!("caller {i}: lock {lock_key}"));
                Box::pin(async move {
                    let Ok(Some(held)) = locks.try_lock(lock_key.clone()).await else {
                        return Vec::new();
                    };
                    Steps(steps).await;
                    let fence = held.fence();
                    if !held.is_lost() {
                        let record = ready(store.inner.read(&lock_key)).unwrap();
                        let live = record.is_some_and(|r| {
                            r.fence == fence
                                && matches!(r.state, RecordState::InProgress { lease_left } if !lease_left.is_zero())
                        });
                        if !live {
                            world.lock().unwrap().violations.push(format!(
                                "the holder of `{lock_key}` (fence {fence}) believes it holds a lock the store says it does not"
                            ));
                        }
                    }
                    if unlock {
                        let _ = held.unlock().await;
                    }
                    Vec::new()
                })
            }
            // A gRPC method behind the real `grpc::DetachLayer`: the same engine, a prost
            // reply, errors as `Status`; dropped once started, it runs on in the layer's task.
            4 => {
                let key = choices.pick(n_keys as u32) as usize;
                let ran: Ran = Arc::new(Mutex::new(None));
                let body = body(key, i as u64, choices.pick(4), choices.chance(1, 5), &ran);
                let body = async move { to_grpc(body.await) };
                type Method = Result<tonic::Response<SimReply>, tonic::Status>;
                let mut op = guard.operation::<Method>(keys[key].clone()).replay_grpc();
                if with_hold {
                    op = op.on_error(|_: &tonic::Status| OnError::Hold);
                }
                log(format!("caller {i}: gRPC call on key {key}"));
                rans_of.push((key, ran.clone()));
                let ended = Arc::new(Mutex::new(None));
                detached = Some(Detached::Grpc(ended.clone()));
                let method: Pin<Box<dyn Future<Output = Method> + Send>> = if with_done {
                    let effects = effects.clone();
                    let op = op.done(move || {
                        let done = effects.lock().unwrap().applied[key] > 0;
                        async move { Ok::<_, tonic::Status>(done) }
                    });
                    Box::pin(op.run_with(|_| body))
                } else {
                    Box::pin(op.run_with(|_| body))
                };
                // The server's call: the method, its answer kept where the checks read it
                // whether or not its client is still there.
                let mut method = Some(method);
                let server = tower::service_fn(move |()| {
                    let method = method.take().expect("one call");
                    let ended = ended.clone();
                    async move {
                        let out = from_grpc(method.await);
                        *ended.lock().unwrap() = Some(out.clone());
                        Ok::<_, Infallible>(out)
                    }
                });
                let call = DetachLayer::new().layer(server).oneshot(());
                Box::pin(async move {
                    let Ok(out) = call.await;
                    vec![Answer { key, ran, out }]
                })
            }
            // An HTTP request through the real `http::IdempotencyLayer`, its handler the body:
            // `201` with the value, or `500` (its key given back). Dropped once started, its
            // run goes on in the layer's task.
            10 | 11 => {
                let j = choices.pick(n_keys as u32) as usize;
                let key = n_keys + j;
                let ran: Ran = Arc::new(Mutex::new(None));
                let (steps, fails) = (choices.pick(4), choices.chance(1, 5));
                // Another body under the same key now and then: `422`, and nothing runs.
                let payload = if choices.chance(1, 6) { "other" } else { "" };
                // Now and then a streamed response: its head and first frame go out while
                // the handler's second frame waits on an await point, where the client may
                // leave; the key completes once the body ended or its client left.
                let streamed = choices.chance(1, 3).then(|| choices.pick(3));
                let handler = {
                    let (body, ran) = (body.clone(), ran.clone());
                    tower::service_fn(move |_: http::Request<axum::body::Body>| {
                        let body = body(key, i as u64, steps, fails, &ran);
                        async move {
                            let (status, text) = match body.await {
                                Ok(value) => (201, value.to_string()),
                                Err(_) => (500, "business".to_owned()),
                            };
                            let body = match streamed {
                                Some(pause) => axum::body::Body::from_stream(frames(text, pause)),
                                None => axum::body::Body::from(text),
                            };
                            let response =
                                http::Response::builder().status(status).body(body).unwrap();
                            Ok::<_, Infallible>(response)
                        }
                    })
                };
                let layer =
                    IdempotencyLayer::new(guard, |_: &http::request::Parts| Some("sim".to_owned()))
                        .previous_layout(previous_layout);
                detached = Some(Detached::Http(layer.clone()));
                let request = http::Request::post(format!("/sim/{j}"))
                    .header("idempotency-key", format!("k{j}"))
                    .body(axum::body::Body::from(payload))
                    .unwrap();
                log(format!(
                    "caller {i}: HTTP request on key {key} body {payload:?} streamed {streamed:?}"
                ));
                rans_of.push((key, ran.clone()));
                let call = layer.layer(handler).oneshot(request);
                let seeded = seeded == Some(key);
                Box::pin(async move {
                    let Ok(response) = call.await;
                    let out = from_http(response, seeded).await;
                    vec![Answer { key, ran, out }]
                })
            }
            // A unary gRPC call through the real `grpc::IdempotencyLayer`, keyed by its
            // metadata, to a real tonic handler of the body, from a real tonic client: the
            // reply's message, or `INTERNAL` (its key given back). Dropped once started, its
            // call goes on in the layer's task.
            12 | 13 => {
                let j = choices.pick(n_keys as u32) as usize;
                let key = 2 * n_keys + j;
                let ran: Ran = Arc::new(Mutex::new(None));
                let (steps, fails) = (choices.pick(4), choices.chance(1, 5));
                // Another message under the same key now and then: `INVALID_ARGUMENT`.
                let payload = if choices.chance(1, 6) { "other" } else { "" };
                let handler = {
                    let (body, ran) = (body.clone(), ran.clone());
                    tower::service_fn(move |call: http::Request<tonic::body::Body>| {
                        let method = SimMethod(Some(body(key, i as u64, steps, fails, &ran)));
                        async move {
                            let mut server =
                                tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                            Ok::<_, Infallible>(server.unary(method, call).await)
                        }
                    })
                };
                let layer =
                    idempotency::grpc::IdempotencyLayer::new(guard, |_: &http::request::Parts| {
                        Some("sim".to_owned())
                    });
                detached = Some(Detached::GrpcLayer(layer.clone()));
                let mut request = tonic::Request::new(SimRequest {
                    payload: payload.to_owned(),
                });
                request
                    .metadata_mut()
                    .insert("idempotency-key", format!("k{j}").parse().unwrap());
                log(format!(
                    "caller {i}: gRPC layer call on key {key} message {payload:?}"
                ));
                rans_of.push((key, ran.clone()));
                let mut client = tonic::client::Grpc::new(layer.layer(handler));
                Box::pin(async move {
                    client.ready().await.unwrap();
                    let path = http::uri::PathAndQuery::from_static("/sim.Sim/Call");
                    let codec = tonic_prost::ProstCodec::default();
                    let out = from_grpc(client.unary(request, path, codec).await);
                    vec![Answer { key, ran, out }]
                })
            }
            // A single call.
            _ => {
                let key = choices.pick(n_keys as u32) as usize;
                let ran: Ran = Arc::new(Mutex::new(None));
                let body = body(key, i as u64, choices.pick(4), choices.chance(1, 5), &ran);
                let mut op = guard.operation(keys[key].clone()).replay();
                if with_hold {
                    op = op.on_error(hold);
                }
                log(format!("caller {i}: key {key}"));
                rans_of.push((key, ran.clone()));
                let answer = move |out| vec![Answer { key, ran, out }];
                if with_done {
                    let effects = effects.clone();
                    let op = op.done(move || {
                        let done = effects.lock().unwrap().applied[key] > 0;
                        async move { Ok::<_, AppError>(done) }
                    });
                    Box::pin(async move { answer(op.run_with(|_| body).await) })
                } else {
                    Box::pin(async move { answer(op.run_with(|_| body).await) })
                }
            }
        };
        waiting.push(Caller {
            future,
            detached,
            started: false,
            rans: rans_of,
        });
    }
    let mut live: Vec<(usize, Caller)> = Vec::new();
    // Callers whose client left after their call started, which runs on in its layer's task:
    // the caller, its keys and how its call is seen to end.
    type Left = (usize, Vec<(usize, Ran)>, Detached);
    let mut left: Vec<Left> = Vec::new();
    let mut next_caller = 0usize;

    let check_answer = |i: usize, answer: &Answer| -> Option<String> {
        let effects = effects.lock().unwrap();
        let ran = answer.ran.lock().unwrap().is_some();
        let key = answer.key;
        match &answer.out {
            Ok(v) if !ran && !effects.values[key].contains(v) => Some(format!(
                "caller {i} got replayed value {v} that no body of key {key} returned"
            )),
            Err(AppError::Idem(kind)) if kind == "duplicate" && effects.applied[key] == 0 => Some(
                format!("caller {i} was told duplicate before any effect of key {key}"),
            ),
            _ => None,
        }
    };

    // Polls caller `at` once; when it answers, checks the answers and removes it.
    let poll_caller = |live: &mut Vec<(usize, Caller)>, at: usize| -> bool {
        let (i, caller) = &mut live[at];
        caller.started = true;
        let Poll::Ready(answers) = caller
            .future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        else {
            return false;
        };
        for answer in &answers {
            log(format!(
                "caller {i} answered key {}: {:?}",
                answer.key, answer.out
            ));
            if let Some(v) = check_answer(*i, answer) {
                world.lock().unwrap().violations.push(v);
            }
            let ran = *answer.ran.lock().unwrap();
            if let (Err(AppError::Idem(kind)), Some(fence)) = (&answer.out, ran) {
                if kind == "lost_ownership" {
                    let mut world = world.lock().unwrap();
                    world.losers.entry(answer.key).or_default().insert(fence);
                }
            }
        }
        if answers.is_empty() {
            log(format!("caller {i} finished"));
        }
        live.remove(at);
        true
    };

    let steps = 20 + choices.pick(100);
    for _ in 0..steps {
        match choices.pick(17) {
            // Start the next caller.
            0 | 1 if next_caller < waiting.len() => {
                let caller = waiting.remove(0);
                live.push((next_caller, caller));
                log(format!("start caller {next_caller}"));
                next_caller += 1;
            }
            // Poll a caller.
            0..=5 if !live.is_empty() => {
                let at = choices.pick(live.len() as u32) as usize;
                if !poll_caller(&mut live, at) {
                    log(format!("poll caller {}: pending", live[at].0));
                }
            }
            // Drop a caller at its current await point.
            6 if !live.is_empty() => {
                let at = choices.pick(live.len() as u32) as usize;
                let (i, caller) = live.remove(at);
                if let (true, Some(detached)) = (caller.started, caller.detached) {
                    // Its client left: the layer moves its call to a task of its own, where
                    // it must run to its end.
                    log(format!("the client of caller {i} left"));
                    drop(caller.future);
                    left.push((i, caller.rans, detached));
                    continue;
                }
                log(format!("drop caller {i}"));
                let mut world = world.lock().unwrap();
                for (key, ran) in &caller.rans {
                    if let Some(fence) = *ran.lock().unwrap() {
                        world.losers.entry(*key).or_default().insert(fence);
                    }
                }
            }
            // End a store command.
            7..=11 => {
                let unsettled = store.unsettled();
                if !unsettled.is_empty() {
                    let index = unsettled[choices.pick(unsettled.len() as u32) as usize];
                    let fault = match choices.pick(20) {
                        0 | 1 => 1,
                        2 | 3 => 2,
                        4 => 3,
                        5 => 4,
                        6 => 5,
                        7 => 6,
                        _ => 0,
                    };
                    store.end(index, fault);
                }
            }
            // Let background tasks run.
            12 | 13 => {
                tokio::task::yield_now().await;
            }
            // The front layer of a tiered store loses its data (a restart, an eviction, a
            // failover to a replica that had not caught up).
            16 if tiered => {
                log("the front layer loses its data".into());
                front.inner.clear();
            }
            // Move the clock.
            _ => {
                let by = match choices.pick(4) {
                    0 => Duration::from_millis(1),
                    1 => LEASE / 2,
                    2 => LEASE + Duration::from_millis(1),
                    _ => Duration::from_millis(20),
                };
                log(format!("clock +{by:?}"));
                tokio::time::advance(by).await;
            }
        }
    }

    // Quiesce: no more faults; every caller left runs to its end, background tasks finish.
    log("quiesce".into());
    let mut quiet = 0;
    for _ in 0..1000 {
        let mut active = !store.unsettled().is_empty();
        for at in (0..live.len()).rev() {
            active |= poll_caller(&mut live, at);
        }
        for index in store.unsettled() {
            store.end(index, 0);
        }
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        // Quiet for longer than any backoff of a background task: everything has landed.
        quiet = if active || !live.is_empty() {
            0
        } else {
            quiet + 1
        };
        if quiet > 2 * LEASE.as_millis() / 10 {
            break;
        }
        tokio::time::advance(Duration::from_millis(10)).await;
    }
    if !live.is_empty() {
        let ids: Vec<usize> = live.iter().map(|(i, _)| *i).collect();
        world.lock().unwrap().violations.push(format!(
            "callers {ids:?} never answered, though every command was answered"
        ));
    }
    // One lease later, nothing may be in progress.
    tokio::time::advance(LEASE + Duration::from_millis(1)).await;
    for _ in 0..4 {
        tokio::task::yield_now().await;
    }

    let mut ends = Vec::new();
    for (_, _, detached) in &left {
        ends.push(detached.ended().await);
    }
    let mut world_guard = world.lock().unwrap();
    let effects = effects.lock().unwrap();
    for ((i, rans, _), (ended, lost)) in left.iter().zip(ends) {
        if !ended {
            world_guard.violations.push(format!(
                "the call of caller {i}, whose client left, never ended"
            ));
        }
        for (key, ran) in rans.iter().filter(|_| lost) {
            if let Some(fence) = *ran.lock().unwrap() {
                world_guard.losers.entry(*key).or_default().insert(fence);
            }
        }
    }
    // The key completed under the previous layout never runs, unless an operator deleted
    // that record (it is the only record without a key of this schedule's).
    if let Some(key) = seeded {
        let deleted = world_guard.rerun_by_operator.contains_key(&usize::MAX);
        if effects.applied[key] > 0 && !deleted {
            world_guard.violations.push(format!(
                "`{}` ran {} times though its request was completed before the upgrade",
                keys[key], effects.applied[key]
            ));
        }
    }
    for lost in lost_completions().lock().unwrap().drain(..) {
        let at = keys
            .iter()
            .position(|k| *k == lost.key)
            .unwrap_or(usize::MAX);
        world_guard.losers.entry(at).or_default().insert(lost.fence);
    }
    for (i, key) in keys.iter().enumerate() {
        let applied = effects.applied[i];
        let refused = world_guard.losers.get(&i).map_or(0, BTreeSet::len) as u32;
        let rerun = world_guard.rerun_by_operator.get(&i).copied().unwrap_or(0) as u32;
        let by_live_owner = effects.by_live_owner[i];
        // HTTP requests have no business check but the previous layout's record.
        if with_done && i < n_keys && by_live_owner > 1 {
            world_guard.violations.push(format!(
                "`{key}`: {by_live_owner} effects by live owners with a done check"
            ));
        }
        if applied > 1 + refused + rerun {
            world_guard.violations.push(format!(
                "`{key}`: {applied} effects but only {refused} losses reported and {rerun} records an operator deleted"
            ));
        }
        let mut read = store.inner.read(key);
        let record = match read.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(r) => r.unwrap(),
            Poll::Pending => None,
        };
        if let Some(record) = record {
            if let RecordState::InProgress { lease_left } = record.state {
                // A claim the store applied and never answered has no one to give it back:
                // its lease running out is all that frees the key.
                if !lease_left.is_zero() || !world_guard.applied_unanswered.contains(&i) {
                    world_guard.violations.push(format!(
                        "`{key}` is still in progress after every caller left and a lease passed"
                    ));
                }
            }
        }
    }
    Outcome {
        violations: std::mem::take(&mut world_guard.violations),
        trace: world_guard.trace.take().unwrap_or_default(),
    }
}

/// Shrinks a failing list of choices: drops chunks, then lowers values, while it still fails.
fn shrink(mut choices: Vec<u32>) -> Vec<u32> {
    let fails = |c: &[u32]| {
        !run_schedule(&mut Choices::replaying(c.to_vec()), false)
            .violations
            .is_empty()
    };
    let mut chunk = choices.len() / 2;
    while chunk >= 1 {
        let mut start = 0;
        while start + chunk <= choices.len() {
            let mut candidate = choices.clone();
            candidate.drain(start..start + chunk);
            if fails(&candidate) {
                choices = candidate;
            } else {
                start += chunk;
            }
        }
        chunk /= 2;
    }
    for i in 0..choices.len() {
        while choices[i] > 0 {
            let mut candidate = choices.clone();
            candidate[i] -= 1;
            if fails(&candidate) {
                choices = candidate;
            } else {
                break;
            }
        }
    }
    choices
}

#[test]
fn engine_keeps_its_invariants_under_every_schedule() {
    let started = std::time::Instant::now();
    if let Ok(seed) = std::env::var("SIM_SEED") {
        let seed: u64 = seed.parse().expect("SIM_SEED is a number");
        let outcome = run_schedule(&mut Choices::seeded(seed), true);
        for line in &outcome.trace {
            println!("{line}");
        }
        assert!(
            outcome.violations.is_empty(),
            "seed {seed}: {:#?}",
            outcome.violations
        );
        return;
    }
    let schedules: u64 = match std::env::var("SIM_SCHEDULES") {
        Ok(n) => n.parse().expect("SIM_SCHEDULES is a number"),
        Err(_) if cfg!(debug_assertions) => 2_000,
        Err(_) => 100_000,
    };
    let base: u64 = std::env::var("SIM_BASE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED);
    let mut violations = 0u64;
    let mut ran = 0u64;
    for n in 0..schedules {
        ran += 1;
        let seed = base.wrapping_add(n);
        let mut choices = Choices::seeded(seed);
        let outcome = run_schedule(&mut choices, false);
        if !outcome.violations.is_empty() {
            violations += 1;
            let shrunk = shrink(choices.taken.clone());
            let replay = run_schedule(&mut Choices::replaying(shrunk.clone()), true);
            println!("violation with seed {seed} (replay: SIM_SEED={seed}):");
            for v in &outcome.violations {
                println!("  {v}");
            }
            println!("shrunk schedule ({} choices): {shrunk:?}", shrunk.len());
            for line in &replay.trace {
                println!("{line}");
            }
            for v in &replay.violations {
                println!("  shrunk: {v}");
            }
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    println!("schedules={ran} violations={violations} seconds={seconds:.1}");
    assert_eq!(
        violations, 0,
        "the engine broke an invariant; see the schedule above"
    );
}
