//! The model checker of the write protocol (`src/protocol`): every interleaving, within a bounded
//! scope, of CA's calls through one or two providers, each write landing, conflicting, answered
//! late or lost, a provider crashing between any two steps, the repair, Cluster API's
//! MachineDeployment and MachineSet controllers (`protocol_model/world.rs`) and a user, explored
//! exhaustively from each scenario's start. The operations are the provider's own: the same code
//! `src/scale/` runs, fed what the model's API returns.
//!
//! Checked in every state:
//! - a write never moves replicas away from [min, max] (invariant 2);
//! - a removal is settled at most once, and our decrements never exceed the removals settled;
//! - Cluster API deletes an unmarked Machine only for a plain decrement by the user.
//!
//! Checked in every final state (no call, write or Cluster API step left, the repair idle):
//! - every node a call was answered OK for is gone, unless a raise or a user's mark took its place;
//! - no node a call was refused for is gone, unless a plain decrement by the user took it;
//! - no mark of ours, no claim and no taking-back record is left; replicas equal the Machines.
//!
//! Prints, per scenario, the states explored, the final states and the time.

#[path = "protocol_model/world.rs"]
mod world;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::time::Instant;

use capi_autoscaler_provider::protocol::{
    Cancel, Hold, Next, Operation, Outcome, Purpose, Raise, Read, Removal, Repair, Ripe, Write,
    is_our_mark,
};
use world::{Answer, Budget, Call, Running, Step, UserAction, World};

/// One transition's result: the next world.
fn successors(w: &World) -> Vec<World> {
    let mut out = Vec::new();
    for p in 0..w.providers.len() {
        provider_steps(w, p, &mut out);
    }
    if let Some((_, write)) = &w.late {
        let mut n = w.clone();
        let write = write.clone();
        n.late = None;
        n.apply_group(&write);
        out.push(n);
        let mut n = w.clone();
        n.late = None;
        out.push(n);
    }
    if w.deployment_pending() {
        let mut n = w.clone();
        n.deployment_sync();
        out.push(n);
    }
    if w.set_pending() {
        let mut n = w.clone();
        n.set_reconcile();
        out.push(n);
    }
    for (name, m) in &w.machines {
        if m.deleting {
            let mut n = w.clone();
            n.machines.remove(name);
            out.push(n);
        } else if !m.registered {
            let mut n = w.clone();
            if let Some(m) = n.machines.get_mut(name) {
                m.registered = true;
                m.version += 1;
            }
            out.push(n);
        }
    }
    if w.user_pending_decrement {
        let mut n = w.clone();
        n.user_decrement();
        out.push(n);
    } else if w.budget.user > 0
        && let Some(action) = w.user_actions.first().copied()
    {
        let mut n = w.clone();
        n.user_actions.remove(0);
        n.budget.user -= 1;
        if n.user(action) {
            out.push(n);
        }
    }
    out
}

fn operation_for(w: &World, call: usize) -> Operation {
    let stamp = 100 * (call as u64 + 1);
    let token = format!("t{call}");
    match &w.calls[call].0 {
        Call::Delete(names) => Operation::Remove(Removal::new(
            "md",
            Purpose::DeleteNodes,
            names.iter().cloned(),
            Vec::<String>::new(),
            stamp,
        )),
        Call::Increase(delta) => Operation::Raise(Raise::new("md", *delta, &token)),
        Call::Decrease(by) => Operation::Cancel(Cancel::new("md", *by, &token, stamp)),
    }
}

