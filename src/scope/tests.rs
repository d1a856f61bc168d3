use super::*;

/// [`super::decide`] where the management cluster's Cluster objects are those of the groups.
fn decide(
    configured: Option<&ClusterRef>,
    observed: &BTreeSet<ObjectKey>,
    groups: &BTreeSet<ObjectKey>,
) -> Scope {
    super::decide(configured, observed, groups, groups)
}

/// Finding 8 of issue 28: `--cluster NAME` without a namespace, while no Node names a Cluster,
/// served a same-named Cluster in another namespace because only its groups were found. Every
/// Cluster of that name counts: ambiguous, nothing is served, and the message says what to set.
#[test]
fn a_cluster_name_without_namespace_is_ambiguous_when_clusters_of_that_name_are_in_two_namespaces()
{
    let groups = set(&[("team-b", "prod")]);
    let known = set(&[("team-a", "prod"), ("team-b", "prod")]);
    let scope = super::decide(Some(&cluster("prod")), &BTreeSet::new(), &groups, &known);
    assert!(nothing(&scope).contains("NAMESPACE/NAME"), "{scope:?}");
    let only = set(&[("team-b", "prod")]);
    let scope = super::decide(Some(&cluster("prod")), &BTreeSet::new(), &groups, &only);
    assert_eq!(served(&scope), "team-b/prod");
}

fn key(namespace: &str, name: &str) -> ObjectKey {
    ObjectKey::new(namespace, name)
}

fn set(keys: &[(&str, &str)]) -> BTreeSet<ObjectKey> {
    keys.iter().map(|(ns, n)| key(ns, n)).collect()
}

fn cluster(value: &str) -> ClusterRef {
    value.parse().unwrap()
}

/// The Cluster served, as `NAMESPACE/NAME` (or `NAME`); panics when nothing is.
fn served(scope: &Scope) -> String {
    match scope {
        Scope::Cluster { cluster, .. } => cluster.to_string(),
        other => panic!("nothing served: {other:?}"),
    }
}

fn nothing(scope: &Scope) -> &str {
    match scope {
        Scope::Nothing(why) => why,
        other => panic!("served: {other:?}"),
    }
}

#[test]
fn configured_and_named_by_the_nodes_is_served() {
    let observed = set(&[("fleet", "prod")]);
    let groups = set(&[("fleet", "prod"), ("fleet", "dev")]);
    let scope = decide(Some(&cluster("fleet/prod")), &observed, &groups);
    assert_eq!(served(&scope), "fleet/prod");
    // A name alone finds its namespace among the Clusters the Nodes name.
    let scope = decide(Some(&cluster("prod")), &observed, &groups);
    assert_eq!(served(&scope), "fleet/prod");
    assert!(scope.serves(&key("fleet", "prod")));
    assert!(!scope.serves(&key("fleet", "dev")));
    assert!(!scope.serves(&key("other", "prod")));
}

#[test]
fn configured_but_the_nodes_name_another_cluster_serves_nothing_and_names_both() {
    let observed = set(&[("fleet", "dev")]);
    let scope = decide(
        Some(&cluster("fleet/prod")),
        &observed,
        &set(&[("fleet", "prod")]),
    );
    let why = nothing(&scope);
    assert!(why.contains("--cluster fleet/prod"), "{why}");
    assert!(why.contains("Cluster fleet/dev"), "{why}");
    assert!(!scope.serves(&key("fleet", "prod")));
    assert!(!scope.serves(&key("fleet", "dev")));
}

#[test]
fn a_configured_name_that_the_nodes_name_in_two_namespaces_serves_nothing() {
    let observed = set(&[("a", "prod"), ("b", "prod")]);
    let why = nothing(&decide(Some(&cluster("prod")), &observed, &BTreeSet::new())).to_string();
    assert!(why.contains("a/prod") && why.contains("b/prod"), "{why}");
    assert!(why.contains("NAMESPACE/NAME"), "{why}");
    // With the namespace it is one of them.
    let scope = decide(Some(&cluster("b/prod")), &observed, &BTreeSet::new());
    assert_eq!(served(&scope), "b/prod");
}

/// Every group at zero (or the workload cluster not watched): no Node names a Cluster, the configured
/// one is served.
#[test]
fn configured_and_no_node_naming_a_cluster_serves_the_configured_one() {
    let groups = set(&[("fleet", "prod"), ("fleet", "dev")]);
    let scope = decide(Some(&cluster("fleet/prod")), &BTreeSet::new(), &groups);
    assert_eq!(served(&scope), "fleet/prod");
    // By name: the namespace of the one group Cluster of that name.
    let scope = decide(Some(&cluster("prod")), &BTreeSet::new(), &groups);
    assert_eq!(served(&scope), "fleet/prod");
    // By name, and no group of it yet: that name in any namespace.
    let scope = decide(Some(&cluster("new")), &BTreeSet::new(), &groups);
    assert_eq!(served(&scope), "new");
    assert!(scope.serves(&key("anywhere", "new")));
    assert!(!scope.serves(&key("fleet", "prod")));
}

#[test]
fn a_configured_name_with_groups_in_two_namespaces_and_no_nodes_serves_nothing() {
    let groups = set(&[("a", "prod"), ("b", "prod")]);
    let why = nothing(&decide(Some(&cluster("prod")), &BTreeSet::new(), &groups)).to_string();
    assert!(why.contains("a/prod") && why.contains("b/prod"), "{why}");
}

