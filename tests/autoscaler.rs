//! End-to-end scenarios with the real cluster-autoscaler (the default pinned version) driving the
//! provider, with the real Cluster API manager (v1.14.2, `capi_manager`: one per test binary, shared
//! by the scenarios) and the stand-in cloud and kubelets (`standin`), on one control plane with the
//! real kube-scheduler binding pods. Each scenario has its own namespace, Cluster, provider and CA;
//! pods only fit their own scenario's groups, so scenarios run side by side. Assertions are on
//! objects (replicas, Machines, Nodes, pods, Events, and each Machine CAPI deleted with whether it
//! carried the delete-machine mark, from a watch), never on log text.
//!
//! Elsewhere on real CAPI (tests/real_capi/autoscaler.rs): scale from zero by the template's
//! capacity and back, the node CA chose under every MachineSet deletion order (the old
//! empty-node-by-its-mark scenario, stronger), a drain, no removal during a rollout.

pub mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{DynamicObject, PostParams};
use serde_json::json;
use support::capi::{Capi, Kind, apply_cluster_role, shipped_cluster_role};
use support::pki::{self, Ca};
use support::procs::{self, Check, poll_until};
use support::provider::start_provider_tls;
use support::real_capi_scenario::{CLUSTER, RealCapiScenario, scale_up_and_down};
use support::standin;
use support::workload::{self, PodSpec};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

const UP: Duration = Duration::from_secs(60);
const DOWN: Duration = Duration::from_secs(90);
const PRICE: &str = "capi-autoscaler-provider/hourly-price";
const OPTION_UNNEEDED: &str = "cluster.x-k8s.io/autoscaling-options-scaledownunneededtime";
/// CA's taint on a node it is deleting.
const TO_BE_DELETED: &str = "ToBeDeletedByClusterAutoscaler";

/// A pending pod that fits only a zero-size group with capacity annotations (its stand-in template
/// says nothing) makes CA scale the group up from zero through the provider's template; the pod is
/// bound to the new Node; once the pod is gone CA removes the empty Node through DeleteNodes: CAPI
/// deletes that Machine, which carried the mark, replicas back to 0.
#[tokio::test]
async fn scale_up_from_zero_with_capacity_annotations_and_back_down() {
    let mut s = RealCapiScenario::new("scale-from-zero-annotations").await;
    let times = scale_up_and_down(&mut s, &[], |ca| ca).await;
    let reasons = workload::pod_event_reasons(&s.client, &s.ns, "web").await;
    s.check(
        reasons.iter().any(|r| r == "TriggeredScaleUp"),
        &format!("CA's TriggeredScaleUp Event on the pod: {reasons:?}"),
    );
    eprintln!("e2e: {times:?}");
    s.passed();
}

/// With no capacity annotations, the infrastructure template's `status.capacity` is the template:
/// a pod that needs 3 CPUs scales the 4-CPU template group, not the 2-CPU annotated one.
#[tokio::test]
async fn scale_up_from_zero_with_infrastructure_template_capacity() {
    let mut s = RealCapiScenario::new("scale-from-zero-infra-template").await;
    s.template("md-big-tmpl", "4", "8Gi", true).await;
    s.template("md-small-tmpl", "2", "4Gi", false).await;
    s.create_md(&s.md("md-big", "md-big-tmpl", 0, 3, 0)).await;
    let small = RealCapiScenario::capacity(s.md("md-small", "md-small-tmpl", 0, 3, 0), "2", "4Gi");
    s.create_md(&small).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("big", "3", "2Gi")).await;
    s.wait_replicas("md-big", 1, UP).await;
    let node = workload::wait_bound(&s.client, &s.ns, "big", UP).await;
    s.check(
        node.starts_with("md-big"),
        &format!("the pod runs on md-big's Node: {node}"),
    );
    let small = s.replicas("md-small").await;
    s.check(small == 0, &format!("md-small stays at 0: {small}"));
    s.passed();
}

/// A zero-size group with neither capacity annotations nor template capacity cannot be simulated:
/// CA does not scale it (its replicas stay 0 over several loops) and says so on the pod.
#[tokio::test]
async fn no_scale_up_without_a_template() {
    let mut s = RealCapiScenario::new("no-template").await;
    s.template("md-blank-tmpl", "2", "4Gi", false).await;
    s.create_md(&s.md("md-blank", "md-blank-tmpl", 0, 3, 0))
        .await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "500m", "256Mi")).await;
    wait_pod_event(&s, "web", "NotTriggerScaleUp").await;
    s.wait_loops(5).await;
    let replicas = s.replicas("md-blank").await;
    s.check(replicas == 0, &format!("md-blank stays at 0: {replicas}"));
    let machines = s.machine_names().await;
    s.check(machines.is_empty(), &format!("no Machine: {machines:?}"));
    s.check(
        workload::node_of(&s.client, &s.ns, "web").await.is_none(),
        "the pod stays pending",
    );
    s.passed();
}

