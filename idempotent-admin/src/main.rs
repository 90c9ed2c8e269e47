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
//! idempotent-admin --store postgres://app@db/orders outbox dead
//! idempotent-admin --store postgres://app@db/orders outbox retry --id 01J9... --yes
//! idempotent-admin --store postgres://app@db/orders outbox inspect --id 01J9...
//! idempotent-admin --store postgres://app@db/orders outbox discard --id 01J9... --force --yes
//! ```
//!
//! A key is named by its parts, as the handler builds it (`--prefix`, `--version`, one
//! `--part` per key part, in order), or by its encoded text (`--key`). `release`, `unhold`,
//! `delete`, `purge` and the outbox's `retry` and `discard` ask for confirmation unless
//! `--yes` is given. Output is a readable table, or JSON with `--json`. Durations are written
//! `500ms`, `30s`, `10m`, `2h` or `7d`.
//!
//! Exit codes: 0 done (or the record was found, or the listing ran); 1 nothing changed (no
//! record, another fence, a record in another state, a record that changed meanwhile, a
//! refused confirmation); 2 bad input (arguments, a malformed key or prefix, an outbox
//! command on a store that is not SQL); 3 the store failed (unreachable, a record it cannot
//! read).

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use idempotency::admin::{Admin, AdminOutcome, Inspection, ListQuery, StateFilter};
use idempotency::store::ScanCursor;
use idempotency::{Key, RecordState, StoreError};
use serde_json::json;

mod outbox;

