//! The grammar of `#[idempotent(...)]`: comma-separated `name = value` arguments.
//!
//! This module only reads tokens. Whether a value makes sense (a positive `ttl`, a key that
//! names a parameter, ...) is decided in `validate.rs`, so values whose meaning is checked
//! there are kept as expressions here.

use proc_macro2::Span;
use syn::ext::IdentExt as _;
use syn::parse::{Lookahead1, Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{bracketed, parenthesized, token, Error, Expr, ExprPath, Ident, Path, Result, Token};

/// The argument names and the policy words.
pub(crate) mod kw {
    syn::custom_keyword!(prefix);
    syn::custom_keyword!(keys);
    syn::custom_keyword!(ttl);
    syn::custom_keyword!(lease);
    syn::custom_keyword!(version);
    syn::custom_keyword!(store);
    syn::custom_keyword!(on_in_progress);
    syn::custom_keyword!(on_store_error);
    syn::custom_keyword!(on_error);
    syn::custom_keyword!(fingerprint);
    syn::custom_keyword!(done);
    syn::custom_keyword!(replay);
    syn::custom_keyword!(on_replay);

    syn::custom_keyword!(reject);
    syn::custom_keyword!(skip);
    syn::custom_keyword!(wait);
    syn::custom_keyword!(fail_closed);
    syn::custom_keyword!(fail_open);
    syn::custom_keyword!(release);
    syn::custom_keyword!(hold);
}

/// Every argument name, in the order the documentation lists them.
pub(crate) const NAMES: [&str; 14] = [
    "prefix",
    "keys",
    "ttl",
    "lease",
    "version",
    "store",
    "on_in_progress",
    "on_store_error",
    "on_error",
    "fingerprint",
    "done",
    "replay",
    "on_replay",
    "crate",
];

/// The arguments of one `#[idempotent(...)]`, each at most once.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) prefix: Option<Arg<Expr>>,
    pub(crate) keys: Option<Arg<List>>,
    pub(crate) ttl: Option<Arg<Expr>>,
    pub(crate) lease: Option<Arg<Expr>>,
    pub(crate) version: Option<Arg<Expr>>,
    pub(crate) store: Option<Arg<Expr>>,
    pub(crate) on_in_progress: Option<Arg<InProgress>>,
    pub(crate) on_store_error: Option<Arg<OnStoreError>>,
    pub(crate) on_error: Option<Arg<OnError>>,
    pub(crate) fingerprint: Option<Arg<List>>,
    pub(crate) done: Option<Arg<Expr>>,
    /// The span of the `replay` flag.
    pub(crate) replay: Option<Arg<()>>,
    /// `on_replay = hook`: called with the key when a stored result is returned.
    pub(crate) on_replay: Option<Arg<Expr>>,
    /// `crate = path`: where the runtime is, when not at `::idempotency`.
    pub(crate) krate: Option<Arg<Path>>,
}

/// One argument's value and the span of its name.
pub(crate) struct Arg<T> {
    pub(crate) name: Span,
    pub(crate) value: T,
}

/// `[a, b.c, ...]`: the value of `keys` and `fingerprint`.
pub(crate) struct List {
    pub(crate) bracket: token::Bracket,
    pub(crate) items: Punctuated<Expr, Token![,]>,
}

/// The value of `on_in_progress`.
pub(crate) enum InProgress {
    Reject,
    Skip,
    /// `wait(<seconds>)`.
    Wait(Expr),
}

/// The value of `on_store_error`.
pub(crate) enum OnStoreError {
    FailClosed,
    FailOpen,
}

