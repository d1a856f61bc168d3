//! `explain NAMESPACE/POD`: why cluster-autoscaler did or did not scale up for a pod, on one screen.
//!
//! CA's own verdict (the pod's `TriggeredScaleUp` / `NotTriggerScaleUp` Events and CA's status
//! ConfigMap) next to the provider's view of each node group (what `check` reports: bounds, target,
//! instances, template, rollout, problems, groups not served and why). Nothing is guessed about CA's
//! simulation: CA's words are quoted and parsed only where CA gives structure (the groups and sizes of
//! a scale-up); the rest is facts about the objects. [`explain`] is pure; [`run`] reads the cluster
//! and the provider.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::Context;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Pod};
use kube::Api;
use kube::api::ListParams;
use serde::Serialize;
use serde_json::Value;

use crate::config::{ExplainArgs, KubeconfigSource, OutputFormat};
use crate::snapshot::GroupId;

/// CA's Event reasons on a pod it considered.
pub const TRIGGERED: &str = "TriggeredScaleUp";
pub const NOT_TRIGGERED: &str = "NotTriggerScaleUp";

/// What the pod says of itself.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    pub phase: String,
    /// The Node it is bound to.
    pub node: Option<String>,
    /// The `PodScheduled` condition when it is not `True`: `reason: message`.
    pub unschedulable: Option<String>,
}

/// One Event about the pod.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EventFacts {
    pub reason: String,
    pub message: String,
    pub count: i32,
    /// RFC 3339, when known.
    pub last_seen: Option<String>,
}

/// One group CA raised for the pod, as its `TriggeredScaleUp` Event names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ScaleUp {
    pub group: String,
    pub from: i64,
    pub to: i64,
    pub max: i64,
}

/// CA's verdict on the pod, from its latest Event about it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Verdict {
    /// `TriggeredScaleUp`: the groups and sizes CA asked for.
    ScaleUpTriggered { scale_ups: Vec<ScaleUp> },
    /// `NotTriggerScaleUp`: CA's reasons, as it counts them over the groups it tried.
    NoScaleUp { reasons: Vec<String> },
    /// Neither Event (CA has not considered the pod, or the Events expired).
    NoDecision,
}

/// CA's status ConfigMap, as far as it concerns the groups.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StatusFacts {
    /// `namespace/name` of the ConfigMap.
    pub config_map: String,
    /// Why it could not be read, if it could not.
    pub unreadable: Option<String>,
    /// CA's last update (`time`).
    pub time: Option<String>,
    /// `autoscalerStatus` and the cluster-wide health.
    pub autoscaler: Option<String>,
    pub cluster_health: Option<String>,
    /// By node group id.
    pub groups: BTreeMap<String, GroupStatus>,
}

/// One group in CA's status.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GroupStatus {
    pub health: Option<String>,
    pub scale_up: Option<String>,
    /// `errorCode: errorMessage` of a scale-up backoff.
    pub backoff: Option<String>,
}

/// The provider's view of one group, and CA's status of it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GroupView {
    pub id: String,
    pub min: i64,
    pub max: i64,
    pub target: i64,
    /// The target is at (or above) max: CA cannot raise it.
    pub at_max: bool,
    /// CA's Event names this group.
    pub named_by_ca: bool,
    /// `N running, N creating, N deleting, N failed`.
    pub instances: String,
    pub failed_instances: i64,
    /// `2 cpu, 4Gi mem, 110 pods, linux/amd64 (annotations)`, or why there is none.
    pub template: String,
    pub has_template: bool,
    pub rollout: Option<String>,
    pub notes: Vec<String>,
    /// `field: message` of every problem about the group's object.
    pub problems: Vec<String>,
    pub ca_status: Option<GroupStatus>,
}

