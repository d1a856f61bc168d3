//! The seam between the gRPC service and the writer: what the service answers from and writes
//! through ([`Backend`]), the nodes it names and the errors it gets back. The service and the
//! writer both depend on this module, never on each other.

use std::collections::HashMap;
use std::sync::Arc;

use crate::capi::{Keys, ScalableKind};
use crate::snapshot::Snapshot;

/// What the service answers from and writes through.
#[tonic::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The current view of the node groups.
    fn snapshot(&self) -> Arc<Snapshot>;
    /// Every watch has listed and a snapshot was built from that.
    fn is_complete(&self) -> bool;
    /// Why a write to a group of `kind` would be made against an old view; empty when it would not.
    fn stale_for_write(&self, kind: ScalableKind) -> Vec<String>;
    fn keys(&self) -> &Keys;
    /// Asks for a snapshot build (CA's Refresh).
    fn refresh(&self);
    /// Marked changed each time a snapshot is published (a backend that never publishes: closed).
    fn published(&self) -> tokio::sync::watch::Receiver<()> {
        tokio::sync::watch::channel(()).1
    }
    async fn increase_size(&self, id: &str, delta: i32) -> Result<(), ActuatorError>;
    async fn decrease_target_size(&self, id: &str, delta: i32) -> Result<(), ActuatorError>;
    async fn delete_nodes(&self, id: &str, nodes: &[NodeToDelete]) -> Result<(), ActuatorError>;
}

/// Why a scale operation failed, in the domain's terms; the wire module maps each to the status
/// code CA acts on.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum ActuatorError {
    /// No node group has this id (any more).
    #[error("node group {id:?} not found")]
    GroupNotFound { id: String },
    /// A node or an object the request names is not there.
    #[error("{0}")]
    NotFound(String),
    /// The request itself is wrong: a delta of the wrong sign, a node of another group.
    #[error("{0}")]
    BadRequest(String),
    /// The size the operation leads to is outside the bounds of the group object it would write.
    #[error("{group}: {operation}: desired size {desired} is outside [{min}, {max}]")]
    OutOfBounds {
        group: String,
        operation: String,
        desired: i32,
        min: i32,
        max: i32,
    },
    /// The group's state does not allow it: a rollout, a malformed object, registered nodes that
    /// would go.
    #[error("{0}")]
    Refused(String),
    /// Still conflicting with other writers after every attempt.
    #[error("{0}")]
    Conflict(String),
    /// The management cluster's API failed the call.
    #[error("{message}")]
    Api { cause: ApiCause, message: String },
    #[error("{0}")]
    Internal(String),
}

/// Why an API call failed, as far as a caller decides differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiCause {
    /// Not reached, no answer in time, or a server-side error: whether a write landed may be
    /// unknown, a retry finds out.
    Unreachable,
    /// The API refused this identity (RBAC).
    Forbidden,
    /// Any other answer.
    Failed,
}

impl ActuatorError {
    pub(crate) fn api(cause: ApiCause, message: String) -> Self {
        ActuatorError::Api { cause, message }
    }

    pub(crate) fn unreachable(message: String) -> Self {
        Self::api(ApiCause::Unreachable, message)
    }

    pub(crate) fn is_unreachable(&self) -> bool {
        matches!(
            self,
            ActuatorError::Api {
                cause: ApiCause::Unreachable,
                ..
            }
        )
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
    pub(crate) fn describe(&self) -> String {
        if self.provider_id.is_empty() {
            format!("node {:?}", self.name)
        } else {
            format!("node {:?} (providerID {:?})", self.name, self.provider_id)
        }
    }
}
