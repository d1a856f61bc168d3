//! The read every decision of the protocol starts from: the group object, its MachineSets and its
//! Cluster, then its namespace's Machines, each read from the API and recorded in the cache; the
//! group's holds (paused, rolling out, topology), members and what Cluster API has observed then
//! come from a snapshot built over exactly that, by the same rules the read path serves with.

use std::sync::Arc;

use kube::api::{Api, ListParams};

use super::Actuator;
use super::api::{call, other};
use crate::backend::ActuatorError;
use crate::capi::{Keys, Machine, ObjectKey, ScalableKind, ScalableResource, scaling_bounds};
use crate::protocol::ledger::{
    CLAIMS_ANNOTATION, LEDGER_ANNOTATION, RESIZES_ANNOTATION, TAKING_BACK_ANNOTATION,
};
use crate::protocol::{GroupRead, Hold, Ledger, Member, Read, Resizes, pool_node_entry};
use crate::snapshot::{NodeGroup, NotServed, Snapshot};

impl Actuator {
    /// The group and its members as the API has them now (and the group as the snapshot built over
    /// that read serves it). The group object and its Cluster are read first (GETs, answered from
    /// etcd at once), then its MachineSets and its Machines listed side by side: both lists answer
    /// at a revision after the group's, so neither the members nor what Cluster API observed are
    /// older than the group, which every rule allows for, and the two wait for the API server's
    /// cache to catch up together, not one after the other. MachineSets and Machines are listed by
    /// the label Cluster API gives a group's own (see [`Actuator::own_label`]), so a write costs
    /// the group's objects, not the namespace's. Without `members` (an operation that decides from
    /// the group object and its Cluster alone) neither MachineSets nor Machines are listed: the
    /// read has no members, and what Cluster API observed and a rollout are as cached.
    pub(super) async fn read(
        &self,
        id: &str,
        group: &NodeGroup,
        members: bool,
    ) -> Result<Read, ActuatorError> {
        let kind = group.kind();
        let key = group.resource.key.clone();
        let group_api = self.group_api(kind, &key.namespace)?;
        let cluster_api = self
            .cluster_api(&key.namespace)
            .filter(|_| !group.resource.cluster_name.is_empty());
        let (object, cluster) =
            tokio::join!(self.get(group_api, &key.name, kind.as_str()), async {
                match cluster_api {
                    Some(api) => self
                        .get(api, &group.resource.cluster_name, "Cluster")
                        .await
                        .ok(),
                    None => None,
                }
            },);
        self.store.record(Some(kind), object?);
        if let Some(cluster) = cluster {
            self.store.record_cluster(cluster);
        }
        if !members {
            // The holds come from the snapshot: built over what was just read.
            self.store.refresh();
            let mut read = self.cached_read(id, group)?;
            read.members.clear();
            return Ok(read);
        }
        let set_api = match kind {
            ScalableKind::MachineDeployment => Some(self.set_api(&key.namespace)?),
            _ => None,
        };
        let (set_selector, machine_selector) = self.own_selectors(id, group);
        let (sets, machines) = tokio::join!(
            async {
                match set_api {
                    Some(api) => self
                        .list(api, "MachineSets", &key.namespace, set_selector.as_ref())
                        .await
                        .map(Some),
                    None => Ok(None),
                }
            },
            self.list(
                self.machine_api(&key.namespace),
                "Machines",
                &key.namespace,
                machine_selector.as_ref(),
            ),
        );
        for set in sets?.map(|list| list.items).unwrap_or_default() {
            self.store.record(Some(ScalableKind::MachineSet), set);
        }
        let machines = machines?;
        self.store.record_machines(
            &key.namespace,
            machine_selector
                .as_ref()
                .map(|(k, v)| (k.as_str(), v.as_str())),
            machines.metadata.resource_version.as_deref(),
            machines.items,
        );
        self.cached_read(id, group)
    }

