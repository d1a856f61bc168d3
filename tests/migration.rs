//! The README's move from the in-tree `clusterapi` provider to this one, as the official Helm chart
//! does it, checked on what decides it: the cluster-autoscaler Lease. The in-tree chart in
//! `clusterAPIMode: kubeconfig-incluster` runs CA with `--namespace=kube-system` and the workload
//! cluster's kubeconfig, so its Lease is `kube-system/cluster-autoscaler` of the workload cluster. With
//! `cloudProvider: externalgrpc` the chart passes `--namespace=<release namespace>`: unless the values
//! keep the Lease where it was, the old and the new CA each lead their own Lease during the switch
//! and both scale. The chart deploy/helm with `provider.workloadKubeconfigSecret` (as in
//! `deploy/helm/values-kind-capd.yaml`) keeps it (`--namespace=kube-system` after the chart's own), and
//! the README's `cluster-autoscaler.nameOverride` keeps the Deployment, its selector and its Service, so
//! `helm upgrade` rolls the one Deployment over.
//!
//! The test renders both charts with a real `helm`, runs the in-tree CA (the chart's arguments) as the
//! leader, then the new pod's CA (the chart's arguments) beside it, as a rolling update does, then
//! stops the old one (SIGTERM, as the old pod is deleted). It asserts that the new CA runs no loop
//! while the old one leads, takes the Lease once the old one is gone, and then scales through this
//! provider. What a process cannot take from a pod is substituted and said where: the kubeconfig
//! paths (the test control plane is both the management and the workload cluster) and the in-cluster
//! configuration of the management cluster (`--cloud-config` with the same kubeconfig). Each CA runs
//! with a hostname of its own (a UTS namespace; root), as pods have: CA's leader identity is the
//! hostname, and two processes of one host would both be the same candidate. Cluster API is the
//! real manager (`support::real_capi_scenario`: a stand-in Cluster, its MachineSets and Machines made
//! by CAPI), so both CAs read the objects a management cluster has.

pub mod support;

use std::path::Path;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use serde_json::Value;
use support::autoscaler::{self, Autoscaler, http_get, metric_sum};
use support::procs::{self, Check, poll_until};
use support::real_capi_scenario::{CLUSTER, RealCapiScenario};
use support::render;
use support::workload::{self, PodSpec};

const RELEASE: &str = "cluster-autoscaler";
/// Short leader election, so that a takeover takes seconds; the same for both CAs.
const LEADER_ELECTION: [&str; 3] = [
    "--leader-elect-lease-duration=6s",
    "--leader-elect-renew-deadline=4s",
    "--leader-elect-retry-period=1s",
];

/// The CA container of the chart's Deployment in `objects`: its name, selector and argv.
struct RenderedCa {
    deployment: String,
    selector: Value,
    argv: Vec<String>,
}

fn rendered_ca(objects: &[Value]) -> RenderedCa {
    let deployments = render::all(objects, "Deployment");
    assert_eq!(deployments.len(), 1, "one Deployment rendered");
    let d = deployments[0];
    let pod = &d["spec"]["template"]["spec"];
    let ca = render::containers(pod)
        .into_iter()
        .find(|c| {
            render::strings(&c["command"])
                .iter()
                .any(|a| a.ends_with("cluster-autoscaler"))
        })
        .unwrap_or_else(|| panic!("no cluster-autoscaler container in {pod}"));
    let mut argv = render::strings(&ca["command"]);
    argv.extend(render::strings(&ca["args"]));
    RenderedCa {
        deployment: d["metadata"]["name"].as_str().unwrap_or_default().into(),
        selector: d["spec"]["selector"].clone(),
        argv,
    }
}

/// Where CA keeps its Lease: `--leader-elect-resource-namespace`, else `--namespace` (CA's default
/// kube-system), named `--leader-elect-resource-name` (default `cluster-autoscaler`).
fn lease_of(argv: &[String]) -> (String, String) {
    let namespace = render::flag(argv, "--leader-elect-resource-namespace")
        .filter(|n| !n.is_empty())
        .or_else(|| render::flag(argv, "--namespace"))
        .unwrap_or_else(|| "kube-system".into());
    let name = render::flag(argv, "--leader-elect-resource-name")
        .unwrap_or_else(|| "cluster-autoscaler".into());
    (namespace, name)
}

