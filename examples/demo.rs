//! `make demo`: the provider's main job on one machine, in well under a minute.
//!
//! A fresh etcd + kube-apiserver with the Cluster API CRDs (tests/support), the example node groups of
//! examples/*.yaml in namespace `demo`, a fake CAPI + fake kubelet reconciler, and this provider
//! (`serve`). Then one cluster-autoscaler cycle on `md-small`: a pending pod scales the group up from
//! zero and, once the pod is gone, back down.
//!
//! The real cluster-autoscaler cannot be built on this machine (the Go module proxy answers 403 for
//! k8s.io/autoscaler), so the demo plays CA's part: it calls the provider over the same externalgrpc
//! gRPC protocol, with the calls CA makes in its scale-up and scale-down loops.
//!
//! Every run starts its own control plane on free 127.0.0.1 ports and leaves nothing behind: the
//! provider, the reconciler, kube-apiserver and etcd stop at exit (also on Ctrl-C), and the work
//! directories are removed (kept, with their path printed, when the demo fails).

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::instance_status::InstanceState;
use capi_autoscaler_provider::proto::{
    ExternalGrpcNode, NodeGroupAutoscalingOptions, NodeGroupAutoscalingOptionsRequest,
    NodeGroupTemplateNodeInfoRequest,
};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_pb::api::core::v1 as pb;
use kube::api::{DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::{Api, Client};
use prost::Message as _;
use serde::Deserialize as _;
use serde_json::{Value, json};
use support::capi::{Capi, Kind, Rpc};
use support::provider::PROVIDER_BIN;
use support::reconciler::Reconciler;
use support::{CAPI_GROUP, Check, ControlPlane, Setup, poll_until, procs, start_provider};

const NS: &str = "demo";
const MD: &str = "md-small";
const GROUP: &str = "MachineDeployment/demo/md-small";
const POD: &str = "web";
const POD_CPU: &str = "1500m";
const POD_MEMORY: &str = "512Mi";
const TIMEOUT: Duration = Duration::from_secs(60);

fn main() -> ExitCode {
    let t0 = Instant::now();
    println!("== capi-autoscaler-provider demo");
    println!(
        "note: the real cluster-autoscaler cannot be built on this machine (the Go module proxy answers\n      \
         403 for k8s.io/autoscaler), so this demo plays CA's part: it drives the provider over the\n      \
         same externalgrpc gRPC protocol, with the calls CA makes when it scales up and down."
    );
    if !Path::new(PROVIDER_BIN).is_file() {
        eprintln!(
            "error: no provider binary at {PROVIDER_BIN}; build it first: \
             cargo build --bin capi-autoscaler-provider (`make demo` does)"
        );
        return ExitCode::FAILURE;
    }
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
        tokio::select! {
            result = run(t0) => result,
            _ = tokio::signal::ctrl_c() => Err(Outcome::Interrupted),
        }
    });
    // The provider and the reconciler live in `run`: stopped by now. Don't wait for a control-plane
    // start that an interrupt cut short; the exit handler kills its processes.
    runtime.shutdown_background();
    println!("\nstopping kube-apiserver and etcd; removing the work directories");
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
            ExitCode::FAILURE
        }
    }
}

enum Outcome {
    Interrupted,
    Failed(String),
}

/// Starts the control plane (on a blocking thread: the harness blocks while it starts), then the demo.
async fn run(t0: Instant) -> Result<(), Outcome> {
    println!(
        "\n[{:7.2}s] starting etcd + kube-apiserver + Cluster API CRDs on 127.0.0.1 …",
        0.0
    );
    let cp = tokio::task::spawn_blocking(|| support::control_plane(Setup::shipped()))
        .await
        .map_err(|e| Outcome::Failed(format!("the control plane did not start: {e}")))?;
    let t = &cp.timings;
    println!(
        "[{:7.2}s] control plane {} up in {:.1}s (etcd {:.1}s, kube-apiserver {:.1}s, {} CRDs {:.1}s; \
         the E2EMachineTemplate CRD of tests/fixtures is among them)",
        t0.elapsed().as_secs_f64(),
        cp.server,
        t.total.as_secs_f64(),
        t.etcd.as_secs_f64(),
        t.apiserver.as_secs_f64(),
        t.crd_count,
        t.crds.as_secs_f64(),
    );
    demo(cp, t0).await.map_err(Outcome::Failed)
}

