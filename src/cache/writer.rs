//! Watch events → the [`Index`]: each object becomes the typed view its kind keeps (its JSON is not
//! held), a re-list replaces every object of its kind at once, and a version older than the one
//! cached is ignored. The store feeds it the events of its watches and the objects its writes get
//! back; the tests below feed it events as a watch would, without a cluster.

use std::sync::Arc;

use kube::ResourceExt;

use super::{Index, InfraKind, InfraKindState, Parsed};
use crate::capi::{
    ClusterTopology, InfraTemplate, Keys, Machine, Node, ObjectKey, ParseError, ScalableKind,
    ScalableResource,
};
use crate::object::ApiObject;
use crate::problem::{Problem, ProblemKind};

/// What one watch is over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Watched {
    Scalable(ScalableKind),
    Machine,
    Node,
    Infra(InfraKind),
    /// Optional: readiness does not wait for it (older RBAC may not allow it).
    Cluster,
}

impl Watched {
    /// The metric label of the watch.
    pub fn label(&self) -> &'static str {
        match self {
            Watched::Scalable(kind) => kind.plural(),
            Watched::Machine => "machines",
            Watched::Node => "nodes",
            Watched::Infra(_) => "infrastructure-templates",
            Watched::Cluster => "clusters",
        }
    }
}

/// An object parsed into what the index keeps of its kind.
pub enum Prepared {
    Scalable(ObjectKey, Parsed<ScalableResource>),
    Machine(ObjectKey, Parsed<Machine>),
    /// A Node that cannot be read is left out: Nodes only add labels to templates and providerIDs
    /// to Machines that lack one.
    Node(Option<Node>),
    Infra(ObjectKey, Parsed<InfraTemplate>),
    /// A Cluster whose topology cannot be read is left out: it only feeds an advisory check.
    Cluster(Option<ClusterTopology>),
}

/// Parses an object of a watch (no lock needed: a re-list is parsed as it arrives and only the
/// views are held until it is complete).
pub fn prepare<const S: bool>(keys: &Keys, what: &Watched, obj: ApiObject<S>) -> Prepared {
    let key = object_key(&obj);
    let json = obj.into_json();
    let problem = |kind: &str, e: ParseError| {
        Problem::new(
            crate::problem::Subject::object(kind, &key),
            e.field,
            e.message,
        )
        .with_kind(ProblemKind::Malformed)
    };
    match what {
        Watched::Scalable(kind) => {
            let parsed = ScalableResource::from_json(*kind, keys, &json)
                .map(Arc::new)
                .map_err(|e| Box::new(problem(&kind.to_string(), e)));
            Prepared::Scalable(key, parsed)
        }
        Watched::Machine => {
            let parsed = Machine::from_json(keys, &json)
                .map(Arc::new)
                .map_err(|e| Box::new(problem("Machine", e)));
            // The cache's key is the view's own: the Machine's name is kept once.
            let key = parsed.as_ref().map_or(key, |m| m.key.clone());
            Prepared::Machine(key, parsed)
        }
        // Templates copy only these labels (a Node's others would be cached for nothing).
        Watched::Node => Prepared::Node(
            match Node::from_json(keys, &crate::template::NODE_LABELS_COPIED, &json) {
                Ok(node) => Some(node),
                Err(e) => {
                    tracing::debug!(node = %key, "Node not read: {e}");
                    None
                }
            },
        ),
        Watched::Infra(_) => {
            let parsed = InfraTemplate::from_json(&json)
                .map(Arc::new)
                .map_err(|e| Box::new(problem(json["kind"].as_str().unwrap_or_default(), e)));
            Prepared::Infra(key, parsed)
        }
        Watched::Cluster => Prepared::Cluster(match ClusterTopology::from_json(&json) {
            Ok(cluster) => Some(cluster),
            Err(e) => {
                tracing::debug!(cluster = %key, "topology not read: {e}");
                None
            }
        }),
    }
}

