//! What a Redis server and this process say of their work: `INFO` fields, and the CPU time
//! each used. Included by the benches that talk to Redis with
//! `#[path = "support/redis_info.rs"] mod redis_info;`.

// Each bench uses only some of these.
#![allow(dead_code)]

use idempotency::redis::RedisStore;
use redis::aio::ConnectionManager;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The bench's store on `url`: in a counted run (`IDEMPOTENT_BENCH_ONLY` names its side), one
/// that accepts `counted_error` as the error of its estimate of the server's clock (see
/// `instructions::COUNTED_CLOCK_ERROR`); otherwise the default store.
pub(crate) async fn store(
    url: &str,
    counted_error: std::time::Duration,
) -> Result<RedisStore, BoxError> {
    let builder = RedisStore::builder(url);
    let builder = match std::env::var_os("IDEMPOTENT_BENCH_ONLY") {
        Some(_) => builder.fast_claim_max_error(counted_error),
        None => builder,
    };
    Ok(builder.build().await?)
}

/// The number after `prefix` in an `INFO` section (up to a `,` or the end of the line).
pub(crate) async fn info_field<T: std::str::FromStr + Default>(
    conn: &mut ConnectionManager,
    section: &str,
    prefix: &str,
) -> Result<T, BoxError>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    let info: String = redis::cmd("INFO").arg(section).query_async(conn).await?;
    let value = info
        .lines()
        .find_map(|line| line.strip_prefix(prefix))
        .map(|rest| rest.split([',', '\r']).next().unwrap_or_default().trim());
    match value {
        Some(n) => Ok(n.parse()?),
        None => Ok(T::default()),
    }
}

/// CPU seconds the server has used (all its threads), from `INFO cpu`.
pub(crate) async fn server_cpu(conn: &mut ConnectionManager) -> Result<f64, BoxError> {
    let user: f64 = info_field(conn, "cpu", "used_cpu_user:").await?;
    let sys: f64 = info_field(conn, "cpu", "used_cpu_sys:").await?;
    Ok(user + sys)
}

/// CPU seconds this process's live threads have used, from `/proc/self/task/*/schedstat`
/// (Linux); `None` elsewhere.
pub(crate) fn client_cpu() -> Option<f64> {
    crate::stats::process_cpu(std::path::Path::new("/proc/self"))
}

/// A probe of how many scripts (`EVALSHA`) the server at `url` ran so far, over a connection
/// of its own, for [`per_cycle_probed`](crate::instructions::per_cycle_probed): a claim of
/// ours is a script only when it cannot be the fast `SET ... NX GET`, which is what a count
/// under callgrind, many times slower, has to be read with.
pub(crate) fn script_calls(url: &str) -> Result<impl FnMut() -> Result<u64, BoxError>, BoxError> {
    let mut conn = redis::Client::open(url)?.get_connection()?;
    Ok(move || {
        let info: String = redis::cmd("INFO").arg("commandstats").query(&mut conn)?;
        let calls = info
            .lines()
            .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
            .and_then(|rest| rest.split(',').next())
            .map_or(Ok(0), str::parse)?;
        Ok(calls)
    })
}
