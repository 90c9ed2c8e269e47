//! `#[idempotent]` on a tonic method over real gRPC: a tonic server on 127.0.0.1 and its
//! generated client, orders inserted into a PostgreSQL table, records in the PostgreSQL store
//! of the test suite (or the Redis at `IDEMPOTENT_REDIS_URL`, or a throwaway Redis that is
//! killed for the outage).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../examples/grpc_orders/orders.rs"]
mod orders;
#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::sync::Arc;
use std::time::Duration;

use idempotency::grpc::{DetachLayer, REPLAYED};
use idempotency::sql::sqlx::{self, AssertSqlSafe};
use idempotency::sql::PostgresStore;
use idempotency::store::Token;
use idempotency::{idempotent, SharedStore};
use orders::orders_client::OrdersClient;
use orders::orders_server::{Orders, OrdersServer};
use orders::{CreateOrderRequest, Order};
use redis_server::{connect, delete_matching, redis_url, RedisServer};
use sql_tables::{Scratch, Server};
use tokio::sync::{Notify, Semaphore};
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

/// Holds a call after its insert until the test lets it go.
struct Hold {
    inserted: Notify,
    release: Semaphore,
}

impl Default for Hold {
    fn default() -> Hold {
        Hold {
            inserted: Notify::new(),
            release: Semaphore::new(0),
        }
    }
}

/// The service under test: one order row per call that runs.
struct OrderService {
    /// Part of every key, so runs of the suite never meet each other's records.
    run: String,
    store: SharedStore,
    pool: sqlx::PgPool,
    insert: String,
    hold: Option<Arc<Hold>>,
}

#[tonic::async_trait]
impl Orders for OrderService {
    #[idempotent(
        prefix = "grpc-test:create",
        keys = [self.run, request.get_ref().request_id],
        fingerprint = [request.get_ref().customer, request.get_ref().amount_cents],
        ttl = 3600,
        on_in_progress = wait(30),
        store = self.store,
        replay
    )]
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let message = request.into_inner();
        let id: i64 = sqlx::query_scalar(AssertSqlSafe(self.insert.clone()))
            .bind(&message.request_id)
            .bind(&message.customer)
            .bind(i64::try_from(message.amount_cents).map_err(|_| Status::out_of_range("amount"))?)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        if let Some(hold) = &self.hold {
            hold.inserted.notify_one();
            hold.release.acquire().await.unwrap().forget();
        }
        let mut response = Response::new(Order {
            id: u64::try_from(id).unwrap(),
            customer: message.customer,
            amount_cents: message.amount_cents,
        });
        response
            .metadata_mut()
            .insert("x-order-state", "created".parse().unwrap());
        Ok(response)
    }
}

/// The orders table of a case, and a pool on it.
struct OrdersTable {
    table: Scratch,
    pool: sqlx::PgPool,
}

impl OrdersTable {
    async fn new() -> OrdersTable {
        let table = Scratch::table(Server::Postgres);
        let pool = sqlx::PgPool::connect(table.url()).await.unwrap();
        let create = format!(
            "CREATE TABLE {} (id BIGSERIAL PRIMARY KEY, request_id TEXT NOT NULL, \
             customer TEXT NOT NULL, amount_cents BIGINT NOT NULL)",
            table.name()
        );
        sqlx::query(AssertSqlSafe(create))
            .execute(&pool)
            .await
            .unwrap();
        OrdersTable { table, pool }
    }

    fn insert(&self) -> String {
        format!(
            "INSERT INTO {} (request_id, customer, amount_cents) VALUES ($1, $2, $3) RETURNING id",
            self.table.name()
        )
    }

