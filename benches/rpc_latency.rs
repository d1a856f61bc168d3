//! Read-RPC latency at scale: 5,000 Machines in 500 MachineDeployment groups, served over gRPC on
//! 127.0.0.1 exactly as cluster-autoscaler calls them (one call at a time). Prints figures.
//!
//! cargo bench --bench rpc_latency [-- MACHINES GROUPS]

use std::sync::Arc;
use std::time::{Duration, Instant};

use capi_autoscaler_provider::capi::{Keys, Machine, ScalableKind, ScalableResource};
use capi_autoscaler_provider::metrics::Metrics;
use capi_autoscaler_provider::proto::cloud_provider_client::CloudProviderClient;
use capi_autoscaler_provider::proto::cloud_provider_server::CloudProviderServer;
use capi_autoscaler_provider::proto::{
    ExternalGrpcNode, NodeGroupForNodeRequest, NodeGroupNodesRequest, NodeGroupTargetSizeRequest,
    NodeGroupsRequest,
};
use capi_autoscaler_provider::service::Service;
use capi_autoscaler_provider::snapshot::{Index, NodeRef, Settings};
use capi_autoscaler_provider::store::{CapiApis, Store};
use serde_json::json;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration, Duration) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99), at(1.0))
}

fn report(name: &str, samples: Vec<Duration>) {
    let n = samples.len();
    let (p50, p99, max) = percentiles(samples);
    println!("{name:<28} n={n:<6} p50={p50:>10.1?} p99={p99:>10.1?} max={max:>10.1?}");
}

