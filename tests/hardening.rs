//! Hardening against a real kube-apiserver (shipped CRDs):
//! - hostile gRPC: 10,000 random 100 KB group ids, DeleteNodes with millions of empty nodes,
//!   NodeGroupForNode with millions of empty labels, PricingPodPrice with millions of empty containers:
//!   each refused or answered NOT_FOUND, the provider lives, its memory stays bounded, normal calls work;
//! - TLS rotation: the certificate, key and client CA replaced by ones from a new CA while serving: a
//!   half-written rotation keeps the old files in use, the complete one is picked up without a restart,
//!   old connections go on;
//! - health that tells the truth: the provider's ClusterRoleBinding removed after start → NOT_SERVING
//!   and `/readyz` 503 naming the watch and the 403, writes UNAVAILABLE, reads still answered; given back
//!   → SERVING and writes again;
//! - the API unreachable for longer than `--watch-stale-after` → NOT_SERVING after the bound, not
//!   before; back → SERVING;
//! - `check` with a workload identity that may not list Nodes reports it at once.
//!
//! Every test works in a namespace of its own with a provider that only looks at that namespace.

pub mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::{NodeGroupForNodeRequest, PricingPodPriceRequest};
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_pb::api::core::v1 as pb;
use k8s_pb::apimachinery::pkg::api::resource::Quantity;
use prost::Message;
use prost::bytes::Bytes;
use rand::{Rng as _, SeedableRng as _};
use support::capi::{
    CLOUD_PROVIDER_SERVICE, Capi, EnvProvider, Kind, Rpc, SHIPPED_ROLE, Scalable, TcpProxy,
    apply_cluster_role, apply_shipped_cluster_role, expect_code, fresh_capi, grpc_node, ids,
    kubeconfig_with_server, socket_addr_of, start_provider_with_env,
};
use support::hardening::{
    TlsDir, TlsSet, empty_elements, expect_one_of, http_get, len_field, metric, node_groups_on,
    node_groups_over, peak_rss_mib, raw_call, restore_bindings, revoke_bindings, rss_mib,
    start_tls_provider, user_of,
};
use support::infra::run_cli;
use support::procs::{Check, poll_until};
use support::{ControlPlane, Setup};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

const SETUP: Setup = Setup::shipped();
const VERSION: &str = "v1beta2";

const CPU: &str = "capacity.cluster-autoscaler.kubernetes.io/cpu";
const MEMORY: &str = "capacity.cluster-autoscaler.kubernetes.io/memory";
const PRICE: &str = "capi-autoscaler-provider/hourly-price";

async fn capi() -> (&'static ControlPlane, Capi) {
    fresh_capi(SETUP, VERSION).await
}

/// A priced MachineDeployment (and its MachineSet) that can scale from zero: 0..5, 1 replica.
async fn priced_group(capi: &Capi, name: &str) -> String {
    let md = Scalable::md(name)
        .bounds(0, 5)
        .replicas(1)
        .annotation(CPU, "2")
        .annotation(MEMORY, "8Gi")
        .annotation(PRICE, "0.25");
    capi.create_deployment(&md, false).await;
    capi.id(Kind::MachineDeployment, name)
}

fn discovery(ns: &str) -> String {
    format!("clusterapi:namespace={ns}")
}

fn ts(seconds: i64) -> prost_types::Timestamp {
    prost_types::Timestamp { seconds, nanos: 0 }
}

fn pod_price_request(pod_bytes: Vec<u8>) -> PricingPodPriceRequest {
    PricingPodPriceRequest {
        pod_bytes,
        start_timestamp: Some(ts(1_800_000_000)),
        end_timestamp: Some(ts(1_800_003_600)),
        ..Default::default()
    }
}

