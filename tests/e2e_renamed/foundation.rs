//! Foundation: the real control plane with the Cluster API CRDs as shipped (v1beta2 storage) and the
//! renamed-group copy, real RBAC, and the provider's gRPC health service.

use crate::support;

use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule};
use kube::Api;
use kube::api::{DynamicObject, ListParams, ObjectMeta, PostParams};
use serde_json::json;
use support::capi::e2e_machine_deployment;
use support::{CAPI_GROUP, Setup, capi_resource, machine_deployments};
use tonic_health::pb::health_check_response::ServingStatus;

const SETUP: Setup = Setup::shipped().with_renamed_group();

/// A v1beta2 MachineDeployment with every field the v1beta2 schema requires.
fn machine_deployment_v1beta2(name: &str) -> serde_json::Value {
    e2e_machine_deployment(
        name,
        ("0", "3"),
        1,
        json!({
            "apiGroup": "infrastructure.cluster.x-k8s.io",
            "kind": "E2EMachineTemplate",
            "name": name,
        }),
    )
}

async fn create_md(
    api: &Api<DynamicObject>,
    ar: &kube::api::ApiResource,
    name: &str,
) -> DynamicObject {
    let object = DynamicObject::new(name, ar).data(machine_deployment_v1beta2(name));
    api.create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create MachineDeployment {name}: {e}"))
}

fn assert_md_round_trip(read: &DynamicObject, api_version: &str, name: &str) {
    let types = read
        .types
        .as_ref()
        .expect("apiVersion and kind in the answer");
    assert_eq!(types.api_version, api_version);
    assert_eq!(types.kind, "MachineDeployment");
    let spec = &read.data["spec"];
    assert_eq!(spec["clusterName"], "e2e");
    assert_eq!(spec["replicas"], 1);
    assert_eq!(
        spec["template"]["spec"]["infrastructureRef"],
        json!({"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "E2EMachineTemplate", "name": name}),
        "infrastructureRef must survive the v1beta2 schema unpruned"
    );
    assert_eq!(
        spec["template"]["spec"]["bootstrap"]["dataSecretName"],
        format!("{name}-bootstrap")
    );
    assert_eq!(
        read.metadata.annotations.as_ref().expect("annotations")["cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size"],
        "3"
    );
}

#[tokio::test]
async fn v1beta2_machine_deployment_round_trip() {
    let cp = support::control_plane(SETUP);
    let client = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let (api, ar) = machine_deployments(client, &ns, CAPI_GROUP, "v1beta2");

    let created = create_md(&api, &ar, "md-a").await;
    assert_md_round_trip(&created, "cluster.x-k8s.io/v1beta2", "md-a");
    let read = api
        .get("md-a")
        .await
        .expect("read the MachineDeployment back");
    assert_md_round_trip(&read, "cluster.x-k8s.io/v1beta2", "md-a");
    let listed = api.list(&ListParams::default()).await.expect("list");
    assert_eq!(listed.items.len(), 1);
}

#[tokio::test]
async fn v1beta2_schema_rejects_a_machine_deployment_without_required_fields() {
    let cp = support::control_plane(SETUP);
    let ns = cp.fresh_namespace().await;
    let (api, ar) = machine_deployments(cp.admin_client().await, &ns, CAPI_GROUP, "v1beta2");
    let mut body = machine_deployment_v1beta2("md-bad");
    body["spec"]["template"]["spec"]["infrastructureRef"]
        .as_object_mut()
        .expect("infrastructureRef object")
        .remove("apiGroup");
    let err = api
        .create(
            &PostParams::default(),
            &DynamicObject::new("md-bad", &ar).data(body),
        )
        .await
        .expect_err("the CRD schema must require infrastructureRef.apiGroup");
    match err {
        kube::Error::Api(status) => assert!(status.is_invalid(), "{status:?}"),
        other => panic!("expected 422 Invalid, got {other}"),
    }
}

#[tokio::test]
async fn machine_deployment_in_the_renamed_group() {
    let cp = support::control_plane(SETUP);
    assert_eq!(cp.renamed_group, "cluster.example.dev");
    let ns = cp.fresh_namespace().await;
    let client = cp.admin_client().await;
    let (api, renamed) = machine_deployments(client.clone(), &ns, &cp.renamed_group, "v1beta2");
    create_md(&api, &renamed, "md-renamed").await;
    let read = api.get("md-renamed").await.expect("read back");
    assert_md_round_trip(&read, "cluster.example.dev/v1beta2", "md-renamed");

    // The two groups are separate resources: nothing of it under cluster.x-k8s.io.
    let (upstream_api, _) = machine_deployments(client, &ns, CAPI_GROUP, "v1beta2");
    assert!(
        upstream_api
            .list(&ListParams::default())
            .await
            .expect("list")
            .items
            .is_empty()
    );
}

#[tokio::test]
async fn e2e_machine_template_serves_both_versions_with_status() {
    let cp = support::control_plane(SETUP);
    let ns = cp.fresh_namespace().await;
    let client = cp.admin_client().await;
    let group = "infrastructure.cluster.x-k8s.io";
    let v1 = capi_resource(
        group,
        "v1beta1",
        "E2EMachineTemplate",
        "e2emachinetemplates",
    );
    let v2 = capi_resource(
        group,
        "v1beta2",
        "E2EMachineTemplate",
        "e2emachinetemplates",
    );
    let api1: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &v1);
    let api2: Api<DynamicObject> = Api::namespaced_with(client, &ns, &v2);
    let tmpl = DynamicObject::new("tmpl", &v1).data(json!({"spec": {"template": {"spec": {}}}}));
    api1.create(&PostParams::default(), &tmpl)
        .await
        .expect("create");
    let status = json!({"status": {
        "capacity": {"cpu": "4", "memory": "8Gi"},
        "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux"},
    }});
    api1.patch_status(
        "tmpl",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&status),
    )
    .await
    .expect("patch status");
    let read = api2.get("tmpl").await.expect("read through v1beta2");
    assert_eq!(read.data["status"]["capacity"]["memory"], "8Gi");
    assert_eq!(read.data["status"]["nodeInfo"]["architecture"], "amd64");
}

