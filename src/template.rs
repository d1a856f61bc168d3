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

mod annotations;
mod labels;
mod node;
mod node_capacity;
mod zone;

use crate::capi::Labels;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as api;
use prost::bytes::Bytes;

use crate::capi::{InfraTemplate, ScalableResource, Taint};
use crate::encoded::Encoded;
use crate::problem::{Problem, Subject};

pub use annotations::{not_carried, parse_count, parse_labels_annotation, parse_taints_annotation};
use labels::{labels, taints};
use node::{node, node_name, summary};
use node_capacity::{capacity, unsized_problem};
pub use zone::{FailureDomainZone, Zone, ZoneSource, zone_in_failure_domain};

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

#[derive(Clone, Debug)]
pub struct TemplateOutcome {
    /// `None` when the group cannot be described (no cpu or no memory).
    pub template: Option<TemplateNode>,
    pub problems: Vec<Problem>,
}

#[derive(Clone, Debug)]
pub struct TemplateNode {
    pub node: api::Node,
    pub summary: TemplateSummary,
    /// `node` as CA receives it, encoded the first time CA asks ([`TemplateNode::encoded`]): a
    /// template is shared by every snapshot until its group changes, so each is encoded once.
    encoded: Encoded,
}

impl TemplateNode {
    fn new(node: api::Node, summary: TemplateSummary) -> Self {
        TemplateNode {
            node,
            summary,
            encoded: Encoded::default(),
        }
    }

    /// `node` as `encode` writes it, encoded on the first call only; every later call shares
    /// those bytes.
    pub fn encoded(&self, encode: impl FnOnce(&api::Node) -> Vec<u8>) -> Bytes {
        self.encoded.get_or_encode(|| encode(&self.node))
    }
}

/// Two templates are the same when they describe the same node, encoded or not.
impl PartialEq for TemplateNode {
    fn eq(&self, other: &Self) -> bool {
        self.node == other.node && self.summary == other.summary
    }
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
        template: Some(TemplateNode::new(node, summary)),
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

    fn annotations(&self) -> &'a Labels {
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

#[cfg(test)]
mod tests;
