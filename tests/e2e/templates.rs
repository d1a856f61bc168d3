//! Scale from zero end to end on the Cluster API CRDs as shipped (v1beta2 objects):
//! `NodeGroupTemplateNodeInfo` from capacity annotations, from an infrastructure template's
//! `status.capacity`/`status.nodeInfo` (referenced by `apiGroup`), and both; every template is then
//! created as a real Node in the apiserver (from the exact gRPC bytes, and from the `template`
//! command's YAML) so the server validates it. Also: no capacity → `UNIMPLEMENTED` (never OK with
//! empty bytes), a template that is missing at first and appears later, `GetAvailableGPUTypes`, and
//! `NodeGroupGetOptions` (docs/architecture.md, invariants 4 and 5).
//!
//! Every test works in a namespace of its own with a provider that only looks at that namespace.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use capi_autoscaler_provider::proto::{
    GetAvailableGpuTypesRequest, GpuLabelRequest, LegacyDuration, NodeGroupAutoscalingOptions,
    NodeGroupAutoscalingOptionsRequest,
};
use serde_json::json;
use support::capi::{Env, provider_for_namespace};
use support::capi::{INFRA_GROUP, Kind, Rpc, Scalable, expect_code};
use support::infra::{
    self, TemplateAnswer, create_node_from_proto, create_node_from_yaml, run_cli, stored_capacity,
    template_node, template_status, wait_log_line, wait_problem_event, wait_template,
};
use support::{CAPI_GROUP, ProviderProcess, Setup, start_provider};
use tonic::Code;

const SETUP: Setup = Setup::shipped();
const VERSION: &str = "v1beta2";

const CPU: &str = "capacity.cluster-autoscaler.kubernetes.io/cpu";
const MEMORY: &str = "capacity.cluster-autoscaler.kubernetes.io/memory";
const EPHEMERAL_DISK: &str = "capacity.cluster-autoscaler.kubernetes.io/ephemeral-disk";
const GPU_TYPE: &str = "capacity.cluster-autoscaler.kubernetes.io/gpu-type";
const GPU_COUNT: &str = "capacity.cluster-autoscaler.kubernetes.io/gpu-count";
const MAX_PODS: &str = "capacity.cluster-autoscaler.kubernetes.io/maxPods";
const LABELS: &str = "capacity.cluster-autoscaler.kubernetes.io/labels";
const TAINTS: &str = "capacity.cluster-autoscaler.kubernetes.io/taints";
const GPU_LABEL: &str = "cluster-api/accelerator";
const NODE_GROUP_ANNOTATION: &str = "capi-autoscaler-provider/node-group";

async fn env() -> Env {
    Env::fresh(SETUP, VERSION).await
}

