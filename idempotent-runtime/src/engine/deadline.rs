//! Bounds on the store calls of an owner's path: a call that never answers (a silent
//! connection, a stalled server) is abandoned after a time derived from the lease and treated
//! as a lost reply ([`OutcomeUnknown`](crate::StoreErrorKind::OutcomeUnknown)), which the
//! read-back and retry rules then resolve. The lease goes on being renewed meanwhile (the caller runs the call under the
//! watchdog), so the bound never lets the lease lapse by itself.

pub(crate) use crate::store::deadline::{bounded, call_bound};
