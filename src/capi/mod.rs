//! Cluster API knowledge, pure: annotation and label keys derived from the API group, typed views of the
//! objects the provider reads (v1beta1 and v1beta2 alike), and providerID normalisation.
//!
//! Views keep only what decisions need, so the caches stay small; they are parsed from the JSON of the
//! objects (`parse.rs`) and never talk to the API.

mod bounds;
pub mod names;
pub mod owners;
mod parse;
pub mod preflight;
pub mod providerid;
pub mod quantity;
pub mod rollout;
pub mod text;

use std::collections::BTreeMap;
use std::fmt;

pub use bounds::{has_bounds, scaling_bounds};
pub use parse::ParseError;
pub use text::{Labels, Name};

/// The API group of Cluster API objects unless `CAPI_GROUP` says otherwise.
pub const DEFAULT_GROUP: &str = "cluster.x-k8s.io";
/// Presence pauses a scalable resource, whatever its value. Not derived from `CAPI_GROUP` (as upstream).
pub const PAUSED_ANNOTATION: &str = "cluster.x-k8s.io/paused";
/// The node label CA reads the GPU type from.
pub const GPU_LABEL: &str = "cluster-api/accelerator";
/// The hourly price of one node of a group, in any currency unit, as a decimal number. The project's own key.
pub const PRICE_ANNOTATION: &str = "capi-autoscaler-provider/hourly-price";

/// Scale-from-zero annotations on MachineDeployments, MachineSets and MachinePools (not group dependent).
pub mod capacity {
    pub const CPU: &str = "capacity.cluster-autoscaler.kubernetes.io/cpu";
    pub const MEMORY: &str = "capacity.cluster-autoscaler.kubernetes.io/memory";
    pub const EPHEMERAL_DISK: &str = "capacity.cluster-autoscaler.kubernetes.io/ephemeral-disk";
    pub const GPU_TYPE: &str = "capacity.cluster-autoscaler.kubernetes.io/gpu-type";
    pub const GPU_COUNT: &str = "capacity.cluster-autoscaler.kubernetes.io/gpu-count";
    pub const MAX_PODS: &str = "capacity.cluster-autoscaler.kubernetes.io/maxPods";
    pub const TAINTS: &str = "capacity.cluster-autoscaler.kubernetes.io/taints";
    pub const LABELS: &str = "capacity.cluster-autoscaler.kubernetes.io/labels";
    /// Honoured by the in-tree provider, not carried by externalgrpc (a template is one Node).
    pub const DRA_DRIVER: &str = "capacity.cluster-autoscaler.kubernetes.io/dra-driver";
    /// Honoured by the in-tree provider, not carried by externalgrpc (a template is one Node).
    pub const CSI_DRIVER: &str = "capacity.cluster-autoscaler.kubernetes.io/csi-driver";
}

/// Keys whose prefix is the Cluster API group (`CAPI_GROUP`), computed once at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    pub group: String,
    pub min_size: String,
    pub max_size: String,
    pub options_prefix: String,
    pub delete_machine: String,
    /// Node annotation naming the Machine behind the Node.
    pub node_machine: String,
    /// Node annotation naming the namespace of that Machine (and of its Cluster).
    pub node_cluster_namespace: String,
    /// Node annotation naming the Cluster the Node belongs to (the same key as the label on objects).
    pub node_cluster_name: String,
    pub cluster_name_label: String,
    /// Labels naming the owners of MachineSets and Machines (see `owners`).
    pub deployment_name_label: String,
    pub set_name_label: String,
    pub pool_name_label: String,
}

impl Keys {
    pub fn new(group: &str) -> Self {
        Keys {
            group: group.to_string(),
            min_size: format!("{group}/cluster-api-autoscaler-node-group-min-size"),
            max_size: format!("{group}/cluster-api-autoscaler-node-group-max-size"),
            options_prefix: format!("{group}/autoscaling-options-"),
            delete_machine: format!("{group}/delete-machine"),
            node_machine: format!("{group}/machine"),
            node_cluster_namespace: format!("{group}/cluster-namespace"),
            node_cluster_name: format!("{group}/cluster-name"),
            cluster_name_label: format!("{group}/cluster-name"),
            deployment_name_label: format!("{group}/deployment-name"),
            set_name_label: format!("{group}/set-name"),
            pool_name_label: format!("{group}/pool-name"),
        }
    }
}