/// `argv` of a rendered CA with what a process here cannot take from a pod substituted: the
/// kubeconfig paths, the in-cluster management config, the cloud-config file; plus the test timings
/// and a metrics address. Returns the arguments and the metrics address.
fn runnable(
    argv: &[String],
    kubeconfig: &Path,
    cloud_config: &Path,
    extra: &[String],
) -> (Vec<String>, String) {
    let address = format!("127.0.0.1:{}", procs::free_port());
    let mut args: Vec<String> = argv[1..]
        .iter()
        .map(|a| {
            if a.starts_with("--kubeconfig=") {
                format!("--kubeconfig={}", kubeconfig.display())
            } else if a == "--clusterapi-cloud-config-authoritative" {
                // In-cluster config of the management cluster: here the same control plane.
                format!("--cloud-config={}", kubeconfig.display())
            } else if a.starts_with("--cloud-config=") {
                format!("--cloud-config={}", cloud_config.display())
            } else {
                a.clone()
            }
        })
        .collect();
    args.extend(extra.iter().cloned());
    args.extend(LEADER_ELECTION.iter().map(|s| s.to_string()));
    args.extend([
        format!("--address={address}"),
        "--logtostderr=true".into(),
        "--v=4".into(),
    ]);
    (args, address)
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// `cluster_autoscaler_last_activity{activity="main"}` of the CA at `address`: the unix time of its
/// last main loop (0 before its first, or while it does not lead).
async fn last_loop(address: &str) -> f64 {
    let text = http_get(address, "/metrics").await.unwrap_or_default();
    metric_sum(
        &text,
        "cluster_autoscaler_last_activity",
        &[("activity", "main")],
    )
}

async fn lease_holder(api: &Api<Lease>, name: &str) -> Option<String> {
    api.get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec?.holder_identity)
        .filter(|h| !h.is_empty())
}

