//! `make load`: many concurrent clients making cluster-autoscaler's read RPCs against this provider's
//! release binary, as users run it: `serve` against the test control plane (etcd + kube-apiserver + the
//! Cluster API CRDs, `tests/support`) holding a fleet of real objects (`benches/fleet/fleet.rs`: N Machines
//! with Ready Nodes in G MachineDeployments with their MachineSets, ~10% of the groups at zero, ~5% more
//! Nodes in no group).
//!
//! The calls are those of CA loops: per loop NodeGroups once, NodeGroupForNode for every Node,
//! NodeGroupTargetSize, NodeGroupNodes and NodeGroupGetOptions for every group, NodeGroupTemplateNodeInfo for
//! every zero-size group; each loop's calls shuffled, loops repeated until the total is reached, taken by the
//! clients from one queue (each client has its own connection and waits for each answer). Prints errors
//! (which must be 0: the bench exits 1 otherwise), throughput, p50/p99/max latency overall and per kind, and
//! the provider's resident memory sampled every 25 ms during the run (growth from the first to the last
//! tenth of the run shows whether memory stays bounded) and its CPU time. Figures, not a timed test.
//!
//! Environment (all optional): `LOAD_MACHINES` (5000), `LOAD_GROUPS` (500), `LOAD_CLIENTS` (64),
//! `LOAD_RPCS` (100000), `LOAD_TIMEOUT` (seconds per call, 10: CA's cloud-config default).

#[path = "../tests/support/mod.rs"]
pub mod support;

// The fleet of the `fleet` bench, created the same way.
#[allow(dead_code)]
#[path = "fleet/fleet.rs"]
mod fleet;
#[allow(dead_code)]
#[path = "fleet/stats.rs"]
mod fleet_stats;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::cloud_provider_client::CloudProviderClient;
use capi_autoscaler_provider::proto::*;
use rand::SeedableRng as _;
use rand::seq::SliceRandom as _;
use tonic::transport::{Channel, Endpoint};

use crate::fleet::Fleet;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// Progress on stderr, with the time since the start.
fn say(start: Instant, text: &str) {
    eprintln!("[{:>7.1}s] {text}", start.elapsed().as_secs_f64());
}

const KINDS: [&str; 6] = [
    "NodeGroups",
    "NodeGroupForNode",
    "NodeGroupTargetSize",
    "NodeGroupNodes",
    "NodeGroupGetOptions",
    "NodeGroupTemplateNodeInfo",
];

/// One read RPC of a CA loop.
#[derive(Clone, Copy, Debug)]
enum Call {
    NodeGroups,
    ForNode(usize),
    TargetSize(usize),
    Nodes(usize),
    Options(usize),
    Template(usize),
}

impl Call {
    fn kind(self) -> usize {
        match self {
            Call::NodeGroups => 0,
            Call::ForNode(_) => 1,
            Call::TargetSize(_) => 2,
            Call::Nodes(_) => 3,
            Call::Options(_) => 4,
            Call::Template(_) => 5,
        }
    }
}

/// What the calls ask, precomputed from the fleet.
struct Plan {
    nodes: Vec<ExternalGrpcNode>,
    groups: Vec<String>,
    zero_groups: Vec<String>,
    defaults: NodeGroupAutoscalingOptions,
    /// One CA loop.
    cycle: Vec<Call>,
}

impl Plan {
    fn new(fleet: &Fleet) -> Plan {
        let duration = |seconds: i64| prost_types::Duration { seconds, nanos: 0 };
        let nodes: Vec<ExternalGrpcNode> = fleet.nodes.iter().map(|n| n.grpc()).collect();
        let groups: Vec<String> = fleet.groups.iter().map(|g| g.id.clone()).collect();
        let zero_groups: Vec<String> = fleet.zero_groups().map(|g| g.id.clone()).collect();
        let mut cycle = vec![Call::NodeGroups];
        cycle.extend((0..nodes.len()).map(Call::ForNode));
        for g in 0..groups.len() {
            cycle.extend([Call::TargetSize(g), Call::Nodes(g), Call::Options(g)]);
        }
        cycle.extend((0..zero_groups.len()).map(Call::Template));
        Plan {
            nodes,
            groups,
            zero_groups,
            // CA 1.36's defaults, as it sends them.
            defaults: NodeGroupAutoscalingOptions {
                scale_down_utilization_threshold: 0.5,
                scale_down_gpu_utilization_threshold: 0.5,
                scale_down_unneeded_duration: Some(duration(600)),
                scale_down_unready_duration: Some(duration(1200)),
                max_node_provision_duration: Some(duration(900)),
                ..Default::default()
            },
            cycle,
        }
    }

