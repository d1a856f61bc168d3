//! The stand-in infrastructure and control plane provider for the real Cluster API manager
//! (`capi_manager`): it plays only what no controller here can, the cloud and the kubelets, and a
//! control plane that is up from the start. Everything Cluster API does itself (MachineSets,
//! Machines, delete order, drain, Node deletion, node refs, conditions) is left to the manager.
//!
//! Its API (tests/fixtures/standin-crds.yaml, group [`GROUP`], version [`VERSION`], CRDs labelled
//! `cluster.x-k8s.io/v1beta2: v1alpha1` as the v1beta2 contract asks):
//! - `StandInMachineTemplate`: an infrastructure machine template; `status.capacity` and
//!   `status.nodeInfo` say what its Nodes have (the scale-from-zero contract), 2 CPUs / 4Gi / 110
//!   pods when absent;
//! - `StandInMachine`: cloned from the template by CAPI for each Machine;
//! - `StandInMachinePool`: the instance group behind a MachinePool; the stand-in keeps its
//!   `spec.providerIDList` at the MachinePool's `spec.replicas` (new entries last, the newest dropped
//!   first: a cloud's choice, not CAPI's), a Ready Node per entry, `status.replicas` and
//!   `status.ready`, which is what CAPI v1.14's MachinePool controller reads; with
//!   `spec.machinePoolMachines: true` it plays an infrastructure provider with MachinePool
//!   Machines instead: one `StandInMachine` per instance (labelled with the pool and Cluster names,
//!   `status.infrastructureMachineKind` set, so CAPI makes a Machine for each), and on a decrement
//!   the instances whose Machine carries the delete mark go first, then the newest, by deleting
//!   their Machines (what the MachinePool Machines contract asks of infrastructure providers);
//! - `StandInCluster`: the infrastructure cluster, `status.initialization.provisioned` from the start
//!   (without one, Cluster API never sets the Cluster's `InfrastructureReady` condition True, and
//!   MachineHealthChecks never evaluate its Machines);
//! - `StandInControlPlane`: `status.initialization.controlPlaneInitialized` and
//!   `status.externalManagedControlPlane` true, `spec.version` = `status.version`, so the MachineSet
//!   preflight checks pass and CAPI drains and deletes Nodes.
//!
//! [`workload_cluster`] makes a Cluster (infrastructureRef to a `StandInCluster`, controlPlaneRef to a
//! `StandInControlPlane`) whose workload cluster is the test kube-apiserver itself, through the
//! `<cluster>-kubeconfig` Secret. [`StandIn::start`] runs the cloud and the kubelets of one namespace
//! as a poll loop: each `StandInMachine` gets `spec.providerID` (`standin:///<ns>/<name>`),
//! `status.initialization.provisioned: true` and a Ready Node of the same name and providerID (the
//! conditions CAPI reads: Ready True; Memory-, Disk- and PIDPressure False; the label
//! `e2e-scenario=<ns>` that only this namespace's workload pods select); pods on its Nodes that
//! are being deleted (evicted by a drain) are finished, as a kubelet would; the other pods bound there
//! stay as they are (no phase, no conditions) unless [`StandIn::run_pods`] asked for them to be
//! reported Running and Ready (what a disruption controller counts healthy). A Node is made once per
//! machine: one CAPI deleted is never made again. A Node whose instance is gone is deleted, as a
//! cloud's node lifecycle controller does (CAPI deletes a Node only through a Machine's node ref).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use k8s_openapi::jiff::{Timestamp, Unit};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams,
    PostParams,
};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::task::AbortHandle;

use super::control_plane::ControlPlane;
use super::procs::{Check, poll_until};
use super::workload::SCENARIO_LABEL;
use super::{CAPI_GROUP, capi_resource};

/// The stand-in's API group.
pub const GROUP: &str = "standin.e2e.capi-autoscaler-provider.test";
/// Its only version, the one that serves the v1beta2 contract.
pub const VERSION: &str = "v1alpha1";
pub const TEMPLATE_KIND: &str = "StandInMachineTemplate";
pub const MACHINE_KIND: &str = "StandInMachine";
pub const CONTROL_PLANE_KIND: &str = "StandInControlPlane";
pub const CLUSTER_KIND: &str = "StandInCluster";
pub const MACHINE_POOL_KIND: &str = "StandInMachinePool";
/// The Kubernetes version of the stand-in's control plane and kubelets (the test kube-apiserver's).
pub const KUBERNETES_VERSION: &str = "v1.36.2";
/// Label on every Node the stand-in makes: the namespace of its machine.
pub const NODE_LABEL: &str = "e2e.capi-autoscaler-provider.test/stand-in-namespace";
/// The annotation CAPI puts on an object cloned from a template (controllers/external).
const CLONED_FROM_NAME: &str = "cluster.x-k8s.io/cloned-from-name";
const CLUSTER_NAME_LABEL: &str = "cluster.x-k8s.io/cluster-name";
/// The label CAPI's MachinePool controller selects a pool's infrastructure machines by.
const POOL_NAME_LABEL: &str = "cluster.x-k8s.io/pool-name";
const DELETE_MACHINE: &str = "cluster.x-k8s.io/delete-machine";
/// `spec.machinePoolMachines: true` on a `StandInMachinePool`: it keeps its instances as
/// `StandInMachine`s CAPI makes Machines for (MachinePool Machines).
pub const POOL_MACHINES_FIELD: &str = "machinePoolMachines";
const PASS_INTERVAL: Duration = Duration::from_millis(200);
const MAX_ERRORS: usize = 100;