fn deployment(keys: &Keys, i: usize) -> serde_json::Value {
    json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
        "metadata": {"name": format!("md-{i}"), "namespace": "bench", "uid": format!("md-uid-{i}"), "resourceVersion": "1",
            "annotations": {
                keys.min_size.clone(): "0", keys.max_size.clone(): "100",
                "capacity.cluster-autoscaler.kubernetes.io/cpu": "4",
                "capacity.cluster-autoscaler.kubernetes.io/memory": "16Gi",
            }},
        "spec": {"clusterName": "bench", "replicas": 10,
            "selector": {"matchLabels": {"cluster.x-k8s.io/deployment-name": format!("md-{i}")}},
            "template": {"metadata": {"labels": {"cluster.x-k8s.io/deployment-name": format!("md-{i}")}},
                "spec": {"clusterName": "bench", "bootstrap": {"dataSecretName": "b"},
                    "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "E2EMachineTemplate", "name": "t"}}}}
    })
}

fn machine_set(i: usize) -> serde_json::Value {
    json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet",
        "metadata": {"name": format!("md-{i}-abc"), "namespace": "bench", "uid": format!("ms-uid-{i}"), "resourceVersion": "1",
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment", "name": format!("md-{i}"), "uid": format!("md-uid-{i}")}]},
        "spec": {"clusterName": "bench", "replicas": 10, "selector": {"matchLabels": {}},
            "template": {"spec": {"clusterName": "bench", "bootstrap": {"dataSecretName": "b"},
                "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "E2EMachineTemplate", "name": "t"}}}}
    })
}

fn machine(i: usize, j: usize) -> serde_json::Value {
    let name = format!("md-{i}-abc-{j}");
    json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
        "metadata": {"name": name, "namespace": "bench", "uid": format!("m-uid-{i}-{j}"), "resourceVersion": "1",
            "labels": {"cluster.x-k8s.io/cluster-name": "bench", "cluster.x-k8s.io/set-name": format!("md-{i}-abc")},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet", "name": format!("md-{i}-abc"), "uid": format!("ms-uid-{i}")}]},
        "spec": {"clusterName": "bench", "providerID": format!("bench:///bench/{name}"), "bootstrap": {"dataSecretName": "b"},
            "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "E2EMachine", "name": name}},
        "status": {"nodeRef": {"name": name}, "phase": "Running"}
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let machines = args.first().copied().unwrap_or(5_000);
    let groups = args.get(1).copied().unwrap_or(500).max(1);
    let per_group = machines.div_ceil(groups);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let keys = Keys::default();
        let rss_before = rss_kib();
        let started = Instant::now();
        let mut index = Index::default();
        for i in 0..groups {
            let md = ScalableResource::from_json(ScalableKind::MachineDeployment, &keys, &deployment(&keys, i))?;
            index.apply_resource(ScalableKind::MachineDeployment, md.key.clone(), Ok(Arc::new(md)));
            let ms = ScalableResource::from_json(ScalableKind::MachineSet, &keys, &machine_set(i))?;
            index.apply_resource(ScalableKind::MachineSet, ms.key.clone(), Ok(Arc::new(ms)));
            for j in 0..per_group {
                let m = Machine::from_json(&keys, &machine(i, j))?;
                index.apply_machine(m.key.clone(), Ok(Arc::new(m)));
            }
        }
        let filled = started.elapsed();
        let settings = Settings::default();
        let mut builds = Vec::new();
        for generation in 0..20 {
            let t = Instant::now();
            let snapshot = index.snapshot(&settings, generation);
            builds.push(t.elapsed());
            std::hint::black_box(snapshot);
        }
        let snapshot = index.snapshot(&settings, 99);
        println!(
            "objects: {} groups, {} Machines; parsed into the index in {filled:.1?}",
            snapshot.groups.len(),
            snapshot.machines
        );
        report("snapshot build", builds);
        let mut lookups = Vec::new();
        for i in 0..groups {
            for j in 0..per_group {
                let provider_id = format!("bench:///bench/md-{i}-abc-{j}");
                let t = Instant::now();
                let g = snapshot.group_for_node(&NodeRef { provider_id: &provider_id, name: "", annotations: None }, &keys);
                lookups.push(t.elapsed());
                assert!(g.is_some(), "{provider_id} not found");
            }
        }
        report("in-process node lookup", lookups);

        let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse()?))?;
        let metrics = Arc::new(Metrics::new());
        let store = Store::fixed(client, CapiApis::assume("cluster.x-k8s.io", "v1beta2"), settings, index, Arc::clone(&metrics));
        let rss_loaded = rss_kib();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(CloudProviderServer::new(Service::new(store, metrics)))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))),
        );
        let mut grpc = CloudProviderClient::connect(format!("http://{address}")).await?;
        for _ in 0..50 {
            grpc.node_groups(NodeGroupsRequest {}).await?;
        }
        let mut samples = Vec::new();
        for _ in 0..300 {
            let t = Instant::now();
            let r = grpc.node_groups(NodeGroupsRequest {}).await?;
            samples.push(t.elapsed());
            assert_eq!(r.get_ref().node_groups.len(), groups);
        }
        report("gRPC NodeGroups", samples);
        let mut samples = Vec::new();
        for i in 0..groups {
            for j in 0..per_group {
                let node = ExternalGrpcNode {
                    provider_id: format!("bench:///bench/md-{i}-abc-{j}"),
                    name: format!("md-{i}-abc-{j}"),
                    ..Default::default()
                };
                let t = Instant::now();
                let r = grpc.node_group_for_node(NodeGroupForNodeRequest { node: Some(node) }).await?;
                samples.push(t.elapsed());
                assert_eq!(r.get_ref().node_group.as_ref().map(|g| g.id.as_str()), Some(format!("MachineDeployment/bench/md-{i}").as_str()));
            }
        }
        report("gRPC NodeGroupForNode", samples);
        let mut sizes = Vec::new();
        let mut nodes = Vec::new();
        for i in 0..groups {
            let id = format!("MachineDeployment/bench/md-{i}");
            let t = Instant::now();
            grpc.node_group_target_size(NodeGroupTargetSizeRequest { id: id.clone() }).await?;
            sizes.push(t.elapsed());
            let t = Instant::now();
            grpc.node_group_nodes(NodeGroupNodesRequest { id }).await?;
            nodes.push(t.elapsed());
        }
        report("gRPC NodeGroupTargetSize", sizes);
        report("gRPC NodeGroupNodes", nodes);
        println!(
            "resident memory: {} KiB before, {} KiB with index and snapshot ({} KiB for {} Machines)",
            rss_before,
            rss_loaded,
            rss_loaded.saturating_sub(rss_before),
            machines
        );
        server.abort();
        Ok::<(), Box<dyn std::error::Error>>(())
    })?;
    Ok(())
}
