//! Scale-from-zero, pricing and `check` helpers: `E2EMachineTemplate` objects with a status, the
//! template node a group answers (decoded), creating that node in the apiserver so the server
//! validates it, and running the provider's one-shot commands (`check`, `template`) with a deadline.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::{
    NodeGroupTemplateNodeInfoRequest, NodeGroupTemplateNodeInfoResponse,
};
use k8s_pb::api::core::v1 as pb;
use kube::api::{ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use prost::Message;
use serde_json::{Value, json};
use tonic::Status;

use super::capi::{INFRA_GROUP, Rpc};
use super::procs::{self, Check, poll_until};
use super::provider::PROVIDER_BIN;

/// The kind of the test's infrastructure machine template CRD.
pub const TEMPLATE_KIND: &str = "E2EMachineTemplate";

/// The `ApiResource` of `E2EMachineTemplate` at `version` (`v1beta1` is stored, `v1beta2` served too).
pub fn template_resource(version: &str) -> ApiResource {
    super::capi_resource(INFRA_GROUP, version, TEMPLATE_KIND, "e2emachinetemplates")
}

fn templates(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &template_resource("v1beta1"))
}

/// `status` of an infrastructure machine template as the CAPI scale-from-zero contract has it:
/// `status.capacity` (resource → quantity) and, when `arch_os` is given,
/// `status.nodeInfo.{architecture,operatingSystem}`.
pub fn template_status(capacity: &[(&str, &str)], arch_os: Option<(&str, &str)>) -> Value {
    let capacity: BTreeMap<&str, &str> = capacity.iter().copied().collect();
    let mut status = json!({ "capacity": capacity });
    if let Some((arch, os)) = arch_os {
        status["nodeInfo"] = json!({"architecture": arch, "operatingSystem": os});
    }
    status
}

/// Creates `E2EMachineTemplate` `name` (at `version`) and, when `status` is given, writes it through
/// the status subresource (a create drops `status`). Returns the object as stored.
pub async fn create_template(
    client: &Client,
    ns: &str,
    name: &str,
    version: &str,
    status: Option<Value>,
) -> DynamicObject {
    let ar = template_resource(version);
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let object = DynamicObject::new(name, &ar).data(json!({"spec": {"template": {"spec": {}}}}));
    let created = api
        .create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create {TEMPLATE_KIND} {ns}/{name}: {e}"));
    match status {
        Some(status) => set_template_status(client, ns, name, status).await,
        None => created,
    }
}

/// Replaces `status` of an existing `E2EMachineTemplate` through the status subresource and checks
/// that the apiserver kept it.
pub async fn set_template_status(
    client: &Client,
    ns: &str,
    name: &str,
    status: Value,
) -> DynamicObject {
    let api = templates(client, ns);
    // A JSON merge patch would merge maps key by key; replace the whole status instead.
    let stored = api
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Json::<()>(
                serde_json::from_value(json!([
                    {"op": "add", "path": "/status", "value": status}
                ]))
                .expect("a JSON patch"),
            ),
        )
        .await
        .unwrap_or_else(|e| panic!("write the status of {TEMPLATE_KIND} {ns}/{name}: {e}"));
    assert_eq!(
        stored.data["status"], status,
        "the apiserver did not keep the status of {TEMPLATE_KIND} {ns}/{name}"
    );
    stored
}

/// Deletes an `E2EMachineTemplate` (it must exist).
pub async fn delete_template(client: &Client, ns: &str, name: &str) {
    templates(client, ns)
        .delete(name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("delete {TEMPLATE_KIND} {ns}/{name}: {e}"));
}

/// The template node of a group as CA gets it: the decoded `nodeBytes` and the raw response.
pub struct TemplateAnswer {
    pub node: pb::Node,
    pub response: NodeGroupTemplateNodeInfoResponse,
}

impl TemplateAnswer {
    pub fn name(&self) -> String {
        self.node
            .metadata
            .as_ref()
            .and_then(|m| m.name.clone())
            .unwrap_or_default()
    }

    pub fn labels(&self) -> BTreeMap<String, String> {
        self.node
            .metadata
            .as_ref()
            .map(|m| m.labels.clone())
            .unwrap_or_default()
    }

    pub fn annotations(&self) -> BTreeMap<String, String> {
        self.node
            .metadata
            .as_ref()
            .map(|m| m.annotations.clone())
            .unwrap_or_default()
    }

