//! Which Cluster is served (invariant 8, kubernetes/autoscaler#5510), against the real apiserver: two
//! Clusters' groups in one namespace, a provider for the first: the second's groups answer NOT_FOUND to
//! every RPC, are never written and are reported naming their Cluster (Event, metric, `check`); `--cluster`
//! that the workload cluster's Nodes contradict serves nothing and `/readyz` says why; a discovery spec
//! naming another Cluster is reported naming the spec and the served Cluster.
//!
//! The workload cluster here is the shared apiserver itself (`--kubeconfig`), whose Nodes belong to
//! many tests: each test's own Node names a Cluster of its own namespace.

use crate::support;

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::{Value, json};
use support::capi::{Capi, Kind, Owner, Rpc, Scalable, expect_code, fresh_capi, spawn_provider};
use support::infra::run_cli;
use support::procs::{self, Check, poll_until};
use support::{CAPI_GROUP, Setup, start_provider};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

const CLOUD_PROVIDER: &str = "clusterautoscaler.cloudprovider.v1.externalgrpc.CloudProvider";

const SETUP: Setup = Setup::shipped();
const VERSION: &str = "v1beta2";

/// Two Clusters in the test's namespace: `mine` (Cluster `c1`) and `theirs` (Cluster `c2`), each
/// with a running Machine.
async fn two_clusters() -> (&'static support::ControlPlane, Capi) {
    let (cp, capi) = fresh_capi(SETUP, VERSION).await;
    capi.create_deployment(
        &Scalable::md("mine").bounds(0, 5).replicas(1).cluster("c1"),
        false,
    )
    .await;
    capi.create_machine(&capi.running("mine-0", Owner::Deployment("mine".into())))
        .await;
    capi.create_deployment(
        &Scalable::md("theirs")
            .bounds(0, 5)
            .replicas(1)
            .cluster("c2"),
        false,
    )
    .await;
    capi.create_machine(&capi.running("theirs-0", Owner::Deployment("theirs".into())))
        .await;
    (cp, capi)
}

/// A Node of the workload cluster as Cluster API annotates it: it belongs to `namespace/cluster`.
/// Unschedulable, so no test's pod lands on it. Deleted when the guard drops.
struct ClusterNode {
    kubeconfig: std::path::PathBuf,
    name: String,
}

impl ClusterNode {
    async fn create(
        cp: &support::ControlPlane,
        name: &str,
        namespace: &str,
        cluster: &str,
    ) -> ClusterNode {
        let node: Node = serde_json::from_value(json!({
            "metadata": {
                "name": name,
                "annotations": {
                    format!("{CAPI_GROUP}/cluster-namespace"): namespace,
                    format!("{CAPI_GROUP}/cluster-name"): cluster,
                },
            },
            "spec": {"unschedulable": true},
        }))
        .expect("a Node");
        Api::<Node>::all(cp.admin_client().await)
            .create(&PostParams::default(), &node)
            .await
            .unwrap_or_else(|e| panic!("create Node {name}: {e}"));
        ClusterNode {
            kubeconfig: cp.admin_kubeconfig().to_path_buf(),
            name: name.to_string(),
        }
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        let (kubeconfig, name) = (self.kubeconfig.clone(), self.name.clone());
        // On a runtime and client of its own: the test's runtime is blocked in this drop.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async {
                let client = support::client_from_kubeconfig(&kubeconfig).await;
                Api::<Node>::all(client)
                    .delete(&name, &DeleteParams::default())
                    .await
                    .ok()
            })
        })
        .join();
    }
}

fn only(capi: &Capi) -> String {
    format!("clusterapi:namespace={}", capi.ns)
}

