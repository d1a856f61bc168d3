//! What an operation decides from: the group object and its members as one read of the API returned
//! them, and each member's standing in the removals the group records.

use std::collections::BTreeSet;

use super::ledger::{Entry, Ledger, Resizes, entry_for, our_mark_stamp};

/// Why Cluster API, or this provider, would not act on a group's size now. Read afresh before
/// every decision: the cache can lag a pause, a rollout or a topology that took over replicas.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Hold {
    /// The paused annotation on the group, or its Cluster paused: Cluster API acts on nothing.
    Paused(String),
    /// The group's MachineDeployment rolls out: the MachineDeployment controller picks which
    /// MachineSet shrinks, so a lower count may remove another node than the one marked. Removals
    /// only; a raise is fine.
    RollingOut(String),
    /// The Cluster's managed topology sets the group's replicas: the topology controller undoes
    /// every write.
    Topology(String),
}

impl Hold {
    /// Whether the hold refuses a raise too (a rollout refuses only removals).
    pub fn refuses_raise(&self) -> bool {
        !matches!(self, Hold::RollingOut(_))
    }

    pub fn reason(&self) -> &str {
        match self {
            Hold::Paused(r) | Hold::RollingOut(r) | Hold::Topology(r) => r,
        }
    }
}

/// The group object as read.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GroupRead {
    /// `metadata.resourceVersion`: every write is guarded by the version it was decided from.
    pub version: String,
    pub replicas: i32,
    /// `(min, max)`, or why the annotations cannot be read.
    pub bounds: Result<(i32, i32), String>,
    pub ledger: Ledger,
    pub claims: Ledger,
    pub taking_back: Ledger,
    pub resizes: Resizes,
    /// Cluster API has acted on this version's replicas: the group's controller (and for a
    /// MachineDeployment, its MachineSet's) has observed the generation and the MachineSet's
    /// replicas are the group's. Until then it may still act on an older count.
    pub observed: bool,
    /// Capacity beyond the members will not become a Machine that could be pinned: Cluster API's
    /// preflight checks hold its creation of Machines, or a MachinePool's infrastructure makes
    /// none (its instances appear in providerIDList alone).
    pub held: bool,
    pub hold: Option<Hold>,
}

/// A member of the group: a Machine, or a MachinePool instance without one.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Member {
    /// The Machine's name; a MachinePool instance without a Machine: its pool entry
    /// ([`super::ledger::pool_node_entry`]).
    pub name: String,
    /// The Machine's resourceVersion: marks are guarded by it.
    pub version: String,
    /// The delete-machine annotation's value.
    pub mark: Option<String>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// It has a Node (`status.nodeRef`).
    pub registered: bool,
    /// Registered, but Cluster API ranks it unhealthy (NodeHealthy or HealthCheckSucceeded False,
    /// or a terminal failure): with those without a Node, what it deletes right after the marked.
    pub unhealthy: bool,
    /// A MachinePool instance without a Machine: never marked, its removal is a pool entry.
    pub machineless: bool,
}

impl Member {
    /// Whether Cluster API ranks it among the first to delete after the marked ones.
    pub fn ranks_unhealthy(&self) -> bool {
        !self.registered || self.unhealthy
    }
}

/// One read: the group, then its members listed after it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Read {
    pub group: GroupRead,
    /// Empty for an operation that does not read them ([`super::Operation::reads_members`]); its
    /// group's `observed` and a [`Hold::RollingOut`] are then as cached, which it does not read.
    pub members: Vec<Member>,
}

/// Where a member stands in the group's removals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standing {
    Unmarked,
    /// Its mark's removal is settled (`entry` in the ledger).
    Settled(String),
    /// Its mark's removal is claimed, not settled yet.
    Claimed(String),
    /// Its mark (ours) is being taken back.
    TakingBack(String),
    /// A mark of ours no entry records (an earlier version's, or a removal that lost its claim).
    Unrecorded(String),
    /// Someone else's mark no entry records.
    Foreign,
}

impl Read {
    pub fn member(&self, name: &str) -> Option<&Member> {
        self.members.iter().find(|m| m.name == name)
    }

