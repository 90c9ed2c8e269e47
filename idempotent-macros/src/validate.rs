//! Every rule the attribute enforces. Errors are collected and combined, so one build shows
//! all of them, each on the token that needs fixing.

use std::fmt;

use proc_macro2::{Span, TokenStream, TokenTree};
use syn::{Error, Expr, ExprPath, FnArg, Ident, Item, ItemFn, Lit, LitStr, Member, Pat, Result};

use crate::args::{self, Arg, Args, List};

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
    /// The path of the runtime: `crate = path`, or `::idempotency`.
    pub(crate) krate: syn::Path,
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
        item,
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
        krate: args
            .krate
            .map_or_else(|| syn::parse_quote!(::idempotency), |krate| krate.value),
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
    if sig.asyncness.is_none() {
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

/// The names a key may start with.
struct Params {
    has_self: bool,
    names: Vec<Ident>,
}

impl Params {
    fn of(function: &ItemFn) -> Params {
        let mut params = Params {
            has_self: false,
            names: Vec::new(),
        };
        for input in &function.sig.inputs {
            match input {
                FnArg::Receiver(_) => params.has_self = true,
                FnArg::Typed(typed) => bindings(&typed.pat, &mut params.names),
            }
        }
        params
    }

    fn contains(&self, ident: &Ident) -> bool {
        if ident == "self" {
            self.has_self
        } else {
            self.names.iter().any(|name| name == ident)
        }
    }

    /// `` `a`, `b` `` for the help text of a name that is not a parameter.
    fn list(&self) -> String {
        let receiver = self.has_self.then(|| "`self`".to_owned());
        let names = self.names.iter().map(|name| format!("`{name}`"));
        let all: Vec<String> = receiver.into_iter().chain(names).collect();
        match all.as_slice() {
            [] => "this function has no parameters".to_owned(),
            [one] => format!("its only parameter is {one}"),
            many => format!("its parameters are {}", many.join(", ")),
        }
    }
}

/// Collects the names a parameter pattern binds (`msg`, or `id` and `body` in `Msg { id, body }`).
fn bindings(pat: &Pat, names: &mut Vec<Ident>) {
    match pat {
        Pat::Ident(pat) => {
            names.push(pat.ident.clone());
            if let Some((_, sub)) = &pat.subpat {
                bindings(sub, names);
            }
        }
        Pat::Tuple(pat) => pat.elems.iter().for_each(|pat| bindings(pat, names)),
        Pat::TupleStruct(pat) => pat.elems.iter().for_each(|pat| bindings(pat, names)),
        Pat::Slice(pat) => pat.elems.iter().for_each(|pat| bindings(pat, names)),
        Pat::Struct(pat) => pat
            .fields
            .iter()
            .for_each(|field| bindings(&field.pat, names)),
        Pat::Reference(pat) => bindings(&pat.pat, names),
        Pat::Paren(pat) => bindings(&pat.pat, names),
        Pat::Type(pat) => bindings(&pat.pat, names),
        // Every alternative binds the same names.
        Pat::Or(pat) => pat
            .cases
            .iter()
            .take(1)
            .for_each(|pat| bindings(pat, names)),
        _ => {}
    }
}

/// A key entry as a root name and the fields under it.
#[derive(PartialEq)]
struct KeyPath {
    root: Ident,
    fields: Vec<Member>,
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.root)?;
        for field in &self.fields {
            match field {
                Member::Named(name) => write!(f, ".{name}")?,
                Member::Unnamed(index) => write!(f, ".{}", index.index)?,
            }
        }
        Ok(())
    }
}

/// Reads `expr` as `param` or `param.field.field`, or says what it is instead.
fn key_path(expr: &Expr) -> std::result::Result<KeyPath, &'static str> {
    match expr {
        Expr::Path(path) if path.attrs.is_empty() && path.qself.is_none() => {
            match path.path.get_ident() {
                Some(root) => Ok(KeyPath {
                    root: root.clone(),
                    fields: Vec::new(),
                }),
                None => Err("not paths to items"),
            }
        }
        Expr::Field(field) if field.attrs.is_empty() => {
            let mut path = key_path(&field.base)?;
            path.fields.push(field.member.clone());
            Ok(path)
        }
        // An invisible group, from a `macro_rules!` fragment.
        Expr::Group(group) => key_path(&group.expr),
        Expr::MethodCall(_) => Err("not method calls"),
        Expr::Call(_) => Err("not function calls"),
        Expr::Lit(_) => Err("not literals"),
        Expr::Index(_) => Err("not index expressions"),
        Expr::Reference(_) => Err("not references: they are borrowed already, drop the `&`"),
        _ => Err("not arbitrary expressions"),
    }
}

