//! The group rules as Cluster API applies them (issue 21), with the real CA and the real CAPI
//! manager: a delete mark someone else wrote, DecreaseTargetSize beside a mark and during a
//! rollout, replicas lowered by hand just before a DeleteNodes, a rollout-paused MachineDeployment,
//! a paused Cluster, max lowered below replicas. Each scenario records which Machines CAPI deleted
//! (a 100 ms watcher: seen with a deletionTimestamp, or gone).

use crate::support;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams};
use serde_json::json;
use support::ProviderProcess;
use support::autoscaler::{self, AutoscalerProcess};
use support::capi::{Rpc, grpc_node};
use support::procs::{self, Check, poll_until};
use support::real_capi::{
    CAPACITY, DELETE_MACHINE, MACHINES, MAX_SIZE, api, create, machine_deployment,
    machines_with_nodes,
};
use support::real_capi_namespace::{RealCapiNamespace, SIZE};
use support::standin;
use support::workload::{self, PodSpec, scenario_labels};

/// How many times the provider answered `method` with `code`.
async fn answered(provider: &ProviderProcess, method: &str, code: &str) -> u64 {
    let text = autoscaler::http_get(&provider.metrics_address, "/metrics")
        .await
        .unwrap_or_default();
    autoscaler::metric_sum(
        &text,
        "capi_autoscaler_provider_grpc_requests_total",
        &[("method", method), ("code", code)],
    ) as u64
}

/// CA's log lines about the provider's refusals and what it did next (the failed scale-down, its
/// taint taken off, the next attempt), for the record (not asserted on).
fn refusals_in(ca: &AutoscalerProcess) -> String {
    let log = ca.log_contents();
    let mut lines: Vec<String> = Vec::new();
    for pattern in [
        "FailedPrecondition",
        "failed to delete",
        "ToBeDeleted",
        "Scale-down: removing",
        "couldn't delete",
        "DecreaseTargetSize",
        "Failed to fix",
    ] {
        let matching: Vec<&str> = log.lines().filter(|l| l.contains(pattern)).collect();
        if matching.is_empty() {
            continue;
        }
        let shown: Vec<String> = matching
            .iter()
            .take(2)
            .map(|l| l.chars().take(300).collect::<String>())
            .collect();
        lines.push(format!(
            "[{pattern}: {} lines] {}",
            matching.len(),
            shown.join(" / ")
        ));
    }
    lines.join(" | ")
}

/// Waits until the provider has answered `method` with FAILED_PRECONDITION `at_least` times.
async fn refused(
    s: &RealCapiNamespace,
    provider: &ProviderProcess,
    ca: Option<&AutoscalerProcess>,
    method: &str,
    at_least: u64,
) {
    s.until(
        &format!("{method} refused {at_least} times"),
        Duration::from_secs(40),
        provider,
        ca,
        || async {
            let n = answered(provider, method, "FAILED_PRECONDITION").await;
            if n >= at_least {
                Check::Done(())
            } else {
                Check::Wait(format!("{n} refusals"))
            }
        },
    )
    .await
}

/// Someone else's delete mark next to CA's scale-down: three Nodes, a person marked `a` (busy), CA
/// wants the empty `c` gone. Lowering replicas would make CAPI delete `a`, so DeleteNodes is
/// refused, nothing written, and CA retries; no Machine is deleted. Once the person lowers replicas
/// for their mark, CAPI deletes `a`, and CA's next DeleteNodes of `c` goes through: CAPI deletes
/// exactly `a` and `c`.
#[tokio::test]
async fn a_foreign_mark_refuses_a_scale_down_until_replicas_remove_it() {
    let s = RealCapiNamespace::new(&SIZE).await;
    s.group("fm", ("1", "5", 3), |_| {}).await;
    let names = s.machines("fm", 3).await;
    let (a, b, c) = (names[0].clone(), names[1].clone(), names[2].clone());
    for (pod, node) in [("busy-a", &a), ("busy-b", &b)] {
        workload::create_bound_pod(&s.client, &s.ns, &PodSpec::new(pod, "1500m", "1Gi"), node)
            .await;
    }
    s.mark_by_hand(&a).await;
    let deleted = s.watch_deletions();
    let provider = s.provider().await;
    let mut ca = s.start_ca(&provider).await;
    refused(&s, &provider, Some(&ca), "NodeGroupDeleteNodes", 2).await;
    assert!(deleted.names().is_empty(), "deleted {:?}", deleted.names());
    assert_eq!(s.replicas("fm").await, Ok(3), "nothing written");
    let refusal_log = refusals_in(&ca);

    // The person lowers replicas for their mark.
    s.patch("MachineDeployment", "fm", json!({"spec": {"replicas": 2}}))
        .await;
    let t = Instant::now();
    let want: BTreeSet<String> = [a.clone(), c.clone()].into();
    let kept = [&b];
    s.until(
        "CAPI deleted a (the person's) and c (CA's), b kept",
        Duration::from_secs(45),
        &provider,
        Some(&ca),
        || s.deleted_exactly(&deleted, "fm", 1, &want, &kept),
    )
    .await;
    s.check_ca_alive(&mut ca, &provider);
    procs::announce(&format!(
        "e2e: scenario rules-foreign-mark passed in {:.1}s: DeleteNodes({c}) refused while {a} \
         carried a mark by hand, nothing deleted; replicas lowered by hand -> CAPI deleted \
         {:?} in {:.1}s. CA after the refusal: {refusal_log}",
        s.started.elapsed().as_secs_f64(),
        deleted.names(),
        t.elapsed().as_secs_f64()
    ));
}

