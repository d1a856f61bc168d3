//! deploy/monitoring/ as data: the PromQL of the alerts (PrometheusRule) and of the Grafana dashboard,
//! the metric names each expression names (parsed by Prometheus's own PromQL parser, `promql-names`),
//! and the names a /metrics exposition offers; promtool, built from Go modules by
//! tests/upstream/promtool/build.sh (cached outside the repository, like helm).

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use capi_autoscaler_provider::cache::Index;
use capi_autoscaler_provider::capi::{ObjectKey, ScalableKind, ScalableResource};
use capi_autoscaler_provider::metrics::Metrics;
use capi_autoscaler_provider::snapshot::Settings;
use serde_json::{Value, json};

use super::render::{built_by, repo};

/// The directory holding `promtool` and `promql-names` (built on first use).
pub fn tools() -> PathBuf {
    static TOOLS: OnceLock<PathBuf> = OnceLock::new();
    TOOLS
        .get_or_init(|| built_by("tests/upstream/promtool/build.sh"))
        .clone()
}

pub fn promtool() -> PathBuf {
    tools().join("promtool")
}

/// The PrometheusRule deploy/monitoring/prometheusrule.yaml.
pub fn prometheus_rule() -> Value {
    let path = repo("deploy/monitoring/prometheusrule.yaml");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

/// The dashboard deploy/monitoring/dashboard.json.
pub fn dashboard() -> Value {
    let path = repo("deploy/monitoring/dashboard.json");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

/// Every alert of the PrometheusRule: (name, expression).
pub fn rule_expressions() -> Vec<(String, String)> {
    let rule = prometheus_rule();
    let mut out = Vec::new();
    for group in rule["spec"]["groups"].as_array().expect("spec.groups") {
        for r in group["rules"].as_array().expect("rules of a group") {
            let name = r["alert"]
                .as_str()
                .or_else(|| r["record"].as_str())
                .expect("a rule has alert or record")
                .to_string();
            out.push((name, r["expr"].as_str().expect("expr").to_string()));
        }
    }
    out
}

/// Every PromQL expression of the dashboard: (where, expression), panel targets and the queries of
/// its variables (`label_values(<selector>, <label>)`: the selector), Grafana's `$variables` replaced
/// by what they stand for, so Prometheus's parser reads them.
pub fn dashboard_expressions() -> Vec<(String, String)> {
    let dashboard = dashboard();
    let mut out = Vec::new();
    fn panels<'a>(list: &'a Value, into: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            into.push(p);
            panels(&p["panels"], into);
        }
    }
    let mut all = Vec::new();
    panels(&dashboard["panels"], &mut all);
    for p in all {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = t["expr"].as_str() {
                out.push((
                    format!("panel {:?} target {}", p["title"], t["refId"]),
                    substitute(expr),
                ));
            }
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if v["type"] != "query" {
            continue;
        }
        let query = v["query"]["query"]
            .as_str()
            .or_else(|| v["query"].as_str())
            .expect("a query variable's query");
        let selector = query
            .strip_prefix("label_values(")
            .and_then(|q| q.rsplit_once(','))
            .map(|(selector, _)| selector.trim())
            .unwrap_or_else(|| {
                panic!(
                    "variable {}: not label_values(<selector>, <label>)",
                    v["name"]
                )
            });
        out.push((format!("variable {}", v["name"]), substitute(selector)));
    }
    out
}

/// Grafana's `$__rate_interval` (and other intervals) as a duration, every other `$variable` as a
/// plain value.
fn substitute(expr: &str) -> String {
    let mut out = String::new();
    let mut rest = expr;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let name: String = rest[at + 1..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        out.push_str(if name.starts_with("__") {
            "5m"
        } else {
            "value"
        });
        rest = &rest[at + 1 + name.len()..];
    }
    out.push_str(rest);
    out
}

