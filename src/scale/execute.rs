//! Runs a protocol operation (`crate::protocol`) against the API: reads when it asks, makes the
//! guarded write it asks for and tells it what the write did, waits when it waits. Nothing here
//! decides.

use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::Patch;
use serde_json::{Value, json};

use super::api::{ApiFailure, write_params};
use super::read::{Since, machine_key};
use super::{Actuator, GroupLock};
use crate::backend::{ActuatorError, ApiCause};
use crate::protocol::ledger::{
    CLAIMS_ANNOTATION, LEDGER_ANNOTATION, RESIZES_ANNOTATION, TAKING_BACK_ANNOTATION,
};
use crate::protocol::{GroupWrite, Next, Operation, Outcome, Read, Refusal, Write};
use crate::snapshot::NodeGroup;

/// How often a waiting operation reads again.
const POLL: Duration = Duration::from_millis(150);

/// The reason of the Normal Event a size change records on its group.
pub(super) const REPLICAS_CHANGED: &str = "ReplicasChanged";

/// Who asked: the `operation` label of the write metrics and the action of the Events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Caller {
    IncreaseSize,
    DecreaseTargetSize,
    DeleteNodes,
    Repair,
}

impl Caller {
    fn label(self) -> &'static str {
        match self {
            Caller::IncreaseSize => "increase-size",
            Caller::DecreaseTargetSize => "decrease-target-size",
            Caller::DeleteNodes => "delete-nodes",
            Caller::Repair => "repair-record",
        }
    }

    fn action(self) -> &'static str {
        match self {
            Caller::IncreaseSize => "IncreaseSize",
            Caller::DecreaseTargetSize => "DecreaseTargetSize",
            Caller::DeleteNodes => "DeleteNodes",
            Caller::Repair => "Repair",
        }
    }
}

impl Actuator {
    /// Runs `op` on `group` to its answer under the group's operation lock. It waits (reading
    /// again every [`POLL`]) at most until `wait_until`, then is told its time is up. An operation
    /// that has written something keeps the lock while it waits: the operations of one provider
    /// on one group never interleave their writes (those of several providers do, and the model
    /// checker explores them). One that has written nothing lets the lock go while it waits: it
    /// is then no different from a call refused and asked again, and a group with CA's calls
    /// queued does not spend their deadlines on one call's wait.
    pub(super) async fn execute(
        &self,
        id: &str,
        group: &NodeGroup,
        caller: Caller,
        op: &mut Operation,
        lock: &GroupLock,
        wait_until: Instant,
    ) -> Result<(), ActuatorError> {
        let mut guard = Some(lock.lock().await);
        let mut since = Since::default();
        let mut last: Option<Read> = None;
        let mut next = op.start();
        loop {
            let newest = match guard.as_mut() {
                Some(newest) => newest,
                None => guard.insert(lock.lock().await),
            };
            // Both ways: what another operation of this process saw while the lock was let go.
            since.carry(newest);
            next = match next {
                Next::Read => match self.read(id, group, op.reads_members(), &mut since).await {
                    Ok(read) => {
                        let next = op.read(&read);
                        last = Some(read);
                        next
                    }
                    // A read changes nothing: the API out of reach is read again while there is
                    // time (the client opens a new connection), as a wait would.
                    Err(e) if e.is_unreachable() && Instant::now() + POLL <= wait_until => {
                        tracing::debug!(group = %id, "reading again: {e}");
                        tokio::time::sleep(POLL).await;
                        Next::Read
                    }
                    Err(e) => op.read_failed(&e.to_string()),
                },
                // Marks only within the call's time (twice the wait: --request-timeout), well
                // inside the grace period after which the repair takes a claim back.
                Next::Write(Write::Mark { .. }) if Instant::now() > wait_until + self.wait => {
                    op.too_late_to_mark()
                }
                Next::Write(write) => {
                    let (outcome, landed_at) = self.apply(group, caller, &write).await;
                    match landed_at {
                        Some(version) => since.wrote(&version, !matches!(write, Write::Group(_))),
                        None => since.lost_track(),
                    }
                    if outcome == Outcome::Landed
                        && let (Write::Group(w), Some(read)) = (&write, &last)
                    {
                        self.size_changed(group, caller, read, w);
                    }
                    op.wrote(outcome)
                }
                Next::Wait(_) if Instant::now() + POLL > wait_until => op.expired(),
                Next::Wait(_) => {
                    if op.holds().is_empty() {
                        guard = None;
                    }
                    tokio::time::sleep(POLL).await;
                    Next::Read
                }
                Next::Done(answer) => return answer.map_err(ActuatorError::from),
            }
        }
    }

