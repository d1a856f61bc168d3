//! deploy/ run, not just validated: each kustomize overlay and each Helm values file is rendered (kustomize,
//! the official chart with a real `helm template`), every rendered object is applied to the test apiserver,
//! and every container of the rendered pods is started as a local process by the test kubelet
//! (tests/support/kubelet.rs: the image's program at its path in its own root, the manifest's args and env,
//! ConfigMap/Secret volumes with their modes and fsGroup ownership, the pod's user and groups, a
//! ServiceAccount token from the TokenRequest API). The provider binary is the one cargo built; CA is the
//! pinned release.
//!
//! Each variant asserts: the provider becomes ready under exactly the rendered RBAC (its ServiceAccount's
//! token, no other binding); the real CA reads its cloud-config from the ConfigMap, completes its loop through
//! the provider (its `last_activity{activity="main"}` moves, its status ConfigMap appears) and scales a
//! MachineDeployment up from zero for a pending pod; nothing is refused by RBAC; TLS/mTLS between them is as
//! configured. Each variant names its Cluster where the packaging has the placeholder (as an operator
//! must); left as is, the provider stops at start saying what to set. Variants share cluster-scoped names
//! and kube-system, so they run one at a time.

pub mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use serde_json::Value;
use support::capi::{Capi, Kind, Scalable};
use support::kubelet::{Kubelet, PortMap, RunningPod};
use support::procs::{self, Check, poll_until};
use support::real_capi::CAPACITY;
use support::render::{self, expected_ca_image, expected_provider_image};
use support::workload::{self, PodSpec};
use support::workload_cluster::workload_cluster;
use support::{CAPI_GROUP, ControlPlane, Setup};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// Variants share cluster-scoped objects and kube-system: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const CA_REPOSITORY: &str = "registry.k8s.io/autoscaling/cluster-autoscaler";
const PROVIDER_IMAGE_NAME: &str = "capi-autoscaler-provider";
/// The ports the manifests name: CA's metrics, the provider's gRPC and HTTP.
const PORTS: [u16; 3] = [8085, 8086, 8087];
/// CA's default scan interval is 10 s and its leader election takes a moment: room for a few loops.
const LOOP: Duration = Duration::from_secs(90);

/// Where the scaled group and the pending pod live.
enum Topology {
    /// One cluster: CAPI objects, Nodes and Pods together.
    Single,
    /// CA in the management cluster (the control plane), Pods and Nodes in a separate workload cluster
    /// whose kubeconfig is the Secret `<cluster>-kubeconfig` in the install namespace, as Cluster API
    /// writes it; the node group belongs to Cluster `cluster` in that namespace.
    Management { cluster: &'static str },
}

struct Variant {
    name: &'static str,
    /// The rendered objects.
    objects: Vec<Value>,
    topology: Topology,
}

/// Applies `objects` with kubectl (server-side, as `kubectl apply -k` / `helm install` would create them)
/// and deletes them again when dropped, with everything else the run left (the node group, the pending
/// pod, CA's Lease and status ConfigMap).
struct Applied {
    file: PathBuf,
    kubeconfig: PathBuf,
    cleanups: Vec<(PathBuf, Vec<String>)>,
}

impl Applied {
    fn apply(cp: &ControlPlane, name: &str, objects: &[Value]) -> Applied {
        Applied::apply_as(cp, name, objects, "e2e-install")
    }

    /// [`Applied::apply`] with field manager `manager` (one per Helm release, as each `helm install`
    /// owns its objects): an object another manager set differently is a conflict, and fails.
    fn apply_as(cp: &ControlPlane, name: &str, objects: &[Value], manager: &str) -> Applied {
        let file = procs::work_dir().join(format!("{name}.rendered.yaml"));
        let text: String = objects
            .iter()
            .map(|o| format!("---\n{}", serde_norway::to_string(o).expect("YAML")))
            .collect();
        std::fs::write(&file, text).expect("write the rendered objects");
        let kubeconfig = cp.admin_kubeconfig().to_path_buf();
        let out = kubectl(
            &kubeconfig,
            &[
                "apply",
                "--server-side",
                &format!("--field-manager={manager}"),
                "-f",
                &path(&file),
            ],
        );
        eprintln!("e2e: {name}: applied\n{out}");
        Applied {
            file,
            kubeconfig,
            cleanups: Vec::new(),
        }
    }

