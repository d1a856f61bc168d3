//! Unit tests of `template`.

use super::labels::gpu_label_value;
use super::*;
use crate::capi::Labels;
use crate::capi::names::is_label_value;
use crate::capi::{GPU_LABEL, InfraRef, MachineTemplate, ObjectKey, ScalableKind, capacity};

const GROUP: &str = "MachineDeployment/default/md-0";
const OBJ: &str = "MachineDeployment default/md-0";
const TPL_OBJ: &str = "DockerMachineTemplate default/md-0-tpl";

fn resource(annotations: &[(&str, &str)], replicas: i32) -> ScalableResource {
    ScalableResource {
        kind: ScalableKind::MachineDeployment,
        key: ObjectKey::new("default", "md-0"),
        uid: "uid".to_string(),
        resource_version: "1".to_string(),
        labels: Labels::default(),
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        cluster_name: "c".to_string(),
        replicas: Some(replicas),
        status_replicas: None,
        generation: None,
        observed_generation: None,
        rolling_out: false,
        preflight: None,
        paused: false,
        owners: Vec::new(),
        template: MachineTemplate {
            labels: Labels::default(),
            infrastructure_ref: Some(Ok(InfraRef {
                api_group: "infrastructure.cluster.x-k8s.io".to_string(),
                api_version: None,
                kind: "DockerMachineTemplate".to_string(),
                name: "md-0-tpl".to_string(),
            })),
            taints: Vec::new(),
            failure_domain: None,
        },
        provider_id_list: Vec::new(),
        topology: None,
    }
}

fn infra(capacity: &[(&str, &str)], arch: Option<&str>, os: Option<&str>) -> InfraTemplate {
    InfraTemplate {
        key: ObjectKey::new("default", "md-0-tpl"),
        api_group: "infrastructure.cluster.x-k8s.io".to_string(),
        kind: "DockerMachineTemplate".to_string(),
        capacity: capacity
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        architecture: arch.map(str::to_string),
        operating_system: os.map(str::to_string),
    }
}

fn run(r: &ScalableResource, infra: InfraSource) -> TemplateOutcome {
    run_with(r, infra, None, None)
}

fn run_with(
    r: &ScalableResource,
    infra: InfraSource,
    node_labels: Option<&BTreeMap<String, String>>,
    default_arch: Option<&str>,
) -> TemplateOutcome {
    build(&TemplateInputs {
        group_id: GROUP,
        resource: r,
        infra,
        node_labels,
        default_arch,
        failure_domain_zone: None,
    })
}

fn capacity_of(t: &TemplateNode) -> BTreeMap<String, String> {
    t.node
        .status
        .as_ref()
        .and_then(|s| s.capacity.as_ref())
        .map(|c| c.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect())
        .unwrap_or_default()
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn annotations_only() {
    let r = resource(
        &[
            (capacity::CPU, "4"),
            (capacity::MEMORY, "16Gi"),
            (capacity::EPHEMERAL_DISK, "100Gi"),
            (capacity::GPU_TYPE, "nvidia.com/gpu"),
            (capacity::GPU_COUNT, "2"),
            (capacity::MAX_PODS, "200"),
        ],
        0,
    );
    let out = run(&r, InfraSource::NoReference);
    assert!(out.problems.is_empty(), "{:?}", out.problems);
    let t = out.template.expect("template");
    assert_eq!(
        capacity_of(&t),
        map(&[
            ("cpu", "4"),
            ("memory", "16Gi"),
            ("ephemeral-storage", "100Gi"),
            ("nvidia.com/gpu", "2"),
            ("pods", "200")
        ])
    );
    let s = &t.summary;
    assert_eq!(s.capacity_source, CapacitySource::Annotations);
    assert_eq!((s.cpu.as_str(), s.cpu_cores), ("4", 4.0));
    assert_eq!((s.memory.as_str(), s.memory_gib), ("16Gi", 16.0));
    assert_eq!(s.ephemeral_storage.as_deref(), Some("100Gi"));
    assert_eq!(s.pods, 200);
    assert_eq!(s.gpu, Some(("nvidia.com/gpu".to_string(), 2)));
    assert_eq!(
        s.labels.get(GPU_LABEL).map(String::as_str),
        Some("nvidia.com-gpu")
    );
    assert_eq!(s.arch, "amd64");
    assert_eq!(s.os, "linux");
    // status
    let status = t.node.status.as_ref().expect("status");
    assert_eq!(status.capacity, status.allocatable);
    let conditions: Vec<(String, String)> = status
        .conditions
        .iter()
        .flatten()
        .map(|c| (c.type_.clone(), c.status.clone()))
        .collect();
    assert_eq!(
        conditions,
        [
            ("Ready", "True"),
            ("MemoryPressure", "False"),
            ("DiskPressure", "False"),
            ("PIDPressure", "False"),
            ("NetworkUnavailable", "False")
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()))
    );
    let info = status.node_info.as_ref().expect("nodeInfo");
    assert_eq!(
        (info.architecture.as_str(), info.operating_system.as_str()),
        ("amd64", "linux")
    );
    // metadata
    let name = t.node.metadata.name.clone().unwrap_or_default();
    assert_eq!(name, s.name);
    assert!(name.starts_with("md-0-template-"), "{name}");
    assert_eq!(s.labels.get(LABEL_HOSTNAME), Some(&name));
    assert_eq!(
        t.node.metadata.annotations,
        Some(map(&[(NODE_GROUP_ANNOTATION, GROUP)]))
    );
    assert!(
        t.node
            .spec
            .as_ref()
            .is_some_and(|s| s.taints.is_none() && s.provider_id.is_none())
    );
}

