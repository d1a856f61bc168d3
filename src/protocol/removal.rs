//! A removal: DeleteNodes of some of a group's nodes, or the pinning of pending Machines a
//! DecreaseTargetSize cancels. Four steps, each decided from a fresh read but the marks, which
//! follow their claim as step 1 planned them:
//!
//! 1. **Claim**: the named Machines' entries go into the group's claims (one guarded write), only
//!    while the group balances ([`Accounts::balance`] zero): every mark Cluster API would delete
//!    first has its unit of surplus, so a mark written now is deleted only for its own decrement.
//! 2. **Mark**: each named Machine without a mark gets ours, with the claim's stamp (guarded by the
//!    Machine's version step 1 read: one marked or changed since conflicts, and is decided again
//!    from a fresh read). A Machine carrying a mark already is claimed as it is.
//! 3. **Settle**: the claims move to the ledger in the write that lowers replicas by one each,
//!    less the surplus someone else's decrement left (credited: Cluster API deletes the marked
//!    Machine for that decrement). A Machine Cluster API already took for another decrement is
//!    settled all the same, so that decrement's own mark goes too: marks are interchangeable.
//!    While the group does not balance (a raise absorbed a settled mark, someone else's mark, a
//!    Machine still to be created) the marks wait, and only removals Cluster API already acted on
//!    are settled.
//! 4. Else **take back**: the claims still pending move to the taking-back record (guarded), then
//!    the marks come off (guarded by each Machine's version). A mark Cluster API began deleting
//!    meanwhile cannot come back: it is settled instead, and the node counts as removed.

use std::collections::{BTreeMap, BTreeSet};

use super::ledger::{Entry, Ledger, our_mark};
use super::read::{Read, Standing};
use super::refusal::{self, Refusal};
use super::settlement::{owed_settlement, pruned};
use super::{GroupWrite, MAX_ATTEMPTS, Next, Outcome, Write, within_bounds};

/// Who asked for the removal: what its messages and Events say.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Purpose {
    DeleteNodes,
    /// DecreaseTargetSize pinning the pending Machines it cancels: they must still have no Node.
    Pin,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Phase {
    Deciding,
    /// The claims write is in flight; then these marks, as step 1 planned them.
    Claiming(Vec<(String, String, String)>),
    /// Marks to write, in order: (Machine, version, value).
    Marking(Vec<(String, String, String)>),
    Settling,
    /// The settle write is in flight with these entries.
    SettleWritten(Vec<String>),
    /// Taking back what is still pending, then answering `reason`.
    TakingBack(Refusal),
    /// Settling these claims Cluster API acted on, then taking back the rest.
    OwedWritten(Refusal, Vec<String>),
    /// The taking-back record is in flight; then these marks come off.
    RecordWritten(Refusal, Vec<String>),
    /// Unmarking these Machines, then answering `reason`.
    Unmarking(Refusal, Vec<(String, String)>),
    Done,
}

/// What step 1 found: the claim of each named member (new entries to record, marks to write),
/// the named members already settled, taking-back records a fresh claim replaces, and how many
/// members this removal still has to settle.
struct ClaimPlan {
    claims: BTreeMap<String, String>,
    new_claims: Vec<String>,
    marks: Vec<(String, String, String)>,
    settled_named: Vec<String>,
    replaced: Vec<String>,
    to_settle: i32,
}

/// A removal of some of a group's members.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Removal {
    group: String,
    purpose: Purpose,
    /// The members to remove (Machine names; pool entries for MachinePool nodes without a Machine).
    named: BTreeSet<String>,
    /// Members that must still have no Node when marked and when settled.
    unregistered: BTreeSet<String>,
    /// The stamp new marks start from: the removal's start on the API server's clock.
    stamp: u64,
    phase: Phase,
    /// This removal's claims: member → entry.
    claims: BTreeMap<String, String>,
    attempts: u32,
    /// Why it last waited: the answer if its time runs out.
    waited: Option<Refusal>,
    /// Its claims seen settled (the ledger may drop an entry once its Machine is gone).
    settled: BTreeSet<String>,
}

