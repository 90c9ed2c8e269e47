//! The rule of a claim that finds a live record under its key, as one table ([`RULE`]): what
//! `store::claim_answer` decides, what the Redis script (`record.lua`, which cannot call
//! Rust) answers, and what every store answers are all held to it. [`cases`] enumerates
//! every combination of the record's state, its owner and both fingerprints, each with the
//! answer the table gives it.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::time::Duration;

use idempotency::store::{
    claim_answer, Claim, ClaimAnswer, ClaimRequest, Fingerprint, Record, RecordState, Token,
};
use idempotency::Key;

/// The state of the record a claim finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// In progress, a minute of lease left.
    Live,
    /// In progress, the lease run out a second ago.
    RunOut,
    Completed,
    Released,
}

/// Whose token the record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The claim's own token (a claim retried after a lost reply).
    Same,
    Other,
}

/// What a row says of the two fingerprints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// Both set, and different.
    Differ,
    /// Anything.
    Any,
}

/// What the claim answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// `Acquired` with the record's fence, nothing written.
    Reacquired,
    /// Taken over: `Acquired` with the record's fence + 1.
    TakenOver,
    Completed,
    InProgress,
    Mismatch,
}

/// The rule: the first row that matches a case is its answer (`None`: any owner).
pub const RULE: &[(&[Found], Option<Owner>, Payload, Want)] = &[
    (
        &[Found::Live, Found::RunOut],
        Some(Owner::Same),
        Payload::Any,
        Want::Reacquired,
    ),
    (&[Found::Completed], None, Payload::Differ, Want::Mismatch),
    (&[Found::Completed], None, Payload::Any, Want::Completed),
    (
        &[Found::Live, Found::RunOut],
        Some(Owner::Other),
        Payload::Differ,
        Want::Mismatch,
    ),
    (
        &[Found::Live],
        Some(Owner::Other),
        Payload::Any,
        Want::InProgress,
    ),
    (
        &[Found::RunOut],
        Some(Owner::Other),
        Payload::Any,
        Want::TakenOver,
    ),
    (&[Found::Released], None, Payload::Any, Want::TakenOver),
];

/// The fingerprints of a case: none, or one of two payloads.
pub fn fingerprint(n: u8) -> Option<Fingerprint> {
    (n > 0).then(|| Fingerprint::of(&[&n]))
}

/// One combination: the record found (state, owner, stored fingerprint) and the claim's
/// fingerprint, with the answer [`RULE`] gives it.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub found: Found,
    pub owner: Owner,
    /// 0: none; 1 or 2: a payload.
    pub stored: u8,
    /// 0: none; 1 or 2: a payload.
    pub given: u8,
    pub want: Want,
}

/// The stored result of a completed record in every case.
pub const RESULT: &[u8] = b"receipt";

/// Every combination, with its answer.
pub fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for found in [
        Found::Live,
        Found::RunOut,
        Found::Completed,
        Found::Released,
    ] {
        for owner in [Owner::Same, Owner::Other] {
            for stored in 0..3u8 {
                for given in 0..3u8 {
                    let differ = stored > 0 && given > 0 && stored != given;
                    let want = RULE
                        .iter()
                        .find(|(states, who, payload, _)| {
                            states.contains(&found)
                                && who.is_none_or(|who| who == owner)
                                && (*payload == Payload::Any || differ)
                        })
                        .map(|row| row.3)
                        .unwrap_or_else(|| {
                            panic!("no row of the rule covers {found:?} {owner:?} {stored} {given}")
                        });
                    cases.push(Case {
                        found,
                        owner,
                        stored,
                        given,
                        want,
                    });
                }
            }
        }
    }
    cases
}

impl Case {
    /// The claim of this case on `key`, by `token`: a minute of lease and of ttl.
    pub fn request(&self, key: &Key, token: Token) -> ClaimRequest {
        let minute = Duration::from_secs(60);
        let mut req = ClaimRequest::new(key.clone(), token, minute, minute);
        req.fingerprint = fingerprint(self.given);
        req
    }

    /// The token the record holds, for a claim by `token`.
    pub fn record_token(&self, token: Token) -> Token {
        match self.owner {
            Owner::Same => token,
            Owner::Other => Token::generate(),
        }
    }

    /// The record found, as `claim_answer` takes it.
    pub fn record(&self, token: Token, fence: u64) -> Record {
        let state = match self.found {
            Found::Live => RecordState::InProgress {
                lease_left: Duration::from_secs(60),
            },
            Found::RunOut => RecordState::InProgress {
                lease_left: Duration::ZERO,
            },
            Found::Completed => RecordState::Completed,
            Found::Released => RecordState::Released,
        };
        let result = (self.found == Found::Completed).then(|| RESULT.to_vec());
        Record::new(state, token, fence)
            .with_fingerprint(fingerprint(self.stored))
            .with_result(result)
    }

    /// What a claim answers for a record with `fence`.
    pub fn expected(&self, fence: u64) -> Claim {
        match self.want {
            Want::Reacquired => Claim::Acquired { fence },
            Want::TakenOver => Claim::Acquired { fence: fence + 1 },
            Want::Completed => Claim::Completed {
                fence,
                result: Some(RESULT.to_vec()),
            },
            Want::InProgress => Claim::InProgress { fence },
            Want::Mismatch => Claim::Mismatch { fence },
        }
    }
}

/// `claim_answer`'s answer as a claim answers it: a take-over is the acquisition it writes.
pub fn answered(answer: ClaimAnswer) -> Claim {
    match answer {
        ClaimAnswer::Answer(claim) => claim,
        ClaimAnswer::TakeOver { fence } => Claim::Acquired { fence },
        other => panic!("an answer the table does not know: {other:?}"),
    }
}

/// Holds `claim_answer` to the table, case by case.
pub fn check_claim_answer() {
    let key = Key::new("claim-rule", 1, &[&0u8]).unwrap();
    for (i, case) in cases().iter().enumerate() {
        let token = Token::generate();
        let fence = 1_000 + i as u64;
        let req = case.request(&key, token);
        let got = answered(claim_answer(
            &req,
            case.record(case.record_token(token), fence),
        ));
        assert_eq!(got, case.expected(fence), "{case:?}");
    }
}