    async fn rows(&self) -> i64 {
        let count = format!("SELECT COUNT(*) FROM {}", self.table.name());
        sqlx::query_scalar(AssertSqlSafe(count))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

impl OrderService {
    fn new(store: SharedStore, orders: &OrdersTable, hold: Option<Arc<Hold>>) -> OrderService {
        OrderService {
            run: unique_run(),
            store,
            pool: orders.pool.clone(),
            insert: orders.insert(),
            hold,
        }
    }
}

/// A PostgreSQL store on a table of its own (dropped with the guard).
async fn postgres_store() -> (SharedStore, Scratch) {
    let records = Scratch::table(Server::Postgres);
    let store = PostgresStore::builder(records.url())
        .table(records.name().to_string())
        .build()
        .await
        .unwrap();
    (Arc::new(store), records)
}

fn unique_run() -> String {
    format!("{:?}", Token::generate())
}

/// Serves `service` on a free port behind a [`DetachLayer`]; returns a connected client and
/// the layer.
async fn serve(service: OrderService) -> (OrdersClient<Channel>, DetachLayer) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let detach = DetachLayer::new();
    let server = tonic::transport::Server::builder()
        .layer(detach.clone())
        .add_service(OrdersServer::new(service))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.unwrap() });
    let client = OrdersClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    (client, detach)
}

fn order(request_id: &str, amount_cents: u64) -> CreateOrderRequest {
    CreateOrderRequest {
        request_id: request_id.into(),
        customer: "c-7".into(),
        amount_cents,
    }
}

fn replayed(response: &Response<Order>) -> bool {
    response
        .metadata()
        .get(REPLAYED)
        .is_some_and(|value| value == "true")
}

/// First call runs; the retry with the same id gets the same message and metadata, marked
/// replayed; another id runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_gets_the_first_reply_marked_replayed() {
    let orders = OrdersTable::new().await;
    let (store, _records) = postgres_store().await;
    let (mut client, _detach) = serve(OrderService::new(store, &orders, None)).await;

    let first = client.create_order(order("r-1", 1250)).await.unwrap();
    assert!(!replayed(&first));
    let retry = client.create_order(order("r-1", 1250)).await.unwrap();
    assert!(replayed(&retry));
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(retry.metadata().get("x-order-state").unwrap(), "created");
    assert_eq!(orders.rows().await, 1);

    let other = client.create_order(order("r-2", 1250)).await.unwrap();
    assert!(!replayed(&other));
    assert_ne!(other.get_ref().id, first.get_ref().id);
    assert_eq!(orders.rows().await, 2);
}

/// The same id with another payload is `INVALID_ARGUMENT` and runs nothing; a request
/// without an id (proto3's empty string) is `INVALID_ARGUMENT` and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_id_with_another_payload_and_a_missing_id_are_refused() {
    let orders = OrdersTable::new().await;
    let (store, _records) = postgres_store().await;
    let (mut client, _detach) = serve(OrderService::new(store, &orders, None)).await;

    client.create_order(order("r-1", 1250)).await.unwrap();
    let mismatch = client.create_order(order("r-1", 9999)).await.unwrap_err();
    assert_eq!(mismatch.code(), Code::InvalidArgument, "{mismatch:?}");
    assert!(
        mismatch.message().contains("different payload"),
        "{mismatch:?}"
    );

    let missing = client.create_order(order("", 1250)).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert!(
        missing.message().contains("invalid idempotency key"),
        "{missing:?}"
    );
    assert_eq!(orders.rows().await, 1);
}

/// 100 concurrent identical calls on one HTTP/2 connection make exactly one order row, on the
/// PostgreSQL and the Redis store: one runs, the 99 others wait for it and get its reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hundred_concurrent_identical_calls_make_one_order() {
    for backend in ["postgres", "redis"] {
        let orders = OrdersTable::new().await;
        let (store, _records): (SharedStore, Option<Scratch>) = match backend {
            "postgres" => {
                let (store, records) = postgres_store().await;
                (store, Some(records))
            }
            _ => (Arc::new(connect(&redis_url()).await), None),
        };
        let (client, _detach) = serve(OrderService::new(store, &orders, None)).await;

        let start = Arc::new(Semaphore::new(0));
        let calls: Vec<_> = (0..100)
            .map(|_| {
                let (mut client, start) = (client.clone(), start.clone());
                tokio::spawn(async move {
                    let _go = start.acquire().await.unwrap();
                    client.create_order(order("r-1", 1250)).await
                })
            })
            .collect();
        start.add_permits(100);
        let mut ids = Vec::new();
        let mut replays = 0;
        for call in calls {
            let reply = call.await.unwrap().unwrap();
            replays += usize::from(replayed(&reply));
            ids.push(reply.get_ref().id);
        }
        ids.dedup();
        assert_eq!(ids.len(), 1, "{backend}: every call got the same order");
        assert_eq!(replays, 99, "{backend}");
        assert_eq!(orders.rows().await, 1, "{backend}");
        if backend == "redis" {
            let url = redis_url();
            std::thread::spawn(move || delete_matching(&url, "grpc-test:create:*"))
                .join()
                .unwrap();
        }
    }
}

