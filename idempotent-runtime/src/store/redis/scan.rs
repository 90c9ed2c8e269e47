//! The operator's primitives of [`RedisStore`]: reopening, deleting, and scanning each
//! server of the store.

use ::redis::Value;

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::redis::conn::{command_error, Conn};
use crate::store::redis::store::RedisStore;
use crate::store::redis::wire::{int, text};
use crate::store::{BoxFuture, Expect, OperatorStore, ScanCursor, ScanPage, Store, Token};

impl OperatorStore for RedisStore {
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.by_token("reopen", key, token))
    }

    /// `SCAN ... MATCH <prefix>:v*` on the server, or on each primary of a cluster in turn
    /// (the cursor names the primary by its position in the sorted list of primaries' addresses;
    /// a topology change during a scan may skip or repeat a node's keys), then each key found
    /// read by the script. Keys of the pattern that are no operation key are left out.
    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        cursor: &'a ScanCursor,
        limit: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
        Box::pin(async move {
            let bad = || {
                StoreError::new(
                    StoreErrorKind::Rejected,
                    format!("`{cursor}` is not a cursor of a Redis store"),
                )
            };
            let (node, position) = if cursor.is_start() {
                (0, 0u64)
            } else {
                match cursor.as_str().split_once(':') {
                    Some((node, position)) => (
                        node.parse::<usize>().map_err(|_| bad())?,
                        position.parse::<u64>().map_err(|_| bad())?,
                    ),
                    None => (0, cursor.as_str().parse::<u64>().map_err(|_| bad())?),
                }
            };
            let mut scan = ::redis::cmd("SCAN");
            scan.arg(position)
                .arg("MATCH")
                .arg(scan_pattern(prefix))
                .arg("COUNT")
                .arg(limit.clamp(1, 10_000));
            let (reply, nodes) = match &self.inner.conn {
                Conn::Single(_) | Conn::Sentinel(_) => (self.inner.conn.query(&scan).await, 1),
                Conn::Cluster(cluster) => {
                    let primaries = primaries(&self.inner.conn).await?;
                    let Some((host, port)) = primaries.get(node).cloned() else {
                        return Err(bad());
                    };
                    let routing = ::redis::cluster_routing::RoutingInfo::SingleNode(
                        ::redis::cluster_routing::SingleNodeRoutingInfo::ByAddress { host, port },
                    );
                    (
                        cluster.clone().route_command(scan, routing).await,
                        primaries.len(),
                    )
                }
            };
            let reply = reply.map_err(command_error)?;
            let (next_position, keys) = scan_reply(reply)?;
            let next = match (next_position, node + 1 < nodes) {
                (0, false) => None,
                (0, true) => Some(ScanCursor::new(format!("{}:0", node + 1))),
                (position, _) if nodes == 1 => Some(ScanCursor::new(position.to_string())),
                (position, _) => Some(ScanCursor::new(format!("{node}:{position}"))),
            };
            let keys: Vec<Key> = keys
                .iter()
                .filter_map(|bytes| Key::parse_bytes(bytes).ok())
                .filter(|key| key.prefix() == prefix)
                .collect();
            let reads = futures_util::future::join_all(keys.iter().map(|key| self.read(key))).await;
            let mut records = Vec::with_capacity(keys.len());
            for (key, read) in keys.into_iter().zip(reads) {
                match read {
                    Ok(Some(record)) => records.push((key, Ok(record))),
                    // Expired between the scan and the read.
                    Ok(None) => {}
                    Err(err) if err.kind() == StoreErrorKind::Corrupt => {
                        records.push((key, Err(err)));
                    }
                    Err(err) => return Err(err),
                }
            }
            Ok(ScanPage::new(records, next))
        })
    }

    fn delete<'a>(
        &'a self,
        key: &'a Key,
        expect: Expect<'a>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut cmd = self.inner.script.call(key.as_bytes());
            match expect {
                Expect::Token(token) => cmd.arg("delete").arg(token.as_bytes()),
                Expect::Corrupt => cmd.arg("delete_corrupt"),
            };
            Ok(int(&self.call(key, &self.inner.script, &cmd).await?)? == 1)
        })
    }
}

/// The `SCAN MATCH` pattern of every operation key with `prefix`: the prefix with the glob's
/// special characters escaped, then `:v*`.
fn scan_pattern(prefix: &str) -> String {
    let mut pattern = String::with_capacity(prefix.len() + 4);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push_str(":v*");
    pattern
}

/// A `SCAN` reply: the next position and the keys.
fn scan_reply(reply: Value) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
    let protocol = |what: &str| {
        StoreError::new(
            StoreErrorKind::Protocol,
            format!("unexpected SCAN reply: {what}"),
        )
    };
    let Value::Array(mut items) = reply else {
        return Err(protocol("not an array"));
    };
    if items.len() != 2 {
        return Err(protocol("not two items"));
    }
    let keys = items.pop();
    let position = match items.pop() {
        Some(Value::BulkString(bytes)) => std::str::from_utf8(&bytes)
            .ok()
            .and_then(|s| s.parse::<u64>().ok()),
        _ => None,
    }
    .ok_or_else(|| protocol("no position"))?;
    let keys = match keys {
        Some(Value::Array(keys)) => keys
            .into_iter()
            .filter_map(|key| match key {
                Value::BulkString(bytes) => Some(bytes),
                _ => None,
            })
            .collect(),
        _ => return Err(protocol("no keys")),
    };
    Ok((position, keys))
}

/// The addresses of a cluster's primaries (`CLUSTER NODES`), sorted.
async fn primaries(conn: &Conn) -> Result<Vec<(String, u16)>, StoreError> {
    let reply = conn
        .query(::redis::cmd("CLUSTER").arg("NODES"))
        .await
        .map_err(command_error)?;
    let mut nodes: Vec<(String, u16)> = text(&reply)
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let address = fields.nth(1)?;
            let flags = fields.next()?;
            if !flags.split(',').any(|f| f == "master") || flags.contains("fail") {
                return None;
            }
            // `ip:port@cport[,hostname]`
            let address = address.split(['@', ',']).next()?;
            let (host, port) = address.rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?))
        })
        .collect();
    nodes.sort();
    nodes.dedup();
    if nodes.is_empty() {
        return Err(StoreError::new(
            StoreErrorKind::Unavailable,
            "the cluster reports no primary",
        ));
    }
    Ok(nodes)
}
