//! What an operator sees of the provider's work besides the groups themselves: a Normal Event on the
//! group for every size change it writes (who asked, from, to), recorded best effort (a write stands
//! when its Event cannot be recorded), and the /metrics a running provider serves, with the names
//! deploy/monitoring/'s alerts and dashboard use.

use crate::support;

use std::time::Duration;

use k8s_openapi::api::events::v1::Event;
use support::capi::{
    Capi, Kind, Owner, Scalable, apply_cluster_role, fresh_capi, grpc_node, provider_for_namespace,
    shipped_cluster_role,
};
use support::{Check, Setup, monitoring, poll_until};

use crate::nodegroups::API_QUIET;

const SETUP: Setup = Setup::shipped();
const VERSION: &str = "v1beta2";

/// The `ReplicasChanged` Events about `name`, once there are `count` (20 s at most).
async fn size_events(capi: &Capi, name: &str, count: usize) -> Vec<Event> {
    poll_until(
        &format!("{count} ReplicasChanged Event(s) on {name}"),
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            let events: Vec<Event> = capi
                .events_about(name)
                .await
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("ReplicasChanged"))
                .collect();
            if events.len() >= count {
                Check::Done(events)
            } else {
                Check::Wait(format!("{} so far", events.len()))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Asserts `event` is the provider's Normal Event about `kind`/`name` saying `note`, for `action`.
async fn assert_size_event(
    capi: &Capi,
    event: &Event,
    kind: Kind,
    name: &str,
    action: &str,
    note: &str,
) {
    let object = capi.api(kind).get(name).await.expect("the group object");
    let regarding = event.regarding.as_ref().expect("regarding");
    assert_eq!(
        (
            event.type_.as_deref(),
            event.action.as_deref(),
            event.note.as_deref(),
            event.reporting_controller.as_deref(),
        ),
        (
            Some("Normal"),
            Some(action),
            Some(note),
            Some("capi-autoscaler-provider")
        ),
        "{event:?}"
    );
    assert_eq!(
        (
            regarding.kind.as_deref(),
            regarding.name.as_deref(),
            regarding.namespace.as_deref(),
            regarding.uid.as_deref(),
        ),
        (
            Some(kind.as_str()),
            Some(name),
            Some(capi.ns.as_str()),
            object.metadata.uid.as_deref()
        ),
        "{event:?}"
    );
}

#[tokio::test]
async fn every_size_change_written_is_a_normal_event_on_the_group_saying_who_asked_from_and_to() {
    let _shared = API_QUIET.read().await;
    let (cp, capi) = fresh_capi(SETUP, VERSION).await;
    capi.create_deployment(&Scalable::md("md").bounds(1, 5).replicas(1), false)
        .await;
    capi.create(&Scalable::ms("ms").bounds(0, 3).replicas(2))
        .await;
    capi.create_machine(&capi.running("s0", Owner::MachineSet("ms".into())))
        .await;
    capi.create_machine(&capi.running("s1", Owner::MachineSet("ms".into())))
        .await;
    let (pa, pb) = (capi.provider_id("mp-a"), capi.provider_id("mp-b"));
    capi.create(
        &Scalable::mp("mp")
            .bounds(0, 6)
            .replicas(4)
            .provider_ids(&[pa.clone(), pb.clone()]),
    )
    .await;
    let (_provider, mut rpc) = provider_for_namespace(cp, &capi.ns).await;

    rpc.increase(&capi.id(Kind::MachineDeployment, "md"), 2)
        .await
        .expect("IncreaseSize +2");
    let events = size_events(&capi, "md", 1).await;
    assert_size_event(
        &capi,
        &events[0],
        Kind::MachineDeployment,
        "md",
        "IncreaseSize",
        "replicas 1 → 3 for cluster-autoscaler IncreaseSize",
    )
    .await;

    rpc.delete_nodes(&capi.id(Kind::MachineSet, "ms"), vec![capi.grpc_node("s0")])
        .await
        .expect("DeleteNodes s0");
    let events = size_events(&capi, "ms", 1).await;
    assert_size_event(
        &capi,
        &events[0],
        Kind::MachineSet,
        "ms",
        "DeleteNodes",
        "replicas 2 → 1 for cluster-autoscaler DeleteNodes (s0)",
    )
    .await;

    // A MachinePool: capacity not yet a node cancelled, then a node without a Machine removed.
    let mp = capi.id(Kind::MachinePool, "mp");
    rpc.decrease(&mp, -2).await.expect("DecreaseTargetSize -2");
    rpc.delete_nodes(&mp, vec![grpc_node(&pb, "mp-b")])
        .await
        .expect("DeleteNodes mp-b");
    let mut events = size_events(&capi, "mp", 2).await;
    events.sort_by_key(|e| e.note.clone());
    assert_size_event(
        &capi,
        &events[1],
        Kind::MachinePool,
        "mp",
        "DecreaseTargetSize",
        "replicas 4 → 2 for cluster-autoscaler DecreaseTargetSize",
    )
    .await;
    let note = events[0].note.clone().unwrap_or_default();
    assert!(
        note.starts_with("replicas 2 → 1 for cluster-autoscaler DeleteNodes (id:")
            && note.contains("mp-b"),
        "{note}"
    );
    assert_eq!(capi.replicas(Kind::MachinePool, "mp").await, 1);
}

#[tokio::test]
async fn a_size_change_stands_when_its_event_cannot_be_recorded() {
    let _shared = API_QUIET.read().await;
    let (cp, capi) = fresh_capi(SETUP, VERSION).await;
    // The shipped ClusterRole without its Events rule: every Event the provider records is refused.
    let mut role = shipped_cluster_role();
    role.rules
        .as_mut()
        .expect("rules")
        .retain(|r| !r.api_groups.iter().flatten().any(|g| g == "events.k8s.io"));
    let name = format!("no-events-{}", capi.ns);
    apply_cluster_role(&capi.client, &name, role).await;
    let (_client, kubeconfig) = cp.restricted_identity(&name).await;
    capi.create_deployment(&Scalable::md("md").bounds(1, 5).replicas(1), false)
        .await;
    let discovery = format!("clusterapi:namespace={}", capi.ns);
    let provider =
        support::start_provider(&["--node-group-auto-discovery", &discovery], &kubeconfig).await;
    let mut rpc = support::capi::Rpc::connect(&provider).await;
    let id = capi.id(Kind::MachineDeployment, "md");

    rpc.increase(&id, 2)
        .await
        .expect("IncreaseSize +2 without Events");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 3);
    rpc.increase(&id, 1)
        .await
        .expect("IncreaseSize +1 without Events");
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 4);
    assert_eq!(rpc.target(&id).await.unwrap(), 4);
    // Refused, not recorded: none appears (where one is allowed it shows within a second).
    let appeared = poll_until(
        "a ReplicasChanged Event despite the refusal",
        Duration::from_secs(5),
        Duration::from_millis(200),
        || async {
            let events = capi.events_about("md").await;
            if events.is_empty() {
                Check::Wait("none".into())
            } else {
                Check::Done(events)
            }
        },
    )
    .await;
    assert!(appeared.is_err(), "{appeared:?}");
}