#[test]
fn annotations_override_template_key_by_key() {
    let r = resource(
        &[
            (capacity::MEMORY, "32Gi"),
            (capacity::GPU_TYPE, "nvidia.com/gpu"),
            (capacity::GPU_COUNT, "1"),
        ],
        0,
    );
    let tpl = infra(
        &[
            ("cpu", "8"),
            ("memory", "16Gi"),
            ("ephemeral-storage", "50Gi"),
            ("pods", "58"),
        ],
        Some("arm64"),
        Some("linux"),
    );
    let out = run(&r, InfraSource::Found(&tpl));
    assert!(out.problems.is_empty(), "{:?}", out.problems);
    let t = out.template.expect("template");
    assert_eq!(
        capacity_of(&t),
        map(&[
            ("cpu", "8"),
            ("memory", "32Gi"),
            ("ephemeral-storage", "50Gi"),
            ("nvidia.com/gpu", "1"),
            // the template's pods are kept when maxPods is not annotated
            ("pods", "58")
        ])
    );
    assert_eq!(t.summary.pods, 58);
    assert_eq!(
        t.summary.capacity_source,
        CapacitySource::Both("DockerMachineTemplate/md-0-tpl".to_string())
    );
    assert_eq!(t.summary.arch, "arm64");
    assert_eq!(
        t.summary.labels.get(LABEL_ARCH).map(String::as_str),
        Some("arm64")
    );
}

#[test]
fn template_only_and_max_pods() {
    let tpl = infra(&[("cpu", "2"), ("memory", "4Gi")], None, None);
    // (maxPods annotation, pods, source)
    let cases = [
        (
            None,
            "110",
            CapacitySource::InfraTemplate("DockerMachineTemplate/md-0-tpl".to_string()),
        ),
        (
            Some(""),
            "110",
            CapacitySource::InfraTemplate("DockerMachineTemplate/md-0-tpl".to_string()),
        ),
        (
            Some("0"),
            "110",
            CapacitySource::InfraTemplate("DockerMachineTemplate/md-0-tpl".to_string()),
        ),
        (
            Some("30"),
            "30",
            CapacitySource::Both("DockerMachineTemplate/md-0-tpl".to_string()),
        ),
    ];
    for (max_pods, pods, source) in cases {
        let ann: Vec<(&str, &str)> = max_pods
            .map(|v| (capacity::MAX_PODS, v))
            .into_iter()
            .collect();
        let r = resource(&ann, 0);
        let out = run(&r, InfraSource::Found(&tpl));
        assert!(out.problems.is_empty(), "{max_pods:?}: {:?}", out.problems);
        let t = out.template.expect("template");
        assert_eq!(
            capacity_of(&t).get("pods").map(String::as_str),
            Some(pods),
            "{max_pods:?}"
        );
        assert_eq!(t.summary.capacity_source, source, "{max_pods:?}");
    }
}

