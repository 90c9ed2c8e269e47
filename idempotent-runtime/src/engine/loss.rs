//! Losses no caller can be told about: a handler whose effect was applied and whose caller
//! already got `Ok`, while its completion was still being retried in the background, and that
//! completion then failed for good. The next delivery of that operation runs the handler again
//! unless a business check (`done`) or a fence at the effect refuses it; this module makes the
//! loss visible: a tracing event at `error`, the counter `idempotency.completion.lost`, and the
//! hook an application registers with [`on_completion_lost`].

use std::sync::{Arc, PoisonError, RwLock};

use crate::key::Key;

/// Why a background completion was lost ([`CompletionLost::reason`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LossReason {
    /// The store refused the completion: the lease had run out and another owner holds (or
    /// completed) the key.
    Refused,
    /// The store did not record the completion before the record's ttl had passed (the store
    /// was down or never answered all that time).
    GaveUp,
}

impl LossReason {
    /// A short name for logs and metrics: `refused` or `gave_up`.
    pub fn as_str(self) -> &'static str {
        match self {
            LossReason::Refused => "refused",
            LossReason::GaveUp => "gave_up",
        }
    }
}

/// A completion that was lost after its caller had been told the operation succeeded: the
/// effect was applied, and the next delivery runs again unless a business check or fence
/// refuses it (see [`on_completion_lost`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompletionLost {
    /// The operation key.
    pub key: Key,
    /// The fence the lost owner held.
    pub fence: u64,
    /// Why it was lost.
    pub reason: LossReason,
}

type Hook = Arc<dyn Fn(&CompletionLost) + Send + Sync>;

static HOOK: RwLock<Option<Hook>> = RwLock::new(None);

/// Registers `hook`, called once for every completion lost after its caller got `Ok` (a
/// completion retried in the background that the store refused, or that was still not
/// recorded when the record's ttl ran out), in place of any hook registered before. The hook
/// runs on the background task that gave up: keep it short (log, count, alert, enqueue a
/// reconciliation), never block.
///
/// What protects the effect itself is a check at the effect: a business check
/// ([`Operation::done`](crate::Operation::done)) or a fenced write that refuses a stale
/// owner ([`Current::fence`](crate::Current::fence)). The hook tells you when they are all
/// that stood between a redelivery and a second effect.
///
/// ```
/// use idempotent_runtime::{on_completion_lost, CompletionLost};
///
/// on_completion_lost(|lost: &CompletionLost| {
///     eprintln!("{} (fence {}): completion lost, {}", lost.key, lost.fence, lost.reason.as_str());
/// });
/// ```
pub fn on_completion_lost(hook: impl Fn(&CompletionLost) + Send + Sync + 'static) {
    *HOOK.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(hook));
}

/// Reports a lost completion: the event, the counter and the hook.
pub(crate) fn report(lost: CompletionLost, store: &'static str) {
    tracing::error!(
        key = %lost.key,
        fence = lost.fence,
        reason = lost.reason.as_str(),
        "completion lost after the caller was told it succeeded; the next delivery runs again unless a business check or fence refuses it"
    );
    crate::metrics::completion_lost(&lost.key, store, lost.reason.as_str());
    let hook = HOOK.read().unwrap_or_else(PoisonError::into_inner).clone();
    if let Some(hook) = hook {
        hook(&lost);
    }
}
