//! [`IdempotencyService`]: one request, from its key header to its answer.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::FutureExt as _;
use http::{Request, Response};
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::codec;
use crate::default_store::{carry, scoped};
use crate::http::body::{Body, BoxError};
use crate::http::detached::{Detached, Ended};
use crate::http::failure::Failure;
use crate::http::request::{prepare, Guarded, Prepared};
use crate::http::respond::{answer, reject};
use crate::http::stored::Stored;
use crate::http::stream::{self, Live, Tail};
use crate::http::{Config, Problem};
use crate::key::Key;
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

/// What a panic said, when it said it with a string.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(message), _) => (*message).to_owned(),
        (_, Some(message)) => message.clone(),
        _ => "a panic without a message".to_owned(),
    }
}

/// The answer of a run, or the inner service's error.
type Reply<E> = oneshot::Sender<Result<Response<Body>, E>>;

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
        previous,
    } = match prepare(&config, request, true).await {
        Guarded::Run(prepared) => prepared,
        Guarded::Pass(request) => return pass(inner, request).await,
        Guarded::Answer(response) => return Ok(response),
    };
    let request = Request::from_parts(parts, B::from(bytes));
    let (reply, mut replied) = oneshot::channel();
    // The run, from the claim to the answer and its count, goes to its end whatever the
    // client does: it is polled here, and goes on in a task of its own if this future is
    // dropped first (a client that hangs up) or once the answer is out while the run goes on
    // (a streamed response's tail); its response is then stored for the client's retry and
    // counted.
    // Boxed as soon as it is made: the run holds the handler's future and the engine's, and
    // every wrapper would move it by value; a box moves as a pointer.
    let run = Box::pin(conclude(
        inner,
        config.clone(),
        (key, previous),
        fingerprint,
        request,
        reply,
    ));
    let mut run = Detached::new(
        carry(scoped(), run.instrument(tracing::Span::current())),
        &tasks,
    );
    // The run first: its last poll sends the answer, and a run that ended is not spawned.
    let first = std::future::poll_fn(|cx| match run.poll_run(cx) {
        Poll::Ready(ended) => Poll::Ready(Err(ended)),
        Poll::Pending => Pin::new(&mut replied).poll(cx).map(Ok),
    })
    .await;
    match first {
        // The answer while the run goes on: dropping `run` moves it to its task.
        Ok(Ok(answer)) => return answer,
        Err(Ok(())) => {
            if let Ok(answer) = replied.try_recv() {
                return answer;
            }
        }
        Err(Err(Ended::Panicked(panic))) => tracing::error!(
            panic = %panic_message(&*panic),
            "the idempotency layer panicked while answering"
        ),
        Ok(Err(_)) | Err(Err(Ended::Gone)) => {}
    }
    // The run ended (or panicked) without an answer: a bug of the layer's.
    Ok(reject(
        &config,
        Problem::Internal,
        "the idempotency layer failed while answering",
    ))
}

/// Runs the request under its key and sends its answer on `reply`, counted here, where the
/// outcome is known, whether or not the client still waits for it.
async fn conclude<S, B, RB>(
    inner: S,
    config: Arc<Config>,
    key: (Key, Option<Key>),
    fingerprint: Fingerprint,
    request: Request<B>,
    reply: Reply<S::Error>,
) where
    S: tower_service::Service<Request<B>, Response = Response<RB>>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let live = Live::default();
    let reply = Mutex::new(Some(reply));
    let outcome = run(inner, &config, key, fingerprint, request, &live, &reply).await;
    // The completion is recorded (or known refused): the rest of a streamed response may go.
    let tail = live
        .tail
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    if let Some(head) = tail.and_then(Tail::release) {
        // Held with its body: both go now, in one write.
        live.streamed.store(true, Ordering::Relaxed);
        if let Some(reply) = reply.lock().unwrap_or_else(PoisonError::into_inner).take() {
            let _ = reply.send(Ok(head));
        }
    }
    let answer = answer(&config, outcome, &live);
    // The client may be gone, or have its streamed response already: the answer is counted
    // all the same.
    let reply = reply.lock().unwrap_or_else(PoisonError::into_inner).take();
    if let Some(reply) = reply {
        let _ = reply.send(answer);
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

/// Claims the key and runs the inner service under it, its response streamed to the client
/// ([`stream`]); the engine completes the key with the stored response, or releases it.
async fn run<S, B, RB>(
    mut inner: S,
    config: &Config,
    (key, previous): (Key, Option<Key>),
    fingerprint: Fingerprint,
    request: Request<B>,
    live: &Live,
    reply: &Mutex<Option<Reply<S::Error>>>,
) -> Result<Stored, Failure<S::Error>>
where
    S: tower_service::Service<Request<B>, Response = Response<RB>>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    // The previous layout's record is read with the claim, in its round trip where the store
    // can: its answer is what a read after the claim would give (a request still running
    // under the previous layout is not seen either way). A request answered without running
    // (a replay, a duplicate) does not wait for it.
    config
        .idempotency
        .operation::<Result<Stored, Failure<S::Error>>>(key)
        .fingerprint_of(fingerprint)
        .replay_with(|stored| stored.encode(codec::OK), Stored::decode)
        .done_if_completed(previous)
        // A closure that makes the body when it is called, not the body itself: the closure
        // holds the request and a few references, where the body's future, unstarted, is as
        // large as it will ever be, and the engine keeps the closure in its frame until then.
        .run_with(|_| async {
            live.ran.store(true, Ordering::Relaxed);
            // A handler that panics has done nothing it answered for: its key is released
            // (the engine sees an error) and the client gets a `500`, not a dropped connection.
            let response = match AssertUnwindSafe(inner.call(request)).catch_unwind().await {
                Ok(response) => response.map_err(Failure::Service)?,
                Err(panic) => return Err(Failure::Panicked(panic_message(&*panic))),
            };
            let send_head = |head| {
                live.streamed.store(true, Ordering::Relaxed);
                if let Some(reply) = reply.lock().unwrap_or_else(PoisonError::into_inner).take() {
                    let _ = reply.send(Ok(head));
                }
            };
            stream::capture(config, response, send_head, &live.tail).await
        })
        .await
}
