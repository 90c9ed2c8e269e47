//! A record row as every dialect returns it, and the shared reading of a claim's outcome.

use std::time::Duration;

use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::error::{StoreError, StoreErrorKind};
use crate::store::{
    claim_answer, Claim, ClaimAnswer, ClaimRequest, Fingerprint, Record, RecordState, Token,
};

/// The record columns every statement that returns a record selects, in this order:
/// `state, token, fence, fingerprint, result, lease_left` (`lease_left` in the dialect's
/// tick, never negative, computed by the database from its own clock), and, for the reads
/// an operator sees, `age, expires_in` after them (in ticks too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordRow {
    pub(crate) state: String,
    pub(crate) token: Vec<u8>,
    pub(crate) fence: i64,
    pub(crate) fingerprint: Option<Vec<u8>>,
    pub(crate) result: Option<Vec<u8>>,
    pub(crate) lease_left: i64,
    pub(crate) age: Option<i64>,
    pub(crate) expires_in: Option<i64>,
}

impl RecordRow {
    /// Decodes a listed row: the `record_key` column, then the record columns with age and
    /// expiry. A record whose columns do not decode is that key's error, not the page's.
    pub(crate) fn decode_listed<R>(
        row: &R,
    ) -> Result<(Vec<u8>, Result<RecordRow, sqlx::Error>), sqlx::Error>
    where
        R: Row,
        usize: ColumnIndex<R>,
        String: for<'r> Decode<'r, R::Database> + Type<R::Database>,
        Vec<u8>: for<'r> Decode<'r, R::Database> + Type<R::Database>,
        i64: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    {
        let key = row.try_get(0)?;
        Ok((key, RecordRow::decode_from(row, 1)))
    }

    /// Decodes the six record columns of `row`.
    pub(crate) fn decode<R>(row: &R) -> Result<RecordRow, sqlx::Error>
    where
        R: Row,
        usize: ColumnIndex<R>,
        String: for<'r> Decode<'r, R::Database> + Type<R::Database>,
        Vec<u8>: for<'r> Decode<'r, R::Database> + Type<R::Database>,
        i64: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    {
        RecordRow::decode_from(row, 0)
    }

    /// Decodes a batch row: the `record_key` column, then the six record columns. A record
    /// whose columns do not decode is that key's answer ([`Step::Unreadable`]), not the
    /// batch's.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    pub(crate) fn decode_keyed<R>(row: &R) -> Result<(Vec<u8>, Step), sqlx::Error>
    where
        R: Row,
        usize: ColumnIndex<R>,
        String: for<'r> Decode<'r, R::Database> + Type<R::Database>,
        Vec<u8>: for<'r> Decode<'r, R::Database> + Type<R::Database>,
        i64: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    {
        let key = row.try_get(0)?;
        let step = match RecordRow::decode_from(row, 1) {
            Ok(record) => Step::Seen(Some(record)),
            Err(err) => Step::Unreadable(err),
        };
        Ok((key, step))
    }

    fn decode_from<R>(row: &R, first: usize) -> Result<RecordRow, sqlx::Error>
    where
        R: Row,
        usize: ColumnIndex<R>,
        String: for<'r> Decode<'r, R::Database> + Type<R::Database>,
        Vec<u8>: for<'r> Decode<'r, R::Database> + Type<R::Database>,
        i64: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    {
        Ok(RecordRow {
            state: row.try_get(first)?,
            token: row.try_get(first + 1)?,
            fence: row.try_get(first + 2)?,
            fingerprint: row.try_get(first + 3)?,
            result: row.try_get(first + 4)?,
            lease_left: row.try_get(first + 5)?,
            // Only the operator's reads select them.
            age: row.try_get(first + 6).ok(),
            expires_in: row.try_get(first + 7).ok(),
        })
    }
}

/// A record's state, as stored in the `state` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    InProgress,
    Completed,
    Released,
}

/// A decoded record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stored {
    pub(crate) state: State,
    pub(crate) token: Token,
    pub(crate) fence: u64,
    pub(crate) fingerprint: Option<Fingerprint>,
    pub(crate) result: Option<Vec<u8>>,
    /// Time left on the lease; zero once it ran out.
    pub(crate) lease_left: Duration,
    pub(crate) age: Option<Duration>,
    pub(crate) expires_in: Option<Duration>,
}

