//! Prometheus metrics: RPCs, API writes, watches, snapshot builds, node groups and problems.
//! deploy/monitoring/ (alerts, dashboard) uses these names; tests/monitoring.rs checks it uses no other.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::problem::ProblemKind;
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
    rpc_requests: Family<RpcLabels, Counter>,
    rpc_seconds: Family<MethodLabels, Histogram>,
    api_writes: Family<WriteLabels, Counter>,
    api_write_seconds: Family<WriteLabels, Histogram>,
    watch_events: Family<WatchLabels, Counter>,
    watch_stale: Family<ResourceLabels, Gauge<f64, AtomicU64>>,
    watch_stale_after: Gauge<f64, AtomicU64>,
    rejected: Family<RejectLabels, Counter>,
    tls_reloads: Family<OutcomeLabels, Counter>,
    snapshot_seconds: Histogram,
    node_groups: Gauge,
    group_target: Family<GroupLabels, Gauge>,
    group_min: Family<GroupLabels, Gauge>,
    group_max: Family<GroupLabels, Gauge>,
    not_served: Family<ReasonLabels, Gauge>,
    machines: Gauge,
    problems: Family<KindLabels, Gauge>,
    ready: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

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
        let rpc_requests = Family::<RpcLabels, Counter>::default();
        registry.register(
            "grpc_requests",
            "externalgrpc calls by method and status code",
            rpc_requests.clone(),
        );
        let rpc_seconds = Family::<MethodLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_01, 4.0, 12))
        });
        registry.register(
            "grpc_request_duration_seconds",
            "externalgrpc call latency",
            rpc_seconds.clone(),
        );
        let api_writes = Family::<WriteLabels, Counter>::default();
        registry.register(
            "api_writes",
            "writes to the management cluster by operation and outcome",
            api_writes.clone(),
        );
        // From 1 ms (a write on a quiet local API server) to about 65 s (past every retry).
        let api_write_seconds = Family::<WriteLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 17))
        });
        registry.register(
            "api_write_duration_seconds",
            "latency of each write to the management cluster by operation and outcome",
            api_write_seconds.clone(),
        );
        let watch_events = Family::<WatchLabels, Counter>::default();
        registry.register(
            "watch_events",
            "watch events by resource and kind of event",
            watch_events.clone(),
        );
        let watch_stale = Family::<ResourceLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "watch_stale_seconds",
            "how long each watch has been failing (or, before its first list, waiting); 0 while it is in sync",
            watch_stale.clone(),
        );
        // The threshold the provider itself turns not ready at, for the alert on the series above.
        let watch_stale_after = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "watch_stale_after_seconds",
            "--watch-stale-after: how long a watch may fail before the provider stops serving",
            watch_stale_after.clone(),
        );
        let rejected = Family::<RejectLabels, Counter>::default();
        registry.register(
            "grpc_rejected",
            "CloudProvider calls refused by a limit (message size, decoded size, concurrency, timeout)",
            rejected.clone(),
        );
        let tls_reloads = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "tls_reloads",
            "TLS certificate, key and client CA files read again after they changed, by outcome",
            tls_reloads.clone(),
        );
        let snapshot_seconds = Histogram::new(exponential_buckets(0.000_1, 4.0, 10));
        registry.register(
            "snapshot_build_duration_seconds",
            "time to build a snapshot",
            snapshot_seconds.clone(),
        );
        let node_groups = Gauge::default();
        registry.register("node_groups", "node groups served", node_groups.clone());
        // Per served group, by the id CA knows it by (CA's own node_group label).
        let group_target = Family::<GroupLabels, Gauge>::default();
        registry.register(
            "node_group_target_size",
            "target size (spec.replicas) of each node group served",
            group_target.clone(),
        );
        let group_min = Family::<GroupLabels, Gauge>::default();
        registry.register(
            "node_group_min_size",
            "configured min size of each node group served",
            group_min.clone(),
        );
        let group_max = Family::<GroupLabels, Gauge>::default();
        registry.register(
            "node_group_max_size",
            "max size of each node group served",
            group_max.clone(),
        );
        let not_served = Family::<ReasonLabels, Gauge>::default();
        registry.register(
            "node_groups_not_served",
            "candidate node groups not served (`check`'s NOT SERVED) by reason",
            not_served.clone(),
        );
        let machines = Gauge::default();
        registry.register("machines", "Machines cached", machines.clone());
        let problems = Family::<KindLabels, Gauge>::default();
        registry.register(
            "problems",
            "problems found in the Cluster API objects (see `check`) by kind",
            problems.clone(),
        );
        let ready = Gauge::default();
        registry.register(
            "ready",
            "1 while /readyz answers 200 (every watch in sync, some group served), else 0",
            ready.clone(),
        );
        // Every label value from the start, so a rule sees 0 rather than no series (and
        // `increase()` sees the first write, repair or failure as one).
        for operation in WRITE_OPERATIONS {
            for outcome in ["ok", "conflict", "error"] {
                api_writes
                    .get_or_create(&WriteLabels { operation, outcome })
                    .get();
            }
        }
        api_writes
            .get_or_create(&WriteLabels {
                operation: "repair-unmark",
                outcome: "ok",
            })
            .get();
        for outcome in ["success", "error"] {
            tls_reloads.get_or_create(&OutcomeLabels { outcome }).get();
        }
        for kind in ProblemKind::ALL {
            problems
                .get_or_create(&KindLabels { kind: kind.label() })
                .set(0);
        }
        for reason in NotServed::ALL {
            not_served
                .get_or_create(&ReasonLabels {
                    reason: reason.label(),
                })
                .set(0);
        }
        Metrics {
            registry,
            rpc_requests,
            rpc_seconds,
            api_writes,
            api_write_seconds,
            watch_events,
            watch_stale,
            watch_stale_after,
            rejected,
            tls_reloads,
            snapshot_seconds,
            node_groups,
            group_target,
            group_min,
            group_max,
            not_served,
            machines,
            problems,
            ready,
        }
    }

    pub fn rpc(&self, method: &'static str, code: tonic::Code, elapsed: Duration) {
        self.rpc_requests
            .get_or_create(&RpcLabels {
                method,
                code: code_name(code),
            })
            .inc();
        self.rpc_seconds
            .get_or_create(&MethodLabels { method })
            .observe(elapsed.as_secs_f64());
    }

    /// One write to the management cluster and how long its request took.
    pub fn api_write(&self, operation: &'static str, outcome: &'static str, elapsed: Duration) {
        let labels = WriteLabels { operation, outcome };
        self.api_writes.get_or_create(&labels).inc();
        self.api_write_seconds
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
    }

    /// A delete mark the repair took back (`api_writes_total{operation="repair-unmark"}`: its
    /// request is counted as `unmark-machine`).
    pub fn mark_repaired(&self) {
        self.api_writes
            .get_or_create(&WriteLabels {
                operation: "repair-unmark",
                outcome: "ok",
            })
            .inc();
    }

    /// Whether the provider is ready (what /readyz answers).
    pub fn ready(&self, ready: bool) {
        self.ready.set(i64::from(ready));
    }

    pub fn watch_event(&self, resource: &'static str, event: &'static str) {
        self.watch_events
            .get_or_create(&WatchLabels { resource, event })
            .inc();
    }

    /// Seconds the watch of `resource` has been failing (or not yet listed); 0 when in sync.
    pub fn watch_stale(&self, resource: &str, seconds: f64) {
        self.watch_stale
            .get_or_create(&ResourceLabels {
                resource: resource.to_string(),
            })
            .set(seconds);
    }

    /// `--watch-stale-after`, the bound [`Metrics::watch_stale`] is judged by.
    pub fn watch_stale_after(&self, after: std::time::Duration) {
        self.watch_stale_after.set(after.as_secs_f64());
    }

    /// A CloudProvider call refused by a limit, before or instead of its handler.
    pub fn rejected(&self, method: &'static str, reason: &'static str) {
        self.rejected
            .get_or_create(&RejectLabels { method, reason })
            .inc();
    }

    pub fn tls_reload(&self, outcome: &'static str) {
        self.tls_reloads
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    pub fn observe_snapshot(&self, snapshot: &Snapshot, elapsed: Duration) {
        self.snapshot_seconds.observe(elapsed.as_secs_f64());
        self.node_groups.set(snapshot.groups.len() as i64);
        self.machines.set(snapshot.machines as i64);
        for kind in ProblemKind::ALL {
            let count = snapshot.problems.iter().filter(|p| p.kind == kind).count();
            self.problems
                .get_or_create(&KindLabels { kind: kind.label() })
                .set(count as i64);
        }
        for reason in NotServed::ALL {
            let count = snapshot
                .not_served
                .values()
                .filter(|r| **r == reason)
                .count();
            self.not_served
                .get_or_create(&ReasonLabels {
                    reason: reason.label(),
                })
                .set(count as i64);
        }
    }

    /// Target, min and max size of each group `snapshot` serves (groups gone are dropped). Set
    /// when scraped rather than on every snapshot build: it costs a series per group.
    pub fn observe_groups(&self, snapshot: &Snapshot) {
        for family in [&self.group_target, &self.group_min, &self.group_max] {
            family.clear();
        }
        for (id, group) in snapshot.groups.iter() {
            let labels = GroupLabels {
                node_group: id.to_string(),
            };
            self.group_target
                .get_or_create(&labels)
                .set(i64::from(group.target));
            self.group_min
                .get_or_create(&labels)
                .set(i64::from(group.min));
            self.group_max
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
