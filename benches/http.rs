//! The HTTP layer against a handler that guards itself by hand, over real HTTP.
//!
//! Two axum servers on 127.0.0.1 in this process, one Redis server, one HTTP/1.1 client with
//! keep-alive (reqwest) driving 50 connections:
//!
//! - **bare**: the handler does what the seed article does by hand: `SET key token NX PX`
//!   before the work (a taken key answers `409`), then a Lua compare-and-set that stores the
//!   response body under the key if the token is still the owner's. The key is the
//!   `Idempotency-Key` header under a prefix.
//! - **layer**: the same handler without any of that, behind `http::IdempotencyLayer` on a
//!   `RedisStore` (one `SET ... NX GET` to claim, one `EVALSHA` to complete with the stored
//!   response, and alongside the claim a read of the key the request had in the previous key
//!   layout, so that a retry across an upgrade of the layer does not run again).
//! - **current**: the layer without that read (`previous_layout(false)`, for a deployment
//!   that never ran the previous layout or has run this one for a ttl): what the upgrade
//!   check costs.
//!
//! Both sides make two Redis round trips per request and answer `201` with the same small
//! JSON body. Every request carries a fresh key (every request is a first run). After a
//! warm-up pass of each, bare and layer passes alternate (5 rounds); the median of each side
//! is kept. Latency is per request, over all requests of the measured passes.
//!
//! Needs a Redis server this benchmark may write to, at `IDEMPOTENT_REDIS_URL` (default
//! `redis://127.0.0.1:6379`); every key carries a tag unique to the run, expires after an
//! hour, and is deleted before the run ends. Run it with:
//!
//! ```text
//! cargo bench --bench http --features redis,http
//! ```
//!
//! The last lines are the figures: `http_bare_rps`, `http_layer_rps`, `http_ratio` (layer over
//! bare), `http_current_layout_rps` and `http_current_layout_ratio` (current over bare), `http_bare_p50_ms`, `http_bare_p99_ms`, `http_layer_p50_ms`, `http_layer_p99_ms`,
//! and the CPU time per request (median over passes) of this process (client and servers:
//! `http_*_process_cpu_us`) and of Redis (`http_*_redis_cpu_us`), which machine noise
//! disturbs less than the throughput, and the allocations per request of this process
//! (`http_*_allocations`). With valgrind installed it then counts each side's instructions
//! per request under callgrind (see `support/instructions.rs`): `http_bare_instructions`,
//! `http_layer_instructions` and `http_instructions_ratio` (bare's count over the layer's:
//! read as the throughput ratio is, the higher the better), a figure the machine's load does
//! not move, `http_current_layout_instructions` and `http_current_layout_instructions_ratio`
//! for the layer without the upgrade check, with `http_*_counted_scripts_per_request`: the scripts Redis ran per request of
//! the counted runs (the layer: 1.0 when its claims were the fast `SET ... NX GET`, 2.0 when,
//! slowed down under callgrind, they went through the script).
//! `IDEMPOTENT_BENCH_INSTRUCTIONS=0` skips it.

// A measurement program: failing loudly on a broken setup is the right behaviour.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/allocations.rs"]
mod allocations;
#[path = "support/instructions.rs"]
mod instructions;
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

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use idempotency::http::IdempotencyLayer;
use idempotency::Idempotency;
use redis::aio::ConnectionManager;
use redis::Script;
use redis_info::{client_cpu, server_cpu};
use seed_guard::{delete_matching, rand_u128, COMPLETE};
use stats::{figure, median, per_s, percentile};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const CONNECTIONS: usize = 50;
const REQUESTS: usize = 4_000;
const ROUNDS: usize = 5;
/// Warm-up requests of a side run alone.
const WARM_ONLY: usize = 200;
/// Requests a side makes under callgrind (and twice as many in the second count).
const INSTRUCTION_OPS: usize = 1_000;
const TTL_MS: u64 = 3_600_000;
const LEASE_MS: u64 = 30_000;

static ORDERS: AtomicU64 = AtomicU64::new(0);

/// The work both handlers do: number an order.
fn order_body() -> String {
    format!("{{\"order\":{}}}", ORDERS.fetch_add(1, Ordering::Relaxed))
}

/// The layer's handler: the work only.
async fn create_order() -> impl IntoResponse {
    (StatusCode::CREATED, order_body())
}

#[derive(Clone)]
struct Bare {
    conn: ConnectionManager,
    complete: Arc<Script>,
    prefix: String,
}

/// The handler guarding itself the seed's way.
async fn create_order_bare(
    State(bare): State<Bare>,
    headers: HeaderMap,
) -> axum::response::Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let key = format!("{}:{key}", bare.prefix);
    let token = format!("{:032x}", rand_u128());
    let mut conn = bare.conn.clone();
    let claimed: Option<String> = match redis::cmd("SET")
        .arg(&key)
        .arg(&token)
        .arg("NX")
        .arg("PX")
        .arg(LEASE_MS)
        .query_async(&mut conn)
        .await
    {
        Ok(claimed) => claimed,
        Err(_) => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
    };
    if claimed.is_none() {
        return StatusCode::CONFLICT.into_response();
    }
    let body = order_body();
    let stored: Result<i64, _> = bare
        .complete
        .key(&key)
        .arg(&token)
        .arg(format!("201:{body}"))
        .arg(TTL_MS)
        .invoke_async(&mut conn)
        .await;
    if stored.is_err() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    (StatusCode::CREATED, body).into_response()
}

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/orders", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    url
}

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Bare,
    Layer,
    /// The layer without the previous layout's read.
    Current,
}

