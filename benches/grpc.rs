//! `#[idempotent]` on a tonic method against the same method guarded by hand, over real gRPC.
//!
//! Four tonic servers on 127.0.0.1 in this process, one Redis server, one client channel
//! (HTTP/2) per server driving 50 concurrent calls:
//!
//! - **bare**: the method only, unguarded: what the guard costs is measured against it.
//! - **by hand**: the method guarding itself the seed's way: `SET key token NX PX` before the
//!   work (a taken key answers `ABORTED`), then a Lua compare-and-set that stores the reply
//!   (the prost-encoded message) under the key if the token is still the owner's. The key is
//!   the request's `request_id` under a prefix.
//! - **attribute**: the method without any of that, under `#[idempotent(..., replay)]` on a
//!   `RedisStore` (one `EVALSHA` to claim, one to complete with the stored reply), served
//!   behind `grpc::DetachLayer` as the guide recommends (a dropped call goes on in a task of its own).
//! - **layer**: the bare method behind `grpc::IdempotencyLayer`, keyed by the call's
//!   `idempotency-key` metadata entry (the request id again), replaying headers, message and
//!   trailers.
//!
//! The guarded sides make two Redis round trips per call. Every call carries a fresh
//! `request_id` (every call is a first run). After a warm-up pass of each side, passes
//! rotate through the four sides (5 rounds); the median of each side is kept. Latency is
//! per call, over all calls of the measured passes.
//!
//! Needs a Redis server this benchmark may write to, at `IDEMPOTENT_REDIS_URL` (default
//! `redis://127.0.0.1:6379`); every key carries a tag unique to the run, expires after an
//! hour, and is deleted before the run ends. Run it with:
//!
//! ```text
//! cargo bench --bench grpc --features redis,grpc
//! ```
//!
//! With valgrind installed it then counts each side's instructions per call under callgrind
//! (see `support/instructions.rs`): `grpc_<side>_instructions`, and `grpc_instructions_ratio`
//! and `grpc_layer_instructions_ratio` (the by-hand guard's count over the attribute's and the
//! layer's: read as a throughput ratio, the higher the better), a figure the machine's load
//! does not move. `IDEMPOTENT_BENCH_INSTRUCTIONS=0` skips it.
//!
//! The last lines are the figures: `grpc_bare_cps`, `grpc_by_hand_cps`,
//! `grpc_attribute_cps`, `grpc_layer_cps` (calls per second), `grpc_ratio` (attribute over by
//! hand, the goal is at least 0.85), `grpc_layer_ratio` (layer over by hand),
//! `grpc_*_p50_ms`, `grpc_*_p99_ms`, `grpc_*_allocations` (per call, client and server), and
//! the CPU time per call of this process (`grpc_*_process_cpu_us`: client and server), which
//! machine noise disturbs less than the throughput.

// A measurement program: failing loudly on a broken setup is the right behaviour.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/allocations.rs"]
mod allocations;
#[path = "support/instructions.rs"]
mod instructions;
#[path = "../examples/grpc_orders/orders.rs"]
mod orders;
#[path = "support/redis_info.rs"]
mod redis_info;
#[path = "support/seed_guard.rs"]
mod seed_guard;
#[path = "support/stats.rs"]
mod stats;

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::grpc::{DetachLayer, IdempotencyLayer};
use idempotency::redis::RedisStore;
use idempotency::{idempotent, Idempotency, SharedStore};
use orders::orders_client::OrdersClient;
use orders::orders_server::{Orders, OrdersServer};
use orders::{CreateOrderRequest, Order};
use prost::Message as _;
use redis::aio::ConnectionManager;
use redis::Script;
use redis_info::client_cpu;
use seed_guard::{delete_matching, rand_u128, COMPLETE};
use stats::{figure, median, per_s, percentile};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const CONCURRENCY: usize = 50;
const CALLS: usize = 4_000;
const ROUNDS: usize = 5;
/// Calls a side makes under callgrind (and twice as many in the second count).
const INSTRUCTION_OPS: usize = 1_000;
const TTL_MS: u64 = 3_600_000;
const LEASE_MS: u64 = 30_000;

static ORDERS: AtomicU64 = AtomicU64::new(0);

/// The work every side does: number an order.
fn create(message: CreateOrderRequest) -> Order {
    Order {
        id: ORDERS.fetch_add(1, Ordering::Relaxed),
        customer: message.customer,
        amount_cents: message.amount_cents,
    }
}

/// The method, unguarded.
struct Bare;

#[tonic::async_trait]
impl Orders for Bare {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        Ok(Response::new(create(request.into_inner())))
    }
}

/// The method guarding itself the seed's way.
struct ByHand {
    conn: ConnectionManager,
    complete: Script,
    prefix: String,
}

