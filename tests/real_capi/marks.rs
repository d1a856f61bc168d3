//! Delete marks against the real MachineSet controller, driven through the provider's RPCs: the
//! absorbed-mark race, and a MachineHealthCheck remediating beside a removal.

use crate::support;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::ListParams;
use kube::{Api, Client};
use serde_json::json;
use support::CAPI_GROUP;
use support::procs::{self, Check, poll_until};
use support::real_capi::{
    DELETE_MACHINE, DEPLOYMENT_NAME, MACHINES, api, create, machines_of, machines_with_nodes,
    name_of,
};
use support::real_capi_namespace::RealCapiNamespace;
use support::standin;

/// What the Machine watcher of the race scenario saw: every Machine name, and for each Machine seen
/// being deleted whether it carried delete-machine then.
#[derive(Default)]
struct Seen {
    names: BTreeSet<String>,
    deleting: BTreeMap<String, bool>,
}

/// Records every 50 ms what [`Seen`] holds for the Machines of `md`, until aborted.
fn watch_machines(
    client: Client,
    ns: String,
    md: String,
) -> (Arc<Mutex<Seen>>, tokio::task::AbortHandle) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let record = seen.clone();
    let task = tokio::spawn(async move {
        let machines = api(&client, &ns, "v1beta2", "Machine");
        let params = ListParams::default().labels(&format!("{DEPLOYMENT_NAME}={md}"));
        loop {
            if let Ok(list) = machines.list(&params).await {
                let mut seen = record.lock().unwrap_or_else(|e| e.into_inner());
                for m in &list.items {
                    let name = name_of(m);
                    seen.names.insert(name.clone());
                    if m.metadata.deletion_timestamp.is_some() {
                        let marked = m
                            .metadata
                            .annotations
                            .as_ref()
                            .is_some_and(|a| a.contains_key(DELETE_MACHINE));
                        seen.deleting.entry(name).or_insert(marked);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .abort_handle();
    (seen, task)
}

/// The absorbed-mark race against the real MachineSet controller: DeleteNodes and IncreaseSize
/// back to back, in both orders, round after round, on a group of 3 (the provider's repair every
/// 1 s, marks taken back after a 3 s grace). Whatever CAPI makes of each pair (the marked Machine
/// deleted and replaced, or its mark absorbed by the raise and taken back), no Machine is ever
/// deleted without its mark, only the Machines named to DeleteNodes ever go, and each round
/// settles at 3 Machines with Nodes and no mark. (A DeleteNodes right after the raise is refused
/// until CAPI has created the raise's Machine, and asked again, as CA would.)
#[tokio::test]
async fn delete_nodes_and_increase_size_back_to_back_never_cost_an_unmarked_machine() {
    const ROUNDS: usize = 6;
    let s = RealCapiNamespace::new(&[]).await;
    s.plain_group("race", ("1", "5", 3)).await;
    s.machines("race", 3).await;
    let (seen, watcher) = watch_machines(s.client.clone(), s.ns.clone(), "race".into());
    let provider = s
        .provider_with(&["--repair-interval=1s", "--mark-grace-period=3s"])
        .await;
    let (mut rpc, id) = s.served_group(&provider).await;
    let fail = |message: String| -> ! { s.fail(message, &provider, None) };

    let mut victims = BTreeSet::new();
    let mut outcomes = Vec::new();
    let mut refused_before_created = 0;
    for round in 0..ROUNDS {
        let delete_first = round % 2 == 0;
        let current = s
            .wait_settled(
                &format!("round {round}: race settled at 3 Machines with Nodes, none marked"),
                "race",
                3,
            )
            .await
            .unwrap_or_else(|e| fail(e));
        // Not the Machine CAPI's own order (Random: ties by name) would take without a mark.
        let victim = current.last().expect("three Machines").clone();
        let node = s.grpc_node(&victim).await;
        victims.insert(victim.clone());
        let t = Instant::now();
        let (first, second) = if delete_first {
            (
                rpc.delete_nodes(&id, vec![node]).await,
                rpc.increase(&id, 1).await,
            )
        } else {
            let raised = rpc.increase(&id, 1).await;
            // Right after the raise CAPI may not have created the Machine for it yet: DeleteNodes
            // is then refused (a decrement would cancel that Machine and the victim would stay),
            // and asked again, as CA does on its next loop, until the Machine exists.
            let mut deleted = rpc.delete_nodes(&id, vec![node.clone()]).await;
            while let Err(e) = &deleted {
                let not_created = e.code() == tonic::Code::FailedPrecondition
                    && e.message()
                        .contains("Cluster API creates Machines for them first");
                if !not_created || t.elapsed() > MACHINES {
                    break;
                }
                refused_before_created += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
                deleted = rpc.delete_nodes(&id, vec![node.clone()]).await;
            }
            (deleted, raised)
        };
        if let Err(e) = first.and(second) {
            fail(format!("round {round}: {e}"));
        }
        let pair = t.elapsed();
        // The round is over when the victim went and was replaced, or its mark was taken back.
        let outcome = poll_until(
            &format!("round {round}: Machine {victim} deleted or its mark taken back"),
            MACHINES,
            Duration::from_millis(100),
            || async {
                let all = match machines_of(&s.client, &s.ns, "race").await {
                    Ok(all) => all,
                    Err(e) => return Check::Wait(e),
                };
                let victim_state = all.iter().find(|(name, _)| *name == victim);
                let settled = all.len() == 3 && all.iter().all(|(_, marked)| !*marked);
                match victim_state {
                    None if settled => Check::Done("deleted"),
                    Some((_, false)) if settled => Check::Done("absorbed"),
                    _ => Check::Wait(format!("Machines {all:?}")),
                }
            },
        )
        .await
        .unwrap_or_else(|e| fail(e));
        outcomes.push(format!(
            "{}: {outcome} ({:.1}s, pair {:.0}ms)",
            if delete_first {
                "delete+raise"
            } else {
                "raise+delete"
            },
            t.elapsed().as_secs_f64(),
            pair.as_secs_f64() * 1000.0
        ));
    }
    watcher.abort();
    let seen = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
    let unmarked: Vec<&String> = seen
        .deleting
        .iter()
        .filter(|(_, marked)| !**marked)
        .map(|(name, _)| name)
        .collect();
    if !unmarked.is_empty() {
        fail(format!(
            "Machines deleted without their mark: {unmarked:?}; outcomes {outcomes:?}"
        ));
    }
    let remaining: BTreeSet<String> = machines_of(&s.client, &s.ns, "race")
        .await
        .unwrap_or_else(|e| fail(e))
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    let gone: BTreeSet<String> = seen.names.difference(&remaining).cloned().collect();
    if !gone.is_subset(&victims) {
        fail(format!(
            "Machines gone that nobody named: {:?}; outcomes {outcomes:?}",
            gone.difference(&victims).collect::<Vec<_>>()
        ));
    }
    let errors = s.standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-absorbed-mark-race passed in {:.1}s: {ROUNDS} rounds, none cost an \
         unmarked Machine ({} deleted, all marked): {outcomes:?}; DeleteNodes refused \
         {refused_before_created} times before the raise's Machine existed",
        s.started.elapsed().as_secs_f64(),
        seen.deleting.len(),
    ));
}

/// DecreaseTargetSize while a Machine of the group is being deleted, against the real MachineSet
/// controller. The Machine (held in deletion by a finalizer of the test, as a slow drain or
/// infrastructure would) still counts toward its MachineSet's replicas, so after a raise back to 3
/// Cluster API creates nothing until it is gone, and then creates its replacement. A decrement now
/// would race that replacement (it may register before the MachineSet acts on the decrement, and a
/// registered Machine go unmarked: what the random test caught): the call is refused with nothing
/// written. Released, the Machine goes, the replacement registers, and no other Machine goes.
#[tokio::test]
async fn a_decrease_while_a_machine_is_being_deleted_is_refused_and_only_that_machine_goes() {
    const HOLD: &str = "e2e.capi-autoscaler-provider/hold";
    let s = RealCapiNamespace::new(&[]).await;
    s.plain_group("replace", ("1", "5", 3)).await;
    let machines = s.machines("replace", 3).await;
    let deleted = s.watch_deletions();
    let provider = s.provider().await;
    let (mut rpc, id) = s.served_group(&provider).await;
    let fail = |message: String| -> ! { s.fail(message, &provider, None) };
    let held = machines[0].clone();
    let machine_api = api(&s.client, &s.ns, "v1beta2", "Machine");
    let finalizers = |extra: Option<&str>| {
        let machine_api = machine_api.clone();
        let held = held.clone();
        let extra = extra.map(str::to_string);
        async move {
            let machine = machine_api
                .get(&held)
                .await
                .unwrap_or_else(|e| panic!("get Machine {held}: {e}"));
            let mut list: Vec<String> = machine
                .metadata
                .finalizers
                .unwrap_or_default()
                .into_iter()
                .filter(|f| f != HOLD)
                .collect();
            list.extend(extra);
            json!({"metadata": {"finalizers": list, "resourceVersion": machine.metadata.resource_version}})
        }
    };
    s.patch("Machine", &held, finalizers(Some(HOLD)).await)
        .await;

    let node = s.grpc_node(&held).await;
    if let Err(e) = rpc.delete_nodes(&id, vec![node]).await {
        fail(format!("DeleteNodes of {held}: {e}"));
    }
    s.until(
        &format!("{held} being deleted, held by the test's finalizer"),
        MACHINES,
        &provider,
        None,
        || async {
            match deleted.names().contains(&held) {
                true => Check::Done(()),
                false => Check::Wait(format!("deleted {:?}", deleted.names())),
            }
        },
    )
    .await;
    if let Err(e) = rpc.increase(&id, 1).await {
        fail(format!("IncreaseSize back to 3: {e}"));
    }
    // The MachineSet has acted on 3: it counts the held Machine, so it creates nothing yet.
    let sets = api(&s.client, &s.ns, "v1beta2", "MachineSet");
    s.until(
        "the MachineSet at 3 replicas, observed",
        MACHINES,
        &provider,
        None,
        || async {
            match support::real_capi::of_deployment(&sets, "replace").await {
                Ok(list) if list.len() == 1 => {
                    let ms = &list[0].data;
                    let observed =
                        ms["status"]["observedGeneration"].as_i64() >= list[0].metadata.generation;
                    match (ms["spec"]["replicas"].as_i64(), observed) {
                        (Some(3), true) => Check::Done(()),
                        other => Check::Wait(format!("MachineSet replicas, observed: {other:?}")),
                    }
                }
                Ok(list) => Check::Wait(format!("{} MachineSets", list.len())),
                Err(e) => Check::Wait(e),
            }
        },
    )
    .await;
    let before = machines_of(&s.client, &s.ns, "replace")
        .await
        .unwrap_or_else(|e| fail(e));

    let refusal = match rpc.decrease(&id, -1).await {
        Ok(()) => fail(format!(
            "DecreaseTargetSize(-1) answered OK beside {held} being deleted; Machines {before:?}"
        )),
        Err(e) => e,
    };
    if refusal.code() != tonic::Code::FailedPrecondition
        || !refusal
            .message()
            .contains("replacements of Machines being deleted")
    {
        fail(format!("DecreaseTargetSize(-1): {refusal:?}"));
    }
    match s.replicas("replace").await {
        Ok(3) => {}
        other => fail(format!(
            "replicas after the refused DecreaseTargetSize: {other:?}"
        )),
    }

    s.patch("Machine", &held, finalizers(None).await).await;
    let after = s
        .wait_settled(
            "the held Machine gone and replaced: 3 Machines with Nodes, none marked",
            "replace",
            3,
        )
        .await
        .unwrap_or_else(|e| fail(e));
    let gone = deleted.names();
    if gone != BTreeSet::from([held.clone()]) {
        fail(format!("Machines deleted: {gone:?}, want only {held}"));
    }
    procs::announce(&format!(
        "e2e: scenario real-capi-decrease-beside-a-deletion passed in {:.1}s: DecreaseTargetSize refused \
         while {held} was being deleted ({}), replicas kept at 3; released, it was replaced: {after:?}",
        s.started.elapsed().as_secs_f64(),
        refusal.message(),
    ));
}

/// A MachineHealthCheck remediating one Machine while this provider removes another of the same
/// group: the real MachineSet controller deletes the unhealthy Machine and replaces it, and deletes
/// the marked one; replicas drop by exactly one (no double decrement), the third Machine is never
/// touched, no Machine goes unmarked but the remediated one, and nothing is left marked.
#[tokio::test]
async fn a_machine_health_check_remediation_beside_delete_nodes_costs_nothing_extra() {
    let s = RealCapiNamespace::new(&[]).await;
    s.plain_group("heal", ("1", "5", 3)).await;
    let mhc = json!({
        "apiVersion": format!("{CAPI_GROUP}/v1beta2"),
        "kind": "MachineHealthCheck",
        "metadata": {"name": "heal"},
        "spec": {
            "clusterName": "workload",
            "selector": {"matchLabels": {DEPLOYMENT_NAME: "heal"}},
            "checks": {"unhealthyNodeConditions": [
                {"type": "Ready", "status": "False", "timeoutSeconds": 1},
            ]},
        },
    });
    create(
        &api(&s.client, &s.ns, "v1beta2", "MachineHealthCheck"),
        &mhc,
    )
    .await
    .unwrap_or_else(|e| panic!("create MachineHealthCheck {}/heal: {e}", s.ns));
    let machines = s.machines("heal", 3).await;
    let (sick, untouched, removed) = (
        machines[0].clone(),
        machines[1].clone(),
        machines[2].clone(),
    );
    let (seen, watcher) = watch_machines(s.client.clone(), s.ns.clone(), "heal".into());
    let provider = s.provider().await;
    let (mut rpc, id) = s.served_group(&provider).await;
    let node = s.grpc_node(&removed).await;
    let fail = |message: String| -> ! { s.fail(message, &provider, None) };

    let t = Instant::now();
    standin::set_node_ready(&s.client, &sick, false).await;
    rpc.delete_nodes(&id, vec![node])
        .await
        .unwrap_or_else(|e| fail(format!("DeleteNodes {removed}: {e}")));
    let left = poll_until(
        &format!("{sick} remediated and replaced, {removed} removed, {untouched} kept"),
        Duration::from_secs(90),
        Duration::from_millis(200),
        || async {
            let all = match machines_of(&s.client, &s.ns, "heal").await {
                Ok(all) => all,
                Err(e) => return Check::Wait(e),
            };
            let names: BTreeSet<&String> = all.iter().map(|(n, _)| n).collect();
            if !names.contains(&untouched) {
                return Check::Fatal(format!("Machine {untouched} went: {all:?}"));
            }
            let settled = all.len() == 2
                && !names.contains(&sick)
                && !names.contains(&removed)
                && all.iter().all(|(_, marked)| !*marked);
            if !settled {
                return Check::Wait(format!("Machines {all:?}"));
            }
            match machines_with_nodes(&s.client, &s.ns, "heal", 2).await {
                Check::Done(names) => Check::Done(names),
                Check::Wait(why) => Check::Wait(why),
                Check::Fatal(e) => Check::Fatal(e),
            }
        },
    )
    .await
    .unwrap_or_else(|e| fail(e));
    let took = t.elapsed();
    watcher.abort();
    assert_eq!(
        s.replicas("heal").await,
        Ok(2),
        "replicas dropped by exactly one"
    );
    let seen = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
    let unmarked: Vec<&String> = seen
        .deleting
        .iter()
        .filter(|(name, marked)| !**marked && **name != sick)
        .map(|(name, _)| name)
        .collect();
    if !unmarked.is_empty() {
        fail(format!(
            "Machines deleted without a mark besides the remediated {sick}: {unmarked:?}"
        ));
    }
    if seen.deleting.get(&removed) != Some(&true) {
        fail(format!(
            "Machine {removed} was not seen deleting with its mark: {:?}",
            seen.deleting
        ));
    }
    let nodes: Api<Node> = Api::all(s.client.clone());
    for gone in [&sick, &removed] {
        if !matches!(nodes.get_opt(gone).await, Ok(None)) {
            fail(format!("Node {gone} is still there"));
        }
    }
    let errors = s.standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-health-check passed in {:.1}s: Node {sick} NotReady + DeleteNodes \
         {removed} -> remediated and replaced, removed, {untouched} kept, replicas 3 -> 2, in {:.1}s \
         (left: {left:?})",
        s.started.elapsed().as_secs_f64(),
        took.as_secs_f64(),
    ));
}