#[tokio::test]
async fn groups_of_a_second_cluster_are_not_served_never_written_and_reported_with_their_cluster() {
    let (cp, capi) = two_clusters().await;
    let cluster = format!("{}/c1", capi.ns);
    let discovery = only(&capi);
    let provider = start_provider(
        &[
            "--node-group-auto-discovery",
            &discovery,
            "--cluster",
            &cluster,
        ],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    let mine = capi.id(Kind::MachineDeployment, "mine");
    let theirs = capi.id(Kind::MachineDeployment, "theirs");

    assert_eq!(rpc.ids_in(&capi.ns).await, support::capi::ids(&[&mine]));
    assert_eq!(rpc.for_node(capi.grpc_node("mine-0")).await.id, mine);
    assert_eq!(rpc.for_node(capi.grpc_node("theirs-0")).await.id, "");
    expect_code("TargetSize", rpc.target(&theirs).await, Code::NotFound);
    expect_code(
        "IncreaseSize",
        rpc.increase(&theirs, 1).await,
        Code::NotFound,
    );
    expect_code(
        "DecreaseTargetSize",
        rpc.decrease(&theirs, -1).await,
        Code::NotFound,
    );
    expect_code(
        "DeleteNodes",
        rpc.delete_nodes(&theirs, vec![capi.grpc_node("theirs-0")])
            .await,
        Code::NotFound,
    );
    expect_code("Nodes", rpc.nodes(&theirs).await, Code::NotFound);
    // The served Cluster scales as ever.
    rpc.increase(&mine, 1).await.expect("IncreaseSize of mine");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "mine").await, 2);

    // Nothing written to the other Cluster's group.
    assert_eq!(capi.replicas(Kind::MachineDeployment, "theirs").await, 1);
    assert!(capi.marked_machines().await.is_empty());

    // Reported on the object, naming both Clusters.
    let theirs_cluster = format!("Cluster {}/c2", capi.ns);
    let mine_cluster = format!("Cluster {cluster}");
    support::infra::wait_problem_event(&capi, "theirs", &[&theirs_cluster, &mine_cluster]).await;
    // Counted with the problems (of kind scope), and among the groups not served.
    let metrics = support::autoscaler::http_get(&provider.metrics_address, "/metrics")
        .await
        .unwrap_or_else(|e| panic!("GET /metrics: {e}"));
    let problems = support::autoscaler::metric_sum(
        &metrics,
        "capi_autoscaler_provider_problems",
        &[("kind", "scope")],
    );
    assert!(problems >= 1.0, "problems {problems}");
    let not_served = support::autoscaler::metric_sum(
        &metrics,
        "capi_autoscaler_provider_node_groups_not_served",
        &[("reason", "other-cluster")],
    );
    assert!(not_served >= 1.0, "not served {not_served}");
    // And by `check`, which also names the served Cluster.
    let report = check(&capi, &["--cluster", &cluster]).await;
    assert!(
        report["cluster"]
            .as_str()
            .is_some_and(|c| c.starts_with(&cluster)),
        "{report}"
    );
    let problem = report["problems"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["object"] == format!("MachineDeployment {}/theirs", capi.ns))
        .unwrap_or_else(|| panic!("no problem about theirs: {report}"));
    assert_eq!(problem["field"], "spec.clusterName");
    assert!(
        problem["message"]
            .as_str()
            .is_some_and(|m| m.contains(&theirs_cluster)),
        "{problem}"
    );
}

/// `check -o json` with the namespace filter and `extra`; its report.
async fn check(capi: &Capi, extra: &[&str]) -> Value {
    let cp = support::control_plane(SETUP);
    let kubeconfig = cp.admin_kubeconfig().display().to_string();
    let discovery = only(capi);
    let mut args = vec![
        "check",
        "-o",
        "json",
        "--cloud-config",
        kubeconfig.as_str(),
        "--node-group-auto-discovery",
        discovery.as_str(),
    ];
    args.extend_from_slice(extra);
    let run = run_cli(&args, Duration::from_secs(30)).await;
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("{e}: {}", run.describe()))
}

