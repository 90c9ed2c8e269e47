//! Methods that `#[async_trait]` (tonic's `#[tonic::async_trait]`) rewrote before the
//! attribute saw them.
//!
//! An attribute on a method inside an `#[async_trait]` impl is expanded after the impl's, so
//! it receives the method as `async_trait` returns it:
//!
//! ```text
//! fn create_order<'life0, 'async_trait>(&'life0 self, request: Request<CreateOrder>)
//!     -> Pin<Box<dyn Future<Output = Result<Response<Order>, Status>> + Send + 'async_trait>>
//! {
//!     Box::pin(async move {
//!         if let Some(__ret) = None::<Result<Response<Order>, Status>> { return __ret; }
//!         let __self = self;
//!         let request = request;
//!         let __ret: Result<Response<Order>, Status> = { /* the method's body */ };
//!         __ret
//!     })
//! }
//! ```
//!
//! The attribute then treats the future's `Output` as the return type, keeps the statements
//! up to `let __ret` (they bind the parameters inside the future), wraps the rest, and reads
//! `self` in its arguments as `__self`, as `async_trait` did in the body.

use proc_macro2::{Group, Ident, TokenStream, TokenTree};
use syn::{
    Expr, ExprAsync, GenericArgument, ItemFn, Pat, PathArguments, ReturnType, Stmt, Type,
    TypeParamBound,
};

/// The `Output` of a `Pin<Box<dyn Future<Output = T> + ...>>` return type.
pub(crate) fn future_output(output: &ReturnType) -> Option<&Type> {
    let ReturnType::Type(_, ty) = output else {
        return None;
    };
    let boxed = single_type_argument(ty, "Pin")?;
    let Type::TraitObject(object) = single_type_argument(boxed, "Box")? else {
        return None;
    };
    object.bounds.iter().find_map(|bound| {
        let TypeParamBound::Trait(bound) = bound else {
            return None;
        };
        let segment = bound.path.segments.last()?;
        if segment.ident != "Future" {
            return None;
        }
        let PathArguments::AngleBracketed(arguments) = &segment.arguments else {
            return None;
        };
        arguments.args.iter().find_map(|argument| match argument {
            GenericArgument::AssocType(assoc) if assoc.ident == "Output" => Some(&assoc.ty),
            _ => None,
        })
    })
}

/// `T` in `<path>::Name<T>`.
fn single_type_argument<'a>(ty: &'a Type, name: &str) -> Option<&'a Type> {
    let Type::Path(path) = ty else {
        return None;
    };
    let segment = path.path.segments.last()?;
    if segment.ident != name {
        return None;
    }
    let PathArguments::AngleBracketed(arguments) = &segment.arguments else {
        return None;
    };
    match arguments.args.first()? {
        GenericArgument::Type(ty) if arguments.args.len() == 1 => Some(ty),
        _ => None,
    }
}

/// The `async move { ... }` in the function's only statement, `Box::pin(async move { ... })`.
pub(crate) fn inner_future(function: &mut ItemFn) -> Option<&mut ExprAsync> {
    let [Stmt::Expr(Expr::Call(call), None)] = function.block.stmts.as_mut_slice() else {
        return None;
    };
    let Expr::Path(callee) = &*call.func else {
        return None;
    };
    let names: Vec<String> = callee
        .path
        .segments
        .iter()
        .map(|segment| segment.ident.to_string())
        .collect();
    if !names.ends_with(&["Box".to_owned(), "pin".to_owned()]) || call.args.len() != 1 {
        return None;
    }
    match call.args.first_mut()? {
        Expr::Async(future) if future.capture.is_some() => Some(future),
        _ => None,
    }
}

/// Where the method's own body starts among the future's statements: at `let __ret: T = ...`.
pub(crate) fn body_start(stmts: &[Stmt]) -> Option<usize> {
    stmts.iter().position(|stmt| {
        let Stmt::Local(local) = stmt else {
            return false;
        };
        let Pat::Type(typed) = &local.pat else {
            return false;
        };
        matches!(&*typed.pat, Pat::Ident(ident) if ident.ident == "__ret")
    })
}

/// Whether `function` is a method as `async_trait` rewrites it.
pub(crate) fn is_boxed(function: &ItemFn) -> bool {
    if function.sig.asyncness.is_some() || future_output(&function.sig.output).is_none() {
        return false;
    }
    let mut function = function.clone();
    inner_future(&mut function).is_some_and(|future| body_start(&future.block.stmts).is_some())
}

/// `tokens` with every `self` read as `__self`, as `async_trait` binds the receiver inside
/// the future.
pub(crate) fn rename_self(tokens: TokenStream) -> TokenStream {
    tokens
        .into_iter()
        .map(|token| match token {
            TokenTree::Ident(ident) if ident == "self" => {
                TokenTree::Ident(Ident::new("__self", ident.span()))
            }
            TokenTree::Group(group) => {
                let mut renamed = Group::new(group.delimiter(), rename_self(group.stream()));
                renamed.set_span(group.span());
                TokenTree::Group(renamed)
            }
            other => other,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::ToTokens;

    const REWRITTEN: &str = "fn create_order<'life0, 'async_trait>(&'life0 self, request: Request<CreateOrder>) \
        -> ::core::pin::Pin<Box<dyn ::core::future::Future<Output = Result<Response<Order>, Status>> \
        + ::core::marker::Send + 'async_trait>> where 'life0: 'async_trait, Self: 'async_trait { \
        Box::pin(async move { \
            if let ::core::option::Option::Some(__ret) = ::core::option::Option::None::<Result<Response<Order>, Status>> { \
                #[allow(unreachable_code)] return __ret; } \
            let __self = self; let request = request; \
            let __ret: Result<Response<Order>, Status> = { Ok(Response::new(Order::default())) }; \
            #[allow(unreachable_code)] __ret }) }";

    #[test]
    fn an_async_trait_method_is_recognised() {
        let function: ItemFn = syn::parse_str(REWRITTEN).unwrap();
        assert!(is_boxed(&function));
        let output = future_output(&function.sig.output).unwrap();
        assert_eq!(
            output.to_token_stream().to_string(),
            "Result < Response < Order > , Status >"
        );
        let mut function = function;
        let future = inner_future(&mut function).unwrap();
        assert_eq!(body_start(&future.block.stmts), Some(3));
    }

    #[test]
    fn other_functions_are_not() {
        for item in [
            "async fn f() -> Result<(), E> { Ok(()) }",
            "fn f() -> Pin<Box<dyn Future<Output = u8> + Send>> { Box::pin(async { 1 }) }",
            "fn f() -> Pin<Box<dyn Future<Output = u8> + Send>> { Box::pin(async move { 1 }) }",
            "fn f() -> Box<dyn Future<Output = u8>> { Box::new(async move { let __ret: u8 = 1; __ret }) }",
        ] {
            let function: ItemFn = syn::parse_str(item).unwrap();
            assert!(!is_boxed(&function), "{item}");
        }
    }

    #[test]
    fn self_is_renamed_everywhere_in_an_argument() {
        let tokens: TokenStream = syn::parse_str("self.orders.done(&self.id, (self))").unwrap();
        assert_eq!(
            rename_self(tokens).to_string(),
            "__self . orders . done (& __self . id , (__self))"
        );
    }
}
