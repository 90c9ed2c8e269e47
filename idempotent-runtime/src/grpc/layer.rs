//! [`IdempotencyLayer`]: unary gRPC methods made idempotent by an `idempotency-key` metadata
//! entry, for services that cannot change their messages.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt as _;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue};
use http_body_util::{BodyExt, Full};
use sha2::{Digest, Sha256};
use tokio_util::task::TaskTracker;
use tonic::{Code, Status};
use tracing::Instrument;

use super::call::{ReplyBody, StoredCall};
use crate::default_store::{carry, scoped};
use crate::engine::Idempotency;
use crate::http::detached::Detached;
use crate::http::failure::Failure;
use crate::http::key::{self, KeyHeader};
use crate::http::request::read_request;
use crate::http::stored::storable;
use crate::http::{BoxError, Problem, Storage};
use crate::key::{hex_string, Key, KeyError};
use crate::store::Fingerprint;

type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// The key's layout version: `<prefix>:v1:{sha256(caller)[..16], client key}`.
const KEY_VERSION: u32 = 1;

#[derive(Clone)]
struct Config {
    idempotency: Idempotency,
    scope: Arc<ScopeFn>,
    prefix: String,
    key_names: Vec<HeaderName>,
    streaming: Vec<String>,
    required: Vec<String>,
    max_key_len: usize,
    max_request_body: usize,
    max_stored_reply: usize,
    storage: fn(Code) -> Storage,
}

/// Whether a reply with this status is kept for replay (the key completes) or gives the key
/// back (a retry runs the method again): the default of [`IdempotencyLayer::storage`].
///
/// `OK` and the answers a retry would get again (`INVALID_ARGUMENT`, `NOT_FOUND`,
/// `ALREADY_EXISTS`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`, `UNIMPLEMENTED`) are kept; the
/// transient ones and those that say nothing was done (`CANCELLED`, `UNKNOWN`,
/// `DEADLINE_EXCEEDED`, `PERMISSION_DENIED`, `RESOURCE_EXHAUSTED`, `ABORTED`, `INTERNAL`,
/// `UNAVAILABLE`, `DATA_LOSS`, `UNAUTHENTICATED`) release the key, as HTTP's 5xx, 401, 403
/// and 429 do.
///
/// ```
/// use idempotent_runtime::grpc::storage_for;
/// use idempotent_runtime::http::Storage;
/// use tonic::Code;
///
/// assert_eq!(storage_for(Code::Ok), Storage::Store);
/// assert_eq!(storage_for(Code::NotFound), Storage::Store);
/// assert_eq!(storage_for(Code::Unavailable), Storage::Release);
/// ```
pub fn storage_for(code: Code) -> Storage {
    match code {
        Code::Ok
        | Code::InvalidArgument
        | Code::NotFound
        | Code::AlreadyExists
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::Unimplemented => Storage::Store,
        _ => Storage::Release,
    }
}

