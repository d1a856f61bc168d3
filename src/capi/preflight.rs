//! Scale-ups Cluster API holds back: the MachineSet controller runs preflight checks before it
//! creates Machines (the control plane stable, not provisioning or upgrading; Kubernetes and
//! kubeadm version skew) and, while one fails, creates none and retries every 15 s. Replicas are
//! raised, no Machine comes, and CA would wait out max-node-provision-time (15 min by default)
//! before it gives up on the group. So the capacity the check holds back is reported to CA as
//! instances being created with an error: CA records a failed scale-up, backs the group off (and
//! may pick another), and deletes those instances, which lowers replicas again by exactly the
//! capacity that was never created.
//!
//! Where Cluster API v1.14 says so (`core/reconcilers/machineset`): the v1beta2 condition
//! `ScalingUp` is `True` with the message `Scaling up from N to M replicas is blocked because:`
//! followed by one `* <message>` line per failed check, each ending `("<Check>" preflight check
//! failed)`; recomputed on every reconcile, so it never outlives the hold. The deprecated v1beta1
//! condition `MachinesCreated` is `False` with reason `PreflightCheckFailed` and the messages joined
//! by `; `; it is only rewritten when Machines are created, so it is believed only while the group
//! still lacks Machines. Pure: the snapshot and the writer feed it; it imports neither.

/// Made-up instance ids of capacity a preflight check holds back: `preflight-held-<kind>-<ns>_<name>-<n>`.
pub const HELD_PREFIX: &str = "preflight-held-";
/// The instance error code: this, then `:` and the failed checks.
pub const ERROR_CODE: &str = "PreflightCheckFailed";
const SCALING_UP: &str = "ScalingUp";
const MACHINES_CREATED: &str = "MachinesCreated";
const PREFLIGHT_CHECK_FAILED: &str = "PreflightCheckFailed";
const CHECK_FAILED_SUFFIX: &str = "preflight check failed)";

/// A MachineSet's preflight checks holding its scale-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreflightHold {
    /// The checks that failed, by the names Cluster API gives them (`ControlPlaneIsStable`, …).
    pub checks: Vec<String>,
    /// What Cluster API says, one line per failed check.
    pub message: String,
}

/// One condition of an object, as far as these rules read it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Condition<'a> {
    pub type_: &'a str,
    pub status: &'a str,
    pub reason: &'a str,
    pub message: &'a str,
}

