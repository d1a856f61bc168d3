//! Which resources are served node groups: discovery, scope, bounds, pause, replicas; each served
//! group's options, price, rollout and preflight hold, and its own problems.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use super::Builder;
use crate::cache::Index;
use crate::capi::rollout::{self, REVISION_ANNOTATION, Rollout};
use crate::capi::{self, ObjectKey, ScalableKind, ScalableResource, owners};
use crate::discovery;
use crate::encoded::Encoded;
use crate::options;
use crate::pricing;
use crate::problem::{Problem, ProblemKind};
use crate::snapshot::{GroupId, NodeGroup, NotServed, Settings, object_name};

impl<'a> Builder<'a> {
    /// The Clusters of the resources that would be node groups but for their Cluster: discovery
    /// selects them and they carry a bound annotation.
    pub(super) fn candidate_clusters(&self) -> BTreeSet<ObjectKey> {
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

    /// MachineSets by the MachineDeployment whose rollout they take part in (namespace, name; see
    /// [`owners::rollout_deployment_of`]).
    pub(super) fn machine_sets_by_deployment(
        &self,
    ) -> HashMap<(&'a str, &'a str), Vec<&'a ScalableResource>> {
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
    pub(in crate::snapshot) fn served_group(
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
                marked: false,
                registered: 0,
                template: None,
                options,
                price,
                rollout,
                preflight,
                encoded: Encoded::default(),
            }
        });
        Some((group, problems))
    }

    /// The served groups (by id) and each one's own problems; a resource that could not be read is
    /// a problem of the snapshot.
    pub(super) fn candidate_groups(
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
                    self.problems.push(Problem::clone(problem));
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
}
