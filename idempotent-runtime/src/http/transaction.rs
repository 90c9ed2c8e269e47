//! [`InTransaction`]: the claim, the handler's business writes and the stored response
//! committed in one database transaction.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use std::sync::PoisonError;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::request::Parts;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;

use crate::codec;
use crate::engine::state::Check;
use crate::engine::{run_bound, BoundCall, Results};
use crate::http::body::{Body, BoxError};
use crate::http::failure::Failure;
use crate::http::request::{prepare, read_request, Guarded, Prepared};
use crate::http::respond::{answer, reject};
use crate::http::stored::{storable, Stored};
use crate::http::stream::Live;
use crate::http::{Config, IdempotencyLayer, Problem, Storage};
use crate::in_tx::InTx;
use crate::store::sql::{Dialect, SqlStore};

/// Idempotent handlers whose idempotency record commits **in the same database transaction**
/// as their business writes: built by [`IdempotencyLayer::in_transaction`], with the layer's
/// settings (header names, scope, limits, storage rules, problems, counters).
///
/// [`run`](InTransaction::run) begins a transaction on the store's pool, claims the key in it,
/// runs the handler on the transaction's connection, stores its response in it and commits:
/// the order row and the response that announces it exist together or not at all. There is
/// no window in which the effect is committed but the key is not, and no lease to run out:
///
/// - a duplicate that arrives while the first transaction is open waits on the record's row
///   lock and, once it commits, gets the response replayed (or runs, after a rollback);
/// - a handler whose response releases the key ([`Storage::Release`](crate::http::Storage))
///   rolls the whole transaction back, its writes included;
/// - a crash, a dropped future (the client hung up) or a failed commit rolls everything
///   back, so the retry runs the handler as if it were the first.
///
/// Use it on routes *without* the layer (the layer would claim the key a second time, on
/// its own connection).
///
/// ```no_run
/// use std::{sync::Arc, time::Duration};
/// use axum::{body::Body, extract::{Request, State}, response::Response, routing::post, Router};
/// use idempotent_runtime::http::{IdempotencyLayer, InTransaction};
/// use idempotent_runtime::sql::{sqlx, PostgresStore};
/// use idempotent_runtime::Idempotency;
///
/// async fn create_order(
///     State(orders): State<Arc<InTransaction<sqlx::Postgres>>>,
///     request: Request,
/// ) -> Response<idempotent_runtime::http::Body> {
///     orders
///         .run(request, async |conn, _parts, body| {
///             let id: i64 = sqlx::query_scalar("INSERT INTO orders (item) VALUES ($1) RETURNING id")
///                 .bind(String::from_utf8_lossy(&body).into_owned())
///                 .fetch_one(&mut *conn)
///                 .await
///                 .unwrap_or(-1);
///             Response::builder().status(201).body(Body::from(format!("{id}"))).unwrap_or_default()
///         })
///         .await
/// }
///
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let store = Arc::new(PostgresStore::connect("postgres://app@db/shop").await?);
/// let layer = IdempotencyLayer::new(
///     Idempotency::new(Duration::from_secs(86_400)),
///     |request: &http::request::Parts| Some(request.headers.get("x-api-key")?.to_str().ok()?.to_owned()),
/// );
/// let orders = Arc::new(layer.in_transaction(store));
/// let app: Router = Router::new().route("/orders", post(create_order)).with_state(orders);
/// # Ok(()) }
/// ```
pub struct InTransaction<DB: Dialect> {
    config: Arc<Config>,
    store: Arc<SqlStore<DB>>,
}

impl<DB: Dialect> std::fmt::Debug for InTransaction<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InTransaction")
            .field("prefix", &self.config.prefix)
            .field("table", &self.store.table())
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// Handlers whose claim, business writes and stored response commit in one transaction of
    /// `store`: see [`InTransaction`]. The ttl is the layer's; its store, lease and in-progress
    /// policy do not apply (the row lock orders concurrent requests).
    pub fn in_transaction<DB: Dialect>(&self, store: Arc<SqlStore<DB>>) -> InTransaction<DB> {
        InTransaction {
            config: self.config.clone(),
            store,
        }
    }
}

