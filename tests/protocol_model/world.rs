//! The world the protocol runs in, as far as its safety depends on it: one MachineDeployment group
//! and its MachineSet as Cluster API v1.14 acts on them, its Machines, two providers running the
//! protocol's operations (src/protocol) against the API with every outcome a write can have, a
//! user, and the ghost record the invariants are checked against.
//!
//! Cluster API's steps, each atomic (one reconcile):
//! - the MachineDeployment controller copies its replicas to the MachineSet and records that it
//!   observed its generation;
//! - the MachineSet controller compares all its Machines, those being deleted included, with its
//!   replicas (`machineset_controller.go` syncReplicas): beyond them it deletes the first by
//!   `machineset_deletion_order.go`'s order (being deleted, then marked, then without a Node, then
//!   the rest; ties by name), below them it creates Machines; then it records its observed
//!   generation. It acts on the replicas its last sync gave it: a raise it has not observed yet
//!   does not stop it deleting for the count before;
//! - a Machine being deleted goes (drain and infrastructure done), a Machine gets its Node.
//!   A Machine may get its Node at any step after it is created: no timing is assumed between a
//!   machine booting and a write of ours landing or Cluster API acting on it.
//!   What the model leaves out: Machine status writes (they only make marks conflict more), the
//!   MachineSet's cache of Machines lagging a mark (its reconcile is woken by the mark itself).

use std::collections::{BTreeMap, BTreeSet};

use capi_autoscaler_provider::protocol::{
    GroupRead, GroupWrite, Ledger, Member, Next, Operation, Outcome, Read, Refusal, Resizes,
    within_bounds,
};

/// A Machine. Versions are per object (a write bumps the object's own), which is all a guard
/// compares and keeps the explored states few.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Machine {
    pub version: u32,
    pub mark: Option<String>,
    pub deleting: bool,
    pub registered: bool,
}

/// Who asked for what, and what they were answered.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Call {
    Delete(Vec<String>),
    Increase(i32),
    Decrease(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Answer {
    Ok,
    /// A refusal: CA cleans its taint off the nodes and may ask again.
    Refused,
    /// The API could not be reached, the provider crashed or CA's deadline passed: the outcome
    /// is unknown to CA (it treats the call as failed; what was written may stand).
    Unknown,
}

/// Where a provider's current operation is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    Next(Next),
    /// The group object was read (its own observedGeneration caught up or not: the `bool`); its
    /// MachineSets and members are listed next, so what the read says Cluster API observed is the
    /// group's part as read then and the MachineSet's as listed.
    Listed(GroupRead, bool),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Running {
    /// The call it answers (`None`: a repair round).
    pub call: Option<usize>,
    pub op: Operation,
    pub step: Step,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Provider {
    /// Calls CA sent it, waiting for the group's lock.
    pub queue: Vec<usize>,
    pub running: Option<Running>,
}

/// The budgets of nondeterministic events in one exploration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Budget {
    /// Answers lost (landed or not; a lost request may land later).
    pub lost: u8,
    pub crashes: u8,
    pub user: u8,
    /// Repair rounds that write.
    pub repairs: u8,
    /// Operations told their time to mark is up instead of writing a mark (the API answered them
    /// too slowly).
    pub slow: u8,
    /// Reads list the MachineSet and the members after the group object, other steps between (else
    /// one atomic step).
    pub split_reads: bool,
}

/// What the user may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UserAction {
    ScaleDown,
    ScaleUp,
    /// The delete-machine annotation on a Machine, without a decrement (a preference).
    Mark,
    /// Annotate a Machine and lower replicas for it, two writes.
    MarkAndScaleDown,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct World {
    // The MachineDeployment: the group.
    pub replicas: i32,
    pub generation: u32,
    pub observed: u32,
    pub group_version: u32,
    pub min: i32,
    pub max: i32,
    pub ledger: Ledger,
    pub claims: Ledger,
    pub taking_back: Ledger,
    pub resizes: Resizes,
    // Its MachineSet.
    pub set_replicas: i32,
    pub set_generation: u32,
    pub set_observed: u32,
    pub machines: BTreeMap<String, Machine>,
    pub created: u32,
    pub providers: Vec<Provider>,
    pub calls: Vec<(Call, Option<Answer>)>,
    /// A request whose answer was lost before it landed: it may still land (guarded as sent).
    pub late: Option<(u8, GroupWrite)>,
    pub budget: Budget,
    pub user_actions: Vec<UserAction>,
    /// The second write of a user's mark-and-scale-down, if the first is done.
    pub user_pending_decrement: bool,
    pub ghost: Ghost,
}

/// What the invariants are checked against.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ghost {
    /// Machines Cluster API began deleting, with whether each carried a mark then.
    pub deleted: BTreeMap<String, bool>,
    /// Of those, the unmarked ones, and the unmarked ones with a Node.
    pub unmarked: u32,
    pub unmarked_registered: u32,
    /// Replica decrements by the user, with or without a mark of theirs (a mark of theirs
    /// Cluster API took for a decrement of ours leaves theirs to an unmarked Machine).
    pub user_decrements: u32,
    pub user_marks: u32,
    pub raises: u32,
    /// Replicas our DecreaseTargetSize cancelled without a Machine: Cluster API may delete as
    /// many Machines without a Node, unmarked, for them.
    pub cancelled: u32,
    /// Every entry ever settled, and the decrements our settlements wrote: removals are
    /// interchangeable to Cluster API, so what must hold is that the decrements never exceed the
    /// distinct removals settled (an entry settled again after a take-back is credited).
    pub settled: BTreeSet<String>,
    pub decrements: u32,
    /// The first violation found.
    pub violation: Option<String>,
}