    /// Makes one guarded write; what it did, in the protocol's terms, and the revision it landed
    /// at (`None`: not landed, or landed at a revision not known).
    async fn apply(
        &self,
        group: &NodeGroup,
        caller: Caller,
        write: &Write,
    ) -> (Outcome, Option<String>) {
        let kind = group.kind();
        let key = &group.resource.key;
        let (api, name, patch, what, label) = match write {
            Write::Group(w) => match self.group_api(kind, &key.namespace) {
                Ok(api) => (
                    api,
                    key.name.to_string(),
                    group_patch(w),
                    format!("writing {kind} {key}"),
                    caller.label(),
                ),
                Err(e) => return (Outcome::Rejected(Refusal::Failed(e.to_string())), None),
            },
            Write::Mark {
                machine,
                version,
                value,
            } => (
                self.machine_api(&key.namespace),
                machine.clone(),
                json!({"metadata": {"resourceVersion": version, "annotations": {
                    self.store.settings().keys.delete_machine.as_str(): value,
                }}}),
                format!(
                    "marking Machine {} for deletion",
                    machine_key(group, machine)
                ),
                "mark-machine",
            ),
            Write::Unmark { machine, version } => (
                self.machine_api(&key.namespace),
                machine.clone(),
                json!({"metadata": {"resourceVersion": version, "annotations": {
                    self.store.settings().keys.delete_machine.as_str(): Value::Null,
                }}}),
                format!(
                    "taking back the delete mark of Machine {}",
                    machine_key(group, machine)
                ),
                "unmark-machine",
            ),
        };
        let started = Instant::now();
        let result = super::api::call(
            &what,
            api.patch(&name, &write_params(), &Patch::Merge(&patch)),
        )
        .await;
        let mut landed_at = None;
        let outcome = match result {
            Ok(object) => {
                let recorded = match write {
                    Write::Group(_) => Some(kind),
                    _ => None,
                };
                landed_at = object.resource_version();
                self.store.record(recorded, object);
                Outcome::Landed
            }
            Err(ApiFailure::Conflict) => Outcome::Conflict,
            Err(ApiFailure::Other(ActuatorError::NotFound(_))) => Outcome::Gone,
            Err(ApiFailure::Other(e)) if e.is_unreachable() => {
                tracing::warn!(group = %group.id, "{what}: no answer, whether it landed is read back: {e}");
                Outcome::Unknown
            }
            Err(ApiFailure::Other(e)) => Outcome::Rejected(refusal_of(e)),
        };
        let counted = match &outcome {
            Outcome::Landed => "ok",
            Outcome::Conflict => "conflict",
            _ => "error",
        };
        self.metrics.api_write(label, counted, started.elapsed());
        (outcome, landed_at)
    }

    /// Records a Normal Event on the group for a size change written (best effort: the write
    /// stands whether or not the Event is recorded).
    fn size_changed(&self, group: &NodeGroup, caller: Caller, before: &Read, write: &GroupWrite) {
        let Some(to) = write.replicas else { return };
        let from = before.group.replicas;
        let settled: Vec<String> = write
            .ledger
            .iter()
            .flat_map(|l| l.iter())
            .filter(|e| !before.group.ledger.contains(e))
            .map(|e| entry_subject(e).to_string())
            .collect();
        let note = size_change_note(caller, from, to, &settled);
        tracing::info!(group = %group.id, from, to, "{note}");
        self.store.group_event(
            group.kind(),
            &group.resource.key,
            REPLICAS_CHANGED,
            caller.action(),
            note,
        );
    }
}

