//! Sending the store's statements: conflict retries, claims that resolve, batches, and
//! owner-checked writes.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Database;

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::{BoxFuture, Claim, ClaimRequest, Completion, End, Ending, Token};

use crate::database::{is_conflict, store_error, Phase};
use crate::store::sql::dialect::{ticks, Arg};
use crate::store::sql::dialect::{Dialect, Statements};
use crate::store::sql::record::{resolve, Step, Stored};

/// How many times an autocommit statement the database rolled back by a conflict (deadlock,
/// serialization failure, busy database) is sent again before the error is returned.
const CONFLICT_RETRIES: u32 = 3;

/// How many times a claim is sent when the record keeps changing under it. Each new attempt
/// needs another writer to have changed the record in between.
const RESOLVE_ATTEMPTS: u32 = 16;

/// Sends the claim statement until its outcome is resolved (see the module docs). In autocommit
/// mode a statement rolled back by a conflict is sent again; in a transaction it is not (the
/// transaction may be aborted). `fresh`: whether the key may have no record, as
/// [`DialectImpl::claim`](super::dialect::DialectImpl::claim) takes it; a claim sent again
/// saw one.
pub(super) async fn claim_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    req: &ClaimRequest,
    autocommit: bool,
    mut fresh: bool,
) -> Result<Claim, StoreError> {
    // One count of conflicts for every attempt.
    let mut conflicts = Conflicts::new(autocommit);
    let mut attempts = 0;
    loop {
        let step = conflicts
            .send::<DB, _, _>(
                conn,
                &(sql, req, fresh),
                "claim",
                |conn, &(sql, req, fresh)| DB::claim(conn, sql, req, fresh),
            )
            .await?;
        if let Some(claim) = resolve(step, req, DB::TICK)? {
            return Ok(claim);
        }
        fresh = false;
        attempts += 1;
        if attempts >= RESOLVE_ATTEMPTS {
            return Err(StoreError::new(
                StoreErrorKind::Unavailable,
                format!(
                    "{} claim did not resolve: the record changed under it {attempts} times",
                    <DB as Database>::NAME
                ),
            ));
        }
    }
}

/// Claims `reqs` in batch statements of distinct keys, then answers the later occurrences of
/// a key one claim at a time (they meet the first occurrence's claim, as separate claims
/// would); a reported record that is free is claimed again on its own, as in [`claim_on`].
pub(super) async fn claim_many_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    reqs: &[ClaimRequest],
) -> Vec<Result<Claim, StoreError>> {
    let mut claims: Vec<Result<Claim, StoreError>> = reqs
        .iter()
        .map(|_| {
            Err(StoreError::new(
                StoreErrorKind::Protocol,
                "batch claim left an item unanswered",
            ))
        })
        .collect();
    // One order for every batch, so that overlapping batches lock their rows alike. The sort
    // is stable: of a key's occurrences, the first comes first, and goes in the batch.
    let mut by_key: Vec<(usize, &ClaimRequest)> = reqs.iter().enumerate().collect();
    by_key.sort_by(|(_, a), (_, b)| a.key.as_bytes().cmp(b.key.as_bytes()));
    let (mut distinct, mut later) = (Vec::with_capacity(reqs.len()), Vec::new());
    let mut previous: Option<&[u8]> = None;
    for (i, req) in by_key {
        let key = req.key.as_bytes();
        if previous == Some(key) {
            later.push((i, req));
        } else {
            distinct.push((i, req));
        }
        previous = Some(key);
    }
    later.sort_unstable_by_key(|&(i, _)| i);
    for chunk in distinct.chunks(DB::BATCH.max(1)) {
        let mut chunk = chunk.to_vec();
        if sql.claim_many_fresh().is_some() {
            // The insert-only claim first; its statement is applied or not as a whole, so
            // a failure of the full claim that follows concerns the other keys alone.
            let batch: Vec<&ClaimRequest> = chunk.iter().map(|&(_, req)| req).collect();
            let sent = Conflicts::new(true)
                .send::<DB, _, _>(
                    conn,
                    &(sql, &batch[..]),
                    "batch claim",
                    |conn, &(sql, reqs)| DB::claim_batch_fresh(conn, sql, reqs),
                )
                .await;
            let Some(taken) = reported::<DB, _>(&mut claims, &chunk, sent) else {
                continue;
            };
            let mut rest = Vec::with_capacity(chunk.len());
            for (&(i, req), step) in chunk.iter().zip(taken) {
                match step {
                    Some(step) => {
                        let claim = settle::<DB>(conn, sql, req, step).await;
                        put(&mut claims, i, claim);
                    }
                    None => rest.push((i, req)),
                }
            }
            chunk = rest;
        }
        if chunk.is_empty() {
            continue;
        }
        let batch: Vec<&ClaimRequest> = chunk.iter().map(|&(_, req)| req).collect();
        let sent = claim_batch_on::<DB>(conn, sql, &batch).await;
        let Some(steps) = reported::<DB, _>(&mut claims, &chunk, sent) else {
            continue;
        };
        for (&(i, req), step) in chunk.iter().zip(steps) {
            let claim = settle::<DB>(conn, sql, req, step).await;
            put(&mut claims, i, claim);
        }
    }
    for (i, req) in later {
        // It meets the first occurrence's record.
        let claim = claim_on::<DB>(conn, sql, req, true, false).await;
        put(&mut claims, i, claim);
    }
    claims
}

