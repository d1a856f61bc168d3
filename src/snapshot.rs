//! Pure: the cached objects (`Index`) → an immutable `Snapshot` that every read RPC answers from.
//!
//! The index consumes watch events (apply, delete, reset) per kind, exactly as the store receives them,
//! so it is tested by feeding it events, without a cluster.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::capi::{
    ClusterTopology, InfraRef, InfraTemplate, Keys, Machine, Node, ObjectKey, ScalableKind,
    ScalableResource, providerid,
};
use crate::discovery::{self, DiscoverySpec};
use crate::options::{self, GroupOptions};
use crate::pricing::{self, PriceSource, ReferencePrices};
use crate::problem::Problem;
use crate::template::{self, InfraSource, TemplateInputs, TemplateNode};

/// Prefixes of the instance ids made up for Machines that have no providerID (kept from upstream).
pub const PENDING_PREFIX: &str = "pending-machine-";
pub const FAILED_PREFIX: &str = "failed-machine-";
pub const DELETING_PREFIX: &str = "deleting-machine-";

/// Settings that shape the snapshot and do not change while the provider runs.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    pub keys: Keys,
    pub discovery: Vec<DiscoverySpec>,
    pub default_arch: Option<String>,
    pub cpu_hour_price: Option<f64>,
    pub gib_hour_price: Option<f64>,
}

/// An infrastructure template kind, identified as a reference names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InfraKind {
    pub api_group: String,
    pub kind: String,
}

impl InfraKind {
    pub fn of(reference: &InfraRef) -> Self {
        InfraKind {
            api_group: reference.api_group.clone(),
            kind: reference.kind.clone(),
        }
    }
}

/// Whether the objects of an infrastructure template kind can be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InfraKindState {
    /// A watch was asked for and has not listed yet.
    Syncing,
    Synced,
    /// The kind cannot be read: not served, forbidden, … The text says why.
    Unavailable(String),
}

/// A watched object of a kind, or the reason it could not be read.
type Parsed<T> = Result<Arc<T>, Problem>;

/// The cached objects of the management (and optionally workload) cluster.
#[derive(Clone, Debug, Default)]
pub struct Index {
    resources: BTreeMap<(ScalableKind, ObjectKey), Parsed<ScalableResource>>,
    machines: BTreeMap<ObjectKey, Parsed<Machine>>,
    nodes: HashMap<String, Arc<Node>>,
    infra_kinds: BTreeMap<InfraKind, InfraKindState>,
    infra: HashMap<(InfraKind, ObjectKey), Parsed<InfraTemplate>>,
    /// Clusters by namespace/name, for the topology check.
    clusters: HashMap<ObjectKey, Arc<ClusterTopology>>,
}

impl Index {
    pub fn apply_resource(
        &mut self,
        kind: ScalableKind,
        key: ObjectKey,
        parsed: Parsed<ScalableResource>,
    ) {
        self.resources.insert((kind, key), parsed);
    }

    pub fn delete_resource(&mut self, kind: ScalableKind, key: &ObjectKey) {
        self.resources.remove(&(kind, key.clone()));
    }

    /// A watch of `kind` re-listed: these are now all the objects of that kind.
    pub fn reset_resources(
        &mut self,
        kind: ScalableKind,
        objects: impl IntoIterator<Item = (ObjectKey, Parsed<ScalableResource>)>,
    ) {
        self.resources.retain(|(k, _), _| *k != kind);
        for (key, parsed) in objects {
            self.resources.insert((kind, key), parsed);
        }
    }

    pub fn resource(&self, kind: ScalableKind, key: &ObjectKey) -> Option<&Arc<ScalableResource>> {
        self.resources
            .get(&(kind, key.clone()))
            .and_then(|r| r.as_ref().ok())
    }

    pub fn apply_machine(&mut self, key: ObjectKey, parsed: Parsed<Machine>) {
        self.machines.insert(key, parsed);
    }

    pub fn delete_machine(&mut self, key: &ObjectKey) {
        self.machines.remove(key);
    }

    pub fn reset_machines(
        &mut self,
        objects: impl IntoIterator<Item = (ObjectKey, Parsed<Machine>)>,
    ) {
        self.machines = objects.into_iter().collect();
    }

    pub fn machine(&self, key: &ObjectKey) -> Option<&Arc<Machine>> {
        self.machines.get(key).and_then(|m| m.as_ref().ok())
    }

    pub fn apply_node(&mut self, node: Node) {
        self.nodes.insert(node.name.clone(), Arc::new(node));
    }

    pub fn delete_node(&mut self, name: &str) {
        self.nodes.remove(name);
    }

    pub fn reset_nodes(&mut self, nodes: impl IntoIterator<Item = Node>) {
        self.nodes = nodes
            .into_iter()
            .map(|n| (n.name.clone(), Arc::new(n)))
            .collect();
    }

    pub fn set_infra_kind_state(&mut self, kind: InfraKind, state: InfraKindState) {
        self.infra_kinds.insert(kind, state);
    }

    pub fn infra_kind_state(&self, kind: &InfraKind) -> Option<&InfraKindState> {
        self.infra_kinds.get(kind)
    }

    pub fn apply_infra(&mut self, kind: InfraKind, key: ObjectKey, parsed: Parsed<InfraTemplate>) {
        self.infra.insert((kind, key), parsed);
    }

    pub fn delete_infra(&mut self, kind: &InfraKind, key: &ObjectKey) {
        self.infra.remove(&(kind.clone(), key.clone()));
    }

    pub fn reset_infra(
        &mut self,
        kind: &InfraKind,
        objects: impl IntoIterator<Item = (ObjectKey, Parsed<InfraTemplate>)>,
    ) {
        self.infra.retain(|(k, _), _| k != kind);
        for (key, parsed) in objects {
            self.infra.insert((kind.clone(), key), parsed);
        }
    }

    pub fn apply_cluster(&mut self, cluster: ClusterTopology) {
        self.clusters.insert(cluster.key.clone(), Arc::new(cluster));
    }

    pub fn delete_cluster(&mut self, key: &ObjectKey) {
        self.clusters.remove(key);
    }

