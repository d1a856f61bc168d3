//! One cluster-autoscaler 1.36 loop replayed over gRPC, one call at a time as CA makes them: Refresh;
//! NodeGroups; NodeGroupForNode for every Node; per group TargetSize, Nodes and GetOptions; a template
//! per zero-size group.
//!
//! A server too slow for whole loops (W) is sampled: every kind of call is made at least once and then
//! until its time budget is spent, the calls picked at random; the loop time is then estimated as the
//! sum over kinds of (calls a whole loop makes) × (mean sampled latency), and marked as estimated.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::cloud_provider_client::CloudProviderClient;
use capi_autoscaler_provider::proto::*;
use rand::SeedableRng as _;
use rand::seq::SliceRandom as _;
use tonic::transport::Channel;

use crate::fleet::Fleet;
use crate::stats::Samples;

/// The RPC kinds of a loop, in CA's order.
pub const KINDS: [&str; 7] = [
    "Refresh",
    "NodeGroups",
    "NodeGroupForNode",
    "NodeGroupTargetSize",
    "NodeGroupNodes",
    "NodeGroupGetOptions",
    "NodeGroupTemplateNodeInfo",
];

/// What a loop asks, precomputed from the fleet.
pub struct Plan {
    nodes: Vec<ExternalGrpcNode>,
    groups: Vec<String>,
    zero_groups: Vec<String>,
    defaults: NodeGroupAutoscalingOptions,
}

impl Plan {
    pub fn new(fleet: &Fleet) -> Plan {
        let duration = |secs: i64| prost_types::Duration {
            seconds: secs,
            nanos: 0,
        };
        Plan {
            nodes: fleet.nodes.iter().map(|n| n.grpc()).collect(),
            groups: fleet.groups.iter().map(|g| g.id.clone()).collect(),
            zero_groups: fleet.zero_groups().map(|g| g.id.clone()).collect(),
            // CA 1.36's defaults, as it sends them.
            defaults: NodeGroupAutoscalingOptions {
                scale_down_utilization_threshold: 0.5,
                scale_down_gpu_utilization_threshold: 0.5,
                scale_down_unneeded_duration: Some(duration(600)),
                scale_down_unready_duration: Some(duration(1200)),
                max_node_provision_duration: Some(duration(900)),
                ..Default::default()
            },
        }
    }

    /// Calls of each kind in a whole loop.
    pub fn counts(&self) -> BTreeMap<&'static str, usize> {
        BTreeMap::from([
            ("Refresh", 1),
            ("NodeGroups", 1),
            ("NodeGroupForNode", self.nodes.len()),
            ("NodeGroupTargetSize", self.groups.len()),
            ("NodeGroupNodes", self.groups.len()),
            ("NodeGroupGetOptions", self.groups.len()),
            ("NodeGroupTemplateNodeInfo", self.zero_groups.len()),
        ])
    }
}

/// Whole loops, or samples within a time budget per kind.
#[derive(Clone, Copy, Debug)]
pub enum Mode {
    Whole,
    Sampled { budget: Duration, max: usize },
}

/// One replayed loop.
#[derive(Clone, Debug, Default)]
pub struct LoopRun {
    pub latency: BTreeMap<&'static str, Samples>,
    /// Calls that did not answer OK (Unimplemented included), by kind.
    pub errors: BTreeMap<&'static str, usize>,
    /// Wall time of the loop; for a sampled loop, the estimate.
    pub wall: Duration,
    /// Wall time actually spent.
    pub spent: Duration,
    pub estimated: bool,
    /// CPU seconds the server used during the loop.
    pub server_cpu: Option<f64>,
    /// CPU seconds the rest of the machine used during the loop: all but the server and the replay
    /// client (the API server, etcd, the other servers).
    pub others_cpu: Option<f64>,
}