/// A batch statement's answer for the items of `chunk` (one per item), or `None` once its
/// failure, or an answer of the wrong length, is placed in `claims` for each of them.
fn reported<DB: Dialect, T>(
    claims: &mut [Result<Claim, StoreError>],
    chunk: &[(usize, &ClaimRequest)],
    sent: Result<Vec<T>, StoreError>,
) -> Option<Vec<T>> {
    let err = match sent {
        Ok(steps) if steps.len() == chunk.len() => return Some(steps),
        Ok(_) => StoreError::new(
            StoreErrorKind::Protocol,
            format!(
                "{} batch claim did not report every key",
                <DB as Database>::NAME
            ),
        ),
        Err(err) => err,
    };
    let indices: Vec<usize> = chunk.iter().map(|&(i, _)| i).collect();
    place(claims, &indices, err);
    None
}

/// The claim of one item of a batch from its `step`; a reported record that is free is
/// claimed again on its own.
async fn settle<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    req: &ClaimRequest,
    step: Step,
) -> Result<Claim, StoreError> {
    match resolve(step, req, DB::TICK) {
        Ok(Some(claim)) => Ok(claim),
        Ok(None) => claim_on::<DB>(conn, sql, req, true, false).await,
        Err(err) => Err(err),
    }
}

fn put(claims: &mut [Result<Claim, StoreError>], i: usize, claim: Result<Claim, StoreError>) {
    if let Some(slot) = claims.get_mut(i) {
        *slot = claim;
    }
}

/// Sends one batch claim statement; a statement rolled back by a conflict is sent again.
async fn claim_batch_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    reqs: &[&ClaimRequest],
) -> Result<Vec<Step>, StoreError> {
    Conflicts::new(true)
        .send::<DB, _, _>(conn, &(sql, reqs), "batch claim", |conn, &(sql, reqs)| {
            DB::claim_batch(conn, sql, reqs)
        })
        .await
}

/// `err` for every item of a batch that failed as a whole: the first gets the error itself,
/// the others its kind and message.
pub(super) fn spread(err: StoreError, items: usize) -> Vec<Result<Claim, StoreError>> {
    let mut claims: Vec<_> = (1..items).map(|_| Err(copy_error(&err))).collect();
    if items > 0 {
        claims.insert(0, Err(err));
    }
    claims
}

/// Puts `err` in `claims` at the indices of a failed batch statement.
fn place(claims: &mut [Result<Claim, StoreError>], indices: &[usize], err: StoreError) {
    for &i in indices.iter().skip(1) {
        put(claims, i, Err(copy_error(&err)));
    }
    if let Some(&first) = indices.first() {
        put(claims, first, Err(err));
    }
}

fn copy_error(err: &StoreError) -> StoreError {
    StoreError::new(err.kind(), err.to_string())
}

pub(super) async fn complete_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    key: &Key,
    token: &Token,
    completion: &Completion,
    autocommit: bool,
) -> Result<bool, StoreError> {
    let args = [
        Arg::MaybeBytes(completion.result.as_deref()),
        Arg::Int(ticks(completion.ttl, DB::TICK)),
        Arg::Bytes(key.as_bytes()),
        Arg::Bytes(token.as_bytes()),
    ];
    let completed = write::<DB>(conn, &sql.complete, &args, "complete", autocommit).await?;
    owned::<DB>(conn, sql, key, completed).await
}

pub(super) async fn release_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    key: &Key,
    token: &Token,
    autocommit: bool,
) -> Result<bool, StoreError> {
    let args = [Arg::Bytes(key.as_bytes()), Arg::Bytes(token.as_bytes())];
    let released = write::<DB>(conn, &sql.release, &args, "release", autocommit).await?;
    owned::<DB>(conn, sql, key, released).await
}

