//! The externalgrpc CloudProvider service: translates between the wire and a [`Backend`] (the
//! snapshot and the actuator in the provider, a fixed snapshot in unit tests). Read RPCs answer from
//! the snapshot only; scale RPCs go to the backend's writer.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};

use crate::backend::{ActuatorError, Backend};
use crate::capi::{GPU_LABEL, Keys};
use crate::metrics::Metrics;
use crate::pricing;
use crate::proto::cloud_provider_server::CloudProvider;
use crate::proto::*;
use crate::snapshot::{GroupId, NodeGroup as Group, Snapshot};
use crate::template::NODE_GROUP_ANNOTATION;

pub(crate) mod codec;
mod convert;
mod limits;
pub mod wire;

use convert::{EncodedGroups, period};
pub use convert::{group_field, node_ref, options_response, template_bytes};
use limits::{bounded, pod_bytes_within_limits, shorten};

/// CA renames template nodes `template-node-for-<group id>-<random>` before pricing them.
const TEMPLATE_NODE_PREFIX: &str = "template-node-for-";

pub struct Service<B> {
    backend: B,
    metrics: Arc<Metrics>,
    node_groups: Arc<EncodedGroups>,
}

impl<B: Backend> Service<B> {
    pub fn new(backend: B, metrics: Arc<Metrics>) -> Self {
        Service {
            backend,
            metrics,
            node_groups: Arc::default(),
        }
    }

    /// Encodes the NodeGroups answer of each snapshot as it is published, so that CA's first
    /// NodeGroups after a change finds it encoded (at 100,000 Machines the encoding is most of that
    /// call's time). Runs until the backend stops publishing.
    pub fn encode_on_publish(&self) -> impl std::future::Future<Output = ()> + Send + 'static
    where
        B: Clone,
    {
        let backend = self.backend.clone();
        let node_groups = Arc::clone(&self.node_groups);
        let mut published = backend.published();
        async move {
            while published.changed().await.is_ok() {
                if backend.is_complete() {
                    node_groups.answer(&backend.snapshot());
                }
            }
        }
    }

    /// Nothing is answered from a partial view: until every watch (Nodes included) has listed and a
    /// snapshot was built from that, CA would take unmapped nodes for unmanaged ones. UNAVAILABLE
    /// makes CA retry the call or its loop.
    fn serving(&self) -> Result<(), Status> {
        if self.backend.is_complete() {
            Ok(())
        } else {
            Err(Status::unavailable(
                "the provider is still listing the management cluster (not every watch has synced yet); retry shortly",
            ))
        }
    }

    /// Writes need the bounds and replicas of the group, its MachineSets and Machines as they are: while
    /// a watch they depend on is stale, they are refused with UNAVAILABLE (CA retries) rather than made
    /// against an old view.
    fn writable(&self, id: &str) -> Result<(), Status> {
        let Some(group) = GroupId::parse(id) else {
            return Ok(()); // not a group id: the backend answers NOT_FOUND
        };
        let stale = self.backend.stale_for_write(group.kind);
        if stale.is_empty() {
            return Ok(());
        }
        Err(Status::unavailable(format!(
            "not writing to node group {}: {}; its bounds and replicas may be out of date",
            shorten(id, 200),
            stale.join("; ")
        )))
    }

    fn keys(&self) -> &Keys {
        self.backend.keys()
    }

    /// How every RPC but Cleanup is answered: `UNAVAILABLE` until the view is whole, else what
    /// `handler` answers, timed, counted and logged by [`Self::observe`]. `handler` is not started
    /// before the view is whole.
    async fn answer<T>(
        &self,
        method: &'static str,
        handler: impl Future<Output = Result<T, Status>>,
    ) -> Result<Response<T>, Status> {
        let started = Instant::now();
        let result = match self.serving() {
            Ok(()) => handler.await,
            Err(status) => Err(status),
        };
        self.observe(method, started, result)
    }

    /// Counts and times the answer of `method`, logs a failure worth a look; the message sent back
    /// is bounded.
    fn observe<T>(
        &self,
        method: &'static str,
        started: Instant,
        result: Result<T, Status>,
    ) -> Result<Response<T>, Status> {
        let result = result.map_err(bounded);
        let code = match &result {
            Ok(_) => tonic::Code::Ok,
            Err(status) => status.code(),
        };
        // The limits layer reads OUT_OF_RANGE as the gRPC library's refusal of a message over
        // --max-message-size (`crate::server`): no handler answers it.
        debug_assert_ne!(code, tonic::Code::OutOfRange, "{method}");
        self.metrics.rpc(method, code, started.elapsed());
        if let Err(status) = &result
            && !matches!(code, tonic::Code::Unimplemented | tonic::Code::NotFound)
        {
            tracing::warn!(method, code = ?code, "{}", status.message());
        }
        result.map(Response::new)
    }
}

fn find<'a>(snapshot: &'a Snapshot, id: &str) -> Result<&'a Group, Status> {
    snapshot
        .group(id)
        .ok_or_else(|| ActuatorError::GroupNotFound { id: id.to_string() }.into())
}