    /// Also run `kubectl ARGS` with `kubeconfig` at the end.
    fn cleanup(&mut self, kubeconfig: &Path, args: &[&str]) {
        self.cleanups.push((
            kubeconfig.to_path_buf(),
            args.iter().map(|s| s.to_string()).collect(),
        ));
    }
}

impl Drop for Applied {
    fn drop(&mut self) {
        let file = path(&self.file);
        let mut all = vec![(
            self.kubeconfig.clone(),
            vec![
                "delete".to_string(),
                "--ignore-not-found".into(),
                "--wait=false".into(),
                "-f".into(),
                file,
            ],
        )];
        all.append(&mut self.cleanups);
        for (kubeconfig, args) in all {
            let _ = std::process::Command::new("kubectl")
                .arg("--kubeconfig")
                .arg(&kubeconfig)
                .args(&args)
                .stdin(std::process::Stdio::null())
                .output();
        }
    }
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

fn kubectl(kubeconfig: &Path, args: &[&str]) -> String {
    let kubeconfig = path(kubeconfig);
    let all: Vec<&str> = ["--kubeconfig", kubeconfig.as_str()]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    render::run(Path::new("kubectl"), &all)
}

/// The stored pod template of Deployment `namespace/name`: what the ReplicaSet controller would copy into
/// the pod, defaults applied by the apiserver.
async fn stored_pod_spec(client: &Client, namespace: &str, name: &str) -> Value {
    let d = Api::<Deployment>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .unwrap_or_else(|e| panic!("get Deployment {namespace}/{name}: {e}"));
    serde_json::to_value(d).expect("a Deployment as JSON")["spec"]["template"]["spec"].clone()
}

/// Service names in the rendered objects, as cluster DNS answers them.
fn service_names(objects: &[Value]) -> Vec<String> {
    render::all(objects, "Service")
        .into_iter()
        .flat_map(|s| {
            let name = s["metadata"]["name"].as_str().unwrap_or_default();
            let ns = s["metadata"]["namespace"].as_str().unwrap_or_default();
            [
                name.to_string(),
                format!("{name}.{ns}"),
                format!("{name}.{ns}.svc"),
                format!("{name}.{ns}.svc.cluster.local"),
            ]
        })
        .collect()
}

/// Every image the pods name resolves to a real registry path: CA's is the official one at the pinned
/// default version, the provider's the image `make image` builds.
fn assert_images(objects: &[Value]) {
    for d in render::all(objects, "Deployment") {
        for c in render::containers(&d["spec"]["template"]["spec"]) {
            let image = c["image"].as_str().unwrap_or_default();
            let (repository, _) = support::kubelet::split_image(image);
            if repository == CA_REPOSITORY {
                assert_eq!(image, expected_ca_image(), "{}", d["metadata"]["name"]);
            } else {
                assert_eq!(repository, PROVIDER_IMAGE_NAME, "unexpected image {image}");
                assert_eq!(image, expected_provider_image());
            }
        }
    }
}

/// Creates namespace `name` (ignoring that it exists).
async fn ensure_namespace(client: &Client, name: &str) {
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        ..Default::default()
    };
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("create namespace {name}: {e}"),
    }
}

