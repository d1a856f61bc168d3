//! A test-only imitation of Cluster API's controllers and of the kubelets, in one namespace.
//!
//! Where it still runs, and why: the real Cluster API v1.14.2 manager (`capi_manager`, with the
//! stand-in cloud and kubelets of `standin`) now runs `make demo` (examples/demo.rs), the real-CA
//! scenarios (tests/autoscaler.rs), the CA version matrix (tests/autoscaler_matrix.rs),
//! tests/topology.rs, tests/migration.rs and tests/real_capi*/ (issue 20). This imitation is left, not
//! moved yet, in tests/e2e/rollout.rs, the fault tests (tests/faults.rs) and the model test
//! (tests/model.rs), with its own tests in tests/e2e/reconciler.rs. (The renamed-group and
//! v1beta1-only binaries, where real Cluster API cannot run, use no controllers.) It is kinder than
//! Cluster API: it lists scalable resources before Machines (a lowered replica count is always seen
//! with its mark), deletes marked Machines first and then the newest (CAPI's default order is
//! Random, ties by name), never drains, and has no webhooks, preflight checks, MachineHealthChecks
//! or conversion.
//!
//! Where it runs, no CAPI controller and no kubelet do, so this small reconciler plays their parts,
//! close enough for the provider and for cluster-autoscaler:
//!
//! - **MachineDeployment → MachineSet**: one MachineSet `<md>-<hash>` per MachineDeployment (an
//!   existing MachineSet the MachineDeployment controls is adopted instead), ownerReference
//!   `controller: true`, labels `cluster-name`/`deployment-name`, annotation
//!   `machinedeployment.clusters.x-k8s.io/revision: "1"`; `spec.replicas` mirrored onto the newest
//!   MachineSet, less what older MachineSets still hold (a rollout a test drives by hand).
//! - **MachineSet → Machines**: ownerReference to the MachineSet, labels `cluster-name`, `set-name`,
//!   `deployment-name`, `spec.providerID = e2e:///<ns>/<machine>`. After
//!   [`ReconcilerConfig::node_delay`] each Machine gets a Ready Node (name = Machine name, same
//!   providerID; labels, taints and capacity from the group's template) and its status (`nodeRef`,
//!   phase `Running`) through `/status`. Scale-down deletes Machines carrying
//!   `cluster.x-k8s.io/delete-machine` first, then the newest; a deleted Machine's Node goes too.
//! - **MachinePool**: replicas become entries of `spec.providerIDList` and Nodes (no Machines);
//!   `status.replicas` follows. Scale-down drops the newest entries and their Nodes.
//! - **Provisioning failure**: groups named in [`ReconcilerConfig::never_provision`] (or switched
//!   on later with [`Reconciler::never_provision`]) get Machines / providerIDs but never a Node.
//!
//! Nodes are cluster-scoped: MachineSet names carry a hash of namespace and MachineDeployment, and
//! every name ends in a random suffix, so Node names do not collide across namespaces. Each Node
//! carries the label [`NAMESPACE_LABEL`]; Nodes without it are never touched.
//!
//! It is a poll loop (every [`ReconcilerConfig::interval`]) in a tokio task, aborted when the
//! [`Reconciler`] is dropped. One pass lists the scalable resources before the Machines, so a
//! provider that marks a Machine and then lowers replicas is always seen with its mark. Failed API
//! calls are recorded ([`Reconciler::errors`]) and retried on the next pass; every action is logged
//! ([`Reconciler::take_actions`]).
//!
//! Only Machines the reconciler created are provisioned; Machines a test creates itself are counted
//! (and may be scaled away) but never get a Node. v1beta2 objects by default; v1beta1 with
//! [`ReconcilerConfig::v1beta1`] (only `nodeRef` differs in shape).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use rand::Rng as _;
use serde_json::{Value, json};
use tokio::task::AbortHandle;

use super::procs::{Check, poll_until};

