//! deploy/ as rendered (kustomize overlays, this repository's Helm chart deploy/helm with the official
//! chart as its dependency), checked for the shapes that matter without running anything: images from
//! real registries at the pinned versions, the provider's gRPC on loopback unless mutual TLS guards it,
//! mounted keys readable by the pod's user, the provider as a native sidecar with a startup probe, the
//! workload kubeconfig for a management-cluster CA, least-privilege RBAC identical in both packagings and
//! covering `explain`, a PodDisruptionBudget, priority and NetworkPolicy for every pod, the pod's name
//! for the provider's Events, the chart's provider values settable with `--set`, and two releases in one
//! namespace sharing no object. tests/manifests.rs applies and runs the same objects.

pub mod support;

use std::collections::BTreeSet;

use serde_json::Value;
use support::render::{
    self, all, container, containers, expected_ca_image, expected_provider_image, find, flag,
    strings,
};

const CA_REPOSITORY: &str = "registry.k8s.io/autoscaling/cluster-autoscaler";

struct Rendered {
    name: &'static str,
    objects: Vec<Value>,
}

fn variants() -> Vec<Rendered> {
    vec![
        Rendered {
            name: "sidecar overlay",
            objects: render::kustomize("deploy/overlays/sidecar"),
        },
        Rendered {
            name: "standalone overlay",
            objects: render::kustomize("deploy/overlays/standalone"),
        },
        Rendered {
            name: "helm sidecar",
            objects: render::provider_template("cluster-autoscaler", "kube-system", &[], &[]),
        },
        Rendered {
            name: "helm kind+CAPD",
            objects: render::provider_template(
                "cluster-autoscaler",
                "default",
                &["deploy/helm/values-kind-capd.yaml"],
                &[],
            ),
        },
    ]
}

fn pod_specs(objects: &[Value]) -> Vec<&Value> {
    all(objects, "Deployment")
        .into_iter()
        .map(|d| &d["spec"]["template"]["spec"])
        .collect()
}

fn is_ca(c: &Value) -> bool {
    c["image"]
        .as_str()
        .is_some_and(|i| i.starts_with(CA_REPOSITORY))
}

fn is_provider(c: &Value) -> bool {
    !is_ca(c)
}

/// A provider setting: its flag in the argv, else its environment variable.
fn setting(c: &Value, flag_name: &str, env: &str) -> Option<String> {
    flag(&argv(c), flag_name).or_else(|| {
        c["env"].as_array()?.iter().find(|e| e["name"] == env)?["value"]
            .as_str()
            .map(String::from)
    })
}

/// The argv tail a container runs with (`command` + `args`; the chart puts CA's flags in `command`).
fn argv(c: &Value) -> Vec<String> {
    let mut v = strings(&c["command"]);
    v.extend(strings(&c["args"]));
    v
}

#[test]
fn images_are_the_pinned_releases_from_real_registries() {
    for v in variants() {
        let mut seen = BTreeSet::new();
        for spec in pod_specs(&v.objects) {
            for c in containers(spec) {
                let image = c["image"].as_str().unwrap_or_default();
                if is_ca(c) {
                    assert_eq!(image, expected_ca_image(), "{}", v.name);
                } else {
                    assert_eq!(image, expected_provider_image(), "{}", v.name);
                }
                seen.insert(is_ca(c));
            }
        }
        assert_eq!(seen.len(), 2, "{}: both CA and the provider run", v.name);
    }
}

#[test]
fn plaintext_grpc_stays_on_loopback_and_mutual_tls_guards_the_rest() {
    for v in variants() {
        for spec in pod_specs(&v.objects) {
            for c in containers(spec).into_iter().filter(|c| is_provider(c)) {
                let a = argv(c);
                let address = flag(&a, "--address").unwrap_or_else(|| "127.0.0.1:8086".into());
                if address.starts_with("127.0.0.1:") {
                    continue;
                }
                for f in ["--tls-cert", "--tls-key", "--tls-client-ca"] {
                    assert!(
                        flag(&a, f).is_some(),
                        "{}: gRPC on {address} without {f}: {a:?}",
                        v.name
                    );
                }
            }
        }
    }
}

/// CA's cloud-config names the provider where it listens: the sidecar's loopback address, or the
/// standalone Service, whose name the server certificate carries.
#[test]
fn the_cloud_config_points_at_the_provider() {
    for v in variants() {
        let config = all(&v.objects, "ConfigMap")
            .into_iter()
            .find_map(|cm| cm["data"]["cloud-config.yaml"].as_str())
            .unwrap_or_else(|| panic!("{}: no cloud-config.yaml", v.name));
        let parsed: Value = serde_norway::from_str(config).expect("cloud-config YAML");
        let address = parsed["address"].as_str().expect("address");
        let (host, port) = address.rsplit_once(':').expect("host:port");
        if host == "127.0.0.1" {
            for spec in pod_specs(&v.objects) {
                let cs = containers(spec);
                if cs.iter().any(|c| is_ca(c)) {
                    let provider = cs
                        .iter()
                        .find(|c| is_provider(c))
                        .unwrap_or_else(|| panic!("{}: loopback without a sidecar", v.name));
                    assert_eq!(
                        flag(&argv(provider), "--address").as_deref(),
                        Some(address),
                        "{}",
                        v.name
                    );
                }
            }
            assert!(parsed.get("cert").is_none(), "{}", v.name);
        } else {
            let service = find(&v.objects, "Service", host);
            assert_eq!(
                service["spec"]["ports"][0]["port"].as_u64(),
                port.parse().ok()
            );
            let cert = find(
                &v.objects,
                "Certificate",
                "capi-autoscaler-provider-server-cert",
            );
            let names = strings(&cert["spec"]["dnsNames"]);
            assert!(names.iter().any(|n| n == host), "{names:?}");
            for key in ["cert", "key", "cacert"] {
                assert!(parsed.get(key).is_some(), "{}: mTLS needs {key}", v.name);
            }
        }
    }
}

