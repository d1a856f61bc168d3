//! The three scale operations CA asks for (IncreaseSize, DecreaseTargetSize, DeleteNodes), each
//! run to completion under its group's lock, and their refusals.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;

use super::api::members;
use super::state::GroupState;
use super::write::Change;
use super::{Actuator, MAX_ATTEMPTS, now_unix};
use crate::backend::{ActuatorError, NodeToDelete};
use crate::capi::preflight;
use crate::capi::{ObjectKey, ScalableKind};
use crate::removal::{
    self, Cancellation, Counts, Deletion, LEDGER_ANNOTATION, Ledger, TAKING_BACK_ANNOTATION,
    pool_node_entry,
};
use crate::snapshot::{NodeGroup, NodeRef, Snapshot};

impl Actuator {
    pub async fn increase_size(
        self: &Arc<Self>,
        id: &str,
        delta: i32,
    ) -> Result<(), ActuatorError> {
        let (me, id) = (Arc::clone(self), id.to_string());
        self.run(async move { me.increase(&id, delta).await }).await
    }

    /// Cancels capacity that has not become nodes yet; never removes a registered node.
    pub async fn decrease_target_size(
        self: &Arc<Self>,
        id: &str,
        delta: i32,
    ) -> Result<(), ActuatorError> {
        let (me, id) = (Arc::clone(self), id.to_string());
        self.run(async move { me.decrease(&id, delta).await }).await
    }

    /// Marks each node's Machine for deletion and lowers replicas by one per node, recording each
    /// decrement in the group's ledger. A node whose removal is paid already (or whose Machine is
    /// being deleted) is skipped, so CA's retries never lower replicas twice. Refused, writing
    /// nothing, while the group's MachineDeployment rolls out.
    pub async fn delete_nodes(
        self: &Arc<Self>,
        id: &str,
        nodes: &[NodeToDelete],
    ) -> Result<(), ActuatorError> {
        let (me, id, nodes) = (Arc::clone(self), id.to_string(), nodes.to_vec());
        self.run(async move { me.delete(&id, &nodes).await }).await
    }

    /// Runs an accepted operation to completion on its own task: CA's deadline may drop the RPC,
    /// but a half-done removal must not be dropped with it. One snapshot build follows.
    async fn run(
        &self,
        operation: impl Future<Output = Result<(), ActuatorError>> + Send + 'static,
    ) -> Result<(), ActuatorError> {
        let store = Arc::clone(&self.store);
        tokio::spawn(async move {
            let result = operation.await;
            store.refresh();
            result
        })
        .await
        .unwrap_or_else(|e| {
            Err(ActuatorError::Internal(format!(
                "scale operation failed: {e}"
            )))
        })
    }

    async fn increase(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
        if delta <= 0 {
            return Err(ActuatorError::BadRequest(format!(
                "size increase must be positive, got delta {delta}"
            )));
        }
        let (snapshot, _) = self.group(id)?;
        let group_lock = self.group_lock(&snapshot, id);
        let _guard = group_lock.lock().await;
        let (_, group) = self.group(id)?;
        self.write(&group, "increase-size", false, |state| {
            let desired = state.replicas.saturating_add(delta);
            if desired > state.max {
                return Err(state.out_of_bounds(&group, "size increase", desired));
            }
            Ok(Some(Change {
                replicas: desired,
                entries: Vec::new(),
            }))
        })
        .await
        .map(|_| ())
    }

    /// Cancels capacity that never became nodes, pinned ([`removal::cancellation_plan`], decided
    /// from the group and its Machines as the API has them): replicas without a Machine are
    /// cancelled by a decrement alone, first; the pending Machines Cluster API would remove for the
    /// rest are marked and paid like a DeleteNodes of them ([`Actuator::remove_machines`]), so
    /// Cluster API removes exactly those even if one gets its Node before its controller acts.
    /// Refused during a rollout like DeleteNodes. CA never repeats a DecreaseTargetSize: it
    /// decides again from the target size and the nodes, so every call is a fresh cancellation;
    /// within one call a conflict re-decides and a write whose answer was lost is looked up.
    async fn decrease(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
        if delta >= 0 {
            return Err(ActuatorError::BadRequest(format!(
                "size decrease must be negative, got delta {delta}"
            )));
        }
        let (snapshot, _) = self.group(id)?;
        let group_lock = self.group_lock(&snapshot, id);
        let _guard = group_lock.lock().await;
        let (_, group) = self.group(id)?;
        refuse_during_rollout(&group, "DecreaseTargetSize")?;
        // A MachinePool has no deletion order to count with: which instance goes is the
        // infrastructure provider's choice, so only the registered count guards it.
        if group.kind() == ScalableKind::MachinePool {
            return self.decrease_pool(&group, delta).await;
        }
        self.cancel(id, &group, delta.unsigned_abs()).await
    }

