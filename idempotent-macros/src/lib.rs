//! The `#[idempotent]` attribute. Use it through the `idempotency` crate, which re-exports it
//! together with the runtime the generated code calls.

mod args;
mod boxed;
mod expand;
mod validate;

use proc_macro::TokenStream;

/// Makes an `async fn` handler run at most once per business key: exactly-once effects for
/// message consumers and HTTP handlers.
///
/// ```
/// use idempotency::idempotent;
/// # use std::sync::atomic::{AtomicU32, Ordering};
/// # use std::sync::Arc;
/// # struct OrderMessage { order_id: String, activity_id: u32 }
/// # #[derive(Debug, PartialEq)]
/// # struct Receipt { order_id: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// # static APPLIED: AtomicU32 = AtomicU32::new(0);
/// # async fn apply(msg: &OrderMessage) -> Result<Receipt, AppError> {
/// #     APPLIED.fetch_add(1, Ordering::SeqCst);
/// #     Ok(Receipt { order_id: msg.order_id.clone() })
/// # }
///
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.activity_id], ttl = 3600)]
/// async fn on_order(msg: &OrderMessage) -> Result<Receipt, AppError> {
///     // runs at most once per (order_id, activity_id), however often the broker delivers
///     apply(msg).await
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # idempotency::set_default_store(Arc::new(idempotency::MemoryStore::new()))?;
/// # let msg = OrderMessage { order_id: "A-1001".into(), activity_id: 7 };
/// # assert_eq!(on_order(&msg).await?, Receipt { order_id: "A-1001".into() });
/// # let duplicate = on_order(&msg).await;
/// # assert!(matches!(duplicate, Err(AppError::Idempotency(e)) if e.is_duplicate()));
/// # assert_eq!(APPLIED.load(Ordering::SeqCst), 1);
/// # Ok(())
/// # }
/// ```
///
/// The handler keeps its signature, visibility, generics and attributes; it works on free
/// functions and on methods (`&self`, `&mut self`, `self`), those of an `#[async_trait]` impl
/// (tonic's service traits) included. It must be an `async fn` that
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
/// ```
/// # use idempotency::idempotent;
/// # struct Capture { payment_id: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "payment:capture", keys = [req.payment_id], ttl = 86400)]
/// # async fn capture(req: &Capture) -> Result<(), AppError> { Ok(()) }
/// # fn main() {}
/// ```
///
/// ## `keys = [...]` (required)
///
/// The smallest business unit of idempotency: 1 to 16 parameters or field paths of
/// parameters (`msg`, `msg.order_id`, `msg.meta.tenant`, `self.tenant`, `pair.0`), borrowed
/// when the handler is called. A path may go through method calls whose arguments are
/// literals, as a tonic request's message and metadata are reached:
/// `request.get_ref().request_id`, `request.metadata().get("x-request-id")`. Each one's type must implement `idempotency::KeyPart`
/// (strings, byte strings, integers, `bool`, `char`, and references to them, or your own
/// identifier types). Key on the business operation (order and activity), not on a message
/// id that a producer's retry changes.
///
/// ```
/// # use idempotency::idempotent;
/// # struct Coupons { tenant: String }
/// # struct Redeem { coupon: String, user_id: u64 }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// # impl Coupons {
/// #[idempotent(prefix = "coupon:redeem", keys = [self.tenant, req.coupon, req.user_id], ttl = 600)]
/// async fn redeem(&self, req: &Redeem) -> Result<(), AppError> {
///     // ...
/// #   Ok(())
/// }
/// # }
/// # fn main() {}
/// ```
///
/// ## `ttl = N` (required)
///
/// How many seconds a completed record is kept: duplicates arriving within it are caught.
/// A whole number greater than zero.
///
/// ```
/// # use idempotency::idempotent;
/// # struct OrderMessage { order_id: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600)]
/// # async fn on_order(msg: &OrderMessage) -> Result<(), AppError> { Ok(()) }
/// # fn main() {}
/// ```
///
/// ## `lease = N`
///
/// How many seconds a claim lives without renewal; the runtime renews it every third of it
/// while the body runs, so a crashed owner's claim is taken over after at most `lease`.
/// Shorter than `ttl`. Defaults to 30 seconds or a third of `ttl`, whichever is shorter.
/// `ttl` and `lease` lie between 1 second and 36,500 days.
///
/// ```
/// # use idempotency::idempotent;
/// # struct Job { id: u64 }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "report:build", keys = [job.id], ttl = 86400, lease = 120)]
/// # async fn build_report(job: &Job) -> Result<(), AppError> { Ok(()) }
/// # fn main() {}
/// ```
///
/// ## `version = N`
///
/// Part of every key, 1 by default. Bump it when you change what a key means (its prefix or
/// its parts), so the change is deliberate rather than a silent loss of deduplication.
///
/// ```
/// # use idempotency::idempotent;
/// # struct OrderMessage { order_id: String, line: u32 }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.line], ttl = 3600, version = 2)]
/// # async fn on_order_line(msg: &OrderMessage) -> Result<(), AppError> { Ok(()) }
/// # fn main() {}
/// ```
///
/// ## `store = <expression>`
///
/// The store to use, evaluated on every call and borrowed (it must implement
/// `idempotency::store::IntoStore + Clone`; an `Arc` of a store is cheap to clone). Without it
/// the process default is used.
///
/// ```
/// # use idempotency::{idempotent, MemoryStore};
/// # use std::sync::Arc;
/// # struct OrderMessage { order_id: String }
/// # struct Consumer { store: Arc<MemoryStore> }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// # impl Consumer {
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600, store = self.store)]
/// # async fn on_order(&self, msg: &OrderMessage) -> Result<(), AppError> { Ok(()) }
/// # }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), AppError> {
/// # // No process default store: each consumer uses its own.
/// # let consumer = Consumer { store: Arc::new(MemoryStore::new()) };
/// # let msg = OrderMessage { order_id: "A-1001".into() };
/// # consumer.on_order(&msg).await?;
/// # assert!(matches!(consumer.on_order(&msg).await, Err(AppError::Idempotency(e)) if e.is_duplicate()));
/// # let other = Consumer { store: Arc::new(MemoryStore::new()) };
/// # other.on_order(&msg).await?;
/// # Ok(())
/// # }
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
/// ```
/// # use idempotency::idempotent;
/// # struct CreateOrder { key: String }
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderCreated { id: u64 }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "http:order", keys = [req.key], ttl = 86400, on_in_progress = wait(10), replay)]
/// # async fn create_order(req: &CreateOrder) -> Result<OrderCreated, AppError> {
/// #     Ok(OrderCreated { id: 1 })
/// # }
/// # fn main() {}
/// ```
///
/// ## `on_store_error = fail_closed | fail_open`
///
/// What a call does when the store fails before the body ran: `fail_closed` (the default)
/// returns `idempotency::Error::Store` without running the body, so the message is
/// redelivered; `fail_open` runs the body unguarded.
///
/// ```
/// # use idempotency::idempotent;
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "cache:warm", keys = [key], ttl = 60, on_store_error = fail_open)]
/// # async fn warm(key: &str) -> Result<(), AppError> { Ok(()) }
/// # fn main() {}
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
/// ```
/// # use idempotency::idempotent;
/// # use std::sync::Arc;
/// # struct Capture { payment_id: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error("the payment provider timed out")]
/// #     Timeout,
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// fn classify(error: &AppError) -> idempotency::OnError {
///     match error {
///         AppError::Timeout => idempotency::OnError::Hold,
///         _ => idempotency::OnError::Release,
///     }
/// }
///
/// #[idempotent(prefix = "payment:capture", keys = [req.payment_id], ttl = 86400, on_error = classify)]
/// # async fn capture(req: &Capture) -> Result<(), AppError> { Err(AppError::Timeout) }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # idempotency::set_default_store(Arc::new(idempotency::MemoryStore::new()))?;
/// # let req = Capture { payment_id: "P-1".into() };
/// # assert!(matches!(capture(&req).await, Err(AppError::Timeout)));
/// # // A timeout holds the key: a retry does not capture again.
/// # assert!(matches!(
/// #     capture(&req).await,
/// #     Err(AppError::Idempotency(idempotency::Error::Held { .. }))
/// # ));
/// # Ok(())
/// # }
/// ```
///
/// ## `fingerprint = [...]`
///
/// Parameters or field paths (as in `keys`) that describe the payload. A duplicate key with
/// a different fingerprint fails with `idempotency::Error::PayloadMismatch` instead of being
/// treated as the same operation.
///
/// ```
/// # use idempotency::idempotent;
/// # use std::sync::Arc;
/// # struct Capture { payment_id: String, amount: u64, currency: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "payment:capture", keys = [req.payment_id], ttl = 86400, fingerprint = [req.amount, req.currency])]
/// # async fn capture(req: &Capture) -> Result<(), AppError> { Ok(()) }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # idempotency::set_default_store(Arc::new(idempotency::MemoryStore::new()))?;
/// # capture(&Capture { payment_id: "P-1".into(), amount: 100, currency: "EUR".into() }).await?;
/// # let other = capture(&Capture { payment_id: "P-1".into(), amount: 999, currency: "EUR".into() }).await;
/// # assert!(matches!(
/// #     other,
/// #     Err(AppError::Idempotency(idempotency::Error::PayloadMismatch { .. }))
/// # ));
/// # Ok(())
/// # }
/// ```
///
/// ## `done = <call>`
///
/// A business-status check: an expression evaluated to a future whose output is
/// `Result<bool, D>`, where `E: From<D>`. It may borrow the parameters. After a claim is
/// acquired, and when a call meets a live claim, the runtime asks it whether the effect is
/// already applied; `Ok(true)` completes the record and skips the body. This keeps effects
/// exactly-once even when the store lost its data, and when a completion retried in the
/// background after the caller got `Ok` was lost (the runtime counts that loss as
/// `idempotency.completion.lost` and hands it to the hook registered with
/// `idempotency::on_completion_lost`: without `done` or a fence at the effect, the next
/// delivery of that operation runs the body again).
///
/// ```
/// # use idempotency::idempotent;
/// # use std::sync::atomic::{AtomicU32, Ordering};
/// # use std::sync::Arc;
/// # struct OrderMessage { order_id: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// # struct Orders;
/// # impl Orders {
/// #     // The business table's own record of the effect.
/// #     async fn is_consumed(&self, order_id: &str) -> Result<bool, AppError> {
/// #         Ok(order_id == "A-1000")
/// #     }
/// # }
/// # struct Consumer { orders: Orders, runs: AtomicU32 }
/// # impl Consumer {
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600, done = self.orders.is_consumed(&msg.order_id))]
/// # async fn on_order(&self, msg: &OrderMessage) -> Result<(), AppError> {
/// #     self.runs.fetch_add(1, Ordering::SeqCst);
/// #     Ok(())
/// # }
/// # }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # idempotency::set_default_store(Arc::new(idempotency::MemoryStore::new()))?;
/// # let consumer = Consumer { orders: Orders, runs: AtomicU32::new(0) };
/// # // Already applied (the store knew nothing of it): the body does not run.
/// # let _ = consumer.on_order(&OrderMessage { order_id: "A-1000".into() }).await;
/// # assert_eq!(consumer.runs.load(Ordering::SeqCst), 0);
/// # consumer.on_order(&OrderMessage { order_id: "A-1001".into() }).await?;
/// # assert_eq!(consumer.runs.load(Ordering::SeqCst), 1);
/// # Ok(())
/// # }
/// ```
///
/// ## `replay`
///
/// Store the first run's `Ok` value and return it to duplicates instead of
/// `idempotency::Error::Duplicate`. `T` must implement `serde::Serialize` and
/// `serde::de::DeserializeOwned`.
///
/// ```
/// # use idempotency::idempotent;
/// # use std::sync::atomic::{AtomicU64, Ordering};
/// # use std::sync::Arc;
/// # struct CreateOrder { idempotency_key: String }
/// # #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
/// # struct OrderCreated { id: u64 }
/// # #[derive(Debug, thiserror::Error)]
/// # enum ApiError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// # static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// #[idempotent(prefix = "http:create-order", keys = [req.idempotency_key], ttl = 86400, replay)]
/// async fn create_order(req: &CreateOrder) -> Result<OrderCreated, ApiError> {
///     // ...
/// #   Ok(OrderCreated { id: NEXT_ID.fetch_add(1, Ordering::SeqCst) })
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # idempotency::set_default_store(Arc::new(idempotency::MemoryStore::new()))?;
/// # let req = CreateOrder { idempotency_key: "9f1c".into() };
/// # let first = create_order(&req).await?;
/// # // The retry gets the first answer, and no second order is created.
/// # assert_eq!(create_order(&req).await?, first);
/// # assert_eq!(NEXT_ID.load(Ordering::SeqCst), 2);
/// # Ok(())
/// # }
/// ```
///
/// ## `on_replay = <fn>`
///
/// A `fn(&idempotency::Key)` (a path, or a closure that captures nothing) called each time
/// the call returns a stored value (`replay`) or a stored error (`on_error = store`) instead
/// of running the handler: the way to tell a replay from a fresh run (a metric, a log line)
/// without changing what the handler returns. Without `replay` or `on_error = store` nothing
/// is ever replayed, so the attribute refuses it.
///
/// ```
/// # use idempotency::idempotent;
/// # use std::sync::atomic::{AtomicU64, Ordering};
/// # use std::sync::Arc;
/// static REPLAYED: AtomicU64 = AtomicU64::new(0);
///
/// fn count_replay(_key: &idempotency::Key) {
///     REPLAYED.fetch_add(1, Ordering::Relaxed);
/// }
///
/// #[idempotent(prefix = "coupon:grant", keys = [user], ttl = 86400, replay, on_replay = count_replay)]
/// async fn grant_coupon(user: &str) -> Result<String, idempotency::Error> {
///     Ok(format!("SPRING-{user}"))
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # idempotency::set_default_store(Arc::new(idempotency::MemoryStore::new()))?;
/// # assert_eq!(grant_coupon("u7").await?, grant_coupon("u7").await?);
/// # assert_eq!(REPLAYED.load(Ordering::Relaxed), 1);
/// # Ok(())
/// # }
/// ```
///
/// ## `crate = path`
///
/// Where the runtime is, when it is not at `::idempotency`: a renamed dependency
/// (`crate = ::idem` after `idem = { package = "idempotency", .. }`), or the runtime crate used
/// directly (`crate = idempotent_runtime`). The expansion only names items under
/// `<path>::__private`.
///
/// ```
/// # use idempotency::idempotent;
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotent_runtime::Error),
/// # }
/// #[idempotent(crate = idempotent_runtime, prefix = "order:consume", keys = [id], ttl = 60)]
/// # async fn on_order(id: u64) -> Result<(), AppError> { Ok(()) }
/// # fn main() {}
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
///
/// A `ttl` of zero would keep nothing, so duplicates would never be caught:
///
/// ```compile_fail
/// # use idempotency::idempotent;
/// # struct OrderMessage { order_id: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 0)]
/// async fn on_order(msg: &OrderMessage) -> Result<(), AppError> { Ok(()) }
/// # fn main() {}
/// ```
///
/// A `lease` must be shorter than `ttl` (here both are 60 seconds):
///
/// ```compile_fail
/// # use idempotency::idempotent;
/// # struct OrderMessage { order_id: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 60, lease = 60)]
/// async fn on_order(msg: &OrderMessage) -> Result<(), AppError> { Ok(()) }
/// # fn main() {}
/// ```
///
/// The handler must be an `async fn`: the claim, the body and the completion are awaited:
///
/// ```compile_fail
/// # use idempotency::idempotent;
/// # struct OrderMessage { order_id: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600)]
/// fn on_order(msg: &OrderMessage) -> Result<(), AppError> { Ok(()) }
/// # fn main() {}
/// ```
///
/// A key must be a parameter or a field path of one (here the parameter is `msg`):
///
/// ```compile_fail
/// # use idempotency::idempotent;
/// # struct OrderMessage { order_id: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "order:consume", keys = [message.order_id], ttl = 3600)]
/// async fn on_order(msg: &OrderMessage) -> Result<(), AppError> { Ok(()) }
/// # fn main() {}
/// ```
///
/// An unknown argument is refused rather than ignored (there is no `timeout`):
///
/// ```compile_fail
/// # use idempotency::idempotent;
/// # struct OrderMessage { order_id: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600, timeout = 30)]
/// async fn on_order(msg: &OrderMessage) -> Result<(), AppError> { Ok(()) }
/// # fn main() {}
/// ```
///
/// The handler must return a `Result`, so every outcome that is not its own can be an `Err`:
///
/// ```compile_fail
/// # use idempotency::idempotent;
/// # struct OrderMessage { order_id: String }
/// # #[derive(Debug, thiserror::Error)]
/// # enum AppError {
/// #     #[error(transparent)]
/// #     Idempotency(#[from] idempotency::Error),
/// # }
/// #[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600)]
/// async fn on_order(msg: &OrderMessage) -> u64 { 1 }
/// # fn main() {}
/// ```
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
