//! Every translation between the externalgrpc wire and the provider's own types: requests into
//! domain values, snapshots and templates into answers, writer errors into the status codes CA acts on.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1 as api;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use prost::Message;
use tonic::Status;

use crate::backend::{ActuatorError, ApiCause, NodeToDelete};
use crate::options::{Defaults, GroupOptions};
use crate::pricing;
use crate::proto::instance_status::InstanceState as WireState;
use crate::proto::*;
use crate::snapshot::{InstanceState, NodeGroup as Group, NodeRef, Snapshot};
use crate::template::TemplateNode;

/// The status code CA acts on for each actuator error: it retries UNAVAILABLE and ABORTED, and
/// gives up on the others.
impl From<ActuatorError> for Status {
    fn from(e: ActuatorError) -> Self {
        match e {
            e @ ActuatorError::GroupNotFound { .. } => Status::not_found(e.to_string()),
            ActuatorError::NotFound(m) => Status::not_found(m),
            ActuatorError::BadRequest(m) => Status::invalid_argument(m),
            e @ ActuatorError::OutOfBounds { .. } => Status::failed_precondition(e.to_string()),
            ActuatorError::Refused(m) => Status::failed_precondition(m),
            ActuatorError::Conflict(m) => Status::aborted(m),
            ActuatorError::Api { cause, message } => match cause {
                ApiCause::Unreachable => Status::unavailable(message),
                ApiCause::Forbidden => Status::permission_denied(message),
                ApiCause::Failed => Status::internal(message),
            },
            ActuatorError::Internal(m) => Status::internal(m),
        }
    }
}

/// The NodeGroups answer of the snapshot answered from last, encoded once: CA asks every loop, and
/// a fleet's groups change only with its snapshot.
#[derive(Default)]
pub(super) struct EncodedGroups(Mutex<Option<(Weak<Snapshot>, NodeGroupsResponse)>>);

impl EncodedGroups {
    /// The answer for `snapshot`, encoded now if it is not the one encoded last (under the lock:
    /// calls that come together encode it once).
    pub(super) fn answer(&self, snapshot: &Arc<Snapshot>) -> NodeGroupsResponse {
        let mut cached = crate::lock(&self.0);
        if let Some((of, response)) = cached.as_ref()
            && std::ptr::eq(of.as_ptr(), Arc::as_ptr(snapshot))
        {
            return response.clone();
        }
        let fields: Vec<prost::bytes::Bytes> = snapshot.groups.values().map(group_field).collect();
        let response = NodeGroupsResponse::encoded(fields.iter().map(|f| f.as_ref()));
        *cached = Some((Arc::downgrade(snapshot), response.clone()));
        response
    }

    /// Whether the answer of `snapshot` is the one encoded.
    #[cfg(test)]
    pub(super) fn holds(&self, snapshot: &Arc<Snapshot>) -> bool {
        crate::lock(&self.0)
            .as_ref()
            .is_some_and(|(of, _)| std::ptr::eq(of.as_ptr(), Arc::as_ptr(snapshot)))
    }
}

/// `group` as it is sent, alone (NodeGroupForNode) or among the others (NodeGroups): encoded the
/// first time either is answered, shared by every later answer until the group changes.
pub fn group_field(group: &Group) -> prost::bytes::Bytes {
    group.encoded(|g| node_group_field(&wire_group(g)))
}

pub(super) fn wire_group(group: &Group) -> NodeGroup {
    NodeGroup {
        id: group.id.clone(),
        min_size: group.served_min(),
        max_size: group.max,
        debug: group.debug(),
    }
}

/// What the snapshot's lookups read of a node CA names.
pub fn node_ref(node: &ExternalGrpcNode) -> NodeRef<'_> {
    NodeRef {
        provider_id: &node.provider_id,
        name: &node.name,
        annotations: Some(&node.annotations),
    }
}

