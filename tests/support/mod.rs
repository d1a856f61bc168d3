//! Shared harness for integration tests: a real etcd + kube-apiserver (built from Go modules by
//! tests/upstream/build.sh) with the Cluster API CRDs, identities, and the provider binary.
//!
//! Use from a test file with `pub mod support;`: public, the harness is that test crate's API, so
//! the parts a binary does not call are not dead code there. One control plane per test binary,
//! started on first use and stopped when the binary ends (also after a panic):
//!
//! ```ignore
//! let cp = support::control_plane(support::Setup::shipped());
//! let client = cp.admin_client().await;       // a client per test: each test has its own runtime
//! let ns = cp.fresh_namespace().await;
//! let provider = support::start_provider(&[], cp.admin_kubeconfig()).await;
//! ```
//!
//! Environment: `CAPI_E2E_KEEP=1` keeps the work directory (certificates, kubeconfigs, logs) even
//! when every test passed; it is always kept when a test panicked, and its path is printed.
//! `CAPI_E2E_AUDIT=1` makes each control plane's kube-apiserver write an audit log of the writes to
//! Cluster API's Machines and scalable objects (`control-plane/audit.log` in that directory).

pub mod artifacts;
pub mod autoscaler;
pub mod capi;
pub mod capi_manager;
pub mod cert_manager;
pub mod control_plane;
pub mod controller_manager;
pub mod crds;
pub mod faults;
pub mod ha;
pub mod hardening;
pub mod infra;
pub mod kubelet;
pub mod monitoring;
pub mod pki;
pub mod procs;
pub mod provider;
pub mod real_capi;
pub mod real_capi_namespace;
pub mod real_capi_scenario;
pub mod render;
pub mod resuming_watch;
pub mod standin;
pub mod workload;
pub mod workload_cluster;

pub use control_plane::{ControlPlane, CrdSet, Setup, client_from_kubeconfig, control_plane};
pub use procs::{Check, poll_until};
pub use provider::{ProviderProcess, start_provider};

use kube::api::ApiResource;

/// The `ApiResource` of a Cluster API kind (`plural` of `kind`) in `group`/`version`.
pub fn capi_resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: group.to_string(),
        version: version.to_string(),
        api_version: format!("{group}/{version}"),
        kind: kind.to_string(),
        plural: plural.to_string(),
    }
}

/// The MachineDeployments of `group`/`version` in namespace `ns` through `client`, and their
/// `ApiResource`.
pub fn machine_deployments(
    client: kube::Client,
    ns: &str,
    group: &str,
    version: &str,
) -> (kube::Api<kube::api::DynamicObject>, ApiResource) {
    let ar = capi_resource(group, version, "MachineDeployment", "machinedeployments");
    (kube::Api::namespaced_with(client, ns, &ar), ar)
}

/// The Cluster API group.
pub const CAPI_GROUP: &str = "cluster.x-k8s.io";
