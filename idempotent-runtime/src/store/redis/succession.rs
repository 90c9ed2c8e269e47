//! Whether a replica took over from the primary the sentinels name: the check that closes a
//! failover's window when the leading sentinel's answer is lost.
//!
//! While a failover is under way, the sentinels that have not heard of it name the old
//! primary. The leading sentinel's answer says a failover is under way, but it may be lost
//! (its connection refused, its reply late). The replicas tell it too: the one the leader
//! promoted answers `role:master`, and its previous replication history
//! (`master_replid2`) is the old primary's current one (`master_replid`). So before a primary
//! is confirmed, every replica the sentinels list is asked (`INFO replication`, once the
//! primary has answered, so that no replica's answer is older than the primary's):
//!
//! - a replica that answers as a master vetoes the primary, unless the primary's previous
//!   history is that replica's current one (the primary took over from it: the replica is
//!   the old primary of a failover that has ended, not yet demoted);
//! - a replica that does not answer vetoes the primary (it may be the promoted one), unless
//!   every sentinel that lists it sees it down or disconnected: the leader promotes only a
//!   replica it reaches, and a replica no sentinel reaches is most likely gone.
//!
//! A veto fails the lookup closed (`Unavailable`): calls fail until the failover ends and the
//! sentinels name the new primary.

use std::collections::HashMap;

use ::redis::{Client, ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo, Value};

/// A replica a sentinel lists, and whether that sentinel sees it down or disconnected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Listed {
    pub(super) addr: (String, u16),
    pub(super) down: bool,
}

/// The replicas of a `SENTINEL REPLICAS` reply (each a flat list or a map of fields).
pub(super) fn listed(reply: &Value, text: fn(&Value) -> String) -> Vec<Listed> {
    let Value::Array(entries) = reply else {
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|entry| {
            let fields = fields(entry, text)?;
            let field = |name: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.as_str())
            };
            let ip = field("ip")?;
            let port = field("port")?.parse().ok()?;
            let flags = field("flags").unwrap_or_default();
            let down = flags
                .split(',')
                .any(|f| matches!(f, "s_down" | "o_down" | "disconnected"));
            Some(Listed {
                addr: (ip.to_owned(), port),
                down,
            })
        })
        .collect()
}

/// The fields of one entry of a sentinel's reply (a flat list of names and values, or a
/// map), or `None` for another kind of value.
pub(super) fn fields(entry: &Value, text: fn(&Value) -> String) -> Option<Vec<(String, String)>> {
    match entry {
        Value::Array(items) => Some(
            items
                .chunks(2)
                .filter_map(|pair| Some((text(pair.first()?), text(pair.get(1)?))))
                .collect(),
        ),
        Value::Map(entries) => Some(entries.iter().map(|(k, v)| (text(k), text(v))).collect()),
        _ => None,
    }
}

/// The replicas to ask: every replica some sentinel lists, but the primary itself and those
/// every sentinel that lists them sees down.
pub(super) fn to_ask<'a>(
    lists: impl IntoIterator<Item = &'a [Listed]>,
    primary: &(String, u16),
) -> Vec<(String, u16)> {
    // For each address: whether every sentinel listing it sees it down.
    let mut down: HashMap<&(String, u16), bool> = HashMap::new();
    let mut order = Vec::new();
    for list in lists {
        for replica in list {
            let entry = down.entry(&replica.addr).or_insert_with(|| {
                order.push(&replica.addr);
                true
            });
            *entry &= replica.down;
        }
    }
    order
        .into_iter()
        .filter(|addr| *addr != primary && !down.get(addr).copied().unwrap_or(true))
        .cloned()
        .collect()
}

/// A node's `INFO replication`, as far as the check needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Replication {
    pub(super) master: bool,
    /// `master_replid`: the node's current replication history.
    pub(super) id: String,
    /// `master_replid2`: the history it had before it was last promoted (all zeros if none).
    pub(super) previous: String,
}

impl Replication {
    /// Reads an `INFO replication` reply.
    pub(super) fn parse(info: &str) -> Option<Replication> {
        let field = |name: &str| {
            info.lines().find_map(|line| {
                let (key, value) = line.trim_end().split_once(':')?;
                (key == name).then_some(value)
            })
        };
        Some(Replication {
            master: field("role")? == "master",
            id: field("master_replid")?.to_owned(),
            previous: field("master_replid2").unwrap_or_default().to_owned(),
        })
    }
}

/// Why `primary` must not be confirmed, given what each replica answered (`None`: no
/// answer), or `None` when nothing speaks against it.
pub(super) fn veto(
    primary: &Replication,
    replicas: &[((String, u16), Option<Replication>)],
) -> Option<String> {
    replicas.iter().find_map(|((host, port), answer)| match answer {
        None => Some(format!(
            "its replica {host}:{port}, which a sentinel reaches, did not answer: it may have been promoted by a failover under way"
        )),
        Some(replica) if replica.master && primary.previous != replica.id => Some(format!(
            "its replica {host}:{port} answers as a primary: a failover is under way"
        )),
        Some(_) => None,
    })
}

