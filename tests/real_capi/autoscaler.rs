//! The real cluster-autoscaler, through this provider, with the real Cluster API manager: scale from
//! zero and back, the node CA chose under every deletion order, no removal during a rollout, a drain.

use crate::support;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use support::autoscaler::AutoscalerProcess;
use support::capi::Rpc;
use support::procs::{self, Check, poll_until};
use support::real_capi::{
    CAPACITY, DEPLOYMENT_NAME, MACHINES, api, create, machine_deployment, machines_of,
    machines_with_nodes, name_of, replicas,
};
use support::real_capi_namespace::{RealCapiNamespace, SIZE};
use support::standin;
use support::workload::{self, PodSpec, scenario_labels};

/// The real cluster-autoscaler, through this provider, with the real CAPI manager: a pending pod
/// that fits only a group at zero (min 0, replicas defaulted to 0 by CAPI's webhook; its size from
/// the stand-in template's `status.capacity`) makes CA raise
/// its replicas; CAPI's MachineSet makes the Machine, the stand-in its Node, the scheduler binds the
/// pod there; once the pod is gone CA removes the empty Node through DeleteNodes and CAPI deletes that
/// Machine and Node, replicas back to 0.
#[tokio::test]
async fn cluster_autoscaler_scales_a_group_up_from_zero_and_back_down_through_real_capi() {
    let s = RealCapiNamespace::new(&SIZE).await;
    let (client, ns) = (s.client.clone(), s.ns.clone());
    // The size comes from the template's status (the scale-from-zero contract), read by the
    // provider through the stand-in's group; only the Node label is an annotation.
    let mut md = machine_deployment("pool", "workload", "small", "0", "3");
    md["metadata"]["annotations"][format!("{CAPACITY}/labels")] = json!(scenario_labels(&ns, &[]));
    let mds = api(&client, &ns, "v1beta2", "MachineDeployment");
    let created = create(&mds, &md)
        .await
        .unwrap_or_else(|e| panic!("create MachineDeployment {ns}/pool: {e}"));
    assert_eq!(created.data["spec"]["replicas"], json!(0));

    let provider = s.provider().await;
    let mut ca = s.start_ca(&provider).await;
    let fail =
        |message: String, ca: &AutoscalerProcess| -> ! { s.fail(message, &provider, Some(ca)) };

    let t_up = Instant::now();
    workload::create_pod(&client, &ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    let raised = poll_until(
        "CA raises pool to 1",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            match replicas(&client, &ns, "pool").await {
                Ok(1) => Check::Done(()),
                Ok(n) => Check::Wait(format!("replicas {n}")),
                Err(e) => Check::Wait(e),
            }
        },
    )
    .await;
    if let Err(e) = raised {
        fail(e, &ca);
    }
    let up = t_up.elapsed();
    let machines = match poll_until(
        "the Machine of pool with its Ready Node",
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(&client, &ns, "pool", 1),
    )
    .await
    {
        Ok(m) => m,
        Err(e) => fail(e, &ca),
    };
    let machine = machines.first().expect("one Machine").clone();
    let node = workload::wait_bound(&client, &ns, "web", Duration::from_secs(60)).await;
    let bound = t_up.elapsed();
    assert_eq!(node, machine, "the pod runs on the Node of pool's Machine");

    let t_down = Instant::now();
    workload::delete_pod(&client, &ns, "web").await;
    let machine_api = api(&client, &ns, "v1beta2", "Machine");
    let nodes: Api<Node> = Api::all(client.clone());
    let removed = poll_until(
        &format!("pool back to 0, Machine {machine} and Node {node} deleted by CAPI"),
        Duration::from_secs(90),
        Duration::from_millis(200),
        || async {
            let replicas = replicas(&client, &ns, "pool").await;
            let machine = machine_api.get_opt(&machine).await;
            let node = nodes.get_opt(&node).await;
            match (replicas, machine, node) {
                (Ok(0), Ok(None), Ok(None)) => Check::Done(()),
                (r, m, n) => Check::Wait(format!(
                    "replicas {r:?}, Machine present: {:?}, Node present: {:?}",
                    m.map(|m| m.is_some()),
                    n.map(|n| n.is_some())
                )),
            }
        },
    )
    .await;
    if let Err(e) = removed {
        fail(e, &ca);
    }
    let down = t_down.elapsed();
    s.check_ca_alive(&mut ca, &provider);
    let errors = s.standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-ca-up-and-down passed in {:.1}s: pod -> replicas 1 {:.1}s, pod -> \
         bound {:.1}s, pod deleted -> replicas 0 with Machine and Node gone {:.1}s",
        s.started.elapsed().as_secs_f64(),
        up.as_secs_f64(),
        bound.as_secs_f64(),
        down.as_secs_f64(),
    ));
}

