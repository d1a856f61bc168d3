//! The repair: takes back our delete marks the replicas do not pay for (a removal interrupted
//! between its two writes, or a raise that absorbed its decrement), confirmed from the API first.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::api::{ApiFailure, members};
use super::state::GroupState;
use super::{Actuator, now_unix};
use crate::backend::ActuatorError;
use crate::capi::{Machine, ObjectKey};
use crate::removal::{self, Counts, Ledger, MachineState, TAKING_BACK_ANNOTATION, mark_entry};
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
        let record = taking_back_record(&live.taking_back, confirmed, |name| {
            self.cached_mark_time(group, name)
        });
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
        match self
            .patch_counted(&api, &key.name, &patch, &what, "repair-record")
            .await
        {
            Ok(object) => {
                self.store.record(Some(group.kind()), object);
                Ok(())
            }
            Err(ApiFailure::Conflict) => Err(ActuatorError::Conflict(format!(
                "{what}: the group changed since the repair read it"
            ))),
            Err(ApiFailure::Other(e)) => Err(e),
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
        let members = members(group, &machines, delete_key);
        marks_to_take_back(&machines, &members, state, now_unix(), grace.as_secs())
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

/// What a repair takes back in a group (its decision, no I/O): of the group's `members` (the
/// rules' terms of `machines`, as cached), our marks `state` (replicas, ledger, last raise) does not
/// pay for and older than `grace_secs` at `now_unix` ([`removal::orphans`]), each with the version
/// of its Machine, so the unmark is guarded by the version decided from.
fn marks_to_take_back(
    machines: &[(ObjectKey, Arc<Machine>)],
    members: &[MachineState<'_>],
    state: &GroupState,
    now_unix: u64,
    grace_secs: u64,
) -> Vec<(ObjectKey, String)> {
    let counts = Counts::of(state.replicas, &state.ledger, members.iter().copied());
    removal::orphans(
        members,
        &state.ledger,
        &counts,
        state.raised,
        now_unix,
        grace_secs,
    )
    .into_iter()
    .filter_map(|name| machines.iter().find(|(k, _)| k.name == name))
    .map(|(k, m)| (k.clone(), m.resource_version.clone()))
    .collect()
}

/// The record a repair writes on the group before taking marks back: of the record read
/// (`taking_back`), the entries whose Machine still carries that very mark, and each mark about to
/// be taken back (`confirmed`) as its Machine carries it (`mark_time_of`: the time of our mark on a
/// Machine of the group, as cached; `None` when gone or unmarked, then not recorded).
fn taking_back_record(
    taking_back: &Ledger,
    confirmed: &[(ObjectKey, String)],
    mark_time_of: impl Fn(&str) -> Option<u64>,
) -> Ledger {
    let mut record = taking_back.still_marked(&mark_time_of);
    for (key, _) in confirmed {
        if let Some(t) = mark_time_of(&key.name) {
            record.insert(mark_entry(&key.name, t));
        }
    }
    record
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::removal::our_mark;

    fn machine(name: &str, version: &str) -> (ObjectKey, Arc<Machine>) {
        let key = ObjectKey::new("ns", name);
        let machine = Machine {
            key: key.clone(),
            uid: format!("uid-{name}"),
            resource_version: version.to_string(),
            labels: Default::default(),
            annotations: Default::default(),
            cluster_name: "c".into(),
            provider_id: None,
            node_ref: Some(name.to_string()),
            failure_domain: None,
            deleting: false,
            owners: Vec::new(),
            phase: None,
            failure: None,
            conditions_unhealthy: false,
        };
        (key, Arc::new(machine))
    }

    fn member<'a>(name: &'a str, mark: Option<&'a str>) -> MachineState<'a> {
        MachineState {
            name,
            deleting: false,
            mark,
            registered: true,
            unhealthy: false,
            machineless: false,
        }
    }

    fn state(replicas: i32, ledger: &str, raised: Option<u64>) -> GroupState {
        GroupState {
            replicas,
            min: 0,
            max: 10,
            ledger: Ledger::parse(Some(ledger)),
            raised,
            taking_back: Ledger::default(),
            listed: BTreeSet::new(),
            resource_version: "1".into(),
        }
    }

    /// 3 Machines, replicas 3: our mark on m2 (at 100) makes Cluster API delete nothing, its
    /// decrement never landed. Past the grace period it is taken back, guarded by m2's version.
    #[test]
    fn a_repair_takes_back_an_unpaid_mark_past_the_grace_with_its_machine_version() {
        let machines = [
            machine("m0", "10"),
            machine("m1", "11"),
            machine("m2", "12"),
        ];
        let mark = our_mark(100);
        let members = [
            member("m0", None),
            member("m1", None),
            member("m2", Some(&mark)),
        ];
        assert_eq!(
            marks_to_take_back(&machines, &members, &state(3, "", None), 200, 60),
            vec![(ObjectKey::new("ns", "m2"), "12".to_string())]
        );
        assert!(
            marks_to_take_back(&machines, &members, &state(3, "", None), 150, 60).is_empty(),
            "a mark younger than the grace period may still get its decrement"
        );
        assert!(
            marks_to_take_back(&machines, &members, &state(3, "", Some(180)), 200, 60).is_empty(),
            "nothing while a raise is within the grace period"
        );
        assert!(
            marks_to_take_back(&machines, &members, &state(2, "m2@100", None), 200, 60).is_empty(),
            "a paid mark the replicas remove stays"
        );
        assert!(
            marks_to_take_back(&machines, &members, &state(2, "", None), 200, 60).is_empty(),
            "replicas lowered for it by someone else: covered, it stays"
        );
        let foreign = [
            member("m0", None),
            member("m1", None),
            member("m2", Some("yes")),
        ];
        assert!(
            marks_to_take_back(&machines, &foreign, &state(3, "", None), 200, 60).is_empty(),
            "someone else's mark is theirs to take back"
        );
    }

    /// A paid mark a raise absorbed (replicas back to the Machines) is taken back too.
    #[test]
    fn a_repair_takes_back_a_paid_mark_a_raise_absorbed() {
        let machines = [machine("m0", "10"), machine("m1", "11")];
        let mark = our_mark(100);
        let members = [member("m0", Some(&mark)), member("m1", None)];
        assert_eq!(
            marks_to_take_back(&machines, &members, &state(2, "m0@100", Some(120)), 200, 60),
            vec![(ObjectKey::new("ns", "m0"), "10".to_string())]
        );
    }

    /// The record keeps the entries whose Machine still carries that mark and adds the marks
    /// about to be taken back as they are now; a Machine gone meanwhile is not recorded.
    #[test]
    fn the_taking_back_record_keeps_marks_still_there_and_adds_the_confirmed_ones() {
        let read = Ledger::parse(Some("m0@100,m1@50"));
        let marked = |name: &str| match name {
            "m0" => Some(100),
            "m1" => Some(60),
            "m2" => Some(70),
            _ => None,
        };
        let confirmed = [
            (ObjectKey::new("ns", "m2"), "12".to_string()),
            (ObjectKey::new("ns", "m3"), "13".to_string()),
        ];
        assert_eq!(
            taking_back_record(&read, &confirmed, marked),
            Ledger::parse(Some("m0@100,m2@70")),
            "m1 was marked again since; m3 is gone"
        );
        assert_eq!(
            taking_back_record(&Ledger::default(), &[], marked).render(),
            None,
            "nothing to record removes the annotation"
        );
    }
}