/// A Machine that never gets its Node (the cloud holds it) beside a registered one marked by hand:
/// lowering replicas would make CAPI delete the marked, registered Machine first, so CA's
/// DeleteNodes of the unregistered node, and a DecreaseTargetSize (sent through the provider's RPC:
/// CA sees no size to fix while the unregistered node counts), are refused and nothing is deleted.
/// With the mark gone, CA's next attempt removes the pending Machine only.
#[tokio::test]
async fn decrease_target_size_beside_a_marked_machine_never_costs_a_registered_node() {
    let s = RealCapiNamespace::new(&SIZE).await;
    s.group("pend", ("1", "5", 2), |_| {}).await;
    let names = s.machines("pend", 2).await;
    for (i, node) in names.iter().enumerate() {
        let pod = PodSpec::new(&format!("busy-{i}"), "1500m", "1Gi");
        workload::create_bound_pod(&s.client, &s.ns, &pod, node).await;
    }
    let pending = s.held_third_machine("pend", &names).await;
    let marked = names[0].clone();
    s.mark_by_hand(&marked).await;
    let deleted = s.watch_deletions();
    let provider = s.provider().await;
    let mut ca = s
        .autoscaler(&provider)
        .flag("--max-node-provision-time=8s")
        .start(s.manager.cp)
        .await;
    // CA removes the long-unregistered node through DeleteNodes (its target, 3, matches the
    // registered plus unregistered nodes, so it sees no size to fix): refused.
    refused(&s, &provider, Some(&ca), "NodeGroupDeleteNodes", 2).await;
    // DecreaseTargetSize (what CA sends when the target exceeds the nodes it knows of), the same.
    let (mut rpc, id) = s.served_group(&provider).await;
    let decrease = rpc.decrease(&id, -1).await;
    match &decrease {
        Err(e) if e.code() == tonic::Code::FailedPrecondition && e.message().contains(&marked) => {}
        other => s.fail(
            format!("DecreaseTargetSize beside {marked}: {other:?}"),
            &provider,
            Some(&ca),
        ),
    }
    let deletes_refused = answered(&provider, "NodeGroupDeleteNodes", "FAILED_PRECONDITION").await;
    assert!(deleted.names().is_empty(), "deleted {:?}", deleted.names());
    assert_eq!(s.replicas("pend").await, Ok(3), "nothing written");
    let refusal_log = refusals_in(&ca);

    s.patch(
        "Machine",
        &marked,
        json!({"metadata": {"annotations": {DELETE_MACHINE: null}}}),
    )
    .await;
    let t = Instant::now();
    let want = BTreeSet::from([pending.clone()]);
    let registered: Vec<&String> = names.iter().collect();
    s.until(
        "CA removed the pending Machine only",
        Duration::from_secs(45),
        &provider,
        Some(&ca),
        || s.deleted_exactly(&deleted, "pend", 2, &want, &registered),
    )
    .await;
    s.check_ca_alive(&mut ca, &provider);
    procs::announce(&format!(
        "e2e: scenario rules-decrease-beside-mark passed in {:.1}s: with {marked} marked by hand, \
         CA's DeleteNodes of the unregistered node refused {deletes_refused} times and \
         DecreaseTargetSize refused, nothing deleted; mark removed -> CAPI deleted {:?} in {:.1}s. CA after the \
         refusals: {refusal_log}",
        s.started.elapsed().as_secs_f64(),
        deleted.names(),
        t.elapsed().as_secs_f64()
    ));
}