/// Prints the timeline: before the scale cycle, seconds since the start of the run; during it,
/// seconds since the pending pod appeared. The reconciler's actions are printed in between.
struct Timeline {
    start: Instant,
    cycle: Option<Instant>,
    steps: Vec<(Duration, String)>,
}

impl Timeline {
    fn stamp(&self, at: Instant) -> String {
        match self.cycle {
            Some(c) if at >= c => format!("{:>8}", format!("+{:.3}s", (at - c).as_secs_f64())),
            _ => format!("{:7.2}s", (at - self.start).as_secs_f64()),
        }
    }

    fn print(&self, at: Instant, text: &str) {
        let stamp = self.stamp(at);
        for (i, line) in text.lines().enumerate() {
            if i == 0 {
                println!("[{stamp}] {line}");
            } else {
                println!("{:width$}   {line}", "", width = stamp.len());
            }
        }
    }

    /// A line of the timeline; during the scale cycle it is also a step of the summary.
    fn step(&mut self, reconciler: Option<&Reconciler>, text: &str) {
        if let Some(r) = reconciler {
            self.flush(r);
        }
        let now = Instant::now();
        self.print(now, text);
        if let Some(c) = self.cycle {
            let first = text.lines().next().unwrap_or_default().to_string();
            self.steps.push((now - c, first));
        }
    }

    /// Prints what the reconciler did since the last call.
    fn flush(&self, reconciler: &Reconciler) {
        for (at, action) in reconciler.take_actions() {
            self.print(at, &format!("    fake CAPI/kubelet: {action}"));
        }
    }
}

