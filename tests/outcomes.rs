//! Every door concludes in one place: each outcome a door can reach is driven through it (the
//! attribute, `Operation`, `Batch`, `run_in_tx`, the HTTP layer, HTTP `InTransaction`,
//! `Lock`, and a handler under the RabbitMQ consumer loop) with a metrics recorder and a span recorder installed for this binary, and the
//! test asserts that the call's `idempotency` span carries the outcome under the same name
//! as the `idempotency.operations` counter, exactly once per call. A door that answered
//! without going through the shared conclusion leaves its span or its counter short.
//!
//! The stores are real: the in-memory store; the Redis at `IDEMPOTENT_REDIS_URL` behind a
//! proxy that is taken down for store errors and lost leases; PostgreSQL for the doors that
//! claim in the caller's transaction; RabbitMQ for the broker's consumer loop.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use idempotency::http::{IdempotencyLayer, InTransaction};
use idempotency::lock::Lock;
use idempotency::sql::sqlx::{self, Postgres};
use idempotency::sql::PostgresStore;
use idempotency::store::{Fingerprint, Token};
use idempotency::{
    idempotent, Error, Idempotency, Key, MemoryStore, OnError, OnInProgress, OnLostLease,
    OnStoreError, SharedStore,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::sync::{oneshot, Semaphore};
use tower::ServiceExt as _;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt as _};

// ---------------------------------------------------------------------------------------
// The recorders.

/// The `key` and `outcome`s of every `idempotency` span: open ones by id (ids are reused
/// once a span closes), then closed ones.
#[derive(Default)]
struct Spans {
    open: HashMap<u64, (String, Vec<String>)>,
    closed: Vec<(String, Vec<String>)>,
}

struct Fields<'a>(&'a mut Option<String>, &'a mut Option<String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "key" => *self.0 = Some(value.to_owned()),
            "outcome" => *self.1 = Some(value.to_owned()),
            _ => {}
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }
}

struct Capture(&'static Mutex<Spans>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        if attrs.metadata().name() != "idempotency" {
            return;
        }
        let (mut key, mut outcome) = (None, None);
        attrs.record(&mut Fields(&mut key, &mut outcome));
        let mut spans = self.0.lock().unwrap();
        let entry = spans.open.entry(id.into_u64()).or_default();
        entry.0 = key.unwrap_or_default();
        entry.1.extend(outcome);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let (mut key, mut outcome) = (None, None);
        values.record(&mut Fields(&mut key, &mut outcome));
        let mut spans = self.0.lock().unwrap();
        if let Some(entry) = spans.open.get_mut(&id.into_u64()) {
            if let Some(key) = key {
                entry.0 = key;
            }
            entry.1.extend(outcome);
        }
    }

    fn on_close(&self, id: Id, _: Context<'_, S>) {
        let mut spans = self.0.lock().unwrap();
        if let Some(entry) = spans.open.remove(&id.into_u64()) {
            spans.closed.push(entry);
        }
    }
}

struct Recorders {
    metrics: Snapshotter,
    spans: &'static Mutex<Spans>,
    counted: Mutex<HashMap<(String, String), u64>>,
}

fn recorders() -> &'static Recorders {
    static RECORDERS: OnceLock<Recorders> = OnceLock::new();
    RECORDERS.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let metrics = recorder.snapshotter();
        recorder
            .install()
            .expect("no other recorder in this binary");
        let spans: &'static Mutex<Spans> = Box::leak(Box::default());
        let subscriber = tracing_subscriber::registry().with(Capture(spans));
        tracing::subscriber::set_global_default(subscriber).expect("no other subscriber");
        Recorders {
            metrics,
            spans,
            counted: Mutex::default(),
        }
    })
}

