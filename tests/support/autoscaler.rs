//! The real cluster-autoscaler (CA) and the real kube-scheduler, run against the test control plane.
//!
//! CA binaries of the pinned versions (`tests/upstream/cluster-autoscaler.versions`) are resolved by
//! `tests/upstream/artifact.sh` ([`super::artifacts`]): `CLUSTER_AUTOSCALER`, else a local mirror of upstream
//! artifacts, else the official image pulled by its pinned digest. kube-scheduler is built with kube-apiserver
//! by `tests/upstream/build.sh` and started once per control plane, on first use, so that pods land on
//! the Nodes CA makes a group grow to: CA's scale-up is judged against a real scheduling decision.
//!
//! Each CA runs with short timings ([`Autoscaler::new`]), leader election off (unless
//! [`Autoscaler::leader_elect`]), its status ConfigMap in
//! the scenario's own namespace and its metrics and `/health-check` on a free loopback port.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::{Api, Client};

use super::control_plane::{ControlPlane, spawn_scheduler};
use super::procs::{self, Check, poll_until};

/// Name of the status ConfigMap every CA here writes (in its scenario's namespace).
pub const STATUS_CONFIGMAP: &str = "cluster-autoscaler-status";

/// The pinned CA versions, the default first (each line of the pin file: the version, then its image digest).
pub fn versions() -> Vec<String> {
    include_str!("../upstream/cluster-autoscaler.versions")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// The default CA version (the first pinned one).
pub fn default_version() -> String {
    versions()
        .into_iter()
        .next()
        .expect("tests/upstream/cluster-autoscaler.versions names at least one version")
}

/// The CA binary of `version` (`flavor` "externalgrpc", or "clusterapi" for CA with the in-tree provider),
/// resolved by `tests/upstream/artifact.sh`. Panics with its explanation otherwise.
pub fn binary(version: &str, flavor: &str) -> PathBuf {
    let artifact = match flavor {
        "externalgrpc" => "cluster-autoscaler",
        "clusterapi" => "cluster-autoscaler-clusterapi",
        other => panic!("no cluster-autoscaler flavor {other:?}: externalgrpc or clusterapi"),
    };
    super::artifacts::resolved(&[artifact, version])
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts the control plane's kube-scheduler unless it runs already (once per control plane).
pub fn ensure_scheduler(cp: &ControlPlane) {
    static STARTED: std::sync::Mutex<Vec<(String, Result<(), String>)>> =
        std::sync::Mutex::new(Vec::new());
    let mut started = lock(&STARTED);
    if !started.iter().any(|(server, _)| *server == cp.server) {
        let result = spawn_scheduler(
            &cp.bin,
            &cp.dir.join("kube-scheduler.log"),
            cp.admin_kubeconfig(),
        );
        started.push((cp.server.clone(), result));
    }
    if let Some((_, Err(e))) = started.iter().find(|(server, _)| *server == cp.server) {
        panic!("{e}");
    }
}

/// How a CA process is started.
#[derive(Clone, Debug)]
pub struct Autoscaler {
    pub version: String,
    /// The namespace of the scenario: CA's `--namespace` (status ConfigMap, Events about it).
    pub ns: String,
    /// `127.0.0.1:<port>` of the provider's gRPC listener.
    pub provider: String,
    /// `cert`, `key`, `cacert` of the cloud-config (mTLS), when set.
    pub tls: Option<(PathBuf, PathBuf, PathBuf)>,
    /// Flags as `--name=value`; later ones replace earlier ones of the same name.
    pub flags: Vec<String>,
    /// The hostname CA runs with, when set (see [`Autoscaler::leader_elect`]).
    pub hostname: Option<String>,
}

impl Autoscaler {
    /// The default version with test timings: a 2 s loop, nodes unneeded for 5 s are removed, no
    /// cool-down after a scale-up or a deletion, 60 s to provision a node.
    pub fn new(ns: &str, provider: &str) -> Autoscaler {
        Autoscaler {
            version: default_version(),
            ns: ns.to_string(),
            provider: provider.to_string(),
            tls: None,
            hostname: None,
            flags: [
                "--scan-interval=2s",
                "--scale-down-delay-after-add=0s",
                "--scale-down-delay-after-delete=0s",
                "--scale-down-delay-after-failure=3s",
                "--scale-down-unneeded-time=5s",
                "--scale-down-unready-time=30s",
                "--unremovable-node-recheck-timeout=5s",
                "--node-delete-delay-after-taint=0s",
                "--max-node-provision-time=60s",
                "--initial-node-group-backoff-duration=20s",
                "--new-pod-scale-up-delay=0s",
                "--skip-nodes-with-system-pods=false",
                "--skip-nodes-with-local-storage=false",
                "--max-graceful-termination-sec=5",
                "--expander=least-waste",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        }
    }

    pub fn version(mut self, version: &str) -> Self {
        self.version = version.to_string();
        self
    }

    /// Sets `--name=value`, replacing an earlier value of the same flag.
    pub fn flag(mut self, flag: &str) -> Self {
        let name = flag.split('=').next().unwrap_or(flag).to_string();
        self.flags
            .retain(|f| f.split('=').next().unwrap_or(f) != name);
        self.flags.push(flag.to_string());
        self
    }

    /// Leader election on, the Lease `lease` in the scenario's namespace, with timings short enough
    /// for a standby to take over within seconds of the leader's death: a Lease unrenewed for 6 s is
    /// taken, the leader renews every second and gives up leading after 4 s without a renewal.
    ///
    /// CA's identity in the Lease is its hostname, which in a cluster is its pod's name: two CAs with
    /// one hostname both take the Lease as theirs and both lead. So CA runs as `pod`, with that
    /// hostname in a UTS namespace of its own (as a container runtime gives each pod), which needs
    /// root.
    pub fn leader_elect(mut self, lease: &str, pod: &str) -> Self {
        let ns = self.ns.clone();
        self.hostname = Some(pod.to_string());
        self.flag("--leader-elect=true")
            .flag(&format!("--leader-elect-resource-namespace={ns}"))
            .flag(&format!("--leader-elect-resource-name={lease}"))
            .flag("--leader-elect-lease-duration=6s")
            .flag("--leader-elect-renew-deadline=4s")
            .flag("--leader-elect-retry-period=1s")
    }

    pub fn tls(mut self, cert: &Path, key: &Path, ca: &Path) -> Self {
        self.tls = Some((cert.into(), key.into(), ca.into()));
        self
    }

    /// Writes the cloud-config and starts CA against the control plane (its admin kubeconfig for
    /// Nodes and Pods); waits until CA serves its metrics endpoint. The kube-scheduler is started
    /// first if it is not running.
    pub async fn start(&self, cp: &ControlPlane) -> AutoscalerProcess {
        ensure_scheduler(cp);
        static COUNT: AtomicU32 = AtomicU32::new(0);
        let n = COUNT.fetch_add(1, Ordering::SeqCst);
        let dir = procs::work_dir();
        let log = dir.join(format!("cluster-autoscaler-{}-{n}.log", self.ns));
        let cloud_config = dir.join(format!("cloud-config-{}-{n}.yaml", self.ns));
        let mut text = format!("address: \"{}\"\ngrpc_timeout: \"10s\"\n", self.provider);
        if let Some((cert, key, ca)) = &self.tls {
            text.push_str(&format!(
                "cert: \"{}\"\nkey: \"{}\"\ncacert: \"{}\"\n",
                cert.display(),
                key.display(),
                ca.display()
            ));
        }
        std::fs::write(&cloud_config, text)
            .unwrap_or_else(|e| panic!("write {}: {e}", cloud_config.display()));
        let binary = binary(&self.version, "externalgrpc");
        let mut attempt = 0;
        loop {
            attempt += 1;
            let address = format!("127.0.0.1:{}", procs::free_port());
            let mut args: Vec<String> = vec![
                format!("--kubeconfig={}", cp.admin_kubeconfig().display()),
                "--cloud-provider=externalgrpc".into(),
                format!("--cloud-config={}", cloud_config.display()),
                format!("--namespace={}", self.ns),
                "--write-status-configmap=true".into(),
                format!("--status-config-map-name={STATUS_CONFIGMAP}"),
                format!("--address={address}"),
                "--logtostderr=true".into(),
                "--v=4".into(),
            ];
            if !self.flags.iter().any(|f| f.starts_with("--leader-elect=")) {
                args.push("--leader-elect=false".into());
            }
            args.extend(self.flags.iter().cloned());
            let started = Instant::now();
            let spawned = match &self.hostname {
                Some(hostname) => procs::spawn_logged_on_host(hostname, &binary, &args, &log),
                None => procs::spawn_logged(&binary, &args, &log),
            };
            let mut child = spawned.unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
            match wait_metrics(&mut child, &address).await {
                Ok(()) => {
                    eprintln!(
                        "e2e: cluster-autoscaler {} for {} up after {:.1}s (log {})",
                        self.version,
                        self.ns,
                        started.elapsed().as_secs_f64(),
                        log.display()
                    );
                    return AutoscalerProcess {
                        child,
                        version: self.version.clone(),
                        ns: self.ns.clone(),
                        address,
                        log,
                        started,
                    };
                }
                Err(e) => {
                    procs::kill_and_reap(&mut child);
                    let tail = procs::log_tail(&log, 8000);
                    if attempt < 3 && tail.contains("address already in use") {
                        continue;
                    }
                    panic!(
                        "cluster-autoscaler {} did not start: {e}\n--- log {} ---\n{tail}",
                        self.version,
                        log.display()
                    );
                }
            }
        }
    }
}

/// A running CA; killed (SIGKILL) and reaped on drop.
pub struct AutoscalerProcess {
    child: Child,
    pub version: String,
    pub ns: String,
    /// `127.0.0.1:<port>`: metrics and `/health-check`.
    pub address: String,
    pub log: PathBuf,
    pub started: Instant,
}

impl Drop for AutoscalerProcess {
    fn drop(&mut self) {
        procs::kill_and_reap(&mut self.child);
    }
}

impl AutoscalerProcess {
    /// Kills CA (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        procs::kill_and_reap(&mut self.child);
    }

    /// The log so far.
    pub fn log_contents(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The tail of the log, for failure messages.
    pub fn log_tail(&self) -> String {
        procs::log_tail(&self.log, 12_000)
    }

    /// The `status` text of CA's status ConfigMap, when written.
    pub async fn status(&self, client: &Client) -> Option<String> {
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), &self.ns);
        let cm = api.get_opt(STATUS_CONFIGMAP).await.ok()??;
        cm.data?.get("status").cloned()
    }

    /// CA's Prometheus metrics text.
    pub async fn metrics(&self) -> Result<String, String> {
        http_get(&self.address, "/metrics").await
    }

    /// The sum of the samples of metric `name` whose labels contain every `label="value"` of
    /// `labels` (0 when there is none).
    pub async fn metric_sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let text = self.metrics().await.unwrap_or_default();
        metric_sum(&text, name, labels)
    }

    /// Fails when CA has exited.
    pub fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Err(format!(
                "cluster-autoscaler exited with {status}\n--- log ---\n{}",
                self.log_tail()
            )),
            Ok(None) => Ok(()),
            Err(e) => Err(format!("wait for cluster-autoscaler: {e}")),
        }
    }

    /// Waits until CA has finished `n` more main loops (from `cluster_autoscaler_last_activity`
    /// `{activity="main"}` moving `n` times), at most `timeout`.
    pub async fn wait_loops(&mut self, n: u32, timeout: Duration) {
        let mut last = self.last_main_activity().await;
        let mut seen = 0;
        let deadline = Instant::now() + timeout;
        while seen < n {
            if let Err(e) = self.check_alive() {
                panic!("{e}");
            }
            assert!(
                Instant::now() < deadline,
                "cluster-autoscaler in {}: {seen} of {n} loops after {timeout:?}\n{}",
                self.ns,
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = self.last_main_activity().await;
            if now > last {
                seen += 1;
                last = now;
            }
        }
    }

    async fn last_main_activity(&self) -> f64 {
        self.metric_sum("cluster_autoscaler_last_activity", &[("activity", "main")])
            .await
    }
}

/// Sums the samples of `name` with all of `labels` in a Prometheus text exposition.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, rest) = match series.find('{') {
                Some(i) => (&series[..i], &series[i..]),
                None => (series, ""),
            };
            if metric != name {
                return None;
            }
            if !labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            {
                return None;
            }
            value.parse::<f64>().ok()
        })
        .sum()
}

async fn wait_metrics(child: &mut Child, address: &str) -> Result<(), String> {
    poll_until(
        &format!("cluster-autoscaler metrics at {address}"),
        Duration::from_secs(60),
        Duration::from_millis(100),
        || {
            let gone = procs::gone(child);
            async move {
                if let Some(gone) = gone {
                    return Check::Fatal(gone);
                }
                match http_get(address, "/metrics").await {
                    Ok(_) => Check::Done(()),
                    Err(e) => Check::Wait(e),
                }
            }
        },
    )
    .await
}

/// The body of `GET path` on `address` when the status is 200.
pub async fn http_get(address: &str, path: &str) -> Result<String, String> {
    match procs::http_get(address, path).await? {
        (200, body) => Ok(body),
        (code, _) => Err(format!("GET {address}{path}: HTTP {code}")),
    }
}
