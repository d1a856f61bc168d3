//! Watches over the management (and workload) cluster feeding the `Index`, and the published `Snapshot`.
//!
//! Every kind is watched with a kube-runtime watcher; events go into the index as they come, and a
//! snapshot is rebuilt (coalescing bursts) and swapped in atomically. Read RPCs only load the snapshot.
//!
//! This file: the [`Store`] (publication of snapshots, readiness, the rebuild loop). `health`: whether
//! each watch is in sync; `stream`: one watch's loop; `infra`: the infrastructure template kinds
//! watched on demand; `object_events`: Events on the objects the store caches.

mod health;
mod infra;
mod object_events;
mod stream;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kube::Client;
use kube::api::{Api, ApiResource};
use tokio::sync::Notify;

use crate::apis::{CapiApis, resource_name};
use crate::cache::writer::{self as index, Watched};
use crate::cache::{Index, InfraKind};
use crate::capi::{Machine, ObjectKey, ScalableKind, ScalableResource};
use crate::events::Events;
use crate::lock;
use crate::metrics::Metrics;
use crate::object::{ApiObject, NodeObject};
use crate::scope::Scope;
use crate::server_clock::ServerClock;
use crate::snapshot::{Settings, Snapshot};

use health::WatchHealth;
pub use stream::{Streaming, streams_initial_lists};

/// Least time between two snapshot builds triggered by watch events.
const REBUILD_SPACING: Duration = Duration::from_millis(100);

/// How the watches run and when they count as stale.
#[derive(Clone, Copy, Debug)]
pub struct WatchSettings {
    /// Server-side timeout of each watch request: a watch is re-established (and so re-authorized) at
    /// least this often.
    pub timeout: Duration,
    /// A watch failing for longer is stale: not ready, and writes that need it are refused.
    /// Forbidden (403) and not found (404) are stale at once.
    pub stale_after: Duration,
    /// Which clusters' watches start with a streamed initial list.
    pub streaming: Streaming,
}

impl Default for WatchSettings {
    fn default() -> Self {
        WatchSettings {
            timeout: Duration::from_secs(60),
            stale_after: Duration::from_secs(60),
            streaming: Streaming::default(),
        }
    }
}

/// The management cluster's API: its client, and its server's clock as that client's answers show it.
pub struct ManagementApi {
    pub client: Client,
    pub clock: ServerClock,
}

pub struct Store {
    settings: Settings,
    /// The one namespace discovery specs allow, when they all name the same.
    watch_namespace: Option<String>,
    apis: CapiApis,
    client: Client,
    /// The API server's clock, as `client`'s answers show it.
    server_clock: ServerClock,
    index: Mutex<Index>,
    snapshot: ArcSwap<Snapshot>,
    /// Wakes the rebuild loop. Whether there is anything to build is the index's to say (its
    /// journal), read under the same lock as every change is made under: a flag set after a change
    /// would leave a moment where a build finds the change but not the flag, and a write's
    /// read-your-writes would return the snapshot from before it.
    changed: Notify,
    /// Marked changed with every snapshot published.
    published: tokio::sync::watch::Sender<()>,
    /// Signalled when the watch of Machines or of MachineSets has brought the index further
    /// ([`Index::watched`]).
    watermark_moved: Notify,
    watch_settings: WatchSettings,
    /// Every watch by resource name.
    health: Mutex<BTreeMap<String, WatchHealth>>,
    /// Signalled when a watch fails or recovers.
    health_changed: Notify,
    /// Set once a snapshot built from a complete listing is published.
    complete: AtomicBool,
    infra_started: Mutex<BTreeSet<InfraKind>>,
    events: Events,
    metrics: Arc<Metrics>,
    /// When the watches were started: a start's log says how long listing took.
    started: Instant,
}

impl Store {
    fn new(
        management: ManagementApi,
        apis: CapiApis,
        settings: Settings,
        index: Index,
        metrics: Arc<Metrics>,
        events: Events,
        watch_settings: WatchSettings,
    ) -> Store {
        Store {
            watch_namespace: crate::discovery::watch_namespace(&settings.discovery),
            settings,
            apis,
            client: management.client,
            server_clock: management.clock,
            index: Mutex::new(index),
            snapshot: ArcSwap::from_pointee(Snapshot::default()),
            changed: Notify::new(),
            published: tokio::sync::watch::channel(()).0,
            watermark_moved: Notify::new(),
            watch_settings,
            health: Mutex::new(BTreeMap::new()),
            health_changed: Notify::new(),
            complete: AtomicBool::new(false),
            infra_started: Mutex::new(BTreeSet::new()),
            events,
            metrics,
            started: Instant::now(),
        }
    }

