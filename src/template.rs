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
//!   `topology.kubernetes.io/zone` is copied from a Node too, and the template's failure domain fills it in:
//!   with the zone the Cluster's Nodes in that failure domain carry when there are any (CAPZ's failure
//!   domains are `1`, `2`, `3`, its Nodes' zones `eastus-1`), else with the failure domain's name.
//! - GPU groups get the label `cluster-api/accelerator`.
//! - taints from the annotation must have a valid key, value and effect.
//!
//! No `cpu` or no `memory` (or a zero one) → no template: the service answers `UNIMPLEMENTED`, never OK with
//! empty bytes (docs/architecture.md, invariant 4).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as api;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::capi::names::{is_label_value, is_qualified_name};
use crate::capi::quantity::parse_quantity;
use crate::capi::{GPU_LABEL, InfraTemplate, ScalableResource, Taint, capacity};
use crate::problem::{Problem, Subject};

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
    /// `Kind/namespace/name`.
    pub group_id: &'a str,
    pub resource: &'a ScalableResource,
    pub infra: InfraSource<'a>,
    /// Labels of an existing Node of the group, if a workload cluster is watched.
    pub node_labels: Option<&'a BTreeMap<String, String>>,
    /// `CAPI_SCALE_ZERO_DEFAULT_ARCH`.
    pub default_arch: Option<&'a str>,
    /// The zone the Nodes of the group's Cluster in the template's failure domain carry
    /// ([`zone_in_failure_domain`]), when any such Node exists.
    pub failure_domain_zone: Option<&'a FailureDomainZone>,
}

/// The zone label Nodes in one failure domain carry, and how many of them carry it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailureDomainZone {
    pub zone: String,
    pub nodes: usize,
}

/// Where a template's `topology.kubernetes.io/zone` came from, lowest precedence last.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "from", rename_all = "snake_case")]
pub enum ZoneSource {
    /// An existing Node of the group: its labels win over everything.
    GroupNode,
    /// The `capacity.cluster-autoscaler.kubernetes.io/labels` annotation.
    Annotation,
    /// The Nodes of the Cluster's Machines in the template's failure domain.
    FailureDomainNodes {
        failure_domain: String,
        nodes: usize,
    },
    /// `spec.template.spec.failureDomain` as it is, no Node being in that failure domain yet: right
    /// where failure domains are zone names (CAPA), wrong where they are not (CAPZ `1`, CAPV objects).
    FailureDomain { failure_domain: String },
}

/// A template's zone label and where it came from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Zone {
    pub value: String,
    pub source: ZoneSource,
}

impl Zone {
    /// One line for `check`: the zone, where it came from and, when it is only the failure domain's
    /// name, how to set it.
    pub fn describe(&self) -> String {
        match &self.source {
            ZoneSource::GroupNode => format!("{} (from a Node of the group)", self.value),
            ZoneSource::Annotation => format!("{} (from {})", self.value, capacity::LABELS),
            ZoneSource::FailureDomainNodes {
                failure_domain,
                nodes,
            } => format!(
                "{} (from {nodes} Node(s) of the Cluster's Machines in failure domain {failure_domain:?})",
                self.value
            ),
            ZoneSource::FailureDomain { failure_domain } => format!(
                "{} (spec.template.spec.failureDomain {failure_domain:?} as is: no Node is in that failure \
                 domain yet; right where failure domains are zone names (CAPA), not where they are not \
                 (CAPZ, CAPV): then set {}: {LABEL_ZONE}=<zone>)",
                self.value,
                capacity::LABELS
            ),
        }
    }
}

