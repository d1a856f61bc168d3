//! `make bench`: this provider measured against upstream's in-tree clusterapi provider and against a
//! floor, on a fleet of real API objects, in one run.
//!
//! For each size (Machines / MachineDeployment groups) a fleet is created on the test control plane
//! (etcd + kube-apiserver + Cluster API CRDs, `tests/support`): N Machines with Ready Nodes over G
//! MachineDeployments with their MachineSets, ~10% of the groups at zero replicas, ~5% more Nodes in no
//! group. Then, against the same fleet:
//!
//! - start → ready and resident memory of each server: this provider (its release binary), W
//!   (upstream's example externalgrpc server around the in-tree provider) and the floor (a server in
//!   this process answering precomputed constants);
//! - a replay of one CA 1.36 loop over gRPC against each, in rounds whose order rotates so that noise
//!   falls on all alike: per-RPC latency, loop time, apiserver requests per loop (APF flow schemas per
//!   identity); W is sampled where whole loops would take too long;
//! - the real CA 1.36.1 with this provider, with the floor, and A (CA with the in-tree provider): CA's
//!   loop and phases, apiserver requests per loop, the calls it makes to this provider, pending pod →
//!   replicas raised;
//! - write latency: IncreaseSize and DeleteNodes, call → visible in the API.
//!
//! Prints one table (also `target/bench/fleet.md`) and writes `target/bench/fleet.json`.
//!
//! Environment (all optional): `BENCH_SIZES` (`1000/100,10000/1000,100000/10000`), `BENCH_COMPARE_UP_TO`
//! (largest size with W and A, 10000), `BENCH_ROUNDS` (3), `BENCH_W_ROUNDS` (rounds W joins: 3 up to
//! 1,000 Machines, else 1), `BENCH_W_BUDGET` (seconds per RPC kind per W round, 20), `BENCH_CA_LOOPS`
//! (3), `BENCH_CA_PODS` (5), `BENCH_CA_BUDGET` (seconds for CA with this provider, 900),
//! `BENCH_A_BUDGET` (seconds for A: 3600 up to 1,000 Machines, 1800 above), `BENCH_WRITES` (samples
//! per kind, 50), `BENCH_W_WRITE_BUDGET` (seconds, 300), `BENCH_SKIP` (`w`, `a`, `ca`, `ca-floor`,
//! `writes`), `BENCH_CA_ARGS` (more flags for CA), `BENCH_STARTS` (starts of this provider measured
//! one after the other on each fleet, 3: the figure is their median), `BENCH_HOLD` (a file: after
//! those starts, the fleet's namespace and a kubeconfig for it are written there and the run waits
//! until the file is removed, at most an hour, for experiments by hand on the fleet).

#[path = "../../tests/support/mod.rs"]
pub mod support;

mod apf;
mod ca;
mod fleet;
mod replay;
mod report;
mod servers;
mod stats;
mod writes;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kube::Client;

use crate::apf::Identity;
use crate::fleet::Fleet;
use crate::replay::{LoopRun, Mode, Plan};
use crate::servers::Target;
use crate::stats::Samples;

