//! A kubelet for tests: runs every container of a pod spec (as stored by the apiserver, defaults applied)
//! as a local process, the way the kubelet and a container runtime would, so that a manifest that would not
//! work in a cluster does not work here either.
//!
//! What is real:
//! - **Image → program**: each image is mapped to the local binary of that image (the provider cargo built,
//!   the pinned cluster-autoscaler release) placed at the path it has in the image, with the image's
//!   ENTRYPOINT/CMD/WORKDIR/USER (the provider's from the Dockerfile, cluster-autoscaler's from its
//!   distroless image: `/cluster-autoscaler`, WORKDIR `/`, user 65532). `command`/`args` compose with them as
//!   in Kubernetes (`command` replaces ENTRYPOINT and drops CMD; `args` replace CMD), `$(VAR)` expanded.
//! - **Filesystem**: each container gets its own root (a private mount namespace and `chroot`) holding the
//!   program, `/etc/hosts`, `/etc/passwd`, an empty `/tmp`, and its volumeMounts at their `mountPath`s;
//!   `readOnlyRootFilesystem` makes that root read-only. The host's `/usr` (and the `/lib` links) is bound
//!   read-only because the provider cargo built links glibc dynamically, where the image has a static binary.
//! - **Volumes**: ConfigMap, Secret and projected volumes are written from the objects in the apiserver with
//!   the kubelet's modes and ownership: `items`, `mode`, `defaultMode` (0644 when unset), files owned by root;
//!   with `fsGroup` the files and directories are group-owned by it and made group-readable (the kubelet's
//!   `SetVolumeOwnership`, read-only mask 0440). Such volumes are mounted read-only; `emptyDir` read-write.
//! - **Identity**: the process runs as the effective `runAsUser`/`runAsGroup` (container over pod over image)
//!   with `fsGroup` and `supplementalGroups` as supplementary groups; `runAsNonRoot` refuses uid 0;
//!   `allowPrivilegeEscalation: false` sets no_new_privs. The kernel checks every file access.
//! - **Service account**: unless automounting is off, a token for the pod's ServiceAccount from the TokenRequest
//!   API, the cluster's CA and the namespace are mounted at `/var/run/secrets/kubernetes.io/serviceaccount`
//!   (mode 0644) in each container's own root, and `KUBERNETES_SERVICE_HOST`/`_PORT` name the test apiserver:
//!   the programs use their real in-cluster configuration code, under exactly the RBAC the token's
//!   ServiceAccount is bound to.
//! - **Probes and start order**: native sidecars (init containers with `restartPolicy: Always`) start first,
//!   one by one, each waited for until its startup probe passes (within `failureThreshold × periodSeconds`);
//!   other init containers must exit 0; then the containers start. Readiness is the readiness probe
//!   (`httpGet`, `tcpSocket`, `grpc`), polled faster than `periodSeconds` to keep tests short.
//!
//! What is substituted (every pod shares the host's network namespace, and the tests listen on 127.0.0.1
//! only):
//! - well-known ports ([`PortMap`]) are moved to free ones: in args, env values, ConfigMap files and probes;
//! - listen addresses `0.0.0.0` become `127.0.0.1`, and a program's default listen address is given
//!   explicitly when the manifest leaves it to the default (cluster-autoscaler's `--address` is `:8085`);
//! - cluster DNS is `/etc/hosts`: the names in [`Kubelet::hosts`] (Services) resolve to 127.0.0.1;
//! - memory limits are not enforced (no cgroups): the peak resident size is reported for the test to check;
//! - seccomp profiles and capability lists are not applied (the processes run as non-root users anyway).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Secret, ServiceAccount};
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::{Value, json};

use super::procs::{self, Check, poll_until};

/// Ports that manifests name literally, moved to free ones on 127.0.0.1 for one test run.
#[derive(Clone, Debug, Default)]
pub struct PortMap(BTreeMap<u16, u16>);

impl PortMap {
    /// A free loopback port for each of `ports`.
    pub fn fresh(ports: &[u16]) -> PortMap {
        PortMap(ports.iter().map(|p| (*p, procs::free_port())).collect())
    }

    /// The port `port` is moved to (itself when it is not mapped).
    pub fn get(&self, port: u16) -> u16 {
        self.0.get(&port).copied().unwrap_or(port)
    }

    /// `text` with every `:PORT` of a mapped port replaced, and wildcard listen hosts made loopback.
    pub fn rewrite(&self, text: &str) -> String {
        let mut out = text.replace("0.0.0.0:", "127.0.0.1:");
        for (from, to) in &self.0 {
            out = replace_port(&out, *from, *to);
        }
        out
    }
}