/// Outcomes of calls on keys with `prefix`: counted by the metric, and recorded on spans.
fn seen(prefix: &str) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let recorders = recorders();
    let mut counted = recorders.counted.lock().unwrap();
    for (key, _, _, value) in recorders.metrics.snapshot().into_vec() {
        let key = key.key();
        if key.name() != "idempotency.operations" {
            continue;
        }
        let label = |name: &str| {
            key.labels()
                .find(|l| l.key() == name)
                .map(|l| l.value().to_owned())
        };
        if let (Some(p), Some(o), DebugValue::Counter(n)) =
            (label("prefix"), label("outcome"), value)
        {
            *counted.entry((p, o)).or_default() += n;
        }
    }
    let metric = counted
        .iter()
        .filter(|((p, _), n)| p == prefix && **n > 0)
        .map(|((_, o), n)| (o.clone(), *n))
        .collect();
    let mut spans = BTreeMap::new();
    let recorded = recorders.spans.lock().unwrap();
    for (key, outcomes) in recorded.open.values().chain(recorded.closed.iter()) {
        if key.starts_with(&format!("{prefix}:")) {
            for outcome in outcomes {
                *spans.entry(outcome.clone()).or_default() += 1;
            }
        }
    }
    (metric, spans)
}

/// Asserts that the calls on `prefix` concluded `expected`, in the metric and on the spans
/// alike. A call's conclusion can come after its caller got the answer (an HTTP response
/// streamed before its record is written), so this waits for it, up to a bound.
async fn assert_concluded(door: Door, case: Case, prefix: &str, expected: &[(&str, u64)]) {
    let expected: BTreeMap<String, u64> = expected
        .iter()
        .map(|(o, n)| ((*o).to_owned(), *n))
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (metric, spans) = seen(prefix);
        if (metric == expected && spans == expected) || tokio::time::Instant::now() > deadline {
            assert_eq!(
                metric, expected,
                "{door:?} {case:?}: idempotency.operations"
            );
            assert_eq!(
                spans, expected,
                "{door:?} {case:?}: the spans' outcome field"
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn unique(prefix: &str) -> String {
    let token = format!("{:?}", Token::generate());
    format!("{prefix}-{}", &token[6..token.len() - 1])
}

// ---------------------------------------------------------------------------------------
// The doors and the cases.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Door {
    Attribute,
    Broker,
    Operation,
    Batch,
    RunInTx,
    Http,
    HttpInTx,
    Lock,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    Executed,
    Failed,
    Duplicate,
    Replayed,
    Held,
    InProgress,
    Skipped,
    Mismatch,
    LostOwnership,
    StoreError,
    FailOpen,
    DoneFallback,
    Acquired,
}

const CASES: [Case; 13] = [
    Case::Executed,
    Case::Failed,
    Case::Duplicate,
    Case::Replayed,
    Case::Held,
    Case::InProgress,
    Case::Skipped,
    Case::Mismatch,
    Case::LostOwnership,
    Case::StoreError,
    Case::FailOpen,
    Case::DoneFallback,
    Case::Acquired,
];

/// What the cases share: the Redis behind a proxy, and PostgreSQL.
struct Env {
    proxy: proxy::Proxy,
    redis: SharedStore,
    pg: Arc<PostgresStore>,
    pg_pool: sqlx::PgPool,
    _records: sql_tables::Scratch,
}

impl Env {
    async fn new() -> Env {
        let url = redis_server::redis_url();
        let proxy = proxy::Proxy::start(url.trim_start_matches("redis://").parse().unwrap()).await;
        let redis: SharedStore = Arc::new(
            idempotency::redis::RedisStore::builder(&proxy.url())
                .on_unsafe_config(idempotency::redis::UnsafeConfig::Warn)
                .response_timeout(Duration::from_millis(300))
                .build()
                .await
                .unwrap(),
        );
        let records = sql_tables::Scratch::table(sql_tables::Server::Postgres);
        let pg = PostgresStore::builder(records.url())
            .table(records.name().to_string())
            .build()
            .await
            .unwrap();
        let pg_pool = pg.pool().clone();
        Env {
            proxy,
            redis,
            pg: Arc::new(pg),
            pg_pool,
            _records: records,
        }
    }

    /// The proxy up again, and the store's connection back: a call right after an outage
    /// may still meet the connection the outage cut.
    async fn up(&self) {
        self.proxy.up();
        let key = Key::new("outcomes-probe", 1, &[&"k"]).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.redis.read(&key).await.is_err() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "Redis did not come back"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The Redis store with its proxy down: every call fails.
    fn broken(&self) -> SharedStore {
        self.proxy.down();
        self.redis.clone()
    }
}

/// The error the handlers of these cases fail with.
fn handler_error() -> Error {
    Error::InvalidDuration {
        setting: "test",
        value: Duration::ZERO,
    }
}

fn memory() -> SharedStore {
    Arc::new(MemoryStore::new())
}

fn settings(store: SharedStore) -> Idempotency {
    Idempotency::new(Duration::from_secs(60)).store(store)
}

/// A body that holds its claim until told to finish: `started` fires once it runs.
struct Gate {
    started: Option<oneshot::Sender<()>>,
    finish: oneshot::Receiver<()>,
}

fn gate() -> (Gate, oneshot::Receiver<()>, oneshot::Sender<()>) {
    let (started_tx, started) = oneshot::channel();
    let (finish, finish_rx) = oneshot::channel();
    (
        Gate {
            started: Some(started_tx),
            finish: finish_rx,
        },
        started,
        finish,
    )
}

impl Gate {
    async fn pass(mut self) {
        if let Some(started) = self.started.take() {
            let _ = started.send(());
        }
        let _ = self.finish.await;
    }
}

/// Runs `first` (which holds its key until released) and, while it holds it, `second`;
/// then lets `first` finish.
async fn while_held<A, B>(first: impl FnOnce(Gate) -> A, second: B)
where
    A: std::future::Future + Send + 'static,
    A::Output: Send,
    B: std::future::Future,
{
    let (gate, started, finish) = gate();
    let holder = tokio::spawn(first(gate));
    started.await.unwrap();
    second.await;
    finish.send(()).unwrap();
    holder.await.unwrap();
}

// ---------------------------------------------------------------------------------------
// The attribute.

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idempotency(#[from] Error),
    #[error("the handler failed")]
    Failed,
}

static ATTRIBUTE_STORE: Mutex<Option<SharedStore>> = Mutex::new(None);

fn attribute_store() -> SharedStore {
    ATTRIBUTE_STORE.lock().unwrap().clone().unwrap()
}

#[idempotent(prefix = "outcomes-attribute", keys = [id], ttl = 60, store = attribute_store(),
             fingerprint = [amount], replay)]
async fn charge(id: &str, amount: u32, fail: bool) -> Result<u32, AppError> {
    if fail {
        return Err(AppError::Failed);
    }
    Ok(amount)
}

#[idempotent(prefix = "outcomes-attribute", keys = [id], ttl = 60, store = attribute_store())]
async fn plain(id: &str) -> Result<(), AppError> {
    Ok(())
}

#[idempotent(prefix = "outcomes-attribute", keys = [id], ttl = 60, store = attribute_store(),
             on_error = hold)]
