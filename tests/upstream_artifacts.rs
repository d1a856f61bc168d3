//! The upstream artifact resolver (`tests/upstream/artifact.sh`), as a user's machine without a mirror runs it:
//! `tests/upstream/public-stand-ins.sh` stands in for the public sources on 127.0.0.1 (an OCI registry holding an
//! image of the default cluster-autoscaler release, two platforms like the official one; a Helm chart repository
//! with the official chart, packaged and indexed), pinned by the digests of what it serves. With an empty mirror,
//! the resolver must fetch each artifact from there, verify it against its pin, cache it, hand back a path that
//! works, serve the next request from the cache alone, and refuse what does not match its pin. Then the order:
//! a path from the environment first, a local mirror next, and the errors a user can meet on the way.

pub mod support;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::{Mutex, OnceLock, mpsc};
use std::time::Duration;

use support::{artifacts, autoscaler, procs, render};

/// Variables that would point the resolver somewhere else than the place a test means.
const ARTIFACT_VARIABLES: &[&str] = &[
    "CLUSTER_AUTOSCALER",
    "CLUSTER_AUTOSCALER_CLUSTERAPI",
    "CLUSTER_AUTOSCALER_CHART",
    "CAPI_GRPC_SERVER",
    "CAPI_SHARED_UPSTREAM",
    "CAPI_UPSTREAM_REGISTRY",
    "CAPI_UPSTREAM_CHART_REPO",
    "CAPI_UPSTREAM_PINS",
    "CAPI_ARTIFACT_CACHE",
];

/// A registry address nothing listens on: a resolver that contacts it fails.
const NO_REGISTRY: &str = "127.0.0.1:1";

/// The stand-ins, started once for this binary; they stop when it exits (their standard input closes).
struct StandIns {
    /// The environment that points the resolver at them (no mirror, their pins, a cache of their own).
    env: BTreeMap<String, String>,
    _child: Mutex<Child>,
    _stdin: Mutex<ChildStdin>,
}