/// The value of `on_error`; each variant keeps the span of the policy word.
pub(crate) enum OnError {
    Release,
    Hold(Span),
    Store(Span),
    /// A path to a `fn(&E) -> idempotency::OnError`.
    Classify(ExprPath),
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> Result<Self> {
        let mut args = Args::default();
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            if lookahead.peek(kw::prefix) {
                let name = input.parse::<kw::prefix>()?.span;
                set_once(&mut args.prefix, "prefix", name, assigned(input)?)?;
            } else if lookahead.peek(kw::keys) {
                let name = input.parse::<kw::keys>()?.span;
                input.parse::<Token![=]>()?;
                set_once(&mut args.keys, "keys", name, input.parse()?)?;
            } else if lookahead.peek(kw::ttl) {
                let name = input.parse::<kw::ttl>()?.span;
                set_once(&mut args.ttl, "ttl", name, assigned(input)?)?;
            } else if lookahead.peek(kw::lease) {
                let name = input.parse::<kw::lease>()?.span;
                set_once(&mut args.lease, "lease", name, assigned(input)?)?;
            } else if lookahead.peek(kw::version) {
                let name = input.parse::<kw::version>()?.span;
                set_once(&mut args.version, "version", name, assigned(input)?)?;
            } else if lookahead.peek(kw::store) {
                let name = input.parse::<kw::store>()?.span;
                set_once(&mut args.store, "store", name, assigned(input)?)?;
            } else if lookahead.peek(kw::on_in_progress) {
                let name = input.parse::<kw::on_in_progress>()?.span;
                input.parse::<Token![=]>()?;
                let value = input.parse()?;
                set_once(&mut args.on_in_progress, "on_in_progress", name, value)?;
            } else if lookahead.peek(kw::on_store_error) {
                let name = input.parse::<kw::on_store_error>()?.span;
                input.parse::<Token![=]>()?;
                let value = input.parse()?;
                set_once(&mut args.on_store_error, "on_store_error", name, value)?;
            } else if lookahead.peek(kw::on_error) {
                let name = input.parse::<kw::on_error>()?.span;
                input.parse::<Token![=]>()?;
                set_once(&mut args.on_error, "on_error", name, input.parse()?)?;
            } else if lookahead.peek(kw::fingerprint) {
                let name = input.parse::<kw::fingerprint>()?.span;
                input.parse::<Token![=]>()?;
                set_once(&mut args.fingerprint, "fingerprint", name, input.parse()?)?;
            } else if lookahead.peek(kw::done) {
                let name = input.parse::<kw::done>()?.span;
                set_once(&mut args.done, "done", name, assigned(input)?)?;
            } else if lookahead.peek(kw::on_replay) {
                let name = input.parse::<kw::on_replay>()?.span;
                set_once(&mut args.on_replay, "on_replay", name, assigned(input)?)?;
            } else if lookahead.peek(kw::replay) {
                let name = input.parse::<kw::replay>()?.span;
                if input.peek(Token![=]) {
                    return Err(Error::new(
                        name,
                        "`replay` is a flag and takes no value: write `replay`",
                    ));
                }
                set_once(&mut args.replay, "replay", name, ())?;
            } else if lookahead.peek(Token![crate]) {
                let name = input.parse::<Token![crate]>()?.span;
                input.parse::<Token![=]>()?;
                if input.peek(syn::LitStr) {
                    return Err(Error::new(
                        input.span(),
                        "`crate` takes a path, not a string: write `crate = ::idempotency`",
                    ));
                }
                let path = input.call(Path::parse_mod_style)?;
                set_once(&mut args.krate, "crate", name, path)?;
            } else {
                return Err(unknown_argument(input, lookahead));
            }

            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        Ok(args)
    }
}

impl Parse for List {
    fn parse(input: ParseStream<'_>) -> Result<Self> {
        let content;
        let bracket = bracketed!(content in input);
        let items = content.parse_terminated(Expr::parse, Token![,])?;
        Ok(List { bracket, items })
    }
}

impl Parse for InProgress {
    fn parse(input: ParseStream<'_>) -> Result<Self> {
        let lookahead = input.lookahead1();
        if lookahead.peek(kw::reject) {
            input.parse::<kw::reject>()?;
            Ok(InProgress::Reject)
        } else if lookahead.peek(kw::skip) {
            input.parse::<kw::skip>()?;
            Ok(InProgress::Skip)
        } else if lookahead.peek(kw::wait) {
            let wait = input.parse::<kw::wait>()?;
            if !input.peek(token::Paren) {
                return Err(Error::new(
                    wait.span,
                    "`wait` takes the longest wait in seconds, e.g. `wait(5)`",
                ));
            }
            let content;
            parenthesized!(content in input);
            Ok(InProgress::Wait(content.parse()?))
        } else {
            Err(unknown_policy(
                input,
                lookahead,
                "on_in_progress",
                "`reject`, `skip` or `wait(<seconds>)`",
            ))
        }
    }
}

