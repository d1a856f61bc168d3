//! The integration tests that share one control plane with the shipped CRDs (v1beta2): each works in
//! a namespace of its own and none stops the apiserver, so they need no control plane of their own.
//! (Tests that stop or kill the apiserver, the real-CA scenarios and the other CRD variants are
//! binaries of their own.) `cargo test --test e2e <module>::` runs one file.

#[path = "../support/mod.rs"]
pub mod support;

mod check;
mod nodegroups;
mod observability;
mod operator;
mod preflight;
mod pricing;
mod scope;
mod startup;
mod templates;
mod tls;
