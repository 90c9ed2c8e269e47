//! Compile-time behaviour of `#[idempotent]`: what compiles, and where each mistake is
//! reported. Regenerate the expected output with `TRYBUILD=overwrite cargo test --test ui`
//! and read every changed `.stderr` before committing it.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*/*.rs");
}