/// Replaces `:from` by `:to` where `from` is not followed by another digit.
fn replace_port(text: &str, from: u16, to: u16) -> String {
    let needle = format!(":{from}");
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(&needle) {
        let after = &rest[i + needle.len()..];
        out.push_str(&rest[..i]);
        if after.starts_with(|c: char| c.is_ascii_digit()) {
            out.push_str(&needle);
        } else {
            out.push_str(&format!(":{to}"));
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

/// What an image holds, as far as running it goes.
#[derive(Clone, Debug)]
pub struct ImageConfig {
    /// Where the program is in the image (the local binary is placed there).
    pub path: String,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub workdir: String,
    /// `USER uid:gid`.
    pub user: Option<(u32, Option<u32>)>,
    /// `(flag, port)`: where the program listens when the flag is not given (its default), made explicit
    /// on 127.0.0.1 and a mapped port.
    pub default_listens: Vec<(String, u16)>,
}

/// A local binary standing in for an image.
#[derive(Clone, Debug)]
pub struct LocalImage {
    pub image: String,
    pub binary: PathBuf,
    pub config: ImageConfig,
}

/// The local binary and image configuration for `image`. Known: the provider's image (any registry, name
/// `capi-autoscaler-provider`) and `registry.k8s.io/autoscaling/cluster-autoscaler` at a pinned version.
pub fn local_image(image: &str) -> LocalImage {
    let (repository, tag) = split_image(image);
    if repository == "registry.k8s.io/autoscaling/cluster-autoscaler" {
        let version = tag.trim_start_matches('v');
        assert!(
            super::autoscaler::versions().iter().any(|v| v == version),
            "image {image}: cluster-autoscaler {version} is not a pinned version \
             (tests/upstream/cluster-autoscaler.versions)"
        );
        return LocalImage {
            image: image.to_string(),
            binary: super::autoscaler::binary(version, "externalgrpc"),
            // The release image: the binary on distroless/static:nonroot.
            config: ImageConfig {
                path: "/cluster-autoscaler".into(),
                entrypoint: Vec::new(),
                cmd: vec!["/cluster-autoscaler".into()],
                workdir: "/".into(),
                user: Some((65532, Some(65532))),
                default_listens: vec![("--address".into(), 8085)],
            },
        };
    }
    if repository.rsplit('/').next() == Some("capi-autoscaler-provider") {
        let mut config = dockerfile_config(&super::render::repo("Dockerfile"));
        config.default_listens = vec![
            ("--address".into(), 8086),
            ("--metrics-address".into(), 8087),
        ];
        return LocalImage {
            image: image.to_string(),
            binary: PathBuf::from(super::provider::PROVIDER_BIN),
            config,
        };
    }
    panic!("image {image}: no local binary stands in for it (see tests/support/kubelet.rs)");
}

/// `(repository, tag)`; the tag is `latest` when absent.
pub fn split_image(image: &str) -> (&str, &str) {
    let name_start = image.rfind('/').map_or(0, |i| i + 1);
    match image[name_start..].rfind(':') {
        Some(i) => (&image[..name_start + i], &image[name_start + i + 1..]),
        None => (image, "latest"),
    }
}

/// ENTRYPOINT, CMD (exec form), WORKDIR and USER of the final stage of a Dockerfile.
pub fn dockerfile_config(path: &Path) -> ImageConfig {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let last_stage = text.rsplit_once("\nFROM ").map(|(_, s)| s).unwrap_or(&text);
    let mut config = ImageConfig {
        path: String::new(),
        entrypoint: Vec::new(),
        cmd: Vec::new(),
        workdir: "/".into(),
        user: None,
        default_listens: Vec::new(),
    };
    let exec_form = |rest: &str| -> Vec<String> {
        serde_json::from_str(rest.trim()).unwrap_or_else(|e| {
            panic!(
                "{}: `{rest}` is not the exec (JSON) form: {e}",
                path.display()
            )
        })
    };
    for line in last_stage.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("ENTRYPOINT ") {
            config.entrypoint = exec_form(rest);
        } else if let Some(rest) = line.strip_prefix("CMD ") {
            config.cmd = exec_form(rest);
        } else if let Some(rest) = line.strip_prefix("WORKDIR ") {
            config.workdir = rest.trim().to_string();
        } else if let Some(rest) = line.strip_prefix("USER ") {
            let (u, g) = match rest.trim().split_once(':') {
                Some((u, g)) => (u, Some(g)),
                None => (rest.trim(), None),
            };
            let uid = u
                .parse()
                .unwrap_or_else(|_| panic!("{}: USER {rest} is not numeric", path.display()));
            config.user = Some((uid, g.and_then(|g| g.parse().ok())));
        }
    }
    config.path = config
        .entrypoint
        .first()
        .or(config.cmd.first())
        .cloned()
        .unwrap_or_else(|| panic!("{}: no ENTRYPOINT or CMD", path.display()));
    config
}

/// The kubelet of one cluster: where its pods' API objects and tokens come from.
pub struct Kubelet {
    /// An admin client of the cluster the pods run in (reads ConfigMaps, Secrets, ServiceAccounts; asks for
    /// tokens), as the node's kubelet would.
    pub client: Client,
    /// `https://127.0.0.1:<port>`: what `KUBERNETES_SERVICE_HOST`/`_PORT` point at.
    pub server: String,
    /// The cluster's CA certificate (PEM): `ca.crt` of the service-account volume.
    pub ca_pem: String,
    pub ports: PortMap,
    /// Names that resolve to 127.0.0.1 in every container (cluster DNS for Services).
    pub hosts: Vec<String>,
}

/// A probe, resolved to a local port.
#[derive(Clone, Debug)]
pub struct Probe {
    pub action: ProbeAction,
    pub initial_delay: Duration,
    pub period: Duration,
    pub failure_threshold: u32,
}

#[derive(Clone, Debug)]
pub enum ProbeAction {
    Http { port: u16, path: String },
    Tcp { port: u16 },
    Grpc { port: u16, service: String },
}

impl Probe {
    /// How long the kubelet lets it fail before giving up on the container.
    pub fn budget(&self) -> Duration {
        self.initial_delay + self.period * self.failure_threshold
    }

    pub async fn check(&self) -> Result<(), String> {
        match &self.action {
            ProbeAction::Http { port, path } => {
                super::autoscaler::http_get(&format!("127.0.0.1:{port}"), path)
                    .await
                    .map(|_| ())
            }
            ProbeAction::Tcp { port } => tokio::net::TcpStream::connect(("127.0.0.1", *port))
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            ProbeAction::Grpc { port, service } => {
                let endpoint =
                    tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
                        .map_err(|e| e.to_string())?
                        .connect_timeout(Duration::from_secs(1))
                        .timeout(Duration::from_secs(2));
                match super::provider::health_status(endpoint, service).await? {
                    tonic_health::pb::health_check_response::ServingStatus::Serving => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        }
    }

    fn describe(&self) -> String {
        match &self.action {
            ProbeAction::Http { port, path } => format!("GET 127.0.0.1:{port}{path}"),
            ProbeAction::Tcp { port } => format!("TCP 127.0.0.1:{port}"),
            ProbeAction::Grpc { port, service } => {
                format!("gRPC health {service:?} 127.0.0.1:{port}")
            }
        }
    }
}

/// One started container.
pub struct RunningContainer {
    pub name: String,
    pub image: String,
    pub binary: PathBuf,
    /// The command line as executed (after composition, expansion and the substitutions).
    pub argv: Vec<String>,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// A native sidecar (init container with `restartPolicy: Always`).
    pub sidecar: bool,
    pub log: PathBuf,
    pub started: Instant,
    /// Start → startup probe passed (or started, without one).
    pub startup_after: Option<Duration>,
    /// Start → readiness probe passed (or started, without one).
    pub ready_after: Option<Duration>,
    pub startup: Option<Probe>,
    pub readiness: Option<Probe>,
    pub liveness: Option<Probe>,
    /// `resources.limits.memory` in bytes.
    pub memory_limit: Option<u64>,
    child: Child,
    exec: ExecSpec,
}

/// How the container's process was set up, to run another one beside it (`kubectl exec`).
struct ExecSpec {
    env: Vec<(String, String)>,
    root: PathBuf,
    binds: Vec<Bind>,
    read_only_root: bool,
    workdir: String,
    uid: u32,
    gid: u32,
    groups: Vec<u32>,
    no_new_privs: bool,
}

impl ExecSpec {
    fn sandbox(&self) -> Sandbox {
        Sandbox {
            root: cstring(&self.root),
            mounts: self.binds.iter().cloned().map(Bind::into_c).collect(),
            read_only_root: self.read_only_root,
            workdir: CString::new(self.workdir.as_str()).expect("a working directory without NUL"),
            uid: self.uid,
            gid: self.gid,
            groups: self.groups.clone(),
            no_new_privs: self.no_new_privs,
        }
    }

    /// `argv` in the container's root, as its user, with its environment; stdout and stderr captured.
    fn command(&self, argv: &[&str]) -> Command {
        let mut command = Command::new(argv[0]);
        command
            .args(&argv[1..])
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        let sandbox = self.sandbox();
        // SAFETY: the closure runs between fork and exec and makes only raw system calls on memory
        // prepared before the fork (no allocation, no locks).
        unsafe {
            command.pre_exec(move || sandbox.enter());
        }
        command
    }
}

impl RunningContainer {
    pub fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Err(format!(
                "container {} exited with {status}\n--- log {} ---\n{}",
                self.name,
                self.log.display(),
                procs::log_tail(&self.log, 8000)
            )),
            Ok(None) => Ok(()),
            Err(e) => Err(format!("wait for container {}: {e}", self.name)),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Runs `argv` beside the container's process as `kubectl exec` would: same root, mounts, user,
    /// groups and environment. Returns its exit status, stdout and stderr.
    pub async fn exec(&self, argv: &[&str]) -> std::process::Output {
        let mut command = self.exec.command(argv);
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = procs::spawn(command)
            .unwrap_or_else(|e| panic!("exec {argv:?} in container {}: {e}", self.name));
        let waited = tokio::time::timeout(
            Duration::from_secs(60),
            tokio::task::spawn_blocking(move || child.wait_with_output()),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "exec {argv:?} in container {}: no exit after 60 s",
                self.name
            )
        });
        waited
            .expect("the exec waiter")
            .unwrap_or_else(|e| panic!("exec {argv:?}: {e}"))
    }

    /// Waits until the process exits on its own, `timeout` at most.
    pub async fn wait_exit(
        &mut self,
        timeout: Duration,
    ) -> Result<std::process::ExitStatus, String> {
        procs::wait_exit(
            &mut self.child,
            &format!("container {} exits", self.name),
            timeout,
        )
        .await
    }

    /// Peak resident memory so far (`VmHWM`), in bytes.
    pub fn peak_rss(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// The first and last lines of the log, for failure messages.
    pub fn log_tail(&self) -> String {
        procs::log_tail(&self.log, 8000)
    }

    async fn wait_started(&mut self) -> Result<(), String> {
        if let Some(probe) = self.startup.clone() {
            let what = format!("container {} startup probe {}", self.name, probe.describe());
            self.poll_probe(&what, &probe, probe.budget()).await?;
        }
        self.startup_after = Some(self.started.elapsed());
        Ok(())
    }

    async fn wait_ready(&mut self, timeout: Duration) -> Result<(), String> {
        if let Some(probe) = self.readiness.clone() {
            let what = format!(
                "container {} readiness probe {}",
                self.name,
                probe.describe()
            );
            self.poll_probe(&what, &probe, timeout).await?;
        }
        self.ready_after.get_or_insert(self.started.elapsed());
        Ok(())
    }

    async fn poll_probe(
        &mut self,
        what: &str,
        probe: &Probe,
        timeout: Duration,
    ) -> Result<(), String> {
        let result = poll_until(what, timeout, Duration::from_millis(100), || {
            let alive = self.check_alive();
            let probe = probe.clone();
            async move {
                if let Err(e) = alive {
                    return Check::Fatal(e);
                }
                match probe.check().await {
                    Ok(()) => Check::Done(()),
                    Err(e) => Check::Wait(e),
                }
            }
        })
        .await;
        result.map_err(|e| {
            format!(
                "{e}\n--- log {} ---\n{}",
                self.log.display(),
                self.log_tail()
            )
        })
    }
}

/// A pod whose containers run; killed on drop (containers first, then sidecars in reverse start order).
pub struct RunningPod {
    pub namespace: String,
    pub name: String,
    pub service_account: String,
    pub dir: PathBuf,
    pub containers: Vec<RunningContainer>,
}

impl RunningPod {
    pub fn container(&self, name: &str) -> &RunningContainer {
        self.containers
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("pod {} has no container {name}", self.name))
    }

    /// The container running `image`'s repository (e.g. `registry.k8s.io/autoscaling/cluster-autoscaler`).
    pub fn by_image(&self, repository: &str) -> &RunningContainer {
        self.containers
            .iter()
            .find(|c| split_image(&c.image).0 == repository)
            .unwrap_or_else(|| panic!("pod {} runs no {repository} image", self.name))
    }

    pub fn check_alive(&mut self) -> Result<(), String> {
        self.containers
            .iter_mut()
            .try_for_each(RunningContainer::check_alive)
    }

    /// Waits until every container is ready (its readiness probe passes), `timeout` each at most.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<(), String> {
        for c in &mut self.containers {
            c.wait_ready(timeout).await?;
        }
        Ok(())
    }

    /// A line per container: image, program, user, readiness.
    pub fn summary(&self) -> String {
        let mut out = format!(
            "pod {}/{} (ServiceAccount {})",
            self.namespace, self.name, self.service_account
        );
        for c in &self.containers {
            let secs = |d: Option<Duration>| {
                d.map_or("never".to_string(), |d| format!("{:.1}s", d.as_secs_f64()))
            };
            // The provider's own settings from the environment (its flags' variables), as they count.
            let settings: String = c
                .exec
                .env
                .iter()
                .filter(|(k, _)| k.starts_with("CAPI_"))
                .map(|(k, v)| format!("{k}={v} "))
                .collect();
            out.push_str(&format!(
                "\n  {}{}: {} as uid {} gid {} groups {:?}; started {} ready {}; `{settings}{}`",
                c.name,
                if c.sidecar { " (native sidecar)" } else { "" },
                c.image,
                c.uid,
                c.gid,
                c.groups,
                secs(c.startup_after),
                secs(c.ready_after),
                c.argv.join(" "),
            ));
        }
        out
    }

    /// The log tails of every container.
    pub fn logs(&self) -> String {
        self.containers
            .iter()
            .map(|c| {
                format!(
                    "--- {} log {} ---\n{}\n",
                    c.name,
                    c.log.display(),
                    c.log_tail()
                )
            })
            .collect()
    }
}

impl Drop for RunningPod {
    fn drop(&mut self) {
        // Main containers stop before the sidecars; sidecars in reverse start order.
        let (sidecars, main): (Vec<_>, Vec<_>) =
            self.containers.iter_mut().partition(|c| c.sidecar);
        for c in main.into_iter().chain(sidecars.into_iter().rev()) {
            procs::kill_and_reap(&mut c.child);
        }
    }
}

/// A materialized volume: a directory on the host.
struct VolumeDir {
    path: PathBuf,
    read_only: bool,
}

/// The service-account volume's mount path.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

impl Kubelet {
    /// Runs the pod `name` of `spec` (a PodSpec as JSON, e.g. a stored Deployment's `spec.template.spec`)
    /// in `namespace`: volumes, service-account token, native sidecars until started, init containers to
    /// completion, then the containers, waited for until their startup probes pass (not necessarily
    /// ready). Panics with the logs when a container does not start.
    pub async fn run_pod(&self, namespace: &str, name: &str, spec: &Value) -> RunningPod {
        let mut pod = self.start_pod(namespace, name, spec).await;
        // The main containers start together; the kubelet gates their readiness on their startup probes.
        for c in pod.containers.iter_mut().filter(|c| !c.sidecar) {
            if let Err(e) = c.wait_started().await {
                panic!("{e}");
            }
        }
        pod
    }

    /// [`Kubelet::run_pod`] without waiting for the main containers' startup probes (native sidecars are
    /// still waited for: the main containers start after them).
    pub async fn start_pod(&self, namespace: &str, name: &str, spec: &Value) -> RunningPod {
        let dir = procs::work_dir().join("pods").join(name);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .unwrap_or_else(|e| panic!("clear {}: {e}", dir.display()));
        }
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        let pod_security = &spec["securityContext"];
        let fs_group = pod_security["fsGroup"].as_u64().map(|g| g as u32);
        let service_account = spec["serviceAccountName"]
            .as_str()
            .unwrap_or("default")
            .to_string();

        let mut volumes = BTreeMap::new();
        for volume in spec["volumes"].as_array().into_iter().flatten() {
            let vname = volume["name"].as_str().expect("volume name").to_string();
            let path = dir.join("volumes").join(&vname);
            let read_only = self.materialize(namespace, volume, &path, fs_group).await;
            volumes.insert(vname, VolumeDir { path, read_only });
        }
        let automount = self.automount(namespace, spec, &service_account).await;
        let token_dir = if automount {
            let path = dir.join("volumes").join("kube-api-access");
            let token = self.token(namespace, &service_account).await;
            let files = [
                ("token", token.into_bytes()),
                ("ca.crt", self.ca_pem.clone().into_bytes()),
                ("namespace", namespace.as_bytes().to_vec()),
            ];
            write_volume(
                &path,
                files.iter().map(|(k, v)| (k.to_string(), v.clone(), 0o644)),
                fs_group,
            );
            Some(path)
        } else {
            None
        };

        let mut pod = RunningPod {
            namespace: namespace.to_string(),
            name: name.to_string(),
            service_account,
            dir: dir.clone(),
            containers: Vec::new(),
        };
        let pod_env = PodEnv {
            namespace,
            name,
            service_account: &pod.service_account,
        };
        for (kind, list) in [
            ("init", &spec["initContainers"]),
            ("main", &spec["containers"]),
        ] {
            for container in list.as_array().into_iter().flatten() {
                let sidecar = kind == "init" && container["restartPolicy"] == "Always";
                let mut running = self
                    .start_container(
                        &pod_env,
                        spec,
                        container,
                        &dir,
                        &volumes,
                        token_dir.as_deref(),
                        sidecar,
                    )
                    .await;
                if kind == "init" && !sidecar {
                    let status = procs::wait_exit(
                        &mut running.child,
                        &format!("init container {}", running.name),
                        Duration::from_secs(120),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                    assert!(
                        status.success(),
                        "init container {} failed with {status}\n{}",
                        running.name,
                        running.log_tail()
                    );
                    continue;
                }
                if sidecar {
                    // The kubelet starts the next container only once this sidecar has started.
                    if let Err(e) = running.wait_started().await {
                        pod.containers.push(running);
                        panic!("{e}\n{}", pod.summary());
                    }
                }
                pod.containers.push(running);
            }
        }
        pod
    }

    async fn automount(&self, namespace: &str, spec: &Value, service_account: &str) -> bool {
        if let Some(b) = spec["automountServiceAccountToken"].as_bool() {
            return b;
        }
        let sa = Api::<ServiceAccount>::namespaced(self.client.clone(), namespace)
            .get_opt(service_account)
            .await
            .unwrap_or_else(|e| panic!("get ServiceAccount {namespace}/{service_account}: {e}"))
            .unwrap_or_else(|| {
                panic!(
                    "ServiceAccount {namespace}/{service_account} does not exist: the pod would not be \
                     created"
                )
            });
        sa.automount_service_account_token.unwrap_or(true)
    }

    /// A token for `namespace/service_account` from the TokenRequest API (the default audience, the
    /// kubelet's default lifetime of a projected token).
    pub async fn token(&self, namespace: &str, service_account: &str) -> String {
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), namespace);
        let request = json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3607},
        });
        let response: Value = api
            .create_subresource("token", service_account, &PostParams::default(), &request)
            .await
            .unwrap_or_else(|e| {
                panic!("TokenRequest for ServiceAccount {namespace}/{service_account}: {e}")
            });
        response["status"]["token"]
            .as_str()
            .expect("a token in the TokenRequest status")
            .to_string()
    }

    /// Writes `volume` into `path`; returns whether it is mounted read-only.
    async fn materialize(
        &self,
        namespace: &str,
        volume: &Value,
        path: &Path,
        fs_group: Option<u32>,
    ) -> bool {
        let name = volume["name"].as_str().unwrap_or_default();
        if let Some(source) = volume.get("configMap") {
            let files = self.config_map_files(namespace, name, source).await;
            write_volume(path, files, fs_group);
            return true;
        }
        if let Some(source) = volume.get("secret") {
            let files = self.secret_files(namespace, name, source).await;
            write_volume(path, files, fs_group);
            return true;
        }
        if volume.get("emptyDir").is_some() {
            std::fs::create_dir_all(path)
                .unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
            set_mode(path, 0o777);
            if let Some(g) = fs_group {
                chown_group(path, g);
                set_mode(path, 0o777 | 0o2000);
            }
            return false;
        }
        panic!("volume {name}: only configMap, secret and emptyDir volumes are run here: {volume}");
    }

    async fn config_map_files(
        &self,
        namespace: &str,
        volume: &str,
        source: &Value,
    ) -> Vec<(String, Vec<u8>, u32)> {
        let cm_name = source["name"].as_str().unwrap_or_default();
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), namespace);
        let Some(cm) = api
            .get_opt(cm_name)
            .await
            .unwrap_or_else(|e| panic!("get ConfigMap {namespace}/{cm_name}: {e}"))
        else {
            assert!(
                source["optional"] == true,
                "volume {volume}: ConfigMap {namespace}/{cm_name} does not exist: the pod would stay \
                 ContainerCreating"
            );
            return Vec::new();
        };
        let mut data: BTreeMap<String, Vec<u8>> = cm
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, self.ports.rewrite(&v).into_bytes()))
            .collect();
        for (k, v) in cm.binary_data.unwrap_or_default() {
            data.insert(k, v.0);
        }
        project(volume, source, data)
    }

    async fn secret_files(
        &self,
        namespace: &str,
        volume: &str,
        source: &Value,
    ) -> Vec<(String, Vec<u8>, u32)> {
        let secret_name = source["secretName"].as_str().unwrap_or_default();
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        let Some(secret) = api
            .get_opt(secret_name)
            .await
            .unwrap_or_else(|e| panic!("get Secret {namespace}/{secret_name}: {e}"))
        else {
            assert!(
                source["optional"] == true,
                "volume {volume}: Secret {namespace}/{secret_name} does not exist: the pod would stay \
                 ContainerCreating"
            );
            return Vec::new();
        };
        let data: BTreeMap<String, Vec<u8>> = secret
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect();
        project(volume, source, data)
    }

    #[allow(clippy::too_many_arguments)]
    async fn start_container(
        &self,
        pod: &PodEnv<'_>,
        spec: &Value,
        container: &Value,
        pod_dir: &Path,
        volumes: &BTreeMap<String, VolumeDir>,
        token_dir: Option<&Path>,
        sidecar: bool,
    ) -> RunningContainer {
        let name = container["name"]
            .as_str()
            .expect("container name")
            .to_string();
        let image = container["image"]
            .as_str()
            .expect("container image")
            .to_string();
        let local = local_image(&image);

        // Identity: container over pod over image.
        let pod_sc = &spec["securityContext"];
        let sc = &container["securityContext"];
        let pick = |key: &str| sc[key].as_u64().or_else(|| pod_sc[key].as_u64());
        let uid = pick("runAsUser")
            .map(|u| u as u32)
            .or(local.config.user.map(|(u, _)| u))
            .unwrap_or(0);
        let gid = pick("runAsGroup")
            .map(|g| g as u32)
            .or(local.config.user.and_then(|(_, g)| g))
            .unwrap_or(0);
        let non_root = sc["runAsNonRoot"]
            .as_bool()
            .or(pod_sc["runAsNonRoot"].as_bool())
            .unwrap_or(false);
        assert!(
            !(non_root && uid == 0),
            "container {name}: runAsNonRoot and the image would run as root: the kubelet refuses it"
        );
        let mut groups: Vec<u32> = pod_sc["fsGroup"]
            .as_u64()
            .map(|g| g as u32)
            .into_iter()
            .collect();
        groups.extend(
            pod_sc["supplementalGroups"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|g| g.as_u64().map(|g| g as u32)),
        );

        // Environment as the kubelet sets it.
        let (api_host, api_port) = host_port(&self.server);
        let mut env: Vec<(String, String)> = vec![
            (
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            ),
            ("HOSTNAME".into(), pod.name.into()),
            ("KUBERNETES_SERVICE_HOST".into(), api_host.clone()),
            ("KUBERNETES_SERVICE_PORT".into(), api_port.to_string()),
            ("KUBERNETES_SERVICE_PORT_HTTPS".into(), api_port.to_string()),
            (
                "KUBERNETES_PORT".into(),
                format!("tcp://{api_host}:{api_port}"),
            ),
        ];
        for from in container["envFrom"].as_array().into_iter().flatten() {
            for (k, v) in self.env_from(pod.namespace, from).await {
                set_env(&mut env, k, v);
            }
        }
        for var in container["env"].as_array().into_iter().flatten() {
            let key = var["name"].as_str().expect("env name").to_string();
            let value = match var["value"].as_str() {
                Some(v) => expand(v, &env),
                None => self.env_value_from(pod, &var["valueFrom"]).await,
            };
            set_env(&mut env, key, self.ports.rewrite(&value));
        }

        // Command line: Kubernetes' composition with the image's ENTRYPOINT and CMD.
        let command = super::render::strings(&container["command"]);
        let args = super::render::strings(&container["args"]);
        let has_args = container.get("args").is_some_and(|a| !a.is_null());
        let mut argv: Vec<String> = if !command.is_empty() {
            command.iter().chain(args.iter()).cloned().collect()
        } else {
            let tail = if has_args {
                args
            } else {
                local.config.cmd.clone()
            };
            local
                .config
                .entrypoint
                .iter()
                .cloned()
                .chain(tail)
                .collect()
        };
        argv = argv
            .iter()
            .map(|a| self.ports.rewrite(&expand(a, &env)))
            .collect();
        let workdir = container["workingDir"]
            .as_str()
            .unwrap_or(&local.config.workdir)
            .to_string();
        let program = argv.first().cloned().unwrap_or_else(|| {
            panic!("container {name}: no command, and the image {image} has no ENTRYPOINT or CMD")
        });
        let resolved = if program.starts_with('/') {
            normalize(&program)
        } else {
            normalize(&format!("{workdir}/{program}"))
        };
        assert_eq!(
            resolved, local.config.path,
            "container {name}: runs {program} (in {workdir}), but the image {image} has its program at {}",
            local.config.path
        );
        for (flag, port) in &local.config.default_listens {
            let given = argv
                .iter()
                .any(|a| a == flag || a.starts_with(&format!("{flag}=")));
            // Only a serving command line listens (not the provider's `check` or `template`).
            let serves = argv
                .get(1)
                .is_none_or(|c| c == "serve" || c.starts_with('-'));
            if !given && serves {
                argv.push(format!("{flag}=127.0.0.1:{}", self.ports.get(*port)));
            }
        }

        // The container's own root.
        let root = pod_dir.join("containers").join(&name);
        let mut mounts = Vec::new();
        build_root(&root, &self.hosts, pod.name);
        add_system_mounts(&root, &mut mounts);
        let program_in_root = root.join(local.config.path.trim_start_matches('/'));
        if let Some(parent) = program_in_root.parent() {
            std::fs::create_dir_all(parent).expect("create the program's directory");
        }
        std::fs::write(&program_in_root, b"").expect("create the program's mount point");
        mounts.push(Bind::new(&local.binary, &program_in_root, true));
        for mount in container["volumeMounts"].as_array().into_iter().flatten() {
            let vname = mount["name"].as_str().unwrap_or_default();
            let volume = volumes.get(vname).unwrap_or_else(|| {
                panic!("container {name}: volumeMount {vname} names no volume of the pod")
            });
            let target = mount["mountPath"].as_str().expect("mountPath");
            let mut source = volume.path.clone();
            if let Some(sub) = mount["subPath"].as_str().filter(|s| !s.is_empty()) {
                source = source.join(sub);
            }
            let dst = root.join(target.trim_start_matches('/'));
            if source.is_dir() {
                std::fs::create_dir_all(&dst).expect("create a mount point");
            } else {
                std::fs::create_dir_all(dst.parent().expect("a parent"))
                    .expect("create a mount point");
                std::fs::write(&dst, b"").expect("create a file mount point");
            }
            let read_only = volume.read_only || mount["readOnly"] == true;
            mounts.push(Bind::new(&source, &dst, read_only));
        }
        if let Some(token_dir) = token_dir {
            let dst = root.join(SERVICE_ACCOUNT_DIR.trim_start_matches('/'));
            std::fs::create_dir_all(&dst).expect("create the service-account mount point");
            mounts.push(Bind::new(token_dir, &dst, true));
        }
        let exec = ExecSpec {
            env,
            root,
            binds: mounts,
            read_only_root: sc["readOnlyRootFilesystem"] == true,
            workdir,
            uid,
            gid,
            groups: groups.clone(),
            no_new_privs: sc["allowPrivilegeEscalation"] == false,
        };

        let log = pod_dir.join(format!("{name}.log"));
        let out = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|e| panic!("open {}: {e}", log.display()));
        let argv_refs: Vec<&str> = argv.iter().map(String::as_str).collect();
        let mut command = exec.command(&argv_refs);
        command
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().expect("clone the log file")))
            .stderr(Stdio::from(out));
        let started = Instant::now();
        let child = procs::spawn(command)
            .unwrap_or_else(|e| panic!("start container {name} ({}): {e}", local.binary.display()));
        let probe = |key: &str| self.probe(container, &container[key]);
        RunningContainer {
            startup: probe("startupProbe"),
            readiness: probe("readinessProbe"),
            liveness: probe("livenessProbe"),
            memory_limit: container["resources"]["limits"]["memory"]
                .as_str()
                .map(parse_memory),
            name,
            image,
            binary: local.binary,
            argv,
            uid,
            gid,
            groups,
            sidecar,
            log,
            started,
            startup_after: None,
            ready_after: None,
            child,
            exec,
        }
    }

    fn probe(&self, container: &Value, probe: &Value) -> Option<Probe> {
        if probe.is_null() {
            return None;
        }
        let port_of = |port: &Value| -> u16 {
            let declared = match port {
                Value::Number(n) => n.as_u64().expect("a port number") as u16,
                Value::String(name) => container["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|p| p["name"] == *name)
                    .and_then(|p| p["containerPort"].as_u64())
                    .unwrap_or_else(|| {
                        panic!(
                            "probe port {name}: not a port of container {}",
                            container["name"]
                        )
                    }) as u16,
                other => panic!("probe port {other}"),
            };
            self.ports.get(declared)
        };
        let action = if let Some(http) = probe.get("httpGet") {
            assert!(
                http["scheme"].as_str().unwrap_or("HTTP") == "HTTP",
                "only HTTP probes are run here: {probe}"
            );
            ProbeAction::Http {
                port: port_of(&http["port"]),
                path: http["path"].as_str().unwrap_or("/").to_string(),
            }
        } else if let Some(tcp) = probe.get("tcpSocket") {
            ProbeAction::Tcp {
                port: port_of(&tcp["port"]),
            }
        } else if let Some(grpc) = probe.get("grpc") {
            ProbeAction::Grpc {
                port: port_of(&grpc["port"]),
                service: grpc["service"].as_str().unwrap_or_default().to_string(),
            }
        } else {
            panic!(
                "container {}: only httpGet, tcpSocket and grpc probes are run here: {probe}",
                container["name"]
            );
        };
        let secs =
            |key: &str, default: u64| Duration::from_secs(probe[key].as_u64().unwrap_or(default));
        Some(Probe {
            action,
            initial_delay: secs("initialDelaySeconds", 0),
            period: secs("periodSeconds", 10),
            failure_threshold: probe["failureThreshold"].as_u64().unwrap_or(3) as u32,
        })
    }

    async fn env_from(&self, namespace: &str, from: &Value) -> Vec<(String, String)> {
        let prefix = from["prefix"].as_str().unwrap_or_default();
        let data: BTreeMap<String, String> = if let Some(r) = from.get("configMapRef") {
            let name = r["name"].as_str().unwrap_or_default();
            Api::<ConfigMap>::namespaced(self.client.clone(), namespace)
                .get(name)
                .await
                .unwrap_or_else(|e| panic!("envFrom ConfigMap {namespace}/{name}: {e}"))
                .data
                .unwrap_or_default()
        } else if let Some(r) = from.get("secretRef") {
            let name = r["name"].as_str().unwrap_or_default();
            Api::<Secret>::namespaced(self.client.clone(), namespace)
                .get(name)
                .await
                .unwrap_or_else(|e| panic!("envFrom Secret {namespace}/{name}: {e}"))
                .data
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
                .collect()
        } else {
            panic!("envFrom {from}: not understood here")
        };
        data.into_iter()
            .map(|(k, v)| (format!("{prefix}{k}"), self.ports.rewrite(&v)))
            .collect()
    }

    async fn env_value_from(&self, pod: &PodEnv<'_>, from: &Value) -> String {
        if let Some(field) = from["fieldRef"]["fieldPath"].as_str() {
            return match field {
                "metadata.name" => pod.name.to_string(),
                "metadata.namespace" => pod.namespace.to_string(),
                "spec.serviceAccountName" => pod.service_account.to_string(),
                "spec.nodeName" => "e2e-node".to_string(),
                "status.podIP" | "status.hostIP" => "127.0.0.1".to_string(),
                other => panic!("env fieldRef {other}: not understood here"),
            };
        }
        if let Some(r) = from.get("configMapKeyRef") {
            let (name, key) = (
                r["name"].as_str().unwrap_or_default(),
                r["key"].as_str().unwrap_or_default(),
            );
            let cm = Api::<ConfigMap>::namespaced(self.client.clone(), pod.namespace)
                .get(name)
                .await
                .unwrap_or_else(|e| panic!("env ConfigMap {}/{name}: {e}", pod.namespace));
            return cm.data.unwrap_or_default().remove(key).unwrap_or_else(|| {
                panic!("env: ConfigMap {}/{name} has no key {key}", pod.namespace)
            });
        }
        if let Some(r) = from.get("secretKeyRef") {
            let (name, key) = (
                r["name"].as_str().unwrap_or_default(),
                r["key"].as_str().unwrap_or_default(),
            );
            let secret = Api::<Secret>::namespaced(self.client.clone(), pod.namespace)
                .get(name)
                .await
                .unwrap_or_else(|e| panic!("env Secret {}/{name}: {e}", pod.namespace));
            let value = secret
                .data
                .unwrap_or_default()
                .remove(key)
                .unwrap_or_else(|| panic!("env: Secret {}/{name} has no key {key}", pod.namespace));
            return String::from_utf8_lossy(&value.0).into_owned();
        }
        panic!("env valueFrom {from}: not understood here");
    }
}

