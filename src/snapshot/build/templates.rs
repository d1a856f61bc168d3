//! Each served group's template, with what it was built from so the next build can reuse it when
//! those inputs did not change.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use super::Builder;
use crate::cache::{InfraKind, InfraKindState, same_but_counts};
use crate::capi::{InfraTemplate, Labels, ObjectKey, ScalableResource};
use crate::problem::Problem;
use crate::snapshot::{NodeGroup, object_name};
use crate::template::{self, FailureDomainZone, InfraSource, TemplateInputs, TemplateNode};

/// What a group's template was built from, and what came of it.
#[derive(Clone, Debug)]
pub(in crate::snapshot) struct TemplateMemo {
    resource: Arc<ScalableResource>,
    infra: InfraInput,
    /// The labels templates copy from an existing Node of the group.
    pub(in crate::snapshot) node_labels: Vec<(String, String)>,
    /// The zone of the template's failure domain, from the Nodes in it.
    pub(in crate::snapshot) failure_domain_zone: Option<FailureDomainZone>,
    pub(in crate::snapshot) template: Option<Arc<TemplateNode>>,
    pub(in crate::snapshot) problems: Vec<Problem>,
}

impl TemplateMemo {
    fn holds_for(
        &self,
        resource: &Arc<ScalableResource>,
        infra: &InfraInput,
        node_labels: &[(String, String)],
        failure_domain_zone: Option<&FailureDomainZone>,
    ) -> bool {
        (Arc::ptr_eq(&self.resource, resource) || same_for_template(&self.resource, resource))
            && self.infra.same(infra)
            && self.node_labels == node_labels
            && self.failure_domain_zone.as_ref() == failure_domain_zone
    }
}

/// Whether two versions of a resource give the same template: everything but the replica counts
/// (only whether the group is at zero matters: it decides whether a missing capacity is a problem),
/// the resourceVersion and the rollout state.
fn same_for_template(a: &ScalableResource, b: &ScalableResource) -> bool {
    same_but_counts(a, b, |x, y| (x.unwrap_or(0) == 0) == (y.unwrap_or(0) == 0))
}

/// The infrastructure template input of a group's template, owned.
#[derive(Clone, Debug)]
enum InfraInput {
    NoReference,
    Found(Arc<InfraTemplate>),
    Unavailable(String),
    /// The reference itself is malformed (a problem on the group).
    Malformed(Problem),
}

impl InfraInput {
    fn same(&self, other: &InfraInput) -> bool {
        match (self, other) {
            (InfraInput::NoReference, InfraInput::NoReference) => true,
            (InfraInput::Found(a), InfraInput::Found(b)) => Arc::ptr_eq(a, b) || a == b,
            (InfraInput::Unavailable(a), InfraInput::Unavailable(b)) => a == b,
            (InfraInput::Malformed(a), InfraInput::Malformed(b)) => a == b,
            _ => false,
        }
    }

    fn source(&self) -> InfraSource<'_> {
        match self {
            InfraInput::NoReference | InfraInput::Malformed(_) => InfraSource::NoReference,
            InfraInput::Found(template) => InfraSource::Found(template),
            InfraInput::Unavailable(reason) => InfraSource::Unavailable {
                reason: reason.clone(),
            },
        }
    }
}

impl<'a> Builder<'a> {
    /// The infrastructure template input of a group's template.
    fn infra_input(&self, resource: &ScalableResource) -> InfraInput {
        let index = self.index;
        match &resource.template.infrastructure_ref {
            None => InfraInput::NoReference,
            Some(Err(e)) => InfraInput::Malformed(Problem::new(
                object_name(resource.kind, &resource.key),
                format!("spec.template.spec.infrastructureRef: {}", e.field),
                e.message.clone(),
            )),
            Some(Ok(reference)) => {
                let kind = InfraKind::of(reference);
                let key = ObjectKey::new(resource.key.namespace.as_str(), reference.name.as_str());
                let what = format!(
                    "{} {}/{} ({})",
                    reference.kind, key.namespace, key.name, reference.api_group
                );
                match index.infra_kind_state(&kind) {
                    None | Some(InfraKindState::Syncing) => InfraInput::Unavailable(format!(
                        "{what}: the watch of {} has not listed yet",
                        reference.kind
                    )),
                    Some(InfraKindState::Unavailable(why)) => InfraInput::Unavailable(format!(
                        "{what}: cannot read {}: {why}",
                        reference.kind
                    )),
                    Some(InfraKindState::Synced) => match index.infra(&kind, &key) {
                        Some(Ok(template)) => InfraInput::Found(Arc::clone(template)),
                        Some(Err(problem)) => InfraInput::Unavailable(format!(
                            "{what}: {}: {}",
                            problem.field, problem.message
                        )),
                        None => InfraInput::Unavailable(format!("{what}: not found")),
                    },
                }
            }
        }
    }

