//! One scenario with the real cluster-autoscaler on the real Cluster API manager (`capi_manager`): its
//! own namespace with a Cluster of the stand-in (`standin::workload_cluster`), the stand-in cloud and
//! kubelets, MachineDeployments on stand-in templates, this provider limited to the namespace, and a
//! record of every Machine deletion taken from a watch ([`MachineDeletions`]), which is how a test
//! knows whether CAPI deleted a Machine that carried no delete mark.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::api::{DynamicObject, ListParams, WatchEvent, WatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::task::AbortHandle;

use super::autoscaler::{Autoscaler, AutoscalerProcess};
use super::capi::{Capi, DEFAULT_CLUSTER, Kind};
use super::capi_manager::{CapiManager, capi_manager};
use super::control_plane::ControlPlane;
use super::procs::{self, Check, poll_until};
use super::real_capi::{self, DELETE_MACHINE};
use super::standin::{self, StandIn};
use super::workload::{self, scenario_labels};
use super::{CAPI_GROUP, ProviderProcess, start_provider};

/// Capacity annotation prefix (only `labels` is used: the size is the stand-in template's status).
const CAPACITY: &str = "capacity.cluster-autoscaler.kubernetes.io";

pub struct RealCapiScenario {
    pub name: String,
    pub manager: &'static CapiManager,
    pub cp: &'static ControlPlane,
    pub client: Client,
    pub ns: String,
    /// The namespace's Cluster API objects, read at v1beta2.
    pub capi: Capi,
    pub standin: StandIn,
    pub deletions: MachineDeletions,
    pub provider: Option<ProviderProcess>,
    pub ca: Option<AutoscalerProcess>,
    started: Instant,
}