/// A Machine of a MachineDeployment as the deletion-order scenario sees it.
#[derive(Clone, Debug)]
struct Placed {
    name: String,
    created: String,
}

/// Brings MachineDeployment `md` (created at 1 replica) to two Machines with Nodes whose creation
/// times differ (CAPI's Newest and Oldest orders compare whole seconds): waits for the first, then
/// for the next second, then raises replicas to 2. Returns the two, oldest first.
async fn two_machines_a_second_apart(client: &Client, ns: &str, md: &str) -> Vec<Placed> {
    let machines = api(client, ns, "v1beta2", "Machine");
    let first = poll_until(
        &format!("the first Machine of {md}"),
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(client, ns, md, 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let first = first.first().expect("one Machine").clone();
    let created = machines
        .get(&first)
        .await
        .unwrap_or_else(|e| panic!("get Machine {first}: {e}"))
        .metadata
        .creation_timestamp
        .map(|t| t.0)
        .unwrap_or_else(|| panic!("Machine {first} without creationTimestamp"));
    poll_until(
        "the next second",
        Duration::from_secs(3),
        Duration::from_millis(50),
        || async move {
            let now = k8s_openapi::jiff::Timestamp::now();
            if now.as_second() > created.as_second() {
                Check::Done(())
            } else {
                Check::Wait(format!("{now} is in the second of {created}"))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    api(client, ns, "v1beta2", "MachineDeployment")
        .patch(
            md,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"replicas": 2}})),
        )
        .await
        .unwrap_or_else(|e| panic!("raise {md} to 2: {e}"));
    let names = poll_until(
        &format!("two Machines of {md}"),
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(client, ns, md, 2),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut placed = Vec::new();
    for name in names {
        let m = machines
            .get(&name)
            .await
            .unwrap_or_else(|e| panic!("get Machine {name}: {e}"));
        let created = m
            .metadata
            .creation_timestamp
            .map(|t| t.0.to_string())
            .unwrap_or_default();
        placed.push(Placed { name, created });
    }
    placed.sort_by(|a, b| a.created.cmp(&b.created));
    assert_ne!(
        placed[0].created, placed[1].created,
        "the Machines of {md} were created in different seconds"
    );
    placed
}

/// For each MachineSet deletion order (Random: ties by name, Newest, Oldest) a group of two Nodes
/// where the Node CAPI's order would remove carries a pod CA will not move and the other is empty:
/// CA removes the empty Node through this provider, and the real MachineSet controller deletes
/// exactly that Machine and its Node in every group, whatever its own order would have taken.
#[tokio::test]
async fn cluster_autoscaler_removes_the_node_it_chose_under_every_capi_deletion_order() {
    let s = RealCapiNamespace::new(&SIZE).await;
    let (client, ns) = (s.client.clone(), s.ns.clone());
    let mds = api(&client, &ns, "v1beta2", "MachineDeployment");
    let orders = ["Random", "Newest", "Oldest"];
    for order in orders {
        let name = order.to_lowercase();
        let mut md = machine_deployment(&name, "workload", "small", "1", "3");
        md["metadata"]["annotations"][format!("{CAPACITY}/labels")] =
            json!(scenario_labels(&ns, &[]));
        md["spec"]["deletion"] = json!({"order": order});
        create(&mds, &md)
            .await
            .unwrap_or_else(|e| panic!("create MachineDeployment {ns}/{name}: {e}"));
    }
    let names: Vec<String> = orders.iter().map(|o| o.to_lowercase()).collect();
    let placed = futures::future::join_all(
        names
            .iter()
            .map(|name| two_machines_a_second_apart(&client, &ns, name)),
    )
    .await;
    let set_up = s.started.elapsed();
    for (order, name) in orders.iter().zip(&names) {
        let sets = api(&client, &ns, "v1beta2", "MachineSet")
            .list(&ListParams::default().labels(&format!("{DEPLOYMENT_NAME}={name}")))
            .await
            .unwrap_or_else(|e| panic!("list the MachineSets of {name}: {e}"));
        let copied: Vec<&Value> = sets
            .items
            .iter()
            .map(|ms| &ms.data["spec"]["deletion"]["order"])
            .collect();
        assert_eq!(
            copied,
            vec![&json!(order)],
            "CAPI copied {name}'s deletion order to its one MachineSet"
        );
    }

    // In each group the busy Node is the one CAPI's own order would delete.
    let mut busy = BTreeSet::new();
    let mut empty = BTreeSet::new();
    for (order, machines) in orders.iter().zip(&placed) {
        let (oldest, newest) = (&machines[0], &machines[1]);
        let by_name = oldest.name.clone().min(newest.name.clone());
        let capi_pick = match *order {
            "Random" => by_name,
            "Newest" => newest.name.clone(),
            _ => oldest.name.clone(),
        };
        for m in machines {
            if m.name == capi_pick {
                busy.insert(m.name.clone());
            } else {
                empty.insert(m.name.clone());
            }
        }
        // Three quarters of the Node: above CA's utilization threshold, so CA keeps it.
        let pod = PodSpec::new(&format!("busy-{}", order.to_lowercase()), "1500m", "1Gi");
        workload::create_bound_pod(&client, &ns, &pod, &capi_pick).await;
    }

    let provider = s.provider().await;
    let mut ca = s.start_ca(&provider).await;
    let t_down = Instant::now();
    let machine_api = api(&client, &ns, "v1beta2", "Machine");
    let nodes: Api<Node> = Api::all(client.clone());
    let outcome = poll_until(
        "CA removed the empty Node of each group and CAPI deleted exactly its Machine",
        Duration::from_secs(90),
        Duration::from_millis(250),
        || async {
            let left: BTreeSet<String> = match machine_api.list(&ListParams::default()).await {
                Ok(l) => l.items.iter().map(name_of).collect(),
                Err(e) => return Check::Wait(e.to_string()),
            };
            let node_names: BTreeSet<String> = match nodes
                .list(&ListParams::default().labels(&format!("{}={ns}", standin::NODE_LABEL)))
                .await
            {
                Ok(l) => l
                    .items
                    .into_iter()
                    .filter_map(|n| n.metadata.name)
                    .collect(),
                Err(e) => return Check::Wait(e.to_string()),
            };
            if left.iter().any(|m| !busy.contains(m) && !empty.contains(m)) {
                return Check::Fatal(format!("a Machine nobody asked for: {left:?}"));
            }
            if let Some(gone) = busy.iter().find(|m| !left.contains(*m)) {
                return Check::Fatal(format!("Machine {gone}, the busy one, was deleted"));
            }
            if left == busy && node_names == busy {
                Check::Done(())
            } else {
                Check::Wait(format!("Machines {left:?}, Nodes {node_names:?}"))
            }
        },
    )
    .await;
    if let Err(e) = outcome {
        s.fail(
            format!("{e}\nbusy {busy:?}, empty {empty:?}"),
            &provider,
            Some(&ca),
        );
    }
    let down = t_down.elapsed();
    for order in orders {
        let name = order.to_lowercase();
        assert_eq!(replicas(&client, &ns, &name).await, Ok(1), "{name} at 1");
    }
    s.check_ca_alive(&mut ca, &provider);
    let errors = s.standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-deletion-orders passed in {:.1}s: 3 groups of 2 Nodes set up in \
         {:.1}s, CA start -> the 3 empty Machines and Nodes deleted by CAPI {:.1}s (busy kept: \
         {busy:?})",
        s.started.elapsed().as_secs_f64(),
        set_up.as_secs_f64(),
        down.as_secs_f64(),
    ));
}

