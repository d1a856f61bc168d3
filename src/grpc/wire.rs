//! Protobuf wire format read without decoding: an upper bound of the memory a decoder would allocate
//! for a message, so a request whose few bytes would decode into gigabytes (millions of empty nodes,
//! containers or map entries: two bytes on the wire each, hundreds to thousands of bytes decoded) is
//! refused before it is decoded.
//!
//! The bound counts every length-delimited field (a message, a map entry, a string) with a weight:
//! the decoded size of the element it may become, known for the few large element types, else
//! [`UNIT`]. A malformed message is counted up to the point where it stops being well formed, as a
//! decoder allocates up to there before it fails. Nothing is allocated while scanning.

use std::mem::size_of;

/// Weight of an element whose type is not listed: larger than a decoded `ExternalGrpcNode` and than
/// most Kubernetes element types (an `EnvVar` is 360 bytes, a `Toleration` 112).
pub const UNIT: u64 = 400;

/// Nesting deeper than this is not looked into (counted as one element). prost itself refuses
/// messages nested deeper than 100.
const MAX_DEPTH: usize = 32;

/// What a message is, as far as the weights care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Not known: every length-delimited field may be a message.
    Any,
    /// A string or bytes: not looked into.
    Leaf,
    /// `k8s.io.api.core.v1.Pod`.
    Pod,
    PodSpec,
    PodStatus,
    /// A request whose field `nodes` holds `ExternalGrpcNode`s (DeleteNodes: 1; NodeGroupForNode and
    /// PricingNodePrice: 1, singular).
    NodeRequest,
    /// `ExternalGrpcNode`: fields 3 (labels) and 4 (annotations) are maps.
    Node,
}

/// A weight twice the element's size: a growing vector holds up to twice what it uses.
const fn twice<T>() -> u64 {
    2 * size_of::<T>() as u64
}

/// The shape and weight of field `field` (length-delimited) of a message of shape `shape`.
fn child(shape: Shape, field: u32) -> (Shape, u64) {
    use k8s_pb::api::core::v1 as core;
    match (shape, field) {
        (Shape::Leaf, _) => (Shape::Leaf, 0),
        (Shape::Pod, 2) => (Shape::PodSpec, UNIT),
        (Shape::Pod, 3) => (Shape::PodStatus, UNIT),
        (Shape::PodSpec, 1) => (Shape::Any, twice::<core::Volume>()),
        (Shape::PodSpec, 2 | 20) => (Shape::Any, twice::<core::Container>()),
        (Shape::PodSpec, 34) => (Shape::Any, twice::<core::EphemeralContainer>()),
        (Shape::PodStatus, 8 | 10 | 13) => (Shape::Any, twice::<core::ContainerStatus>()),
        (Shape::NodeRequest, 1) => (Shape::Node, twice::<crate::proto::ExternalGrpcNode>()),
        // The other fields of the requests are strings and timestamps, decoded in place.
        (Shape::NodeRequest, _) => (Shape::Leaf, 0),
        // A map entry: a hash table slot and its two strings' allocations.
        (Shape::Node, 3 | 4) => (Shape::Leaf, 256),
        (Shape::Node, _) => (Shape::Leaf, 0),
        (Shape::Any | Shape::Pod | Shape::PodSpec | Shape::PodStatus, _) => (Shape::Any, UNIT),
    }
}

/// Whether field `field` of a message of shape `shape` is a map: `ExternalGrpcNode` labels and
/// annotations, `PodSpec` nodeSelector and overhead, `PodStatus` field 19 (the maps of the shapes known;
/// inside `Any` maps are not known, which can only misweigh that one field's own payload).
fn is_map(shape: Shape, field: u64) -> bool {
    matches!(
        (shape, field),
        (Shape::Node, 3 | 4) | (Shape::PodSpec, 7 | 32) | (Shape::PodStatus, 19)
    )
}

/// The weighted bound was passed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the message would decode into more than {budget} bytes (at least {cost})")]
pub struct TooLarge {
    pub budget: u64,
    pub cost: u64,
}

/// The weighted element count of `buf` read as a message of `shape`; `Err` as soon as it passes
/// `budget`.
pub fn cost(buf: &[u8], shape: Shape, budget: u64) -> Result<u64, TooLarge> {
    let mut total = 0u64;
    scan(buf, shape, 0, budget, &mut total)?;
    Ok(total)
}