#[test]
fn malformed_values_are_problems_and_ignored() {
    // (annotations, template capacity, expected (object, field) of problems, template expected)
    type Case<'a> = (
        &'a [(&'a str, &'a str)],
        &'a [(&'a str, &'a str)],
        Vec<(&'a str, String)>,
        bool,
    );
    let cases: Vec<Case> = vec![
        (
            &[(capacity::CPU, "four"), (capacity::MEMORY, "8Gi")],
            &[("cpu", "2")],
            vec![(OBJ, Problem::annotation_field(capacity::CPU))],
            true, // the template's cpu is used
        ),
        (
            &[],
            &[("cpu", "2"), ("memory", "lots"), ("nvidia.com/gpu", "-1")],
            vec![
                (TPL_OBJ, "status.capacity[memory]".to_string()),
                (TPL_OBJ, "status.capacity[nvidia.com/gpu]".to_string()),
                (OBJ, Problem::annotation_field(capacity::MEMORY)),
            ],
            false,
        ),
        (
            &[
                (capacity::CPU, "1"),
                (capacity::MEMORY, "1Gi"),
                (capacity::EPHEMERAL_DISK, "-5Gi"),
            ],
            &[],
            vec![(OBJ, Problem::annotation_field(capacity::EPHEMERAL_DISK))],
            true,
        ),
        (
            &[
                (capacity::CPU, "1"),
                (capacity::MEMORY, "1Gi"),
                (capacity::MAX_PODS, "13Mi"),
            ],
            &[],
            vec![(OBJ, Problem::annotation_field(capacity::MAX_PODS))],
            true,
        ),
        (
            &[
                (capacity::CPU, "1"),
                (capacity::MEMORY, "1Gi"),
                (capacity::MAX_PODS, "-3"),
            ],
            &[],
            vec![(OBJ, Problem::annotation_field(capacity::MAX_PODS))],
            true,
        ),
        (
            &[
                (capacity::CPU, "1"),
                (capacity::MEMORY, "1Gi"),
                (capacity::GPU_TYPE, "nvidia.com/gpu"),
                (capacity::GPU_COUNT, "two"),
            ],
            &[],
            vec![(OBJ, Problem::annotation_field(capacity::GPU_COUNT))],
            true,
        ),
        (
            &[
                (capacity::CPU, "1"),
                (capacity::MEMORY, "1Gi"),
                (capacity::GPU_TYPE, "nvidia.com/gpu"),
            ],
            &[],
            vec![(OBJ, Problem::annotation_field(capacity::GPU_COUNT))],
            true,
        ),
        (
            &[
                (capacity::CPU, "1"),
                (capacity::MEMORY, "1Gi"),
                (capacity::GPU_COUNT, "2"),
            ],
            &[],
            vec![(OBJ, Problem::annotation_field(capacity::GPU_TYPE))],
            true,
        ),
        (
            &[
                (capacity::CPU, "1"),
                (capacity::MEMORY, "1Gi"),
                (capacity::GPU_TYPE, "nvidia gpu"),
                (capacity::GPU_COUNT, "2"),
            ],
            &[],
            vec![(OBJ, Problem::annotation_field(capacity::GPU_TYPE))],
            true,
        ),
        (
            &[(capacity::CPU, "1"), (capacity::MEMORY, "1Gi")],
            &[("bad name!", "1")],
            vec![(TPL_OBJ, "status.capacity[bad name!]".to_string())],
            true,
        ),
    ];
    for (i, (ann, cap, want, has_template)) in cases.into_iter().enumerate() {
        let r = resource(ann, 0);
        let tpl = infra(cap, None, None);
        let out = run(&r, InfraSource::Found(&tpl));
        let got: Vec<(String, String)> = out
            .problems
            .iter()
            .map(|p| (p.object.to_string(), p.field.clone()))
            .collect();
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(o, f)| (o.to_string(), f.clone()))
            .collect();
        assert_eq!(got, want, "case {i}: {:?}", out.problems);
        assert_eq!(out.template.is_some(), has_template, "case {i}");
        if let Some(t) = out.template {
            let c = capacity_of(&t);
            assert!(
                c.keys().all(|k| k == "cpu" || k == "memory" || k == "pods"),
                "case {i}: {c:?}"
            );
        }
    }
}

#[test]
fn no_cpu_or_memory_gives_no_template() {
    // (annotations, replicas, problem expected)
    type Case<'a> = (&'a [(&'a str, &'a str)], i32, bool);
    let cases: [Case; 6] = [
        (&[], 0, true),
        (&[], 3, false),
        (&[(capacity::CPU, "2")], 0, true),
        (&[(capacity::MEMORY, "2Gi")], 0, true),
        (&[(capacity::CPU, "0"), (capacity::MEMORY, "2Gi")], 0, true),
        (
            &[(capacity::CPU, "2"), (capacity::MAX_PODS, "10")],
            2,
            false,
        ),
    ];
    for (i, (ann, replicas, problem)) in cases.into_iter().enumerate() {
        let r = resource(ann, replicas);
        let out = run(&r, InfraSource::NoReference);
        assert!(out.template.is_none(), "case {i}");
        assert_eq!(
            out.problems.len(),
            usize::from(problem),
            "case {i}: {:?}",
            out.problems
        );
        if let Some(p) = out.problems.first() {
            assert_eq!(p.object, OBJ);
            assert!(
                p.message
                    .starts_with("zero-size group has no cpu/memory capacity"),
                "{}",
                p.message
            );
            assert!(
                p.message.contains("DockerMachineTemplate default/md-0-tpl"),
                "{}",
                p.message
            );
        }
    }
}