/// Every mounted Secret is readable by the pod's user: world-readable, or the pod's fsGroup makes it
/// group-readable (the kubelet adds group read and the group). Root-only files with no fsGroup were the
/// issue's unreadable key.
#[test]
fn mounted_secrets_are_readable_by_the_pods_user() {
    for v in variants() {
        for spec in pod_specs(&v.objects) {
            let sc = &spec["securityContext"];
            assert_eq!(sc["runAsNonRoot"], true, "{}", v.name);
            assert_eq!(sc["runAsUser"], 65532, "{}", v.name);
            for volume in spec["volumes"].as_array().into_iter().flatten() {
                let Some(secret) = volume.get("secret") else {
                    continue;
                };
                let mode = secret["defaultMode"].as_u64().unwrap_or(0o644);
                let world_readable = mode & 0o004 != 0;
                assert!(
                    world_readable || sc["fsGroup"].as_u64() == sc["runAsUser"].as_u64(),
                    "{}: Secret volume {} (mode {mode:o}) is not readable by uid {}",
                    v.name,
                    volume["name"],
                    sc["runAsUser"]
                );
            }
            for c in containers(spec) {
                let csc = &c["securityContext"];
                assert_eq!(csc["readOnlyRootFilesystem"], true, "{}", v.name);
                assert_eq!(csc["allowPrivilegeEscalation"], false, "{}", v.name);
            }
        }
    }
}

/// In one pod, the provider is a native sidecar with a startup probe on its /readyz: CA starts once the
/// provider's caches have listed.
#[test]
fn the_provider_is_a_native_sidecar_with_a_startup_probe() {
    for v in variants() {
        for spec in pod_specs(&v.objects) {
            if !containers(spec).iter().any(|c| is_ca(c)) {
                continue;
            }
            let Some(provider) = spec["initContainers"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| is_provider(c))
            else {
                continue; // the standalone CA pod has no provider
            };
            assert_eq!(provider["restartPolicy"], "Always", "{}", v.name);
            assert_eq!(
                provider["startupProbe"]["httpGet"]["path"], "/readyz",
                "{}",
                v.name
            );
        }
    }
}

/// CA in the management cluster watches the workload cluster through the Secret Cluster API writes; the
/// provider reads the management cluster in-cluster and the workload cluster's Nodes through the same file.
#[test]
fn the_kind_capd_values_give_ca_the_workload_kubeconfig() {
    let objects = render::provider_template(
        "cluster-autoscaler",
        "default",
        &["deploy/helm/values-kind-capd.yaml"],
        &[],
    );
    let d = all(&objects, "Deployment")[0];
    let spec = &d["spec"]["template"]["spec"];
    let volume = spec["volumes"]
        .as_array()
        .and_then(|vs| {
            vs.iter()
                .find(|v| v["secret"]["secretName"] == "demo-kubeconfig")
        })
        .expect("a volume of the Secret demo-kubeconfig");
    for c in containers(spec) {
        let mount = c["volumeMounts"]
            .as_array()
            .and_then(|ms| ms.iter().find(|m| m["name"] == volume["name"]))
            .unwrap_or_else(|| panic!("{} mounts no workload kubeconfig", c["name"]));
        let file = format!("{}/value", mount["mountPath"].as_str().unwrap_or_default());
        if is_ca(c) {
            assert_eq!(flag(&argv(c), "--kubeconfig"), Some(file));
        } else {
            // In the environment: `check` run in the container sees the same clusters.
            let kubeconfig = setting(c, "--kubeconfig", "CAPI_AUTOSCALER_PROVIDER_KUBECONFIG");
            assert_eq!(kubeconfig, Some(file));
            let authoritative = setting(
                c,
                "--clusterapi-cloud-config-authoritative",
                "CAPI_AUTOSCALER_PROVIDER_CLOUD_CONFIG_AUTHORITATIVE",
            );
            assert_eq!(authoritative.as_deref(), Some("true"), "{c}");
            assert!(c["env"].as_array().is_some_and(|e| {
                e.iter()
                    .all(|v| v["name"] != "CAPI_AUTOSCALER_PROVIDER_CLOUD_CONFIG")
            }));
        }
    }
}

/// The Helm chart grants the provider exactly the ClusterRole of deploy/base.
#[test]
fn the_helm_values_grant_the_shipped_cluster_role() {
    let base = render::kustomize("deploy/base");
    let shipped = find(&base, "ClusterRole", "capi-autoscaler-provider")["rules"].clone();
    let text = std::fs::read_to_string(render::repo("deploy/helm/values.yaml")).expect("values");
    let parsed: Value = serde_norway::from_str(&text).expect("values YAML");
    assert_eq!(
        parsed["cluster-autoscaler"]["rbac"]["additionalRules"],
        shipped
    );
}

