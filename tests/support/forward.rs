//! `forward_operator_store!(Wrapper)`: the operator's calls of a test wrapper that only
//! intercepts [`Store`](idempotency::store::Store) calls, forwarded to its `inner` field
//! unchanged.

/// Implements [`OperatorStore`](idempotency::store::OperatorStore) for `$wrapper` by
/// forwarding every call to `self.inner`.
#[macro_export]
macro_rules! forward_operator_store {
    ($wrapper:ty) => {
        impl ::idempotency::store::OperatorStore for $wrapper {
            fn reopen<'a>(
                &'a self,
                key: &'a ::idempotency::Key,
                token: &'a ::idempotency::store::Token,
            ) -> ::idempotency::store::BoxFuture<'a, Result<bool, ::idempotency::store::StoreError>>
            {
                self.inner.reopen(key, token)
            }
            fn scan<'a>(
                &'a self,
                prefix: &'a str,
                cursor: &'a ::idempotency::store::ScanCursor,
                limit: usize,
            ) -> ::idempotency::store::BoxFuture<
                'a,
                Result<::idempotency::store::ScanPage, ::idempotency::store::StoreError>,
            > {
                self.inner.scan(prefix, cursor, limit)
            }
            fn delete<'a>(
                &'a self,
                key: &'a ::idempotency::Key,
                expect: ::idempotency::store::Expect<'a>,
            ) -> ::idempotency::store::BoxFuture<'a, Result<bool, ::idempotency::store::StoreError>>
            {
                self.inner.delete(key, expect)
            }
        }
    };
}