fn sigterm_and_wait(child: &mut Child, what: &str) {
    let pid = child.id() as libc::pid_t;
    // SAFETY: a plain kill(2) of a child this test started and has not reaped.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                procs::kill_and_reap(child);
                panic!("{what} did not stop within 30 s of SIGTERM");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_from_the_in_tree_chart_keeps_one_leader_at_every_moment() {
    let mut s = RealCapiScenario::new("migration").await;
    let dir = procs::scratch_dir();
    let kubeconfig = s.cp.admin_kubeconfig().to_path_buf();

    // The two installs as the charts render them: the in-tree one as users have it with the official
    // chart, and the README's values for the move with deploy/helm (values-kind-capd.yaml plus the
    // nameOverride that keeps every name).
    let old_values = dir.join("in-tree-values.yaml");
    write(
        &old_values,
        &format!(
            "cloudProvider: clusterapi\nclusterAPIMode: kubeconfig-incluster\n\
             clusterAPIKubeconfigSecret: {CLUSTER}-kubeconfig\n\
             autoDiscovery:\n  clusterName: {CLUSTER}\n  namespace: {ns}\n\
             image:\n  tag: v{version}\n",
            ns = s.ns,
            version = autoscaler::default_version()
        ),
    );
    let keep_names = dir.join("keep-names.yaml");
    write(
        &keep_names,
        "cluster-autoscaler:\n  nameOverride: clusterapi-cluster-autoscaler\n",
    );
    let old = rendered_ca(&render::helm_template_files(&[&old_values], RELEASE, &s.ns));
    let new = rendered_ca(&render::provider_template_files(
        &[
            &render::repo("deploy/helm/values-kind-capd.yaml"),
            &keep_names,
        ],
        RELEASE,
        &s.ns,
    ));
    assert_eq!(
        (&new.deployment, &new.selector),
        (&old.deployment, &old.selector),
        "helm upgrade updates the one Deployment in place (a selector change would be refused)"
    );
    let lease = lease_of(&old.argv);
    assert_eq!(
        lease,
        ("kube-system".to_string(), "cluster-autoscaler".to_string())
    );
    assert_eq!(lease_of(&new.argv), lease, "both CAs contend for one Lease");
    assert_eq!(
        render::flag(&new.argv, "--namespace"),
        render::flag(&old.argv, "--namespace"),
        "the status ConfigMap stays where alerts look for it"
    );
    assert!(
        render::flag(&old.argv, "--kubeconfig").is_some()
            && render::flag(&new.argv, "--kubeconfig") == render::flag(&old.argv, "--kubeconfig"),
        "both lead through the workload cluster: {:?} / {:?}",
        old.argv,
        new.argv
    );

    // A group at zero that only the new stack will scale (pods come once it leads).
    s.template("md-0", "2", "4Gi", true).await;
    s.create_md(&s.md("md-0", "md-0", 0, 2, 0)).await;
    autoscaler::ensure_scheduler(s.cp);
    let timings: Vec<String> = Autoscaler::new(&s.ns, "").flags;

    // The in-tree CA, leading.
    let old_bin = autoscaler::binary(&autoscaler::default_version(), "clusterapi");
    let (old_args, old_address) = runnable(&old.argv, &kubeconfig, Path::new("/unused"), &timings);
    let old_log = procs::work_dir().join("migration-in-tree-ca.log");
    let mut old_ca =
        procs::spawn_logged_on_host("cluster-autoscaler-old-pod", &old_bin, &old_args, &old_log)
            .expect("start the in-tree CA");
    let leases: Api<Lease> = Api::namespaced(s.client.clone(), &lease.0);
    let old_holder = poll_until(
        "the in-tree CA holds the Lease and runs its loop",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || {
            let leases = leases.clone();
            let (name, address) = (lease.1.clone(), old_address.clone());
            async move {
                match (
                    lease_holder(&leases, &name).await,
                    last_loop(&address).await,
                ) {
                    (Some(holder), t) if t > 0.0 => Check::Done(holder),
                    other => Check::Wait(format!("{other:?}")),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", procs::log_tail(&old_log, 6000)));

    // Every 100 ms until the end: each CA's last loop time, for the one-leader check.
    let samples: Arc<Mutex<Vec<(f64, f64)>>> = Arc::default();
    let new_address_slot: Arc<Mutex<Option<String>>> = Arc::default();
    let sampler = {
        let (samples, slot, old_address) = (
            Arc::clone(&samples),
            Arc::clone(&new_address_slot),
            old_address.clone(),
        );
        tokio::spawn(async move {
            for _ in 0..3_000 {
                let new_address = slot.lock().map(|a| a.clone()).unwrap_or_default();
                let new_t = match new_address {
                    Some(a) => last_loop(&a).await,
                    None => 0.0,
                };
                let old_t = last_loop(&old_address).await;
                if let Ok(mut v) = samples.lock() {
                    v.push((old_t, new_t));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    // helm upgrade: the new pod (provider, then CA) starts while the old one still runs.
    let provider = s.start_provider(&[]).await.address.clone();
    let cloud_config = dir.join("cloud-config.yaml");
    write(
        &cloud_config,
        &format!("address: \"{provider}\"\ngrpc_timeout: \"10s\"\n"),
    );
    let new_bin = autoscaler::binary(&autoscaler::default_version(), "externalgrpc");
    let (new_args, new_address) = runnable(&new.argv, &kubeconfig, &cloud_config, &timings);
    let new_log = procs::work_dir().join("migration-externalgrpc-ca.log");
    let mut new_ca =
        procs::spawn_logged_on_host("cluster-autoscaler-new-pod", &new_bin, &new_args, &new_log)
            .expect("start the new CA");
    if let Ok(mut slot) = new_address_slot.lock() {
        *slot = Some(new_address.clone());
    }
    // Both run side by side for three more loops of the old CA (at least 6 s, a whole lease duration):
    // the new one must not run one.
    let mut seen = last_loop(&old_address).await;
    let mut old_loops = 0;
    let overlap = Instant::now();
    while old_loops < 3 {
        assert!(
            overlap.elapsed() < Duration::from_secs(60),
            "the in-tree CA stopped looping\n{}",
            procs::log_tail(&old_log, 4000)
        );
        if let Ok(Some(status)) = new_ca.try_wait() {
            panic!(
                "the new CA exited with {status}\n{}",
                procs::log_tail(&new_log, 6000)
            );
        }
        let t = last_loop(&old_address).await;
        if t > seen {
            old_loops += 1;
            seen = t;
        }
        let new_t = last_loop(&new_address).await;
        assert_eq!(
            new_t, 0.0,
            "the new CA ran a loop while the in-tree CA led: two leaders"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        lease_holder(&leases, &lease.1).await.as_deref(),
        Some(old_holder.as_str())
    );

    // The old pod is deleted: its CA gets SIGTERM.
    let stopped = Instant::now();
    sigterm_and_wait(&mut old_ca, "the in-tree CA");
    let new_holder = poll_until(
        "the new CA takes the Lease and runs its loop",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || {
            let leases = leases.clone();
            let (name, address, old) = (lease.1.clone(), new_address.clone(), old_holder.clone());
            async move {
                match (
                    lease_holder(&leases, &name).await,
                    last_loop(&address).await,
                ) {
                    (Some(holder), t) if holder != old && t > 0.0 => Check::Done(holder),
                    other => Check::Wait(format!("{other:?}")),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", procs::log_tail(&new_log, 6000)));
    let takeover = stopped.elapsed();

    // The new CA scales through this provider.
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1", "1Gi")).await;
    s.wait_replicas("md-0", 1, Duration::from_secs(60)).await;
    workload::wait_bound(&s.client, &s.ns, "web", Duration::from_secs(60)).await;

    sampler.abort();
    let samples = samples.lock().map(|v| v.clone()).unwrap_or_default();
    let old_last = samples.iter().map(|s| s.0).fold(0.0, f64::max);
    let new_first = samples
        .iter()
        .map(|s| s.1)
        .filter(|t| *t > 0.0)
        .fold(f64::INFINITY, f64::min);
    assert!(
        new_first > old_last,
        "the new CA's first loop ({new_first}) came before the in-tree CA's last ({old_last})"
    );
    procs::kill_and_reap(&mut new_ca);
    procs::announce(&format!(
        "e2e: migration: Lease {}/{} held by the in-tree CA ({old_holder}), then by the new CA ({new_holder}) {:.1}s after the old one got SIGTERM; {} samples, never two leaders; the new CA raised md-0 0 -> 1",
        lease.0,
        lease.1,
        takeover.as_secs_f64(),
        samples.len()
    ));
    s.passed();
}
