//! Every rule the attribute enforces. Errors are collected and combined, so one build shows
//! all of them, each on the token that needs fixing.

use proc_macro2::{Span, TokenStream, TokenTree};
use syn::{Error, Expr, ExprPath, Ident, Item, ItemFn, Lit, LitStr, Result};

use crate::args::{self, Arg, Args};

mod keys;
use keys::{check_keys, Params};

/// Longest accepted prefix, in bytes (the runtime's `key::MAX_PREFIX_LEN`).
const MAX_PREFIX_LEN: usize = 128;
/// Most entries `keys` may have (the runtime's `key::MAX_PARTS`).
const MAX_KEYS: usize = 16;

/// A handler that passed every check: what `expand.rs` turns into code.
pub(crate) struct Handler {
    pub(crate) item: ItemFn,
    pub(crate) prefix: LitStr,
    pub(crate) keys: Vec<Expr>,
    pub(crate) ttl: u64,
    /// Zero when not given: the runtime picks the default lease.
    pub(crate) lease: u64,
    pub(crate) version: u32,
    pub(crate) store: Option<Expr>,
    pub(crate) in_progress: InProgress,
    pub(crate) on_store_error: args::OnStoreError,
    pub(crate) on_error: args::OnError,
    /// Empty when not given.
    pub(crate) fingerprint: Vec<Expr>,
    pub(crate) done: Option<Expr>,
    /// The span of the `replay` flag.
    pub(crate) replay: Option<Span>,
    /// `on_replay = hook`.
    pub(crate) on_replay: Option<Expr>,
    /// The path of the runtime: `crate = path`, or `::idempotency`.
    pub(crate) krate: syn::Path,
    /// Whether the function is a method as `#[async_trait]` rewrote it (see `boxed.rs`).
    pub(crate) boxed: bool,
}

/// A checked `on_in_progress` policy.
pub(crate) enum InProgress {
    Reject,
    Skip,
    /// Wait up to this many seconds.
    Wait(u64),
}

/// Checks the parsed attribute against the item it is applied to.
///
/// `args` and `item` are the results of parsing: a grammar error in the attribute does not
/// hide the item's own mistakes.
pub(crate) fn handler(args: Result<Args>, item: Result<Item>, call_site: Span) -> Result<Handler> {
    let mut errors = Errors::default();
    // The function's mistakes are reported after the attribute's, in source order.
    let mut signature = Errors::default();

    let item = match item {
        Ok(item) => function(item, &mut signature),
        Err(error) => {
            signature.push(error);
            None
        }
    };
    let args = match args {
        Ok(args) => Some(args),
        Err(error) => {
            errors.push(error);
            None
        }
    };
    let (Some(args), Some(item)) = (args, item) else {
        errors.append(signature);
        return Err(errors.finish(call_site));
    };

    let params = Params::of(&item);
    let prefix = required(
        &mut errors,
        args.prefix,
        call_site,
        "prefix",
        "prefix = \"order:consume\"",
    )
    .and_then(|prefix| check_prefix(&prefix.value, &mut errors));
    let keys = required(
        &mut errors,
        args.keys,
        call_site,
        "keys",
        "keys = [msg.order_id]",
    )
    .and_then(|keys| check_keys(&keys, "keys", &params, &mut errors));
    let ttl = required(&mut errors, args.ttl, call_site, "ttl", "ttl = 3600")
        .and_then(|ttl| seconds(&ttl.value, "ttl", "ttl = 3600", &mut errors));
    let lease = args.lease.and_then(|lease| {
        seconds(&lease.value, "lease", "lease = 30", &mut errors).map(|s| (s, lease))
    });
    if let (Some((lease, arg)), Some(ttl)) = (&lease, ttl) {
        if *lease >= ttl {
            errors.push(Error::new_spanned(
                &arg.value,
                format!("`lease` ({lease} s) must be shorter than `ttl` ({ttl} s)"),
            ));
        }
    }
    let version = match args.version {
        Some(version) => check_version(&version.value, &mut errors),
        None => Some(1),
    };
    let in_progress = match args.on_in_progress.map(|arg| arg.value) {
        None | Some(args::InProgress::Reject) => Some(InProgress::Reject),
        Some(args::InProgress::Skip) => Some(InProgress::Skip),
        Some(args::InProgress::Wait(secs)) => {
            seconds(&secs, "wait", "wait(5)", &mut errors).map(InProgress::Wait)
        }
    };
    let fingerprint = match &args.fingerprint {
        Some(list) => check_keys(list, "fingerprint", &params, &mut errors),
        None => Some(Vec::new()),
    };
    let done = args.done.map(|done| done.value);
    if let Some(done) = &done {
        check_done(done, &mut errors);
    }

    let on_replay = args.on_replay.map(|hook| {
        let replays = args.replay.is_some()
            || matches!(
                &args.on_error,
                Some(Arg {
                    value: args::OnError::Store(_),
                    ..
                })
            );
        if !replays {
            errors.push(Error::new(
                hook.name,
                "`on_replay` needs something to replay: add `replay` (stored values) or \
                 `on_error = store` (stored errors)",
            ));
        }
        hook.value
    });

    errors.append(signature);
    if let Some(error) = errors.0 {
        return Err(error);
    }
    let (Some(prefix), Some(keys), Some(ttl), Some(version), Some(in_progress), Some(fingerprint)) =
        (prefix, keys, ttl, version, in_progress, fingerprint)
    else {
        // Every `None` above comes with an error, so this is only a safety net.
        return Err(Error::new(call_site, "invalid `#[idempotent]` arguments"));
    };
    Ok(Handler {
        prefix,
        keys,
        ttl,
        lease: lease.map_or(0, |(lease, _)| lease),
        version,
        store: args.store.map(|store| store.value),
        in_progress,
        on_store_error: args
            .on_store_error
            .map_or(args::OnStoreError::FailClosed, |arg| arg.value),
        on_error: args
            .on_error
            .map_or(args::OnError::Release, |arg| arg.value),
        fingerprint,
        done,
        replay: args.replay.map(|replay| replay.name),
        on_replay,
        krate: args
            .krate
            .map_or_else(|| syn::parse_quote!(::idempotency), |krate| krate.value),
        boxed: crate::boxed::is_boxed(&item),
        item,
    })
}

