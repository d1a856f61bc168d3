//! The real Cluster API core manager (`sigs.k8s.io/cluster-api/core` v1.14.2 pinned in
//! tests/upstream/capi, or another release pinned in a subdirectory there: [`capi_manager_of`])
//! on a control plane of its own kind ([`Setup::real_capi`]), wired as `clusterctl init` wires it into
//! a management cluster, except that every webhook is reached by URL on 127.0.0.1 instead of through
//! a Service:
//!
//! - all 13 core CRDs of the module, each with the conversion webhook (strategy `Webhook`,
//!   `https://127.0.0.1:<port>/convert`, the serving CA as `caBundle`), so v1beta1 ↔ v1beta2 is
//!   CAPI's own conversion;
//! - the module's Mutating- and ValidatingWebhookConfigurations (core/config/webhook/manifests.yaml,
//!   config/webhook/ before v1.14:
//!   names, rules and paths as shipped, `capi-` prefix as clusterctl's kustomization gives them), so
//!   defaulting and validation are CAPI's own;
//! - the manager process (`--leader-elect=false`, MachinePool on, ClusterTopology off), up when its
//!   `/readyz` (the webhook server's TLS check) answers ok.
//!
//! One manager per test binary (plus one per further release asked for, each on its own control
//! plane), started on first use with the control plane and stopped when the binary ends; a fault test may kill it (SIGKILL) and restart it. Infrastructure and control plane
//! objects are the stand-in's (`standin`).
//!
//! The manager's webhook server listens on every interface (the module has no flag for its host);
//! the apiserver reaches it on 127.0.0.1 only.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::{Value, json};

use super::control_plane::{ControlPlane, Setup, control_plane, named_control_plane};
use super::crds;
use super::pki::{self, Ca};
use super::procs::{self, Check, poll_until};

const FIELD_MANAGER: &str = "capi-e2e";
/// The prefix clusterctl's kustomization (core/config/default) gives the core provider's objects.
const NAME_PREFIX: &str = "capi-";

/// How long the manager took to come up, phase by phase.
#[derive(Clone, Debug)]
pub struct ManagerTimings {
    /// tests/upstream/capi/build.sh in this run: a build when the cache was cold, else a lookup.
    pub lookup: Duration,
    /// The cold build of the manager as the cache recorded it (whichever run built it).
    pub cold_build: Option<Duration>,
    /// The 13 CRDs (with the conversion webhook) and the stand-in's CRDs applied and serving.
    pub crds: Duration,
    /// The webhook configurations registered.
    pub webhooks: Duration,
    /// Process start until `/readyz` answers ok.
    pub start_to_healthy: Duration,
}

/// The running manager of this test binary.
pub struct CapiManager {
    pub cp: &'static ControlPlane,
    /// The Cluster API version built (`v1.14.2`, `v1.13.6`).
    pub version: String,
    /// The cache directory of tests/upstream/capi/build.sh (bin/, crds/, webhook/).
    pub cache: PathBuf,
    pub log: PathBuf,
    /// `127.0.0.1:<port>` of `/healthz` and `/readyz`.
    pub health_address: String,
    /// `127.0.0.1:<port>` of `/metrics` (plain HTTP: `--insecure-diagnostics`).
    pub diagnostics_address: String,
    /// `https://127.0.0.1:<port>`: the base of every webhook URL.
    pub webhook_base: String,
    pub timings: ManagerTimings,
    args: Vec<String>,
    /// The running process; `None` after [`CapiManager::kill`] until [`CapiManager::restart`].
    /// Not in the exit registry: it dies with the test binary like every child (`PDEATHSIG`).
    process: Mutex<Option<Child>>,
}

static MANAGER: OnceLock<Result<CapiManager, String>> = OnceLock::new();

/// The real CAPI manager of this test binary (and its control plane), started on first use. Blocks
/// while starting; other tests wait for the same start.
pub fn capi_manager() -> &'static CapiManager {
    let started =
        MANAGER.get_or_init(|| start_on_thread(control_plane(Setup::real_capi()), None, None));
    started_or_panic(started)
}