    /// Lowers a MachinePool's replicas by `-delta`, never below its registered nodes.
    async fn decrease_pool(&self, group: &NodeGroup, delta: i32) -> Result<(), ActuatorError> {
        self.write(group, "decrease-target-size", false, |state| {
            if let Some(e) = refuse_registered(group, state.replicas, delta) {
                return Err(e);
            }
            let desired = state.replicas.saturating_add(delta);
            if !removal::within_bounds(state.replicas, desired, state.min, state.max) {
                return Err(state.out_of_bounds(group, "size decrease", desired));
            }
            Ok(Some(Change {
                replicas: desired,
                entries: Vec::new(),
            }))
        })
        .await
        .map(|_| ())
    }

    /// Cancels `by` replicas of a group of Machines: those without a Machine by a decrement alone,
    /// then the pending Machines [`removal::cancellation_plan`] pins ([`Actuator::pin_pending`]).
    async fn cancel(&self, id: &str, group: &NodeGroup, by: u32) -> Result<(), ActuatorError> {
        // Registered nodes as of the group the call decided from, before it was confirmed.
        let asked = group;
        let (group, _) = self.confirm(id, group).await?;
        let delete_key = self.store.settings().keys.delete_machine.clone();
        // The plan over `state` and the Machines as cached: `by` in all, every refusal checked.
        let plan = |state: &GroupState, by: u32| -> Result<(usize, Vec<String>), ActuatorError> {
            let current = state.replicas;
            let delta = -i32::try_from(by).unwrap_or(i32::MAX);
            if let Some(e) = refuse_registered(asked, current, delta) {
                return Err(e);
            }
            let (_, now) = self.group(id)?;
            let machines = self.machines(&now);
            let members = members(&now, &machines, &delete_key);
            let plan = removal::cancellation_plan(&members, current, by)
                .map_err(|why| cancellation_refusal(&now, current, delta, &why))?;
            let desired = current.saturating_sub(i32::try_from(by).unwrap_or(i32::MAX));
            if !removal::within_bounds(current, desired, state.min, state.max) {
                return Err(state.out_of_bounds(&group, "size decrease", desired));
            }
            Ok((
                plan.uncreated,
                plan.pin.into_iter().map(str::to_string).collect(),
            ))
        };
        let grace = self.mark_grace.as_secs();
        let hold =
            |state: &GroupState, uncreated: usize| uncreated_hold(id, state, uncreated, grace);
        let cached = self.cached(&group)?;
        let (uncreated, mut pin) = plan(&cached, by)?;
        hold(&cached, uncreated)?;
        if uncreated > 0 {
            // The pending Machines this call still pins after the decrement, as last decided.
            let pinned = std::sync::atomic::AtomicUsize::new(pin.len());
            self.write(&group, "decrease-target-size", true, |state| {
                let (uncreated, pin) = plan(state, by)?;
                hold(state, uncreated)?;
                pinned.store(pin.len(), std::sync::atomic::Ordering::Relaxed);
                Ok((uncreated > 0).then(|| Change {
                    replicas: state.replicas - uncreated as i32,
                    entries: Vec::new(),
                }))
            })
            .await?;
            let rest = pinned.load(std::sync::atomic::Ordering::Relaxed);
            if rest == 0 {
                return Ok(());
            }
            // Decided again from the objects as they are now: the Machines to pin may have changed.
            let (_, state) = self.confirm(id, &group).await?;
            let rest = u32::try_from(rest).unwrap_or(u32::MAX);
            let (left, now) = plan(&state, rest)?;
            if left > 0 {
                return Err(ActuatorError::Conflict(format!(
                    "{id}: capacity without a Machine was cancelled, but replicas still exceed the Machines by {left}: Cluster API changed the group meanwhile; nothing more written"
                )));
            }
            pin = now;
        }
        if pin.is_empty() {
            return Ok(());
        }
        self.pin_pending(id, &pin).await
    }

