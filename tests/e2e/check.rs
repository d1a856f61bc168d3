//! The one-shot commands against the real apiserver (shipped CRDs): `check` (JSON and table) lists
//! the groups and every problem by object and field, exits 1 with problems and 0 without; a template
//! the identity may not read (the shipped ClusterRole without its infrastructure rule) is a problem
//! that says so, and `check` still returns promptly; `template <ID>` prints the Node as YAML.
//!
//! Every test works in a namespace of its own and runs the commands with a namespace filter.

use crate::support;

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use support::capi::fresh_capi;
use support::capi::{Capi, Kind, Scalable};
use support::infra::{CliRun, connection_args, run_cli, template_status};
use support::{CAPI_GROUP, ControlPlane, Setup};

const SETUP: Setup = Setup::shipped();
const VERSION: &str = "v1beta2";

const CPU: &str = "capacity.cluster-autoscaler.kubernetes.io/cpu";
const MEMORY: &str = "capacity.cluster-autoscaler.kubernetes.io/memory";
const PRICE: &str = "capi-autoscaler-provider/hourly-price";

/// A one-shot command never takes longer than this (the provider's own listing timeout is 60 s,
/// so a command that waits for something it cannot read would show here).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

async fn capi() -> (&'static ControlPlane, Capi) {
    fresh_capi(SETUP, VERSION).await
}

/// `capi-autoscaler-provider <command> <extra…> --cloud-config <kubeconfig> --node-group-auto-discovery clusterapi:namespace=<ns>`.
async fn run(command: &str, extra: &[&str], kubeconfig: &Path, ns: &str) -> CliRun {
    let mut args: Vec<String> = vec![command.to_string()];
    args.extend(extra.iter().map(|a| a.to_string()));
    args.extend(connection_args(kubeconfig, ns));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_cli(&args, COMMAND_TIMEOUT).await
}

/// A group CA can scale from zero: capacity annotations, a price and an option.
fn good(name: &str) -> Scalable {
    Scalable::md(name)
        .bounds(0, 5)
        .replicas(1)
        .annotation(CPU, "4")
        .annotation(MEMORY, "16Gi")
        .annotation(PRICE, "0.25")
        .annotation(
            &format!("{CAPI_GROUP}/autoscaling-options-scaledownunneededtime"),
            "5m",
        )
}

fn group<'a>(report: &'a Value, id: &str) -> Option<&'a Value> {
    report["groups"]
        .as_array()
        .expect("groups is a list")
        .iter()
        .find(|g| g["id"] == id)
}

fn problems(report: &Value) -> Vec<(String, String, String)> {
    report["problems"]
        .as_array()
        .expect("problems is a list")
        .iter()
        .map(|p| {
            let s = |k: &str| p[k].as_str().unwrap_or_default().to_string();
            (s("object"), s("field"), s("message"))
        })
        .collect()
}

/// The problem about `object` at `field`; panics with the whole report otherwise.
fn problem(report: &Value, object: &str, field: &str) -> String {
    problems(report)
        .into_iter()
        .find(|(o, f, _)| o == object && f == field)
        .map(|(_, _, m)| m)
        .unwrap_or_else(|| {
            panic!(
                "no problem about {object} at {field}:\n{}",
                serde_json::to_string_pretty(&report["problems"]).unwrap()
            )
        })
}