pub(super) async fn reopen_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    key: &Key,
    token: &Token,
) -> Result<bool, StoreError> {
    let args = [Arg::Bytes(key.as_bytes()), Arg::Bytes(token.as_bytes())];
    let reopened = write::<DB>(conn, &sql.reopen, &args, "reopen", true).await?;
    owned::<DB>(conn, sql, key, reopened).await
}

/// The answer of an owner-checked write that matched `rows` rows: `true` when it matched the
/// record. When it matched none, the key is someone else's or has no live record, or its
/// record cannot be read (those writes leave such a record alone): the record is read to
/// tell the last apart, which is [`StoreErrorKind::Corrupt`], never a lost owner. A failure
/// of that read leaves the write's answer, `false`.
pub(super) async fn owned<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    key: &Key,
    rows: u64,
) -> Result<bool, StoreError> {
    if rows > 0 {
        return Ok(true);
    }
    let args = [Arg::Bytes(key.as_bytes())];
    let row = match DB::fetch(conn, &sql.read, &args).await {
        Ok(row) => row,
        Err(err) => {
            let err = store_error::<DB>(err, Phase::Read, "read");
            return if err.kind() == StoreErrorKind::Corrupt {
                Err(err)
            } else {
                Ok(false)
            };
        }
    };
    if let Some(row) = row {
        Stored::from_row(row, DB::TICK)?;
    }
    Ok(false)
}

/// The most result bytes one batch ending statement carries: a larger batch is split,
/// so a statement stays well within every database's packet and parameter limits.
const COMPLETE_BATCH_BYTES: usize = 4 << 20;

/// Ends `items` in batch statements of distinct keys (at most [`DialectImpl::COMPLETE_BATCH`](crate::store::sql::dialect::DialectImpl::COMPLETE_BATCH)
/// items and [`COMPLETE_BATCH_BYTES`] of results each); an item the statement did not resolve
/// is answered as a single write that matched nothing ([`owned`]: someone else's key, or
/// [`StoreErrorKind::Corrupt`]). Later occurrences of a key, results larger than the store
/// takes, databases without a batch statement, releases where the batch statement cannot
/// report them exactly ([`DialectImpl::BATCH_RELEASES`](crate::store::sql::dialect::DialectImpl::BATCH_RELEASES)) and a batch statement's worth of one
/// item are ended one by one.
pub(super) async fn complete_many_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    items: &[Ending],
    max_result_size: usize,
) -> Vec<Result<bool, StoreError>> {
    let mut ended: Vec<Option<Result<bool, StoreError>>> = items.iter().map(|_| None).collect();
    let mut sendable = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        if let End::Complete(completion) = &item.action {
            if let Err(err) = refuse_oversized(completion, max_result_size) {
                ended[i] = Some(Err(err));
                continue;
            }
        }
        sendable.push(i);
    }
    let (mut distinct, mut single) = (Vec::with_capacity(items.len()), Vec::new());
    if DB::COMPLETE_BATCH == 0 {
        single = sendable;
    } else {
        // One order for every batch, so that overlapping batches lock their rows alike. The
        // sort is stable: of a key's items, the first comes first.
        sendable.sort_by(|&a, &b| items[a].key.as_bytes().cmp(items[b].key.as_bytes()));
        let mut previous: Option<&[u8]> = None;
        for i in sendable {
            let item = &items[i];
            let key = item.key.as_bytes();
            // A key's first item goes in the batch statement if the statement takes it; a key
            // met first in an item it does not take goes one by one, with every later item
            // of it, in order.
            let batchable = DB::BATCH_RELEASES || matches!(item.action, End::Complete(_));
            if previous != Some(key) && batchable {
                distinct.push(i);
            } else {
                single.push(i);
            }
            previous = Some(key);
        }
        single.sort_unstable();
    }
    let mut chunks: Vec<Vec<usize>> = Vec::new();
    let mut bytes = 0;
    for i in distinct {
        let size = match &items[i].action {
            End::Complete(completion) => completion.result.as_ref().map_or(0, Vec::len),
            _ => 0,
        };
        match chunks.last_mut() {
            Some(chunk)
                if chunk.len() < DB::COMPLETE_BATCH && bytes + size <= COMPLETE_BATCH_BYTES =>
            {
                bytes += size;
                chunk.push(i);
            }
            _ => {
                bytes = size;
                chunks.push(vec![i]);
            }
        }
    }
    // A chunk of one item is that item's own statement, which the database runs for less
    // than the batch statement's (a single ending sent through a batch call, as a
    // `CombiningStore` sends one when its store is idle). Moved among the single items in
    // item order, it still goes before the later items of its key.
    let (ones, chunks): (Vec<Vec<usize>>, Vec<Vec<usize>>) =
        chunks.into_iter().partition(|chunk| chunk.len() == 1);
    if !ones.is_empty() {
        single.extend(ones.into_iter().flatten());
        single.sort_unstable();
    }
    for chunk in chunks {
        let batch: Vec<&Ending> = chunk.iter().map(|&i| &items[i]).collect();
        match complete_batch_on::<DB>(conn, sql, &batch).await {
            Ok(matched) if matched.len() == chunk.len() => {
                for (&i, matched) in chunk.iter().zip(matched) {
                    let answer = if matched {
                        Ok(true)
                    } else {
                        owned::<DB>(conn, sql, &items[i].key, 0).await
                    };
                    ended[i] = Some(answer);
                }
            }
            Ok(_) => {
                for &i in &chunk {
                    ended[i] = Some(Err(StoreError::new(
                        StoreErrorKind::Protocol,
                        format!(
                            "{} batch ending did not report every key",
                            <DB as Database>::NAME
                        ),
                    )));
                }
            }
            Err(err) => {
                for &i in chunk.iter().skip(1) {
                    ended[i] = Some(Err(copy_error(&err)));
                }
                if let Some(&first) = chunk.first() {
                    ended[first] = Some(Err(err));
                }
            }
        }
    }
    for i in single {
        let item = &items[i];
        let answer = match &item.action {
            End::Complete(completion) => {
                complete_on::<DB>(conn, sql, &item.key, &item.token, completion, true).await
            }
            _ => release_on::<DB>(conn, sql, &item.key, &item.token, true).await,
        };
        ended[i] = Some(answer);
    }
    ended
        .into_iter()
        .map(|answer| {
            answer.unwrap_or_else(|| {
                Err(StoreError::new(
                    StoreErrorKind::Protocol,
                    "batch ending left an item unanswered",
                ))
            })
        })
        .collect()
}