/// Waits until the scheduler has marked pod `ns/name` unschedulable (`PodScheduled` False).
async fn wait_unschedulable(client: &Client, ns: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    poll_until(
        &format!("pod {ns}/{name} marked unschedulable"),
        Duration::from_secs(30),
        Duration::from_millis(100),
        || {
            let pods = pods.clone();
            async move {
                let pod = match pods.get(name).await {
                    Ok(pod) => pod,
                    Err(e) => return Check::Wait(e.to_string()),
                };
                let unschedulable = pod
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "PodScheduled" && c.status == "False");
                if unschedulable {
                    Check::Done(())
                } else {
                    Check::Wait("not marked yet".into())
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Panics with `message` and every container's log.
fn fail(variant: &str, pods: &[RunningPod], message: &str) -> ! {
    let logs: String = pods
        .iter()
        .map(|p| format!("{}\n{}", p.summary(), p.logs()))
        .collect();
    panic!("variant {variant}: {message}\n{logs}")
}

/// The test kubelet makes mount namespaces, chroots and switches users: only root may.
fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "tests/manifests.rs runs each container in its own mount namespace and root as the pod's user, \
         as a container runtime does: it must run as root (CI and the development machines do)"
    );
}

async fn run(mut variant: Variant) {
    require_root();
    let started = Instant::now();
    // The operator names their Cluster where the packaging has the placeholder (the kind + CAPD values
    // name the quickstart's own); each single-cluster variant's group is of a Cluster of its own.
    let cluster = match variant.topology {
        Topology::Single => variant.name,
        Topology::Management { cluster } => cluster,
    };
    render::name_cluster(&mut variant.objects, cluster);
    let cp = support::control_plane(Setup::shipped());
    let admin = cp.admin_client().await;
    assert_images(&variant.objects);

    if !render::all(&variant.objects, "Certificate").is_empty() {
        support::crds::install(
            &admin,
            &[render::repo("tests/fixtures/cert-manager-crds.yaml")],
        )
        .await
        .expect("install the cert-manager stand-in CRDs");
    }
    let mut applied = Applied::apply(cp, variant.name, &variant.objects);

    // Certificates: what cert-manager would write.
    let certificates: Vec<Value> = variant
        .objects
        .iter()
        .filter(|o| o["kind"] == "Certificate" || o["kind"] == "Issuer")
        .cloned()
        .collect();
    let issued = if certificates.is_empty() {
        None
    } else {
        let ns = certificates[0]["metadata"]["namespace"]
            .as_str()
            .unwrap_or("kube-system")
            .to_string();
        Some(support::cert_manager::issue(&admin, &ns, &certificates).await)
    };

    // Where CA's Pods, Nodes, status and Lease are, and where the node group is.
    let deployments: Vec<(String, String)> = render::all(&variant.objects, "Deployment")
        .iter()
        .map(|d| {
            (
                d["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                d["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect();
    let install_ns = deployments[0].0.clone();
    let (pods_client, pods_kubeconfig, group_ns, cluster_name, pod_ns) = match variant.topology {
        Topology::Single => {
            support::autoscaler::ensure_scheduler(cp);
            let ns = cp.fresh_namespace().await;
            (
                admin.clone(),
                cp.admin_kubeconfig().to_path_buf(),
                ns.clone(),
                cluster,
                ns,
            )
        }
        Topology::Management { cluster } => {
            let w = workload_cluster(cp);
            // What Cluster API writes for every Cluster: its admin kubeconfig, key `value`.
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(format!("{cluster}-kubeconfig")),
                    namespace: Some(install_ns.clone()),
                    labels: Some(
                        [(format!("{CAPI_GROUP}/cluster-name"), cluster.to_string())].into(),
                    ),
                    ..Default::default()
                },
                type_: Some("cluster.x-k8s.io/secret".into()),
                string_data: Some([("value".to_string(), w.admin_kubeconfig_text.clone())].into()),
                ..Default::default()
            };
            Api::<Secret>::namespaced(admin.clone(), &install_ns)
                .create(&PostParams::default(), &secret)
                .await
                .unwrap_or_else(|e| panic!("create the {cluster}-kubeconfig Secret: {e}"));
            applied.cleanup(
                cp.admin_kubeconfig(),
                &[
                    "-n",
                    &install_ns,
                    "delete",
                    "secret",
                    &format!("{cluster}-kubeconfig"),
                ],
            );
            let client = support::client_from_kubeconfig(&w.admin_kubeconfig).await;
            let pod_ns = format!("e2e-{}", variant.name);
            ensure_namespace(&client, &pod_ns).await;
            (
                client,
                w.admin_kubeconfig.clone(),
                install_ns.clone(),
                cluster,
                pod_ns,
            )
        }
    };
    // CA's Lease and status: in the install namespace, or kube-system where the values keep them there
    // (values-kind-capd.yaml, as the in-tree chart's kubeconfig-incluster mode does).
    for ns in [install_ns.as_str(), "kube-system"] {
        applied.cleanup(
            &pods_kubeconfig,
            &[
                "-n",
                ns,
                "delete",
                "lease,configmap",
                "cluster-autoscaler",
                "cluster-autoscaler-status",
                "--ignore-not-found",
            ],
        );
    }
    applied.cleanup(
        &pods_kubeconfig,
        &[
            "-n",
            &pod_ns,
            "delete",
            "pods,replicasets",
            "--all",
            "--grace-period=0",
            "--force",
        ],
    );

    // A node group at zero whose template fits only this run's pod.
    let capi = Capi::new(admin.clone(), &group_ns, CAPI_GROUP, "v1beta2");
    let md_name = format!("md-{}", variant.name);
    let mut md = Scalable::md(&md_name)
        .bounds(0, 2)
        .replicas(0)
        .annotation(&format!("{CAPACITY}/cpu"), "2")
        .annotation(&format!("{CAPACITY}/memory"), "4Gi")
        .annotation(&format!("{CAPACITY}/maxPods"), "110")
        .annotation(
            &format!("{CAPACITY}/labels"),
            &workload::scenario_labels(&pod_ns, &[]),
        );
    md = md.cluster(cluster_name);
    capi.create_deployment(&md, false).await;
    applied.cleanup(
        cp.admin_kubeconfig(),
        &[
            "-n",
            &group_ns,
            "delete",
            &format!("machinedeployments.{CAPI_GROUP},machinesets.{CAPI_GROUP}"),
            &md_name,
            &Capi::set_of(&md_name),
            "--ignore-not-found",
        ],
    );
    // Pending, and marked unschedulable by the scheduler, before CA starts: CA's first loop has a reason
    // to scale.
    workload::create_pod(&pods_client, &pod_ns, &PodSpec::new("web", "500m", "256Mi")).await;
    wait_unschedulable(&pods_client, &pod_ns, "web").await;

    let kubelet = Kubelet {
        client: admin.clone(),
        server: cp.server.clone(),
        ca_pem: std::fs::read_to_string(cp.dir.join("ca.crt")).expect("the control plane's CA"),
        ports: PortMap::fresh(&PORTS),
        hosts: service_names(&variant.objects),
    };

    // The provider's pods first (standalone), CA's last.
    let mut order = deployments.clone();
    let runs_ca = |(ns, name): &(String, String)| {
        render::all(&variant.objects, "Deployment").iter().any(|d| {
            d["metadata"]["namespace"] == ns.as_str()
                && d["metadata"]["name"] == name.as_str()
                && render::containers(&d["spec"]["template"]["spec"])
                    .iter()
                    .any(|c| {
                        c["image"]
                            .as_str()
                            .unwrap_or_default()
                            .starts_with(CA_REPOSITORY)
                    })
        })
    };
    order.sort_by_key(runs_ca);
    // What the ReplicaSet controller would create: each pod, admitted by the API server (a dry run, so
    // the admission plugins run) with the priority of its priorityClassName, system-cluster-critical.
    for (ns, name) in &order {
        let spec = stored_pod_spec(&admin, ns, name).await;
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("{name}-admission")},
            "spec": spec,
        }))
        .expect("a Pod of the stored template");
        let dry_run = PostParams {
            dry_run: true,
            ..Default::default()
        };
        let admitted = Api::<Pod>::namespaced(admin.clone(), ns)
            .create(&dry_run, &pod)
            .await
            .unwrap_or_else(|e| panic!("{}: the pod of {ns}/{name} is refused: {e}", variant.name));
        let priority = admitted.spec.and_then(|s| s.priority);
        assert_eq!(
            priority,
            Some(2_000_000_000),
            "{}: the pod of {ns}/{name} runs without the autoscaler's priority",
            variant.name
        );
    }
    let mut pods: Vec<RunningPod> = Vec::new();
    for (ns, name) in &order {
        let spec = stored_pod_spec(&admin, ns, name).await;
        let mut pod = kubelet.run_pod(ns, &format!("{name}-e2e"), &spec).await;
        if let Err(e) = pod.wait_ready(Duration::from_secs(60)).await {
            panic!("{e}\n{}", pod.summary());
        }
        pods.push(pod);
    }

    // TLS as configured between the provider and CA.
    if let Some(issued) = &issued {
        check_mutual_tls(&pods, issued, &kubelet).await;
    }

    // CA: its first main loop, through the provider.
    let ca_pod = pods
        .iter()
        .position(|p| {
            p.containers
                .iter()
                .any(|c| c.image.starts_with(CA_REPOSITORY))
        })
        .expect("a pod runs cluster-autoscaler");
    let ca = pods[ca_pod].by_image(CA_REPOSITORY);
    let ca_started = ca.started;
    let ca_address = render::flag(&ca.argv, "--address").expect("CA's --address");
    // Where CA keeps its status ConfigMap (and Lease) in the cluster it watches: its last --namespace.
    let ca_ns = render::flag(&ca.argv, "--namespace").unwrap_or_else(|| install_ns.clone());
    let first = poll_until(
        "CA's first main loop (cluster_autoscaler_last_activity{activity=\"main\"})",
        LOOP,
        Duration::from_millis(200),
        || {
            let alive = pods.iter_mut().try_for_each(RunningPod::check_alive);
            let address = ca_address.clone();
            async move {
                if let Err(e) = alive {
                    return Check::Fatal(e);
                }
                let text = support::autoscaler::http_get(&address, "/metrics").await;
                let sum = support::autoscaler::metric_sum(
                    &text.unwrap_or_default(),
                    "cluster_autoscaler_last_activity",
                    &[("activity", "main")],
                );
                if sum > 0.0 {
                    Check::Done(sum)
                } else {
                    Check::Wait("no main loop yet".into())
                }
            }
        },
    )
    .await;
    let first_activity = match first {
        Ok(v) => v,
        Err(e) => fail(variant.name, &pods, &e),
    };
    let first_loop = ca_started.elapsed();

    // The loop reached the provider: the group was scaled up from zero for the pending pod.
    let scaled = poll_until(
        &format!("MachineDeployment {group_ns}/{md_name} scaled 0 → 1 by CA through the provider"),
        LOOP,
        Duration::from_millis(200),
        || {
            let alive = pods.iter_mut().try_for_each(RunningPod::check_alive);
            let capi = &capi;
            let md_name = &md_name;
            async move {
                if let Err(e) = alive {
                    return Check::Fatal(e);
                }
                match capi.replicas(Kind::MachineDeployment, md_name).await {
                    1 => Check::Done(()),
                    n => Check::Wait(format!("replicas {n}")),
                }
            }
        },
    )
    .await;
    if let Err(e) = scaled {
        fail(variant.name, &pods, &e);
    }
    let scaled_up = ca_started.elapsed();
    // CA records the Event after the write that scaled, asynchronously: it may land a moment later.
    let event = poll_until(
        "CA's TriggeredScaleUp Event on the pod",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            let pods_client = &pods_client;
            let pod_ns = &pod_ns;
            async move {
                let reasons = workload::pod_event_reasons(pods_client, pod_ns, "web").await;
                if reasons.iter().any(|r| r == "TriggeredScaleUp") {
                    Check::Done(())
                } else {
                    Check::Wait(format!("reasons {reasons:?}"))
                }
            }
        },
    )
    .await;
    if let Err(e) = event {
        fail(variant.name, &pods, &e);
    }

    // The provider recorded who asked for the change on the group, and its metrics, scraped where the
    // packaging's monitoring scrapes them (the values' Service for the chart's ServiceMonitor, the
    // PodMonitor of deploy/monitoring for the overlays), count the write and show the new size.
    let recorded = poll_until(
        "the provider's ReplicasChanged Event on the MachineDeployment",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            let capi = &capi;
            let md_name = &md_name;
            async move {
                let events = capi.events_about(md_name).await;
                match events
                    .iter()
                    .find(|e| e.reason.as_deref() == Some("ReplicasChanged"))
                {
                    Some(e) => Check::Done((
                        e.type_.clone(),
                        e.note.clone(),
                        e.reporting_instance.clone(),
                    )),
                    None => Check::Wait(format!("{} other Events", events.len())),
                }
            }
        },
    )
    .await;
    // The Event names the pod that wrote (POD_NAME from the downward API in every packaging).
    let provider_pod = pods
        .iter()
        .find(|p| {
            p.containers
                .iter()
                .any(|c| c.image.starts_with(PROVIDER_IMAGE_NAME))
        })
        .map(|p| p.name.clone())
        .expect("a pod runs the provider");
    match recorded {
        Ok((Some(kind), Some(note), Some(instance)))
            if kind == "Normal"
                && note == "replicas 0 → 1 for cluster-autoscaler IncreaseSize"
                && instance == provider_pod => {}
        Ok(other) => fail(
            variant.name,
            &pods,
            &format!("ReplicasChanged Event {other:?}"),
        ),
        Err(e) => fail(variant.name, &pods, &e),
    }
    let provider_port = provider_scrape_port(&variant.objects);
    let scrape_port = kubelet.ports.get(provider_port);
    let provider_metrics =
        support::autoscaler::http_get(&format!("127.0.0.1:{scrape_port}"), "/metrics")
            .await
            .unwrap_or_default();
    let provider_value = |name: &str, labels: &[(&str, &str)]| {
        support::autoscaler::metric_sum(
            &provider_metrics,
            &format!("capi_autoscaler_provider_{name}"),
            labels,
        )
    };
    let group_id = format!("MachineDeployment/{group_ns}/{md_name}");
    let write = [("operation", "increase-size"), ("outcome", "ok")];
    let seen = (
        provider_value("api_writes_total", &write),
        provider_value("api_write_duration_seconds_count", &write),
        provider_value("node_group_target_size", &[("node_group", &group_id)]),
        provider_value("ready", &[]),
    );
    if seen != (1.0, 1.0, 1.0, 1.0) {
        fail(
            variant.name,
            &pods,
            &format!(
                "the provider's metrics on port {scrape_port}: writes, their latency count, the \
                 group's target, ready = {seen:?}, want 1 each"
            ),
        );
    }

    // `kubectl exec … -c provider -- /capi-autoscaler-provider check` (the README's way to see what CA sees)
    // works in the pod: it reaches the same clusters as `serve` and shows the group.
    let provider = pods
        .iter()
        .flat_map(|p| p.containers.iter())
        .find(|c| c.image.starts_with(PROVIDER_IMAGE_NAME))
        .expect("a provider container");
    let program = provider.argv[0].clone();
    let check = provider.exec(&[&program, "check"]).await;
    let check_out = String::from_utf8_lossy(&check.stdout).into_owned();
    let group = format!("MachineDeployment/{group_ns}/{md_name}");
    let Some(check_line) = check_out
        .lines()
        .find(|l| l.starts_with(&group))
        .filter(|_| check.status.success())
    else {
        fail(
            variant.name,
            &pods,
            &format!(
                "`check` in the provider container ({}) does not show {group}:\n{check_out}{}",
                check.status,
                String::from_utf8_lossy(&check.stderr)
            ),
        );
    };
    let check_line = check_line.split_whitespace().collect::<Vec<_>>().join(" ");

    // The main loop keeps running, and CA's status ConfigMap is in its namespace of the cluster it watches.
    let ca_address2 = ca_address.clone();
    let moved = poll_until(
        "CA's last_activity{activity=\"main\"} moves again",
        LOOP,
        Duration::from_millis(200),
        || {
            let address = ca_address2.clone();
            async move {
                let text = support::autoscaler::http_get(&address, "/metrics").await;
                let now = support::autoscaler::metric_sum(
                    &text.unwrap_or_default(),
                    "cluster_autoscaler_last_activity",
                    &[("activity", "main")],
                );
                if now > first_activity {
                    Check::Done(())
                } else {
                    Check::Wait(format!("still {now}"))
                }
            }
        },
    )
    .await;
    if let Err(e) = moved {
        fail(variant.name, &pods, &e);
    }
    let status = Api::<ConfigMap>::namespaced(pods_client.clone(), &ca_ns)
        .get_opt(support::autoscaler::STATUS_CONFIGMAP)
        .await
        .ok()
        .flatten();
    if status.is_none() {
        fail(
            variant.name,
            &pods,
            &format!("CA's status ConfigMap in {ca_ns} of the cluster it watches"),
        );
    }
    if matches!(variant.topology, Topology::Management { .. }) {
        // Not in the management cluster: CA watches the workload cluster only.
        let wrong = Api::<ConfigMap>::namespaced(admin.clone(), &ca_ns)
            .get_opt(support::autoscaler::STATUS_CONFIGMAP)
            .await
            .ok()
            .flatten();
        if wrong.is_some() {
            fail(
                variant.name,
                &pods,
                "CA wrote its status into the management cluster",
            );
        }
    }
    // `kubectl exec … -c provider -- /capi-autoscaler-provider explain NS/POD` (README "Troubleshoot"),
    // as the pod's ServiceAccount under exactly the rendered RBAC: CA's verdict from the pod's Events and
    // its status ConfigMap read, the group CA named marked.
    let explained = provider
        .exec(&[&program, "explain", &format!("{pod_ns}/web"), "-o", "json"])
        .await;
    let explain_out = String::from_utf8_lossy(&explained.stdout).into_owned();
    let explanation: Value = serde_json::from_str(&explain_out).unwrap_or_default();
    let verdict = explanation["verdict"]["kind"].as_str().unwrap_or_default();
    let status_read =
        explanation["status"]["unreadable"].is_null() && !explanation["status"].is_null();
    if !explained.status.success() || verdict != "scale_up_triggered" || !status_read {
        fail(
            variant.name,
            &pods,
            &format!(
                "`explain {pod_ns}/web` in the provider container ({}): verdict {verdict:?}, CA's status \
                 read: {status_read}\n{explain_out}{}",
                explained.status,
                String::from_utf8_lossy(&explained.stderr)
            ),
        );
    }

    let metrics = support::autoscaler::http_get(&ca_address, "/metrics")
        .await
        .unwrap_or_default();
    let node_groups = support::autoscaler::metric_sum(
        &metrics,
        "cluster_autoscaler_node_groups_count",
        &[("node_group_type", "autoscaled")],
    );

    // Nothing refused: every permission the programs used is in the rendered RBAC. And lists: the
    // control plane streams them, the workload cluster has WatchList off, so exactly the provider's
    // Node watch there must have fallen back to pages.
    let mut fallbacks: Vec<String> = Vec::new();
    for pod in &pods {
        for c in &pod.containers {
            let log = std::fs::read_to_string(&c.log).unwrap_or_default();
            if let Some(line) = log.lines().find(|l| l.contains("forbidden")) {
                fail(
                    variant.name,
                    &pods,
                    &format!("container {} was refused by RBAC: {line}", c.name),
                );
            }
            fallbacks.extend(
                log.lines()
                    .filter(|l| l.contains("does not stream initial lists"))
                    .map(str::to_string),
            );
            if let (Some(limit), Some(peak)) = (c.memory_limit, c.peak_rss())
                && peak > limit
            {
                fail(
                    variant.name,
                    &pods,
                    &format!(
                        "container {} peaked at {peak} bytes, over its limit {limit}",
                        c.name
                    ),
                );
            }
        }
    }
    let only_nodes = !fallbacks.is_empty() && fallbacks.iter().all(|l| l.contains("nodes"));
    let expected_fallback = matches!(variant.topology, Topology::Management { .. });
    if (expected_fallback && !only_nodes) || (!expected_fallback && !fallbacks.is_empty()) {
        fail(
            variant.name,
            &pods,
            &format!(
                "paginated-list fallbacks {fallbacks:?}; expected {}",
                if expected_fallback {
                    "the Node watch of the workload cluster alone"
                } else {
                    "none: every list streamed"
                }
            ),
        );
    }

    let summaries: Vec<String> = pods.iter().map(RunningPod::summary).collect();
    procs::announce(&format!(
        "e2e: manifests {}: {}\n  CA's first main loop {:.1}s after its start; {} autoscaled node group(s); \
         pending pod → {group_ns}/{md_name} replicas 0 → 1 {:.1}s after CA's start (TriggeredScaleUp); \
         status ConfigMap {ca_ns}/{}; `check` in the provider container: {check_line}; \
         ReplicasChanged Event \"replicas 0 → 1 for cluster-autoscaler IncreaseSize\" by {provider_pod}; \
         `explain` in the provider container as the pod's ServiceAccount: {verdict}; pods admitted with \
         priority system-cluster-critical; provider \
         metrics scraped on container port {provider_port} where the packaging's monitoring does; \
         variant done in {:.1}s",
        variant.name,
        summaries.join("\n  "),
        first_loop.as_secs_f64(),
        node_groups,
        scaled_up.as_secs_f64(),
        support::autoscaler::STATUS_CONFIGMAP,
        started.elapsed().as_secs_f64(),
    ));
    drop(pods);
    drop(applied);
}