#[tokio::test]
async fn check_lists_groups_and_problems_naming_object_and_field() {
    let (cp, capi) = capi().await;
    let ns = capi.ns.clone();
    capi.create_deployment(&good("good"), false).await;
    // max below min
    capi.create_deployment(
        &Scalable::md("bad-bounds").raw_bounds(Some("5"), Some("2")),
        false,
    )
    .await;
    // zero-size, no capacity anywhere
    capi.create_deployment(&Scalable::md("empty").bounds(0, 3).replicas(0), false)
        .await;
    capi.create_deployment(
        &Scalable::md("paused")
            .bounds(1, 3)
            .annotation("cluster.x-k8s.io/paused", ""),
        false,
    )
    .await;
    let id = |name: &str| capi.id(Kind::MachineDeployment, name);
    let object = |name: &str| format!("MachineDeployment {ns}/{name}");

    let run_json = run("check", &["-o", "json"], cp.admin_kubeconfig(), &ns).await;
    assert_eq!(run_json.code, Some(1), "{}", run_json.describe());
    let report = run_json.json();

    // Served groups: the good one (with its template) and the empty one (without).
    let g = group(&report, &id("good")).unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!(
        (&g["min"], &g["max"], &g["target"]),
        (&Value::from(0), &Value::from(5), &Value::from(1))
    );
    assert_eq!(g["template"]["cpu"], "4", "{g:#}");
    assert_eq!(g["template"]["memory"], "16Gi", "{g:#}");
    assert_eq!(g["template"]["capacity_source"], "annotations", "{g:#}");
    assert_eq!(g["hourly_price"], 0.25, "{g:#}");
    assert!(!g["options"].is_null(), "{g:#}");
    let e = group(&report, &id("empty")).unwrap_or_else(|| panic!("{report:#}"));
    assert!(e["template"].is_null(), "{e:#}");
    assert!(group(&report, &id("bad-bounds")).is_none(), "{report:#}");
    assert!(group(&report, &id("paused")).is_none(), "{report:#}");
    // The malformed and the paused groups are not served, and say why.
    let skipped = report["skipped"].as_object().expect("skipped is a map");
    assert!(skipped.contains_key(&id("bad-bounds")), "{skipped:?}");
    assert!(skipped.contains_key(&id("paused")), "{skipped:?}");

    // Every problem names its object and field.
    let max_key = format!("metadata.annotations[{}]", capi.max_key());
    let m = problem(&report, &object("bad-bounds"), &max_key);
    assert!(m.contains("below min"), "{m}");
    let m = problem(
        &report,
        &object("empty"),
        &format!("metadata.annotations[{CPU}]"),
    );
    assert!(
        m.contains("no cpu/memory capacity") && m.contains(MEMORY),
        "{m}"
    );
    let m = problem(
        &report,
        &object("paused"),
        "metadata.annotations[cluster.x-k8s.io/paused]",
    );
    assert!(m.contains("paused"), "{m}");
    assert!(
        problems(&report)
            .iter()
            .all(|(o, _, _)| o != &object("good")),
        "the good group has no problem: {:#}",
        report["problems"]
    );

    // The table: every group id, and the problems.
    let table = run("check", &[], cp.admin_kubeconfig(), &ns).await;
    assert_eq!(table.code, Some(1), "{}", table.describe());
    eprintln!("--- check (table) ---\n{}", table.stdout);
    for name in ["good", "empty"] {
        assert!(table.stdout.contains(&id(name)), "{}", table.stdout);
    }
    assert!(table.stdout.contains("NODE GROUP"), "{}", table.stdout);
    assert!(table.stdout.contains("PROBLEMS ("), "{}", table.stdout);
    assert!(
        table.stdout.contains(&object("bad-bounds")),
        "{}",
        table.stdout
    );
    assert!(table.stdout.contains(&max_key), "{}", table.stdout);
    assert!(table.stdout.contains("NOT SERVED"), "{}", table.stdout);
}

#[tokio::test]
async fn check_exits_zero_without_problems() {
    let (cp, capi) = capi().await;
    let ns = capi.ns.clone();
    capi.create_deployment(&good("one"), false).await;
    capi.create_deployment(&Scalable::md("two").bounds(0, 2).replicas(0), false)
        .await;
    support::infra::set_template_status(
        &capi.client,
        &ns,
        "two-tmpl",
        template_status(&[("cpu", "2"), ("memory", "4Gi")], Some(("arm64", "linux"))),
    )
    .await;

    let run_json = run("check", &["-o", "json"], cp.admin_kubeconfig(), &ns).await;
    assert_eq!(run_json.code, Some(0), "{}", run_json.describe());
    let report = run_json.json();
    assert_eq!(problems(&report), vec![], "{report:#}");
    let two = group(&report, &capi.id(Kind::MachineDeployment, "two"))
        .unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!(two["template"]["arch"], "arm64", "{two:#}");
    assert_eq!(
        two["template"]["capacity_source"], "template E2EMachineTemplate/two-tmpl",
        "{two:#}"
    );
    assert!(group(&report, &capi.id(Kind::MachineDeployment, "one")).is_some());

    let table = run("check", &[], cp.admin_kubeconfig(), &ns).await;
    assert_eq!(table.code, Some(0), "{}", table.describe());
    assert!(table.stdout.contains("no problems"), "{}", table.stdout);
    assert!(!table.stdout.contains("PROBLEMS"), "{}", table.stdout);
}