/// The hold the conditions of a MachineSet (v1beta2 and deprecated v1beta1 together) report, if
/// any: the fresh `ScalingUp` first, else `MachinesCreated`.
pub fn hold_of(conditions: &[Condition<'_>]) -> Option<PreflightHold> {
    let scaling_up = conditions
        .iter()
        .find(|c| c.type_ == SCALING_UP && c.status == "True")
        .and_then(|c| {
            let lines: Vec<&str> = c
                .message
                .lines()
                .map(|l| l.trim().trim_start_matches("* ").trim())
                .filter(|l| l.ends_with(CHECK_FAILED_SUFFIX))
                .collect();
            (!lines.is_empty()).then(|| lines.join("; "))
        });
    let message = scaling_up.or_else(|| {
        conditions
            .iter()
            .find(|c| {
                c.type_ == MACHINES_CREATED
                    && c.status == "False"
                    && c.reason == PREFLIGHT_CHECK_FAILED
            })
            .map(|c| c.message.trim().to_string())
    })?;
    Some(PreflightHold {
        checks: checks_named(&message),
        message,
    })
}

/// The check names in `("<Check>" preflight check failed)`, in order, each once.
fn checks_named(message: &str) -> Vec<String> {
    let mut checks: Vec<String> = Vec::new();
    for part in message.split(CHECK_FAILED_SUFFIX).filter(|p| !p.is_empty()) {
        let Some(open) = part.rfind("(\"") else {
            continue;
        };
        let name = part[open + 2..].trim_end().trim_end_matches('"');
        if !name.is_empty() && !name.contains('"') && !checks.iter().any(|c| c == name) {
            checks.push(name.to_string());
        }
    }
    checks
}

/// The error code CA is told for each instance the hold keeps from being created: the code, then
/// the failed checks.
pub fn error_code(hold: &PreflightHold) -> String {
    match hold.checks.as_slice() {
        [] => ERROR_CODE.to_string(),
        checks => format!("{ERROR_CODE}:{}", checks.join(",")),
    }
}

/// The error message CA is told for each instance the hold keeps from being created in `group`.
pub fn error_message(group: &str, hold: &PreflightHold) -> String {
    format!(
        "Cluster API holds the scale-up of {group}: {} (the MachineSet creates no Machine until \
         its preflight checks pass; the annotation machineset.cluster.x-k8s.io/skip-preflight-checks \
         skips them)",
        hold.message
    )
}

/// How many instances the hold keeps back: replicas beyond the group's Machines (not being deleted).
pub fn held_count(target: i32, machines: usize) -> usize {
    usize::try_from(target)
        .unwrap_or(0)
        .saturating_sub(machines)
}

/// The ids of the `count` instances held back in group `kind`/`namespace`/`name`.
pub fn held_ids(kind: &str, namespace: &str, name: &str, count: usize) -> Vec<String> {
    (0..count)
        .map(|n| {
            format!(
                "{HELD_PREFIX}{}-{namespace}_{name}-{n}",
                kind.to_ascii_lowercase()
            )
        })
        .collect()
}

pub fn is_held_id(id: &str) -> bool {
    id.starts_with(HELD_PREFIX)
}

/// The replicas after CA removes `removed` held-back instances from a group with `replicas` and
/// `machines` Machines not being deleted: lower by as many, never below the Machines there are, so
/// no Machine (one the check let through meanwhile included) is removed. An error says why not.
pub fn cancel(replicas: i32, machines: usize, removed: usize) -> Result<i32, String> {
    let held = held_count(replicas, machines);
    if removed > held {
        return Err(format!(
            "{removed} held-back instance(s) named, but replicas {replicas} exceed the {machines} \
             Machine(s) by {held}: lowering replicas further would remove a Machine"
        ));
    }
    Ok(replicas - removed as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CP: &str = "StandInControlPlane ns/workload is upgrading (\"ControlPlaneIsStable\" preflight check failed)";

    fn c<'a>(type_: &'a str, status: &'a str, reason: &'a str, message: &'a str) -> Condition<'a> {
        Condition {
            type_,
            status,
            reason,
            message,
        }
    }

    #[test]
    fn scaling_up_blocked_by_preflight_checks_is_a_hold() {
        let message = format!(
            "Scaling up from 0 to 1 replicas is blocked because:\n* {CP}\n* MachineSet version (1.37.0) and ControlPlane version (1.36.2) do not conform to the kubernetes version skew policy as MachineSet version is higher than ControlPlane version (\"KubernetesVersionSkew\" preflight check failed)"
        );
        let hold = hold_of(&[c("ScalingUp", "True", "ScalingUp", &message)]).expect("a hold");
        assert_eq!(
            hold.checks,
            ["ControlPlaneIsStable", "KubernetesVersionSkew"]
        );
        assert!(hold.message.starts_with(CP), "{}", hold.message);
        assert!(
            !hold.message.contains("Scaling up from"),
            "{}",
            hold.message
        );
    }

    #[test]
    fn scaling_up_for_other_reasons_or_not_at_all_is_no_hold() {
        let missing = "Scaling up from 0 to 1 replicas is blocked because:\n* StandInMachineTemplate does not exist";
        assert_eq!(
            hold_of(&[c("ScalingUp", "True", "ScalingUp", missing)]),
            None
        );
        assert_eq!(
            hold_of(&[c(
                "ScalingUp",
                "True",
                "ScalingUp",
                "Scaling up from 0 to 1 replicas"
            )]),
            None
        );
        assert_eq!(
            hold_of(&[c("ScalingUp", "False", "NotScalingUp", CP)]),
            None
        );
        assert_eq!(hold_of(&[]), None);
    }

    #[test]
    fn the_deprecated_machines_created_condition_is_read_when_scaling_up_says_nothing() {
        let hold = hold_of(&[
            c("ScalingUp", "False", "NotScalingUp", ""),
            c("MachinesCreated", "False", "PreflightCheckFailed", CP),
        ])
        .expect("a hold");
        assert_eq!(hold.checks, ["ControlPlaneIsStable"]);
        assert_eq!(hold.message, CP);
        let other = c(
            "MachinesCreated",
            "False",
            "InfrastructureTemplateCloningFailed",
            CP,
        );
        assert_eq!(hold_of(&[other]), None);
        assert_eq!(
            hold_of(&[c("MachinesCreated", "True", "PreflightCheckFailed", CP)]),
            None
        );
    }

    #[test]
    fn a_message_naming_no_check_still_holds_with_the_bare_code() {
        let hold = hold_of(&[c(
            "MachinesCreated",
            "False",
            "PreflightCheckFailed",
            "failed to get ControlPlane",
        )])
        .expect("a hold");
        assert!(hold.checks.is_empty());
        assert_eq!(error_code(&hold), "PreflightCheckFailed");
    }

    #[test]
    fn the_instance_error_names_the_group_the_checks_and_the_way_out() {
        let hold =
            hold_of(&[c("MachinesCreated", "False", "PreflightCheckFailed", CP)]).expect("a hold");
        assert_eq!(
            error_code(&hold),
            "PreflightCheckFailed:ControlPlaneIsStable"
        );
        let message = error_message("MachineDeployment/ns/md", &hold);
        assert!(message.contains("MachineDeployment/ns/md"), "{message}");
        assert!(message.contains(CP), "{message}");
        assert!(message.contains("skip-preflight-checks"), "{message}");
    }

    #[test]
    fn held_instances_are_the_replicas_beyond_the_machines_with_stable_ids() {
        assert_eq!(held_count(3, 1), 2);
        assert_eq!(held_count(1, 3), 0);
        assert_eq!(held_count(-1, 0), 0);
        let ids = held_ids("MachineDeployment", "ns", "md", 2);
        assert_eq!(
            ids,
            [
                "preflight-held-machinedeployment-ns_md-0",
                "preflight-held-machinedeployment-ns_md-1"
            ]
        );
        assert!(ids.iter().all(|id| is_held_id(id)));
        assert!(!is_held_id("pending-machine-ns_m"));
    }

    #[test]
    fn cancelling_held_instances_never_reaches_a_machine() {
        assert_eq!(cancel(3, 1, 2), Ok(1));
        assert_eq!(cancel(3, 1, 1), Ok(2));
        // A Machine the check let through since: one fewer held back than CA names.
        let refused = cancel(3, 2, 2).expect_err("would remove a Machine");
        assert!(refused.contains("by 1"), "{refused}");
        assert!(cancel(2, 2, 1).is_err());
    }
}