    /// The same read as the cache holds it now, with no API call (the repair's first look).
    pub(super) fn cached_read(&self, id: &str, group: &NodeGroup) -> Result<Read, ActuatorError> {
        let snapshot = self.store.snapshot();
        let keys = &self.store.settings().keys;
        let kind = group.kind();
        let resource = self
            .store
            .cached_resource(kind, &group.resource.key)
            .ok_or_else(|| ActuatorError::GroupNotFound { id: id.to_string() })?;
        let served = snapshot.group(id);
        let hold = hold_of(&snapshot, id, served);
        let sets: Vec<Arc<ScalableResource>> = if kind == ScalableKind::MachineDeployment {
            snapshot
                .machine_sets_of(&resource.key)
                .iter()
                .filter_map(|k| self.store.cached_resource(ScalableKind::MachineSet, k))
                .collect()
        } else {
            Vec::new()
        };
        let machines: Vec<Arc<Machine>> = served
            .into_iter()
            .flat_map(member_machines)
            .filter_map(|k| self.store.cached_machine(k))
            .collect();
        // A MachinePool's instances without a Machine are members; another group's instances
        // without one are capacity a preflight check holds, not members.
        let pool_instances: Vec<&str> = served
            .filter(|g| g.kind() == ScalableKind::MachinePool)
            .map(|g| {
                g.instances
                    .iter()
                    .filter(|i| i.machine.is_none())
                    .map(|i| i.id.as_str())
                    .collect()
            })
            .unwrap_or_default();
        let mut group_read = group_read(keys, &resource, &sets, hold);
        // A MachinePool whose infrastructure makes no Machines: its instances only appear in
        // providerIDList, so nothing could be pinned; the infrastructure picks (as upstream).
        let machineless_pool = resource.kind == ScalableKind::MachinePool && machines.is_empty();
        group_read.held = served.is_some_and(|g| g.preflight.is_some()) || machineless_pool;
        Ok(Read {
            group: group_read,
            members: members(keys, &machines, &pool_instances),
        })
    }

    async fn get(
        &self,
        api: Api<crate::object::ApiObject>,
        name: &str,
        kind: &str,
    ) -> Result<crate::object::ApiObject, ActuatorError> {
        let what = format!("reading {kind} {}/{name}", api_namespace(&api));
        call(&what, api.get(name))
            .await
            .map_err(|e| other(e, &what))
    }

    /// The selectors of the group's MachineSets and of its Machines ([`Actuator::own_label`]).
    fn own_selectors(&self, id: &str, group: &NodeGroup) -> (Selector, Selector) {
        let keys = &self.store.settings().keys;
        let snapshot = self.store.snapshot();
        let key = &group.resource.key;
        // Only a MachineDeployment's read lists MachineSets.
        let sets = match group.kind() {
            ScalableKind::MachineDeployment => Self::own_label(
                &keys.deployment_name_label,
                &key.name,
                snapshot.machine_sets_of(key).iter().map(|k| {
                    self.store
                        .cached_resource(ScalableKind::MachineSet, k)
                        .map(|s| s.labels.get(&keys.deployment_name_label).cloned())
                }),
            ),
            _ => None,
        };
        let label = match group.kind() {
            ScalableKind::MachineDeployment => &keys.deployment_name_label,
            ScalableKind::MachineSet => &keys.set_name_label,
            ScalableKind::MachinePool => &keys.pool_name_label,
        };
        let machines = Self::own_label(
            label,
            &key.name,
            snapshot
                .group(id)
                .into_iter()
                .flat_map(member_machines)
                .map(|k| {
                    self.store
                        .cached_machine(k)
                        .map(|m| m.labels.get(label).map(str::to_string))
                }),
        );
        (sets, machines)
    }

    /// `label=name`, the selector of a group's own objects (Cluster API labels a MachineDeployment's
    /// MachineSets and Machines with `…/deployment-name`, a MachineSet's Machines with `…/set-name`,
    /// a MachinePool's with `…/pool-name`), when every one of them the cache holds (`cached`: each
    /// one's value of that label; `None`: not cached) carries it; else `None`, and the namespace is
    /// listed: an object of the group without the label (made by someone else than Cluster API), or a
    /// name longer than a label value may be (Cluster API then labels with a hash of it).
    fn own_label(
        label: &str,
        name: &str,
        mut cached: impl Iterator<Item = Option<Option<String>>>,
    ) -> Selector {
        let labelled =
            name.len() <= 63 && cached.all(|value| value.flatten().as_deref() == Some(name));
        labelled.then(|| (label.to_string(), name.to_string()))
    }

