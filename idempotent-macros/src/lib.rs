//! The `#[idempotent]` attribute. Use it through the `idempotent` crate, which re-exports it
//! together with the runtime the generated code calls.

mod args;
mod expand;
mod validate;

use proc_macro::TokenStream;

/// Makes an `async fn` handler run at most once per business key: exactly-once effects for
/// message consumers and HTTP handlers.
///
/// ```ignore
/// use idempotency::idempotent;
///
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.activity_id], ttl = 3600)]
/// async fn on_order(msg: &OrderMessage) -> Result<Receipt, AppError> {
///     // runs at most once per (order_id, activity_id), however often the broker delivers
///     apply(msg).await
/// }
/// ```
///
/// The handler keeps its signature, visibility, generics and attributes; it works on free
/// functions and on methods (`&self`, `&mut self`, `self`). It must be an `async fn` that
/// returns `Result<T, E>` where `E: From<idempotency::Error>`: every outcome that is not the
/// handler's own result arrives as an ordinary `Err`, which a consumer maps to ack, nack or
/// dead-letter with `idempotency::Error::action`.
///
/// # What a call does
///
/// 1. **Claim** the key (`prefix`, `version` and the `keys` values, encoded without
///    ambiguity) in one atomic store operation. The store is `store = ...` if given, or the
///    process default set with `idempotency::set_default_store`.
/// 2. **Run** the body if the claim was acquired, renewing the claim's lease while it runs.
/// 3. **Complete** the record on `Ok` (kept `ttl` seconds), or apply the `on_error` policy on
///    `Err` (by default, **release** the claim so a redelivery runs the handler again).
///
/// A **duplicate** (the key was completed) does not run the body and returns
/// `idempotency::Error::Duplicate`, or with `replay` the first run's `Ok` value. A call that
/// meets a **live claim** of another owner follows `on_in_progress`. A **store failure**
/// follows `on_store_error`. Dropping the handler's future before the body finished gives the
/// claim back; once the body returned, its outcome is recorded (retried in the background if
/// the store fails) and the claim is never given back.
///
/// Inside the body, `idempotency::current()` returns the claim: its key, its **fence** (pass it
/// to the resource: `UPDATE ... SET ..., fence = $f WHERE id = $id AND fence < $f` refuses a
/// stale owner) and a signal that resolves if the lease is lost.
///
/// # Arguments
///
/// Comma-separated, in any order. `prefix`, `keys` and `ttl` are required.
///
/// ## `prefix = "..."` (required)
///
/// The readable start of every key of this handler, shown by `SCAN` or `LIKE`. A non-empty
/// string literal of at most 128 bytes, without braces, white space or control characters.
///
/// ```ignore
/// #[idempotent(prefix = "payment:capture", keys = [req.payment_id], ttl = 86400)]
/// ```
///
/// ## `keys = [...]` (required)
///
/// The smallest business unit of idempotency: 1 to 16 parameters or field paths of
/// parameters (`msg`, `msg.order_id`, `msg.meta.tenant`, `self.tenant`, `pair.0`), borrowed
/// when the handler is called. Each one's type must implement `idempotency::KeyPart`
/// (strings, byte strings, integers, `bool`, `char`, and references to them, or your own
/// identifier types). Key on the business operation (order and activity), not on a message
/// id that a producer's retry changes.
///
/// ```ignore
/// #[idempotent(prefix = "coupon:redeem", keys = [self.tenant, req.coupon, req.user_id], ttl = 600)]
/// async fn redeem(&self, req: &Redeem) -> Result<(), AppError> { /* ... */ }
/// ```
///
/// ## `ttl = N` (required)
///
/// How many seconds a completed record is kept: duplicates arriving within it are caught.
/// A whole number greater than zero.
///
/// ```ignore
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600)]
/// ```
///
/// ## `lease = N`
///
/// How many seconds a claim lives without renewal; the runtime renews it every third of it
/// while the body runs, so a crashed owner's claim is taken over after at most `lease`.
/// Shorter than `ttl`. Defaults to 30 seconds or a third of `ttl`, whichever is shorter.
/// `ttl` and `lease` lie between 1 second and 36,500 days.
///
/// ```ignore
/// #[idempotent(prefix = "report:build", keys = [job.id], ttl = 86400, lease = 120)]
/// ```
///
/// ## `version = N`
///
/// Part of every key, 1 by default. Bump it when you change what a key means (its prefix or
/// its parts), so the change is deliberate rather than a silent loss of deduplication.
///
/// ```ignore
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.line], ttl = 3600, version = 2)]
/// ```
///
/// ## `store = <expression>`
///
/// The store to use, evaluated on every call and borrowed (it must implement
/// `idempotency::IntoStore + Clone`; an `Arc` of a store is cheap to clone). Without it the
/// process default is used.
///
/// ```ignore
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600, store = self.store)]
/// ```
///
/// ## `on_in_progress = reject | skip | wait(N)`
///
/// What a call does when another owner holds a live claim on the key:
///
/// - `reject` (the default): return `idempotency::Error::InProgress`, so the broker
///   redelivers the message later;
/// - `skip`: return `idempotency::Error::Skipped`, which a consumer acknowledges;
/// - `wait(N)`: wait up to `N` seconds for the owner to finish, then behave as for a
///   completed key (or claim the key if the owner gave it up).
///
/// ```ignore
/// #[idempotent(prefix = "http:order", keys = [req.key], ttl = 86400, on_in_progress = wait(10), replay)]
/// ```
///
/// ## `on_store_error = fail_closed | fail_open`
///
/// What a call does when the store fails before the body ran: `fail_closed` (the default)
/// returns `idempotency::Error::Store` without running the body, so the message is
/// redelivered; `fail_open` runs the body unguarded.
///
/// ```ignore
/// #[idempotent(prefix = "cache:warm", keys = [key], ttl = 60, on_store_error = fail_open)]
/// ```
///
/// ## `on_error = release | hold | store | <path>`
///
/// What happens to the claim when the body returns `Err`:
///
/// - `release` (the default): give the claim back, so a redelivery runs the body again;
/// - `hold`: keep the key blocked; duplicates get `idempotency::Error::Held` until the record
///   expires or an operator clears it;
/// - `store`: store the error and return it to duplicates (the error type must implement
///   `serde::Serialize` and `serde::de::DeserializeOwned`);
/// - a path to a `fn(&E) -> idempotency::OnError`, to decide per error.
///
/// ```ignore
/// fn classify(error: &AppError) -> idempotency::OnError {
///     match error {
///         AppError::Timeout => idempotency::OnError::Hold,
///         _ => idempotency::OnError::Release,
///     }
/// }
///
/// #[idempotent(prefix = "payment:capture", keys = [req.payment_id], ttl = 86400, on_error = classify)]
/// ```
///
/// ## `fingerprint = [...]`
///
/// Parameters or field paths (as in `keys`) that describe the payload. A duplicate key with
/// a different fingerprint fails with `idempotency::Error::PayloadMismatch` instead of being
/// treated as the same operation.
///
/// ```ignore
/// #[idempotent(prefix = "payment:capture", keys = [req.payment_id], ttl = 86400, fingerprint = [req.amount, req.currency])]
/// ```
///
/// ## `done = <call>`
///
/// A business-status check: an expression evaluated to a future whose output is
/// `Result<bool, D>`, where `E: From<D>`. It may borrow the parameters. After a claim is
/// acquired, and when a call meets a live claim, the runtime asks it whether the effect is
/// already applied; `Ok(true)` completes the record and skips the body. This keeps effects
/// exactly-once even when the store lost its data.
///
/// ```ignore
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600, done = self.orders.is_consumed(&msg.order_id))]
/// ```
///
/// ## `replay`
///
/// Store the first run's `Ok` value and return it to duplicates instead of
/// `idempotency::Error::Duplicate`. `T` must implement `serde::Serialize` and
/// `serde::de::DeserializeOwned`.
///
/// ```ignore
/// #[idempotent(prefix = "http:create-order", keys = [req.idempotency_key], ttl = 86400, replay)]
/// async fn create_order(req: &CreateOrder) -> Result<OrderCreated, ApiError> { /* ... */ }
/// ```
///
/// ## `crate = path`
///
/// Where the runtime is, when it is not at `::idempotency`: a renamed dependency
/// (`crate = ::idem` after `idem = { package = "idempotency", .. }`), or the runtime crate used
/// directly (`crate = idempotent_runtime`). The expansion only names items under
/// `<path>::__private`.
///
/// ```ignore
/// #[idempotent(crate = idempotent_runtime, prefix = "order:consume", keys = [id], ttl = 60)]
/// ```
///
/// # Compile errors
///
/// Every misuse is reported on the token to fix, all in one build: an unknown or repeated
/// argument, a missing required one, a key that is not a parameter, a `ttl` of zero, a
/// `lease` not shorter than `ttl`, a function that is not `async` or returns nothing. A
/// return type that is not a `Result`, a key type that is not a `KeyPart` and a `replay`
/// result that is not serializable are reported by the compiler on the return type, the key
/// and `replay`.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let original = proc_macro2::TokenStream::from(item.clone());
    let args = syn::parse::<args::Args>(args);
    let item = syn::parse::<syn::Item>(item);
    match validate::handler(args, item, proc_macro2::Span::call_site()) {
        Ok(handler) => expand::handler(handler).into(),
        Err(error) => {
            // The function as written, so its callers do not fail as well.
            let mut tokens = error.to_compile_error();
            tokens.extend(original);
            tokens.into()
        }
    }
}
