//! What [`Admin::list`](super::Admin::list) selects ([`ListQuery`], [`StateFilter`]) and
//! returns ([`ListPage`]).

use std::time::Duration;

use super::Inspection;
use crate::error::StoreError;
use crate::key::{Key, KeyError};
use crate::store::{RecordState, ScanCursor};

/// Which records [`Admin::list`](super::Admin::list) returns: the records of one key prefix, optionally of one
/// state and at least of some age.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::admin::{ListQuery, StateFilter};
///
/// // In progress for ten minutes or more: an owner that hangs, or one killed with a long lease.
/// let stuck = ListQuery::new("payment:capture")?
///     .state(StateFilter::InProgress)
///     .older_than(Duration::from_secs(600));
/// assert_eq!(stuck.prefix(), "payment:capture");
/// assert!(ListQuery::new("has space").is_err());
/// # Ok::<(), idempotent_runtime::KeyError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ListQuery {
    pub(super) prefix: String,
    state: Option<StateFilter>,
    older_than: Option<Duration>,
    pub(super) cursor: ScanCursor,
    pub(super) limit: usize,
}

/// The states [`ListQuery::state`] selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StateFilter {
    /// In progress (a live lease or one that ran out).
    InProgress,
    /// Completed, held ones included.
    Completed,
    /// Held: completed as failed with `on_error = hold`.
    Held,
    /// Released.
    Released,
    /// Values under the prefix's keys that are not records.
    Corrupt,
}

impl ListQuery {
    /// The records whose key has `prefix`, every state, from the start.
    ///
    /// # Errors
    ///
    /// The [`KeyError`] of a prefix that [`Key::new`] would refuse.
    pub fn new(prefix: &str) -> Result<ListQuery, KeyError> {
        // A prefix is valid exactly when a key can be built with it.
        Key::new(prefix, 1, &[&"-"])?;
        Ok(ListQuery {
            prefix: prefix.to_owned(),
            state: None,
            older_than: None,
            cursor: ScanCursor::start(),
            limit: 100,
        })
    }

    /// Only records in `state`.
    pub fn state(mut self, state: StateFilter) -> ListQuery {
        self.state = Some(state);
        self
    }

    /// Only records that have been in their state at least `age` ([`Record::age`](crate::store::Record::age)); records
    /// whose store does not keep their age (completed and released records on Redis) are
    /// left out.
    pub fn older_than(mut self, age: Duration) -> ListQuery {
        self.older_than = Some(age);
        self
    }

    /// Goes on where a previous page ended ([`ListPage::next`]).
    pub fn cursor(mut self, cursor: ScanCursor) -> ListQuery {
        self.cursor = cursor;
        self
    }

    /// About how many keys one page examines (1 to 10,000; 100 by default). A page holds at
    /// most about that many records, fewer when the filters leave some out.
    pub fn limit(mut self, limit: usize) -> ListQuery {
        self.limit = limit.clamp(1, 10_000);
        self
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(super) fn selects(&self, record: &Result<Inspection, StoreError>) -> bool {
        let Ok(seen) = record else {
            return matches!(self.state, None | Some(StateFilter::Corrupt));
        };
        let state = match self.state {
            None => true,
            Some(StateFilter::InProgress) => matches!(seen.state, RecordState::InProgress { .. }),
            Some(StateFilter::Completed) => seen.state == RecordState::Completed,
            Some(StateFilter::Held) => seen.held,
            Some(StateFilter::Released) => seen.state == RecordState::Released,
            Some(StateFilter::Corrupt) => false,
        };
        state
            && self
                .older_than
                .is_none_or(|min| seen.age.is_some_and(|age| age >= min))
    }
}

/// One page of [`Admin::list`](super::Admin::list).
#[derive(Debug)]
#[non_exhaustive]
pub struct ListPage {
    /// The records found, each with what it holds, or why it cannot be read (a value that is
    /// no record: [`StoreErrorKind::Corrupt`](crate::StoreErrorKind::Corrupt)).
    pub records: Vec<(Key, Result<Inspection, StoreError>)>,
    /// Where the listing goes on (pass it to [`ListQuery::cursor`]); `None` when it is over.
    pub next: Option<ScanCursor>,
}