/// The zone of a failure domain, from the zone labels of the Nodes in it (label value → Nodes): the
/// one most Nodes carry, ties to the first by name. `None` without any.
pub fn zone_in_failure_domain(zones: &BTreeMap<String, usize>) -> Option<FailureDomainZone> {
    zones
        .iter()
        .filter(|(zone, n)| **n > 0 && !zone.is_empty() && is_label_value(zone))
        // max_by_key keeps the last of equals: reversed, the first by name wins a tie
        .rev()
        .max_by_key(|(_, n)| **n)
        .map(|(zone, n)| FailureDomainZone {
            zone: zone.clone(),
            nodes: *n,
        })
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
    /// The zone label, and where it came from.
    pub zone: Option<Zone>,
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
                    Subject::Other("environment".into()),
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

/// Builds the template node of one group. Never panics; every malformed input is a problem.
pub fn build(inputs: &TemplateInputs) -> TemplateOutcome {
    let mut problems = Vec::new();
    let group = Group::new(inputs, &mut problems);
    problems.extend(not_carried(&group.object, group.annotations()));
    let capacity = capacity(&group, &mut problems);
    let Some(size) = capacity.size() else {
        problems.extend(unsized_problem(&group, &capacity));
        return TemplateOutcome {
            template: None,
            problems,
        };
    };
    let name = node_name(&group.resource.key.name, inputs.group_id);
    let (labels, zone) = labels(inputs, &group, &name, capacity.gpu.as_ref(), &mut problems);
    let taints = taints(&group, &mut problems);
    let mut summary = summary(&group, &capacity, size, name, labels, taints);
    summary.zone = zone;
    let node = node(&summary, &capacity, inputs.group_id);
    TemplateOutcome {
        template: Some(TemplateNode { node, summary }),
        problems,
    }
}

/// The scalable resource of a group, as its problems name it, and its infrastructure template.
struct Group<'a> {
    resource: &'a ScalableResource,
    /// `Kind namespace/name`.
    object: Subject,
    /// `Kind namespace/name` of the referenced infrastructure template, also when it cannot be read.
    infra_name: Option<String>,
    /// `None` when there is no reference or the template cannot be read.
    template: Option<&'a InfraTemplate>,
}

impl<'a> Group<'a> {
    fn new(inputs: &TemplateInputs<'a>, problems: &mut Vec<Problem>) -> Group<'a> {
        let r = inputs.resource;
        let infra_name = match &r.template.infrastructure_ref {
            Some(Ok(iref)) => Some(format!("{} {}/{}", iref.kind, r.key.namespace, iref.name)),
            _ => None,
        };
        let mut group = Group {
            resource: r,
            object: Subject::object(r.kind, &r.key),
            infra_name,
            template: None,
        };
        match &inputs.infra {
            InfraSource::Found(t) => group.template = Some(*t),
            InfraSource::NoReference => {}
            // The annotations may still describe the group, so this is not fatal.
            InfraSource::Unavailable { reason } => problems.push(Problem::new(
                &group.object,
                "spec.template.spec.infrastructureRef",
                format!(
                    "{} is unavailable: {reason}; scale from zero uses the capacity annotations alone",
                    group.infra_described()
                ),
            )),
        }
        group
    }

    fn annotations(&self) -> &'a BTreeMap<String, String> {
        &self.resource.annotations
    }

    /// `Kind namespace/name` of the readable template: the object of problems in its own fields.
    fn template_object(&self) -> Option<Subject> {
        self.template.map(|t| Subject::object(&t.kind, &t.key))
    }

    /// `Kind/name` of the readable template, as [`CapacitySource`] shows it.
    fn template_id(&self) -> Option<String> {
        self.template.map(|t| format!("{}/{}", t.kind, t.key.name))
    }

    /// The infrastructure template as a message can point a user at it, readable, referenced or neither.
    fn infra_described(&self) -> String {
        self.template_object()
            .map(|t| t.to_string())
            .or_else(|| self.infra_name.clone())
            .unwrap_or_else(|| "the infrastructure template".to_string())
    }
}