/// The ClusterRole of deploy/base/rbac.yaml without its infrastructure.cluster.x-k8s.io rule,
/// under another name.
async fn apply_role_without_infra(admin: &kube::Client, name: &str) {
    let mut role = support::capi::shipped_cluster_role();
    let rules = role.rules.take().unwrap_or_default();
    let before = rules.len();
    let rules: Vec<_> = rules
        .into_iter()
        .filter(|r| {
            !r.api_groups
                .iter()
                .flatten()
                .any(|g| g == support::capi::INFRA_GROUP)
        })
        .collect();
    assert_eq!(rules.len(), before - 1, "exactly one infrastructure rule");
    role.rules = Some(rules);
    support::capi::apply_cluster_role(admin, name, role).await;
}

#[tokio::test]
async fn an_unreadable_template_is_a_forbidden_problem_and_check_returns() {
    let (cp, capi) = capi().await;
    let ns = capi.ns.clone();
    capi.create_deployment(&good("denied"), false).await;
    capi.create_deployment(&Scalable::md("denied-zero").bounds(0, 3).replicas(0), false)
        .await;
    let role = "capi-autoscaler-provider-without-infra";
    apply_role_without_infra(&capi.client, role).await;
    let (_client, kubeconfig) = cp.restricted_identity(role).await;

    let run_json = run("check", &["-o", "json"], &kubeconfig, &ns).await;
    assert!(
        run_json.elapsed < COMMAND_TIMEOUT,
        "{}",
        run_json.describe()
    );
    assert_eq!(run_json.code, Some(1), "{}", run_json.describe());
    let report = run_json.json();
    for name in ["denied", "denied-zero"] {
        let m = problem(
            &report,
            &format!("MachineDeployment {ns}/{name}"),
            "spec.template.spec.infrastructureRef",
        );
        assert!(
            m.contains(&format!("E2EMachineTemplate {ns}/{name}-tmpl")),
            "the problem names the template: {m}"
        );
        assert!(m.contains("cannot read"), "{m}");
        assert!(m.to_lowercase().contains("forbidden"), "{m}");
    }
    // The annotated group is still described by its annotations; the other one cannot be.
    let denied = group(&report, &capi.id(Kind::MachineDeployment, "denied"))
        .unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!(
        denied["template"]["capacity_source"], "annotations",
        "{denied:#}"
    );
    let zero = group(&report, &capi.id(Kind::MachineDeployment, "denied-zero"))
        .unwrap_or_else(|| panic!("{report:#}"));
    assert!(zero["template"].is_null(), "{zero:#}");
}

#[tokio::test]
async fn template_prints_the_node_as_yaml() {
    let (cp, capi) = capi().await;
    let ns = capi.ns.clone();
    capi.create_deployment(&good("good"), false).await;
    capi.create_deployment(&Scalable::md("empty").bounds(0, 3).replicas(0), false)
        .await;

    let id = capi.id(Kind::MachineDeployment, "good");
    let out = run("template", &[&id], cp.admin_kubeconfig(), &ns).await;
    assert_eq!(out.code, Some(0), "{}", out.describe());
    let node: serde_norway::Value =
        serde_norway::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.describe()));
    let name = node["metadata"]["name"].as_str().unwrap_or_default();
    assert!(name.starts_with("good-template-"), "{}", out.stdout);
    assert_eq!(node["status"]["capacity"]["cpu"].as_str(), Some("4"));
    assert_eq!(node["status"]["capacity"]["memory"].as_str(), Some("16Gi"));
    assert_eq!(node["status"]["capacity"]["pods"].as_str(), Some("110"));
    assert_eq!(
        node["metadata"]["labels"]["kubernetes.io/hostname"].as_str(),
        Some(name)
    );

    // No template: exit 1 and the reason on stderr.
    let empty = capi.id(Kind::MachineDeployment, "empty");
    let out = run("template", &[&empty], cp.admin_kubeconfig(), &ns).await;
    assert_eq!(out.code, Some(1), "{}", out.describe());
    assert!(out.stdout.is_empty(), "{}", out.describe());
    assert!(
        out.stderr.contains("has no scale-from-zero template")
            && out.stderr.contains("no cpu/memory capacity"),
        "{}",
        out.describe()
    );

    // No such group: exit 2, naming it.
    let unknown = capi.id(Kind::MachineDeployment, "nope");
    let out = run("template", &[&unknown], cp.admin_kubeconfig(), &ns).await;
    assert_eq!(out.code, Some(2), "{}", out.describe());
    assert!(out.stderr.contains(&unknown), "{}", out.describe());
}

