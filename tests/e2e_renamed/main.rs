//! The integration tests on a control plane with the shipped CRDs and the same CRDs moved to another
//! group (`Setup::with_renamed_group`, for `CAPI_GROUP`): the harness's foundations and node groups
//! in a renamed group. `cargo test --test e2e_renamed <module>::` runs one file.

#[path = "../support/mod.rs"]
pub mod support;

mod foundation;
mod nodegroups;
