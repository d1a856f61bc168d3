//! The only writer: replicas (with the removal ledger, see `removal`) and the delete-machine annotation.
//!
//! One operation per group at a time. Every replica write carries the resourceVersion it was computed
//! from, so a concurrent change makes it fail with a conflict instead of overwriting; it is then
//! recomputed from a fresh read and bounds are checked again.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;

use crate::backend::{ActuatorError, ApiCause, Backend, NodeToDelete};
use crate::capi::{Keys, ObjectKey, ScalableKind, ScalableResource};
use crate::lock;
use crate::metrics::Metrics;
use crate::object::ApiObject;
use crate::preflight;
use crate::snapshot::{NodeGroup, NodeRef, Snapshot, scaling_bounds};
use crate::store::Store;
use removal::{
    Cancellation, Counts, Deletion, LEDGER_ANNOTATION, Ledger, MachineState, RAISED_ANNOTATION,
    TAKING_BACK_ANNOTATION, mark_entry, our_mark, our_mark_time, payment_entry, pool_node_entry,
    raised_at,
};

pub(crate) mod removal;

/// Attempts at a replica write before giving up on conflicts.
const MAX_ATTEMPTS: usize = 8;
/// Bound on each API call, below CA's default gRPC deadline (5s).
const CALL_TIMEOUT: Duration = Duration::from_secs(4);

/// An API error, kept apart from conflicts so writes can retry those.
#[derive(Debug)]
enum ApiFailure {
    Conflict,
    Other(ActuatorError),
}

fn classify(what: &str, e: kube::Error) -> ApiFailure {
    match e {
        kube::Error::Api(status) if status.code == 409 => ApiFailure::Conflict,
        kube::Error::Api(status) => ApiFailure::Other(match status.code {
            404 => ActuatorError::NotFound(format!("{what}: not found: {}", status.message)),
            403 => ActuatorError::api(
                ApiCause::Forbidden,
                format!(
                    "{what}: forbidden (check the provider's RBAC): {}",
                    status.message
                ),
            ),
            400 | 422 => ActuatorError::Refused(format!("{what}: rejected: {}", status.message)),
            429 | 500..=599 => ActuatorError::unreachable(format!(
                "{what}: API server error {}: {}",
                status.code, status.message
            )),
            code => ActuatorError::api(
                ApiCause::Failed,
                format!("{what}: API error {code}: {}", status.message),
            ),
        }),
        other => ApiFailure::Other(ActuatorError::unreachable(format!(
            "{what}: management cluster API unreachable: {other}"
        ))),
    }
}

async fn call<T>(
    what: &str,
    fut: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, ApiFailure> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(result) => result.map_err(|e| classify(what, e)),
        Err(_) => Err(ApiFailure::Other(ActuatorError::unreachable(format!(
            "{what}: management cluster API did not answer within {CALL_TIMEOUT:?}"
        )))),
    }
}

fn other(e: ApiFailure, what: &str) -> ActuatorError {
    match e {
        ApiFailure::Conflict => ActuatorError::Conflict(format!("{what}: conflict")),
        ApiFailure::Other(e) => e,
    }
}

pub struct Actuator {
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    /// Per group that exists (pruned as groups go): one operation of this process at a time. What
    /// other processes must know (a raise, a paid removal) is written to the objects instead.
    groups: Mutex<HashMap<String, GroupLock>>,
    /// `--mark-grace-period`: how long after a raise Cluster API may still act on it (the repair
    /// keeps marks, a DecreaseTargetSize cancels no capacity without a Machine, meanwhile).
    mark_grace: Duration,
}

type GroupLock = Arc<tokio::sync::Mutex<()>>;

/// The provider's backend: the store's snapshot for reads, the actuator for writes.
#[tonic::async_trait]
impl Backend for Arc<Actuator> {
    fn snapshot(&self) -> Arc<Snapshot> {
        self.store.snapshot()
    }

    fn is_complete(&self) -> bool {
        self.store.is_complete()
    }

    fn stale_for_write(&self, kind: ScalableKind) -> Vec<String> {
        self.store
            .stale_for_write(kind)
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    fn keys(&self) -> &Keys {
        &self.store.settings().keys
    }

    fn refresh(&self) {
        self.store.refresh();
    }

    async fn increase_size(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
        Actuator::increase_size(self, id, delta).await
    }

    async fn decrease_target_size(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
        Actuator::decrease_target_size(self, id, delta).await
    }

    async fn delete_nodes(&self, id: &str, nodes: &[NodeToDelete]) -> Result<(), ActuatorError> {
        Actuator::delete_nodes(self, id, nodes).await
    }
}

/// The group object as a write starts from it: replicas, bounds, ledger and last raise of one
/// resourceVersion.
struct GroupState {
    replicas: i32,
    min: i32,
    max: i32,
    ledger: Ledger,
    /// When replicas were last raised by any provider ([`RAISED_ANNOTATION`]).
    raised: Option<u64>,
    /// Marks a repair is taking back ([`TAKING_BACK_ANNOTATION`]): no decrement pays them.
    taking_back: Ledger,
    /// `spec.providerIDList` entries (normalised) of the same version: ledger entries of nodes no
    /// longer listed need no record.
    listed: BTreeSet<String>,
    resource_version: String,
}

impl GroupState {
    fn out_of_bounds(&self, group: &NodeGroup, operation: &str, desired: i32) -> ActuatorError {
        ActuatorError::OutOfBounds {
            group: group.id.clone(),
            operation: operation.to_string(),
            desired,
            min: self.min,
            max: self.max,
        }
    }
}

/// What a write changes: the new replica count and, for a removal, the ledger entries it pays for.
struct Change {
    replicas: i32,
    entries: Vec<String>,
}

/// Whether `wanted`, written over version `before`, shows in `now`.
fn landed(before: &str, wanted: &Change, now: &GroupState) -> bool {
    if wanted.entries.is_empty() {
        now.resource_version != before && now.replicas == wanted.replicas
    } else {
        // Entries are written only with their decrement: their presence proves the write.
        wanted.entries.iter().all(|e| now.ledger.contains(e))
    }
}

/// The reason of the Normal Event a size change records on its group.
pub const REPLICAS_CHANGED: &str = "ReplicasChanged";

/// The action and note of the Event for a size change written by `operation`: who asked, from,
/// to, and for a removal the Machines (or MachinePool nodes) it pays for.
fn size_change_event(operation: &str, from: i32, change: &Change) -> (&'static str, String) {
    let action = match operation {
        "increase-size" => "IncreaseSize",
        "decrease-target-size" => "DecreaseTargetSize",
        "delete-nodes" => "DeleteNodes",
        _ => "Scale",
    };
    let mut note = format!(
        "replicas {from} → {} for cluster-autoscaler {action}",
        change.replicas
    );
    let removed: Vec<&str> = change
        .entries
        .iter()
        .map(|e| match e.rsplit_once('@') {
            Some((machine, _)) if !e.starts_with("id:") => machine,
            _ => e.as_str(),
        })
        .collect();
    if !removed.is_empty() {
        note.push_str(&format!(" ({})", removed.join(", ")));
    }
    (action, note)
}

/// How often an unknown outcome (an answer lost in transit) is looked up before giving up.
const RESOLVE_ATTEMPTS: u32 = 3;

/// Every write names the provider as its field manager: managedFields and audit logs show who wrote.
fn write_params() -> PatchParams {
    PatchParams {
        field_manager: Some("capi-autoscaler-provider".into()),
        ..PatchParams::default()
    }
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Now in unix seconds, rounded up: a raise recorded so is protected for the whole grace period
/// after it, never a fraction of a second less.
fn now_unix_ceil() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() + u64::from(d.subsec_nanos() > 0))
        .unwrap_or(0)
}