impl Stored {
    /// Checks and converts a row; `tick` is the unit of `lease_left`.
    pub(crate) fn from_row(row: RecordRow, tick: Duration) -> Result<Stored, StoreError> {
        let state = match row.state.as_str() {
            "in_progress" => State::InProgress,
            "completed" => State::Completed,
            "released" => State::Released,
            other => return Err(corrupt(format!("unknown record state {other:?}"))),
        };
        let token = Token::from_bytes(sixteen(&row.token, "token")?);
        let fingerprint = match &row.fingerprint {
            Some(bytes) => Some(Fingerprint::from_bytes(sixteen(bytes, "fingerprint")?)),
            None => None,
        };
        let fence = u64::try_from(row.fence)
            .map_err(|_| corrupt(format!("negative fence {}", row.fence)))?;
        let tick_nanos = u64::try_from(tick.as_nanos()).unwrap_or(u64::MAX);
        let duration = |ticks: i64| {
            Duration::from_nanos(tick_nanos.saturating_mul(u64::try_from(ticks).unwrap_or(0)))
        };
        Ok(Stored {
            state,
            token,
            fence,
            fingerprint,
            result: row.result,
            lease_left: duration(row.lease_left),
            age: row.age.map(duration),
            expires_in: row.expires_in.map(duration),
        })
    }

    /// The record as [`Store::read`](crate::Store::read) returns it.
    pub(crate) fn into_record(self) -> Record {
        let state = match self.state {
            State::InProgress => RecordState::InProgress {
                lease_left: self.lease_left,
            },
            State::Completed => RecordState::Completed,
            State::Released => RecordState::Released,
        };
        let result = match self.state {
            State::Completed => self.result,
            _ => None,
        };
        Record::new(state, self.token, self.fence)
            .with_fingerprint(self.fingerprint)
            .with_result(result)
            .with_age(self.age)
            .with_expires_in(self.expires_in)
    }
}

/// What a claim statement reports.
#[derive(Debug)]
pub enum Step {
    /// The statement took the key for the request's token, with this fence.
    Acquired(u64),
    /// The key's record as the statement found it (after its write, if it wrote), or `None`
    /// when there was no live record to report.
    Seen(Option<RecordRow>),
    /// The key's record row, whose columns did not decode (a batch reports it per key).
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    Unreadable(sqlx::Error),
}

impl Step {
    /// A key taken with the fence a statement returned: unreadable if it is negative.
    #[cfg(feature = "postgres")]
    pub(crate) fn taken(fence: i64) -> Step {
        match u64::try_from(fence) {
            Ok(fence) => Step::Acquired(fence),
            Err(_) => Step::Unreadable(sqlx::Error::Decode(
                format!("fence {fence} is negative").into(),
            )),
        }
    }
}

/// Reads a claim's outcome from the record the claim statement reported.
///
/// Returns `None` when the claim must be sent again: the reported record is free (absent,
/// released, or an in-progress record whose lease ran out) although the statement, which
/// takes free records, did not take it. That happens only when the record changed between
/// the statement's write and its report (another claim, a release, an expiry): the statement
/// applied nothing for this token, so sending it again is safe.
///
/// Every other answer is what an atomic claim at the moment of the report returns, and the
/// statement wrote nothing: a record that this token does not own and that is not free is
/// never taken by a claim.
pub(crate) fn resolve(
    step: Step,
    req: &ClaimRequest,
    tick: Duration,
) -> Result<Option<Claim>, StoreError> {
    let row = match step {
        Step::Acquired(fence) => return Ok(Some(Claim::Acquired { fence })),
        Step::Seen(None) => return Ok(None),
        Step::Seen(Some(row)) => row,
        Step::Unreadable(err) => {
            return Err(corrupt("a column does not decode".to_string()).with_source(err))
        }
    };
    Ok(
        match claim_answer(req, Stored::from_row(row, tick)?.into_record()) {
            ClaimAnswer::Answer(claim) => Some(claim),
            // Free, yet the statement did not take it: send it again.
            ClaimAnswer::TakeOver { .. } => None,
        },
    )
}