    async fn list(
        &self,
        api: Api<crate::object::ApiObject>,
        what: &str,
        namespace: &str,
        selector: Option<&(String, String)>,
    ) -> Result<kube::core::ObjectList<crate::object::ApiObject>, ActuatorError> {
        let (what, params) = match selector {
            Some((label, value)) => (
                format!("listing the {what} of namespace {namespace} labelled {label}={value}"),
                ListParams::default().labels(&format!("{label}={value}")),
            ),
            None => (
                format!("listing the {what} of namespace {namespace}"),
                ListParams::default(),
            ),
        };
        call(&what, api.list(&params))
            .await
            .map_err(|e| other(e, &what))
    }
}

/// A label selector `(key, value)`; `None`: the whole namespace.
type Selector = Option<(String, String)>;

/// The Machines a group's members are: its instances' and those it no longer lists.
fn member_machines(group: &NodeGroup) -> impl Iterator<Item = &ObjectKey> {
    group
        .instances
        .iter()
        .filter_map(|i| i.machine.as_ref())
        .chain(group.unlisted.iter())
}

fn api_namespace(api: &Api<crate::object::ApiObject>) -> String {
    api.resource_url()
        .split("/namespaces/")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default()
        .to_string()
}

/// Why the protocol must not write to the group now, from the snapshot built over the fresh read:
/// not served any more (paused, its Cluster paused, replicas the topology sets…), or rolling out.
fn hold_of(snapshot: &Snapshot, id: &str, served: Option<&NodeGroup>) -> Option<Hold> {
    match served {
        Some(group) => group.rollout.as_ref().map(|r| {
            Hold::RollingOut(format!(
                "MachineDeployment {} ({})",
                group.resource.key,
                r.reason()
            ))
        }),
        None => {
            let why = snapshot
                .skipped
                .get(id)
                .cloned()
                .unwrap_or_else(|| "no longer served".to_string());
            Some(match snapshot.not_served.get(id) {
                Some(NotServed::Topology) => Hold::Topology(why),
                _ => Hold::Paused(why),
            })
        }
    }
}

/// The group object in the protocol's terms: replicas, bounds and records of this very version,
/// and whether Cluster API has acted on it (the object's observedGeneration, and for a
/// MachineDeployment each of its MachineSets', their replicas adding up to its own).
pub(super) fn group_read(
    keys: &Keys,
    resource: &ScalableResource,
    sets: &[Arc<ScalableResource>],
    hold: Option<Hold>,
) -> GroupRead {
    let annotation = |key: &str| resource.annotations.get(key).map(String::as_str);
    let bounds = match scaling_bounds(keys, &resource.annotations) {
        Ok(Some(bounds)) => Ok(bounds),
        Ok(None) => Err("no longer carries the min/max size annotations".to_string()),
        Err(e) => Err(format!("{}: {}", e.field, e.message)),
    };
    let set_replicas: i64 = sets
        .iter()
        .map(|s| i64::from(s.replicas.unwrap_or(0)))
        .sum();
    let observed = resource.observed()
        && (resource.kind != ScalableKind::MachineDeployment
            || (sets.iter().all(|s| s.observed())
                && set_replicas == i64::from(resource.replicas.unwrap_or(0))));
    GroupRead {
        version: resource.resource_version.clone(),
        replicas: resource.replicas.unwrap_or(0),
        bounds: match resource.replicas {
            Some(_) => bounds,
            None => Err("spec.replicas is not set".to_string()),
        },
        ledger: Ledger::parse(annotation(LEDGER_ANNOTATION)),
        claims: Ledger::parse(annotation(CLAIMS_ANNOTATION)),
        taking_back: Ledger::parse(annotation(TAKING_BACK_ANNOTATION)),
        resizes: Resizes::parse(annotation(RESIZES_ANNOTATION)),
        observed,
        held: false,
        hold,
    }
}