/// While the real MachineDeployment controller rolls a group out (template changed, maxSurge 1 as
/// CAPI's webhook defaults it, the new Machine slow to come because the stand-in cloud holds it),
/// CA removes no node of it over 8 loops although both old Nodes are empty: nothing marked, nothing
/// deleted, replicas unchanged, the provider serving the group's min raised to its target. Once the
/// cloud delivers and CAPI finishes the rollout, CA scales the group down to its minimum: one
/// Machine of the new MachineSet left.
#[tokio::test]
async fn cluster_autoscaler_removes_nothing_while_real_capi_rolls_a_group_out() {
    let s = RealCapiNamespace::new(&SIZE).await;
    let (client, ns) = (s.client.clone(), s.ns.clone());
    standin::create_template(&client, &ns, "small-v2", &SIZE).await;
    let created = s.group("roll", ("1", "3", 2), |_| {}).await;
    assert_eq!(
        created.data["spec"]["rollout"]["strategy"]["rollingUpdate"]["maxSurge"],
        json!(1),
        "CAPI's webhook defaults maxSurge: {}",
        created.data["spec"]
    );
    let old = s.machines("roll", 2).await;

    s.standin.hold("small-v2");
    api(&client, &ns, "v1beta2", "MachineDeployment")
        .patch(
            "roll",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"template": {"spec": {
                "infrastructureRef": standin::reference(standin::TEMPLATE_KIND, "small-v2"),
            }}}})),
        )
        .await
        .unwrap_or_else(|e| panic!("change the template of roll: {e}"));
    poll_until(
        "CAPI surges a third Machine for the rollout",
        MACHINES,
        Duration::from_millis(200),
        || async {
            match machines_of(&client, &ns, "roll").await {
                Ok(m) if m.len() == 3 => Check::Done(()),
                Ok(m) => Check::Wait(format!("Machines {m:?}")),
                Err(e) => Check::Wait(e),
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    let provider = s.provider().await;
    let mut ca = s.start_ca(&provider).await;
    let t_paused = Instant::now();
    ca.wait_loops(8, Duration::from_secs(60)).await;
    let paused = t_paused.elapsed();
    let machines = machines_of(&client, &ns, "roll")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let nodes: Api<Node> = Api::all(client.clone());
    let fail =
        |message: String, ca: &AutoscalerProcess| -> ! { s.fail(message, &provider, Some(ca)) };
    if machines.len() != 3 || machines.iter().any(|(_, marked)| *marked) {
        fail(
            format!("during the rollout: Machines {machines:?}, want 3, none marked"),
            &ca,
        );
    }
    for name in &old {
        if !matches!(nodes.get_opt(name).await, Ok(Some(_))) {
            fail(format!("Node {name} went during the rollout"), &ca);
        }
    }
    if replicas(&client, &ns, "roll").await != Ok(2) {
        fail("replicas changed during the rollout".into(), &ca);
    }
    // How: the provider saw CAPI's rollout (its MachineSet revisions, its RollingOut condition) and
    // serves the group's min raised to its target.
    let groups = Rpc::connect(&provider).await.groups().await;
    let mins: Vec<(String, i32)> = groups.iter().map(|g| (g.id.clone(), g.min_size)).collect();
    if mins.len() != 1 || mins[0].1 != 2 {
        fail(
            format!("NodeGroups during the rollout: {mins:?}, want the one group with min 2"),
            &ca,
        );
    }

    let t_down = Instant::now();
    s.standin.release("small-v2");
    let left = poll_until(
        "the rollout done and roll scaled down to its minimum",
        Duration::from_secs(90),
        Duration::from_millis(250),
        || async {
            let replicas = replicas(&client, &ns, "roll").await;
            match machines_with_nodes(&client, &ns, "roll", 1).await {
                Check::Done(left) if replicas == Ok(1) => Check::Done(left),
                Check::Done(_) => Check::Wait(format!("replicas {replicas:?}")),
                Check::Wait(why) => Check::Wait(format!("replicas {replicas:?}; {why}")),
                Check::Fatal(e) => Check::Fatal(e),
            }
        },
    )
    .await;
    let left = match left {
        Ok(left) => left,
        Err(e) => fail(e, &ca),
    };
    let down = t_down.elapsed();
    let survivor = left.first().expect("one Machine").clone();
    if old.contains(&survivor) {
        fail(
            format!("the Machine left, {survivor}, is of the old MachineSet"),
            &ca,
        );
    }
    s.check_ca_alive(&mut ca, &provider);
    let errors = s.standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-rollout passed in {:.1}s: 8 CA loops ({:.1}s) during the rollout \
         removed nothing; release -> rollout done and scaled down to 1 ({survivor}) {:.1}s",
        s.started.elapsed().as_secs_f64(),
        paused.as_secs_f64(),
        down.as_secs_f64(),
    ));
}