impl Parse for OnStoreError {
    fn parse(input: ParseStream<'_>) -> Result<Self> {
        let lookahead = input.lookahead1();
        if lookahead.peek(kw::fail_closed) {
            input.parse::<kw::fail_closed>()?;
            Ok(OnStoreError::FailClosed)
        } else if lookahead.peek(kw::fail_open) {
            input.parse::<kw::fail_open>()?;
            Ok(OnStoreError::FailOpen)
        } else {
            Err(unknown_policy(
                input,
                lookahead,
                "on_store_error",
                "`fail_closed` or `fail_open`",
            ))
        }
    }
}

impl Parse for OnError {
    fn parse(input: ParseStream<'_>) -> Result<Self> {
        // A policy word alone is a policy; anything else (`release::x`, `my_classifier`) is
        // the path of a classifier function.
        let alone = |input: ParseStream<'_>| !input.peek2(Token![::]);
        if input.peek(kw::release) && alone(input) {
            input.parse::<kw::release>()?;
            Ok(OnError::Release)
        } else if input.peek(kw::hold) && alone(input) {
            Ok(OnError::Hold(input.parse::<kw::hold>()?.span))
        } else if input.peek(kw::store) && alone(input) {
            Ok(OnError::Store(input.parse::<kw::store>()?.span))
        } else if input.peek(Ident::peek_any) || input.peek(Token![::]) || input.peek(Token![<]) {
            Ok(OnError::Classify(input.parse()?))
        } else {
            Err(input
                .error("expected `release`, `hold`, `store` or the path of a classifier function"))
        }
    }
}

/// Parses `= <expression>`.
fn assigned(input: ParseStream<'_>) -> Result<Expr> {
    input.parse::<Token![=]>()?;
    input.parse()
}

/// Stores an argument, or reports the second occurrence of a name given twice.
fn set_once<T>(slot: &mut Option<Arg<T>>, name: &str, span: Span, value: T) -> Result<()> {
    if slot.is_some() {
        return Err(Error::new(span, format!("duplicate argument `{name}`")));
    }
    *slot = Some(Arg { name: span, value });
    Ok(())
}

/// The error for a token that starts no known argument.
fn unknown_argument(input: ParseStream<'_>, lookahead: Lookahead1<'_>) -> Error {
    let Ok(ident) = input.fork().call(Ident::parse_any) else {
        return lookahead.error();
    };
    let known = NAMES.map(|name| format!("`{name}`")).join(", ");
    let unknown = ident.unraw().to_string();
    let message = match NAMES.iter().find(|name| similar(&unknown, name)) {
        Some(name) => {
            format!("unknown argument `{unknown}`; did you mean `{name}`? (arguments are {known})")
        }
        None => format!("unknown argument `{unknown}`; the arguments are {known}"),
    };
    Error::new(ident.span(), message)
}

/// The error for a word that is not one of an argument's policies.
fn unknown_policy(
    input: ParseStream<'_>,
    lookahead: Lookahead1<'_>,
    argument: &str,
    expected: &str,
) -> Error {
    match input.fork().call(Ident::parse_any) {
        Ok(ident) => Error::new(
            ident.span(),
            format!("unknown `{argument}` policy `{ident}`; expected {expected}"),
        ),
        Err(_) => lookahead.error(),
    }
}

