//! Node groups end to end on the Cluster API CRDs as shipped (v1beta2 objects): every CloudProvider
//! RPC and its error paths for MachineDeployment, standalone MachineSet and MachinePool groups,
//! auto-discovery filters, problem Events, the shipped ClusterRole, concurrency of scale operations,
//! no API request on the read path, and an unreachable API.
//!
//! Every test works in a namespace of its own. Tests share the apiserver, so the one that counts the
//! apiserver's requests runs alone: it takes [`API_QUIET`] exclusively, every other test shares it.

use crate::support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::instance_status::InstanceState;
use capi_autoscaler_provider::proto::{
    CleanupRequest, ExternalGrpcNode, GetAvailableGpuTypesRequest, GpuLabelRequest,
    NodeGroupAutoscalingOptions, NodeGroupAutoscalingOptionsRequest,
    NodeGroupTemplateNodeInfoRequest, RefreshRequest,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};
use support::capi::{
    Capi, Kind, Owner, Rpc, SHIPPED_ROLE, Scalable, TcpProxy, apply_shipped_cluster_role,
    expect_code, growth, grpc_node, kubeconfig_with_server, label_of, request_counts,
    socket_addr_of,
};
use support::capi::{Env, ids, provider_for_namespace};
use support::{CAPI_GROUP, Check, ProviderProcess, Setup, poll_until, start_provider};
use tokio::sync::{RwLock, watch};
use tonic::Code;

const SETUP: Setup = Setup::shipped();
const VERSION: &str = "v1beta2";

/// Shared by every test; taken exclusively by the one that counts apiserver requests.
pub(crate) static API_QUIET: RwLock<()> = RwLock::const_new(());

async fn env() -> Env {
    Env::fresh(SETUP, VERSION).await
}

fn only_namespace(ns: &str) -> String {
    format!("clusterapi:namespace={ns}")
}

/// A provider (admin identity) that only looks at the test's namespace, and a client for it.
async fn provider_for(env: &Env) -> (ProviderProcess, Rpc) {
    provider_for_namespace(env.cp, &env.capi.ns).await
}

/// No grace period after a raise: these tests cancel capacity without a Machine right after
/// raising it (no Cluster API controller here creates Machines for the raise).
const NO_RAISE_HOLD: [&str; 2] = ["--mark-grace-period", "0s"];

/// [`provider_for`] with more flags.
async fn provider_for_args(env: &Env, args: &[&str]) -> (ProviderProcess, Rpc) {
    let discovery = format!("clusterapi:namespace={}", env.capi.ns);
    let mut all = vec!["--node-group-auto-discovery", discovery.as_str()];
    all.extend_from_slice(args);
    let provider = support::start_provider(&all, env.cp.admin_kubeconfig()).await;
    let rpc = Rpc::connect(&provider).await;
    (provider, rpc)
}

fn state(
    instance: &capi_autoscaler_provider::proto::Instance,
) -> (InstanceState, Option<(String, i32)>) {
    let status = instance
        .status
        .as_ref()
        .expect("every instance has a status");
    (
        InstanceState::try_from(status.instance_state).expect("a known instance state"),
        status
            .error_info
            .as_ref()
            .map(|e| (e.error_code.clone(), e.instance_error_class)),
    )
}

fn annotated_node(capi: &Capi, machine: &str) -> ExternalGrpcNode {
    let mut node = grpc_node("", &format!("node-without-provider-id-{machine}"));
    node.annotations = HashMap::from([
        (capi.key("machine"), machine.to_string()),
        (capi.key("cluster-namespace"), capi.ns.clone()),
    ]);
    node
}

/// Whether an object's managedFields record the provider (its field manager) as the writer of
/// `spec.replicas`, in a write to the object itself (where the removal ledger goes too).
async fn replicas_written_by_provider(capi: &Capi, kind: Kind, name: &str) -> bool {
    let object = capi
        .api(kind)
        .get(name)
        .await
        .expect("get the scalable resource");
    object
        .metadata
        .managed_fields
        .unwrap_or_default()
        .iter()
        .any(|f| {
            f.manager.as_deref() == Some("capi-autoscaler-provider")
                && f.subresource.is_none()
                && f.fields_v1
                    .as_ref()
                    .is_some_and(|v| v.0.to_string().contains("f:replicas"))
        })
}

#[tokio::test]
async fn machine_deployment_group_answers_every_read_rpc() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let ns = capi.ns.clone();
    let md = Owner::Deployment("md".into());
    // The owned MachineSet carries the bound annotations too: it must still not be a group.
    capi.create_deployment(&Scalable::md("md").bounds(1, 8).replicas(8), true)
        .await;
    capi.create_machine(&capi.running("run-0", md.clone()))
        .await;
    capi.create_machine(&capi.running("run-1", md.clone()))
        .await;
    capi.create_machine(&capi.running("pend-id", md.clone()).node(None))
        .await;
    capi.create_machine(&capi.pending("pend", md.clone())).await;
    capi.create_machine(&capi.running("del", md.clone()).deleting())
        .await;
    capi.create_machine(&capi.pending("del-noid", md.clone()).deleting())
        .await;
    capi.create_machine(&capi.pending("fail", md.clone()).failed("quota exceeded"))
        .await;
    capi.create_machine(
        &capi
            .running("fail-id", md.clone())
            .node(None)
            .failed("no capacity"),
    )
    .await;
    // A Machine of a MachineSet that is no node group.
    capi.create(&Scalable::ms("plain")).await;
    capi.create_machine(&capi.running("stray", Owner::MachineSet("plain".into())))
        .await;

    let (_provider, mut rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachineDeployment, "md");

    // NodeGroups: the MachineDeployment only, with its bounds.
    assert_eq!(rpc.ids_in(&ns).await, ids(&[&id]));
    let group = rpc.group(&id).await.expect("the MachineDeployment group");
    assert_eq!((group.min_size, group.max_size), (1, 8));
    assert!(
        group.debug.contains(&id),
        "debug {:?} should name the group",
        group.debug
    );

    // NodeGroupNodes: ids and states.
    let instances = rpc.instances(&id).await;
    let p = |m: &str| capi.provider_id(m);
    let expected: BTreeMap<String, (InstanceState, Option<(String, i32)>)> = [
        (p("run-0"), (InstanceState::InstanceRunning, None)),
        (p("run-1"), (InstanceState::InstanceRunning, None)),
        (p("pend-id"), (InstanceState::InstanceCreating, None)),
        (
            format!("pending-machine-{ns}_pend"),
            (InstanceState::InstanceCreating, None),
        ),
        (p("del"), (InstanceState::InstanceDeleting, None)),
        (
            format!("deleting-machine-{ns}_del-noid"),
            (InstanceState::InstanceDeleting, None),
        ),
        (
            format!("failed-machine-{ns}_fail"),
            (
                InstanceState::InstanceCreating,
                Some(("ProvisioningFailed".to_string(), 99)),
            ),
        ),
        (
            p("fail-id"),
            (
                InstanceState::InstanceCreating,
                Some(("ProvisioningFailed".to_string(), 99)),
            ),
        ),
    ]
    .into_iter()
    .collect();
    let got: BTreeMap<_, _> = instances
        .iter()
        .map(|(k, v)| (k.clone(), state(v)))
        .collect();
    assert_eq!(got, expected);
    let failed = &instances[&format!("failed-machine-{ns}_fail")];
    let message = &failed
        .status
        .as_ref()
        .unwrap()
        .error_info
        .as_ref()
        .unwrap()
        .error_message;
    assert!(
        message.contains("quota exceeded"),
        "error message {message:?}"
    );

    // NodeGroupTargetSize = spec.replicas.
    assert_eq!(rpc.target(&id).await.expect("TargetSize"), 8);

    // NodeGroupForNode, every way a node can be named; the answer carries the bounds.
    let lookups: Vec<(&str, ExternalGrpcNode)> = vec![
        ("exact providerID", capi.grpc_node("run-0")),
        (
            "normalised providerID",
            grpc_node(&format!("other:///zone-a/{ns}-run-1"), "n"),
        ),
        ("pending id as providerID", {
            let made_up = format!("pending-machine-{ns}_pend");
            grpc_node(&made_up, &made_up)
        }),
        (
            "pending id as name only",
            grpc_node("", &format!("pending-machine-{ns}_pend")),
        ),
        ("failed id", {
            let made_up = format!("failed-machine-{ns}_fail");
            grpc_node(&made_up, &made_up)
        }),
        ("deleting id", {
            let made_up = format!("deleting-machine-{ns}_del-noid");
            grpc_node(&made_up, &made_up)
        }),
        ("machine annotations", annotated_node(capi, "run-0")),
        (
            "machine annotations of a pending Machine",
            annotated_node(capi, "pend"),
        ),
    ];
    for (how, node) in lookups {
        let group = rpc.for_node(node).await;
        assert_eq!(group.id, id, "NodeGroupForNode by {how}");
        assert_eq!((group.min_size, group.max_size), (1, 8), "bounds by {how}");
    }
    for (how, node) in [
        (
            "unknown providerID",
            grpc_node(&format!("e2e:///{ns}/nowhere-{ns}"), "nowhere"),
        ),
        ("Machine of no group", capi.grpc_node("stray")),
        (
            "annotations naming no Machine",
            annotated_node(capi, "no-such-machine"),
        ),
    ] {
        let group = rpc.for_node(node).await;
        assert_eq!(group.id, "", "NodeGroupForNode by {how}: not autoscaled");
    }

    // Unknown ids.
    expect_code(
        "TargetSize(unknown)",
        rpc.target("MachineDeployment/nope/nope").await,
        Code::NotFound,
    );
    expect_code(
        "Nodes(unknown)",
        rpc.nodes("MachineDeployment/nope/nope").await,
        Code::NotFound,
    );
    expect_code(
        "Nodes(owned MachineSet)",
        rpc.nodes(&capi.id(Kind::MachineSet, &Capi::set_of("md")))
            .await,
        Code::NotFound,
    );

    // The other read RPCs.
    let mut client = rpc.client.clone();
    let label = client
        .gpu_label(GpuLabelRequest {})
        .await
        .expect("GPULabel")
        .into_inner()
        .label;
    assert_eq!(label, "cluster-api/accelerator");
    client
        .get_available_gpu_types(GetAvailableGpuTypesRequest {})
        .await
        .expect("GetAvailableGPUTypes");
    client.refresh(RefreshRequest {}).await.expect("Refresh");
    client.cleanup(CleanupRequest {}).await.expect("Cleanup");
    let options = client
        .node_group_get_options(NodeGroupAutoscalingOptionsRequest {
            id: id.clone(),
            defaults: Some(NodeGroupAutoscalingOptions {
                scale_down_utilization_threshold: 0.5,
                ..Default::default()
            }),
        })
        .await
        .expect("NodeGroupGetOptions")
        .into_inner();
    assert!(
        options.node_group_autoscaling_options.is_none(),
        "no per-group option annotations: the answer must be empty, got {options:?}"
    );
    // Refresh changed nothing.
    assert_eq!(rpc.ids_in(&ns).await, ids(&[&id]));
}

