//! MachinePools on the real MachinePool controller: removing one named instance. With MachinePool
//! Machines (the stand-in's pool in `machinePoolMachines` mode, as CAPZ's and CAPA's machine pools
//! are) the provider marks the instance's Machine and lowers replicas, the infrastructure honours
//! the mark, and exactly that instance goes. Without Machines nothing can name an instance to the
//! infrastructure: the provider lowers replicas by one per named node (as the in-tree provider
//! does), and which instance leaves is the infrastructure's choice.

use crate::support;
use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::ListParams;
use serde_json::{Value, json};
use support::capi::{Kind, Rpc, grpc_node};
use support::procs::{Check, poll_until};
use support::real_capi_scenario::RealCapiScenario;
use support::standin;
use support::workload::{self, PodSpec};

const POOL_LABEL: &str = "cluster.x-k8s.io/pool-name";
const SETTLE: Duration = Duration::from_secs(90);

/// Creates `StandInMachinePool` `name` (with MachinePool Machines when `machines`) and MachinePool
/// `name` on it with `replicas`, bounds 1..4 and 2-CPU capacity annotations. (Nodes are named after
/// the instances, `<name>-<n>`, and are cluster-wide: each scenario's pool has its own name.)
async fn pool(s: &RealCapiScenario, name: &str, replicas: i64, machines: bool) {
    let mp = RealCapiScenario::capacity(s.mp(name, 1, 4, replicas), "2", "4Gi");
    s.create_pool(&mp, json!({standin::POOL_MACHINES_FIELD: machines}))
        .await;
}

/// What the pool is made of right now.
#[derive(Debug, PartialEq, Eq)]
struct PoolState {
    replicas: Option<i64>,
    /// The MachinePool's `spec.providerIDList` (CAPI's copy of the infrastructure's), by the
    /// instance name the stand-in gives (the id's last segment).
    listed: BTreeSet<String>,
    /// `status.nodeRefs`.
    node_refs: BTreeSet<String>,
    /// The pool's Machines (none without MachinePool Machines), with whether each has a node ref.
    machines: BTreeSet<(String, bool)>,
    nodes: BTreeSet<String>,
}

async fn pool_state(s: &RealCapiScenario, name: &str) -> Result<PoolState, String> {
    let mp = s
        .capi
        .api(Kind::MachinePool)
        .get(name)
        .await
        .map_err(|e| e.to_string())?;
    let names = |v: &Value, f: &dyn Fn(&Value) -> Option<String>| -> BTreeSet<String> {
        v.as_array().into_iter().flatten().filter_map(f).collect()
    };
    let listed = names(&mp.data["spec"]["providerIDList"], &|v| {
        v.as_str()?.rsplit('/').next().map(String::from)
    });
    let node_refs = names(&mp.data["status"]["nodeRefs"], &|v| {
        v["name"].as_str().map(String::from)
    });
    let machines = s
        .capi
        .api(Kind::Machine)
        .list(&ListParams::default().labels(&format!("{POOL_LABEL}={name}")))
        .await
        .map_err(|e| e.to_string())?
        .items
        .into_iter()
        .filter(|m| m.metadata.deletion_timestamp.is_none())
        .map(|m| {
            let linked = m.data["status"]["nodeRef"]["name"].is_string();
            (m.metadata.name.unwrap_or_default(), linked)
        })
        .collect();
    let nodes = workload::scenario_nodes(&s.client, &s.ns)
        .await?
        .into_iter()
        .collect();
    Ok(PoolState {
        replicas: mp.data["spec"]["replicas"].as_i64(),
        listed,
        node_refs,
        machines,
        nodes,
    })
}

