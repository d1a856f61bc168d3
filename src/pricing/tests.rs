//! Unit tests of `pricing`.

use super::*;
use crate::capi::Labels;
use k8s_pb::api::core::v1::{PodSpec, ResourceRequirements};
use k8s_pb::apimachinery::pkg::apis::meta::v1::ObjectMeta;

const OBJ: &str = "MachineDeployment default/md-0";

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn group_prices() {
    type Case<'a> = (Option<&'a str>, Result<Option<f64>, &'a str>);
    let cases: &[Case] = &[
        (None, Ok(None)),
        (Some("0.096"), Ok(Some(0.096))),
        (Some("12"), Ok(Some(12.0))),
        (Some(" 1.5 "), Ok(Some(1.5))),
        (Some(".5"), Ok(Some(0.5))),
        (Some("3."), Ok(Some(3.0))),
        (Some("0"), Ok(Some(0.0))),
        (Some(""), Err("empty")),
        (Some("-1"), Err("negative")),
        (Some("1e3"), Err("decimal")),
        (Some("inf"), Err("decimal")),
        (Some("NaN"), Err("decimal")),
        (Some("$1"), Err("decimal")),
        (Some("1,5"), Err("decimal")),
        (Some("."), Err("decimal")),
        (Some("+1"), Err("decimal")),
        (Some("1.2.3"), Err("decimal")),
    ];
    for (value, want) in cases {
        let mut a = BTreeMap::new();
        a.insert("other".to_string(), "x".to_string());
        if let Some(v) = value {
            a.insert(PRICE_ANNOTATION.to_string(), v.to_string());
        }
        match (group_price(OBJ, &Labels::from(a.clone())), want) {
            (Ok(got), Ok(w)) => assert_eq!(got, *w, "{value:?}"),
            (Err(p), Err(fragment)) => {
                assert_eq!(p.object, OBJ);
                assert_eq!(
                    p.field,
                    "metadata.annotations[capi-autoscaler-provider/hourly-price]"
                );
                assert!(p.message.contains(fragment), "{value:?}: {}", p.message);
            }
            (got, w) => panic!("{value:?}: got {got:?}, want {w:?}"),
        }
    }
}

#[test]
fn node_prices() {
    let t0 = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let cases = [
        (2.0, 0u64, 3600u64, 2.0),
        (2.0, 0, 1800, 1.0),
        (0.096, 0, 36_000, 0.96),
        (2.0, 3600, 0, 0.0), // end before start
        (2.0, 100, 100, 0.0),
        (0.0, 0, 3600, 0.0),
    ];
    for (hourly, s, e, want) in cases {
        let got = node_price(
            hourly,
            t0 + Duration::from_secs(s),
            t0 + Duration::from_secs(e),
        );
        assert!(close(got, want), "{hourly} {s}..{e}: {got} != {want}");
    }
}

#[test]
fn timestamps() {
    assert_eq!(timestamp(0, 0), Some(UNIX_EPOCH));
    assert_eq!(timestamp(10, 5), Some(UNIX_EPOCH + Duration::new(10, 5)));
    assert_eq!(
        timestamp(-10, 500_000_000),
        UNIX_EPOCH.checked_sub(Duration::from_millis(9_500))
    );
    assert_eq!(timestamp(1, -1), None);
    assert_eq!(timestamp(1, 1_000_000_000), None);
    // out of SystemTime's range on any platform: no panic, whatever the answer
    let _ = timestamp(i64::MAX, 999_999_999);
    let _ = timestamp(i64::MIN, 0);
    let a = timestamp(1_700_000_000, 0).unwrap_or(UNIX_EPOCH);
    let b = timestamp(1_700_003_600, 0).unwrap_or(UNIX_EPOCH);
    assert!(close(hours_between(a, b), 1.0));
    assert_eq!(hours_between(b, a), 0.0);
}

fn node(hourly: f64, cpu_cores: f64, memory_gib: f64) -> PricedNode {
    PricedNode {
        hourly,
        cpu_cores,
        memory_gib,
        gpu: false,
    }
}