/// The operator's command line for idempotency stores.
#[derive(Debug, Parser)]
#[command(name = "idempotent-admin", version)]
struct Cli {
    /// The store's URL (`redis://`, `redis+cluster://`, `postgres://`, `mysql://`,
    /// `sqlite:`).
    #[arg(long, env = "IDEMPOTENT_STORE_URL", global = true)]
    store: Option<String>,
    /// JSON output, for scripts.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Shows a key's record: state, lease left, fence, held, result size, fingerprint.
    Inspect(KeyArgs),
    /// Frees a key whose owner is stuck: its in-progress record with this fence is released.
    Release {
        #[command(flatten)]
        key: KeyArgs,
        /// The fence of the stuck owner, as `inspect` shows it.
        #[arg(long)]
        fence: u64,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
    /// Lets a held key (`on_error = hold`) run again.
    Unhold {
        #[command(flatten)]
        key: KeyArgs,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
    /// Lists the records of a key prefix, a page at a time: key, state, age, lease left,
    /// expiry, fence.
    List {
        /// The key prefix, as in the handler's attribute.
        #[arg(long)]
        prefix: String,
        /// Only records in this state.
        #[arg(long, value_enum)]
        state: Option<StateArg>,
        /// In progress for at least `--older-than` (10m unless given): an owner that hangs,
        /// or one killed with a long lease.
        #[arg(long, conflicts_with = "state")]
        stuck: bool,
        /// Only records in their state for at least this long (Redis knows it for
        /// in-progress records only).
        #[arg(long, value_parser = parse_duration)]
        older_than: Option<Duration>,
        /// Stop after about this many records (whole pages), printing the cursor to go on.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Go on from a cursor a previous listing printed.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Deletes a key's record (or a value under it that is no record): the next delivery
    /// runs the handler again. A live claim is refused: `release` it first.
    Delete {
        #[command(flatten)]
        key: KeyArgs,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
    /// Deletes every record of a key prefix, except live claims.
    Purge {
        /// The key prefix.
        #[arg(long)]
        prefix: String,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
    /// The transactional outbox of an SQL database: counts, dead messages, inspect, retry, discard,
    /// purge of published ones.
    Outbox(outbox::OutboxArgs),
}

/// The states `list --state` selects.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum StateArg {
    InProgress,
    Completed,
    Held,
    Released,
    Corrupt,
}

impl StateArg {
    fn filter(self) -> StateFilter {
        match self {
            StateArg::InProgress => StateFilter::InProgress,
            StateArg::Completed => StateFilter::Completed,
            StateArg::Held => StateFilter::Held,
            StateArg::Released => StateFilter::Released,
            StateArg::Corrupt => StateFilter::Corrupt,
        }
    }
}

/// A duration written `500ms`, `30s`, `10m`, `2h` or `7d`.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("`{text}` has no unit (ms, s, m, h, d)"))?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` does not start with a number"))?;
    let millis = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1_000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => return Err(format!("`{unit}` is not a unit (ms, s, m, h, d)")),
    }
    .ok_or_else(|| format!("`{text}` is too long"))?;
    Ok(Duration::from_millis(millis))
}

#[derive(Debug, Args)]
struct KeyArgs {
    /// The key's encoded text (`<prefix>:v<version>:{<parts>}`).
    #[arg(long, conflicts_with_all = ["prefix", "part"])]
    key: Option<String>,
    /// The key's prefix, as in the handler's attribute.
    #[arg(long)]
    prefix: Option<String>,
    /// The key's version.
    #[arg(long, default_value_t = 1)]
    version: u32,
    /// One key part, in order (repeat for each).
    #[arg(long)]
    part: Vec<String>,
}

impl KeyArgs {
    fn key(&self) -> Result<Key, Failure> {
        let built = match (&self.key, &self.prefix) {
            (Some(text), _) => Key::parse(text),
            (None, Some(prefix)) => {
                let parts: Vec<&dyn idempotency::KeyPart> = self
                    .part
                    .iter()
                    .map(|p| p as &dyn idempotency::KeyPart)
                    .collect();
                Key::new(prefix, self.version, &parts)
            }
            (None, None) => {
                return Err(Failure::Input(
                    "name the key with --key, or with --prefix and --part".into(),
                ))
            }
        };
        built.map_err(|e| Failure::Input(format!("bad key: {e}")))
    }
}

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
    let cli = Cli::parse();
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
    match runtime.block_on(run(&cli)) {
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

/// What to do, checked before the store is reached: bad input changes nothing.
enum Plan {
    Inspect(Key),
    Release(Key, u64, bool),
    Unhold(Key, bool),
    Delete(Key, bool),
    List(ListQuery, usize),
    Purge(String, bool),
}

impl Plan {
    fn of(command: &Command) -> Result<Plan, Failure> {
        let bad_prefix = |e: idempotency::KeyError| Failure::Input(format!("bad prefix: {e}"));
        Ok(match command {
            Command::Inspect(key) => Plan::Inspect(key.key()?),
            Command::Release { key, fence, yes } => Plan::Release(key.key()?, *fence, *yes),
            Command::Unhold { key, yes } => Plan::Unhold(key.key()?, *yes),
            Command::Delete { key, yes } => Plan::Delete(key.key()?, *yes),
            Command::List {
                prefix,
                state,
                stuck,
                older_than,
                limit,
                cursor,
            } => {
                let mut query = ListQuery::new(prefix).map_err(bad_prefix)?;
                if let Some(state) = state {
                    query = query.state(state.filter());
                }
                if *stuck {
                    query = query.state(StateFilter::InProgress);
                }
                if let Some(age) = older_than.or(stuck.then_some(Duration::from_secs(600))) {
                    query = query.older_than(age);
                }
                if let Some(cursor) = cursor {
                    let Ok(cursor) = cursor.parse::<ScanCursor>();
                    query = query.cursor(cursor);
                }
                Plan::List(query, *limit)
            }
            Command::Purge { prefix, yes } => {
                ListQuery::new(prefix).map_err(bad_prefix)?;
                Plan::Purge(prefix.clone(), *yes)
            }
            Command::Outbox(_) => unreachable!("the outbox has its own command line"),
        })
    }
}

async fn run(cli: &Cli) -> Result<(), Failure> {
    let Some(url) = &cli.store else {
        return Err(Failure::Input(
            "no store: give --store <url> or set IDEMPOTENT_STORE_URL".into(),
        ));
    };
    if let Command::Outbox(args) = &cli.command {
        return outbox::run(url, args, cli.json).await;
    }
    let plan = Plan::of(&cli.command)?;
    let store = idempotency::connect(url)
        .await
        .map_err(|e| Failure::Store(format!("cannot use the store: {e}")))?;
    let admin = Admin::new(store);
    let store_error = |e: StoreError| Failure::Store(format!("{e}"));
    match plan {
        Plan::Inspect(key) => {
            let Some(seen) = admin.inspect(&key).await.map_err(store_error)? else {
                if cli.json {
                    println!("{}", json!({ "key": key.to_string(), "record": null }));
                }
                return Err(Failure::Unchanged(format!("`{key}` has no record")));
            };
            print_inspection(&key, &seen, cli.json);
            Ok(())
        }
        Plan::Release(key, fence, yes) => {
            confirm(
                yes,
                &format!("Release `{key}` from its owner with fence {fence}?"),
            )?;
            let outcome = admin
                .force_release(&key, fence)
                .await
                .map_err(store_error)?;
            report("release", &key, outcome, cli.json)
        }
        Plan::Unhold(key, yes) => {
            confirm(yes, &format!("Let held `{key}` run again?"))?;
            let outcome = admin.unhold(&key).await.map_err(store_error)?;
            report("unhold", &key, outcome, cli.json)
        }
        Plan::Delete(key, yes) => {
            confirm(
                yes,
                &format!("Delete the record of `{key}`, so that its next delivery runs again?"),
            )?;
            let outcome = admin.delete(&key).await.map_err(store_error)?;
            report("delete", &key, outcome, cli.json)
        }
        Plan::List(query, limit) => list(&admin, query, limit, cli.json).await,
        Plan::Purge(prefix, yes) => {
            confirm(
                yes,
                &format!("Delete every record of `{prefix}` (live claims are kept)?"),
            )?;
            let report = admin.purge(&prefix).await.map_err(store_error)?;
            if cli.json {
                println!(
                    "{}",
                    json!({
                        "prefix": prefix,
                        "action": "purge",
                        "deleted": report.deleted,
                        "corrupt_deleted": report.corrupt_deleted,
                        "live_claims_kept": report.live_claims_kept,
                        "changed": report.changed,
                    })
                );
            } else {
                println!(
                    "purge: deleted {} records and {} values that were no record under `{prefix}`; kept {} live claims; {} changed meanwhile",
                    report.deleted, report.corrupt_deleted, report.live_claims_kept, report.changed
                );
            }
            Ok(())
        }
    }
}

/// Pages through `query` until about `limit` records are printed or the listing is over.
async fn list(
    admin: &Admin,
    mut query: ListQuery,
    limit: usize,
    as_json: bool,
) -> Result<(), Failure> {
    let mut rows = Vec::new();
    let next = loop {
        let page = admin
            .list(&query)
            .await
            .map_err(|e| Failure::Store(format!("{e}")))?;
        rows.extend(page.records);
        match page.next {
            Some(next) if rows.len() >= limit => break Some(next),
            Some(next) => query = query.cursor(next),
            None => break None,
        }
    };
    if as_json {
        let records: Vec<_> = rows
            .iter()
            .map(|(key, seen)| match seen {
                Ok(seen) => inspection_json(key, seen),
                Err(err) => json!({ "key": key.to_string(), "corrupt": err.to_string() }),
            })
            .collect();
        println!(
            "{}",
            json!({ "records": records, "next_cursor": next.as_ref().map(ScanCursor::to_string) })
        );
        return Ok(());
    }
    if rows.is_empty() {
        eprintln!("no records");
    } else {
        println!(
            "{:<12} {:>10} {:>10} {:>10} {:>18}  KEY",
            "STATE", "AGE", "LEASE", "EXPIRES", "FENCE"
        );
    }
    for (key, seen) in &rows {
        match seen {
            Ok(seen) => {
                let state = if seen.held {
                    "held"
                } else {
                    state_name(&seen.state)
                };
                let lease = match seen.state {
                    RecordState::InProgress { lease_left } => seconds(Some(lease_left)),
                    _ => "-".into(),
                };
                println!(
                    "{state:<12} {:>10} {lease:>10} {:>10} {:>18}  {key}",
                    seconds(seen.age),
                    seconds(seen.expires_in),
                    seen.fence
                );
            }
            Err(_) => println!(
                "{:<12} {:>10} {:>10} {:>10} {:>18}  {key}",
                "corrupt", "-", "-", "-", "-"
            ),
        }
    }
    if let Some(next) = next {
        eprintln!("more records: go on with --cursor {next}");
    }
    Ok(())
}

fn seconds(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".into(), |d| format!("{:.1} s", d.as_secs_f64()))
}

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

fn state_name(state: &RecordState) -> &'static str {
    match state {
        RecordState::InProgress { .. } => "in_progress",
        RecordState::Completed => "completed",
        RecordState::Released => "released",
        _ => "unknown",
    }
}

fn inspection_json(key: &Key, seen: &Inspection) -> serde_json::Value {
    let lease_left = match seen.state {
        RecordState::InProgress { lease_left } => Some(lease_left.as_secs_f64()),
        _ => None,
    };
    json!({
        "key": key.to_string(),
        "record": {
            "state": state_name(&seen.state),
            "lease_left_seconds": lease_left,
            "age_seconds": seen.age.map(|d| d.as_secs_f64()),
            "expires_in_seconds": seen.expires_in.map(|d| d.as_secs_f64()),
            "fence": seen.fence,
            "held": seen.held,
            "result_bytes": seen.result_size,
            "fingerprint": seen.fingerprint,
        }
    })
}

fn print_inspection(key: &Key, seen: &Inspection, as_json: bool) {
    if as_json {
        println!("{}", inspection_json(key, seen));
        return;
    }
    let lease = match seen.state {
        RecordState::InProgress { lease_left } => seconds(Some(lease_left)),
        _ => "-".into(),
    };
    let result = seen
        .result_size
        .map_or_else(|| "-".to_string(), |n| format!("{n} bytes"));
    println!("key          {key}");
    println!("state        {}", state_name(&seen.state));
    println!("lease left   {lease}");
    println!("age          {}", seconds(seen.age));
    println!("expires in   {}", seconds(seen.expires_in));
    println!("fence        {}", seen.fence);
    println!("held         {}", if seen.held { "yes" } else { "no" });
    println!("result       {result}");
    println!(
        "fingerprint  {}",
        if seen.fingerprint { "yes" } else { "no" }
    );
}

fn report(action: &str, key: &Key, outcome: AdminOutcome, as_json: bool) -> Result<(), Failure> {
    if as_json {
        let fence = match outcome {
            AdminOutcome::Done { fence } | AdminOutcome::FenceMismatch { fence } => Some(fence),
            _ => None,
        };
        println!(
            "{}",
            json!({ "key": key.to_string(), "action": action, "outcome": outcome.as_str(), "fence": fence })
        );
    }
    match outcome {
        AdminOutcome::Done { fence } => {
            if !as_json && action == "delete" {
                println!("{action}: done; the record of `{key}` (fence {fence}) is deleted; the next delivery runs the handler again");
            } else if !as_json {
                println!("{action}: done; `{key}` is released (fence {fence}); the next claim takes it with a higher fence");
            }
            Ok(())
        }
        AdminOutcome::DeletedCorrupt => {
            if !as_json {
                println!("{action}: done; the value under `{key}` was no record and is deleted");
            }
            Ok(())
        }
        AdminOutcome::Missing => Err(Failure::Unchanged(format!("`{key}` has no record"))),
        AdminOutcome::FenceMismatch { fence } => Err(Failure::Unchanged(format!(
            "the record's fence is {fence}: another owner holds `{key}` now"
        ))),
        AdminOutcome::WrongState { state } => Err(Failure::Unchanged(match state {
            RecordState::InProgress { .. } if action == "delete" => {
                format!("`{key}` is claimed by an owner whose lease is live; release it first")
            }
            _ => format!("`{key}` is {}", state_name(&state)),
        })),
        AdminOutcome::Changed => Err(Failure::Unchanged(format!(
            "`{key}` changed meanwhile; inspect it again"
        ))),
        _ => Err(Failure::Unchanged(outcome.as_str().to_string())),
    }
}
