//! One real control plane (etcd + kube-apiserver, Cluster API CRDs) per test binary, and on request
//! further ones beside it ([`named_control_plane`]).

use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleRef, Subject};
use kube::api::{ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

use super::crds;
use super::pki::{self, Ca};
use super::procs::{self, Check, poll_until};

/// Which Cluster API CRDs the control plane serves under `cluster.x-k8s.io`. The two sets share
/// names, so one control plane holds exactly one of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrdSet {
    /// As released by CAPI v1.14.0: v1beta1 and v1beta2 served, v1beta2 stored.
    Shipped,
    /// Only v1beta1, as storage (for the v1beta1 code paths without conversion).
    V1beta1,
    /// None at start: the real Cluster API manager's 13 CRDs, with its conversion webhook, are
    /// installed by `capi_manager` together with the manager (a release pinned in
    /// tests/upstream/capi; v1.14.2 by default).
    RealCapi,
}

/// What a control plane is started with. The test infrastructure template CRD
/// (`e2emachinetemplates.infrastructure.cluster.x-k8s.io`) is always installed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setup {
    pub crds: CrdSet,
    /// Also install the shipped CRDs moved to the group in the cache's `renamed-group` file
    /// (`cluster.example.dev`), for `CAPI_GROUP` tests.
    pub renamed_group: bool,
    /// The kube-apiserver and kube-scheduler of the Kubernetes release pinned in
    /// tests/upstream/k8s/<pin> (the management-cluster matrix), instead of the default's.
    pub kubernetes: Option<&'static str>,
    /// Whether the kube-apiserver checks its watch cache against etcd (`DetectCacheInconsistency`,
    /// on by default since Kubernetes 1.34): every 5 to 7.5 minutes it lists each resource from
    /// both and compares, tens of CPU seconds at 100,000 Machines, at random times. The benchmark
    /// turns it off so that those bursts do not land on one server's measured loop and not another's.
    pub cache_consistency_checks: bool,
}

impl Setup {
    pub const fn shipped() -> Setup {
        Setup {
            crds: CrdSet::Shipped,
            renamed_group: false,
            kubernetes: None,
            cache_consistency_checks: true,
        }
    }
    pub const fn v1beta1() -> Setup {
        Setup {
            crds: CrdSet::V1beta1,
            renamed_group: false,
            kubernetes: None,
            cache_consistency_checks: true,
        }
    }
    pub const fn real_capi() -> Setup {
        Setup {
            crds: CrdSet::RealCapi,
            renamed_group: false,
            kubernetes: None,
            cache_consistency_checks: true,
        }
    }
    pub const fn with_renamed_group(self) -> Setup {
        Setup {
            renamed_group: true,
            ..self
        }
    }
    /// Without the kube-apiserver's watch cache consistency checks (the default Kubernetes release
    /// only: older ones have no such feature gate).
    pub const fn without_cache_consistency_checks(self) -> Setup {
        Setup {
            cache_consistency_checks: false,
            ..self
        }
    }
    /// Runs the kube-apiserver and kube-scheduler of tests/upstream/k8s/`pin` (see
    /// [`pinned_kubernetes`]).
    pub const fn on_kubernetes(self, pin: &'static str) -> Setup {
        Setup {
            kubernetes: Some(pin),
            ..self
        }
    }
}

/// How long the start took, phase by phase.
#[derive(Clone, Debug)]
pub struct Timings {
    pub upstream: Duration,
    pub etcd: Duration,
    pub apiserver: Duration,
    pub crds: Duration,
    pub total: Duration,
    pub crd_count: usize,
}

/// A running control plane. Holds no runtime-bound objects: make clients per test.
pub struct ControlPlane {
    pub setup: Setup,
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    /// The upstream cache directory (bin/, crds/).
    pub upstream: PathBuf,
    /// Where its etcd, kube-apiserver and kube-scheduler are: the upstream cache's bin/, or for a
    /// pinned Kubernetes ([`Setup::kubernetes`]) a bin/ of the control plane's own linking them.
    pub bin: PathBuf,
    /// The version of its kube-apiserver (`v1.36.3`).
    pub kubernetes_version: String,
    /// Certificates, kubeconfigs and logs.
    pub dir: PathBuf,
    /// The API group of the renamed CRD set (whether or not it is installed).
    pub renamed_group: String,
    pub etcd_log: PathBuf,
    pub apiserver_log: PathBuf,
    pub timings: Timings,
    admin_kubeconfig: PathBuf,
    ca: Ca,
    counter: AtomicU32,
}

