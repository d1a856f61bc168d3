//! The typed views' JSON parsers (`src/capi/parse.rs`): MachineDeployment, MachineSet and MachinePool
//! (`ScalableResource::from_json`), `Machine::from_json`, `InfraTemplate::from_json`,
//! `ClusterTopology::from_json` and `Node::from_json` (workload-cluster Nodes), on JSON text (seeded with
//! tests/fixtures/objects) and on JSON values built from the keys and strings these objects have.
//!
//! Contract: no panic, the same answer twice; every error (also a kept `infrastructureRef` error) has a
//! field path under a top-level field of the object (`metadata.…`, `spec.…`, `status.…`, `apiVersion`,
//! `kind`) or `object` when the value is not an object, and a message, shown as `field: message`; what is
//! read is what the object says (name, kind, no last-applied copy, providerID never empty).
#![no_main]

use capi_autoscaler_provider::capi::{
    ClusterTopology, InfraTemplate, Keys, Machine, Node, ParseError, ScalableKind, ScalableResource,
};
use capi_autoscaler_provider::template::NODE_LABELS_COPIED;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value, json};

const ROOTS: [&str; 6] = ["object", "apiVersion", "kind", "metadata", "spec", "status"];
const KEYS: &[&str] = &[
    "apiVersion",
    "kind",
    "metadata",
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "labels",
    "annotations",
    "ownerReferences",
    "deletionTimestamp",
    "spec",
    "status",
    "replicas",
    "paused",
    "clusterName",
    "template",
    "infrastructureRef",
    "apiGroup",
    "taints",
    "key",
    "value",
    "effect",
    "failureDomain",
    "providerIDList",
    "providerID",
    "nodeRef",
    "phase",
    "failureReason",
    "failureMessage",
    "deprecated",
    "v1beta1",
    "v1beta2",
    "conditions",
    "type",
    "reason",
    "message",
    "capacity",
    "nodeInfo",
    "managedFields",
    "architecture",
    "operatingSystem",
    "topology",
    "workers",
    "machineDeployments",
    "machinePools",
    "controller",
    "cluster.x-k8s.io/paused",
    "cluster.x-k8s.io/cluster-name",
    "topology.cluster.x-k8s.io/owned",
    "topology.cluster.x-k8s.io/deployment-name",
    "kubectl.kubernetes.io/last-applied-configuration",
];
const STRINGS: &[&str] = &[
    "",
    "x",
    "True",
    "False",
    "Failed",
    "Running",
    "RollingOut",
    "InfrastructureReady",
    "ObjectDeleted",
    "MachineDeployment",
    "MachineSet",
    "MachinePool",
    "Machine",
    "Cluster",
    "cluster.x-k8s.io/v1beta2",
    "cluster.x-k8s.io/v1beta1",
    "infrastructure.cluster.x-k8s.io",
    "g/v",
    "a/b/c",
    "/",
    "v1",
    "Node",
    "2026-01-01T00:00:00Z",
    "aws:///i-1",
    "4",
    "16Gi",
    "💥",
];

fn value(u: &mut Unstructured, depth: usize) -> Result<Value> {
    let choice = u.int_in_range(0..=if depth == 0 { 5 } else { 8 })?;
    Ok(match choice {
        0 => Value::Null,
        1 => json!(u.arbitrary::<bool>()?),
        2 => json!(u.arbitrary::<i64>()?),
        3 => json!(u.arbitrary::<f32>()? as f64),
        4 | 5 => json!(u.choose(STRINGS)?),
        6 => Value::Array(
            (0..u.int_in_range(0..=3)?)
                .map(|_| value(u, depth - 1))
                .collect::<Result<_>>()?,
        ),
        _ => {
            let mut m = Map::new();
            for _ in 0..u.int_in_range(0..=6)? {
                m.insert(u.choose(KEYS)?.to_string(), value(u, depth - 1)?);
            }
            Value::Object(m)
        }
    })
}