#[test]
fn unavailable_template_uses_annotations() {
    let r = resource(&[(capacity::CPU, "2"), (capacity::MEMORY, "4Gi")], 0);
    let out = run(
        &r,
        InfraSource::Unavailable {
            reason: "forbidden: cannot list dockermachinetemplates".to_string(),
        },
    );
    assert_eq!(out.problems.len(), 1, "{:?}", out.problems);
    let p = &out.problems[0];
    assert_eq!(p.object, OBJ);
    assert_eq!(p.field, "spec.template.spec.infrastructureRef");
    assert!(
        p.message.contains("DockerMachineTemplate default/md-0-tpl"),
        "{}",
        p.message
    );
    assert!(p.message.contains("forbidden"), "{}", p.message);
    let t = out.template.expect("template from annotations");
    assert_eq!(t.summary.capacity_source, CapacitySource::Annotations);

    // and without annotations: two problems, no template
    let r = resource(&[], 0);
    let out = run(
        &r,
        InfraSource::Unavailable {
            reason: "not found".to_string(),
        },
    );
    assert!(out.template.is_none());
    assert_eq!(out.problems.len(), 2, "{:?}", out.problems);
}

#[test]
fn arch_and_os() {
    // (template nodeInfo arch, os, default arch, node label arch, want arch, want os, problems)
    let cases = [
        (
            Some("arm64"),
            Some("linux"),
            None,
            None,
            "arm64",
            "linux",
            0,
        ),
        (
            Some("arm64"),
            Some("windows"),
            Some("s390x"),
            None,
            "arm64",
            "windows",
            0,
        ),
        (None, None, None, None, "amd64", "linux", 0),
        (Some(""), Some(""), None, None, "amd64", "linux", 0),
        (None, None, Some("arm64"), None, "arm64", "linux", 0),
        (None, None, Some("ppc64le"), None, "ppc64le", "linux", 0),
        (None, None, Some(""), None, "amd64", "linux", 0),
        (None, None, Some("ARM64"), None, "amd64", "linux", 1),
        (None, None, Some("riscv64"), None, "amd64", "linux", 1),
        // an invalid default that is not used is not reported here
        (
            Some("arm64"),
            None,
            Some("riscv64"),
            None,
            "arm64",
            "linux",
            0,
        ),
        // a real node wins
        (
            Some("amd64"),
            None,
            None,
            Some("arm64"),
            "arm64",
            "linux",
            0,
        ),
    ];
    for (i, (ta, to, def, node_arch, want_arch, want_os, n_problems)) in
        cases.into_iter().enumerate()
    {
        let r = resource(&[(capacity::CPU, "1"), (capacity::MEMORY, "1Gi")], 0);
        let tpl = infra(&[], ta, to);
        let node_labels = node_arch.map(|a| map(&[(LABEL_ARCH, a)]));
        let out = run_with(&r, InfraSource::Found(&tpl), node_labels.as_ref(), def);
        assert_eq!(
            out.problems.len(),
            n_problems,
            "case {i}: {:?}",
            out.problems
        );
        if let Some(p) = out.problems.first() {
            assert_eq!(p.field, "CAPI_SCALE_ZERO_DEFAULT_ARCH");
        }
        let t = out.template.expect("template");
        assert_eq!(
            (t.summary.arch.as_str(), t.summary.os.as_str()),
            (want_arch, want_os),
            "case {i}"
        );
        let labels = &t.summary.labels;
        assert_eq!(
            labels.get(LABEL_ARCH).map(String::as_str),
            Some(want_arch),
            "case {i}"
        );
        assert_eq!(
            labels.get(LABEL_OS).map(String::as_str),
            Some(want_os),
            "case {i}"
        );
        let info = t
            .node
            .status
            .as_ref()
            .and_then(|s| s.node_info.as_ref())
            .expect("nodeInfo");
        assert_eq!(info.architecture, want_arch, "case {i}");
    }
    assert_eq!(default_arch(Some("s390x")), ("s390x", None));
    assert!(default_arch(Some("x86_64")).1.is_some());
}

