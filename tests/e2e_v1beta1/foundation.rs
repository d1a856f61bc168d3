//! Foundation on the v1beta1-only Cluster API CRDs (v1beta1 is the storage version): objects written
//! and read as v1beta1, with v1beta1's reference shape (`infrastructureRef.apiVersion`).

use crate::support;

use kube::Api;
use kube::api::{DynamicObject, ListParams, PostParams};
use serde_json::json;
use support::capi::e2e_machine_deployment;
use support::{CAPI_GROUP, Setup, capi_resource, machine_deployments};

const SETUP: Setup = Setup::v1beta1();

fn machine_deployment_v1beta1(name: &str) -> serde_json::Value {
    e2e_machine_deployment(
        name,
        ("1", "5"),
        2,
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
            "kind": "E2EMachineTemplate",
            "name": name,
        }),
    )
}

#[tokio::test]
async fn v1beta1_machine_deployment_round_trip() {
    let cp = support::control_plane(SETUP);
    let ns = cp.fresh_namespace().await;
    let client = cp.admin_client().await;
    let (api, ar) = machine_deployments(client, &ns, CAPI_GROUP, "v1beta1");
    let object = DynamicObject::new("md-v1", &ar).data(machine_deployment_v1beta1("md-v1"));
    api.create(&PostParams::default(), &object)
        .await
        .expect("create a v1beta1 MachineDeployment");

    let read = api.get("md-v1").await.expect("read back");
    let types = read.types.as_ref().expect("apiVersion and kind");
    assert_eq!(types.api_version, "cluster.x-k8s.io/v1beta1");
    assert_eq!(read.data["spec"]["replicas"], 2);
    assert_eq!(
        read.data["spec"]["template"]["spec"]["infrastructureRef"],
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
            "kind": "E2EMachineTemplate",
            "name": "md-v1",
        })
    );
    assert_eq!(
        read.metadata.annotations.as_ref().expect("annotations")["cluster.x-k8s.io/cluster-api-autoscaler-node-group-min-size"],
        "1"
    );
}

#[tokio::test]
async fn v1beta2_is_not_served_on_the_v1beta1_set() {
    let cp = support::control_plane(SETUP);
    let ns = cp.fresh_namespace().await;
    let (api, _) = machine_deployments(cp.admin_client().await, &ns, CAPI_GROUP, "v1beta2");
    match api.list(&ListParams::default()).await {
        Err(kube::Error::Api(status)) if status.code == 404 => {}
        other => panic!("expected 404 for v1beta2 on the v1beta1-only CRDs, got {other:?}"),
    }
}

#[tokio::test]
async fn v1beta1_machine_with_node_ref_status() {
    let cp = support::control_plane(SETUP);
    let ns = cp.fresh_namespace().await;
    let ar = capi_resource(CAPI_GROUP, "v1beta1", "Machine", "machines");
    let api: Api<DynamicObject> = Api::namespaced_with(cp.admin_client().await, &ns, &ar);
    let machine = DynamicObject::new("m-1", &ar).data(json!({
        "spec": {
            "clusterName": "e2e",
            "bootstrap": { "dataSecretName": "m-1-bootstrap" },
            "infrastructureRef": {
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
                "kind": "E2EMachine",
                "name": "m-1",
            },
            "providerID": "e2e:///ns/m-1",
        },
    }));
    api.create(&PostParams::default(), &machine)
        .await
        .expect("create a v1beta1 Machine");
    let status = json!({"status": {"nodeRef": {"apiVersion": "v1", "kind": "Node", "name": "m-1"}, "phase": "Running"}});
    let patched = api
        .patch_status(
            "m-1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&status),
        )
        .await
        .expect("patch Machine status");
    assert_eq!(patched.data["status"]["nodeRef"]["name"], "m-1");
    assert_eq!(patched.data["spec"]["providerID"], "e2e:///ns/m-1");
}
