//! Prometheus metrics: RPCs, API writes, watches, snapshot builds, node groups and problems.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::snapshot::Snapshot;
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
pub struct WriteLabels {
    pub operation: &'static str,
    pub outcome: &'static str,
}

pub struct Metrics {
    registry: Registry,
    rpc_requests: Family<RpcLabels, Counter>,
    rpc_seconds: Family<MethodLabels, Histogram>,
    api_writes: Family<WriteLabels, Counter>,
    watch_events: Family<WatchLabels, Counter>,
    watch_stale: Family<ResourceLabels, Gauge<f64, AtomicU64>>,
    rejected: Family<RejectLabels, Counter>,
    tls_reloads: Family<OutcomeLabels, Counter>,
    snapshot_seconds: Histogram,
    node_groups: Gauge,
    machines: Gauge,
    problems: Gauge,
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
        let machines = Gauge::default();
        registry.register("machines", "Machines cached", machines.clone());
        let problems = Gauge::default();
        registry.register(
            "problems",
            "problems found in the Cluster API objects (see `check`)",
            problems.clone(),
        );
        Metrics {
            registry,
            rpc_requests,
            rpc_seconds,
            api_writes,
            watch_events,
            watch_stale,
            rejected,
            tls_reloads,
            snapshot_seconds,
            node_groups,
            machines,
            problems,
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

    pub fn api_write(&self, operation: &'static str, outcome: &'static str) {
        self.api_writes
            .get_or_create(&WriteLabels { operation, outcome })
            .inc();
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
        self.problems.set(snapshot.problems.len() as i64);
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
        m.api_write("scale", "conflict");
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
        m.rejected("NodeGroupDeleteNodes", "decoded-size");
        m.tls_reload("error");
        let text = m.encode();
        for line in [
            "capi_autoscaler_provider_watch_stale_seconds{resource=\"machines.cluster.x-k8s.io\"} 12.5",
            "capi_autoscaler_provider_grpc_rejected_total{method=\"NodeGroupDeleteNodes\",reason=\"decoded-size\"} 1",
            "capi_autoscaler_provider_tls_reloads_total{outcome=\"error\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
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
