//! The three scale operations CA asks for (IncreaseSize, DecreaseTargetSize, DeleteNodes): each
//! checked, its nodes resolved, turned into a protocol operation and run to completion under its
//! group's lock.

use std::collections::BTreeSet;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Instant;

use super::Actuator;
use super::execute::Caller;
use crate::backend::{ActuatorError, NodeToDelete};
use crate::capi::{ObjectKey, ScalableKind, preflight};
use crate::lock;
use crate::protocol::{Cancel, Hold, Operation, Purpose, Raise, Removal, pool_node_entry, refusal};
use crate::snapshot::{NodeGroup, NodeRef, Snapshot};

impl Actuator {
    pub async fn increase_size(
        self: &Arc<Self>,
        id: &str,
        delta: i32,
    ) -> Result<(), ActuatorError> {
        if delta <= 0 {
            return Err(ActuatorError::BadRequest(format!(
                "size increase must be positive, got delta {delta}"
            )));
        }
        let op = Operation::Raise(Raise::new(id, delta, &token()));
        self.run(id, Caller::IncreaseSize, vec![op]).await
    }

    /// Cancels capacity that has not become nodes yet; never removes a registered node.
    pub async fn decrease_target_size(
        self: &Arc<Self>,
        id: &str,
        delta: i32,
    ) -> Result<(), ActuatorError> {
        if delta >= 0 {
            return Err(ActuatorError::BadRequest(format!(
                "size decrease must be negative, got delta {delta}"
            )));
        }
        refuse_during_rollout(&self.store.snapshot(), id, "DecreaseTargetSize")?;
        let op = Operation::Cancel(Cancel::new(
            id,
            delta.unsigned_abs(),
            &token(),
            self.store.server_clock().stamp(),
        ));
        self.run(id, Caller::DecreaseTargetSize, vec![op]).await
    }

    /// Marks each node's Machine for deletion and lowers replicas by one per node
    /// (`crate::protocol::Removal`); instances a preflight check holds back are cancelled first.
    /// Every node is resolved before anything is written.
    pub async fn delete_nodes(
        self: &Arc<Self>,
        id: &str,
        nodes: &[NodeToDelete],
    ) -> Result<(), ActuatorError> {
        let snapshot = self.store.snapshot();
        let group = snapshot
            .group(id)
            .ok_or_else(|| ActuatorError::GroupNotFound { id: id.to_string() })?;
        refuse_during_rollout(&snapshot, id, "scale-down")?;
        let plan = removal_plan(&snapshot, &self.store.settings().keys, group, nodes)?;
        let mut ops = Vec::new();
        if !plan.held.is_empty() {
            let by = u32::try_from(plan.held.len()).unwrap_or(u32::MAX);
            ops.push(Operation::Cancel(Cancel::held(id, by, &token())));
        }
        let key = plan.key(id);
        if !plan.members.is_empty() {
            ops.push(Operation::Remove(Removal::new(
                id,
                Purpose::DeleteNodes,
                plan.members,
                plan.pending,
                self.store.server_clock().stamp(),
            )));
        }
        let mut answer = {
            let mut removals = lock(&self.removals);
            match removals.get(&key) {
                Some(under_way) => under_way.clone(),
                None => {
                    let (send, answer) = tokio::sync::watch::channel(None);
                    removals.insert(key.clone(), answer.clone());
                    let me = Arc::clone(self);
                    let id = id.to_string();
                    // This task owns the answer and its entry; `run` is the operation's own task,
                    // so a panic in it still ends in an answer and the entry's removal.
                    tokio::spawn(async move {
                        let result = me.run(&id, Caller::DeleteNodes, ops).await;
                        send.send_replace(Some(result));
                        lock(&me.removals).remove(&key);
                    });
                    answer
                }
            }
        };
        match answer.wait_for(Option::is_some).await {
            Ok(result) => result.clone().unwrap_or(Ok(())),
            Err(_) => Err(ActuatorError::Internal(
                "scale operation ended without an answer".into(),
            )),
        }
    }

    /// Runs `ops` one after the other under the group's lock (`execute`), on a task of their own: CA's deadline
    /// may drop the RPC, but a removal half-way must not be dropped with it. One snapshot build
    /// follows.
    async fn run(
        self: &Arc<Self>,
        id: &str,
        caller: Caller,
        ops: Vec<Operation>,
    ) -> Result<(), ActuatorError> {
        let me = Arc::clone(self);
        let id = id.to_string();
        // The time to wait counts from the call's arrival: one queued behind others on the lock
        // has spent it there, so a busy group's queue drains instead of each waiting in turn.
        let wait_until = Instant::now() + me.wait;
        spawned(async move {
            let snapshot = me.store.snapshot();
            let group = snapshot
                .group(&id)
                .cloned()
                .ok_or_else(|| ActuatorError::GroupNotFound { id: id.clone() })?;
            let lock = me.group_lock(&snapshot, &id);
            let mut result = Ok(());
            for mut op in ops {
                result = me
                    .execute(&id, &group, caller, &mut op, &lock, wait_until)
                    .await;
                if result.is_err() {
                    break;
                }
            }
            me.store.refresh();
            result
        })
        .await
    }
}

