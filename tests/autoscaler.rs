//! End-to-end scenarios with the real cluster-autoscaler (the default pinned version) driving the
//! provider, on one shared control plane (Cluster API v1beta2 CRDs), the real kube-scheduler binding
//! pods and the test reconciler playing CAPI's controllers and the kubelets. Each scenario has its own
//! namespace, provider and CA; pods only fit their own scenario's groups, so scenarios run side by
//! side. Assertions are on objects (replicas, Machines, Nodes, pods, Events), never on log text.

pub mod support;

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use support::Setup;
use support::capi::{Kind, Scalable, apply_cluster_role, shipped_cluster_role};
use support::infra;
use support::pki::{self, Ca};
use support::procs::{self, Check, poll_until};
use support::provider::start_provider_tls;
use support::reconciler::ReconcilerConfig;
use support::scenario::{CAPACITY, Scenario, scale_up_and_down};
use support::workload::{self, PodSpec};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

const UP: Duration = Duration::from_secs(60);
const DOWN: Duration = Duration::from_secs(90);
const PRICE: &str = "capi-autoscaler-provider/hourly-price";
const OPTION_UNNEEDED: &str = "cluster.x-k8s.io/autoscaling-options-scaledownunneededtime";
const REVISION: &str = "machinedeployment.clusters.x-k8s.io/revision";
/// CA's taint on a node it is deleting.
const TO_BE_DELETED: &str = "ToBeDeletedByClusterAutoscaler";

/// A pending pod that fits only a zero-size group with capacity annotations makes CA scale the group
/// up from zero through the provider's template; the pod is bound to the new Node; once the pod is
/// gone CA removes the empty Node through DeleteNodes: that Machine marked, replicas back to 0.
#[tokio::test]
async fn scale_up_from_zero_with_capacity_annotations_and_back_down() {
    let mut s = Scenario::new("scale-from-zero-annotations", Setup::shipped()).await;
    let times = scale_up_and_down(&mut s, |ca| ca).await;
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
    let mut s = Scenario::new("scale-from-zero-infra-template", Setup::shipped()).await;
    infra::create_template(
        &s.client,
        &s.ns,
        "md-big-tmpl",
        "v1beta1",
        Some(infra::template_status(
            &[("cpu", "4"), ("memory", "8Gi"), ("pods", "110")],
            Some(("amd64", "linux")),
        )),
    )
    .await;
    s.capi
        .create_deployment(&s.md("md-big", 0, 3, 0), false)
        .await;
    let small = Scenario::capacity(s.md("md-small", 0, 3, 0), "2", "4Gi");
    s.capi.create_deployment(&small, false).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("big", "3", "2Gi")).await;
    s.wait_replicas(Kind::MachineDeployment, "md-big", 1, UP)
        .await;
    workload::wait_bound(&s.client, &s.ns, "big", UP).await;
    let small = s.capi.replicas(Kind::MachineDeployment, "md-small").await;
    s.check(small == 0, &format!("md-small stays at 0: {small}"));
    s.passed();
}

/// A zero-size group with neither capacity annotations nor template capacity cannot be simulated:
/// CA does not scale it (its replicas stay 0 over several loops) and says so on the pod.
#[tokio::test]
async fn no_scale_up_without_a_template() {
    let mut s = Scenario::new("no-template", Setup::shipped()).await;
    s.capi
        .create_deployment(&s.md("md-blank", 0, 3, 0), false)
        .await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "500m", "256Mi")).await;
    wait_pod_event(&s, "web", "NotTriggerScaleUp").await;
    s.wait_loops(5).await;
    let replicas = s.capi.replicas(Kind::MachineDeployment, "md-blank").await;
    s.check(replicas == 0, &format!("md-blank stays at 0: {replicas}"));
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
    let mut s = Scenario::new("max-respected", Setup::shipped()).await;
    let md = Scenario::capacity(s.md("md-a", 0, 2, 0), "2", "4Gi");
    s.capi.create_deployment(&md, false).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    for i in 0..4 {
        let pod = PodSpec::new(&format!("p{i}"), "1500m", "1Gi");
        workload::create_pod(&s.client, &s.ns, &pod).await;
    }
    s.wait_replicas(Kind::MachineDeployment, "md-a", 2, UP)
        .await;
    wait_bound_count(&s, &["p0", "p1", "p2", "p3"], 2).await;
    s.wait_loops(5).await;
    let replicas = s.capi.replicas(Kind::MachineDeployment, "md-a").await;
    s.check(
        replicas == 2,
        &format!("md-a stays at its max 2: {replicas}"),
    );
    s.passed();
}