/// Label on every Node the reconciler creates: the namespace of its Machine or MachinePool.
pub const NAMESPACE_LABEL: &str = "e2e.capi-autoscaler-provider.test/namespace";
/// Annotation on every Machine the reconciler creates: creation time in Unix nanoseconds (orders
/// Machines created within the same second; "newest" goes first on scale-down).
pub const CREATED_ANNOTATION: &str = "e2e.capi-autoscaler-provider.test/created-nanos";
/// The MachineDeployment revision annotation CAPI puts on MachineSets.
pub const REVISION_ANNOTATION: &str = "machinedeployment.clusters.x-k8s.io/revision";
/// The label CAPI puts on a MachineSet, its selector and its Machines.
pub const TEMPLATE_HASH_LABEL: &str = "machine-template-hash";
const CAPACITY: &str = "capacity.cluster-autoscaler.kubernetes.io";
/// CAPI's random-suffix alphabet (no vowels, no look-alikes).
const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
/// How long a MachineDeployment without a MachineSet waits for one from the test before the
/// reconciler makes its own.
const OWN_SET_GRACE: Duration = Duration::from_millis(500);
/// At most this many errors are kept.
const MAX_ERRORS: usize = 100;

/// How the reconciler behaves.
#[derive(Clone, Debug)]
pub struct ReconcilerConfig {
    /// API group of the Cluster API objects.
    pub group: String,
    /// `v1beta2` or `v1beta1`.
    pub version: String,
    /// Time from a Machine's (or MachinePool entry's) creation to its Node.
    pub node_delay: Duration,
    /// Pause between passes.
    pub interval: Duration,
    /// MachineDeployments, MachineSets and MachinePools (by name) whose new instances never get a Node.
    pub never_provision: BTreeSet<String>,
    /// Start without acting until [`Reconciler::resume`] (to create objects it must not race).
    pub paused: bool,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        ReconcilerConfig {
            group: super::CAPI_GROUP.to_string(),
            version: "v1beta2".to_string(),
            node_delay: Duration::ZERO,
            interval: Duration::from_millis(100),
            never_provision: BTreeSet::new(),
            paused: false,
        }
    }
}

impl ReconcilerConfig {
    pub fn v1beta1(mut self) -> Self {
        self.version = "v1beta1".into();
        self
    }
    pub fn group(mut self, group: &str) -> Self {
        self.group = group.into();
        self
    }
    pub fn node_delay(mut self, delay: Duration) -> Self {
        self.node_delay = delay;
        self
    }
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }
    pub fn never_provision(mut self, name: &str) -> Self {
        self.never_provision.insert(name.into());
        self
    }
    pub fn paused(mut self) -> Self {
        self.paused = true;
        self
    }
}

/// What the task shares with its handle.
struct Shared {
    passes: AtomicU64,
    errors: Mutex<Vec<String>>,
    actions: Mutex<Vec<(Instant, String)>>,
    never_provision: Mutex<BTreeSet<String>>,
    paused: std::sync::atomic::AtomicBool,
}

/// A running reconciler for one namespace; stopped when dropped.
pub struct Reconciler {
    pub ns: String,
    pub config: ReconcilerConfig,
    shared: Arc<Shared>,
    task: AbortHandle,
}

impl Drop for Reconciler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Reconciler {
    /// Starts with the default configuration (v1beta2, no Node delay) in the current runtime.
    pub fn start(client: Client, ns: &str) -> Reconciler {
        Self::start_with(client, ns, ReconcilerConfig::default())
    }

    /// Starts with `config` in the current runtime.
    pub fn start_with(client: Client, ns: &str, config: ReconcilerConfig) -> Reconciler {
        let shared = Arc::new(Shared {
            passes: AtomicU64::new(0),
            errors: Mutex::new(Vec::new()),
            actions: Mutex::new(Vec::new()),
            never_provision: Mutex::new(config.never_provision.clone()),
            paused: std::sync::atomic::AtomicBool::new(config.paused),
        });
        let mut worker = Worker {
            client,
            ns: ns.to_string(),
            config: config.clone(),
            shared: shared.clone(),
            first_seen: HashMap::new(),
        };
        let interval = config.interval;
        let task = tokio::spawn({
            let shared = shared.clone();
            async move {
                loop {
                    if !shared.paused.load(Ordering::SeqCst) {
                        worker.pass().await;
                    }
                    shared.passes.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(interval).await;
                }
            }
        })
        .abort_handle();
        Reconciler {
            ns: ns.to_string(),
            config,
            shared,
            task,
        }
    }

