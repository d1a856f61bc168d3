//! One scenario with the real cluster-autoscaler on the real Cluster API manager (the one of this
//! test binary, `capi_manager`): its own namespace with Cluster [`CLUSTER`] of the stand-in
//! (`standin::workload_cluster`), the stand-in cloud and kubelets, MachineDeployments on stand-in
//! templates, this provider limited to the namespace by auto-discovery, a CA process pointed at it,
//! and a record of every Machine deletion taken from a watch ([`MachineDeletions`]), which is how a
//! test knows whether CAPI deleted a Machine that carried no delete mark.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{DynamicObject, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::task::AbortHandle;

use super::autoscaler::{Autoscaler, AutoscalerProcess};
use super::capi::{Capi, Kind};
use super::capi_manager::{CapiManager, capi_manager};
use super::control_plane::ControlPlane;
use super::faults::{bound_violations, etcd_versions};
use super::procs::{self, Check, poll_until};
use super::real_capi::{self, CAPACITY, DELETE_MACHINE, MAX_SIZE, MIN_SIZE, api, create};
use super::resuming_watch::{Watched, watch_resuming};
use super::standin::{self, StandIn};
use super::workload::{self, scenario_labels};
use super::{CAPI_GROUP, ProviderProcess, start_provider};

/// The Cluster every scenario's groups belong to (unless a scenario makes another).
pub const CLUSTER: &str = "workload";

/// A Machine CAPI began to delete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deletion {
    pub machine: String,
    /// The Node of its `status.nodeRef` (the stand-in names Nodes after their Machines).
    pub node: Option<String>,
    /// Whether it carried `cluster.x-k8s.io/delete-machine` when its deletion began.
    pub marked: bool,
}

pub struct RealCapiScenario {
    pub name: String,
    pub manager: &'static CapiManager,
    pub cp: &'static ControlPlane,
    pub client: Client,
    pub ns: String,
    /// The namespace's Cluster API objects at v1beta2 (the storage version).
    pub capi: Capi,
    pub standin: StandIn,
    pub deletions: MachineDeletions,
    pub provider: Option<ProviderProcess>,
    pub ca: Option<AutoscalerProcess>,
    started: Instant,
}

impl RealCapiScenario {
    /// A fresh namespace on the real manager's control plane with Cluster [`CLUSTER`] ready (its
    /// infrastructure provisioned, control plane initialized, remote connection up), the stand-in
    /// running and Machine deletions recorded.
    pub async fn new(name: &str) -> RealCapiScenario {
        RealCapiScenario::on(name, capi_manager()).await
    }

    /// [`RealCapiScenario::new`] on `manager` (e.g. another pinned release: `capi_manager_of`).
    pub async fn on(name: &str, manager: &'static CapiManager) -> RealCapiScenario {
        let started = Instant::now();
        let cp = manager.cp;
        let client = cp.admin_client().await;
        let ns = cp.fresh_namespace().await;
        standin::workload_cluster(&client, cp, &ns, CLUSTER).await;
        let standin = StandIn::start(client.clone(), &ns);
        let capi = Capi::new(client.clone(), &ns, CAPI_GROUP, "v1beta2");
        let deletions = MachineDeletions::start(&capi).await;
        eprintln!(
            "e2e: scenario {name} in namespace {ns} (real Cluster API {})",
            manager.version
        );
        RealCapiScenario {
            name: name.into(),
            manager,
            cp,
            client,
            ns,
            capi,
            standin,
            deletions,
            provider: None,
            ca: None,
            started,
        }
    }

    /// A stand-in machine template whose Nodes have `cpu` and `memory` (110 pods), in its status
    /// (the scale-from-zero contract) unless `in_status` is false: then the template says nothing
    /// and the stand-in's Nodes get its default 2 CPUs / 4Gi.
    pub async fn template(&self, name: &str, cpu: &str, memory: &str, in_status: bool) {
        let size = [("cpu", cpu), ("memory", memory), ("pods", "110")];
        let size: &[(&str, &str)] = if in_status { &size } else { &[] };
        standin::create_template(&self.client, &self.ns, name, size).await;
    }