struct PodEnv<'a> {
    namespace: &'a str,
    name: &'a str,
    service_account: &'a str,
}

/// The files of a ConfigMap or Secret volume: `items` (key → path, per-item mode) or every key, with
/// `defaultMode` (0644 when unset, as the apiserver defaults it).
fn project(
    volume: &str,
    source: &Value,
    data: BTreeMap<String, Vec<u8>>,
) -> Vec<(String, Vec<u8>, u32)> {
    let default_mode = source["defaultMode"].as_u64().unwrap_or(0o644) as u32;
    match source["items"].as_array() {
        Some(items) => items
            .iter()
            .filter_map(|item| {
                let key = item["key"].as_str().unwrap_or_default();
                let Some(bytes) = data.get(key) else {
                    assert!(
                        source["optional"] == true,
                        "volume {volume}: key {key} is missing: the pod would stay ContainerCreating"
                    );
                    return None;
                };
                let path = item["path"].as_str().unwrap_or(key).to_string();
                let mode = item["mode"].as_u64().map_or(default_mode, |m| m as u32);
                Some((path, bytes.clone(), mode))
            })
            .collect(),
        None => data
            .into_iter()
            .map(|(k, v)| (k, v, default_mode))
            .collect(),
    }
}

/// Writes read-only volume files as the kubelet does: root-owned with their modes; with `fs_group`, every
/// file and directory group-owned by it, files `mode | 0440`, directories `| 0550` and setgid.
fn write_volume(
    dir: &Path,
    files: impl IntoIterator<Item = (String, Vec<u8>, u32)>,
    fs_group: Option<u32>,
) {
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let fix_dir = |d: &Path| {
        set_mode(d, 0o755);
        if let Some(g) = fs_group {
            chown_group(d, g);
            set_mode(d, 0o755 | 0o550 | 0o2000);
        }
    };
    fix_dir(dir);
    for (rel, bytes, mode) in files {
        let path = dir.join(&rel);
        let parent = path.parent().expect("a parent directory");
        if parent != dir {
            std::fs::create_dir_all(parent).expect("create a volume subdirectory");
            let mut d = parent;
            while d != dir {
                fix_dir(d);
                d = d.parent().expect("inside the volume");
            }
        }
        std::fs::write(&path, &bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        set_mode(&path, mode & 0o777);
        if let Some(g) = fs_group {
            chown_group(&path, g);
            set_mode(&path, (mode | 0o440) & 0o777);
        }
    }
}

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {:o} {}: {e}", mode, path.display()));
}