fn sixteen(bytes: &[u8], what: &str) -> Result<[u8; 16], StoreError> {
    <[u8; 16]>::try_from(bytes)
        .map_err(|_| corrupt(format!("{what} is {} bytes, expected 16", bytes.len())))
}

fn corrupt(message: String) -> StoreError {
    StoreError::new(
        StoreErrorKind::Corrupt,
        format!("corrupt idempotency record: {message}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;

    const TICK: Duration = Duration::from_micros(1);

    fn req(fingerprint: Option<Fingerprint>) -> ClaimRequest {
        ClaimRequest {
            key: Key::new("t", 1, &[&1u8]).unwrap(),
            token: Token::generate(),
            lease: Duration::from_secs(1),
            ttl: Duration::from_secs(2),
            fingerprint,
        }
    }

    fn row(state: &str, token: &Token, fp: Option<Fingerprint>, lease_left: i64) -> RecordRow {
        RecordRow {
            state: state.into(),
            token: token.as_bytes().to_vec(),
            fence: 3,
            fingerprint: fp.map(|f| f.as_bytes().to_vec()),
            result: Some(b"r".to_vec()),
            lease_left,
            age: None,
            expires_in: None,
        }
    }

    #[test]
    fn own_in_progress_record_is_acquired() {
        let r = req(None);
        let seen = Step::Seen(Some(row("in_progress", &r.token, None, 10)));
        assert_eq!(
            resolve(seen, &r, TICK).unwrap(),
            Some(Claim::Acquired { fence: 3 })
        );
    }

    #[test]
    fn others_records_answer_or_retry() {
        let r = req(Some(Fingerprint::of(&[&1u8])));
        let other = Token::generate();
        let same = r.fingerprint;
        let different = Some(Fingerprint::of(&[&2u8]));
        let cases = [
            (
                row("completed", &other, same, 0),
                Some(Claim::Completed {
                    fence: 3,
                    result: Some(b"r".to_vec()),
                }),
            ),
            (
                row("completed", &other, different, 0),
                Some(Claim::Mismatch { fence: 3 }),
            ),
            (
                row("completed", &other, None, 0),
                Some(Claim::Completed {
                    fence: 3,
                    result: Some(b"r".to_vec()),
                }),
            ),
            (
                row("in_progress", &other, same, 5),
                Some(Claim::InProgress { fence: 3 }),
            ),
            (
                row("in_progress", &other, different, 5),
                Some(Claim::Mismatch { fence: 3 }),
            ),
            // A run-out lease with another payload is not taken over (its owner may have
            // applied that payload).
            (
                row("in_progress", &other, different, 0),
                Some(Claim::Mismatch { fence: 3 }),
            ),
            // Free records that the statement did not take: send it again.
            (row("in_progress", &other, same, 0), None),
            (row("released", &other, different, 0), None),
        ];
        for (row, expected) in cases {
            let got = resolve(Step::Seen(Some(row.clone())), &r, TICK).unwrap();
            assert_eq!(got, expected, "{row:?}");
        }
        assert_eq!(resolve(Step::Seen(None), &r, TICK).unwrap(), None);
    }

    #[test]
    fn corrupt_rows_are_corrupt_errors() {
        let r = req(None);
        let mut state = row("in_progress", &r.token, None, 0);
        state.state = "done".into();
        let mut token = row("released", &r.token, None, 0);
        token.token.pop();
        let mut fence = row("released", &r.token, None, 0);
        fence.fence = -1;
        let mut fingerprint = row("in_progress", &r.token, Some(Fingerprint::of(&[&1u8])), 5);
        fingerprint.fingerprint = Some(vec![1]);
        for bad in [state, token, fence, fingerprint] {
            let err = resolve(Step::Seen(Some(bad.clone())), &r, TICK).unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::Corrupt, "{bad:?}");
        }
    }

    #[test]
    fn lease_left_is_converted_from_ticks() {
        let token = Token::generate();
        let stored = Stored::from_row(
            row("in_progress", &token, None, 1500),
            Duration::from_millis(1),
        )
        .unwrap();
        assert_eq!(
            stored.into_record().state,
            RecordState::InProgress {
                lease_left: Duration::from_millis(1500)
            }
        );
    }
}
