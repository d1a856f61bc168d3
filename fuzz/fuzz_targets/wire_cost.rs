//! The protobuf wire scanner that screens requests before they are decoded (`src/grpc/wire.rs`: the decoded
//! size bound of PricingPodPrice's pod and of the node-carrying requests, DeleteNodes, NodeGroupForNode,
//! PricingNodePrice), on raw bytes read as each shape.
//!
//! Contract: no panic, and it stops; the bound without a budget is always an answer, and with a budget it
//! is that same answer when within it, else `TooLarge` past the budget and at most the full bound; for bytes
//! the decoder accepts, the bound is at least what the decoded lists weigh (containers, init and ephemeral
//! containers, volumes of a Pod; nodes and their label and annotation entries of a DeleteNodes request).
#![no_main]

use std::mem::size_of;

use capi_autoscaler_provider::grpc::wire::{Shape, TooLarge, UNIT, cost};
use capi_autoscaler_provider::proto::{ExternalGrpcNode, NodeGroupDeleteNodesRequest};
use k8s_pb::api::core::v1::{Container, EphemeralContainer, Pod, Volume};
use libfuzzer_sys::fuzz_target;
use prost::Message;

const SHAPES: [Shape; 7] = [
    Shape::Pod,
    Shape::NodeRequest,
    Shape::Any,
    Shape::PodSpec,
    Shape::PodStatus,
    Shape::Node,
    Shape::Leaf,
];

fn twice<T>() -> u64 {
    2 * size_of::<T>() as u64
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    let shape = SHAPES[usize::from(selector) % SHAPES.len()];
    let full = cost(bytes, shape, u64::MAX).expect("no budget, no refusal");
    // Budgets around the full bound, and the one the server and the service use (64 MiB).
    for budget in [0, UNIT, full / 2, full.saturating_sub(1), full, 64 << 20] {
        match cost(bytes, shape, budget) {
            Ok(c) => assert!(
                c == full && c <= budget,
                "{shape:?} {budget}: {c} != {full}"
            ),
            Err(TooLarge { budget: b, cost: c }) => {
                assert_eq!(b, budget);
                assert!(
                    full > budget && c > budget && c <= full,
                    "{shape:?} {budget}: {c} of {full}"
                );
            }
        }
    }
    match shape {
        Shape::Pod => {
            if let Ok(pod) = Pod::decode(bytes) {
                let spec = pod.spec.unwrap_or_default();
                let weight = (spec.containers.len() + spec.init_containers.len()) as u64
                    * twice::<Container>()
                    + spec.ephemeral_containers.len() as u64 * twice::<EphemeralContainer>()
                    + spec.volumes.len() as u64 * twice::<Volume>();
                assert!(full >= weight, "pod bound {full} below its lists' {weight}");
            }
        }
        Shape::NodeRequest => {
            if let Ok(r) = NodeGroupDeleteNodesRequest::decode(bytes) {
                let entries: usize = r
                    .nodes
                    .iter()
                    .map(|n| n.labels.len() + n.annotations.len())
                    .sum();
                let weight =
                    r.nodes.len() as u64 * twice::<ExternalGrpcNode>() + entries as u64 * 256;
                assert!(
                    full >= weight,
                    "request bound {full} below its nodes' {weight}"
                );
            }
        }
        _ => {}
    }
});
