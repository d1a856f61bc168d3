//! Pure: the cached objects (`Index`) → an immutable `Snapshot` that every read RPC answers from.
//!
//! The index consumes watch events (apply, delete, reset) per kind, exactly as the store receives them,
//! so it is tested by feeding it events, without a cluster.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use crate::capi::rollout::{self, REVISION_ANNOTATION, Rollout};
use crate::capi::{
    ClusterTopology, InfraRef, InfraTemplate, Keys, Machine, Node, ObjectKey, ScalableKind,
    ScalableResource, providerid,
};
use crate::discovery::{self, DiscoverySpec};
use crate::options::{self, GroupOptions};
use crate::pricing::{self, PriceSource, PricedNode, ReferencePrices};
use crate::problem::{Problem, ProblemKind};
use crate::scope::{self, ClusterRef, Scope};
use crate::template::{self, FailureDomainZone, InfraSource, TemplateInputs, TemplateNode};

/// Prefixes of the instance ids made up for Machines that have no providerID (kept from upstream).
pub const PENDING_PREFIX: &str = "pending-machine-";
pub const FAILED_PREFIX: &str = "failed-machine-";
pub const DELETING_PREFIX: &str = "deleting-machine-";

/// Settings that shape the snapshot and do not change while the provider runs.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    pub keys: Keys,
    pub discovery: Vec<DiscoverySpec>,
    /// `--cluster`: the Cluster whose Nodes CA watches (see `scope`).
    pub cluster: Option<ClusterRef>,
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
    /// How many Nodes name each Cluster: the observed Clusters `scope` decides by.
    node_clusters: BTreeMap<ObjectKey, usize>,
    infra_kinds: BTreeMap<InfraKind, InfraKindState>,
    /// How many resources reference each infrastructure kind: kept as resources come and go, so
    /// readiness and every build ask it without a walk over every resource.
    infra_refs: BTreeMap<InfraKind, usize>,
    infra: HashMap<(InfraKind, ObjectKey), Parsed<InfraTemplate>>,
    /// Clusters by namespace/name, for the topology check.
    clusters: HashMap<ObjectKey, Arc<ClusterTopology>>,
    /// What changed since the snapshot `journal.since` was built.
    journal: Journal,
    /// The basis of the last snapshot built with [`Index::snapshot_reusing`].
    epoch: u64,
}

/// The changes since a snapshot, when they are all of the kinds a rebuild can apply to the groups they
/// touch alone (a write of replicas, a Machine's annotations): the rest of that snapshot still holds.
#[derive(Clone, Debug, Default)]
struct Journal {
    since: u64,
    resources: BTreeSet<(ScalableKind, ObjectKey)>,
    machines: BTreeSet<ObjectKey>,
    /// Any other change: the next snapshot is built from scratch.
    other: bool,
}

impl Index {
    pub fn apply_resource(
        &mut self,
        kind: ScalableKind,
        key: ObjectKey,
        parsed: Parsed<ScalableResource>,
    ) {
        let local = match (self.resources.get(&(kind, key.clone())), &parsed) {
            (Some(Ok(old)), Ok(new)) => same_layout(old, new),
            _ => false,
        };
        if local {
            // Same template, so the same infrastructure reference.
            self.journal.resources.insert((kind, key.clone()));
        } else {
            self.journal.other = true;
            self.count_infra_ref(Some(&parsed), 1);
        }
        if let Some(old) = self.resources.insert((kind, key), parsed)
            && !local
        {
            self.count_infra_ref(Some(&old), -1);
        }
    }

    pub fn delete_resource(&mut self, kind: ScalableKind, key: &ObjectKey) {
        self.journal.other = true;
        let old = self.resources.remove(&(kind, key.clone()));
        self.count_infra_ref(old.as_ref(), -1);
    }

    fn count_infra_ref(&mut self, parsed: Option<&Parsed<ScalableResource>>, by: isize) {
        let Some(kind) = parsed.and_then(referenced_infra_kind) else {
            return;
        };
        let count = self.infra_refs.entry(kind.clone()).or_default();
        *count = count.saturating_add_signed(by);
        if *count == 0 {
            self.infra_refs.remove(&kind);
        }
    }

    /// A watch of `kind` re-listed: these are now all the objects of that kind.
    pub fn reset_resources(
        &mut self,
        kind: ScalableKind,
        objects: impl IntoIterator<Item = (ObjectKey, Parsed<ScalableResource>)>,
    ) {
        self.journal.other = true;
        self.resources.retain(|(k, _), _| *k != kind);
        for (key, parsed) in objects {
            self.resources.insert((kind, key), parsed);
        }
        self.infra_refs.clear();
        for kind in self.resources.values().filter_map(referenced_infra_kind) {
            *self.infra_refs.entry(kind).or_default() += 1;
        }
    }

    pub fn resource(&self, kind: ScalableKind, key: &ObjectKey) -> Option<&Arc<ScalableResource>> {
        self.resources
            .get(&(kind, key.clone()))
            .and_then(|r| r.as_ref().ok())
    }

    pub fn apply_machine(&mut self, key: ObjectKey, parsed: Parsed<Machine>) {
        let local = match (self.machines.get(&key), &parsed) {
            (Some(Ok(old)), Ok(new)) => same_machine_layout(old, new),
            _ => false,
        };
        if local {
            self.journal.machines.insert(key.clone());
        } else {
            self.journal.other = true;
        }
        self.machines.insert(key, parsed);
    }

    pub fn delete_machine(&mut self, key: &ObjectKey) {
        self.journal.other = true;
        self.machines.remove(key);
    }

    pub fn reset_machines(
        &mut self,
        objects: impl IntoIterator<Item = (ObjectKey, Parsed<Machine>)>,
    ) {
        self.journal.other = true;
        self.machines = objects.into_iter().collect();
    }

    /// The keys and resourceVersions of the Machines cached in `namespace` (`None` for one that could
    /// not be read).
    pub fn machine_versions_in(&self, namespace: &str) -> Vec<(ObjectKey, Option<String>)> {
        self.machines
            .iter()
            .filter(|(k, _)| k.namespace == namespace)
            .map(|(k, m)| {
                let version = m.as_ref().ok().map(|m| m.resource_version.clone());
                (k.clone(), version)
            })
            .collect()
    }

    pub fn machine(&self, key: &ObjectKey) -> Option<&Arc<Machine>> {
        self.machines.get(key).and_then(|m| m.as_ref().ok())
    }

    pub fn apply_node(&mut self, node: Node) {
        self.journal.other = true;
        self.count_node_cluster(Some(&node), 1);
        let old = self.nodes.insert(node.name.clone(), Arc::new(node));
        self.count_node_cluster(old.as_deref(), -1);
    }

    pub fn delete_node(&mut self, name: &str) {
        self.journal.other = true;
        let old = self.nodes.remove(name);
        self.count_node_cluster(old.as_deref(), -1);
    }

    pub fn reset_nodes(&mut self, nodes: impl IntoIterator<Item = Node>) {
        self.journal.other = true;
        self.nodes = nodes
            .into_iter()
            .map(|n| (n.name.clone(), Arc::new(n)))
            .collect();
        self.node_clusters.clear();
        for cluster in self.nodes.values().filter_map(|n| n.cluster.clone()) {
            *self.node_clusters.entry(cluster).or_default() += 1;
        }
    }

    fn count_node_cluster(&mut self, node: Option<&Node>, by: isize) {
        let Some(cluster) = node.and_then(|n| n.cluster.as_ref()) else {
            return;
        };
        let count = self.node_clusters.entry(cluster.clone()).or_default();
        *count = count.saturating_add_signed(by);
        if *count == 0 {
            self.node_clusters.remove(cluster);
        }
    }

