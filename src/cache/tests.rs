//! The writer fed watch events as the store receives them: what each does to the index and its
//! journal, without a cluster.

use serde_json::{Value, json};

use super::writer::{Watched, apply, delete, prepare, reset};
use super::*;
use crate::capi::Keys;
use crate::object::{ApiObject, NodeObject};
use crate::protocol::ledger::{CLAIMS_ANNOTATION, LEDGER_ANNOTATION};

const MD: Watched = Watched::Scalable(ScalableKind::MachineDeployment);
const E2E_GROUP: &str = "infrastructure.cluster.x-k8s.io";

pub(super) fn object(value: Value) -> ApiObject {
    ApiObject::from_json(value).expect("an object")
}

/// A MachineDeployment `ns/<name>` at version `rv`, with `labels`, referencing template `infra`
/// of kind `E2EMachineTemplate` when given.
fn md(name: &str, rv: &str, replicas: i64, labels: Value, infra: Option<&str>) -> ApiObject {
    let mut spec = json!({"clusterName": "c1"});
    if let Some(infra) = infra {
        spec["infrastructureRef"] =
            json!({"apiGroup": E2E_GROUP, "kind": "E2EMachineTemplate", "name": infra});
    }
    object(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "MachineDeployment",
        "metadata": {
            "name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": rv,
            "labels": labels,
            "annotations": {
                "cluster.x-k8s.io/cluster-api-autoscaler-node-group-min-size": "0",
                "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size": "5",
            },
        },
        "spec": {"clusterName": "c1", "replicas": replicas, "template": {"spec": spec}},
    }))
}

pub(super) fn machine(name: &str, rv: &str, provider_id: &str, mark: Option<&str>) -> ApiObject {
    let annotations = match mark {
        Some(mark) => json!({"cluster.x-k8s.io/delete-machine": mark}),
        None => json!({}),
    };
    object(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "Machine",
        "metadata": {
            "name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": rv,
            "annotations": annotations,
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet", "name": "ms", "uid": "u"}],
        },
        "spec": {"clusterName": "c1", "providerID": provider_id},
    }))
}

fn node(name: &str, rv: &str, cluster: Option<&str>) -> NodeObject {
    NodeObject::from_json(node_json(name, rv, cluster)).expect("a Node")
}

fn node_json(name: &str, rv: &str, cluster: Option<&str>) -> serde_json::Value {
    let annotations = match cluster {
        Some(cluster) => json!({
            "cluster.x-k8s.io/cluster-namespace": "ns",
            "cluster.x-k8s.io/cluster-name": cluster,
        }),
        None => json!({}),
    };
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "resourceVersion": rv, "annotations": annotations},
        "spec": {"providerID": format!("e2e:///{name}")},
    })
}

fn infra_kind() -> InfraKind {
    InfraKind {
        api_group: E2E_GROUP.into(),
        kind: "E2EMachineTemplate".into(),
    }
}

/// An `E2EMachineTemplate` `ns/<name>` whose `status.capacity` is `capacity`.
fn template(name: &str, capacity: Value) -> ApiObject {
    object(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
        "kind": "E2EMachineTemplate",
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": "1"},
        "spec": {"template": {"spec": {}}},
        "status": {"capacity": capacity},
    }))
}

fn cluster(name: &str, paused: bool) -> ApiObject {
    object(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "Cluster",
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": "1"},
        "spec": {"paused": paused},
    }))
}

fn key(name: &str) -> ObjectKey {
    ObjectKey::new("ns", name)
}

/// What the journal holds, as (local resources, local Machines, anything else).
fn journal(index: &Index) -> (Vec<String>, Vec<String>, bool) {
    let journal = &index.journal;
    (
        journal
            .resources
            .iter()
            .map(|(_, k)| k.name.to_string())
            .collect(),
        journal
            .machines
            .iter()
            .map(|k| k.name.to_string())
            .collect(),
        journal.other,
    )
}