/// tests/fixtures/standin-crds.yaml.
pub fn crd_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/standin-crds.yaml")
}

/// The `ApiResource` of a stand-in kind.
pub fn resource(kind: &str) -> ApiResource {
    capi_resource(GROUP, VERSION, kind, &format!("{}s", kind.to_lowercase()))
}

/// A reference to a stand-in object as a v1beta2 Cluster API object holds it.
pub fn reference(kind: &str, name: &str) -> Value {
    json!({"apiGroup": GROUP, "kind": kind, "name": name})
}

/// The providerID the stand-in's cloud gives the machine `ns/name`.
pub fn provider_id(ns: &str, name: &str) -> String {
    format!("standin:///{ns}/{name}")
}

/// Creates a `StandInMachineTemplate` whose Nodes have `capacity` (resource → quantity, written to
/// `status.capacity` with `status.nodeInfo` linux/amd64; nothing written when empty).
pub async fn create_template(client: &Client, ns: &str, name: &str, capacity: &[(&str, &str)]) {
    let ar = resource(TEMPLATE_KIND);
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let object = DynamicObject::new(name, &ar).data(json!({"spec": {"template": {"spec": {}}}}));
    api.create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create {TEMPLATE_KIND} {ns}/{name}: {e}"));
    if capacity.is_empty() {
        return;
    }
    let capacity: BTreeMap<&str, &str> = capacity.iter().copied().collect();
    let status = json!({"status": {
        "capacity": capacity,
        "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux"},
    }});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap_or_else(|e| panic!("write the status of {TEMPLATE_KIND} {ns}/{name}: {e}"));
}

/// Makes the stand-in kubelet of Node `name` report Ready `False` (or `True` again), as a kubelet
/// whose node went bad does; the pressure conditions stay `False`.
pub async fn set_node_ready(client: &Client, name: &str, ready: bool) {
    let now = Timestamp::now()
        .round(Unit::Second)
        .unwrap_or_else(|_| Timestamp::now())
        .to_string();
    let (status, reason) = if ready {
        ("True", "KubeletReady")
    } else {
        ("False", "KubeletNotReady")
    };
    let patch = json!({"status": {"conditions": [{
        "type": "Ready", "status": status, "reason": reason, "message": "stand-in kubelet",
        "lastHeartbeatTime": now, "lastTransitionTime": now,
    }]}});
    Api::<Node>::all(client.clone())
        .patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch))
        .await
        .unwrap_or_else(|e| panic!("set Node {name} Ready {status}: {e}"));
}

/// The Kubernetes version the stand-in's control plane upgrades to in [`set_control_plane_upgrading`].
pub const UPGRADE_VERSION: &str = "v1.37.0";

/// Makes the `StandInControlPlane` `name` start an upgrade (`spec.version` to [`UPGRADE_VERSION`],
/// `status.version` left behind: Cluster API's MachineSet preflight check `ControlPlaneIsStable`
/// then holds every scale-up) or, with `false`, finish it (`status.version` caught up).
pub async fn set_control_plane_upgrading(client: &Client, ns: &str, name: &str, upgrading: bool) {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &resource(CONTROL_PLANE_KIND));
    let result = if upgrading {
        let spec = json!({"spec": {"version": UPGRADE_VERSION}});
        api.patch(name, &PatchParams::default(), &Patch::Merge(&spec))
            .await
    } else {
        let status = json!({"status": {"version": UPGRADE_VERSION}});
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
    };
    result
        .unwrap_or_else(|e| panic!("{CONTROL_PLANE_KIND} {ns}/{name} upgrading {upgrading}: {e}"));
}

/// A Cluster of the stand-in, its workload cluster being the test kube-apiserver.
pub struct WorkloadCluster {
    pub ns: String,
    pub name: String,
    /// From the Cluster's creation until CAPI reports it initialized and connected.
    pub ready_after: Duration,
}

