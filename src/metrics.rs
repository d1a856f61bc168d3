//! Prometheus metrics: RPCs, API writes, watches, snapshot builds, node groups and problems.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::snapshot::Snapshot;

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
}
