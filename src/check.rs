//! `check`: what cluster-autoscaler will see, for people and scripts.
//!
//! The report is built from the same Snapshot the server answers from, so what `check` prints is what
//! CA gets.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::Context;
use serde::Serialize;

use crate::config::{CheckArgs, OutputFormat};
use crate::options::GroupOptions;
use crate::pricing::{PriceSource, ReferencePrices};
use crate::problem::Problem;
use crate::scope::Scope;
use crate::snapshot::{InstanceState, NodeGroup, Snapshot};
use crate::template::{TemplateSummary, taint_string};

mod served;

pub use served::{ServedCheck, fingerprint, served_check, served_or_own};

#[derive(Debug, Serialize)]
pub struct Report {
    /// The Cluster whose groups are served and how that was decided, or why none is.
    pub cluster: String,
    pub groups: Vec<GroupReport>,
    /// Candidates that are not served, and why.
    pub skipped: BTreeMap<String, String>,
    pub problems: Vec<Problem>,
    pub reference_prices: ReferencePrices,
    pub reference_sources: [PriceSource; 2],
}

#[derive(Debug, Default, Serialize)]
pub struct Instances {
    pub running: usize,
    pub creating: usize,
    pub deleting: usize,
    pub failed: usize,
}

#[derive(Debug, Serialize)]
pub struct GroupReport {
    pub id: String,
    pub min: i32,
    pub max: i32,
    pub target: i32,
    pub instances: Instances,
    pub template: Option<TemplateSummary>,
    pub options: Option<GroupOptions>,
    pub hourly_price: Option<f64>,
    /// Present while the group's MachineDeployment rolls out.
    pub rollout: Option<RolloutReport>,
    /// Machines carrying a delete mark this provider did not write (Cluster API deletes them first;
    /// DeleteNodes of the group is refused while replicas do not remove them).
    pub foreign_marks: Vec<String>,
    /// What CA will do differently for this group than its annotations suggest, though nothing is
    /// wrong with them (not problems: they set no exit code).
    pub notes: Vec<String>,
    /// Present while Cluster API's MachineSet preflight checks hold back the group's scale-up.
    pub preflight: Option<PreflightReport>,
}

/// The notes of one group: per-group options cost CA ≥ 1.35 the group's max node startup time.
pub fn group_notes(group: &NodeGroup) -> Vec<String> {
    let mut notes = Vec::new();
    if group.options.is_some() {
        notes.push(crate::options::STARTUP_TIME_NOTE.to_string());
    }
    notes
}

/// A scale-up Cluster API's preflight checks hold back.
#[derive(Debug, Serialize)]
pub struct PreflightReport {
    /// The failed checks (`ControlPlaneIsStable`, …).
    pub checks: Vec<String>,
    /// Cluster API's message.
    pub message: String,
    /// Instances reported to CA as failed to create (replicas beyond the group's Machines).
    pub held: usize,
}

fn preflight_report(group: &NodeGroup) -> Option<PreflightReport> {
    let hold = group.preflight.as_ref()?;
    Some(PreflightReport {
        checks: hold.checks.clone(),
        message: hold.message.clone(),
        held: group
            .instances
            .iter()
            .filter(|i| crate::capi::preflight::is_held_id(&i.id))
            .count(),
    })
}

/// A rollout that pauses a group's scale-down.
#[derive(Debug, Serialize)]
pub struct RolloutReport {
    /// e.g. `rolling out: MachineSet ns/md-old still has 2 replicas; scale-down paused (…)`.
    pub message: String,
    /// The min size CA is told while it lasts (`min` stays the configured one).
    pub served_min: i32,
    /// Old MachineSets (`namespace/name`) still holding replicas, and how many.
    pub old_machine_sets: BTreeMap<String, i32>,
    /// The MachineDeployment's `RollingOut` condition is `True`.
    pub rolling_out_condition: bool,
}

