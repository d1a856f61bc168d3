//! The real Cluster API manager killed (SIGKILL) and restarted around this provider's scale-down. A
//! binary of its own: a dead manager takes CAPI's webhooks with it, so every create or update of a
//! Cluster API object is refused meanwhile, which would fail the scenarios of tests/real_capi/.
//! Assertions are on objects, never on log text.

pub mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use support::capi::{Rpc, grpc_node};
use support::capi_manager::{CapiManager, capi_manager};
use support::procs::{self, Check, poll_until};
use support::real_capi::{
    MACHINES, api, create, machine_deployment, machines_of, machines_with_nodes, replicas,
};
use support::standin::{self, StandIn};
use support::start_provider;

/// The Machines of `md` that carry delete-machine.
async fn marked(client: &Client, ns: &str, md: &str) -> BTreeSet<String> {
    machines_of(client, ns, md)
        .await
        .unwrap_or_else(|e| panic!("list the Machines of {md}: {e}"))
        .into_iter()
        .filter(|(_, marked)| *marked)
        .map(|(name, _)| name)
        .collect()
}

async fn restart(manager: &CapiManager) -> Duration {
    manager
        .restart()
        .await
        .unwrap_or_else(|e| panic!("restart the CAPI manager: {e}"))
}

/// A pod on Node `node` with a grace period (a kubelet, here the stand-in, ends it after an
/// eviction) and a PodDisruptionBudget that refuses its eviction: no disruption controller runs, so
/// the budget never gets the observed status the eviction API needs.
async fn pinned_pod(client: &Client, ns: &str, node: &str) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "pinned", "labels": {"app": "pinned"}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 30,
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
        },
    }))
    .expect("a Pod");
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    pods.create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("create pod {ns}/pinned: {e}"));
    // Running and Ready, as a kubelet reports it: the eviction API lets a Pending pod go whatever
    // its budget says, and the stand-in kubelet reports no pod status.
    let status = json!({"status": {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
    }});
    pods.patch_status("pinned", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap_or_else(|e| panic!("report pod {ns}/pinned Running: {e}"));
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "pinned"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "pinned"}}},
    }))
    .expect("a PodDisruptionBudget");
    Api::<PodDisruptionBudget>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pdb)
        .await
        .unwrap_or_else(|e| panic!("create PodDisruptionBudget {ns}/pinned: {e}"));
}