impl World {
    pub fn new(
        machines: usize,
        min: i32,
        max: i32,
        providers: usize,
        calls: Vec<(usize, Call)>,
        budget: Budget,
        user_actions: Vec<UserAction>,
    ) -> World {
        let mut world = World {
            replicas: machines as i32,
            generation: 1,
            observed: 1,
            group_version: 1,
            min,
            max,
            ledger: Ledger::default(),
            claims: Ledger::default(),
            taking_back: Ledger::default(),
            resizes: Resizes::default(),
            set_replicas: machines as i32,
            set_generation: 1,
            set_observed: 1,
            machines: BTreeMap::new(),
            created: 0,
            providers: vec![Provider::default(); providers],
            calls: Vec::new(),
            late: None,
            budget,
            user_actions,
            user_pending_decrement: false,
            ghost: Ghost::default(),
        };
        for i in 0..machines {
            world.machines.insert(
                format!("m{i}"),
                Machine {
                    version: 1,
                    mark: None,
                    deleting: false,
                    registered: true,
                },
            );
        }
        for (provider, call) in calls {
            let id = world.calls.len();
            world.calls.push((call, None));
            world.providers[provider].queue.push(id);
        }
        world
    }

    fn bump_group(&mut self) {
        self.group_version += 1;
    }

    pub fn group_read(&self) -> GroupRead {
        GroupRead {
            version: self.group_version.to_string(),
            replicas: self.replicas,
            bounds: Ok((self.min, self.max)),
            ledger: self.ledger.clone(),
            claims: self.claims.clone(),
            taking_back: self.taking_back.clone(),
            resizes: self.resizes.clone(),
            observed: self.observed == self.generation
                && self.set_replicas == self.replicas
                && self.set_observed == self.set_generation,
            held: false,
            hold: None,
        }
    }

    pub fn members(&self) -> Vec<Member> {
        self.machines
            .iter()
            .map(|(name, m)| Member {
                name: name.clone(),
                version: m.version.to_string(),
                mark: m.mark.clone(),
                deleting: m.deleting,
                registered: m.registered,
                unhealthy: false,
                machineless: false,
            })
            .collect()
    }

    fn violate(&mut self, why: String) {
        if self.ghost.violation.is_none() {
            self.ghost.violation = Some(why);
        }
    }

    /// Applies a group write guarded by its version: landed or conflict.
    pub fn apply_group(&mut self, w: &GroupWrite) -> Outcome {
        if w.version != self.group_version.to_string() {
            return Outcome::Conflict;
        }
        if let Some(replicas) = w.replicas
            && w.resizes.is_some()
            && replicas < self.replicas
        {
            self.ghost.cancelled += (self.replicas - replicas) as u32;
        }
        if let Some(replicas) = w.replicas {
            if !within_bounds(self.replicas, replicas, self.min, self.max) {
                self.violate(format!(
                    "invariant 2: replicas {} -> {replicas} outside [{}, {}]",
                    self.replicas, self.min, self.max
                ));
            }
            if replicas > self.replicas {
                self.ghost.raises += (replicas - self.replicas) as u32;
            }
            if replicas != self.replicas {
                self.generation += 1;
            }
        }
        if let Some(ledger) = &w.ledger {
            let added: Vec<String> = ledger
                .iter()
                .filter(|e| !self.ledger.contains(e))
                .map(str::to_string)
                .collect();
            for e in &added {
                self.ghost.settled.insert(e.clone());
            }
            if let Some(replicas) = w.replicas
                && replicas < self.replicas
            {
                self.ghost.decrements += (self.replicas - replicas) as u32;
                if self.ghost.decrements as usize > self.ghost.settled.len() {
                    self.violate(format!(
                        "decrements {} exceed the removals settled {}: a removal paid twice",
                        self.ghost.decrements,
                        self.ghost.settled.len()
                    ));
                }
            }
        }
        if let Some(replicas) = w.replicas {
            self.replicas = replicas;
        }
        if let Some(l) = &w.ledger {
            self.ledger = l.clone();
        }
        if let Some(c) = &w.claims {
            self.claims = c.clone();
        }
        if let Some(t) = &w.taking_back {
            self.taking_back = t.clone();
        }
        if let Some(r) = &w.resizes {
            self.resizes = r.clone();
        }
        self.bump_group();
        Outcome::Landed
    }