    /// `total` calls: whole loops, each shuffled, the last one cut.
    fn calls(&self, total: usize) -> Vec<Call> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x10AD);
        let mut out = Vec::with_capacity(total);
        while out.len() < total {
            let mut cycle = self.cycle.clone();
            cycle.shuffle(&mut rng);
            let take = (total - out.len()).min(cycle.len());
            out.extend_from_slice(&cycle[..take]);
        }
        out
    }

    /// Makes one call; `Err` with the status of a failed one (an empty group id or an unmapped node
    /// counts as an error: every node of the fleet but the ungrouped ones belongs to a group).
    async fn call(
        &self,
        client: &mut CloudProviderClient<Channel>,
        call: Call,
        fleet: &Fleet,
    ) -> Result<(), String> {
        let status = |s: tonic::Status| format!("{:?}: {}", s.code(), s.message());
        match call {
            Call::NodeGroups => {
                let r = client.node_groups(NodeGroupsRequest {}).await;
                let listed = r.map_err(status)?.into_inner().node_groups.len();
                (listed == self.groups.len())
                    .then_some(())
                    .ok_or_else(|| format!("NodeGroups listed {listed} groups"))
            }
            Call::ForNode(i) => {
                let r = client
                    .node_group_for_node(NodeGroupForNodeRequest {
                        node: Some(self.nodes[i].clone()),
                    })
                    .await;
                let got = r
                    .map_err(status)?
                    .into_inner()
                    .node_group
                    .unwrap_or_default();
                let want = fleet.nodes[i]
                    .group
                    .map(|g| fleet.groups[g].id.as_str())
                    .unwrap_or_default();
                (got.id == want)
                    .then_some(())
                    .ok_or_else(|| format!("node {} mapped to {:?}", self.nodes[i].name, got.id))
            }
            Call::TargetSize(g) => client
                .node_group_target_size(NodeGroupTargetSizeRequest {
                    id: self.groups[g].clone(),
                })
                .await
                .map(drop)
                .map_err(status),
            Call::Nodes(g) => client
                .node_group_nodes(NodeGroupNodesRequest {
                    id: self.groups[g].clone(),
                })
                .await
                .map(drop)
                .map_err(status),
            Call::Options(g) => client
                .node_group_get_options(NodeGroupAutoscalingOptionsRequest {
                    id: self.groups[g].clone(),
                    defaults: Some(self.defaults),
                })
                .await
                .map(drop)
                .map_err(status),
            Call::Template(g) => client
                .node_group_template_node_info(NodeGroupTemplateNodeInfoRequest {
                    id: self.zero_groups[g].clone(),
                })
                .await
                .map(drop)
                .map_err(status),
        }
    }
}

/// `VmRSS` of a process, bytes.
fn rss(pid: u32) -> Option<u64> {
    fleet_stats::rss_of(pid).map(|(rss, _)| rss)
}

/// User + system CPU time of a process.
fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name in parentheses: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| Duration::from_secs_f64(ticks as f64 / per_second as f64))
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn ms(seconds: f64) -> String {
    format!("{:.2} ms", seconds * 1e3)
}

async fn client(address: &str, timeout: Duration) -> CloudProviderClient<Channel> {
    let channel = Endpoint::from_shared(format!("http://{address}"))
        .unwrap_or_else(|e| panic!("endpoint {address}: {e}"))
        .connect_timeout(Duration::from_secs(5))
        .timeout(timeout)
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect to {address}: {e}"));
    CloudProviderClient::new(channel).max_decoding_message_size(64 * 1024 * 1024)
}

