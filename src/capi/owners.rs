//! Which object a MachineSet or a Machine belongs to, as Cluster API decides it. One function per
//! rule: the snapshot asks these wherever it groups MachineSets and Machines.
//!
//! Cluster API's MachineDeployment controller takes the MachineSets its selector matches (the
//! `deployment-name` label) that it controls, and adopts those no MachineDeployment controls; it
//! creates every MachineSet with its owner reference. Owner references need a name (the parser
//! refuses an empty one); a label may be present and empty, and an empty name names nothing.

use super::{Keys, Machine, ScalableKind, ScalableResource};

const MACHINE_DEPLOYMENT: &str = "MachineDeployment";

/// The MachineDeployment a MachineSet belongs to: the one its owner reference names, else the one its
/// `deployment-name` label names (a MachineSet Cluster API adopts). `None` for a MachineSet of no
/// MachineDeployment, for a resource of another kind, and for empty names.
pub fn deployment_of<'a>(keys: &Keys, machine_set: &'a ScalableResource) -> Option<&'a str> {
    if machine_set.kind != ScalableKind::MachineSet {
        return None;
    }
    let owner = machine_set
        .owners
        .iter()
        .find(|o| o.kind == MACHINE_DEPLOYMENT && !o.name.is_empty())
        .map(|o| o.name.as_str());
    owner.or_else(|| named(&machine_set.labels, &keys.deployment_name_label))
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
    let label = |key: &str| named(&machine.labels, key);
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
    named(&machine.labels, &keys.deployment_name_label)
}

fn named<'a>(labels: &'a std::collections::BTreeMap<String, String>, key: &str) -> Option<&'a str> {
    labels
        .get(key)
        .map(String::as_str)
        .filter(|name| !name.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::{MachineTemplate, ObjectKey, OwnerRef};
    use std::collections::BTreeMap;

    fn owner(kind: &str, name: &str) -> OwnerRef {
        OwnerRef {
            kind: kind.into(),
            name: name.into(),
        }
    }

    fn machine_set(owners: Vec<OwnerRef>, label: Option<&str>) -> ScalableResource {
        let keys = Keys::default();
        let mut ms = ScalableResource {
            kind: ScalableKind::MachineSet,
            key: ObjectKey::new("ns", "ms"),
            uid: String::new(),
            resource_version: "1".into(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            cluster_name: "c1".into(),
            replicas: Some(0),
            status_replicas: None,
            rolling_out: false,
            preflight: None,
            paused: false,
            owners,
            template: MachineTemplate::default(),
            provider_id_list: Vec::new(),
            topology: None,
        };
        if let Some(label) = label {
            ms.labels
                .insert(keys.deployment_name_label.clone(), label.into());
        }
        ms
    }

    fn machine() -> Machine {
        Machine {
            key: ObjectKey::new("ns", "m"),
            uid: String::new(),
            resource_version: "1".into(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            cluster_name: "c1".into(),
            provider_id: None,
            node_ref: None,
            failure_domain: None,
            deleting: false,
            owners: Vec::new(),
            phase: None,
            failure: None,
            conditions_unhealthy: false,
        }
    }

    #[test]
    fn a_machine_set_belongs_to_the_deployment_its_owner_reference_names_else_its_label() {
        let keys = Keys::default();
        let owned = machine_set(vec![owner("MachineDeployment", "md")], None);
        assert_eq!(deployment_of(&keys, &owned), Some("md"));
        let labelled = machine_set(Vec::new(), Some("md"));
        assert_eq!(deployment_of(&keys, &labelled), Some("md"));
        // Controlled by one, matched by another's selector: Cluster API leaves it to its controller.
        let both = machine_set(vec![owner("MachineDeployment", "a")], Some("b"));
        assert_eq!(deployment_of(&keys, &both), Some("a"));
        let other_owner = machine_set(vec![owner("Cluster", "c1")], None);
        assert_eq!(deployment_of(&keys, &other_owner), None);
        let mut not_a_set = machine_set(vec![owner("MachineDeployment", "md")], Some("md"));
        not_a_set.kind = ScalableKind::MachineDeployment;
        assert_eq!(deployment_of(&keys, &not_a_set), None);
    }

    #[test]
    fn an_empty_owner_name_owns_nothing() {
        let keys = Keys::default();
        assert_eq!(
            deployment_of(&keys, &machine_set(Vec::new(), Some(""))),
            None
        );
        let empty_owner = machine_set(vec![owner("MachineDeployment", "")], None);
        assert_eq!(deployment_of(&keys, &empty_owner), None);
        // An empty owner reference gives way to the label.
        let empty_then_label = machine_set(vec![owner("MachineDeployment", "")], Some("md"));
        assert_eq!(deployment_of(&keys, &empty_then_label), Some("md"));

        let mut machine = machine();
        machine
            .labels
            .insert(keys.pool_name_label.clone(), String::new());
        machine.owners = vec![owner("MachineSet", "ms")];
        assert_eq!(
            machine_owner(&keys, &machine),
            Some((ScalableKind::MachineSet, "ms")),
            "an empty pool-name label does not hide the MachineSet"
        );
        machine.owners.clear();
        machine
            .labels
            .insert(keys.set_name_label.clone(), String::new());
        machine
            .labels
            .insert(keys.deployment_name_label.clone(), "md".into());
        assert_eq!(
            machine_owner(&keys, &machine),
            Some((ScalableKind::MachineDeployment, "md"))
        );
        machine
            .labels
            .insert(keys.deployment_name_label.clone(), String::new());
        assert_eq!(machine_owner(&keys, &machine), None);
        assert_eq!(machine_deployment_label(&keys, &machine), None);
    }

    #[test]
    fn a_machine_points_at_its_pool_then_its_set_then_its_deployment() {
        let keys = Keys::default();
        let mut machine = machine();
        machine
            .labels
            .insert(keys.deployment_name_label.clone(), "md".into());
        machine
            .labels
            .insert(keys.set_name_label.clone(), "ms-label".into());
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
