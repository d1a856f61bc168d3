//! Pricing for CA's `price` expander end to end (shipped CRDs): `PricingNodePrice` for CA's renamed
//! template nodes (`template-node-for-<group id>-<random>`), for a template node known only by the
//! annotation our templates carry, and for a real node by providerID; `PricingPodPrice` from a pod's
//! requests at the reference prices derived from the priced groups, in the current and the legacy
//! wire layout; the error codes (docs/architecture.md, "Pricing").
//!
//! Every test works in a namespace of its own with a provider that only looks at that namespace.

use crate::support;

use std::collections::{BTreeMap, HashMap};

use capi_autoscaler_provider::proto::{
    ExternalGrpcNode, LegacyTime, PricingNodePriceRequest, PricingPodPriceRequest,
};
use k8s_pb::api::core::v1 as pb;
use k8s_pb::apimachinery::pkg::api::resource::Quantity;
use k8s_pb::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use prost::Message;
use support::capi::{Capi, Kind, Owner, Rpc, Scalable, expect_code, grpc_node};
use support::capi::{fresh_capi, provider_for_namespace};
use support::{ControlPlane, ProviderProcess, Setup};
use tonic::{Code, Status};

const SETUP: Setup = Setup::shipped();
const VERSION: &str = "v1beta2";

const CPU: &str = "capacity.cluster-autoscaler.kubernetes.io/cpu";
const MEMORY: &str = "capacity.cluster-autoscaler.kubernetes.io/memory";
const PRICE: &str = "capi-autoscaler-provider/hourly-price";
const NODE_GROUP_ANNOTATION: &str = "capi-autoscaler-provider/node-group";

/// Any fixed instant; prices only depend on the length of the period.
const START: i64 = 1_800_000_000;
const HOUR: i64 = 3600;

async fn capi() -> (&'static ControlPlane, Capi) {
    fresh_capi(SETUP, VERSION).await
}

async fn provider_for(cp: &ControlPlane, ns: &str) -> (ProviderProcess, Rpc) {
    provider_for_namespace(cp, ns).await
}

/// A group of `cores` CPUs and 4 GiB per core, priced `price` per node-hour (or not at all).
fn group(name: &str, cores: u32, price: Option<&str>) -> Scalable {
    let s = Scalable::md(name)
        .bounds(0, 5)
        .replicas(1)
        .annotation(CPU, &cores.to_string())
        .annotation(MEMORY, &format!("{}Gi", 4 * cores));
    match price {
        Some(p) => s.annotation(PRICE, p),
        None => s,
    }
}

fn ts(seconds: i64) -> prost_types::Timestamp {
    prost_types::Timestamp { seconds, nanos: 0 }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// The node CA prices for an expansion option of group `id`: a copy of our template, renamed.
fn template_node(id: &str) -> ExternalGrpcNode {
    grpc_node("", &format!("template-node-for-{id}-5577006791947779410"))
}

async fn node_price(rpc: &mut Rpc, node: ExternalGrpcNode, hours: i64) -> Result<f64, Status> {
    rpc.client
        .pricing_node_price(PricingNodePriceRequest {
            node: Some(node),
            start_timestamp: Some(ts(START)),
            end_timestamp: Some(ts(START + hours * HOUR)),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().price)
}

#[track_caller]
fn assert_price(what: &str, got: Result<f64, Status>, want: f64) {
    match got {
        Ok(p) if close(p, want) => {}
        other => panic!("{what}: expected {want}, got {other:?}"),
    }
}

fn quantities(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
    pairs
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                Quantity {
                    string: Some(v.to_string()),
                },
            )
        })
        .collect()
}