async fn held(id: &str) -> Result<(), AppError> {
    Err(AppError::Failed)
}

#[idempotent(prefix = "outcomes-attribute", keys = [id], ttl = 60, store = attribute_store(),
             on_in_progress = skip)]
async fn gated(id: &str, gate: Option<Gate>) -> Result<(), AppError> {
    if let Some(gate) = gate {
        gate.pass().await;
    }
    Ok(())
}

async fn applied() -> Result<bool, AppError> {
    Ok(true)
}

#[idempotent(prefix = "outcomes-attribute", keys = [id], ttl = 60, store = attribute_store(),
             done = applied())]
async fn checked(id: &str) -> Result<(), AppError> {
    panic!("the business check said the effect is applied")
}

#[idempotent(prefix = "outcomes-attribute", keys = [id], ttl = 60, store = attribute_store(),
             on_store_error = fail_open)]
async fn open(id: &str) -> Result<(), AppError> {
    Ok(())
}

/// The attribute's cases: its prefix is a literal, so the counts are compared before and
/// after each case (the cases run one after another).
async fn attribute(env: &Env, case: Case) -> Option<Vec<(&'static str, u64)>> {
    let store = match case {
        Case::StoreError | Case::FailOpen => env.broken(),
        _ => memory(),
    };
    *ATTRIBUTE_STORE.lock().unwrap() = Some(store);
    let id = unique("id");
    let id = id.as_str();
    Some(match case {
        Case::Executed => {
            plain(id).await.unwrap();
            vec![("executed", 1)]
        }
        Case::Failed => {
            assert!(matches!(charge(id, 1, true).await, Err(AppError::Failed)));
            vec![("failed", 1)]
        }
        Case::Duplicate => {
            plain(id).await.unwrap();
            assert!(matches!(plain(id).await, Err(AppError::Idempotency(e)) if e.is_duplicate()));
            vec![("executed", 1), ("duplicate", 1)]
        }
        Case::Replayed => {
            assert_eq!(charge(id, 5, false).await.unwrap(), 5);
            assert_eq!(charge(id, 5, false).await.unwrap(), 5);
            vec![("executed", 1), ("replayed", 1)]
        }
        Case::Held => {
            assert!(held(id).await.is_err());
            let again = held(id).await;
            assert!(matches!(
                again,
                Err(AppError::Idempotency(Error::Held { .. }))
            ));
            vec![("failed", 1), ("held", 1)]
        }
        Case::Skipped => {
            while_held(
                move |gate| {
                    let id = id.to_owned();
                    async move { gated(&id, Some(gate)).await.unwrap() }
                },
                async {
                    let second = gated(id, None).await;
                    assert!(matches!(
                        second,
                        Err(AppError::Idempotency(Error::Skipped { .. }))
                    ));
                },
            )
            .await;
            vec![("executed", 1), ("skipped", 1)]
        }
        Case::Mismatch => {
            charge(id, 5, false).await.unwrap();
            let other = charge(id, 6, false).await;
            assert!(matches!(
                other,
                Err(AppError::Idempotency(Error::PayloadMismatch { .. }))
            ));
            vec![("executed", 1), ("mismatch", 1)]
        }
        Case::StoreError => {
            let out = plain(id).await;
            env.up().await;
            assert!(matches!(out, Err(AppError::Idempotency(Error::Store(_)))));
            vec![("store_error", 1)]
        }
        Case::FailOpen => {
            let out = open(id).await;
            env.up().await;
            out.unwrap();
            vec![("fail_open", 1)]
        }
        Case::DoneFallback => {
            let out = checked(id).await;
            assert!(matches!(out, Err(AppError::Idempotency(e)) if e.is_duplicate()));
            vec![("done_fallback", 1)]
        }
        // In progress is `Operation`'s reject (the attribute's `skip` is above); the lease
        // cannot be lost under the attribute's settings without a second owner.
        Case::InProgress | Case::LostOwnership | Case::Acquired => return None,
    })
}

