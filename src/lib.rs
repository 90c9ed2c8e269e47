#![doc = include_str!("../README.md")]

pub use idempotent_macros::idempotent;
pub use idempotent_runtime::*;
