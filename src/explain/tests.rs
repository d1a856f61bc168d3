//! Unit tests of `explain`.

use super::*;
use serde_json::json;

fn event(reason: &str, message: &str, at: &str) -> EventFacts {
    EventFacts {
        reason: reason.into(),
        message: message.into(),
        count: 1,
        last_seen: Some(at.into()),
    }
}

/// `check`'s JSON report: md-a (max 1, at it), md-b (no template, a problem), one not served.
fn report() -> Value {
    json!({
        "cluster": "ns/c (--cluster ns/c)",
        "groups": [
            {"id": "MachineDeployment/ns/md-a", "min": 0, "max": 1, "target": 1,
             "instances": {"running": 1, "creating": 0, "deleting": 0, "failed": 0},
             "template": {"cpu": "2", "memory": "4Gi", "pods": 110, "os": "linux", "arch": "amd64",
                          "gpu": null, "capacity_source": "annotations"},
             "rollout": null, "notes": []},
            {"id": "MachineDeployment/ns/md-b", "min": 0, "max": 3, "target": 0,
             "instances": {"running": 0, "creating": 0, "deleting": 0, "failed": 2},
             "template": null, "rollout": {"message": "rolling out: MachineSet ns/old still has 1 replicas"},
             "notes": ["a note"]},
        ],
        "skipped": {"MachineDeployment/ns/paused": "paused"},
        "problems": [
            {"object": "MachineDeployment ns/md-b",
             "field": "metadata.annotations[capacity.cluster-autoscaler.kubernetes.io/cpu]",
             "message": "no cpu/memory capacity"},
            {"object": "MachineDeployment ns/other", "field": "f", "message": "m"},
        ],
    })
}

fn pending() -> PodFacts {
    PodFacts {
        namespace: "ns".into(),
        name: "web".into(),
        phase: "Pending".into(),
        node: None,
        unschedulable: Some("Unschedulable: 0/1 nodes are available".into()),
    }
}

#[test]
fn a_triggered_scale_up_names_its_groups_and_sizes() {
    let ups = parse_triggered(
        "pod triggered scale-up: [{MachineDeployment/ns/md-a 0->1 (max: 1)} {MachineSet/ns/ms 2->4 (max: 5)}]",
    );
    assert_eq!(
        ups,
        vec![
            ScaleUp {
                group: "MachineDeployment/ns/md-a".into(),
                from: 0,
                to: 1,
                max: 1
            },
            ScaleUp {
                group: "MachineSet/ns/ms".into(),
                from: 2,
                to: 4,
                max: 5
            },
        ]
    );
    assert!(parse_triggered("pod triggered scale-up: [{garbled}]").is_empty());
    assert!(parse_triggered("").is_empty());
}

#[test]
fn no_scale_up_reasons_are_ca_s_own_words() {
    assert_eq!(
        parse_not_triggered(
            "pod didn't trigger scale-up: 1 max node group size reached, 2 Insufficient cpu"
        ),
        vec!["1 max node group size reached", "2 Insufficient cpu"]
    );
}

#[test]
fn the_latest_ca_event_is_the_verdict() {
    let events = vec![
        event(
            NOT_TRIGGERED,
            "pod didn't trigger scale-up: 1 Insufficient cpu",
            "2026-01-01T00:00:01Z",
        ),
        event(
            TRIGGERED,
            "pod triggered scale-up: [{MachineDeployment/ns/md-a 0->1 (max: 1)}]",
            "2026-01-01T00:00:05Z",
        ),
        event("FailedScheduling", "0/1 nodes", "2026-01-01T00:00:09Z"),
    ];
    assert!(matches!(verdict(&events), Verdict::ScaleUpTriggered { .. }));
    assert_eq!(
        verdict(&events[..1]),
        Verdict::NoScaleUp {
            reasons: vec!["1 Insufficient cpu".into()]
        }
    );
    assert_eq!(verdict(&events[2..]), Verdict::NoDecision);
}

