//! The incremental patch: after changes local to some groups (the provider's own writes of replicas
//! and delete marks, see `crate::cache::Journal`), only those groups are rebuilt and everything else,
//! lookups included, is shared with the previous snapshot.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use super::build::Builder;
use super::instances::held_instances;
use super::{GroupId, Instance, InstanceState, NodeGroup, Snapshot};
use crate::cache::{Index, Journal};
use crate::capi::{ScalableKind, ScalableResource, owners};

impl<'a> Builder<'a> {
    /// The snapshot after changes local to some groups (see [`crate::cache::Journal`]): those groups
    /// are rebuilt, everything else is taken from the previous snapshot. `None` when the changes are
    /// of another kind, or the previous snapshot is not the one they are relative to.
    pub(super) fn patch(&mut self, basis: u64) -> Option<Snapshot> {
        let (previous, journal) = (self.previous?, self.journal?);
        if journal.builds_whole_after(previous.basis) {
            return None;
        }
        self.scope = previous.scope.clone();
        let affected = self.affected_groups(previous, journal);
        let sets_by_deployment = self.current_machine_sets(previous, &affected);
        let mut groups = previous.groups.clone();
        let mut templates = previous.templates.clone();
        let mut group_problems = previous.group_problems.clone();
        for id in affected {
            let old = previous.groups.get(id)?;
            let (kind, key) = (old.kind(), &old.resource.key);
            let resource = self.index.resource(kind, key)?;
            let (rebuilt, base) =
                self.collecting(|b| b.served_group(kind, key, resource, &sets_by_deployment));
            let (mut group, mut problems) = rebuilt?;
            if !base.is_empty() || group.id.as_str() != id.as_ref() {
                return None;
            }
            self.same_instances_again(old, &mut group)?;
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
            groups.replace(group)?;
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

    /// The served groups the journal's changes touch, by the id the previous snapshot shares (which
    /// the rebuilt group keeps): the changed resources' groups, a changed MachineSet's
    /// MachineDeployment (its rollout), the changed Machines' groups.
    fn affected_groups(&self, previous: &'a Snapshot, journal: &Journal) -> BTreeSet<&'a Arc<str>> {
        let index = self.index;
        let mut affected: BTreeSet<&'a Arc<str>> = BTreeSet::new();
        let mut served = |id: String| {
            if let Some(id) = previous.groups.shared_id(id.as_str()) {
                affected.insert(id);
            }
        };
        for (kind, key) in &journal.resources {
            served(GroupId::of(*kind, key).to_string());
            if *kind == ScalableKind::MachineSet
                && let Some(set) = index.resource(*kind, key)
                && let Some(md) = owners::rollout_deployment_of(&self.settings.keys, set)
            {
                served(
                    GroupId::new(ScalableKind::MachineDeployment, &key.namespace, md).to_string(),
                );
            }
        }
        for key in &journal.machines {
            if let Some(location) = previous
                .lookup
                .by_machine
                .get(key)
                .and_then(|at| previous.lookup.locations.get(*at as usize))
            {
                served(location.group_id.to_string());
            }
        }
        affected
    }

    /// The MachineSets of the MachineDeployments among `affected`, as they are now (their rollout
    /// state): a patch never changes which belong to which, so the previous snapshot's lists hold.
    fn current_machine_sets(
        &self,
        previous: &'a Snapshot,
        affected: &BTreeSet<&'a Arc<str>>,
    ) -> HashMap<(&'a str, &'a str), Vec<&'a ScalableResource>> {
        let index: &'a Index = self.index;
        affected
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
            .collect()
    }

    /// `group`'s instances from `old`'s: same Machines, same ids, their states again, then the marks
    /// against the new target and the held-back instances made again. `None` when an instance's id
    /// changed or the held-back ones differ: other ids than before need a new lookup.
    fn same_instances_again(&self, old: &NodeGroup, group: &mut NodeGroup) -> Option<()> {
        let index = self.index;
        let is_held =
            |i: &Instance| i.machine.is_none() && crate::capi::preflight::is_held_id(&i.id);
        let mut list = Vec::with_capacity(old.instances.len());
        for instance in old.instances.iter().filter(|i| !is_held(i)) {
            match &instance.machine {
                Some(machine) => {
                    let fresh = self.machines().instance_of(index.machine(machine)?)?;
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
        // Machines with a Node but no providerID stay with the group (the removal counts and the
        // repair read them); one that has an id now is an instance: built from scratch.
        for key in &old.unlisted {
            if self.machines().instance_of(index.machine(key)?).is_some() {
                return None;
            }
        }
        group.unlisted = old.unlisted.clone();
        let held = held_instances(group, &list, group.unlisted.len());
        let old_held = old.instances.iter().filter(|i| is_held(i)).map(|i| &i.id);
        if held.iter().map(|i| &i.id).ne(old_held) {
            return None;
        }
        self.machines()
            .mark_leaving(&mut list, group.unlisted.len(), group.target);
        list.extend(held);
        let running = list
            .iter()
            .filter(|i| i.state == InstanceState::Running)
            .count();
        group.registered = running as i32 + group.unlisted.len() as i32;
        let marks = self.machines().marks(&list, &group.unlisted);
        (group.foreign_marks, group.marked) = (marks.foreign, marks.any);
        group.instances = list;
        Some(())
    }
}