#[test]
fn the_sidecar_overlay_binds_both_roles_to_the_pods_service_account() {
    let objects = render::kustomize("deploy/overlays/sidecar");
    let d = find(&objects, "Deployment", "cluster-autoscaler");
    let sa = d["spec"]["template"]["spec"]["serviceAccountName"].clone();
    for (kind, name) in [
        ("ClusterRoleBinding", "capi-autoscaler-provider"),
        ("ClusterRoleBinding", "cluster-autoscaler"),
        ("RoleBinding", "cluster-autoscaler"),
    ] {
        assert_eq!(
            find(&objects, kind, name)["subjects"][0]["name"],
            sa,
            "{kind} {name}"
        );
    }
    let provider = container(&d["spec"]["template"]["spec"], "provider");
    assert_eq!(provider["restartPolicy"], "Always");
}

#[test]
fn the_shipped_cluster_role_grants_reads_scale_and_machine_patches_only() {
    let objects = render::kustomize("deploy/base");
    let role = find(&objects, "ClusterRole", "capi-autoscaler-provider");
    let rules = role["rules"].as_array().expect("rules");
    for rule in rules {
        let verbs = strings(&rule["verbs"]);
        for verb in &verbs {
            assert!(
                ["get", "list", "watch", "patch", "create"].contains(&verb.as_str()),
                "unexpected verb {verb} in {rule}"
            );
        }
        let resources = strings(&rule["resources"]);
        if verbs.iter().any(|v| v == "patch") {
            assert!(
                resources.iter().all(|r| [
                    "machinedeployments",
                    "machinesets",
                    "machinepools",
                    "machines",
                    "events"
                ]
                .contains(&r.as_str())),
                "patch beyond the scalable resources, machines and events: {rule}"
            );
        }
        if verbs.iter().any(|v| v == "create") {
            assert_eq!(resources, ["events"], "create beyond events: {rule}");
        }
        assert!(
            !verbs.iter().any(|v| v == "delete" || v == "update"),
            "{rule}"
        );
    }
}

/// The provider's `CAPI_AUTOSCALER_PROVIDER_CLUSTER` as the pod would get it: a value, or the key of the
/// rendered ConfigMap it refers to.
fn provider_cluster(objects: &[Value], c: &Value) -> Option<String> {
    let var = c["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == "CAPI_AUTOSCALER_PROVIDER_CLUSTER")?;
    if let Some(value) = var["value"].as_str() {
        return Some(value.to_string());
    }
    let from = &var["valueFrom"]["configMapKeyRef"];
    let map = find(objects, "ConfigMap", from["name"].as_str()?);
    map["data"][from["key"].as_str()?]
        .as_str()
        .map(String::from)
}

fn provider_containers(objects: &[Value]) -> Vec<&Value> {
    pod_specs(objects)
        .into_iter()
        .flat_map(containers)
        .filter(|c| is_provider(c))
        .collect()
}

/// The general-purpose packagings name the Cluster once, as the placeholder, and every provider
/// container gets it; the kind + CAPD values name the quickstart's Cluster `default/demo`.
#[test]
fn the_cluster_is_named_once_and_reaches_every_provider() {
    for v in variants() {
        let mut copy = v.objects.clone();
        let placeholders = render::name_cluster(&mut copy, render::CLUSTER_PLACEHOLDER);
        let want = if v.name == "helm kind+CAPD" {
            assert_eq!(placeholders, 0, "{}", v.name);
            "default/demo"
        } else {
            assert_eq!(placeholders, 1, "{}: the Cluster is named once", v.name);
            render::CLUSTER_PLACEHOLDER
        };
        let providers = provider_containers(&v.objects);
        assert!(!providers.is_empty(), "{}", v.name);
        for c in providers {
            assert_eq!(
                provider_cluster(&v.objects, c).as_deref(),
                Some(want),
                "{}",
                v.name
            );
        }
    }
    for values in [
        "deploy/helm/values.yaml",
        "deploy/helm/values-kind-capd.yaml",
    ] {
        let text = std::fs::read_to_string(render::repo(values)).expect("values file");
        let parsed: Value = serde_norway::from_str(&text).expect("values YAML");
        assert!(
            parsed["provider"]["cluster"]["name"].is_string(),
            "{values}: the chart value names the Cluster"
        );
        assert!(
            !text.contains("NODE_GROUP_AUTO_DISCOVERY"),
            "{values}: no second name of the Cluster in a discovery spec"
        );
    }
}

/// The chart's one value is what the provider gets: `provider.cluster.name` (and `.namespace`) set at
/// install time reach the provider's environment.
#[test]
fn the_helm_cluster_value_feeds_the_provider() {
    for (values, ns) in [
        (&[][..], "kube-system"),
        (&["deploy/helm/values-kind-capd.yaml"][..], "default"),
    ] {
        let objects = render::provider_template(
            "cluster-autoscaler",
            ns,
            values,
            &[
                ("provider.cluster.name", "prod"),
                ("provider.cluster.namespace", "fleet"),
            ],
        );
        for c in provider_containers(&objects) {
            assert_eq!(
                provider_cluster(&objects, c).as_deref(),
                Some("fleet/prod"),
                "{values:?}"
            );
        }
        let objects = render::provider_template(
            "cluster-autoscaler",
            ns,
            values,
            &[
                ("provider.cluster.name", "prod"),
                ("provider.cluster.namespace", ""),
            ],
        );
        for c in provider_containers(&objects) {
            assert_eq!(
                provider_cluster(&objects, c).as_deref(),
                Some("prod"),
                "{values:?}"
            );
        }
    }
}

/// Left as shipped, the placeholder stops the provider at start with an error saying what to set: the
/// real binary, with the environment each rendered provider container gets.
#[test]
fn the_placeholder_left_as_is_stops_the_provider_at_start() {
    for v in variants()
        .into_iter()
        .filter(|v| v.name != "helm kind+CAPD")
    {
        for c in provider_containers(&v.objects) {
            let cluster = provider_cluster(&v.objects, c).expect("the provider's Cluster");
            let out = std::process::Command::new(support::provider::PROVIDER_BIN)
                .args(["serve", "--address", "127.0.0.1:0", "--metrics-address", ""])
                .env("CAPI_AUTOSCALER_PROVIDER_CLUSTER", &cluster)
                .env("CAPI_AUTOSCALER_PROVIDER_CLOUD_CONFIG", "/nonexistent")
                .stdin(std::process::Stdio::null())
                .output()
                .expect("run the provider");
            let stderr = String::from_utf8_lossy(&out.stderr);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(!out.status.success(), "{}: {stdout}{stderr}", v.name);
            let log = format!("{stdout}{stderr}");
            for needle in [
                "CAPI_AUTOSCALER_PROVIDER_CLUSTER",
                "placeholder",
                "NAMESPACE/NAME",
                "provider.cluster.name",
            ] {
                assert!(log.contains(needle), "{}: {needle} not in: {log}", v.name);
            }
            // It stopped on the placeholder, before reaching for a cluster.
            assert!(!log.contains("/nonexistent"), "{}: {log}", v.name);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Monitoring: what scrapes the provider's /metrics in each packaging.

/// The port of the provider's `--metrics-address` (flag or environment).
fn metrics_port(c: &Value) -> u64 {
    setting(
        c,
        "--metrics-address",
        "CAPI_AUTOSCALER_PROVIDER_METRICS_ADDRESS",
    )
    .and_then(|a| a.rsplit_once(':').and_then(|(_, p)| p.parse().ok()))
    .unwrap_or(8087)
}

/// Whether `labels` carries every entry of `selector` (a matchLabels or a Service selector).
fn selects(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| labels[k] == *v))
}

/// The pods (their Deployment's namespace and pod spec) whose labels `selector` selects in `namespace`.
fn selected_pods<'a>(
    objects: &'a [Value],
    selector: &Value,
    namespaces: &[&str],
) -> Vec<&'a Value> {
    all(objects, "Deployment")
        .into_iter()
        .filter(|d| {
            namespaces.contains(&d["metadata"]["namespace"].as_str().unwrap_or_default())
                && selects(selector, &d["spec"]["template"]["metadata"]["labels"])
        })
        .map(|d| &d["spec"]["template"]["spec"])
        .collect()
}

