//! The simulation's invariants on real servers: a workload of duplicate deliveries runs against
//! real Redis, real PostgreSQL and real MariaDB through a TCP proxy that, at random, cuts connections before
//! a request reaches the server and drops replies after the server applied the request; calls
//! are also dropped at random (a timeout around the handler). Effects are rows in a PostgreSQL
//! business table written over a direct connection.
//!
//! Checked: with a business check (`done`), exactly one effect per key; without it, no more
//! than one plus the lost ownerships reported; no key left in progress once the workload is
//! over and a lease has passed. Each run prints one line with its figures. Also: batches on
//! PostgreSQL and MariaDB whose statements lose their replies at chosen points.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::redis::RedisStore;
use idempotency::sql::sqlx::{self, AssertSqlSafe, PgPool};
use idempotency::sql::{MySqlStore, PostgresStore};
use idempotency::store::RecordState;
use idempotency::{Action, Error, Idempotency, Key, SharedStore};
use proxy::Proxy;
use sql_tables::{Scratch, Server};

const KEYS: usize = 150;
const DELIVERIES: usize = 3;
const WORKERS: usize = 24;
const LEASE: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("business database: {0}")]
    Db(#[from] sqlx::Error),
}

#[derive(Default)]
struct Counts {
    deliveries: AtomicUsize,
    executed: AtomicUsize,
    duplicates: AtomicUsize,
    redelivered: AtomicUsize,
    dropped_calls: AtomicUsize,
    /// Calls dropped once their effect was sent to the database, before the body returned:
    /// the write may have committed, and by the contract the claim is given back, so without
    /// a business check the effect can repeat.
    dropped_after_effect: AtomicUsize,
    lost_ownership: AtomicUsize,
    dead_lettered: AtomicUsize,
}

struct Workload {
    name: &'static str,
    business: PgPool,
    /// The business table of effects, dropped with the workload.
    _effects_table: Scratch,
    table: String,
    prefix: String,
}

