//! Scale from zero, pure: the `v1.Node` CA simulates for a group, built from the scalable resource's
//! capacity annotations, its infrastructure template's `status`, its Machine template and, when a workload
//! cluster is watched, the labels of an existing Node of the group.
//!
//! Capacity: the infra template's `status.capacity`, overridden key by key by the capacity annotations
//! (`cpu`, `memory`, `ephemeral-disk` → `ephemeral-storage`, `gpu-type` + `gpu-count` → `<gpu-type>: count`,
//! `maxPods` → `pods`). Differences from the in-tree provider, on purpose:
//! - `pods` = the `maxPods` annotation, else the template's `status.capacity.pods`, else 110 (upstream
//!   always overrides the template's value).
//! - every malformed value is a [`Problem`] naming object and field, and is ignored (upstream swallows the
//!   error and drops the whole template); negative quantities and counts are malformed too.
//! - a template without `status.nodeInfo` gives the default arch and `linux`, not empty labels.
//! - managed labels come from `spec.template.metadata.labels` (upstream reads a path that does not exist),
//!   `topology.kubernetes.io/zone` is copied from a Node too, and the template's failure domain fills it in.
//! - GPU groups get the label `cluster-api/accelerator`.
//! - taints from the annotation must have a valid key, value and effect.
//!
//! No `cpu` or no `memory` (or a zero one) → no template: the service answers `UNIMPLEMENTED`, never OK with
//! empty bytes (DESIGN.md invariant 4).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as api;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use prost::Message;

use crate::capi::names::{is_label_value, is_qualified_name};
use crate::capi::quantity::parse_quantity;
use crate::capi::{GPU_LABEL, InfraTemplate, Keys, ScalableResource, Taint, capacity};
use crate::problem::Problem;

/// Annotation on every template node: the id of its group (pricing maps template nodes back with it).
pub const NODE_GROUP_ANNOTATION: &str = "capi-autoscaler-provider/node-group";
/// `pods` when neither the `maxPods` annotation nor the template says.
pub const DEFAULT_MAX_PODS: i64 = 110;
/// Architectures `CAPI_SCALE_ZERO_DEFAULT_ARCH` accepts (exact, as upstream).
pub const ARCHITECTURES: [&str; 4] = ["amd64", "arm64", "ppc64le", "s390x"];
pub const DEFAULT_ARCH: &str = "amd64";
pub const DEFAULT_OS: &str = "linux";

pub const LABEL_ARCH: &str = "kubernetes.io/arch";
pub const LABEL_OS: &str = "kubernetes.io/os";
pub const LABEL_HOSTNAME: &str = "kubernetes.io/hostname";
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// Copied from an existing Node of the group (non-empty values only); they win over everything else.
pub const NODE_LABELS_COPIED: [&str; 8] = [
    LABEL_ARCH,
    LABEL_OS,
    "beta.kubernetes.io/instance-type",
    "node.kubernetes.io/instance-type",
    "failure-domain.beta.kubernetes.io/region",
    "topology.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone",
    LABEL_ZONE,
    // no GPU label: it is derived from the group's annotations
];
/// Extended resources CA recognises as GPUs.
const GPU_RESOURCES: [&str; 5] = [
    "nvidia.com/gpu",
    "amd.com/gpu",
    "habana.ai/gaudi",
    "gpu.intel.com/xe",
    "microsoft.com/directx",
];
const TAINT_EFFECTS: [&str; 3] = ["NoSchedule", "PreferNoSchedule", "NoExecute"];
const MANAGED_LABEL_DOMAINS: [&str; 3] = [
    "node-role.kubernetes.io",
    "node-restriction.kubernetes.io",
    "node.cluster.x-k8s.io",
];

/// Where the infrastructure template of a group stands.
#[derive(Clone, Debug)]
pub enum InfraSource<'a> {
    /// The Machine template has no infrastructure reference.
    NoReference,
    Found(&'a InfraTemplate),
    /// Referenced but not readable: RBAC, missing, not yet synced.
    Unavailable {
        reason: String,
    },
}

pub struct TemplateInputs<'a> {
    pub keys: &'a Keys,
    /// `Kind/namespace/name`.
    pub group_id: &'a str,
    pub resource: &'a ScalableResource,
    pub infra: InfraSource<'a>,
    /// Labels of an existing Node of the group, if a workload cluster is watched.
    pub node_labels: Option<&'a BTreeMap<String, String>>,
    /// `CAPI_SCALE_ZERO_DEFAULT_ARCH`.
    pub default_arch: Option<&'a str>,
}

#[derive(Clone, Debug)]
pub struct TemplateOutcome {
    /// `None` when the group cannot be described (no cpu or no memory).
    pub template: Option<TemplateNode>,
    pub problems: Vec<Problem>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TemplateNode {
    pub node: api::Node,
    pub summary: TemplateSummary,
}

/// Where the capacity came from (the default `pods` does not count). Serialized as its text.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(into = "String")]
pub enum CapacitySource {
    Annotations,
    /// `Kind/name` of the infrastructure template.
    InfraTemplate(String),
    /// Both; `Kind/name` of the infrastructure template.
    Both(String),
}

impl std::fmt::Display for CapacitySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CapacitySource::Annotations => f.write_str("annotations"),
            CapacitySource::InfraTemplate(t) => write!(f, "template {t}"),
            CapacitySource::Both(t) => write!(f, "annotations over template {t}"),
        }
    }
}

impl From<CapacitySource> for String {
    fn from(source: CapacitySource) -> String {
        source.to_string()
    }
}

/// What `check` shows of a template, and what pricing needs of it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TemplateSummary {
    pub name: String,
    /// The cpu quantity as written, and in cores.
    pub cpu: String,
    pub cpu_cores: f64,
    /// The memory quantity as written, and in GiB.
    pub memory: String,
    pub memory_gib: f64,
    /// `ephemeral-storage` as written.
    pub ephemeral_storage: Option<String>,
    /// (extended resource name, e.g. `nvidia.com/gpu`; count): from the gpu annotations, else the first
    /// GPU resource CA knows in the template's capacity.
    pub gpu: Option<(String, i64)>,
    pub pods: i64,
    pub arch: String,
    pub os: String,
    pub labels: BTreeMap<String, String>,
    /// Serialized as `key=value:Effect`.
    #[serde(serialize_with = "serialize_taints")]
    pub taints: Vec<Taint>,
    pub capacity_source: CapacitySource,
}

fn serialize_taints<S: serde::Serializer>(taints: &[Taint], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let mut seq = s.serialize_seq(Some(taints.len()))?;
    for t in taints {
        seq.serialize_element(&taint_string(t))?;
    }
    seq.end()
}

/// `key=value:Effect` (`key:Effect` without a value).
pub fn taint_string(t: &Taint) -> String {
    if t.value.is_empty() {
        format!("{}:{}", t.key, t.effect)
    } else {
        format!("{}={}:{}", t.key, t.value, t.effect)
    }
}

/// Validates `CAPI_SCALE_ZERO_DEFAULT_ARCH`: unset or empty → amd64; one of [`ARCHITECTURES`] → itself;
/// anything else → amd64 and the problem to report.
pub fn default_arch(value: Option<&str>) -> (&'static str, Option<Problem>) {
    match value {
        None | Some("") => (DEFAULT_ARCH, None),
        Some(v) => match ARCHITECTURES.iter().find(|a| **a == v) {
            Some(a) => (a, None),
            None => (
                DEFAULT_ARCH,
                Some(Problem::new(
                    "environment",
                    "CAPI_SCALE_ZERO_DEFAULT_ARCH",
                    format!(
                        "unrecognized architecture {v:?} (expected one of {}); amd64 is used",
                        ARCHITECTURES.join(", ")
                    ),
                )),
            ),
        },
    }
}