    pub fn reset_clusters(&mut self, clusters: impl IntoIterator<Item = ClusterTopology>) {
        self.clusters = clusters
            .into_iter()
            .map(|c| (c.key.clone(), Arc::new(c)))
            .collect();
    }

    /// Infrastructure template kinds referenced by candidate groups that nobody watches yet.
    pub fn wanted_infra_kinds(&self) -> BTreeSet<InfraKind> {
        self.resources
            .values()
            .filter_map(|r| r.as_ref().ok())
            .filter_map(|r| r.template.infrastructure_ref.as_ref())
            .filter_map(|r| r.as_ref().ok())
            .map(InfraKind::of)
            .filter(|k| !self.infra_kinds.contains_key(k))
            .collect()
    }

    /// Builds the snapshot: node groups, their instances and templates, lookup tables, problems.
    pub fn snapshot(&self, settings: &Settings, generation: u64) -> Snapshot {
        Builder::new(self, settings).build(generation)
    }
}

/// What CA sees of one instance of a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstanceState {
    Running,
    Creating,
    Deleting,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceError {
    pub code: String,
    pub message: String,
    /// CA's error class: 1 out of resources, 99 other.
    pub class: i32,
}

pub const OTHER_ERROR_CLASS: i32 = 99;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    /// The Machine's providerID byte for byte, or a made-up id with an upstream prefix.
    pub id: String,
    pub state: InstanceState,
    pub error: Option<InstanceError>,
    pub machine: Option<ObjectKey>,
}

/// A node group as CA sees it, with what the other RPCs need.
#[derive(Clone, Debug)]
pub struct NodeGroup {
    pub id: String,
    pub min: i32,
    pub max: i32,
    /// `spec.replicas`.
    pub target: i32,
    pub resource: Arc<ScalableResource>,
    pub instances: Vec<Instance>,
    /// Nodes that registered: running instances, and Machines with a Node but no known providerID.
    pub registered: i32,
    pub template: Option<Arc<TemplateNode>>,
    pub options: Option<GroupOptions>,
    pub price: Option<f64>,
}

impl NodeGroup {
    pub fn kind(&self) -> ScalableKind {
        self.resource.kind
    }

    pub fn debug(&self) -> String {
        format!(
            "{} (min: {}, max: {}, replicas: {})",
            self.id, self.min, self.max, self.target
        )
    }
}

/// Where a node CA names lives: its group and, when there is one, its Machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub group_id: String,
    pub machine: Option<ObjectKey>,
    /// The node is listed in the MachinePool's providerIDList.
    pub in_pool_list: bool,
}

/// The node fields CA sends (`ExternalGrpcNode`).
#[derive(Clone, Debug, Default)]
pub struct NodeRef<'a> {
    pub provider_id: &'a str,
    pub name: &'a str,
    pub annotations: Option<&'a HashMap<String, String>>,
}

/// Everything read RPCs answer from; immutable once built.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub generation: u64,
    pub groups: BTreeMap<String, NodeGroup>,
    /// Exact instance id (providerID or made-up id) → where it lives.
    by_instance_id: HashMap<String, Location>,
    /// Normalised providerID → where it lives; only ids that normalise uniquely.
    by_normalized_id: HashMap<String, Location>,
    /// Machine → where it lives (also Machines that are not listed as instances).
    by_machine: HashMap<ObjectKey, Location>,
    /// Resources that are candidates but not served (paused, bad bounds, …) by id, for `check`.
    pub skipped: BTreeMap<String, String>,
    pub problems: Vec<Problem>,
    /// Prices per CPU-hour and GiB-hour for PricingPodPrice, and where each came from.
    pub reference_prices: ReferencePrices,
    pub reference_sources: [PriceSource; 2],
    pub machines: usize,
}

impl Default for Snapshot {
    fn default() -> Self {
        Index::default().snapshot(&Settings::default(), 0)
    }
}

impl Snapshot {
    pub fn group(&self, id: &str) -> Option<&NodeGroup> {
        self.groups.get(id)
    }

    /// The group and Machine of a node, by providerID (exact, then normalised), by the ids this provider
    /// made up for Machines without one, and by the node's machine annotations.
    pub fn locate(&self, node: &NodeRef<'_>, keys: &Keys) -> Option<&Location> {
        if !node.provider_id.is_empty() {
            if let Some(found) = self.by_instance_id.get(node.provider_id) {
                return Some(found);
            }
            if let Some(found) = self
                .by_normalized_id
                .get(providerid::normalize(node.provider_id))
            {
                return Some(found);
            }
        }
        // CA's fake nodes for instances that never registered carry the instance id as their name.
        if let Some(found) = self.by_instance_id.get(node.name) {
            return Some(found);
        }
        let annotations = node.annotations?;
        let name = annotations.get(&keys.node_machine)?;
        let namespace = annotations.get(&keys.node_cluster_namespace)?;
        self.by_machine
            .get(&ObjectKey::new(namespace.as_str(), name.as_str()))
    }

    pub fn group_for_node(&self, node: &NodeRef<'_>, keys: &Keys) -> Option<&NodeGroup> {
        self.locate(node, keys)
            .and_then(|l| self.groups.get(&l.group_id))
    }
}

/// The made-up instance id of a Machine without a providerID.
fn synthetic_id(prefix: &str, key: &ObjectKey) -> String {
    // `_` cannot occur in a namespace, so the first one separates namespace and name.
    format!("{prefix}{}_{}", key.namespace, key.name)
}

/// The labels CAPI puts on Machines naming their owner, under the group in use.
struct OwnerLabels {
    pool: String,
    set: String,
    deployment: String,
}

impl OwnerLabels {
    fn new(keys: &Keys) -> Self {
        OwnerLabels {
            pool: format!("{}/pool-name", keys.group),
            set: format!("{}/set-name", keys.group),
            deployment: format!("{}/deployment-name", keys.group),
        }
    }
}

struct Builder<'a> {
    index: &'a Index,
    settings: &'a Settings,
    problems: Vec<Problem>,
    skipped: BTreeMap<String, String>,
}