/// The merge patch of a group write: the resourceVersion it is guarded by and what it replaces.
fn group_patch(w: &GroupWrite) -> Value {
    let mut patch = json!({"metadata": {"resourceVersion": w.version}});
    if let Some(replicas) = w.replicas {
        patch["spec"] = json!({"replicas": replicas});
    }
    let mut annotations = serde_json::Map::new();
    for (key, ledger) in [
        (LEDGER_ANNOTATION, &w.ledger),
        (CLAIMS_ANNOTATION, &w.claims),
        (TAKING_BACK_ANNOTATION, &w.taking_back),
    ] {
        if let Some(ledger) = ledger {
            annotations.insert(key.to_string(), json!(ledger.render()));
        }
    }
    if let Some(resizes) = &w.resizes {
        annotations.insert(RESIZES_ANNOTATION.to_string(), json!(resizes.render()));
    }
    if !annotations.is_empty() {
        patch["metadata"]["annotations"] = Value::Object(annotations);
    }
    patch
}

/// What a settled entry names, for people: its Machine, or a pool node's providerID.
fn entry_subject(entry: &str) -> &str {
    match entry.rsplit_once('@') {
        Some((machine, _)) if !entry.starts_with("id:") => machine,
        _ => entry,
    }
}

/// The note of the Event for a size change: who asked, from, to, and the removals it settles.
fn size_change_note(caller: Caller, from: i32, to: i32, settled: &[String]) -> String {
    let mut note = format!(
        "replicas {from} → {to} for cluster-autoscaler {}",
        caller.action()
    );
    if !settled.is_empty() {
        note.push_str(&format!(" ({})", settled.join(", ")));
    }
    note
}

/// An API failure as the protocol's refusal.
fn refusal_of(e: ActuatorError) -> Refusal {
    match e {
        ActuatorError::Api {
            cause: ApiCause::Forbidden,
            message,
        } => Refusal::Forbidden(message),
        ActuatorError::Refused(message) => Refusal::Precondition(message),
        other => Refusal::Failed(other.to_string()),
    }
}

impl From<Refusal> for ActuatorError {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::OutOfBounds {
                group,
                operation,
                desired,
                min,
                max,
            } => ActuatorError::OutOfBounds {
                group,
                operation,
                desired,
                min,
                max,
            },
            Refusal::NotFound(m) => ActuatorError::NotFound(m),
            Refusal::Precondition(m) => ActuatorError::Refused(m),
            Refusal::Conflict(m) => ActuatorError::Conflict(m),
            Refusal::Unavailable(m) => ActuatorError::unreachable(m),
            Refusal::Forbidden(m) => ActuatorError::api(ApiCause::Forbidden, m),
            Refusal::Failed(m) => ActuatorError::api(ApiCause::Failed, m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Ledger, Resizes};

    #[test]
    fn a_group_write_is_guarded_and_replaces_only_what_it_names() {
        let w = GroupWrite {
            version: "7".into(),
            replicas: Some(2),
            ledger: Some(Ledger::parse(Some("m0@5"))),
            claims: Some(Ledger::default()),
            taking_back: None,
            resizes: None,
        };
        assert_eq!(
            group_patch(&w),
            json!({
                "metadata": {"resourceVersion": "7", "annotations": {
                    LEDGER_ANNOTATION: "m0@5",
                    CLAIMS_ANNOTATION: null,
                }},
                "spec": {"replicas": 2},
            }),
            "an emptied set removes its annotation"
        );
        let raise = GroupWrite {
            version: "8".into(),
            replicas: Some(3),
            resizes: Some(Resizes::default().with("t1")),
            ..GroupWrite::default()
        };
        assert_eq!(
            group_patch(&raise),
            json!({
                "metadata": {"resourceVersion": "8", "annotations": {RESIZES_ANNOTATION: "t1"}},
                "spec": {"replicas": 3},
            })
        );
    }

    #[test]
    fn size_change_events_say_who_asked_from_to_and_what_was_removed() {
        assert_eq!(
            size_change_note(Caller::IncreaseSize, 1, 3, &[]),
            "replicas 1 → 3 for cluster-autoscaler IncreaseSize"
        );
        let settled = vec![
            entry_subject("md-0-a@1700000000").to_string(),
            entry_subject("id:aws:///i-1").to_string(),
        ];
        assert_eq!(
            size_change_note(Caller::DeleteNodes, 3, 1, &settled),
            "replicas 3 → 1 for cluster-autoscaler DeleteNodes (md-0-a, id:aws:///i-1)"
        );
    }
}
