//! deploy/ rendered the way users render it: the kustomize overlays with `kubectl kustomize`, and this
//! repository's Helm chart (deploy/helm, which depends on the official cluster-autoscaler chart) with a
//! real `helm template` (helm v3 built from the Go modules pinned in tests/upstream/helm/, by its
//! build.sh); the official chart alone too, for the in-tree install a user moves from.
//!
//! The chart (the version pinned in `tests/upstream/cluster-autoscaler-chart.version`) is resolved by
//! `tests/upstream/artifact.sh` like the CA binaries: `CLUSTER_AUTOSCALER_CHART` (a chart folder), else a local
//! mirror of upstream artifacts, else `helm pull` from the chart repository of kubernetes/autoscaler, checked
//! against the pinned sha256.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use serde_json::Value;

/// The official chart version the values files are written for and tested with (the first word of
/// `tests/upstream/cluster-autoscaler-chart.version`; the second is its package's sha256).
pub fn chart_version() -> &'static str {
    include_str!("../upstream/cluster-autoscaler-chart.version")
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .and_then(|l| l.split_whitespace().next())
        .expect("a version in tests/upstream/cluster-autoscaler-chart.version")
}

/// A path in this repository.
pub fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Runs `program args…` and returns its stdout; panics with its output when it fails.
pub fn run(program: &Path, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    assert!(
        out.status.success(),
        "{} {args:?} failed ({}):\n{}{}",
        program.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The objects of a YAML stream (empty documents dropped).
pub fn parse_stream(yaml: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(yaml)
        .map(|doc| serde::Deserialize::deserialize(doc).expect("a YAML document"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// `kubectl kustomize` of a folder of this repository (e.g. `deploy/overlays/sidecar`).
pub fn kustomize(dir: &str) -> Vec<Value> {
    kustomize_path(&repo(dir))
}

/// `kubectl kustomize` of a folder anywhere.
pub fn kustomize_path(dir: &Path) -> Vec<Value> {
    let path = dir.display().to_string();
    parse_stream(&run(Path::new("kubectl"), &["kustomize", &path]))
}

/// The helm binary (built on first use; cached outside the repository).
pub fn helm() -> PathBuf {
    static HELM: OnceLock<PathBuf> = OnceLock::new();
    HELM.get_or_init(|| built_by("tests/upstream/helm/build.sh"))
        .clone()
}

/// Runs a build script of `tests/upstream` (it builds or finds its tools in the cache outside the
/// repository) and returns the path it prints.
pub fn built_by(script: &str) -> PathBuf {
    let script = repo(script);
    let out = Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed", script.display());
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// The folder of the official cluster-autoscaler chart ([`chart_version`]), resolved by
/// `tests/upstream/artifact.sh`.
pub fn chart() -> PathBuf {
    super::artifacts::resolved(&["cluster-autoscaler-chart"])
}

/// The Kubernetes version the tests run (the `k8s.io/kubernetes` that tests/upstream/go.mod pins): `helm
/// template` is told it, as `helm install` would learn it from the cluster.
pub fn kube_version() -> &'static str {
    include_str!("../upstream/go.mod")
        .lines()
        .find_map(|l| l.trim().strip_prefix("k8s.io/kubernetes "))
        .and_then(|rest| rest.split_whitespace().next())
        .expect("k8s.io/kubernetes in tests/upstream/go.mod")
}

/// This repository's chart (deploy/helm) as `helm dependency update` leaves it, the official chart
/// ([`chart`]) in its `charts/`: a copy of its own for this test process (a `charts/` or `Chart.lock` a
/// user's `helm dependency update` left in deploy/helm is not copied).
pub fn provider_chart() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // Tests have cargo's scratch folder; the demo, which shares this module, the system's.
        let scratch = option_env!("CARGO_TARGET_TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = scratch
            .join(format!("provider-chart-{}", std::process::id()))
            .join("capi-autoscaler-provider");
        if dir.exists() {
            std::fs::remove_dir_all(&dir).expect("clear the chart copy");
        }
        copy_dir(&repo("deploy/helm"), &dir, &["charts", "Chart.lock"]);
        std::fs::create_dir_all(dir.join("charts")).expect("create charts/");
        // The official chart as a folder or as its packaged .tgz: helm takes either in charts/.
        let official = chart();
        if official.is_dir() {
            copy_dir(
                &official,
                &dir.join("charts").join("cluster-autoscaler"),
                &[],
            );
        } else {
            let file = official.file_name().expect("the chart's file name");
            std::fs::copy(&official, dir.join("charts").join(file))
                .unwrap_or_else(|e| panic!("copy {}: {e}", official.display()));
        }
        dir
    })
    .clone()
}

/// Copies the tree `from` to `to`, leaving out the entries of `from` named in `skip`.
fn copy_dir(from: &Path, to: &Path, skip: &[&str]) {
    std::fs::create_dir_all(to).unwrap_or_else(|e| panic!("create {}: {e}", to.display()));
    let entries = std::fs::read_dir(from).unwrap_or_else(|e| panic!("{}: {e}", from.display()));
    for entry in entries {
        let entry = entry.expect("a directory entry");
        let name = entry.file_name();
        if skip.iter().any(|s| name == *s) {
            continue;
        }
        let (src, dest) = (entry.path(), to.join(&name));
        if entry.file_type().expect("a file type").is_dir() {
            copy_dir(&src, &dest, &[]);
        } else {
            std::fs::copy(&src, &dest)
                .unwrap_or_else(|e| panic!("copy {} to {}: {e}", src.display(), dest.display()));
        }
    }
}

/// `helm template RELEASE deploy/helm --namespace NAMESPACE -f FILE… --set KEY=VALUE…`: this repository's
/// chart, values files of this repository (later ones override earlier ones, as with helm).
pub fn provider_template(
    release: &str,
    namespace: &str,
    values: &[&str],
    set: &[(&str, &str)],
) -> Vec<Value> {
    let files: Vec<PathBuf> = values.iter().map(|v| repo(v)).collect();
    let files: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    template(&provider_chart(), &files, release, namespace, set)
}

/// [`provider_template`] with values files anywhere.
pub fn provider_template_files(values: &[&Path], release: &str, namespace: &str) -> Vec<Value> {
    template(&provider_chart(), values, release, namespace, &[])
}

/// The placeholder the shipped manifests carry where the operator names their Cluster.
pub const CLUSTER_PLACEHOLDER: &str = "REPLACE-WITH-CLUSTER-NAME";

/// `objects` with every string that is the placeholder replaced by `cluster`: what an operator does to
/// the kustomize overlays.
pub fn name_cluster(objects: &mut [Value], cluster: &str) -> usize {
    fn walk(v: &mut Value, cluster: &str) -> usize {
        match v {
            Value::String(s) if s == CLUSTER_PLACEHOLDER => {
                *s = cluster.to_string();
                1
            }
            Value::Array(items) => items.iter_mut().map(|i| walk(i, cluster)).sum(),
            Value::Object(map) => map.values_mut().map(|i| walk(i, cluster)).sum(),
            _ => 0,
        }
    }
    objects.iter_mut().map(|o| walk(o, cluster)).sum()
}

/// `helm template RELEASE <the official chart> --namespace NAMESPACE -f FILE…` with values files
/// anywhere (later files override earlier ones, as with helm).
pub fn helm_template_files(values: &[&Path], release: &str, namespace: &str) -> Vec<Value> {
    template(&chart(), values, release, namespace, &[])
}

/// `helm template RELEASE CHART --namespace NAMESPACE -f FILE… --set KEY=VALUE…`.
fn template(
    chart: &Path,
    values: &[&Path],
    release: &str,
    namespace: &str,
    set: &[(&str, &str)],
) -> Vec<Value> {
    let chart = chart.display().to_string();
    let mut args: Vec<String> = [
        "template",
        release,
        &chart,
        "--namespace",
        namespace,
        "--kube-version",
        kube_version(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for file in values {
        args.extend(["-f".to_string(), file.display().to_string()]);
    }
    for (key, value) in set {
        args.extend(["--set".to_string(), format!("{key}={value}")]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    parse_stream(&run(&helm(), &args))
}

/// The object of `kind` named `name`.
pub fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} among the rendered objects"))
}

/// Every object of `kind`.
pub fn all<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

/// The containers of a pod spec, init containers (and native sidecars) first.
pub fn containers(pod_spec: &Value) -> Vec<&Value> {
    ["initContainers", "containers"]
        .iter()
        .filter_map(|k| pod_spec[k].as_array())
        .flatten()
        .collect()
}

/// The container of a pod spec named `name`.
pub fn container<'a>(pod_spec: &'a Value, name: &str) -> &'a Value {
    containers(pod_spec)
        .into_iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name} in {pod_spec}"))
}

/// The strings of a string list field (`args`, `command`).
pub fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// The value of `--name=value` in `args` (the last one wins, as with Go's and clap's flag parsing).
pub fn flag(args: &[String], name: &str) -> Option<String> {
    let prefix = format!("{name}=");
    args.iter()
        .rev()
        .find_map(|a| a.strip_prefix(&prefix).map(String::from))
}

/// The `cluster-autoscaler` image every variant must run: the official registry, the default pinned
/// version (tests/upstream/cluster-autoscaler.versions).
pub fn expected_ca_image() -> String {
    format!(
        "registry.k8s.io/autoscaling/cluster-autoscaler:v{}",
        super::autoscaler::default_version()
    )
}

/// The provider image the manifests name: the one `make image` builds, tagged with the crate's version.
pub fn expected_provider_image() -> String {
    format!("capi-autoscaler-provider:{}", env!("CARGO_PKG_VERSION"))
}
