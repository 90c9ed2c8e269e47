//! What the `#[idempotent]` expansion calls. Not a public API: it may change in any release.

use std::marker::PhantomData;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

pub use crate::engine::HandlerResult;
use crate::engine::{Idempotency, Operation};
pub use crate::policy::{OnError, OnInProgress, OnStoreError};
use crate::store::{IntoStore, SharedStore};
use crate::{Key, KeyPart};

/// The attribute's constant settings.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// `prefix = "..."`.
    pub prefix: &'static str,
    /// `version = N`.
    pub version: u32,
    /// `ttl = N`, in seconds.
    pub ttl_secs: u64,
    /// `lease = N`, in seconds; 0 for the default.
    pub lease_secs: u64,
    /// `on_in_progress = ...`.
    pub in_progress: OnInProgress,
    /// `on_store_error = ...`.
    pub on_store_error: OnStoreError,
}

/// One call of an annotated handler.
pub fn operation<R: HandlerResult>(
    spec: Spec,
    store: Option<SharedStore>,
    parts: &[&dyn KeyPart],
) -> Operation<R> {
    let mut settings = Idempotency::new(Duration::from_secs(spec.ttl_secs))
        .on_in_progress(spec.in_progress)
        .on_store_error(spec.on_store_error);
    if spec.lease_secs > 0 {
        settings = settings.lease(Duration::from_secs(spec.lease_secs));
    }
    if let Some(store) = store {
        settings = settings.store(store);
    }
    Operation::new(settings, Key::new(spec.prefix, spec.version, parts))
}

/// A key part, type-checked where the user wrote it.
pub fn part<P: KeyPart>(part: &P) -> &dyn KeyPart {
    part
}

/// `store = <expr>`.
pub fn store<S: IntoStore + Clone>(store: &S) -> SharedStore {
    store.clone().into_store()
}

/// `on_error = hold`.
pub fn hold<E>(_: &E) -> OnError {
    OnError::Hold
}

/// `replay`'s choice of encoding, by the handler's `Ok` type: `(&replay_of(&op)).replay(op)`
/// finds [`ReplayGrpc`] for a `tonic::Response` of a prost message (feature `grpc`) and
/// [`ReplaySerde`] for anything else, whose bound then asks for serde.
pub struct ReplayOf<T>(PhantomData<fn() -> T>);

/// The [`ReplayOf`] of an operation's `Ok` type.
pub fn replay_of<R: HandlerResult, D>(_: &Operation<R, D>) -> ReplayOf<R::Ok> {
    ReplayOf(PhantomData)
}

/// `replay` of a gRPC reply: the message as prost encodes it, and its metadata.
pub trait ReplayGrpc {
    /// The replayed type.
    type Value;
    /// The operation, replaying its `Ok` value.
    fn replay<R: HandlerResult<Ok = Self::Value>, D>(&self, op: Operation<R, D>)
        -> Operation<R, D>;
}

#[cfg(feature = "grpc")]
impl<M: prost::Message + Default> ReplayGrpc for ReplayOf<tonic::Response<M>> {
    type Value = tonic::Response<M>;
    fn replay<R: HandlerResult<Ok = Self::Value>, D>(
        &self,
        op: Operation<R, D>,
    ) -> Operation<R, D> {
        op.replay_grpc()
    }
}

/// `replay` of any other value, through serde.
pub trait ReplaySerde {
    /// The operation, replaying its `Ok` value.
    fn replay<R: HandlerResult, D>(&self, op: Operation<R, D>) -> Operation<R, D>
    where
        R::Ok: Serialize + DeserializeOwned;
}

impl<T> ReplaySerde for &ReplayOf<T> {
    fn replay<R: HandlerResult, D>(&self, op: Operation<R, D>) -> Operation<R, D>
    where
        R::Ok: Serialize + DeserializeOwned,
    {
        op.replay()
    }
}
