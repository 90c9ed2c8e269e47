//! `http::InTransaction` over real HTTP on PostgreSQL: the claim, the handler's order row and
//! the stored response commit in one transaction.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use idempotency::http::{IdempotencyLayer, InTransaction};
use idempotency::sql::sqlx::{self, AssertSqlSafe, Postgres};
use idempotency::sql::PostgresStore;
use idempotency::Idempotency;
use sql_tables::{Scratch, Server};
use tokio::sync::Semaphore;

struct App {
    orders: InTransaction<Postgres>,
    table: String,
}

/// Inserts an order row in the request's transaction; `fail` answers `503` after writing it.
async fn create_order(
    State(app): State<Arc<App>>,
    request: Request,
) -> Response<idempotency::http::Body> {
    let insert = format!("INSERT INTO {} (item) VALUES ($1) RETURNING id", app.table);
    app.orders
        .run(request, async |conn, _parts, body| {
            let item = String::from_utf8_lossy(&body).into_owned();
            let id: i64 = sqlx::query_scalar(AssertSqlSafe(insert))
                .bind(&item)
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            let status = if item == "fail" {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::CREATED
            };
            Response::builder()
                .status(status)
                .body(Body::from(format!("{{\"id\":{id}}}")))
                .unwrap()
        })
        .await
}

struct Running {
    url: String,
    pool: sqlx::PgPool,
    table: Scratch,
    _records: Scratch,
    layer: IdempotencyLayer,
}

impl Running {
    async fn rows(&self) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {}", self.table.name());
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

async fn start() -> Running {
    let records = Scratch::table(Server::Postgres);
    let table = Scratch::table(Server::Postgres);
    let pool = sqlx::PgPool::connect(table.url()).await.unwrap();
    let create = format!(
        "CREATE TABLE {} (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL)",
        table.name()
    );
    sqlx::query(AssertSqlSafe(create))
        .execute(&pool)
        .await
        .unwrap();
    let store = PostgresStore::builder(records.url())
        .table(records.name().to_string())
        .max_connections(60)
        .build()
        .await
        .unwrap();
    let layer = IdempotencyLayer::new(
        Idempotency::new(Duration::from_secs(3600)),
        |_: &http::request::Parts| Some("tenant".to_owned()),
    );
    let app = Arc::new(App {
        orders: layer.in_transaction(Arc::new(store)),
        table: table.name().to_owned(),
    });
    let router = Router::new()
        .route("/orders", post(create_order))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/orders", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    Running {
        url,
        pool,
        table,
        _records: records,
        layer,
    }
}

async fn post_order(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    item: &str,
) -> (u16, bool, String) {
    let response = client
        .post(url)
        .header("idempotency-key", key)
        .body(item.to_owned())
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let replayed = response.headers().get("idempotent-replayed").is_some();
    (status, replayed, response.text().await.unwrap())
}

/// The first request commits its order and its response; retries replay it and add no row.
#[tokio::test]
async fn the_order_and_its_response_commit_together() {
    let server = start().await;
    let client = reqwest::Client::new();
    let first = post_order(&client, &server.url, "k1", "pizza").await;
    assert_eq!((first.0, first.1), (201, false));
    for _ in 0..3 {
        let again = post_order(&client, &server.url, "k1", "pizza").await;
        assert_eq!(again, (201, true, first.2.clone()));
    }
    assert_eq!(server.rows().await, 1);
    let other = post_order(&client, &server.url, "k1", "sushi").await;
    assert_eq!(other.0, 422);
    let counts = server.layer.counts();
    assert_eq!((counts.fresh, counts.replayed), (1, 3));
}

/// 50 concurrent identical requests: one transaction inserts the order, the others wait on
/// the record's row lock and replay its response. Exactly one row, one fresh answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_create_one_order() {
    let server = start().await;
    let client = reqwest::Client::new();
    let start = Arc::new(Semaphore::new(0));
    let calls: Vec<_> = (0..50)
        .map(|_| {
            let (client, url, start) = (client.clone(), server.url.clone(), start.clone());
            tokio::spawn(async move {
                let _go = start.acquire().await.unwrap();
                post_order(&client, &url, "same", "pizza").await
            })
        })
        .collect();
    start.add_permits(50);
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap());
    }
    assert_eq!(server.rows().await, 1);
    assert!(
        answers.iter().all(|a| a.0 == 201 && a.2 == answers[0].2),
        "{answers:?}"
    );
    assert_eq!(answers.iter().filter(|a| !a.1).count(), 1, "{answers:?}");
}

/// A response that releases the key (`503`) rolls the transaction back, its order row
/// included; the retry runs again.
#[tokio::test]
async fn a_released_response_rolls_back_the_handlers_writes() {
    let server = start().await;
    let client = reqwest::Client::new();
    let failed = post_order(&client, &server.url, "k", "fail").await;
    assert_eq!((failed.0, failed.1), (503, false));
    assert_eq!(server.rows().await, 0);
    let retry = post_order(&client, &server.url, "k", "fail").await;
    assert_eq!((retry.0, retry.1), (503, false));
    assert_eq!(server.rows().await, 0);
    assert_eq!(server.layer.counts().released, 2);
}
