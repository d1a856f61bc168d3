//! Watches over the management (and workload) cluster feeding the `Index`, and the published `Snapshot`.
//!
//! Every kind is watched with a kube-runtime watcher; events go into the index as they come, and a
//! snapshot is rebuilt (coalescing bursts) and swapped in atomically. Read RPCs only load the snapshot.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures::StreamExt;
use kube::Client;
use kube::api::{Api, ApiResource};
use kube::runtime::watcher::{self, Event};
use tokio::sync::Notify;

use crate::apis::{CapiApis, infra_resource, resource_name};
use crate::capi::{Machine, ObjectKey, ScalableKind, ScalableResource};
use crate::events::Events;
use crate::index::{self, Prepared, Watched};
use crate::lock;
use crate::metrics::Metrics;
use crate::object::{ApiObject, NodeObject};
use crate::problem::Problem;
use crate::scope::Scope;
use crate::snapshot::{Index, InfraKind, InfraKindState, Settings, Snapshot};

/// Longest wait between two looks for an infrastructure template kind that is not served.
const INFRA_RETRY_MAX: Duration = Duration::from_secs(30);

/// Least time between two snapshot builds triggered by watch events.
const REBUILD_SPACING: Duration = Duration::from_millis(100);

/// First and longest wait before a failed watch is started again (doubling in between).
const RESTART_MIN: Duration = Duration::from_millis(500);
const RESTART_MAX: Duration = Duration::from_secs(15);

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

/// The state of one watch.
#[derive(Debug)]
struct WatchHealth {
    /// Readiness and writes depend on it (not the optional Cluster and infrastructure watches).
    required: bool,
    started: Instant,
    /// Listed completely at least once.
    listed: bool,
    /// Failing since its last complete list.
    failure: Option<WatchFailure>,
}

#[derive(Debug, Clone)]
struct WatchFailure {
    since: Instant,
    message: String,
    /// Forbidden (403) or not found (404): nothing gets better by waiting.
    fatal: bool,
}

/// A watch that is not in sync: what readiness, `/readyz`, `check` and refused writes say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchProblem {
    /// e.g. `machines.cluster.x-k8s.io`, `nodes`.
    pub resource: String,
    /// Forbidden (403) or not found (404).
    pub fatal: bool,
    pub message: String,
}

impl std::fmt::Display for WatchProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "watch of {}: {}", self.resource, self.message)
    }
}

/// What a watch problem says: why it is out of sync, since when.
fn describe(health: &WatchHealth, now: Instant, stale_after: Duration) -> Option<(bool, String)> {
    let secs = |since: Instant| now.saturating_duration_since(since).as_secs();
    match (&health.failure, health.listed) {
        (None, true) => None,
        (None, false) => Some((
            false,
            format!("has not listed yet (waiting {}s)", secs(health.started)),
        )),
        (Some(f), listed) => {
            let stale = f.fatal || now.saturating_duration_since(f.since) >= stale_after;
            if listed && !stale {
                return None;
            }
            let what = if listed {
                "out of sync"
            } else {
                "has not listed yet"
            };
            let hint = if f.fatal {
                " (not transient: fix the RBAC rules or serve the resource; retried meanwhile)"
            } else {
                ""
            };
            Some((
                f.fatal,
                format!(
                    "{what}, failing for {}s: {}{hint}",
                    secs(f.since),
                    f.message
                ),
            ))
        }
    }
}

/// Whether each cluster's watches start with a streamed initial list (see [`streams_initial_lists`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Streaming {
    pub management: bool,
    pub workload: bool,
}

/// Whether an API server of this version (`/version`'s major and minor, e.g. "1", "34+") streams
/// initial lists by default: the WatchList feature gate is on by default in Kubernetes 1.32 and
/// from 1.34, off in 1.33 and before. An unreadable version lists in pages, which every server
/// serves; a server with the gate turned off refuses the stream, and the watch lists in pages.
pub fn streams_initial_lists(major: &str, minor: &str) -> bool {
    let number = |s: &str| {
        s.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse::<u32>()
            .ok()
    };
    matches!((number(major), number(minor)), (Some(1), Some(m)) if m == 32 || m >= 34)
}