/// A tower layer that makes unary gRPC methods idempotent per `idempotency-key` metadata
/// entry, for services whose messages have no request id of their own.
///
/// A call that carries `idempotency-key` is claimed under it (with the caller, from the
/// `scope` function) before the method runs, by the same engine and store as the attribute;
/// the method's reply (headers, message, trailers) is kept and replayed to retries, marked
/// `idempotent-replayed: true`. The request's path and message make its fingerprint: the same
/// key on another method or with another message is `INVALID_ARGUMENT`, and nothing runs.
/// Outcomes are the statuses of the [module table](super#status-codes); a store outage is
/// `UNAVAILABLE` and runs nothing; a reply whose status says nothing was done
/// ([`storage_for`]) gives the key back. Each call runs in a task of the layer's, so a client
/// that leaves (its deadline expired) does not cancel it, and its retry gets the reply.
///
/// **Unary methods only.** The layer buffers the request message and the whole reply, which
/// a streaming method cannot give: name every streaming method with
/// [`streaming`](Self::streaming), and its calls pass through unguarded, key or not. Calls
/// without a key pass through as well, unless their method is named by
/// [`require_key`](Self::require_key).
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotent_runtime::grpc::IdempotencyLayer;
/// use idempotent_runtime::{Idempotency, MemoryStore};
///
/// let idempotency = Idempotency::new(Duration::from_secs(86_400)).store(Arc::new(MemoryStore::new()));
/// // The caller: here a tenant id an authentication interceptor put in the metadata.
/// let layer = IdempotencyLayer::new(idempotency, |call: &http::request::Parts| {
///     call.headers.get("x-tenant")?.to_str().ok().map(str::to_owned)
/// })
/// .require_key("/orders.v1.Orders/CreateOrder")
/// .streaming("/orders.v1.Orders/WatchOrders");
/// // tonic::transport::Server::builder().layer(layer).add_service(...)
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
    tasks: TaskTracker,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("prefix", &self.config.prefix)
            .field("streaming", &self.config.streaming)
            .field("required", &self.config.required)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer with `idempotency`'s store, ttl, lease and in-progress policy, and `scope`:
    /// the caller a call comes from (tenant, principal), part of every key so that one caller
    /// never replays another's reply; `None` answers `UNAUTHENTICATED`. A service with a
    /// single caller returns `Some(String::new())`.
    ///
    /// Defaults: keys from `idempotency-key` metadata, at most 255 characters, prefix
    /// `grpc`; request messages up to 4 MiB (tonic's own default), replies kept up to 256
    /// KiB (a larger one completes the key without it: retries get `ALREADY_EXISTS`);
    /// [`storage_for`].
    pub fn new<F>(idempotency: Idempotency, scope: F) -> IdempotencyLayer
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        IdempotencyLayer {
            config: Arc::new(Config {
                idempotency,
                scope: Arc::new(scope),
                prefix: "grpc".to_owned(),
                key_names: vec![HeaderName::from_static("idempotency-key")],
                streaming: Vec::new(),
                required: Vec::new(),
                max_key_len: 255,
                max_request_body: 4 << 20,
                max_stored_reply: 256 << 10,
                storage: storage_for,
            }),
            tasks: TaskTracker::new(),
        }
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// The key prefix (default `grpc`): keys are `<prefix>:v1:{caller, key}`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config().prefix = prefix.into();
        self
    }

    /// A streaming method, by its path (`/package.Service/Method`): its calls pass through
    /// unguarded, with a key or without.
    pub fn streaming(mut self, path: impl Into<String>) -> Self {
        self.config().streaming.push(path.into());
        self
    }

    /// A method, by its path (`/package.Service/Method`), whose calls must carry a key: one
    /// without is `INVALID_ARGUMENT` and does not run. Calls of other methods without a key
    /// pass through unguarded.
    pub fn require_key(mut self, path: impl Into<String>) -> Self {
        self.config().required.push(path.into());
        self
    }

    /// The longest key accepted, in characters (default 255; never above a key part's 4096
    /// bytes).
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.config().max_key_len = len;
        self
    }

    /// The largest request the layer buffers (default 4 MiB); a larger one is
    /// `RESOURCE_EXHAUSTED` and nothing is claimed.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config().max_request_body = bytes;
        self
    }

    /// The largest reply kept for replay (default 256 KiB). A larger one still completes the
    /// key and reaches its client whole; retries get `ALREADY_EXISTS`, never a second run.
    pub fn max_stored_reply(mut self, bytes: usize) -> Self {
        self.config().max_stored_reply = bytes;
        self
    }

    /// Which reply statuses are kept and which give the key back, in place of
    /// [`storage_for`].
    pub fn storage(mut self, storage: fn(Code) -> Storage) -> Self {
        self.config().storage = storage;
        self
    }

    /// Waits, at most `within`, for calls still running (those whose clients left included)
    /// to finish and store their replies; call it after the server stopped accepting calls.
    /// Returns `false` when some were still running at the deadline.
    pub async fn shutdown(&self, within: Duration) -> bool {
        crate::http::drain(&self.tasks, within).await
    }
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> IdempotencyService<S> {
        IdempotencyService {
            inner,
            config: self.config.clone(),
            tasks: self.tasks.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around a tonic server.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
    tasks: TaskTracker,
}

impl<S> std::fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("prefix", &self.config.prefix)
            .finish_non_exhaustive()
    }
}

type Call = http::Request<tonic::body::Body>;
type Reply = http::Response<tonic::body::Body>;
type ServiceFuture<E> = Pin<Box<dyn Future<Output = Result<Reply, E>> + Send>>;

