//! Batches on Redis: one pipeline on a standalone server, one pipeline per node on a cluster.
//!
//! A cluster's keys are grouped by the primary that serves their slot, from a map of the
//! slots (`CLUSTER SLOTS`) kept for [`MAP_TTL`] and read again after a `MOVED` reply. Each
//! group's pipeline is routed to the node of its first key's slot; a key the map placed
//! wrong (a resharding since the map was read) is answered `MOVED` or `ASK` by that node,
//! and that key alone is sent again on its own, through the cluster client's routing.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ::redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use ::redis::{Pipeline, RedisError, ServerErrorKind, Value};

use crate::key::Key;
use crate::store::redis::conn::Conn;

/// How long a map of the cluster's slots is used before it is read again.
pub(super) const MAP_TTL: Duration = Duration::from_secs(30);

/// The slot of a Redis key: CRC16 (XMODEM) of its hash tag (the bytes between the first `{`
/// and the next `}`, when not empty) or of the whole key, modulo 16384.
pub(super) fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16(tagged) % 16384
}

fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// A range of slots and the address of the primary that serves it.
type Range = (u16, u16, String);

/// The slot ranges of a cluster's primaries, as last read.
#[derive(Default)]
pub(super) struct SlotMap {
    map: Mutex<Option<(Instant, Vec<Range>)>>,
}

impl SlotMap {
    /// Forgets the map: the next batch reads it again.
    pub(super) fn invalidate(&self) {
        if let Ok(mut map) = self.map.lock() {
            *map = None;
        }
    }

    fn current(&self) -> Option<Vec<Range>> {
        let map = self.map.lock().ok()?;
        map.as_ref()
            .filter(|(read_at, _)| read_at.elapsed() < MAP_TTL)
            .map(|(_, ranges)| ranges.clone())
    }

    async fn read(&self, conn: &Conn) -> Option<Vec<Range>> {
        if let Some(ranges) = self.current() {
            return Some(ranges);
        }
        let reply = conn
            .query(::redis::cmd("CLUSTER").arg("SLOTS"))
            .await
            .ok()?;
        let ranges = parse_slots(&reply)?;
        if let Ok(mut map) = self.map.lock() {
            *map = Some((Instant::now(), ranges.clone()));
        }
        Some(ranges)
    }

    /// The positions of `keys` grouped by the node that serves them, each group with the
    /// slot of its first key (to route it by). Without a map (the server does not answer
    /// `CLUSTER SLOTS`), keys are grouped by slot.
    pub(super) async fn groups<'k>(
        &self,
        conn: &Conn,
        keys: impl Iterator<Item = &'k Key>,
    ) -> Vec<(u16, Vec<usize>)> {
        let ranges = self.read(conn).await;
        let node_of = |slot: u16| -> Option<&str> {
            ranges.as_ref().and_then(|ranges| {
                ranges
                    .iter()
                    .find(|(start, end, _)| (*start..=*end).contains(&slot))
                    .map(|(_, _, node)| node.as_str())
            })
        };
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        let mut by_node: HashMap<String, usize> = HashMap::new();
        for (index, key) in keys.enumerate() {
            let slot = slot(key.as_bytes());
            let node = node_of(slot).map_or_else(|| format!("slot {slot}"), str::to_owned);
            match by_node.get(&node) {
                Some(&group) => groups[group].1.push(index),
                None => {
                    by_node.insert(node, groups.len());
                    groups.push((slot, vec![index]));
                }
            }
        }
        groups
    }
}

/// `CLUSTER SLOTS`: `[start, end, [host, port, id, ...], replicas...]` per range.
fn parse_slots(reply: &Value) -> Option<Vec<Range>> {
    let Value::Array(ranges) = reply else {
        return None;
    };
    let mut parsed = Vec::with_capacity(ranges.len());
    for range in ranges {
        let Value::Array(fields) = range else {
            return None;
        };
        let number = |value: Option<&Value>| match value {
            Some(Value::Int(n)) => u16::try_from(*n).ok(),
            _ => None,
        };
        let (start, end) = (number(fields.first())?, number(fields.get(1))?);
        let Some(Value::Array(primary)) = fields.get(2) else {
            return None;
        };
        let host = match primary.first() {
            Some(Value::BulkString(host)) => String::from_utf8_lossy(host).into_owned(),
            Some(Value::SimpleString(host)) => host.clone(),
            _ => return None,
        };
        let port = match primary.get(1) {
            Some(Value::Int(port)) => *port,
            _ => return None,
        };
        parsed.push((start, end, format!("{host}:{port}")));
    }
    Some(parsed)
}

impl Conn {
    /// Sends `pipe`: to the server, or to the cluster node that serves `slot`.
    pub(super) async fn pipeline(
        &self,
        pipe: Pipeline,
        slot: u16,
    ) -> Result<Vec<Value>, RedisError> {
        match self.clone() {
            Conn::Single(mut conn) => pipe.query_async(&mut conn).await,
            // Boxed, as in `Conn::query`: following a failover is a large future.
            Conn::Sentinel(primary) => Box::pin(primary.pipeline(&pipe)).await,
            Conn::Cluster(mut conn) => {
                let count = pipe.len();
                let route = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
                conn.route_pipeline(pipe, 0, count, route).await
            }
        }
    }
}

/// Whether a pipelined reply is `NOSCRIPT`: the server does not have the script (a restart,
/// a failover, `SCRIPT FLUSH`).
pub(super) fn no_script(reply: &Value) -> bool {
    matches!(reply, Value::ServerError(err) if err.kind() == Some(ServerErrorKind::NoScript))
}

/// Whether a pipelined reply asks for the command to be sent again on its own: a script the
/// server does not have (`NOSCRIPT`; the single call loads it), or a key the node does not
/// serve (`MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`; the single call is routed by the
/// cluster client).
pub(super) fn send_again(reply: &Value) -> Option<bool> {
    let Value::ServerError(err) = reply else {
        return None;
    };
    let moved = matches!(
        err.kind(),
        Some(ServerErrorKind::Moved | ServerErrorKind::Ask)
    );
    matches!(
        err.kind(),
        Some(
            ServerErrorKind::NoScript
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
        )
    )
    .then_some(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_redis_cluster_slots() {
        assert_eq!(crc16(b"123456789"), 0x31c3);
        // `CLUSTER KEYSLOT foo` and `CLUSTER KEYSLOT bar`.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
        // The hash tag decides; an empty tag does not count.
        assert_eq!(slot(b"order:v1:{foo}"), slot(b"foo"));
        assert_eq!(slot(b"a{}b"), crc16(b"a{}b") % 16384);
        assert_eq!(slot(b"a{foo"), crc16(b"a{foo") % 16384);
    }

    #[test]
    fn slot_ranges_are_read_from_cluster_slots() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("10.0.0.1", 7000),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                node("10.0.0.2", 7001),
                node("10.0.0.3", 7002),
            ]),
        ]);
        assert_eq!(
            parse_slots(&reply).unwrap(),
            vec![
                (0, 5460, "10.0.0.1:7000".to_string()),
                (5461, 16383, "10.0.0.2:7001".to_string())
            ]
        );
        assert_eq!(parse_slots(&Value::Int(1)), None);
    }
}