/// DeleteNodes while CAPI's manager is dead fails and writes nothing (CAPI's webhooks refuse the
/// mark, so replicas are not lowered either); after a restart it marks the Machine and lowers
/// replicas; the manager killed again while its drain of that Node is held by a
/// PodDisruptionBudget and restarted with the budget gone finishes the scale-down: that Machine,
/// its Node and its pod go, the other Machine is never touched, nothing is left marked.
#[tokio::test]
async fn a_scale_down_survives_the_capi_manager_killed_before_and_during_it() {
    let manager = capi_manager();
    let cp = manager.cp;
    let client = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let started = Instant::now();
    standin::workload_cluster(&client, cp, &ns, "workload").await;
    let standin = StandIn::start(client.clone(), &ns);
    standin::create_template(&client, &ns, "small", &[]).await;
    let mut md = machine_deployment("group", "workload", "small", "1", "3");
    md["spec"]["replicas"] = json!(2);
    create(&api(&client, &ns, "v1beta2", "MachineDeployment"), &md)
        .await
        .unwrap_or_else(|e| panic!("create MachineDeployment {ns}/group: {e}"));
    let machines = poll_until(
        "two Machines of group with Nodes",
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(&client, &ns, "group", 2),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // CAPI's own order (Random, ties by name) would take the first: remove the other.
    let kept = machines.first().expect("two Machines").clone();
    let victim = machines.last().expect("two Machines").clone();
    let machine_api = api(&client, &ns, "v1beta2", "Machine");
    let victim_object = machine_api
        .get(&victim)
        .await
        .unwrap_or_else(|e| panic!("get Machine {victim}: {e}"));
    let victim_node = victim_object.data["status"]["nodeRef"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let victim_id = victim_object.data["spec"]["providerID"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    pinned_pod(&client, &ns, &victim_node).await;

    let provider = start_provider(
        &[
            "--node-group-auto-discovery",
            &format!("clusterapi:namespace={ns}"),
        ],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    let ids = rpc.ids_in(&ns).await;
    let id = ids.first().expect("the group is served").clone();
    let fail = |message: String| -> ! {
        panic!(
            "{message}\nstand-in actions: {:?}\n--- provider log ---\n{}\n--- CAPI manager log (tail) ---\n{}",
            standin.actions(),
            procs::log_tail(&provider.log, 4000),
            manager.log_tail()
        )
    };

    // Killed before the scale-down: the mark is refused by CAPI's unreachable webhook.
    manager.kill();
    let refused = rpc
        .delete_nodes(&id, vec![grpc_node(&victim_id, &victim_node)])
        .await;
    let status = match refused {
        Ok(()) => fail("DeleteNodes succeeded while CAPI's webhooks were down".into()),
        Err(status) => status,
    };
    let marks = marked(&client, &ns, "group").await;
    if !marks.is_empty() || replicas(&client, &ns, "group").await != Ok(2) {
        fail(format!(
            "after the refused DeleteNodes: marked {marks:?}, replicas {:?}; want none and 2",
            replicas(&client, &ns, "group").await
        ));
    }
    let first_restart = restart(manager).await;

    rpc.delete_nodes(&id, vec![grpc_node(&victim_id, &victim_node)])
        .await
        .unwrap_or_else(|e| fail(format!("DeleteNodes after the restart: {e}")));
    let t_down = Instant::now();
    let marks = marked(&client, &ns, "group").await;
    if marks != BTreeSet::from([victim.clone()]) || replicas(&client, &ns, "group").await != Ok(1) {
        fail(format!(
            "after DeleteNodes: marked {marks:?}, want only {victim}; replicas 1"
        ));
    }

    // Killed during the scale-down: CAPI is draining the Machine's Node, held by the budget.
    poll_until(
        &format!("CAPI draining the Node of Machine {victim}"),
        MACHINES,
        Duration::from_millis(100),
        || async {
            match machine_api.get_opt(&victim).await {
                Ok(Some(m)) => {
                    let draining = m.data["status"]["conditions"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|c| c["type"] == "Deleting" && c["reason"] == "DrainingNode");
                    if m.metadata.deletion_timestamp.is_some() && draining {
                        Check::Done(())
                    } else {
                        Check::Wait(format!("conditions {}", m.data["status"]["conditions"]))
                    }
                }
                Ok(None) => Check::Fatal(format!("Machine {victim} went despite the budget")),
                Err(e) => Check::Wait(e.to_string()),
            }
        },
    )
    .await
    .unwrap_or_else(|e| fail(e));
    manager.kill();
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    if !matches!(pods.get_opt("pinned").await, Ok(Some(_))) {
        fail("the pinned pod went although its budget refuses eviction".into());
    }
    Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns)
        .delete("pinned", &DeleteParams::default())
        .await
        .unwrap_or_else(|e| fail(format!("delete PodDisruptionBudget {ns}/pinned: {e}")));
    let second_restart = restart(manager).await;
    poll_until(
        &format!("Machine {victim}, Node {victim_node} and the pinned pod gone"),
        Duration::from_secs(90),
        Duration::from_millis(250),
        || async {
            let machine = machine_api.get_opt(&victim).await;
            let node = nodes.get_opt(&victim_node).await;
            let pod = pods.get_opt("pinned").await;
            match (machine, node, pod) {
                (Ok(None), Ok(None), Ok(None)) => Check::Done(()),
                (m, n, p) => Check::Wait(format!(
                    "Machine present {:?}, Node present {:?}, pod present {:?}",
                    m.map(|x| x.is_some()),
                    n.map(|x| x.is_some()),
                    p.map(|x| x.is_some())
                )),
            }
        },
    )
    .await
    .unwrap_or_else(|e| fail(e));
    let down = t_down.elapsed();
    let left = poll_until(
        "the other Machine with its Node",
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(&client, &ns, "group", 1),
    )
    .await
    .unwrap_or_else(|e| fail(e));
    assert_eq!(left, BTreeSet::from([kept.clone()]), "only {victim} went");
    assert!(
        marked(&client, &ns, "group").await.is_empty(),
        "nothing left marked"
    );
    assert_eq!(replicas(&client, &ns, "group").await, Ok(1));
    let finished = standin
        .actions()
        .iter()
        .any(|(_, a)| a == &format!("pod {ns}/pinned finished"));
    assert!(
        finished,
        "the evicted pod (grace period 30 s) was finished by the stand-in kubelet"
    );
    let errors = standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-manager-killed passed in {:.1}s: DeleteNodes with the manager dead \
         refused ({:?}: {}), nothing written; restarts healthy in {:.1}s and {:.1}s; DeleteNodes -> \
         Machine, Node and pod gone {:.1}s (the manager killed while CAPI drained the Node)",
        started.elapsed().as_secs_f64(),
        status.code(),
        status.message(),
        first_restart.as_secs_f64(),
        second_restart.as_secs_f64(),
        down.as_secs_f64(),
    ));
}
