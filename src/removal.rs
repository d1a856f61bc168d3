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
mod tests;