fn provider_steps(w: &World, p: usize, out: &mut Vec<World>) {
    let provider = &w.providers[p];
    if w.budget.crashes > 0 && (provider.running.is_some() || !provider.queue.is_empty()) {
        // A crash: the operation in flight stops where it is; CA's calls to it fail.
        let mut n = w.clone();
        n.budget.crashes -= 1;
        let mut calls: Vec<usize> = std::mem::take(&mut n.providers[p].queue);
        if let Some(running) = n.providers[p].running.take() {
            calls.extend(running.call);
        }
        for c in calls {
            n.calls[c].1 = Some(Answer::Unknown);
        }
        out.push(n);
    }
    let Some(running) = &provider.running else {
        for (i, &call) in provider.queue.iter().enumerate() {
            let mut n = w.clone();
            n.providers[p].queue.remove(i);
            let op = operation_for(&n, call);
            n.providers[p].running = Some(Running {
                call: Some(call),
                op,
                step: Step::Next(Next::Read),
            });
            out.push(n);
        }
        if provider.queue.is_empty() && w.budget.repairs > 0 {
            let mut n = w.clone();
            // Ripe: every record no operation running holds. The one timing the repair counts on
            // is that it waits longer than any operation lives before it takes one back.
            let held: std::collections::BTreeSet<String> = w
                .providers
                .iter()
                .filter_map(|p| p.running.as_ref())
                .flat_map(|r| r.op.holds().into_iter().cloned())
                .collect();
            let ripe = w
                .claims
                .iter()
                .chain(w.taking_back.iter())
                .map(str::to_string)
                .chain(w.machines.iter().filter_map(|(name, m)| {
                    let stamp = m
                        .mark
                        .as_deref()
                        .and_then(capi_autoscaler_provider::protocol::our_mark_stamp)?;
                    Some(format!("{name}@{stamp}"))
                }))
                .filter(|e| !held.contains(e))
                .collect();
            n.providers[p].running = Some(Running {
                call: None,
                op: Operation::Repair(Repair::new(Ripe::Only(ripe))),
                step: Step::Next(Next::Read),
            });
            out.push(n);
        }
        return;
    };
    match &running.step {
        Step::Next(Next::Read) if w.budget.split_reads => {
            let mut n = w.clone();
            let group = n.group_read();
            let group_observed = n.observed == n.generation;
            if let Some(r) = n.providers[p].running.as_mut() {
                r.step = Step::Listed(group, group_observed);
            }
            out.push(n);
        }
        Step::Next(Next::Read) => {
            let mut n = w.clone();
            let read = n.read(n.group_read());
            n.advance(p, |op| op.read(&as_read_by(op, read)));
            out.push(n);
        }
        Step::Listed(group, group_observed) => {
            let mut n = w.clone();
            let read = n.listed(group.clone(), *group_observed);
            n.advance(p, |op| op.read(&as_read_by(op, read)));
            out.push(n);
        }
        Step::Next(Next::Write(write)) => {
            let write = write.clone();
            let repair = running.call.is_none();
            // Lands (or conflicts) and is answered.
            let mut n = w.clone();
            let outcome = n.apply(&write);
            if repair && outcome == Outcome::Landed {
                n.budget.repairs = n.budget.repairs.saturating_sub(1);
            }
            n.advance(p, |op| op.wrote(outcome));
            out.push(n);
            if matches!(write, Write::Mark { .. }) && w.budget.slow > 0 {
                // Its time to mark ran out first: not written, taken back.
                let mut n = w.clone();
                n.budget.slow -= 1;
                n.advance(p, |op| op.too_late_to_mark());
                out.push(n);
            }
            if w.budget.lost > 0 {
                // Lands, the answer is lost.
                let mut n = w.clone();
                n.budget.lost -= 1;
                n.apply(&write);
                n.advance(p, |op| op.wrote(Outcome::Unknown));
                out.push(n);
                // Lost on the way: it may land later, guarded as it was sent.
                if let Write::Group(g) = &write
                    && w.late.is_none()
                {
                    let mut n = w.clone();
                    n.budget.lost -= 1;
                    n.late = Some((p as u8, g.clone()));
                    n.advance(p, |op| op.wrote(Outcome::Unknown));
                    out.push(n);
                }
            }
        }
        Step::Next(Next::Wait(_)) => {
            let mut n = w.clone();
            if let Some(r) = n.providers[p].running.as_mut() {
                r.step = Step::Next(Next::Read);
            }
            out.push(n);
            let mut n = w.clone();
            n.advance(p, |op| op.expired());
            out.push(n);
        }
        Step::Next(Next::Done(_)) => {}
    }
}

/// The read as the shell gives it to `op`: for an operation that decides from the group object
/// and its Cluster alone, without members, and what Cluster API observed and a rollout as a stale
/// cache may have them (not observed, no rollout).
fn as_read_by(op: &Operation, mut read: Read) -> Read {
    if !op.reads_members() {
        read.members.clear();
        read.group.observed = false;
        if matches!(read.group.hold, Some(Hold::RollingOut(_))) {
            read.group.hold = None;
        }
    }
    read
}