/// The capacity annotations the in-tree provider honours and the externalgrpc protocol cannot carry:
/// a template is one `v1.Node`, with no room for the ResourceSlices or the CSINode they describe. Each
/// one set is a problem saying so and what CA does instead, rather than being dropped in silence.
pub fn not_carried(
    object: impl Into<Subject> + Copy,
    annotations: &BTreeMap<String, String>,
) -> Vec<Problem> {
    let set = |key: &str| annotations.get(key).is_some_and(|v| !v.trim().is_empty());
    let mut problems = Vec::new();
    if set(capacity::DRA_DRIVER) {
        problems.push(Problem::new(
            object,
            Problem::annotation_field(capacity::DRA_DRIVER),
            "not carried over externalgrpc: a template is one Node and the protocol has no field for the \
             ResourceSlices this annotation describes (kubernetes/autoscaler#10277); CA simulates this \
             group's node without DRA devices, so a pod that claims devices does not scale it up from zero \
             (it can once the group has a node, whose real ResourceSlices CA sees)",
        ));
    }
    if set(capacity::CSI_DRIVER) {
        problems.push(Problem::new(
            object,
            Problem::annotation_field(capacity::CSI_DRIVER),
            "not carried over externalgrpc: the protocol has no field for the CSINode this annotation \
             describes; CA simulates this group's node without a CSINode: with --enable-csi-node-aware-scheduling a pod with CSI volumes does not scale it up from \
             zero (kubernetes/autoscaler#10131), without it the drivers' attach limits are not considered",
        ));
    }
    problems
}

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
struct Amount {
    quantity: String,
    value: f64,
}

/// What a template cannot do without: a node with no cpu or memory tells CA nothing about what fits on it.
struct Size {
    cpu: Amount,
    memory: Amount,
}

/// A GPU resource of the template.
#[derive(Clone)]
struct Gpu {
    /// The extended resource name, e.g. `nvidia.com/gpu`.
    resource: String,
    count: i64,
}

struct Capacity {
    /// By resource name.
    entries: BTreeMap<String, Entry>,
    gpu: Option<Gpu>,
    pods: i64,
}

impl Capacity {
    /// Zero is as good as absent: a node with none of a resource offers none of it.
    fn amount(&self, resource: &str) -> Option<Amount> {
        self.entries
            .get(resource)
            .filter(|e| e.value > 0.0)
            .map(|e| Amount {
                quantity: e.quantity.clone(),
                value: e.value,
            })
    }

    fn size(&self) -> Option<Size> {
        Some(Size {
            cpu: self.amount("cpu")?,
            memory: self.amount("memory")?,
        })
    }

    /// The default `pods` does not count: it says nothing about the machines.
    fn source(&self, template_id: Option<String>) -> CapacitySource {
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

    fn quantities(&self) -> BTreeMap<String, Quantity> {
        self.entries
            .iter()
            .map(|(res, e)| (res.clone(), Quantity(e.quantity.clone())))
            .collect()
    }
}

/// The template's capacity, overridden key by key by the annotations.
fn capacity(group: &Group, problems: &mut Vec<Problem>) -> Capacity {
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
fn unsized_problem(group: &Group, capacity: &Capacity) -> Option<Problem> {
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
fn labels(
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
            .map(|(k, v)| (k.clone(), v.clone())),
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
fn taints(group: &Group, problems: &mut Vec<Problem>) -> Vec<Taint> {
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

fn summary(
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
fn node(summary: &TemplateSummary, capacity: &Capacity, group_id: &str) -> api::Node {
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

/// Pods and extended resources (`vendor.example/name`) are counted in whole units.
fn must_be_whole(resource: &str) -> bool {
    resource == "pods" || (resource.contains('/') && !resource.starts_with("kubernetes.io/"))
}

/// The GPU label value for a GPU resource: itself when it is a valid label value, else with every invalid
/// character replaced by `-` (`nvidia.com/gpu` → `nvidia.com-gpu`). Users who need a specific value
/// (`--gpu-total` matches on it) set `cluster-api/accelerator` in the labels annotation, which wins.
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
pub fn parse_count(
    object: impl Into<Subject> + Copy,
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
pub fn parse_labels_annotation(
    object: impl Into<Subject> + Copy,
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
pub fn parse_taints_annotation(
    object: impl Into<Subject> + Copy,
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
mod tests;
