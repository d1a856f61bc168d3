//! The real Cluster API core manager (v1.14.2, built by tests/upstream/capi/build.sh) against the test
//! kube-apiserver, wired as `clusterctl init` wires it: its 13 CRDs with the conversion webhook, its
//! defaulting and validating webhooks, its controllers. Only the cloud and the kubelets are the
//! stand-in's (tests/support/standin.rs). Assertions are on objects, never on log text.

pub mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use support::autoscaler::Autoscaler;
use support::capi::{Rpc, grpc_node};
use support::capi_manager::capi_manager;
use support::procs::{self, Check, poll_until};
use support::real_capi::{
    CAPACITY, DELETE_MACHINE, DEPLOYMENT_NAME, MACHINES, MIN_SIZE, api, create, machine_deployment,
    machines_of, machines_with_nodes, name_of, replicas,
};
use support::standin::{self, StandIn};
use support::workload::{self, PodSpec, scenario_labels};
use support::{CAPI_GROUP, start_provider};

/// A MachineDeployment created without `spec.replicas` and with the autoscaler bounds gets its
/// replicas from CAPI's defaulting webhook (and a bad bound is refused, naming the annotation); it
/// reads as v1beta1 through CAPI's conversion webhook; the real MachineSet controller makes the
/// Machines, the stand-in provisions them with Ready Nodes, CAPI sets the node refs; lowering
/// replicas with one Machine carrying delete-machine deletes exactly that Machine and its Node,
/// though CAPI's own order (Random: ties by name) would have picked the other.
#[tokio::test]
async fn real_capi_defaults_converts_provisions_and_deletes_the_marked_machine() {
    let manager = capi_manager();
    let cp = manager.cp;
    let client = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let started = Instant::now();
    let cluster = standin::workload_cluster(&client, cp, &ns, "workload").await;
    let standin = StandIn::start(client.clone(), &ns);
    standin::create_template(&client, &ns, "workers", &[]).await;
    let mds = api(&client, &ns, "v1beta2", "MachineDeployment");
    let fail = |message: String| -> ! {
        panic!(
            "{message}\nstand-in actions: {:?}\nstand-in errors: {:?}\n--- CAPI manager log (tail) ---\n{}",
            standin.actions(),
            standin.errors(),
            manager.log_tail()
        )
    };

    // Validation is CAPI's: a min-size that is no number is refused, naming the annotation.
    match create(
        &mds,
        &machine_deployment("bad", "workload", "workers", "two", "4"),
    )
    .await
    {
        Ok(_) => fail("CAPI's webhook accepted min-size \"two\"".into()),
        Err(e) => assert!(
            e.to_string().contains(MIN_SIZE),
            "the refusal names the min-size annotation: {e}"
        ),
    }

    // Defaulting is CAPI's: replicas from min-size.
    let md = machine_deployment("workers", "workload", "workers", "2", "4");
    assert!(md["spec"].get("replicas").is_none());
    let created = create(&mds, &md)
        .await
        .unwrap_or_else(|e| fail(format!("create MachineDeployment {ns}/workers: {e}")));
    assert_eq!(
        created.data["spec"]["replicas"],
        json!(2),
        "CAPI's webhook defaults spec.replicas from the min-size annotation: {}",
        created.data["spec"]
    );
    let defaulted = started.elapsed();

    // Conversion is CAPI's: v1beta1 has an infrastructureRef with the apiVersion CAPI resolves
    // from the stand-in CRD's contract label, and the namespace of the MachineDeployment.
    let old = api(&client, &ns, "v1beta1", "MachineDeployment")
        .get("workers")
        .await
        .unwrap_or_else(|e| {
            fail(format!(
                "get MachineDeployment {ns}/workers as v1beta1: {e}"
            ))
        });
    assert_eq!(
        old.types.as_ref().map(|t| t.api_version.as_str()),
        Some("cluster.x-k8s.io/v1beta1")
    );
    assert_eq!(old.data["spec"]["replicas"], json!(2));
    assert_eq!(
        old.data["spec"]["template"]["spec"]["infrastructureRef"],
        json!({
            "apiVersion": format!("{}/{}", standin::GROUP, standin::VERSION),
            "kind": standin::TEMPLATE_KIND,
            "name": "workers",
            "namespace": ns,
        }),
        "the v1beta1 infrastructureRef as CAPI's conversion writes it"
    );

    // The real MachineSet controller makes two Machines; CAPI finds their Nodes.
    let t_up = Instant::now();
    let machines = poll_until(
        "two Machines of workers with Ready Nodes and node refs",
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(&client, &ns, "workers", 2),
    )
    .await
    .unwrap_or_else(|e| fail(e));
    let up = t_up.elapsed();
    let machine_api = api(&client, &ns, "v1beta2", "Machine");
    let old_machine = api(&client, &ns, "v1beta1", "Machine")
        .get(machines.first().expect("two Machines"))
        .await
        .unwrap_or_else(|e| fail(format!("get a Machine as v1beta1: {e}")));
    assert_eq!(
        old_machine.data["status"]["nodeRef"]["kind"],
        json!("Node"),
        "the v1beta1 nodeRef as CAPI's conversion writes it: {}",
        old_machine.data["status"]
    );

    // Mark the Machine CAPI's own order would keep (Random: ties broken by name, first goes).
    let marked = machines.last().expect("two Machines").clone();
    let kept = machines.first().expect("two Machines").clone();
    let marked_node = machine_api
        .get(&marked)
        .await
        .unwrap_or_else(|e| fail(format!("get Machine {marked}: {e}")))
        .data["status"]["nodeRef"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    machine_api
        .patch(
            &marked,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {DELETE_MACHINE: "true"}}})),
        )
        .await
        .unwrap_or_else(|e| fail(format!("mark Machine {marked}: {e}")));
    let t_down = Instant::now();
    mds.patch(
        "workers",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"replicas": 1}})),
    )
    .await
    .unwrap_or_else(|e| fail(format!("lower the replicas of workers: {e}")));
    let nodes: Api<Node> = Api::all(client.clone());
    poll_until(
        &format!("Machine {marked} and Node {marked_node} deleted by CAPI"),
        MACHINES,
        Duration::from_millis(200),
        || async {
            let machine = machine_api.get_opt(&marked).await;
            let node = nodes.get_opt(&marked_node).await;
            match (machine, node) {
                (Ok(None), Ok(None)) => Check::Done(()),
                (Ok(m), Ok(n)) => Check::Wait(format!(
                    "Machine present: {}, Node present: {}",
                    m.is_some(),
                    n.is_some()
                )),
                (Err(e), _) | (_, Err(e)) => Check::Wait(e.to_string()),
            }
        },
    )
    .await
    .unwrap_or_else(|e| fail(e));
    let down = t_down.elapsed();
    let left = poll_until(
        "the one Machine left, with its Node",
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(&client, &ns, "workers", 1),
    )
    .await
    .unwrap_or_else(|e| fail(e));
    assert_eq!(
        left,
        BTreeSet::from([kept.clone()]),
        "only the marked Machine went"
    );
    let errors = standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-foundation passed in {:.1}s: Cluster ready {:.1}s, replicas \
         defaulted {:.1}s after the start, 2 Machines with Nodes and node refs {:.1}s, marked \
         Machine {marked} and its Node deleted {:.1}s after replicas 2 -> 1 ({kept} kept)",
        started.elapsed().as_secs_f64(),
        cluster.ready_after.as_secs_f64(),
        defaulted.as_secs_f64(),
        up.as_secs_f64(),
        down.as_secs_f64(),
    ));
}