/// Replays one loop against `client`. `seed` picks the samples of a sampled loop.
pub async fn run(
    client: &mut CloudProviderClient<Channel>,
    plan: &Plan,
    mode: Mode,
    seed: u64,
) -> LoopRun {
    let mut run = LoopRun::default();
    let started = Instant::now();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // Sampled loops: each kind's items in random order, cut by the budget.
    let order = |n: usize, rng: &mut rand::rngs::StdRng| {
        let mut v: Vec<usize> = (0..n).collect();
        if matches!(mode, Mode::Sampled { .. }) {
            v.shuffle(rng);
        }
        v
    };
    let keep_going = |kind_started: Instant, done: usize| match mode {
        Mode::Whole => true,
        Mode::Sampled { budget, max } => {
            done == 0 || (done < max && kind_started.elapsed() < budget)
        }
    };

    macro_rules! call {
        ($kind:expr, $fut:expr) => {{
            let t = Instant::now();
            let result = $fut.await;
            run.latency.entry($kind).or_default().push(t.elapsed());
            if result.is_err() {
                *run.errors.entry($kind).or_default() += 1;
            }
        }};
    }

    call!("Refresh", client.refresh(RefreshRequest {}));
    call!("NodeGroups", client.node_groups(NodeGroupsRequest {}));
    let kind_started = Instant::now();
    for (done, i) in order(plan.nodes.len(), &mut rng).into_iter().enumerate() {
        if !keep_going(kind_started, done) {
            break;
        }
        call!(
            "NodeGroupForNode",
            client.node_group_for_node(NodeGroupForNodeRequest {
                node: Some(plan.nodes[i].clone()),
            })
        );
    }
    let groups = order(plan.groups.len(), &mut rng);
    let kind_started = Instant::now();
    for (done, &g) in groups.iter().enumerate() {
        let id = plan.groups[g].clone();
        match mode {
            Mode::Whole => {
                call!(
                    "NodeGroupTargetSize",
                    client.node_group_target_size(NodeGroupTargetSizeRequest { id: id.clone() })
                );
                call!(
                    "NodeGroupNodes",
                    client.node_group_nodes(NodeGroupNodesRequest { id: id.clone() })
                );
                call!(
                    "NodeGroupGetOptions",
                    client.node_group_get_options(NodeGroupAutoscalingOptionsRequest {
                        id,
                        defaults: Some(plan.defaults),
                    })
                );
            }
            Mode::Sampled { .. } => {
                // Each kind on its own budget, on the same random groups.
                if !keep_going(kind_started, done) {
                    break;
                }
                call!(
                    "NodeGroupTargetSize",
                    client.node_group_target_size(NodeGroupTargetSizeRequest { id })
                );
            }
        }
    }
    if let Mode::Sampled { .. } = mode {
        let kind_started = Instant::now();
        for (done, &g) in groups.iter().enumerate() {
            if !keep_going(kind_started, done) {
                break;
            }
            let id = plan.groups[g].clone();
            call!(
                "NodeGroupNodes",
                client.node_group_nodes(NodeGroupNodesRequest { id })
            );
        }
        let kind_started = Instant::now();
        for (done, &g) in groups.iter().enumerate() {
            if !keep_going(kind_started, done) {
                break;
            }
            let id = plan.groups[g].clone();
            call!(
                "NodeGroupGetOptions",
                client.node_group_get_options(NodeGroupAutoscalingOptionsRequest {
                    id,
                    defaults: Some(plan.defaults),
                })
            );
        }
    }
    let kind_started = Instant::now();
    let mut zero = plan.zero_groups.clone();
    if matches!(mode, Mode::Sampled { .. }) {
        zero.shuffle(&mut rng);
    }
    for (done, id) in zero.into_iter().enumerate() {
        if !keep_going(kind_started, done) {
            break;
        }
        call!(
            "NodeGroupTemplateNodeInfo",
            client.node_group_template_node_info(NodeGroupTemplateNodeInfoRequest { id })
        );
    }
    run.spent = started.elapsed();
    run.estimated = match mode {
        Mode::Whole => false,
        Mode::Sampled { .. } => plan
            .counts()
            .iter()
            .any(|(kind, &n)| run.latency.get(kind).map_or(0, Samples::len) < n),
    };
    run.wall = if run.estimated {
        let seconds: f64 = plan
            .counts()
            .iter()
            .map(|(kind, &n)| {
                n as f64 * run.latency.get(kind).and_then(Samples::mean).unwrap_or(0.0)
            })
            .sum();
        Duration::from_secs_f64(seconds)
    } else {
        run.spent
    };
    run
}