    /// The Clusters the workload cluster's Nodes belong to.
    pub fn observed_clusters(&self) -> BTreeSet<ObjectKey> {
        self.node_clusters.keys().cloned().collect()
    }

    pub fn set_infra_kind_state(&mut self, kind: InfraKind, state: InfraKindState) {
        self.journal.other = true;
        self.infra_kinds.insert(kind, state);
    }

    pub fn infra_kind_state(&self, kind: &InfraKind) -> Option<&InfraKindState> {
        self.infra_kinds.get(kind)
    }

    pub fn apply_infra(&mut self, kind: InfraKind, key: ObjectKey, parsed: Parsed<InfraTemplate>) {
        self.journal.other = true;
        self.infra.insert((kind, key), parsed);
    }

    pub fn delete_infra(&mut self, kind: &InfraKind, key: &ObjectKey) {
        self.journal.other = true;
        self.infra.remove(&(kind.clone(), key.clone()));
    }

    pub fn reset_infra(
        &mut self,
        kind: &InfraKind,
        objects: impl IntoIterator<Item = (ObjectKey, Parsed<InfraTemplate>)>,
    ) {
        self.journal.other = true;
        self.infra.retain(|(k, _), _| k != kind);
        for (key, parsed) in objects {
            self.infra.insert((kind.clone(), key), parsed);
        }
    }

    pub fn apply_cluster(&mut self, cluster: ClusterTopology) {
        self.journal.other = true;
        self.clusters.insert(cluster.key.clone(), Arc::new(cluster));
    }

    pub fn delete_cluster(&mut self, key: &ObjectKey) {
        self.journal.other = true;
        self.clusters.remove(key);
    }

    pub fn reset_clusters(&mut self, clusters: impl IntoIterator<Item = ClusterTopology>) {
        self.journal.other = true;
        self.clusters = clusters
            .into_iter()
            .map(|c| (c.key.clone(), Arc::new(c)))
            .collect();
    }

    /// Infrastructure template kinds referenced by candidate groups that nobody watches yet.
    pub fn wanted_infra_kinds(&self) -> BTreeSet<InfraKind> {
        self.infra_refs
            .keys()
            .filter(|k| !self.infra_kinds.contains_key(*k))
            .cloned()
            .collect()
    }

    /// Builds the snapshot: node groups, their instances and templates, lookup tables, problems.
    pub fn snapshot(&self, settings: &Settings) -> Snapshot {
        Builder::new(self, settings, None, None).build(0)
    }

    /// Whether anything changed since the last [`snapshot_reusing`](Self::snapshot_reusing): every
    /// change goes through the journal, so this is true exactly when that snapshot is out of date.
    pub fn changed_since_snapshot(&self) -> bool {
        let journal = &self.journal;
        journal.other || !journal.resources.is_empty() || !journal.machines.is_empty()
    }

    /// [`snapshot`](Self::snapshot) for a store that rebuilds over and over: `previous` is the last
    /// snapshot this index built this way (with the same settings). When everything that changed since
    /// is local to some groups (replicas written, Machines marked: the provider's own writes), only
    /// those groups are rebuilt and the rest, lookups included, is shared with `previous`; otherwise
    /// it is built from scratch, reusing the templates whose inputs did not change. Either way the
    /// result equals [`snapshot`](Self::snapshot)'s.
    pub fn snapshot_reusing(&mut self, settings: &Settings, previous: &Snapshot) -> Snapshot {
        self.epoch += 1;
        let basis = self.epoch;
        let journal = std::mem::replace(
            &mut self.journal,
            Journal {
                since: basis,
                ..Journal::default()
            },
        );
        Builder::new(self, settings, Some(previous), Some(&journal)).build(basis)
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
    /// Machines with a Node but no providerID: no instance CA sees, but Machines Cluster API
    /// counts (and deletes) like any other.
    pub unlisted: Vec<ObjectKey>,
    /// Machines (not being deleted) carrying a delete mark this provider did not write: Cluster API
    /// deletes them first all the same (see `removal::deletion`).
    pub foreign_marks: Vec<String>,
    /// Nodes that registered: running instances, and Machines with a Node but no known providerID.
    pub registered: i32,
    pub template: Option<Arc<TemplateNode>>,
    pub options: Option<GroupOptions>,
    pub price: Option<f64>,
    /// Set while the group's MachineDeployment rolls out: scale-down of the group is paused.
    pub rollout: Option<Rollout>,
    /// Set while Cluster API's preflight checks hold back the group's scale-up (its MachineSet's, or
    /// one of its MachineDeployment's): the replicas beyond its Machines are reported as instances
    /// being created with an error (`crate::preflight`).
    pub preflight: Option<crate::preflight::PreflightHold>,
}

impl NodeGroup {
    pub fn kind(&self) -> ScalableKind {
        self.resource.kind
    }

    /// The min size CA is told. While rolling out it is raised to the target size (not above max):
    /// CA never picks nodes of a group at its minimum for scale-down, and the MachineDeployment
    /// controller, not CA, would decide which node a lower replica count removes. Scale-up still has
    /// room up to max. Replica writes keep checking the configured `min`.
    pub fn served_min(&self) -> i32 {
        match &self.rollout {
            Some(_) => self.min.max(self.target.min(self.max)),
            None => self.min,
        }
    }

    pub fn debug(&self) -> String {
        let rolling = match &self.rollout {
            Some(_) => ", rolling out: scale-down paused",
            None => "",
        };
        format!(
            "{} (min: {}, max: {}, replicas: {}{rolling})",
            self.id, self.min, self.max, self.target
        )
    }

    /// Why DeleteNodes is refused and CA sees a raised min, for people.
    pub fn rollout_note(&self) -> Option<String> {
        self.rollout.as_ref().map(|r| {
            format!(
                "rolling out: {}; scale-down paused (min size sent to CA: {})",
                r.reason(),
                self.served_min()
            )
        })
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
    pub groups: Groups,
    /// Where nodes live. Shared by the snapshots built after changes that moved no node.
    lookup: Arc<Lookup>,
    /// What each group's template was built from, for [`Index::snapshot_reusing`].
    templates: HashMap<Arc<str>, Arc<TemplateMemo>>,
    /// The MachineSets of each MachineDeployment (by owner reference or label), for
    /// [`Index::snapshot_reusing`]: a patch never changes which belong to which, so it reads them
    /// from here instead of walking every MachineSet.
    machine_sets: Arc<HashMap<ObjectKey, Vec<ObjectKey>>>,
    /// The problems of each served group (its options, price, rollout, template)…
    group_problems: HashMap<Arc<str>, Arc<[Problem]>>,
    /// … and all the others (objects that cannot be read, resources not served, claimed ids).
    base_problems: Vec<Problem>,
    /// Which Cluster's groups are served.
    pub scope: Scope,
    /// Set when no group is served because of `scope` (groups of other Clusters only, or no Cluster
    /// can be decided): `/readyz` and gRPC health say it.
    pub scope_reason: Option<String>,
    /// Which state of the index this was built from ([`Index::snapshot_reusing`]); 0: none known.
    basis: u64,
    /// Resources that are candidates but not served (paused, bad bounds, …) by id, for `check`.
    pub skipped: BTreeMap<String, String>,
    /// The same resources, by id, with the kind of reason (the `node_groups_not_served` metric).
    pub not_served: BTreeMap<String, NotServed>,
    pub problems: Vec<Problem>,
    /// Prices per CPU-hour and GiB-hour for PricingPodPrice, and where each came from.
    pub reference_prices: ReferencePrices,
    pub reference_sources: [PriceSource; 2],
    pub machines: usize,
}

/// Why a candidate resource is not served: a small fixed set, so it can label a metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NotServed {
    /// It belongs to another Cluster than the one served: expected where one management cluster
    /// holds several Clusters, each with its own autoscaler.
    OtherCluster,
    /// Its min/max size annotations are missing or wrong.
    Bounds,
    /// Its max size is 0.
    MaxZero,
    /// It or its Cluster is paused.
    Paused,
    /// `spec.replicas` is unset.
    ReplicasUnset,
}

impl NotServed {
    pub const ALL: [NotServed; 5] = [
        NotServed::OtherCluster,
        NotServed::Bounds,
        NotServed::MaxZero,
        NotServed::Paused,
        NotServed::ReplicasUnset,
    ];