#[tokio::test]
async fn restricted_identity_is_refused_outside_its_role() {
    let cp = support::control_plane(SETUP);
    let ns = cp.fresh_namespace().await;
    let admin = cp.admin_client().await;
    let role_name = "e2e-machinedeployments-read";
    let role = ClusterRole {
        metadata: ObjectMeta {
            name: Some(role_name.into()),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![CAPI_GROUP.into()]),
            resources: Some(vec!["machinedeployments".into()]),
            verbs: vec!["get".into(), "list".into()],
            ..Default::default()
        }]),
        ..Default::default()
    };
    Api::<ClusterRole>::all(admin)
        .create(&PostParams::default(), &role)
        .await
        .expect("create ClusterRole");
    let (client, kubeconfig) = cp.restricted_identity(role_name).await;
    assert!(kubeconfig.is_file());

    let md = capi_resource(
        CAPI_GROUP,
        "v1beta2",
        "MachineDeployment",
        "machinedeployments",
    );
    let machines = capi_resource(CAPI_GROUP, "v1beta2", "Machine", "machines");
    let md_api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &md);
    md_api
        .list(&ListParams::default())
        .await
        .expect("the role allows listing MachineDeployments");

    let forbidden = |what: &str, result: Result<(), kube::Error>| match result {
        Err(kube::Error::Api(status)) if status.code == 403 => {}
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    };
    let create = md_api
        .create(
            &PostParams::default(),
            &DynamicObject::new("md-x", &md).data(machine_deployment_v1beta2("md-x")),
        )
        .await
        .map(drop);
    forbidden("create a MachineDeployment", create);
    let machines_api: Api<DynamicObject> = Api::namespaced_with(client, &ns, &machines);
    let list = machines_api.list(&ListParams::default()).await.map(drop);
    forbidden("list Machines", list);
}

#[tokio::test]
async fn serve_answers_grpc_health() {
    let cp = support::control_plane(SETUP);
    // Limited to a namespace of its own: the other tests' groups belong to Clusters of their own, and
    // a provider serves one Cluster (invariant 8).
    let ns = cp.fresh_namespace().await;
    let only = format!("clusterapi:namespace={ns}");
    let mut provider = support::start_provider(
        &["--node-group-auto-discovery", &only],
        cp.admin_kubeconfig(),
    )
    .await;
    let endpoint = tonic::transport::Endpoint::from_shared(provider.endpoint()).expect("endpoint");
    let status = support::provider::health_status(endpoint, "")
        .await
        .expect("grpc.health.v1 Check");
    assert_eq!(status, ServingStatus::Serving);
    // The CloudProvider service itself turns SERVING once the provider's caches have listed.
    provider
        .wait_serving("clusterautoscaler.cloudprovider.v1.externalgrpc.CloudProvider")
        .await;
}
