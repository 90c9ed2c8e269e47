//! [`IdempotencyService`]: one request, from its key header to its answer.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::request::Parts;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use sha2::{Digest, Sha256};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::codec;
use crate::default_store::{carry, scoped};
use crate::error::Error;
use crate::http::body::{Body, BoxError};
use crate::http::key::{self, KeyHeader};
use crate::http::stored::{storable, Stored};
use crate::http::{Config, Problem, Replayed, Storage, REPLAYED};
use crate::key::{hex_string, Key};
use crate::store::Fingerprint;

/// The service [`IdempotencyLayer`](crate::http::IdempotencyLayer) wraps around `S`.
///
/// `S` takes requests whose body is built from the buffered bytes (`B: From<Bytes>`, as axum's
/// and `http_body_util::Full`'s are) and is cloned per request, as tower services are.
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
    tasks: TaskTracker,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>, tasks: TaskTracker) -> Self {
        IdempotencyService {
            inner,
            config,
            tasks,
        }
    }
}

impl<S: Clone> Clone for IdempotencyService<S> {
    fn clone(&self) -> Self {
        IdempotencyService {
            inner: self.inner.clone(),
            config: self.config.clone(),
            tasks: self.tasks.clone(),
        }
    }
}

impl<S> std::fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("prefix", &self.config.prefix)
            .finish_non_exhaustive()
    }
}

type ServiceFuture<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

impl<S, B, RB> tower_service::Service<Request<B>> for IdempotencyService<S>
where
    S: tower_service::Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ServiceFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The clone that was made ready serves this request; a fresh clone waits for the next.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        Box::pin(serve(
            inner,
            self.config.clone(),
            self.tasks.clone(),
            request,
        ))
    }
}

/// What the handler's run left for the request that ran it.
#[derive(Default)]
pub(crate) struct Live {
    /// The handler started.
    pub(crate) ran: AtomicBool,
    /// The response for the request that ran the handler.
    pub(crate) response: Mutex<Option<Response<Body>>>,
}

/// How a run ended, besides a stored response.
pub(crate) enum Failure<E> {
    /// The engine answered (duplicate, in flight, store down...).
    Engine(Error),
    /// The handler's response releases the key: sent as it is, not stored.
    Released(Response<Body>),
    /// The inner service failed.
    Service(E),
}

impl<E> From<Error> for Failure<E> {
    fn from(err: Error) -> Self {
        Failure::Engine(err)
    }
}

async fn serve<S, B, RB>(
    inner: S,
    config: Arc<Config>,
    tasks: TaskTracker,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: tower_service::Service<Request<B>, Response = Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let Prepared {
        parts,
        bytes,
        key,
        fingerprint,
    } = match prepare(&config, request, true).await {
        Guarded::Run(prepared) => prepared,
        Guarded::Pass(request) => return pass(inner, request).await,
        Guarded::Answer(response) => return Ok(response),
    };
    let request = Request::from_parts(parts, B::from(bytes));
    let live = Arc::new(Live::default());
    // The handler runs in a task of its own: a client that hangs up drops this future, not
    // the handler, whose response is stored for the client's retry.
    let task = tasks.spawn(carry(
        scoped(),
        run(
            inner,
            config.clone(),
            key,
            fingerprint,
            request,
            live.clone(),
        )
        .instrument(tracing::Span::current()),
    ));
    let outcome = match task.await {
        Ok(outcome) => outcome,
        Err(err) => match err.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(_) => {
                let detail = "the handler's task was cancelled (the runtime is shutting down)";
                return Ok(reject(&config, Problem::Internal, detail));
            }
        },
    };
    answer(&config, outcome, &live)
}

/// A guarded request, read and keyed, before anything is claimed.
pub(crate) struct Prepared {
    pub(crate) parts: Parts,
    pub(crate) bytes: Bytes,
    pub(crate) key: Key,
    pub(crate) fingerprint: Fingerprint,
}

/// What becomes of a request before anything is claimed.
pub(crate) enum Guarded<B> {
    /// Not guarded: its method, or no key where none is required.
    Pass(Request<B>),
    /// Refused with a problem.
    Answer(Response<Body>),
    /// To run under its key.
    Run(Prepared),
}

