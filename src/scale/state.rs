//! A group object as a write starts from it: what every decision of the writer reads.

use std::collections::BTreeSet;

use crate::backend::ActuatorError;
use crate::removal::Ledger;
use crate::snapshot::NodeGroup;

/// The group object as a write starts from it: replicas, bounds, ledger and last raise of one
/// resourceVersion.
pub(super) struct GroupState {
    pub(super) replicas: i32,
    pub(super) min: i32,
    pub(super) max: i32,
    pub(super) ledger: Ledger,
    /// When replicas were last raised by any provider ([`crate::removal::RAISED_ANNOTATION`]).
    pub(super) raised: Option<u64>,
    /// Marks a repair is taking back ([`crate::removal::TAKING_BACK_ANNOTATION`]): no decrement pays them.
    pub(super) taking_back: Ledger,
    /// `spec.providerIDList` entries (normalised) of the same version: ledger entries of nodes no
    /// longer listed need no record.
    pub(super) listed: BTreeSet<String>,
    pub(super) resource_version: String,
}

impl GroupState {
    pub(super) fn out_of_bounds(
        &self,
        group: &NodeGroup,
        operation: &str,
        desired: i32,
    ) -> ActuatorError {
        ActuatorError::OutOfBounds {
            group: group.id.clone(),
            operation: operation.to_string(),
            desired,
            min: self.min,
            max: self.max,
        }
    }
}
