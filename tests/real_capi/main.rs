//! The real Cluster API core manager (v1.14.2, built by tests/upstream/capi/build.sh) against the test
//! kube-apiserver, wired as `clusterctl init` wires it: its 13 CRDs with the conversion webhook, its
//! defaulting and validating webhooks, its controllers. Only the cloud and the kubelets are the
//! stand-in's (tests/support/standin.rs). The scenarios share the manager, each in a namespace with a
//! Cluster of its own. Assertions are on objects, never on log text. `cargo test --test real_capi
//! <module>::` runs one file. (Killing the manager takes its webhooks away from every scenario:
//! tests/real_capi_faults.rs does it in a binary of its own.)

#[path = "../support/mod.rs"]
pub mod support;

mod autoscaler;
mod drain;
mod foundation;
mod grace;
mod marks;
mod pools;
mod preflight;
mod rollout;
mod rules;
