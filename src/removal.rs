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

/// On a group object: the marks of ours a repair is taking back (`<machine>@<mark unix seconds>`),
/// written before any of them is unmarked, guarded by the version the repair decided from. A
/// decrement of another provider still in flight (slow, or its process stopping) was prepared
/// against an older version: it now meets a conflict, reads this, and pays none of these marks;
/// landing before it, it makes this write conflict instead and the repair keeps the mark, now
/// paid. Without it, a decrement landing after the unmark would make Cluster API delete a Machine
/// nobody marked. Entries whose Machine no longer carries that mark are dropped by the next repair.
pub const TAKING_BACK_ANNOTATION: &str = "capi-autoscaler-provider/taking-back";

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

/// The Machine and mark time of a mark entry (`None` for pool entries, foreign-mark entries and
/// garbage).
fn parse_mark_entry(entry: &str) -> Option<(&str, u64)> {
    let (machine, time) = entry.rsplit_once('@')?;
    (!machine.is_empty() && !machine.contains(':')).then_some(())?;
    Some((machine, time.parse().ok()?))
}

/// The ledger entry of a decrement paying for a mark someone else wrote on a Machine DeleteNodes
/// named: `<machine>@<paid unix seconds>#<hash of the mark's value>`. The mark is left as it is
/// (the Machine goes either way; its writer's record stays), and the entry pays for that very
/// value: another value written later is another removal.
pub fn foreign_entry(machine: &str, mark: &str, paid_unix: u64) -> String {
    format!("{machine}@{paid_unix}#{}", mark_hash(mark))
}

/// A stable hash of a mark's value (FNV-1a, 64 bits, hex): the same in every process and build.
fn mark_hash(mark: &str) -> String {
    let hash = mark.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{hash:016x}")
}

/// The Machine, payment time and mark hash of a foreign-mark entry.
fn parse_foreign_entry(entry: &str) -> Option<(&str, u64, &str)> {
    let (rest, hash) = entry.rsplit_once('#')?;
    let (machine, paid) = rest.rsplit_once('@')?;
    (!machine.is_empty() && !machine.contains(':')).then_some(())?;
    Some((machine, paid.parse().ok()?, hash))
}

