//! The API calls of the writer: each bounded in time, its failure classified in the domain's terms
//! (a conflict kept apart for the guarded write), and the APIs of the objects it reads and writes.

use std::future::Future;
use std::time::Duration;

use kube::api::{Api, PatchParams};

use super::Actuator;
use crate::backend::{ActuatorError, ApiCause};
use crate::capi::ScalableKind;
use crate::object::ApiObject;

/// Bound on each API call, below CA's default gRPC deadline (5s).
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(4);

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

impl Actuator {
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

    /// The MachineSets of `namespace` (a MachineDeployment's are read with it).
    pub(super) fn set_api(&self, namespace: &str) -> Result<Api<ApiObject>, ActuatorError> {
        self.group_api(ScalableKind::MachineSet, namespace)
    }

    /// The Clusters of `namespace`, when the API serves them.
    pub(super) fn cluster_api(&self, namespace: &str) -> Option<Api<ApiObject>> {
        let resource = self.store.apis().cluster.as_ref()?;
        Some(Api::namespaced_with(
            self.store.client().clone(),
            namespace,
            resource,
        ))
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
