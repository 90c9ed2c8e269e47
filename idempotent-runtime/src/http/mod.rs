//! HTTP `Idempotency-Key` for tower and axum: [`IdempotencyLayer`] runs a handler once per
//! key and replays its response to every retry.
//!
//! Clients send `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"` (a structured-field
//! string as the IETF draft "The Idempotency-Key HTTP Header Field" defines it; a bare token is
//! accepted too) on `POST` and `PATCH`. The layer claims the key in the store **before** the
//! handler runs, with the same engine, store and guarantees as the `#[idempotent]` attribute:
//!
//! | request | answer |
//! |---|---|
//! | first with its key | the handler runs; a storable response is kept ([`Storage`]) |
//! | retry after the first completed | the stored status, headers and body, with `Idempotent-Replayed: true` |
//! | retry while the first runs | `409` [`in-flight`](#in-flight) with `Retry-After` (or it waits, with [`OnInProgress::Wait`](crate::OnInProgress::Wait)) |
//! | same key, another method, path, query or body | `422` [`payload-mismatch`](#payload-mismatch) |
//! | no key where one is required | `400` [`missing-key`](#missing-key) |
//! | store down | `503` [`store-unavailable`](#store-unavailable); the handler does not run (fail closed) |
//!
//! Keys are scoped: the key stored is the scope function's caller (hashed) and the client's
//! key, so one caller never gets another's response.
//!
//! # One key, one request
//!
//! As the IETF draft has it, a key identifies one request: its method, path, query and body
//! make the request's fingerprint, and the same key sent with another method, to another path
//! or with another query or body is `422` [`payload-mismatch`](#payload-mismatch); the handler
//! does not run. Paths are compared as the router reads them: percent-escapes are decoded
//! (`/pay/%61bc` is `/pay/abc`, `/pay/a%40b` is `/pay/a@b`) but those of `/` and `%`, whose
//! hex digits are compared in uppercase (`/pay/x%2fy` is `/pay/x%2Fy`, not `/pay/x/y`);
//! letter case and a trailing slash make another path, as they make another axum route.
//! Queries are compared after decoding the escapes of unreserved characters (RFC 3986
//! section 6.2.2). The path and query are hashed, not stored, so they may be of any length.
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use axum::{routing::post, Router};
//! use idempotent_runtime::{http::IdempotencyLayer, Idempotency, MemoryStore};
//!
//! let idempotency = Idempotency::new(Duration::from_secs(24 * 3600))
//!     .store(Arc::new(MemoryStore::new()));
//! // The caller: here an API key id an authentication layer put in a header.
//! let layer = IdempotencyLayer::new(idempotency, |request: &http::request::Parts| {
//!     request.headers.get("x-api-key-id")?.to_str().ok().map(str::to_owned)
//! });
//! let app: Router = Router::new()
//!     .route("/orders", post(async || "created"))
//!     .layer(layer);
//! ```
//!
//! # What is stored
//!
//! By default ([`Storage::default_for`]) 2xx, 3xx and definitive 4xx responses are stored and
//! replayed; 5xx, `408`, `425`, `429`, `401` and `403` release the key, so a retry runs the
//! handler again. Stored headers leave out hop-by-hop headers, `Date`, `Content-Length` and
//! `Set-Cookie`, then pass through [`IdempotencyLayer::sanitize_headers`]. A response body
//! larger than [`IdempotencyLayer::max_stored_body`] (or one that fails while read, or has
//! trailers, or whose client left before its end) still completes the key, without its body:
//! the first client gets the whole body, retries get `303 See Other` to the response's
//! `Location` when it has one, else the problem [`response-not-stored`](#response-not-stored).
//! The handler never runs twice because its answer was too large to keep.
//!
//! # Streamed responses
//!
//! The response is sent as the handler produces it: its head as soon as the handler returned
//! it, each body frame as soon as it is produced (server-sent events reach the client one by
//! one), while the layer keeps a copy up to the stored-body limit. The handler's effect has
//! happened once it returned its head, so from then on the key is never released; it
//! **completes** when the body ended (with the body, replayed to retries), or as soon as the
//! body will not be kept: it outgrew the limit, failed or had trailers, or the client left
//! before its end (the body is then read no further than what is ready). Until then a retry
//! gets `409` [`in-flight`](#in-flight). The body's last frame and its end (or, past the
//! limit, the rest of the body) reach the client only after the completion is recorded, so a
//! client that read the whole response and retries gets the replay. With
//! [`InTransaction`] the response is sent after the commit instead, whole.
//!
//! # Telling a replay from a fresh run
//!
//! Replays carry `Idempotent-Replayed: true` ([`REPLAYED`]); every response of the guarded
//! path carries a [`Replayed`] extension for middleware outside the layer;
//! [`IdempotencyLayer::counts`] counts fresh runs, replays, released keys, problems and
//! requests passed through; each answer is a `tracing` debug event with an `outcome` field
//! (`fresh`, `replayed`, `released`) or a `problem` field.
//!
//! # Disconnects and shutdown
//!
//! Once a handler started it runs to completion in a task of the layer's, even when the
//! client hangs up (a server drops the request's future), and its response is stored: the
//! client's retry gets the replay. The outcome is counted in that task too, so
//! [`IdempotencyLayer::counts`] has the runs whose clients left. [`IdempotencyLayer::shutdown`]
//! waits for those tasks.
//!
//! A handler that panics is answered `500` [`internal`](#internal) (the connection stays up)
//! and its key is released: it answered for nothing, so a retry runs it again.
//!
//! # In the business transaction
//!
//! On the SQL stores, [`IdempotencyLayer::in_transaction`] gives handlers an
//! [`InTransaction`]: the claim, the handler's writes and the stored response commit in one
//! database transaction, so the effect and its record exist together or not at all.
//!
//! # Problems
//!
//! Every answer of the layer's own is an RFC 9457 `application/problem+json` body whose `type`
//! is the [problem base](IdempotencyLayer::problem_base) followed by one of these names (see
//! [`Problem`]):
//!
//! ### missing-key
//! `400`: the method requires a key and the request has none.
//! ### invalid-key
//! `400`: the key is malformed, empty, longer than [`IdempotencyLayer::max_key_len`], or
//! sent more than once.
//! ### missing-scope
//! `400`: the scope function found no caller.
//! ### request-too-large
//! `413`: the body is larger than [`IdempotencyLayer::max_request_body`].
//! ### invalid-body
//! `400`: the body could not be read.
//! ### in-flight
//! `409` with `Retry-After`: a request with this key is running.
//! ### payload-mismatch
//! `422`: the key was first used with another method, path, query or body.
//! ### held
//! `409`: the first request's outcome is unknown and the key is held.
//! ### already-processed
//! `409`: the key was completed elsewhere (a consumer sharing the key space), without a
//! response.
//! ### response-not-stored
//! `409`: the first response was completed without its body (too large, failed, or its
//! client left mid-stream) and had no `Location`.
//! ### store-unavailable
//! `503` with `Retry-After`: the store did not answer; nothing ran.
//! ### internal
//! `500`: the handler panicked (its key is released: a retry runs it), or the layer failed
//! (a stored response it cannot read).

