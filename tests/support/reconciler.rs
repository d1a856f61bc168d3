//! An imitation of Cluster API's MachineDeployment and MachineSet controllers and of the kubelets,
//! in one namespace. It is not Cluster API, and it is kinder than Cluster API: it lists
//! MachineDeployments and MachineSets before Machines in one pass, so a lowered replica count is
//! always seen with its mark (the real controllers work from informer caches with no such
//! ordering); it acts within a pass (100 ms) where the real controllers take seconds under load, so
//! a Machine a DecreaseTargetSize cancels has always still no Node when it goes (with the real
//! MachineSet controller it may have registered by then, and the name tie-break picks another);
//! it deletes marked Machines first and then the newest (the real MachineSet
//! controller's default order is Random: marked first, then Machines without a node ref, then by
//! name); it never drains and has no webhooks, preflight checks, MachineHealthChecks, conversion,
//! rollouts or MachinePools.
//!
//! Every scenario that Cluster API can run in runs on the real Cluster API v1.14.2 manager
//! (`capi_manager`, with the stand-in cloud and kubelets of `standin`): `make demo`, the real-CA
//! scenarios, the version matrix, topology, migration, the model test (tests/model.rs), rollouts
//! (tests/real_capi/rollout.rs) and tests/real_capi*/. Where real Cluster API cannot run (CRDs under
//! a renamed `CAPI_GROUP`: its manager knows only `cluster.x-k8s.io`; v1beta1-only CRDs: no older
//! CAPI is served by the module proxy) no controller is needed: those binaries (tests/e2e_renamed,
//! tests/e2e_v1beta1) write the objects a controller would and use none. This file is left only for
//! the apiserver-kill fault test of tests/faults.rs, not moved to the real manager yet (issue 20);
//! once it is, nothing needs this imitation: delete the file.
//!
//! What it does, every [`ReconcilerConfig::interval`], in a tokio task aborted when the
//! [`Reconciler`] is dropped:
//! - **MachineDeployment → MachineSet**: one MachineSet `<md>-<hash>` per MachineDeployment,
//!   ownerReference `controller: true`, labels `cluster-name`/`deployment-name`; `spec.replicas`
//!   mirrored onto it.
//! - **MachineSet → Machines**: ownerReference to the MachineSet, labels `cluster-name`, `set-name`,
//!   `deployment-name`, `spec.providerID = e2e:///<ns>/<machine>`, and at once a Ready Node (name =
//!   Machine name, same providerID, the template's labels) and its status (`nodeRef`, phase
//!   `Running`). Scale-down deletes Machines carrying `cluster.x-k8s.io/delete-machine` first, then
//!   the newest; a deleted Machine's Node goes too.
//!
//! Nodes are cluster-scoped: MachineSet names carry a hash of namespace and MachineDeployment, and
//! every Machine name ends in a random suffix, so Node names do not collide across namespaces. Each
//! Node carries the label [`NAMESPACE_LABEL`]; Nodes without it are never touched. Failed API calls
//! are recorded ([`Reconciler::errors`]) and retried on the next pass; every action is recorded
//! ([`Reconciler::actions`]). Machines a test creates itself are counted (and may be scaled away)
//! but never get a Node.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use rand::Rng as _;
use serde_json::{Value, json};
use tokio::task::AbortHandle;

/// Label on every Node the reconciler creates: the namespace of its Machine.
pub const NAMESPACE_LABEL: &str = "e2e.capi-autoscaler-provider.test/namespace";
/// Annotation on every Machine the reconciler creates: creation time in Unix nanoseconds (orders
/// Machines created within the same second; "newest" goes first on scale-down).
const CREATED_ANNOTATION: &str = "e2e.capi-autoscaler-provider.test/created-nanos";
/// The API version of the objects it reads and writes.
const VERSION: &str = "v1beta2";
/// CAPI's random-suffix alphabet (no vowels, no look-alikes).
const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
/// At most this many errors are kept.
const MAX_ERRORS: usize = 100;

/// How the reconciler behaves.
#[derive(Clone, Debug)]
pub struct ReconcilerConfig {
    /// Pause between passes.
    pub interval: Duration,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        ReconcilerConfig {
            interval: Duration::from_millis(100),
        }
    }
}

impl ReconcilerConfig {
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }
}

/// What the task shares with its handle.
#[derive(Default)]
struct Shared {
    errors: Mutex<Vec<String>>,
    actions: Mutex<Vec<String>>,
}

