//! What a DecreaseTargetSize may cancel: capacity that never became a node, in Cluster API's own
//! deletion order, so that a lower count can never take a registered node.

use super::read::Member;
use super::surplus;

/// Why lowering replicas would remove more than capacity that never became a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cancellation {
    /// Marked Machines the replicas do not remove yet: Cluster API deletes them first.
    Marked(Vec<String>),
    /// Cluster API would remove `removes` unmarked Machines and only `pending` (unmarked,
    /// without a Node) can go without removing a registered node.
    Registered { removes: usize, pending: usize },
    /// Registered Machines Cluster API ranks unhealthy (like those without a Node) and would
    /// remove, by name, before or instead of the pending ones.
    Unhealthy(Vec<String>),
}

/// What a DecreaseTargetSize that [`cancellation`] allows cancels, pinned so that Cluster API's
/// own order cannot turn it into a registered node: `uncreated` replicas beyond the members (the
/// decrement alone cancels those, first), and the pending Machines (`pin`) Cluster API would
/// remove for the rest of it, which get our delete mark before the decrement (marked Machines go
/// first whatever happens to their nodeRef meanwhile).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CancellationPlan<'a> {
    pub uncreated: usize,
    pub pin: Vec<&'a str>,
}

/// Whether lowering `replicas` by `by` removes only Machines without a Node and without a mark,
/// in Cluster API's order: Machines not created yet are cancelled first; then it deletes the
/// marked Machines, then the unhealthy ones (no Node, or an unhealthy Node or MachineHealthCheck:
/// one rank, ties broken by name), then the rest. So the Machines beyond the new count must be
/// the marked ones the current count already removes, then, in that order, only pending ones.
pub fn cancellation(members: &[Member], replicas: i32, by: u32) -> Result<(), Cancellation> {
    let active: Vec<&Member> = members.iter().filter(|m| !m.deleting).collect();
    let now = surplus(active.len(), replicas);
    let marked: Vec<String> = active
        .iter()
        .filter(|m| m.mark.is_some())
        .map(|m| m.name.clone())
        .collect();
    if marked.len() > now {
        return Err(Cancellation::Marked(marked));
    }
    let after = surplus(active.len(), lowered(replicas, by));
    let removes = after - marked.len();
    let first = first_unmarked(&active);
    let pending = first.iter().filter(|m| !m.registered).count();
    if removes > first.len() {
        return Err(Cancellation::Registered { removes, pending });
    }
    let registered: Vec<String> = first
        .iter()
        .take(removes)
        .filter(|m| m.registered)
        .map(|m| m.name.clone())
        .collect();
    if !registered.is_empty() {
        return Err(Cancellation::Unhealthy(registered));
    }
    Ok(())
}

/// [`cancellation`]'s decision with what it cancels: of the unmarked Machines Cluster API ranks
/// first (pending or unhealthy, by name), those the count as it stands removes already come
/// first (not this call's; left as they are), the next ones are this call's to pin. `uncreated`
/// is the rest of `by`, what no Machine exists for.
pub fn cancellation_plan(
    members: &[Member],
    replicas: i32,
    by: u32,
) -> Result<CancellationPlan<'_>, Cancellation> {
    cancellation(members, replicas, by)?;
    let active: Vec<&Member> = members.iter().filter(|m| !m.deleting).collect();
    let marked = active.iter().filter(|m| m.mark.is_some()).count();
    let now = surplus(active.len(), replicas);
    let after = surplus(active.len(), lowered(replicas, by));
    let pin: Vec<&str> = first_unmarked(&active)
        .into_iter()
        .skip(now - marked)
        .take(after - now)
        .map(|m| m.name.as_str())
        .collect();
    Ok(CancellationPlan {
        uncreated: (by as usize).saturating_sub(pin.len()),
        pin,
    })
}

/// The unmarked members Cluster API ranks first after the marked ones (pending or unhealthy), by
/// name.
fn first_unmarked<'a>(active: &[&'a Member]) -> Vec<&'a Member> {
    let mut first: Vec<&Member> = active
        .iter()
        .copied()
        .filter(|m| m.mark.is_none() && m.ranks_unhealthy())
        .collect();
    first.sort_by(|a, b| a.name.cmp(&b.name));
    first
}

fn lowered(replicas: i32, by: u32) -> i32 {
    replicas.saturating_sub(i32::try_from(by).unwrap_or(i32::MAX))
}