/// The container port the packaging's monitoring scrapes the provider on: the port of the values'
/// Service for the provider (labelled `app.kubernetes.io/component: capi-autoscaler-provider`), which the
/// chart's ServiceMonitor selects, or else the port deploy/monitoring's PodMonitor names.
fn provider_scrape_port(objects: &[Value]) -> u16 {
    let service = render::all(objects, "Service").into_iter().find(|s| {
        s["metadata"]["labels"]["app.kubernetes.io/component"] == "capi-autoscaler-provider"
    });
    let port = match service {
        Some(service) => service["spec"]["ports"][0]["targetPort"].clone(),
        None => {
            let monitoring = render::kustomize("deploy/monitoring");
            let monitor = render::find(&monitoring, "PodMonitor", "capi-autoscaler-provider");
            monitor["spec"]["podMetricsEndpoints"][0]["port"].clone()
        }
    };
    render::all(objects, "Deployment")
        .iter()
        .flat_map(|d| render::containers(&d["spec"]["template"]["spec"]))
        .filter(|c| {
            c["image"]
                .as_str()
                .is_some_and(|i| i.starts_with(PROVIDER_IMAGE_NAME))
        })
        .flat_map(|c| c["ports"].as_array().into_iter().flatten())
        .find(|p| p["name"] == port || p["containerPort"] == port)
        .and_then(|p| p["containerPort"].as_u64())
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or_else(|| panic!("no provider container port {port}"))
}

