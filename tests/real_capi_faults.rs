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
use support::capi::grpc_node;
use support::capi_manager::CapiManager;
use support::procs::{self, Check, poll_until};
use support::real_capi::{MACHINES, api, machines_with_nodes};
use support::real_capi_namespace::RealCapiNamespace;

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
    let s = RealCapiNamespace::new(&[]).await;
    let manager = s.manager;
    let ns = &s.ns;
    s.plain_group("group", ("1", "3", 2)).await;
    let machines = s.machines("group", 2).await;
    // CAPI's own order (Random, ties by name) would take the first: remove the other.
    let kept = machines.first().expect("two Machines").clone();
    let victim = machines.last().expect("two Machines").clone();
    let machine_api = api(&s.client, &s.ns, "v1beta2", "Machine");
    let (victim_id, victim_node) = s.provider_id_and_node(&victim).await;
    pinned_pod(&s.client, &s.ns, &victim_node).await;

    let provider = s.provider().await;
    let (mut rpc, id) = s.served_group(&provider).await;
    let fail = |message: String| -> ! { s.fail(message, &provider, None) };

    // Killed before the scale-down: the mark is refused by CAPI's unreachable webhook.
    manager.kill();
    let refused = rpc
        .delete_nodes(&id, vec![grpc_node(&victim_id, &victim_node)])
        .await;
    let status = match refused {
        Ok(()) => fail("DeleteNodes succeeded while CAPI's webhooks were down".into()),
        Err(status) => status,
    };
    let marks = s.marked("group").await;
    if !marks.is_empty() || s.replicas("group").await != Ok(2) {
        fail(format!(
            "after the refused DeleteNodes: marked {marks:?}, replicas {:?}; want none and 2",
            s.replicas("group").await
        ));
    }
    let first_restart = restart(manager).await;

    rpc.delete_nodes(&id, vec![grpc_node(&victim_id, &victim_node)])
        .await
        .unwrap_or_else(|e| fail(format!("DeleteNodes after the restart: {e}")));
    let t_down = Instant::now();
    let marks = s.marked("group").await;
    if marks != BTreeSet::from([victim.clone()]) || s.replicas("group").await != Ok(1) {
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
    let nodes: Api<Node> = Api::all(s.client.clone());
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.ns);
    if !matches!(pods.get_opt("pinned").await, Ok(Some(_))) {
        fail("the pinned pod went although its budget refuses eviction".into());
    }
    Api::<PodDisruptionBudget>::namespaced(s.client.clone(), &s.ns)
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
        || machines_with_nodes(&s.client, &s.ns, "group", 1),
    )
    .await
    .unwrap_or_else(|e| fail(e));
    assert_eq!(left, BTreeSet::from([kept.clone()]), "only {victim} went");
    assert!(s.marked("group").await.is_empty(), "nothing left marked");
    assert_eq!(s.replicas("group").await, Ok(1));
    let finished = s
        .standin
        .actions()
        .iter()
        .any(|(_, a)| a == &format!("pod {ns}/pinned finished"));
    assert!(
        finished,
        "the evicted pod (grace period 30 s) was finished by the stand-in kubelet"
    );
    let errors = s.standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-manager-killed passed in {:.1}s: DeleteNodes with the manager dead \
         refused ({:?}: {}), nothing written; restarts healthy in {:.1}s and {:.1}s; DeleteNodes -> \
         Machine, Node and pod gone {:.1}s (the manager killed while CAPI drained the Node)",
        s.started.elapsed().as_secs_f64(),
        status.code(),
        status.message(),
        first_restart.as_secs_f64(),
        second_restart.as_secs_f64(),
        down.as_secs_f64(),
    ));
}