/// The container and container port a (named or numbered) port of a pod spec is.
fn container_port<'a>(spec: &'a Value, port: &Value) -> Option<(&'a Value, u64)> {
    containers(spec).into_iter().find_map(|c| {
        c["ports"].as_array()?.iter().find_map(|p| {
            let hit = match port {
                Value::String(name) => p["name"] == name.as_str(),
                Value::Number(n) => p["containerPort"].as_u64() == n.as_u64(),
                _ => false,
            };
            hit.then(|| (c, p["containerPort"].as_u64().unwrap_or_default()))
        })
    })
}

/// What each scrape target is: (is the provider, its container port).
fn targets(pods: &[&Value], port: &Value) -> Vec<(bool, u64)> {
    pods.iter()
        .filter_map(|spec| container_port(spec, port))
        .map(|(c, p)| (is_provider(c), p))
        .collect()
}

/// `kubectl apply -k deploy/monitoring` beside a kustomize overlay: its PodMonitor selects the pods the
/// provider runs in (CA's pod with the sidecar, the provider's own standalone) and scrapes the
/// provider's --metrics-address port; the dashboard ConfigMap carries dashboard.json for Grafana's
/// sidecar.
#[test]
fn the_pod_monitor_scrapes_the_providers_metrics_port_in_the_kustomize_overlays() {
    let monitoring = render::kustomize("deploy/monitoring");
    let monitor = find(&monitoring, "PodMonitor", "capi-autoscaler-provider");
    let namespace = monitor["metadata"]["namespace"]
        .as_str()
        .unwrap_or_default();
    let endpoints = monitor["spec"]["podMetricsEndpoints"]
        .as_array()
        .expect("podMetricsEndpoints");
    for overlay in ["deploy/overlays/sidecar", "deploy/overlays/standalone"] {
        let objects = render::kustomize(overlay);
        let pods = selected_pods(
            &objects,
            &monitor["spec"]["selector"]["matchLabels"],
            &[namespace],
        );
        assert_eq!(
            pods.len(),
            1,
            "{overlay}: the PodMonitor selects the provider's pods"
        );
        let provider = containers(pods[0])
            .into_iter()
            .find(|c| is_provider(c))
            .expect("a provider container in the selected pods");
        let scraped: Vec<(bool, u64)> = endpoints
            .iter()
            .flat_map(|e| targets(&pods, &e["port"]))
            .collect();
        assert_eq!(
            scraped,
            vec![(true, metrics_port(provider))],
            "{overlay}: the PodMonitor scrapes the provider's --metrics-address port alone"
        );
        assert_eq!(endpoints[0]["path"], "/metrics");
    }
    assert!(all(&monitoring, "PrometheusRule").len() == 1);
    let dashboard = find(
        &monitoring,
        "ConfigMap",
        "capi-autoscaler-provider-dashboard",
    );
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(
        dashboard["data"]["capi-autoscaler-provider.json"].as_str(),
        Some(
            std::fs::read_to_string(render::repo("deploy/monitoring/dashboard.json"))
                .expect("read dashboard.json")
                .as_str()
        )
    );
}