    /// A v1beta2 MachineDeployment of [`CLUSTER`] on stand-in template `template`, with autoscaler
    /// bounds, `replicas` and the scenario label on its Nodes' template (capacity annotation
    /// `labels`).
    pub fn md(&self, name: &str, template: &str, min: i64, max: i64, replicas: i64) -> Value {
        json!({
            "apiVersion": format!("{CAPI_GROUP}/v1beta2"),
            "kind": "MachineDeployment",
            "metadata": {"name": name, "annotations": {
                MIN_SIZE: min.to_string(),
                MAX_SIZE: max.to_string(),
                format!("{CAPACITY}/labels"): scenario_labels(&self.ns, &[]),
            }},
            "spec": {
                "clusterName": CLUSTER,
                "replicas": replicas,
                "selector": {"matchLabels": {}},
                "template": {"spec": {
                    "clusterName": CLUSTER,
                    "version": standin::KUBERNETES_VERSION,
                    "bootstrap": {"dataSecretName": "stand-in-bootstrap"},
                    "infrastructureRef": standin::reference(standin::TEMPLATE_KIND, template),
                }},
            },
        })
    }

    /// Capacity annotations on MachineDeployment `md`: cpu, memory and 110 pods.
    pub fn capacity(mut md: Value, cpu: &str, memory: &str) -> Value {
        let annotations = &mut md["metadata"]["annotations"];
        annotations[format!("{CAPACITY}/cpu")] = json!(cpu);
        annotations[format!("{CAPACITY}/memory")] = json!(memory);
        annotations[format!("{CAPACITY}/maxPods")] = json!("110");
        md
    }

    /// `md` with annotation `key: value`.
    pub fn annotation(mut md: Value, key: &str, value: &str) -> Value {
        md["metadata"]["annotations"][key] = json!(value);
        md
    }

    /// Extra template labels (`k=v`) besides the scenario label.
    pub fn labels(&self, mut md: Value, extra: &[&str]) -> Value {
        md["metadata"]["annotations"][format!("{CAPACITY}/labels")] =
            json!(scenario_labels(&self.ns, extra));
        md
    }

    /// Creates MachineDeployment `md` (through CAPI's webhooks).
    pub async fn create_md(&self, md: &Value) {
        let mds = api(&self.client, &self.ns, "v1beta2", "MachineDeployment");
        if let Err(e) = create(&mds, md).await {
            self.fail(&format!(
                "create MachineDeployment {}/{}: {e}",
                self.ns, md["metadata"]["name"]
            ));
        }
    }

    /// A v1beta2 MachinePool `name` of [`CLUSTER`] on the stand-in machine pool of the same name,
    /// with autoscaler bounds, `replicas` and the scenario label (as [`RealCapiScenario::md`]).
    pub fn mp(&self, name: &str, min: i64, max: i64, replicas: i64) -> Value {
        let mut mp = self.md(name, "unused", min, max, replicas);
        mp["kind"] = json!("MachinePool");
        mp["spec"] = json!({
            "clusterName": CLUSTER,
            "replicas": replicas,
            "template": {"spec": {
                "clusterName": CLUSTER,
                "version": standin::KUBERNETES_VERSION,
                "bootstrap": {"dataSecretName": "stand-in-bootstrap"},
                "infrastructureRef": standin::reference(standin::MACHINE_POOL_KIND, name),
            }},
        });
        mp
    }

    /// Creates the stand-in machine pool MachinePool `mp` refers to (named the same, with spec
    /// `infra_spec`), then `mp` (through CAPI's webhooks).
    pub async fn create_pool(&self, mp: &Value, infra_spec: Value) {
        let name = mp["metadata"]["name"].as_str().unwrap_or_default();
        let ar = standin::resource(standin::MACHINE_POOL_KIND);
        let infra = DynamicObject::new(name, &ar).data(json!({ "spec": infra_spec }));
        if let Err(e) = Api::<DynamicObject>::namespaced_with(self.client.clone(), &self.ns, &ar)
            .create(&PostParams::default(), &infra)
            .await
        {
            self.fail(&format!(
                "create {} {name}: {e}",
                standin::MACHINE_POOL_KIND
            ));
        }
        if let Err(e) = create(&self.capi.api(Kind::MachinePool), mp).await {
            self.fail(&format!("create MachinePool {name}: {e}"));
        }
    }

    /// How many versions of group `name` (`plural` of its kind) etcd at `etcd` holds, and those
    /// whose replicas lie outside the bounds of the version written over (invariant 2).
    pub async fn stored_bound_violations(
        &self,
        etcd: &str,
        plural: &str,
        name: &str,
    ) -> (usize, Vec<String>) {
        let (min_key, max_key) = (self.capi.min_key(), self.capi.max_key());
        let versions = etcd_versions(etcd, CAPI_GROUP, plural, &self.ns, name, &min_key, &max_key)
            .await
            .unwrap_or_else(|e| self.fail(&format!("{name}'s versions from etcd: {e}")));
        (versions.len(), bound_violations(&versions))
    }