/// A provider (admin identity) that only looks at the test's namespace, and a client for it.
async fn provider_for(env: &Env) -> (ProviderProcess, Rpc) {
    provider_for_namespace(env.cp, &env.capi.ns).await
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// The template node of `id` is a ready node with exactly `capacity` (allocatable the same),
/// `arch`/`os` in labels and nodeInfo, its own name as hostname, and the group annotation.
fn assert_node_basics(
    t: &TemplateAnswer,
    id: &str,
    capacity: &BTreeMap<String, String>,
    arch: &str,
    os: &str,
) {
    let name = t.name();
    assert!(!name.is_empty(), "{id}: the template node has no name");
    assert_eq!(&t.capacity(), capacity, "{id}: capacity");
    assert_eq!(&t.allocatable(), capacity, "{id}: allocatable");
    let labels = t.labels();
    assert_eq!(
        labels.get("kubernetes.io/arch").map(String::as_str),
        Some(arch),
        "{id}: arch label in {labels:?}"
    );
    assert_eq!(
        labels.get("kubernetes.io/os").map(String::as_str),
        Some(os),
        "{id}: os label in {labels:?}"
    );
    assert_eq!(
        labels.get("kubernetes.io/hostname"),
        Some(&name),
        "{id}: hostname label"
    );
    assert_eq!(
        t.node_info(),
        (arch.to_string(), os.to_string()),
        "{id}: nodeInfo"
    );
    assert_eq!(
        t.condition("Ready"),
        Some(("True".to_string(), "KubeletReady".to_string())),
        "{id}: the Ready condition"
    );
    assert_eq!(
        t.annotations()
            .get(NODE_GROUP_ANNOTATION)
            .map(String::as_str),
        Some(id),
        "{id}: the node-group annotation"
    );
}

/// Creates the template node from the exact gRPC bytes in the apiserver and checks what was stored.
async fn assert_valid_node(env: &Env, t: &TemplateAnswer) -> k8s_openapi::api::core::v1::Node {
    let admin = env.cp.admin_client().await;
    let stored = create_node_from_proto(&admin, &t.response.node_bytes).await;
    assert_eq!(stored.metadata.name, Some(t.name()), "stored Node name");
    assert_eq!(
        stored_capacity(&stored),
        t.capacity(),
        "the apiserver stored a different capacity than the template carried"
    );
    assert_eq!(
        stored.metadata.labels.clone().unwrap_or_default(),
        t.labels(),
        "stored labels"
    );
    let stored_taints: Vec<String> = stored
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .iter()
        .map(|t| match t.value.as_deref() {
            Some(v) if !v.is_empty() => format!("{}={v}:{}", t.key, t.effect),
            _ => format!("{}:{}", t.key, t.effect),
        })
        .collect();
    assert_eq!(stored_taints, t.taints(), "stored taints");
    stored
}

#[tokio::test]
async fn capacity_annotations_alone_make_a_valid_template_node() {
    let env = env().await;
    let capi = &env.capi;
    let id = capi.id(Kind::MachineDeployment, "ann");
    capi.create_deployment(
        &Scalable::md("ann")
            .bounds(0, 5)
            .replicas(0)
            .annotation(CPU, "4")
            .annotation(MEMORY, "16Gi")
            .annotation(EPHEMERAL_DISK, "50Gi")
            .annotation(MAX_PODS, "58")
            .annotation(GPU_TYPE, "nvidia.com/gpu")
            .annotation(GPU_COUNT, "2")
            .annotation(LABELS, "team=ml,tier=batch")
            .annotation(TAINTS, "k=v:NoSchedule"),
        false,
    )
    .await;
    let (_provider, mut rpc) = provider_for(&env).await;

    let t = template_node(&mut rpc, &id)
        .await
        .unwrap_or_else(|e| panic!("NodeGroupTemplateNodeInfo({id}): {e:?}"));
    let capacity = map(&[
        ("cpu", "4"),
        ("memory", "16Gi"),
        ("ephemeral-storage", "50Gi"),
        ("pods", "58"),
        ("nvidia.com/gpu", "2"),
    ]);
    // No status.nodeInfo anywhere: the default architecture and linux.
    assert_node_basics(&t, &id, &capacity, "amd64", "linux");
    assert!(
        t.name().starts_with("ann-template-"),
        "template node name {}",
        t.name()
    );
    let labels = t.labels();
    assert_eq!(labels.get("team").map(String::as_str), Some("ml"));
    assert_eq!(labels.get("tier").map(String::as_str), Some("batch"));
    // `nvidia.com/gpu` is no valid label value: the label carries it with `/` replaced.
    assert_eq!(
        labels.get(GPU_LABEL).map(String::as_str),
        Some("nvidia.com-gpu"),
        "GPU label in {labels:?}"
    );
    assert_eq!(t.taints(), vec!["k=v:NoSchedule".to_string()]);

    // The GPU label and the GPU type are advertised.
    let label = rpc
        .client
        .gpu_label(GpuLabelRequest {})
        .await
        .expect("GPULabel")
        .into_inner()
        .label;
    assert_eq!(label, GPU_LABEL);
    let types: BTreeSet<String> = rpc
        .client
        .get_available_gpu_types(GetAvailableGpuTypesRequest {})
        .await
        .expect("GetAvailableGPUTypes")
        .into_inner()
        .gpu_types
        .into_keys()
        .collect();
    assert_eq!(
        types.len(),
        1,
        "GetAvailableGPUTypes lists the one GPU type of the namespace's groups: {types:?}"
    );

    assert_valid_node(&env, &t).await;
}

#[tokio::test]
async fn infra_template_status_referenced_by_api_group_makes_a_valid_template_node() {
    let env = env().await;
    let capi = &env.capi;
    let id = capi.id(Kind::MachineDeployment, "tpl");
    capi.create_deployment(&Scalable::md("tpl").bounds(0, 5).replicas(0), false)
        .await;
    // The v1beta2 reference names the group only.
    let md = capi.api(Kind::MachineDeployment).get("tpl").await.unwrap();
    let reference = &md.data["spec"]["template"]["spec"]["infrastructureRef"];
    assert_eq!(reference["apiGroup"], json!(INFRA_GROUP));
    assert!(reference.get("apiVersion").is_none(), "{reference}");
    // Taints of the v1beta2 Machine template (CAPI ≥ 1.12).
    capi.patch(
        Kind::MachineDeployment,
        "tpl",
        json!({"spec": {"template": {"spec": {"taints": [
            {"key": "dedicated", "value": "gpu", "effect": "NoSchedule", "propagation": "Always"}
        ]}}}}),
    )
    .await;
    infra::set_template_status(
        &capi.client,
        &capi.ns,
        "tpl-tmpl",
        template_status(
            &[("cpu", "8"), ("memory", "32Gi"), ("nvidia.com/gpu", "1")],
            Some(("arm64", "linux")),
        ),
    )
    .await;
    let (_provider, rpc) = provider_for(&env).await;

    let capacity = map(&[
        ("cpu", "8"),
        ("memory", "32Gi"),
        ("nvidia.com/gpu", "1"),
        ("pods", "110"),
    ]);
    let t = wait_template(&rpc, &id, |t| t.capacity() == capacity).await;
    assert_node_basics(&t, &id, &capacity, "arm64", "linux");
    assert_eq!(t.taints(), vec!["dedicated=gpu:NoSchedule".to_string()]);

    assert_valid_node(&env, &t).await;
}

#[tokio::test]
async fn annotations_override_the_infra_template_key_by_key() {
    let env = env().await;
    let capi = &env.capi;
    let id = capi.id(Kind::MachineDeployment, "both");
    capi.create_deployment(
        &Scalable::md("both")
            .bounds(0, 5)
            .replicas(0)
            .annotation(CPU, "16")
            .annotation(GPU_TYPE, "nvidia.com/gpu")
            .annotation(GPU_COUNT, "4")
            .annotation(LABELS, "team=ml")
            .annotation(TAINTS, "k=v:NoSchedule,dedicated=other:NoSchedule"),
        false,
    )
    .await;
    capi.patch(
        Kind::MachineDeployment,
        "both",
        json!({"spec": {"template": {"spec": {"taints": [
            {"key": "dedicated", "value": "gpu", "effect": "NoSchedule", "propagation": "Always"}
        ]}}}}),
    )
    .await;
    infra::set_template_status(
        &capi.client,
        &capi.ns,
        "both-tmpl",
        template_status(
            &[
                ("cpu", "8"),
                ("memory", "32Gi"),
                ("ephemeral-storage", "100Gi"),
                ("nvidia.com/gpu", "1"),
                ("pods", "64"),
            ],
            Some(("arm64", "linux")),
        ),
    )
    .await;
    let (_provider, rpc) = provider_for(&env).await;

    // cpu and the GPU count from the annotations, everything else from the template.
    let capacity = map(&[
        ("cpu", "16"),
        ("memory", "32Gi"),
        ("ephemeral-storage", "100Gi"),
        ("nvidia.com/gpu", "4"),
        ("pods", "64"),
    ]);
    let t = wait_template(&rpc, &id, |t| t.capacity() == capacity).await;
    assert_node_basics(&t, &id, &capacity, "arm64", "linux");
    let labels = t.labels();
    assert_eq!(labels.get("team").map(String::as_str), Some("ml"));
    assert_eq!(
        labels.get(GPU_LABEL).map(String::as_str),
        Some("nvidia.com-gpu")
    );
    // The annotation's taint with the same key and effect replaces the Machine template's.
    let taints: BTreeSet<String> = t.taints().into_iter().collect();
    assert_eq!(
        taints,
        set(&["dedicated=other:NoSchedule", "k=v:NoSchedule"])
    );
    let from_grpc = assert_valid_node(&env, &t).await;

    // The `template` command prints the same node as YAML; the apiserver takes it too.
    let mut args = vec!["template".to_string(), id.clone()];
    args.extend(infra::connection_args(env.cp.admin_kubeconfig(), &capi.ns));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = run_cli(&args, Duration::from_secs(60)).await;
    assert_eq!(run.code, Some(0), "{}", run.describe());
    let admin = env.cp.admin_client().await;
    let from_yaml = create_node_from_yaml(&admin, &run.stdout, &format!("{}-yaml", t.name())).await;
    assert_eq!(stored_capacity(&from_yaml), stored_capacity(&from_grpc));
    assert_eq!(from_yaml.metadata.labels, from_grpc.metadata.labels);
    assert_eq!(
        from_yaml.spec.as_ref().and_then(|s| s.taints.clone()),
        from_grpc.spec.as_ref().and_then(|s| s.taints.clone())
    );
}

#[tokio::test]
async fn no_cpu_or_memory_is_unimplemented_never_ok_with_empty_bytes() {
    let env = env().await;
    let capi = &env.capi;
    // A template without status, no annotations.
    capi.create_deployment(&Scalable::md("bare").bounds(0, 3).replicas(0), false)
        .await;
    // cpu but no memory.
    capi.create_deployment(
        &Scalable::md("cpu-only")
            .bounds(0, 3)
            .replicas(0)
            .annotation(CPU, "2"),
        false,
    )
    .await;
    // A running group without capacity anywhere (CA may still ask).
    capi.create_deployment(&Scalable::md("running").bounds(1, 3).replicas(2), false)
        .await;
    // memory from the template, cpu zero in the annotation: still no cpu.
    capi.create_deployment(
        &Scalable::md("zero-cpu")
            .bounds(0, 3)
            .replicas(0)
            .annotation(CPU, "0"),
        false,
    )
    .await;
    infra::set_template_status(
        &capi.client,
        &capi.ns,
        "zero-cpu-tmpl",
        template_status(&[("memory", "4Gi")], None),
    )
    .await;
    let (provider, mut rpc) = provider_for(&env).await;
    let ids: BTreeSet<String> = ["bare", "cpu-only", "running", "zero-cpu"]
        .iter()
        .map(|n| capi.id(Kind::MachineDeployment, n))
        .collect();
    rpc.wait_ids(&capi.ns, &ids).await;
    for id in &ids {
        let message = expect_code(
            &format!("NodeGroupTemplateNodeInfo({id})"),
            template_node(&mut rpc, id).await.map(|t| t.node),
            Code::Unimplemented,
        );
        assert!(message.contains(id.as_str()), "{message}");
    }
    let unknown = capi.id(Kind::MachineDeployment, "nope");
    expect_code(
        "NodeGroupTemplateNodeInfo(unknown group)",
        template_node(&mut rpc, &unknown).await.map(|t| t.node),
        Code::NotFound,
    );
    // The zero-size groups that cannot scale from zero say why, naming the capacity keys.
    for (md, field) in [("bare", CPU), ("cpu-only", MEMORY)] {
        wait_log_line(
            &provider,
            &[
                &format!("MachineDeployment {}/{md}", capi.ns),
                &format!("metadata.annotations[{field}]"),
                "no cpu/memory capacity",
            ],
        )
        .await;
        // Problems become Events on their object (which note survives: see the ignored
        // `a_later_problem_on_an_object_is_recorded_with_its_own_note`).
        wait_problem_event(capi, md, &[]).await;
    }
}

#[tokio::test]
async fn a_missing_infra_template_is_a_problem_until_it_appears() {
    let env = env().await;
    let capi = &env.capi;
    let late = capi.id(Kind::MachineDeployment, "late");
    let late_ann = capi.id(Kind::MachineDeployment, "late-ann");
    capi.create_deployment(&Scalable::md("late").bounds(0, 3).replicas(0), false)
        .await;
    capi.create_deployment(
        &Scalable::md("late-ann")
            .bounds(0, 3)
            .replicas(0)
            .annotation(CPU, "1")
            .annotation(MEMORY, "2Gi"),
        false,
    )
    .await;
    // Both reference templates that do not exist (yet).
    infra::delete_template(&capi.client, &capi.ns, "late-tmpl").await;
    infra::delete_template(&capi.client, &capi.ns, "late-ann-tmpl").await;
    let (provider, mut rpc) = provider_for(&env).await;
    rpc.wait_ids(&capi.ns, &[late.clone(), late_ann.clone()].into())
        .await;

    // Without annotations there is nothing to describe the group with.
    expect_code(
        &format!("NodeGroupTemplateNodeInfo({late})"),
        template_node(&mut rpc, &late).await.map(|t| t.node),
        Code::Unimplemented,
    );
    // With annotations the group is described by them alone.
    let t = template_node(&mut rpc, &late_ann)
        .await
        .unwrap_or_else(|e| panic!("NodeGroupTemplateNodeInfo({late_ann}): {e:?}"));
    assert_eq!(
        t.capacity(),
        map(&[("cpu", "1"), ("memory", "2Gi"), ("pods", "110")])
    );
    // Each missing template is a problem on its MachineDeployment, naming the template (the
    // provider's log; `check` shows the same problems, see tests/e2e/check.rs).
    for (md, template) in [("late", "late-tmpl"), ("late-ann", "late-ann-tmpl")] {
        wait_log_line(
            &provider,
            &[
                &format!("MachineDeployment {}/{md}", capi.ns),
                "spec.template.spec.infrastructureRef",
                &format!(
                    "E2EMachineTemplate {}/{template} (infrastructure.cluster.x-k8s.io): not found",
                    capi.ns
                ),
            ],
        )
        .await;
        // Problems become Events on their object (which note survives: see the ignored
        // `a_later_problem_on_an_object_is_recorded_with_its_own_note`).
        wait_problem_event(capi, md, &[]).await;
    }

    // The templates appear: served without restarting the provider.
    infra::create_template(
        &capi.client,
        &capi.ns,
        "late-tmpl",
        "v1beta2",
        Some(template_status(
            &[("cpu", "2"), ("memory", "4Gi")],
            Some(("arm64", "linux")),
        )),
    )
    .await;
    infra::create_template(
        &capi.client,
        &capi.ns,
        "late-ann-tmpl",
        "v1beta1",
        Some(template_status(
            &[
                ("cpu", "8"),
                ("memory", "8Gi"),
                ("ephemeral-storage", "20Gi"),
            ],
            None,
        )),
    )
    .await;
    let capacity = map(&[("cpu", "2"), ("memory", "4Gi"), ("pods", "110")]);
    let t = wait_template(&rpc, &late, |t| t.capacity() == capacity).await;
    assert_node_basics(&t, &late, &capacity, "arm64", "linux");
    let capacity = map(&[
        ("cpu", "1"),
        ("memory", "2Gi"),
        ("ephemeral-storage", "20Gi"),
        ("pods", "110"),
    ]);
    let t = wait_template(&rpc, &late_ann, |t| t.capacity() == capacity).await;
    assert_node_basics(&t, &late_ann, &capacity, "amd64", "linux");
    assert_valid_node(&env, &t).await;
}

fn defaults() -> NodeGroupAutoscalingOptions {
    let duration = |secs: i64| prost_types::Duration {
        seconds: secs,
        nanos: 0,
    };
    NodeGroupAutoscalingOptions {
        scale_down_utilization_threshold: 0.5,
        scale_down_gpu_utilization_threshold: 0.45,
        scale_down_unneeded_duration: Some(duration(600)),
        scale_down_unready_duration: Some(duration(1200)),
        max_node_provision_duration: Some(duration(900)),
        zero_or_max_node_scaling: true,
        ignore_daemon_sets_utilization: true,
        ..Default::default()
    }
}

async fn options(
    rpc: &mut Rpc,
    id: &str,
) -> Result<Option<NodeGroupAutoscalingOptions>, tonic::Status> {
    rpc.client
        .node_group_get_options(NodeGroupAutoscalingOptionsRequest {
            id: id.into(),
            defaults: Some(defaults()),
        })
        .await
        .map(|r| r.into_inner().node_group_autoscaling_options)
}

#[tokio::test]
async fn get_options_is_empty_without_annotations_and_echoes_defaults_it_does_not_override() {
    let env = env().await;
    let capi = &env.capi;
    let opt = |suffix: &str| format!("{CAPI_GROUP}/autoscaling-options-{suffix}");
    capi.create_deployment(&Scalable::md("plain").bounds(1, 3), false)
        .await;
    capi.create_deployment(
        &Scalable::md("tuned")
            .bounds(1, 3)
            .annotation(&opt("scaledownunneededtime"), "5m")
            .annotation(&opt("scaledownutilizationthreshold"), "0.7")
            .annotation(&opt("scaledownunreadytime"), "soon"),
        false,
    )
    .await;
    capi.create_deployment(
        &Scalable::md("all-bad")
            .bounds(1, 3)
            .annotation(&opt("scaledownutilizationthreshold"), "lots"),
        false,
    )
    .await;
    let (provider, mut rpc) = provider_for(&env).await;
    let plain = capi.id(Kind::MachineDeployment, "plain");
    let tuned = capi.id(Kind::MachineDeployment, "tuned");
    let all_bad = capi.id(Kind::MachineDeployment, "all-bad");
    rpc.wait_ids(
        &capi.ns,
        &[plain.clone(), tuned.clone(), all_bad.clone()].into(),
    )
    .await;

    // No per-group annotation: the empty answer, so CA keeps every default (invariant 5).
    assert_eq!(options(&mut rpc, &plain).await.expect("options"), None);
    // Only bad values: no field overridden, the empty answer as well.
    assert_eq!(options(&mut rpc, &all_bad).await.expect("options"), None);

    let o = options(&mut rpc, &tuned)
        .await
        .expect("options")
        .expect("an options answer for the annotated group");
    let d = defaults();
    assert_eq!(o.scale_down_utilization_threshold, 0.7);
    assert_eq!(
        o.scale_down_unneeded_duration,
        Some(prost_types::Duration {
            seconds: 300,
            nanos: 0
        })
    );
    assert_eq!(
        o.scale_down_unneeded_time,
        Some(LegacyDuration {
            duration: 300_000_000_000
        }),
        "the legacy duration for CA ≤ 1.34"
    );
    // Every other field echoes the request's defaults, including the one with a bad value.
    assert_eq!(
        o.scale_down_gpu_utilization_threshold,
        d.scale_down_gpu_utilization_threshold
    );
    assert_eq!(o.scale_down_unready_duration, d.scale_down_unready_duration);
    assert_eq!(
        o.scale_down_unready_time,
        Some(LegacyDuration {
            duration: 1_200_000_000_000
        })
    );
    assert_eq!(o.max_node_provision_duration, d.max_node_provision_duration);
    assert_eq!(
        o.max_node_provision_time,
        Some(LegacyDuration {
            duration: 900_000_000_000
        })
    );
    assert_eq!(o.zero_or_max_node_scaling, d.zero_or_max_node_scaling);
    assert_eq!(
        o.ignore_daemon_sets_utilization,
        d.ignore_daemon_sets_utilization
    );
    // The bad value is a problem naming its annotation.
    wait_log_line(
        &provider,
        &[
            &format!("MachineDeployment {}/tuned", capi.ns),
            &format!("metadata.annotations[{}]", opt("scaledownunreadytime")),
            "\"soon\"",
            "the default is used",
        ],
    )
    .await;

    expect_code(
        "NodeGroupGetOptions(unknown group)",
        options(&mut rpc, &capi.id(Kind::MachineDeployment, "nope")).await,
        Code::NotFound,
    );
}

#[tokio::test]
async fn an_infra_kind_served_only_after_it_is_referenced_is_picked_up() {
    let env = env().await;
    let capi = &env.capi;
    let id = capi.id(Kind::MachineDeployment, "kindless");
    capi.create_deployment(&Scalable::md("kindless").bounds(0, 3).replicas(0), false)
        .await;
    // The reference names a kind no CRD serves yet (its provider's CRDs come later).
    let (kind, plural) = ("E2ELateMachineTemplate", "e2elatemachinetemplates");
    capi.patch(
        Kind::MachineDeployment,
        "kindless",
        json!({"spec": {"template": {"spec": {"infrastructureRef": {"kind": kind}}}}}),
    )
    .await;
    let (provider, mut rpc) = provider_for(&env).await;
    rpc.wait_ids(&capi.ns, &[id.clone()].into()).await;
    expect_code(
        &format!("NodeGroupTemplateNodeInfo({id})"),
        template_node(&mut rpc, &id).await.map(|t| t.node),
        Code::Unimplemented,
    );
    wait_log_line(
        &provider,
        &["kindless-tmpl", &format!("cannot read {kind}")],
    )
    .await;

    // The CRD is installed and the template created: served without restarting the provider.
    let fixture = std::fs::read_to_string(support::crds::e2e_template_crd()).expect("read fixture");
    let crd = fixture
        .replace("E2EMachineTemplate", kind)
        .replace("e2emachinetemplate", &plural[..plural.len() - 1]);
    let path = support::procs::work_dir().join("e2elatemachinetemplates.yaml");
    std::fs::write(&path, crd).expect("write the CRD");
    support::crds::install(&capi.client, &[path])
        .await
        .unwrap_or_else(|e| panic!("install {kind}: {e}"));
    let ar = support::capi_resource(INFRA_GROUP, "v1beta1", kind, plural);
    let api: kube::Api<kube::api::DynamicObject> =
        kube::Api::namespaced_with(capi.client.clone(), &capi.ns, &ar);
    let object = kube::api::DynamicObject::new("kindless-tmpl", &ar)
        .data(json!({"spec": {"template": {"spec": {}}}}));
    api.create(&Default::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create {kind}: {e}"));
    api.patch_status(
        "kindless-tmpl",
        &Default::default(),
        &kube::api::Patch::Merge(
            json!({"status": template_status(&[("cpu", "2"), ("memory", "4Gi")], None)}),
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("write the status of {kind}: {e}"));
    let capacity = map(&[("cpu", "2"), ("memory", "4Gi"), ("pods", "110")]);
    wait_template(&rpc, &id, |t| t.capacity() == capacity).await;
}

// ---------------------------------------------------------------------------------------------------
// Provider bugs found by these tests, kept as focused tests until fixed.

#[tokio::test]
async fn a_gpu_from_the_infra_template_gets_the_gpu_label() {
    let env = env().await;
    let capi = &env.capi;
    let id = capi.id(Kind::MachineDeployment, "tgpu");
    capi.create_deployment(&Scalable::md("tgpu").bounds(0, 5).replicas(0), false)
        .await;
    infra::set_template_status(
        &capi.client,
        &capi.ns,
        "tgpu-tmpl",
        template_status(
            &[("cpu", "8"), ("memory", "32Gi"), ("nvidia.com/gpu", "1")],
            None,
        ),
    )
    .await;
    let (_provider, rpc) = provider_for(&env).await;
    let t = wait_template(&rpc, &id, |t| t.capacity().contains_key("nvidia.com/gpu")).await;
    // GetAvailableGPUTypes already lists this group's GPU; its nodes must carry the label CA reads
    // the type from (GetNodeGpuConfig, --gpu-total, GPU metrics).
    let labels = t.labels();
    assert_eq!(
        labels.get(GPU_LABEL).map(String::as_str),
        Some("nvidia.com-gpu"),
        "GPU label of a group whose GPU comes from the infrastructure template: {labels:?}"
    );
}

#[tokio::test]
async fn gpu_types_are_the_values_of_the_gpu_label() {
    let env = env().await;
    let capi = &env.capi;
    let id = capi.id(Kind::MachineDeployment, "gpu");
    capi.create_deployment(
        &Scalable::md("gpu")
            .bounds(0, 5)
            .replicas(0)
            .annotation(CPU, "4")
            .annotation(MEMORY, "16Gi")
            .annotation(GPU_TYPE, "nvidia.com/gpu")
            .annotation(GPU_COUNT, "1"),
        false,
    )
    .await;
    let (_provider, mut rpc) = provider_for(&env).await;
    let t = wait_template(&rpc, &id, |_| true).await;
    let label = t.labels().get(GPU_LABEL).cloned().expect("a GPU label");
    let types: BTreeSet<String> = rpc
        .client
        .get_available_gpu_types(GetAvailableGpuTypesRequest {})
        .await
        .expect("GetAvailableGPUTypes")
        .into_inner()
        .gpu_types
        .into_keys()
        .collect();
    // CA's GetGpuTypeForMetrics / validateGpuType look the node's label value up in these keys.
    assert!(
        types.contains(&label),
        "GetAvailableGPUTypes {types:?} does not list the GPU label value {label:?} of the group's nodes"
    );
}

#[tokio::test]
async fn a_later_problem_on_an_object_is_recorded_with_its_own_note() {
    let env = env().await;
    let capi = &env.capi;
    capi.create_deployment(&Scalable::md("late").bounds(0, 3).replicas(0), false)
        .await;
    infra::delete_template(&capi.client, &capi.ns, "late-tmpl").await;
    let (_provider, _rpc) = provider_for(&env).await;
    wait_problem_event(capi, "late", &["late-tmpl", "not found"]).await;
}

#[tokio::test]
async fn a_healthy_group_reports_no_problem_at_startup() {
    let env = env().await;
    let capi = &env.capi;
    let id = capi.id(Kind::MachineDeployment, "fine");
    capi.create_deployment(&Scalable::md("fine").bounds(0, 3).replicas(0), false)
        .await;
    infra::set_template_status(
        &capi.client,
        &capi.ns,
        "fine-tmpl",
        template_status(&[("cpu", "2"), ("memory", "4Gi")], Some(("amd64", "linux"))),
    )
    .await;
    let (provider, rpc) = provider_for(&env).await;
    wait_template(&rpc, &id, |_| true).await;
    // Problems are logged synchronously when a snapshot is built; by now every startup build is in
    // the log.
    let object = format!("MachineDeployment {}/fine", capi.ns);
    let log = provider.log_contents();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains(&object))
        .collect();
    assert!(
        warnings.is_empty(),
        "a group whose template is fine was reported with problems:\n{}",
        warnings.join("\n")
    );
    let events = capi.events_about("fine").await;
    assert!(
        events.is_empty(),
        "Warning Events on a group whose template is fine: {:?}",
        events.iter().map(|e| &e.note).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn integer_resources_from_the_infra_template_make_a_valid_node() {
    let env = env().await;
    let capi = &env.capi;
    let id = capi.id(Kind::MachineDeployment, "frac");
    capi.create_deployment(&Scalable::md("frac").bounds(0, 3).replicas(0), false)
        .await;
    infra::set_template_status(
        &capi.client,
        &capi.ns,
        "frac-tmpl",
        template_status(
            &[
                ("cpu", "2"),
                ("memory", "4Gi"),
                ("nvidia.com/gpu", "1500m"),
                ("pods", "10500m"),
            ],
            None,
        ),
    )
    .await;
    let (_provider, rpc) = provider_for(&env).await;
    let t = wait_template(&rpc, &id, |t| t.capacity().contains_key("cpu")).await;
    // Either the malformed counts are left out (and reported), or made integers: the node CA
    // simulates must be one Kubernetes accepts.
    assert_valid_node(&env, &t).await;
}

/// With `--kubeconfig` (the workload cluster; here the same apiserver), a Node of the group gives the
/// template its instance type, region and zone, over the failure domain and the annotations.
#[tokio::test]
async fn well_known_labels_come_from_an_existing_node_of_the_group_with_a_workload_kubeconfig() {
    use support::capi::Owner;
    let env = env().await;
    let capi = &env.capi;
    let id = capi.id(Kind::MachineDeployment, "wl");
    capi.create_deployment(
        &Scalable::md("wl")
            .bounds(0, 5)
            .replicas(1)
            .annotation(CPU, "2")
            .annotation(MEMORY, "8Gi")
            .annotation(LABELS, "topology.kubernetes.io/zone=from-annotation"),
        false,
    )
    .await;
    capi.create_machine(&capi.running("wl-0", Owner::Deployment("wl".into())))
        .await;
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> =
        kube::Api::all(env.cp.admin_client().await);
    let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(json!({
        "metadata": {"name": capi.node_name("wl-0"), "labels": {
            "node.kubernetes.io/instance-type": "m5.large",
            "topology.kubernetes.io/region": "eu-west-1",
            "topology.kubernetes.io/zone": "eu-west-1b",
            "kubernetes.io/arch": "arm64",
            "unrelated": "not-copied",
        }, "annotations": {
            // As Cluster API annotates its Nodes: the Cluster served is checked against them.
            capi.key("cluster-namespace"): capi.ns,
            capi.key("cluster-name"): support::capi::DEFAULT_CLUSTER,
        }},
        "spec": {"providerID": capi.provider_id("wl-0")}
    }))
    .expect("a Node");
    nodes
        .create(&kube::api::PostParams::default(), &node)
        .await
        .expect("create the workload Node");

    let discovery = format!("clusterapi:namespace={}", capi.ns);
    let kubeconfig = env.cp.admin_kubeconfig().display().to_string();
    // The shared apiserver's Nodes belong to many tests' Clusters: this test's is named.
    let cluster = format!("{}/{}", capi.ns, support::capi::DEFAULT_CLUSTER);
    let provider = start_provider(
        &[
            "--node-group-auto-discovery",
            &discovery,
            "--kubeconfig",
            &kubeconfig,
            "--cluster",
            &cluster,
        ],
        env.cp.admin_kubeconfig(),
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    let t = template_node(&mut rpc, &id)
        .await
        .unwrap_or_else(|e| panic!("NodeGroupTemplateNodeInfo({id}): {e:?}"));
    let labels = t.labels();
    for (key, value) in [
        ("node.kubernetes.io/instance-type", "m5.large"),
        ("topology.kubernetes.io/region", "eu-west-1"),
        ("topology.kubernetes.io/zone", "eu-west-1b"),
        ("kubernetes.io/arch", "arm64"),
    ] {
        assert_eq!(
            labels.get(key).map(String::as_str),
            Some(value),
            "{key} in {labels:?}"
        );
    }
    assert!(!labels.contains_key("unrelated"), "{labels:?}");
    assert_valid_node(&env, &t).await;

    // Without the workload cluster, the annotation's zone stands.
    drop(rpc);
    drop(provider);
    let (_provider, mut rpc) = provider_for(&env).await;
    let t = template_node(&mut rpc, &id)
        .await
        .unwrap_or_else(|e| panic!("NodeGroupTemplateNodeInfo({id}): {e:?}"));
    assert_eq!(
        t.labels()
            .get("topology.kubernetes.io/zone")
            .map(String::as_str),
        Some("from-annotation")
    );
    assert!(!t.labels().contains_key("node.kubernetes.io/instance-type"));
}