/// A pod of ReplicaSet `owner` (created here; nothing reconciles it) on Node `node` with a grace
/// period, so that an eviction leaves it Terminating until a kubelet (the stand-in) ends it.
async fn graceful_pod(client: &Client, ns: &str, name: &str, cpu: &str, node: Option<&str>) {
    let sets: Api<ReplicaSet> = Api::namespaced(client.clone(), ns);
    let owner = match sets.get_opt("movers").await {
        Ok(Some(rs)) => rs,
        _ => {
            let rs = serde_json::from_value(json!({
                "metadata": {"name": "movers"},
                "spec": {
                    "replicas": 0,
                    "selector": {"matchLabels": {"app": "movers"}},
                    "template": {
                        "metadata": {"labels": {"app": "movers"}},
                        "spec": {"containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}]},
                    },
                },
            }))
            .expect("a ReplicaSet");
            sets.create(&PostParams::default(), &rs)
                .await
                .unwrap_or_else(|e| panic!("create ReplicaSet {ns}/movers: {e}"))
        }
    };
    let spec = workload::graceful_spec(ns, cpu, node);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": {"app": "movers"},
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "movers",
                "uid": owner.metadata.uid.unwrap_or_default(), "controller": true,
            }],
        },
        "spec": spec,
    }))
    .expect("a Pod");
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("create pod {ns}/{name}: {e}"));
}