#[test]
fn derive_reference_prices() {
    // one group: 4 cores, 16 GiB, 0.2/h → 0.1/4 per core, 0.1/16 per GiB
    let r = ReferencePrices::derive(&[node(0.2, 4.0, 16.0)]);
    assert_eq!(
        r,
        Some(ReferencePrices {
            cpu_hour: 0.025,
            gib_hour: 0.00625
        })
    );
    // a node of that group filled by pods costs the node's price
    let r = r.unwrap_or(ReferencePrices::FALLBACK);
    assert!(close(4.0 * r.cpu_hour + 16.0 * r.gib_hour, 0.2));

    // median over three: an outlier does not move it
    let r = ReferencePrices::derive(&[
        node(0.2, 4.0, 16.0),
        node(0.4, 8.0, 32.0),
        node(10.0, 4.0, 16.0),
    ]);
    assert_eq!(
        r,
        Some(ReferencePrices {
            cpu_hour: 0.025,
            gib_hour: 0.00625
        })
    );
    // even count: mean of the middle two
    let r = ReferencePrices::derive(&[node(0.2, 4.0, 16.0), node(0.6, 4.0, 16.0)]);
    let r = r.unwrap_or(ReferencePrices::FALLBACK);
    assert!(
        close(r.cpu_hour, 0.05) && close(r.gib_hour, 0.0125),
        "{r:?}"
    );
    // unusable entries skipped
    assert_eq!(ReferencePrices::derive(&[]), None);
    assert_eq!(
        ReferencePrices::derive(&[
            node(0.2, 0.0, 16.0),
            node(0.2, 4.0, 0.0),
            node(f64::NAN, 4.0, 16.0),
            node(-1.0, 4.0, 16.0),
            node(0.2, f64::INFINITY, 16.0)
        ]),
        None
    );
}

#[test]
fn resolve_reference_prices() {
    let priced = [node(0.2, 4.0, 16.0)];
    let (r, src) = ReferencePrices::resolve(None, None, &priced);
    assert_eq!(
        r,
        ReferencePrices {
            cpu_hour: 0.025,
            gib_hour: 0.00625
        }
    );
    assert_eq!(src, [PriceSource::Derived(1), PriceSource::Derived(1)]);
    let (r, src) = ReferencePrices::resolve(Some(0.04), None, &priced);
    assert_eq!(
        r,
        ReferencePrices {
            cpu_hour: 0.04,
            gib_hour: 0.00625
        }
    );
    assert_eq!(src, [PriceSource::Flag, PriceSource::Derived(1)]);
    let (r, src) = ReferencePrices::resolve(Some(0.04), Some(0.005), &[]);
    assert_eq!(
        r,
        ReferencePrices {
            cpu_hour: 0.04,
            gib_hour: 0.005
        }
    );
    assert_eq!(src, [PriceSource::Flag, PriceSource::Flag]);
    let (r, src) = ReferencePrices::resolve(None, Some(f64::NAN), &[]);
    assert_eq!(r, ReferencePrices::FALLBACK);
    assert_eq!(src, [PriceSource::Fallback, PriceSource::Fallback]);
}

#[test]
fn gpu_nodes_set_reference_prices_only_when_nothing_else_is_priced() {
    let gpu = PricedNode {
        gpu: true,
        ..node(10.0, 4.0, 16.0)
    };
    let plain = ReferencePrices {
        cpu_hour: 0.025,
        gib_hour: 0.00625,
    };
    let (r, src) = ReferencePrices::resolve(None, None, &[gpu, node(0.2, 4.0, 16.0)]);
    assert_eq!((r, src), (plain, [PriceSource::Derived(1); 2]));
    let (r, src) = ReferencePrices::resolve(None, None, &[gpu]);
    assert_eq!(
        (r, src),
        (
            ReferencePrices {
                cpu_hour: 1.25,
                gib_hour: 0.3125
            },
            [PriceSource::Derived(1); 2]
        )
    );
    // An unusable plain node does not push the GPU one out.
    let (r, _) = ReferencePrices::resolve(None, None, &[gpu, node(0.2, 0.0, 16.0)]);
    assert_eq!(r.cpu_hour, 1.25);
}

fn q(s: &str) -> Quantity {
    Quantity {
        string: Some(s.to_string()),
    }
}

fn container(cpu: Option<&str>, mem: Option<&str>, restart: Option<&str>) -> Container {
    let mut requests = BTreeMap::new();
    if let Some(c) = cpu {
        requests.insert("cpu".to_string(), q(c));
    }
    if let Some(m) = mem {
        requests.insert("memory".to_string(), q(m));
    }
    Container {
        name: Some("c".to_string()),
        resources: Some(ResourceRequirements {
            requests,
            ..Default::default()
        }),
        restart_policy: restart.map(str::to_string),
        ..Default::default()
    }
}

fn pod(containers: Vec<Container>, init: Vec<Container>, overhead: &[(&str, &str)]) -> Pod {
    Pod {
        metadata: Some(ObjectMeta {
            name: Some("p".to_string()),
            namespace: Some("default".to_string()),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            containers,
            init_containers: init,
            overhead: overhead
                .iter()
                .map(|(k, v)| (k.to_string(), q(v)))
                .collect(),
            ..Default::default()
        }),
        status: None,
    }
}

