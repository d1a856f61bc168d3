//! The cache: the objects the watches deliver, kept by kind and key as typed views (`Index`), and a
//! journal of what changed since the last snapshot, so a rebuild after the provider's own writes
//! touches only the groups they changed. The writer (`writer`) turns watch events into calls here;
//! `crate::snapshot` reads it. Pure: tested by feeding it events, without a cluster.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::capi::{
    ClusterTopology, InfraRef, InfraTemplate, Labels, Machine, Name, Node, ObjectKey, ScalableKind,
    ScalableResource,
};
use crate::problem::Problem;
use crate::protocol::ledger::RECORD_ANNOTATIONS;

#[cfg(test)]
mod tests;
pub mod writer;

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

/// A watched object of a kind, or the reason it could not be read (boxed: the maps hold one of
/// these per object, and almost every object can be read).
pub type Parsed<T> = Result<Arc<T>, Box<Problem>>;

/// The cached objects of the management (and optionally workload) cluster.
#[derive(Clone, Debug, Default)]
pub struct Index {
    resources: BTreeMap<(ScalableKind, ObjectKey), Parsed<ScalableResource>>,
    machines: BTreeMap<ObjectKey, Parsed<Machine>>,
    nodes: HashMap<Name, Arc<Node>>,
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
    /// The basis of the last snapshot built with `Index::snapshot_reusing`.
    epoch: u64,
    /// How far the watches of Machines and of MachineSets have brought the index.
    watched: Watermarks,
}

/// The revisions the watches of Machines and of MachineSets have brought the index up to: every
/// event of theirs up to there is applied (0: none yet), so what the index holds of that kind is
/// not older than it (a read's list of them at that revision or later returns nothing older).
#[derive(Clone, Copy, Debug, Default)]
struct Watermarks {
    machines: u64,
    machine_sets: u64,
}

impl Watermarks {
    /// The watermark of Machines (`None`) or of a kind; `None` for a kind none is kept of.
    fn of(&mut self, kind: Option<ScalableKind>) -> Option<&mut u64> {
        match kind {
            None => Some(&mut self.machines),
            Some(ScalableKind::MachineSet) => Some(&mut self.machine_sets),
            Some(_) => None,
        }
    }
}

/// The changes since a snapshot, when they are all of the kinds a rebuild can apply to the groups they
/// touch alone (a write of replicas, a Machine's annotations): the rest of that snapshot still holds.
#[derive(Clone, Debug, Default)]
pub(crate) struct Journal {
    pub(crate) since: u64,
    pub(crate) resources: BTreeSet<(ScalableKind, ObjectKey)>,
    pub(crate) machines: BTreeSet<ObjectKey>,
    /// Any other change: the next snapshot is built from scratch.
    pub(crate) other: bool,
}

impl Journal {
    /// Whether a snapshot built over these changes from the one built at `previous_basis` is built
    /// whole: a change a patch cannot apply, or a snapshot these changes are not relative to.
    pub(crate) fn builds_whole_after(&self, previous_basis: u64) -> bool {
        self.other || previous_basis == 0 || previous_basis != self.since
    }
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
    /// The Machines of `namespace` with their versions; with `selector` (label key, value), only
    /// those whose cached labels carry it.
    pub fn machine_versions_in(
        &self,
        namespace: &str,
        selector: Option<(&str, &str)>,
    ) -> Vec<(ObjectKey, Option<String>)> {
        self.machines
            .iter()
            .filter(|(k, _)| k.namespace == namespace)
            .filter(|(_, m)| {
                selector.is_none_or(|(key, value)| {
                    m.as_ref().is_ok_and(|m| m.labels.get(key) == Some(value))
                })
            })
            .map(|(k, m)| {
                let version = m.as_ref().ok().map(|m| m.resource_version.clone());
                (k.clone(), version)
            })
            .collect()
    }

    /// How far the watch of Machines (`None`) or of `kind` has brought the index ([`Watermarks`]);
    /// 0 for a kind none is kept of.
    pub fn watched(&self, kind: Option<ScalableKind>) -> u64 {
        let mut watermarks = self.watched;
        watermarks.of(kind).map_or(0, |at| *at)
    }

    /// The watch of Machines (`None`) or of `kind` applied an event at `revision`.
    pub fn watched_to(&mut self, kind: Option<ScalableKind>, revision: u64) {
        if let Some(at) = self.watched.of(kind) {
            *at = (*at).max(revision);
        }
    }

    /// The watch of Machines (`None`) or of `kind` listed them all again, the newest of them at
    /// `revision`: the list is not older than that (it may be older than the events before it, on
    /// another API server).
    pub fn relisted_at(&mut self, kind: Option<ScalableKind>, revision: u64) {
        if let Some(at) = self.watched.of(kind) {
            *at = revision;
        }
    }

    /// Whether the Machine (`None`) or object of `kind` at `key` is cached (read, or failed to
    /// parse).
    pub fn has(&self, kind: Option<ScalableKind>, key: &ObjectKey) -> bool {
        match kind {
            None => self.machines.contains_key(key),
            Some(kind) => self.resources.contains_key(&(kind, key.clone())),
        }
    }