/// The entry a decrement writes to pay for `mark` on Machine `machine` at `now_unix`: ours by its
/// time, another's by [`foreign_entry`].
pub fn payment_entry(machine: &str, mark: &str, now_unix: u64) -> String {
    match our_mark_time(mark) {
        Some(t) => mark_entry(machine, t),
        None => foreign_entry(machine, mark, now_unix),
    }
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

    /// Whether Machine `name`, carrying `mark`, carries a mark a decrement paid for: ours by its
    /// time, someone else's by its value ([`foreign_entry`]).
    pub fn pays(&self, name: &str, mark: Option<&str>) -> bool {
        let Some(mark) = mark else {
            return false;
        };
        match our_mark_time(mark) {
            Some(t) => self.contains(&mark_entry(name, t)),
            None => self.pays_foreign(name, mark),
        }
    }

    fn pays_foreign(&self, name: &str, mark: &str) -> bool {
        let hash = mark_hash(mark);
        self.0.iter().any(|e| {
            parse_foreign_entry(e).is_some_and(|(m, _, h)| m == name && h == hash.as_str())
        })
    }

    /// The entries whose Machine still carries that very mark (`mark_time_of`: the time of our mark
    /// on a Machine of the group, `None` when gone or unmarked): what a repair's taking-back record
    /// keeps once its unmarks are done.
    pub fn still_marked(&self, mark_time_of: impl Fn(&str) -> Option<u64>) -> Ledger {
        Ledger(
            self.0
                .iter()
                .filter(|e| parse_mark_entry(e).is_some_and(|(m, t)| mark_time_of(m) == Some(t)))
                .cloned()
                .collect(),
        )
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
    /// another mark (`mark_of`: the delete mark on a Machine of the group, `None` when absent or
    /// unmarked), and the entry (its mark's time, or its payment's for another's mark) is older
    /// than [`STALE_ENTRY_SECS`].
    pub fn pruned(
        &self,
        listed: &BTreeSet<String>,
        mark_of: impl Fn(&str) -> Option<String>,
        now_unix: u64,
    ) -> Ledger {
        let young = |t: u64| now_unix.saturating_sub(t) < STALE_ENTRY_SECS;
        Ledger(
            self.0
                .iter()
                .filter(|e| {
                    if let Some((machine, t)) = parse_mark_entry(e) {
                        young(t) || mark_of(machine).as_deref().and_then(our_mark_time) == Some(t)
                    } else if let Some((machine, paid, hash)) = parse_foreign_entry(e) {
                        young(paid) || mark_of(machine).is_some_and(|m| mark_hash(&m) == hash)
                    } else {
                        listed.contains(e.as_str())
                    }
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

/// The view of a group member the rules need: a Machine, or a MachinePool instance without one.
#[derive(Clone, Copy, Debug)]
pub struct MachineState<'a> {
    /// The Machine's name; a MachinePool instance without a Machine: its providerID.
    pub name: &'a str,
    pub deleting: bool,
    /// The delete-machine annotation's value, when present.
    pub mark: Option<&'a str>,
    /// It has a Node (`status.nodeRef`).
    pub registered: bool,
    /// Registered, but its `NodeHealthy` or `HealthCheckSucceeded` condition is `False` (or it
    /// reports a terminal failure, which Cluster API before v1beta2 ranked so): with the
    /// unregistered ones, what Cluster API's MachineSet deletes right after the marked Machines.
    pub unhealthy: bool,
    /// A MachinePool instance listed in `spec.providerIDList` without a Machine: counted among
    /// the pool's members, never marked; its removal is paid by its pool entry in the ledger.
    pub machineless: bool,
}

impl MachineState<'_> {
    /// Whether Cluster API ranks it "unhealthy" when it deletes: no Node, or an unhealthy one
    /// (`isMachineHealthy`, machineset_deletion_order.go).
    pub fn ranks_unhealthy(&self) -> bool {
        !self.registered || self.unhealthy
    }
}

/// A group's members and replicas, as far as the rules need them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub replicas: i32,
    /// Members not being deleted: Machines, and MachinePool instances without a Machine.
    pub active: usize,
    /// Of those, the Machines carrying a mark a decrement paid for (ours, or another's a
    /// DeleteNodes named).
    pub paid: usize,
    /// Of those, the ones carrying a mark of ours without a ledger entry.
    pub unledgered: usize,
    /// Of those, the ones carrying a mark someone else wrote (a person, another tool) that no
    /// decrement paid for: Cluster API deletes them first all the same.
    pub foreign: usize,
    /// MachinePool instances without a Machine whose removal a decrement paid for, still listed:
    /// each takes one Machine beyond replicas (the pool's provider removes an instance for it).
    pub pool_paid: usize,
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
            if m.machineless {
                if ledger.contains(&pool_node_entry(m.name)) {
                    counts.pool_paid += 1;
                }
            } else if ledger.pays(m.name, m.mark) {
                counts.paid += 1;
            } else if m.mark.is_some_and(is_our_mark) {
                counts.unledgered += 1;
            } else if m.mark.is_some() {
                counts.foreign += 1;
            }
        }
        counts
    }

    /// Members beyond replicas: how many Cluster API deletes, marked ones first.
    pub fn surplus(&self) -> usize {
        surplus(self.active, self.replicas)
    }

    /// Replicas beyond the members not being deleted: Machines Cluster API has not created yet
    /// (or will create again once those being deleted are gone). While there are any, a
    /// decrement cancels them before it removes anything.
    pub fn not_created(&self) -> usize {
        usize::try_from(self.replicas)
            .unwrap_or(0)
            .saturating_sub(self.active)
    }

    /// The surplus that marked Machines take: what paid pool instances leave of it.
    fn marks_surplus(&self) -> usize {
        self.surplus().saturating_sub(self.pool_paid)
    }

    /// Paid marks replicas no longer make Cluster API delete: absorbed by raises.
    pub fn absorbed(&self) -> usize {
        self.paid.saturating_sub(self.marks_surplus())
    }

    /// Marks of ours without a ledger entry that the surplus left after the paid marks and the
    /// marks of others does not cover: owed a decrement. (Someone else's mark is their removal;
    /// ours without its decrement is the one to take back.)
    pub fn owed(&self) -> usize {
        let covered = self
            .marks_surplus()
            .saturating_sub(self.paid)
            .saturating_sub(self.foreign);
        self.unledgered.saturating_sub(covered)
    }
}

/// How many of a group's `active` Machines (not being deleted) its `replicas` do not cover: Cluster
/// API deletes that many, marked ones first.
pub fn surplus(active: usize, replicas: i32) -> usize {
    active.saturating_sub(usize::try_from(replicas).unwrap_or(0))
}

/// What a DeleteNodes naming some of a group's Machines writes, by Cluster API's own order: when
/// a group has more Machines (not being deleted) than replicas, the MachineSet controller deletes
/// every Machine carrying the delete mark first, whoever wrote it, then the unhealthy ones (no
/// Node, or an unhealthy one), then the rest. So the call removes exactly the named Machines only
/// if, after its writes, every marked Machine is one the replicas remove: the named ones, and
/// marked ones the replicas as they stand already remove. (Which unhealthy or other Machines the
/// count as it stands removes beyond the marked ones does not change: each named Machine's mark
/// comes with one more Machine beyond replicas.)
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Deletion<'a> {
    /// Write our mark on `mark` (named Machines without any mark), then lower replicas by
    /// `decrement`, with the ledger entries of `pay` in the same write (a named Machine carrying
    /// someone else's mark keeps it; the entry pays for that mark). Nothing to write: done
    /// already (a retry, or replicas lowered for these Machines already, e.g. by hand just before).
    Proceed {
        mark: Vec<&'a str>,
        decrement: usize,
        pay: Vec<&'a str>,
    },
    /// Named Machines whose marks are paid, but a raise since made replicas cover one of the
    /// paid marks: which marked Machine Cluster API keeps is its choice, so none is certain to go.
    /// Refused, nothing written, until the repair takes the absorbed marks back (after the grace
    /// period since the raise); then it is a fresh removal. A paid mark is never paid again.
    Absorbed(Vec<&'a str>),
    /// Other Machines carry a delete mark the replicas do not remove yet (or MachinePool
    /// instances a decrement paid for): any decrement would make Cluster API delete one of them
    /// before or instead of a named one. Refused, nothing written.
    OthersMarked(Vec<&'a str>),
    /// Replicas exceed the members not being deleted: Cluster API creates Machines for them
    /// first, so a decrement of one cancels a Machine not created yet and the named one stays
    /// (marked, paid, never deleted). Refused, nothing written: the Machines get created (and
    /// CA removes the named node on a later loop), or CA cancels the capacity that never comes
    /// (DecreaseTargetSize, which cancels Machines not created yet first).
    NotCreated { replicas: i32, members: usize },
}

/// What a DeleteNodes of `named` (Machine names of the group) writes over `replicas`, `ledger` and
/// the group's `machines` (its MachinePool instances without a Machine included), by
/// [`Deletion`]'s rule. The decrement is what makes the marked Machines exactly as many as the
/// Machines beyond replicas: what the count as it stands removes (replicas lowered before the
/// call, capacity cancelled) still goes, each fresh mark is one more, and a named Machine being
/// deleted is done.
pub fn deletion<'a>(
    machines: &[MachineState<'a>],
    named: &BTreeSet<&str>,
    replicas: i32,
    ledger: &Ledger,
) -> Deletion<'a> {
    let counts = Counts::of(replicas, ledger, machines.iter().copied());
    let active: Vec<&MachineState<'a>> = machines.iter().filter(|m| !m.deleting).collect();
    let (named_active, others): (Vec<&MachineState<'a>>, Vec<&MachineState<'a>>) = active
        .iter()
        .partition(|m| !m.machineless && named.contains(m.name));
    let paid_named: Vec<&'a str> = named_active
        .iter()
        .filter(|m| ledger.pays(m.name, m.mark))
        .map(|m| m.name)
        .collect();
    if counts.absorbed() > 0 && !paid_named.is_empty() {
        return Deletion::Absorbed(paid_named);
    }
    let unpaid_named: Vec<&'a str> = named_active
        .iter()
        .filter(|m| !ledger.pays(m.name, m.mark))
        .map(|m| m.name)
        .collect();
    if !unpaid_named.is_empty() && counts.not_created() > 0 {
        return Deletion::NotCreated {
            replicas,
            members: counts.active,
        };
    }
    let others_marked: Vec<&'a str> = others
        .iter()
        .filter(|m| !m.machineless && m.mark.is_some())
        .map(|m| m.name)
        .collect();
    if others_marked.len() + paid_named.len() > counts.marks_surplus() {
        let mut going = others_marked;
        going.extend(
            others
                .iter()
                .filter(|m| m.machineless && ledger.contains(&pool_node_entry(m.name)))
                .map(|m| m.name),
        );
        return Deletion::OthersMarked(going);
    }
    // Each fresh mark is one more Machine beyond replicas; marks the count does not remove yet
    // (ours unpaid, or someone else's on a named Machine) are paid too. What the count as it
    // stands removes (capacity cancelled, replicas lowered by hand) still goes.
    // (The surplus a paid MachinePool instance takes is not the marks': it is paid already.)
    let marked_before =
        others_marked.len() + named_active.iter().filter(|m| m.mark.is_some()).count();
    let fresh = named_active.iter().filter(|m| m.mark.is_none()).count();
    let decrement = fresh + marked_before.saturating_sub(counts.marks_surplus());
    Deletion::Proceed {
        mark: named_active
            .iter()
            .filter(|m| m.mark.is_none())
            .map(|m| m.name)
            .collect(),
        decrement,
        pay: unpaid_named.into_iter().take(decrement).collect(),
    }
}

/// How much of a decrement decided over `decided` (replicas and ledger) is still owed over a
/// later version `now` of the group: less by every drop of replicas since that no removal paid
/// since explains (by hand, a writer without the ledger). Cluster API deletes the marked Machines
/// first for such a drop, so paying it again would remove a node CA never drained. A raise since
/// does not change it.
pub fn still_owed(decrement: usize, decided: (i32, &Ledger), now: (i32, &Ledger)) -> usize {
    let lowered = i64::from(decided.0) - i64::from(now.0);
    let unexplained = lowered - now.1.paid_since(decided.1) as i64;
    decrement.saturating_sub(usize::try_from(unexplained).unwrap_or(0))
}

/// The ledger entries a removal of the Machines `names` still writes with its decrement over a
/// later version `now` of the group (replicas and ledger), decided over `decided` as `decrement`:
/// as many as [`still_owed`] leaves, each paying the mark (`marks`: each Machine of the group with
/// the delete mark it carries) of a named Machine no entry pays yet, ours by its time, someone
/// else's by its value at `paid_at` ([`payment_entry`]). Never more than such marks: a named
/// Machine without a mark is owed nothing. Empty: nothing is owed, nothing is written.
pub fn owed_payments(
    names: &BTreeSet<&str>,
    marks: &[(String, Option<String>)],
    decrement: usize,
    decided: (i32, &Ledger),
    now: (i32, &Ledger),
    paid_at: u64,
) -> Vec<String> {
    let unpaid = marks
        .iter()
        .filter(|(name, _)| names.contains(name.as_str()))
        .filter_map(|(name, mark)| {
            let mark = mark.as_deref()?;
            (!now.1.pays(name, Some(mark))).then(|| payment_entry(name, mark, paid_at))
        });
    unpaid.take(still_owed(decrement, decided, now)).collect()
}

/// How many of the MachinePool nodes without a Machine (by providerID) DeleteNodes names are owed
/// a decrement: those whose entry is not in the pool's `ledger` yet.
pub fn unpaid_pool_nodes<'a>(
    ledger: &Ledger,
    provider_ids: impl IntoIterator<Item = &'a str>,
) -> usize {
    provider_ids
        .into_iter()
        .filter(|id| !ledger.contains(&pool_node_entry(id)))
        .count()
}

