//! A snapshot put together: the patch when the changes allow it, else the full build in its steps,
//! then prices and problems over the groups.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::machines::normalized_ids;
use super::{Builder, TemplateMemo};
use crate::capi::ObjectKey;
use crate::pricing::{PricedNode, ReferencePrices};
use crate::problem::Problem;
use crate::scope::{self, Scope};
use crate::snapshot::{Groups, Lookup, Snapshot};

impl<'a> Builder<'a> {
    pub(super) fn build(mut self, basis: u64) -> Snapshot {
        if let Some(snapshot) = self.patch(basis) {
            return snapshot;
        }
        let sets_by_deployment = self.machine_sets_by_deployment();
        let machine_sets = Arc::new(
            sets_by_deployment
                .iter()
                .map(|(&(namespace, name), sets)| {
                    let keys: Vec<ObjectKey> = sets.iter().map(|ms| ms.key.clone()).collect();
                    (ObjectKey::new(namespace, name), keys)
                })
                .collect(),
        );
        self.scope = scope::decide(
            self.settings.cluster.as_ref(),
            &self.index.observed_clusters(),
            &self.candidate_clusters(),
            &self.index.cluster_keys(),
        );
        let (mut groups, mut group_problems) = self.candidate_groups(&sets_by_deployment);
        self.problems.extend(scope::discovery_problems(
            &self.settings.discovery,
            &self.scope,
        ));
        let scope_reason = match &self.scope {
            Scope::Nothing(why) => Some(format!("no node group is served: {why}")),
            Scope::Cluster { cluster, how } if groups.is_empty() && self.out_of_scope > 0 => {
                Some(format!(
                    "no node group is served: none belongs to Cluster {cluster} ({how}); {} of \
                     other Clusters left out",
                    self.out_of_scope
                ))
            }
            _ => None,
        };
        let mut lookup = Lookup::default();
        let found = self.machines_by_group(&groups, &mut lookup);
        self.attach_instances(&mut groups, found, &mut lookup);
        lookup.by_normalized_id = normalized_ids(&lookup);
        let mut templates = self.templates(&mut groups, &mut group_problems);
        // One shared id per group, for the maps every later patch copies.
        let mut shared_templates = HashMap::with_capacity(templates.len());
        let mut shared_problems = HashMap::with_capacity(group_problems.len());
        let mut served = BTreeMap::new();
        for (id, group) in groups {
            let shared: Arc<str> = Arc::from(id.as_str());
            if let Some(memo) = templates.remove(&id) {
                shared_templates.insert(Arc::clone(&shared), memo);
            }
            if let Some(problems) = group_problems.remove(&id) {
                shared_problems.insert(Arc::clone(&shared), Arc::from(problems));
            }
            served.insert(shared, Arc::new(group));
        }
        let groups = Groups::new(served);
        lookup.place_groups(&groups);
        lookup.shrink_to_fit();
        let (templates, group_problems) = (shared_templates, shared_problems);
        let mut base_problems = std::mem::take(&mut self.problems);
        base_problems.sort();
        base_problems.dedup();
        let skipped = std::mem::take(&mut self.skipped);
        let mut snapshot = self.finish(
            basis,
            groups,
            Arc::new(lookup),
            templates,
            machine_sets,
            group_problems,
            base_problems,
            skipped,
        );
        snapshot.scope = std::mem::take(&mut self.scope);
        snapshot.scope_reason = scope_reason;
        snapshot.not_served = std::mem::take(&mut self.not_served);
        snapshot
    }
    /// The rest of a snapshot, from its groups and problems.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::snapshot) fn finish(
        &self,
        basis: u64,
        groups: Groups,
        lookup: Arc<Lookup>,
        templates: HashMap<Arc<str>, Arc<TemplateMemo>>,
        machine_sets: Arc<HashMap<ObjectKey, Vec<ObjectKey>>>,
        group_problems: HashMap<Arc<str>, Arc<[Problem]>>,
        base_problems: Vec<Problem>,
        skipped: BTreeMap<String, String>,
    ) -> Snapshot {
        let priced: Vec<PricedNode> = groups
            .values()
            .filter_map(|g| {
                let (hourly, template) = (g.price?, g.template.as_ref()?);
                Some(PricedNode {
                    hourly,
                    cpu_cores: template.summary.cpu_cores,
                    memory_gib: template.summary.memory_gib,
                    gpu: template.summary.gpu.is_some(),
                })
            })
            .collect();
        let (reference_prices, reference_sources) = ReferencePrices::resolve(
            self.settings.cpu_hour_price,
            self.settings.gib_hour_price,
            &priced,
        );
        let mut problems: Vec<Problem> = base_problems
            .iter()
            .chain(group_problems.values().flat_map(|p| p.iter()))
            .cloned()
            .collect();
        problems.sort();
        problems.dedup();
        Snapshot {
            groups,
            lookup,
            templates,
            machine_sets,
            group_problems,
            base_problems,
            scope: Scope::Unknown,
            scope_reason: None,
            basis,
            skipped,
            not_served: BTreeMap::new(),
            problems,
            reference_prices,
            reference_sources,
            machines: self.index.machines().len(),
        }
    }
}