/// With the official chart's `serviceMonitor.enabled`, its ServiceMonitor selects this chart's Service
/// for the provider too (same labels, port named like the chart's): it scrapes CA's port and the
/// provider's --metrics-address port, each through its own Service.
#[test]
fn the_charts_service_monitor_scrapes_the_provider_through_the_values_service() {
    for (values, namespace) in [
        (&[][..], "kube-system"),
        (&["deploy/helm/values-kind-capd.yaml"][..], "default"),
    ] {
        let objects = render::provider_template(
            "cluster-autoscaler",
            namespace,
            values,
            &[("cluster-autoscaler.serviceMonitor.enabled", "true")],
        );
        let monitors = all(&objects, "ServiceMonitor");
        assert_eq!(monitors.len(), 1, "{values:?}");
        let monitor = monitors[0];
        let namespaces: Vec<&str> = monitor["spec"]["namespaceSelector"]["matchNames"]
            .as_array()
            .expect("namespaceSelector.matchNames")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let mut scraped = BTreeSet::new();
        for service in all(&objects, "Service") {
            if !namespaces.contains(
                &service["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default(),
            ) || !selects(
                &monitor["spec"]["selector"]["matchLabels"],
                &service["metadata"]["labels"],
            ) {
                continue;
            }
            let pods = selected_pods(&objects, &service["spec"]["selector"], &namespaces);
            for endpoint in monitor["spec"]["endpoints"].as_array().expect("endpoints") {
                for port in service["spec"]["ports"].as_array().into_iter().flatten() {
                    if port["name"] == endpoint["port"] {
                        scraped.extend(targets(&pods, &port["targetPort"]));
                    }
                }
            }
        }
        let provider = provider_containers(&objects)[0];
        assert_eq!(
            scraped,
            BTreeSet::from([(false, 8085), (true, metrics_port(provider))]),
            "{values:?}: the ServiceMonitor scrapes CA's metrics and the provider's"
        );
    }
}

// ---------------------------------------------------------------------------------------------------
// What an operator's review asks of every packaging.

/// The objects of `kind` in `namespace` whose `selector` (a LabelSelector's matchLabels) selects the pod
/// template of Deployment `d`.
fn selecting<'a>(objects: &'a [Value], kind: &str, d: &Value, selector: &str) -> Vec<&'a Value> {
    let labels = &d["spec"]["template"]["metadata"]["labels"];
    all(objects, kind)
        .into_iter()
        .filter(|o| {
            o["metadata"]["namespace"] == d["metadata"]["namespace"]
                && selects(&o["spec"][selector]["matchLabels"], labels)
        })
        .collect()
}

/// Every pod: a PodDisruptionBudget of one voluntary eviction at a time (CA drains a node whose
/// kube-system pods have one, and never two replicas at once) and the priority the official chart gives
/// CA (`system-cluster-critical`).
#[test]
fn every_pod_has_a_disruption_budget_and_the_autoscalers_priority() {
    for v in variants() {
        for d in all(&v.objects, "Deployment") {
            let name = &d["metadata"]["name"];
            let budgets = selecting(&v.objects, "PodDisruptionBudget", d, "selector");
            assert_eq!(
                budgets.len(),
                1,
                "{}: PodDisruptionBudgets of {name}",
                v.name
            );
            assert_eq!(
                budgets[0]["spec"]["maxUnavailable"], 1,
                "{}: {name}",
                v.name
            );
            assert!(
                budgets[0]["spec"].get("minAvailable").is_none(),
                "{}",
                v.name
            );
            assert_eq!(
                d["spec"]["template"]["spec"]["priorityClassName"], "system-cluster-critical",
                "{}: {name}",
                v.name
            );
        }
    }
}

/// The ports a NetworkPolicy admits to a pod and from where: `(container port, from)` for every port of
/// every ingress rule of the policies that select it, named ports resolved to the pod's containers.
fn admitted(objects: &[Value], d: &Value) -> Vec<(u64, Value)> {
    let spec = &d["spec"]["template"]["spec"];
    let mut out = Vec::new();
    for policy in selecting(objects, "NetworkPolicy", d, "podSelector") {
        assert!(
            strings(&policy["spec"]["policyTypes"]).contains(&"Ingress".to_string()),
            "{policy}"
        );
        for rule in policy["spec"]["ingress"].as_array().into_iter().flatten() {
            for port in rule["ports"].as_array().into_iter().flatten() {
                let number = match &port["port"] {
                    Value::Number(n) => n.as_u64(),
                    named => container_port(spec, named).map(|(_, p)| p),
                };
                let number = number.unwrap_or_else(|| panic!("port {port} of {policy}"));
                out.push((number, rule["from"].clone()));
            }
        }
    }
    out
}