fn stand_ins() -> &'static StandIns {
    static STAND_INS: OnceLock<StandIns> = OnceLock::new();
    STAND_INS.get_or_init(|| {
        let dir = procs::work_dir().join("stand-ins");
        let script = repo("tests/upstream/public-stand-ins.sh");
        // Not through procs::spawn: the script must outlive a panic of this thread and stop its servers
        // itself when this binary's end closes its standard input.
        let mut child = Command::new("bash")
            .arg(&script)
            .arg(&dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", script.display()));
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // Cold, the script builds crane and helm from Go modules first (helm: minutes).
        let mut env = BTreeMap::new();
        loop {
            match rx.recv_timeout(Duration::from_secs(20 * 60)) {
                Ok(line) if line == "ready" => break,
                Ok(line) => {
                    let (name, value) = line
                        .split_once('=')
                        .unwrap_or_else(|| panic!("stand-ins printed {line:?}, not NAME=VALUE"));
                    env.insert(name.to_string(), value.to_string());
                }
                Err(e) => panic!("the stand-ins did not get ready: {e} (their output is above)"),
            }
        }
        StandIns {
            env,
            _child: Mutex::new(child),
            _stdin: Mutex::new(stdin),
        }
    })
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// This process's environment without [`ARTIFACT_VARIABLES`] and `CLUSTER_AUTOSCALER_<version>`.
fn clean_env() -> Vec<(String, String)> {
    std::env::vars()
        .filter(|(name, _)| {
            !ARTIFACT_VARIABLES.contains(&name.as_str())
                && !name
                    .strip_prefix("CLUSTER_AUTOSCALER_")
                    .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .collect()
}

/// Runs the resolver with `args` in [`clean_env`] plus `env`.
fn resolver(env: &BTreeMap<String, String>, args: &[&str]) -> Output {
    Command::new("bash")
        .arg(artifacts::script())
        .args(args)
        .env_clear()
        .envs(clean_env())
        .envs(env)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", artifacts::script().display()))
}

/// The path a successful resolver run printed, with its stderr.
fn resolved(env: &BTreeMap<String, String>, args: &[&str]) -> (PathBuf, String) {
    let out = resolver(env, args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "artifact.sh {args:?} failed ({}):\n{stderr}",
        out.status
    );
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (path, stderr)
}

/// What a failed resolver run said; panics when it succeeded.
fn refused(env: &BTreeMap<String, String>, args: &[&str]) -> String {
    let out = resolver(env, args);
    assert!(
        !out.status.success(),
        "artifact.sh {args:?} succeeded with {}, expected a refusal",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The stand-ins' environment with a fresh cache named `name`, and `changes` applied.
fn public_env(name: &str, changes: &[(&str, &str)]) -> BTreeMap<String, String> {
    let mut env = stand_ins().env.clone();
    let cache = procs::work_dir().join(format!("cache-{name}"));
    env.insert("CAPI_ARTIFACT_CACHE".into(), cache.display().to_string());
    for (k, v) in changes {
        env.insert(k.to_string(), v.to_string());
    }
    env
}

/// A copy of the stand-ins' pins with `file`'s digest of its first entry replaced by `digest`.
fn pins_with(name: &str, file: &str, digest: &str) -> PathBuf {
    let from = PathBuf::from(&stand_ins().env["CAPI_UPSTREAM_PINS"]);
    let to = procs::work_dir().join(format!("pins-{name}"));
    std::fs::create_dir_all(&to).unwrap_or_else(|e| panic!("create {}: {e}", to.display()));
    for entry in [
        "cluster-autoscaler.versions",
        "cluster-autoscaler-chart.version",
    ] {
        let text =
            std::fs::read_to_string(from.join(entry)).unwrap_or_else(|e| panic!("{entry}: {e}"));
        let text = if entry == file {
            let mut lines: Vec<String> = text.lines().map(String::from).collect();
            let version = lines[0]
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
            lines[0] = format!("{version} {digest}");
            lines.join("\n") + "\n"
        } else {
            text
        };
        std::fs::write(to.join(entry), text).unwrap_or_else(|e| panic!("write {entry}: {e}"));
    }
    to
}

/// The entries of `dir` whose names start with `prefix` (finished cache entries, not scratch folders).
fn cached(dir: &Path, prefix: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// What the resolver finds as this process is configured (a mirror in CI, the real public sources elsewhere):
/// the artifact the stand-ins serve.
fn source(args: &[&str]) -> PathBuf {
    artifacts::resolve(args).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn cluster_autoscaler_is_pulled_by_its_pinned_digest_verified_cached_and_runs() {
    let version = autoscaler::default_version();
    let env = public_env("ca", &[]);
    let cache = PathBuf::from(&env["CAPI_ARTIFACT_CACHE"]);
    let registry = &env["CAPI_UPSTREAM_REGISTRY"];

    let (binary, stderr) = resolved(&env, &["cluster-autoscaler"]);
    assert!(
        stderr.contains("pulling /cluster-autoscaler") && stderr.contains(registry.as_str()),
        "the first resolution pulls from the registry {registry}:\n{stderr}"
    );
    assert!(stderr.contains("verified and cached"), "{stderr}");
    assert!(
        binary.starts_with(&cache),
        "{} is not in the cache {}",
        binary.display(),
        cache.display()
    );
    assert_eq!(
        sha256(&binary),
        sha256(&source(&["cluster-autoscaler", &version])),
        "the binary is the one the image carries for this platform, not the other platform's file"
    );
    let help = Command::new(&binary)
        .arg("--help")
        .output()
        .expect("run the pulled binary");
    let text = String::from_utf8_lossy(&help.stdout) + String::from_utf8_lossy(&help.stderr);
    assert!(
        text.contains("--cloud-provider"),
        "{} --help:\n{text}",
        binary.display()
    );

    // Cached: the same path again, without the registry.
    let offline = public_env("ca", &[("CAPI_UPSTREAM_REGISTRY", NO_REGISTRY)]);
    let (again, stderr) = resolved(&offline, &["cluster-autoscaler", &version]);
    assert_eq!(again, binary);
    assert!(
        !stderr.contains("pulling"),
        "a cached binary is not pulled again:\n{stderr}"
    );

    // CA with the in-tree clusterapi provider: the official binary has every provider built in.
    let (in_tree, _) = resolved(&offline, &["cluster-autoscaler-clusterapi"]);
    assert_eq!(in_tree, binary);
}

#[test]
fn the_chart_is_pulled_from_the_chart_repository_verified_cached_and_renders() {
    let env = public_env("chart", &[]);
    let cache = PathBuf::from(&env["CAPI_ARTIFACT_CACHE"]);
    let repository = &env["CAPI_UPSTREAM_CHART_REPO"];

    let (chart, stderr) = resolved(&env, &["cluster-autoscaler-chart"]);
    assert!(
        stderr.contains(&format!("helm pull from {repository}"))
            && stderr.contains("verified and cached"),
        "the first resolution pulls from the chart repository {repository}:\n{stderr}"
    );
    assert!(
        chart.starts_with(&cache),
        "{} is not in the cache {}",
        chart.display(),
        cache.display()
    );
    let meta =
        std::fs::read_to_string(chart.join("Chart.yaml")).expect("Chart.yaml of the pulled chart");
    assert!(
        meta.lines().any(|l| l == "name: cluster-autoscaler")
            && meta
                .lines()
                .any(|l| l == format!("version: {}", render::chart_version())),
        "{meta}"
    );
    let chart_arg = chart.display().to_string();
    let rendered = render::run(
        &render::helm(),
        &[
            "template",
            "t",
            &chart_arg,
            "--set",
            "autoDiscovery.clusterName=demo",
            "--set",
            "cloudProvider=clusterapi",
        ],
    );
    let objects = render::parse_stream(&rendered);
    assert!(
        objects.iter().any(|o| o["kind"] == "Deployment"),
        "helm template of the pulled chart renders a Deployment:\n{rendered}"
    );

    let offline = public_env(
        "chart",
        &[("CAPI_UPSTREAM_CHART_REPO", "http://127.0.0.1:1")],
    );
    let (again, stderr) = resolved(&offline, &["cluster-autoscaler-chart"]);
    assert_eq!(again, chart);
    assert!(
        !stderr.contains("helm pull"),
        "a cached chart is not pulled again:\n{stderr}"
    );
}

#[test]
fn an_image_other_than_the_pinned_digest_is_refused_and_nothing_is_cached() {
    // The digest of another image: the registry does not serve it under the pinned name.
    let wrong = "sha256:0000000000000000000000000000000000000000000000000000000000000001";
    let pins = pins_with("wrong-image", "cluster-autoscaler.versions", wrong);
    let env = public_env(
        "wrong-image",
        &[("CAPI_UPSTREAM_PINS", &pins.display().to_string())],
    );
    let stderr = refused(&env, &["cluster-autoscaler"]);
    let version = autoscaler::default_version();
    assert!(
        stderr.contains(&format!("cluster-autoscaler {version}"))
            && stderr.contains(wrong)
            && stderr.contains("refusing"),
        "the refusal names the release, the pinned digest and says so:\n{stderr}"
    );
    let cache = PathBuf::from(&env["CAPI_ARTIFACT_CACHE"]);
    assert_eq!(
        cached(&cache, "cluster-autoscaler"),
        Vec::<String>::new(),
        "nothing cached"
    );
    assert_eq!(
        cached(&cache, ".cluster-autoscaler"),
        Vec::<String>::new(),
        "no scratch left"
    );
}

#[test]
fn a_chart_package_other_than_the_pinned_sha256_is_refused_and_nothing_is_cached() {
    let wrong = "sha256:00000000000000000000000000000000000000000000000000000000000000ff";
    let pins = pins_with("wrong-chart", "cluster-autoscaler-chart.version", wrong);
    let env = public_env(
        "wrong-chart",
        &[("CAPI_UPSTREAM_PINS", &pins.display().to_string())],
    );
    let stderr = refused(&env, &["cluster-autoscaler-chart"]);
    let served = std::fs::read_to_string(
        PathBuf::from(&stand_ins().env["CAPI_UPSTREAM_PINS"])
            .join("cluster-autoscaler-chart.version"),
    )
    .expect("the stand-ins' chart pin");
    let actual = served
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_string();
    assert!(
        stderr.contains(&format!("has the digest {actual}"))
            && stderr.contains(&format!("pins {wrong}"))
            && stderr.contains("refusing"),
        "the refusal names the package's sha256 and the pinned one:\n{stderr}"
    );
    let cache = PathBuf::from(&env["CAPI_ARTIFACT_CACHE"]);
    assert_eq!(
        cached(&cache, "cluster-autoscaler-chart"),
        Vec::<String>::new(),
        "nothing cached"
    );
}

/// A stand-in for a local mirror of upstream artifacts: a folder whose `get` lists and prints as the mirror's
/// does, holding `name` as an executable.
fn mirror(dir_name: &str, name: &str) -> (PathBuf, PathBuf) {
    let dir = procs::work_dir().join(dir_name);
    std::fs::create_dir_all(&dir).expect("mirror folder");
    let artifact = dir.join(format!("{name}.bin"));
    std::fs::write(&artifact, "#!/bin/sh\nexit 0\n").expect("mirror artifact");
    let get = dir.join("get");
    std::fs::write(
        &get,
        format!(
            "#!/bin/sh\nif [ \"$1\" = --list ]; then echo {name}; exit 0; fi\n\
             [ \"$1\" = {name} ] && echo {} && exit 0\nexit 2\n",
            artifact.display()
        ),
    )
    .expect("mirror get");
    for path in [&artifact, &get] {
        let status = Command::new("chmod")
            .arg("0755")
            .arg(path)
            .status()
            .expect("chmod");
        assert!(status.success());
    }
    (dir, artifact)
}

fn env_of(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn a_path_from_the_environment_comes_before_the_mirror_and_the_public_source() {
    let version = autoscaler::default_version();
    let (dir, from_mirror) = mirror("mirror-env-first", &format!("cluster-autoscaler-{version}"));
    let (_, explicit) = mirror("explicit", "anything");
    let dir = dir.display().to_string();
    let explicit_arg = explicit.display().to_string();
    let env = env_of(&[
        ("CLUSTER_AUTOSCALER", &explicit_arg),
        ("CAPI_SHARED_UPSTREAM", &dir),
        ("CAPI_UPSTREAM_REGISTRY", NO_REGISTRY),
    ]);
    assert_eq!(resolved(&env, &["cluster-autoscaler"]).0, explicit);
    // Another pinned version has a variable of its own; CLUSTER_AUTOSCALER is the default version's only.
    let other = autoscaler::versions()[1].clone();
    let other_var = format!("CLUSTER_AUTOSCALER_{}", other.replace('.', "_"));
    let env = env_of(&[
        (other_var.as_str(), &explicit_arg),
        ("CAPI_SHARED_UPSTREAM", &dir),
        ("CAPI_UPSTREAM_REGISTRY", NO_REGISTRY),
    ]);
    assert_eq!(resolved(&env, &["cluster-autoscaler", &other]).0, explicit);
    assert_eq!(resolved(&env, &["cluster-autoscaler"]).0, from_mirror);

    let env = env_of(&[
        ("CAPI_SHARED_UPSTREAM", &dir),
        ("CAPI_UPSTREAM_REGISTRY", NO_REGISTRY),
    ]);
    assert_eq!(
        resolved(&env, &["cluster-autoscaler"]).0,
        from_mirror,
        "the mirror comes before the public source"
    );
}

/// A resolver run that must fail: its environment, its arguments and phrases its error must contain.
struct Mistake<'a> {
    env: Vec<(&'a str, &'a str)>,
    args: Vec<&'a str>,
    says: Vec<&'a str>,
}

#[test]
fn what_a_user_can_get_wrong_is_named_in_the_error() {
    let empty = procs::work_dir().join("empty-mirror");
    std::fs::create_dir_all(&empty).expect("empty mirror");
    let empty = empty.display().to_string();
    let not_a_folder = procs::work_dir()
        .join("no-such-mirror")
        .display()
        .to_string();
    let not_executable = repo("Cargo.toml").display().to_string();
    let not_a_chart = procs::work_dir().display().to_string();
    let cases = [
        Mistake {
            env: vec![("CLUSTER_AUTOSCALER", &not_executable)],
            args: vec!["cluster-autoscaler"],
            says: vec!["CLUSTER_AUTOSCALER=", "is not an executable file"],
        },
        Mistake {
            env: vec![("CAPI_GRPC_SERVER", &not_executable)],
            args: vec!["capi-grpc-server"],
            says: vec!["CAPI_GRPC_SERVER=", "is not an executable file"],
        },
        Mistake {
            env: vec![("CLUSTER_AUTOSCALER_CHART", &not_a_chart)],
            args: vec!["cluster-autoscaler-chart"],
            says: vec!["CLUSTER_AUTOSCALER_CHART=", "is not a chart folder"],
        },
        Mistake {
            env: vec![("CAPI_SHARED_UPSTREAM", &not_a_folder)],
            args: vec!["cluster-autoscaler"],
            says: vec![
                "CAPI_SHARED_UPSTREAM=",
                "is not a folder",
                "a local mirror of upstream artifacts",
            ],
        },
        Mistake {
            env: vec![("CAPI_SHARED_UPSTREAM", &empty)],
            args: vec!["cluster-autoscaler", "1.2.3"],
            says: vec![
                "version 1.2.3 is not pinned in",
                "cluster-autoscaler.versions",
            ],
        },
        Mistake {
            env: vec![],
            args: vec!["kube-apiserver"],
            says: vec![
                "unknown artifact 'kube-apiserver'",
                "artifact.sh cluster-autoscaler",
            ],
        },
    ];
    for Mistake { env, args, says } in cases {
        let stderr = refused(&env_of(&env), &args);
        for phrase in says {
            assert!(
                stderr.contains(phrase),
                "artifact.sh {args:?} with {env:?}: {phrase:?} not in:\n{stderr}"
            );
        }
    }
}
