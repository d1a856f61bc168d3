//! `make demo`: the provider's main job on one machine, driven by the real cluster-autoscaler.
//!
//! A fresh etcd + kube-apiserver + kube-scheduler with the real Cluster API core manager (v1.14.2,
//! its 13 CRDs, conversion and admission webhooks: tests/support/capi_manager.rs), a Cluster `demo`
//! of the stand-in infrastructure (tests/support/standin.rs: a provisioned StandInCluster, an
//! initialized StandInControlPlane, the kubeconfig Secret), the example node groups of
//! examples/*.yaml in namespace `demo`, the stand-in playing only the cloud and the kubelets, this
//! provider (`serve`, discovery limited to `demo`) and the real cluster-autoscaler (the default
//! pinned version, `--cloud-provider=externalgrpc`, test timings). The examples are applied as
//! written except for what the stand-in must play: their infrastructure template kind
//! (`E2EMachineTemplate`, standing for a real provider's) becomes the stand-in's
//! `StandInMachineTemplate`, and the MachinePool example is skipped (the stand-in has no machine
//! pool). Then one cycle on `md-small`: a pending pod that only fits it makes CA scale the group up
//! from zero; CAPI makes the MachineSet and the Machine, the stand-in its Node, kube-scheduler binds
//! the pod; once the pod is deleted, CA removes the empty Node through DeleteNodes, and CAPI deletes
//! the marked Machine (drain, Node deletion), replicas back to 0.
//!
//! The timeline shows what CA decided from what CA itself writes (its Events and its status
//! ConfigMap), what the real CAPI manager did from the objects it wrote (MachineSets, Machines and
//! their phases, node refs, the drain's cordon, Node and Machine deletion), the other objects that
//! changed (replicas, delete marks, CA's taints) and the stand-in's actions; the objects are
//! watched, so the times are when the changes happened.
//!
//! Every run starts its own control plane on free 127.0.0.1 ports and leaves nothing behind: CA, the
//! provider, the stand-in, the CAPI manager, kube-scheduler, kube-apiserver and etcd stop at exit
//! (also on Ctrl-C), and the work directories are removed (kept, with the logs' paths printed, when
//! the demo fails).

#[path = "../tests/support/mod.rs"]
pub mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Namespace, Node, Pod};
use kube::api::{DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Resource};
use serde::Deserialize as _;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use support::autoscaler::{self, Autoscaler, AutoscalerProcess, STATUS_CONFIGMAP};
use support::capi::{Capi, Kind};
use support::capi_manager::{CapiManager, capi_manager};
use support::provider::PROVIDER_BIN;
use support::standin::{self, StandIn};
use support::{CAPI_GROUP, ProviderProcess, infra, procs, start_provider};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

const NS: &str = "demo";
const MD: &str = "md-small";
const GROUP: &str = "MachineDeployment/demo/md-small";
const POD: &str = "web";
const POD_CPU: &str = "1500m";
const POD_MEMORY: &str = "512Mi";
/// The label CAPI puts on the Machines (and MachineSets) of a MachineDeployment.
const DEPLOYMENT_LABEL: &str = "cluster.x-k8s.io/deployment-name";
/// The Node label md-small's template carries (CAPI syncs labels of this domain from Machines onto
/// Nodes), and the demo pod's nodeSelector.
const POOL_LABEL: &str = "node.cluster.x-k8s.io/pool";
/// What examples/*.yaml call their infrastructure: a stand-in for a real provider's kinds.
const EXAMPLE_INFRA_GROUP: &str = "infrastructure.cluster.x-k8s.io";
const EXAMPLE_TEMPLATE_KIND: &str = "E2EMachineTemplate";
/// CA's loop is 2 s, CAPI and the stand-in make a Node within seconds: a minute is ample for each
/// scale-up step.
const UP: Duration = Duration::from_secs(60);
/// md-small's scale-down-unneeded-time (10 s) plus CA's loops and CAPI's deletion.
const DOWN: Duration = Duration::from_secs(90);
const SHORT: Duration = Duration::from_secs(30);
/// The key of the whole cluster's line among the node groups' in CA's status.
const CLUSTER_WIDE: &str = "cluster-wide";

fn main() -> ExitCode {
    let t0 = Instant::now();
    println!("== capi-autoscaler-provider demo: the real cluster-autoscaler drives the provider");
    if !Path::new(PROVIDER_BIN).is_file() {
        eprintln!(
            "error: no provider binary at {PROVIDER_BIN}; build it first: \
             cargo build --bin capi-autoscaler-provider (`make demo` does)"
        );
        return ExitCode::FAILURE;
    }
    // Before anything starts: without CA there is no demo (the panic message says what was tried).
    let version = autoscaler::default_version();
    let Ok(binary) = std::panic::catch_unwind(|| autoscaler::binary(&version, "externalgrpc"))
    else {
        eprintln!(
            "error: no cluster-autoscaler {version}; set CLUSTER_AUTOSCALER to a release build \
             (`-tags externalgrpc`)"
        );
        return ExitCode::FAILURE;
    };
    println!(
        "\n== setup (seconds since the start)\n[{:7.2}s] cluster-autoscaler {version}: {}",
        t0.elapsed().as_secs_f64(),
        binary.display()
    );
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        // In a task of its own, so that a panicking harness step (they panic with the logs) is a
        // failure like any other, and so that Ctrl-C can stop it (dropping it kills CA and the provider).
        let mut task = tokio::spawn(run(t0, version));
        tokio::select! {
            result = &mut task => joined(result).and_then(|r| r).map_err(Outcome::Failed),
            _ = tokio::signal::ctrl_c() => {
                task.abort();
                let _ = task.await;
                Err(Outcome::Interrupted)
            }
        }
    });
    // Don't wait for a control-plane start that an interrupt cut short: the exit handler kills its
    // processes and removes the work directories.
    runtime.shutdown_background();
    println!("\nstopping kube-scheduler, kube-apiserver and etcd; removing the work directories");
    match result {
        Ok(()) => {
            println!("demo: done in {:.1}s", t0.elapsed().as_secs_f64());
            ExitCode::SUCCESS
        }
        Err(Outcome::Interrupted) => {
            eprintln!("\ndemo: interrupted");
            ExitCode::from(130)
        }
        Err(Outcome::Failed(e)) => {
            procs::mark_failed();
            eprintln!("\ndemo FAILED: {e}");
            let logs = log_files(procs::work_dir());
            if !logs.is_empty() {
                eprintln!("\nlogs (kept):");
            }
            for log in logs {
                eprintln!("  {}", log.display());
            }
            ExitCode::FAILURE
        }
    }
}

