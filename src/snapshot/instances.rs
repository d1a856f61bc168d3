//! What CA sees of a group's Machines, for the build and the patch alike: the instance of a Machine,
//! marked Machines leaving, delete marks of others, and the capacity preflight checks hold back.

use super::{
    DELETING_PREFIX, FAILED_PREFIX, Instance, InstanceError, InstanceState, NodeGroup,
    OTHER_ERROR_CLASS, PENDING_PREFIX,
};
use crate::cache::Index;
use crate::capi::{Machine, Name, ObjectKey};

/// A group's delete marks ([`MachineView::marks`]).
#[derive(Default)]
pub(super) struct Marks {
    pub foreign: Vec<String>,
    pub any: bool,
}

/// The cached Machines and Nodes a group's instances are read from.
#[derive(Clone, Copy)]
pub(super) struct MachineView<'a> {
    pub index: &'a Index,
    /// The delete-machine annotation's key.
    pub delete_key: &'a str,
}

impl MachineView<'_> {
    /// The delete marks on the Machines of `instances` and `unlisted`: those (not being deleted)
    /// this provider did not write, by name, and whether any of them (being deleted or not) carries
    /// one, anyone's.
    pub(super) fn marks(&self, instances: &[Instance], unlisted: &[ObjectKey]) -> Marks {
        let mut marks = Marks::default();
        let members = instances
            .iter()
            .filter_map(|i| i.machine.as_ref())
            .chain(unlisted);
        for key in members {
            let Some(machine) = self.index.machines().get(key).and_then(|m| m.as_ref().ok()) else {
                continue;
            };
            let Some(mark) = machine.annotations.get(self.delete_key) else {
                continue;
            };
            marks.any = true;
            if !machine.deleting && !crate::protocol::is_our_mark(mark) {
                marks.foreign.push(key.name.to_string());
            }
        }
        marks
    }

    /// Marked Machines that the replica count no longer covers are on their way out: CAPI deletes
    /// marked Machines first when replicas drop below the Machines it has. Reported as deleting, CA
    /// stops counting them: an unregistered one is otherwise "removed" again every loop and its
    /// group scaled up again for the capacity CA believes it lost. A mark replicas still cover (a
    /// decrement not yet written) leaves the instance as it was, so CA's retry can complete it.
    /// Every member counts toward the Machines beyond replicas, as in the removal rules: a
    /// MachinePool's instances without a Machine, and the `unlisted` Machines (a Node, no
    /// providerID).
    pub(super) fn mark_leaving(&self, list: &mut [Instance], unlisted: usize, target: i32) {
        let delete_key = self.delete_key;
        let active = list
            .iter()
            .filter(|i| i.state != InstanceState::Deleting)
            .count()
            + unlisted;
        let mut surplus = crate::protocol::surplus(active, target);
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
                .and_then(|key| self.index.machines().get(key))
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
    pub(super) fn instance_of(&self, machine: &Machine) -> Option<Instance> {
        let provider_id = machine.provider_id.clone().or_else(|| {
            machine
                .node_ref
                .as_deref()
                .and_then(|name| self.index.nodes().get(name))
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

/// The made-up instance id of a Machine without a providerID.
fn synthetic_id(prefix: &str, key: &ObjectKey) -> Name {
    // `_` cannot occur in a namespace, so the first one separates namespace and name.
    Name::from(format!("{prefix}{}_{}", key.namespace, key.name))
}

/// The instances Cluster API's preflight checks hold back in `group` (none without a hold): its
/// replicas beyond its Machines not being deleted (`list`'s, and `unlisted` Machines with a Node
/// but no providerID), each being created with the hold as its error.
pub(super) fn held_instances(
    group: &NodeGroup,
    list: &[Instance],
    unlisted: usize,
) -> Vec<Instance> {
    let Some(hold) = &group.preflight else {
        return Vec::new();
    };
    let machines = list
        .iter()
        .filter(|i| i.machine.is_some() && i.state != InstanceState::Deleting)
        .count()
        + unlisted;
    let count = crate::capi::preflight::held_count(group.target, machines);
    // Class "other": CA backs the group off the same for either class, and nothing is out of
    // resources.
    let error = InstanceError {
        code: crate::capi::preflight::error_code(hold),
        message: crate::capi::preflight::error_message(&group.id, hold),
        class: OTHER_ERROR_CLASS,
    };
    let key = &group.resource.key;
    crate::capi::preflight::held_ids(group.kind().as_str(), &key.namespace, &key.name, count)
        .into_iter()
        .map(|id| Instance {
            id: Name::from(id),
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

pub(super) fn is_synthetic(id: &str) -> bool {
    [PENDING_PREFIX, FAILED_PREFIX, DELETING_PREFIX]
        .iter()
        .any(|p| id.starts_with(p))
}
