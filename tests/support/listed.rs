//! The objects of a `make bench` fleet (`benches/fleet/fleet.rs`) as the API server lists them: JSON
//! with the metadata the server adds (uid, resourceVersion, generation, creationTimestamp,
//! managedFields) and the status the controllers write. For measuring what the provider keeps of a
//! fleet without a cluster: the heap profile (`benches/heap.rs`) and the memory guard
//! (`tests/memory.rs`) feed these through the watches' own path into the cache.
//!
//! Shapes as in the fleet: G MachineDeployments (every tenth at zero) each with one MachineSet, N
//! Machines spread over the others, one Node per Machine and 5 % more in no group.

use capi_autoscaler_provider::cache::writer::{Prepared, Watched, prepare, reset};
use capi_autoscaler_provider::cache::{Index, InfraKind};
use capi_autoscaler_provider::capi::ScalableKind;
use capi_autoscaler_provider::object::{ApiObject, NodeObject};
use capi_autoscaler_provider::snapshot::Settings;
use serde_json::{Value, json};

pub const CLUSTER: &str = "bench";
const GROUP: &str = "cluster.x-k8s.io";
const INFRA_GROUP: &str = "infrastructure.cluster.x-k8s.io";
/// The kind of the fleet's one infrastructure template, which every group references.
const TEMPLATE_KIND: &str = "E2EMachineTemplate";
const FLEET_LABEL: &str = "bench.capi-autoscaler-provider.test/fleet";
const GROUP_LABEL: &str = "bench.capi-autoscaler-provider.test/group";

/// A fleet's objects by kind, each object as the bytes of its JSON.
pub struct Listed {
    pub deployments: Vec<Vec<u8>>,
    pub machine_sets: Vec<Vec<u8>>,
    pub machines: Vec<Vec<u8>>,
    pub nodes: Vec<Vec<u8>>,
    pub templates: Vec<Vec<u8>>,
}

impl Listed {
    /// Each kind's objects, named, in the order the provider's watches are started.
    pub fn kinds(&self) -> [(&'static str, Watched, &[Vec<u8>]); 5] {
        let template = InfraKind {
            api_group: INFRA_GROUP.into(),
            kind: TEMPLATE_KIND.into(),
        };
        [
            (
                "MachineDeployments",
                Watched::Scalable(ScalableKind::MachineDeployment),
                &self.deployments,
            ),
            (
                "MachineSets",
                Watched::Scalable(ScalableKind::MachineSet),
                &self.machine_sets,
            ),
            ("Machines", Watched::Machine, &self.machines),
            ("Nodes", Watched::Node, &self.nodes),
            (
                "infrastructure templates",
                Watched::Infra(template),
                &self.templates,
            ),
        ]
    }
}

/// `machines` Machines in `groups` MachineDeployments of namespace `ns`.
pub fn fleet(ns: &str, machines: usize, groups: usize) -> Listed {
    let groups = groups.max(1);
    let zero = |g: usize| groups >= 10 && g % 10 == 9;
    let filled: Vec<usize> = (0..groups).filter(|g| !zero(*g)).collect();
    let mut replicas = vec![0usize; groups];
    let mut members = Vec::with_capacity(machines);
    for i in 0..machines {
        let g = filled[i % filled.len()];
        replicas[g] += 1;
        members.push(g);
    }
    let mut rv = 1000u64;
    let mut next = || {
        rv += 1;
        rv.to_string()
    };
    let deployments = (0..groups)
        .map(|g| bytes(&deployment(ns, g, replicas[g], zero(g), &next())))
        .collect();
    let machine_sets = (0..groups)
        .map(|g| bytes(&machine_set(ns, g, replicas[g], &next())))
        .collect();
    let machines_json = members
        .iter()
        .enumerate()
        .map(|(i, g)| bytes(&machine(ns, i, *g, &next())))
        .collect();
    let mut nodes: Vec<Vec<u8>> = members
        .iter()
        .enumerate()
        .map(|(i, g)| bytes(&node(ns, &machine_name(ns, i), Some(*g), i, &next())))
        .collect();
    for j in 0..machines / 20 {
        let name = format!("{ns}-u{j:05}");
        nodes.push(bytes(&node(ns, &name, None, j, &next())));
    }
    Listed {
        deployments,
        machine_sets,
        machines: machines_json,
        nodes,
        templates: vec![bytes(&template(ns))],
    }
}

/// Takes `objects` of kind `what` into `index` as a watch's initial list does: each parsed and
/// prepared, then the kind's cache reset to them.
pub fn take(index: &mut Index, what: &Watched, objects: &[Vec<u8>]) {
    let keys = Settings::default().keys;
    let prepared: Vec<Prepared> = objects
        .iter()
        .map(|bytes| match what {
            Watched::Node => prepare(&keys, what, parse::<NodeObject>(bytes)),
            _ => prepare(&keys, what, parse::<ApiObject>(bytes)),
        })
        .collect();
    reset(index, what, prepared);
}

fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> T {
    serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("a listed object: {e}"))
}