    /// Starts the watches. Returns at once; `wait_ready` tells when everything has listed. With `events`,
    /// problems are also recorded as Events on their objects.
    pub fn start(
        management: ManagementApi,
        workload: Option<Client>,
        apis: CapiApis,
        settings: Settings,
        metrics: Arc<Metrics>,
        events: bool,
        watch_settings: WatchSettings,
    ) -> Arc<Store> {
        let events = if events {
            Events::recorded(&management.client)
        } else {
            Events::logged()
        };
        let store = Arc::new(Store::new(
            management,
            apis,
            settings,
            Index::default(),
            metrics,
            events,
            watch_settings,
        ));
        let watches = store.management_watches();
        let nodes = workload.as_ref().map(|workload| {
            let nodes = ApiResource::erase::<k8s_openapi::api::core::v1::Node>(&());
            let name = resource_name(&nodes);
            (Api::<NodeObject>::all_with(workload.clone(), &nodes), name)
        });
        // Every watch is known before any of them runs, so readiness never counts a partial set.
        for (what, _, name) in &watches {
            // Readiness waits for every watch but the optional Cluster one.
            store.register_watch(name, !matches!(what, Watched::Cluster));
        }
        if let Some((_, name)) = &nodes {
            store.register_watch(name, true);
        }
        for (what, api, name) in watches {
            tokio::spawn(Arc::clone(&store).watch(what, api, name));
        }
        if let Some((api, name)) = nodes {
            tokio::spawn(Arc::clone(&store).watch(Watched::Node, api, name));
        }
        tokio::spawn(Arc::clone(&store).rebuild_loop());
        store
    }

    /// The watches of the management cluster: each scalable kind, Machines, and Clusters when
    /// served, with the resource name each is known by.
    fn management_watches(&self) -> Vec<(Watched, Api<ApiObject>, String)> {
        let mut watches: Vec<(Watched, Api<ApiObject>, String)> = Vec::new();
        for (kind, resource) in &self.apis.scalable {
            watches.push((
                Watched::Scalable(*kind),
                self.watch_api(resource),
                resource_name(resource),
            ));
        }
        watches.push((
            Watched::Machine,
            self.watch_api(&self.apis.machine),
            resource_name(&self.apis.machine),
        ));
        if let Some(cluster) = &self.apis.cluster {
            watches.push((
                Watched::Cluster,
                self.watch_api(cluster),
                resource_name(cluster),
            ));
        }
        watches
    }

    /// A store over fixed objects, with no watches (`client` is only used by writes).
    #[cfg(test)]
    pub fn fixed(
        client: Client,
        apis: CapiApis,
        settings: Settings,
        index: Index,
        metrics: Arc<Metrics>,
    ) -> Arc<Store> {
        let store = Arc::new(Store::new(
            ManagementApi {
                client,
                clock: ServerClock::default(),
            },
            apis,
            settings,
            index,
            metrics,
            Events::logged(),
            WatchSettings::default(),
        ));
        store.build(false);
        store
    }

