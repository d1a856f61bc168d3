//! Write latency: IncreaseSize and DeleteNodes, from the call to the change being visible in the API
//! (replicas raised; the Machine marked for deletion and replicas lowered), each sample on a group of
//! its own.

use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::cloud_provider_client::CloudProviderClient;
use capi_autoscaler_provider::proto::{NodeGroupDeleteNodesRequest, NodeGroupIncreaseSizeRequest};
use kube::Client;
use tonic::transport::Channel;

use crate::fleet::{self, Fleet, Group};
use crate::stats::Samples;

/// How long a change may take to show before the sample counts as failed.
const VISIBLE_WITHIN: Duration = Duration::from_secs(900);

#[derive(Clone, Debug, Default)]
pub struct WriteRun {
    pub increase: Samples,
    pub delete: Samples,
    pub failures: Vec<String>,
    /// Time spent, for the budget of slow servers.
    pub spent: Duration,
}

/// One IncreaseSize(+1) on `group`: call → `spec.replicas` raised in the API.
pub async fn increase(
    admin: &Client,
    client: &mut CloudProviderClient<Channel>,
    fleet: &Fleet,
    group: &Group,
    run: &mut WriteRun,
) {
    let began = Instant::now();
    let before = fleet::replicas(admin, &fleet.ns, &group.name)
        .await
        .unwrap_or(0);
    let started = Instant::now();
    let result = client
        .node_group_increase_size(NodeGroupIncreaseSizeRequest {
            delta: 1,
            id: group.id.clone(),
        })
        .await;
    match result {
        Err(status) => run
            .failures
            .push(format!("IncreaseSize {}: {status}", group.id)),
        Ok(_) => {
            let visible = wait(|| async {
                fleet::replicas(admin, &fleet.ns, &group.name).await == Some(before + 1)
            })
            .await;
            match visible {
                true => run.increase.push(started.elapsed()),
                false => run
                    .failures
                    .push(format!("IncreaseSize {}: replicas not raised", group.id)),
            }
        }
    }
    run.spent += began.elapsed();
}

/// One DeleteNodes of the group's `k`-th Node: call → Machine marked and `spec.replicas` lowered.
pub async fn delete(
    admin: &Client,
    client: &mut CloudProviderClient<Channel>,
    fleet: &Fleet,
    group: &Group,
    k: usize,
    run: &mut WriteRun,
) {
    let began = Instant::now();
    let Some(node) = group.members.get(k).map(|&i| &fleet.nodes[i]) else {
        return;
    };
    let machine = node.machine.clone().unwrap_or_default();
    let before = fleet::replicas(admin, &fleet.ns, &group.name)
        .await
        .unwrap_or(0);
    let started = Instant::now();
    let result = client
        .node_group_delete_nodes(NodeGroupDeleteNodesRequest {
            nodes: vec![node.grpc()],
            id: group.id.clone(),
        })
        .await;
    match result {
        Err(status) => run
            .failures
            .push(format!("DeleteNodes {}: {status}", group.id)),
        Ok(_) => {
            let visible = wait(|| async {
                fleet::replicas(admin, &fleet.ns, &group.name).await == Some(before - 1)
                    && fleet::marked(admin, &fleet.ns, &machine).await
            })
            .await;
            match visible {
                true => run.delete.push(started.elapsed()),
                false => run
                    .failures
                    .push(format!("DeleteNodes {}: not visible", group.id)),
            }
        }
    }
    run.spent += began.elapsed();
}

/// Polls `check` back to back until it holds or [`VISIBLE_WITHIN`] passes.
async fn wait<F, Fut>(mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + VISIBLE_WITHIN;
    while Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    false
}