/// DecreaseTargetSize while the MachineDeployment rolls out with maxUnavailable 1 (the new
/// Machine held by the cloud) is refused and writes nothing: the MachineDeployment controller would
/// shrink the old MachineSet, a registered node, while the pending new one stays. CAPI's own
/// rollout meanwhile deletes at most what maxUnavailable allows it.
#[tokio::test]
async fn decrease_target_size_during_a_rollout_is_refused() {
    let s = RealCapiNamespace::new(&SIZE).await;
    standin::create_template(&s.client, &s.ns, "small-v2", &SIZE).await;
    s.group("roll", ("1", "5", 2), |md| {
        md["spec"]["rollout"] =
            json!({"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 1}}});
    })
    .await;
    let old = s.machines("roll", 2).await;
    s.standin.hold("small-v2");
    // The template changed and replicas raised together: 3 wanted, 2 registered, the new
    // Machine held by the cloud. Replicas above the registered nodes: the old rule let a decrease
    // through, and the MachineDeployment controller would have shrunk the old MachineSet.
    s.patch(
        "MachineDeployment",
        "roll",
        json!({"spec": {"replicas": 3, "template": {"spec": {"infrastructureRef": standin::reference(standin::TEMPLATE_KIND, "small-v2")}}}}),
    )
    .await;
    let provider = s.provider().await;
    let (mut rpc, id) = s.served_group(&provider).await;
    s.until(
        "the provider serves the rollout (min raised to the target, 3)",
        Duration::from_secs(30),
        &provider,
        None,
        || {
            let mut rpc = rpc.clone();
            let id = id.clone();
            async move {
                let groups = rpc.groups().await;
                match groups.iter().find(|g| g.id == id) {
                    Some(g) if g.min_size == 3 => Check::Done(()),
                    other => Check::Wait(format!("{other:?}")),
                }
            }
        },
    )
    .await;
    let refusal = match rpc.decrease(&id, -1).await {
        Err(e) if e.code() == tonic::Code::FailedPrecondition => e.message().to_string(),
        other => s.fail(
            format!("DecreaseTargetSize during the rollout: {other:?}"),
            &provider,
            None,
        ),
    };
    assert!(refusal.contains("rolling out"), "{refusal}");
    assert_eq!(s.replicas("roll").await, Ok(3), "nothing written");
    s.standin.release("small-v2");
    procs::announce(&format!(
        "e2e: scenario rules-decrease-during-rollout passed in {:.1}s: old Machines {old:?}; \
         DecreaseTargetSize refused: {refusal}",
        s.started.elapsed().as_secs_f64(),
    ));
}

/// Replicas lowered by hand (3 -> 2) just before a DeleteNodes of `c`: the provider decides from
/// the live objects (the group read and its Machines listed before deciding, not the cache, which
/// may still show 3), so the person's lower count and CA's removal are each paid once: CAPI deletes
/// `c` and exactly one other Machine, replicas 1, whether or not CAPI had begun deleting a Machine
/// for the person's count when the call came. A call CAPI has not acted for yet waits within the
/// call, then is refused (nothing written) and asked again, as CA does.
#[tokio::test]
async fn replicas_lowered_by_hand_just_before_delete_nodes_cost_one_machine_each() {
    let s = RealCapiNamespace::new(&SIZE).await;
    s.group("hand", ("1", "5", 3), |_| {}).await;
    let names = s.machines("hand", 3).await;
    let c = names[2].clone();
    let deleted = s.watch_deletions();
    let provider = s.provider().await;
    let (mut rpc, id) = s.served_group(&provider).await;
    let node = s.grpc_node(&c).await;
    s.patch(
        "MachineDeployment",
        "hand",
        json!({"spec": {"replicas": 2}}),
    )
    .await;
    let t = Instant::now();
    // Until CAPI has deleted a Machine for the person's count, a mark would be taken for that
    // decrement: the provider waits for it within the call, and refuses when CAPI is slower (a
    // loaded machine); CA asks again on its next loop, and so does this test, while the deadline
    // allows.
    let mut refused = 0;
    loop {
        match rpc.delete_nodes(&id, vec![node.clone()]).await {
            Ok(()) => break,
            Err(e)
                if e.code() == tonic::Code::FailedPrecondition
                    && e.message()
                        .contains("Cluster API has not deleted Machines for it yet")
                    && t.elapsed() < Duration::from_secs(30) =>
            {
                assert_eq!(s.replicas("hand").await, Ok(2), "refused: nothing written");
                refused += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => s.fail(format!("DeleteNodes({c}): {e}"), &provider, None),
        }
    }
    let after = t.elapsed();
    let written = s.replicas("hand").await;
    let outcome = s
        .until(
            "c and one other Machine deleted, replicas 1",
            Duration::from_secs(40),
            &provider,
            None,
            || async {
                let gone = deleted.names();
                let left: BTreeSet<String> = names
                    .iter()
                    .filter(|n| !gone.contains(*n))
                    .cloned()
                    .collect();
                if gone.len() > 2 {
                    return Check::Fatal(format!("more than two Machines deleted: {gone:?}"));
                }
                match s.replicas("hand").await {
                    Ok(1) if gone.contains(&c) && left.len() == 1 => Check::Done((1, gone)),
                    r => Check::Wait(format!("replicas {r:?}, deleted {gone:?}")),
                }
            },
        )
        .await;
    procs::announce(&format!(
        "e2e: scenario rules-lowered-by-hand passed in {:.1}s: DeleteNodes({c}) answered {:.0} ms \
         after the hand-lowering to 2 ({refused} refusal(s) before CAPI acted) wrote replicas \
         {written:?}; CAPI deleted {:?}, replicas {}",
        s.started.elapsed().as_secs_f64(),
        after.as_secs_f64() * 1000.0,
        outcome.1,
        outcome.0
    ));
}

/// A MachineDeployment whose rollouts are paused (`spec.paused`, what `clusterctl alpha rollout
/// pause` sets) is still scaled by CAPI (its existing MachineSet), so it stays a node group: a pod
/// that fits no Node makes CA raise it from 1 to 2, and CAPI creates the Machine.
#[tokio::test]
async fn a_rollout_paused_machine_deployment_is_scaled_by_cluster_autoscaler() {
    let s = RealCapiNamespace::new(&SIZE).await;
    s.group("rp", ("1", "3", 1), |_| {}).await;
    let first = s.machines("rp", 1).await;
    workload::create_bound_pod(
        &s.client,
        &s.ns,
        &PodSpec::new("busy", "1500m", "1Gi"),
        &first[0],
    )
    .await;
    s.patch("MachineDeployment", "rp", json!({"spec": {"paused": true}}))
        .await;
    let provider = s.provider().await;
    let mut ca = s.start_ca(&provider).await;
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    let t = Instant::now();
    let machines = s
        .until(
            "CA raised rp to 2 and CAPI made its Machine with a Node",
            Duration::from_secs(60),
            &provider,
            Some(&ca),
            || async {
                match s.replicas("rp").await {
                    Ok(2) => machines_with_nodes(&s.client, &s.ns, "rp", 2).await,
                    r => Check::Wait(format!("replicas {r:?}")),
                }
            },
        )
        .await;
    let paused = api(&s.client, &s.ns, "v1beta2", "MachineDeployment")
        .get("rp")
        .await
        .map(|md| md.data["spec"]["paused"].clone());
    assert_eq!(paused.ok(), Some(json!(true)), "still rollout-paused");
    s.check_ca_alive(&mut ca, &provider);
    procs::announce(&format!(
        "e2e: scenario rules-rollout-paused passed in {:.1}s: pod -> replicas 2, Machines \
         {machines:?} with Nodes in {:.1}s",
        s.started.elapsed().as_secs_f64(),
        t.elapsed().as_secs_f64()
    ));
}

/// A paused Cluster: CAPI acts on none of its groups, so none is served and CA does not scale one
/// for a pending pod over 6 loops; unpaused, CA raises it and CAPI creates the Machine.
#[tokio::test]
async fn the_groups_of_a_paused_cluster_are_not_served_until_it_resumes() {
    let s = RealCapiNamespace::new(&SIZE).await;
    s.patch("Cluster", "workload", json!({"spec": {"paused": true}}))
        .await;
    s.group("pc", ("0", "3", 0), |_| {}).await;
    let provider = s.provider().await;
    let mut rpc = Rpc::connect(&provider).await;
    let mut ca = s.start_ca(&provider).await;
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    ca.wait_loops(6, Duration::from_secs(40)).await;
    assert!(rpc.ids_in(&s.ns).await.is_empty(), "no group served");
    assert_eq!(
        s.replicas("pc").await,
        Ok(0),
        "CA scaled a paused Cluster's group"
    );
    s.patch("Cluster", "workload", json!({"spec": {"paused": false}}))
        .await;
    let t = Instant::now();
    s.until(
        "resumed: CA raised pc to 1, its Machine with a Node",
        Duration::from_secs(60),
        &provider,
        Some(&ca),
        || async {
            match s.replicas("pc").await {
                Ok(1) => machines_with_nodes(&s.client, &s.ns, "pc", 1).await,
                r => Check::Wait(format!("replicas {r:?}")),
            }
        },
    )
    .await;
    s.check_ca_alive(&mut ca, &provider);
    procs::announce(&format!(
        "e2e: scenario rules-paused-cluster passed in {:.1}s: 6 CA loops with the Cluster paused, \
         nothing served or scaled; resumed -> Machine with its Node in {:.1}s",
        s.started.elapsed().as_secs_f64(),
        t.elapsed().as_secs_f64()
    ));
}

/// Max lowered below replicas (3 Machines, max 1, min 1): CA's removals move replicas toward the
/// range, so they are allowed: CA removes the two empty Nodes and CAPI deletes exactly their
/// Machines, the busy one stays, replicas 1.
#[tokio::test]
async fn max_lowered_below_replicas_lets_cluster_autoscaler_bring_the_group_back() {
    let s = RealCapiNamespace::new(&SIZE).await;
    s.group("over", ("1", "5", 3), |_| {}).await;
    let names = s.machines("over", 3).await;
    let busy = names[1].clone();
    workload::create_bound_pod(
        &s.client,
        &s.ns,
        &PodSpec::new("busy", "1500m", "1Gi"),
        &busy,
    )
    .await;
    s.patch(
        "MachineDeployment",
        "over",
        json!({"metadata": {"annotations": {MAX_SIZE: "1"}}}),
    )
    .await;
    let deleted = s.watch_deletions();
    let provider = s.provider().await;
    let mut ca = s.start_ca(&provider).await;
    let t = Instant::now();
    let want: BTreeSet<String> = names.iter().filter(|n| **n != busy).cloned().collect();
    let kept = [&busy];
    s.until(
        "CA removed the two empty Nodes, replicas 1",
        Duration::from_secs(60),
        &provider,
        Some(&ca),
        || s.deleted_exactly(&deleted, "over", 1, &want, &kept),
    )
    .await;
    s.check_ca_alive(&mut ca, &provider);
    procs::announce(&format!(
        "e2e: scenario rules-above-max passed in {:.1}s: CAPI deleted {:?} in {:.1}s, {busy} kept",
        s.started.elapsed().as_secs_f64(),
        deleted.names(),
        t.elapsed().as_secs_f64()
    ));
}

/// Someone else's mark on the very Machine CA removes: three Nodes, a person marked the empty `a`
/// ("marked by hand"), `b` and `c` busy. CA's DeleteNodes of `a` keeps the mark as the person
/// wrote it (never overwritten with ours), lowers replicas 3 -> 2 once and records the payment of
/// that mark in the group's ledger; CAPI deletes exactly `a`; nothing is left marked, and no
/// repair takes anything back.
#[tokio::test]
async fn a_foreign_mark_on_the_machine_cluster_autoscaler_removes_is_kept_and_paid_once() {
    let s = RealCapiNamespace::new(&SIZE).await;
    s.group("fk", ("1", "5", 3), |_| {}).await;
    let names = s.machines("fk", 3).await;
    let (a, b, c) = (names[0].clone(), names[1].clone(), names[2].clone());
    for (pod, node) in [("busy-b", &b), ("busy-c", &c)] {
        workload::create_bound_pod(&s.client, &s.ns, &PodSpec::new(pod, "1500m", "1Gi"), node)
            .await;
    }
    s.mark_by_hand(&a).await;
    let marks = s.watch_mark(&a);
    let deleted = s.watch_deletions();
    let provider = s.provider().await;
    let mut ca = s.start_ca(&provider).await;
    let t = Instant::now();
    let ledger = s
        .until(
            "CA removed a: replicas 2, the ledger pays a's mark, CAPI deleted exactly a",
            Duration::from_secs(60),
            &provider,
            Some(&ca),
            || async {
                let gone = deleted.names();
                if gone.contains(&b) || gone.contains(&c) {
                    return Check::Fatal(format!("a busy Machine deleted: {gone:?}"));
                }
                let ledger = s
                    .annotation(
                        "MachineDeployment",
                        "fk",
                        "capi-autoscaler-provider/removed",
                    )
                    .await;
                match s.replicas("fk").await {
                    Ok(2) if gone == BTreeSet::from([a.clone()]) => Check::Done(ledger),
                    r => Check::Wait(format!(
                        "replicas {r:?}, deleted {gone:?}, ledger {ledger:?}"
                    )),
                }
            },
        )
        .await;
    assert!(
        ledger.starts_with(&format!("{a}@")) && ledger.contains('#'),
        "the decrement paid for a's foreign mark: {ledger:?}"
    );
    assert_eq!(
        marks.values(),
        BTreeSet::from([Some("marked by hand".to_string())]),
        "a's mark stayed as the person wrote it"
    );
    // CA goes on looping; nothing more is written or deleted.
    ca.wait_loops(3, Duration::from_secs(40)).await;
    assert_eq!(s.replicas("fk").await, Ok(2), "paid once");
    assert_eq!(deleted.names(), BTreeSet::from([a.clone()]));
    let left = support::real_capi::machines_of(&s.client, &s.ns, "fk")
        .await
        .unwrap_or_default();
    assert!(
        left.iter().all(|(_, marked)| !marked),
        "nothing left marked: {left:?}"
    );
    s.check_ca_alive(&mut ca, &provider);
    procs::announce(&format!(
        "e2e: scenario rules-foreign-mark-named passed in {:.1}s: DeleteNodes({a}) with a's mark \
         by hand kept; ledger {ledger:?}; CAPI deleted {:?} in {:.1}s; mark values seen {:?}",
        s.started.elapsed().as_secs_f64(),
        deleted.names(),
        t.elapsed().as_secs_f64(),
        marks.values()
    ));
}

/// A MachinePool whose instances have no Machine (the stand-in cloud's pool): three instances, two
/// busy; the pool's cloud holds its instances for a while. CA removes the empty one: replicas
/// 3 -> 2 with its entry in the ledger, and while the instance is still listed, a DeleteNodes of it
/// sent again (as CA retries) writes nothing: replicas stay 2. Released, the cloud drops that
/// instance (the newest) and CAPI deletes its Node.
#[tokio::test]
async fn a_machine_pool_instance_without_a_machine_is_paid_once() {
    let s = RealCapiNamespace::new(&SIZE).await;
    let pool = format!("{}-pool", s.ns);
    let pools: kube::Api<kube::api::DynamicObject> = kube::Api::namespaced_with(
        s.client.clone(),
        &s.ns,
        &standin::resource(standin::MACHINE_POOL_KIND),
    );
    let infra =
        kube::api::DynamicObject::new(&pool, &standin::resource(standin::MACHINE_POOL_KIND))
            .data(json!({"spec": {}}));
    pools
        .create(&kube::api::PostParams::default(), &infra)
        .await
        .unwrap_or_else(|e| panic!("create {} {pool}: {e}", standin::MACHINE_POOL_KIND));
    let mut mp = machine_deployment("mp", "workload", "unused", "1", "5");
    mp["kind"] = json!("MachinePool");
    mp["metadata"]["annotations"][format!("{CAPACITY}/labels")] =
        json!(scenario_labels(&s.ns, &[]));
    for (k, v) in SIZE {
        let key = if k == "pods" { "maxPods" } else { k };
        mp["metadata"]["annotations"][format!("{CAPACITY}/{key}")] = json!(v);
    }
    mp["spec"] = json!({
        "clusterName": "workload",
        "replicas": 3,
        "template": {"spec": {
            "clusterName": "workload",
            "version": standin::KUBERNETES_VERSION,
            "bootstrap": {"dataSecretName": "stand-in-bootstrap"},
            "infrastructureRef": standin::reference(standin::MACHINE_POOL_KIND, &pool),
        }},
    });
    create(&api(&s.client, &s.ns, "v1beta2", "MachinePool"), &mp)
        .await
        .unwrap_or_else(|e| panic!("create MachinePool {}/mp: {e}", s.ns));
    let instance = |n: u32| format!("{pool}-{n}");
    let listed = || async {
        api(&s.client, &s.ns, "v1beta2", "MachinePool")
            .get("mp")
            .await
            .map(|mp| {
                mp.data["spec"]["providerIDList"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| {
                        v.as_str()
                            .map(|id| id.rsplit('/').next().unwrap_or(id).to_string())
                    })
                    .collect::<BTreeSet<String>>()
            })
            .unwrap_or_default()
    };
    let all: BTreeSet<String> = (1..=3).map(instance).collect();
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(s.client.clone());
    poll_until(
        "CAPI lists the pool's 3 instances, each with its Node",
        MACHINES,
        Duration::from_millis(200),
        || async {
            let ids = listed().await;
            for n in &all {
                if !matches!(nodes.get_opt(n).await, Ok(Some(_))) {
                    return Check::Wait(format!("no Node {n} yet; listed {ids:?}"));
                }
            }
            if ids == all {
                Check::Done(())
            } else {
                Check::Wait(format!("listed {ids:?}"))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    for (pod, n) in [("busy-1", 1), ("busy-2", 2)] {
        workload::create_bound_pod(
            &s.client,
            &s.ns,
            &PodSpec::new(pod, "1500m", "1Gi"),
            &instance(n),
        )
        .await;
    }
    let empty = instance(3);
    s.standin.hold(&pool);
    let provider = s.provider().await;
    let mut ca = s.start_ca(&provider).await;
    let t = Instant::now();
    let pool_replicas = || async {
        api(&s.client, &s.ns, "v1beta2", "MachinePool")
            .get("mp")
            .await
            .map_err(|e| e.to_string())
            .and_then(|mp| {
                mp.data["spec"]["replicas"]
                    .as_i64()
                    .ok_or("no replicas".into())
            })
    };
    let entry = format!("id:{}", empty);
    s.until(
        "CA removed the empty instance: replicas 2, its entry in the ledger",
        Duration::from_secs(60),
        &provider,
        Some(&ca),
        || async {
            let ledger = s
                .annotation("MachinePool", "mp", "capi-autoscaler-provider/removed")
                .await;
            match pool_replicas().await {
                Ok(2) if ledger.split(',').any(|e| e.ends_with(&empty)) => Check::Done(()),
                Ok(n) if n < 2 => Check::Fatal(format!("replicas {n}: paid twice")),
                r => Check::Wait(format!("replicas {r:?}, ledger {ledger:?}")),
            }
        },
    )
    .await;
    let ledger = s
        .annotation("MachinePool", "mp", "capi-autoscaler-provider/removed")
        .await;
    assert!(listed().await.contains(&empty), "held: still listed");
    // The retry, while the instance is still listed.
    let (mut rpc, id) = s.served_group(&provider).await;
    let node = grpc_node(&standin::provider_id(&s.ns, &empty), &empty);
    if let Err(e) = rpc.delete_nodes(&id, vec![node]).await {
        s.fail(
            format!("DeleteNodes({empty}) again: {e}"),
            &provider,
            Some(&ca),
        );
    }
    ca.wait_loops(3, Duration::from_secs(40)).await;
    assert_eq!(pool_replicas().await, Ok(2), "a retry pays nothing twice");
    s.standin.release(&pool);
    let t_release = Instant::now();
    s.until(
        "the cloud dropped the instance and CAPI deleted its Node; replicas 2",
        Duration::from_secs(60),
        &provider,
        Some(&ca),
        || async {
            let ids = listed().await;
            let node = nodes.get_opt(&empty).await;
            match (pool_replicas().await, node) {
                (Ok(2), Ok(None)) if !ids.contains(&empty) && ids.len() == 2 => Check::Done(()),
                (r, n) => Check::Wait(format!(
                    "replicas {r:?}, listed {ids:?}, Node {empty} there: {:?}",
                    n.map(|n| n.is_some())
                )),
            }
        },
    )
    .await;
    s.check_ca_alive(&mut ca, &provider);
    procs::announce(&format!(
        "e2e: scenario rules-pool-instance passed in {:.1}s: CA's DeleteNodes({empty}) -> replicas \
         2 in {:.1}s, ledger {ledger:?} ({entry}); a DeleteNodes sent again while listed wrote \
         nothing; released -> instance dropped, Node deleted in {:.1}s",
        s.started.elapsed().as_secs_f64(),
        t.elapsed().as_secs_f64(),
        t_release.elapsed().as_secs_f64()
    ));
}

/// Cluster API ranks a registered Machine whose Node is unhealthy with the ones that never got a
/// Node, ties broken by name. Two registered Machines and a third held by the cloud (pending); the
/// first registered one by name gets a NotReady Node, and CAPI sets its `NodeHealthy` condition
/// False. DecreaseTargetSize(-1): if that Machine sorts before the pending one, it is refused,
/// naming it, and nothing is written; replicas then lowered by hand show what the refusal spared:
/// CAPI deletes the unhealthy registered Machine, not the pending one. If the pending one sorts
/// first, the decrease goes through and CAPI deletes the pending one only. (Machine names are
/// random: which branch runs is printed.)
#[tokio::test]
async fn decrease_target_size_follows_the_unhealthy_rank_cluster_api_deletes_by() {
    let s = RealCapiNamespace::new(&SIZE).await;
    s.group("sick", ("1", "5", 2), |_| {}).await;
    let names = s.machines("sick", 2).await;
    let pending = s.held_third_machine("sick", &names).await;
    let machine_api = api(&s.client, &s.ns, "v1beta2", "Machine");
    let sick = names[0].clone();
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(s.client.clone());
    let condition = |type_: &str, status: &str| {
        json!({"type": type_, "status": status, "reason": "StandIn", "message": "set by the test",
               "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"})
    };
    nodes
        .patch_status(
            &sick,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"conditions": [
                condition("Ready", "False"),
                condition("MemoryPressure", "False"),
                condition("DiskPressure", "False"),
                condition("PIDPressure", "False"),
            ]}})),
        )
        .await
        .unwrap_or_else(|e| panic!("make Node {sick} NotReady: {e}"));
    poll_until(
        "CAPI sets the Machine's NodeHealthy False",
        MACHINES,
        Duration::from_millis(200),
        || async {
            match machine_api.get(&sick).await {
                Ok(m) => {
                    let conditions = m.data["status"]["conditions"].as_array().cloned();
                    let healthy = conditions
                        .iter()
                        .flatten()
                        .find(|c| c["type"] == "NodeHealthy");
                    match healthy {
                        Some(c) if c["status"] == "False" => Check::Done(()),
                        other => Check::Wait(format!("NodeHealthy {other:?}")),
                    }
                }
                Err(e) => Check::Wait(e.to_string()),
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let deleted = s.watch_deletions();
    let provider = s.provider().await;
    let (mut rpc, id) = s.served_group(&provider).await;
    // The provider decides from the Machines it lists: wait until it serves all three.
    s.until(
        "the provider serves the group's 3 instances",
        Duration::from_secs(30),
        &provider,
        None,
        || {
            let mut rpc = rpc.clone();
            let id = id.clone();
            async move {
                match rpc.nodes(&id).await {
                    Ok(n) if n.len() == 3 => Check::Done(()),
                    other => Check::Wait(format!("{:?}", other.map(|n| n.len()))),
                }
            }
        },
    )
    .await;
    let decrease = rpc.decrease(&id, -1).await;
    let sick_first = sick < pending;
    let t = Instant::now();
    let want: BTreeSet<String> = if sick_first {
        match &decrease {
            Err(e)
                if e.code() == tonic::Code::FailedPrecondition
                    && e.message().contains(&sick)
                    && e.message().contains("unhealthy") => {}
            other => s.fail(
                format!("DecreaseTargetSize with {sick} (unhealthy) before {pending}: {other:?}"),
                &provider,
                None,
            ),
        }
        assert_eq!(s.replicas("sick").await, Ok(3), "nothing written");
        // What the refusal spared: the same count written by hand.
        s.patch(
            "MachineDeployment",
            "sick",
            json!({"spec": {"replicas": 2}}),
        )
        .await;
        BTreeSet::from([sick.clone()])
    } else {
        if let Err(e) = &decrease {
            s.fail(
                format!("DecreaseTargetSize with {pending} before {sick} (unhealthy): {e}"),
                &provider,
                None,
            );
        }
        BTreeSet::from([pending.clone()])
    };
    s.until(
        "CAPI deleted the Machine its unhealthy rank puts first",
        Duration::from_secs(60),
        &provider,
        None,
        || async {
            let gone = deleted.names();
            if gone.len() > 1 {
                return Check::Fatal(format!("more than one Machine deleted: {gone:?}"));
            }
            match s.replicas("sick").await {
                Ok(2) if gone == want => Check::Done(()),
                r => Check::Wait(format!("replicas {r:?}, deleted {gone:?}")),
            }
        },
    )
    .await;
    procs::announce(&format!(
        "e2e: scenario rules-unhealthy-rank passed in {:.1}s: unhealthy {sick}, pending {pending}, \
         {}; CAPI deleted {:?} in {:.1}s",
        s.started.elapsed().as_secs_f64(),
        if sick_first {
            format!(
                "DecreaseTargetSize refused ({}); replicas lowered by hand",
                decrease
                    .err()
                    .map(|e| e.message().to_string())
                    .unwrap_or_default()
            )
        } else {
            "DecreaseTargetSize accepted".to_string()
        },
        deleted.names(),
        t.elapsed().as_secs_f64()
    ));
}