fn check_error(e: &ParseError, obj: &Value) {
    assert!(!e.field.is_empty() && !e.message.is_empty(), "{e:?}");
    assert_eq!(e.to_string(), format!("{}: {}", e.field, e.message));
    let root = e.field.split(['.', '[']).next().unwrap_or_default();
    assert!(
        ROOTS.contains(&root),
        "error about no field of the object: {e:?}"
    );
    if !obj.is_object() {
        assert_eq!(e.field, "object", "{e:?}");
    }
}

fn parse_all(obj: &Value, keys: &Keys) {
    for kind in ScalableKind::ALL {
        let got = ScalableResource::from_json(kind, keys, obj);
        assert_eq!(got, ScalableResource::from_json(kind, keys, obj));
        match &got {
            Ok(r) => {
                assert_eq!(r.kind, kind);
                assert!(!r.key.name.is_empty());
                assert_eq!(obj["metadata"]["name"].as_str(), Some(r.key.name.as_str()));
                if let Some(found) = obj["kind"].as_str() {
                    assert_eq!(found, kind.as_str());
                }
                assert!(
                    !r.annotations
                        .contains_key("kubectl.kubernetes.io/last-applied-configuration")
                );
                if let Some(Err(e)) = &r.template.infrastructure_ref {
                    check_error(e, obj);
                    assert!(e.field.starts_with("spec."), "{e:?}");
                }
            }
            Err(e) => check_error(e, obj),
        }
    }
    let machine = Machine::from_json(keys, obj);
    assert_eq!(machine, Machine::from_json(keys, obj));
    match &machine {
        Ok(m) => {
            assert!(!m.key.name.is_empty());
            assert!(m.provider_id.as_deref().is_none_or(|p| !p.is_empty()));
            assert!(m.node_ref.as_deref().is_none_or(|n| !n.is_empty()));
        }
        Err(e) => check_error(e, obj),
    }
    let infra = InfraTemplate::from_json(obj);
    assert_eq!(infra, InfraTemplate::from_json(obj));
    match &infra {
        Ok(t) => {
            // The group is empty for a core-group apiVersion (`v1`).
            assert!(!t.kind.is_empty() && !t.key.name.is_empty());
            assert_eq!(obj["kind"].as_str(), Some(t.kind.as_str()));
        }
        Err(e) => check_error(e, obj),
    }
    let cluster = ClusterTopology::from_json(obj);
    assert_eq!(cluster, ClusterTopology::from_json(obj));
    match &cluster {
        Ok(c) => assert!(!c.key.name.is_empty()),
        Err(e) => check_error(e, obj),
    }
    let node = Node::from_json(keys, &NODE_LABELS_COPIED, obj);
    assert_eq!(node, Node::from_json(keys, &NODE_LABELS_COPIED, obj));
    match &node {
        Ok(n) => {
            assert_eq!(obj["metadata"]["name"].as_str().unwrap_or_default(), n.name);
            assert!(n.provider_id.as_deref().is_none_or(|p| !p.is_empty()));
        }
        Err(e) => check_error(e, obj),
    }
}

fuzz_target!(|data: &[u8]| {
    let keys = Keys::default();
    // JSON text as the API serves it, else a value built from the bytes.
    let obj = match serde_json::from_slice::<Value>(data) {
        Ok(v) => v,
        Err(_) => {
            let mut u = Unstructured::new(data);
            let Ok(mut v) = value(&mut u, 6) else { return };
            // Often a readable skeleton, so that the parsers get past metadata.
            if v.is_object() && u.ratio(1, 2).unwrap_or(false) {
                v["metadata"] = json!({"namespace": "ns", "name": "n"});
                if u.ratio(1, 2).unwrap_or(false) {
                    v["apiVersion"] = json!("cluster.x-k8s.io/v1beta2");
                    v["kind"] = json!(
                        u.choose(&["MachineDeployment", "Machine", "MachinePool", "T"])
                            .unwrap_or(&"T")
                    );
                }
            }
            v
        }
    };
    parse_all(&obj, &keys);
});