/// A group at its min size keeps its empty node: after several times the unneeded time, no Machine
/// is marked and replicas are unchanged.
#[tokio::test]
async fn min_size_is_respected() {
    let mut s = Scenario::new("min-respected", Setup::shipped()).await;
    let md = Scenario::capacity(s.md("md-a", 1, 3, 1), "2", "4Gi");
    s.capi.create_deployment(&md, false).await;
    s.wait_node_count(1).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    // unneeded time 5 s, a loop every 2 s: 8 loops are three times the time a node needs.
    s.wait_loops(8).await;
    let replicas = s.capi.replicas(Kind::MachineDeployment, "md-a").await;
    s.check(
        replicas == 1,
        &format!("md-a stays at its min 1: {replicas}"),
    );
    let marked = s.capi.marked_machines().await;
    s.check(marked.is_empty(), &format!("no Machine marked: {marked:?}"));
    s.passed();
}

/// Two nodes, one running a pod, one empty: CA removes the empty one. The reconciler deletes the
/// newest unmarked Machine when replicas drop without a mark, and the busy node is the newest, so
/// only a mark on the right Machine removes the right node.
#[tokio::test]
async fn empty_node_is_scaled_down_by_its_mark() {
    let mut s = Scenario::new("empty-node-down", Setup::shipped()).await;
    let md = Scenario::capacity(s.md("md-a", 0, 3, 1), "2", "4Gi");
    s.capi.create_deployment(&md, false).await;
    let empty = s.wait_node_count(1).await.remove(0);
    s.capi.scale(Kind::MachineDeployment, "md-a", 2).await;
    let nodes = s.wait_node_count(2).await;
    let busy = nodes
        .into_iter()
        .find(|n| *n != empty)
        .expect("a second Node");
    let pod = PodSpec::new("web", "1", "1Gi").select("kubernetes.io/hostname", &busy);
    workload::create_pod(&s.client, &s.ns, &pod).await;
    workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    s.wait_replicas(Kind::MachineDeployment, "md-a", 1, DOWN)
        .await;
    s.wait_nodes(std::slice::from_ref(&busy)).await;
    let deleted = s.reconciler.deleted_marked();
    s.check(
        deleted == vec![empty.clone()],
        &format!("only the empty node's Machine {empty} was marked and deleted: {deleted:?}"),
    );
    s.check(
        workload::node_of(&s.client, &s.ns, "web").await.as_deref() == Some(busy.as_str()),
        "the pod still runs on the busy node",
    );
    s.passed();
}

/// Two lightly used nodes: CA drains one (evicts its pod, which fits on the other) and removes it
/// through the provider: its Machine marked, replicas 2 → 1. The pod's replacement (the test acts
/// as the ReplicaSet controller) lands on the remaining node.
#[tokio::test]
async fn node_with_a_movable_pod_is_drained_and_scaled_down() {
    let mut s = Scenario::new("drain-down", Setup::shipped()).await;
    let md = Scenario::capacity(s.md("md-a", 0, 3, 2), "4", "8Gi");
    s.capi.create_deployment(&md, false).await;
    let nodes = s.wait_node_count(2).await;
    // One free-to-move pod on each node, placed as a scheduler would (spec.nodeName at creation).
    for (i, node) in nodes.iter().enumerate() {
        let pod = PodSpec::new(&format!("m{i}"), "500m", "512Mi");
        workload::create_bound_pod(&s.client, &s.ns, &pod, node).await;
    }
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    s.wait_replicas(Kind::MachineDeployment, "md-a", 1, DOWN)
        .await;
    let remaining = s.wait_node_count(1).await.remove(0);
    let removed: Vec<&String> = nodes.iter().filter(|n| **n != remaining).collect();
    let deleted = s.reconciler.deleted_marked();
    s.check(
        deleted.iter().collect::<Vec<_>>() == removed,
        &format!(
            "the drained node's Machine was deleted for its mark: {deleted:?}, removed {removed:?}"
        ),
    );
    let evicted = if removed[0] == &nodes[0] { "m0" } else { "m1" };
    s.check(
        !workload::pod_exists(&s.client, &s.ns, evicted).await,
        &format!("pod {evicted} was evicted from the drained node"),
    );
    workload::create_pod(
        &s.client,
        &s.ns,
        &PodSpec::new("m-replacement", "500m", "512Mi"),
    )
    .await;
    let node = workload::wait_bound(&s.client, &s.ns, "m-replacement", UP).await;
    s.check(
        node == remaining,
        "the replacement runs on the remaining node",
    );
    s.passed();
}