enum Outcome {
    Interrupted,
    Failed(String),
}

/// A task's result; a panic (the harness panics with the logs' tails) as its message.
fn joined<T>(result: Result<T, tokio::task::JoinError>) -> Result<T, String> {
    result.map_err(|e| match e.try_into_panic() {
        Ok(payload) => match payload.downcast::<String>() {
            Ok(message) => format!("a step panicked: {message}"),
            Err(payload) => format!(
                "a step panicked: {}",
                payload.downcast_ref::<&str>().unwrap_or(&"(no message)")
            ),
        },
        Err(e) => e.to_string(),
    })
}

/// The `*.log` files of the work directory and of its subdirectories (the control plane's).
fn log_files(dir: &Path) -> Vec<PathBuf> {
    let mut logs = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            logs.extend(log_files(&path));
        } else if path.extension().is_some_and(|x| x == "log") {
            logs.push(path);
        }
    }
    logs.sort();
    logs
}

/// Starts the control plane (on a blocking thread: the harness blocks while it starts), then the
/// demo.
async fn run(t0: Instant, version: String) -> Result<(), String> {
    println!(
        "[{:7.2}s] starting etcd + kube-apiserver, then the Cluster API manager on 127.0.0.1 …",
        t0.elapsed().as_secs_f64()
    );
    let manager = joined(tokio::task::spawn_blocking(capi_manager).await)?;
    let cp = manager.cp;
    let t = &cp.timings;
    println!(
        "[{:7.2}s] control plane {} up in {:.1}s (etcd {:.1}s, kube-apiserver {:.1}s)",
        t0.elapsed().as_secs_f64(),
        cp.server,
        t.total.as_secs_f64(),
        t.etcd.as_secs_f64(),
        t.apiserver.as_secs_f64(),
    );
    let m = &manager.timings;
    println!(
        "[{:7.2}s] Cluster API manager {} (pid {}) healthy {:.1}s after its start: its 13 CRDs with \
         the conversion webhook and the stand-in's CRDs in {:.1}s, its webhook configurations in \
         {:.2}s",
        t0.elapsed().as_secs_f64(),
        manager.version,
        manager.pid().unwrap_or_default(),
        m.start_to_healthy.as_secs_f64(),
        m.crds.as_secs_f64(),
        m.webhooks.as_secs_f64(),
    );
    demo(manager, t0, &version).await
}

fn err(what: impl std::fmt::Display) -> impl FnOnce(kube::Error) -> String {
    move |e| format!("{what}: {e}")
}

