//! The in-memory store as a model: random sequences of operations on one key get the same
//! answers from the store under test.

use std::sync::Arc;
use std::time::Duration;

use idempotency::store::{
    AcquiredClaim, Claim, ClaimRequest, Completion, Ending, Expect, Fingerprint, OperatorStore,
    RecordState, SharedOperatorStore, StoreErrorKind, Token,
};
use idempotency::{Key, MemoryStore};

use super::{unique_prefix, OperatorBackend};

/// What a store answered, with fences counted from the key's first acquisition on that store
/// (each store takes a new key's fence from its own clock; every later acquisition is + 1).
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Claim(&'static str, i128, Option<Vec<u8>>),
    Ended(bool),
    Record(Option<SeenRecord>),
    Failed(StoreErrorKind),
}

/// A record as [`Seen`] compares it: state, relative fence, result, fingerprint, token.
type SeenRecord = (&'static str, i128, Option<Vec<u8>>, Option<[u8; 16]>, Token);

/// A small deterministic generator (xorshift64*), so that a failing sequence replays.
struct Dice(u64);

impl Dice {
    fn roll(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// One step of a sequence, as the dice chose it.
struct Step {
    op: u64,
    owner: usize,
    /// How a completion names its claim: not at all, by fence, by fence and lease, wrongly.
    naming: u64,
    result: Option<Vec<u8>>,
    fingerprint: Option<Fingerprint>,
    token: Token,
}

/// An owner of the key: its token and fingerprint, and on each store the fence it acquired.
struct Owner {
    token: Token,
    fingerprint: Option<Fingerprint>,
    fences: [Option<u64>; 2],
}

/// Random sequences of claims (each by a new owner, with one of three fingerprints; single or
/// as a batch of one), completions (by token, naming the fence, naming fence and lease,
/// naming a wrong claim; retried at random), releases, renewals, batch endings of one
/// item, an operator's reopening and deletion by token, and reads, on two keys, with batch
/// claims and batch endings of both keys at once, sent to the store under test and to a
/// fresh in-memory store: every answer is the in-memory store's. Leases and ttls are long,
/// so no answer depends on time; a store whose fast paths (a compare-and-set completion, a
/// completion by head, a native claim) answered otherwise than its general path would show
/// here as a different answer or record.
pub async fn every_sequence_is_answered_as_the_in_memory_store_answers_it(b: impl OperatorBackend) {
    let store = b.operator_store();
    let prefix = unique_prefix(&b, "model");
    // Fences of in-progress, completed and mismatch answers are compared where the store
    // reports the owner's (a tiered store answers those from its front).
    let owners_fence = b.answers_carry_the_owners_fence();
    let normal = |answer: Seen| match answer {
        Seen::Claim(kind, _, result) if !owners_fence && kind != "acquired" => {
            Seen::Claim(kind, 0, result)
        }
        other => other,
    };
    for seed in 1..=120u64 {
        let memory: SharedOperatorStore = Arc::new(MemoryStore::new());
        let stores: [&dyn OperatorStore; 2] = [store.as_ref(), memory.as_ref()];
        let mut dice = Dice(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut keys: [KeyState; 2] = [0u8, 1].map(|k| KeyState {
            key: Key::new(&prefix, 1, &[&seed, &k]).unwrap(),
            owners: Vec::new(),
            base: [None, None],
        });
        let mut trace = Vec::new();
        for step in 0..24 {
            let mut seen: [Vec<Seen>; 2] = [Vec::new(), Vec::new()];
            if dice.roll(6) == 0 {
                // Both keys in one batch: claimed by new owners, or ended by known ones.
                let steps = [0, 1].map(|k| roll(&mut dice, keys[k].owners.len()));
                let claim = keys.iter().any(|k| k.owners.is_empty()) || dice.roll(2) == 0;
                trace.push(format!("batch {}", if claim { "claim" } else { "end" }));
                if claim {
                    for (k, s) in keys.iter_mut().zip(&steps) {
                        k.owners.push(Owner {
                            token: s.token,
                            fingerprint: s.fingerprint,
                            fences: [None, None],
                        });
                    }
                }
                for (side, &on) in stores.iter().enumerate() {
                    let answers = if claim {
                        claim_both(on, side, &mut keys, &steps).await
                    } else {
                        settle_both(on, side, &keys, &steps).await
                    };
                    seen[side] = answers.into_iter().map(normal).collect();
                }
            } else {
                let k = dice.roll(2) as usize;
                let state = &mut keys[k];
                let step_now = roll(&mut dice, state.owners.len());
                trace.push(format!(
                    "{k}:{}/{}/{}",
                    step_now.op, step_now.owner, step_now.naming
                ));
                if matches!(step_now.op, 0 | 7) {
                    state.owners.push(Owner {
                        token: step_now.token,
                        fingerprint: step_now.fingerprint,
                        fences: [None, None],
                    });
                }
                for (side, &on) in stores.iter().enumerate() {
                    let answer = apply(
                        on,
                        side,
                        &state.key,
                        &step_now,
                        &mut state.owners,
                        &mut state.base,
                    )
                    .await;
                    seen[side].push(normal(answer));
                }
            }
            assert_eq!(
                seen[0], seen[1],
                "seed {seed}, step {step}: the store (left) and the in-memory store (right) \
                 differ after {trace:?} (key:op/owner/naming)"
            );
        }
    }
}

/// One key of a sequence: its owners and, on each store, the fence of its first acquisition.
struct KeyState {
    key: Key,
    owners: Vec<Owner>,
    base: [Option<u64>; 2],
}

/// Claims both keys in one batch, for the owners just added.
async fn claim_both(
    store: &dyn OperatorStore,
    side: usize,
    keys: &mut [KeyState; 2],
    steps: &[Step; 2],
) -> Vec<Seen> {
    let minute = Duration::from_secs(60);
    let reqs: Vec<ClaimRequest> = keys
        .iter()
        .zip(steps)
        .map(|(k, s)| {
            let mut req = ClaimRequest::new(k.key.clone(), s.token, minute, minute);
            req.fingerprint = s.fingerprint;
            req
        })
        .collect();
    let answers = store.claim_many(&reqs).await;
    keys.iter_mut()
        .zip(answers)
        .map(|(k, answer)| seen_claim(answer, side, &mut k.owners, &mut k.base))
        .collect()
}

/// Ends both keys in one batch: each a completion (named as its step says) or a release by
/// one of its known owners.
async fn settle_both(
    store: &dyn OperatorStore,
    side: usize,
    keys: &[KeyState; 2],
    steps: &[Step; 2],
) -> Vec<Seen> {
    let items: Vec<Ending> = keys
        .iter()
        .zip(steps)
        .map(|(k, s)| {
            let owner = &k.owners[s.owner];
            if s.op % 2 == 0 {
                Ending::release(k.key.clone(), owner.token)
            } else {
                Ending::complete(k.key.clone(), owner.token, completion(s, owner, side))
            }
        })
        .collect();
    store
        .complete_many(&items)
        .await
        .into_iter()
        .map(|answer| answer.map_or_else(|e| Seen::Failed(e.kind()), Seen::Ended))
        .collect()
}

/// The completion of `step` by `owner` on side `side`, naming its claim as the step says.
fn completion(step: &Step, owner: &Owner, side: usize) -> Completion {
    let minute = Duration::from_secs(60);
    let mut done = Completion::new(step.result.clone(), minute);
    if let Some(fence) = owner.fences[side] {
        let named = |fence| AcquiredClaim::new(fence, owner.fingerprint);
        match step.naming {
            0 => {}
            1 => done = done.for_claim(named(fence)),
            2 => done = done.for_claim(named(fence).with_lease(minute)),
            _ => done = done.for_claim(named(fence + 1).with_lease(minute)),
        }
    }
    done
}

/// A claim's answer, fences relative to the key's first acquisition on this side; an
/// acquisition is the last owner's.
fn seen_claim(
    claim: Result<Claim, idempotency::store::StoreError>,
    side: usize,
    owners: &mut [Owner],
    base: &mut [Option<u64>; 2],
) -> Seen {
    let rel = |fence: u64, base: &[Option<u64>; 2]| {
        i128::from(fence) - i128::from(base[side].unwrap_or(fence))
    };
    match claim {
        Ok(Claim::Acquired { fence }) => {
            base[side].get_or_insert(fence);
            if let Some(owner) = owners.last_mut() {
                owner.fences[side] = Some(fence);
            }
            Seen::Claim("acquired", rel(fence, base), None)
        }
        Ok(Claim::Completed { fence, result }) => {
            Seen::Claim("completed", rel(fence, base), result)
        }
        Ok(Claim::InProgress { fence }) => Seen::Claim("in progress", rel(fence, base), None),
        Ok(Claim::Mismatch { fence }) => Seen::Claim("mismatch", rel(fence, base), None),
        Ok(other) => panic!("an answer the model does not know: {other:?}"),
        Err(err) => Seen::Failed(err.kind()),
    }
}

fn roll(dice: &mut Dice, owners: usize) -> Step {
    let fingerprints = [
        None,
        Some(Fingerprint::of(&[&"EUR"])),
        Some(Fingerprint::of(&[&"USD"])),
    ];
    let results = [None, Some(b"r1".to_vec()), Some(b"receipt-2".to_vec())];
    let op = if owners == 0 { 0 } else { dice.roll(10) };
    Step {
        op,
        owner: if owners == 0 {
            0
        } else {
            dice.roll(owners as u64) as usize
        },
        naming: dice.roll(4),
        result: results[dice.roll(3) as usize].clone(),
        fingerprint: fingerprints[dice.roll(3) as usize],
        token: Token::generate(),
    }
}

/// Sends `step` to `store` (side 0: the store under test, 1: the model).
async fn apply(
    store: &dyn OperatorStore,
    side: usize,
    key: &Key,
    step: &Step,
    owners: &mut [Owner],
    base: &mut [Option<u64>; 2],
) -> Seen {
    let minute = Duration::from_secs(60);
    let rel = |fence: u64, base: &[Option<u64>; 2]| {
        i128::from(fence) - i128::from(base[side].unwrap_or(fence))
    };
    let failed = |err: idempotency::store::StoreError| Seen::Failed(err.kind());
    match step.op {
        0 | 7 => {
            let mut req = ClaimRequest::new(key.clone(), step.token, minute, minute);
            req.fingerprint = step.fingerprint;
            let claim = if step.op == 0 {
                store.claim(&req).await
            } else {
                store.claim_many(std::slice::from_ref(&req)).await.remove(0)
            };
            seen_claim(claim, side, owners, base)
        }
        1 | 2 => {
            let owner = &owners[step.owner];
            let done = completion(step, owner, side);
            let outcome = if step.op == 1 {
                store.complete(key, &owner.token, &done).await
            } else {
                let item = Ending::complete(key.clone(), owner.token, done);
                store.complete_many(&[item]).await.remove(0)
            };
            outcome.map_or_else(failed, Seen::Ended)
        }
        3 | 4 => {
            let token = owners[step.owner].token;
            let outcome = if step.op == 3 {
                store.release(key, &token).await
            } else {
                let item = Ending::release(key.clone(), token);
                store.complete_many(&[item]).await.remove(0)
            };
            outcome.map_or_else(failed, Seen::Ended)
        }
        5 => store
            .renew(key, &owners[step.owner].token, minute)
            .await
            .map_or_else(failed, Seen::Ended),
        8 => store
            .reopen(key, &owners[step.owner].token)
            .await
            .map_or_else(failed, Seen::Ended),
        9 => {
            let deleted = store
                .delete(key, Expect::Token(&owners[step.owner].token))
                .await;
            if matches!(deleted, Ok(true)) {
                // The key starts again: its next fence comes from the store's clock.
                base[side] = None;
            }
            deleted.map_or_else(failed, Seen::Ended)
        }
        _ => match store.read(key).await {
            Ok(record) => {
                // The state alone (what the HTTP layer's upgrade check asks) agrees with it.
                let completed = store.is_completed(key).await;
                let read = record
                    .as_ref()
                    .is_some_and(|r| r.state == RecordState::Completed);
                assert_eq!(
                    completed.as_ref().ok(),
                    Some(&read),
                    "side {side}: is_completed gave {completed:?}, the read {record:?}"
                );
                Seen::Record(record.map(|r| {
                    let state = match r.state {
                        RecordState::InProgress { .. } => "in progress",
                        RecordState::Completed => "completed",
                        RecordState::Released => "released",
                        _ => "other",
                    };
                    // A released record's fingerprint decides nothing: some stores keep it,
                    // Redis does not.
                    let fingerprint = r
                        .fingerprint
                        .filter(|_| state != "released")
                        .map(|f| *f.as_bytes());
                    (state, rel(r.fence, base), r.result, fingerprint, r.token)
                }))
            }
            Err(err) => failed(err),
        },
    }
}