/// A MachinePool group: scaled up from zero for a pod (replicas through the scale subresource, the
/// new instance in `providerIDList`), then back down when the pod goes.
#[tokio::test]
async fn machine_pool_scales_up_and_down() {
    let mut s = Scenario::new("machinepool", Setup::shipped()).await;
    let mp = Scalable::mp("pool").bounds(0, 3).replicas(0).annotation(
        &format!("{CAPACITY}/labels"),
        &workload::scenario_labels(&s.ns, &[]),
    );
    let mp = Scenario::capacity(mp, "2", "4Gi");
    s.capi.create(&mp).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas(Kind::MachinePool, "pool", 1, UP).await;
    let node = workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    let pool = s
        .capi
        .api(Kind::MachinePool)
        .get("pool")
        .await
        .expect("get MachinePool");
    let ids = pool.data["spec"]["providerIDList"]
        .as_array()
        .map_or(0, Vec::len);
    s.check(ids == 1, &format!("one entry in providerIDList: {ids}"));

    workload::delete_pod(&s.client, &s.ns, "web").await;
    s.wait_replicas(Kind::MachinePool, "pool", 0, DOWN).await;
    s.wait_nodes(&[]).await;
    let gone = Api::<Node>::all(s.client.clone())
        .get_opt(&node)
        .await
        .ok()
        .flatten();
    s.check(gone.is_none(), &format!("Node {node} is gone"));
    s.passed();
}