async fn demo(manager: &'static CapiManager, t0: Instant, version: &str) -> Result<(), String> {
    let cp = manager.cp;
    let client = cp.admin_client().await;
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some(NS.into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .map_err(err("create namespace demo"))?;
    let capi = Capi::new(client.clone(), NS, CAPI_GROUP, "v1beta2");
    let mut d = Demo::new(client.clone(), &capi, t0);

    let cluster = standin::workload_cluster(&client, cp, NS, NS).await;
    d.say(&format!(
        "Cluster {NS}/{NS}: a StandInCluster (provisioned), a StandInControlPlane (initialized, \
         externally managed) and the {NS}-kubeconfig Secret (this kube-apiserver is also the workload \
         cluster); CAPI has it provisioned, initialized and connected after {:.1}s",
        cluster.ready_after.as_secs_f64()
    ));
    let applied = apply_examples(&client).await?;
    d.say(&format!(
        "namespace {NS}: objects from examples/*.yaml\n{applied}"
    ));
    d.say(
        "stand-in cloud and kubelets running for namespace demo (providerIDs, provisioned \
         StandInMachines, Ready Nodes); the rest is the CAPI manager's",
    );

    let discovery = format!("clusterapi:namespace={NS}");
    let provider = start_provider(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
    )
    .await;
    d.say(&format!(
        "provider `serve --node-group-auto-discovery {discovery}` on {} (pid {}): CloudProvider \
         SERVING after {:.2}s",
        provider.address,
        provider.pid(),
        provider.startup.as_secs_f64()
    ));
    let provider = d.provider.insert(provider);
    let provider_address = provider.address.clone();

    // What CA will see, as the operator would look at it.
    let args = infra::connection_args(cp.admin_kubeconfig(), NS);
    let mut check_args = vec!["check"];
    check_args.extend(args.iter().map(String::as_str));
    let check = infra::run_cli(&check_args, SHORT).await;
    let meaning = match check.code {
        Some(0) => "no problems",
        Some(1) => "problems reported, see PROBLEMS",
        _ => return Err(format!("`check` failed:\n{}", check.describe())),
    };
    let mut text = format!(
        "`capi-autoscaler-provider check --cloud-config <kubeconfig> --node-group-auto-discovery \
         {discovery}` exited {} ({meaning}):",
        check.code.unwrap_or_default()
    );
    for line in check.stdout.lines() {
        text.push_str(&format!("\n  | {line}"));
    }
    d.say(&text);

    let ca = Autoscaler::new(NS, &provider_address);
    let flags = ca
        .flags
        .chunks(4)
        .map(|line| line.join(" "))
        .collect::<Vec<_>>()
        .join("\n  ");
    d.ca = Some(ca.start(cp).await);
    d.say(&format!(
        "kube-scheduler started; cluster-autoscaler {version} up: --cloud-provider=externalgrpc \
         --cloud-config=<address: {provider_address}> --namespace={NS}\n  {flags}"
    ));
    d.until("CA's first status ConfigMap with md-small", SHORT, |s| {
        s.groups.contains_key(GROUP).then_some(())
    })
    .await?;

    // --- scale up ----------------------------------------------------------------------------------
    println!(
        "\n== the cycle on {GROUP} (t+ = seconds since the pod was created; \
         lines are: who, what)"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    create_pod(&pods).await?;
    d.cycle = Some(Instant::now());
    d.say(&format!(
        "pod {NS}/{POD} created: requests cpu {POD_CPU}, memory {POD_MEMORY}; nodeSelector \
         {POOL_LABEL}=small (only md-small's template has that label, and md-small has no node)"
    ));
    d.until("CA raises md-small's replicas", UP, |s| {
        (s.replicas.get(MD).copied().unwrap_or(0) >= 1).then_some(())
    })
    .await?;
    let node = d
        .until("md-small's Node is Ready", UP, |s| {
            s.nodes
                .iter()
                .find(|(_, n)| n.group == MD && n.ready)
                .map(|(name, _)| name.clone())
        })
        .await?;
    let bound = d
        .until("kube-scheduler binds the pod", UP, |s| s.pod_node.clone())
        .await?;
    if bound != node {
        return Err(format!(
            "the pod went to {bound}, not to md-small's Node {node}"
        ));
    }
    // One more CA loop, to show CA's view of the grown group.
    d.until("CA's status shows md-small's Node ready", SHORT, |s| {
        s.groups
            .get(GROUP)
            .is_some_and(|g| g.ready == 1)
            .then_some(())
    })
    .await?;

    // --- scale down --------------------------------------------------------------------------------
    let option = capi.key("autoscaling-options-scaledownunneededtime");
    let unneeded = capi
        .api(Kind::MachineDeployment)
        .get(MD)
        .await
        .map_err(err("get MachineDeployment md-small"))?
        .metadata
        .annotations
        .and_then(|a| {
            a.get(&option)
                .map(|v| format!("{v} (its {option} annotation)"))
        })
        .unwrap_or_else(|| "CA's --scale-down-unneeded-time".into());
    pods.delete(POD, &DeleteParams::default().grace_period(0))
        .await
        .map_err(err("delete the pod"))?;
    d.deleted = Some(Instant::now());
    d.say(&format!(
        "pod {NS}/{POD} deleted: {node} is empty; CA removes it once unneeded for md-small's \
         scale-down-unneeded-time: {unneeded}"
    ));
    d.until("the pod is gone", SHORT, |s| (!s.pod_exists).then_some(()))
        .await?;
    d.until("CA has the provider mark md-small's Machine", DOWN, |s| {
        s.times.marked.map(|_| ())
    })
    .await?;
    d.until("md-small's replicas back to 0", SHORT, |s| {
        (s.replicas.get(MD) == Some(&0)).then_some(())
    })
    .await?;
    d.until("md-small's Node is gone", SHORT, |s| {
        (!s.nodes.values().any(|n| n.group == MD)).then_some(())
    })
    .await?;
    d.until("CA's status shows md-small at 0", SHORT, |s| {
        s.groups
            .get(GROUP)
            .is_some_and(|g| g.target == 0 && g.registered == 0)
            .then_some(())
    })
    .await?;
    // The Machine that went is the marked one, and the only one.
    if d.state.deleted_marked != vec![node.clone()] {
        return Err(format!(
            "Machines deleted with the delete mark: {:?}, not just {node}'s",
            d.state.deleted_marked
        ));
    }

    // --- summary -----------------------------------------------------------------------------------
    let scaled_up = d
        .ca()
        .metric_sum("cluster_autoscaler_scaled_up_nodes_total", &[])
        .await;
    let scaled_down = d
        .ca()
        .metric_sum("cluster_autoscaler_scaled_down_nodes_total", &[])
        .await;
    d.summary(manager, version, &node, scaled_up, scaled_down);
    if !d.standin.errors().is_empty() {
        println!("  stand-in errors: {:#?}", d.standin.errors());
    }
    println!(
        "  logs (removed at exit): {}",
        log_files(procs::work_dir())
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("\nstopping cluster-autoscaler, the provider and the stand-in");
    drop(d);
    Ok(())
}

/// The demo's pod: it fits only md-small (nodeSelector `pool=small`, 1.5 of its 2 CPUs). No owner:
/// CA never needs to drain it, the demo deletes it before the scale-down.
async fn create_pod(pods: &Api<Pod>) -> Result<(), String> {
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": POD, "namespace": NS, "labels": {"app": POD}},
        "spec": {
            "nodeSelector": {POOL_LABEL: "small"},
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": POD,
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": POD_CPU, "memory": POD_MEMORY}},
            }],
        },
    }))
    .map_err(|e| format!("pod object: {e}"))?;
    pods.create(&PostParams::default(), &pod)
        .await
        .map_err(err("create the pod"))?;
    Ok(())
}

