//! Node groups on the v1beta1-only Cluster API CRDs (v1beta1 storage), with v1beta1-shaped objects:
//! `infrastructureRef.apiVersion`, `status.nodeRef` as an ObjectReference, `status.failureMessage`.

use crate::support;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use capi_autoscaler_provider::proto::instance_status::InstanceState;
use capi_autoscaler_provider::proto::{ExternalGrpcNode, Instance};
use support::capi::{Capi, Kind, Owner, Rpc, Scalable, expect_code, grpc_node};
use support::capi::{fresh_capi, ids, provider_for_namespace};
use support::{ProviderProcess, Setup};
use tonic::Code;

const SETUP: Setup = Setup::v1beta1();

async fn capi() -> (&'static support::ControlPlane, Capi) {
    fresh_capi(SETUP, "v1beta1").await
}

async fn provider_for(cp: &support::ControlPlane, capi: &Capi) -> (ProviderProcess, Rpc) {
    provider_for_namespace(cp, &capi.ns).await
}

fn state(i: &Instance) -> (InstanceState, Option<(String, i32)>) {
    let status = i.status.as_ref().expect("every instance has a status");
    (
        InstanceState::try_from(status.instance_state).expect("a known state"),
        status
            .error_info
            .as_ref()
            .map(|e| (e.error_code.clone(), e.instance_error_class)),
    )
}

fn annotated_node(capi: &Capi, machine: &str) -> ExternalGrpcNode {
    let mut node = grpc_node("", "node-without-provider-id");
    node.annotations = HashMap::from([
        (capi.key("machine"), machine.to_string()),
        (capi.key("cluster-namespace"), capi.ns.clone()),
    ]);
    node
}

#[tokio::test]
async fn v1beta1_groups_instances_and_node_lookups() {
    let (cp, capi) = capi().await;
    let ns = capi.ns.clone();
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(1, 6).replicas(5), true)
        .await;
    capi.create_machine(&capi.running("run", md.clone())).await;
    capi.create_machine(&capi.pending("pend", md.clone())).await;
    capi.create_machine(&capi.running("del", md.clone()).deleting())
        .await;
    capi.create_machine(
        &capi
            .pending("fail", md.clone())
            .failed("instance type unavailable"),
    )
    .await;
    capi.create_machine(
        &capi
            .running("fail-id", md.clone())
            .node(None)
            .failed("boot timeout"),
    )
    .await;
    capi.create(&Scalable::ms("ms").bounds(0, 2).replicas(1))
        .await;
    capi.create_machine(&capi.running("ms-0", Owner::MachineSet("ms".into())))
        .await;
    let (pa, pb) = (capi.provider_id("mp-a"), capi.provider_id("mp-b"));
    capi.create(
        &Scalable::mp("mp")
            .bounds(0, 4)
            .replicas(2)
            .provider_ids(&[pa.clone(), pb.clone()]),
    )
    .await;
    capi.create_machine(&capi.running("mp-a", Owner::MachinePool("mp".into())))
        .await;
    let (_provider, mut rpc) = provider_for(cp, &capi).await;
    let md_id = capi.id(Kind::MachineDeployment, "md");
    let ms_id = capi.id(Kind::MachineSet, "ms");
    let mp_id = capi.id(Kind::MachinePool, "mp");

    assert_eq!(rpc.ids_in(&ns).await, ids(&[&md_id, &ms_id, &mp_id]));
    let bounds: BTreeMap<String, (i32, i32)> = rpc
        .groups()
        .await
        .into_iter()
        .map(|g| (g.id, (g.min_size, g.max_size)))
        .collect();
    assert_eq!(bounds[&md_id], (1, 6));
    assert_eq!(bounds[&ms_id], (0, 2));
    assert_eq!(bounds[&mp_id], (0, 4));

    let got: BTreeMap<String, _> = rpc
        .instances(&md_id)
        .await
        .iter()
        .map(|(k, v)| (k.clone(), state(v)))
        .collect();
    let failed = Some(("ProvisioningFailed".to_string(), 99));
    let expected: BTreeMap<String, _> = [
        (
            capi.provider_id("run"),
            (InstanceState::InstanceRunning, None),
        ),
        (
            format!("pending-machine-{ns}_pend"),
            (InstanceState::InstanceCreating, None),
        ),
        (
            capi.provider_id("del"),
            (InstanceState::InstanceDeleting, None),
        ),
        (
            format!("failed-machine-{ns}_fail"),
            (InstanceState::InstanceCreating, failed.clone()),
        ),
        (
            capi.provider_id("fail-id"),
            (InstanceState::InstanceCreating, failed),
        ),
    ]
    .into_iter()
    .collect();
    assert_eq!(got, expected);
    let mp_instances = rpc.instances(&mp_id).await;
    assert_eq!(
        mp_instances.keys().cloned().collect::<BTreeSet<_>>(),
        ids(&[&pa, &pb])
    );
    assert_eq!(rpc.target(&md_id).await.unwrap(), 5);
    assert_eq!(rpc.target(&mp_id).await.unwrap(), 2);

    for (how, node, want) in [
        ("providerID", capi.grpc_node("run"), &md_id),
        (
            "normalised providerID",
            grpc_node(&format!("aws:///us-east-1a/{ns}-run"), "x"),
            &md_id,
        ),
        (
            "pending id",
            grpc_node(
                &format!("pending-machine-{ns}_pend"),
                &format!("pending-machine-{ns}_pend"),
            ),
            &md_id,
        ),
        (
            "failed id",
            grpc_node(
                &format!("failed-machine-{ns}_fail"),
                &format!("failed-machine-{ns}_fail"),
            ),
            &md_id,
        ),
        ("annotations", annotated_node(&capi, "run"), &md_id),
        ("MachineSet Machine", capi.grpc_node("ms-0"), &ms_id),
        ("providerIDList entry", grpc_node(&pb, "mp-b"), &mp_id),
        ("MachinePool Machine", capi.grpc_node("mp-a"), &mp_id),
    ] {
        let group = rpc.for_node(node).await;
        assert_eq!(&group.id, want, "NodeGroupForNode by {how}");
        assert_eq!(
            (group.min_size, group.max_size),
            bounds[want],
            "bounds by {how}"
        );
    }
    assert_eq!(
        rpc.for_node(grpc_node(&format!("aws:///x/nowhere-{ns}"), "n"))
            .await
            .id,
        ""
    );
    expect_code(
        "owned MachineSet is no group",
        rpc.target(&capi.id(Kind::MachineSet, &Capi::set_of("md")))
            .await,
        Code::NotFound,
    );
}

