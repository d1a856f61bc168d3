//! The guarded write of a group's replicas: carried by the resourceVersion it was computed from,
//! checked against the bounds of that very version, recomputed after a conflict, and an answer lost
//! in transit resolved by reading back.

use std::time::{Duration, Instant};

use serde_json::json;

use super::api::ApiFailure;
use super::state::GroupState;
use super::{Actuator, MAX_ATTEMPTS, now_unix, now_unix_ceil};
use crate::backend::ActuatorError;
use crate::removal::{self, LEDGER_ANNOTATION, Ledger, RAISED_ANNOTATION};
use crate::snapshot::NodeGroup;

/// What a write changes: the new replica count and, for a removal, the ledger entries it pays for.
pub(super) struct Change {
    pub(super) replicas: i32,
    pub(super) entries: Vec<String>,
}

/// Whether `wanted`, written over version `before`, shows in `now`.
pub(super) fn landed(before: &str, wanted: &Change, now: &GroupState) -> bool {
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

/// The ledger as the next write leaves it: entries that need no record any more dropped (see
/// [`Ledger::pruned`]; `mark_of`: a Machine's mark as cached), `entries` added.
fn next_ledger(
    state: &GroupState,
    entries: &[String],
    mark_of: impl Fn(&str) -> Option<String>,
    now_unix: u64,
) -> Ledger {
    let mut ledger = state.ledger.pruned(&state.listed, mark_of, now_unix);
    for entry in entries {
        ledger.insert(entry.clone());
    }
    ledger
}

/// What one attempt of a write sends over the version `state` read.
#[derive(Debug, PartialEq)]
enum Attempt {
    /// The merge patch, guarded by that version's resourceVersion.
    Patch(serde_json::Value),
    /// `wanted` leaves the bounds of that version (and does not move toward them): nothing sent.
    OutOfBounds,
}

/// What a write changes over `state` for `wanted` (the guarded write's decision, no I/O):
/// `spec.replicas`; the ledger when `ledger` (see [`next_ledger`]) differs from the one read; for a
/// raise, its time `now_ceil` (every provider's repair reads it, see `RAISED_ANNOTATION`).
fn patch_for(state: &GroupState, wanted: &Change, ledger: &Ledger, now_ceil: u64) -> Attempt {
    if !removal::within_bounds(state.replicas, wanted.replicas, state.min, state.max) {
        return Attempt::OutOfBounds;
    }
    let mut patch = json!({
        "metadata": {"resourceVersion": state.resource_version},
        "spec": {"replicas": wanted.replicas},
    });
    if *ledger != state.ledger {
        patch["metadata"]["annotations"][LEDGER_ANNOTATION] = json!(ledger.render());
    }
    if wanted.replicas > state.replicas {
        patch["metadata"]["annotations"][RAISED_ANNOTATION] = json!(now_ceil.to_string());
    }
    Attempt::Patch(patch)
}

impl Actuator {
    /// Writes `change(state)` to the group object in one guarded write: `spec.replicas` and, for a
    /// removal, its ledger entry, for a raise the time of it (`None`: nothing is owed over that
    /// version, no write). Bounds are those of the version written over; a conflict re-reads and
    /// recomputes (with `machines_too`, after listing the Machines of the group's namespace
    /// again: the change is decided from them). An answer lost in transit is resolved by reading again, never by assuming; a
    /// write read back as not applied may still arrive (the network can deliver a request its client
    /// gave up on after a later one), so every later read first checks whether it has, and then
    /// takes it as this write instead of applying the change twice.
    pub(super) async fn write(
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
            let ledger = next_ledger(
                &state,
                &wanted.entries,
                |name| self.cached_mark(group, name),
                now_unix(),
            );
            let patch = match patch_for(&state, &wanted, &ledger, now_unix_ceil()) {
                Attempt::Patch(patch) => patch,
                Attempt::OutOfBounds => {
                    return Err(state.out_of_bounds(group, operation, wanted.replicas));
                }
            };
            let started = Instant::now();
            match self
                .patch_counted(&api, &key.name, &patch, &what, operation)
                .await
            {
                Ok(object) => {
                    self.store.record(Some(group.kind()), object);
                    tracing::info!(group = %group.id, from = state.replicas, to = wanted.replicas, elapsed = ?started.elapsed(), "{operation}");
                    self.size_changed(group, operation, state.replicas, &wanted);
                    return Ok(wanted.replicas);
                }
                Err(ApiFailure::Conflict) => {}
                Err(ApiFailure::Other(e)) => {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

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

    fn state(replicas: i32, ledger: &str, version: &str) -> GroupState {
        GroupState {
            replicas,
            min: 1,
            max: 10,
            ledger: Ledger::parse(Some(ledger)),
            raised: None,
            taking_back: Ledger::default(),
            listed: BTreeSet::new(),
            resource_version: version.to_string(),
        }
    }

    fn change(replicas: i32, entries: &[&str]) -> Change {
        Change {
            replicas,
            entries: entries.iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn a_raise_writes_replicas_and_its_time_guarded_by_the_version_read() {
        let read = state(2, "", "7");
        let wanted = change(3, &[]);
        let ledger = next_ledger(&read, &wanted.entries, |_| None, 1_000);
        assert_eq!(
            patch_for(&read, &wanted, &ledger, 1_001),
            Attempt::Patch(json!({
                "metadata": {
                    "resourceVersion": "7",
                    "annotations": {RAISED_ANNOTATION: "1001"},
                },
                "spec": {"replicas": 3},
            }))
        );
    }

    #[test]
    fn a_removal_writes_its_entry_with_the_decrement_and_keeps_young_entries() {
        let read = state(3, "m0@100", "8");
        let wanted = change(2, &["m1@200"]);
        let ledger = next_ledger(&read, &wanted.entries, |_| None, 300);
        assert_eq!(
            patch_for(&read, &wanted, &ledger, 301),
            Attempt::Patch(json!({
                "metadata": {
                    "resourceVersion": "8",
                    "annotations": {LEDGER_ANNOTATION: "m0@100,m1@200"},
                },
                "spec": {"replicas": 2},
            })),
            "no raise time for a decrement"
        );
    }

    #[test]
    fn a_write_drops_ledger_entries_that_need_no_record_and_leaves_an_unchanged_ledger_alone() {
        let read = state(3, "m0@100,id:i-1", "9");
        let now = 100 + removal::STALE_ENTRY_SECS;
        let still_marked = |name: &str| (name == "m0").then(|| removal::our_mark(100));
        let kept = next_ledger(&read, &[], still_marked, now);
        assert_eq!(
            kept,
            Ledger::parse(Some("m0@100")),
            "the pool node left the list"
        );
        let gone = next_ledger(&read, &[], |_| None, now);
        assert_eq!(
            patch_for(&read, &change(2, &[]), &gone, now),
            Attempt::Patch(json!({
                "metadata": {
                    "resourceVersion": "9",
                    "annotations": {LEDGER_ANNOTATION: null},
                },
                "spec": {"replicas": 2},
            })),
            "an emptied ledger removes the annotation"
        );
        let unchanged = state(3, "m0@100", "9");
        let young = next_ledger(&unchanged, &[], |_| None, 101);
        assert_eq!(
            patch_for(&unchanged, &change(2, &[]), &young, 101),
            Attempt::Patch(json!({
                "metadata": {"resourceVersion": "9"},
                "spec": {"replicas": 2},
            }))
        );
    }

    #[test]
    fn a_write_leaving_the_bounds_sends_nothing_unless_it_moves_toward_them() {
        let within = state(2, "", "1");
        let ledger = within.ledger.clone();
        assert_eq!(
            patch_for(&within, &change(11, &[]), &ledger, 0),
            Attempt::OutOfBounds
        );
        assert_eq!(
            patch_for(&within, &change(0, &[]), &ledger, 0),
            Attempt::OutOfBounds
        );
        let above = state(12, "", "1");
        assert!(matches!(
            patch_for(&above, &change(11, &[]), &ledger, 0),
            Attempt::Patch(_)
        ));
        assert_eq!(
            patch_for(&above, &change(13, &[]), &ledger, 0),
            Attempt::OutOfBounds
        );
    }

    #[test]
    fn a_write_landed_when_its_entries_show_or_its_replicas_show_in_a_later_version() {
        let paid = state(2, "m0@100,m1@200", "11");
        assert!(landed("10", &change(2, &["m1@200"]), &paid));
        assert!(
            landed("11", &change(2, &["m1@200"]), &paid),
            "entries are written only with their decrement: their presence proves it"
        );
        assert!(!landed("10", &change(2, &["m2@300"]), &paid));
        let raised = state(4, "", "12");
        assert!(landed("11", &change(4, &[]), &raised));
        assert!(
            !landed("12", &change(4, &[]), &raised),
            "the version written over: nothing landed"
        );
        assert!(!landed("11", &change(5, &[]), &raised));
    }
}