/// The standalone provider speaks TLS only, and only to clients with a certificate from its CA: plaintext
/// and certificate-less TLS are refused, the client certificate CA mounts is accepted, for the Service name
/// in CA's cloud-config.
async fn check_mutual_tls(
    pods: &[RunningPod],
    issued: &support::cert_manager::Issued,
    kubelet: &Kubelet,
) {
    let provider = pods
        .iter()
        .flat_map(|p| p.containers.iter())
        .find(|c| c.image.starts_with(PROVIDER_IMAGE_NAME))
        .expect("a provider container");
    let address = render::flag(&provider.argv, "--address").expect("the provider's --address");
    let server = issued
        .secrets
        .get("capi-autoscaler-provider-server-cert")
        .expect("the server certificate");
    let client = issued
        .secrets
        .get("cluster-autoscaler-grpc-client-cert")
        .expect("the client certificate");
    let host = "capi-autoscaler-provider";
    assert!(server.names.iter().any(|n| n == host), "{:?}", server.names);
    assert!(kubelet.hosts.iter().any(|n| n == host));
    let port = address.rsplit_once(':').expect("host:port").1;
    let health = |tls: Option<ClientTlsConfig>| {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://127.0.0.1:{port}"))
            .expect("an endpoint")
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(3));
        if let Some(tls) = tls {
            endpoint = endpoint.tls_config(tls).expect("a TLS config");
        }
        support::provider::health_status(endpoint, "")
    };
    let ca = || Certificate::from_pem(&server.ca);
    assert!(
        health(None).await.is_err(),
        "plaintext gRPC must be refused"
    );
    let no_cert = ClientTlsConfig::new()
        .ca_certificate(ca())
        .domain_name(host);
    assert!(
        health(Some(no_cert)).await.is_err(),
        "TLS without a client certificate must be refused (mTLS)"
    );
    let with_cert = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&client.ca))
        .identity(Identity::from_pem(&client.cert, &client.key))
        .domain_name(host);
    let status = health(Some(with_cert)).await;
    assert!(
        matches!(
            status,
            Ok(tonic_health::pb::health_check_response::ServingStatus::Serving)
        ),
        "mTLS with CA's client certificate: {status:?}"
    );
}