/// Creates every Kubernetes object in examples/*.yaml (in file order), in its stand-in variant
/// ([`standin_variant`]; machine pools skipped); `status` goes through the status subresource.
/// Returns one line per object or file.
async fn apply_examples(client: &Client) -> Result<String, String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("read {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    let mut report = Vec::new();
    for file in files {
        let short = format!(
            "examples/{}",
            file.file_name().unwrap_or_default().to_string_lossy()
        );
        let text =
            std::fs::read_to_string(&file).map_err(|e| format!("read {}: {e}", file.display()))?;
        // Parsed before any await: the YAML parser cannot move between threads.
        let documents = serde_norway::Deserializer::from_str(&text)
            .map(|doc| {
                let value = serde_norway::Value::deserialize(doc)
                    .map_err(|e| format!("parse {short}: {e}"))?;
                serde_json::to_value(value).map_err(|e| format!("{short}: {e}"))
            })
            .collect::<Result<Vec<Value>, String>>()?;
        for mut object in documents {
            if object.is_null() {
                continue;
            }
            let Some(kind) = object["apiVersion"]
                .as_str()
                .and(object["kind"].as_str())
                .map(str::to_string)
            else {
                report.push(format!(
                    "  {short:<44} skipped: a CA --cloud-config file, not an object"
                ));
                continue;
            };
            if kind.contains("MachinePool") {
                report.push(format!(
                    "  {short:<44} {kind} skipped: the stand-in infrastructure has no machine pool"
                ));
                continue;
            }
            let played = standin_variant(&mut object);
            let (Some(api_version), Some(kind)) = (
                object["apiVersion"].as_str().map(str::to_string),
                object["kind"].as_str().map(str::to_string),
            ) else {
                continue;
            };
            let (group, version) = api_version.split_once('/').unwrap_or(("", &api_version));
            let gvk = GroupVersionKind::gvk(group, version, &kind);
            let (resource, _) = kube::discovery::pinned_kind(client, &gvk)
                .await
                .map_err(err(format!("{short}: discover {api_version} {kind}")))?;
            let status = object.as_object_mut().and_then(|o| o.remove("status"));
            let name = object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let ns = object["metadata"]["namespace"]
                .as_str()
                .unwrap_or(NS)
                .to_string();
            let dynamic: DynamicObject =
                serde_json::from_value(object).map_err(|e| format!("{short}: {e}"))?;
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &resource);
            api.create(&PostParams::default(), &dynamic)
                .await
                .map_err(err(format!("{short}: create {kind} {ns}/{name}")))?;
            let mut line = format!("  {short:<44} {kind} {ns}/{name}");
            if let Some(note) = played {
                line.push_str(note);
            }
            if let Some(status) = status {
                api.patch_status(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({ "status": status })),
                )
                .await
                .map_err(err(format!("{short}: write the status of {kind} {name}")))?;
                line.push_str(" (+ status through /status)");
            }
            report.push(line);
        }
    }
    Ok(report.join("\n"))
}

/// Turns an example object into what the stand-in plays: an `E2EMachineTemplate` of
/// examples/*.yaml (the infrastructure template of a real provider there) becomes a
/// `StandInMachineTemplate` with the same spec and status, and a reference to one in a template's
/// `infrastructureRef` refers to the stand-in's. Returns what changed, for the report.
fn standin_variant(object: &mut Value) -> Option<&'static str> {
    let example_template =
        |group: &str, kind: &str| group == EXAMPLE_INFRA_GROUP && kind == EXAMPLE_TEMPLATE_KIND;
    let api_version = object["apiVersion"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let group = api_version.split_once('/').map_or("", |(g, _)| g);
    if example_template(group, object["kind"].as_str().unwrap_or_default()) {
        object["apiVersion"] = json!(format!("{}/{}", standin::GROUP, standin::VERSION));
        object["kind"] = json!(standin::TEMPLATE_KIND);
        return Some(" (the stand-in's, for E2EMachineTemplate)");
    }
    let reference = object.pointer_mut("/spec/template/spec/infrastructureRef")?;
    if example_template(
        reference["apiGroup"].as_str().unwrap_or_default(),
        reference["kind"].as_str().unwrap_or_default(),
    ) {
        let name = reference["name"].as_str().unwrap_or_default().to_string();
        *reference = standin::reference(standin::TEMPLATE_KIND, &name);
        return Some(" (infrastructureRef → the stand-in's template)");
    }
    None
}

// --- watching ------------------------------------------------------------------------------------

/// An object a watch reported, with when it arrived.
struct Seen {
    at: Instant,
    object: Object,
    gone: bool,
}

/// Pods, Nodes and Events are boxed: they are much larger than the rest.
enum Object {
    Pod(Box<Pod>),
    Node(Box<Node>),
    Machine(DynamicObject),
    MachineSet(DynamicObject),
    Deployment(DynamicObject),
    Status(ConfigMap),
    Event(Box<Event>),
}

/// Forwards every change of `api`'s objects (as `wrap`ped) to `tx` until aborted; a failed watch
/// is restarted with backoff.
fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    tx: mpsc::UnboundedSender<Seen>,
    wrap: fn(K) -> Object,
) -> AbortHandle
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(watcher(api, config).default_backoff());
        while let Some(event) = stream.next().await {
            let (object, gone) = match event {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => (o, false),
                Ok(watcher::Event::Delete(o)) => (o, true),
                _ => continue,
            };
            let seen = Seen {
                at: Instant::now(),
                object: wrap(object),
                gone,
            };
            if tx.send(seen).is_err() {
                break;
            }
        }
    })
    .abort_handle()
}

/// The watch tasks; aborted when dropped.
struct Watches(Vec<AbortHandle>);

