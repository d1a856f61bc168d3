//! Whether a MachineDeployment is rolling out, from its MachineSets and its own status.
//!
//! During a rollout the MachineDeployment controller, not the autoscaler, decides which MachineSet
//! gives up a replica when the MachineDeployment's replicas drop. A node the autoscaler chose (and
//! marked) may then stay while a node of another MachineSet goes (kubernetes/autoscaler#8494). The
//! in-tree provider keeps such nodes out of CA's scale-down candidates with a core processor; that hook
//! does not exist over externalgrpc, so the snapshot carries the rollout and the service acts on it.

use super::{ObjectKey, ScalableResource};

/// The MachineDeployment revision a MachineSet was made for; an integer, higher is newer.
pub const REVISION_ANNOTATION: &str = "machinedeployment.clusters.x-k8s.io/revision";
/// The v1beta2 MachineDeployment condition that is `True` while Machines are not up to date.
pub const ROLLING_OUT_CONDITION: &str = "RollingOut";

/// A MachineSet of an older revision that still has Machines, or is still asked for some.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OldMachineSet {
    pub key: ObjectKey,
    /// The larger of `spec.replicas` and `status.replicas`.
    pub replicas: i32,
}

/// A MachineSet whose revision annotation is not an integer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnreadableRevision {
    pub key: ObjectKey,
    pub value: String,
}

/// Why a MachineDeployment counts as rolling out. At least one list is non-empty or `condition` is set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rollout {
    /// Old MachineSets still holding replicas, by name.
    pub old_sets: Vec<OldMachineSet>,
    /// The MachineDeployment's `RollingOut` condition is `True`.
    pub condition: bool,
    /// Without a readable revision old and new cannot be told apart: counted as rolling out, as
    /// in-tree does, because the wrong guess loses a node.
    pub unreadable: Vec<UnreadableRevision>,
}

impl Rollout {
    /// One line for people: what holds the rollout open.
    pub fn reason(&self) -> String {
        let mut parts: Vec<String> = self
            .old_sets
            .iter()
            .map(|s| {
                let noun = if s.replicas == 1 {
                    "replica"
                } else {
                    "replicas"
                };
                format!("MachineSet {} still has {} {noun}", s.key, s.replicas)
            })
            .collect();
        if self.condition {
            parts.push(format!("condition {ROLLING_OUT_CONDITION} is True"));
        }
        parts.extend(self.unreadable.iter().map(|u| {
            format!(
                "MachineSet {} has revision {:?}, not an integer",
                u.key, u.value
            )
        }));
        parts.join(", ")
    }
}

fn revision(set: &ScalableResource) -> Option<Result<i64, &str>> {
    let raw = set.annotations.get(REVISION_ANNOTATION)?;
    Some(raw.trim().parse::<i64>().map_err(|_| raw))
}

