//! Workload pods for the end-to-end scenarios: what cluster-autoscaler scales for.
//!
//! Pods are owned by a real ReplicaSet object (nothing reconciles it: no controller-manager runs),
//! because CA refuses to drain pods without a controller. They have `terminationGracePeriodSeconds:
//! 0`, so an eviction deletes them at once although no kubelet runs. Every pod selects the label
//! [`SCENARIO_LABEL`] `=<namespace>`, which only the node groups of its own scenario give their
//! Nodes (see [`scenario_labels`]): scenarios sharing a control plane never scale for each other.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use super::procs::{Check, poll_until};

/// The Node label that ties Nodes of a scenario's groups to the scenario's pods.
pub const SCENARIO_LABEL: &str = "e2e-scenario";
/// The ReplicaSet every workload pod of a namespace belongs to.
pub const OWNER: &str = "workload";

/// The `capacity.cluster-autoscaler.kubernetes.io/labels` value that puts [`SCENARIO_LABEL`] on
/// the template and on every Node of a group in namespace `ns` (plus `extra`, `k=v` pairs).
pub fn scenario_labels(ns: &str, extra: &[&str]) -> String {
    let mut pairs = vec![format!("{SCENARIO_LABEL}={ns}")];
    pairs.extend(extra.iter().map(|s| s.to_string()));
    pairs.join(",")
}

/// A pod to create.
#[derive(Clone, Debug)]
pub struct PodSpec {
    pub name: String,
    pub cpu: String,
    pub memory: String,
    /// More node selector terms besides the scenario label.
    pub selector: BTreeMap<String, String>,
    /// `key=value:Effect` tolerations (`Equal`).
    pub tolerations: Vec<(String, String, String)>,
    /// Pods with the same `anti` value repel each other per hostname.
    pub anti_affinity: Option<String>,
}

impl PodSpec {
    pub fn new(name: &str, cpu: &str, memory: &str) -> PodSpec {
        PodSpec {
            name: name.into(),
            cpu: cpu.into(),
            memory: memory.into(),
            selector: BTreeMap::new(),
            tolerations: Vec::new(),
            anti_affinity: None,
        }
    }
    pub fn select(mut self, key: &str, value: &str) -> Self {
        self.selector.insert(key.into(), value.into());
        self
    }
    pub fn tolerate(mut self, key: &str, value: &str, effect: &str) -> Self {
        self.tolerations
            .push((key.into(), value.into(), effect.into()));
        self
    }
    /// One pod per Node among the pods with the same `group`.
    pub fn spread(mut self, group: &str) -> Self {
        self.anti_affinity = Some(group.into());
        self
    }
}

/// Creates the namespace's workload ReplicaSet (once) and returns its uid.
async fn owner_uid(client: &Client, ns: &str) -> String {
    let api: Api<ReplicaSet> = Api::namespaced(client.clone(), ns);
    if let Ok(Some(rs)) = api.get_opt(OWNER).await {
        return rs.metadata.uid.unwrap_or_default();
    }
    let rs: ReplicaSet = serde_json::from_value(json!({
        "metadata": {"name": OWNER},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": OWNER}},
            "template": {
                "metadata": {"labels": {"app": OWNER}},
                "spec": {"containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}]},
            },
        },
    }))
    .expect("a ReplicaSet");
    match api.create(&PostParams::default(), &rs).await {
        Ok(rs) => rs.metadata.uid.unwrap_or_default(),
        Err(kube::Error::Api(s)) if s.code == 409 => api
            .get(OWNER)
            .await
            .ok()
            .and_then(|rs| rs.metadata.uid)
            .unwrap_or_default(),
        Err(e) => panic!("create ReplicaSet {ns}/{OWNER}: {e}"),
    }
}

/// The spec of a pod of `cpu` and 512Mi on the scenario's Nodes (on Node `node` when given) with
/// a 30 s grace period, so that an eviction leaves it Terminating until a kubelet (the stand-in)
/// ends it.
pub fn graceful_spec(ns: &str, cpu: &str, node: Option<&str>) -> serde_json::Value {
    let mut spec = json!({
        "terminationGracePeriodSeconds": 30,
        "nodeSelector": {SCENARIO_LABEL: ns},
        "containers": [{
            "name": "app",
            "image": "registry.k8s.io/pause:3.10",
            "resources": {"requests": {"cpu": cpu, "memory": "512Mi"}},
        }],
    });
    if let Some(node) = node {
        spec["nodeName"] = json!(node);
    }
    spec
}

