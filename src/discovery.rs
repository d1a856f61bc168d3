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
use std::collections::BTreeMap;
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
    pub fn matches(
        &self,
        namespace: &str,
        cluster_name: &str,
        labels: &BTreeMap<String, String>,
    ) -> bool {
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
    labels: &BTreeMap<String, String>,
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
mod tests {
    use super::*;

    fn spec(
        namespace: Option<&str>,
        cluster: Option<&str>,
        labels: &[(&str, &str)],
    ) -> DiscoverySpec {
        DiscoverySpec {
            namespace: namespace.map(Into::into),
            cluster_name: cluster.map(Into::into),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parses() {
        let long63 = "a".repeat(63);
        let prefix253 = format!(
            "{}.{}.{}.{}",
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(61)
        );
        let cases: Vec<(String, DiscoverySpec)> = vec![
            ("clusterapi:".into(), spec(None, None, &[])),
            ("clusterapi:,,".into(), spec(None, None, &[])),
            (
                "clusterapi:namespace=default".into(),
                spec(Some("default"), None, &[]),
            ),
            (
                "clusterapi:clusterName=prod".into(),
                spec(None, Some("prod"), &[]),
            ),
            (
                "clusterapi:namespace=ns-1,clusterName=prod,color=green".into(),
                spec(Some("ns-1"), Some("prod"), &[("color", "green")]),
            ),
            (
                "clusterapi:clusterName=a,clusterName=b,namespace=x,namespace=y".into(),
                spec(Some("y"), Some("b"), &[]),
            ),
            (
                "clusterapi:namespace=,clusterName=".into(),
                spec(None, None, &[]),
            ),
            (
                "clusterapi:namespace=a,namespace=".into(),
                spec(None, None, &[]),
            ),
            (
                "clusterapi:mylabel=".into(),
                spec(None, None, &[("mylabel", "")]),
            ),
            (
                "clusterapi:color=green,color=blue".into(),
                spec(None, None, &[("color", "green"), ("color", "blue")]),
            ),
            (
                "clusterapi:example.com/pool=gpu_a.1,node.cluster.x-k8s.io/x=Y-9".into(),
                spec(
                    None,
                    None,
                    &[
                        ("example.com/pool", "gpu_a.1"),
                        ("node.cluster.x-k8s.io/x", "Y-9"),
                    ],
                ),
            ),
            (
                "clusterapi:Namespace=Foo".into(),
                spec(None, None, &[("Namespace", "Foo")]),
            ),
            (
                format!("clusterapi:{long63}={long63}"),
                spec(None, None, &[(&long63, &long63)]),
            ),
            (
                format!("clusterapi:{prefix253}/k=v"),
                spec(None, None, &[(&format!("{prefix253}/k"), "v")]),
            ),
            (
                format!("clusterapi:namespace={long63}"),
                spec(Some(&long63), None, &[]),
            ),
        ];
        for (input, want) in cases {
            let got: DiscoverySpec = input.parse().unwrap_or_else(|e| panic!("{input}: {e}"));
            assert_eq!(got, want, "{input}");
            // The canonical form parses back to the same spec.
            assert_eq!(
                got.to_string().parse::<DiscoverySpec>().unwrap(),
                got,
                "{input}"
            );
        }
    }

    #[test]
    fn rejects() {
        let long64 = "a".repeat(64);
        let prefix254 = format!(
            "{}.{}.{}.{}",
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(62)
        );
        let cases: Vec<(String, &str)> = vec![
            ("".into(), "expected exactly one ':' (found 0)"),
            ("clusterapi".into(), "expected exactly one ':' (found 0)"),
            (
                "clusterapi:namespace=a:b".into(),
                "expected exactly one ':' (found 2)",
            ),
            (
                "clusterapi:k=http://x".into(),
                "expected exactly one ':' (found 2)",
            ),
            (
                "asg:tag=k8s.io/cluster-autoscaler/enabled".into(),
                r#"unsupported discoverer "asg"; only "clusterapi" is supported"#,
            ),
            (
                "ClusterAPI:".into(),
                r#"unsupported discoverer "ClusterAPI""#,
            ),
            (":namespace=a".into(), r#"unsupported discoverer """#),
            (
                "clusterapi:invalid".into(),
                r#""invalid" is not a key=value pair: no '='"#,
            ),
            (
                "clusterapi:a=b=c".into(),
                r#""a=b=c" is not a key=value pair: more than one '='"#,
            ),
            (
                "clusterapi:=v".into(),
                r#"label key "" has an empty name part"#,
            ),
            (
                "clusterapi:bad key=v".into(),
                r#"label key "bad key" has a name part that must consist of alphanumeric"#,
            ),
            (
                "clusterapi:-a=v".into(),
                r#"label key "-a" has a name part that must consist"#,
            ),
            (
                "clusterapi:a/b/c=v".into(),
                r#"label key "a/b/c" has more than one '/'"#,
            ),
            (
                "clusterapi:/a=v".into(),
                r#"label key "/a" has an empty prefix before '/'"#,
            ),
            (
                "clusterapi:a/=v".into(),
                r#"label key "a/" has an empty name part"#,
            ),
            (
                "clusterapi:Example.com/a=v".into(),
                r#"label key "Example.com/a" has a prefix that must be a DNS-1123 subdomain"#,
            ),
            (
                "clusterapi:a..b/c=v".into(),
                r#"label key "a..b/c" has a prefix that must be a DNS-1123 subdomain"#,
            ),
            (
                format!("clusterapi:{long64}=v"),
                "has a name part longer than 63 characters",
            ),
            (
                format!("clusterapi:{prefix254}/k=v"),
                "has a prefix that is longer than 253 characters",
            ),
            (
                format!("clusterapi:k={long64}"),
                r#"(key "k") is longer than 63 characters"#,
            ),
            (
                "clusterapi:k=a b".into(),
                r#"label value "a b" (key "k") must consist of alphanumeric"#,
            ),
            (
                "clusterapi:k=-a".into(),
                r#"label value "-a" (key "k") must consist"#,
            ),
            (
                "clusterapi:k=a_".into(),
                r#"label value "a_" (key "k") must consist"#,
            ),
            (
                "clusterapi:namespace=Team-A".into(),
                r#"namespace "Team-A" must be a DNS-1123 label"#,
            ),
            (
                "clusterapi:namespace=a.b".into(),
                r#"namespace "a.b" must be a DNS-1123 label"#,
            ),
            (
                format!("clusterapi:namespace={long64}"),
                "is longer than 63 characters",
            ),
        ];
        for (input, want) in cases {
            let err = input
                .parse::<DiscoverySpec>()
                .expect_err(&format!("{input:?} should be rejected"));
            assert_eq!(err.spec, input);
            let text = err.to_string();
            assert!(
                text.starts_with(&format!("auto-discovery spec {input:?}: ")),
                "{input}: the error quotes the spec: {text}"
            );
            assert!(
                err.reason.contains(want),
                "{input}: {:?} should contain {want:?}",
                err.reason
            );
        }
    }

    #[test]
    fn matches() {
        let l = labels(&[
            ("color", "green"),
            ("example.com/pool", "gpu"),
            ("empty", ""),
        ]);
        let cases = [
            ("clusterapi:", "ns", "c", true),
            ("clusterapi:namespace=ns", "ns", "c", true),
            ("clusterapi:namespace=other", "ns", "c", false),
            ("clusterapi:clusterName=c", "ns", "c", true),
            ("clusterapi:clusterName=d", "ns", "c", false),
            ("clusterapi:clusterName=c", "ns", "", false),
            ("clusterapi:color=green", "ns", "c", true),
            ("clusterapi:color=blue", "ns", "c", false),
            (
                "clusterapi:color=green,example.com/pool=gpu",
                "ns",
                "c",
                true,
            ),
            (
                "clusterapi:color=green,example.com/pool=cpu",
                "ns",
                "c",
                false,
            ),
            ("clusterapi:color=green,color=blue", "ns", "c", false),
            ("clusterapi:missing=", "ns", "c", false),
            ("clusterapi:empty=", "ns", "c", true),
            (
                "clusterapi:namespace=ns,clusterName=c,color=green",
                "ns",
                "c",
                true,
            ),
            (
                "clusterapi:namespace=ns,clusterName=c,color=green",
                "ns2",
                "c",
                false,
            ),
        ];
        for (input, ns, cluster, want) in cases {
            let s: DiscoverySpec = input.parse().unwrap();
            assert_eq!(
                s.matches(ns, cluster, &l),
                want,
                "{input} vs {ns}/{cluster}"
            );
        }
        assert!(
            !"clusterapi:color=green"
                .parse::<DiscoverySpec>()
                .unwrap()
                .matches("ns", "c", &BTreeMap::new())
        );
    }

    #[test]
    fn allowed_ors_specs() {
        let parse = |specs: &[&str]| -> Vec<DiscoverySpec> {
            specs.iter().map(|s| s.parse().unwrap()).collect()
        };
        let l = labels(&[("color", "green")]);
        let cases: Vec<(Vec<DiscoverySpec>, &str, &str, bool)> = vec![
            (vec![], "any", "thing", true),
            (parse(&["clusterapi:namespace=a"]), "a", "c", true),
            (parse(&["clusterapi:namespace=a"]), "b", "c", false),
            (
                parse(&["clusterapi:namespace=a", "clusterapi:namespace=b"]),
                "b",
                "c",
                true,
            ),
            (
                parse(&["clusterapi:namespace=a", "clusterapi:clusterName=c"]),
                "z",
                "c",
                true,
            ),
            (
                parse(&["clusterapi:color=blue", "clusterapi:color=green"]),
                "z",
                "c",
                true,
            ),
            (
                parse(&["clusterapi:color=blue", "clusterapi:namespace=a"]),
                "z",
                "c",
                false,
            ),
            (parse(&["clusterapi:"]), "z", "", true),
        ];
        for (specs, ns, cluster, want) in cases {
            assert_eq!(
                allowed(&specs, ns, cluster, &l),
                want,
                "{specs:?} vs {ns}/{cluster}"
            );
        }
    }

    #[test]
    fn watch_namespace_only_when_all_specs_agree() {
        let parse = |specs: &[&str]| -> Vec<DiscoverySpec> {
            specs.iter().map(|s| s.parse().unwrap()).collect()
        };
        let cases: Vec<(Vec<&str>, Option<&str>)> = vec![
            (vec![], None),
            (vec!["clusterapi:"], None),
            (vec!["clusterapi:namespace=a"], Some("a")),
            (
                vec![
                    "clusterapi:namespace=a,color=x",
                    "clusterapi:namespace=a,clusterName=c",
                ],
                Some("a"),
            ),
            (
                vec!["clusterapi:namespace=a", "clusterapi:namespace=b"],
                None,
            ),
            (
                vec!["clusterapi:namespace=a", "clusterapi:clusterName=c"],
                None,
            ),
            (
                vec!["clusterapi:clusterName=c", "clusterapi:namespace=a"],
                None,
            ),
            (vec!["clusterapi:namespace=a,namespace="], None),
        ];
        for (specs, want) in cases {
            assert_eq!(
                watch_namespace(&parse(&specs)).as_deref(),
                want,
                "{specs:?}"
            );
        }
    }

    #[test]
    fn display_is_canonical() {
        let cases = [
            ("clusterapi:", "clusterapi:"),
            (
                "clusterapi:,color=green,,namespace=ns",
                "clusterapi:namespace=ns,color=green",
            ),
            (
                "clusterapi:k=v,clusterName=c,namespace=n,x=",
                "clusterapi:namespace=n,clusterName=c,k=v,x=",
            ),
        ];
        for (input, want) in cases {
            assert_eq!(input.parse::<DiscoverySpec>().unwrap().to_string(), want);
        }
    }
}