impl Actuator {
    pub fn new(store: Arc<Store>, metrics: Arc<Metrics>) -> Self {
        Actuator {
            store,
            metrics,
            groups: Mutex::new(HashMap::new()),
            mark_grace: Duration::from_secs(30),
        }
    }

    /// Sets `--mark-grace-period` (30 s unless set) for DecreaseTargetSize; the repair is given it
    /// by [`Actuator::spawn_repair`].
    pub fn with_mark_grace(mut self, grace: Duration) -> Self {
        self.mark_grace = grace;
        self
    }

    /// The operation lock of a group that exists in `snapshot`; those of groups that are gone are
    /// dropped.
    fn group_lock(&self, snapshot: &Snapshot, id: &str) -> GroupLock {
        let mut groups = lock(&self.groups);
        if groups.len() > snapshot.groups.len() {
            groups.retain(|g, o| snapshot.groups.contains_key(g) || Arc::strong_count(o) > 1);
        }
        Arc::clone(groups.entry(id.to_string()).or_default())
    }

    /// The group as of everything the index holds now (an operation decides from it).
    fn group(&self, id: &str) -> Result<(Arc<Snapshot>, NodeGroup), ActuatorError> {
        self.store.refresh();
        let snapshot = self.store.snapshot();
        let group = snapshot
            .group(id)
            .cloned()
            .ok_or_else(|| ActuatorError::GroupNotFound { id: id.to_string() })?;
        Ok((snapshot, group))
    }

    fn group_api(
        &self,
        kind: ScalableKind,
        namespace: &str,
    ) -> Result<Api<ApiObject>, ActuatorError> {
        let resource = self
            .store
            .apis()
            .scalable
            .get(&kind)
            .ok_or_else(|| ActuatorError::Internal(format!("{kind} is not served")))?;
        Ok(Api::namespaced_with(
            self.store.client().clone(),
            namespace,
            resource,
        ))
    }

    fn machine_api(&self, namespace: &str) -> Api<ApiObject> {
        Api::namespaced_with(
            self.store.client().clone(),
            namespace,
            &self.store.apis().machine,
        )
    }

    /// Replicas, bounds and ledger of `resource`. Bounds come from the object itself, so a write is
    /// checked against the bounds of the very version it replaces.
    fn state_of(
        &self,
        group: &NodeGroup,
        resource: &ScalableResource,
    ) -> Result<GroupState, ActuatorError> {
        let object = format!("{} {}", group.kind(), group.resource.key);
        let (min, max) =
            scaling_bounds(&self.store.settings().keys, &object, &resource.annotations)
                .map_err(|p| {
                    ActuatorError::Refused(format!("{}: {}: {}", group.id, p.field, p.message))
                })?
                .ok_or_else(|| {
                    ActuatorError::Refused(format!(
                        "{}: no longer carries the min/max size annotations",
                        group.id
                    ))
                })?;
        let replicas = resource.replicas.ok_or_else(|| {
            ActuatorError::Refused(format!("{}: spec.replicas is not set", group.id))
        })?;
        Ok(GroupState {
            replicas,
            min,
            max,
            ledger: Ledger::parse(
                resource
                    .annotations
                    .get(LEDGER_ANNOTATION)
                    .map(String::as_str),
            ),
            raised: raised_at(
                resource
                    .annotations
                    .get(RAISED_ANNOTATION)
                    .map(String::as_str),
            ),
            taking_back: Ledger::parse(
                resource
                    .annotations
                    .get(TAKING_BACK_ANNOTATION)
                    .map(String::as_str),
            ),
            listed: resource
                .provider_id_list
                .iter()
                .map(|id| pool_node_entry(id))
                .collect(),
            resource_version: resource.resource_version.clone(),
        })
    }

    /// The group object as cached (read-your-writes included).
    fn cached(&self, group: &NodeGroup) -> Result<GroupState, ActuatorError> {
        let resource = self
            .store
            .cached_resource(group.kind(), &group.resource.key)
            .ok_or_else(|| ActuatorError::GroupNotFound {
                id: group.id.clone(),
            })?;
        self.state_of(group, &resource)
    }

    /// The group object as the API has it now (also put into the cache).
    async fn live(&self, group: &NodeGroup) -> Result<GroupState, ActuatorError> {
        let key = &group.resource.key;
        let api = self.group_api(group.kind(), &key.namespace)?;
        let what = format!("reading {} {key}", group.kind());
        let object = call(&what, api.get(&key.name))
            .await
            .map_err(|e| other(e, &what))?;
        let resource =
            ScalableResource::from_json(group.kind(), &self.store.settings().keys, object.json())
                .map_err(|e| ActuatorError::Refused(format!("{}: {e}", group.id)));
        self.store.record(Some(group.kind()), object);
        let resource = resource?;
        self.state_of(group, &resource)
    }

    /// Lists the Machines of `namespace` and puts them into the index (and the snapshot), so the
    /// decision that follows sees every Machine the API has.
    async fn sync_machines(&self, namespace: &str) -> Result<(), ActuatorError> {
        let api = self.machine_api(namespace);
        let what = format!("listing the Machines of namespace {namespace}");
        let list = call(&what, api.list(&ListParams::default()))
            .await
            .map_err(|e| other(e, &what))?;
        self.store.record_machines(
            namespace,
            list.metadata.resource_version.as_deref(),
            list.items,
        );
        Ok(())
    }

    /// The group's Machines as cached now (our own writes included).
    fn machines(&self, group: &NodeGroup) -> Vec<(ObjectKey, Arc<crate::capi::Machine>)> {
        group
            .instances
            .iter()
            .filter_map(|i| i.machine.clone())
            .chain(group.unlisted.iter().cloned())
            .filter_map(|k| self.store.cached_machine(&k).map(|m| (k, m)))
            .collect()
    }

    /// The delete mark on Machine `name` of `group`, as cached (`None`: gone or unmarked): what
    /// ledger entries are matched against.
    fn cached_mark(&self, group: &NodeGroup, name: &str) -> Option<String> {
        let delete_key = &self.store.settings().keys.delete_machine;
        self.store
            .cached_machine(&ObjectKey::new(group.resource.key.namespace.as_str(), name))
            .and_then(|m| m.annotations.get(delete_key).cloned())
    }

    /// The time of our mark on Machine `name` of `group`, as cached (`None`: gone, unmarked, or
    /// marked by someone else): what taking-back entries are matched against.
    fn cached_mark_time(&self, group: &NodeGroup, name: &str) -> Option<u64> {
        self.cached_mark(group, name)
            .as_deref()
            .and_then(our_mark_time)
    }

    /// The ledger as the next write leaves it: entries that need no record any more dropped (see
    /// [`Ledger::pruned`]; a Machine's mark as cached), `entry` added.
    fn next_ledger(&self, group: &NodeGroup, state: &GroupState, entries: &[String]) -> Ledger {
        let mut ledger = state.ledger.pruned(
            &state.listed,
            |name| self.cached_mark(group, name),
            now_unix(),
        );
        for entry in entries {
            ledger.insert(entry.clone());
        }
        ledger
    }

