//! Unit tests of `parse`.

use super::*;
use crate::capi::Labels;
use serde_json::json;

#[test]
fn machines_keep_only_the_group_keys_and_resources_drop_the_last_applied_copy() {
    let keys = Keys::default();
    let machine = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
        "metadata": {"name": "m", "namespace": "ns",
            "labels": {"cluster.x-k8s.io/set-name": "ms", "app": "x"},
            "annotations": {"cluster.x-k8s.io/delete-machine": "t", "kubectl.kubernetes.io/last-applied-configuration": "{}"}},
        "spec": {"clusterName": "c"}
    });
    let m = Machine::from_json(&keys, &machine).unwrap();
    assert_eq!(
        m.labels.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        ["cluster.x-k8s.io/set-name"]
    );
    assert_eq!(
        m.annotations.keys().collect::<Vec<_>>(),
        ["cluster.x-k8s.io/delete-machine"]
    );
    let md = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
        "metadata": {"name": "md", "namespace": "ns", "labels": {"team": "a"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "capacity.cluster-autoscaler.kubernetes.io/cpu": "2"}},
        "spec": {"clusterName": "c", "replicas": 1}
    });
    let r = ScalableResource::from_json(ScalableKind::MachineDeployment, &keys, &md).unwrap();
    assert_eq!(
        r.annotations.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        ["capacity.cluster-autoscaler.kubernetes.io/cpu"]
    );
    assert_eq!(
        r.labels.get("team"),
        Some("a"),
        "labels feed discovery selectors"
    );
}

#[test]
fn cluster_topology_workers_and_their_replicas() {
    let cluster = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
        "metadata": {"name": "c1", "namespace": "ns"},
        "spec": {"topology": {"classRef": {"name": "cc"}, "workers": {
            "machineDeployments": [{"class": "default", "name": "md-0", "replicas": 3}, {"class": "default", "name": "md-1"}],
            "machinePools": [{"class": "default", "name": "mp-0", "replicas": 1}]
        }}}
    });
    let t = ClusterTopology::from_json(&cluster).unwrap();
    assert_eq!(t.key, ObjectKey::new("ns", "c1"));
    assert_eq!(
        t.workers,
        vec![
            TopologyWorker {
                kind: ScalableKind::MachineDeployment,
                name: "md-0".into(),
                replicas: Some(3)
            },
            TopologyWorker {
                kind: ScalableKind::MachineDeployment,
                name: "md-1".into(),
                replicas: None
            },
            TopologyWorker {
                kind: ScalableKind::MachinePool,
                name: "mp-0".into(),
                replicas: Some(1)
            },
        ]
    );
    let plain = json!({"metadata": {"name": "c2", "namespace": "ns"}, "spec": {}});
    assert!(
        ClusterTopology::from_json(&plain)
            .unwrap()
            .workers
            .is_empty()
    );
    assert!(!ClusterTopology::from_json(&plain).unwrap().paused);
    let paused = json!({"metadata": {"name": "c2", "namespace": "ns"}, "spec": {"paused": true}});
    assert!(ClusterTopology::from_json(&paused).unwrap().paused);
    let annotated = json!({"metadata": {"name": "c2", "namespace": "ns",
        "annotations": {"cluster.x-k8s.io/paused": ""}}, "spec": {}});
    assert!(ClusterTopology::from_json(&annotated).unwrap().paused);
    let bad = json!({"metadata": {"name": "c3", "namespace": "ns"},
        "spec": {"topology": {"workers": {"machineDeployments": [{"name": "md-0", "replicas": "three"}]}}}});
    let e = ClusterTopology::from_json(&bad).unwrap_err();
    assert_eq!(
        e.field,
        "spec.topology.workers.machineDeployments[0].replicas"
    );
}

macro_rules! fixtures {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_str!(concat!("../../../tests/fixtures/objects/", $name)))),*]
    };
}

/// Every object fixture, by file name.
const FIXTURES: &[(&str, &str)] = fixtures![
    "awsmachinetemplate-v1beta2.json",
    "dockermachinetemplate-v1beta2.json",
    "machine-v1beta1-failed.json",
    "machine-v1beta1-running.json",
    "machine-v1beta2-deleting.json",
    "machine-v1beta2-failed-deprecated.json",
    "machine-v1beta2-infra-deleted.json",
    "machine-v1beta2-pending.json",
    "machine-v1beta2-running.json",
    "machinedeployment-v1beta1.json",
    "machinedeployment-v1beta2-topology-paused.json",
    "machinedeployment-v1beta2.json",
    "machinepool-v1beta1.json",
    "machinepool-v1beta2.json",
    "machineset-v1beta1-standalone.json",
    "machineset-v1beta2-owned.json",
];

#[test]
fn every_fixture_is_listed() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/objects");
    let mut on_disk: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    on_disk.sort();
    let listed: Vec<&str> = FIXTURES.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        on_disk, listed,
        "list new fixtures in FIXTURES (sorted) so the fuzz tests see them"
    );
}

