//! Scale from zero: every capacity annotation (`capacity.cluster-autoscaler.kubernetes.io/{cpu, memory,
//! ephemeral-disk, gpu-type, gpu-count, maxPods, labels, taints}`) on a scalable resource, with or without
//! an infrastructure template's `status.capacity`/`status.nodeInfo`, template taints and labels, a Node's
//! labels and `CAPI_SCALE_ZERO_DEFAULT_ARCH`, through `template::build`.
//!
//! Contract: no panic; every problem names the resource (or the infrastructure template, or the
//! environment) and a field that is there (an annotation that is present, `status.capacity[…]`,
//! `spec.template.spec.taints[i]`, …; or the cpu/memory/gpu-type/gpu-count annotation that is missing); a
//! template has positive cpu and memory, at least one pod, capacity = allocatable in quantities that parse,
//! valid taints, valid labels (but for the ones copied verbatim from the Node or the infrastructure
//! template), a valid hostname, the capacity annotations' values where they are valid, and protobuf bytes
//! that decode to a Node of that name; a zero-size group without a template has a problem saying why.
#![no_main]

use std::collections::BTreeMap;

use capi_autoscaler_provider::capi::names::{is_label_value, is_qualified_name};
use capi_autoscaler_provider::capi::quantity::parse_quantity;
use capi_autoscaler_provider::capi::{
    InfraRef, InfraTemplate, Labels, MachineTemplate, ObjectKey, ScalableKind, ScalableResource,
    Taint, capacity,
};
use capi_autoscaler_provider::grpc::template_bytes;
use capi_autoscaler_provider::template::{
    self, InfraSource, LABEL_ARCH, LABEL_HOSTNAME, LABEL_OS, NODE_LABELS_COPIED, TemplateInputs,
};
use capi_autoscaler_provider_fuzz::{annotation_field, annotations, text, text_of};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use prost::Message;

const OBJECT: &str = "MachineDeployment ns/md-0";
const TEMPLATE_OBJECT: &str = "DockerMachineTemplate ns/tpl";
const KEYS: [&str; 8] = [
    capacity::CPU,
    capacity::MEMORY,
    capacity::EPHEMERAL_DISK,
    capacity::GPU_TYPE,
    capacity::GPU_COUNT,
    capacity::MAX_PODS,
    capacity::TAINTS,
    capacity::LABELS,
];
const TOKENS: &[&str] = &[
    "0",
    "1",
    "2",
    "4",
    "16",
    "110",
    "500m",
    "16Gi",
    "1Ki",
    "1e3",
    "2E",
    ".5",
    "-1",
    "+",
    " ",
    "Mi",
    "G",
    "m",
    "n",
    "e",
    ".",
    "nvidia.com/gpu",
    "amd.com/gpu",
    "gpu",
    "example.com/",
    "a",
    "=",
    ",",
    ":",
    "/",
    "-",
    "_",
    "NoSchedule",
    "NoExecute",
    "PreferNoSchedule",
    "node-role.kubernetes.io/x",
    "cluster-api/accelerator",
    "kubernetes.io/arch",
    "amd64",
    "arm64",
];
const RESOURCES: &[&str] = &[
    "cpu",
    "memory",
    "pods",
    "ephemeral-storage",
    "nvidia.com/gpu",
    "amd.com/gpu",
    "kubernetes.io/x",
    "example.com/dongle",
    "bad name",
];

fn map(u: &mut Unstructured, keys: &[&str]) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for _ in 0..u.int_in_range(0..=3)? {
        out.insert(u.choose(keys)?.to_string(), text_of(u, TOKENS, 3)?);
    }
    Ok(out)
}