    /// Writes `change(state)` to the group object in one guarded write: `spec.replicas` and, for a
    /// removal, its ledger entry, for a raise the time of it (`None`: nothing is owed over that
    /// version, no write). Bounds are those of the version written over; a conflict re-reads and
    /// recomputes (with `machines_too`, after listing the Machines of the group's namespace
    /// again: the change is decided from them). An answer lost in transit is resolved by reading again, never by assuming; a
    /// write read back as not applied may still arrive (the network can deliver a request its client
    /// gave up on after a later one), so every later read first checks whether it has, and then
    /// takes it as this write instead of applying the change twice.
    async fn write(
        &self,
        group: &NodeGroup,
        operation: &'static str,
        machines_too: bool,
        change: impl Fn(&GroupState) -> Result<Option<Change>, ActuatorError>,
    ) -> Result<i32, ActuatorError> {
        let key = &group.resource.key;
        let api = self.group_api(group.kind(), &key.namespace)?;
        let what = format!("scaling {} {key}", group.kind());
        let mut state = self.cached(group)?;
        // Attempts whose answer was lost and that were read back as not applied (yet).
        let mut unanswered: Vec<(String, i32, Change)> = Vec::new();
        for attempt in 0..MAX_ATTEMPTS {
            if attempt > 0 {
                state = self.live(group).await?;
                if machines_too {
                    self.sync_machines(&key.namespace).await?;
                }
                if let Some((_, from, late)) = unanswered
                    .iter()
                    .find(|(before, _, wanted)| landed(before, wanted, &state))
                {
                    tracing::info!(group = %group.id, to = late.replicas, "{operation}: an earlier attempt whose answer was lost has landed");
                    self.size_changed(group, operation, *from, late);
                    return Ok(late.replicas);
                }
            }
            let Some(wanted) = change(&state)? else {
                // Nothing is owed any more: the version just read already carries the change.
                return Ok(state.replicas);
            };
            if !removal::within_bounds(state.replicas, wanted.replicas, state.min, state.max) {
                return Err(state.out_of_bounds(group, operation, wanted.replicas));
            }
            let ledger = self.next_ledger(group, &state, &wanted.entries);
            let mut patch = json!({
                "metadata": {"resourceVersion": state.resource_version},
                "spec": {"replicas": wanted.replicas},
            });
            if ledger != state.ledger {
                patch["metadata"]["annotations"][LEDGER_ANNOTATION] = json!(ledger.render());
            }
            if wanted.replicas > state.replicas {
                // Every provider's repair reads it (see `RAISED_ANNOTATION`).
                patch["metadata"]["annotations"][RAISED_ANNOTATION] =
                    json!(now_unix_ceil().to_string());
            }
            let started = Instant::now();
            match call(
                &what,
                api.patch(&key.name, &write_params(), &Patch::Merge(&patch)),
            )
            .await
            {
                Ok(object) => {
                    self.metrics.api_write(operation, "ok", started.elapsed());
                    self.store.record(Some(group.kind()), object);
                    tracing::info!(group = %group.id, from = state.replicas, to = wanted.replicas, elapsed = ?started.elapsed(), "{operation}");
                    self.size_changed(group, operation, state.replicas, &wanted);
                    return Ok(wanted.replicas);
                }
                Err(ApiFailure::Conflict) => {
                    self.metrics
                        .api_write(operation, "conflict", started.elapsed());
                }
                Err(ApiFailure::Other(e)) => {
                    self.metrics
                        .api_write(operation, "error", started.elapsed());
                    if !e.is_unreachable() {
                        return Err(e);
                    }
                    // The write may have landed before its answer was lost.
                    match self.resolve(group, &state, &wanted).await {
                        Some(true) => {
                            self.size_changed(group, operation, state.replicas, &wanted);
                            return Ok(wanted.replicas);
                        }
                        // Not applied yet: the next attempt recomputes from a fresh read, unless
                        // that read shows this one arrived meanwhile.
                        Some(false) => unanswered.push((
                            state.resource_version.clone(),
                            state.replicas,
                            wanted,
                        )),
                        None => {
                            return Err(ActuatorError::unreachable(format!(
                                "{e}; whether the write landed is unknown (it is looked up again on retry)"
                            )));
                        }
                    }
                }
            }
        }
        Err(ActuatorError::Conflict(format!(
            "{what}: still conflicting after {MAX_ATTEMPTS} attempts"
        )))
    }

    /// Records a Normal Event on the group for a size change written (best effort: the write
    /// stands whether or not the Event is recorded).
    fn size_changed(&self, group: &NodeGroup, operation: &str, from: i32, change: &Change) {
        let (action, note) = size_change_event(operation, from, change);
        self.store.group_event(
            group.kind(),
            &group.resource.key,
            REPLICAS_CHANGED,
            action,
            note,
        );
    }

