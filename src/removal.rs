//! Pure rules for removing nodes: which removals are still owed a replica decrement, which are paid,
//! which a raise absorbed, and which delete marks are orphans to repair. No I/O: the actuator feeds
//! it cached or freshly read objects.
//!
//! A removal is "mark the Machine, lower replicas by one": two writes to two objects. The decrement
//! is written together with an entry in the group's [`LEDGER_ANNOTATION`] naming the mark it pays
//! for (Machine name and the mark's time), in one guarded write, so whether a mark is paid is read
//! from the objects, by any provider, after any restart. Cluster API deletes marked Machines first
//! whenever a group has more Machines than replicas, so the group's surplus (Machines not being
//! deleted, less `spec.replicas`) is how many marks replicas make it delete:
//!
//! - a paid mark is never paid again (invariant 3: at most once per mark). While the paid marks are
//!   no more than the surplus, a retry is done already; once a raise has made them more (replicas
//!   now cover a Machine a paid removal asked to go, before Cluster API deleted it), the raise has
//!   absorbed a paid mark: which of the marked Machines Cluster API keeps is its choice, so none of
//!   them is certain to go, and a DeleteNodes naming one is refused until the repair has taken
//!   the absorbed marks back (after the grace period since the raise); then it is a fresh removal;
//! - a mark of ours without a ledger entry (written by a version before the ledger, or left between
//!   the two writes by a crash or a lost answer) keeps the surplus counting: the surplus beyond the
//!   paid marks pays for such marks, and those beyond it are owed a decrement, which a retried
//!   DeleteNodes pays, or, once older than the grace period, the repair takes back.
//!
//! MachinePool nodes without a Machine cannot be marked: the pool's ledger lists the normalised
//! providerIDs whose decrement its `spec.replicas` includes, written in the same guarded write as
//! the decrement, so it survives restarts and matches any spelling of the id.

use std::collections::BTreeSet;

use crate::capi::providerid;

/// On a group object: the removals its `spec.replicas` already pays for, comma-separated: a
/// Machine's mark as `<machine>@<mark unix seconds>`, a MachinePool node without a Machine as
/// `id:<normalised providerID>`. Written only together with `spec.replicas`.
pub const LEDGER_ANNOTATION: &str = "capi-autoscaler-provider/removed";

/// On a group object: when this provider last raised its replicas (unix seconds), written in the
/// same guarded write as the raise. Cluster API's controllers act on the replicas they cached: for a
/// while after a raise one may still act on the lower count and delete marked Machines first, so
/// no provider's repair takes a mark back within the grace period after any provider's raise.
pub const RAISED_ANNOTATION: &str = "capi-autoscaler-provider/raised";

/// Marks written by this provider end with this; the value starts with `unix <seconds>`.
const MARK_SUFFIX: &str = " by capi-autoscaler-provider";

/// Longest ledger kept: a group never has more removals in flight than Machines, but a hostile or
/// broken annotation must not grow without bound.
const MAX_LEDGER_ENTRIES: usize = 10_000;

/// How long a Machine's ledger entry is kept after its Machine is gone or carries another mark: a
/// cache a moment behind another provider's mark must not erase that provider's payment. A stale
/// entry is harmless meanwhile: a new mark of that Machine is always dated after it.
pub const STALE_ENTRY_SECS: u64 = 600;

/// The delete-machine annotation value this provider writes: presence is what Cluster API reads;
/// the time dates it for the orphan repair and names it in the ledger; the suffix tells it from
/// others' marks.
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

/// When the group was last raised, from its [`RAISED_ANNOTATION`] (`None`: never, or unreadable).
pub fn raised_at(value: Option<&str>) -> Option<u64> {
    value?.trim().parse().ok()
}

/// Whether a raise at `raised` is within `grace_secs` of `now_unix` (a raise dated in the future, a
/// clock ahead of ours, counts as recent).
pub fn raised_within(raised: Option<u64>, now_unix: u64, grace_secs: u64) -> bool {
    raised.is_some_and(|at| now_unix.saturating_sub(at) < grace_secs)
}