/// Of two lightly used Nodes, CA drains one (evicting its movable pod, which stays Terminating for
/// its grace period until the stand-in kubelet ends it) and removes it through DeleteNodes; CAPI's
/// own drain and Node deletion complete; the other Node and its pod stay, and a replacement pod
/// runs there.
#[tokio::test]
async fn cluster_autoscaler_drains_a_node_and_real_capi_removes_it() {
    let s = RealCapiNamespace::new(&SIZE).await;
    let (client, ns) = (s.client.clone(), s.ns.clone());
    s.group("drain", ("1", "3", 2), |_| {}).await;
    let machines = s.machines("drain", 2).await;
    // The Node CAPI's own order would keep (Random: ties by name, first goes) is the one to drain.
    let (kept, drained) = (
        machines.first().expect("two Machines").clone(),
        machines.last().expect("two Machines").clone(),
    );
    // 60 % of the kept Node: CA keeps it; 25 % of the other, movable to the kept one.
    graceful_pod(&client, &ns, "stay", "1200m", Some(&kept)).await;
    graceful_pod(&client, &ns, "move", "500m", Some(&drained)).await;

    let provider = s.provider().await;
    let mut ca = s.start_ca(&provider).await;
    let t_down = Instant::now();
    let machine_api = api(&client, &ns, "v1beta2", "Machine");
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let removed = poll_until(
        &format!("Node {drained} drained by CA, its Machine and Node deleted by CAPI"),
        Duration::from_secs(90),
        Duration::from_millis(250),
        || async {
            let machine = machine_api.get_opt(&drained).await;
            let node = nodes.get_opt(&drained).await;
            let pod = pods.get_opt("move").await;
            match (machine, node, pod) {
                (Ok(None), Ok(None), Ok(None)) => Check::Done(()),
                (m, n, p) => Check::Wait(format!(
                    "Machine present {:?}, Node present {:?}, pod move present {:?}",
                    m.map(|x| x.is_some()),
                    n.map(|x| x.is_some()),
                    p.map(|x| x.is_some())
                )),
            }
        },
    )
    .await;
    if let Err(e) = removed {
        s.fail(e, &provider, Some(&ca));
    }
    let down = t_down.elapsed();
    let finished = s
        .standin
        .actions()
        .iter()
        .any(|(_, a)| a == &format!("pod {ns}/move finished"));
    assert!(
        finished,
        "the evicted pod stayed Terminating until the stand-in kubelet ended it"
    );
    assert_eq!(replicas(&client, &ns, "drain").await, Ok(1));
    let left = poll_until(
        "the kept Machine with its Node",
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(&client, &ns, "drain", 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(left, BTreeSet::from([kept.clone()]), "only {drained} went");
    assert_eq!(
        workload::node_of(&client, &ns, "stay").await.as_deref(),
        Some(kept.as_str()),
        "the pod of the kept Node stays"
    );
    // The ReplicaSet's replacement (no controller-manager runs on the shared control plane: the
    // test makes it) runs on the kept Node, placed there by the real scheduler. drain.rs has the
    // real ReplicaSet controller recreate it, within a PodDisruptionBudget.
    graceful_pod(&client, &ns, "move-again", "500m", None).await;
    let placed = workload::wait_bound(&client, &ns, "move-again", Duration::from_secs(30)).await;
    assert_eq!(placed, kept, "the replacement runs on the kept Node");
    s.check_ca_alive(&mut ca, &provider);
    let errors = s.standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-drain passed in {:.1}s: CA start -> pod evicted and ended, Machine \
         and Node {drained} deleted by CAPI {:.1}s",
        s.started.elapsed().as_secs_f64(),
        down.as_secs_f64(),
    ));
}

