//! The read every decision of the protocol starts from: the group object and its Cluster, then
//! its MachineSets and its Machines, each read from the API and recorded in the cache; the
//! group's holds (paused, rolling out, topology), members and what Cluster API has observed then
//! come from a snapshot built over exactly that, by the same rules the read path serves with.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::{Api, ListParams, VersionMatch};

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
    /// etcd at once; right after a landed write of the operation's own to the group, its answer is
    /// that read: [`Since::group_answered`]), then its MachineSets and its Machines beside them,
    /// listed at a revision not older than the group as just read and than every write this process
    /// made to the group's objects ([`Since`]): neither the members nor what Cluster API observed
    /// are then older than the group, nor than this process's own writes. The Machines, and the
    /// MachineSets, are not listed at all once their watch has brought every event up to that
    /// revision (right after a write of the operation's own to a Machine, a read waits a moment for
    /// the Machines watch): the cache then holds what such a list would return, or newer. The
    /// MachineSets are read one by one (GETs) instead of listed when [`Since::sets`] allows.
    /// MachineSets and Machines are listed by the label Cluster API gives a group's own (see
    /// [`Actuator::own_label`]), so a write costs the group's objects, not the namespace's. Without
    /// `members` (an operation that decides from the group object and its Cluster alone) neither
    /// MachineSets nor Machines are read: the read has no members, and what Cluster API observed
    /// and a rollout are as cached.
    pub(super) async fn read(
        &self,
        id: &str,
        group: &NodeGroup,
        members: bool,
        since: &mut Since,
    ) -> Result<Read, ActuatorError> {
        for _ in 0..READ_ATTEMPTS {
            if let Some(read) = self.read_once(id, group, members, since).await? {
                return Ok(read);
            }
        }
        Err(ActuatorError::Conflict(format!(
            "{id}: the group object changed after each of {READ_ATTEMPTS} reads of its Machines; nothing written, retry in a moment"
        )))
    }

    /// One attempt at [`Actuator::read`]; `None` when the group's watch brought a version newer
    /// than the Machines listed (see the end).
    async fn read_once(
        &self,
        id: &str,
        group: &NodeGroup,
        members: bool,
        since: &mut Since,
    ) -> Result<Option<Read>, ActuatorError> {
        let kind = group.kind();
        let key = group.resource.key.clone();
        let answered = since.take_group_answered();
        match self.store.cached_resource(kind, &key) {
            // The group as this operation's own write just returned it (or newer, from the
            // watch): that answer is a read of the group at the write's revision, as a GET would
            // be (the Cluster as cached).
            Some(cached) if answered => {
                since.saw(Some(&cached.resource_version));
            }
            _ => self.read_group(group, since).await?,
        }
        if !members {
            // The holds come from the snapshot: built over what was just read.
            self.store.refresh();
            let mut read = self.cached_read(id, group)?;
            read.members.clear();
            return Ok(Some(read));
        }
        let floor = since.floor();
        // The generation Cluster API's MachineDeployment controller has observed, if it has
        // observed the current one.
        let observed = self
            .store
            .cached_resource(kind, &key)
            .filter(|r| kind == ScalableKind::MachineDeployment && r.observed())
            .and_then(|r| r.generation);
        let (set_selector, machine_selector) = self.own_selectors(id, group);
        let watch_wait = since.watch_wait();
        // The cache's MachineSets are a list not older than the floor once their watch has
        // brought every event up to it (no wait: nothing of this operation's makes one).
        let sets_watched = kind == ScalableKind::MachineDeployment
            && floor
                .is_some_and(|floor| self.store.watched(Some(ScalableKind::MachineSet)) >= floor);
        let get_sets = since.sets_to_get(observed);
        let (sets, machines) = tokio::join!(
            async {
                if kind != ScalableKind::MachineDeployment || sets_watched {
                    return Ok(None);
                }
                self.read_sets(&key.namespace, set_selector.as_ref(), floor, get_sets)
                    .await
                    .map(Some)
            },
            self.read_machines(&key.namespace, machine_selector.as_ref(), floor, watch_wait),
        );
        let machines = machines?;
        if let Some((sets, listed)) = sets? {
            since.saw(listed.as_deref());
            since.sets_read(observed, sets.iter().map(|s| s.name_any()).collect());
            for set in sets {
                self.store.record(Some(ScalableKind::MachineSet), set);
            }
        }
        let machines_at = match machines {
            Machines::Listed(list) => {
                let listed = list.metadata.resource_version;
                since.saw(listed.as_deref());
                self.store.record_machines(
                    &key.namespace,
                    machine_selector
                        .as_ref()
                        .map(|(k, v)| (k.as_str(), v.as_str())),
                    listed.as_deref(),
                    list.items,
                );
                revision(listed.as_deref())
            }
            Machines::Watched(at) => {
                since.saw(Some(&at.to_string()));
                Some(at)
            }
        };
        // Every change read is in the index: the snapshot the read is taken from is built over it.
        self.store.refresh();
        if sets_watched {
            let snapshot = self.store.snapshot();
            let names = snapshot.machine_sets_of(&key).iter();
            since.sets_read(observed, names.map(|k| k.name.to_string()).collect());
        }
        since.known = true;
        let read = self.cached_read(id, group)?;
        // The read's group is the newest the cache holds: its watch may have brought a version
        // newer than the Machines read, and members older than the group are no read the rules
        // allow for. Read again, not older than that version.
        if let (Some(group_at), Some(machines_at)) =
            (revision(Some(&read.group.version)), machines_at)
            && group_at > machines_at
        {
            since.saw(Some(&read.group.version));
            return Ok(None);
        }
        Ok(Some(read))
    }

    /// The group object and its Cluster (GETs side by side), recorded in the cache.
    async fn read_group(&self, group: &NodeGroup, since: &mut Since) -> Result<(), ActuatorError> {
        let kind = group.kind();
        let key = &group.resource.key;
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
        let object = object?;
        since.saw(object.resource_version().as_deref());
        self.store.record(Some(kind), object);
        if let Some(cluster) = cluster {
            self.store.record_cluster(cluster);
        }
        Ok(())
    }

    /// The MachineSets of the group: those named in `get` read one by one, else (or when one is
    /// gone) listed (labelled `selector`) not older than `floor`, with the list's revision.
    async fn read_sets(
        &self,
        namespace: &str,
        selector: Option<&(String, String)>,
        floor: Option<u64>,
        get: Option<Vec<String>>,
    ) -> Result<(Vec<crate::object::ApiObject>, Option<String>), ActuatorError> {
        let api = self.set_api(namespace)?;
        if let Some(names) = get
            && let Some(sets) = self.get_all(&api, names).await?
        {
            return Ok((sets, None));
        }
        let list = self
            .list(api, "MachineSets", namespace, selector, floor)
            .await?;
        Ok((list.items, list.metadata.resource_version))
    }

    /// The group's Machines: from the cache once the Machines watch has brought every event up to
    /// `floor` (waiting for it until `wait` has passed), else listed (labelled `selector`) not
    /// older than `floor`; the watch is still taken if it gets there before the list's answer (at
    /// 100,000 Machines in the namespace the API server takes about 150 ms to filter them by
    /// label, a watch running late a few milliseconds more).
    async fn read_machines(
        &self,
        namespace: &str,
        selector: Option<&(String, String)>,
        floor: Option<u64>,
        wait: Duration,
    ) -> Result<Machines, ActuatorError> {
        let list = async {
            self.list(
                self.machine_api(namespace),
                "Machines",
                namespace,
                selector,
                floor,
            )
            .await
            .map(Machines::Listed)
        };
        let Some(floor) = floor else {
            return list.await;
        };
        if let Some(at) = self
            .store
            .watched_from(None, floor, Instant::now() + wait)
            .await
        {
            return Ok(Machines::Watched(at));
        }
        let watch = self
            .store
            .watched_from(None, floor, Instant::now() + super::CALL_TIMEOUT);
        tokio::select! {
            Some(at) = watch => Ok(Machines::Watched(at)),
            listed = list => listed,
        }
    }

    /// The MachineSets named, each read (GETs side by side); `None` when one is gone: only a list
    /// shows what replaced it.
    async fn get_all(
        &self,
        api: &Api<crate::object::ApiObject>,
        names: Vec<String>,
    ) -> Result<Option<Vec<crate::object::ApiObject>>, ActuatorError> {
        let read = futures::future::join_all(
            names
                .iter()
                .map(|name| self.get(api.clone(), name, "MachineSet")),
        )
        .await;
        let mut sets = Vec::with_capacity(read.len());
        for set in read {
            match set {
                Ok(set) => sets.push(set),
                Err(ActuatorError::NotFound(_)) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Ok(Some(sets))
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
                        .map(|s| {
                            s.labels
                                .get(&keys.deployment_name_label)
                                .map(str::to_string)
                        })
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

    /// The `what` of `namespace` (labelled `selector`), at a revision not older than `floor`
    /// (`None`: the newest there is).
    async fn list(
        &self,
        api: Api<crate::object::ApiObject>,
        what: &str,
        namespace: &str,
        selector: Option<&(String, String)>,
        floor: Option<u64>,
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
        let params = match floor {
            Some(revision) => params
                .at(&revision.to_string())
                .matching(VersionMatch::NotOlderThan),
            None => params,
        };
        call(&what, api.list(&params))
            .await
            .map_err(|e| other(e, &what))
    }
}

/// What one operation's reads carry from one to the next, so that no read is older than what the
/// operation saw or this process wrote before it.
///
/// A list without a revision is answered from the API server's watch cache only once that cache
/// has caught up with etcd's newest revision, which after a write to another resource it learns
/// from a progress notification it asks etcd for at most every 100 ms (k8s.io/apiserver
/// `cacher/progress/watch_progress.go`): a removal's second read waited for it, most of the
/// removal's time. A decision needs less: lists not older than the group as just read (the group
/// has not changed between its revision and the GET, so a list answered anywhere from there on is
/// one made after a read of the group then: the split read the model checker explores), nor than
/// every write this process made to the group's objects (its own marks are in what it reads).
/// After a write whose effect is not known (a conflict, no answer, gone), the next read is at the
/// newest revision: the change met is in no revision this process got back.
#[derive(Debug)]
pub(super) struct Since {
    /// The newest revision read or written.
    newest: u64,
    /// Whether every write since the last read is known (landed, at a revision seen).
    known: bool,
    /// The MachineSets this operation listed last, when it listed them with the MachineDeployment
    /// controller having observed the group's generation (that generation first).
    sets: Option<(i64, Vec<String>)>,
    /// Whether the newest revision is a write of this operation to a Machine: the Machines watch
    /// is about to bring it.
    machine_write: bool,
    /// Whether this operation's last write to the group landed, with nothing unknown since: its
    /// answer, recorded in the cache, is the group as read at that write's revision, and the next
    /// read takes it from there instead of a GET.
    group_answered: bool,
}

impl Default for Since {
    fn default() -> Self {
        Since {
            newest: 0,
            known: true,
            sets: None,
            machine_write: false,
            group_answered: false,
        }
    }
}

impl Since {
    /// Carries the newest revision both ways between this operation and `newest`, the newest
    /// revision this process's reads and writes of the group got back (kept under its lock).
    pub(super) fn carry(&mut self, newest: &mut u64) {
        if *newest > self.newest {
            // Another operation of this process wrote meanwhile.
            self.newest = *newest;
            self.machine_write = false;
            self.group_answered = false;
        }
        *newest = self.newest;
    }

    /// The revision the next lists may not be older than; `None`: the newest there is.
    fn floor(&self) -> Option<u64> {
        Some(self.newest).filter(|r| self.known && *r > 0)
    }

    /// A read or a landed write got `version` back.
    pub(super) fn saw(&mut self, version: Option<&str>) {
        if let Some(revision) = revision(version)
            && revision > self.newest
        {
            self.newest = revision;
            self.machine_write = false;
        }
    }

    /// A write of this operation landed at `version`; `machine`: a write to a Machine.
    pub(super) fn wrote(&mut self, version: &str, machine: bool) {
        if let Some(revision) = revision(Some(version))
            && revision >= self.newest
        {
            self.newest = revision;
            self.machine_write = machine;
        }
        if !machine {
            self.group_answered = true;
        }
    }

    /// Whether the next read may take the group from the cache, as this operation's own write
    /// returned it (see [`Since::group_answered`]); once only.
    fn take_group_answered(&mut self) -> bool {
        std::mem::take(&mut self.group_answered)
    }

    /// How long the next read waits for the Machines watch to reach its floor before it lists
    /// them: a moment after a write of its own to a Machine (the watch is about to bring it), else
    /// not at all (nothing says an event is coming).
    fn watch_wait(&self) -> Duration {
        if self.machine_write {
            WATCH_CATCH_UP
        } else {
            Duration::ZERO
        }
    }

    /// A write whose effect is not known: the next read is at the newest revision there is.
    pub(super) fn lost_track(&mut self) {
        self.known = false;
        self.group_answered = false;
    }

    /// The MachineSets to read one by one instead of listing them: those listed before, while the
    /// MachineDeployment controller has observed the same generation as then (`observed`). It
    /// makes a MachineSet (a new template's) before it records the generation observed, so the
    /// list had every MachineSet of that generation, and it makes no other for the same one
    /// unless one is deleted (a GET then finds it gone, and the MachineSets are listed again).
    fn sets_to_get(&self, observed: Option<i64>) -> Option<Vec<String>> {
        match (&self.sets, observed) {
            (Some((listed_at, names)), Some(now)) if *listed_at == now => Some(names.clone()),
            _ => None,
        }
    }

    /// The MachineSets read are `names`, with the MachineDeployment controller having observed
    /// generation `observed`.
    fn sets_read(&mut self, observed: Option<i64>, names: Vec<String>) {
        self.sets = observed.map(|g| (g, names));
    }
}

/// A resourceVersion as the etcd revision it is; `None` for one that is not a number.
fn revision(version: Option<&str>) -> Option<u64> {
    version?.parse().ok()
}

/// How many times a read is made again when the group changed under it (see [`Actuator::read`]).
const READ_ATTEMPTS: usize = 5;

/// How long a read waits for the Machines watch to bring a write of its operation's own before it
/// lists the Machines instead: the watch brings an event a few milliseconds after the write is
/// answered; a list of a group's Machines costs 15–20 ms at 10,000 Machines in its namespace.
const WATCH_CATCH_UP: Duration = Duration::from_millis(20);

/// Where a read's Machines come from.
enum Machines {
    /// A list, answered at its revision.
    Listed(kube::core::ObjectList<crate::object::ApiObject>),
    /// The cache, the Machines watch having brought every event up to this revision.
    Watched(u64),
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
    let annotation = |key: &str| resource.annotations.get(key);
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
mod tests;