    pub fn label(self) -> &'static str {
        match self {
            NotServed::OtherCluster => "other-cluster",
            NotServed::Bounds => "bounds",
            NotServed::MaxZero => "max-zero",
            NotServed::Paused => "paused",
            NotServed::ReplicasUnset => "replicas-unset",
        }
    }
}

/// The served node groups by id. A group, and its id, are shared by every snapshot it did not
/// change in, so a rebuild after a write copies pointers, not groups or strings.
#[derive(Clone, Debug, Default)]
pub struct Groups(BTreeMap<Arc<str>, Arc<NodeGroup>>);

impl Groups {
    pub fn get(&self, id: &str) -> Option<&NodeGroup> {
        self.0.get(id).map(Arc::as_ref)
    }

    pub fn contains_key(&self, id: &str) -> bool {
        self.0.contains_key(id)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Ids in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(AsRef::as_ref)
    }

    /// Groups in id order.
    pub fn values(&self) -> impl Iterator<Item = &NodeGroup> {
        self.0.values().map(Arc::as_ref)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &NodeGroup)> {
        self.0.iter().map(|(id, g)| (id.as_ref(), g.as_ref()))
    }
}

impl<'a> IntoIterator for &'a Groups {
    type Item = (&'a str, &'a NodeGroup);
    type IntoIter = std::iter::Map<
        std::collections::btree_map::Iter<'a, Arc<str>, Arc<NodeGroup>>,
        fn((&'a Arc<str>, &'a Arc<NodeGroup>)) -> (&'a str, &'a NodeGroup),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(id, g)| (id.as_ref(), g.as_ref()))
    }
}

/// Every place a node can live, each once, and the maps that find it. (A Location per map entry
/// would triple the largest part of a snapshot: one entry per Machine in each map.)
#[derive(Clone, Debug, Default)]
struct Lookup {
    locations: Vec<Location>,
    /// Exact instance id (providerID or made-up id) → where it lives.
    by_instance_id: HashMap<String, u32>,
    /// Normalised providerID → where it lives; only ids that normalise uniquely.
    by_normalized_id: HashMap<String, u32>,
    /// Machine → where it lives (also Machines that are not listed as instances).
    by_machine: HashMap<ObjectKey, u32>,
}

impl Lookup {
    /// Where `instance` of group `id` lives: its Machine's location when that says the same (the
    /// usual case), else a new one.
    fn place(&mut self, id: &str, instance: &Instance, in_pool_list: bool) -> u32 {
        let same = instance
            .machine
            .as_ref()
            .and_then(|m| self.by_machine.get(m))
            .copied()
            .filter(|&at| {
                self.locations
                    .get(at as usize)
                    .is_some_and(|l| l.group_id == id && l.in_pool_list == in_pool_list)
            });
        if let Some(at) = same {
            return at;
        }
        let at = position(&self.locations);
        self.locations.push(Location {
            group_id: id.to_string(),
            machine: instance.machine.clone(),
            in_pool_list,
        });
        at
    }
}

/// Normalised providerIDs → locations, for nodes whose providerID is spelled differently from the
/// Machine's; an id that normalises to two different places is left out.
fn normalized_ids(lookup: &Lookup) -> HashMap<String, u32> {
    let mut by_normalized_id: HashMap<String, u32> = HashMap::new();
    let mut ambiguous: BTreeSet<String> = BTreeSet::new();
    for (id, &at) in &lookup.by_instance_id {
        if is_synthetic(id) {
            continue;
        }
        let normalized = providerid::normalize(id);
        if normalized.is_empty() || ambiguous.contains(normalized) {
            continue;
        }
        if let Some(&previous) = by_normalized_id.get(normalized)
            && lookup.locations.get(previous as usize) != lookup.locations.get(at as usize)
        {
            ambiguous.insert(normalized.to_string());
            continue;
        }
        by_normalized_id.insert(normalized.to_string(), at);
    }
    for normalized in ambiguous {
        by_normalized_id.remove(&normalized);
    }
    by_normalized_id
}

/// The Machines a build found for each served group.
#[derive(Default)]
struct GroupMachines {
    /// Group id → the instances of its Machines.
    instances: BTreeMap<String, Vec<Instance>>,
    /// Group id → its Machines with a Node but no providerID, so no instance (counted as
    /// registered).
    unlisted: BTreeMap<String, Vec<ObjectKey>>,
}

impl Default for Snapshot {
    fn default() -> Self {
        Index::default().snapshot(&Settings::default())
    }
}

impl Snapshot {
    pub fn group(&self, id: &str) -> Option<&NodeGroup> {
        self.groups.get(id)
    }

    /// The group and Machine of a node, by providerID (exact, then normalised), by the ids this provider
    /// made up for Machines without one, and by the node's machine annotations.
    pub fn locate(&self, node: &NodeRef<'_>, keys: &Keys) -> Option<&Location> {
        let lookup = self.lookup.as_ref();
        let at = |i: &u32| lookup.locations.get(*i as usize);
        if !node.provider_id.is_empty() {
            if let Some(found) = lookup.by_instance_id.get(node.provider_id).and_then(at) {
                return Some(found);
            }
            if let Some(found) = lookup
                .by_normalized_id
                .get(providerid::normalize(node.provider_id))
                .and_then(at)
            {
                return Some(found);
            }
        }
        // CA's fake nodes for instances that never registered carry the instance id as their name.
        if let Some(found) = lookup.by_instance_id.get(node.name).and_then(at) {
            return Some(found);
        }
        let annotations = node.annotations?;
        let name = annotations.get(&keys.node_machine)?;
        let namespace = annotations.get(&keys.node_cluster_namespace)?;
        lookup
            .by_machine
            .get(&ObjectKey::new(namespace.as_str(), name.as_str()))
            .and_then(at)
    }

    pub fn group_for_node(&self, node: &NodeRef<'_>, keys: &Keys) -> Option<&NodeGroup> {
        self.locate(node, keys)
            .and_then(|l| self.groups.get(&l.group_id))
    }
}

/// The index the next location pushed onto `locations` gets.
fn position(locations: &[Location]) -> u32 {
    u32::try_from(locations.len()).unwrap_or(u32::MAX)
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
    previous: Option<&'a Snapshot>,
    /// What changed since `previous`, when known.
    journal: Option<&'a Journal>,
    /// Problems not of a served group (see `Snapshot::base_problems`); a group's are collected apart.
    problems: Vec<Problem>,
    skipped: BTreeMap<String, String>,
    not_served: BTreeMap<String, NotServed>,
    /// Which Cluster's groups this build serves.
    scope: Scope,
    /// Candidate groups left out because they belong to another Cluster.
    out_of_scope: usize,
}

/// What a group's template was built from, and what came of it.
#[derive(Clone, Debug)]
struct TemplateMemo {
    resource: Arc<ScalableResource>,
    infra: InfraInput,
    /// The labels templates copy from an existing Node of the group.
    node_labels: Vec<(String, String)>,
    /// The zone of the template's failure domain, from the Nodes in it.
    failure_domain_zone: Option<FailureDomainZone>,
    template: Option<Arc<TemplateNode>>,
    problems: Vec<Problem>,
}