/// The metric names each expression selects, or why it does not parse (Prometheus's parser).
pub fn metric_names(exprs: &[String]) -> Vec<Result<BTreeSet<String>, String>> {
    let program = tools().join("promql-names");
    let mut child = Command::new(&program)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(serde_json::to_string(exprs).expect("JSON").as_bytes())
        .expect("write the expressions");
    let out = child.wait_with_output().expect("promql-names output");
    assert!(out.status.success(), "promql-names failed ({})", out.status);
    let parsed: Vec<Value> = serde_json::from_slice(&out.stdout).expect("promql-names JSON");
    assert_eq!(parsed.len(), exprs.len());
    parsed
        .into_iter()
        .map(|r| match r["error"].as_str() {
            Some(e) => Err(e.to_string()),
            None => Ok(r["names"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|n| n.as_str().map(String::from))
                .collect()),
        })
        .collect()
}

/// The exposition of a registry with a series in every family (families without a series are not
/// exposed at all): every recorder called once, a snapshot of one served MachineDeployment observed.
pub fn exercised_exposition() -> String {
    let m = Metrics::new();
    m.rpc("NodeGroups", tonic::Code::Ok, Duration::from_millis(1));
    m.api_write("increase-size", "ok", Duration::from_millis(5));
    m.mark_repaired();
    m.watch_event("machines.cluster.x-k8s.io", "list");
    m.watch_stale("machines.cluster.x-k8s.io", 0.0);
    m.rejected("NodeGroupDeleteNodes", "timeout");
    m.tls_reload("success");
    m.ready(true);
    let settings = Settings::default();
    let keys = &settings.keys;
    let object = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "MachineDeployment",
        "metadata": {
            "name": "md", "namespace": "ns", "uid": "u1", "resourceVersion": "1",
            "annotations": {keys.min_size.clone(): "1", keys.max_size.clone(): "5"},
        },
        "spec": {
            "clusterName": "c1",
            "replicas": 2,
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"clusterName": "c1"}},
        },
    });
    let resource = ScalableResource::from_json(ScalableKind::MachineDeployment, keys, &object)
        .unwrap_or_else(|e| panic!("a MachineDeployment: {e}"));
    let mut index = Index::default();
    index.apply_resource(
        ScalableKind::MachineDeployment,
        ObjectKey::new("ns", "md"),
        Ok(Arc::new(resource)),
    );
    let snapshot = index.snapshot(&settings);
    assert_eq!(snapshot.groups.len(), 1, "{:?}", snapshot.problems);
    m.observe_snapshot(&snapshot, Duration::from_millis(1));
    m.observe_groups(&snapshot);
    m.encode()
}

/// The series names an exposition (Prometheus text or OpenMetrics) offers: those of its samples,
/// and for each `# TYPE` those its type implies, so a family with no sample yet (a histogram before
/// its first observation) counts too.
pub fn exported_names(exposition: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in exposition.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                "summary" => &["", "_sum", "_count"],
                "info" => &["_info"],
                _ => &[""],
            };
            for s in suffixes {
                let full = if name.ends_with(s) {
                    name.to_string()
                } else {
                    format!("{name}{s}")
                };
                names.insert(full);
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// Series Prometheus itself records for each target it scrapes.
pub const PROMETHEUS_SERIES: [&str; 1] = ["up"];

/// The metric families the alerts and the dashboard select that `exported` lacks, each with where
/// it is used; an expression that does not parse, or selects no metric at all, is reported too.
pub fn unknown_metrics(exported: &BTreeSet<String>) -> Vec<String> {
    let mut all = rule_expressions()
        .into_iter()
        .map(|(n, e)| (format!("alert {n}"), e))
        .collect::<Vec<_>>();
    all.extend(dashboard_expressions());
    let exprs: Vec<String> = all.iter().map(|(_, e)| e.clone()).collect();
    let mut wrong = Vec::new();
    for ((at, expr), names) in all.iter().zip(metric_names(&exprs)) {
        match names {
            Err(e) => wrong.push(format!("{at}: {expr:?} does not parse: {e}")),
            Ok(names) if names.is_empty() => {
                wrong.push(format!("{at}: {expr:?} selects no metric by name"))
            }
            Ok(names) => {
                for n in names.difference(exported) {
                    // Prometheus's own series of every scrape target.
                    if PROMETHEUS_SERIES.contains(&n.as_str()) {
                        continue;
                    }
                    wrong.push(format!("{at}: {n} is not exported ({expr})"));
                }
            }
        }
    }
    wrong
}