    /// Starts the provider limited to this namespace (plus `args`) with the admin identity.
    pub async fn start_provider(&mut self, args: &[&str]) -> &ProviderProcess {
        let kubeconfig = self.cp.admin_kubeconfig().to_path_buf();
        self.start_provider_as(&kubeconfig, args).await
    }

    /// Starts the provider limited to this namespace (plus `args`) with the identity of `kubeconfig`.
    pub async fn start_provider_as(
        &mut self,
        kubeconfig: &Path,
        args: &[&str],
    ) -> &ProviderProcess {
        let discovery = format!("clusterapi:namespace={}", self.ns);
        let mut all = vec!["--node-group-auto-discovery", discovery.as_str()];
        all.extend_from_slice(args);
        let provider = start_provider(&all, kubeconfig).await;
        self.provider.insert(provider)
    }

    /// CA's defaults for this scenario, pointed at the running provider.
    pub fn autoscaler(&self) -> Autoscaler {
        let provider = self
            .provider
            .as_ref()
            .expect("start the provider before CA");
        Autoscaler::new(&self.ns, &provider.address)
    }

    /// Starts `ca` (see [`RealCapiScenario::autoscaler`]).
    pub async fn start_ca(&mut self, ca: Autoscaler) -> &mut AutoscalerProcess {
        let process = ca.start(self.cp).await;
        self.ca.insert(process)
    }

    /// The Nodes of the Machines CAPI deleted that carried the mark, sorted.
    pub fn deleted_marked(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self
            .deletions
            .all()
            .into_iter()
            .filter(|d| d.marked)
            .map(|d| d.node.unwrap_or(d.machine))
            .collect();
        nodes.sort();
        nodes
    }

    /// Fails unless every Machine CAPI deleted carried the mark (CAPI deleted none on its own).
    pub fn check_every_deletion_marked(&self) {
        let unmarked: Vec<Deletion> = self
            .deletions
            .all()
            .into_iter()
            .filter(|d| !d.marked)
            .collect();
        self.check(
            unmarked.is_empty(),
            &format!("CAPI deleted Machines without the mark: {unmarked:?}"),
        );
    }