pub struct Store {
    settings: Settings,
    /// The one namespace discovery specs allow, when they all name the same.
    watch_namespace: Option<String>,
    apis: CapiApis,
    client: Client,
    index: Mutex<Index>,
    snapshot: ArcSwap<Snapshot>,
    /// Wakes the rebuild loop. Whether there is anything to build is the index's to say (its
    /// journal), read under the same lock as every change is made under: a flag set after a change
    /// would leave a moment where a build finds the change but not the flag, and a write's
    /// read-your-writes would return the snapshot from before it.
    changed: Notify,
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
}

impl Store {
    fn new(
        client: Client,
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
            client,
            index: Mutex::new(index),
            snapshot: ArcSwap::from_pointee(Snapshot::default()),
            changed: Notify::new(),
            watch_settings,
            health: Mutex::new(BTreeMap::new()),
            health_changed: Notify::new(),
            complete: AtomicBool::new(false),
            infra_started: Mutex::new(BTreeSet::new()),
            events,
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
        watch_settings: WatchSettings,
    ) -> Arc<Store> {
        let events = if events {
            Events::recorded(&client)
        } else {
            Events::logged()
        };
        let store = Arc::new(Store::new(
            client,
            apis,
            settings,
            Index::default(),
            metrics,
            events,
            watch_settings,
        ));
        let mut watches: Vec<(Watched, Api<ApiObject>, String)> = Vec::new();
        for (kind, resource) in &store.apis.scalable {
            watches.push((
                Watched::Scalable(*kind),
                store.watch_api(resource),
                resource_name(resource),
            ));
        }
        watches.push((
            Watched::Machine,
            store.watch_api(&store.apis.machine),
            resource_name(&store.apis.machine),
        ));
        if let Some(cluster) = &store.apis.cluster {
            watches.push((
                Watched::Cluster,
                store.watch_api(cluster),
                resource_name(cluster),
            ));
        }
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
            client,
            apis,
            settings,
            index,
            metrics,
            Events::logged(),
            WatchSettings::default(),
        ));
        store.rebuild();
        store
    }

    /// The management-cluster API of a kind, narrowed to the one namespace discovery allows, if any.
    fn watch_api(&self, resource: &ApiResource) -> Api<ApiObject> {
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

    /// A snapshot built after every watch had listed is being served: the RPCs may answer.
    pub fn is_complete(&self) -> bool {
        self.complete.load(Ordering::Acquire)
    }

    /// Every required watch has listed once, and every infrastructure kind referenced so far has
    /// listed or failed: the index holds a complete view (possibly an old one).
    pub fn is_listed(&self) -> bool {
        lock(&self.health).values().all(|h| h.listed || !h.required) && self.infra_settled()
    }

    fn infra_settled(&self) -> bool {
        let index = lock(&self.index);
        index.wanted_infra_kinds().is_empty()
            && lock(&self.infra_started).iter().all(|k| {
                !matches!(
                    index.infra_kind_state(k),
                    Some(InfraKindState::Syncing) | None
                )
            })
    }

    /// Listed, and no required watch stale: what readiness, health and the repair loop go by.
    pub fn is_ready(&self) -> bool {
        self.is_listed() && self.watch_problems().is_empty()
    }

    /// The required watches that have not listed yet or are stale (failing for longer than the
    /// stale bound, or forbidden / not found at all).
    pub fn watch_problems(&self) -> Vec<WatchProblem> {
        let now = Instant::now();
        let stale_after = self.watch_settings.stale_after;
        lock(&self.health)
            .iter()
            .filter(|(_, h)| h.required)
            .filter_map(|(name, h)| {
                describe(h, now, stale_after).map(|(fatal, message)| WatchProblem {
                    resource: name.clone(),
                    fatal,
                    message,
                })
            })
            .collect()
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

    /// The stale watches a write to a group of `kind` depends on: its own kind, MachineSets (a
    /// MachineDeployment's rollout), Machines (which nodes are whose, which are marked).
    pub fn stale_for_write(&self, kind: ScalableKind) -> Vec<WatchProblem> {
        let mut needed: Vec<String> = vec![resource_name(&self.apis.machine)];
        for k in [kind, ScalableKind::MachineSet] {
            if let Some(resource) = self.apis.scalable.get(&k) {
                needed.push(resource_name(resource));
            }
        }
        self.watch_problems()
            .into_iter()
            .filter(|p| needed.contains(&p.resource))
            .collect()
    }

    /// Resolves at the next failure or recovery of a watch.
    pub async fn health_changed(&self) {
        self.health_changed.notified().await;
    }

    /// Sets `watch_stale_seconds` of every watch to now.
    pub fn publish_watch_metrics(&self) {
        self.metrics.ready(self.not_ready_reasons().is_empty());
        let now = Instant::now();
        for (name, h) in lock(&self.health).iter() {
            let since = match (&h.failure, h.listed) {
                (Some(f), _) => Some(f.since),
                (None, false) => Some(h.started),
                (None, true) => None,
            };
            let seconds = since.map_or(0.0, |s| now.saturating_duration_since(s).as_secs_f64());
            self.metrics.watch_stale(name, seconds);
        }
    }

    fn register_watch(&self, name: &str, required: bool) {
        lock(&self.health)
            .entry(name.to_string())
            .or_insert_with(|| WatchHealth {
                required,
                started: Instant::now(),
                listed: false,
                failure: None,
            });
    }

    /// A complete list arrived: the watch is in sync again.
    fn watch_synced(&self, name: &str) {
        let recovered = {
            let mut health = lock(&self.health);
            let Some(h) = health.get_mut(name) else {
                return;
            };
            h.listed = true;
            h.failure.take()
        };
        if let Some(f) = recovered {
            tracing::info!(watch = name, after = ?f.since.elapsed(), "watch in sync again (was failing: {})", f.message);
            self.health_changed.notify_waiters();
        }
    }

    /// The watch failed; it is started again after a pause. Logged when the failure starts or
    /// changes, at error level when it is forbidden or not found.
    fn watch_failed(&self, name: &str, message: String, fatal: bool) {
        let changed = {
            let mut health = lock(&self.health);
            let Some(h) = health.get_mut(name) else {
                return;
            };
            match &mut h.failure {
                Some(f) if f.message == message => false,
                Some(f) => {
                    f.message = message.clone();
                    f.fatal = fatal;
                    true
                }
                None => {
                    h.failure = Some(WatchFailure {
                        since: Instant::now(),
                        message: message.clone(),
                        fatal,
                    });
                    true
                }
            }
        };
        if changed {
            if fatal {
                tracing::error!(
                    watch = name,
                    "watch failed, not a transient error: {message}; the provider is not ready until it is fixed"
                );
            } else {
                tracing::warn!(watch = name, "watch failed: {message}; retrying");
            }
            self.health_changed.notify_waiters();
        } else {
            tracing::debug!(watch = name, "watch failed again: {message}");
        }
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
            self.refresh();
            if self.is_ready() {
                self.rebuild();
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
        if index::apply(&mut lock(&self.index), &self.settings.keys, &what, object) {
            self.wake_rebuild();
        }
    }

    /// The Machines of `namespace` as a LIST just returned them (see [`index::machines_listed`]);
    /// the snapshot is rebuilt at once, since the caller decides from it next.
    pub fn record_machines(
        self: &Arc<Self>,
        namespace: &str,
        list_version: Option<&str>,
        items: Vec<ApiObject>,
    ) {
        index::machines_listed(
            &mut lock(&self.index),
            &self.settings.keys,
            namespace,
            list_version,
            items,
        );
        self.refresh();
    }

    /// A resource as cached.
    pub fn cached_resource(
        &self,
        kind: ScalableKind,
        key: &ObjectKey,
    ) -> Option<Arc<ScalableResource>> {
        lock(&self.index).resource(kind, key).cloned()
    }

    /// Records a Warning Event on a cached Machine (no-op for read-only uses).
    pub fn machine_event(&self, key: &ObjectKey, reason: &str, note: String) {
        let Some(uid) = lock(&self.index).machine(key).map(|m| m.uid.clone()) else {
            return;
        };
        let reference = object_reference(&self.apis.machine, key.clone(), uid);
        self.events
            .warn(reference, reason, reason.to_string(), &note);
    }

    /// Records a Normal Event on a cached group object (no-op for read-only uses).
    pub fn group_event(
        &self,
        kind: ScalableKind,
        key: &ObjectKey,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let Some(uid) = lock(&self.index).resource(kind, key).map(|r| r.uid.clone()) else {
            return;
        };
        let Some(resource) = self.apis.scalable.get(&kind) else {
            return;
        };
        let reference = object_reference(resource, key.clone(), uid);
        self.events
            .normal(reference, reason, action.to_string(), &note);
    }

    pub fn cached_machine(&self, key: &ObjectKey) -> Option<Arc<Machine>> {
        lock(&self.index).machine(key).cloned()
    }

    fn wake_rebuild(&self) {
        self.changed.notify_one();
    }

    fn rebuild(self: &Arc<Self>) {
        self.build(false);
    }

    /// Builds and publishes a snapshot; with `only_if_changed`, only when the index changed since the
    /// last build. Asked of the index under the lock a build publishes under, so when this returns
    /// every change made to the index before the call is served, whichever caller built it.
    fn build(self: &Arc<Self>, only_if_changed: bool) {
        let started = Instant::now();
        // Judged before the build: a snapshot is complete only if everything had listed before it.
        let ready = self.is_listed();
        let snapshot = {
            let mut index = lock(&self.index);
            if only_if_changed && !index.changed_since_snapshot() {
                return;
            }
            // Built from the snapshot served now: only the groups changed since are rebuilt when that is
            // enough (the provider's own writes), templates whose inputs did not change are reused.
            // Published under the index lock, so two builds never publish out of order.
            let previous = self.snapshot.load();
            let snapshot = Arc::new(index.snapshot_reusing(&self.settings, &previous));
            self.snapshot.store(Arc::clone(&snapshot));
            if ready
                && (previous.scope != snapshot.scope
                    || previous.scope_reason != snapshot.scope_reason
                    || !self.is_complete())
            {
                log_scope(&snapshot);
            }
            snapshot
        };
        if ready && !self.complete.swap(true, Ordering::AcqRel) {
            tracing::info!(groups = snapshot.groups.len(), build = ?started.elapsed(), "serving: every watch has listed");
        }
        self.metrics.observe_snapshot(&snapshot, started.elapsed());
        self.start_referenced_infra_watches();
        // Until everything has listed, missing objects are just not seen yet: not problems to report.
        if self.is_listed() {
            self.events
                .report(&snapshot.problems, |p| self.event_reference(p));
            self.events
                .report_holds(&held_scale_ups(&snapshot), |id| self.group_reference(id));
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

    /// Watches the infrastructure template kinds the objects reference and nothing watches yet.
    fn start_referenced_infra_watches(self: &Arc<Self>) {
        let wanted = lock(&self.index).wanted_infra_kinds();
        for kind in wanted {
            self.start_infra_watch(kind);
        }
    }

    /// The object a problem is about, when it is one the provider watches.
    /// The object of group `id` (`Kind/namespace/name`), for an Event.
    fn group_reference(&self, id: &str) -> Option<k8s_openapi::api::core::v1::ObjectReference> {
        let mut parts = id.splitn(3, '/');
        let kind = ScalableKind::from_kind(parts.next()?)?;
        let key = ObjectKey::new(parts.next()?, parts.next()?);
        let uid = lock(&self.index).resource(kind, &key)?.uid.clone();
        Some(object_reference(self.apis.scalable.get(&kind)?, key, uid))
    }

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
        Some(object_reference(resource, key, uid))
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
                match infra_resource(&store.client, &kind).await {
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
                            store.wake_rebuild();
                        }
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(INFRA_RETRY_MAX);
                    }
                }
            };
            let api = store.watch_api(&resource);
            let name = resource_name(&resource);
            store.register_watch(&name, false);
            store.watch(Watched::Infra(kind), api, name).await;
        });
    }

    /// Runs one watch for good. After an error the watcher is dropped and started again (a fresh
    /// list) after a pause: the next complete list is what says the watch is in sync again, since a
    /// watch resumed from a resourceVersion delivers nothing when nothing changed.
    ///
    /// Where the cluster's server streams initial lists, the list comes as a stream of watch events
    /// (WatchList: the server never builds the whole list in one response, and parsing event by
    /// event costs about half the CPU of list pages). A server that refuses it (the feature off: 422,
    /// or an older server: 400) gets paginated lists from then on.
    async fn watch<const S: bool>(
        self: Arc<Self>,
        what: Watched,
        api: Api<ApiObject<S>>,
        name: String,
    ) {
        let timeout = u32::try_from(self.watch_settings.timeout.as_secs())
            .unwrap_or(290)
            .clamp(1, 290);
        let mut streaming = match what {
            Watched::Node => self.watch_settings.streaming.workload,
            _ => self.watch_settings.streaming.management,
        };
        let mut listed_once = false;
        let mut delay = RESTART_MIN;
        loop {
            let mut config = watcher::Config::default().timeout(timeout);
            if streaming {
                config = config.streaming_lists();
            }
            let mut stream = watcher::watcher(api.clone(), config).boxed();
            let mut synced_here = false;
            // A (re)list is parsed object by object as it arrives: only the views are held until it
            // is complete, never the JSON of every object (which is many times their size).
            let mut buffer: Vec<Prepared> = Vec::new();
            let mut list_started = Instant::now();
            let failure = loop {
                let Some(event) = stream.next().await else {
                    break None;
                };
                match event {
                    Ok(Event::Init) => {
                        buffer.clear();
                        list_started = Instant::now();
                    }
                    Ok(Event::InitApply(obj)) => {
                        buffer.push(index::prepare(&self.settings.keys, &what, obj))
                    }
                    Ok(Event::InitDone) => {
                        let objects = std::mem::take(&mut buffer);
                        // What a slow start spent its time on, one line per watch.
                        if !listed_once {
                            tracing::info!(watch = %name, objects = objects.len(), took = ?list_started.elapsed(), "listed");
                        }
                        self.metrics.watch_event(what.label(), "list");
                        index::reset(&mut lock(&self.index), &what, objects);
                        listed_once = true;
                        synced_here = true;
                        self.watch_synced(&name);
                        delay = RESTART_MIN;
                        self.wake_rebuild();
                    }
                    Ok(Event::Apply(obj)) => {
                        self.metrics.watch_event(what.label(), "apply");
                        if index::apply(&mut lock(&self.index), &self.settings.keys, &what, obj) {
                            self.wake_rebuild();
                        }
                    }
                    Ok(Event::Delete(obj)) => {
                        self.metrics.watch_event(what.label(), "delete");
                        index::delete(&mut lock(&self.index), &what, &obj);
                        self.wake_rebuild();
                    }
                    // 410 Gone: the resourceVersion is too old; the watcher lists again by itself.
                    Err(e) if watch_error_code(&e) == Some(410) => {
                        self.metrics.watch_event(what.label(), "expired");
                        tracing::debug!(watch = %name, "watch expired, listing again: {}", watch_error_text(&e));
                    }
                    Err(e) => break Some(e),
                }
            };
            drop(stream);
            if streaming
                && !synced_here
                && let Some(code @ (400 | 422)) = failure.as_ref().and_then(watch_error_code)
            {
                tracing::info!(watch = %name, code, "the API server does not stream initial lists (WatchList): listing in pages instead");
                streaming = false;
                continue;
            }
            let (text, fatal) = match &failure {
                Some(e) => (
                    watch_error_text(e),
                    matches!(watch_error_code(e), Some(403 | 404)),
                ),
                None => ("the watch stream ended".to_string(), false),
            };
            self.metrics.watch_event(what.label(), "error");
            self.watch_failed(&name, text.clone(), fatal);
            if let Watched::Infra(kind) = &what
                && !listed_once
            {
                lock(&self.index)
                    .set_infra_kind_state(kind.clone(), InfraKindState::Unavailable(text));
                self.wake_rebuild();
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(RESTART_MAX);
        }
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

/// The groups whose scale-up Cluster API's preflight checks hold back (with instances reported as
/// failed to create), with what their Event says.
fn held_scale_ups(snapshot: &Snapshot) -> Vec<(String, String)> {
    snapshot
        .groups
        .values()
        .filter_map(|g| {
            let hold = g.preflight.as_ref()?;
            let held = g
                .instances
                .iter()
                .filter(|i| crate::preflight::is_held_id(&i.id))
                .count();
            (held > 0).then(|| {
                (
                    g.id.clone(),
                    format!(
                        "{held} replica(s) reported to the cluster-autoscaler as failed to create: {}",
                        hold.message
                    ),
                )
            })
        })
        .collect()
}

fn object_reference(
    resource: &ApiResource,
    key: ObjectKey,
    uid: String,
) -> k8s_openapi::api::core::v1::ObjectReference {
    k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some(resource.api_version.clone()),
        kind: Some(resource.kind.clone()),
        name: Some(key.name),
        namespace: Some(key.namespace),
        uid: Some(uid),
        ..Default::default()
    }
}

/// The part of a watch error a person needs: the API's message rather than the whole status dump.
fn watch_error_text(e: &watcher::Error) -> String {
    let source = match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => e,
        watcher::Error::WatchError(status) => {
            return format!("{} ({})", status.message, status.code);
        }
        other => return other.to_string(),
    };
    match source {
        kube::Error::Api(status) => format!("{} ({})", status.message, status.code),
        other => with_causes(other),
    }
}

