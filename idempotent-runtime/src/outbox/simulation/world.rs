//! The simulation's world: the outbox's rows in memory, the seeded choices of every fault, and
//! the checks made as the relays act on it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{StoreError, StoreErrorKind};
use crate::store::Token;

/// A small deterministic generator (SplitMix64).
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A duration in `0..max`, in whole milliseconds.
    pub(super) fn millis(&mut self, max: Duration) -> Duration {
        Duration::from_millis(self.below(max.as_millis() as u64 + 1))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    Pending,
    Published,
    Dead,
}

pub(super) struct Row {
    pub(super) id: String,
    pub(super) state: State,
    pub(super) attempts: u32,
    pub(super) next_at: Instant,
    pub(super) token: Option<Token>,
    pub(super) claimed_until: Option<Instant>,
    /// Written by another producer: the relay cannot read it.
    pub(super) unreadable: bool,
}

/// How a statement or a publication goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fate {
    Answered,
    Refused,
    AnswerLost,
    NeverAnswered,
    /// A publication only: the broker is unreachable.
    Unreachable,
    /// A publication only: confirmed, after the claim ran out.
    Late,
}

pub(super) struct World {
    pub(super) rows: Vec<Row>,
    pub(super) rng: Rng,
    /// Whose claim each token is.
    pub(super) owner: BTreeMap<Token16, usize>,
    /// Publications the broker confirmed: (token, row).
    pub(super) confirmed: BTreeSet<(Token16, String)>,
    /// Publications that ended without a confirmation: (token, row).
    pub(super) unconfirmed: BTreeSet<(Token16, String)>,
    pub(super) faults: bool,
    pub(super) lease: Duration,
    pub(super) violations: Vec<String>,
    pub(super) trace: Option<Vec<String>>,
}

pub(super) type Token16 = [u8; 16];

impl World {
    pub(super) fn note(&mut self, what: impl FnOnce() -> String) {
        if let Some(trace) = self.trace.as_mut() {
            trace.push(format!("{:?} {}", Instant::now(), what()));
        }
    }

    pub(super) fn fate(&mut self, publication: bool) -> Fate {
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

    pub(super) fn delay(&mut self) -> Duration {
        if !self.faults {
            return Duration::ZERO;
        }
        let most = self.lease / 4;
        self.rng.millis(most)
    }

    /// The row `id` is held by a live claim of `relay`'s: checked as a publication starts and
    /// as it ends.
    pub(super) fn check_held(&mut self, relay: usize, id: &str, when: &str) {
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

pub(super) fn lock(world: &Mutex<World>) -> MutexGuard<'_, World> {
    world
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A statement against the rows: its fate decided, applied (or not) by `apply`, answered (or
/// not) after delays.
pub(super) async fn statement<T: Send>(
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