/// What the externalgrpc protocol cannot carry is said, not dropped: `dra-driver` and `csi-driver`
/// are problems on their group naming the upstream issue and what CA does instead; a group whose
/// options are answered carries the note that CA ≥ 1.35 then zeroes its max node startup time
/// (kubernetes/autoscaler#10245), and a group without options does not.
#[tokio::test]
async fn check_says_what_the_protocol_cannot_carry() {
    let (cp, capi) = capi().await;
    let ns = capi.ns.clone();
    capi.create_deployment(
        &Scalable::md("dra")
            .bounds(0, 3)
            .replicas(0)
            .annotation(CPU, "2")
            .annotation(MEMORY, "4Gi")
            .annotation(
                "capacity.cluster-autoscaler.kubernetes.io/dra-driver",
                "gpu.nvidia.com",
            )
            .annotation("capacity.cluster-autoscaler.kubernetes.io/gpu-count", "1")
            .annotation(
                "capacity.cluster-autoscaler.kubernetes.io/csi-driver",
                "ebs.csi.aws.com=25",
            ),
        false,
    )
    .await;
    capi.create_deployment(&good("options"), false).await;
    capi.create_deployment(
        &Scalable::md("plain")
            .bounds(0, 3)
            .replicas(1)
            .annotation(CPU, "2")
            .annotation(MEMORY, "4Gi"),
        false,
    )
    .await;
    let id = |name: &str| capi.id(Kind::MachineDeployment, name);
    let object = format!("MachineDeployment {ns}/dra");

    let run_json = run("check", &["-o", "json"], cp.admin_kubeconfig(), &ns).await;
    assert_eq!(run_json.code, Some(1), "{}", run_json.describe());
    let report = run_json.json();
    let m = problem(
        &report,
        &object,
        "metadata.annotations[capacity.cluster-autoscaler.kubernetes.io/dra-driver]",
    );
    assert!(m.contains("kubernetes/autoscaler#10277"), "{m}");
    assert!(m.contains("without DRA devices"), "{m}");
    let m = problem(
        &report,
        &object,
        "metadata.annotations[capacity.cluster-autoscaler.kubernetes.io/csi-driver]",
    );
    assert!(m.contains("kubernetes/autoscaler#10131"), "{m}");
    // The group is still served, with the template the protocol can carry.
    let dra = group(&report, &id("dra")).unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!(dra["template"]["cpu"], "2", "{dra:#}");

    let notes = |name: &str| -> Vec<String> {
        group(&report, &id(name)).unwrap_or_else(|| panic!("{report:#}"))["notes"]
            .as_array()
            .expect("notes is a list")
            .iter()
            .map(|n| n.as_str().unwrap_or_default().to_string())
            .collect()
    };
    let with_options = notes("options");
    assert_eq!(with_options.len(), 1, "{with_options:?}");
    assert!(
        with_options[0].contains("max node startup time to 0")
            && with_options[0].contains("kubernetes/autoscaler#10245"),
        "{with_options:?}"
    );
    assert!(notes("plain").is_empty());
    assert!(
        problems(&report)
            .iter()
            .all(|(o, _, _)| !o.ends_with("/options")),
        "a note is not a problem: {:#}",
        report["problems"]
    );

    let table = run("check", &[], cp.admin_kubeconfig(), &ns).await;
    eprintln!("--- check (table) ---\n{}", table.stdout);
    assert!(
        table
            .stdout
            .contains("note: CA >= 1.35 sets this group's max node startup time to 0"),
        "{}",
        table.stdout
    );
}