/// The Cluster API releases pinned in tests/upstream/capi: `None` for its go.mod (the default, the
/// release [`capi_manager`] runs), then each subdirectory with a go.mod of its own (`Some("v1.13")`),
/// by name. Which version each pins is read from the build (`CapiManager::version`), not here.
pub fn pinned_releases() -> Vec<Option<String>> {
    std::iter::once(None)
        .chain(
            procs::pinned_subdirectories("tests/upstream/capi")
                .into_iter()
                .map(Some),
        )
        .collect()
}

/// The real CAPI manager of pinned release `pin` (see [`pinned_releases`]), started on first use:
/// for the default release the one of [`capi_manager`]; for another a manager on a control plane of
/// its own (`named_control_plane("capi-<pin>")`: two releases' CRDs cannot share one), wired the
/// same way (its own CRDs, webhooks and conversion).
pub fn capi_manager_of(pin: Option<&str>) -> &'static CapiManager {
    let Some(pin) = pin else {
        return capi_manager();
    };
    type Started = &'static Result<CapiManager, String>;
    static OTHERS: Mutex<Vec<(String, Started)>> = Mutex::new(Vec::new());
    // Held while starting: a second caller for the same release waits for the same start.
    let mut others = OTHERS.lock().unwrap_or_else(|e| e.into_inner());
    let started = match others.iter().find(|(p, _)| p == pin) {
        Some((_, started)) => *started,
        None => {
            let cp = named_control_plane(&format!("capi-{pin}"), Setup::real_capi());
            let started: Started = Box::leak(Box::new(start_on_thread(cp, Some(pin), None)));
            others.push((pin.to_string(), started));
            started
        }
    };
    drop(others);
    started_or_panic(started)
}

/// A real CAPI manager of the default release on a control plane of its own named `name`
/// (`named_control_plane(name, setup)`, files in the work directory's `capi-manager-<name>`),
/// started on first use: for scenarios that run what must not reach the shared control plane's
/// other scenarios (a kube-controller-manager, tests/support/controller_manager.rs), or on another
/// Kubernetes release ([`Setup::on_kubernetes`]).
pub fn capi_manager_apart(name: &str, setup: Setup) -> &'static CapiManager {
    type Started = &'static Result<CapiManager, String>;
    static APART: Mutex<Vec<(String, Started)>> = Mutex::new(Vec::new());
    // Held while starting: a second caller for the same name waits for the same start.
    let mut apart = APART.lock().unwrap_or_else(|e| e.into_inner());
    let started = match apart.iter().find(|(n, _)| n == name) {
        Some((_, started)) => *started,
        None => {
            let cp = named_control_plane(name, setup);
            let started: Started = Box::leak(Box::new(start_on_thread(cp, None, Some(name))));
            apart.push((name.to_string(), started));
            started
        }
    };
    drop(apart);
    started_or_panic(started)
}

/// Starts the manager of `pin` on a thread of its own with its own runtime (the caller may be inside
/// a runtime, and nothing runtime-bound may outlive the start); `apart` names its work directory
/// when it is not the only manager of its release.
fn start_on_thread(
    cp: &'static ControlPlane,
    pin: Option<&str>,
    apart: Option<&str>,
) -> Result<CapiManager, String> {
    let pin = pin.map(String::from);
    let apart = apart.map(String::from);
    std::thread::Builder::new()
        .name("e2e-capi-manager".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("build a tokio runtime: {e}"))?;
            runtime.block_on(start(cp, pin.as_deref(), apart.as_deref()))
        })
        .map_err(|e| format!("spawn the CAPI manager thread: {e}"))
        .and_then(|t| {
            t.join()
                .unwrap_or_else(|_| Err("the CAPI manager start panicked".into()))
        })
        .inspect_err(|_| procs::mark_failed())
}

