//! Watches over the management (and workload) cluster feeding the `Index`, and the published `Snapshot`.
//!
//! Every kind is watched with a kube-runtime watcher; events go into the index as they come, and a
//! snapshot is rebuilt (coalescing bursts) and swapped in atomically. Read RPCs only load the snapshot.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::discovery::{self, ApiGroup};
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use tokio::sync::Notify;

use crate::capi::{
    ClusterTopology, InfraTemplate, Machine, Node, ObjectKey, ScalableKind, ScalableResource,
};
use crate::metrics::Metrics;
use crate::problem::Problem;
use crate::snapshot::{Index, InfraKind, InfraKindState, Settings, Snapshot};

/// Longest wait between two looks for an infrastructure template kind that is not served.
const INFRA_RETRY_MAX: Duration = Duration::from_secs(30);

/// Least time between two snapshot builds triggered by watch events.
const REBUILD_SPACING: Duration = Duration::from_millis(100);

/// The Cluster API resources this provider reads and writes, at the version in use.
#[derive(Clone, Debug)]
pub struct CapiApis {
    pub group: String,
    pub version: String,
    /// Only the kinds the API serves (MachinePools may be absent).
    pub scalable: BTreeMap<ScalableKind, ApiResource>,
    pub machine: ApiResource,
    /// Clusters, when served: only read for their managed topology.
    pub cluster: Option<ApiResource>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("discovering API group {group:?}{}: {reason}", at_version(version))]
    Discovery {
        group: String,
        version: Option<String>,
        reason: String,
    },
    #[error("API group {group:?} does not serve {what}")]
    NotServed { group: String, what: String },
}

fn at_version(version: &Option<String>) -> String {
    version
        .as_deref()
        .map(|v| format!(" at version {v} (CAPI_VERSION)"))
        .unwrap_or_default()
}

impl CapiApis {
    /// The served version: `CAPI_VERSION` when set, else the group's preferred version.
    pub async fn discover(
        client: &Client,
        group: &str,
        version: Option<&str>,
    ) -> Result<Self, StoreError> {
        let discovery_error = |e: kube::Error| StoreError::Discovery {
            group: group.to_string(),
            version: version.map(str::to_string),
            reason: match e {
                kube::Error::Api(status) if status.code == 404 => {
                    "not served by this API server (404)".to_string()
                }
                kube::Error::Api(status) => format!("{} ({})", status.message, status.code),
                other => other.to_string(),
            },
        };
        let api_group: ApiGroup = match version {
            Some(v) => discovery::pinned_group(client, &kube::core::GroupVersion::gv(group, v))
                .await
                .map_err(discovery_error)?,
            None => discovery::group(client, group)
                .await
                .map_err(discovery_error)?,
        };
        let version = version
            .map(str::to_string)
            .unwrap_or_else(|| api_group.preferred_version_or_latest().to_string());
        let served = api_group.versioned_resources(&version);
        let find = |kind: &str| {
            served
                .iter()
                .find(|(r, _)| r.kind == kind)
                .map(|(r, _)| r.clone())
        };
        let machine = find("Machine").ok_or_else(|| StoreError::NotServed {
            group: group.to_string(),
            what: format!("machines at {version}"),
        })?;
        let scalable: BTreeMap<ScalableKind, ApiResource> = ScalableKind::ALL
            .into_iter()
            .filter_map(|k| find(k.as_str()).map(|r| (k, r)))
            .collect();
        if !scalable.contains_key(&ScalableKind::MachineSet) {
            return Err(StoreError::NotServed {
                group: group.to_string(),
                what: format!("machinesets at {version}"),
            });
        }
        let cluster = find("Cluster");
        Ok(CapiApis {
            group: group.to_string(),
            version,
            scalable,
            machine,
            cluster,
        })
    }

    /// The same resources without discovery (tests and `CAPI_VERSION` users who know what is served).
    pub fn assume(group: &str, version: &str) -> Self {
        let resource = |kind: &str, plural: &str| {
            ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
        };
        CapiApis {
            group: group.to_string(),
            version: version.to_string(),
            scalable: ScalableKind::ALL
                .into_iter()
                .map(|k| (k, resource(k.as_str(), k.plural())))
                .collect(),
            machine: resource("Machine", "machines"),
            cluster: Some(resource("Cluster", "clusters")),
        }
    }
}

