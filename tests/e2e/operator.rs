//! Operator basics, against a running provider and the test apiserver: gRPC server reflection (what
//! grpcurl uses), the build_info metric and the start-up line, the User-Agent on API requests, the
//! configuration taken from the environment by `serve` and `check` alike, and logs without colour codes
//! when they do not go to a terminal.

use crate::support;

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use capi_autoscaler_provider::version;
use prost::Message as _;
use prost_types::FileDescriptorProto;
use support::capi::{Kind, Rpc, Scalable, fresh_capi};
use support::provider::{PROVIDER_BIN, health_status};
use support::{Check, Setup, poll_until, start_provider};
use tonic::transport::{Channel, Endpoint};

const SETUP: Setup = Setup::shipped();
const CLOUD_PROVIDER: &str = "clusterautoscaler.cloudprovider.v1.externalgrpc.CloudProvider";

mod v1 {
    pub use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    pub use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    pub use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    pub use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};
}

mod v1alpha {
    pub use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
    pub use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
    pub use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
    pub use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
}

/// One v1 reflection request on its own stream; the answer.
async fn reflect(channel: &Channel, request: v1::MessageRequest) -> v1::MessageResponse {
    let mut client = v1::ServerReflectionClient::new(channel.clone());
    let what = format!("{request:?}");
    let mut stream = client
        .server_reflection_info(futures::stream::iter([v1::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(request),
        }]))
        .await
        .unwrap_or_else(|e| panic!("ServerReflectionInfo {what}: {e}"))
        .into_inner();
    let answer: Option<v1::ServerReflectionResponse> = stream
        .message()
        .await
        .unwrap_or_else(|e| panic!("ServerReflectionInfo {what}: {e}"));
    answer
        .and_then(|a| a.message_response)
        .unwrap_or_else(|| panic!("no answer to {what}"))
}

fn services(response: v1::MessageResponse) -> BTreeSet<String> {
    match response {
        v1::MessageResponse::ListServicesResponse(list) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("not a service list: {other:?}"),
    }
}

fn files(response: v1::MessageResponse) -> Vec<FileDescriptorProto> {
    match response {
        v1::MessageResponse::FileDescriptorResponse(files) => files
            .file_descriptor_proto
            .iter()
            .map(|bytes| {
                FileDescriptorProto::decode(bytes.as_slice()).expect("a FileDescriptorProto")
            })
            .collect(),
        other => panic!("not file descriptors: {other:?}"),
    }
}

/// A provider limited to a namespace of its own, without groups: the other tests' groups belong to
/// Clusters of their own, and a provider serves one Cluster (invariant 8).
async fn provider_of_an_empty_namespace(cp: &support::ControlPlane) -> support::ProviderProcess {
    let ns = cp.fresh_namespace().await;
    let only = format!("clusterapi:namespace={ns}");
    start_provider(
        &["--node-group-auto-discovery", &only],
        cp.admin_kubeconfig(),
    )
    .await
}