fn started_or_panic(started: &'static Result<CapiManager, String>) -> &'static CapiManager {
    match started {
        Ok(manager) => manager,
        Err(e) => panic!("the real Cluster API manager did not start:\n{e}"),
    }
}

impl CapiManager {
    /// The last lines of the manager's log, for failure messages.
    pub fn log_tail(&self) -> String {
        procs::log_tail(&self.log, 6000)
    }

    /// The PID of the running manager, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process().as_ref().map(Child::id)
    }

    /// SIGKILLs the manager and reaps it: its controllers stop and its webhooks (defaulting,
    /// validation, conversion) stop answering, as when its pod dies.
    pub fn kill(&self) {
        if let Some(mut child) = self.process().take() {
            procs::kill_and_reap(&mut child);
        }
    }

    /// Starts the manager again with the same flags, ports and certificate (its log appended);
    /// returns the time from its start until `/readyz` answered ok.
    pub async fn restart(&self) -> Result<Duration, String> {
        self.kill();
        let (child, took) = spawn_healthy(
            &self.cache.join(MANAGER_BIN),
            &self.args,
            &self.log,
            &self.health_address,
        )
        .await?;
        *self.process() = Some(child);
        Ok(took)
    }

    fn process(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.process.lock().unwrap_or_else(|e| e.into_inner())
    }
}

const MANAGER_BIN: &str = "bin/capi-manager";

/// Spawns the manager and waits until its `/readyz` answers ok; returns it and how long that took.
async fn spawn_healthy(
    binary: &Path,
    args: &[String],
    log: &Path,
    health_address: &str,
) -> Result<(Child, Duration), String> {
    let started = Instant::now();
    let mut attempt = 1;
    loop {
        let mut child = procs::spawn_logged(binary, args, log)
            .map_err(|e| format!("start the CAPI manager: {e}"))?;
        let ready = poll_until(
            "CAPI manager /readyz",
            Duration::from_secs(60),
            Duration::from_millis(100),
            || {
                let gone = procs::gone(&mut child);
                async move {
                    if let Some(gone) = gone {
                        return Check::Fatal(gone);
                    }
                    match procs::http_get(health_address, "/readyz").await {
                        Ok((200, _)) => Check::Done(()),
                        Ok((code, body)) => Check::Wait(format!("{code}: {body}")),
                        Err(e) => Check::Wait(e),
                    }
                }
            },
        )
        .await;
        let Err(e) = ready else {
            return Ok((child, started.elapsed()));
        };
        // On a loaded machine the manager may give up waiting for its informers to sync and exit
        // (CI saw it once): that is the environment, not the scenario, so it starts once more.
        let exited = procs::gone(&mut child).is_some();
        procs::kill_and_reap(&mut child);
        let failure = format!(
            "{e}\n--- CAPI manager log {} (tail) ---\n{}",
            log.display(),
            procs::log_tail(log, 6000)
        );
        if !exited || attempt == 2 {
            return Err(failure);
        }
        let kept = log.with_extension("first-attempt.log");
        let _ = std::fs::copy(log, &kept);
        procs::announce(&format!(
            "e2e: CAPI manager exited before it was ready, starting it once more (log of the first \
             attempt: {})",
            kept.display()
        ));
        attempt += 1;
    }
}

/// Runs tests/upstream/capi/build.sh (builds on first use, else answers at once) and returns its
/// cache dir.
pub fn capi_dir() -> Result<PathBuf, String> {
    capi_dir_of(None)
}

/// [`capi_dir`] of pinned release `pin` (see [`pinned_releases`]).
pub fn capi_dir_of(pin: Option<&str>) -> Result<PathBuf, String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/upstream/capi/build.sh");
    let args: Vec<&str> = pin.into_iter().collect();
    procs::finished_cache_dir(&script, &args, true)
}