/// What a watch feeds.
#[derive(Clone, Debug)]
enum Watched {
    Scalable(ScalableKind),
    Machine,
    Node,
    Infra(InfraKind),
    /// Optional: readiness does not wait for it (older RBAC may not allow it).
    Cluster,
}

pub struct Store {
    settings: Settings,
    /// The one namespace discovery specs allow, when they all name the same.
    watch_namespace: Option<String>,
    apis: CapiApis,
    client: Client,
    index: Mutex<Index>,
    snapshot: ArcSwap<Snapshot>,
    generation: AtomicU64,
    dirty: AtomicBool,
    changed: Notify,
    watches_total: usize,
    watches_listed: AtomicUsize,
    infra_started: Mutex<BTreeSet<InfraKind>>,
    reported: Mutex<BTreeSet<Problem>>,
    /// Problems become Events on their objects; `None` for read-only uses (`check`).
    recorder: Option<Recorder>,
    metrics: Arc<Metrics>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave the index half-updated in a way later events don't fix.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn object_key(obj: &DynamicObject) -> ObjectKey {
    ObjectKey::new(obj.namespace().unwrap_or_default(), obj.name_any())
}

fn to_json(obj: &DynamicObject) -> serde_json::Value {
    serde_json::to_value(obj).unwrap_or(serde_json::Value::Null)
}

impl Store {
    fn new(
        client: Client,
        apis: CapiApis,
        settings: Settings,
        index: Index,
        metrics: Arc<Metrics>,
        recorder: Option<Recorder>,
        watches_total: usize,
    ) -> Store {
        Store {
            watch_namespace: crate::discovery::watch_namespace(&settings.discovery),
            settings,
            apis,
            client,
            index: Mutex::new(index),
            snapshot: ArcSwap::from_pointee(Snapshot::default()),
            generation: AtomicU64::new(0),
            dirty: AtomicBool::new(false),
            changed: Notify::new(),
            watches_total,
            watches_listed: AtomicUsize::new(0),
            infra_started: Mutex::new(BTreeSet::new()),
            reported: Mutex::new(BTreeSet::new()),
            recorder,
            metrics,
        }
    }

    /// Starts the watches. Returns at once; `wait_ready` tells when everything has listed. With `events`,
    /// problems are also recorded as Events on their objects.
    pub fn start(
        client: Client,
        workload: Option<Client>,
        apis: CapiApis,
        settings: Settings,
        metrics: Arc<Metrics>,
        events: bool,
    ) -> Arc<Store> {
        let recorder = events.then(|| {
            Recorder::new(
                client.clone(),
                Reporter {
                    controller: "capi-autoscaler-provider".into(),
                    instance: std::env::var("POD_NAME").ok(),
                },
            )
        });
        // Readiness waits for every watch but the optional Cluster one.
        let watches_total = apis.scalable.len() + 1 + usize::from(workload.is_some());
        let store = Arc::new(Store::new(
            client,
            apis,
            settings,
            Index::default(),
            metrics,
            recorder,
            watches_total,
        ));
        let mut watches: Vec<(Watched, Api<DynamicObject>)> = Vec::new();
        for (kind, resource) in &store.apis.scalable {
            watches.push((Watched::Scalable(*kind), store.watch_api(resource)));
        }
        watches.push((Watched::Machine, store.watch_api(&store.apis.machine)));
        if let Some(cluster) = &store.apis.cluster {
            watches.push((Watched::Cluster, store.watch_api(cluster)));
        }
        if let Some(workload) = &workload {
            let nodes = ApiResource::erase::<k8s_openapi::api::core::v1::Node>(&());
            watches.push((Watched::Node, Api::all_with(workload.clone(), &nodes)));
        }
        for (what, api) in watches {
            tokio::spawn(Arc::clone(&store).watch(what, api));
        }
        tokio::spawn(Arc::clone(&store).rebuild_loop());
        store
    }