#[test]
fn label_precedence() {
    let mut r = resource(
        &[
            (capacity::CPU, "1"),
            (capacity::MEMORY, "1Gi"),
            (
                capacity::LABELS,
                "node-role.kubernetes.io/worker=annotation, team=a,,bad,kubernetes.io/os=linux2,topology.kubernetes.io/zone=ann-zone, =x,k=bad value,toolong=aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            ),
        ],
        0,
    );
    r.template.labels = Labels::from(map(&[
        ("node-role.kubernetes.io/worker", "template"),
        ("node-role.kubernetes.io/gpu", ""),
        ("prefixed.node-role.kubernetes.io/x", "dropped"),
        ("node-restriction.kubernetes.io/a", "kept"),
        ("foo.node-restriction.kubernetes.io/b", "kept"),
        ("node.cluster.x-k8s.io/c", "kept"),
        ("bar.node.cluster.x-k8s.io/d", "kept"),
        ("xnode.cluster.x-k8s.io/e", "dropped"),
        ("app", "dropped"),
        ("cluster.x-k8s.io/cluster-name", "dropped"),
    ]));
    r.template.failure_domain = Some("fd-1".to_string());
    let node_labels = map(&[
        (LABEL_ARCH, "arm64"),
        (LABEL_OS, ""),
        ("node.kubernetes.io/instance-type", "m5.large"),
        ("beta.kubernetes.io/instance-type", "m5.large"),
        ("topology.kubernetes.io/region", "eu-west-1"),
        ("failure-domain.beta.kubernetes.io/region", "eu-west-1"),
        ("failure-domain.beta.kubernetes.io/zone", "eu-west-1b"),
        (LABEL_ZONE, "eu-west-1b"),
        ("unrelated", "x"),
    ]);
    let out = run_with(&r, InfraSource::NoReference, Some(&node_labels), None);
    let fields: Vec<&str> = out.problems.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(
        fields,
        vec![Problem::annotation_field(capacity::LABELS).as_str(); 4],
        "{:?}",
        out.problems
    );
    let t = out.template.expect("template");
    let name = t.summary.name.clone();
    let want = map(&[
        (LABEL_ARCH, "arm64"),
        (LABEL_OS, "linux2"),
        (LABEL_HOSTNAME, &name),
        (LABEL_ZONE, "eu-west-1b"),
        ("failure-domain.beta.kubernetes.io/zone", "eu-west-1b"),
        ("node.kubernetes.io/instance-type", "m5.large"),
        ("beta.kubernetes.io/instance-type", "m5.large"),
        ("topology.kubernetes.io/region", "eu-west-1"),
        ("failure-domain.beta.kubernetes.io/region", "eu-west-1"),
        ("node-role.kubernetes.io/worker", "annotation"),
        ("node-role.kubernetes.io/gpu", ""),
        ("node-restriction.kubernetes.io/a", "kept"),
        ("foo.node-restriction.kubernetes.io/b", "kept"),
        ("node.cluster.x-k8s.io/c", "kept"),
        ("bar.node.cluster.x-k8s.io/d", "kept"),
        ("team", "a"),
    ]);
    assert_eq!(t.summary.labels, want);
    assert_eq!(t.node.metadata.labels.as_ref(), Some(&want));

    // without node labels: the failure domain, overridden by the annotation
    let out = run(&r, InfraSource::NoReference);
    let t = out.template.expect("template");
    assert_eq!(
        t.summary.labels.get(LABEL_ZONE).map(String::as_str),
        Some("ann-zone")
    );
    r.annotations.remove(capacity::LABELS);
    let t = run(&r, InfraSource::NoReference)
        .template
        .expect("template");
    assert_eq!(
        t.summary.labels.get(LABEL_ZONE).map(String::as_str),
        Some("fd-1")
    );
    assert_eq!(
        t.summary.labels.get(LABEL_ARCH).map(String::as_str),
        Some("amd64")
    );
}

#[test]
fn gpu_label() {
    // (gpu-type, labels annotation, want label)
    let cases = [
        ("nvidia.com/gpu", None, Some("nvidia.com-gpu")),
        ("nvidia-tesla-t4", None, None), // not a valid extended resource name → problem, no GPU
        (
            "example.com/nvidia-tesla-t4",
            Some("cluster-api/accelerator=nvidia-tesla-t4"),
            Some("nvidia-tesla-t4"),
        ),
    ];
    for (gpu_type, labels, want) in cases {
        let mut ann = vec![
            (capacity::CPU, "1"),
            (capacity::MEMORY, "1Gi"),
            (capacity::GPU_TYPE, gpu_type),
            (capacity::GPU_COUNT, "1"),
        ];
        if let Some(l) = labels {
            ann.push((capacity::LABELS, l));
        }
        let r = resource(&ann, 0);
        let t = run(&r, InfraSource::NoReference)
            .template
            .expect("template");
        assert_eq!(
            t.summary.labels.get(GPU_LABEL).map(String::as_str),
            want,
            "{gpu_type}"
        );
    }
    // a GPU from the template's capacity is summarised and labelled too
    let r = resource(&[], 0);
    let tpl = infra(
        &[("cpu", "8"), ("memory", "32Gi"), ("nvidia.com/gpu", "4")],
        None,
        None,
    );
    let t = run(&r, InfraSource::Found(&tpl))
        .template
        .expect("template");
    assert_eq!(t.summary.gpu, Some(("nvidia.com/gpu".to_string(), 4)));
    assert_eq!(
        t.summary.labels.get(GPU_LABEL).map(String::as_str),
        Some("nvidia.com-gpu")
    );
    // fractional counts of whole-unit resources are problems, and left out
    let tpl = infra(
        &[
            ("cpu", "1500m"),
            ("memory", "1Gi"),
            ("nvidia.com/gpu", "1500m"),
            ("pods", "10500m"),
        ],
        None,
        None,
    );
    let out = run(&r, InfraSource::Found(&tpl));
    let t = out.template.expect("template");
    assert_eq!(t.summary.gpu, None);
    assert_eq!(t.summary.pods, DEFAULT_MAX_PODS);
    assert_eq!(t.summary.cpu, "1500m");
    let fields: Vec<&str> = out.problems.iter().map(|p| p.field.as_str()).collect();
    assert!(
        fields.contains(&"status.capacity[nvidia.com/gpu]"),
        "{fields:?}"
    );
    assert!(fields.contains(&"status.capacity[pods]"), "{fields:?}");
}

fn taint(k: &str, v: &str, e: &str) -> Taint {
    Taint {
        key: k.to_string(),
        value: v.to_string(),
        effect: e.to_string(),
    }
}

#[test]
fn taints() {
    let mut r = resource(
        &[
            (capacity::CPU, "1"),
            (capacity::MEMORY, "1Gi"),
            (
                capacity::TAINTS,
                "dedicated=gpu:NoSchedule, spot:PreferNoSchedule,key=value,a=b:Sometimes,bad key=v:NoSchedule,k=bad value:NoExecute,,x=y:NoExecute,dedicated=ml:NoExecute",
            ),
        ],
        0,
    );
    r.template.taints = vec![
        taint("dedicated", "infra", "NoSchedule"),
        taint("example.com/maintenance", "", "NoExecute"),
        taint("broken", "", "Never"),
    ];
    let out = run(&r, InfraSource::NoReference);
    let fields: Vec<String> = out.problems.iter().map(|p| p.field.clone()).collect();
    let ann_field = Problem::annotation_field(capacity::TAINTS);
    assert_eq!(
        fields,
        vec![
            "spec.template.spec.taints[2]".to_string(),
            ann_field.clone(),
            ann_field.clone(),
            ann_field.clone(),
            ann_field
        ],
        "{:?}",
        out.problems
    );
    let t = out.template.expect("template");
    let want = vec![
        taint("dedicated", "gpu", "NoSchedule"), // replaced in place: same key and effect
        taint("example.com/maintenance", "", "NoExecute"),
        taint("spot", "", "PreferNoSchedule"),
        taint("x", "y", "NoExecute"),
        taint("dedicated", "ml", "NoExecute"), // same key, other effect: appended
    ];
    assert_eq!(t.summary.taints, want);
    let node_taints: Vec<(String, Option<String>, String)> = t
        .node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|t| (t.key, t.value, t.effect))
        .collect();
    assert_eq!(
        node_taints[1],
        (
            "example.com/maintenance".to_string(),
            None,
            "NoExecute".to_string()
        )
    );
    assert_eq!(node_taints.len(), 5);
    let json = serde_json::to_value(
        t.summary
            .taints
            .iter()
            .map(taint_string)
            .collect::<Vec<_>>(),
    )
    .unwrap_or_default();
    assert_eq!(json[0], "dedicated=gpu:NoSchedule");
    assert_eq!(json[2], "spot:PreferNoSchedule");
}