/// A Machine whose Node registered (status.nodeRef) but that has no spec.providerID (some
/// infrastructure providers), with no workload cluster to look the Node up in. Its instance id can
/// match no Node's providerID, so if it is listed as a running instance CA counts it as a node that
/// never registered and, after max-node-provision-time (15 min), deletes it through DeleteNodes — the
/// real, registered node behind it. Upstream lists such a Machine only through its Node's
/// providerID and skips it when the Node is unknown.
#[tokio::test]
async fn machine_with_a_node_but_no_provider_id_is_not_an_unregistered_running_instance() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(0, 5).replicas(2), false)
        .await;
    capi.create_machine(&capi.running("with-id", md.clone()))
        .await;
    capi.create_machine(&capi.running("no-id", md.clone()).provider_id(None))
        .await;
    let (_provider, mut rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachineDeployment, "md");

    // The Node is still mapped to its group, through its machine annotations.
    assert_eq!(rpc.for_node(annotated_node(capi, "no-id")).await.id, id);
    let instances = rpc.instances(&id).await;
    assert!(instances.contains_key(&capi.provider_id("with-id")));
    let made_up_running: Vec<&String> = instances
        .iter()
        .filter(|(k, v)| {
            ["pending-machine-", "failed-machine-", "deleting-machine-"]
                .iter()
                .any(|p| k.starts_with(p))
                && state(v).0 == InstanceState::InstanceRunning
        })
        .map(|(k, _)| k)
        .collect();
    assert!(
        made_up_running.is_empty(),
        "made-up instance ids reported as running (CA will delete them as never registered): {made_up_running:?}; all: {:?}",
        instances
            .iter()
            .map(|(k, v)| (k, state(v)))
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn standalone_machine_set_group_scales() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let owner = Owner::MachineSet("ms".into());
    capi.create(&Scalable::ms("ms").bounds(1, 4).replicas(2))
        .await;
    capi.create_machine(&capi.running("ms-0", owner.clone()))
        .await;
    capi.create_machine(&capi.running("ms-1", owner.clone()))
        .await;
    let (_provider, mut rpc) = provider_for_args(&env, &NO_RAISE_HOLD).await;
    let id = capi.id(Kind::MachineSet, "ms");

    assert_eq!(rpc.ids_in(&capi.ns).await, ids(&[&id]));
    let group = rpc.for_node(capi.grpc_node("ms-1")).await;
    assert_eq!(
        (group.id.as_str(), group.min_size, group.max_size),
        (id.as_str(), 1, 4)
    );
    let instances = rpc.instances(&id).await;
    assert_eq!(
        instances.keys().cloned().collect::<BTreeSet<_>>(),
        ids(&[&capi.provider_id("ms-0"), &capi.provider_id("ms-1")])
    );
    assert!(
        instances
            .values()
            .all(|i| state(i).0 == InstanceState::InstanceRunning)
    );

    rpc.increase(&id, 1).await.expect("IncreaseSize +1");
    assert_eq!(rpc.target(&id).await.unwrap(), 3, "read-your-writes");
    assert_eq!(capi.replicas(Kind::MachineSet, "ms").await, 3);
    assert!(replicas_written_by_provider(capi, Kind::MachineSet, "ms").await);
    expect_code(
        "IncreaseSize above max",
        rpc.increase(&id, 2).await,
        Code::FailedPrecondition,
    );
    assert_eq!(capi.replicas(Kind::MachineSet, "ms").await, 3);
    // Cluster API takes in the raise and creates the third Machine; it gets no Node.
    capi.observe(Kind::MachineSet, "ms").await;
    capi.create_machine(&capi.pending("ms-2", owner.clone()))
        .await;

    rpc.decrease(&id, -1)
        .await
        .expect("DecreaseTargetSize -1 (one not registered)");
    assert_eq!(rpc.target(&id).await.unwrap(), 2);
    assert_eq!(capi.marked_machines().await, ids(&["ms-2"]), "pinned");
    capi.observe(Kind::MachineSet, "ms").await;
    expect_code(
        "DecreaseTargetSize below the registered nodes",
        rpc.decrease(&id, -1).await,
        Code::FailedPrecondition,
    );
    assert_eq!(capi.replicas(Kind::MachineSet, "ms").await, 2);

    rpc.delete_nodes(&id, vec![capi.grpc_node("ms-0")])
        .await
        .expect("DeleteNodes ms-0");
    assert_eq!(capi.marked_machines().await, ids(&["ms-0", "ms-2"]));
    assert_eq!(capi.replicas(Kind::MachineSet, "ms").await, 1);
    assert_eq!(rpc.target(&id).await.unwrap(), 1);
    rpc.delete_nodes(&id, vec![capi.grpc_node("ms-0")])
        .await
        .expect("DeleteNodes ms-0 again");
    assert_eq!(
        capi.replicas(Kind::MachineSet, "ms").await,
        1,
        "a retry must not decrement again"
    );
    expect_code(
        "DeleteNodes below min",
        rpc.delete_nodes(&id, vec![capi.grpc_node("ms-1")]).await,
        Code::FailedPrecondition,
    );
    assert_eq!(capi.marked_machines().await, ids(&["ms-0", "ms-2"]));
    assert_eq!(capi.replicas(Kind::MachineSet, "ms").await, 1);
}

#[tokio::test]
async fn machine_pool_group_maps_provider_id_list_entries() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let ns = capi.ns.clone();
    let (a, b, c) = (
        capi.provider_id("mp-a"),
        capi.provider_id("mp-b"),
        capi.provider_id("mp-c"),
    );
    capi.create(&Scalable::mp("mp").bounds(2, 6).replicas(3).provider_ids(&[
        a.clone(),
        b.clone(),
        c.clone(),
    ]))
    .await;
    // Only mp-a has a Machine (some infrastructure providers make none).
    capi.create_machine(&capi.running("mp-a", Owner::MachinePool("mp".into())))
        .await;
    let (_provider, mut rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachinePool, "mp");

    assert_eq!(rpc.ids_in(&ns).await, ids(&[&id]));
    let group = rpc.group(&id).await.unwrap();
    assert_eq!((group.min_size, group.max_size), (2, 6));
    let instances = rpc.instances(&id).await;
    assert_eq!(
        instances.keys().cloned().collect::<BTreeSet<_>>(),
        ids(&[&a, &b, &c])
    );
    assert!(
        instances
            .values()
            .all(|i| state(i).0 == InstanceState::InstanceRunning)
    );
    for node in [
        grpc_node(&b, "mp-b"),
        grpc_node(&format!("other:///x/{ns}-mp-c"), "mp-c"),
        capi.grpc_node("mp-a"),
    ] {
        let group = rpc.for_node(node).await;
        assert_eq!(
            (group.id.as_str(), group.min_size, group.max_size),
            (id.as_str(), 2, 6)
        );
    }
    assert_eq!(rpc.target(&id).await.unwrap(), 3);

    rpc.increase(&id, 1).await.expect("IncreaseSize");
    assert_eq!(rpc.target(&id).await.unwrap(), 4);
    assert_eq!(capi.replicas(Kind::MachinePool, "mp").await, 4);
    assert!(replicas_written_by_provider(capi, Kind::MachinePool, "mp").await);
    // The infrastructure provider lists the instance it made for the raise.
    let d = capi.provider_id("mp-d");
    capi.patch(
        Kind::MachinePool,
        "mp",
        serde_json::json!({"spec": {"providerIDList": [&a, &b, &c, &d]}}),
    )
    .await;

    // A providerIDList entry without a Machine: replicas only.
    rpc.delete_nodes(&id, vec![grpc_node(&b, "mp-b")])
        .await
        .expect("DeleteNodes mp-b");
    assert_eq!(capi.replicas(Kind::MachinePool, "mp").await, 3);
    assert!(capi.marked_machines().await.is_empty());
    rpc.delete_nodes(&id, vec![grpc_node(&b, "mp-b")])
        .await
        .expect("DeleteNodes mp-b again");
    assert_eq!(
        capi.replicas(Kind::MachinePool, "mp").await,
        3,
        "a retry must not decrement again"
    );
    // A node with a Machine: marked and decremented.
    rpc.delete_nodes(&id, vec![capi.grpc_node("mp-a")])
        .await
        .expect("DeleteNodes mp-a");
    assert_eq!(capi.marked_machines().await, ids(&["mp-a"]));
    assert_eq!(capi.replicas(Kind::MachinePool, "mp").await, 2);
    assert_eq!(rpc.target(&id).await.unwrap(), 2);
    // Every listed instance counts as registered: nothing to cancel.
    expect_code(
        "DecreaseTargetSize(0)",
        rpc.decrease(&id, 0).await,
        Code::InvalidArgument,
    );
    expect_code(
        "DecreaseTargetSize(-1)",
        rpc.decrease(&id, -1).await,
        Code::FailedPrecondition,
    );
    // At min: a further node is refused and nothing changes.
    expect_code(
        "DeleteNodes below min",
        rpc.delete_nodes(&id, vec![grpc_node(&c, "mp-c")]).await,
        Code::FailedPrecondition,
    );
    assert_eq!(capi.replicas(Kind::MachinePool, "mp").await, 2);
    assert_eq!(capi.marked_machines().await, ids(&["mp-a"]));
}

#[tokio::test]
async fn increase_size_raises_replicas_within_bounds() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    capi.create_deployment(&Scalable::md("md").bounds(1, 5).replicas(2), false)
        .await;
    let (_provider, mut rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachineDeployment, "md");

    rpc.increase(&id, 2).await.expect("IncreaseSize +2");
    assert_eq!(
        rpc.target(&id).await.unwrap(),
        4,
        "TargetSize right after IncreaseSize (read-your-writes)"
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 4);
    assert!(
        replicas_written_by_provider(capi, Kind::MachineDeployment, "md").await,
        "replicas must be written by the provider"
    );
    for delta in [0, -1] {
        expect_code(
            &format!("IncreaseSize({delta})"),
            rpc.increase(&id, delta).await,
            Code::InvalidArgument,
        );
    }
    expect_code(
        "IncreaseSize above max",
        rpc.increase(&id, 2).await,
        Code::FailedPrecondition,
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 4);
    assert_eq!(rpc.target(&id).await.unwrap(), 4);
    expect_code(
        "IncreaseSize(unknown group)",
        rpc.increase(&capi.id(Kind::MachineDeployment, "nope"), 1)
            .await,
        Code::NotFound,
    );

    // A change made behind the provider's back is the base of the next increase.
    capi.scale(Kind::MachineDeployment, "md", 2).await;
    rpc.wait_target(&id, 2).await;
    rpc.increase(&id, 3)
        .await
        .expect("IncreaseSize +3 up to max");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 5);
    assert_eq!(rpc.target(&id).await.unwrap(), 5);
}

/// The watches and the writes share one HTTP/2 connection to the API server, as client-go's do:
/// a write never waits for a new TCP and TLS connection (kube's own client speaks HTTP/1.1: a
/// connection per watch, and a new one for a write whenever none is idle).
#[tokio::test]
async fn watches_and_writes_share_one_connection_to_the_api_server() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    capi.create_deployment(&Scalable::md("md").bounds(0, 5).replicas(1), false)
        .await;
    let (provider, mut rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachineDeployment, "md");
    let port = socket_addr_of(&env.cp.server).port();

    assert_eq!(
        provider.connections_to(port),
        1,
        "every watch on one connection once the provider serves"
    );
    rpc.increase(&id, 1).await.expect("IncreaseSize +1");
    rpc.increase(&id, 1).await.expect("IncreaseSize +1 again");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    assert_eq!(
        provider.connections_to(port),
        1,
        "the writes rode the watches' connection"
    );
}