/// Creates, in `ns`, a `StandInCluster` (provisioned), a `StandInControlPlane` (initialized,
/// externally managed), the `<name>-kubeconfig` Secret (the admin kubeconfig of `cp`) and Cluster
/// `name` referring to both; waits until CAPI has the Cluster's infrastructure provisioned and ready,
/// its control plane initialized and the remote connection up.
pub async fn workload_cluster(
    client: &Client,
    cp: &ControlPlane,
    ns: &str,
    name: &str,
) -> WorkloadCluster {
    let started = Instant::now();
    let (host, port) = cp
        .server
        .trim_start_matches("https://")
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
        .unwrap_or_else(|| panic!("host and port of {}", cp.server));
    let endpoint = json!({"host": host, "port": port});
    let ar = resource(CLUSTER_KIND);
    let infra_clusters: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let infra_cluster =
        DynamicObject::new(name, &ar).data(json!({"spec": {"controlPlaneEndpoint": endpoint}}));
    infra_clusters
        .create(&PostParams::default(), &infra_cluster)
        .await
        .unwrap_or_else(|e| panic!("create {CLUSTER_KIND} {ns}/{name}: {e}"));
    let status = json!({"status": {"initialization": {"provisioned": true}}});
    infra_clusters
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap_or_else(|e| panic!("write the status of {CLUSTER_KIND} {ns}/{name}: {e}"));

    let ar = resource(CONTROL_PLANE_KIND);
    let control_planes: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let control_plane = DynamicObject::new(name, &ar).data(json!({"spec": {
        "version": KUBERNETES_VERSION,
        "controlPlaneEndpoint": endpoint,
    }}));
    control_planes
        .create(&PostParams::default(), &control_plane)
        .await
        .unwrap_or_else(|e| panic!("create {CONTROL_PLANE_KIND} {ns}/{name}: {e}"));
    let status = json!({"status": {
        "initialization": {"controlPlaneInitialized": true},
        "externalManagedControlPlane": true,
        "version": KUBERNETES_VERSION,
    }});
    control_planes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap_or_else(|e| panic!("write the status of {CONTROL_PLANE_KIND} {ns}/{name}: {e}"));

    let kubeconfig = std::fs::read(cp.admin_kubeconfig())
        .unwrap_or_else(|e| panic!("read {}: {e}", cp.admin_kubeconfig().display()));
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(format!("{name}-kubeconfig")),
            labels: Some([(CLUSTER_NAME_LABEL.to_string(), name.to_string())].into()),
            ..Default::default()
        },
        type_: Some("cluster.x-k8s.io/secret".into()),
        data: Some([("value".to_string(), k8s_openapi::ByteString(kubeconfig))].into()),
        ..Default::default()
    };
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap_or_else(|e| panic!("create Secret {ns}/{name}-kubeconfig: {e}"));

    let ar = capi_resource(CAPI_GROUP, "v1beta2", "Cluster", "clusters");
    let clusters: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let cluster = DynamicObject::new(name, &ar).data(json!({"spec": {
        "infrastructureRef": reference(CLUSTER_KIND, name),
        "controlPlaneRef": reference(CONTROL_PLANE_KIND, name),
    }}));
    clusters
        .create(&PostParams::default(), &cluster)
        .await
        .unwrap_or_else(|e| panic!("create Cluster {ns}/{name}: {e}"));
    poll_until(
        &format!("Cluster {ns}/{name} initialized and connected by CAPI"),
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            match clusters.get(name).await {
                Ok(c) => match cluster_unready(&c.data["status"]) {
                    None => Check::Done(()),
                    Some(why) => Check::Wait(why),
                },
                Err(e) => Check::Wait(e.to_string()),
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    WorkloadCluster {
        ns: ns.into(),
        name: name.into(),
        ready_after: started.elapsed(),
    }
}

/// Why a v1beta2 Cluster `status` is not yet usable for Machines, or `None` when it is.
fn cluster_unready(status: &Value) -> Option<String> {
    let init = &status["initialization"];
    if init["infrastructureProvisioned"] != json!(true) {
        return Some(format!("infrastructure not provisioned: {status}"));
    }
    if init["controlPlaneInitialized"] != json!(true) {
        return Some(format!("control plane not initialized: {status}"));
    }
    for wanted in ["InfrastructureReady", "RemoteConnectionProbe"] {
        let condition = status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == wanted);
        if !condition.is_some_and(|c| c["status"] == "True") {
            return Some(format!("{wanted} not True: {condition:?}"));
        }
    }
    None
}