/// Reads the key, the scope and the body of `request` (only for the layer's methods when
/// `by_method`), and builds its key and fingerprint.
pub(crate) async fn prepare<B>(config: &Config, request: Request<B>, by_method: bool) -> Guarded<B>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let counts = &config.counts;
    if by_method && !config.methods.contains(request.method()) {
        counts.passed_through.fetch_add(1, Ordering::Relaxed);
        return Guarded::Pass(request);
    }
    let client_key = match key::read(request.headers(), &config.header_names, config.max_key_len) {
        KeyHeader::Key(key) => key,
        KeyHeader::Missing if !config.require_key => {
            counts.passed_through.fetch_add(1, Ordering::Relaxed);
            return Guarded::Pass(request);
        }
        KeyHeader::Missing => {
            let detail = format!(
                "{} requests need an {} header",
                request.method(),
                config
                    .header_names
                    .first()
                    .map_or("Idempotency-Key", |n| n.as_str())
            );
            return Guarded::Answer(reject(config, Problem::MissingKey, &detail));
        }
        KeyHeader::Invalid(why) => {
            return Guarded::Answer(reject(config, Problem::InvalidKey, &why))
        }
    };
    let (parts, body) = request.into_parts();
    let Some(scope) = (config.scope)(&parts) else {
        let detail = "the request has no caller to scope its idempotency key to";
        return Guarded::Answer(reject(config, Problem::MissingScope, detail));
    };
    let bytes = match read_request(&parts, body, config.max_request_body).await {
        Ok(bytes) => bytes,
        Err((problem, detail)) => return Guarded::Answer(reject(config, problem, &detail)),
    };
    let fingerprint = match config.fingerprint {
        Some(custom) => custom(&parts, &bytes),
        None => fingerprint(&parts, &bytes),
    };
    let scope = hex_string(&Sha256::digest(scope.as_bytes())[..16]);
    let key = Key::new(
        &config.prefix,
        1,
        &[
            &scope,
            &parts.method.as_str(),
            &parts.uri.path(),
            &client_key,
        ],
    );
    match key {
        Ok(key) => Guarded::Run(Prepared {
            parts,
            bytes,
            key,
            fingerprint,
        }),
        Err(err) => Guarded::Answer(reject(config, Problem::Internal, &err.to_string())),
    }
}

/// An unguarded request: the inner service's answer, body boxed.
async fn pass<S, B, RB>(mut inner: S, request: Request<B>) -> Result<Response<Body>, S::Error>
where
    S: tower_service::Service<Request<B>, Response = Response<RB>>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    Ok(inner.call(request).await?.map(Body::stream))
}

/// The request body, whole, or why not.
pub(crate) async fn read_request<B>(
    parts: &Parts,
    body: B,
    max: usize,
) -> Result<Bytes, (Problem, String)>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        let detail = format!("the request body is larger than {max} bytes");
        (Problem::RequestTooLarge, detail)
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > max as u64) {
        return Err(too_large());
    }
    match Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(err) => Err((
            Problem::InvalidBody,
            format!("the request body could not be read: {err}"),
        )),
    }
}

/// SHA-256 of the method, path, query and body, each length-prefixed.
fn fingerprint(parts: &Parts, body: &[u8]) -> Fingerprint {
    let mut hash = Sha256::new();
    for part in [
        parts.method.as_str().as_bytes(),
        parts.uri.path().as_bytes(),
        parts.uri.query().unwrap_or("").as_bytes(),
        body,
    ] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    let digest = hash.finalize();
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    Fingerprint::from_bytes(first)
}

/// Claims the key and runs the inner service under it; the engine completes the key with
/// the stored response, or releases it.
async fn run<S, B, RB>(
    mut inner: S,
    config: Arc<Config>,
    key: Key,
    fingerprint: Fingerprint,
    request: Request<B>,
    live: Arc<Live>,
) -> Result<Stored, Failure<S::Error>>
where
    S: tower_service::Service<Request<B>, Response = Response<RB>>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    config
        .idempotency
        .operation::<Result<Stored, Failure<S::Error>>>(key)
        .fingerprint_of(fingerprint)
        .replay_with(|stored| stored.encode(codec::OK), Stored::decode)
        .run(async {
            live.ran.store(true, Ordering::Relaxed);
            let response = inner.call(request).await.map_err(Failure::Service)?;
            capture(&config, response, &live).await
        })
        .await
}