/// Creates pod `spec` in `ns`, owned by the namespace's workload ReplicaSet and pinned to the
/// scenario's Nodes. The real kube-scheduler binds it, or marks it unschedulable for CA.
pub async fn create_pod(client: &Client, ns: &str, spec: &PodSpec) -> Pod {
    create(client, ns, spec, None).await
}

/// [`create_pod`] already bound to Node `node` (placed by the test, not the scheduler).
pub async fn create_bound_pod(client: &Client, ns: &str, spec: &PodSpec, node: &str) -> Pod {
    create(client, ns, spec, Some(node)).await
}

async fn create(client: &Client, ns: &str, spec: &PodSpec, node: Option<&str>) -> Pod {
    let uid = owner_uid(client, ns).await;
    let mut selector = spec.selector.clone();
    selector.insert(SCENARIO_LABEL.into(), ns.into());
    let tolerations: Vec<_> = spec
        .tolerations
        .iter()
        .map(|(k, v, e)| json!({"key": k, "operator": "Equal", "value": v, "effect": e}))
        .collect();
    let mut labels = json!({"app": OWNER});
    let mut pod_spec = json!({
        "terminationGracePeriodSeconds": 0,
        "nodeSelector": selector,
        "tolerations": tolerations,
        "containers": [{
            "name": "app",
            "image": "registry.k8s.io/pause:3.10",
            "resources": {"requests": {"cpu": spec.cpu, "memory": spec.memory}},
        }],
    });
    if let Some(node) = node {
        pod_spec["nodeName"] = json!(node);
    }
    if let Some(group) = &spec.anti_affinity {
        labels["spread"] = json!(group);
        pod_spec["affinity"] = json!({"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {"spread": group}},
            "topologyKey": "kubernetes.io/hostname",
        }]}});
    }
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {
            "name": spec.name,
            "labels": labels,
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": OWNER, "uid": uid,
                "controller": true, "blockOwnerDeletion": true,
            }],
        },
        "spec": pod_spec,
    }))
    .expect("a Pod");
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("create pod {ns}/{}: {e}", spec.name))
}

/// Deletes pod `name` at once (grace period 0).
pub async fn delete_pod(client: &Client, ns: &str, name: &str) {
    match Api::<Pod>::namespaced(client.clone(), ns)
        .delete(name, &DeleteParams::default().grace_period(0))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => panic!("delete pod {ns}/{name}: {e}"),
    }
}

/// The Node pod `name` is bound to, if any (`None` also when the pod is gone).
pub async fn node_of(client: &Client, ns: &str, name: &str) -> Option<String> {
    Api::<Pod>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|p| p.spec?.node_name)
}

/// Waits until pod `name` is bound to a Node and returns the Node's name.
pub async fn wait_bound(client: &Client, ns: &str, name: &str, timeout: Duration) -> String {
    poll_until(
        &format!("pod {ns}/{name} bound to a Node"),
        timeout,
        Duration::from_millis(100),
        || async move {
            match node_of(client, ns, name).await {
                Some(node) => Check::Done(node),
                None => Check::Wait("not bound".into()),
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Whether pod `name` still exists.
pub async fn pod_exists(client: &Client, ns: &str, name: &str) -> bool {
    matches!(
        Api::<Pod>::namespaced(client.clone(), ns)
            .get_opt(name)
            .await,
        Ok(Some(_))
    )
}

/// The names of the Nodes that carry the scenario label of `ns`.
pub async fn scenario_nodes(client: &Client, ns: &str) -> Result<Vec<String>, String> {
    Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(&format!("{SCENARIO_LABEL}={ns}")))
        .await
        .map(|l| {
            l.items
                .into_iter()
                .filter_map(|n| n.metadata.name)
                .collect()
        })
        .map_err(|e| format!("list the Nodes of {ns}: {e}"))
}

/// The reasons of the Events (core and events.k8s.io share storage) about pod `name`.
pub async fn pod_event_reasons(client: &Client, ns: &str, name: &str) -> Vec<String> {
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .map(|l| {
            l.items
                .into_iter()
                .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
                .filter_map(|e| e.reason)
                .collect()
        })
        .unwrap_or_default()
}