/// An error with its causes (`client error (Connect): tcp connect error: Connection refused`): the
/// outermost alone rarely says what went wrong.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

/// The HTTP status code of a watch error that came from the API server.
fn watch_error_code(e: &watcher::Error) -> Option<u16> {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => Some(status.code),
        watcher::Error::WatchError(status) => Some(status.code),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(listed: bool, failure: Option<(u64, &str, bool)>, now: Instant) -> WatchHealth {
        WatchHealth {
            required: true,
            started: now - Duration::from_secs(100),
            listed,
            failure: failure.map(|(ago, message, fatal)| WatchFailure {
                since: now - Duration::from_secs(ago),
                message: message.to_string(),
                fatal,
            }),
        }
    }

    /// A store with no watches, over a client that is never called.
    /// A client whose calls all fail (nothing listens on port 9).
    fn unreachable_client() -> Client {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        Client::try_from(config).unwrap()
    }

    fn unwatched_store() -> Arc<Store> {
        Store::fixed(
            unreachable_client(),
            CapiApis::assume(crate::capi::DEFAULT_GROUP, "v1beta2"),
            Settings::default(),
            Index::default(),
            Arc::new(Metrics::new()),
        )
    }

    fn md(replicas: i64, rv: &str) -> ApiObject {
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
            unreachable_client(),
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

    #[test]
    fn initial_lists_are_streamed_only_where_the_server_streams_them_by_default() {
        for (major, minor, streams) in [
            ("1", "36", true),
            ("1", "34", true),
            ("1", "34+", true),
            ("1", "33", false),
            ("1", "32", true),
            ("1", "31", false),
            ("1", "27", false),
            ("2", "0", false),
            ("1", "", false),
            ("", "", false),
            ("one", "thirty-four", false),
        ] {
            assert_eq!(
                streams_initial_lists(major, minor),
                streams,
                "{major}.{minor}"
            );
        }
    }

    #[test]
    fn a_watch_is_stale_after_the_bound_or_at_once_when_forbidden() {
        let now = Instant::now();
        let bound = Duration::from_secs(60);
        // In sync.
        assert_eq!(describe(&health(true, None, now), now, bound), None);
        // A transient error within the bound: still in sync as far as readiness goes.
        assert_eq!(
            describe(
                &health(true, Some((59, "connection refused", false)), now),
                now,
                bound
            ),
            None
        );
        // Past the bound: stale, with how long and why.
        let (fatal, text) = describe(
            &health(true, Some((61, "connection refused", false)), now),
            now,
            bound,
        )
        .unwrap();
        assert!(!fatal);
        assert!(
            text.contains("failing for 61s: connection refused"),
            "{text}"
        );
        // Forbidden: at once.
        let (fatal, text) = describe(
            &health(true, Some((0, "machines is forbidden (403)", true)), now),
            now,
            bound,
        )
        .unwrap();
        assert!(fatal);
        assert!(text.contains("machines is forbidden (403)"), "{text}");
        // Never listed: a problem whatever the error, saying so.
        let (_, text) = describe(&health(false, None, now), now, bound).unwrap();
        assert!(text.contains("has not listed yet"), "{text}");
        let (_, text) =
            describe(&health(false, Some((1, "timeout", false)), now), now, bound).unwrap();
        assert!(
            text.contains("has not listed yet, failing for 1s: timeout"),
            "{text}"
        );
    }
}