    /// Whether `wanted` landed over `before`: `Some(applied)` once the object could be read.
    async fn resolve(
        &self,
        group: &NodeGroup,
        before: &GroupState,
        wanted: &Change,
    ) -> Option<bool> {
        for attempt in 0..RESOLVE_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
            }
            if let Ok(now) = self.live(group).await {
                return Some(landed(&before.resource_version, wanted, &now));
            }
        }
        None
    }

    pub async fn increase_size(
        self: &Arc<Self>,
        id: &str,
        delta: i32,
    ) -> Result<(), ActuatorError> {
        let (me, id) = (Arc::clone(self), id.to_string());
        self.run(async move { me.increase(&id, delta).await }).await
    }

    /// Cancels capacity that has not become nodes yet; never removes a registered node.
    pub async fn decrease_target_size(
        self: &Arc<Self>,
        id: &str,
        delta: i32,
    ) -> Result<(), ActuatorError> {
        let (me, id) = (Arc::clone(self), id.to_string());
        self.run(async move { me.decrease(&id, delta).await }).await
    }

    /// Marks each node's Machine for deletion and lowers replicas by one per node, recording each
    /// decrement in the group's ledger. A node whose removal is paid already (or whose Machine is
    /// being deleted) is skipped, so CA's retries never lower replicas twice. Refused, writing
    /// nothing, while the group's MachineDeployment rolls out.
    pub async fn delete_nodes(
        self: &Arc<Self>,
        id: &str,
        nodes: &[NodeToDelete],
    ) -> Result<(), ActuatorError> {
        let (me, id, nodes) = (Arc::clone(self), id.to_string(), nodes.to_vec());
        self.run(async move { me.delete(&id, &nodes).await }).await
    }

    /// Runs an accepted operation to completion on its own task: CA's deadline may drop the RPC,
    /// but a half-done removal must not be dropped with it. One snapshot build follows.
    async fn run(
        &self,
        operation: impl Future<Output = Result<(), ActuatorError>> + Send + 'static,
    ) -> Result<(), ActuatorError> {
        let store = Arc::clone(&self.store);
        tokio::spawn(async move {
            let result = operation.await;
            store.refresh();
            result
        })
        .await
        .unwrap_or_else(|e| {
            Err(ActuatorError::Internal(format!(
                "scale operation failed: {e}"
            )))
        })
    }

    async fn increase(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
        if delta <= 0 {
            return Err(ActuatorError::BadRequest(format!(
                "size increase must be positive, got delta {delta}"
            )));
        }
        let (snapshot, _) = self.group(id)?;
        let group_lock = self.group_lock(&snapshot, id);
        let _guard = group_lock.lock().await;
        let (_, group) = self.group(id)?;
        self.write(&group, "increase-size", false, |state| {
            let desired = state.replicas.saturating_add(delta);
            if desired > state.max {
                return Err(state.out_of_bounds(&group, "size increase", desired));
            }
            Ok(Some(Change {
                replicas: desired,
                entries: Vec::new(),
            }))
        })
        .await
        .map(|_| ())
    }

    /// Cancels capacity that never became nodes, pinned ([`removal::cancellation_plan`], decided
    /// from the group and its Machines as the API has them): replicas without a Machine are
    /// cancelled by a decrement alone, first; the pending Machines Cluster API would remove for the
    /// rest are marked and paid like a DeleteNodes of them ([`Actuator::remove_machines`]), so
    /// Cluster API removes exactly those even if one gets its Node before its controller acts.
    /// Refused during a rollout like DeleteNodes. CA never repeats a DecreaseTargetSize: it
    /// decides again from the target size and the nodes, so every call is a fresh cancellation;
    /// within one call a conflict re-decides and a write whose answer was lost is looked up.
    async fn decrease(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
        if delta >= 0 {
            return Err(ActuatorError::BadRequest(format!(
                "size decrease must be negative, got delta {delta}"
            )));
        }
        let (snapshot, _) = self.group(id)?;
        let group_lock = self.group_lock(&snapshot, id);
        let _guard = group_lock.lock().await;
        let (_, group) = self.group(id)?;
        refuse_during_rollout(&group, "DecreaseTargetSize")?;
        let registered = group.registered;
        let by = delta.unsigned_abs();
        let refuse_registered = |current: i32, delta: i32| {
            let desired = current.saturating_add(delta);
            (desired < registered).then(|| ActuatorError::Refused(format!(
                "{id}: attempt to delete existing nodes: replicas {current}, delta {delta}, registered nodes {registered}"
            )))
        };
        // A MachinePool has no deletion order to count with: which instance goes is the
        // infrastructure provider's choice, so only the registered count guards it.
        if group.kind() == ScalableKind::MachinePool {
            return self
                .write(&group, "decrease-target-size", false, |state| {
                    if let Some(e) = refuse_registered(state.replicas, delta) {
                        return Err(e);
                    }
                    let desired = state.replicas.saturating_add(delta);
                    if !removal::within_bounds(state.replicas, desired, state.min, state.max) {
                        return Err(state.out_of_bounds(&group, "size decrease", desired));
                    }
                    Ok(Some(Change {
                        replicas: desired,
                        entries: Vec::new(),
                    }))
                })
                .await
                .map(|_| ());
        }
        let (group, _) = self.confirm(id, &group).await?;
        let delete_key = self.store.settings().keys.delete_machine.clone();
        // The plan over `state` and the Machines as cached: `by` in all, every refusal checked.
        let plan = |state: &GroupState, by: u32| -> Result<(usize, Vec<String>), ActuatorError> {
            let current = state.replicas;
            let delta = -i32::try_from(by).unwrap_or(i32::MAX);
            if let Some(e) = refuse_registered(current, delta) {
                return Err(e);
            }
            let (_, now) = self.group(id)?;
            let machines = self.machines(&now);
            let members = members(&now, &machines, &delete_key);
            let plan = removal::cancellation_plan(&members, current, by)
                .map_err(|why| cancellation_refusal(&now, current, delta, &why))?;
            let desired = current.saturating_sub(i32::try_from(by).unwrap_or(i32::MAX));
            if !removal::within_bounds(current, desired, state.min, state.max) {
                return Err(state.out_of_bounds(&group, "size decrease", desired));
            }
            Ok((
                plan.uncreated,
                plan.pin.into_iter().map(str::to_string).collect(),
            ))
        };
        // Capacity without a Machine is not cancelled while Cluster API may still be creating
        // Machines for the last raise (by any provider: read from the group object): one it
        // creates after this decision could not be pinned, and the lower count could delete it,
        // registered by then, unmarked. CA calls DecreaseTargetSize only after
        // --max-node-provision-time, long after its raise.
        let grace = self.mark_grace.as_secs();
        let hold = |state: &GroupState, uncreated: usize| -> Result<(), ActuatorError> {
            match removal::uncreated_hold(uncreated, state.raised, now_unix(), grace) {
                Some(until) => Err(ActuatorError::Refused(format!(
                    "{id}: {uncreated} of the replicas to cancel have no Machine yet and the group was raised at unix {} (within --mark-grace-period {grace}s): Cluster API may still be creating Machines for that raise; nothing written, retry after unix {until}",
                    state.raised.unwrap_or_default()
                ))),
                None => Ok(()),
            }
        };
        let cached = self.cached(&group)?;
        let (uncreated, mut pin) = plan(&cached, by)?;
        hold(&cached, uncreated)?;
        if uncreated > 0 {
            // The pending Machines this call still pins after the decrement, as last decided.
            let pinned = std::sync::atomic::AtomicUsize::new(pin.len());
            self.write(&group, "decrease-target-size", true, |state| {
                let (uncreated, pin) = plan(state, by)?;
                hold(state, uncreated)?;
                pinned.store(pin.len(), std::sync::atomic::Ordering::Relaxed);
                Ok((uncreated > 0).then(|| Change {
                    replicas: state.replicas - uncreated as i32,
                    entries: Vec::new(),
                }))
            })
            .await?;
            let rest = pinned.load(std::sync::atomic::Ordering::Relaxed);
            if rest == 0 {
                return Ok(());
            }
            // Decided again from the objects as they are now: the Machines to pin may have changed.
            let (_, state) = self.confirm(id, &group).await?;
            let rest = u32::try_from(rest).unwrap_or(u32::MAX);
            let (left, now) = plan(&state, rest)?;
            if left > 0 {
                return Err(ActuatorError::Conflict(format!(
                    "{id}: capacity without a Machine was cancelled, but replicas still exceed the Machines by {left}: Cluster API changed the group meanwhile; nothing more written"
                )));
            }
            pin = now;
        }
        if pin.is_empty() {
            return Ok(());
        }
        let (_, group) = self.group(id)?;
        let namespace = group.resource.key.namespace.clone();
        let named: Vec<ObjectKey> = pin
            .iter()
            .map(|name| ObjectKey::new(namespace.as_str(), name.as_str()))
            .collect();
        // A Machine that got its Node after the decision is never marked by this call: marks are
        // guarded by the version decided from, and a conflict re-reads it and lands here. One
        // Cluster API started deleting meanwhile (for Machines it created beyond the count) would
        // make the decrement look paid already, and CA's target would not drop by its delta.
        let still_pending = |group: &NodeGroup, marking: &[String]| {
            let machines = self.machines(group);
            let state = |name: &str| machines.iter().find(|(k, _)| k.name == name);
            let went = pin
                .iter()
                .find(|name| state(name).is_none_or(|(_, m)| m.deleting));
            let registered = marking
                .iter()
                .find(|name| state(name).is_some_and(|(_, m)| m.node_ref.is_some()));
            match went.or(registered) {
                Some(name) => Err(ActuatorError::Refused(format!(
                    "{id}: attempt to delete existing nodes: Machine {namespace}/{name} got its Node, or is being deleted, while DecreaseTargetSize was cancelling it; marks of this call taken back, nothing more written"
                ))),
                None => Ok(()),
            }
        };
        self.remove_machines(
            id,
            &group,
            &named,
            0,
            "decrease-target-size",
            &still_pending,
        )
        .await
        .map(|_| ())
    }

    async fn delete(&self, id: &str, nodes: &[NodeToDelete]) -> Result<(), ActuatorError> {
        let (snapshot, _) = self.group(id)?;
        let group_lock = self.group_lock(&snapshot, id);
        let _guard = group_lock.lock().await;
        let (snapshot, group) = self.group(id)?;
        // During a rollout the MachineDeployment controller picks the MachineSet that shrinks, so
        // a lower replica count may take another node than the one marked.
        refuse_during_rollout(&group, "scale-down")?;
        // Every node resolved before anything is touched.
        let plan = removal_plan(&snapshot, &self.store.settings().keys, &group, nodes)?;
        // Capacity never created is cancelled first; the other nodes of the call then as usual.
        let held = plan
            .iter()
            .filter(|(n, m)| m.is_none() && is_held(n))
            .count();
        let group = if held > 0 {
            self.cancel_held(id, &group, held).await?;
            self.group(id)?.1
        } else {
            group
        };
        let plan: Vec<_> = plan
            .into_iter()
            .filter(|(n, m)| m.is_some() || !is_held(n))
            .collect();
        let named: Vec<ObjectKey> = plan.iter().filter_map(|(_, m)| m.clone()).collect();
        let pool_nodes: Vec<&NodeToDelete> = plan
            .iter()
            .filter(|(_, m)| m.is_none())
            .map(|(n, _)| n)
            .collect();
        let pool_owed = pool_nodes
            .iter()
            .filter(|n| {
                self.cached(&group)
                    .is_ok_and(|state| !state.ledger.contains(&pool_node_entry(&n.provider_id)))
            })
            .count();
        let mut group = group;
        if !named.is_empty() {
            group = self
                .remove_machines(
                    id,
                    &group,
                    &named,
                    pool_owed,
                    "delete-nodes",
                    &|_, _| Ok(()),
                )
                .await?;
        } else if pool_owed > 0 {
            let state = self.cached(&group)?;
            let desired = state.replicas - pool_owed as i32;
            if !removal::within_bounds(state.replicas, desired, state.min, state.max) {
                return Err(state.out_of_bounds(
                    &group,
                    &format!("deleting {pool_owed} node(s)"),
                    desired,
                ));
            }
        }
        for node in pool_nodes {
            let entry = pool_node_entry(&node.provider_id);
            // Re-checked on every attempt: a removal paid meanwhile (by another writer, or an
            // earlier attempt that landed) is not paid twice.
            self.write(&group, "delete-nodes", false, |state| {
                Ok((!state.ledger.contains(&entry)).then(|| Change {
                    replicas: state.replicas - 1,
                    entries: vec![entry.clone()],
                }))
            })
            .await?;
            tracing::info!(group = id, node = %node.describe(), "no Machine for this MachinePool node: lowered replicas only");
        }
        Ok(())
    }

    /// Removes `count` instances Cluster API's preflight checks hold back (CA deletes instances it
    /// was told failed to create): lowers replicas by as many, decided from the group and its
    /// Machines as the API has them, never below the Machines there are ([`preflight::cancel`]).
    async fn cancel_held(
        &self,
        id: &str,
        group: &NodeGroup,
        count: usize,
    ) -> Result<(), ActuatorError> {
        let (group, _) = self.confirm(id, group).await?;
        self.write(&group, "delete-nodes", true, |state| {
            let (_, now) = self.group(id)?;
            let machines = self
                .machines(&now)
                .iter()
                .filter(|(_, m)| !m.deleting)
                .count();
            let desired = preflight::cancel(state.replicas, machines, count)
                .map_err(|why| ActuatorError::Refused(format!("{id}: {why}")))?;
            if !removal::within_bounds(state.replicas, desired, state.min, state.max) {
                return Err(state.out_of_bounds(
                    &group,
                    &format!("removing {count} held-back instance(s)"),
                    desired,
                ));
            }
            Ok(Some(Change {
                replicas: desired,
                entries: Vec::new(),
            }))
        })
        .await?;
        tracing::info!(
            group = id,
            count,
            "instances held back by Cluster API's preflight checks removed: replicas lowered"
        );
        Ok(())
    }

    /// The group's Machines (as cached) in the rules' terms, with the group as of now.
    fn deletion_of(
        &self,
        id: &str,
        names: &BTreeSet<&str>,
        state: &GroupState,
    ) -> Result<(NodeGroup, Marks, Decided), ActuatorError> {
        let (_, group) = self.group(id)?;
        let delete_key = &self.store.settings().keys.delete_machine;
        let machines = self.machines(&group);
        // A named Machine gone from the group (deleted, or moved) is never answered as removed
        // by a decision that did not count it.
        if let Some(missing) = names
            .iter()
            .find(|n| !machines.iter().any(|(k, _)| k.name == **n))
        {
            return Err(ActuatorError::NotFound(format!(
                "{id}: Machine {}/{missing} is no longer one of the group's Machines",
                group.resource.key.namespace
            )));
        }
        let states = members(&group, &machines, delete_key);
        let marks: Vec<(String, Option<String>)> = machines
            .iter()
            .map(|(k, m)| (k.name.clone(), m.annotations.get(delete_key).cloned()))
            .collect();
        let decided = match removal::deletion(&states, names, state.replicas, &state.ledger) {
            Deletion::Proceed {
                mark, decrement, ..
            } => Decided::Proceed {
                mark: mark.into_iter().map(str::to_string).collect(),
                decrement,
            },
            Deletion::Absorbed(names) => Decided::Refused(absorbed_refusal(
                &group,
                state,
                &Counts::of(state.replicas, &state.ledger, states.iter().copied()),
                &names,
            )),
            Deletion::OthersMarked(others) => {
                Decided::Refused(others_marked_refusal(&group, state, &others))
            }
            Deletion::NotCreated { replicas, members } => {
                Decided::Refused(ActuatorError::Refused(format!(
                    "{id}: replicas ({replicas}) exceed the {members} Machine(s) of {} {} not being deleted: Cluster API creates Machines for them first, so lowering replicas now would cancel one not created yet and the named node(s) would stay; nothing written. Once the Machines exist the removal can proceed (or DecreaseTargetSize cancels those never created)",
                    group.kind(),
                    group.resource.key,
                )))
            }
        };
        Ok((group, marks, decided))
    }

    /// Removes the named Machines of a group by [`removal::deletion`], decided from the group and
    /// its Machines as the API has them (read before deciding, and again on every conflict): marks
    /// the named Machines, then lowers replicas by what makes Cluster API's own order remove
    /// exactly them, with the ledger entries in the same write. Refused, nothing written, when
    /// another Machine's mark would go first. A mark written here is taken back when the decrement
    /// certainly did not land (a mark someone else set restored); when its outcome is unknown it
    /// stays, and the counts decide later. `pool_owed`: decrements the same call still writes for
    /// MachinePool nodes without a Machine (checked against min together). `operation` names the
    /// writes (metrics, Events); `before_marking` may refuse, on every decision, the Machines about
    /// to be marked (the call's marks taken back). DecreaseTargetSize pins its Machines this way.
    async fn remove_machines(
        &self,
        id: &str,
        group: &NodeGroup,
        named: &[ObjectKey],
        pool_owed: usize,
        operation: &'static str,
        before_marking: &BeforeMarking<'_>,
    ) -> Result<NodeGroup, ActuatorError> {
        let delete_key = self.store.settings().keys.delete_machine.clone();
        let names: BTreeSet<&str> = named.iter().map(|k| k.name.as_str()).collect();
        let namespace = group.resource.key.namespace.clone();
        let (_, mut state) = self.confirm(id, group).await?;
        // Marks written by this call: the Machine and the value it carried before.
        let mut written: Vec<(ObjectKey, Option<String>)> = Vec::new();
        let mut attempt = 0;
        let (group, decrement) = loop {
            let (group, marks, decided) = self.deletion_of(id, &names, &state)?;
            let (mark, decrement) = match decided {
                Decided::Refused(e) => {
                    self.take_back(&written, &delete_key).await;
                    return Err(e);
                }
                Decided::Proceed {
                    mark, decrement, ..
                } => (mark, decrement),
            };
            if let Err(e) = before_marking(&group, &mark) {
                self.take_back(&written, &delete_key).await;
                return Err(e);
            }
            let total = (decrement + pool_owed) as i32;
            let desired = state.replicas - total;
            if total > 0 && !removal::within_bounds(state.replicas, desired, state.min, state.max) {
                self.take_back(&written, &delete_key).await;
                return Err(state.out_of_bounds(
                    &group,
                    &format!("deleting {total} node(s)"),
                    desired,
                ));
            }
            let mut changed = None;
            for name in &mark {
                let key = ObjectKey::new(namespace.as_str(), name.as_str());
                let previous = marks
                    .iter()
                    .find(|(n, _)| n == name)
                    .and_then(|(_, v)| v.clone());
                match self.mark(&key, &delete_key, &state.ledger).await {
                    Ok(true) => {
                        if !written.iter().any(|(k, _)| *k == key) {
                            written.push((key, previous));
                        }
                    }
                    Ok(false) => {
                        changed = Some(key);
                        break;
                    }
                    Err(e) => {
                        // A mark that landed unseen is owed a decrement: a retry pays it, else
                        // the repair takes it back after the grace period.
                        self.take_back(&written, &delete_key).await;
                        return Err(e);
                    }
                }
            }
            let Some(key) = changed else {
                break (group, decrement);
            };
            attempt += 1;
            if attempt >= MAX_ATTEMPTS {
                self.take_back(&written, &delete_key).await;
                return Err(ActuatorError::Conflict(format!(
                    "{id}: Machine {key} kept changing while it was being marked, {MAX_ATTEMPTS} attempts"
                )));
            }
            self.read_machine(&key).await?;
            state = self.cached(&group)?;
        };
        // Checked again over every version the write meets (a conflict re-reads the group and
        // lists the Machines): a mark written meanwhile refuses it; an earlier attempt that landed
        // is not paid twice; replicas lowered by someone else meanwhile are taken as paying for
        // the named Machines (Cluster API deletes the marked ones first for them).
        let decided = (state.replicas, state.ledger.clone());
        let result = self
            .write(&group, operation, true, |state| {
                let (now_group, marks, now) = self.deletion_of(id, &names, state)?;
                before_marking(&now_group, &[])?;
                match now {
                    Decided::Refused(e) => return Err(e),
                    Decided::Proceed { mark, .. } if !mark.is_empty() => {
                        return Err(ActuatorError::Conflict(format!(
                            "{id}: the delete mark of Machine(s) {} was removed while they were being removed",
                            mark.join(", ")
                        )));
                    }
                    Decided::Proceed { .. } => {}
                }
                // A repair is taking one of these marks back (another provider's, which decided
                // from the objects that no decrement paid it): paying it now would land after the
                // unmark, and Cluster API would delete a Machine nobody marked.
                if let Some((name, _)) = marks.iter().find(|(name, mark)| {
                    names.contains(name.as_str()) && state.taking_back.pays(name, mark.as_deref())
                }) {
                    return Err(ActuatorError::Refused(format!(
                        "{id}: the delete mark of Machine {name} is being taken back by a repair (its {TAKING_BACK_ANNOTATION} annotation): nothing written; ask again once it is gone, as a fresh removal"
                    )));
                }
                // The named Machines' marks (ours, or another's kept as its writer left it) that
                // no entry pays for yet.
                let paid_at = now_unix();
                let unpaid: Vec<String> = marks
                    .iter()
                    .filter(|(name, _)| names.contains(name.as_str()))
                    .filter_map(|(name, mark)| {
                        let mark = mark.as_deref()?;
                        (!state.ledger.pays(name, Some(mark)))
                            .then(|| payment_entry(name, mark, paid_at))
                    })
                    .collect();
                let owed = removal::still_owed(
                    decrement,
                    (decided.0, &decided.1),
                    (state.replicas, &state.ledger),
                )
                .min(unpaid.len());
                if owed == 0 {
                    return Ok(None);
                }
                Ok(Some(Change {
                    replicas: state.replicas - owed as i32,
                    entries: unpaid.into_iter().take(owed).collect(),
                }))
            })
            .await;
        match result {
            Ok(_) => Ok(group),
            Err(e) if e.is_unreachable() => {
                tracing::warn!(group = %group.id, "decrement outcome unknown, the marks stay for the counts to settle: {e}");
                Err(e)
            }
            Err(e) => {
                if !written.is_empty() {
                    tracing::warn!(group = %group.id, "decrement failed, taking the delete marks back: {e}");
                }
                self.take_back(&written, &delete_key).await;
                Err(e)
            }
        }
    }

    /// Writes our mark on Machine `key`, dated after every ledger entry of it, guarded by the
    /// version the decision saw: two providers removing one node at once would otherwise both
    /// mark it, each with its own time, and both pay. `false`: the Machine changed since (nothing
    /// written).
    async fn mark(
        &self,
        key: &ObjectKey,
        delete_key: &str,
        ledger: &Ledger,
    ) -> Result<bool, ActuatorError> {
        let api = self.machine_api(&key.namespace);
        let what = format!("marking Machine {key} for deletion");
        let mark_time = ledger.fresh_mark_time(&key.name, now_unix());
        let mut patch = json!({"metadata": {"annotations": {delete_key: our_mark(mark_time)}}});
        if let Some(machine) = self.store.cached_machine(key) {
            patch["metadata"]["resourceVersion"] = json!(machine.resource_version);
        }
        let started = Instant::now();
        match call(
            &what,
            api.patch(&key.name, &write_params(), &Patch::Merge(&patch)),
        )
        .await
        {
            Ok(marked) => {
                self.metrics
                    .api_write("mark-machine", "ok", started.elapsed());
                self.store.record(None, marked);
                Ok(true)
            }
            Err(ApiFailure::Conflict) => {
                self.metrics
                    .api_write("mark-machine", "conflict", started.elapsed());
                Ok(false)
            }
            Err(ApiFailure::Other(e)) => {
                self.metrics
                    .api_write("mark-machine", "error", started.elapsed());
                Err(e)
            }
        }
    }

    /// Takes back the marks this call wrote, each restoring what the Machine carried before.
    async fn take_back(&self, written: &[(ObjectKey, Option<String>)], delete_key: &str) {
        for (key, previous) in written {
            self.unmark(key, delete_key, previous.as_deref(), None)
                .await;
        }
    }

    /// Reads Machine `key` from the API into the cache.
    async fn read_machine(&self, key: &ObjectKey) -> Result<(), ActuatorError> {
        let what = format!("reading Machine {key}");
        let object = call(&what, self.machine_api(&key.namespace).get(&key.name))
            .await
            .map_err(|e| other(e, &what))?;
        self.store.record(None, object);
        Ok(())
    }

    /// The group read from the API, then its namespace's Machines listed, into the cache; the group
    /// and its state as cached after that. What a removal writes depends on every Machine's mark
    /// and on replicas, which a lagging cache can get wrong (a Machine CAPI has just created or
    /// deleted, a mark someone just wrote, replicas lowered by hand, another provider's raise or
    /// payment not seen yet).
    async fn confirm(
        &self,
        id: &str,
        group: &NodeGroup,
    ) -> Result<(NodeGroup, GroupState), ActuatorError> {
        self.live(group).await?;
        self.sync_machines(&group.resource.key.namespace).await?;
        let (_, group) = self.group(id)?;
        let state = self.cached(&group)?;
        Ok((group, state))
    }

    /// Takes our mark back (restoring `previous`). With `resource_version`, only from that version of
    /// the Machine, so a mark set again meanwhile is left alone.
    async fn unmark(
        &self,
        key: &ObjectKey,
        delete_key: &str,
        previous: Option<&str>,
        resource_version: Option<&str>,
    ) -> bool {
        let api = self.machine_api(&key.namespace);
        let what = format!("taking back the delete mark of Machine {key}");
        let mut unmark = json!({"metadata": {"annotations": {delete_key: previous}}});
        if let Some(rv) = resource_version {
            unmark["metadata"]["resourceVersion"] = json!(rv);
        }
        let started = Instant::now();
        match call(
            &what,
            api.patch(&key.name, &write_params(), &Patch::Merge(&unmark)),
        )
        .await
        {
            Ok(obj) => {
                self.metrics
                    .api_write("unmark-machine", "ok", started.elapsed());
                self.store.record(None, obj);
                true
            }
            Err(ApiFailure::Other(ActuatorError::NotFound(_))) => true,
            Err(e) => {
                self.metrics
                    .api_write("unmark-machine", "error", started.elapsed());
                tracing::warn!(machine = %key, "{what} failed: {e:?}; the repair retries it");
                false
            }
        }
    }

    /// Takes back the marks of ours that replicas do not pay for and that are older than `grace` (as
    /// the cache shows it, confirmed from the API), in groups no provider raised within `grace`
    /// (the group's [`RAISED_ANNOTATION`]): what a crash, a lost answer or a dropped call left
    /// between the two writes of a removal, or a raise absorbed (see [`removal::orphans`]). The node
    /// stays; CA asks again if it still wants it gone, a fresh removal. Each repair is logged,
    /// counted (`api_writes_total{operation="repair-unmark"}`) and recorded as an Event on the
    /// Machine.
    pub async fn repair(&self, grace: Duration) -> usize {
        let snapshot = self.store.snapshot();
        let delete_key = self.store.settings().keys.delete_machine.clone();
        let mut repaired = 0;
        for (id, _) in snapshot.groups.iter() {
            let group_lock = self.group_lock(&snapshot, id);
            let _guard = group_lock.lock().await;
            // Fresh after taking the lock: an operation that just finished has recorded its writes.
            self.store.refresh();
            let current = self.store.snapshot();
            let Some(group) = current.group(id) else {
                continue;
            };
            let Ok(cached) = self.cached(group) else {
                continue;
            };
            // Taking back a mark whose decrement did land would let CAPI remove an unmarked Machine,
            // and the caches lag the API (for seconds after an outage, while Machines come and go;
            // another provider's raise or payment). So what the cache shows unpaid is confirmed
            // from the group and its Machines as the API has them before anything is taken back.
            if self.unpaid_marks(group, &cached, grace).is_empty() {
                continue;
            }
            // The group read, then its Machines listed: a Machine created or deleted after the
            // read only makes fewer marks look unpaid. Another provider's removal between the two
            // is marked before its decrement, so it looks paid, or owed and too young to take.
            let live = match self.live(group).await {
                Ok(live) => live,
                Err(e) => {
                    tracing::debug!(group = %group.id, "repair postponed: {e}");
                    continue;
                }
            };
            if let Err(e) = self.sync_machines(&group.resource.key.namespace).await {
                tracing::debug!(group = %group.id, "repair postponed: {e}");
                continue;
            }
            let Ok((_, group)) = self.group(id) else {
                continue;
            };
            let confirmed = self.unpaid_marks(&group, &live, grace);
            if confirmed.is_empty() {
                continue;
            }
            // Recorded on the group first, guarded by the version decided from: a decrement in
            // flight from another provider then either landed before (this conflicts; the mark is
            // paid and stays) or meets a conflict after, reads the record, and pays nothing.
            if let Err(e) = self.record_taking_back(&group, &live, &confirmed).await {
                tracing::debug!(group = %group.id, "repair postponed: {e}");
                continue;
            }
            for (key, version) in confirmed {
                if self.unmark(&key, &delete_key, None, Some(&version)).await {
                    repaired += 1;
                    self.metrics.mark_repaired();
                    let note = format!(
                        "{}: delete mark taken back: the replicas of {} do not pay for it (a removal interrupted part-way, or a raise absorbed its decrement); the node stays",
                        group.id, group.resource.key
                    );
                    tracing::warn!(group = %group.id, machine = %key, "{note}");
                    self.store.machine_event(&key, "DeleteMarkRepaired", note);
                }
            }
        }
        repaired
    }

    /// Writes the marks about to be taken back into the group's [`TAKING_BACK_ANNOTATION`]
    /// (dropping entries whose Machine no longer carries that mark), guarded by `live`'s version.
    async fn record_taking_back(
        &self,
        group: &NodeGroup,
        live: &GroupState,
        confirmed: &[(ObjectKey, String)],
    ) -> Result<(), ActuatorError> {
        let mut record = live
            .taking_back
            .still_marked(|name| self.cached_mark_time(group, name));
        for (key, _) in confirmed {
            if let Some(t) = self.cached_mark_time(group, &key.name) {
                record.insert(mark_entry(&key.name, t));
            }
        }
        let key = &group.resource.key;
        let api = self.group_api(group.kind(), &key.namespace)?;
        let what = format!(
            "recording the marks a repair takes back on {} {key}",
            group.kind()
        );
        let patch = json!({"metadata": {
            "resourceVersion": live.resource_version,
            "annotations": {TAKING_BACK_ANNOTATION: record.render()},
        }});
        let started = Instant::now();
        match call(
            &what,
            api.patch(&key.name, &write_params(), &Patch::Merge(&patch)),
        )
        .await
        {
            Ok(object) => {
                self.metrics
                    .api_write("repair-record", "ok", started.elapsed());
                self.store.record(Some(group.kind()), object);
                Ok(())
            }
            Err(ApiFailure::Conflict) => {
                self.metrics
                    .api_write("repair-record", "conflict", started.elapsed());
                Err(ActuatorError::Conflict(format!(
                    "{what}: the group changed since the repair read it"
                )))
            }
            Err(ApiFailure::Other(e)) => {
                self.metrics
                    .api_write("repair-record", "error", started.elapsed());
                Err(e)
            }
        }
    }

    /// Our marks on `group`'s Machines that `state` (replicas, ledger, last raise) does not pay for
    /// and that are older than `grace`, as the index shows them (see [`removal::orphans`]), with
    /// the version of each Machine (for a guarded unmark).
    fn unpaid_marks(
        &self,
        group: &NodeGroup,
        state: &GroupState,
        grace: Duration,
    ) -> Vec<(ObjectKey, String)> {
        let delete_key = &self.store.settings().keys.delete_machine;
        let machines = self.machines(group);
        let states = members(group, &machines, delete_key);
        let counts = Counts::of(state.replicas, &state.ledger, states.iter().copied());
        removal::orphans(
            &states,
            &state.ledger,
            &counts,
            state.raised,
            now_unix(),
            grace.as_secs(),
        )
        .into_iter()
        .filter_map(|name| machines.iter().find(|(k, _)| k.name == name))
        .map(|(k, m)| (k.clone(), m.resource_version.clone()))
        .collect()
    }

    /// Runs [`Actuator::repair`] now and then every `interval`.
    pub fn spawn_repair(self: &Arc<Self>, interval: Duration, grace: Duration) {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                if me.store.is_ready() {
                    me.repair(grace).await;
                }
                tokio::time::sleep(interval).await;
            }
        });
    }
}

