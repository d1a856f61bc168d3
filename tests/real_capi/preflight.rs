//! Cluster API's MachineSet preflight checks holding a scale-up, with the real CA: the provider
//! reports the capacity held back as instances that failed to create, so CA backs the group off at
//! once (instead of waiting out max-node-provision-time) and scales another; once the control plane
//! is stable again, the group's Machines come.

use crate::support;
use std::time::{Duration, Instant};

use kube::api::ListParams;
use support::capi::Kind;
use support::procs::{Check, poll_until};
use support::real_capi_scenario::{CLUSTER, RealCapiScenario};
use support::standin;
use support::workload::{self, PodSpec};

const UP: Duration = Duration::from_secs(120);
/// CA's metric of failed scale-ups, by reason: the instance error code for creation errors.
const FAILED_SCALE_UPS: &str = "cluster_autoscaler_failed_scale_ups_total";
const HELD_CODE: &str = "PreflightCheckFailed:ControlPlaneIsStable";
const SKIP_PREFLIGHT: &str = "machineset.cluster.x-k8s.io/skip-preflight-checks";

/// The Machines of MachineDeployment `md` (by the name prefix CAPI gives them).
async fn machines_of(s: &RealCapiScenario, md: &str) -> Vec<String> {
    match s.capi.api(Kind::Machine).list(&ListParams::default()).await {
        Ok(list) => list
            .items
            .into_iter()
            .filter_map(|m| m.metadata.name)
            .filter(|m| m.starts_with(&format!("{md}-")))
            .collect(),
        Err(e) => s.fail(&format!("list Machines: {e}")),
    }
}

/// The control plane upgrading (`ControlPlaneIsStable` fails): CA scales md-held (the better fit)
/// for a pending pod, the real MachineSet controller creates no Machine, the provider reports the
/// held replica as an instance that failed to create (`PreflightCheckFailed:ControlPlaneIsStable`),
/// CA counts a failed scale-up with that reason (and the provider puts a Warning Event
/// `ScaleUpHeldByPreflightChecks` on the MachineDeployment), removes the instance (replicas back to 0, still no
/// Machine) and scales md-spare instead (whose MachineSets skip the check), long before its
/// max-node-provision-time of 10 minutes.
/// The upgrade done, a pod only md-held can take makes CA scale it again, and its Machine and Node
/// come.
#[tokio::test]
async fn a_scale_up_held_by_preflight_checks_backs_the_group_off_and_another_scales() {
    let mut s = RealCapiScenario::new("preflight-held").await;
    s.template("md-held-tmpl", "2", "4Gi", true).await;
    s.template("md-spare-tmpl", "3", "6Gi", true).await;
    let held = RealCapiScenario::capacity(s.md("md-held", "md-held-tmpl", 0, 3, 0), "2", "4Gi");
    // At most one spare node: the second pod fits md-held only. Its MachineSets skip the check
    // (CAPI copies the annotation from the MachineDeployment): the held control plane holds every
    // other MachineSet of the Cluster.
    let spare = RealCapiScenario::annotation(
        RealCapiScenario::capacity(s.md("md-spare", "md-spare-tmpl", 0, 1, 0), "3", "6Gi"),
        SKIP_PREFLIGHT,
        "ControlPlaneIsStable",
    );
    s.create_md(&held).await;
    s.create_md(&spare).await;
    standin::set_control_plane_upgrading(&s.client, &s.ns, CLUSTER, true).await;
    s.start_provider(&[]).await;
    let ca = s.autoscaler().flag("--max-node-provision-time=10m");
    s.start_ca(ca).await;

    let started = Instant::now();
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas("md-held", 1, UP).await;
    let ca = s.ca.as_ref().expect("CA runs");
    let counted = poll_until(
        "CA counts a failed scale-up with the preflight code",
        UP,
        Duration::from_millis(500),
        || async move {
            let n = ca
                .metric_sum(FAILED_SCALE_UPS, &[("reason", HELD_CODE)])
                .await;
            if n >= 1.0 {
                Check::Done(n)
            } else {
                Check::Wait(format!("{FAILED_SCALE_UPS}{{reason={HELD_CODE}}} = {n}"))
            }
        },
    )
    .await;
    let backed_off_after = started.elapsed();
    if let Err(e) = counted {
        s.fail(&e);
    }
    let node = workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    let bound_after = started.elapsed();
    s.check(
        node.starts_with("md-spare"),
        &format!("the pod runs on md-spare: {node}"),
    );
    s.wait_replicas("md-held", 0, UP).await;
    let made = machines_of(&s, "md-held").await;
    let deleted: Vec<String> = s
        .deletions
        .all()
        .into_iter()
        .map(|d| d.machine)
        .filter(|m| m.starts_with("md-held-"))
        .collect();
    s.check(
        made.is_empty() && deleted.is_empty(),
        &format!("no md-held Machine while held: {made:?}, deleted {deleted:?}"),
    );

    let capi = &s.capi;
    let event = poll_until(
        "the provider's Warning Event on MachineDeployment md-held",
        UP,
        Duration::from_millis(500),
        || async move {
            let events = capi.events_about("md-held").await;
            let found = events.iter().find(|e| {
                e.reason.as_deref() == Some("ScaleUpHeldByPreflightChecks")
                    && e.type_.as_deref() == Some("Warning")
                    && e.regarding.as_ref().and_then(|r| r.kind.as_deref())
                        == Some("MachineDeployment")
            });
            match found {
                Some(e) => Check::Done(e.note.clone().unwrap_or_default()),
                None => Check::Wait(format!("{} Events about md-held", events.len())),
            }
        },
    )
    .await;
    match event {
        Ok(note) => s.check(
            note.contains("ControlPlaneIsStable"),
            &format!("the Event names the failed check: {note}"),
        ),
        Err(e) => s.fail(&e),
    }

    standin::set_control_plane_upgrading(&s.client, &s.ns, CLUSTER, false).await;
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("db", "1800m", "1Gi")).await;
    let node = workload::wait_bound(&s.client, &s.ns, "db", Duration::from_secs(180)).await;
    s.check(
        node.starts_with("md-held"),
        &format!("the second pod runs on md-held: {node}"),
    );
    eprintln!(
        "e2e: preflight-held: CA backed md-held off {:.1}s after the pod, the pod bound on md-spare \
         after {:.1}s (max-node-provision-time 600 s); md-held scaled once stable, {:.1}s in all",
        backed_off_after.as_secs_f64(),
        bound_after.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    s.passed();
}
