//! RFC 9457 problem details: one problem type per reason a request was not run or not
//! answered by its handler.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::http::body::Body;

/// Why the layer answered a request itself, as an RFC 9457 `application/problem+json`
/// response. Each has its own problem `type` (the [base](crate::http::IdempotencyLayer::problem_base)
/// followed by [`slug`](Problem::slug)), so a client can tell, say, a request in flight from a
/// key reused with another payload although both are `409`/`422`-class answers.
///
/// ```
/// use idempotent_runtime::http::Problem;
/// use http::StatusCode;
///
/// assert_eq!(Problem::InFlight.status(), StatusCode::CONFLICT);
/// assert_eq!(Problem::InFlight.slug(), "in-flight");
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Problem {
    /// `400`: the route requires an `Idempotency-Key` and the request has none.
    MissingKey,
    /// `400`: the key header is malformed, empty, too long or given more than once.
    InvalidKey,
    /// `400`: the scope function found no caller (tenant, principal) for the request.
    MissingScope,
    /// `413`: the request body is larger than the layer buffers.
    RequestTooLarge,
    /// `400`: the request body could not be read.
    InvalidBody,
    /// `409`: a request with this key is being processed; retry after `Retry-After`.
    InFlight,
    /// `422`: the key was used before with another request (method, path, query or body).
    PayloadMismatch,
    /// `409`: the first request with this key failed with an unknown outcome and the key is
    /// held until it expires or an operator clears it.
    Held,
    /// `409`: the key was completed by something other than this layer (a consumer sharing
    /// the key space), so there is no response to replay.
    AlreadyProcessed,
    /// `409`: the first request completed, but its response body was not kept (too large,
    /// failed, with trailers, or its client left mid-stream), so it cannot be replayed. Its
    /// handler is never run again.
    ResponseNotStored,
    /// `503`: the idempotency store did not answer; nothing was run (fail closed).
    StoreUnavailable,
    /// `500`: the handler panicked (its key is released, so a retry runs it), or the layer
    /// itself failed (a stored response it cannot read, a bad setting).
    Internal,
}

impl Problem {
    /// The HTTP status of the problem response.
    pub fn status(self) -> StatusCode {
        match self {
            Problem::MissingKey
            | Problem::InvalidKey
            | Problem::MissingScope
            | Problem::InvalidBody => StatusCode::BAD_REQUEST,
            Problem::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Problem::InFlight
            | Problem::Held
            | Problem::AlreadyProcessed
            | Problem::ResponseNotStored => StatusCode::CONFLICT,
            Problem::PayloadMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Problem::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The last segment of the problem's `type`: `missing-key`, `invalid-key`,
    /// `missing-scope`, `request-too-large`, `invalid-body`, `in-flight`, `payload-mismatch`,
    /// `held`, `already-processed`, `response-not-stored`, `store-unavailable`, `internal`.
    pub fn slug(self) -> &'static str {
        match self {
            Problem::MissingKey => "missing-key",
            Problem::InvalidKey => "invalid-key",
            Problem::MissingScope => "missing-scope",
            Problem::RequestTooLarge => "request-too-large",
            Problem::InvalidBody => "invalid-body",
            Problem::InFlight => "in-flight",
            Problem::PayloadMismatch => "payload-mismatch",
            Problem::Held => "held",
            Problem::AlreadyProcessed => "already-processed",
            Problem::ResponseNotStored => "response-not-stored",
            Problem::StoreUnavailable => "store-unavailable",
            Problem::Internal => "internal",
        }
    }

    /// The problem's `title`: the same for every occurrence.
    pub fn title(self) -> &'static str {
        match self {
            Problem::MissingKey => "Idempotency-Key is missing",
            Problem::InvalidKey => "Idempotency-Key is invalid",
            Problem::MissingScope => "The request has no caller to scope its key",
            Problem::RequestTooLarge => "Request body too large",
            Problem::InvalidBody => "Request body could not be read",
            Problem::InFlight => "A request with this key is in progress",
            Problem::PayloadMismatch => "Idempotency-Key reused with another request",
            Problem::Held => "The first request with this key has an unknown outcome",
            Problem::AlreadyProcessed => "This key was processed without a response to replay",
            Problem::ResponseNotStored => "The first response was not stored",
            Problem::StoreUnavailable => "Idempotency store unavailable",
            Problem::Internal => "Idempotency layer error",
        }
    }

    /// The problem as a response: `application/problem+json` with `type`, `title`, `status`
    /// and `detail`, and `Retry-After` (whole seconds, at least 1) when given.
    pub(crate) fn response(
        self,
        base: &str,
        detail: &str,
        retry_after: Option<Duration>,
    ) -> Response<Body> {
        let body = serde_json::json!({
            "type": format!("{base}{}", self.slug()),
            "title": self.title(),
            "status": self.status().as_u16(),
            "detail": detail,
        });
        let mut response = Response::new(Body::full(Bytes::from(body.to_string())));
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = retry_after {
            let secs = after
                .as_secs()
                .saturating_add(u64::from(after.subsec_nanos() > 0));
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        response.extensions_mut().insert(self);
        response
    }
}