/// A check [`Actuator::remove_machines`] runs over the group (as cached) and the Machines it is
/// about to mark, before marking them: a DecreaseTargetSize never marks a Machine that got its
/// Node since it decided.
type BeforeMarking<'a> = dyn Fn(&NodeGroup, &[String]) -> Result<(), ActuatorError> + Sync + 'a;

/// Each Machine of a group with the delete mark it carries (as cached).
type Marks = Vec<(String, Option<String>)>;

/// What [`removal::deletion`] decided, owned (the rules borrow from the cache's Machines).
enum Decided {
    Proceed { mark: Vec<String>, decrement: usize },
    Refused(ActuatorError),
}

/// Refuses `operation` while the group's MachineDeployment rolls out: the MachineDeployment
/// controller then picks which MachineSet shrinks (the old one, within maxUnavailable), so a lower
/// replica count may remove a registered node of it instead of the one marked or the one pending.
fn refuse_during_rollout(group: &NodeGroup, operation: &str) -> Result<(), ActuatorError> {
    match &group.rollout {
        Some(rollout) => Err(ActuatorError::Refused(format!(
            "{}: MachineDeployment {} is rolling out ({}): {operation} is paused until the rollout finishes",
            group.id,
            group.resource.key,
            rollout.reason()
        ))),
        None => Ok(()),
    }
}