/// Whether a repair round run alone now would write anything.
fn repair_would_write(w: &World) -> bool {
    let n = w.clone();
    let mut op = Operation::Repair(Repair::new(Ripe::All));
    let mut next = Next::Read;
    for _ in 0..64 {
        next = match next {
            Next::Read => {
                let read = n.read(n.group_read());
                op.read(&read)
            }
            Next::Write(_) => return true,
            Next::Wait(_) | Next::Done(_) => return false,
        };
    }
    false
}

fn is_final(w: &World) -> bool {
    w.providers
        .iter()
        .all(|p| p.running.is_none() && p.queue.is_empty())
        && w.late.is_none()
        && !w.deployment_pending()
        && !w.set_pending()
        && w.machines.values().all(|m| !m.deleting && m.registered)
        && !w.user_pending_decrement
}

/// The final-state invariants; `None` when they hold.
fn final_violation(w: &World) -> Option<String> {
    let gone = |name: &str| !w.machines.contains_key(name);
    let excused_ok = w.ghost.raises + w.ghost.user_marks;
    let mut not_gone = 0;
    let answered_ok: Vec<&String> = w
        .calls
        .iter()
        .filter(|(_, a)| *a == Some(Answer::Ok))
        .flat_map(|(c, _)| match c {
            Call::Delete(names) => names.iter().collect(),
            _ => Vec::new(),
        })
        .collect();
    // A node answered OK by more than one call (CA's retry) counts once.
    let mut still_there: Vec<&String> = answered_ok.iter().copied().filter(|n| !gone(n)).collect();
    still_there.sort();
    still_there.dedup();
    not_gone += still_there.len() as u32;
    for (call, answer) in &w.calls {
        let Call::Delete(names) = call else { continue };
        if *answer == Some(Answer::Refused) {
            // Gone for another call answered OK for it (CA's retry of a removed node), or for a
            // decrement by the user, is not this refusal's doing.
            let taken: Vec<&String> = names
                .iter()
                .filter(|n| gone(n) && !answered_ok.contains(n))
                .collect();
            if !taken.is_empty() && w.ghost.user_decrements == 0 {
                return Some(format!("refused, yet removed: {taken:?}"));
            }
        }
    }
    if not_gone > excused_ok {
        return Some(format!(
            "{not_gone} node(s) answered OK are still there ({} raises, {} user marks)",
            w.ghost.raises, w.ghost.user_marks
        ));
    }
    if let Some((name, _)) = w
        .machines
        .iter()
        .find(|(_, m)| m.mark.as_deref().is_some_and(is_our_mark))
    {
        return Some(format!("a mark of ours is left on {name}"));
    }
    if !w.claims.is_empty() || !w.taking_back.is_empty() {
        return Some(format!(
            "records left: claims {:?}, taking back {:?}",
            w.claims, w.taking_back
        ));
    }
    if w.replicas != w.machines.len() as i32 {
        return Some(format!(
            "replicas {} but {} Machines",
            w.replicas,
            w.machines.len()
        ));
    }
    None
}