static CONTROL_PLANE: OnceLock<Result<ControlPlane, String>> = OnceLock::new();

/// The control plane of this test binary, started on first use with `setup`. Every later call must
/// ask for the same setup. Blocks while starting (other tests wait for the same start).
pub fn control_plane(setup: Setup) -> &'static ControlPlane {
    let started = CONTROL_PLANE.get_or_init(|| start_on_thread(setup, "control-plane"));
    started_with(started, setup)
}

/// A further control plane of this test binary beside [`control_plane`]'s, for what one control
/// plane cannot hold twice (the CRDs of two Cluster API releases share their names): named `name`
/// (its files in the work directory's `control-plane-<name>`), started on first use with `setup`,
/// stopped with the binary like the first. Every later call for `name` must ask for the same setup.
pub fn named_control_plane(name: &str, setup: Setup) -> &'static ControlPlane {
    type Started = &'static Result<ControlPlane, String>;
    static NAMED: Mutex<Vec<(String, Started)>> = Mutex::new(Vec::new());
    // Held while starting: a second caller for the same name waits for the same start.
    let mut named = NAMED.lock().unwrap_or_else(|e| e.into_inner());
    let started = match named.iter().find(|(n, _)| n == name) {
        Some((_, started)) => *started,
        None => {
            let started: Started = Box::leak(Box::new(start_on_thread(
                setup,
                &format!("control-plane-{name}"),
            )));
            named.push((name.to_string(), started));
            started
        }
    };
    drop(named);
    started_with(started, setup)
}

/// Starts a control plane with files in the work directory's `dir_name`, on a thread of its own
/// with its own runtime: the caller may be inside a runtime, and nothing runtime-bound may outlive
/// the start.
fn start_on_thread(setup: Setup, dir_name: &str) -> Result<ControlPlane, String> {
    let dir = procs::work_dir().join(dir_name);
    std::thread::Builder::new()
        .name("e2e-control-plane".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("build a tokio runtime: {e}"))?;
            runtime.block_on(start(setup, dir))
        })
        .map_err(|e| format!("spawn the control-plane thread: {e}"))
        .and_then(|t| {
            t.join()
                .unwrap_or_else(|_| Err("the control-plane start panicked".into()))
        })
        .inspect_err(|_| procs::mark_failed())
}

fn started_with(
    started: &'static Result<ControlPlane, String>,
    setup: Setup,
) -> &'static ControlPlane {
    match started {
        Ok(cp) => {
            assert_eq!(
                cp.setup, setup,
                "a control plane has one setup: this one was started with {:?}",
                cp.setup
            );
            cp
        }
        Err(e) => panic!("the test control plane did not start:\n{e}"),
    }
}

/// Loads a client from a kubeconfig file, in the current runtime.
pub async fn client_from_kubeconfig(path: &Path) -> Client {
    let config = config_from_kubeconfig(path).await;
    Client::try_from(config)
        .unwrap_or_else(|e| panic!("client from kubeconfig {}: {e}", path.display()))
}

async fn config_from_kubeconfig(path: &Path) -> Config {
    let kubeconfig = Kubeconfig::read_from(path)
        .unwrap_or_else(|e| panic!("read kubeconfig {}: {e}", path.display()));
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap_or_else(|e| panic!("load kubeconfig {}: {e}", path.display()))
}

impl ControlPlane {
    /// The admin (`system:masters`) kubeconfig, certificates embedded.
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// A new admin client, bound to the calling test's runtime.
    pub async fn admin_client(&self) -> Client {
        client_from_kubeconfig(&self.admin_kubeconfig).await
    }

    fn next_id(&self) -> u32 {
        self.counter.fetch_add(1, Ordering::SeqCst)
    }