/// The removals a group's replicas already pay for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ledger(BTreeSet<String>);

/// The ledger entry of a MachinePool node without a Machine: its normalised providerID, so a
/// differently spelled id matches.
pub fn pool_node_entry(provider_id: &str) -> String {
    format!("id:{}", providerid::normalize(provider_id))
}

/// The ledger entry of a Machine's mark: the Machine and the mark's time (Machine names have no
/// `@`, `,` or `:`, so it is told from pool entries).
pub fn mark_entry(machine: &str, mark_time: u64) -> String {
    format!("{machine}@{mark_time}")
}

/// The Machine and mark time of a mark entry (`None` for pool entries and garbage).
fn parse_mark_entry(entry: &str) -> Option<(&str, u64)> {
    let (machine, time) = entry.rsplit_once('@')?;
    (!machine.is_empty() && !machine.contains(':')).then_some(())?;
    Some((machine, time.parse().ok()?))
}

impl Ledger {
    /// Reads the annotation leniently: a garbled value can only make a paid removal look unpaid,
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

    /// Whether Machine `name`, carrying `mark`, carries a mark of ours that a decrement paid for.
    pub fn pays(&self, name: &str, mark: Option<&str>) -> bool {
        mark.and_then(our_mark_time)
            .is_some_and(|t| self.contains(&mark_entry(name, t)))
    }

    /// Entries that are here and not in `earlier`: removals paid since.
    pub fn paid_since(&self, earlier: &Ledger) -> usize {
        self.0.difference(&earlier.0).count()
    }

    /// The time for a new mark on Machine `name` at `now_unix`: after every entry of that Machine, so
    /// a mark taken back and written again within a second is never mistaken for the paid one.
    pub fn fresh_mark_time(&self, name: &str, now_unix: u64) -> u64 {
        self.0
            .iter()
            .filter_map(|e| parse_mark_entry(e))
            .filter(|(m, _)| *m == name)
            .map(|(_, t)| t.saturating_add(1))
            .fold(now_unix, u64::max)
    }

    /// The ledger without the entries that need no record any more: a pool node's once its id left
    /// `listed` (the pool's `spec.providerIDList`); a Machine's once the Machine is gone or carries
    /// another mark (`mark_time_of`: the time of our mark on a Machine of the group, `None` when
    /// absent or unmarked), and the entry is older than [`STALE_ENTRY_SECS`].
    pub fn pruned(
        &self,
        listed: &BTreeSet<String>,
        mark_time_of: impl Fn(&str) -> Option<u64>,
        now_unix: u64,
    ) -> Ledger {
        Ledger(
            self.0
                .iter()
                .filter(|e| match parse_mark_entry(e) {
                    Some((machine, t)) => {
                        mark_time_of(machine) == Some(t)
                            || now_unix.saturating_sub(t) < STALE_ENTRY_SECS
                    }
                    None => listed.contains(e.as_str()),
                })
                .cloned()
                .collect(),
        )
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
    /// Our mark is paid, but a raise since made replicas cover it: refused, nothing written, until
    /// the repair takes the mark back.
    Absorbed,
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
    /// Of those, the ones carrying a mark of ours the ledger pays for.
    pub paid: usize,
    /// Of those, the ones carrying a mark of ours without a ledger entry.
    pub unledgered: usize,
}

impl Counts {
    pub fn of<'a>(
        replicas: i32,
        ledger: &Ledger,
        machines: impl IntoIterator<Item = MachineState<'a>>,
    ) -> Counts {
        let mut counts = Counts {
            replicas,
            ..Counts::default()
        };
        for m in machines.into_iter().filter(|m| !m.deleting) {
            counts.active += 1;
            if ledger.pays(m.name, m.mark) {
                counts.paid += 1;
            } else if m.mark.is_some_and(is_our_mark) {
                counts.unledgered += 1;
            }
        }
        counts
    }

    /// Machines beyond replicas: how many marked Machines Cluster API deletes.
    pub fn surplus(&self) -> usize {
        surplus(self.active, self.replicas)
    }