fn container(name: &str, requests: &[(&str, &str)]) -> pb::Container {
    pb::Container {
        name: Some(name.into()),
        image: Some("registry.k8s.io/pause:3.10".into()),
        resources: (!requests.is_empty()).then(|| pb::ResourceRequirements {
            requests: quantities(requests),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A pending pod as CA sends it: metadata and a spec, no node.
fn pod(containers: Vec<pb::Container>) -> pb::Pod {
    pb::Pod {
        metadata: Some(ObjectMeta {
            name: Some("pending".into()),
            namespace: Some("default".into()),
            ..Default::default()
        }),
        spec: Some(pb::PodSpec {
            containers,
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn pod_price(rpc: &mut Rpc, pod: &pb::Pod, hours: i64) -> Result<f64, Status> {
    rpc.client
        .pricing_pod_price(PricingPodPriceRequest {
            pod_bytes: pod.encode_to_vec(),
            start_timestamp: Some(ts(START)),
            end_timestamp: Some(ts(START + hours * HOUR)),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().price)
}

#[tokio::test]
async fn node_prices_for_template_nodes_and_real_nodes() {
    let (cp, capi) = capi().await;
    let id = |name: &str| capi.id(Kind::MachineDeployment, name);
    capi.create_deployment(&group("cheap", 2, Some("0.10")), false)
        .await;
    capi.create_deployment(&group("dear", 8, Some("0.40")), false)
        .await;
    // Its id extends "cheap"'s: its template nodes must not be taken for "cheap"'s.
    capi.create_deployment(&group("cheap-2", 4, Some("0.20")), false)
        .await;
    capi.create_deployment(&group("free", 2, None), false).await;
    // A malformed price is no price (and a problem).
    capi.create_deployment(&group("typo", 2, Some("0,10")), false)
        .await;
    capi.create_machine(&capi.running("m0", Owner::Deployment("cheap".into())))
        .await;
    let (_provider, mut rpc) = provider_for(cp, &capi.ns).await;
    rpc.wait_ids(
        &capi.ns,
        &["cheap", "dear", "cheap-2", "free", "typo"]
            .iter()
            .map(|n| id(n))
            .collect(),
    )
    .await;

    // CA's template nodes, over two hours.
    for (name, want) in [("cheap", 0.2), ("dear", 0.8), ("cheap-2", 0.4)] {
        assert_price(
            &format!("PricingNodePrice(template node of {name})"),
            node_price(&mut rpc, template_node(&id(name)), 2).await,
            want,
        );
    }
    // A template node known only by the annotation our templates carry.
    let mut annotated = grpc_node("", "renamed-by-someone");
    annotated.annotations = HashMap::from([(NODE_GROUP_ANNOTATION.to_string(), id("dear"))]);
    assert_price(
        "PricingNodePrice(node with the node-group annotation)",
        node_price(&mut rpc, annotated, 2).await,
        0.8,
    );
    // A real node of "cheap", by the providerID of its Machine.
    let real = capi.grpc_node("m0");
    assert_eq!(rpc.for_node(real.clone()).await.id, id("cheap"));
    assert_price(
        "PricingNodePrice(real node of cheap, 2h)",
        node_price(&mut rpc, real.clone(), 2).await,
        0.2,
    );
    assert_price(
        "PricingNodePrice(real node of cheap, 1h)",
        node_price(&mut rpc, real.clone(), 1).await,
        0.1,
    );
    // An empty or reversed period costs nothing.
    assert_price(
        "PricingNodePrice(reversed period)",
        node_price(&mut rpc, real.clone(), -1).await,
        0.0,
    );

    // A group without a price, and a node of no group: UNIMPLEMENTED (CA's "not implemented").
    let message = expect_code(
        "PricingNodePrice(template node of the unpriced group)",
        node_price(&mut rpc, template_node(&id("free")), 2).await,
        Code::Unimplemented,
    );
    assert!(message.contains(&id("free")), "{message}");
    expect_code(
        "PricingNodePrice(template node of the group with a malformed price)",
        node_price(&mut rpc, template_node(&id("typo")), 2).await,
        Code::Unimplemented,
    );
    expect_code(
        "PricingNodePrice(node of no group)",
        node_price(&mut rpc, grpc_node("e2e:///nowhere/x", "stranger"), 2).await,
        Code::Unimplemented,
    );
    // No timestamps: INVALID_ARGUMENT.
    let missing = rpc
        .client
        .pricing_node_price(PricingNodePriceRequest {
            node: Some(template_node(&id("cheap"))),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().price);
    expect_code(
        "PricingNodePrice without timestamps",
        missing,
        Code::InvalidArgument,
    );
}

#[tokio::test]
async fn pod_prices_follow_requests_and_the_period() {
    let (cp, capi) = capi().await;
    // Every priced group costs 0.05 per core-hour with 4 GiB per core: half of each price to CPU,
    // half to memory gives 0.025 per CPU-hour and 0.00625 per GiB-hour (pricing.rs, module doc).
    capi.create_deployment(&group("cheap", 2, Some("0.10")), false)
        .await;
    capi.create_deployment(&group("dear", 8, Some("0.40")), false)
        .await;
    capi.create_deployment(&group("free", 16, None), false)
        .await;
    let (_provider, mut rpc) = provider_for(cp, &capi.ns).await;
    rpc.wait_ids(
        &capi.ns,
        &["cheap", "dear", "free"]
            .iter()
            .map(|n| capi.id(Kind::MachineDeployment, n))
            .collect(),
    )
    .await;
    let (cpu_hour, gib_hour) = (0.025, 0.00625);

    let small = pod(vec![container(
        "app",
        &[("cpu", "500m"), ("memory", "1Gi")],
    )]);
    let one_hour = pod_price(&mut rpc, &small, 1)
        .await
        .expect("PricingPodPrice");
    assert!(one_hour > 0.0, "{one_hour}");
    assert!(
        close(one_hour, 0.5 * cpu_hour + gib_hour),
        "500m and 1Gi for an hour: {one_hour}"
    );
    let two_hours = pod_price(&mut rpc, &small, 2)
        .await
        .expect("PricingPodPrice");
    assert!(
        close(two_hours, 2.0 * one_hour),
        "proportional to the period: {one_hour} per hour, {two_hours} for two"
    );

    // Init containers count as their peak, overhead is added.
    let mut bigger = pod(vec![
        container("a", &[("cpu", "250m"), ("memory", "512Mi")]),
        container("b", &[("cpu", "250m"), ("memory", "512Mi")]),
    ]);
    if let Some(spec) = bigger.spec.as_mut() {
        spec.init_containers = vec![container("init", &[("cpu", "2"), ("memory", "256Mi")])];
        spec.overhead = quantities(&[("cpu", "100m")]);
    }
    assert_price(
        "PricingPodPrice(init peak + overhead)",
        pod_price(&mut rpc, &bigger, 1).await,
        2.1 * cpu_hour + gib_hour,
    );

    // A pod without requests costs nothing (but is answered: CA drops options whose pods fail).
    let idle = pod(vec![container("idle", &[])]);
    assert_price(
        "PricingPodPrice(no requests)",
        pod_price(&mut rpc, &idle, 2).await,
        0.0,
    );

    // CA ≤ 1.34 sends the pod in `pod` and the period in the meta.v1.Time fields.
    let legacy = rpc
        .client
        .pricing_pod_price(PricingPodPriceRequest {
            pod: small.encode_to_vec(),
            start_time: Some(LegacyTime {
                seconds: START,
                nanos: 0,
            }),
            end_time: Some(LegacyTime {
                seconds: START + 2 * HOUR,
                nanos: 0,
            }),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().price);
    assert_price("PricingPodPrice(legacy layout)", legacy, two_hours);

    // No timestamps: INVALID_ARGUMENT.
    let missing = rpc
        .client
        .pricing_pod_price(PricingPodPriceRequest {
            pod_bytes: small.encode_to_vec(),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().price);
    expect_code(
        "PricingPodPrice without timestamps",
        missing,
        Code::InvalidArgument,
    );
    let missing_end = rpc
        .client
        .pricing_pod_price(PricingPodPriceRequest {
            pod_bytes: small.encode_to_vec(),
            start_timestamp: Some(ts(START)),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().price);
    expect_code(
        "PricingPodPrice without endTimestamp",
        missing_end,
        Code::InvalidArgument,
    );
    // Bytes that are no Pod.
    let garbage = rpc
        .client
        .pricing_pod_price(PricingPodPriceRequest {
            pod_bytes: vec![0xff, 0xff, 0xff],
            start_timestamp: Some(ts(START)),
            end_timestamp: Some(ts(START + HOUR)),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().price);
    expect_code(
        "PricingPodPrice(garbage bytes)",
        garbage,
        Code::InvalidArgument,
    );
}

#[tokio::test]
async fn without_any_priced_group_pricing_is_unimplemented() {
    let (cp, capi) = capi().await;
    capi.create_deployment(&group("a", 2, None), false).await;
    capi.create_deployment(&group("b", 4, None), false).await;
    let (_provider, mut rpc) = provider_for(cp, &capi.ns).await;
    let a = capi.id(Kind::MachineDeployment, "a");
    rpc.wait_ids(
        &capi.ns,
        &[a.clone(), capi.id(Kind::MachineDeployment, "b")].into(),
    )
    .await;

    let small = pod(vec![container(
        "app",
        &[("cpu", "500m"), ("memory", "1Gi")],
    )]);
    expect_code(
        "PricingPodPrice with no priced group",
        pod_price(&mut rpc, &small, 1).await,
        Code::Unimplemented,
    );
    expect_code(
        "PricingNodePrice with no priced group",
        node_price(&mut rpc, template_node(&a), 1).await,
        Code::Unimplemented,
    );
}