// ---------------------------------------------------------------------------------------
// `Operation` and `Batch`.

/// A call through `Operation` (`batch: false`) or a batch of one (`batch: true`).
#[derive(Clone)]
struct Call {
    settings: Idempotency,
    key: Key,
    fingerprint: u32,
    replay: bool,
    on_error: Option<fn(&Error) -> OnError>,
    done: bool,
    batch: bool,
}

impl Call {
    async fn run(&self, out: Result<u32, Error>, gate: Option<Gate>) -> Result<u32, Error> {
        let body = move || async move {
            if let Some(gate) = gate {
                gate.pass().await;
            }
            out
        };
        if self.batch {
            let mut batch = self
                .settings
                .batch::<u32, Result<u32, Error>>()
                .fingerprint(|fingerprint: &u32| Fingerprint::of(&[fingerprint]));
            if self.replay {
                batch = batch.replay();
            }
            if let Some(on_error) = self.on_error {
                batch = batch.on_error(on_error);
            }
            let body = Mutex::new(Some(body));
            let handler = |_: u32| {
                let body = body.lock().unwrap().take().unwrap();
                body()
            };
            let mut answers = if self.done {
                batch
                    .done(|_| async { Ok::<_, Error>(true) })
                    .run(vec![(self.key.clone(), self.fingerprint)], handler)
                    .await
            } else {
                batch
                    .run(vec![(self.key.clone(), self.fingerprint)], handler)
                    .await
            };
            answers.pop().unwrap()
        } else {
            let mut op = self
                .settings
                .operation::<Result<u32, Error>>(self.key.clone())
                .fingerprint(&[&self.fingerprint]);
            if self.replay {
                op = op.replay();
            }
            if let Some(on_error) = self.on_error {
                op = op.on_error(on_error);
            }
            if self.done {
                op.done(|| async { Ok::<_, Error>(true) }).run(body()).await
            } else {
                op.run(body()).await
            }
        }
    }
}