/// A client for the node at `addr`, with the primary's database and credentials.
pub(super) fn client(
    addr: &(String, u16),
    node: &RedisConnectionInfo,
) -> Result<Client, ::redis::RedisError> {
    ConnectionAddr::Tcp(addr.0.clone(), addr.1)
        .into_connection_info()
        .map(|info| info.set_redis_settings(node.clone()))
        .and_then(Client::open)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> (String, u16) {
        ("10.0.0.1".to_owned(), port)
    }

    fn node(master: bool, id: &str, previous: &str) -> Replication {
        Replication {
            master,
            id: id.to_owned(),
            previous: previous.to_owned(),
        }
    }

    const NONE: &str = "0000000000000000000000000000000000000000";

    #[test]
    fn info_replication_is_read() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:1\r\n\
                    master_replid:abc\r\nmaster_replid2:def\r\nmaster_repl_offset:10\r\n";
        assert_eq!(Replication::parse(info), Some(node(true, "abc", "def")));
        let info = "# Replication\r\nrole:slave\r\nmaster_host:h\r\nmaster_replid:abc\r\n";
        assert_eq!(Replication::parse(info), Some(node(false, "abc", "")));
        assert_eq!(Replication::parse("role:master\r\n"), None);
    }

    #[test]
    fn replicas_that_follow_the_primary_do_not_veto_it() {
        let primary = node(true, "p", NONE);
        let replicas = [(addr(2), Some(node(false, "p", NONE)))];
        assert_eq!(veto(&primary, &replicas), None);
        assert_eq!(veto(&primary, &[]), None);
    }

    #[test]
    fn a_promoted_replica_vetoes_the_old_primary() {
        // The replica was promoted: its previous history is the old primary's current one.
        let old_primary = node(true, "p", NONE);
        let replicas = [
            (addr(2), Some(node(false, "p", NONE))),
            (addr(3), Some(node(true, "r", "p"))),
        ];
        let why = veto(&old_primary, &replicas).unwrap();
        assert!(why.contains("10.0.0.1:3"), "{why}");
    }

    #[test]
    fn an_old_primary_not_yet_demoted_does_not_veto_its_successor() {
        // The new primary took over from it: its previous history is the old one's current.
        let new_primary = node(true, "r", "p");
        let replicas = [(addr(1), Some(node(true, "p", NONE)))];
        assert_eq!(veto(&new_primary, &replicas), None);
    }

    #[test]
    fn a_master_of_another_history_vetoes() {
        // Restarted, or promoted by hand: nothing shows which of the two is the primary.
        let primary = node(true, "r", "p");
        let replicas = [(addr(1), Some(node(true, "q", NONE)))];
        assert!(veto(&primary, &replicas).is_some());
    }

    #[test]
    fn a_replica_that_does_not_answer_vetoes() {
        let primary = node(true, "p", NONE);
        let replicas = [(addr(2), None)];
        assert!(veto(&primary, &replicas).is_some());
    }

    #[test]
    fn replicas_every_sentinel_sees_down_are_not_asked() {
        let listed = |port, down| Listed {
            addr: addr(port),
            down,
        };
        let a = [listed(1, false), listed(2, true), listed(3, true)];
        let b = [listed(2, true), listed(3, false), listed(4, false)];
        // 1: the primary itself; 2: down for both; 3: one sentinel reaches it; 4: listed once.
        assert_eq!(to_ask([&a[..], &b[..]], &addr(1)), vec![addr(3), addr(4)]);
    }

    #[test]
    fn sentinel_replicas_replies_are_read() {
        let text = |v: &Value| match v {
            Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            _ => String::new(),
        };
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let entry = |ip: &str, port: &str, flags: &str| {
            Value::Array(vec![
                bulk("name"),
                bulk("x"),
                bulk("ip"),
                bulk(ip),
                bulk("port"),
                bulk(port),
                bulk("flags"),
                bulk(flags),
            ])
        };
        let reply = Value::Array(vec![
            entry("10.0.0.1", "2", "slave"),
            entry("10.0.0.1", "3", "s_down,slave,disconnected"),
            entry("10.0.0.1", "not a port", "slave"),
        ]);
        assert_eq!(
            listed(&reply, text),
            vec![
                Listed {
                    addr: addr(2),
                    down: false
                },
                Listed {
                    addr: addr(3),
                    down: true
                },
            ]
        );
        assert!(listed(&Value::Nil, text).is_empty());
    }
}