async fn start(
    cp: &'static ControlPlane,
    pin: Option<&str>,
    apart: Option<&str>,
) -> Result<CapiManager, String> {
    let t_lookup = Instant::now();
    let cache = capi_dir_of(pin)?;
    let lookup = t_lookup.elapsed();
    let read = |name: &str| {
        std::fs::read_to_string(cache.join(name))
            .map(|s| s.trim().to_string())
            .map_err(|e| format!("read {}/{name}: {e}", cache.display()))
    };
    let version = read("version")?;
    let cold_build = read("build-seconds")
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs);

    let dir = procs::work_dir().join(match (pin, apart) {
        (_, Some(name)) => format!("capi-manager-{name}"),
        (None, None) => "capi-manager".to_string(),
        (Some(pin), None) => format!("capi-manager-{pin}"),
    });
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let cert_dir = dir.join("serving-certs");
    std::fs::create_dir_all(&cert_dir)
        .map_err(|e| format!("create {}: {e}", cert_dir.display()))?;
    let webhook_ca = Ca::generate();
    let serving = webhook_ca.serving_cert("capi-webhook-service");
    pki::write_private(&cert_dir, "tls.crt", &serving.cert);
    pki::write_private(&cert_dir, "tls.key", &serving.key);
    let ca_bundle = STANDARD.encode(&webhook_ca.cert_pem);
    let webhook_port = procs::free_port();
    let webhook_base = format!("https://127.0.0.1:{webhook_port}");

    let client = cp.admin_client().await;
    let t_crds = Instant::now();
    let mut files = Vec::new();
    for file in yaml_files(&cache.join("crds"))? {
        let mut docs = crds::read(&file)?;
        for doc in &mut docs {
            with_conversion_webhook(doc, &format!("{webhook_base}/convert"), &ca_bundle);
        }
        let name = file
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| format!("a CRD file without a name: {}", file.display()))?;
        let text = docs
            .iter()
            .map(|d| serde_json::to_string(d).map_err(|e| format!("encode {name}: {e}")))
            .collect::<Result<Vec<_>, _>>()?
            .join("\n---\n");
        files.push(pki::write_private(&dir, name, &text));
    }
    let crd_count = files.len();
    if crd_count != 13 {
        return Err(format!(
            "{} holds {crd_count} CRDs; the core manager needs all 13",
            cache.join("crds").display()
        ));
    }
    files.push(super::standin::crd_file());
    crds::install(&client, &files).await?;
    let crds_took = t_crds.elapsed();

    let t_webhooks = Instant::now();
    register_webhooks(&client, &cache, &webhook_base, &ca_bundle).await?;
    let webhooks_took = t_webhooks.elapsed();

    let health_address = format!("127.0.0.1:{}", procs::free_port());
    let diagnostics_address = format!("127.0.0.1:{}", procs::free_port());
    let args: Vec<String> = vec![
        format!("--kubeconfig={}", cp.admin_kubeconfig().display()),
        "--leader-elect=false".into(),
        format!("--webhook-port={webhook_port}"),
        format!("--webhook-cert-dir={}", cert_dir.display()),
        format!("--health-addr={health_address}"),
        format!("--diagnostics-address={diagnostics_address}"),
        "--insecure-diagnostics=true".into(),
        "--feature-gates=MachinePool=true,ClusterTopology=false".into(),
    ];
    let log = dir.join("capi-manager.log");
    let (child, start_to_healthy) =
        spawn_healthy(&cache.join(MANAGER_BIN), &args, &log, &health_address).await?;
    let pid = child.id();
    let timings = ManagerTimings {
        lookup,
        cold_build,
        crds: crds_took,
        webhooks: webhooks_took,
        start_to_healthy,
    };
    procs::announce(&format!(
        "e2e: CAPI manager {version} healthy {:.1}s after its start (pid {pid}); build.sh {:.1}s \
         (cold build recorded: {}), {crd_count} CRDs with conversion webhook + stand-in CRDs {:.1}s, \
         webhook configurations {:.2}s; log {}",
        start_to_healthy.as_secs_f64(),
        lookup.as_secs_f64(),
        cold_build.map_or("unknown".into(), |d| format!("{}s", d.as_secs())),
        crds_took.as_secs_f64(),
        webhooks_took.as_secs_f64(),
        log.display(),
    ));
    Ok(CapiManager {
        cp,
        version,
        cache,
        log,
        health_address,
        diagnostics_address,
        webhook_base,
        timings,
        args,
        process: Mutex::new(Some(child)),
    })
}

