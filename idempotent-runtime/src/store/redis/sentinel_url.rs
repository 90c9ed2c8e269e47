//! `redis+sentinel://` URLs: the sentinels, the service, the primary's database and
//! credentials.

use crate::error::{StoreError, StoreErrorKind};

/// Where a Sentinel deployment is, as a `redis+sentinel://` URL gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SentinelTarget {
    /// The sentinels, as `redis://host:port` URLs.
    pub(super) sentinels: Vec<String>,
    /// The service (master) name the sentinels monitor.
    pub(super) service: String,
    /// The database on the primary.
    pub(super) db: i64,
    /// Credentials for the primary (`user`, `password`).
    pub(super) username: Option<String>,
    pub(super) password: Option<String>,
}

/// Parses `redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]`;
/// `None` for another scheme, an error for a malformed Sentinel URL.
pub(super) fn sentinel_target(url: &str) -> Option<Result<SentinelTarget, StoreError>> {
    let rest = url.strip_prefix("redis+sentinel://")?;
    let bad = |why: &str| {
        StoreError::new(
            StoreErrorKind::Rejected,
            format!(
                "invalid Sentinel URL ({why}): expected \
                 `redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]`"
            ),
        )
    };
    Some((|| {
        let (authority, path) = rest.split_once('/').ok_or_else(|| bad("no service name"))?;
        let (credentials, hosts) = match authority.rsplit_once('@') {
            Some((credentials, hosts)) => (Some(credentials), hosts),
            None => (None, authority),
        };
        let (username, password) = match credentials {
            None => (None, None),
            Some(c) => match c.split_once(':') {
                Some((user, password)) => (
                    Some(user).filter(|u| !u.is_empty()).map(decode),
                    Some(decode(password)),
                ),
                None => (Some(decode(c)), None),
            },
        };
        let sentinels: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| {
                if h.contains(':') {
                    format!("redis://{h}")
                } else {
                    format!("redis://{h}:26379")
                }
            })
            .collect();
        if sentinels.is_empty() {
            return Err(bad("no sentinel address"));
        }
        let mut parts = path.splitn(2, '/');
        let service = parts.next().unwrap_or_default();
        if service.is_empty() {
            return Err(bad("no service name"));
        }
        let db = match parts.next().filter(|d| !d.is_empty()) {
            None => 0,
            Some(d) => d.parse().map_err(|_| bad("the database is not a number"))?,
        };
        Ok(SentinelTarget {
            sentinels,
            service: decode(service),
            db,
            username,
            password,
        })
    })())
}

/// Percent-decodes a URL part (`%40` for `@` in a password).
fn decode(part: &str) -> String {
    let bytes = part.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                let (h, l) = (hex(h).unwrap_or(0), hex(l).unwrap_or(0));
                out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_name_their_sentinels_service_and_database() {
        let t = sentinel_target("redis+sentinel://a:26379,b:26380,c/orders/2")
            .unwrap()
            .unwrap();
        assert_eq!(
            t.sentinels,
            ["redis://a:26379", "redis://b:26380", "redis://c:26379"]
        );
        assert_eq!((t.service.as_str(), t.db), ("orders", 2));
        assert_eq!((t.username, t.password), (None, None));

        let t = sentinel_target("redis+sentinel://app:p%40ss@a:1/main")
            .unwrap()
            .unwrap();
        assert_eq!(t.username.as_deref(), Some("app"));
        assert_eq!(t.password.as_deref(), Some("p@ss"));
        let t = sentinel_target("redis+sentinel://:secret@a:1/main")
            .unwrap()
            .unwrap();
        assert_eq!((t.username, t.password.as_deref()), (None, Some("secret")));

        assert!(sentinel_target("redis://a:1").is_none());
        for bad in [
            "redis+sentinel://a:1",
            "redis+sentinel://a:1/",
            "redis+sentinel:///main",
            "redis+sentinel://a:1/main/x",
        ] {
            let err = sentinel_target(bad).unwrap().unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::Rejected, "{bad}");
        }
    }
}