/// A running reconciler for one namespace; stopped when dropped.
pub struct Reconciler {
    shared: Arc<Shared>,
    task: AbortHandle,
}

impl Drop for Reconciler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Reconciler {
    /// Starts with `config` in the current runtime.
    pub fn start_with(client: Client, ns: &str, config: ReconcilerConfig) -> Reconciler {
        let shared = Arc::new(Shared::default());
        let worker = Worker {
            client,
            ns: ns.to_string(),
            shared: shared.clone(),
        };
        let task = tokio::spawn(async move {
            loop {
                worker.pass().await;
                tokio::time::sleep(config.interval).await;
            }
        })
        .abort_handle();
        Reconciler { shared, task }
    }

    /// The API errors of the passes so far (the last 100).
    pub fn errors(&self) -> Vec<String> {
        lock(&self.shared.errors).clone()
    }

    /// Every action so far, in order.
    pub fn actions(&self) -> Vec<String> {
        lock(&self.shared.actions).clone()
    }

    /// The Machines deleted so far because they carried the delete-machine annotation.
    pub fn deleted_marked(&self) -> Vec<String> {
        self.actions()
            .iter()
            .filter_map(|a| {
                a.strip_prefix("deleted Machine ")?
                    .strip_suffix(" (delete-machine annotation)")
                    .map(str::to_string)
            })
            .collect()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// FNV-1a of `s`, as 5 characters of [`ALPHABET`].
fn short_hash(s: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (0..5)
        .map(|_| {
            let c = ALPHABET[(h % ALPHABET.len() as u64) as usize] as char;
            h /= ALPHABET.len() as u64;
            c
        })
        .collect()
}

fn random_suffix() -> String {
    let mut rng = rand::rng();
    (0..5)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

fn now_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

fn name_of(o: &DynamicObject) -> String {
    o.metadata.name.clone().unwrap_or_default()
}

fn deleting(o: &DynamicObject) -> bool {
    o.metadata.deletion_timestamp.is_some()
}

fn replicas_of(o: &DynamicObject) -> Option<i64> {
    o.data["spec"]["replicas"].as_i64()
}

fn annotations_of(o: &DynamicObject) -> BTreeMap<String, String> {
    o.metadata.annotations.clone().unwrap_or_default()
}

/// The name of the controller owner of `o` of kind `kind`.
fn controller_of(o: &DynamicObject, kind: &str) -> Option<String> {
    o.metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|r| r.kind == kind && r.controller == Some(true))
        .map(|r| r.name.clone())
}

fn string_map(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// Creation order: creationTimestamp, then the reconciler's nanosecond annotation, then the name.
fn age_key(o: &DynamicObject) -> (String, u128, String) {
    let created = o
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_default();
    let nanos = annotations_of(o)
        .get(CREATED_ANNOTATION)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (created, nanos, name_of(o))
}

struct Worker {
    client: Client,
    ns: String,
    shared: Arc<Shared>,
}

impl Worker {
    fn resource(&self, kind: &str, plural: &str) -> ApiResource {
        super::capi_resource(super::CAPI_GROUP, VERSION, kind, plural)
    }

    fn api(&self, kind: &str) -> Api<DynamicObject> {
        let plural = format!("{}s", kind.to_ascii_lowercase());
        Api::namespaced_with(self.client.clone(), &self.ns, &self.resource(kind, &plural))
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    fn key(&self, suffix: &str) -> String {
        format!("{}/{suffix}", super::CAPI_GROUP)
    }

    fn api_version(&self) -> String {
        format!("{}/{VERSION}", super::CAPI_GROUP)
    }

    fn error(&self, e: String) {
        let mut errors = lock(&self.shared.errors);
        if errors.len() >= MAX_ERRORS {
            errors.remove(0);
        }
        errors.push(e);
    }

    fn act(&self, what: String) {
        lock(&self.shared.actions).push(what);
    }

    async fn list(&self, kind: &str) -> Result<Vec<DynamicObject>, String> {
        let mut items = self
            .api(kind)
            .list(&ListParams::default())
            .await
            .map_err(|e| format!("list {kind}s in {}: {e}", self.ns))?
            .items;
        items.sort_by_key(age_key);
        Ok(items)
    }

    async fn pass(&self) {
        if let Err(e) = self.try_pass().await {
            self.error(e);
        }
    }

    /// One pass over the namespace. MachineDeployments and MachineSets are listed before Machines:
    /// a provider marks a Machine before it lowers replicas, so a lowered count is always seen with
    /// its mark.
    async fn try_pass(&self) -> Result<(), String> {
        let deployments = self.list("MachineDeployment").await?;
        let mut sets = self.list("MachineSet").await?;
        let nodes: BTreeSet<String> = self
            .nodes()
            .list(&ListParams::default().labels(&format!("{NAMESPACE_LABEL}={}", self.ns)))
            .await
            .map_err(|e| format!("list Nodes of {}: {e}", self.ns))?
            .items
            .into_iter()
            .filter_map(|n| n.metadata.name)
            .collect();

        for md in deployments.iter().filter(|md| !deleting(md)) {
            if let Err(e) = self.deployment(md, &mut sets).await {
                self.error(e);
            }
        }
        let mut machines = self.list("Machine").await?;
        for ms in sets.iter().filter(|ms| !deleting(ms)) {
            if let Err(e) = self.machine_set(ms, &mut machines).await {
                self.error(e);
            }
        }
        for machine in machines.iter().filter(|m| !deleting(m)) {
            if let Err(e) = self.provision(machine, &sets, &nodes).await {
                self.error(e);
            }
        }
        // Nodes whose Machine is gone.
        let live: BTreeSet<String> = machines
            .iter()
            .filter(|m| !deleting(m))
            .map(name_of)
            .collect();
        for name in nodes.iter().filter(|n| !live.contains(*n)) {
            self.delete_node(name).await;
        }
        Ok(())
    }

    /// Ensures the MachineSet of `md` exists and mirrors its replicas.
    async fn deployment(
        &self,
        md: &DynamicObject,
        sets: &mut Vec<DynamicObject>,
    ) -> Result<(), String> {
        let md_name = name_of(md);
        let owned = sets
            .iter()
            .position(|ms| controller_of(ms, "MachineDeployment").as_deref() == Some(&md_name));
        let index = match owned {
            Some(i) => i,
            None => {
                let created = self.create_set(md).await?;
                sets.push(created);
                sets.len() - 1
            }
        };
        let Some(want) = replicas_of(md) else {
            return Ok(());
        };
        if replicas_of(&sets[index]) != Some(want) {
            let ms_name = name_of(&sets[index]);
            let patched = self
                .api("MachineSet")
                .patch(
                    &ms_name,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"replicas": want}})),
                )
                .await
                .map_err(|e| format!("scale MachineSet {}/{ms_name}: {e}", self.ns))?;
            self.act(format!("MachineSet {ms_name} replicas → {want}"));
            sets[index] = patched;
        }
        Ok(())
    }