    pub fn machine(&self, key: &ObjectKey) -> Option<&Arc<Machine>> {
        self.machines.get(key).and_then(|m| m.as_ref().ok())
    }

    /// Whether the Node changed what the index keeps of it. A kubelet rewrites its Node's status
    /// (conditions, images, heartbeats) without touching any of that: such an update costs no
    /// snapshot build, where every one was a whole build (half a second at 100,000 Machines,
    /// hundreds of updates a second from as many kubelets).
    pub fn apply_node(&mut self, node: Node) -> bool {
        if self.nodes.get(&node.name).is_some_and(|old| **old == node) {
            return false;
        }
        self.journal.other = true;
        self.count_node_cluster(Some(&node), 1);
        let old = self.nodes.insert(node.name.clone(), Arc::new(node));
        self.count_node_cluster(old.as_deref(), -1);
        true
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

    /// The Clusters of the management cluster, as watched.
    pub fn cluster_keys(&self) -> BTreeSet<ObjectKey> {
        self.clusters.keys().cloned().collect()
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

    /// Returns whether it changed anything: every write's fresh read records the group's Cluster,
    /// and the same Cluster again must not cost a snapshot built from scratch.
    pub fn apply_cluster(&mut self, cluster: ClusterTopology) -> bool {
        if self
            .clusters
            .get(&cluster.key)
            .is_some_and(|cached| **cached == cluster)
        {
            return false;
        }
        self.journal.other = true;
        self.clusters.insert(cluster.key.clone(), Arc::new(cluster));
        true
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

    /// Every resource of the scalable kinds, by kind and key, readable or not.
    pub(crate) fn resources(
        &self,
    ) -> &BTreeMap<(ScalableKind, ObjectKey), Parsed<ScalableResource>> {
        &self.resources
    }

    /// Every Machine by key, readable or not.
    pub(crate) fn machines(&self) -> &BTreeMap<ObjectKey, Parsed<Machine>> {
        &self.machines
    }

    /// The workload cluster's Nodes by name.
    pub(crate) fn nodes(&self) -> &HashMap<Name, Arc<Node>> {
        &self.nodes
    }

    pub(crate) fn cluster(&self, key: &ObjectKey) -> Option<&Arc<ClusterTopology>> {
        self.clusters.get(key)
    }

    /// An infrastructure template, once its kind is watched (see [`Index::infra_kind_state`]).
    pub(crate) fn infra(
        &self,
        kind: &InfraKind,
        key: &ObjectKey,
    ) -> Option<&Parsed<InfraTemplate>> {
        self.infra.get(&(kind.clone(), key.clone()))
    }

    /// Whether the snapshot after the one built from `previous_basis` is built whole, not patched.
    pub fn builds_whole_after(&self, previous_basis: u64) -> bool {
        self.journal.builds_whole_after(previous_basis)
    }

    /// Whether anything changed since the last `snapshot_reusing` (see `crate::snapshot`): every
    /// change goes through the journal, so this is true exactly when that snapshot is out of date.
    pub fn changed_since_snapshot(&self) -> bool {
        let journal = &self.journal;
        journal.other || !journal.resources.is_empty() || !journal.machines.is_empty()
    }

    /// The changes since the last snapshot, for the next one: `basis` names the state of the index
    /// that snapshot is built from, and later changes are recorded relative to it.
    pub(crate) fn take_journal(&mut self) -> (u64, Journal) {
        self.epoch += 1;
        let basis = self.epoch;
        let journal = std::mem::replace(
            &mut self.journal,
            Journal {
                since: basis,
                ..Journal::default()
            },
        );
        (basis, journal)
    }
}

/// The infrastructure kind a readable resource's template references.
fn referenced_infra_kind(parsed: &Parsed<ScalableResource>) -> Option<InfraKind> {
    let reference = parsed.as_ref().ok()?.template.infrastructure_ref.as_ref()?;
    reference.as_ref().ok().map(InfraKind::of)
}

/// Whether two sets of annotations differ at most in the protocol's records
/// ([`RECORD_ANNOTATIONS`]), which only the write path reads.
fn same_but_records(a: &Labels, b: &Labels) -> bool {
    fn served(m: &Labels) -> impl Iterator<Item = (&str, &str)> {
        m.iter().filter(|(k, _)| !RECORD_ANNOTATIONS.contains(k))
    }
    a == b || served(a).eq(served(b))
}

/// Whether a new version of a resource changes only what a rebuild of its own group (and, for a
/// MachineSet, of its MachineDeployment's) picks up: replica counts (not whether there are any), the
/// resourceVersion, the rollout state, the protocol's records.
fn same_layout(a: &ScalableResource, b: &ScalableResource) -> bool {
    same_but_counts(a, b, |x, y| x.is_some() == y.is_some())
}

/// Whether two resources agree on everything but the resourceVersion, `status.replicas`, the
/// rollout state and `spec.replicas`, which `same_replicas` judges. Destructured, so a new field
/// must be placed here.
pub(crate) fn same_but_counts(
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
        generation: _,
        observed_generation: _,
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
        && same_but_records(annotations, &b.annotations)
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