/// Why lowering replicas would remove more than capacity that never became a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cancellation<'a> {
    /// Marked Machines the replicas do not remove yet: Cluster API deletes them first.
    Marked(Vec<&'a str>),
    /// Cluster API would remove `removes` unmarked Machines and only `pending` (unmarked,
    /// without a Node) can go without removing a registered node.
    Registered { removes: usize, pending: usize },
    /// Registered Machines Cluster API ranks unhealthy (like those without a Node) and would
    /// remove, by name, before or instead of the pending ones.
    Unhealthy(Vec<&'a str>),
}

/// Whether lowering `replicas` by `by` removes only Machines without a Node and without a mark,
/// in Cluster API's order: Machines not created yet are cancelled first; then it deletes the
/// marked Machines, then the unhealthy ones (no Node, or an unhealthy Node or MachineHealthCheck:
/// one rank, ties broken by name), then the rest. So the Machines beyond the new count must be
/// the marked ones the current count already removes, then, in that order, only pending ones.
pub fn cancellation<'a>(
    machines: &[MachineState<'a>],
    replicas: i32,
    by: u32,
) -> Result<(), Cancellation<'a>> {
    let active: Vec<&MachineState<'a>> = machines.iter().filter(|m| !m.deleting).collect();
    let now = surplus(active.len(), replicas);
    let marked: Vec<&'a str> = active
        .iter()
        .filter(|m| m.mark.is_some())
        .map(|m| m.name)
        .collect();
    if marked.len() > now {
        return Err(Cancellation::Marked(marked));
    }
    let after = surplus(
        active.len(),
        replicas.saturating_sub(i32::try_from(by).unwrap_or(i32::MAX)),
    );
    let removes = after - marked.len();
    let mut unhealthy: Vec<&MachineState<'a>> = active
        .iter()
        .copied()
        .filter(|m| m.mark.is_none() && m.ranks_unhealthy())
        .collect();
    unhealthy.sort_by_key(|m| m.name);
    let pending = unhealthy.iter().filter(|m| !m.registered).count();
    if removes > unhealthy.len() {
        return Err(Cancellation::Registered { removes, pending });
    }
    let registered: Vec<&'a str> = unhealthy
        .iter()
        .take(removes)
        .filter(|m| m.registered)
        .map(|m| m.name)
        .collect();
    if !registered.is_empty() {
        return Err(Cancellation::Unhealthy(registered));
    }
    Ok(())
}