/// Progress on stderr, with the time since the start.
pub fn say(text: &str) {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = START.get_or_init(Instant::now);
    eprintln!("[{:>7.1}s] {text}", start.elapsed().as_secs_f64());
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// What to run.
#[derive(Clone, Debug)]
struct Options {
    sizes: Vec<(usize, usize)>,
    compare_up_to: usize,
    rounds: usize,
    w_rounds: Option<usize>,
    w_budget: Duration,
    ca_loops: u32,
    ca_pods: usize,
    ca_budget: Duration,
    /// A's budget per size: (up to 1,000 Machines, above).
    a_budget: (Duration, Duration),
    writes: usize,
    w_write_budget: Duration,
    skip: BTreeSet<String>,
    starts: usize,
}

impl Options {
    fn from_env() -> Options {
        let sizes = std::env::var("BENCH_SIZES")
            .unwrap_or_else(|_| "1000/100,10000/1000,100000/10000".into())
            .split(',')
            .filter_map(|s| {
                let (n, g) = s.trim().split_once('/')?;
                Some((n.trim().parse().ok()?, g.trim().parse().ok()?))
            })
            .collect();
        Options {
            sizes,
            compare_up_to: env_or("BENCH_COMPARE_UP_TO", 10_000),
            rounds: env_or("BENCH_ROUNDS", 3usize).max(1),
            w_rounds: std::env::var("BENCH_W_ROUNDS")
                .ok()
                .and_then(|v| v.parse().ok()),
            w_budget: Duration::from_secs(env_or("BENCH_W_BUDGET", 20)),
            ca_loops: env_or("BENCH_CA_LOOPS", 3),
            ca_pods: env_or("BENCH_CA_PODS", 5),
            ca_budget: Duration::from_secs(env_or("BENCH_CA_BUDGET", 900)),
            a_budget: match std::env::var("BENCH_A_BUDGET")
                .ok()
                .and_then(|v| v.parse().ok())
            {
                Some(secs) => (Duration::from_secs(secs), Duration::from_secs(secs)),
                None => (Duration::from_secs(3600), Duration::from_secs(1800)),
            },
            writes: env_or("BENCH_WRITES", 50),
            w_write_budget: Duration::from_secs(env_or("BENCH_W_WRITE_BUDGET", 300)),
            skip: std::env::var("BENCH_SKIP")
                .unwrap_or_default()
                .split(',')
                .map(|s| s.trim().to_lowercase())
                .filter(|s| !s.is_empty())
                .collect(),
            starts: env_or("BENCH_STARTS", 3usize).max(1),
        }
    }

    fn runs(&self, what: &str, machines: usize) -> bool {
        !self.skip.contains(what) && (machines <= self.compare_up_to || what == "writes")
    }
}

/// The identities of the programs under test (each counted apart by the apiserver).
struct Identities {
    ours: Identity,
    ca: Identity,
    a: Identity,
    w_mgmt: Identity,
    w_workload: Identity,
    in_cluster: std::path::PathBuf,
}

/// Everything measured of one server at one size.
#[derive(Debug, Default)]
pub struct ServerFigures {
    pub loops: Vec<LoopRun>,
    /// Non-watch apiserver requests of each replayed loop.
    pub requests: Samples,
    pub watches: f64,
    /// Start → ready: the median of `starts`.
    pub ready_after: Option<f64>,
    /// Each start measured (this provider): seconds to ready and the CPU seconds it used by then.
    pub starts: Vec<(f64, Option<f64>)>,
    /// Right after ready.
    pub rss_ready: Option<(u64, u64)>,
    /// After the replay rounds.
    pub rss_steady: Option<(u64, u64)>,
    /// Mean and count of full-fleet snapshot builds (this provider).
    pub snapshot_build: Option<(f64, f64)>,
    pub writes: Option<writes::WriteRun>,
}

fn latency_in<'a>(loops: impl Iterator<Item = &'a LoopRun>, kind: &str) -> Samples {
    let mut all = Samples::default();
    for l in loops {
        if let Some(s) = l.latency.get(kind) {
            all.extend(s);
        }
    }
    all
}

impl ServerFigures {
    /// The latencies of `kind` over every loop.
    pub fn latency(&self, kind: &str) -> Samples {
        latency_in(self.loops.iter(), kind)
    }

    /// The latencies of `kind` over the quiet loops ([`ServerFigures::quiet_loops`]): the calls of a
    /// loop an API server burst landed on are faster, for either server.
    pub fn quiet_latency(&self, kind: &str) -> Samples {
        latency_in(self.quiet_loops(), kind)
    }

    pub fn loop_times(&self) -> Samples {
        Samples(self.loops.iter().map(|l| l.wall.as_secs_f64()).collect())
    }

