//! Scale from zero on the v1beta1-only Cluster API CRDs (v1beta1 storage): a v1beta1
//! MachineDeployment names its infrastructure template by `apiVersion`, and the template node comes
//! from that template's `status.capacity` and `status.nodeInfo`. The node is created in the
//! apiserver from the exact gRPC bytes, so the server validates it.

use crate::support;

use std::collections::BTreeMap;

use serde_json::json;
use support::capi::{Capi, INFRA_GROUP, Kind, Rpc, Scalable};
use support::infra::{
    self, create_node_from_proto, stored_capacity, template_status, wait_template,
};
use support::{CAPI_GROUP, Setup, start_provider};

const SETUP: Setup = Setup::v1beta1();

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[tokio::test]
async fn v1beta1_reference_by_api_version_gives_the_template_from_status_capacity() {
    let cp = support::control_plane(SETUP);
    let ns = cp.fresh_namespace().await;
    let capi = Capi::new(cp.admin_client().await, &ns, CAPI_GROUP, "v1beta1");
    capi.create_deployment(&Scalable::md("old").bounds(0, 4).replicas(0), false)
        .await;
    // A second group names the template's other served version: the provider reads the kind at
    // whatever version the API serves, the reference only picks the group.
    capi.create_deployment(&Scalable::md("newer").bounds(0, 4).replicas(0), false)
        .await;
    capi.patch(
        Kind::MachineDeployment,
        "newer",
        json!({"spec": {"template": {"spec": {"infrastructureRef": {
            "apiVersion": format!("{INFRA_GROUP}/v1beta2")
        }}}}}),
    )
    .await;
    let md = capi.api(Kind::MachineDeployment).get("old").await.unwrap();
    let reference = &md.data["spec"]["template"]["spec"]["infrastructureRef"];
    assert_eq!(
        reference["apiVersion"],
        json!(format!("{INFRA_GROUP}/v1beta1"))
    );
    assert!(reference.get("apiGroup").is_none(), "{reference}");
    infra::set_template_status(
        &capi.client,
        &ns,
        "old-tmpl",
        template_status(
            &[
                ("cpu", "2"),
                ("memory", "8Gi"),
                ("ephemeral-storage", "40Gi"),
            ],
            Some(("arm64", "linux")),
        ),
    )
    .await;
    infra::set_template_status(
        &capi.client,
        &ns,
        "newer-tmpl",
        template_status(&[("cpu", "500m"), ("memory", "1536Mi")], None),
    )
    .await;

    let discovery = format!("clusterapi:namespace={ns}");
    let provider = start_provider(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
    )
    .await;
    let rpc = Rpc::connect(&provider).await;

    let id = capi.id(Kind::MachineDeployment, "old");
    let capacity = map(&[
        ("cpu", "2"),
        ("memory", "8Gi"),
        ("ephemeral-storage", "40Gi"),
        ("pods", "110"),
    ]);
    let t = wait_template(&rpc, &id, |t| t.capacity() == capacity).await;
    assert_eq!(t.allocatable(), capacity);
    let labels = t.labels();
    assert_eq!(
        labels.get("kubernetes.io/arch").map(String::as_str),
        Some("arm64")
    );
    assert_eq!(
        labels.get("kubernetes.io/os").map(String::as_str),
        Some("linux")
    );
    assert_eq!(t.node_info(), ("arm64".to_string(), "linux".to_string()));
    assert_eq!(
        t.condition("Ready"),
        Some(("True".to_string(), "KubeletReady".to_string()))
    );
    let admin = cp.admin_client().await;
    let stored = create_node_from_proto(&admin, &t.response.node_bytes).await;
    assert_eq!(stored_capacity(&stored), capacity);

    let id = capi.id(Kind::MachineDeployment, "newer");
    let capacity = map(&[("cpu", "500m"), ("memory", "1536Mi"), ("pods", "110")]);
    let t = wait_template(&rpc, &id, |t| t.capacity() == capacity).await;
    // No status.nodeInfo: the default architecture.
    assert_eq!(t.node_info(), ("amd64".to_string(), "linux".to_string()));
    let stored = create_node_from_proto(&admin, &t.response.node_bytes).await;
    assert_eq!(stored_capacity(&stored), capacity);
}