/// The index after `events`, with its journal emptied as a snapshot takes it.
fn settled(events: impl FnOnce(&mut Index, &Keys)) -> Index {
    let (keys, mut index) = (Keys::default(), Index::default());
    events(&mut index, &keys);
    index.take_journal();
    assert!(!index.changed_since_snapshot());
    index
}

#[test]
fn a_new_replica_count_is_local_to_its_group_and_any_other_change_is_not() {
    let keys = Keys::default();
    let mut index = settled(|index, keys| {
        apply(index, keys, &MD, md("a", "1", 1, json!({}), None));
    });
    apply(&mut index, &keys, &MD, md("a", "2", 3, json!({}), None));
    assert!(index.changed_since_snapshot());
    assert_eq!(journal(&index), (vec!["a".into()], vec![], false));

    index.take_journal();
    apply(
        &mut index,
        &keys,
        &MD,
        md("a", "3", 3, json!({"team": "x"}), None),
    );
    assert_eq!(
        journal(&index),
        (vec![], vec![], true),
        "a label moves groups"
    );

    index.take_journal();
    delete(&mut index, &MD, &md("a", "4", 3, json!({}), None));
    assert_eq!(journal(&index), (vec![], vec![], true));
    assert!(
        index
            .resource(ScalableKind::MachineDeployment, &key("a"))
            .is_none()
    );
}

/// The write path writes its records (claims, ledger, resize tokens) on the group object with
/// every operation, and reads its Cluster with every fresh read: neither may cost a snapshot built
/// from scratch (60 ms at 10,000 Machines, a second at 100,000, per write).
#[test]
fn the_protocols_records_are_local_to_their_group_and_the_same_cluster_again_changes_nothing() {
    let keys = Keys::default();
    let with = |rv: &str, records: Value| {
        let mut json = md("a", rv, 3, json!({}), None).into_json();
        for (k, v) in records.as_object().into_iter().flatten() {
            json["metadata"]["annotations"][k] = v.clone();
        }
        object(json)
    };
    let mut index = settled(|index, keys| {
        apply(index, keys, &MD, with("1", json!({})));
        apply(index, keys, &Watched::Cluster, cluster("c1", false));
    });
    apply(
        &mut index,
        &keys,
        &MD,
        with("2", json!({CLAIMS_ANNOTATION: "m1@5"})),
    );
    assert_eq!(journal(&index), (vec!["a".into()], vec![], false));

    index.take_journal();
    apply(
        &mut index,
        &keys,
        &MD,
        with(
            "3",
            json!({LEDGER_ANNOTATION: "m1@5", "example.com/team": "x"}),
        ),
    );
    assert_eq!(
        journal(&index),
        (vec![], vec![], true),
        "another annotation with them is not the protocol's"
    );

    index.take_journal();
    assert!(!apply(
        &mut index,
        &keys,
        &Watched::Cluster,
        cluster("c1", false)
    ));
    assert!(!index.changed_since_snapshot(), "the same Cluster again");
    assert!(apply(
        &mut index,
        &keys,
        &Watched::Cluster,
        cluster("c1", true)
    ));
    assert_eq!(
        journal(&index),
        (vec![], vec![], true),
        "paused: everything"
    );
}

#[test]
fn a_new_delete_mark_is_local_and_a_new_provider_id_is_not() {
    let keys = Keys::default();
    let m = Watched::Machine;
    let mut index = settled(|index, keys| {
        apply(index, keys, &m, machine("m1", "1", "e2e:///m1", None));
    });
    let mark = "unix 1 by capi-autoscaler-provider";
    apply(
        &mut index,
        &keys,
        &m,
        machine("m1", "2", "e2e:///m1", Some(mark)),
    );
    assert_eq!(journal(&index), (vec![], vec!["m1".into()], false));
    let marked = index.machine(&key("m1")).map(|m| m.annotations.len());
    assert_eq!(marked, Some(1));

    index.take_journal();
    apply(
        &mut index,
        &keys,
        &m,
        machine("m1", "3", "e2e:///other", Some(mark)),
    );
    assert_eq!(journal(&index), (vec![], vec![], true));

    index.take_journal();
    delete(&mut index, &m, &machine("m1", "4", "e2e:///other", None));
    assert!(index.machine(&key("m1")).is_none());
    assert!(index.changed_since_snapshot());
}

