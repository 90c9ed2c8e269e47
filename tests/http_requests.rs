//! What the HTTP layer takes to be one request, over real HTTP (an axum server on 127.0.0.1
//! and a real HTTP/1.1 client) on the memory store, Redis and PostgreSQL: a key identifies
//! one request, method and path included, and the path is compared as the router reads it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/forward.rs"]
mod forward;
#[path = "support/http_harness.rs"]
mod http_harness;
#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use http_harness::{send, serve, Answer, Running, BACKENDS};

/// `POST`/`PATCH /pay/{id}` and `POST /refund/{id}`: each run counted, the id (as axum decoded
/// it) and the run's number in the body.
fn app(runs: Arc<AtomicUsize>) -> Router {
    async fn pay(
        State(runs): State<Arc<AtomicUsize>>,
        Path(id): Path<String>,
    ) -> (StatusCode, String) {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        (StatusCode::CREATED, format!("paid {id} #{n}"))
    }
    async fn refund(
        State(runs): State<Arc<AtomicUsize>>,
        Path(id): Path<String>,
    ) -> (StatusCode, String) {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        (StatusCode::CREATED, format!("refunded {id} #{n}"))
    }
    Router::new()
        .route("/pay/{id}", post(pay).patch(pay))
        .route("/refund/{id}", post(refund))
        .with_state(runs)
}

async fn start(backend: http_harness::Backend) -> (Running, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    (serve(backend, app(runs.clone()), |layer| layer).await, runs)
}

