//! A second, separate cluster standing in for a Cluster API *workload* cluster: its own etcd, kube-apiserver
//! (its own CA, its own service-account keys) and kube-scheduler, from the same upstream build as the
//! control plane, no CRDs, and the WatchList feature off. With it a test can tell the two connections of a management-cluster install
//! apart: cluster-autoscaler must watch this cluster's Pods and Nodes while the provider reads and writes the
//! Cluster API objects of the control plane.
//!
//! Started once per test binary, on first use; stopped when the binary exits.

use std::path::PathBuf;
use std::sync::OnceLock;

use super::control_plane::{ControlPlane, spawn_scheduler, start_apiserver};
use super::procs;

pub struct WorkloadCluster {
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    /// An admin (`system:masters`) kubeconfig with the certificates embedded: what Cluster API stores in
    /// the `<cluster>-kubeconfig` Secret.
    pub admin_kubeconfig: PathBuf,
    /// The text of that kubeconfig.
    pub admin_kubeconfig_text: String,
    pub dir: PathBuf,
}

static WORKLOAD: OnceLock<Result<WorkloadCluster, String>> = OnceLock::new();

/// The workload cluster of this test binary, started on first use (blocks while starting).
pub fn workload_cluster(cp: &ControlPlane) -> &'static WorkloadCluster {
    let started = WORKLOAD.get_or_init(|| {
        let bin = cp.bin.clone();
        std::thread::Builder::new()
            .name("e2e-workload-cluster".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| format!("build a tokio runtime: {e}"))?;
                runtime.block_on(start(bin))
            })
            .map_err(|e| format!("spawn the workload-cluster thread: {e}"))
            .and_then(|t| {
                t.join()
                    .unwrap_or_else(|_| Err("the workload-cluster start panicked".into()))
            })
            .inspect_err(|_| procs::mark_failed())
    });
    match started {
        Ok(w) => w,
        Err(e) => panic!("the workload cluster did not start:\n{e}"),
    }
}

async fn start(bin: PathBuf) -> Result<WorkloadCluster, String> {
    let dir = procs::work_dir().join("workload-cluster");
    // Streamed initial lists (WatchList) off, as on Kubernetes 1.33 or where an operator turned them
    // off: the provider's Node watch here must fall back to paginated lists, while the control plane
    // serves them streamed.
    let api = start_apiserver(
        &bin,
        &dir,
        "workload",
        "10.0.1.0/24",
        &["--feature-gates=WatchList=false"],
    )
    .await?;
    // The scheduler marks pods that fit no Node unschedulable, which is what makes
    // cluster-autoscaler consider them.
    spawn_scheduler(&bin, &dir.join("kube-scheduler.log"), &api.admin_kubeconfig)
        .map_err(|e| format!("the workload cluster's {e}"))?;
    let admin_kubeconfig_text = std::fs::read_to_string(&api.admin_kubeconfig)
        .map_err(|e| format!("read {}: {e}", api.admin_kubeconfig.display()))?;
    Ok(WorkloadCluster {
        server: api.server,
        admin_kubeconfig: api.admin_kubeconfig,
        admin_kubeconfig_text,
        dir,
    })
}
