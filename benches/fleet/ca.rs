//! The real cluster-autoscaler 1.36.1 on the fleet: with this provider over externalgrpc, and A (CA
//! built with the in-tree clusterapi provider). CA's own figures: its loop duration and phases
//! (`cluster_autoscaler_function_duration_seconds`), the apiserver requests of a loop, and the time
//! from a pending pod to the chosen group's replicas being raised.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant, SystemTime};

use kube::Client;
use rand::{Rng as _, SeedableRng as _};

use crate::apf::{self, Identity};
use crate::fleet::{self, Fleet, GROUP_LABEL};
use crate::support::{self, autoscaler, procs, workload};

/// CA's default scan interval, used as is.
pub const SCAN_INTERVAL: Duration = Duration::from_secs(10);
const FUNCTION_METRIC: &str = "cluster_autoscaler_function_duration_seconds";
/// Log lines that mark the start of a CA main loop.
const LOOP_MARKERS: [&str; 2] = ["Autoscaler loop triggered", "Starting main loop"];

/// How CA is run.
pub enum Flavor<'a> {
    /// CA with `--cloud-provider=externalgrpc` against this provider at `address` (its metrics at
    /// `metrics`, when served).
    Ours {
        address: &'a str,
        metrics: Option<&'a str>,
    },
    /// CA with `--cloud-provider=externalgrpc` against the floor at `address`: what CA's loop costs
    /// when every answer is a precomputed constant.
    Floor { address: &'a str },
    /// A: CA with the in-tree clusterapi provider.
    InTree,
}

impl Flavor<'_> {
    fn label(&self) -> &'static str {
        match self {
            Flavor::Ours { .. } => "CA+ours",
            Flavor::Floor { .. } => "CA+floor",
            Flavor::InTree => "CA+A",
        }
    }
}

/// A running CA; killed on drop.
pub struct Ca {
    child: Child,
    pub label: &'static str,
    pub address: String,
    pub log: PathBuf,
}

impl Drop for Ca {
    fn drop(&mut self) {
        procs::kill_and_reap(&mut self.child);
    }
}

/// Starts CA 1.36.1 with its defaults (10 s scan interval), leader election off, the status
/// ConfigMap in the fleet's namespace, and `--scale-down-unneeded-time=1h` so that the empty fleet
/// is not scaled down while it is measured (scale-down is still evaluated every loop).
pub fn start(
    cp: &support::ControlPlane,
    fleet: &Fleet,
    flavor: Flavor<'_>,
    identity: &Identity,
) -> Ca {
    autoscaler::ensure_scheduler(cp);
    let version = "1.36.1";
    let address = format!("127.0.0.1:{}", procs::free_port());
    let (label, binary, mut args) = match flavor {
        Flavor::Ours {
            address: provider, ..
        }
        | Flavor::Floor { address: provider } => {
            let label = flavor.label();
            let config = procs::work_dir().join(format!(
                "cloud-config-{}-{}.yaml",
                label.replace('+', "-"),
                fleet.ns
            ));
            std::fs::write(
                &config,
                format!("address: \"{provider}\"\ngrpc_timeout: \"10s\"\n"),
            )
            .unwrap_or_else(|e| panic!("write {}: {e}", config.display()));
            (
                label,
                autoscaler::binary(version, "externalgrpc"),
                vec![
                    "--cloud-provider=externalgrpc".to_string(),
                    format!("--cloud-config={}", config.display()),
                ],
            )
        }
        Flavor::InTree => (
            flavor.label(),
            autoscaler::binary(version, "clusterapi"),
            vec![
                "--cloud-provider=clusterapi".to_string(),
                format!("--cloud-config={}", identity.kubeconfig().display()),
                format!(
                    "--node-group-auto-discovery=clusterapi:namespace={}",
                    fleet.ns
                ),
            ],
        ),
    };
    args.extend([
        format!("--kubeconfig={}", identity.kubeconfig().display()),
        "--leader-elect=false".into(),
        format!("--namespace={}", fleet.ns),
        format!(
            "--status-config-map-name=cluster-autoscaler-status-{}",
            label.to_lowercase().replace('+', "-")
        ),
        format!("--address={address}"),
        format!("--scan-interval={}s", SCAN_INTERVAL.as_secs()),
        "--scale-down-unneeded-time=1h".into(),
        "--logtostderr=true".into(),
        "--v=4".into(),
    ]);
    // `BENCH_CA_ARGS` (e.g. `--profiling=true`, then /debug/pprof on CA's address) adds flags.
    args.extend(
        std::env::var("BENCH_CA_ARGS")
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string),
    );
    let log = procs::work_dir().join(format!("{}-{}.log", label.replace('+', "-"), fleet.ns));
    let child = procs::spawn_logged(&binary, &args, &log)
        .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
    Ca {
        child,
        label,
        address,
        log,
    }
}

