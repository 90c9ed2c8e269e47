//! gRPC through tonic: the `#[idempotent]` attribute on service methods, keyed by the
//! request's own id (AIP-155's `request_id`), replaying the first response to every retry.
//!
//! gRPC clients retry unary calls on their own (retry policies, hedging, a deadline that
//! expires after the server did the work), so the same `CreateOrder` reaches a server more
//! than once. Put the attribute on the method, inside the `#[tonic::async_trait]` impl:
//!
//! ```text
//! #[tonic::async_trait]
//! impl pb::orders_server::Orders for OrderService {
//!     #[idempotent(prefix = "orders:create", keys = [request.get_ref().request_id], ttl = 86400,
//!                  fingerprint = [request.get_ref().amount_cents], replay)]
//!     async fn create_order(&self, request: Request<CreateOrder>) -> Result<Response<Order>, Status> {
//!         // insert the order: runs once per request_id
//!     }
//! }
//! ```
//!
//! (The `idempotency` crate's guide, chapter "gRPC methods", has this example whole and
//! running.) Serve it behind a [`DetachLayer`], so that a call whose client left (its
//! deadline expired) finishes and stores its reply instead of being dropped halfway.
//!
//! - **Keys** are message fields (`request.get_ref().request_id`), metadata entries
//!   (`request.metadata().get("x-request-id")`: a missing entry is an empty key part, refused
//!   as [`KeyError::EmptyPart`](crate::KeyError::EmptyPart)), or anything else that is a
//!   [`KeyPart`]. proto3's empty string (the field was not set) is refused the
//!   same way: `INVALID_ARGUMENT`, nothing runs.
//! - **`replay`** of a `Response<M>` for a prost message `M` stores the message as prost
//!   encodes it and the response metadata the method set; generated types need no serde. A
//!   replayed response carries the metadata entry `idempotent-replayed: true` ([`REPLAYED`]).
//!   Put per-call metadata a retry must not see (a server timestamp, a trace id) on the
//!   response in a layer or interceptor outside the method, not in the method itself.
//! - **Outcomes** that are not the method's own answer arrive as a [`tonic::Status`]
//!   (`impl From<idempotency::Error> for Status`), by the table below.
//!
//! # Status codes
//!
//! Chosen by the gRPC status code guide ("use `UNAVAILABLE` if the client can retry just the
//! failing call, `ABORTED` if it should retry at a higher level, `FAILED_PRECONDITION` if it
//! should not retry until the system state has been explicitly fixed") and AIP-155 (a
//! duplicate gets the first response, which `replay` gives):
//!
//! | outcome | [`Error`] | code | why |
//! |---|---|---|---|
//! | key missing or invalid | `InvalidKey` | `INVALID_ARGUMENT` | the request is wrong whatever the server's state; nothing ran |
//! | same id, another payload | `PayloadMismatch` | `INVALID_ARGUMENT` | a client bug, as HTTP's `422`: no retry can succeed; send a new id |
//! | in flight (another call runs it) | `InProgress`, `Skipped` | `ABORTED` | a concurrency conflict: retry later with the same id, and get the replay |
//! | lease lost before completing | `LostOwnership` | `ABORTED` | another owner took the call over: retry with the same id |
//! | completed, nothing to replay | `Duplicate` | `ALREADY_EXISTS` | the effect happened once already (without `replay`, or completed elsewhere) |
//! | held after a failed run | `Held` | `FAILED_PRECONDITION` | the first run's outcome is unknown: an operator clears the key, retrying does not help |
//! | store down, reply lost | `Store` (transient) | `UNAVAILABLE` | nothing ran (fail closed): retry the call with backoff |
//! | store refused the record, corrupt record | `Store` (permanent) | `INTERNAL` | a server-side fault a retry meets again |
//! | no store, bad setting, unreadable stored reply | `NoStore`, `NoRuntime`, `InvalidDuration`, `Codec` | `INTERNAL` | the server is misconfigured |
//!
//! [`code`] gives the code of an error; the status message is the error's `Display`.
//!
//! # Without changing the messages: [`IdempotencyLayer`]
//!
//! A service whose messages have no request id (or that cannot change them) puts
//! [`IdempotencyLayer`] in front of its tonic server instead: calls carrying an
//! `idempotency-key` metadata entry are claimed under it (scoped per caller), the method runs
//! once, and its reply (headers, message and trailers) is replayed to retries, with the same
//! engine, store and statuses as the attribute. It guards unary methods only: every
//! streaming method is named with [`IdempotencyLayer::streaming`] and passes through
//! unguarded.
//!
//! [`Error`]: crate::Error

mod call;
mod detach;
mod layer;
mod reply;

use tonic::metadata::{Ascii, Binary, MetadataValue};
use tonic::{Code, Status};

use crate::engine::{HandlerResult, Operation};
use crate::error::Error;
use crate::key::KeyPart;

use reply::{decode_reply, encode_reply};

pub use detach::{Detach, DetachLayer};
pub use layer::{storage_for, IdempotencyLayer, IdempotencyService};

/// The metadata entry a replayed response carries, with the value `true`.
pub const REPLAYED: &str = "idempotent-replayed";