fn yaml_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("read {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    Ok(files)
}

/// Sets the CRD's conversion to CAPI's webhook at `url`, as clusterctl's kustomization patches
/// (core/config/crd/patches/webhook_in_*.yaml) and cert-manager's CA injection make it.
pub fn with_conversion_webhook(crd: &mut Value, url: &str, ca_bundle: &str) {
    crd["spec"]["conversion"] = json!({
        "strategy": "Webhook",
        "webhook": {
            "conversionReviewVersions": ["v1"],
            "clientConfig": {"url": url, "caBundle": ca_bundle},
        },
    });
}

/// A webhook configuration of the module with every webhook's Service client config replaced by
/// the URL `<base><service path>` and `ca_bundle`, and the `capi-` name prefix.
pub fn with_url_client_configs(
    mut config: Value,
    base: &str,
    ca_bundle: &str,
) -> Result<Value, String> {
    let name = config["metadata"]["name"]
        .as_str()
        .ok_or("a webhook configuration without metadata.name")?
        .to_string();
    config["metadata"] = json!({"name": format!("{NAME_PREFIX}{name}")});
    let webhooks = config["webhooks"]
        .as_array_mut()
        .ok_or_else(|| format!("webhook configuration {name} without webhooks"))?;
    for webhook in webhooks {
        let path = webhook["clientConfig"]["service"]["path"]
            .as_str()
            .ok_or_else(|| {
                format!(
                    "webhook {} of {name}: no clientConfig.service.path",
                    webhook["name"]
                )
            })?
            .to_string();
        webhook["clientConfig"] = json!({"url": format!("{base}{path}"), "caBundle": ca_bundle});
    }
    Ok(config)
}

/// Registers the module's Mutating- and ValidatingWebhookConfigurations (server-side apply).
async fn register_webhooks(
    client: &Client,
    cache: &Path,
    base: &str,
    ca_bundle: &str,
) -> Result<(), String> {
    let file = cache.join("webhook/manifests.yaml");
    let mut kinds = Vec::new();
    for doc in crds::read(&file)? {
        let kind = doc["kind"].as_str().unwrap_or_default().to_string();
        let config = with_url_client_configs(doc, base, ca_bundle)?;
        let name = config["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let params = PatchParams::apply(FIELD_MANAGER).force();
        match kind.as_str() {
            "MutatingWebhookConfiguration" => {
                let typed: MutatingWebhookConfiguration = serde_json::from_value(config)
                    .map_err(|e| format!("{}: {kind} {name}: {e}", file.display()))?;
                Api::<MutatingWebhookConfiguration>::all(client.clone())
                    .patch(&name, &params, &Patch::Apply(&typed))
                    .await
                    .map_err(|e| format!("apply {kind} {name}: {e}"))?;
            }
            "ValidatingWebhookConfiguration" => {
                let typed: ValidatingWebhookConfiguration = serde_json::from_value(config)
                    .map_err(|e| format!("{}: {kind} {name}: {e}", file.display()))?;
                Api::<ValidatingWebhookConfiguration>::all(client.clone())
                    .patch(&name, &params, &Patch::Apply(&typed))
                    .await
                    .map_err(|e| format!("apply {kind} {name}: {e}"))?;
            }
            other => return Err(format!("{}: unexpected kind {other:?}", file.display())),
        }
        kinds.push(kind);
    }
    if kinds.len() != 2 {
        return Err(format!(
            "{}: expected one mutating and one validating configuration, found {kinds:?}",
            file.display()
        ));
    }
    Ok(())
}