    async fn create_set(&self, md: &DynamicObject) -> Result<DynamicObject, String> {
        let md_name = name_of(md);
        let name = format!(
            "{md_name}-{}",
            short_hash(&format!("{}/{md_name}", self.ns))
        );
        let spec = &md.data["spec"];
        let cluster = spec["clusterName"].as_str().unwrap_or_default().to_string();
        let mut template = spec["template"].clone();
        if !template.is_object() {
            template = json!({});
        }
        let mut labels = string_map(&spec["template"]["metadata"]["labels"]);
        labels.insert(self.key("cluster-name"), cluster.clone());
        labels.insert(self.key("deployment-name"), md_name.clone());
        let ms_spec = json!({
            "clusterName": cluster,
            "replicas": replicas_of(md).unwrap_or(0),
            "selector": spec["selector"].clone(),
            "template": template,
        });
        let metadata = json!({
            "name": name,
            "namespace": self.ns,
            "labels": labels,
            "ownerReferences": [{
                "apiVersion": self.api_version(),
                "kind": "MachineDeployment",
                "name": md_name,
                "uid": md.metadata.uid.clone().unwrap_or_default(),
                "controller": true,
                "blockOwnerDeletion": true,
            }],
        });
        let ar = self.resource("MachineSet", "machinesets");
        let mut object = DynamicObject::new(&name, &ar).data(json!({"spec": ms_spec}));
        object.metadata = serde_json::from_value::<ObjectMeta>(metadata)
            .map_err(|e| format!("MachineSet metadata: {e}"))?;
        let created = self
            .api("MachineSet")
            .create(&PostParams::default(), &object)
            .await
            .map_err(|e| format!("create MachineSet {}/{name}: {e}", self.ns))?;
        self.act(format!("created MachineSet {name} for {md_name}"));
        Ok(created)
    }