#[test]
fn names() {
    let a = node_name("md-0", "MachineDeployment/default/md-0");
    let b = node_name("md-0", "MachineDeployment/other/md-0");
    let c = node_name("md-0", "MachineSet/default/md-0");
    assert_ne!(a, b);
    assert_ne!(a, c);
    assert_eq!(a, node_name("md-0", "MachineDeployment/default/md-0"));
    let long = node_name(&"x".repeat(253), "g");
    assert_eq!(long.len(), 63);
    assert!(
        is_label_value(&long) && crate::capi::names::is_dns1123_subdomain(&long),
        "{long}"
    );
    let odd = node_name("-.Weird_Name.-", "g");
    assert!(odd.starts_with("weirdname-template-"), "{odd}");
    assert!(node_name("", "g").starts_with("node-template-"));
}

#[test]
fn gpu_label_values() {
    assert_eq!(gpu_label_value("nvidia.com/gpu"), "nvidia.com-gpu");
    assert_eq!(gpu_label_value("nvidia-t4"), "nvidia-t4");
}

#[test]
fn node_serializes_as_yaml() {
    let r = resource(&[(capacity::CPU, "1"), (capacity::MEMORY, "1Gi")], 0);
    let t = run(&r, InfraSource::NoReference)
        .template
        .expect("template");
    let yaml = serde_norway::to_string(&t.node).unwrap_or_default();
    assert!(yaml.contains("kind: Node"), "{yaml}");
    assert!(
        yaml.contains("cpu: '1'") || yaml.contains("cpu: \"1\""),
        "{yaml}"
    );
    let json = serde_json::to_value(&t.summary).unwrap_or_default();
    assert_eq!(json["cpu"], "1");
    assert_eq!(json["memory_gib"], 1.0);
    assert_eq!(json["capacity_source"], "annotations");
}

