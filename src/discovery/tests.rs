//! Unit tests of `discovery`.

use super::*;
use crate::capi::Labels;
use std::collections::BTreeMap;

fn spec(namespace: Option<&str>, cluster: Option<&str>, labels: &[(&str, &str)]) -> DiscoverySpec {
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
            s.matches(ns, cluster, &Labels::from(l.clone())),
            want,
            "{input} vs {ns}/{cluster}"
        );
    }
    assert!(
        !"clusterapi:color=green"
            .parse::<DiscoverySpec>()
            .unwrap()
            .matches("ns", "c", &Labels::default())
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
            allowed(&specs, ns, cluster, &Labels::from(l.clone())),
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
