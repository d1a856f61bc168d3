//! A template's labels and taints: its platform, failure domain, GPU, managed labels, the annotations,
//! and what an existing Node of the group shows.

use std::collections::BTreeMap;

use super::annotations::{parse_labels_annotation, parse_taints_annotation, validate_taint};
use super::node_capacity::Gpu;
use super::zone::{Zone, ZoneSource};
use super::{
    DEFAULT_OS, Group, LABEL_ARCH, LABEL_HOSTNAME, LABEL_OS, LABEL_ZONE, NODE_LABELS_COPIED,
    TemplateInputs, default_arch,
};
use crate::capi::names::is_label_value;
use crate::capi::{GPU_LABEL, Taint};
use crate::problem::Problem;

const MANAGED_LABEL_DOMAINS: [&str; 3] = [
    "node-role.kubernetes.io",
    "node-restriction.kubernetes.io",
    "node.cluster.x-k8s.io",
];

/// The node's architecture and operating system before a Node of the group says otherwise.
struct Platform {
    arch: String,
    os: String,
}

fn platform(
    group: &Group,
    default_arch_env: Option<&str>,
    problems: &mut Vec<Problem>,
) -> Platform {
    fn declared(value: Option<&str>) -> Option<&str> {
        value.map(str::trim).filter(|v| !v.is_empty())
    }
    let template_arch = declared(group.template.and_then(|t| t.architecture.as_deref()));
    let template_os = declared(group.template.and_then(|t| t.operating_system.as_deref()));
    let (fallback_arch, arch_problem) = default_arch(default_arch_env);
    // A bad default matters only where it is used.
    if template_arch.is_none()
        && let Some(p) = arch_problem
    {
        problems.push(p);
    }
    Platform {
        arch: template_arch.unwrap_or(fallback_arch).to_string(),
        os: template_os.unwrap_or(DEFAULT_OS).to_string(),
    }
}

/// Lowest precedence first: each source overrides the ones before it, and what a real Node of the group
/// shows wins. Also says where the zone label came from.
pub(super) fn labels(
    inputs: &TemplateInputs,
    group: &Group,
    name: &str,
    gpu: Option<&Gpu>,
    problems: &mut Vec<Problem>,
) -> (BTreeMap<String, String>, Option<Zone>) {
    let r = group.resource;
    let platform = platform(group, inputs.default_arch, problems);
    let mut labels = BTreeMap::from([
        (LABEL_ARCH.to_string(), platform.arch),
        (LABEL_OS.to_string(), platform.os),
        (LABEL_HOSTNAME.to_string(), name.to_string()),
    ]);
    let mut zone_source = None;
    if let Some(fd) = r.template.failure_domain.as_deref().map(str::trim)
        && !fd.is_empty()
    {
        let failure_domain = fd.to_string();
        if let Some(seen) = inputs.failure_domain_zone {
            labels.insert(LABEL_ZONE.to_string(), seen.zone.clone());
            zone_source = Some(ZoneSource::FailureDomainNodes {
                failure_domain,
                nodes: seen.nodes,
            });
        } else if is_label_value(fd) {
            labels.insert(LABEL_ZONE.to_string(), failure_domain.clone());
            zone_source = Some(ZoneSource::FailureDomain { failure_domain });
        }
    }
    // GPUs declared by the annotations or published by the infrastructure template both label the node,
    // so CA's GPU accounting sees them; a `cluster-api/accelerator` in the labels annotation wins below.
    if let Some(g) = gpu {
        labels.insert(GPU_LABEL.to_string(), gpu_label_value(&g.resource));
    }
    labels.extend(
        r.template
            .labels
            .iter()
            .filter(|(k, _)| is_managed_label(k))
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let annotated = parse_labels_annotation(&group.object, group.annotations(), problems);
    if annotated.iter().any(|(k, _)| k == LABEL_ZONE) {
        zone_source = Some(ZoneSource::Annotation);
    }
    labels.extend(annotated);
    if let Some(node_labels) = inputs.node_labels {
        if node_labels.get(LABEL_ZONE).is_some_and(|v| !v.is_empty()) {
            zone_source = Some(ZoneSource::GroupNode);
        }
        labels.extend(NODE_LABELS_COPIED.iter().filter_map(|key| {
            node_labels
                .get(*key)
                .filter(|v| !v.is_empty())
                .map(|v| (key.to_string(), v.clone()))
        }));
    }
    let zone = zone_source.and_then(|source| {
        labels.get(LABEL_ZONE).map(|value| Zone {
            value: value.clone(),
            source,
        })
    });
    (labels, zone)
}

/// The Machine template's valid taints, then the annotation's; one of the annotation replaces a taint of the
/// same key and effect, as a Node may carry only one of each.
pub(super) fn taints(group: &Group, problems: &mut Vec<Problem>) -> Vec<Taint> {
    let mut taints: Vec<Taint> = Vec::new();
    for (i, t) in group.resource.template.taints.iter().enumerate() {
        match validate_taint(t) {
            Ok(()) => taints.push(t.clone()),
            Err(e) => problems.push(Problem::new(
                &group.object,
                format!("spec.template.spec.taints[{i}]"),
                format!("{e}; ignored"),
            )),
        }
    }
    for t in parse_taints_annotation(&group.object, group.annotations(), problems) {
        match taints
            .iter_mut()
            .find(|e| e.key == t.key && e.effect == t.effect)
        {
            Some(existing) => *existing = t,
            None => taints.push(t),
        }
    }
    taints
}

/// The GPU label value for a GPU resource: itself when it is a valid label value, else with every invalid
/// character replaced by `-` (`nvidia.com/gpu` → `nvidia.com-gpu`). Users who need a specific value
/// (`--gpu-total` matches on it) set `cluster-api/accelerator` in the labels annotation, which wins.
pub(super) fn gpu_label_value(resource: &str) -> String {
    if is_label_value(resource) {
        return resource.to_string();
    }
    let v: String = resource
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    v.trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}

fn is_managed_label(key: &str) -> bool {
    let Some((prefix, _)) = key.split_once('/') else {
        return false;
    };
    prefix == MANAGED_LABEL_DOMAINS[0]
        || MANAGED_LABEL_DOMAINS[1..]
            .iter()
            .any(|d| prefix == *d || prefix.strip_suffix(*d).is_some_and(|p| p.ends_with('.')))
}
