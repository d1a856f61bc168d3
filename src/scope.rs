//! Which Cluster's node groups the provider serves, pure (DESIGN.md invariant 8, kubernetes/autoscaler#5510).
//!
//! cluster-autoscaler sees the Nodes of one workload cluster. A group of another Cluster, served to it,
//! looks like instances that never registered: CA deletes them after `--max-node-provision-time`, scales
//! them up for its own pods and counts them in its cluster health. So exactly one Cluster is served, the
//! one CA watches, decided from plain data:
//!
//! - *configured*: `--cluster NAME` or `--cluster NAMESPACE/NAME`;
//! - *observed*: the Clusters named by the workload cluster's Nodes (`<group>/cluster-namespace` and
//!   `<group>/cluster-name`, which Cluster API syncs onto every Node it manages), when it is watched;
//! - the Clusters the candidate node groups belong to (their namespace and `spec.clusterName`).
//!
//! A configured Cluster must be one the Nodes name; with no Node naming any (every group at zero, or
//! the workload cluster not watched) the configured one is served. Without `--cluster`, the one
//! Cluster the Nodes name, else the one Cluster all candidate groups belong to. Anything ambiguous
//! serves nothing and says what to set: a wrong guess would hand CA another cluster's Machines.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use crate::capi::ObjectKey;
use crate::capi::names::{check_dns1123_label, check_dns1123_subdomain};
use crate::discovery::DiscoverySpec;
use crate::problem::Problem;

/// The value the shipped manifests and Helm values carry until the operator names their Cluster.
pub const PLACEHOLDER: &str = "REPLACE-WITH-CLUSTER-NAME";

/// `--cluster`: a Cluster by name, optionally with its namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClusterRef {
    pub namespace: Option<String>,
    pub name: String,
}

impl ClusterRef {
    pub fn matches(&self, cluster: &ObjectKey) -> bool {
        self.name == cluster.name
            && self
                .namespace
                .as_deref()
                .is_none_or(|ns| ns == cluster.namespace)
    }

    fn exact(cluster: &ObjectKey) -> Self {
        ClusterRef {
            namespace: Some(cluster.namespace.to_string()),
            name: cluster.name.to_string(),
        }
    }
}

impl fmt::Display for ClusterRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{ns}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

impl FromStr for ClusterRef {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, String> {
        if value.contains(PLACEHOLDER) {
            return Err(format!(
                "{value:?} is the placeholder of the shipped manifests: replace it with the Cluster \
                 whose Nodes cluster-autoscaler watches, as NAME or NAMESPACE/NAME (with the Helm \
                 chart deploy/helm: provider.cluster.name and provider.cluster.namespace)"
            ));
        }
        let (namespace, name) = match value.split_once('/') {
            Some((ns, name)) => {
                check_dns1123_label(ns).map_err(|why| format!("namespace {ns:?} {why}"))?;
                (Some(ns.to_string()), name)
            }
            None => (None, value),
        };
        check_dns1123_subdomain(name).map_err(|why| {
            format!("Cluster name {name:?} {why} (expected NAME or NAMESPACE/NAME)")
        })?;
        Ok(ClusterRef {
            namespace,
            name: name.to_string(),
        })
    }
}

/// What the provider serves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Scope {
    /// The groups of this Cluster, and no other; `how` says how it was decided, for people.
    Cluster { cluster: ClusterRef, how: String },
    /// No Cluster named anywhere and no candidate group: nothing to serve, nothing wrong.
    #[default]
    Unknown,
    /// Nothing, for this reason (it says what to set).
    Nothing(String),
}

impl Scope {
    /// Whether a group of `cluster` is served.
    pub fn serves(&self, cluster: &ObjectKey) -> bool {
        match self {
            Scope::Cluster { cluster: c, .. } => c.matches(cluster),
            Scope::Unknown => true,
            Scope::Nothing(_) => false,
        }
    }

    /// Why a group of `cluster` is not served, naming both Clusters; `None` when it is.
    pub fn refusal(&self, cluster: &ObjectKey) -> Option<String> {
        match self {
            _ if self.serves(cluster) => None,
            Scope::Cluster { cluster: c, how } => Some(format!(
                "belongs to Cluster {}, not to Cluster {c}, whose Nodes cluster-autoscaler watches \
                 ({how}): not served, so never scaled by this provider (kubernetes/autoscaler#5510)",
                cluster_name(cluster)
            )),
            Scope::Nothing(why) => Some(format!(
                "belongs to Cluster {}; no group is served: {why}",
                cluster_name(cluster)
            )),
            Scope::Unknown => None,
        }
    }
}

/// A Cluster as people read it; a group with no cluster name says so.
fn cluster_name(cluster: &ObjectKey) -> String {
    if cluster.name.is_empty() {
        format!(
            "(none: spec.clusterName is empty, namespace {})",
            cluster.namespace
        )
    } else {
        cluster.to_string()
    }
}