/// A pending pod with one container requesting 1 CPU and 1 GiB.
fn normal_pod() -> Vec<u8> {
    let requests = [("cpu", "1"), ("memory", "1Gi")]
        .into_iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                Quantity {
                    string: Some(v.into()),
                },
            )
        })
        .collect();
    pb::Pod {
        spec: Some(pb::PodSpec {
            containers: vec![pb::Container {
                name: Some("app".into()),
                resources: Some(pb::ResourceRequirements {
                    requests,
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// A Pod whose spec holds `n` empty containers (two bytes each), without building them.
fn pod_with_empty_containers(n: usize) -> Vec<u8> {
    len_field(2, &empty_elements(2, n))
}

#[tokio::test]
async fn hostile_grpc_input_is_refused_or_answered_and_memory_stays_bounded() {
    let (cp, capi) = capi().await;
    let id = priced_group(&capi, "md").await;
    let provider = support::start_provider(
        &["--node-group-auto-discovery", &discovery(&capi.ns)],
        cp.admin_kubeconfig(),
    )
    .await;
    let pid = provider.pid();
    let mut rpc = Rpc::connect(&provider).await;
    rpc.wait_ids(&capi.ns, &ids(&[&id])).await;
    assert_eq!(rpc.target(&id).await.expect("NodeGroupTargetSize"), 1);
    let before = rss_mib(pid);

    // 10,000 random 100 KB ids, 8 clients at a time, over every call that takes an id. Each id is
    // distinct: a random prefix and a random slice of a random pool; some carry a real kind prefix so
    // the write path is taken too.
    let started = Instant::now();
    let mut rng = rand::rngs::StdRng::seed_from_u64(10);
    let pool: String = (&mut rng)
        .sample_iter(rand::distr::Alphanumeric)
        .take(1 << 20)
        .map(char::from)
        .collect();
    const ID_LEN: usize = 100 * 1024;
    let mut workers = Vec::new();
    for worker in 0..8u64 {
        let mut rpc = rpc.clone();
        let pool = pool.clone();
        let mut rng = rand::rngs::StdRng::seed_from_u64(worker);
        workers.push(tokio::spawn(async move {
            let mut longest_message = 0;
            for i in 0..1250usize {
                let prefix: String = (&mut rng)
                    .sample_iter(rand::distr::Alphanumeric)
                    .take(16)
                    .map(char::from)
                    .collect();
                let kind = if i % 3 == 0 { "MachineDeployment/" } else { "" };
                let offset = rng.random_range(0..pool.len() - ID_LEN);
                let mut id = format!("{kind}{prefix}");
                id.push_str(&pool[offset..offset + ID_LEN - id.len()]);
                let result = match i % 7 {
                    0 => rpc.target(&id).await.map(drop),
                    1 => rpc.nodes(&id).await.map(drop),
                    2 => rpc.increase(&id, 1).await,
                    3 => rpc.decrease(&id, -1).await,
                    4 => rpc.delete_nodes(&id, vec![grpc_node("e2e://x", "x")]).await,
                    5 => rpc
                        .client
                        .node_group_template_node_info(
                            capi_autoscaler_provider::proto::NodeGroupTemplateNodeInfoRequest {
                                id: id.clone(),
                            },
                        )
                        .await
                        .map(drop),
                    _ => rpc
                        .client
                        .node_group_get_options(
                            capi_autoscaler_provider::proto::NodeGroupAutoscalingOptionsRequest {
                                id: id.clone(),
                                ..Default::default()
                            },
                        )
                        .await
                        .map(drop),
                };
                let message = expect_code(
                    &format!("call {i} of worker {worker}"),
                    result,
                    Code::NotFound,
                );
                longest_message = longest_message.max(message.len());
            }
            longest_message
        }));
    }
    let mut longest_message = 0;
    for w in workers {
        longest_message = longest_message.max(w.await.expect("a worker"));
    }
    let after_ids = rss_mib(pid);
    support::procs::announce(&format!(
        "hardening: 10,000 random 100 KB ids answered NOT_FOUND in {:.1}s; longest status message {longest_message} bytes",
        started.elapsed().as_secs_f64()
    ));
    // The hostile id is not echoed whole.
    assert!(longest_message <= 1200, "{longest_message}");

    let raw = |method: &'static str, message: Vec<u8>| {
        let channel = tonic::transport::Endpoint::from_shared(provider.endpoint())
            .expect("endpoint")
            .timeout(Duration::from_secs(30))
            .connect_lazy();
        async move { raw_call(channel, method, Bytes::from(message)).await }
    };

    // DeleteNodes with 3,000,000 empty nodes (6 MB, under the 16 MiB limit): its decoded size.
    let mut message = len_field(2, id.as_bytes());
    message.extend(empty_elements(1, 3_000_000));
    let status = expect_one_of(
        "DeleteNodes with 3,000,000 empty nodes",
        raw("NodeGroupDeleteNodes", message).await,
        &[Code::ResourceExhausted],
    );
    support::procs::announce(&format!(
        "hardening: DeleteNodes × 3,000,000 empty nodes: {:?} {}",
        status.code(),
        status.message()
    ));
    // 10,000,000 empty nodes (20 MB): over --max-message-size.
    let mut message = len_field(2, id.as_bytes());
    message.extend(empty_elements(1, 10_000_000));
    let status = expect_one_of(
        "DeleteNodes with 10,000,000 empty nodes",
        raw("NodeGroupDeleteNodes", message).await,
        &[Code::ResourceExhausted],
    );
    support::procs::announce(&format!(
        "hardening: DeleteNodes × 10,000,000 empty nodes: {:?} {}",
        status.code(),
        status.message()
    ));
    // A node with 2,000,000 empty labels (its map entries).
    let status = expect_one_of(
        "NodeGroupForNode with 2,000,000 empty labels",
        raw(
            "NodeGroupForNode",
            len_field(1, &empty_elements(3, 2_000_000)),
        )
        .await,
        &[Code::ResourceExhausted],
    );
    support::procs::announce(&format!(
        "hardening: NodeGroupForNode × 2,000,000 empty labels: {:?} {}",
        status.code(),
        status.message()
    ));
    // PricingPodPrice with 1,500,000 (2.9 MB), 5,000,000 (10 MB) and 10,000,000 (20 MB) empty containers.
    for n in [1_500_000, 5_000_000, 10_000_000] {
        let result = rpc
            .client
            .pricing_pod_price(pod_price_request(pod_with_empty_containers(n)))
            .await;
        let status = expect_one_of(
            &format!("PricingPodPrice with {n} empty containers"),
            result,
            &[Code::ResourceExhausted],
        );
        support::procs::announce(&format!(
            "hardening: PricingPodPrice × {n} empty containers: {:?} {}",
            status.code(),
            status.message()
        ));
    }
    let after = rss_mib(pid);
    let peak = peak_rss_mib(pid);
    support::procs::announce(&format!(
        "hardening: provider VmRSS {before:.1} MiB before, {after_ids:.1} MiB after the ids, {after:.1} MiB after the large requests; peak (VmHWM) {peak:.1} MiB"
    ));

    // The process lives and answers normal calls.
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the provider died"
    );
    assert_eq!(rpc.target(&id).await.expect("NodeGroupTargetSize after"), 1);
    assert!(rpc.groups().await.iter().any(|g| g.id == id));
    let price = rpc
        .client
        .pricing_pod_price(pod_price_request(normal_pod()))
        .await
        .expect("PricingPodPrice of a normal pod")
        .into_inner()
        .price;
    assert!(price > 0.0, "{price}");
    let node = rpc
        .client
        .node_group_for_node(NodeGroupForNodeRequest {
            node: Some(grpc_node("e2e://unknown", "unknown")),
        })
        .await
        .expect("NodeGroupForNode of a normal node");
    assert_eq!(node.into_inner().node_group.unwrap_or_default().id, "");

    // Memory: decoding 3,000,000 empty nodes alone would take 864 MB, 1,500,000 empty containers
    // 7 GB. What the provider holds is its caches, buffers of at most one message per call and
    // allocator slack.
    assert!(
        peak - before < 128.0,
        "peak resident memory grew by {:.1} MiB (from {before:.1} to {peak:.1})",
        peak - before
    );
    assert!(
        after - before < 96.0,
        "resident memory grew by {:.1} MiB (from {before:.1} to {after:.1})",
        after - before
    );
}

#[tokio::test]
async fn tls_files_rotated_to_a_new_ca_are_picked_up_without_a_restart() {
    let (cp, capi) = capi().await;
    let id = priced_group(&capi, "md").await;
    let old = TlsSet::generate();
    let new = TlsSet::generate();
    let files = TlsDir::create();
    files.install(&old);
    let extra = vec![
        "--node-group-auto-discovery".to_string(),
        discovery(&capi.ns),
    ];
    let provider = start_tls_provider(cp.admin_kubeconfig(), &extra, &files, &old).await;
    let address = provider.address.clone();
    let metrics = provider.metrics_address.clone();

    // A connection made before the rotation.
    let before = support::hardening::connect_tls(&address, old.client_config())
        .await
        .expect("mTLS connection with the old CA");
    assert_eq!(node_groups_on(before.clone()).await, Ok(1));
    // A client of the new CA is refused (it does not trust the old server certificate).
    assert!(
        node_groups_over(&address, new.client_config())
            .await
            .is_err()
    );

    // Half a rotation: the new certificate without its key. It does not load; the old files stay in use.
    files.replace(&files.cert(), &new.server.cert);
    let text = poll_until(
        "the provider notices the changed files (tls_reloads_total{outcome=\"error\"})",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || {
            let metrics = metrics.clone();
            async move {
                match http_get(&metrics, "/metrics").await {
                    Ok((200, text))
                        if metric(
                            &text,
                            "capi_autoscaler_provider_tls_reloads_total{outcome=\"error\"}",
                        )
                        .is_some_and(|n| n >= 1.0) =>
                    {
                        Check::Done(text)
                    }
                    Ok((code, _)) => Check::Wait(format!("no reload error yet ({code})")),
                    Err(e) => Check::Wait(e),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
    assert_eq!(
        metric(
            &text,
            "capi_autoscaler_provider_tls_reloads_total{outcome=\"success\"}"
        ),
        Some(0.0),
        "no reload succeeded (the series is there from the start, at 0)"
    );
    assert_eq!(
        node_groups_over(&address, old.client_config()).await,
        Ok(1),
        "a half-written rotation must leave the old certificate in use"
    );

    // The rest of the rotation: key and client CA of the new CA.
    let rotated = Instant::now();
    files.replace(&files.key(), &new.server.key);
    files.replace(&files.client_ca(), &new.ca.cert_pem);
    poll_until(
        "a client trusting only the new CA, with a certificate from it, is served",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || {
            let (address, tls) = (address.clone(), new.client_config());
            async move {
                match node_groups_over(&address, tls).await {
                    Ok(n) => Check::Done(n),
                    Err(e) => Check::Wait(e),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
    support::procs::announce(&format!(
        "hardening: rotated TLS files served to new connections after {:.2}s",
        rotated.elapsed().as_secs_f64()
    ));
    // New connections with the old CA are refused both ways: the client does not trust the new
    // server certificate; a client certificate of the old CA is not accepted any more.
    assert!(
        node_groups_over(&address, old.client_config())
            .await
            .is_err()
    );
    let mixed = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&new.ca.cert_pem))
        .identity(tonic::transport::Identity::from_pem(
            &old.client.cert,
            &old.client.key,
        ))
        .domain_name("localhost");
    assert!(
        node_groups_over(&address, mixed).await.is_err(),
        "a client certificate of the old CA was accepted after the rotation"
    );
    // The connection made before the rotation goes on.
    assert_eq!(node_groups_on(before).await, Ok(1));
    let (_, text) = http_get(&metrics, "/metrics").await.expect("/metrics");
    assert!(
        metric(
            &text,
            "capi_autoscaler_provider_tls_reloads_total{outcome=\"success\"}"
        )
        .is_some_and(|n| n >= 1.0),
        "{text}"
    );
    assert!(id.starts_with("MachineDeployment/"));
}

/// The provider on namespace `capi.ns` through `kubeconfig`, its watches re-established every 2 s
/// and stale after `stale_after`, and a client of it once it serves group `id`.
async fn quick_watch_provider(
    capi: &Capi,
    kubeconfig: &Path,
    stale_after: &str,
    id: &str,
) -> (EnvProvider, Rpc) {
    let discovery = discovery(&capi.ns);
    let provider = start_provider_with_env(
        &[
            "--node-group-auto-discovery",
            &discovery,
            "--watch-timeout",
            "2s",
            "--watch-stale-after",
            stale_after,
        ],
        kubeconfig,
        &[],
    )
    .await;
    let mut rpc = Rpc::connect(&provider).await;
    rpc.wait_ids(&capi.ns, &ids(&[id])).await;
    (provider, rpc)
}

#[tokio::test]
async fn a_revoked_watch_makes_the_provider_not_serving_with_the_reason_and_writes_unavailable() {
    let (cp, capi) = capi().await;
    let id = priced_group(&capi, "md").await;
    let admin = cp.admin_client().await;
    apply_shipped_cluster_role(&admin).await;
    let (_, kubeconfig) = cp.restricted_identity(SHIPPED_ROLE).await;
    // Watches re-established every 2 s: a revoked permission shows within that.
    let (provider, mut rpc) = quick_watch_provider(&capi, &kubeconfig, "10s", &id).await;
    rpc.increase(&id, 1)
        .await
        .expect("IncreaseSize while in sync");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);
    let (code, body) = http_get(&provider.metrics_address, "/readyz")
        .await
        .expect("/readyz");
    assert_eq!((code, body.trim()), (200, "ready"));

    // Take the provider's permissions away.
    let bindings = revoke_bindings(&admin, &user_of(&kubeconfig)).await;
    let revoked = Instant::now();
    let metrics = provider.metrics_address.clone();
    let reasons = poll_until(
        "NOT_SERVING and /readyz naming the MachineDeployment, MachineSet and Machine watches",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || {
            let health = provider.health(CLOUD_PROVIDER_SERVICE);
            let metrics = metrics.clone();
            async move {
                let status = match health.await {
                    Ok(s) => s,
                    Err(e) => return Check::Wait(e),
                };
                let (code, body) = match http_get(&metrics, "/readyz").await {
                    Ok(r) => r,
                    Err(e) => return Check::Wait(e),
                };
                let all = ["machinedeployments.", "machinesets.", "machines."]
                    .iter()
                    .all(|w| body.contains(&format!("watch of {w}cluster.x-k8s.io")));
                if status == ServingStatus::NotServing && code == 503 && all {
                    Check::Done(body)
                } else {
                    Check::Wait(format!("health {status:?}, /readyz {code}: {body}"))
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
    support::procs::announce(&format!(
        "hardening: NOT_SERVING {:.2}s after the ClusterRoleBinding was deleted; /readyz:\n{reasons}",
        revoked.elapsed().as_secs_f64()
    ));
    assert!(
        reasons.contains("forbidden") && reasons.contains("(403)"),
        "{reasons}"
    );
    // The whole server says so too.
    assert_eq!(provider.health("").await, Ok(ServingStatus::NotServing));

    // Writes are refused with the reason; nothing is written.
    for (what, result) in [
        ("IncreaseSize", rpc.increase(&id, 1).await),
        ("DecreaseTargetSize", rpc.decrease(&id, -1).await),
        (
            "DeleteNodes",
            rpc.delete_nodes(&id, vec![grpc_node("e2e://x", "x")]).await,
        ),
    ] {
        let message = expect_code(what, result, Code::Unavailable);
        assert!(
            message.contains("forbidden") && message.contains("watch of"),
            "{what}: {message}"
        );
    }
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);
    // Reads still answer from the last complete view.
    assert_eq!(rpc.target(&id).await.expect("NodeGroupTargetSize"), 2);
    let (_, text) = http_get(&metrics, "/metrics").await.expect("/metrics");
    let stale = metric(
        &text,
        "capi_autoscaler_provider_watch_stale_seconds{resource=\"machines.cluster.x-k8s.io\"}",
    );
    assert!(stale.is_some_and(|s| s >= 0.0), "{text}");

    // Give them back: SERVING again, writes again.
    restore_bindings(&admin, &bindings).await;
    let restored = Instant::now();
    poll_until(
        "SERVING again and /readyz 200",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || {
            let health = provider.health(CLOUD_PROVIDER_SERVICE);
            let metrics = metrics.clone();
            async move {
                let status = health.await;
                let readyz = http_get(&metrics, "/readyz").await;
                match (status, readyz) {
                    (Ok(ServingStatus::Serving), Ok((200, _))) => Check::Done(()),
                    other => Check::Wait(format!("{other:?}")),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
    support::procs::announce(&format!(
        "hardening: SERVING again {:.2}s after the ClusterRoleBinding came back",
        restored.elapsed().as_secs_f64()
    ));
    rpc.increase(&id, 1)
        .await
        .expect("IncreaseSize after the permissions came back");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    let (_, text) = http_get(&metrics, "/metrics").await.expect("/metrics");
    assert_eq!(
        metric(
            &text,
            "capi_autoscaler_provider_watch_stale_seconds{resource=\"machines.cluster.x-k8s.io\"}",
        ),
        Some(0.0),
        "{text}"
    );
}

#[tokio::test]
async fn check_reports_a_forbidden_nodes_watch_at_once() {
    let (cp, capi) = capi().await;
    priced_group(&capi, "md").await;
    // The workload cluster's identity may read nothing, Nodes included.
    let admin = cp.admin_client().await;
    apply_cluster_role(
        &admin,
        "hardening-nothing",
        ClusterRole {
            rules: Some(vec![]),
            ..Default::default()
        },
    )
    .await;
    let (_, workload) = cp.restricted_identity("hardening-nothing").await;
    let discovery = discovery(&capi.ns);
    let management = cp.admin_kubeconfig().display().to_string();
    let workload = workload.display().to_string();
    let run = run_cli(
        &[
            "check",
            "-o",
            "json",
            "--cloud-config",
            &management,
            "--kubeconfig",
            &workload,
            "--node-group-auto-discovery",
            &discovery,
        ],
        Duration::from_secs(30),
    )
    .await;
    support::procs::announce(&format!(
        "hardening: check with a forbidden Nodes watch exited {:?} after {:.2}s",
        run.code,
        run.elapsed.as_secs_f64()
    ));
    assert_eq!(run.code, Some(2), "{}", run.describe());
    // Not the 60 s listing timeout: at once.
    assert!(run.elapsed < Duration::from_secs(15), "{}", run.describe());
    assert!(
        run.stderr.contains("watch of nodes")
            && run.stderr.contains("forbidden")
            && run.stderr.contains("(403)"),
        "{}",
        run.describe()
    );
}

/// The API unreachable for longer than `--watch-stale-after` (not a 403: connections refused): NOT_SERVING
/// once the bound has passed, and not before; `/readyz` says which watches fail, for how long, and why;
/// back → SERVING.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_gone_longer_than_the_stale_bound_makes_the_provider_not_serving() {
    let (cp, capi) = capi().await;
    let id = priced_group(&capi, "md").await;
    let apiserver = socket_addr_of(&cp.server);
    let mut proxy = TcpProxy::start("127.0.0.1:0".parse().expect("an address"), apiserver)
        .await
        .expect("start the proxy");
    let proxy_addr = proxy.addr;
    let kubeconfig = kubeconfig_with_server(
        cp.admin_kubeconfig(),
        &cp.server,
        &format!("https://{proxy_addr}"),
    );
    let (provider, mut rpc) = quick_watch_provider(&capi, &kubeconfig, "5s", &id).await;

    let gone = Instant::now();
    proxy.stop().await;
    let metrics = provider.metrics_address.clone();
    let reasons = poll_until(
        "NOT_SERVING after the API has been gone for the stale bound",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || {
            let health = provider.health(CLOUD_PROVIDER_SERVICE);
            let metrics = metrics.clone();
            async move {
                match (health.await, http_get(&metrics, "/readyz").await) {
                    (Ok(ServingStatus::NotServing), Ok((503, body))) => Check::Done(body),
                    other => Check::Wait(format!("{other:?}")),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
    let after = gone.elapsed();
    support::procs::announce(&format!(
        "hardening: API gone: NOT_SERVING after {:.2}s (--watch-stale-after 5s, --watch-timeout 2s); /readyz:\n{reasons}",
        after.as_secs_f64()
    ));
    // Not before the bound (a watch notices within --watch-timeout, then fails for 5 s), not much later.
    assert!(after >= Duration::from_secs(5), "{after:?}");
    assert!(
        reasons.contains("watch of machines.cluster.x-k8s.io: out of sync, failing for"),
        "{reasons}"
    );
    let message = expect_code(
        "IncreaseSize",
        rpc.increase(&id, 1).await,
        Code::Unavailable,
    );
    assert!(message.contains("watch of"), "{message}");

    let _proxy = TcpProxy::restart(proxy_addr, apiserver).await;
    let back = Instant::now();
    poll_until(
        "SERVING again once the API is back",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || {
            let health = provider.health(CLOUD_PROVIDER_SERVICE);
            async move {
                match health.await {
                    Ok(ServingStatus::Serving) => Check::Done(()),
                    other => Check::Wait(format!("{other:?}")),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
    support::procs::announce(&format!(
        "hardening: API back: SERVING after {:.2}s",
        back.elapsed().as_secs_f64()
    ));
    rpc.increase(&id, 1)
        .await
        .expect("IncreaseSize with the API back");
}
