//! The operator's primitives of [`MemoryStore`]: reopening, deleting, scanning a shard.

use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::memory::shard::{lock, Entry, State};
use crate::store::memory::store::MemoryStore;
use crate::store::{BoxFuture, Expect, OperatorStore, ScanCursor, ScanPage, Token};

impl MemoryStore {
    fn reopen_now(&self, key: &Key, token: &Token) -> bool {
        let now = self.clock.now();
        let (mut shard, hash) = self.shard(key);
        match shard.live(key, hash, now) {
            Some(entry) if entry.token == *token => {
                entry.state = State::Released;
                entry.since = now;
                true
            }
            _ => false,
        }
    }

    fn delete_now(&self, key: &Key, token: &Token) -> bool {
        let now = self.clock.now();
        let (mut shard, hash) = self.shard(key);
        match shard.live(key, hash, now) {
            // A live claim is never deleted: its owner may be running.
            Some(entry)
                if entry.token == *token
                    && !matches!(entry.state, State::InProgress { lease_until } if lease_until > now) =>
            {
                shard.remove(key, hash);
                true
            }
            _ => false,
        }
    }

    /// One shard's live records under `prefix` after `after`, at most `limit`, in key order.
    fn scan_now(
        &self,
        prefix: &str,
        cursor: &ScanCursor,
        limit: usize,
    ) -> Result<ScanPage, StoreError> {
        let (index, after) = parse_cursor(cursor, self.shards.len())?;
        let now = self.clock.now();
        let shard = lock(&self.shards[index]);
        let mut found: Vec<(&Key, &Entry)> = shard
            .map
            .iter()
            .map(|slot| (&slot.key, &slot.entry))
            .filter(|(key, entry)| {
                entry.expires_at > now
                    && key.prefix() == prefix
                    && after.as_deref().is_none_or(|after| key.as_bytes() > after)
            })
            .collect();
        found.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let limit = limit.max(1);
        let more = found.len() > limit;
        found.truncate(limit);
        let next = match found.last() {
            Some((key, _)) if more => Some(ScanCursor::new(format!(
                "{index}:{}",
                crate::key::hex_string(key.as_bytes())
            ))),
            _ if index + 1 < self.shards.len() => Some(ScanCursor::new(format!("{}:", index + 1))),
            _ => None,
        };
        let records = found
            .into_iter()
            .map(|(key, entry)| (key.clone(), Ok(entry.record(now))))
            .collect();
        Ok(ScanPage::new(records, next))
    }
}

/// The shard and the last key of a memory scan's cursor (`<shard>:<hex key>`).
fn parse_cursor(
    cursor: &ScanCursor,
    shards: usize,
) -> Result<(usize, Option<Vec<u8>>), StoreError> {
    if cursor.is_start() {
        return Ok((0, None));
    }
    let bad = || {
        StoreError::new(
            StoreErrorKind::Rejected,
            format!("`{cursor}` is not a cursor of a memory store"),
        )
    };
    let (index, key) = cursor.as_str().split_once(':').ok_or_else(bad)?;
    let index: usize = index.parse().map_err(|_| bad())?;
    if index >= shards {
        return Err(bad());
    }
    let key = if key.is_empty() {
        None
    } else {
        Some(crate::key::parse_hex(key).ok_or_else(bad)?)
    };
    Ok((index, key))
}

impl OperatorStore for MemoryStore {
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let reopened = self.reopen_now(key, token);
        Box::pin(async move { Ok(reopened) })
    }

    /// One shard per page, in key order within it: a scan takes as many pages as the store
    /// has shards, at least.
    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        cursor: &'a ScanCursor,
        limit: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
        Box::pin(std::future::ready(self.scan_now(prefix, cursor, limit)))
    }

    /// Every record of this store is readable: `Expect::Corrupt` deletes nothing.
    fn delete<'a>(
        &'a self,
        key: &'a Key,
        expect: Expect<'a>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let deleted = match expect {
            Expect::Token(token) => self.delete_now(key, token),
            Expect::Corrupt => false,
        };
        Box::pin(std::future::ready(Ok(deleted)))
    }
}