/// Everything `explain` shows.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Explanation {
    pub pod: PodFacts,
    pub verdict: Verdict,
    /// CA's Events about the pod, latest first (and the scheduler's `FailedScheduling`).
    pub events: Vec<EventFacts>,
    pub status: StatusFacts,
    /// Where the provider's view came from: the running provider or watches of the command's own.
    pub provider_source: String,
    /// The Cluster served (as `check` says it).
    pub cluster: String,
    pub groups: Vec<GroupView>,
    /// Candidates not served, and why (CA does not see them).
    pub not_served: BTreeMap<String, String>,
}

/// `pod triggered scale-up: [{MachineDeployment/ns/md 0->1 (max: 3)} …]` → the scale-ups. Entries
/// that do not read so are skipped.
pub fn parse_triggered(message: &str) -> Vec<ScaleUp> {
    message
        .split('{')
        .skip(1)
        .filter_map(|entry| {
            let entry = entry.split('}').next()?;
            let mut words = entry.split_whitespace();
            let group = words.next()?.to_string();
            let (from, to) = words.next()?.split_once("->")?;
            let max = words
                .skip_while(|w| *w != "(max:")
                .nth(1)?
                .trim_end_matches(')');
            Some(ScaleUp {
                group,
                from: from.parse().ok()?,
                to: to.parse().ok()?,
                max: max.parse().ok()?,
            })
        })
        .collect()
}

/// `pod didn't trigger scale-up: 1 max node group size reached, 2 Insufficient cpu` → the reasons.
pub fn parse_not_triggered(message: &str) -> Vec<String> {
    let reasons = message
        .split_once("scale-up:")
        .map_or(message, |(_, rest)| rest);
    reasons
        .split(", ")
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .map(str::to_string)
        .collect()
}

/// CA's verdict: its latest Event about the pod. Several autoscalers (each over groups of its own)
/// each report on every pending pod; those that reported at the same latest moment are one verdict:
/// a scale-up if any made one, else every reason given.
pub fn verdict(events: &[EventFacts]) -> Verdict {
    let decisions: Vec<&EventFacts> = events
        .iter()
        .filter(|e| e.reason == TRIGGERED || e.reason == NOT_TRIGGERED)
        .collect();
    let Some(latest) = decisions.iter().map(|e| &e.last_seen).max() else {
        return Verdict::NoDecision;
    };
    let at_latest: Vec<&&EventFacts> = decisions
        .iter()
        .filter(|e| &e.last_seen == latest)
        .collect();
    let scale_ups: Vec<ScaleUp> = at_latest
        .iter()
        .filter(|e| e.reason == TRIGGERED)
        .flat_map(|e| parse_triggered(&e.message))
        .collect();
    if at_latest.iter().any(|e| e.reason == TRIGGERED) {
        return Verdict::ScaleUpTriggered { scale_ups };
    }
    let mut reasons: Vec<String> = Vec::new();
    for reason in at_latest
        .iter()
        .flat_map(|e| parse_not_triggered(&e.message))
    {
        if !reasons.contains(&reason) {
            reasons.push(reason);
        }
    }
    Verdict::NoScaleUp { reasons }
}

/// CA's status ConfigMap text (YAML, CA ≥ 1.30): the time, state and each group's health, scale-up
/// activity and backoff.
pub fn parse_status(config_map: &str, text: &str) -> StatusFacts {
    let mut facts = StatusFacts {
        config_map: config_map.to_string(),
        ..StatusFacts::default()
    };
    let status: Value = match serde_norway::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            facts.unreadable = Some(format!("not YAML: {e}"));
            return facts;
        }
    };
    let text_of = |v: &Value| v.as_str().map(str::to_string);
    facts.time = text_of(&status["time"]);
    facts.autoscaler = text_of(&status["autoscalerStatus"]);
    facts.cluster_health = text_of(&status["clusterWide"]["health"]["status"]);
    for group in status["nodeGroups"].as_array().into_iter().flatten() {
        let Some(name) = group["name"].as_str() else {
            continue;
        };
        let backoff = &group["scaleUp"]["backoffInfo"];
        let backoff = backoff["errorCode"]
            .as_str()
            .filter(|c| !c.is_empty())
            .map(|code| match backoff["errorMessage"].as_str() {
                Some(m) if !m.is_empty() => format!("{code}: {m}"),
                _ => code.to_string(),
            });
        facts.groups.insert(
            name.to_string(),
            GroupStatus {
                health: text_of(&group["health"]["status"]),
                scale_up: text_of(&group["scaleUp"]["status"]),
                backoff,
            },
        );
    }
    facts
}

