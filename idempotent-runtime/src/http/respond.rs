//! What a request is answered: the fresh response, a replay, or a problem, each counted.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::error::Error;
use crate::http::body::Body;
use crate::http::failure::Failure;
use crate::http::stored::Stored;
use crate::http::stream::Live;
use crate::http::{Config, Problem, Replayed, REPLAYED};

/// The response to send for a run's outcome.
pub(crate) fn answer<E>(
    config: &Config,
    outcome: Result<Stored, Failure<E>>,
    live: &Live,
) -> Result<Response<Body>, E> {
    let counts = &config.counts;
    match outcome {
        Ok(stored) => {
            let fresh = live
                .response
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            match fresh {
                Some(mut response) => {
                    counts.fresh.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(outcome = "fresh", status = %response.status(), "stored");
                    response.extensions_mut().insert(Replayed(false));
                    Ok(response)
                }
                // Sent already, as the handler produced it: the outcome is counted here.
                None if live.streamed.load(Ordering::Relaxed) => {
                    counts.fresh.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(outcome = "fresh", status = %stored.status, "stored");
                    Ok(Response::new(Body::full(Bytes::new())))
                }
                None => Ok(replay(config, stored)),
            }
        }
        Err(Failure::Released(mut response)) => {
            counts.released.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(outcome = "released", status = %response.status(), "not stored");
            response.extensions_mut().insert(Replayed(false));
            Ok(response)
        }
        Err(Failure::Service(err)) => Err(err),
        Err(Failure::Panicked(message)) => {
            tracing::error!(panic = %message, "the handler panicked; its key is released");
            let detail = "the handler failed; nothing was stored and a retry runs it again";
            Ok(reject(config, Problem::Internal, detail))
        }
        Err(Failure::Engine(err)) => Ok(engine_problem(config, &err)),
    }
}

/// A stored response, as a retry gets it.
fn replay(config: &Config, stored: Stored) -> Response<Body> {
    let Stored {
        status,
        headers,
        body,
    } = stored;
    let mut response = match body {
        Some(body) => {
            let mut response = Response::new(Body::full(body));
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            response
        }
        None => match headers.get(header::LOCATION) {
            Some(location) => {
                let mut response = Response::new(Body::full(Bytes::new()));
                *response.status_mut() = StatusCode::SEE_OTHER;
                response
                    .headers_mut()
                    .insert(header::LOCATION, location.clone());
                response
            }
            None => {
                let detail = format!(
                    "the first request with this key completed with status {status}, but its \
                     response body was not kept (too large, failed, or its client left \
                     mid-stream); it is not run again"
                );
                return reject(config, Problem::ResponseNotStored, &detail);
            }
        },
    };
    config.counts.replayed.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(outcome = "replayed", status = %response.status(), "replayed");
    response
        .headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    response.extensions_mut().insert(Replayed(true));
    response
}

/// The problem for an engine answer other than a run or a replay.
fn engine_problem(config: &Config, err: &Error) -> Response<Body> {
    let (problem, detail) = match err {
        Error::InProgress { .. } => (
            Problem::InFlight,
            "a request with this idempotency key is being processed; retry later".to_owned(),
        ),
        Error::PayloadMismatch { .. } => (
            Problem::PayloadMismatch,
            "this idempotency key was used with another request (method, path, query or body)"
                .to_owned(),
        ),
        Error::Held { .. } => (
            Problem::Held,
            "the first request with this key ended with an unknown outcome; the key is held"
                .to_owned(),
        ),
        Error::Duplicate { .. } => (
            Problem::AlreadyProcessed,
            "this key was processed without a response to replay".to_owned(),
        ),
        Error::Store(store) => (
            Problem::StoreUnavailable,
            format!(
                "the idempotency store did not answer ({:?}); nothing was run",
                store.kind()
            ),
        ),
        other => (Problem::Internal, other.to_string()),
    };
    reject(config, problem, &detail)
}

/// A problem response, counted.
pub(crate) fn reject(config: &Config, problem: Problem, detail: &str) -> Response<Body> {
    config.counts.rejected.fetch_add(1, Ordering::Relaxed);
    let retry_after = matches!(problem, Problem::InFlight | Problem::StoreUnavailable)
        .then_some(config.retry_after);
    tracing::debug!(problem = problem.slug(), detail, "answered with a problem");
    problem.response(&config.problem_base, detail, retry_after)
}