/// The refusal of a DeleteNodes while other Machines carry a delete mark the replicas do not
/// remove yet: Cluster API deletes marked Machines first, whoever marked them, so a decrement now
/// would remove one of those instead of, or besides, a named one. Nothing is written.
fn others_marked_refusal(group: &NodeGroup, state: &GroupState, others: &[&str]) -> ActuatorError {
    ActuatorError::Refused(format!(
        "{}: other Machines of {} {} carry the delete-machine mark and replicas ({}) do not remove them yet: {}; Cluster API deletes marked Machines first, whoever marked them, so lowering replicas now would remove one of them instead of the named node(s); nothing written. Remove those marks, or lower replicas for them, and the removal can proceed",
        group.id,
        group.kind(),
        group.resource.key,
        state.replicas,
        others.join(", "),
    ))
}

/// The refusal of a DecreaseTargetSize that would make Cluster API remove a marked or a
/// registered Machine.
fn cancellation_refusal(
    group: &NodeGroup,
    replicas: i32,
    delta: i32,
    why: &Cancellation<'_>,
) -> ActuatorError {
    let what = match why {
        Cancellation::Marked(names) => format!(
            "Machines {} carry the delete-machine mark and Cluster API deletes them first",
            names.join(", ")
        ),
        Cancellation::Registered { removes, pending } => format!(
            "Cluster API would remove {removes} unmarked Machine(s) and only {pending} never got a node"
        ),
        Cancellation::Unhealthy(names) => format!(
            "Cluster API ranks the registered Machine(s) {} unhealthy (NodeHealthy or HealthCheckSucceeded False), like those without a node, and would remove them by name first",
            names.join(", ")
        ),
    };
    ActuatorError::Refused(format!(
        "{}: attempt to delete existing nodes: replicas {replicas}, delta {delta}: {what}",
        group.id
    ))
}

