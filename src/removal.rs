//! Pure rules for removing nodes: which removals are still owed a replica decrement, and which
//! delete marks are orphans to repair. No I/O: the actuator feeds it cached or freshly read objects.
//!
//! A removal is "mark the Machine, lower replicas by one": two writes to two objects. Whether a
//! decrement is owed is decided from the objects, never from the mark alone (a mark can outlive its
//! decrement: a crash, a dropped call, a lost answer): Cluster API deletes marked Machines first
//! whenever a group has more Machines than replicas, so the group's surplus (Machines not being
//! deleted, less `spec.replicas`) is how many marks its replicas already pay for. Marks of ours
//! beyond the surplus are owed a decrement: a retried DeleteNodes pays it, and once older than the
//! grace period (no operation in flight) the repair takes them back instead (the node stays; CA,
//! which got no OK for it, asks again if it still wants it gone). A scale-up that raised replicas
//! again after a removal "absorbs" its mark the same way, and the same rules apply.
//!
//! MachinePool nodes without a Machine cannot be marked: the pool's [`LEDGER_ANNOTATION`] lists the
//! normalised providerIDs whose decrement its `spec.replicas` includes, written in the same guarded
//! write as the decrement, so it survives restarts and matches any spelling of the id.

use std::collections::BTreeSet;

use crate::capi::providerid;

/// On a MachinePool: the nodes without a Machine whose removal its `spec.replicas` already pays for
/// (normalised providerIDs, comma-separated). Written only together with `spec.replicas`.
pub const LEDGER_ANNOTATION: &str = "capi-autoscaler-provider/removed";

/// Marks written by this provider end with this; the value starts with `unix <seconds>`.
const MARK_SUFFIX: &str = " by capi-autoscaler-provider";

/// Longest ledger kept: a group never has more removals in flight than Machines, but a hostile or
/// broken annotation must not grow without bound.
const MAX_LEDGER_ENTRIES: usize = 10_000;

/// The delete-machine annotation value this provider writes: presence is what Cluster API reads;
/// the time dates it for the orphan repair and helps people; the suffix tells it from others' marks.
pub fn our_mark(now_unix: u64) -> String {
    format!("unix {now_unix}{MARK_SUFFIX}")
}

/// When a mark of ours was written (`None` for others' marks or an unreadable time).
pub fn our_mark_time(value: &str) -> Option<u64> {
    value
        .strip_suffix(MARK_SUFFIX)?
        .strip_prefix("unix ")?
        .trim()
        .parse()
        .ok()
}

/// Whether `value` is a mark this provider wrote.
pub fn is_our_mark(value: &str) -> bool {
    value.ends_with(MARK_SUFFIX)
}

/// The removals a group's replicas already pay for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ledger(BTreeSet<String>);

/// The ledger entry of a MachinePool node without a Machine: its normalised providerID, so a
/// differently spelled id matches.
pub fn pool_node_entry(provider_id: &str) -> String {
    format!("id:{}", providerid::normalize(provider_id))
}

impl Ledger {
    /// Reads the annotation leniently: a garbled value can only make a paid removal look owed,
    /// which the bounds check and the repair then handle; it never invents a payment.
    pub fn parse(value: Option<&str>) -> Ledger {
        Ledger(
            value
                .unwrap_or_default()
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .take(MAX_LEDGER_ENTRIES)
                .map(str::to_string)
                .collect(),
        )
    }

    pub fn contains(&self, entry: &str) -> bool {
        self.0.contains(entry)
    }

    pub fn insert(&mut self, entry: String) {
        self.0.insert(entry);
    }

    /// Keeps only the entries for which `live` holds (their Machine or pool entry still exists):
    /// once CAPI has removed one, its payment needs no record.
    pub fn retain(&mut self, live: impl Fn(&str) -> bool) {
        self.0.retain(|e| live(e));
    }

    /// The annotation value; `None` (remove the annotation) when empty.
    pub fn render(&self) -> Option<String> {
        (!self.0.is_empty()).then(|| self.0.iter().cloned().collect::<Vec<_>>().join(","))
    }
}

/// What a removal still needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// Paid already, or the Machine is being deleted: nothing to do (a retry of CA).
    Done,
    /// Mark the Machine, then decrement.
    MarkAndDecrement,
    /// Our mark is there but unpaid (or a MachinePool node without a Machine): decrement.
    Decrement,
}