/// Errors found so far, combined into one.
#[derive(Default)]
struct Errors(Option<Error>);

impl Errors {
    fn push(&mut self, error: Error) {
        match &mut self.0 {
            Some(errors) => errors.combine(error),
            None => self.0 = Some(error),
        }
    }

    fn append(&mut self, other: Errors) {
        if let Some(error) = other.0 {
            self.push(error);
        }
    }

    fn finish(self, call_site: Span) -> Error {
        self.0
            .unwrap_or_else(|| Error::new(call_site, "invalid `#[idempotent]` handler"))
    }
}

/// Checks that the item is an `async fn` that returns something, and returns the function.
fn function(item: Item, errors: &mut Errors) -> Option<ItemFn> {
    let Item::Fn(function) = item else {
        errors.push(Error::new(
            item_keyword(&item),
            "`#[idempotent]` applies to `async fn` handlers with a body",
        ));
        return None;
    };
    let sig = &function.sig;
    if let Some(constness) = &sig.constness {
        errors.push(Error::new_spanned(
            constness,
            "`#[idempotent]` handlers cannot be `const fn`",
        ));
    }
    if let Some(unsafety) = &sig.unsafety {
        errors.push(Error::new_spanned(
            unsafety,
            "`#[idempotent]` handlers cannot be `unsafe fn`",
        ));
    }
    if let Some(abi) = &sig.abi {
        errors.push(Error::new_spanned(
            abi,
            "`#[idempotent]` handlers cannot be `extern fn`",
        ));
    }
    // A method of an `#[async_trait]` impl arrives rewritten into a boxed future.
    if sig.asyncness.is_none() && !crate::boxed::is_boxed(&function) {
        errors.push(Error::new_spanned(
            sig.fn_token,
            "`#[idempotent]` handlers must be `async fn`",
        ));
    }
    if let syn::ReturnType::Default = sig.output {
        // From the name to the closing parenthesis: where `-> Result<T, E>` goes.
        let close = Ident::new("__", sig.paren_token.span.close());
        let mut tokens = quote::ToTokens::to_token_stream(&sig.ident);
        tokens.extend([TokenTree::Ident(close)]);
        errors.push(Error::new_spanned(
            tokens,
            "`#[idempotent]` handlers must return `Result<T, E>` where `E: From<idempotency::Error>`",
        ));
    }
    // Returned even when wrong, so the arguments are checked against its parameters too.
    Some(function)
}

/// The span of an item's keyword (`struct`, `impl`, ...), after its attributes and visibility.
fn item_keyword(item: &Item) -> Span {
    let tokens: TokenStream = quote::ToTokens::to_token_stream(item);
    let mut tokens = tokens.into_iter().peekable();
    while let Some(token) = tokens.next() {
        match &token {
            // `#[...]`
            TokenTree::Punct(punct) if punct.as_char() == '#' => {
                tokens.next();
            }
            // `pub`, `pub(crate)`
            TokenTree::Ident(ident) if ident == "pub" => {
                if let Some(TokenTree::Group(_)) = tokens.peek() {
                    tokens.next();
                }
            }
            _ => return token.span(),
        }
    }
    Span::call_site()
}

/// Reports a missing required argument, with an example of it.
fn required<T>(
    errors: &mut Errors,
    arg: Option<Arg<T>>,
    call_site: Span,
    name: &str,
    example: &str,
) -> Option<Arg<T>> {
    if arg.is_none() {
        errors.push(Error::new(
            call_site,
            format!("missing `{name}` argument, e.g. `{example}`"),
        ));
    }
    arg
}