/// Four pods that each need a whole node and a group of max 2: CA raises the group to 2 and no
/// further, however many loops pass, and reports the rest as not triggering a scale-up.
#[tokio::test]
async fn max_size_is_respected() {
    let mut s = RealCapiScenario::new("max-respected").await;
    s.template("md-a-tmpl", "2", "4Gi", true).await;
    let md = RealCapiScenario::capacity(s.md("md-a", "md-a-tmpl", 0, 2, 0), "2", "4Gi");
    s.create_md(&md).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    for i in 0..4 {
        let pod = PodSpec::new(&format!("p{i}"), "1500m", "1Gi");
        workload::create_pod(&s.client, &s.ns, &pod).await;
    }
    s.wait_replicas("md-a", 2, UP).await;
    wait_bound_count(&s, &["p0", "p1", "p2", "p3"], 2).await;
    s.wait_loops(5).await;
    let replicas = s.replicas("md-a").await;
    s.check(
        replicas == 2,
        &format!("md-a stays at its max 2: {replicas}"),
    );
    let machines = s.machine_names().await;
    s.check(
        machines.len() == 2,
        &format!("CAPI made two Machines: {machines:?}"),
    );
    s.passed();
}

/// A group at its min size keeps its empty node: after several times the unneeded time, no Machine
/// is marked or deleted and replicas are unchanged.
#[tokio::test]
async fn min_size_is_respected() {
    let mut s = RealCapiScenario::new("min-respected").await;
    s.template("md-a-tmpl", "2", "4Gi", true).await;
    let md = RealCapiScenario::capacity(s.md("md-a", "md-a-tmpl", 1, 3, 1), "2", "4Gi");
    s.create_md(&md).await;
    s.wait_node_count(1).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    // unneeded time 5 s, a loop every 2 s: 8 loops are three times the time a node needs.
    s.wait_loops(8).await;
    let replicas = s.replicas("md-a").await;
    s.check(
        replicas == 1,
        &format!("md-a stays at its min 1: {replicas}"),
    );
    let marked = s.capi.marked_machines().await;
    s.check(marked.is_empty(), &format!("no Machine marked: {marked:?}"));
    let deletions = s.deletions.all();
    s.check(
        deletions.is_empty(),
        &format!("no Machine deleted: {deletions:?}"),
    );
    s.passed();
}