#[tokio::test]
async fn reflection_lets_a_client_list_and_describe_every_service_without_the_proto() {
    let cp = support::control_plane(SETUP);
    let provider = provider_of_an_empty_namespace(cp).await;
    let channel = provider.channel().await;

    // `grpcurl list`.
    let listed = services(reflect(&channel, v1::MessageRequest::ListServices(String::new())).await);
    let want: BTreeSet<String> = [
        CLOUD_PROVIDER,
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ]
    .map(String::from)
    .into();
    assert_eq!(listed, want);

    // `grpcurl describe …CloudProvider`: the file that defines it, with every RPC, and the files it
    // imports, so a client can build every message type from the answers alone.
    let answer = files(
        reflect(
            &channel,
            v1::MessageRequest::FileContainingSymbol(CLOUD_PROVIDER.into()),
        )
        .await,
    );
    let file = answer
        .iter()
        .find(|f| f.service.iter().any(|s| s.name() == "CloudProvider"))
        .unwrap_or_else(|| panic!("no file with the service: {answer:?}"));
    let methods: BTreeSet<&str> = file.service[0].method.iter().map(|m| m.name()).collect();
    for rpc in [
        "NodeGroups",
        "NodeGroupForNode",
        "NodeGroupIncreaseSize",
        "NodeGroupDeleteNodes",
        "NodeGroupTemplateNodeInfo",
        "NodeGroupGetOptions",
        "PricingNodePrice",
    ] {
        assert!(methods.contains(rpc), "{rpc} not in {methods:?}");
    }
    assert!(
        file.dependency
            .iter()
            .any(|d| d == "google/protobuf/any.proto"),
        "{:?}",
        file.dependency
    );
    for dependency in &file.dependency {
        let known = answer.iter().any(|f| f.name() == dependency)
            || !files(
                reflect(
                    &channel,
                    v1::MessageRequest::FileByFilename(dependency.clone()),
                )
                .await,
            )
            .is_empty();
        assert!(known, "{dependency} cannot be resolved by reflection");
    }
    // A message type, as `grpcurl describe …NodeGroupsRequest` or a call with -d asks for.
    let answer = files(
        reflect(
            &channel,
            v1::MessageRequest::FileContainingSymbol(
                "clusterautoscaler.cloudprovider.v1.externalgrpc.NodeGroupTemplateNodeInfoResponse"
                    .into(),
            ),
        )
        .await,
    );
    assert!(answer.iter().any(|f| f.name() == file.name()));
    // The health service is described too (grpcurl … grpc.health.v1.Health/Check).
    let answer = files(
        reflect(
            &channel,
            v1::MessageRequest::FileContainingSymbol("grpc.health.v1.Health".into()),
        )
        .await,
    );
    assert!(
        answer
            .iter()
            .any(|f| f.service.iter().any(|s| s.name() == "Health"))
    );

    // Older clients speak v1alpha.
    let mut client = v1alpha::ServerReflectionClient::new(channel.clone());
    let mut stream = client
        .server_reflection_info(futures::stream::iter([v1alpha::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(v1alpha::MessageRequest::ListServices(String::new())),
        }]))
        .await
        .expect("v1alpha ServerReflectionInfo")
        .into_inner();
    let answer = stream
        .message()
        .await
        .expect("v1alpha answer")
        .and_then(|a| a.message_response);
    match answer {
        Some(v1alpha::MessageResponse::ListServicesResponse(list)) => {
            assert!(
                list.service.iter().any(|s| s.name == CLOUD_PROVIDER),
                "{list:?}"
            );
        }
        other => panic!("v1alpha: not a service list: {other:?}"),
    }
}

#[tokio::test]
async fn version_and_commit_are_logged_at_start_and_exported_as_build_info() {
    let cp = support::control_plane(SETUP);
    let provider = provider_of_an_empty_namespace(cp).await;
    let metrics = support::autoscaler::http_get(&provider.metrics_address, "/metrics")
        .await
        .unwrap_or_else(|e| panic!("GET /metrics: {e}"));
    let line = format!(
        "capi_autoscaler_provider_build_info{{version=\"{}\",commit=\"{}\"}} 1",
        version::VERSION,
        version::COMMIT
    );
    assert!(
        metrics.lines().any(|l| l == line),
        "{line} not in:\n{metrics}"
    );
    // Built from this work tree: the commit is git's, not "unknown".
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if let Some(head) = head {
        // The test binary and the provider were built at the same commit by the same cargo run.
        assert_eq!(version::COMMIT, head);
    }
    let log = provider.log_contents();
    let start = log
        .lines()
        .find(|l| l.contains("capi-autoscaler-provider starting"))
        .unwrap_or_else(|| panic!("no start-up line in:\n{log}"));
    assert!(
        start.contains(&format!("version=\"{}\"", version::VERSION))
            && start.contains(&format!("commit=\"{}\"", version::COMMIT)),
        "{start}"
    );
    // The log goes to a file here, not a terminal: no ANSI escape codes anywhere.
    assert!(!log.contains('\u{1b}'), "colour codes in the log:\n{log}");

    let out = Command::new(PROVIDER_BIN)
        .arg("--version")
        .output()
        .expect("run --version");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.trim(),
        format!(
            "capi-autoscaler-provider {} (commit {})",
            version::VERSION,
            version::COMMIT
        )
    );
}