/// The view of a Machine the rules need.
#[derive(Clone, Copy, Debug)]
pub struct MachineState<'a> {
    pub name: &'a str,
    pub deleting: bool,
    /// The delete-machine annotation's value, when present.
    pub mark: Option<&'a str>,
}

/// A group's Machines and replicas, as far as the rules need them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub replicas: i32,
    /// Machines not being deleted.
    pub active: usize,
    /// Of those, the ones carrying our mark.
    pub marked_by_us: usize,
}

impl Counts {
    pub fn of<'a>(replicas: i32, machines: impl IntoIterator<Item = MachineState<'a>>) -> Counts {
        let mut counts = Counts {
            replicas,
            ..Counts::default()
        };
        for m in machines.into_iter().filter(|m| !m.deleting) {
            counts.active += 1;
            if m.mark.is_some_and(is_our_mark) {
                counts.marked_by_us += 1;
            }
        }
        counts
    }

    /// Machines beyond replicas: the marks the replicas already pay for.
    pub fn surplus(&self) -> usize {
        surplus(self.active, self.replicas)
    }

    /// Marks of ours no decrement pays for.
    pub fn owed(&self) -> usize {
        self.marked_by_us.saturating_sub(self.surplus())
    }
}

/// How many of a group's `active` Machines (not being deleted) its `replicas` do not cover: Cluster
/// API deletes that many, marked ones first.
pub fn surplus(active: usize, replicas: i32) -> usize {
    active.saturating_sub(usize::try_from(replicas).unwrap_or(0))
}

/// What removing a Machine still needs, from the objects alone.
pub fn removal(machine: MachineState<'_>, counts: &Counts) -> Removal {
    if machine.deleting {
        Removal::Done
    } else if !machine.mark.is_some_and(is_our_mark) {
        Removal::MarkAndDecrement
    } else if counts.owed() > 0 {
        Removal::Decrement
    } else {
        Removal::Done
    }
}

/// What removing a MachinePool node without a Machine still needs: paid once its entry is in the
/// pool's ledger (entries leave the ledger when their id leaves `spec.providerIDList`). A pool has
/// no deletion priority to count with: which instance a lower replica count removes is the
/// infrastructure provider's choice, so the entry itself is the only record.
pub fn pool_removal(entry: &str, ledger: &Ledger) -> Removal {
    if ledger.contains(entry) {
        Removal::Done
    } else {
        Removal::Decrement
    }
}