/// The refusal of a DeleteNodes naming nodes whose paid marks a raise absorbed: nothing is written,
/// CA cleans its taint off the nodes and may ask again, a fresh removal once the repair has taken
/// the marks back.
fn absorbed_refusal(
    group: &NodeGroup,
    state: &GroupState,
    counts: &Counts,
    machines: &[&str],
) -> ActuatorError {
    let nodes: Vec<String> = machines.iter().map(|m| format!("Machine {m}")).collect();
    ActuatorError::Refused(format!(
        "{}: {}: removal paid already (the mark is in the {LEDGER_ANNOTATION} annotation of {} {}), but replicas were raised since: {} replicas make Cluster API remove {} of the group's {} Machines with a paid mark, so the raise absorbed {}: which marked Machine stays as its capacity is Cluster API's choice; refused until the repair takes the absorbed marks back (the mark grace period after the last raise), after which this is a fresh removal",
        group.id,
        nodes.join(", "),
        group.kind(),
        group.resource.key,
        state.replicas,
        counts.surplus(),
        counts.paid,
        counts.absorbed(),
    ))
}

/// What the removal rules need of a cached Machine.
fn machine_state<'a>(
    key: &'a ObjectKey,
    machine: &'a crate::capi::Machine,
    delete_key: &str,
) -> MachineState<'a> {
    let registered = machine.node_ref.is_some();
    MachineState {
        name: &key.name,
        deleting: machine.deleting,
        mark: machine.annotations.get(delete_key).map(String::as_str),
        registered,
        unhealthy: registered && (machine.conditions_unhealthy || machine.failure.is_some()),
        machineless: false,
    }
}