/// The stored form of the handler's `response`, its body read up to the limit; the response
/// to send is left in `live`. A response that releases the key is the failure sent as it is.
pub(crate) async fn capture<RB, E>(
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
                    return (None, Body::resume(frames, None, Some(body)));
                };
                size += data.len();
                frames.push(frame);
                if size > max {
                    return (None, Body::resume(frames, None, Some(body)));
                }
            }
            Some(Err(err)) => return (None, Body::resume(frames, Some(err), None)),
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

/// The response to send for a run's outcome.
pub(crate) fn answer<E>(
    config: &Config,
    outcome: Result<Stored, Failure<E>>,
    live: &Live,
) -> Result<Response<Body>, E> {
    let counts = &config.counts;
    match outcome {
        Ok(stored) => {
            let fresh = live
                .response
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            match fresh {
                Some(mut response) => {
                    counts.fresh.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(outcome = "fresh", status = %response.status(), "stored");
                    response.extensions_mut().insert(Replayed(false));
                    Ok(response)
                }
                None => Ok(replay(config, stored)),
            }
        }
        Err(Failure::Released(mut response)) => {
            counts.released.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(outcome = "released", status = %response.status(), "not stored");
            response.extensions_mut().insert(Replayed(false));
            Ok(response)
        }
        Err(Failure::Service(err)) => Err(err),
        Err(Failure::Engine(err)) => Ok(engine_problem(config, &err)),
    }
}

/// A stored response, as a retry gets it.
fn replay(config: &Config, stored: Stored) -> Response<Body> {
    let Stored {
        status,
        headers,
        body,
    } = stored;
    let mut response = match body {
        Some(body) => {
            let mut response = Response::new(Body::full(body));
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            response
        }
        None => match headers.get(header::LOCATION) {
            Some(location) => {
                let mut response = Response::new(Body::full(Bytes::new()));
                *response.status_mut() = StatusCode::SEE_OTHER;
                response
                    .headers_mut()
                    .insert(header::LOCATION, location.clone());
                response
            }
            None => {
                let detail = format!(
                    "the first request with this key completed with status {status}, but its \
                     response body was too large to keep; it is not run again"
                );
                return reject(config, Problem::ResponseNotStored, &detail);
            }
        },
    };
    config.counts.replayed.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(outcome = "replayed", status = %response.status(), "replayed");
    response
        .headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    response.extensions_mut().insert(Replayed(true));
    response
}

/// The problem for an engine answer other than a run or a replay.
fn engine_problem(config: &Config, err: &Error) -> Response<Body> {
    let (problem, detail) = match err {
        Error::InProgress { .. } => (
            Problem::InFlight,
            "a request with this idempotency key is being processed; retry later".to_owned(),
        ),
        Error::PayloadMismatch { .. } => (
            Problem::PayloadMismatch,
            "this idempotency key was used with another request (method, path, query or body)"
                .to_owned(),
        ),
        Error::Held { .. } => (
            Problem::Held,
            "the first request with this key ended with an unknown outcome; the key is held"
                .to_owned(),
        ),
        Error::Duplicate { .. } => (
            Problem::AlreadyProcessed,
            "this key was processed without a response to replay".to_owned(),
        ),
        Error::Store(store) => (
            Problem::StoreUnavailable,
            format!(
                "the idempotency store did not answer ({:?}); nothing was run",
                store.kind()
            ),
        ),
        other => (Problem::Internal, other.to_string()),
    };
    reject(config, problem, &detail)
}

/// A problem response, counted.
pub(crate) fn reject(config: &Config, problem: Problem, detail: &str) -> Response<Body> {
    config.counts.rejected.fetch_add(1, Ordering::Relaxed);
    let retry_after = matches!(problem, Problem::InFlight | Problem::StoreUnavailable)
        .then_some(config.retry_after);
    tracing::debug!(problem = problem.slug(), detail, "answered with a problem");
    problem.response(&config.problem_base, detail, retry_after)
}