/// The rule. `sets` are the MachineSets of `deployment` (owned by it or labelled with its name).
///
/// Rolling out when the `RollingOut` condition is `True`, when a MachineSet's revision is not an
/// integer, or when a MachineSet older than the newest revision still has `spec.replicas` or
/// `status.replicas` above 0. A MachineSet without the annotation is older than any that has one (the
/// controller annotates every MachineSet it makes); when none has one there is no revision to compare
/// and nothing is old (in-tree then counts every MachineSet as old, which pauses scale-down forever).
pub fn rollout(deployment: &ScalableResource, sets: &[&ScalableResource]) -> Option<Rollout> {
    let mut unreadable: Vec<UnreadableRevision> = sets
        .iter()
        .filter_map(|s| match revision(s) {
            Some(Err(value)) => Some(UnreadableRevision {
                key: s.key.clone(),
                value: value.to_string(),
            }),
            _ => None,
        })
        .collect();
    unreadable.sort_by(|a, b| a.key.cmp(&b.key));
    let newest = sets
        .iter()
        .filter_map(|s| revision(s).and_then(Result::ok))
        .max();
    let mut old_sets: Vec<OldMachineSet> = match newest {
        None => Vec::new(),
        Some(newest) => sets
            .iter()
            .filter(|s| match revision(s) {
                None => true,
                Some(Ok(r)) => r < newest,
                Some(Err(_)) => false,
            })
            .filter_map(|s| {
                let replicas = s.replicas.unwrap_or(0).max(s.status_replicas.unwrap_or(0));
                (replicas > 0).then(|| OldMachineSet {
                    key: s.key.clone(),
                    replicas,
                })
            })
            .collect(),
    };
    old_sets.sort_by(|a, b| a.key.cmp(&b.key));
    let found = Rollout {
        old_sets,
        condition: deployment.rolling_out,
        unreadable,
    };
    (found.condition || !found.old_sets.is_empty() || !found.unreadable.is_empty()).then_some(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::ScalableKind;
    use crate::capi::test_fixtures::resource as object;

    fn md() -> ScalableResource {
        object(ScalableKind::MachineDeployment, "md")
    }

    fn ms(name: &str, revision: Option<&str>, spec: i32, status: Option<i32>) -> ScalableResource {
        let mut s = object(ScalableKind::MachineSet, name);
        if let Some(r) = revision {
            s.annotations
                .insert(REVISION_ANNOTATION.to_string(), r.to_string());
        }
        s.replicas = Some(spec);
        s.status_replicas = status;
        s
    }

    fn old(name: &str, replicas: i32) -> OldMachineSet {
        OldMachineSet {
            key: ObjectKey::new("ns", name),
            replicas,
        }
    }

    #[test]
    fn one_machine_set_or_none_is_no_rollout() {
        assert_eq!(rollout(&md(), &[]), None);
        assert_eq!(rollout(&md(), &[&ms("a", Some("3"), 5, Some(5))]), None);
        assert_eq!(rollout(&md(), &[&ms("a", None, 5, Some(5))]), None);
    }

    #[test]
    fn an_old_revision_with_spec_or_status_replicas_is_a_rollout() {
        let new = ms("md-new", Some("2"), 3, Some(2));
        let by_spec = ms("md-old", Some("1"), 1, Some(0));
        assert_eq!(
            rollout(&md(), &[&new, &by_spec]).map(|r| r.old_sets),
            Some(vec![old("md-old", 1)])
        );
        // Scaled to 0 but its Machines are still going away.
        let by_status = ms("md-old", Some("1"), 0, Some(2));
        let found = rollout(&md(), &[&new, &by_status]).unwrap();
        assert_eq!(found.old_sets, vec![old("md-old", 2)]);
        assert_eq!(found.reason(), "MachineSet ns/md-old still has 2 replicas");
    }

    #[test]
    fn old_revisions_without_replicas_are_no_rollout() {
        let new = ms("md-new", Some("10"), 3, Some(3));
        // 9 < 10 as integers although "9" > "10" as text.
        let drained = ms("md-old", Some("9"), 0, Some(0));
        let never_counted = ms("md-older", Some("8"), 0, None);
        assert_eq!(rollout(&md(), &[&new, &drained, &never_counted]), None);
    }

    #[test]
    fn revisions_compare_as_integers_and_the_newest_may_be_several() {
        let a = ms("a", Some("10"), 2, None);
        let b = ms("b", Some(" 10 "), 1, None);
        let c = ms("c", Some("9"), 1, None);
        assert_eq!(
            rollout(&md(), &[&c, &b, &a]).map(|r| r.old_sets),
            Some(vec![old("c", 1)])
        );
        assert_eq!(rollout(&md(), &[&a, &b]), None);
    }

    #[test]
    fn a_machine_set_without_a_revision_is_old_next_to_one_with_a_revision() {
        let new = ms("new", Some("1"), 1, None);
        let unannotated = ms("hand-made", None, 2, None);
        assert_eq!(
            rollout(&md(), &[&new, &unannotated]).map(|r| r.old_sets),
            Some(vec![old("hand-made", 2)])
        );
    }

    #[test]
    fn a_non_integer_revision_counts_as_a_rollout_and_names_the_machine_set() {
        let new = ms("new", Some("2"), 1, None);
        let odd = ms("odd", Some("two"), 0, None);
        let found = rollout(&md(), &[&new, &odd]).unwrap();
        assert_eq!(
            found.unreadable,
            vec![UnreadableRevision {
                key: ObjectKey::new("ns", "odd"),
                value: "two".into()
            }]
        );
        assert!(found.old_sets.is_empty());
        assert_eq!(
            found.reason(),
            "MachineSet ns/odd has revision \"two\", not an integer"
        );
    }

    #[test]
    fn the_rolling_out_condition_alone_is_a_rollout() {
        let mut deployment = md();
        deployment.rolling_out = true;
        let found = rollout(&deployment, &[&ms("a", Some("1"), 2, Some(2))]).unwrap();
        assert!(found.condition && found.old_sets.is_empty());
        assert_eq!(found.reason(), "condition RollingOut is True");
    }

    #[test]
    fn the_reason_lists_every_old_machine_set_by_name() {
        let new = ms("c", Some("3"), 1, None);
        let found = rollout(
            &md(),
            &[
                &new,
                &ms("b", Some("2"), 1, None),
                &ms("a", Some("1"), 0, Some(3)),
            ],
        )
        .unwrap();
        assert_eq!(
            found.reason(),
            "MachineSet ns/a still has 3 replicas, MachineSet ns/b still has 1 replica"
        );
    }
}
