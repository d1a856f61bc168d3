//! What the real manager does with the objects alone: defaulting, validation, conversion, Machines
//! with Nodes and node refs, and the marked Machine deleted first.

use crate::support;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use support::capi_manager::capi_manager;
use support::procs::{self, Check, poll_until};
use support::real_capi::{
    DELETE_MACHINE, MACHINES, MIN_SIZE, api, create, machine_deployment, machines_with_nodes,
};
use support::standin::{self, StandIn};

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