    /// The MachineSet name the reconciler gives MachineDeployment `md` of namespace `ns`.
    pub fn set_name(ns: &str, md: &str) -> String {
        format!("{md}-{}", short_hash(&format!("{ns}/{md}")))
    }

    /// Passes completed so far.
    pub fn passes(&self) -> u64 {
        self.shared.passes.load(Ordering::SeqCst)
    }

    /// Waits (30 s at most) until `n` more passes have completed: everything written before the
    /// call has then been acted on.
    pub async fn wait_passes(&self, n: u64) {
        let target = self.passes() + n;
        poll_until(
            &format!("{n} reconciler passes in {}", self.ns),
            Duration::from_secs(30),
            Duration::from_millis(10),
            || async move {
                let done = self.passes();
                if done >= target {
                    Check::Done(())
                } else {
                    Check::Wait(format!("{done} of {target} passes"))
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}; errors: {:?}", self.errors()));
    }

    /// The API errors of the passes so far (the last 100).
    pub fn errors(&self) -> Vec<String> {
        lock(&self.shared.errors).clone()
    }

    /// The actions since the last call, with when they happened.
    pub fn take_actions(&self) -> Vec<(Instant, String)> {
        std::mem::take(&mut *lock(&self.shared.actions))
    }

    /// Starts acting (after [`ReconcilerConfig::paused`]).
    pub fn resume(&self) {
        self.shared.paused.store(false, Ordering::SeqCst);
    }

    /// Every action so far that [`take_actions`](Self::take_actions) has not taken.
    pub fn actions(&self) -> Vec<String> {
        lock(&self.shared.actions)
            .iter()
            .map(|(_, a)| a.clone())
            .collect()
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

    /// The Machines deleted so far without the delete-machine annotation (the newest, for a replica
    /// count that dropped without a mark).
    pub fn deleted_unmarked(&self) -> Vec<String> {
        self.actions()
            .iter()
            .filter_map(|a| {
                a.strip_prefix("deleted Machine ")?
                    .strip_suffix(" (newest)")
                    .map(str::to_string)
            })
            .collect()
    }

    /// Switches provisioning failure on or off for the group named `name`; affects instances that
    /// have no Node yet.
    pub fn never_provision(&self, name: &str, on: bool) {
        let mut set = lock(&self.shared.never_provision);
        if on {
            set.insert(name.into());
        } else {
            set.remove(name);
        }
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

/// `spec.template.metadata.labels` of a MachineDeployment, MachineSet or MachinePool.
fn template_labels(o: &DynamicObject) -> BTreeMap<String, String> {
    string_map(&o.data["spec"]["template"]["metadata"]["labels"])
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

/// `k=v,k2=v2` of a selector's matchLabels.
fn selector_string(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
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

/// What a Node of a group looks like (from the group's template and annotations).
#[derive(Debug, Default)]
struct NodeShape {
    labels: BTreeMap<String, String>,
    taints: Vec<Value>,
    capacity: BTreeMap<String, String>,
    arch: String,
    os: String,
    kubelet_version: String,
}

struct Worker {
    client: Client,
    ns: String,
    config: ReconcilerConfig,
    shared: Arc<Shared>,
    /// When each instance (Machine uid, MachinePool providerID) was first seen, for the Node delay.
    first_seen: HashMap<String, Instant>,
}

impl Worker {
    fn resource(&self, kind: &str, plural: &str) -> ApiResource {
        super::capi_resource(&self.config.group, &self.config.version, kind, plural)
    }

    fn api(&self, kind: &str) -> Api<DynamicObject> {
        let plural = format!("{}s", kind.to_ascii_lowercase());
        Api::namespaced_with(self.client.clone(), &self.ns, &self.resource(kind, &plural))
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    fn key(&self, suffix: &str) -> String {
        format!("{}/{suffix}", self.config.group)
    }

    fn api_version(&self) -> String {
        format!("{}/{}", self.config.group, self.config.version)
    }

    fn v1beta1(&self) -> bool {
        self.config.version == "v1beta1"
    }

    fn error(&self, e: String) {
        let mut errors = lock(&self.shared.errors);
        if errors.len() >= MAX_ERRORS {
            errors.remove(0);
        }
        errors.push(e);
    }

    fn act(&self, what: String) {
        lock(&self.shared.actions).push((Instant::now(), what));
    }

    fn never_provision(&self, names: &[&str]) -> bool {
        let set = lock(&self.shared.never_provision);
        names.iter().any(|n| set.contains(*n))
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

    /// One pass over the namespace. Scalable resources are listed before Machines: a provider marks a
    /// Machine before it lowers replicas, so a lowered count is always seen with its mark.
    async fn pass(&mut self) {
        if let Err(e) = self.try_pass().await {
            self.error(e);
        }
    }

    async fn try_pass(&mut self) -> Result<(), String> {
        let pools = self.list("MachinePool").await?;
        let deployments = self.list("MachineDeployment").await?;
        let mut sets = self.list("MachineSet").await?;
        let node_list = self
            .nodes()
            .list(&ListParams::default().labels(&format!("{NAMESPACE_LABEL}={}", self.ns)))
            .await
            .map_err(|e| format!("list Nodes of {}: {e}", self.ns))?
            .items;
        let nodes: BTreeMap<String, Node> = node_list
            .into_iter()
            .map(|n| (n.metadata.name.clone().unwrap_or_default(), n))
            .collect();

        // MachineDeployment → MachineSet.
        for md in deployments.iter().filter(|md| !deleting(md)) {
            if let Err(e) = self.deployment(md, &mut sets).await {
                self.error(e);
            }
        }

        // MachineSet → Machines (listed only now, after the scalable resources).
        let mut machines = self.list("Machine").await?;
        for ms in sets.iter().filter(|ms| !deleting(ms)) {
            if let Err(e) = self.machine_set(ms, &mut machines).await {
                self.error(e);
            }
        }

        // Machines → Nodes.
        for machine in machines.iter().filter(|m| !deleting(m)) {
            if let Err(e) = self.provision(machine, &sets, &deployments, &nodes).await {
                self.error(e);
            }
        }

        // MachineDeployment status, from its MachineSets' Machines.
        for md in deployments.iter().filter(|md| !deleting(md)) {
            if let Err(e) = self.deployment_status(md, &sets, &machines).await {
                self.error(e);
            }
        }

        // MachinePools.
        let mut pool_ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for mp in pools.iter().filter(|mp| !deleting(mp)) {
            match self.pool(mp, &nodes).await {
                Ok(ids) => {
                    pool_ids.insert(name_of(mp), ids);
                }
                Err(e) => {
                    // Unknown state: keep its Nodes this pass.
                    pool_ids.insert(name_of(mp), BTreeSet::from(["*".to_string()]));
                    self.error(e);
                }
            }
        }

        // Nodes whose Machine or MachinePool entry is gone.
        let live: BTreeSet<String> = machines
            .iter()
            .filter(|m| !deleting(m))
            .map(name_of)
            .collect();
        for (name, node) in &nodes {
            let annotations = node.metadata.annotations.clone().unwrap_or_default();
            let keep = if let Some(machine) = annotations.get(&self.key("machine")) {
                live.contains(machine)
            } else if annotations.get(&self.key("owner-kind")).map(String::as_str)
                == Some("MachinePool")
            {
                let pool = annotations
                    .get(&self.key("owner-name"))
                    .cloned()
                    .unwrap_or_default();
                let id = node
                    .spec
                    .as_ref()
                    .and_then(|s| s.provider_id.clone())
                    .unwrap_or_default();
                pool_ids
                    .get(&pool)
                    .is_some_and(|ids| ids.contains("*") || ids.contains(&id))
            } else {
                true
            };
            if !keep {
                self.delete_node(name).await;
            }
        }
        Ok(())
    }

    /// Ensures the MachineSet of `md` exists and mirrors its replicas.
    async fn deployment(
        &mut self,
        md: &DynamicObject,
        sets: &mut Vec<DynamicObject>,
    ) -> Result<(), String> {
        let md_name = name_of(md);
        // A test that brings its own MachineSet creates it right after the MachineDeployment: give it
        // a moment before making one, or two MachineSets would share the replicas.
        let seen = *self
            .first_seen
            .entry(md.metadata.uid.clone().unwrap_or_default())
            .or_insert_with(Instant::now);
        let owned: Vec<usize> = sets
            .iter()
            .enumerate()
            .filter(|(_, ms)| controller_of(ms, "MachineDeployment").as_deref() == Some(&md_name))
            .map(|(i, _)| i)
            .collect();
        // The newest MachineSet: highest revision, then the youngest.
        let revision = |ms: &DynamicObject| {
            annotations_of(ms)
                .get(REVISION_ANNOTATION)
                .and_then(|r| r.parse::<i64>().ok())
                .unwrap_or(0)
        };
        let newest = owned
            .iter()
            .copied()
            .max_by_key(|&i| (revision(&sets[i]), age_key(&sets[i])));
        let index = match newest {
            Some(i) => i,
            None if seen.elapsed() < OWN_SET_GRACE => return Ok(()),
            None => {
                let created = self.create_set(md).await?;
                sets.push(created);
                sets.len() - 1
            }
        };
        let Some(total) = replicas_of(md) else {
            return Ok(());
        };
        // Mid-rollout (older MachineSets still hold replicas, which a test scales itself) the newest
        // MachineSet gets what is left, as CAPI keeps the total at the MachineDeployment's replicas.
        let older: i64 = owned
            .iter()
            .filter(|&&i| i != index)
            .filter_map(|&i| replicas_of(&sets[i]))
            .sum();
        let want = (total - older).max(0);
        if replicas_of(&sets[index]) != Some(want) {
            let ms_name = name_of(&sets[index]);
            let before = replicas_of(&sets[index]);
            let patched = self
                .api("MachineSet")
                .patch(
                    &ms_name,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"replicas": want}})),
                )
                .await
                .map_err(|e| format!("scale MachineSet {}/{ms_name}: {e}", self.ns))?;
            self.act(format!(
                "MachineSet {ms_name} replicas {} → {want}",
                before.map_or("-".into(), |n| n.to_string())
            ));
            sets[index] = patched;
        }
        Ok(())
    }

    async fn create_set(&self, md: &DynamicObject) -> Result<DynamicObject, String> {
        let md_name = name_of(md);
        let name = Reconciler::set_name(&self.ns, &md_name);
        let hash = short_hash(&format!("{}/{md_name}/template", self.ns));
        let spec = &md.data["spec"];
        let cluster = spec["clusterName"].as_str().unwrap_or_default().to_string();
        let mut selector = string_map(&spec["selector"]["matchLabels"]);
        selector.insert(TEMPLATE_HASH_LABEL.into(), hash.clone());
        let mut template = spec["template"].clone();
        if !template.is_object() {
            template = json!({});
        }
        let mut template_labels = template_labels(md);
        template_labels.insert(TEMPLATE_HASH_LABEL.into(), hash.clone());
        template["metadata"]["labels"] = json!(template_labels);
        let mut labels = template_labels.clone();
        labels.insert(self.key("cluster-name"), cluster.clone());
        labels.insert(self.key("deployment-name"), md_name.clone());
        let mut ms_spec = json!({
            "clusterName": cluster,
            "replicas": replicas_of(md).unwrap_or(0),
            "selector": {"matchLabels": selector},
            "template": template,
        });
        if cluster.is_empty()
            && let Some(m) = ms_spec.as_object_mut()
        {
            m.remove("clusterName");
        }
        let metadata = json!({
            "name": name,
            "namespace": self.ns,
            "labels": labels,
            "annotations": {REVISION_ANNOTATION: "1"},
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

    /// Creates or deletes the Machines of `ms` to match its replicas; writes its status.
    async fn machine_set(
        &self,
        ms: &DynamicObject,
        machines: &mut Vec<DynamicObject>,
    ) -> Result<(), String> {
        let ms_name = name_of(ms);
        let Some(want) = replicas_of(ms) else {
            return Ok(());
        };
        let owned = |machines: &[DynamicObject]| -> Vec<DynamicObject> {
            machines
                .iter()
                .filter(|m| !deleting(m))
                .filter(|m| controller_of(m, "MachineSet").as_deref() == Some(&ms_name))
                .cloned()
                .collect()
        };
        let active = owned(machines);
        let count = active.len() as i64;
        if count < want {
            for _ in count..want {
                let created = self.create_machine(ms).await?;
                machines.push(created);
            }
        } else if count > want {
            let mark = self.key("delete-machine");
            let mut order = active.clone();
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
        let active = owned(machines);
        let ready = active
            .iter()
            .filter(|m| !m.data["status"]["nodeRef"].is_null())
            .count();
        let selector = string_map(&ms.data["spec"]["selector"]["matchLabels"]);
        let status = json!({
            "replicas": active.len(),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "selector": selector_string(&selector),
        });
        self.write_status("MachineSet", ms, status).await
    }

    /// Merge-patches `status` through `/status` unless the object already has those values.
    async fn write_status(
        &self,
        kind: &str,
        object: &DynamicObject,
        status: Value,
    ) -> Result<(), String> {
        let current = &object.data["status"];
        let same = status
            .as_object()
            .is_some_and(|m| m.iter().all(|(k, v)| &current[k] == v));
        if same {
            return Ok(());
        }
        let name = name_of(object);
        self.api(kind)
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&json!({ "status": status })),
            )
            .await
            .map_err(|e| format!("write status of {kind} {}/{name}: {e}", self.ns))?;
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

    /// Gives a Machine this reconciler created its Node and status, once the delay has passed.
    async fn provision(
        &mut self,
        machine: &DynamicObject,
        sets: &[DynamicObject],
        deployments: &[DynamicObject],
        nodes: &BTreeMap<String, Node>,
    ) -> Result<(), String> {
        let annotations = annotations_of(machine);
        if !annotations.contains_key(CREATED_ANNOTATION)
            || !machine.data["status"]["nodeRef"].is_null()
        {
            return Ok(());
        }
        let name = name_of(machine);
        let Some(ms_name) = controller_of(machine, "MachineSet") else {
            return Ok(());
        };
        let ms = sets.iter().find(|s| name_of(s) == ms_name);
        let md = ms
            .and_then(|ms| controller_of(ms, "MachineDeployment"))
            .and_then(|md| deployments.iter().find(|d| name_of(d) == md));
        // A MachineSet listed before its MachineDeployment (created in between the two lists of a
        // pass): the Node's shape comes from the MachineDeployment, so wait for it.
        if md.is_none()
            && ms
                .and_then(|ms| controller_of(ms, "MachineDeployment"))
                .is_some()
        {
            return Ok(());
        }
        let mut group_names = vec![ms_name.as_str()];
        let md_name = md.map(name_of);
        if let Some(n) = &md_name {
            group_names.push(n);
        }
        if self.never_provision(&group_names) {
            return Ok(());
        }
        let uid = machine.metadata.uid.clone().unwrap_or_else(|| name.clone());
        let seen = *self.first_seen.entry(uid).or_insert_with(Instant::now);
        if seen.elapsed() < self.config.node_delay {
            return Ok(());
        }
        let Some(group) = md.or(ms) else {
            return Ok(());
        };
        let provider_id = machine.data["spec"]["providerID"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("e2e:///{}/{name}", self.ns));
        let (owner_kind, owner_name) = match &md_name {
            Some(md) => ("MachineDeployment", md.clone()),
            None => ("MachineSet", ms_name.clone()),
        };
        let cluster = machine.data["spec"]["clusterName"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut node_annotations = BTreeMap::new();
        node_annotations.insert(self.key("machine"), name.clone());
        node_annotations.insert(self.key("cluster-namespace"), self.ns.clone());
        node_annotations.insert(self.key("cluster-name"), cluster);
        node_annotations.insert(self.key("owner-kind"), owner_kind.to_string());
        node_annotations.insert(self.key("owner-name"), owner_name);
        let node_uid = if nodes.contains_key(&name) {
            nodes[&name].metadata.uid.clone().unwrap_or_default()
        } else {
            let shape = self.shape(group).await;
            self.create_node(&name, &provider_id, shape, node_annotations)
                .await?
        };
        let status = if self.v1beta1() {
            json!({
                "nodeRef": {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node_uid},
                "phase": "Running",
                "bootstrapReady": true,
                "infrastructureReady": true,
            })
        } else {
            json!({
                "nodeRef": {"name": name},
                "phase": "Running",
                "initialization": {"bootstrapDataSecretCreated": true, "infrastructureProvisioned": true},
            })
        };
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

    /// Labels, taints, capacity and system info for a Node of `group`: its capacity annotations,
    /// else its infrastructure template's `status.capacity`/`status.nodeInfo`, else 2 CPUs / 4Gi.
    async fn shape(&self, group: &DynamicObject) -> NodeShape {
        let annotations = annotations_of(group);
        let capacity_key = |k: &str| annotations.get(&format!("{CAPACITY}/{k}")).cloned();
        let mut shape = NodeShape {
            labels: template_labels(group),
            kubelet_version: group.data["spec"]["template"]["spec"]["version"]
                .as_str()
                .unwrap_or("v1.36.0")
                .to_string(),
            ..Default::default()
        };
        if let Some(status) = self.infra_status(group).await {
            for (k, v) in string_map(&status["capacity"]) {
                shape.capacity.insert(k, v);
            }
            let info = &status["nodeInfo"];
            shape.arch = info["architecture"].as_str().unwrap_or_default().into();
            shape.os = info["operatingSystem"].as_str().unwrap_or_default().into();
        }
        for (key, resource) in [
            ("cpu", "cpu"),
            ("memory", "memory"),
            ("ephemeral-disk", "ephemeral-storage"),
            ("maxPods", "pods"),
        ] {
            if let Some(v) = capacity_key(key).filter(|v| !v.is_empty()) {
                shape.capacity.insert(resource.into(), v);
            }
        }
        if let (Some(kind), Some(count)) = (capacity_key("gpu-type"), capacity_key("gpu-count"))
            && !kind.is_empty()
            && count.parse::<i64>().is_ok_and(|n| n > 0)
        {
            shape.capacity.insert(kind, count);
        }
        shape
            .capacity
            .entry("cpu".into())
            .or_insert_with(|| "2".into());
        shape
            .capacity
            .entry("memory".into())
            .or_insert_with(|| "4Gi".into());
        shape
            .capacity
            .entry("pods".into())
            .or_insert_with(|| "110".into());
        if let Some(labels) = capacity_key("labels") {
            for pair in labels.split(',').filter(|p| !p.trim().is_empty()) {
                if let Some((k, v)) = pair.split_once('=') {
                    shape.labels.insert(k.trim().into(), v.trim().into());
                }
            }
        }
        if let Some(taints) = capacity_key("taints") {
            for taint in taints.split(',').filter(|t| !t.trim().is_empty()) {
                let Some((kv, effect)) = taint.trim().rsplit_once(':') else {
                    continue;
                };
                let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
                shape
                    .taints
                    .push(json!({"key": key, "value": value, "effect": effect}));
            }
        }
        if shape.arch.is_empty() {
            shape.arch = "amd64".into();
        }
        if shape.os.is_empty() {
            shape.os = "linux".into();
        }
        shape
    }

    /// `status` of the group's `E2EMachineTemplate`, when it points at one that exists.
    async fn infra_status(&self, group: &DynamicObject) -> Option<Value> {
        let reference = &group.data["spec"]["template"]["spec"]["infrastructureRef"];
        if reference["kind"].as_str() != Some("E2EMachineTemplate") {
            return None;
        }
        let name = reference["name"].as_str()?;
        let ar = super::infra::template_resource("v1beta1");
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &self.ns, &ar);
        let template = api.get_opt(name).await.ok()??;
        let status = template.data.get("status")?.clone();
        status.is_object().then_some(status)
    }

    /// Creates a Ready Node; returns its uid. An existing Node of the same name is an error.
    async fn create_node(
        &self,
        name: &str,
        provider_id: &str,
        shape: NodeShape,
        annotations: BTreeMap<String, String>,
    ) -> Result<String, String> {
        let mut labels = shape.labels;
        labels.insert("kubernetes.io/hostname".into(), name.into());
        labels
            .entry("kubernetes.io/os".into())
            .or_insert(shape.os.clone());
        labels
            .entry("kubernetes.io/arch".into())
            .or_insert(shape.arch.clone());
        labels.insert(NAMESPACE_LABEL.into(), self.ns.clone());
        let now = k8s_openapi::jiff::Timestamp::now()
            .round(k8s_openapi::jiff::Unit::Second)
            .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now())
            .to_string();
        let node = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": labels, "annotations": annotations},
            "spec": {"providerID": provider_id, "taints": shape.taints},
            "status": {
                "capacity": shape.capacity,
                "allocatable": shape.capacity,
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
                    "kubeletVersion": shape.kubelet_version, "kubeProxyVersion": "",
                    "operatingSystem": shape.os, "architecture": shape.arch,
                },
            },
        });
        let node: Node =
            serde_json::from_value(node).map_err(|e| format!("Node {name} object: {e}"))?;
        let created = self
            .nodes()
            .create(&PostParams::default(), &node)
            .await
            .map_err(|e| format!("create Node {name}: {e}"))?;
        self.act(format!("Node {name} Ready ({provider_id})"));
        Ok(created.metadata.uid.unwrap_or_default())
    }

    /// Writes the MachineDeployment's status from the Machines of the MachineSets it controls.
    async fn deployment_status(
        &self,
        md: &DynamicObject,
        sets: &[DynamicObject],
        machines: &[DynamicObject],
    ) -> Result<(), String> {
        let md_name = name_of(md);
        let owned: BTreeSet<String> = sets
            .iter()
            .filter(|ms| controller_of(ms, "MachineDeployment").as_deref() == Some(&md_name))
            .map(name_of)
            .collect();
        let active: Vec<&DynamicObject> = machines
            .iter()
            .filter(|m| !deleting(m))
            .filter(|m| controller_of(m, "MachineSet").is_some_and(|s| owned.contains(&s)))
            .collect();
        let ready = active
            .iter()
            .filter(|m| !m.data["status"]["nodeRef"].is_null())
            .count();
        let selector = string_map(&md.data["spec"]["selector"]["matchLabels"]);
        let status = json!({
            "replicas": active.len(),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "selector": selector_string(&selector),
        });
        self.write_status("MachineDeployment", md, status).await
    }

    /// Keeps a MachinePool's providerIDList, Nodes and status.replicas at its replicas; returns the
    /// providerIDs it holds now.
    async fn pool(
        &mut self,
        mp: &DynamicObject,
        nodes: &BTreeMap<String, Node>,
    ) -> Result<BTreeSet<String>, String> {
        let mp_name = name_of(mp);
        let mut ids: Vec<String> = mp.data["spec"]["providerIDList"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        if let Some(want) = replicas_of(mp) {
            let want = usize::try_from(want).unwrap_or(0);
            if ids.len() != want {
                let before = ids.len();
                let prefix = format!(
                    "{mp_name}-{}",
                    short_hash(&format!("{}/{mp_name}", self.ns))
                );
                while ids.len() < want {
                    ids.push(format!("e2e:///{}/{prefix}-{}", self.ns, random_suffix()));
                }
                let removed: Vec<String> = ids.split_off(want.min(ids.len()));
                self.api("MachinePool")
                    .patch(
                        &mp_name,
                        &PatchParams::default(),
                        &Patch::Merge(&json!({"spec": {"providerIDList": ids}})),
                    )
                    .await
                    .map_err(|e| format!("write providerIDList of MachinePool {mp_name}: {e}"))?;
                self.act(format!(
                    "MachinePool {mp_name} providerIDList {before} → {} entries",
                    ids.len()
                ));
                for id in removed {
                    if let Some(node) = id.rsplit('/').next() {
                        self.delete_node(node).await;
                    }
                }
            }
        }
        let provision = !self.never_provision(&[&mp_name]);
        let mut ready = 0usize;
        for id in &ids {
            let Some(node_name) = id.strip_prefix(&format!("e2e:///{}/", self.ns)) else {
                continue; // not one of ours
            };
            if nodes.contains_key(node_name) {
                ready += 1;
                continue;
            }
            if !provision {
                continue;
            }
            let seen = *self
                .first_seen
                .entry(id.clone())
                .or_insert_with(Instant::now);
            if seen.elapsed() < self.config.node_delay {
                continue;
            }
            let mut annotations = BTreeMap::new();
            annotations.insert(self.key("cluster-namespace"), self.ns.clone());
            annotations.insert(
                self.key("cluster-name"),
                mp.data["spec"]["clusterName"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
            annotations.insert(self.key("owner-kind"), "MachinePool".into());
            annotations.insert(self.key("owner-name"), mp_name.clone());
            let shape = self.shape(mp).await;
            match self.create_node(node_name, id, shape, annotations).await {
                Ok(_) => ready += 1,
                Err(e) => self.error(e),
            }
        }
        let status =
            json!({"replicas": ids.len(), "readyReplicas": ready, "availableReplicas": ready});
        self.write_status("MachinePool", mp, status).await?;
        Ok(ids.into_iter().collect())
    }
}