/// Waits for `check` with the demo's deadline.
async fn wait<T, F, Fut>(what: &str, mut check: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, String>>,
{
    poll_until(what, TIMEOUT, Duration::from_millis(20), || {
        let fut = check();
        async move {
            match fut.await {
                Ok(Some(v)) => Check::Done(v),
                Ok(None) => Check::Wait("not yet".into()),
                Err(e) => Check::Wait(e),
            }
        }
    })
    .await
}

fn err(what: impl std::fmt::Display) -> impl FnOnce(kube::Error) -> String {
    move |e| format!("{what}: {e}")
}

async fn demo(cp: &'static ControlPlane, t0: Instant) -> Result<(), String> {
    let mut tl = Timeline {
        start: t0,
        cycle: None,
        steps: Vec::new(),
    };
    let client = cp.admin_client().await;
    let kubeconfig = cp.admin_kubeconfig();

    // --- the example objects -------------------------------------------------------------------
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
    let applied = apply_examples(&client).await?;
    tl.step(
        None,
        &format!("namespace {NS}: objects from examples/*.yaml\n{applied}"),
    );

    // --- fake CAPI + kubelets, then the provider -------------------------------------------------
    let reconciler = Reconciler::start(client.clone(), NS);
    let capi = Capi::new(client.clone(), NS, CAPI_GROUP, "v1beta2");
    wait("MachinePool demo/pool has its Node", || async {
        let mp = capi
            .api(Kind::MachinePool)
            .get("pool")
            .await
            .map_err(|e| e.to_string())?;
        Ok((mp.data["status"]["readyReplicas"] == json!(1)).then_some(()))
    })
    .await?;
    tl.step(
        Some(&reconciler),
        "fake CAPI/kubelet reconciler running for namespace demo (MachineSets, Machines, Nodes)",
    );

    let provider = start_provider(&[], kubeconfig).await;
    let mut rpc = Rpc::connect(&provider).await;
    tl.step(
        Some(&reconciler),
        &format!(
            "provider `serve` on {} (pid {}): CloudProvider SERVING after {:.2}s",
            provider.address,
            provider.pid(),
            provider.startup.as_secs_f64()
        ),
    );

    // --- what CA sees ------------------------------------------------------------------------------
    let check = run_check(kubeconfig).await?;
    tl.step(
        Some(&reconciler),
        &format!("`capi-autoscaler-provider check --cloud-config <kubeconfig>` {check}"),
    );
    let mut table = String::from("CA → NodeGroups (then TargetSize, NodeGroupNodes per group):");
    for group in rpc.groups().await {
        let target = rpc.target(&group.id).await.map_err(|e| e.to_string())?;
        let nodes = rpc.nodes(&group.id).await.map_err(|e| e.to_string())?;
        table.push_str(&format!(
            "\n  {:<36} min {:>2}  max {:>2}  target {:>2}  instances {}",
            group.id,
            group.min_size,
            group.max_size,
            target,
            nodes.len()
        ));
    }
    tl.step(Some(&reconciler), &table);

    // --- scale up ----------------------------------------------------------------------------------
    println!(
        "\n== a cluster-autoscaler cycle on {GROUP} (times from the pending pod; \
         CA's own waits — scan interval, scale-down-unneeded-time — skipped)"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    create_pending_pod(&pods).await?;
    tl.cycle = Some(Instant::now());
    tl.step(
        Some(&reconciler),
        &format!(
            "pod {NS}/{POD} Pending, PodScheduled=False/Unschedulable (requests cpu {POD_CPU}, \
             memory {POD_MEMORY}; nodeSelector pool=small)"
        ),
    );
    let existing = existing_node_verdicts(&client).await?;
    tl.step(
        Some(&reconciler),
        &format!("CA: simulates the pod on the existing nodes{existing}"),
    );

    let mut options = String::from("CA → NodeGroupTemplateNodeInfo for each group:");
    for group in rpc.groups().await {
        match template(&mut rpc, &group.id).await {
            Ok(node) => {
                let shape = Shape::of_template(&node);
                let verdict = match shape.fits() {
                    Ok(()) => "the pod fits".to_string(),
                    Err(why) => format!("no: {why}"),
                };
                options.push_str(&format!("\n  {:<36} {verdict}", group.id));
            }
            Err(status) => options.push_str(&format!(
                "\n  {:<36} {:?}: {}",
                group.id,
                status.code(),
                status.message()
            )),
        }
    }
    tl.step(Some(&reconciler), &options);
    let node = template(&mut rpc, GROUP).await.map_err(|e| e.to_string())?;
    let shape = Shape::of_template(&node);
    tl.step(
        Some(&reconciler),
        &format!(
            "TemplateNodeInfo({GROUP}) decoded (nodeBytes → k8s.io.api.core.v1.Node, {} bytes):\n  \
             name   {}\n  cpu    {}\n  memory {}\n  pods   {}\n  labels {}\n  taints {}",
            node.encoded_len(),
            node.metadata
                .as_ref()
                .and_then(|m| m.name.clone())
                .unwrap_or_default(),
            shape.cpu,
            shape.memory,
            shape.pods,
            shape
                .labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", "),
            if shape.taints.is_empty() {
                "none".to_string()
            } else {
                shape.taints.join(", ")
            },
        ),
    );

    let before = capi.replicas(Kind::MachineDeployment, MD).await;
    let called = Instant::now();
    rpc.increase(GROUP, 1)
        .await
        .map_err(|e| format!("IncreaseSize: {e}"))?;
    tl.step(
        Some(&reconciler),
        &format!(
            "CA → NodeGroupIncreaseSize({GROUP}, delta 1): OK in {:.0} ms",
            called.elapsed().as_secs_f64() * 1000.0
        ),
    );
    let after = capi.replicas(Kind::MachineDeployment, MD).await;
    let target = rpc.target(GROUP).await.map_err(|e| e.to_string())?;
    tl.step(
        Some(&reconciler),
        &format!(
            "MachineDeployment {NS}/{MD} spec.replicas {before} → {after} (written by the provider); \
             NodeGroupTargetSize = {target}"
        ),
    );

    let machines = capi.api(Kind::Machine);
    let machine = wait("a Machine of md-small", || async {
        let list = machines
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(list.items.into_iter().find(|m| {
            m.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(&capi.key("deployment-name")))
                .is_some_and(|d| d == MD)
        }))
    })
    .await?;
    let machine_name = machine.metadata.name.clone().unwrap_or_default();
    tl.step(
        Some(&reconciler),
        &format!(
            "Machine {NS}/{machine_name} exists (providerID {})",
            machine.data["spec"]["providerID"].as_str().unwrap_or("-")
        ),
    );

    let nodes: Api<Node> = Api::all(client.clone());
    let node = wait("its Node Ready", || async {
        Ok(match nodes.get_opt(&machine_name).await {
            Ok(Some(n)) if node_ready(&n) => Some(n),
            Ok(_) => None,
            Err(e) => return Err(e.to_string()),
        })
    })
    .await?;
    let node_name = node.metadata.name.clone().unwrap_or_default();
    tl.step(Some(&reconciler), &format!("Node {node_name} Ready"));

    let running = wait("the provider lists the instance Running", || {
        let mut rpc = rpc.clone();
        async move {
            let instances = rpc.nodes(GROUP).await.map_err(|e| e.to_string())?;
            Ok(instances
                .into_iter()
                .find(|i| {
                    i.status.as_ref().map(|s| s.instance_state)
                        == Some(InstanceState::InstanceRunning as i32)
                })
                .map(|i| i.id))
        }
    })
    .await?;
    tl.step(
        Some(&reconciler),
        &format!("CA → NodeGroupNodes({GROUP}): {running} Running"),
    );

    let grpc_node = grpc_node_of(&node);
    let group = rpc.for_node(grpc_node.clone()).await;
    tl.step(
        Some(&reconciler),
        &format!(
            "CA → NodeGroupForNode({node_name}): {} (min {}, max {})",
            group.id, group.min_size, group.max_size
        ),
    );
    if group.id != GROUP {
        return Err(format!(
            "NodeGroupForNode answered {}, not {GROUP}",
            group.id
        ));
    }

    pods.create_subresource::<Value, Value>(
        "binding",
        POD,
        &PostParams::default(),
        &json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": POD, "namespace": NS},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node_name},
        }),
    )
    .await
    .map_err(err("bind the pod"))?;
    tl.step(
        Some(&reconciler),
        &format!("pod {NS}/{POD} bound to {node_name} (pods/binding, as kube-scheduler would)"),
    );
    let scale_up = tl.steps.last().map(|s| s.0).unwrap_or_default();

    // --- scale down --------------------------------------------------------------------------------
    pods.delete(POD, &DeleteParams::default().grace_period(0))
        .await
        .map_err(err("delete the pod"))?;
    wait("the pod is gone", || async {
        Ok(pods
            .get_opt(POD)
            .await
            .map_err(|e| e.to_string())?
            .is_none()
            .then_some(()))
    })
    .await?;
    tl.step(
        Some(&reconciler),
        &format!("pod {NS}/{POD} deleted: {node_name} is empty"),
    );
    let unneeded = unneeded_time(&mut rpc).await?;
    tl.step(
        Some(&reconciler),
        &format!(
            "CA → NodeGroupGetOptions({GROUP}): scaleDownUnneededTime {unneeded} \
             (CA's default 10m); CA would wait that long — skipped here"
        ),
    );
    let down_start = Instant::now();
    rpc.delete_nodes(GROUP, vec![grpc_node])
        .await
        .map_err(|e| format!("DeleteNodes: {e}"))?;
    tl.step(
        Some(&reconciler),
        &format!(
            "CA → NodeGroupDeleteNodes({GROUP}, [{node_name}]): OK in {:.0} ms",
            down_start.elapsed().as_secs_f64() * 1000.0
        ),
    );
    let marked = machines
        .get_opt(&machine_name)
        .await
        .map_err(|e| e.to_string())?
        .map(|m| {
            m.metadata
                .annotations
                .unwrap_or_default()
                .contains_key(&capi.delete_key())
        });
    let replicas = capi.replicas(Kind::MachineDeployment, MD).await;
    tl.step(
        Some(&reconciler),
        &format!(
            "Machine {machine_name}: {}; MachineDeployment spec.replicas {after} → {replicas}",
            match marked {
                Some(true) => format!("annotated {}", capi.delete_key()),
                Some(false) => "not annotated (!)".to_string(),
                None => "already deleted by the fake MachineSet controller".to_string(),
            }
        ),
    );
    wait("the Node is gone", || async {
        Ok(nodes
            .get_opt(&node_name)
            .await
            .map_err(|e| e.to_string())?
            .is_none()
            .then_some(()))
    })
    .await?;
    tl.step(
        Some(&reconciler),
        &format!("Machine and Node {node_name} gone"),
    );
    let target = rpc.target(GROUP).await.map_err(|e| e.to_string())?;
    wait("NodeGroupNodes lists no instance", || {
        let mut rpc = rpc.clone();
        async move {
            let instances = rpc.nodes(GROUP).await.map_err(|e| e.to_string())?;
            Ok(instances.is_empty().then_some(()))
        }
    })
    .await?;
    tl.step(
        Some(&reconciler),
        &format!("CA → NodeGroupTargetSize({GROUP}) = {target}; NodeGroupNodes: no instances"),
    );
    let scale_down = Instant::now() - down_start;

    // --- summary -----------------------------------------------------------------------------------
    println!("\n== summary");
    for (at, step) in &tl.steps {
        println!("  {:>8}  {step}", format!("+{:.3}s", at.as_secs_f64()));
    }
    println!(
        "  scale-up   (pending pod → Node Ready, pod bound): {:.2}s",
        scale_up.as_secs_f64()
    );
    println!(
        "  scale-down (DeleteNodes → Node gone, target 0):  {:.2}s",
        scale_down.as_secs_f64()
    );
    println!(
        "  control plane start {:.1}s; whole run so far {:.1}s",
        cp.timings.total.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    let errors = reconciler.errors();
    if !errors.is_empty() {
        println!("  reconciler errors: {errors:#?}");
    }
    let excerpt = log_excerpt(&provider.log_contents());
    println!("  provider log (WARN/ERROR, resolved problems, scale operations):");
    for line in excerpt.iter().take(30) {
        println!("    {line}");
    }
    let events = Api::<Event>::namespaced(client.clone(), NS)
        .list(&Default::default())
        .await
        .map_err(err("list Events"))?;
    println!("  Kubernetes Events in namespace {NS}:");
    for e in &events.items {
        let mut line = format!(
            "{} {} {}/{} ×{}: {}",
            e.type_.as_deref().unwrap_or("-"),
            e.reason.as_deref().unwrap_or("-"),
            e.regarding
                .as_ref()
                .and_then(|r| r.kind.as_deref())
                .unwrap_or("-"),
            e.regarding
                .as_ref()
                .and_then(|r| r.name.as_deref())
                .unwrap_or("-"),
            e.series.as_ref().map_or(1, |s| s.count),
            e.note.as_deref().unwrap_or_default(),
        );
        if line.chars().count() > 200 {
            line = line.chars().take(199).collect::<String>() + "…";
        }
        println!("    {line}");
    }
    println!(
        "\nstopping the provider (pid {}) and the reconciler",
        provider.pid()
    );
    drop(provider);
    drop(reconciler);
    Ok(())
}

