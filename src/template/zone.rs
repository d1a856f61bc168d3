//! Where a template's zone label comes from: the Nodes of a failure domain, the annotation, a Node
//! of the group, or the failure domain's own name.

use std::collections::BTreeMap;

use super::LABEL_ZONE;
use crate::capi::capacity;
use crate::capi::names::is_label_value;

/// The zone label Nodes in one failure domain carry, and how many of them carry it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailureDomainZone {
    pub zone: String,
    pub nodes: usize,
}

/// Where a template's `topology.kubernetes.io/zone` came from, lowest precedence last.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "from", rename_all = "snake_case")]
pub enum ZoneSource {
    /// An existing Node of the group: its labels win over everything.
    GroupNode,
    /// The `capacity.cluster-autoscaler.kubernetes.io/labels` annotation.
    Annotation,
    /// The Nodes of the Cluster's Machines in the template's failure domain.
    FailureDomainNodes {
        failure_domain: String,
        nodes: usize,
    },
    /// `spec.template.spec.failureDomain` as it is, no Node being in that failure domain yet: right
    /// where failure domains are zone names (CAPA), wrong where they are not (CAPZ `1`, CAPV objects).
    FailureDomain { failure_domain: String },
}

/// A template's zone label and where it came from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Zone {
    pub value: String,
    pub source: ZoneSource,
}

impl Zone {
    /// One line for `check`: the zone, where it came from and, when it is only the failure domain's
    /// name, how to set it.
    pub fn describe(&self) -> String {
        match &self.source {
            ZoneSource::GroupNode => format!("{} (from a Node of the group)", self.value),
            ZoneSource::Annotation => format!("{} (from {})", self.value, capacity::LABELS),
            ZoneSource::FailureDomainNodes {
                failure_domain,
                nodes,
            } => format!(
                "{} (from {nodes} Node(s) of the Cluster's Machines in failure domain {failure_domain:?})",
                self.value
            ),
            ZoneSource::FailureDomain { failure_domain } => format!(
                "{} (spec.template.spec.failureDomain {failure_domain:?} as is: no Node is in that failure \
                 domain yet; right where failure domains are zone names (CAPA), not where they are not \
                 (CAPZ, CAPV): then set {}: {LABEL_ZONE}=<zone>)",
                self.value,
                capacity::LABELS
            ),
        }
    }
}

/// The zone of a failure domain, from the zone labels of the Nodes in it (label value → Nodes): the
/// one most Nodes carry, ties to the first by name. `None` without any.
pub fn zone_in_failure_domain(zones: &BTreeMap<String, usize>) -> Option<FailureDomainZone> {
    zones
        .iter()
        .filter(|(zone, n)| **n > 0 && !zone.is_empty() && is_label_value(zone))
        // max_by_key keeps the last of equals: reversed, the first by name wins a tie
        .rev()
        .max_by_key(|(_, n)| **n)
        .map(|(zone, n)| FailureDomainZone {
            zone: zone.clone(),
            nodes: *n,
        })
}
