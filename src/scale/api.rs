//! The API calls of the writer: each bounded in time, its failure classified in the domain's terms
//! (a conflict kept apart for the guarded write); the group object and its Machines read from the
//! API into the cache, and as cached in the removal rules' terms.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::{Api, ListParams, Patch, PatchParams};

use super::Actuator;
use super::state::GroupState;
use crate::backend::{ActuatorError, ApiCause};
use crate::capi::{ObjectKey, ScalableKind, ScalableResource, scaling_bounds};
use crate::object::ApiObject;
use crate::removal::{
    LEDGER_ANNOTATION, Ledger, MachineState, RAISED_ANNOTATION, TAKING_BACK_ANNOTATION,
    our_mark_time, pool_node_entry, raised_at,
};
use crate::snapshot::NodeGroup;

/// Bound on each API call, below CA's default gRPC deadline (5s).
const CALL_TIMEOUT: Duration = Duration::from_secs(4);

/// An API error, kept apart from conflicts so writes can retry those.
#[derive(Debug)]
pub(super) enum ApiFailure {
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

pub(super) async fn call<T>(
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

pub(super) fn other(e: ApiFailure, what: &str) -> ActuatorError {
    match e {
        ApiFailure::Conflict => ActuatorError::Conflict(format!("{what}: conflict")),
        ApiFailure::Other(e) => e,
    }
}

/// Every write names the provider as its field manager: managedFields and audit logs show who wrote.
pub(super) fn write_params() -> PatchParams {
    PatchParams {
        field_manager: Some("capi-autoscaler-provider".into()),
        ..PatchParams::default()
    }
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

/// The group's members in the rules' terms: its Machines (as cached: `machines`, see
/// [`Actuator::machines`]) and, for a MachinePool, the instances of its providerIDList without a
/// Machine.
pub(super) fn members<'a>(
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

impl Actuator {
    /// A guarded merge patch of `name`, its outcome (`ok`, `conflict`, `error`) and latency counted
    /// under `operation`.
    pub(super) async fn patch_counted(
        &self,
        api: &Api<ApiObject>,
        name: &str,
        patch: &serde_json::Value,
        what: &str,
        operation: &'static str,
    ) -> Result<ApiObject, ApiFailure> {
        let started = Instant::now();
        let result = call(what, api.patch(name, &write_params(), &Patch::Merge(patch))).await;
        let outcome = match &result {
            Ok(_) => "ok",
            Err(ApiFailure::Conflict) => "conflict",
            Err(ApiFailure::Other(_)) => "error",
        };
        self.metrics
            .api_write(operation, outcome, started.elapsed());
        result
    }

    pub(super) fn group_api(
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

    pub(super) fn machine_api(&self, namespace: &str) -> Api<ApiObject> {
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
        let (min, max) = scaling_bounds(&self.store.settings().keys, &resource.annotations)
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
    pub(super) fn cached(&self, group: &NodeGroup) -> Result<GroupState, ActuatorError> {
        let resource = self
            .store
            .cached_resource(group.kind(), &group.resource.key)
            .ok_or_else(|| ActuatorError::GroupNotFound {
                id: group.id.clone(),
            })?;
        self.state_of(group, &resource)
    }

    /// The group object as the API has it now (also put into the cache).
    pub(super) async fn live(&self, group: &NodeGroup) -> Result<GroupState, ActuatorError> {
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
    pub(super) async fn sync_machines(&self, namespace: &str) -> Result<(), ActuatorError> {
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
    pub(super) fn machines(
        &self,
        group: &NodeGroup,
    ) -> Vec<(ObjectKey, Arc<crate::capi::Machine>)> {
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
    pub(super) fn cached_mark(&self, group: &NodeGroup, name: &str) -> Option<String> {
        let delete_key = &self.store.settings().keys.delete_machine;
        self.store
            .cached_machine(&ObjectKey::new(group.resource.key.namespace.as_str(), name))
            .and_then(|m| m.annotations.get(delete_key).cloned())
    }

    /// The time of our mark on Machine `name` of `group`, as cached (`None`: gone, unmarked, or
    /// marked by someone else): what taking-back entries are matched against.
    pub(super) fn cached_mark_time(&self, group: &NodeGroup, name: &str) -> Option<u64> {
        self.cached_mark(group, name)
            .as_deref()
            .and_then(our_mark_time)
    }

    /// Reads Machine `key` from the API into the cache.
    pub(super) async fn read_machine(&self, key: &ObjectKey) -> Result<(), ActuatorError> {
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
    pub(super) async fn confirm(
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
