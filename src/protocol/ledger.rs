//! What the objects record of removals: the delete mark this provider writes on a Machine, and the
//! three sets of entries it keeps on the group object (settled, claimed, being taken back).
//!
//! An entry names one removal: `<machine>@<stamp>` for a mark of ours (the stamp is the one in the
//! mark's value), `<machine>@<stamp>#<hash>` for a mark someone else wrote on a Machine CA named
//! (the mark is kept as its writer left it; the hash names that very value), `id:<providerID>` for
//! a MachinePool node without a Machine. A stamp is its removal's start on the API server's clock
//! (Unix seconds, raised past every earlier stamp of the same Machine): it tells marks of one
//! Machine apart, and the repair ages a record by it (`super::Ripe::Aged`).

use std::collections::BTreeSet;

use crate::capi::providerid;

/// On a group object: the removals its `spec.replicas` already accounts for (settled), by entry,
/// comma-separated. Written only together with the replica write that settles them.
pub const LEDGER_ANNOTATION: &str = "capi-autoscaler-provider/removed";

/// On a group object: removals claimed and not settled yet. Written before a removal marks
/// anything, so a removal interrupted at any point (a crash, a lost answer) is visible to every
/// provider, even once Cluster API has deleted its Machine and the Machine is gone.
pub const CLAIMS_ANNOTATION: &str = "capi-autoscaler-provider/claims";

/// On a group object: marks of ours being taken back, written (guarded by the version decided
/// from) before any of them is unmarked, so a settlement decided from an older version conflicts
/// and never pays a mark that is going away.
pub const TAKING_BACK_ANNOTATION: &str = "capi-autoscaler-provider/taking-back";

/// On a group object: the tokens of the last size changes written without an entry (IncreaseSize,
/// a cancellation of capacity never created), so a write whose answer was lost is recognised when
/// read back and never applied twice.
pub const RESIZES_ANNOTATION: &str = "capi-autoscaler-provider/resizes";

/// Written by earlier versions with the time of the last raise; no longer read or written.
pub const RAISED_ANNOTATION: &str = "capi-autoscaler-provider/raised";

/// The protocol's records on a group object: read by the write path alone, never by what the
/// snapshot serves.
pub const RECORD_ANNOTATIONS: [&str; 5] = [
    LEDGER_ANNOTATION,
    CLAIMS_ANNOTATION,
    TAKING_BACK_ANNOTATION,
    RESIZES_ANNOTATION,
    RAISED_ANNOTATION,
];

/// Marks written by this provider end with this; the value starts with `unix <stamp>`.
const MARK_SUFFIX: &str = " by capi-autoscaler-provider";

/// Longest set kept: a hostile or broken annotation must not grow without bound.
const MAX_ENTRIES: usize = 10_000;

/// Resize tokens kept: enough for every write of the operations in flight on one group.
const MAX_RESIZES: usize = 16;

/// The delete-machine annotation value this provider writes: presence is what Cluster API reads;
/// the stamp names the removal in the entries; the suffix tells it from others' marks.
pub fn our_mark(stamp: u64) -> String {
    format!("unix {stamp}{MARK_SUFFIX}")
}