    /// The provider, CA and manager logs and the stand-in's record, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        if let Some(ca) = &self.ca {
            out.push_str(&format!(
                "--- cluster-autoscaler {} log {} (tail) ---\n{}\n",
                ca.version,
                ca.log.display(),
                ca.log_tail()
            ));
        }
        if let Some(p) = &self.provider {
            out.push_str(&format!(
                "--- provider log {} (tail) ---\n{}\n",
                p.log.display(),
                procs::log_tail(&p.log, 6000)
            ));
        }
        out.push_str(&format!(
            "--- CAPI manager log {} (tail) ---\n{}\n",
            self.manager.log.display(),
            self.manager.log_tail()
        ));
        let actions = self.standin.actions();
        let last = &actions[actions.len().saturating_sub(20)..];
        out.push_str(&format!(
            "stand-in errors: {:?}; last actions: {:?}\ndeletions: {:?}\n",
            self.standin.errors(),
            last.iter().map(|(_, a)| a).collect::<Vec<_>>(),
            self.deletions.all()
        ));
        out
    }

    /// Panics with `message` and the logs.
    pub fn fail(&self, message: &str) -> ! {
        panic!("scenario {}: {message}\n{}", self.name, self.logs())
    }

    /// Asserts `cond`, else fails with `message` and the logs.
    pub fn check(&self, cond: bool, message: &str) {
        if !cond {
            self.fail(message);
        }
    }

    /// MachineDeployment `md`'s `spec.replicas` now.
    pub async fn replicas(&self, md: &str) -> i64 {
        self.capi.replicas(Kind::MachineDeployment, md).await
    }

    /// Waits until `spec.replicas` of MachineDeployment `md` is `want`.
    pub async fn wait_replicas(&self, md: &str, want: i64, timeout: Duration) {
        let capi = &self.capi;
        let result = poll_until(
            &format!("MachineDeployment {}/{md} replicas = {want}", self.ns),
            timeout,
            Duration::from_millis(100),
            || async move {
                match capi.api(Kind::MachineDeployment).get(md).await {
                    Ok(o) if o.data["spec"]["replicas"] == json!(want) => Check::Done(()),
                    Ok(o) => Check::Wait(format!("replicas {}", o.data["spec"]["replicas"])),
                    Err(e) => Check::Wait(e.to_string()),
                }
            },
        )
        .await;
        if let Err(e) = result {
            self.fail(&e);
        }
    }

    /// Waits until the scenario's Nodes are exactly `want` (by name).
    pub async fn wait_nodes(&self, want: &[String]) {
        let want: BTreeSet<String> = want.iter().cloned().collect();
        let (client, ns) = (&self.client, &self.ns);
        let result = poll_until(
            "the scenario's Nodes",
            Duration::from_secs(90),
            Duration::from_millis(100),
            || {
                let want = want.clone();
                async move {
                    let got: BTreeSet<String> = match workload::scenario_nodes(client, ns).await {
                        Ok(names) => names.into_iter().collect(),
                        Err(e) => return Check::Wait(e),
                    };
                    if got == want {
                        Check::Done(())
                    } else {
                        Check::Wait(format!("Nodes {got:?}, want {want:?}"))
                    }
                }
            },
        )
        .await;
        if let Err(e) = result {
            self.fail(&e);
        }
    }

    /// Waits until the scenario has `n` Ready Nodes whose Machines CAPI linked (node ref set);
    /// returns their names, oldest first.
    pub async fn wait_node_count(&self, n: usize) -> Vec<String> {
        let (client, capi) = (&self.client, &self.capi);
        let ns = &self.ns;
        let result = poll_until(
            &format!("{n} Nodes with their Machines"),
            Duration::from_secs(60),
            Duration::from_millis(100),
            || async move {
                let names = match workload::scenario_nodes(client, ns).await {
                    Ok(names) => names,
                    Err(e) => return Check::Wait(e),
                };
                if names.len() != n {
                    return Check::Wait(format!("Nodes {names:?}"));
                }
                let linked: BTreeSet<String> =
                    match capi.api(Kind::Machine).list(&Default::default()).await {
                        Ok(l) => l
                            .items
                            .iter()
                            .filter_map(|m| m.data["status"]["nodeRef"]["name"].as_str())
                            .map(String::from)
                            .collect(),
                        Err(e) => return Check::Wait(e.to_string()),
                    };
                if names.iter().all(|n| linked.contains(n)) {
                    Check::Done(names)
                } else {
                    Check::Wait(format!("Nodes {names:?}, linked by CAPI {linked:?}"))
                }
            },
        )
        .await;
        let names = result.unwrap_or_else(|e| self.fail(&e));
        let nodes: Api<Node> = Api::all(self.client.clone());
        let mut aged = Vec::new();
        for name in names {
            let node = nodes
                .get(&name)
                .await
                .unwrap_or_else(|e| self.fail(&e.to_string()));
            aged.push((node.metadata.creation_timestamp.map(|t| t.0), name));
        }
        aged.sort();
        aged.into_iter().map(|(_, n)| n).collect()
    }

    /// The names of the Machines in the namespace that are not being deleted.
    pub async fn machine_names(&self) -> Vec<String> {
        self.capi
            .api(Kind::Machine)
            .list(&Default::default())
            .await
            .unwrap_or_else(|e| self.fail(&e.to_string()))
            .items
            .into_iter()
            .filter(|m| m.metadata.deletion_timestamp.is_none())
            .filter_map(|m| m.metadata.name)
            .collect()
    }

    /// Waits for `n` full CA loops (from CA's own activity metric).
    pub async fn wait_loops(&mut self, n: u32) {
        let ca = self.ca.as_mut().expect("CA is running");
        ca.wait_loops(n, Duration::from_secs(30 + 5 * u64::from(n)))
            .await;
    }

    /// Waits until MachineDeployment `md` has exactly `n` Machines not being deleted, each with its
    /// Ready Node and CAPI's node ref; returns their names (each its Node's name) in CAPI's
    /// tie-break order (by name).
    pub async fn wait_machines_with_nodes(&self, md: &str, n: usize) -> Vec<String> {
        let (client, ns) = (&self.client, &self.ns);
        poll_until(
            &format!("{n} Machines of {md} with Nodes"),
            real_capi::MACHINES,
            Duration::from_millis(200),
            || real_capi::machines_with_nodes(client, ns, md, n),
        )
        .await
        .unwrap_or_else(|e| self.fail(&e))
        .into_iter()
        .collect()
    }

    /// Waits until no Machine of the namespace is being deleted and every Machine CAPI deleted is
    /// gone with its Node (so the deletion record is complete).
    pub async fn wait_deletions_done(&self) {
        let (capi, client) = (&self.capi, &self.client);
        let deletions = &self.deletions;
        let result = poll_until(
            "no Machine being deleted, the deleted Machines' Nodes gone",
            Duration::from_secs(90),
            Duration::from_millis(200),
            || async move {
                let machines = match capi.api(Kind::Machine).list(&ListParams::default()).await {
                    Ok(l) => l.items,
                    Err(e) => return Check::Wait(e.to_string()),
                };
                if let Some(m) = machines
                    .iter()
                    .find(|m| m.metadata.deletion_timestamp.is_some())
                {
                    return Check::Wait(format!(
                        "Machine {:?} still being deleted",
                        m.metadata.name
                    ));
                }
                let nodes: Api<Node> = Api::all(client.clone());
                for name in deletions.all().into_iter().map(|d| d.machine) {
                    match nodes.get_opt(&name).await {
                        Ok(None) => {}
                        Ok(Some(_)) => return Check::Wait(format!("Node {name} still there")),
                        Err(e) => return Check::Wait(e.to_string()),
                    }
                }
                Check::Done(())
            },
        )
        .await;
        if let Err(e) = result {
            self.fail(&e);
        }
    }

    /// Prints the scenario's wall time.
    pub fn passed(self) {
        procs::announce(&format!(
            "e2e: scenario {} passed in {:.1}s (real Cluster API {})",
            self.name,
            self.started.elapsed().as_secs_f64(),
            self.manager.version
        ));
    }
}