/// A fast 64-bit hash of a state (FNV-1a over the bytes `Hash` feeds it, folded by 8).
fn state_hash(w: &World) -> u64 {
    struct Fnv(u64);
    impl Hasher for Fnv {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            for chunk in bytes.chunks(8) {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                self.0 = (self.0 ^ u64::from_le_bytes(word)).wrapping_mul(0x0000_0100_0000_01b3);
                self.0 ^= self.0 >> 29;
            }
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    w.hash(&mut h);
    h.finish()
}

/// The path from `start` to `end`, one line per state, rebuilt by searching each parent's
/// successors for the child's hash.
fn trace(start: &World, end: &World, parents: &HashMap<u64, u64>) -> String {
    let mut hashes = vec![state_hash(end)];
    let start_hash = state_hash(start);
    while let Some(&p) = parents.get(hashes.last().unwrap_or(&0)) {
        if p == 0 {
            break;
        }
        hashes.push(p);
        if p == start_hash {
            break;
        }
    }
    hashes.reverse();
    let mut lines = vec![start.line()];
    let mut current = start.clone();
    for h in hashes.iter().skip(1) {
        match successors(&current)
            .into_iter()
            .find(|n| state_hash(n) == *h)
        {
            Some(n) => {
                lines.push(n.line());
                current = n;
            }
            None => break,
        }
    }
    let skip = lines.len().saturating_sub(60);
    lines.split_off(skip).join("\n")
}

struct Report {
    states: usize,
    finals: usize,
    unchecked: usize,
}

/// Explores every state reachable from `start`; the first violation with the path to it.
fn explore(start: World, limit: usize) -> Result<Report, String> {
    // Each state's parent, to print the path to a violation.
    let mut seen: HashMap<u64, u64> = HashMap::new();
    let mut stack: Vec<World> = vec![start.clone()];
    seen.insert(state_hash(&start), 0);
    let mut report = Report {
        states: 0,
        finals: 0,
        unchecked: 0,
    };
    while let Some(w) = stack.pop() {
        report.states += 1;
        if report.states > limit {
            return Err(format!("more than {limit} states: scope too large"));
        }
        if let Some(v) = &w.ghost.violation {
            return Err(format!("{v}\n{}", trace(&start, &w, &seen)));
        }
        if is_final(&w) && (w.budget.user == 0 || w.user_actions.is_empty()) {
            if !repair_would_write(&w) {
                report.finals += 1;
                if let Some(v) = final_violation(&w) {
                    return Err(format!("{v}\n{}", trace(&start, &w, &seen)));
                }
            } else if w.budget.repairs == 0 {
                report.unchecked += 1;
            }
        }
        let parent = state_hash(&w);
        for n in successors(&w) {
            if let std::collections::hash_map::Entry::Vacant(e) = seen.entry(state_hash(&n)) {
                e.insert(parent);
                stack.push(n);
            }
        }
    }
    Ok(report)
}

struct Scenario {
    name: &'static str,
    world: World,
}

fn budget(lost: u8, crashes: u8, user: u8) -> Budget {
    Budget {
        lost,
        crashes,
        user,
        repairs: 3,
        slow: 1,
        split_reads: false,
    }
}

/// `budget` with every read split: the group object first, its MachineSet and Machines after it.
fn split_reads(budget: Budget) -> Budget {
    Budget {
        split_reads: true,
        ..budget
    }
}

/// Two Machines (min 0, max 4), two providers: IncreaseSize(2) then DecreaseTargetSize(-1) through one,
/// DeleteNodes(m0) through the other.
fn decrease_after_a_raise_beside_a_removal(budget: Budget) -> World {
    World::new(
        2,
        0,
        4,
        2,
        vec![
            (0, Call::Increase(2)),
            (0, Call::Decrease(1)),
            (1, delete(&["m0"])),
        ],
        budget,
        vec![],
    )
}

fn delete(names: &[&str]) -> Call {
    Call::Delete(names.iter().map(|s| s.to_string()).collect())
}

fn scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            // Finding 1: CA's goroutines send one DeleteNodes per empty node back to back; the
            // MachineSet may take the later-marked Machine for the earlier decrement.
            name: "two removals from one provider, Cluster API acting between them",
            world: World::new(
                3,
                0,
                4,
                1,
                vec![(0, delete(&["m1"])), (0, delete(&["m0"]))],
                budget(0, 0, 0),
                vec![],
            ),
        },
        Scenario {
            name: "two removals and a raise through two providers, one answer lost",
            world: World::new(
                3,
                0,
                4,
                2,
                vec![
                    (0, delete(&["m1"])),
                    (1, delete(&["m0"])),
                    (1, Call::Increase(1)),
                ],
                budget(1, 0, 0),
                vec![],
            ),
        },
        Scenario {
            name: "a removal retried through the other provider, one crashes",
            world: World::new(
                3,
                0,
                4,
                2,
                vec![(0, delete(&["m1"])), (1, delete(&["m1"]))],
                budget(0, 1, 0),
                vec![],
            ),
        },
        Scenario {
            // Finding 3: a user's annotate-and-scale-down in flight beside a removal.
            name: "a removal beside a user's mark and scale-down",
            world: World::new(
                3,
                0,
                4,
                1,
                vec![(0, delete(&["m1"]))],
                budget(0, 0, 1),
                vec![UserAction::MarkAndScaleDown],
            ),
        },
        Scenario {
            name: "a removal beside a user's scale-down",
            world: World::new(
                3,
                0,
                4,
                1,
                vec![(0, delete(&["m1"]))],
                budget(1, 0, 1),
                vec![UserAction::ScaleDown],
            ),
        },
        Scenario {
            name: "a removal beside a user's scale-up",
            world: World::new(
                3,
                0,
                4,
                1,
                vec![(0, delete(&["m1"]))],
                budget(1, 0, 1),
                vec![UserAction::ScaleUp],
            ),
        },
        Scenario {
            name: "a removal beside a user's preference mark",
            world: World::new(
                3,
                0,
                4,
                1,
                vec![(0, delete(&["m2"]))],
                budget(0, 0, 1),
                vec![UserAction::Mark],
            ),
        },
        Scenario {
            // A raise absorbing a settled removal, then the repair (clocks play no part).
            name: "a removal, a raise and a second removal",
            world: World::new(
                3,
                0,
                4,
                2,
                vec![
                    (0, delete(&["m1"])),
                    (1, Call::Increase(1)),
                    (0, delete(&["m2"])),
                ],
                budget(0, 0, 0),
                vec![],
            ),
        },
        Scenario {
            // A mark taken back by the repair, its Machine removed again as a fresh removal and
            // taken: the old record is owed nothing when the next removal comes.
            name: "a removal absorbed and taken back, the same node removed again, then another",
            world: World::new(
                3,
                0,
                4,
                1,
                vec![
                    (0, delete(&["m1"])),
                    (0, Call::Increase(1)),
                    (0, delete(&["m1"])),
                    (0, delete(&["m2"])),
                ],
                budget(0, 0, 0),
                vec![],
            ),
        },
        Scenario {
            name: "DecreaseTargetSize after a raise, beside a removal",
            world: decrease_after_a_raise_beside_a_removal(budget(1, 0, 0)),
        },
        Scenario {
            // The read as the shell makes it: the group object first, its MachineSet and Machines
            // listed after it, Cluster API and the other provider acting in between.
            name: "DecreaseTargetSize after a raise, beside a removal, reads split",
            world: decrease_after_a_raise_beside_a_removal(split_reads(budget(0, 0, 0))),
        },
        Scenario {
            name: "two removals through two providers, Cluster API acting between them, reads split",
            world: World::new(
                3,
                0,
                4,
                2,
                vec![(0, delete(&["m1"])), (1, delete(&["m0"]))],
                split_reads(budget(0, 0, 0)),
                vec![],
            ),
        },
        Scenario {
            name: "one call removing two nodes, a crash",
            world: World::new(
                3,
                1,
                4,
                2,
                vec![(0, delete(&["m0", "m2"])), (1, delete(&["m1"]))],
                budget(0, 1, 0),
                vec![],
            ),
        },
    ]
}