/// Creates every Kubernetes object in examples/*.yaml (in file order); `status` goes through the
/// status subresource. Returns one line per object or file.
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
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value =
                serde_yaml::Value::deserialize(doc).map_err(|e| format!("parse {short}: {e}"))?;
            let mut object: Value =
                serde_json::to_value(value).map_err(|e| format!("{short}: {e}"))?;
            if object.is_null() {
                continue;
            }
            let (Some(api_version), Some(kind)) = (
                object["apiVersion"].as_str().map(str::to_string),
                object["kind"].as_str().map(str::to_string),
            ) else {
                report.push(format!(
                    "  {short:<44} skipped: a CA --cloud-config file, not an object"
                ));
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

/// Runs `capi-autoscaler-provider check --cloud-config <kubeconfig>` (60 s at most); returns its
/// exit code and stdout, indented.
async fn run_check(kubeconfig: &Path) -> Result<String, String> {
    let out = procs::work_dir().join("check.stdout");
    let errs = procs::work_dir().join("check.stderr");
    let file = |p: &Path| std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()));
    let mut command = Command::new(PROVIDER_BIN);
    command
        .arg("check")
        .arg("--cloud-config")
        .arg(kubeconfig)
        .stdin(Stdio::null())
        .stdout(file(&out)?)
        .stderr(file(&errs)?);
    let mut child = procs::spawn(command).map_err(|e| format!("start check: {e}"))?;
    let waited = procs::wait_exit(&mut child, "`check` exits", TIMEOUT).await;
    let status = match waited {
        Ok(status) => status,
        Err(e) => {
            procs::kill_and_reap(&mut child);
            return Err(e);
        }
    };
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    let stderr = std::fs::read_to_string(&errs).unwrap_or_default();
    let code = status
        .code()
        .map_or("a signal".to_string(), |c| c.to_string());
    let meaning = match status.code() {
        Some(0) => "no problems",
        Some(1) => "problems reported, see PROBLEMS",
        _ => "failed",
    };
    let mut text = format!("exited {code} ({meaning}):");
    for line in stdout.lines() {
        text.push_str(&format!("\n  | {line}"));
    }
    if !matches!(status.code(), Some(0 | 1)) {
        text.push_str(&format!("\n  stderr:\n{stderr}"));
        return Err(text);
    }
    Ok(text)
}

