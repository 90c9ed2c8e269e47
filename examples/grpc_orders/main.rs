//! A gRPC `CreateOrder` made idempotent by its AIP-155 `request_id`: a tonic server and its
//! client in one process (no `grpcurl`, no `protoc`).
//!
//! ```sh
//! cargo run --example grpc_orders
//! ```
//!
//! The client sends a call and its retry (the retry gets the same order, marked
//! `idempotent-replayed: true`), the same id with another amount (`INVALID_ARGUMENT`), 50
//! concurrent duplicates (one order), and a call whose deadline expires while the method
//! runs (the method finishes behind `DetachLayer`, and the retry gets its reply). Records are
//! kept in memory, or in the store at `IDEMPOTENT_STORE_URL` (`redis://127.0.0.1:6379`,
//! `postgres://postgres@127.0.0.1:5432/test`, ...).

mod orders;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::grpc::{DetachLayer, REPLAYED};
use idempotency::{idempotent, SharedStore};
use orders::orders_client::OrdersClient;
use orders::orders_server::{Orders, OrdersServer};
use orders::{CreateOrderRequest, Order};
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

/// The business side: orders by id, and how many were created.
#[derive(Default)]
struct Book {
    next_id: AtomicU64,
    orders: Mutex<HashMap<u64, Order>>,
}

struct OrderService {
    store: SharedStore,
    book: Arc<Book>,
}

#[tonic::async_trait]
impl Orders for OrderService {
    #[idempotent(
        prefix = "orders:create",
        keys = [request.get_ref().request_id],
        fingerprint = [request.get_ref().customer, request.get_ref().amount_cents],
        ttl = 86400,
        on_in_progress = wait(10),
        store = self.store,
        replay
    )]
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let message = request.into_inner();
        if message.customer == "slow" {
            // A method slower than its client's deadline.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let order = Order {
            id: self.book.next_id.fetch_add(1, Ordering::SeqCst) + 1,
            customer: message.customer,
            amount_cents: message.amount_cents,
        };
        self.book
            .orders
            .lock()
            .map_err(|_| Status::internal("the order book is poisoned"))?
            .insert(order.id, order.clone());
        let mut reply = Response::new(order);
        reply.metadata_mut().insert(
            "x-order-state",
            tonic::metadata::MetadataValue::from_static("created"),
        );
        Ok(reply)
    }
}

fn create(request_id: &str, customer: &str, amount_cents: u64) -> CreateOrderRequest {
    CreateOrderRequest {
        request_id: request_id.into(),
        customer: customer.into(),
        amount_cents,
    }
}

fn replayed<T>(reply: &Response<T>) -> bool {
    reply.metadata().get(REPLAYED).is_some_and(|v| v == "true")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store_url = std::env::var("IDEMPOTENT_STORE_URL").unwrap_or_else(|_| "memory:".into());
    let store = idempotency::connect(&store_url).await?;
    let book = Arc::new(Book::default());

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let detach = DetachLayer::new();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tonic::transport::Server::builder()
        .layer(detach.clone())
        .add_service(OrdersServer::new(OrderService {
            store: store.clone(),
            book: book.clone(),
        }))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
            let _ = stopped.await;
        });
    let server = tokio::spawn(server);
    println!("orders.v1.Orders on {addr}, records in {store_url}");

    let mut client = OrdersClient::connect(format!("http://{addr}")).await?;
    // Unique per run, so a run on a shared store does not replay an earlier run's orders.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let id = |name: &str| format!("{run}-{name}");

    let first = client.create_order(create(&id("a"), "alice", 1250)).await?;
    let retry = client.create_order(create(&id("a"), "alice", 1250)).await?;
    println!(
        "CreateOrder {}: order {} (replayed: {}); its retry: order {} (replayed: {})",
        id("a"),
        first.get_ref().id,
        replayed(&first),
        retry.get_ref().id,
        replayed(&retry)
    );

    let mismatch = client.create_order(create(&id("a"), "alice", 9999)).await;
    if let Err(status) = &mismatch {
        println!(
            "the same id with another amount: {:?} ({})",
            status.code(),
            status.message()
        );
    }

    let calls: Vec<_> = (0..50)
        .map(|_| {
            let mut client = client.clone();
            let request = create(&id("b"), "bob", 800);
            tokio::spawn(async move { client.create_order(request).await })
        })
        .collect();
    let mut ids = Vec::new();
    for call in calls {
        ids.push(call.await??.get_ref().id);
    }
    ids.dedup();
    println!("50 concurrent duplicates: orders {ids:?}");

    let mut hurried = Request::new(create(&id("c"), "slow", 300));
    hurried.set_timeout(Duration::from_millis(100));
    let expired = client.create_order(hurried).await;
    if let Err(status) = &expired {
        println!("a call with a 100 ms deadline: {:?}", status.code());
    }
    let retried = client.create_order(create(&id("c"), "slow", 300)).await?;
    println!(
        "its retry: order {} (replayed: {})",
        retried.get_ref().id,
        replayed(&retried)
    );

    let created = book.orders.lock().map(|orders| orders.len()).unwrap_or(0);
    println!("orders created: {created} (one per request id: 3)");

    let _ = stop.send(());
    server.await??;
    detach.shutdown(Duration::from_secs(10)).await;
    if created != 3 || !replayed(&retry) || mismatch.is_ok() || ids.len() != 1 {
        return Err("an order was created twice or a retry was not replayed".into());
    }
    Ok(())
}
