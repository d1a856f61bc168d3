//! The Machines of the served groups: each one's group through its owner, the instances CA sees,
//! and the lookups that find a node's group and Machine.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::Builder;
use crate::cache::Index;
use crate::capi::{Name, ObjectKey, ScalableKind, owners, providerid};
use crate::problem::Problem;
use crate::snapshot::instances::{held_instances, is_synthetic};
use crate::snapshot::{GroupId, Instance, InstanceState, Location, Lookup, NodeGroup, object_name};

/// Normalised providerIDs → locations, for nodes whose providerID is spelled differently from the
/// Machine's; an id that normalises to two different places is left out.
pub(super) fn normalized_ids(lookup: &Lookup) -> HashMap<Name, u32> {
    let mut by_normalized_id: HashMap<Name, u32> = HashMap::new();
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
        // An id that is its own normal form is the same string, kept once.
        let normalized = if normalized.len() == id.len() {
            id.clone()
        } else {
            Name::from(normalized)
        };
        by_normalized_id.insert(normalized, at);
    }
    for normalized in ambiguous {
        by_normalized_id.remove(normalized.as_str());
    }
    by_normalized_id
}

/// The Machines a build found for each served group.
#[derive(Default)]
pub(super) struct GroupMachines {
    /// Group id → the instances of its Machines.
    instances: BTreeMap<Name, Vec<Instance>>,
    /// Group id → its Machines with a Node but no providerID, so no instance (counted as
    /// registered).
    unlisted: BTreeMap<Name, Vec<ObjectKey>>,
}

impl<'a> Builder<'a> {
    /// The served group behind a Machine's owner: a MachineSet owned by a served MachineDeployment
    /// belongs to that MachineDeployment.
    fn owner_group(
        &self,
        namespace: &str,
        (kind, name): (ScalableKind, &str),
        served: &BTreeMap<String, NodeGroup>,
    ) -> Option<Name> {
        let serving = |kind: ScalableKind, name: &str| {
            let id = GroupId::new(kind, namespace, name).to_string();
            served.contains_key(&id).then(|| Name::from(id))
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

    /// Every Machine of a served group, through its owner (a MachineSet not cached or not served
    /// falls back to the Machine's deployment label); each gets its location in `lookup`.
    pub(super) fn machines_by_group(
        &mut self,
        groups: &BTreeMap<String, NodeGroup>,
        lookup: &mut Lookup,
    ) -> GroupMachines {
        let mut found = GroupMachines::default();
        let index: &'a Index = self.index;
        let keys = &self.settings.keys;
        // Many Machines share an owner: each owner is resolved to its group once per build.
        let mut owner_groups: HashMap<(&str, ScalableKind, &str), Option<Name>> = HashMap::new();
        for (key, parsed) in index.machines() {
            let machine = match parsed {
                Ok(m) => m,
                Err(problem) => {
                    self.problems.push(Problem::clone(problem));
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
                groups.contains_key(&id).then(|| Name::from(id))
            };
            let group_id = match resolved {
                Some(id) => id.clone(),
                None if owner.0 == ScalableKind::MachineSet => match fallback() {
                    Some(id) => id,
                    None => continue,
                },
                None => continue,
            };
            let at = lookup.push(Location {
                group_id: group_id.clone(),
                machine: Some(key.clone()),
                in_pool_list: false,
            });
            lookup.by_machine.insert(key.clone(), at);
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
    pub(super) fn attach_instances(
        &mut self,
        groups: &mut BTreeMap<String, NodeGroup>,
        mut found: GroupMachines,
        lookup: &mut Lookup,
    ) {
        for (id, group) in groups.iter_mut() {
            // The group's id as its Machines' locations share it.
            let (name, mut list) = found
                .instances
                .remove_entry(id.as_str())
                .unwrap_or_else(|| (Name::from(id.as_str()), Vec::new()));
            if group.kind() == ScalableKind::MachinePool {
                let known: BTreeSet<Name> = list.iter().map(|i| i.id.clone()).collect();
                for provider_id in &group.resource.provider_id_list {
                    if !provider_id.is_empty() && !known.contains(provider_id.as_str()) {
                        list.push(Instance {
                            id: Name::from(provider_id),
                            state: InstanceState::Running,
                            error: None,
                            machine: None,
                        });
                    }
                }
            }
            list.sort_by(|a, b| a.id.cmp(&b.id));
            list.dedup_by(|a, b| a.id == b.id);
            let unlisted = found.unlisted.get(id.as_str()).map_or(0, Vec::len);
            let held = held_instances(group, &list, unlisted);
            self.machines()
                .mark_leaving(&mut list, unlisted, group.target);
            list.extend(held);
            list.shrink_to_fit();
            let pool: BTreeSet<&str> = group
                .resource
                .provider_id_list
                .iter()
                .map(String::as_str)
                .collect();
            for instance in &list {
                let at = lookup.place(&name, instance, pool.contains(instance.id.as_str()));
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
                + unlisted as i32;
            group.instances = list;
            group.unlisted = found.unlisted.remove(id.as_str()).unwrap_or_default();
            let marks = self.machines().marks(&group.instances, &group.unlisted);
            (group.foreign_marks, group.marked) = (marks.foreign, marks.any);
        }
    }
}