    /// Marks and pays the pending Machines `pin` of a DecreaseTargetSize like a DeleteNodes of them
    /// ([`Actuator::remove_machines`]), refused if one got its Node or went meanwhile.
    async fn pin_pending(&self, id: &str, pin: &[String]) -> Result<(), ActuatorError> {
        let (_, group) = self.group(id)?;
        let namespace = group.resource.key.namespace.clone();
        let named: Vec<ObjectKey> = pin
            .iter()
            .map(|name| ObjectKey::new(namespace.as_str(), name.as_str()))
            .collect();
        // A Machine that got its Node after the decision is never marked by this call: marks are
        // guarded by the version decided from, and a conflict re-reads it and lands here. One
        // Cluster API started deleting meanwhile (for Machines it created beyond the count) would
        // make the decrement look paid already, and CA's target would not drop by its delta.
        let still_pending = |group: &NodeGroup, marking: &[String]| {
            let machines = self.machines(group);
            let state = |name: &str| machines.iter().find(|(k, _)| k.name == name);
            let went = pin
                .iter()
                .find(|name| state(name).is_none_or(|(_, m)| m.deleting));
            let registered = marking
                .iter()
                .find(|name| state(name).is_some_and(|(_, m)| m.node_ref.is_some()));
            match went.or(registered) {
                Some(name) => Err(ActuatorError::Refused(format!(
                    "{id}: attempt to delete existing nodes: Machine {namespace}/{name} got its Node, or is being deleted, while DecreaseTargetSize was cancelling it; marks of this call taken back, nothing more written"
                ))),
                None => Ok(()),
            }
        };
        self.remove_machines(
            id,
            &group,
            &named,
            0,
            "decrease-target-size",
            &still_pending,
        )
        .await
        .map(|_| ())
    }

    async fn delete(&self, id: &str, nodes: &[NodeToDelete]) -> Result<(), ActuatorError> {
        let (snapshot, _) = self.group(id)?;
        let group_lock = self.group_lock(&snapshot, id);
        let _guard = group_lock.lock().await;
        let (snapshot, group) = self.group(id)?;
        // During a rollout the MachineDeployment controller picks the MachineSet that shrinks, so
        // a lower replica count may take another node than the one marked.
        refuse_during_rollout(&group, "scale-down")?;
        // Every node resolved before anything is touched.
        let plan = removal_plan(&snapshot, &self.store.settings().keys, &group, nodes)?;
        // Capacity never created is cancelled first; the other nodes of the call then as usual.
        let held = plan
            .iter()
            .filter(|(n, m)| m.is_none() && is_held(n))
            .count();
        let group = if held > 0 {
            self.cancel_held(id, &group, held).await?;
            self.group(id)?.1
        } else {
            group
        };
        let plan: Vec<_> = plan
            .into_iter()
            .filter(|(n, m)| m.is_some() || !is_held(n))
            .collect();
        let named: Vec<ObjectKey> = plan.iter().filter_map(|(_, m)| m.clone()).collect();
        let pool_nodes: Vec<&NodeToDelete> = plan
            .iter()
            .filter(|(_, m)| m.is_none())
            .map(|(n, _)| n)
            .collect();
        let pool_owed = self.cached(&group).map_or(0, |state| {
            removal::unpaid_pool_nodes(
                &state.ledger,
                pool_nodes.iter().map(|n| n.provider_id.as_str()),
            )
        });
        let mut group = group;
        if !named.is_empty() {
            group = self
                .remove_machines(
                    id,
                    &group,
                    &named,
                    pool_owed,
                    "delete-nodes",
                    &|_, _| Ok(()),
                )
                .await?;
        } else if pool_owed > 0 {
            let state = self.cached(&group)?;
            let desired = state.replicas - pool_owed as i32;
            if !removal::within_bounds(state.replicas, desired, state.min, state.max) {
                return Err(state.out_of_bounds(
                    &group,
                    &format!("deleting {pool_owed} node(s)"),
                    desired,
                ));
            }
        }
        for node in pool_nodes {
            let entry = pool_node_entry(&node.provider_id);
            // Re-checked on every attempt: a removal paid meanwhile (by another writer, or an
            // earlier attempt that landed) is not paid twice.
            self.write(&group, "delete-nodes", false, |state| {
                Ok((!state.ledger.contains(&entry)).then(|| Change {
                    replicas: state.replicas - 1,
                    entries: vec![entry.clone()],
                }))
            })
            .await?;
            tracing::info!(group = id, node = %node.describe(), "no Machine for this MachinePool node: lowered replicas only");
        }
        Ok(())
    }