fn scan(
    buf: &[u8],
    shape: Shape,
    depth: usize,
    budget: u64,
    total: &mut u64,
) -> Result<(), TooLarge> {
    if shape == Shape::Leaf {
        return Ok(());
    }
    let mut rest = buf;
    while !rest.is_empty() {
        let Some((key, after)) = varint(rest) else {
            return Ok(());
        };
        let field = key >> 3;
        if field == 0 || field > u64::from(u32::MAX >> 3) {
            return Ok(());
        }
        rest = after;
        // prost reads a map field as length-delimited whatever its wire type says (it does not check it):
        // so does the scan, or entries written with another wire type would weigh nothing.
        let wire_type = if is_map(shape, field) { 2 } else { key & 7 };
        match wire_type {
            // varint
            0 => match varint(rest) {
                Some((_, after)) => rest = after,
                None => return Ok(()),
            },
            // 64-bit
            1 => match rest.get(8..) {
                Some(after) => rest = after,
                None => return Ok(()),
            },
            // length-delimited
            2 => {
                let Some((len, after)) = varint(rest) else {
                    return Ok(());
                };
                let Some(payload) = usize::try_from(len).ok().and_then(|n| after.get(..n)) else {
                    return Ok(());
                };
                rest = &after[payload.len()..];
                let (inner, weight) = child(shape, field as u32);
                *total = total.saturating_add(weight);
                if *total > budget {
                    return Err(TooLarge {
                        budget,
                        cost: *total,
                    });
                }
                if depth < MAX_DEPTH {
                    scan(payload, inner, depth + 1, budget, total)?;
                }
            }
            // Groups (deprecated): their fields are read as if they were this message's own.
            3 | 4 => {}
            // 32-bit
            5 => match rest.get(4..) {
                Some(after) => rest = after,
                None => return Ok(()),
            },
            _ => return Ok(()),
        }
    }
    Ok(())
}