#[derive(Default)]
struct Deletions {
    /// In order of first sight.
    seen: Vec<Deletion>,
    /// Re-lists after the watch expired (a deletion could have been missed in between).
    gaps: usize,
    /// Every Machine seen and not yet gone, as last seen: a Machine gone between two lists (the
    /// watch expired, e.g. across an apiserver restart) is recorded from its last sight.
    known: std::collections::BTreeMap<String, Deletion>,
}

/// Every Machine of a namespace seen with a `deletionTimestamp` (or, should the watch miss that,
/// gone), and whether it then carried the delete-machine annotation: from a watch resumed from the last resourceVersion (each update is
/// seen, however fast CAPI finishes the deletion; a Machine's finalizer keeps it until CAPI removed
/// its Node). When the watch cannot resume (an apiserver restarted with a fresh watch cache) it
/// re-lists, and a Machine gone in between is recorded as last seen. Stopped when dropped.
pub struct MachineDeletions {
    state: Arc<Mutex<Deletions>>,
    task: AbortHandle,
}

impl Drop for MachineDeletions {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock(state: &Mutex<Deletions>) -> std::sync::MutexGuard<'_, Deletions> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Remembers `m` as last seen; records it the first time it is seen being deleted or `gone`, with
/// its mark at that moment.
fn record(state: &Mutex<Deletions>, m: &DynamicObject, gone: bool) {
    let machine = m.metadata.name.clone().unwrap_or_default();
    let marked = m
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(DELETE_MACHINE));
    let node = m.data["status"]["nodeRef"]["name"]
        .as_str()
        .map(String::from);
    let last = Deletion {
        machine: machine.clone(),
        node,
        marked,
    };
    let mut s = lock(state);
    if gone {
        s.known.remove(&machine);
    } else {
        s.known.insert(machine.clone(), last.clone());
    }
    if (gone || m.metadata.deletion_timestamp.is_some())
        && !s.seen.iter().any(|d| d.machine == machine)
    {
        s.seen.push(last);
    }
}

/// After a re-list: the Machines seen before and not listed now went while the watch was away;
/// each is recorded from its last sight.
fn record_vanished(state: &Mutex<Deletions>, listed: &[DynamicObject]) {
    let names: BTreeSet<String> = listed
        .iter()
        .filter_map(|m| m.metadata.name.clone())
        .collect();
    let mut s = lock(state);
    let vanished: Vec<Deletion> = s
        .known
        .values()
        .filter(|d| !names.contains(&d.machine))
        .cloned()
        .collect();
    for d in vanished {
        s.known.remove(&d.machine);
        if !s.seen.iter().any(|x| x.machine == d.machine) {
            s.seen.push(d);
        }
    }
}