fn fixture(name: &str) -> Value {
    let (_, text) = FIXTURES
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no fixture {name}"));
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn keys() -> Keys {
    Keys::default()
}

fn labels(pairs: &[(&str, &str)]) -> crate::capi::Labels {
    pairs.iter().copied().collect()
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn owner(kind: &str, name: &str) -> OwnerRef {
    OwnerRef {
        kind: kind.into(),
        name: name.into(),
    }
}

fn taint(key: &str, value: &str, effect: &str) -> Taint {
    Taint {
        key: key.into(),
        value: value.into(),
        effect: effect.into(),
    }
}

fn infra(group: &str, version: Option<&str>, kind: &str, name: &str) -> InfraRef {
    InfraRef {
        api_group: group.into(),
        api_version: version.map(Into::into),
        kind: kind.into(),
        name: name.into(),
    }
}

/// Sets (or with `None`, removes) the value at `path`, creating objects on the way.
fn set(obj: &mut Value, path: &[&str], value: Option<Value>) {
    let (last, parents) = path.split_last().expect("non-empty path");
    let mut current = obj;
    for p in parents {
        if !current.get(*p).is_some_and(Value::is_object) {
            current[*p] = json!({});
        }
        current = &mut current[*p];
    }
    let m = current.as_object_mut().expect("object");
    match value {
        Some(v) => {
            m.insert(last.to_string(), v);
        }
        None => {
            m.remove(*last);
        }
    }
}

fn with(mut obj: Value, path: &[&str], value: Value) -> Value {
    set(&mut obj, path, Some(value));
    obj
}

fn without(mut obj: Value, path: &[&str]) -> Value {
    set(&mut obj, path, None);
    obj
}

// -----------------------------------------------------------------------------------------------
// Scalable resources

#[test]
fn machinedeployment_v1beta2_fixture() {
    let md = ScalableResource::from_json(
        ScalableKind::MachineDeployment,
        &keys(),
        &fixture("machinedeployment-v1beta2.json"),
    )
    .unwrap();
    assert_eq!(
        md,
        ScalableResource {
            kind: ScalableKind::MachineDeployment,
            key: ObjectKey::new("team-a", "workers-md-0"),
            uid: "3f0d2c1e-5b7a-4c1d-9e2f-0a1b2c3d4e01".into(),
            resource_version: "48213".into(),
            labels: labels(&[
                ("cluster.x-k8s.io/cluster-name", "prod"),
                ("nodepool", "general")
            ]),
            annotations: labels(&[
                (
                    "cluster.x-k8s.io/cluster-api-autoscaler-node-group-min-size",
                    "1"
                ),
                (
                    "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size",
                    "10"
                ),
                (
                    "capacity.cluster-autoscaler.kubernetes.io/labels",
                    "tier=general"
                ),
                ("machinedeployment.clusters.x-k8s.io/revision", "2"),
            ]),
            cluster_name: "prod".into(),
            replicas: Some(3),
            status_replicas: Some(3),
            generation: Some(3),
            observed_generation: Some(3),
            rolling_out: false,
            preflight: None,
            paused: false,
            owners: vec![owner("Cluster", "prod")],
            template: MachineTemplate {
                labels: labels(&[
                    ("cluster.x-k8s.io/cluster-name", "prod"),
                    ("cluster.x-k8s.io/deployment-name", "workers-md-0"),
                    ("node-role.kubernetes.io/worker", ""),
                    ("nodepool", "general"),
                ]),
                infrastructure_ref: Some(Ok(infra(
                    "infrastructure.cluster.x-k8s.io",
                    None,
                    "DockerMachineTemplate",
                    "workers-md-0-7d9f4"
                ))),
                taints: vec![
                    taint("dedicated", "general", "NoSchedule"),
                    taint("example.com/initializing", "", "NoExecute"),
                ],
                failure_domain: Some("fd-a".into()),
            },
            provider_id_list: vec![],
            topology: None,
        }
    );
}

/// What each scalable fixture reads as, field by field.
#[test]
fn scalable_fixtures() {
    struct Row {
        file: &'static str,
        kind: ScalableKind,
        key: (&'static str, &'static str),
        cluster: &'static str,
        replicas: Option<i32>,
        paused: bool,
        owners: Vec<OwnerRef>,
        infra: Option<InfraRef>,
        template_labels: usize,
        provider_ids: usize,
        topology: Option<&'static str>,
    }
    let rows = [
        Row {
            file: "machinedeployment-v1beta1.json",
            kind: ScalableKind::MachineDeployment,
            key: ("team-b", "legacy-md"),
            cluster: "legacy",
            replicas: Some(0),
            // The paused annotation pauses whatever its value, even "false" (as upstream).
            paused: true,
            owners: vec![],
            infra: Some(infra(
                "infrastructure.cluster.x-k8s.io",
                Some("infrastructure.cluster.x-k8s.io/v1beta2"),
                "AWSMachineTemplate",
                "legacy-md-m5large",
            )),
            template_labels: 1,
            provider_ids: 0,
            topology: None,
        },
        Row {
            file: "machinedeployment-v1beta2-topology-paused.json",
            kind: ScalableKind::MachineDeployment,
            key: ("tenants", "cc-md-gpu-8xk2p"),
            cluster: "cc",
            replicas: None,
            // spec.paused: a rollout pause, not the group's.
            paused: false,
            owners: vec![],
            infra: Some(infra(
                "infrastructure.cluster.x-k8s.io",
                None,
                "DockerMachineTemplate",
                "cc-md-gpu-infra-4f2k9",
            )),
            template_labels: 0,
            provider_ids: 0,
            topology: Some("gpu"),
        },
        Row {
            file: "machineset-v1beta2-owned.json",
            kind: ScalableKind::MachineSet,
            key: ("team-a", "workers-md-0-5f8c9"),
            cluster: "prod",
            replicas: Some(3),
            paused: false,
            owners: vec![owner("MachineDeployment", "workers-md-0")],
            infra: Some(infra(
                "infrastructure.cluster.x-k8s.io",
                None,
                "DockerMachineTemplate",
                "workers-md-0-7d9f4",
            )),
            template_labels: 2,
            provider_ids: 0,
            topology: None,
        },
        Row {
            file: "machineset-v1beta1-standalone.json",
            kind: ScalableKind::MachineSet,
            key: ("team-b", "standalone-ms"),
            cluster: "legacy",
            replicas: None,
            paused: false,
            owners: vec![],
            infra: Some(infra(
                "infrastructure.cluster.x-k8s.io",
                Some("infrastructure.cluster.x-k8s.io/v1beta1"),
                "VSphereMachineTemplate",
                "standalone",
            )),
            template_labels: 1,
            provider_ids: 0,
            topology: None,
        },
        Row {
            file: "machinepool-v1beta2.json",
            kind: ScalableKind::MachinePool,
            key: ("team-a", "pool-0"),
            cluster: "prod",
            replicas: Some(2),
            paused: false,
            owners: vec![],
            infra: Some(infra(
                "infrastructure.cluster.x-k8s.io",
                None,
                "AWSMachinePool",
                "pool-0",
            )),
            template_labels: 1,
            provider_ids: 2,
            topology: None,
        },
        Row {
            file: "machinepool-v1beta1.json",
            kind: ScalableKind::MachinePool,
            key: ("team-c", "azure-pool"),
            cluster: "az",
            replicas: Some(1),
            paused: false,
            owners: vec![],
            infra: Some(infra(
                "infrastructure.cluster.x-k8s.io",
                Some("infrastructure.cluster.x-k8s.io/v1beta1"),
                "AzureMachinePool",
                "azure-pool",
            )),
            template_labels: 0,
            provider_ids: 1,
            topology: None,
        },
    ];
    for row in rows {
        let r = ScalableResource::from_json(row.kind, &keys(), &fixture(row.file))
            .unwrap_or_else(|e| panic!("{}: {e}", row.file));
        let f = row.file;
        assert_eq!(r.kind, row.kind, "{f}");
        assert_eq!(r.key, ObjectKey::new(row.key.0, row.key.1), "{f}");
        assert!(!r.uid.is_empty() && !r.resource_version.is_empty(), "{f}");
        assert_eq!(r.cluster_name, row.cluster, "{f}");
        assert_eq!(r.replicas, row.replicas, "{f}");
        assert_eq!(r.paused, row.paused, "{f}");
        assert_eq!(r.owners, row.owners, "{f}");
        assert_eq!(r.template.infrastructure_ref, row.infra.map(Ok), "{f}");
        assert_eq!(r.template.labels.len(), row.template_labels, "{f}");
        assert_eq!(r.provider_id_list.len(), row.provider_ids, "{f}");
        assert_eq!(r.topology.as_deref(), row.topology, "{f}");
    }
}

fn base_md() -> Value {
    json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "MachineDeployment",
        "metadata": {"namespace": "ns", "name": "md"},
        "spec": {"clusterName": "c", "template": {"spec": {}}},
    })
}

