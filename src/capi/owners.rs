//! Which object a MachineSet or a Machine belongs to, as Cluster API decides it. One function per
//! rule: the snapshot asks these wherever it groups MachineSets and Machines.
//!
//! Cluster API's MachineDeployment controller creates every MachineSet with its owner reference and
//! adopts a matching orphan by adding one; the in-tree provider reads only that reference
//! (`machineSetHasMachineDeploymentOwnerRef`: kind and a non-empty name), so a MachineSet whose owner
//! reference is gone (orphaned) is a node group of its own there and here. A Machine's labels may be
//! present and empty; an empty name names nothing.

use super::{Keys, Machine, ScalableKind, ScalableResource};

const MACHINE_DEPLOYMENT: &str = "MachineDeployment";

/// The MachineDeployment a MachineSet belongs to: the one its owner reference names. `None` for a
/// MachineSet of no MachineDeployment (whatever its labels say), for a resource of another kind, and
/// for an empty name.
pub fn deployment_of(machine_set: &ScalableResource) -> Option<&str> {
    if machine_set.kind != ScalableKind::MachineSet {
        return None;
    }
    machine_set
        .owners
        .iter()
        .find(|o| o.kind == MACHINE_DEPLOYMENT && !o.name.is_empty())
        .map(|o| o.name.as_str())
}

/// The MachineDeployment whose rollout a MachineSet takes part in: the one its owner reference names,
/// else, owned by no MachineDeployment, the one its `deployment-name` label names (the MachineSets that
/// MachineDeployment's selector matches, which Cluster API adopts). Empty names name nothing.
pub fn rollout_deployment_of<'a>(
    keys: &Keys,
    machine_set: &'a ScalableResource,
) -> Option<&'a str> {
    if machine_set.kind != ScalableKind::MachineSet {
        return None;
    }
    deployment_of(machine_set)
        .or_else(|| named(machine_set.labels.get(&keys.deployment_name_label)))
}

/// What a Machine points at: its MachinePool, else its MachineSet (each by owner reference, else by
/// label), else the MachineDeployment its `deployment-name` label names. Empty names point nowhere.
pub fn machine_owner<'a>(keys: &Keys, machine: &'a Machine) -> Option<(ScalableKind, &'a str)> {
    let owner = |kind: &str| {
        machine
            .owners
            .iter()
            .find(|o| o.kind == kind && !o.name.is_empty())
            .map(|o| o.name.as_str())
    };
    let label = |key: &str| named(machine.labels.get(key));
    if let Some(pool) = owner("MachinePool").or_else(|| label(&keys.pool_name_label)) {
        return Some((ScalableKind::MachinePool, pool));
    }
    if let Some(set) = owner("MachineSet").or_else(|| label(&keys.set_name_label)) {
        return Some((ScalableKind::MachineSet, set));
    }
    machine_deployment_label(keys, machine).map(|md| (ScalableKind::MachineDeployment, md))
}

/// The MachineDeployment a Machine's `deployment-name` label names, if not empty: where its Machines
/// go when their MachineSet is not known.
pub fn machine_deployment_label<'a>(keys: &Keys, machine: &'a Machine) -> Option<&'a str> {
    named(machine.labels.get(&keys.deployment_name_label))
}

/// A label's value as a name: an empty one names nothing.
fn named(value: Option<&str>) -> Option<&str> {
    value.filter(|name| !name.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::OwnerRef;
    use crate::capi::test_fixtures::resource;

    fn owner(kind: &str, name: &str) -> OwnerRef {
        OwnerRef {
            kind: kind.into(),
            name: name.into(),
        }
    }

    fn machine_set(owners: Vec<OwnerRef>, label: Option<&str>) -> ScalableResource {
        let keys = Keys::default();
        let mut ms = resource(ScalableKind::MachineSet, "ms");
        ms.owners = owners;
        if let Some(label) = label {
            ms.labels
                .insert(keys.deployment_name_label.clone(), label.into());
        }
        ms
    }

    /// `machine` with label `key` set to `value`.
    fn label(machine: &mut Machine, key: &str, value: &str) {
        machine.labels = machine.labels.iter().chain([(key, value)]).collect();
    }

    fn machine() -> Machine {
        crate::capi::test_fixtures::machine("m")
    }

    #[test]
    fn a_machine_set_belongs_to_the_deployment_its_owner_reference_names_never_its_label() {
        let owned = machine_set(vec![owner("MachineDeployment", "md")], None);
        assert_eq!(deployment_of(&owned), Some("md"));
        let labelled = machine_set(Vec::new(), Some("md"));
        assert_eq!(deployment_of(&labelled), None);
        // Controlled by one, matched by another's selector: Cluster API leaves it to its controller.
        let both = machine_set(vec![owner("MachineDeployment", "a")], Some("b"));
        assert_eq!(deployment_of(&both), Some("a"));
        assert_eq!(rollout_deployment_of(&Keys::default(), &both), Some("a"));
        assert_eq!(
            rollout_deployment_of(&Keys::default(), &labelled),
            Some("md"),
            "the selector's MachineSets take part in the rollout before Cluster API adopts them"
        );
        let other_owner = machine_set(vec![owner("Cluster", "c1")], None);
        assert_eq!(deployment_of(&other_owner), None);
        let mut not_a_set = machine_set(vec![owner("MachineDeployment", "md")], Some("md"));
        not_a_set.kind = ScalableKind::MachineDeployment;
        assert_eq!(deployment_of(&not_a_set), None);
    }

    #[test]
    fn an_empty_owner_name_owns_nothing() {
        let keys = Keys::default();
        let empty_owner = machine_set(vec![owner("MachineDeployment", "")], Some("md"));
        assert_eq!(deployment_of(&empty_owner), None);
        assert_eq!(rollout_deployment_of(&keys, &empty_owner), Some("md"));
        let empty_label = machine_set(Vec::new(), Some(""));
        assert_eq!(rollout_deployment_of(&keys, &empty_label), None);

        let mut machine = machine();
        label(&mut machine, &keys.pool_name_label, "");
        machine.owners = vec![owner("MachineSet", "ms")];
        assert_eq!(
            machine_owner(&keys, &machine),
            Some((ScalableKind::MachineSet, "ms")),
            "an empty pool-name label does not hide the MachineSet"
        );
        machine.owners.clear();
        label(&mut machine, &keys.set_name_label, "");
        label(&mut machine, &keys.deployment_name_label, "md");
        assert_eq!(
            machine_owner(&keys, &machine),
            Some((ScalableKind::MachineDeployment, "md"))
        );
        label(&mut machine, &keys.deployment_name_label, "");
        assert_eq!(machine_owner(&keys, &machine), None);
        assert_eq!(machine_deployment_label(&keys, &machine), None);
    }

    #[test]
    fn a_machine_points_at_its_pool_then_its_set_then_its_deployment() {
        let keys = Keys::default();
        let mut machine = machine();
        label(&mut machine, &keys.deployment_name_label, "md");
        label(&mut machine, &keys.set_name_label, "ms-label");
        assert_eq!(
            machine_owner(&keys, &machine),
            Some((ScalableKind::MachineSet, "ms-label"))
        );
        machine.owners = vec![owner("MachineSet", "ms")];
        assert_eq!(
            machine_owner(&keys, &machine),
            Some((ScalableKind::MachineSet, "ms"))
        );
        machine.owners.push(owner("MachinePool", "mp"));
        assert_eq!(
            machine_owner(&keys, &machine),
            Some((ScalableKind::MachinePool, "mp"))
        );
    }
}
