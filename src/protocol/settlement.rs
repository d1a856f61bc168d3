//! What settling a removal writes, shared by a removal rolling forward and the repair: the
//! settlement of removals whose Machine Cluster API took, and the ledger pruned of entries that
//! need no record any more.

use super::ledger::{Entry, Ledger};
use super::read::Read;
use super::{GroupWrite, within_bounds};

/// The write that settles `owed` (removals whose Machine Cluster API took): each moves to the
/// ledger, replicas lowered by those the surplus (`balance` above 0: someone else's decrement) does
/// not already pay for, and not at all where that would leave the bounds (Cluster API replaces the
/// Machine then).
pub(super) fn owed_settlement(read: &Read, owed: &[String], balance: i64) -> GroupWrite {
    let g = &read.group;
    let (min, max) = g.bounds.clone().unwrap_or((i32::MIN, i32::MAX));
    let credits = usize::try_from(balance.max(0)).unwrap_or(0).min(owed.len());
    let mut paid = i32::try_from(owed.len() - credits).unwrap_or(i32::MAX);
    if !within_bounds(g.replicas, g.replicas - paid, min, max) {
        paid = 0;
    }
    let mut ledger = pruned(read);
    let mut claims = g.claims.clone();
    let mut taking_back = g.taking_back.clone();
    for e in owed {
        claims.remove(e);
        taking_back.remove(e);
        ledger.insert(e.clone());
    }
    GroupWrite {
        version: g.version.clone(),
        replicas: (paid > 0).then_some(g.replicas - paid),
        ledger: Some(ledger),
        claims: Some(claims),
        taking_back: Some(taking_back),
        resizes: None,
    }
}

/// The ledger without entries that need no record any more: a Machine's once the Machine is gone
/// or carries another mark (members are listed after the group is read, so an entry's Machine
/// existed when the entry was written). Pool entries stay; the repair drops them.
pub(super) fn pruned(read: &Read) -> Ledger {
    read.group
        .ledger
        .iter()
        .filter(|e| match Entry::parse(e) {
            // Kept after its instance left the list: CA may still retry it. The repair drops it
            // once it has stood the grace period unlisted.
            Some(Entry::PoolNode(_)) => true,
            Some(entry) => entry
                .machine()
                .and_then(|m| read.member(m))
                .is_some_and(|m| {
                    m.mark
                        .as_deref()
                        .is_some_and(|mark| entry.names(&m.name, mark))
                }),
            None => false,
        })
        .map(str::to_string)
        .collect()
}