fn object_name(kind: impl std::fmt::Display, key: &ObjectKey) -> String {
    format!("{kind} {key}")
}

pub fn group_id(kind: ScalableKind, key: &ObjectKey) -> String {
    format!("{}/{}/{}", kind.as_str(), key.namespace, key.name)
}

/// min/max from the annotations. `Ok(None)`: neither annotation, not a candidate.
pub fn scaling_bounds(
    keys: &Keys,
    object: &str,
    annotations: &BTreeMap<String, String>,
) -> Result<Option<(i32, i32)>, Problem> {
    let read = |key: &str| -> Result<Option<i32>, Problem> {
        match annotations.get(key) {
            None => Ok(None),
            Some(v) => match v.trim().parse::<i32>() {
                Ok(n) if n >= 0 => Ok(Some(n)),
                Ok(n) => Err(Problem::new(
                    object,
                    Problem::annotation_field(key),
                    format!("{n} is negative"),
                )),
                Err(_) => Err(Problem::new(
                    object,
                    Problem::annotation_field(key),
                    format!("{v:?} is not a non-negative integer"),
                )),
            },
        }
    };
    let min = read(&keys.min_size)?;
    let max = read(&keys.max_size)?;
    match (min, max) {
        (None, None) => Ok(None),
        (_, None) => Err(Problem::new(
            object,
            Problem::annotation_field(&keys.max_size),
            "missing: the min size annotation is set but the max size annotation is not",
        )),
        (min, Some(max)) => {
            let min = min.unwrap_or(0);
            if max < min {
                Err(Problem::new(
                    object,
                    Problem::annotation_field(&keys.max_size),
                    format!("max size {max} is below min size {min}"),
                ))
            } else {
                Ok(Some((min, max)))
            }
        }
    }
}

impl<'a> Builder<'a> {
    fn new(index: &'a Index, settings: &'a Settings) -> Self {
        Builder {
            index,
            settings,
            problems: Vec::new(),
            skipped: BTreeMap::new(),
        }
    }

    fn skip(&mut self, id: String, why: impl Into<String>) {
        self.skipped.insert(id, why.into());
    }