#[test]
fn hostile_input_does_not_panic() {
    let weird = [
        "",
        ":",
        "=",
        "==:",
        "a=b=c:NoSchedule",
        "\u{0}",
        "é=é:é",
        ",,,",
        "k=v:NoSchedule:x",
        "🦀",
    ];
    for w in weird {
        let mut r = resource(
            &[
                (capacity::CPU, w),
                (capacity::MEMORY, w),
                (capacity::EPHEMERAL_DISK, w),
                (capacity::GPU_TYPE, w),
                (capacity::GPU_COUNT, w),
                (capacity::MAX_PODS, w),
                (capacity::LABELS, w),
                (capacity::TAINTS, w),
            ],
            0,
        );
        r.key.name = w.into();
        r.template.failure_domain = Some(w.to_string());
        r.template.labels = Labels::from(map(&[(w, w)]));
        r.template.taints = vec![taint(w, w, w)];
        let tpl = infra(&[(w, w), ("cpu", w)], Some(w), Some(w));
        let nl = map(&[(LABEL_ARCH, w)]);
        let _ = run_with(&r, InfraSource::Found(&tpl), Some(&nl), Some(w));
        let _ = run_with(
            &r,
            InfraSource::Unavailable {
                reason: w.to_string(),
            },
            None,
            Some(w),
        );
    }
}

#[test]
fn annotations_the_protocol_cannot_carry_are_problems_that_say_why() {
    let r = resource(
        &[
            (capacity::CPU, "2"),
            (capacity::MEMORY, "4Gi"),
            (capacity::DRA_DRIVER, "gpu.nvidia.com"),
            (capacity::GPU_COUNT, "1"),
            (capacity::CSI_DRIVER, "ebs.csi.aws.com=25"),
        ],
        0,
    );
    let out = run(&r, InfraSource::NoReference);
    // The template is still built from what can be carried.
    assert!(out.template.is_some());
    let dra = out
        .problems
        .iter()
        .find(|p| p.field == Problem::annotation_field(capacity::DRA_DRIVER))
        .expect("a dra-driver problem");
    assert_eq!(dra.object, OBJ);
    assert!(dra.message.contains("kubernetes/autoscaler#10277"), "{dra}");
    assert!(dra.message.contains("without DRA devices"), "{dra}");
    assert!(
        !dra.message.contains("gpu-type"),
        "no advice to set gpu-type: {dra}"
    );
    let csi = out
        .problems
        .iter()
        .find(|p| p.field == Problem::annotation_field(capacity::CSI_DRIVER))
        .expect("a csi-driver problem");
    assert!(csi.message.contains("kubernetes/autoscaler#10131"), "{csi}");
    assert!(csi.message.contains("without a CSINode"), "{csi}");
}

#[test]
fn annotations_the_protocol_cannot_carry_are_reported_without_a_template_too() {
    // Unsized (no cpu, no memory) at zero: the dra-driver problem is still there.
    let r = resource(&[(capacity::DRA_DRIVER, "gpu.nvidia.com")], 0);
    let out = run(&r, InfraSource::NoReference);
    assert!(out.template.is_none());
    assert!(
        out.problems
            .iter()
            .any(|p| p.field == Problem::annotation_field(capacity::DRA_DRIVER))
    );
    // Empty values are not set.
    let blank = [(capacity::DRA_DRIVER, " "), (capacity::CSI_DRIVER, "")];
    assert!(not_carried(OBJ, &Labels::from(map(&blank))).is_empty());
}