mod body;
pub(crate) mod detached;
pub(crate) mod failure;
pub(crate) mod key;
mod problem;
pub(crate) mod request;
mod respond;
mod service;
pub(crate) mod stored;
mod stream;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod transaction;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderMap, HeaderName, Method, StatusCode};
use tokio_util::task::TaskTracker;

use crate::engine::Idempotency;
use crate::store::{Fingerprint, MAX_DURATION};

pub use body::{Body, BoxError};
pub use problem::Problem;
pub use service::IdempotencyService;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite")))
)]
pub use transaction::InTransaction;

/// The response header that marks a replay.
pub const REPLAYED: &str = "idempotent-replayed";

/// Whether a response is a replay: an extension on every response the layer's handler path
/// produced (fresh or replayed), for middleware outside the layer.
///
/// ```
/// use idempotent_runtime::http::Replayed;
///
/// let mut response = http::Response::new(());
/// response.extensions_mut().insert(Replayed(true));
/// assert_eq!(response.extensions().get::<Replayed>(), Some(&Replayed(true)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replayed(pub bool);

/// What happens to the key after the handler answered with a status.
///
/// ```
/// use http::StatusCode;
/// use idempotent_runtime::http::Storage;
///
/// assert_eq!(Storage::default_for(StatusCode::CREATED), Storage::Store);
/// assert_eq!(Storage::default_for(StatusCode::UNPROCESSABLE_ENTITY), Storage::Store);
/// assert_eq!(Storage::default_for(StatusCode::TOO_MANY_REQUESTS), Storage::Release);
/// assert_eq!(Storage::default_for(StatusCode::BAD_GATEWAY), Storage::Release);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// Complete the key with the response: retries get it replayed.
    Store,
    /// Give the key back: the handler runs again on a retry (nothing was done, or the error
    /// is transient).
    Release,
}