#[derive(Default)]
struct State {
    /// Machines (and pool instances) whose Node was made (never made twice).
    nodes_made: BTreeSet<String>,
    /// Instances made so far per machine pool: the next one's number.
    pool_instances: BTreeMap<String, u32>,
    /// Templates whose machines the cloud does not provision (yet).
    held: BTreeSet<String>,
    /// Pods bound to this namespace's Nodes are reported Running and Ready ([`StandIn::run_pods`]).
    run_pods: bool,
    actions: Vec<(Instant, String)>,
    errors: Vec<String>,
}

/// The stand-in cloud and kubelets of one namespace; stops when dropped.
pub struct StandIn {
    pub ns: String,
    state: Arc<Mutex<State>>,
    task: AbortHandle,
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

impl StandIn {
    /// Starts the poll loop in the current runtime.
    pub fn start(client: Client, ns: &str) -> StandIn {
        let state = Arc::new(Mutex::new(State::default()));
        let worker = Worker {
            client,
            ns: ns.to_string(),
            state: state.clone(),
        };
        let task = tokio::spawn(async move {
            loop {
                worker.pass().await;
                tokio::time::sleep(PASS_INTERVAL).await;
            }
        })
        .abort_handle();
        StandIn {
            ns: ns.to_string(),
            state,
            task,
        }
    }

    /// Machines cloned from template `name` stay unprovisioned (no providerID, no Node) until
    /// [`StandIn::release`]: a cloud that is slow to deliver. A machine pool of that name keeps
    /// its instances as they are (none added, none dropped) until then.
    pub fn hold(&self, template: &str) {
        lock(&self.state).held.insert(template.to_string());
    }

    /// Provisions the machines of a held template from the next pass on.
    pub fn release(&self, template: &str) {
        lock(&self.state).held.remove(template);
    }

    /// From the next pass on, reports each pod bound to this namespace's Nodes (and not being
    /// deleted) Running with its containers started and Ready, as a kubelet would once they run:
    /// what a disruption controller counts as healthy. Off by default: the other scenarios' pods
    /// stay Pending with a node, as they always were.
    pub fn run_pods(&self) {
        lock(&self.state).run_pods = true;
    }

    /// What it did, in order, with when.
    pub fn actions(&self) -> Vec<(Instant, String)> {
        lock(&self.state).actions.clone()
    }

    /// Failed API calls (retried on the next pass).
    pub fn errors(&self) -> Vec<String> {
        lock(&self.state).errors.clone()
    }
}

struct Worker {
    client: Client,
    ns: String,
    state: Arc<Mutex<State>>,
}

impl Worker {
    fn act(&self, action: String) {
        lock(&self.state).actions.push((Instant::now(), action));
    }

    fn error(&self, error: String) {
        let mut state = lock(&self.state);
        if state.errors.len() < MAX_ERRORS {
            state.errors.push(error);
        }
    }

    fn machines(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &self.ns, &resource(MACHINE_KIND))
    }

    async fn pass(&self) {
        match self.machines().list(&ListParams::default()).await {
            Ok(list) => {
                for machine in list.items {
                    if let Err(e) = self.provision(&machine).await {
                        self.error(e);
                    }
                }
            }
            Err(e) => self.error(format!("list {MACHINE_KIND}s in {}: {e}", self.ns)),
        }
        if let Err(e) = self.pools().await {
            self.error(e);
        }
        if let Err(e) = self.finish_deleted_pods().await {
            self.error(e);
        }
        if lock(&self.state).run_pods
            && let Err(e) = self.report_running_pods().await
        {
            self.error(e);
        }
        if let Err(e) = self.delete_nodes_of_gone_instances().await {
            self.error(e);
        }
    }