    /// Where `member` stands.
    pub fn standing(&self, member: &Member) -> Standing {
        let g = &self.group;
        if member.machineless {
            return if g.ledger.contains(&member.name) {
                Standing::Settled(member.name.clone())
            } else if g.claims.contains(&member.name) {
                Standing::Claimed(member.name.clone())
            } else {
                Standing::Unmarked
            };
        }
        let Some(mark) = member.mark.as_deref() else {
            return Standing::Unmarked;
        };
        let name = member.name.as_str();
        if let Some(e) = g.ledger.naming(name, mark) {
            Standing::Settled(e.to_string())
        } else if let Some(e) = g.claims.naming(name, mark) {
            Standing::Claimed(e.to_string())
        } else if let Some(e) = g.taking_back.naming(name, mark) {
            Standing::TakingBack(e.to_string())
        } else if let Some(stamp) = our_mark_stamp(mark) {
            Standing::Unrecorded(super::ledger::mark_entry(name, stamp))
        } else {
            Standing::Foreign
        }
    }

    /// Claimed entries, and entries being taken back, whose Machine is gone: Cluster API deleted
    /// it (or someone did), and the removal is owed its settlement. (An entry being taken back
    /// whose unmark landed before the Machine went looks the same: the balance then credits it.)
    pub fn gone_claims(&self) -> Vec<&str> {
        self.group
            .claims
            .iter()
            .chain(self.group.taking_back.iter())
            .filter(|e| match Entry::parse(e) {
                Some(Entry::PoolNode(_)) => !self.members.iter().any(|m| m.name == *e),
                Some(entry) => {
                    entry
                        .machine()
                        .is_some_and(|machine| self.member(machine).is_none())
                        && !self.superseded(&entry)
                }
                None => false,
            })
            .collect()
    }

    /// Whether a later removal of the same Machine is recorded: its mark replaced this entry's,
    /// so this entry's mark was gone before its Machine went (a mark taken back, then the Machine
    /// removed again as a fresh removal), and nothing is owed for it.
    pub fn superseded(&self, entry: &Entry) -> bool {
        let (Some(machine), Some(stamp)) = (entry.machine(), entry.stamp()) else {
            return false;
        };
        let g = &self.group;
        g.ledger
            .iter()
            .chain(g.claims.iter())
            .chain(g.taking_back.iter())
            .filter_map(Entry::parse)
            .any(|e| e.machine() == Some(machine) && e.stamp().is_some_and(|s| s > stamp))
    }

    /// Claimed entries whose Machine is there, not being deleted, and carries no mark this entry
    /// names (a removal stopped between its claim and its mark, or a mark taken away): stale.
    pub fn stale_claims(&self) -> Vec<&str> {
        self.group
            .claims
            .iter()
            .filter(|e| match Entry::parse(e) {
                Some(entry @ (Entry::Ours { .. } | Entry::Foreign { .. })) => entry
                    .machine()
                    .and_then(|machine| self.member(machine))
                    .is_some_and(|m| {
                        !m.deleting
                            && !m
                                .mark
                                .as_deref()
                                .is_some_and(|mark| entry.names(&m.name, mark))
                    }),
                _ => false,
            })
            .collect()
    }

    /// The entry a claim on `member` records: the claim or settlement it has, else a new one
    /// stamped `stamp` for its mark (`mark` when it has none yet).
    pub fn entry_of(&self, member: &Member, new_mark: &str, stamp: u64) -> String {
        if member.machineless {
            return member.name.clone();
        }
        match self.standing(member) {
            Standing::Settled(e)
            | Standing::Claimed(e)
            | Standing::TakingBack(e)
            | Standing::Unrecorded(e) => e,
            Standing::Foreign => entry_for(
                &member.name,
                member.mark.as_deref().unwrap_or_default(),
                stamp,
            ),
            Standing::Unmarked => entry_for(&member.name, new_mark, stamp),
        }
    }