/// Waits until the pool has replicas `want.len()`, exactly the instances `want` listed, linked and
/// with their Nodes, and (when `machines`) a Machine with a node ref for each.
async fn wait_pool(s: &RealCapiScenario, name: &str, want: &[&str], machines: bool) -> PoolState {
    let want: BTreeSet<String> = want.iter().map(|w| w.to_string()).collect();
    let result = poll_until(
        &format!("the pool is exactly {want:?}"),
        SETTLE,
        Duration::from_millis(200),
        || {
            let want = want.clone();
            async move {
                let state = match pool_state(s, name).await {
                    Ok(state) => state,
                    Err(e) => return Check::Wait(e),
                };
                let with_machines: BTreeSet<(String, bool)> =
                    want.iter().map(|w| (w.clone(), true)).collect();
                let done = state.replicas == Some(want.len() as i64)
                    && state.listed == want
                    && state.node_refs == want
                    && state.nodes == want
                    && (!machines || state.machines == with_machines);
                if done {
                    Check::Done(state)
                } else {
                    Check::Wait(format!("{state:?}"))
                }
            }
        },
    )
    .await;
    result.unwrap_or_else(|e| s.fail(&e))
}

/// A MachinePool of three instances with MachinePool Machines, pods keeping the two newest busy:
/// CA removes the empty oldest one through DeleteNodes. The provider marks its Machine and lowers
/// replicas; the stand-in infrastructure honours the mark (not its own newest-first order), deletes
/// that Machine, and CAPI removes its infrastructure machine and Node. Exactly that instance goes:
/// its Machine (the only Machine deleted, and marked), its providerID, its Node; the others stay.
#[tokio::test]
async fn cluster_autoscaler_removes_one_named_machine_pool_instance_and_only_it() {
    let mut s = RealCapiScenario::new("machinepool-named-instance").await;
    pool(&s, "mpm", 3, true).await;
    wait_pool(&s, "mpm", &["mpm-1", "mpm-2", "mpm-3"], true).await;
    for (pod, node) in [("busy-2", "mpm-2"), ("busy-3", "mpm-3")] {
        workload::create_bound_pod(&s.client, &s.ns, &PodSpec::new(pod, "1500m", "1Gi"), node)
            .await;
    }
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    let after = wait_pool(&s, "mpm", &["mpm-2", "mpm-3"], true).await;
    s.wait_deletions_done().await;
    let deletions = s.deletions.all();
    s.check(
        deletions.len() == 1 && deletions[0].machine == "mpm-1" && deletions[0].marked,
        &format!("only Machine mpm-1 deleted, and it carried the mark: {deletions:?}"),
    );
    let gone = Api::<Node>::all(s.client.clone())
        .get_opt("mpm-1")
        .await
        .ok()
        .flatten();
    s.check(gone.is_none(), "Node mpm-1 is gone");
    for pod in ["busy-2", "busy-3"] {
        s.check(
            workload::pod_exists(&s.client, &s.ns, pod).await,
            &format!("pod {pod} still runs: {after:?}"),
        );
    }
    s.passed();
}

/// A MachinePool of three instances without MachinePool Machines: DeleteNodes naming the oldest
/// instance lowers replicas by one and records the node in the pool's ledger; the infrastructure
/// (the stand-in: newest first) picks which instance leaves, so exactly one instance goes, though
/// not necessarily the named one. A retry of the same node writes nothing more (paid once).
#[tokio::test]
async fn without_machine_pool_machines_delete_nodes_costs_one_instance_of_the_infrastructures_choice()
 {
    let mut s = RealCapiScenario::new("machinepool-no-machines").await;
    pool(&s, "pool", 3, false).await;
    wait_pool(&s, "pool", &["pool-1", "pool-2", "pool-3"], false).await;
    let provider = s.start_provider(&[]).await;
    let mut rpc = Rpc::connect(provider).await;
    let id = s.capi.id(Kind::MachinePool, "pool");
    let named = grpc_node(&standin::provider_id(&s.ns, "pool-1"), "pool-1");
    if let Err(e) = rpc.delete_nodes(&id, vec![named.clone()]).await {
        s.fail(&format!("DeleteNodes(pool-1): {e}"));
    }
    let after = wait_pool(&s, "pool", &["pool-1", "pool-2"], false).await;
    s.check(
        after.machines.is_empty(),
        &format!("no Machines in this pool: {after:?}"),
    );
    if let Err(e) = rpc.delete_nodes(&id, vec![named]).await {
        s.fail(&format!("DeleteNodes(pool-1) again: {e}"));
    }
    let again = pool_state(&s, "pool").await.unwrap_or_else(|e| s.fail(&e));
    s.check(
        again.replicas == Some(2),
        &format!("the retry lowered nothing: {again:?}"),
    );
    s.passed();
}