    /// Deletes this namespace's Nodes whose instance is gone (no `StandInMachine` of that name, no
    /// machine pool listing it), as a cloud's node lifecycle controller deletes the Node of a
    /// terminated instance. Cluster API deletes a Machine's Node itself only through its node ref:
    /// a Machine deleted before it had one (capacity cancelled while the cloud was still bringing
    /// it up) leaves its Node to the cloud. The Nodes are listed before the instances, and a Node
    /// is made only for an instance that exists, so a Node whose instance is missing from the later
    /// lists lost it.
    async fn delete_nodes_of_gone_instances(&self) -> Result<(), String> {
        let nodes = Api::<Node>::all(self.client.clone());
        let ours: Vec<(String, String)> = nodes
            .list(&ListParams::default().labels(&format!("{NODE_LABEL}={}", self.ns)))
            .await
            .map_err(|e| format!("list the Nodes of {}: {e}", self.ns))?
            .items
            .into_iter()
            .filter_map(|n| {
                let id = n.spec.as_ref()?.provider_id.clone()?;
                Some((n.metadata.name?, id))
            })
            .collect();
        if ours.is_empty() {
            return Ok(());
        }
        let mut instances: BTreeSet<String> = self
            .machines()
            .list(&ListParams::default())
            .await
            .map_err(|e| format!("list {MACHINE_KIND}s in {}: {e}", self.ns))?
            .items
            .iter()
            .filter_map(|m| m.metadata.name.as_ref())
            .map(|name| provider_id(&self.ns, name))
            .collect();
        let pools: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.ns, &resource(MACHINE_POOL_KIND));
        for pool in pools
            .list(&ListParams::default())
            .await
            .map_err(|e| format!("list {MACHINE_POOL_KIND}s in {}: {e}", self.ns))?
            .items
        {
            instances.extend(
                pool.data["spec"]["providerIDList"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(String::from)),
            );
        }
        for (name, id) in ours.iter().filter(|(_, id)| !instances.contains(id)) {
            match nodes.delete(name, &DeleteParams::default()).await {
                Ok(_) => self.act(format!("Node {name} deleted: its instance {id} is gone")),
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(format!("delete Node {name}: {e}")),
            }
        }
        Ok(())
    }

    /// Keeps each machine pool at the replicas of the MachinePool that refers to it.
    async fn pools(&self) -> Result<(), String> {
        let pools: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.ns, &resource(MACHINE_POOL_KIND));
        let pools = pools
            .list(&ListParams::default())
            .await
            .map_err(|e| format!("list {MACHINE_POOL_KIND}s in {}: {e}", self.ns))?;
        if pools.items.is_empty() {
            return Ok(());
        }
        let ar = capi_resource(CAPI_GROUP, "v1beta2", "MachinePool", "machinepools");
        let machine_pools =
            Api::<DynamicObject>::namespaced_with(self.client.clone(), &self.ns, &ar)
                .list(&ListParams::default())
                .await
                .map_err(|e| format!("list MachinePools in {}: {e}", self.ns))?;
        for pool in pools.items {
            let name = pool.metadata.name.clone().unwrap_or_default();
            let owner = machine_pools.items.iter().find(|mp| {
                let reference = &mp.data["spec"]["template"]["spec"]["infrastructureRef"];
                reference["kind"] == MACHINE_POOL_KIND && reference["name"] == name.as_str()
            });
            if pool.metadata.deletion_timestamp.is_some() || lock(&self.state).held.contains(&name)
            {
                continue;
            }
            let Some((owner, want)) =
                owner.and_then(|mp| Some((mp, mp.data["spec"]["replicas"].as_u64()?)))
            else {
                continue;
            };
            let want = usize::try_from(want).unwrap_or(0);
            if pool.data["spec"][POOL_MACHINES_FIELD] == json!(true) {
                self.pool_with_machines(&pool, owner, want).await?;
            } else {
                self.pool(&pool, want).await?;
            }
        }
        Ok(())
    }

    /// Brings machine pool `pool` (of MachinePool `owner`) to `want` instances the way an
    /// infrastructure provider with MachinePool Machines does: one `StandInMachine` per instance,
    /// labelled with the pool and Cluster names (CAPI's MachinePool controller makes a Machine for
    /// each), the kind in `status.infrastructureMachineKind`. On a decrement the instances whose
    /// Machine carries `cluster.x-k8s.io/delete-machine` go first, then the newest; an instance
    /// goes by deleting its Machine (CAPI drains, deletes the `StandInMachine` and the Node).
    /// `spec.providerIDList` lists the `StandInMachine`s that exist.
    async fn pool_with_machines(
        &self,
        pool: &DynamicObject,
        owner: &DynamicObject,
        want: usize,
    ) -> Result<(), String> {
        let name = pool.metadata.name.clone().unwrap_or_default();
        let mp_name = owner.metadata.name.clone().unwrap_or_default();
        let cluster = owner.data["spec"]["clusterName"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let selector = format!("{POOL_NAME_LABEL}={mp_name}");
        let instances = self
            .machines()
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| format!("list the {MACHINE_KIND}s of pool {name}: {e}"))?
            .items;
        let ar = capi_resource(CAPI_GROUP, "v1beta2", "Machine", "machines");
        let capi_machines: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.ns, &ar);
        let owners: BTreeMap<String, DynamicObject> = capi_machines
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| format!("list the Machines of MachinePool {mp_name}: {e}"))?
            .items
            .into_iter()
            .map(|m| (m.metadata.name.clone().unwrap_or_default(), m))
            .collect();
        let live: Vec<PoolInstance> = instances
            .iter()
            .filter(|i| i.metadata.deletion_timestamp.is_none())
            .filter_map(|i| {
                let instance = i.metadata.name.clone()?;
                let machine = owners.get(&instance);
                if machine.is_some_and(|m| m.metadata.deletion_timestamp.is_some()) {
                    return None;
                }
                Some(PoolInstance {
                    number: instance_number(&instance),
                    marked: machine.is_some_and(|m| {
                        m.metadata
                            .annotations
                            .as_ref()
                            .is_some_and(|a| a.contains_key(DELETE_MACHINE))
                    }),
                    has_machine: machine.is_some(),
                    name: instance,
                })
            })
            .collect();
        for leaving in leaving_instances(&live, want) {
            let result = if leaving.has_machine {
                capi_machines
                    .delete(&leaving.name, &DeleteParams::default())
                    .await
                    .map(|_| ())
            } else {
                self.machines()
                    .delete(&leaving.name, &DeleteParams::default())
                    .await
                    .map(|_| ())
            };
            match result {
                Ok(()) => self.act(format!(
                    "{MACHINE_POOL_KIND} {name}: instance {} leaves{}",
                    leaving.name,
                    if leaving.marked { " (marked)" } else { "" }
                )),
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(format!("remove instance {} of {name}: {e}", leaving.name)),
            }
        }
        for _ in live.len()..want {
            let n = {
                let mut state = lock(&self.state);
                let next = state.pool_instances.entry(name.clone()).or_insert(0);
                *next += 1;
                *next
            };
            let instance = format!("{name}-{n}");
            let mut object = DynamicObject::new(&instance, &resource(MACHINE_KIND))
                .data(json!({"spec": {"providerID": provider_id(&self.ns, &instance)}}));
            object.metadata.labels = Some(
                [
                    (POOL_NAME_LABEL.to_string(), mp_name.clone()),
                    (CLUSTER_NAME_LABEL.to_string(), cluster.clone()),
                ]
                .into(),
            );
            self.machines()
                .create(&PostParams::default(), &object)
                .await
                .map_err(|e| format!("create {MACHINE_KIND} {instance} of {name}: {e}"))?;
            self.act(format!(
                "{MACHINE_POOL_KIND} {name}: instance {instance} made"
            ));
        }
        let mut listed: Vec<(u32, String)> = instances
            .iter()
            .filter_map(|i| {
                let instance = i.metadata.name.clone()?;
                Some((instance_number(&instance), provider_id(&self.ns, &instance)))
            })
            .collect();
        listed.sort();
        let ids: Vec<String> = listed.into_iter().map(|(_, id)| id).collect();
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.ns, &resource(MACHINE_POOL_KIND));
        if pool.data["spec"]["providerIDList"] != json!(ids) {
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"providerIDList": ids}})),
            )
            .await
            .map_err(|e| format!("set the providerIDList of {MACHINE_POOL_KIND} {name}: {e}"))?;
            self.act(format!(
                "{MACHINE_POOL_KIND} {name}: providerIDList {ids:?}"
            ));
        }
        let status = json!({
            "replicas": ids.len(),
            "ready": true,
            "initialization": {"provisioned": true},
            "infrastructureMachineKind": MACHINE_KIND,
        });
        let current = &pool.data["status"];
        if current["replicas"] != status["replicas"]
            || current["ready"] != json!(true)
            || current["infrastructureMachineKind"] != json!(MACHINE_KIND)
        {
            write_pool_status(&api, &name, status).await?;
        }
        Ok(())
    }

    /// Brings machine pool `pool` to `want` instances, each with its Ready Node, and reports them.
    async fn pool(&self, pool: &DynamicObject, want: usize) -> Result<(), String> {
        let name = pool.metadata.name.clone().unwrap_or_default();
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.ns, &resource(MACHINE_POOL_KIND));
        let mut ids: Vec<String> = pool.data["spec"]["providerIDList"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(String::from))
            .collect();
        if ids.len() != want {
            let before = ids.len();
            ids.truncate(want);
            while ids.len() < want {
                let n = {
                    let mut state = lock(&self.state);
                    let next = state.pool_instances.entry(name.clone()).or_insert(0);
                    *next += 1;
                    *next
                };
                ids.push(provider_id(&self.ns, &format!("{name}-{n}")));
            }
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"providerIDList": ids}})),
            )
            .await
            .map_err(|e| format!("set the providerIDList of {MACHINE_POOL_KIND} {name}: {e}"))?;
            self.act(format!(
                "{MACHINE_POOL_KIND} {name}: {before} -> {} instances",
                ids.len()
            ));
        }
        for id in &ids {
            let Some(node_name) = id.rsplit('/').next() else {
                continue;
            };
            if lock(&self.state).nodes_made.contains(node_name) {
                continue;
            }
            self.make_node(node_name, id, &Value::Null).await?;
        }
        let status = json!({
            "replicas": ids.len(),
            "ready": true,
            "initialization": {"provisioned": true},
        });
        let current = &pool.data["status"];
        if current["replicas"] != status["replicas"] || current["ready"] != json!(true) {
            write_pool_status(&api, &name, status).await?;
        }
        Ok(())
    }

    /// Creates Ready Node `name` with providerID `id` and `capacity` (unless it exists), and
    /// records it as made.
    async fn make_node(&self, name: &str, id: &str, capacity: &Value) -> Result<(), String> {
        let node = ready_node(name, id, &self.ns, capacity)?;
        match Api::<Node>::all(self.client.clone())
            .create(&PostParams::default(), &node)
            .await
        {
            Ok(_) => self.act(format!("Node {name} Ready ({id})")),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(format!("create Node {name}: {e}")),
        }
        lock(&self.state).nodes_made.insert(name.to_string());
        Ok(())
    }

    /// Gives a machine its providerID, its provisioned status and its Ready Node.
    async fn provision(&self, machine: &DynamicObject) -> Result<(), String> {
        if machine.metadata.deletion_timestamp.is_some() {
            return Ok(());
        }
        let name = machine.metadata.name.clone().unwrap_or_default();
        let template = machine
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(CLONED_FROM_NAME))
            .cloned();
        if template
            .as_ref()
            .is_some_and(|t| lock(&self.state).held.contains(t))
        {
            return Ok(());
        }
        let id = provider_id(&self.ns, &name);
        if machine.data["spec"]["providerID"].as_str() != Some(id.as_str()) {
            match self
                .machines()
                .patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"providerID": id}})),
                )
                .await
            {
                Ok(_) => self.act(format!("{MACHINE_KIND} {name}: providerID {id}")),
                // CAPI deleted it since the list (a Machine cancelled before it was up).
                Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
                Err(e) => {
                    return Err(format!("set the providerID of {MACHINE_KIND} {name}: {e}"));
                }
            }
        }
        let made = lock(&self.state).nodes_made.contains(&name);
        if !made {
            let capacity = match template {
                Some(t) => self.template_status(&t).await?,
                None => Value::Null,
            };
            self.make_node(&name, &id, &capacity).await?;
        }
        if machine.data["status"]["initialization"]["provisioned"] != json!(true) {
            let status = json!({"status": {"initialization": {"provisioned": true}}});
            match self
                .machines()
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                .await
            {
                Ok(_) => self.act(format!("{MACHINE_KIND} {name}: provisioned")),
                // Its Node, made meanwhile, goes with the next pass (its instance is gone).
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(format!("write the status of {MACHINE_KIND} {name}: {e}")),
            }
        }
        Ok(())
    }

    /// `status` of template `name` (`null` when it has none).
    async fn template_status(&self, name: &str) -> Result<Value, String> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.ns, &resource(TEMPLATE_KIND));
        let template = api
            .get(name)
            .await
            .map_err(|e| format!("get {TEMPLATE_KIND} {}/{name}: {e}", self.ns))?;
        Ok(template.data["status"].clone())
    }

    /// The pods bound to this namespace's Nodes (what their kubelets would run).
    async fn pods_on_our_nodes(&self) -> Result<Vec<Pod>, String> {
        let nodes: BTreeSet<String> = Api::<Node>::all(self.client.clone())
            .list(&ListParams::default().labels(&format!("{NODE_LABEL}={}", self.ns)))
            .await
            .map_err(|e| format!("list the Nodes of {}: {e}", self.ns))?
            .items
            .into_iter()
            .filter_map(|n| n.metadata.name)
            .collect();
        if nodes.is_empty() {
            return Ok(Vec::new());
        }
        let pods = Api::<Pod>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|e| format!("list pods: {e}"))?;
        Ok(pods
            .items
            .into_iter()
            .filter(|pod| {
                pod.spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_ref())
                    .is_some_and(|n| nodes.contains(n))
            })
            .collect())
    }

    /// Deletes at once the pods on this namespace's Nodes that are being deleted (evicted): no
    /// kubelet runs to end their containers.
    async fn finish_deleted_pods(&self) -> Result<(), String> {
        for pod in self.pods_on_our_nodes().await? {
            if pod.metadata.deletion_timestamp.is_none() {
                continue;
            }
            let (ns, name) = (
                pod.metadata.namespace.unwrap_or_default(),
                pod.metadata.name.unwrap_or_default(),
            );
            let params = DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            };
            match Api::<Pod>::namespaced(self.client.clone(), &ns)
                .delete(&name, &params)
                .await
            {
                Ok(_) => self.act(format!("pod {ns}/{name} finished")),
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(format!("finish pod {ns}/{name}: {e}")),
            }
        }
        Ok(())
    }
}

