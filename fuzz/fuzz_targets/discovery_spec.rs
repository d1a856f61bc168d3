//! `--node-group-auto-discovery` specs (`clusterapi:namespace=…,clusterName=…,key=value,…`).
//!
//! Contract: no panic; an accepted spec's canonical form (`Display`) parses back to the same spec, its
//! namespace and labels are valid Kubernetes names and values, and it selects an object that has exactly
//! what it asks for; a rejected spec's error carries the spec as given and a reason.
#![no_main]

use capi_autoscaler_provider::capi::Labels;

use capi_autoscaler_provider::capi::names::{
    check_dns1123_label, is_label_value, is_qualified_name,
};
use capi_autoscaler_provider::discovery::{self, DiscoverySpec};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|spec: &str| {
    match spec.parse::<DiscoverySpec>() {
        Ok(parsed) => {
            let canonical = parsed.to_string();
            assert_eq!(
                canonical.parse::<DiscoverySpec>().as_ref(),
                Ok(&parsed),
                "{spec:?} → {canonical:?}"
            );
            if let Some(ns) = &parsed.namespace {
                assert!(check_dns1123_label(ns).is_ok(), "namespace {ns:?}");
            }
            if let Some(cluster) = &parsed.cluster_name {
                assert!(!cluster.is_empty());
            }
            for (k, v) in &parsed.labels {
                assert!(is_qualified_name(k) && is_label_value(v), "{k:?}={v:?}");
            }
            let labels: Labels = parsed.labels.iter().cloned().collect();
            // One value per key: the spec can be satisfied.
            if labels.len() == parsed.labels.len() {
                let ns = parsed.namespace.as_deref().unwrap_or("any-namespace");
                let cluster = parsed.cluster_name.as_deref().unwrap_or("any-cluster");
                assert!(parsed.matches(ns, cluster, &labels), "{spec:?}");
                let specs = [parsed.clone()];
                assert!(discovery::allowed(&specs, ns, cluster, &labels));
                assert_eq!(discovery::watch_namespace(&specs), parsed.namespace);
            }
        }
        Err(e) => {
            assert_eq!(e.spec, spec);
            assert!(!e.reason.is_empty());
            assert!(e.to_string().contains(&format!("{spec:?}")));
        }
    }
});
