//! Prometheus metrics: RPCs, API writes, watches, snapshot builds, node groups and problems.
//! deploy/monitoring/ (alerts, dashboard) uses these names; tests/monitoring.rs checks it uses no other.

use std::sync::OnceLock;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Metric, Registry};

use crate::problem::ProblemKind;
use crate::proto::METHODS;
use crate::snapshot::{NotServed, Snapshot};
use crate::version;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    pub method: &'static str,
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    pub method: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WatchLabels {
    pub resource: &'static str,
    pub event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    pub resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectLabels {
    pub method: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GroupLabels {
    pub node_group: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    pub operation: &'static str,
    pub outcome: &'static str,
}

/// The `operation` of every write to the management cluster (`api_writes_total`,
/// `api_write_duration_seconds`); `repair-unmark` counts the marks the repair took back.
pub const WRITE_OPERATIONS: [&str; 6] = [
    "increase-size",
    "decrease-target-size",
    "delete-nodes",
    "mark-machine",
    "unmark-machine",
    "repair-record",
];

pub struct Metrics {
    registry: Registry,
    calls: Calls,
    writes: Writes,
    watches: Watches,
    groups: Groups,
}

/// CA's calls: how each was answered and how long it took, those a limit refused, the TLS files
/// they are served with.
struct Calls {
    requests: Family<RpcLabels, Counter>,
    seconds: Family<MethodLabels, Histogram>,
    /// Per method of [`METHODS`], its OK count and its latency, taken from the families when first
    /// needed: CA makes one call per node every loop, and a family lookup hashes its labels.
    answered: [MethodHandles; METHODS.len()],
    rejected: Family<RejectLabels, Counter>,
    tls_reloads: Family<OutcomeLabels, Counter>,
}

/// One method's series in [`Calls`], as handles.
#[derive(Default)]
struct MethodHandles {
    ok: OnceLock<Counter>,
    latency: OnceLock<Histogram>,
}

/// Writes to the management cluster.
struct Writes {
    count: Family<WriteLabels, Counter>,
    seconds: Family<WriteLabels, Histogram>,
}

/// The watches and the snapshots built from them.
struct Watches {
    events: Family<WatchLabels, Counter>,
    stale: Family<ResourceLabels, Gauge<f64, AtomicU64>>,
    stale_after: Gauge<f64, AtomicU64>,
    snapshot_seconds: Histogram,
}

/// What is served: the groups, their sizes, the candidates not served, the problems, readiness.
struct Groups {
    served: Gauge,
    target: Family<GroupLabels, Gauge>,
    min: Family<GroupLabels, Gauge>,
    max: Family<GroupLabels, Gauge>,
    not_served: Family<ReasonLabels, Gauge>,
    machines: Gauge,
    problems: Family<KindLabels, Gauge>,
    ready: Gauge,
}

/// `metric` registered under `name`, and the handle to update it by.
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Calls {
    fn register(registry: &mut Registry) -> Self {
        let calls = Calls {
            requests: registered(
                registry,
                "grpc_requests",
                "externalgrpc calls by method and status code",
                Family::default(),
            ),
            seconds: registered(
                registry,
                "grpc_request_duration_seconds",
                "externalgrpc call latency",
                Family::new_with_constructor(|| {
                    Histogram::new(exponential_buckets(0.000_01, 4.0, 12))
                }),
            ),
            answered: Default::default(),
            rejected: registered(
                registry,
                "grpc_rejected",
                "CloudProvider calls refused by a limit (message size, decoded size, concurrency, timeout)",
                Family::default(),
            ),
            tls_reloads: registered(
                registry,
                "tls_reloads",
                "TLS certificate, key and client CA files read again after they changed, by outcome",
                Family::default(),
            ),
        };
        for outcome in ["success", "error"] {
            calls
                .tls_reloads
                .get_or_create(&OutcomeLabels { outcome })
                .get();
        }
        calls
    }
}

impl Writes {
    fn register(registry: &mut Registry) -> Self {
        let writes = Writes {
            count: registered(
                registry,
                "api_writes",
                "writes to the management cluster by operation and outcome",
                Family::default(),
            ),
            // From 1 ms (a write on a quiet local API server) to about 65 s (past every retry).
            seconds: registered(
                registry,
                "api_write_duration_seconds",
                "latency of each write to the management cluster by operation and outcome",
                Family::new_with_constructor(|| {
                    Histogram::new(exponential_buckets(0.001, 2.0, 17))
                }),
            ),
        };
        // Every label value from the start, so a rule sees 0 rather than no series (and
        // `increase()` sees the first write, repair or failure as one).
        for operation in WRITE_OPERATIONS {
            for outcome in ["ok", "conflict", "error"] {
                writes
                    .count
                    .get_or_create(&WriteLabels { operation, outcome })
                    .get();
            }
        }
        writes.count.get_or_create(&REPAIR_UNMARK).get();
        writes
    }
}

impl Watches {
    fn register(registry: &mut Registry) -> Self {
        Watches {
            events: registered(
                registry,
                "watch_events",
                "watch events by resource and kind of event",
                Family::default(),
            ),
            stale: registered(
                registry,
                "watch_stale_seconds",
                "how long each watch has been failing (or, before its first list, waiting); 0 while it is in sync",
                Family::default(),
            ),
            // The threshold the provider itself turns not ready at, for the alert on the series above.
            stale_after: registered(
                registry,
                "watch_stale_after_seconds",
                "--watch-stale-after: how long a watch may fail before the provider stops serving",
                Gauge::default(),
            ),
            snapshot_seconds: registered(
                registry,
                "snapshot_build_duration_seconds",
                "time to build a snapshot",
                Histogram::new(exponential_buckets(0.000_1, 4.0, 10)),
            ),
        }
    }
}

impl Groups {
    fn register(registry: &mut Registry) -> Self {
        let groups = Groups {
            served: registered(
                registry,
                "node_groups",
                "node groups served",
                Gauge::default(),
            ),
            // Per served group, by the id CA knows it by (CA's own node_group label).
            target: registered(
                registry,
                "node_group_target_size",
                "target size (spec.replicas) of each node group served",
                Family::default(),
            ),
            min: registered(
                registry,
                "node_group_min_size",
                "configured min size of each node group served",
                Family::default(),
            ),
            max: registered(
                registry,
                "node_group_max_size",
                "max size of each node group served",
                Family::default(),
            ),
            not_served: registered(
                registry,
                "node_groups_not_served",
                "candidate node groups not served (`check`'s NOT SERVED) by reason",
                Family::default(),
            ),
            machines: registered(registry, "machines", "Machines cached", Gauge::default()),
            problems: registered(
                registry,
                "problems",
                "problems found in the Cluster API objects (see `check`) by kind",
                Family::default(),
            ),
            ready: registered(
                registry,
                "ready",
                "1 while /readyz answers 200 (every watch in sync, some group served), else 0",
                Gauge::default(),
            ),
        };
        for kind in ProblemKind::ALL {
            groups
                .problems
                .get_or_create(&KindLabels { kind: kind.label() })
                .set(0);
        }
        for reason in NotServed::ALL {
            groups
                .not_served
                .get_or_create(&ReasonLabels {
                    reason: reason.label(),
                })
                .set(0);
        }
        groups
    }
}

/// The marks the repair took back: `api_writes_total{operation="repair-unmark"}` (their requests
/// are counted as `unmark-machine`).
const REPAIR_UNMARK: WriteLabels = WriteLabels {
    operation: "repair-unmark",
    outcome: "ok",
};

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("capi_autoscaler_provider");
        // `capi_autoscaler_provider_build_info{version,commit} 1`: which build is running, joinable
        // with the other series on the pod's labels.
        registry.register(
            "build",
            "version and git commit of the running binary",
            Info::new(vec![
                ("version", version::VERSION),
                ("commit", version::COMMIT),
            ]),
        );
        let calls = Calls::register(&mut registry);
        let writes = Writes::register(&mut registry);
        let watches = Watches::register(&mut registry);
        let groups = Groups::register(&mut registry);
        Metrics {
            registry,
            calls,
            writes,
            watches,
            groups,
        }
    }

    pub fn rpc(&self, method: &'static str, code: tonic::Code, elapsed: Duration) {
        let calls = &self.calls;
        let handles = METHODS
            .iter()
            .position(|m| *m == method)
            .and_then(|i| calls.answered.get(i));
        let labels = || RpcLabels {
            method,
            code: code_name(code),
        };
        match handles {
            Some(handles) if code == tonic::Code::Ok => handles
                .ok
                .get_or_init(|| calls.requests.get_or_create(&labels()).clone())
                .inc(),
            _ => calls.requests.get_or_create(&labels()).inc(),
        };
        let latency = || calls.seconds.get_or_create(&MethodLabels { method });
        match handles {
            Some(handles) => handles
                .latency
                .get_or_init(|| latency().clone())
                .observe(elapsed.as_secs_f64()),
            None => latency().observe(elapsed.as_secs_f64()),
        }
    }

    /// One write to the management cluster and how long its request took.
    pub fn api_write(&self, operation: &'static str, outcome: &'static str, elapsed: Duration) {
        let labels = WriteLabels { operation, outcome };
        self.writes.count.get_or_create(&labels).inc();
        self.writes
            .seconds
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
    }

    /// A delete mark the repair took back (`api_writes_total{operation="repair-unmark"}`: its
    /// request is counted as `unmark-machine`).
    pub fn mark_repaired(&self) {
        self.writes.count.get_or_create(&REPAIR_UNMARK).inc();
    }

    /// Whether the provider is ready (what /readyz answers).
    pub fn ready(&self, ready: bool) {
        self.groups.ready.set(i64::from(ready));
    }

    pub fn watch_event(&self, resource: &'static str, event: &'static str) {
        self.watches
            .events
            .get_or_create(&WatchLabels { resource, event })
            .inc();
    }

    /// Seconds the watch of `resource` has been failing (or not yet listed); 0 when in sync.
    pub fn watch_stale(&self, resource: &str, seconds: f64) {
        self.watches
            .stale
            .get_or_create(&ResourceLabels {
                resource: resource.to_string(),
            })
            .set(seconds);
    }

    /// `--watch-stale-after`, the bound [`Metrics::watch_stale`] is judged by.
    pub fn watch_stale_after(&self, after: std::time::Duration) {
        self.watches.stale_after.set(after.as_secs_f64());
    }

    /// A CloudProvider call refused by a limit, before or instead of its handler.
    pub fn rejected(&self, method: &'static str, reason: &'static str) {
        self.calls
            .rejected
            .get_or_create(&RejectLabels { method, reason })
            .inc();
    }

    pub fn tls_reload(&self, outcome: &'static str) {
        self.calls
            .tls_reloads
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    pub fn observe_snapshot(&self, snapshot: &Snapshot, elapsed: Duration) {
        self.watches.snapshot_seconds.observe(elapsed.as_secs_f64());
        self.groups.served.set(snapshot.groups.len() as i64);
        self.groups.machines.set(snapshot.machines as i64);
        for kind in ProblemKind::ALL {
            let count = snapshot.problems.iter().filter(|p| p.kind == kind).count();
            self.groups
                .problems
                .get_or_create(&KindLabels { kind: kind.label() })
                .set(count as i64);
        }
        for reason in NotServed::ALL {
            let count = snapshot
                .not_served
                .values()
                .filter(|r| **r == reason)
                .count();
            self.groups
                .not_served
                .get_or_create(&ReasonLabels {
                    reason: reason.label(),
                })
                .set(count as i64);
        }
    }

    /// Target, min and max size of each group `snapshot` serves (groups gone are dropped). Set
    /// when scraped rather than on every snapshot build: it costs a series per group.
    pub fn observe_groups(&self, snapshot: &Snapshot) {
        for family in [&self.groups.target, &self.groups.min, &self.groups.max] {
            family.clear();
        }
        for (id, group) in snapshot.groups.iter() {
            let labels = GroupLabels {
                node_group: id.to_string(),
            };
            self.groups
                .target
                .get_or_create(&labels)
                .set(i64::from(group.target));
            self.groups
                .min
                .get_or_create(&labels)
                .set(i64::from(group.min));
            self.groups
                .max
                .get_or_create(&labels)
                .set(i64::from(group.max));
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpc_calls_show_up_in_the_exposition() {
        let m = Metrics::new();
        m.rpc("NodeGroups", tonic::Code::Ok, Duration::from_micros(30));
        m.api_write("scale", "conflict", Duration::from_millis(3));
        let text = m.encode();
        assert!(
            text.contains(
                "capi_autoscaler_provider_grpc_requests_total{method=\"NodeGroups\",code=\"OK\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("capi_autoscaler_provider_api_writes_total{operation=\"scale\",outcome=\"conflict\"} 1"), "{text}");
    }

    /// The OK answers of a known method are counted through its kept handles, every other code
    /// and any other method through the families: all land in the same series.
    #[test]
    fn every_call_is_counted_by_method_and_code_and_timed_by_method() {
        let m = Metrics::new();
        for _ in 0..3 {
            m.rpc(
                "NodeGroupForNode",
                tonic::Code::Ok,
                Duration::from_micros(30),
            );
        }
        m.rpc(
            "NodeGroupForNode",
            tonic::Code::InvalidArgument,
            Duration::from_micros(5),
        );
        m.rpc(
            "NodeGroupTargetSize",
            tonic::Code::NotFound,
            Duration::from_micros(5),
        );
        m.rpc("unknown", tonic::Code::Ok, Duration::from_micros(5));
        let text = m.encode();
        for line in [
            "capi_autoscaler_provider_grpc_requests_total{method=\"NodeGroupForNode\",code=\"OK\"} 3",
            "capi_autoscaler_provider_grpc_requests_total{method=\"NodeGroupForNode\",code=\"INVALID_ARGUMENT\"} 1",
            "capi_autoscaler_provider_grpc_request_duration_seconds_count{method=\"NodeGroupForNode\"} 4",
            "capi_autoscaler_provider_grpc_requests_total{method=\"NodeGroupTargetSize\",code=\"NOT_FOUND\"} 1",
            "capi_autoscaler_provider_grpc_request_duration_seconds_count{method=\"NodeGroupTargetSize\"} 1",
            "capi_autoscaler_provider_grpc_requests_total{method=\"unknown\",code=\"OK\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        assert!(
            !text.contains("method=\"NodeGroupTargetSize\",code=\"OK\""),
            "a method never answered OK has no OK series: {text}"
        );
    }

    #[test]
    fn watch_staleness_and_rejections_show_up_in_the_exposition() {
        let m = Metrics::new();
        m.watch_stale("machines.cluster.x-k8s.io", 12.5);
        m.watch_stale_after(std::time::Duration::from_secs(45));
        m.rejected("NodeGroupDeleteNodes", "decoded-size");
        m.tls_reload("error");
        let text = m.encode();
        for line in [
            "capi_autoscaler_provider_watch_stale_seconds{resource=\"machines.cluster.x-k8s.io\"} 12.5",
            "capi_autoscaler_provider_watch_stale_after_seconds 45.0",
            "capi_autoscaler_provider_grpc_rejected_total{method=\"NodeGroupDeleteNodes\",reason=\"decoded-size\"} 1",
            "capi_autoscaler_provider_tls_reloads_total{outcome=\"error\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
    }

    #[test]
    fn write_latency_is_a_histogram_by_operation_and_outcome() {
        let m = Metrics::new();
        m.api_write("increase-size", "ok", Duration::from_millis(3));
        m.api_write("increase-size", "ok", Duration::from_millis(40));
        m.api_write("mark-machine", "error", Duration::from_secs(2));
        m.mark_repaired();
        let text = m.encode();
        for line in [
            "capi_autoscaler_provider_api_write_duration_seconds_count{operation=\"increase-size\",outcome=\"ok\"} 2",
            "capi_autoscaler_provider_api_write_duration_seconds_bucket{le=\"0.004\",operation=\"increase-size\",outcome=\"ok\"} 1",
            "capi_autoscaler_provider_api_write_duration_seconds_bucket{le=\"0.064\",operation=\"increase-size\",outcome=\"ok\"} 2",
            "capi_autoscaler_provider_api_write_duration_seconds_count{operation=\"mark-machine\",outcome=\"error\"} 1",
            "capi_autoscaler_provider_api_writes_total{operation=\"increase-size\",outcome=\"ok\"} 2",
            "capi_autoscaler_provider_api_writes_total{operation=\"repair-unmark\",outcome=\"ok\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        // The repair's count is not a request of its own: no latency observed for it.
        assert!(!text.contains("api_write_duration_seconds_count{operation=\"repair-unmark\""));
    }

    #[test]
    fn problems_are_counted_by_kind_and_groups_not_served_by_reason() {
        let m = Metrics::new();
        let before = m.encode();
        // Every kind and reason is there from the start, at 0.
        for kind in ProblemKind::ALL {
            let line = format!(
                "capi_autoscaler_provider_problems{{kind=\"{}\"}} 0",
                kind.label()
            );
            assert!(before.lines().any(|l| l == line), "{line} not in\n{before}");
        }
        for reason in NotServed::ALL {
            let line = format!(
                "capi_autoscaler_provider_node_groups_not_served{{reason=\"{}\"}} 0",
                reason.label()
            );
            assert!(before.lines().any(|l| l == line), "{line} not in\n{before}");
        }
        let mut snapshot = Snapshot::default();
        snapshot.problems = vec![
            crate::problem::Problem::new("MachineDeployment ns/a", "spec.replicas", "not set"),
            crate::problem::Problem::new(
                "MachineDeployment ns/b",
                "metadata.annotations[capacity.cluster-autoscaler.kubernetes.io/memory]",
                "bad",
            ),
            crate::problem::Problem::new(
                "MachineDeployment ns/c",
                "metadata.annotations[capacity.cluster-autoscaler.kubernetes.io/cpu]",
                "bad",
            ),
        ];
        snapshot.not_served = [
            (
                "MachineDeployment/ns/a".to_string(),
                NotServed::ReplicasUnset,
            ),
            (
                "MachineDeployment/ns/x".to_string(),
                NotServed::OtherCluster,
            ),
            (
                "MachineDeployment/ns/y".to_string(),
                NotServed::OtherCluster,
            ),
        ]
        .into();
        m.observe_snapshot(&snapshot, Duration::from_millis(1));
        let text = m.encode();
        for line in [
            "capi_autoscaler_provider_problems{kind=\"replicas\"} 1",
            "capi_autoscaler_provider_problems{kind=\"capacity\"} 2",
            "capi_autoscaler_provider_problems{kind=\"bounds\"} 0",
            "capi_autoscaler_provider_node_groups_not_served{reason=\"replicas-unset\"} 1",
            "capi_autoscaler_provider_node_groups_not_served{reason=\"other-cluster\"} 2",
            "capi_autoscaler_provider_node_groups_not_served{reason=\"paused\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        // Gone again: back to 0, not absent.
        m.observe_snapshot(&Snapshot::default(), Duration::from_millis(1));
        let text = m.encode();
        assert!(
            text.lines()
                .any(|l| l == "capi_autoscaler_provider_problems{kind=\"capacity\"} 0"),
            "{text}"
        );
    }

    #[test]
    fn readiness_is_a_gauge() {
        let m = Metrics::new();
        assert!(
            m.encode()
                .lines()
                .any(|l| l == "capi_autoscaler_provider_ready 0")
        );
        m.ready(true);
        assert!(
            m.encode()
                .lines()
                .any(|l| l == "capi_autoscaler_provider_ready 1")
        );
    }

    #[test]
    fn build_info_carries_version_and_commit() {
        let text = Metrics::new().encode();
        let line = format!(
            "capi_autoscaler_provider_build_info{{version=\"{}\",commit=\"{}\"}} 1",
            version::VERSION,
            version::COMMIT
        );
        assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
    }
}
