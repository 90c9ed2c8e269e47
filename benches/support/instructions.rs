//! Instructions per cycle of one side of a bench, counted by valgrind's callgrind: a figure
//! that does not move with the machine's load (the same binary and input execute the same
//! instructions whatever else runs beside them).
//!
//! The bench runs itself twice under callgrind for one side alone (`IDEMPOTENT_BENCH_ONLY`
//! names the side, `IDEMPOTENT_BENCH_OPS` the cycles): with `n` and with `2n` cycles. The
//! difference of the two totals, over `n`, is the work of one cycle without the start-up,
//! connections and warm-up both runs share. It counts every thread of the process: for a
//! bench whose servers run in the process (HTTP, gRPC), client and server together.
//!
//! `IDEMPOTENT_BENCH_INSTRUCTIONS=0` skips the count; without `valgrind` on the `PATH` the
//! figures are left out with a note. Included with
//! `#[path = "support/instructions.rs"] mod instructions;`.

// Each bench uses only some of these.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The side a run of the bench is restricted to (`IDEMPOTENT_BENCH_ONLY`), and its cycles
/// (`IDEMPOTENT_BENCH_OPS`, `default` when unset).
pub(crate) fn only(default: usize) -> Result<Option<(String, usize)>, BoxError> {
    let Ok(side) = std::env::var("IDEMPOTENT_BENCH_ONLY") else {
        return Ok(None);
    };
    let ops = match std::env::var("IDEMPOTENT_BENCH_OPS") {
        Ok(ops) => ops.parse()?,
        Err(_) => default,
    };
    Ok(Some((side, ops)))
}

/// The error of its estimate of the server's clock that a Redis store accepts in a counted run
/// ([`RedisStoreBuilder::fast_claim_max_error`]). Callgrind runs this process many times
/// slower, the `TIME` round trip with it, and at the default bound (1 ms) the store's claims
/// would go through the script, a path a client at full speed does not take. The leases of
/// the benches (30 s and more) are over a thousand times this bound, as the fast claim needs.
///
/// [`RedisStoreBuilder::fast_claim_max_error`]: idempotency::redis::RedisStoreBuilder::fast_claim_max_error
pub(crate) const COUNTED_CLOCK_ERROR: std::time::Duration = std::time::Duration::from_millis(30);

/// Whether the instruction counts are wanted and can be taken.
pub(crate) fn enabled() -> bool {
    if std::env::var("IDEMPOTENT_BENCH_INSTRUCTIONS").is_ok_and(|v| v == "0") {
        return false;
    }
    let found = Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success());
    if !found {
        println!("(valgrind not found: instruction counts left out; apt install valgrind)");
    }
    found
}

/// Instructions per cycle of `side`: this bench run twice under callgrind with `ops` and
/// `2 * ops` cycles of that side alone.
pub(crate) fn per_cycle(side: &str, ops: usize) -> Result<f64, BoxError> {
    per_cycle_probed(side, ops, &mut || Ok(0)).map(|(count, _)| count)
}

/// [`per_cycle`], and how much `probe` (a server's counter, read before and after each run)
/// grew per cycle, the same way: what the cycles of the counted runs asked of the server.
pub(crate) fn per_cycle_probed(
    side: &str,
    ops: usize,
    probe: &mut dyn FnMut() -> Result<u64, BoxError>,
) -> Result<(f64, f64), BoxError> {
    per_cycle_expected(side, ops, probe, None)
}

/// What a run of a side is expected to ask of the server: at most `per_cycle` of the probed
/// calls for each of its cycles and of its `warm_cycles` warm-up cycles.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expected {
    pub(crate) warm_cycles: usize,
    pub(crate) per_cycle: f64,
}

/// How many times a run that asked more of the server than expected is taken again.
const ATTEMPTS: usize = 3;

/// [`per_cycle_probed`], with each run taken again (up to [`ATTEMPTS`] times, keeping the
/// run that asked least) while its probe grew by more than `expected` allows: a run on which
/// the code took a slower path than the one to count (the Redis store's fast claim falls back
/// to its script while its estimate of the server's clock is not precise enough, and under
/// callgrind the clock's readings are slow) is not the figure wanted.
pub(crate) fn per_cycle_expected(
    side: &str,
    ops: usize,
    probe: &mut dyn FnMut() -> Result<u64, BoxError>,
    expected: Option<Expected>,
) -> Result<(f64, f64), BoxError> {
    let mut totals = [0u64; 2];
    let mut probed = [0u64; 2];
    for ((total, grew), cycles) in totals.iter_mut().zip(&mut probed).zip([ops, 2 * ops]) {
        let most = expected.map(|e| (e.per_cycle * (cycles + e.warm_cycles) as f64) as u64);
        let mut best: Option<(u64, u64)> = None;
        for _ in 0..ATTEMPTS {
            let run = count_run(side, cycles, probe)?;
            if best.is_none_or(|(_, least)| run.1 < least) {
                best = Some(run);
            }
            if most.is_none_or(|most| run.1 <= most) {
                break;
            }
        }
        if let Some((counted, asked)) = best {
            (*total, *grew) = (counted, asked);
        }
    }
    // A run of twice the cycles that executed no more is a broken count (work that differs
    // between the two runs, such as a cleanup of shared state): say so, not a figure.
    if totals[1] <= totals[0] {
        return Err(format!(
            "the {side} side counted {} instructions for {} cycles and {} for {ops}",
            totals[1],
            2 * ops,
            totals[0]
        )
        .into());
    }
    let grew = probed[1].saturating_sub(probed[0]) as f64 / ops as f64;
    Ok(((totals[1] - totals[0]) as f64 / ops as f64, grew))
}

/// One run of `side` with `cycles` cycles under callgrind: its instruction total, and how
/// much `probe` grew over it.
fn count_run(
    side: &str,
    cycles: usize,
    probe: &mut dyn FnMut() -> Result<u64, BoxError>,
) -> Result<(u64, u64), BoxError> {
    let exe = std::env::current_exe()?;
    let before = probe()?;
    let out = std::env::temp_dir().join(format!(
        "idempotent-bench-{}-{side}-{cycles}.callgrind",
        std::process::id()
    ));
    let status = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(&exe)
        .arg("--bench")
        .env("IDEMPOTENT_BENCH_ONLY", side)
        .env("IDEMPOTENT_BENCH_OPS", cycles.to_string())
        .env("IDEMPOTENT_BENCH_INSTRUCTIONS", "0")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()?;
    let read = total_of(&out);
    let _ = std::fs::remove_file(&out);
    if !status.success() {
        return Err(format!("the {side} side failed under callgrind ({status})").into());
    }
    Ok((read?, probe()?.saturating_sub(before)))
}

/// The instruction total of a callgrind output file (its `summary:` or `totals:` line).
fn total_of(path: &Path) -> Result<u64, BoxError> {
    let text = std::fs::read_to_string(path)?;
    text.lines()
        .find_map(|line| {
            line.strip_prefix("summary:")
                .or_else(|| line.strip_prefix("totals:"))
        })
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("no instruction total in {}", path.display()).into())
}