#[tonic::async_trait]
impl Orders for ByHand {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let message = request.into_inner();
        if message.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is required"));
        }
        let key = format!("{}:{}", self.prefix, message.request_id);
        let token = format!("{:032x}", rand_u128());
        let mut conn = self.conn.clone();
        let claimed: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(LEASE_MS)
            .query_async(&mut conn)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        if claimed.is_none() {
            return Err(Status::aborted("in progress or done"));
        }
        let order = create(message);
        let _: i64 = self
            .complete
            .key(&key)
            .arg(&token)
            .arg(order.encode_to_vec())
            .arg(TTL_MS)
            .invoke_async(&mut conn)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(order))
    }
}

/// The method under the attribute.
struct Attribute {
    store: SharedStore,
    run: String,
}

#[tonic::async_trait]
impl Orders for Attribute {
    #[idempotent(
        prefix = "bench:grpc:attribute",
        keys = [self.run, request.get_ref().request_id],
        ttl = 3600,
        lease = 30,
        store = self.store,
        replay
    )]
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        Ok(Response::new(create(request.into_inner())))
    }
}

/// In front of a server: nothing, `DetachLayer` (for the attribute), or the metadata-keyed
/// `IdempotencyLayer`.
enum Front {
    None,
    Detach,
    Layer(IdempotencyLayer),
}

/// Serves `service` on a free port behind `front`; a client channel.
async fn serve<S: Orders>(service: S, front: Front) -> Result<OrdersClient<Channel>, BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let service = OrdersServer::new(service);
    let mut builder = tonic::transport::Server::builder();
    match front {
        Front::None => {
            tokio::spawn(builder.add_service(service).serve_with_incoming(incoming));
        }
        Front::Detach => {
            let server = builder.layer(DetachLayer::new()).add_service(service);
            tokio::spawn(server.serve_with_incoming(incoming));
        }
        Front::Layer(layer) => {
            let server = builder.layer(layer).add_service(service);
            tokio::spawn(server.serve_with_incoming(incoming));
        }
    }
    Ok(OrdersClient::connect(format!("http://{addr}")).await?)
}

