//! The full build of a snapshot from the index: which resources are served groups, their Machines
//! and instances, the lookups, the templates (reused from the previous build when their inputs did
//! not change), problems and prices.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use super::instances::{MachineView, held_instances, is_synthetic};
use super::{
    GroupId, Groups, Instance, InstanceState, Location, Lookup, NodeGroup, NotServed, Settings,
    Snapshot, object_name, position,
};
use crate::cache::{Index, InfraKind, InfraKindState, Journal, same_but_counts};
use crate::capi::rollout::{self, REVISION_ANNOTATION, Rollout};
use crate::capi::{self, owners};
use crate::capi::{InfraTemplate, ObjectKey, ScalableKind, ScalableResource, providerid};
use crate::discovery;
use crate::options;
use crate::pricing::{self, PricedNode, ReferencePrices};
use crate::problem::{Problem, ProblemKind};
use crate::scope::{self, Scope};
use crate::template::{self, FailureDomainZone, InfraSource, TemplateInputs, TemplateNode};

impl Index {
    /// Builds the snapshot: node groups, their instances and templates, lookup tables, problems.
    pub fn snapshot(&self, settings: &Settings) -> Snapshot {
        Builder::new(self, settings, None, None).build(0)
    }

    /// [`snapshot`](Self::snapshot) for a store that rebuilds over and over: `previous` is the last
    /// snapshot this index built this way (with the same settings). When everything that changed since
    /// is local to some groups (replicas written, Machines marked: the provider's own writes), only
    /// those groups are rebuilt and the rest, lookups included, is shared with `previous`; otherwise
    /// it is built from scratch, reusing the templates whose inputs did not change. Either way the
    /// result equals [`snapshot`](Self::snapshot)'s.
    pub fn snapshot_reusing(&mut self, settings: &Settings, previous: &Snapshot) -> Snapshot {
        let (basis, journal) = self.take_journal();
        Builder::new(self, settings, Some(previous), Some(&journal)).build(basis)
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

pub(super) struct Builder<'a> {
    pub(super) index: &'a Index,
    pub(super) settings: &'a Settings,
    pub(super) previous: Option<&'a Snapshot>,
    /// What changed since `previous`, when known.
    pub(super) journal: Option<&'a Journal>,
    /// Problems not of a served group (see `Snapshot::base_problems`); a group's are collected apart.
    problems: Vec<Problem>,
    skipped: BTreeMap<String, String>,
    not_served: BTreeMap<String, NotServed>,
    /// Which Cluster's groups this build serves.
    pub(super) scope: Scope,
    /// Candidate groups left out because they belong to another Cluster.
    out_of_scope: usize,
}

/// What a group's template was built from, and what came of it.
#[derive(Clone, Debug)]
pub(super) struct TemplateMemo {
    resource: Arc<ScalableResource>,
    infra: InfraInput,
    /// The labels templates copy from an existing Node of the group.
    pub(super) node_labels: Vec<(String, String)>,
    /// The zone of the template's failure domain, from the Nodes in it.
    pub(super) failure_domain_zone: Option<FailureDomainZone>,
    pub(super) template: Option<Arc<TemplateNode>>,
    pub(super) problems: Vec<Problem>,
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

impl<'a> Builder<'a> {
    /// The cached Machines and Nodes the instances are read from.
    pub(super) fn machines(&self) -> MachineView<'a> {
        MachineView {
            index: self.index,
            delete_key: &self.settings.keys.delete_machine,
        }
    }

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
            .resources()
            .iter()
            .filter_map(|((_, key), parsed)| {
                let resource = parsed.as_ref().ok()?;
                (owners::deployment_of(resource).is_none()
                    && discovery::allowed(
                        &settings.discovery,
                        &key.namespace,
                        &resource.cluster_name,
                        &resource.labels,
                    )
                    && capi::has_bounds(&settings.keys, resource))
                .then(|| ObjectKey::new(key.namespace.as_str(), resource.cluster_name.as_str()))
            })
            .collect()
    }