/// The gRPC status code of an outcome that is not the method's own answer: see the
/// [table](self#status-codes).
///
/// ```
/// use idempotent_runtime::{grpc, Error, Key};
/// use tonic::Code;
///
/// let key = Key::new("orders:create", 1, &[&"r-1"]).unwrap();
/// assert_eq!(grpc::code(&Error::InProgress { key: key.clone(), fence: 3 }), Code::Aborted);
/// assert_eq!(grpc::code(&Error::PayloadMismatch { key }), Code::InvalidArgument);
/// ```
pub fn code(error: &Error) -> Code {
    match error {
        Error::InvalidKey(_) | Error::PayloadMismatch { .. } => Code::InvalidArgument,
        Error::InProgress { .. } | Error::Skipped { .. } | Error::LostOwnership { .. } => {
            Code::Aborted
        }
        Error::Duplicate { .. } => Code::AlreadyExists,
        Error::Held { .. } => Code::FailedPrecondition,
        Error::Store(err) if err.is_permanent() => Code::Internal,
        Error::Store(_) => Code::Unavailable,
        Error::NoStore | Error::NoRuntime | Error::InvalidDuration { .. } | Error::Codec { .. } => {
            Code::Internal
        }
    }
}

/// Every outcome that is not the method's own answer, as a status: [`code`] and the error's
/// message.
impl From<Error> for Status {
    fn from(error: Error) -> Status {
        Status::new(code(&error), error.to_string())
    }
}

impl<M, R, D> Operation<R, D>
where
    M: prost::Message + Default,
    R: HandlerResult<Ok = tonic::Response<M>>,
{
    /// Stores the first run's reply (its message as prost encodes it, and its metadata) and
    /// returns it to duplicates, marked with [`REPLAYED`]: what `replay` does on a tonic
    /// method. Generated message types need no serde.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotent_runtime::{grpc, Idempotency, Key, MemoryStore};
    /// use tonic::{Response, Status};
    ///
    /// #[derive(Clone, PartialEq, prost::Message)]
    /// struct Order {
    ///     #[prost(uint64, tag = "1")]
    ///     id: u64,
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let orders = Idempotency::new(Duration::from_secs(86_400)).store(Arc::new(MemoryStore::new()));
    /// let key = Key::new("orders:create", 1, &[&"request-1"]).unwrap();
    /// for attempt in 0..2 {
    ///     let reply: Result<Response<Order>, Status> = orders
    ///         .operation(key.clone())
    ///         .replay_grpc()
    ///         .run(async { Ok(Response::new(Order { id: 42 })) })
    ///         .await;
    ///     let reply = reply.unwrap();
    ///     assert_eq!(reply.get_ref().id, 42);
    ///     assert_eq!(reply.metadata().contains_key(grpc::REPLAYED), attempt == 1);
    /// }
    /// # }
    /// ```
    pub fn replay_grpc(self) -> Self {
        self.replay_with(encode_reply::<M>, decode_reply::<M>)
    }
}

macro_rules! metadata_key_part {
    ($($encoding:ty)*) => {$(
        /// A metadata entry as a key part: its bytes as sent (a binary entry in its base64
        /// form).
        impl KeyPart for MetadataValue<$encoding> {
            fn write_key_part(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(self.as_encoded_bytes());
            }
        }

        /// A metadata entry that may be absent (`request.metadata().get("x-request-id")`): a
        /// missing one writes nothing, so the key is refused as
        /// [`KeyError::EmptyPart`](crate::KeyError::EmptyPart) and the call answers
        /// `INVALID_ARGUMENT` without running.
        impl KeyPart for Option<&MetadataValue<$encoding>> {
            fn write_key_part(&self, out: &mut Vec<u8>) {
                if let Some(value) = self {
                    value.write_key_part(out);
                }
            }
        }
    )*};
}
metadata_key_part!(Ascii Binary);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Key, KeyError, StoreError, StoreErrorKind};

    #[test]
    fn every_outcome_has_its_code_and_keeps_its_message() {
        let key = || Key::new("orders:create", 1, &[&"r-1"]).unwrap();
        let store = |kind| Error::Store(StoreError::new(kind, "boom"));
        let cases = [
            (
                Error::InvalidKey(KeyError::EmptyPart { index: 0 }),
                Code::InvalidArgument,
            ),
            (Error::PayloadMismatch { key: key() }, Code::InvalidArgument),
            (
                Error::InProgress {
                    key: key(),
                    fence: 2,
                },
                Code::Aborted,
            ),
            (Error::Skipped { key: key() }, Code::Aborted),
            (
                Error::LostOwnership {
                    key: key(),
                    fence: 2,
                },
                Code::Aborted,
            ),
            (Error::Duplicate { key: key() }, Code::AlreadyExists),
            (Error::Held { key: key() }, Code::FailedPrecondition),
            (store(StoreErrorKind::Unavailable), Code::Unavailable),
            (store(StoreErrorKind::OutcomeUnknown), Code::Unavailable),
            (store(StoreErrorKind::Unsafe), Code::Unavailable),
            (store(StoreErrorKind::Corrupt), Code::Internal),
            (store(StoreErrorKind::Rejected), Code::Internal),
            (Error::NoStore, Code::Internal),
            (Error::NoRuntime, Code::Internal),
            (
                Error::InvalidDuration {
                    setting: "ttl",
                    value: std::time::Duration::ZERO,
                },
                Code::Internal,
            ),
        ];
        for (error, expected) in cases {
            let message = error.to_string();
            let status = Status::from(error);
            assert_eq!(status.code(), expected, "{message}");
            assert_eq!(status.message(), message);
        }
    }
}
