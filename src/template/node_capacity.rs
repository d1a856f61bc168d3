//! A template's capacity: the infrastructure template's `status.capacity`, overridden key by key by
//! the capacity annotations, its GPU and its `pods`.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::annotations::parse_count;
use super::{CapacitySource, DEFAULT_MAX_PODS, Group};
use crate::capi::capacity;
use crate::capi::names::is_qualified_name;
use crate::capi::quantity::parse_quantity;
use crate::problem::Problem;

/// Extended resources CA recognises as GPUs.
const GPU_RESOURCES: [&str; 5] = [
    "nvidia.com/gpu",
    "amd.com/gpu",
    "habana.ai/gaudi",
    "gpu.intel.com/xe",
    "microsoft.com/directx",
];

/// Where a capacity entry came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Template,
    Annotation,
    /// The default `pods`.
    Default,
}

/// One resource of the capacity.
struct Entry {
    /// As written (trimmed): the Node carries it verbatim.
    quantity: String,
    value: f64,
    origin: Origin,
}

impl Entry {
    fn count(n: i64, origin: Origin) -> Entry {
        Entry {
            quantity: n.to_string(),
            value: n as f64,
            origin,
        }
    }
}

/// A positive amount of a resource.
pub(super) struct Amount {
    pub(super) quantity: String,
    pub(super) value: f64,
}

/// What a template cannot do without: a node with no cpu or memory tells CA nothing about what fits on it.
pub(super) struct Size {
    pub(super) cpu: Amount,
    pub(super) memory: Amount,
}

/// A GPU resource of the template.
#[derive(Clone)]
pub(super) struct Gpu {
    /// The extended resource name, e.g. `nvidia.com/gpu`.
    pub(super) resource: String,
    pub(super) count: i64,
}

pub(super) struct Capacity {
    /// By resource name.
    entries: BTreeMap<String, Entry>,
    pub(super) gpu: Option<Gpu>,
    pub(super) pods: i64,
}

impl Capacity {
    /// Zero is as good as absent: a node with none of a resource offers none of it.
    pub(super) fn amount(&self, resource: &str) -> Option<Amount> {
        self.entries
            .get(resource)
            .filter(|e| e.value > 0.0)
            .map(|e| Amount {
                quantity: e.quantity.clone(),
                value: e.value,
            })
    }

    pub(super) fn size(&self) -> Option<Size> {
        Some(Size {
            cpu: self.amount("cpu")?,
            memory: self.amount("memory")?,
        })
    }

    /// The default `pods` does not count: it says nothing about the machines.
    pub(super) fn source(&self, template_id: Option<String>) -> CapacitySource {
        let from = |origin| self.entries.values().any(|e| e.origin == origin);
        match (
            from(Origin::Annotation),
            from(Origin::Template),
            template_id,
        ) {
            (true, true, Some(id)) => CapacitySource::Both(id),
            (false, true, Some(id)) => CapacitySource::InfraTemplate(id),
            _ => CapacitySource::Annotations,
        }
    }

    pub(super) fn quantities(&self) -> BTreeMap<String, Quantity> {
        self.entries
            .iter()
            .map(|(res, e)| (res.clone(), Quantity(e.quantity.clone())))
            .collect()
    }
}

/// The template's capacity, overridden key by key by the annotations.
pub(super) fn capacity(group: &Group, problems: &mut Vec<Problem>) -> Capacity {
    let mut entries = template_capacity(group, problems);
    annotated_capacity(group, &mut entries, problems);
    let annotated = annotated_gpu(group, problems);
    if let Some(g) = &annotated {
        entries.insert(
            g.resource.clone(),
            Entry::count(g.count, Origin::Annotation),
        );
    }
    let gpu = annotated.or_else(|| known_gpu(&entries));
    let pods = pods(group, &mut entries, problems);
    Capacity { entries, gpu, pods }
}

fn template_capacity(group: &Group, problems: &mut Vec<Problem>) -> BTreeMap<String, Entry> {
    let mut entries = BTreeMap::new();
    let (Some(t), Some(tobj)) = (group.template, group.template_object()) else {
        return entries;
    };
    for (res, raw) in &t.capacity {
        let field = format!("status.capacity[{res}]");
        if !is_qualified_name(res) {
            problems.push(Problem::new(
                &tobj,
                field,
                "not a valid resource name; ignored",
            ));
            continue;
        }
        match parse_quantity(raw) {
            // The apiserver rejects a Node with a fractional count of pods or of an extended resource.
            Ok(v) if must_be_whole(res) && v.fract() != 0.0 => problems.push(Problem::new(
                &tobj,
                field,
                format!("{raw:?} is not a whole number, which {res} must be; ignored"),
            )),
            Ok(v) => {
                entries.insert(
                    res.clone(),
                    Entry {
                        quantity: raw.trim().to_string(),
                        value: v,
                        origin: Origin::Template,
                    },
                );
            }
            Err(e) => problems.push(Problem::new(&tobj, field, format!("{e}; ignored"))),
        }
    }
    entries
}