#[tokio::test]
async fn the_sidecar_overlay_runs_and_scales() {
    let _serial = SERIAL.lock().await;
    run(Variant {
        name: "sidecar-overlay",
        objects: render::kustomize("deploy/overlays/sidecar"),
        topology: Topology::Single,
    })
    .await;
}

#[tokio::test]
async fn the_standalone_overlay_runs_with_mutual_tls_and_scales() {
    let _serial = SERIAL.lock().await;
    run(Variant {
        name: "standalone-overlay",
        objects: render::kustomize("deploy/overlays/standalone"),
        topology: Topology::Single,
    })
    .await;
}

#[tokio::test]
async fn the_helm_sidecar_values_run_and_scale() {
    let _serial = SERIAL.lock().await;
    run(Variant {
        name: "helm-sidecar",
        objects: render::provider_template("cluster-autoscaler", "kube-system", &[], &[]),
        topology: Topology::Single,
    })
    .await;
}

#[tokio::test]
async fn the_helm_kind_capd_values_watch_the_workload_cluster_and_scale() {
    let _serial = SERIAL.lock().await;
    run(Variant {
        name: "helm-kind-capd",
        objects: render::provider_template(
            "cluster-autoscaler",
            "default",
            &["deploy/helm/values-kind-capd.yaml"],
            &[],
        ),
        topology: Topology::Management { cluster: "demo" },
    })
    .await;
}

