//! The script's arguments and replies, and the record format it stores.

use std::time::Duration;

use ::redis::{Cmd, Value};

use crate::error::{StoreError, StoreErrorKind};
use crate::key::{push_decimal, Key};
use crate::store::redis::conn::Lua;
use crate::store::{
    clamped_millis, AcquiredClaim, Claim, ClaimRequest, Fingerprint, Record, RecordState, Token,
};

/// The largest fence or time a record holds: above it, Lua's numbers are not exact integers.
const MAX_EXACT: u64 = (1 << 53) - 2;

/// The claim script's call for a claim.
pub(super) fn claim_cmd(script: &Lua, req: &ClaimRequest) -> Cmd {
    let fingerprint: &[u8] = req.fingerprint.as_ref().map_or(&[], |f| f.as_bytes());
    let mut cmd = script.call(req.key.as_bytes());
    cmd.arg("claim")
        .arg(req.token.as_bytes())
        .arg(clamped_millis(req.lease))
        .arg(clamped_millis(req.record_lifetime()))
        .arg(fingerprint);
    cmd
}

pub(super) fn text(value: &Value) -> String {
    match value {
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::VerbatimString { text, .. } => text.clone(),
        // A cluster answers INFO per node: the first node speaks for the checks.
        Value::Map(entries) => entries.first().map(|(_, v)| text(v)).unwrap_or_default(),
        _ => String::new(),
    }
}

fn protocol(what: impl std::fmt::Display) -> StoreError {
    StoreError::new(
        StoreErrorKind::Protocol,
        format!("unexpected reply: {what}"),
    )
}

pub(super) fn int(value: &Value) -> Result<i64, StoreError> {
    match value {
        Value::Int(n) => Ok(*n),
        other => Err(protocol(format_args!("{other:?}"))),
    }
}

fn fence(value: Option<&Value>) -> Result<u64, StoreError> {
    let n = value.map_or(Err(protocol("missing fence")), int)?;
    u64::try_from(n).map_err(|_| protocol("negative fence"))
}

pub(super) fn decode_claim(value: Value) -> Result<Claim, StoreError> {
    let Value::Array(items) = value else {
        return Err(protocol(format_args!("{value:?}")));
    };
    let code = items
        .first()
        .map_or(Err(protocol("empty claim reply")), int)?;
    let fence = fence(items.get(1))?;
    Ok(match code {
        1 => Claim::Acquired { fence },
        2 => Claim::Completed {
            fence,
            result: match items.get(2) {
                Some(Value::BulkString(bytes)) if !bytes.is_empty() => Some(bytes.clone()),
                _ => None,
            },
        },
        3 => Claim::InProgress { fence },
        4 => Claim::Mismatch { fence },
        other => return Err(protocol(format_args!("claim code {other}"))),
    })
}

/// A record's decimal field: digits only, at most [`MAX_EXACT`].
fn number(field: &[u8]) -> Option<u64> {
    if field.is_empty() || !field.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(field)
        .ok()?
        .parse()
        .ok()
        .filter(|&n| n <= MAX_EXACT)
}

pub(super) fn decode_record(key: &Key, value: Value) -> Result<Option<Record>, StoreError> {
    let Value::Array(items) = value else {
        return Err(protocol(format_args!("{value:?}")));
    };
    let now = items.get(1).map_or(Err(protocol("missing time")), int)?;
    let bytes = match items.first() {
        Some(Value::BulkString(bytes)) => bytes,
        Some(Value::Nil) | None => return Ok(None),
        Some(other) => return Err(protocol(format_args!("{other:?}"))),
    };
    // The key's PTTL (-1: no expiry, which no record has; a script of an older release
    // does not send it).
    let expires_in = match items.get(2) {
        Some(Value::Int(ms)) => u64::try_from(*ms).ok().map(Duration::from_millis),
        _ => None,
    };
    let record = parse_record(bytes, now).ok_or_else(|| {
        StoreError::new(
            StoreErrorKind::Corrupt,
            format!("the value under `{key}` is not a record"),
        )
    })?;
    Ok(Some(record.with_expires_in(expires_in)))
}

