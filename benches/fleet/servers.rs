//! The three CloudProvider servers a replay runs against: this provider (its release binary, a
//! process), W (upstream's example externalgrpc server around the in-tree clusterapi provider, a
//! process in a mount namespace of its own) and the floor (a tonic server in this process answering
//! precomputed constants, in a process of its own: what any server costs at least over gRPC on this
//! machine).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::cloud_provider_client::CloudProviderClient;
use capi_autoscaler_provider::proto::cloud_provider_server::{CloudProvider, CloudProviderServer};
use capi_autoscaler_provider::proto::instance_status::InstanceState;
use capi_autoscaler_provider::proto::*;
use prost::Message;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use crate::apf::Identity;
use crate::fleet::{self, Fleet};
use crate::stats;
use crate::support::{self, procs};

/// A server under test.
pub struct Target {
    /// "ours", "W" or "floor".
    pub name: &'static str,
    pub address: String,
    pub metrics_address: Option<String>,
    pub log: Option<PathBuf>,
    child: Option<Child>,
    /// Whose apiserver requests are the server's.
    pub identities: Vec<Identity>,
    /// Spawn → first NodeGroups answer listing every group and mapping the last Machine's Node.
    pub ready_after: Option<Duration>,
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            procs::kill_and_reap(child);
        }
    }
}

impl Target {
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `VmRSS` and `VmHWM` of the server process, bytes.
    pub fn rss(&self) -> Option<(u64, u64)> {
        self.pid().and_then(stats::rss_of)
    }

    /// CPU time the server process has used so far, seconds.
    pub fn cpu(&self) -> Option<f64> {
        self.pid().and_then(stats::cpu_of)
    }

    /// A client on a channel of its own; `timeout` per call.
    pub async fn client(&self, timeout: Duration) -> CloudProviderClient<Channel> {
        let channel = Endpoint::from_shared(format!("http://{}", self.address))
            .unwrap_or_else(|e| panic!("endpoint {}: {e}", self.address))
            .connect_timeout(Duration::from_secs(2))
            .timeout(timeout)
            .tcp_nodelay(true)
            .connect_lazy();
        CloudProviderClient::new(channel).max_decoding_message_size(256 * 1024 * 1024)
    }