/// The group a node being priced belongs to: a real node by providerID or machine annotations, a
/// template node by CA's name prefix or by the annotation our templates carry.
fn priced_group<'a>(
    snapshot: &'a Snapshot,
    keys: &Keys,
    node: &ExternalGrpcNode,
) -> Option<&'a Group> {
    if let Some(group) = snapshot.group_for_node(&node_ref(node), keys) {
        return Some(group);
    }
    if let Some(rest) = node.name.strip_prefix(TEMPLATE_NODE_PREFIX) {
        // The id itself contains '-', so take the longest group id the name starts with.
        if let Some(group) = snapshot
            .groups
            .values()
            .filter(|g| rest.starts_with(&g.id) && rest[g.id.len()..].starts_with('-'))
            .max_by_key(|g| g.id.len())
        {
            return Some(group);
        }
    }
    node.annotations
        .get(NODE_GROUP_ANNOTATION)
        .and_then(|id| snapshot.group(id))
}

#[tonic::async_trait]
impl<B: Backend> CloudProvider for Service<B> {
    async fn node_groups(
        &self,
        _: Request<NodeGroupsRequest>,
    ) -> Result<Response<NodeGroupsResponse>, Status> {
        self.answer("NodeGroups", async {
            let snapshot = self.backend.snapshot();
            Ok(self.node_groups.answer(&snapshot))
        })
        .await
    }

    async fn node_group_for_node(
        &self,
        request: Request<NodeGroupForNodeRequest>,
    ) -> Result<Response<NodeGroupForNodeResponse>, Status> {
        self.answer("NodeGroupForNode", async {
            let node = request
                .get_ref()
                .node
                .as_ref()
                .ok_or_else(|| Status::invalid_argument("node is required"))?;
            let snapshot = self.backend.snapshot();
            Ok(
                match snapshot.group_for_node(&node_ref(node), self.keys()) {
                    Some(group) => NodeGroupForNodeResponse::encoded(group_field(group)),
                    // An empty id tells CA the node is not autoscaled (a group it must get: CA reads
                    // the id through it).
                    None => NodeGroupForNodeResponse::from(NodeGroup::default()),
                },
            )
        })
        .await
    }

    async fn pricing_node_price(
        &self,
        request: Request<PricingNodePriceRequest>,
    ) -> Result<Response<PricingNodePriceResponse>, Status> {
        self.answer("PricingNodePrice", async {
            let r = request.get_ref();
            let node = r
                .node
                .as_ref()
                .ok_or_else(|| Status::invalid_argument("node is required"))?;
            let snapshot = self.backend.snapshot();
            let group = priced_group(&snapshot, self.keys(), node).ok_or_else(|| {
                Status::unimplemented(format!("node {:?} belongs to no node group", node.name))
            })?;
            let hourly = group.price.ok_or_else(|| {
                Status::unimplemented(format!(
                    "node group {} has no {} annotation",
                    group.id,
                    crate::capi::PRICE_ANNOTATION
                ))
            })?;
            let (start, end) = period(
                (r.start_timestamp.as_ref(), r.start_time.as_ref()),
                (r.end_timestamp.as_ref(), r.end_time.as_ref()),
            )?;
            Ok(PricingNodePriceResponse {
                price: pricing::node_price(hourly, start, end),
            })
        })
        .await
    }

    async fn pricing_pod_price(
        &self,
        request: Request<PricingPodPriceRequest>,
    ) -> Result<Response<PricingPodPriceResponse>, Status> {
        self.answer("PricingPodPrice", async {
            let r = request.get_ref();
            let snapshot = self.backend.snapshot();
            if snapshot.groups.values().all(|g| g.price.is_none()) {
                return Err(Status::unimplemented("no node group has a price"));
            }
            let bytes = if r.pod_bytes.is_empty() {
                &r.pod
            } else {
                &r.pod_bytes
            };
            if bytes.is_empty() {
                return Err(Status::invalid_argument("pod_bytes is required"));
            }
            pod_bytes_within_limits(bytes)?;
            let pod = pricing::decode_pod(bytes)
                .map_err(|e| Status::invalid_argument(format!("pod_bytes: {e}")))?;
            let (start, end) = period(
                (r.start_timestamp.as_ref(), r.start_time.as_ref()),
                (r.end_timestamp.as_ref(), r.end_time.as_ref()),
            )?;
            let hours = pricing::hours_between(start, end);
            Ok(PricingPodPriceResponse {
                price: pricing::pod_price(&pod, &snapshot.reference_prices, hours),
            })
        })
        .await
    }

    async fn gpu_label(
        &self,
        _: Request<GpuLabelRequest>,
    ) -> Result<Response<GpuLabelResponse>, Status> {
        self.answer("GPULabel", async {
            Ok(GpuLabelResponse {
                label: GPU_LABEL.to_string(),
            })
        })
        .await
    }