    /// The whole loops during which every other process together used less than a tenth of a core.
    /// At 100,000 Machines the API server (a heap of about 13 GiB) spends 5–13 CPU seconds every few
    /// minutes with no request from either server, most likely collecting its heap. The loops it lands
    /// on are two to three times faster for both servers (likely because the replay client and the
    /// server then share a core instead of waking an idle one for each call), so which loops it hits
    /// decides a median over a few rounds.
    pub fn quiet_loops(&self) -> impl Iterator<Item = &LoopRun> {
        self.whole_loops()
            .filter(|l| l.others_cpu.is_some_and(|c| c < 0.1 * l.wall.as_secs_f64()))
    }

    /// The loops replayed whole: a sampled loop's CPU is of a different amount of work.
    pub fn whole_loops(&self) -> impl Iterator<Item = &LoopRun> {
        self.loops.iter().filter(|l| !l.estimated)
    }

    pub fn quiet_loop_times(&self) -> Samples {
        Samples(self.quiet_loops().map(|l| l.wall.as_secs_f64()).collect())
    }

    pub fn estimated(&self) -> bool {
        self.loops.iter().any(|l| l.estimated)
    }

    pub fn errors(&self) -> BTreeMap<&'static str, usize> {
        let mut out = BTreeMap::new();
        for l in &self.loops {
            for (k, n) in &l.errors {
                *out.entry(*k).or_insert(0) += n;
            }
        }
        out
    }
}

/// Everything measured at one size.
#[derive(Debug, Default)]
pub struct SizeResult {
    pub machines: usize,
    pub groups: usize,
    pub zero_groups: usize,
    pub nodes: usize,
    pub fleet_seconds: f64,
    pub objects: usize,
    pub servers: BTreeMap<&'static str, ServerFigures>,
    pub ca: BTreeMap<&'static str, ca::CaRun>,
    pub notes: Vec<String>,
}

fn main() {
    if let Ok(plan) = std::env::var(servers::FLOOR_PLAN_ENV) {
        servers::floor_main(&plan);
        return;
    }
    let options = Options::from_env();
    say(&format!("options: {options:?}"));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("tokio runtime: {e}"));
    let results = runtime.block_on(run(&options));
    let machine = report::Machine::describe();
    let table = report::table(&results, &options_text(&options), &machine);
    println!("{table}");
    let json = report::json(&results, &options_text(&options), &machine);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    for (file, text) in [
        (
            "fleet.json",
            serde_json::to_string_pretty(&json).unwrap_or_default(),
        ),
        ("fleet.md", table),
    ] {
        let path = dir.join(file);
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        say(&format!("wrote {}", path.display()));
    }
}

fn options_text(o: &Options) -> String {
    format!(
        "sizes {:?}, rounds {}, W budget {} s per RPC kind, CA {} loops and {} pods within {} s (A: {} s up to 1,000 Machines, {} s above), {} write samples, {} starts of this provider",
        o.sizes,
        o.rounds,
        o.w_budget.as_secs(),
        o.ca_loops,
        o.ca_pods,
        o.ca_budget.as_secs(),
        o.a_budget.0.as_secs(),
        o.a_budget.1.as_secs(),
        o.writes,
        o.starts
    )
}