/// The zone label of a template in failure domain `1` (CAPZ's spelling) is the zone the Cluster's
/// Nodes in that failure domain carry (`eastus-1`), and `check` says so; a template whose failure
/// domain has no Node yet keeps the failure domain's name (`us-east-1a`, CAPA's spelling) and
/// `check` says where it came from and which annotation overrides it.
#[tokio::test]
async fn check_says_where_a_templates_zone_came_from() {
    use support::capi::Owner;
    let (cp, capi) = capi().await;
    let ns = capi.ns.clone();
    let sized = |name: &str, replicas: i64| {
        Scalable::md(name)
            .bounds(0, 5)
            .replicas(replicas)
            .annotation(CPU, "2")
            .annotation(MEMORY, "4Gi")
    };
    for (name, replicas) in [("capz", 0), ("capa", 0), ("busy", 1)] {
        capi.create_deployment(&sized(name, replicas), false).await;
    }
    for (name, fd) in [("capz", "1"), ("capa", "us-east-1a"), ("busy", "1")] {
        capi.patch(
            Kind::MachineDeployment,
            name,
            serde_json::json!({"spec": {"template": {"spec": {"failureDomain": fd}}}}),
        )
        .await;
    }
    // busy's Machine in failure domain 1, its Node in zone eastus-1.
    capi.create_machine(&capi.running("busy-0", Owner::Deployment("busy".into())))
        .await;
    capi.api(Kind::Machine)
        .patch(
            "busy-0",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"failureDomain": "1"}})),
        )
        .await
        .expect("set the Machine's failure domain");
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(capi.client.clone());
    let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": capi.node_name("busy-0"), "labels": {
            "topology.kubernetes.io/zone": "eastus-1",
        }, "annotations": {
            capi.key("cluster-namespace"): ns,
            capi.key("cluster-name"): support::capi::DEFAULT_CLUSTER,
        }},
        "spec": {"providerID": capi.provider_id("busy-0")}
    }))
    .expect("a Node");
    nodes
        .create(&kube::api::PostParams::default(), &node)
        .await
        .expect("create the workload Node");

    let kubeconfig = cp.admin_kubeconfig().display().to_string();
    // The shared apiserver's Nodes belong to many tests' Clusters: this test's is named.
    let cluster = format!("{ns}/{}", support::capi::DEFAULT_CLUSTER);
    let extra = [
        "--kubeconfig",
        kubeconfig.as_str(),
        "--cluster",
        cluster.as_str(),
    ];
    let mut json_args = vec!["-o", "json"];
    json_args.extend(extra);
    let run_json = run("check", &json_args, cp.admin_kubeconfig(), &ns).await;
    assert_eq!(run_json.code, Some(0), "{}", run_json.describe());
    let report = run_json.json();
    let zone = |name: &str| {
        group(&report, &capi.id(Kind::MachineDeployment, name))
            .unwrap_or_else(|| panic!("{report:#}"))["template"]["zone"]
            .clone()
    };
    assert_eq!(
        zone("capz"),
        serde_json::json!({"value": "eastus-1",
            "source": {"from": "failure_domain_nodes", "failure_domain": "1", "nodes": 1}}),
        "{report:#}"
    );
    assert_eq!(
        zone("capa"),
        serde_json::json!({"value": "us-east-1a",
            "source": {"from": "failure_domain", "failure_domain": "us-east-1a"}}),
        "{report:#}"
    );
    // busy's own Node says it.
    assert_eq!(zone("busy")["source"]["from"], "group_node", "{report:#}");

    let table = run("check", &extra, cp.admin_kubeconfig(), &ns).await;
    eprintln!("--- check (table) ---\n{}", table.stdout);
    assert!(
        table.stdout.contains(
            "zone: eastus-1 (from 1 Node(s) of the Cluster's Machines in failure domain \"1\")"
        ),
        "{}",
        table.stdout
    );
    assert!(
        table.stdout.contains("zone: us-east-1a (spec.template.spec.failureDomain \"us-east-1a\" as is")
            && table
                .stdout
                .contains("capacity.cluster-autoscaler.kubernetes.io/labels: topology.kubernetes.io/zone=<zone>"),
        "{}",
        table.stdout
    );
}