#[tokio::test]
async fn the_running_provider_serves_every_metric_the_alerts_and_dashboard_use() {
    let _shared = API_QUIET.read().await;
    let (cp, capi) = fresh_capi(SETUP, VERSION).await;
    capi.create_deployment(&Scalable::md("md").bounds(1, 5).replicas(1), false)
        .await;
    // A small message limit, so that one call is refused by it: every family has a series.
    let discovery = format!("clusterapi:namespace={}", capi.ns);
    let provider = support::start_provider(
        &[
            "--node-group-auto-discovery",
            &discovery,
            "--max-message-size",
            "4Ki",
        ],
        cp.admin_kubeconfig(),
    )
    .await;
    let mut rpc = support::capi::Rpc::connect(&provider).await;
    let id = capi.id(Kind::MachineDeployment, "md");
    rpc.increase(&id, 2).await.expect("IncreaseSize +2");
    let mut big = grpc_node(&capi.provider_id("x"), "x");
    big.labels.insert("padding".into(), "x".repeat(8 << 10));
    support::capi::expect_code(
        "DeleteNodes over --max-message-size",
        rpc.delete_nodes(&id, vec![big]).await,
        tonic::Code::ResourceExhausted,
    );

    let (code, text) = support::procs::http_get(&provider.metrics_address, "/metrics")
        .await
        .expect("GET /metrics");
    assert_eq!(code, 200, "{text}");
    let exported = monitoring::exported_names(&text);
    let wrong = monitoring::unknown_metrics(&exported);
    assert!(wrong.is_empty(), "{}\n/metrics:\n{text}", wrong.join("\n"));

    let value = |name: &str, labels: &[(&str, &str)]| {
        support::autoscaler::metric_sum(&text, &format!("capi_autoscaler_provider_{name}"), labels)
    };
    let group = [("node_group", id.as_str())];
    assert_eq!(
        (
            value("node_group_target_size", &group),
            value("node_group_min_size", &group),
            value("node_group_max_size", &group),
        ),
        (3.0, 1.0, 5.0),
        "{text}"
    );
    let write = [("operation", "increase-size"), ("outcome", "ok")];
    assert_eq!(value("api_writes_total", &write), 1.0, "{text}");
    assert_eq!(
        value("api_write_duration_seconds_count", &write),
        1.0,
        "{text}"
    );
    assert!(
        value("api_write_duration_seconds_sum", &write) > 0.0,
        "{text}"
    );
    assert_eq!(value("ready", &[]), 1.0, "{text}");
    assert_eq!(
        value(
            "grpc_rejected_total",
            &[
                ("method", "NodeGroupDeleteNodes"),
                ("reason", "message-size")
            ]
        ),
        1.0,
        "{text}"
    );
    assert_eq!(value("problems", &[]), 0.0, "{text}");
}