/// Every pod is selected by a NetworkPolicy that admits what the kubelet probes and Prometheus scrapes
/// (CA's 8085, the provider's --metrics-address port) and nothing else, but the standalone provider's
/// gRPC port, from cluster-autoscaler's pods alone.
#[test]
fn network_policies_admit_the_scraped_ports_and_grpc_from_the_autoscaler_only() {
    for v in variants() {
        for d in all(&v.objects, "Deployment") {
            let name = d["metadata"]["name"].as_str().unwrap_or_default();
            let spec = &d["spec"]["template"]["spec"];
            let rules = admitted(&v.objects, d);
            assert!(
                !rules.is_empty(),
                "{}: no NetworkPolicy selects {name}",
                v.name
            );
            let mut want = BTreeSet::new();
            for c in containers(spec) {
                if is_ca(c) {
                    want.insert(8085);
                } else {
                    want.insert(metrics_port(c));
                }
            }
            for (port, from) in &rules {
                if want.contains(port) {
                    continue;
                }
                // Only gRPC on a non-loopback address, only from CA's pods.
                let grpc = containers(spec).into_iter().find(|c| {
                    is_provider(c)
                        && flag(&argv(c), "--address").is_some_and(|a| {
                            !a.starts_with("127.0.0.1:") && a.ends_with(&format!(":{port}"))
                        })
                });
                assert!(grpc.is_some(), "{}: {name} admits port {port}", v.name);
                let peers = from
                    .as_array()
                    .expect("gRPC admitted from named peers only");
                let ca_pods: Vec<&Value> = all(&v.objects, "Deployment")
                    .into_iter()
                    .filter(|o| {
                        containers(&o["spec"]["template"]["spec"])
                            .iter()
                            .any(|c| is_ca(c))
                    })
                    .collect();
                for peer in peers {
                    assert!(
                        ca_pods.iter().all(|ca| selects(
                            &peer["podSelector"]["matchLabels"],
                            &ca["spec"]["template"]["metadata"]["labels"]
                        )) && peer.get("namespaceSelector").is_none(),
                        "{}: gRPC of {name} admitted from {peer}",
                        v.name
                    );
                }
            }
            let open: BTreeSet<u64> = rules.iter().map(|(p, _)| *p).collect();
            assert!(
                want.is_subset(&open),
                "{}: {name} admits {open:?}, the probed and scraped ports are {want:?}",
                v.name
            );
        }
    }
}