#[test]
fn unconfigured_the_one_cluster_of_the_nodes_is_served() {
    let observed = set(&[("fleet", "prod")]);
    let groups = set(&[("fleet", "prod"), ("fleet", "dev")]);
    let scope = decide(None, &observed, &groups);
    assert_eq!(served(&scope), "fleet/prod");
    let why = scope.refusal(&key("fleet", "dev")).unwrap_or_default();
    assert!(
        why.contains("fleet/dev") && why.contains("fleet/prod"),
        "{why}"
    );
}

#[test]
fn unconfigured_nodes_of_several_clusters_serve_nothing_and_ask_for_the_flag() {
    let observed = set(&[("fleet", "prod"), ("fleet", "dev")]);
    let why = nothing(&decide(None, &observed, &set(&[("fleet", "prod")]))).to_string();
    assert!(why.contains("set --cluster"), "{why}");
    assert!(
        why.contains("fleet/dev") && why.contains("fleet/prod"),
        "{why}"
    );
}

#[test]
fn unconfigured_without_nodes_the_one_cluster_of_the_groups_is_served() {
    let scope = decide(None, &BTreeSet::new(), &set(&[("fleet", "prod")]));
    assert_eq!(served(&scope), "fleet/prod");
}

#[test]
fn unconfigured_without_nodes_groups_of_several_clusters_serve_nothing() {
    let groups = set(&[("fleet", "prod"), ("other", "prod")]);
    let scope = decide(None, &BTreeSet::new(), &groups);
    let why = nothing(&scope);
    assert!(why.contains("set --cluster"), "{why}");
    assert!(
        why.contains("fleet/prod") && why.contains("other/prod"),
        "{why}"
    );
    let refusal = scope.refusal(&key("fleet", "prod")).unwrap_or_default();
    assert!(
        refusal.contains("fleet/prod") && refusal.contains("set --cluster"),
        "{refusal}"
    );
}

#[test]
fn nothing_named_anywhere_and_no_group_is_nothing_to_decide() {
    let scope = decide(None, &BTreeSet::new(), &BTreeSet::new());
    assert_eq!(scope, Scope::Unknown);
    assert_eq!(scope.refusal(&key("a", "b")), None);
}

#[test]
fn a_group_without_a_cluster_name_is_never_the_configured_cluster() {
    let scope = decide(
        Some(&cluster("fleet/prod")),
        &BTreeSet::new(),
        &set(&[("fleet", "")]),
    );
    let refusal = scope.refusal(&key("fleet", "")).unwrap_or_default();
    assert!(refusal.contains("spec.clusterName is empty"), "{refusal}");
}

#[test]
fn cluster_refs_parse_and_print_back() {
    for text in ["prod", "fleet/prod", "a.b-c"] {
        assert_eq!(cluster(text).to_string(), text);
    }
    for bad in ["", "/x", "x/", "A", "a/b/c", "x_y"] {
        assert!(bad.parse::<ClusterRef>().is_err(), "{bad:?}");
    }
    let placeholder = PLACEHOLDER.parse::<ClusterRef>().unwrap_err();
    assert!(placeholder.contains("placeholder"), "{placeholder}");
}

#[test]
fn discovery_specs_naming_another_cluster_are_problems_naming_spec_and_served_cluster() {
    let spec = |s: &str| s.parse::<DiscoverySpec>().unwrap();
    let specs = [
        spec("clusterapi:namespace=fleet,clusterName=prod"),
        spec("clusterapi:clusterName=prod"),
        spec("clusterapi:namespace=fleet"),
        spec("clusterapi:clusterName=dev"),
        spec("clusterapi:namespace=other,clusterName=prod"),
    ];
    let scope = decide(
        Some(&cluster("fleet/prod")),
        &BTreeSet::new(),
        &BTreeSet::new(),
    );
    let problems = discovery_problems(&specs, &scope);
    let objects: Vec<String> = problems.iter().map(|p| p.object.to_string()).collect();
    assert_eq!(
        objects,
        [
            "--node-group-auto-discovery clusterapi:clusterName=dev",
            "--node-group-auto-discovery clusterapi:namespace=other,clusterName=prod",
        ]
    );
    for p in &problems {
        assert_eq!(p.field, "clusterName");
        assert!(
            p.message.contains("serves Cluster fleet/prod"),
            "{}",
            p.message
        );
    }
    // Nothing served: the scope itself is the problem, not the specs.
    let none = decide(None, &set(&[("a", "x"), ("b", "y")]), &BTreeSet::new());
    assert!(discovery_problems(&specs, &none).is_empty());
}

#[test]
fn long_lists_of_clusters_are_cut_with_a_count() {
    let many: BTreeSet<ObjectKey> = (0..8).map(|i| key(&format!("ns-{i}"), "c")).collect();
    let why = nothing(&decide(None, &many, &BTreeSet::new())).to_string();
    assert!(why.contains("ns-0/c") && why.contains("ns-4/c"), "{why}");
    assert!(
        !why.contains("ns-5/c") && why.contains("and 3 more"),
        "{why}"
    );
}