/// Whether `value`, the reply to a `GET` of `key`, is a completed record (`Nil`: no record);
/// bytes that are not a record are [`StoreErrorKind::Corrupt`], as a read finds them.
pub(super) fn decode_completed(key: &Key, value: &Value) -> Result<bool, StoreError> {
    let bytes = match value {
        Value::BulkString(bytes) => bytes,
        Value::Nil => return Ok(false),
        other => return Err(protocol(format_args!("{other:?}"))),
    };
    // A completed record's state does not depend on the time: any instant reads it.
    let record = parse_record(bytes, 0).ok_or_else(|| {
        StoreError::new(
            StoreErrorKind::Corrupt,
            format!("the value under `{key}` is not a record"),
        )
    })?;
    Ok(record.state == RecordState::Completed)
}

/// An in-progress record in the script's format (as its `encode` writes it): owned by
/// `token`, with `fingerprint` and `fence`, claimed at `now_ms` with the lease ending at
/// `lease_end_ms`; `None` when a number is out of the script's exact range.
fn encode_in_progress(
    token: &Token,
    fingerprint: Option<&Fingerprint>,
    fence: u64,
    now_ms: u64,
    lease_end_ms: u64,
) -> Option<Vec<u8>> {
    if fence > MAX_EXACT || lease_end_ms > MAX_EXACT {
        return None;
    }
    let mut value = Vec::with_capacity(88);
    value.push(b'P');
    value.extend_from_slice(token.as_bytes());
    push_fingerprint(&mut value, fingerprint);
    push_decimal(&mut value, fence);
    value.push(b':');
    push_decimal(&mut value, lease_end_ms);
    value.push(b':');
    push_decimal(&mut value, now_ms);
    Some(value)
}

/// The in-progress record the fast claim writes for `req` with `fence` (the server's clock
/// in microseconds, as estimated): claimed at the fence's millisecond, the lease ending
/// `lease_ms` after it. Its owner can write it again from the fence and the lease alone,
/// which [`fast_completion`] does.
pub(super) fn fast_claim_record(req: &ClaimRequest, fence: u64, lease_ms: u64) -> Option<Vec<u8>> {
    let at_ms = fence / 1_000;
    encode_in_progress(
        &req.token,
        req.fingerprint.as_ref(),
        fence,
        at_ms,
        at_ms.checked_add(lease_ms)?,
    )
}

/// `ending.lua`'s three-argument completion of a claim the fast claim wrote: the record as
/// [`fast_claim_record`] wrote it for `claim` (acquired with a lease of `lease_ms`), and the
/// completed record that replaces it (what the script's own completion writes: the state,
/// the token, the fingerprint and the fence as they were, no lease, `result`). `None` for
/// numbers out of the script's exact range.
pub(super) fn fast_completion(
    token: &Token,
    claim: &AcquiredClaim,
    lease_ms: u64,
    result: &[u8],
) -> Option<(Vec<u8>, Vec<u8>)> {
    let at_ms = claim.fence / 1_000;
    let lease_end_ms = at_ms.checked_add(lease_ms)?;
    if lease_end_ms > MAX_EXACT {
        return None;
    }
    let mut claimed = in_progress_head(token, claim)?;
    let head = claimed.len();
    push_decimal(&mut claimed, lease_end_ms);
    claimed.push(b':');
    push_decimal(&mut claimed, at_ms);
    let mut completed = Vec::with_capacity(head + 2 + result.len());
    completed.push(b'C');
    completed.extend_from_slice(&claimed[1..head]);
    completed.extend_from_slice(b"0:");
    completed.extend_from_slice(result);
    Some((claimed, completed))
}

/// `ending.lua`'s release of a claim the fast claim wrote, in one buffer: the record as
/// [`fast_claim_record`] wrote it for `claim` (acquired with a lease of `lease_ms`), then the
/// released record that replaces it (what the script's own release writes: the token, no
/// fingerprint, the fence, no lease), and where the second starts. `None` for numbers out
/// of the script's exact range.
pub(super) fn fast_release(
    token: &Token,
    claim: &AcquiredClaim,
    lease_ms: u64,
) -> Option<(Vec<u8>, usize)> {
    let at_ms = claim.fence / 1_000;
    let lease_end_ms = at_ms.checked_add(lease_ms)?;
    if lease_end_ms > MAX_EXACT {
        return None;
    }
    let mut both = in_progress_head(token, claim)?;
    push_decimal(&mut both, lease_end_ms);
    both.push(b':');
    push_decimal(&mut both, at_ms);
    let released = both.len();
    both.push(b'R');
    both.extend_from_slice(token.as_bytes());
    both.push(b'-');
    push_decimal(&mut both, claim.fence);
    both.extend_from_slice(b":0:");
    Some((both, released))
}

