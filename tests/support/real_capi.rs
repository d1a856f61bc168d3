//! The Cluster API objects of the real-CAPI scenarios (tests/real_capi/, tests/real_capi_faults.rs)
//! and the waits on what the real manager makes of them.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{ApiResource, DynamicObject, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

use super::procs::Check;
use super::standin;
use super::{CAPI_GROUP, capi_resource};

pub const MIN_SIZE: &str = "cluster.x-k8s.io/cluster-api-autoscaler-node-group-min-size";
pub const MAX_SIZE: &str = "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size";
pub const DELETE_MACHINE: &str = "cluster.x-k8s.io/delete-machine";
pub const DEPLOYMENT_NAME: &str = "cluster.x-k8s.io/deployment-name";
/// The MachineDeployment revision CAPI puts on each MachineSet it makes.
pub const REVISION: &str = "machinedeployment.clusters.x-k8s.io/revision";
pub const CAPACITY: &str = "capacity.cluster-autoscaler.kubernetes.io";
/// How long CAPI may take to bring Machines up, or to delete one (drain of an empty Node included).
pub const MACHINES: Duration = Duration::from_secs(60);

/// The `ApiResource` of Cluster API kind `kind` at `version`.
pub fn capi(version: &str, kind: &str) -> ApiResource {
    let plural = format!("{}s", kind.to_lowercase());
    capi_resource(CAPI_GROUP, version, kind, &plural)
}

/// The namespaced API of Cluster API kind `kind` at `version`.
pub fn api(client: &Client, ns: &str, version: &str, kind: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &capi(version, kind))
}

/// A v1beta2 MachineDeployment of `cluster` on the stand-in template `template`, with the autoscaler
/// bounds as annotations and no `spec.replicas` (CAPI's webhook defaults it).
pub fn machine_deployment(
    name: &str,
    cluster: &str,
    template: &str,
    min: &str,
    max: &str,
) -> Value {
    json!({
        "apiVersion": format!("{CAPI_GROUP}/v1beta2"),
        "kind": "MachineDeployment",
        "metadata": {"name": name, "annotations": {MIN_SIZE: min, MAX_SIZE: max}},
        "spec": {
            "clusterName": cluster,
            "selector": {"matchLabels": {}},
            "template": {"spec": {
                "clusterName": cluster,
                "version": standin::KUBERNETES_VERSION,
                "bootstrap": {"dataSecretName": "stand-in-bootstrap"},
                "infrastructureRef": standin::reference(standin::TEMPLATE_KIND, template),
            }},
        },
    })
}

pub async fn create(
    api: &Api<DynamicObject>,
    object: &Value,
) -> Result<DynamicObject, kube::Error> {
    let object: DynamicObject =
        serde_json::from_value(object.clone()).expect("a Kubernetes object");
    api.create(&PostParams::default(), &object).await
}

/// The name of an object (empty when it has none).
pub fn name_of(o: &DynamicObject) -> String {
    o.metadata.name.clone().unwrap_or_default()
}

/// The Machines of MachineDeployment `md` that are not being deleted, with their Nodes once CAPI
/// set the node ref, the Node is Ready, and CAPI synced its annotations onto it: `Done` with the
/// Machine names when there are exactly `want`.
pub async fn machines_with_nodes(
    client: &Client,
    ns: &str,
    md: &str,
    want: usize,
) -> Check<BTreeSet<String>> {
    let machines = match api(client, ns, "v1beta2", "Machine")
        .list(&ListParams::default().labels(&format!("{DEPLOYMENT_NAME}={md}")))
        .await
    {
        Ok(list) => list.items,
        Err(e) => return Check::Wait(e.to_string()),
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let mut names = BTreeSet::new();
    for m in machines
        .iter()
        .filter(|m| m.metadata.deletion_timestamp.is_none())
    {
        let name = name_of(m);
        let Some(node_name) = m.data["status"]["nodeRef"]["name"].as_str() else {
            return Check::Wait(format!("Machine {name} has no nodeRef yet"));
        };
        let node = match nodes.get_opt(node_name).await {
            Ok(Some(node)) => node,
            Ok(None) => {
                return Check::Fatal(format!("Machine {name} refers to no Node {node_name}"));
            }
            Err(e) => return Check::Wait(e.to_string()),
        };
        let provider_id = node.spec.as_ref().and_then(|s| s.provider_id.clone());
        if provider_id.as_deref() != m.data["spec"]["providerID"].as_str() {
            return Check::Fatal(format!(
                "Node {node_name} has providerID {provider_id:?}, Machine {name} {}",
                m.data["spec"]["providerID"]
            ));
        }
        let synced = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("cluster.x-k8s.io/machine"));
        if synced != Some(&name) {
            return Check::Wait(format!(
                "Node {node_name}: CAPI has not synced the machine annotation yet ({synced:?})"
            ));
        }
        names.insert(name);
    }
    if names.len() == want {
        Check::Done(names)
    } else {
        Check::Wait(format!("{} Machines with Nodes, want {want}", names.len()))
    }
}

/// MachineDeployment `md`'s `spec.replicas` (`None` while it cannot be read).
pub async fn replicas(client: &Client, ns: &str, md: &str) -> Result<i64, String> {
    api(client, ns, "v1beta2", "MachineDeployment")
        .get(md)
        .await
        .map_err(|e| e.to_string())?
        .data["spec"]["replicas"]
        .as_i64()
        .ok_or_else(|| format!("MachineDeployment {ns}/{md} has no spec.replicas"))
}

/// The Machines of MachineDeployment `md` by name, with whether each carries delete-machine.
pub async fn machines_of(
    client: &Client,
    ns: &str,
    md: &str,
) -> Result<Vec<(String, bool)>, String> {
    let machines = of_deployment(&api(client, ns, "v1beta2", "Machine"), md).await?;
    let marked = |m: &DynamicObject| {
        m.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(DELETE_MACHINE))
    };
    Ok(machines.iter().map(|m| (name_of(m), marked(m))).collect())
}

/// The objects of `api` that belong to MachineDeployment `md` (by CAPI's deployment-name label).
pub async fn of_deployment(
    api: &Api<DynamicObject>,
    md: &str,
) -> Result<Vec<DynamicObject>, String> {
    api.list(&ListParams::default().labels(&format!("{DEPLOYMENT_NAME}={md}")))
        .await
        .map(|list| list.items)
        .map_err(|e| e.to_string())
}