fn chown_group(path: &Path, gid: u32) {
    std::os::unix::fs::chown(path, None, Some(gid))
        .unwrap_or_else(|e| panic!("chgrp {gid} {}: {e}", path.display()));
}

fn set_env(env: &mut Vec<(String, String)>, key: String, value: String) {
    env.retain(|(k, _)| *k != key);
    env.push((key, value));
}

/// `$(VAR)` references to variables defined earlier expanded, `$$` an escaped `$`, unknown references kept.
fn expand(text: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
            && let Some((_, v)) = env.iter().rev().find(|(k, _)| *k == inner[..end])
        {
            out.push_str(v);
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

fn normalize(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

fn host_port(server: &str) -> (String, u16) {
    let hostport = server.trim_start_matches("https://").trim_end_matches('/');
    let (host, port) = hostport.rsplit_once(':').expect("server with a port");
    (host.to_string(), port.parse().expect("a port number"))
}

/// A Kubernetes memory quantity in bytes (the binary and decimal suffixes manifests use).
fn parse_memory(q: &str) -> u64 {
    let units: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    for (suffix, factor) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().expect("a memory quantity") * factor;
        }
    }
    q.parse().expect("a memory quantity")
}

fn cstring(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("a path without NUL")
}

/// The container root: `/etc/hosts` (the pod's name and the Service names on 127.0.0.1), `/etc/passwd`
/// and `/etc/group` as distroless has them, `/etc/nsswitch.conf` (files before DNS), an empty `/tmp`.
fn build_root(root: &Path, hosts: &[String], pod: &str) {
    if root.exists() {
        std::fs::remove_dir_all(root).unwrap_or_else(|e| panic!("clear {}: {e}", root.display()));
    }
    for dir in ["etc", "tmp", "proc", "dev", "sys", "usr"] {
        std::fs::create_dir_all(root.join(dir)).expect("create the container root");
    }
    set_mode(root, 0o755);
    set_mode(&root.join("tmp"), 0o1777);
    let mut etc_hosts = format!("127.0.0.1\tlocalhost\n127.0.0.1\t{pod}\n");
    for host in hosts {
        etc_hosts.push_str(&format!("127.0.0.1\t{host}\n"));
    }
    for (file, text) in [
        ("hosts", etc_hosts.as_str()),
        (
            "passwd",
            "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
        ),
        ("group", "root:x:0:\nnonroot:x:65532:\n"),
        ("nsswitch.conf", "hosts: files dns\n"),
    ] {
        let path = root.join("etc").join(file);
        std::fs::write(&path, text).expect("write a file of the container root");
        set_mode(&path, 0o644);
    }
}

/// /proc, /dev, /sys and the host's /usr (read-only, for the dynamically linked provider), with the
/// host's top-level links into /usr (`/lib` → `usr/lib` on merged-/usr systems) recreated.
fn add_system_mounts(root: &Path, mounts: &mut Vec<Bind>) {
    for (dir, read_only) in [
        ("proc", false),
        ("dev", false),
        ("sys", true),
        ("usr", true),
    ] {
        mounts.push(Bind::new(
            Path::new(&format!("/{dir}")),
            &root.join(dir),
            read_only,
        ));
    }
    for link in ["lib", "lib64", "bin", "sbin"] {
        let host = Path::new("/").join(link);
        if let Ok(target) = std::fs::read_link(&host) {
            std::os::unix::fs::symlink(&target, root.join(link)).expect("link into /usr");
        } else if host.is_dir() {
            std::fs::create_dir_all(root.join(link)).expect("create a mount point");
            mounts.push(Bind::new(&host, &root.join(link), true));
        }
    }
}

#[derive(Clone)]
struct Bind {
    src: PathBuf,
    dst: PathBuf,
    read_only: bool,
}

impl Bind {
    fn new(src: &Path, dst: &Path, read_only: bool) -> Bind {
        Bind {
            src: src.to_path_buf(),
            dst: dst.to_path_buf(),
            read_only,
        }
    }

    fn into_c(self) -> CBind {
        CBind {
            src: cstring(&self.src),
            dst: cstring(&self.dst),
            read_only: self.read_only,
        }
    }
}

struct CBind {
    src: CString,
    dst: CString,
    read_only: bool,
}

/// What the child does between fork and exec: a private mount namespace, the binds, the (read-only) root,
/// chroot, then the user and groups. Everything is prepared before the fork.
struct Sandbox {
    root: CString,
    mounts: Vec<CBind>,
    read_only_root: bool,
    workdir: CString,
    uid: u32,
    gid: u32,
    groups: Vec<u32>,
    no_new_privs: bool,
}

fn cvt(r: libc::c_int) -> io::Result<()> {
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl Sandbox {
    fn enter(&self) -> io::Result<()> {
        let none = std::ptr::null();
        // SAFETY: raw system calls with NUL-terminated strings that live as long as `self`.
        unsafe {
            cvt(libc::unshare(libc::CLONE_NEWNS))?;
            // Nothing mounted below propagates back to the host's mount namespace.
            cvt(libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                none as *const libc::c_void,
            ))?;
            cvt(libc::mount(
                self.root.as_ptr(),
                self.root.as_ptr(),
                none,
                libc::MS_BIND | libc::MS_REC,
                none as *const libc::c_void,
            ))?;
            for m in &self.mounts {
                cvt(libc::mount(
                    m.src.as_ptr(),
                    m.dst.as_ptr(),
                    none,
                    libc::MS_BIND | libc::MS_REC,
                    none as *const libc::c_void,
                ))?;
                if m.read_only {
                    cvt(libc::mount(
                        none,
                        m.dst.as_ptr(),
                        none,
                        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY,
                        none as *const libc::c_void,
                    ))?;
                }
            }
            if self.read_only_root {
                cvt(libc::mount(
                    none,
                    self.root.as_ptr(),
                    none,
                    libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY,
                    none as *const libc::c_void,
                ))?;
            }
            cvt(libc::chroot(self.root.as_ptr()))?;
            cvt(libc::chdir(self.workdir.as_ptr()))?;
            cvt(libc::setgroups(self.groups.len(), self.groups.as_ptr()))?;
            cvt(libc::setgid(self.gid))?;
            cvt(libc::setuid(self.uid))?;
            if self.no_new_privs {
                cvt(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
            }
        }
        Ok(())
    }
}
