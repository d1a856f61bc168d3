//! Node groups in a renamed Cluster API group (`cluster.example.dev`, the shipped CRDs moved there),
//! with the provider told so by `CAPI_GROUP` (or `--capi-group`): annotations, labels and the
//! delete-machine mark all follow the group; objects of `cluster.x-k8s.io` are not looked at.

use crate::support;

use std::collections::HashMap;

use support::capi::ids;
use support::capi::{
    Capi, Kind, Owner, Rpc, Scalable, expect_code, grpc_node, start_provider_with_env,
};
use support::{CAPI_GROUP, Setup, start_provider};
use tonic::Code;

const SETUP: Setup = Setup::shipped().with_renamed_group();

/// The renamed group's objects and the upstream group's objects, in one fresh namespace.
async fn capis() -> (&'static support::ControlPlane, Capi, Capi) {
    let cp = support::control_plane(SETUP);
    assert_eq!(cp.renamed_group, "cluster.example.dev");
    let ns = cp.fresh_namespace().await;
    let client = cp.admin_client().await;
    (
        cp,
        Capi::new(client.clone(), &ns, &cp.renamed_group, "v1beta2"),
        Capi::new(client, &ns, CAPI_GROUP, "v1beta2"),
    )
}

#[tokio::test]
async fn capi_group_env_renames_the_group_and_every_key() {
    let (cp, renamed, upstream) = capis().await;
    let ns = renamed.ns.clone();
    let md = Owner::Deployment("md".into());
    renamed
        .create_deployment(&Scalable::md("md").bounds(1, 4).replicas(3), false)
        .await;
    for m in ["m0", "m1", "m2"] {
        renamed
            .create_machine(&renamed.running(m, md.clone()))
            .await;
    }
    // In the renamed group but annotated with the upstream keys: not a group.
    renamed
        .create(
            &Scalable::md("upstream-keys")
                .annotation(
                    "cluster.x-k8s.io/cluster-api-autoscaler-node-group-min-size",
                    "0",
                )
                .annotation(
                    "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size",
                    "3",
                ),
        )
        .await;
    // The paused annotation is not derived from the group (as upstream).
    renamed
        .create(
            &Scalable::md("paused")
                .bounds(0, 3)
                .annotation("cluster.x-k8s.io/paused", ""),
        )
        .await;
    // The same kind of object in cluster.x-k8s.io: not looked at.
    upstream
        .create_deployment(&Scalable::md("other-group").bounds(0, 3), false)
        .await;

    let discovery = format!("clusterapi:namespace={ns}");
    let provider = start_provider_with_env(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
        &[("CAPI_GROUP", cp.renamed_group.as_str())],
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    let id = renamed.id(Kind::MachineDeployment, "md");
    assert_eq!(rpc.ids_in(&ns).await, ids(&[&id]));
    let group = rpc.group(&id).await.unwrap();
    assert_eq!((group.min_size, group.max_size), (1, 4));
    assert_eq!(rpc.for_node(renamed.grpc_node("m0")).await.id, id);
    let mut by_annotations = grpc_node("", "node-without-provider-id");
    by_annotations.annotations = HashMap::from([
        ("cluster.example.dev/machine".to_string(), "m1".to_string()),
        (
            "cluster.example.dev/cluster-namespace".to_string(),
            ns.clone(),
        ),
    ]);
    assert_eq!(rpc.for_node(by_annotations).await.id, id);
    assert_eq!(rpc.instances(&id).await.len(), 3);

    rpc.increase(&id, 1).await.expect("IncreaseSize");
    assert_eq!(renamed.replicas(Kind::MachineDeployment, "md").await, 4);
    // The raise's Machine, as Cluster API creates it: DeleteNodes is refused while replicas exceed
    // the Machines (a decrement would cancel the one not created yet, not m0).
    renamed
        .create_machine(&renamed.running("m3", md.clone()))
        .await;
    rpc.delete_nodes(&id, vec![renamed.grpc_node("m0")])
        .await
        .expect("DeleteNodes m0");
    assert_eq!(renamed.replicas(Kind::MachineDeployment, "md").await, 3);
    let m0 = renamed.api(Kind::Machine).get("m0").await.expect("get m0");
    let annotations = m0.metadata.annotations.unwrap_or_default();
    assert!(
        annotations.contains_key("cluster.example.dev/delete-machine"),
        "m0 must carry cluster.example.dev/delete-machine: {annotations:?}"
    );
    assert!(
        !annotations.contains_key("cluster.x-k8s.io/delete-machine"),
        "m0 must not carry the upstream key: {annotations:?}"
    );
    assert_eq!(renamed.marked_machines().await, ids(&["m0"]));
    expect_code(
        "a cluster.x-k8s.io object is no group",
        rpc.target(&upstream.id(Kind::MachineDeployment, "other-group"))
            .await,
        Code::NotFound,
    );
    assert_eq!(
        upstream
            .replicas(Kind::MachineDeployment, "other-group")
            .await,
        1
    );
}

#[tokio::test]
async fn capi_group_flag_works_like_the_env() {
    let (cp, renamed, upstream) = capis().await;
    renamed.create(&Scalable::ms("ms").bounds(0, 2)).await;
    renamed.create(&Scalable::mp("mp").bounds(0, 2)).await;
    upstream.create(&Scalable::ms("ms").bounds(0, 2)).await;
    let discovery = format!("clusterapi:namespace={}", renamed.ns);
    let provider = start_provider(
        &[
            "--capi-group",
            &cp.renamed_group,
            "--node-group-auto-discovery",
            &discovery,
        ],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    // Both kinds exist in both groups with the same names: only the renamed ones are groups, and
    // the ids do not say which group (as upstream).
    assert_eq!(
        rpc.ids_in(&renamed.ns).await,
        ids(&[
            &renamed.id(Kind::MachineSet, "ms"),
            &renamed.id(Kind::MachinePool, "mp")
        ])
    );
    rpc.increase(&renamed.id(Kind::MachineSet, "ms"), 1)
        .await
        .expect("IncreaseSize");
    assert_eq!(renamed.replicas(Kind::MachineSet, "ms").await, 2);
    assert_eq!(
        upstream.replicas(Kind::MachineSet, "ms").await,
        1,
        "the cluster.x-k8s.io twin is untouched"
    );
}
