//! A drain that a PodDisruptionBudget governs, with the real kube-controller-manager (its
//! disruption, ReplicaSet and Deployment controllers; tests/support/controller_manager.rs) on a
//! control plane and real CAPI manager of their own: while the budget allows no disruption CA
//! removes nothing; once it allows one, CA evicts the pod through the Eviction API, calls
//! DeleteNodes, CAPI's own drain and Node deletion complete, and the Deployment's ReplicaSet runs
//! the pod again on the other Node.

use crate::support;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use support::controller_manager::capi_with_controller_manager;
use support::procs::{self, Check, poll_until};
use support::real_capi_scenario::RealCapiScenario;
use support::workload;

/// A pod of Deployment `app` as last seen: name, Node, Ready.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Running {
    name: String,
    node: String,
    ready: bool,
}

/// Deployment `name` of one replica (a pod of `cpu` and 512Mi, 30 s grace period, on the scenario's
/// Nodes; on Node `node` when given).
fn deployment(ns: &str, name: &str, cpu: &str, node: Option<&str>) -> Deployment {
    let spec = workload::graceful_spec(ns, cpu, node);
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }))
    .expect("a Deployment")
}

/// The pods of Deployment `app` not being deleted.
async fn running(client: &Client, ns: &str, app: &str) -> Result<Vec<Running>, String> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await
        .map_err(|e| format!("list the pods of {app}: {e}"))?;
    Ok(pods
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| Running {
            name: p.metadata.name.unwrap_or_default(),
            node: p.spec.and_then(|s| s.node_name).unwrap_or_default(),
            ready: p
                .status
                .and_then(|s| s.conditions)
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
        })
        .collect())
}

/// Waits until Deployment `app` has exactly one pod, Ready, on Node `node`.
async fn wait_running_on(s: &RealCapiScenario, app: &str, node: &str) -> Running {
    let (client, ns) = (&s.client, &s.ns);
    poll_until(
        &format!("one Ready pod of {app} on {node}"),
        Duration::from_secs(90),
        Duration::from_millis(200),
        || async move {
            match running(client, ns, app).await {
                Ok(pods) if pods.len() == 1 && pods[0].node == node && pods[0].ready => {
                    Check::Done(pods[0].clone())
                }
                Ok(pods) => Check::Wait(format!("pods {pods:?}")),
                Err(e) => Check::Wait(e),
            }
        },
    )
    .await
    .unwrap_or_else(|e| s.fail(&e))
}

/// Waits until the disruption controller computed PodDisruptionBudget `name` for its current
/// generation with `healthy` healthy pods and `allowed` disruptions allowed.
async fn wait_budget(s: &RealCapiScenario, name: &str, healthy: i32, allowed: i32) {
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(s.client.clone(), &s.ns);
    let budgets = &budgets;
    poll_until(
        &format!("PodDisruptionBudget {name}: {healthy} healthy, {allowed} disruptions allowed"),
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async move {
            match budgets.get(name).await {
                Ok(b) => {
                    let generation = b.metadata.generation;
                    match b.status {
                        Some(st)
                            if st.observed_generation == generation
                                && st.current_healthy == Some(healthy)
                                && st.disruptions_allowed == Some(allowed) =>
                        {
                            Check::Done(())
                        }
                        st => Check::Wait(format!("generation {generation:?}, status {st:?}")),
                    }
                }
                Err(e) => Check::Wait(e.to_string()),
            }
        },
    )
    .await
    .unwrap_or_else(|e| s.fail(&e));
}

async fn cordon(s: &RealCapiScenario, node: &str, unschedulable: bool) {
    Api::<Node>::all(s.client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"unschedulable": unschedulable}})),
        )
        .await
        .unwrap_or_else(|e| s.fail(&format!("cordon {node} = {unschedulable}: {e}")));
}