/// Whether `a` is a likely misspelling of `b`: at most two single-character edits apart.
fn similar(a: &str, b: &str) -> bool {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // Levenshtein distance over two rows.
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut current = Vec::with_capacity(b.len() + 1);
        current.push(i + 1);
        for (j, cb) in b.iter().enumerate() {
            let substitute = previous[j] + usize::from(ca != cb);
            let insert = current[j] + 1;
            let delete = previous[j + 1] + 1;
            current.push(substitute.min(insert).min(delete));
        }
        previous = current;
    }
    previous[b.len()] <= 2
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &str) -> Result<Args> {
        syn::parse_str(args)
    }

    fn message(args: &str) -> String {
        match parse(args) {
            Ok(_) => panic!("`{args}` parsed"),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn every_argument_in_any_order_with_a_trailing_comma() {
        let args = parse(
            "replay, ttl = 60, keys = [msg.a, msg.b], prefix = \"p\", lease = 10, version = 2, \
             store = &STORE, on_in_progress = wait(5), on_store_error = fail_open, \
             on_error = hold, fingerprint = [msg.amount], done = is_done(&msg.a),",
        )
        .unwrap();
        assert!(args.prefix.is_some() && args.ttl.is_some() && args.lease.is_some());
        assert_eq!(args.keys.unwrap().value.items.len(), 2);
        assert!(matches!(
            args.on_in_progress.unwrap().value,
            InProgress::Wait(_)
        ));
        assert!(matches!(
            args.on_store_error.unwrap().value,
            OnStoreError::FailOpen
        ));
        assert!(matches!(args.on_error.unwrap().value, OnError::Hold(_)));
        assert!(args.replay.is_some() && args.done.is_some() && args.store.is_some());
    }

    #[test]
    fn an_empty_attribute_parses_to_no_arguments() {
        let args = parse("").unwrap();
        assert!(args.prefix.is_none() && args.keys.is_none() && args.ttl.is_none());
    }

    #[test]
    fn policy_words_and_classifier_paths() {
        let on_error = |text: &str| parse(text).unwrap().on_error.unwrap().value;
        assert!(matches!(on_error("on_error = release"), OnError::Release));
        assert!(matches!(on_error("on_error = store"), OnError::Store(_)));
        assert!(matches!(
            on_error("on_error = classify"),
            OnError::Classify(_)
        ));
        assert!(matches!(
            on_error("on_error = store::classify"),
            OnError::Classify(_)
        ));
        assert!(matches!(
            on_error("on_error = AppError::policy"),
            OnError::Classify(_)
        ));
        let in_progress = |text: &str| parse(text).unwrap().on_in_progress.unwrap().value;
        assert!(matches!(
            in_progress("on_in_progress = reject"),
            InProgress::Reject
        ));
        assert!(matches!(
            in_progress("on_in_progress = skip"),
            InProgress::Skip
        ));
    }

    #[test]
    fn a_duplicate_is_reported_once() {
        assert_eq!(
            message("ttl = 1, ttl = 2, ttl = 3"),
            "duplicate argument `ttl`"
        );
        assert_eq!(message("replay, replay"), "duplicate argument `replay`");
    }

    #[test]
    fn an_unknown_argument_lists_the_known_ones() {
        let text = message("prefix = \"p\", timeout = 5");
        assert!(text.starts_with("unknown argument `timeout`; the arguments are `prefix`"));
        let text = message("key = [msg.id]");
        assert!(text.starts_with("unknown argument `key`; did you mean `keys`?"));
    }

    #[test]
    fn unknown_policies_are_parse_errors() {
        assert_eq!(
            message("on_in_progress = retry"),
            "unknown `on_in_progress` policy `retry`; expected `reject`, `skip` or `wait(<seconds>)`"
        );
        assert_eq!(
            message("on_in_progress = 5"),
            "expected one of: `reject`, `skip`, `wait`"
        );
        assert_eq!(
            message("on_in_progress = wait"),
            "`wait` takes the longest wait in seconds, e.g. `wait(5)`"
        );
        assert_eq!(
            message("on_store_error = open"),
            "unknown `on_store_error` policy `open`; expected `fail_closed` or `fail_open`"
        );
    }

    #[test]
    fn replay_takes_no_value() {
        assert!(message("replay = true").starts_with("`replay` is a flag"));
    }

    #[test]
    fn similar_names() {
        assert!(similar("key", "keys"));
        assert!(similar("tll", "ttl"));
        assert!(similar("fingerprints", "fingerprint"));
        assert!(!similar("timeout", "ttl"));
    }
}