fn run(u: &mut Unstructured) -> Result<()> {
    let annotations = annotations(u, &KEYS, TOKENS)?;
    let mut taints = Vec::new();
    for _ in 0..u.int_in_range(0..=2)? {
        taints.push(Taint {
            key: text_of(u, TOKENS, 2)?,
            value: text_of(u, TOKENS, 2)?,
            effect: text_of(u, TOKENS, 1)?,
        });
    }
    let template_labels = map(
        u,
        &[
            "node-role.kubernetes.io/worker",
            "node.cluster.x-k8s.io/pool",
            "a.node.cluster.x-k8s.io/b",
            "other/x",
            "plain",
        ],
    )?;
    let resource = ScalableResource {
        kind: ScalableKind::MachineDeployment,
        key: ObjectKey::new("ns", "md-0"),
        uid: "uid".into(),
        resource_version: "1".into(),
        labels: Labels::default(),
        annotations: Labels::from(annotations.clone()),
        cluster_name: "c".into(),
        replicas: u.arbitrary()?,
        status_replicas: None,
        generation: None,
        observed_generation: None,
        rolling_out: false,
        preflight: None,
        paused: false,
        owners: Vec::new(),
        template: MachineTemplate {
            labels: Labels::from(template_labels.clone()),
            infrastructure_ref: Some(Ok(InfraRef {
                api_group: "infrastructure.cluster.x-k8s.io".into(),
                api_version: None,
                kind: "DockerMachineTemplate".into(),
                name: "tpl".into(),
            })),
            taints,
            failure_domain: u
                .arbitrary::<bool>()?
                .then(|| text(u, TOKENS))
                .transpose()?,
        },
        provider_id_list: Vec::new(),
        topology: None,
    };
    let infra_template = InfraTemplate {
        key: ObjectKey::new("ns", "tpl"),
        api_group: "infrastructure.cluster.x-k8s.io".into(),
        kind: "DockerMachineTemplate".into(),
        capacity: map(u, RESOURCES)?,
        architecture: u
            .arbitrary::<bool>()?
            .then(|| text_of(u, TOKENS, 2))
            .transpose()?,
        operating_system: u
            .arbitrary::<bool>()?
            .then(|| text_of(u, TOKENS, 2))
            .transpose()?,
    };
    let infra = match u.int_in_range(0..=2)? {
        0 => InfraSource::NoReference,
        1 => InfraSource::Found(&infra_template),
        _ => InfraSource::Unavailable {
            reason: "forbidden".into(),
        },
    };
    let from_template = matches!(infra, InfraSource::Found(_));
    let node_labels = if u.ratio(1, 4)? {
        Some(map(u, &NODE_LABELS_COPIED)?)
    } else {
        None
    };
    let default_arch = u
        .arbitrary::<bool>()?
        .then(|| text_of(u, &["amd64", "arm64", "s390x", "x"], 2))
        .transpose()?;
    let inputs = TemplateInputs {
        group_id: "MachineDeployment/ns/md-0",
        resource: &resource,
        infra,
        node_labels: node_labels.as_ref(),
        default_arch: default_arch.as_deref(),
        failure_domain_zone: None,
    };
    let outcome = template::build(&inputs);

    for p in &outcome.problems {
        assert!(!p.message.is_empty(), "{p:?}");
        let named = match p.object.to_string().as_str() {
            OBJECT => {
                let annotation = KEYS.iter().find(|k| p.field == annotation_field(k));
                match annotation {
                    Some(k) => {
                        annotations.contains_key(*k)
                            || [
                                capacity::CPU,
                                capacity::MEMORY,
                                capacity::GPU_TYPE,
                                capacity::GPU_COUNT,
                            ]
                            .contains(k)
                    }
                    None => {
                        p.field == "spec.template.spec.infrastructureRef"
                            || p.field
                                .strip_prefix("spec.template.spec.taints[")
                                .is_some_and(|i| {
                                    i.strip_suffix(']')
                                        .and_then(|i| i.parse::<usize>().ok())
                                        .is_some_and(|i| i < resource.template.taints.len())
                                })
                    }
                }
            }
            TEMPLATE_OBJECT => p.field.strip_prefix("status.capacity[").is_some_and(|r| {
                r.strip_suffix(']')
                    .is_some_and(|r| from_template && infra_template.capacity.contains_key(r))
            }),
            "environment" => p.field == "CAPI_SCALE_ZERO_DEFAULT_ARCH",
            _ => false,
        };
        assert!(named, "problem names no field that is there: {p:?}");
    }

    let Some(t) = &outcome.template else {
        if resource.replicas.unwrap_or(0) == 0 {
            assert!(
                outcome
                    .problems
                    .iter()
                    .any(|p| p.message.contains("cpu/memory")),
                "no template and no reason: {:?}",
                outcome.problems
            );
        }
        return Ok(());
    };
    let s = &t.summary;
    assert!(s.cpu_cores > 0.0 && s.cpu_cores.is_finite(), "{s:?}");
    assert!(s.memory_gib > 0.0 && s.memory_gib.is_finite(), "{s:?}");
    assert!(s.pods >= 1, "{s:?}");
    let status = t.node.status.as_ref().expect("status");
    let capacity = status.capacity.as_ref().expect("capacity");
    assert_eq!(Some(capacity), status.allocatable.as_ref());
    for (res, q) in capacity {
        assert!(is_qualified_name(res), "resource {res:?}");
        let v = parse_quantity(&q.0).unwrap_or_else(|e| panic!("capacity {res}: {e}"));
        if res == "pods" || res.contains('/') && !res.starts_with("kubernetes.io/") {
            assert_eq!(v.fract(), 0.0, "{res}={}", q.0);
        }
    }
    assert_eq!(
        capacity.get("cpu").map(|q| q.0.as_str()),
        Some(s.cpu.as_str())
    );
    assert_eq!(
        capacity.get("memory").map(|q| q.0.as_str()),
        Some(s.memory.as_str())
    );
    if let Some((res, n)) = &s.gpu {
        assert!(*n >= 1 && capacity.contains_key(res), "{s:?}");
    }
    // A valid annotation wins over the template.
    for (key, res) in [(capacity::CPU, "cpu"), (capacity::MEMORY, "memory")] {
        if let Some(raw) = annotations.get(key).map(|v| v.trim())
            && parse_quantity(raw).is_ok_and(|v| v > 0.0)
        {
            assert_eq!(capacity.get(res).map(|q| q.0.as_str()), Some(raw), "{key}");
        }
    }
    if let Some(n) = annotations
        .get(capacity::MAX_PODS)
        .and_then(|v| v.trim().parse::<i64>().ok())
        .filter(|n| *n > 0)
    {
        assert_eq!(s.pods, n);
    }
    for taint in &s.taints {
        assert!(
            is_qualified_name(&taint.key)
                && is_label_value(&taint.value)
                && ["NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&taint.effect.as_str()),
            "{taint:?}"
        );
    }
    let verbatim = |k: &str| {
        k == LABEL_ARCH
            || k == LABEL_OS
            || template_labels.contains_key(k)
            || node_labels.as_ref().is_some_and(|n| n.contains_key(k))
    };
    for (k, v) in &s.labels {
        if !verbatim(k) {
            assert!(
                is_qualified_name(k) && is_label_value(v),
                "label {k:?}={v:?}"
            );
        }
    }
    assert!(
        s.name.len() <= 63 && is_label_value(&s.name),
        "name {:?}",
        s.name
    );
    // The hostname label is the node's name, unless the labels annotation sets it (it wins, as every
    // label it sets; CA renames simulated nodes and their hostname label anyway).
    if !annotations
        .get(capacity::LABELS)
        .is_some_and(|l| l.contains(LABEL_HOSTNAME))
    {
        assert_eq!(s.labels.get(LABEL_HOSTNAME), Some(&s.name));
    }
    let bytes = template_bytes(t);
    let decoded = k8s_pb::api::core::v1::Node::decode(&bytes[..]).expect("template bytes decode");
    assert_eq!(decoded.encode_to_vec(), bytes);
    assert_eq!(
        decoded.metadata.and_then(|m| m.name).as_deref(),
        Some(s.name.as_str())
    );
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
