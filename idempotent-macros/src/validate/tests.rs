//! The attribute's rules, one case each.

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
    let prefix = |value: &str| error(&format!("prefix = {value}, keys = [msg], ttl = 1"), HANDLER);
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
    // A tonic request's message and metadata: method calls with literal arguments.
    assert!(check(
        "prefix = \"p\", ttl = 1, keys = [msg.get_ref().id, msg.metadata().get(\"x-request-id\")]",
        HANDLER
    )
    .is_ok());
    assert_eq!(
        keys("[msg.get_ref().id, msg.get_ref().id]"),
        ["duplicate `keys` entry `msg.get_ref().id`"]
    );
    for (key, what) in [
        (
            "msg.id(other)",
            "not method calls whose arguments are not literals",
        ),
        ("msg.id::<u8>()", "not method calls with type arguments"),
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
             `fingerprint`, `done`, `replay`, `on_replay`, `crate`",
            "`#[idempotent]` handlers must be `async fn`",
            "`#[idempotent]` handlers must return `Result<T, E>` where `E: From<idempotency::Error>`",
        ]
    );
}

#[test]
fn all_errors_at_once() {
    let found = errors(
        "prefix = \"\", keys = [msg.id(x), other], ttl = 0, lease = 0, version = 0",
        "fn h(msg: &Msg) -> Result<(), E> {}",
    );
    assert_eq!(found.len(), 7, "{found:#?}");
}

#[test]
fn on_replay_needs_something_to_replay() {
    let item = "async fn f(id: u64) -> Result<(), E> { Ok(()) }";
    let hook = r#"prefix = "p", keys = [id], ttl = 60, on_replay = count"#;
    assert_eq!(
        errors(hook, item),
        [
            "`on_replay` needs something to replay: add `replay` (stored values) or \
          `on_error = store` (stored errors)"
        ]
    );
    assert!(check(&format!("{hook}, replay"), item).is_ok());
    assert!(check(&format!("{hook}, on_error = store"), item).is_ok());
}
