//! deploy/monitoring/ proved without a cluster: the alerts pass `promtool check rules` and `promtool test
//! rules` (tests/monitoring/alerts.test.yaml: synthetic series under which every alert fires, and others
//! under which it stays silent), and every expression of the alerts and of the Grafana dashboard parses
//! (Prometheus's own parser) and names only metrics the provider exports, read from its metrics registry
//! with a series in every family.
//! tests/e2e/observability.rs checks the same names against a running provider's /metrics.

pub mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Instant;

use serde_json::Value;
use support::monitoring;
use support::render::repo;

fn run(program: &Path, args: &[&str], dir: &Path) -> (bool, String) {
    let out = std::process::Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The PrometheusRule's groups as a plain Prometheus rules file, and the unit tests next to it.
fn rules_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let rule = monitoring::prometheus_rule();
    let rules = serde_json::json!({"groups": rule["spec"]["groups"]});
    std::fs::write(
        dir.path().join("rules.yaml"),
        serde_norway::to_string(&rules).expect("rules as YAML"),
    )
    .expect("write rules.yaml");
    std::fs::copy(
        repo("tests/monitoring/alerts.test.yaml"),
        dir.path().join("alerts.test.yaml"),
    )
    .expect("copy alerts.test.yaml");
    dir
}

#[test]
fn the_alerts_pass_promtool_check_rules() {
    let dir = rules_dir();
    let (ok, out) = run(
        &monitoring::promtool(),
        &["check", "rules", "rules.yaml"],
        dir.path(),
    );
    println!("promtool check rules:\n{out}");
    assert!(ok, "promtool check rules failed:\n{out}");
}

#[test]
fn every_alert_fires_on_its_synthetic_series_and_stays_silent_on_others() {
    // Each alert has a case where it fires and one where it must not (checked here, so a new alert
    // cannot go untested).
    let tests: Value = serde_norway::from_str(
        &std::fs::read_to_string(repo("tests/monitoring/alerts.test.yaml"))
            .expect("read alerts.test.yaml"),
    )
    .expect("parse alerts.test.yaml");
    let mut cases: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for group in tests["tests"].as_array().expect("tests") {
        for case in group["alert_rule_test"].as_array().into_iter().flatten() {
            let name = case["alertname"].as_str().expect("alertname").to_string();
            let firing = case["exp_alerts"].as_array().is_some_and(|a| !a.is_empty());
            let entry = cases.entry(name).or_default();
            if firing {
                entry.0 += 1;
            } else {
                entry.1 += 1;
            }
        }
    }
    for (alert, _) in monitoring::rule_expressions() {
        let (firing, silent) = cases.get(&alert).copied().unwrap_or_default();
        assert!(
            firing > 0 && silent > 0,
            "alert {alert}: {firing} firing and {silent} silent cases in alerts.test.yaml; each needs both"
        );
    }

    let dir = rules_dir();
    let started = Instant::now();
    let (ok, out) = run(
        &monitoring::promtool(),
        &["test", "rules", "alerts.test.yaml"],
        dir.path(),
    );
    println!(
        "promtool test rules ({:.1}s, {} alerts):\n{out}",
        started.elapsed().as_secs_f64(),
        cases.len()
    );
    assert!(ok, "promtool test rules failed:\n{out}");
}

#[test]
fn the_alerts_and_the_dashboard_name_only_metrics_the_provider_exports() {
    let exported = monitoring::exported_names(&monitoring::exercised_exposition());
    let wrong = monitoring::unknown_metrics(&exported);
    assert!(
        wrong.is_empty(),
        "exported: {exported:?}\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_dashboard_shows_every_metric_the_provider_exports() {
    let exported = monitoring::exported_names(&monitoring::exercised_exposition());
    let exprs: Vec<String> = monitoring::dashboard_expressions()
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    let used: BTreeSet<String> = monitoring::metric_names(&exprs)
        .into_iter()
        .filter_map(Result::ok)
        .flatten()
        .collect();
    // A family counts as shown when any of its series is (a histogram through its buckets).
    let family = |name: &str| {
        ["_bucket", "_sum", "_count", "_total", "_info"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name)
            .to_string()
    };
    let shown: BTreeSet<String> = used.iter().map(|n| family(n)).collect();
    let missing: Vec<String> = exported
        .iter()
        .map(|n| family(n))
        .filter(|f| !shown.contains(f))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    assert!(
        missing.is_empty(),
        "families on no dashboard panel: {missing:?}"
    );
    let panels: Vec<String> = monitoring::dashboard()["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .filter(|p| p["type"] != "row")
        .map(|p| {
            format!(
                "{} ({})",
                p["title"].as_str().unwrap_or(""),
                p["type"].as_str().unwrap_or("")
            )
        })
        .collect();
    println!("dashboard panels: {}", panels.join(", "));
}

/// GitHub's anchor of a Markdown heading: lower case, spaces to `-`, other punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Every alert's `runbook_url` is the README section of that alert: the base `deploy/monitoring`
/// writes (the kustomization's `readme`, README.md as shipped), `#`, the anchor of a heading of README
/// named like the alert. Changing the base in the kustomization changes every runbook_url.
#[test]
fn every_alert_links_its_runbook_in_the_readme() {
    let readme = std::fs::read_to_string(repo("README.md")).expect("read README.md");
    let anchors: BTreeSet<String> = readme
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect();
    let dir = tempfile::tempdir().expect("a temporary directory");
    for file in [
        "kustomization.yaml",
        "prometheusrule.yaml",
        "podmonitor.yaml",
        "dashboard.json",
    ] {
        std::fs::copy(repo("deploy/monitoring").join(file), dir.path().join(file))
            .expect("copy deploy/monitoring");
    }
    let base = "https://docs.example.invalid/capi-autoscaler-provider/v0.1.0/README.md";
    for (readme_base, dir) in [
        ("README.md", repo("deploy/monitoring")),
        (base, dir.path().to_path_buf()),
    ] {
        if readme_base == base {
            let file = dir.join("kustomization.yaml");
            let text = std::fs::read_to_string(&file).expect("read the kustomization");
            assert!(text.contains("- readme=README.md"), "{text}");
            std::fs::write(
                &file,
                text.replace("- readme=README.md", &format!("- readme={base}")),
            )
            .expect("write the kustomization");
        }
        let rendered = support::render::kustomize_path(&dir);
        let rule = support::render::all(&rendered, "PrometheusRule")[0];
        let mut alerts = 0;
        for group in rule["spec"]["groups"].as_array().expect("groups") {
            for r in group["rules"].as_array().expect("rules") {
                let name = r["alert"].as_str().expect("alert");
                let url = r["annotations"]["runbook_url"].as_str().unwrap_or_default();
                let want = format!("{readme_base}#{}", anchor(name));
                assert_eq!(url, want, "{name}");
                assert!(
                    anchors.contains(&anchor(name)),
                    "README has no heading {name} for the runbook_url of the alert"
                );
                alerts += 1;
            }
        }
        assert_eq!(alerts, monitoring::rule_expressions().len());
        // The base is a kustomize input, not an object applied to the cluster.
        assert!(
            support::render::all(&rendered, "ConfigMap")
                .iter()
                .all(|c| c["metadata"]["name"] != "capi-autoscaler-provider-runbooks")
        );
    }
}
