//! Matching a batch statement's rows to the batch's items by key: the items' keys are sorted
//! once (a batch comes sorted, which the sort only checks), and each row finds its item by
//! binary search. No hashing of the callers' keys per item, and nothing a client could aim
//! collisions at.

use crate::store::sql::record::Step;
use crate::store::{ClaimRequest, Ending};

/// What a batch statement returned for its items, matched to them by key (see the module
/// docs).
pub(crate) struct ByKey<'k, T> {
    /// The items' keys, in the items' order.
    keys: Vec<&'k [u8]>,
    /// The items' indices, sorted by key.
    order: Vec<usize>,
    found: Vec<Option<T>>,
}

impl<'k, T> ByKey<'k, T> {
    /// Nothing found yet for the items of `keys` (distinct keys: a batch statement's).
    pub(crate) fn new(keys: impl IntoIterator<Item = &'k [u8]>) -> ByKey<'k, T> {
        let keys: Vec<&[u8]> = keys.into_iter().collect();
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_by(|&a, &b| keys[a].cmp(keys[b]));
        let found = keys.iter().map(|_| None).collect();
        ByKey { keys, order, found }
    }

    /// Records `value` for the item of `key` (the last one recorded counts); a key of no
    /// item is ignored.
    pub(crate) fn insert(&mut self, key: &[u8], value: T) {
        let keys = &self.keys;
        if let Ok(at) = self.order.binary_search_by(|&i| keys[i].cmp(key)) {
            self.found[self.order[at]] = Some(value);
        }
    }

    /// The keys of the items nothing was found for, in the items' order.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn missing(&self) -> impl Iterator<Item = &'k [u8]> + '_ {
        self.keys
            .iter()
            .zip(&self.found)
            .filter(|(_, found)| found.is_none())
            .map(|(key, _)| *key)
    }

    /// What was found for each item, in the items' order.
    pub(crate) fn into_found(self) -> Vec<Option<T>> {
        self.found
    }
}

/// Each request's step from the steps found by key (a key not found: no record to report).
pub(crate) fn in_request_order(seen: ByKey<'_, Step>) -> Vec<Step> {
    seen.into_found()
        .into_iter()
        .map(|step| step.unwrap_or(Step::Seen(None)))
        .collect()
}

/// The keys of `items`, to match a batch statement's rows to.
pub(crate) fn claim_keys<'k>(reqs: &[&'k ClaimRequest]) -> ByKey<'k, Step> {
    ByKey::new(reqs.iter().map(|req| req.key.as_bytes()))
}

/// Whether each of `items` is among the keys a batch ending returned.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) fn ended_in_order(items: &[&Ending], ended: &[Vec<u8>]) -> Vec<bool> {
    let mut found = ByKey::new(items.iter().map(|item| item.key.as_bytes()));
    for key in ended {
        found.insert(key, ());
    }
    found
        .into_found()
        .into_iter()
        .map(|f| f.is_some())
        .collect()
}

/// The values a batch statement answered by position (from 1) for `len` items, in the items'
/// order (`None` for an item it did not answer): every item in order when `positions` is
/// `None`. A position out of range, or positions and values that do not pair, is an error.
#[cfg(feature = "postgres")]
pub(crate) fn by_position<T>(
    len: usize,
    positions: Option<Vec<i64>>,
    values: Vec<T>,
) -> Result<Vec<Option<T>>, sqlx::Error> {
    let positions =
        positions.unwrap_or_else(|| (1..=len).filter_map(|n| i64::try_from(n).ok()).collect());
    if positions.len() != values.len() {
        return Err(sqlx::Error::Decode(
            format!(
                "a batch statement answered {} positions for {} values",
                positions.len(),
                values.len()
            )
            .into(),
        ));
    }
    let mut answered: Vec<Option<T>> = (0..len).map(|_| None).collect();
    for (n, value) in positions.into_iter().zip(values) {
        let slot = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_sub(1))
            .and_then(|i| answered.get_mut(i))
            .ok_or_else(|| {
                sqlx::Error::Decode(
                    format!("a batch statement answered position {n} of {len}").into(),
                )
            })?;
        *slot = Some(value);
    }
    Ok(answered)
}

/// Which of `len` items a batch ending that answers by position ended (see
/// [`by_position`]).
#[cfg(feature = "postgres")]
pub(crate) fn ended_at(len: usize, ended: Option<Vec<i64>>) -> Result<Vec<bool>, sqlx::Error> {
    let values = vec![(); ended.as_ref().map_or(len, Vec::len)];
    Ok(by_position(len, ended, values)?
        .into_iter()
        .map(|ended| ended.is_some())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(feature = "postgres")]
    fn positions_say_which_items_ended() {
        assert_eq!(ended_at(3, None).unwrap(), [true, true, true]);
        assert_eq!(ended_at(3, Some(vec![3, 1])).unwrap(), [true, false, true]);
        assert_eq!(ended_at(2, Some(vec![])).unwrap(), [false, false]);
        for out_of_range in [0, -1, 3] {
            assert!(ended_at(2, Some(vec![out_of_range])).is_err());
        }
        assert_eq!(
            by_position(3, Some(vec![2]), vec!["b"]).unwrap(),
            [None, Some("b"), None]
        );
        assert_eq!(
            by_position(2, None, vec![7, 8]).unwrap(),
            [Some(7), Some(8)]
        );
        assert!(by_position(2, None, vec![7]).is_err());
        assert!(by_position(2, Some(vec![1, 2]), vec![7]).is_err());
    }

    #[test]
    fn rows_find_their_items_by_key_in_any_order() {
        let keys: [&[u8]; 4] = [b"k:3", b"k:1", b"k:4", b"k:2"];
        let mut found = ByKey::new(keys);
        found.insert(b"k:4", 40);
        found.insert(b"k:9", 90); // no such item: ignored
        found.insert(b"k:3", 30);
        found.insert(b"k:3", 31); // the last one counts
        assert_eq!(found.missing().collect::<Vec<_>>(), [&b"k:1"[..], b"k:2"]);
        assert_eq!(found.into_found(), [Some(31), None, Some(40), None]);
        let none: ByKey<'_, ()> = ByKey::new(std::iter::empty());
        assert!(none.into_found().is_empty());
    }
}
