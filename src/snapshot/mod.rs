//! Pure: the cached objects (`crate::cache::Index`) → an immutable `Snapshot` that every read RPC
//! answers from.
//!
//! Here the snapshot's types and lookups; `build` the full build, `patch` the rebuild of the groups
//! the provider's own writes touched, `instances` what CA sees of a group's Machines (for both),
//! `group_id` the id CA knows a group by. Which MachineSet belongs to which MachineDeployment and a
//! group's bounds are Cluster API rules: `crate::capi::owners`, `crate::capi::bounds`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use prost::bytes::Bytes;

use crate::cache::Index;
use crate::capi::rollout::Rollout;
use crate::capi::{Keys, Name, ObjectKey, ScalableKind, ScalableResource, providerid};
use crate::discovery::DiscoverySpec;
use crate::encoded::Encoded;
use crate::options::GroupOptions;
use crate::pricing::{PriceSource, ReferencePrices};
use crate::problem::Problem;
use crate::scope::{ClusterRef, Scope};
use crate::template::TemplateNode;

use build::TemplateMemo;
pub use group_id::GroupId;

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
    /// The Machine's providerID byte for byte (the cached Machine's own string), or a made-up id
    /// with an upstream prefix.
    pub id: Name,
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
    /// deletes them first all the same (see `crate::protocol`).
    pub foreign_marks: Vec<String>,
    /// Whether a member Machine (being deleted or not) carries a delete mark, anyone's: with the
    /// protocol's records on the group, what gives the repair something to look at
    /// ([`crate::protocol::repair_has_work`]).
    pub marked: bool,
    /// Nodes that registered: running instances, and Machines with a Node but no known providerID.
    pub registered: i32,
    pub template: Option<Arc<TemplateNode>>,
    pub options: Option<GroupOptions>,
    pub price: Option<f64>,
    /// Set while the group's MachineDeployment rolls out: scale-down of the group is paused.
    pub rollout: Option<Rollout>,
    /// Set while Cluster API's preflight checks hold back the group's scale-up (its MachineSet's, or
    /// one of its MachineDeployment's): the replicas beyond its Machines are reported as instances
    /// being created with an error (`crate::capi::preflight`).
    pub preflight: Option<crate::capi::preflight::PreflightHold>,
    /// The group as CA receives it ([`NodeGroup::encoded`]): a group is shared by every snapshot
    /// until it changes, so it is encoded once per change, not once per NodeGroupForNode.
    encoded: Encoded,
}

impl NodeGroup {
    /// The group as `encode` writes it, encoded on the first call only; every later call shares
    /// those bytes.
    pub fn encoded(&self, encode: impl FnOnce(&NodeGroup) -> Vec<u8>) -> Bytes {
        self.encoded.get_or_encode(|| encode(self))
    }

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
    /// One string per group, shared by its locations.
    pub group_id: Name,
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
    pub(crate) basis: u64,
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

impl Snapshot {
    /// The MachineSets of MachineDeployment `deployment` (by owner reference or label).
    pub fn machine_sets_of(&self, deployment: &ObjectKey) -> &[ObjectKey] {
        self.machine_sets
            .get(deployment)
            .map(Vec::as_slice)
            .unwrap_or_default()
    }
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
    /// Its Cluster's managed topology sets its replicas: the topology controller would undo
    /// every scale.
    Topology,
}

impl NotServed {
    pub const ALL: [NotServed; 6] = [
        NotServed::OtherCluster,
        NotServed::Bounds,
        NotServed::MaxZero,
        NotServed::Paused,
        NotServed::ReplicasUnset,
        NotServed::Topology,
    ];

    pub fn label(self) -> &'static str {
        match self {
            NotServed::OtherCluster => "other-cluster",
            NotServed::Bounds => "bounds",
            NotServed::MaxZero => "max-zero",
            NotServed::Paused => "paused",
            NotServed::ReplicasUnset => "replicas-unset",
            NotServed::Topology => "topology",
        }
    }
}

/// The served node groups, in id order. A group, and its id, are shared by every snapshot it did
/// not change in, so a rebuild after a write copies pointers, not groups or strings.
#[derive(Clone, Debug, Default)]
pub struct Groups {
    list: Vec<Arc<NodeGroup>>,
    /// Each group's position in `list`, by id. A patch changes groups, never which there are, so
    /// the snapshots patched from one build share it (and their lookups' group positions).
    positions: Arc<HashMap<Arc<str>, u32>>,
}

impl Groups {
    /// The groups of `served`, in its order.
    fn new(served: BTreeMap<Arc<str>, Arc<NodeGroup>>) -> Groups {
        let mut positions = HashMap::with_capacity(served.len());
        let mut list = Vec::with_capacity(served.len());
        for (id, group) in served {
            positions.insert(id, position(&list));
            list.push(group);
        }
        Groups {
            list,
            positions: Arc::new(positions),
        }
    }

    pub fn get(&self, id: &str) -> Option<&NodeGroup> {
        self.positions.get(id).and_then(|&at| self.at(at))
    }

    /// The group at `position` (a location's, [`Lookup::place_groups`]).
    fn at(&self, position: u32) -> Option<&NodeGroup> {
        self.list.get(position as usize).map(Arc::as_ref)
    }

    /// The id of group `id` as every snapshot of this build shares it.
    fn shared_id(&self, id: &str) -> Option<&Arc<str>> {
        self.positions.get_key_value(id).map(|(id, _)| id)
    }

    /// Puts `group` in the place of the group of its id; `None` when there is none.
    fn replace(&mut self, group: NodeGroup) -> Option<()> {
        let at = *self.positions.get(group.id.as_str())?;
        *self.list.get_mut(at as usize)? = Arc::new(group);
        Some(())
    }