impl TemplateMemo {
    fn holds_for(
        &self,
        resource: &Arc<ScalableResource>,
        infra: &InfraInput,
        node_labels: &[(String, String)],
        failure_domain_zone: Option<&FailureDomainZone>,
    ) -> bool {
        (Arc::ptr_eq(&self.resource, resource) || same_for_template(&self.resource, resource))
            && self.infra.same(infra)
            && self.node_labels == node_labels
            && self.failure_domain_zone.as_ref() == failure_domain_zone
    }
}

/// The infrastructure kind a readable resource's template references.
fn referenced_infra_kind(parsed: &Parsed<ScalableResource>) -> Option<InfraKind> {
    let reference = parsed.as_ref().ok()?.template.infrastructure_ref.as_ref()?;
    reference.as_ref().ok().map(InfraKind::of)
}

/// Whether a new version of a resource changes only what a rebuild of its own group (and, for a
/// MachineSet, of its MachineDeployment's) picks up: replica counts (not whether there are any), the
/// resourceVersion, the rollout state.
fn same_layout(a: &ScalableResource, b: &ScalableResource) -> bool {
    same_but_counts(a, b, |x, y| x.is_some() == y.is_some())
}

/// Whether two resources agree on everything but the resourceVersion, `status.replicas`, the
/// rollout state and `spec.replicas`, which `same_replicas` judges. Destructured, so a new field
/// must be placed here.
fn same_but_counts(
    a: &ScalableResource,
    b: &ScalableResource,
    same_replicas: impl Fn(Option<i32>, Option<i32>) -> bool,
) -> bool {
    let ScalableResource {
        kind,
        key,
        uid,
        resource_version: _,
        labels,
        annotations,
        cluster_name,
        replicas,
        status_replicas: _,
        rolling_out: _,
        preflight: _,
        paused,
        owners,
        template,
        provider_id_list,
        topology,
    } = a;
    *kind == b.kind
        && *key == b.key
        && *uid == b.uid
        && *labels == b.labels
        && *annotations == b.annotations
        && *cluster_name == b.cluster_name
        && same_replicas(*replicas, b.replicas)
        && *paused == b.paused
        && *owners == b.owners
        && *template == b.template
        && *provider_id_list == b.provider_id_list
        && *topology == b.topology
}

/// Whether a new version of a Machine changes only its annotations (its delete mark) and its
/// resourceVersion: its group, instance id and state stay what they were.
fn same_machine_layout(a: &Machine, b: &Machine) -> bool {
    let Machine {
        key,
        uid,
        resource_version: _,
        labels,
        annotations: _,
        cluster_name,
        provider_id,
        node_ref,
        failure_domain,
        deleting,
        owners,
        phase,
        failure,
        // Read by the removal rules from the index, never by the snapshot.
        conditions_unhealthy: _,
    } = a;
    *key == b.key
        && *uid == b.uid
        && *labels == b.labels
        && *cluster_name == b.cluster_name
        && *provider_id == b.provider_id
        && *node_ref == b.node_ref
        && *failure_domain == b.failure_domain
        && *deleting == b.deleting
        && *owners == b.owners
        && *phase == b.phase
        && *failure == b.failure
}

/// Whether two versions of a resource give the same template: everything but the replica counts
/// (only whether the group is at zero matters: it decides whether a missing capacity is a problem),
/// the resourceVersion and the rollout state.
fn same_for_template(a: &ScalableResource, b: &ScalableResource) -> bool {
    same_but_counts(a, b, |x, y| (x.unwrap_or(0) == 0) == (y.unwrap_or(0) == 0))
}

/// The infrastructure template input of a group's template, owned.
#[derive(Clone, Debug)]
enum InfraInput {
    NoReference,
    Found(Arc<InfraTemplate>),
    Unavailable(String),
    /// The reference itself is malformed (a problem on the group).
    Malformed(Problem),
}

impl InfraInput {
    fn same(&self, other: &InfraInput) -> bool {
        match (self, other) {
            (InfraInput::NoReference, InfraInput::NoReference) => true,
            (InfraInput::Found(a), InfraInput::Found(b)) => Arc::ptr_eq(a, b) || a == b,
            (InfraInput::Unavailable(a), InfraInput::Unavailable(b)) => a == b,
            (InfraInput::Malformed(a), InfraInput::Malformed(b)) => a == b,
            _ => false,
        }
    }

    fn source(&self) -> InfraSource<'_> {
        match self {
            InfraInput::NoReference | InfraInput::Malformed(_) => InfraSource::NoReference,
            InfraInput::Found(template) => InfraSource::Found(template),
            InfraInput::Unavailable(reason) => InfraSource::Unavailable {
                reason: reason.clone(),
            },
        }
    }
}

fn object_name(kind: impl std::fmt::Display, key: &ObjectKey) -> String {
    format!("{kind} {key}")
}

pub fn group_id(kind: ScalableKind, key: &ObjectKey) -> String {
    format!("{}/{}/{}", kind.as_str(), key.namespace, key.name)
}

/// A MachineSet of a MachineDeployment: part of that group, never a group of its own.
fn owned_by_deployment(kind: ScalableKind, resource: &ScalableResource) -> bool {
    kind == ScalableKind::MachineSet
        && resource
            .owners
            .iter()
            .any(|o| o.kind == "MachineDeployment" && !o.name.is_empty())
}

