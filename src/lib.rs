//! cluster-autoscaler's externalgrpc cloud provider for Cluster API.
//!
//! A functional core (capi, discovery, cache, snapshot, template, options, pricing, removal: plain data
//! in, plain data out) and a thin shell (watch, scale, grpc, server) that does the I/O; `backend` is the
//! seam between the gRPC service and what it answers from and writes through.

mod apis;
mod backend;
pub mod cache;
pub mod capi;
pub mod check;
pub mod config;
pub mod discovery;
mod encoded;
mod events;
pub mod explain;
pub mod grpc;
pub mod logging;
pub mod memory;
pub mod metrics;
pub mod object;
pub mod options;
pub mod pricing;
pub mod print_template;
pub mod problem;
pub mod proto;
pub mod protocol;
mod scale;
pub mod scope;
pub mod server;
pub mod server_clock;
pub mod snapshot;
mod startup;
pub mod template;
mod tls;
pub mod version;
mod watch;

/// Locks `m` even if a thread panicked while holding it: every value kept behind these mutexes is
/// whole after each single update (a map entry, a timestamp, a set swapped in), and a later event or
/// write brings it up to date.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