fn rollout_report(group: &NodeGroup) -> Option<RolloutReport> {
    let rollout = group.rollout.as_ref()?;
    Some(RolloutReport {
        message: group.rollout_note().unwrap_or_default(),
        served_min: group.served_min(),
        old_machine_sets: rollout
            .old_sets
            .iter()
            .map(|s| (s.key.to_string(), s.replicas))
            .collect(),
        rolling_out_condition: rollout.condition,
    })
}

fn group_report(group: &NodeGroup) -> GroupReport {
    let mut instances = Instances::default();
    for i in &group.instances {
        match (i.state, i.error.is_some()) {
            (_, true) => instances.failed += 1,
            (InstanceState::Running, false) => instances.running += 1,
            (InstanceState::Creating, false) => instances.creating += 1,
            (InstanceState::Deleting, false) => instances.deleting += 1,
        }
    }
    GroupReport {
        id: group.id.clone(),
        min: group.min,
        max: group.max,
        target: group.target,
        instances,
        template: group.template.as_ref().map(|t| t.summary.clone()),
        options: group.options.clone(),
        hourly_price: group.price,
        rollout: rollout_report(group),
        foreign_marks: group.foreign_marks.clone(),
        notes: group_notes(group),
        preflight: preflight_report(group),
    }
}

pub fn report(snapshot: &Snapshot) -> Report {
    Report {
        cluster: match &snapshot.scope {
            Scope::Cluster { cluster, how } => format!("{cluster} ({how})"),
            Scope::Unknown => "(none yet: no node group, no --cluster)".into(),
            Scope::Nothing(why) => format!("(none: {why})"),
        },
        groups: snapshot.groups.values().map(group_report).collect(),
        skipped: snapshot.skipped.clone(),
        problems: snapshot.problems.clone(),
        reference_prices: snapshot.reference_prices,
        reference_sources: snapshot.reference_sources,
    }
}

fn options_text(o: &GroupOptions) -> String {
    let mut parts = Vec::new();
    if let Some(v) = o.scale_down_utilization_threshold {
        parts.push(format!("scaleDownUtilizationThreshold={v}"));
    }
    if let Some(v) = o.scale_down_gpu_utilization_threshold {
        parts.push(format!("scaleDownGpuUtilizationThreshold={v}"));
    }
    if let Some(v) = o.scale_down_unneeded_time {
        parts.push(format!("scaleDownUnneededTime={v:?}"));
    }
    if let Some(v) = o.scale_down_unready_time {
        parts.push(format!("scaleDownUnreadyTime={v:?}"));
    }
    if let Some(v) = o.max_node_provision_time {
        parts.push(format!("maxNodeProvisionTime={v:?}"));
    }
    if let Some(v) = o.zero_or_max_node_scaling {
        parts.push(format!("zeroOrMaxNodeScaling={v}"));
    }
    if let Some(v) = o.ignore_daemonsets_utilization {
        parts.push(format!("ignoreDaemonSetsUtilization={v}"));
    }
    if parts.is_empty() {
        "annotations present, none valid (CA defaults apply)".into()
    } else {
        parts.join(", ")
    }
}

/// The human-readable report: the groups as a table, then each group's details, prices, what is not
/// served and the problems.
pub fn render_table(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "CLUSTER {}\n", report.cluster);
    let rows: Vec<[String; 6]> = report.groups.iter().map(group_row).collect();
    write_columns(&mut out, &rows);
    if report.groups.is_empty() {
        let _ = writeln!(
            out,
            "(no node groups: no MachineDeployment, MachineSet or MachinePool carries the min/max size annotations, or discovery filters them out)"
        );
    }
    for g in &report.groups {
        let details = group_details(g);
        if !details.is_empty() {
            let _ = writeln!(out, "\n{}", g.id);
            for d in details {
                let _ = writeln!(out, "  {d}");
            }
        }
    }
    if report.groups.iter().any(|g| g.hourly_price.is_some()) {
        let _ = writeln!(out, "\n{}", pod_prices(report));
    }
    if !report.skipped.is_empty() {
        let _ = writeln!(out, "\nNOT SERVED");
        for (id, why) in &report.skipped {
            let _ = writeln!(out, "  {id}: {why}");
        }
    }
    if report.problems.is_empty() {
        let _ = writeln!(out, "\nno problems");
    } else {
        let _ = writeln!(out, "\nPROBLEMS ({})", report.problems.len());
        for p in &report.problems {
            let _ = writeln!(out, "  {}\n    {}: {}", p.object, p.field, p.message);
        }
    }
    out
}