/// Finding 1 of the protocol's review (issue 28), with the real cluster-autoscaler and the real
/// Cluster API manager: a group of 6 empty nodes (min 1). CA removes the 5 it may in one loop, one
/// DeleteNodes per node, each from its own goroutine, back to back; the MachineSet, woken by each
/// mark, may take a later-marked Machine for an earlier decrement (it ranks marked Machines
/// equally and breaks ties by name). Every node CA was answered OK for is gone, the others stay,
/// none keeps CA's ToBeDeleted taint, and no Machine went without its mark.
#[tokio::test]
async fn cluster_autoscaler_removes_empty_nodes_in_one_loop_each_answered_ok_gone_none_left_tainted()
 {
    let s = RealCapiNamespace::new(&SIZE).await;
    s.group("six", ("1", "6", 6), |_| {}).await;
    let before: BTreeSet<String> = s.machines("six", 6).await.into_iter().collect();
    let capi = support::capi::Capi::new(s.client.clone(), &s.ns, "cluster.x-k8s.io", "v1beta2");
    let deletions = support::real_capi_scenario::MachineDeletions::start(&capi).await;
    let provider = s.provider().await;
    let mut ca = s.start_ca(&provider).await;
    let t = Instant::now();

    // CA removes the empty nodes down to min (a node refused is retried in a later loop), Cluster
    // API acts; then nothing is left in flight: one Machine, unmarked, replicas 1.
    let settled = poll_until(
        "six scaled down to 1, settled",
        Duration::from_secs(180),
        Duration::from_millis(200),
        || async {
            let replicas = s.replicas("six").await;
            let machines = machines_of(&s.client, &s.ns, "six").await;
            match (replicas, machines) {
                (Ok(1), Ok(all)) if all.len() == 1 && all.iter().all(|(_, marked)| !marked) => {
                    match machines_with_nodes(&s.client, &s.ns, "six", all.len()).await {
                        Check::Done(names) => Check::Done(names),
                        Check::Wait(why) | Check::Fatal(why) => {
                            Check::Wait(format!("replicas 1: {why}"))
                        }
                    }
                }
                (r, m) => Check::Wait(format!("replicas {r:?}, Machines {m:?}")),
            }
        },
    )
    .await;
    let remaining = match settled {
        Ok(remaining) => remaining,
        Err(e) => s.fail(e, &provider, Some(&ca)),
    };
    let text = support::autoscaler::http_get(&provider.metrics_address, "/metrics")
        .await
        .unwrap_or_default();
    let answered_ok = support::autoscaler::metric_sum(
        &text,
        "capi_autoscaler_provider_grpc_requests_total",
        &[("method", "NodeGroupDeleteNodes"), ("code", "OK")],
    ) as usize;
    let refused = support::autoscaler::metric_sum(
        &text,
        "capi_autoscaler_provider_grpc_requests_total",
        &[("method", "NodeGroupDeleteNodes")],
    ) as usize
        - answered_ok;
    let removed: BTreeSet<String> = before.difference(&remaining).cloned().collect();
    assert_eq!(
        removed.len(),
        answered_ok,
        "every node answered OK is gone, no other: removed {removed:?}, {answered_ok} DeleteNodes answered OK; provider log:\n{}",
        provider.log_contents()
    );
    assert!(
        deletions.unmarked().is_empty(),
        "Machines deleted without a mark: {:?}",
        deletions.unmarked()
    );
    let nodes: Api<Node> = Api::all(s.client.clone());
    let untainted = poll_until(
        "no remaining node keeps CA's ToBeDeleted taint",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let mut tainted = Vec::new();
            for machine in &remaining {
                let (_, node) = s.provider_id_and_node(machine).await;
                let taints = nodes
                    .get_opt(&node)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|n| n.spec)
                    .and_then(|spec| spec.taints)
                    .unwrap_or_default();
                if taints
                    .iter()
                    .any(|t| t.key == "ToBeDeletedByClusterAutoscaler")
                {
                    tainted.push(node);
                }
            }
            if tainted.is_empty() {
                Check::Done(())
            } else {
                Check::Wait(format!("tainted: {tainted:?}"))
            }
        },
    )
    .await;
    if let Err(e) = untainted {
        s.fail(e, &provider, Some(&ca));
    }
    s.check_ca_alive(&mut ca, &provider);
    procs::announce(&format!(
        "e2e: scenario real-capi-ca-empty-nodes-in-one-loop passed in {:.1}s: {} of 6 removed, {} DeleteNodes answered OK, {refused} refused (retried), {} left",
        t.elapsed().as_secs_f64(),
        removed.len(),
        answered_ok,
        remaining.len()
    ));
}