impl Drop for Watches {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// What the watches have shown so far.
#[derive(Default)]
struct State {
    /// `spec.replicas` of each MachineDeployment.
    replicas: BTreeMap<String, i64>,
    /// Machine name → carries the delete-machine annotation.
    marked: BTreeMap<String, bool>,
    /// Machine name → what CAPI last wrote of it.
    machines: BTreeMap<String, MachineState>,
    /// Machine name → its MachineDeployment (kept after the Machine is gone: its Node goes later).
    machine_group: BTreeMap<String, String>,
    /// MachineSet name → `spec.replicas`.
    machine_sets: BTreeMap<String, i64>,
    /// Machines that were deleted while they carried the annotation.
    deleted_marked: Vec<String>,
    nodes: BTreeMap<String, NodeState>,
    pod_exists: bool,
    pod_node: Option<String>,
    /// CA's status ConfigMap: one summary line per node group, and `cluster-wide`.
    status: BTreeMap<String, String>,
    groups: BTreeMap<String, GroupStatus>,
    /// Event uid → count, to show each Event once and its repetitions.
    events: HashMap<String, i32>,
    times: Milestones,
}

/// What CAPI writes of a Machine that the timeline shows.
#[derive(Clone, PartialEq)]
struct MachineState {
    phase: String,
    node_ref: Option<String>,
    deleting: bool,
}

struct NodeState {
    /// The MachineDeployment of the Node's Machine (the stand-in names the Node after it).
    group: String,
    ready: bool,
    /// Cordoned: CAPI's drain does it (CA only taints).
    unschedulable: bool,
    /// CAPI synced its Machine's annotations onto it.
    synced: bool,
    /// `key:Effect` of each taint.
    taints: BTreeSet<String>,
}

/// The numbers of one node group in CA's status ConfigMap.
struct GroupStatus {
    target: i64,
    registered: i64,
    ready: i64,
}

/// When each step of the cycle was first seen.
#[derive(Default)]
struct Milestones {
    triggered: Option<Instant>,
    scaled_up_event: Option<Instant>,
    replicas_up: Option<Instant>,
    machine_created: Option<Instant>,
    node_ready: Option<Instant>,
    node_ref: Option<Instant>,
    bound: Option<Instant>,
    candidate: Option<Instant>,
    scale_down_event: Option<Instant>,
    marked: Option<Instant>,
    replicas_down: Option<Instant>,
    deleting: Option<Instant>,
    cordoned: Option<Instant>,
    node_gone: Option<Instant>,
    machine_gone: Option<Instant>,
}

impl State {
    /// Takes in one change; returns the timeline lines it makes, as (who, what).
    fn absorb(&mut self, seen: Seen, delete_key: &str) -> Vec<(&'static str, String)> {
        let at = seen.at;
        let mut lines = Vec::new();
        match seen.object {
            Object::Deployment(md) => {
                let name = md.metadata.name.clone().unwrap_or_default();
                let replicas = md.data["spec"]["replicas"].as_i64().unwrap_or(0);
                if let Some(before) = self.replicas.insert(name.clone(), replicas)
                    && before != replicas
                {
                    lines.push((
                        "provider",
                        format!("MachineDeployment {name} spec.replicas {before} → {replicas}"),
                    ));
                    if name == MD {
                        let step = if replicas > before {
                            &mut self.times.replicas_up
                        } else {
                            &mut self.times.replicas_down
                        };
                        step.get_or_insert(at);
                    }
                }
            }
            Object::Machine(machine) => {
                let name = machine.metadata.name.clone().unwrap_or_default();
                let group = label(&machine.metadata, DEPLOYMENT_LABEL);
                let marked = machine
                    .metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(delete_key));
                let before = if seen.gone {
                    self.marked.remove(&name)
                } else {
                    self.marked.insert(name.clone(), marked)
                };
                // A deleted Machine's last state still shows its mark.
                if seen.gone && marked {
                    self.deleted_marked.push(name.clone());
                }
                let mine = group == MD;
                if !group.is_empty() {
                    self.machine_group.insert(name.clone(), group);
                }
                if marked && before != Some(true) {
                    lines.push((
                        "provider",
                        format!("Machine {name} annotated {delete_key} (DeleteNodes)"),
                    ));
                    if mine {
                        self.times.marked.get_or_insert(at);
                    }
                }
                if seen.gone {
                    self.machines.remove(&name);
                    lines.push((
                        "CAPI",
                        format!("Machine {name} gone (its finalizer removed)"),
                    ));
                    if mine {
                        self.times.machine_gone.get_or_insert(at);
                    }
                    return lines;
                }
                let now = MachineState {
                    phase: machine.data["status"]["phase"]
                        .as_str()
                        .unwrap_or("-")
                        .to_string(),
                    node_ref: machine.data["status"]["nodeRef"]["name"]
                        .as_str()
                        .map(str::to_string),
                    deleting: machine.metadata.deletion_timestamp.is_some(),
                };
                let before = self.machines.insert(name.clone(), now.clone());
                let Some(before) = before else {
                    let owner = machine
                        .metadata
                        .owner_references
                        .iter()
                        .flatten()
                        .find(|o| o.kind == "MachineSet")
                        .map_or_else(|| "-".to_string(), |o| o.name.clone());
                    lines.push((
                        "CAPI",
                        format!(
                            "Machine {name} created by MachineSet {owner} (phase {})",
                            now.phase
                        ),
                    ));
                    if mine {
                        self.times.machine_created.get_or_insert(at);
                    }
                    return lines;
                };
                if now.deleting && !before.deleting {
                    lines.push((
                        "CAPI",
                        format!(
                            "Machine {name} being deleted by its MachineSet (delete-machine: {marked})"
                        ),
                    ));
                    if mine {
                        self.times.deleting.get_or_insert(at);
                    }
                }
                if now.phase != before.phase {
                    lines.push((
                        "CAPI",
                        format!("Machine {name} phase {} → {}", before.phase, now.phase),
                    ));
                }
                if let Some(node) = now.node_ref.as_ref().filter(|_| before.node_ref.is_none()) {
                    lines.push((
                        "CAPI",
                        format!("Machine {name} status.nodeRef → Node {node}"),
                    ));
                    if mine {
                        self.times.node_ref.get_or_insert(at);
                    }
                }
            }
            Object::MachineSet(set) => {
                let name = set.metadata.name.clone().unwrap_or_default();
                if seen.gone {
                    self.machine_sets.remove(&name);
                    lines.push(("CAPI", format!("MachineSet {name} deleted")));
                    return lines;
                }
                let replicas = set.data["spec"]["replicas"].as_i64().unwrap_or(0);
                match self.machine_sets.insert(name.clone(), replicas) {
                    None => lines.push((
                        "CAPI",
                        format!(
                            "MachineSet {name} of MachineDeployment {} (spec.replicas {replicas})",
                            label(&set.metadata, DEPLOYMENT_LABEL)
                        ),
                    )),
                    Some(before) if before != replicas => lines.push((
                        "CAPI",
                        format!("MachineSet {name} spec.replicas {before} → {replicas}"),
                    )),
                    Some(_) => {}
                }
            }
            Object::Node(node) => {
                let name = node.metadata.name.clone().unwrap_or_default();
                if seen.gone {
                    lines.push(("CAPI", format!("Node {name} deleted")));
                    if self.nodes.remove(&name).is_some_and(|n| n.group == MD) {
                        self.times.node_gone.get_or_insert(at);
                    }
                    return lines;
                }
                let now = NodeState {
                    group: self.machine_group.get(&name).cloned().unwrap_or_default(),
                    ready: node_ready(&node),
                    unschedulable: node
                        .spec
                        .as_ref()
                        .and_then(|s| s.unschedulable)
                        .unwrap_or(false),
                    synced: node
                        .metadata
                        .annotations
                        .as_ref()
                        .is_some_and(|a| a.contains_key("cluster.x-k8s.io/machine")),
                    taints: node
                        .spec
                        .as_ref()
                        .and_then(|s| s.taints.as_ref())
                        .into_iter()
                        .flatten()
                        .map(|t| format!("{}:{}", t.key, t.effect))
                        .collect(),
                };
                if now.group == MD && now.ready {
                    self.times.node_ready.get_or_insert(at);
                }
                if let Some(before) = self.nodes.get(&name) {
                    if now.synced && !before.synced {
                        let pool = node
                            .metadata
                            .labels
                            .as_ref()
                            .and_then(|l| l.get(POOL_LABEL))
                            .map(|v| format!(", label {POOL_LABEL}={v}"))
                            .unwrap_or_default();
                        lines.push((
                            "CAPI",
                            format!("Node {name}: its Machine's annotations synced{pool}"),
                        ));
                    }
                    if now.unschedulable && !before.unschedulable {
                        let who = cordoned_by(&node.metadata);
                        lines.push((who, format!("Node {name} cordoned (spec.unschedulable)")));
                        if now.group == MD {
                            self.times.cordoned.get_or_insert(at);
                        }
                    }
                    for taint in now.taints.difference(&before.taints) {
                        lines.push(("CA", format!("Node {name} tainted {taint}{}", why(taint))));
                        if taint.starts_with("DeletionCandidateOfClusterAutoscaler")
                            && now.group == MD
                        {
                            self.times.candidate.get_or_insert(at);
                        }
                    }
                    for taint in before.taints.difference(&now.taints) {
                        lines.push(("CA", format!("Node {name} untainted {taint}")));
                    }
                }
                self.nodes.insert(name, now);
            }
            Object::Pod(pod) => {
                self.pod_exists = !seen.gone;
                self.pod_node = pod.spec.and_then(|s| s.node_name).filter(|_| !seen.gone);
                if self.pod_node.is_some() {
                    self.times.bound.get_or_insert(at);
                }
            }
            Object::Status(cm) => {
                let text = cm
                    .data
                    .and_then(|d| d.get("status").cloned())
                    .unwrap_or_default();
                let (status, groups) = ca_status(&text);
                // The cluster-wide line repeats the groups' news: shown until CA runs.
                let first = !self
                    .status
                    .get(CLUSTER_WIDE)
                    .is_some_and(|l| l.starts_with("Running"));
                for (key, line) in &status {
                    if self.status.get(key) != Some(line) && (key != CLUSTER_WIDE || first) {
                        lines.push(("CA status", format!("{key}: {line}")));
                    }
                }
                self.status = status;
                self.groups = groups;
            }
            Object::Event(event) => {
                let about = &event.involved_object;
                if about.namespace.as_deref() != Some(NS) && about.kind.as_deref() != Some("Node") {
                    return lines;
                }
                let uid = event.metadata.uid.clone().unwrap_or_default();
                let count = event.count.unwrap_or(1);
                if self.events.insert(uid, count) == Some(count) {
                    return lines;
                }
                let reason = event.reason.clone().unwrap_or_default();
                let who = match reporter(&event) {
                    "cluster-autoscaler" => "CA",
                    "default-scheduler" => "scheduler",
                    "capi-autoscaler-provider" => "provider",
                    // The manager's controllers report as `<kind>-controller`.
                    c if c.ends_with("-controller") => "CAPI",
                    _ => "other",
                };
                if who == "CA" {
                    let step = match reason.as_str() {
                        "TriggeredScaleUp" => Some(&mut self.times.triggered),
                        "ScaledUpGroup" => Some(&mut self.times.scaled_up_event),
                        r if r.starts_with("ScaleDown") => Some(&mut self.times.scale_down_event),
                        _ => None,
                    };
                    if let Some(step) = step {
                        step.get_or_insert(at);
                    }
                }
                lines.push((
                    who,
                    format!(
                        "Event {reason}{} on {} {}: {}{}",
                        match event.type_.as_deref() {
                            Some("Warning") => " (Warning)",
                            _ => "",
                        },
                        about.kind.as_deref().unwrap_or("-"),
                        about.name.as_deref().unwrap_or("-"),
                        event.message.as_deref().unwrap_or_default().trim(),
                        if count > 1 {
                            format!(" (×{count})")
                        } else {
                            String::new()
                        }
                    ),
                ));
            }
        }
        lines
    }
}