impl<DB: Dialect> InTransaction<DB> {
    /// Answers `request`: its key read and scoped as the layer does, then `handler` run on a
    /// transaction's connection with the request's head and body, its response stored and
    /// the transaction committed; or the stored response replayed; or a problem. Requests
    /// without a key (where the layer does not require one) run in a transaction too,
    /// without a record.
    pub async fn run<B, RB>(
        &self,
        request: Request<B>,
        handler: impl AsyncFnOnce(&mut DB::Connection, Parts, Bytes) -> Response<RB>,
    ) -> Response<Body>
    where
        B: http_body::Body<Data = Bytes>,
        B::Error: Into<BoxError>,
        RB: http_body::Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<BoxError>,
    {
        let config = &*self.config;
        let unavailable = |err: &dyn std::fmt::Display| {
            let detail = format!("the database did not answer ({err}); nothing was done");
            reject(config, Problem::StoreUnavailable, &detail)
        };
        let prepared = match prepare(config, request, false).await {
            Guarded::Run(prepared) => prepared,
            Guarded::Answer(response) => return response,
            Guarded::Pass(request) => {
                // No key: the handler in a transaction of its own, nothing recorded.
                let (parts, body) = request.into_parts();
                let bytes = match read_request(&parts, body, config.max_request_body).await {
                    Ok(bytes) => bytes,
                    Err((problem, detail)) => return reject(config, problem, &detail),
                };
                let mut tx = match self.store.pool().begin().await {
                    Ok(tx) => tx,
                    Err(err) => return unavailable(&err),
                };
                let response = handler(&mut *tx, parts, bytes).await;
                return match tx.commit().await {
                    Ok(()) => response.map(Body::stream),
                    Err(err) => unavailable(&err),
                };
            }
        };
        let Prepared {
            parts,
            bytes,
            key,
            fingerprint,
            previous,
        } = prepared;
        let mut tx = match self.store.pool().begin().await {
            Ok(tx) => tx,
            Err(err) => return unavailable(&err),
        };
        let live = Live::default();
        let call = BoundCall {
            key,
            ttl: config.idempotency.ttl(),
            fingerprint: Some(fingerprint),
            results: Results::default()
                .with_replay_codec(|stored: &Stored| stored.encode(codec::OK), Stored::decode),
            // Processed under the previous key layout, before an upgrade: not run again.
            done: Check(|| Prepared::done_before(previous.as_ref(), config)),
        };
        let outcome: Result<Stored, Failure<Infallible>> = run_bound(
            &mut InTx {
                store: &self.store,
                tx: &mut tx,
            },
            call,
            async |conn| {
                live.ran.store(true, Ordering::Relaxed);
                let response = handler(conn, parts, bytes).await;
                capture(config, response, &live).await
            },
        )
        .await;
        let fresh = live.ran.load(Ordering::Relaxed);
        let done = match &outcome {
            // A run whose response is stored: the effect and the record commit together.
            Ok(_) if fresh => tx.commit().await,
            // A replay, a released key, a problem: nothing of this request is kept.
            _ => tx.rollback().await,
        };
        match (done, fresh, &outcome) {
            (Err(err), true, Ok(_)) => unavailable(&err),
            _ => match answer(config, outcome, &live) {
                Ok(response) => response,
                Err(never) => match never {},
            },
        }
    }
}

/// The stored form of the handler's `response`, its body read up to the limit; the response
/// to send is left in `live`. A response that releases the key is the failure sent as it is.
async fn capture<RB, E>(
    config: &Config,
    response: Response<RB>,
    live: &Live,
) -> Result<Stored, Failure<E>>
where
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let (parts, body) = response.into_parts();
    if (config.storage)(parts.status) == Storage::Release {
        return Err(Failure::Released(Response::from_parts(
            parts,
            Body::stream(body),
        )));
    }
    let headers = storable(&parts.headers, config.sanitize);
    let status = parts.status;
    let (kept, body) = read_response(body, config.max_stored_body).await;
    *live.response.lock().unwrap_or_else(PoisonError::into_inner) =
        Some(Response::from_parts(parts, body));
    Ok(Stored {
        status,
        headers,
        body: kept,
    })
}

/// The response body whole when it is at most `max` bytes of data (then also the body to
/// send), or `None` and a body that sends what was read, then the rest.
async fn read_response<RB>(body: RB, max: usize) -> (Option<Bytes>, Body)
where
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let mut body = body.map_err(Into::into).boxed_unsync();
    let mut frames: Vec<Frame<Bytes>> = Vec::new();
    let mut size = 0usize;
    loop {
        match body.frame().await {
            None => break,
            Some(Ok(frame)) => {
                let Some(data) = frame.data_ref() else {
                    // Trailers are not kept: the response is not replayable as it was.
                    frames.push(frame);
                    return (None, resume(frames, None, Some(body)));
                };
                size += data.len();
                frames.push(frame);
                if size > max {
                    return (None, resume(frames, None, Some(body)));
                }
            }
            Some(Err(err)) => return (None, resume(frames, Some(err), None)),
        }
    }
    let whole = match frames.len() {
        0 => Bytes::new(),
        1 => frames
            .pop()
            .and_then(|frame| frame.into_data().ok())
            .unwrap_or_default(),
        _ => {
            let mut whole = BytesMut::with_capacity(size);
            for frame in frames {
                if let Ok(data) = frame.into_data() {
                    whole.extend_from_slice(&data);
                }
            }
            whole.freeze()
        }
    };
    (Some(whole.clone()), Body::full(whole))
}

/// The frames the layer already read, then the rest of `rest` (or `error`, when reading
/// failed).
fn resume(
    read: Vec<Frame<Bytes>>,
    error: Option<BoxError>,
    rest: Option<UnsyncBoxBody<Bytes, BoxError>>,
) -> Body {
    Body::stream(Resumed {
        read: read.into(),
        error,
        rest,
    })
}

struct Resumed {
    read: VecDeque<Frame<Bytes>>,
    error: Option<BoxError>,
    rest: Option<UnsyncBoxBody<Bytes, BoxError>>,
}

impl http_body::Body for Resumed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(frame) = self.read.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if let Some(error) = self.error.take() {
            return Poll::Ready(Some(Err(error)));
        }
        match &mut self.rest {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }
}