/// The priced period: the CA ≥ 1.35 timestamps, else the legacy ones.
pub(super) fn period(
    start: (Option<&prost_types::Timestamp>, Option<&LegacyTime>),
    end: (Option<&prost_types::Timestamp>, Option<&LegacyTime>),
) -> Result<(SystemTime, SystemTime), Status> {
    let read = |(new, legacy): (Option<&prost_types::Timestamp>, Option<&LegacyTime>),
                name: &str| {
        let (seconds, nanos) = match (new, legacy) {
            (Some(t), _) => (t.seconds, t.nanos),
            (None, Some(t)) => (t.seconds, t.nanos),
            (None, None) => return Err(Status::invalid_argument(format!("{name} is required"))),
        };
        pricing::timestamp(seconds, nanos)
            .ok_or_else(|| Status::invalid_argument(format!("{name} is out of range")))
    };
    Ok((read(start, "startTimestamp")?, read(end, "endTimestamp")?))
}

pub(super) fn wire_duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

pub(super) fn read_duration(
    new: Option<&prost_types::Duration>,
    legacy: Option<&LegacyDuration>,
) -> Duration {
    match (new, legacy) {
        (Some(d), _) => Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32),
        (None, Some(l)) => Duration::from_nanos(l.duration.max(0) as u64),
        (None, None) => Duration::ZERO,
    }
}

pub(super) fn defaults_from_wire(o: &NodeGroupAutoscalingOptions) -> Defaults {
    Defaults {
        scale_down_utilization_threshold: o.scale_down_utilization_threshold,
        scale_down_gpu_utilization_threshold: o.scale_down_gpu_utilization_threshold,
        scale_down_unneeded_time: read_duration(
            o.scale_down_unneeded_duration.as_ref(),
            o.scale_down_unneeded_time.as_ref(),
        ),
        scale_down_unready_time: read_duration(
            o.scale_down_unready_duration.as_ref(),
            o.scale_down_unready_time.as_ref(),
        ),
        max_node_provision_time: read_duration(
            o.max_node_provision_duration.as_ref(),
            o.max_node_provision_time.as_ref(),
        ),
        zero_or_max_node_scaling: o.zero_or_max_node_scaling,
        ignore_daemonsets_utilization: o.ignore_daemon_sets_utilization,
    }
}

/// Both the CA ≥ 1.35 fields and the legacy ones, so every supported CA reads every duration.
pub(super) fn options_to_wire(o: &Defaults) -> NodeGroupAutoscalingOptions {
    let legacy = |d: Duration| LegacyDuration {
        duration: i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
    };
    NodeGroupAutoscalingOptions {
        scale_down_utilization_threshold: o.scale_down_utilization_threshold,
        scale_down_gpu_utilization_threshold: o.scale_down_gpu_utilization_threshold,
        scale_down_unneeded_time: Some(legacy(o.scale_down_unneeded_time)),
        scale_down_unready_time: Some(legacy(o.scale_down_unready_time)),
        max_node_provision_time: Some(legacy(o.max_node_provision_time)),
        zero_or_max_node_scaling: o.zero_or_max_node_scaling,
        ignore_daemon_sets_utilization: o.ignore_daemonsets_utilization,
        scale_down_unneeded_duration: Some(wire_duration(o.scale_down_unneeded_time)),
        scale_down_unready_duration: Some(wire_duration(o.scale_down_unready_time)),
        max_node_provision_duration: Some(wire_duration(o.max_node_provision_time)),
    }
}

/// The options answer: empty without per-group annotations (CA keeps all its defaults, including the
/// ones the proto cannot carry), else the defaults with the group's overrides.
pub fn options_response(
    options: Option<&GroupOptions>,
    defaults: Option<&NodeGroupAutoscalingOptions>,
) -> Result<NodeGroupAutoscalingOptionsResponse, Status> {
    let Some(options) = options else {
        return Ok(NodeGroupAutoscalingOptionsResponse::default());
    };
    let defaults = defaults.ok_or_else(|| Status::invalid_argument("defaults are required"))?;
    Ok(NodeGroupAutoscalingOptionsResponse {
        node_group_autoscaling_options: Some(options_to_wire(
            &options.merged(&defaults_from_wire(defaults)),
        )),
    })
}

pub(super) fn wire_state(state: InstanceState) -> WireState {
    match state {
        InstanceState::Running => WireState::InstanceRunning,
        InstanceState::Creating => WireState::InstanceCreating,
        InstanceState::Deleting => WireState::InstanceDeleting,
    }
}