    /// Paid marks replicas no longer make Cluster API delete: absorbed by raises.
    pub fn absorbed(&self) -> usize {
        self.paid.saturating_sub(self.surplus())
    }

    /// Marks of ours without a ledger entry that the surplus left after the paid marks does not
    /// cover: owed a decrement.
    pub fn owed(&self) -> usize {
        let covered = self.surplus().saturating_sub(self.paid);
        self.unledgered.saturating_sub(covered)
    }
}

/// How many of a group's `active` Machines (not being deleted) its `replicas` do not cover: Cluster
/// API deletes that many, marked ones first.
pub fn surplus(active: usize, replicas: i32) -> usize {
    active.saturating_sub(usize::try_from(replicas).unwrap_or(0))
}

/// What removing a Machine still needs, from the objects alone.
pub fn removal(machine: MachineState<'_>, ledger: &Ledger, counts: &Counts) -> Removal {
    if machine.deleting {
        Removal::Done
    } else if ledger.pays(machine.name, machine.mark) {
        if counts.absorbed() > 0 {
            Removal::Absorbed
        } else {
            Removal::Done
        }
    } else if !machine.mark.is_some_and(is_our_mark) {
        Removal::MarkAndDecrement
    } else if counts.owed() > 0 {
        Removal::Decrement
    } else {
        Removal::Done
    }
}