/// A group id → `Kind namespace/name`, the object problems name.
fn object_of(id: &str) -> String {
    GroupId::parse(id).map_or_else(|| id.to_string(), |group| group.object())
}

fn template_text(template: &Value) -> Option<String> {
    let t = template.as_object()?;
    let s = |k: &str| t.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
    let gpu = t
        .get("gpu")
        .and_then(Value::as_array)
        .and_then(|g| Some(format!(", {}x {}", g.get(1)?, g.first()?.as_str()?)))
        .unwrap_or_default();
    let zone = t
        .get("zone")
        .and_then(|z| z["value"].as_str())
        .map(|z| format!(", zone {z}"))
        .unwrap_or_default();
    Some(format!(
        "{} cpu, {} mem{gpu}, {} pods, {}/{}{zone} ({})",
        s("cpu"),
        s("memory"),
        t.get("pods").and_then(Value::as_i64).unwrap_or_default(),
        s("os"),
        s("arch"),
        s("capacity_source"),
    ))
}

/// The explanation, from the pod, its Events, CA's status and `check`'s report (JSON).
pub fn explain(
    pod: PodFacts,
    mut events: Vec<EventFacts>,
    status: StatusFacts,
    report: &Value,
    provider_source: &str,
) -> Explanation {
    events.sort_by(|a, b| b.last_seen.cmp(&a.last_seen));
    let verdict = verdict(&events);
    let named: Vec<&str> = match &verdict {
        Verdict::ScaleUpTriggered { scale_ups } => {
            scale_ups.iter().map(|s| s.group.as_str()).collect()
        }
        _ => Vec::new(),
    };
    let problems: Vec<(String, String)> = report["problems"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let s = |k: &str| p[k].as_str().unwrap_or_default().to_string();
            (s("object"), format!("{}: {}", s("field"), s("message")))
        })
        .collect();
    let mut groups: Vec<GroupView> = report["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|g| {
            let id = g["id"].as_str().unwrap_or_default().to_string();
            let n = |v: &Value| v.as_i64().unwrap_or_default();
            let i = &g["instances"];
            let object = object_of(&id);
            let template = template_text(&g["template"]);
            GroupView {
                min: n(&g["min"]),
                max: n(&g["max"]),
                target: n(&g["target"]),
                at_max: n(&g["target"]) >= n(&g["max"]),
                named_by_ca: named.contains(&id.as_str()),
                instances: format!(
                    "{} running, {} creating, {} deleting, {} failed",
                    n(&i["running"]),
                    n(&i["creating"]),
                    n(&i["deleting"]),
                    n(&i["failed"])
                ),
                failed_instances: n(&i["failed"]),
                has_template: template.is_some(),
                template: template.unwrap_or_else(|| "none: cannot scale from zero".into()),
                rollout: g["rollout"]["message"].as_str().map(str::to_string),
                notes: g["notes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|n| n.as_str().map(str::to_string))
                    .collect(),
                problems: problems
                    .iter()
                    .filter(|(o, _)| *o == object)
                    .map(|(_, p)| p.clone())
                    .collect(),
                ca_status: status.groups.get(&id).cloned(),
                id,
            }
        })
        .collect();
    // The groups CA named first, then the rest as `check` orders them.
    groups.sort_by_key(|g| !g.named_by_ca);
    let not_served = report["skipped"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(id, why)| (id.clone(), why.as_str().unwrap_or_default().to_string()))
        .collect();
    Explanation {
        pod,
        verdict,
        events,
        status,
        provider_source: provider_source.to_string(),
        cluster: report["cluster"].as_str().unwrap_or_default().to_string(),
        groups,
        not_served,
    }
}