/// Sends one batch ending statement; a statement rolled back by a conflict is sent again.
async fn complete_batch_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    items: &[&Ending],
) -> Result<Vec<bool>, StoreError> {
    Conflicts::new(true)
        .send::<DB, _, _>(
            conn,
            &(sql, items),
            "batch ending",
            |conn, &(sql, items)| DB::complete_batch(conn, sql, items),
        )
        .await
}

/// Refuses a completion whose result is larger than the store takes, before it is sent.
pub(super) fn refuse_oversized(completion: &Completion, limit: usize) -> Result<(), StoreError> {
    match completion.result.as_ref().map(Vec::len) {
        Some(len) if len > limit => Err(StoreError::new(
            StoreErrorKind::Rejected,
            format!("a result of {len} bytes is larger than the store takes ({limit} bytes)"),
        )),
        _ => Ok(()),
    }
}

/// Executes a writing statement; returns the rows it matched.
pub(super) async fn write<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Arc<str>,
    args: &[Arg<'_>],
    what: &str,
    autocommit: bool,
) -> Result<u64, StoreError> {
    Conflicts::new(autocommit)
        .send::<DB, _, _>(conn, &(sql, args), what, |conn, &(sql, args)| {
            DB::execute(conn, sql, args)
        })
        .await
}

/// The conflict retries of a statement: one that the database rolled back by a conflict
/// (deadlock, serialization failure, busy database) is sent again, after a short, growing
/// pause, at most [`CONFLICT_RETRIES`] times in all. Only in autocommit mode: in a
/// transaction a conflict may have aborted the transaction, and the error is returned.
struct Conflicts {
    autocommit: bool,
    seen: u32,
}

impl Conflicts {
    fn new(autocommit: bool) -> Conflicts {
        Conflicts {
            autocommit,
            seen: 0,
        }
    }

    /// `send(conn, args)`'s answer, sent again while it is rolled back by a conflict and
    /// retries are left; its error otherwise, as a write's error named `what`.
    async fn send<DB, A, T>(
        &mut self,
        conn: &mut DB::Connection,
        args: &A,
        what: &str,
        send: impl for<'c> Fn(&'c mut DB::Connection, &'c A) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError>
    where
        DB: Dialect,
        A: ?Sized,
    {
        loop {
            match send(&mut *conn, args).await {
                Ok(answer) => return Ok(answer),
                Err(err)
                    if self.autocommit
                        && self.seen < CONFLICT_RETRIES
                        && is_conflict::<DB>(&err) =>
                {
                    self.seen += 1;
                    tokio::time::sleep(Duration::from_millis(2u64 << self.seen.min(6))).await;
                }
                Err(err) => return Err(store_error::<DB>(err, Phase::Write, what)),
            }
        }
    }
}