    fn quantities(
        map: impl Fn(
            &pb::NodeStatus,
        ) -> &BTreeMap<String, k8s_pb::apimachinery::pkg::api::resource::Quantity>,
        status: Option<&pb::NodeStatus>,
    ) -> BTreeMap<String, String> {
        status
            .map(|s| {
                map(s)
                    .iter()
                    .map(|(k, q)| (k.clone(), q.string.clone().unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn capacity(&self) -> BTreeMap<String, String> {
        Self::quantities(|s| &s.capacity, self.node.status.as_ref())
    }

    pub fn allocatable(&self) -> BTreeMap<String, String> {
        Self::quantities(|s| &s.allocatable, self.node.status.as_ref())
    }

    /// Taints as `key=value:Effect` (`key:Effect` without a value), in order.
    pub fn taints(&self) -> Vec<String> {
        self.node
            .spec
            .as_ref()
            .map(|s| {
                s.taints
                    .iter()
                    .map(|t| {
                        let key = t.key.clone().unwrap_or_default();
                        let effect = t.effect.clone().unwrap_or_default();
                        match t.value.as_deref() {
                            Some(v) if !v.is_empty() => format!("{key}={v}:{effect}"),
                            _ => format!("{key}:{effect}"),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `(status, reason)` of the condition `type_`.
    pub fn condition(&self, type_: &str) -> Option<(String, String)> {
        self.node.status.as_ref().and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.r#type.as_deref() == Some(type_))
                .map(|c| {
                    (
                        c.status.clone().unwrap_or_default(),
                        c.reason.clone().unwrap_or_default(),
                    )
                })
        })
    }

    /// `(architecture, operatingSystem)` of `status.nodeInfo`.
    pub fn node_info(&self) -> (String, String) {
        self.node
            .status
            .as_ref()
            .and_then(|s| s.node_info.as_ref())
            .map(|i| {
                (
                    i.architecture.clone().unwrap_or_default(),
                    i.operating_system.clone().unwrap_or_default(),
                )
            })
            .unwrap_or_default()
    }
}

/// One `NodeGroupTemplateNodeInfo`; an OK answer must carry a Node in `nodeBytes` and the same
/// bytes in the legacy `nodeInfo` field (panics otherwise).
pub async fn template_node(rpc: &mut Rpc, id: &str) -> Result<TemplateAnswer, Status> {
    let response = rpc
        .client
        .node_group_template_node_info(NodeGroupTemplateNodeInfoRequest { id: id.into() })
        .await?
        .into_inner();
    assert!(
        !response.node_bytes.is_empty(),
        "NodeGroupTemplateNodeInfo({id}) answered OK with empty nodeBytes (docs/architecture.md, invariant 4)"
    );
    assert_eq!(
        response.node_info, response.node_bytes,
        "NodeGroupTemplateNodeInfo({id}): the legacy nodeInfo field must carry the same bytes as nodeBytes"
    );
    let node = pb::Node::decode(&response.node_bytes[..]).unwrap_or_else(|e| {
        panic!("NodeGroupTemplateNodeInfo({id}): nodeBytes is no v1.Node: {e}")
    });
    Ok(TemplateAnswer { node, response })
}

/// Polls `NodeGroupTemplateNodeInfo(id)` until it answers OK and `ready` accepts the node (30 s).
pub async fn wait_template(
    rpc: &Rpc,
    id: &str,
    ready: impl Fn(&TemplateAnswer) -> bool,
) -> TemplateAnswer {
    poll_until(
        &format!("NodeGroupTemplateNodeInfo({id}) answers the expected template"),
        Duration::from_secs(30),
        Duration::from_millis(50),
        || {
            let mut rpc = rpc.clone();
            let ready = &ready;
            async move {
                match template_node(&mut rpc, id).await {
                    Ok(answer) if ready(&answer) => Check::Done(answer),
                    Ok(answer) => Check::Wait(format!("not yet: {:?}", answer.node)),
                    Err(status) => Check::Wait(format!("{status:?}")),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// POSTs `node_bytes` (the protobuf a group's template answer carries, exactly as CA receives it)
/// to the apiserver as a v1 Node in the Kubernetes protobuf envelope, so the server's own decoder and
/// validation judge it. Returns the created Node.
pub async fn create_node_from_proto(
    admin: &Client,
    node_bytes: &[u8],
) -> k8s_openapi::api::core::v1::Node {
    use k8s_pb::apimachinery::pkg::runtime::{TypeMeta, Unknown};
    let unknown = Unknown {
        type_meta: Some(TypeMeta {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
        }),
        raw: Some(node_bytes.to_vec()),
        content_encoding: Some(String::new()),
        content_type: Some(String::new()),
    };
    let mut body = b"k8s\0".to_vec();
    body.extend(unknown.encode_to_vec());
    let request = http::Request::post("/api/v1/nodes")
        .header("Content-Type", "application/vnd.kubernetes.protobuf")
        .header("Accept", "application/json")
        .body(body)
        .expect("a POST request");
    let text = admin
        .request_text(request)
        .await
        .unwrap_or_else(|e| panic!("the apiserver refused the template node as a v1 Node: {e}"));
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("the created Node does not parse ({e}): {text}"))
}

/// Creates a Node from the YAML the `template` command printed (renamed to `name`, so it can live
/// beside the node created from the gRPC bytes) and returns it as stored.
pub async fn create_node_from_yaml(
    admin: &Client,
    yaml: &str,
    name: &str,
) -> k8s_openapi::api::core::v1::Node {
    let mut value: Value =
        serde_norway::from_str(yaml).unwrap_or_else(|e| panic!("template YAML ({e}):\n{yaml}"));
    value["apiVersion"] = json!("v1");
    value["kind"] = json!("Node");
    value["metadata"]["name"] = json!(name);
    let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(value)
        .unwrap_or_else(|e| panic!("template YAML is no v1 Node ({e}):\n{yaml}"));
    Api::<k8s_openapi::api::core::v1::Node>::all(admin.clone())
        .create(&PostParams::default(), &node)
        .await
        .unwrap_or_else(|e| {
            panic!("the apiserver refused the template YAML as a Node: {e}\n{yaml}")
        })
}

/// The capacity of a created Node as the apiserver stored it.
pub fn stored_capacity(node: &k8s_openapi::api::core::v1::Node) -> BTreeMap<String, String> {
    node.status
        .as_ref()
        .and_then(|s| s.capacity.as_ref())
        .map(|c| c.iter().map(|(k, q)| (k.clone(), q.0.clone())).collect())
        .unwrap_or_default()
}

/// A finished run of the provider binary's one-shot commands.
#[derive(Debug)]
pub struct CliRun {
    pub args: Vec<String>,
    /// The exit code; `None` when killed by a signal.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl CliRun {
    /// Everything about the run, for failure messages.
    pub fn describe(&self) -> String {
        format!(
            "`capi-autoscaler-provider {}` exited with {:?} after {:.2}s\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.args.join(" "),
            self.code,
            self.elapsed.as_secs_f64(),
            self.stdout,
            procs_tail(&self.stderr),
        )
    }

    /// stdout as JSON (panics with the whole run otherwise).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is no JSON ({e}):\n{}", self.describe()))
    }
}

fn procs_tail(s: &str) -> &str {
    let max = 6000;
    if s.len() <= max {
        return s;
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// Runs `capi-autoscaler-provider <args…>` (stdin closed), waits at most `timeout` (then kills it
/// and panics: a one-shot command must never hang) and returns how it ended.
pub async fn run_cli(args: &[&str], timeout: Duration) -> CliRun {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    let out_path = procs::work_dir().join(format!("cli-{n}.stdout"));
    let err_path = procs::work_dir().join(format!("cli-{n}.stderr"));
    let create = |p: &Path| {
        std::fs::File::create(p).unwrap_or_else(|e| panic!("create {}: {e}", p.display()))
    };
    let mut command = Command::new(PROVIDER_BIN);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(create(&out_path))
        .stderr(create(&err_path));
    let started = Instant::now();
    let mut child = procs::spawn(command).unwrap_or_else(|e| panic!("start {PROVIDER_BIN}: {e}"));
    let waited = procs::wait_exit(
        &mut child,
        &format!("`capi-autoscaler-provider {}` exits", args.join(" ")),
        timeout,
    )
    .await;
    let elapsed = started.elapsed();
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    match waited {
        Ok(status) => CliRun {
            args: args.iter().map(|a| a.to_string()).collect(),
            code: status.code(),
            stdout: read(&out_path),
            stderr: read(&err_path),
            elapsed,
        },
        Err(e) => {
            procs::kill_and_reap(&mut child);
            panic!(
                "{e}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                read(&out_path),
                procs_tail(&read(&err_path))
            );
        }
    }
}

/// `--cloud-config <kubeconfig> --node-group-auto-discovery clusterapi:namespace=<ns>` as owned
/// strings, for [`run_cli`].
pub fn connection_args(kubeconfig: &Path, ns: &str) -> Vec<String> {
    vec![
        "--cloud-config".into(),
        kubeconfig.display().to_string(),
        "--node-group-auto-discovery".into(),
        format!("clusterapi:namespace={ns}"),
    ]
}

/// Waits (30 s) for an `AutoscalerConfigProblem` Warning Event about object `name` in the
/// namespace of `capi` whose note contains every one of `needles`; returns the note.
pub async fn wait_problem_event(capi: &super::capi::Capi, name: &str, needles: &[&str]) -> String {
    poll_until(
        &format!("an AutoscalerConfigProblem Event on {name} containing {needles:?}"),
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async move {
            let events = capi.events_about(name).await;
            let found = events.iter().find(|e| {
                e.reason.as_deref() == Some("AutoscalerConfigProblem")
                    && e.type_.as_deref() == Some("Warning")
                    && e.note
                        .as_deref()
                        .is_some_and(|n| needles.iter().all(|x| n.contains(x)))
            });
            match found {
                Some(e) => Check::Done(e.note.clone().unwrap_or_default()),
                None => Check::Wait(format!(
                    "events about {name}: {:?}",
                    events
                        .iter()
                        .map(|e| (&e.reason, &e.note))
                        .collect::<Vec<_>>()
                )),
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Waits (30 s) until the provider's log has a line containing every one of `needles`; returns it.
pub async fn wait_log_line(provider: &super::ProviderProcess, needles: &[&str]) -> String {
    poll_until(
        &format!(
            "a line in {} containing {needles:?}",
            provider.log.display()
        ),
        Duration::from_secs(30),
        Duration::from_millis(50),
        || {
            let log = provider.log_contents();
            async move {
                match log.lines().find(|l| needles.iter().all(|n| l.contains(n))) {
                    Some(line) => Check::Done(line.to_string()),
                    None => Check::Wait(format!("log so far:\n{}", procs_tail(&log))),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}
