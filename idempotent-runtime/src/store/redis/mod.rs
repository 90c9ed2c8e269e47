//! The Redis backend: standalone Redis or Redis Cluster, through redis-rs.
//!
//! A key without a record is claimed with one native command on a standalone Redis 7.0 or
//! later, `SET key <in-progress record> NX PX <lifetime> GET`, whose reply also decides most
//! duplicates ([`RedisStoreBuilder::fast_claims`] says when it applies and how its fence and
//! lease end are taken from the server's clock). Everything else is a server-side script:
//! `record.lua` for claims that need the server's clock to decide, renewals and the
//! operator's deletes, `ending.lua` for completion and release, `read.lua` for reads on a
//! cluster (the value, the server's time and the key's expiry, checked by the client; on one
//! server the same three are one pipeline of `GET`, `PTTL` and `TIME`); each is loaded once
//! and called by SHA-1 (`EVALSHA`); after a `SCRIPT FLUSH` or a server restart the `NOSCRIPT`
//! reply makes the client load them again and retry, transparently. Leases and expiry use the server's clock
//! (`TIME`, `PX`), never the client's wall clock. A completion that names its claim
//! ([`Completion::claim`](crate::Completion::claim), as the engine's do) lets `ending.lua`
//! skip parsing: with the claim's lease, the owner writes again the record its fast claim
//! wrote (claimed at the fence's millisecond, so the fence and the lease give every byte of
//! it) and the completed record, and the script is a compare-and-set, as a hand-written
//! completion is; a record renewed since is recognised by its head (state, token,
//! fingerprint, fence) and completed without parsing; any other record goes through the full
//! checks, so the answer is the token's either way. A batch
//! ([`Store::claim_many`](crate::Store::claim_many)) is one pipeline of the same fast claims,
//! and a second pipeline of scripts for the items they leave undecided.
//!
//! A record is one Redis string holding state, token, fingerprint, fence, lease end and
//! result, so one key per record and one Redis Cluster slot (the key's `{...}` hash tag
//! keeps the slot stable across versions that might add keys).
//!
//! # Connections
//!
//! A standalone server is reached through one auto-reconnecting multiplexed connection
//! ([`ConnectionManager`]) shared by every handler; a cluster through redis-rs's async
//! cluster client, which follows `MOVED` and `ASK` redirections. Both have a response and a
//! connection timeout ([`RedisStore::builder`]).
//!
//! # Safety checks
//!
//! At connection, the store reads `INFO` (and `CONFIG GET`, where allowed) and
//!
//! - refuses (or, by option, warns about) an eviction policy other than `noeviction`: an
//!   `allkeys-*` policy drops completed records, and `volatile-*` policies are as unsafe here
//!   since every record has a TTL (`volatile-ttl` evicts the in-flight claims first);
//! - refuses a replica (writes would fail or be lost);
//! - warns when neither RDB snapshots nor AOF are enabled (a restart forgets every record);
//! - remembers the server's `run_id`; when a later reconnection finds another one, it logs
//!   "dedup history may be lost" and counts it ([`RedisStore::history_resets`]).
//!
//! A managed Redis that hides `INFO` or `CONFIG` gives "cannot verify" warnings instead.
//!
//! # What Redis can and cannot promise
//!
//! Redis acknowledges a write before it is durable: a restart without persistence, a
//! failover to a replica that had not received the write, or an eviction loses records. A
//! lost record makes the next duplicate run again. Keep effects exactly-once with a check at
//! the effect: the `done` fallback (asked whenever a claim is acquired), a status
//! compare-and-set, or the fence. [`RedisStoreBuilder::wait_for_replicas`] makes claims,
//! renewals and completions count only once replicas have them (a `WAIT` pipelined with each
//! write); what a write that is not replicated in time means on each path is said on that
//! method.
//!
//! # Sentinel
//!
//! A `redis+sentinel://` URL ([`RedisStore::sentinel`]) reaches the primary the sentinels
//! name and follows it across failovers: `READONLY` (a demoted primary), a refused, dropped
//! or silent connection make the store ask the sentinels again and move to the node they now
//! name; a command refused with `READONLY` or a refused connection (not applied) is sent once
//! more there, one whose connection failed under it (maybe applied) is resolved as every
//! unknown outcome is. The safety checks run on the primary, with a warning when it takes
//! writes no replica has (`min-replicas-to-write 0`).
//!
//! An `OOM` reply (memory full under `noeviction`) is a store error: the call fails closed.
//!
//! # Records it cannot read
//!
//! A value under a record's key that the script cannot parse (written by something else, cut
//! short, an unknown state letter, a non-numeric fence) or a key of another Redis type is
//! [`StoreErrorKind::Corrupt`] for every operation, and is left as it is: never taken for a
//! free key, never overwritten.
//!
//! # Fences, durations, result sizes
//!
//! A key without a record is acquired with the server's clock in microseconds (`TIME`) as
//! its fence, a key with one with its fence + 1
//! ([`next_fence`](crate::store::next_fence)). Durations are sent as
//! [`clamped_millis`]. A stored result is at most
//! [`max_result_size`](RedisStoreBuilder::max_result_size) bytes, and never more than the
//! server's `proto-max-bulk-len` allows.

#[cfg(doc)]
use ::redis::aio::ConnectionManager;

#[cfg(doc)]
use crate::error::StoreErrorKind;
#[cfg(doc)]
use crate::store::clamped_millis;

mod batch;
mod builder;
mod claim;
mod clock;
mod conn;
mod durable;
mod ending;
mod scan;
mod sentinel;
mod sentinel_url;
mod store;
mod succession;
mod wire;

pub use builder::{Health, RedisStoreBuilder, UnsafeConfig};
pub use store::RedisStore;