impl RealCapiScenario {
    /// A fresh namespace on the real-CAPI control plane with Cluster [`DEFAULT_CLUSTER`] ready, the
    /// stand-in running and Machine deletions recorded.
    pub async fn new(name: &str) -> RealCapiScenario {
        let started = Instant::now();
        let manager = capi_manager();
        let cp = manager.cp;
        let client = cp.admin_client().await;
        let ns = cp.fresh_namespace().await;
        standin::workload_cluster(&client, cp, &ns, DEFAULT_CLUSTER).await;
        let standin = StandIn::start(client.clone(), &ns);
        let capi = Capi::new(client.clone(), &ns, CAPI_GROUP, "v1beta2");
        let deletions = MachineDeletions::start(&capi).await;
        eprintln!("e2e: scenario {name} in namespace {ns} (real Cluster API)");
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

    /// Creates a stand-in template `name` whose Nodes have `cpu` CPUs, 4Gi and 110 pods (in its
    /// status, the scale-from-zero contract) and MachineDeployment `name` on it with bounds and
    /// `replicas`; its template nodes carry the scenario label (the labels annotation), as the
    /// stand-in's Nodes do.
    pub async fn create_md(&self, name: &str, min: i64, max: i64, replicas: i64, cpu: &str) {
        let size = [("cpu", cpu), ("memory", "4Gi"), ("pods", "110")];
        standin::create_template(&self.client, &self.ns, name, &size).await;
        let mut md = real_capi::machine_deployment(
            name,
            DEFAULT_CLUSTER,
            name,
            &min.to_string(),
            &max.to_string(),
        );
        md["spec"]["replicas"] = json!(replicas);
        md["metadata"]["annotations"][format!("{CAPACITY}/labels")] =
            json!(scenario_labels(&self.ns, &[]));
        real_capi::create(&self.capi.api(Kind::MachineDeployment), &md)
            .await
            .unwrap_or_else(|e| {
                self.fail(&format!("create MachineDeployment {}/{name}: {e}", self.ns))
            });
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

    /// Starts the provider limited to this namespace (plus `args`) with the admin identity.
    pub async fn start_provider(&mut self, args: &[&str]) -> &ProviderProcess {
        let kubeconfig = self.cp.admin_kubeconfig().to_path_buf();
        self.start_provider_as(&kubeconfig, args).await
    }

    /// Starts `ca`.
    pub async fn start_ca(&mut self, ca: Autoscaler) -> &mut AutoscalerProcess {
        let process = ca.start(self.cp).await;
        self.ca.insert(process)
    }

    /// The provider, CA, stand-in and CAPI manager logs, for failure messages.
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
            "stand-in errors: {:?}\nMachine deletions seen: {:?}\n--- CAPI manager log {} (tail) ---\n{}\n",
            self.standin.errors(),
            self.deletions.seen(),
            self.manager.log.display(),
            self.manager.log_tail()
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

    /// Waits until `spec.replicas` of MachineDeployment `name` is `want`.
    pub async fn wait_replicas(&self, name: &str, want: i64, timeout: Duration) {
        let capi = &self.capi;
        let result = poll_until(
            &format!("MachineDeployment {}/{name} replicas = {want}", self.ns),
            timeout,
            Duration::from_millis(100),
            || async move {
                let got = capi.replicas(Kind::MachineDeployment, name).await;
                if got == want {
                    Check::Done(())
                } else {
                    Check::Wait(format!("replicas {got}"))
                }
            },
        )
        .await;
        if let Err(e) = result {
            self.fail(&e);
        }
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

    /// Waits until the scenario's Nodes are exactly `want` (by name): CAPI deleted the others.
    pub async fn wait_nodes(&self, want: &[String]) {
        let mut want = want.to_vec();
        want.sort();
        let (client, ns) = (&self.client, &self.ns);
        let result = poll_until(
            "the scenario's Nodes",
            Duration::from_secs(90),
            Duration::from_millis(100),
            || {
                let want = want.clone();
                async move {
                    let mut got = match workload::scenario_nodes(client, ns).await {
                        Ok(names) => names,
                        Err(e) => return Check::Wait(e),
                    };
                    got.sort();
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
                for name in deletions.seen().keys() {
                    match nodes.get_opt(name).await {
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
            "e2e: scenario {} passed in {:.1}s (real Cluster API)",
            self.name,
            self.started.elapsed().as_secs_f64()
        ));
    }
}

#[derive(Default)]
struct Deletions {
    /// Machine name → whether it carried delete-machine when first seen being deleted.
    seen: BTreeMap<String, bool>,
    /// In order of first sight.
    order: Vec<String>,
    /// Re-lists after the watch expired (a deletion could have been missed in between).
    gaps: usize,
}

/// Every Machine of a namespace seen with a `deletionTimestamp`, and whether it then carried the
/// delete-machine annotation: from a watch resumed from the last resourceVersion (each update is
/// seen, however fast CAPI finishes the deletion; a Machine's finalizer keeps it until CAPI removed
/// its Node). Stopped when dropped.
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

fn record(state: &Mutex<Deletions>, m: &DynamicObject) {
    if m.metadata.deletion_timestamp.is_none() {
        return;
    }
    let name = m.metadata.name.clone().unwrap_or_default();
    let marked = m
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(DELETE_MACHINE));
    let mut s = lock(state);
    if !s.seen.contains_key(&name) {
        s.seen.insert(name.clone(), marked);
        s.order.push(name);
    }
}

impl MachineDeletions {
    pub async fn start(capi: &Capi) -> MachineDeletions {
        let api = capi.api(Kind::Machine);
        let state = Arc::new(Mutex::new(Deletions::default()));
        let list = api
            .list(&ListParams::default())
            .await
            .expect("list the Machines to watch");
        for m in &list.items {
            record(&state, m);
        }
        let mut rv = list.metadata.resource_version.clone().unwrap_or_default();
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let params = WatchParams::default().timeout(290);
                let stream = match api.watch(&params, &rv).await {
                    Ok(s) => s,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
                let mut stream = std::pin::pin!(stream);
                let mut expired = false;
                while let Some(event) = stream.next().await {
                    match event {
                        Ok(WatchEvent::Added(o))
                        | Ok(WatchEvent::Modified(o))
                        | Ok(WatchEvent::Deleted(o)) => {
                            rv = o.metadata.resource_version.clone().unwrap_or_default();
                            record(&shared, &o);
                        }
                        Ok(WatchEvent::Bookmark(b)) => rv = b.metadata.resource_version,
                        Ok(WatchEvent::Error(status)) => {
                            expired = status.code == 410;
                            break;
                        }
                        Err(_) => break,
                    }
                }
                if expired {
                    match api.list(&ListParams::default()).await {
                        Ok(list) => {
                            lock(&shared).gaps += 1;
                            for m in &list.items {
                                record(&shared, m);
                            }
                            rv = list.metadata.resource_version.unwrap_or_default();
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
            }
        })
        .abort_handle();
        MachineDeletions { state, task }
    }

    /// Every Machine seen being deleted → whether it carried delete-machine then.
    pub fn seen(&self) -> BTreeMap<String, bool> {
        lock(&self.state).seen.clone()
    }

    /// The Machines deleted with the delete mark, in the order their deletion was seen.
    pub fn marked(&self) -> Vec<String> {
        let s = lock(&self.state);
        s.order.iter().filter(|n| s.seen[*n]).cloned().collect()
    }

    /// The Machines deleted without the delete mark (a replica count lowered without its mark, or
    /// a MachineSet CAPI deleted whole).
    pub fn unmarked(&self) -> Vec<String> {
        let s = lock(&self.state);
        s.order.iter().filter(|n| !s.seen[*n]).cloned().collect()
    }

    /// How often the watch had to re-list: a deletion may have been missed in between.
    pub fn gaps(&self) -> usize {
        lock(&self.state).gaps
    }
}