    /// A store over fixed objects, with no watches (benchmarks; `client` is only used by writes).
    pub fn fixed(
        client: Client,
        apis: CapiApis,
        settings: Settings,
        index: Index,
        metrics: Arc<Metrics>,
    ) -> Arc<Store> {
        let store = Arc::new(Store::new(client, apis, settings, index, metrics, None, 0));
        store.rebuild();
        store
    }

    /// The management-cluster API of a kind, narrowed to the one namespace discovery allows, if any.
    fn watch_api(&self, resource: &ApiResource) -> Api<DynamicObject> {
        match &self.watch_namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, resource),
            None => Api::all_with(self.client.clone(), resource),
        }
    }

    pub fn apis(&self) -> &CapiApis {
        &self.apis
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The current snapshot; no lock, no API call.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// Every watch has listed once, and every infrastructure kind referenced so far has listed or failed.
    pub fn is_ready(&self) -> bool {
        self.watches_listed.load(Ordering::Acquire) >= self.watches_total && {
            let index = lock(&self.index);
            index.wanted_infra_kinds().is_empty()
                && lock(&self.infra_started).iter().all(|k| {
                    !matches!(
                        index.infra_kind_state(k),
                        Some(InfraKindState::Syncing) | None
                    )
                })
        }
    }

    /// Polls readiness until `timeout`; the snapshot is rebuilt before returning true.
    pub async fn wait_ready(self: &Arc<Self>, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            self.refresh();
            if self.is_ready() {
                self.rebuild();
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Rebuilds the snapshot now if anything changed since the last build (the Refresh RPC).
    pub fn refresh(self: &Arc<Self>) {
        if self.dirty.swap(false, Ordering::AcqRel) {
            self.rebuild();
        }
    }

    /// Read-your-writes: the replicas a successful write returned, before the watch delivers them. The
    /// index sees it at once; the snapshot with the next `refresh` (the actuator's, after each operation).
    pub fn record_replicas(
        self: &Arc<Self>,
        kind: ScalableKind,
        key: &ObjectKey,
        replicas: i32,
        resource_version: &str,
    ) {
        {
            let mut index = lock(&self.index);
            if let Some(current) = index.resource(kind, key) {
                let mut updated = ScalableResource::clone(current);
                updated.replicas = Some(replicas);
                updated.resource_version = resource_version.to_string();
                index.apply_resource(kind, key.clone(), Ok(Arc::new(updated)));
            }
        }
        self.mark_dirty();
    }

    /// Read-your-writes for a Machine the actuator patched.
    pub fn record_machine(self: &Arc<Self>, object: &DynamicObject) {
        let parsed = Machine::from_json(&self.settings.keys, &to_json(object));
        let key = object_key(object);
        {
            let mut index = lock(&self.index);
            index.apply_machine(
                key.clone(),
                parsed.map(Arc::new).map_err(|e| machine_problem(&key, &e)),
            );
        }
        self.mark_dirty();
    }

    /// Replicas and resourceVersion of a resource as cached.
    pub fn cached_replicas(
        &self,
        kind: ScalableKind,
        key: &ObjectKey,
    ) -> Option<(Option<i32>, String)> {
        let index = lock(&self.index);
        index
            .resource(kind, key)
            .map(|r| (r.replicas, r.resource_version.clone()))
    }

    pub fn cached_machine(&self, key: &ObjectKey) -> Option<Arc<Machine>> {
        lock(&self.index).machine(key).cloned()
    }

    fn mark_dirty(&self) {
        self.dirty.store(true, Ordering::Release);
        self.changed.notify_one();
    }

    fn rebuild(self: &Arc<Self>) {
        let started = Instant::now();
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        let (snapshot, wanted) = {
            let index = lock(&self.index);
            (
                index.snapshot(&self.settings, generation),
                index.wanted_infra_kinds(),
            )
        };
        let snapshot = Arc::new(snapshot);
        self.snapshot.store(Arc::clone(&snapshot));
        self.metrics.observe_snapshot(&snapshot, started.elapsed());
        for kind in wanted {
            self.start_infra_watch(kind);
        }
        // Until everything has listed, missing objects are just not seen yet: not problems to report.
        if self.is_ready() {
            self.report(&snapshot);
        }
    }

    async fn rebuild_loop(self: Arc<Self>) {
        loop {
            self.changed.notified().await;
            // Coalesce a burst of events (a relist, a rollout) into one build, and leave at least
            // REBUILD_SPACING between builds so constant churn in a large cluster costs a bounded share
            // of a core. Refresh (once per CA loop) and the provider's own writes rebuild at once.
            tokio::time::sleep(REBUILD_SPACING).await;
            if self.dirty.swap(false, Ordering::AcqRel) {
                self.rebuild();
            }
        }
    }

    /// Logs and records an Event for each problem the first time it appears; logs when one goes away.
    fn report(self: &Arc<Self>, snapshot: &Snapshot) {
        let current: BTreeSet<Problem> = snapshot.problems.iter().cloned().collect();
        let (new, gone) = {
            let mut reported = lock(&self.reported);
            let new: Vec<Problem> = current.difference(&reported).cloned().collect();
            let gone: Vec<Problem> = reported.difference(&current).cloned().collect();
            *reported = current;
            (new, gone)
        };
        for problem in gone {
            tracing::info!(object = %problem.object, field = %problem.field, "problem resolved: {}", problem.message);
        }
        for problem in new {
            tracing::warn!(object = %problem.object, field = %problem.field, "{}", problem.message);
            if let (Some(recorder), Some(reference)) =
                (&self.recorder, self.event_reference(&problem))
            {
                let recorder = recorder.clone();
                tokio::spawn(async move {
                    let event = KubeEvent {
                        type_: EventType::Warning,
                        reason: "AutoscalerConfigProblem".into(),
                        note: Some(truncate(
                            &format!("{}: {}", problem.field, problem.message),
                            1000,
                        )),
                        // Events aggregate by reason and action: one action per distinct problem keeps a
                        // later problem on the same object from only bumping an older event's count.
                        action: format!("Check-{:016x}", problem_hash(&problem)),
                        secondary: None,
                    };
                    if let Err(e) = recorder.publish(&event, &reference).await {
                        tracing::debug!(object = %problem.object, "recording event: {e}");
                    }
                });
            }
        }
    }

    /// The object a problem is about, when it is one the provider watches.
    fn event_reference(
        &self,
        problem: &Problem,
    ) -> Option<k8s_openapi::api::core::v1::ObjectReference> {
        let (kind, rest) = problem.object.split_once(' ')?;
        let (namespace, name) = rest.split_once('/')?;
        let key = ObjectKey::new(namespace, name);
        let index = lock(&self.index);
        let (uid, resource) = if let Some(kind) = ScalableKind::from_kind(kind) {
            let r = index.resource(kind, &key)?;
            (r.uid.clone(), self.apis.scalable.get(&kind)?)
        } else if kind == "Machine" {
            (index.machine(&key)?.uid.clone(), &self.apis.machine)
        } else {
            return None;
        };
        Some(k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some(resource.api_version.clone()),
            kind: Some(resource.kind.clone()),
            name: Some(key.name),
            namespace: Some(key.namespace),
            uid: Some(uid),
            ..Default::default()
        })
    }

    fn start_infra_watch(self: &Arc<Self>, kind: InfraKind) {
        if !lock(&self.infra_started).insert(kind.clone()) {
            return;
        }
        lock(&self.index).set_infra_kind_state(kind.clone(), InfraKindState::Syncing);
        let store = Arc::clone(self);
        tokio::spawn(async move {
            // The kind may be served later (its CRD installed after the reference): keep looking.
            let mut delay = Duration::from_secs(1);
            let resource = loop {
                match store.infra_resource(&kind).await {
                    Ok(resource) => break resource,
                    Err(reason) => {
                        tracing::warn!(kind = %kind.kind, group = %kind.api_group, retry_in = ?delay, "infrastructure templates unavailable: {reason}");
                        let changed = lock(&store.index).infra_kind_state(&kind)
                            != Some(&InfraKindState::Unavailable(reason.clone()));
                        if changed {
                            lock(&store.index).set_infra_kind_state(
                                kind.clone(),
                                InfraKindState::Unavailable(reason),
                            );
                            store.mark_dirty();
                        }
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(INFRA_RETRY_MAX);
                    }
                }
            };
            let api = store.watch_api(&resource);
            store.watch(Watched::Infra(kind), api).await;
        });
    }

    /// The version serving an infrastructure kind: the first served version of its group that has it,
    /// preferred version first.
    async fn infra_resource(&self, kind: &InfraKind) -> Result<ApiResource, String> {
        let group = discovery::group(&self.client, &kind.api_group)
            .await
            .map_err(|e| {
                format!(
                    "API group {} is not served or not discoverable: {e}",
                    kind.api_group
                )
            })?;
        group
            .recommended_kind(&kind.kind)
            .map(|(resource, _)| resource)
            .ok_or_else(|| format!("API group {} serves no kind {}", kind.api_group, kind.kind))
    }

    async fn watch(self: Arc<Self>, what: Watched, api: Api<DynamicObject>) {
        let mut stream = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        let mut buffer: Vec<DynamicObject> = Vec::new();
        let mut listed_once = false;
        while let Some(event) = stream.next().await {
            match event {
                Ok(Event::Init) => buffer.clear(),
                Ok(Event::InitApply(obj)) => buffer.push(obj),
                Ok(Event::InitDone) => {
                    let objects = std::mem::take(&mut buffer);
                    self.metrics.watch_event(label(&what), "list");
                    self.reset(&what, objects);
                    if !listed_once {
                        listed_once = true;
                        if !matches!(what, Watched::Infra(_) | Watched::Cluster) {
                            self.watches_listed.fetch_add(1, Ordering::AcqRel);
                        }
                    }
                    self.mark_dirty();
                }
                Ok(Event::Apply(obj)) => {
                    self.metrics.watch_event(label(&what), "apply");
                    self.apply(&what, &obj);
                    self.mark_dirty();
                }
                Ok(Event::Delete(obj)) => {
                    self.metrics.watch_event(label(&what), "delete");
                    self.delete(&what, &obj);
                    self.mark_dirty();
                }
                Err(e) => {
                    self.metrics.watch_event(label(&what), "error");
                    let text = watch_error_text(&e);
                    tracing::warn!(watch = label(&what), "watch error: {text}");
                    if let Watched::Infra(kind) = &what
                        && !listed_once
                    {
                        lock(&self.index)
                            .set_infra_kind_state(kind.clone(), InfraKindState::Unavailable(text));
                        self.mark_dirty();
                    }
                }
            }
        }
    }

    fn reset(&self, what: &Watched, objects: Vec<DynamicObject>) {
        let keys = &self.settings.keys;
        let mut index = lock(&self.index);
        match what {
            Watched::Scalable(kind) => index.reset_resources(
                *kind,
                objects
                    .iter()
                    .map(|o| (object_key(o), parse_resource(*kind, keys, o))),
            ),
            Watched::Machine => index.reset_machines(objects.iter().map(|o| {
                let key = object_key(o);
                let parsed = Machine::from_json(keys, &to_json(o))
                    .map(Arc::new)
                    .map_err(|e| machine_problem(&key, &e));
                (key, parsed)
            })),
            Watched::Node => index.reset_nodes(objects.iter().filter_map(parse_node)),
            Watched::Cluster => index.reset_clusters(objects.iter().filter_map(parse_cluster)),
            Watched::Infra(kind) => {
                index.reset_infra(
                    kind,
                    objects.iter().map(|o| (object_key(o), parse_infra(o))),
                );
                index.set_infra_kind_state(kind.clone(), InfraKindState::Synced);
            }
        }
    }

    fn apply(&self, what: &Watched, obj: &DynamicObject) {
        let keys = &self.settings.keys;
        let key = object_key(obj);
        let mut index = lock(&self.index);
        match what {
            Watched::Scalable(kind) => {
                if is_older(
                    index
                        .resource(*kind, &key)
                        .map(|r| r.resource_version.as_str()),
                    obj,
                ) {
                    return;
                }
                index.apply_resource(*kind, key, parse_resource(*kind, keys, obj));
            }
            Watched::Machine => {
                if is_older(
                    index.machine(&key).map(|m| m.resource_version.as_str()),
                    obj,
                ) {
                    return;
                }
                let parsed = Machine::from_json(keys, &to_json(obj))
                    .map(Arc::new)
                    .map_err(|e| machine_problem(&key, &e));
                index.apply_machine(key, parsed);
            }
            Watched::Node => {
                if let Some(node) = parse_node(obj) {
                    index.apply_node(node);
                }
            }
            Watched::Infra(kind) => index.apply_infra(kind.clone(), key, parse_infra(obj)),
            Watched::Cluster => {
                if let Some(cluster) = parse_cluster(obj) {
                    index.apply_cluster(cluster);
                }
            }
        }
    }

    fn delete(&self, what: &Watched, obj: &DynamicObject) {
        let key = object_key(obj);
        let mut index = lock(&self.index);
        match what {
            Watched::Scalable(kind) => index.delete_resource(*kind, &key),
            Watched::Machine => index.delete_machine(&key),
            Watched::Node => index.delete_node(&key.name),
            Watched::Infra(kind) => index.delete_infra(kind, &key),
            Watched::Cluster => index.delete_cluster(&key),
        }
    }
}

fn label(what: &Watched) -> &'static str {
    match what {
        Watched::Scalable(kind) => kind.plural(),
        Watched::Machine => "machines",
        Watched::Node => "nodes",
        Watched::Infra(_) => "infrastructure-templates",
        Watched::Cluster => "clusters",
    }
}