/// Whether CA names an instance Cluster API's preflight checks hold back (CA's fake node for it
/// carries the instance id as providerID and name).
fn is_held(node: &NodeToDelete) -> bool {
    preflight::is_held_id(&node.provider_id) || preflight::is_held_id(&node.name)
}

/// The group's members in the rules' terms: its Machines (as cached: `machines`, see
/// [`Actuator::machines`]) and, for a MachinePool, the instances of its providerIDList without a
/// Machine.
fn members<'a>(
    group: &'a NodeGroup,
    machines: &'a [(ObjectKey, Arc<crate::capi::Machine>)],
    delete_key: &str,
) -> Vec<MachineState<'a>> {
    machines
        .iter()
        .map(|(k, m)| machine_state(k, m, delete_key))
        .chain(
            group
                .instances
                .iter()
                .filter(|i| i.machine.is_none())
                .map(|i| MachineState {
                    name: &i.id,
                    deleting: false,
                    mark: None,
                    registered: true,
                    unhealthy: false,
                    machineless: true,
                }),
        )
        .collect()
}

/// Each node to remove with its Machine (`None`: a MachinePool node listed in its providerIDList
/// without one, or an instance a preflight check holds back), duplicates dropped; an error, before anything is written, for a node of no group,
/// of another group, or without a Machine outside a pool's list.
fn removal_plan(
    snapshot: &Snapshot,
    keys: &crate::capi::Keys,
    group: &NodeGroup,
    nodes: &[NodeToDelete],
) -> Result<Vec<(NodeToDelete, Option<ObjectKey>)>, ActuatorError> {
    let id = group.id.as_str();
    let mut plan: Vec<(NodeToDelete, Option<ObjectKey>)> = Vec::new();
    let mut seen: BTreeSet<String> = BTreeSet::new();
    for node in nodes {
        let location = snapshot
            .locate(
                &NodeRef {
                    provider_id: &node.provider_id,
                    name: &node.name,
                    annotations: Some(&node.annotations),
                },
                keys,
            )
            .ok_or_else(|| {
                ActuatorError::NotFound(format!("{} belongs to no node group", node.describe()))
            })?;
        if location.group_id != id {
            return Err(ActuatorError::BadRequest(format!(
                "{} belongs to node group {:?}, not {id:?}",
                node.describe(),
                location.group_id
            )));
        }
        let dedupe = match &location.machine {
            Some(m) => format!("machine:{m}"),
            None => pool_node_entry(&node.provider_id),
        };
        if !seen.insert(dedupe) {
            continue;
        }
        if location.machine.is_none()
            && !is_held(node)
            && !(group.kind() == ScalableKind::MachinePool && location.in_pool_list)
        {
            return Err(ActuatorError::Refused(format!(
                "{}: no Machine found, and it is not in the providerIDList of {id}",
                node.describe()
            )));
        }
        plan.push((node.clone(), location.machine.clone()));
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_change_events_say_who_asked_from_and_to() {
        let change = |replicas, entries: &[&str]| Change {
            replicas,
            entries: entries.iter().map(|e| e.to_string()).collect(),
        };
        assert_eq!(
            size_change_event("increase-size", 1, &change(3, &[])),
            (
                "IncreaseSize",
                "replicas 1 → 3 for cluster-autoscaler IncreaseSize".to_string()
            )
        );
        assert_eq!(
            size_change_event(
                "delete-nodes",
                3,
                &change(1, &["md-0-a@1700000000", "md-0-b@1700000001"])
            ),
            (
                "DeleteNodes",
                "replicas 3 → 1 for cluster-autoscaler DeleteNodes (md-0-a, md-0-b)".to_string()
            )
        );
        assert_eq!(
            size_change_event("delete-nodes", 2, &change(1, &["id:aws:///i-1"])).1,
            "replicas 2 → 1 for cluster-autoscaler DeleteNodes (id:aws:///i-1)"
        );
        assert_eq!(
            size_change_event("decrease-target-size", 4, &change(2, &[])).0,
            "DecreaseTargetSize"
        );
    }

    #[test]
    fn api_errors_map_to_grpc_codes() {
        let api = |code: u16| {
            kube::Error::Api(
                kube::core::Status::failure("boom", "Reason")
                    .with_code(code)
                    .boxed(),
            )
        };
        assert!(matches!(classify("x", api(409)), ApiFailure::Conflict));
        let code = |c: u16| match classify("x", api(c)) {
            ApiFailure::Other(e) => tonic::Status::from(e).code(),
            ApiFailure::Conflict => tonic::Code::Aborted,
        };
        assert_eq!(code(404), tonic::Code::NotFound);
        assert_eq!(code(403), tonic::Code::PermissionDenied);
        assert_eq!(code(422), tonic::Code::FailedPrecondition);
        assert_eq!(code(503), tonic::Code::Unavailable);
    }
}