/// What a DecreaseTargetSize that [`cancellation`] allows cancels, pinned so that Cluster API's
/// own order cannot turn it into a registered node: `uncreated` replicas beyond the members (the
/// decrement alone cancels those, first), and the pending Machines (`pin`) Cluster API would
/// remove for the rest of it, which get our delete mark before the decrement (marked Machines go
/// first whatever happens to their nodeRef meanwhile).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CancellationPlan<'a> {
    pub uncreated: usize,
    pub pin: Vec<&'a str>,
}

/// [`cancellation`]'s decision with what it cancels: of the unmarked Machines Cluster API ranks
/// first (pending or unhealthy, by name), those the count as it stands removes already come
/// first (not this call's; left as they are), the next ones are this call's to pin. `uncreated`
/// is the rest of `by`, what no Machine exists for.
pub fn cancellation_plan<'a>(
    machines: &[MachineState<'a>],
    replicas: i32,
    by: u32,
) -> Result<CancellationPlan<'a>, Cancellation<'a>> {
    cancellation(machines, replicas, by)?;
    let active: Vec<&MachineState<'a>> = machines.iter().filter(|m| !m.deleting).collect();
    let marked = active.iter().filter(|m| m.mark.is_some()).count();
    let now = surplus(active.len(), replicas);
    let after = surplus(
        active.len(),
        replicas.saturating_sub(i32::try_from(by).unwrap_or(i32::MAX)),
    );
    let mut first: Vec<&MachineState<'a>> = active
        .iter()
        .copied()
        .filter(|m| m.mark.is_none() && m.ranks_unhealthy())
        .collect();
    first.sort_by_key(|m| m.name);
    let pin: Vec<&'a str> = first
        .iter()
        .skip(now - marked)
        .take(after - now)
        .map(|m| m.name)
        .collect();
    Ok(CancellationPlan {
        uncreated: (by as usize).saturating_sub(pin.len()),
        pin,
    })
}

/// Until when (unix seconds) a DecreaseTargetSize may not cancel `uncreated` replicas that have no
/// Machine yet: Cluster API's MachineSet controller may still be creating Machines for the raise at
/// `raised`, and a Machine it creates after the decision cannot be pinned; lowered under it, the
/// MachineSet could delete that Machine, registered by then, unmarked. `None`: allowed (nothing
/// uncreated to cancel, never raised, or the raise is `grace_secs` old). A raise dated in the
/// future (a clock ahead of ours) holds until `grace_secs` after it.
pub fn uncreated_hold(
    uncreated: usize,
    raised: Option<u64>,
    now_unix: u64,
    grace_secs: u64,
) -> Option<u64> {
    if uncreated == 0 || !raised_within(raised, now_unix, grace_secs) {
        return None;
    }
    raised.map(|at| at.saturating_add(grace_secs))
}