#[test]
fn a_relist_of_machines_replaces_them_all() {
    let keys = Keys::default();
    let m = Watched::Machine;
    let mut index = settled(|index, keys| {
        apply(index, keys, &m, machine("gone", "1", "e2e:///gone", None));
    });
    let listed = vec![prepare(&keys, &m, machine("new", "5", "e2e:///new", None))];
    reset(&mut index, &m, listed);
    assert!(index.machine(&key("gone")).is_none());
    assert!(index.machine(&key("new")).is_some());
    assert_eq!(journal(&index), (vec![], vec![], true));
}

#[test]
fn referenced_infrastructure_kinds_are_wanted_until_watched_and_counted_as_resources_go() {
    let keys = Keys::default();
    let mut index = Index::default();
    apply(
        &mut index,
        &keys,
        &MD,
        md("a", "1", 1, json!({}), Some("t")),
    );
    apply(
        &mut index,
        &keys,
        &MD,
        md("b", "1", 1, json!({}), Some("t")),
    );
    let wanted = |index: &Index| index.wanted_infra_kinds().into_iter().collect::<Vec<_>>();
    assert_eq!(wanted(&index), [infra_kind()]);
    // A new replica count keeps the reference; one resource gone leaves the other's.
    apply(
        &mut index,
        &keys,
        &MD,
        md("a", "2", 2, json!({}), Some("t")),
    );
    delete(&mut index, &MD, &md("a", "3", 2, json!({}), Some("t")));
    assert_eq!(wanted(&index), [infra_kind()]);
    delete(&mut index, &MD, &md("b", "2", 1, json!({}), Some("t")));
    assert!(wanted(&index).is_empty());

    // Watched once listed: no longer wanted, and its templates are there.
    apply(
        &mut index,
        &keys,
        &MD,
        md("a", "4", 1, json!({}), Some("t")),
    );
    let what = Watched::Infra(infra_kind());
    let listed = vec![prepare(&keys, &what, template("t", json!({"cpu": "2"})))];
    reset(&mut index, &what, listed);
    assert!(wanted(&index).is_empty());
    assert_eq!(
        index.infra_kind_state(&infra_kind()),
        Some(&InfraKindState::Synced)
    );
    assert!(matches!(index.infra(&infra_kind(), &key("t")), Some(Ok(_))));
}

#[test]
fn infrastructure_templates_come_go_and_an_unreadable_one_is_kept_as_its_problem() {
    let keys = Keys::default();
    let what = Watched::Infra(infra_kind());
    let mut index = settled(|index, _| reset(index, &what, Vec::new()));
    assert!(apply(
        &mut index,
        &keys,
        &what,
        template("t", json!({"cpu": "2"}))
    ));
    assert!(matches!(index.infra(&infra_kind(), &key("t")), Some(Ok(_))));
    assert!(index.changed_since_snapshot());
    apply(&mut index, &keys, &what, template("bad", json!("lots")));
    let problem = match index.infra(&infra_kind(), &key("bad")) {
        Some(Err(problem)) => problem,
        other => panic!("expected a problem, got {other:?}"),
    };
    assert_eq!(problem.field, "status.capacity");
    assert_eq!(problem.object, "E2EMachineTemplate ns/bad");
    delete(&mut index, &what, &template("t", json!({"cpu": "2"})));
    assert!(index.infra(&infra_kind(), &key("t")).is_none());
    // A relist replaces the kind's templates.
    reset(&mut index, &what, Vec::new());
    assert!(index.infra(&infra_kind(), &key("bad")).is_none());
}