/// DecreaseTargetSize lowers replicas only by Machines without a Node, each pinned by our mark so
/// that Cluster API removes that one (its order takes marked Machines first), never a running node.
#[tokio::test]
async fn decrease_target_size_cancels_only_unregistered_capacity() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(1, 10).replicas(5), false)
        .await;
    capi.create_machine(&capi.running("r0", md.clone())).await;
    capi.create_machine(&capi.running("r1", md.clone())).await;
    for p in ["p0", "p1", "p2"] {
        capi.create_machine(&capi.pending(p, md.clone())).await;
    }
    let floor = Owner::Deployment("floor".into());
    capi.create_deployment(&Scalable::md("floor").bounds(3, 10).replicas(5), false)
        .await;
    capi.create_machine(&capi.running("f0", floor.clone()))
        .await;
    for p in ["f1", "f2", "f3", "f4"] {
        capi.create_machine(&capi.pending(p, floor.clone())).await;
    }
    let (_provider, mut rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachineDeployment, "md");
    let floor_id = capi.id(Kind::MachineDeployment, "floor");

    for delta in [0, 1] {
        expect_code(
            &format!("DecreaseTargetSize({delta})"),
            rpc.decrease(&id, delta).await,
            Code::InvalidArgument,
        );
    }
    expect_code(
        "DecreaseTargetSize below the running instances",
        rpc.decrease(&id, -4).await,
        Code::FailedPrecondition,
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 5);
    assert!(
        capi.marked_machines().await.is_empty(),
        "a refusal marks nothing"
    );
    rpc.decrease(&id, -3)
        .await
        .expect("DecreaseTargetSize -3 (down to the 2 running)");
    assert_eq!(rpc.target(&id).await.unwrap(), 2);
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);
    capi.observe(Kind::MachineDeployment, "md").await;
    expect_code(
        "DecreaseTargetSize below the running instances",
        rpc.decrease(&id, -1).await,
        Code::FailedPrecondition,
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);

    expect_code(
        "DecreaseTargetSize below min",
        rpc.decrease(&floor_id, -3).await,
        Code::FailedPrecondition,
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "floor").await, 5);
    rpc.decrease(&floor_id, -2)
        .await
        .expect("DecreaseTargetSize down to min");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "floor").await, 3);
    expect_code(
        "DecreaseTargetSize(unknown group)",
        rpc.decrease(&capi.id(Kind::MachineDeployment, "nope"), -1)
            .await,
        Code::NotFound,
    );
    assert_eq!(
        capi.marked_machines().await,
        ids(&["p0", "p1", "p2", "f1", "f2"]),
        "each pending Machine cancelled is pinned by our mark, the first by name as Cluster API ranks them"
    );
    assert_eq!(
        ledger_names(capi, "md").await,
        ids(&["p0", "p1", "p2"]),
        "their marks are paid in the ledger"
    );
    assert_eq!(ledger_names(capi, "floor").await, ids(&["f1", "f2"]));
}

/// The Machine names of MachineDeployment `name`'s ledger entries.
async fn ledger_names(capi: &Capi, name: &str) -> BTreeSet<String> {
    ledger_marks(capi, name)
        .await
        .into_iter()
        .filter_map(|e| e.rsplit_once('@').map(|(m, _)| m.to_string()))
        .collect()
}

/// DecreaseTargetSize marks (and pays in the ledger, in the decrement's write) exactly the pending
/// Machines Cluster API removes first for the count written: Cluster API's order takes marked
/// Machines first, so one that gets its Node before the MachineSet controller acts is still the one
/// removed, never a registered node. Each decrease waits for Cluster API to have observed the last.
#[tokio::test]
async fn decrease_target_size_pins_the_pending_machines_it_cancels() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(0, 10).replicas(4), false)
        .await;
    capi.create_machine(&capi.running("r0", md.clone())).await;
    for p in ["p2", "p0", "p1"] {
        capi.create_machine(&capi.pending(p, md.clone())).await;
    }
    let (_provider, mut rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachineDeployment, "md");
    let replicas = || capi.replicas(Kind::MachineDeployment, "md");

    rpc.decrease(&id, -1)
        .await
        .expect("DecreaseTargetSize -1: one pending");
    assert_eq!(replicas().await, 3);
    capi.observe(Kind::MachineDeployment, "md").await;
    assert_eq!(
        capi.marked_machines().await,
        ids(&["p0"]),
        "the first pending Machine by name, as Cluster API ranks them"
    );
    let ledger = ledger_marks(capi, "md").await;
    let mark = capi
        .api(Kind::Machine)
        .get("p0")
        .await
        .expect("get p0")
        .metadata
        .annotations
        .and_then(|a| a.get(&capi.delete_key()).cloned())
        .expect("p0 carries the delete mark");
    assert_eq!(ledger.len(), 1, "one entry: {ledger:?}");
    let entry = ledger.iter().next().cloned().unwrap_or_default();
    assert!(
        entry.starts_with("p0@") && mark.contains(entry.trim_start_matches("p0@")),
        "the ledger entry {entry:?} pays p0's mark {mark:?}"
    );

    rpc.decrease(&id, -1)
        .await
        .expect("DecreaseTargetSize -1: the next pending one");
    assert_eq!(replicas().await, 2);
    assert_eq!(capi.marked_machines().await, ids(&["p0", "p1"]));
    assert_eq!(ledger_names(capi, "md").await, ids(&["p0", "p1"]));
    capi.observe(Kind::MachineDeployment, "md").await;

    expect_code(
        "DecreaseTargetSize reaching the registered node",
        rpc.decrease(&id, -2).await,
        Code::FailedPrecondition,
    );
    assert_eq!(replicas().await, 2, "a refusal writes nothing");
    assert_eq!(capi.marked_machines().await, ids(&["p0", "p1"]));

    rpc.decrease(&id, -1)
        .await
        .expect("DecreaseTargetSize -1: the last pending one");
    assert_eq!(replicas().await, 1);
    assert_eq!(capi.marked_machines().await, ids(&["p0", "p1", "p2"]));
    assert_eq!(ledger_names(capi, "md").await, ids(&["p0", "p1", "p2"]));
    assert!(
        !capi.marked_machines().await.contains("r0"),
        "the registered node is never marked"
    );
}

#[tokio::test]
async fn delete_nodes_marks_each_machine_and_decrements_once() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(2, 10).replicas(6), false)
        .await;
    for m in ["m0", "m1", "m2", "m3", "m4"] {
        capi.create_machine(&capi.running(m, md.clone())).await;
    }
    capi.create_machine(&capi.pending("p0", md.clone())).await;
    capi.create_machine(&capi.running("going", md.clone()).deleting())
        .await;
    capi.create_deployment(&Scalable::md("other").bounds(0, 5).replicas(1), false)
        .await;
    capi.create_machine(&capi.running("o0", Owner::Deployment("other".into())))
        .await;
    let (_provider, mut rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachineDeployment, "md");
    let other_id = capi.id(Kind::MachineDeployment, "other");
    let replicas = || capi.replicas(Kind::MachineDeployment, "md");

    rpc.delete_nodes(&id, vec![capi.grpc_node("m0")])
        .await
        .expect("DeleteNodes m0");
    assert_eq!(capi.marked_machines().await, ids(&["m0"]));
    assert_eq!(replicas().await, 5);
    assert_eq!(rpc.target(&id).await.unwrap(), 5, "read-your-writes");
    let value = capi
        .api(Kind::Machine)
        .get("m0")
        .await
        .unwrap()
        .metadata
        .annotations
        .unwrap()[&capi.delete_key()]
        .clone();
    assert!(!value.is_empty(), "the delete annotation has a value");

    rpc.delete_nodes(&id, vec![capi.grpc_node("m0")])
        .await
        .expect("DeleteNodes m0, retried");
    assert_eq!(
        replicas().await,
        5,
        "a retried call must not decrement again"
    );
    assert_eq!(capi.marked_machines().await, ids(&["m0"]));

    rpc.delete_nodes(&id, vec![capi.grpc_node("m1"), capi.grpc_node("m1")])
        .await
        .expect("DeleteNodes m1 twice in one call");
    assert_eq!(replicas().await, 4);
    assert_eq!(capi.marked_machines().await, ids(&["m0", "m1"]));

    // A node of another group anywhere in the call: INVALID_ARGUMENT and nothing changes.
    expect_code(
        "DeleteNodes with a node of another group",
        rpc.delete_nodes(&id, vec![capi.grpc_node("m2"), capi.grpc_node("o0")])
            .await,
        Code::InvalidArgument,
    );
    assert_eq!(capi.marked_machines().await, ids(&["m0", "m1"]));
    assert_eq!(replicas().await, 4);
    assert_eq!(capi.replicas(Kind::MachineDeployment, "other").await, 1);
    // Unknown node, unknown group.
    let unknown = grpc_node(&format!("e2e:///{0}/nowhere-{0}", capi.ns), "nowhere");
    expect_code(
        "DeleteNodes with an unknown node",
        rpc.delete_nodes(&id, vec![capi.grpc_node("m2"), unknown])
            .await,
        Code::NotFound,
    );
    expect_code(
        "DeleteNodes on an unknown group",
        rpc.delete_nodes(
            &capi.id(Kind::MachineDeployment, "nope"),
            vec![capi.grpc_node("m2")],
        )
        .await,
        Code::NotFound,
    );
    assert_eq!(capi.marked_machines().await, ids(&["m0", "m1"]));
    assert_eq!(replicas().await, 4);

    // A Machine being deleted already: nothing to do, no decrement.
    rpc.delete_nodes(&id, vec![capi.grpc_node("going")])
        .await
        .expect("DeleteNodes of a deleting Machine");
    assert_eq!(replicas().await, 4);

    // CA's fake node for an instance that never registered (the made-up id).
    let fake = format!("pending-machine-{}_p0", capi.ns);
    rpc.delete_nodes(&id, vec![grpc_node(&fake, &fake)])
        .await
        .expect("DeleteNodes of a pending Machine");
    assert_eq!(replicas().await, 3);
    assert_eq!(capi.marked_machines().await, ids(&["m0", "m1", "p0"]));

    // Would go below min (3 - 2 < 2): FAILED_PRECONDITION, nothing marked, same replicas.
    expect_code(
        "DeleteNodes below min",
        rpc.delete_nodes(&id, vec![capi.grpc_node("m2"), capi.grpc_node("m3")])
            .await,
        Code::FailedPrecondition,
    );
    assert_eq!(capi.marked_machines().await, ids(&["m0", "m1", "p0"]));
    assert_eq!(replicas().await, 3);

    // A node known only by its machine annotations.
    rpc.delete_nodes(&id, vec![annotated_node(capi, "m2")])
        .await
        .expect("DeleteNodes by annotations");
    assert_eq!(replicas().await, 2);
    assert_eq!(capi.marked_machines().await, ids(&["m0", "m1", "m2", "p0"]));
    expect_code(
        "DeleteNodes at min",
        rpc.delete_nodes(&id, vec![capi.grpc_node("m3")]).await,
        Code::FailedPrecondition,
    );
    assert_eq!(replicas().await, 2);
    assert_eq!(capi.marked_machines().await, ids(&["m0", "m1", "m2", "p0"]));
    assert_eq!(rpc.target(&other_id).await.unwrap(), 1);
}