/// One pass: `REQUESTS` requests with fresh keys over `CONNECTIONS` concurrent clients.
/// Requests per second, and each request's latency in milliseconds.
async fn pass(
    client: &reqwest::Client,
    url: &str,
    tag: &str,
    requests: usize,
) -> Result<(f64, Vec<f64>), BoxError> {
    let start = Instant::now();
    let tasks: Vec<_> = (0..CONNECTIONS)
        .map(|worker| {
            let (client, url, tag) = (client.clone(), url.to_owned(), tag.to_owned());
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(requests / CONNECTIONS);
                for i in (worker..requests).step_by(CONNECTIONS) {
                    let sent = Instant::now();
                    let response = client
                        .post(&url)
                        .header("idempotency-key", format!("{tag}-{i}"))
                        .header("x-api-key", "bench")
                        .send()
                        .await?;
                    let status = response.status();
                    response.bytes().await?;
                    if status != reqwest::StatusCode::CREATED {
                        return Err(format!("{url}: {status}").into());
                    }
                    latencies.push(sent.elapsed().as_secs_f64() * 1e3);
                }
                Ok::<_, BoxError>(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(requests);
    for task in tasks {
        latencies.extend(task.await??);
    }
    Ok((per_s(requests, start.elapsed()), latencies))
}

async fn run(url: &str, run_tag: &str) -> Result<(), BoxError> {
    let client = redis::Client::open(url)?;
    let conn = ConnectionManager::new(client).await?;
    let store = redis_info::store(url, instructions::COUNTED_CLOCK_ERROR).await?;
    let bare_url = serve(
        Router::new()
            .route("/orders", post(create_order_bare))
            .with_state(Bare {
                conn: conn.clone(),
                complete: Arc::new(Script::new(COMPLETE)),
                prefix: format!("bench:http:bare:{run_tag}"),
            }),
    )
    .await;
    let idempotency = Idempotency::new(Duration::from_millis(TTL_MS))
        .lease(Duration::from_millis(LEASE_MS))
        .store(Arc::new(store));
    let layer = IdempotencyLayer::new(idempotency, |request: &http::request::Parts| {
        Some(request.headers.get("x-api-key")?.to_str().ok()?.to_owned())
    })
    .prefix(format!("bench:http:layer:{run_tag}"));
    let current = layer
        .clone()
        .prefix(format!("bench:http:current:{run_tag}"))
        .previous_layout(false);
    let layer_url = serve(
        Router::new()
            .route("/orders", post(create_order))
            .layer(layer),
    )
    .await;
    let current_url = serve(
        Router::new()
            .route("/orders", post(create_order))
            .layer(current),
    )
    .await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(CONNECTIONS)
        .build()?;

    // `IDEMPOTENT_BENCH_ONLY=<side>`: a warm-up and `ops` requests of that side alone,
    // nothing printed: what callgrind counts.
    if let Some((name, ops)) = instructions::only(INSTRUCTION_OPS)? {
        let url = match name.as_str() {
            "bare" => &bare_url,
            "layer" => &layer_url,
            "current" => &current_url,
            other => return Err(format!("no side {other}: bare, layer or current").into()),
        };
        pass(&client, url, "warm", WARM_ONLY).await?;
        pass(&client, url, "only", ops).await?;
        return Ok(());
    }
    println!(
        "http bench: {CONNECTIONS} connections, {REQUESTS} requests a pass, run tag {run_tag}"
    );

    // Warm-up: connections, the script caches, allocators.
    pass(&client, &bare_url, "warm", REQUESTS).await?;
    pass(&client, &layer_url, "warm", REQUESTS).await?;
    pass(&client, &current_url, "warm", REQUESTS).await?;

    let mut info = conn.clone();
    let (mut bare, mut layer) = (Vec::new(), Vec::new());
    // CPU microseconds per request: this process (client and server), and Redis.
    let (mut bare_cpu, mut layer_cpu) = (Vec::new(), Vec::new());
    let (mut bare_redis, mut layer_redis) = (Vec::new(), Vec::new());
    let (mut bare_latency, mut layer_latency) = (Vec::new(), Vec::new());
    let (mut bare_allocs, mut layer_allocs) = (Vec::new(), Vec::new());
    // The layer without the previous layout's read: throughput only.
    let mut current = Vec::new();
    for round in 0..ROUNDS {
        // Each side takes each place in turn.
        let mut order = [Side::Bare, Side::Layer, Side::Current];
        order.rotate_left(round % 3);
        if round % 2 == 1 {
            order.reverse();
        }
        for side in order {
            let tag = format!("r{round}");
            if side == Side::Current {
                let (rps, _) = pass(&client, &current_url, &tag, REQUESTS).await?;
                println!("round {round} current: {rps:>8.0} requests/s");
                current.push(rps);
                continue;
            }
            let (url, rates, latencies, cpu, redis_cpu, allocs, name) = match side {
                Side::Bare => (
                    &bare_url,
                    &mut bare,
                    &mut bare_latency,
                    &mut bare_cpu,
                    &mut bare_redis,
                    &mut bare_allocs,
                    "bare",
                ),
                // `Current` went on above.
                Side::Layer | Side::Current => (
                    &layer_url,
                    &mut layer,
                    &mut layer_latency,
                    &mut layer_cpu,
                    &mut layer_redis,
                    &mut layer_allocs,
                    "layer",
                ),
            };
            let (process_before, redis_before) = (client_cpu(), server_cpu(&mut info).await?);
            let allocated = allocations::so_far();
            let (rps, lat) = pass(&client, url, &tag, REQUESTS).await?;
            let per_request_allocs = (allocations::so_far() - allocated) as f64 / REQUESTS as f64;
            let per_request = |seconds: f64| seconds * 1e6 / REQUESTS as f64;
            let redis_us = per_request(server_cpu(&mut info).await? - redis_before);
            let process_us = match (process_before, client_cpu()) {
                (Some(before), Some(after)) => per_request(after - before),
                _ => f64::NAN,
            };
            println!(
                "round {round} {name:>5}: {rps:>8.0} requests/s, cpu/request: process \
                 {process_us:.1} us, redis {redis_us:.1} us, {per_request_allocs:.0} allocations"
            );
            allocs.push(per_request_allocs);
            rates.push(rps);
            latencies.extend(lat);
            cpu.push(process_us);
            redis_cpu.push(redis_us);
        }
    }
    bare_latency.sort_by(f64::total_cmp);
    layer_latency.sort_by(f64::total_cmp);
    let (bare_rps, layer_rps) = (median(&bare), median(&layer));
    figure("http_bare_rps", bare_rps, 0);
    figure("http_layer_rps", layer_rps, 0);
    figure("http_ratio", layer_rps / bare_rps, 3);
    figure("http_current_layout_rps", median(&current), 0);
    figure("http_current_layout_ratio", median(&current) / bare_rps, 3);
    figure("http_bare_p50_ms", percentile(&bare_latency, 0.50), 2);
    figure("http_bare_p99_ms", percentile(&bare_latency, 0.99), 2);
    figure("http_layer_p50_ms", percentile(&layer_latency, 0.50), 2);
    figure("http_layer_p99_ms", percentile(&layer_latency, 0.99), 2);
    figure("http_bare_process_cpu_us", median(&bare_cpu), 1);
    figure("http_layer_process_cpu_us", median(&layer_cpu), 1);
    figure("http_bare_redis_cpu_us", median(&bare_redis), 1);
    figure("http_layer_redis_cpu_us", median(&layer_redis), 1);
    figure("http_bare_allocations", median(&bare_allocs), 1);
    figure("http_layer_allocations", median(&layer_allocs), 1);
    if instructions::enabled() {
        let mut scripts = redis_info::script_calls(url)?;
        // One script a request on both sides: its completion. A run whose claims fell back to
        // the script is taken again.
        let expected = Some(instructions::Expected {
            warm_cycles: WARM_ONLY,
            per_cycle: 1.0,
        });
        let (bare, bare_scripts) =
            instructions::per_cycle_expected("bare", INSTRUCTION_OPS, &mut scripts, expected)?;
        let (layer, layer_scripts) =
            instructions::per_cycle_expected("layer", INSTRUCTION_OPS, &mut scripts, expected)?;
        let (current, current_scripts) =
            instructions::per_cycle_expected("current", INSTRUCTION_OPS, &mut scripts, expected)?;
        figure("http_bare_instructions", bare, 0);
        figure("http_layer_instructions", layer, 0);
        figure("http_current_layout_instructions", current, 0);
        figure("http_bare_counted_scripts_per_request", bare_scripts, 2);
        figure("http_layer_counted_scripts_per_request", layer_scripts, 2);
        figure(
            "http_current_layout_counted_scripts_per_request",
            current_scripts,
            2,
        );
        figure("http_instructions_ratio", bare / layer, 3);
        figure("http_current_layout_instructions_ratio", bare / current, 3);
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    let url = std::env::var("IDEMPOTENT_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_string());
    let run_tag = format!("{:08x}", rand_u128() as u32);
    let outcome = run(&url, &run_tag).await;
    // Whatever happened, remove every key of this run.
    if let Ok(client) = redis::Client::open(url.as_str()) {
        if let Ok(mut conn) = ConnectionManager::new(client).await {
            for pattern in [
                format!("bench:http:bare:{run_tag}:*"),
                format!("bench:http:layer:{run_tag}:*"),
                format!("bench:http:current:{run_tag}:*"),
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