/// The stamp of a mark of ours (`None` for others' marks or an unreadable value).
pub fn our_mark_stamp(value: &str) -> Option<u64> {
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

/// The entry of a mark of ours.
pub fn mark_entry(machine: &str, stamp: u64) -> String {
    format!("{machine}@{stamp}")
}

/// The entry of a MachinePool node without a Machine: its normalised providerID, so a differently
/// spelled id matches.
pub fn pool_node_entry(provider_id: &str) -> String {
    format!("id:{}", providerid::normalize(provider_id))
}

/// The entry of a removal of Machine `machine` carrying someone else's mark `mark`, claimed with
/// `stamp`: the value's hash names that very mark (another value written later is another removal).
pub fn foreign_entry(machine: &str, mark: &str, stamp: u64) -> String {
    format!("{machine}@{stamp}#{}", mark_hash(mark))
}

/// The entry for Machine `machine` carrying `mark`, claimed with `stamp`: ours by the mark's own
/// stamp, someone else's by [`foreign_entry`].
pub fn entry_for(machine: &str, mark: &str, stamp: u64) -> String {
    match our_mark_stamp(mark) {
        Some(own) => mark_entry(machine, own),
        None => foreign_entry(machine, mark, stamp),
    }
}

/// A stable hash of a mark's value (FNV-1a, 64 bits, hex): the same in every process and build.
fn mark_hash(mark: &str) -> String {
    let hash = mark.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{hash:016x}")
}

/// What an entry names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry<'a> {
    /// A mark of ours on a Machine.
    Ours { machine: &'a str, stamp: u64 },
    /// Someone else's mark (by its hash) on a Machine.
    Foreign {
        machine: &'a str,
        stamp: u64,
        hash: &'a str,
    },
    /// A MachinePool node without a Machine.
    PoolNode(&'a str),
}

impl<'a> Entry<'a> {
    pub fn parse(entry: &'a str) -> Option<Entry<'a>> {
        if entry.starts_with("id:") {
            return Some(Entry::PoolNode(entry));
        }
        let (rest, hash) = match entry.rsplit_once('#') {
            Some((rest, hash)) => (rest, Some(hash)),
            None => (entry, None),
        };
        let (machine, stamp) = rest.rsplit_once('@')?;
        if machine.is_empty() || machine.contains(':') {
            return None;
        }
        let stamp = stamp.parse().ok()?;
        Some(match hash {
            Some(hash) => Entry::Foreign {
                machine,
                stamp,
                hash,
            },
            None => Entry::Ours { machine, stamp },
        })
    }

    /// The stamp of the removal (`None` for a pool node).
    pub fn stamp(&self) -> Option<u64> {
        match self {
            Entry::Ours { stamp, .. } | Entry::Foreign { stamp, .. } => Some(*stamp),
            Entry::PoolNode(_) => None,
        }
    }

    /// The Machine an entry names (`None` for a pool node).
    pub fn machine(&self) -> Option<&'a str> {
        match self {
            Entry::Ours { machine, .. } | Entry::Foreign { machine, .. } => Some(machine),
            Entry::PoolNode(_) => None,
        }
    }

    /// Whether this entry names Machine `machine` carrying `mark`.
    pub fn names(&self, machine: &str, mark: &str) -> bool {
        match *self {
            Entry::Ours { machine: m, stamp } => {
                m == machine && our_mark_stamp(mark) == Some(stamp)
            }
            Entry::Foreign {
                machine: m, hash, ..
            } => m == machine && !is_our_mark(mark) && mark_hash(mark) == hash,
            Entry::PoolNode(_) => false,
        }
    }
}

/// Whether an entry carries its removal's stamp (a MachinePool instance's does not).
pub fn has_stamp(entry: &str) -> bool {
    Entry::parse(entry).and_then(|e| e.stamp()).is_some()
}

/// A set of entries, as one annotation holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ledger(BTreeSet<String>);

impl Ledger {
    /// Reads an annotation leniently: garbage is kept as entries nothing matches, so it can only
    /// make a removal look unrecorded, never invent one.
    pub fn parse(value: Option<&str>) -> Ledger {
        Ledger(
            value
                .unwrap_or_default()
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .take(MAX_ENTRIES)
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

    pub fn remove(&mut self, entry: &str) -> bool {
        self.0.remove(entry)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }

    /// The entry of this set naming Machine `machine` carrying `mark`, if any.
    pub fn naming(&self, machine: &str, mark: &str) -> Option<&str> {
        self.iter()
            .find(|e| Entry::parse(e).is_some_and(|e| e.names(machine, mark)))
    }

    /// A stamp for a new mark on Machine `machine`, at least `now`: after every stamp any of
    /// `sets` holds for it, so a mark written again after one was taken back is another removal.
    pub fn fresh_stamp(machine: &str, now: u64, sets: &[&Ledger]) -> u64 {
        sets.iter()
            .flat_map(|s| s.iter())
            .filter_map(Entry::parse)
            .filter_map(|e| match e {
                Entry::Ours { machine: m, stamp }
                | Entry::Foreign {
                    machine: m, stamp, ..
                } if m == machine => Some(stamp.saturating_add(1)),
                _ => None,
            })
            .fold(now, u64::max)
    }

    /// The annotation value; `None` (remove the annotation) when empty.
    pub fn render(&self) -> Option<String> {
        (!self.0.is_empty()).then(|| self.0.iter().cloned().collect::<Vec<_>>().join(","))
    }
}

impl FromIterator<String> for Ledger {
    fn from_iter<I: IntoIterator<Item = String>>(iter: I) -> Self {
        Ledger(iter.into_iter().collect())
    }
}

/// The tokens of the last size changes written without an entry ([`RESIZES_ANNOTATION`]), newest
/// last.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Resizes(Vec<String>);

impl Resizes {
    pub fn parse(value: Option<&str>) -> Resizes {
        Resizes(
            value
                .unwrap_or_default()
                .split(',')
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .take(MAX_RESIZES)
                .map(str::to_string)
                .collect(),
        )
    }

    pub fn contains(&self, token: &str) -> bool {
        self.0.iter().any(|t| t == token)
    }

    /// These tokens and `token`, the oldest dropped beyond the limit.
    pub fn with(&self, token: &str) -> Resizes {
        let mut tokens: Vec<String> = self.0.iter().filter(|t| *t != token).cloned().collect();
        tokens.push(token.to_string());
        let excess = tokens.len().saturating_sub(MAX_RESIZES);
        Resizes(tokens.split_off(excess))
    }

    pub fn render(&self) -> String {
        self.0.join(",")
    }
}