/// Checks `prefix = "..."`: what the runtime's key encoding accepts, at compile time.
fn check_prefix(expr: &Expr, errors: &mut Errors) -> Option<LitStr> {
    let Some(Lit::Str(lit)) = literal(expr) else {
        errors.push(Error::new_spanned(
            expr,
            "`prefix` takes a string literal, e.g. `prefix = \"order:consume\"`",
        ));
        return None;
    };
    let value = lit.value();
    let problem = if value.is_empty() {
        Some("`prefix` cannot be empty".to_owned())
    } else if value.len() > MAX_PREFIX_LEN {
        Some(format!(
            "`prefix` is {} bytes long; at most {MAX_PREFIX_LEN} are allowed",
            value.len()
        ))
    } else if value.contains(['{', '}']) {
        Some("`prefix` cannot contain `{` or `}`: braces delimit the key's hash tag".to_owned())
    } else if value.contains(char::is_whitespace) {
        Some("`prefix` cannot contain white space".to_owned())
    } else if value.contains(char::is_control) {
        Some("`prefix` cannot contain control characters".to_owned())
    } else {
        None
    };
    match problem {
        Some(problem) => {
            errors.push(Error::new(lit.span(), problem));
            None
        }
        None => Some(lit.clone()),
    }
}

/// The literal `expr` is, if it is one (looking through invisible groups).
fn literal(expr: &Expr) -> Option<&Lit> {
    match expr {
        Expr::Lit(lit) if lit.attrs.is_empty() => Some(&lit.lit),
        Expr::Group(group) => literal(&group.expr),
        _ => None,
    }
}

/// The value of an integer literal without a suffix or with an unsigned one: `None` for
/// anything else, the literal's span when the value does not fit a `u64`.
fn whole_number(expr: &Expr) -> Option<std::result::Result<u64, Span>> {
    const SUFFIXES: [&str; 5] = ["", "u16", "u32", "u64", "usize"];
    let Some(Lit::Int(int)) = literal(expr) else {
        return None;
    };
    if !SUFFIXES.contains(&int.suffix()) {
        return None;
    }
    Some(int.base10_parse::<u64>().map_err(|_| int.span()))
}

/// The longest duration the runtime accepts, in seconds: 36,500 days
/// (`idempotent_runtime::store::MAX_DURATION`).
const MAX_SECONDS: u64 = 36_500 * 24 * 3600;

/// Checks a duration in whole seconds (`ttl`, `lease`, `wait(...)`): 1 to [`MAX_SECONDS`].
fn seconds(expr: &Expr, name: &str, example: &str, errors: &mut Errors) -> Option<u64> {
    let too_large = format!("`{name}` must be at most {MAX_SECONDS} seconds (36500 days)");
    match whole_number(expr) {
        Some(Ok(0)) => errors.push(Error::new_spanned(
            expr,
            format!("`{name}` must be at least 1 second"),
        )),
        Some(Ok(secs)) if secs > MAX_SECONDS => errors.push(Error::new_spanned(expr, too_large)),
        Some(Ok(secs)) => return Some(secs),
        Some(Err(span)) => errors.push(Error::new(span, too_large)),
        None => errors.push(Error::new_spanned(
            expr,
            format!("`{name}` takes a whole number of seconds, e.g. `{example}`"),
        )),
    }
    None
}

/// Checks `version = N`: 1 to `u32::MAX`.
fn check_version(expr: &Expr, errors: &mut Errors) -> Option<u32> {
    match whole_number(expr) {
        Some(Ok(0)) => errors.push(Error::new_spanned(expr, "`version` starts at 1")),
        Some(Ok(version)) => match u32::try_from(version) {
            Ok(version) => return Some(version),
            Err(_) => errors.push(Error::new_spanned(
                expr,
                format!("`version` must be at most {}", u32::MAX),
            )),
        },
        Some(Err(span)) => errors.push(Error::new(
            span,
            format!("`version` must be at most {}", u32::MAX),
        )),
        None => errors.push(Error::new_spanned(
            expr,
            "`version` takes a whole number, e.g. `version = 2`",
        )),
    }
    None
}

/// Checks that `done` is something that produces a future, not a function or a closure.
fn check_done(expr: &Expr, errors: &mut Errors) {
    let what = match expr {
        Expr::Path(ExprPath { .. }) => "a function",
        Expr::Closure(_) => "a closure",
        _ => return,
    };
    errors.push(Error::new_spanned(
        expr,
        format!(
            "`done` takes a call that returns a future, e.g. `done = is_consumed(&msg.order_id)`, \
             not {what}"
        ),
    ));
}

#[cfg(test)]
mod tests;