    /// Applies a write of the protocol; `landed_only`: the outcome CA's provider would see.
    pub fn apply(&mut self, write: &capi_autoscaler_provider::protocol::Write) -> Outcome {
        use capi_autoscaler_provider::protocol::Write;
        match write {
            Write::Group(w) => self.apply_group(w),
            Write::Mark {
                machine,
                version,
                value,
            } => match self.machines.get_mut(machine) {
                None => Outcome::Gone,
                Some(m) if m.version.to_string() != *version => Outcome::Conflict,
                Some(m) => {
                    m.mark = Some(value.clone());
                    m.version += 1;
                    Outcome::Landed
                }
            },
            Write::Unmark { machine, version } => match self.machines.get_mut(machine) {
                None => Outcome::Gone,
                Some(m) if m.version.to_string() != *version => Outcome::Conflict,
                Some(m) => {
                    m.mark = None;
                    m.version += 1;
                    Outcome::Landed
                }
            },
        }
    }

    // --- Cluster API ---

    pub fn deployment_pending(&self) -> bool {
        self.set_replicas != self.replicas || self.observed != self.generation
    }

    pub fn deployment_sync(&mut self) {
        if self.set_replicas != self.replicas {
            self.set_replicas = self.replicas;
            self.set_generation += 1;
        }
        if self.observed != self.generation {
            self.observed = self.generation;
            // A status write: the object's version changes.
            self.bump_group();
        }
    }

    fn diff(&self) -> i64 {
        self.machines.len() as i64 - i64::from(self.set_replicas)
    }

    pub fn set_pending(&self) -> bool {
        let deleting = self.machines.values().filter(|m| m.deleting).count() as i64;
        self.set_observed != self.set_generation || self.diff() < 0 || self.diff() > deleting
    }

    pub fn set_reconcile(&mut self) {
        let diff = self.diff();
        if diff > 0 {
            let mut order: Vec<(u8, String)> = self
                .machines
                .iter()
                .map(|(name, m)| {
                    let rank = if m.deleting {
                        0
                    } else if m.mark.is_some() {
                        1
                    } else if !m.registered {
                        2
                    } else {
                        3
                    };
                    (rank, name.clone())
                })
                .collect();
            order.sort();
            for (_, name) in order.into_iter().take(diff as usize) {
                let Some(m) = self.machines.get_mut(&name) else {
                    continue;
                };
                if m.deleting {
                    continue;
                }
                m.deleting = true;
                m.version += 1;
                let marked = m.mark.is_some();
                let registered = m.registered;
                self.ghost.deleted.insert(name.clone(), marked);
                if !marked {
                    self.ghost.unmarked += 1;
                    if registered {
                        self.ghost.unmarked_registered += 1;
                    }
                    let unmarked = self.ghost.unmarked;
                    if self.ghost.unmarked_registered > self.ghost.user_decrements
                        || unmarked > self.ghost.user_decrements + self.ghost.cancelled
                    {
                        self.violate(format!(
                            "Cluster API deleted unmarked Machine {name} for a decrement of ours ({} unmarked deletions, {} decrements by the user)",
                            unmarked, self.ghost.user_decrements
                        ));
                    }
                }
            }
        } else if diff < 0 {
            for _ in 0..(-diff) {
                self.created += 1;
                let name = format!("n{}", self.created);
                self.machines.insert(
                    name,
                    Machine {
                        version: 1,
                        mark: None,
                        deleting: false,
                        registered: false,
                    },
                );
            }
        }
        self.set_observed = self.set_generation;
    }

    // --- the user ---

