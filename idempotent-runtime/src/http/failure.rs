//! How a guarded request's run ended, besides a stored response.

use http::Response;

use crate::error::Error;
use crate::http::body::Body;

/// How a run ended, besides a stored response.
pub(crate) enum Failure<E> {
    /// The engine answered (duplicate, in flight, store down...).
    Engine(Error),
    /// The handler's response releases the key: sent as it is, not stored.
    Released(Response<Body>),
    /// The inner service failed.
    Service(E),
    /// The handler panicked (with this message): the key is released.
    Panicked(String),
}

impl<E> From<Error> for Failure<E> {
    fn from(err: Error) -> Self {
        Failure::Engine(err)
    }
}