impl Workload {
    async fn new(name: &'static str) -> Workload {
        let effects_table = Scratch::table(Server::Postgres);
        let business = PgPool::connect(effects_table.url()).await.unwrap();
        let table = effects_table.name().to_string();
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE {table} (op_key TEXT NOT NULL, fence BIGINT NOT NULL)"
        )))
        .execute(&business)
        .await
        .unwrap();
        Workload {
            name,
            business,
            prefix: format!("faults:{name}:{table}"),
            _effects_table: effects_table,
            table,
        }
    }

    fn key(&self, n: usize) -> Key {
        Key::new(&self.prefix, 1, &[&(n as u64)]).unwrap()
    }

    async fn effects(&self, key: &Key) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE op_key = $1",
            self.table
        )))
        .bind(key.to_string())
        .fetch_one(&self.business)
        .await
        .unwrap()
    }

    /// One delivery, redelivered until the consumer acknowledges it.
    async fn deliver(&self, store: &SharedStore, n: usize, counts: &Counts, seed: &mut u64) {
        let key = self.key(n);
        // Even keys have a business check; odd keys rely on the store alone.
        let with_done = n % 2 == 0;
        loop {
            counts.deliveries.fetch_add(1, Ordering::Relaxed);
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            // One call in ten is dropped after a random moment (a consumer's timeout).
            let deadline = if *seed % 10 == 0 {
                Duration::from_millis(*seed / 10 % 40)
            } else {
                Duration::from_secs(30)
            };
            let guard = Idempotency::new(Duration::from_secs(600))
                .lease(LEASE)
                .store(store.clone());
            let effect_sent = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let body = |claim: idempotency::Current| {
                let (pool, table, key) = (self.business.clone(), self.table.clone(), key.clone());
                let effect_sent = effect_sent.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    // From here a dropped call may leave the write applied.
                    effect_sent.store(true, Ordering::SeqCst);
                    sqlx::query(AssertSqlSafe(format!(
                        "INSERT INTO {table} (op_key, fence) VALUES ($1, $2)"
                    )))
                    .bind(key.to_string())
                    .bind(claim.fence() as i64)
                    .execute(&pool)
                    .await?;
                    Ok::<_, AppError>(())
                }
            };
            let call = async {
                if with_done {
                    let check = || async { Ok::<_, AppError>(self.effects(&key).await > 0) };
                    guard
                        .operation(key.clone())
                        .done(check)
                        .run_with(body)
                        .await
                } else {
                    guard.operation(key.clone()).run_with(body).await
                }
            };
            let action = match tokio::time::timeout(deadline, call).await {
                Err(_) => {
                    counts.dropped_calls.fetch_add(1, Ordering::Relaxed);
                    if effect_sent.load(Ordering::SeqCst) {
                        counts.dropped_after_effect.fetch_add(1, Ordering::Relaxed);
                    }
                    Action::Redeliver
                }
                Ok(Ok(())) => {
                    counts.executed.fetch_add(1, Ordering::Relaxed);
                    Action::Ack
                }
                Ok(Err(AppError::Idem(err))) => {
                    match &err {
                        Error::Duplicate { .. } => {
                            counts.duplicates.fetch_add(1, Ordering::Relaxed);
                        }
                        Error::LostOwnership { .. } => {
                            counts.lost_ownership.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {}
                    }
                    err.action()
                }
                Ok(Err(AppError::Db(err))) => panic!("business database failed: {err}"),
            };
            match action {
                Action::Ack => return,
                Action::DeadLetter => {
                    counts.dead_lettered.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                _ => {
                    counts.redelivered.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }

    /// Runs every delivery through `store` (behind `proxy`), then checks the invariants with
    /// `direct`, a store on the same server without the proxy.
    async fn run(
        self,
        proxy: &Proxy,
        chaos_permille: usize,
        store: SharedStore,
        direct: SharedStore,
    ) {
        let counts = Arc::new(Counts::default());
        let this = Arc::new(self);
        let next = Arc::new(AtomicUsize::new(0));
        proxy.chaos(chaos_permille, chaos_permille, 0x00C0_FFEE);
        let workers: Vec<_> = (0..WORKERS)
            .map(|w| {
                let (this, store, counts, next) =
                    (this.clone(), store.clone(), counts.clone(), next.clone());
                tokio::spawn(async move {
                    let mut seed = 0x9E37_79B9_7F4A_7C15 ^ (w as u64 + 1);
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        if i >= KEYS * DELIVERIES {
                            return;
                        }
                        this.deliver(&store, i % KEYS, &counts, &mut seed).await;
                    }
                })
            })
            .collect();
        for w in workers {
            w.await.unwrap();
        }
        proxy.calm();
        // Background completions and give-backs land; then one lease passes.
        tokio::time::sleep(LEASE + Duration::from_millis(500)).await;

        let (mut effects, mut duplicate_effects, mut stuck) = (0, 0, 0);
        for n in 0..KEYS {
            let key = this.key(n);
            let e = this.effects(&key).await;
            effects += e;
            if n % 2 == 0 {
                assert!(
                    e <= 1,
                    "{}: `{key}` has {e} effects with a business check",
                    this.name
                );
            }
            duplicate_effects += (e - 1).max(0);
            assert!(e >= 1, "{}: `{key}` was never applied", this.name);
            if let Some(record) = direct.read(&key).await.unwrap() {
                if matches!(record.state, RecordState::InProgress { .. }) {
                    stuck += 1;
                }
            }
        }
        let lost = counts.lost_ownership.load(Ordering::SeqCst) as i64;
        let dropped_after_effect = counts.dropped_after_effect.load(Ordering::SeqCst) as i64;
        println!(
            "backend={} keys={KEYS} requests={} deliveries={} executed={} duplicates={} redelivered={} dropped_calls={} faults_cut={} faults_lost_replies={} effects={effects} duplicate_effects={duplicate_effects} lost_ownership={lost} dropped_after_effect={dropped_after_effect} dead_lettered={} stuck={stuck}",
            this.name,
            proxy.requests(),
            counts.deliveries.load(Ordering::SeqCst),
            counts.executed.load(Ordering::SeqCst),
            counts.duplicates.load(Ordering::SeqCst),
            counts.redelivered.load(Ordering::SeqCst),
            counts.dropped_calls.load(Ordering::SeqCst),
            proxy.cut(),
            proxy.lost(),
            counts.dead_lettered.load(Ordering::SeqCst),
        );
        // Which requests the seeded proxy faults depends on how the traffic is cut into
        // reads; over hundreds of requests some always are.
        assert!(proxy.cut() + proxy.lost() > 0, "no fault was injected");
        assert!(
            duplicate_effects <= lost + dropped_after_effect,
            "{}: {duplicate_effects} duplicate effects but {lost} lost ownerships and {dropped_after_effect} calls dropped after sending their effect",
            this.name
        );
        assert_eq!(stuck, 0, "{}: keys left in progress", this.name);
        assert_eq!(counts.dead_lettered.load(Ordering::SeqCst), 0);
    }
}

fn addr(url: &str) -> SocketAddr {
    url.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_under_random_connection_faults_keeps_effects_exact() {
    let proxy = Proxy::start(addr("127.0.0.1:6379")).await;
    let store = RedisStore::builder(&proxy.url())
        .response_timeout(Duration::from_millis(500))
        .connection_timeout(Duration::from_millis(500))
        .build()
        .await
        .expect("Redis at 127.0.0.1:6379 must be running");
    let direct = RedisStore::connect("redis://127.0.0.1:6379").await.unwrap();
    let workload = Workload::new("redis").await;
    let prefix = workload.prefix.clone();
    // One multiplexed connection carries many commands per read: fault reads more often.
    workload
        .run(&proxy, 150, Arc::new(store), Arc::new(direct))
        .await;
    let client = redis::Client::open("redis://127.0.0.1:6379").unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(keys)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_under_random_connection_faults_keeps_effects_exact() {
    let records = Scratch::table(Server::Postgres);
    let url = records.url().to_string();
    let server = url
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap();
    let proxy = Proxy::start(addr(server)).await;
    let proxied_url = url.replacen(server, &proxy.addr().to_string(), 1);
    let store = PostgresStore::builder(&proxied_url)
        .table(records.name().to_string())
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(2))
        .build()
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 must be running");
    let direct = PostgresStore::builder(&url)
        .table(records.name().to_string())
        .build()
        .await
        .unwrap();
    let workload = Workload::new("postgres").await;
    workload
        .run(&proxy, 30, Arc::new(store), Arc::new(direct))
        .await;
}

/// MariaDB's claims: a fresh key is one statement, any other claim two (the second
/// returning the record), so a fault may fall between them or on either reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_under_random_connection_faults_keeps_effects_exact() {
    let (_records, proxy, store, direct) = proxied_mariadb(false).await;
    let workload = Workload::new("mariadb").await;
    workload.run(&proxy, 30, store, direct).await;
}

/// On MariaDB a claim of a key that has a row is two statements: the insert-only one, which
/// leaves the row alone, then the full claim returning the record. Here the second one takes
/// over a released record and commits, and its reply is lost: the engine reads the record
/// back by its token, finds its own claim, and runs the handler once with the new fence; a
/// redelivery replays the result. For a duplicate (a live claim of another owner), the same
/// lost reply is answered as the duplicate it is, and the handler does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_to_mariadbs_second_claim_statement_is_read_back() {
    let (_records, proxy, store, direct) = proxied_mariadb(false).await;
    let guard = Idempotency::new(Duration::from_secs(60))
        .lease(Duration::from_secs(30))
        .store(store);
    let runs = AtomicUsize::new(0);
    let handler = || async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, Error>(7u32)
    };
    let name = format!("second-statement-{}", std::process::id());

    // A released record: the takeover is the second statement.
    let key = Key::new("lost-second", 1, &[&name, &"takeover"]).unwrap();
    let earlier = idempotency::store::ClaimRequest::new(
        key.clone(),
        idempotency::store::Token::generate(),
        Duration::from_secs(30),
        Duration::from_secs(60),
    );
    let Ok(idempotency::store::Claim::Acquired { fence }) = direct.claim(&earlier).await else {
        panic!("the earlier claim was not acquired");
    };
    assert!(direct.release(&key, &earlier.token).await.unwrap());
    // The key's bytes are a parameter of both statements (and of nothing in between:
    // `mariadb_claims_fresh_keys_in_one_statement_and_others_in_two` counts them), so the
    // second request carrying them is the full claim.
    proxy.lose_reply_to_nth(key.as_bytes(), 2);
    let lost = proxy.lost();
    let first: Result<u32, Error> = guard.operation(key.clone()).replay().run(handler()).await;
    assert_eq!(first.unwrap(), 7);
    assert_eq!(proxy.lost(), lost + 1, "no reply was lost");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let record = direct.read(&key).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.fence),
        (RecordState::Completed, fence + 1)
    );
    let again: Result<u32, Error> = guard.operation(key.clone()).replay().run(handler()).await;
    assert_eq!(again.unwrap(), 7);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A live claim of another owner: the duplicate's second statement loses its reply.
    let key = Key::new("lost-second", 1, &[&name, &"duplicate"]).unwrap();
    let other = idempotency::store::ClaimRequest::new(
        key.clone(),
        idempotency::store::Token::generate(),
        Duration::from_secs(30),
        Duration::from_secs(60),
    );
    assert!(matches!(
        direct.claim(&other).await,
        Ok(idempotency::store::Claim::Acquired { .. })
    ));
    proxy.lose_reply_to_nth(key.as_bytes(), 2);
    let lost = proxy.lost();
    let out: Result<u32, Error> = guard.run(key.clone(), handler()).await;
    assert_eq!(proxy.lost(), lost + 1, "no reply was lost");
    assert!(
        matches!(out, Err(Error::InProgress { .. })),
        "a live claim of another owner: {out:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let record = direct.read(&key).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "{record:?}"
    );
    assert_eq!(record.token, other.token);
}

