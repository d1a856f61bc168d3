//! The write protocol, sans I/O: every decision of IncreaseSize, DecreaseTargetSize, DeleteNodes and
//! the repair, as state machines fed what the API returned and asked for the next step.
//!
//! An operation starts with [`Next::Read`]; the shell reads the group object and then lists its
//! members ([`Read`]; neither its MachineSets nor its members for an operation that decides from
//! the group object and its Cluster alone, [`Operation::reads_members`]) and feeds them to
//! [`Operation::read`]; the operation answers with the next
//! guarded write ([`Write`]), a wait for Cluster API or another writer ([`Next::Wait`], the shell
//! reads again a moment later, or calls [`Operation::expired`] once its time is up), or its answer
//! ([`Next::Done`]). What a write did comes back through [`Operation::wrote`]: landed, a conflict
//! (the object changed since it was read), gone, or unknown (the answer was lost: landed or not,
//! the next read tells, by the entry or token every write carries). `src/scale/` executes it;
//! `tests/protocol_model.rs` explores every interleaving of it with Cluster API, users and faults.
//!
//! The rules, each in one place:
//! - **Balance** ([`Accounts::balance`]): a new mark is written, and a removal settled by a
//!   decrement, only while every mark Cluster API deletes first has exactly its unit of surplus.
//!   Marks are interchangeable to Cluster API (it ranks them equally, ties by name), so the
//!   protocol never counts on which marked Machine goes, only on how many.
//! - **Claim before mark** ([`removal`]): a removal is recorded on the group before its Machine is
//!   marked, so one interrupted anywhere, even after Cluster API deleted and removed its Machine,
//!   is settled or taken back by whoever reads the group next.
//! - **Exactly once**: a removal is settled by its entry moving from the claims to the ledger in
//!   the write that lowers replicas for it (or credits it, when a decrement by someone else
//!   already made Cluster API delete it); a mark Cluster API began deleting is always settled
//!   (rolled forward), a mark still there may be taken back (rolled back), through the
//!   taking-back record first.
//! - **Observed, not timed**: an absorbed mark is taken back, and capacity without a Machine
//!   cancelled, only once Cluster API has observed the group's current replicas
//!   ([`GroupRead::observed`]); no decision compares clocks.
//! - **Bounds** ([`within_bounds`]), **holds** ([`Hold`]: paused, rolling out, topology-managed)
//!   and **pinning** ([`cancellation`]) are checked on every fresh read.

pub mod cancellation;
pub mod ledger;
mod read;
pub mod refusal;
mod removal;
mod repair;
mod resize;
mod settlement;

pub use cancellation::{Cancellation, CancellationPlan, cancellation, cancellation_plan};
pub use ledger::{
    Ledger, Resizes, has_stamp, is_our_mark, our_mark, our_mark_stamp, pool_node_entry,
};
pub use read::{Accounts, GroupRead, Hold, Member, Read, Standing};
pub use refusal::Refusal;
pub use removal::{Purpose, Removal};
pub use repair::{Repair, RepairAction, Ripe, repair_has_work};
pub use resize::{Cancel, Raise};

/// A write the shell makes, guarded by the version it names.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Write {
    /// A merge patch of the group object: each `Some` field replaces what it names.
    Group(GroupWrite),
    /// Our mark on a Machine (`cluster.x-k8s.io/delete-machine` = `value`).
    Mark {
        machine: String,
        version: String,
        value: String,
    },
    /// The mark taken off a Machine.
    Unmark { machine: String, version: String },
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct GroupWrite {
    pub version: String,
    pub replicas: Option<i32>,
    pub ledger: Option<Ledger>,
    pub claims: Option<Ledger>,
    pub taking_back: Option<Ledger>,
    pub resizes: Option<Resizes>,
}

/// What a write did.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Landed,
    /// The object changed since the version the write was guarded by: nothing written.
    Conflict,
    /// The object is gone.
    Gone,
    /// No answer: it may or may not have landed (or land later).
    Unknown,
    /// Refused by the API (forbidden, invalid): nothing written.
    Rejected(Refusal),
}

