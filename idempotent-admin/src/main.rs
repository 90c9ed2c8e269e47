//! `idempotent-admin`: the operator's command line for the stores of the `idempotency`
//! crate, on top of its `admin::Admin` API.
//!
//! ```text
//! idempotent-admin --store redis://127.0.0.1:6379 inspect --prefix payment:capture --part pay-42
//! idempotent-admin --store redis://127.0.0.1:6379 release --prefix payment:capture --part pay-42 --fence 1796122444904000
//! IDEMPOTENT_STORE_URL=postgres://app@db/orders idempotent-admin unhold --key 'payment:capture:v1:{6:pay-42}' --yes
//! ```
//!
//! A key is named by its parts, as the handler builds it (`--prefix`, `--version`, one
//! `--part` per key part, in order), or by its encoded text (`--key`). `release` and `unhold`
//! ask for confirmation unless `--yes` is given. Output is a readable table, or JSON with
//! `--json`.
//!
//! Exit codes: 0 done (or the record was found); 1 nothing changed (no record, another fence,
//! a record in another state, a record that changed meanwhile, a refused confirmation); 2 bad
//! input (arguments, a malformed key); 3 the store failed (unreachable, a record it cannot
//! read).

use std::io::{BufRead, Write};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use idempotency::admin::{Admin, AdminOutcome, Inspection};
use idempotency::{Key, RecordState};
use serde_json::json;

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
enum Failure {
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

async fn run(cli: &Cli) -> Result<(), Failure> {
    let Some(url) = &cli.store else {
        return Err(Failure::Input(
            "no store: give --store <url> or set IDEMPOTENT_STORE_URL".into(),
        ));
    };
    let key = match &cli.command {
        Command::Inspect(key) | Command::Release { key, .. } | Command::Unhold { key, .. } => {
            key.key()?
        }
    };
    let store = idempotency::connect(url)
        .await
        .map_err(|e| Failure::Store(format!("cannot use the store: {e}")))?;
    let admin = Admin::new(store);
    let store_error = |e: idempotency::StoreError| Failure::Store(format!("{e}"));
    match &cli.command {
        Command::Inspect(_) => {
            let Some(seen) = admin.inspect(&key).await.map_err(store_error)? else {
                if cli.json {
                    println!("{}", json!({ "key": key.to_string(), "record": null }));
                }
                return Err(Failure::Unchanged(format!("`{key}` has no record")));
            };
            print_inspection(&key, &seen, cli.json);
            Ok(())
        }
        Command::Release { fence, yes, .. } => {
            confirm(
                *yes,
                &format!("Release `{key}` from its owner with fence {fence}?"),
            )?;
            let outcome = admin
                .force_release(&key, *fence)
                .await
                .map_err(store_error)?;
            report("release", &key, outcome, cli.json)
        }
        Command::Unhold { yes, .. } => {
            confirm(*yes, &format!("Let held `{key}` run again?"))?;
            let outcome = admin.unhold(&key).await.map_err(store_error)?;
            report("unhold", &key, outcome, cli.json)
        }
    }
}

/// Asks on the terminal unless `yes`; anything but `y` or `yes` refuses.
fn confirm(yes: bool, question: &str) -> Result<(), Failure> {
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

fn print_inspection(key: &Key, seen: &Inspection, as_json: bool) {
    let lease_left = match seen.state {
        RecordState::InProgress { lease_left } => Some(lease_left.as_secs_f64()),
        _ => None,
    };
    if as_json {
        println!(
            "{}",
            json!({
                "key": key.to_string(),
                "record": {
                    "state": state_name(&seen.state),
                    "lease_left_seconds": lease_left,
                    "fence": seen.fence,
                    "held": seen.held,
                    "result_bytes": seen.result_size,
                    "fingerprint": seen.fingerprint,
                }
            })
        );
        return;
    }
    let lease = lease_left.map_or_else(|| "-".to_string(), |s| format!("{s:.1} s"));
    let result = seen
        .result_size
        .map_or_else(|| "-".to_string(), |n| format!("{n} bytes"));
    println!("key          {key}");
    println!("state        {}", state_name(&seen.state));
    println!("lease left   {lease}");
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
            if !as_json {
                println!("{action}: done; `{key}` is released (fence {fence}); the next claim takes it with a higher fence");
            }
            Ok(())
        }
        AdminOutcome::Missing => Err(Failure::Unchanged(format!("`{key}` has no record"))),
        AdminOutcome::FenceMismatch { fence } => Err(Failure::Unchanged(format!(
            "the record's fence is {fence}: another owner holds `{key}` now"
        ))),
        AdminOutcome::WrongState { state } => Err(Failure::Unchanged(format!(
            "`{key}` is {}",
            state_name(&state)
        ))),
        AdminOutcome::Changed => Err(Failure::Unchanged(format!(
            "`{key}` changed meanwhile; inspect it again"
        ))),
        _ => Err(Failure::Unchanged(outcome.as_str().to_string())),
    }
}