#[test]
fn nodes_count_the_clusters_they_name_as_they_come_and_go() {
    let keys = Keys::default();
    let n = Watched::Node;
    let mut index = Index::default();
    let observed = |index: &Index| {
        index
            .observed_clusters()
            .into_iter()
            .map(|k| k.to_string())
            .collect::<Vec<_>>()
    };
    apply(&mut index, &keys, &n, node("n1", "1", Some("c1")));
    apply(&mut index, &keys, &n, node("n2", "1", Some("c1")));
    apply(&mut index, &keys, &n, node("n3", "1", None));
    assert_eq!(observed(&index), ["ns/c1"]);
    // A Node that moves to another Cluster counts there only.
    apply(&mut index, &keys, &n, node("n2", "2", Some("c2")));
    assert_eq!(observed(&index), ["ns/c1", "ns/c2"]);
    delete(&mut index, &n, &node("n1", "3", Some("c1")));
    assert_eq!(observed(&index), ["ns/c2"]);
    assert!(!index.nodes().contains_key("n1"));
    let listed = vec![prepare(&keys, &n, node("n4", "9", Some("c3")))];
    reset(&mut index, &n, listed);
    assert_eq!(observed(&index), ["ns/c3"]);
    assert_eq!(index.nodes().len(), 1);
}

/// A kubelet's status updates (conditions, heartbeats, images) leave the Node's view as it was:
/// no change for the next snapshot. A label templates copy, a providerID or a Cluster is one.
#[test]
fn a_node_update_that_changes_nothing_the_index_keeps_is_no_change() {
    let keys = Keys::default();
    let n = Watched::Node;
    let mut index = Index::default();
    assert!(apply(&mut index, &keys, &n, node("n1", "1", Some("c1"))));
    index.take_journal();

    let mut heartbeat = node_json("n1", "2", Some("c1"));
    heartbeat["status"] = json!({
        "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "2026-11-29T21:00:00Z"}],
        "images": [{"names": ["registry.example/app:1"], "sizeBytes": 1000}],
    });
    heartbeat["metadata"]["labels"] = json!({"not-copied.example/label": "x"});
    let heartbeat = NodeObject::from_json(heartbeat).expect("a Node");
    assert!(!apply(&mut index, &keys, &n, heartbeat));
    assert!(!index.changed_since_snapshot());

    let mut labelled = node_json("n1", "3", Some("c1"));
    labelled["metadata"]["labels"] = json!({"kubernetes.io/arch": "arm64"});
    let labelled = NodeObject::from_json(labelled).expect("a Node");
    assert!(apply(&mut index, &keys, &n, labelled));
    assert!(index.changed_since_snapshot());
    index.take_journal();

    assert!(apply(&mut index, &keys, &n, node("n1", "4", Some("c2"))));
    assert!(index.changed_since_snapshot());
}

#[test]
fn clusters_come_go_and_are_relisted() {
    let keys = Keys::default();
    let c = Watched::Cluster;
    let mut index = settled(|index, keys| {
        apply(index, keys, &c, cluster("c1", false));
    });
    assert_eq!(index.cluster(&key("c1")).map(|c| c.paused), Some(false));
    apply(&mut index, &keys, &c, cluster("c1", true));
    assert_eq!(index.cluster(&key("c1")).map(|c| c.paused), Some(true));
    assert_eq!(journal(&index), (vec![], vec![], true));
    delete(&mut index, &c, &cluster("c1", true));
    assert!(index.cluster(&key("c1")).is_none());
    let listed = vec![prepare(&keys, &c, cluster("c2", false))];
    reset(&mut index, &c, listed);
    assert!(index.cluster(&key("c2")).is_some());
}

#[test]
fn a_snapshot_takes_the_journal_and_later_changes_are_relative_to_it() {
    let keys = Keys::default();
    let mut index = Index::default();
    apply(&mut index, &keys, &MD, md("a", "1", 1, json!({}), None));
    let (first, journal) = index.take_journal();
    assert!(journal.other);
    apply(&mut index, &keys, &MD, md("a", "2", 2, json!({}), None));
    let (second, journal) = index.take_journal();
    assert_eq!(second, first + 1);
    assert_eq!(journal.since, first);
    assert!(!journal.other);
}