/// A watch listed again: these are now all the objects of its kind.
pub fn reset(index: &mut Index, what: &Watched, objects: Vec<Prepared>) {
    let objects = objects.into_iter();
    match what {
        Watched::Scalable(kind) => index.reset_resources(
            *kind,
            objects.filter_map(|o| match o {
                Prepared::Scalable(key, parsed) => Some((key, parsed)),
                _ => None,
            }),
        ),
        Watched::Machine => index.reset_machines(objects.filter_map(|o| match o {
            Prepared::Machine(key, parsed) => Some((key, parsed)),
            _ => None,
        })),
        Watched::Node => index.reset_nodes(objects.filter_map(|o| match o {
            Prepared::Node(node) => node,
            _ => None,
        })),
        Watched::Cluster => index.reset_clusters(objects.filter_map(|o| match o {
            Prepared::Cluster(cluster) => cluster,
            _ => None,
        })),
        Watched::Infra(kind) => {
            index.reset_infra(
                kind,
                objects.filter_map(|o| match o {
                    Prepared::Infra(key, parsed) => Some((key, parsed)),
                    _ => None,
                }),
            );
            index.set_infra_kind_state(kind.clone(), InfraKindState::Synced);
        }
    }
}

/// An object added or changed, from a watch or as a write of ours got it back. Returns whether the
/// index took it: a version older than the cached one is ignored, so a watch event behind a write
/// already recorded, or a write's answer behind a watch event, never rolls the cache back; the
/// cached version again (the watch's echo of a write already recorded) changes nothing, so it costs
/// no snapshot build; nor does a Node whose update changed nothing the index keeps of it.
pub(crate) fn apply<const S: bool>(
    index: &mut Index,
    keys: &Keys,
    what: &Watched,
    obj: ApiObject<S>,
) -> bool {
    let key = object_key(&obj);
    let cached = match what {
        Watched::Scalable(kind) => index
            .resource(*kind, &key)
            .map(|r| r.resource_version.clone()),
        Watched::Machine => index.machine(&key).map(|m| m.resource_version.clone()),
        Watched::Node | Watched::Infra(_) | Watched::Cluster => None,
    };
    let incoming = obj.resource_version();
    if !supersedes(cached.as_deref(), incoming.as_deref()) {
        return false;
    }
    match prepare(keys, what, obj) {
        Prepared::Scalable(key, parsed) => {
            if let Watched::Scalable(kind) = what {
                index.apply_resource(*kind, key, parsed);
            }
        }
        Prepared::Machine(key, parsed) => index.apply_machine(key, parsed),
        Prepared::Node(node) => return node.is_some_and(|node| index.apply_node(node)),
        Prepared::Infra(key, parsed) => {
            if let Watched::Infra(kind) = what {
                index.apply_infra(kind.clone(), key, parsed);
            }
        }
        Prepared::Cluster(cluster) => {
            if let Some(cluster) = cluster {
                return index.apply_cluster(cluster);
            }
        }
    }
    true
}

/// The Machines of `namespace` as one LIST at `list_version` returned them, all of them or, with
/// `selector` (label key, value), those carrying that label: each is applied, and a cached Machine the
/// list should have had (one the selector matches as cached) but lacks is gone, unless its cached
/// version is newer than the list (it was created after it). A listed Machine not cached, at a
/// version the Machines watch has gone past, is not brought back: the watch brought every Machine
/// event up to there, so it saw this one deleted (a list answered before the deletion, applied
/// after it).
pub(crate) fn machines_listed(
    index: &mut Index,
    keys: &Keys,
    namespace: &str,
    selector: Option<(&str, &str)>,
    list_version: Option<&str>,
    items: Vec<ApiObject>,
) {
    let listed: std::collections::BTreeSet<ObjectKey> = items.iter().map(object_key).collect();
    for obj in items {
        if !deleted_since(index, None, &obj) {
            apply(index, keys, &Watched::Machine, obj);
        }
    }
    for (key, version) in index.machine_versions_in(namespace, selector) {
        if !listed.contains(&key) && !is_older(version.as_deref(), list_version) {
            index.delete_machine(&key);
        }
    }
}