/// Where a capacity entry came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Template,
    Annotation,
    /// The default `pods`.
    Default,
}

/// Builds the template node of one group. Never panics; every malformed input is a problem.
pub fn build(inputs: &TemplateInputs) -> TemplateOutcome {
    let r = inputs.resource;
    let object = format!("{} {}", r.kind, r.key);
    let mut problems = Vec::new();
    let annotations = &r.annotations;

    // ---- the infrastructure template
    let infra_name = match &r.template.infrastructure_ref {
        Some(Ok(iref)) => Some(format!("{} {}/{}", iref.kind, r.key.namespace, iref.name)),
        _ => None,
    };
    let template = match &inputs.infra {
        InfraSource::Found(t) => Some(*t),
        InfraSource::NoReference => None,
        InfraSource::Unavailable { reason } => {
            let what = infra_name
                .clone()
                .unwrap_or_else(|| "the infrastructure template".to_string());
            problems.push(Problem::new(
                object.clone(),
                "spec.template.spec.infrastructureRef",
                format!(
                    "{what} is unavailable: {reason}; scale from zero uses the capacity annotations alone"
                ),
            ));
            None
        }
    };
    let template_id = template.map(|t| format!("{}/{}", t.kind, t.key.name));
    let template_object = template.map(|t| format!("{} {}", t.kind, t.key));

    // ---- capacity
    // resource name → (quantity string, value, where from)
    let mut cap: BTreeMap<String, (String, f64, Origin)> = BTreeMap::new();
    if let (Some(t), Some(tobj)) = (template, template_object.as_deref()) {
        for (res, raw) in &t.capacity {
            let field = format!("status.capacity[{res}]");
            if !is_qualified_name(res) {
                problems.push(Problem::new(
                    tobj,
                    field,
                    "not a valid resource name; ignored",
                ));
                continue;
            }
            match parse_quantity(raw) {
                // The apiserver rejects a Node with a fractional count of pods or of an extended resource.
                Ok(v) if must_be_whole(res) && v.fract() != 0.0 => problems.push(Problem::new(
                    tobj,
                    field,
                    format!("{raw:?} is not a whole number, which {res} must be; ignored"),
                )),
                Ok(v) => {
                    cap.insert(res.clone(), (raw.trim().to_string(), v, Origin::Template));
                }
                Err(e) => problems.push(Problem::new(tobj, field, format!("{e}; ignored"))),
            }
        }
    }
    let mut annotated = |key: &str, res: &str, problems: &mut Vec<Problem>| {
        let raw = annotations.get(key).map(|v| v.trim()).unwrap_or("");
        if raw.is_empty() {
            return;
        }
        match parse_quantity(raw) {
            // zero is "not set", as upstream: the template's value, if any, shows through
            Ok(v) => {
                if v != 0.0 {
                    cap.insert(res.to_string(), (raw.to_string(), v, Origin::Annotation));
                }
            }
            Err(e) => problems.push(Problem::new(
                object.as_str(),
                Problem::annotation_field(key),
                format!("{e}; ignored"),
            )),
        }
    };
    annotated(capacity::CPU, "cpu", &mut problems);
    annotated(capacity::MEMORY, "memory", &mut problems);
    annotated(capacity::EPHEMERAL_DISK, "ephemeral-storage", &mut problems);

    // GPUs
    let gpu_type = annotations
        .get(capacity::GPU_TYPE)
        .map(|v| v.trim())
        .unwrap_or("");
    let gpu_count = parse_count(&object, annotations, capacity::GPU_COUNT, &mut problems);
    let mut gpu = None;
    match (gpu_type.is_empty(), gpu_count) {
        (false, Some(n)) if n > 0 => {
            // an extended resource: a Node's capacity takes no other name without a domain
            if gpu_type.contains('/') && is_qualified_name(gpu_type) {
                cap.insert(
                    gpu_type.to_string(),
                    (n.to_string(), n as f64, Origin::Annotation),
                );
                gpu = Some((gpu_type.to_string(), n));
            } else {
                problems.push(Problem::new(
                    object.as_str(),
                    Problem::annotation_field(capacity::GPU_TYPE),
                    format!("{gpu_type:?} is not a valid extended resource name (e.g. nvidia.com/gpu); no GPU in the template"),
                ));
            }
        }
        (false, None)
            if annotations
                .get(capacity::GPU_COUNT)
                .is_none_or(|v| v.trim().is_empty()) =>
        {
            problems.push(Problem::new(
                object.as_str(),
                Problem::annotation_field(capacity::GPU_COUNT),
                format!(
                    "{} is set but gpu-count is not; no GPU in the template",
                    capacity::GPU_TYPE
                ),
            ))
        }
        (true, Some(n)) if n > 0 => problems.push(Problem::new(
            object.as_str(),
            Problem::annotation_field(capacity::GPU_TYPE),
            format!(
                "{} is set but gpu-type is not; no GPU in the template",
                capacity::GPU_COUNT
            ),
        )),
        _ => {}
    }
    if gpu.is_none() {
        gpu = GPU_RESOURCES.iter().find_map(|res| {
            cap.get(*res)
                .filter(|(_, v, _)| *v >= 1.0)
                .map(|(_, v, _)| (res.to_string(), v.floor() as i64))
        });
    }

    // pods
    let max_pods =
        parse_count(&object, annotations, capacity::MAX_PODS, &mut problems).filter(|n| *n > 0);
    let pods = match max_pods {
        Some(n) => {
            cap.insert(
                "pods".to_string(),
                (n.to_string(), n as f64, Origin::Annotation),
            );
            n
        }
        None => match cap.get("pods").filter(|(_, v, _)| *v >= 1.0) {
            Some((_, v, _)) => v.floor() as i64,
            None => {
                cap.insert(
                    "pods".to_string(),
                    (
                        DEFAULT_MAX_PODS.to_string(),
                        DEFAULT_MAX_PODS as f64,
                        Origin::Default,
                    ),
                );
                DEFAULT_MAX_PODS
            }
        },
    };

    // the gate
    let amount = |res: &str| {
        cap.get(res)
            .filter(|(_, v, _)| *v > 0.0)
            .map(|(q, v, _)| (q.clone(), *v))
    };
    let (Some(cpu), Some(memory)) = (amount("cpu"), amount("memory")) else {
        if r.replicas.unwrap_or(0) == 0 {
            let missing_key = if amount("cpu").is_none() {
                capacity::CPU
            } else {
                capacity::MEMORY
            };
            let on = template_object
                .clone()
                .or(infra_name.clone())
                .unwrap_or_else(|| "the infrastructure template".to_string());
            problems.push(Problem::new(
                object.as_str(),
                Problem::annotation_field(missing_key),
                format!(
                    "zero-size group has no cpu/memory capacity: set {} and {} or status.capacity on {on}",
                    capacity::CPU,
                    capacity::MEMORY
                ),
            ));
        }
        return TemplateOutcome {
            template: None,
            problems,
        };
    };
    let ephemeral_storage = amount("ephemeral-storage").map(|(q, _)| q);
    let from_annotations = cap.values().any(|(_, _, from)| *from == Origin::Annotation);
    let from_template = cap.values().any(|(_, _, from)| *from == Origin::Template);
    let capacity_source = match (from_annotations, from_template, template_id) {
        (true, true, Some(id)) => CapacitySource::Both(id),
        (false, true, Some(id)) => CapacitySource::InfraTemplate(id),
        _ => CapacitySource::Annotations,
    };

    // ---- name
    let name = node_name(&r.key.name, inputs.group_id);

    // ---- labels, lowest precedence first
    let (fallback_arch, arch_problem) = default_arch(inputs.default_arch);
    let template_arch = template
        .and_then(|t| t.architecture.as_deref())
        .map(str::trim)
        .filter(|a| !a.is_empty());
    let template_os = template
        .and_then(|t| t.operating_system.as_deref())
        .map(str::trim)
        .filter(|o| !o.is_empty());
    if template_arch.is_none()
        && let Some(p) = arch_problem
    {
        problems.push(p);
    }
    let mut labels = BTreeMap::new();
    labels.insert(
        LABEL_ARCH.to_string(),
        template_arch.unwrap_or(fallback_arch).to_string(),
    );
    labels.insert(
        LABEL_OS.to_string(),
        template_os.unwrap_or(DEFAULT_OS).to_string(),
    );
    labels.insert(LABEL_HOSTNAME.to_string(), name.clone());
    if let Some(fd) = r.template.failure_domain.as_deref().map(str::trim)
        && !fd.is_empty()
        && is_label_value(fd)
    {
        labels.insert(LABEL_ZONE.to_string(), fd.to_string());
    }
    // GPUs declared by the annotations or published by the infrastructure template both label the node,
    // so CA's GPU accounting sees them; a `cluster-api/accelerator` in the labels annotation wins below.
    if let Some(g) = &gpu {
        labels.insert(GPU_LABEL.to_string(), gpu_label_value(&g.0));
    }
    for (k, v) in &r.template.labels {
        if is_managed_label(k) {
            labels.insert(k.clone(), v.clone());
        }
    }
    for (k, v) in parse_labels_annotation(&object, annotations, &mut problems) {
        labels.insert(k, v);
    }
    if let Some(node_labels) = inputs.node_labels {
        for key in NODE_LABELS_COPIED {
            if let Some(v) = node_labels.get(key).filter(|v| !v.is_empty()) {
                labels.insert(key.to_string(), v.clone());
            }
        }
    }
    let arch = labels.get(LABEL_ARCH).cloned().unwrap_or_default();
    let os = labels.get(LABEL_OS).cloned().unwrap_or_default();

    // ---- taints
    let mut taints: Vec<Taint> = Vec::new();
    for (i, t) in r.template.taints.iter().enumerate() {
        match validate_taint(t) {
            Ok(()) => taints.push(t.clone()),
            Err(e) => problems.push(Problem::new(
                object.as_str(),
                format!("spec.template.spec.taints[{i}]"),
                format!("{e}; ignored"),
            )),
        }
    }
    for t in parse_taints_annotation(&object, annotations, &mut problems) {
        match taints
            .iter_mut()
            .find(|e| e.key == t.key && e.effect == t.effect)
        {
            Some(existing) => *existing = t,
            None => taints.push(t),
        }
    }

    // ---- the node
    let quantities: BTreeMap<String, Quantity> = cap
        .iter()
        .map(|(res, (q, _, _))| (res.clone(), Quantity(q.clone())))
        .collect();
    let condition = |type_: &str, status: &str, reason: &str| api::NodeCondition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: Some(reason.to_string()),
        ..Default::default()
    };
    let node = api::Node {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some(labels.clone()),
            annotations: Some(BTreeMap::from([(
                NODE_GROUP_ANNOTATION.to_string(),
                inputs.group_id.to_string(),
            )])),
            ..Default::default()
        },
        spec: Some(api::NodeSpec {
            taints: (!taints.is_empty()).then(|| {
                taints
                    .iter()
                    .map(|t| api::Taint {
                        key: t.key.clone(),
                        value: (!t.value.is_empty()).then(|| t.value.clone()),
                        effect: t.effect.clone(),
                        time_added: None,
                    })
                    .collect()
            }),
            ..Default::default()
        }),
        status: Some(api::NodeStatus {
            capacity: Some(quantities.clone()),
            allocatable: Some(quantities),
            conditions: Some(vec![
                condition("Ready", "True", "KubeletReady"),
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID"),
                condition("NetworkUnavailable", "False", "RouteCreated"),
            ]),
            node_info: Some(api::NodeSystemInfo {
                architecture: arch.clone(),
                operating_system: os.clone(),
                ..Default::default()
            }),
            ..Default::default()
        }),
    };
    let summary = TemplateSummary {
        name,
        cpu: cpu.0,
        cpu_cores: cpu.1,
        memory: memory.0,
        memory_gib: memory.1 / (1024.0 * 1024.0 * 1024.0),
        ephemeral_storage,
        gpu,
        pods,
        arch,
        os,
        labels,
        taints,
        capacity_source,
    };
    TemplateOutcome {
        template: Some(TemplateNode { node, summary }),
        problems,
    }
}