    /// What a Machine points at: its owner by reference, else by the group's labels.
    fn machine_owner<'m>(
        &self,
        machine: &'m Machine,
        labels: &OwnerLabels,
    ) -> Option<(ScalableKind, &'m str)> {
        let owner = |kind: &str| {
            machine
                .owners
                .iter()
                .find(|o| o.kind == kind)
                .map(|o| o.name.as_str())
        };
        let label = |key: &String| machine.labels.get(key).map(String::as_str);
        if let Some(pool) = owner("MachinePool").or_else(|| label(&labels.pool)) {
            return Some((ScalableKind::MachinePool, pool));
        }
        if let Some(set) = owner("MachineSet").or_else(|| label(&labels.set)) {
            return Some((ScalableKind::MachineSet, set));
        }
        label(&labels.deployment).map(|md| (ScalableKind::MachineDeployment, md))
    }

    /// The served group behind a Machine's owner: a MachineSet owned by a served MachineDeployment
    /// belongs to that MachineDeployment.
    fn owner_group(
        &self,
        namespace: &str,
        (kind, name): (ScalableKind, &str),
        served: &BTreeMap<String, NodeGroup>,
    ) -> Option<String> {
        let serving = |kind: ScalableKind, name: &str| {
            let id = group_id(kind, &ObjectKey::new(namespace, name));
            served.contains_key(&id).then_some(id)
        };
        if kind != ScalableKind::MachineSet {
            return serving(kind, name);
        }
        self.index
            .resource(ScalableKind::MachineSet, &ObjectKey::new(namespace, name))
            .and_then(|ms| ms.owners.iter().find(|o| o.kind == "MachineDeployment"))
            .and_then(|md| serving(ScalableKind::MachineDeployment, &md.name))
            .or_else(|| serving(ScalableKind::MachineSet, name))
    }

    /// An autoscaled group whose replicas its Cluster's managed topology also sets: the topology
    /// controller would undo every scale the autoscaler makes.
    fn topology_conflict(&self, resource: &ScalableResource) -> Option<Problem> {
        let name = resource.topology.as_ref()?;
        let cluster_key = ObjectKey::new(
            resource.key.namespace.as_str(),
            resource.cluster_name.as_str(),
        );
        let cluster = self.index.clusters.get(&cluster_key)?;
        let kind = match resource.kind {
            ScalableKind::MachinePool => ScalableKind::MachinePool,
            _ => ScalableKind::MachineDeployment,
        };
        let (position, worker) = cluster
            .workers
            .iter()
            .filter(|w| w.kind == kind)
            .enumerate()
            .find(|(_, w)| &w.name == name)?;
        let replicas = worker.replicas?;
        let list = match kind {
            ScalableKind::MachinePool => "machinePools",
            _ => "machineDeployments",
        };
        Some(Problem::new(
            format!("Cluster {cluster_key}"),
            format!("spec.topology.workers.{list}[{position}].replicas"),
            format!(
                "sets replicas ({replicas}) of {} {}, which the autoscaler manages: remove it, \
                 or the topology controller undoes every scale",
                resource.kind, resource.key
            ),
        ))
    }

    fn infra_source(&self, resource: &ScalableResource) -> Result<InfraSource<'a>, Problem> {
        let index = self.index;
        match &resource.template.infrastructure_ref {
            None => Ok(InfraSource::NoReference),
            Some(Err(e)) => Err(Problem::new(
                object_name(resource.kind, &resource.key),
                format!("spec.template.spec.infrastructureRef: {}", e.field),
                e.message.clone(),
            )),
            Some(Ok(reference)) => {
                let kind = InfraKind::of(reference);
                let key = ObjectKey::new(resource.key.namespace.as_str(), reference.name.as_str());
                let what = format!(
                    "{} {}/{} ({})",
                    reference.kind, key.namespace, key.name, reference.api_group
                );
                Ok(match index.infra_kinds.get(&kind) {
                    None | Some(InfraKindState::Syncing) => InfraSource::Unavailable {
                        reason: format!(
                            "{what}: the watch of {} has not listed yet",
                            reference.kind
                        ),
                    },
                    Some(InfraKindState::Unavailable(why)) => InfraSource::Unavailable {
                        reason: format!("{what}: cannot read {}: {why}", reference.kind),
                    },
                    Some(InfraKindState::Synced) => match index.infra.get(&(kind, key)) {
                        Some(Ok(template)) => InfraSource::Found(template),
                        Some(Err(problem)) => InfraSource::Unavailable {
                            reason: format!("{what}: {}: {}", problem.field, problem.message),
                        },
                        None => InfraSource::Unavailable {
                            reason: format!("{what}: not found"),
                        },
                    },
                })
            }
        }
    }

    fn build(mut self, generation: u64) -> Snapshot {
        let keys = self.settings.keys.clone();
        let mut groups: BTreeMap<String, NodeGroup> = BTreeMap::new();

        for ((kind, key), parsed) in &self.index.resources {
            let resource = match parsed {
                Ok(r) => r,
                Err(problem) => {
                    self.problems.push(problem.clone());
                    continue;
                }
            };
            let id = group_id(*kind, key);
            let object = object_name(kind, key);
            if *kind == ScalableKind::MachineSet
                && resource
                    .owners
                    .iter()
                    .any(|o| o.kind == "MachineDeployment" && !o.name.is_empty())
            {
                continue;
            }
            if !discovery::allowed(
                &self.settings.discovery,
                &key.namespace,
                &resource.cluster_name,
                &resource.labels,
            ) {
                continue;
            }
            let (min, max) = match scaling_bounds(&keys, &object, &resource.annotations) {
                Ok(Some(bounds)) => bounds,
                Ok(None) => continue,
                Err(problem) => {
                    self.skip(id, format!("{}: {}", problem.field, problem.message));
                    self.problems.push(problem);
                    continue;
                }
            };
            if max == 0 {
                self.skip(id, "max size is 0");
                continue;
            }
            if resource.paused {
                let why = "paused (spec.paused or the cluster.x-k8s.io/paused annotation): not autoscaled until resumed";
                self.problems
                    .push(Problem::new(&object, "spec.paused", why));
                self.skip(id, why);
                continue;
            }
            let Some(target) = resource.replicas else {
                let problem = Problem::new(
                    &object,
                    "spec.replicas",
                    "not set: the group has no target size",
                );
                self.skip(id, format!("{}: {}", problem.field, problem.message));
                self.problems.push(problem);
                continue;
            };
            if let Some(problem) = self.topology_conflict(resource) {
                self.problems.push(problem);
            }
            let (options, option_problems) = options::parse(&keys, &object, &resource.annotations);
            self.problems.extend(option_problems);
            let price = match pricing::group_price(&object, &resource.annotations) {
                Ok(price) => price,
                Err(problem) => {
                    self.problems.push(problem);
                    None
                }
            };
            groups.insert(
                id.clone(),
                NodeGroup {
                    id,
                    min,
                    max,
                    target,
                    resource: resource.clone(),
                    instances: Vec::new(),
                    registered: 0,
                    template: None,
                    options,
                    price,
                },
            );
        }

        // Instances: Machines through their owners, MachinePools also through providerIDList.
        let mut by_instance_id: HashMap<String, Location> = HashMap::new();
        let mut by_machine: HashMap<ObjectKey, Location> = HashMap::new();
        let mut unlisted_registered: BTreeMap<String, i32> = BTreeMap::new();
        let mut instances: BTreeMap<String, Vec<Instance>> = BTreeMap::new();
        let owner_labels = OwnerLabels::new(&keys);
        let mut owner_groups: HashMap<(&str, ScalableKind, &str), Option<String>> = HashMap::new();
        for (key, parsed) in &self.index.machines {
            let machine = match parsed {
                Ok(m) => m,
                Err(problem) => {
                    self.problems.push(problem.clone());
                    continue;
                }
            };
            // Many Machines share an owner: resolve each owner to its group once per build.
            let Some(owner) = self.machine_owner(machine, &owner_labels) else {
                continue;
            };
            let namespace = machine.key.namespace.as_str();
            let resolved = owner_groups
                .entry((namespace, owner.0, owner.1))
                .or_insert_with(|| self.owner_group(namespace, owner, &groups));
            // A MachineSet not (yet) cached or not served: the Machine's deployment label may still name
            // a served MachineDeployment.
            let fallback = || {
                let md = machine.labels.get(&owner_labels.deployment)?;
                let id = group_id(
                    ScalableKind::MachineDeployment,
                    &ObjectKey::new(namespace, md.as_str()),
                );
                groups.contains_key(&id).then_some(id)
            };
            let group_id = match resolved {
                Some(id) => id.clone(),
                None if owner.0 == ScalableKind::MachineSet => match fallback() {
                    Some(id) => id,
                    None => continue,
                },
                None => continue,
            };
            by_machine.insert(
                key.clone(),
                Location {
                    group_id: group_id.clone(),
                    machine: Some(key.clone()),
                    in_pool_list: false,
                },
            );
            match self.instance_of(machine) {
                Some(instance) => instances.entry(group_id).or_default().push(instance),
                None => *unlisted_registered.entry(group_id).or_default() += 1,
            }
        }
        for (id, group) in groups.iter_mut() {
            let mut list = instances.remove(id).unwrap_or_default();
            if group.kind() == ScalableKind::MachinePool {
                let known: BTreeSet<String> = list.iter().map(|i| i.id.clone()).collect();
                for provider_id in &group.resource.provider_id_list {
                    if !provider_id.is_empty() && !known.contains(provider_id) {
                        list.push(Instance {
                            id: provider_id.clone(),
                            state: InstanceState::Running,
                            error: None,
                            machine: None,
                        });
                    }
                }
            }
            list.sort_by(|a, b| a.id.cmp(&b.id));
            list.dedup_by(|a, b| a.id == b.id);
            let pool: BTreeSet<&str> = group
                .resource
                .provider_id_list
                .iter()
                .map(String::as_str)
                .collect();
            for instance in &list {
                let location = Location {
                    group_id: id.clone(),
                    machine: instance.machine.clone(),
                    in_pool_list: pool.contains(instance.id.as_str()),
                };
                if let Some(previous) = by_instance_id.insert(instance.id.clone(), location) {
                    self.problems.push(Problem::new(
                        object_name(group.kind(), &group.resource.key),
                        "spec.providerID",
                        format!(
                            "instance {} is also claimed by {}",
                            instance.id, previous.group_id
                        ),
                    ));
                }
            }
            group.registered = list
                .iter()
                .filter(|i| i.state == InstanceState::Running)
                .count() as i32
                + unlisted_registered.get(id).copied().unwrap_or(0);
            group.instances = list;
        }

        // Normalised providerIDs, for nodes whose providerID is spelled differently from the Machine's.
        let mut by_normalized_id: HashMap<String, Location> = HashMap::new();
        let mut ambiguous: BTreeSet<String> = BTreeSet::new();
        for (id, location) in &by_instance_id {
            if is_synthetic(id) {
                continue;
            }
            let normalized = providerid::normalize(id).to_string();
            if normalized.is_empty() {
                continue;
            }
            if let Some(previous) = by_normalized_id.get(&normalized)
                && previous != location
            {
                ambiguous.insert(normalized);
                continue;
            }
            by_normalized_id.insert(normalized, location.clone());
        }
        for normalized in ambiguous {
            by_normalized_id.remove(&normalized);
        }

        // Templates, and the node labels of an existing node of the group when the workload cluster is watched.
        let node_labels_by_provider: HashMap<&str, &BTreeMap<String, String>> = self
            .index
            .nodes
            .values()
            .filter_map(|n| n.provider_id.as_deref().map(|p| (p, &n.labels)))
            .collect();
        let mut priced: Vec<(f64, f64, f64, bool)> = Vec::new();
        let ids: Vec<String> = groups.keys().cloned().collect();
        for id in ids {
            let Some(group) = groups.get(&id) else {
                continue;
            };
            let resource = group.resource.clone();
            let node_labels = group
                .instances
                .iter()
                .find_map(|i| node_labels_by_provider.get(i.id.as_str()).copied());
            let infra = match self.infra_source(&resource) {
                Ok(source) => source,
                Err(problem) => {
                    self.problems.push(problem);
                    InfraSource::NoReference
                }
            };
            let outcome = template::build(&TemplateInputs {
                keys: &keys,
                group_id: &id,
                resource: &resource,
                infra,
                node_labels,
                default_arch: self.settings.default_arch.as_deref(),
            });
            self.problems.extend(outcome.problems);
            if let Some(group) = groups.get_mut(&id) {
                if let (Some(price), Some(template)) = (group.price, outcome.template.as_ref()) {
                    priced.push((
                        price,
                        template.summary.cpu_cores,
                        template.summary.memory_gib,
                        template.summary.gpu.is_some(),
                    ));
                }
                group.template = outcome.template.map(Arc::new);
            }
        }

        // GPU nodes cost more than their CPU and memory: they set pod prices only when nothing else is priced.
        let reference: Vec<(f64, f64, f64)> = if priced.iter().any(|p| !p.3) {
            priced
                .iter()
                .filter(|p| !p.3)
                .map(|p| (p.0, p.1, p.2))
                .collect()
        } else {
            priced.iter().map(|p| (p.0, p.1, p.2)).collect()
        };
        let (reference_prices, reference_sources) = ReferencePrices::resolve(
            self.settings.cpu_hour_price,
            self.settings.gib_hour_price,
            &reference,
        );
        self.problems.sort();
        self.problems.dedup();
        Snapshot {
            generation,
            groups,
            by_instance_id,
            by_normalized_id,
            by_machine,
            skipped: self.skipped,
            problems: self.problems,
            reference_prices,
            reference_sources,
            machines: self.index.machines.len(),
        }
    }

    /// The instance CA sees for a Machine. `None` for a Machine whose Node registered but whose
    /// providerID is unknown (no spec.providerID, Node not watched): any made-up id would look to CA
    /// like a node that never registered, which CA eventually deletes.
    fn instance_of(&self, machine: &Machine) -> Option<Instance> {
        let provider_id = machine.provider_id.clone().or_else(|| {
            machine
                .node_ref
                .as_ref()
                .and_then(|name| self.index.nodes.get(name))
                .and_then(|node| node.provider_id.clone())
        });
        let (state, error, prefix) = match (&machine.failure, machine.deleting, &machine.node_ref) {
            (Some(_), true, _) => (
                InstanceState::Deleting,
                Some(InstanceError {
                    code: "DeletingFailed".into(),
                    message: failure_message(machine, "Machine deletion failed"),
                    class: OTHER_ERROR_CLASS,
                }),
                Some(FAILED_PREFIX),
            ),
            (Some(_), false, None) => (
                InstanceState::Creating,
                Some(InstanceError {
                    code: "ProvisioningFailed".into(),
                    message: failure_message(machine, "Machine provisioning failed"),
                    class: OTHER_ERROR_CLASS,
                }),
                Some(FAILED_PREFIX),
            ),
            (_, true, _) => (InstanceState::Deleting, None, Some(DELETING_PREFIX)),
            (None, false, None) => (InstanceState::Creating, None, Some(PENDING_PREFIX)),
            // Registered (also when failed afterwards: CA judges the Node itself). It has no made-up id:
            // one would look to CA like a node that never registered.
            (_, false, Some(_)) => (InstanceState::Running, None, None),
        };
        let id = match (provider_id, prefix) {
            (Some(id), _) => id,
            (None, Some(prefix)) => synthetic_id(prefix, &machine.key),
            (None, None) => return None,
        };
        Some(Instance {
            id,
            state,
            error,
            machine: Some(machine.key.clone()),
        })
    }
}