    /// Creates a namespace with a name not used before in this control plane and returns the name.
    pub async fn fresh_namespace(&self) -> String {
        let name = format!("e2e-{}", self.next_id());
        let namespaces: Api<Namespace> = Api::all(self.admin_client().await);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some([("capi-e2e".to_string(), "true".to_string())].into()),
                ..Default::default()
            },
            ..Default::default()
        };
        namespaces
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
        name
    }

    /// A new client-certificate user (unique CN, no groups besides `system:authenticated`) bound by a
    /// ClusterRoleBinding to `cluster_role` only. Returns a client for it and its kubeconfig. Waits
    /// until the binding is in effect (the first rule of the role is allowed).
    pub async fn restricted_identity(&self, cluster_role: &str) -> (Client, PathBuf) {
        let user = format!("e2e-user-{}", self.next_id());
        let cert = self.ca.client_cert(&user, None);
        let kubeconfig = pki::write_private(
            &self.dir,
            &format!("{user}.kubeconfig"),
            &pki::kubeconfig(&self.server, &self.ca.cert_pem, &user, &cert),
        );
        let admin = self.admin_client().await;
        let binding = ClusterRoleBinding {
            metadata: ObjectMeta {
                name: Some(user.clone()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "ClusterRole".into(),
                name: cluster_role.into(),
            },
            subjects: Some(vec![Subject {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "User".into(),
                name: user.clone(),
                namespace: None,
            }]),
        };
        Api::<ClusterRoleBinding>::all(admin.clone())
            .create(&PostParams::default(), &binding)
            .await
            .unwrap_or_else(|e| panic!("create ClusterRoleBinding {user} → {cluster_role}: {e}"));
        wait_for_binding(&admin, &user, cluster_role).await;
        (client_from_kubeconfig(&kubeconfig).await, kubeconfig)
    }
}