/// A MachinePool group on the stand-in's machine pool: scaled up from zero for a pod (replicas
/// through the scale subresource; the stand-in cloud adds an instance to its pool's
/// providerIDList, CAPI's MachinePool controller copies it into the MachinePool's and links its
/// Node), then back down when the pod goes: replicas 0, the instance dropped, its Node deleted.
#[tokio::test]
async fn machine_pool_scales_up_and_down() {
    let mut s = RealCapiScenario::new("machinepool").await;
    let pools = Api::<DynamicObject>::namespaced_with(
        s.client.clone(),
        &s.ns,
        &standin::resource(standin::MACHINE_POOL_KIND),
    );
    let infra = DynamicObject::new("pool", &standin::resource(standin::MACHINE_POOL_KIND))
        .data(json!({"spec": {}}));
    if let Err(e) = pools.create(&PostParams::default(), &infra).await {
        s.fail(&format!("create {} pool: {e}", standin::MACHINE_POOL_KIND));
    }
    let mut mp = RealCapiScenario::capacity(s.md("pool", "unused", 0, 3, 0), "2", "4Gi");
    mp["kind"] = json!("MachinePool");
    mp["spec"] = json!({
        "clusterName": CLUSTER,
        "replicas": 0,
        "template": {"spec": {
            "clusterName": CLUSTER,
            "version": standin::KUBERNETES_VERSION,
            "bootstrap": {"dataSecretName": "stand-in-bootstrap"},
            "infrastructureRef": standin::reference(standin::MACHINE_POOL_KIND, "pool"),
        }},
    });
    let machine_pools = s.capi.api(Kind::MachinePool);
    if let Err(e) = support::real_capi::create(&machine_pools, &mp).await {
        s.fail(&format!("create MachinePool pool: {e}"));
    }
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    wait_pool(&s, 1, UP).await;
    let node = workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    let linked = poll_until(
        "CAPI lists the instance in the MachinePool and links its Node",
        UP,
        Duration::from_millis(200),
        || {
            let (api, node) = (&machine_pools, &node);
            async move {
                let mp = match api.get("pool").await {
                    Ok(mp) => mp,
                    Err(e) => return Check::Wait(e.to_string()),
                };
                let ids = mp.data["spec"]["providerIDList"].clone();
                let refs: Vec<&str> = mp.data["status"]["nodeRefs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|r| r["name"].as_str())
                    .collect();
                if ids.as_array().map_or(0, Vec::len) == 1 && refs == [node.as_str()] {
                    Check::Done(())
                } else {
                    Check::Wait(format!("providerIDList {ids}, nodeRefs {refs:?}"))
                }
            }
        },
    )
    .await;
    if let Err(e) = linked {
        s.fail(&e);
    }

    workload::delete_pod(&s.client, &s.ns, "web").await;
    wait_pool(&s, 0, DOWN).await;
    s.wait_nodes(&[]).await;
    let gone = Api::<Node>::all(s.client.clone())
        .get_opt(&node)
        .await
        .ok()
        .flatten();
    s.check(gone.is_none(), &format!("Node {node} is gone"));
    let emptied = poll_until(
        "CAPI drops the instance from the MachinePool",
        DOWN,
        Duration::from_millis(200),
        || {
            let api = &machine_pools;
            async move {
                match api.get("pool").await {
                    Ok(mp) => {
                        let ids = &mp.data["spec"]["providerIDList"];
                        if ids.as_array().is_none_or(Vec::is_empty) {
                            Check::Done(())
                        } else {
                            Check::Wait(format!("providerIDList {ids}"))
                        }
                    }
                    Err(e) => Check::Wait(e.to_string()),
                }
            }
        },
    )
    .await;
    if let Err(e) = emptied {
        s.fail(&e);
    }
    s.passed();
}

/// A Machine whose cloud never delivers (the stand-in holds its template: no providerID, no Node):
/// after max-node-provision-time CA gives up on it (CA 1.36 either reverts the timed-out scale-up
/// with DecreaseTargetSize or removes the unregistered instance with DeleteNodes, whichever of its
/// two 15 s clocks fires first), backs the group off and scales the other fitting group instead. In
/// the end the broken group is at 0 with no Machine left, and CA stopped retrying it: over five more
/// loops its replicas stay 0 (sampled every 100 ms) and no Machine is made for it. (Before the
/// back-off, CA may remove the instance and raise the group again in one loop, a few times over;
/// each round trip can let CAPI replace the Machine, so how many were made before is CA's timing.)
#[tokio::test]
async fn unprovisioned_machine_is_given_up_and_another_group_scales() {
    let mut s = RealCapiScenario::new("provision-failure").await;
    s.template("md-broken-tmpl", "2", "4Gi", true).await;
    s.template("md-spare-tmpl", "4", "8Gi", true).await;
    s.standin.hold("md-broken-tmpl");
    // The broken group is the better fit (least waste), so CA tries it first.
    let broken =
        RealCapiScenario::capacity(s.md("md-broken", "md-broken-tmpl", 0, 3, 0), "2", "4Gi");
    let spare = RealCapiScenario::capacity(s.md("md-spare", "md-spare-tmpl", 0, 3, 0), "4", "8Gi");
    s.create_md(&broken).await;
    s.create_md(&spare).await;
    s.start_provider(&[]).await;
    let ca = s.autoscaler().flag("--max-node-provision-time=15s");
    s.start_ca(ca).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas("md-broken", 1, UP).await;
    s.wait_replicas("md-spare", 1, DOWN).await;
    let node = workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    s.check(
        node.starts_with("md-spare"),
        &format!("the pod runs on md-spare: {node}"),
    );
    s.wait_replicas("md-broken", 0, DOWN).await;
    let capi = &s.capi;
    let left = poll_until(
        "CAPI deletes the md-broken Machines",
        DOWN,
        Duration::from_millis(200),
        || async move {
            match capi.api(Kind::Machine).list(&Default::default()).await {
                Ok(l) => {
                    let left: Vec<String> = l
                        .items
                        .into_iter()
                        .filter_map(|m| m.metadata.name)
                        .filter(|m| m.starts_with("md-broken"))
                        .collect();
                    if left.is_empty() {
                        Check::Done(())
                    } else {
                        Check::Wait(format!("left {left:?}"))
                    }
                }
                Err(e) => Check::Wait(e.to_string()),
            }
        },
    )
    .await;
    if let Err(e) = left {
        s.fail(&e);
    }
    let made = |s: &RealCapiScenario| -> BTreeSet<String> {
        s.deletions
            .all()
            .into_iter()
            .map(|d| d.machine)
            .filter(|m| m.starts_with("md-broken"))
            .collect()
    };
    let before = made(&s);
    // Sampled beside CA's loops: a raise would show as replicas 1 for at least the provision time.
    let sampler = Capi::new(s.client.clone(), &s.ns, support::CAPI_GROUP, "v1beta2");
    let done = Arc::new(AtomicBool::new(false));
    let sampling = {
        let done = done.clone();
        async move {
            let mut seen = BTreeSet::new();
            while !done.load(Ordering::SeqCst) {
                if let Ok(md) = sampler.api(Kind::MachineDeployment).get("md-broken").await {
                    seen.insert(md.data["spec"]["replicas"].as_i64().unwrap_or(-1));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            seen
        }
    };
    let loops = async {
        s.wait_loops(5).await;
        done.store(true, Ordering::SeqCst);
    };
    let (seen, ()) = tokio::join!(sampling, loops);
    let after = made(&s);
    let now: Vec<String> = s
        .machine_names()
        .await
        .into_iter()
        .filter(|m| m.starts_with("md-broken"))
        .collect();
    s.check(
        !before.is_empty() && after == before && now.is_empty() && seen == BTreeSet::from([0]),
        &format!(
            "CA backed md-broken off: Machines made for it before {before:?}, after 5 more loops \
             {after:?}, now {now:?}; its replicas over those loops {seen:?}"
        ),
    );
    let marked = s.capi.marked_machines().await;
    s.check(
        marked.is_empty(),
        &format!("no Machine left marked: {marked:?}"),
    );
    s.passed();
}

/// Two Clusters in one management cluster (kubernetes/autoscaler#5510), CA watching the first. The
/// second Cluster's MachineDeployment has two Machines that never become Nodes (the stand-in cloud
/// holds them): served to CA, they would be instances that never registered, deleted after
/// `--max-node-provision-time`. The provider serves only `--cluster`'s groups, so past that time (15 s)
/// and more loops, none of the second Cluster's Machines is marked or deleted and its replicas stay,
/// while the first Cluster scales up from zero for a pod and back down as usual.
#[tokio::test]
async fn a_second_clusters_groups_are_never_touched_while_the_first_scales() {
    const PROVISION: Duration = Duration::from_secs(15);
    let mut s = RealCapiScenario::new("two-clusters").await;
    standin::workload_cluster(&s.client, s.cp, &s.ns, "other").await;
    s.template("md-other-tmpl", "2", "4Gi", true).await;
    s.standin.hold("md-other-tmpl");
    let mut other =
        RealCapiScenario::capacity(s.md("md-other", "md-other-tmpl", 0, 5, 2), "2", "4Gi");
    other["spec"]["clusterName"] = "other".into();
    other["spec"]["template"]["spec"]["clusterName"] = "other".into();
    s.create_md(&other).await;
    let theirs = poll_until(
        "the other Cluster's two Machines",
        UP,
        Duration::from_millis(100),
        || {
            let s = &s;
            async move {
                let names: Vec<String> = s
                    .machine_names()
                    .await
                    .into_iter()
                    .filter(|m| m.starts_with("md-other"))
                    .collect();
                if names.len() == 2 {
                    Check::Done(names)
                } else {
                    Check::Wait(format!("{names:?}"))
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| s.fail(&e));
    s.template("md-a-tmpl", "2", "4Gi", true).await;
    let md = RealCapiScenario::capacity(s.md("md-a", "md-a-tmpl", 0, 3, 0), "2", "4Gi");
    s.create_md(&md).await;
    let cluster = format!("{}/{CLUSTER}", s.ns);
    s.start_provider(&["--cluster", &cluster]).await;
    let provision = format!("--max-node-provision-time={}s", PROVISION.as_secs());
    s.start_ca(s.autoscaler().flag(&provision)).await;
    let ca_started = std::time::Instant::now();

    // The first Cluster: up from zero for a pod that fits either group, and back down.
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas("md-a", 1, UP).await;
    let node = workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    s.check(
        node.starts_with("md-a"),
        &format!("the pod runs on the first Cluster's node: {node}"),
    );
    workload::delete_pod(&s.client, &s.ns, "web").await;
    s.wait_replicas("md-a", 0, DOWN).await;
    s.wait_nodes(&[]).await;
    // Past CA's provision timeout by a margin, then five more loops.
    while ca_started.elapsed() < PROVISION * 2 {
        s.wait_loops(1).await;
    }
    s.wait_loops(5).await;

    s.check(
        s.replicas("md-other").await == 2,
        "the other Cluster's replicas unchanged",
    );
    let left: Vec<String> = s
        .machine_names()
        .await
        .into_iter()
        .filter(|m| m.starts_with("md-other"))
        .collect();
    s.check(
        left == theirs,
        &format!("the other Cluster's Machines all stay: {left:?}, were {theirs:?}"),
    );
    let marked = s.capi.marked_machines().await;
    s.check(
        marked.is_empty(),
        &format!("no Machine left marked: {marked:?}"),
    );
    let deleted = s.deleted_marked();
    s.check(
        deleted == vec![node.clone()],
        &format!("only the first Cluster's node was removed, for its mark: {deleted:?}"),
    );
    s.check_every_deletion_marked();
    s.passed();
}

/// CA's `price` expander picks the cheaper of two groups that both fit, from the provider's prices
/// (the expensive one is the tighter fit, so least-waste would have picked it).
#[tokio::test]
async fn price_expander_chooses_the_cheaper_group() {
    let mut s = RealCapiScenario::new("price-expander").await;
    s.template("md-dear-tmpl", "2", "4Gi", true).await;
    s.template("md-cheap-tmpl", "4", "8Gi", true).await;
    let dear = RealCapiScenario::capacity(s.md("md-dear", "md-dear-tmpl", 0, 3, 0), "2", "4Gi");
    let cheap = RealCapiScenario::capacity(s.md("md-cheap", "md-cheap-tmpl", 0, 3, 0), "4", "8Gi");
    s.create_md(&RealCapiScenario::annotation(dear, PRICE, "2.0"))
        .await;
    s.create_md(&RealCapiScenario::annotation(cheap, PRICE, "0.1"))
        .await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler().flag("--expander=price")).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas("md-cheap", 1, UP).await;
    let node = workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    s.check(
        node.starts_with("md-cheap"),
        &format!("the pod runs on md-cheap's Node: {node}"),
    );
    let dear = s.replicas("md-dear").await;
    s.check(dear == 0, &format!("md-dear stays at 0: {dear}"));
    s.passed();
}

/// `--balance-similar-node-groups`: two groups alike but for their zone share a scale-up of four
/// one-per-node pods, two nodes each.
#[tokio::test]
async fn balance_similar_node_groups_spreads_over_zones() {
    let mut s = RealCapiScenario::new("balance-zones").await;
    for (md, zone) in [("md-zone-a", "zone-a"), ("md-zone-b", "zone-b")] {
        let label = format!("topology.kubernetes.io/zone={zone}");
        let template = format!("{md}-tmpl");
        s.template(&template, "2", "4Gi", true).await;
        let group = s.labels(s.md(md, &template, 0, 4, 0), &[label.as_str()]);
        s.create_md(&RealCapiScenario::capacity(group, "2", "4Gi"))
            .await;
    }
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler().flag("--balance-similar-node-groups=true"))
        .await;

    for i in 0..4 {
        let pod = PodSpec::new(&format!("p{i}"), "1500m", "1Gi");
        workload::create_pod(&s.client, &s.ns, &pod).await;
    }
    s.wait_replicas("md-zone-a", 2, UP).await;
    s.wait_replicas("md-zone-b", 2, UP).await;
    wait_bound_count(&s, &["p0", "p1", "p2", "p3"], 4).await;
    s.passed();
}

/// The per-group `autoscaling-options-scaledownunneededtime` annotation: with CA's own unneeded time
/// at 10 minutes, the group that says 2 s loses its empty node (CAPI deletes that Machine, marked),
/// the other keeps its.
#[tokio::test]
async fn per_group_scale_down_unneeded_time() {
    let mut s = RealCapiScenario::new("per-group-unneeded-time").await;
    s.template("md-fast-tmpl", "2", "4Gi", true).await;
    s.template("md-slow-tmpl", "2", "4Gi", true).await;
    let fast = RealCapiScenario::capacity(s.md("md-fast", "md-fast-tmpl", 0, 3, 1), "2", "4Gi");
    let slow = RealCapiScenario::capacity(s.md("md-slow", "md-slow-tmpl", 0, 3, 1), "2", "4Gi");
    s.create_md(&RealCapiScenario::annotation(fast, OPTION_UNNEEDED, "2s"))
        .await;
    s.create_md(&slow).await;
    let nodes = s.wait_node_count(2).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler().flag("--scale-down-unneeded-time=10m"))
        .await;

    s.wait_replicas("md-fast", 0, DOWN).await;
    let slow_node: Vec<String> = nodes
        .into_iter()
        .filter(|n| n.starts_with("md-slow"))
        .collect();
    s.wait_nodes(&slow_node).await;
    s.wait_loops(3).await;
    let slow = s.replicas("md-slow").await;
    s.check(
        slow == 1,
        &format!("md-slow keeps its node (CA's 10m): {slow}"),
    );
    let deleted = s.deleted_marked();
    s.check(
        deleted.len() == 1 && deleted[0].starts_with("md-fast"),
        &format!("only md-fast's Machine was deleted, for its mark: {deleted:?}"),
    );
    s.check_every_deletion_marked();
    s.passed();
}

/// The provider may not read infrastructure templates (RBAC: the shipped ClusterRole without its
/// infrastructure rules, which never named the stand-in's group either): the group that needs its
/// template cannot scale from zero, but CA still scales the group described by annotations.
#[tokio::test]
async fn unreadable_template_does_not_stop_other_groups() {
    let mut s = RealCapiScenario::new("rbac-template").await;
    s.template("md-infra-tmpl", "8", "16Gi", true).await;
    s.template("md-annotated-tmpl", "2", "4Gi", false).await;
    s.create_md(&s.md("md-infra", "md-infra-tmpl", 0, 3, 0))
        .await;
    let annotated = RealCapiScenario::capacity(
        s.md("md-annotated", "md-annotated-tmpl", 0, 3, 0),
        "2",
        "4Gi",
    );
    s.create_md(&annotated).await;
    let mut role = shipped_cluster_role();
    role.rules.get_or_insert_with(Vec::new).retain(|r| {
        !r.api_groups
            .iter()
            .flatten()
            .any(|g| g.starts_with("infrastructure.") || g == standin::GROUP)
    });
    let role_name = format!("provider-no-infra-{}", s.ns);
    apply_cluster_role(&s.client, &role_name, role).await;
    let (_, kubeconfig) = s.cp.restricted_identity(&role_name).await;
    s.start_provider_as(&kubeconfig, &[]).await;
    s.start_ca(s.autoscaler()).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("big", "6", "8Gi")).await;
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("small", "1500m", "1Gi")).await;
    s.wait_replicas("md-annotated", 1, UP).await;
    workload::wait_bound(&s.client, &s.ns, "small", UP).await;
    s.wait_loops(3).await;
    let infra = s.replicas("md-infra").await;
    s.check(
        infra == 0,
        &format!("md-infra cannot scale from zero: {infra}"),
    );
    s.passed();
}

/// The provider and CA are both killed while CA removes three empty nodes, then restarted: in the
/// end the group is at its min with exactly its Machines, no replica lost, every Machine CAPI
/// deleted carried the mark, and a mark the killed provider left without its decrement is taken
/// back within the grace period plus a repair interval.
#[tokio::test]
async fn restarts_in_the_middle_of_a_scale_down_lose_nothing() {
    let mut s = RealCapiScenario::new("restart-mid-scale-down").await;
    s.template("md-a-tmpl", "2", "4Gi", true).await;
    let md = RealCapiScenario::capacity(s.md("md-a", "md-a-tmpl", 1, 4, 4), "2", "4Gi");
    s.create_md(&md).await;
    s.wait_node_count(4).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    // The moment CA taints the first node for deletion, both go down.
    let client = s.client.clone();
    let ns = s.ns.clone();
    let tainted = poll_until(
        "CA taints a node for deletion",
        DOWN,
        Duration::from_millis(20),
        || {
            let client = client.clone();
            let ns = ns.clone();
            async move {
                let nodes = workload::scenario_nodes(&client, &ns)
                    .await
                    .unwrap_or_default();
                for name in nodes {
                    if let Ok(Some(node)) = Api::<Node>::all(client.clone()).get_opt(&name).await
                        && node
                            .spec
                            .and_then(|s| s.taints)
                            .unwrap_or_default()
                            .iter()
                            .any(|t| t.key == TO_BE_DELETED)
                    {
                        return Check::Done(name);
                    }
                }
                Check::Wait("no taint yet".into())
            }
        },
    )
    .await;
    let tainted = tainted.unwrap_or_else(|e| s.fail(&e));
    if let Some(ca) = s.ca.as_mut() {
        ca.kill();
    }
    s.provider = None;
    eprintln!("e2e: killed CA and the provider after CA tainted {tainted}");

    // A mark the killed provider wrote without its decrement is taken back by the repair, which
    // runs here with a short grace period so the scenario need not wait the default 30 s.
    s.start_provider(&["--mark-grace-period", "3s", "--repair-interval", "500ms"])
        .await;
    s.start_ca(s.autoscaler()).await;
    s.wait_replicas("md-a", 1, DOWN).await;
    let nodes = s.wait_node_count(1).await;
    let capi = &s.capi;
    let settled = poll_until(
        "one Machine left, none marked (within the grace period and a repair interval)",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async move {
            let machines = capi.api(Kind::Machine).list(&Default::default()).await;
            let marked = capi.marked_machines().await;
            match machines {
                Ok(l) if l.items.len() == 1 && marked.is_empty() => Check::Done(()),
                Ok(l) => Check::Wait(format!(
                    "Machines {:?}, marked {marked:?}",
                    l.items
                        .iter()
                        .map(|m| m.metadata.name.clone())
                        .collect::<Vec<_>>()
                )),
                Err(e) => Check::Wait(e.to_string()),
            }
        },
    )
    .await;
    if let Err(e) = settled {
        s.fail(&e);
    }
    let deleted = s.deleted_marked();
    s.check(
        deleted.len() == 3 && !deleted.contains(&nodes[0]),
        &format!(
            "three Machines deleted, each for its mark, not {}: {deleted:?}",
            nodes[0]
        ),
    );
    s.check_every_deletion_marked();
    let node = Api::<Node>::all(s.client.clone())
        .get(&nodes[0])
        .await
        .unwrap_or_else(|e| s.fail(&format!("get the remaining Node: {e}")));
    let taints = node.spec.and_then(|s| s.taints).unwrap_or_default();
    s.check(
        !taints.iter().any(|t| t.key == TO_BE_DELETED),
        &format!("the remaining node is not left tainted: {taints:?}"),
    );
    s.passed();
}

/// CA reaches the provider over mutual TLS (the standalone topology): the provider requires a client
/// certificate from its CA, CA's cloud-config names its certificate, key and the server's CA; a
/// scale-up from zero goes through.
#[tokio::test]
async fn autoscaler_over_mutual_tls() {
    let mut s = RealCapiScenario::new("mtls").await;
    s.template("md-a-tmpl", "2", "4Gi", true).await;
    let md = RealCapiScenario::capacity(s.md("md-a", "md-a-tmpl", 0, 3, 0), "2", "4Gi");
    s.create_md(&md).await;
    let dir = procs::work_dir().join(format!("mtls-{}", s.ns));
    std::fs::create_dir_all(&dir).expect("create the mTLS directory");
    let server_ca = Ca::generate();
    let client_ca = Ca::generate();
    let serving = server_ca.serving_cert("capi-autoscaler-provider");
    let client = client_ca.client_cert("cluster-autoscaler", None);
    let path = |name: &str, pem: &str| pki::write_private(&dir, name, pem);
    let (cert, key) = (
        path("tls.crt", &serving.cert),
        path("tls.key", &serving.key),
    );
    let client_ca_file = path("client-ca.crt", &client_ca.cert_pem);
    let (ca_cert, ca_key) = (
        path("ca-client.crt", &client.cert),
        path("ca-client.key", &client.key),
    );
    let server_ca_file = path("server-ca.crt", &server_ca.cert_pem);
    let discovery = format!("clusterapi:namespace={}", s.ns);
    let args = [
        "--node-group-auto-discovery",
        discovery.as_str(),
        "--tls-cert",
        cert.to_str().unwrap_or_default(),
        "--tls-key",
        key.to_str().unwrap_or_default(),
        "--tls-client-ca",
        client_ca_file.to_str().unwrap_or_default(),
    ];
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&server_ca.cert_pem))
        .identity(Identity::from_pem(&client.cert, &client.key));
    let provider = start_provider_tls(&args, s.cp.admin_kubeconfig(), tls).await;
    let ca = support::autoscaler::Autoscaler::new(&s.ns, &provider.address).tls(
        &ca_cert,
        &ca_key,
        &server_ca_file,
    );
    s.provider = Some(provider);
    s.start_ca(ca).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas("md-a", 1, UP).await;
    workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    s.passed();
}