/// The group's instances as CA lists them.
pub(super) fn instances(group: &Group) -> Vec<Instance> {
    group
        .instances
        .iter()
        .map(|i| Instance {
            id: i.id.to_string(),
            status: Some(InstanceStatus {
                instance_state: wire_state(i.state) as i32,
                error_info: i.error.as_ref().map(|e| InstanceErrorInfo {
                    error_code: e.code.clone(),
                    error_message: e.message.clone(),
                    instance_error_class: e.class,
                }),
            }),
        })
        .collect()
}

/// The nodes of a DeleteNodes request, as far as the writer needs them.
pub(super) fn nodes_to_delete(nodes: Vec<ExternalGrpcNode>) -> Vec<NodeToDelete> {
    nodes
        .into_iter()
        .map(|n| NodeToDelete {
            provider_id: n.provider_id,
            name: n.name,
            annotations: n.annotations,
        })
        .collect()
}

/// A template node as Kubernetes protobuf: the bytes of Go's `v1.Node.Marshal()` (no `k8s\0`
/// envelope, no TypeMeta), for `nodeBytes` of `NodeGroupTemplateNodeInfoResponse`. Carries every
/// field [`crate::template::build`] sets. Encoded once per template; later answers share the bytes.
pub fn template_bytes(template: &TemplateNode) -> prost::bytes::Bytes {
    template.encoded(|node| to_pb(node).encode_to_vec())
}

/// k8s-openapi `Node` → k8s-pb `Node`, for the fields templates use.
pub(super) fn to_pb(node: &api::Node) -> k8s_pb::api::core::v1::Node {
    use k8s_pb::api::core::v1 as pb;
    use k8s_pb::apimachinery::pkg::api::resource::Quantity as PbQuantity;
    use k8s_pb::apimachinery::pkg::apis::meta::v1 as pbmeta;
    let quantities = |m: &Option<BTreeMap<String, Quantity>>| -> BTreeMap<String, PbQuantity> {
        m.iter()
            .flatten()
            .map(|(k, q)| {
                (
                    k.clone(),
                    PbQuantity {
                        string: Some(q.0.clone()),
                    },
                )
            })
            .collect()
    };
    let md = &node.metadata;
    pb::Node {
        metadata: Some(pbmeta::ObjectMeta {
            name: md.name.clone(),
            labels: md.labels.clone().unwrap_or_default(),
            annotations: md.annotations.clone().unwrap_or_default(),
            ..Default::default()
        }),
        spec: node.spec.as_ref().map(|s| pb::NodeSpec {
            provider_id: s.provider_id.clone(),
            taints: s
                .taints
                .iter()
                .flatten()
                .map(|t| pb::Taint {
                    key: Some(t.key.clone()),
                    value: t.value.clone(),
                    effect: Some(t.effect.clone()),
                    time_added: None,
                })
                .collect(),
            ..Default::default()
        }),
        status: node.status.as_ref().map(|s| pb::NodeStatus {
            capacity: quantities(&s.capacity),
            allocatable: quantities(&s.allocatable),
            conditions: s
                .conditions
                .iter()
                .flatten()
                .map(|c| pb::NodeCondition {
                    r#type: Some(c.type_.clone()),
                    status: Some(c.status.clone()),
                    reason: c.reason.clone(),
                    message: c.message.clone(),
                    ..Default::default()
                })
                .collect(),
            node_info: s.node_info.as_ref().map(|i| pb::NodeSystemInfo {
                machine_id: Some(i.machine_id.clone()),
                system_uuid: Some(i.system_uuid.clone()),
                boot_id: Some(i.boot_id.clone()),
                kernel_version: Some(i.kernel_version.clone()),
                os_image: Some(i.os_image.clone()),
                container_runtime_version: Some(i.container_runtime_version.clone()),
                kubelet_version: Some(i.kubelet_version.clone()),
                kube_proxy_version: Some(i.kube_proxy_version.clone()),
                operating_system: Some(i.operating_system.clone()),
                architecture: Some(i.architecture.clone()),
                swap: None,
            }),
            ..Default::default()
        }),
    }
}
