//! A round of the repair on one group: settles what Cluster API already acted on, takes back what
//! no removal will settle, and drops records nothing needs. One group write per round (then the
//! unmarks it records), decided from a fresh read; the next round picks up from the objects.
//!
//! A removal in flight on another provider looks the same as one interrupted: only entries
//! [`Ripe`] names are taken back, those older than the grace period on the API server's clock
//! (a removal stamps its entries with its start on that clock and marks only within
//! `--request-timeout` of it). The taking-back record, guarded by the version decided from, makes
//! a settlement decided before it conflict.

use std::collections::BTreeSet;

use super::ledger::{Entry, Ledger, is_our_mark};
use super::read::{Read, Standing};
use super::settlement::{owed_settlement, pruned};
use super::{GroupWrite, Next, Outcome, Write};

/// What a round did, for the log, the Events and the metrics.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RepairAction {
    /// Removals Cluster API already acted on, settled (by a decrement, or credited).
    Settled(Vec<String>),
    /// Claims whose Machine never got the mark, dropped.
    DroppedStale(Vec<String>),
    /// Marks recorded as being taken back (absorbed by a raise, or no removal settles them).
    Recorded(Vec<String>),
    /// A mark taken back (the Machine).
    Unmarked(String),
    /// Records nothing needs any more, dropped.
    Cleaned,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Phase {
    Reading,
    Writing(RepairAction),
    Unmarking(Vec<(String, String)>),
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Repair {
    ripe: Ripe,
    phase: Phase,
    /// Entries seen waiting in this round: what the caller times.
    seen: BTreeSet<String>,
    done: Vec<RepairAction>,
}

/// Which waiting entries the repair may take back: those whose removal can no longer write.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Ripe {
    /// By age on the API server's clock (Unix seconds): an entry once `now` is `grace` past its
    /// stamp (its removal's start; the removal marks only within `--request-timeout` of it); an
    /// entry with no stamp (a MachinePool instance's) once it is in `unstamped`, the ones the
    /// caller has seen waiting for the grace period.
    Aged {
        now: u64,
        grace: u64,
        unstamped: BTreeSet<String>,
    },
    /// Exactly these (the model checker's: the records no running operation holds, which is what
    /// the grace period guarantees).
    Only(BTreeSet<String>),
    /// Every one (the model checker's worst case: a provider that takes back another's removal
    /// in flight).
    All,
}

impl Ripe {
    fn contains(&self, entry: &str) -> bool {
        match self {
            Ripe::Aged {
                now,
                grace,
                unstamped,
            } => match Entry::parse(entry).and_then(|e| e.stamp()) {
                Some(stamp) => *now >= stamp.saturating_add(*grace),
                None => unstamped.contains(entry),
            },
            Ripe::Only(set) => set.contains(entry),
            Ripe::All => true,
        }
    }
}

/// Whether a round can have anything to write on a group whose records are `records` (the ledger,
/// claims and taking-back annotations) and whose members carry a delete mark, anyone's (`marked`):
/// every step settles, takes back or cleans a record or a member's mark, so on a group with
/// neither a round is done without a read, and the repair loop skips it.
pub fn repair_has_work(records: [Option<&str>; 3], marked: bool) -> bool {
    marked || records.into_iter().any(|r| !Ledger::parse(r).is_empty())
}

impl Repair {
    pub fn new(ripe: Ripe) -> Self {
        Repair {
            ripe,
            phase: Phase::Reading,
            seen: BTreeSet::new(),
            done: Vec::new(),
        }
    }

    /// Entries this round saw waiting to be settled or taken back.
    pub fn seen(&self) -> &BTreeSet<String> {
        &self.seen
    }

    /// What this round did.
    pub fn actions(&self) -> &[RepairAction] {
        &self.done
    }