#[tokio::test]
async fn v1beta1_increase_size_and_delete_nodes() {
    let (cp, capi) = capi().await;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(2, 5).replicas(3), false)
        .await;
    for m in ["m0", "m1", "m2"] {
        capi.create_machine(&capi.running(m, md.clone())).await;
    }
    let pb = capi.provider_id("mp-b");
    capi.create(
        &Scalable::mp("mp")
            .bounds(0, 3)
            .replicas(1)
            .provider_ids(std::slice::from_ref(&pb)),
    )
    .await;
    let discovery = format!("clusterapi:namespace={}", capi.ns);
    let provider = support::start_provider(
        &[
            "--node-group-auto-discovery",
            &discovery,
            "--mark-grace-period",
            "0s",
        ],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    let id = capi.id(Kind::MachineDeployment, "md");
    let mp_id = capi.id(Kind::MachinePool, "mp");

    rpc.increase(&id, 2).await.expect("IncreaseSize +2");
    assert_eq!(rpc.target(&id).await.unwrap(), 5, "read-your-writes");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 5);
    expect_code(
        "IncreaseSize above max",
        rpc.increase(&id, 1).await,
        Code::FailedPrecondition,
    );
    expect_code(
        "IncreaseSize(0)",
        rpc.increase(&id, 0).await,
        Code::InvalidArgument,
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 5);
    // Cluster API takes in the raise and creates two Machines that get no Node.
    capi.observe(Kind::MachineDeployment, "md").await;
    for p in ["p0", "p1"] {
        capi.create_machine(&capi.pending(p, md.clone())).await;
    }
    rpc.decrease(&id, -2)
        .await
        .expect("DecreaseTargetSize -2 (never registered)");
    assert_eq!(capi.marked_machines().await, ids(&["p0", "p1"]), "pinned");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);

    rpc.delete_nodes(&id, vec![capi.grpc_node("m0")])
        .await
        .expect("DeleteNodes m0");
    assert_eq!(capi.marked_machines().await, ids(&["m0", "p0", "p1"]));
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);
    rpc.delete_nodes(&id, vec![capi.grpc_node("m0")])
        .await
        .expect("DeleteNodes m0 again");
    assert_eq!(
        capi.replicas(Kind::MachineDeployment, "md").await,
        2,
        "a retry must not decrement again"
    );
    expect_code(
        "DeleteNodes below min",
        rpc.delete_nodes(&id, vec![annotated_node(&capi, "m1")])
            .await,
        Code::FailedPrecondition,
    );
    expect_code(
        "DeleteNodes with a node of another group",
        rpc.delete_nodes(&id, vec![grpc_node(&pb, "mp-b")]).await,
        Code::InvalidArgument,
    );
    assert_eq!(capi.marked_machines().await, ids(&["m0", "p0", "p1"]));
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);

    rpc.delete_nodes(&mp_id, vec![grpc_node(&pb, "mp-b")])
        .await
        .expect("DeleteNodes MachinePool entry");
    assert_eq!(capi.replicas(Kind::MachinePool, "mp").await, 0);
    assert_eq!(capi.marked_machines().await, ids(&["m0", "p0", "p1"]));
}

/// `CAPI_VERSION` picks the version instead of discovery: v1beta1 is served here; v1beta2 is not, and
/// the provider stops at start with an error that names the group and version.
#[tokio::test]
async fn capi_version_selects_the_served_version_and_an_unserved_one_fails_at_start() {
    use support::capi::{spawn_provider, start_provider_with_env};

    let (cp, capi) = capi().await;
    capi.create_deployment(&Scalable::md("md").bounds(0, 3).replicas(0), false)
        .await;
    let discovery = format!("clusterapi:namespace={}", capi.ns);
    let provider = start_provider_with_env(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
        &[("CAPI_VERSION", "v1beta1")],
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    assert_eq!(
        rpc.ids_in(&capi.ns).await,
        ids(&[&capi.id(Kind::MachineDeployment, "md")])
    );

    let mut wrong = spawn_provider(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
        &[("CAPI_VERSION", "v1beta2")],
    );
    let status = wrong.wait_exit().await;
    assert!(!status.success(), "{status}");
    let log = wrong.log_contents();
    assert!(
        log.contains("\"cluster.x-k8s.io\" at version v1beta2") && log.contains("not served"),
        "the error names the group and version: {log}"
    );

    // A CAPI_GROUP the API server does not serve stops the start the same way.
    let mut missing = spawn_provider(
        &[],
        cp.admin_kubeconfig(),
        &[("CAPI_GROUP", "nowhere.example.dev")],
    );
    let status = missing.wait_exit().await;
    assert!(!status.success(), "{status}");
    let log = missing.log_contents();
    assert!(
        log.contains("nowhere.example.dev"),
        "the error names the group: {log}"
    );
}
