//! Allocations per cycle: the bench's global allocator is `stats_alloc`'s counting wrapper
//! around the system allocator (the workspace forbids the `unsafe_code` a hand-written
//! `GlobalAlloc` needs). It counts every allocation of the process (client and, for the HTTP
//! and gRPC benches, server), so a pass's count over its cycles is the heap traffic of one
//! cycle. Included with `#[path = "support/allocations.rs"] mod allocations;`, which installs
//! the counter.

use std::alloc::System;

use stats_alloc::StatsAlloc;

/// Counts every allocation of the process, on top of the system allocator.
#[global_allocator]
static ALLOCATOR: StatsAlloc<System> = StatsAlloc::system();

/// Allocations (reallocations included) since the process started.
pub(crate) fn so_far() -> u64 {
    let stats = ALLOCATOR.stats();
    (stats.allocations + stats.reallocations) as u64
}