/// The real cluster-autoscaler, through this provider, with the real CAPI manager: a pending pod
/// that fits only a group at zero (min 0, replicas defaulted to 0 by CAPI's webhook; its size from
/// the stand-in template's `status.capacity`) makes CA raise
/// its replicas; CAPI's MachineSet makes the Machine, the stand-in its Node, the scheduler binds the
/// pod there; once the pod is gone CA removes the empty Node through DeleteNodes and CAPI deletes that
/// Machine and Node, replicas back to 0.
#[tokio::test]
async fn cluster_autoscaler_scales_a_group_up_from_zero_and_back_down_through_real_capi() {
    let manager = capi_manager();
    let cp = manager.cp;
    let client = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let started = Instant::now();
    standin::workload_cluster(&client, cp, &ns, "workload").await;
    let standin = StandIn::start(client.clone(), &ns);
    let size = [("cpu", "2"), ("memory", "4Gi"), ("pods", "110")];
    standin::create_template(&client, &ns, "small", &size).await;
    // The size comes from the template's status (the scale-from-zero contract), read by the
    // provider through the stand-in's group; only the Node label is an annotation.
    let mut md = machine_deployment("pool", "workload", "small", "0", "3");
    md["metadata"]["annotations"][format!("{CAPACITY}/labels")] = json!(scenario_labels(&ns, &[]));
    let mds = api(&client, &ns, "v1beta2", "MachineDeployment");
    let created = create(&mds, &md)
        .await
        .unwrap_or_else(|e| panic!("create MachineDeployment {ns}/pool: {e}"));
    assert_eq!(created.data["spec"]["replicas"], json!(0));

    let discovery = format!("clusterapi:namespace={ns}");
    let provider = start_provider(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut ca = Autoscaler::new(&ns, &provider.address).start(cp).await;
    let fail = |message: String, ca: &support::autoscaler::AutoscalerProcess| -> ! {
        panic!(
            "{message}\nstand-in actions: {:?}\nstand-in errors: {:?}\n--- provider log ---\n{}\n\
             --- CA log (tail) ---\n{}\n--- CAPI manager log (tail) ---\n{}",
            standin.actions(),
            standin.errors(),
            procs::log_tail(&provider.log, 4000),
            ca.log_tail(),
            manager.log_tail()
        )
    };

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
    if let Err(e) = ca.check_alive() {
        fail(e, &ca);
    }
    let errors = standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-ca-up-and-down passed in {:.1}s: pod -> replicas 1 {:.1}s, pod -> \
         bound {:.1}s, pod deleted -> replicas 0 with Machine and Node gone {:.1}s",
        started.elapsed().as_secs_f64(),
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
    let manager = capi_manager();
    let cp = manager.cp;
    let client = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let started = Instant::now();
    standin::workload_cluster(&client, cp, &ns, "workload").await;
    let standin = StandIn::start(client.clone(), &ns);
    let size = [("cpu", "2"), ("memory", "4Gi"), ("pods", "110")];
    standin::create_template(&client, &ns, "small", &size).await;
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
    let set_up = started.elapsed();
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

    let discovery = format!("clusterapi:namespace={ns}");
    let provider = start_provider(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut ca = Autoscaler::new(&ns, &provider.address).start(cp).await;
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
        panic!(
            "{e}\nbusy {busy:?}, empty {empty:?}\nstand-in errors: {:?}\n--- provider log ---\n{}\n\
             --- CA log (tail) ---\n{}\n--- CAPI manager log (tail) ---\n{}",
            standin.errors(),
            procs::log_tail(&provider.log, 4000),
            ca.log_tail(),
            manager.log_tail()
        );
    }
    let down = t_down.elapsed();
    for order in orders {
        let name = order.to_lowercase();
        assert_eq!(replicas(&client, &ns, &name).await, Ok(1), "{name} at 1");
    }
    if let Err(e) = ca.check_alive() {
        panic!("{e}");
    }
    let errors = standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-deletion-orders passed in {:.1}s: 3 groups of 2 Nodes set up in \
         {:.1}s, CA start -> the 3 empty Machines and Nodes deleted by CAPI {:.1}s (busy kept: \
         {busy:?})",
        started.elapsed().as_secs_f64(),
        set_up.as_secs_f64(),
        down.as_secs_f64(),
    ));
}