#[test]
#[ignore = "millions of states: run optimised, `make test` does (Cargo.toml: profile.model)"]
fn the_write_protocol_holds_its_invariants_in_every_interleaving() {
    let limit: usize = std::env::var("PROTOCOL_MODEL_LIMIT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000_000);
    let started = Instant::now();
    let mut total = 0;
    let mut failures = Vec::new();
    // PROTOCOL_MODEL_ONLY: the scenarios whose name contains it (all when unset).
    let only = std::env::var("PROTOCOL_MODEL_ONLY").unwrap_or_default();
    for scenario in scenarios()
        .into_iter()
        .filter(|s| s.name.contains(only.as_str()))
    {
        let t = Instant::now();
        match explore(scenario.world, limit) {
            Ok(report) => {
                total += report.states;
                println!(
                    "protocol model: {}: {} states, {} final ({} past the repair budget), {:.1}s",
                    scenario.name,
                    report.states,
                    report.finals,
                    report.unchecked,
                    t.elapsed().as_secs_f64()
                );
            }
            Err(why) => {
                println!("protocol model: {}: VIOLATION: {why}", scenario.name);
                failures.push(scenario.name);
            }
        }
    }
    println!(
        "protocol model: {total} states in {:.1}s, {} violation(s)",
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    assert!(failures.is_empty(), "violations in: {failures:?}");
}
