//! A lighter scenario than [`super::real_capi_scenario::RealCapiScenario`] for the tests that drive
//! the provider themselves (through its RPCs, or a CA they start): a namespace on the real Cluster
//! API manager with Cluster `workload` of the stand-in, the stand-in cloud and kubelets, and the
//! `small` machine template; MachineDeployments of it made with [`RealCapiNamespace::group`]; the
//! Machines CAPI deletes, and the values a delete mark takes, recorded by 100 ms pollers.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::Client;
use kube::api::{DynamicObject, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

use super::autoscaler::{Autoscaler, AutoscalerProcess};
use capi_autoscaler_provider::proto::ExternalGrpcNode;

use super::capi::{Rpc, grpc_node};
use super::capi_manager::{CapiManager, capi_manager};
use super::procs::{self, Check, poll_until};
use super::real_capi::{
    CAPACITY, DELETE_MACHINE, DEPLOYMENT_NAME, MACHINES, api, create, machine_deployment,
    machines_of, machines_with_nodes, name_of, replicas,
};
use super::standin::{self, StandIn};
use super::workload::scenario_labels;
use super::{ProviderProcess, start_provider};

/// The Cluster of the namespace.
pub const CLUSTER: &str = "workload";
/// The stand-in machine template every group of the namespace is made on.
pub const TEMPLATE: &str = "small";

/// The size CA needs to read from template [`TEMPLATE`]'s status to scale a group from zero.
pub const SIZE: [(&str, &str); 3] = [("cpu", "2"), ("memory", "4Gi"), ("pods", "110")];

/// A namespace with a workload Cluster, the stand-in cloud and the `small` template.
pub struct RealCapiNamespace {
    pub manager: &'static CapiManager,
    pub client: Client,
    pub ns: String,
    pub standin: StandIn,
    pub started: Instant,
}

/// Every Machine of the namespace seen being deleted (or gone after being seen), until dropped.
pub struct Deleted {
    seen: Arc<Mutex<(BTreeSet<String>, BTreeSet<String>)>>,
    task: tokio::task::AbortHandle,
}

impl Drop for Deleted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Deleted {
    pub fn names(&self) -> BTreeSet<String> {
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .clone()
    }
}

/// The values a Machine's delete mark took (`None`: unmarked), until dropped.
pub struct MarkValues {
    seen: Arc<Mutex<BTreeSet<Option<String>>>>,
    task: tokio::task::AbortHandle,
}

impl Drop for MarkValues {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl MarkValues {
    pub fn values(&self) -> BTreeSet<Option<String>> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl RealCapiNamespace {
    /// A fresh namespace with Cluster [`CLUSTER`] ready, the stand-in running and template
    /// [`TEMPLATE`] whose status says `size` (empty: the stand-in's default Nodes).
    pub async fn new(size: &[(&str, &str)]) -> RealCapiNamespace {
        let manager = capi_manager();
        let cp = manager.cp;
        let client = cp.admin_client().await;
        let ns = cp.fresh_namespace().await;
        let started = Instant::now();
        standin::workload_cluster(&client, cp, &ns, CLUSTER).await;
        let standin = StandIn::start(client.clone(), &ns);
        standin::create_template(&client, &ns, TEMPLATE, size).await;
        RealCapiNamespace {
            manager,
            client,
            ns,
            standin,
            started,
        }
    }

    /// MachineDeployment `name` with `replicas`, sized for CA; `edit` adjusts it before creation.
    /// Returns it as CAPI's webhooks made it.
    pub async fn group(
        &self,
        name: &str,
        (min, max, replicas): (&str, &str, i64),
        edit: impl FnOnce(&mut Value),
    ) -> DynamicObject {
        let mut md = machine_deployment(name, CLUSTER, TEMPLATE, min, max);
        md["metadata"]["annotations"][format!("{CAPACITY}/labels")] =
            json!(scenario_labels(&self.ns, &[]));
        md["spec"]["replicas"] = json!(replicas);
        edit(&mut md);
        create(
            &api(&self.client, &self.ns, "v1beta2", "MachineDeployment"),
            &md,
        )
        .await
        .unwrap_or_else(|e| panic!("create MachineDeployment {}/{name}: {e}", self.ns))
    }

    /// MachineDeployment `name` with `replicas` and the bounds only (no capacity labels).
    pub async fn plain_group(&self, name: &str, (min, max, replicas): (&str, &str, i64)) {
        let mut md = machine_deployment(name, CLUSTER, TEMPLATE, min, max);
        md["spec"]["replicas"] = json!(replicas);
        create(
            &api(&self.client, &self.ns, "v1beta2", "MachineDeployment"),
            &md,
        )
        .await
        .unwrap_or_else(|e| panic!("create MachineDeployment {}/{name}: {e}", self.ns));
    }

    /// The Machines of `md` once exactly `want` have Nodes.
    pub async fn machines(&self, md: &str, want: usize) -> Vec<String> {
        poll_until(
            &format!("{want} Machines of {md} with Nodes"),
            MACHINES,
            Duration::from_millis(200),
            || machines_with_nodes(&self.client, &self.ns, md, want),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .collect()
    }

    /// `Done` with the Machines of `md` once it is settled: exactly `want` Machines, none marked,
    /// replicas `want`, each with its Node.
    pub async fn settled(&self, md: &str, want: usize) -> Check<BTreeSet<String>> {
        let all = match machines_of(&self.client, &self.ns, md).await {
            Ok(all) => all,
            Err(e) => return Check::Wait(e),
        };
        if all.len() != want || all.iter().any(|(_, marked)| *marked) {
            return Check::Wait(format!("Machines {all:?}"));
        }
        match (
            replicas(&self.client, &self.ns, md).await,
            machines_with_nodes(&self.client, &self.ns, md, want).await,
        ) {
            (Ok(r), Check::Done(names)) if usize::try_from(r) == Ok(want) => Check::Done(names),
            (r, Check::Fatal(e)) => Check::Fatal(format!("replicas {r:?}: {e}")),
            (r, _) => Check::Wait(format!("replicas {r:?}, Machines {all:?}")),
        }
    }

    /// Waits (reading every 100 ms, up to [`MACHINES`]) until `md` is [`Self::settled`] at `want`.
    pub async fn wait_settled(
        &self,
        what: &str,
        md: &str,
        want: usize,
    ) -> Result<BTreeSet<String>, String> {
        poll_until(what, MACHINES, Duration::from_millis(100), || {
            self.settled(md, want)
        })
        .await
    }

    /// The Machines of `md` carrying delete-machine.
    pub async fn marked(&self, md: &str) -> BTreeSet<String> {
        machines_of(&self.client, &self.ns, md)
            .await
            .unwrap_or_else(|e| panic!("list the Machines of {md}: {e}"))
            .into_iter()
            .filter(|(_, marked)| *marked)
            .map(|(name, _)| name)
            .collect()
    }

    /// Machine `machine`'s `spec.providerID` and the Node of its `status.nodeRef` (empty when
    /// unset).
    pub async fn provider_id_and_node(&self, machine: &str) -> (String, String) {
        let object = api(&self.client, &self.ns, "v1beta2", "Machine")
            .get(machine)
            .await
            .unwrap_or_else(|e| panic!("get Machine {machine}: {e}"));
        let field = |v: &Value| v.as_str().unwrap_or_default().to_string();
        (
            field(&object.data["spec"]["providerID"]),
            field(&object.data["status"]["nodeRef"]["name"]),
        )
    }

    /// The node CA would name to DeleteNodes for Machine `machine`.
    pub async fn grpc_node(&self, machine: &str) -> ExternalGrpcNode {
        let (provider_id, node) = self.provider_id_and_node(machine).await;
        grpc_node(&provider_id, &node)
    }

    /// With the cloud holding new machines back, raises `md` from its two Machines (`names`) to 3 and
    /// returns the third Machine, which gets no Node until the hold ends.
    pub async fn held_third_machine(&self, md: &str, names: &[String]) -> String {
        self.standin.hold(TEMPLATE);
        self.patch("MachineDeployment", md, json!({"spec": {"replicas": 3}}))
            .await;
        let machine_api = api(&self.client, &self.ns, "v1beta2", "Machine");
        let selector = ListParams::default().labels(&format!("{DEPLOYMENT_NAME}={md}"));
        poll_until(
            "the third Machine, held by the cloud",
            MACHINES,
            Duration::from_millis(200),
            || async {
                match machine_api.list(&selector).await {
                    Ok(l) => match l.items.iter().map(name_of).find(|n| !names.contains(n)) {
                        Some(n) => Check::Done(n),
                        None => Check::Wait("2 Machines".into()),
                    },
                    Err(e) => Check::Wait(e.to_string()),
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn watch_deletions(&self) -> Deleted {
        let seen = Arc::new(Mutex::new((BTreeSet::new(), BTreeSet::new())));
        let record = seen.clone();
        let machines = api(&self.client, &self.ns, "v1beta2", "Machine");
        let task = tokio::spawn(async move {
            loop {
                if let Ok(list) = machines.list(&ListParams::default()).await {
                    let mut seen = record.lock().unwrap_or_else(|e| e.into_inner());
                    let now: BTreeSet<String> = list.items.iter().map(name_of).collect();
                    let (all, deleted) = &mut *seen;
                    for gone in all.difference(&now) {
                        deleted.insert(gone.clone());
                    }
                    for m in &list.items {
                        all.insert(name_of(m));
                        if m.metadata.deletion_timestamp.is_some() {
                            deleted.insert(name_of(m));
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .abort_handle();
        Deleted { seen, task }
    }

    /// Every value of Machine `name`'s delete mark seen (polled every 100 ms), until dropped.
    pub fn watch_mark(&self, name: &str) -> MarkValues {
        let seen = Arc::new(Mutex::new(BTreeSet::new()));
        let record = seen.clone();
        let machines = api(&self.client, &self.ns, "v1beta2", "Machine");
        let name = name.to_string();
        let task = tokio::spawn(async move {
            loop {
                if let Ok(Some(m)) = machines.get_opt(&name).await {
                    let value = m
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(DELETE_MACHINE))
                        .cloned();
                    record
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(value);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .abort_handle();
        MarkValues { seen, task }
    }

    /// The group object's annotation `key` (kind `kind`), empty when absent.
    pub async fn annotation(&self, kind: &str, name: &str, key: &str) -> String {
        api(&self.client, &self.ns, "v1beta2", kind)
            .get(name)
            .await
            .ok()
            .and_then(|o| o.metadata.annotations.and_then(|a| a.get(key).cloned()))
            .unwrap_or_default()
    }

    /// The provider, limited to the namespace by auto-discovery.
    pub async fn provider(&self) -> ProviderProcess {
        self.provider_with(&[]).await
    }

    /// [`RealCapiNamespace::provider`] with flags `extra` besides.
    pub async fn provider_with(&self, extra: &[&str]) -> ProviderProcess {
        let discovery = format!("clusterapi:namespace={}", self.ns);
        let mut args = vec!["--node-group-auto-discovery", discovery.as_str()];
        args.extend_from_slice(extra);
        start_provider(&args, self.manager.cp.admin_kubeconfig()).await
    }

    /// A client of `provider`'s RPCs once it serves, and the id of the namespace's (first) group.
    pub async fn served_group(&self, provider: &ProviderProcess) -> (Rpc, String) {
        let mut rpc = Rpc::connect(provider).await;
        let id = rpc
            .ids_in(&self.ns)
            .await
            .into_iter()
            .next()
            .expect("the group is served");
        (rpc, id)
    }

    /// CA for the namespace's pods, pointed at `provider` (to add flags to before it starts).
    pub fn autoscaler(&self, provider: &ProviderProcess) -> Autoscaler {
        Autoscaler::new(&self.ns, &provider.address)
    }

    /// CA for the namespace's pods, pointed at `provider`, started.
    pub async fn start_ca(&self, provider: &ProviderProcess) -> AutoscalerProcess {
        self.autoscaler(provider).start(self.manager.cp).await
    }

    /// Fails the scenario if CA is no longer running.
    pub fn check_ca_alive(&self, ca: &mut AutoscalerProcess, provider: &ProviderProcess) {
        if let Err(e) = ca.check_alive() {
            self.fail(e, provider, Some(ca));
        }
    }

    pub async fn patch(&self, kind: &str, name: &str, patch: Value) {
        api(&self.client, &self.ns, "v1beta2", kind)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_or_else(|e| panic!("patch {kind} {}/{name}: {e}", self.ns));
    }

    /// Marks Machine `name` for deletion as a person would.
    pub async fn mark_by_hand(&self, name: &str) {
        self.patch(
            "Machine",
            name,
            json!({"metadata": {"annotations": {DELETE_MACHINE: "marked by hand"}}}),
        )
        .await;
    }

    pub async fn replicas(&self, md: &str) -> Result<i64, String> {
        replicas(&self.client, &self.ns, md).await
    }

    /// Panics with `message` and what the stand-in, the provider, CA and the CAPI manager did.
    pub fn fail(
        &self,
        message: String,
        provider: &ProviderProcess,
        ca: Option<&AutoscalerProcess>,
    ) -> ! {
        panic!(
            "{message}\nstand-in errors: {:?}\nstand-in actions: {:?}\n--- provider log (tail) ---\n{}\n--- CA log (tail) ---\n{}\n--- CAPI manager log (tail) ---\n{}",
            self.standin.errors(),
            self.standin.actions(),
            procs::log_tail(&provider.log, 6000),
            ca.map(|c| c.log_tail()).unwrap_or_default(),
            self.manager.log_tail()
        )
    }

    /// Waits until `check` holds on the objects.
    pub async fn until<T, F, Fut>(
        &self,
        what: &str,
        timeout: Duration,
        provider: &ProviderProcess,
        ca: Option<&AutoscalerProcess>,
        check: F,
    ) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Check<T>>,
    {
        match poll_until(what, timeout, Duration::from_millis(200), check).await {
            Ok(t) => t,
            Err(e) => self.fail(e, provider, ca),
        }
    }

    /// `Done` once replicas of `md` are `want_replicas` and CAPI deleted exactly `want` (from
    /// `deleted`); `Fatal` as soon as it deleted any of `kept`.
    pub async fn deleted_exactly(
        &self,
        deleted: &Deleted,
        md: &str,
        want_replicas: i64,
        want: &BTreeSet<String>,
        kept: &[&String],
    ) -> Check<()> {
        let gone = deleted.names();
        if let Some(k) = kept.iter().find(|k| gone.contains(**k)) {
            return Check::Fatal(format!("{k} deleted: {gone:?}"));
        }
        match self.replicas(md).await {
            Ok(r) if r == want_replicas && gone == *want => Check::Done(()),
            r => Check::Wait(format!("replicas {r:?}, deleted {gone:?}")),
        }
    }
}