async fn operation(
    env: &Env,
    case: Case,
    batch: bool,
) -> Option<(String, Vec<(&'static str, u64)>)> {
    let prefix = unique("outcomes");
    let store = match case {
        Case::StoreError | Case::FailOpen | Case::LostOwnership => env.redis.clone(),
        _ => memory(),
    };
    let mut call = Call {
        settings: settings(store),
        key: Key::new(&prefix, 1, &[&"k"]).unwrap(),
        fingerprint: 0,
        replay: false,
        on_error: None,
        done: false,
        batch,
    };
    let failed = || Err(handler_error());
    let expected = match case {
        Case::Executed => {
            call.run(Ok(1), None).await.unwrap();
            vec![("executed", 1)]
        }
        Case::Failed => {
            assert!(call.run(failed(), None).await.is_err());
            vec![("failed", 1)]
        }
        Case::Duplicate => {
            call.run(Ok(1), None).await.unwrap();
            assert!(matches!(
                call.run(Ok(2), None).await,
                Err(Error::Duplicate { .. })
            ));
            vec![("executed", 1), ("duplicate", 1)]
        }
        Case::Replayed => {
            call.replay = true;
            call.run(Ok(1), None).await.unwrap();
            assert_eq!(call.run(Ok(2), None).await.unwrap(), 1);
            vec![("executed", 1), ("replayed", 1)]
        }
        Case::Held => {
            call.on_error = Some(|_| OnError::Hold);
            assert!(call.run(failed(), None).await.is_err());
            assert!(matches!(
                call.run(Ok(1), None).await,
                Err(Error::Held { .. })
            ));
            vec![("failed", 1), ("held", 1)]
        }
        Case::InProgress | Case::Skipped => {
            let policy = if case == Case::Skipped {
                OnInProgress::Skip
            } else {
                OnInProgress::Reject
            };
            call.settings = call.settings.on_in_progress(policy);
            let first = call.clone();
            let second = call.clone();
            while_held(
                move |gate| async move { first.run(Ok(1), Some(gate)).await.unwrap() },
                async move {
                    match second.run(Ok(2), None).await {
                        Err(Error::InProgress { .. }) if case == Case::InProgress => {}
                        Err(Error::Skipped { .. }) if case == Case::Skipped => {}
                        other => panic!("{other:?}"),
                    }
                },
            )
            .await;
            let name = if case == Case::Skipped {
                "skipped"
            } else {
                "in_progress"
            };
            vec![("executed", 1), (name, 1)]
        }
        Case::Mismatch => {
            call.run(Ok(1), None).await.unwrap();
            call.fingerprint = 1;
            assert!(matches!(
                call.run(Ok(2), None).await,
                Err(Error::PayloadMismatch { .. })
            ));
            vec![("executed", 1), ("mismatch", 1)]
        }
        Case::LostOwnership => {
            // The lease is lost while the body runs: the proxy goes down, no renewal reaches
            // the store, and the body is cancelled once the lease has run out.
            call.settings = call
                .settings
                .lease(Duration::from_secs(1))
                .on_lost_lease(OnLostLease::Cancel);
            let (gate, started, _finish) = gate();
            let proxy_down = async {
                started.await.unwrap();
                env.proxy.down();
            };
            let (out, ()) = tokio::join!(call.run(Ok(1), Some(gate)), proxy_down);
            env.up().await;
            assert!(matches!(out, Err(Error::LostOwnership { .. })), "{out:?}");
            vec![("lost_ownership", 1)]
        }
        Case::StoreError => {
            env.proxy.down();
            let out = call.run(Ok(1), None).await;
            env.up().await;
            assert!(matches!(out, Err(Error::Store(_))), "{out:?}");
            vec![("store_error", 1)]
        }
        Case::FailOpen => {
            call.settings = call.settings.on_store_error(OnStoreError::FailOpen);
            env.proxy.down();
            let out = call.run(Ok(1), None).await;
            env.up().await;
            assert_eq!(out.unwrap(), 1);
            vec![("fail_open", 1)]
        }
        Case::DoneFallback => {
            call.done = true;
            assert!(matches!(
                call.run(Ok(1), None).await,
                Err(Error::Duplicate { .. })
            ));
            vec![("done_fallback", 1)]
        }
        Case::Acquired => return None,
    };
    Some((prefix, expected))
}

// ---------------------------------------------------------------------------------------
// `run_in_tx` and HTTP `InTransaction`, on PostgreSQL.

async fn run_in_tx(env: &Env, case: Case) -> Option<(String, Vec<(&'static str, u64)>)> {
    let prefix = unique("outcomes");
    let key = Key::new(&prefix, 1, &[&"k"]).unwrap();
    let ttl = Duration::from_secs(60);
    let once = |fail: bool| {
        let key = key.clone();
        async move {
            let mut tx = env.pg_pool.begin().await.unwrap();
            let out = env
                .pg
                .run_in_tx(&mut tx, key, ttl, async |conn| {
                    sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
                    if fail {
                        Err(handler_error())
                    } else {
                        Ok(1u32)
                    }
                })
                .await;
            if out.is_ok() {
                tx.commit().await.unwrap();
            }
            out
        }
    };
    let expected = match case {
        Case::Executed => {
            once(false).await.unwrap();
            vec![("executed", 1)]
        }
        Case::Failed => {
            assert!(once(true).await.is_err());
            vec![("failed", 1)]
        }
        Case::Duplicate => {
            once(false).await.unwrap();
            assert!(matches!(once(false).await, Err(Error::Duplicate { .. })));
            vec![("executed", 1), ("duplicate", 1)]
        }
        Case::Held => {
            // Held by a call outside the transaction.
            let held: Result<(), Error> = settings(env.pg.clone())
                .operation(key.clone())
                .on_error(|_| OnError::Hold)
                .run(async { Err(handler_error()) })
                .await;
            assert!(held.is_err());
            assert!(matches!(once(false).await, Err(Error::Held { .. })));
            vec![("failed", 1), ("held", 1)]
        }
        Case::InProgress => {
            let owner = settings(env.pg.clone());
            let k = key.clone();
            while_held(
                move |gate| async move {
                    let out: Result<(), Error> = owner
                        .run(k, async move {
                            gate.pass().await;
                            Ok(())
                        })
                        .await;
                    out.unwrap();
                },
                async { assert!(matches!(once(false).await, Err(Error::InProgress { .. }))) },
            )
            .await;
            vec![("executed", 1), ("in_progress", 1)]
        }
        Case::StoreError => {
            // A statement failed earlier in the transaction: PostgreSQL refuses the claim.
            let mut tx = env.pg_pool.begin().await.unwrap();
            assert!(sqlx::query("SELECT 1/0").execute(&mut *tx).await.is_err());
            let out = env
                .pg
                .run_in_tx(&mut tx, key, ttl, async |_| Ok::<_, Error>(()))
                .await;
            assert!(matches!(out, Err(Error::Store(_))), "{out:?}");
            vec![("store_error", 1)]
        }
        _ => return None,
    };
    Some((prefix, expected))
}

/// The HTTP layer (`in_tx: false`, on memory or the broken Redis) or `InTransaction`
/// (`in_tx: true`, on PostgreSQL), called in process with real requests.
async fn http(env: &Env, case: Case, in_tx: bool) -> Option<(String, Vec<(&'static str, u64)>)> {
    let prefix = unique("outcomes");
    let store = match case {
        Case::StoreError | Case::FailOpen => env.redis.clone(),
        _ => memory(),
    };
    let mut idempotency = settings(store);
    if case == Case::FailOpen {
        idempotency = idempotency.on_store_error(OnStoreError::FailOpen);
    }
    let layer = IdempotencyLayer::new(idempotency, |_: &http::request::Parts| Some("t".into()))
        .prefix(prefix.clone());
    let orders: Arc<InTransaction<Postgres>> = Arc::new(layer.in_transaction(env.pg.clone()));
    // The first request of an in-progress case waits for this permit.
    let hold = Arc::new(Semaphore::new(0));
    let (started_tx, started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let handler = {
        let hold = hold.clone();
        move |body: Vec<u8>| {
            let hold = hold.clone();
            let started = started_tx.clone();
            async move {
                if body == b"slow" {
                    let _ = started.send(());
                    hold.acquire().await.unwrap().forget();
                }
                let status = if body == b"fail" { 503 } else { 201 };
                http::Response::builder()
                    .status(status)
                    .body(Body::from(body))
                    .unwrap()
            }
        }
    };
    let router = if in_tx {
        let handler = handler.clone();
        Router::new().route(
            "/orders",
            post(move |request: axum::extract::Request| {
                let orders = orders.clone();
                let handler = handler.clone();
                async move {
                    orders
                        .run(request, async |conn, _parts, body| {
                            sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
                            handler(body.to_vec()).await
                        })
                        .await
                }
            }),
        )
    } else {
        Router::new()
            .route(
                "/orders",
                post(move |body: axum::body::Bytes| handler(body.to_vec())),
            )
            .layer(layer.clone())
    };
    let send = |body: &'static str| {
        let router = router.clone();
        async move {
            let request = http::Request::post("/orders")
                .header("idempotency-key", "key-1")
                .body(Body::from(body))
                .unwrap();
            router.oneshot(request).await.unwrap().status().as_u16()
        }
    };
    let expected = match (case, in_tx) {
        (Case::Executed, _) => {
            assert_eq!(send("a").await, 201);
            vec![("executed", 1)]
        }
        (Case::Replayed, _) => {
            assert_eq!(send("a").await, 201);
            assert_eq!(send("a").await, 201);
            vec![("executed", 1), ("replayed", 1)]
        }
        (Case::Mismatch, _) => {
            assert_eq!(send("a").await, 201);
            assert_eq!(send("b").await, 422);
            vec![("executed", 1), ("mismatch", 1)]
        }
        (Case::Failed, _) => {
            assert_eq!(send("fail").await, 503);
            vec![("failed", 1)]
        }
        (Case::InProgress, false) => {
            let first = tokio::spawn(send("slow"));
            let mut started = started;
            started.recv().await.unwrap();
            assert_eq!(send("slow").await, 409);
            hold.add_permits(1);
            assert_eq!(first.await.unwrap(), 201);
            vec![("executed", 1), ("in_progress", 1)]
        }
        (Case::StoreError, false) => {
            env.proxy.down();
            let status = send("a").await;
            env.up().await;
            assert_eq!(status, 503);
            vec![("store_error", 1)]
        }
        (Case::FailOpen, false) => {
            env.proxy.down();
            let status = send("a").await;
            env.up().await;
            assert_eq!(status, 201);
            vec![("fail_open", 1)]
        }
        _ => return None,
    };
    Some((prefix, expected))
}

// ---------------------------------------------------------------------------------------
// `Lock`.

async fn lock(env: &Env, case: Case) -> Option<(String, Vec<(&'static str, u64)>)> {
    let prefix = unique("outcomes");
    let key = Key::new(&prefix, 1, &[&"k"]).unwrap();
    let store = memory();
    let expected = match case {
        Case::Acquired => {
            let locks = Lock::new(store, Duration::from_secs(5));
            locks.lock(key).await.unwrap().unlock().await.unwrap();
            vec![("acquired", 1)]
        }
        Case::InProgress => {
            let locks = Lock::new(store, Duration::from_secs(5));
            let held = locks.lock(key.clone()).await.unwrap();
            assert!(locks.try_lock(key).await.unwrap().is_none());
            held.unlock().await.unwrap();
            vec![("acquired", 1), ("in_progress", 1)]
        }
        Case::Duplicate => {
            let done: Result<(), Error> = settings(store.clone())
                .run(key.clone(), async { Ok(()) })
                .await;
            done.unwrap();
            let locks = Lock::new(store, Duration::from_secs(5));
            assert!(matches!(
                locks.lock(key).await,
                Err(Error::Duplicate { .. })
            ));
            vec![("executed", 1), ("duplicate", 1)]
        }
        Case::StoreError => {
            let locks = Lock::new(env.broken(), Duration::from_secs(5));
            let out = locks.lock(key).await;
            env.up().await;
            assert!(matches!(out, Err(Error::Store(_))), "{out:?}");
            vec![("store_error", 1)]
        }
        _ => return None,
    };
    Some((prefix, expected))
}

// ---------------------------------------------------------------------------------------
// A handler under the RabbitMQ consumer loop.

#[idempotent(prefix = "outcomes-broker", keys = [order], ttl = 60, store = attribute_store())]
async fn on_order(order: String) -> Result<(), Error> {
    Ok(())
}

/// The same order delivered twice through `broker::rabbitmq::consume`: the handler runs
/// once, the duplicate is filtered and acknowledged.
async fn broker(case: Case) -> Option<Vec<(&'static str, u64)>> {
    use idempotency::broker::rabbitmq::{self, Queue};
    use idempotency::broker::Redelivery;
    use lapin::options::{
        BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Connection, ConnectionProperties};

    if case != Case::Duplicate {
        return None;
    }
    *ATTRIBUTE_STORE.lock().unwrap() = Some(memory());
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at AMQP_URL (start it: see scripts/check-services)");
    let channel = conn.create_channel().await.unwrap();
    let queue = unique("outcomes");
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let order = unique("order");
    for _ in 0..2 {
        channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                order.as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "outcomes".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let handled = Arc::new(Semaphore::new(0));
    let counted = handled.clone();
    let stop = async move {
        counted.acquire_many(2).await.unwrap().forget();
    };
    let summary = rabbitmq::consume(
        consumer,
        Queue::classic(queue.as_str()),
        1,
        Redelivery::default(),
        stop,
        move |message: rabbitmq::Message| {
            let handled = handled.clone();
            async move {
                let order = String::from_utf8_lossy(&message.delivery().data).into_owned();
                let out = on_order(order).await;
                handled.add_permits(1);
                out
            }
        },
    )
    .await
    .unwrap();
    assert_eq!(summary.acked, 2, "{summary:?}");
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    Some(vec![("executed", 1), ("duplicate", 1)])
}

// ---------------------------------------------------------------------------------------

/// Every door, every outcome it can reach: the same name on the span and on the counter,
/// once per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_door_concludes_every_outcome_in_one_place() {
    recorders();
    let env = Env::new().await;
    let doors = [
        Door::Attribute,
        Door::Broker,
        Door::Operation,
        Door::Batch,
        Door::RunInTx,
        Door::Http,
        Door::HttpInTx,
        Door::Lock,
    ];
    let mut driven = BTreeMap::<String, usize>::new();
    for door in doors {
        for case in CASES {
            let ran = match door {
                Door::Attribute | Door::Broker => {
                    let prefix = if door == Door::Broker {
                        "outcomes-broker"
                    } else {
                        "outcomes-attribute"
                    };
                    let before = seen(prefix);
                    let expected = if door == Door::Broker {
                        broker(case).await
                    } else {
                        attribute(&env, case).await
                    };
                    let Some(expected) = expected else {
                        continue;
                    };
                    // Compared as the difference the case made.
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                    loop {
                        let after = seen(prefix);
                        let diff = |a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>| {
                            a.iter()
                                .map(|(o, n)| (o.clone(), n - b.get(o).copied().unwrap_or(0)))
                                .filter(|(_, n)| *n > 0)
                                .collect::<BTreeMap<_, _>>()
                        };
                        let (metric, spans) =
                            (diff(&after.0, &before.0), diff(&after.1, &before.1));
                        let want: BTreeMap<String, u64> = expected
                            .iter()
                            .map(|(o, n)| ((*o).to_owned(), *n))
                            .collect();
                        if (metric == want && spans == want)
                            || tokio::time::Instant::now() > deadline
                        {
                            assert_eq!(metric, want, "{door:?} {case:?}: idempotency.operations");
                            assert_eq!(spans, want, "{door:?} {case:?}: the spans' outcome field");
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    true
                }
                _ => {
                    let out = match door {
                        Door::Operation => operation(&env, case, false).await,
                        Door::Batch => operation(&env, case, true).await,
                        Door::RunInTx => run_in_tx(&env, case).await,
                        Door::Http => http(&env, case, false).await,
                        Door::HttpInTx => http(&env, case, true).await,
                        Door::Lock => lock(&env, case).await,
                        Door::Attribute | Door::Broker => unreachable!(),
                    };
                    let Some((prefix, expected)) = out else {
                        continue;
                    };
                    assert_concluded(door, case, &prefix, &expected).await;
                    true
                }
            };
            if ran {
                *driven.entry(format!("{door:?}")).or_default() += 1;
            }
        }
    }
    // The matrix this test covers: a door whose cases were dropped fails here.
    let covered: Vec<(String, usize)> = driven.into_iter().collect();
    assert_eq!(
        covered,
        [
            ("Attribute", 10),
            ("Batch", 12),
            ("Broker", 1),
            ("Http", 7),
            ("HttpInTx", 4),
            ("Lock", 4),
            ("Operation", 12),
            ("RunInTx", 6),
        ]
        .map(|(d, n)| (d.to_owned(), n))
    );
    redis_server::delete_matching(&redis_server::redis_url(), "outcomes-*");
}
