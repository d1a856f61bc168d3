//! One end-to-end scenario with the real cluster-autoscaler on the imitation of Cluster API: its own
//! namespace on the shared control plane, the test reconciler (CAPI controllers and kubelets), this
//! provider limited to the namespace by auto-discovery, and a CA process pointed at it. Used where
//! the real manager does not run yet (tests/topology.rs, tests/migration.rs); the real-CA scenarios
//! with the real manager use `real_scenario`.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};

use super::autoscaler::{Autoscaler, AutoscalerProcess};
use super::capi::{Capi, Kind, Scalable};
use super::control_plane::{ControlPlane, CrdSet, Setup, control_plane};
use super::procs::{Check, poll_until};
use super::reconciler::{Reconciler, ReconcilerConfig};
use super::workload::{self, scenario_labels};
use super::{CAPI_GROUP, ProviderProcess, start_provider};

/// Capacity annotation prefix.
pub const CAPACITY: &str = "capacity.cluster-autoscaler.kubernetes.io";

pub struct Scenario {
    pub name: String,
    pub cp: &'static ControlPlane,
    pub client: Client,
    pub ns: String,
    pub capi: Capi,
    pub reconciler: Reconciler,
    pub provider: Option<ProviderProcess>,
    pub ca: Option<AutoscalerProcess>,
    started: Instant,
}

impl Scenario {
    /// A fresh namespace on the control plane of `setup`, with the reconciler running in it.
    pub async fn new(name: &str, setup: Setup) -> Scenario {
        Self::with_reconciler(name, setup, ReconcilerConfig::default()).await
    }

    pub async fn with_reconciler(name: &str, setup: Setup, config: ReconcilerConfig) -> Scenario {
        let started = Instant::now();
        let cp = control_plane(setup);
        let client = cp.admin_client().await;
        let ns = cp.fresh_namespace().await;
        let version = match setup.crds {
            CrdSet::Shipped => "v1beta2",
            CrdSet::V1beta1 => "v1beta1",
            CrdSet::RealCapi => {
                panic!(
                    "scenario {name}: the imitation reconciler never runs beside the real CAPI manager"
                )
            }
        };
        let config = ReconcilerConfig {
            version: version.into(),
            ..config
        };
        let capi = Capi::new(client.clone(), &ns, CAPI_GROUP, version);
        let reconciler = Reconciler::start_with(client.clone(), &ns, config);
        eprintln!("e2e: scenario {name} in namespace {ns}");
        Scenario {
            name: name.into(),
            cp,
            client,
            ns,
            capi,
            reconciler,
            provider: None,
            ca: None,
            started,
        }
    }

    /// A MachineDeployment (and its MachineSet) with bounds, replicas and a template of `cpu`/`memory`
    /// from capacity annotations (none when `cpu` is empty), whose Nodes carry the scenario label
    /// and `labels` (`k=v`).
    pub fn md(&self, name: &str, min: i64, max: i64, replicas: i64) -> Scalable {
        Scalable::md(name)
            .bounds(min, max)
            .replicas(replicas)
            .annotation(
                &format!("{CAPACITY}/labels"),
                &scenario_labels(&self.ns, &[]),
            )
    }

    /// Capacity annotations on `s`: cpu, memory (and pods 110).
    pub fn capacity(s: Scalable, cpu: &str, memory: &str) -> Scalable {
        s.annotation(&format!("{CAPACITY}/cpu"), cpu)
            .annotation(&format!("{CAPACITY}/memory"), memory)
            .annotation(&format!("{CAPACITY}/maxPods"), "110")
    }

    /// Extra template labels (`k=v`) besides the scenario label.
    pub fn labels(&self, s: Scalable, extra: &[&str]) -> Scalable {
        s.annotation(
            &format!("{CAPACITY}/labels"),
            &scenario_labels(&self.ns, extra),
        )
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

    /// Starts `ca` (see [`Scenario::autoscaler`]).
    pub async fn start_ca(&mut self, ca: Autoscaler) -> &mut AutoscalerProcess {
        let process = ca.start(self.cp).await;
        self.ca.insert(process)
    }

    /// The provider and CA logs, for failure messages.
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
                super::procs::log_tail(&p.log, 6000)
            ));
        }
        let actions = self.reconciler.actions();
        let last = &actions[actions.len().saturating_sub(20)..];
        out.push_str(&format!(
            "reconciler: {} passes; errors: {:?}; last actions: {last:?}\n",
            self.reconciler.passes(),
            self.reconciler.errors()
        ));
        out
    }

    /// Waits until `spec.replicas` of `kind`/`name` is `want`.
    pub async fn wait_replicas(&mut self, kind: Kind, name: &str, want: i64, timeout: Duration) {
        let capi = &self.capi;
        let result = poll_until(
            &format!("{} {}/{name} replicas = {want}", kind.as_str(), self.ns),
            timeout,
            Duration::from_millis(100),
            || async move {
                let got = capi.replicas(kind, name).await;
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

    /// Panics with `message`, the logs and CA's status.
    pub fn fail(&self, message: &str) -> ! {
        panic!("scenario {}: {message}\n{}", self.name, self.logs())
    }

    /// Asserts `cond`, else fails with `message` and the logs.
    pub fn check(&self, cond: bool, message: &str) {
        if !cond {
            self.fail(message);
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

    /// Waits until the scenario has `n` Nodes; returns their names, oldest first.
    pub async fn wait_node_count(&self, n: usize) -> Vec<String> {
        let (client, ns) = (&self.client, &self.ns);
        let result = poll_until(
            &format!("{n} Nodes"),
            Duration::from_secs(60),
            Duration::from_millis(100),
            || async move {
                let names = match workload::scenario_nodes(client, ns).await {
                    Ok(names) => names,
                    Err(e) => return Check::Wait(e),
                };
                if names.len() == n {
                    Check::Done(names)
                } else {
                    Check::Wait(format!("Nodes {names:?}"))
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

    /// Waits for `n` full CA loops (from CA's own activity metric).
    pub async fn wait_loops(&mut self, n: u32) {
        let ca = self.ca.as_mut().expect("CA is running");
        ca.wait_loops(n, Duration::from_secs(30 + 5 * u64::from(n)))
            .await;
    }

    /// Prints the scenario's wall time.
    pub fn passed(self) {
        super::procs::announce(&format!(
            "e2e: scenario {} passed in {:.1}s",
            self.name,
            self.started.elapsed().as_secs_f64()
        ));
    }
}