#[tokio::test]
async fn a_cluster_the_workload_nodes_contradict_serves_nothing_and_readyz_says_why() {
    let (cp, capi) = two_clusters().await;
    let _node = ClusterNode::create(cp, &format!("{}-node", capi.ns), &capi.ns, "c1").await;
    let kubeconfig = cp.admin_kubeconfig().display().to_string();
    let wrong = format!("{}/c2", capi.ns);
    let discovery = only(&capi);
    let provider = spawn_provider(
        &[
            "--kubeconfig",
            &kubeconfig,
            "--node-group-auto-discovery",
            &discovery,
            "--cluster",
            &wrong,
        ],
        cp.admin_kubeconfig(),
        &[],
    );
    let address = provider.metrics_address.clone();
    let (want_flag, want_nodes) = (format!("--cluster {wrong}"), format!("{}/c1", capi.ns));
    let reason = poll_until(
        "/readyz 503 with the Cluster reason",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || {
            let address = address.clone();
            let (want_flag, want_nodes) = (want_flag.clone(), want_nodes.clone());
            async move {
                match procs::http_get(&address, "/readyz").await {
                    Ok((503, body)) if body.contains(&want_flag) && body.contains(&want_nodes) => {
                        Check::Done(body)
                    }
                    Ok((code, body)) => Check::Wait(format!("{code}: {body}")),
                    Err(e) => Check::Wait(e),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
    assert!(reason.contains("no node group is served"), "{reason}");
    // The ready gauge says what /readyz says (CapiAutoscalerProviderNotReady fires on it).
    let ready = |address: String| async move {
        let (_, metrics) = procs::http_get(&address, "/metrics")
            .await
            .expect("GET /metrics");
        support::autoscaler::metric_sum(&metrics, "capi_autoscaler_provider_ready", &[])
    };
    assert_eq!(ready(address.clone()).await, 0.0);

    // Not ready for gRPC health either; nothing served, nothing written: every group answers NOT_FOUND.
    assert_eq!(
        provider.health(CLOUD_PROVIDER).await,
        Ok(ServingStatus::NotServing)
    );
    let mut rpc = Rpc::connect_unready(&provider).await;
    assert!(rpc.ids_in(&capi.ns).await.is_empty());
    for name in ["mine", "theirs"] {
        let id = capi.id(Kind::MachineDeployment, name);
        expect_code("IncreaseSize", rpc.increase(&id, 1).await, Code::NotFound);
        assert_eq!(capi.replicas(Kind::MachineDeployment, name).await, 1);
    }

    // The name of the Cluster the Nodes belong to: served, namespace found from the Nodes.
    let provider = start_provider(
        &[
            "--kubeconfig",
            &kubeconfig,
            "--node-group-auto-discovery",
            &discovery,
            "--cluster",
            "c1",
        ],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    assert_eq!(
        rpc.ids_in(&capi.ns).await,
        support::capi::ids(&[&capi.id(Kind::MachineDeployment, "mine")])
    );
    let (code, body) = procs::http_get(&provider.metrics_address, "/readyz")
        .await
        .expect("GET /readyz");
    assert_eq!(code, 200, "{body}");
    assert_eq!(ready(provider.metrics_address.clone()).await, 1.0);
}

#[tokio::test]
async fn without_cluster_groups_of_two_clusters_and_no_nodes_serve_nothing_and_ask_for_it() {
    let (cp, capi) = two_clusters().await;
    let discovery = only(&capi);
    let provider = spawn_provider(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
        &[],
    );
    let address = provider.metrics_address.clone();
    let body = poll_until(
        "/readyz 503 asking for --cluster",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || {
            let address = address.clone();
            async move {
                match procs::http_get(&address, "/readyz").await {
                    Ok((503, body)) if body.contains("set --cluster") => Check::Done(body),
                    Ok((code, body)) => Check::Wait(format!("{code}: {body}")),
                    Err(e) => Check::Wait(e),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
    for cluster in ["c1", "c2"] {
        let named = format!("{}/{cluster}", capi.ns);
        assert!(body.contains(&named), "{named}: {body}");
    }
    let mut rpc = Rpc::connect_unready(&provider).await;
    assert!(rpc.ids_in(&capi.ns).await.is_empty());
    // Both groups reported, each with its own Cluster.
    for (name, cluster) in [("mine", "c1"), ("theirs", "c2")] {
        let named = format!("Cluster {}/{cluster}", capi.ns);
        support::infra::wait_problem_event(&capi, name, &[&named, "set --cluster"]).await;
    }
}

#[tokio::test]
async fn a_discovery_spec_naming_another_cluster_is_reported_naming_the_spec_and_the_served_cluster()
 {
    let (_cp, capi) = two_clusters().await;
    let cluster = format!("{}/c1", capi.ns);
    let other = format!("clusterapi:namespace={},clusterName=c3", capi.ns);
    let report = check(
        &capi,
        &["--cluster", &cluster, "--node-group-auto-discovery", &other],
    )
    .await;
    let problem = report["problems"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["object"] == format!("--node-group-auto-discovery {other}"))
        .unwrap_or_else(|| panic!("the spec is not reported: {report}"));
    assert_eq!(problem["field"], "clusterName");
    let message = problem["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("serves Cluster {cluster}")) && message.contains("c3"),
        "{message}"
    );
    // The served Cluster's group is served all the same.
    let groups: Vec<&str> = report["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|g| g["id"].as_str())
        .collect();
    assert_eq!(groups, [capi.id(Kind::MachineDeployment, "mine")]);
}