/// Of two Nodes of a group (min 1), one runs Deployment `stay` at 60 % (CA keeps it), the other
/// Deployment `app`'s only pod at 25 %, which fits the first; a PodDisruptionBudget covers `app`.
/// While the budget allows no disruption (minAvailable 1, computed by the real disruption
/// controller from the pod the stand-in kubelet reports Ready), CA removes nothing over several
/// loops. Once it allows one (maxUnavailable 1), CA evicts the pod (it stays Terminating until the
/// stand-in kubelet ends it) and calls DeleteNodes; CAPI's own drain and Node deletion complete;
/// the ReplicaSet's new pod runs, Ready, on the other Node; exactly that Machine and Node went, and
/// every Machine CAPI deleted carried the mark.
#[tokio::test]
async fn cluster_autoscaler_drains_a_node_within_its_pod_disruption_budget() {
    let mut s = RealCapiScenario::on("real-capi-drain-pdb", capi_with_controller_manager()).await;
    s.standin.run_pods();
    // Placed by the real scheduler before CA (which would start it) runs.
    support::autoscaler::ensure_scheduler(s.cp);
    s.template("small", "2", "4Gi", true).await;
    let md = s.md("drain", "small", 1, 3, 2);
    s.create_md(&md).await;
    let machines = s.wait_machines_with_nodes("drain", 2).await;
    let (kept, drained) = (machines[0].clone(), machines[1].clone());
    let ns = s.ns.clone();
    let deployments: Api<Deployment> = Api::namespaced(s.client.clone(), &ns);
    deployments
        .create(
            &PostParams::default(),
            &deployment(&ns, "stay", "1200m", Some(&kept)),
        )
        .await
        .unwrap_or_else(|e| s.fail(&format!("create Deployment stay: {e}")));
    // The kept Node cordoned while the scheduler places app's pod: it lands on the other one.
    cordon(&s, &kept, true).await;
    deployments
        .create(
            &PostParams::default(),
            &deployment(&ns, "app", "500m", None),
        )
        .await
        .unwrap_or_else(|e| s.fail(&format!("create Deployment app: {e}")));
    let first = wait_running_on(&s, "app", &drained).await;
    cordon(&s, &kept, false).await;
    let stay = wait_running_on(&s, "stay", &kept).await;

    let budget: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "app"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "app"}}},
    }))
    .expect("a PodDisruptionBudget");
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(s.client.clone(), &ns);
    budgets
        .create(&PostParams::default(), &budget)
        .await
        .unwrap_or_else(|e| s.fail(&format!("create PodDisruptionBudget app: {e}")));
    wait_budget(&s, "app", 1, 0).await;

    s.start_provider(&[]).await;
    let ca = s.autoscaler();
    s.start_ca(ca).await;
    let t_blocked = Instant::now();
    s.wait_loops(6).await;
    let blocked = t_blocked.elapsed();
    let machines = s.machine_names().await;
    s.check(
        machines.len() == 2 && s.deletions.all().is_empty(),
        &format!("while the budget allows no disruption: Machines {machines:?}, none deleted"),
    );
    s.check(
        s.replicas("drain").await == 2,
        "replicas stay 2 while the budget allows no disruption",
    );
    let pods = running(&s.client, &ns, "app")
        .await
        .unwrap_or_else(|e| s.fail(&e));
    s.check(
        pods == vec![first.clone()],
        &format!("app's pod not evicted while the budget allows no disruption: {pods:?}"),
    );
    let reasons = workload::pod_event_reasons(&s.client, &ns, &first.name).await;
    s.check(
        !reasons.iter().any(|r| r == "ScaleDown"),
        &format!("CA did not try to evict app's pod: its Events {reasons:?}"),
    );

    let t_down = Instant::now();
    budgets
        .patch(
            "app",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"minAvailable": null, "maxUnavailable": 1}})),
        )
        .await
        .unwrap_or_else(|e| s.fail(&format!("allow one disruption of app: {e}")));
    s.wait_replicas("drain", 1, Duration::from_secs(120)).await;
    s.wait_nodes(std::slice::from_ref(&kept)).await;
    s.wait_deletions_done().await;
    let down = t_down.elapsed();
    let again = wait_running_on(&s, "app", &kept).await;
    s.check(
        again.name != first.name,
        &format!("the ReplicaSet made a new pod: {again:?}, the evicted one {first:?}"),
    );
    // CA's eviction (not only CAPI's drain): CA records ScaleDown on each pod it evicts.
    let (client, evicted) = (&s.client, &first.name);
    poll_until(
        &format!("CA's ScaleDown Event on {evicted}"),
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let reasons = workload::pod_event_reasons(client, &ns, evicted).await;
            if reasons.iter().any(|r| r == "ScaleDown") {
                Check::Done(())
            } else {
                Check::Wait(format!("Events {reasons:?}"))
            }
        },
    )
    .await
    .unwrap_or_else(|e| s.fail(&e));
    let finished = format!("pod {ns}/{} finished", first.name);
    s.check(
        s.standin.actions().iter().any(|(_, a)| *a == finished),
        "the evicted pod stayed Terminating until the stand-in kubelet ended it",
    );
    let stays = running(&s.client, &ns, "stay")
        .await
        .unwrap_or_else(|e| s.fail(&e));
    s.check(
        stays == vec![stay.clone()],
        &format!("the kept Node's pod stays: {stays:?}"),
    );
    let machines = s.machine_names().await;
    s.check(
        machines == vec![kept.clone()],
        &format!("only {drained} went: Machines {machines:?}"),
    );
    let deleted = s.deleted_marked();
    s.check(
        deleted == vec![drained.clone()],
        &format!("CAPI deleted the Machine of {drained} for its mark: {deleted:?}"),
    );
    s.check_every_deletion_marked();
    if let Some(ca) = s.ca.as_mut()
        && let Err(e) = ca.check_alive()
    {
        panic!("{e}");
    }
    let errors = s.standin.errors();
    s.check(errors.is_empty(), &format!("stand-in errors: {errors:?}"));
    procs::announce(&format!(
        "e2e: scenario real-capi-drain-pdb: 6 CA loops with the budget at 0 removed nothing \
         ({:.1}s); budget raised -> pod evicted, Machine and Node {drained} deleted by CAPI, \
         the new pod Ready on {kept} {:.1}s",
        blocked.as_secs_f64(),
        down.as_secs_f64(),
    ));
    s.passed();
}