impl Removal {
    pub fn new(
        group: &str,
        purpose: Purpose,
        named: impl IntoIterator<Item = String>,
        unregistered: impl IntoIterator<Item = String>,
        stamp: u64,
    ) -> Self {
        Removal {
            group: group.to_string(),
            purpose,
            named: named.into_iter().collect(),
            unregistered: unregistered.into_iter().collect(),
            stamp,
            phase: Phase::Deciding,
            claims: BTreeMap::new(),
            attempts: 0,
            waited: None,
            settled: BTreeSet::new(),
        }
    }

    fn operation(&self) -> &'static str {
        match self.purpose {
            Purpose::DeleteNodes => "scale-down",
            Purpose::Pin => "DecreaseTargetSize",
        }
    }

    /// The members named, for the messages.
    pub fn named(&self) -> &BTreeSet<String> {
        &self.named
    }

    /// The entries this removal claims (a repair leaves them alone while it runs).
    pub fn holds(&self) -> impl Iterator<Item = &String> {
        self.claims.values()
    }

    pub fn read(&mut self, read: &Read) -> Next {
        match std::mem::replace(&mut self.phase, Phase::Deciding) {
            Phase::Deciding | Phase::Claiming(_) | Phase::Marking(_) => self.decide(read),
            Phase::Settling | Phase::SettleWritten(_) => self.settle(read),
            Phase::TakingBack(reason)
            | Phase::RecordWritten(reason, _)
            | Phase::OwedWritten(reason, _) => self.take_back(read, reason),
            Phase::Unmarking(reason, _) => self.take_back(read, reason),
            Phase::Done => Next::Done(Ok(())),
        }
    }

    pub fn wrote(&mut self, outcome: Outcome) -> Next {
        if let Outcome::Rejected(refusal) = &outcome {
            return self.rejected(refusal.clone());
        }
        let phase = std::mem::replace(&mut self.phase, Phase::Deciding);
        if matches!(outcome, Outcome::Conflict | Outcome::Unknown) {
            self.attempts += 1;
        }
        match (phase, outcome) {
            (Phase::Claiming(marks), Outcome::Landed) => {
                // The claims landed over the version step 1 read, so no other removal claimed in
                // between; each mark is guarded by the version of its Machine step 1 read, so one
                // marked meanwhile (by anyone) conflicts and is decided again from a fresh read.
                self.next_mark(marks)
            }
            (Phase::Marking(mut queue), Outcome::Landed) => {
                queue.remove(0);
                self.next_mark(queue)
            }
            (Phase::SettleWritten(entries), Outcome::Landed) => {
                self.settled.extend(entries);
                // Every claim settled: a read could only confirm it (step 3 answers OK whatever it
                // shows), so the answer goes now. Claims still pending (the group did not balance
                // for them) wait for the next read.
                if self.claims.values().all(|e| self.settled.contains(e)) {
                    return self.finish(Ok(()));
                }
                self.phase = Phase::Settling;
                Next::Read
            }
            (Phase::OwedWritten(reason, entries), Outcome::Landed) => {
                self.settled.extend(entries);
                self.phase = Phase::TakingBack(reason);
                Next::Read
            }
            (Phase::RecordWritten(reason, machines), Outcome::Landed) => {
                self.phase = Phase::TakingBack(reason.clone());
                self.unmark_next(
                    reason,
                    machines.into_iter().map(|m| (m, String::new())).collect(),
                )
            }
            (Phase::Unmarking(reason, mut queue), Outcome::Landed | Outcome::Gone) => {
                queue.remove(0);
                self.unmark_next(reason, queue)
            }
            (phase, _) => {
                // A conflict, an unknown outcome or a Machine gone: read again and decide from
                // what the objects say (every write is recognisable by what it carries).
                self.phase = match phase {
                    Phase::SettleWritten(_) => Phase::Settling,
                    Phase::RecordWritten(reason, _)
                    | Phase::Unmarking(reason, _)
                    | Phase::OwedWritten(reason, _) => Phase::TakingBack(reason),
                    other => other,
                };
                if let Phase::TakingBack(reason) = &self.phase
                    && self.attempts >= 2 * MAX_ATTEMPTS
                {
                    // What is left is recorded (claimed, or being taken back): the repair
                    // settles or unmarks it.
                    let reason = reason.clone();
                    return self.finish(Err(reason));
                }
                if self.attempts >= MAX_ATTEMPTS && !matches!(self.phase, Phase::TakingBack(_)) {
                    // Giving up is taking back, from a fresh read: an attempt whose answer was
                    // lost may have landed, and then it stands.
                    self.phase = Phase::TakingBack(refusal::gave_up(&self.group, "removing nodes"));
                }
                Next::Read
            }
        }
    }

    /// Out of time to mark (see [`super::Operation::too_late_to_mark`]): its claims are taken
    /// back, unmarked.
    pub fn too_late_to_mark(&mut self) -> Next {
        self.phase = Phase::TakingBack(refusal::too_late_to_mark(&self.group));
        Next::Read
    }

    /// Out of time while waiting: what this removal still has pending is taken back.
    pub fn expired(&mut self) -> Next {
        match &self.phase {
            Phase::Deciding if self.claims.is_empty() => {
                self.phase = Phase::Done;
                Next::Done(Err(self.last_wait()))
            }
            _ => {
                self.phase = Phase::TakingBack(self.last_wait());
                Next::Read
            }
        }
    }

    fn last_wait(&self) -> Refusal {
        self.waited.clone().unwrap_or_else(|| {
            Refusal::Precondition(format!(
                "{}: the group's marks and replicas did not balance in time",
                self.group
            ))
        })
    }

    fn rejected(&mut self, refusal: Refusal) -> Next {
        if self.claims.is_empty() {
            self.phase = Phase::Done;
            return Next::Done(Err(refusal));
        }
        self.phase = Phase::TakingBack(refusal);
        Next::Read
    }

    fn wait(&mut self, phase: Phase, refusal: Refusal) -> Next {
        self.phase = phase;
        self.waited = Some(refusal.clone());
        Next::Wait(refusal)
    }

    fn finish(&mut self, answer: Result<(), Refusal>) -> Next {
        self.phase = Phase::Done;
        Next::Done(answer)
    }

    /// Step 1: what to claim and mark, if the group balances.
    fn decide(&mut self, read: &Read) -> Next {
        let g = &read.group;
        if let Some(hold) = &g.hold {
            let refusal = refusal::held(&self.group, hold, self.operation());
            return self.stop(refusal);
        }
        let (min, max) = match &g.bounds {
            Ok(bounds) => *bounds,
            Err(why) => return self.stop(refusal::bounds_unreadable(&self.group, why)),
        };
        // Claims of this removal that never landed (a claims write that conflicted) are not its.
        let settled = &self.settled;
        self.claims.retain(|_, e| {
            g.claims.contains(e)
                || g.ledger.contains(e)
                || g.taking_back.contains(e)
                || settled.contains(e)
        });
        let ClaimPlan {
            claims,
            new_claims,
            marks,
            settled_named,
            replaced,
            to_settle,
        } = match self.claim_plan(read) {
            Ok(plan) => plan,
            Err(next) => return *next,
        };
        let accounts = read.accounts(&self.named);
        let balance = accounts.balance();
        if !settled_named.is_empty() && balance < 0 {
            let refusal = refusal::unbalanced(&self.group, &accounts, &settled_named);
            return self.pause(refusal);
        }
        if new_claims.is_empty() && marks.is_empty() {
            // Nothing to write before settling: every named node is settled, going, or claimed.
            self.claims = claims;
            return self.settle(read);
        }
        if balance != 0 {
            let refusal = refusal::unbalanced(&self.group, &accounts, &[]);
            return self.pause(refusal);
        }
        // Marks are interchangeable: the claims of other removals (pending, or owed) may take
        // this one's decrement and it theirs, so the bounds must hold for all of them together.
        let reserved = i32::try_from(accounts.reserved).unwrap_or(i32::MAX);
        let desired = g.replicas - to_settle;
        if !within_bounds(g.replicas, desired.saturating_sub(reserved), min, max) {
            let refusal = Refusal::OutOfBounds {
                group: self.group.clone(),
                operation: format!("deleting {to_settle} node(s)"),
                desired,
                min,
                max,
            };
            return self.stop(refusal);
        }
        self.claims = claims;
        if new_claims.is_empty() {
            return self.next_mark(marks);
        }
        let mut recorded = g.claims.clone();
        for e in &new_claims {
            recorded.insert(e.clone());
        }
        let mut taking_back = g.taking_back.clone();
        for e in &replaced {
            taking_back.remove(e);
        }
        self.phase = Phase::Claiming(marks);
        Next::Write(Write::Group(GroupWrite {
            version: g.version.clone(),
            claims: Some(recorded),
            taking_back: (taking_back != g.taking_back).then_some(taking_back),
            ..GroupWrite::default()
        }))
    }

    /// Step 1's survey: where each named member stands, what to claim and mark for it.
    fn claim_plan(&mut self, read: &Read) -> Result<ClaimPlan, Box<Next>> {
        // What this decision claims, kept only once it writes (or settles): a removal that waits
        // has nothing of its own on the group.
        let mut plan = ClaimPlan {
            claims: self.claims.clone(),
            new_claims: Vec::new(),
            marks: Vec::new(),
            settled_named: Vec::new(),
            replaced: Vec::new(),
            to_settle: 0,
        };
        for name in self.named.clone() {
            let Some(member) = read.member(&name) else {
                self.plan_unlisted(read, &name, &mut plan);
                continue;
            };
            if member.deleting {
                if let Standing::Claimed(e) | Standing::TakingBack(e) | Standing::Unrecorded(e) =
                    read.standing(member)
                {
                    // Owed: settled with the rest (exactly once, whoever does it first).
                    plan.claims.insert(name.clone(), e);
                }
                continue;
            }
            if self.unregistered.contains(&name) && member.registered {
                return Err(Box::new(self.stop(refusal::registered(&self.group, &name))));
            }
            match read.standing(member) {
                Standing::Settled(e) => {
                    self.settled.insert(e.clone());
                    plan.claims.insert(name.clone(), e);
                    plan.settled_named.push(name.clone());
                }
                Standing::TakingBack(_) => {
                    let refusal = refusal::taking_back(&self.group, &name);
                    return Err(Box::new(self.pause(refusal)));
                }
                Standing::Claimed(e) => {
                    plan.claims.insert(name.clone(), e);
                    plan.to_settle += 1;
                }
                Standing::Unrecorded(e) => {
                    plan.claims.insert(name.clone(), e.clone());
                    plan.new_claims.push(e);
                    plan.to_settle += 1;
                }
                Standing::Foreign => {
                    let e = read.entry_of(member, "", self.stamp);
                    plan.claims.insert(name.clone(), e.clone());
                    plan.new_claims.push(e);
                    plan.to_settle += 1;
                }
                Standing::Unmarked => self.plan_unmarked(read, member, &mut plan),
            }
        }
        Ok(plan)
    }

    /// A named member the read does not list.
    fn plan_unlisted(&mut self, read: &Read, name: &str, plan: &mut ClaimPlan) {
        let g = &read.group;
        if matches!(Entry::parse(name), Some(Entry::PoolNode(_))) {
            // A pool instance no longer listed: the infrastructure, which picks, removed it,
            // perhaps for another decrement. Unless its removal is recorded, it is one decrement,
            // as for a listed one.
            plan.claims.insert(name.to_string(), name.to_string());
            if g.ledger.contains(name) || self.settled.contains(name) {
                self.settled.insert(name.to_string());
            } else {
                if !g.claims.contains(name) {
                    plan.new_claims.push(name.to_string());
                }
                plan.to_settle += 1;
            }
            return;
        }
        // Gone: owed if still claimed or being taken back (settled with the rest), else settled
        // already, or gone for another reason: removed either way.
        let recorded = g
            .claims
            .iter()
            .chain(g.taking_back.iter())
            .find(|e| {
                Entry::parse(e).is_some_and(|e| e.machine() == Some(name) && !read.superseded(&e))
            })
            .map(str::to_string);
        let e = match recorded {
            Some(e) => e,
            None => {
                let e = plan
                    .claims
                    .get(name)
                    .cloned()
                    .unwrap_or_else(|| name.to_string());
                self.settled.insert(e.clone());
                e
            }
        };
        plan.claims.insert(name.to_string(), e);
    }

    /// A named member without a mark: claimed afresh and marked by this removal.
    fn plan_unmarked(&self, read: &Read, member: &super::Member, plan: &mut ClaimPlan) {
        let g = &read.group;
        let name = &member.name;
        // Its earlier removals being taken back are done with: their marks are gone. Dropped with
        // this claim, so that none is taken for owed once Cluster API deletes the Machine for this
        // one.
        plan.replaced.extend(
            g.taking_back
                .iter()
                .filter(|e| Entry::parse(e).is_some_and(|e| e.machine() == Some(name.as_str())))
                .map(str::to_string),
        );
        // An entry settled or being taken back is never claimed again: a new mark is a new
        // removal, with a stamp after every recorded one.
        let live = |e: &String| !g.ledger.contains(e) && !g.taking_back.contains(e);
        let known = plan.claims.get(name).cloned().filter(live);
        let e = match known.or_else(|| claimed_entry(read, name)) {
            Some(e) => e,
            None if member.machineless => name.clone(),
            None => {
                let stamp =
                    Ledger::fresh_stamp(name, self.stamp, &[&g.ledger, &g.claims, &g.taking_back]);
                super::ledger::mark_entry(name, stamp)
            }
        };
        if !g.claims.contains(&e) {
            plan.new_claims.push(e.clone());
        }
        if !member.machineless
            && let Some(Entry::Ours { stamp, .. }) = Entry::parse(&e)
        {
            plan.marks
                .push((name.clone(), member.version.clone(), our_mark(stamp)));
        }
        plan.claims.insert(name.clone(), e);
        plan.to_settle += 1;
    }

    /// Waits before anything of this removal is written, or, once something is, takes it back
    /// when the time is up (see [`Removal::expired`]).
    fn pause(&mut self, refusal: Refusal) -> Next {
        self.wait(Phase::Deciding, refusal)
    }

    /// Refuses: at once when nothing of this removal is written, else after taking back.
    fn stop(&mut self, refusal: Refusal) -> Next {
        if self.claims.is_empty() {
            return self.finish(Err(refusal));
        }
        self.phase = Phase::TakingBack(refusal);
        Next::Read
    }

    fn next_mark(&mut self, queue: Vec<(String, String, String)>) -> Next {
        let Some((machine, version, value)) = queue.first().cloned() else {
            self.phase = Phase::Settling;
            return Next::Read;
        };
        self.phase = Phase::Marking(queue);
        Next::Write(Write::Mark {
            machine,
            version,
            value,
        })
    }

    /// Step 3: settle what can be settled.
    fn settle(&mut self, read: &Read) -> Next {
        let g = &read.group;
        let mut owed: Vec<String> = Vec::new();
        let mut pending: Vec<String> = Vec::new();
        for (name, entry) in self.claims.clone() {
            if g.ledger.contains(&entry) || self.settled.contains(&entry) {
                self.settled.insert(entry);
                continue;
            }
            let member = read.member(&name);
            let claimed = g.claims.contains(&entry);
            let retracted = g.taking_back.contains(&entry);
            match member {
                None | Some(super::Member { deleting: true, .. }) if claimed || retracted => {
                    owed.push(entry)
                }
                // Its Machine went and no record of it is left: settled by someone (and the
                // entry since dropped), or gone for another reason. Removed either way.
                None | Some(super::Member { deleting: true, .. }) => {
                    self.settled.insert(entry);
                }
                Some(m)
                    if claimed
                        && (m.machineless
                            || m.mark
                                .as_deref()
                                .is_some_and(|mark| mark_matches(&entry, &m.name, mark))) =>
                {
                    if self.unregistered.contains(&name) && m.registered {
                        let refusal = refusal::registered(&self.group, &name);
                        return self.take_back(read, refusal);
                    }
                    pending.push(entry)
                }
                Some(_) => {
                    let refusal = refusal::mark_lost(&self.group, &name);
                    return self.take_back(read, refusal);
                }
            }
        }
        if let Some(hold) = &g.hold
            && !pending.is_empty()
        {
            let refusal = refusal::held(&self.group, hold, self.operation());
            return self.take_back(read, refusal);
        }
        let own: BTreeSet<String> = self.claims.keys().cloned().collect();
        let accounts = read.accounts(&own);
        let balance = accounts.balance();
        let mut settling = owed.clone();
        if balance >= 0 {
            settling.extend(pending.iter().cloned());
        }
        if settling.is_empty() {
            if pending.is_empty() {
                return self.finish(Ok(()));
            }
            let refusal = refusal::unbalanced(&self.group, &accounts, &[]);
            return self.wait(Phase::Settling, refusal);
        }
        let (min, max) = g.bounds.clone().unwrap_or((i32::MIN, i32::MAX));
        // Surplus no mark explains is someone else's decrement: Cluster API deletes these marks
        // for it, so they are credited, not paid again.
        let credits = if balance > 0 {
            usize::try_from(balance).unwrap_or(0).min(settling.len())
        } else {
            0
        };
        let mut desired = g.replicas - (settling.len() - credits) as i32;
        let reserved = i32::try_from(accounts.reserved).unwrap_or(i32::MAX);
        if !within_bounds(g.replicas, desired.saturating_sub(reserved), min, max) {
            if pending.is_empty() || balance < 0 {
                // Only removals Cluster API already made are settled here: beyond the bounds
                // they are credited (it replaces the Machine), never left owed.
                desired = g.replicas;
            } else {
                let refusal = Refusal::OutOfBounds {
                    group: self.group.clone(),
                    operation: format!("deleting {} node(s)", settling.len()),
                    desired,
                    min,
                    max,
                };
                return self.take_back(read, refusal);
            }
        }
        let mut ledger = pruned(read);
        let mut claims = g.claims.clone();
        let mut taking_back = g.taking_back.clone();
        for e in &settling {
            claims.remove(e);
            taking_back.remove(e);
            ledger.insert(e.clone());
        }
        self.phase = Phase::SettleWritten(settling);
        Next::Write(Write::Group(GroupWrite {
            version: g.version.clone(),
            replicas: (desired != g.replicas).then_some(desired),
            ledger: (ledger != g.ledger).then_some(ledger),
            claims: (claims != g.claims).then_some(claims),
            taking_back: (taking_back != g.taking_back).then_some(taking_back),
            resizes: None,
        }))
    }

    /// Step 4: settles what Cluster API already acted on, records the rest as being taken back,
    /// then unmarks it; answers `reason` unless every named node ended settled.
    fn take_back(&mut self, read: &Read, reason: Refusal) -> Next {
        let g = &read.group;
        let mut owed = false;
        let mut retract: Vec<String> = Vec::new();
        let mut unmark: Vec<(String, String)> = Vec::new();
        for (name, entry) in &self.claims {
            if g.ledger.contains(entry) {
                self.settled.insert(entry.clone());
            }
            if self.settled.contains(entry) {
                continue;
            }
            let member = read.member(name);
            let claimed = g.claims.contains(entry);
            let retracting = g.taking_back.contains(entry);
            match member {
                None | Some(super::Member { deleting: true, .. }) if claimed || retracting => {
                    owed = true
                }
                None | Some(super::Member { deleting: true, .. }) => {
                    self.settled.insert(entry.clone());
                }
                Some(m) => {
                    // Our mark of this removal, wherever its record went (a repair may have
                    // dropped the claim as stale before the mark landed): taken back through
                    // the record, never left to be taken for another decrement.
                    let ours = m.mark.as_deref().is_some_and(|mark| {
                        super::ledger::is_our_mark(mark) && mark_matches(entry, name, mark)
                    });
                    if claimed || (ours && !retracting) {
                        retract.push(entry.clone());
                    }
                    if ours {
                        unmark.push((name.clone(), m.version.clone()));
                    }
                }
            }
        }
        if owed {
            // Rolled forward first: those Machines are going whatever happens.
            return self.settle_owed(read, reason);
        }
        if !retract.is_empty() {
            let mut claims = g.claims.clone();
            let mut taking_back = g.taking_back.clone();
            for e in &retract {
                claims.remove(e);
                if Entry::parse(e).is_some_and(|e| matches!(e, Entry::Ours { .. })) {
                    taking_back.insert(e.clone());
                }
            }
            let machines = unmark.into_iter().map(|(m, _)| m).collect();
            self.phase = Phase::RecordWritten(reason, machines);
            return Next::Write(Write::Group(GroupWrite {
                version: g.version.clone(),
                claims: Some(claims),
                taking_back: (taking_back != g.taking_back).then_some(taking_back),
                ..GroupWrite::default()
            }));
        }
        if !unmark.is_empty() {
            self.phase = Phase::Unmarking(reason.clone(), unmark.clone());
            return self.unmark_next(reason, unmark);
        }
        // Every named node settled (its Machine went, or goes, for it): that is what CA asked.
        let all_settled = self
            .named
            .iter()
            .all(|n| self.claims.get(n).is_some_and(|e| self.settled.contains(e)));
        self.finish(if all_settled { Ok(()) } else { Err(reason) })
    }

    /// Settles this removal's claims Cluster API already acted on, then goes on taking back.
    fn settle_owed(&mut self, read: &Read, reason: Refusal) -> Next {
        let g = &read.group;
        let owed: Vec<String> = self
            .claims
            .iter()
            .filter(|(name, e)| {
                !g.ledger.contains(e)
                    && !self.settled.contains(*e)
                    && (g.claims.contains(e) || g.taking_back.contains(e))
                    && read.member(name).is_none_or(|m| m.deleting)
            })
            .map(|(_, e)| e.clone())
            .collect();
        let own: BTreeSet<String> = self.claims.keys().cloned().collect();
        let balance = read.accounts(&own).balance();
        self.phase = Phase::OwedWritten(reason, owed.clone());
        Next::Write(Write::Group(owed_settlement(read, &owed, balance)))
    }

    fn unmark_next(&mut self, reason: Refusal, queue: Vec<(String, String)>) -> Next {
        match queue.first() {
            // Versions unknown (after the record write): read them first.
            Some((_, version)) if version.is_empty() => {
                self.phase = Phase::TakingBack(reason);
                Next::Read
            }
            Some((machine, version)) => {
                let write = Write::Unmark {
                    machine: machine.clone(),
                    version: version.clone(),
                };
                self.phase = Phase::Unmarking(reason, queue);
                Next::Write(write)
            }
            None => {
                self.phase = Phase::TakingBack(reason);
                Next::Read
            }
        }
    }
}

/// The claim entry of Machine `name` in the group's claims, if any (a mark of ours claimed, by
/// this or another removal).
fn claimed_entry(read: &Read, name: &str) -> Option<String> {
    read.group
        .claims
        .iter()
        .find(|e| Entry::parse(e).is_some_and(|e| e.machine() == Some(name)))
        .map(str::to_string)
}

/// Whether `mark` on Machine `name` is the one `entry` names.
fn mark_matches(entry: &str, name: &str, mark: &str) -> bool {
    Entry::parse(entry).is_some_and(|e| e.names(name, mark))
}
