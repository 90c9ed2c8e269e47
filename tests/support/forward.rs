//! Forwarding for test wrappers over a real store, each of which intercepts a few calls and
//! passes the rest to its `inner` field unchanged:
//!
//! - `forward_store!(claim, release, ...)`, inside an `impl Store for Wrapper` block: the
//!   named [`Store`](idempotency::store::Store) methods, forwarded. Methods not named and not
//!   written in the block keep the trait's defaults.
//! - `forward_operator_store!(Wrapper)`: the whole
//!   [`OperatorStore`](idempotency::store::OperatorStore), forwarded.

/// The named [`Store`](idempotency::store::Store) methods, forwarded to `self.inner`: used
/// inside an `impl Store for Wrapper` block, beside the methods the wrapper intercepts.
#[macro_export]
macro_rules! forward_store {
    ($($method:ident),+ $(,)?) => {
        $($crate::forward_store!(@ $method);)+
    };
    (@ claim) => {
        fn claim<'a>(
            &'a self,
            req: &'a ::idempotency::store::ClaimRequest,
        ) -> ::idempotency::store::BoxFuture<
            'a,
            Result<::idempotency::store::Claim, ::idempotency::store::StoreError>,
        > {
            self.inner.claim(req)
        }
    };
    (@ claim_many) => {
        fn claim_many<'a>(
            &'a self,
            reqs: &'a [::idempotency::store::ClaimRequest],
        ) -> ::idempotency::store::BoxFuture<
            'a,
            Vec<Result<::idempotency::store::Claim, ::idempotency::store::StoreError>>,
        > {
            self.inner.claim_many(reqs)
        }
    };
    (@ complete) => {
        fn complete<'a>(
            &'a self,
            key: &'a ::idempotency::Key,
            token: &'a ::idempotency::store::Token,
            completion: &'a ::idempotency::store::Completion,
        ) -> ::idempotency::store::BoxFuture<'a, Result<bool, ::idempotency::store::StoreError>>
        {
            self.inner.complete(key, token, completion)
        }
    };
    (@ complete_many) => {
        fn complete_many<'a>(
            &'a self,
            items: &'a [::idempotency::store::Ending],
        ) -> ::idempotency::store::BoxFuture<
            'a,
            Vec<Result<bool, ::idempotency::store::StoreError>>,
        > {
            self.inner.complete_many(items)
        }
    };
    (@ release) => {
        fn release<'a>(
            &'a self,
            key: &'a ::idempotency::Key,
            token: &'a ::idempotency::store::Token,
        ) -> ::idempotency::store::BoxFuture<'a, Result<bool, ::idempotency::store::StoreError>>
        {
            self.inner.release(key, token)
        }
    };
    (@ release_acquired) => {
        fn release_acquired<'a>(
            &'a self,
            key: &'a ::idempotency::Key,
            token: &'a ::idempotency::store::Token,
            claim: &'a ::idempotency::store::AcquiredClaim,
        ) -> ::idempotency::store::BoxFuture<'a, Result<bool, ::idempotency::store::StoreError>>
        {
            self.inner.release_acquired(key, token, claim)
        }
    };
    (@ renew) => {
        fn renew<'a>(
            &'a self,
            key: &'a ::idempotency::Key,
            token: &'a ::idempotency::store::Token,
            lease: ::std::time::Duration,
        ) -> ::idempotency::store::BoxFuture<'a, Result<bool, ::idempotency::store::StoreError>>
        {
            self.inner.renew(key, token, lease)
        }
    };
    (@ is_completed) => {
        fn is_completed<'a>(
            &'a self,
            key: &'a ::idempotency::Key,
        ) -> ::idempotency::store::BoxFuture<'a, Result<bool, ::idempotency::store::StoreError>>
        {
            self.inner.is_completed(key)
        }
    };
    (@ read) => {
        fn read<'a>(
            &'a self,
            key: &'a ::idempotency::Key,
        ) -> ::idempotency::store::BoxFuture<
            'a,
            Result<Option<::idempotency::store::Record>, ::idempotency::store::StoreError>,
        > {
            self.inner.read(key)
        }
    };
    (@ claim_and_is_completed) => {
        fn claim_and_is_completed(
            self: ::std::sync::Arc<Self>,
            req: ::std::sync::Arc<::idempotency::store::ClaimRequest>,
            other: ::idempotency::Key,
        ) -> Option<
            ::idempotency::store::BoxFuture<
                'static,
                (
                    Result<::idempotency::store::Claim, ::idempotency::store::StoreError>,
                    Result<bool, ::idempotency::store::StoreError>,
                ),
            >,
        > {
            ::std::sync::Arc::clone(&self.inner).claim_and_is_completed(req, other)
        }
    };
    (@ max_result_size) => {
        fn max_result_size(&self) -> usize {
            self.inner.max_result_size()
        }
    };
    (@ name) => {
        fn name(&self) -> &'static str {
            self.inner.name()
        }
    };
}

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