    pub fn user(&mut self, action: UserAction) -> bool {
        match action {
            UserAction::ScaleDown => {
                if self.replicas <= self.min {
                    return false;
                }
                self.replicas -= 1;
                self.generation += 1;
                self.bump_group();
                self.ghost.user_decrements += 1;
            }
            UserAction::ScaleUp => {
                if self.replicas >= self.max {
                    return false;
                }
                self.replicas += 1;
                self.generation += 1;
                self.bump_group();
                self.ghost.raises += 1;
            }
            UserAction::Mark | UserAction::MarkAndScaleDown => {
                let Some(name) = self
                    .machines
                    .iter()
                    .find(|(_, m)| !m.deleting && m.mark.is_none())
                    .map(|(n, _)| n.clone())
                else {
                    return false;
                };
                if let Some(m) = self.machines.get_mut(&name) {
                    m.mark = Some("yes".into());
                    m.version += 1;
                }
                self.ghost.user_marks += 1;
                self.user_pending_decrement = action == UserAction::MarkAndScaleDown;
            }
        }
        true
    }

    pub fn user_decrement(&mut self) {
        self.user_pending_decrement = false;
        self.ghost.user_decrements += 1;
        self.replicas -= 1;
        self.generation += 1;
        self.bump_group();
    }

    // --- the providers ---

    /// Answers call `call` (when it is one), ending the provider's operation.
    pub fn answer(&mut self, provider: usize, result: Result<(), Refusal>) {
        if let Some(running) = self.providers[provider].running.take()
            && let Some(call) = running.call
        {
            let answer = match result {
                Ok(()) => Answer::Ok,
                Err(r) if r.is_unknown() => Answer::Unknown,
                Err(_) => Answer::Refused,
            };
            self.calls[call].1 = Some(answer);
        }
    }

    /// The second half of a split read: the MachineSet and the members as they are now, beside
    /// `group` as it was read before (`group_observed`: its own observedGeneration then).
    pub fn listed(&self, mut group: GroupRead, group_observed: bool) -> Read {
        group.observed = group_observed
            && self.set_replicas == group.replicas
            && self.set_observed == self.set_generation;
        self.read(group)
    }

    pub fn read(&self, group: GroupRead) -> Read {
        Read {
            group,
            members: self.members(),
        }
    }

    /// Feeds a step's result to provider `p`'s operation.
    pub fn advance(&mut self, p: usize, next: impl FnOnce(&mut Operation) -> Next) {
        let Some(running) = self.providers[p].running.as_mut() else {
            return;
        };
        let n = next(&mut running.op);
        match n {
            Next::Done(result) => self.answer(p, result),
            n => running.step = Step::Next(n),
        }
    }
}

impl World {
    /// One line: what a trace shows of a state.
    pub fn line(&self) -> String {
        let machines: Vec<String> = self
            .machines
            .iter()
            .map(|(n, m)| {
                let mut s = n.clone();
                if let Some(mark) = &m.mark {
                    s.push_str(&format!(
                        "[{}]",
                        capi_autoscaler_provider::protocol::our_mark_stamp(mark)
                            .map_or_else(|| mark.clone(), |t| t.to_string())
                    ));
                }
                if m.deleting {
                    s.push('x');
                }
                if !m.registered {
                    s.push('?');
                }
                s
            })
            .collect();
        let ops: Vec<String> = self
            .providers
            .iter()
            .map(|p| match &p.running {
                None => format!("idle{:?}", p.queue),
                Some(r) => format!("{:?}:{}", r.call, step_line(&r.step)),
            })
            .collect();
        format!(
            "R={} ms={} obs={} | {} | L={:?} C={:?} T={:?} | {} | calls {:?}",
            self.replicas,
            self.set_replicas,
            self.group_read().observed,
            machines.join(" "),
            self.ledger.iter().collect::<Vec<_>>(),
            self.claims.iter().collect::<Vec<_>>(),
            self.taking_back.iter().collect::<Vec<_>>(),
            ops.join(" / "),
            self.calls.iter().map(|(_, a)| *a).collect::<Vec<_>>(),
        )
    }
}

fn step_line(step: &Step) -> String {
    match step {
        Step::Listed(..) => "listing".into(),
        Step::Next(Next::Read) => "read".into(),
        Step::Next(Next::Wait(_)) => "wait".into(),
        Step::Next(Next::Done(r)) => format!("done {r:?}"),
        Step::Next(Next::Write(w)) => match w {
            capi_autoscaler_provider::protocol::Write::Group(g) => format!(
                "write group R={:?} L={:?} C={:?} T={:?}",
                g.replicas,
                g.ledger.as_ref().map(|l| l.iter().collect::<Vec<_>>()),
                g.claims.as_ref().map(|l| l.iter().collect::<Vec<_>>()),
                g.taking_back.as_ref().map(|l| l.iter().collect::<Vec<_>>())
            ),
            capi_autoscaler_provider::protocol::Write::Mark { machine, .. } => {
                format!("mark {machine}")
            }
            capi_autoscaler_provider::protocol::Write::Unmark { machine, .. } => {
                format!("unmark {machine}")
            }
        },
    }
}