async fn run(options: &Options) -> Vec<SizeResult> {
    let cp = support::control_plane(support::Setup::shipped().without_cache_consistency_checks());
    let admin = cp.admin_client().await;
    let system_ns = cp.fresh_namespace().await;
    let ids = Identities {
        ours: apf::user(cp, "ours").await,
        ca: apf::user(cp, "ca").await,
        a: apf::user(cp, "a").await,
        w_mgmt: apf::user(cp, "w").await,
        w_workload: apf::service_account(cp, &system_ns, "w-workload").await,
        in_cluster: std::path::PathBuf::new(),
    };
    let ids = Identities {
        in_cluster: apf::write_in_cluster_files(cp, &ids.w_workload),
        ..ids
    };
    for identity in [&ids.ours, &ids.ca, &ids.a, &ids.w_mgmt, &ids.w_workload] {
        apf::wait_counted(&admin, identity).await;
    }
    say("identities and APF flow schemas in effect");
    let mut results = Vec::new();
    let last = options.sizes.len().saturating_sub(1);
    for (i, &(machines, groups)) in options.sizes.iter().enumerate() {
        let result = size(cp, &admin, &ids, options, machines, groups, i == last).await;
        results.push(result);
    }
    results
}

/// Keeps the fleet while `file` exists (at most an hour), after writing into it how to reach it.
async fn hold_fleet(file: &Path, fleet: &Fleet, identity: &Identity) {
    let text = format!(
        "namespace={}\nkubeconfig={}\n",
        fleet.ns,
        identity.kubeconfig().display()
    );
    std::fs::write(file, text).unwrap_or_else(|e| panic!("write {}: {e}", file.display()));
    say(&format!(
        "holding the fleet until {} is removed",
        file.display()
    ));
    let deadline = Instant::now() + Duration::from_secs(3600);
    while file.exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn size(
    cp: &support::ControlPlane,
    admin: &Client,
    ids: &Identities,
    options: &Options,
    machines: usize,
    groups: usize,
    last: bool,
) -> SizeResult {
    let ns = cp.fresh_namespace().await;
    let mut fleet = Fleet::plan(&ns, machines, groups);
    say(&format!(
        "size {machines}/{groups}: creating the fleet in {ns} ({} Nodes)",
        fleet.nodes.len()
    ));
    fleet.create(admin).await;
    let counted = fleet::count_machines(admin, &ns).await;
    assert_eq!(counted, machines, "Machines in {ns}");
    say(&format!(
        "fleet: {} objects in {:.1}s ({:.0}/s)",
        fleet.objects,
        fleet.created_in.as_secs_f64(),
        fleet.objects as f64 / fleet.created_in.as_secs_f64()
    ));
    let mut result = SizeResult {
        machines,
        groups,
        zero_groups: fleet.zero_groups().count(),
        nodes: fleet.nodes.len(),
        fleet_seconds: fleet.created_in.as_secs_f64(),
        objects: fleet.objects,
        ..Default::default()
    };
    let with_w = options.runs("w", machines);
    let with_ca = options.runs("ca", machines);

    // Start → ready, several starts one after the other (the last one stays for what follows), and
    // resident memory after sync.
    let mut starts = Vec::new();
    let mut ours = loop {
        let (mut target, spawned) = servers::spawn_ours(&fleet, &ids.ours);
        target
            .wait_ready(&fleet, spawned, Duration::from_secs(900))
            .await;
        let ready = target.ready_after.map_or(f64::NAN, |d| d.as_secs_f64());
        let cpu = target.cpu();
        say(&format!(
            "ours start {}: ready after {ready:.2}s, {:.2} CPU seconds",
            starts.len() + 1,
            cpu.unwrap_or(f64::NAN)
        ));
        starts.push((ready, cpu));
        if starts.len() >= options.starts {
            break target;
        }
    };
    if let Ok(hold) = std::env::var("BENCH_HOLD") {
        hold_fleet(Path::new(&hold), &fleet, &ids.ours).await;
    }
    let mut ours_figures = ServerFigures {
        ready_after: Samples(starts.iter().map(|s| s.0).collect()).p50(),
        starts,
        rss_ready: ours.rss(),
        ..Default::default()
    };
    say(&format!(
        "ours ready after {:.2}s (median), RSS {}",
        ours_figures.ready_after.unwrap_or(f64::NAN),
        report::mib(ours_figures.rss_ready.map(|r| r.0))
    ));
    let (mut floor, spawned) = servers::spawn_floor(&fleet);
    floor
        .wait_ready(&fleet, spawned, Duration::from_secs(60))
        .await;
    let mut floor_figures = ServerFigures {
        ready_after: floor.ready_after.map(|d| d.as_secs_f64()),
        rss_ready: floor.rss(),
        ..Default::default()
    };
    let mut w = None;
    let mut w_figures = ServerFigures::default();
    if with_w {
        let (mut target, spawned) =
            servers::spawn_w(cp, &fleet, &ids.w_mgmt, &ids.w_workload, &ids.in_cluster);
        say(&format!("W: started (log {:?})", target.log));
        target
            .wait_ready(&fleet, spawned, Duration::from_secs(7200))
            .await;
        w_figures.ready_after = target.ready_after.map(|d| d.as_secs_f64());
        w_figures.rss_ready = target.rss();
        say(&format!(
            "W ready after {:.1}s, RSS {}",
            w_figures.ready_after.unwrap_or(f64::NAN),
            report::mib(w_figures.rss_ready.map(|r| r.0))
        ));
        w = Some(target);
    }

    // Snapshot builds of the whole fleet: a touched MachineDeployment makes the provider rebuild.
    ours_figures.snapshot_build = snapshot_builds(admin, &fleet, &ours).await;

    // Replay rounds.
    let plan = Plan::new(&fleet);
    let w_rounds = options
        .w_rounds
        .unwrap_or(if machines <= 1000 { options.rounds } else { 1 });
    // Whole loops of the fast servers are interleaved one by one within a round, about 2 s of them.
    let per_round = ((2.0 / (fleet.nodes.len() as f64 * 100e-6)).ceil() as usize).clamp(1, 10);
    for round in 0..options.rounds {
        let mut order: Vec<&'static str> = vec!["ours", "floor", "W"];
        order.rotate_left(round % 3);
        for name in order {
            match name {
                "W" => {
                    if let Some(w) = w.as_mut().filter(|_| round < w_rounds) {
                        let mode = Mode::Sampled {
                            budget: options.w_budget,
                            max: 200,
                        };
                        replay_once(admin, &plan, w, &mut w_figures, mode, round).await;
                    }
                }
                "ours" => {
                    for k in 0..per_round {
                        let mut pair = [
                            (&mut ours, &mut ours_figures),
                            (&mut floor, &mut floor_figures),
                        ];
                        // Who goes first alternates across rounds too: at 100,000 Machines a round
                        // holds one loop of each.
                        if (k + round) % 2 == 1 {
                            pair.reverse();
                        }
                        for (target, figures) in pair {
                            replay_once(admin, &plan, target, figures, Mode::Whole, round).await;
                        }
                    }
                }
                _ => {}
            }
        }
    }
    say(&format!(
        "replay: ours median loop {:.3}s, floor {:.3}s",
        ours_figures.loop_times().p50().unwrap_or(f64::NAN),
        floor_figures.loop_times().p50().unwrap_or(f64::NAN)
    ));
    floor_figures.rss_steady = floor.rss();
    ours_figures.rss_steady = ours.rss();
    if let Some(w) = &w {
        w_figures.rss_steady = w.rss();
    }

    // The real CA with this provider, with the floor, then with the in-tree provider.
    if with_ca {
        let counted = [&ids.ca, &ids.ours];
        let run = ca::session(
            cp,
            admin,
            &fleet,
            ca::Flavor::Ours {
                address: &ours.address,
                metrics: ours.metrics_address.as_deref(),
            },
            &ids.ca,
            &counted,
            options.ca_loops,
            options.ca_pods,
            options.ca_budget,
            machines as u64,
        )
        .await;
        result.ca.insert("ours", run);
        // The same CA against the floor: its loop when every answer costs nothing but the call.
        // The floor changes nothing, so it gets no pods.
        if !options.skip.contains("ca-floor") {
            let run = ca::session(
                cp,
                admin,
                &fleet,
                ca::Flavor::Floor {
                    address: &floor.address,
                },
                &ids.ca,
                &[&ids.ca],
                options.ca_loops,
                0,
                options.ca_budget,
                machines as u64 + 2,
            )
            .await;
            result.ca.insert("floor", run);
        }
        if !options.skip.contains("a") {
            let run = ca::session(
                cp,
                admin,
                &fleet,
                ca::Flavor::InTree,
                &ids.a,
                &[&ids.a],
                // A's loops take minutes: fewer of them leave its budget some time for pods.
                options.ca_loops.min(2),
                options.ca_pods,
                if machines <= 1000 {
                    options.a_budget.0
                } else {
                    options.a_budget.1
                },
                machines as u64 + 1,
            )
            .await;
            result.ca.insert("A", run);
        }
    }

    // Write latency, ours and W alternating, each sample on a group of its own.
    if options.runs("writes", machines) {
        let (ours_writes, w_writes) =
            measure_writes(admin, &fleet, &ours, w.as_ref(), options).await;
        ours_figures.writes = Some(ours_writes);
        if w.is_some() {
            w_figures.writes = Some(w_writes);
        }
    }
    if let Err(e) = ours.check_alive() {
        panic!("{e}");
    }
    result.servers.insert("ours", ours_figures);
    result.servers.insert("floor", floor_figures);
    if w.is_some() {
        result.servers.insert("W", w_figures);
    }
    drop(ours);
    drop(w);
    drop(floor);
    if !last {
        say(&format!("removing the fleet of {ns}"));
        fleet.delete(admin).await;
    }
    result
}

/// Replays one loop against `target`, counting the apiserver requests of its identities meanwhile.
async fn replay_once(
    admin: &Client,
    plan: &Plan,
    target: &mut Target,
    figures: &mut ServerFigures,
    mode: Mode,
    round: usize,
) {
    let timeout = match mode {
        Mode::Whole => Duration::from_secs(120),
        Mode::Sampled { .. } => Duration::from_secs(7200),
    };
    let mut client = target.client(timeout).await;
    let identities: Vec<Identity> = target.identities.clone();
    let identities: Vec<&Identity> = identities.iter().collect();
    let before = apf::counts(admin).await;
    let cpu_before = stats::cpu_by_process();
    let mut run = replay::run(
        &mut client,
        plan,
        mode,
        round as u64 + figures.loops.len() as u64,
    )
    .await;
    let cpu_after = stats::cpu_by_process();
    if let Some(pid) = target.pid() {
        run.server_cpu = cpu_after
            .get(&pid)
            .zip(cpu_before.get(&pid))
            .map(|(a, b)| a - b);
        let except = [pid, std::process::id()];
        let others = stats::cpu_of_others(&cpu_before, &cpu_after, &except);
        run.others_cpu = Some(others.iter().map(|(_, seconds)| seconds).sum());
        say(&format!(
            "round {}: {} loop {:.3}s, its CPU {:.2}s; others {}",
            round + 1,
            target.name,
            run.wall.as_secs_f64(),
            run.server_cpu.unwrap_or(f64::NAN),
            // Every loop: which neighbour took the time when a loop is slow.
            others
                .iter()
                .take(3)
                .map(|&(pid, seconds)| format!("{} {seconds:.2}s", stats::process_name(pid)))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let after = apf::counts(admin).await;
    if let Err(e) = target.check_alive() {
        panic!("{e}");
    }
    if !identities.is_empty() {
        figures
            .requests
            .0
            .push(apf::requests(&before, &after, &identities));
        figures.watches += apf::watches(&before, &after, &identities);
    }
    if matches!(mode, Mode::Sampled { .. }) || figures.loops.is_empty() {
        say(&format!(
            "round {}: {} loop {:.3}s{} ({:.1}s spent), {} apiserver requests",
            round + 1,
            target.name,
            run.wall.as_secs_f64(),
            if run.estimated { " (estimated)" } else { "" },
            run.spent.as_secs_f64(),
            figures.requests.0.last().copied().unwrap_or(0.0)
        ));
    }
    figures.loops.push(run);
}

/// Touches a MachineDeployment five times (each a full rebuild of the provider's snapshot) and reads
/// the mean build time from the provider's metrics.
async fn snapshot_builds(admin: &Client, fleet: &Fleet, ours: &Target) -> Option<(f64, f64)> {
    let address = ours.metrics_address.as_deref()?;
    let read = || async {
        let text = support::autoscaler::http_get(address, "/metrics")
            .await
            .unwrap_or_default();
        let sum = support::autoscaler::metric_sum(
            &text,
            "capi_autoscaler_provider_snapshot_build_duration_seconds_sum",
            &[],
        );
        let count = support::autoscaler::metric_sum(
            &text,
            "capi_autoscaler_provider_snapshot_build_duration_seconds_count",
            &[],
        );
        (sum, count)
    };
    let group = fleet.groups.first()?;
    let before = read().await;
    for i in 0..5 {
        fleet::touch(admin, &fleet.ns, &group.name, &i.to_string()).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let after = read().await;
        if after.1 - before.1 >= 5.0 || Instant::now() >= deadline {
            let count = after.1 - before.1;
            return (count > 0.0).then(|| ((after.0 - before.0) / count, count));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn measure_writes(
    admin: &Client,
    fleet: &Fleet,
    ours: &Target,
    w: Option<&Target>,
    options: &Options,
) -> (writes::WriteRun, writes::WriteRun) {
    let mut ours_run = writes::WriteRun::default();
    let mut w_run = writes::WriteRun::default();
    let mut ours_client = ours.client(Duration::from_secs(60)).await;
    let mut w_client = match w {
        Some(w) => Some(w.client(Duration::from_secs(7200)).await),
        None => None,
    };
    // Groups with room to shrink (replicas ≥ 2 > min 1): the even ones for this provider, the odd
    // ones for W; of each server's, the first half is raised (round-robin), the second half each
    // loses one Node, once. No Cluster API controller runs here: a raise never gets its Machine and
    // a mark is never acted on, so a DeleteNodes on a group raised or marked before is (rightly)
    // refused until Cluster API acts. DeleteNodes samples are therefore at most half the groups.
    let filled: Vec<&fleet::Group> = fleet.groups.iter().filter(|g| g.replicas >= 2).collect();
    for i in 0..options.writes {
        for (parity, server) in [(0, "ours"), (1, "W")] {
            let (client, run) = match server {
                "ours" => (&mut ours_client, &mut ours_run),
                _ => match w_client.as_mut() {
                    Some(c)
                        if w_run.spent < options.w_write_budget || w_run.increase.is_empty() =>
                    {
                        (c, &mut w_run)
                    }
                    _ => continue,
                },
            };
            let mine: Vec<usize> = (parity..filled.len()).step_by(2).collect();
            let (raised, shrunk) = mine.split_at(mine.len() / 2);
            if raised.is_empty() {
                continue;
            }
            writes::increase(admin, client, fleet, filled[raised[i % raised.len()]], run).await;
            // Keep every group above its min.
            if let Some(&slot) = shrunk.get(i)
                && filled[slot].replicas - filled[slot].min > 1
            {
                writes::delete(admin, client, fleet, filled[slot], 0, run).await;
            }
        }
        if i % 10 == 9 {
            say(&format!("writes: {} samples each", i + 1));
        }
    }
    say(&format!(
        "writes: ours IncreaseSize p99 {} DeleteNodes p99 {}; failures {:?} {:?}",
        report::ms(ours_run.increase.p99()),
        report::ms(ours_run.delete.p99()),
        ours_run.failures,
        w_run.failures
    ));
    (ours_run, w_run)
}