/// Whether a resource carries a bound annotation, valid or not: it is meant to be a node group.
fn has_bounds(keys: &Keys, resource: &ScalableResource) -> bool {
    resource.annotations.contains_key(&keys.min_size)
        || resource.annotations.contains_key(&keys.max_size)
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
    fn new(
        index: &'a Index,
        settings: &'a Settings,
        previous: Option<&'a Snapshot>,
        journal: Option<&'a Journal>,
    ) -> Self {
        Builder {
            index,
            settings,
            previous,
            journal,
            problems: Vec::new(),
            skipped: BTreeMap::new(),
            not_served: BTreeMap::new(),
            scope: Scope::Unknown,
            out_of_scope: 0,
        }
    }

    /// The Clusters of the resources that would be node groups but for their Cluster: discovery
    /// selects them and they carry a bound annotation.
    fn candidate_clusters(&self) -> BTreeSet<ObjectKey> {
        let settings = self.settings;
        self.index
            .resources
            .iter()
            .filter_map(|((kind, key), parsed)| {
                let resource = parsed.as_ref().ok()?;
                (!owned_by_deployment(*kind, resource)
                    && discovery::allowed(
                        &settings.discovery,
                        &key.namespace,
                        &resource.cluster_name,
                        &resource.labels,
                    )
                    && has_bounds(&settings.keys, resource))
                .then(|| ObjectKey::new(key.namespace.as_str(), resource.cluster_name.as_str()))
            })
            .collect()
    }

    fn skip(&mut self, id: String, reason: NotServed, why: impl Into<String>) {
        self.not_served.insert(id.clone(), reason);
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

    /// MachineSets by the MachineDeployment they belong to (namespace, name): owned by it, or carrying
    /// its name in the deployment-name label.
    fn machine_sets_by_deployment(
        &self,
        labels: &OwnerLabels,
    ) -> HashMap<(&'a str, &'a str), Vec<&'a ScalableResource>> {
        let index: &'a Index = self.index;
        let mut sets: HashMap<(&'a str, &'a str), Vec<&'a ScalableResource>> = HashMap::new();
        let machine_sets = index
            .resources
            .range((ScalableKind::MachineSet, ObjectKey::new("", ""))..)
            .take_while(|((kind, _), _)| *kind == ScalableKind::MachineSet);
        for ((_, key), parsed) in machine_sets {
            let Ok(ms) = parsed else {
                continue;
            };
            let owners = ms
                .owners
                .iter()
                .filter(|o| o.kind == "MachineDeployment" && !o.name.is_empty())
                .map(|o| o.name.as_str());
            let named = ms.labels.get(&labels.deployment).map(String::as_str);
            for md in owners.chain(named) {
                let listed = sets.entry((key.namespace.as_str(), md)).or_default();
                // The owner reference and the label usually name the same MachineDeployment.
                if !listed
                    .last()
                    .is_some_and(|last| std::ptr::eq(*last, ms.as_ref()))
                {
                    listed.push(ms.as_ref());
                }
            }
        }
        sets
    }

    /// The rollout of a MachineDeployment group, with a problem for every revision that cannot be read.
    fn rollout_of(
        &mut self,
        deployment: &ScalableResource,
        sets: &HashMap<(&'a str, &'a str), Vec<&'a ScalableResource>>,
    ) -> Option<Rollout> {
        let key = (
            deployment.key.namespace.as_str(),
            deployment.key.name.as_str(),
        );
        let found = rollout::rollout(
            deployment,
            sets.get(&key).map(Vec::as_slice).unwrap_or_default(),
        )?;
        for bad in &found.unreadable {
            self.problems.push(Problem::new(
                object_name(ScalableKind::MachineSet, &bad.key),
                Problem::annotation_field(REVISION_ANNOTATION),
                format!(
                    "{:?} is not an integer revision: MachineDeployment {} counts as rolling out \
                     and its scale-down stays paused until this is fixed",
                    bad.value, deployment.key
                ),
            ));
        }
        Some(found)
    }

    /// Why Cluster API would not act on the group now, with the field that says so: the paused
    /// annotation on the object, or its Cluster's `spec.paused` (or the annotation there). A
    /// MachineDeployment's own `spec.paused` is no such reason: it pauses rollouts, not scaling.
    fn pause_of(&self, resource: &ScalableResource) -> Option<(&'static str, String)> {
        if resource.paused {
            return Some((
                "metadata.annotations[cluster.x-k8s.io/paused]",
                "paused (the cluster.x-k8s.io/paused annotation): Cluster API does not act on it, \
                 not autoscaled until resumed"
                    .to_string(),
            ));
        }
        let cluster_key = ObjectKey::new(
            resource.key.namespace.as_str(),
            resource.cluster_name.as_str(),
        );
        let cluster = self.index.clusters.get(&cluster_key)?;
        cluster.paused.then(|| {
            (
                "spec.clusterName",
                format!(
                    "Cluster {cluster_key} is paused (spec.paused or the cluster.x-k8s.io/paused \
                     annotation): Cluster API acts on none of its groups, not autoscaled until resumed"
                ),
            )
        })
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

    /// The infrastructure template input of a group's template.
    fn infra_input(&self, resource: &ScalableResource) -> InfraInput {
        let index = self.index;
        match &resource.template.infrastructure_ref {
            None => InfraInput::NoReference,
            Some(Err(e)) => InfraInput::Malformed(Problem::new(
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
                match index.infra_kinds.get(&kind) {
                    None | Some(InfraKindState::Syncing) => InfraInput::Unavailable(format!(
                        "{what}: the watch of {} has not listed yet",
                        reference.kind
                    )),
                    Some(InfraKindState::Unavailable(why)) => InfraInput::Unavailable(format!(
                        "{what}: cannot read {}: {why}",
                        reference.kind
                    )),
                    Some(InfraKindState::Synced) => match index.infra.get(&(kind, key)) {
                        Some(Ok(template)) => InfraInput::Found(Arc::clone(template)),
                        Some(Err(problem)) => InfraInput::Unavailable(format!(
                            "{what}: {}: {}",
                            problem.field, problem.message
                        )),
                        None => InfraInput::Unavailable(format!("{what}: not found")),
                    },
                }
            }
        }
    }

    /// Runs `f` with a problem list of its own; returns its result and the problems it found.
    fn collecting<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> (T, Vec<Problem>) {
        let outer = std::mem::take(&mut self.problems);
        let value = f(self);
        let inner = std::mem::replace(&mut self.problems, outer);
        (value, inner)
    }

    /// The group a resource is, without its instances and template, and the group's own problems; or
    /// `None` for a resource that is not a served group (problems of those go to `self.problems`).
    fn served_group(
        &mut self,
        kind: ScalableKind,
        key: &ObjectKey,
        resource: &Arc<ScalableResource>,
        sets_by_deployment: &HashMap<(&'a str, &'a str), Vec<&'a ScalableResource>>,
    ) -> Option<(NodeGroup, Vec<Problem>)> {
        let settings: &'a Settings = self.settings;
        let keys = &settings.keys;
        let id = group_id(kind, key);
        let object = object_name(kind, key);
        if owned_by_deployment(kind, resource) {
            return None;
        }
        if !discovery::allowed(
            &self.settings.discovery,
            &key.namespace,
            &resource.cluster_name,
            &resource.labels,
        ) {
            return None;
        }
        let cluster = ObjectKey::new(key.namespace.as_str(), resource.cluster_name.as_str());
        if has_bounds(keys, resource)
            && let Some(why) = self.scope.refusal(&cluster)
        {
            self.problems
                .push(Problem::new(&object, "spec.clusterName", why.clone()));
            self.skip(id, NotServed::OtherCluster, why);
            self.out_of_scope += 1;
            return None;
        }
        let (min, max) = match scaling_bounds(keys, &object, &resource.annotations) {
            Ok(Some(bounds)) => bounds,
            Ok(None) => return None,
            Err(problem) => {
                self.skip(
                    id,
                    NotServed::Bounds,
                    format!("{}: {}", problem.field, problem.message),
                );
                self.problems.push(problem);
                return None;
            }
        };
        if max == 0 {
            self.skip(id, NotServed::MaxZero, "max size is 0");
            return None;
        }
        if let Some((field, why)) = self.pause_of(resource) {
            self.problems
                .push(Problem::new(&object, field, why.clone()).with_kind(ProblemKind::Paused));
            self.skip(id, NotServed::Paused, why);
            return None;
        }
        let Some(target) = resource.replicas else {
            let problem = Problem::new(
                &object,
                "spec.replicas",
                "not set: the group has no target size",
            );
            self.skip(
                id,
                NotServed::ReplicasUnset,
                format!("{}: {}", problem.field, problem.message),
            );
            self.problems.push(problem);
            return None;
        };
        let (group, problems) = self.collecting(|b| {
            let keys = &b.settings.keys;
            if let Some(problem) = b.topology_conflict(resource) {
                b.problems.push(problem);
            }
            let (options, option_problems) = options::parse(keys, &object, &resource.annotations);
            b.problems.extend(option_problems);
            let price = match pricing::group_price(&object, &resource.annotations) {
                Ok(price) => price,
                Err(problem) => {
                    b.problems.push(problem);
                    None
                }
            };
            let rollout = match kind {
                ScalableKind::MachineDeployment => b.rollout_of(resource, sets_by_deployment),
                _ => None,
            };
            let preflight = match kind {
                ScalableKind::MachineSet => resource.preflight.clone(),
                ScalableKind::MachineDeployment => sets_by_deployment
                    .get(&(key.namespace.as_str(), key.name.as_str()))
                    .and_then(|sets| sets.iter().find_map(|ms| ms.preflight.clone())),
                ScalableKind::MachinePool => None,
            };
            NodeGroup {
                id,
                min,
                max,
                target,
                resource: Arc::clone(resource),
                instances: Vec::new(),
                unlisted: Vec::new(),
                foreign_marks: Vec::new(),
                registered: 0,
                template: None,
                options,
                price,
                rollout,
                preflight,
            }
        });
        Some((group, problems))
    }

    /// The template of `group`: taken from the previous snapshot when its inputs are the same.
    fn template_memo(
        &self,
        group: &NodeGroup,
        node_labels: Option<&BTreeMap<String, String>>,
        copied: Vec<(String, String)>,
        failure_domain_zone: Option<FailureDomainZone>,
    ) -> Arc<TemplateMemo> {
        let infra = self.infra_input(&group.resource);
        if let Some(memo) = self
            .previous
            .and_then(|p| p.templates.get(group.id.as_str()))
            .filter(|m| {
                m.holds_for(
                    &group.resource,
                    &infra,
                    &copied,
                    failure_domain_zone.as_ref(),
                )
            })
        {
            return Arc::clone(memo);
        }
        let outcome = template::build(&TemplateInputs {
            group_id: &group.id,
            resource: &group.resource,
            infra: infra.source(),
            node_labels,
            default_arch: self.settings.default_arch.as_deref(),
            failure_domain_zone: failure_domain_zone.as_ref(),
        });
        let mut problems = outcome.problems;
        if let InfraInput::Malformed(problem) = &infra {
            problems.push(problem.clone());
        }
        Arc::new(TemplateMemo {
            resource: Arc::clone(&group.resource),
            infra,
            node_labels: copied,
            failure_domain_zone,
            template: outcome.template.map(Arc::new),
            problems,
        })
    }

    fn build(mut self, basis: u64) -> Snapshot {
        if let Some(snapshot) = self.patch(basis) {
            return snapshot;
        }
        let owner_labels = OwnerLabels::new(&self.settings.keys);
        let sets_by_deployment = self.machine_sets_by_deployment(&owner_labels);
        let machine_sets = Arc::new(
            sets_by_deployment
                .iter()
                .map(|(&(namespace, name), sets)| {
                    let keys: Vec<ObjectKey> = sets.iter().map(|ms| ms.key.clone()).collect();
                    (ObjectKey::new(namespace, name), keys)
                })
                .collect(),
        );
        self.scope = scope::decide(
            self.settings.cluster.as_ref(),
            &self.index.observed_clusters(),
            &self.candidate_clusters(),
        );
        let (mut groups, mut group_problems) = self.candidate_groups(&sets_by_deployment);
        self.problems.extend(scope::discovery_problems(
            &self.settings.discovery,
            &self.scope,
        ));
        let scope_reason = match &self.scope {
            Scope::Nothing(why) => Some(format!("no node group is served: {why}")),
            Scope::Cluster { cluster, how } if groups.is_empty() && self.out_of_scope > 0 => {
                Some(format!(
                    "no node group is served: none belongs to Cluster {cluster} ({how}); {} of \
                     other Clusters left out",
                    self.out_of_scope
                ))
            }
            _ => None,
        };
        let mut lookup = Lookup::default();
        let found = self.machines_by_group(&groups, &owner_labels, &mut lookup);
        self.attach_instances(&mut groups, found, &mut lookup);
        lookup.by_normalized_id = normalized_ids(&lookup);
        let mut templates = self.templates(&mut groups, &mut group_problems);
        // One shared id per group, for the maps every later patch copies.
        let mut shared_templates = HashMap::with_capacity(templates.len());
        let mut shared_problems = HashMap::with_capacity(group_problems.len());
        let mut served = BTreeMap::new();
        for (id, group) in groups {
            let shared: Arc<str> = Arc::from(id.as_str());
            if let Some(memo) = templates.remove(&id) {
                shared_templates.insert(Arc::clone(&shared), memo);
            }
            if let Some(problems) = group_problems.remove(&id) {
                shared_problems.insert(Arc::clone(&shared), Arc::from(problems));
            }
            served.insert(shared, Arc::new(group));
        }
        let groups = Groups(served);
        let (templates, group_problems) = (shared_templates, shared_problems);
        let mut base_problems = std::mem::take(&mut self.problems);
        base_problems.sort();
        base_problems.dedup();
        let skipped = std::mem::take(&mut self.skipped);
        let mut snapshot = self.finish(
            basis,
            groups,
            Arc::new(lookup),
            templates,
            machine_sets,
            group_problems,
            base_problems,
            skipped,
        );
        snapshot.scope = std::mem::take(&mut self.scope);
        snapshot.scope_reason = scope_reason;
        snapshot.not_served = std::mem::take(&mut self.not_served);
        snapshot
    }

    /// The served groups (by id) and each one's own problems; a resource that could not be read is
    /// a problem of the snapshot.
    fn candidate_groups(
        &mut self,
        sets_by_deployment: &HashMap<(&'a str, &'a str), Vec<&'a ScalableResource>>,
    ) -> (BTreeMap<String, NodeGroup>, HashMap<String, Vec<Problem>>) {
        let mut groups: BTreeMap<String, NodeGroup> = BTreeMap::new();
        let mut group_problems: HashMap<String, Vec<Problem>> = HashMap::new();
        let index: &'a Index = self.index;
        for ((kind, key), parsed) in &index.resources {
            let resource = match parsed {
                Ok(r) => r,
                Err(problem) => {
                    self.problems.push(problem.clone());
                    continue;
                }
            };
            if let Some((group, problems)) =
                self.served_group(*kind, key, resource, sets_by_deployment)
            {
                if !problems.is_empty() {
                    group_problems.insert(group.id.clone(), problems);
                }
                groups.insert(group.id.clone(), group);
            }
        }
        (groups, group_problems)
    }

    /// Every Machine of a served group, through its owner (a MachineSet not cached or not served
    /// falls back to the Machine's deployment label); each gets its location in `lookup`.
    fn machines_by_group(
        &mut self,
        groups: &BTreeMap<String, NodeGroup>,
        owner_labels: &OwnerLabels,
        lookup: &mut Lookup,
    ) -> GroupMachines {
        let mut found = GroupMachines::default();
        let index: &'a Index = self.index;
        // Many Machines share an owner: each owner is resolved to its group once per build.
        let mut owner_groups: HashMap<(&str, ScalableKind, &str), Option<String>> = HashMap::new();
        for (key, parsed) in &index.machines {
            let machine = match parsed {
                Ok(m) => m,
                Err(problem) => {
                    self.problems.push(problem.clone());
                    continue;
                }
            };
            let Some(owner) = self.machine_owner(machine, owner_labels) else {
                continue;
            };
            let namespace = machine.key.namespace.as_str();
            let resolved = owner_groups
                .entry((namespace, owner.0, owner.1))
                .or_insert_with(|| self.owner_group(namespace, owner, groups));
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
            lookup
                .by_machine
                .insert(key.clone(), position(&lookup.locations));
            lookup.locations.push(Location {
                group_id: group_id.clone(),
                machine: Some(key.clone()),
                in_pool_list: false,
            });
            match self.instance_of(machine) {
                Some(instance) => found.instances.entry(group_id).or_default().push(instance),
                None => found
                    .unlisted
                    .entry(group_id)
                    .or_default()
                    .push(key.clone()),
            }
        }
        found
    }

    /// Each group's instances (its Machines', and a MachinePool's providerIDList entries without a
    /// Machine), sorted, with their locations in `lookup`; an instance claimed by two groups is a
    /// problem.
    fn attach_instances(
        &mut self,
        groups: &mut BTreeMap<String, NodeGroup>,
        mut found: GroupMachines,
        lookup: &mut Lookup,
    ) {
        for (id, group) in groups.iter_mut() {
            let mut list = found.instances.remove(id).unwrap_or_default();
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
            let unlisted = found.unlisted.get(id).map_or(0, Vec::len);
            let held = held_instances(group, &list, unlisted);
            self.mark_leaving(&mut list, unlisted, group.target);
            list.extend(held);
            let pool: BTreeSet<&str> = group
                .resource
                .provider_id_list
                .iter()
                .map(String::as_str)
                .collect();
            for instance in &list {
                let at = lookup.place(id, instance, pool.contains(instance.id.as_str()));
                if let Some(previous) = lookup.by_instance_id.insert(instance.id.clone(), at) {
                    let claimed_by = lookup
                        .locations
                        .get(previous as usize)
                        .map(|l| l.group_id.as_str())
                        .unwrap_or_default();
                    self.problems.push(Problem::new(
                        object_name(group.kind(), &group.resource.key),
                        "spec.providerID",
                        format!("instance {} is also claimed by {claimed_by}", instance.id),
                    ));
                }
            }
            group.registered = list
                .iter()
                .filter(|i| i.state == InstanceState::Running)
                .count() as i32
                + found.unlisted.get(id).map_or(0, Vec::len) as i32;
            group.instances = list;
            group.unlisted = found.unlisted.remove(id).unwrap_or_default();
            group.foreign_marks = self.foreign_marks(&group.instances, &group.unlisted);
        }
    }

    /// The zone labels of the Nodes of Machines in each failure domain, by (namespace, Cluster,
    /// failure domain): what a template in that failure domain is given as its zone. Only the failure
    /// domains some group's template names are counted.
    fn failure_domain_zones(
        &self,
        groups: &BTreeMap<String, NodeGroup>,
    ) -> HashMap<(&str, &str, &str), BTreeMap<String, usize>> {
        let wanted: HashSet<(&str, &str, &str)> = groups
            .values()
            .filter_map(|g| {
                let r = &g.resource;
                let fd = r.template.failure_domain.as_deref()?.trim();
                Some((r.key.namespace.as_str(), r.cluster_name.as_str(), fd))
            })
            .collect();
        let mut zones: HashMap<(&str, &str, &str), BTreeMap<String, usize>> = HashMap::new();
        if wanted.is_empty() {
            return zones;
        }
        for machine in self.index.machines.values().filter_map(|m| m.as_ref().ok()) {
            let Some(fd) = machine.failure_domain.as_deref() else {
                continue;
            };
            let at = (
                machine.key.namespace.as_str(),
                machine.cluster_name.as_str(),
                fd,
            );
            if !wanted.contains(&at) {
                continue;
            }
            let zone = machine
                .node_ref
                .as_deref()
                .and_then(|name| self.index.nodes.get(name))
                .and_then(|node| node.labels.get(template::LABEL_ZONE));
            if let Some(zone) = zone {
                *zones
                    .entry(at)
                    .or_default()
                    .entry(zone.clone())
                    .or_default() += 1;
            }
        }
        zones
    }

    /// Each group's template, with the node labels of an existing node of the group when the
    /// workload cluster is watched. A template whose inputs are those of the previous build is
    /// taken from it.
    fn templates(
        &self,
        groups: &mut BTreeMap<String, NodeGroup>,
        group_problems: &mut HashMap<String, Vec<Problem>>,
    ) -> HashMap<String, Arc<TemplateMemo>> {
        let node_labels_by_provider: HashMap<&str, &BTreeMap<String, String>> = self
            .index
            .nodes
            .values()
            .filter_map(|n| n.provider_id.as_deref().map(|p| (p, &n.labels)))
            .collect();
        let zones = self.failure_domain_zones(groups);
        let mut templates: HashMap<String, Arc<TemplateMemo>> =
            HashMap::with_capacity(groups.len());
        for (id, group) in groups.iter_mut() {
            let node_labels = group
                .instances
                .iter()
                .find_map(|i| node_labels_by_provider.get(i.id.as_str()).copied());
            let copied: Vec<(String, String)> = node_labels
                .map(|labels| {
                    template::NODE_LABELS_COPIED
                        .iter()
                        .filter_map(|k| labels.get(*k).map(|v| (k.to_string(), v.clone())))
                        .collect()
                })
                .unwrap_or_default();
            let r = &group.resource;
            let failure_domain_zone = r
                .template
                .failure_domain
                .as_deref()
                .map(str::trim)
                .and_then(|fd| zones.get(&(r.key.namespace.as_str(), r.cluster_name.as_str(), fd)))
                .and_then(template::zone_in_failure_domain);
            let memo = self.template_memo(group, node_labels, copied, failure_domain_zone);
            if !memo.problems.is_empty() {
                group_problems
                    .entry(id.clone())
                    .or_default()
                    .extend(memo.problems.iter().cloned());
            }
            group.template = memo.template.clone();
            templates.insert(id.clone(), memo);
        }
        templates
    }

    /// The rest of a snapshot, from its groups and problems.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        basis: u64,
        groups: Groups,
        lookup: Arc<Lookup>,
        templates: HashMap<Arc<str>, Arc<TemplateMemo>>,
        machine_sets: Arc<HashMap<ObjectKey, Vec<ObjectKey>>>,
        group_problems: HashMap<Arc<str>, Arc<[Problem]>>,
        base_problems: Vec<Problem>,
        skipped: BTreeMap<String, String>,
    ) -> Snapshot {
        let priced: Vec<PricedNode> = groups
            .values()
            .filter_map(|g| {
                let (hourly, template) = (g.price?, g.template.as_ref()?);
                Some(PricedNode {
                    hourly,
                    cpu_cores: template.summary.cpu_cores,
                    memory_gib: template.summary.memory_gib,
                    gpu: template.summary.gpu.is_some(),
                })
            })
            .collect();
        let (reference_prices, reference_sources) = ReferencePrices::resolve(
            self.settings.cpu_hour_price,
            self.settings.gib_hour_price,
            &priced,
        );
        let mut problems: Vec<Problem> = base_problems
            .iter()
            .chain(group_problems.values().flat_map(|p| p.iter()))
            .cloned()
            .collect();
        problems.sort();
        problems.dedup();
        Snapshot {
            groups,
            lookup,
            templates,
            machine_sets,
            group_problems,
            base_problems,
            scope: Scope::Unknown,
            scope_reason: None,
            basis,
            skipped,
            not_served: BTreeMap::new(),
            problems,
            reference_prices,
            reference_sources,
            machines: self.index.machines.len(),
        }
    }

    /// The snapshot after changes local to some groups (see [`Journal`]): those groups are rebuilt,
    /// everything else is taken from the previous snapshot. `None` when the changes are of another
    /// kind, or the previous snapshot is not the one they are relative to.
    fn patch(&mut self, basis: u64) -> Option<Snapshot> {
        let (previous, journal) = (self.previous?, self.journal?);
        if journal.other || previous.basis == 0 || previous.basis != journal.since {
            return None;
        }
        let index: &'a Index = self.index;
        self.scope = previous.scope.clone();
        let owner_labels = OwnerLabels::new(&self.settings.keys);
        // By the id the previous snapshot shares, which the rebuilt group keeps.
        let mut affected: BTreeSet<&Arc<str>> = BTreeSet::new();
        let mut served = |id: String| {
            if let Some((id, _)) = previous.groups.0.get_key_value(id.as_str()) {
                affected.insert(id);
            }
        };
        for (kind, key) in &journal.resources {
            served(group_id(*kind, key));
            // A MachineSet's replicas are its MachineDeployment's rollout.
            if *kind == ScalableKind::MachineSet
                && let Some(set) = index.resource(*kind, key)
            {
                let named = set.labels.get(&owner_labels.deployment);
                for md in set
                    .owners
                    .iter()
                    .filter(|o| o.kind == "MachineDeployment")
                    .map(|o| &o.name)
                    .chain(named)
                {
                    served(group_id(
                        ScalableKind::MachineDeployment,
                        &ObjectKey::new(key.namespace.as_str(), md.as_str()),
                    ));
                }
            }
        }
        for key in &journal.machines {
            if let Some(location) = previous
                .lookup
                .by_machine
                .get(key)
                .and_then(|at| previous.lookup.locations.get(*at as usize))
            {
                served(location.group_id.clone());
            }
        }
        // Only the MachineSets of the MachineDeployments rebuilt, as they are now: their rollout state.
        let sets_by_deployment: HashMap<(&'a str, &'a str), Vec<&'a ScalableResource>> = affected
            .iter()
            .filter_map(|id| previous.groups.get(id))
            .filter(|g| g.kind() == ScalableKind::MachineDeployment)
            .filter_map(|g| {
                let key = &g.resource.key;
                let sets = previous
                    .machine_sets
                    .get(key)?
                    .iter()
                    .filter_map(|ms| index.resource(ScalableKind::MachineSet, ms))
                    .map(Arc::as_ref)
                    .collect();
                Some(((key.namespace.as_str(), key.name.as_str()), sets))
            })
            .collect();
        let mut groups = previous.groups.clone();
        let mut templates = previous.templates.clone();
        let mut group_problems = previous.group_problems.clone();
        for id in affected {
            let old = previous.groups.get(id)?;
            let (kind, key) = (old.kind(), &old.resource.key);
            let resource = index.resource(kind, key)?;
            let (rebuilt, base) =
                self.collecting(|b| b.served_group(kind, key, resource, &sets_by_deployment));
            let (mut group, mut problems) = rebuilt?;
            if !base.is_empty() || group.id.as_str() != id.as_ref() {
                return None;
            }
            // Same Machines, same ids: their states again, then the marks against the new target.
            // Held-back instances are made again below; other ids than before need a new lookup.
            let mut list = Vec::with_capacity(old.instances.len());
            let old_held: Vec<&str> = old
                .instances
                .iter()
                .filter(|i| i.machine.is_none() && crate::preflight::is_held_id(&i.id))
                .map(|i| i.id.as_str())
                .collect();
            for instance in &old.instances {
                if instance.machine.is_none() && crate::preflight::is_held_id(&instance.id) {
                    continue;
                }
                match &instance.machine {
                    Some(machine) => {
                        let fresh = self.instance_of(index.machine(machine)?)?;
                        if fresh.id != instance.id {
                            return None;
                        }
                        list.push(fresh);
                    }
                    None => list.push(Instance {
                        state: InstanceState::Running,
                        error: None,
                        ..instance.clone()
                    }),
                }
            }
            let running = |list: &[Instance]| {
                list.iter()
                    .filter(|i| i.state == InstanceState::Running)
                    .count() as i32
            };
            // Machines with a Node but no providerID stay with the group (the removal counts and
            // the repair read them); one that has an id now is an instance: built from scratch.
            for key in &old.unlisted {
                if self.instance_of(index.machine(key)?).is_some() {
                    return None;
                }
            }
            group.unlisted = old.unlisted.clone();
            let held = held_instances(&group, &list, group.unlisted.len());
            if held
                .iter()
                .map(|i| i.id.as_str())
                .ne(old_held.iter().copied())
            {
                return None;
            }
            self.mark_leaving(&mut list, group.unlisted.len(), group.target);
            list.extend(held);
            group.registered = running(&list) + group.unlisted.len() as i32;
            group.foreign_marks = self.foreign_marks(&list, &group.unlisted);
            group.instances = list;
            // Nodes did not change: the labels copied from the group's Node neither.
            // Nor the zones of failure domains.
            let previous_memo = previous.templates.get(id)?;
            let copied = previous_memo.node_labels.clone();
            let failure_domain_zone = previous_memo.failure_domain_zone.clone();
            let node_labels: BTreeMap<String, String> = copied.iter().cloned().collect();
            let memo = self.template_memo(&group, Some(&node_labels), copied, failure_domain_zone);
            problems.extend(memo.problems.iter().cloned());
            group.template = memo.template.clone();
            templates.insert(Arc::clone(id), memo);
            if problems.is_empty() {
                group_problems.remove(id);
            } else {
                group_problems.insert(Arc::clone(id), Arc::from(problems));
            }
            groups.0.insert(Arc::clone(id), Arc::new(group));
        }
        let mut snapshot = self.finish(
            basis,
            groups,
            Arc::clone(&previous.lookup),
            templates,
            Arc::clone(&previous.machine_sets),
            group_problems,
            previous.base_problems.clone(),
            previous.skipped.clone(),
        );
        snapshot.scope = previous.scope.clone();
        snapshot.scope_reason = previous.scope_reason.clone();
        snapshot.not_served = previous.not_served.clone();
        Some(snapshot)
    }

    /// The Machines (not being deleted) of `instances` and `unlisted` carrying a delete mark this
    /// provider did not write.
    fn foreign_marks(&self, instances: &[Instance], unlisted: &[ObjectKey]) -> Vec<String> {
        let delete_key = &self.settings.keys.delete_machine;
        instances
            .iter()
            .filter_map(|i| i.machine.as_ref())
            .chain(unlisted)
            .filter(|key| {
                self.index
                    .machines
                    .get(*key)
                    .and_then(|m| m.as_ref().ok())
                    .is_some_and(|m| {
                        !m.deleting
                            && m.annotations
                                .get(delete_key)
                                .is_some_and(|v| !crate::scale::removal::is_our_mark(v))
                    })
            })
            .map(|key| key.name.clone())
            .collect()
    }

    /// Marked Machines that the replica count no longer covers are on their way out: CAPI deletes
    /// marked Machines first when replicas drop below the Machines it has. Reported as deleting, CA
    /// stops counting them: an unregistered one is otherwise "removed" again every loop and its
    /// group scaled up again for the capacity CA believes it lost. A mark replicas still cover (a
    /// decrement not yet written) leaves the instance as it was, so CA's retry can complete it.
    /// Every member counts toward the Machines beyond replicas, as in the removal rules: a
    /// MachinePool's instances without a Machine, and the `unlisted` Machines (a Node, no
    /// providerID).
    fn mark_leaving(&self, list: &mut [Instance], unlisted: usize, target: i32) {
        let delete_key = &self.settings.keys.delete_machine;
        let active = list
            .iter()
            .filter(|i| i.state != InstanceState::Deleting)
            .count()
            + unlisted;
        let mut surplus = crate::scale::removal::surplus(active, target);
        for instance in list.iter_mut() {
            if surplus == 0 {
                break;
            }
            if instance.state == InstanceState::Deleting {
                continue;
            }
            let marked = instance
                .machine
                .as_ref()
                .and_then(|key| self.index.machines.get(key))
                .and_then(|m| m.as_ref().ok())
                .is_some_and(|m| m.annotations.contains_key(delete_key));
            if marked {
                instance.state = InstanceState::Deleting;
                surplus -= 1;
            }
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

/// The instances Cluster API's preflight checks hold back in `group` (none without a hold): its
/// replicas beyond its Machines not being deleted (`list`'s, and `unlisted` Machines with a Node
/// but no providerID), each being created with the hold as its error.
fn held_instances(group: &NodeGroup, list: &[Instance], unlisted: usize) -> Vec<Instance> {
    let Some(hold) = &group.preflight else {
        return Vec::new();
    };
    let machines = list
        .iter()
        .filter(|i| i.machine.is_some() && i.state != InstanceState::Deleting)
        .count()
        + unlisted;
    let count = crate::preflight::held_count(group.target, machines);
    let error = crate::preflight::instance_error(&group.id, hold);
    let key = &group.resource.key;
    crate::preflight::held_ids(group.kind().as_str(), &key.namespace, &key.name, count)
        .into_iter()
        .map(|id| Instance {
            id,
            state: InstanceState::Creating,
            error: Some(error.clone()),
            machine: None,
        })
        .collect()
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
mod tests;