    /// Removes `count` instances Cluster API's preflight checks hold back (CA deletes instances it
    /// was told failed to create): lowers replicas by as many, decided from the group and its
    /// Machines as the API has them, never below the Machines there are ([`preflight::cancel`]).
    async fn cancel_held(
        &self,
        id: &str,
        group: &NodeGroup,
        count: usize,
    ) -> Result<(), ActuatorError> {
        let (group, _) = self.confirm(id, group).await?;
        self.write(&group, "delete-nodes", true, |state| {
            let (_, now) = self.group(id)?;
            let machines = self
                .machines(&now)
                .iter()
                .filter(|(_, m)| !m.deleting)
                .count();
            let desired = preflight::cancel(state.replicas, machines, count)
                .map_err(|why| ActuatorError::Refused(format!("{id}: {why}")))?;
            if !removal::within_bounds(state.replicas, desired, state.min, state.max) {
                return Err(state.out_of_bounds(
                    &group,
                    &format!("removing {count} held-back instance(s)"),
                    desired,
                ));
            }
            Ok(Some(Change {
                replicas: desired,
                entries: Vec::new(),
            }))
        })
        .await?;
        tracing::info!(
            group = id,
            count,
            "instances held back by Cluster API's preflight checks removed: replicas lowered"
        );
        Ok(())
    }

    /// The group's Machines (as cached) in the rules' terms, with the group as of now.
    fn deletion_of(
        &self,
        id: &str,
        names: &BTreeSet<&str>,
        state: &GroupState,
    ) -> Result<(NodeGroup, Marks, Decided), ActuatorError> {
        let (_, group) = self.group(id)?;
        let delete_key = &self.store.settings().keys.delete_machine;
        let machines = self.machines(&group);
        // A named Machine gone from the group (deleted, or moved) is never answered as removed
        // by a decision that did not count it.
        if let Some(missing) = names
            .iter()
            .find(|n| !machines.iter().any(|(k, _)| k.name == **n))
        {
            return Err(ActuatorError::NotFound(format!(
                "{id}: Machine {}/{missing} is no longer one of the group's Machines",
                group.resource.key.namespace
            )));
        }
        let states = members(&group, &machines, delete_key);
        let marks: Vec<(String, Option<String>)> = machines
            .iter()
            .map(|(k, m)| (k.name.to_string(), m.annotations.get(delete_key).cloned()))
            .collect();
        let decided = match removal::deletion(&states, names, state.replicas, &state.ledger) {
            Deletion::Proceed {
                mark, decrement, ..
            } => Decided::Proceed {
                mark: mark.into_iter().map(str::to_string).collect(),
                decrement,
            },
            Deletion::Absorbed(names) => Decided::Refused(absorbed_refusal(
                &group,
                state,
                &Counts::of(state.replicas, &state.ledger, states.iter().copied()),
                &names,
            )),
            Deletion::OthersMarked(others) => {
                Decided::Refused(others_marked_refusal(&group, state, &others))
            }
            Deletion::NotCreated { replicas, members } => {
                Decided::Refused(ActuatorError::Refused(format!(
                    "{id}: replicas ({replicas}) exceed the {members} Machine(s) of {} {} not being deleted: Cluster API creates Machines for them first, so lowering replicas now would cancel one not created yet and the named node(s) would stay; nothing written. Once the Machines exist the removal can proceed (or DecreaseTargetSize cancels those never created)",
                    group.kind(),
                    group.resource.key,
                )))
            }
        };
        Ok((group, marks, decided))
    }