    /// Fails when the process has exited.
    pub fn check_alive(&mut self) -> Result<(), String> {
        let Some(child) = self.child.as_mut() else {
            return Ok(());
        };
        match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!(
                "{} exited with {status}; log {}:\n{}",
                self.name,
                self.log.as_deref().unwrap_or(Path::new("?")).display(),
                self.log
                    .as_deref()
                    .map(|l| procs::log_tail(l, 4000))
                    .unwrap_or_default()
            )),
            Err(e) => Err(format!("wait for {}: {e}", self.name)),
        }
    }

    /// Polls NodeGroups until it lists every group of the fleet and NodeGroupForNode maps the last
    /// Machine's Node to its group; records the time since `spawned`.
    pub async fn wait_ready(&mut self, fleet: &Fleet, spawned: Instant, timeout: Duration) {
        let mut client = self.client(timeout).await;
        let want = fleet.groups.len();
        let probe = fleet.probe().map(|(n, g)| (n.grpc(), g.id.clone()));
        let deadline = spawned + timeout;
        loop {
            if let Err(e) = self.check_alive() {
                panic!("{e}");
            }
            assert!(
                Instant::now() < deadline,
                "{} not ready after {timeout:?}; log {:?}",
                self.name,
                self.log
            );
            let listed = client
                .node_groups(NodeGroupsRequest {})
                .await
                .map(|r| r.into_inner().node_groups.len())
                .unwrap_or(0);
            if listed == want {
                let mapped = match &probe {
                    None => true,
                    Some((node, id)) => client
                        .node_group_for_node(NodeGroupForNodeRequest {
                            node: Some(node.clone()),
                        })
                        .await
                        .ok()
                        .and_then(|r| r.into_inner().node_group)
                        .is_some_and(|g| &g.id == id),
                };
                if mapped {
                    self.ready_after = Some(spawned.elapsed());
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Starts this provider's release binary: management and workload cluster through `identity`,
/// auto-discovery limited to the fleet's namespace (as W and A are). Returns at once.
pub fn spawn_ours(fleet: &Fleet, identity: &Identity) -> (Target, Instant) {
    let address = format!("127.0.0.1:{}", procs::free_port());
    let metrics = format!("127.0.0.1:{}", procs::free_port());
    let log = procs::work_dir().join(format!("ours-{}-{}.log", fleet.ns, procs::free_port()));
    let kubeconfig = identity.kubeconfig();
    let discovery = format!("clusterapi:namespace={}", fleet.ns);
    let args: Vec<String> = vec![
        "serve".into(),
        "--address".into(),
        address.clone(),
        "--metrics-address".into(),
        metrics.clone(),
        "--cloud-config".into(),
        kubeconfig.display().to_string(),
        "--kubeconfig".into(),
        kubeconfig.display().to_string(),
        "--node-group-auto-discovery".into(),
        discovery,
    ];
    // `BENCH_PROVIDER_WRAPPER` (e.g. `heaptrack -o /tmp/ours`) runs the provider under a profiler;
    // the figures of such a run are the profiler's, not the provider's.
    let wrapper: Vec<String> = std::env::var("BENCH_PROVIDER_WRAPPER")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let (program, args) = match wrapper.split_first() {
        None => (support::provider::PROVIDER_BIN.to_string(), args),
        Some((program, rest)) => {
            let mut all = rest.to_vec();
            all.push(support::provider::PROVIDER_BIN.to_string());
            all.extend(args);
            (program.clone(), all)
        }
    };
    let spawned = Instant::now();
    let child = procs::spawn_logged(Path::new(&program), &args, &log)
        .unwrap_or_else(|e| panic!("start {program}: {e}"));
    (
        Target {
            name: "ours",
            address,
            metrics_address: Some(metrics),
            log: Some(log),
            child: Some(child),
            identities: vec![identity.clone()],
            ready_after: None,
        },
        spawned,
    )
}

/// Starts W: `--cloud-config` is `mgmt`'s kubeconfig; its workload client is client-go's in-cluster
/// configuration, given `workload`'s token and the apiserver's CA in a mount namespace of its own (a
/// private tmpfs on /run, so /var/run/secrets of this machine is never written).
pub fn spawn_w(
    cp: &support::ControlPlane,
    fleet: &Fleet,
    mgmt: &Identity,
    workload: &Identity,
    in_cluster: &Path,
) -> (Target, Instant) {
    let binary = support::artifacts::resolved(&["capi-grpc-server"]);
    let address = format!("127.0.0.1:{}", procs::free_port());
    let log = procs::work_dir().join(format!("w-{}-{}.log", fleet.ns, procs::free_port()));
    let secrets = "/run/secrets/kubernetes.io/serviceaccount";
    let script = format!(
        "set -e; mount -t tmpfs tmpfs /run; mkdir -p {secrets}; \
         cp {dir}/token {dir}/ca.crt {dir}/namespace {secrets}/; \
         test \"$(readlink -f /var/run)\" = /run || test -f /var/run/secrets/kubernetes.io/serviceaccount/token; \
         exec \"$0\" \"$@\"",
        dir = in_cluster.display(),
    );
    let port = cp.server.rsplit(':').next().unwrap_or_default().to_string();
    let out =
        std::fs::File::create(&log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
    let err = out
        .try_clone()
        .unwrap_or_else(|e| panic!("log handle: {e}"));
    let mut command = Command::new("unshare");
    command
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .arg(&binary)
        .arg(format!("--address={address}"))
        .arg("--cloud-provider=clusterapi")
        .arg(format!("--cloud-config={}", mgmt.kubeconfig().display()))
        .arg(format!(
            "--node-group-auto-discovery=clusterapi:namespace={}",
            fleet.ns
        ))
        .arg("--logtostderr=true")
        .arg("--v=1")
        .env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        .env("KUBERNETES_SERVICE_PORT", port)
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err));
    let spawned = Instant::now();
    let child = procs::spawn(command).unwrap_or_else(|e| panic!("start W: {e}"));
    (
        Target {
            name: "W",
            address,
            metrics_address: None,
            log: Some(log),
            child: Some(child),
            identities: vec![mgmt.clone(), workload.clone()],
            ready_after: None,
        },
        spawned,
    )
}

/// The environment variable that turns this benchmark binary into the floor server: the path of its
/// plan (the fleet as JSON). `BENCH_FLOOR_ADDRESS` is where it listens.
pub const FLOOR_PLAN_ENV: &str = "BENCH_FLOOR_PLAN";
const FLOOR_ADDRESS_ENV: &str = "BENCH_FLOOR_ADDRESS";

/// Starts the floor: this binary again, in a process of its own (as every real server is), with a
/// runtime like the provider's.
pub fn spawn_floor(fleet: &Fleet) -> (Target, Instant) {
    let plan = procs::work_dir().join(format!("floor-plan-{}.json", fleet.ns));
    let groups: Vec<serde_json::Value> = fleet
        .groups
        .iter()
        .map(|g| {
            serde_json::json!({
                "id": g.id, "min": g.min, "max": g.max, "replicas": g.replicas,
                "members": g.members.iter().map(|&i| &fleet.nodes[i].provider_id).collect::<Vec<_>>(),
            })
        })
        .collect();
    std::fs::write(&plan, serde_json::to_vec(&groups).unwrap_or_default())
        .unwrap_or_else(|e| panic!("write {}: {e}", plan.display()));
    let address = format!("127.0.0.1:{}", procs::free_port());
    let log = procs::work_dir().join(format!("floor-{}.log", fleet.ns));
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("this binary: {e}"));
    let out =
        std::fs::File::create(&log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
    let err = out
        .try_clone()
        .unwrap_or_else(|e| panic!("log handle: {e}"));
    let mut command = Command::new(exe);
    command
        .env(FLOOR_PLAN_ENV, &plan)
        .env(FLOOR_ADDRESS_ENV, &address)
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err));
    let spawned = Instant::now();
    let child = procs::spawn(command).unwrap_or_else(|e| panic!("start the floor: {e}"));
    (
        Target {
            name: "floor",
            address,
            metrics_address: None,
            log: Some(log),
            child: Some(child),
            identities: Vec::new(),
            ready_after: None,
        },
        spawned,
    )
}

/// The floor process: serves the plan at `BENCH_FLOOR_ADDRESS` until killed.
pub fn floor_main(plan: &str) {
    let text = std::fs::read(plan).unwrap_or_else(|e| panic!("read {plan}: {e}"));
    let groups: Vec<serde_json::Value> =
        serde_json::from_slice(&text).unwrap_or_else(|e| panic!("parse {plan}: {e}"));
    let floor = Floor::new(&groups);
    // With no subscriber ever set, every span the gRPC stack opens is also formatted for the `log`
    // crate (about 3 % of the floor's CPU per call in a profile at 100,000 Machines): the floor sets
    // one that records nothing, as the provider sets its own.
    let _ = tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::default());
    let address = std::env::var(FLOOR_ADDRESS_ENV).unwrap_or_else(|_| "127.0.0.1:8086".into());
    let runtime = tokio::runtime::Runtime::new().unwrap_or_else(|e| panic!("runtime: {e}"));
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .unwrap_or_else(|e| panic!("bind the floor at {address}: {e}"));
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let _ = tonic::transport::Server::builder()
            .add_service(CloudProviderServer::new(floor))
            .serve_with_incoming(incoming)
            .await;
    });
}

