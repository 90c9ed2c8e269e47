//! The `metrics` feature with a Prometheus exporter: a burst of order messages through an
//! `#[idempotent]` consumer on the in-memory store (first deliveries, duplicates, replays, a
//! failure, a duplicate of a message still in flight), then `/metrics` served in Prometheus's
//! text format on `127.0.0.1:9464`.
//!
//! Needs nothing but a free port. Run it with:
//!
//! ```text
//! cargo run --example metrics_prometheus --features metrics
//! curl -s http://127.0.0.1:9464/metrics | grep idempotency
//! ```
//!
//! With `-- --once` it fetches its own `/metrics`, prints the `idempotency` lines and exits.
//! Series are named by the OpenTelemetry conventions; Prometheus's exporter writes the dots as
//! underscores (`idempotency_operations`, `idempotency_claim_duration`).

use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use idempotency::{idempotent, Error, Idempotency, Key, MemoryStore, OnInProgress, SharedStore};
use metrics_exporter_prometheus::PrometheusBuilder;

#[derive(Debug)]
struct OrderMessage {
    order_id: u32,
}

#[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600, store = store, replay)]
async fn on_order(store: &SharedStore, msg: &OrderMessage) -> Result<u32, Error> {
    // The effect: a receipt number.
    tokio::time::sleep(Duration::from_millis(1)).await;
    if msg.order_id % 25 == 0 {
        // A transient failure: the claim is given back and a redelivery runs it again.
        return Err(Error::NoStore);
    }
    Ok(msg.order_id * 10)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let prometheus = PrometheusBuilder::new().install_recorder()?;
    let store: SharedStore = Arc::new(MemoryStore::new());

    // 200 orders, each delivered three times (a producer retry and a redelivery).
    for round in 0..3 {
        for order_id in 1..=200 {
            let _ = on_order(&store, &OrderMessage { order_id }).await;
        }
        println!("round {round}: 200 deliveries");
    }
    // A duplicate that arrives while the first delivery still runs.
    let guard = Idempotency::new(Duration::from_secs(60)).store(store.clone());
    let key = Key::new("payment:capture", 1, &[&"pay-1"])?;
    let (started, running) = tokio::sync::oneshot::channel();
    let first = tokio::spawn({
        let (guard, key) = (guard.clone(), key.clone());
        async move {
            let out: Result<(), Error> = guard
                .run(key, async move {
                    let _ = started.send(());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok(())
                })
                .await;
            out
        }
    });
    running.await?;
    let busy: Result<(), Error> = guard
        .on_in_progress(OnInProgress::Reject)
        .run(key, async { Ok(()) })
        .await;
    println!("in flight: {busy:?}");
    first.await??;

    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let prometheus = prometheus.clone();
            async move { prometheus.render() }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:9464").await?;
    println!("serving http://127.0.0.1:9464/metrics");
    if std::env::args().any(|arg| arg == "--once") {
        tokio::spawn(async move { axum::serve(listener, app).await });
        let text = reqwest::get("http://127.0.0.1:9464/metrics")
            .await?
            .text()
            .await?;
        for line in text.lines().filter(|l| l.starts_with("idempotency")) {
            println!("{line}");
        }
        return Ok(());
    }
    axum::serve(listener, app).await?;
    Ok(())
}