    /// The group's accounts, with the members named in `own` (those an operation claims or is
    /// about to claim) left out of the marks they weigh against.
    pub fn accounts(&self, own: &BTreeSet<String>) -> Accounts {
        let mut accounts = Accounts::default();
        if !self.members.is_empty() && self.members.iter().all(|m| m.machineless) {
            // A MachinePool whose infrastructure makes no Machines: nothing is marked, the
            // infrastructure picks which instance a decrement removes, so there is nothing to
            // balance; its entries only keep each removal to one decrement.
            accounts.reserved = self.reserved(own);
            return accounts;
        }
        let mut active = 0_i64;
        for member in &self.members {
            let standing = self.standing(member);
            if member.deleting {
                // A mark of ours Cluster API began deleting whose removal is not settled: its
                // settlement is owed (the surplus it took belonged to another mark, or to nobody).
                if matches!(
                    standing,
                    Standing::Claimed(_) | Standing::TakingBack(_) | Standing::Unrecorded(_)
                ) {
                    accounts.owed += 1;
                }
                continue;
            }
            active += 1;
            let claimed_by_caller = own.contains(&member.name);
            match standing {
                Standing::Settled(_) => accounts.settled += 1,
                Standing::Claimed(_) if claimed_by_caller => {}
                Standing::Claimed(_) => accounts.pending += 1,
                Standing::Unrecorded(_) | Standing::Foreign if claimed_by_caller => {}
                Standing::TakingBack(_) | Standing::Unrecorded(_) | Standing::Foreign => {
                    accounts.uncovered += 1
                }
                Standing::Unmarked => {}
            }
        }
        accounts.owed += self.gone_claims().len() as i64;
        accounts.surplus = active - i64::from(self.group.replicas);
        accounts.reserved = self.reserved(own);
        accounts
    }

    /// Every removal recorded and not settled that is not one of `own`'s: each may yet lower
    /// replicas by one (marks are interchangeable, so any may take the caller's decrement).
    fn reserved(&self, own: &BTreeSet<String>) -> i64 {
        self.group
            .claims
            .iter()
            .chain(self.group.taking_back.iter())
            .filter(|e| {
                // A pool node without a Machine is its own entry (its member's name).
                !own.contains(*e)
                    && Entry::parse(e)
                        .and_then(|e| e.machine())
                        .is_none_or(|m| !own.contains(m))
            })
            .filter(|e| {
                // Taken-back entries only while Cluster API may still take their Machine.
                self.group.claims.contains(e)
                    || Entry::parse(e)
                        .and_then(|e| e.machine())
                        .is_none_or(|m| self.member(m).is_none_or(|m| m.deleting))
            })
            .count() as i64
            + self
                .members
                .iter()
                .filter(|m| m.deleting && matches!(self.standing(m), Standing::Unrecorded(_)))
                .count() as i64
    }
}

/// A group's removals by count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Accounts {
    /// Members not being deleted beyond replicas: what Cluster API deletes, marked ones first
    /// (negative: Machines it still creates).
    pub surplus: i64,
    /// Settled marks on members not being deleted: each has its unit of surplus.
    pub settled: i64,
    /// Claimed marks of other operations on members not being deleted: their settlement comes.
    pub pending: i64,
    /// Removals whose member Cluster API is deleting or deleted, not settled yet.
    pub owed: i64,
    /// Marks on members not being deleted that no removal of ours settles or claims: someone
    /// else's, ours without a record, ours being taken back. Cluster API deletes them first all
    /// the same.
    pub uncovered: i64,
    /// Removals of others recorded and not settled: each may yet lower replicas by one.
    pub reserved: i64,
}

impl Accounts {
    /// Zero when every mark Cluster API deletes first has exactly its unit of surplus, counting
    /// the owed settlements as paid: then a new mark is deleted only for its own decrement, and a
    /// settlement removes exactly the marked. Positive: surplus no mark explains (a decrement
    /// by someone else, Cluster API deletes unmarked members for it); negative: marks the surplus
    /// does not cover (absorbed by a raise, someone else's, Machines still to be created).
    pub fn balance(&self) -> i64 {
        self.surplus + self.owed - self.settled - self.uncovered
    }
}
