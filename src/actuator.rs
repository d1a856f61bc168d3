//! The only writer: replicas through the scale subresource, and the delete-machine annotation.
//!
//! One operation per group at a time. Every replica write carries the resourceVersion it was computed
//! from, so a concurrent change makes it fail with a conflict instead of overwriting; it is then
//! recomputed from a fresh read and bounds are checked again.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::json;

use crate::capi::{ObjectKey, ScalableKind};
use crate::metrics::Metrics;
use crate::snapshot::{NodeGroup, NodeRef, Snapshot};
use crate::store::Store;

/// Attempts at a replica write before giving up on conflicts.
const MAX_ATTEMPTS: usize = 8;
/// Bound on each API call, below CA's default gRPC deadline (5s).
const CALL_TIMEOUT: Duration = Duration::from_secs(4);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ActuatorError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Aborted(String),
    #[error("{0}")]
    Internal(String),
}

impl From<ActuatorError> for tonic::Status {
    fn from(e: ActuatorError) -> Self {
        match e {
            ActuatorError::NotFound(m) => tonic::Status::not_found(m),
            ActuatorError::InvalidArgument(m) => tonic::Status::invalid_argument(m),
            ActuatorError::FailedPrecondition(m) => tonic::Status::failed_precondition(m),
            ActuatorError::Unavailable(m) => tonic::Status::unavailable(m),
            ActuatorError::PermissionDenied(m) => tonic::Status::permission_denied(m),
            ActuatorError::Aborted(m) => tonic::Status::aborted(m),
            ActuatorError::Internal(m) => tonic::Status::internal(m),
        }
    }
}

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
            403 => ActuatorError::PermissionDenied(format!(
                "{what}: forbidden (check the provider's RBAC): {}",
                status.message
            )),
            400 | 422 => {
                ActuatorError::FailedPrecondition(format!("{what}: rejected: {}", status.message))
            }
            429 | 500..=599 => ActuatorError::Unavailable(format!(
                "{what}: API server error {}: {}",
                status.code, status.message
            )),
            code => {
                ActuatorError::Internal(format!("{what}: API error {code}: {}", status.message))
            }
        }),
        other => ApiFailure::Other(ActuatorError::Unavailable(format!(
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
        Err(_) => Err(ApiFailure::Other(ActuatorError::Unavailable(format!(
            "{what}: management cluster API did not answer within {CALL_TIMEOUT:?}"
        )))),
    }
}

fn other(e: ApiFailure, what: &str) -> ActuatorError {
    match e {
        ApiFailure::Conflict => ActuatorError::Aborted(format!("{what}: conflict")),
        ApiFailure::Other(e) => e,
    }
}

/// The node CA names, as far as DeleteNodes needs it.
#[derive(Clone, Debug, Default)]
pub struct NodeToDelete {
    pub provider_id: String,
    pub name: String,
    pub annotations: HashMap<String, String>,
}

impl NodeToDelete {
    fn describe(&self) -> String {
        if self.provider_id.is_empty() {
            format!("node {:?}", self.name)
        } else {
            format!("node {:?} (providerID {:?})", self.name, self.provider_id)
        }
    }
}

pub struct Actuator {
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// MachinePool nodes without a Machine whose replica was already taken off, so a retry of the same
    /// node does not take a second one; kept until the node leaves the pool's providerIDList.
    pool_decrements: Mutex<BTreeSet<(String, String)>>,
}

/// A target replica count and the resourceVersion it is based on.
struct Replicas {
    replicas: i32,
    resource_version: String,
}

impl Actuator {
    pub fn new(store: Arc<Store>, metrics: Arc<Metrics>) -> Self {
        Actuator {
            store,
            metrics,
            locks: Mutex::new(HashMap::new()),
            pool_decrements: Mutex::new(BTreeSet::new()),
        }
    }

    fn group_lock(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(locks.entry(id.to_string()).or_default())
    }

    fn group(&self, id: &str) -> Result<(Arc<Snapshot>, NodeGroup), ActuatorError> {
        let snapshot = self.store.snapshot();
        let group = snapshot
            .group(id)
            .cloned()
            .ok_or_else(|| ActuatorError::NotFound(format!("node group {id:?} not found")))?;
        Ok((snapshot, group))
    }

    fn scale_api(
        &self,
        kind: ScalableKind,
        namespace: &str,
    ) -> Result<Api<DynamicObject>, ActuatorError> {
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

    fn machine_api(&self, namespace: &str) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.store.client().clone(),
            namespace,
            &self.store.apis().machine,
        )
    }

    /// Replicas as cached (read-your-writes included).
    fn cached(&self, group: &NodeGroup) -> Result<Replicas, ActuatorError> {
        match self
            .store
            .cached_replicas(group.kind(), &group.resource.key)
        {
            Some((Some(replicas), resource_version)) => Ok(Replicas {
                replicas,
                resource_version,
            }),
            _ => Err(ActuatorError::NotFound(format!(
                "node group {:?} is gone",
                group.id
            ))),
        }
    }

    /// Replicas as the API has them now.
    async fn live(&self, group: &NodeGroup) -> Result<Replicas, ActuatorError> {
        let api = self.scale_api(group.kind(), &group.resource.key.namespace)?;
        let what = format!(
            "reading the scale of {} {}",
            group.kind(),
            group.resource.key
        );
        let scale = call(&what, api.get_scale(&group.resource.key.name))
            .await
            .map_err(|e| other(e, &what))?;
        Ok(Replicas {
            replicas: scale.spec.and_then(|s| s.replicas).unwrap_or(0),
            resource_version: scale.metadata.resource_version.unwrap_or_default(),
        })
    }

    /// Sets replicas to `target(current)`, guarded by resourceVersion, re-reading on conflict.
    /// `target` checks bounds against the current value and may refuse.
    async fn write_replicas(
        &self,
        group: &NodeGroup,
        operation: &'static str,
        target: impl Fn(i32) -> Result<i32, ActuatorError>,
    ) -> Result<i32, ActuatorError> {
        let key = &group.resource.key;
        let api = self.scale_api(group.kind(), &key.namespace)?;
        let what = format!("scaling {} {}", group.kind(), key);
        let mut current = self.cached(group)?;
        for attempt in 0..MAX_ATTEMPTS {
            if attempt > 0 {
                current = self.live(group).await?;
            }
            let desired = target(current.replicas)?;
            if desired < group.min || desired > group.max {
                return Err(ActuatorError::FailedPrecondition(format!(
                    "{}: {desired} replicas is outside [{}, {}]",
                    group.id, group.min, group.max
                )));
            }
            let patch = json!({
                "metadata": {"resourceVersion": current.resource_version},
                "spec": {"replicas": desired},
            });
            let started = Instant::now();
            match call(
                &what,
                api.patch_scale(&key.name, &PatchParams::default(), &Patch::Merge(&patch)),
            )
            .await
            {
                Ok(scale) => {
                    self.metrics.api_write(operation, "ok");
                    let replicas = scale.spec.and_then(|s| s.replicas).unwrap_or(desired);
                    let rv = scale.metadata.resource_version.unwrap_or_default();
                    self.store.record_replicas(group.kind(), key, replicas, &rv);
                    tracing::info!(group = %group.id, from = current.replicas, to = replicas, elapsed = ?started.elapsed(), "{operation}");
                    return Ok(replicas);
                }
                Err(ApiFailure::Conflict) => {
                    self.metrics.api_write(operation, "conflict");
                    continue;
                }
                Err(ApiFailure::Other(e)) => {
                    self.metrics.api_write(operation, "error");
                    // The write may have landed before the answer was lost: look before reporting failure.
                    if matches!(e, ActuatorError::Unavailable(_))
                        && let Ok(now) = self.live(group).await
                        && now.replicas == desired
                        && now.resource_version != current.resource_version
                    {
                        self.store.record_replicas(
                            group.kind(),
                            key,
                            now.replicas,
                            &now.resource_version,
                        );
                        return Ok(now.replicas);
                    }
                    return Err(e);
                }
            }
        }
        Err(ActuatorError::Aborted(format!(
            "{what}: still conflicting after {MAX_ATTEMPTS} attempts"
        )))
    }

    pub async fn increase_size(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
        let result = self.increase(id, delta).await;
        self.store.refresh();
        result
    }

    /// Cancels capacity that has not become nodes yet; never removes a registered node.
    pub async fn decrease_target_size(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
        let result = self.decrease(id, delta).await;
        self.store.refresh();
        result
    }

    /// Marks each node's Machine for deletion and lowers replicas by one per node, node by node. A node
    /// whose removal is already under way (Machine deleting, or marked by this provider) is skipped, so
    /// CA's retries do not lower replicas twice.
    pub async fn delete_nodes(
        &self,
        id: &str,
        nodes: &[NodeToDelete],
    ) -> Result<(), ActuatorError> {
        let result = self.delete(id, nodes).await;
        // One snapshot build for the whole operation: every write above went into the index already.
        self.store.refresh();
        result
    }

    async fn increase(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
        if delta <= 0 {
            return Err(ActuatorError::InvalidArgument(format!(
                "size increase must be positive, got delta {delta}"
            )));
        }
        let lock = self.group_lock(id);
        let _guard = lock.lock().await;
        let (_, group) = self.group(id)?;
        self.write_replicas(&group, "increase-size", |current| {
            let desired = current.saturating_add(delta);
            if desired > group.max {
                return Err(ActuatorError::FailedPrecondition(format!(
                    "{id}: size increase too large: desired {desired}, max {}",
                    group.max
                )));
            }
            Ok(desired)
        })
        .await
        .map(|_| ())
    }

    async fn decrease(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
        if delta >= 0 {
            return Err(ActuatorError::InvalidArgument(format!(
                "size decrease must be negative, got delta {delta}"
            )));
        }
        let lock = self.group_lock(id);
        let _guard = lock.lock().await;
        let (_, group) = self.group(id)?;
        let registered = group.registered;
        self.write_replicas(&group, "decrease-target-size", |current| {
            let desired = current.saturating_add(delta);
            if desired < registered {
                return Err(ActuatorError::FailedPrecondition(format!(
                    "{id}: attempt to delete existing nodes: replicas {current}, delta {delta}, registered nodes {registered}"
                )));
            }
            if desired < group.min {
                return Err(ActuatorError::FailedPrecondition(format!(
                    "{id}: size decrease too large: desired {desired}, min {}",
                    group.min
                )));
            }
            Ok(desired)
        })
        .await
        .map(|_| ())
    }

    async fn delete(&self, id: &str, nodes: &[NodeToDelete]) -> Result<(), ActuatorError> {
        let lock = self.group_lock(id);
        let _guard = lock.lock().await;
        let (snapshot, group) = self.group(id)?;
        let keys = &self.store.settings().keys;
        if group.kind() == ScalableKind::MachinePool {
            let listed: BTreeSet<&String> = group.resource.provider_id_list.iter().collect();
            self.pool_decrements
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|(g, provider_id)| g != id || listed.contains(provider_id));
        }

        // Resolve every node before touching anything.
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
                return Err(ActuatorError::InvalidArgument(format!(
                    "{} belongs to node group {:?}, not {id:?}",
                    node.describe(),
                    location.group_id
                )));
            }
            let dedupe = match &location.machine {
                Some(m) => format!("machine:{m}"),
                None => format!("node:{}", node.provider_id),
            };
            if !seen.insert(dedupe) {
                continue;
            }
            if location.machine.is_none()
                && !(group.kind() == ScalableKind::MachinePool && location.in_pool_list)
            {
                return Err(ActuatorError::FailedPrecondition(format!(
                    "{}: no Machine found, and it is not in the providerIDList of {id}",
                    node.describe()
                )));
            }
            plan.push((node.clone(), location.machine.clone()));
        }

        // Up front, so a call that would cross min changes nothing.
        let current = self.cached(&group)?.replicas;
        let removals = plan
            .iter()
            .filter(|(node, machine)| {
                self.needs_decrement(&group, node, machine.as_ref()) != Removal::Skip
            })
            .count() as i32;
        if removals > 0 && current - removals < group.min {
            return Err(ActuatorError::FailedPrecondition(format!(
                "{id}: deleting {removals} node(s) would take replicas from {current} below min size {}",
                group.min
            )));
        }

        for (node, machine) in &plan {
            match self.needs_decrement(&group, node, machine.as_ref()) {
                Removal::Skip => {
                    tracing::info!(group = id, node = %node.describe(), "already being removed, not decrementing again");
                }
                Removal::MarkAndDecrement => {
                    if let Some(machine) = machine {
                        self.remove_machine(&group, machine).await?;
                    }
                }
                Removal::DecrementOnly => {
                    self.write_replicas(&group, "delete-nodes", |current| Ok(current - 1))
                        .await?;
                    if machine.is_none() {
                        self.pool_decrements
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert((id.to_string(), node.provider_id.clone()));
                        tracing::warn!(group = id, node = %node.describe(), "no Machine for this MachinePool node: lowered replicas only");
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether removing this node still needs a replica decrement.
    fn needs_decrement(
        &self,
        group: &NodeGroup,
        node: &NodeToDelete,
        machine: Option<&ObjectKey>,
    ) -> Removal {
        let Some(key) = machine else {
            let done = self
                .pool_decrements
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&(group.id.clone(), node.provider_id.clone()));
            return if done {
                Removal::Skip
            } else {
                Removal::DecrementOnly
            };
        };
        let delete_key = &self.store.settings().keys.delete_machine;
        let Some(cached) = self.store.cached_machine(key) else {
            return Removal::MarkAndDecrement;
        };
        if cached.deleting {
            return Removal::Skip;
        }
        // Our own mark is only ever left in place together with its decrement (a failed decrement takes
        // it back), so it means this node was already counted. A mark someone else set was not.
        match cached.annotations.get(delete_key) {
            Some(value) if is_our_mark(value) => Removal::Skip,
            _ => Removal::MarkAndDecrement,
        }
    }

    /// Mark, then decrement; if the decrement fails, take the mark back so no Machine stays marked
    /// without its decrement.
    async fn remove_machine(
        &self,
        group: &NodeGroup,
        key: &ObjectKey,
    ) -> Result<(), ActuatorError> {
        let delete_key = self.store.settings().keys.delete_machine.clone();
        // A mark someone else set is restored, not removed, if our decrement fails.
        let previous = self
            .store
            .cached_machine(key)
            .and_then(|m| m.annotations.get(&delete_key).cloned());
        let api = self.machine_api(&key.namespace);
        let what = format!("marking Machine {key} for deletion");
        let mark = json!({"metadata": {"annotations": {delete_key.as_str(): our_mark()}}});
        let marked = match call(
            &what,
            api.patch(&key.name, &PatchParams::default(), &Patch::Merge(&mark)),
        )
        .await
        {
            Ok(obj) => obj,
            Err(e) => {
                self.metrics.api_write("mark-machine", "error");
                let e = other(e, &what);
                // The mark may have landed although the answer was lost; take it back to be sure.
                if matches!(e, ActuatorError::Unavailable(_)) {
                    self.unmark(key, &delete_key, previous.as_deref()).await;
                }
                return Err(e);
            }
        };
        self.metrics.api_write("mark-machine", "ok");
        self.store.record_machine(&marked);
        match self
            .write_replicas(group, "delete-nodes", |current| Ok(current - 1))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::warn!(group = %group.id, machine = %key, "decrement failed, taking the delete mark back: {e}");
                self.unmark(key, &delete_key, previous.as_deref()).await;
                Err(e)
            }
        }
    }

    async fn unmark(&self, key: &ObjectKey, delete_key: &str, previous: Option<&str>) {
        let api = self.machine_api(&key.namespace);
        let what = format!("taking back the delete mark of Machine {key}");
        let unmark = json!({"metadata": {"annotations": {delete_key: previous}}});
        match call(
            &what,
            api.patch(&key.name, &PatchParams::default(), &Patch::Merge(&unmark)),
        )
        .await
        {
            Ok(obj) => {
                self.metrics.api_write("unmark-machine", "ok");
                self.store.record_machine(&obj);
            }
            Err(ApiFailure::Other(ActuatorError::NotFound(_))) => {}
            Err(e) => {
                self.metrics.api_write("unmark-machine", "error");
                tracing::error!(
                    machine = %key,
                    "{what} failed: {e:?}; it stays marked without its replica decrement until the mark is removed"
                );
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Removal {
    Skip,
    MarkAndDecrement,
    DecrementOnly,
}

/// Marks written by this provider end with this, so a retried DeleteNodes recognises them.
const MARK_SUFFIX: &str = " by capi-autoscaler-provider";

/// The annotation value: only presence matters to Cluster API; the time and the writer help people,
/// and the writer tells this provider's marks (each one paid for by a decrement) from others'.
fn our_mark() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("unix {}{MARK_SUFFIX}", now.as_secs())
}

fn is_our_mark(value: &str) -> bool {
    value.ends_with(MARK_SUFFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_marks_are_told_from_others() {
        assert!(is_our_mark(&our_mark()));
        assert!(!is_our_mark(
            "2024-01-02 15:04:05.123456789 +0000 UTC m=+12.3"
        ));
        assert!(!is_our_mark(""));
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