/// Clusters for a message: the first few, and how many more (a management cluster may hold hundreds).
fn list<'a>(clusters: impl Iterator<Item = &'a ObjectKey>) -> String {
    const SHOWN: usize = 5;
    let names: Vec<String> = clusters.map(cluster_name).collect();
    match names.len().checked_sub(SHOWN) {
        Some(more) if more > 0 => format!("{} and {more} more", names[..SHOWN].join(", ")),
        _ => names.join(", "),
    }
}

/// Decides which Cluster is served (see the module documentation).
/// `observed`: the Clusters the workload cluster's Nodes name; `groups`: those of the candidate
/// groups; `known`: the Cluster objects of the management cluster (empty when not watched).
pub fn decide(
    configured: Option<&ClusterRef>,
    observed: &BTreeSet<ObjectKey>,
    groups: &BTreeSet<ObjectKey>,
    known: &BTreeSet<ObjectKey>,
) -> Scope {
    let serve = |cluster: ClusterRef, how: String| Scope::Cluster { cluster, how };
    match configured {
        Some(wanted) if !observed.is_empty() => {
            let matching: BTreeSet<&ObjectKey> =
                observed.iter().filter(|c| wanted.matches(c)).collect();
            match single(&matching) {
                Some(cluster) => serve(
                    ClusterRef::exact(cluster),
                    format!("--cluster {wanted}, which the workload cluster's Nodes name"),
                ),
                None if matching.is_empty() => Scope::Nothing(format!(
                    "--cluster {wanted}, but the workload cluster's Nodes belong to Cluster {}: \
                     set --cluster to the Cluster cluster-autoscaler watches",
                    list(observed.iter())
                )),
                None => Scope::Nothing(format!(
                    "--cluster {wanted} names several Clusters the workload cluster's Nodes \
                     belong to ({}): set --cluster to NAMESPACE/NAME",
                    list(matching.into_iter())
                )),
            }
        }
        Some(wanted) => {
            let how =
                format!("--cluster {wanted}; no Node of the workload cluster names a Cluster");
            if wanted.namespace.is_some() {
                return serve(wanted.clone(), how);
            }
            // Every Cluster of that name counts, with groups or not: a same-named Cluster in
            // another namespace whose groups happen to be the only ones found is no proof.
            let named: BTreeSet<&ObjectKey> = groups
                .iter()
                .chain(known.iter())
                .filter(|c| wanted.matches(c))
                .collect();
            match single(&named) {
                Some(cluster) => serve(ClusterRef::exact(cluster), how),
                None if named.is_empty() => serve(wanted.clone(), how),
                None => Scope::Nothing(format!(
                    "--cluster {wanted} names Clusters in several namespaces ({}): set --cluster \
                     to NAMESPACE/NAME",
                    list(named.into_iter())
                )),
            }
        }
        None => {
            if let Some(cluster) = single(observed) {
                serve(
                    ClusterRef::exact(cluster),
                    "the Cluster the workload cluster's Nodes belong to".into(),
                )
            } else if !observed.is_empty() {
                Scope::Nothing(format!(
                    "the workload cluster's Nodes belong to Clusters {}: set --cluster to the one \
                     cluster-autoscaler watches",
                    list(observed.iter())
                ))
            } else if let Some(cluster) = single(groups) {
                serve(
                    ClusterRef::exact(cluster),
                    "the one Cluster of the node groups; no --cluster, and no Node of a watched \
                     workload cluster names a Cluster"
                        .into(),
                )
            } else if groups.is_empty() {
                Scope::Unknown
            } else {
                Scope::Nothing(format!(
                    "the node groups belong to Clusters {} and no Node of a watched workload \
                     cluster names one: set --cluster to the Cluster whose Nodes \
                     cluster-autoscaler watches",
                    list(groups.iter())
                ))
            }
        }
    }
}

/// The one element of `set`, if it has exactly one.
fn single<'a, T: std::borrow::Borrow<ObjectKey> + 'a>(
    set: &'a BTreeSet<T>,
) -> Option<&'a ObjectKey> {
    match set.len() {
        1 => set.iter().next().map(std::borrow::Borrow::borrow),
        _ => None,
    }
}

/// A discovery spec that names a Cluster (and namespace) other than the served one selects nothing:
/// said, naming the spec and the served Cluster, rather than served silently as nothing.
pub fn discovery_problems(specs: &[DiscoverySpec], scope: &Scope) -> Vec<Problem> {
    let Scope::Cluster { cluster, how } = scope else {
        return Vec::new();
    };
    specs
        .iter()
        .filter_map(|spec| {
            let name = spec.cluster_name.as_deref()?;
            let other_name = name != cluster.name;
            let other_namespace = matches!(
                (&spec.namespace, &cluster.namespace),
                (Some(a), Some(b)) if a != b
            );
            (other_name || other_namespace).then(|| {
                let named = match &spec.namespace {
                    Some(ns) => format!("{ns}/{name}"),
                    None => name.to_string(),
                };
                Problem::new(
                    crate::problem::Subject::Other(format!("--node-group-auto-discovery {spec}")),
                    "clusterName",
                    format!(
                        "names Cluster {named}, but this provider serves Cluster {cluster} ({how}): \
                         the spec selects no node group"
                    ),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