/// Checks `keys = [...]` or `fingerprint = [...]` and returns its entries.
fn check_keys(
    list: &Arg<List>,
    name: &str,
    params: &Params,
    errors: &mut Errors,
) -> Option<Vec<Expr>> {
    let List { bracket, items } = &list.value;
    if items.is_empty() {
        errors.push(Error::new(
            bracket.span.join(),
            format!("`{name}` needs at least one parameter or field path, e.g. `{name} = [msg.order_id]`"),
        ));
        return None;
    }
    let before = errors.0.is_some();
    let mut seen: Vec<KeyPath> = Vec::new();
    for (index, item) in items.iter().enumerate() {
        if name == "keys" && index == MAX_KEYS {
            errors.push(Error::new_spanned(
                item,
                format!("too many keys: a key has at most {MAX_KEYS} parts"),
            ));
        }
        let path = match key_path(item) {
            Ok(path) => path,
            Err(what) => {
                errors.push(Error::new_spanned(
                    item,
                    format!(
                        "`{name}` takes parameters or field paths of parameters, like `msg` or \
                         `msg.order_id`, {what}"
                    ),
                ));
                continue;
            }
        };
        if !params.contains(&path.root) {
            errors.push(Error::new(
                path.root.span(),
                format!(
                    "`{}` is not a parameter of this function; {}",
                    path.root,
                    params.list()
                ),
            ));
            continue;
        }
        if seen.contains(&path) {
            errors.push(Error::new_spanned(
                item,
                format!("duplicate `{name}` entry `{path}`"),
            ));
            continue;
        }
        seen.push(path);
    }
    (errors.0.is_some() == before).then(|| items.iter().cloned().collect())
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
mod tests {
    use super::*;

    fn check(args: &str, item: &str) -> Result<Handler> {
        handler(
            syn::parse_str(args),
            syn::parse_str(item),
            Span::call_site(),
        )
    }

    /// Every error message of `args` on `item`, in order.
    fn errors(args: &str, item: &str) -> Vec<String> {
        match check(args, item) {
            Ok(_) => panic!("`{args}` on `{item}` passed"),
            Err(error) => error.into_iter().map(|error| error.to_string()).collect(),
        }
    }

    fn error(args: &str, item: &str) -> String {
        let errors = errors(args, item);
        assert_eq!(errors.len(), 1, "{errors:#?}");
        errors.into_iter().next().unwrap()
    }

    const HANDLER: &str = "async fn h(msg: &Msg) -> Result<(), E> {}";
    const BASE: &str = "prefix = \"p\", keys = [msg.id], ttl = 60";

    #[test]
    fn defaults() {
        let handler = check(BASE, HANDLER).unwrap();
        assert_eq!(handler.prefix.value(), "p");
        assert_eq!((handler.ttl, handler.lease, handler.version), (60, 0, 1));
        assert!(matches!(handler.in_progress, InProgress::Reject));
        assert!(matches!(
            handler.on_store_error,
            args::OnStoreError::FailClosed
        ));
        assert!(matches!(handler.on_error, args::OnError::Release));
        assert!(handler.fingerprint.is_empty() && handler.done.is_none());
        assert!(handler.store.is_none() && handler.replay.is_none());
    }

    #[test]
    fn every_argument() {
        let handler = check(
            "prefix = \"p\", keys = [msg.a, msg.b], ttl = 60, lease = 10, version = 2, \
             store = S, on_in_progress = wait(5), on_store_error = fail_open, on_error = hold, \
             fingerprint = [msg.amount], done = is_done(&msg.a), replay",
            HANDLER,
        )
        .unwrap();
        assert_eq!(handler.keys.len(), 2);
        assert_eq!((handler.ttl, handler.lease, handler.version), (60, 10, 2));
        assert!(matches!(handler.in_progress, InProgress::Wait(5)));
        assert_eq!(handler.fingerprint.len(), 1);
        assert!(handler.replay.is_some() && handler.done.is_some());
    }

    #[test]
    fn methods_generics_and_patterns() {
        let method = "pub async fn h<T: Clone>(&self, (a, b): (u8, u8), Msg { id, .. }: Msg) \
                      -> Result<(), E> where T: Send {}";
        let keys = "prefix = \"p\", ttl = 1, keys = [self.tenant, a, b, id, self]";
        assert!(check(keys, method).is_ok());
        let keys = "prefix = \"p\", ttl = 1, keys = [pair.0, pair.1.name]";
        assert!(check(keys, "async fn h(pair: (u8, Msg)) -> Result<(), E> {}").is_ok());
    }

    #[test]
    fn missing_arguments() {
        assert_eq!(
            errors("", HANDLER),
            [
                "missing `prefix` argument, e.g. `prefix = \"order:consume\"`",
                "missing `keys` argument, e.g. `keys = [msg.order_id]`",
                "missing `ttl` argument, e.g. `ttl = 3600`",
            ]
        );
    }

    #[test]
    fn prefixes() {
        let prefix =
            |value: &str| error(&format!("prefix = {value}, keys = [msg], ttl = 1"), HANDLER);
        assert_eq!(prefix("\"\""), "`prefix` cannot be empty");
        assert!(prefix("\"a{b\"").starts_with("`prefix` cannot contain `{` or `}`"));
        assert_eq!(prefix("\"a b\""), "`prefix` cannot contain white space");
        assert_eq!(
            prefix("\"a\\u{7}\""),
            "`prefix` cannot contain control characters"
        );
        assert_eq!(
            prefix(&format!("\"{}\"", "x".repeat(129))),
            "`prefix` is 129 bytes long; at most 128 are allowed"
        );
        assert!(prefix("PREFIX").starts_with("`prefix` takes a string literal"));
        assert!(check(
            "prefix = \"order:consume-v2/x_y.z\", keys = [msg], ttl = 1",
            HANDLER
        )
        .is_ok());
    }

    #[test]
    fn durations() {
        let with = |extra: &str| error(&format!("{BASE}, {extra}"), HANDLER);
        let ttl = |value: &str| {
            error(
                &format!("prefix = \"p\", keys = [msg], ttl = {value}"),
                HANDLER,
            )
        };
        assert_eq!(ttl("0"), "`ttl` must be at least 1 second");
        let whole = "`ttl` takes a whole number of seconds, e.g. `ttl = 3600`";
        for value in ["\"3600\"", "1.5", "1h", "-1", "ONE_HOUR", "60 * 60"] {
            assert_eq!(ttl(value), whole, "{value}");
        }
        let too_large = "`ttl` must be at most 3153600000 seconds (36500 days)";
        assert_eq!(ttl("99999999999999999999"), too_large);
        assert_eq!(ttl("3153600001"), too_large);
        assert!(check("prefix = \"p\", keys = [msg], ttl = 3153600000", HANDLER).is_ok());
        assert!(check("prefix = \"p\", keys = [msg], ttl = 3600u64", HANDLER).is_ok());
        assert_eq!(with("lease = 0"), "`lease` must be at least 1 second");
        assert_eq!(
            with("lease = 60"),
            "`lease` (60 s) must be shorter than `ttl` (60 s)"
        );
        assert_eq!(
            with("lease = 61"),
            "`lease` (61 s) must be shorter than `ttl` (60 s)"
        );
        assert_eq!(
            with("on_in_progress = wait(0)"),
            "`wait` must be at least 1 second"
        );
        assert!(with("on_in_progress = wait(x)").starts_with("`wait` takes a whole number"));
        assert_eq!(with("version = 0"), "`version` starts at 1");
        assert_eq!(
            with("version = 4294967296"),
            "`version` must be at most 4294967295"
        );
        assert!(with("version = \"2\"").starts_with("`version` takes a whole number"));
    }

    #[test]
    fn keys() {
        let keys = |list: &str| errors(&format!("prefix = \"p\", ttl = 1, keys = {list}"), HANDLER);
        assert_eq!(
            keys("[]"),
            ["`keys` needs at least one parameter or field path, e.g. `keys = [msg.order_id]`"]
        );
        assert_eq!(
            keys("[message.id]"),
            ["`message` is not a parameter of this function; its only parameter is `msg`"]
        );
        assert_eq!(
            keys("[self.id]"),
            ["`self` is not a parameter of this function; its only parameter is `msg`"]
        );
        assert_eq!(
            keys("[msg.id, msg.id]"),
            ["duplicate `keys` entry `msg.id`"]
        );
        for (key, what) in [
            ("msg.id()", "not method calls"),
            ("id(msg)", "not function calls"),
            ("\"x\"", "not literals"),
            ("msg.ids[0]", "not index expressions"),
            ("&msg.id", "not references"),
            ("crate::ID", "not paths to items"),
            ("msg.a + msg.b", "not arbitrary expressions"),
        ] {
            let found = keys(&format!("[{key}]"));
            assert_eq!(found.len(), 1);
            assert!(
                found[0].starts_with("`keys` takes parameters or field paths"),
                "{key}"
            );
            assert!(found[0].contains(what), "{key}: {found:?}");
        }
        let many = (0..17).map(|_| "msg").collect::<Vec<_>>().join(", ");
        assert!(keys(&format!("[{many}]"))
            .contains(&"too many keys: a key has at most 16 parts".to_owned()));
        let parameters = "async fn h(a: u8, b: u8) -> Result<(), E> {}";
        assert_eq!(
            errors("prefix = \"p\", ttl = 1, keys = [c]", parameters),
            ["`c` is not a parameter of this function; its parameters are `a`, `b`"]
        );
        assert_eq!(
            errors(
                "prefix = \"p\", ttl = 1, keys = [c]",
                "async fn h() -> Result<(), E> {}"
            ),
            ["`c` is not a parameter of this function; this function has no parameters"]
        );
        assert_eq!(
            errors(&format!("{BASE}, fingerprint = [amount]"), HANDLER),
            ["`amount` is not a parameter of this function; its only parameter is `msg`"]
        );
    }

    #[test]
    fn done_is_a_call() {
        let done = |value: &str| check(&format!("{BASE}, done = {value}"), HANDLER);
        assert!(done("is_done(&msg.id)").is_ok());
        assert!(done("self.orders.is_consumed(msg.id)").is_ok());
        assert!(done("async { Ok::<_, E>(false) }").is_ok());
        for value in ["is_done", "|| is_done(msg)", "async || is_done(msg)"] {
            let found = error(&format!("{BASE}, done = {value}"), HANDLER);
            assert!(
                found.starts_with("`done` takes a call that returns a future"),
                "{found}"
            );
        }
    }

    #[test]
    fn signatures() {
        let sig = |item: &str| errors(BASE, item);
        assert_eq!(
            sig("fn h(msg: &Msg) -> Result<(), E> {}"),
            ["`#[idempotent]` handlers must be `async fn`"]
        );
        assert_eq!(
            sig("async fn h(msg: &Msg) {}"),
            ["`#[idempotent]` handlers must return `Result<T, E>` where `E: From<idempotency::Error>`"]
        );
        assert_eq!(
            sig("async unsafe fn h(msg: &Msg) -> Result<(), E> {}"),
            ["`#[idempotent]` handlers cannot be `unsafe fn`"]
        );
        assert_eq!(
            sig("async extern \"C\" fn h(msg: &Msg) -> Result<(), E> {}"),
            ["`#[idempotent]` handlers cannot be `extern fn`"]
        );
        assert_eq!(
            sig("const fn h(msg: &Msg) -> Result<(), E> {}"),
            [
                "`#[idempotent]` handlers cannot be `const fn`",
                "`#[idempotent]` handlers must be `async fn`"
            ]
        );
        assert_eq!(
            sig("#[derive(Debug)] pub(crate) struct Msg;"),
            ["`#[idempotent]` applies to `async fn` handlers with a body"]
        );
    }

    #[test]
    fn the_item_is_checked_even_when_the_arguments_do_not_parse() {
        assert_eq!(
            errors("prefix = \"p\", ttl = 1, keys = [msg], retries = 3", "fn h(msg: &Msg) {}"),
            [
                "unknown argument `retries`; the arguments are `prefix`, `keys`, `ttl`, `lease`, \
                 `version`, `store`, `on_in_progress`, `on_store_error`, `on_error`, \
                 `fingerprint`, `done`, `replay`, `crate`",
                "`#[idempotent]` handlers must be `async fn`",
                "`#[idempotent]` handlers must return `Result<T, E>` where `E: From<idempotency::Error>`",
            ]
        );
    }

    #[test]
    fn all_errors_at_once() {
        let found = errors(
            "prefix = \"\", keys = [msg.id(), other], ttl = 0, lease = 0, version = 0",
            "fn h(msg: &Msg) -> Result<(), E> {}",
        );
        assert_eq!(found.len(), 7, "{found:#?}");
    }
}