fn bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

fn group_name(g: usize) -> String {
    format!("md-{g:05}")
}

fn machine_name(ns: &str, i: usize) -> String {
    format!("{ns}-m{i:06}")
}

fn uid(kind: &str, n: usize) -> String {
    format!("{:08x}-0000-4000-8000-{:012x}", kind.len(), n)
}

fn key(suffix: &str) -> String {
    format!("{GROUP}/{suffix}")
}

/// What the server adds to every object's metadata; `managedFields` as a field manager leaves them.
fn metadata(ns: &str, name: &str, kind: &str, n: usize, rv: &str) -> Value {
    json!({
        "name": name,
        "namespace": ns,
        "uid": uid(kind, n),
        "resourceVersion": rv,
        "generation": 1,
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "managedFields": [{
            "manager": "bench", "operation": "Update", "apiVersion": format!("{GROUP}/v1beta2"),
            "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {"f:labels": {".": {}}}, "f:spec": {".": {}, "f:clusterName": {}}},
        }],
    })
}

fn selector(md: &str, set: bool) -> Value {
    let mut labels = json!({key("cluster-name"): CLUSTER, key("deployment-name"): md});
    if set {
        labels[key("set-name")] = json!(format!("{md}-ms"));
    }
    labels
}

fn template_spec(ns: &str, md: &str, set: bool) -> Value {
    json!({
        "metadata": {"labels": selector(md, set)},
        "spec": {
            "clusterName": CLUSTER,
            "bootstrap": {"dataSecretName": format!("{ns}-bootstrap")},
            "infrastructureRef": {"apiGroup": INFRA_GROUP, "kind": TEMPLATE_KIND, "name": "bench-template"},
        },
    })
}

fn deployment(ns: &str, g: usize, replicas: usize, zero: bool, rv: &str) -> Value {
    let name = group_name(g);
    let mut meta = metadata(ns, &name, "MachineDeployment", g, rv);
    meta["labels"] = json!({key("cluster-name"): CLUSTER});
    meta["annotations"] = json!({
        key("cluster-api-autoscaler-node-group-min-size"): if zero { "0" } else { "1" },
        key("cluster-api-autoscaler-node-group-max-size"): "1000",
        "capacity.cluster-autoscaler.kubernetes.io/cpu": "4",
        "capacity.cluster-autoscaler.kubernetes.io/memory": "16Gi",
        "capacity.cluster-autoscaler.kubernetes.io/maxPods": "110",
        "capacity.cluster-autoscaler.kubernetes.io/labels": format!("e2e-scenario={ns},{GROUP_LABEL}={name}"),
    });
    json!({
        "apiVersion": format!("{GROUP}/v1beta2"), "kind": "MachineDeployment", "metadata": meta,
        "spec": {
            "clusterName": CLUSTER, "replicas": replicas,
            "selector": {"matchLabels": selector(&name, false)},
            "template": template_spec(ns, &name, false),
        },
        "status": {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas, "observedGeneration": 1},
    })
}