    /// The management-cluster API of a kind, narrowed to the one namespace discovery allows, if any.
    pub(super) fn watch_api(&self, resource: &ApiResource) -> Api<ApiObject> {
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

    pub fn server_clock(&self) -> &ServerClock {
        &self.server_clock
    }

    /// The current snapshot; no lock, no API call.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// Marked changed with every snapshot published.
    pub fn published(&self) -> tokio::sync::watch::Receiver<()> {
        self.published.subscribe()
    }

    /// A snapshot built after every watch had listed is being served: the RPCs may answer.
    pub fn is_complete(&self) -> bool {
        self.complete.load(Ordering::Acquire)
    }

    /// Every required watch has listed once, and every infrastructure kind referenced so far has
    /// listed or failed: the index holds a complete view (possibly an old one).
    pub fn is_listed(&self) -> bool {
        self.required_watches_listed() && self.infra_settled()
    }

    /// Listed, and no required watch stale: what readiness, health and the repair loop go by.
    pub fn is_ready(&self) -> bool {
        self.is_listed() && self.watch_problems().is_empty()
    }

    /// Why the provider is not ready, one reason per line; empty when it is.
    pub fn not_ready_reasons(&self) -> Vec<String> {
        let mut reasons: Vec<String> = self
            .watch_problems()
            .iter()
            .map(ToString::to_string)
            .collect();
        if reasons.is_empty() && !self.infra_settled() {
            reasons.push(
                "infrastructure templates referenced by node groups are still being listed".into(),
            );
        }
        // Serving nothing because of which Cluster is served is a configuration to fix, said where
        // the operator looks first (the pod's readiness).
        if reasons.is_empty()
            && self.is_complete()
            && let Some(why) = &self.snapshot().scope_reason
        {
            reasons.push(why.clone());
        }
        reasons
    }

    /// Polls readiness until `timeout`; the snapshot is rebuilt before returning true.
    pub async fn wait_ready(self: &Arc<Self>, timeout: Duration) -> bool {
        self.wait_ready_or_fatal(timeout, false).await.is_ok()
    }

    /// Polls readiness until `timeout`; the snapshot is rebuilt before returning `Ok`. With
    /// `fail_fast`, returns at once when a required watch is forbidden or not found. `Err` holds the
    /// reasons it is not ready.
    pub async fn wait_ready_or_fatal(
        self: &Arc<Self>,
        timeout: Duration,
        fail_fast: bool,
    ) -> Result<(), Vec<String>> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.is_ready() {
                // The first build once everything has listed (unless the rebuild loop made it
                // already), then only what changed: a build before that would be thrown away.
                self.build(self.is_complete());
                return Ok(());
            }
            let problems = self.watch_problems();
            if (fail_fast && problems.iter().any(|p| p.fatal)) || Instant::now() >= deadline {
                return Err(self.not_ready_reasons());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Rebuilds the snapshot now if anything changed since the last build (the Refresh RPC).
    pub fn refresh(self: &Arc<Self>) {
        self.build(true);
    }

    /// Read-your-writes: a Machine, MachineDeployment, MachineSet or MachinePool as a write of the
    /// actuator got it back goes into the index at once (unless the watch has delivered a later
    /// version meanwhile); the snapshot follows on the next build.
    pub fn record(self: &Arc<Self>, kind: Option<ScalableKind>, object: ApiObject) {
        let what = kind.map_or(Watched::Machine, Watched::Scalable);
        let mut index = lock(&self.index);
        if !index::deleted_since(&index, kind, &object)
            && index::apply(&mut index, &self.settings.keys, &what, object)
        {
            drop(index);
            self.wake_rebuild();
        }
    }

    /// A Cluster as the writer just read it (its pause and topology decide whether a write may go).
    pub fn record_cluster(self: &Arc<Self>, object: ApiObject) {
        if index::apply(
            &mut lock(&self.index),
            &self.settings.keys,
            &Watched::Cluster,
            object,
        ) {
            self.wake_rebuild();
        }
    }

    /// The Machines of `namespace` (those carrying `selector`'s label, when given) as a LIST just
    /// returned them (see [`index::machines_listed`]); the snapshot is rebuilt at once, since the
    /// caller decides from it next.
    pub fn record_machines(
        self: &Arc<Self>,
        namespace: &str,
        selector: Option<(&str, &str)>,
        list_version: Option<&str>,
        items: Vec<ApiObject>,
    ) {
        index::machines_listed(
            &mut lock(&self.index),
            &self.settings.keys,
            namespace,
            selector,
            list_version,
            items,
        );
        self.refresh();
    }

    /// How far the watch of Machines (`kind` `None`) or of `kind` has brought the index.
    pub fn watched(&self, kind: Option<ScalableKind>) -> u64 {
        lock(&self.index).watched(kind)
    }

    /// The revision the watch of Machines (`kind` `None`) or of `kind` has brought the index up
    /// to, once it is `floor` or newer, waiting for it until `deadline`; `None` when it is still
    /// older then.
    pub async fn watched_from(
        &self,
        kind: Option<ScalableKind>,
        floor: u64,
        deadline: Instant,
    ) -> Option<u64> {
        loop {
            let moved = self.watermark_moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            let watched = lock(&self.index).watched(kind);
            if watched >= floor {
                return Some(watched);
            }
            tokio::time::timeout_at(deadline.into(), moved).await.ok()?;
        }
    }

    /// A resource as cached.
    pub fn cached_resource(
        &self,
        kind: ScalableKind,
        key: &ObjectKey,
    ) -> Option<Arc<ScalableResource>> {
        lock(&self.index).resource(kind, key).cloned()
    }

    pub fn cached_machine(&self, key: &ObjectKey) -> Option<Arc<Machine>> {
        lock(&self.index).machine(key).cloned()
    }

    pub(super) fn wake_rebuild(&self) {
        self.changed.notify_one();
    }

    /// Builds and publishes a snapshot; with `only_if_changed`, only when the index changed since the
    /// last build. Asked of the index under the lock a build publishes under, so when this returns
    /// every change made to the index before the call is served, whichever caller built it.
    fn build(self: &Arc<Self>, only_if_changed: bool) {
        let started = Instant::now();
        // Judged before the build: a snapshot is complete only if everything had listed before it.
        let ready = self.is_listed();
        let (snapshot, whole) = {
            let mut index = lock(&self.index);
            if only_if_changed && !index.changed_since_snapshot() {
                return;
            }
            // Built from the snapshot served now: only the groups changed since are rebuilt when that is
            // enough (the provider's own writes), templates whose inputs did not change are reused.
            // Published under the index lock, so two builds never publish out of order.
            let previous = self.snapshot.load();
            let whole = index.builds_whole_after(previous.basis);
            let snapshot = Arc::new(index.snapshot_reusing(&self.settings, &previous));
            self.snapshot.store(Arc::clone(&snapshot));
            self.published.send_replace(());
            if ready
                && (previous.scope != snapshot.scope
                    || previous.scope_reason != snapshot.scope_reason
                    || !self.is_complete())
            {
                log_scope(&snapshot);
            }
            (snapshot, whole)
        };
        if ready && !self.complete.swap(true, Ordering::AcqRel) {
            tracing::info!(groups = snapshot.groups.len(), machines = snapshot.machines, build = ?started.elapsed(), after = ?self.started.elapsed(), "serving: every watch has listed");
        }
        self.metrics.observe_snapshot(&snapshot, started.elapsed());
        if whole {
            // The snapshot before, and what the build allocated on its way, are free now (but for
            // the readers still holding it): their pages go back to the system.
            crate::memory::release_free_pages();
        }
        self.start_referenced_infra_watches();
        // Until everything has listed, missing objects are just not seen yet: not problems to report.
        if self.is_listed() {
            self.report_to_objects(&snapshot);
        }
    }

    async fn rebuild_loop(self: Arc<Self>) {
        loop {
            self.changed.notified().await;
            // Coalesce a burst of events (a relist, a rollout) into one build, and leave at least
            // REBUILD_SPACING between builds so constant churn in a large cluster costs a bounded share
            // of a core. Refresh (once per CA loop) and the provider's own writes rebuild at once.
            tokio::time::sleep(REBUILD_SPACING).await;
            self.rebuild_changed();
        }
    }

    /// Rebuilds if the index changed. Nothing is served before every watch has listed, so until
    /// then a build (a second each at 100,000 Machines) would be thrown away: only the
    /// infrastructure kinds the objects reference are started, as being listed waits for them too.
    fn rebuild_changed(self: &Arc<Self>) {
        if !self.is_complete() && !self.is_listed() {
            self.start_referenced_infra_watches();
            return;
        }
        self.build(true);
    }
}

/// Says which Cluster is served when that is decided or changes, and why nothing is when nothing is
/// (the reason `/readyz` gives, in the log too).
fn log_scope(snapshot: &Snapshot) {
    match (&snapshot.scope, &snapshot.scope_reason) {
        (_, Some(why)) => tracing::error!("{why}"),
        (Scope::Cluster { cluster, how }, None) => {
            tracing::info!(%cluster, "serving the node groups of Cluster {cluster} ({how})");
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::InfraKindState;

    /// A client whose calls all fail (nothing listens on port 9).
    fn unreachable_client() -> Client {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        Client::try_from(config).unwrap()
    }

    /// A store with no watches, over a client that is never called.
    pub(super) fn unwatched_store() -> Arc<Store> {
        Store::fixed(
            unreachable_client(),
            CapiApis::assume(crate::capi::DEFAULT_GROUP, "v1beta2"),
            Settings::default(),
            Index::default(),
            Arc::new(Metrics::new()),
        )
    }

    pub(super) fn md(replicas: i64, rv: &str) -> ApiObject {
        ApiObject::from_json(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2",
            "kind": "MachineDeployment",
            "metadata": {
                "name": "md", "namespace": "ns", "uid": "uid-md", "resourceVersion": rv,
                "annotations": {
                    "cluster.x-k8s.io/cluster-api-autoscaler-node-group-min-size": "0",
                    "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size": "5",
                },
            },
            "spec": {"clusterName": "c1", "replicas": replicas, "template": {"spec": {"clusterName": "c1"}}},
        }))
        .unwrap()
    }

    fn machine_deployment(replicas: i64, rv: &str, infra: Option<&str>) -> ApiObject {
        let mut json = md(replicas, rv).into_json();
        if let Some(kind) = infra {
            json["spec"]["template"]["spec"]["infrastructureRef"] = serde_json::json!({
                "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": kind, "name": "t",
            });
        }
        ApiObject::from_json(json).unwrap()
    }

    #[tokio::test]
    async fn nothing_is_built_before_every_watch_has_listed_but_referenced_infrastructure_is_watched()
     {
        let store = Arc::new(Store::new(
            ManagementApi {
                client: unreachable_client(),
                clock: ServerClock::default(),
            },
            CapiApis::assume(crate::capi::DEFAULT_GROUP, "v1beta2"),
            Settings::default(),
            Index::default(),
            Arc::new(Metrics::new()),
            Events::logged(),
            WatchSettings::default(),
        ));
        store.register_watch("machinedeployments", true);
        let keys = store.settings.keys.clone();
        let scalable = Watched::Scalable(ScalableKind::MachineDeployment);
        let object = machine_deployment(2, "10", Some("DockerMachineTemplate"));
        assert!(index::apply(
            &mut lock(&store.index),
            &keys,
            &scalable,
            object
        ));

        store.rebuild_changed();
        assert_eq!(target(&store), None, "built before the watch listed");
        assert!(!store.is_complete());
        let started: Vec<String> = lock(&store.infra_started)
            .iter()
            .map(|k| k.kind.clone())
            .collect();
        assert_eq!(started, ["DockerMachineTemplate"]);

        store.watch_synced("machinedeployments");
        // The template's kind is still being looked up (its API is unreachable here), so the
        // view is not complete yet; once that lookup has failed it is.
        lock(&store.index).set_infra_kind_state(
            started_kind(&store),
            InfraKindState::Unavailable("unreachable".into()),
        );
        store.rebuild_changed();
        assert_eq!(target(&store), Some(2));
        assert!(store.is_complete());
    }

    fn started_kind(store: &Store) -> InfraKind {
        lock(&store.infra_started).iter().next().cloned().unwrap()
    }

    fn target(store: &Store) -> Option<i32> {
        store
            .snapshot()
            .group("MachineDeployment/ns/md")
            .map(|g| g.target)
    }

    /// CI once saw TargetSize answer the old size right after IncreaseSize: the watch had applied
    /// the write's echo and not yet said so, the write's own answer was then a no-op, and the
    /// refresh found nothing to build.
    #[tokio::test]
    async fn a_refresh_serves_every_change_in_the_index_even_one_nobody_announced() {
        let store = unwatched_store();
        let keys = store.settings.keys.clone();
        let scalable = Watched::Scalable(ScalableKind::MachineDeployment);
        assert!(index::apply(
            &mut lock(&store.index),
            &keys,
            &scalable,
            md(2, "10")
        ));
        store.refresh();
        assert_eq!(target(&store), Some(2));
        // The watch's echo of a write, taken into the index; the loop is not woken yet.
        assert!(index::apply(
            &mut lock(&store.index),
            &keys,
            &scalable,
            md(4, "11")
        ));
        // The write's own answer is the same version: nothing for the index to take.
        store.record(Some(ScalableKind::MachineDeployment), md(4, "11"));
        store.refresh();
        assert_eq!(
            target(&store),
            Some(4),
            "read-your-writes after the echo won"
        );
        // Nothing changed since: the snapshot served is kept, not built again.
        let built = store.snapshot();
        store.refresh();
        assert!(Arc::ptr_eq(&built, &store.snapshot()));
    }
}