impl Storage {
    /// The default: 2xx, 3xx and definitive 4xx are stored; 5xx and 1xx, `408 Request
    /// Timeout`, `425 Too Early`, `429 Too Many Requests`, `401 Unauthorized` and
    /// `403 Forbidden` (nothing ran; the client may fix its credentials) release the key.
    pub fn default_for(status: StatusCode) -> Storage {
        match status.as_u16() {
            401 | 403 | 408 | 425 | 429 => Storage::Release,
            200..=499 => Storage::Store,
            _ => Storage::Release,
        }
    }
}

type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type FingerprintFn = fn(&Parts, &[u8]) -> Fingerprint;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) idempotency: Idempotency,
    pub(crate) scope: Arc<ScopeFn>,
    pub(crate) prefix: String,
    pub(crate) header_names: Vec<HeaderName>,
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) max_key_len: usize,
    pub(crate) max_request_body: usize,
    pub(crate) max_stored_body: usize,
    pub(crate) storage: fn(StatusCode) -> Storage,
    pub(crate) sanitize: Option<fn(&mut HeaderMap)>,
    pub(crate) fingerprint: Option<FingerprintFn>,
    pub(crate) retry_after: Duration,
    pub(crate) previous_layout: bool,
    pub(crate) problem_base: String,
    pub(crate) counts: Arc<Counters>,
}

/// Requests the layer answered, by outcome, since it was built.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) fresh: AtomicU64,
    pub(crate) replayed: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) passed_through: AtomicU64,
}

/// How many requests a layer answered, by outcome: [`IdempotencyLayer::counts`].
#[non_exhaustive]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// The handler ran and its response was stored.
    pub fresh: u64,
    /// A stored response was replayed (or a `303` to its `Location`).
    pub replayed: u64,
    /// The handler ran and its response released the key ([`Storage::Release`]).
    pub released: u64,
    /// The layer answered with a [`Problem`].
    pub rejected: u64,
    /// The request was not guarded (its method, or no key where none is required).
    pub passed_through: u64,
}

/// A tower [`Layer`](tower_layer::Layer) that makes the services it wraps idempotent per
/// `Idempotency-Key`: see the [module documentation](self).
///
/// Cheap to clone; clones share their settings, counters and tasks.
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
    tasks: TaskTracker,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("idempotency", &self.config.idempotency)
            .field("prefix", &self.config.prefix)
            .field("header_names", &self.config.header_names)
            .field("methods", &self.config.methods)
            .field("require_key", &self.config.require_key)
            .finish_non_exhaustive()
    }
}

/// Default key prefix.
const PREFIX: &str = "http";