    pub fn read(&mut self, read: &Read) -> Next {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Unmarking(queue) => self.unmark_next(read, queue),
            _ => self.decide(read),
        }
    }

    pub fn wrote(&mut self, outcome: Outcome) -> Next {
        match (std::mem::replace(&mut self.phase, Phase::Done), outcome) {
            (Phase::Writing(RepairAction::Recorded(entries)), Outcome::Landed) => {
                self.done.push(RepairAction::Recorded(entries.clone()));
                let queue = entries
                    .iter()
                    .filter_map(|e| {
                        Entry::parse(e)
                            .and_then(|e| e.machine())
                            .map(str::to_string)
                    })
                    .map(|m| (m, String::new()))
                    .collect();
                self.phase = Phase::Unmarking(queue);
                Next::Read
            }
            (Phase::Writing(action), Outcome::Landed) => {
                self.done.push(action);
                Next::Done(Ok(()))
            }
            (Phase::Unmarking(mut queue), Outcome::Landed) => {
                let (machine, _) = queue.remove(0);
                self.done.push(RepairAction::Unmarked(machine));
                self.phase = Phase::Unmarking(queue);
                Next::Read
            }
            (Phase::Unmarking(mut queue), Outcome::Gone) => {
                queue.remove(0);
                self.phase = Phase::Unmarking(queue);
                Next::Read
            }
            // A conflict or an unknown outcome: the next round decides again from the objects.
            _ => Next::Done(Ok(())),
        }
    }

    /// The first of the repair's steps that has something to write, in order.
    fn decide(&mut self, read: &Read) -> Next {
        if let Some(next) = self.settle_owed(read) {
            return next;
        }
        if let Some(next) = self.drop_stale_claims(read) {
            return next;
        }
        if let Some(next) = self.record_marks_to_take_back(read) {
            return next;
        }
        // 4. Marks recorded as being taken back and still there (a take-back interrupted).
        let leftover: Vec<(String, String)> = read
            .members
            .iter()
            .filter(|m| !m.deleting && matches!(read.standing(m), Standing::TakingBack(_)))
            .map(|m| (m.name.clone(), m.version.clone()))
            .collect();
        if !leftover.is_empty() {
            return self.unmark_next(read, leftover);
        }
        self.clean_records(read).unwrap_or(Next::Done(Ok(())))
    }

    /// 1. Removals Cluster API acted on (their Machine deleting or gone), never left owed.
    fn settle_owed(&mut self, read: &Read) -> Option<Next> {
        let none = BTreeSet::new();
        let balance = read.accounts(&none).balance();
        let owed: Vec<String> = read
            .members
            .iter()
            .filter(|m| m.deleting)
            .filter_map(|m| match read.standing(m) {
                Standing::Claimed(e) | Standing::TakingBack(e) | Standing::Unrecorded(e) => Some(e),
                _ => None,
            })
            .chain(read.gone_claims().into_iter().map(str::to_string))
            .collect();
        if owed.is_empty() {
            return None;
        }
        let write = owed_settlement(read, &owed, balance);
        Some(self.write(RepairAction::Settled(owed), write))
    }

    /// 2. Claims whose Machine never got (or lost) the mark: a removal stopped before marking.
    ///    Moved to the taking-back record, never just dropped: a mark of that removal still on its
    ///    way is then one being taken back (unmarked, or settled if Cluster API took it).
    fn drop_stale_claims(&mut self, read: &Read) -> Option<Next> {
        let g = &read.group;
        let stale: Vec<String> = read
            .stale_claims()
            .into_iter()
            .map(str::to_string)
            .collect();
        self.seen.extend(stale.iter().cloned());
        let ripe_stale: Vec<String> = stale
            .into_iter()
            .filter(|e| self.ripe.contains(e))
            .collect();
        if ripe_stale.is_empty() {
            return None;
        }
        let mut claims = g.claims.clone();
        let mut taking_back = g.taking_back.clone();
        for e in &ripe_stale {
            claims.remove(e);
            if matches!(Entry::parse(e), Some(Entry::Ours { .. })) {
                taking_back.insert(e.clone());
            }
        }
        Some(self.write(
            RepairAction::DroppedStale(ripe_stale),
            GroupWrite {
                version: g.version.clone(),
                claims: Some(claims),
                taking_back: (taking_back != g.taking_back).then_some(taking_back),
                ..GroupWrite::default()
            },
        ))
    }

    /// 3. Marks of ours no removal will settle: claimed and waiting (its removal stopped),
    ///    unrecorded, or settled but absorbed by a raise once Cluster API has observed it and
    ///    deletes nothing more (every settled mark still there is then beyond replicas).
    fn record_marks_to_take_back(&mut self, read: &Read) -> Option<Next> {
        let g = &read.group;
        let none = BTreeSet::new();
        let accounts = read.accounts(&none);
        let absorbed = g.observed && accounts.owed == 0 && accounts.surplus <= 0;
        let mut take: Vec<String> = Vec::new();
        for m in read
            .members
            .iter()
            .filter(|m| !m.deleting && !m.machineless)
        {
            if !m.mark.as_deref().is_some_and(is_our_mark) {
                continue;
            }
            match read.standing(m) {
                Standing::Claimed(e) | Standing::Unrecorded(e) => {
                    self.seen.insert(e.clone());
                    if self.ripe.contains(&e) {
                        take.push(e);
                    }
                }
                Standing::Settled(e) if absorbed => take.push(e),
                _ => {}
            }
        }
        if take.is_empty() {
            return None;
        }
        let mut claims = g.claims.clone();
        let mut ledger = g.ledger.clone();
        let mut taking_back = g.taking_back.clone();
        for e in &take {
            claims.remove(e);
            ledger.remove(e);
            taking_back.insert(e.clone());
        }
        Some(self.write(
            RepairAction::Recorded(take),
            GroupWrite {
                version: g.version.clone(),
                ledger: (ledger != g.ledger).then_some(ledger),
                claims: (claims != g.claims).then_some(claims),
                taking_back: Some(taking_back),
                ..GroupWrite::default()
            },
        ))
    }

    fn clean_records(&mut self, read: &Read) -> Option<Next> {
        let g = &read.group;
        // 5. Records nothing needs: taken-back entries a later removal of their Machine replaced,
        //    taken-back entries whose Machine is there without that mark (once ripe: a mark of
        //    that removal could otherwise still be on its way), settled entries whose Machine is
        //    gone or carries another mark, pool entries whose instance has been unlisted for the
        //    grace period (until then CA may retry it).
        let taking_back: super::Ledger = g
            .taking_back
            .iter()
            .filter(|e| {
                if Entry::parse(e).is_some_and(|entry| read.superseded(&entry)) {
                    return false;
                }
                let unmarked = Entry::parse(e)
                    .and_then(|entry| entry.machine().map(|m| (entry, m)))
                    .and_then(|(entry, m)| read.member(m).map(|member| (entry, member)))
                    .is_some_and(|(entry, member)| {
                        !member.deleting
                            && !member
                                .mark
                                .as_deref()
                                .is_some_and(|mark| entry.names(&member.name, mark))
                    });
                if unmarked {
                    self.seen.insert(e.to_string());
                }
                !(unmarked && self.ripe.contains(e))
            })
            .map(str::to_string)
            .collect();
        let mut ledger = pruned(read);
        let unlisted: Vec<String> = ledger
            .iter()
            .filter(|e| matches!(Entry::parse(e), Some(Entry::PoolNode(_))))
            .filter(|e| read.member(e).is_none())
            .map(str::to_string)
            .collect();
        for e in unlisted {
            self.seen.insert(e.clone());
            if self.ripe.contains(&e) {
                ledger.remove(&e);
            }
        }
        if taking_back == g.taking_back && ledger == g.ledger {
            return None;
        }
        Some(self.write(
            RepairAction::Cleaned,
            GroupWrite {
                version: g.version.clone(),
                ledger: (ledger != g.ledger).then_some(ledger),
                taking_back: (taking_back != g.taking_back).then_some(taking_back),
                ..GroupWrite::default()
            },
        ))
    }

    fn write(&mut self, action: RepairAction, write: GroupWrite) -> Next {
        self.phase = Phase::Writing(action);
        Next::Write(Write::Group(write))
    }

    /// Unmarks the next Machine of `queue` still carrying a mark being taken back, with the
    /// version just read.
    fn unmark_next(&mut self, read: &Read, mut queue: Vec<(String, String)>) -> Next {
        while let Some((machine, _)) = queue.first() {
            let member = read.member(machine);
            match member {
                Some(m) if !m.deleting && matches!(read.standing(m), Standing::TakingBack(_)) => {
                    let write = Write::Unmark {
                        machine: m.name.clone(),
                        version: m.version.clone(),
                    };
                    self.phase = Phase::Unmarking(queue);
                    return Next::Write(write);
                }
                _ => {
                    queue.remove(0);
                }
            }
        }
        Next::Done(Ok(()))
    }
}
