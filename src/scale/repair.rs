//! The repair: takes back our delete marks the replicas do not pay for (a removal interrupted
//! between its two writes, or a raise that absorbed its decrement), confirmed from the API first.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::Patch;
use serde_json::json;

use super::api::{ApiFailure, call, members, write_params};
use super::removal::{self, Counts, TAKING_BACK_ANNOTATION, mark_entry};
use super::write::GroupState;
use super::{Actuator, now_unix};
use crate::backend::ActuatorError;
use crate::capi::ObjectKey;
use crate::snapshot::NodeGroup;

impl Actuator {
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