/// The marks to take back: of our marks on Machines not being deleted, as many as are owed, among
/// those older than `grace_secs`, newest first (the likeliest to be the interrupted ones). The
/// caller holds the group's operation lock, so no removal of this process is half-way.
pub fn orphans<'a>(
    machines: &[MachineState<'a>],
    counts: &Counts,
    now_unix: u64,
    grace_secs: u64,
) -> Vec<&'a str> {
    let mut old: Vec<(u64, &'a str)> = machines
        .iter()
        .filter(|m| !m.deleting)
        .filter_map(|m| Some((m.mark.and_then(our_mark_time)?, m.name)))
        .filter(|(t, _)| now_unix.saturating_sub(*t) >= grace_secs)
        .collect();
    old.sort_by(|a, b| b.cmp(a));
    old.into_iter()
        .take(counts.owed())
        .map(|(_, name)| name)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m<'a>(name: &'a str, deleting: bool, mark: Option<&'a str>) -> MachineState<'a> {
        MachineState {
            name,
            deleting,
            mark,
        }
    }

    #[test]
    fn marks_carry_their_time_and_are_told_from_others() {
        let mark = our_mark(1_700_000_000);
        assert!(is_our_mark(&mark));
        assert_eq!(our_mark_time(&mark), Some(1_700_000_000));
        assert!(!is_our_mark("2024-01-02 15:04:05 +0000 UTC"));
        assert_eq!(our_mark_time("yes"), None);
        assert_eq!(our_mark_time("unix x by capi-autoscaler-provider"), None);
        assert_eq!(
            our_mark_time("unix 99999999999999999999999 by capi-autoscaler-provider"),
            None,
            "an overflowing time is not read"
        );
    }

    #[test]
    fn the_ledger_reads_leniently_and_renders_sorted() {
        let l = Ledger::parse(Some(" b, a,,a , id:i-1"));
        assert_eq!(l.render().as_deref(), Some("a,b,id:i-1"));
        assert_eq!(Ledger::parse(None).render(), None);
        assert_eq!(Ledger::parse(Some(" , ")).render(), None);
        let huge = (0..20_000)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(
            Ledger::parse(Some(&huge))
                .render()
                .map_or(0, |r| r.split(',').count()),
            MAX_LEDGER_ENTRIES
        );
    }

    #[test]
    fn pool_entries_match_any_spelling_of_the_provider_id() {
        assert_eq!(pool_node_entry("aws:///us-east-1a/i-1"), "id:i-1");
        assert_eq!(pool_node_entry("aws:////i-1"), pool_node_entry("i-1"));
    }

    #[test]
    fn a_decrement_is_owed_when_our_marks_exceed_the_surplus() {
        let ours = our_mark(1);
        let machines = |marks: &[Option<&'static str>]| -> Vec<MachineState<'static>> {
            marks
                .iter()
                .enumerate()
                .map(|(i, mark)| m(["a", "b", "c", "d"][i], false, *mark))
                .collect()
        };
        let ours: &'static str = Box::leak(ours.into_boxed_str());
        // Paid: 3 Machines, replicas 2, our mark on one.
        let paid = Counts::of(2, machines(&[Some(ours), None, None]));
        assert_eq!((paid.surplus(), paid.owed()), (1, 0));
        assert_eq!(removal(m("a", false, Some(ours)), &paid), Removal::Done);
        // The leftover mark: replicas unchanged, so the decrement is owed.
        let leftover = Counts::of(3, machines(&[Some(ours), None, None]));
        assert_eq!(leftover.owed(), 1);
        assert_eq!(
            removal(m("a", false, Some(ours)), &leftover),
            Removal::Decrement
        );
        // Absorbed by a scale-up after the removal: owed again.
        let absorbed = Counts::of(4, machines(&[Some(ours), None, None]));
        assert_eq!(absorbed.owed(), 1);
        // Two marks, one paid.
        let two = Counts::of(2, machines(&[Some(ours), Some(ours), None]));
        assert_eq!(two.owed(), 1);
        // Unmarked or foreign-marked Machines need both writes; deleting ones nothing.
        assert_eq!(
            removal(m("b", false, None), &paid),
            Removal::MarkAndDecrement
        );
        assert_eq!(
            removal(m("b", false, Some("yes")), &paid),
            Removal::MarkAndDecrement
        );
        assert_eq!(removal(m("x", true, Some(ours)), &leftover), Removal::Done);
        // Deleting Machines count neither as surplus nor as marks.
        let mut with_deleting = machines(&[Some(ours), None]);
        with_deleting.push(m("z", true, Some(ours)));
        assert_eq!(Counts::of(1, with_deleting).owed(), 0);
    }

    #[test]
    fn pool_nodes_are_paid_by_their_ledger_entry_in_any_spelling() {
        let ledger = Ledger::parse(Some("id:i-9"));
        assert_eq!(
            pool_removal(&pool_node_entry("aws:///zone/i-9"), &ledger),
            Removal::Done
        );
        assert_eq!(
            pool_removal(&pool_node_entry("i-8"), &ledger),
            Removal::Decrement
        );
    }

    #[test]
    fn orphans_are_the_owed_marks_past_the_grace_period_newest_first() {
        let old = our_mark(1_000);
        let older = our_mark(900);
        let fresh = our_mark(1_100);
        let machines = [
            m("older", false, Some(&older)),
            m("old", false, Some(&old)),
            m("fresh", false, Some(&fresh)),
            m("deleting", true, Some(&old)),
            m("foreign", false, Some("yes")),
            m("unmarked", false, None),
        ];
        // 5 active, replicas 4: surplus 1, 3 marks of ours → 2 owed.
        let counts = Counts::of(4, machines);
        assert_eq!(counts.owed(), 2);
        assert_eq!(orphans(&machines, &counts, 1_120, 60), ["old", "older"]);
        let paid = Counts::of(2, machines);
        assert!(orphans(&machines, &paid, 1_120, 60).is_empty(), "all paid");
        assert_eq!(
            orphans(&machines, &counts, 1_200, 60),
            ["fresh", "old"],
            "past the grace period the newest go first"
        );
    }
}
