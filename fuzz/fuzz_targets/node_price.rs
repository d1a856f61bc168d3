//! PricingNodePrice's decoders: the request (`PricingNodePriceRequest`, prost), the node in it
//! (`ExternalGrpcNode`: providerID, name, labels, annotations) as the service locates it in a snapshot of
//! one priced MachineDeployment, the period (CA ≥ 1.35 timestamps, else the legacy ones) and the price.
//! Inputs are raw bytes, or (first byte 0xff) a request built from the bytes with providerIDs, names and
//! machine annotations like CA's.
//!
//! Contract: no panic; a request re-encodes to itself; the normalized providerID is a suffix of it; a node
//! is located only by its providerID, its name or its machine annotations, and then in the one group; a
//! timestamp is read only with nanos in [0, 1e9) and then converts back to itself; the price is finite, not
//! negative, and 0 when the period is empty.
#![no_main]

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};
use std::time::{SystemTime, UNIX_EPOCH};

use capi_autoscaler_provider::cache::Index;
use capi_autoscaler_provider::capi::{Keys, Machine, ScalableKind, ScalableResource, providerid};
use capi_autoscaler_provider::pricing;
use capi_autoscaler_provider::proto::{ExternalGrpcNode, LegacyTime, PricingNodePriceRequest};
use capi_autoscaler_provider::snapshot::{NodeRef, Settings, Snapshot};
use capi_autoscaler_provider_fuzz::text_of;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use serde_json::json;

const GROUP: &str = "MachineDeployment/ns/md";
const PROVIDER_ID: &str = "e2e:///ns/m-0";
const TOKENS: &[&str] = &[
    "e2e:///",
    "ns",
    "/",
    "m-0",
    "m-1",
    "azure://",
    "virtualMachineScaleSets",
    "aws:////",
    "i-1",
    "",
    "cluster.x-k8s.io/machine",
    "cluster.x-k8s.io/cluster-namespace",
];

static SNAPSHOT: LazyLock<Snapshot> = LazyLock::new(|| {
    let keys = Keys::default();
    let labels =
        json!({"cluster.x-k8s.io/cluster-name": "c", "cluster.x-k8s.io/deployment-name": "md"});
    let md = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
        "metadata": {"name": "md", "namespace": "ns", "uid": "md-uid", "annotations": {
            keys.min_size.clone(): "0", keys.max_size.clone(): "5",
            "capi-autoscaler-provider/hourly-price": "0.5",
        }},
        "spec": {"clusterName": "c", "replicas": 1, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"clusterName": "c"}}},
    });
    let ms = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet",
        "metadata": {"name": "md-ms", "namespace": "ns", "uid": "ms-uid", "labels": labels,
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
                "name": "md", "uid": "md-uid", "controller": true}]},
        "spec": {"clusterName": "c", "replicas": 1, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"clusterName": "c"}}},
    });
    let machine = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
        "metadata": {"name": "m-0", "namespace": "ns", "uid": "m-uid", "labels": labels,
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet",
                "name": "md-ms", "uid": "ms-uid", "controller": true}]},
        "spec": {"clusterName": "c", "providerID": PROVIDER_ID},
        "status": {"nodeRef": {"name": "m-0"}, "phase": "Running"},
    });
    let mut index = Index::default();
    for (kind, obj) in [
        (ScalableKind::MachineDeployment, md),
        (ScalableKind::MachineSet, ms),
    ] {
        let r = ScalableResource::from_json(kind, &keys, &obj).expect("fixture");
        index.apply_resource(kind, r.key.clone(), Ok(Arc::new(r)));
    }
    let m = Machine::from_json(&keys, &machine).expect("fixture");
    index.apply_machine(m.key.clone(), Ok(Arc::new(m)));
    let snapshot = index.snapshot(&Settings::default());
    assert!(
        snapshot.group(GROUP).is_some_and(|g| g.price == Some(0.5)),
        "fixture group"
    );
    snapshot
});