fn label(meta: &ObjectMeta, key: &str) -> String {
    meta.labels
        .as_ref()
        .and_then(|l| l.get(key).cloned())
        .unwrap_or_default()
}

/// Who cordoned a Node, from the field manager of `spec.unschedulable`: CA cordons the Nodes it
/// removes, CAPI's drain cordons before it evicts.
fn cordoned_by(meta: &ObjectMeta) -> &'static str {
    let manager = meta
        .managed_fields
        .iter()
        .flatten()
        .find(|f| {
            f.fields_v1
                .as_ref()
                .is_some_and(|v| v.0["f:spec"].get("f:unschedulable").is_some())
        })
        .and_then(|f| f.manager.as_deref())
        .unwrap_or_default();
    if manager.contains("autoscaler") {
        "CA"
    } else {
        "CAPI"
    }
}

fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// What CA's taints on a Node mean.
fn why(taint: &str) -> &'static str {
    if taint.starts_with("DeletionCandidateOfClusterAutoscaler") {
        " (CA: unneeded, a scale-down candidate)"
    } else if taint.starts_with("ToBeDeletedByClusterAutoscaler") {
        " (CA: deleting it, no new pods)"
    } else {
        ""
    }
}

/// Who reported an Event: events.k8s.io writers (kube-scheduler, the provider) fill
/// `reportingComponent`, core ones (CA) `source.component`.
fn reporter(event: &Event) -> &str {
    event
        .reporting_component
        .as_deref()
        .filter(|c| !c.is_empty())
        .or_else(|| event.source.as_ref().and_then(|s| s.component.as_deref()))
        .unwrap_or_default()
}