/// One pass: `CALLS` calls with fresh ids, `CONCURRENCY` at a time. Calls per second, and
/// each call's latency in milliseconds.
async fn pass(
    client: &OrdersClient<Channel>,
    tag: &str,
    calls: usize,
) -> Result<(f64, Vec<f64>), BoxError> {
    let start = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|worker| {
            let (mut client, tag) = (client.clone(), tag.to_owned());
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(calls / CONCURRENCY);
                for i in (worker..calls).step_by(CONCURRENCY) {
                    let sent = Instant::now();
                    let request_id = format!("{tag}-{i}");
                    let mut request = Request::new(CreateOrderRequest {
                        request_id: request_id.clone(),
                        customer: "bench".into(),
                        amount_cents: 1250,
                    });
                    // For the metadata-keyed layer; the other sides ignore it.
                    request
                        .metadata_mut()
                        .insert("idempotency-key", request_id.parse()?);
                    client.create_order(request).await?;
                    latencies.push(sent.elapsed().as_secs_f64() * 1e3);
                }
                Ok::<_, BoxError>(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(calls);
    for task in tasks {
        latencies.extend(task.await??);
    }
    Ok((per_s(calls, start.elapsed()), latencies))
}

const SIDES: [&str; 4] = ["bare", "by_hand", "attribute", "layer"];

/// A client of a server of `side` ("bare", "by_hand", "attribute" or "layer").
async fn side(url: &str, run_tag: &str, side: &str) -> Result<OrdersClient<Channel>, BoxError> {
    match side {
        "bare" => serve(Bare, Front::None).await,
        "by_hand" => {
            let conn = ConnectionManager::new(redis::Client::open(url)?).await?;
            let by_hand = ByHand {
                conn,
                complete: Script::new(COMPLETE),
                prefix: format!("bench:grpc:by_hand:{run_tag}"),
            };
            serve(by_hand, Front::None).await
        }
        "attribute" => {
            let attribute = Attribute {
                store: Arc::new(RedisStore::connect(url).await?),
                run: run_tag.to_owned(),
            };
            serve(attribute, Front::Detach).await
        }
        "layer" => {
            let idempotency = Idempotency::new(Duration::from_secs(3600))
                .lease(Duration::from_secs(30))
                .store(Arc::new(RedisStore::connect(url).await?) as SharedStore);
            let layer =
                IdempotencyLayer::new(idempotency, |_: &http::request::Parts| Some(String::new()))
                    .prefix(format!("bench:grpc:layer:{run_tag}"));
            serve(Bare, Front::Layer(layer)).await
        }
        other => Err(format!("no side {other}: bare, by_hand, attribute or layer").into()),
    }
}

/// `IDEMPOTENT_BENCH_ONLY=<side>`: a warm-up and `ops` calls of that side alone, nothing
/// printed: what callgrind counts.
async fn one_side(url: &str, run_tag: &str, name: &str, ops: usize) -> Result<(), BoxError> {
    let client = side(url, run_tag, name).await?;
    pass(&client, "warm", 100).await?;
    pass(&client, "only", ops).await?;
    Ok(())
}

async fn run(url: &str, run_tag: &str) -> Result<(), BoxError> {
    let mut clients = Vec::new();
    for name in SIDES {
        clients.push(side(url, run_tag, name).await?);
    }

    // Warm-up: connections, the script caches, allocators.
    for client in &clients {
        pass(client, "warm", CALLS).await?;
    }

    let mut rates: [Vec<f64>; 4] = Default::default();
    let mut latencies: [Vec<f64>; 4] = Default::default();
    let mut cpu: [Vec<f64>; 4] = Default::default();
    let mut allocs: [Vec<f64>; 4] = Default::default();
    for round in 0..ROUNDS {
        for step in 0..SIDES.len() {
            let side = (round + step) % SIDES.len();
            let before = client_cpu();
            let allocated = allocations::so_far();
            let (cps, lat) = pass(&clients[side], &format!("r{round}"), CALLS).await?;
            let per_call = (allocations::so_far() - allocated) as f64 / CALLS as f64;
            let cpu_us = match (before, client_cpu()) {
                (Some(before), Some(after)) => (after - before) * 1e6 / CALLS as f64,
                _ => f64::NAN,
            };
            println!(
                "round {round} {:>9}: {cps:>8.0} calls/s, process cpu/call {cpu_us:.1} us, \
                 {per_call:.0} allocations/call",
                SIDES[side]
            );
            allocs[side].push(per_call);
            rates[side].push(cps);
            latencies[side].extend(lat);
            cpu[side].push(cpu_us);
        }
    }
    let cps: Vec<f64> = rates.iter().map(|r| median(r)).collect();
    for (side, name) in SIDES.iter().enumerate() {
        figure(&format!("grpc_{name}_cps"), cps[side], 0);
    }
    figure("grpc_ratio", cps[2] / cps[1], 3);
    figure("grpc_layer_ratio", cps[3] / cps[1], 3);
    for (side, name) in SIDES.iter().enumerate() {
        let sorted = &mut latencies[side];
        sorted.sort_by(f64::total_cmp);
        figure(&format!("grpc_{name}_p50_ms"), percentile(sorted, 0.50), 2);
        figure(&format!("grpc_{name}_p99_ms"), percentile(sorted, 0.99), 2);
    }
    for (side, name) in SIDES.iter().enumerate() {
        figure(
            &format!("grpc_{name}_process_cpu_us"),
            median(&cpu[side]),
            1,
        );
        figure(
            &format!("grpc_{name}_allocations"),
            median(&allocs[side]),
            1,
        );
    }
    if instructions::enabled() {
        let mut counts = Vec::new();
        for name in SIDES {
            let count = instructions::per_cycle(name, INSTRUCTION_OPS)?;
            figure(&format!("grpc_{name}_instructions"), count, 0);
            counts.push(count);
        }
        // Work the hand-written guard does per call over the attribute's (and the layer's):
        // read as the throughput ratio would be, the higher the better.
        figure("grpc_instructions_ratio", counts[1] / counts[2], 3);
        figure("grpc_layer_instructions_ratio", counts[1] / counts[3], 3);
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    let url = std::env::var("IDEMPOTENT_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_string());
    let run_tag = format!("{:08x}", rand_u128() as u32);
    if std::env::var("IDEMPOTENT_BENCH_ONLY").is_err() {
        println!(
            "grpc bench: {CONCURRENCY} concurrent calls, {CALLS} calls a pass, run tag {run_tag}"
        );
    }
    let outcome = match instructions::only(INSTRUCTION_OPS) {
        Ok(Some((name, ops))) => one_side(&url, &run_tag, &name, ops).await,
        Ok(None) => run(&url, &run_tag).await,
        Err(err) => Err(err),
    };
    // Whatever happened, remove every key of this run.
    if let Ok(client) = redis::Client::open(url.as_str()) {
        if let Ok(mut conn) = ConnectionManager::new(client).await {
            for pattern in [
                format!("bench:grpc:by_hand:{run_tag}:*"),
                format!("bench:grpc:attribute:*{run_tag}*"),
                format!("bench:grpc:layer:{run_tag}:*"),
            ] {
                if let Err(err) = delete_matching(&mut conn, &pattern).await {
                    eprintln!("cleanup of {pattern} failed: {err}");
                }
            }
        }
    }
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!(
                "error: {err}\n(needs a Redis server at {url}: start one with\n  \
                 redis-server --daemonize yes\nor set IDEMPOTENT_REDIS_URL)"
            );
            ExitCode::FAILURE
        }
    }
}
