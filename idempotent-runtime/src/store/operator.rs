//! [`OperatorStore`]: what an operator's tools need of a store on top of the engine's
//! [`Store`]: reopening a held record, listing the records of a prefix, deleting a record.
//!
//! The engine never calls these methods; [`Admin`](crate::admin::Admin) (and the
//! `idempotent-admin` command line built on it) does, and so do the layered stores that pass
//! an operator's calls on ([`TieredStore`](super::TieredStore),
//! [`CombiningStore`](super::CombiningStore)). A store that implements only [`Store`] serves
//! handlers; an operator can use it once it implements [`OperatorStore`] too, which the
//! compiler checks where the store is handed to [`Admin::new`](crate::admin::Admin::new).
//! Every store of this crate implements both.

use std::fmt;
use std::sync::Arc;

use crate::error::StoreError;
use crate::key::Key;
use crate::store::{BoxFuture, IntoStore, Record, SharedStore, Store, Token};

/// The operator's primitives of a store, beyond the engine's [`Store`]: each one atomic,
/// owner-checked operation on the store, as the [`Store`] methods are.
///
/// [`Admin`](crate::admin::Admin) requires it, and so do [`TieredStore`](super::TieredStore)
/// and [`CombiningStore`](super::CombiningStore) for the stores they wrap. A store author
/// implements [`Store`] for the engine and this trait for the operator; the conformance suite
/// in the repository's `tests/` checks both.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idempotent_runtime::store::{OperatorStore, ScanCursor};
/// use idempotent_runtime::{ClaimRequest, Key, MemoryStore, Store, Token};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// let key = Key::new("doc", 1, &[&"a"])?;
/// let hour = Duration::from_secs(3600);
/// store.claim(&ClaimRequest::new(key.clone(), Token::generate(), hour, hour)).await?;
///
/// // Every record of the prefix, a page at a time.
/// let mut cursor = ScanCursor::start();
/// let mut found = Vec::new();
/// loop {
///     let page = store.scan("doc", &cursor, 100).await?;
///     found.extend(page.records.into_iter().map(|(key, _)| key));
///     match page.next {
///         Some(next) => cursor = next,
///         None => break,
///     }
/// }
/// assert_eq!(found, vec![key]);
/// # Ok(()) }
/// ```
pub trait OperatorStore: Store + upcast::Upcast {
    /// Makes the record `Released` (keeping its fence, dropping a stored result) if `token`
    /// is still the record's, whatever its state, so the next claim acquires the key with the
    /// next fence. Returns `false`, changing nothing, when the record is gone or has another
    /// token. [`Admin::unhold`](crate::admin::Admin::unhold) calls it.
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// One page of the live records whose key has `prefix`, starting at `cursor`
    /// ([`ScanCursor::start`] for the first page), examining about `limit` keys. Pages may be
    /// short or empty while the scan goes on; the scan is over when [`ScanPage::next`] is
    /// `None`. Every record live for the whole scan is returned at least once (Redis may
    /// return one twice); records written or removed during it may or may not be. A value
    /// under a matching key that is not a record is returned with its
    /// [`StoreErrorKind::Corrupt`](crate::StoreErrorKind::Corrupt) error.
    /// [`Admin::list`](crate::admin::Admin::list) and
    /// [`Admin::purge`](crate::admin::Admin::purge) call it.
    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        cursor: &'a ScanCursor,
        limit: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>>;

    /// Removes the value under `key` if it still is what `expect` says (a record with that
    /// token, or a value that is not a record at all), so the key is as if it was never
    /// claimed. Returns `false`, changing nothing, otherwise.
    /// [`Admin::delete`](crate::admin::Admin::delete) and
    /// [`Admin::purge`](crate::admin::Admin::purge) call it.
    ///
    /// An in-progress record whose lease has not run out is never deleted, whatever its
    /// token: the store checks the lease at the moment of the delete, in the same atomic
    /// step, so an owner that renewed after the operator read its record (a stalled process
    /// that resumed) keeps its claim and no second owner can acquire the key while it runs.
    fn delete<'a>(
        &'a self,
        key: &'a Key,
        expect: Expect<'a>,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
}

/// A store shared by an operator's tools: a [`SharedStore`] with the [`OperatorStore`]
/// methods. [`connect`](super::connect) returns one; [`IntoStore`] turns it into a
/// [`SharedStore`] for handlers.
///
/// ```
/// use std::sync::Arc;
/// use idempotent_runtime::store::SharedOperatorStore;
/// use idempotent_runtime::{IntoStore, MemoryStore, SharedStore};
///
/// let store: SharedOperatorStore = Arc::new(MemoryStore::new());
/// let for_handlers: SharedStore = store.clone().into_store();
/// # let _ = for_handlers;
/// ```
pub type SharedOperatorStore = Arc<dyn OperatorStore>;

mod upcast {
    use std::sync::Arc;

    use crate::store::{SharedStore, Store};

    /// A shared store as a plain [`SharedStore`]: what trait-object upcasting does on Rust
    /// 1.86 and later, for the crate's minimum supported Rust. Implemented for every store.
    pub trait Upcast {
        /// `self` as a [`SharedStore`].
        fn upcast(self: Arc<Self>) -> SharedStore;
    }

    impl<S: Store> Upcast for S {
        fn upcast(self: Arc<Self>) -> SharedStore {
            self
        }
    }
}

/// A shared operator's store is a shared store: the same store, without the operator's
/// methods.
impl IntoStore for SharedOperatorStore {
    fn into_store(self) -> SharedStore {
        upcast::Upcast::upcast(self)
    }
}