/// `explain` for three pods, with the real CA's verdicts, each asked right after CA's verdict on it:
/// one no group fits (8 CPUs; md-a has 2, md-b 1), one CA scaled md-a up for (0 -> 1), and one that
/// found md-a at its max (1). Each run asks the running provider (`--metrics-address`), reads the
/// pod's Events and CA's status ConfigMap, and says, as data: CA's verdict and the groups it named,
/// and the provider's view of each group (at max, template).
#[tokio::test]
async fn explain_says_why_ca_did_or_did_not_scale_up_for_a_pod() {
    let mut s = RealCapiScenario::new("explain").await;
    s.template("md-a-tmpl", "2", "4Gi", false).await;
    s.template("md-b-tmpl", "1", "2Gi", false).await;
    let a = RealCapiScenario::capacity(s.md("md-a", "md-a-tmpl", 0, 1, 0), "2", "4Gi");
    s.create_md(&a).await;
    let b = RealCapiScenario::capacity(s.md("md-b", "md-b-tmpl", 0, 3, 0), "1", "2Gi");
    s.create_md(&b).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;
    let id = |md: &str| format!("MachineDeployment/{}/{md}", s.ns);

    let provider = s.provider.as_ref().expect("the provider runs");
    let kubeconfig = s.cp.admin_kubeconfig().display().to_string();
    let discovery = format!("clusterapi:namespace={}", s.ns);
    let explain = |pod: &str, json: bool| {
        let pod = format!("{}/{pod}", s.ns);
        let mut args: Vec<String> = ["explain", pod.as_str(), "--metrics-address"]
            .iter()
            .map(|a| a.to_string())
            .collect();
        args.push(provider.metrics_address.clone());
        for a in [
            "--autoscaler-namespace",
            &s.ns,
            "--status-config-map",
            support::autoscaler::STATUS_CONFIGMAP,
            "--cloud-config",
            &kubeconfig,
            "--node-group-auto-discovery",
            &discovery,
        ] {
            args.push(a.to_string());
        }
        if json {
            args.extend(["-o".to_string(), "json".to_string()]);
        }
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            support::infra::run_cli(&args, Duration::from_secs(60)).await
        }
    };
    // CA's verdict on a pod may change from loop to loop (a first NotTriggerScaleUp can name only the
    // Nodes it did not match, before the groups' templates, or while md-a's new Node comes up): ask
    // until it names `reason`.
    let settled = async |pod: &str, reason: &str| {
        let result = poll_until(
            &format!("CA's verdict on {pod} names {reason:?}"),
            UP,
            Duration::from_millis(500),
            || async {
                let verdict = explain(pod, true).await.json()["verdict"].clone();
                if verdict["reasons"].to_string().contains(reason) {
                    Check::Done(())
                } else {
                    Check::Wait(format!("{verdict:#}"))
                }
            },
        )
        .await;
        if let Err(e) = result {
            s.fail(&e);
        }
    };
    let mut screens = Vec::new();
    let mut explained = std::collections::BTreeMap::new();
    let mut explain_now = async |pod: &'static str| {
        let run = explain(pod, true).await;
        s.check(run.code == Some(0), &run.describe());
        explained.insert(pod, run.json());
        let table = explain(pod, false).await;
        s.check(table.code == Some(0), &table.describe());
        screens.push(format!("$ explain {}/{pod}\n{}", s.ns, table.stdout));
    };

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("too-big", "8", "1Gi")).await;
    wait_pod_event(&s, "too-big", "NotTriggerScaleUp").await;
    settled("too-big", "Insufficient cpu").await;
    explain_now("too-big").await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("fits", "1500m", "1Gi")).await;
    wait_pod_event(&s, "fits", "TriggeredScaleUp").await;
    workload::wait_bound(&s.client, &s.ns, "fits", UP).await;
    explain_now("fits").await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("over-max", "1500m", "1Gi")).await;
    wait_pod_event(&s, "over-max", "NotTriggerScaleUp").await;
    settled("over-max", "max node group size reached").await;
    explain_now("over-max").await;
    eprintln!("e2e: explain screens:\n{}", screens.join("\n"));

    let group = |e: &serde_json::Value, md: &str| -> serde_json::Value {
        e["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|g| g["id"] == id(md).as_str())
            .cloned()
            .unwrap_or_else(|| s.fail(&format!("no group {md} in {e:#}")))
    };
    for e in explained.values() {
        s.check(
            e["provider_source"]
                .as_str()
                .is_some_and(|src| src.starts_with("the running provider at")),
            &format!(
                "explain asked the running provider: {}",
                e["provider_source"]
            ),
        );
        s.check(
            e["status"]["autoscaler"].is_string() && e["status"]["unreadable"].is_null(),
            &format!("CA's status ConfigMap read: {:#}", e["status"]),
        );
    }

    // Scaled: CA's verdict names md-a 0 -> 1 (max 1); md-a first, marked.
    let fits = &explained["fits"];
    s.check(
        fits["verdict"]
            == json!({"kind": "scale_up_triggered",
                "scale_ups": [{"group": id("md-a"), "from": 0, "to": 1, "max": 1}]}),
        &format!("fits: {:#}", fits["verdict"]),
    );
    s.check(
        fits["groups"][0]["id"] == id("md-a").as_str() && fits["groups"][0]["named_by_ca"] == true,
        &format!("fits: md-a first and named: {:#}", fits["groups"]),
    );
    s.check(
        fits["pod"]["node"]
            .as_str()
            .is_some_and(|n| n.starts_with("md-a")),
        &format!("fits runs on md-a's Node: {:#}", fits["pod"]),
    );

    // Hit max: CA says so, and the provider's view shows md-a at its max.
    let over = &explained["over-max"];
    let reasons = over["verdict"]["reasons"].to_string();
    s.check(
        over["verdict"]["kind"] == "no_scale_up" && reasons.contains("max node group size reached"),
        &format!("over-max: {:#}", over["verdict"]),
    );
    let md_a = group(over, "md-a");
    s.check(
        md_a["at_max"] == true && md_a["target"] == 1 && md_a["max"] == 1,
        &format!("over-max: md-a at max: {md_a:#}"),
    );
    s.check(over["pod"]["node"].is_null(), "over-max stays pending");

    // No group fits: CA's reasons, and both groups' templates (2 and 1 CPUs) beside them.
    let big = &explained["too-big"];
    s.check(
        big["verdict"]["kind"] == "no_scale_up"
            && big["verdict"]["reasons"]
                .to_string()
                .contains("Insufficient cpu"),
        &format!("too-big: {:#}", big["verdict"]),
    );
    for (md, size) in [("md-a", "2 cpu, 4Gi mem"), ("md-b", "1 cpu, 2Gi mem")] {
        let g = group(big, md);
        s.check(
            g["has_template"] == true
                && g["template"].as_str().is_some_and(|t| t.starts_with(size)),
            &format!("too-big: {md}'s template: {g:#}"),
        );
        s.check(
            g["named_by_ca"] == false,
            &format!("too-big: {md} not named"),
        );
    }
    s.check(
        big["pod"]["unschedulable"]
            .as_str()
            .is_some_and(|u| u.contains("Unschedulable")),
        &format!("too-big: the scheduler's reason: {:#}", big["pod"]),
    );
    s.passed();
}

