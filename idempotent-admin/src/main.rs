//! `idempotent-admin`: the operator's command line for the stores of the `idempotency`
//! crate, on top of its `admin::Admin` API.
//!
//! ```text
//! idempotent-admin --store redis://127.0.0.1:6379 inspect --prefix payment:capture --part pay-42
//! idempotent-admin --store redis://127.0.0.1:6379 list --prefix payment:capture --stuck --older-than 10m
//! idempotent-admin --store redis://127.0.0.1:6379 release --prefix payment:capture --part pay-42 --fence 1796122444904000
//! IDEMPOTENT_STORE_URL=postgres://app@db/orders idempotent-admin unhold --key 'payment:capture:v1:{6:pay-42}' --yes
//! idempotent-admin --store postgres://app@db/orders delete --prefix coupon:issue --part u-7 --yes
//! idempotent-admin --store postgres://app@db/orders purge --prefix checkout:v0-retired --yes
//! idempotent-admin --store mysql://app@db/shop --table shop_idempotency list --prefix order:pay --state held
//! idempotent-admin --store postgres://app@db/orders migrate
//! idempotent-admin --store postgres://app@db/orders outbox dead
//! idempotent-admin --store postgres://app@db/orders outbox retry --id 01J9... --yes
//! idempotent-admin --store postgres://app@db/orders outbox inspect --id 01J9...
//! idempotent-admin --store postgres://app@db/orders outbox discard --id 01J9... --force --yes
//! ```
//!
//! A key is named by its parts, as the handler builds it (`--prefix`, `--version`, one
//! `--part` per key part, in order), or by its text as `list` and `inspect` print it
//! (`--key`): bytes outside printable ASCII (a part that is not UTF-8, a character outside
//! ASCII) are printed `\xNN`, a backslash `\\`, quotes `\'` and `\"`, tab, carriage return
//! and newline `\t`, `\r`, `\n`, and `--key` reads that form back. `release`, `unhold`,
//! `delete`, `purge` and the outbox's `retry` and `discard` ask for confirmation unless
//! `--yes` is given. Output is a readable table, or JSON with `--json`. Durations are written
//! `500ms`, `30s`, `10m`, `2h` or `7d`. Every call to the store (opening it included) fails
//! after `--timeout` without an answer (30 s unless given), with exit 3 and a message that
//! a change the call carried may have been applied: a silent connection never hangs the
//! command.
//!
//! On an SQL store `--table` (before the command) names the records table, as the
//! application's store builder does (`idempotent_records` by default). The record commands
//! never change the schema: on a database without the table they say so, and `migrate`
//! creates it (as the application's store does when it opens).
//!
//! Exit codes: 0 done (or the record was found, or the listing ran); 1 nothing changed (no
//! record, another fence, a record in another state, a record that changed meanwhile, a
//! refused confirmation); 2 bad input (arguments, a malformed key or prefix, a store URL of
//! no known scheme or that does not parse, an invalid table name, `--table` on a store that
//! is not SQL, a cursor of another store, an outbox command on a store that is not SQL); 3
//! the store failed (unreachable, refused the credentials, no such database, no records
//! table, a record it cannot read, no answer within `--timeout`). Errors print their causes.

use std::future::Future;
use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

mod args;
mod commands;
mod connect;
mod outbox;
mod show;

pub(crate) use args::parse_duration;

/// Why the command did not do what was asked.
pub(crate) enum Failure {
    /// Nothing changed (exit 1).
    Unchanged(String),
    /// Bad input (exit 2).
    Input(String),
    /// The store failed (exit 3).
    Store(String),
}

fn main() -> ExitCode {
    let cli = args::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the runtime: {err}");
            return ExitCode::from(3);
        }
    };
    match runtime.block_on(commands::run(&cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Unchanged(why)) => {
            eprintln!("nothing changed: {why}");
            ExitCode::from(1)
        }
        Err(Failure::Input(why)) => {
            eprintln!("error: {why}");
            ExitCode::from(2)
        }
        Err(Failure::Store(why)) => {
            eprintln!("error: {why}");
            ExitCode::from(3)
        }
    }
}

/// `call`, failed with exit 3 when the store has not answered within `timeout` (`--timeout`):
/// the message names the call (`what`) and says a change it carried may have been applied.
pub(crate) async fn within<T>(
    timeout: Duration,
    what: &str,
    call: impl Future<Output = Result<T, Failure>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(timeout, call).await {
        Ok(answer) => answer,
        Err(_) => Err(Failure::Store(format!(
            "{what}: no answer from the store within {timeout:?}; {MAY_HAVE_BEEN_APPLIED}"
        ))),
    }
}

/// What an unanswered call may have done, for its message.
pub(crate) const MAY_HAVE_BEEN_APPLIED: &str =
    "a change it carried may have been applied (look before trying again)";

/// Asks on the terminal unless `yes`; anything but `y` or `yes` refuses.
pub(crate) fn confirm(yes: bool, question: &str) -> Result<(), Failure> {
    if yes {
        return Ok(());
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    let read = std::io::stdin().lock().read_line(&mut answer);
    match (read, answer.trim()) {
        (Ok(_), "y" | "yes" | "Y" | "YES") => Ok(()),
        _ => Err(Failure::Unchanged("not confirmed (use --yes)".into())),
    }
}
