//! Size changes without a Machine to mark: IncreaseSize, and DecreaseTargetSize (capacity never
//! created cancelled by a decrement alone, the pending Machines it would remove pinned by a
//! [`Removal`]; a MachinePool without Machines lowered, never below its registered nodes).

use super::cancellation::{self, Cancellation};
use super::read::Read;
use super::refusal::{self, Refusal};
use super::removal::{Purpose, Removal};
use super::{GroupWrite, MAX_ATTEMPTS, Next, Outcome, Write, within_bounds};

/// IncreaseSize: replicas raised by `delta` over the version read, with a token that tells a
/// write whose answer was lost from one never made.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Raise {
    group: String,
    delta: i32,
    token: String,
    attempts: u32,
}

impl Raise {
    fn gave_up(&self) -> bool {
        self.attempts >= MAX_ATTEMPTS
    }
}

impl Raise {
    pub fn new(group: &str, delta: i32, token: &str) -> Self {
        Raise {
            group: group.to_string(),
            delta,
            token: token.to_string(),
            attempts: 0,
        }
    }

    pub fn read(&mut self, read: &Read) -> Next {
        let g = &read.group;
        if g.resizes.contains(&self.token) {
            return Next::Done(Ok(()));
        }
        if self.gave_up() {
            // The last read after the last attempt: it did not land.
            return Next::Done(Err(refusal::gave_up(&self.group, "IncreaseSize")));
        }
        if let Some(hold) = g.hold.as_ref().filter(|h| h.refuses_raise()) {
            return Next::Done(Err(refusal::held(&self.group, hold, "IncreaseSize")));
        }
        let (min, max) = match &g.bounds {
            Ok(bounds) => *bounds,
            Err(why) => return Next::Done(Err(refusal::bounds_unreadable(&self.group, why))),
        };
        let desired = g.replicas.saturating_add(self.delta);
        if desired > max || !within_bounds(g.replicas, desired, min, max) {
            return Next::Done(Err(Refusal::OutOfBounds {
                group: self.group.clone(),
                operation: "size increase".into(),
                desired,
                min,
                max,
            }));
        }
        Next::Write(Write::Group(GroupWrite {
            version: g.version.clone(),
            replicas: Some(desired),
            resizes: Some(g.resizes.with(&self.token)),
            ..GroupWrite::default()
        }))
    }

    pub fn wrote(&mut self, outcome: Outcome) -> Next {
        match outcome {
            Outcome::Landed => Next::Done(Ok(())),
            Outcome::Rejected(refusal) => Next::Done(Err(refusal)),
            Outcome::Gone => Next::Done(Err(Refusal::NotFound(format!(
                "{}: the group object is gone",
                self.group
            )))),
            // Read again: the token tells whether it landed (also after the last attempt).
            Outcome::Conflict | Outcome::Unknown => {
                self.attempts += 1;
                Next::Read
            }
        }
    }

    pub fn expired(&mut self) -> Next {
        Next::Done(Err(refusal::gave_up(&self.group, "IncreaseSize")))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum CancelPhase {
    Deciding,
    /// The decrement of capacity without a Machine is in flight; then `pin` more to pin.
    Cancelling {
        pin: usize,
    },
    Pinning(Box<Removal>),
}

/// DecreaseTargetSize by `by`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Cancel {
    group: String,
    by: u32,
    token: String,
    stamp: u64,
    phase: CancelPhase,
    attempts: u32,
    /// Only capacity a preflight check holds back (CA deleting the instances it was told failed
    /// to create): nothing to pin, never a Machine.
    held_only: bool,
}

impl Cancel {
    pub fn new(group: &str, by: u32, token: &str, stamp: u64) -> Self {
        Cancel {
            group: group.to_string(),
            by,
            token: token.to_string(),
            stamp,
            phase: CancelPhase::Deciding,
            attempts: 0,
            held_only: false,
        }
    }

    /// DeleteNodes of `by` instances Cluster API's preflight checks hold back: replicas lowered by
    /// as many, never below the Machines there are.
    pub fn held(group: &str, by: u32, token: &str) -> Self {
        Cancel {
            held_only: true,
            ..Cancel::new(group, by, token, 0)
        }
    }

    pub fn read(&mut self, read: &Read) -> Next {
        match &mut self.phase {
            CancelPhase::Pinning(removal) => return removal.read(read),
            CancelPhase::Cancelling { pin } => {
                let pin = *pin;
                if read.group.resizes.contains(&self.token) {
                    return self.pin(read, pin);
                }
            }
            CancelPhase::Deciding => {}
        }
        self.decide(read)
    }

    pub fn wrote(&mut self, outcome: Outcome) -> Next {
        match &mut self.phase {
            CancelPhase::Pinning(removal) => removal.wrote(outcome),
            CancelPhase::Cancelling { .. } => match outcome {
                Outcome::Landed => Next::Read,
                Outcome::Rejected(refusal) => Next::Done(Err(refusal)),
                Outcome::Gone => Next::Done(Err(Refusal::NotFound(format!(
                    "{}: the group object is gone",
                    self.group
                )))),
                Outcome::Conflict | Outcome::Unknown => {
                    self.attempts += 1;
                    if self.attempts >= MAX_ATTEMPTS {
                        return Next::Done(Err(refusal::gave_up(
                            &self.group,
                            "DecreaseTargetSize",
                        )));
                    }
                    // Read again: the token tells whether it landed; if not, decided afresh.
                    Next::Read
                }
            },
            CancelPhase::Deciding => Next::Read,
        }
    }