    /// Creates or deletes the Machines of `ms` to match its replicas.
    async fn machine_set(
        &self,
        ms: &DynamicObject,
        machines: &mut Vec<DynamicObject>,
    ) -> Result<(), String> {
        let ms_name = name_of(ms);
        let Some(want) = replicas_of(ms) else {
            return Ok(());
        };
        let active: Vec<DynamicObject> = machines
            .iter()
            .filter(|m| !deleting(m))
            .filter(|m| controller_of(m, "MachineSet").as_deref() == Some(&ms_name))
            .cloned()
            .collect();
        let count = active.len() as i64;
        if count < want {
            for _ in count..want {
                let created = self.create_machine(ms).await?;
                machines.push(created);
            }
        } else if count > want {
            let mark = self.key("delete-machine");
            let mut order = active;
            // Marked first; within each class the newest first.
            order.sort_by(|a, b| {
                let am = annotations_of(a).contains_key(&mark);
                let bm = annotations_of(b).contains_key(&mark);
                bm.cmp(&am).then_with(|| age_key(b).cmp(&age_key(a)))
            });
            for victim in order.iter().take((count - want) as usize) {
                let name = name_of(victim);
                let why = if annotations_of(victim).contains_key(&mark) {
                    "delete-machine annotation"
                } else {
                    "newest"
                };
                self.delete_machine(victim, why).await?;
                machines.retain(|m| name_of(m) != name);
            }
        }
        Ok(())
    }

    async fn create_machine(&self, ms: &DynamicObject) -> Result<DynamicObject, String> {
        let ms_name = name_of(ms);
        let name = format!("{ms_name}-{}", random_suffix());
        let template = &ms.data["spec"]["template"];
        let ms_labels = ms.metadata.labels.clone().unwrap_or_default();
        let cluster = ms.data["spec"]["clusterName"]
            .as_str()
            .map(str::to_string)
            .or_else(|| ms_labels.get(&self.key("cluster-name")).cloned())
            .unwrap_or_default();
        let mut labels = string_map(&template["metadata"]["labels"]);
        labels.insert(self.key("cluster-name"), cluster);
        labels.insert(self.key("set-name"), ms_name.clone());
        let deployment = controller_of(ms, "MachineDeployment")
            .or_else(|| ms_labels.get(&self.key("deployment-name")).cloned());
        if let Some(md) = &deployment {
            labels.insert(self.key("deployment-name"), md.clone());
        }
        let mut annotations = string_map(&template["metadata"]["annotations"]);
        annotations.insert(CREATED_ANNOTATION.into(), now_nanos().to_string());
        let mut spec = template["spec"].clone();
        if !spec.is_object() {
            spec = json!({});
        }
        spec["providerID"] = json!(format!("e2e:///{}/{name}", self.ns));
        // The infrastructure machine a real provider would clone from the template.
        if let Some(kind) = spec["infrastructureRef"]["kind"].as_str() {
            let kind = kind.strip_suffix("Template").unwrap_or(kind).to_string();
            spec["infrastructureRef"]["kind"] = json!(kind);
            spec["infrastructureRef"]["name"] = json!(name);
        }
        let metadata = json!({
            "name": name,
            "namespace": self.ns,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [{
                "apiVersion": self.api_version(),
                "kind": "MachineSet",
                "name": ms_name,
                "uid": ms.metadata.uid.clone().unwrap_or_default(),
                "controller": true,
                "blockOwnerDeletion": true,
            }],
        });
        let ar = self.resource("Machine", "machines");
        let mut object = DynamicObject::new(&name, &ar).data(json!({ "spec": spec }));
        object.metadata = serde_json::from_value::<ObjectMeta>(metadata)
            .map_err(|e| format!("Machine metadata: {e}"))?;
        let created = self
            .api("Machine")
            .create(&PostParams::default(), &object)
            .await
            .map_err(|e| format!("create Machine {}/{name} for {ms_name}: {e}", self.ns))?;
        self.act(format!("created Machine {name} ({ms_name})"));
        Ok(created)
    }

    async fn delete_machine(&self, machine: &DynamicObject, why: &str) -> Result<(), String> {
        let name = name_of(machine);
        match self
            .api("Machine")
            .delete(&name, &DeleteParams::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(format!("delete Machine {}/{name}: {e}", self.ns)),
        }
        self.act(format!("deleted Machine {name} ({why})"));
        let node = machine.data["status"]["nodeRef"]["name"]
            .as_str()
            .map(str::to_string)
            .unwrap_or(name);
        self.delete_node(&node).await;
        Ok(())
    }