/// While the real MachineDeployment controller rolls a group out (template changed, maxSurge 1 as
/// CAPI's webhook defaults it, the new Machine slow to come because the stand-in cloud holds it),
/// CA removes no node of it over 8 loops although both old Nodes are empty: nothing marked, nothing
/// deleted, replicas unchanged, the provider serving the group's min raised to its target. Once the cloud delivers and CAPI finishes the rollout, CA scales the
/// group down to its minimum: one Machine of the new MachineSet left.
#[tokio::test]
async fn cluster_autoscaler_removes_nothing_while_real_capi_rolls_a_group_out() {
    let manager = capi_manager();
    let cp = manager.cp;
    let client = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let started = Instant::now();
    standin::workload_cluster(&client, cp, &ns, "workload").await;
    let standin = StandIn::start(client.clone(), &ns);
    let size = [("cpu", "2"), ("memory", "4Gi"), ("pods", "110")];
    standin::create_template(&client, &ns, "small", &size).await;
    standin::create_template(&client, &ns, "small-v2", &size).await;
    let mut md = machine_deployment("roll", "workload", "small", "1", "3");
    md["metadata"]["annotations"][format!("{CAPACITY}/labels")] = json!(scenario_labels(&ns, &[]));
    md["spec"]["replicas"] = json!(2);
    let mds = api(&client, &ns, "v1beta2", "MachineDeployment");
    let created = create(&mds, &md)
        .await
        .unwrap_or_else(|e| panic!("create MachineDeployment {ns}/roll: {e}"));
    assert_eq!(
        created.data["spec"]["rollout"]["strategy"]["rollingUpdate"]["maxSurge"],
        json!(1),
        "CAPI's webhook defaults maxSurge: {}",
        created.data["spec"]
    );
    let old = poll_until(
        "two Machines of roll with Nodes",
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(&client, &ns, "roll", 2),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    standin.hold("small-v2");
    mds.patch(
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

    let discovery = format!("clusterapi:namespace={ns}");
    let provider = start_provider(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut ca = Autoscaler::new(&ns, &provider.address).start(cp).await;
    let t_paused = Instant::now();
    ca.wait_loops(8, Duration::from_secs(60)).await;
    let paused = t_paused.elapsed();
    let machines = machines_of(&client, &ns, "roll")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let nodes: Api<Node> = Api::all(client.clone());
    let fail = |message: String, ca: &support::autoscaler::AutoscalerProcess| -> ! {
        panic!(
            "{message}\nstand-in actions: {:?}\n--- provider log ---\n{}\n--- CA log (tail) ---\n{}",
            standin.actions(),
            procs::log_tail(&provider.log, 4000),
            ca.log_tail()
        )
    };
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
    standin.release("small-v2");
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
    if let Err(e) = ca.check_alive() {
        fail(e, &ca);
    }
    let errors = standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-rollout passed in {:.1}s: 8 CA loops ({:.1}s) during the rollout \
         removed nothing; release -> rollout done and scaled down to 1 ({survivor}) {:.1}s",
        started.elapsed().as_secs_f64(),
        paused.as_secs_f64(),
        down.as_secs_f64(),
    ));
}

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
/// settles at 3 Machines with Nodes and no mark.
#[tokio::test]
async fn delete_nodes_and_increase_size_back_to_back_never_cost_an_unmarked_machine() {
    const ROUNDS: usize = 6;
    let manager = capi_manager();
    let cp = manager.cp;
    let client = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let started = Instant::now();
    standin::workload_cluster(&client, cp, &ns, "workload").await;
    let standin = StandIn::start(client.clone(), &ns);
    standin::create_template(&client, &ns, "small", &[]).await;
    let mut md = machine_deployment("race", "workload", "small", "1", "5");
    md["spec"]["replicas"] = json!(3);
    create(&api(&client, &ns, "v1beta2", "MachineDeployment"), &md)
        .await
        .unwrap_or_else(|e| panic!("create MachineDeployment {ns}/race: {e}"));
    poll_until(
        "three Machines of race with Nodes",
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(&client, &ns, "race", 3),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let (seen, watcher) = watch_machines(client.clone(), ns.clone(), "race".into());
    let provider = start_provider(
        &[
            "--node-group-auto-discovery",
            &format!("clusterapi:namespace={ns}"),
            "--repair-interval=1s",
            "--mark-grace-period=3s",
        ],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    let id = rpc
        .ids_in(&ns)
        .await
        .into_iter()
        .next()
        .expect("the group is served");
    let machine_api = api(&client, &ns, "v1beta2", "Machine");
    let fail = |message: String| -> ! {
        panic!(
            "{message}\nstand-in errors: {:?}\n--- provider log (tail) ---\n{}\n--- CAPI manager log (tail) ---\n{}",
            standin.errors(),
            procs::log_tail(&provider.log, 6000),
            manager.log_tail()
        )
    };

    let mut victims = BTreeSet::new();
    let mut outcomes = Vec::new();
    for round in 0..ROUNDS {
        let delete_first = round % 2 == 0;
        let current = poll_until(
            &format!("round {round}: race settled at 3 Machines with Nodes, none marked"),
            MACHINES,
            Duration::from_millis(100),
            || async {
                let all = match machines_of(&client, &ns, "race").await {
                    Ok(all) => all,
                    Err(e) => return Check::Wait(e),
                };
                if all.len() != 3 || all.iter().any(|(_, marked)| *marked) {
                    return Check::Wait(format!("Machines {all:?}"));
                }
                match (
                    replicas(&client, &ns, "race").await,
                    machines_with_nodes(&client, &ns, "race", 3).await,
                ) {
                    (Ok(3), Check::Done(names)) => Check::Done(names),
                    (r, Check::Fatal(e)) => Check::Fatal(format!("replicas {r:?}: {e}")),
                    (r, _) => Check::Wait(format!("replicas {r:?}, Machines {all:?}")),
                }
            },
        )
        .await
        .unwrap_or_else(|e| fail(e));
        // Not the Machine CAPI's own order (Random: ties by name) would take without a mark.
        let victim = current.last().expect("three Machines").clone();
        let object = machine_api
            .get(&victim)
            .await
            .unwrap_or_else(|e| fail(format!("get Machine {victim}: {e}")));
        let node = grpc_node(
            object.data["spec"]["providerID"]
                .as_str()
                .unwrap_or_default(),
            object.data["status"]["nodeRef"]["name"]
                .as_str()
                .unwrap_or_default(),
        );
        victims.insert(victim.clone());
        let t = Instant::now();
        let (first, second) = if delete_first {
            (
                rpc.delete_nodes(&id, vec![node]).await,
                rpc.increase(&id, 1).await,
            )
        } else {
            let raised = rpc.increase(&id, 1).await;
            (rpc.delete_nodes(&id, vec![node]).await, raised)
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
                let all = match machines_of(&client, &ns, "race").await {
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
    let remaining: BTreeSet<String> = machines_of(&client, &ns, "race")
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
    let errors = standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-absorbed-mark-race passed in {:.1}s: {ROUNDS} rounds, none cost an \
         unmarked Machine ({} deleted, all marked): {outcomes:?}",
        started.elapsed().as_secs_f64(),
        seen.deleting.len(),
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
    let mut spec = json!({
        "terminationGracePeriodSeconds": 30,
        "nodeSelector": {workload::SCENARIO_LABEL: ns},
        "containers": [{
            "name": "app",
            "image": "registry.k8s.io/pause:3.10",
            "resources": {"requests": {"cpu": cpu, "memory": "512Mi"}},
        }],
    });
    if let Some(node) = node {
        spec["nodeName"] = json!(node);
    }
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
    let manager = capi_manager();
    let cp = manager.cp;
    let client = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let started = Instant::now();
    standin::workload_cluster(&client, cp, &ns, "workload").await;
    let standin = StandIn::start(client.clone(), &ns);
    let size = [("cpu", "2"), ("memory", "4Gi"), ("pods", "110")];
    standin::create_template(&client, &ns, "small", &size).await;
    let mut md = machine_deployment("drain", "workload", "small", "1", "3");
    md["metadata"]["annotations"][format!("{CAPACITY}/labels")] = json!(scenario_labels(&ns, &[]));
    md["spec"]["replicas"] = json!(2);
    create(&api(&client, &ns, "v1beta2", "MachineDeployment"), &md)
        .await
        .unwrap_or_else(|e| panic!("create MachineDeployment {ns}/drain: {e}"));
    let machines = poll_until(
        "two Machines of drain with Nodes",
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(&client, &ns, "drain", 2),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // The Node CAPI's own order would keep (Random: ties by name, first goes) is the one to drain.
    let (kept, drained) = (
        machines.first().expect("two Machines").clone(),
        machines.last().expect("two Machines").clone(),
    );
    // 60 % of the kept Node: CA keeps it; 25 % of the other, movable to the kept one.
    graceful_pod(&client, &ns, "stay", "1200m", Some(&kept)).await;
    graceful_pod(&client, &ns, "move", "500m", Some(&drained)).await;

    let provider = start_provider(
        &[
            "--node-group-auto-discovery",
            &format!("clusterapi:namespace={ns}"),
        ],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut ca = Autoscaler::new(&ns, &provider.address).start(cp).await;
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
        panic!(
            "{e}\nstand-in actions: {:?}\n--- provider log ---\n{}\n--- CA log (tail) ---\n{}\n\
             --- CAPI manager log (tail) ---\n{}",
            standin.actions(),
            procs::log_tail(&provider.log, 4000),
            ca.log_tail(),
            manager.log_tail()
        );
    }
    let down = t_down.elapsed();
    let finished = standin
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
    // The ReplicaSet's replacement (no controller-manager runs: the test makes it) runs on the
    // kept Node, placed there by the real scheduler.
    graceful_pod(&client, &ns, "move-again", "500m", None).await;
    let placed = workload::wait_bound(&client, &ns, "move-again", Duration::from_secs(30)).await;
    assert_eq!(placed, kept, "the replacement runs on the kept Node");
    if let Err(e) = ca.check_alive() {
        panic!("{e}");
    }
    let errors = standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-drain passed in {:.1}s: CA start -> pod evicted and ended, Machine \
         and Node {drained} deleted by CAPI {:.1}s",
        started.elapsed().as_secs_f64(),
        down.as_secs_f64(),
    ));
}

/// A MachineHealthCheck remediating one Machine while this provider removes another of the same
/// group: the real MachineSet controller deletes the unhealthy Machine and replaces it, and deletes
/// the marked one; replicas drop by exactly one (no double decrement), the third Machine is never
/// touched, no Machine goes unmarked but the remediated one, and nothing is left marked.
#[tokio::test]
async fn a_machine_health_check_remediation_beside_delete_nodes_costs_nothing_extra() {
    let manager = capi_manager();
    let cp = manager.cp;
    let client = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let started = Instant::now();
    standin::workload_cluster(&client, cp, &ns, "workload").await;
    let standin = StandIn::start(client.clone(), &ns);
    standin::create_template(&client, &ns, "small", &[]).await;
    let mut md = machine_deployment("heal", "workload", "small", "1", "5");
    md["spec"]["replicas"] = json!(3);
    create(&api(&client, &ns, "v1beta2", "MachineDeployment"), &md)
        .await
        .unwrap_or_else(|e| panic!("create MachineDeployment {ns}/heal: {e}"));
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
    create(&api(&client, &ns, "v1beta2", "MachineHealthCheck"), &mhc)
        .await
        .unwrap_or_else(|e| panic!("create MachineHealthCheck {ns}/heal: {e}"));
    let machines: Vec<String> = poll_until(
        "three Machines of heal with Nodes",
        MACHINES,
        Duration::from_millis(200),
        || machines_with_nodes(&client, &ns, "heal", 3),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .into_iter()
    .collect();
    let (sick, untouched, removed) = (
        machines[0].clone(),
        machines[1].clone(),
        machines[2].clone(),
    );
    let (seen, watcher) = watch_machines(client.clone(), ns.clone(), "heal".into());
    let provider = start_provider(
        &[
            "--node-group-auto-discovery",
            &format!("clusterapi:namespace={ns}"),
        ],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    let id = rpc
        .ids_in(&ns)
        .await
        .into_iter()
        .next()
        .expect("the group is served");
    let machine_api = api(&client, &ns, "v1beta2", "Machine");
    let object = machine_api
        .get(&removed)
        .await
        .unwrap_or_else(|e| panic!("get Machine {removed}: {e}"));
    let node = grpc_node(
        object.data["spec"]["providerID"]
            .as_str()
            .unwrap_or_default(),
        object.data["status"]["nodeRef"]["name"]
            .as_str()
            .unwrap_or_default(),
    );
    let fail = |message: String| -> ! {
        panic!(
            "{message}\nstand-in actions: {:?}\n--- provider log (tail) ---\n{}\n--- CAPI manager log (tail) ---\n{}",
            standin.actions(),
            procs::log_tail(&provider.log, 6000),
            manager.log_tail()
        )
    };

    let t = Instant::now();
    standin::set_node_ready(&client, &sick, false).await;
    rpc.delete_nodes(&id, vec![node])
        .await
        .unwrap_or_else(|e| fail(format!("DeleteNodes {removed}: {e}")));
    let left = poll_until(
        &format!("{sick} remediated and replaced, {removed} removed, {untouched} kept"),
        Duration::from_secs(90),
        Duration::from_millis(200),
        || async {
            let all = match machines_of(&client, &ns, "heal").await {
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
            match machines_with_nodes(&client, &ns, "heal", 2).await {
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
        replicas(&client, &ns, "heal").await,
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
    let nodes: Api<Node> = Api::all(client.clone());
    for gone in [&sick, &removed] {
        if !matches!(nodes.get_opt(gone).await, Ok(None)) {
            fail(format!("Node {gone} is still there"));
        }
    }
    let errors = standin.errors();
    assert!(errors.is_empty(), "stand-in errors: {errors:?}");
    procs::announce(&format!(
        "e2e: scenario real-capi-health-check passed in {:.1}s: Node {sick} NotReady + DeleteNodes \
         {removed} -> remediated and replaced, removed, {untouched} kept, replicas 3 -> 2, in {:.1}s \
         (left: {left:?})",
        started.elapsed().as_secs_f64(),
        took.as_secs_f64(),
    ));
}
