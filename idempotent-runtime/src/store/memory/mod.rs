//! The embedded in-memory store: no server, correct under multi-threaded contention.
//!
//! Records live in a sharded map; each shard is a mutex held only for the few instructions
//! of one primitive (never across an `.await`), so claims of different keys rarely contend.
//! Expired records are dropped lazily when touched, and a shard is swept whenever it has
//! doubled since its last sweep (or has seen as many claims as it holds records): whatever
//! the mix of new keys and duplicates, a shard holds at most twice the records live at its
//! last sweep (or 1,024), for a constant cost per claim. Time is the store's own monotonic
//! [`Clock`] (fences also read its wall time, [`Clock::unix_micros`]); a [`ManualClock`]
//! makes lease and expiry tests instant and exact.
//!
//! Durations are taken in whole milliseconds within
//! [`MIN_DURATION`](crate::store::MIN_DURATION) ..= [`MAX_DURATION`](crate::store::MAX_DURATION),
//! as on every backend.
//!
//! It is the right store for demos, tests of code that uses the framework, and single-process
//! services whose dedup window need not survive a restart. Records are lost when the process
//! exits.

mod clock;
mod operator;
mod shard;
mod store;

pub use clock::{Clock, ManualClock, SystemClock};
pub use store::{MemoryStore, MemoryStoreBuilder};