/// CA's status ConfigMap text (YAML) as one line per node group and one `cluster-wide`, without
/// the probe times that change on every loop; and each group's numbers.
fn ca_status(text: &str) -> (BTreeMap<String, String>, BTreeMap<String, GroupStatus>) {
    let mut lines = BTreeMap::new();
    let mut groups = BTreeMap::new();
    let status: Value = match serde_norway::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            lines.insert("unreadable".into(), e.to_string());
            return (lines, groups);
        }
    };
    let count = |v: &Value| v.as_i64().unwrap_or(0);
    let nodes = |health: &Value| {
        let counts = &health["nodeCounts"];
        let registered = &counts["registered"];
        let mut text = format!(
            "{}, {} of {} nodes ready",
            health["status"].as_str().unwrap_or("?"),
            count(&registered["ready"]),
            count(&registered["total"]),
        );
        for (what, n) in [
            ("not started", count(&registered["notStarted"])),
            ("being deleted", count(&registered["beingDeleted"])),
            ("unregistered", count(&counts["unregistered"])),
        ] {
            if n > 0 {
                text.push_str(&format!(", {n} {what}"));
            }
        }
        text
    };
    let activity = |v: &Value| {
        let up = &v["scaleUp"];
        let down = &v["scaleDown"];
        let mut text = format!("scale-up {}", up["status"].as_str().unwrap_or("?"));
        if let Some(code) = up["backoffInfo"]["errorCode"]
            .as_str()
            .filter(|c| !c.is_empty())
        {
            text.push_str(&format!(" ({code})"));
        }
        text.push_str(&format!(
            "; scale-down {}",
            down["status"].as_str().unwrap_or("?")
        ));
        match count(&down["candidates"]) {
            0 => {}
            1 => text.push_str(" (1 candidate)"),
            n => text.push_str(&format!(" ({n} candidates)")),
        }
        text
    };
    let cluster = &status["clusterWide"];
    let state = status["autoscalerStatus"].as_str().unwrap_or("?");
    // Before its first loop CA writes only its state.
    let cluster_line = if cluster["health"]["status"].is_string() {
        format!(
            "{state}; {}; {}",
            nodes(&cluster["health"]),
            activity(cluster)
        )
    } else {
        state.to_string()
    };
    lines.insert(CLUSTER_WIDE.into(), cluster_line);
    for group in status["nodeGroups"].as_array().into_iter().flatten() {
        let health = &group["health"];
        let name = group["name"].as_str().unwrap_or("?").to_string();
        lines.insert(
            name.clone(),
            format!(
                "{}, target {} (min {}, max {}); {}",
                nodes(health),
                count(&health["cloudProviderTarget"]),
                count(&health["minSize"]),
                count(&health["maxSize"]),
                activity(group)
            ),
        );
        let registered = &health["nodeCounts"]["registered"];
        groups.insert(
            name,
            GroupStatus {
                target: count(&health["cloudProviderTarget"]),
                registered: count(&registered["total"]),
                ready: count(&registered["ready"]),
            },
        );
    }
    (lines, groups)
}

// --- the timeline --------------------------------------------------------------------------------

/// The demo's running parts and what it has seen. Fields drop in order: CA stops before the
/// provider it calls, the stand-in and the watches last.
struct Demo {
    ca: Option<AutoscalerProcess>,
    provider: Option<ProviderProcess>,
    standin: StandIn,
    /// How many of the stand-in's actions are on the timeline.
    standin_shown: usize,
    _watches: Watches,
    rx: mpsc::UnboundedReceiver<Seen>,
    state: State,
    delete_key: String,
    /// The start of the run: setup lines are stamped from it.
    start: Instant,
    /// The pod's creation: the cycle's lines are stamped from it.
    cycle: Option<Instant>,
    /// The pod's deletion.
    deleted: Option<Instant>,
}

impl Demo {
    /// Starts the watches and the stand-in in namespace demo.
    fn new(client: Client, capi: &Capi, start: Instant) -> Demo {
        let (tx, rx) = mpsc::unbounded_channel();
        let all = watcher::Config::default;
        let watches = Watches(vec![
            watch(
                capi.api(Kind::MachineDeployment),
                all(),
                tx.clone(),
                Object::Deployment,
            ),
            watch(capi.api(Kind::Machine), all(), tx.clone(), Object::Machine),
            watch(
                capi.api(Kind::MachineSet),
                all(),
                tx.clone(),
                Object::MachineSet,
            ),
            watch(Api::all(client.clone()), all(), tx.clone(), |n| {
                Object::Node(Box::new(n))
            }),
            watch(
                Api::namespaced(client.clone(), NS),
                all().fields(&format!("metadata.name={POD}")),
                tx.clone(),
                |p| Object::Pod(Box::new(p)),
            ),
            watch(
                Api::namespaced(client.clone(), NS),
                all().fields(&format!("metadata.name={STATUS_CONFIGMAP}")),
                tx.clone(),
                Object::Status,
            ),
            // Events about Nodes are in namespace default.
            watch(Api::all(client.clone()), all(), tx, |e| {
                Object::Event(Box::new(e))
            }),
        ]);
        Demo {
            ca: None,
            provider: None,
            standin: StandIn::start(client, NS),
            standin_shown: 0,
            _watches: watches,
            rx,
            state: State::default(),
            delete_key: capi.delete_key(),
            start,
            cycle: None,
            deleted: None,
        }
    }