/// The harness is strict where the issue's bug was: the provider's key mounted 0400 without fsGroup (the
/// old standalone overlay) is root's alone, and the provider, uid 65532, cannot read it.
#[tokio::test]
async fn a_key_mounted_0400_without_fs_group_is_unreadable_for_the_provider() {
    require_root();
    let _serial = SERIAL.lock().await;
    let cp = support::control_plane(Setup::shipped());
    let mut objects = render::kustomize("deploy/overlays/standalone");
    // Named, so that what stops the provider is its key.
    render::name_cluster(&mut objects, "old-standalone");
    for o in objects.iter_mut().filter(|o| {
        o["kind"] == "Deployment" && o["metadata"]["name"] == "capi-autoscaler-provider"
    }) {
        let spec = &mut o["spec"]["template"]["spec"];
        spec["securityContext"]
            .as_object_mut()
            .expect("a pod securityContext")
            .remove("fsGroup");
        for v in spec["volumes"].as_array_mut().expect("volumes") {
            if v.get("secret").is_some() {
                v["secret"]["defaultMode"] = Value::from(0o400);
            }
        }
    }
    let (applied, mut pod) =
        standalone_provider_pod(cp, "old-standalone", &objects, "old-provider-e2e").await;
    let provider = &mut pod.containers[0];
    let exited = provider.wait_exit(Duration::from_secs(30)).await;
    let log = provider.log_tail();
    assert!(
        exited.as_ref().is_ok_and(|s| !s.success()) && log.contains("ermission denied"),
        "the provider should have failed to read its key ({exited:?}):\n{log}"
    );
    procs::announce(&format!(
        "e2e: manifests old standalone (0400, no fsGroup): the provider exits: {}",
        log.lines()
            .rev()
            .find(|l| l.contains("ermission denied"))
            .unwrap_or_default()
    ));
    drop(pod);
    drop(applied);
}

/// Applies the standalone overlay's `objects` as release `release` (with the cert-manager stand-in
/// CRDs and the certificates cert-manager would issue) and runs the provider's pod from its stored
/// Deployment as `pod_name`: what a start of the shipped standalone provider does.
async fn standalone_provider_pod(
    cp: &'static ControlPlane,
    release: &str,
    objects: &[Value],
    pod_name: &str,
) -> (Applied, RunningPod) {
    let admin = cp.admin_client().await;
    support::crds::install(
        &admin,
        &[render::repo("tests/fixtures/cert-manager-crds.yaml")],
    )
    .await
    .expect("install the cert-manager stand-in CRDs");
    let applied = Applied::apply(cp, release, objects);
    let certificates: Vec<Value> = objects
        .iter()
        .filter(|o| o["kind"] == "Certificate" || o["kind"] == "Issuer")
        .cloned()
        .collect();
    support::cert_manager::issue(&admin, "kube-system", &certificates).await;
    let kubelet = Kubelet {
        client: admin.clone(),
        server: cp.server.clone(),
        ca_pem: std::fs::read_to_string(cp.dir.join("ca.crt")).expect("the control plane's CA"),
        ports: PortMap::fresh(&PORTS),
        hosts: service_names(objects),
    };
    let spec = stored_pod_spec(&admin, "kube-system", "capi-autoscaler-provider").await;
    let pod = kubelet.start_pod("kube-system", pod_name, &spec).await;
    (applied, pod)
}

/// The overlays as shipped, the Cluster not named: the provider, run as the pod runs it, stops at start
/// with an error that says what to set (and CA would never get a provider serving every Cluster).
#[tokio::test]
async fn the_placeholder_left_in_the_overlay_stops_the_provider_saying_what_to_set() {
    require_root();
    let _serial = SERIAL.lock().await;
    let cp = support::control_plane(Setup::shipped());
    let objects = render::kustomize("deploy/overlays/standalone");
    let (applied, mut pod) = standalone_provider_pod(
        cp,
        "placeholder-standalone",
        &objects,
        "placeholder-provider-e2e",
    )
    .await;
    let provider = &mut pod.containers[0];
    let exited = provider.wait_exit(Duration::from_secs(30)).await;
    let log = provider.log_tail();
    assert!(
        exited.as_ref().is_ok_and(|s| !s.success())
            && log.contains(render::CLUSTER_PLACEHOLDER)
            && log.contains("CAPI_AUTOSCALER_PROVIDER_CLUSTER")
            && log.contains("NAMESPACE/NAME"),
        "the provider should have stopped on the placeholder ({exited:?}):\n{log}"
    );
    procs::announce(&format!(
        "e2e: manifests standalone with the placeholder: the provider exits: {}",
        log.lines()
            .rev()
            .find(|l| l.contains("placeholder"))
            .unwrap_or_default()
    ));
    drop(pod);
    drop(applied);
}