/// A template in failure domain `fd` (capacity from annotations), built with what the Nodes in
/// that failure domain say and, optionally, a Node of the group and a labels annotation.
fn zoned(
    fd: &str,
    seen: Option<(&str, usize)>,
    node: Option<&str>,
    annotation: Option<&str>,
) -> Option<Zone> {
    let mut annotations = vec![(capacity::CPU, "2"), (capacity::MEMORY, "4Gi")];
    let labels = annotation.map(|z| format!("{LABEL_ZONE}={z}"));
    if let Some(l) = &labels {
        annotations.push((capacity::LABELS, l.as_str()));
    }
    let mut r = resource(&annotations, 0);
    r.template.failure_domain = Some(fd.to_string());
    let node_labels = node.map(|z| map(&[(LABEL_ZONE, z)]));
    let seen = seen.map(|(zone, nodes)| FailureDomainZone {
        zone: zone.to_string(),
        nodes,
    });
    let out = build(&TemplateInputs {
        group_id: GROUP,
        resource: &r,
        infra: InfraSource::NoReference,
        node_labels: node_labels.as_ref(),
        default_arch: None,
        failure_domain_zone: seen.as_ref(),
    });
    let t = out.template.expect("a template");
    let zone = t.summary.zone.clone();
    assert_eq!(
        t.node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_ZONE)),
        zone.as_ref().map(|z| &z.value),
        "the summary names the Node's zone label"
    );
    zone
}

#[test]
fn the_zone_comes_from_the_nodes_in_the_failure_domain() {
    // CAPZ: failure domain "1", its Nodes carry eastus-1.
    let z = zoned("1", Some(("eastus-1", 2)), None, None).unwrap();
    assert_eq!(z.value, "eastus-1");
    assert_eq!(
        z.source,
        ZoneSource::FailureDomainNodes {
            failure_domain: "1".into(),
            nodes: 2
        }
    );
    assert!(
        z.describe().contains("failure domain \"1\""),
        "{}",
        z.describe()
    );
}

#[test]
fn without_nodes_the_failure_domain_is_the_zone_and_check_says_how_to_override_it() {
    // CAPA: the failure domain is the zone's name, and no Node is there yet.
    let z = zoned("us-east-1a", None, None, None).unwrap();
    assert_eq!(z.value, "us-east-1a");
    assert_eq!(
        z.source,
        ZoneSource::FailureDomain {
            failure_domain: "us-east-1a".into()
        }
    );
    let text = z.describe();
    assert!(text.contains("spec.template.spec.failureDomain"), "{text}");
    assert!(
        text.contains(
            "capacity.cluster-autoscaler.kubernetes.io/labels: topology.kubernetes.io/zone=<zone>"
        ),
        "{text}"
    );
}

#[test]
fn the_labels_annotation_and_a_node_of_the_group_win_over_the_failure_domain() {
    let z = zoned("1", Some(("eastus-1", 1)), None, Some("eastus-3")).unwrap();
    assert_eq!(
        (z.value.as_str(), &z.source),
        ("eastus-3", &ZoneSource::Annotation)
    );
    let z = zoned(
        "1",
        Some(("eastus-1", 1)),
        Some("eastus-2"),
        Some("eastus-3"),
    )
    .unwrap();
    assert_eq!(
        (z.value.as_str(), &z.source),
        ("eastus-2", &ZoneSource::GroupNode)
    );
    // A failure domain that is no label value (CAPV: an object name with a slash) gives no zone.
    assert_eq!(zoned("dc/cluster-1", None, None, None), None);
    // ... unless its Nodes say.
    let z = zoned("dc/cluster-1", Some(("zone-a", 1)), None, None).unwrap();
    assert_eq!(z.value, "zone-a");
}

#[test]
fn the_zone_of_a_failure_domain_is_the_one_most_of_its_nodes_carry() {
    let zones = |pairs: &[(&str, usize)]| -> BTreeMap<String, usize> {
        pairs.iter().map(|(z, n)| (z.to_string(), *n)).collect()
    };
    let pick =
        |pairs: &[(&str, usize)]| zone_in_failure_domain(&zones(pairs)).map(|z| (z.zone, z.nodes));
    assert_eq!(pick(&[]), None);
    assert_eq!(pick(&[("eastus-1", 3)]), Some(("eastus-1".into(), 3)));
    assert_eq!(
        pick(&[("eastus-1", 1), ("eastus-2", 4)]),
        Some(("eastus-2".into(), 4))
    );
    // A tie: the first by name.
    assert_eq!(pick(&[("b", 2), ("a", 2)]), Some(("a".into(), 2)));
    // Not a label value: skipped.
    assert_eq!(pick(&[("bad value", 5), ("ok", 1)]), Some(("ok".into(), 1)));
}