/// Two autoscalers, each over groups of its own, report on the same pending pod in the same second:
/// their reasons together are the verdict (one of them alone would hide the other's groups), and a
/// scale-up by either is the verdict.
#[test]
fn autoscalers_reporting_at_the_same_moment_give_one_verdict_with_every_reason() {
    let at = "2026-01-01T00:00:05Z";
    let ours = event(
        NOT_TRIGGERED,
        "pod didn't trigger scale-up: 2 Insufficient cpu",
        at,
    );
    let other = event(
        NOT_TRIGGERED,
        "pod didn't trigger scale-up: 1 max node group size reached",
        at,
    );
    let older = event(
        NOT_TRIGGERED,
        "pod didn't trigger scale-up: 3 Insufficient memory",
        "2026-01-01T00:00:01Z",
    );
    assert_eq!(
        verdict(&[older.clone(), other.clone(), ours.clone()]),
        Verdict::NoScaleUp {
            reasons: vec![
                "1 max node group size reached".into(),
                "2 Insufficient cpu".into()
            ]
        }
    );
    let triggered = event(
        TRIGGERED,
        "pod triggered scale-up: [{MachineDeployment/ns/md-a 0->1 (max: 1)}]",
        at,
    );
    assert!(matches!(
        verdict(&[ours, triggered, older]),
        Verdict::ScaleUpTriggered { scale_ups } if scale_ups.len() == 1
    ));
}

#[test]
fn ca_status_gives_each_groups_health_activity_and_backoff() {
    let text = r#"
time: 2026-01-01 00:00:10.1 +0000 UTC
autoscalerStatus: Running
clusterWide:
  health: {status: Healthy}
nodeGroups:
- name: MachineDeployment/ns/md-a
  health: {status: Healthy, cloudProviderTarget: 1}
  scaleUp: {status: NoActivity}
- name: MachineDeployment/ns/md-b
  health: {status: Unhealthy}
  scaleUp:
    status: Backoff
    backoffInfo: {errorCode: timeout, errorMessage: "Scale-up timed out for node group"}
"#;
    let s = parse_status("ns/cluster-autoscaler-status", text);
    assert_eq!(s.autoscaler.as_deref(), Some("Running"));
    assert_eq!(s.cluster_health.as_deref(), Some("Healthy"));
    assert_eq!(
        s.groups["MachineDeployment/ns/md-b"],
        GroupStatus {
            health: Some("Unhealthy".into()),
            scale_up: Some("Backoff".into()),
            backoff: Some("timeout: Scale-up timed out for node group".into()),
        }
    );
    assert_eq!(s.groups["MachineDeployment/ns/md-a"].backoff, None);
    assert!(parse_status("x", "{ not: [yaml").unreadable.is_some());
}

#[test]
fn the_groups_ca_named_come_first_with_the_providers_view_beside_them() {
    let events = vec![event(
        TRIGGERED,
        "pod triggered scale-up: [{MachineDeployment/ns/md-b 0->1 (max: 3)}]",
        "2026-01-01T00:00:05Z",
    )];
    let e = explain(
        pending(),
        events,
        StatusFacts::default(),
        &report(),
        "the running provider at x",
    );
    assert_eq!(e.groups[0].id, "MachineDeployment/ns/md-b");
    assert!(e.groups[0].named_by_ca);
    let b = &e.groups[0];
    assert!(!b.has_template);
    assert_eq!(b.failed_instances, 2);
    assert_eq!(
        b.problems.len(),
        1,
        "only its own object's problems: {:?}",
        b.problems
    );
    assert!(
        b.rollout
            .as_deref()
            .unwrap_or_default()
            .contains("rolling out")
    );
    let a = &e.groups[1];
    assert!(a.at_max && !a.named_by_ca);
    assert_eq!(
        a.template,
        "2 cpu, 4Gi mem, 110 pods, linux/amd64 (annotations)"
    );
    assert_eq!(e.not_served["MachineDeployment/ns/paused"], "paused");
    let screen = render(&e);
    assert!(
        screen.contains("verdict: scale-up triggered: MachineDeployment/ns/md-b 0 -> 1 (max 3)"),
        "{screen}"
    );
    assert!(screen.contains("* MachineDeployment/ns/md-b"), "{screen}");
    assert!(
        screen.contains("MachineDeployment/ns/md-a  0/1/1 (at max)"),
        "{screen}"
    );
    assert!(screen.contains("NOT SERVED"), "{screen}");
    let json = serde_json::to_value(&e).unwrap();
    assert_eq!(json["verdict"]["kind"], "scale_up_triggered");
    assert_eq!(json["verdict"]["scale_ups"][0]["to"], 1);
}

#[test]
fn without_any_ca_event_there_is_no_verdict_and_every_group_is_shown() {
    let e = explain(pending(), vec![], StatusFacts::default(), &report(), "own");
    assert_eq!(e.verdict, Verdict::NoDecision);
    assert_eq!(e.groups.len(), 2);
    assert!(render(&e).contains("verdict: none yet"));
    assert_eq!(
        serde_json::to_value(&e).unwrap()["verdict"]["kind"],
        "no_decision"
    );
}