/// Whether a Machine removal decided over a group version of `decided_replicas` and `decided_ledger`
/// still lowers replicas when written over a version of `replicas` and `ledger`: not when that
/// very mark was paid meanwhile (an earlier attempt whose answer was lost, or another provider),
/// nor when replicas dropped by more than the removals paid since explain (by hand, or a writer
/// without the ledger): Cluster API deletes the marked Machine for that drop (marked ones go first),
/// and a second decrement would remove a node CA never drained. A raise meanwhile does not stop it.
pub fn decrement_owed(
    entry: &str,
    (decided_replicas, decided_ledger): (i32, &Ledger),
    (replicas, ledger): (i32, &Ledger),
) -> bool {
    let lowered = i64::from(decided_replicas) - i64::from(replicas);
    !ledger.contains(entry) && lowered <= ledger.paid_since(decided_ledger) as i64
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

/// The marks to take back, none while the group was raised within `grace_secs` (by any provider:
/// `raised` is read from the group object): of our marks on Machines not being deleted and older
/// than `grace_secs`, as many paid ones as raises absorbed and as many unledgered ones as are owed,
/// newest first (the likeliest to be the interrupted ones). What stays marked is never less than
/// the surplus, so Cluster API never deletes an unmarked Machine for it. The caller holds the
/// group's operation lock, so no removal of this process is half-way.
pub fn orphans<'a>(
    machines: &[MachineState<'a>],
    ledger: &Ledger,
    counts: &Counts,
    raised: Option<u64>,
    now_unix: u64,
    grace_secs: u64,
) -> Vec<&'a str> {
    if raised_within(raised, now_unix, grace_secs) {
        return Vec::new();
    }
    let old = |paid: bool| {
        let mut old: Vec<(u64, &'a str)> = machines
            .iter()
            .filter(|m| !m.deleting && ledger.pays(m.name, m.mark) == paid)
            .filter_map(|m| Some((m.mark.and_then(our_mark_time)?, m.name)))
            .filter(|(t, _)| now_unix.saturating_sub(*t) >= grace_secs)
            .collect();
        old.sort_by(|a, b| b.cmp(a));
        old.into_iter().map(|(_, name)| name)
    };
    old(true)
        .take(counts.absorbed())
        .chain(old(false).take(counts.owed()))
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

    fn leak(s: String) -> &'static str {
        Box::leak(s.into_boxed_str())
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
    fn a_mark_is_paid_only_by_the_entry_of_that_very_mark() {
        let ledger = Ledger::parse(Some("m0@100,id:i-1"));
        assert!(ledger.pays("m0", Some(&our_mark(100))));
        assert!(
            !ledger.pays("m0", Some(&our_mark(101))),
            "a later mark of the same Machine is a new removal"
        );
        assert!(!ledger.pays("m1", Some(&our_mark(100))), "another Machine");
        assert!(!ledger.pays("m0", Some("yes")), "someone else's mark");
        assert!(!ledger.pays("m0", None));
        assert_eq!(
            parse_mark_entry("id:i-1"),
            None,
            "pool entries are not marks"
        );
        assert_eq!(parse_mark_entry("m0@x"), None);
        assert_eq!(parse_mark_entry("a.b-c@7"), Some(("a.b-c", 7)));
    }

    #[test]
    fn a_fresh_mark_is_dated_after_every_entry_of_its_machine() {
        let ledger = Ledger::parse(Some("m0@100,m0@104,m1@200,id:i-1"));
        assert_eq!(ledger.fresh_mark_time("m0", 104), 105);
        assert_eq!(ledger.fresh_mark_time("m0", 300), 300);
        assert_eq!(ledger.fresh_mark_time("m2", 50), 50);
    }

    /// Paid: 3 Machines, replicas 2, m0's mark in the ledger. A retry is done, never paid again.
    #[test]
    fn a_paid_mark_is_done() {
        let mark = leak(our_mark(100));
        let ledger = Ledger::parse(Some("m0@100"));
        let machines = [
            m("m0", false, Some(mark)),
            m("m1", false, None),
            m("m2", false, None),
        ];
        let counts = Counts::of(2, &ledger, machines);
        assert_eq!(
            (counts.paid, counts.unledgered, counts.surplus()),
            (1, 0, 1)
        );
        assert_eq!((counts.absorbed(), counts.owed()), (0, 0));
        assert_eq!(removal(machines[0], &ledger, &counts), Removal::Done);
        assert_eq!(
            removal(machines[1], &ledger, &counts),
            Removal::MarkAndDecrement
        );
        assert_eq!(
            removal(m("m1", false, Some("yes")), &ledger, &counts),
            Removal::MarkAndDecrement,
            "someone else's mark is not a payment"
        );
        assert_eq!(
            removal(m("m9", true, Some(mark)), &ledger, &counts),
            Removal::Done,
            "a Machine being deleted"
        );
    }

    /// Absorbed: the same, then a raise to 3. The paid mark is refused, never paid again, and a
    /// new mark of that Machine (after the repair took the old one back) is a fresh removal.
    #[test]
    fn a_paid_mark_a_raise_absorbed_is_refused_never_paid_again() {
        let mark = leak(our_mark(100));
        let ledger = Ledger::parse(Some("m0@100"));
        let machines = [
            m("m0", false, Some(mark)),
            m("m1", false, None),
            m("m2", false, None),
        ];
        let counts = Counts::of(3, &ledger, machines);
        assert_eq!((counts.absorbed(), counts.owed()), (1, 0));
        assert_eq!(removal(machines[0], &ledger, &counts), Removal::Absorbed);
        // Taken back by the repair, the Machine is unmarked: a fresh removal.
        let unmarked = Counts::of(3, &ledger, [m("m0", false, None), machines[1], machines[2]]);
        assert_eq!(
            removal(m("m0", false, None), &ledger, &unmarked),
            Removal::MarkAndDecrement
        );
        // Two paid marks, replicas raised by one: one absorbed, which Machine CAPI keeps is its
        // choice, so both are refused.
        let second = leak(our_mark(110));
        let ledger = Ledger::parse(Some("m0@100,m1@110"));
        let two = [
            m("m0", false, Some(mark)),
            m("m1", false, Some(second)),
            machines[2],
        ];
        let counts = Counts::of(2, &ledger, two);
        assert_eq!((counts.surplus(), counts.absorbed()), (1, 1));
        assert_eq!(removal(two[0], &ledger, &counts), Removal::Absorbed);
        assert_eq!(removal(two[1], &ledger, &counts), Removal::Absorbed);
        // Cluster API has deleted one of them: the surplus is spent, the other is absorbed still.
        let after = [m("m0", true, Some(mark)), two[1], two[2]];
        let counts = Counts::of(2, &ledger, after);
        assert_eq!(removal(after[0], &ledger, &counts), Removal::Done);
        assert_eq!(removal(after[1], &ledger, &counts), Removal::Absorbed);
    }

    /// Unpaid or legacy: marks of ours without an entry keep the surplus counting, so marks paid by
    /// a version before the ledger are not paid again after an upgrade, and a leftover is paid.
    #[test]
    fn unledgered_marks_keep_the_surplus_counting() {
        let mark = leak(our_mark(100));
        let ledger = Ledger::default();
        let machines = [
            m("m0", false, Some(mark)),
            m("m1", false, None),
            m("m2", false, None),
        ];
        // Paid by an older version: replicas 2 make CAPI delete it.
        let legacy = Counts::of(2, &ledger, machines);
        assert_eq!((legacy.unledgered, legacy.owed()), (1, 0));
        assert_eq!(removal(machines[0], &ledger, &legacy), Removal::Done);
        // Left without its decrement: replicas unchanged, owed.
        let leftover = Counts::of(3, &ledger, machines);
        assert_eq!(leftover.owed(), 1);
        assert_eq!(removal(machines[0], &ledger, &leftover), Removal::Decrement);
    }

    /// Mixed: the surplus pays for the paid marks first (their decrements are certain), what it
    /// leaves pays for unledgered ones.
    #[test]
    fn the_surplus_pays_for_paid_marks_first() {
        let (a, b, c) = (
            leak(our_mark(100)),
            leak(our_mark(110)),
            leak(our_mark(120)),
        );
        let ledger = Ledger::parse(Some("paid@100"));
        let machines = [
            m("paid", false, Some(a)),
            m("legacy", false, Some(b)),
            m("inflight", false, Some(c)),
            m("plain", false, None),
        ];
        // Replicas 2: surplus 2 → the paid mark and one unledgered; the other is owed.
        let counts = Counts::of(2, &ledger, machines);
        assert_eq!((counts.paid, counts.unledgered), (1, 2));
        assert_eq!((counts.absorbed(), counts.owed()), (0, 1));
        assert_eq!(removal(machines[0], &ledger, &counts), Removal::Done);
        assert_eq!(removal(machines[1], &ledger, &counts), Removal::Decrement);
        // Replicas 1: all paid for.
        let counts = Counts::of(1, &ledger, machines);
        assert_eq!((counts.absorbed(), counts.owed()), (0, 0));
        // Replicas 4: no surplus; the paid mark is absorbed, both unledgered ones owed.
        let counts = Counts::of(4, &ledger, machines);
        assert_eq!((counts.absorbed(), counts.owed()), (1, 2));
        assert_eq!(removal(machines[0], &ledger, &counts), Removal::Absorbed);
        assert_eq!(removal(machines[2], &ledger, &counts), Removal::Decrement);
    }

    #[test]
    fn pool_nodes_are_paid_by_their_ledger_entry_in_any_spelling() {
        let ledger = Ledger::parse(Some("id:i-9,m0@5"));
        assert_eq!(
            pool_removal(&pool_node_entry("aws:///zone/i-9"), &ledger),
            Removal::Done
        );
        assert_eq!(
            pool_removal(&pool_node_entry("i-8"), &ledger),
            Removal::Decrement
        );
        // Pool entries are no Machine's payment, and count in no Machine counts.
        let counts = Counts::of(1, &ledger, [m("i-9", false, None)]);
        assert_eq!((counts.paid, counts.unledgered), (0, 0));
    }

    #[test]
    fn entries_are_pruned_once_their_mark_is_gone_and_old() {
        let ledger = Ledger::parse(Some(
            "kept@100,gone@100,remarked@100,young@950,id:i-1,id:i-2",
        ));
        let listed = BTreeSet::from(["id:i-1".to_string()]);
        let mark_of = |name: &str| match name {
            "kept" => Some(100),
            "remarked" => Some(900),
            _ => None,
        };
        let now = 100 + STALE_ENTRY_SECS;
        assert_eq!(
            ledger.pruned(&listed, mark_of, now).render().as_deref(),
            Some("id:i-1,kept@100,young@950"),
            "pool entries go with their listing, as before; a Machine's when its mark is gone \
             and the entry is older than {STALE_ENTRY_SECS}s"
        );
        assert_eq!(
            ledger.pruned(&listed, mark_of, now - 1).render().as_deref(),
            Some("gone@100,id:i-1,kept@100,remarked@100,young@950"),
            "younger entries stay, whatever the cache shows"
        );
    }

    #[test]
    fn removals_paid_since_are_counted_from_the_ledger() {
        let before = Ledger::parse(Some("a@1,id:i-1"));
        let now = Ledger::parse(Some("a@1,b@2,c@3"));
        assert_eq!(now.paid_since(&before), 2);
        assert_eq!(before.paid_since(&before), 0);
    }

    #[test]
    fn a_decrement_is_written_once_and_not_over_an_unexplained_drop() {
        let decided = Ledger::parse(Some("a@1"));
        let paid_other = Ledger::parse(Some("a@1,b@2"));
        let paid_this = Ledger::parse(Some("a@1,x@9"));
        assert!(decrement_owed("x@9", (5, &decided), (5, &decided)));
        assert!(
            !decrement_owed("x@9", (5, &decided), (4, &paid_this)),
            "paid meanwhile"
        );
        assert!(
            decrement_owed("x@9", (5, &decided), (4, &paid_other)),
            "another removal paid meanwhile explains the drop"
        );
        assert!(
            !decrement_owed("x@9", (5, &decided), (4, &decided)),
            "a drop no paid removal explains: CAPI deletes the marked Machine for it"
        );
        assert!(
            decrement_owed("x@9", (5, &decided), (6, &decided)),
            "a raise meanwhile"
        );
    }

    #[test]
    fn the_raise_record_reads_leniently() {
        assert_eq!(raised_at(Some(" 1700 ")), Some(1700));
        assert_eq!(raised_at(Some("soon")), None);
        assert_eq!(raised_at(None), None);
        assert!(raised_within(Some(100), 102, 3));
        assert!(!raised_within(Some(100), 103, 3));
        assert!(
            raised_within(Some(200), 100, 3),
            "a raise dated ahead of our clock"
        );
        assert!(!raised_within(None, 100, 3));
    }

    #[test]
    fn orphans_are_the_absorbed_and_owed_marks_past_the_grace_period_newest_first() {
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
        let none = Ledger::default();
        // 5 active, replicas 4: surplus 1, 3 unledgered marks of ours → 2 owed.
        let counts = Counts::of(4, &none, machines);
        assert_eq!(counts.owed(), 2);
        assert_eq!(
            orphans(&machines, &none, &counts, None, 1_120, 60),
            ["old", "older"]
        );
        let paid = Counts::of(2, &none, machines);
        assert!(
            orphans(&machines, &none, &paid, None, 1_120, 60).is_empty(),
            "all paid"
        );
        assert_eq!(
            orphans(&machines, &none, &counts, None, 1_200, 60),
            ["fresh", "old"],
            "past the grace period the newest go first"
        );
        assert!(
            orphans(&machines, &none, &counts, Some(1_150), 1_200, 60).is_empty(),
            "nothing within the grace period after a raise"
        );
        assert_eq!(
            orphans(&machines, &none, &counts, Some(1_100), 1_200, 60),
            ["fresh", "old"]
        );
        // Paid marks: "older" and "old" paid, replicas 5 → no surplus: both absorbed, the
        // unledgered "fresh" owed; "fresh" is too young yet.
        let ledger = Ledger::parse(Some("older@900,old@1000"));
        let counts = Counts::of(5, &ledger, machines);
        assert_eq!((counts.absorbed(), counts.owed()), (2, 1));
        assert_eq!(
            orphans(&machines, &ledger, &counts, Some(1_000), 1_120, 60),
            ["old", "older"]
        );
        // Replicas 4: surplus 1 pays for one paid mark; one absorbed, taken back newest first.
        let counts = Counts::of(4, &ledger, machines);
        assert_eq!((counts.absorbed(), counts.owed()), (1, 1));
        assert_eq!(
            orphans(&machines, &ledger, &counts, None, 1_200, 60),
            ["old", "fresh"]
        );
    }
}
