//! Scale-ups Cluster API's MachineSet preflight checks hold back, as the provider serves them (no
//! Cluster API controller runs here: the MachineSet's conditions are written by the test as the
//! real MachineSet controller writes them; tests/real_capi/preflight.rs has the real one).

use crate::support;
use std::time::Duration;

use capi_autoscaler_provider::proto::Instance;
use capi_autoscaler_provider::proto::instance_status::InstanceState;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use support::capi::{Kind, Owner, Rpc, Scalable, fresh_capi, grpc_node, provider_for_namespace};
use support::{Check, Setup, poll_until};
use tonic::Code;

const HELD: &str =
    "StandInControlPlane ns/w is upgrading (\"ControlPlaneIsStable\" preflight check failed)";

/// The held-back instances of group `id` once NodeGroupNodes lists exactly `want`.
async fn wait_held(rpc: &mut Rpc, id: &str, want: usize) -> Vec<Instance> {
    let rpc = tokio::sync::Mutex::new(rpc);
    poll_until(
        &format!("{want} held-back instances of {id}"),
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            let instances = rpc.lock().await.instances(id).await;
            let held: Vec<Instance> = instances
                .into_values()
                .filter(|i| i.id.starts_with("preflight-held-"))
                .collect();
            if held.len() == want {
                Check::Done(held)
            } else {
                Check::Wait(format!("{} held", held.len()))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A MachineSet of 3 replicas with one Machine whose `ScalingUp` condition says a preflight check
/// blocks it: the two replicas never created are instances being created with the error
/// `PreflightCheckFailed:ControlPlaneIsStable` (class other). DeleteNodes of one lowers replicas by
/// one (as CA does for instances that failed to create); once a Machine the check let through
/// covers the other, DeleteNodes of it is refused and writes nothing; once the condition clears,
/// nothing is held back.
#[tokio::test]
async fn held_back_replicas_are_failed_instances_that_delete_nodes_cancels() {
    let (cp, capi) = fresh_capi(Setup::shipped(), "v1beta2").await;
    let owner = Owner::MachineSet("ms".into());
    capi.create(&Scalable::ms("ms").bounds(0, 4).replicas(3))
        .await;
    capi.create_machine(&capi.running("ms-0", owner.clone()))
        .await;
    let condition = |status: &str, message: &str| {
        json!({"status": {"conditions": [{
            "type": "ScalingUp", "status": status, "reason": "ScalingUp",
            "lastTransitionTime": "2026-01-01T00:00:00Z", "message": message,
        }]}})
    };
    capi.api(Kind::MachineSet)
        .patch_status(
            "ms",
            &PatchParams::default(),
            &Patch::Merge(&condition(
                "True",
                &format!("Scaling up from 1 to 3 replicas is blocked because:\n* {HELD}"),
            )),
        )
        .await
        .expect("write the MachineSet's conditions");
    let (_provider, mut rpc) = provider_for_namespace(cp, &capi.ns).await;
    let id = capi.id(Kind::MachineSet, "ms");

    let held = wait_held(&mut rpc, &id, 2).await;
    for instance in &held {
        let status = instance.status.as_ref().expect("a status");
        assert_eq!(
            status.instance_state,
            InstanceState::InstanceCreating as i32
        );
        let error = status.error_info.as_ref().expect("an error");
        assert_eq!(
            (error.error_code.as_str(), error.instance_error_class),
            ("PreflightCheckFailed:ControlPlaneIsStable", 99)
        );
        assert!(
            error.error_message.contains(HELD),
            "{}",
            error.error_message
        );
    }

    // As CA deletes an instance that failed to create: its id as providerID and name.
    let first = held[0].id.clone();
    rpc.delete_nodes(&id, vec![grpc_node(&first, &first)])
        .await
        .expect("DeleteNodes of a held-back instance");
    assert_eq!(capi.replicas(Kind::MachineSet, "ms").await, 2);
    let held = wait_held(&mut rpc, &id, 1).await;

    // The check lets one through: its Machine covers the last held-back replica. Whether or not the
    // provider saw it yet, removing that instance now would remove a Machine: refused.
    capi.create_machine(&capi.pending("ms-1", owner.clone()))
        .await;
    let last = held[0].id.clone();
    let refused = rpc
        .delete_nodes(&id, vec![grpc_node(&last, &last)])
        .await
        .expect_err("the held-back replica has its Machine now");
    assert!(
        matches!(refused.code(), Code::FailedPrecondition | Code::NotFound),
        "{refused:?}"
    );
    assert_eq!(capi.replicas(Kind::MachineSet, "ms").await, 2);
    wait_held(&mut rpc, &id, 0).await;

    // Raised again: held back while the condition says so, not after it clears.
    rpc.increase(&id, 1).await.expect("IncreaseSize");
    wait_held(&mut rpc, &id, 1).await;
    capi.api(Kind::MachineSet)
        .patch_status(
            "ms",
            &PatchParams::default(),
            &Patch::Merge(&condition("True", "Scaling up from 2 to 3 replicas")),
        )
        .await
        .expect("clear the MachineSet's preflight message");
    wait_held(&mut rpc, &id, 0).await;
}
