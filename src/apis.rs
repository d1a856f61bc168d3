//! Which Cluster API resources the API server serves, at which version (`CAPI_GROUP`,
//! `CAPI_VERSION`, else the group's preferred version).

use std::collections::BTreeMap;

use kube::Client;
use kube::api::ApiResource;
#[cfg(test)]
use kube::api::GroupVersionKind;
use kube::discovery::{self, ApiGroup};

use crate::cache::InfraKind;
use crate::capi::ScalableKind;

/// `plural.group` (`plural` for the core group): how watches are named in logs, metrics and reasons.
pub fn resource_name(resource: &ApiResource) -> String {
    if resource.group.is_empty() {
        resource.plural.clone()
    } else {
        format!("{}.{}", resource.plural, resource.group)
    }
}

/// The Cluster API resources this provider reads and writes, at the version in use.
#[derive(Clone, Debug)]
pub struct CapiApis {
    pub group: String,
    pub version: String,
    /// Only the kinds the API serves (MachinePools may be absent).
    pub scalable: BTreeMap<ScalableKind, ApiResource>,
    pub machine: ApiResource,
    /// Clusters, when served: only read for their managed topology.
    pub cluster: Option<ApiResource>,
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("discovering API group {group:?}{}: {reason}", at_version(version))]
    Discovery {
        group: String,
        version: Option<String>,
        reason: String,
    },
    #[error("API group {group:?} does not serve {what}")]
    NotServed { group: String, what: String },
}

fn at_version(version: &Option<String>) -> String {
    version
        .as_deref()
        .map(|v| format!(" at version {v} (CAPI_VERSION)"))
        .unwrap_or_default()
}

impl CapiApis {
    /// The served version: `CAPI_VERSION` when set, else the group's preferred version.
    pub async fn discover(
        client: &Client,
        group: &str,
        version: Option<&str>,
    ) -> Result<Self, DiscoveryError> {
        let discovery_error = |e: kube::Error| DiscoveryError::Discovery {
            group: group.to_string(),
            version: version.map(str::to_string),
            reason: match e {
                kube::Error::Api(status) if status.code == 404 => {
                    "not served by this API server (404)".to_string()
                }
                kube::Error::Api(status) => format!("{} ({})", status.message, status.code),
                other => other.to_string(),
            },
        };
        let api_group: ApiGroup = match version {
            Some(v) => discovery::pinned_group(client, &kube::core::GroupVersion::gv(group, v))
                .await
                .map_err(discovery_error)?,
            None => discovery::group(client, group)
                .await
                .map_err(discovery_error)?,
        };
        let version = version
            .map(str::to_string)
            .unwrap_or_else(|| api_group.preferred_version_or_latest().to_string());
        let served = api_group.versioned_resources(&version);
        let find = |kind: &str| {
            served
                .iter()
                .find(|(r, _)| r.kind == kind)
                .map(|(r, _)| r.clone())
        };
        let machine = find("Machine").ok_or_else(|| DiscoveryError::NotServed {
            group: group.to_string(),
            what: format!("machines at {version}"),
        })?;
        let scalable: BTreeMap<ScalableKind, ApiResource> = ScalableKind::ALL
            .into_iter()
            .filter_map(|k| find(k.as_str()).map(|r| (k, r)))
            .collect();
        if !scalable.contains_key(&ScalableKind::MachineSet) {
            return Err(DiscoveryError::NotServed {
                group: group.to_string(),
                what: format!("machinesets at {version}"),
            });
        }
        let cluster = find("Cluster");
        Ok(CapiApis {
            group: group.to_string(),
            version,
            scalable,
            machine,
            cluster,
        })
    }

    /// The same resources without discovery.
    #[cfg(test)]
    pub fn assume(group: &str, version: &str) -> Self {
        let resource = |kind: &str, plural: &str| {
            ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
        };
        CapiApis {
            group: group.to_string(),
            version: version.to_string(),
            scalable: ScalableKind::ALL
                .into_iter()
                .map(|k| (k, resource(k.as_str(), k.plural())))
                .collect(),
            machine: resource("Machine", "machines"),
            cluster: Some(resource("Cluster", "clusters")),
        }
    }
}

/// The version serving an infrastructure kind: the first served version of its group that has it,
/// preferred version first.
pub async fn infra_resource(client: &Client, kind: &InfraKind) -> Result<ApiResource, String> {
    let group = discovery::group(client, &kind.api_group)
        .await
        .map_err(|e| {
            format!(
                "API group {} is not served or not discoverable: {e}",
                kind.api_group
            )
        })?;
    group
        .recommended_kind(&kind.kind)
        .map(|(resource, _)| resource)
        .ok_or_else(|| format!("API group {} serves no kind {}", kind.api_group, kind.kind))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_are_named_by_resource_and_group() {
        let md = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta2", "MachineDeployment"),
            "machinedeployments",
        );
        assert_eq!(resource_name(&md), "machinedeployments.cluster.x-k8s.io");
        let nodes = ApiResource::erase::<k8s_openapi::api::core::v1::Node>(&());
        assert_eq!(resource_name(&nodes), "nodes");
    }
}
