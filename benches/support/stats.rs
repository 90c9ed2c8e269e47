//! The statistics the benchmarks share: medians, percentiles, rates and the `name=value`
//! figure lines they end with. Each bench includes this file with
//! `#[path = "support/stats.rs"] mod stats;`.

// Each bench uses only some of these.
#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

/// The median of `values`: the middle one once sorted (the upper middle for an even count).
/// NaN sorts last, so a pass that measured nothing does not shift the median down.
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// The `p` quantile (0.0 to 1.0) of `sorted`, already in ascending order: the nearest-rank
/// value, never below the first.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    let at = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[at]
}

/// How many per second `count` events over `elapsed` make.
pub(crate) fn per_s(count: usize, elapsed: Duration) -> f64 {
    count as f64 / elapsed.as_secs_f64()
}

/// Prints one figure line, `name=value`, with `decimals` digits after the point.
pub(crate) fn figure(name: &str, value: f64, decimals: usize) {
    println!("{name}={value:.decimals$}");
}

/// CPU seconds the live threads of the process at `proc_dir` (`/proc/self`, `/proc/<pid>`)
/// have used, from its `task/*/schedstat` (Linux); `None` where they cannot be read.
pub(crate) fn process_cpu(proc_dir: &Path) -> Option<f64> {
    let mut nanos = 0u64;
    for task in std::fs::read_dir(proc_dir.join("task")).ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        nanos += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(nanos as f64 / 1e9)
}

/// CPU seconds so far of every process whose name (`/proc/<pid>/comm`) is one of `names`: a
/// database server's, its connections' processes included (PostgreSQL: `postgres`;
/// MariaDB: `mariadbd` or `mysqld`). 0 where `/proc` shows none.
pub(crate) fn processes_cpu(names: &[&str]) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            std::fs::read_to_string(path.join("comm"))
                .is_ok_and(|comm| names.contains(&comm.trim()))
        })
        .filter_map(|path| process_cpu(&path))
        .sum()
}
