//! PricingPodPrice's decoders: the request (`PricingPodPriceRequest`, prost) and the pod in it
//! (`pod_bytes`/legacy `pod`: a `k8s.io.api.core.v1.Pod`, k8s-pb), then the pod's requests and price.
//! Inputs are raw bytes, or (first byte 0xff) a request built from the bytes with containers, init
//! containers (sidecars), pod-level resources and overhead whose quantities come from Kubernetes' grammar.
//!
//! Contract: no panic; a pod either decodes or is an error saying it is not a v1.Pod; a decoded pod
//! re-encodes to a pod equal to it; its requests are non-negative (NaN never), its price is finite and not
//! negative for any period, and 0 for an empty, negative or infinite one.
#![no_main]

use std::collections::BTreeMap;

use capi_autoscaler_provider::pricing::{self, ReferencePrices};
use capi_autoscaler_provider::proto::PricingPodPriceRequest;
use capi_autoscaler_provider_fuzz::text_of;
use k8s_pb::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_pb::apimachinery::pkg::api::resource::Quantity;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use prost::Message;

const QUANTITIES: &[&str] = &[
    "0",
    "1",
    "4",
    "250m",
    "1.5",
    "16Gi",
    "512Mi",
    "1e3",
    "2E",
    "9",
    "E",
    "Ei",
    "-1",
    "x",
    "",
    "99999999999999999999",
    "1e18",
];
const PRICES: [ReferencePrices; 3] = [
    ReferencePrices::FALLBACK,
    ReferencePrices {
        cpu_hour: 0.0,
        gib_hour: 0.0,
    },
    ReferencePrices {
        cpu_hour: 1e300,
        gib_hour: 1e300,
    },
];
const HOURS: [f64; 6] = [1.0, 0.0, -1.0, 1e-9, 1e12, f64::INFINITY];

fn resources(u: &mut Unstructured) -> Result<BTreeMap<String, Quantity>> {
    let mut out = BTreeMap::new();
    for _ in 0..u.int_in_range(0..=3)? {
        let name = *u.choose(&["cpu", "memory", "nvidia.com/gpu", "pods"])?;
        let string = u
            .arbitrary::<bool>()?
            .then(|| text_of(u, QUANTITIES, 2))
            .transpose()?;
        out.insert(name.to_string(), Quantity { string });
    }
    Ok(out)
}

fn container(u: &mut Unstructured) -> Result<Container> {
    Ok(Container {
        name: Some("c".into()),
        restart_policy: u
            .arbitrary::<bool>()?
            .then(|| u.choose(&["Always", "Never", ""]).map(|s| s.to_string()))
            .transpose()?,
        resources: u
            .arbitrary::<bool>()?
            .then(|| -> Result<_> {
                Ok(ResourceRequirements {
                    requests: resources(u)?,
                    limits: resources(u)?,
                    ..Default::default()
                })
            })
            .transpose()?,
        ..Default::default()
    })
}

fn request(u: &mut Unstructured) -> Result<Vec<u8>> {
    let mut spec = PodSpec::default();
    for _ in 0..u.int_in_range(0..=4)? {
        spec.containers.push(container(u)?);
    }
    for _ in 0..u.int_in_range(0..=3)? {
        spec.init_containers.push(container(u)?);
    }
    spec.overhead = resources(u)?;
    if u.arbitrary()? {
        spec.resources = Some(ResourceRequirements {
            requests: resources(u)?,
            ..Default::default()
        });
    }
    let pod = Pod {
        spec: u.ratio(15, 16)?.then_some(spec),
        ..Default::default()
    }
    .encode_to_vec();
    let (pod, pod_bytes) = if u.arbitrary()? {
        (pod, Vec::new())
    } else {
        (Vec::new(), pod)
    };
    Ok(PricingPodPriceRequest {
        pod,
        pod_bytes,
        ..Default::default()
    }
    .encode_to_vec())
}

fn check_pod(bytes: &[u8]) {
    match pricing::decode_pod(bytes) {
        Ok(pod) => {
            let again =
                pricing::decode_pod(&pod.encode_to_vec()).expect("a decoded pod re-decodes");
            assert_eq!(again, pod);
            let r = pricing::pod_requests(&pod);
            assert!(r.cpu_cores >= 0.0 && r.memory_gib >= 0.0, "{r:?}");
            for refs in &PRICES {
                for hours in HOURS {
                    let price = pricing::pod_price(&pod, refs, hours);
                    assert!(
                        price.is_finite() && price >= 0.0,
                        "{r:?} {refs:?} {hours}: {price}"
                    );
                    if !hours.is_finite() || hours <= 0.0 {
                        assert_eq!(price, 0.0);
                    }
                }
            }
        }
        Err(e) => assert!(e.to_string().contains("not a v1.Pod"), "{e}"),
    }
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
    // The request as CA sends it: pod_bytes (CA ≥ 1.35), else the legacy pod.
    if let Ok(r) = PricingPodPriceRequest::decode(data) {
        let again =
            PricingPodPriceRequest::decode(r.encode_to_vec().as_slice()).expect("re-decodes");
        assert_eq!(again, r);
        let bytes = if r.pod_bytes.is_empty() {
            &r.pod
        } else {
            &r.pod_bytes
        };
        check_pod(bytes);
    }
    // The bytes as a pod.
    check_pod(data);
});
