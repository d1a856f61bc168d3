//! The full build of a snapshot from the index: which resources are served groups (`serving`), their
//! Machines and instances and the lookups (`machines`), the templates, reused from the previous build
//! when their inputs did not change (`templates`), and the snapshot put together with its problems and
//! prices (`assembly`). Here the [`Builder`] they all extend, and the index's entry points.

mod assembly;
mod machines;
mod serving;
mod templates;

use std::collections::BTreeMap;

use super::instances::MachineView;
use super::{NotServed, Settings, Snapshot};
use crate::cache::{Index, Journal};
use crate::problem::Problem;
use crate::scope::Scope;

pub(super) use templates::TemplateMemo;

impl Index {
    /// Builds the snapshot: node groups, their instances and templates, lookup tables, problems.
    pub fn snapshot(&self, settings: &Settings) -> Snapshot {
        Builder::new(self, settings, None, None).build(0)
    }

    /// [`snapshot`](Self::snapshot) for a store that rebuilds over and over: `previous` is the last
    /// snapshot this index built this way (with the same settings). When everything that changed since
    /// is local to some groups (replicas written, Machines marked: the provider's own writes), only
    /// those groups are rebuilt and the rest, lookups included, is shared with `previous`; otherwise
    /// it is built from scratch, reusing the templates whose inputs did not change. Either way the
    /// result equals [`snapshot`](Self::snapshot)'s.
    pub fn snapshot_reusing(&mut self, settings: &Settings, previous: &Snapshot) -> Snapshot {
        let (basis, journal) = self.take_journal();
        Builder::new(self, settings, Some(previous), Some(&journal)).build(basis)
    }
}

pub(super) struct Builder<'a> {
    pub(super) index: &'a Index,
    pub(super) settings: &'a Settings,
    pub(super) previous: Option<&'a Snapshot>,
    /// What changed since `previous`, when known.
    pub(super) journal: Option<&'a Journal>,
    /// Problems not of a served group (see `Snapshot::base_problems`); a group's are collected apart.
    problems: Vec<Problem>,
    skipped: BTreeMap<String, String>,
    not_served: BTreeMap<String, NotServed>,
    /// Which Cluster's groups this build serves.
    pub(super) scope: Scope,
    /// Candidate groups left out because they belong to another Cluster.
    out_of_scope: usize,
}

impl<'a> Builder<'a> {
    /// The cached Machines and Nodes the instances are read from.
    pub(super) fn machines(&self) -> MachineView<'a> {
        MachineView {
            index: self.index,
            delete_key: &self.settings.keys.delete_machine,
        }
    }

    fn new(
        index: &'a Index,
        settings: &'a Settings,
        previous: Option<&'a Snapshot>,
        journal: Option<&'a Journal>,
    ) -> Self {
        Builder {
            index,
            settings,
            previous,
            journal,
            problems: Vec::new(),
            skipped: BTreeMap::new(),
            not_served: BTreeMap::new(),
            scope: Scope::Unknown,
            out_of_scope: 0,
        }
    }

    /// Runs `f` with a problem list of its own; returns its result and the problems it found.
    pub(super) fn collecting<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> (T, Vec<Problem>) {
        let outer = std::mem::take(&mut self.problems);
        let value = f(self);
        let inner = std::mem::replace(&mut self.problems, outer);
        (value, inner)
    }

    fn skip(&mut self, id: String, reason: NotServed, why: impl Into<String>) {
        self.not_served.insert(id.clone(), reason);
        self.skipped.insert(id, why.into());
    }
}
