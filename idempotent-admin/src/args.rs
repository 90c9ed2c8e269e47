//! The command line's arguments: the store, the commands, how a key is named, durations.

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use idempotency::admin::StateFilter;
use idempotency::Key;

use crate::{outbox, Failure};

/// The operator's command line for idempotency stores.
#[derive(Debug, Parser)]
#[command(name = "idempotent-admin", version)]
pub(crate) struct Cli {
    /// The store's URL (`redis://`, `redis+cluster://`, `postgres://`, `mysql://`,
    /// `sqlite:`).
    #[arg(long, env = "IDEMPOTENT_STORE_URL", global = true)]
    pub(crate) store: Option<String>,
    /// The records table of an SQL store (default `idempotent_records`), as the
    /// application's store builder names it with `.table(...)`; given before the command.
    #[arg(long)]
    pub(crate) table: Option<String>,
    /// JSON output, for scripts.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    /// How long one call to the store may go unanswered (`500ms`, `30s`, `2m`): past it the
    /// command fails with exit 3, and a change the call carried may have been applied
    /// (inspect before trying again).
    #[arg(long, global = true, default_value = "30s", value_parser = parse_timeout)]
    pub(crate) timeout: Duration,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
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
    /// Creates the records table of an SQL store and its migrations table if they are
    /// missing, and applies the migrations not applied yet (what the application's store
    /// does when it opens). The only command that changes the schema.
    Migrate,
    /// The transactional outbox of an SQL database: counts, dead messages, inspect, retry, discard,
    /// purge of published ones.
    Outbox(outbox::OutboxArgs),
}

/// The states `list --state` selects.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum StateArg {
    InProgress,
    Completed,
    Held,
    Released,
    Corrupt,
}

impl StateArg {
    pub(crate) fn filter(self) -> StateFilter {
        match self {
            StateArg::InProgress => StateFilter::InProgress,
            StateArg::Completed => StateFilter::Completed,
            StateArg::Held => StateFilter::Held,
            StateArg::Released => StateFilter::Released,
            StateArg::Corrupt => StateFilter::Corrupt,
        }
    }
}

/// A `--timeout`: a duration of at least 1 ms.
fn parse_timeout(text: &str) -> Result<Duration, String> {
    let timeout = parse_duration(text)?;
    if timeout.is_zero() {
        return Err("a timeout of 0 would fail every call".into());
    }
    Ok(timeout)
}

/// A duration written `500ms`, `30s`, `10m`, `2h` or `7d`.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
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
pub(crate) struct KeyArgs {
    /// The key as `list` and `inspect` print it (`<prefix>:v<version>:{<parts>}`): bytes
    /// outside printable ASCII written `\xNN`, a backslash `\\`, quotes `\'` and `\"`, tab,
    /// carriage return and newline `\t`, `\r`, `\n`.
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
    pub(crate) fn key(&self) -> Result<Key, Failure> {
        let built = match (&self.key, &self.prefix) {
            (Some(text), _) => Key::parse_escaped(text),
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