fn machine_set(ns: &str, g: usize, replicas: usize, rv: &str) -> Value {
    let md = group_name(g);
    let name = format!("{md}-ms");
    let mut meta = metadata(ns, &name, "MachineSet", g, rv);
    meta["labels"] = selector(&md, false);
    meta["annotations"] = json!({"machinedeployment.clusters.x-k8s.io/revision": "1"});
    meta["ownerReferences"] = json!([{
        "apiVersion": format!("{GROUP}/v1beta2"), "kind": "MachineDeployment", "name": md,
        "uid": uid("MachineDeployment", g), "controller": true,
    }]);
    json!({
        "apiVersion": format!("{GROUP}/v1beta2"), "kind": "MachineSet", "metadata": meta,
        "spec": {
            "clusterName": CLUSTER, "replicas": replicas,
            "selector": {"matchLabels": selector(&md, true)},
            "template": template_spec(ns, &md, true),
        },
        "status": {"replicas": replicas, "readyReplicas": replicas, "observedGeneration": 1},
    })
}

fn machine(ns: &str, i: usize, g: usize, rv: &str) -> Value {
    let md = group_name(g);
    let name = machine_name(ns, i);
    let mut meta = metadata(ns, &name, "Machine", i, rv);
    meta["labels"] = selector(&md, true);
    meta["ownerReferences"] = json!([{
        "apiVersion": format!("{GROUP}/v1beta2"), "kind": "MachineSet", "name": format!("{md}-ms"),
        "uid": uid("MachineSet", g), "controller": true,
    }]);
    json!({
        "apiVersion": format!("{GROUP}/v1beta2"), "kind": "Machine", "metadata": meta,
        "spec": {
            "clusterName": CLUSTER,
            "providerID": format!("bench:///{ns}/{name}"),
            "bootstrap": {"dataSecretName": format!("{ns}-bootstrap")},
            "infrastructureRef": {"apiGroup": INFRA_GROUP, "kind": "E2EMachine", "name": name},
        },
        "status": {
            "phase": "Running", "nodeRef": {"name": name},
            "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        },
    })
}

fn node(ns: &str, name: &str, group: Option<usize>, n: usize, rv: &str) -> Value {
    let mut labels = json!({
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": "bench-4x16",
        "topology.kubernetes.io/zone": format!("zone-{}", n % 3),
        FLEET_LABEL: ns,
    });
    let mut annotations = json!({});
    if let Some(g) = group {
        labels[GROUP_LABEL] = json!(group_name(g));
        annotations = json!({
            key("machine"): name,
            key("cluster-namespace"): ns,
            key("cluster-name"): CLUSTER,
            key("owner-kind"): "MachineSet",
            key("owner-name"): format!("{}-ms", group_name(g)),
        });
    }
    let capacity = json!({"cpu": "4", "memory": "16Gi", "pods": "110"});
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name, "uid": uid("Node", n), "resourceVersion": rv,
            "creationTimestamp": "2026-01-01T00:00:00Z", "labels": labels, "annotations": annotations,
        },
        "spec": {"providerID": format!("bench:///{ns}/{name}")},
        "status": {
            "capacity": capacity, "allocatable": capacity,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            "addresses": [{"type": "Hostname", "address": name}],
            "nodeInfo": {"osImage": "bench", "kubeletVersion": "v1.36.2", "operatingSystem": "linux", "architecture": "amd64"},
        },
    })
}

fn template(ns: &str) -> Value {
    json!({
        "apiVersion": format!("{INFRA_GROUP}/v1beta1"), "kind": TEMPLATE_KIND,
        "metadata": metadata(ns, "bench-template", TEMPLATE_KIND, 0, "1"),
        "spec": {"template": {"spec": {}}},
        "status": {"capacity": {"cpu": "4", "memory": "16Gi"}, "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux"}},
    })
}