/// A Machine that never gets a Node: after max-node-provision-time CA gives up on it (CA 1.36 either
/// reverts the timed-out scale-up with DecreaseTargetSize or removes the unregistered instance with
/// DeleteNodes, whichever of its two 15 s clocks fires first), backs the group off and scales the
/// other fitting group instead. In the end the broken group is at 0 with no Machine left, and CA
/// stopped retrying it: no Machine is made for it in five more loops. (Before the back-off, CA may
/// remove the instance and raise the group again in one loop, a few times over; each round trip can
/// let Cluster API replace the Machine, so how many were made before is CA's timing, not ours.)
#[tokio::test]
async fn unprovisioned_machine_is_given_up_and_another_group_scales() {
    let config = ReconcilerConfig::default().never_provision("md-broken");
    let mut s = Scenario::with_reconciler("provision-failure", Setup::shipped(), config).await;
    // The broken group is the better fit (least waste), so CA tries it first.
    let broken = Scenario::capacity(s.md("md-broken", 0, 3, 0), "2", "4Gi");
    let spare = Scenario::capacity(s.md("md-spare", 0, 3, 0), "4", "8Gi");
    s.capi.create_deployment(&broken, false).await;
    s.capi.create_deployment(&spare, false).await;
    s.start_provider(&[]).await;
    let ca = s.autoscaler().flag("--max-node-provision-time=15s");
    s.start_ca(ca).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas(Kind::MachineDeployment, "md-broken", 1, UP)
        .await;
    s.wait_replicas(Kind::MachineDeployment, "md-spare", 1, DOWN)
        .await;
    let node = workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    s.check(
        node.starts_with("md-spare"),
        &format!("the pod runs on md-spare: {node}"),
    );
    s.wait_replicas(Kind::MachineDeployment, "md-broken", 0, DOWN)
        .await;
    s.reconciler.wait_passes(2).await;
    let left: Vec<String> = machine_names(&s)
        .await
        .into_iter()
        .filter(|m| m.starts_with("md-broken"))
        .collect();
    s.check(
        left.is_empty(),
        &format!("no md-broken Machine left: {left:?}"),
    );
    let made = |s: &Scenario| {
        s.reconciler
            .actions()
            .iter()
            .filter(|a| a.starts_with("created Machine md-broken"))
            .count()
    };
    let before = made(&s);
    s.wait_loops(5).await;
    let after = made(&s);
    s.check(
        before >= 1 && after == before,
        &format!(
            "CA backed md-broken off: {before} Machines made for it before, none in 5 more loops ({after} in all)"
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
/// second Cluster's MachineDeployment has two Machines whose Nodes are not in CA's cluster (they never
/// become Nodes here): served to CA, they would be instances that never registered, deleted after
/// `--max-node-provision-time`. The provider serves only `--cluster`'s groups, so past that time (15 s)
/// and more loops, none of the second Cluster's Machines is marked or deleted and its replicas stay,
/// while the first Cluster scales up from zero for a pod and back down as usual.
#[tokio::test]
async fn a_second_clusters_groups_are_never_touched_while_the_first_scales() {
    const PROVISION: Duration = Duration::from_secs(15);
    let config = ReconcilerConfig::default().never_provision("md-other");
    let mut s = Scenario::with_reconciler("two-clusters", Setup::shipped(), config).await;
    let other = Scenario::capacity(s.md("md-other", 0, 5, 2), "2", "4Gi").cluster("other");
    s.capi.create_deployment(&other, false).await;
    let theirs = poll_until(
        "the other Cluster's two Machines",
        UP,
        Duration::from_millis(100),
        || {
            let s = &s;
            async move {
                let names: Vec<String> = machine_names(s)
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
    let md = Scenario::capacity(s.md("md-a", 0, 3, 0), "2", "4Gi");
    s.capi.create_deployment(&md, false).await;
    let cluster = format!("{}/{}", s.ns, support::capi::DEFAULT_CLUSTER);
    s.start_provider(&["--cluster", &cluster]).await;
    let provision = format!("--max-node-provision-time={}s", PROVISION.as_secs());
    s.start_ca(s.autoscaler().flag(&provision)).await;
    let ca_started = std::time::Instant::now();

    // The first Cluster: up from zero for a pod that fits either group, and back down.
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas(Kind::MachineDeployment, "md-a", 1, UP)
        .await;
    let node = workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    s.check(
        node.starts_with("md-a"),
        &format!("the pod runs on the first Cluster's node: {node}"),
    );
    workload::delete_pod(&s.client, &s.ns, "web").await;
    s.wait_replicas(Kind::MachineDeployment, "md-a", 0, DOWN)
        .await;
    s.wait_nodes(&[]).await;
    // Past CA's provision timeout by a margin, then five more loops.
    while ca_started.elapsed() < PROVISION * 2 {
        s.wait_loops(1).await;
    }
    s.wait_loops(5).await;

    s.check(
        s.capi.replicas(Kind::MachineDeployment, "md-other").await == 2,
        "the other Cluster's replicas unchanged",
    );
    let left: Vec<String> = machine_names(&s)
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
    let deleted = s.reconciler.deleted_marked();
    s.check(
        deleted == vec![node.clone()],
        &format!("only the first Cluster's node was removed, for its mark: {deleted:?}"),
    );
    s.passed();
}

/// CA's `price` expander picks the cheaper of two groups that both fit, from the provider's prices
/// (the expensive one is the tighter fit, so least-waste would have picked it).
#[tokio::test]
async fn price_expander_chooses_the_cheaper_group() {
    let mut s = Scenario::new("price-expander", Setup::shipped()).await;
    let dear = Scenario::capacity(s.md("md-dear", 0, 3, 0), "2", "4Gi").annotation(PRICE, "2.0");
    let cheap = Scenario::capacity(s.md("md-cheap", 0, 3, 0), "4", "8Gi").annotation(PRICE, "0.1");
    s.capi.create_deployment(&dear, false).await;
    s.capi.create_deployment(&cheap, false).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler().flag("--expander=price")).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas(Kind::MachineDeployment, "md-cheap", 1, UP)
        .await;
    workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    let dear = s.capi.replicas(Kind::MachineDeployment, "md-dear").await;
    s.check(dear == 0, &format!("md-dear stays at 0: {dear}"));
    s.passed();
}

/// `--balance-similar-node-groups`: two groups alike but for their zone share a scale-up of four
/// one-per-node pods, two nodes each.
#[tokio::test]
async fn balance_similar_node_groups_spreads_over_zones() {
    let mut s = Scenario::new("balance-zones", Setup::shipped()).await;
    for (md, zone) in [("md-zone-a", "zone-a"), ("md-zone-b", "zone-b")] {
        let label = format!("topology.kubernetes.io/zone={zone}");
        let group = s.labels(s.md(md, 0, 4, 0), &[label.as_str()]);
        s.capi
            .create_deployment(&Scenario::capacity(group, "2", "4Gi"), false)
            .await;
    }
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler().flag("--balance-similar-node-groups=true"))
        .await;

    for i in 0..4 {
        let pod = PodSpec::new(&format!("p{i}"), "1500m", "1Gi");
        workload::create_pod(&s.client, &s.ns, &pod).await;
    }
    s.wait_replicas(Kind::MachineDeployment, "md-zone-a", 2, UP)
        .await;
    s.wait_replicas(Kind::MachineDeployment, "md-zone-b", 2, UP)
        .await;
    wait_bound_count(&s, &["p0", "p1", "p2", "p3"], 4).await;
    s.passed();
}

/// The per-group `autoscaling-options-scaledownunneededtime` annotation: with CA's own unneeded time
/// at 10 minutes, the group that says 2 s loses its empty node, the other keeps its.
#[tokio::test]
async fn per_group_scale_down_unneeded_time() {
    let mut s = Scenario::new("per-group-unneeded-time", Setup::shipped()).await;
    let fast =
        Scenario::capacity(s.md("md-fast", 0, 3, 1), "2", "4Gi").annotation(OPTION_UNNEEDED, "2s");
    let slow = Scenario::capacity(s.md("md-slow", 0, 3, 1), "2", "4Gi");
    s.capi.create_deployment(&fast, false).await;
    s.capi.create_deployment(&slow, false).await;
    s.wait_node_count(2).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler().flag("--scale-down-unneeded-time=10m"))
        .await;

    s.wait_replicas(Kind::MachineDeployment, "md-fast", 0, DOWN)
        .await;
    s.wait_loops(3).await;
    let slow = s.capi.replicas(Kind::MachineDeployment, "md-slow").await;
    s.check(
        slow == 1,
        &format!("md-slow keeps its node (CA's 10m): {slow}"),
    );
    s.passed();
}

/// The provider may not read infrastructure templates (RBAC): the group that needs its template
/// cannot scale from zero, but CA still scales the group described by annotations.
#[tokio::test]
async fn unreadable_template_does_not_stop_other_groups() {
    let mut s = Scenario::new("rbac-template", Setup::shipped()).await;
    infra::create_template(
        &s.client,
        &s.ns,
        "md-infra-tmpl",
        "v1beta1",
        Some(infra::template_status(
            &[("cpu", "8"), ("memory", "16Gi")],
            None,
        )),
    )
    .await;
    s.capi
        .create_deployment(&s.md("md-infra", 0, 3, 0), false)
        .await;
    let annotated = Scenario::capacity(s.md("md-annotated", 0, 3, 0), "2", "4Gi");
    s.capi.create_deployment(&annotated, false).await;
    let mut role = shipped_cluster_role();
    role.rules.get_or_insert_with(Vec::new).retain(|r| {
        !r.api_groups
            .iter()
            .flatten()
            .any(|g| g.starts_with("infrastructure."))
    });
    let role_name = format!("provider-no-infra-{}", s.ns);
    apply_cluster_role(&s.client, &role_name, role).await;
    let (_, kubeconfig) = s.cp.restricted_identity(&role_name).await;
    s.start_provider_as(&kubeconfig, &[]).await;
    s.start_ca(s.autoscaler()).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("big", "6", "8Gi")).await;
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("small", "1500m", "1Gi")).await;
    s.wait_replicas(Kind::MachineDeployment, "md-annotated", 1, UP)
        .await;
    workload::wait_bound(&s.client, &s.ns, "small", UP).await;
    s.wait_loops(3).await;
    let infra = s.capi.replicas(Kind::MachineDeployment, "md-infra").await;
    s.check(
        infra == 0,
        &format!("md-infra cannot scale from zero: {infra}"),
    );
    s.passed();
}

/// The provider and CA are both killed while CA removes three empty nodes, then restarted: in the
/// end the group is at its min with exactly its Machines, no replica lost, and a mark the killed
/// provider left without its decrement is taken back within the grace period plus a repair interval.
#[tokio::test]
async fn restarts_in_the_middle_of_a_scale_down_lose_nothing() {
    let mut s = Scenario::new("restart-mid-scale-down", Setup::shipped()).await;
    let md = Scenario::capacity(s.md("md-a", 1, 4, 4), "2", "4Gi");
    s.capi.create_deployment(&md, false).await;
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
    // runs here with a short grace period so the scenario need not wait the default minute.
    s.start_provider(&["--mark-grace-period", "3s", "--repair-interval", "500ms"])
        .await;
    s.start_ca(s.autoscaler()).await;
    s.wait_replicas(Kind::MachineDeployment, "md-a", 1, DOWN)
        .await;
    let nodes = s.wait_node_count(1).await;
    s.reconciler.wait_passes(3).await;
    let machines = machine_names(&s).await;
    s.check(
        machines.len() == 1,
        &format!("one Machine left: {machines:?}"),
    );
    let capi = &s.capi;
    let unmarked = poll_until(
        "no Machine left marked (within the grace period and a repair interval)",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async move {
            let marked = capi.marked_machines().await;
            if marked.is_empty() {
                Check::Done(())
            } else {
                Check::Wait(format!("marked {marked:?}"))
            }
        },
    )
    .await;
    if let Err(e) = unmarked {
        s.fail(&e);
    }
    let deleted = s.reconciler.deleted_marked();
    s.check(
        deleted.len() == 3,
        &format!("three Machines deleted, each for its mark: {deleted:?}"),
    );
    let node = Api::<Node>::all(s.client.clone())
        .get(&nodes[0])
        .await
        .expect("get the remaining Node");
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
    let mut s = Scenario::new("mtls", Setup::shipped()).await;
    let md = Scenario::capacity(s.md("md-a", 0, 3, 0), "2", "4Gi");
    s.capi.create_deployment(&md, false).await;
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
    s.wait_replicas(Kind::MachineDeployment, "md-a", 1, UP)
        .await;
    workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    s.passed();
}

/// While a MachineDeployment rolls out (an older MachineSet still holds replicas), CA removes none
/// of its nodes, however long they stay empty; once the rollout is over, it scales it down.
#[tokio::test]
async fn no_scale_down_while_a_machine_deployment_rolls_out() {
    // Paused until both MachineSets exist, or it would make one of its own for the new MD.
    let config = ReconcilerConfig::default().paused();
    let mut s = Scenario::with_reconciler("rollout", Setup::shipped(), config).await;
    let md = Scenario::capacity(s.md("md-r", 0, 4, 2), "2", "4Gi");
    s.capi.create(&md).await;
    let old = Scalable::ms("md-r-old")
        .owned_by("md-r")
        .replicas(1)
        .annotation(REVISION, "1");
    s.capi.create(&old).await;
    let new = Scalable::ms("md-r-new")
        .owned_by("md-r")
        .replicas(1)
        .annotation(REVISION, "2");
    s.capi.create(&new).await;
    s.reconciler.resume();
    s.wait_node_count(2).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    // Unneeded after 5 s; 8 loops (16 s) leave CA every chance.
    s.wait_loops(8).await;
    let replicas = s.capi.replicas(Kind::MachineDeployment, "md-r").await;
    s.check(
        replicas == 2,
        &format!("md-r keeps its nodes while rolling out: {replicas}"),
    );
    let marked = s.capi.marked_machines().await;
    s.check(
        marked.is_empty(),
        &format!("no Machine marked during the rollout: {marked:?}"),
    );

    // The rollout ends: the old MachineSet is scaled away (CAPI's MachineDeployment controller).
    s.capi.scale(Kind::MachineSet, "md-r-old", 0).await;
    s.wait_replicas(Kind::MachineDeployment, "md-r", 0, DOWN)
        .await;
    s.wait_nodes(&[]).await;
    s.passed();
}

// ---------------------------------------------------------------------------------------------------

/// Waits until exactly `n` of `pods` are bound.
async fn wait_bound_count(s: &Scenario, pods: &[&str], n: usize) {
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
async fn wait_pod_event(s: &Scenario, pod: &str, reason: &str) {
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

/// The names of the Machines in the scenario's namespace that are not being deleted.
async fn machine_names(s: &Scenario) -> Vec<String> {
    s.capi
        .api(Kind::Machine)
        .list(&Default::default())
        .await
        .unwrap_or_else(|e| s.fail(&e.to_string()))
        .items
        .into_iter()
        .filter(|m| m.metadata.deletion_timestamp.is_none())
        .filter_map(|m| m.metadata.name)
        .collect()
}
