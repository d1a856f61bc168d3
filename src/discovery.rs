//! `--node-group-auto-discovery` specs, in the upstream clusterapi syntax:
//!
//! ```text
//! clusterapi:namespace=<ns>,clusterName=<name>,<label key>=<label value>,...
//! ```
//!
//! `namespace` and `clusterName` filter on the resource's namespace and cluster name; every other pair is a
//! label the resource must carry with exactly that value (pairs are ANDed). Empty pairs are ignored, and
//! `clusterapi:` alone matches everything. Several specs are ORed; no spec allows everything.
//!
//! Parsing follows upstream (`clusterapi_autodiscovery.go`): exactly one `:`, exactly one `=` per pair,
//! `namespace`/`clusterName` may repeat (the last wins), label keys and values are validated as Kubernetes
//! validates them. One deliberate difference: a non-empty `namespace` must be a valid namespace name (a
//! DNS-1123 label), since any other value could never match.
use crate::capi::Labels;
use std::fmt;
use std::str::FromStr;

use crate::capi::names::{check_dns1123_label, check_label_value, check_qualified_name};

/// The only discoverer this provider (and upstream's clusterapi provider) knows.
pub const DISCOVERER: &str = "clusterapi";

const NAMESPACE_KEY: &str = "namespace";
const CLUSTER_NAME_KEY: &str = "clusterName";

/// One `--node-group-auto-discovery` spec.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DiscoverySpec {
    /// Only resources in this namespace; `None` (or `namespace=`): any namespace.
    pub namespace: Option<String>,
    /// Only resources of this cluster; `None` (or `clusterName=`): any cluster.
    pub cluster_name: Option<String>,
    /// Labels the resource must carry, each with exactly this value, in the order given.
    pub labels: Vec<(String, String)>,
}

/// A spec that cannot be parsed: the spec as given and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("auto-discovery spec {spec:?}: {reason}")]
pub struct DiscoverySpecError {
    pub spec: String,
    pub reason: String,
}

impl FromStr for DiscoverySpec {
    type Err = DiscoverySpecError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let fail = |reason: String| DiscoverySpecError {
            spec: spec.to_string(),
            reason,
        };
        let mut parts = spec.split(':');
        let (Some(discoverer), Some(args), None) = (parts.next(), parts.next(), parts.next())
        else {
            let colons = spec.matches(':').count();
            return Err(fail(format!(
                "expected exactly one ':' (found {colons}), as in \
                 {DISCOVERER}:namespace=<ns>,clusterName=<name>,<label>=<value>"
            )));
        };
        if discoverer != DISCOVERER {
            return Err(fail(format!(
                "unsupported discoverer {discoverer:?}; only {DISCOVERER:?} is supported"
            )));
        }
        let mut out = DiscoverySpec::default();
        for arg in args.split(',').filter(|a| !a.is_empty()) {
            let mut kv = arg.split('=');
            let (Some(key), Some(value), None) = (kv.next(), kv.next(), kv.next()) else {
                let reason = if arg.contains('=') {
                    "more than one '='"
                } else {
                    "no '='"
                };
                return Err(fail(format!("{arg:?} is not a key=value pair: {reason}")));
            };
            match key {
                NAMESPACE_KEY => {
                    if !value.is_empty()
                        && let Err(why) = check_dns1123_label(value)
                    {
                        return Err(fail(format!("namespace {value:?} {why}")));
                    }
                    out.namespace = non_empty(value);
                }
                CLUSTER_NAME_KEY => out.cluster_name = non_empty(value),
                _ => {
                    check_qualified_name(key)
                        .map_err(|why| fail(format!("label key {key:?} {why}")))?;
                    check_label_value(value).map_err(|why| {
                        fail(format!("label value {value:?} (key {key:?}) {why}"))
                    })?;
                    out.labels.push((key.to_string(), value.to_string()));
                }
            }
        }
        Ok(out)
    }
}

/// The canonical form, which parses back to the same spec.
impl fmt::Display for DiscoverySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{DISCOVERER}:")?;
        let mut sep = "";
        if let Some(ns) = &self.namespace {
            write!(f, "{NAMESPACE_KEY}={ns}")?;
            sep = ",";
        }
        if let Some(c) = &self.cluster_name {
            write!(f, "{sep}{CLUSTER_NAME_KEY}={c}")?;
            sep = ",";
        }
        for (k, v) in &self.labels {
            write!(f, "{sep}{k}={v}")?;
            sep = ",";
        }
        Ok(())
    }
}

impl DiscoverySpec {
    /// Whether a resource with this namespace, cluster name and labels is selected by this spec.
    pub fn matches(&self, namespace: &str, cluster_name: &str, labels: &Labels) -> bool {
        self.namespace.as_deref().is_none_or(|ns| ns == namespace)
            && self
                .cluster_name
                .as_deref()
                .is_none_or(|c| c == cluster_name)
            && self
                .labels
                .iter()
                .all(|(k, v)| labels.get(k).is_some_and(|have| have == v))
    }
}

/// Whether any spec selects the resource; with no specs, everything is allowed.
pub fn allowed(
    specs: &[DiscoverySpec],
    namespace: &str,
    cluster_name: &str,
    labels: &Labels,
) -> bool {
    specs.is_empty()
        || specs
            .iter()
            .any(|s| s.matches(namespace, cluster_name, labels))
}

/// The one namespace watches can be narrowed to: `Some` only when there are specs and every one of them
/// names the same namespace. (Upstream watches the first namespace named by any spec, so specs for other
/// namespaces, or for all namespaces, silently find nothing.)
pub fn watch_namespace(specs: &[DiscoverySpec]) -> Option<String> {
    let first = specs.first()?.namespace.as_ref()?;
    specs
        .iter()
        .all(|s| s.namespace.as_ref() == Some(first))
        .then(|| first.clone())
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

#[cfg(test)]
mod tests;