async fn create_pending_pod(pods: &Api<Pod>) -> Result<(), String> {
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": POD, "namespace": NS, "labels": {"app": POD}},
        "spec": {
            "nodeSelector": {"pool": "small"},
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
    // No scheduler runs: say what kube-scheduler would (CA counts exactly such pods as unschedulable).
    pods.patch_status(
        POD,
        &PatchParams::default(),
        &Patch::Merge(&json!({"status": {"conditions": [{
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector.",
        }]}})),
    )
    .await
    .map_err(err("mark the pod Unschedulable"))?;
    Ok(())
}

async fn template(rpc: &mut Rpc, id: &str) -> Result<pb::Node, tonic::Status> {
    let response = rpc
        .client
        .node_group_template_node_info(NodeGroupTemplateNodeInfoRequest { id: id.into() })
        .await?
        .into_inner();
    pb::Node::decode(response.node_bytes.as_slice())
        .map_err(|e| tonic::Status::internal(format!("nodeBytes is no v1.Node: {e}")))
}

async fn unneeded_time(rpc: &mut Rpc) -> Result<String, String> {
    let ten_minutes = prost_types::Duration {
        seconds: 600,
        nanos: 0,
    };
    let options = rpc
        .client
        .node_group_get_options(NodeGroupAutoscalingOptionsRequest {
            id: GROUP.into(),
            defaults: Some(NodeGroupAutoscalingOptions {
                scale_down_utilization_threshold: 0.5,
                scale_down_gpu_utilization_threshold: 0.5,
                scale_down_unneeded_duration: Some(ten_minutes),
                scale_down_unready_duration: Some(prost_types::Duration {
                    seconds: 1200,
                    nanos: 0,
                }),
                max_node_provision_duration: Some(prost_types::Duration {
                    seconds: 900,
                    nanos: 0,
                }),
                ..Default::default()
            }),
        })
        .await
        .map_err(|e| format!("NodeGroupGetOptions: {e}"))?
        .into_inner()
        .node_group_autoscaling_options;
    Ok(match options.and_then(|o| o.scale_down_unneeded_duration) {
        Some(d) if d.seconds % 60 == 0 => format!("{}m", d.seconds / 60),
        Some(d) => format!("{}s", d.seconds),
        None => "(CA's default: no per-group options)".into(),
    })
}

fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The node as CA's externalgrpc client sends it: providerID, name, labels, annotations.
fn grpc_node_of(node: &Node) -> ExternalGrpcNode {
    let to_map = |m: &Option<BTreeMap<String, String>>| -> HashMap<String, String> {
        m.clone().unwrap_or_default().into_iter().collect()
    };
    ExternalGrpcNode {
        provider_id: node
            .spec
            .as_ref()
            .and_then(|s| s.provider_id.clone())
            .unwrap_or_default(),
        name: node.metadata.name.clone().unwrap_or_default(),
        labels: to_map(&node.metadata.labels),
        annotations: to_map(&node.metadata.annotations),
    }
}

/// What CA's simulation looks at, for the demo's pod: allocatable, labels, taints.
struct Shape {
    cpu: String,
    memory: String,
    pods: String,
    labels: BTreeMap<String, String>,
    taints: Vec<String>,
}

impl Shape {
    fn of_template(node: &pb::Node) -> Shape {
        let allocatable = node
            .status
            .as_ref()
            .map(|s| &s.allocatable)
            .cloned()
            .unwrap_or_default();
        let get = |k: &str| {
            allocatable
                .get(k)
                .and_then(|q| q.string.clone())
                .unwrap_or_default()
        };
        Shape {
            cpu: get("cpu"),
            memory: get("memory"),
            pods: get("pods"),
            labels: node
                .metadata
                .as_ref()
                .map(|m| m.labels.clone())
                .unwrap_or_default(),
            taints: node
                .spec
                .as_ref()
                .map(|s| {
                    s.taints
                        .iter()
                        .map(|t| {
                            taint_string(
                                t.key.as_deref().unwrap_or_default(),
                                t.value.as_deref().unwrap_or_default(),
                                t.effect.as_deref().unwrap_or_default(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    fn of_node(node: &Node) -> Shape {
        let allocatable = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.clone())
            .unwrap_or_default();
        let get = |k: &str| allocatable.get(k).map(|q| q.0.clone()).unwrap_or_default();
        Shape {
            cpu: get("cpu"),
            memory: get("memory"),
            pods: get("pods"),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            taints: node
                .spec
                .as_ref()
                .and_then(|s| s.taints.clone())
                .unwrap_or_default()
                .iter()
                .map(|t| taint_string(&t.key, t.value.as_deref().unwrap_or_default(), &t.effect))
                .collect(),
        }
    }

    /// Whether the demo's pod fits an empty node of this shape, or why not.
    fn fits(&self) -> Result<(), String> {
        let amount = |q: &str| {
            kube_quantity::ParsedQuantity::try_from(q)
                .ok()
                .and_then(|p| p.to_bytes_f64())
                .unwrap_or(0.0)
        };
        if self.labels.get("pool").map(String::as_str) != Some("small") {
            return Err(format!(
                "nodeSelector pool=small (label pool is {})",
                self.labels
                    .get("pool")
                    .map_or("absent".to_string(), |v| format!("{v:?}"))
            ));
        }
        if let Some(t) = self
            .taints
            .iter()
            .find(|t| t.ends_with(":NoSchedule") || t.ends_with(":NoExecute"))
        {
            return Err(format!("taint {t} not tolerated"));
        }
        if amount(&self.cpu) < amount(POD_CPU) {
            return Err(format!("cpu {} < {POD_CPU}", self.cpu));
        }
        if amount(&self.memory) < amount(POD_MEMORY) {
            return Err(format!("memory {} < {POD_MEMORY}", self.memory));
        }
        Ok(())
    }
}

fn taint_string(key: &str, value: &str, effect: &str) -> String {
    if value.is_empty() {
        format!("{key}:{effect}")
    } else {
        format!("{key}={value}:{effect}")
    }
}

/// Why the pod fits none of the existing nodes (each one's verdict).
async fn existing_node_verdicts(client: &Client) -> Result<String, String> {
    let nodes = Api::<Node>::all(client.clone())
        .list(&Default::default())
        .await
        .map_err(|e| format!("list Nodes: {e}"))?;
    let mut text = String::new();
    for node in &nodes.items {
        let name = node.metadata.name.clone().unwrap_or_default();
        let verdict = match Shape::of_node(node).fits() {
            Ok(()) => "fits (!)".to_string(),
            Err(why) => format!("no: {why}"),
        };
        text.push_str(&format!("\n  {name:<36} {verdict}"));
    }
    if nodes.items.is_empty() {
        text.push_str("\n  (no nodes)");
    }
    text.push_str("\n  → still unschedulable: CA looks for a node group to scale up");
    Ok(text)
}

/// The provider log's WARN and ERROR lines and its scale operations (the actuator's lines), without
/// colours and timestamps, shortened.
fn log_excerpt(log: &str) -> Vec<String> {
    let mut lines = Vec::new();
    for raw in log.lines() {
        let mut plain = String::with_capacity(raw.len());
        let mut chars = raw.chars();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                // An escape sequence: up to and including its final letter.
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                plain.push(c);
            }
        }
        let mut words = plain.split_whitespace();
        let (Some(_time), Some(level), Some(target)) = (words.next(), words.next(), words.next())
        else {
            continue;
        };
        if matches!(level, "WARN" | "ERROR")
            || target.contains("::actuator")
            || plain.contains("problem resolved")
        {
            let rest = plain
                .split_once(target)
                .map(|(_, r)| r.trim())
                .unwrap_or_default();
            let mut line = format!("{level:<5} {target} {rest}");
            if line.chars().count() > 200 {
                line = line.chars().take(199).collect::<String>() + "…";
            }
            lines.push(line);
        }
    }
    lines
}