/// Whether writing `wanted` replicas over `current` keeps the group within `[min, max]`, or, from
/// outside it (bounds changed under the group), moves it toward the range without passing it.
pub fn within_bounds(current: i32, wanted: i32, min: i32, max: i32) -> bool {
    let inside = |n: i32| (min..=max).contains(&n);
    inside(wanted)
        || (current > max && wanted < current && wanted >= min)
        || (current < min && wanted > current && wanted <= max)
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

    #[test]
    fn capacity_without_a_machine_is_not_cancelled_while_a_raise_may_still_create_machines() {
        // Within the grace period after the last raise: held until the raise is `grace` old.
        assert_eq!(uncreated_hold(1, Some(1000), 1000, 30), Some(1030));
        assert_eq!(uncreated_hold(2, Some(1000), 1029, 30), Some(1030));
        // The grace period over, never raised, or nothing without a Machine to cancel: allowed.
        assert_eq!(uncreated_hold(1, Some(1000), 1030, 30), None);
        assert_eq!(uncreated_hold(1, None, 1000, 30), None);
        assert_eq!(uncreated_hold(0, Some(1000), 1000, 30), None);
        // A raise dated ahead of our clock holds until grace after it.
        assert_eq!(uncreated_hold(1, Some(1100), 1000, 30), Some(1130));
        // No grace period: never held.
        assert_eq!(uncreated_hold(1, Some(1000), 1000, 0), None);
    }

    #[test]
    fn a_taking_back_record_keeps_only_marks_still_there_and_names_exactly_them() {
        let record = Ledger::parse(Some("a@100,b@200,c@300,id:i-1"));
        // a: still that mark; b: marked again later; c: unmarked (or gone); pool entries dropped.
        let kept = record.still_marked(|m| match m {
            "a" => Some(100),
            "b" => Some(900),
            _ => None,
        });
        assert_eq!(kept.render().as_deref(), Some("a@100"));
        assert!(
            kept.pays("a", Some(&our_mark(100))),
            "the mark being taken back"
        );
        assert!(
            !kept.pays("a", Some(&our_mark(101))),
            "a fresh mark is not that one"
        );
        assert!(!kept.pays("b", Some(&our_mark(900))));
        assert!(
            !kept.pays("a", Some("yes")),
            "another's mark is never ours to pay"
        );
    }

    fn m<'a>(name: &'a str, deleting: bool, mark: Option<&'a str>) -> MachineState<'a> {
        MachineState {
            name,
            deleting,
            mark,
            registered: true,
            unhealthy: false,
            machineless: false,
        }
    }

    /// A registered Machine Cluster API ranks unhealthy (NodeHealthy or its MachineHealthCheck
    /// False).
    fn sick(name: &'static str) -> MachineState<'static> {
        MachineState {
            unhealthy: true,
            ..m(name, false, None)
        }
    }

    /// A MachinePool instance without a Machine.
    fn instance(id: &'static str) -> MachineState<'static> {
        MachineState {
            machineless: true,
            ..m(id, false, None)
        }
    }

    /// A Machine that never got its Node.
    fn pending(name: &'static str) -> MachineState<'static> {
        MachineState {
            registered: false,
            ..m(name, false, None)
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

    fn proceed(mark: &[&'static str], decrement: usize, pay: &[&'static str]) -> Deletion<'static> {
        Deletion::Proceed {
            mark: mark.to_vec(),
            decrement,
            pay: pay.to_vec(),
        }
    }

    fn named(names: &[&'static str]) -> BTreeSet<&'static str> {
        names.iter().copied().collect()
    }

    /// Paid: 3 Machines, replicas 2, m0's mark in the ledger. A retry is done, never paid again;
    /// another node is a fresh removal; a Machine being deleted is done.
    #[test]
    fn a_paid_mark_is_done_and_never_paid_again() {
        let mark = leak(our_mark(100));
        let ledger = Ledger::parse(Some("m0@100"));
        let machines = [
            m("m0", false, Some(mark)),
            m("m1", false, None),
            m("m2", false, None),
        ];
        assert_eq!(
            deletion(&machines, &named(&["m0"]), 2, &ledger),
            proceed(&[], 0, &[])
        );
        assert_eq!(
            deletion(&machines, &named(&["m1"]), 2, &ledger),
            proceed(&["m1"], 1, &["m1"])
        );
        assert_eq!(
            deletion(&machines, &named(&["m0", "m1"]), 2, &ledger),
            proceed(&["m1"], 1, &["m1"]),
            "the paid one stays paid, the other is paid once"
        );
        let deleting = [m("m0", true, Some(mark)), machines[1], machines[2]];
        assert_eq!(
            deletion(&deleting, &named(&["m0"]), 2, &ledger),
            proceed(&[], 0, &[])
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
        assert_eq!(
            deletion(&machines, &named(&["m0"]), 3, &ledger),
            Deletion::Absorbed(vec!["m0"])
        );
        assert_eq!(
            deletion(&machines, &named(&["m1"]), 3, &ledger),
            Deletion::OthersMarked(vec!["m0"]),
            "m0's absorbed mark would go before m1"
        );
        let unmarked = [m("m0", false, None), machines[1], machines[2]];
        assert_eq!(
            deletion(&unmarked, &named(&["m0"]), 3, &ledger),
            proceed(&["m0"], 1, &["m0"])
        );
    }

    /// Legacy and leftover: a mark of ours without an entry that replicas already remove is done
    /// (paid by a version before the ledger); one they do not is owed its decrement.
    #[test]
    fn unledgered_marks_are_paid_only_when_replicas_do_not_remove_them() {
        let mark = leak(our_mark(100));
        let none = Ledger::default();
        let machines = [
            m("m0", false, Some(mark)),
            m("m1", false, None),
            m("m2", false, None),
        ];
        assert_eq!(
            deletion(&machines, &named(&["m0"]), 2, &none),
            proceed(&[], 0, &[])
        );
        assert_eq!(
            deletion(&machines, &named(&["m0"]), 3, &none),
            proceed(&[], 1, &["m0"])
        );
        let counts = Counts::of(3, &none, machines);
        assert_eq!((counts.unledgered, counts.owed()), (1, 1));
    }

    /// Someone else's mark counts like any: Cluster API deletes it first. A removal of another
    /// Machine is refused while replicas do not remove it, and proceeds once they do (or names
    /// it itself: the mark stays as its writer left it, and the decrement pays for it).
    #[test]
    fn a_mark_someone_else_wrote_counts_and_refuses_a_removal_it_would_preempt() {
        let none = Ledger::default();
        let machines = [
            m("a", false, Some("yes")),
            m("b", false, None),
            m("c", false, None),
        ];
        assert_eq!(
            deletion(&machines, &named(&["c"]), 3, &none),
            Deletion::OthersMarked(vec!["a"])
        );
        assert_eq!(
            deletion(&machines, &named(&["c"]), 2, &none),
            proceed(&["c"], 1, &["c"]),
            "replicas remove a already: c is one more"
        );
        assert_eq!(
            deletion(&machines, &named(&["a"]), 3, &none),
            proceed(&[], 1, &["a"]),
            "named itself: kept, paid"
        );
        let counts = Counts::of(3, &none, machines);
        assert_eq!((counts.foreign, counts.owed()), (1, 0));
        // Our leftover beside it: the foreign mark takes the surplus first, ours is owed.
        let ours = leak(our_mark(100));
        let both = [machines[0], m("b", false, Some(ours)), machines[2]];
        let counts = Counts::of(2, &none, both);
        assert_eq!(
            (counts.foreign, counts.unledgered, counts.owed()),
            (1, 1, 1)
        );
    }

    /// A named Machine carrying someone else's mark keeps it (the Machine goes either way; its
    /// writer's record stays): the decrement pays for that very value, so a retry is done, a raise
    /// absorbs it like ours, the repair never takes it back, and a new value is a new removal.
    #[test]
    fn a_foreign_mark_on_a_named_machine_is_kept_and_paid_once() {
        let machines = [
            m("a", false, Some("by hand")),
            m("b", false, None),
            m("c", false, None),
        ];
        let entry = foreign_entry("a", "by hand", 500);
        assert_eq!(payment_entry("a", "by hand", 500), entry);
        assert_eq!(
            payment_entry("a", &our_mark(7), 500),
            "a@7",
            "ours by its time"
        );
        let ledger = Ledger::parse(Some(&entry));
        assert!(ledger.pays("a", Some("by hand")));
        assert!(!ledger.pays("a", Some("by hand, again")), "another value");
        assert!(!ledger.pays("b", Some("by hand")), "another Machine");
        assert_eq!(parse_mark_entry(&entry), None, "not one of our marks");
        let counts = Counts::of(2, &ledger, machines);
        assert_eq!(
            (
                counts.paid,
                counts.foreign,
                counts.owed(),
                counts.absorbed()
            ),
            (1, 0, 0, 0)
        );
        assert_eq!(
            deletion(&machines, &named(&["a"]), 2, &ledger),
            proceed(&[], 0, &[]),
            "a retry is done"
        );
        assert_eq!(
            deletion(&machines, &named(&["c"]), 2, &ledger),
            proceed(&["c"], 1, &["c"])
        );
        assert_eq!(
            deletion(&machines, &named(&["a"]), 3, &ledger),
            Deletion::Absorbed(vec!["a"])
        );
        assert!(
            orphans(
                &machines,
                &ledger,
                &Counts::of(3, &ledger, machines),
                None,
                9_999,
                60
            )
            .is_empty(),
            "someone else's mark is never taken back"
        );
        // Kept while the Machine carries that value; once it does not, until it is old.
        let mark_of = |value: Option<&'static str>| move |_: &str| value.map(str::to_string);
        let none = BTreeSet::new();
        let old = 500 + STALE_ENTRY_SECS;
        assert_eq!(ledger.pruned(&none, mark_of(Some("by hand")), old), ledger);
        assert_eq!(ledger.pruned(&none, mark_of(None), old - 1), ledger);
        assert_eq!(
            ledger.pruned(&none, mark_of(Some("other")), old).render(),
            None
        );
        assert_eq!(ledger.pruned(&none, mark_of(None), old).render(), None);
    }

    /// A MachinePool's instances without a Machine are members like its Machines: with one beside
    /// a paid mark, a retry is done (counting the Machines alone, the paid mark would look
    /// absorbed, or owed again); a paid instance still listed takes one Machine beyond replicas.
    #[test]
    fn machinepool_instances_without_a_machine_count_like_machines() {
        let mark = leak(our_mark(100));
        let ledger = Ledger::parse(Some("m1@100"));
        let pool = [
            m("m1", false, Some(mark)),
            m("m2", false, None),
            instance("i-3"),
            instance("i-4"),
        ];
        assert_eq!(
            deletion(&pool, &named(&["m1"]), 3, &ledger),
            proceed(&[], 0, &[]),
            "4 members, replicas 3: m1's paid mark is the one beyond"
        );
        let machines_only = [pool[0], pool[1]];
        assert_eq!(
            deletion(&machines_only, &named(&["m1"]), 3, &ledger),
            Deletion::Absorbed(vec!["m1"]),
            "(what counting the Machines alone would have made of it)"
        );
        let pool_paid = Ledger::parse(Some("id:i-3"));
        let unmarked = [m("m1", false, None), pool[1], pool[2], pool[3]];
        let counts = Counts::of(3, &pool_paid, unmarked);
        assert_eq!(
            (counts.active, counts.pool_paid, counts.surplus()),
            (4, 1, 1)
        );
        assert_eq!(
            deletion(&unmarked, &named(&["m1"]), 3, &pool_paid),
            proceed(&["m1"], 1, &["m1"]),
            "the pool's paid instance still goes, m1 is one more"
        );
        let foreign = [
            m("m1", false, None),
            m("f", false, Some("yes")),
            pool[2],
            pool[3],
        ];
        assert_eq!(
            deletion(&foreign, &named(&["m1"]), 3, &pool_paid),
            Deletion::OthersMarked(vec!["f", "i-3"]),
            "the one beyond replicas is i-3's: f's mark is not removed yet"
        );
        // A Machine without providerID (but with a Node) is a member like any: the rules see it
        // as a Machine; the actuator lists it with the group's Machines.
        let unlisted = [pool[0], pool[1], m("no-id", false, None)];
        assert_eq!(
            deletion(&unlisted, &named(&["m1"]), 2, &ledger),
            proceed(&[], 0, &[])
        );
    }

    /// Replicas above the members Cluster API has (Machines not created yet, or to be created
    /// again once those being deleted are gone): a decrement would cancel one of those and the
    /// named Machine would stay, so a removal is refused; a retry of a paid one is still done.
    #[test]
    fn a_removal_while_machines_are_not_created_yet_is_refused() {
        let machines = [
            m("a", false, None),
            m("b", false, None),
            m("c", true, Some("yes")),
        ];
        let none = Ledger::default();
        assert_eq!(
            deletion(&machines, &named(&["a"]), 3, &none),
            Deletion::NotCreated {
                replicas: 3,
                members: 2
            }
        );
        assert_eq!(
            deletion(&machines, &named(&["a"]), 2, &none),
            proceed(&["a"], 1, &["a"])
        );
        assert_eq!(
            deletion(&machines, &named(&["c"]), 3, &none),
            proceed(&[], 0, &[]),
            "a named Machine being deleted is done"
        );
        assert_eq!(Counts::of(5, &none, machines).not_created(), 3);
        // DecreaseTargetSize cancels them first.
        assert_eq!(cancellation(&machines, 4, 2), Ok(()));
        assert!(cancellation(&machines, 4, 3).is_err());
    }

    /// Cluster API ranks a registered Machine with an unhealthy Node (or a failed health check)
    /// with those that never got one, ties broken by name: a decrease that would reach it before
    /// the pending one is refused; one that reaches only pending ones goes through.
    #[test]
    fn a_decrease_never_reaches_an_unhealthy_registered_machine() {
        let group = [m("a", false, None), sick("b-sick"), pending("p")];
        assert_eq!(
            cancellation(&group, 3, 1),
            Err(Cancellation::Unhealthy(vec!["b-sick"])),
            "b-sick sorts before p in the unhealthy rank"
        );
        let after = [m("a", false, None), sick("x-sick"), pending("p")];
        assert_eq!(cancellation(&after, 3, 1), Ok(()), "p sorts first");
        assert_eq!(
            cancellation(&after, 3, 2),
            Err(Cancellation::Unhealthy(vec!["x-sick"]))
        );
        assert_eq!(
            cancellation(&[sick("b-sick"), group[0]], 2, 1),
            Err(Cancellation::Unhealthy(vec!["b-sick"])),
            "no pending Machine at all"
        );
        let marked = [m("a", false, Some("yes")), sick("b-sick"), pending("p")];
        assert_eq!(
            cancellation(&marked, 2, 1),
            Err(Cancellation::Unhealthy(vec!["b-sick"])),
            "after the mark the count removes, the unhealthy rank by name"
        );
        // DeleteNodes: marks go before the unhealthy rank, so the named one goes exactly.
        let none = Ledger::default();
        assert_eq!(
            deletion(&group, &named(&["a"]), 3, &none),
            proceed(&["a"], 1, &["a"])
        );
    }

    /// Replicas lowered (by hand) before the call: what that count removes still goes, the named
    /// Machine is one more; a drop during the call (seen on a conflict) takes the named Machine's
    /// place, as Cluster API deletes the marked one first for it.
    #[test]
    fn replicas_lowered_by_someone_else_are_paid_once() {
        let none = Ledger::default();
        let machines = [
            m("a", false, None),
            m("b", false, None),
            m("c", false, None),
        ];
        assert_eq!(
            deletion(&machines, &named(&["c"]), 2, &none),
            proceed(&["c"], 1, &["c"])
        );
        let decided = Ledger::parse(Some("a@1"));
        assert_eq!(still_owed(1, (3, &decided), (3, &decided)), 1);
        assert_eq!(still_owed(1, (3, &decided), (2, &decided)), 0, "by hand");
        let paid_other = Ledger::parse(Some("a@1,b@2"));
        assert_eq!(
            still_owed(1, (3, &decided), (2, &paid_other)),
            1,
            "another removal paid meanwhile explains the drop"
        );
        assert_eq!(still_owed(2, (5, &decided), (4, &decided)), 1);
        assert_eq!(still_owed(1, (5, &decided), (6, &decided)), 1, "a raise");
    }

    /// The decrement pays the named Machines' marks no entry pays yet, one entry each, never more
    /// than is still owed: a retry whose decrement landed owes nothing, a drop by hand pays one.
    #[test]
    fn a_removal_owes_one_entry_per_unpaid_named_mark_and_no_more_than_still_owed() {
        let marks = |pairs: &[(&str, Option<String>)]| -> Vec<(String, Option<String>)> {
            pairs
                .iter()
                .map(|(n, m)| (n.to_string(), m.clone()))
                .collect()
        };
        let all = marks(&[
            ("a", Some(our_mark(100))),
            ("b", Some(our_mark(101))),
            ("c", Some(our_mark(102))),
        ]);
        let none = Ledger::default();
        let ab = named(&["a", "b"]);
        assert_eq!(
            owed_payments(&ab, &all, 2, (5, &none), (5, &none), 900),
            vec!["a@100".to_string(), "b@101".to_string()],
            "each named mark once; c is not named"
        );
        let landed = Ledger::parse(Some("a@100,b@101"));
        assert!(
            owed_payments(&ab, &all, 2, (5, &none), (3, &landed), 900).is_empty(),
            "a retry over the version its decrement landed in pays nothing twice"
        );
        assert_eq!(
            owed_payments(&ab, &all, 2, (5, &none), (4, &none), 900),
            vec!["a@100".to_string()],
            "replicas lowered by hand since pay for one of them"
        );
        assert_eq!(
            owed_payments(&ab, &all, 2, (5, &none), (6, &none), 900).len(),
            2,
            "a raise since changes nothing owed"
        );
        let half = Ledger::parse(Some("a@100"));
        assert_eq!(
            owed_payments(&ab, &all, 1, (5, &half), (5, &half), 900),
            vec!["b@101".to_string()],
            "a paid mark is never paid again"
        );
        let unmarked = marks(&[("a", None), ("b", Some(our_mark(101)))]);
        assert_eq!(
            owed_payments(&ab, &unmarked, 2, (5, &none), (5, &none), 900),
            vec!["b@101".to_string()],
            "a named Machine without a mark is owed nothing"
        );
        let foreign = marks(&[("a", Some("yes".to_string()))]);
        let paid = owed_payments(&named(&["a"]), &foreign, 1, (5, &none), (5, &none), 900);
        assert_eq!(paid, vec![foreign_entry("a", "yes", 900)]);
        assert!(Ledger::parse(Some(&paid[0])).pays("a", Some("yes")));
    }

    #[test]
    fn pool_nodes_already_in_the_ledger_are_owed_nothing_in_any_spelling() {
        let ledger = Ledger::parse(Some("id:i-1,m0@100"));
        assert_eq!(
            unpaid_pool_nodes(&ledger, ["aws:///us-east-1a/i-1", "aws:///us-east-1a/i-2"]),
            1
        );
        assert_eq!(unpaid_pool_nodes(&ledger, ["i-1"]), 0);
        assert_eq!(unpaid_pool_nodes(&Ledger::default(), ["i-1", "i-2"]), 2);
    }

    /// The surplus pays for paid marks first (their decrements are certain), what it leaves for
    /// unledgered ones; a paid mark the surplus no longer covers refuses removals beside it.
    #[test]
    fn the_surplus_pays_for_paid_marks_first() {
        let (a, b) = (leak(our_mark(100)), leak(our_mark(110)));
        let ledger = Ledger::parse(Some("paid@100"));
        let machines = [
            m("paid", false, Some(a)),
            m("legacy", false, Some(b)),
            m("plain", false, None),
            m("plain2", false, None),
        ];
        let counts = Counts::of(2, &ledger, machines);
        assert_eq!((counts.absorbed(), counts.owed()), (0, 0));
        assert_eq!(
            deletion(&machines, &named(&["plain"]), 2, &ledger),
            proceed(&["plain"], 1, &["plain"])
        );
        let counts = Counts::of(3, &ledger, machines);
        assert_eq!((counts.absorbed(), counts.owed()), (0, 1));
        assert_eq!(
            deletion(&machines, &named(&["legacy"]), 3, &ledger),
            proceed(&[], 1, &["legacy"])
        );
        assert_eq!(
            deletion(&machines, &named(&["plain"]), 3, &ledger),
            Deletion::OthersMarked(vec!["paid", "legacy"])
        );
    }

    /// DecreaseTargetSize: only Machines without a Node and without a mark may go for the count
    /// written; a mark the replicas do not remove yet goes first.
    #[test]
    fn a_decrease_cancels_only_pending_unmarked_machines() {
        let group = [m("a", false, None), m("b", false, None), pending("p")];
        assert_eq!(cancellation(&group, 3, 1), Ok(()));
        assert_eq!(
            cancellation(&group, 3, 2),
            Err(Cancellation::Registered {
                removes: 2,
                pending: 1
            })
        );
        let marked = [m("a", false, Some("yes")), group[1], group[2]];
        assert_eq!(
            cancellation(&marked, 3, 1),
            Err(Cancellation::Marked(vec!["a"]))
        );
        assert_eq!(
            cancellation(&marked, 2, 1),
            Ok(()),
            "the mark is removed by the count as it stands; the pending one goes next"
        );
        let deleting = [m("a", true, Some("yes")), group[1], group[2]];
        assert_eq!(cancellation(&deleting, 2, 1), Ok(()));
        assert_eq!(
            cancellation(&group, 5, 3),
            Ok(()),
            "two Machines not created yet are cancelled, then the pending one"
        );
        assert_eq!(
            cancellation(&group, 5, 4),
            Err(Cancellation::Registered {
                removes: 2,
                pending: 1
            })
        );
    }

    /// After a DecreaseTargetSize, Machines without a Node are beyond replicas, going: a named
    /// node is one more, paid, never in their place (the cancelled capacity still goes).
    #[test]
    fn a_removal_beside_cancelled_capacity_is_paid() {
        let none = Ledger::default();
        let machines = [
            m("a", false, None),
            m("b", false, None),
            pending("p1"),
            pending("p2"),
        ];
        assert_eq!(
            deletion(&machines, &named(&["a"]), 2, &none),
            proceed(&["a"], 1, &["a"])
        );
        assert_eq!(
            deletion(&machines, &named(&["a"]), 1, &none),
            proceed(&["a"], 1, &["a"]),
            "lowered further by hand: that still goes too"
        );
    }

    #[test]
    fn writes_stay_in_bounds_or_move_toward_them() {
        assert!(within_bounds(3, 2, 1, 5));
        assert!(!within_bounds(3, 6, 1, 5));
        assert!(!within_bounds(1, 0, 1, 5));
        assert!(within_bounds(7, 6, 1, 5), "above max, lowered toward it");
        assert!(!within_bounds(7, 8, 1, 5), "above max, raised further");
        assert!(!within_bounds(7, 0, 1, 5), "above max, past min");
        assert!(within_bounds(0, 1, 2, 5), "below min, raised toward it");
        assert!(!within_bounds(1, 0, 2, 5), "below min, lowered further");
    }

    #[test]
    fn entries_are_pruned_once_their_mark_is_gone_and_old() {
        let ledger = Ledger::parse(Some(
            "kept@100,gone@100,remarked@100,young@950,id:i-1,id:i-2",
        ));
        let listed = BTreeSet::from(["id:i-1".to_string()]);
        let mark_of = |name: &str| match name {
            "kept" => Some(our_mark(100)),
            "remarked" => Some(our_mark(900)),
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
        // 5 active, replicas 3: surplus 2, taken first by the foreign mark; of 3 unledgered
        // marks of ours 1 covered, 2 owed.
        let counts = Counts::of(3, &none, machines);
        assert_eq!(counts.owed(), 2);
        assert_eq!(
            orphans(&machines, &none, &counts, None, 1_120, 60),
            ["old", "older"]
        );
        let paid = Counts::of(1, &none, machines);
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

    /// A DecreaseTargetSize pins what it cancels: replicas without a Machine are cancelled by the
    /// decrement alone, first; then the pending Machines Cluster API ranks first for the count
    /// written (by name), each to be marked before the decrement, so a nodeRef arriving before
    /// Cluster API acts no longer lets its Random order reach a registered node.
    #[test]
    fn a_decrease_pins_the_pending_machines_it_cancels_after_uncreated_capacity() {
        let plan = |uncreated, pin: &[&'static str]| {
            Ok(CancellationPlan {
                uncreated,
                pin: pin.to_vec(),
            })
        };
        let group = [m("a", false, None), pending("q"), pending("p")];
        assert_eq!(
            cancellation_plan(&group, 3, 1),
            plan(0, &["p"]),
            "p sorts first"
        );
        assert_eq!(cancellation_plan(&group, 3, 2), plan(0, &["p", "q"]));
        assert_eq!(
            cancellation_plan(&group, 5, 1),
            plan(1, &[]),
            "capacity not created is cancelled first, no Machine is touched"
        );
        assert_eq!(cancellation_plan(&group, 5, 3), plan(2, &["p"]));
        assert_eq!(cancellation_plan(&group, 5, 4), plan(2, &["p", "q"]));
        assert!(
            cancellation_plan(&group, 5, 5).is_err(),
            "a registers: never a registered node"
        );
        // Machines being deleted are neither counted nor pinned.
        let deleting = [m("a", false, None), m("gone", true, None), pending("p")];
        assert_eq!(cancellation_plan(&deleting, 2, 1), plan(0, &["p"]));
        // A paid mark the count removes already goes first, as it stands; so does an unmarked
        // surplus (replicas lowered by hand): this call pins the next pending ones.
        let marked = [m("a", false, Some("yes")), pending("p"), pending("q")];
        assert_eq!(cancellation_plan(&marked, 2, 1), plan(0, &["p"]));
        let lowered = [m("a", false, None), pending("p"), pending("q")];
        assert_eq!(
            cancellation_plan(&lowered, 2, 1),
            plan(0, &["q"]),
            "p is the surplus the count removes already"
        );
        // Every refusal of `cancellation` stands.
        assert_eq!(
            cancellation_plan(&[sick("b-sick"), pending("p")], 2, 1),
            Err(Cancellation::Unhealthy(vec!["b-sick"]))
        );
        assert_eq!(
            cancellation_plan(&[m("a", false, Some("yes")), pending("p")], 2, 1),
            Err(Cancellation::Marked(vec!["a"]))
        );
        assert_eq!(
            cancellation_plan(&[m("a", false, None), pending("p")], 2, 2),
            Err(Cancellation::Registered {
                removes: 2,
                pending: 1
            })
        );
    }
}