    /// Removes the named Machines of a group by [`removal::deletion`], decided from the group and
    /// its Machines as the API has them (read before deciding, and again on every conflict): marks
    /// the named Machines, then lowers replicas by what makes Cluster API's own order remove
    /// exactly them, with the ledger entries in the same write. Refused, nothing written, when
    /// another Machine's mark would go first. A mark written here is taken back when the decrement
    /// certainly did not land (a mark someone else set restored); when its outcome is unknown it
    /// stays, and the counts decide later. `pool_owed`: decrements the same call still writes for
    /// MachinePool nodes without a Machine (checked against min together). `operation` names the
    /// writes (metrics, Events); `before_marking` may refuse, on every decision, the Machines about
    /// to be marked (the call's marks taken back). DecreaseTargetSize pins its Machines this way.
    async fn remove_machines(
        &self,
        id: &str,
        group: &NodeGroup,
        named: &[ObjectKey],
        pool_owed: usize,
        operation: &'static str,
        before_marking: &BeforeMarking<'_>,
    ) -> Result<NodeGroup, ActuatorError> {
        let delete_key = self.store.settings().keys.delete_machine.clone();
        let names: BTreeSet<&str> = named.iter().map(|k| k.name.as_str()).collect();
        let namespace = group.resource.key.namespace.clone();
        let (_, mut state) = self.confirm(id, group).await?;
        // Marks written by this call: the Machine and the value it carried before.
        let mut written: Vec<(ObjectKey, Option<String>)> = Vec::new();
        let mut attempt = 0;
        let (group, decrement) = loop {
            let (group, marks, decided) = self.deletion_of(id, &names, &state)?;
            let (mark, decrement) = match decided {
                Decided::Refused(e) => {
                    self.take_back(&written, &delete_key).await;
                    return Err(e);
                }
                Decided::Proceed {
                    mark, decrement, ..
                } => (mark, decrement),
            };
            if let Err(e) = before_marking(&group, &mark) {
                self.take_back(&written, &delete_key).await;
                return Err(e);
            }
            let total = (decrement + pool_owed) as i32;
            let desired = state.replicas - total;
            if total > 0 && !removal::within_bounds(state.replicas, desired, state.min, state.max) {
                self.take_back(&written, &delete_key).await;
                return Err(state.out_of_bounds(
                    &group,
                    &format!("deleting {total} node(s)"),
                    desired,
                ));
            }
            let changed = match self
                .mark_each(
                    &namespace,
                    &mark,
                    &marks,
                    &delete_key,
                    &state.ledger,
                    &mut written,
                )
                .await
            {
                Ok(changed) => changed,
                Err(e) => {
                    // A mark that landed unseen is owed a decrement: a retry pays it, else
                    // the repair takes it back after the grace period.
                    self.take_back(&written, &delete_key).await;
                    return Err(e);
                }
            };
            let Some(key) = changed else {
                break (group, decrement);
            };
            attempt += 1;
            if attempt >= MAX_ATTEMPTS {
                self.take_back(&written, &delete_key).await;
                return Err(ActuatorError::Conflict(format!(
                    "{id}: Machine {key} kept changing while it was being marked, {MAX_ATTEMPTS} attempts"
                )));
            }
            self.read_machine(&key).await?;
            state = self.cached(&group)?;
        };
        // Checked again over every version the write meets (a conflict re-reads the group and
        // lists the Machines): a mark written meanwhile refuses it; an earlier attempt that landed
        // is not paid twice; replicas lowered by someone else meanwhile are taken as paying for
        // the named Machines (Cluster API deletes the marked ones first for them).
        let decided = (state.replicas, state.ledger.clone());
        let result = self
            .write(&group, operation, true, |state| {
                let (now_group, marks, now) = self.deletion_of(id, &names, state)?;
                before_marking(&now_group, &[])?;
                decrement_over(
                    id,
                    &names,
                    &marks,
                    now,
                    state,
                    decrement,
                    (decided.0, &decided.1),
                    now_unix(),
                )
            })
            .await;
        match result {
            Ok(_) => Ok(group),
            Err(e) if e.is_unreachable() => {
                tracing::warn!(group = %group.id, "decrement outcome unknown, the marks stay for the counts to settle: {e}");
                Err(e)
            }
            Err(e) => {
                if !written.is_empty() {
                    tracing::warn!(group = %group.id, "decrement failed, taking the delete marks back: {e}");
                }
                self.take_back(&written, &delete_key).await;
                Err(e)
            }
        }
    }
}

