//! The record commands: what to do (checked before the store is reached), doing it, and
//! what it printed.

use std::time::Duration;

use idempotency::admin::{Admin, AdminOutcome, ListQuery, StateFilter};
use idempotency::store::{RecordState, ScanCursor, StoreError, StoreErrorKind};
use idempotency::Key;
use serde_json::json;

use crate::args::{Cli, Command};
use crate::show::{inspection_json, print_inspection, seconds, state_name};
use crate::{confirm, connect, outbox, within, Failure, MAY_HAVE_BEEN_APPLIED};

/// What to do, checked before the store is reached: bad input changes nothing.
enum Plan {
    Inspect(Key),
    Release(Key, u64, bool),
    Unhold(Key, bool),
    Delete(Key, bool),
    List(ListQuery, usize),
    Purge(String, bool),
    Migrate,
}

impl Plan {
    fn of(command: &Command) -> Result<Plan, Failure> {
        let bad_prefix = |e: idempotency::key::KeyError| Failure::Input(format!("bad prefix: {e}"));
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
            Command::Migrate => Plan::Migrate,
            Command::Outbox(_) => unreachable!("the outbox has its own command line"),
        })
    }
}

pub(crate) async fn run(cli: &Cli) -> Result<(), Failure> {
    let Some(url) = &cli.store else {
        return Err(Failure::Input(
            "no store: give --store <url> or set IDEMPOTENT_STORE_URL".into(),
        ));
    };
    if let Command::Outbox(args) = &cli.command {
        return outbox::run(url, args, cli.json, cli.timeout).await;
    }
    let plan = Plan::of(&cli.command)?;
    let migrate = matches!(plan, Plan::Migrate);
    let opened = connect::open(url, cli.table.as_deref(), migrate);
    let store = within(cli.timeout, "opening the store", opened).await?;
    let admin = Admin::new(store).timeout(cli.timeout);
    let store_error = |e: StoreError| {
        let mut why = connect::chain(&e);
        if e.kind() == StoreErrorKind::OutcomeUnknown {
            why = format!("{why}; {MAY_HAVE_BEEN_APPLIED}");
        }
        Failure::Store(why)
    };
    match plan {
        Plan::Migrate => {
            let table = cli.table.as_deref().unwrap_or("idempotent_records");
            if cli.json {
                println!("{}", json!({ "action": "migrate", "table": table }));
            } else {
                println!("migrate: done; the records table `{table}` is ready");
            }
            Ok(())
        }
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
            if let AdminOutcome::FenceMismatch { fence: has } = outcome {
                // Say what is known: the record's fence. Whether it is another owner's (a
                // later claim) or the same owner's (a mistyped fence) is not.
                if cli.json {
                    report("release", &key, outcome, true).ok();
                }
                return Err(Failure::Unchanged(format!(
                    "the record's fence is {has}, not {fence}: nothing was released (`inspect` shows the fence of whoever holds `{key}`)"
                )));
            }
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
        let page = admin.list(&query).await.map_err(|e| {
            // The only thing a listing rejects is a cursor of another store.
            if e.kind() == StoreErrorKind::Rejected {
                Failure::Input(format!("bad --cursor: {}", connect::chain(&e)))
            } else {
                Failure::Store(connect::chain(&e))
            }
        })?;
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
            "the record's fence is {fence}, not the one given"
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