/// A Machine someone else marked (an admin, or the in-tree provider before a migration) was not
/// paid for by a decrement: DeleteNodes keeps the mark as its writer left it, decrements once and
/// records the payment of that mark in the ledger; a retry does not decrement again.
#[tokio::test]
async fn delete_nodes_of_a_machine_marked_by_someone_else_decrements_once() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(1, 10).replicas(3), false)
        .await;
    capi.create_machine(&capi.running("m0", md.clone()).annotation(
        &capi.delete_key(),
        "2026-11-22 03:00:00.000000000 +0000 UTC m=+1.0",
    ))
    .await;
    for m in ["m1", "m2"] {
        capi.create_machine(&capi.running(m, md.clone())).await;
    }
    let (_provider, mut rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachineDeployment, "md");

    rpc.delete_nodes(&id, vec![capi.grpc_node("m0")])
        .await
        .expect("DeleteNodes of a Machine marked by someone else");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);
    rpc.delete_nodes(&id, vec![capi.grpc_node("m0")])
        .await
        .expect("DeleteNodes m0, retried");
    assert_eq!(
        capi.replicas(Kind::MachineDeployment, "md").await,
        2,
        "a retry must not decrement again"
    );
    assert_eq!(capi.marked_machines().await, ids(&["m0"]));
    let m0 = capi.api(Kind::Machine).get("m0").await.expect("get m0");
    assert_eq!(
        m0.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(&capi.delete_key()))
            .map(String::as_str),
        Some("2026-11-22 03:00:00.000000000 +0000 UTC m=+1.0"),
        "the mark stays as its writer left it"
    );
    let md = capi
        .api(Kind::MachineDeployment)
        .get("md")
        .await
        .expect("get md");
    let ledger = md
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("capi-autoscaler-provider/removed"))
        .cloned()
        .unwrap_or_default();
    assert!(
        ledger.starts_with("m0@") && ledger.contains('#'),
        "the payment of m0's foreign mark: {ledger:?}"
    );
}

/// CA retries DeleteNodes for a node whose first call succeeded, but a scale-up raised replicas
/// before Cluster API removed the marked Machine: replicas now cover all three Machines, so CAPI
/// keeps the marked one (it deletes marked Machines first only when there are more Machines than
/// replicas). The raise absorbed the paid mark: the retry is refused, FAILED_PRECONDITION, and
/// writes nothing (invariant 3: a removal is paid at most once per mark).
#[tokio::test]
async fn delete_nodes_retry_after_an_increase_is_refused_and_pays_nothing_twice() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(1, 10).replicas(3), false)
        .await;
    for m in ["m0", "m1", "m2"] {
        capi.create_machine(&capi.running(m, md.clone())).await;
    }
    let (_provider, mut rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachineDeployment, "md");

    rpc.delete_nodes(&id, vec![capi.grpc_node("m0")])
        .await
        .expect("DeleteNodes m0");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);
    let paid = ledger_marks(capi, "md").await;
    assert_eq!(
        paid,
        current_marks(capi).await,
        "the decrement recorded the mark it paid for"
    );
    rpc.increase(&id, 1).await.expect("IncreaseSize +1");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    assert!(
        group_annotation(capi, "md", RESIZES).await.is_some(),
        "the raise is recorded on the object"
    );
    for attempt in ["retried", "retried again"] {
        let refused = rpc
            .delete_nodes(&id, vec![capi.grpc_node("m0")])
            .await
            .expect_err("a DeleteNodes of an absorbed mark is refused");
        assert_eq!(
            refused.code(),
            Code::FailedPrecondition,
            "{attempt}: {refused:?}"
        );
        assert!(
            refused.message().contains("absorbed"),
            "{attempt}: {}",
            refused.message()
        );
        assert_eq!(capi.marked_machines().await, ids(&["m0"]));
        assert_eq!(
            capi.replicas(Kind::MachineDeployment, "md").await,
            3,
            "{attempt}: the paid mark is not paid again"
        );
        assert_eq!(
            ledger_marks(capi, "md").await,
            paid,
            "{attempt}: nothing written"
        );
    }
    // Another node is refused too: Cluster API deletes marked Machines first (m0 before m1 by
    // name), so lowering replicas now would remove m0, not m1. Nothing written.
    let refused = rpc
        .delete_nodes(&id, vec![capi.grpc_node("m1")])
        .await
        .expect_err("DeleteNodes m1 beside the absorbed mark");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(
        refused
            .message()
            .contains("other Machines carry the delete-machine mark"),
        "{}",
        refused.message()
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    assert_eq!(capi.marked_machines().await, ids(&["m0"]));
    assert_eq!(ledger_marks(capi, "md").await, paid);
}

/// A mark of ours without its decrement (a crash between the two writes): DeleteNodes of that node
/// lowers replicas by one, never answers OK with nothing done; a retry then changes nothing.
#[tokio::test]
async fn delete_nodes_pays_a_leftover_mark() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(0, 10).replicas(2), false)
        .await;
    machine_marked_by_us(capi, "m0", md.clone(), 5).await;
    capi.create_machine(&capi.running("m1", md.clone())).await;
    let (_provider, mut rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachineDeployment, "md");

    for attempt in ["first", "retry"] {
        rpc.delete_nodes(&id, vec![capi.grpc_node("m0")])
            .await
            .unwrap_or_else(|e| panic!("DeleteNodes m0 ({attempt}): {e}"));
        assert_eq!(
            capi.replicas(Kind::MachineDeployment, "md").await,
            1,
            "{attempt}: the leftover mark is paid exactly once"
        );
        assert_eq!(capi.marked_machines().await, ids(&["m0"]));
    }
}

/// The repair: a mark of ours older than the grace period that no removal records is taken back
/// (with an Event on the Machine); a settled mark its decrement pays for and someone else's mark
/// stay.
#[tokio::test]
async fn orphan_marks_are_taken_back_after_the_grace_period() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    // 3 Machines, replicas 3, no record: a mark of ours no removal will settle.
    capi.create_deployment(&Scalable::md("md").bounds(0, 10).replicas(3), false)
        .await;
    machine_marked_by_us(capi, "orphan", md.clone(), 600).await;
    capi.create_machine(
        &capi
            .running("foreign", md.clone())
            .annotation(&capi.delete_key(), "yes"),
    )
    .await;
    capi.create_machine(&capi.running("plain", md.clone()))
        .await;
    // A second group whose mark is settled and paid (in its ledger; 2 Machines, replicas 1).
    let paid = Owner::Deployment("paid".into());
    let stamp = now_unix() - 600;
    capi.create_deployment(
        &Scalable::md("paid")
            .bounds(0, 10)
            .replicas(1)
            .annotation(LEDGER, &format!("paid-0@{stamp}")),
        false,
    )
    .await;
    machine_marked_by_us_at(capi, "paid-0", paid.clone(), stamp).await;
    capi.create_machine(&capi.running("paid-1", paid.clone()))
        .await;
    let (provider, _rpc) = provider_for_args(
        &env,
        &["--repair-interval", "200ms", "--mark-grace-period", "1s"],
    )
    .await;

    let key = capi.delete_key();
    let taken_back = |machine: &'static str| {
        let provider = &provider;
        let key = &key;
        async move {
            poll_until(
                &format!("the mark of {machine} is taken back"),
                Duration::from_secs(20),
                Duration::from_millis(100),
                || async {
                    let marked = capi.marked_machines().await;
                    if marked.contains(machine) {
                        Check::Wait(format!("marked {marked:?} ({key})"))
                    } else {
                        Check::Done(())
                    }
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
        }
    };
    taken_back("orphan").await;
    wait_event(capi, "orphan", "DeleteMarkRepaired").await;
    // Another orphan, taken back only in a later round of the repair, which has then gone over
    // the paid group again with the first orphan gone.
    machine_marked_by_us(capi, "orphan-2", md.clone(), 600).await;
    taken_back("orphan-2").await;
    assert_eq!(capi.marked_machines().await, ids(&["foreign", "paid-0"]));
    let settled = format!("paid-0@{stamp}");
    assert_eq!(ledger_marks(capi, "paid").await, ids(&[settled.as_str()]));
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    assert_eq!(capi.replicas(Kind::MachineDeployment, "paid").await, 1);
}

