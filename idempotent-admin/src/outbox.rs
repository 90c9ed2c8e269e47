//! `idempotent-admin outbox ...`: the transactional outbox of an SQL database (PostgreSQL,
//! MySQL / MariaDB, SQLite), on top of `idempotency::outbox::Outbox`.

use std::future::Future;
use std::time::Duration;

use clap::{Args, Subcommand};
use idempotency::outbox::{
    DeadMessage, Discarded, MessageId, Outbox, OutboxCounts, OutboxDialect, StoredMessage,
};
use idempotency::sql::sqlx::{self, Pool};
use idempotency::store::StoreError;
use serde_json::json;

use crate::{confirm, parse_duration, within, Failure};

#[derive(Debug, Args)]
pub(crate) struct OutboxArgs {
    /// The outbox table (`schema.table` on PostgreSQL).
    #[arg(long, default_value = "idempotent_outbox")]
    table: String,
    #[command(subcommand)]
    command: OutboxCommand,
}

#[derive(Debug, Subcommand)]
enum OutboxCommand {
    /// How many messages are pending, published and dead.
    Counts,
    /// The dead messages (out of attempts), oldest first.
    Dead {
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Puts a dead message back in the queue, its attempts reset.
    Retry {
        /// The message id.
        #[arg(long)]
        id: String,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
    /// One message, whatever its state: attempts, last error, why it cannot be read, whether
    /// a relay is publishing it now.
    Inspect {
        /// The message id.
        #[arg(long)]
        id: String,
    },
    /// Deletes a dead message: it is never published. With `--force`, also a pending one
    /// (stuck: it cannot be read or published), unless a relay is publishing it right now.
    Discard {
        /// The message id.
        #[arg(long)]
        id: String,
        /// Also delete a pending message (one no relay is publishing right now).
        #[arg(long)]
        force: bool,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
    /// Deletes messages published longer ago than `--older-than`.
    PurgePublished {
        /// Published at least this long ago (`1h`, `7d`).
        #[arg(long, value_parser = parse_duration)]
        older_than: Duration,
        /// At most this many per statement; the command repeats until none is left.
        #[arg(long, default_value_t = 1000)]
        batch: u32,
    },
}

/// Runs an outbox command on the SQL database at `url`.
/// Every statement fails (exit 3) after `timeout` without an answer.
pub(crate) async fn run(
    url: &str,
    args: &OutboxArgs,
    as_json: bool,
    timeout: Duration,
) -> Result<(), Failure> {
    let scheme = url.split(':').next().unwrap_or_default();
    match scheme {
        "postgres" | "postgresql" => on::<sqlx::Postgres>(url, args, as_json, timeout).await,
        "mysql" | "mariadb" => {
            let url = url.replacen("mariadb:", "mysql:", 1);
            on::<sqlx::MySql>(&url, args, as_json, timeout).await
        }
        "sqlite" => on::<sqlx::Sqlite>(url, args, as_json, timeout).await,
        other => Err(Failure::Input(format!(
            "the outbox lives in an SQL database (postgres://, mysql://, sqlite:), not `{other}:`"
        ))),
    }
}

async fn on<DB: OutboxDialect>(
    url: &str,
    args: &OutboxArgs,
    as_json: bool,
    timeout: Duration,
) -> Result<(), Failure> {
    let connect = async {
        Pool::<DB>::connect(url)
            .await
            .map_err(|e| Failure::Store(format!("cannot use the database: {e}")))
    };
    let pool = within(timeout, "connecting", connect).await?;
    let outbox = Outbox::with_table(pool, &args.table)
        .map_err(|e| Failure::Input(format!("bad table: {e}")))?;
    match &args.command {
        OutboxCommand::Counts => {
            let counts = answer(timeout, "counts", outbox.counts()).await?;
            print_counts(&counts, as_json);
            Ok(())
        }
        OutboxCommand::Dead { limit } => {
            let dead = answer(timeout, "dead", outbox.dead(*limit)).await?;
            print_dead(&dead, as_json);
            Ok(())
        }
        OutboxCommand::Retry { id, yes } => {
            confirm(*yes, &format!("Publish dead message `{id}` again?"))?;
            let message = MessageId::from_string(id.clone());
            let done = answer(timeout, "retry", outbox.retry(&message)).await?;
            settled(
                "retry",
                id,
                done,
                as_json,
                "is pending again, its attempts reset",
            )
        }
        OutboxCommand::Inspect { id } => {
            let message = MessageId::from_string(id.clone());
            let row = answer(timeout, "inspect", outbox.inspect(&message)).await?;
            match row {
                Some(row) => {
                    print_stored(&row, as_json);
                    Ok(())
                }
                None => {
                    if as_json {
                        println!("{}", json!({ "id": id, "found": false }));
                    }
                    Err(Failure::Unchanged(format!(
                        "`{id}` is not a message of this outbox"
                    )))
                }
            }
        }
        OutboxCommand::Discard {
            id,
            force: false,
            yes,
        } => {
            confirm(
                *yes,
                &format!("Delete dead message `{id}`? It is never published."),
            )?;
            let message = MessageId::from_string(id.clone());
            let done = answer(timeout, "discard", outbox.discard(&message)).await?;
            settled("discard", id, done, as_json, "is deleted")
        }
        OutboxCommand::Discard {
            id,
            force: true,
            yes,
        } => {
            confirm(
                *yes,
                &format!("Delete message `{id}`, pending or dead? It is never published."),
            )?;
            let message = MessageId::from_string(id.clone());
            let outcome = answer(timeout, "discard", outbox.force_discard(&message)).await?;
            force_discarded(id, outcome, as_json)
        }
        OutboxCommand::PurgePublished { older_than, batch } => {
            let mut purged = 0u64;
            loop {
                let purge = outbox.purge_published(*older_than, (*batch).max(1));
                let n = answer(timeout, "purge-published", purge).await?;
                purged += n;
                if n < u64::from((*batch).max(1)) {
                    break;
                }
            }
            if as_json {
                println!(
                    "{}",
                    json!({ "action": "purge_published", "deleted": purged })
                );
            } else {
                println!("purge-published: deleted {purged} published messages");
            }
            Ok(())
        }
    }
}

/// One outbox call: its error, or no answer within `timeout`, fails the command (exit 3).
async fn answer<T>(
    timeout: Duration,
    what: &str,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, Failure> {
    let failed = async {
        call.await
            .map_err(|e| Failure::Store(format!("{what}: {e}")))
    };
    within(timeout, what, failed).await
}

fn print_counts(counts: &OutboxCounts, as_json: bool) {
    if as_json {
        println!(
            "{}",
            json!({ "pending": counts.pending, "published": counts.published, "dead": counts.dead })
        );
    } else {
        println!("pending    {}", counts.pending);
        println!("published  {}", counts.published);
        println!("dead       {}", counts.dead);
    }
}

fn print_dead(dead: &[DeadMessage], as_json: bool) {
    if as_json {
        let rows: Vec<_> = dead
            .iter()
            .map(|d| {
                json!({
                    "id": d.message.id.as_str(),
                    "destination": d.message.destination,
                    "event_type": d.message.event_type,
                    "aggregate": format!("{}/{}", d.message.aggregate_type, d.message.aggregate_id),
                    "attempts": d.message.attempts,
                    "age_seconds": d.age_seconds,
                    "last_error": d.last_error,
                    "unreadable": d.unreadable,
                })
            })
            .collect();
        println!("{}", json!({ "dead": rows }));
        return;
    }
    if dead.is_empty() {
        eprintln!("no dead messages");
        return;
    }
    println!(
        "{:<36} {:>8} {:>10}  {:<24} LAST ERROR",
        "ID", "ATTEMPTS", "AGE", "DESTINATION"
    );
    for d in dead {
        println!(
            "{:<36} {:>8} {:>10}  {:<24} {}",
            d.message.id.as_str(),
            d.message.attempts,
            format!("{:.0} s", d.age_seconds),
            d.message.destination,
            d.last_error.as_deref().unwrap_or("-")
        );
        if let Some(why) = &d.unreadable {
            println!("{:<36} unreadable: {why}", "");
        }
    }
}

fn print_stored(row: &StoredMessage, as_json: bool) {
    let m = &row.message;
    if as_json {
        println!(
            "{}",
            json!({
                "id": m.id.as_str(),
                "state": row.state.as_str(),
                "destination": m.destination,
                "event_type": m.event_type,
                "aggregate": format!("{}/{}", m.aggregate_type, m.aggregate_id),
                "headers": m.headers,
                "payload_bytes": m.payload.len(),
                "attempts": m.attempts,
                "age_seconds": row.age_seconds,
                "claimed": row.claimed,
                "last_error": row.last_error,
                "unreadable": row.unreadable,
            })
        );
        return;
    }
    println!("id           {}", m.id);
    println!("state        {}", row.state.as_str());
    println!("destination  {}", m.destination);
    println!("event type   {}", m.event_type);
    println!("aggregate    {}/{}", m.aggregate_type, m.aggregate_id);
    println!("payload      {} bytes", m.payload.len());
    println!("attempts     {}", m.attempts);
    println!("age          {:.0} s", row.age_seconds);
    println!(
        "claimed      {}",
        if row.claimed {
            "yes: a relay is publishing it now"
        } else {
            "no"
        }
    );
    println!("last error   {}", row.last_error.as_deref().unwrap_or("-"));
    println!("unreadable   {}", row.unreadable.as_deref().unwrap_or("-"));
}

fn force_discarded(id: &str, outcome: Discarded, as_json: bool) -> Result<(), Failure> {
    let (name, why) = match outcome {
        Discarded::Deleted => ("done", ""),
        Discarded::Claimed => (
            "claimed",
            "a relay is publishing it right now; try again once its claim ends",
        ),
        Discarded::Published => ("published", "it is published (purge-published removes it)"),
        _ => ("not_found", "it is not a message of this outbox"),
    };
    if as_json {
        println!(
            "{}",
            json!({ "id": id, "action": "discard", "outcome": name })
        );
    }
    if outcome != Discarded::Deleted {
        return Err(Failure::Unchanged(format!("`{id}` not deleted: {why}")));
    }
    if !as_json {
        println!("discard: done; `{id}` is deleted, never published");
    }
    Ok(())
}

fn settled(action: &str, id: &str, done: bool, as_json: bool, what: &str) -> Result<(), Failure> {
    if as_json {
        println!(
            "{}",
            json!({ "id": id, "action": action, "outcome": if done { "done" } else { "not_dead" } })
        );
    }
    if !done {
        return Err(Failure::Unchanged(format!(
            "`{id}` is not a dead message of this outbox"
        )));
    }
    if !as_json {
        println!("{action}: done; `{id}` {what}");
    }
    Ok(())
}