impl MachineDeletions {
    pub async fn start(capi: &Capi) -> MachineDeletions {
        let api = capi.api(Kind::Machine);
        let state = Arc::new(Mutex::new(Deletions::default()));
        let shared = Arc::clone(&state);
        let task = watch_resuming(api, move |seen| match seen {
            Watched::Listed { objects, relisted } => {
                if relisted {
                    lock(&shared).gaps += 1;
                    record_vanished(&shared, objects);
                }
                for m in objects {
                    record(&shared, m, false);
                }
            }
            Watched::Changed(m) => record(&shared, m, false),
            Watched::Deleted(m) => record(&shared, m, true),
            Watched::Resumed => {}
        })
        .await
        .abort_handle();
        MachineDeletions { state, task }
    }

    /// Every Machine seen being deleted, in the order their deletion was seen.
    pub fn all(&self) -> Vec<Deletion> {
        lock(&self.state).seen.clone()
    }

    /// The Machines deleted with the delete mark, in the order their deletion was seen.
    pub fn marked(&self) -> Vec<String> {
        self.names(true)
    }

    /// The Machines deleted without the delete mark (a replica count lowered without its mark, or
    /// a MachineSet CAPI deleted whole).
    pub fn unmarked(&self) -> Vec<String> {
        self.names(false)
    }

    fn names(&self, marked: bool) -> Vec<String> {
        let s = lock(&self.state);
        s.seen
            .iter()
            .filter(|d| d.marked == marked)
            .map(|d| d.machine.clone())
            .collect()
    }

    /// How often the watch had to re-list: a deletion may have been missed in between.
    pub fn gaps(&self) -> usize {
        lock(&self.state).gaps
    }
}

/// Times of [`scale_up_and_down`].
#[derive(Clone, Copy, Debug)]
pub struct UpAndDown {
    /// Pod created → replicas raised.
    pub up: Duration,
    /// Pod created → pod bound to the new Node.
    pub bound: Duration,
    /// Pod deleted → replicas back to 0, the Node gone.
    pub down: Duration,
}

/// The core CA cycle on a zero-size MachineDeployment `md-a` (2 CPUs, 4Gi by capacity annotations;
/// the stand-in template says nothing): a pod that fits only it makes CA scale it up from zero; CAPI
/// makes the Machine, the stand-in its Node, the scheduler binds the pod there; once the pod is
/// deleted CA removes the empty Node through DeleteNodes, and CAPI deletes exactly that Machine (it
/// carried the mark) and its Node. Starts the provider (plus `provider_args`) and `ca` (built from
/// [`RealCapiScenario::autoscaler`] by the caller's `configure`).
pub async fn scale_up_and_down(
    s: &mut RealCapiScenario,
    provider_args: &[&str],
    configure: impl FnOnce(Autoscaler) -> Autoscaler,
) -> UpAndDown {
    use super::workload::PodSpec;
    s.template("md-a-tmpl", "2", "4Gi", false).await;
    let md = RealCapiScenario::capacity(s.md("md-a", "md-a-tmpl", 0, 3, 0), "2", "4Gi");
    s.create_md(&md).await;
    s.start_provider(provider_args).await;
    let ca = configure(s.autoscaler());
    s.start_ca(ca).await;

    let t0 = Instant::now();
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas("md-a", 1, Duration::from_secs(60)).await;
    let up = t0.elapsed();
    let node = workload::wait_bound(&s.client, &s.ns, "web", Duration::from_secs(60)).await;
    let bound = t0.elapsed();
    let nodes = workload::scenario_nodes(&s.client, &s.ns)
        .await
        .unwrap_or_else(|e| s.fail(&e));
    s.check(
        nodes == vec![node.clone()],
        &format!("one Node, the pod's: {nodes:?}"),
    );

    let t1 = Instant::now();
    workload::delete_pod(&s.client, &s.ns, "web").await;
    s.wait_replicas("md-a", 0, Duration::from_secs(90)).await;
    s.wait_nodes(&[]).await;
    let down = t1.elapsed();
    let deleted = s.deleted_marked();
    s.check(
        deleted == vec![node.clone()],
        &format!("CAPI deleted the Machine of {node} for its mark: {deleted:?}"),
    );
    s.check_every_deletion_marked();
    UpAndDown { up, bound, down }
}
