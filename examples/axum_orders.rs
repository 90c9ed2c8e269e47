//! A create-order API on PostgreSQL, idempotent per `Idempotency-Key` through
//! `idempotency::http::IdempotencyLayer`: a retried `POST /orders` gets the first response
//! back (`Idempotent-Replayed: true`) and never creates a second order.
//!
//! Needs PostgreSQL (`IDEMPOTENT_PG_URL`, default `postgres://postgres@127.0.0.1:5432/test`);
//! the records go to the same database (or to `IDEMPOTENT_STORE_URL`, e.g. `memory:` or a
//! Redis URL). Run it and try it:
//!
//! ```sh
//! cargo run --example axum_orders
//! # first request: 201, order created
//! curl -i -X POST localhost:3000/orders -H 'x-api-key: alice' -H 'Idempotency-Key: "o-1"' -d 'pizza'
//! # the same request again: the same 201 and body, Idempotent-Replayed: true
//! curl -i -X POST localhost:3000/orders -H 'x-api-key: alice' -H 'Idempotency-Key: "o-1"' -d 'pizza'
//! # the same key with another body: 422 payload-mismatch
//! curl -i -X POST localhost:3000/orders -H 'x-api-key: alice' -H 'Idempotency-Key: "o-1"' -d 'sushi'
//! # no key: 400 missing-key
//! curl -i -X POST localhost:3000/orders -H 'x-api-key: alice' -d 'pizza'
//! # while a slow request runs, its retry: 409 in-flight with Retry-After
//! curl -s -X POST localhost:3000/orders -H 'x-api-key: alice' -H 'Idempotency-Key: "o-2"' -d 'slow' &
//! sleep 0.5; curl -i -X POST localhost:3000/orders -H 'x-api-key: alice' -H 'Idempotency-Key: "o-2"' -d 'slow'
//! ```
//!
//! `IDEMPOTENT_HTTP_ADDR` changes the address (default `127.0.0.1:3000`).

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use idempotency::http::IdempotencyLayer;
use idempotency::Idempotency;
use sqlx::PgPool;

#[derive(Clone)]
struct App {
    db: PgPool,
}

/// Creates the order. `slow` takes three seconds, to show a retry while it runs.
async fn create_order(State(app): State<App>, item: String) -> impl IntoResponse {
    if item == "slow" {
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let created =
        sqlx::query_scalar::<_, i64>("INSERT INTO example_orders (item) VALUES ($1) RETURNING id")
            .bind(&item)
            .fetch_one(&app.db)
            .await;
    match created {
        Ok(id) => (
            StatusCode::CREATED,
            [("location", format!("/orders/{id}"))],
            format!("{{\"id\":{id},\"item\":{item:?}}}\n"),
        )
            .into_response(),
        // A 5xx releases the key: the client's retry runs the handler again.
        Err(err) => (StatusCode::SERVICE_UNAVAILABLE, format!("{err}\n")).into_response(),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pg_url = std::env::var("IDEMPOTENT_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let db = PgPool::connect(&pg_url).await.map_err(|e| {
        format!("cannot reach PostgreSQL at {pg_url} ({e}); start it or set IDEMPOTENT_PG_URL")
    })?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS example_orders (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL)",
    )
    .execute(&db)
    .await?;

    let store_url = std::env::var("IDEMPOTENT_STORE_URL").unwrap_or_else(|_| pg_url.clone());
    let store = idempotency::connect(&store_url).await?;
    println!("store: {store_url}");

    // Keys live a day (as Stripe's do); a retry while the first request runs gets a 409.
    let idempotency = Idempotency::new(Duration::from_secs(24 * 3600)).store(store);
    // The caller: an API key an authentication layer would have checked.
    let layer = IdempotencyLayer::new(idempotency, |request: &http::request::Parts| {
        let caller = request.headers.get("x-api-key")?.to_str().ok()?;
        Some(caller.to_owned())
    })
    .prefix("orders-api");

    let app = Router::new()
        .route("/orders", post(create_order))
        .layer(layer.clone())
        .with_state(App { db });
    let addr = std::env::var("IDEMPOTENT_HTTP_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{addr} (Ctrl-C stops)");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Handlers whose clients hung up still finish and store their responses.
    if !layer.shutdown(Duration::from_secs(10)).await {
        eprintln!("some handlers were still running after 10 s");
    }
    println!("{:?}", layer.counts());
    Ok(())
}