/// `cpu`, `memory` and `ephemeral-storage` from their annotations.
fn annotated_capacity(
    group: &Group,
    entries: &mut BTreeMap<String, Entry>,
    problems: &mut Vec<Problem>,
) {
    for (key, res) in [
        (capacity::CPU, "cpu"),
        (capacity::MEMORY, "memory"),
        (capacity::EPHEMERAL_DISK, "ephemeral-storage"),
    ] {
        let raw = group.annotations().get(key).map(|v| v.trim()).unwrap_or("");
        if raw.is_empty() {
            continue;
        }
        match parse_quantity(raw) {
            // zero is "not set", as upstream: the template's value, if any, shows through
            Ok(v) => {
                if v != 0.0 {
                    entries.insert(
                        res.to_string(),
                        Entry {
                            quantity: raw.to_string(),
                            value: v,
                            origin: Origin::Annotation,
                        },
                    );
                }
            }
            Err(e) => problems.push(Problem::new(
                &group.object,
                Problem::annotation_field(key),
                format!("{e}; ignored"),
            )),
        }
    }
}

/// The GPU of `gpu-type` and `gpu-count`; either without the other is a problem, not a guess.
fn annotated_gpu(group: &Group, problems: &mut Vec<Problem>) -> Option<Gpu> {
    let annotations = group.annotations();
    let object = &group.object;
    let gpu_type = annotations
        .get(capacity::GPU_TYPE)
        .map(|v| v.trim())
        .unwrap_or("");
    let gpu_count = parse_count(object, annotations, capacity::GPU_COUNT, problems);
    let without = |set: &str, unset: &str, unset_short: &str| {
        Problem::new(
            object,
            Problem::annotation_field(unset),
            format!("{set} is set but {unset_short} is not; no GPU in the template"),
        )
    };
    match (gpu_type.is_empty(), gpu_count) {
        (false, Some(n)) if n > 0 => {
            // an extended resource: a Node's capacity takes no other name without a domain
            if gpu_type.contains('/') && is_qualified_name(gpu_type) {
                return Some(Gpu {
                    resource: gpu_type.to_string(),
                    count: n,
                });
            }
            problems.push(Problem::new(
                object,
                Problem::annotation_field(capacity::GPU_TYPE),
                format!("{gpu_type:?} is not a valid extended resource name (e.g. nvidia.com/gpu); no GPU in the template"),
            ));
        }
        (false, None)
            if annotations
                .get(capacity::GPU_COUNT)
                .is_none_or(|v| v.trim().is_empty()) =>
        {
            problems.push(without(
                capacity::GPU_TYPE,
                capacity::GPU_COUNT,
                "gpu-count",
            ))
        }
        (true, Some(n)) if n > 0 => {
            problems.push(without(capacity::GPU_COUNT, capacity::GPU_TYPE, "gpu-type"))
        }
        // neither set, a zero count, or a malformed one (reported by `parse_count`)
        _ => {}
    }
    None
}

/// Without GPU annotations, a GPU the infrastructure template publishes still makes a GPU group.
fn known_gpu(entries: &BTreeMap<String, Entry>) -> Option<Gpu> {
    GPU_RESOURCES.iter().find_map(|res| {
        entries.get(*res).filter(|e| e.value >= 1.0).map(|e| Gpu {
            resource: res.to_string(),
            count: e.value.floor() as i64,
        })
    })
}

/// The `maxPods` annotation, else the template's `pods`, else [`DEFAULT_MAX_PODS`]: a node without `pods`
/// would take no pod at all.
fn pods(group: &Group, entries: &mut BTreeMap<String, Entry>, problems: &mut Vec<Problem>) -> i64 {
    let max_pods = parse_count(
        &group.object,
        group.annotations(),
        capacity::MAX_PODS,
        problems,
    )
    .filter(|n| *n > 0);
    if let Some(n) = max_pods {
        entries.insert("pods".to_string(), Entry::count(n, Origin::Annotation));
        return n;
    }
    if let Some(e) = entries.get("pods").filter(|e| e.value >= 1.0) {
        return e.value.floor() as i64;
    }
    entries.insert(
        "pods".to_string(),
        Entry::count(DEFAULT_MAX_PODS, Origin::Default),
    );
    DEFAULT_MAX_PODS
}

/// A group with Machines has Nodes CA can copy; only a group at zero depends on this template.
pub(super) fn unsized_problem(group: &Group, capacity: &Capacity) -> Option<Problem> {
    if group.resource.replicas.unwrap_or(0) != 0 {
        return None;
    }
    let missing_key = if capacity.amount("cpu").is_none() {
        capacity::CPU
    } else {
        capacity::MEMORY
    };
    Some(Problem::new(
        &group.object,
        Problem::annotation_field(missing_key),
        format!(
            "zero-size group has no cpu/memory capacity: set {} and {} or status.capacity on {}",
            capacity::CPU,
            capacity::MEMORY,
            group.infra_described()
        ),
    ))
}

/// Pods and extended resources (`vendor.example/name`) are counted in whole units.
fn must_be_whole(resource: &str) -> bool {
    resource == "pods" || (resource.contains('/') && !resource.starts_with("kubernetes.io/"))
}