impl Ca {
    fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!(
                "{} exited with {status}:\n{}",
                self.label,
                procs::log_tail(&self.log, 6000)
            )),
            Err(e) => Err(format!("wait for {}: {e}", self.label)),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `function → (sum, count)` of CA's function duration histogram.
    async fn functions(&self) -> BTreeMap<String, (f64, f64)> {
        let text = autoscaler::http_get(&self.address, "/metrics")
            .await
            .unwrap_or_default();
        let sums = by_label(&text, &format!("{FUNCTION_METRIC}_sum"), "function");
        let counts = by_label(&text, &format!("{FUNCTION_METRIC}_count"), "function");
        sums.into_iter()
            .map(|(function, sum)| {
                let count = counts.get(&function).copied().unwrap_or(0.0);
                (function, (sum, count))
            })
            .collect()
    }

    async fn loops_done(&self) -> f64 {
        self.functions()
            .await
            .get("main")
            .map(|(_, count)| *count)
            .unwrap_or(0.0)
    }

    /// Waits until `n` more main loops have finished, at most until `deadline`; how many did.
    async fn wait_loops(&mut self, n: u32, deadline: Instant) -> u32 {
        let start = self.loops_done().await;
        loop {
            if let Err(e) = self.check_alive() {
                panic!("{e}");
            }
            let done = (self.loops_done().await - start).max(0.0) as u32;
            if done >= n || Instant::now() >= deadline {
                return done.min(n);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Start times of CA's main loops, from its log.
    fn loop_starts(&self) -> Vec<SystemTime> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut starts: Vec<SystemTime> = text
            .lines()
            .filter(|l| LOOP_MARKERS.iter().any(|m| l.contains(m)))
            .filter_map(klog_time)
            .collect();
        starts.sort();
        starts
            .dedup_by(|a, b| a.duration_since(*b).unwrap_or_default() < Duration::from_millis(50));
        starts
    }
}

/// The time of a klog line (`Lmmdd hh:mm:ss.uuuuuu ...`), in this year and the system time zone.
fn klog_time(line: &str) -> Option<SystemTime> {
    use k8s_openapi::jiff::{civil, tz::TimeZone};
    let head = line.get(1..21)?;
    let month: i8 = head.get(0..2)?.parse().ok()?;
    let day: i8 = head.get(2..4)?.parse().ok()?;
    let hour: i8 = head.get(5..7)?.parse().ok()?;
    let minute: i8 = head.get(8..10)?.parse().ok()?;
    let second: i8 = head.get(11..13)?.parse().ok()?;
    let micros: i32 = head.get(14..20)?.parse().ok()?;
    let now = k8s_openapi::jiff::Zoned::now();
    let at =
        civil::DateTime::new(now.year(), month, day, hour, minute, second, micros * 1000).ok()?;
    let zoned = at.to_zoned(TimeZone::system()).ok()?;
    let ts = zoned.timestamp();
    Some(SystemTime::UNIX_EPOCH + Duration::from_nanos(u64::try_from(ts.as_nanosecond()).ok()?))
}

/// One pending pod's way to a raised replica count.
#[derive(Clone, Debug)]
pub struct PodRun {
    pub group: String,
    /// When in CA's scan interval it was created: seconds after the end of the loop before.
    pub offset: f64,
    /// Pod created → replicas raised (seconds); `None` when not within the wait.
    pub raised_after: Option<f64>,
    /// How long it was waited for.
    pub waited: f64,
    /// Pod created → start of the first CA loop after it. CA leaves pods younger than 2 s for the
    /// next loop ("Unschedulable pods are very new, waiting one iteration for more"), so a loop
    /// triggered by the pod itself does not scale for it.
    pub first_loop_after: Option<f64>,
    /// Pod created → start of the loop that raised the replicas: CA's next loop that could scale
    /// for the pod.
    pub next_loop_after: Option<f64>,
}

impl PodRun {
    /// Replicas raised − start of the loop that raised them.
    pub fn margin(&self) -> Option<f64> {
        Some(self.raised_after? - self.next_loop_after?)
    }
}

/// What a CA session measured.
#[derive(Clone, Debug, Default)]
pub struct CaRun {
    pub label: &'static str,
    /// Loops measured (after the first one).
    pub loops: u32,
    /// Mean duration of a main loop, seconds.
    pub loop_mean: Option<f64>,
    /// When no loop finished within the budget: how long the first one had run by then.
    pub loop_at_least: Option<f64>,
    /// Non-watch apiserver requests made meanwhile (a lower bound per loop).
    pub requests_at_least: Option<f64>,
    /// Seconds per loop in each function CA times.
    pub phases: BTreeMap<String, f64>,
    /// Non-watch apiserver requests of CA (and of its provider) per loop.
    pub requests_per_loop: Option<f64>,
    /// Calls the provider answered per loop, by method (this provider only, from its metrics).
    pub provider_calls: BTreeMap<String, f64>,
    /// Seconds the provider spent answering per loop (the sum of its call durations).
    pub provider_seconds: Option<f64>,
    pub watches: f64,
    /// Start → end of the first loop.
    pub first_loop: Option<f64>,
    pub pods: Vec<PodRun>,
    pub rss: Option<u64>,
    pub notes: Vec<String>,
}

/// Runs a CA session: the first loop, `loops` steady loops (figures), then `pods` pending pods, each
/// made at a random point of the scan interval for a zero-size group of its own. Everything within
/// `budget`; the fleet is put back (pods deleted, replicas 0) at the end.
#[allow(clippy::too_many_arguments)]
pub async fn session(
    cp: &support::ControlPlane,
    admin: &Client,
    fleet: &Fleet,
    flavor: Flavor<'_>,
    ca_identity: &Identity,
    counted: &[&Identity],
    loops: u32,
    pods: usize,
    budget: Duration,
    seed: u64,
) -> CaRun {
    let started = Instant::now();
    let deadline = started + budget;
    let session_before = apf::counts(admin).await;
    let provider_metrics = match &flavor {
        Flavor::Ours { metrics, .. } => metrics.map(str::to_string),
        Flavor::Floor { .. } | Flavor::InTree => None,
    };
    let mut ca = start(cp, fleet, flavor, ca_identity);
    let mut run = CaRun {
        label: ca.label,
        ..Default::default()
    };
    crate::say(&format!("{}: started (log {})", ca.label, ca.log.display()));
    // The first loop (caches fill, templates computed).
    let metrics_deadline = Instant::now() + Duration::from_secs(120);
    while autoscaler::http_get(&ca.address, "/metrics").await.is_err() {
        if let Err(e) = ca.check_alive() {
            panic!("{e}");
        }
        assert!(
            Instant::now() < metrics_deadline,
            "{} serves no metrics",
            ca.label
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if ca.wait_loops(1, deadline).await == 0 {
        let now = SystemTime::now();
        run.loop_at_least = ca
            .loop_starts()
            .first()
            .and_then(|t| now.duration_since(*t).ok())
            .map(|d| d.as_secs_f64());
        run.requests_at_least = Some(apf::requests(
            &session_before,
            &apf::counts(admin).await,
            counted,
        ));
        run.rss = stats_rss(ca.pid());
        run.notes.push(format!(
            "its first loop did not finish within the budget of {:.0} s ({:.0} s into it, {:.0} apiserver requests so far)",
            budget.as_secs_f64(),
            run.loop_at_least.unwrap_or(0.0),
            run.requests_at_least.unwrap_or(0.0),
        ));
        crate::say(&format!("{}: {}", ca.label, run.notes.join("; ")));
        return run;
    }
    run.first_loop = Some(started.elapsed().as_secs_f64());
    crate::say(&format!(
        "{}: first loop done after {:.1}s",
        ca.label,
        started.elapsed().as_secs_f64()
    ));

    // Steady loops.
    let before = ca.functions().await;
    let requests_before = apf::counts(admin).await;
    let calls_before = provider_calls(provider_metrics.as_deref()).await;
    let done = ca.wait_loops(loops, deadline).await;
    let after = ca.functions().await;
    let requests_after = apf::counts(admin).await;
    let calls_after = provider_calls(provider_metrics.as_deref()).await;
    let main = |m: &BTreeMap<String, (f64, f64)>| m.get("main").copied().unwrap_or_default();
    let loops_seen = main(&after).1 - main(&before).1;
    if loops_seen >= 1.0 {
        run.loops = loops_seen as u32;
        run.loop_mean = Some((main(&after).0 - main(&before).0) / loops_seen);
        for (function, (sum, _)) in &after {
            let previous = before.get(function).map(|v| v.0).unwrap_or(0.0);
            run.phases
                .insert(function.clone(), (sum - previous) / loops_seen);
        }
        run.requests_per_loop =
            Some(apf::requests(&requests_before, &requests_after, counted) / loops_seen);
        run.watches = apf::watches(&requests_before, &requests_after, counted);
        if let (Some(before), Some(after)) = (calls_before, calls_after) {
            run.provider_calls = after
                .calls
                .iter()
                .map(|(method, n)| {
                    let previous = before.calls.get(method).copied().unwrap_or(0.0);
                    (method.clone(), (n - previous) / loops_seen)
                })
                .filter(|(_, n)| *n > 0.0)
                .collect();
            run.provider_seconds = Some((after.seconds - before.seconds) / loops_seen);
        }
    } else {
        // Only the first loop fit in the budget: its figures stand for the loop.
        run.notes.push(format!(
            "{done} steady loops within the budget: the figures are of the first loop"
        ));
        let (sum, count) = main(&before);
        run.loops = count as u32;
        run.loop_mean = Some(sum / count.max(1.0));
        for (function, (sum, _)) in &before {
            run.phases.insert(function.clone(), sum / count.max(1.0));
        }
    }
    run.rss = stats_rss(ca.pid());
    crate::say(&format!(
        "{}: {} steady loops, mean {:.2}s, {:.1} apiserver requests per loop",
        ca.label,
        run.loops,
        run.loop_mean.unwrap_or(f64::NAN),
        run.requests_per_loop.unwrap_or(f64::NAN)
    ));

    // Pending pods, one zero-size group each.
    let client = admin.clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let groups: Vec<&fleet::Group> = fleet.zero_groups().take(pods).collect();
    let mut made = Vec::new();
    for (i, group) in groups.iter().enumerate() {
        if Instant::now() >= deadline {
            run.notes.push(format!(
                "{} of {pods} pods within the budget of {:.0} s",
                run.pods.len(),
                budget.as_secs_f64()
            ));
            break;
        }
        // A random point of the scan interval: after a loop ends, wait U(0, interval).
        ca.wait_loops(1, deadline).await;
        let offset = rng.random_range(0.0..SCAN_INTERVAL.as_secs_f64());
        tokio::time::sleep(Duration::from_secs_f64(offset)).await;
        let name = format!("pending-{}-{i}", ca.label.to_lowercase().replace('+', "-"));
        let spec = workload::PodSpec::new(&name, "1", "1Gi").select(GROUP_LABEL, &group.name);
        let created_at = SystemTime::now();
        let created = Instant::now();
        workload::create_pod(&client, &fleet.ns, &spec).await;
        made.push(name);
        let wait_until = deadline.max(Instant::now() + Duration::from_secs(60));
        let mut raised = None;
        while Instant::now() < wait_until {
            if let Err(e) = ca.check_alive() {
                panic!("{e}");
            }
            if fleet::replicas(&client, &fleet.ns, &group.name)
                .await
                .unwrap_or(0)
                > 0
            {
                raised = Some(created.elapsed().as_secs_f64());
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let waited = created.elapsed().as_secs_f64();
        let since = |t: &SystemTime| t.duration_since(created_at).ok().map(|d| d.as_secs_f64());
        let starts = ca.loop_starts();
        let first_loop_after = starts.iter().find(|t| **t >= created_at).and_then(since);
        let next_loop_after = raised.and_then(|r| {
            starts
                .iter()
                .filter_map(since)
                .filter(|s| *s <= r)
                .reduce(f64::max)
        });
        let pod = PodRun {
            group: group.id.clone(),
            offset,
            raised_after: raised,
            waited,
            first_loop_after,
            next_loop_after,
        };
        crate::say(&format!(
            "{}: pod {} → {} raised after {} (waited {:.1}s; first loop after {}, the loop that scaled after {})",
            ca.label,
            i + 1,
            group.name,
            secs(pod.raised_after),
            pod.waited,
            secs(pod.first_loop_after),
            secs(pod.next_loop_after)
        ));
        run.pods.push(pod);
    }
    drop(ca);
    for name in made {
        workload::delete_pod(&client, &fleet.ns, &name).await;
    }
    for group in groups {
        fleet::set_replicas(&client, &fleet.ns, &group.name, 0).await;
    }
    run
}

/// The provider's answered calls by method and the sum of their durations, from its metrics.
struct ProviderCalls {
    calls: BTreeMap<String, f64>,
    seconds: f64,
}

async fn provider_calls(metrics: Option<&str>) -> Option<ProviderCalls> {
    let text = autoscaler::http_get(metrics?, "/metrics").await.ok()?;
    Some(ProviderCalls {
        calls: by_label(
            &text,
            "capi_autoscaler_provider_grpc_requests_total",
            "method",
        ),
        seconds: autoscaler::metric_sum(
            &text,
            "capi_autoscaler_provider_grpc_request_duration_seconds_sum",
            &[],
        ),
    })
}

/// The values of the series `metric{…}` in Prometheus text, summed by the value of one label.
fn by_label(text: &str, metric: &str, label: &str) -> BTreeMap<String, f64> {
    let prefix = format!("{metric}{{");
    let mut out: BTreeMap<String, f64> = BTreeMap::new();
    for line in text.lines() {
        let Some((labels, value)) = line
            .strip_prefix(&prefix)
            .and_then(|rest| rest.rsplit_once(' '))
        else {
            continue;
        };
        let (Some(key), Ok(value)) = (
            support::capi::label_of(labels.trim_end_matches('}'), label),
            value.trim().parse::<f64>(),
        ) else {
            continue;
        };
        *out.entry(key.to_string()).or_default() += value;
    }
    out
}

fn secs(v: Option<f64>) -> String {
    v.map(|s| format!("{s:.2}s")).unwrap_or_else(|| "—".into())
}

fn stats_rss(pid: u32) -> Option<u64> {
    crate::stats::rss_of(pid).map(|(rss, _)| rss)
}