    fn skip(&mut self, id: String, reason: NotServed, why: impl Into<String>) {
        self.not_served.insert(id.clone(), reason);
        self.skipped.insert(id, why.into());
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
            let id = GroupId::new(kind, namespace, name).to_string();
            served.contains_key(&id).then_some(id)
        };
        if kind != ScalableKind::MachineSet {
            return serving(kind, name);
        }
        self.index
            .resource(ScalableKind::MachineSet, &ObjectKey::new(namespace, name))
            .and_then(|ms| owners::deployment_of(ms))
            .and_then(|md| serving(ScalableKind::MachineDeployment, md))
            .or_else(|| serving(ScalableKind::MachineSet, name))
    }

    /// MachineSets by the MachineDeployment whose rollout they take part in (namespace, name; see
    /// [`owners::rollout_deployment_of`]).
    fn machine_sets_by_deployment(&self) -> HashMap<(&'a str, &'a str), Vec<&'a ScalableResource>> {
        let index: &'a Index = self.index;
        let mut sets: HashMap<(&'a str, &'a str), Vec<&'a ScalableResource>> = HashMap::new();
        let machine_sets = index
            .resources()
            .range((ScalableKind::MachineSet, ObjectKey::new("", ""))..)
            .take_while(|((kind, _), _)| *kind == ScalableKind::MachineSet);
        for ((_, key), parsed) in machine_sets {
            let Ok(ms) = parsed else {
                continue;
            };
            if let Some(md) = owners::rollout_deployment_of(&self.settings.keys, ms) {
                sets.entry((key.namespace.as_str(), md))
                    .or_default()
                    .push(ms.as_ref());
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
        let cluster = self.index.cluster(&cluster_key)?;
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
        let cluster = self.index.cluster(&cluster_key)?;
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
            object_name("Cluster", &cluster_key),
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
                match index.infra_kind_state(&kind) {
                    None | Some(InfraKindState::Syncing) => InfraInput::Unavailable(format!(
                        "{what}: the watch of {} has not listed yet",
                        reference.kind
                    )),
                    Some(InfraKindState::Unavailable(why)) => InfraInput::Unavailable(format!(
                        "{what}: cannot read {}: {why}",
                        reference.kind
                    )),
                    Some(InfraKindState::Synced) => match index.infra(&kind, &key) {
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
    pub(super) fn collecting<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> (T, Vec<Problem>) {
        let outer = std::mem::take(&mut self.problems);
        let value = f(self);
        let inner = std::mem::replace(&mut self.problems, outer);
        (value, inner)
    }

    /// min, max and target of a resource that is a served group. `None` for one that is not a
    /// candidate, and for a candidate that is not served: why is recorded (`skip`) and, when the
    /// objects are at fault, a problem.
    fn served_sizes(
        &mut self,
        id: &str,
        object: &crate::problem::Subject,
        key: &ObjectKey,
        resource: &ScalableResource,
    ) -> Option<(i32, i32, i32)> {
        let settings: &'a Settings = self.settings;
        let keys = &settings.keys;
        if owners::deployment_of(resource).is_some() {
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
        if capi::has_bounds(keys, resource)
            && let Some(why) = self.scope.refusal(&cluster)
        {
            self.problems
                .push(Problem::new(object, "spec.clusterName", why.clone()));
            self.skip(id.to_string(), NotServed::OtherCluster, why);
            self.out_of_scope += 1;
            return None;
        }
        let bounds = capi::scaling_bounds(keys, &resource.annotations)
            .map_err(|e| Problem::new(object, e.field, e.message));
        let (min, max) = match bounds {
            Ok(Some(bounds)) => bounds,
            Ok(None) => return None,
            Err(problem) => {
                self.skip(
                    id.to_string(),
                    NotServed::Bounds,
                    format!("{}: {}", problem.field, problem.message),
                );
                self.problems.push(problem);
                return None;
            }
        };
        if max == 0 {
            self.skip(id.to_string(), NotServed::MaxZero, "max size is 0");
            return None;
        }
        if let Some((field, why)) = self.pause_of(resource) {
            self.problems
                .push(Problem::new(object, field, why.clone()).with_kind(ProblemKind::Paused));
            self.skip(id.to_string(), NotServed::Paused, why);
            return None;
        }
        // Served, every decrement would be undone by the topology controller and the marked
        // Machine kept: a node CA was answered OK for would stay.
        if let Some(problem) = self.topology_conflict(resource) {
            let why = format!("{}: {}", problem.field, problem.message);
            self.problems.push(problem);
            self.skip(id.to_string(), NotServed::Topology, why);
            return None;
        }
        let Some(target) = resource.replicas else {
            let problem = Problem::new(
                object,
                "spec.replicas",
                "not set: the group has no target size",
            );
            self.skip(
                id.to_string(),
                NotServed::ReplicasUnset,
                format!("{}: {}", problem.field, problem.message),
            );
            self.problems.push(problem);
            return None;
        };
        Some((min, max, target))
    }

    /// The group a resource is, without its instances and template, and the group's own problems; or
    /// `None` for a resource that is not a served group (problems of those go to `self.problems`).
    pub(super) fn served_group(
        &mut self,
        kind: ScalableKind,
        key: &ObjectKey,
        resource: &Arc<ScalableResource>,
        sets_by_deployment: &HashMap<(&'a str, &'a str), Vec<&'a ScalableResource>>,
    ) -> Option<(NodeGroup, Vec<Problem>)> {
        let id = GroupId::of(kind, key).to_string();
        let object = object_name(kind, key);
        let (min, max, target) = self.served_sizes(&id, &object, key, resource)?;
        let (group, problems) = self.collecting(|b| {
            let keys = &b.settings.keys;
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
    pub(super) fn template_memo(
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
        let sets_by_deployment = self.machine_sets_by_deployment();
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
            &self.index.cluster_keys(),
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
        let found = self.machines_by_group(&groups, &mut lookup);
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
        for ((kind, key), parsed) in index.resources() {
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
        lookup: &mut Lookup,
    ) -> GroupMachines {
        let mut found = GroupMachines::default();
        let index: &'a Index = self.index;
        let keys = &self.settings.keys;
        // Many Machines share an owner: each owner is resolved to its group once per build.
        let mut owner_groups: HashMap<(&str, ScalableKind, &str), Option<String>> = HashMap::new();
        for (key, parsed) in index.machines() {
            let machine = match parsed {
                Ok(m) => m,
                Err(problem) => {
                    self.problems.push(problem.clone());
                    continue;
                }
            };
            let Some(owner) = owners::machine_owner(keys, machine) else {
                continue;
            };
            let namespace = machine.key.namespace.as_str();
            let resolved = owner_groups
                .entry((namespace, owner.0, owner.1))
                .or_insert_with(|| self.owner_group(namespace, owner, groups));
            let fallback = || {
                let md = owners::machine_deployment_label(keys, machine)?;
                let id = GroupId::new(ScalableKind::MachineDeployment, namespace, md).to_string();
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
            match self.machines().instance_of(machine) {
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
            self.machines()
                .mark_leaving(&mut list, unlisted, group.target);
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
            group.foreign_marks = self
                .machines()
                .foreign_marks(&group.instances, &group.unlisted);
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
        for machine in self
            .index
            .machines()
            .values()
            .filter_map(|m| m.as_ref().ok())
        {
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
                .and_then(|name| self.index.nodes().get(name))
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
            .nodes()
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
    pub(super) fn finish(
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
            machines: self.index.machines().len(),
        }
    }
}