/// A client whose deadline expires while the method runs gets `DEADLINE_EXCEEDED`; the
/// method still finishes (the server dropped the call, the `DetachLayer` did not), and the
/// retry gets its reply: one order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_deadline_expired_finishes_and_its_retry_replays() {
    let orders = OrdersTable::new().await;
    let (store, _records) = postgres_store().await;
    let hold = Arc::new(Hold::default());
    let (mut client, detach) = serve(OrderService::new(store, &orders, Some(hold.clone()))).await;

    let mut first = Request::new(order("r-1", 1250));
    first.set_timeout(Duration::from_millis(300));
    let mut first_client = client.clone();
    let first = tokio::spawn(async move { first_client.create_order(first).await });
    // The insert happened; the call is held past its deadline.
    hold.inserted.notified().await;
    let expired = first.await.unwrap().unwrap_err();
    assert!(
        matches!(expired.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{expired:?}"
    );
    assert_eq!(
        detach.running(),
        1,
        "the call runs on after its client left"
    );

    // The retry arrives while the first still runs: it waits for it (`wait(30)`).
    let retry = tokio::spawn(async move { client.create_order(order("r-1", 1250)).await });
    hold.release.add_permits(1);
    let retry = retry.await.unwrap().unwrap();
    assert!(replayed(&retry));
    assert_eq!(orders.rows().await, 1);
    assert!(detach.shutdown(Duration::from_secs(10)).await);
}

/// The store is down: `UNAVAILABLE`, and the method does not run. Back up, the call runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_is_unavailable_and_runs_nothing() {
    let orders = OrdersTable::new().await;
    let mut redis = RedisServer::start(&[]);
    let store: SharedStore = Arc::new(connect(&redis.url()).await);
    let (mut client, _detach) = serve(OrderService::new(store, &orders, None)).await;

    redis.kill();
    let down = client.create_order(order("r-1", 1250)).await.unwrap_err();
    assert_eq!(down.code(), Code::Unavailable, "{down:?}");
    assert_eq!(orders.rows().await, 0);

    redis.restart();
    let mut up = None;
    // The store reconnects on its own; a call made while it does is refused, never run.
    for _ in 0..50 {
        match client.create_order(order("r-1", 1250)).await {
            Ok(reply) => {
                up = Some(reply);
                break;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                assert_eq!(orders.rows().await, 0);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert!(!replayed(&up.expect("the store came back")));
    assert_eq!(orders.rows().await, 1);
}

/// Keyed by a metadata entry: a call without it is `INVALID_ARGUMENT` and runs nothing.
struct MetadataKeyed {
    store: SharedStore,
    runs: std::sync::atomic::AtomicU64,
}

#[tonic::async_trait]
impl Orders for MetadataKeyed {
    #[idempotent(
        prefix = "grpc-test:metadata",
        keys = [request.metadata().get("x-request-id")],
        ttl = 60,
        store = self.store,
        replay
    )]
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let id = self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        Ok(Response::new(Order {
            id,
            customer: request.into_inner().customer,
            amount_cents: 0,
        }))
    }
}

#[tokio::test]
async fn a_key_from_metadata_is_required_and_deduplicates() {
    let service = MetadataKeyed {
        store: Arc::new(idempotency::MemoryStore::new()),
        runs: Default::default(),
    };
    let missing = service
        .create_order(Request::new(order("", 1)))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");

    let with_id = || {
        let mut request = Request::new(order("", 1));
        request
            .metadata_mut()
            .insert("x-request-id", "9f1c".parse().unwrap());
        request
    };
    let first = service.create_order(with_id()).await.unwrap();
    let retry = service.create_order(with_id()).await.unwrap();
    assert_eq!(retry.get_ref(), first.get_ref());
    assert!(replayed(&retry) && !replayed(&first));
    assert_eq!(service.runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}