impl<S, RB> tower_service::Service<Call> for IdempotencyService<S>
where
    S: tower_service::Service<Call, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Reply;
    type Error = S::Error;
    type Future = ServiceFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, call: Call) -> Self::Future {
        // The clone that was made ready serves this call; a fresh clone waits for the next.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        Box::pin(serve(inner, self.config.clone(), self.tasks.clone(), call))
    }
}

/// A trailers-only reply with `status`.
fn status_reply(status: Status) -> Reply {
    status.into_http()
}

fn refuse(problem: Problem, code: Code, detail: &str) -> Reply {
    tracing::debug!(problem = problem.slug(), detail, "call refused");
    status_reply(Status::new(code, detail.to_owned()))
}

async fn pass<S, RB>(mut inner: S, call: Call) -> Result<Reply, S::Error>
where
    S: tower_service::Service<Call, Response = http::Response<RB>>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    Ok(inner.call(call).await?.map(tonic::body::Body::new))
}

async fn serve<S, RB>(
    inner: S,
    config: Arc<Config>,
    tasks: TaskTracker,
    call: Call,
) -> Result<Reply, S::Error>
where
    S: tower_service::Service<Call, Response = http::Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let path = call.uri().path();
    if config.streaming.iter().any(|p| p == path) {
        return pass(inner, call).await;
    }
    let client_key = match key::read(call.headers(), &config.key_names, config.max_key_len) {
        KeyHeader::Key(key) => key,
        KeyHeader::Missing if config.required.iter().any(|p| p == path) => {
            let detail = format!("{path} calls need an idempotency-key metadata entry");
            return Ok(refuse(Problem::MissingKey, Code::InvalidArgument, &detail));
        }
        KeyHeader::Missing => return pass(inner, call).await,
        KeyHeader::Invalid(why) => {
            return Ok(refuse(Problem::InvalidKey, Code::InvalidArgument, &why))
        }
    };
    let (parts, body) = call.into_parts();
    let Some(scope) = (config.scope)(&parts) else {
        let detail = "the call has no caller to scope its idempotency key to";
        return Ok(refuse(Problem::MissingScope, Code::Unauthenticated, detail));
    };
    let bytes = match read_request(&parts, body, config.max_request_body).await {
        Ok(bytes) => bytes,
        Err((Problem::RequestTooLarge, detail)) => {
            return Ok(refuse(
                Problem::RequestTooLarge,
                Code::ResourceExhausted,
                &detail,
            ))
        }
        Err((problem, detail)) => return Ok(refuse(problem, Code::InvalidArgument, &detail)),
    };
    let scope = hex_string(&Sha256::digest(scope.as_bytes())[..16]);
    let key = match Key::new(&config.prefix, KEY_VERSION, &[&scope, &client_key]) {
        Ok(key) => key,
        Err(err @ KeyError::PartTooLong { index: 1, .. }) => {
            let detail = format!("the idempotency key is too long: {err}");
            return Ok(refuse(Problem::InvalidKey, Code::InvalidArgument, &detail));
        }
        Err(err) => return Ok(refuse(Problem::Internal, Code::Internal, &err.to_string())),
    };
    // The method and the message: the same key on another method, or with another message,
    // is another call.
    let fingerprint = Fingerprint::of(&[&parts.uri.path(), &&bytes[..]]);
    let call = http::Request::from_parts(parts, tonic::body::Body::new(Full::new(bytes)));
    // The run goes to its end whatever the client does: it is polled here, and goes on in a
    // task of its own if this future is dropped first (a client that left).
    // Boxed as soon as it is made: the run holds the method's future and the engine's, and
    // every wrapper would move it by value; a box moves as a pointer.
    let answering = Box::pin(async move { run(inner, &config, key, fingerprint, call).await });
    let answering = Detached::new(
        carry(scoped(), answering.instrument(tracing::Span::current())),
        &tasks,
    );
    match answering.await {
        Ok(answer) => answer,
        // A bug of the layer's.
        Err(_) => Ok(status_reply(Status::internal(
            "the idempotency layer failed while answering",
        ))),
    }
}

