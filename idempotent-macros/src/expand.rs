//! Code generation: the handler's body, untouched, handed to one runtime call.
//!
//! Every check happened in `validate.rs`; nothing here can fail.

use proc_macro2::{Delimiter, Group, Ident, Literal, Span, TokenStream, TokenTree};
use quote::{quote, quote_spanned, ToTokens};
use syn::{Block, Expr, GenericArgument, LitStr, PathArguments, ReturnType, Stmt, Type, TypeInfer};

use crate::args::{OnError, OnStoreError};
use crate::validate::{Handler, InProgress};

/// The handler with its body replaced by the call into `::idempotency::__private`:
///
/// ```text
/// let __idempotent_operation = ::idempotency::__private::operation::<R>(spec, store, &[parts]);
/// let __idempotent_fingerprint = __idempotent_operation.fingerprint(&[parts]);
/// let __idempotent_on_error = __idempotent_fingerprint.on_error(classify);
/// let __idempotent_done = __idempotent_on_error.done(|| into_future(check));
/// let __idempotent_replay = __idempotent_done.replay();
/// __idempotent_replay.run_with(|_| async { <fake return of R> { body } }).await
/// ```
///
/// One statement per step (only the steps whose argument was given), each call spanned at
/// the argument it comes from, so an unsatisfied bound (a `replay` result that is not
/// serializable, say) is reported on that argument. Building the operation in statements of
/// its own also drops the temporaries that hold the borrowed key parts (`&dyn KeyPart`,
/// neither `Send` nor `Sync`) before the `.await`, so the handler's future is `Send` whenever
/// its parameters are.
pub(crate) fn handler(handler: Handler) -> TokenStream {
    let Handler {
        mut item,
        prefix,
        keys,
        ttl,
        lease,
        version,
        store,
        in_progress,
        on_store_error,
        on_error,
        fingerprint,
        done,
        replay,
        on_replay,
        krate,
        boxed,
    } = handler;
    let private = quote!(#krate::__private);

    // The body to run once: the function's block, or in an `#[async_trait]` method the
    // statements of its future from `let __ret` on (the ones before bind the parameters).
    let body = match boxed
        .then(|| crate::boxed::inner_future(&mut item))
        .flatten()
    {
        Some(future) => {
            let start = crate::boxed::body_start(&future.block.stmts).unwrap_or(0);
            let stmts = future.block.stmts.split_off(start);
            quote!({ #(#stmts)* })
        }
        None => item.block.to_token_stream(),
    };
    // The arguments of an `#[async_trait]` method read its receiver as `__self`.
    let rename = |expr: Expr| -> Expr {
        if !boxed {
            return expr;
        }
        syn::parse2(crate::boxed::rename_self(expr.to_token_stream())).unwrap_or(expr)
    };
    let keys: Vec<Expr> = keys.into_iter().map(rename).collect();
    let fingerprint: Vec<Expr> = fingerprint.into_iter().map(rename).collect();
    let store = store.map(rename);
    let done = done.map(rename);

    let output = if boxed {
        crate::boxed::future_output(&item.sig.output).cloned()
    } else {
        match &item.sig.output {
            ReturnType::Type(_, ty) => Some((**ty).clone()),
            ReturnType::Default => None,
        }
    };
    let output = output.as_ref();
    // Where a handler whose output is not a `Result` is told so: its declared return type.
    let output_span = output.map_or_else(|| item.sig.ident.span(), first_span);

    let spec = spec(
        &private,
        &prefix,
        version,
        ttl,
        lease,
        &in_progress,
        &on_store_error,
    );
    let store = match store {
        Some(store) => {
            let store = call_on(quote!(#private::store), &store, Pass::Borrow);
            quote!(::core::option::Option::Some(#store))
        }
        None => quote!(::core::option::Option::None),
    };
    let keys = keys.iter().map(|key| part(&private, key));
    // `operation::<declared return type>`: a type that is not a `Result` is reported on it.
    let operation = match output {
        Some(output) => {
            let (first, last) = first_and_last_span(output);
            let mut output = output.clone();
            erase_impl_trait(&mut output);
            let path = respan(quote!(#private::operation::<), first);
            let close = respan(quote!(>), last);
            quote!(#path #output #close)
        }
        None => respan(quote!(#private::operation), output_span),
    };
    let arguments = spanned_group(quote!(#spec, #store, &[#(#keys),*]), output_span);
    let mut chain = Chain {
        tokens: quote!(let __idempotent_operation = #operation #arguments;),
        current: Ident::new("__idempotent_operation", Span::call_site()),
    };

    if !fingerprint.is_empty() {
        let parts = fingerprint.iter().map(|key| part(&private, key));
        let call_site = Span::call_site();
        chain.step(
            "fingerprint",
            quote!(&[#(#parts),*]),
            (call_site, call_site),
        );
    }
    match on_error {
        OnError::Release => {}
        OnError::Hold(span) => chain.step(
            "on_error",
            quote_spanned!(span=> #private::hold),
            (span, span),
        ),
        OnError::Store(span) => chain.step("store_errors", TokenStream::new(), (span, span)),
        OnError::Classify(path) => {
            let spans = first_and_last_span(&path);
            chain.step("on_error", path.into_token_stream(), spans);
        }
    }
    if let Some(done) = done {
        let spans = first_and_last_span(&done);
        let future = call_on(
            quote!(::core::future::IntoFuture::into_future),
            &done,
            Pass::Value,
        );
        // Not `move`: the check borrows the parameters, as the body does.
        chain.step("done", quote_spanned!(spans.0=> || #future), spans);
    }
    if let Some(span) = replay {
        chain.replay(&private, span);
    }
    if let Some(hook) = on_replay {
        let spans = first_and_last_span(&hook);
        chain.step("on_replay", hook.into_token_stream(), spans);
    }

    let fake_return = output.map(fake_return);
    // Not `async move`: the body borrows the parameters it uses, and `done` may borrow them
    // too. The user's block is the tail of the async block, so its `return`s and `?`s are
    // checked against the declared return type. Made by a closure once the key is claimed
    // (`run_with`), so the call's future holds the body's future once.
    let body = quote!(|_| async { #fake_return #body });
    let Chain {
        mut tokens,
        current,
    } = chain;
    let receiver = Ident::new(&current.to_string(), output_span);
    let run = Ident::new("run_with", output_span);
    let arguments = spanned_group(body, output_span);
    tokens.extend(quote!(#receiver.#run #arguments .await));

    let call = Stmt::Expr(Expr::Verbatim(tokens), None);
    match boxed
        .then(|| crate::boxed::inner_future(&mut item))
        .flatten()
    {
        // After the statements that bind the parameters inside the future.
        Some(future) => future.block.stmts.push(call),
        None => {
            item.block = Box::new(Block {
                brace_token: item.block.brace_token,
                stmts: vec![call],
            })
        }
    }
    item.into_token_stream()
}

/// The attribute's constant settings: `::idempotency::__private::Spec { ... }`.
fn spec(
    private: &TokenStream,
    prefix: &LitStr,
    version: u32,
    ttl: u64,
    lease: u64,
    in_progress: &InProgress,
    on_store_error: &OnStoreError,
) -> TokenStream {
    let version = Literal::u32_suffixed(version);
    let ttl = Literal::u64_suffixed(ttl);
    let lease = Literal::u64_suffixed(lease);
    let in_progress = match in_progress {
        InProgress::Reject => quote!(#private::OnInProgress::Reject),
        InProgress::Skip => quote!(#private::OnInProgress::Skip),
        InProgress::Wait(secs) => {
            let secs = Literal::u64_suffixed(*secs);
            quote!(#private::OnInProgress::Wait(::core::time::Duration::from_secs(#secs)))
        }
    };
    let on_store_error = match on_store_error {
        OnStoreError::FailClosed => quote!(#private::OnStoreError::FailClosed),
        OnStoreError::FailOpen => quote!(#private::OnStoreError::FailOpen),
    };
    quote! {
        #private::Spec {
            prefix: #prefix,
            version: #version,
            ttl_secs: #ttl,
            lease_secs: #lease,
            in_progress: #in_progress,
            on_store_error: #on_store_error,
        }
    }
}

/// The statements that build the operation, and the name of the last one's result.
struct Chain {
    tokens: TokenStream,
    current: Ident,
}

impl Chain {
    /// Appends `let __idempotent_<method> = <current>.<method>(arguments);`, the call spanned
    /// from `spans.0` to `spans.1`.
    fn step(&mut self, method: &str, arguments: TokenStream, spans: (Span, Span)) {
        let (first, last) = spans;
        let receiver = Ident::new(&self.current.to_string(), first);
        let name = Ident::new(&format!("__idempotent_{method}"), Span::call_site());
        let method = Ident::new(method, first);
        let arguments = spanned_group(arguments, last);
        self.tokens
            .extend(quote!(let #name = #receiver.#method #arguments;));
        self.current = name;
    }
}

impl Chain {
    /// Appends the `replay` step: `(&replay_of(&op)).replay(op)` picks the encoding by the
    /// `Ok` type (a prost reply, or serde), the method spanned at the `replay` flag so an
    /// unsatisfied bound is reported there.
    fn replay(&mut self, private: &TokenStream, span: Span) {
        let current = Ident::new(&self.current.to_string(), span);
        let name = Ident::new("__idempotent_replay", Span::call_site());
        let method = Ident::new("replay", span);
        let arguments = spanned_group(current.to_token_stream(), span);
        self.tokens.extend(quote! {
            let #name = {
                #[allow(unused_imports)]
                use #private::{ReplayGrpc as _, ReplaySerde as _};
                (&#private::replay_of(&#current)).#method #arguments
            };
        });
        self.current = name;
    }
}

/// `(tokens)`, the parentheses spanned at `span`.
fn spanned_group(tokens: TokenStream, span: Span) -> Group {
    let mut group = Group::new(Delimiter::Parenthesis, tokens);
    group.set_span(span);
    group
}

/// A never-taken `return` of a value of the declared type, spanned at that type. At the start
/// of the async block it fixes the block's output before the body is checked, so a body that
/// returns the wrong type is reported on its own lines, as in a plain function.
fn fake_return(output: &Type) -> TokenStream {
    let span = first_span(output);
    let mut output = output.clone();
    erase_impl_trait(&mut output);
    quote_spanned! {span=>
        #[allow(
            unknown_lints,
            unreachable_code,
            clippy::diverging_sub_expression,
            clippy::empty_loop,
            clippy::let_unit_value,
            clippy::let_with_type_underscore,
            clippy::needless_return,
            clippy::unreachable
        )]
        if false {
            let __idempotent_fake_return: #output = loop {};
            return __idempotent_fake_return;
        }
    }
}

/// `::idempotency::__private::part(&key)`, spanned from the first to the last token of `key`,
/// so a key whose type is not a `KeyPart` is reported on the key.
fn part(private: &TokenStream, key: &Expr) -> TokenStream {
    call_on(quote!(#private::part), key, Pass::BorrowPlace)
}

/// How `call_on` passes the user's expression.
#[derive(Clone, Copy)]
enum Pass {
    /// `f(expr)`.
    Value,
    /// `f(&expr)`, for keys: paths and field paths, which `&` borrows whole.
    BorrowPlace,
    /// `f(&(expr))`, for any expression.
    Borrow,
}

/// `function(expr)`, with spans that cover the user's `expr`: the function path at its first
/// token, the argument list at its last, so an unsatisfied bound is reported on `expr`.
fn call_on(function: TokenStream, expr: &Expr, pass: Pass) -> TokenStream {
    let (first, last) = first_and_last_span(expr);
    let function = respan(function, first);
    let argument = match pass {
        Pass::Value => expr.to_token_stream(),
        Pass::BorrowPlace => quote_spanned!(first=> &#expr),
        Pass::Borrow => {
            let mut parenthesized = Group::new(Delimiter::Parenthesis, expr.to_token_stream());
            parenthesized.set_span(last);
            quote_spanned!(first=> &#parenthesized)
        }
    };
    let arguments = spanned_group(argument, last);
    quote!(#function #arguments)
}

/// Gives every token of `tokens` (and of its groups) the span `span`.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut token| {
            if let TokenTree::Group(group) = &token {
                let mut respanned = Group::new(group.delimiter(), respan(group.stream(), span));
                respanned.set_span(span);
                token = TokenTree::Group(respanned);
            } else {
                token.set_span(span);
            }
            token
        })
        .collect()
}

fn first_span(tokens: &impl ToTokens) -> Span {
    first_and_last_span(tokens).0
}

/// The spans of the first and last tokens: together they cover the whole of `tokens` on
/// stable Rust, where spans cannot be joined.
fn first_and_last_span(tokens: &impl ToTokens) -> (Span, Span) {
    let mut tokens = tokens.to_token_stream().into_iter();
    let first = tokens
        .next()
        .map_or_else(Span::call_site, |token| token.span());
    let last = tokens.last().map_or(first, |token| token.span());
    (first, last)
}

/// Replaces `impl Trait` with `_`: a `let` cannot be annotated with `impl Trait`.
fn erase_impl_trait(ty: &mut Type) {
    match ty {
        Type::ImplTrait(impl_trait) => {
            let span = impl_trait.impl_token.span;
            *ty = Type::Infer(TypeInfer {
                underscore_token: syn::Token![_](span),
            });
        }
        Type::Array(array) => erase_impl_trait(&mut array.elem),
        Type::Group(group) => erase_impl_trait(&mut group.elem),
        Type::Paren(paren) => erase_impl_trait(&mut paren.elem),
        Type::Ptr(ptr) => erase_impl_trait(&mut ptr.elem),
        Type::Reference(reference) => erase_impl_trait(&mut reference.elem),
        Type::Slice(slice) => erase_impl_trait(&mut slice.elem),
        Type::Tuple(tuple) => tuple.elems.iter_mut().for_each(erase_impl_trait),
        Type::Path(path) => {
            if let Some(qself) = &mut path.qself {
                erase_impl_trait(&mut qself.ty);
            }
            for segment in &mut path.path.segments {
                if let PathArguments::AngleBracketed(arguments) = &mut segment.arguments {
                    for argument in &mut arguments.args {
                        if let GenericArgument::Type(ty) = argument {
                            erase_impl_trait(ty);
                        }
                    }
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(args: &str, item: &str) -> syn::ItemFn {
        let checked = crate::validate::handler(
            syn::parse_str(args),
            syn::parse_str(item),
            Span::call_site(),
        )
        .unwrap();
        syn::parse2(handler(checked)).unwrap()
    }

    /// The names bound by the `let` statements of the expanded body, in order.
    fn steps(function: &syn::ItemFn) -> Vec<String> {
        function
            .block
            .stmts
            .iter()
            .filter_map(|stmt| match stmt {
                Stmt::Local(local) => Some(local.pat.to_token_stream().to_string()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_signature_and_attributes_are_kept() {
        let item = "/// Docs.\n#[inline]\npub(crate) async fn h<T: Clone>(&self, msg: &T) \
                    -> Result<T, E> where T: Send { Ok(msg.clone()) }";
        let original: syn::ItemFn = syn::parse_str(item).unwrap();
        let expanded = expand("prefix = \"p\", keys = [self.id], ttl = 60", item);
        fn text(tokens: &impl ToTokens) -> String {
            tokens.to_token_stream().to_string()
        }
        let attrs = |function: &syn::ItemFn| function.attrs.iter().map(text).collect::<Vec<_>>();
        assert_eq!(attrs(&expanded), attrs(&original));
        assert_eq!(text(&expanded.vis), text(&original.vis));
        assert_eq!(text(&expanded.sig), text(&original.sig));
    }

    #[test]
    fn only_the_given_steps_are_emitted() {
        let item = "async fn h(msg: &Msg) -> Result<(), E> { Ok(()) }";
        let minimal = expand("prefix = \"p\", keys = [msg.id], ttl = 60", item);
        assert_eq!(steps(&minimal), ["__idempotent_operation"]);
        let full = expand(
            "prefix = \"p\", keys = [msg.id], ttl = 60, fingerprint = [msg.amount], \
             on_error = hold, done = is_done(&msg.id), replay",
            item,
        );
        assert_eq!(
            steps(&full),
            [
                "__idempotent_operation",
                "__idempotent_fingerprint",
                "__idempotent_on_error",
                "__idempotent_done",
                "__idempotent_replay",
            ]
        );
        let stored = expand(
            "prefix = \"p\", keys = [msg.id], ttl = 60, on_error = store",
            item,
        );
        assert_eq!(
            steps(&stored),
            ["__idempotent_operation", "__idempotent_store_errors"]
        );
    }

    #[test]
    fn impl_trait_is_erased_from_the_pinned_type() {
        let mut ty: Type = syn::parse_str("Result<(impl Display, Vec<impl Send>), E>").unwrap();
        erase_impl_trait(&mut ty);
        assert_eq!(
            ty.to_token_stream().to_string(),
            "Result < (_ , Vec < _ >) , E >"
        );
    }
}