/// A kubeconfig whose server is `http://{address}` (plain HTTP: the listener below reads the request).
fn kubeconfig_for(dir: &Path, address: &str) -> std::path::PathBuf {
    let path = dir.join("capture.kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"http://{address}\"}}\n\
             users:\n- name: u\n  user: {{token: t}}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\n\
             current-context: x\n"
        ),
    )
    .expect("write the kubeconfig");
    path
}

/// Accepts connections on `listener` until one request has been read; answers 503 and returns the
/// request head.
fn capture_one_request(listener: TcpListener) -> String {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match stream.read(&mut byte) {
                Ok(1) => head.push(byte[0]),
                _ => break,
            }
        }
        let _ = stream.write_all(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        );
        if !head.is_empty() {
            return String::from_utf8_lossy(&head).into_owned();
        }
    }
    String::new()
}

#[test]
fn the_binary_sends_its_user_agent_and_logs_without_colour_to_a_pipe() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    let address = listener.local_addr().expect("local address").to_string();
    let kubeconfig = kubeconfig_for(dir.path(), &address);
    let capture = std::thread::spawn(move || capture_one_request(listener));

    // `serve` exactly as in a pod, configured through the environment only; it starts, logs, asks
    // the "apiserver" for the Cluster API version and exits on the 503.
    let mut child = Command::new(PROVIDER_BIN)
        .env_clear()
        .env("CAPI_AUTOSCALER_PROVIDER_CLOUD_CONFIG", &kubeconfig)
        .env("CAPI_AUTOSCALER_PROVIDER_ADDRESS", "127.0.0.1:0")
        .env("CAPI_AUTOSCALER_PROVIDER_METRICS_ADDRESS", "")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the provider");
    let request = capture.join().expect("the capture thread");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait().ok().flatten().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let out = child.wait_with_output().expect("the provider's output");
    let log = String::from_utf8_lossy(&out.stderr);

    let agents: Vec<&str> = request
        .lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(name, _)| name.eq_ignore_ascii_case("user-agent"))
        .map(|(_, value)| value.trim())
        .collect();
    assert_eq!(
        agents,
        [format!("capi-autoscaler-provider/{}", version::VERSION)],
        "request:\n{request}"
    );
    assert!(log.contains("capi-autoscaler-provider starting"), "{log}");
    assert!(!log.contains('\u{1b}'), "colour codes on a pipe:\n{log:?}");
}

#[tokio::test]
async fn the_apiserver_attributes_our_writes_to_our_user_agent() {
    // Events are created without a field manager: the apiserver names the manager after the
    // request's User-Agent (its part before '/'), so the Event's managedFields show what it received.
    let (cp, capi) = fresh_capi(SETUP, "v1beta2").await;
    capi.create(&Scalable::md("bad").raw_bounds(Some("0"), Some("many")))
        .await;
    let discovery = format!("clusterapi:namespace={}", capi.ns);
    let _provider = start_provider(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
    )
    .await;
    support::infra::wait_problem_event(&capi, "bad", &[capi.max_key().as_str()]).await;
    let events = capi.events_about("bad").await;
    let managers: BTreeSet<String> = events
        .iter()
        .flat_map(|e| e.metadata.managed_fields.iter().flatten())
        .filter_map(|f| f.manager.clone())
        .collect();
    assert!(
        managers.contains("capi-autoscaler-provider"),
        "Event field managers: {managers:?}"
    );
}