#[tokio::main]
async fn main() {
    let start = Instant::now();
    // `cargo bench` passes `--bench`; nothing else is read from the arguments.
    let machines: usize = env_or("LOAD_MACHINES", 5_000);
    let groups: usize = env_or("LOAD_GROUPS", 500);
    let clients: usize = env_or("LOAD_CLIENTS", 64).max(1);
    let total: usize = env_or("LOAD_RPCS", 100_000);
    let timeout = Duration::from_secs(env_or("LOAD_TIMEOUT", 10));

    let cp = support::control_plane(support::Setup::shipped());
    let admin = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let mut fleet = Fleet::plan(&ns, machines, groups);
    say(
        start,
        &format!(
            "creating the fleet in {ns}: {machines} Machines in {} groups, {} Nodes",
            fleet.groups.len(),
            fleet.nodes.len()
        ),
    );
    fleet.create(&admin).await;
    let counted = fleet::count_machines(&admin, &ns).await;
    assert_eq!(counted, machines, "Machines in {ns}");
    say(
        start,
        &format!(
            "fleet: {} objects in {:.1}s",
            fleet.objects,
            fleet.created_in.as_secs_f64()
        ),
    );

    // The release binary `cargo bench` built, watching the fleet's namespace and the Nodes.
    let kubeconfig = cp.admin_kubeconfig().display().to_string();
    let discovery = format!("clusterapi:namespace={ns}");
    let provider = support::start_provider(
        &[
            "--kubeconfig",
            &kubeconfig,
            "--node-group-auto-discovery",
            &discovery,
        ],
        cp.admin_kubeconfig(),
    )
    .await;
    let pid = provider.pid();
    let plan = Arc::new(Plan::new(&fleet));
    let fleet = Arc::new(fleet);

    // Ready: every group listed and the last Machine's Node mapped (the snapshot has it all).
    let mut probe = client(&provider.address, timeout).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let listed = plan
            .call(&mut probe, Call::NodeGroups, &fleet)
            .await
            .is_ok();
        let last = fleet.nodes.iter().rposition(|n| n.group.is_some());
        let mapped = match last {
            Some(i) => plan
                .call(&mut probe, Call::ForNode(i), &fleet)
                .await
                .is_ok(),
            None => true,
        };
        if listed && mapped {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "provider not ready after 120 s; log {}",
            provider.log.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let idle_rss = rss(pid).unwrap_or(0);
    say(
        start,
        &format!(
            "provider ready (pid {pid}, {} after start), RSS {}",
            format_args!("{:.1}s", provider.startup.as_secs_f64()),
            mib(idle_rss)
        ),
    );

    // The run.
    let calls = Arc::new(plan.calls(total));
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let done = Arc::clone(&done);
        let next = Arc::clone(&next);
        tokio::spawn(async move {
            let mut samples = Vec::new();
            let began = Instant::now();
            while !done.load(Ordering::Relaxed) {
                if let Some(r) = rss(pid) {
                    samples.push((began.elapsed(), next.load(Ordering::Relaxed), r));
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            samples
        })
    };
    let cpu_before = cpu_time(pid);
    let began = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let mut c = client(&provider.address, timeout).await;
        let (plan, fleet, calls, next) = (
            Arc::clone(&plan),
            Arc::clone(&fleet),
            Arc::clone(&calls),
            Arc::clone(&next),
        );
        tasks.push(tokio::spawn(async move {
            let mut latencies: Vec<(usize, f64)> = Vec::new();
            let mut errors: Vec<(usize, String)> = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&call) = calls.get(i) else { break };
                let t = Instant::now();
                let result = plan.call(&mut c, call, &fleet).await;
                latencies.push((call.kind(), t.elapsed().as_secs_f64()));
                if let Err(e) = result {
                    errors.push((call.kind(), e));
                }
            }
            (latencies, errors)
        }));
    }
    let mut latencies: Vec<(usize, f64)> = Vec::with_capacity(total);
    let mut errors: Vec<(usize, String)> = Vec::new();
    for task in tasks {
        let (l, e) = task.await.expect("client task");
        latencies.extend(l);
        errors.extend(e);
    }
    let wall = began.elapsed();
    let cpu_after = cpu_time(pid);
    done.store(true, Ordering::Relaxed);
    let samples = sampler.await.expect("sampler");
    let after_rss = rss(pid).unwrap_or(0);
    let peak_rss = fleet_stats::rss_of(pid).map(|(_, hwm)| hwm).unwrap_or(0);
    let alive = std::fs::metadata(format!("/proc/{pid}")).is_ok();

    // Figures.
    println!();
    println!(
        "load: {total} read RPCs from {clients} concurrent clients (one connection each) against \
         capi-autoscaler-provider serve (release binary, pid {pid}) serving {machines} Machines in {groups} \
         MachineDeployments ({} at zero) and {} Nodes, on the test control plane",
        plan.zero_groups.len(),
        plan.nodes.len()
    );
    let mut per_loop = [0usize; 6];
    for c in &plan.cycle {
        per_loop[c.kind()] += 1;
    }
    println!(
        "mix (calls per CA loop, {} loops): {}",
        format_args!("{:.1}", total as f64 / plan.cycle.len() as f64),
        KINDS
            .iter()
            .zip(per_loop)
            .map(|(k, n)| format!("{k} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("errors: {} of {}", errors.len(), latencies.len());
    let mut by_message: BTreeMap<String, usize> = BTreeMap::new();
    for (kind, e) in &errors {
        *by_message
            .entry(format!("{}: {e}", KINDS[*kind]))
            .or_default() += 1;
    }
    for (message, n) in by_message.iter().take(10) {
        println!("  {n} × {message}");
    }
    println!(
        "throughput: {:.0} RPC/s ({} RPCs in {:.2} s)",
        latencies.len() as f64 / wall.as_secs_f64(),
        latencies.len(),
        wall.as_secs_f64()
    );
    let all = fleet_stats::Samples(latencies.iter().map(|(_, s)| *s).collect());
    println!(
        "latency (client side, all calls): p50 {}  p99 {}  max {}",
        ms(all.p50().unwrap_or(0.0)),
        ms(all.p99().unwrap_or(0.0)),
        ms(all.max().unwrap_or(0.0))
    );
    println!(
        "  {:<26} {:>7} {:>10} {:>10} {:>10}",
        "kind", "calls", "p50", "p99", "max"
    );
    for (k, kind) in KINDS.iter().enumerate() {
        let s = fleet_stats::Samples(
            latencies
                .iter()
                .filter(|(c, _)| *c == k)
                .map(|(_, s)| *s)
                .collect(),
        );
        if s.is_empty() {
            continue;
        }
        println!(
            "  {:<26} {:>7} {:>10} {:>10} {:>10}",
            kind,
            s.len(),
            ms(s.p50().unwrap_or(0.0)),
            ms(s.p99().unwrap_or(0.0)),
            ms(s.max().unwrap_or(0.0))
        );
    }
    // Memory: the first and the last tenth of the run by calls made.
    let tenth = |lo: f64, hi: f64| {
        samples
            .iter()
            .filter(|(_, made, _)| {
                let f = *made as f64 / total.max(1) as f64;
                f >= lo && f <= hi
            })
            .map(|(_, _, r)| *r)
            .max()
    };
    let during_min = samples.iter().map(|s| s.2).min().unwrap_or(0);
    let during_max = samples.iter().map(|s| s.2).max().unwrap_or(0);
    let (first, last) = (tenth(0.0, 0.1), tenth(0.9, 1.0));
    println!(
        "provider RSS: ready {}; during the run ({} samples) min {} max {}; max in the first tenth {}, \
         in the last tenth {} (growth {}); after {}; peak (VmHWM) {}",
        mib(idle_rss),
        samples.len(),
        mib(during_min),
        mib(during_max),
        first.map(mib).unwrap_or_else(|| "-".into()),
        last.map(mib).unwrap_or_else(|| "-".into()),
        match (first, last) {
            (Some(f), Some(l)) => format!("{:+.1} MiB", (l as f64 - f as f64) / (1024.0 * 1024.0)),
            _ => "-".into(),
        },
        mib(after_rss),
        mib(peak_rss)
    );
    let trace: Vec<String> = (1..=10)
        .filter_map(|i| {
            tenth((i - 1) as f64 / 10.0, i as f64 / 10.0)
                .map(|r| format!("{:.0}", r as f64 / 1048576.0))
        })
        .collect();
    println!(
        "provider RSS by tenth of the run (max, MiB): {}",
        trace.join(" ")
    );
    if let (Some(a), Some(b)) = (cpu_before, cpu_after) {
        let cpu = b.saturating_sub(a);
        println!(
            "provider CPU: {:.2} s during the run ({:.1} ms per 1000 RPCs, {:.0}% of one core)",
            cpu.as_secs_f64(),
            cpu.as_secs_f64() * 1e6 / latencies.len().max(1) as f64,
            cpu.as_secs_f64() / wall.as_secs_f64() * 100.0
        );
    }
    println!("provider still running after the run: {alive}");
    say(start, "done");
    if !errors.is_empty() || !alive || latencies.len() != total {
        std::process::exit(1);
    }
}