/// Two releases of the chart (two workload Clusters) in one namespace, applied as `helm install` would
/// (server-side, each release its own field manager): neither conflicts with the other, and each pod
/// mounts its own cloud-config and serves its own Cluster.
#[tokio::test]
async fn two_releases_in_one_namespace_apply_without_a_conflict() {
    let _serial = SERIAL.lock().await;
    let cp = support::control_plane(Setup::shipped());
    let admin = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let clusters = ["alpha", "beta"];
    let mut releases = Vec::new();
    for cluster in clusters {
        let release = format!("autoscaler-{cluster}");
        let objects =
            render::provider_template(&release, &ns, &[], &[("provider.cluster.name", cluster)]);
        let applied = Applied::apply_as(cp, &release, &objects, &format!("helm-{release}"));
        releases.push((release, objects, applied));
    }
    for ((release, objects, _), cluster) in releases.iter().zip(clusters) {
        let name = render::all(objects, "Deployment")[0]["metadata"]["name"]
            .as_str()
            .expect("the Deployment's name")
            .to_string();
        let spec = stored_pod_spec(&admin, &ns, &name).await;
        let provider = render::container(&spec, "provider");
        let env = provider["env"].as_array().expect("env");
        assert!(
            env.iter()
                .any(|e| e["name"] == "CAPI_AUTOSCALER_PROVIDER_CLUSTER" && e["value"] == cluster),
            "{release}: {env:?}"
        );
        for volume in spec["volumes"].as_array().expect("volumes") {
            if let Some(map) = volume["configMap"]["name"].as_str() {
                let stored = Api::<ConfigMap>::namespaced(admin.clone(), &ns)
                    .get(map)
                    .await
                    .unwrap_or_else(|e| panic!("{release}: ConfigMap {map}: {e}"));
                let managers: Vec<String> = stored
                    .metadata
                    .managed_fields
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|f| f.manager)
                    .collect();
                assert_eq!(managers, [format!("helm-{release}")], "{release}: {map}");
            }
        }
    }
    procs::announce(&format!(
        "e2e: manifests: two releases of deploy/helm in namespace {ns} applied side by side, each with \
         its own objects ({} and {} objects)",
        releases[0].1.len(),
        releases[1].1.len()
    ));
}

/// `kubectl auth can-i` as `identity` (a kubeconfig file) for `args`: whether the API server allows it.
fn can_i(identity: &Path, args: &[&str]) -> bool {
    let out = std::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(identity)
        .args(["auth", "can-i"])
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run kubectl auth can-i");
    String::from_utf8_lossy(&out.stdout).trim() == "yes"
}

/// A kubeconfig of ServiceAccount `kube-system/service_account` in the cluster of `admin` (its server
/// and CA), with a token `kubectl create token` makes for it, written to `file`.
fn service_account_kubeconfig(admin: &Path, service_account: &str, file: &Path) {
    let token = kubectl(
        admin,
        &[
            "-n",
            "kube-system",
            "create",
            "token",
            service_account,
            "--duration=1h",
        ],
    );
    let admin: Value =
        serde_norway::from_str(&std::fs::read_to_string(admin).expect("read the kubeconfig"))
            .expect("a kubeconfig");
    let cluster = admin["clusters"][0]["cluster"].clone();
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "workload", "cluster": cluster}],
        "users": [{"name": service_account, "user": {"token": token.trim()}}],
        "contexts": [{"name": "provider", "context": {"cluster": "workload", "user": service_account}}],
        "current-context": "provider",
    });
    std::fs::write(file, serde_norway::to_string(&config).expect("YAML")).expect("write");
}

/// deploy/workload-cluster applied to a workload cluster as README "Which Cluster is served" says
/// (`kubectl apply -k`, `kubectl create token`): its identity may get, list and watch Nodes (what the
/// provider's watch through --kubeconfig needs) and nothing else. A ServiceAccount without the binding
/// may not: the binding is what grants it.
#[tokio::test]
async fn the_workload_cluster_identity_reads_nodes_and_nothing_else() {
    let _serial = SERIAL.lock().await;
    let cp = support::control_plane(Setup::shipped());
    let w = workload_cluster(cp);
    let dir = procs::work_dir();
    let kustomization = render::repo("deploy/workload-cluster");
    kubectl(
        &w.admin_kubeconfig,
        &[
            "apply",
            "--server-side",
            "--field-manager=e2e-install",
            "-k",
            &path(&kustomization),
        ],
    );
    let identity = dir.join("workload-provider.kubeconfig");
    service_account_kubeconfig(&w.admin_kubeconfig, "capi-autoscaler-provider", &identity);
    for verb in ["get", "list", "watch"] {
        assert!(can_i(&identity, &[verb, "nodes"]), "{verb} nodes");
    }
    for args in [
        &["update", "nodes"][..],
        &["delete", "nodes"],
        &["list", "pods", "--all-namespaces"],
        &["get", "secrets", "-n", "kube-system"],
        &["list", "machines.cluster.x-k8s.io", "--all-namespaces"],
    ] {
        assert!(!can_i(&identity, args), "{args:?} is allowed");
    }
    kubectl(
        &w.admin_kubeconfig,
        &[
            "-n",
            "kube-system",
            "create",
            "serviceaccount",
            "unbound-e2e",
        ],
    );
    let unbound = dir.join("workload-unbound.kubeconfig");
    service_account_kubeconfig(&w.admin_kubeconfig, "unbound-e2e", &unbound);
    assert!(!can_i(&unbound, &["list", "nodes"]));
    kubectl(
        &w.admin_kubeconfig,
        &[
            "-n",
            "kube-system",
            "delete",
            "serviceaccount",
            "unbound-e2e",
        ],
    );
    kubectl(
        &w.admin_kubeconfig,
        &["delete", "-k", &path(&kustomization)],
    );
    procs::announce(
        "e2e: manifests: deploy/workload-cluster: its token may get/list/watch nodes, nothing else",
    );
}
