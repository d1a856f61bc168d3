//! The only writer: runs the protocol's operations (`crate::protocol`: every decision is there)
//! against the API. `operations` turns CA's calls into operations, `execute` runs one (its reads in
//! `read`, its writes through `api`), `repair` runs the repair's rounds. One operation per group
//! at a time in this process; what other processes must know travels through the objects.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::backend::{ActuatorError, Backend, NodeToDelete};
use crate::capi::{Keys, ScalableKind};
use crate::lock;
use crate::metrics::Metrics;
use crate::snapshot::Snapshot;
use crate::watch::Store;

mod api;
pub(crate) use api::CALL_TIMEOUT;
mod execute;
mod operations;
mod read;
mod repair;

pub struct Actuator {
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    /// Per group that exists (pruned as groups go): one operation of this process at a time. What
    /// other processes must know (a raise, a paid removal) is written to the objects instead.
    groups: Mutex<HashMap<String, GroupLock>>,
    /// How long an operation waits for Cluster API or another writer before it gives up (and takes
    /// back what it wrote): within CA's deadline.
    wait: Duration,
    /// The repair's clock of records seen waiting (`repair::Waiting`).
    waiting: Mutex<repair::Waiting>,
    /// DeleteNodes in flight, by group and what they remove (`RemovalPlan::key`): CA asking
    /// again for the same nodes (its deadline passed, or its next loop came) is answered what the
    /// removal under way does, instead of queueing the same removal behind it.
    removals: Mutex<HashMap<String, operations::Answer>>,
}

/// A group's operation lock, over the newest revision this process's reads and writes of the
/// group's objects got back: no later read of it may be older (see [`Actuator::read`]).
type GroupLock = Arc<tokio::sync::Mutex<u64>>;

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

    fn published(&self) -> tokio::sync::watch::Receiver<()> {
        self.store.published()
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

impl Actuator {
    pub fn new(store: Arc<Store>, metrics: Arc<Metrics>) -> Self {
        Actuator {
            store,
            metrics,
            groups: Mutex::new(HashMap::new()),
            wait: Duration::from_secs(3),
            waiting: Mutex::new(HashMap::new()),
            removals: Mutex::new(HashMap::new()),
        }
    }

    /// How long an operation may wait for Cluster API or another writer (3 s unless set; the
    /// server gives it half of `--request-timeout`, leaving the rest for taking back what it wrote).
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
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
}

#[cfg(test)]
mod mock_api_tests;