    async fn get_available_gpu_types(
        &self,
        _: Request<GetAvailableGpuTypesRequest>,
    ) -> Result<Response<GetAvailableGpuTypesResponse>, Status> {
        self.answer("GetAvailableGPUTypes", async {
            let snapshot = self.backend.snapshot();
            let gpu_types: HashMap<String, prost_types::Any> = snapshot
                .groups
                .values()
                .filter_map(|g| g.template.as_ref())
                .filter(|t| t.summary.gpu.is_some())
                // CA looks the GPU label value of a node up in these keys.
                .filter_map(|t| t.summary.labels.get(GPU_LABEL))
                .map(|gpu_type| (gpu_type.clone(), prost_types::Any::default()))
                .collect();
            Ok(GetAvailableGpuTypesResponse { gpu_types })
        })
        .await
    }

    /// Answered even before the view is whole: CA calls it once, at its shutdown, and there is
    /// nothing to clean up.
    async fn cleanup(
        &self,
        _: Request<CleanupRequest>,
    ) -> Result<Response<CleanupResponse>, Status> {
        self.observe("Cleanup", Instant::now(), Ok(CleanupResponse {}))
    }

    async fn refresh(
        &self,
        _: Request<RefreshRequest>,
    ) -> Result<Response<RefreshResponse>, Status> {
        self.answer("Refresh", async {
            self.backend.refresh();
            Ok(RefreshResponse {})
        })
        .await
    }

    async fn node_group_target_size(
        &self,
        request: Request<NodeGroupTargetSizeRequest>,
    ) -> Result<Response<NodeGroupTargetSizeResponse>, Status> {
        self.answer("NodeGroupTargetSize", async {
            let snapshot = self.backend.snapshot();
            let group = find(&snapshot, &request.get_ref().id)?;
            Ok(NodeGroupTargetSizeResponse {
                target_size: group.target,
            })
        })
        .await
    }

    async fn node_group_increase_size(
        &self,
        request: Request<NodeGroupIncreaseSizeRequest>,
    ) -> Result<Response<NodeGroupIncreaseSizeResponse>, Status> {
        self.answer("NodeGroupIncreaseSize", async {
            let r = request.get_ref();
            self.writable(&r.id)?;
            self.backend.increase_size(&r.id, r.delta).await?;
            Ok(NodeGroupIncreaseSizeResponse {})
        })
        .await
    }

    async fn node_group_delete_nodes(
        &self,
        request: Request<NodeGroupDeleteNodesRequest>,
    ) -> Result<Response<NodeGroupDeleteNodesResponse>, Status> {
        self.answer("NodeGroupDeleteNodes", async {
            let r = request.into_inner();
            self.writable(&r.id)?;
            let nodes = convert::nodes_to_delete(r.nodes);
            self.backend.delete_nodes(&r.id, &nodes).await?;
            Ok(NodeGroupDeleteNodesResponse {})
        })
        .await
    }

    async fn node_group_decrease_target_size(
        &self,
        request: Request<NodeGroupDecreaseTargetSizeRequest>,
    ) -> Result<Response<NodeGroupDecreaseTargetSizeResponse>, Status> {
        self.answer("NodeGroupDecreaseTargetSize", async {
            let r = request.get_ref();
            self.writable(&r.id)?;
            self.backend.decrease_target_size(&r.id, r.delta).await?;
            Ok(NodeGroupDecreaseTargetSizeResponse {})
        })
        .await
    }

    async fn node_group_nodes(
        &self,
        request: Request<NodeGroupNodesRequest>,
    ) -> Result<Response<NodeGroupNodesResponse>, Status> {
        self.answer("NodeGroupNodes", async {
            let snapshot = self.backend.snapshot();
            let group = find(&snapshot, &request.get_ref().id)?;
            Ok(NodeGroupNodesResponse {
                instances: convert::instances(group),
            })
        })
        .await
    }

    async fn node_group_template_node_info(
        &self,
        request: Request<NodeGroupTemplateNodeInfoRequest>,
    ) -> Result<Response<NodeGroupTemplateNodeInfoResponse>, Status> {
        self.answer("NodeGroupTemplateNodeInfo", async {
            let snapshot = self.backend.snapshot();
            let group = find(&snapshot, &request.get_ref().id)?;
            // Never OK with empty bytes: CA would cache a nil template and dereference it.
            let template = group.template.as_ref().ok_or_else(|| {
                Status::unimplemented(format!(
                    "node group {} has no scale-from-zero template (no cpu/memory capacity); run `capi-autoscaler-provider check`",
                    group.id
                ))
            })?;
            let bytes = convert::template_bytes(template);
            Ok(NodeGroupTemplateNodeInfoResponse {
                node_info: bytes.clone(),
                node_bytes: bytes,
            })
        })
        .await
    }

    async fn node_group_get_options(
        &self,
        request: Request<NodeGroupAutoscalingOptionsRequest>,
    ) -> Result<Response<NodeGroupAutoscalingOptionsResponse>, Status> {
        self.answer("NodeGroupGetOptions", async {
            let snapshot = self.backend.snapshot();
            let r = request.get_ref();
            let group = find(&snapshot, &r.id)?;
            options_response(group.options.as_ref(), r.defaults.as_ref())
        })
        .await
    }
}

#[cfg(test)]
mod tests;