/// A base-128 varint and what follows it; `None` when truncated or longer than ten bytes.
fn varint(buf: &[u8]) -> Option<(u64, &[u8])> {
    let mut value = 0u64;
    for (i, byte) in buf.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, &buf[i + 1..]));
        }
    }
    None
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use prost::Message;

    /// A pod of `n` empty containers, encoded.
    pub(in crate::grpc) fn pod_with_containers(n: usize) -> Vec<u8> {
        use k8s_pb::api::core::v1::{Container, Pod, PodSpec};
        Pod {
            spec: Some(PodSpec {
                containers: vec![Container::default(); n],
                ..Default::default()
            }),
            ..Default::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn empty_containers_weigh_what_they_decode_into() {
        let one = cost(&pod_with_containers(1), Shape::Pod, u64::MAX).unwrap();
        let thousand = cost(&pod_with_containers(1000), Shape::Pod, u64::MAX).unwrap();
        let container = 2 * size_of::<k8s_pb::api::core::v1::Container>() as u64;
        assert_eq!(thousand - one, 999 * container);
        let err = cost(&pod_with_containers(100_000), Shape::Pod, 64 << 20).unwrap_err();
        assert_eq!(err.budget, 64 << 20);
    }

    #[test]
    fn a_real_pod_costs_little() {
        use k8s_pb::api::core::v1::{Container, EnvVar, Pod, PodSpec, ResourceRequirements};
        use k8s_pb::apimachinery::pkg::api::resource::Quantity;
        let container = Container {
            name: Some("app".into()),
            image: Some("registry.example/app:1.0".into()),
            env: (0..50)
                .map(|i| EnvVar {
                    name: Some(format!("VAR_{i}")),
                    value: Some("some value".into()),
                    ..Default::default()
                })
                .collect(),
            resources: Some(ResourceRequirements {
                requests: [(
                    "cpu".to_string(),
                    Quantity {
                        string: Some("500m".into()),
                    },
                )]
                .into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let pod = Pod {
            spec: Some(PodSpec {
                containers: vec![container; 5],
                ..Default::default()
            }),
            ..Default::default()
        }
        .encode_to_vec();
        let c = cost(&pod, Shape::Pod, u64::MAX).unwrap();
        assert!(c < 1 << 20, "{c}");
    }

    #[test]
    fn millions_of_empty_nodes_are_counted_without_decoding() {
        // NodeGroupDeleteNodesRequest: field 1 repeated, each an empty message: 0x0a 0x00.
        let body: Vec<u8> = std::iter::repeat_n([0x0a, 0x00], 1_000_000)
            .flatten()
            .collect();
        let err = cost(&body, Shape::NodeRequest, 32 << 20).unwrap_err();
        assert!(err.cost > 32 << 20);
        // A normal request: a few nodes with labels.
        let request = crate::proto::NodeGroupDeleteNodesRequest {
            id: "MachineDeployment/ns/md".into(),
            nodes: (0..100)
                .map(|i| crate::proto::ExternalGrpcNode {
                    name: format!("node-{i}"),
                    provider_id: format!("e2e://node-{i}"),
                    labels: (0..30).map(|l| (format!("l{l}"), "v".into())).collect(),
                    annotations: Default::default(),
                })
                .collect(),
        }
        .encode_to_vec();
        assert!(cost(&request, Shape::NodeRequest, 32 << 20).is_ok());
    }

    #[test]
    fn malformed_input_is_counted_up_to_where_it_breaks() {
        let mut body: Vec<u8> = std::iter::repeat_n([0x0a, 0x00], 10).flatten().collect();
        body.extend([0x0a, 0xff]); // a length that runs past the end
        let node = 2 * size_of::<crate::proto::ExternalGrpcNode>() as u64;
        assert_eq!(cost(&body, Shape::NodeRequest, u64::MAX), Ok(10 * node));
        // Nothing panics on arbitrary bytes.
        for seed in 0u32..2000 {
            let bytes: Vec<u8> = (0..64u32)
                .map(|i| (seed.wrapping_mul(2_654_435_761).rotate_left(i) >> 3) as u8)
                .collect();
            let _ = cost(&bytes, Shape::Pod, u64::MAX);
            let _ = cost(&bytes, Shape::NodeRequest, u64::MAX);
        }
    }

    #[test]
    fn map_entries_weigh_whatever_their_wire_type() {
        // Found by fuzz/fuzz_targets/wire_cost.rs: label entries written with wire type varint (key 0x18,
        // not 0x1a) still decode into entries, so they must weigh as entries.
        let mut node = Vec::new();
        for i in 0..1000 {
            let key = i.to_string();
            let entry = [&[0x0a, key.len() as u8], key.as_bytes()].concat();
            node.extend_from_slice(&[0x18, entry.len() as u8]);
            node.extend_from_slice(&entry);
        }
        let mut request = vec![0x0a];
        prost::encoding::encode_varint(node.len() as u64, &mut request);
        request.extend_from_slice(&node);
        let decoded =
            crate::proto::NodeGroupDeleteNodesRequest::decode(request.as_slice()).unwrap();
        assert_eq!(decoded.nodes[0].labels.len(), 1000);
        let c = cost(&request, Shape::NodeRequest, u64::MAX).unwrap();
        assert!(c >= 1000 * 256, "{c}");
    }

    #[test]
    fn a_map_with_another_wire_type_does_not_hide_what_follows() {
        // Found by fuzz/fuzz_targets/wire_cost.rs: nodeSelector (PodSpec field 7) written as a group start
        // (0x3b) decodes as an empty entry, and the containers after it still decode.
        let mut spec = vec![0x3b, 0x00];
        for _ in 0..100 {
            spec.extend_from_slice(&[0x12, 0x00]);
        }
        let mut pod = vec![0x12];
        prost::encoding::encode_varint(spec.len() as u64, &mut pod);
        pod.extend_from_slice(&spec);
        let decoded = k8s_pb::api::core::v1::Pod::decode(pod.as_slice()).unwrap();
        assert_eq!(decoded.spec.unwrap_or_default().containers.len(), 100);
        let c = cost(&pod, Shape::Pod, u64::MAX).unwrap();
        let container = 2 * size_of::<k8s_pb::api::core::v1::Container>() as u64;
        assert!(c >= 100 * container, "{c}");
    }

    #[test]
    fn deep_nesting_is_bounded() {
        // 200 levels of field 1 wrapping field 1: counted, not recursed past MAX_DEPTH.
        let mut msg: Vec<u8> = Vec::new();
        for _ in 0..200 {
            let mut outer = vec![0x0a];
            let mut len = msg.len() as u64;
            loop {
                let byte = (len & 0x7f) as u8;
                len >>= 7;
                if len == 0 {
                    outer.push(byte);
                    break;
                }
                outer.push(byte | 0x80);
            }
            outer.extend_from_slice(&msg);
            msg = outer;
        }
        let c = cost(&msg, Shape::Any, u64::MAX).unwrap();
        assert!(c <= (MAX_DEPTH as u64 + 1) * UNIT, "{c}");
    }
}