    fn ca(&self) -> &AutoscalerProcess {
        self.ca.as_ref().expect("CA is running")
    }

    fn stamp(&self, at: Instant) -> String {
        match self.cycle {
            Some(c) if at >= c => format!("t+{:6.2}s", (at - c).as_secs_f64()),
            _ => format!("{:7.2}s", (at - self.start).as_secs_f64()),
        }
    }

    fn print(&self, at: Instant, who: &str, text: &str) {
        let stamp = self.stamp(at);
        for (i, line) in text.lines().enumerate() {
            if i == 0 {
                println!("[{stamp}] {who:<10} {line}");
            } else {
                println!("{:width$}   {:<10} {line}", "", "", width = stamp.len());
            }
        }
    }

    /// A line about the demo's own step, after what happened before it.
    fn say(&mut self, text: &str) {
        self.flush(None);
        self.print(Instant::now(), "demo", text);
    }

    /// Prints `first`, what the watches have seen and what the stand-in did since the last call, in
    /// time order.
    fn flush(&mut self, first: Option<Seen>) {
        let mut lines: Vec<(Instant, &str, String)> = Vec::new();
        let mut next = first;
        while let Some(seen) = next.take().or_else(|| self.rx.try_recv().ok()) {
            let at = seen.at;
            for (who, text) in self.state.absorb(seen, &self.delete_key) {
                lines.push((at, who, text));
            }
        }
        let actions = self.standin.actions();
        for (at, action) in actions.into_iter().skip(self.standin_shown) {
            self.standin_shown += 1;
            lines.push((at, "stand-in", action));
        }
        lines.sort_by_key(|(at, _, _)| *at);
        for (at, who, text) in lines {
            self.print(at, who, &text);
        }
    }

    /// Prints the timeline until `done` answers, at most `timeout`; fails early when CA exits.
    async fn until<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&State) -> Option<T>,
    ) -> Result<T, String> {
        let deadline = Instant::now() + timeout;
        let mut seen = None;
        loop {
            self.flush(seen.take());
            if let Some(value) = done(&self.state) {
                return Ok(value);
            }
            if let Some(ca) = self.ca.as_mut() {
                ca.check_alive()?;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!("{what}: not after {timeout:?}"));
            }
            // Wake up for the next change, or soon for the stand-in's actions (not watched).
            let tick = (deadline - now).min(Duration::from_millis(200));
            seen = tokio::time::timeout(tick, self.rx.recv())
                .await
                .ok()
                .flatten();
        }
    }

    fn summary(
        &self,
        manager: &CapiManager,
        version: &str,
        node: &str,
        scaled_up: f64,
        scaled_down: f64,
    ) {
        let t = &self.state.times;
        let since = |from: Option<Instant>, at: Option<Instant>, prefix: &str| match (from, at) {
            (Some(from), Some(at)) => format!(
                "{prefix}{:6.2}s",
                at.saturating_duration_since(from).as_secs_f64()
            ),
            _ => "not seen".into(),
        };
        // Each part in the order things happened; steps never seen last.
        let sorted = |mut steps: Vec<(&'static str, Option<Instant>)>| {
            steps.sort_by_key(|(_, at)| (at.is_none(), *at));
            steps
        };
        println!("\n== summary");
        println!("  scale-up from zero (from the pod's creation, Pending):");
        for (what, at) in sorted(vec![
            ("CA's TriggeredScaleUp Event on the pod", t.triggered),
            ("CA's ScaledUpGroup Event", t.scaled_up_event),
            (
                "md-small spec.replicas raised to 1 by the provider",
                t.replicas_up,
            ),
            ("MachineSet's Machine created by CAPI", t.machine_created),
            ("Node Ready (stand-in kubelet)", t.node_ready),
            ("Machine's status.nodeRef set by CAPI", t.node_ref),
            ("pod bound by kube-scheduler", t.bound),
        ]) {
            println!("    {what:<56} {}", since(self.cycle, at, "t+"));
        }
        println!(
            "  scale-down of the empty Node {node} (from the pod's deletion at {}):",
            since(self.cycle, self.deleted, "t+").trim()
        );
        for (what, at) in sorted(vec![
            (
                "CA's DeletionCandidate taint on the Node (unneeded)",
                t.candidate,
            ),
            ("CA's ScaleDown Event", t.scale_down_event),
            ("Machine marked delete-machine by the provider", t.marked),
            ("md-small spec.replicas back to 0", t.replicas_down),
            ("Machine being deleted by CAPI's MachineSet", t.deleting),
            ("Node cordoned", t.cordoned),
            ("Node deleted by CAPI", t.node_gone),
            ("Machine gone (CAPI removed its finalizer)", t.machine_gone),
        ]) {
            println!("    {what:<56} {}", since(self.deleted, at, "+"));
        }
        println!(
            "  CA's own count: {scaled_up} node(s) added, {scaled_down} removed \
             (cluster_autoscaler_scaled_up_nodes_total, …_scaled_down_nodes_total)"
        );
        println!(
            "  what ran: etcd, kube-apiserver and kube-scheduler on 127.0.0.1 (control plane up in {:.1}s); \
             the Cluster API {} core manager (its controllers and webhooks); \
             cluster-autoscaler {version} (--cloud-provider=externalgrpc); \
             capi-autoscaler-provider serve; the stand-in cloud and kubelets of \
             tests/support/standin.rs; whole run {:.1}s",
            manager.cp.timings.total.as_secs_f64(),
            manager.version,
            self.start.elapsed().as_secs_f64()
        );
    }
}
