//! Kubernetes Events: a Warning on the object for each configuration problem the first time it
//! appears (and a log line when it goes away), and for the provider's repairs; a Normal one on a
//! group for each size change the provider writes.

use std::collections::BTreeSet;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

use crate::problem::{self, Problem};

/// Longest note an Event carries (the API limits it to 1 KiB).
const NOTE_MAX: usize = 1000;

pub struct Events {
    /// `None` for read-only uses (`check`): problems are only logged.
    recorder: Option<Recorder>,
    /// Problems already reported, so each is reported once while it lasts.
    reported: Mutex<BTreeSet<Problem>>,
    /// Preflight holds already reported (group id, what Cluster API says), likewise.
    holds: Mutex<BTreeSet<(String, String)>>,
}

impl Events {
    /// Events recorded through the API, as `capi-autoscaler-provider` (instance: `POD_NAME`).
    pub fn recorded(client: &Client) -> Self {
        Self::with(Some(Recorder::new(
            client.clone(),
            Reporter {
                controller: "capi-autoscaler-provider".into(),
                instance: std::env::var("POD_NAME").ok(),
            },
        )))
    }

    /// Problems logged only.
    pub fn logged() -> Self {
        Self::with(None)
    }

    fn with(recorder: Option<Recorder>) -> Self {
        Events {
            recorder,
            reported: Mutex::new(BTreeSet::new()),
            holds: Mutex::new(BTreeSet::new()),
        }
    }

    /// Publishes a Warning Event on `reference` in the background (a failure is only logged: an
    /// Event is never worth holding up the caller).
    pub fn warn(&self, reference: ObjectReference, reason: &str, action: String, note: &str) {
        self.publish(EventType::Warning, reference, reason, action, note);
    }

    /// Publishes a Normal Event on `reference` in the background, as [`Events::warn`] does.
    pub fn normal(&self, reference: ObjectReference, reason: &str, action: String, note: &str) {
        self.publish(EventType::Normal, reference, reason, action, note);
    }

    fn publish(
        &self,
        type_: EventType,
        reference: ObjectReference,
        reason: &str,
        action: String,
        note: &str,
    ) {
        let Some(recorder) = self.recorder.clone() else {
            return;
        };
        let event = Event {
            type_,
            reason: reason.to_string(),
            note: Some(problem::cut(note, NOTE_MAX).to_string()),
            action,
            secondary: None,
        };
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&event, &reference).await {
                tracing::debug!(object = ?reference.name, "recording event: {e}");
            }
        });
    }

    /// Logs and records an Event for each problem the first time it appears; logs when one goes
    /// away. `reference` finds the object a problem is about, when it is one the provider watches.
    pub fn report(
        &self,
        problems: &[Problem],
        reference: impl Fn(&Problem) -> Option<ObjectReference>,
    ) {
        let current: BTreeSet<Problem> = problems.iter().cloned().collect();
        let (new, gone) = {
            let mut reported = crate::lock(&self.reported);
            let new: Vec<Problem> = current.difference(&reported).cloned().collect();
            let gone: Vec<Problem> = reported.difference(&current).cloned().collect();
            *reported = current;
            (new, gone)
        };
        for problem in gone {
            tracing::info!(object = %problem.object, field = %problem.field, "problem resolved: {}", problem.message);
        }
        for problem in new {
            tracing::warn!(object = %problem.object, field = %problem.field, "{}", problem.message);
            if let Some(reference) = reference(&problem) {
                // Events aggregate by reason and action: one action per distinct problem keeps a
                // later problem on the same object from only bumping an older event's count.
                self.warn(
                    reference,
                    "AutoscalerConfigProblem",
                    format!("Check-{:016x}", problem_hash(&problem)),
                    &format!("{}: {}", problem.field, problem.message),
                );
            }
        }
    }
}

impl Events {
    /// Scale-ups Cluster API's preflight checks hold back, as (group id, note): a Warning Event
    /// `ScaleUpHeldByPreflightChecks` on the group object when one first appears (a log line when it
    /// ends). `reference` finds the group object.
    pub fn report_holds(
        &self,
        holds: &[(String, String)],
        reference: impl Fn(&str) -> Option<ObjectReference>,
    ) {
        let current: BTreeSet<(String, String)> = holds.iter().cloned().collect();
        let (new, gone) = {
            let mut reported = crate::lock(&self.holds);
            let new: Vec<(String, String)> = current.difference(&reported).cloned().collect();
            let gone: Vec<(String, String)> = reported.difference(&current).cloned().collect();
            *reported = current;
            (new, gone)
        };
        for (group, _) in gone {
            tracing::info!(group = %group, "scale-up no longer held by preflight checks");
        }
        for (group, note) in new {
            tracing::warn!(group = %group, "{note}");
            if let Some(reference) = reference(&group) {
                self.warn(
                    reference,
                    "ScaleUpHeldByPreflightChecks",
                    "ReportHeldInstances".into(),
                    &note,
                );
            }
        }
    }
}

fn problem_hash(problem: &Problem) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (&problem.field, &problem.message).hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_at_a_character_boundary() {
        let note = "é".repeat(600);
        let cut = problem::cut(&note, NOTE_MAX);
        assert!(cut.len() <= NOTE_MAX && note.starts_with(cut));
        assert_eq!(cut.chars().count(), 500);
        assert_eq!(problem::cut("short", NOTE_MAX), "short");
    }

    #[test]
    fn distinct_problems_of_one_object_get_distinct_actions() {
        let problem = |message: &str| {
            Problem::new("MachineDeployment ns/md", "metadata.annotations", message)
        };
        assert_ne!(problem_hash(&problem("a")), problem_hash(&problem("b")));
        assert_eq!(problem_hash(&problem("a")), problem_hash(&problem("a")));
    }
}
