//! deploy/ as users apply it: both overlays built by kustomize and applied with a server-side dry run to
//! a real apiserver, and the shapes that matter checked (loopback sidecar, mTLS flags, least privilege,
//! non-root, read-only root filesystem).

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn kubectl(args: &[&str]) -> String {
    let out = Command::new("kubectl")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run kubectl (needed to build the kustomizations): {e}"));
    assert!(
        out.status.success(),
        "kubectl {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn build(overlay: &str) -> Vec<Value> {
    let dir = repo(overlay);
    let yaml = kubectl(&["kustomize", &dir.display().to_string()]);
    serde_yaml::Deserializer::from_str(&yaml)
        .map(|doc| serde::Deserialize::deserialize(doc).expect("a YAML document"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the build"))
}

fn container<'a>(deployment: &'a Value, name: &str) -> &'a Value {
    deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn args(container: &Value) -> Vec<String> {
    container["args"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn dry_run(overlay: &str, kubeconfig: &Path) -> String {
    kubectl(&[
        "--kubeconfig",
        &kubeconfig.display().to_string(),
        "apply",
        "--dry-run=server",
        "-k",
        &repo(overlay).display().to_string(),
    ])
}

fn assert_hardened(provider: &Value, pod: &Value) {
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(provider["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        provider["securityContext"]["allowPrivilegeEscalation"],
        false
    );
    assert_eq!(provider["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(provider["livenessProbe"]["httpGet"]["path"], "/healthz");
}

#[tokio::test]
async fn the_sidecar_overlay_applies_and_keeps_the_provider_on_loopback() {
    let cp = support::control_plane(support::Setup::shipped());
    let out = dry_run("deploy/overlays/sidecar", cp.admin_kubeconfig());
    assert!(
        out.contains("deployment.apps/cluster-autoscaler created (server dry run)"),
        "{out}"
    );
    assert!(out.contains("clusterrole.rbac.authorization.k8s.io/capi-autoscaler-provider created (server dry run)"), "{out}");

    let objects = build("deploy/overlays/sidecar");
    let deployment = find(&objects, "Deployment", "cluster-autoscaler");
    let provider = container(deployment, "provider");
    assert!(
        args(provider).contains(&"--address=127.0.0.1:8086".to_string()),
        "{:?}",
        args(provider)
    );
    let ca = container(deployment, "cluster-autoscaler");
    assert!(args(ca).contains(&"--cloud-provider=externalgrpc".to_string()));
    let config = find(&objects, "ConfigMap", "cluster-autoscaler-cloud-config");
    let cloud_config = config["data"]["cloud-config.yaml"]
        .as_str()
        .unwrap_or_default();
    assert!(
        cloud_config.contains("address: \"127.0.0.1:8086\""),
        "{cloud_config}"
    );
    assert_hardened(provider, &deployment["spec"]["template"]["spec"]);
}

#[tokio::test]
async fn the_standalone_overlay_applies_with_mutual_tls() {
    let cp = support::control_plane(support::Setup::shipped());
    let client = cp.admin_client().await;
    support::crds::install(&client, &[repo("tests/fixtures/cert-manager-crds.yaml")])
        .await
        .expect("install the cert-manager stand-in CRDs");
    let out = dry_run("deploy/overlays/standalone", cp.admin_kubeconfig());
    assert!(
        out.contains("service/capi-autoscaler-provider created (server dry run)"),
        "{out}"
    );
    assert!(out.contains("certificate.cert-manager.io/capi-autoscaler-provider-server-cert created (server dry run)"), "{out}");

    let objects = build("deploy/overlays/standalone");
    let deployment = find(&objects, "Deployment", "capi-autoscaler-provider");
    let provider = container(deployment, "provider");
    let a = args(provider);
    for flag in ["--tls-cert=", "--tls-key=", "--tls-client-ca="] {
        assert!(
            a.iter().any(|x| x.starts_with(flag)),
            "{flag} missing: {a:?}"
        );
    }
    let server = find(
        &objects,
        "Certificate",
        "capi-autoscaler-provider-server-cert",
    );
    let names: Vec<&str> = server["spec"]["dnsNames"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let config = find(&objects, "ConfigMap", "cluster-autoscaler-cloud-config");
    let cloud_config = config["data"]["cloud-config.yaml"]
        .as_str()
        .unwrap_or_default();
    // CA verifies the server certificate against the host part of `address`.
    assert!(
        cloud_config.contains("address: \"capi-autoscaler-provider:8086\""),
        "{cloud_config}"
    );
    assert!(names.contains(&"capi-autoscaler-provider"), "{names:?}");
    assert_hardened(provider, &deployment["spec"]["template"]["spec"]);
}

#[tokio::test]
async fn the_shipped_cluster_role_grants_reads_scale_and_machine_patches_only() {
    let objects = build("deploy/base");
    let role = find(&objects, "ClusterRole", "capi-autoscaler-provider");
    let rules = role["rules"].as_array().expect("rules");
    for rule in rules {
        let verbs: Vec<&str> = rule["verbs"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        for verb in &verbs {
            assert!(
                ["get", "list", "watch", "patch", "create"].contains(verb),
                "unexpected verb {verb} in {rule}"
            );
        }
        let resources: Vec<&str> = rule["resources"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        if verbs.contains(&"patch") {
            assert!(
                resources
                    .iter()
                    .all(|r| r.ends_with("/scale") || *r == "machines" || *r == "events"),
                "patch beyond scale, machines and events: {rule}"
            );
        }
        if verbs.contains(&"create") {
            assert_eq!(resources, ["events"], "create beyond events: {rule}");
        }
        assert!(
            !verbs.contains(&"delete") && !verbs.contains(&"update"),
            "{rule}"
        );
    }
}
