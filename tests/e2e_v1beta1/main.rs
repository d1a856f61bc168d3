//! The integration tests against the v1beta1 CRD variant (Cluster API objects served at v1beta1
//! only), sharing one control plane: discovery, node groups, templates and a real-CA scenario.
//! `cargo test --test e2e_v1beta1 <module>::` runs one file.

#[path = "../support/mod.rs"]
pub mod support;

mod autoscaler;
mod foundation;
mod nodegroups;
mod templates;