/// A watch event older than what a write of ours already recorded. resourceVersions are opaque to
/// clients in general, but etcd-backed ones are increasing integers; anything else is never "older".
fn is_older(cached: Option<&str>, incoming: &DynamicObject) -> bool {
    let parse = |s: &str| s.parse::<u64>().ok();
    match (
        cached.and_then(parse),
        incoming.resource_version().as_deref().and_then(parse),
    ) {
        (Some(cached), Some(incoming)) => incoming < cached,
        _ => false,
    }
}

fn parse_resource(
    kind: ScalableKind,
    keys: &crate::capi::Keys,
    obj: &DynamicObject,
) -> Result<Arc<ScalableResource>, Problem> {
    ScalableResource::from_json(kind, keys, &to_json(obj))
        .map(Arc::new)
        .map_err(|e| Problem::new(format!("{kind} {}", object_key(obj)), e.field, e.message))
}

fn machine_problem(key: &ObjectKey, e: &crate::capi::ParseError) -> Problem {
    Problem::new(format!("Machine {key}"), e.field.clone(), e.message.clone())
}

fn parse_infra(obj: &DynamicObject) -> Result<Arc<InfraTemplate>, Problem> {
    let kind = obj
        .types
        .as_ref()
        .map(|t| t.kind.clone())
        .unwrap_or_default();
    InfraTemplate::from_json(&to_json(obj))
        .map(Arc::new)
        .map_err(|e| Problem::new(format!("{kind} {}", object_key(obj)), e.field, e.message))
}

/// A Cluster whose topology cannot be read is left out: it only feeds an advisory check.
fn parse_cluster(obj: &DynamicObject) -> Option<ClusterTopology> {
    match ClusterTopology::from_json(&to_json(obj)) {
        Ok(cluster) => Some(cluster),
        Err(e) => {
            tracing::debug!(cluster = %object_key(obj), "topology not read: {e}");
            None
        }
    }
}

fn parse_node(obj: &DynamicObject) -> Option<Node> {
    let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(to_json(obj)).ok()?;
    Some(Node::from_k8s(&node))
}

fn problem_hash(problem: &Problem) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (&problem.field, &problem.message).hash(&mut hasher);
    hasher.finish()
}

/// The part of a watch error a person needs: the API's message rather than the whole status dump.
fn watch_error_text(e: &watcher::Error) -> String {
    let source = match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => e,
        other => return other.to_string(),
    };
    match source {
        kube::Error::Api(status) => format!("{} ({})", status.message, status.code),
        other => other.to_string(),
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}
