//! `keys` and `fingerprint`: paths rooted at a parameter of the handler, each named once.

use std::fmt;

use syn::{Error, Expr, FnArg, Ident, ItemFn, Member, Pat};

use super::{Errors, MAX_KEYS};
use crate::args::{Arg, List};

/// The names a key may start with.
pub(super) struct Params {
    has_self: bool,
    names: Vec<Ident>,
}

impl Params {
    pub(super) fn of(function: &ItemFn) -> Params {
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

/// A key entry as a root name and the fields and calls under it.
#[derive(PartialEq)]
struct KeyPath {
    root: Ident,
    /// `.field`, `.0`, or `.method(args)` (the arguments as written).
    steps: Vec<String>,
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.root)?;
        for step in &self.steps {
            write!(f, ".{step}")?;
        }
        Ok(())
    }
}

/// Reads `expr` as `param`, `param.field.field` or `param.method().field` (a tonic request's
/// `request.get_ref().request_id`, `request.metadata().get("x-request-id")`: method calls
/// whose arguments are literals), or says what it is instead.
fn key_path(expr: &Expr) -> std::result::Result<KeyPath, &'static str> {
    match expr {
        Expr::Path(path) if path.attrs.is_empty() && path.qself.is_none() => {
            match path.path.get_ident() {
                Some(root) => Ok(KeyPath {
                    root: root.clone(),
                    steps: Vec::new(),
                }),
                None => Err("not paths to items"),
            }
        }
        Expr::Field(field) if field.attrs.is_empty() => {
            let mut path = key_path(&field.base)?;
            path.steps.push(match &field.member {
                Member::Named(name) => name.to_string(),
                Member::Unnamed(index) => index.index.to_string(),
            });
            Ok(path)
        }
        Expr::MethodCall(call) if call.attrs.is_empty() => {
            if call.turbofish.is_some() {
                return Err("not method calls with type arguments");
            }
            if !call.args.iter().all(|arg| matches!(arg, Expr::Lit(_))) {
                return Err("not method calls whose arguments are not literals");
            }
            let mut path = key_path(&call.receiver)?;
            let args: Vec<String> = call
                .args
                .iter()
                .map(|arg| quote::ToTokens::to_token_stream(arg).to_string())
                .collect();
            path.steps
                .push(format!("{}({})", call.method, args.join(", ")));
            Ok(path)
        }
        // An invisible group, from a `macro_rules!` fragment.
        Expr::Group(group) => key_path(&group.expr),
        Expr::Call(_) => Err("not function calls"),
        Expr::Lit(_) => Err("not literals"),
        Expr::Index(_) => Err("not index expressions"),
        Expr::Reference(_) => Err("not references: they are borrowed already, drop the `&`"),
        _ => Err("not arbitrary expressions"),
    }
}

/// Checks `keys = [...]` or `fingerprint = [...]` and returns its entries.
pub(super) fn check_keys(
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