/// One screen for a person.
pub fn render(e: &Explanation) -> String {
    let mut out = String::new();
    let p = &e.pod;
    let _ = write!(out, "POD {}/{}  {}", p.namespace, p.name, p.phase);
    match (&p.node, &p.unschedulable) {
        (Some(node), _) => {
            let _ = writeln!(out, ", on Node {node}");
        }
        (None, Some(why)) => {
            let _ = writeln!(out, ", not scheduled: {why}");
        }
        (None, None) => {
            let _ = writeln!(out, ", not scheduled yet");
        }
    }
    let _ = writeln!(out, "\nCLUSTER-AUTOSCALER");
    let _ = match &e.verdict {
        Verdict::ScaleUpTriggered { scale_ups } => {
            let ups: Vec<String> = scale_ups
                .iter()
                .map(|s| format!("{} {} -> {} (max {})", s.group, s.from, s.to, s.max))
                .collect();
            writeln!(out, "  verdict: scale-up triggered: {}", ups.join(", "))
        }
        Verdict::NoScaleUp { reasons } => {
            writeln!(out, "  verdict: no scale-up: {}", reasons.join("; "))
        }
        Verdict::NoDecision => writeln!(
            out,
            "  verdict: none yet (no {TRIGGERED} or {NOT_TRIGGERED} Event on the pod: CA has not \
             considered it, or the Events expired)"
        ),
    };
    for ev in &e.events {
        let _ = writeln!(
            out,
            "  event {} x{} ({}): {}",
            ev.reason,
            ev.count,
            ev.last_seen.as_deref().unwrap_or("?"),
            ev.message
        );
    }
    let s = &e.status;
    match &s.unreadable {
        Some(why) => {
            let _ = writeln!(out, "  status {}: {why}", s.config_map);
        }
        None => {
            let _ = writeln!(
                out,
                "  status {} ({}): {}; cluster {}",
                s.config_map,
                s.time.as_deref().unwrap_or("?"),
                s.autoscaler.as_deref().unwrap_or("?"),
                s.cluster_health.as_deref().unwrap_or("?"),
            );
        }
    }
    let _ = writeln!(
        out,
        "\nPROVIDER (from {}), CLUSTER {}",
        e.provider_source, e.cluster
    );
    if e.groups.is_empty() {
        let _ = writeln!(out, "  no node groups served");
    }
    for g in &e.groups {
        let _ = writeln!(
            out,
            "{} {}  {}/{}/{}{}  {}  template {}",
            if g.named_by_ca { "*" } else { " " },
            g.id,
            g.min,
            g.max,
            g.target,
            if g.at_max { " (at max)" } else { "" },
            g.instances,
            g.template
        );
        if let Some(st) = &g.ca_status {
            let _ = writeln!(
                out,
                "    CA: health {}, scale-up {}{}",
                st.health.as_deref().unwrap_or("?"),
                st.scale_up.as_deref().unwrap_or("?"),
                st.backoff
                    .as_ref()
                    .map(|b| format!(", backoff {b}"))
                    .unwrap_or_default()
            );
        }
        for line in g
            .rollout
            .iter()
            .map(|r| r.to_string())
            .chain(g.problems.iter().map(|p| format!("problem: {p}")))
            .chain(g.notes.iter().map(|n| format!("note: {n}")))
        {
            let _ = writeln!(out, "    {line}");
        }
    }
    if !e.not_served.is_empty() {
        let _ = writeln!(out, "NOT SERVED (CA does not see them)");
        for (id, why) in &e.not_served {
            let _ = writeln!(out, "  {id}: {why}");
        }
    }
    out
}

fn pod_facts(pod: &Pod) -> PodFacts {
    let status = pod.status.as_ref();
    let unschedulable = status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status != "True")
        .map(|c| {
            format!(
                "{}: {}",
                c.reason.as_deref().unwrap_or_default(),
                c.message.as_deref().unwrap_or_default()
            )
        });
    PodFacts {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        phase: status
            .and_then(|s| s.phase.clone())
            .unwrap_or_else(|| "Unknown".into()),
        node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        unschedulable,
    }
}