    /// The template of `group`: taken from the previous snapshot when its inputs are the same.
    pub(in crate::snapshot) fn template_memo(
        &self,
        group: &NodeGroup,
        node_labels: Option<&BTreeMap<String, String>>,
        copied: Vec<(String, String)>,
        failure_domain_zone: Option<FailureDomainZone>,
    ) -> Arc<TemplateMemo> {
        let infra = self.infra_input(&group.resource);
        if let Some(memo) = self
            .previous
            .and_then(|p| p.templates.get(group.id.as_str()))
            .filter(|m| {
                m.holds_for(
                    &group.resource,
                    &infra,
                    &copied,
                    failure_domain_zone.as_ref(),
                )
            })
        {
            return Arc::clone(memo);
        }
        let outcome = template::build(&TemplateInputs {
            group_id: &group.id,
            resource: &group.resource,
            infra: infra.source(),
            node_labels,
            default_arch: self.settings.default_arch.as_deref(),
            failure_domain_zone: failure_domain_zone.as_ref(),
        });
        let mut problems = outcome.problems;
        if let InfraInput::Malformed(problem) = &infra {
            problems.push(problem.clone());
        }
        Arc::new(TemplateMemo {
            resource: Arc::clone(&group.resource),
            infra,
            node_labels: copied,
            failure_domain_zone,
            template: outcome.template.map(Arc::new),
            problems,
        })
    }

    /// The zone labels of the Nodes of Machines in each failure domain, by (namespace, Cluster,
    /// failure domain): what a template in that failure domain is given as its zone. Only the failure
    /// domains some group's template names are counted.
    fn failure_domain_zones(
        &self,
        groups: &BTreeMap<String, NodeGroup>,
    ) -> HashMap<(&str, &str, &str), BTreeMap<String, usize>> {
        let wanted: HashSet<(&str, &str, &str)> = groups
            .values()
            .filter_map(|g| {
                let r = &g.resource;
                let fd = r.template.failure_domain.as_deref()?.trim();
                Some((r.key.namespace.as_str(), r.cluster_name.as_str(), fd))
            })
            .collect();
        let mut zones: HashMap<(&str, &str, &str), BTreeMap<String, usize>> = HashMap::new();
        if wanted.is_empty() {
            return zones;
        }
        for machine in self
            .index
            .machines()
            .values()
            .filter_map(|m| m.as_ref().ok())
        {
            let Some(fd) = machine.failure_domain.as_deref() else {
                continue;
            };
            let at = (
                machine.key.namespace.as_str(),
                machine.cluster_name.as_str(),
                fd,
            );
            if !wanted.contains(&at) {
                continue;
            }
            let zone = machine
                .node_ref
                .as_deref()
                .and_then(|name| self.index.nodes().get(name))
                .and_then(|node| node.labels.get(template::LABEL_ZONE));
            if let Some(zone) = zone {
                *zones
                    .entry(at)
                    .or_default()
                    .entry(zone.to_string())
                    .or_default() += 1;
            }
        }
        zones
    }

    /// Each group's template, with the node labels of an existing node of the group when the
    /// workload cluster is watched. A template whose inputs are those of the previous build is
    /// taken from it.
    pub(super) fn templates(
        &self,
        groups: &mut BTreeMap<String, NodeGroup>,
        group_problems: &mut HashMap<String, Vec<Problem>>,
    ) -> HashMap<String, Arc<TemplateMemo>> {
        let node_labels_by_provider: HashMap<&str, &Labels> = self
            .index
            .nodes()
            .values()
            .filter_map(|n| n.provider_id.as_deref().map(|p| (p, &n.labels)))
            .collect();
        let zones = self.failure_domain_zones(groups);
        let mut templates: HashMap<String, Arc<TemplateMemo>> =
            HashMap::with_capacity(groups.len());
        for (id, group) in groups.iter_mut() {
            let node = group
                .instances
                .iter()
                .find_map(|i| node_labels_by_provider.get(i.id.as_str()).copied());
            let copied: Vec<(String, String)> = node
                .map(|labels| {
                    template::NODE_LABELS_COPIED
                        .iter()
                        .filter_map(|k| labels.get(k).map(|v| (k.to_string(), v.to_string())))
                        .collect()
                })
                .unwrap_or_default();
            // A Node keeps only the labels templates copy.
            let node_labels: Option<BTreeMap<String, String>> =
                node.map(|_| copied.iter().cloned().collect());
            let r = &group.resource;
            let failure_domain_zone = r
                .template
                .failure_domain
                .as_deref()
                .map(str::trim)
                .and_then(|fd| zones.get(&(r.key.namespace.as_str(), r.cluster_name.as_str(), fd)))
                .and_then(template::zone_in_failure_domain);
            let memo = self.template_memo(group, node_labels.as_ref(), copied, failure_domain_zone);
            if !memo.problems.is_empty() {
                group_problems
                    .entry(id.clone())
                    .or_default()
                    .extend(memo.problems.iter().cloned());
            }
            group.template = memo.template.clone();
            templates.insert(id.clone(), memo);
        }
        templates
    }
}
