//! The real kube-controller-manager (built by `tests/upstream/build.sh kube-controller-manager` from the same pinned Go modules
//! as kube-apiserver and kube-scheduler) with only the controllers a scenario needs: the disruption
//! controller (a PodDisruptionBudget's status: healthy pods, disruptions allowed), the ReplicaSet and
//! Deployment controllers (an evicted pod is recreated). It runs on a control plane of its own with a
//! real CAPI manager of its own ([`capi_with_controller_manager`]), never on the shared one: its
//! ReplicaSet controller reconciles every ReplicaSet of a control plane, and the other scenarios'
//! pods belong to ReplicaSets with no replicas that nothing reconciles (tests/support/workload.rs),
//! which it would delete.

use std::path::Path;
use std::sync::Mutex;

use super::capi_manager::{CapiManager, capi_manager_apart};
use super::control_plane::ControlPlane;
use super::control_plane::{Setup, upstream_dir_of};
use super::procs;

/// The controllers started (`--controllers`).
pub const CONTROLLERS: &str = "disruption,replicaset,deployment";

/// The real CAPI manager on the control plane `controllers` (its own etcd, kube-apiserver and CAPI
/// CRDs and webhooks) with a kube-controller-manager beside it, both started on first use and kept
/// until the test binary exits.
pub fn capi_with_controller_manager() -> &'static CapiManager {
    let manager = capi_manager_apart("controllers", Setup::real_capi());
    ensure_controller_manager(manager.cp);
    manager
}

/// Starts the kube-controller-manager of `cp` unless it runs already (once per control plane). Only
/// for a control plane no other scenario shares (see the module's comment).
pub fn ensure_controller_manager(cp: &ControlPlane) {
    static STARTED: Mutex<Vec<(String, Result<(), String>)>> = Mutex::new(Vec::new());
    let mut started = STARTED.lock().unwrap_or_else(|e| e.into_inner());
    if !started.iter().any(|(server, _)| *server == cp.server) {
        let result = upstream_dir_of("kube-controller-manager").and_then(|built| {
            spawn(
                &built.join("bin"),
                &cp.dir,
                &cp.dir.join("kube-controller-manager.log"),
                cp.admin_kubeconfig(),
            )
        });
        started.push((cp.server.clone(), result));
    }
    if let Some((_, Err(e))) = started.iter().find(|(server, _)| *server == cp.server) {
        panic!("{e}");
    }
}

/// Starts kube-controller-manager (leader election off, loopback only, the admin identity for every
/// controller) against the cluster of `kubeconfig`, kept until the test binary exits.
fn spawn(bin: &Path, dir: &Path, log: &Path, kubeconfig: &Path) -> Result<(), String> {
    let cert_dir = dir.join("kube-controller-manager-certs");
    std::fs::create_dir_all(&cert_dir)
        .map_err(|e| format!("create {}: {e}", cert_dir.display()))?;
    let kubeconfig = kubeconfig.display().to_string();
    let args: Vec<String> = vec![
        format!("--kubeconfig={kubeconfig}"),
        format!("--authentication-kubeconfig={kubeconfig}"),
        format!("--authorization-kubeconfig={kubeconfig}"),
        format!("--controllers={CONTROLLERS}"),
        "--use-service-account-credentials=false".into(),
        "--leader-elect=false".into(),
        "--bind-address=127.0.0.1".into(),
        format!("--secure-port={}", procs::free_port()),
        format!("--cert-dir={}", cert_dir.display()),
        "--v=1".into(),
    ];
    let child = procs::spawn_logged(&bin.join("kube-controller-manager"), &args, log)
        .map_err(|e| format!("start kube-controller-manager: {e}"))?;
    procs::keep_until_exit(child);
    Ok(())
}