/// Run beside a provider of the same configuration (as in its container), `check` takes the running
/// provider's report (`GET /check` on its `--metrics-address`) instead of building watches of its
/// own, and says so; the report is the one its own watches give. A provider serving another
/// configuration is not taken.
#[tokio::test]
async fn check_asks_the_running_provider_of_its_configuration() {
    let (cp, capi) = capi().await;
    let ns = capi.ns.clone();
    capi.create_deployment(&good("served"), false).await;
    let discovery = format!("clusterapi:namespace={ns}");
    let provider = support::start_provider(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
    )
    .await;
    let from_server = run(
        "check",
        &["-o", "json", "--metrics-address", &provider.metrics_address],
        cp.admin_kubeconfig(),
        &ns,
    )
    .await;
    assert_eq!(from_server.code, Some(0), "{}", from_server.describe());
    assert!(
        from_server.stderr.contains(&format!(
            "(from the running provider at {})",
            provider.metrics_address
        )),
        "{}",
        from_server.describe()
    );
    let own = run(
        "check",
        &["-o", "json", "--metrics-address", ""],
        cp.admin_kubeconfig(),
        &ns,
    )
    .await;
    assert!(
        own.stderr.contains("(from watches of its own"),
        "{}",
        own.describe()
    );
    assert_eq!(from_server.json(), own.json(), "the same report either way");

    // Another configuration (a Cluster named) is not the running provider's: its own watches.
    let cluster = format!("{ns}/{}", support::capi::DEFAULT_CLUSTER);
    let other = run(
        "check",
        &[
            "-o",
            "json",
            "--metrics-address",
            &provider.metrics_address,
            "--cluster",
            &cluster,
        ],
        cp.admin_kubeconfig(),
        &ns,
    )
    .await;
    assert!(
        other.stderr.contains("serves another configuration"),
        "{}",
        other.describe()
    );
}

/// `explain`'s error paths and a pod CA never considered: a malformed argument and a missing pod
/// stop with an error naming them (exit 2); without CA there is no verdict, the status ConfigMap is
/// reported missing with the flags that name it, and the provider's groups are still shown.
#[tokio::test]
async fn explain_without_autoscaler_and_its_errors() {
    let (cp, capi) = capi().await;
    let ns = capi.ns.clone();
    capi.create_deployment(&good("g"), false).await;

    let bad = run(
        "explain",
        &["no-slash", "--metrics-address", ""],
        cp.admin_kubeconfig(),
        &ns,
    )
    .await;
    assert_eq!(bad.code, Some(2), "{}", bad.describe());
    assert!(
        bad.stderr.contains("expected NAMESPACE/POD"),
        "{}",
        bad.describe()
    );
    let pod_arg = format!("{ns}/missing");
    let missing = run(
        "explain",
        &[&pod_arg, "--metrics-address", ""],
        cp.admin_kubeconfig(),
        &ns,
    )
    .await;
    assert_eq!(missing.code, Some(2), "{}", missing.describe());
    assert!(
        missing
            .stderr
            .contains(&format!("pod {ns}/missing not found")),
        "{}",
        missing.describe()
    );

    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(capi.client.clone(), &ns);
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "lonely"},
        "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]},
    }))
    .expect("a Pod");
    pods.create(&kube::api::PostParams::default(), &pod)
        .await
        .expect("create the pod");
    let pod_arg = format!("{ns}/lonely");
    let out = run(
        "explain",
        &[
            &pod_arg,
            "-o",
            "json",
            "--metrics-address",
            "",
            "--autoscaler-namespace",
            &ns,
        ],
        cp.admin_kubeconfig(),
        &ns,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.describe());
    let e = out.json();
    assert_eq!(e["verdict"]["kind"], "no_decision", "{e:#}");
    assert!(
        e["status"]["unreadable"]
            .as_str()
            .is_some_and(|u| u.contains("not found") && u.contains("--status-config-map")),
        "{e:#}"
    );
    assert_eq!(
        e["groups"][0]["id"],
        capi.id(Kind::MachineDeployment, "g").as_str(),
        "{e:#}"
    );
    assert!(
        e["provider_source"]
            .as_str()
            .is_some_and(|s| s.starts_with("watches of its own")),
        "{e:#}"
    );
}
