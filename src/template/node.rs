//! The template node itself: its summary for `check` and pricing, and the `v1.Node` CA simulates.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as api;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::node_capacity::{Capacity, Size};
use super::{Group, LABEL_ARCH, LABEL_OS, NODE_GROUP_ANNOTATION, TemplateSummary};
use crate::capi::Taint;

pub(super) fn summary(
    group: &Group,
    capacity: &Capacity,
    size: Size,
    name: String,
    labels: BTreeMap<String, String>,
    taints: Vec<Taint>,
) -> TemplateSummary {
    // A Node of the group may have replaced what the template said.
    let label = |key: &str| labels.get(key).cloned().unwrap_or_default();
    TemplateSummary {
        name,
        cpu: size.cpu.quantity,
        cpu_cores: size.cpu.value,
        memory: size.memory.quantity,
        memory_gib: size.memory.value / (1024.0 * 1024.0 * 1024.0),
        ephemeral_storage: capacity.amount("ephemeral-storage").map(|a| a.quantity),
        gpu: capacity.gpu.clone().map(|g| (g.resource, g.count)),
        pods: capacity.pods,
        arch: label(LABEL_ARCH),
        os: label(LABEL_OS),
        labels,
        taints,
        capacity_source: capacity.source(group.template_id()),
        zone: None,
    }
}

/// The Node of `summary`, with the whole capacity allocatable.
pub(super) fn node(summary: &TemplateSummary, capacity: &Capacity, group_id: &str) -> api::Node {
    let quantities = capacity.quantities();
    api::Node {
        metadata: ObjectMeta {
            name: Some(summary.name.clone()),
            labels: Some(summary.labels.clone()),
            annotations: Some(BTreeMap::from([(
                NODE_GROUP_ANNOTATION.to_string(),
                group_id.to_string(),
            )])),
            ..Default::default()
        },
        spec: Some(api::NodeSpec {
            taints: node_taints(&summary.taints),
            ..Default::default()
        }),
        status: Some(api::NodeStatus {
            capacity: Some(quantities.clone()),
            allocatable: Some(quantities),
            conditions: Some(healthy_conditions()),
            node_info: Some(api::NodeSystemInfo {
                architecture: summary.arch.clone(),
                operating_system: summary.os.clone(),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

/// `None` rather than an empty list, as the apiserver returns a Node without taints.
fn node_taints(taints: &[Taint]) -> Option<Vec<api::Taint>> {
    (!taints.is_empty()).then(|| {
        taints
            .iter()
            .map(|t| api::Taint {
                key: t.key.clone(),
                value: (!t.value.is_empty()).then(|| t.value.clone()),
                effect: t.effect.clone(),
                time_added: None,
            })
            .collect()
    })
}

/// CA simulates pods on the node as it will be once up: ready, with no pressure.
fn healthy_conditions() -> Vec<api::NodeCondition> {
    let condition = |type_: &str, status: &str, reason: &str| api::NodeCondition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: Some(reason.to_string()),
        ..Default::default()
    };
    vec![
        condition("Ready", "True", "KubeletReady"),
        condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
        condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
        condition("PIDPressure", "False", "KubeletHasSufficientPID"),
        condition("NetworkUnavailable", "False", "RouteCreated"),
    ]
}

/// `<resource name>-template-<8 hex of a hash of the group id>`: deterministic, distinct per group, at most
/// 63 characters so that it is also a valid `kubernetes.io/hostname` value.
pub(super) fn node_name(resource_name: &str, group_id: &str) -> String {
    const SUFFIX: &str = "-template-";
    let base: String = resource_name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.')
        .map(|c| c.to_ascii_lowercase())
        .take(63 - SUFFIX.len() - 8)
        .collect();
    let base = base.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    let base = if base.is_empty() { "node" } else { base };
    format!("{base}{SUFFIX}{:08x}", fnv1a32(group_id.as_bytes()))
}

fn fnv1a32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}