fn event_facts(event: &Event) -> EventFacts {
    let last_seen = event
        .last_timestamp
        .as_ref()
        .map(|t| t.0.to_string())
        .or_else(|| event.event_time.as_ref().map(|t| t.0.to_string()))
        .or_else(|| event.first_timestamp.as_ref().map(|t| t.0.to_string()));
    EventFacts {
        reason: event.reason.clone().unwrap_or_default(),
        message: event.message.clone().unwrap_or_default(),
        count: event.count.unwrap_or(1),
        last_seen,
    }
}

/// Reads the pod, its Events and CA's status from the cluster CA watches, and the provider's view
/// (the running provider's when it answers), then prints the explanation.
pub async fn run(args: ExplainArgs) -> anyhow::Result<ExitCode> {
    let (namespace, name) = args
        .pod
        .split_once('/')
        .filter(|(ns, n)| !ns.is_empty() && !n.is_empty() && !n.contains('/'))
        .with_context(|| format!("{:?}: expected NAMESPACE/POD", args.pod))?;
    let config = args.connection.config()?;
    // The pod lives where CA watches: the workload cluster, or the management cluster itself.
    let watched = match &config.workload {
        Some(path) => KubeconfigSource::File(path.clone()),
        None => config.management.clone(),
    };
    let client = crate::startup::client_for(
        &watched,
        config.api_ping,
        &crate::server_clock::ServerClock::default(),
    )
    .await
    .context("the cluster cluster-autoscaler watches")?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods
        .get_opt(name)
        .await
        .with_context(|| format!("reading pod {namespace}/{name}"))?
        .with_context(|| {
            format!("pod {namespace}/{name} not found in the cluster cluster-autoscaler watches")
        })?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let events: Api<Event> = Api::namespaced(client.clone(), namespace);
    let listed = events
        .list(&ListParams::default().fields(&format!(
            "involvedObject.kind=Pod,involvedObject.name={name}"
        )))
        .await
        .with_context(|| format!("listing the Events of pod {namespace}/{name}"))?;
    let events: Vec<EventFacts> = listed
        .items
        .iter()
        // An earlier pod of the same name has Events of its own.
        .filter(|e| uid.is_empty() || e.involved_object.uid.as_deref() == Some(uid.as_str()))
        .filter(|e| {
            matches!(
                e.reason.as_deref(),
                Some(TRIGGERED | NOT_TRIGGERED | "FailedScheduling")
            )
        })
        .map(event_facts)
        .collect();
    let config_map = format!("{}/{}", args.autoscaler_namespace, args.status_config_map);
    let maps: Api<ConfigMap> = Api::namespaced(client, &args.autoscaler_namespace);
    let status = match maps.get_opt(&args.status_config_map).await {
        Ok(Some(cm)) => match cm.data.as_ref().and_then(|d| d.get("status")) {
            Some(text) => parse_status(&config_map, text),
            None => StatusFacts {
                config_map,
                unreadable: Some("no `status` key".into()),
                ..StatusFacts::default()
            },
        },
        Ok(None) => StatusFacts {
            config_map,
            unreadable: Some(
                "not found (CA's --namespace and --status-config-map-name: see \
                 --autoscaler-namespace, --status-config-map)"
                    .into(),
            ),
            ..StatusFacts::default()
        },
        Err(e) => StatusFacts {
            config_map,
            unreadable: Some(e.to_string()),
            ..StatusFacts::default()
        },
    };
    let (served, source) = crate::check::served_or_own(&args.connection, &args.server).await?;
    let explanation = explain(pod_facts(&pod), events, status, &served.report, &source);
    match args.output.format {
        OutputFormat::Table => print!("{}", render(&explanation)),
        OutputFormat::Json => println!(
            "{}",
            serde_json::to_string_pretty(&explanation).context("encoding the explanation")?
        ),
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests;