pub(crate) fn delete<const S: bool>(index: &mut Index, what: &Watched, obj: &ApiObject<S>) {
    let key = object_key(obj);
    match what {
        Watched::Scalable(kind) => index.delete_resource(*kind, &key),
        Watched::Machine => index.delete_machine(&key),
        Watched::Node => index.delete_node(&key.name),
        Watched::Infra(kind) => index.delete_infra(kind, &key),
        Watched::Cluster => index.delete_cluster(&key),
    }
}

/// Whether an object at version `incoming` replaces the one cached at `cached` (`None`: none cached,
/// or a kind whose versions are not compared): not when it is the cached version again, nor an older
/// one.
fn supersedes(cached: Option<&str>, incoming: Option<&str>) -> bool {
    let same = cached.is_some() && cached == incoming;
    !same && !is_older(cached, incoming)
}

/// Whether `incoming` is older than `cached`. Kubernetes 1.35 made resourceVersions of one resource
/// comparable (KEP-5504: positive integers without leading zeros); anything that does not parse is
/// never "older".
fn is_older(cached: Option<&str>, incoming: Option<&str>) -> bool {
    let parse = |s: &str| s.parse::<u64>().ok();
    match (cached.and_then(parse), incoming.and_then(parse)) {
        (Some(cached), Some(incoming)) => incoming < cached,
        _ => false,
    }
}

/// Whether `obj`, a Machine (`kind` `None`) or object of `kind` a read got from the API (not the
/// watch), is one the watch of its kind saw deleted since: not cached, at a version that watch has
/// gone past (it brought every event up to there, so it brought this one's creation and deletion).
/// A list or GET answered before the deletion and applied after it would bring it back otherwise.
pub(crate) fn deleted_since<const S: bool>(
    index: &Index,
    kind: Option<ScalableKind>,
    obj: &ApiObject<S>,
) -> bool {
    !index.has(kind, &object_key(obj))
        && revision_of(obj).is_some_and(|at| at <= index.watched(kind))
}

/// The kind a watch's watermark is kept under ([`Index::watched`]): `None` for Machines.
pub(crate) fn watermark_kind(what: &Watched) -> Option<Option<ScalableKind>> {
    match what {
        Watched::Machine => Some(None),
        Watched::Scalable(kind) => Some(Some(*kind)),
        Watched::Node | Watched::Infra(_) | Watched::Cluster => None,
    }
}

/// An object's resourceVersion as the etcd revision it is; `None` for one that is not a number.
pub(crate) fn revision_of(obj: &impl ResourceExt) -> Option<u64> {
    obj.meta().resource_version.as_deref()?.parse().ok()
}