fn failure_message(machine: &Machine, default: &str) -> String {
    match &machine.failure {
        Some(f) if !f.message.is_empty() => format!("{default}: {}", f.message),
        Some(f) if !f.reason.is_empty() => format!("{default}: {}", f.reason),
        _ => default.to_string(),
    }
}

fn is_synthetic(id: &str) -> bool {
    [PENDING_PREFIX, FAILED_PREFIX, DELETING_PREFIX]
        .iter()
        .any(|p| id.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::{MachineFailure, MachineTemplate, OwnerRef};

    fn keys() -> Keys {
        Keys::default()
    }

    fn settings() -> Settings {
        Settings::default()
    }

    fn resource(
        kind: ScalableKind,
        name: &str,
        min: Option<&str>,
        max: Option<&str>,
        replicas: i32,
    ) -> ScalableResource {
        let keys = keys();
        let mut annotations = BTreeMap::new();
        if let Some(min) = min {
            annotations.insert(keys.min_size.clone(), min.to_string());
        }
        if let Some(max) = max {
            annotations.insert(keys.max_size.clone(), max.to_string());
        }
        ScalableResource {
            kind,
            key: ObjectKey::new("ns", name),
            uid: format!("uid-{name}"),
            resource_version: "1".into(),
            labels: BTreeMap::new(),
            annotations,
            cluster_name: "c1".into(),
            replicas: Some(replicas),
            paused: false,
            owners: Vec::new(),
            template: MachineTemplate::default(),
            provider_id_list: Vec::new(),
            topology: None,
        }
    }

    fn machine(
        name: &str,
        owner_kind: &str,
        owner: &str,
        provider_id: Option<&str>,
        node: bool,
    ) -> Machine {
        Machine {
            key: ObjectKey::new("ns", name),
            uid: format!("uid-{name}"),
            resource_version: "1".into(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            cluster_name: "c1".into(),
            provider_id: provider_id.map(str::to_string),
            node_ref: node.then(|| name.to_string()),
            deleting: false,
            owners: vec![OwnerRef {
                kind: owner_kind.into(),
                name: owner.into(),
            }],
            phase: None,
            failure: None,
        }
    }

    fn add(index: &mut Index, r: ScalableResource) {
        index.apply_resource(r.kind, r.key.clone(), Ok(Arc::new(r)));
    }

    fn add_machine(index: &mut Index, m: Machine) {
        index.apply_machine(m.key.clone(), Ok(Arc::new(m)));
    }

    /// An MD with its MS and two machines: one running, one pending without providerID.
    fn deployment_index() -> Index {
        let mut index = Index::default();
        add(
            &mut index,
            resource(
                ScalableKind::MachineDeployment,
                "md",
                Some("1"),
                Some("5"),
                2,
            ),
        );
        let mut ms = resource(ScalableKind::MachineSet, "md-abc", Some("1"), Some("5"), 2);
        ms.owners.push(OwnerRef {
            kind: "MachineDeployment".into(),
            name: "md".into(),
        });
        add(&mut index, ms);
        add_machine(
            &mut index,
            machine("m1", "MachineSet", "md-abc", Some("e2e:///ns/m1"), true),
        );
        add_machine(
            &mut index,
            machine("m2", "MachineSet", "md-abc", None, false),
        );
        index
    }

    fn node<'a>(provider_id: &'a str, name: &'a str) -> NodeRef<'a> {
        NodeRef {
            provider_id,
            name,
            annotations: None,
        }
    }

    #[test]
    fn a_machine_set_owned_by_a_deployment_is_not_a_group_and_its_machines_belong_to_the_deployment()
     {
        let s = deployment_index().snapshot(&settings(), 1);
        assert_eq!(
            s.groups.keys().collect::<Vec<_>>(),
            ["MachineDeployment/ns/md"]
        );
        let g = s.group("MachineDeployment/ns/md").unwrap();
        assert_eq!((g.min, g.max, g.target), (1, 5, 2));
        let ids: Vec<_> = g
            .instances
            .iter()
            .map(|i| (i.id.as_str(), i.state))
            .collect();
        assert_eq!(
            ids,
            [
                ("e2e:///ns/m1", InstanceState::Running),
                ("pending-machine-ns_m2", InstanceState::Creating)
            ]
        );
        assert_eq!(
            g.debug(),
            "MachineDeployment/ns/md (min: 1, max: 5, replicas: 2)"
        );
    }

    #[test]
    fn nodes_map_by_exact_normalised_and_made_up_ids_and_by_annotations() {
        let s = deployment_index().snapshot(&settings(), 1);
        let k = keys();
        let id = |n: &NodeRef<'_>| s.group_for_node(n, &k).map(|g| g.id.clone());
        let md = Some("MachineDeployment/ns/md".to_string());
        assert_eq!(id(&node("e2e:///ns/m1", "n")), md);
        assert_eq!(id(&node("other:////m1", "n")), md, "normalised providerID");
        assert_eq!(
            id(&node("pending-machine-ns_m2", "pending-machine-ns_m2")),
            md,
            "CA's fake node"
        );
        assert_eq!(id(&node("", "pending-machine-ns_m2")), md);
        assert_eq!(id(&node("unknown://x", "x")), None);
        let annotations: HashMap<String, String> = [
            (k.node_machine.clone(), "m1".to_string()),
            (k.node_cluster_namespace.clone(), "ns".to_string()),
        ]
        .into();
        let by_annotation = NodeRef {
            provider_id: "",
            name: "node-without-provider-id",
            annotations: Some(&annotations),
        };
        assert_eq!(id(&by_annotation), md);
        assert_eq!(
            s.locate(&by_annotation, &k).and_then(|l| l.machine.clone()),
            Some(ObjectKey::new("ns", "m1"))
        );
    }

    #[test]
    fn one_malformed_group_is_skipped_alone_with_a_problem_naming_the_field() {
        let mut index = deployment_index();
        add(
            &mut index,
            resource(
                ScalableKind::MachineDeployment,
                "bad-max",
                Some("1"),
                Some("lots"),
                1,
            ),
        );
        add(
            &mut index,
            resource(
                ScalableKind::MachineDeployment,
                "max-below-min",
                Some("4"),
                Some("2"),
                3,
            ),
        );
        add(
            &mut index,
            resource(
                ScalableKind::MachineDeployment,
                "min-only",
                Some("1"),
                None,
                1,
            ),
        );
        add(
            &mut index,
            resource(
                ScalableKind::MachineDeployment,
                "negative",
                Some("-1"),
                Some("2"),
                1,
            ),
        );
        let s = index.snapshot(&settings(), 1);
        assert_eq!(
            s.groups.keys().collect::<Vec<_>>(),
            ["MachineDeployment/ns/md"]
        );
        let k = keys();
        let problem = |name: &str| {
            s.problems
                .iter()
                .find(|p| p.object == format!("MachineDeployment ns/{name}"))
                .unwrap_or_else(|| panic!("no problem for {name}: {:?}", s.problems))
        };
        assert_eq!(
            problem("bad-max").field,
            Problem::annotation_field(&k.max_size)
        );
        assert!(problem("bad-max").message.contains("\"lots\""));
        assert!(
            problem("max-below-min")
                .message
                .contains("below min size 4")
        );
        assert_eq!(
            problem("min-only").field,
            Problem::annotation_field(&k.max_size)
        );
        assert_eq!(
            problem("negative").field,
            Problem::annotation_field(&k.min_size)
        );
    }

    #[test]
    fn unannotated_zero_max_paused_and_replica_less_resources_are_not_served() {
        let mut index = Index::default();
        add(
            &mut index,
            resource(ScalableKind::MachineDeployment, "plain", None, None, 1),
        );
        add(
            &mut index,
            resource(
                ScalableKind::MachineDeployment,
                "zero",
                Some("0"),
                Some("0"),
                0,
            ),
        );
        let mut paused = resource(
            ScalableKind::MachineDeployment,
            "paused",
            Some("0"),
            Some("3"),
            1,
        );
        paused.paused = true;
        add(&mut index, paused);
        let mut unset = resource(ScalableKind::MachineSet, "unset", Some("0"), Some("3"), 0);
        unset.replicas = None;
        add(&mut index, unset);
        let s = index.snapshot(&settings(), 1);
        assert!(s.groups.is_empty(), "{:?}", s.groups.keys());
        assert!(s.skipped.contains_key("MachineDeployment/ns/paused"));
        assert!(
            s.problems
                .iter()
                .any(|p| p.object == "MachineSet ns/unset" && p.field == "spec.replicas")
        );
        assert!(
            s.problems
                .iter()
                .any(|p| p.object == "MachineDeployment ns/paused" && p.field == "spec.paused")
        );
    }

    #[test]
    fn machine_pools_list_their_provider_ids_and_their_machines() {
        let mut index = Index::default();
        let mut pool = resource(ScalableKind::MachinePool, "mp", Some("0"), Some("4"), 3);
        pool.provider_id_list = vec!["e2e:///ns/a".into(), "e2e:///ns/b".into()];
        add(&mut index, pool);
        add_machine(
            &mut index,
            machine("mp-a", "MachinePool", "mp", Some("e2e:///ns/a"), true),
        );
        add_machine(
            &mut index,
            machine("mp-c", "MachinePool", "mp", None, false),
        );
        let s = index.snapshot(&settings(), 1);
        let g = s.group("MachinePool/ns/mp").unwrap();
        let ids: Vec<_> = g.instances.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(
            ids,
            ["e2e:///ns/a", "e2e:///ns/b", "pending-machine-ns_mp-c"]
        );
        let k = keys();
        let b = s.locate(&node("e2e:///ns/b", "b"), &k).unwrap();
        assert_eq!((b.machine.clone(), b.in_pool_list), (None, true));
        let a = s.locate(&node("e2e:///ns/a", "a"), &k).unwrap();
        assert_eq!(a.machine, Some(ObjectKey::new("ns", "mp-a")));
    }

    #[test]
    fn failed_and_deleting_machines_get_upstream_ids_states_and_error_info() {
        let mut index = Index::default();
        add(
            &mut index,
            resource(ScalableKind::MachineSet, "ms", Some("0"), Some("9"), 4),
        );
        let mut failed = machine("failed", "MachineSet", "ms", None, false);
        failed.failure = Some(MachineFailure {
            reason: "CreateError".into(),
            message: "quota exceeded".into(),
        });
        add_machine(&mut index, failed);
        let mut deleting = machine("deleting", "MachineSet", "ms", None, true);
        deleting.deleting = true;
        add_machine(&mut index, deleting);
        let mut failed_deleting = machine("fd", "MachineSet", "ms", None, true);
        failed_deleting.deleting = true;
        failed_deleting.failure = Some(MachineFailure {
            reason: String::new(),
            message: String::new(),
        });
        add_machine(&mut index, failed_deleting);
        let s = index.snapshot(&settings(), 1);
        let g = s.group("MachineSet/ns/ms").unwrap();
        let by_id: BTreeMap<_, _> = g.instances.iter().map(|i| (i.id.as_str(), i)).collect();
        let f = by_id["failed-machine-ns_failed"];
        assert_eq!(f.state, InstanceState::Creating);
        let e = f.error.as_ref().unwrap();
        assert_eq!(
            (e.code.as_str(), e.class),
            ("ProvisioningFailed", OTHER_ERROR_CLASS)
        );
        assert!(e.message.contains("quota exceeded"));
        assert_eq!(
            by_id["deleting-machine-ns_deleting"].state,
            InstanceState::Deleting
        );
        let fd = by_id["failed-machine-ns_fd"];
        assert_eq!(fd.state, InstanceState::Deleting);
        assert_eq!(fd.error.as_ref().unwrap().code, "DeletingFailed");
    }

    #[test]
    fn a_registered_machine_without_a_known_provider_id_is_no_instance_but_counts_and_maps() {
        let mut index = Index::default();
        add(
            &mut index,
            resource(ScalableKind::MachineSet, "ms", Some("0"), Some("3"), 2),
        );
        add_machine(&mut index, machine("no-id", "MachineSet", "ms", None, true));
        add_machine(
            &mut index,
            machine("known", "MachineSet", "ms", Some("p://known"), true),
        );
        let s = index.snapshot(&settings(), 1);
        let g = s.group("MachineSet/ns/ms").unwrap();
        let ids: Vec<_> = g.instances.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(
            ids,
            ["p://known"],
            "a made-up id would look unregistered to CA"
        );
        assert_eq!(g.registered, 2);
        let k = keys();
        let annotations: HashMap<String, String> = [
            (k.node_machine.clone(), "no-id".to_string()),
            (k.node_cluster_namespace.clone(), "ns".to_string()),
        ]
        .into();
        let n = NodeRef {
            provider_id: "",
            name: "no-id",
            annotations: Some(&annotations),
        };
        assert_eq!(
            s.locate(&n, &k).and_then(|l| l.machine.clone()),
            Some(ObjectKey::new("ns", "no-id"))
        );
        // With the workload cluster watched, the Node's providerID is used.
        index.apply_node(Node {
            name: "no-id".into(),
            provider_id: Some("p://no-id".into()),
            labels: BTreeMap::new(),
        });
        let s = index.snapshot(&settings(), 2);
        let ids: Vec<_> = s
            .group("MachineSet/ns/ms")
            .unwrap()
            .instances
            .iter()
            .map(|i| i.id.clone())
            .collect();
        assert_eq!(ids, ["p://known", "p://no-id"]);
    }

    #[test]
    fn a_cluster_topology_that_sets_an_autoscaled_groups_replicas_is_a_problem_on_the_cluster() {
        use crate::capi::TopologyWorker;
        let mut index = Index::default();
        let mut md = resource(
            ScalableKind::MachineDeployment,
            "c1-md-0-x",
            Some("0"),
            Some("5"),
            1,
        );
        md.topology = Some("md-0".into());
        add(&mut index, md);
        let mut quiet = resource(
            ScalableKind::MachineDeployment,
            "c1-md-1-y",
            Some("0"),
            Some("5"),
            1,
        );
        quiet.topology = Some("md-1".into());
        add(&mut index, quiet);
        let worker = |name: &str, replicas: Option<i32>| TopologyWorker {
            kind: ScalableKind::MachineDeployment,
            name: name.into(),
            replicas,
        };
        index.apply_cluster(ClusterTopology {
            key: ObjectKey::new("ns", "c1"),
            workers: vec![worker("md-0", Some(3)), worker("md-1", None)],
        });
        let s = index.snapshot(&settings(), 1);
        let topology: Vec<_> = s
            .problems
            .iter()
            .filter(|p| p.object == "Cluster ns/c1")
            .collect();
        assert_eq!(topology.len(), 1, "{:?}", s.problems);
        assert_eq!(
            topology[0].field,
            "spec.topology.workers.machineDeployments[0].replicas"
        );
        assert!(
            topology[0]
                .message
                .contains("MachineDeployment ns/c1-md-0-x")
        );
        // Still served: the conflict is the Cluster's to fix.
        assert_eq!(s.groups.len(), 2);
        index.delete_cluster(&ObjectKey::new("ns", "c1"));
        assert!(index.snapshot(&settings(), 2).problems.is_empty());
    }

    #[test]
    fn a_reset_replaces_every_object_of_that_kind_only() {
        let mut index = deployment_index();
        index.reset_resources(ScalableKind::MachineDeployment, Vec::new());
        let s = index.snapshot(&settings(), 2);
        assert!(s.group("MachineDeployment/ns/md").is_none());
        assert!(
            index
                .resource(ScalableKind::MachineSet, &ObjectKey::new("ns", "md-abc"))
                .is_some()
        );
        index.reset_machines(Vec::new());
        assert_eq!(index.snapshot(&settings(), 3).machines, 0);
        index.delete_resource(ScalableKind::MachineSet, &ObjectKey::new("ns", "md-abc"));
        assert!(
            index
                .resource(ScalableKind::MachineSet, &ObjectKey::new("ns", "md-abc"))
                .is_none()
        );
    }

    #[test]
    fn a_machine_set_whose_deployment_is_not_served_is_its_own_group() {
        let mut index = Index::default();
        let mut ms = resource(ScalableKind::MachineSet, "ms", Some("0"), Some("3"), 1);
        ms.owners.push(OwnerRef {
            kind: "MachineDeployment".into(),
            name: "".into(),
        });
        add(&mut index, ms);
        add_machine(
            &mut index,
            machine("m", "MachineSet", "ms", Some("p://m"), true),
        );
        let s = index.snapshot(&settings(), 1);
        assert_eq!(
            s.group_for_node(&node("p://m", "m"), &keys())
                .map(|g| g.id.as_str()),
            Some("MachineSet/ns/ms")
        );
    }

    #[test]
    fn discovery_filters_which_resources_are_groups() {
        let mut index = deployment_index();
        let mut other = resource(
            ScalableKind::MachineDeployment,
            "other",
            Some("0"),
            Some("3"),
            0,
        );
        other.key.namespace = "elsewhere".into();
        add(&mut index, other);
        let mut s = settings();
        s.discovery = vec!["clusterapi:namespace=elsewhere".parse().unwrap()];
        let snap = index.snapshot(&s, 1);
        assert_eq!(
            snap.groups.keys().collect::<Vec<_>>(),
            ["MachineDeployment/elsewhere/other"]
        );
    }

    #[test]
    fn scaling_bounds_follow_upstream_rules() {
        let k = keys();
        let ann = |min: Option<&str>, max: Option<&str>| {
            let mut a = BTreeMap::new();
            if let Some(v) = min {
                a.insert(k.min_size.clone(), v.to_string());
            }
            if let Some(v) = max {
                a.insert(k.max_size.clone(), v.to_string());
            }
            a
        };
        assert_eq!(scaling_bounds(&k, "o", &ann(None, None)), Ok(None));
        assert_eq!(
            scaling_bounds(&k, "o", &ann(None, Some("3"))),
            Ok(Some((0, 3)))
        );
        assert_eq!(
            scaling_bounds(&k, "o", &ann(Some("2"), Some("2"))),
            Ok(Some((2, 2)))
        );
        assert!(scaling_bounds(&k, "o", &ann(Some("x"), Some("2"))).is_err());
        assert!(scaling_bounds(&k, "o", &ann(Some("3"), Some("2"))).is_err());
        assert!(scaling_bounds(&k, "o", &ann(Some("1"), None)).is_err());
    }
}