impl TemplateNode {
    /// The node as Kubernetes protobuf: the bytes of Go's `v1.Node.Marshal()` (no `k8s\0` envelope, no
    /// TypeMeta), for `nodeBytes` of `NodeGroupTemplateNodeInfoResponse`. Carries every field [`build`] sets.
    pub fn to_proto_bytes(&self) -> Vec<u8> {
        to_pb(&self.node).encode_to_vec()
    }
}

/// k8s-openapi `Node` → k8s-pb `Node`, for the fields templates use.
fn to_pb(node: &api::Node) -> k8s_pb::api::core::v1::Node {
    use k8s_pb::api::core::v1 as pb;
    use k8s_pb::apimachinery::pkg::api::resource::Quantity as PbQuantity;
    use k8s_pb::apimachinery::pkg::apis::meta::v1 as pbmeta;
    let quantities = |m: &Option<BTreeMap<String, Quantity>>| -> BTreeMap<String, PbQuantity> {
        m.iter()
            .flatten()
            .map(|(k, q)| {
                (
                    k.clone(),
                    PbQuantity {
                        string: Some(q.0.clone()),
                    },
                )
            })
            .collect()
    };
    let md = &node.metadata;
    pb::Node {
        metadata: Some(pbmeta::ObjectMeta {
            name: md.name.clone(),
            labels: md.labels.clone().unwrap_or_default(),
            annotations: md.annotations.clone().unwrap_or_default(),
            ..Default::default()
        }),
        spec: node.spec.as_ref().map(|s| pb::NodeSpec {
            provider_id: s.provider_id.clone(),
            taints: s
                .taints
                .iter()
                .flatten()
                .map(|t| pb::Taint {
                    key: Some(t.key.clone()),
                    value: t.value.clone(),
                    effect: Some(t.effect.clone()),
                    time_added: None,
                })
                .collect(),
            ..Default::default()
        }),
        status: node.status.as_ref().map(|s| pb::NodeStatus {
            capacity: quantities(&s.capacity),
            allocatable: quantities(&s.allocatable),
            conditions: s
                .conditions
                .iter()
                .flatten()
                .map(|c| pb::NodeCondition {
                    r#type: Some(c.type_.clone()),
                    status: Some(c.status.clone()),
                    reason: c.reason.clone(),
                    message: c.message.clone(),
                    ..Default::default()
                })
                .collect(),
            node_info: s.node_info.as_ref().map(|i| pb::NodeSystemInfo {
                machine_id: Some(i.machine_id.clone()),
                system_uuid: Some(i.system_uuid.clone()),
                boot_id: Some(i.boot_id.clone()),
                kernel_version: Some(i.kernel_version.clone()),
                os_image: Some(i.os_image.clone()),
                container_runtime_version: Some(i.container_runtime_version.clone()),
                kubelet_version: Some(i.kubelet_version.clone()),
                kube_proxy_version: Some(i.kube_proxy_version.clone()),
                operating_system: Some(i.operating_system.clone()),
                architecture: Some(i.architecture.clone()),
                swap: None,
            }),
            ..Default::default()
        }),
    }
}