/// A MariaDB store through a new proxy (8 connections; with `plain`, on the statements MySQL
/// gets), and a store of the same table without it: the table (dropped with it), the proxy
/// and the two stores.
async fn proxied_mariadb(plain: bool) -> (Scratch, Proxy, SharedStore, SharedStore) {
    let records = Scratch::table(Server::MySql);
    let url = records.url().to_string();
    let server = server_of(&url);
    let proxy = Proxy::start(addr(server)).await;
    let proxied_url = url.replacen(server, &proxy.addr().to_string(), 1);
    let store = MySqlStore::builder(&proxied_url)
        .table(records.name().to_string())
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(2))
        .plain_claims(plain)
        .build()
        .await
        .unwrap();
    let direct = MySqlStore::builder(&url)
        .table(records.name().to_string())
        .build()
        .await
        .unwrap();
    (records, proxy, Arc::new(store), Arc::new(direct))
}

/// The host and port of a database URL (`scheme://user@host:port/db`).
fn server_of(url: &str) -> &str {
    url.split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap()
}

/// A batch on a SQL store whose claim statement, then (in a second batch) whose ending
/// statement, loses its reply: the proxy forwards the statement, the database commits it, and
/// the connection is cut before the answer comes back. Each item's outcome is unknown and is
/// read back by token: the claims are found to be the items' own, the completions done. Every
/// handler runs once, every record is completed, and a redelivery replays every result. The
/// markers are values the statements carry as parameters (a key part, a result), so the reply
/// lost is the one of the statement that ran, not of its preparation; `more` are further
/// rounds (a name, the marker, the batch's size).
async fn lost_batch_replies(
    server: Server,
    proxied: SharedStore,
    direct: SharedStore,
    proxy: &Proxy,
    more: Vec<(&'static str, Vec<u8>, u32)>,
) {
    let namespace = format!("lostbatch{}", std::process::id());
    let guard = Idempotency::new(Duration::from_secs(60)).store(proxied);
    let executions = AtomicUsize::new(0);
    let handler = |id: u32| {
        let executions = &executions;
        async move {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(900_000_000 + id)
        }
    };
    let rounds = [
        ("claim", format!("{namespace}-claim-0007").into_bytes(), 30),
        ("end", b"900000007".to_vec(), 30),
    ];
    for (round, marker, size) in rounds.into_iter().chain(more) {
        let items: Vec<(Key, u32)> = (0..size)
            .map(|id| {
                let key = Key::new("lost-batch", 1, &[&format!("{namespace}-{round}-{id:04}")]);
                (key.unwrap(), id)
            })
            .collect();
        let before = executions.load(Ordering::SeqCst);
        proxy.lose_reply_to(&marker);
        let lost_before = proxy.lost();
        let out: Vec<Result<u32, Error>> = guard.batch().replay().run(items.clone(), handler).await;
        assert_eq!(
            proxy.lost(),
            lost_before + 1,
            "{server:?} {round}: no reply was lost"
        );
        for (id, out) in (0..size).zip(&out) {
            assert_eq!(
                out.as_ref().unwrap(),
                &(900_000_000 + id),
                "{server:?} {round} {id}"
            );
        }
        let ran = usize::try_from(size).unwrap();
        assert_eq!(
            executions.load(Ordering::SeqCst),
            before + ran,
            "{server:?} {round}"
        );
        for (key, _) in &items {
            let record = direct.read(key).await.unwrap().unwrap();
            assert_eq!(
                record.state,
                RecordState::Completed,
                "{server:?} {round}: {key}"
            );
        }
        let again: Vec<Result<u32, Error>> =
            guard.batch().replay().run(items.clone(), handler).await;
        assert_eq!(
            executions.load(Ordering::SeqCst),
            before + ran,
            "{server:?} {round}"
        );
        assert_eq!(
            again.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
            (0..size).map(|id| 900_000_000 + id).collect::<Vec<_>>()
        );
    }
}

/// A PostgreSQL store through a new proxy, and a store of the same table without it: the
/// table (dropped with it), the proxy and the two stores.
async fn proxied_postgres() -> (Scratch, Proxy, SharedStore, SharedStore) {
    let records = Scratch::table(Server::Postgres);
    let url = records.url().to_string();
    let server = server_of(&url);
    let proxy = Proxy::start(addr(server)).await;
    let proxied_url = url.replacen(server, &proxy.addr().to_string(), 1);
    let store = PostgresStore::builder(&proxied_url)
        .table(records.name().to_string())
        .build()
        .await
        .unwrap();
    let direct = PostgresStore::builder(&url)
        .table(records.name().to_string())
        .build()
        .await
        .unwrap();
    (records, proxy, Arc::new(store), Arc::new(direct))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_replies_to_batch_statements_on_postgres_are_resolved_item_by_item() {
    let (_records, proxy, store, direct) = proxied_postgres().await;
    lost_batch_replies(Server::Postgres, store, direct, &proxy, Vec::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_replies_to_batch_statements_on_mariadb_are_resolved_item_by_item() {
    // A batch of fresh keys is claimed by one statement (the insert-only claim, with
    // `RETURNING`): the claim round loses its reply.
    lost_mariadb_batch_replies(false, Vec::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_replies_to_batch_statements_in_mysql_form_are_resolved_item_by_item() {
    // The statements MySQL gets: the batch claim is a multi-row insert, then a read of the
    // batch's records. Between the two, the insert commits, and the connection is cut while
    // the read is prepared (a batch of a new size is prepared anew, and only that read has
    // `record_key IN (`).
    let between = ("between", b"WHERE record_key IN (".to_vec(), 31);
    lost_mariadb_batch_replies(true, vec![between]).await;
}

/// [`lost_batch_replies`] on MariaDB; with `plain`, on the statements MySQL gets.
async fn lost_mariadb_batch_replies(plain: bool, more: Vec<(&'static str, Vec<u8>, u32)>) {
    let (_records, proxy, store, direct) = proxied_mariadb(plain).await;
    lost_batch_replies(Server::MySql, store, direct, &proxy, more).await;
}

/// A batch of fresh keys and keys that have a row, on PostgreSQL and MariaDB: the
/// insert-only claim acquires the fresh keys, and the full claim follows for the others (a
/// released record, another owner's live claim, a completed record). The full claim takes
/// over the released record and commits, and its reply is lost. The fresh items run as
/// claimed; each item of the second statement is read back by its token: the released
/// record is found to be this batch's claim (its handler runs once, with the next fence),
/// the live claim stays the other owner's (`InProgress`, nothing runs), the completed record
/// replays its result. A redelivery of the whole batch runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_to_the_second_batch_claim_statement_is_read_back() {
    let (_postgres, proxy, proxied, direct) = proxied_postgres().await;
    second_batch_claim_loses_its_reply(Server::Postgres, &proxy, proxied, direct).await;
    let (_mariadb, proxy, proxied, direct) = proxied_mariadb(false).await;
    second_batch_claim_loses_its_reply(Server::MySql, &proxy, proxied, direct).await;
}

async fn second_batch_claim_loses_its_reply(
    server: Server,
    proxy: &Proxy,
    proxied: SharedStore,
    direct: SharedStore,
) {
    use idempotency::store::{Claim, ClaimRequest, Token};
    let name = format!("second-batch-{}-{server:?}", std::process::id());
    let key = |part: &str| Key::new("lost-second-batch", 1, &[&name, &part]).unwrap();
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let executions = AtomicUsize::new(0);
    let handler = |id: u32| {
        let executions = &executions;
        async move {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(900_000_000 + id)
        }
    };

    // A released record (the marker: its key is a parameter of both claim statements, the
    // first two requests that carry it), another owner's live claim, a completed record.
    let released = ClaimRequest::new(key("released"), Token::generate(), lease, ttl);
    let Ok(Claim::Acquired { fence }) = direct.claim(&released).await else {
        panic!("{server:?}: the earlier claim was not acquired");
    };
    assert!(direct
        .release(&released.key, &released.token)
        .await
        .unwrap());
    let held = ClaimRequest::new(key("held"), Token::generate(), lease, ttl);
    assert!(matches!(
        direct.claim(&held).await,
        Ok(Claim::Acquired { .. })
    ));
    let earlier = Idempotency::new(ttl).store(direct.clone());
    let done: Result<u32, Error> = earlier
        .operation(key("done"))
        .replay()
        .run(async { Ok(900_000_102) })
        .await;
    assert_eq!(done.unwrap(), 900_000_102);

    let mut items: Vec<(Key, u32)> = (0..8).map(|id| (key(&format!("fresh-{id}")), id)).collect();
    items.extend([
        (key("released"), 100),
        (key("held"), 101),
        (key("done"), 102),
    ]);
    let guard = Idempotency::new(ttl).lease(lease).store(proxied);
    proxy.lose_reply_to_nth(released.key.as_bytes(), 2);
    let lost = proxy.lost();
    let out: Vec<Result<u32, Error>> = guard.batch().replay().run(items.clone(), handler).await;
    assert_eq!(proxy.lost(), lost + 1, "{server:?}: no reply was lost");
    for (id, out) in (0..8).zip(&out) {
        assert_eq!(
            out.as_ref().unwrap(),
            &(900_000_000 + id),
            "{server:?} {id}"
        );
    }
    assert_eq!(
        out[8].as_ref().unwrap(),
        &900_000_100,
        "{server:?} released"
    );
    assert!(
        matches!(out[9], Err(Error::InProgress { .. })),
        "{server:?} held: {:?}",
        out[9]
    );
    assert_eq!(out[10].as_ref().unwrap(), &900_000_102, "{server:?} done");
    // The eight fresh items and the released record, once each.
    assert_eq!(executions.load(Ordering::SeqCst), 9, "{server:?}");
    let record = direct.read(&released.key).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.fence),
        (RecordState::Completed, fence + 1),
        "{server:?}"
    );
    let record = direct.read(&held.key).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "{server:?}: {record:?}"
    );
    assert_eq!(record.token, held.token, "{server:?}");

    let again: Vec<Result<u32, Error>> = guard.batch().replay().run(items, handler).await;
    assert_eq!(executions.load(Ordering::SeqCst), 9, "{server:?}");
    let replayed: Vec<u32> = again
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != 9)
        .map(|(_, out)| *out.as_ref().unwrap())
        .collect();
    let expected: Vec<u32> = (0..8)
        .chain([100, 102])
        .map(|id| 900_000_000 + id)
        .collect();
    assert_eq!(replayed, expected, "{server:?}");
    assert!(
        matches!(again[9], Err(Error::InProgress { .. })),
        "{server:?}"
    );
}

/// A completion sent on a pooled PostgreSQL connection that goes silent (the proxy never
/// forwards it and never answers: no reply, no error) must neither hang its caller nor let the
/// lease lapse. The call is bounded (half the lease), resolved by reading the record back on
/// another connection and sending the completion again, while the watchdog keeps renewing; a
/// redelivery meanwhile meets a live owner, and afterwards the recorded result. Before the
/// bound, the caller never returned, the lease ran out, and the redelivery ran the effect again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_on_a_silent_connection_is_bounded_and_the_lease_kept() {
    let records = Scratch::table(Server::Postgres);
    let url = records.url().to_string();
    let server = server_of(&url);
    let proxy = Proxy::start(addr(server)).await;
    let proxied_url = url.replacen(server, &proxy.addr().to_string(), 1);
    let store = PostgresStore::builder(&proxied_url)
        .table(records.name().to_string())
        .max_connections(4)
        .build()
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 must be running");
    let lease = Duration::from_secs(2);
    let guard = Idempotency::new(Duration::from_secs(60))
        .lease(lease)
        .store(Arc::new(store));
    let key = Key::new(
        "silent-completion",
        1,
        &[&format!("{}", std::process::id())],
    )
    .unwrap();
    let effects = Arc::new(AtomicUsize::new(0));
    let ran = Arc::new(tokio::sync::Notify::new());
    let deliver = || {
        let (effects, ran) = (effects.clone(), ran.clone());
        guard.operation(key.clone()).replay().run(async move {
            effects.fetch_add(1, Ordering::SeqCst);
            ran.notify_one();
            Ok::<u32, Error>(987_654_321)
        })
    };

    // The result is a parameter of the completion statement alone.
    proxy.stall_request(b"987654321");
    let first = tokio::spawn(deliver());
    ran.notified().await;
    // Redeliveries for three leases, or until the first call returns: none may run the effect.
    let deadline = tokio::time::Instant::now() + 3 * lease;
    while !first.is_finished() && tokio::time::Instant::now() < deadline {
        match deliver().await {
            Err(Error::InProgress { .. }) => {}
            Ok(value) => assert_eq!(value, 987_654_321),
            Err(other) => panic!("a redelivery failed: {other}"),
        }
        assert_eq!(effects.load(Ordering::SeqCst), 1, "the effect ran again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(proxy.stalled(), 1, "the completion was not stalled");
    assert!(first.is_finished(), "the first caller never returned");
    assert_eq!(first.await.unwrap().unwrap(), 987_654_321);
    assert_eq!(deliver().await.unwrap(), 987_654_321, "not replayed");
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}

/// A purge whose statement goes out on a pooled connection that then goes silent (the proxy
/// never forwards it, never answers, and keeps the connection open) is abandoned at the
/// purger's bound, and a later tick purges on another connection: the expired records go, the
/// live ones stay. Before the bound, the purger awaited that statement forever and no expired
/// record was deleted again.
macro_rules! a_purge_on_a_silent_connection {
    ($name:ident, $server:expr, $store:ty) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let records = Scratch::table($server);
            let url = records.url().to_string();
            let host = server_of(&url);
            let proxy = Proxy::start(addr(host)).await;
            let store = <$store>::builder(&url.replacen(host, &proxy.addr().to_string(), 1))
                .table(records.name().to_string())
                .max_connections(4)
                .build()
                .await
                .unwrap();
            let direct = <$store>::builder(&url)
                .table(records.name().to_string())
                .build()
                .await
                .unwrap();
            let count = format!("SELECT COUNT(*) FROM {}", records.name());
            let rows = || async {
                sqlx::query_scalar::<_, i64>(AssertSqlSafe(count.clone()))
                    .fetch_one(direct.pool())
                    .await
                    .unwrap()
            };
            let (short, hour) = (Duration::from_millis(200), Duration::from_secs(3600));
            for i in 0..30u32 {
                let ttl = if i < 25 { short } else { hour };
                let guard = Idempotency::new(ttl).store(Arc::new(store.clone()));
                let key = Key::new("silent-purge", 1, &[&i]).unwrap();
                guard
                    .operation(key)
                    .run(async { Ok::<(), Error>(()) })
                    .await
                    .unwrap();
            }
            assert_eq!(rows().await, 30);

            // Every purge statement holds the table's ordering by expiry.
            proxy.stall_request(b"ORDER BY expires_at");
            let purger = store.spawn_purger(Duration::from_millis(300), 10);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while rows().await != 5 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the purger stopped: {} rows left, {} statements stalled",
                    rows().await,
                    proxy.stalled()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert_eq!(proxy.stalled(), 1, "no purge statement was stalled");
            drop(purger);
        }
    };
}

a_purge_on_a_silent_connection!(
    a_purge_on_a_silent_postgres_connection_does_not_stop_the_purger,
    Server::Postgres,
    PostgresStore
);
a_purge_on_a_silent_connection!(
    a_purge_on_a_silent_mariadb_connection_does_not_stop_the_purger,
    Server::MySql,
    MySqlStore
);
