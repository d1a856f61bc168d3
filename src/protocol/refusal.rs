//! The answers an operation gives instead of OK, and their messages: each says what stopped it,
//! names the group and the Machines, and what would let it proceed.

use super::read::{Accounts, Hold};

/// Why an operation answers other than OK. The shell maps each to the status code CA acts on.
#[derive(Clone, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Refusal {
    /// The size the operation leads to is outside the bounds of the version it would write.
    #[error("{group}: {operation}: desired size {desired} is outside [{min}, {max}]")]
    OutOfBounds {
        group: String,
        operation: String,
        desired: i32,
        min: i32,
        max: i32,
    },
    /// A Machine or node the call names is not there.
    #[error("{0}")]
    NotFound(String),
    /// The group's state does not allow it now; nothing of the call was left written.
    #[error("{0}")]
    Precondition(String),
    /// Still conflicting with other writers after every attempt.
    #[error("{0}")]
    Conflict(String),
    /// The API could not be reached: what the call wrote may have landed.
    #[error("{0}")]
    Unavailable(String),
    /// The API refused this identity.
    #[error("{0}")]
    Forbidden(String),
    /// The API failed the call otherwise.
    #[error("{0}")]
    Failed(String),
}

impl Refusal {
    /// Whether the call's outcome is unknown to its caller (the API could not be reached):
    /// anything it wrote may stand, for the next call or the repair to settle.
    pub fn is_unknown(&self) -> bool {
        matches!(self, Refusal::Unavailable(_))
    }
}

pub fn held(group: &str, hold: &Hold, operation: &str) -> Refusal {
    Refusal::Precondition(match hold {
        Hold::RollingOut(why) => format!(
            "{group}: {why} is rolling out: {operation} is paused until the rollout finishes"
        ),
        Hold::Paused(why) => {
            format!("{group}: {why}: Cluster API does not act on it; {operation} refused")
        }
        Hold::Topology(why) => format!(
            "{group}: {why}: the topology controller undoes every scale; {operation} refused"
        ),
    })
}

pub(super) fn bounds_unreadable(group: &str, why: &str) -> Refusal {
    Refusal::Precondition(format!("{group}: {why}"))
}

/// Why a removal waits for the group's marks and replicas to balance (see
/// [`Accounts::balance`]), and what settles it.
pub(super) fn unbalanced(group: &str, accounts: &Accounts, absorbed: &[String]) -> Refusal {
    let balance = accounts.balance();
    let why = if !absorbed.is_empty() {
        format!(
            "{}: removal settled already, but replicas were raised since: {} settled mark(s) are beyond what replicas make Cluster API remove, so the raise absorbed {}: which marked Machine stays as its capacity is Cluster API's choice; refused until the repair takes the absorbed marks back (once Cluster API has observed the raise), after which this is a fresh removal",
            absorbed
                .iter()
                .map(|m| format!("Machine {m}"))
                .collect::<Vec<_>>()
                .join(", "),
            accounts.settled,
            -balance,
        )
    } else if accounts.surplus < 0 && accounts.uncovered == 0 && accounts.settled == 0 {
        format!(
            "replicas exceed the Machines not being deleted by {}: Cluster API creates Machines for them first, so lowering replicas now would cancel one not created yet and the named node(s) would stay; nothing written. Once the Machines exist the removal can proceed (or DecreaseTargetSize cancels those never created)",
            -accounts.surplus
        )
    } else if balance < 0 {
        format!(
            "other Machines carry the delete-machine mark and replicas do not remove them yet ({} uncovered, {} settled, surplus {}): Cluster API deletes marked Machines first, whoever marked them, so lowering replicas now could remove one of them instead of the named node(s); nothing written. Remove those marks, or lower replicas for them, and the removal can proceed",
            accounts.uncovered, accounts.settled, accounts.surplus
        )
    } else {
        format!(
            "replicas were lowered by someone else and Cluster API has not deleted Machines for it yet (surplus {} beyond {} marked): a mark now would be taken for that decrement; nothing written, retry once Cluster API has acted",
            accounts.surplus,
            accounts.settled + accounts.uncovered - accounts.owed
        )
    };
    Refusal::Precondition(format!("{group}: {why}"))
}

pub(super) fn registered(group: &str, machine: &str) -> Refusal {
    Refusal::Precondition(format!(
        "{group}: attempt to delete existing nodes: Machine {machine} got its Node, or is being deleted, while it was being cancelled; marks of this call taken back, nothing more written"
    ))
}

pub(super) fn mark_lost(group: &str, machine: &str) -> Refusal {
    Refusal::Conflict(format!(
        "{group}: the delete mark of Machine {machine} was removed or taken back by a repair while it was being removed (its removal was no longer claimed); marks of this call taken back: ask again, as a fresh removal"
    ))
}

pub(super) fn too_late_to_mark(group: &str) -> Refusal {
    Refusal::Unavailable(format!(
        "{group}: the API answered too slowly for this call to mark its Machines within --request-timeout of its arrival (past that, a repair may take its claim back); what it wrote is taken back: ask again"
    ))
}

pub(super) fn taking_back(group: &str, machine: &str) -> Refusal {
    Refusal::Precondition(format!(
        "{group}: the delete mark of Machine {machine} is being taken back by a repair: nothing written; ask again once it is gone, as a fresh removal"
    ))
}

pub(super) fn gave_up(group: &str, what: &str) -> Refusal {
    Refusal::Conflict(format!(
        "{group}: {what}: still conflicting after {} attempts",
        super::MAX_ATTEMPTS
    ))
}

pub(super) fn not_observed(group: &str) -> Refusal {
    Refusal::Precondition(format!(
        "{group}: Cluster API has not yet acted on the group's last change (its observedGeneration, or its MachineSet's replicas, lag), or is creating Machines for it (also the replacements of Machines being deleted): capacity without a Machine may still become one; nothing written, retry in a moment"
    ))
}