/// `<resource name>-template-<8 hex of a hash of the group id>`: deterministic, distinct per group, at most
/// 63 characters so that it is also a valid `kubernetes.io/hostname` value.
fn node_name(resource_name: &str, group_id: &str) -> String {
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

/// The GPU label value for a GPU resource: itself when it is a valid label value, else with every invalid
/// character replaced by `-` (`nvidia.com/gpu` → `nvidia.com-gpu`). Users who need a specific value
/// (`--gpu-total` matches on it) set `cluster-api/accelerator` in the labels annotation, which wins.
/// Pods and extended resources (`vendor.example/name`) are counted in whole units.
fn must_be_whole(resource: &str) -> bool {
    resource == "pods" || (resource.contains('/') && !resource.starts_with("kubernetes.io/"))
}

fn gpu_label_value(resource: &str) -> String {
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

/// An integer annotation (Go `strconv.ParseInt`): absent or empty → `None`; malformed or negative → a
/// problem and `None`.
fn parse_count(
    object: &str,
    annotations: &BTreeMap<String, String>,
    key: &str,
    problems: &mut Vec<Problem>,
) -> Option<i64> {
    let raw = annotations.get(key).map(|v| v.trim()).unwrap_or("");
    if raw.is_empty() {
        return None;
    }
    match raw.parse::<i64>() {
        Ok(n) if n >= 0 => Some(n),
        Ok(_) => {
            problems.push(Problem::new(
                object,
                Problem::annotation_field(key),
                format!("{raw:?} is negative; ignored"),
            ));
            None
        }
        Err(_) => {
            problems.push(Problem::new(
                object,
                Problem::annotation_field(key),
                format!("{raw:?} is not an integer; ignored"),
            ));
            None
        }
    }
}

/// `k=v,k2=v2`; entries trimmed, empty entries skipped, malformed entries reported and skipped.
fn parse_labels_annotation(
    object: &str,
    annotations: &BTreeMap<String, String>,
    problems: &mut Vec<Problem>,
) -> Vec<(String, String)> {
    let Some(raw) = annotations.get(capacity::LABELS) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in raw.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let bad = |why: &str| {
            Problem::new(
                object,
                Problem::annotation_field(capacity::LABELS),
                format!("label {entry:?}: {why}; ignored"),
            )
        };
        let Some((k, v)) = entry.split_once('=') else {
            problems.push(bad("expected key=value"));
            continue;
        };
        let (k, v) = (k.trim(), v.trim());
        if !is_qualified_name(k) {
            problems.push(bad("invalid key"));
        } else if !is_label_value(v) {
            problems.push(bad(
                "invalid value (at most 63 of A-Z a-z 0-9 - _ ., alphanumeric at both ends)",
            ));
        } else {
            out.push((k.to_string(), v.to_string()));
        }
    }
    out
}

/// `key=value:Effect` or `key:Effect`, comma separated; malformed entries reported and skipped.
fn parse_taints_annotation(
    object: &str,
    annotations: &BTreeMap<String, String>,
    problems: &mut Vec<Problem>,
) -> Vec<Taint> {
    let Some(raw) = annotations.get(capacity::TAINTS) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in raw.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let taint = match entry.split_once(':') {
            None => Err("expected key=value:Effect or key:Effect".to_string()),
            Some((kv, effect)) => {
                let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
                let t = Taint {
                    key: key.trim().to_string(),
                    value: value.trim().to_string(),
                    effect: effect.trim().to_string(),
                };
                validate_taint(&t).map(|()| t)
            }
        };
        match taint {
            Ok(t) => out.push(t),
            Err(e) => problems.push(Problem::new(
                object,
                Problem::annotation_field(capacity::TAINTS),
                format!("taint {entry:?}: {e}; ignored"),
            )),
        }
    }
    out
}

