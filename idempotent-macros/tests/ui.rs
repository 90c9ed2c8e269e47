//! Compile-time behaviour of `#[idempotent]`: what compiles, and where each mistake is
//! reported. Regenerate the expected output with
//! `TRYBUILD=overwrite cargo test -p idempotent-macros --test ui` and read every changed
//! `.stderr` before committing it.
//!
//! The cases live in this crate, not beside the facade's tests: trybuild builds them in a
//! project of its own with the dependencies and dev-dependencies of the crate they belong
//! to, and this crate's are the few the cases use (the facade's own are every backend's
//! client, which that build would compile a second time).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*/*.rs");
}