/// What the decrement of a removal of `names` writes over the version `state` of the group (its
/// decision, no I/O), `now` being [`removal::deletion`] over that version and `marks` the group's
/// Machines with their marks: refused when a mark was removed meanwhile or a repair is taking one
/// back; `None` when nothing is owed any more (an earlier attempt landed, replicas were lowered
/// for them); else the lower replicas with the ledger entries [`removal::owed_payments`] pays.
#[allow(clippy::too_many_arguments)]
fn decrement_over(
    id: &str,
    names: &BTreeSet<&str>,
    marks: &Marks,
    now: Decided,
    state: &GroupState,
    decrement: usize,
    decided: (i32, &Ledger),
    paid_at: u64,
) -> Result<Option<Change>, ActuatorError> {
    match now {
        Decided::Refused(e) => return Err(e),
        Decided::Proceed { mark, .. } if !mark.is_empty() => {
            return Err(ActuatorError::Conflict(format!(
                "{id}: the delete mark of Machine(s) {} was removed while they were being removed",
                mark.join(", ")
            )));
        }
        Decided::Proceed { .. } => {}
    }
    // A repair is taking one of these marks back (another provider's, which decided
    // from the objects that no decrement paid it): paying it now would land after the
    // unmark, and Cluster API would delete a Machine nobody marked.
    if let Some((name, _)) = marks.iter().find(|(name, mark)| {
        names.contains(name.as_str()) && state.taking_back.pays(name, mark.as_deref())
    }) {
        return Err(ActuatorError::Refused(format!(
            "{id}: the delete mark of Machine {name} is being taken back by a repair (its {TAKING_BACK_ANNOTATION} annotation): nothing written; ask again once it is gone, as a fresh removal"
        )));
    }
    // The named Machines' marks (ours, or another's kept as its writer left it) that
    // no entry pays for yet, as many as are still owed.
    let entries = removal::owed_payments(
        names,
        marks,
        decrement,
        decided,
        (state.replicas, &state.ledger),
        paid_at,
    );
    if entries.is_empty() {
        return Ok(None);
    }
    Ok(Some(Change {
        replicas: state.replicas - entries.len() as i32,
        entries,
    }))
}

/// A check [`Actuator::remove_machines`] runs over the group (as cached) and the Machines it is
/// about to mark, before marking them: a DecreaseTargetSize never marks a Machine that got its
/// Node since it decided.
type BeforeMarking<'a> = dyn Fn(&NodeGroup, &[String]) -> Result<(), ActuatorError> + Sync + 'a;

/// Each Machine of a group with the delete mark it carries (as cached).
type Marks = Vec<(String, Option<String>)>;

/// What [`removal::deletion`] decided, owned (the rules borrow from the cache's Machines).
enum Decided {
    Proceed { mark: Vec<String>, decrement: usize },
    Refused(ActuatorError),
}

/// The refusal of a decrease by `-delta` from `current` replicas that would leave fewer than the
/// group's registered nodes (as of the group decided from).
fn refuse_registered(group: &NodeGroup, current: i32, delta: i32) -> Option<ActuatorError> {
    let registered = group.registered;
    let desired = current.saturating_add(delta);
    (desired < registered).then(|| ActuatorError::Refused(format!(
        "{}: attempt to delete existing nodes: replicas {current}, delta {delta}, registered nodes {registered}",
        group.id
    )))
}

