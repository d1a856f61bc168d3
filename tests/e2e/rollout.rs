//! Rollout-safe scale-down end to end (v1beta2 objects on the CRDs as shipped): while a
//! MachineDeployment rolls out, NodeGroups and NodeGroupForNode send its min raised to its target,
//! DeleteNodes answers FAILED_PRECONDITION and writes nothing, scale-up still works; once the rollout
//! is over everything is as before. Rollouts are detected from MachineSet revisions and from the
//! MachineDeployment's `RollingOut` condition.

use crate::support;

use std::time::Duration;

use kube::api::{DynamicObject, Patch, PatchParams};
use serde_json::json;
use support::capi::{
    Capi, Kind, Owner, Rpc, Scalable, expect_code, fresh_capi, provider_for_namespace,
};
use support::reconciler::REVISION_ANNOTATION;
use support::{Check, Setup, poll_until};
use tonic::Code;

const SETUP: Setup = Setup::shipped();
const VERSION: &str = "v1beta2";

/// Polls NodeGroups until group `id` is served with min size `want` (changes made behind the
/// provider's back reach it through its watches).
async fn wait_min(rpc: &Rpc, id: &str, want: i32) {
    poll_until(
        &format!("min size of {id} == {want}"),
        Duration::from_secs(30),
        Duration::from_millis(50),
        || {
            let mut rpc = rpc.clone();
            async move {
                match rpc.group(id).await {
                    Some(g) if g.min_size == want => Check::Done(()),
                    Some(g) => Check::Wait(format!("min size {}", g.min_size)),
                    None => Check::Wait("not served".into()),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The resourceVersions of the MachineDeployment and every Machine: what a write would change.
async fn versions(capi: &Capi) -> Vec<(String, String)> {
    let mut all: Vec<DynamicObject> = vec![
        capi.api(Kind::MachineDeployment)
            .get("md")
            .await
            .expect("get the MachineDeployment"),
    ];
    all.extend(
        capi.api(Kind::Machine)
            .list(&Default::default())
            .await
            .expect("list Machines")
            .items,
    );
    all.into_iter()
        .map(|o| {
            (
                o.metadata.name.unwrap_or_default(),
                o.metadata.resource_version.unwrap_or_default(),
            )
        })
        .collect()
}

/// MachineDeployment md (min 1, max 6, `replicas`) with MachineSet md-new (revision 2, two running
/// Machines) and md-old (revision 1, `old` replicas, one running Machine).
async fn rolling_deployment(capi: &Capi, replicas: i64, old: i64) {
    capi.create(&Scalable::md("md").bounds(1, 6).replicas(replicas))
        .await;
    for (name, revision, n) in [("md-new", "2", 2), ("md-old", "1", old)] {
        capi.create(
            &Scalable::ms(name)
                .owned_by("md")
                .annotation(REVISION_ANNOTATION, revision)
                .replicas(n),
        )
        .await;
    }
    for (machine, set) in [
        ("new-0", "md-new"),
        ("new-1", "md-new"),
        ("old-0", "md-old"),
    ] {
        capi.create_machine(&capi.running(machine, Owner::MachineSet(set.into())))
            .await;
    }
}

#[tokio::test]
async fn an_old_machine_set_with_replicas_pauses_scale_down_until_it_is_drained() {
    let (cp, capi) = fresh_capi(SETUP, VERSION).await;
    let ns = capi.ns.clone();
    rolling_deployment(&capi, 3, 1).await;
    let (_provider, mut rpc) = provider_for_namespace(cp, &ns).await;
    let id = capi.id(Kind::MachineDeployment, "md");

    // CA sees the group at its minimum: its nodes are no scale-down candidates.
    let group = rpc.group(&id).await.expect("the MachineDeployment group");
    assert_eq!((group.min_size, group.max_size), (3, 6));
    for machine in ["old-0", "new-0"] {
        let for_node = rpc.for_node(capi.grpc_node(machine)).await;
        assert_eq!((for_node.id.as_str(), for_node.min_size), (id.as_str(), 3));
    }

    // DeleteNodes is refused, naming what holds the rollout open, and writes nothing.
    let before = versions(&capi).await;
    for machine in ["old-0", "new-0"] {
        let message = expect_code(
            "DeleteNodes during the rollout",
            rpc.delete_nodes(&id, vec![capi.grpc_node(machine)]).await,
            Code::FailedPrecondition,
        );
        assert!(
            message.contains(&format!("MachineDeployment {ns}/md"))
                && message.contains(&format!("MachineSet {ns}/md-old still has 1 replica")),
            "{message}"
        );
    }
    assert!(capi.marked_machines().await.is_empty());
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    assert_eq!(versions(&capi).await, before, "DeleteNodes wrote");

    // Scale-up is unaffected, and the min CA sees follows the target.
    rpc.increase(&id, 1)
        .await
        .expect("IncreaseSize during the rollout");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 4);
    wait_min(&rpc, &id, 4).await;

    // The old MachineSet is drained (nobody writes its status here), and the new one has the
    // Machine of the raise (no controller creates it here; DeleteNodes is refused while Cluster
    // API has Machines to create): back to normal.
    capi.scale(Kind::MachineSet, "md-old", 0).await;
    capi.create_machine(&capi.running("new-2", Owner::MachineSet("md-new".into())))
        .await;
    wait_min(&rpc, &id, 1).await;
    rpc.delete_nodes(&id, vec![capi.grpc_node("new-0")])
        .await
        .expect("DeleteNodes after the rollout");
    assert_eq!(
        capi.marked_machines().await,
        ["new-0".to_string()].into_iter().collect()
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
}

#[tokio::test]
async fn the_rolling_out_condition_pauses_scale_down_while_it_is_true() {
    let (cp, capi) = fresh_capi(SETUP, VERSION).await;
    let ns = capi.ns.clone();
    rolling_deployment(&capi, 3, 0).await;
    let (_provider, mut rpc) = provider_for_namespace(cp, &ns).await;
    let id = capi.id(Kind::MachineDeployment, "md");
    assert_eq!(rpc.group(&id).await.map(|g| g.min_size), Some(1));

    let set_condition = |status: &'static str| {
        let api = capi.api(Kind::MachineDeployment);
        async move {
            let reason = if status == "True" {
                "RollingOut"
            } else {
                "NotRollingOut"
            };
            let patch = json!({"status": {"conditions": [{
                "type": "RollingOut",
                "status": status,
                "reason": reason,
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }]}});
            api.patch_status("md", &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .unwrap_or_else(|e| panic!("write the RollingOut condition of md: {e}"));
        }
    };

    set_condition("True").await;
    wait_min(&rpc, &id, 3).await;
    let message = expect_code(
        "DeleteNodes while RollingOut is True",
        rpc.delete_nodes(&id, vec![capi.grpc_node("new-0")]).await,
        Code::FailedPrecondition,
    );
    assert!(
        message.contains("condition RollingOut is True"),
        "{message}"
    );
    assert!(capi.marked_machines().await.is_empty());
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);

    set_condition("False").await;
    wait_min(&rpc, &id, 1).await;
    rpc.delete_nodes(&id, vec![capi.grpc_node("new-0")])
        .await
        .expect("DeleteNodes once RollingOut is False");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);
}