    /// Deletes Node `name` if it is one of this reconciler's (errors are recorded).
    async fn delete_node(&self, name: &str) {
        match self.nodes().get_opt(name).await {
            Ok(Some(node))
                if node
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(NAMESPACE_LABEL))
                    == Some(&self.ns) => {}
            Ok(_) => return,
            Err(e) => return self.error(format!("get Node {name}: {e}")),
        }
        match self.nodes().delete(name, &DeleteParams::default()).await {
            Ok(_) => self.act(format!("deleted Node {name}")),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => self.error(format!("delete Node {name}: {e}")),
        }
    }

    /// Gives a Machine this reconciler created its Node and status.
    async fn provision(
        &self,
        machine: &DynamicObject,
        sets: &[DynamicObject],
        nodes: &BTreeSet<String>,
    ) -> Result<(), String> {
        if !annotations_of(machine).contains_key(CREATED_ANNOTATION)
            || !machine.data["status"]["nodeRef"].is_null()
        {
            return Ok(());
        }
        let name = name_of(machine);
        let Some(ms_name) = controller_of(machine, "MachineSet") else {
            return Ok(());
        };
        let Some(ms) = sets.iter().find(|s| name_of(s) == ms_name) else {
            return Ok(());
        };
        let provider_id = machine.data["spec"]["providerID"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("e2e:///{}/{name}", self.ns));
        let (owner_kind, owner_name) = match controller_of(ms, "MachineDeployment") {
            Some(md) => ("MachineDeployment", md),
            None => ("MachineSet", ms_name.clone()),
        };
        let cluster = machine.data["spec"]["clusterName"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let annotations = BTreeMap::from([
            (self.key("machine"), name.clone()),
            (self.key("cluster-namespace"), self.ns.clone()),
            (self.key("cluster-name"), cluster),
            (self.key("owner-kind"), owner_kind.to_string()),
            (self.key("owner-name"), owner_name),
        ]);
        if !nodes.contains(&name) {
            let labels = string_map(&ms.data["spec"]["template"]["metadata"]["labels"]);
            self.create_node(&name, &provider_id, labels, annotations)
                .await?;
        }
        let status = json!({
            "nodeRef": {"name": name},
            "phase": "Running",
            "initialization": {"bootstrapDataSecretCreated": true, "infrastructureProvisioned": true},
        });
        self.api("Machine")
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&json!({ "status": status })),
            )
            .await
            .map_err(|e| format!("write status of Machine {}/{name}: {e}", self.ns))?;
        self.act(format!("Machine {name} Running (nodeRef {name})"));
        Ok(())
    }

    /// Creates a Ready Node of 2 CPUs and 4Gi with the group's template labels.
    async fn create_node(
        &self,
        name: &str,
        provider_id: &str,
        mut labels: BTreeMap<String, String>,
        annotations: BTreeMap<String, String>,
    ) -> Result<(), String> {
        labels.insert("kubernetes.io/hostname".into(), name.into());
        labels.insert("kubernetes.io/os".into(), "linux".into());
        labels.insert("kubernetes.io/arch".into(), "amd64".into());
        labels.insert(NAMESPACE_LABEL.into(), self.ns.clone());
        let now = k8s_openapi::jiff::Timestamp::now()
            .round(k8s_openapi::jiff::Unit::Second)
            .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now())
            .to_string();
        let capacity = json!({"cpu": "2", "memory": "4Gi", "pods": "110"});
        let node = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": labels, "annotations": annotations},
            "spec": {"providerID": provider_id},
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "conditions": [{
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "e2e reconciler: kubelet is posting ready status",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }],
                "addresses": [{"type": "Hostname", "address": name}],
                "nodeInfo": {
                    "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "",
                    "osImage": "e2e", "containerRuntimeVersion": "e2e://0",
                    "kubeletVersion": "v1.36.0", "kubeProxyVersion": "",
                    "operatingSystem": "linux", "architecture": "amd64",
                },
            },
        });
        let node: Node =
            serde_json::from_value(node).map_err(|e| format!("Node {name} object: {e}"))?;
        self.nodes()
            .create(&PostParams::default(), &node)
            .await
            .map_err(|e| format!("create Node {name}: {e}"))?;
        self.act(format!("Node {name} Ready ({provider_id})"));
        Ok(())
    }
}