    pub fn contains_key(&self, id: &str) -> bool {
        self.positions.contains_key(id)
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Ids in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.list.iter().map(|g| g.id.as_str())
    }

    /// Groups in id order.
    pub fn values(&self) -> impl Iterator<Item = &NodeGroup> {
        self.list.iter().map(Arc::as_ref)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &NodeGroup)> {
        self.into_iter()
    }
}

impl<'a> IntoIterator for &'a Groups {
    type Item = (&'a str, &'a NodeGroup);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, Arc<NodeGroup>>,
        fn(&'a Arc<NodeGroup>) -> (&'a str, &'a NodeGroup),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.list.iter().map(|g| (g.id.as_str(), g.as_ref()))
    }
}

/// Every place a node can live, each once, and the maps that find it. (A Location per map entry
/// would triple the largest part of a snapshot: one entry per Machine in each map.)
#[derive(Clone, Debug, Default)]
struct Lookup {
    locations: Vec<Location>,
    /// Each location's group's position in the snapshot's [`Groups`] ([`NOT_PLACED`]: not served),
    /// beside the locations rather than in them: CA asks for the group of every node each loop, and
    /// at 100,000 nodes these 4 bytes apiece stay in the cache where the locations do not.
    group_positions: Vec<u32>,
    /// Exact instance id (providerID or made-up id) → where it lives.
    by_instance_id: HashMap<Name, u32>,
    /// Normalised providerID → where it lives; only ids that normalise uniquely.
    by_normalized_id: HashMap<Name, u32>,
    /// Machine → where it lives (also Machines that are not listed as instances).
    by_machine: HashMap<ObjectKey, u32>,
}

impl Lookup {
    /// Places each location's group: its position in `groups`, which the snapshots served with this
    /// lookup share (a patch replaces groups in place, never adds or removes one).
    fn place_groups(&mut self, groups: &Groups) {
        self.group_positions = self
            .locations
            .iter()
            .map(|location| {
                groups
                    .positions
                    .get(location.group_id.as_str())
                    .copied()
                    .unwrap_or(NOT_PLACED)
            })
            .collect();
    }

    /// Adds `location`; its group is placed with the others ([`Lookup::place_groups`]).
    fn push(&mut self, location: Location) -> u32 {
        let at = position(&self.locations);
        self.locations.push(location);
        at
    }

    /// Built once and kept until the next full build, so no room to grow: the served snapshot and
    /// the one being built are both held at a rebuild's peak.
    fn shrink_to_fit(&mut self) {
        self.locations.shrink_to_fit();
        self.group_positions.shrink_to_fit();
        self.by_instance_id.shrink_to_fit();
        self.by_normalized_id.shrink_to_fit();
        self.by_machine.shrink_to_fit();
    }

    /// Where `instance` of group `id` lives: its Machine's location when that says the same (the
    /// usual case), else a new one.
    fn place(&mut self, id: &Name, instance: &Instance, in_pool_list: bool) -> u32 {
        let same = instance
            .machine
            .as_ref()
            .and_then(|m| self.by_machine.get(m))
            .copied()
            .filter(|&at| {
                self.locations
                    .get(at as usize)
                    .is_some_and(|l| l.group_id == *id && l.in_pool_list == in_pool_list)
            });
        if let Some(at) = same {
            return at;
        }
        self.push(Location {
            group_id: id.clone(),
            machine: instance.machine.clone(),
            in_pool_list,
        })
    }
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
        self.lookup
            .locations
            .get(self.location_of(node, keys)? as usize)
    }

    /// The group CA's node is in, by [`Snapshot::locate`]'s rules, found from the location's
    /// position alone.
    pub fn group_for_node(&self, node: &NodeRef<'_>, keys: &Keys) -> Option<&NodeGroup> {
        let at = self.location_of(node, keys)? as usize;
        let group = self.groups.at(*self.lookup.group_positions.get(at)?)?;
        debug_assert_eq!(
            Some(group.id.as_str()),
            self.lookup.locations.get(at).map(|l| l.group_id.as_str()),
            "a location placed at another group's position"
        );
        Some(group)
    }

    /// The position of the node's location in the lookup.
    fn location_of(&self, node: &NodeRef<'_>, keys: &Keys) -> Option<u32> {
        let lookup = self.lookup.as_ref();
        if !node.provider_id.is_empty() {
            if let Some(&found) = lookup.by_instance_id.get(node.provider_id) {
                return Some(found);
            }
            if let Some(&found) = lookup
                .by_normalized_id
                .get(providerid::normalize(node.provider_id))
            {
                return Some(found);
            }
        }
        // CA's fake nodes for instances that never registered carry the instance id as their name.
        if let Some(&found) = lookup.by_instance_id.get(node.name) {
            return Some(found);
        }
        let annotations = node.annotations?;
        let name = annotations.get(&keys.node_machine)?;
        let namespace = annotations.get(&keys.node_cluster_namespace)?;
        lookup
            .by_machine
            .get(&ObjectKey::new(namespace.as_str(), name.as_str()))
            .copied()
    }
}

/// The index the next item pushed onto `items` gets.
fn position<T>(items: &[T]) -> u32 {
    u32::try_from(items.len()).unwrap_or(u32::MAX)
}

/// The position of a location whose group is not served.
const NOT_PLACED: u32 = u32::MAX;

fn object_name(kind: impl std::fmt::Display, key: &ObjectKey) -> crate::problem::Subject {
    crate::problem::Subject::object(kind, key)
}

mod build;
mod group_id;
mod instances;
mod patch;

#[cfg(test)]
mod tests;