impl IdempotencyLayer {
    /// A layer with `idempotency`'s store, ttl, lease and in-progress policy, and `scope`:
    /// the caller a request comes from (tenant, principal, API key id), part of every key so
    /// that one caller never replays another's response. `scope` returning `None` answers
    /// [`Problem::MissingScope`]; a service with a single caller returns `Some(String::new())`.
    ///
    /// Defaults: keys from `Idempotency-Key` or `X-Idempotency-Key`, required on `POST` and
    /// `PATCH`, at most 255 characters; request bodies up to 1 MiB, stored response bodies up
    /// to 256 KiB; [`Storage::default_for`]; `Retry-After: 1` on `409 in-flight`.
    pub fn new<F>(idempotency: Idempotency, scope: F) -> IdempotencyLayer
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        IdempotencyLayer {
            config: Arc::new(Config {
                idempotency,
                scope: Arc::new(scope),
                prefix: PREFIX.to_owned(),
                header_names: vec![
                    HeaderName::from_static("idempotency-key"),
                    HeaderName::from_static("x-idempotency-key"),
                ],
                methods: vec![Method::POST, Method::PATCH],
                require_key: true,
                max_key_len: 255,
                max_request_body: 1 << 20,
                max_stored_body: 256 << 10,
                storage: Storage::default_for,
                sanitize: None,
                fingerprint: None,
                retry_after: Duration::from_secs(1),
                previous_layout: true,
                problem_base:
                    "https://docs.rs/idempotent-runtime/latest/idempotent_runtime/http/index.html#"
                        .to_owned(),
                counts: Arc::default(),
            }),
            tasks: TaskTracker::new(),
        }
    }

    fn config(&mut self) -> &mut Config {
        // Settings are made before the layer is cloned into services; a clone made earlier
        // keeps the settings it was cloned with (and shares the counters).
        Arc::make_mut(&mut self.config)
    }

    /// Whether a request that would run its handler first looks for the record the same
    /// request has under the previous key layout (`<prefix>:v1:{scope, method, path, key}`,
    /// written by earlier versions of this layer): if that record is completed, the request
    /// was processed before the upgrade, and it is answered `409`
    /// [`already-processed`](Problem::AlreadyProcessed) instead of running again (default:
    /// `true`). It costs one read per request, sent with the claim so that a request waits
    /// one round trip for both: in the claim's own pipeline on Redis
    /// ([`Store::claim_and_is_completed`](crate::store::Store::claim_and_is_completed)), beside
    /// it on other stores, where a replay or a duplicate is answered without waiting for it. A read that fails, or that has not answered within half the lease, runs
    /// nothing: the request is answered `503` and its key given back. Turn it off once the
    /// layer has run this version for a `ttl` (no record of the previous layout lives
    /// longer), or for a deployment that never ran the previous one. A request
    /// still running under the previous layout on an old instance during a rolling upgrade is
    /// not seen.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotent_runtime::http::IdempotencyLayer;
    /// use idempotent_runtime::{Idempotency, MemoryStore};
    ///
    /// let settings = Idempotency::new(Duration::from_secs(86_400)).store(Arc::new(MemoryStore::new()));
    /// let layer = IdempotencyLayer::new(settings, |_| Some(String::new())).previous_layout(false);
    /// # let _ = layer;
    /// ```
    pub fn previous_layout(mut self, check: bool) -> Self {
        self.config().previous_layout = check;
        self
    }

    /// The key prefix (default `http`): keys are `<prefix>:v2:{scope, key}`.
    /// Give each API its own when several share a store.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config().prefix = prefix.into();
        self
    }

    /// The header names a key is read from, in place of `Idempotency-Key` and
    /// `X-Idempotency-Key`. A request carrying more than one of them is
    /// [`Problem::InvalidKey`].
    pub fn header_names(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config().header_names = names.into_iter().collect();
        self
    }

    /// The methods the layer guards (default `POST` and `PATCH`); requests with other methods
    /// pass through untouched.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config().methods = methods.into_iter().collect();
        self
    }

    /// Whether a guarded request without a key is refused with [`Problem::MissingKey`]
    /// (`true`, the default) or passed through unguarded (`false`).
    pub fn require_key(mut self, required: bool) -> Self {
        self.config().require_key = required;
        self
    }

    /// The longest key accepted, in characters (default 255). Keys longer than a key part
    /// can be ([`MAX_PART_LEN`](crate::key::MAX_PART_LEN), 4096 bytes) are refused with
    /// [`Problem::InvalidKey`] whatever this setting.
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.config().max_key_len = len;
        self
    }

    /// The largest request body the layer buffers (default 1 MiB); larger ones get
    /// [`Problem::RequestTooLarge`] and nothing is claimed.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config().max_request_body = bytes;
        self
    }

    /// The largest response body kept for replay (default 256 KiB); see the
    /// [module documentation](self#what-is-stored) for larger ones. Keep it within the
    /// store's [`max_result_size`](crate::Store::max_result_size).
    pub fn max_stored_body(mut self, bytes: usize) -> Self {
        self.config().max_stored_body = bytes;
        self
    }

    /// Which statuses are stored and which release the key, in place of
    /// [`Storage::default_for`].
    pub fn storage(mut self, storage: fn(StatusCode) -> Storage) -> Self {
        self.config().storage = storage;
        self
    }

    /// Edits the headers kept for replay (after the layer removed hop-by-hop headers, `Date`,
    /// `Content-Length` and `Set-Cookie`): remove per-response ids, tokens, anything a retry
    /// must not see.
    pub fn sanitize_headers(mut self, sanitize: fn(&mut HeaderMap)) -> Self {
        self.config().sanitize = Some(sanitize);
        self
    }

    /// The fingerprint of the request's payload, in place of the default SHA-256 of its query
    /// and body: for example selected JSON fields, so that a client re-serialising the same
    /// order is not a mismatch. The method and the path are part of the request's fingerprint
    /// whatever this function returns, so a key reused on another route is still a mismatch.
    pub fn fingerprint(mut self, fingerprint: fn(&Parts, &[u8]) -> Fingerprint) -> Self {
        self.config().fingerprint = Some(fingerprint);
        self
    }

    /// The `Retry-After` sent with [`Problem::InFlight`] and [`Problem::StoreUnavailable`]
    /// (default 1 second; rounded up to whole seconds, at least 1), clamped to
    /// [`MAX_DURATION`] (36,500 days) as the store's durations are.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotent_runtime::{http::IdempotencyLayer, Idempotency, MemoryStore};
    ///
    /// let idempotency = Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
    /// // `Retry-After: 3153600000`, not a panic.
    /// let layer = IdempotencyLayer::new(idempotency, |_: &http::request::Parts| Some(String::new()))
    ///     .retry_after(Duration::MAX);
    /// # let _ = layer;
    /// ```
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.config().retry_after = after.min(MAX_DURATION);
        self
    }

    /// The start of every problem `type` URI; the problem's [`slug`](Problem::slug) follows.
    /// Defaults to this module's documentation, whose headings describe each problem.
    pub fn problem_base(mut self, base: impl Into<String>) -> Self {
        self.config().problem_base = base.into();
        self
    }

    /// Requests answered so far, by outcome (shared by the layer's clones and services).
    pub fn counts(&self) -> Counts {
        let c = &self.config.counts;
        Counts {
            fresh: c.fresh.load(Ordering::Relaxed),
            replayed: c.replayed.load(Ordering::Relaxed),
            released: c.released.load(Ordering::Relaxed),
            rejected: c.rejected.load(Ordering::Relaxed),
            passed_through: c.passed_through.load(Ordering::Relaxed),
        }
    }

    /// Waits, at most `within`, for handlers still running (those whose clients hung up
    /// included) to finish and store their responses; call it after the server stopped
    /// accepting requests. Returns `false` when some were still running at the deadline.
    pub async fn shutdown(&self, within: Duration) -> bool {
        drain(&self.tasks, within).await
    }
}

/// Waits, at most `within`, for `tasks` to finish; `false` when some still ran at the deadline.
/// The tracker stays open for tasks spawned afterwards.
pub(crate) async fn drain(tasks: &TaskTracker, within: Duration) -> bool {
    tasks.close();
    let done = tokio::time::timeout(within, tasks.wait()).await.is_ok();
    tasks.reopen();
    done
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> IdempotencyService<S> {
        IdempotencyService::new(inner, self.config.clone(), self.tasks.clone())
    }
}