/// Answers every read RPC of the replay with a response computed once from the fleet plan.
struct Floor {
    groups: NodeGroupsResponse,
    /// Each node's answer, encoded (as the provider answers it, so the floor is no slower there).
    by_node: HashMap<String, prost::bytes::Bytes>,
    sizes: HashMap<String, NodeGroupTargetSizeResponse>,
    nodes: HashMap<String, NodeGroupNodesResponse>,
    template: Arc<NodeGroupTemplateNodeInfoResponse>,
}

impl Floor {
    /// From the plan: `[{id, min, max, replicas, members: [providerID]}]`.
    fn new(plan: &[serde_json::Value]) -> Floor {
        let int = |v: &serde_json::Value, k: &str| v[k].as_i64().unwrap_or(0) as i32;
        let wire = |g: &serde_json::Value| {
            let id = g["id"].as_str().unwrap_or_default().to_string();
            NodeGroup {
                debug: format!(
                    "{id} (min: {}, max: {}, replicas: {})",
                    int(g, "min"),
                    int(g, "max"),
                    int(g, "replicas")
                ),
                id,
                min_size: int(g, "min"),
                max_size: int(g, "max"),
            }
        };
        let members = |g: &serde_json::Value| -> Vec<String> {
            g["members"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|m| m.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        let groups = NodeGroupsResponse::from(plan.iter().map(wire).collect::<Vec<_>>());
        let by_node = plan
            .iter()
            .flat_map(|g| {
                let answer = prost::bytes::Bytes::from(node_group_field(&wire(g)));
                members(g).into_iter().map(move |m| (m, answer.clone()))
            })
            .collect();
        let sizes = plan
            .iter()
            .map(|g| {
                (
                    wire(g).id,
                    NodeGroupTargetSizeResponse {
                        target_size: int(g, "replicas"),
                    },
                )
            })
            .collect();
        let nodes = plan
            .iter()
            .map(|g| {
                let instances = members(g)
                    .into_iter()
                    .map(|id| Instance {
                        id,
                        status: Some(InstanceStatus {
                            instance_state: InstanceState::InstanceRunning as i32,
                            error_info: None,
                        }),
                    })
                    .collect();
                (wire(g).id, NodeGroupNodesResponse { instances })
            })
            .collect();
        let bytes = prost::bytes::Bytes::from(template_node().encode_to_vec());
        Floor {
            groups,
            by_node,
            sizes,
            nodes,
            template: Arc::new(NodeGroupTemplateNodeInfoResponse {
                node_info: bytes.clone(),
                node_bytes: bytes,
            }),
        }
    }
}

/// A scale-from-zero template of the fleet's shape.
fn template_node() -> k8s_pb::api::core::v1::Node {
    use k8s_pb::api::core::v1 as pb;
    use k8s_pb::apimachinery::pkg::api::resource::Quantity;
    use k8s_pb::apimachinery::pkg::apis::meta::v1 as meta;
    let quantity = |s: &str| Quantity {
        string: Some(s.to_string()),
    };
    let capacity: std::collections::BTreeMap<String, Quantity> = [
        ("cpu", fleet::CPU),
        ("memory", fleet::MEMORY),
        ("pods", fleet::PODS),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), quantity(v)))
    .collect();
    let labels = [
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", "amd64"),
        ("kubernetes.io/hostname", "template-node-for-floor"),
        ("node.kubernetes.io/instance-type", "bench-4x16"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    pb::Node {
        metadata: Some(meta::ObjectMeta {
            name: Some("template-node-for-floor".into()),
            labels,
            ..Default::default()
        }),
        spec: Some(pb::NodeSpec::default()),
        status: Some(pb::NodeStatus {
            allocatable: capacity.clone(),
            capacity,
            conditions: vec![pb::NodeCondition {
                r#type: Some("Ready".into()),
                status: Some("True".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
    }
}

fn unimplemented<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("the floor answers only reads"))
}

fn found<T: Clone>(map: &HashMap<String, T>, id: &str) -> Result<Response<T>, Status> {
    map.get(id)
        .cloned()
        .map(Response::new)
        .ok_or_else(|| Status::not_found(id.to_string()))
}

#[tonic::async_trait]
impl CloudProvider for Floor {
    async fn node_groups(
        &self,
        _: Request<NodeGroupsRequest>,
    ) -> Result<Response<NodeGroupsResponse>, Status> {
        Ok(Response::new(self.groups.clone()))
    }

    async fn node_group_for_node(
        &self,
        request: Request<NodeGroupForNodeRequest>,
    ) -> Result<Response<NodeGroupForNodeResponse>, Status> {
        let id = request
            .get_ref()
            .node
            .as_ref()
            .map(|n| n.provider_id.as_str())
            .unwrap_or_default();
        Ok(Response::new(match self.by_node.get(id) {
            Some(answer) => NodeGroupForNodeResponse::encoded(answer.clone()),
            None => NodeGroupForNodeResponse::from(NodeGroup::default()),
        }))
    }

    async fn pricing_node_price(
        &self,
        _: Request<PricingNodePriceRequest>,
    ) -> Result<Response<PricingNodePriceResponse>, Status> {
        unimplemented()
    }

    async fn pricing_pod_price(
        &self,
        _: Request<PricingPodPriceRequest>,
    ) -> Result<Response<PricingPodPriceResponse>, Status> {
        unimplemented()
    }

    // CA caches these two only when they succeed: an error would cost a call per node.
    async fn gpu_label(
        &self,
        _: Request<GpuLabelRequest>,
    ) -> Result<Response<GpuLabelResponse>, Status> {
        Ok(Response::new(GpuLabelResponse {
            label: "nvidia.com/gpu".into(),
        }))
    }

    async fn get_available_gpu_types(
        &self,
        _: Request<GetAvailableGpuTypesRequest>,
    ) -> Result<Response<GetAvailableGpuTypesResponse>, Status> {
        Ok(Response::new(GetAvailableGpuTypesResponse::default()))
    }

    async fn cleanup(
        &self,
        _: Request<CleanupRequest>,
    ) -> Result<Response<CleanupResponse>, Status> {
        Ok(Response::new(CleanupResponse {}))
    }

    async fn refresh(
        &self,
        _: Request<RefreshRequest>,
    ) -> Result<Response<RefreshResponse>, Status> {
        Ok(Response::new(RefreshResponse {}))
    }

    async fn node_group_target_size(
        &self,
        request: Request<NodeGroupTargetSizeRequest>,
    ) -> Result<Response<NodeGroupTargetSizeResponse>, Status> {
        found(&self.sizes, &request.get_ref().id)
    }

    async fn node_group_increase_size(
        &self,
        _: Request<NodeGroupIncreaseSizeRequest>,
    ) -> Result<Response<NodeGroupIncreaseSizeResponse>, Status> {
        unimplemented()
    }

    async fn node_group_delete_nodes(
        &self,
        _: Request<NodeGroupDeleteNodesRequest>,
    ) -> Result<Response<NodeGroupDeleteNodesResponse>, Status> {
        unimplemented()
    }

    async fn node_group_decrease_target_size(
        &self,
        _: Request<NodeGroupDecreaseTargetSizeRequest>,
    ) -> Result<Response<NodeGroupDecreaseTargetSizeResponse>, Status> {
        unimplemented()
    }

    async fn node_group_nodes(
        &self,
        request: Request<NodeGroupNodesRequest>,
    ) -> Result<Response<NodeGroupNodesResponse>, Status> {
        found(&self.nodes, &request.get_ref().id)
    }

    async fn node_group_template_node_info(
        &self,
        _: Request<NodeGroupTemplateNodeInfoRequest>,
    ) -> Result<Response<NodeGroupTemplateNodeInfoResponse>, Status> {
        Ok(Response::new(NodeGroupTemplateNodeInfoResponse::clone(
            &self.template,
        )))
    }

    async fn node_group_get_options(
        &self,
        _: Request<NodeGroupAutoscalingOptionsRequest>,
    ) -> Result<Response<NodeGroupAutoscalingOptionsResponse>, Status> {
        Ok(Response::new(NodeGroupAutoscalingOptionsResponse::default()))
    }
}