const COLUMNS: [&str; 6] = [
    "NODE GROUP",
    "MIN/MAX/TARGET",
    "INSTANCES",
    "TEMPLATE",
    "TEMPLATE SOURCE",
    "PRICE/H",
];

/// One group's row of the table, in the order of [`COLUMNS`].
fn group_row(g: &GroupReport) -> [String; 6] {
    let i = &g.instances;
    let rolling = if g.rollout.is_some() {
        " (rolling out)"
    } else {
        ""
    };
    let template = match &g.template {
        Some(t) => {
            let gpu = t
                .gpu
                .as_ref()
                .map(|(ty, n)| format!(", {n}x {ty}"))
                .unwrap_or_default();
            format!(
                "{} cpu, {} mem{gpu}, {} pods, {}/{}",
                t.cpu, t.memory, t.pods, t.os, t.arch
            )
        }
        None => "none: cannot scale from zero".into(),
    };
    [
        g.id.clone(),
        format!("{}/{}/{}", g.min, g.max, g.target),
        format!(
            "{} running, {} creating, {} deleting, {} failed{rolling}",
            i.running, i.creating, i.deleting, i.failed
        ),
        template,
        g.template
            .as_ref()
            .map(|t| t.capacity_source.to_string())
            .unwrap_or_else(|| "-".into()),
        g.hourly_price
            .map(|p| format!("{p}"))
            .unwrap_or_else(|| "-".into()),
    ]
}

/// The header and the rows, each column as wide as its widest cell.
fn write_columns(out: &mut String, rows: &[[String; 6]]) {
    let mut widths = COLUMNS.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut line = |cells: &[String]| {
        let text: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", text.join("  ").trim_end());
    };
    line(&COLUMNS.map(String::from));
    for row in rows {
        line(row);
    }
}

/// What the table has no room for: rollout, preflight hold, foreign marks, zone, labels, taints,
/// options, notes.
fn group_details(g: &GroupReport) -> Vec<String> {
    let template = g.template.as_ref();
    [
        g.rollout.as_ref().map(|r| r.message.clone()),
        g.preflight.as_ref().map(|p| {
            format!(
                "scale-up held by Cluster API's preflight checks ({}): {} instance(s) reported \
                 to CA as failed to create; {}",
                p.checks.join(", "),
                p.held,
                p.message
            )
        }),
        (!g.foreign_marks.is_empty()).then(|| {
            format!(
                "delete marks not written by this provider (Cluster API deletes them first; \
                 scale-down of other nodes refused until replicas remove them): {}",
                g.foreign_marks.join(", ")
            )
        }),
        template
            .and_then(|t| t.zone.as_ref())
            .map(|z| format!("zone: {}", z.describe())),
        template.filter(|t| !t.labels.is_empty()).map(|t| {
            let labels: Vec<String> = t.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("labels: {}", labels.join(","))
        }),
        template.filter(|t| !t.taints.is_empty()).map(|t| {
            let taints: Vec<String> = t.taints.iter().map(taint_string).collect();
            format!("taints: {}", taints.join(","))
        }),
        g.options
            .as_ref()
            .map(|o| format!("options: {}", options_text(o))),
    ]
    .into_iter()
    .flatten()
    .chain(g.notes.iter().map(|n| format!("note: {n}")))
    .collect()
}

/// The reference prices pods are priced by, and where each comes from.
fn pod_prices(report: &Report) -> String {
    let source = |s: &PriceSource| match s {
        PriceSource::Flag => "flag".to_string(),
        PriceSource::Derived(n) => format!("derived from {n} priced group(s)"),
        PriceSource::Fallback => "fallback list price".to_string(),
    };
    format!(
        "pod prices: {} per CPU-hour ({}), {} per GiB-hour ({})",
        report.reference_prices.cpu_hour,
        source(&report.reference_sources[0]),
        report.reference_prices.gib_hour,
        source(&report.reference_sources[1]),
    )
}