/// Converts a store handle into a [`SharedOperatorStore`]. Implemented for `Arc<S>` of any
/// [`OperatorStore`], for [`SharedOperatorStore`] itself, and for references to either.
///
/// ```
/// use std::sync::Arc;
/// use idempotent_runtime::store::{IntoOperatorStore, SharedOperatorStore};
/// use idempotent_runtime::MemoryStore;
///
/// let store = Arc::new(MemoryStore::new());
/// let shared: SharedOperatorStore = (&store).into_operator_store();
/// # let _ = shared;
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a handle of a store with the operator's methods",
    note = "pass an `Arc` of a store that implements `OperatorStore` (every store of this crate does), e.g. `Arc<MemoryStore>` or `idempotency::store::SharedOperatorStore`"
)]
pub trait IntoOperatorStore {
    /// The shared handle.
    fn into_operator_store(self) -> SharedOperatorStore;
}

impl<S: OperatorStore> IntoOperatorStore for Arc<S> {
    fn into_operator_store(self) -> SharedOperatorStore {
        self
    }
}

impl IntoOperatorStore for SharedOperatorStore {
    fn into_operator_store(self) -> SharedOperatorStore {
        self
    }
}

impl<T: IntoOperatorStore + Clone> IntoOperatorStore for &T {
    fn into_operator_store(self) -> SharedOperatorStore {
        self.clone().into_operator_store()
    }
}

/// Forwards every method of [`OperatorStore`] through a pointer to a store.
macro_rules! forward_operator_store {
    ($(#[$doc:meta])* impl<S> OperatorStore for $ty:ty) => {
        $(#[$doc])*
        impl<S: OperatorStore + ?Sized> OperatorStore for $ty {
            fn reopen<'a>(
                &'a self,
                key: &'a Key,
                token: &'a Token,
            ) -> BoxFuture<'a, Result<bool, StoreError>> {
                (**self).reopen(key, token)
            }
            fn scan<'a>(
                &'a self,
                prefix: &'a str,
                cursor: &'a ScanCursor,
                limit: usize,
            ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
                (**self).scan(prefix, cursor, limit)
            }
            fn delete<'a>(
                &'a self,
                key: &'a Key,
                expect: Expect<'a>,
            ) -> BoxFuture<'a, Result<bool, StoreError>> {
                (**self).delete(key, expect)
            }
        }
    };
}

forward_operator_store!(
    /// A shared operator's store is an operator's store.
    impl<S> OperatorStore for Arc<S>
);
forward_operator_store!(
    /// A boxed operator's store is an operator's store.
    impl<S> OperatorStore for Box<S>
);
forward_operator_store!(
    /// A reference to an operator's store that lives for the whole program is an operator's
    /// store.
    impl<S> OperatorStore for &'static S
);

/// What [`OperatorStore::delete`] expects under the key before it removes it.
///
/// ```
/// use idempotent_runtime::store::Expect;
/// use idempotent_runtime::Token;
///
/// let token = Token::generate();
/// assert_ne!(Expect::Token(&token), Expect::Corrupt);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Expect<'a> {
    /// A record whose token is this one: completed, released, or in progress with a lease
    /// that has run out (a live claim is never deleted).
    Token(&'a Token),
    /// A value that is not a record
    /// ([`StoreErrorKind::Corrupt`](crate::StoreErrorKind::Corrupt) when read).
    Corrupt,
}

/// Where an [`OperatorStore::scan`] goes on: opaque text, printable and parsable so that a
/// tool can hand it back later (`idempotent-admin list --cursor`).
///
/// ```
/// use idempotent_runtime::store::ScanCursor;
///
/// let start = ScanCursor::start();
/// assert!(start.is_start());
/// let again: ScanCursor = start.to_string().parse().unwrap();
/// assert_eq!(again, start);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct ScanCursor(String);

impl ScanCursor {
    /// The beginning of a scan.
    pub fn start() -> ScanCursor {
        ScanCursor(String::new())
    }

    /// A position a store wrote itself: for third-party stores implementing
    /// [`OperatorStore::scan`].
    pub fn new(position: impl Into<String>) -> ScanCursor {
        ScanCursor(position.into())
    }

    /// Whether this is the beginning of a scan.
    pub fn is_start(&self) -> bool {
        self.0.is_empty() || self.0 == "0"
    }

    /// The position, as the store wrote it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ScanCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("0")
        } else {
            f.write_str(&self.0)
        }
    }
}

impl std::str::FromStr for ScanCursor {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<ScanCursor, Self::Err> {
        Ok(if s == "0" {
            ScanCursor::start()
        } else {
            ScanCursor(s.to_owned())
        })
    }
}

/// One page of [`OperatorStore::scan`].
///
/// ```
/// use idempotent_runtime::store::ScanPage;
///
/// // The last page of a scan that found nothing more.
/// let page = ScanPage::new(Vec::new(), None);
/// assert!(page.records.is_empty() && page.next.is_none());
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct ScanPage {
    /// The keys found, each with its record or why it could not be read.
    pub records: Vec<(Key, Result<Record, StoreError>)>,
    /// Where the scan goes on; `None` when it is over.
    pub next: Option<ScanCursor>,
}

impl ScanPage {
    /// A page: for third-party stores implementing [`OperatorStore::scan`].
    pub fn new(
        records: Vec<(Key, Result<Record, StoreError>)>,
        next: Option<ScanCursor>,
    ) -> ScanPage {
        ScanPage { records, next }
    }
}