/// Capacity without a Machine is not cancelled while Cluster API may still be creating Machines
/// for the last raise (by any provider: read from the group object): one it creates after this
/// decision could not be pinned, and the lower count could delete it, registered by then,
/// unmarked. CA calls DecreaseTargetSize only after --max-node-provision-time, long after its raise.
fn uncreated_hold(
    id: &str,
    state: &GroupState,
    uncreated: usize,
    grace: u64,
) -> Result<(), ActuatorError> {
    match removal::uncreated_hold(uncreated, state.raised, now_unix(), grace) {
        Some(until) => Err(ActuatorError::Refused(format!(
            "{id}: {uncreated} of the replicas to cancel have no Machine yet and the group was raised at unix {} (within --mark-grace-period {grace}s): Cluster API may still be creating Machines for that raise; nothing written, retry after unix {until}",
            state.raised.unwrap_or_default()
        ))),
        None => Ok(()),
    }
}

/// Refuses `operation` while the group's MachineDeployment rolls out: the MachineDeployment
/// controller then picks which MachineSet shrinks (the old one, within maxUnavailable), so a lower
/// replica count may remove a registered node of it instead of the one marked or the one pending.
fn refuse_during_rollout(group: &NodeGroup, operation: &str) -> Result<(), ActuatorError> {
    match &group.rollout {
        Some(rollout) => Err(ActuatorError::Refused(format!(
            "{}: MachineDeployment {} is rolling out ({}): {operation} is paused until the rollout finishes",
            group.id,
            group.resource.key,
            rollout.reason()
        ))),
        None => Ok(()),
    }
}

/// The refusal of a DeleteNodes while other Machines carry a delete mark the replicas do not
/// remove yet: Cluster API deletes marked Machines first, whoever marked them, so a decrement now
/// would remove one of those instead of, or besides, a named one. Nothing is written.
fn others_marked_refusal(group: &NodeGroup, state: &GroupState, others: &[&str]) -> ActuatorError {
    ActuatorError::Refused(format!(
        "{}: other Machines of {} {} carry the delete-machine mark and replicas ({}) do not remove them yet: {}; Cluster API deletes marked Machines first, whoever marked them, so lowering replicas now would remove one of them instead of the named node(s); nothing written. Remove those marks, or lower replicas for them, and the removal can proceed",
        group.id,
        group.kind(),
        group.resource.key,
        state.replicas,
        others.join(", "),
    ))
}

/// The refusal of a DecreaseTargetSize that would make Cluster API remove a marked or a
/// registered Machine.
fn cancellation_refusal(
    group: &NodeGroup,
    replicas: i32,
    delta: i32,
    why: &Cancellation<'_>,
) -> ActuatorError {
    let what = match why {
        Cancellation::Marked(names) => format!(
            "Machines {} carry the delete-machine mark and Cluster API deletes them first",
            names.join(", ")
        ),
        Cancellation::Registered { removes, pending } => format!(
            "Cluster API would remove {removes} unmarked Machine(s) and only {pending} never got a node"
        ),
        Cancellation::Unhealthy(names) => format!(
            "Cluster API ranks the registered Machine(s) {} unhealthy (NodeHealthy or HealthCheckSucceeded False), like those without a node, and would remove them by name first",
            names.join(", ")
        ),
    };
    ActuatorError::Refused(format!(
        "{}: attempt to delete existing nodes: replicas {replicas}, delta {delta}: {what}",
        group.id
    ))
}

/// The refusal of a DeleteNodes naming nodes whose paid marks a raise absorbed: nothing is written,
/// CA cleans its taint off the nodes and may ask again, a fresh removal once the repair has taken
/// the marks back.
fn absorbed_refusal(
    group: &NodeGroup,
    state: &GroupState,
    counts: &Counts,
    machines: &[&str],
) -> ActuatorError {
    let nodes: Vec<String> = machines.iter().map(|m| format!("Machine {m}")).collect();
    ActuatorError::Refused(format!(
        "{}: {}: removal paid already (the mark is in the {LEDGER_ANNOTATION} annotation of {} {}), but replicas were raised since: {} replicas make Cluster API remove {} of the group's {} Machines with a paid mark, so the raise absorbed {}: which marked Machine stays as its capacity is Cluster API's choice; refused until the repair takes the absorbed marks back (the mark grace period after the last raise), after which this is a fresh removal",
        group.id,
        nodes.join(", "),
        group.kind(),
        group.resource.key,
        state.replicas,
        counts.surplus(),
        counts.paid,
        counts.absorbed(),
    ))
}

