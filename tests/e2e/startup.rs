//! No answer from an incomplete view: a client that races the provider's start at 10,000 Machines
//! gets UNAVAILABLE (which CA retries) or a complete, correct answer, never a partial one: every OK
//! NodeGroups lists every group, every OK NodeGroupForNode maps its node.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::cloud_provider_client::CloudProviderClient;
use capi_autoscaler_provider::proto::{NodeGroupForNodeRequest, NodeGroupsRequest};
use futures::StreamExt as _;
use kube::api::{DynamicObject, PostParams};
use support::capi::{Capi, Kind, Scalable, grpc_node};
use support::{CAPI_GROUP, Setup, control_plane, procs};
use tonic::Code;

const GROUPS: usize = 50;
const MACHINES: usize = 10_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_racing_the_start_gets_unavailable_or_complete_answers() {
    let cp = control_plane(Setup::shipped());
    let client = cp.admin_client().await;
    let ns = cp.fresh_namespace().await;
    let capi = Arc::new(Capi::new(client.clone(), &ns, CAPI_GROUP, "v1beta2"));
    let started = Instant::now();
    let mut set_uids = Vec::new();
    for g in 0..GROUPS {
        let md = Scalable::md(&format!("md-{g}"))
            .bounds(0, 1_000)
            .replicas((MACHINES / GROUPS) as i64);
        capi.create_deployment(&md, false).await;
        let set = capi
            .api(Kind::MachineSet)
            .get(&Capi::set_of(&format!("md-{g}")))
            .await
            .expect("get the MachineSet");
        set_uids.push((
            set.metadata.name.clone().unwrap_or_default(),
            set.metadata.uid.clone().unwrap_or_default(),
        ));
    }
    let set_uids = Arc::new(set_uids);
    futures::stream::iter(0..MACHINES)
        .map(|i| {
            let capi = Arc::clone(&capi);
            let set_uids = Arc::clone(&set_uids);
            async move {
                let g = i % GROUPS;
                let (set, uid) = &set_uids[g];
                let name = format!("m-{i}");
                let ar = capi.resource(Kind::Machine);
                let mut object = DynamicObject::new(&name, &ar).data(serde_json::json!({"spec": {
                    "clusterName": "e2e",
                    "bootstrap": {"dataSecretName": "b"},
                    "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "E2EMachine", "name": name},
                    "providerID": format!("e2e:///{}/{name}", capi.ns),
                }}));
                object.metadata.labels = Some(
                    [
                        (capi.key("cluster-name"), "e2e".to_string()),
                        (capi.key("deployment-name"), format!("md-{g}")),
                        (capi.key("set-name"), set.clone()),
                    ]
                    .into(),
                );
                object.metadata.owner_references = Some(vec![
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                        api_version: format!("{CAPI_GROUP}/v1beta2"),
                        kind: "MachineSet".into(),
                        name: set.clone(),
                        uid: uid.clone(),
                        controller: Some(true),
                        ..Default::default()
                    },
                ]);
                capi.api(Kind::Machine)
                    .create(&PostParams::default(), &object)
                    .await
                    .unwrap_or_else(|e| panic!("create Machine {name}: {e}"));
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
    procs::announce(&format!(
        "e2e: startup race: {GROUPS} groups, {MACHINES} Machines created in {:.1}s",
        started.elapsed().as_secs_f64()
    ));

    // Start the provider and, at once, call it until both RPCs have answered OK several times.
    let discovery = format!("clusterapi:namespace={ns}");
    let provider = support::provider::spawn_provider(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
    );
    let endpoint = format!("http://{}", provider.address);
    let t0 = Instant::now();
    let (mut unavailable, mut complete) = (0u32, 0u32);
    let sample: Vec<usize> = (0..MACHINES).step_by(997).collect();
    while complete < 5 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no complete answer within 120 s ({unavailable} UNAVAILABLE)\n{}",
            provider.log_contents()
        );
        let Ok(channel) = tonic::transport::Endpoint::from_shared(endpoint.clone())
            .expect("endpoint")
            .connect_timeout(Duration::from_millis(200))
            .connect()
            .await
        else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let mut rpc = CloudProviderClient::new(channel);
        match rpc.node_groups(NodeGroupsRequest {}).await {
            Ok(answer) => {
                let groups = answer.into_inner().node_groups;
                let ours = groups
                    .iter()
                    .filter(|g| g.id.contains(&format!("/{ns}/")))
                    .count();
                assert_eq!(ours, GROUPS, "an OK NodeGroups lists every group");
            }
            Err(s) if s.code() == Code::Unavailable => {
                unavailable += 1;
                continue;
            }
            Err(s) => panic!("NodeGroups: {s:?}"),
        }
        for i in &sample {
            let name = format!("m-{i}");
            let node = grpc_node(&format!("e2e:///{ns}/{name}"), &name);
            let answer = rpc
                .node_group_for_node(NodeGroupForNodeRequest { node: Some(node) })
                .await;
            match answer.map(|a| a.into_inner().node_group.unwrap_or_default()) {
                Ok(group) => assert_eq!(
                    group.id,
                    capi.id(Kind::MachineDeployment, &format!("md-{}", i % GROUPS)),
                    "an OK NodeGroupForNode maps {name}"
                ),
                Err(s) if s.code() == Code::Unavailable => unavailable += 1,
                Err(s) => panic!("NodeGroupForNode: {s:?}"),
            }
        }
        complete += 1;
    }
    procs::announce(&format!(
        "e2e: startup race: first complete answers {:.2}s after the start, {unavailable} UNAVAILABLE before",
        t0.elapsed().as_secs_f64()
    ));
}

/// The scale RPCs are refused off loopback without client certificates: the process stops at once
/// with an error saying what to do, before it reads a kubeconfig or binds anything.
#[test]
fn serving_writes_off_loopback_without_client_certificates_is_refused_at_start() {
    let output = std::process::Command::new(support::provider::PROVIDER_BIN)
        .args([
            "serve",
            "--address=0.0.0.0:1",
            "--metrics-address=",
            "--cloud-config=/nonexistent/kubeconfig",
        ])
        .env("RUST_LOG", "info")
        .output()
        .expect("run the provider");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("refusing to serve the scale RPCs")
            && stderr.contains("--tls-client-ca")
            && stderr.contains("--allow-unauthenticated-writes"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("/nonexistent/kubeconfig"),
        "refused before the kubeconfig is read: {stderr}"
    );
}