pub(crate) fn object_key(obj: &impl ResourceExt) -> ObjectKey {
    ObjectKey::new(obj.namespace().unwrap_or_default(), obj.name_any())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::tests::{machine as machine_with_provider_id, object};
    use crate::object::NodeObject;
    use crate::snapshot::Settings;
    use serde_json::json;

    fn keys() -> Keys {
        Keys::default()
    }

    fn md(name: &str, rv: &str, replicas: i64, max: &str) -> ApiObject {
        object(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2",
            "kind": "MachineDeployment",
            "metadata": {
                "name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": rv,
                "annotations": {
                    "cluster.x-k8s.io/cluster-api-autoscaler-node-group-min-size": "0",
                    "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size": max,
                },
                "managedFields": [{"manager": "kubectl", "operation": "Update"}],
            },
            "spec": {"clusterName": "c1", "replicas": replicas, "template": {"spec": {"clusterName": "c1"}}},
        }))
    }

    fn machine(name: &str, rv: &str, mark: Option<&str>) -> ApiObject {
        machine_with_provider_id(name, rv, &format!("e2e:///{name}"), mark)
    }

    fn node(name: &str, labels: serde_json::Value) -> NodeObject {
        NodeObject::from_json(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "resourceVersion": "5", "labels": labels},
            "spec": {"providerID": format!("e2e:///{name}")},
        }))
        .unwrap()
    }

    const MD: Watched = Watched::Scalable(ScalableKind::MachineDeployment);

    fn replicas(index: &Index, name: &str) -> Option<i32> {
        index
            .resource(ScalableKind::MachineDeployment, &ObjectKey::new("ns", name))
            .and_then(|r| r.replicas)
    }

    fn list<const S: bool>(
        keys: &Keys,
        what: &Watched,
        objects: Vec<ApiObject<S>>,
    ) -> Vec<Prepared> {
        objects
            .into_iter()
            .map(|o| prepare(keys, what, o))
            .collect()
    }

    #[test]
    fn apply_adds_and_changes_and_delete_removes() {
        let (keys, mut index) = (keys(), Index::default());
        assert!(apply(&mut index, &keys, &MD, md("a", "10", 1, "5")));
        assert_eq!(replicas(&index, "a"), Some(1));
        assert!(apply(&mut index, &keys, &MD, md("a", "11", 3, "5")));
        assert_eq!(replicas(&index, "a"), Some(3));
        delete(&mut index, &MD, &md("a", "12", 3, "5"));
        assert_eq!(replicas(&index, "a"), None);
    }

    #[test]
    fn an_older_version_never_rolls_the_cache_back() {
        let (keys, mut index) = (keys(), Index::default());
        // A write of ours recorded at 20, then the watch delivers 19 (before the write) and 20.
        assert!(apply(&mut index, &keys, &MD, md("a", "20", 4, "5")));
        assert!(!apply(&mut index, &keys, &MD, md("a", "19", 3, "5")));
        assert_eq!(replicas(&index, "a"), Some(4));
        // The watch's echo of the write: nothing to take.
        assert!(!apply(&mut index, &keys, &MD, md("a", "20", 4, "5")));
        // Compared as numbers: "100" is newer than "99".
        assert!(apply(&mut index, &keys, &MD, md("a", "100", 2, "5")));
        assert!(!apply(&mut index, &keys, &MD, md("a", "99", 1, "5")));
        assert_eq!(replicas(&index, "a"), Some(2));

        let key = ObjectKey::new("ns", "m1");
        let mark = "unix 1 by capi-autoscaler-provider";
        assert!(apply(
            &mut index,
            &keys,
            &Watched::Machine,
            machine("m1", "31", Some(mark))
        ));
        assert!(!apply(
            &mut index,
            &keys,
            &Watched::Machine,
            machine("m1", "30", None)
        ));
        let cached = index.machine(&key).map(|m| m.annotations.len());
        assert_eq!(cached, Some(1), "the mark written at 31 stays");
    }

    #[test]
    fn a_fresh_list_of_machines_adds_the_missing_and_drops_the_gone_but_not_the_newer() {
        let (keys, mut index) = (keys(), Index::default());
        apply(
            &mut index,
            &keys,
            &Watched::Machine,
            machine("gone", "5", None),
        );
        apply(
            &mut index,
            &keys,
            &Watched::Machine,
            machine("newer", "50", None),
        );
        apply(
            &mut index,
            &keys,
            &Watched::Machine,
            machine("kept", "6", None),
        );
        let mark = "unix 1 by capi-autoscaler-provider";
        let items = vec![
            machine("kept", "7", Some(mark)),
            machine("unseen", "8", None),
        ];
        machines_listed(&mut index, &keys, "ns", None, Some("40"), items);
        let names: Vec<String> = index
            .machine_versions_in("ns", None)
            .into_iter()
            .map(|(k, v)| format!("{} {}", k.name, v.unwrap_or_default()))
            .collect();
        assert_eq!(names, vec!["kept 7", "newer 50", "unseen 8"]);
    }

    #[test]
    fn a_list_by_label_drops_only_the_gone_machines_that_carry_the_label() {
        let (keys, mut index) = (keys(), Index::default());
        let labelled = |name: &str, value: &str| {
            object(json!({
                "apiVersion": "cluster.x-k8s.io/v1beta2",
                "kind": "Machine",
                "metadata": {
                    "name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": "5",
                    "labels": {keys.deployment_name_label.as_str(): value},
                },
                "spec": {"clusterName": "c1"},
            }))
        };
        for object in [
            labelled("gone", "md"),
            labelled("kept", "md"),
            labelled("elsewhere", "other"),
            machine("unlabelled", "5", None),
        ] {
            apply(&mut index, &keys, &Watched::Machine, object);
        }
        let selector = (keys.deployment_name_label.as_str(), "md");
        machines_listed(
            &mut index,
            &keys,
            "ns",
            Some(selector),
            Some("40"),
            vec![labelled("kept", "md")],
        );
        let names: Vec<String> = index
            .machine_versions_in("ns", None)
            .into_iter()
            .map(|(k, _)| k.name.to_string())
            .collect();
        assert_eq!(names, vec!["elsewhere", "kept", "unlabelled"]);
    }

    /// A list answered before a deletion the Machines watch has brought since (a read's list and
    /// the watch race) does not bring the Machine back: the cache would keep a Machine that is gone
    /// until the next list of its group, and a read from the watch would count it a member.
    #[test]
    fn a_list_older_than_a_deletion_the_watch_brought_does_not_bring_the_machine_back() {
        let (keys, mut index) = (keys(), Index::default());
        apply(
            &mut index,
            &keys,
            &Watched::Machine,
            machine("gone", "5", None),
        );
        delete(&mut index, &Watched::Machine, &machine("gone", "9", None));
        index.watched_to(None, 9);

        machines_listed(
            &mut index,
            &keys,
            "ns",
            None,
            Some("8"),
            vec![machine("gone", "5", None)],
        );
        assert!(index.machine_versions_in("ns", None).is_empty());

        // A Machine at a version the watch has not come to yet is the list's to bring.
        machines_listed(
            &mut index,
            &keys,
            "ns",
            None,
            Some("12"),
            vec![machine("newer", "11", None)],
        );
        assert!(index.machine(&ObjectKey::new("ns", "newer")).is_some());
    }

    /// The same for a MachineSet a read got (its watch keeps a watermark too); a kind none is kept
    /// of is never taken for deleted.
    #[test]
    fn a_machine_set_read_before_a_deletion_its_watch_brought_is_taken_for_deleted() {
        let (keys, mut index) = (keys(), Index::default());
        let set = |rv: &str| {
            object(json!({
                "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet",
                "metadata": {"name": "md-1", "namespace": "ns", "uid": "u", "resourceVersion": rv},
                "spec": {"clusterName": "c1", "replicas": 1},
            }))
        };
        let sets = Some(ScalableKind::MachineSet);
        apply(
            &mut index,
            &keys,
            &Watched::Scalable(ScalableKind::MachineSet),
            set("5"),
        );
        assert!(!deleted_since(&index, sets, &set("5")), "cached");
        delete(
            &mut index,
            &Watched::Scalable(ScalableKind::MachineSet),
            &set("9"),
        );
        assert!(
            !deleted_since(&index, sets, &set("5")),
            "the watch has not come to 9"
        );
        index.watched_to(sets, 9);
        assert!(deleted_since(&index, sets, &set("5")));
        assert!(!deleted_since(&index, sets, &set("10")), "made again since");
        assert!(!deleted_since(
            &index,
            Some(ScalableKind::MachineDeployment),
            &md("md", "5", 1, "3")
        ));
    }

    #[test]
    fn only_another_and_not_older_version_supersedes_the_cached_one() {
        assert!(supersedes(None, Some("1")));
        assert!(supersedes(None, None));
        assert!(supersedes(Some("10"), Some("11")));
        assert!(!supersedes(Some("10"), Some("10")));
        assert!(!supersedes(Some("10"), Some("9")));
        assert!(supersedes(Some("abc"), Some("abd")));
        assert!(!supersedes(Some("abc"), Some("abc")));
    }

    #[test]
    fn versions_that_are_not_comparable_are_applied() {
        assert!(!is_older(None, Some("1")));
        assert!(!is_older(Some("10"), None));
        assert!(!is_older(Some("abc"), Some("1")));
        assert!(!is_older(Some("10"), Some("x9")));
        assert!(is_older(Some("10"), Some("9")));
        assert!(!is_older(Some("10"), Some("10")));
    }

    #[test]
    fn a_relist_replaces_every_object_of_its_kind_and_only_those() {
        let (keys, mut index) = (keys(), Index::default());
        apply(&mut index, &keys, &MD, md("gone", "1", 1, "5"));
        apply(&mut index, &keys, &MD, md("kept", "2", 1, "5"));
        apply(
            &mut index,
            &keys,
            &Watched::Machine,
            machine("m1", "3", None),
        );
        let objects = list(
            &keys,
            &MD,
            vec![md("kept", "7", 2, "5"), md("new", "8", 1, "5")],
        );
        reset(&mut index, &MD, objects);
        assert_eq!(replicas(&index, "gone"), None);
        assert_eq!(replicas(&index, "kept"), Some(2));
        assert_eq!(replicas(&index, "new"), Some(1));
        assert!(
            index.machine(&ObjectKey::new("ns", "m1")).is_some(),
            "another kind's objects are untouched"
        );
        // A relist after an etcd restore may carry lower versions: it is taken as it is.
        reset(
            &mut index,
            &MD,
            list(&keys, &MD, vec![md("kept", "3", 5, "5")]),
        );
        assert_eq!(replicas(&index, "kept"), Some(5));
    }

    #[test]
    fn a_malformed_object_is_a_problem_naming_it_and_the_others_are_served() {
        let (keys, mut index) = (keys(), Index::default());
        apply(&mut index, &keys, &MD, md("good", "1", 1, "5"));
        apply(&mut index, &keys, &MD, md("bad", "2", 1, "ten"));
        let snapshot = index.snapshot(&Settings::default());
        assert!(snapshot.group("MachineDeployment/ns/good").is_some());
        assert!(snapshot.group("MachineDeployment/ns/bad").is_none());
        let problem = snapshot
            .problems
            .iter()
            .find(|p| p.object == "MachineDeployment ns/bad")
            .unwrap_or_else(|| panic!("no problem for ns/bad: {:?}", snapshot.problems));
        assert!(problem.field.contains("max-size"), "{problem:?}");
    }

    #[test]
    fn nodes_keep_only_the_labels_templates_copy_and_unreadable_ones_are_left_out() {
        let (keys, mut index) = (keys(), Index::default());
        let labels = json!({"kubernetes.io/arch": "arm64", "team": "a"});
        apply(&mut index, &keys, &Watched::Node, node("n1", labels));
        let objects = list(
            &keys,
            &Watched::Node,
            vec![
                node("n2", json!({"kubernetes.io/os": "linux", "noise": "x"})),
                NodeObject::from_json(
                    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n3"}, "spec": 7}),
                )
                .unwrap(),
            ],
        );
        let listed: Vec<String> = objects
            .iter()
            .filter_map(|o| match o {
                Prepared::Node(Some(n)) => Some(format!("{} {:?}", n.name, n.labels)),
                _ => None,
            })
            .collect();
        assert_eq!(
            listed,
            vec![r#"n2 {"kubernetes.io/os": "linux"}"#.to_string()]
        );
    }

    #[test]
    fn an_infrastructure_kind_is_synced_once_listed() {
        let mut index = Index::default();
        let kind = InfraKind {
            api_group: "infrastructure.cluster.x-k8s.io".into(),
            kind: "E2EMachineTemplate".into(),
        };
        let what = Watched::Infra(kind.clone());
        assert!(index.infra_kind_state(&kind).is_none());
        reset(&mut index, &what, Vec::new());
        assert!(matches!(
            index.infra_kind_state(&kind),
            Some(InfraKindState::Synced)
        ));
    }
}