impl Default for Keys {
    fn default() -> Self {
        Keys::new(DEFAULT_GROUP)
    }
}

/// The kinds that can be node groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScalableKind {
    MachineDeployment,
    MachineSet,
    MachinePool,
}

impl ScalableKind {
    pub const ALL: [ScalableKind; 3] = [
        ScalableKind::MachineDeployment,
        ScalableKind::MachineSet,
        ScalableKind::MachinePool,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ScalableKind::MachineDeployment => "MachineDeployment",
            ScalableKind::MachineSet => "MachineSet",
            ScalableKind::MachinePool => "MachinePool",
        }
    }

    pub fn plural(self) -> &'static str {
        match self {
            ScalableKind::MachineDeployment => "machinedeployments",
            ScalableKind::MachineSet => "machinesets",
            ScalableKind::MachinePool => "machinepools",
        }
    }

    pub fn from_kind(kind: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == kind)
    }
}

impl fmt::Display for ScalableKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// namespace/name of a namespaced object. Its clones share the strings; namespaces are interned.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ObjectKey {
    pub namespace: Name,
    pub name: Name,
}

impl ObjectKey {
    pub fn new(namespace: impl AsRef<str>, name: impl Into<Name>) -> Self {
        ObjectKey {
            namespace: Name::interned(namespace.as_ref()),
            name: name.into(),
        }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Interned: the Machines of a MachineSet all name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerRef {
    pub kind: Name,
    pub name: Name,
}

/// A taint as written on a Node.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Taint {
    pub key: String,
    pub value: String,
    pub effect: String,
}

/// `spec.template.spec.infrastructureRef`: v1beta1 names `apiVersion`, v1beta2 names `apiGroup` only.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InfraRef {
    pub api_group: String,
    /// Present for v1beta1 references; v1beta2 references leave the version to discovery.
    pub api_version: Option<String>,
    pub kind: String,
    pub name: String,
}

/// What the Machines a scalable resource creates will look like.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MachineTemplate {
    /// `spec.template.metadata.labels`.
    pub labels: Labels,
    /// `Err` when the reference is there but unusable (missing kind, name, or both apiGroup and apiVersion).
    pub infrastructure_ref: Option<Result<InfraRef, ParseError>>,
    /// `spec.template.spec.taints` (v1beta2, CAPI ≥ 1.12).
    pub taints: Vec<Taint>,
    /// `spec.template.spec.failureDomain`.
    pub failure_domain: Option<String>,
}

/// A MachineDeployment, MachineSet or MachinePool, as far as the autoscaler cares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScalableResource {
    pub kind: ScalableKind,
    pub key: ObjectKey,
    pub uid: String,
    pub resource_version: String,
    pub labels: Labels,
    pub annotations: Labels,
    /// `spec.clusterName`, else the cluster-name label, else empty.
    pub cluster_name: String,
    /// `spec.replicas`; `None` when absent.
    pub replicas: Option<i32>,
    /// `status.replicas`: the Machines there are, which lags `spec.replicas` while they come and go.
    pub status_replicas: Option<i32>,
    /// `metadata.generation`: bumped by every change of the spec.
    pub generation: Option<i64>,
    /// `status.observedGeneration`: the generation Cluster API's controller last acted on.
    pub observed_generation: Option<i64>,
    /// MachineDeployments: the v1beta2 condition `RollingOut` is `True` (see `rollout`).
    pub rolling_out: bool,
    /// MachineSets: preflight checks holding the scale-up, as its conditions say (see `preflight`).
    pub preflight: Option<crate::capi::preflight::PreflightHold>,
    /// The `cluster.x-k8s.io/paused` annotation: Cluster API does not act on the object. (A
    /// MachineDeployment's `spec.paused` pauses its rollouts only, not its scaling.)
    pub paused: bool,
    pub owners: Vec<OwnerRef>,
    pub template: MachineTemplate,
    /// MachinePool `spec.providerIDList`, verbatim.
    pub provider_id_list: Vec<String>,
    /// Managed by a ClusterClass topology (label `topology.cluster.x-k8s.io/owned`): the name of its
    /// entry in the Cluster's `spec.topology.workers` (label `…/deployment-name` or `…/pool-name`).
    pub topology: Option<String>,
}