/// Field by field: what a change to a minimal MachineDeployment does to the view, or the exact error.
#[test]
fn scalable_field_cases() {
    type Check = fn(&ScalableResource) -> bool;
    let ok = |c: Check| Ok::<Check, &str>(c);
    let cases: Vec<(&str, Value, Result<Check, &str>)> = vec![
        (
            "minimal",
            base_md(),
            ok(|r| {
                r.replicas.is_none()
                    && !r.paused
                    && r.template == MachineTemplate::default()
                    && r.uid.is_empty()
                    && r.cluster_name == "c"
            }),
        ),
        (
            "replicas",
            with(base_md(), &["spec", "replicas"], json!(5)),
            ok(|r| r.replicas == Some(5)),
        ),
        (
            "replicas zero",
            with(base_md(), &["spec", "replicas"], json!(0)),
            ok(|r| r.replicas == Some(0)),
        ),
        (
            "status replicas",
            with(base_md(), &["status", "replicas"], json!(2)),
            ok(|r| r.status_replicas == Some(2) && r.replicas.is_none()),
        ),
        (
            "status replicas string",
            with(base_md(), &["status", "replicas"], json!("2")),
            Err(r#"status.replicas: expected an integer, found "2""#),
        ),
        (
            "rolling out (v1beta2 conditions)",
            with(
                base_md(),
                &["status", "conditions"],
                json!([
                    "not a condition",
                    {"type": "Available", "status": "True"},
                    {"type": "RollingOut", "status": "True", "reason": "RollingOut"},
                ]),
            ),
            ok(|r| r.rolling_out),
        ),
        (
            "rolling out (v1beta2 conditions of a v1beta1 object)",
            with(
                base_md(),
                &["status", "v1beta2", "conditions"],
                json!([{"type": "RollingOut", "status": "True"}]),
            ),
            ok(|r| r.rolling_out),
        ),
        (
            "not rolling out",
            with(
                base_md(),
                &["status", "conditions"],
                json!([{"type": "RollingOut", "status": "False", "reason": "NotRollingOut"}]),
            ),
            ok(|r| !r.rolling_out),
        ),
        (
            "conditions not a list",
            with(
                base_md(),
                &["status", "conditions"],
                json!({"type": "RollingOut"}),
            ),
            Err(r#"status.conditions: expected a list, found an object"#),
        ),
        (
            "replicas null",
            with(base_md(), &["spec", "replicas"], Value::Null),
            ok(|r| r.replicas.is_none()),
        ),
        (
            "replicas string",
            with(base_md(), &["spec", "replicas"], json!("three")),
            Err(r#"spec.replicas: expected an integer, found "three""#),
        ),
        (
            "replicas float",
            with(base_md(), &["spec", "replicas"], json!(1.5)),
            Err("spec.replicas: expected an integer, found 1.5"),
        ),
        (
            "replicas too large",
            with(base_md(), &["spec", "replicas"], json!(3_000_000_000_i64)),
            Err("spec.replicas: expected a 32-bit integer, found 3000000000"),
        ),
        (
            "replicas above i64",
            with(base_md(), &["spec", "replicas"], json!(u64::MAX)),
            Err("spec.replicas: expected a 32-bit integer, found 18446744073709551615"),
        ),
        (
            "replicas negative beyond i32",
            with(base_md(), &["spec", "replicas"], json!(-3_000_000_000_i64)),
            Err("spec.replicas: expected a 32-bit integer, found -3000000000"),
        ),
        (
            "replicas object",
            with(base_md(), &["spec", "replicas"], json!({"value": 1})),
            Err("spec.replicas: expected an integer, found an object"),
        ),
        (
            "spec not an object",
            with(base_md(), &["spec"], json!("x")),
            Err(r#"spec: expected an object, found "x""#),
        ),
        (
            "no spec",
            without(base_md(), &["spec"]),
            ok(|r| r.cluster_name.is_empty() && r.replicas.is_none()),
        ),
        (
            "no metadata",
            without(base_md(), &["metadata"]),
            Err("metadata: missing required field"),
        ),
        (
            "metadata list",
            with(base_md(), &["metadata"], json!([])),
            Err("metadata: expected an object, found a list"),
        ),
        (
            "no name",
            without(base_md(), &["metadata", "name"]),
            Err("metadata.name: missing required field"),
        ),
        (
            "empty name",
            with(base_md(), &["metadata", "name"], json!("")),
            Err("metadata.name: must not be empty"),
        ),
        (
            "name number",
            with(base_md(), &["metadata", "name"], json!(5)),
            Err("metadata.name: expected a string, found 5"),
        ),
        (
            "no namespace",
            without(base_md(), &["metadata", "namespace"]),
            Err("metadata.namespace: missing required field"),
        ),
        (
            "uid and resourceVersion",
            with(
                with(base_md(), &["metadata", "uid"], json!("u")),
                &["metadata", "resourceVersion"],
                json!("7"),
            ),
            ok(|r| r.uid == "u" && r.resource_version == "7"),
        ),
        (
            "uid number",
            with(base_md(), &["metadata", "uid"], json!(1)),
            Err("metadata.uid: expected a string, found 1"),
        ),
        (
            "label not a string",
            with(
                base_md(),
                &["metadata", "labels"],
                json!({"a": "b", "x.io/n": 1}),
            ),
            Err("metadata.labels[x.io/n]: expected a string, found 1"),
        ),
        (
            "labels a list",
            with(base_md(), &["metadata", "labels"], json!(["a"])),
            Err("metadata.labels: expected a map of strings, found a list"),
        ),
        (
            "annotation null",
            with(base_md(), &["metadata", "annotations"], json!({"a": null})),
            Err("metadata.annotations[a]: expected a string, found null"),
        ),
        (
            "owners",
            with(
                base_md(),
                &["metadata", "ownerReferences"],
                json!([{"kind": "Cluster", "name": "c", "uid": "1"}]),
            ),
            ok(|r| r.owners == [owner("Cluster", "c")]),
        ),
        (
            "owners not a list",
            with(base_md(), &["metadata", "ownerReferences"], json!({})),
            Err("metadata.ownerReferences: expected a list, found an object"),
        ),
        (
            "owner without kind",
            with(
                base_md(),
                &["metadata", "ownerReferences"],
                json!([{"kind": "A", "name": "a"}, {"name": "b"}]),
            ),
            Err("metadata.ownerReferences[1].kind: missing required field"),
        ),
        (
            "owner not an object",
            with(
                base_md(),
                &["metadata", "ownerReferences"],
                json!(["Cluster/c"]),
            ),
            Err(r#"metadata.ownerReferences[0]: expected an object, found "Cluster/c""#),
        ),
        (
            "owner name empty",
            with(
                base_md(),
                &["metadata", "ownerReferences"],
                json!([{"kind": "A", "name": ""}]),
            ),
            Err("metadata.ownerReferences[0].name: must not be empty"),
        ),
        (
            "spec.paused: a rollout pause, not the group's",
            with(base_md(), &["spec", "paused"], json!(true)),
            ok(|r| !r.paused),
        ),
        (
            "the paused annotation",
            with(
                base_md(),
                &["metadata", "annotations"],
                json!({"cluster.x-k8s.io/paused": ""}),
            ),
            ok(|r| r.paused),
        ),
        (
            "spec.paused false",
            with(base_md(), &["spec", "paused"], json!(false)),
            ok(|r| !r.paused),
        ),
        (
            "spec.paused string: not read (the rollout controller's field)",
            with(base_md(), &["spec", "paused"], json!("true")),
            ok(|r| !r.paused),
        ),
        (
            "paused annotation, empty value",
            with(
                base_md(),
                &["metadata", "annotations"],
                json!({"cluster.x-k8s.io/paused": ""}),
            ),
            ok(|r| r.paused),
        ),
        (
            "cluster name from label",
            with(
                without(base_md(), &["spec", "clusterName"]),
                &["metadata", "labels"],
                json!({"cluster.x-k8s.io/cluster-name": "from-label"}),
            ),
            ok(|r| r.cluster_name == "from-label"),
        ),
        (
            "empty spec.clusterName falls back to the label",
            with(
                with(base_md(), &["spec", "clusterName"], json!("")),
                &["metadata", "labels"],
                json!({"cluster.x-k8s.io/cluster-name": "from-label"}),
            ),
            ok(|r| r.cluster_name == "from-label"),
        ),
        (
            "spec.clusterName wins over the label",
            with(
                base_md(),
                &["metadata", "labels"],
                json!({"cluster.x-k8s.io/cluster-name": "other"}),
            ),
            ok(|r| r.cluster_name == "c"),
        ),
        (
            "no cluster name at all",
            without(base_md(), &["spec", "clusterName"]),
            ok(|r| r.cluster_name.is_empty()),
        ),
        (
            "clusterName number",
            with(base_md(), &["spec", "clusterName"], json!(7)),
            Err("spec.clusterName: expected a string, found 7"),
        ),
        (
            "template labels",
            with(
                base_md(),
                &["spec", "template", "metadata", "labels"],
                json!({"a": "1"}),
            ),
            ok(|r| r.template.labels == labels(&[("a", "1")])),
        ),
        (
            "template labels wrong type",
            with(
                base_md(),
                &["spec", "template", "metadata", "labels"],
                json!("a=1"),
            ),
            Err(r#"spec.template.metadata.labels: expected a map of strings, found "a=1""#),
        ),
        (
            "template spec not an object",
            with(base_md(), &["spec", "template", "spec"], json!(["x"])),
            Err("spec.template.spec: expected an object, found a list"),
        ),
        (
            "taints: non-object items and items with non-string fields are skipped",
            with(
                base_md(),
                &["spec", "template", "spec", "taints"],
                json!([
                    "a=b:NoSchedule",
                    {"key": "k", "value": "v", "effect": "NoSchedule", "propagation": "Always"},
                    7,
                    {"key": "only-key"},
                    {"key": "bad", "effect": 1},
                    null,
                    {"key": "n", "value": null, "effect": "PreferNoSchedule"}
                ]),
            ),
            ok(|r| {
                r.template.taints
                    == [
                        taint("k", "v", "NoSchedule"),
                        taint("only-key", "", ""),
                        taint("n", "", "PreferNoSchedule"),
                    ]
            }),
        ),
        (
            "taints not a list",
            with(
                base_md(),
                &["spec", "template", "spec", "taints"],
                json!("k=v:NoSchedule"),
            ),
            Err(r#"spec.template.spec.taints: expected a list, found "k=v:NoSchedule""#),
        ),
        (
            "failure domain",
            with(
                base_md(),
                &["spec", "template", "spec", "failureDomain"],
                json!("us-east-1a"),
            ),
            ok(|r| r.template.failure_domain.as_deref() == Some("us-east-1a")),
        ),
        (
            "empty failure domain",
            with(
                base_md(),
                &["spec", "template", "spec", "failureDomain"],
                json!(""),
            ),
            ok(|r| r.template.failure_domain.is_none()),
        ),
        (
            "failure domain number",
            with(
                base_md(),
                &["spec", "template", "spec", "failureDomain"],
                json!(1),
            ),
            Err("spec.template.spec.failureDomain: expected a string, found 1"),
        ),
        (
            "providerIDList is read only for MachinePools",
            with(base_md(), &["spec", "providerIDList"], json!([1])),
            ok(|r| r.provider_id_list.is_empty()),
        ),
        (
            "topology owned",
            with(
                base_md(),
                &["metadata", "labels"],
                json!({"topology.cluster.x-k8s.io/owned": ""}),
            ),
            ok(|r| r.topology.as_deref() == Some("")),
        ),
        (
            "no kind is fine",
            without(base_md(), &["kind"]),
            ok(|r| r.key.name == "md"),
        ),
        (
            "other kind",
            with(base_md(), &["kind"], json!("MachineSet")),
            Err(r#"kind: expected "MachineDeployment", found "MachineSet""#),
        ),
        (
            "kind number",
            with(base_md(), &["kind"], json!(1)),
            Err("kind: expected a string, found 1"),
        ),
        (
            "not an object",
            json!([base_md()]),
            Err("object: expected an object, found a list"),
        ),
        (
            "null",
            Value::Null,
            Err("object: expected an object, found null"),
        ),
    ];
    for (name, obj, want) in cases {
        let got = ScalableResource::from_json(ScalableKind::MachineDeployment, &keys(), &obj);
        match (want, got) {
            (Ok(check), Ok(r)) => assert!(check(&r), "{name}: unexpected view {r:#?}"),
            (Err(want), Err(e)) => assert_eq!(e.to_string(), want, "{name}"),
            (want, got) => panic!("{name}: want {:?}, got {got:?}", want.map(|_| "Ok")),
        }
    }
}

#[test]
fn cluster_name_label_follows_the_group() {
    let obj = with(
        without(base_md(), &["spec", "clusterName"]),
        &["metadata", "labels"],
        json!({"cluster.x-k8s.io/cluster-name": "default-group", "cluster.example.dev/cluster-name": "renamed"}),
    );
    let default =
        ScalableResource::from_json(ScalableKind::MachineDeployment, &keys(), &obj).unwrap();
    assert_eq!(default.cluster_name, "default-group");
    let renamed = Keys::new("cluster.example.dev");
    let r = ScalableResource::from_json(ScalableKind::MachineDeployment, &renamed, &obj).unwrap();
    assert_eq!(r.cluster_name, "renamed");
    let m = Machine::from_json(&renamed, &with(obj, &["kind"], json!("Machine"))).unwrap();
    assert_eq!(m.cluster_name, "renamed");
}

#[test]
fn machinepool_provider_id_list() {
    let mp = |list: Value| {
        let obj = with(
            with(base_md(), &["kind"], json!("MachinePool")),
            &["spec", "providerIDList"],
            list,
        );
        ScalableResource::from_json(ScalableKind::MachinePool, &keys(), &obj)
    };
    let ids = json!(["aws:///us-east-1a/i-1", "", "aws:///us-east-1b/i-2"]);
    assert_eq!(
        mp(ids).unwrap().provider_id_list,
        ["aws:///us-east-1a/i-1", "", "aws:///us-east-1b/i-2"],
        "verbatim, empty entries included"
    );
    assert_eq!(
        mp(Value::Null).unwrap().provider_id_list,
        Vec::<String>::new()
    );
    assert_eq!(
        mp(json!(["a", 1])).unwrap_err().to_string(),
        "spec.providerIDList[1]: expected a string, found 1"
    );
    assert_eq!(
        mp(json!("a")).unwrap_err().to_string(),
        r#"spec.providerIDList: expected a list, found "a""#
    );
}

/// `spec.template.spec.infrastructureRef`: v1beta2 `apiGroup`, v1beta1 `apiVersion`, and each way it
/// can be unusable (kept as `Some(Err)`: the group survives without a template).
#[test]
fn infrastructure_ref_cases() {
    const REF: [&str; 4] = ["spec", "template", "spec", "infrastructureRef"];
    let g = "infrastructure.cluster.x-k8s.io";
    type Want = Option<Result<InfraRef, &'static str>>;
    let cases: Vec<(&str, Option<Value>, Want)> = vec![
        ("absent", None, None),
        ("null", Some(Value::Null), None),
        (
            "v1beta2",
            Some(json!({"apiGroup": g, "kind": "DockerMachineTemplate", "name": "t"})),
            Some(Ok(infra(g, None, "DockerMachineTemplate", "t"))),
        ),
        (
            "v1beta1",
            Some(
                json!({"apiVersion": format!("{g}/v1beta1"), "kind": "AWSMachineTemplate", "name": "t", "namespace": "ns"}),
            ),
            Some(Ok(infra(
                g,
                Some("infrastructure.cluster.x-k8s.io/v1beta1"),
                "AWSMachineTemplate",
                "t",
            ))),
        ),
        (
            "both: the group comes from apiGroup, the version only if it is of that group",
            Some(
                json!({"apiGroup": "a.example.com", "apiVersion": "b.example.com/v1", "kind": "K", "name": "t"}),
            ),
            Some(Ok(infra("a.example.com", None, "K", "t"))),
        ),
        (
            "both, same group",
            Some(
                json!({"apiGroup": "a.example.com", "apiVersion": "a.example.com/v2", "kind": "K", "name": "t"}),
            ),
            Some(Ok(infra(
                "a.example.com",
                Some("a.example.com/v2"),
                "K",
                "t",
            ))),
        ),
        (
            "empty apiGroup falls back to apiVersion",
            Some(
                json!({"apiGroup": "", "apiVersion": "b.example.com/v1", "kind": "K", "name": "t"}),
            ),
            Some(Ok(infra(
                "b.example.com",
                Some("b.example.com/v1"),
                "K",
                "t",
            ))),
        ),
        (
            "no kind",
            Some(json!({"apiGroup": g, "name": "t"})),
            Some(Err(
                "spec.template.spec.infrastructureRef.kind: missing required field",
            )),
        ),
        (
            "empty kind",
            Some(json!({"apiGroup": g, "kind": "", "name": "t"})),
            Some(Err(
                "spec.template.spec.infrastructureRef.kind: must not be empty",
            )),
        ),
        (
            "kind number",
            Some(json!({"apiGroup": g, "kind": 5, "name": "t"})),
            Some(Err(
                "spec.template.spec.infrastructureRef.kind: expected a string, found 5",
            )),
        ),
        (
            "no name",
            Some(json!({"apiGroup": g, "kind": "K"})),
            Some(Err(
                "spec.template.spec.infrastructureRef.name: missing required field",
            )),
        ),
        (
            "neither group nor version",
            Some(json!({"kind": "K", "name": "t"})),
            Some(Err(
                "spec.template.spec.infrastructureRef: names neither apiGroup nor apiVersion",
            )),
        ),
        (
            "apiGroup number",
            Some(json!({"apiGroup": 1, "kind": "K", "name": "t"})),
            Some(Err(
                "spec.template.spec.infrastructureRef.apiGroup: expected a string, found 1",
            )),
        ),
        (
            "malformed apiVersion",
            Some(json!({"apiVersion": "a/b/c", "kind": "K", "name": "t"})),
            Some(Err(
                r#"spec.template.spec.infrastructureRef.apiVersion: expected "group/version", found "a/b/c""#,
            )),
        ),
        (
            "apiVersion without version",
            Some(json!({"apiVersion": "example.com/", "kind": "K", "name": "t"})),
            Some(Err(
                r#"spec.template.spec.infrastructureRef.apiVersion: expected "group/version", found "example.com/""#,
            )),
        ),
        (
            "not an object",
            Some(json!("DockerMachineTemplate/t")),
            Some(Err(
                r#"spec.template.spec.infrastructureRef: expected an object, found "DockerMachineTemplate/t""#,
            )),
        ),
    ];
    for (name, r, want) in cases {
        let obj = match r {
            Some(v) => with(base_md(), &REF, v),
            None => base_md(),
        };
        let got = ScalableResource::from_json(ScalableKind::MachineDeployment, &keys(), &obj)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .template
            .infrastructure_ref
            .map(|r| r.map_err(|e| e.to_string()));
        assert_eq!(got, want.map(|w| w.map_err(str::to_string)), "{name}");
    }
}

#[test]
fn split_api_version_cases() {
    let cases = [
        (
            "infrastructure.cluster.x-k8s.io/v1beta2",
            Some(("infrastructure.cluster.x-k8s.io", "v1beta2")),
        ),
        ("v1", Some(("", "v1"))),
        ("", None),
        ("/v1", None),
        ("g/", None),
        ("a/b/c", None),
    ];
    for (input, want) in cases {
        assert_eq!(split_api_version(input), want, "{input:?}");
    }
}

// -----------------------------------------------------------------------------------------------
// Machines

#[test]
fn machine_fixtures() {
    struct Row {
        file: &'static str,
        key: (&'static str, &'static str),
        cluster: &'static str,
        provider_id: Option<&'static str>,
        node_ref: Option<&'static str>,
        deleting: bool,
        phase: Option<&'static str>,
        failure: Option<(&'static str, &'static str)>,
    }
    let rows = [
        Row {
            file: "machine-v1beta2-running.json",
            key: ("team-a", "workers-md-0-5f8c9-abcde"),
            cluster: "prod",
            provider_id: Some("docker:////prod-workers-md-0-5f8c9-abcde"),
            node_ref: Some("prod-workers-md-0-5f8c9-abcde"),
            deleting: false,
            phase: Some("Running"),
            failure: None,
        },
        Row {
            file: "machine-v1beta2-failed-deprecated.json",
            key: ("team-a", "workers-md-0-5f8c9-fffff"),
            cluster: "prod",
            provider_id: None,
            node_ref: None,
            deleting: false,
            phase: Some("Provisioning"),
            failure: Some((
                "InsufficientResources",
                "Failure detected from referenced resource infrastructure.cluster.x-k8s.io/v1beta2, \
                 Kind=AWSMachine with name \"workers-md-0-5f8c9-fffff\": InsufficientInstanceCapacity",
            )),
        },
        Row {
            file: "machine-v1beta2-infra-deleted.json",
            key: ("team-a", "workers-md-0-5f8c9-ggggg"),
            cluster: "prod",
            provider_id: Some("docker:////prod-workers-md-0-5f8c9-ggggg"),
            node_ref: Some("prod-workers-md-0-5f8c9-ggggg"),
            deleting: false,
            phase: Some("Running"),
            failure: Some((
                "InfrastructureDeleted",
                "DockerMachine has been deleted while the Machine still exists",
            )),
        },
        Row {
            // InfrastructureReady=False/ObjectDoesNotExist is where every new Machine starts: not a failure.
            file: "machine-v1beta2-pending.json",
            key: ("team-a", "pool-less-xyz12"),
            cluster: "prod",
            provider_id: None,
            node_ref: None,
            deleting: false,
            phase: Some("Pending"),
            failure: None,
        },
        Row {
            // InfrastructureReady=False/ObjectDeleted during deletion is routine: not a failure.
            file: "machine-v1beta2-deleting.json",
            key: ("team-a", "workers-md-0-5f8c9-hhhhh"),
            cluster: "prod",
            provider_id: Some("docker:////prod-workers-md-0-5f8c9-hhhhh"),
            node_ref: Some("prod-workers-md-0-5f8c9-hhhhh"),
            deleting: true,
            phase: Some("Deleting"),
            failure: None,
        },
        Row {
            file: "machine-v1beta1-running.json",
            key: ("team-b", "legacy-md-7c6b5-q2w3e"),
            cluster: "legacy",
            provider_id: Some("aws:///us-west-2a/i-0aaaabbbbccccdddd"),
            node_ref: Some("ip-10-1-2-3.us-west-2.compute.internal"),
            deleting: false,
            phase: Some("Running"),
            failure: None,
        },
        Row {
            file: "machine-v1beta1-failed.json",
            key: ("team-b", "legacy-md-7c6b5-zzzzz"),
            cluster: "legacy",
            provider_id: None,
            node_ref: None,
            deleting: false,
            phase: Some("Failed"),
            failure: Some((
                "CreateError",
                "Failure detected from referenced resource infrastructure.cluster.x-k8s.io/v1beta2, \
                 Kind=AWSMachine with name \"legacy-md-7c6b5-zzzzz\": instance i-0dead terminated",
            )),
        },
    ];
    for row in rows {
        let f = row.file;
        let m = Machine::from_json(&keys(), &fixture(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert_eq!(m.key, ObjectKey::new(row.key.0, row.key.1), "{f}");
        assert!(!m.uid.is_empty() && !m.resource_version.is_empty(), "{f}");
        assert_eq!(m.cluster_name, row.cluster, "{f}");
        assert_eq!(m.provider_id.as_deref(), row.provider_id, "{f}");
        assert_eq!(m.node_ref.as_deref(), row.node_ref, "{f}");
        assert_eq!(m.deleting, row.deleting, "{f}");
        assert_eq!(m.phase.as_deref(), row.phase, "{f}");
        assert_eq!(
            m.failure,
            row.failure.map(|(reason, message)| MachineFailure {
                reason: reason.into(),
                message: message.into()
            }),
            "{f}"
        );
        assert_eq!(m.owners.len(), 1, "{f}");
        assert_eq!(m.owners[0].kind, "MachineSet", "{f}");
    }
}

fn base_machine() -> Value {
    json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "Machine",
        "metadata": {"namespace": "ns", "name": "m", "labels": {"cluster.x-k8s.io/cluster-name": "c"}},
        "spec": {"clusterName": "c"},
    })
}

#[test]
fn machine_field_cases() {
    type Check = fn(&Machine) -> bool;
    let ok = |c: Check| Ok::<Check, &str>(c);
    fn failure(m: &Machine, reason: &str, message: &str) -> bool {
        m.failure
            == Some(MachineFailure {
                reason: reason.into(),
                message: message.into(),
            })
    }
    let cond = |t: &str, s: &str, r: &str| json!({"type": t, "status": s, "reason": r, "message": "gone", "lastTransitionTime": "2026-01-01T00:00:00Z"});
    let cases: Vec<(&str, Value, Result<Check, &str>)> = vec![
        (
            "minimal",
            base_machine(),
            ok(|m| {
                m.provider_id.is_none()
                    && m.node_ref.is_none()
                    && !m.deleting
                    && m.phase.is_none()
                    && m.failure.is_none()
                    && m.cluster_name == "c"
            }),
        ),
        (
            "providerID",
            with(base_machine(), &["spec", "providerID"], json!("p://1")),
            ok(|m| m.provider_id.as_deref() == Some("p://1")),
        ),
        (
            "empty providerID",
            with(base_machine(), &["spec", "providerID"], json!("")),
            ok(|m| m.provider_id.is_none()),
        ),
        (
            "providerID number",
            with(base_machine(), &["spec", "providerID"], json!(1)),
            Err("spec.providerID: expected a string, found 1"),
        ),
        (
            "v1beta1 nodeRef",
            with(
                base_machine(),
                &["status", "nodeRef"],
                json!({"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "u"}),
            ),
            ok(|m| m.node_ref.as_deref() == Some("n1")),
        ),
        (
            "v1beta2 nodeRef",
            with(
                base_machine(),
                &["status", "nodeRef"],
                json!({"name": "n2"}),
            ),
            ok(|m| m.node_ref.as_deref() == Some("n2")),
        ),
        (
            "nodeRef without name",
            with(base_machine(), &["status", "nodeRef"], json!({})),
            ok(|m| m.node_ref.is_none()),
        ),
        (
            "nodeRef string",
            with(base_machine(), &["status", "nodeRef"], json!("n1")),
            Err(r#"status.nodeRef: expected an object, found "n1""#),
        ),
        (
            "nodeRef name number",
            with(base_machine(), &["status", "nodeRef", "name"], json!(3)),
            Err("status.nodeRef.name: expected a string, found 3"),
        ),
        (
            "status not an object",
            with(base_machine(), &["status"], json!(true)),
            Err("status: expected an object, found true"),
        ),
        (
            "deleting",
            with(
                base_machine(),
                &["metadata", "deletionTimestamp"],
                json!("2026-01-01T00:00:00Z"),
            ),
            ok(|m| m.deleting),
        ),
        (
            "deletionTimestamp null",
            with(
                base_machine(),
                &["metadata", "deletionTimestamp"],
                Value::Null,
            ),
            ok(|m| !m.deleting),
        ),
        (
            "deletionTimestamp number",
            with(base_machine(), &["metadata", "deletionTimestamp"], json!(0)),
            Err("metadata.deletionTimestamp: expected a string, found 0"),
        ),
        (
            "phase",
            with(base_machine(), &["status", "phase"], json!("Provisioned")),
            ok(|m| m.phase.as_deref() == Some("Provisioned") && m.failure.is_none()),
        ),
        (
            "phase Failed alone",
            with(base_machine(), &["status", "phase"], json!("Failed")),
            ok(|m| failure(m, "Failed", "status.phase is Failed")),
        ),
        (
            "phase number",
            with(base_machine(), &["status", "phase"], json!(1)),
            Err("status.phase: expected a string, found 1"),
        ),
        (
            "v1beta1 failureMessage alone",
            with(base_machine(), &["status", "failureMessage"], json!("boom")),
            ok(|m| failure(m, "", "boom")),
        ),
        (
            "v1beta1 failureReason alone",
            with(
                base_machine(),
                &["status", "failureReason"],
                json!("CreateError"),
            ),
            ok(|m| failure(m, "CreateError", "")),
        ),
        (
            "v1beta1 failure fields empty",
            with(
                with(base_machine(), &["status", "failureReason"], json!("")),
                &["status", "failureMessage"],
                json!(""),
            ),
            ok(|m| m.failure.is_none()),
        ),
        (
            "failureMessage number",
            with(base_machine(), &["status", "failureMessage"], json!(1)),
            Err("status.failureMessage: expected a string, found 1"),
        ),
        (
            "v1beta2 deprecated failure",
            with(
                base_machine(),
                &["status", "deprecated", "v1beta1"],
                json!({"failureReason": "UpdateError", "failureMessage": "m"}),
            ),
            ok(|m| failure(m, "UpdateError", "m")),
        ),
        (
            "deprecated wrong type",
            with(base_machine(), &["status", "deprecated"], json!([])),
            Err("status.deprecated: expected an object, found a list"),
        ),
        (
            "v1beta1 fields win over the deprecated ones",
            with(
                with(base_machine(), &["status", "failureReason"], json!("A")),
                &["status", "deprecated", "v1beta1", "failureReason"],
                json!("B"),
            ),
            ok(|m| failure(m, "A", "")),
        ),
        (
            "a failure on a deleting Machine is kept",
            with(
                with(base_machine(), &["status", "failureMessage"], json!("boom")),
                &["metadata", "deletionTimestamp"],
                json!("2026-01-01T00:00:00Z"),
            ),
            ok(|m| m.deleting && failure(m, "", "boom")),
        ),
        (
            "InfrastructureReady=False/ObjectDeleted",
            with(
                base_machine(),
                &["status", "conditions"],
                json!([cond("InfrastructureReady", "False", "ObjectDeleted")]),
            ),
            ok(|m| failure(m, "InfrastructureDeleted", "gone")),
        ),
        (
            "... without a message",
            with(
                base_machine(),
                &["status", "conditions"],
                json!([{"type": "InfrastructureReady", "status": "False", "reason": "ObjectDeleted", "message": ""}]),
            ),
            ok(|m| {
                failure(
                    m,
                    "InfrastructureDeleted",
                    "the infrastructure machine was deleted while the Machine still exists",
                )
            }),
        ),
        (
            "... in status.v1beta2.conditions of a v1beta1 Machine",
            with(
                base_machine(),
                &["status", "v1beta2", "conditions"],
                json!([cond("InfrastructureReady", "False", "ObjectDeleted")]),
            ),
            ok(|m| failure(m, "InfrastructureDeleted", "gone")),
        ),
        (
            "... but not while deleting",
            with(
                with(
                    base_machine(),
                    &["status", "conditions"],
                    json!([cond("InfrastructureReady", "False", "ObjectDeleted")]),
                ),
                &["metadata", "deletionTimestamp"],
                json!("2026-01-01T00:00:00Z"),
            ),
            ok(|m| m.deleting && m.failure.is_none()),
        ),
        (
            "InfrastructureReady=Unknown/ObjectDeleted is not a failure",
            with(
                base_machine(),
                &["status", "conditions"],
                json!([cond("InfrastructureReady", "Unknown", "ObjectDeleted")]),
            ),
            ok(|m| m.failure.is_none()),
        ),
        (
            "InfrastructureReady=False/ObjectDoesNotExist is not a failure",
            with(
                base_machine(),
                &["status", "conditions"],
                json!([cond("InfrastructureReady", "False", "ObjectDoesNotExist")]),
            ),
            ok(|m| m.failure.is_none()),
        ),
        (
            "BootstrapConfigReady=False/ObjectDeleted is not a failure",
            with(
                base_machine(),
                &["status", "conditions"],
                json!([cond("BootstrapConfigReady", "False", "ObjectDeleted")]),
            ),
            ok(|m| m.failure.is_none()),
        ),
        (
            "malformed condition items are skipped",
            with(
                base_machine(),
                &["status", "conditions"],
                json!(["x", 1, null, {"type": 1}, cond("InfrastructureReady", "False", "ObjectDeleted")]),
            ),
            ok(|m| failure(m, "InfrastructureDeleted", "gone")),
        ),
        (
            "conditions not a list",
            with(
                base_machine(),
                &["status", "conditions"],
                json!({"InfrastructureReady": "False"}),
            ),
            Err("status.conditions: expected a list, found an object"),
        ),
        (
            "a condition wins over phase Failed",
            with(
                with(
                    base_machine(),
                    &["status", "conditions"],
                    json!([cond("InfrastructureReady", "False", "ObjectDeleted")]),
                ),
                &["status", "phase"],
                json!("Failed"),
            ),
            ok(|m| failure(m, "InfrastructureDeleted", "gone")),
        ),
        (
            "owners",
            with(
                base_machine(),
                &["metadata", "ownerReferences"],
                json!([{"kind": "MachineSet", "name": "ms"}]),
            ),
            ok(|m| m.owners == [owner("MachineSet", "ms")]),
        ),
        (
            "other kind",
            with(base_machine(), &["kind"], json!("MachineSet")),
            Err(r#"kind: expected "Machine", found "MachineSet""#),
        ),
        (
            "no metadata",
            without(base_machine(), &["metadata"]),
            Err("metadata: missing required field"),
        ),
        (
            "not an object",
            json!("m"),
            Err(r#"object: expected an object, found "m""#),
        ),
    ];
    for (name, obj, want) in cases {
        match (want, Machine::from_json(&keys(), &obj)) {
            (Ok(check), Ok(m)) => assert!(check(&m), "{name}: unexpected view {m:#?}"),
            (Err(want), Err(e)) => assert_eq!(e.to_string(), want, "{name}"),
            (want, got) => panic!("{name}: want {:?}, got {got:?}", want.map(|_| "Ok")),
        }
    }
}

// -----------------------------------------------------------------------------------------------
// Infrastructure templates

#[test]
fn infra_template_fixtures() {
    let docker = InfraTemplate::from_json(&fixture("dockermachinetemplate-v1beta2.json")).unwrap();
    assert_eq!(
        docker,
        InfraTemplate {
            key: ObjectKey::new("team-a", "workers-md-0-7d9f4"),
            api_group: "infrastructure.cluster.x-k8s.io".into(),
            kind: "DockerMachineTemplate".into(),
            capacity: map(&[
                ("cpu", "2"),
                ("memory", "4Gi"),
                ("ephemeral-storage", "20Gi"),
                ("nvidia.com/gpu", "1")
            ]),
            architecture: Some("arm64".into()),
            operating_system: Some("linux".into()),
        }
    );
    let aws = InfraTemplate::from_json(&fixture("awsmachinetemplate-v1beta2.json")).unwrap();
    assert_eq!(aws.key, ObjectKey::new("team-b", "legacy-md-m5large"));
    assert_eq!(aws.kind, "AWSMachineTemplate");
    assert_eq!(aws.capacity, map(&[("cpu", "2"), ("memory", "8Gi")]));
    assert_eq!((aws.architecture, aws.operating_system), (None, None));
}

#[test]
fn infra_template_field_cases() {
    let base = || {
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
            "kind": "FooMachineTemplate",
            "metadata": {"namespace": "ns", "name": "t"},
        })
    };
    type Check = fn(&InfraTemplate) -> bool;
    let ok = |c: Check| Ok::<Check, &str>(c);
    let cases: Vec<(&str, Value, Result<Check, &str>)> = vec![
        (
            "minimal",
            base(),
            ok(|t| {
                t.capacity.is_empty()
                    && t.architecture.is_none()
                    && t.api_group == "infrastructure.cluster.x-k8s.io"
                    && t.kind == "FooMachineTemplate"
            }),
        ),
        (
            "non-string capacity values are skipped",
            with(
                base(),
                &["status", "capacity"],
                json!({"cpu": 4, "memory": "8Gi", "pods": null, "x": {}}),
            ),
            ok(|t| t.capacity == map(&[("memory", "8Gi")])),
        ),
        (
            "capacity a list",
            with(base(), &["status", "capacity"], json!(["cpu=4"])),
            Err("status.capacity: expected an object, found a list"),
        ),
        (
            "capacity null",
            with(base(), &["status", "capacity"], Value::Null),
            ok(|t| t.capacity.is_empty()),
        ),
        (
            "nodeInfo",
            with(
                base(),
                &["status", "nodeInfo"],
                json!({"architecture": "s390x", "operatingSystem": "linux", "kernel": 6}),
            ),
            ok(|t| {
                t.architecture.as_deref() == Some("s390x")
                    && t.operating_system.as_deref() == Some("linux")
            }),
        ),
        (
            "empty architecture",
            with(base(), &["status", "nodeInfo", "architecture"], json!("")),
            ok(|t| t.architecture.is_none()),
        ),
        (
            "architecture number",
            with(base(), &["status", "nodeInfo", "architecture"], json!(64)),
            Err("status.nodeInfo.architecture: expected a string, found 64"),
        ),
        (
            "nodeInfo a string",
            with(base(), &["status", "nodeInfo"], json!("linux/amd64")),
            Err(r#"status.nodeInfo: expected an object, found "linux/amd64""#),
        ),
        (
            "no apiVersion",
            without(base(), &["apiVersion"]),
            Err("apiVersion: missing required field"),
        ),
        (
            "bad apiVersion",
            with(
                base(),
                &["apiVersion"],
                json!("infrastructure.cluster.x-k8s.io/"),
            ),
            Err(
                r#"apiVersion: expected "group/version", found "infrastructure.cluster.x-k8s.io/""#,
            ),
        ),
        (
            "no kind",
            without(base(), &["kind"]),
            Err("kind: missing required field"),
        ),
        (
            "no metadata",
            without(base(), &["metadata"]),
            Err("metadata: missing required field"),
        ),
        (
            "not an object",
            json!(1),
            Err("object: expected an object, found 1"),
        ),
    ];
    for (name, obj, want) in cases {
        match (want, InfraTemplate::from_json(&obj)) {
            (Ok(check), Ok(t)) => assert!(check(&t), "{name}: unexpected view {t:#?}"),
            (Err(want), Err(e)) => assert_eq!(e.to_string(), want, "{name}"),
            (want, got) => panic!("{name}: want {:?}, got {got:?}", want.map(|_| "Ok")),
        }
    }
}

// -----------------------------------------------------------------------------------------------
// Nodes

#[test]
fn node_from_json_of_a_typed_node() {
    use k8s_openapi::api::core::v1::{Node as K8sNode, NodeSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let node = |name: Option<&str>,
                pid: Option<&str>,
                labels: Option<&[(&str, &str)]>,
                spec: bool| K8sNode {
        metadata: ObjectMeta {
            name: name.map(Into::into),
            labels: labels.map(map),
            ..Default::default()
        },
        spec: spec.then(|| NodeSpec {
            provider_id: pid.map(Into::into),
            ..Default::default()
        }),
        status: None,
    };
    let cases = [
        (
            node(
                Some("n1"),
                Some("aws:///a/i-1"),
                Some(&[("kubernetes.io/arch", "amd64")]),
                true,
            ),
            Node {
                name: "n1".into(),
                provider_id: Some("aws:///a/i-1".into()),
                labels: map(&[("kubernetes.io/arch", "amd64")])
                    .into_iter()
                    .collect(),
                cluster: None,
            },
        ),
        (
            node(Some("n2"), Some(""), None, true),
            Node {
                name: "n2".into(),
                provider_id: None,
                labels: Labels::default(),
                cluster: None,
            },
        ),
        (
            node(Some("n3"), None, None, false),
            Node {
                name: "n3".into(),
                ..Node::default()
            },
        ),
        (node(None, None, None, false), Node::default()),
    ];
    for (input, want) in cases {
        let json = serde_json::to_value(&input).unwrap();
        assert_eq!(
            Node::from_json(&Keys::default(), KEPT, &json).unwrap(),
            want
        );
    }
}

/// The Node labels the parse tests keep.
const KEPT: &[&str] = &["kubernetes.io/arch", "a"];

#[test]
fn node_from_json_reads_only_what_it_keeps() {
    let node = json!({
        "metadata": {"name": "n1", "labels": {"a": "b", "z": "not kept"}, "managedFields": [{"manager": "x"}]},
        "spec": {"providerID": "aws:///a/i-1", "taints": "not even a list"},
        "status": {"conditions": 7},
    });
    let want = Node {
        name: "n1".into(),
        provider_id: Some("aws:///a/i-1".into()),
        labels: map(&[("a", "b")]).into_iter().collect(),
        cluster: None,
    };
    let keys = Keys::default();
    assert_eq!(Node::from_json(&keys, KEPT, &node).unwrap(), want);
    let bad = json!({"metadata": {"name": "n1", "labels": {"a": 1}}});
    assert_eq!(
        Node::from_json(&keys, KEPT, &bad).unwrap_err().field,
        "metadata.labels[a]"
    );
    assert!(Node::from_json(&keys, KEPT, &json!([])).is_err());
}

/// The Cluster a Node belongs to: both annotations Cluster API syncs, under the group in use; one
/// alone, or an empty one, names none.
#[test]
fn node_cluster_comes_from_both_cluster_annotations() {
    let keys = Keys::new("test.k8s.io");
    let node = |annotations: serde_json::Value| {
        let json = json!({"metadata": {"name": "n", "annotations": annotations}});
        Node::from_json(&keys, KEPT, &json).unwrap().cluster
    };
    assert_eq!(
        node(json!({"test.k8s.io/cluster-namespace": "ns", "test.k8s.io/cluster-name": "c"})),
        Some(ObjectKey::new("ns", "c"))
    );
    assert_eq!(node(json!({"test.k8s.io/cluster-name": "c"})), None);
    assert_eq!(
        node(json!({"test.k8s.io/cluster-namespace": "ns", "test.k8s.io/cluster-name": ""})),
        None
    );
    assert_eq!(
        node(
            json!({"cluster.x-k8s.io/cluster-namespace": "ns", "cluster.x-k8s.io/cluster-name": "c"})
        ),
        None
    );
}

// -----------------------------------------------------------------------------------------------
// Malformed shapes: no panic, and every error names the field that is wrong.

/// A segment of a path into a JSON value.
#[derive(Clone, Debug)]
enum Seg {
    Key(String),
    Index(usize),
}

/// Every path to a value inside `v` (not the root itself).
fn paths(v: &Value, prefix: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                prefix.push(Seg::Key(k.clone()));
                out.push(prefix.clone());
                paths(child, prefix, out);
                prefix.pop();
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                prefix.push(Seg::Index(i));
                out.push(prefix.clone());
                paths(child, prefix, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

/// Replaces (`Some`) or removes (`None`) the value at `path`.
fn mutate(root: &Value, path: &[Seg], new: Option<&Value>) -> Value {
    let mut out = root.clone();
    let (last, parents) = path.split_last().unwrap();
    let mut current = &mut out;
    for seg in parents {
        current = match seg {
            Seg::Key(k) => &mut current[k.as_str()],
            Seg::Index(i) => &mut current[*i],
        };
    }
    match (last, new) {
        (Seg::Key(k), Some(v)) => current[k.as_str()] = v.clone(),
        (Seg::Key(k), None) => {
            current.as_object_mut().unwrap().remove(k);
        }
        (Seg::Index(i), Some(v)) => current[*i] = v.clone(),
        (Seg::Index(i), None) => {
            current.as_array_mut().unwrap().remove(*i);
        }
    }
    out
}

/// The segments of an error's field path: `a.b[key.with.dots][0].c` → a, b, key.with.dots, 0, c.
fn field_segments(field: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = field;
    while !rest.is_empty() {
        if let Some(inner) = rest.strip_prefix('[') {
            let end = inner.find(']').expect("closing bracket");
            out.push(inner[..end].to_string());
            rest = &inner[end + 1..];
        } else {
            let rest_trimmed = rest.strip_prefix('.').unwrap_or(rest);
            let end = rest_trimmed.find(['.', '[']).unwrap_or(rest_trimmed.len());
            out.push(rest_trimmed[..end].to_string());
            rest = &rest_trimmed[end..];
        }
    }
    out
}

fn seg_strings(path: &[Seg]) -> Vec<String> {
    path.iter()
        .map(|s| match s {
            Seg::Key(k) => k.clone(),
            Seg::Index(i) => i.to_string(),
        })
        .collect()
}

#[test]
fn field_segments_cases() {
    assert_eq!(field_segments("spec.replicas"), ["spec", "replicas"]);
    assert_eq!(
        field_segments("metadata.labels[cluster.x-k8s.io/cluster-name]"),
        ["metadata", "labels", "cluster.x-k8s.io/cluster-name"]
    );
    assert_eq!(
        field_segments("metadata.ownerReferences[1].kind"),
        ["metadata", "ownerReferences", "1", "kind"]
    );
}

/// All three parsers on one value; every error (including a kept infrastructureRef error) must be
/// well formed. Returns the error fields.
fn parse_all(v: &Value) -> Vec<String> {
    let mut fields = Vec::new();
    let mut record = |e: &ParseError| {
        assert!(
            !e.field.is_empty() && !e.message.is_empty(),
            "bad error {e:?}"
        );
        assert_eq!(e.to_string(), format!("{}: {}", e.field, e.message));
        fields.push(e.field.clone());
    };
    for kind in ScalableKind::ALL {
        match ScalableResource::from_json(kind, &keys(), v) {
            Ok(r) => {
                if let Some(Err(e)) = &r.template.infrastructure_ref {
                    record(e);
                }
            }
            Err(e) => record(&e),
        }
    }
    if let Err(e) = Machine::from_json(&keys(), v) {
        record(&e);
    }
    if let Err(e) = InfraTemplate::from_json(v) {
        record(&e);
    }
    fields
}

/// Every fixture, every value inside it replaced by each of a set of odd values (or removed): no
/// panic, and any error that was not there before names the changed field, a field inside it, or
/// the object holding it.
#[test]
fn fuzzish_single_mutations() {
    let odd = [
        Value::Null,
        json!(true),
        json!(0),
        json!(-1),
        json!(1.5),
        json!(1_u64 << 40),
        json!(u64::MAX),
        json!(""),
        json!("three"),
        json!("ünïcødé/🚀:="),
        json!("x".repeat(300)),
        json!([]),
        json!([1, "a", null, {}]),
        json!({}),
        json!({"a": 1, "name": [], "kind": {}}),
    ];
    let mut parsed = 0usize;
    for (name, text) in FIXTURES {
        let original: Value = serde_json::from_str(text).unwrap();
        let before: std::collections::BTreeSet<String> = parse_all(&original).into_iter().collect();
        let mut all = Vec::new();
        paths(&original, &mut Vec::new(), &mut all);
        for path in &all {
            let changed = seg_strings(path);
            for new in odd.iter().map(Some).chain([None]) {
                let v = mutate(&original, path, new);
                for field in parse_all(&v) {
                    parsed += 1;
                    if before.contains(&field) {
                        continue;
                    }
                    let got = field_segments(&field);
                    let related = got.starts_with(&changed) || changed.starts_with(&got);
                    assert!(
                        related || (field == "kind" && changed == ["kind"]),
                        "{name}: changing {changed:?} to {new:?} gave an error about {field}"
                    );
                }
            }
        }
    }
    assert!(parsed > 1000, "only {parsed} errors seen");
}

/// Deterministic pseudo-random JSON made of the keys the parsers look for: no panic, well-formed
/// errors.
#[test]
fn fuzzish_random_shapes() {
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            // xorshift64*
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }
    const KEYS: &[&str] = &[
        "apiVersion",
        "kind",
        "metadata",
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "labels",
        "annotations",
        "ownerReferences",
        "deletionTimestamp",
        "spec",
        "status",
        "replicas",
        "paused",
        "clusterName",
        "template",
        "infrastructureRef",
        "apiGroup",
        "taints",
        "key",
        "value",
        "effect",
        "failureDomain",
        "providerIDList",
        "providerID",
        "nodeRef",
        "phase",
        "failureReason",
        "failureMessage",
        "deprecated",
        "v1beta1",
        "v1beta2",
        "conditions",
        "type",
        "reason",
        "message",
        "capacity",
        "nodeInfo",
        "architecture",
        "operatingSystem",
        "cluster.x-k8s.io/paused",
        "cluster.x-k8s.io/cluster-name",
        "topology.cluster.x-k8s.io/owned",
    ];
    const STRINGS: &[&str] = &[
        "",
        "x",
        "Failed",
        "False",
        "InfrastructureReady",
        "ObjectDeleted",
        "MachineDeployment",
        "Machine",
        "MachinePool",
        "MachineSet",
        "g/v",
        "a/b/c",
        "/",
        "v1",
        "2026-01-01T00:00:00Z",
        "💥",
    ];
    fn random_value(rng: &mut Rng, depth: usize) -> Value {
        let choice = if depth == 0 {
            rng.below(6)
        } else {
            rng.below(9)
        };
        match choice {
            0 => Value::Null,
            1 => json!(rng.below(2) == 0),
            2 => json!(rng.next() as i64),
            3 => json!((rng.next() % 1000) as f64 / 7.0),
            4 | 5 => json!(STRINGS[rng.below(STRINGS.len())]),
            6 => Value::Array(
                (0..rng.below(4))
                    .map(|_| random_value(rng, depth - 1))
                    .collect(),
            ),
            _ => Value::Object(
                (0..rng.below(6))
                    .map(|_| {
                        (
                            KEYS[rng.below(KEYS.len())].to_string(),
                            random_value(rng, depth - 1),
                        )
                    })
                    .collect(),
            ),
        }
    }
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut ok = 0;
    for _ in 0..20_000 {
        let mut v = random_value(&mut rng, 6);
        // Often give it a readable skeleton so that the parsers get past metadata.
        if rng.below(2) == 0 && v.is_object() {
            v["metadata"] = json!({"namespace": "ns", "name": "n"});
            if rng.below(2) == 0 {
                v["apiVersion"] = json!("g/v1");
                v["kind"] = json!("K");
            }
        }
        if parse_all(&v).len() < 5 {
            ok += 1;
        }
    }
    assert!(
        ok > 100,
        "the generator should reach successful parses too ({ok})"
    );
}

/// A MachineSet's preflight hold, wherever the API version keeps the conditions; other kinds have
/// none, and malformed entries are skipped.
#[test]
fn machine_set_preflight_holds_are_read_from_every_condition_list() {
    let message =
        "StandInControlPlane ns/w is upgrading (\"ControlPlaneIsStable\" preflight check failed)";
    let created = json!([{"type": "MachinesCreated", "status": "False", "reason": "PreflightCheckFailed", "message": message}]);
    let scaling = json!([{"type": "ScalingUp", "status": "True", "reason": "ScalingUp",
        "message": format!("Scaling up from 0 to 1 replicas is blocked because:\n* {message}")}]);
    let ms = |version: &str, status: Value| {
        json!({
            "apiVersion": format!("cluster.x-k8s.io/{version}"), "kind": "MachineSet",
            "metadata": {"namespace": "ns", "name": "ms"},
            "spec": {"clusterName": "c", "replicas": 1, "template": {"spec": {}}},
            "status": status,
        })
    };
    let hold = |obj: &Value, kind: ScalableKind| {
        ScalableResource::from_json(kind, &keys(), obj)
            .unwrap()
            .preflight
            .map(|h| h.checks)
    };
    let checks = Some(vec!["ControlPlaneIsStable".to_string()]);
    for obj in [
        ms("v1beta2", json!({"conditions": scaling})),
        ms(
            "v1beta2",
            json!({"deprecated": {"v1beta1": {"conditions": created}}}),
        ),
        ms("v1beta1", json!({"conditions": created})),
        ms("v1beta1", json!({"v1beta2": {"conditions": scaling}})),
    ] {
        assert_eq!(hold(&obj, ScalableKind::MachineSet), checks, "{obj}");
    }
    let mut md = ms("v1beta2", json!({"conditions": scaling}));
    md["kind"] = json!("MachineDeployment");
    assert_eq!(hold(&md, ScalableKind::MachineDeployment), None);
    let odd = ms(
        "v1beta2",
        json!({"conditions": [1, {"type": 2}, {"type": "ScalingUp", "status": "True"}]}),
    );
    assert_eq!(hold(&odd, ScalableKind::MachineSet), None);
}