/// Percent-encodings axum decodes to the same path parameter are the same request: an
/// encoded unreserved character, an encoded reserved one, lower- or uppercase hex. The handler
/// runs once per key and the retry is a replay.
#[tokio::test]
async fn an_encoded_path_is_the_same_request() {
    for backend in BACKENDS {
        let (server, runs) = start(backend).await;
        let first = send(server.post("/pay/abc", "k1")).await;
        assert_eq!(
            (first.status, first.text()),
            (StatusCode::CREATED, "paid abc #1".into())
        );
        for encoded in ["/pay/%61bc", "/pay/%61%62%63", "/pay/ab%63"] {
            let again = send(server.post(encoded, "k1")).await;
            assert_eq!(again.status, StatusCode::CREATED, "{backend:?} {encoded}");
            assert!(again.replayed(), "{backend:?} {encoded}");
            assert_eq!(again.body, first.body);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{backend:?}");

        // The router decodes reserved characters in a parameter too.
        let at = send(server.post("/pay/a@b", "k2")).await;
        assert_eq!(at.text(), "paid a@b #2");
        let encoded = send(server.post("/pay/a%40b", "k2")).await;
        assert!(encoded.replayed(), "{backend:?}");
        assert_eq!(encoded.body, at.body);

        // `%2f` and `%2F` are one escape (a slash inside the parameter, not a separator).
        let lower = send(server.post("/pay/x%2fy", "k3")).await;
        assert_eq!(lower.text(), "paid x/y #3");
        let upper = send(server.post("/pay/x%2Fy", "k3")).await;
        assert!(upper.replayed(), "{backend:?}");
        assert_eq!(upper.body, lower.body);
        assert_eq!(runs.load(Ordering::SeqCst), 3, "{backend:?}");

        // What the handler sees of an encoded path, under a key of its own: the same id.
        let fresh = send(server.post("/pay/%61bc", "k4")).await;
        assert_eq!(fresh.text(), "paid abc #4");
        let counts = server.layer.counts();
        assert_eq!((counts.fresh, counts.replayed), (4, 5), "{backend:?}");
    }
}

/// A trailing slash, another letter case or a decoded `%2F` make another route for axum, so
/// another request: the same key on it is `422 payload-mismatch` and nothing runs; under
/// keys of their own they get the router's own answers.
#[tokio::test]
async fn a_trailing_slash_or_another_case_is_another_request() {
    for backend in BACKENDS {
        let (server, runs) = start(backend).await;
        assert_eq!(
            send(server.post("/pay/abc", "k")).await.status,
            StatusCode::CREATED
        );
        for other in ["/pay/abc/", "/pay/ABC", "/Pay/abc", "/pay/a%62c/"] {
            let answer = send(server.post(other, "k")).await;
            assert_eq!(
                answer.status,
                StatusCode::UNPROCESSABLE_ENTITY,
                "{backend:?} {other}"
            );
            assert_eq!(answer.problem(), "payload-mismatch");
        }
        assert_eq!(
            send(server.post("/pay/x%2Fy", "k2")).await.text(),
            "paid x/y #2"
        );
        let split = send(server.post("/pay/x/y", "k2")).await;
        assert_eq!(
            split.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{backend:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{backend:?}");

        let upper = send(server.post("/pay/ABC", "k3")).await;
        assert_eq!(upper.text(), "paid ABC #3");
        let slash = send(server.post("/pay/abc/", "k4")).await;
        assert_eq!(slash.status, StatusCode::NOT_FOUND, "{backend:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 3, "{backend:?}");
    }
}

/// Per the IETF draft a key identifies one request: the same key with another path, method or
/// query is `422 payload-mismatch` and the handler does not run; the same method, path, query
/// and body is a replay.
#[tokio::test]
async fn a_key_reused_with_another_path_or_method_is_422() {
    for backend in BACKENDS {
        let (server, runs) = start(backend).await;
        let first = send(server.post("/pay/abc", "k").body("100 EUR")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        for (method, path) in [
            ("POST", "/refund/abc"),
            ("POST", "/pay/abd"),
            ("PATCH", "/pay/abc"),
            ("POST", "/pay/abc?currency=usd"),
        ] {
            let answer = send(server.request(method, path, "k").body("100 EUR")).await;
            assert_eq!(
                answer.status,
                StatusCode::UNPROCESSABLE_ENTITY,
                "{backend:?} {method} {path}"
            );
            assert_eq!(answer.problem(), "payload-mismatch");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{backend:?}");
        let again = send(server.post("/pay/abc", "k").body("100 EUR")).await;
        assert!(again.replayed(), "{backend:?}");
        assert_eq!(again.body, first.body);
        let counts = server.layer.counts();
        assert_eq!(
            (counts.fresh, counts.replayed, counts.rejected),
            (1, 1, 4),
            "{backend:?}"
        );
    }
}

/// A 5,000-character path is a request like any other (the path is hashed, not part of the
/// stored key): it runs once and its retry is a replay. A key longer than a key part can be,
/// where the layer accepts such keys, is the client's `400 invalid-key`, not a `500`.
#[tokio::test]
async fn long_paths_run_and_overlong_keys_are_400() {
    for backend in BACKENDS {
        let (server, runs) = start(backend).await;
        let path = format!("/pay/{}", "p".repeat(5000));
        let first = send(server.post(&path, "k")).await;
        assert_eq!(first.status, StatusCode::CREATED, "{backend:?}");
        let again = send(server.post(&path, "k")).await;
        assert!(again.replayed(), "{backend:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let server = serve(http_harness::Backend::Memory, app(runs.clone()), |layer| {
        layer.max_key_len(10_000)
    })
    .await;
    let answer = send(server.post("/pay/abc", &"k".repeat(5000))).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.problem(), "invalid-key");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// Writes what the previous version of the layer wrote for `POST /pay/abc` from tenant `a`
/// with the client key `key`: its record under the previous layout
/// (`<prefix>:v1:{scope, method, path, key}`), completed.
async fn completed_before_the_upgrade(store: &http_harness::Store, key: &str) {
    use sha2::Digest as _;
    let scope: String = sha2::Sha256::digest(b"a")[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let parts: [&dyn idempotency::KeyPart; 4] = [&scope, &"POST", &"/pay/abc", &key];
    let previous = idempotency::Key::new(&store.prefix, 1, &parts).unwrap();
    let hour = std::time::Duration::from_secs(3600);
    let owner = idempotency::store::ClaimRequest::new(
        previous.clone(),
        idempotency::store::Token::generate(),
        hour,
        hour,
    );
    assert!(matches!(
        store.store.claim(&owner).await.unwrap(),
        idempotency::store::Claim::Acquired { .. }
    ));
    let done = idempotency::store::Completion::new(None, hour);
    assert!(store
        .store
        .complete(&previous, &owner.token, &done)
        .await
        .unwrap());
}

/// A key the previous version of the layer completed (its record under the previous layout,
/// `<prefix>:v1:{scope, method, path, key}`) is not run again after an upgrade: the retry is
/// answered `409 already-processed`. With the check turned off it runs, as a new key would.
#[tokio::test]
async fn a_request_processed_before_an_upgrade_is_not_run_again() {
    for backend in BACKENDS {
        for check in [true, false] {
            let runs = Arc::new(AtomicUsize::new(0));
            let server = serve(backend, app(runs.clone()), |layer| {
                layer.previous_layout(check)
            })
            .await;
            completed_before_the_upgrade(&server.store, "old-1").await;

            let retry = send(server.post("/pay/abc", "old-1")).await;
            if check {
                assert_eq!(
                    retry.status,
                    StatusCode::CONFLICT,
                    "{backend:?}: {}",
                    retry.text()
                );
                assert_eq!(retry.problem(), "already-processed", "{backend:?}");
                assert_eq!(runs.load(Ordering::SeqCst), 0, "{backend:?}: ran again");
            } else {
                assert_eq!(retry.status, StatusCode::CREATED, "{backend:?}");
                assert_eq!(runs.load(Ordering::SeqCst), 1, "{backend:?}");
            }
            // A new key is not slowed by the check beyond its read: it runs once.
            let fresh = send(server.post("/pay/abc", "new-1")).await;
            assert_eq!(fresh.status, StatusCode::CREATED, "{backend:?}");
        }
    }
}

/// What the next reads of the previous layout's keys (`:v1:`) do.
#[derive(Debug, Clone, Copy, PartialEq)]
enum PreviousRead {
    /// Read from the real store.
    Pass,
    /// Fail, as a store that is down does.
    Fail,
    /// Never answer.
    Hang,
    /// Read from the real store once a claim has answered.
    AfterTheClaim,
}

/// The real Redis store, whose reads of the previous layout's keys do what the test asks and
/// announce that they began, and whose claims may wait for such a read to begin: one key's
/// read cannot be made to fail or hang on cue on a real server without its claims failing
/// too. Everything else is the real store's.
struct PreviousReads {
    inner: idempotency::SharedStore,
    mode: std::sync::Mutex<PreviousRead>,
    read_began: tokio::sync::Notify,
    claims_wait_for_a_read: std::sync::atomic::AtomicBool,
    claim_answered: tokio::sync::Notify,
}

impl PreviousReads {
    fn new(inner: idempotency::SharedStore) -> Arc<PreviousReads> {
        Arc::new(PreviousReads {
            inner,
            mode: std::sync::Mutex::new(PreviousRead::Pass),
            read_began: tokio::sync::Notify::new(),
            claims_wait_for_a_read: std::sync::atomic::AtomicBool::new(false),
            claim_answered: tokio::sync::Notify::new(),
        })
    }

    fn set(&self, mode: PreviousRead) {
        *self.mode.lock().unwrap() = mode;
    }
}

impl idempotency::store::Store for PreviousReads {
    forward_store!(complete, release, renew, max_result_size, name);

    fn claim<'a>(
        &'a self,
        req: &'a idempotency::store::ClaimRequest,
    ) -> idempotency::store::BoxFuture<
        'a,
        Result<idempotency::store::Claim, idempotency::store::StoreError>,
    > {
        Box::pin(async move {
            if self.claims_wait_for_a_read.load(Ordering::SeqCst) {
                self.read_began.notified().await;
            }
            let claimed = self.inner.claim(req).await;
            if *self.mode.lock().unwrap() == PreviousRead::AfterTheClaim {
                self.claim_answered.notify_one();
            }
            claimed
        })
    }

    fn read<'a>(
        &'a self,
        key: &'a idempotency::Key,
    ) -> idempotency::store::BoxFuture<
        'a,
        Result<Option<idempotency::store::Record>, idempotency::store::StoreError>,
    > {
        if !key.to_string().contains(":v1:") {
            return self.inner.read(key);
        }
        let mode = *self.mode.lock().unwrap();
        Box::pin(async move {
            self.read_began.notify_one();
            match mode {
                PreviousRead::Pass => self.inner.read(key).await,
                PreviousRead::Fail => Err(idempotency::store::StoreError::new(
                    idempotency::store::StoreErrorKind::Unavailable,
                    "the previous layout's read failed",
                )),
                PreviousRead::Hang => std::future::pending().await,
                PreviousRead::AfterTheClaim => {
                    self.claim_answered.notified().await;
                    self.inner.read(key).await
                }
            }
        })
    }
}

/// A server on the real Redis whose previous-layout reads the test controls.
async fn start_on_previous_reads() -> (Running, Arc<PreviousReads>, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let (server, reads) = serve_on_previous_reads(app(runs.clone())).await;
    (server, reads, runs)
}

/// `router` served on the real Redis, whose previous-layout reads the test controls.
async fn serve_on_previous_reads(router: Router) -> (Running, Arc<PreviousReads>) {
    let mut reads = None;
    let store = http_harness::store(http_harness::Backend::Redis)
        .await
        .wrapped(|real| {
            let wrapped = PreviousReads::new(real);
            reads = Some(wrapped.clone());
            wrapped
        });
    let server = http_harness::serve_on(store, router, |layer| layer, |r| r).await;
    (server, reads.unwrap())
}

/// `request`'s answer; fails the test with `held` when it takes a minute or more.
async fn within_a_minute(request: reqwest::RequestBuilder, held: &str) -> Answer {
    tokio::time::timeout(std::time::Duration::from_secs(60), send(request))
        .await
        .expect(held)
}

/// A fresh request waits one round trip for its claim and the previous layout's read, not one
/// after the other: the read is sent alongside the claim. Here the claim only proceeds once
/// the read has begun; a read made after the claim would never begin, and the request would
/// fail when the claim's bound gave up on it.
#[tokio::test]
async fn the_previous_layouts_read_goes_out_with_the_claim() {
    let (server, reads, runs) = start_on_previous_reads().await;
    reads.claims_wait_for_a_read.store(true, Ordering::SeqCst);
    let first = within_a_minute(
        server.post("/pay/abc", "with-claim"),
        "the previous layout's read waited for the claim",
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// With the previous layout's reads in `mode`, a request is `503 store-unavailable` without
/// running, and its key is given back: the retry, with the reads back, runs once.
async fn refused_without_running_then_retried(mode: PreviousRead, body: &str) {
    let (server, reads, runs) = start_on_previous_reads().await;
    reads.set(mode);
    let refused = within_a_minute(
        server.post("/pay/abc", body),
        "the previous layout's read held the request",
    )
    .await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        refused.text()
    );
    assert_eq!(refused.problem(), "store-unavailable");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "ran without the read's answer"
    );

    reads.set(PreviousRead::Pass);
    let retry = send(server.post("/pay/abc", body)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A previous-layout read that fails runs nothing: the request is `503 store-unavailable`
/// and its claim is given back, so the retry, with the store back, runs once.
#[tokio::test]
async fn a_failed_previous_layout_read_runs_nothing_and_gives_the_key_back() {
    refused_without_running_then_retried(PreviousRead::Fail, "read-fails").await;
}

/// A previous-layout read that never answers does not hold a fresh request: it is abandoned
/// at the engine's bound on a store call (half the lease: 5 s here), the request is
/// `503 store-unavailable` with nothing run, and its key is given back, so the retry runs
/// once. The wrapper's read never reaches Redis, so only that bound can end it.
#[tokio::test]
async fn a_previous_layout_read_that_never_answers_is_abandoned_at_the_bound() {
    refused_without_running_then_retried(PreviousRead::Hang, "read-hangs").await;
}

/// A previous-layout read that answers after the claim did is waited for: the check after
/// the claim takes its answer when it comes. Here the request was completed before the
/// upgrade and its read answers only once the claim has: the request is `409
/// already-processed` and runs nothing.
#[tokio::test]
async fn a_previous_layout_read_slower_than_the_claim_is_waited_for() {
    let (server, reads, runs) = start_on_previous_reads().await;
    completed_before_the_upgrade(&server.store, "late-read").await;
    reads.set(PreviousRead::AfterTheClaim);
    let retry = within_a_minute(
        server.post("/pay/abc", "late-read"),
        "the check lost the late read's answer",
    )
    .await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{}", retry.text());
    assert_eq!(retry.problem(), "already-processed");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "ran before the read answered"
    );
}

/// A replay is answered from the record it finds, without waiting for the previous layout's
/// read sent alongside its claim: here that read never answers.
#[tokio::test]
async fn a_replay_does_not_wait_for_the_previous_layouts_read() {
    let (server, reads, runs) = start_on_previous_reads().await;
    let first = send(server.post("/pay/abc", "replayed")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());

    reads.set(PreviousRead::Hang);
    let again = within_a_minute(
        server.post("/pay/abc", "replayed"),
        "the replay waited for the previous layout's read",
    )
    .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A request that finds its key held by a live owner reads the previous layout's key again,
/// after its claim, to tell `409 already-processed` from `409 in-flight`. When that read
/// fails, the request is `503 store-unavailable`: it is neither told the request is in
/// flight on an answer it does not have, nor run. The owner is not disturbed: it runs once,
/// and the retry after it is its replay.
#[tokio::test]
async fn a_failed_previous_layout_read_beside_a_live_owner_is_store_unavailable() {
    let runs = Arc::new(AtomicUsize::new(0));
    let entered = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let router = {
        let (runs, entered, release) = (runs.clone(), entered.clone(), release.clone());
        Router::new().route(
            "/pay/{id}",
            post(move |Path(id): Path<String>| async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                entered.notify_one();
                release.notified().await;
                (StatusCode::CREATED, format!("paid {id} #{n}"))
            }),
        )
    };
    let (server, reads) = serve_on_previous_reads(router).await;
    let owner = tokio::spawn(send(server.post("/pay/abc", "held")));
    entered.notified().await;

    reads.set(PreviousRead::Fail);
    let duplicate = within_a_minute(
        server.post("/pay/abc", "held"),
        "the duplicate waited on the owner",
    )
    .await;
    assert_eq!(
        duplicate.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        duplicate.text()
    );
    assert_eq!(duplicate.problem(), "store-unavailable");

    // With the reads back, the duplicate is told the owner is still running.
    reads.set(PreviousRead::Pass);
    let in_flight = send(server.post("/pay/abc", "held")).await;
    assert_eq!(
        in_flight.status,
        StatusCode::CONFLICT,
        "{}",
        in_flight.text()
    );
    assert_eq!(in_flight.problem(), "in-flight");

    release.notify_one();
    let first = owner.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    let replay = send(server.post("/pay/abc", "held")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The real Redis store (behind the proxy), whose pipelined claim and read go to the server
/// and whose reads of the previous layout's keys (`:v1:`) fail while `fail` is set (its
/// `is_completed` is the trait's, over this `read`): the read sent again after a lost
/// pipeline reply cannot be made to fail on a real server without the claim's read-back
/// failing too.
struct FailingRereads {
    inner: idempotency::SharedStore,
    fail: std::sync::atomic::AtomicBool,
}

impl idempotency::store::Store for FailingRereads {
    forward_store!(
        claim,
        claim_and_is_completed,
        complete,
        release,
        renew,
        max_result_size,
        name
    );

    fn read<'a>(
        &'a self,
        key: &'a idempotency::Key,
    ) -> idempotency::store::BoxFuture<
        'a,
        Result<Option<idempotency::store::Record>, idempotency::store::StoreError>,
    > {
        if key.to_string().contains(":v1:") && self.fail.load(Ordering::SeqCst) {
            return Box::pin(std::future::ready(Err(
                idempotency::store::StoreError::new(
                    idempotency::store::StoreErrorKind::Unavailable,
                    "the previous layout's read failed",
                ),
            )));
        }
        self.inner.read(key)
    }
}

/// The real Redis store behind a proxy that can lose a reply; its claims are fast ones.
async fn proxied_redis() -> (proxy::Proxy, idempotency::SharedStore) {
    let upstream = redis_server::redis_url()
        .trim_start_matches("redis://")
        .parse()
        .unwrap();
    let proxy = proxy::Proxy::start(upstream).await;
    // Without the wider clock error, a loaded machine's claim could go to the script, without
    // the marker the proxy waits for. 10 ms, the most the layer's 10 s lease allows (a fast
    // claim's lease is at least a thousand times the clock's error).
    let store: idempotency::SharedStore = Arc::new(
        redis_server::connect_with_clock_error(
            &proxy.url(),
            true,
            Some(std::time::Duration::from_millis(10)),
        )
        .await,
    );
    (proxy, store)
}

/// After the claim-and-read pipeline lost its reply, the claim is read back as the request's
/// own and the previous layout's key is read again. When that read fails, the request is
/// `503 store-unavailable`, not run, and its claim is given back: the retry, with the reads
/// back, runs once, and the one after it is its replay.
#[tokio::test]
async fn a_failed_read_after_a_lost_pipeline_reply_is_store_unavailable() {
    let (proxy, proxied) = proxied_redis().await;
    let failing = Arc::new(FailingRereads {
        inner: proxied,
        fail: std::sync::atomic::AtomicBool::new(false),
    });
    let store = http_harness::store(http_harness::Backend::Redis)
        .await
        .wrapped({
            let failing = failing.clone();
            move |_| failing
        });
    let runs = Arc::new(AtomicUsize::new(0));
    let server = http_harness::serve_on(store, app(runs.clone()), |layer| layer, |r| r).await;
    // A first request: the store knows the server's clock, so the next claim is a fast one.
    let warm = send(server.post("/pay/warm", "warm-up")).await;
    assert_eq!(warm.status, StatusCode::CREATED, "{}", warm.text());

    failing.fail.store(true, Ordering::SeqCst);
    proxy.lose_reply_to(b"\r\nNX\r\n");
    let refused = within_a_minute(server.post("/pay/abc", "lost"), "the lost reply held it").await;
    assert_eq!(proxy.lost(), 1, "the proxy lost no reply");
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        refused.text()
    );
    assert_eq!(refused.problem(), "store-unavailable");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "ran without the read's answer"
    );

    failing.fail.store(false, Ordering::SeqCst);
    let retried = send(server.post("/pay/abc", "lost")).await;
    assert_eq!(retried.status, StatusCode::CREATED, "{}", retried.text());
    assert_eq!(retried.text(), "paid abc #2");
    let again = send(server.post("/pay/abc", "lost")).await;
    assert!(again.replayed());
    assert_eq!(again.body, retried.body);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// On Redis a fresh request's claim and the previous layout's read go out in one pipeline
/// (`SET ... NX GET`, then `GET`). When that pipeline's reply is lost on a real connection
/// (the proxy forwards it, Redis applies the claim, and the connection is cut before the
/// answers come back), the claim is read back by token and found to be the request's own,
/// and the read, lost with it, is sent again: the request runs once and is answered, as a
/// request whose single claim lost its reply is.
#[tokio::test]
async fn a_lost_reply_to_the_claim_and_read_pipeline_runs_the_request_once() {
    let (proxy, proxied) = proxied_redis().await;
    let store = http_harness::store(http_harness::Backend::Redis)
        .await
        .wrapped(move |_| proxied);
    let runs = Arc::new(AtomicUsize::new(0));
    let server = http_harness::serve_on(store, app(runs.clone()), |layer| layer, |r| r).await;
    // A first request: the store knows the server's clock, so the next claim is a fast one.
    let warm = send(server.post("/pay/warm", "warm-up")).await;
    assert_eq!(warm.status, StatusCode::CREATED, "{}", warm.text());

    proxy.lose_reply_to(b"\r\nNX\r\n");
    let first = within_a_minute(server.post("/pay/abc", "lost"), "the lost reply held it").await;
    assert_eq!(proxy.lost(), 1, "the proxy lost no reply");
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert_eq!(first.text(), "paid abc #2");
    let again = send(server.post("/pay/abc", "lost")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}