/// The Events the provider records name its pod (`POD_NAME` from the downward API): several replicas'
/// Events tell apart.
#[test]
fn every_provider_knows_its_pods_name() {
    for v in variants() {
        for c in provider_containers(&v.objects) {
            let var = c["env"]
                .as_array()
                .and_then(|e| e.iter().find(|e| e["name"] == "POD_NAME"))
                .unwrap_or_else(|| panic!("{}: no POD_NAME in {}", v.name, c["name"]));
            assert_eq!(
                var["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name",
                "{}",
                v.name
            );
        }
    }
}

/// Whether `rules` (a Role's or ClusterRole's) grant `verb` on `resource` of the core group named
/// `name` (`None`: any object).
fn grants(rules: &Value, resource: &str, verb: &str, name: Option<&str>) -> bool {
    rules.as_array().into_iter().flatten().any(|r| {
        let names = strings(&r["resourceNames"]);
        strings(&r["apiGroups"]).iter().any(|g| g.is_empty())
            && strings(&r["resources"]).iter().any(|x| x == resource)
            && strings(&r["verbs"]).iter().any(|x| x == verb || x == "*")
            && (names.is_empty() || name.is_some_and(|n| names.iter().any(|x| x == n)))
    })
}

/// `explain` in the provider's container (README "Troubleshoot") reads the pod, lists its Events and
/// reads CA's status ConfigMap: the roles bound to the pod's ServiceAccount grant exactly that, in every
/// packaging where CA watches the cluster the pod runs in (tests/manifests.rs runs it there).
#[test]
fn the_pods_service_account_may_do_what_explain_reads() {
    for v in variants()
        .into_iter()
        .filter(|v| v.name != "helm kind+CAPD")
    {
        for d in all(&v.objects, "Deployment") {
            let spec = &d["spec"]["template"]["spec"];
            if !containers(spec).iter().any(|c| is_provider(c)) {
                continue;
            }
            let sa = spec["serviceAccountName"].as_str().unwrap_or_default();
            let ns = d["metadata"]["namespace"].as_str().unwrap_or_default();
            let mut rules: Vec<Value> = Vec::new();
            for kind in ["ClusterRoleBinding", "RoleBinding"] {
                for b in all(&v.objects, kind) {
                    let bound = b["subjects"].as_array().into_iter().flatten().any(|s| {
                        s["kind"] == "ServiceAccount" && s["name"] == sa && s["namespace"] == ns
                    });
                    if bound {
                        let role = &b["roleRef"];
                        let r = find(
                            &v.objects,
                            role["kind"].as_str().unwrap_or_default(),
                            role["name"].as_str().unwrap_or_default(),
                        );
                        rules.extend(r["rules"].as_array().into_iter().flatten().cloned());
                    }
                }
            }
            let rules = Value::from(rules);
            for (resource, verb, name) in [
                ("pods", "get", None),
                ("events", "list", None),
                ("configmaps", "get", Some("cluster-autoscaler-status")),
            ] {
                assert!(
                    grants(&rules, resource, verb, name),
                    "{}: {sa} may not {verb} {resource} {name:?}",
                    v.name
                );
            }
        }
    }
}

/// `helm upgrade --set provider.image.tag=…` (and the repository, the resources): first-class values of
/// the chart, not an edit of a list that `--set` would replace whole. The image tag defaults to the
/// chart's appVersion, the crate's version.
#[test]
fn the_providers_image_and_resources_are_set_with_set() {
    let chart: Value = serde_norway::from_str(
        &std::fs::read_to_string(render::repo("deploy/helm/Chart.yaml")).expect("Chart.yaml"),
    )
    .expect("Chart.yaml as YAML");
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"));
    assert_eq!(chart["version"], env!("CARGO_PKG_VERSION"));
    let objects = render::provider_template(
        "cluster-autoscaler",
        "kube-system",
        &[],
        &[
            (
                "provider.image.repository",
                "registry.example/capi-autoscaler-provider",
            ),
            ("provider.image.tag", "0.2.0-rc.1"),
            ("provider.resources.requests.memory", "512Mi"),
            ("provider.extraArgs[0]", "--watch-stale-after=2m"),
        ],
    );
    let providers = provider_containers(&objects);
    assert_eq!(providers.len(), 1);
    let p = providers[0];
    assert_eq!(
        p["image"],
        "registry.example/capi-autoscaler-provider:0.2.0-rc.1"
    );
    assert_eq!(p["resources"]["requests"]["memory"], "512Mi");
    assert_eq!(
        p["resources"]["limits"]["memory"], "1Gi",
        "the rest of the default kept"
    );
    assert_eq!(flag(&argv(p), "--watch-stale-after").as_deref(), Some("2m"));
    assert_eq!(
        flag(&argv(p), "--address").as_deref(),
        Some("127.0.0.1:8086")
    );
    assert_eq!(p["restartPolicy"], "Always");
}

/// Two releases (two workload Clusters) in one namespace: no object of one is an object of the other.
#[test]
fn two_releases_in_one_namespace_share_no_object() {
    let key = |o: &Value| {
        (
            o["kind"].as_str().unwrap_or_default().to_string(),
            o["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            o["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        )
    };
    let [a, b] = ["a", "b"].map(|c| {
        render::provider_template(
            &format!("autoscaler-{c}"),
            "fleet",
            &[],
            &[("provider.cluster.name", c)],
        )
    });
    let names_a: BTreeSet<_> = a.iter().map(key).collect();
    let names_b: BTreeSet<_> = b.iter().map(key).collect();
    assert_eq!(names_a.len(), a.len());
    let shared: Vec<_> = names_a.intersection(&names_b).collect();
    assert!(shared.is_empty(), "objects of both releases: {shared:?}");
    // Each release's pod mounts its own cloud-config.
    for objects in [&a, &b] {
        let d = all(objects, "Deployment")[0];
        for volume in d["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .expect("volumes")
        {
            if let Some(map) = volume["configMap"]["name"].as_str() {
                find(objects, "ConfigMap", map);
            }
        }
    }
}

/// With `LOG_FORMAT=json` (a log collector parsing every line), the error that stops the provider at
/// start is a JSON line like every other: the placeholder left in the shipped manifests, and a flag
/// value clap refuses.
#[test]
fn fatal_start_up_errors_are_json_lines_with_log_format_json() {
    // (the arguments, the environment, what the error must name)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 2] = [
        (
            &["serve", "--address", "127.0.0.1:0", "--metrics-address", ""],
            &[(
                "CAPI_AUTOSCALER_PROVIDER_CLUSTER",
                render::CLUSTER_PLACEHOLDER,
            )],
            "provider.cluster.name",
        ),
        (
            &["serve", "--watch-stale-after", "soon"],
            &[("CAPI_AUTOSCALER_PROVIDER_CLUSTER", "demo")],
            "--watch-stale-after",
        ),
    ];
    for (args, env, needle) in cases {
        let out = std::process::Command::new(support::provider::PROVIDER_BIN)
            .args(args)
            .envs(env.iter().copied())
            .env("LOG_FORMAT", "json")
            .env("CAPI_AUTOSCALER_PROVIDER_CLOUD_CONFIG", "/nonexistent")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run the provider");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<Value> = stderr
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {l}"))
            })
            .collect();
        let fatal = lines
            .iter()
            .find(|l| l["fields"]["fatal"] == true)
            .unwrap_or_else(|| panic!("{args:?}: no fatal line in {stderr}"));
        assert_eq!(fatal["level"], "ERROR", "{fatal}");
        let message = fatal["fields"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{args:?}: {message}");
        // And without it, the plain `error: …` a person reads.
        let out = std::process::Command::new(support::provider::PROVIDER_BIN)
            .args(args)
            .envs(env.iter().copied())
            .env_remove("LOG_FORMAT")
            .env("CAPI_AUTOSCALER_PROVIDER_CLOUD_CONFIG", "/nonexistent")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run the provider");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.lines().any(|l| l.starts_with("error: ")), "{stderr}");
        assert!(serde_json::from_str::<Value>(stderr.lines().last().unwrap_or("")).is_err());
    }
}

/// Every Role and ClusterRole a packaging ships is bound in it: none lies unused on the cluster (the
/// workload cluster's Node reader lives in deploy/workload-cluster, with its binding, for that cluster).
#[test]
fn every_shipped_role_is_bound() {
    let mut packagings = variants();
    packagings.push(Rendered {
        name: "workload cluster",
        objects: render::kustomize("deploy/workload-cluster"),
    });
    for v in packagings {
        for kind in ["ClusterRole", "Role"] {
            for role in all(&v.objects, kind) {
                let name = &role["metadata"]["name"];
                let bound = ["ClusterRoleBinding", "RoleBinding"].iter().any(|b| {
                    all(&v.objects, b).iter().any(|b| {
                        b["roleRef"]["kind"] == kind
                            && b["roleRef"]["name"] == *name
                            && b["subjects"].as_array().is_some_and(|s| !s.is_empty())
                    })
                });
                assert!(bound, "{}: {kind} {name} is bound to no one", v.name);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// README: the commands of Install and Operate are what is shipped.

/// The text of README's section `## title` (up to the next `## `).
fn readme_section(readme: &str, title: &str) -> String {
    let start = readme
        .find(&format!("\n## {title}\n"))
        .unwrap_or_else(|| panic!("README has no section {title}"));
    let rest = &readme[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |e| e + 3);
    rest[..end].to_string()
}

/// The commands of the ```sh blocks of `text` (continuation lines joined, comments dropped), each with
/// the 300 characters before its block.
fn shell_commands(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find("```sh\n") {
        let before = rest[open.saturating_sub(300)..open].to_string();
        let body = &rest[open + 6..];
        let close = body.find("```").expect("a closed ```sh block");
        let joined = body[..close].replace("\\\n", " ");
        for line in joined.lines() {
            let command = line.split(" #").next().unwrap_or_default().trim();
            if !command.is_empty() && !command.starts_with('#') {
                out.push((
                    command.split_whitespace().collect::<Vec<_>>().join(" "),
                    before.clone(),
                ));
            }
        }
        rest = &body[close + 3..];
    }
    out
}

/// Every command in README's Install and Operate sections is one a test runs, or marked as needing
/// Docker: `helm install`/`helm upgrade` of deploy/helm are rendered here with exactly their
/// arguments (tests/manifests.rs applies and runs the same renders), `kubectl apply -k` renders its
/// folder (applied by tests/manifests.rs), `kubectl create token` is run by tests/manifests.rs, and
/// `helm dependency update` is what `render::provider_chart` does without a network.
#[test]
fn readme_install_and_operate_commands_are_the_tested_ones() {
    let readme = std::fs::read_to_string(render::repo("README.md")).expect("read README.md");
    let mut seen = 0;
    for title in ["Install", "Operate"] {
        for (command, before) in shell_commands(&readme_section(&readme, title)) {
            seen += 1;
            let words: Vec<&str> = command.split_whitespace().collect();
            match words.as_slice() {
                ["helm", "dependency", "update", "deploy/helm"] => {}
                [
                    "helm",
                    verb @ ("install" | "upgrade"),
                    release,
                    "deploy/helm",
                    args @ ..,
                ] => {
                    let (mut ns, mut files, mut set) = ("default", Vec::new(), Vec::new());
                    let mut i = 0;
                    while i < args.len() {
                        match args[i] {
                            "--namespace" | "-n" => ns = args[i + 1],
                            "-f" => files.push(args[i + 1]),
                            "--set" => set.extend(args[i + 1].split(',').map(|kv| {
                                kv.split_once('=').unwrap_or_else(|| panic!("{command}"))
                            })),
                            "--reuse-values" => {
                                i += 1;
                                continue;
                            }
                            other => panic!("{command}: {other} is not understood by this test"),
                        }
                        i += 2;
                    }
                    let objects = render::provider_template(release, ns, &files, &set);
                    let providers = provider_containers(&objects);
                    assert_eq!(providers.len(), 1, "{command}");
                    for (k, v) in &set {
                        match *k {
                            "provider.cluster.name" => assert_eq!(
                                provider_cluster(&objects, providers[0]).as_deref(),
                                Some(*v),
                                "{command}"
                            ),
                            "provider.image.tag" => assert!(
                                providers[0]["image"]
                                    .as_str()
                                    .is_some_and(|i| i.ends_with(&format!(":{v}"))),
                                "{command}"
                            ),
                            other => panic!("{command}: {other} is not checked by this test"),
                        }
                    }
                    eprintln!(
                        "README: helm {verb} {release} rendered ({} objects)",
                        objects.len()
                    );
                }
                [.., "apply", "-k", dir] => {
                    assert!(!render::kustomize(dir).is_empty(), "{command}");
                }
                [.., "create", "token", "capi-autoscaler-provider", _] => {}
                ["docker", ..] | ["kind", ..] => {
                    assert!(
                        before.contains("needs Docker"),
                        "{command}: not marked as needing Docker"
                    );
                }
                _ => panic!(
                    "README command `{command}` is run by no test (nor marked as needing Docker)"
                ),
            }
        }
    }
    assert!(seen >= 5, "{seen} commands found");
}

/// README's Quickstart reads CA's status ConfigMap where the kind + CAPD values make CA write it: the
/// namespace of CA's last `--namespace` (the workload cluster's kube-system).
#[test]
fn the_quickstart_reads_cas_status_where_ca_writes_it() {
    let readme = std::fs::read_to_string(render::repo("README.md")).expect("read README.md");
    let objects = render::provider_template(
        "cluster-autoscaler",
        "default",
        &["deploy/helm/values-kind-capd.yaml"],
        &[],
    );
    let ca = pod_specs(&objects)
        .into_iter()
        .flat_map(containers)
        .find(|c| is_ca(c))
        .expect("CA's container");
    let namespace = flag(&argv(ca), "--namespace").expect("CA's --namespace");
    let quickstart = readme_section(&readme, "Quickstart on a management cluster");
    let reads: Vec<String> = shell_commands(&quickstart)
        .into_iter()
        .map(|(c, _)| c)
        .filter(|c| c.contains("configmap cluster-autoscaler-status"))
        .collect();
    assert!(!reads.is_empty());
    for command in reads {
        let words: Vec<&str> = command.split_whitespace().collect();
        let ns = words
            .windows(2)
            .find(|w| w[0] == "-n" || w[0] == "--namespace")
            .map(|w| w[1]);
        assert_eq!(ns, Some(namespace.as_str()), "{command}");
    }
}