#[tokio::test]
async fn check_in_the_pod_sees_the_configuration_serve_was_given_by_environment() {
    let (cp, capi) = fresh_capi(SETUP, "v1beta2").await;
    // Two namespaces' groups exist; the environment limits both commands to this one.
    capi.create_deployment(&Scalable::md("md-env").bounds(0, 3).replicas(0), false)
        .await;
    let (_, other) = fresh_capi(SETUP, "v1beta2").await;
    other
        .create_deployment(&Scalable::md("md-other").bounds(0, 3).replicas(0), false)
        .await;
    let address = format!("127.0.0.1:{}", support::procs::free_port());
    let log = support::procs::work_dir().join("provider-env.log");
    let env: Vec<(&str, String)> = vec![
        (
            "CAPI_AUTOSCALER_PROVIDER_CLOUD_CONFIG",
            cp.admin_kubeconfig().display().to_string(),
        ),
        (
            "CAPI_AUTOSCALER_PROVIDER_NODE_GROUP_AUTO_DISCOVERY",
            format!("clusterapi:namespace={}", capi.ns),
        ),
        ("CAPI_AUTOSCALER_PROVIDER_ADDRESS", address.clone()),
        ("CAPI_AUTOSCALER_PROVIDER_METRICS_ADDRESS", String::new()),
        (
            "CAPI_AUTOSCALER_PROVIDER_POD_PRICE_PER_CPU_HOUR",
            "0.5".into(),
        ),
    ];

    // `serve` with no argument at all, as the image's ENTRYPOINT/CMD runs it.
    let log_file = std::fs::File::create(&log).expect("create the log file");
    let mut command = Command::new(PROVIDER_BIN);
    command
        .stdin(Stdio::null())
        .stdout(Stdio::from(
            log_file.try_clone().expect("clone the log file"),
        ))
        .stderr(Stdio::from(log_file));
    command.envs(env.iter().map(|(k, v)| (*k, v)));
    let mut serve = support::procs::spawn(command).expect("start serve");
    let endpoint = Endpoint::from_shared(format!("http://{address}"))
        .expect("endpoint")
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(5));
    let ready = poll_until(
        "serve (configured by env) SERVING",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || {
            let endpoint = endpoint.clone();
            async move {
                match health_status(endpoint, CLOUD_PROVIDER).await {
                    Ok(tonic_health::pb::health_check_response::ServingStatus::Serving) => {
                        Check::Done(())
                    }
                    Ok(other) => Check::Wait(format!("{other:?}")),
                    Err(e) => Check::Wait(e),
                }
            }
        },
    )
    .await;
    if let Err(e) = ready {
        support::procs::kill_and_reap(&mut serve);
        panic!("{e}\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    }
    struct Endpointed(String);
    impl support::capi::HasEndpoint for Endpointed {
        fn endpoint(&self) -> String {
            self.0.clone()
        }
    }
    let mut rpc = Rpc::connect(&Endpointed(format!("http://{address}"))).await;
    let served: BTreeSet<String> = rpc.groups().await.into_iter().map(|g| g.id).collect();
    support::procs::kill_and_reap(&mut serve);

    // `check` in the same environment (kubectl exec into the container): the same groups, and the
    // reference price given only by env; the serve-only variables do not disturb it.
    let out = Command::new(PROVIDER_BIN)
        .envs(env.iter().map(|(k, v)| (*k, v)))
        .args(["check", "-o", "json"])
        .output()
        .expect("run check");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "check -o json: {e}\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let checked: BTreeSet<String> = report["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .filter_map(|g| g["id"].as_str().map(String::from))
        .collect();
    let want: BTreeSet<String> = [capi.id(Kind::MachineDeployment, "md-env")].into();
    assert_eq!(served, want);
    assert_eq!(checked, want);
    assert_eq!(report["reference_prices"]["cpu_hour"], 0.5, "{report:#}");
}