/// The first fields of the in-progress record of `claim` owned by `token`, up to and with
/// the `:` after the fence: what `ending.lua` compares a record's head with to complete it
/// without parsing. `None` for a fence out of the script's exact range (no record has one).
pub(super) fn in_progress_head(token: &Token, claim: &AcquiredClaim) -> Option<Vec<u8>> {
    if claim.fence > MAX_EXACT {
        return None;
    }
    // Room for the fields a caller writes after it: a whole claimed record, and the
    // released record [`fast_release`] writes after that.
    let mut head = Vec::with_capacity(128);
    head.push(b'P');
    head.extend_from_slice(token.as_bytes());
    push_fingerprint(&mut head, claim.fingerprint.as_ref());
    push_decimal(&mut head, claim.fence);
    head.push(b':');
    Some(head)
}

fn push_fingerprint(value: &mut Vec<u8>, fingerprint: Option<&Fingerprint>) {
    match fingerprint {
        Some(fingerprint) => {
            value.push(b'F');
            value.extend_from_slice(fingerprint.as_bytes());
        }
        None => value.push(b'-'),
    }
}

/// A record in the script's format, read as strictly as the script reads it.
pub(super) fn parse_record(bytes: &[u8], now_ms: i64) -> Option<Record> {
    let state = *bytes.first()?;
    let token: [u8; 16] = bytes.get(1..17)?.try_into().ok()?;
    let (fingerprint, rest) = match bytes.get(17)? {
        b'F' => {
            let fp: [u8; 16] = bytes.get(18..34)?.try_into().ok()?;
            (Some(Fingerprint::from_bytes(fp)), bytes.get(34..)?)
        }
        b'-' => (None, bytes.get(18..)?),
        _ => return None,
    };
    let mut fields = rest.splitn(3, |&b| b == b':');
    let fence = number(fields.next()?)?;
    let lease_end = i64::try_from(number(fields.next()?)?).ok()?;
    let result = fields.next()?;
    let since =
        |at: u64| Duration::from_millis(u64::try_from(now_ms).unwrap_or(0).saturating_sub(at));
    let (state, result, age) = match state {
        // An in-progress record's last field is the time of its claim (empty before it was
        // kept); it has no result.
        b'P' => (
            RecordState::InProgress {
                lease_left: Duration::from_millis(
                    u64::try_from(lease_end.saturating_sub(now_ms)).unwrap_or(0),
                ),
            },
            None,
            number(result).map(since),
        ),
        b'C' => (
            RecordState::Completed,
            (!result.is_empty()).then(|| result.to_vec()),
            None,
        ),
        b'R' => (RecordState::Released, None, None),
        _ => return None,
    };
    Some(
        Record::new(state, Token::from_bytes(token), fence)
            .with_fingerprint(fingerprint)
            .with_result(result)
            .with_age(age),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_the_script_writes_them() {
        for n in [0, 1, 9, 10, 99, 100, 12_345, MAX_EXACT, u64::MAX] {
            let mut value = b"x".to_vec();
            push_decimal(&mut value, n);
            assert_eq!(value, format!("x{n}").into_bytes());
        }
    }

    #[test]
    fn an_owner_writes_again_the_record_its_fast_claim_wrote() {
        let key = Key::new("t", 1, &[&1u8]).unwrap();
        let lease = Duration::from_secs(30);
        for fingerprint in [None, Some(Fingerprint::of(&[&"EUR", &1250u64]))] {
            let mut req = ClaimRequest::new(key.clone(), Token::generate(), lease, lease);
            req.fingerprint = fingerprint;
            let fence = 1_796_130_461_329_139;
            let written = fast_claim_record(&req, fence, 30_000).unwrap();
            let claim = AcquiredClaim::new(fence, fingerprint).with_lease(lease);
            let (claimed, completed) =
                fast_completion(&req.token, &claim, 30_000, b"receipt-7").unwrap();
            assert_eq!(
                claimed, written,
                "the completion names the claim byte for byte"
            );
            let record = parse_record(&written, 1_796_130_461_329).unwrap();
            assert_eq!(
                record.state,
                RecordState::InProgress { lease_left: lease },
                "claimed at the fence's millisecond"
            );
            assert_eq!(record.age, Some(Duration::ZERO));
            // What the script's own completion writes for that record.
            let mut expected = vec![b'C'];
            expected.extend_from_slice(
                &written[1..written.len() - b"1796130491329:1796130461329".len()],
            );
            expected.extend_from_slice(b"0:receipt-7");
            assert_eq!(completed, expected);
            let record = parse_record(&completed, 0).unwrap();
            assert_eq!(
                (record.state, record.fence, record.fingerprint),
                (RecordState::Completed, fence, fingerprint)
            );
            assert_eq!(record.result.as_deref(), Some(&b"receipt-7"[..]));
        }
        let claim = AcquiredClaim::new(MAX_EXACT + 1, None);
        assert_eq!(fast_completion(&Token::generate(), &claim, 1, b""), None);
    }

    #[test]
    fn records_round_trip_through_the_wire_format() {
        let token = Token::generate();
        let mut bytes = vec![b'P'];
        bytes.extend_from_slice(token.as_bytes());
        bytes.push(b'F');
        bytes.extend_from_slice(&[7u8; 16]);
        bytes.extend_from_slice(b"12:5000:");
        let record = parse_record(&bytes, 3000).unwrap();
        assert_eq!(record.token, token);
        assert_eq!(record.fence, 12);
        assert_eq!(record.fingerprint, Some(Fingerprint::from_bytes([7; 16])));
        assert_eq!(
            record.state,
            RecordState::InProgress {
                lease_left: Duration::from_secs(2)
            }
        );
        assert_eq!(record.result, None);
        assert_eq!(
            record.age, None,
            "a record written before claims kept their time"
        );

        // An in-progress record's last field is the time of its claim, not a result.
        let req = ClaimRequest::new(
            Key::new("t", 1, &[&1u8]).unwrap(),
            token,
            Duration::from_secs(2),
            Duration::from_secs(9),
        );
        let claimed =
            encode_in_progress(&req.token, req.fingerprint.as_ref(), 12, 1000, 3000).unwrap();
        let record = parse_record(&claimed, 1750).unwrap();
        assert_eq!(record.age, Some(Duration::from_millis(750)));
        assert_eq!(record.result, None);
        assert_eq!(
            record.state,
            RecordState::InProgress {
                lease_left: Duration::from_millis(1250)
            }
        );

        let mut done = vec![b'C'];
        done.extend_from_slice(token.as_bytes());
        done.extend_from_slice(b"-3:0:o:{\"a\":1}");
        let record = parse_record(&done, 0).unwrap();
        assert_eq!(record.state, RecordState::Completed);
        assert_eq!(record.fingerprint, None);
        assert_eq!(record.result.as_deref(), Some(&b"o:{\"a\":1}"[..]));
    }

    #[test]
    fn values_that_are_not_records_are_refused() {
        let token = Token::generate();
        let shaped = |state: u8, marker: u8, fields: &[u8]| {
            let mut v = vec![state];
            v.extend_from_slice(token.as_bytes());
            v.push(marker);
            v.extend_from_slice(fields);
            v
        };
        assert!(parse_record(&shaped(b'C', b'-', b"1796000000000000:0:"), 0).is_some());
        for bad in [
            Vec::new(),
            b"P".to_vec(),
            shaped(b'X', b'-', b"7:0:"),
            shaped(b'C', b'?', b"7:0:"),
            shaped(b'C', b'F', b"7:0:"),
            shaped(b'C', b'-', b"seven:0:"),
            shaped(b'C', b'-', b"+7:0:"),
            shaped(b'C', b'-', b":0:"),
            shaped(b'C', b'-', b"7:-1:"),
            shaped(b'C', b'-', b"7:0"),
            shaped(b'C', b'-', b"9007199254740991:0:"),
        ] {
            assert_eq!(
                parse_record(&bad, 0),
                None,
                "{:?}",
                String::from_utf8_lossy(&bad)
            );
        }
    }
}