    /// The entries this cancellation's pinning claims.
    pub fn holds(&self) -> Vec<&String> {
        match &self.phase {
            CancelPhase::Pinning(removal) => removal.holds().collect(),
            _ => Vec::new(),
        }
    }

    pub fn too_late_to_mark(&mut self) -> Next {
        match &mut self.phase {
            CancelPhase::Pinning(removal) => removal.too_late_to_mark(),
            _ => Next::Read,
        }
    }

    pub fn expired(&mut self) -> Next {
        match &mut self.phase {
            CancelPhase::Pinning(removal) => removal.expired(),
            _ => Next::Done(Err(refusal::not_observed(&self.group))),
        }
    }

    fn decide(&mut self, read: &Read) -> Next {
        self.phase = CancelPhase::Deciding;
        let g = &read.group;
        if let Some(hold) = &g.hold {
            return Next::Done(Err(refusal::held(&self.group, hold, "DecreaseTargetSize")));
        }
        let (min, max) = match &g.bounds {
            Ok(bounds) => *bounds,
            Err(why) => return Next::Done(Err(refusal::bounds_unreadable(&self.group, why))),
        };
        // Cluster API may still be creating Machines for a change it has not observed: one it
        // creates after this decision could not be pinned. A Machine being deleted counts toward
        // the MachineSet's replicas only until it is gone, and then its replacement is created:
        // capacity without a Machine that a decrement would race (the replacement may register
        // before the MachineSet acts on the decrement, and one of the registered Machines would
        // go, unmarked). So only Machines not being deleted cover replicas; the replacement is
        // pinned once it exists.
        let active = read.members.iter().filter(|m| !m.deleting).count();
        let creating = active < usize::try_from(g.replicas).unwrap_or(0) && !g.held;
        if !g.observed || creating {
            // Machines it is creating become pending Machines to pin, in a moment.
            return Next::Wait(refusal::not_observed(&self.group));
        }
        let by = i32::try_from(self.by).unwrap_or(i32::MAX);
        let desired = g.replicas.saturating_sub(by);
        if !within_bounds(g.replicas, desired, min, max) {
            return Next::Done(Err(Refusal::OutOfBounds {
                group: self.group.clone(),
                operation: "size decrease".into(),
                desired,
                min,
                max,
            }));
        }
        let plan = match cancellation::cancellation_plan(&read.members, g.replicas, self.by) {
            Ok(plan) => plan,
            Err(why) => {
                return Next::Done(Err(cancellation_refusal(
                    &self.group,
                    g.replicas,
                    -by,
                    &why,
                )));
            }
        };
        if self.held_only && !plan.pin.is_empty() {
            return Next::Done(Err(Refusal::Precondition(format!(
                "{}: {} held-back instance(s) named, but replicas {} exceed the Machines by only {}: lowering replicas further would remove a Machine",
                self.group, self.by, g.replicas, plan.uncreated
            ))));
        }
        if plan.uncreated == 0 {
            return self.pin(read, plan.pin.len());
        }
        self.phase = CancelPhase::Cancelling {
            pin: plan.pin.len(),
        };
        Next::Write(Write::Group(GroupWrite {
            version: g.version.clone(),
            replicas: Some(g.replicas - plan.uncreated as i32),
            resizes: Some(g.resizes.with(&self.token)),
            ..GroupWrite::default()
        }))
    }

    /// Pins `count` pending Machines, decided again over this read (the capacity without a
    /// Machine cancelled): the Machines to pin may have changed.
    fn pin(&mut self, read: &Read, count: usize) -> Next {
        if count == 0 {
            return Next::Done(Ok(()));
        }
        let by = u32::try_from(count).unwrap_or(u32::MAX);
        let plan = match cancellation::cancellation_plan(&read.members, read.group.replicas, by) {
            Ok(plan) => plan,
            Err(why) => {
                return Next::Done(Err(cancellation_refusal(
                    &self.group,
                    read.group.replicas,
                    -(count as i32),
                    &why,
                )));
            }
        };
        if plan.uncreated > 0 {
            return Next::Done(Err(Refusal::Conflict(format!(
                "{}: capacity without a Machine was cancelled, but replicas still exceed the Machines by {}: Cluster API changed the group meanwhile; nothing more written",
                self.group, plan.uncreated
            ))));
        }
        let pins: Vec<String> = plan.pin.iter().map(|s| s.to_string()).collect();
        let mut removal = Removal::new(&self.group, Purpose::Pin, pins.clone(), pins, self.stamp);
        let next = removal.read(read);
        self.phase = CancelPhase::Pinning(Box::new(removal));
        next
    }
}

/// The refusal of a DecreaseTargetSize that would make Cluster API remove a marked or a
/// registered Machine.
fn cancellation_refusal(group: &str, replicas: i32, delta: i32, why: &Cancellation) -> Refusal {
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
    Refusal::Precondition(format!(
        "{group}: attempt to delete existing nodes: replicas {replicas}, delta {delta}: {what}"
    ))
}