/// The group's members: its Machines, and the instances of a MachinePool's providerIDList without
/// a Machine (named by their pool entry).
pub(super) fn members(
    keys: &Keys,
    machines: &[Arc<Machine>],
    pool_instances: &[&str],
) -> Vec<Member> {
    machines
        .iter()
        .map(|m| {
            let registered = m.node_ref.is_some();
            Member {
                name: m.key.name.to_string(),
                version: m.resource_version.clone(),
                mark: m.annotations.get(&keys.delete_machine).cloned(),
                deleting: m.deleting,
                registered,
                unhealthy: registered && (m.conditions_unhealthy || m.failure.is_some()),
                machineless: false,
            }
        })
        .chain(pool_instances.iter().map(|id| Member {
            name: pool_node_entry(id),
            version: String::new(),
            mark: None,
            deleting: false,
            registered: true,
            unhealthy: false,
            machineless: true,
        }))
        .collect()
}

/// The key of Machine `name` in the group's namespace.
pub(super) fn machine_key(group: &NodeGroup, name: &str) -> ObjectKey {
    ObjectKey::new(group.resource.key.namespace.as_str(), name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::test_fixtures::resource;
    use crate::protocol::our_mark;

    fn md(replicas: i32, generation: i64, observed: i64) -> ScalableResource {
        let keys = Keys::default();
        let mut r = resource(ScalableKind::MachineDeployment, "md");
        r.replicas = Some(replicas);
        r.generation = Some(generation);
        r.observed_generation = Some(observed);
        r.annotations.insert(keys.min_size.clone(), "1".into());
        r.annotations.insert(keys.max_size.clone(), "5".into());
        r
    }

    fn ms(replicas: i32, generation: i64, observed: i64) -> Arc<ScalableResource> {
        let mut r = resource(ScalableKind::MachineSet, "md-1");
        r.replicas = Some(replicas);
        r.generation = Some(generation);
        r.observed_generation = Some(observed);
        Arc::new(r)
    }

    #[test]
    fn cluster_api_has_observed_a_deployment_once_it_and_its_machine_sets_caught_up() {
        let keys = Keys::default();
        let read = |d: &ScalableResource, sets: &[Arc<ScalableResource>]| {
            group_read(&keys, d, sets, None).observed
        };
        assert!(read(&md(3, 4, 4), &[ms(3, 2, 2)]));
        assert!(
            !read(&md(3, 5, 4), &[ms(3, 2, 2)]),
            "its own generation not observed"
        );
        assert!(
            !read(&md(3, 4, 4), &[ms(2, 2, 2)]),
            "replicas not copied to its MachineSet yet"
        );
        assert!(
            !read(&md(3, 4, 4), &[ms(3, 3, 2)]),
            "its MachineSet has not acted on its replicas"
        );
    }

    #[test]
    fn the_group_read_carries_its_records_and_bounds_of_that_version() {
        let keys = Keys::default();
        let mut d = md(3, 1, 1);
        d.annotations
            .insert(LEDGER_ANNOTATION.into(), "m0@5".into());
        d.annotations
            .insert(CLAIMS_ANNOTATION.into(), "m1@6".into());
        let read = group_read(&keys, &d, &[ms(3, 1, 1)], None);
        assert_eq!(read.bounds, Ok((1, 5)));
        assert!(read.ledger.contains("m0@5") && read.claims.contains("m1@6"));
        d.replicas = None;
        assert!(
            group_read(&keys, &d, &[], None).bounds.is_err(),
            "no target size, no write"
        );
    }

    #[test]
    fn members_carry_their_mark_version_and_node_and_pool_instances_have_entries() {
        let keys = Keys::default();
        let mut machine = Machine {
            key: ObjectKey::new("ns", "m0"),
            uid: String::new(),
            resource_version: "7".into(),
            labels: Default::default(),
            annotations: Default::default(),
            cluster_name: "c1".into(),
            provider_id: None,
            node_ref: None,
            failure_domain: None,
            deleting: false,
            owners: Vec::new(),
            phase: None,
            failure: None,
            conditions_unhealthy: false,
        };
        machine
            .annotations
            .insert(keys.delete_machine.clone(), our_mark(9));
        let members = members(&keys, &[Arc::new(machine)], &["aws:///i-1"]);
        assert_eq!(members[0].mark.as_deref(), Some(our_mark(9).as_str()));
        assert_eq!(members[0].version, "7");
        assert!(!members[0].registered && members[0].ranks_unhealthy());
        assert!(members[1].machineless && members[1].name == pool_node_entry("aws:///i-1"));
    }
}