impl Worker {
    /// Reports the pods bound to this namespace's Nodes that are not being deleted and not Ready
    /// yet as Running, their containers started and Ready (see [`StandIn::run_pods`]).
    async fn report_running_pods(&self) -> Result<(), String> {
        for pod in self.pods_on_our_nodes().await? {
            let ready = pod
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            if ready || pod.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let (ns, name) = (
                pod.metadata.namespace.clone().unwrap_or_default(),
                pod.metadata.name.clone().unwrap_or_default(),
            );
            let now = Timestamp::now()
                .round(Unit::Second)
                .unwrap_or_else(|_| Timestamp::now())
                .to_string();
            let containers: Vec<Value> = pod
                .spec
                .as_ref()
                .map(|s| s.containers.iter())
                .into_iter()
                .flatten()
                .map(|c| {
                    json!({
                        "name": c.name, "image": c.image.clone().unwrap_or_default(),
                        "imageID": "", "ready": true, "started": true, "restartCount": 0,
                        "state": {"running": {"startedAt": now}},
                    })
                })
                .collect();
            let condition =
                |type_: &str| json!({"type": type_, "status": "True", "lastTransitionTime": now});
            let status = json!({"status": {
                "phase": "Running",
                "startTime": now,
                "conditions": [
                    condition("PodScheduled"), condition("Initialized"),
                    condition("ContainersReady"), condition("Ready"),
                ],
                "containerStatuses": containers,
            }});
            match Api::<Pod>::namespaced(self.client.clone(), &ns)
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                .await
            {
                Ok(_) => self.act(format!("pod {ns}/{name} running")),
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                Err(e) => return Err(format!("report pod {ns}/{name} running: {e}")),
            }
        }
        Ok(())
    }
}