impl ScalableResource {
    /// Whether Cluster API's controller has acted on this object's current spec (its
    /// observedGeneration has reached its generation). An object without a generation (not from
    /// an API server) counts as observed.
    pub fn observed(&self) -> bool {
        match (self.generation, self.observed_generation) {
            (Some(generation), Some(observed)) => observed >= generation,
            (Some(_), None) => false,
            (None, _) => true,
        }
    }
}

/// Why a Machine counts as failed, from v1beta1 fields or v1beta2 conditions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineFailure {
    pub reason: String,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    pub key: ObjectKey,
    pub uid: String,
    pub resource_version: String,
    /// Only the keys under the Cluster API group (the owners' names).
    pub labels: Labels,
    pub annotations: BTreeMap<String, String>,
    pub cluster_name: String,
    /// `spec.providerID`; `None` when absent or empty. Shared with the instance the snapshot lists.
    pub provider_id: Option<Name>,
    /// `status.nodeRef.name`.
    pub node_ref: Option<String>,
    /// `spec.failureDomain`: with its Node's zone label, what a failure domain's zone is.
    pub failure_domain: Option<String>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    pub owners: Vec<OwnerRef>,
    pub phase: Option<String>,
    pub failure: Option<MachineFailure>,
    /// Its `NodeHealthy` or `HealthCheckSucceeded` (MachineHealthCheck) condition is `False`: with
    /// no nodeRef, what makes Cluster API's MachineSet delete it right after the marked Machines.
    pub conditions_unhealthy: bool,
}

/// The node description an infrastructure machine template publishes for scale from zero.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InfraTemplate {
    pub key: ObjectKey,
    pub api_group: String,
    pub kind: String,
    /// `status.capacity`, raw quantity strings by resource name.
    pub capacity: BTreeMap<String, String>,
    /// `status.nodeInfo.architecture`.
    pub architecture: Option<String>,
    /// `status.nodeInfo.operatingSystem`.
    pub operating_system: Option<String>,
}

/// A workload-cluster Node: only what templates copy, what maps Machines without providerIDs, and
/// the Cluster it belongs to (which Cluster the provider serves, `scope`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Node {
    pub name: Name,
    pub provider_id: Option<Name>,
    /// Only the ones templates copy.
    pub labels: Labels,
    /// The `cluster-namespace` and `cluster-name` annotations Cluster API syncs onto its Nodes.
    pub cluster: Option<ObjectKey>,
}

/// A worker entry of a Cluster's managed topology (`spec.topology.workers`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyWorker {
    /// `MachineDeployment` for `machineDeployments[]`, `MachinePool` for `machinePools[]`.
    pub kind: ScalableKind,
    pub name: String,
    pub replicas: Option<i32>,
}

/// What the provider needs of a Cluster: the workers its topology declares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterTopology {
    pub key: ObjectKey,
    pub workers: Vec<TopologyWorker>,
    /// `spec.paused` or the paused annotation: Cluster API acts on none of its groups.
    pub paused: bool,
}

/// Test fixtures of the Cluster API views, for the unit tests of every module.
#[cfg(test)]
pub(crate) mod test_fixtures {
    use super::{Labels, Machine, MachineTemplate, ObjectKey, ScalableKind, ScalableResource};

    /// A Machine `ns/name` of Cluster `c1` at version "1", with no labels, annotations, owners,
    /// providerID or Node.
    pub(crate) fn machine(name: &str) -> Machine {
        Machine {
            key: ObjectKey::new("ns", name),
            uid: String::new(),
            resource_version: "1".into(),
            labels: Labels::default(),
            annotations: Default::default(),
            cluster_name: "c1".into(),
            provider_id: None,
            node_ref: None,
            failure_domain: None,
            deleting: false,
            owners: Vec::new(),
            phase: None,
            failure: None,
            conditions_unhealthy: false,
        }
    }

    /// A resource `ns/name` of Cluster `c1` at zero replicas, with no labels, annotations or owners.
    pub(crate) fn resource(kind: ScalableKind, name: &str) -> ScalableResource {
        ScalableResource {
            kind,
            key: ObjectKey::new("ns", name),
            uid: String::new(),
            resource_version: "1".into(),
            labels: Labels::default(),
            annotations: Labels::default(),
            cluster_name: "c1".into(),
            replicas: Some(0),
            status_replicas: None,
            generation: None,
            observed_generation: None,
            rolling_out: false,
            preflight: None,
            paused: false,
            owners: Vec::new(),
            template: MachineTemplate::default(),
            provider_id_list: Vec::new(),
            topology: None,
        }
    }
}