// ---------------------------------------------------------------------------------------------------

/// Waits until exactly `n` of `pods` are bound.
async fn wait_bound_count(s: &RealCapiScenario, pods: &[&str], n: usize) {
    let (client, ns) = (&s.client, &s.ns);
    let result = poll_until(
        &format!("{n} pods bound"),
        UP,
        Duration::from_millis(100),
        || async move {
            let mut bound = 0;
            for pod in pods {
                if workload::node_of(client, ns, pod).await.is_some() {
                    bound += 1;
                }
            }
            if bound == n {
                Check::Done(())
            } else {
                Check::Wait(format!("{bound} bound"))
            }
        },
    )
    .await;
    if let Err(e) = result {
        s.fail(&e);
    }
}

/// Waits until pod `pod` has an Event with `reason`.
async fn wait_pod_event(s: &RealCapiScenario, pod: &str, reason: &str) {
    let (client, ns) = (&s.client, &s.ns);
    let result = poll_until(
        &format!("Event {reason} on {pod}"),
        UP,
        Duration::from_millis(200),
        || async move {
            let reasons = workload::pod_event_reasons(client, ns, pod).await;
            if reasons.iter().any(|r| r == reason) {
                Check::Done(())
            } else {
                Check::Wait(format!("reasons {reasons:?}"))
            }
        },
    )
    .await;
    if let Err(e) = result {
        s.fail(&e);
    }
}

/// Waits until MachinePool `pool`'s `spec.replicas` is `want`.
async fn wait_pool(s: &RealCapiScenario, want: i64, timeout: Duration) {
    let capi = &s.capi;
    let result = poll_until(
        &format!("MachinePool pool replicas = {want}"),
        timeout,
        Duration::from_millis(100),
        || async move {
            match capi.api(Kind::MachinePool).get("pool").await {
                Ok(mp) if mp.data["spec"]["replicas"] == json!(want) => Check::Done(()),
                Ok(mp) => Check::Wait(format!("replicas {}", mp.data["spec"]["replicas"])),
                Err(e) => Check::Wait(e.to_string()),
            }
        },
    )
    .await;
    if let Err(e) = result {
        s.fail(&e);
    }
}