/// Prints the report; exit code 1 when there are problems.
pub async fn run(args: CheckArgs) -> anyhow::Result<ExitCode> {
    let (served, source) = served_or_own(&args.connection, &args.server).await?;
    eprintln!("(from {source})");
    match args.output.format {
        OutputFormat::Table => print!("{}", served.table),
        OutputFormat::Json => println!(
            "{}",
            serde_json::to_string_pretty(&served.report).context("encoding the report")?
        ),
    }
    Ok(if served.problems == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Index;
    use crate::capi::rollout::REVISION_ANNOTATION;
    use crate::capi::{Keys, ScalableKind, ScalableResource};
    use crate::snapshot::Settings;
    use serde_json::json;
    use std::sync::Arc;

    /// MachineDeployment md (min 0, max 5, replicas 3) with MachineSets md-new (revision 2) and
    /// md-old (revision 1, `old` replicas).
    fn snapshot(old: i32) -> Snapshot {
        let keys = Keys::default();
        let set = |name: &str, revision: &str, replicas: i32| {
            json!({
                "metadata": {
                    "namespace": "ns", "name": name,
                    "annotations": {REVISION_ANNOTATION: revision},
                    "ownerReferences": [{"kind": "MachineDeployment", "name": "md"}],
                },
                "spec": {"replicas": replicas},
            })
        };
        let md = json!({
            "metadata": {
                "namespace": "ns", "name": "md",
                "annotations": {keys.min_size.as_str(): "0", keys.max_size.as_str(): "5"},
            },
            "spec": {"replicas": 3},
        });
        let mut index = Index::default();
        for (kind, object) in [
            (ScalableKind::MachineDeployment, md),
            (ScalableKind::MachineSet, set("md-new", "2", 1)),
            (ScalableKind::MachineSet, set("md-old", "1", old)),
        ] {
            let r = ScalableResource::from_json(kind, &keys, &object).unwrap();
            index.apply_resource(kind, r.key.clone(), Ok(Arc::new(r)));
        }
        index.snapshot(&Settings::default())
    }

    #[test]
    fn a_rolling_out_group_is_marked_in_the_table_and_the_json() {
        let r = report(&snapshot(2));
        let table = render_table(&r);
        assert!(table.contains("(rolling out)"), "{table}");
        assert!(
            table.contains(
                "rolling out: MachineSet ns/md-old still has 2 replicas; scale-down paused (min size sent to CA: 3)"
            ),
            "{table}"
        );
        // MIN stays the configured one; the note says what CA is told.
        assert!(table.contains("0/5/3"), "{table}");
        let json = serde_json::to_value(&r).unwrap();
        let rollout = &json["groups"][0]["rollout"];
        assert_eq!(rollout["served_min"], 3);
        assert_eq!(rollout["old_machine_sets"], json!({"ns/md-old": 2}));
        assert_eq!(rollout["rolling_out_condition"], false);
        assert_eq!(json["groups"][0]["min"], 0);
    }

    #[test]
    fn a_scale_up_held_by_preflight_checks_is_reported_with_its_instances() {
        let keys = Keys::default();
        let md = json!({
            "metadata": {
                "namespace": "ns", "name": "md",
                "annotations": {keys.min_size.as_str(): "0", keys.max_size.as_str(): "5"},
            },
            "spec": {"replicas": 2},
        });
        let ms = json!({
            "metadata": {
                "namespace": "ns", "name": "md-1",
                "annotations": {REVISION_ANNOTATION: "1"},
                "ownerReferences": [{"kind": "MachineDeployment", "name": "md"}],
            },
            "spec": {"replicas": 2},
            "status": {"conditions": [{
                "type": "ScalingUp", "status": "True", "reason": "ScalingUp",
                "message": "Scaling up from 0 to 2 replicas is blocked because:\n* StandInControlPlane ns/w is upgrading (\"ControlPlaneIsStable\" preflight check failed)",
            }]},
        });
        let mut index = Index::default();
        for (kind, object) in [
            (ScalableKind::MachineDeployment, md),
            (ScalableKind::MachineSet, ms),
        ] {
            let r = ScalableResource::from_json(kind, &keys, &object).unwrap();
            index.apply_resource(kind, r.key.clone(), Ok(Arc::new(r)));
        }
        let snapshot = index.snapshot(&Settings::default());
        let group = snapshot.groups.values().next().unwrap();
        let held: Vec<&str> = group.instances.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(
            held,
            [
                "preflight-held-machinedeployment-ns_md-0",
                "preflight-held-machinedeployment-ns_md-1"
            ]
        );
        let error = group.instances[0].error.as_ref().unwrap();
        assert_eq!(group.instances[0].state, InstanceState::Creating);
        assert_eq!(error.code, "PreflightCheckFailed:ControlPlaneIsStable");
        assert_eq!(group.registered, 0);
        let r = report(&snapshot);
        let table = render_table(&r);
        assert!(
            table.contains("0 running, 0 creating, 0 deleting, 2 failed"),
            "{table}"
        );
        assert!(
            table.contains("scale-up held by Cluster API's preflight checks (ControlPlaneIsStable): 2 instance(s)"),
            "{table}"
        );
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["groups"][0]["preflight"]["held"], 2);
        assert_eq!(
            json["groups"][0]["preflight"]["checks"],
            json!(["ControlPlaneIsStable"])
        );
    }

    #[test]
    fn a_group_that_is_not_rolling_out_has_no_rollout_note() {
        let r = report(&snapshot(0));
        let table = render_table(&r);
        assert!(!table.contains("rolling out"), "{table}");
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["groups"][0]["rollout"].is_null());
    }

    /// MachineDeployment md (min 0, max 5, replicas 1) with extra annotations.
    fn group_with(annotations: &[(&str, &str)]) -> Snapshot {
        let keys = Keys::default();
        let mut all = serde_json::Map::new();
        all.insert(keys.min_size.clone(), json!("0"));
        all.insert(keys.max_size.clone(), json!("5"));
        for (k, v) in annotations {
            all.insert(k.to_string(), json!(v));
        }
        let md = json!({
            "metadata": {"namespace": "ns", "name": "md", "annotations": all},
            "spec": {"replicas": 1},
        });
        let r = ScalableResource::from_json(ScalableKind::MachineDeployment, &keys, &md).unwrap();
        let mut index = Index::default();
        index.apply_resource(r.kind, r.key.clone(), Ok(Arc::new(r)));
        index.snapshot(&Settings::default())
    }

    #[test]
    fn a_group_with_answered_options_carries_the_startup_time_note() {
        let key = format!("{}scaledownunneededtime", Keys::default().options_prefix);
        let r = report(&group_with(&[(key.as_str(), "2m")]));
        assert_eq!(r.groups[0].notes, vec![crate::options::STARTUP_TIME_NOTE]);
        let table = render_table(&r);
        assert!(table.contains("note: CA >= 1.35 sets this group's max node startup time to 0"));
        assert!(table.contains("kubernetes/autoscaler#10245"), "{table}");
        // A note is not a problem: the exit code stays 0.
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        let json = serde_json::to_value(&r).unwrap();
        assert!(
            json["groups"][0]["notes"][0]
                .as_str()
                .unwrap()
                .contains("#10245")
        );
    }

    #[test]
    fn options_that_are_not_answered_carry_no_note() {
        // None at all, or only a bad one (the answer is then empty and CA keeps its own options).
        let key = format!("{}scaledownunneededtime", Keys::default().options_prefix);
        for annotations in [&[][..], &[(key.as_str(), "soon")][..]] {
            let r = report(&group_with(annotations));
            assert!(r.groups[0].notes.is_empty(), "{annotations:?}");
        }
    }
}