fn request(u: &mut Unstructured) -> Result<Vec<u8>> {
    let mut annotations = HashMap::new();
    for _ in 0..u.int_in_range(0..=2)? {
        annotations.insert(text_of(u, TOKENS, 2)?, text_of(u, TOKENS, 2)?);
    }
    let node = ExternalGrpcNode {
        provider_id: text_of(u, TOKENS, 4)?,
        name: text_of(u, TOKENS, 2)?,
        labels: HashMap::new(),
        annotations,
    };
    let time = |u: &mut Unstructured| -> Result<(i64, i32)> {
        Ok(if u.arbitrary()? {
            (
                u.int_in_range(-10_000_000_000..=10_000_000_000)?,
                u.int_in_range(-1..=1_000_000_000)?,
            )
        } else {
            (u.arbitrary()?, u.arbitrary()?)
        })
    };
    let (start, end) = (time(u)?, time(u)?);
    let legacy = u.arbitrary::<bool>()?;
    let stamp = |(seconds, nanos)| prost_types::Timestamp { seconds, nanos };
    let old = |(seconds, nanos)| LegacyTime { seconds, nanos };
    Ok(PricingNodePriceRequest {
        node: u.ratio(15, 16)?.then_some(node),
        start_time: legacy.then(|| old(start)),
        end_time: legacy.then(|| old(end)),
        start_timestamp: (!legacy).then(|| stamp(start)),
        end_timestamp: (!legacy).then(|| stamp(end)),
    }
    .encode_to_vec())
}

/// As the service reads a period bound: the new timestamp, else the legacy one.
fn bound(new: Option<&prost_types::Timestamp>, legacy: Option<&LegacyTime>) -> Option<(i64, i32)> {
    new.map(|t| (t.seconds, t.nanos))
        .or(legacy.map(|t| (t.seconds, t.nanos)))
}

fn time(seconds: i64, nanos: i32) -> Option<SystemTime> {
    let t = pricing::timestamp(seconds, nanos)?;
    assert!((0..1_000_000_000).contains(&nanos));
    // Back to (seconds, nanos), either side of the epoch.
    let (s, n) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos() as i32),
        Err(e) => {
            let d = e.duration();
            let (s, n) = (-(d.as_secs() as i128), d.subsec_nanos() as i32);
            if n == 0 {
                (s as i64, 0)
            } else {
                ((s - 1) as i64, 1_000_000_000 - n)
            }
        }
    };
    assert_eq!((s, n), (seconds, nanos));
    Some(t)
}

fuzz_target!(|data: &[u8]| {
    let built;
    let data = match data.split_first() {
        Some((0xff, rest)) => {
            let Ok(bytes) = request(&mut Unstructured::new(rest)) else {
                return;
            };
            built = bytes;
            built.as_slice()
        }
        _ => data,
    };
    let Ok(r) = PricingNodePriceRequest::decode(data) else {
        return;
    };
    assert_eq!(
        PricingNodePriceRequest::decode(r.encode_to_vec().as_slice()).as_ref(),
        Ok(&r)
    );
    let keys = Keys::default();
    if let Some(node) = &r.node {
        assert!(
            node.provider_id
                .ends_with(providerid::normalize(&node.provider_id))
        );
        let node_ref = NodeRef {
            provider_id: &node.provider_id,
            name: &node.name,
            annotations: Some(&node.annotations),
        };
        if let Some(group) = SNAPSHOT.group_for_node(&node_ref, &keys) {
            assert_eq!(group.id, GROUP);
            let by_annotations = node.annotations.get(&keys.node_machine).map(String::as_str)
                == Some("m-0")
                && node
                    .annotations
                    .get(&keys.node_cluster_namespace)
                    .map(String::as_str)
                    == Some("ns");
            assert!(
                providerid::normalize(&node.provider_id) == "m-0"
                    || node.name == PROVIDER_ID
                    || by_annotations,
                "{node:?} located"
            );
        }
    }
    let start = bound(r.start_timestamp.as_ref(), r.start_time.as_ref());
    let end = bound(r.end_timestamp.as_ref(), r.end_time.as_ref());
    if let (Some(start), Some(end)) = (start, end)
        && let (Some(from), Some(to)) = (time(start.0, start.1), time(end.0, end.1))
    {
        let hours = pricing::hours_between(from, to);
        assert!(hours.is_finite() && hours >= 0.0);
        for hourly in [0.0, 0.5, 1e300] {
            let price = pricing::node_price(hourly, from, to);
            assert!(price.is_finite() && price >= 0.0, "{price}");
            if to <= from {
                assert_eq!(price, 0.0);
            }
        }
    }
});