/// RBAC bindings reach the authorizer through an informer: wait until the first rule of the role
/// is allowed for `user` (skipped when the role has no resource rule).
async fn wait_for_binding(admin: &Client, user: &str, cluster_role: &str) {
    let role = Api::<ClusterRole>::all(admin.clone())
        .get(cluster_role)
        .await
        .unwrap_or_else(|e| panic!("get ClusterRole {cluster_role}: {e}"));
    let Some(rule) = role
        .rules
        .unwrap_or_default()
        .into_iter()
        .find(|r| r.resources.as_ref().is_some_and(|v| !v.is_empty()))
    else {
        return;
    };
    let first = |v: &Option<Vec<String>>| v.as_ref().and_then(|v| v.first().cloned());
    let attributes = ResourceAttributes {
        group: first(&rule.api_groups),
        resource: first(&rule.resources),
        verb: rule.verbs.first().cloned(),
        name: first(&rule.resource_names),
        ..Default::default()
    };
    let reviews: Api<SubjectAccessReview> = Api::all(admin.clone());
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.into()),
            resource_attributes: Some(attributes),
            ..Default::default()
        },
        ..Default::default()
    };
    poll_until(
        &format!("ClusterRoleBinding {user} → {cluster_role} in effect"),
        Duration::from_secs(30),
        Duration::from_millis(50),
        || {
            let reviews = reviews.clone();
            let review = review.clone();
            async move {
                match reviews.create(&PostParams::default(), &review).await {
                    Ok(r) if r.status.as_ref().is_some_and(|s| s.allowed) => Check::Done(()),
                    Ok(r) => Check::Wait(format!("not allowed yet: {:?}", r.status)),
                    Err(e) => Check::Wait(e.to_string()),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Runs tests/upstream/build.sh (builds on first use, else answers at once) and returns its cache dir.
pub fn upstream_dir() -> Result<PathBuf, String> {
    upstream_build(&[], false)
}

/// tests/upstream/build.sh `what` (`kube-controller-manager`, or a pin of tests/upstream/k8s): its
/// cache dir, built on first use.
pub fn upstream_dir_of(what: &str) -> Result<PathBuf, String> {
    upstream_build(&[what], true)
}

fn upstream_build(args: &[&str], nice: bool) -> Result<PathBuf, String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/upstream/build.sh");
    procs::finished_cache_dir(&script, args, nice)
}

/// The Kubernetes releases pinned for the management-cluster matrix: each subdirectory of
/// tests/upstream/k8s with a go.mod (`v1.33`, `v1.37`), by name.
pub fn pinned_kubernetes() -> Vec<&'static str> {
    procs::pinned_subdirectories("tests/upstream/k8s")
        .into_iter()
        .map(|p| &*Box::leak(p.into_boxed_str()))
        .collect()
}

/// The bin/ a control plane runs from: the upstream cache's, or for a pinned Kubernetes one in `dir`
/// with the default build's etcd and the pin's kube-apiserver and kube-scheduler; and that
/// kube-apiserver's version.
fn control_plane_bin(
    upstream: &Path,
    pin: Option<&str>,
    dir: &Path,
) -> Result<(PathBuf, String), String> {
    let version = |built: &Path| {
        std::fs::read_to_string(built.join("k8s-version"))
            .map(|v| v.trim().to_string())
            .map_err(|e| format!("read {}/k8s-version: {e}", built.display()))
    };
    let Some(pin) = pin else {
        return Ok((upstream.join("bin"), version(upstream)?));
    };
    let pinned = upstream_dir_of(pin)?;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| format!("create {}: {e}", bin.display()))?;
    for (name, from) in [
        ("etcd", upstream),
        ("kube-apiserver", pinned.as_path()),
        ("kube-scheduler", pinned.as_path()),
    ] {
        let link = bin.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(from.join("bin").join(name), &link)
            .map_err(|e| format!("link {}: {e}", link.display()))?;
    }
    Ok((bin, version(&pinned)?))
}

async fn start(setup: Setup, dir: PathBuf) -> Result<ControlPlane, String> {
    let t0 = Instant::now();
    let upstream = upstream_dir()?;
    let (bin, kubernetes_version) = control_plane_bin(&upstream, setup.kubernetes, &dir)?;
    let t_upstream = t0.elapsed();
    let renamed_group = std::fs::read_to_string(upstream.join("renamed-group"))
        .map_err(|e| format!("read {}/renamed-group: {e}", upstream.display()))?
        .trim()
        .to_string();

    let extra_args: &[&str] = if setup.cache_consistency_checks {
        &[]
    } else {
        &["--feature-gates=DetectCacheInconsistency=false"]
    };
    let api = start_apiserver(&bin, &dir, "e2e", "10.0.0.0/24", extra_args).await?;
    let ApiServer {
        server,
        admin_kubeconfig,
        ca,
        etcd_log,
        apiserver_log,
        t_etcd,
        t_apiserver,
    } = api;

    let t_crds = Instant::now();
    let mut files = crds::files(&upstream, setup);
    files.push(crds::e2e_template_crd());
    let client = client_from_kubeconfig(&admin_kubeconfig).await;
    crds::install(&client, &files)
        .await
        .map_err(|e| failure(&e, &etcd_log, &apiserver_log))?;
    let timings = Timings {
        upstream: t_upstream,
        etcd: t_etcd,
        apiserver: t_apiserver,
        crds: t_crds.elapsed(),
        total: t0.elapsed(),
        crd_count: files.len(),
    };
    // Straight to the process's stderr, past libtest's output capture: always visible.
    let _ = writeln!(
        std::io::stderr(),
        "e2e: control plane {server} ({setup:?}) up in {:.1}s: upstream lookup {:.1}s, etcd {:.1}s, \
         kube-apiserver {:.1}s, {} CRDs {:.1}s; logs in {}",
        timings.total.as_secs_f64(),
        timings.upstream.as_secs_f64(),
        timings.etcd.as_secs_f64(),
        timings.apiserver.as_secs_f64(),
        timings.crd_count,
        timings.crds.as_secs_f64(),
        dir.display(),
    );
    Ok(ControlPlane {
        setup,
        server,
        upstream,
        bin,
        kubernetes_version,
        dir,
        renamed_group,
        etcd_log,
        apiserver_log,
        timings,
        admin_kubeconfig,
        ca,
        counter: AtomicU32::new(0),
    })
}

/// An etcd and kube-apiserver pair, up and kept until the test binary exits.
pub(super) struct ApiServer {
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    /// A `system:masters` kubeconfig, certificates embedded.
    pub admin_kubeconfig: PathBuf,
    /// The cluster's own CA (client certificates of further identities).
    pub ca: Ca,
    pub etcd_log: PathBuf,
    pub apiserver_log: PathBuf,
    pub t_etcd: Duration,
    pub t_apiserver: Duration,
}

/// Starts etcd and kube-apiserver (RBAC, client-certificate authentication, its own CA and
/// service-account keys) on free loopback ports, with files and logs in `dir`; waits until
/// `/readyz` answers ok. Used for the control plane and for the separate workload cluster.
pub(super) async fn start_apiserver(
    bin: &Path,
    dir: &Path,
    name: &str,
    service_cidr: &str,
    extra_args: &[&str],
) -> Result<ApiServer, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let ca = Ca::generate();
    let serving = ca.serving_cert(&format!("{name}-kube-apiserver"));
    let admin = ca.client_cert(&format!("{name}-admin"), Some("system:masters"));
    let (sa_key, sa_pub) = pki::service_account_key();
    let ca_file = pki::write_private(dir, "ca.crt", &ca.cert_pem);
    let tls_cert = pki::write_private(dir, "apiserver.crt", &serving.cert);
    let tls_key = pki::write_private(dir, "apiserver.key", &serving.key);
    let sa_key = pki::write_private(dir, "sa.key", &sa_key);
    let sa_pub = pki::write_private(dir, "sa.pub", &sa_pub);
    let etcd_log = dir.join("etcd.log");
    let apiserver_log = dir.join("kube-apiserver.log");

    // Free ports may be taken between choosing and binding: retry with new ones.
    let mut attempt = 0;
    loop {
        attempt += 1;
        let etcd_data = procs::scratch_dir();
        let (client_port, peer_port, secure_port) =
            (procs::free_port(), procs::free_port(), procs::free_port());
        let started = Instant::now();
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd_args: Vec<String> = vec![
            format!("--name={name}"),
            format!("--data-dir={}", etcd_data.display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster={name}={peer_url}"),
            "--unsafe-no-fsync".into(),
            "--log-level=warn".into(),
        ];
        let mut etcd = procs::spawn_logged(&bin.join("etcd"), &etcd_args, &etcd_log)
            .map_err(|e| format!("start etcd: {e}"))?;
        let etcd_ready = wait_etcd(&mut etcd, client_port, &etcd_log).await;
        if let Err(e) = etcd_ready {
            procs::kill_and_reap(&mut etcd);
            if attempt < 3 && procs::log_tail(&etcd_log, 4096).contains("address already in use") {
                continue;
            }
            return Err(failure(&e, &etcd_log, &apiserver_log));
        }
        let t_etcd = started.elapsed();

        let server = format!("https://127.0.0.1:{secure_port}");
        let mut apiserver_args: Vec<String> = vec![
            format!("--etcd-servers={etcd_url}"),
            // Tests read every version of an object back from etcd (invariant 2 over its whole
            // history); the apiserver's compaction (every 5 min by default) would drop them from
            // a longer run.
            "--etcd-compaction-interval=0".into(),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={secure_port}"),
            format!("--cert-dir={}", dir.display()),
            format!("--tls-cert-file={}", tls_cert.display()),
            format!("--tls-private-key-file={}", tls_key.display()),
            format!("--client-ca-file={}", ca_file.display()),
            "--authorization-mode=RBAC".into(),
            format!("--service-cluster-ip-range={service_cidr}"),
            format!("--service-account-issuer={server}"),
            format!("--service-account-key-file={}", sa_pub.display()),
            format!("--service-account-signing-key-file={}", sa_key.display()),
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition".into(),
            "--allow-privileged=true".into(),
            "--profiling=false".into(),
            // Nothing here could reach 127.0.0.1 as the `kubernetes` Service endpoint (loopback is
            // rejected, logged as an error every 10 s); no reconciler, no noise.
            "--endpoint-reconciler-type=none".into(),
            "--v=1".into(),
        ];
        apiserver_args.extend(extra_args.iter().map(|a| a.to_string()));
        if std::env::var_os("CAPI_E2E_AUDIT").is_some() {
            apiserver_args.extend(audit_args(dir));
        }
        let mut apiserver =
            match procs::spawn_logged(&bin.join("kube-apiserver"), &apiserver_args, &apiserver_log)
            {
                Ok(child) => child,
                Err(e) => {
                    procs::kill_and_reap(&mut etcd);
                    return Err(format!("start kube-apiserver: {e}"));
                }
            };
        let admin_kubeconfig = write_admin_kubeconfig(dir, &server, &ca, &admin, name);
        let ready = wait_apiserver(&mut apiserver, &admin_kubeconfig, &apiserver_log).await;
        if let Err(e) = ready {
            procs::kill_and_reap(&mut apiserver);
            procs::kill_and_reap(&mut etcd);
            if attempt < 3
                && procs::log_tail(&apiserver_log, 8192).contains("address already in use")
            {
                continue;
            }
            return Err(failure(&e, &etcd_log, &apiserver_log));
        }
        procs::keep_until_exit(etcd);
        procs::keep_until_exit(apiserver);
        return Ok(ApiServer {
            server,
            admin_kubeconfig,
            ca,
            etcd_log,
            apiserver_log,
            t_etcd,
            t_apiserver: started.elapsed() - t_etcd,
        });
    }
}

/// Starts a kube-scheduler (leader election off, loopback only) against the cluster of `kubeconfig`,
/// kept until the test binary exits.
pub(super) fn spawn_scheduler(bin: &Path, log: &Path, kubeconfig: &Path) -> Result<(), String> {
    let kubeconfig = kubeconfig.display().to_string();
    let args: Vec<String> = vec![
        format!("--kubeconfig={kubeconfig}"),
        format!("--authentication-kubeconfig={kubeconfig}"),
        format!("--authorization-kubeconfig={kubeconfig}"),
        "--leader-elect=false".into(),
        "--bind-address=127.0.0.1".into(),
        format!("--secure-port={}", procs::free_port()),
        "--v=1".into(),
    ];
    let child = procs::spawn_logged(&bin.join("kube-scheduler"), &args, log)
        .map_err(|e| format!("start kube-scheduler: {e}"))?;
    procs::keep_until_exit(child);
    Ok(())
}

fn write_admin_kubeconfig(
    dir: &Path,
    server: &str,
    ca: &Ca,
    admin: &pki::CertPem,
    name: &str,
) -> PathBuf {
    pki::write_private(
        dir,
        "admin.kubeconfig",
        &pki::kubeconfig(server, &ca.cert_pem, &format!("{name}-admin"), admin),
    )
}

fn failure(error: &str, etcd_log: &Path, apiserver_log: &Path) -> String {
    format!(
        "{error}\n--- etcd log {} (tail) ---\n{}\n--- kube-apiserver log {} (tail) ---\n{}",
        etcd_log.display(),
        procs::log_tail(etcd_log, 3000),
        apiserver_log.display(),
        procs::log_tail(apiserver_log, 6000),
    )
}

fn exited(child: &mut Child, name: &str, log: &Path) -> Option<String> {
    match child.try_wait() {
        Ok(Some(status)) => Some(format!(
            "{name} exited with {status}; log {}",
            log.display()
        )),
        Ok(None) => None,
        Err(e) => Some(format!("{name}: wait: {e}")),
    }
}

/// Polls etcd's /health over plain HTTP until it reports healthy.
async fn wait_etcd(etcd: &mut Child, port: u16, log: &Path) -> Result<(), String> {
    poll_until(
        "etcd /health",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || {
            let gone = exited(etcd, "etcd", log);
            async move {
                if let Some(gone) = gone {
                    return Check::Fatal(gone);
                }
                match etcd_health(port) {
                    Ok(body) if body.contains("\"health\":\"true\"") => Check::Done(()),
                    Ok(body) => Check::Wait(body),
                    Err(e) => Check::Wait(e.to_string()),
                }
            }
        },
    )
    .await
}

fn etcd_health(port: u16) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

/// Polls /readyz with the admin identity until it answers "ok" (all post-start hooks, RBAC bootstrap
/// and etcd checks included).
async fn wait_apiserver(
    apiserver: &mut Child,
    kubeconfig: &Path,
    log: &Path,
) -> Result<(), String> {
    let mut config = config_from_kubeconfig(kubeconfig).await;
    config.default_retry = false;
    config.connect_timeout = Some(Duration::from_secs(1));
    config.read_timeout = Some(Duration::from_secs(5));
    let client = Client::try_from(config).map_err(|e| format!("admin client: {e}"))?;
    poll_until(
        "kube-apiserver /readyz",
        Duration::from_secs(120),
        Duration::from_millis(100),
        || {
            let gone = exited(apiserver, "kube-apiserver", log);
            let client = client.clone();
            async move {
                if let Some(gone) = gone {
                    return Check::Fatal(gone);
                }
                let request = http::Request::get("/readyz")
                    .body(Vec::new())
                    .expect("a GET request");
                match client.request_text(request).await {
                    Ok(body) if body.trim() == "ok" => Check::Done(()),
                    Ok(body) => Check::Wait(body),
                    Err(e) => Check::Wait(e.to_string()),
                }
            }
        },
    )
    .await
}

/// With `CAPI_E2E_AUDIT` set: an audit log of every write to Cluster API's scalable objects and
/// Machines (`audit.log` beside the apiserver's log, kept with `CAPI_E2E_KEEP`), the timeline a
/// failed real-CAPI run is read from: which write came when, from whom, over which version.
fn audit_args(dir: &Path) -> Vec<String> {
    let policy = dir.join("audit-policy.yaml");
    let text = r#"apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Request
  verbs: [create, update, patch, delete]
  resources:
  - group: cluster.x-k8s.io
    resources: [machines, machinesets, machinedeployments, machinepools]
- level: None
"#;
    if let Err(e) = std::fs::write(&policy, text) {
        eprintln!("audit policy {}: {e}", policy.display());
        return Vec::new();
    }
    vec![
        format!("--audit-policy-file={}", policy.display()),
        format!("--audit-log-path={}", dir.join("audit.log").display()),
        "--audit-log-maxsize=0".into(),
    ]
}