/// Whether CA names an instance Cluster API's preflight checks hold back (CA's fake node for it
/// carries the instance id as providerID and name).
fn is_held(node: &NodeToDelete) -> bool {
    preflight::is_held_id(&node.provider_id) || preflight::is_held_id(&node.name)
}

/// Each node to remove with its Machine (`None`: a MachinePool node listed in its providerIDList
/// without one, or an instance a preflight check holds back), duplicates dropped; an error, before anything is written, for a node of no group,
/// of another group, or without a Machine outside a pool's list.
fn removal_plan(
    snapshot: &Snapshot,
    keys: &crate::capi::Keys,
    group: &NodeGroup,
    nodes: &[NodeToDelete],
) -> Result<Vec<(NodeToDelete, Option<ObjectKey>)>, ActuatorError> {
    let id = group.id.as_str();
    let mut plan: Vec<(NodeToDelete, Option<ObjectKey>)> = Vec::new();
    let mut seen: BTreeSet<String> = BTreeSet::new();
    for node in nodes {
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
        let dedupe = match &location.machine {
            Some(m) => format!("machine:{m}"),
            None => pool_node_entry(&node.provider_id),
        };
        if !seen.insert(dedupe) {
            continue;
        }
        if location.machine.is_none()
            && !is_held(node)
            && !(group.kind() == ScalableKind::MachinePool && location.in_pool_list)
        {
            return Err(ActuatorError::Refused(format!(
                "{}: no Machine found, and it is not in the providerIDList of {id}",
                node.describe()
            )));
        }
        plan.push((node.clone(), location.machine.clone()));
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::removal::our_mark;

    fn state(replicas: i32, ledger: &str, taking_back: &str) -> GroupState {
        GroupState {
            replicas,
            min: 0,
            max: 10,
            ledger: Ledger::parse(Some(ledger)),
            raised: None,
            taking_back: Ledger::parse(Some(taking_back)),
            listed: BTreeSet::new(),
            resource_version: "1".into(),
        }
    }

    fn proceed() -> Decided {
        Decided::Proceed {
            mark: Vec::new(),
            decrement: 1,
        }
    }

    /// m1 named and marked (ours, at 100), 3 Machines, replicas 3 when decided: one decrement
    /// with its entry; nothing over a version it landed in; refused while a repair takes the
    /// mark back; a conflict when the mark went meanwhile.
    #[test]
    fn the_decrement_over_each_version_pays_once_and_never_a_mark_being_taken_back() {
        let names: BTreeSet<&str> = ["m1"].into();
        let marks: Marks = vec![
            ("m0".into(), None),
            ("m1".into(), Some(our_mark(100))),
            ("m2".into(), None),
        ];
        let none = Ledger::default();
        let pays = |over: &GroupState, now: Decided| {
            decrement_over("g", &names, &marks, now, over, 1, (3, &none), 500)
        };
        let change = pays(&state(3, "", ""), proceed())
            .expect("owed")
            .expect("a write");
        assert_eq!(
            (change.replicas, change.entries),
            (2, vec!["m1@100".to_string()])
        );
        assert!(
            pays(&state(2, "m1@100", ""), proceed())
                .expect("landed")
                .is_none(),
            "an earlier attempt that landed is not paid twice"
        );
        assert!(
            pays(&state(2, "", ""), proceed())
                .expect("by hand")
                .is_none(),
            "replicas lowered by someone else pay for it"
        );
        assert!(matches!(
            pays(&state(3, "", "m1@100"), proceed()),
            Err(ActuatorError::Refused(m)) if m.contains("taken back by a repair")
        ));
        let unmarked = Decided::Proceed {
            mark: vec!["m1".into()],
            decrement: 1,
        };
        assert!(matches!(
            pays(&state(3, "", ""), unmarked),
            Err(ActuatorError::Conflict(m)) if m.contains("was removed while")
        ));
        let refused = Decided::Refused(ActuatorError::Refused("absorbed".into()));
        assert_eq!(
            pays(&state(3, "", ""), refused).err(),
            Some(ActuatorError::Refused("absorbed".into()))
        );
    }
}