#[test]
fn requests_and_prices() {
    let refs = ReferencePrices {
        cpu_hour: 0.04,
        gib_hour: 0.005,
    };
    // (name, pod, cpu cores, memory GiB)
    let cases = vec![
        ("empty pod", Pod::default(), 0.0, 0.0),
        (
            "no requests",
            pod(vec![container(None, None, None)], vec![], &[]),
            0.0,
            0.0,
        ),
        (
            "containers summed",
            pod(
                vec![
                    container(Some("500m"), Some("1Gi"), None),
                    container(Some("1500m"), Some("512Mi"), None),
                ],
                vec![],
                &[],
            ),
            2.0,
            1.5,
        ),
        (
            "init container larger than containers",
            pod(
                vec![container(Some("1"), Some("1Gi"), None)],
                vec![
                    container(Some("3"), Some("256Mi"), None),
                    container(Some("2"), Some("2Gi"), None),
                ],
                &[],
            ),
            3.0,
            2.0,
        ),
        (
            "sidecar adds to containers and to later init containers",
            pod(
                vec![container(Some("1"), Some("1Gi"), None)],
                vec![
                    container(Some("500m"), Some("512Mi"), Some("Always")),
                    container(Some("2"), Some("1Gi"), None),
                ],
                &[],
            ),
            // init peak: 2 + 0.5 = 2.5 cores, 1 + 0.5 GiB; running: 1 + 0.5 cores, 1.5 GiB
            2.5,
            1.5,
        ),
        (
            "init container before a sidecar does not see it",
            pod(
                vec![container(Some("1"), Some("1Gi"), None)],
                vec![
                    container(Some("2"), Some("1Gi"), None),
                    container(Some("500m"), Some("512Mi"), Some("Always")),
                ],
                &[],
            ),
            2.0,
            1.5,
        ),
        (
            "overhead added",
            pod(
                vec![container(Some("1"), Some("1Gi"), None)],
                vec![],
                &[("cpu", "250m"), ("memory", "256Mi")],
            ),
            1.25,
            1.25,
        ),
        (
            "malformed quantity counts 0",
            pod(
                vec![container(Some("lots"), Some("2Gi"), None)],
                vec![],
                &[],
            ),
            0.0,
            2.0,
        ),
    ];
    for (name, p, cpu, gib) in cases {
        let r = pod_requests(&p);
        assert!(
            close(r.cpu_cores, cpu),
            "{name}: cpu {} != {cpu}",
            r.cpu_cores
        );
        assert!(
            close(r.memory_gib, gib),
            "{name}: memory {} != {gib}",
            r.memory_gib
        );
        let want = (cpu * 0.04 + gib * 0.005) * 2.0;
        let got = pod_price(&p, &refs, 2.0);
        assert!(close(got, want), "{name}: price {got} != {want}");
        assert_eq!(pod_price(&p, &refs, 0.0), 0.0, "{name}");
        assert_eq!(pod_price(&p, &refs, -1.0), 0.0, "{name}");
    }
}

#[test]
fn pod_level_resources_replace_container_sum() {
    let mut p = pod(
        vec![container(Some("1"), Some("1Gi"), None)],
        vec![],
        &[("cpu", "100m")],
    );
    if let Some(spec) = p.spec.as_mut() {
        let mut requests = BTreeMap::new();
        requests.insert("cpu".to_string(), q("4"));
        spec.resources = Some(ResourceRequirements {
            requests,
            ..Default::default()
        });
    }
    let r = pod_requests(&p);
    assert!(close(r.cpu_cores, 4.1), "{r:?}");
    assert!(close(r.memory_gib, 1.0), "{r:?}");
}

#[test]
fn decode_round_trip() {
    let p = pod(
        vec![container(Some("250m"), Some("64Mi"), None)],
        vec![container(Some("1"), None, Some("Always"))],
        &[("memory", "10Mi")],
    );
    let bytes = p.encode_to_vec();
    let decoded = decode_pod(&bytes);
    assert_eq!(decoded.as_ref().ok(), Some(&p));
    let r = decoded.map(|p| pod_requests(&p)).unwrap_or_default();
    assert!(
        close(r.cpu_cores, 1.25) && close(r.memory_gib, 74.0 / 1024.0),
        "{r:?}"
    );
    assert_eq!(decode_pod(&[]), Ok(Pod::default()));
    let garbage = decode_pod(&[0xff, 0xff, 0xff]).unwrap_err();
    assert!(
        garbage
            .to_string()
            .starts_with("pod_bytes is not a v1.Pod: "),
        "{garbage}"
    );
    assert!(
        std::error::Error::source(&garbage).is_some_and(|e| e.is::<prost::DecodeError>()),
        "{garbage:?}"
    );
    assert!(decode_pod(b"k8s\x00garbage").is_err());
}
