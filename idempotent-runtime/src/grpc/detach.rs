//! [`DetachLayer`]: a call keeps running when its client leaves.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio_util::task::TaskTracker;

use crate::http::detached::Detached;

/// A tower layer under which a call whose client left (its deadline expired, it cancelled,
/// its connection dropped) runs to its end instead of being dropped halfway: the call is
/// polled where the server awaits it, and goes on in a task of its own if the server drops
/// it first.
///
/// A gRPC server drops a call's future when the client resets the stream, which a client
/// does when its deadline expires, and when the server's own deadline (`grpc-timeout`)
/// expires. Dropped before its body finished, an `#[idempotent]` method gives its claim
/// back, although the body may have done its effect already (the row inserted, the payment
/// captured): the client's retry then runs it a second time. With this layer the method
/// finishes, its reply is stored, and the retry gets the replay: add it to every server with
/// idempotent methods.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::grpc::DetachLayer;
/// use tower_layer::Layer as _;
/// use tower_service::Service as _;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let detach = DetachLayer::new();
/// // In a tonic server: `Server::builder().layer(detach.clone()).add_service(orders)`.
/// let routes = axum::Router::new().route("/", axum::routing::post(async || "created"));
/// let mut service = detach.layer(routes);
/// let request = http::Request::post("/").body(axum::body::Body::empty()).unwrap();
/// assert_eq!(service.call(request).await.unwrap().status(), 200);
/// // After the server stopped accepting calls: let the detached ones finish.
/// assert!(detach.shutdown(Duration::from_secs(30)).await);
/// # }
/// ```
///
/// A call that panics panics as it would without the layer (the panic is resumed where the
/// call was awaited).
#[derive(Debug, Clone, Default)]
pub struct DetachLayer {
    tasks: TaskTracker,
}

impl DetachLayer {
    /// A layer with no call running yet.
    pub fn new() -> DetachLayer {
        DetachLayer::default()
    }

    /// How many calls are running under the layer, in place or in its tasks (those whose
    /// clients left included).
    pub fn running(&self) -> usize {
        self.tasks.len()
    }

    /// Waits, at most `within`, for the calls still running to finish; call it after the
    /// server stopped accepting calls. Returns `false` when some were still running at the
    /// deadline.
    pub async fn shutdown(&self, within: Duration) -> bool {
        crate::http::drain(&self.tasks, within).await
    }
}

impl<S> tower_layer::Layer<S> for DetachLayer {
    type Service = Detach<S>;

    fn layer(&self, inner: S) -> Detach<S> {
        Detach {
            inner,
            tasks: self.tasks.clone(),
        }
    }
}

/// The service [`DetachLayer`] makes.
#[derive(Debug, Clone)]
pub struct Detach<S> {
    inner: S,
    tasks: TaskTracker,
}

impl<S, Request> tower_service::Service<Request> for Detach<S>
where
    S: tower_service::Service<Request>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // Polled in place, and moved to a task of its own if this future is dropped first.
        let call = Detached::new(self.inner.call(request), &self.tasks);
        Box::pin(async move {
            match call.await {
                Ok(answer) => answer,
                Err(ended) => match ended.into_panic() {
                    Some(panic) => std::panic::resume_unwind(panic),
                    // Polled after it ended: not done by this future, which awaits it once.
                    None => std::future::pending().await,
                },
            }
        })
    }
}
