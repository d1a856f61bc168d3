//! The integration tests against the v1beta1 CRD variant (Cluster API objects served at v1beta1
//! only), sharing one control plane: discovery, node groups and templates. (The real-CA v1beta1
//! cell runs on the real CAPI manager through its conversion webhook: tests/autoscaler_matrix.rs.)
//! `cargo test --test e2e_v1beta1 <module>::` runs one file.

#[path = "../support/mod.rs"]
pub mod support;

mod foundation;
mod nodegroups;
mod templates;