/// One instance of a machine pool with MachinePool Machines, as the stand-in decides removals.
#[derive(Clone, Debug, PartialEq, Eq)]
struct PoolInstance {
    name: String,
    /// Its place in the pool's order of creation.
    number: u32,
    /// Its Machine carries `cluster.x-k8s.io/delete-machine`.
    marked: bool,
    /// CAPI made its Machine already.
    has_machine: bool,
}

/// The number an instance `<pool>-<n>` was made with (0 when its name has none).
fn instance_number(name: &str) -> u32 {
    name.rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Which of `live` instances leave for the pool to have `want`: those whose Machine is marked
/// first, then the newest, as the MachinePool Machines contract asks of infrastructure providers.
fn leaving_instances(live: &[PoolInstance], want: usize) -> Vec<PoolInstance> {
    let mut order: Vec<&PoolInstance> = live.iter().collect();
    order.sort_by_key(|i| (!i.marked, std::cmp::Reverse(i.number)));
    order
        .into_iter()
        .take(live.len().saturating_sub(want))
        .cloned()
        .collect()
}

/// A Ready Node `name` with `provider_id`, sized by a template `status` (`capacity`, `nodeInfo`).
fn ready_node(name: &str, provider_id: &str, ns: &str, status: &Value) -> Result<Node, String> {
    let mut capacity: BTreeMap<String, Value> = status["capacity"]
        .as_object()
        .map(|m| m.clone().into_iter().collect())
        .unwrap_or_default();
    for (resource, default) in [("cpu", "2"), ("memory", "4Gi"), ("pods", "110")] {
        capacity
            .entry(resource.into())
            .or_insert_with(|| json!(default));
    }
    let arch = status["nodeInfo"]["architecture"]
        .as_str()
        .unwrap_or("amd64");
    let os = status["nodeInfo"]["operatingSystem"]
        .as_str()
        .unwrap_or("linux");
    let now = Timestamp::now()
        .round(Unit::Second)
        .unwrap_or_else(|_| Timestamp::now())
        .to_string();
    let condition = |type_: &str, status: &str, reason: &str| {
        json!({
            "type": type_, "status": status, "reason": reason,
            "message": "stand-in kubelet", "lastHeartbeatTime": now, "lastTransitionTime": now,
        })
    };
    let node = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": os,
            "kubernetes.io/arch": arch,
            NODE_LABEL: ns,
            SCENARIO_LABEL: ns,
        }},
        "spec": {"providerID": provider_id},
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                condition("Ready", "True", "KubeletReady"),
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID"),
            ],
            "addresses": [{"type": "Hostname", "address": name}],
            "nodeInfo": {
                "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "",
                "osImage": "stand-in", "containerRuntimeVersion": "stand-in://0",
                "kubeletVersion": KUBERNETES_VERSION, "kubeProxyVersion": "",
                "operatingSystem": os, "architecture": arch,
            },
        },
    });
    serde_json::from_value(node).map_err(|e| format!("Node {name} object: {e}"))
}

/// Writes `status` as the status of stand-in machine pool `name`.
async fn write_pool_status(
    api: &Api<DynamicObject>,
    name: &str,
    status: Value,
) -> Result<(), String> {
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(&json!({ "status": status })),
    )
    .await
    .map(|_| ())
    .map_err(|e| format!("write the status of {MACHINE_POOL_KIND} {name}: {e}"))
}