/// A rollout the snapshot already shows refuses at once, without an API call; the operation's own
/// fresh read checks it again (one may have begun since).
fn refuse_during_rollout(
    snapshot: &Snapshot,
    id: &str,
    operation: &str,
) -> Result<(), ActuatorError> {
    let Some(group) = snapshot.group(id) else {
        return Ok(());
    };
    match &group.rollout {
        Some(rollout) => {
            let hold = Hold::RollingOut(format!(
                "MachineDeployment {} ({})",
                group.resource.key,
                rollout.reason()
            ));
            Err(refusal::held(id, &hold, operation).into())
        }
        None => Ok(()),
    }
}

async fn spawned(
    operation: impl Future<Output = Result<(), ActuatorError>> + Send + 'static,
) -> Result<(), ActuatorError> {
    tokio::spawn(operation).await.unwrap_or_else(|e| {
        Err(ActuatorError::Internal(format!(
            "scale operation failed: {e}"
        )))
    })
}

/// A token no other write carries: what tells a size change whose answer was lost from one never
/// made, when it is read back.
fn token() -> String {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    hasher.write_u32(std::process::id());
    format!("{:016x}", hasher.finish())
}

/// What a DeleteNodes removes: the members (Machine names, pool entries of MachinePool nodes
/// without a Machine), those of them CA knows as pending (no Node: they must still have none when
/// removed), and how many instances a preflight check holds back.
#[derive(Debug, Default, PartialEq, Eq)]
struct RemovalPlan {
    members: Vec<String>,
    pending: Vec<String>,
    /// The instances held back, by the id CA names them by.
    held: Vec<String>,
}

/// The answer of a DeleteNodes under way, once it has one.
pub(super) type Answer = tokio::sync::watch::Receiver<Option<Result<(), ActuatorError>>>;

impl RemovalPlan {
    /// What tells two DeleteNodes of group `id` apart: the same members (in any order), pending
    /// members and held-back instances make the same removal.
    fn key(&self, id: &str) -> String {
        let mut members = self.members.clone();
        members.sort();
        let mut pending = self.pending.clone();
        pending.sort();
        let mut held = self.held.clone();
        held.sort();
        format!("{id}\n{members:?}\n{pending:?}\n{held:?}")
    }
}

/// Whether CA names an instance Cluster API's preflight checks hold back (CA's fake node for it
/// carries the instance id as providerID and name).
fn is_held(node: &NodeToDelete) -> bool {
    preflight::is_held_id(&node.provider_id) || preflight::is_held_id(&node.name)
}

/// Each node resolved, duplicates dropped; an error, before anything is written, for a node of no
/// group, of another group, or without a Machine outside a pool's list.
fn removal_plan(
    snapshot: &Snapshot,
    keys: &crate::capi::Keys,
    group: &NodeGroup,
    nodes: &[NodeToDelete],
) -> Result<RemovalPlan, ActuatorError> {
    let id = group.id.as_str();
    let mut plan = RemovalPlan::default();
    let mut seen: BTreeSet<String> = BTreeSet::new();
    for node in nodes {
        if is_held(node) {
            if seen.insert(format!("held:{}", node.provider_id)) {
                plan.held.push(node.provider_id.clone());
            }
            continue;
        }
        let location = snapshot
            .locate(
                &NodeRef {
                    provider_id: &node.provider_id,
                    name: &node.name,
                    annotations: Some(&node.annotations),
                },
                keys,
            )
            .ok_or_else(|| {
                ActuatorError::NotFound(format!("{} belongs to no node group", node.describe()))
            })?;
        if location.group_id != id {
            return Err(ActuatorError::BadRequest(format!(
                "{} belongs to node group {:?}, not {id:?}",
                node.describe(),
                location.group_id
            )));
        }
        let member = match &location.machine {
            Some(ObjectKey { name, .. }) => name.to_string(),
            None if group.kind() == ScalableKind::MachinePool && location.in_pool_list => {
                pool_node_entry(&node.provider_id)
            }
            None => {
                return Err(ActuatorError::Refused(format!(
                    "{}: no Machine found, and it is not in the providerIDList of {id}",
                    node.describe()
                )));
            }
        };
        if !seen.insert(member.clone()) {
            continue;
        }
        // CA names a Machine that never got a Node by its made-up id: if it gets one before the
        // removal, it is a node CA never drained, and stays.
        if node
            .provider_id
            .starts_with(crate::snapshot::PENDING_PREFIX)
            || node.name.starts_with(crate::snapshot::PENDING_PREFIX)
        {
            plan.pending.push(member.clone());
        }
        plan.members.push(member);
    }
    Ok(plan)
}
