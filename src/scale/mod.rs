//! The only writer: replicas (with the removal ledger, see `crate::removal`) and the delete-machine annotation.
//!
//! One operation per group at a time. Every replica write carries the resourceVersion it was computed
//! from, so a concurrent change makes it fail with a conflict instead of overwriting; it is then
//! recomputed from a fresh read and bounds are checked again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::backend::{ActuatorError, Backend, NodeToDelete};
use crate::capi::{Keys, ScalableKind};
use crate::lock;
use crate::metrics::Metrics;
use crate::snapshot::{NodeGroup, Snapshot};
use crate::watch::Store;

mod api;
mod marks;
mod operations;
mod repair;
mod state;
mod write;

/// Attempts at a replica write before giving up on conflicts.
const MAX_ATTEMPTS: usize = 8;

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
}

#[cfg(test)]
mod mock_api_tests;