/// What the operation asks for next.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Next {
    /// Read the group, then list its members.
    Read,
    Write(Write),
    /// Wait for Cluster API or another writer, then read again; the refusal is the answer if the
    /// operation's time runs out first.
    Wait(Refusal),
    Done(Result<(), Refusal>),
}

/// Conflicts (and unknown outcomes) an operation goes through before it gives up.
pub const MAX_ATTEMPTS: u32 = 8;

/// An operation of the protocol: one of CA's calls, or a round of the repair.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Operation {
    Raise(Raise),
    Cancel(Cancel),
    Remove(Removal),
    Repair(Repair),
}

impl Operation {
    pub fn start(&mut self) -> Next {
        Next::Read
    }

    /// Whether its decisions read the group's members and what Cluster API observed. A raise
    /// decides from the group object and its Cluster alone (replicas, bounds, its token, a pause or
    /// a managed topology; a rollout does not refuse it), so the shell lists neither MachineSets nor
    /// Machines for it: lists the API server answers only once its cache has caught up, most of a
    /// raise's time.
    pub fn reads_members(&self) -> bool {
        !matches!(self, Operation::Raise(_))
    }

    pub fn read(&mut self, read: &Read) -> Next {
        match self {
            Operation::Raise(op) => op.read(read),
            Operation::Cancel(op) => op.read(read),
            Operation::Remove(op) => op.read(read),
            Operation::Repair(op) => op.read(read),
        }
    }

    pub fn wrote(&mut self, outcome: Outcome) -> Next {
        match self {
            Operation::Raise(op) => op.wrote(outcome),
            Operation::Cancel(op) => op.wrote(outcome),
            Operation::Remove(op) => op.wrote(outcome),
            Operation::Repair(op) => op.wrote(outcome),
        }
    }

    /// The entries this operation claims while it runs.
    pub fn holds(&self) -> Vec<&String> {
        match self {
            Operation::Remove(op) => op.holds().collect(),
            Operation::Cancel(op) => op.holds(),
            Operation::Raise(_) | Operation::Repair(_) => Vec::new(),
        }
    }

    /// The read could not be made (API unreachable).
    pub fn read_failed(&mut self, why: &str) -> Next {
        Next::Done(Err(Refusal::Unavailable(format!(
            "{why}; whether every write landed is unknown (the next call or the repair looks it up)"
        ))))
    }

    /// Its time to mark is up: asked instead of a [`Write::Mark`] once the operation is older than
    /// the shell lets it mark in. The repair takes a claim back once it has stood
    /// `--mark-grace-period`; a mark written after that could be deleted for another removal's
    /// decrement, with nothing left to record it. What the operation wrote is taken back instead.
    pub fn too_late_to_mark(&mut self) -> Next {
        match self {
            Operation::Remove(op) => op.too_late_to_mark(),
            Operation::Cancel(op) => op.too_late_to_mark(),
            // Neither marks.
            Operation::Raise(_) | Operation::Repair(_) => Next::Read,
        }
    }

    /// The time to wait is up.
    pub fn expired(&mut self) -> Next {
        match self {
            Operation::Remove(op) => op.expired(),
            Operation::Cancel(op) => op.expired(),
            Operation::Raise(op) => op.expired(),
            Operation::Repair(_) => Next::Done(Ok(())),
        }
    }
}

/// Whether writing `wanted` replicas over `current` keeps the group within `[min, max]`, or, from
/// outside it (bounds changed under the group), moves it toward the range without passing it.
pub fn within_bounds(current: i32, wanted: i32, min: i32, max: i32) -> bool {
    let inside = |n: i32| (min..=max).contains(&n);
    inside(wanted)
        || (current > max && wanted < current && wanted >= min)
        || (current < min && wanted > current && wanted <= max)
}

/// How many of a group's `active` members (not being deleted) its `replicas` do not cover: Cluster
/// API deletes that many, marked ones first.
pub fn surplus(active: usize, replicas: i32) -> usize {
    active.saturating_sub(usize::try_from(replicas).unwrap_or(0))
}

#[cfg(test)]
mod tests;