/// A scale-up that absorbs a paid mark's decrement makes the mark unpaid at once, however old it is;
/// Cluster API's controllers may still act on the lower count they cached and delete marked Machines
/// first. So the repair leaves the group alone until Cluster API has observed the raise (the
/// group's observedGeneration and its MachineSet's replicas), however long that takes, and only
/// then takes the mark back. No clock decides it.
#[tokio::test]
async fn a_mark_a_scale_up_absorbed_is_left_until_cluster_api_observed_the_raise() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(0, 10).replicas(3), false)
        .await;
    for name in ["absorbed", "a", "b"] {
        capi.create_machine(&capi.running(name, md.clone())).await;
    }
    let (provider, mut rpc) = provider_for_args(
        &env,
        &["--repair-interval", "100ms", "--mark-grace-period", "0s"],
    )
    .await;
    let id = capi.id(Kind::MachineDeployment, "md");

    rpc.delete_nodes(&id, vec![capi.grpc_node("absorbed")])
        .await
        .expect("DeleteNodes absorbed");
    rpc.increase(&id, 1).await.expect("IncreaseSize +1");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    stays_marked(capi, "absorbed", Duration::from_millis(1500)).await;

    capi.observe(Kind::MachineDeployment, "md").await;
    poll_until(
        "the absorbed mark is taken back once Cluster API observed the raise",
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            let marked = capi.marked_machines().await;
            if marked.is_empty() {
                Check::Done(())
            } else {
                Check::Wait(format!("marked {marked:?}"))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    wait_event(capi, "absorbed", "DeleteMarkRepaired").await;
}

/// Checks, every 100 ms for `window`, that `machine` keeps its delete mark (the repair runs every
/// 100 ms in these tests).
async fn stays_marked(capi: &Capi, machine: &str, window: Duration) {
    let until = Instant::now() + window;
    while Instant::now() < until {
        let marked = capi.marked_machines().await;
        assert!(
            marked.contains(machine),
            "{machine} lost its mark before Cluster API observed the change: marked {marked:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Two providers on one management cluster (CA replicas each with a sidecar, a rolling update): a
/// raise made through provider A protects the mark it absorbed from provider B's repair until
/// Cluster API has observed the raise, because both read that from the objects, not from A's memory
/// or either clock. Meanwhile B refuses a DeleteNodes of the node; once observed, B takes the mark
/// back (an Event on the Machine) and the node is a fresh removal again.
#[tokio::test]
async fn a_raise_through_one_provider_protects_the_absorbed_mark_from_another_providers_repair() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(0, 10).replicas(3), false)
        .await;
    for name in ["m0", "m1", "m2"] {
        capi.create_machine(&capi.running(name, md.clone())).await;
    }
    // A never repairs within the test; B repairs every 100 ms. B's refusal comes after its wait
    // (half of --request-timeout): a longer timeout keeps it an answer, not a deadline, on a busy
    // API server.
    let (provider_a, mut a) = provider_for_args(
        &env,
        &["--repair-interval", "1h", "--mark-grace-period", "1h"],
    )
    .await;
    let (provider_b, mut b) = provider_for_args(
        &env,
        &[
            "--repair-interval",
            "100ms",
            "--mark-grace-period",
            "0s",
            "--request-timeout",
            "8s",
        ],
    )
    .await;
    let id = capi.id(Kind::MachineDeployment, "md");
    let logs = || {
        format!(
            "provider A:\n{}\nprovider B:\n{}",
            provider_a.log_contents(),
            provider_b.log_contents()
        )
    };

    a.delete_nodes(&id, vec![capi.grpc_node("m0")])
        .await
        .expect("DeleteNodes m0 through A");
    let paid = current_marks(capi).await;
    assert_eq!(
        ledger_marks(capi, "md").await,
        paid,
        "A's decrement recorded the mark"
    );
    a.increase(&id, 1).await.expect("IncreaseSize +1 through A");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);

    let refused = b
        .delete_nodes(&id, vec![capi.grpc_node("m0")])
        .await
        .expect_err("B refuses a DeleteNodes of the absorbed mark");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(
        refused.message().contains("absorbed"),
        "{}",
        refused.message()
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);

    stays_marked(capi, "m0", Duration::from_millis(1500)).await;

    capi.observe(Kind::MachineDeployment, "md").await;
    poll_until(
        "B takes the absorbed mark back once Cluster API observed the raise",
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            let marked = capi.marked_machines().await;
            if marked.is_empty() {
                Check::Done(())
            } else {
                Check::Wait(format!("marked {marked:?}"))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    wait_event(capi, "m0", "DeleteMarkRepaired").await;

    // Taken back, it is a fresh removal: a new mark, dated after the paid one, paid once.
    b.delete_nodes(&id, vec![capi.grpc_node("m0")])
        .await
        .unwrap_or_else(|e| panic!("DeleteNodes m0 through B after the repair: {e}\n{}", logs()));
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);
    let remarked = current_marks(capi).await;
    assert_eq!(remarked.len(), 1);
    assert!(
        remarked.is_disjoint(&paid),
        "a new mark: {remarked:?} after {paid:?}"
    );
    assert!(ledger_marks(capi, "md").await.is_superset(&remarked));
    a.delete_nodes(&id, vec![capi.grpc_node("m0")])
        .await
        .expect("DeleteNodes m0 retried through A");
    assert_eq!(
        capi.replicas(Kind::MachineDeployment, "md").await,
        2,
        "A does not pay B's mark again"
    );
}

/// The retry across a raise, many times over: 12 Machines; at once, DeleteNodes for 8 of them (4
/// of those asked for twice, as CA retries a call whose answer it lost) and 5 IncreaseSize(+1),
/// each after a random delay. Whatever the interleaving, each node's removal is paid once:
/// replicas end at exactly 12 - removed + 5, the removed Machines (those with a call answered OK)
/// carry our mark, the ledger holds exactly their marks, and a call refused is FAILED_PRECONDITION
/// for a mark paid by the node's other call and absorbed by a raise, for another Machine's mark
/// the replicas do not remove (Cluster API would delete that one first), or, after a raise, for
/// replicas above the Machines (Cluster API would create Machines first; none does here). Odd rounds
/// send each call to one of two providers at random (CA replicas with their sidecars, a rolling
/// update). Every fourth round is staged: the raises wait for a removal answered OK and each retry
/// for its first call's answer and a raise after it, the interleaving where a retry finds its
/// removal paid and absorbed, which random delays alone reach in only some runs (a raise, reading
/// no list, mostly lands before any removal). `RETRY_ROUNDS` (20) and `RETRY_SEED` (printed)
/// replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_across_raises_pay_each_removal_once_in_any_interleaving() {
    const MACHINES: usize = 12;
    const REMOVED: usize = 8;
    const RETRIED: usize = 4;
    const RAISES: usize = 5;
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let rounds = std::env::var("RETRY_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20u64);
    let seed = std::env::var("RETRY_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x1923_2026_u64);
    eprintln!("RETRY_SEED={seed} RETRY_ROUNDS={rounds}");
    let (provider, rpc) = provider_for(&env).await;
    let (second, rpc_b) = provider_for(&env).await;
    let mut refusals = 0;
    let started = Instant::now();
    for round in 0..rounds {
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(round));
        let name = format!("md-{round}");
        let owner = Owner::Deployment(name.clone());
        capi.create_deployment(
            &Scalable::md(&name).bounds(1, 40).replicas(MACHINES as i64),
            false,
        )
        .await;
        let machines: Vec<String> = (0..MACHINES).map(|i| format!("r{round}-m{i}")).collect();
        for m in &machines {
            capi.create_machine(&capi.running(m, owner.clone())).await;
        }
        let id = capi.id(Kind::MachineDeployment, &name);
        wait_instances(&rpc, &id, MACHINES).await;
        wait_instances(&rpc_b, &id, MACHINES).await;
        let two = round % 2 == 1;

        let mut chosen = machines.clone();
        chosen.shuffle(&mut rng);
        chosen.truncate(REMOVED);
        let mut ops: Vec<Option<String>> = chosen.iter().cloned().map(Some).collect();
        ops.extend(chosen.iter().take(RETRIED).cloned().map(Some));
        ops.extend(std::iter::repeat_n(None, RAISES));
        ops.shuffle(&mut rng);
        let origin = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        // Staged rounds: the raises wait for a removal answered OK, each retry for its first call's
        // answer and a raise answered after it (each wait bounded).
        let staged = round % 4 == 0;
        let (removed, _) = watch::channel(0u32);
        let (raised, _) = watch::channel(0u32);
        let answered: BTreeMap<String, watch::Sender<bool>> = chosen
            .iter()
            .map(|m| (m.clone(), watch::channel(false).0))
            .collect();
        let mut asked = BTreeSet::new();
        for op in ops {
            let retry = op.as_ref().is_some_and(|m| !asked.insert(m.clone()));
            let delay = Duration::from_millis(rng.random_range(0..40));
            let mut rpc = if two && rng.random_bool(0.5) {
                rpc_b.clone()
            } else {
                rpc.clone()
            };
            let (id, capi) = (id.clone(), capi.clone());
            let (removed, raised) = (removed.clone(), raised.clone());
            let first = op.as_ref().and_then(|m| answered.get(m)).cloned();
            tasks.spawn(async move {
                let gate = Duration::from_secs(10);
                if staged {
                    match (&op, &first) {
                        (None, _) => {
                            let mut rx = removed.subscribe();
                            let _ = tokio::time::timeout(gate, rx.wait_for(|n| *n > 0)).await;
                        }
                        (Some(_), Some(first)) if retry => {
                            let mut own = first.subscribe();
                            let _ = tokio::time::timeout(gate, own.wait_for(|done| *done)).await;
                            let mut rx = raised.subscribe();
                            let before = *rx.borrow_and_update();
                            let _ = tokio::time::timeout(gate, rx.wait_for(|n| *n > before)).await;
                        }
                        _ => {}
                    }
                }
                tokio::time::sleep(delay).await;
                let start = origin.elapsed();
                let mut result = match &op {
                    Some(m) => rpc.delete_nodes(&id, vec![capi.grpc_node(m)]).await,
                    None => rpc.increase(&id, 1).await,
                };
                // The group's operations run one at a time: one queued past the call's deadline
                // is answered DEADLINE_EXCEEDED and goes on to completion. CA asks a removal again
                // in its next loops, and is answered by the removal under way (or what it did); a
                // raise it counts as made (its operation makes it, after the answer). A removal
                // queued so long that its time to mark ran out answers UNAVAILABLE: asked again too.
                let patience = Instant::now() + Duration::from_secs(120);
                while matches!(&result, Err(s) if s.code() == Code::DeadlineExceeded
                    || (s.code() == Code::Unavailable && op.is_some()))
                    && Instant::now() < patience
                {
                    result = match &op {
                        Some(m) => rpc.delete_nodes(&id, vec![capi.grpc_node(m)]).await,
                        None => Ok(()),
                    };
                }
                match (&op, &first) {
                    (None, _) => raised.send_modify(|n| *n += 1),
                    (Some(_), Some(first)) if !retry => {
                        first.send_replace(true);
                        if result.is_ok() {
                            removed.send_modify(|n| *n += 1);
                        }
                    }
                    _ => {}
                }
                (op, start, origin.elapsed(), result)
            });
        }
        let mut outcomes = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            outcomes.push(joined.expect("an RPC task"));
        }
        outcomes.sort_by_key(|(_, start, _, _)| *start);
        let report = outcomes
            .iter()
            .map(|(op, start, end, result)| {
                format!(
                    "{:>4}..{:>4} ms {}: {:?}",
                    start.as_millis(),
                    end.as_millis(),
                    op.as_ref()
                        .map_or("IncreaseSize(1)".to_string(), |m| format!(
                            "DeleteNodes({m})"
                        )),
                    result
                        .as_ref()
                        .map_err(|s| (s.code(), s.message().to_string()))
                )
            })
            .collect::<Vec<_>>()
            .join("\n  ");
        let fail = |what: String| -> ! {
            panic!(
                "RETRY_SEED={seed} round {round} ({} providers): {what}\n  {report}\n{}\n{}",
                if two { 2 } else { 1 },
                provider.log_contents(),
                second.log_contents()
            )
        };
        for (op, _, end, result) in &outcomes {
            let Err(status) = result else { continue };
            let Some(machine) = op else {
                fail(format!("IncreaseSize refused: {status:?}"));
            };
            let other_ok = outcomes
                .iter()
                .any(|(o, _, _, r)| o.as_ref() == Some(machine) && r.is_ok());
            let raise_before = outcomes
                .iter()
                .any(|(o, start, _, r)| o.is_none() && r.is_ok() && start < end);
            // Refused for its own mark, paid by its other call and absorbed by a raise; or for
            // another Machine's mark the replicas do not remove (absorbed by a raise, or another
            // provider's removal between its two writes): Cluster API would delete that one first.
            let absorbed = status.message().contains("absorbed") && other_ok && raise_before;
            let preempted = status.message().contains("other Machines");
            // Or, once raises put replicas above the Machines (no controller creates Machines
            // here), because a decrement would cancel one not created yet instead.
            let not_created = status
                .message()
                .contains("Cluster API creates Machines for them first")
                && raise_before;
            // Or its other call ran out of time waiting and is taking its mark back (or took it
            // back under this one: ABORTED, ask again).
            let taking_back = status.message().contains("is being taken back");
            let mark_lost = status.code() == Code::Aborted
                && status.message().contains("was removed or taken back");
            if !mark_lost
                && (status.code() != Code::FailedPrecondition
                    || !(absorbed || preempted || not_created || taking_back))
            {
                fail(format!(
                    "DeleteNodes({machine}) refused, not for a mark Cluster API deletes first: {status:?}"
                ));
            }
            if absorbed {
                refusals += 1;
            }
        }
        // The nodes with an accepted call are removed, each paid once; a refused one is not.
        let removed: BTreeSet<String> = outcomes
            .iter()
            .filter(|(_, _, _, r)| r.is_ok())
            .filter_map(|(op, _, _, _)| op.clone())
            .collect();
        // A raise answered DEADLINE_EXCEEDED may still be under way: its write is awaited.
        let want = (MACHINES - removed.len() + RAISES) as i64;
        let settled = poll_until(
            "replicas after every operation",
            Duration::from_secs(60),
            Duration::from_millis(50),
            || async {
                match capi.replicas(Kind::MachineDeployment, &name).await {
                    n if n == want => Check::Done(n),
                    n => Check::Wait(format!("replicas {n}")),
                }
            },
        )
        .await;
        let replicas = match settled {
            Ok(n) => n,
            Err(_) => capi.replicas(Kind::MachineDeployment, &name).await,
        };
        if replicas != want {
            fail(format!(
                "replicas {replicas}, not {} ({} removed)",
                MACHINES - removed.len() + RAISES,
                removed.len()
            ));
        }
        let marks = current_marks_of(capi, &name).await;
        let marked: BTreeSet<String> = marks
            .iter()
            .filter_map(|e| e.split('@').next().map(str::to_string))
            .collect();
        let want = removed;
        if marked != want || marks.len() != want.len() {
            fail(format!(
                "marked {marks:?}, not one mark of ours on each of {want:?}"
            ));
        }
        let all_marked = capi.marked_machines().await;
        if !all_marked.is_superset(&want) {
            fail(format!("marks of others: {all_marked:?}"));
        }
        let ledger = ledger_marks(capi, &name).await;
        if ledger != marks {
            fail(format!(
                "ledger {ledger:?}, not exactly the marks {marks:?}"
            ));
        }
    }
    eprintln!(
        "{rounds} rounds in {:.1}s; {refusals} DeleteNodes refused for an absorbed mark",
        started.elapsed().as_secs_f64()
    );
    assert!(
        refusals > 0,
        "no round retried a node after a raise absorbed its mark"
    );
}

/// Waits until the provider serves group `id` with `count` instances.
async fn wait_instances(rpc: &Rpc, id: &str, count: usize) {
    poll_until(
        &format!("{id} served with {count} instances"),
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            match rpc.clone().nodes(id).await {
                Ok(instances) if instances.len() == count => Check::Done(()),
                other => Check::Wait(format!("{:?}", other.map(|i| i.len()))),
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// A running Machine of `owner` carrying this provider's delete mark, written `age_secs` ago.
async fn machine_marked_by_us(capi: &Capi, name: &str, owner: Owner, age_secs: u64) {
    machine_marked_by_us_at(capi, name, owner, now_unix() - age_secs).await;
}

/// Machine `name` running under `owner`, carrying our mark stamped `stamp` (unix seconds).
async fn machine_marked_by_us_at(capi: &Capi, name: &str, owner: Owner, stamp: u64) {
    let mark = format!("unix {stamp} by capi-autoscaler-provider");
    capi.create_machine(
        &capi
            .running(name, owner)
            .annotation(&capi.delete_key(), &mark),
    )
    .await;
}

const LEDGER: &str = "capi-autoscaler-provider/removed";
const RESIZES: &str = "capi-autoscaler-provider/resizes";

/// An annotation of MachineDeployment `name`.
async fn group_annotation(capi: &Capi, name: &str, key: &str) -> Option<String> {
    capi.api(Kind::MachineDeployment)
        .get(name)
        .await
        .expect("get the MachineDeployment")
        .metadata
        .annotations
        .and_then(|a| a.get(key).cloned())
}

/// The Machine entries of MachineDeployment `name`'s ledger (`<machine>@<mark time>`).
async fn ledger_marks(capi: &Capi, name: &str) -> BTreeSet<String> {
    group_annotation(capi, name, LEDGER)
        .await
        .unwrap_or_default()
        .split(',')
        .filter(|e| !e.is_empty() && !e.starts_with("id:"))
        .map(str::to_string)
        .collect()
}

/// Every Machine of the namespace carrying our mark, as the ledger names a mark.
async fn current_marks(capi: &Capi) -> BTreeSet<String> {
    marks_of(capi, &Default::default()).await
}

/// Every Machine of MachineDeployment `name` carrying our mark, as the ledger names a mark.
async fn current_marks_of(capi: &Capi, name: &str) -> BTreeSet<String> {
    let selector = format!("{}={name}", capi.key("deployment-name"));
    marks_of(capi, &kube::api::ListParams::default().labels(&selector)).await
}

async fn marks_of(capi: &Capi, params: &kube::api::ListParams) -> BTreeSet<String> {
    let key = capi.delete_key();
    capi.api(Kind::Machine)
        .list(params)
        .await
        .expect("list Machines")
        .items
        .into_iter()
        .filter_map(|m| {
            let mark = m.metadata.annotations?.get(&key)?.clone();
            let time = mark
                .strip_prefix("unix ")?
                .strip_suffix(" by capi-autoscaler-provider")?
                .to_string();
            Some(format!("{}@{time}", m.metadata.name?))
        })
        .collect()
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Waits until Machine `name` has an Event with `reason`.
async fn wait_event(capi: &Capi, name: &str, reason: &str) {
    poll_until(
        &format!("Event {reason} on {name}"),
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            let reasons: Vec<String> = capi
                .events_about(name)
                .await
                .into_iter()
                .filter_map(|e| e.reason)
                .collect();
            if reasons.iter().any(|r| r == reason) {
                Check::Done(())
            } else {
                Check::Wait(format!("{reasons:?}"))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test]
async fn malformed_and_paused_resources_are_not_served_and_problems_become_events() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let ns = capi.ns.clone();
    capi.create_deployment(&Scalable::md("good").bounds(0, 3), false)
        .await;
    capi.create_machine(&capi.running("good-0", Owner::Deployment("good".into())))
        .await;
    capi.create(&Scalable::md("bad-max").raw_bounds(Some("1"), Some("lots")))
        .await;
    capi.create(&Scalable::ms("bad-min").raw_bounds(Some("-1"), Some("3")))
        .await;
    capi.create(&Scalable::mp("min-only").raw_bounds(Some("2"), None))
        .await;
    capi.create_deployment(
        &Scalable::md("spec-paused")
            .bounds(0, 3)
            .annotation("cluster.x-k8s.io/paused", ""),
        false,
    )
    .await;
    capi.create_machine(&capi.running("sp-0", Owner::Deployment("spec-paused".into())))
        .await;
    // Its own spec.paused pauses a MachineDeployment's rollouts only: Cluster API still scales it.
    capi.create_deployment(
        &Scalable::md("rollout-paused").bounds(0, 3).spec_paused(),
        false,
    )
    .await;
    capi.create(
        &Scalable::ms("paused-ms")
            .bounds(0, 3)
            .annotation("cluster.x-k8s.io/paused", ""),
    )
    .await;
    capi.create_machine(&capi.running("pm-0", Owner::MachineSet("paused-ms".into())))
        .await;
    capi.create(
        &Scalable::mp("paused-mp")
            .bounds(0, 3)
            .annotation("cluster.x-k8s.io/paused", "true"),
    )
    .await;
    let (_provider, mut rpc) = provider_for(&env).await;
    let good = capi.id(Kind::MachineDeployment, "good");
    let rollout_paused = capi.id(Kind::MachineDeployment, "rollout-paused");

    assert_eq!(rpc.ids_in(&ns).await, ids(&[&good, &rollout_paused]));
    assert_eq!(rpc.for_node(capi.grpc_node("good-0")).await.id, good);
    for machine in ["sp-0", "pm-0"] {
        assert_eq!(
            rpc.for_node(capi.grpc_node(machine)).await.id,
            "",
            "{machine}: paused group"
        );
    }
    for (kind, name) in [
        (Kind::MachineDeployment, "bad-max"),
        (Kind::MachineSet, "bad-min"),
        (Kind::MachinePool, "min-only"),
        (Kind::MachineDeployment, "spec-paused"),
    ] {
        let id = capi.id(kind, name);
        expect_code(
            &format!("TargetSize({id})"),
            rpc.target(&id).await,
            Code::NotFound,
        );
        expect_code(
            &format!("IncreaseSize({id})"),
            rpc.increase(&id, 1).await,
            Code::NotFound,
        );
    }

    // One Event per malformed object, naming the annotation.
    for (name, key) in [
        ("bad-max", capi.max_key()),
        ("bad-min", capi.min_key()),
        ("min-only", capi.max_key()),
    ] {
        support::infra::wait_problem_event(capi, name, &[key.as_str()]).await;
    }

    // Fixed: served from then on.
    capi.patch(
        Kind::MachineDeployment,
        "bad-max",
        serde_json::json!({"metadata": {"annotations": {capi.max_key(): "4"}}}),
    )
    .await;
    let fixed = capi.id(Kind::MachineDeployment, "bad-max");
    rpc.wait_ids(&ns, &ids(&[&good, &fixed, &rollout_paused]))
        .await;
    let group = rpc.group(&fixed).await.unwrap();
    assert_eq!((group.min_size, group.max_size), (1, 4));
    // Resumed: served too.
    capi.patch(
        Kind::MachineDeployment,
        "spec-paused",
        serde_json::json!({"metadata": {"annotations": {"cluster.x-k8s.io/paused": null}}}),
    )
    .await;
    let resumed = capi.id(Kind::MachineDeployment, "spec-paused");
    rpc.wait_ids(&ns, &ids(&[&good, &fixed, &resumed, &rollout_paused]))
        .await;
    assert_eq!(rpc.for_node(capi.grpc_node("sp-0")).await.id, resumed);
}

#[tokio::test]
async fn discovery_filters_select_groups_per_provider() {
    let _shared = API_QUIET.read().await;
    let one = env().await;
    let two = env().await;
    let (a, b) = (&one.capi, &two.capi);
    a.create_deployment(&Scalable::md("a").bounds(0, 3).cluster("c1"), false)
        .await;
    a.create_machine(&a.running("a-0", Owner::Deployment("a".into())))
        .await;
    b.create_deployment(
        &Scalable::md("b")
            .bounds(0, 3)
            .cluster("c2")
            .label("pool", "blue"),
        false,
    )
    .await;
    b.create_machine(&b.running("b-0", Owner::Deployment("b".into())))
        .await;
    b.create(
        &Scalable::md("c")
            .bounds(0, 3)
            .cluster("c2")
            .label("pool", "green"),
    )
    .await;
    b.create(
        &Scalable::md("d")
            .bounds(0, 3)
            .cluster("c3")
            .label("pool", "blue"),
    )
    .await;
    b.create(
        &Scalable::mp("e")
            .bounds(0, 3)
            .cluster("c2")
            .label("pool", "blue"),
    )
    .await;
    b.create(&Scalable::ms("f").bounds(0, 3).cluster("c2"))
        .await;

    let only_one = only_namespace(&a.ns);
    let first = start_provider(
        &["--node-group-auto-discovery", &only_one],
        one.cp.admin_kubeconfig(),
    )
    .await;
    let blue_c2 = format!("clusterapi:namespace={},clusterName=c2,pool=blue", b.ns);
    // A provider serves one Cluster (invariant 8): the spec for c3 selects nothing of it.
    let c2 = format!("{}/c2", b.ns);
    let second = start_provider(
        &[
            "--node-group-auto-discovery",
            &blue_c2,
            "--node-group-auto-discovery",
            "clusterapi:clusterName=c3",
            "--cluster",
            &c2,
        ],
        one.cp.admin_kubeconfig(),
    )
    .await;
    let mut rpc1 = Rpc::connect(&first).await;
    let mut rpc2 = Rpc::connect(&second).await;

    let all = |rpc: &mut Rpc| {
        let mut rpc = rpc.clone();
        async move {
            rpc.groups()
                .await
                .into_iter()
                .map(|g| g.id)
                .collect::<BTreeSet<_>>()
        }
    };
    let a_id = a.id(Kind::MachineDeployment, "a");
    let b_id = b.id(Kind::MachineDeployment, "b");
    assert_eq!(all(&mut rpc1).await, ids(&[&a_id]));
    assert_eq!(
        all(&mut rpc2).await,
        ids(&[&b_id, &b.id(Kind::MachinePool, "e")])
    );
    expect_code(
        "TargetSize of the other Cluster's group",
        rpc2.target(&b.id(Kind::MachineDeployment, "d")).await,
        Code::NotFound,
    );
    assert_eq!(rpc1.for_node(a.grpc_node("a-0")).await.id, a_id);
    assert_eq!(rpc1.for_node(b.grpc_node("b-0")).await.id, "");
    assert_eq!(rpc2.for_node(b.grpc_node("b-0")).await.id, b_id);
    assert_eq!(rpc2.for_node(a.grpc_node("a-0")).await.id, "");
    expect_code(
        "IncreaseSize outside the discovery filter",
        rpc1.increase(&b_id, 1).await,
        Code::NotFound,
    );
    expect_code(
        "TargetSize outside the discovery filter",
        rpc2.target(&a_id).await,
        Code::NotFound,
    );
    assert_eq!(b.replicas(Kind::MachineDeployment, "b").await, 1);
}

#[tokio::test]
async fn every_rpc_works_with_exactly_the_shipped_cluster_role() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let ns = capi.ns.clone();
    apply_shipped_cluster_role(&capi.client).await;
    let (_client, kubeconfig) = env.cp.restricted_identity(SHIPPED_ROLE).await;

    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(1, 5).replicas(4), false)
        .await;
    capi.create_machine(&capi.running("r0", md.clone())).await;
    capi.create_machine(&capi.running("r1", md.clone())).await;
    // As many Machines as replicas: DeleteNodes is refused while Cluster API has Machines to
    // create, and no controller creates them here.
    capi.create_machine(&capi.running("r2", md.clone())).await;
    capi.create_machine(&capi.pending("p0", md.clone())).await;
    capi.create(&Scalable::ms("ms").bounds(0, 3).replicas(1))
        .await;
    capi.create_machine(&capi.running("s0", Owner::MachineSet("ms".into())))
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
    capi.create(&Scalable::md("bad").raw_bounds(Some("0"), Some("x")))
        .await;

    // No discovery filter: cluster-wide watches, as deployed; the Cluster named, as deployed.
    let cluster = format!("{ns}/{}", support::capi::DEFAULT_CLUSTER);
    let provider = start_provider(
        &["--cluster", &cluster, NO_RAISE_HOLD[0], NO_RAISE_HOLD[1]],
        &kubeconfig,
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    let md_id = capi.id(Kind::MachineDeployment, "md");
    let ms_id = capi.id(Kind::MachineSet, "ms");
    let mp_id = capi.id(Kind::MachinePool, "mp");

    assert_eq!(rpc.ids_in(&ns).await, ids(&[&md_id, &ms_id, &mp_id]));
    assert_eq!(rpc.for_node(capi.grpc_node("r0")).await.id, md_id);
    assert_eq!(rpc.for_node(grpc_node(&pb, "mp-b")).await.id, mp_id);
    assert_eq!(rpc.instances(&md_id).await.len(), 4);
    assert_eq!(rpc.target(&md_id).await.unwrap(), 4);
    let mut client = rpc.client.clone();
    client
        .node_group_get_options(NodeGroupAutoscalingOptionsRequest {
            id: md_id.clone(),
            defaults: Some(NodeGroupAutoscalingOptions::default()),
        })
        .await
        .expect("NodeGroupGetOptions");
    match client
        .node_group_template_node_info(NodeGroupTemplateNodeInfoRequest { id: md_id.clone() })
        .await
    {
        Ok(r) => assert!(
            !r.into_inner().node_bytes.is_empty(),
            "OK must carry a node"
        ),
        Err(s) => assert_eq!(s.code(), Code::Unimplemented, "TemplateNodeInfo: {s:?}"),
    }
    client
        .gpu_label(GpuLabelRequest {})
        .await
        .expect("GPULabel");
    client
        .get_available_gpu_types(GetAvailableGpuTypesRequest {})
        .await
        .expect("GetAvailableGPUTypes");
    client.refresh(RefreshRequest {}).await.expect("Refresh");

    rpc.increase(&md_id, 1)
        .await
        .expect("IncreaseSize under the shipped role");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 5);
    // Cluster API takes in the raise and creates its Machine; DecreaseTargetSize pins it.
    capi.observe(Kind::MachineDeployment, "md").await;
    capi.create_machine(&capi.pending("p1", md.clone())).await;
    rpc.decrease(&md_id, -1)
        .await
        .expect("DecreaseTargetSize under the shipped role");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 4);
    rpc.delete_nodes(&md_id, vec![capi.grpc_node("r0")])
        .await
        .expect("DeleteNodes (MachineDeployment)");
    rpc.delete_nodes(&ms_id, vec![capi.grpc_node("s0")])
        .await
        .expect("DeleteNodes (MachineSet)");
    rpc.delete_nodes(&mp_id, vec![grpc_node(&pb, "mp-b")])
        .await
        .expect("DeleteNodes (MachinePool, no Machine)");
    rpc.delete_nodes(&mp_id, vec![capi.grpc_node("mp-a")])
        .await
        .expect("DeleteNodes (MachinePool Machine)");
    // The first pending Machine by name is pinned, as Cluster API ranks them.
    assert_eq!(
        capi.marked_machines().await,
        ids(&["mp-a", "p0", "r0", "s0"])
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    assert_eq!(capi.replicas(Kind::MachineSet, "ms").await, 0);
    assert_eq!(capi.replicas(Kind::MachinePool, "mp").await, 0);
    client.cleanup(CleanupRequest {}).await.expect("Cleanup");

    // Problems are reported as Events by the restricted identity.
    support::infra::wait_problem_event(capi, "bad", &[capi.max_key().as_str()]).await;
    let log = provider.log_contents();
    assert!(
        !log.to_lowercase().contains("forbidden"),
        "the shipped role lacks a permission:\n{log}"
    );
}

/// Many DeleteNodes (different nodes, and repeats of the same node) and IncreaseSize calls at once
/// on one group: replicas and marked Machines must agree exactly afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_scale_operations_keep_replicas_and_marks_consistent() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    const MACHINES: usize = 12;
    const MIN: i64 = 2;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(
        &Scalable::md("md").bounds(MIN, 40).replicas(MACHINES as i64),
        false,
    )
    .await;
    let names: Vec<String> = (0..MACHINES).map(|i| format!("m{i}")).collect();
    for name in &names {
        capi.create_machine(&capi.running(name, md.clone())).await;
    }
    let (_provider, rpc) = provider_for(&env).await;
    let id = capi.id(Kind::MachineDeployment, "md");

    enum Op {
        Delete(Vec<String>),
        Increase(i32),
    }
    let mut ops: Vec<Op> = Vec::new();
    for name in &names {
        ops.push(Op::Delete(vec![name.clone()]));
        ops.push(Op::Delete(vec![name.clone()]));
    }
    for pair in names.chunks(2).take(3) {
        ops.push(Op::Delete(pair.to_vec()));
    }
    for _ in 0..6 {
        ops.push(Op::Increase(1));
    }
    ops.push(Op::Increase(2));
    // A fixed shuffle (xorshift), so a failure can be replayed.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in (1..ops.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ops.swap(i, (seed % (i as u64 + 1)) as usize);
    }

    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for op in ops {
        let mut rpc = rpc.clone();
        let id = id.clone();
        let capi = capi.clone();
        tasks.spawn(async move {
            match op {
                Op::Delete(machines) => {
                    let nodes = machines.iter().map(|m| capi.grpc_node(m)).collect();
                    (
                        format!("DeleteNodes{machines:?}"),
                        0,
                        machines,
                        rpc.delete_nodes(&id, nodes).await,
                    )
                }
                Op::Increase(delta) => (
                    format!("IncreaseSize({delta})"),
                    delta,
                    Vec::new(),
                    rpc.increase(&id, delta).await,
                ),
            }
        });
    }
    let mut increased: i64 = 0;
    let mut deleted: BTreeSet<String> = BTreeSet::new();
    let mut outcomes: Vec<String> = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        let (what, delta, machines, result) = joined.expect("an RPC task");
        match &result {
            Ok(()) => {
                increased += delta as i64;
                deleted.extend(machines);
            }
            Err(s) if matches!(s.code(), Code::FailedPrecondition | Code::Aborted) => {}
            Err(s) => panic!("{what}: unexpected {s:?}"),
        }
        outcomes.push(format!("{what}: {:?}", result.map_err(|s| s.code())));
    }
    eprintln!("concurrent operations took {:?}", started.elapsed());

    let replicas = capi.replicas(Kind::MachineDeployment, "md").await;
    let marked = capi.marked_machines().await;
    let report = format!(
        "replicas {replicas}, marked {marked:?}, successful increases {increased}, outcomes:\n  {}",
        outcomes.join("\n  ")
    );
    assert!(replicas >= MIN, "replicas below min: {report}");
    assert!(
        deleted.is_subset(&marked),
        "every node of a successful DeleteNodes is marked: {report}"
    );
    // No CAPI runs here, so no Machine is created or deleted. Each node's removal is paid once,
    // whatever the interleaving (invariant 3): replicas are the Machines, less the nodes removed,
    // plus the raises; a raise after a removal absorbed its mark, it did not make it unpaid.
    assert_eq!(
        marked, deleted,
        "exactly the nodes of successful calls are marked: {report}"
    );
    assert_eq!(
        replicas,
        MACHINES as i64 - deleted.len() as i64 + increased,
        "replicas: {report}"
    );
    assert_eq!(
        ledger_marks(capi, "md").await,
        current_marks(capi).await,
        "the ledger names exactly the marks: {report}"
    );
    // CA's retries of every marked node change nothing: done, or refused while a raise absorbed
    // the group's paid marks.
    for round in ["retry", "second retry"] {
        for machine in &marked {
            let result = rpc
                .clone()
                .delete_nodes(&id, vec![capi.grpc_node(machine)])
                .await;
            if let Err(s) = &result {
                assert_eq!(
                    s.code(),
                    Code::FailedPrecondition,
                    "{round} of {machine}: {s:?}"
                );
                assert!(
                    s.message().contains("absorbed"),
                    "{round} of {machine}: {s:?}"
                );
            }
        }
        assert_eq!(
            capi.replicas(Kind::MachineDeployment, "md").await,
            replicas,
            "{round}: {report}"
        );
        assert_eq!(capi.marked_machines().await, marked, "{round}: {report}");
    }
    let final_replicas = capi.replicas(Kind::MachineDeployment, "md").await;
    assert_eq!(
        rpc.clone().target(&id).await.unwrap() as i64,
        final_replicas,
        "TargetSize after the operations: {report}"
    );
}

/// Read RPCs answer from memory: 2000 of them add no request to the apiserver's counters beyond
/// what the scrapes themselves add.
#[tokio::test]
async fn read_rpcs_make_no_api_requests() {
    let _alone = API_QUIET.write().await;
    let env = env().await;
    let capi = &env.capi;
    apply_shipped_cluster_role(&capi.client).await;
    let (_client, kubeconfig) = env.cp.restricted_identity(SHIPPED_ROLE).await;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(1, 5).replicas(3), false)
        .await;
    capi.create_machine(&capi.running("r0", md.clone())).await;
    capi.create_machine(&capi.running("r1", md.clone())).await;
    capi.create_machine(&capi.pending("p0", md.clone())).await;
    let discovery = only_namespace(&capi.ns);
    let provider = start_provider(&["--node-group-auto-discovery", &discovery], &kubeconfig).await;
    let mut rpc = Rpc::connect(&provider).await;
    let id = capi.id(Kind::MachineDeployment, "md");
    assert_eq!(rpc.ids_in(&capi.ns).await, ids(&[&id]));

    // The apiserver's own housekeeping is not ours to count: measured on an idle control plane, it
    // renews its identity lease every 10 s and fetches /openapi/v3 every 5 s.
    let ours = |series: &str| {
        label_of(series, "group") != Some("coordination.k8s.io")
            && label_of(series, "subresource") != Some("openapi/v3")
    };
    let total = |growth: &BTreeMap<String, f64>| -> f64 {
        growth.iter().filter(|(k, _)| ours(k)).map(|(_, v)| v).sum()
    };
    let admin = capi.client.clone();
    // What one scrape costs, once the provider has settled (its start-up Events, if any, are out).
    let cost = poll_until(
        "two back-to-back scrapes that cost the same",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            let admin = admin.clone();
            async move {
                let s1 = request_counts(&admin).await;
                let s2 = request_counts(&admin).await;
                let s3 = request_counts(&admin).await;
                let (c1, c2) = (total(&growth(&s1, &s2)), total(&growth(&s2, &s3)));
                if c1 == c2 {
                    Check::Done(c1)
                } else {
                    Check::Wait(format!("{c1} then {c2}: {:?}", growth(&s2, &s3)))
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    let before = request_counts(&admin).await;
    let started = Instant::now();
    let node = capi.grpc_node("r0");
    let mut client = rpc.client.clone();
    for i in 0..2000 {
        match i % 5 {
            0 => drop(rpc.groups().await),
            1 => assert_eq!(rpc.for_node(node.clone()).await.id, id),
            2 => assert_eq!(rpc.target(&id).await.unwrap(), 3),
            3 => assert_eq!(rpc.nodes(&id).await.unwrap().len(), 3),
            _ => drop(
                client
                    .node_group_get_options(NodeGroupAutoscalingOptionsRequest {
                        id: id.clone(),
                        defaults: Some(NodeGroupAutoscalingOptions::default()),
                    })
                    .await
                    .expect("NodeGroupGetOptions"),
            ),
        }
    }
    let elapsed = started.elapsed();
    let after = request_counts(&admin).await;
    let grew = growth(&before, &after);
    eprintln!("2000 read RPCs in {elapsed:?}; one scrape costs {cost} request(s); growth {grew:?}");
    assert!(
        total(&grew) <= cost,
        "read RPCs caused API requests (a scrape costs {cost}): {:?}",
        grew.iter().filter(|(k, _)| ours(k)).collect::<Vec<_>>()
    );

    // The counters do see the provider: a scale operation shows up.
    rpc.increase(&id, 1).await.expect("IncreaseSize");
    let later = request_counts(&admin).await;
    let scale_writes: f64 = growth(&after, &later)
        .iter()
        .filter(|(k, _)| {
            label_of(k, "resource") == Some("machinedeployments")
                && label_of(k, "verb") == Some("PATCH")
        })
        .map(|(_, v)| v)
        .sum();
    assert!(
        scale_writes >= 1.0,
        "the replica write is counted: {:?}",
        growth(&after, &later)
    );
}

/// The API goes away after the provider has listed: reads still answer from the snapshot, writes
/// fail UNAVAILABLE (in time for CA's 5 s deadline) and change nothing; when the API is back the
/// provider follows changes and writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_unreachable_reads_answer_from_the_snapshot_and_writes_are_unavailable() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(1, 5).replicas(3), false)
        .await;
    capi.create_machine(&capi.running("r0", md.clone())).await;
    capi.create_machine(&capi.running("r1", md.clone())).await;
    capi.create_machine(&capi.pending("p0", md.clone())).await;

    let apiserver = socket_addr_of(&env.cp.server);
    let any_port: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut proxy = TcpProxy::start(any_port, apiserver)
        .await
        .expect("start the proxy");
    let proxy_addr = proxy.addr;
    let kubeconfig = kubeconfig_with_server(
        env.cp.admin_kubeconfig(),
        &env.cp.server,
        &format!("https://{proxy_addr}"),
    );
    let discovery = only_namespace(&capi.ns);
    let _provider = start_provider(&["--node-group-auto-discovery", &discovery], &kubeconfig).await;
    let mut rpc = Rpc::connect(&_provider).await;
    let id = capi.id(Kind::MachineDeployment, "md");
    assert_eq!(rpc.ids_in(&capi.ns).await, ids(&[&id]));

    proxy.stop().await;

    let started = Instant::now();
    let message = expect_code(
        "IncreaseSize without API",
        rpc.increase(&id, 1).await,
        Code::Unavailable,
    );
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "IncreaseSize took {took:?}: {message}"
    );
    expect_code(
        "DeleteNodes without API",
        rpc.delete_nodes(&id, vec![capi.grpc_node("r0")]).await,
        Code::Unavailable,
    );
    // Reads, from the snapshot.
    let group = rpc.group(&id).await.expect("NodeGroups without API");
    assert_eq!((group.min_size, group.max_size), (1, 5));
    assert_eq!(rpc.target(&id).await.expect("TargetSize without API"), 3);
    assert_eq!(rpc.instances(&id).await.len(), 3);
    assert_eq!(rpc.for_node(capi.grpc_node("r1")).await.id, id);
    // Nothing changed.
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    assert!(capi.marked_machines().await.is_empty());

    // The API is back (same address): the provider follows a change and writes again.
    let restarted = TcpProxy::restart(proxy_addr, apiserver).await;
    let _proxy = restarted;
    capi.scale(Kind::MachineDeployment, "md", 2).await;
    // Generous: the watches reconnect with backoff.
    poll_until(
        "the provider sees replicas 2 after the API is back",
        Duration::from_secs(90),
        Duration::from_millis(200),
        || {
            let mut rpc = rpc.clone();
            let id = id.clone();
            async move {
                match rpc.target(&id).await {
                    Ok(2) => Check::Done(()),
                    other => Check::Wait(format!("{other:?}")),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    rpc.increase(&id, 1)
        .await
        .expect("IncreaseSize with the API back");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
}

/// grpc.health.v1 reports SERVING only once every watch has listed — for the CloudProvider service
/// and for the whole server (service ""), which is what a plain gRPC readiness probe asks.
#[tokio::test]
async fn health_is_not_serving_until_every_watch_has_listed() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule};
    use kube::api::{ObjectMeta, Patch, PatchParams};
    use tonic_health::pb::health_check_response::ServingStatus;

    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    capi.create_deployment(&Scalable::md("md").bounds(0, 3), false)
        .await;
    // The shipped role, except that Machines cannot be listed: their watch never lists.
    let role_name = format!("e2e-no-machine-list-{}", capi.ns);
    let rule = |groups: &[&str], resources: &[&str], verbs: &[&str]| PolicyRule {
        api_groups: Some(groups.iter().map(|s| s.to_string()).collect()),
        resources: Some(resources.iter().map(|s| s.to_string()).collect()),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let role = |machines_readable: bool| {
        let mut readable = vec!["machinedeployments", "machinesets", "machinepools"];
        if machines_readable {
            readable.push("machines");
        }
        ClusterRole {
            metadata: ObjectMeta {
                name: Some(role_name.clone()),
                ..Default::default()
            },
            rules: Some(vec![
                rule(&[CAPI_GROUP], &readable, &["get", "list", "watch"]),
                rule(
                    &[CAPI_GROUP],
                    &[
                        "machinedeployments",
                        "machinesets",
                        "machinepools",
                        "machines",
                    ],
                    &["patch"],
                ),
                rule(
                    &["infrastructure.cluster.x-k8s.io"],
                    &["*"],
                    &["get", "list", "watch"],
                ),
                rule(&["events.k8s.io"], &["events"], &["create", "patch"]),
            ]),
            ..Default::default()
        }
    };
    let roles: kube::Api<ClusterRole> = kube::Api::all(capi.client.clone());
    let apply = PatchParams::apply("e2e-nodegroups").force();
    roles
        .patch(&role_name, &apply, &Patch::Apply(&role(false)))
        .await
        .expect("apply the role");
    let (_client, kubeconfig) = env.cp.restricted_identity(&role_name).await;

    let discovery = only_namespace(&capi.ns);
    let mut provider = support::capi::spawn_provider(
        &["--node-group-auto-discovery", &discovery],
        &kubeconfig,
        &[],
    );
    // Up, and it has tried to list Machines and been refused.
    poll_until(
        "the provider answers health checks and has been refused Machines",
        Duration::from_secs(60),
        Duration::from_millis(50),
        || {
            let gone = provider.exited();
            let answered = provider.health("");
            let log = provider.log_contents();
            async move {
                if let Some(status) = gone {
                    return Check::Fatal(format!("the provider exited with {status}:\n{log}"));
                }
                if let Err(e) = answered.await {
                    return Check::Wait(e);
                }
                let refused = log
                    .lines()
                    .any(|l| l.contains("machines") && l.to_lowercase().contains("forbidden"));
                if refused {
                    Check::Done(())
                } else {
                    Check::Wait("no refused Machine list in the log yet".into())
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let readyz = provider.http_status("/readyz").await.expect("GET /readyz");
    assert_ne!(
        readyz, 200,
        "/readyz while the Machine watch has not listed"
    );
    for service in [support::capi::CLOUD_PROVIDER_SERVICE, ""] {
        let status = provider.health(service).await.expect("health check");
        assert_ne!(
            status,
            ServingStatus::Serving,
            "health of {service:?} while the Machine watch has not listed"
        );
    }

    // Allowed to list Machines: SERVING, and the group is there.
    roles
        .patch(&role_name, &apply, &Patch::Apply(&role(true)))
        .await
        .expect("widen the role");
    for service in [support::capi::CLOUD_PROVIDER_SERVICE, ""] {
        poll_until(
            &format!("health of {service:?} SERVING once Machines can be listed"),
            Duration::from_secs(90),
            Duration::from_millis(100),
            || {
                let status = provider.health(service);
                async move {
                    match status.await {
                        Ok(ServingStatus::Serving) => Check::Done(()),
                        other => Check::Wait(format!("{other:?}")),
                    }
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(
        provider.http_status("/readyz").await.expect("GET /readyz"),
        200
    );
    let mut rpc = Rpc::connect(&provider).await;
    assert_eq!(
        rpc.ids_in(&capi.ns).await,
        ids(&[&capi.id(Kind::MachineDeployment, "md")])
    );
}

/// Invariant 3 (docs/architecture.md): when the decrement fails after the Machine was marked (here: the provider may
/// mark Machines but not write the scalable resources), the mark is taken back, so no Machine is left
/// marked without its decrement, and replicas are unchanged.
#[tokio::test]
async fn a_failed_decrement_takes_the_delete_mark_back() {
    let _shared = API_QUIET.read().await;
    let env = env().await;
    let capi = &env.capi;
    let mut role = support::capi::shipped_cluster_role();
    let mut denied = 0;
    for rule in role.rules.iter_mut().flatten() {
        let scale = rule.verbs.iter().any(|v| v == "patch")
            && rule
                .resources
                .iter()
                .flatten()
                .all(|r| r.starts_with("machine") && r.ends_with('s') && r != "machines");
        if scale {
            rule.verbs.retain(|v| v != "patch");
            denied += 1;
        }
    }
    assert_eq!(
        denied, 1,
        "exactly one replica-write rule in deploy/base/rbac.yaml"
    );
    role.rules
        .get_or_insert_with(Vec::new)
        .retain(|r| !r.verbs.is_empty());
    let role_name = format!("no-scale-{}", capi.ns);
    support::capi::apply_cluster_role(&capi.client, &role_name, role).await;
    let (_client, kubeconfig) = env.cp.restricted_identity(&role_name).await;

    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(0, 5).replicas(2), false)
        .await;
    capi.create_machine(&capi.running("r0", md.clone())).await;
    capi.create_machine(&capi.running("r1", md)).await;
    let discovery = only_namespace(&capi.ns);
    let provider = start_provider(&["--node-group-auto-discovery", &discovery], &kubeconfig).await;
    let mut rpc = Rpc::connect(&provider).await;
    let id = capi.id(Kind::MachineDeployment, "md");

    expect_code(
        "DeleteNodes without permission to scale",
        rpc.delete_nodes(&id, vec![capi.grpc_node("r0")]).await,
        Code::PermissionDenied,
    );
    assert_eq!(
        capi.marked_machines().await,
        ids(&[]),
        "the mark was taken back"
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);
    assert_eq!(rpc.target(&id).await.unwrap(), 2);
}