fn validate_taint(t: &Taint) -> Result<(), String> {
    if !is_qualified_name(&t.key) {
        return Err(format!("invalid key {:?}", t.key));
    }
    if !is_label_value(&t.value) {
        return Err(format!("invalid value {:?}", t.value));
    }
    if !TAINT_EFFECTS.contains(&t.effect.as_str()) {
        return Err(format!(
            "invalid effect {:?} (expected one of {})",
            t.effect,
            TAINT_EFFECTS.join(", ")
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::{InfraRef, MachineTemplate, ObjectKey, ScalableKind};

    const GROUP: &str = "MachineDeployment/default/md-0";
    const OBJ: &str = "MachineDeployment default/md-0";
    const TPL_OBJ: &str = "DockerMachineTemplate default/md-0-tpl";

    fn resource(annotations: &[(&str, &str)], replicas: i32) -> ScalableResource {
        ScalableResource {
            kind: ScalableKind::MachineDeployment,
            key: ObjectKey::new("default", "md-0"),
            uid: "uid".to_string(),
            resource_version: "1".to_string(),
            labels: BTreeMap::new(),
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            cluster_name: "c".to_string(),
            replicas: Some(replicas),
            paused: false,
            owners: Vec::new(),
            template: MachineTemplate {
                labels: BTreeMap::new(),
                infrastructure_ref: Some(Ok(InfraRef {
                    api_group: "infrastructure.cluster.x-k8s.io".to_string(),
                    api_version: None,
                    kind: "DockerMachineTemplate".to_string(),
                    name: "md-0-tpl".to_string(),
                })),
                taints: Vec::new(),
                failure_domain: None,
            },
            provider_id_list: Vec::new(),
            topology: None,
        }
    }

    fn infra(capacity: &[(&str, &str)], arch: Option<&str>, os: Option<&str>) -> InfraTemplate {
        InfraTemplate {
            key: ObjectKey::new("default", "md-0-tpl"),
            api_group: "infrastructure.cluster.x-k8s.io".to_string(),
            kind: "DockerMachineTemplate".to_string(),
            capacity: capacity
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            architecture: arch.map(str::to_string),
            operating_system: os.map(str::to_string),
        }
    }

    fn run(r: &ScalableResource, infra: InfraSource) -> TemplateOutcome {
        run_with(r, infra, None, None)
    }

    fn run_with(
        r: &ScalableResource,
        infra: InfraSource,
        node_labels: Option<&BTreeMap<String, String>>,
        default_arch: Option<&str>,
    ) -> TemplateOutcome {
        let keys = Keys::default();
        build(&TemplateInputs {
            keys: &keys,
            group_id: GROUP,
            resource: r,
            infra,
            node_labels,
            default_arch,
        })
    }

    fn capacity_of(t: &TemplateNode) -> BTreeMap<String, String> {
        t.node
            .status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .map(|c| c.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect())
            .unwrap_or_default()
    }

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn annotations_only() {
        let r = resource(
            &[
                (capacity::CPU, "4"),
                (capacity::MEMORY, "16Gi"),
                (capacity::EPHEMERAL_DISK, "100Gi"),
                (capacity::GPU_TYPE, "nvidia.com/gpu"),
                (capacity::GPU_COUNT, "2"),
                (capacity::MAX_PODS, "200"),
            ],
            0,
        );
        let out = run(&r, InfraSource::NoReference);
        assert!(out.problems.is_empty(), "{:?}", out.problems);
        let t = out.template.expect("template");
        assert_eq!(
            capacity_of(&t),
            map(&[
                ("cpu", "4"),
                ("memory", "16Gi"),
                ("ephemeral-storage", "100Gi"),
                ("nvidia.com/gpu", "2"),
                ("pods", "200")
            ])
        );
        let s = &t.summary;
        assert_eq!(s.capacity_source, CapacitySource::Annotations);
        assert_eq!((s.cpu.as_str(), s.cpu_cores), ("4", 4.0));
        assert_eq!((s.memory.as_str(), s.memory_gib), ("16Gi", 16.0));
        assert_eq!(s.ephemeral_storage.as_deref(), Some("100Gi"));
        assert_eq!(s.pods, 200);
        assert_eq!(s.gpu, Some(("nvidia.com/gpu".to_string(), 2)));
        assert_eq!(
            s.labels.get(GPU_LABEL).map(String::as_str),
            Some("nvidia.com-gpu")
        );
        assert_eq!(s.arch, "amd64");
        assert_eq!(s.os, "linux");
        // status
        let status = t.node.status.as_ref().expect("status");
        assert_eq!(status.capacity, status.allocatable);
        let conditions: Vec<(String, String)> = status
            .conditions
            .iter()
            .flatten()
            .map(|c| (c.type_.clone(), c.status.clone()))
            .collect();
        assert_eq!(
            conditions,
            [
                ("Ready", "True"),
                ("MemoryPressure", "False"),
                ("DiskPressure", "False"),
                ("PIDPressure", "False"),
                ("NetworkUnavailable", "False")
            ]
            .map(|(a, b)| (a.to_string(), b.to_string()))
        );
        let info = status.node_info.as_ref().expect("nodeInfo");
        assert_eq!(
            (info.architecture.as_str(), info.operating_system.as_str()),
            ("amd64", "linux")
        );
        // metadata
        let name = t.node.metadata.name.clone().unwrap_or_default();
        assert_eq!(name, s.name);
        assert!(name.starts_with("md-0-template-"), "{name}");
        assert_eq!(s.labels.get(LABEL_HOSTNAME), Some(&name));
        assert_eq!(
            t.node.metadata.annotations,
            Some(map(&[(NODE_GROUP_ANNOTATION, GROUP)]))
        );
        assert!(
            t.node
                .spec
                .as_ref()
                .is_some_and(|s| s.taints.is_none() && s.provider_id.is_none())
        );
    }

    #[test]
    fn annotations_override_template_key_by_key() {
        let r = resource(
            &[
                (capacity::MEMORY, "32Gi"),
                (capacity::GPU_TYPE, "nvidia.com/gpu"),
                (capacity::GPU_COUNT, "1"),
            ],
            0,
        );
        let tpl = infra(
            &[
                ("cpu", "8"),
                ("memory", "16Gi"),
                ("ephemeral-storage", "50Gi"),
                ("pods", "58"),
            ],
            Some("arm64"),
            Some("linux"),
        );
        let out = run(&r, InfraSource::Found(&tpl));
        assert!(out.problems.is_empty(), "{:?}", out.problems);
        let t = out.template.expect("template");
        assert_eq!(
            capacity_of(&t),
            map(&[
                ("cpu", "8"),
                ("memory", "32Gi"),
                ("ephemeral-storage", "50Gi"),
                ("nvidia.com/gpu", "1"),
                // the template's pods are kept when maxPods is not annotated
                ("pods", "58")
            ])
        );
        assert_eq!(t.summary.pods, 58);
        assert_eq!(
            t.summary.capacity_source,
            CapacitySource::Both("DockerMachineTemplate/md-0-tpl".to_string())
        );
        assert_eq!(t.summary.arch, "arm64");
        assert_eq!(
            t.summary.labels.get(LABEL_ARCH).map(String::as_str),
            Some("arm64")
        );
    }

    #[test]
    fn template_only_and_max_pods() {
        let tpl = infra(&[("cpu", "2"), ("memory", "4Gi")], None, None);
        // (maxPods annotation, pods, source)
        let cases = [
            (
                None,
                "110",
                CapacitySource::InfraTemplate("DockerMachineTemplate/md-0-tpl".to_string()),
            ),
            (
                Some(""),
                "110",
                CapacitySource::InfraTemplate("DockerMachineTemplate/md-0-tpl".to_string()),
            ),
            (
                Some("0"),
                "110",
                CapacitySource::InfraTemplate("DockerMachineTemplate/md-0-tpl".to_string()),
            ),
            (
                Some("30"),
                "30",
                CapacitySource::Both("DockerMachineTemplate/md-0-tpl".to_string()),
            ),
        ];
        for (max_pods, pods, source) in cases {
            let ann: Vec<(&str, &str)> = max_pods
                .map(|v| (capacity::MAX_PODS, v))
                .into_iter()
                .collect();
            let r = resource(&ann, 0);
            let out = run(&r, InfraSource::Found(&tpl));
            assert!(out.problems.is_empty(), "{max_pods:?}: {:?}", out.problems);
            let t = out.template.expect("template");
            assert_eq!(
                capacity_of(&t).get("pods").map(String::as_str),
                Some(pods),
                "{max_pods:?}"
            );
            assert_eq!(t.summary.capacity_source, source, "{max_pods:?}");
        }
    }

    #[test]
    fn malformed_values_are_problems_and_ignored() {
        // (annotations, template capacity, expected (object, field) of problems, template expected)
        type Case<'a> = (
            &'a [(&'a str, &'a str)],
            &'a [(&'a str, &'a str)],
            Vec<(&'a str, String)>,
            bool,
        );
        let cases: Vec<Case> = vec![
            (
                &[(capacity::CPU, "four"), (capacity::MEMORY, "8Gi")],
                &[("cpu", "2")],
                vec![(OBJ, Problem::annotation_field(capacity::CPU))],
                true, // the template's cpu is used
            ),
            (
                &[],
                &[("cpu", "2"), ("memory", "lots"), ("nvidia.com/gpu", "-1")],
                vec![
                    (TPL_OBJ, "status.capacity[memory]".to_string()),
                    (TPL_OBJ, "status.capacity[nvidia.com/gpu]".to_string()),
                    (OBJ, Problem::annotation_field(capacity::MEMORY)),
                ],
                false,
            ),
            (
                &[
                    (capacity::CPU, "1"),
                    (capacity::MEMORY, "1Gi"),
                    (capacity::EPHEMERAL_DISK, "-5Gi"),
                ],
                &[],
                vec![(OBJ, Problem::annotation_field(capacity::EPHEMERAL_DISK))],
                true,
            ),
            (
                &[
                    (capacity::CPU, "1"),
                    (capacity::MEMORY, "1Gi"),
                    (capacity::MAX_PODS, "13Mi"),
                ],
                &[],
                vec![(OBJ, Problem::annotation_field(capacity::MAX_PODS))],
                true,
            ),
            (
                &[
                    (capacity::CPU, "1"),
                    (capacity::MEMORY, "1Gi"),
                    (capacity::MAX_PODS, "-3"),
                ],
                &[],
                vec![(OBJ, Problem::annotation_field(capacity::MAX_PODS))],
                true,
            ),
            (
                &[
                    (capacity::CPU, "1"),
                    (capacity::MEMORY, "1Gi"),
                    (capacity::GPU_TYPE, "nvidia.com/gpu"),
                    (capacity::GPU_COUNT, "two"),
                ],
                &[],
                vec![(OBJ, Problem::annotation_field(capacity::GPU_COUNT))],
                true,
            ),
            (
                &[
                    (capacity::CPU, "1"),
                    (capacity::MEMORY, "1Gi"),
                    (capacity::GPU_TYPE, "nvidia.com/gpu"),
                ],
                &[],
                vec![(OBJ, Problem::annotation_field(capacity::GPU_COUNT))],
                true,
            ),
            (
                &[
                    (capacity::CPU, "1"),
                    (capacity::MEMORY, "1Gi"),
                    (capacity::GPU_COUNT, "2"),
                ],
                &[],
                vec![(OBJ, Problem::annotation_field(capacity::GPU_TYPE))],
                true,
            ),
            (
                &[
                    (capacity::CPU, "1"),
                    (capacity::MEMORY, "1Gi"),
                    (capacity::GPU_TYPE, "nvidia gpu"),
                    (capacity::GPU_COUNT, "2"),
                ],
                &[],
                vec![(OBJ, Problem::annotation_field(capacity::GPU_TYPE))],
                true,
            ),
            (
                &[(capacity::CPU, "1"), (capacity::MEMORY, "1Gi")],
                &[("bad name!", "1")],
                vec![(TPL_OBJ, "status.capacity[bad name!]".to_string())],
                true,
            ),
        ];
        for (i, (ann, cap, want, has_template)) in cases.into_iter().enumerate() {
            let r = resource(ann, 0);
            let tpl = infra(cap, None, None);
            let out = run(&r, InfraSource::Found(&tpl));
            let got: Vec<(String, String)> = out
                .problems
                .iter()
                .map(|p| (p.object.clone(), p.field.clone()))
                .collect();
            let want: Vec<(String, String)> = want
                .iter()
                .map(|(o, f)| (o.to_string(), f.clone()))
                .collect();
            assert_eq!(got, want, "case {i}: {:?}", out.problems);
            assert_eq!(out.template.is_some(), has_template, "case {i}");
            if let Some(t) = out.template {
                let c = capacity_of(&t);
                assert!(
                    c.keys().all(|k| k == "cpu" || k == "memory" || k == "pods"),
                    "case {i}: {c:?}"
                );
            }
        }
    }

    #[test]
    fn no_cpu_or_memory_gives_no_template() {
        // (annotations, replicas, problem expected)
        type Case<'a> = (&'a [(&'a str, &'a str)], i32, bool);
        let cases: [Case; 6] = [
            (&[], 0, true),
            (&[], 3, false),
            (&[(capacity::CPU, "2")], 0, true),
            (&[(capacity::MEMORY, "2Gi")], 0, true),
            (&[(capacity::CPU, "0"), (capacity::MEMORY, "2Gi")], 0, true),
            (
                &[(capacity::CPU, "2"), (capacity::MAX_PODS, "10")],
                2,
                false,
            ),
        ];
        for (i, (ann, replicas, problem)) in cases.into_iter().enumerate() {
            let r = resource(ann, replicas);
            let out = run(&r, InfraSource::NoReference);
            assert!(out.template.is_none(), "case {i}");
            assert_eq!(
                out.problems.len(),
                usize::from(problem),
                "case {i}: {:?}",
                out.problems
            );
            if let Some(p) = out.problems.first() {
                assert_eq!(p.object, OBJ);
                assert!(
                    p.message
                        .starts_with("zero-size group has no cpu/memory capacity"),
                    "{}",
                    p.message
                );
                assert!(
                    p.message.contains("DockerMachineTemplate default/md-0-tpl"),
                    "{}",
                    p.message
                );
            }
        }
    }

    #[test]
    fn unavailable_template_uses_annotations() {
        let r = resource(&[(capacity::CPU, "2"), (capacity::MEMORY, "4Gi")], 0);
        let out = run(
            &r,
            InfraSource::Unavailable {
                reason: "forbidden: cannot list dockermachinetemplates".to_string(),
            },
        );
        assert_eq!(out.problems.len(), 1, "{:?}", out.problems);
        let p = &out.problems[0];
        assert_eq!(p.object, OBJ);
        assert_eq!(p.field, "spec.template.spec.infrastructureRef");
        assert!(
            p.message.contains("DockerMachineTemplate default/md-0-tpl"),
            "{}",
            p.message
        );
        assert!(p.message.contains("forbidden"), "{}", p.message);
        let t = out.template.expect("template from annotations");
        assert_eq!(t.summary.capacity_source, CapacitySource::Annotations);

        // and without annotations: two problems, no template
        let r = resource(&[], 0);
        let out = run(
            &r,
            InfraSource::Unavailable {
                reason: "not found".to_string(),
            },
        );
        assert!(out.template.is_none());
        assert_eq!(out.problems.len(), 2, "{:?}", out.problems);
    }

    #[test]
    fn arch_and_os() {
        // (template nodeInfo arch, os, default arch, node label arch, want arch, want os, problems)
        let cases = [
            (
                Some("arm64"),
                Some("linux"),
                None,
                None,
                "arm64",
                "linux",
                0,
            ),
            (
                Some("arm64"),
                Some("windows"),
                Some("s390x"),
                None,
                "arm64",
                "windows",
                0,
            ),
            (None, None, None, None, "amd64", "linux", 0),
            (Some(""), Some(""), None, None, "amd64", "linux", 0),
            (None, None, Some("arm64"), None, "arm64", "linux", 0),
            (None, None, Some("ppc64le"), None, "ppc64le", "linux", 0),
            (None, None, Some(""), None, "amd64", "linux", 0),
            (None, None, Some("ARM64"), None, "amd64", "linux", 1),
            (None, None, Some("riscv64"), None, "amd64", "linux", 1),
            // an invalid default that is not used is not reported here
            (
                Some("arm64"),
                None,
                Some("riscv64"),
                None,
                "arm64",
                "linux",
                0,
            ),
            // a real node wins
            (
                Some("amd64"),
                None,
                None,
                Some("arm64"),
                "arm64",
                "linux",
                0,
            ),
        ];
        for (i, (ta, to, def, node_arch, want_arch, want_os, n_problems)) in
            cases.into_iter().enumerate()
        {
            let r = resource(&[(capacity::CPU, "1"), (capacity::MEMORY, "1Gi")], 0);
            let tpl = infra(&[], ta, to);
            let node_labels = node_arch.map(|a| map(&[(LABEL_ARCH, a)]));
            let out = run_with(&r, InfraSource::Found(&tpl), node_labels.as_ref(), def);
            assert_eq!(
                out.problems.len(),
                n_problems,
                "case {i}: {:?}",
                out.problems
            );
            if let Some(p) = out.problems.first() {
                assert_eq!(p.field, "CAPI_SCALE_ZERO_DEFAULT_ARCH");
            }
            let t = out.template.expect("template");
            assert_eq!(
                (t.summary.arch.as_str(), t.summary.os.as_str()),
                (want_arch, want_os),
                "case {i}"
            );
            let labels = &t.summary.labels;
            assert_eq!(
                labels.get(LABEL_ARCH).map(String::as_str),
                Some(want_arch),
                "case {i}"
            );
            assert_eq!(
                labels.get(LABEL_OS).map(String::as_str),
                Some(want_os),
                "case {i}"
            );
            let info = t
                .node
                .status
                .as_ref()
                .and_then(|s| s.node_info.as_ref())
                .expect("nodeInfo");
            assert_eq!(info.architecture, want_arch, "case {i}");
        }
        assert_eq!(default_arch(Some("s390x")), ("s390x", None));
        assert!(default_arch(Some("x86_64")).1.is_some());
    }

    #[test]
    fn label_precedence() {
        let mut r = resource(
            &[
                (capacity::CPU, "1"),
                (capacity::MEMORY, "1Gi"),
                (
                    capacity::LABELS,
                    "node-role.kubernetes.io/worker=annotation, team=a,,bad,kubernetes.io/os=linux2,topology.kubernetes.io/zone=ann-zone, =x,k=bad value,toolong=aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                ),
            ],
            0,
        );
        r.template.labels = map(&[
            ("node-role.kubernetes.io/worker", "template"),
            ("node-role.kubernetes.io/gpu", ""),
            ("prefixed.node-role.kubernetes.io/x", "dropped"),
            ("node-restriction.kubernetes.io/a", "kept"),
            ("foo.node-restriction.kubernetes.io/b", "kept"),
            ("node.cluster.x-k8s.io/c", "kept"),
            ("bar.node.cluster.x-k8s.io/d", "kept"),
            ("xnode.cluster.x-k8s.io/e", "dropped"),
            ("app", "dropped"),
            ("cluster.x-k8s.io/cluster-name", "dropped"),
        ]);
        r.template.failure_domain = Some("fd-1".to_string());
        let node_labels = map(&[
            (LABEL_ARCH, "arm64"),
            (LABEL_OS, ""),
            ("node.kubernetes.io/instance-type", "m5.large"),
            ("beta.kubernetes.io/instance-type", "m5.large"),
            ("topology.kubernetes.io/region", "eu-west-1"),
            ("failure-domain.beta.kubernetes.io/region", "eu-west-1"),
            ("failure-domain.beta.kubernetes.io/zone", "eu-west-1b"),
            (LABEL_ZONE, "eu-west-1b"),
            ("unrelated", "x"),
        ]);
        let out = run_with(&r, InfraSource::NoReference, Some(&node_labels), None);
        let fields: Vec<&str> = out.problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            vec![Problem::annotation_field(capacity::LABELS).as_str(); 4],
            "{:?}",
            out.problems
        );
        let t = out.template.expect("template");
        let name = t.summary.name.clone();
        let want = map(&[
            (LABEL_ARCH, "arm64"),
            (LABEL_OS, "linux2"),
            (LABEL_HOSTNAME, &name),
            (LABEL_ZONE, "eu-west-1b"),
            ("failure-domain.beta.kubernetes.io/zone", "eu-west-1b"),
            ("node.kubernetes.io/instance-type", "m5.large"),
            ("beta.kubernetes.io/instance-type", "m5.large"),
            ("topology.kubernetes.io/region", "eu-west-1"),
            ("failure-domain.beta.kubernetes.io/region", "eu-west-1"),
            ("node-role.kubernetes.io/worker", "annotation"),
            ("node-role.kubernetes.io/gpu", ""),
            ("node-restriction.kubernetes.io/a", "kept"),
            ("foo.node-restriction.kubernetes.io/b", "kept"),
            ("node.cluster.x-k8s.io/c", "kept"),
            ("bar.node.cluster.x-k8s.io/d", "kept"),
            ("team", "a"),
        ]);
        assert_eq!(t.summary.labels, want);
        assert_eq!(t.node.metadata.labels.as_ref(), Some(&want));

        // without node labels: the failure domain, overridden by the annotation
        let out = run(&r, InfraSource::NoReference);
        let t = out.template.expect("template");
        assert_eq!(
            t.summary.labels.get(LABEL_ZONE).map(String::as_str),
            Some("ann-zone")
        );
        r.annotations.remove(capacity::LABELS);
        let t = run(&r, InfraSource::NoReference)
            .template
            .expect("template");
        assert_eq!(
            t.summary.labels.get(LABEL_ZONE).map(String::as_str),
            Some("fd-1")
        );
        assert_eq!(
            t.summary.labels.get(LABEL_ARCH).map(String::as_str),
            Some("amd64")
        );
    }

    #[test]
    fn gpu_label() {
        // (gpu-type, labels annotation, want label)
        let cases = [
            ("nvidia.com/gpu", None, Some("nvidia.com-gpu")),
            ("nvidia-tesla-t4", None, None), // not a valid extended resource name → problem, no GPU
            (
                "example.com/nvidia-tesla-t4",
                Some("cluster-api/accelerator=nvidia-tesla-t4"),
                Some("nvidia-tesla-t4"),
            ),
        ];
        for (gpu_type, labels, want) in cases {
            let mut ann = vec![
                (capacity::CPU, "1"),
                (capacity::MEMORY, "1Gi"),
                (capacity::GPU_TYPE, gpu_type),
                (capacity::GPU_COUNT, "1"),
            ];
            if let Some(l) = labels {
                ann.push((capacity::LABELS, l));
            }
            let r = resource(&ann, 0);
            let t = run(&r, InfraSource::NoReference)
                .template
                .expect("template");
            assert_eq!(
                t.summary.labels.get(GPU_LABEL).map(String::as_str),
                want,
                "{gpu_type}"
            );
        }
        // a GPU from the template's capacity is summarised and labelled too
        let r = resource(&[], 0);
        let tpl = infra(
            &[("cpu", "8"), ("memory", "32Gi"), ("nvidia.com/gpu", "4")],
            None,
            None,
        );
        let t = run(&r, InfraSource::Found(&tpl))
            .template
            .expect("template");
        assert_eq!(t.summary.gpu, Some(("nvidia.com/gpu".to_string(), 4)));
        assert_eq!(
            t.summary.labels.get(GPU_LABEL).map(String::as_str),
            Some("nvidia.com-gpu")
        );
        // fractional counts of whole-unit resources are problems, and left out
        let tpl = infra(
            &[
                ("cpu", "1500m"),
                ("memory", "1Gi"),
                ("nvidia.com/gpu", "1500m"),
                ("pods", "10500m"),
            ],
            None,
            None,
        );
        let out = run(&r, InfraSource::Found(&tpl));
        let t = out.template.expect("template");
        assert_eq!(t.summary.gpu, None);
        assert_eq!(t.summary.pods, DEFAULT_MAX_PODS);
        assert_eq!(t.summary.cpu, "1500m");
        let fields: Vec<&str> = out.problems.iter().map(|p| p.field.as_str()).collect();
        assert!(
            fields.contains(&"status.capacity[nvidia.com/gpu]"),
            "{fields:?}"
        );
        assert!(fields.contains(&"status.capacity[pods]"), "{fields:?}");
    }

    fn taint(k: &str, v: &str, e: &str) -> Taint {
        Taint {
            key: k.to_string(),
            value: v.to_string(),
            effect: e.to_string(),
        }
    }

    #[test]
    fn taints() {
        let mut r = resource(
            &[
                (capacity::CPU, "1"),
                (capacity::MEMORY, "1Gi"),
                (
                    capacity::TAINTS,
                    "dedicated=gpu:NoSchedule, spot:PreferNoSchedule,key=value,a=b:Sometimes,bad key=v:NoSchedule,k=bad value:NoExecute,,x=y:NoExecute,dedicated=ml:NoExecute",
                ),
            ],
            0,
        );
        r.template.taints = vec![
            taint("dedicated", "infra", "NoSchedule"),
            taint("example.com/maintenance", "", "NoExecute"),
            taint("broken", "", "Never"),
        ];
        let out = run(&r, InfraSource::NoReference);
        let fields: Vec<String> = out.problems.iter().map(|p| p.field.clone()).collect();
        let ann_field = Problem::annotation_field(capacity::TAINTS);
        assert_eq!(
            fields,
            vec![
                "spec.template.spec.taints[2]".to_string(),
                ann_field.clone(),
                ann_field.clone(),
                ann_field.clone(),
                ann_field
            ],
            "{:?}",
            out.problems
        );
        let t = out.template.expect("template");
        let want = vec![
            taint("dedicated", "gpu", "NoSchedule"), // replaced in place: same key and effect
            taint("example.com/maintenance", "", "NoExecute"),
            taint("spot", "", "PreferNoSchedule"),
            taint("x", "y", "NoExecute"),
            taint("dedicated", "ml", "NoExecute"), // same key, other effect: appended
        ];
        assert_eq!(t.summary.taints, want);
        let node_taints: Vec<(String, Option<String>, String)> = t
            .node
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default()
            .into_iter()
            .map(|t| (t.key, t.value, t.effect))
            .collect();
        assert_eq!(
            node_taints[1],
            (
                "example.com/maintenance".to_string(),
                None,
                "NoExecute".to_string()
            )
        );
        assert_eq!(node_taints.len(), 5);
        let json = serde_json::to_value(
            t.summary
                .taints
                .iter()
                .map(taint_string)
                .collect::<Vec<_>>(),
        )
        .unwrap_or_default();
        assert_eq!(json[0], "dedicated=gpu:NoSchedule");
        assert_eq!(json[2], "spot:PreferNoSchedule");
    }

    #[test]
    fn names() {
        let a = node_name("md-0", "MachineDeployment/default/md-0");
        let b = node_name("md-0", "MachineDeployment/other/md-0");
        let c = node_name("md-0", "MachineSet/default/md-0");
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_eq!(a, node_name("md-0", "MachineDeployment/default/md-0"));
        let long = node_name(&"x".repeat(253), "g");
        assert_eq!(long.len(), 63);
        assert!(
            is_label_value(&long) && crate::capi::names::is_dns1123_subdomain(&long),
            "{long}"
        );
        let odd = node_name("-.Weird_Name.-", "g");
        assert!(odd.starts_with("weirdname-template-"), "{odd}");
        assert!(node_name("", "g").starts_with("node-template-"));
    }

    #[test]
    fn gpu_label_values() {
        assert_eq!(gpu_label_value("nvidia.com/gpu"), "nvidia.com-gpu");
        assert_eq!(gpu_label_value("nvidia-t4"), "nvidia-t4");
    }

    #[test]
    fn proto_round_trip() {
        let mut r = resource(
            &[
                (capacity::CPU, "500m"),
                (capacity::MEMORY, "2Gi"),
                (capacity::GPU_TYPE, "nvidia.com/gpu"),
                (capacity::GPU_COUNT, "1"),
                (capacity::TAINTS, "a=b:NoSchedule,c:NoExecute"),
            ],
            0,
        );
        r.template.labels = map(&[("node-role.kubernetes.io/worker", "")]);
        let t = run(&r, InfraSource::NoReference)
            .template
            .expect("template");
        let bytes = t.to_proto_bytes();
        assert!(!bytes.is_empty());
        assert!(!bytes.starts_with(b"k8s\0"));
        let decoded = k8s_pb::api::core::v1::Node::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(decoded, to_pb(&t.node));

        let md = decoded.metadata.clone().unwrap_or_default();
        assert_eq!(md.name.as_deref(), Some(t.summary.name.as_str()));
        assert_eq!(md.labels, t.summary.labels);
        assert_eq!(
            md.annotations
                .get(NODE_GROUP_ANNOTATION)
                .map(String::as_str),
            Some(GROUP)
        );
        let spec = decoded.spec.clone().unwrap_or_default();
        let taints: Vec<(Option<&str>, Option<&str>, Option<&str>)> = spec
            .taints
            .iter()
            .map(|t| (t.key.as_deref(), t.value.as_deref(), t.effect.as_deref()))
            .collect();
        assert_eq!(
            taints,
            vec![
                (Some("a"), Some("b"), Some("NoSchedule")),
                (Some("c"), None, Some("NoExecute"))
            ]
        );
        assert_eq!(spec.provider_id, None);
        let status = decoded.status.clone().unwrap_or_default();
        let cap: BTreeMap<String, String> = status
            .capacity
            .iter()
            .map(|(k, q)| (k.clone(), q.string.clone().unwrap_or_default()))
            .collect();
        assert_eq!(
            cap,
            map(&[
                ("cpu", "500m"),
                ("memory", "2Gi"),
                ("nvidia.com/gpu", "1"),
                ("pods", "110")
            ])
        );
        assert_eq!(status.capacity, status.allocatable);
        assert_eq!(status.conditions.len(), 5);
        assert_eq!(status.conditions[0].r#type.as_deref(), Some("Ready"));
        assert_eq!(status.conditions[0].status.as_deref(), Some("True"));
        let info = status.node_info.unwrap_or_default();
        assert_eq!(info.architecture.as_deref(), Some("amd64"));
        assert_eq!(info.operating_system.as_deref(), Some("linux"));
    }

    #[test]
    fn node_serializes_as_yaml() {
        let r = resource(&[(capacity::CPU, "1"), (capacity::MEMORY, "1Gi")], 0);
        let t = run(&r, InfraSource::NoReference)
            .template
            .expect("template");
        let yaml = serde_yaml::to_string(&t.node).unwrap_or_default();
        assert!(yaml.contains("kind: Node"), "{yaml}");
        assert!(
            yaml.contains("cpu: '1'") || yaml.contains("cpu: \"1\""),
            "{yaml}"
        );
        let json = serde_json::to_value(&t.summary).unwrap_or_default();
        assert_eq!(json["cpu"], "1");
        assert_eq!(json["memory_gib"], 1.0);
        assert_eq!(json["capacity_source"], "annotations");
    }

    #[test]
    fn hostile_input_does_not_panic() {
        let weird = [
            "",
            ":",
            "=",
            "==:",
            "a=b=c:NoSchedule",
            "\u{0}",
            "é=é:é",
            ",,,",
            "k=v:NoSchedule:x",
            "🦀",
        ];
        for w in weird {
            let mut r = resource(
                &[
                    (capacity::CPU, w),
                    (capacity::MEMORY, w),
                    (capacity::EPHEMERAL_DISK, w),
                    (capacity::GPU_TYPE, w),
                    (capacity::GPU_COUNT, w),
                    (capacity::MAX_PODS, w),
                    (capacity::LABELS, w),
                    (capacity::TAINTS, w),
                ],
                0,
            );
            r.key.name = w.to_string();
            r.template.failure_domain = Some(w.to_string());
            r.template.labels = map(&[(w, w)]);
            r.template.taints = vec![taint(w, w, w)];
            let tpl = infra(&[(w, w), ("cpu", w)], Some(w), Some(w));
            let nl = map(&[(LABEL_ARCH, w)]);
            let _ = run_with(&r, InfraSource::Found(&tpl), Some(&nl), Some(w));
            let _ = run_with(
                &r,
                InfraSource::Unavailable {
                    reason: w.to_string(),
                },
                None,
                Some(w),
            );
        }
    }
}