/// The reply of a call that ran here, kept for its own client whether or not it is stored.
struct Fresh {
    parts: http::response::Parts,
    body: Bytes,
    trailers: HeaderMap,
}

/// Claims the key, runs the method under it and answers: its fresh reply, a replay, a
/// released reply as it was, or the engine's outcome as a status.
async fn run<S, RB>(
    mut inner: S,
    config: &Config,
    key: Key,
    fingerprint: Fingerprint,
    call: Call,
) -> Result<Reply, S::Error>
where
    S: tower_service::Service<Call, Response = http::Response<RB>>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let ran = AtomicBool::new(false);
    let fresh: Mutex<Option<Fresh>> = Mutex::new(None);
    let outcome = config
        .idempotency
        .operation::<Result<StoredCall, Failure<S::Error>>>(key)
        .fingerprint_of(fingerprint)
        .replay_with(StoredCall::encode, StoredCall::decode)
        // A closure that makes the body when it is called: it holds the call and a few
        // references, where the body's unstarted future is as large as it will ever be.
        .run_with(|_| async {
            ran.store(true, Ordering::Relaxed);
            // A method that panics has done nothing it answered for: its key is released.
            let reply = match AssertUnwindSafe(inner.call(call)).catch_unwind().await {
                Ok(reply) => reply.map_err(Failure::Service)?,
                Err(_) => return Err(Failure::Panicked("the method panicked".to_owned())),
            };
            let (parts, body) = reply.into_parts();
            let (body, trailers, whole) = match body.collect().await {
                Ok(collected) => {
                    let trailers = collected.trailers().cloned().unwrap_or_default();
                    (collected.to_bytes(), trailers, true)
                }
                // The method answered and its reply broke on the way: it ran, so its key
                // completes, without a reply to replay.
                Err(err) => {
                    let err: BoxError = err.into();
                    let status = Status::internal(format!("the reply failed: {err}"));
                    let mut trailers = HeaderMap::new();
                    let _ = status.add_header(&mut trailers);
                    (Bytes::new(), trailers, false)
                }
            };
            let code = Status::from_header_map(&trailers)
                .or_else(|| Status::from_header_map(&parts.headers))
                .map_or(Code::Unknown, |status| status.code());
            if whole && (config.storage)(code) == Storage::Release {
                let released = ReplyBody::new(body, trailers);
                return Err(Failure::Released(http::Response::from_parts(
                    parts,
                    crate::http::Body::stream(released),
                )));
            }
            let stored = StoredCall {
                headers: storable(&parts.headers, None),
                trailers: trailers.clone(),
                body: (whole && body.len() <= config.max_stored_reply).then(|| body.clone()),
            };
            *fresh.lock().unwrap_or_else(PoisonError::into_inner) = Some(Fresh {
                parts,
                body,
                trailers,
            });
            Ok(stored)
        })
        .await;
    let fresh = fresh.lock().unwrap_or_else(PoisonError::into_inner).take();
    Ok(match outcome {
        Ok(_) if ran.load(Ordering::Relaxed) => match fresh {
            Some(Fresh {
                parts,
                body,
                trailers,
            }) => http::Response::from_parts(
                parts,
                tonic::body::Body::new(ReplyBody::new(body, trailers)),
            ),
            None => status_reply(Status::internal("the call's reply was lost")),
        },
        Ok(stored) => replay(stored),
        Err(Failure::Released(reply)) => reply.map(tonic::body::Body::new),
        Err(Failure::Engine(err)) => status_reply(Status::from(err)),
        Err(Failure::Panicked(message)) => status_reply(Status::internal(message)),
        Err(Failure::Service(err)) => return Err(err),
    })
}

/// A stored reply, marked as replayed; one completed without its reply is `ALREADY_EXISTS`.
fn replay(stored: StoredCall) -> Reply {
    let Some(body) = stored.body else {
        return status_reply(Status::already_exists(
            "the first call with this key completed; its reply was too large to keep",
        ));
    };
    let mut reply = http::Response::new(tonic::body::Body::new(ReplyBody::new(
        body,
        stored.trailers,
    )));
    *reply.headers_mut() = stored.headers;
    reply
        .headers_mut()
        .insert(super::REPLAYED, HeaderValue::from_static("true"));
    reply
}
