//! Unit tests of `grpc`: the handlers over a fixed snapshot, the conversions.

use super::convert::*;
use super::*;
use crate::capi::ScalableKind;
use crate::options::GroupOptions;
use prost::Message;
use std::time::Duration;

/// NodeGroupTemplateNodeInfoResponse as CA ≤ 1.34.1 declares it: `k8s.io.api.core.v1.Node nodeInfo = 1`.
#[derive(Clone, PartialEq, prost::Message)]
struct OldTemplateResponse {
    #[prost(message, optional, tag = "1")]
    node_info: Option<k8s_pb::api::core::v1::Node>,
}

/// meta.v1.Duration: `optional int64 duration = 1` (nanoseconds).
#[derive(Clone, PartialEq, prost::Message)]
struct OldDuration {
    #[prost(int64, optional, tag = "1")]
    duration: Option<i64>,
}

/// NodeGroupAutoscalingOptions as CA ≤ 1.34.1 declares it.
#[derive(Clone, PartialEq, prost::Message)]
struct OldOptions {
    #[prost(double, tag = "1")]
    scale_down_utilization_threshold: f64,
    #[prost(double, tag = "2")]
    scale_down_gpu_utilization_threshold: f64,
    #[prost(message, optional, tag = "3")]
    scale_down_unneeded_time: Option<OldDuration>,
    #[prost(message, optional, tag = "4")]
    scale_down_unready_time: Option<OldDuration>,
    #[prost(message, optional, tag = "5")]
    max_node_provision_time: Option<OldDuration>,
}

/// meta.v1.Time: `optional int64 seconds = 1; optional int32 nanos = 2`.
#[derive(Clone, PartialEq, prost::Message)]
struct OldTime {
    #[prost(int64, optional, tag = "1")]
    seconds: Option<i64>,
    #[prost(int32, optional, tag = "2")]
    nanos: Option<i32>,
}

/// PricingPodPriceRequest as CA ≤ 1.34.1 sends it.
#[derive(Clone, PartialEq, prost::Message)]
struct OldPodPriceRequest {
    #[prost(message, optional, tag = "1")]
    pod: Option<k8s_pb::api::core::v1::Pod>,
    #[prost(message, optional, tag = "2")]
    start_time: Option<OldTime>,
    #[prost(message, optional, tag = "3")]
    end_time: Option<OldTime>,
}

fn node() -> k8s_pb::api::core::v1::Node {
    k8s_pb::api::core::v1::Node {
        metadata: Some(k8s_pb::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("template".into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn an_old_ca_reads_the_template_from_the_legacy_field() {
    let bytes = prost::bytes::Bytes::from(node().encode_to_vec());
    let response = NodeGroupTemplateNodeInfoResponse {
        node_info: bytes.clone(),
        node_bytes: bytes,
    };
    let old = OldTemplateResponse::decode(response.encode_to_vec().as_slice()).unwrap();
    assert_eq!(old.node_info, Some(node()));
    let new =
        NodeGroupTemplateNodeInfoResponse::decode(response.encode_to_vec().as_slice()).unwrap();
    assert_eq!(
        k8s_pb::api::core::v1::Node::decode(new.node_bytes).unwrap(),
        node()
    );
}

fn defaults() -> NodeGroupAutoscalingOptions {
    NodeGroupAutoscalingOptions {
        scale_down_utilization_threshold: 0.5,
        scale_down_gpu_utilization_threshold: 0.5,
        scale_down_unneeded_duration: Some(wire_duration(Duration::from_secs(600))),
        scale_down_unready_duration: Some(wire_duration(Duration::from_secs(1200))),
        max_node_provision_duration: Some(wire_duration(Duration::from_secs(900))),
        zero_or_max_node_scaling: true,
        ignore_daemon_sets_utilization: true,
        ..Default::default()
    }
}

#[test]
fn options_without_annotations_answer_empty_so_ca_keeps_its_defaults() {
    let r = options_response(None, Some(&defaults())).unwrap();
    assert_eq!(r.node_group_autoscaling_options, None);
    assert!(r.encode_to_vec().is_empty());
}

#[test]
fn options_override_their_field_and_echo_every_other_default_in_both_layouts() {
    let overrides = GroupOptions {
        scale_down_unneeded_time: Some(Duration::from_secs(300)),
        scale_down_utilization_threshold: Some(0.7),
        ..Default::default()
    };
    let r = options_response(Some(&overrides), Some(&defaults())).unwrap();
    let o = r.node_group_autoscaling_options.unwrap();
    assert_eq!(o.scale_down_utilization_threshold, 0.7);
    assert_eq!(o.scale_down_gpu_utilization_threshold, 0.5);
    assert_eq!(
        o.scale_down_unneeded_duration,
        Some(wire_duration(Duration::from_secs(300)))
    );
    assert_eq!(
        o.scale_down_unready_duration,
        Some(wire_duration(Duration::from_secs(1200)))
    );
    assert_eq!(
        o.max_node_provision_duration,
        Some(wire_duration(Duration::from_secs(900)))
    );
    assert!(o.zero_or_max_node_scaling && o.ignore_daemon_sets_utilization);
    // An old CA reads fields 3/4/5 as meta.v1.Duration.
    let old = OldOptions::decode(o.encode_to_vec().as_slice()).unwrap();
    assert_eq!(old.scale_down_utilization_threshold, 0.7);
    assert_eq!(
        old.scale_down_unneeded_time.and_then(|d| d.duration),
        Some(300_000_000_000)
    );
    assert_eq!(
        old.scale_down_unready_time.and_then(|d| d.duration),
        Some(1_200_000_000_000)
    );
    assert_eq!(
        old.max_node_provision_time.and_then(|d| d.duration),
        Some(900_000_000_000)
    );
    assert!(options_response(Some(&overrides), None).is_err());
}

#[test]
fn defaults_from_an_old_ca_are_read_from_the_legacy_durations() {
    let old = OldOptions {
        scale_down_utilization_threshold: 0.4,
        scale_down_unneeded_time: Some(OldDuration {
            duration: Some(60_000_000_000),
        }),
        max_node_provision_time: Some(OldDuration {
            duration: Some(120_000_000_000),
        }),
        ..Default::default()
    };
    let wire = NodeGroupAutoscalingOptions::decode(old.encode_to_vec().as_slice()).unwrap();
    let d = defaults_from_wire(&wire);
    assert_eq!(d.scale_down_utilization_threshold, 0.4);
    assert_eq!(d.scale_down_unneeded_time, Duration::from_secs(60));
    assert_eq!(d.max_node_provision_time, Duration::from_secs(120));
    assert_eq!(d.scale_down_unready_time, Duration::ZERO);
}

#[test]
fn an_old_pod_price_request_is_understood() {
    let pod = k8s_pb::api::core::v1::Pod::default();
    let old = OldPodPriceRequest {
        pod: Some(pod.clone()),
        start_time: Some(OldTime {
            seconds: Some(1_000),
            nanos: None,
        }),
        end_time: Some(OldTime {
            seconds: Some(4_600),
            nanos: None,
        }),
    };
    let r = PricingPodPriceRequest::decode(old.encode_to_vec().as_slice()).unwrap();
    assert!(r.pod_bytes.is_empty());
    assert_eq!(
        k8s_pb::api::core::v1::Pod::decode(r.pod.as_slice()).unwrap(),
        pod
    );
    let (start, end) = period(
        (r.start_timestamp.as_ref(), r.start_time.as_ref()),
        (r.end_timestamp.as_ref(), r.end_time.as_ref()),
    )
    .unwrap();
    assert_eq!(pricing::hours_between(start, end), 1.0);
}

/// CA asks for the groups every loop: the answer is the snapshot's groups, encoded once for each
/// snapshot (clones share the bytes), and a changed snapshot is answered with its own groups.
#[test]
fn the_node_groups_answer_is_the_served_snapshots_groups_encoded_once() {
    use crate::snapshot::Settings;
    let groups = |snapshot: &Arc<Snapshot>| -> Vec<NodeGroup> {
        snapshot.groups.values().map(wire_group).collect()
    };
    let read = |answer: &NodeGroupsResponse| {
        NodeGroupsResponse::decode(answer.encode_to_vec().as_slice())
            .unwrap()
            .node_groups
    };
    let encoded = EncodedGroups::default();
    let one = Arc::new(
        objects::index_of(
            vec![(ScalableKind::MachineDeployment, objects::md(2))],
            vec![],
        )
        .snapshot(&Settings::default()),
    );
    let first = encoded.answer(&one);
    assert_eq!(read(&first), groups(&one));
    assert_eq!(read(&first)[0].max_size, 5);
    assert_eq!(first, encoded.answer(&one), "the same bytes again");
    let mut md = objects::md(3);
    md["metadata"]["annotations"][Keys::default().max_size.as_str()] = "7".into();
    let two = Arc::new(
        objects::index_of(vec![(ScalableKind::MachineDeployment, md)], vec![])
            .snapshot(&Settings::default()),
    );
    let second = encoded.answer(&two);
    assert_eq!(read(&second), groups(&two));
    assert_eq!(read(&second)[0].max_size, 7);
}

/// Objects of namespace `ns` for handler tests: MachineDeployment md (min 1, max 5).
mod objects {
    use crate::cache::Index;
    use crate::capi::{Keys, Machine, ScalableKind, ScalableResource};
    use serde_json::{Value, json};
    use std::sync::Arc;

    pub fn md(replicas: i32) -> Value {
        let keys = Keys::default();
        json!({
            "kind": "MachineDeployment",
            "metadata": {
                "namespace": "ns", "name": "md", "resourceVersion": "1",
                "annotations": {keys.min_size.as_str(): "1", keys.max_size.as_str(): "5"},
            },
            "spec": {"replicas": replicas},
        })
    }

    /// A running Machine of MachineSet `set` with a Node of its name.
    pub fn machine(name: &str, set: &str) -> Value {
        json!({
            "kind": "Machine",
            "metadata": {
                "namespace": "ns", "name": name, "resourceVersion": "1",
                "ownerReferences": [{"kind": "MachineSet", "name": set}],
            },
            "spec": {"providerID": format!("e2e:///ns/{name}")},
            "status": {"nodeRef": {"name": name}},
        })
    }

    pub fn index_of(resources: Vec<(ScalableKind, Value)>, machines: Vec<Value>) -> Index {
        let keys = Keys::default();
        let mut index = Index::default();
        for (kind, object) in resources {
            let r = ScalableResource::from_json(kind, &keys, &object).unwrap();
            index.apply_resource(kind, r.key.clone(), Ok(Arc::new(r)));
        }
        for object in machines {
            let m = Machine::from_json(&keys, &object).unwrap();
            index.apply_machine(m.key.clone(), Ok(Arc::new(m)));
        }
        index
    }
}

/// Scale calls on group `id` as CA makes them, for any backend.
mod calls {
    use super::super::*;

    pub async fn increase<B: Backend>(service: &Service<B>, id: &str) -> Result<(), Status> {
        service
            .node_group_increase_size(Request::new(NodeGroupIncreaseSizeRequest {
                id: id.into(),
                delta: 1,
            }))
            .await
            .map(drop)
    }

    pub async fn decrease<B: Backend>(service: &Service<B>, id: &str) -> Result<(), Status> {
        service
            .node_group_decrease_target_size(Request::new(NodeGroupDecreaseTargetSizeRequest {
                id: id.into(),
                delta: -1,
            }))
            .await
            .map(drop)
    }
}

mod rollout {
    use super::super::*;
    use super::calls;
    use super::objects::{index_of, machine, md};
    use crate::apis::CapiApis;
    use crate::capi::ScalableKind;
    use crate::capi::rollout::REVISION_ANNOTATION;
    use crate::scale::Actuator;
    use crate::snapshot::Settings;
    use crate::watch::Store;
    use prost::Message;
    use serde_json::{Value, json};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A management-cluster API that drops every connection: any API call fails, and the count
    /// tells whether one was tried.
    async fn counting_api() -> (kube::Client, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let count = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&count);
        tokio::spawn(async move {
            while let Ok((connection, _)) = listener.accept().await {
                seen.fetch_add(1, Ordering::SeqCst);
                drop(connection);
            }
        });
        let config = kube::Config::new(format!("http://{address}").parse().unwrap());
        (kube::Client::try_from(config).unwrap(), count)
    }

    fn machine_set(name: &str, revision: &str, spec: i32, status: i32) -> Value {
        json!({
            "kind": "MachineSet",
            "metadata": {
                "namespace": "ns", "name": name, "resourceVersion": "1",
                "annotations": {REVISION_ANNOTATION: revision},
                "ownerReferences": [{"kind": "MachineDeployment", "name": "md"}],
            },
            "spec": {"replicas": spec},
            "status": {"replicas": status},
        })
    }

    /// MachineDeployment md (min 1, max 5, replicas 4): md-new (revision 2) with two running
    /// Machines and one pending, md-old (revision 1) with the given replicas and one Machine.
    async fn service(old_spec: i32, old_status: i32) -> (Live, Arc<AtomicUsize>) {
        let mut pending = machine("p", "md-new");
        pending["spec"] = json!({});
        pending["status"] = json!({});
        let index = index_of(
            vec![
                (ScalableKind::MachineDeployment, md(4)),
                (ScalableKind::MachineSet, machine_set("md-new", "2", 3, 3)),
                (
                    ScalableKind::MachineSet,
                    machine_set("md-old", "1", old_spec, old_status),
                ),
            ],
            vec![
                machine("a", "md-new"),
                machine("b", "md-new"),
                pending,
                machine("c", "md-old"),
            ],
        );
        let (client, count) = counting_api().await;
        let metrics = Arc::new(Metrics::new());
        let store = Store::fixed(
            client,
            CapiApis::assume(crate::capi::DEFAULT_GROUP, "v1beta2"),
            Settings::default(),
            index,
            Arc::clone(&metrics),
        );
        let actuator = Arc::new(Actuator::new(store, Arc::clone(&metrics)));
        (Service::new(actuator, metrics), count)
    }

    type Live = Service<Arc<Actuator>>;

    const ID: &str = "MachineDeployment/ns/md";

    fn node(name: &str) -> ExternalGrpcNode {
        ExternalGrpcNode {
            provider_id: format!("e2e:///ns/{name}"),
            name: name.into(),
            ..Default::default()
        }
    }

    async fn served(service: &Live, node_name: &str) -> (NodeGroup, NodeGroup) {
        let answer = service
            .node_groups(Request::new(NodeGroupsRequest {}))
            .await
            .unwrap()
            .into_inner();
        // As a client reads it: the service sends the groups encoded once.
        let listed = NodeGroupsResponse::decode(answer.encode_to_vec().as_slice())
            .unwrap()
            .node_groups;
        assert_eq!(listed.len(), 1, "{listed:?}");
        let answer = service
            .node_group_for_node(Request::new(NodeGroupForNodeRequest {
                node: Some(node(node_name)),
            }))
            .await
            .unwrap()
            .into_inner();
        let for_node = NodeGroupForNodeResponse::decode(answer.encode_to_vec().as_slice())
            .unwrap()
            .node_group
            .unwrap();
        (listed[0].clone(), for_node)
    }

    async fn delete(service: &Live, node_name: &str) -> Result<(), Status> {
        service
            .node_group_delete_nodes(Request::new(NodeGroupDeleteNodesRequest {
                id: ID.into(),
                nodes: vec![node(node_name)],
            }))
            .await
            .map(drop)
    }

    #[tokio::test]
    async fn while_rolling_out_min_is_the_target_and_delete_nodes_is_refused_without_a_write() {
        let (service, api_calls) = service(1, 1).await;
        let (listed, for_node) = served(&service, "c").await;
        assert_eq!(
            (listed.id.as_str(), listed.min_size, listed.max_size),
            (ID, 4, 5)
        );
        assert_eq!(for_node, listed);
        assert!(listed.debug.contains("rolling out"), "{}", listed.debug);

        for node_name in ["c", "a"] {
            let refused = delete(&service, node_name).await.unwrap_err();
            assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
            let message = refused.message();
            assert!(
                message.contains("MachineDeployment ns/md")
                    && message.contains("MachineSet ns/md-old still has 1 replica"),
                "{message}"
            );
        }
        assert_eq!(api_calls.load(Ordering::SeqCst), 0, "DeleteNodes wrote");

        // DecreaseTargetSize is refused too (the old MachineSet would shrink, a registered node
        // going); scale-up still goes to the API (which fails here).
        let decrease = calls::decrease(&service, ID).await.unwrap_err();
        assert_eq!(
            decrease.code(),
            tonic::Code::FailedPrecondition,
            "{decrease:?}"
        );
        assert!(decrease.message().contains("rolling out"), "{decrease:?}");
        assert_eq!(
            api_calls.load(Ordering::SeqCst),
            0,
            "DecreaseTargetSize wrote"
        );
        let increase = calls::increase(&service, ID).await.unwrap_err();
        assert_eq!(increase.code(), tonic::Code::Unavailable, "{increase:?}");
        assert!(api_calls.load(Ordering::SeqCst) > 0);
    }

    #[tokio::test]
    async fn an_old_machine_set_still_holding_machines_keeps_scale_down_paused() {
        let (service, api_calls) = service(0, 1).await;
        assert_eq!(served(&service, "a").await.0.min_size, 4);
        assert_eq!(
            delete(&service, "a").await.unwrap_err().code(),
            tonic::Code::FailedPrecondition
        );
        assert_eq!(api_calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn once_the_old_machine_set_is_drained_min_and_delete_nodes_are_normal() {
        let (service, api_calls) = service(0, 0).await;
        let (listed, for_node) = served(&service, "a").await;
        assert_eq!((listed.min_size, listed.max_size), (1, 5));
        assert_eq!(for_node, listed);
        // Goes on to mark the Machine: the API is asked (and fails here).
        let failed = delete(&service, "a").await.unwrap_err();
        assert_eq!(failed.code(), tonic::Code::Unavailable, "{failed:?}");
        assert!(api_calls.load(Ordering::SeqCst) > 0);
    }
}

#[test]
fn a_price_request_without_times_is_invalid() {
    assert_eq!(
        period((None, None), (None, None)).unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
}

/// The handlers over a backend that serves a fixed snapshot and records the writes asked of it: what
/// is answered, what is refused before the writer, and how writer errors reach CA.
mod handlers {
    use super::super::*;
    use super::calls;
    use super::objects::{index_of, machine, md};
    use crate::backend::{ApiCause, NodeToDelete};
    use crate::capi::ScalableKind;
    use crate::snapshot::Settings;
    use prost::Message as _;
    use serde_json::json;
    use std::sync::Mutex;

    const ID: &str = "MachineDeployment/ns/md";

    struct Fixed {
        snapshot: Arc<Snapshot>,
        keys: Keys,
        complete: bool,
        stale: Vec<String>,
        /// What the next write answers (then Ok).
        answer: Mutex<Option<ActuatorError>>,
        writes: Mutex<Vec<String>>,
        published: tokio::sync::watch::Sender<()>,
    }

    impl Fixed {
        /// MachineDeployment ns/md (min 1, max 5, replicas 2) with Machines a and b.
        fn new() -> Fixed {
            Fixed::of(md(2))
        }

        /// `md` (MachineDeployment ns/md) with its MachineSet md-1 of 2 replicas, Machines a and b.
        fn of(md: serde_json::Value) -> Fixed {
            let settings = Settings::default();
            let ms = json!({
                "kind": "MachineSet",
                "metadata": {
                    "namespace": "ns", "name": "md-1", "resourceVersion": "1",
                    "ownerReferences": [{"kind": "MachineDeployment", "name": "md"}],
                },
                "spec": {"replicas": 2},
            });
            let index = index_of(
                vec![
                    (ScalableKind::MachineDeployment, md),
                    (ScalableKind::MachineSet, ms),
                ],
                vec![machine("a", "md-1"), machine("b", "md-1")],
            );
            Fixed {
                snapshot: Arc::new(index.snapshot(&settings)),
                keys: settings.keys.clone(),
                complete: true,
                stale: Vec::new(),
                answer: Mutex::new(None),
                writes: Mutex::new(Vec::new()),
                published: tokio::sync::watch::channel(()).0,
            }
        }

        fn write(&self, what: String) -> Result<(), ActuatorError> {
            self.writes.lock().unwrap().push(what);
            self.answer.lock().unwrap().take().map_or(Ok(()), Err)
        }

        fn writes(&self) -> Vec<String> {
            self.writes.lock().unwrap().clone()
        }
    }

    #[tonic::async_trait]
    impl Backend for Arc<Fixed> {
        fn snapshot(&self) -> Arc<Snapshot> {
            Arc::clone(&self.snapshot)
        }
        fn is_complete(&self) -> bool {
            self.complete
        }
        fn stale_for_write(&self, _: ScalableKind) -> Vec<String> {
            self.stale.clone()
        }
        fn keys(&self) -> &Keys {
            &self.keys
        }
        fn refresh(&self) {}
        fn published(&self) -> tokio::sync::watch::Receiver<()> {
            self.published.subscribe()
        }
        async fn increase_size(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
            self.write(format!("increase {id} {delta}"))
        }
        async fn decrease_target_size(&self, id: &str, delta: i32) -> Result<(), ActuatorError> {
            self.write(format!("decrease {id} {delta}"))
        }
        async fn delete_nodes(
            &self,
            id: &str,
            nodes: &[NodeToDelete],
        ) -> Result<(), ActuatorError> {
            let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
            self.write(format!("delete {id} {names:?}"))
        }
    }

    fn service(backend: Fixed) -> (Service<Arc<Fixed>>, Arc<Fixed>) {
        let backend = Arc::new(backend);
        (
            Service::new(Arc::clone(&backend), Arc::new(Metrics::new())),
            backend,
        )
    }

    async fn target_size(service: &Service<Arc<Fixed>>, id: &str) -> Result<i32, Status> {
        service
            .node_group_target_size(Request::new(NodeGroupTargetSizeRequest { id: id.into() }))
            .await
            .map(|r| r.into_inner().target_size)
    }

    /// CA's first NodeGroups after a change finds the answer encoded: each snapshot is encoded as
    /// it is published, not when CA first asks.
    #[tokio::test]
    async fn a_published_snapshot_has_its_node_groups_answer_encoded_before_ca_asks() {
        let (service, backend) = service(Fixed::new());
        let encoding = tokio::spawn(service.encode_on_publish());
        assert!(
            !service.node_groups.holds(&backend.snapshot),
            "nothing asked yet"
        );

        backend.published.send_replace(());

        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !service.node_groups.holds(&backend.snapshot) {
            assert!(
                std::time::Instant::now() < deadline,
                "the published snapshot's answer was not encoded"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        encoding.abort();
    }

    async fn group_for_node(
        service: &Service<Arc<Fixed>>,
        node: ExternalGrpcNode,
    ) -> (NodeGroupForNodeResponse, Option<NodeGroup>) {
        let answer = service
            .node_group_for_node(Request::new(NodeGroupForNodeRequest { node: Some(node) }))
            .await
            .unwrap()
            .into_inner();
        let read = NodeGroupForNodeResponse::decode(answer.encode_to_vec().as_slice()).unwrap();
        (answer, read.node_group)
    }

    fn node_of(provider_id: &str, name: &str) -> ExternalGrpcNode {
        ExternalGrpcNode {
            provider_id: provider_id.into(),
            name: name.into(),
            ..Default::default()
        }
    }

    /// CA asks for the group of every node every loop: the group is encoded on the first answer
    /// that needs it, and every NodeGroupForNode and NodeGroups answer after it sends those bytes.
    #[tokio::test]
    async fn a_group_is_encoded_once_for_every_node_group_for_node_and_node_groups_answer() {
        let (service, backend) = service(Fixed::new());
        let (a, read_a) = group_for_node(&service, node_of("e2e:///ns/a", "a")).await;
        let (b, read_b) = group_for_node(&service, node_of("e2e:///ns/b", "b")).await;

        let group = backend.snapshot.group(ID).unwrap();
        assert_eq!(read_a, Some(super::super::convert::wire_group(group)));
        assert_eq!(
            read_a.as_ref().unwrap().debug,
            "MachineDeployment/ns/md (min: 1, max: 5, replicas: 2)"
        );
        assert_eq!(read_b, read_a);
        let kept = group.encoded(|_| panic!("the group was not kept encoded by its first answer"));
        assert_eq!(a.encode_to_vec(), kept.to_vec());
        assert_eq!(b.encode_to_vec(), kept.to_vec());

        let groups = service
            .node_groups(Request::new(NodeGroupsRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            groups.encode_to_vec(),
            kept.to_vec(),
            "one group: its bytes alone"
        );
    }

    /// A node of no group gets a group with an empty id, not none: CA reads the id through it.
    #[tokio::test]
    async fn a_node_of_no_group_is_answered_with_an_empty_group() {
        let (service, _) = service(Fixed::new());
        for node in [node_of("e2e:///ns/elsewhere", "elsewhere"), node_of("", "")] {
            let (answer, read) = group_for_node(&service, node).await;
            assert_eq!(read, Some(NodeGroup::default()));
            assert_eq!(
                answer.encode_to_vec(),
                [0x0a, 0x00],
                "field 1, an empty message"
            );
        }
    }

    /// A request over --max-message-size, or one whose nodes would decode into too much memory, is
    /// refused RESOURCE_EXHAUSTED by the served stack (the limits, the library, the codec) before
    /// any handler runs, and counted; a normal one is answered.
    #[tokio::test]
    async fn hostile_requests_are_refused_before_the_handler_and_counted() {
        use tower::{Layer, Service as _};
        let backend = Arc::new(Fixed::new());
        let metrics = Arc::new(Metrics::new());
        let server = crate::proto::cloud_provider_server::CloudProviderServer::new(Service::new(
            Arc::clone(&backend),
            Arc::clone(&metrics),
        ))
        .max_decoding_message_size(1 << 20);
        let limits = crate::server::Limits::new(
            1 << 20,
            4,
            std::time::Duration::from_secs(2),
            Arc::clone(&metrics),
        );
        let mut stack = limits.layer(server);
        let call = |method: &str, message: Vec<u8>| {
            let mut framed = vec![0u8];
            framed.extend((message.len() as u32).to_be_bytes());
            framed.extend(message);
            http::Request::post(format!(
                "/clusterautoscaler.cloudprovider.v1.externalgrpc.CloudProvider/{method}"
            ))
            .header("content-type", "application/grpc")
            .body(tonic::body::Body::new(http_body_util::Full::new(
                prost::bytes::Bytes::from(framed),
            )))
            .unwrap()
        };
        let status = |response: &http::Response<tonic::body::Body>| {
            Status::from_header_map(response.headers()).unwrap_or_else(|| Status::ok(""))
        };

        let mut nodes = ID.as_bytes().to_vec();
        nodes.insert(0, ID.len() as u8);
        nodes.insert(0, 0x12); // field 2: the group id, then 500,000 empty nodes
        nodes.extend(std::iter::repeat_n([0x0a, 0x00], 500_000).flatten());
        let refused = stack
            .call(call("NodeGroupDeleteNodes", nodes))
            .await
            .unwrap();
        assert_eq!(status(&refused).code(), tonic::Code::ResourceExhausted);
        assert!(
            backend.writes().is_empty(),
            "the handler ran: {:?}",
            backend.writes()
        );

        let big = NodeGroupTargetSizeRequest {
            id: "x".repeat((1 << 20) + 1),
        };
        let refused = stack
            .call(call("NodeGroupTargetSize", big.encode_to_vec()))
            .await
            .unwrap();
        assert_eq!(status(&refused).code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            status(&refused).message(),
            "NodeGroupTargetSize: the request is larger than --max-message-size (1048576 bytes)"
        );

        let normal = NodeGroupTargetSizeRequest { id: ID.into() };
        let answered = stack
            .call(call("NodeGroupTargetSize", normal.encode_to_vec()))
            .await
            .unwrap();
        assert!(
            answered.headers().get("grpc-status").is_none(),
            "{answered:?}"
        );

        let text = metrics.encode();
        for line in [
            "capi_autoscaler_provider_grpc_rejected_total{method=\"NodeGroupDeleteNodes\",reason=\"decoded-size\"} 1",
            "capi_autoscaler_provider_grpc_rejected_total{method=\"NodeGroupTargetSize\",reason=\"message-size\"} 1",
            "capi_autoscaler_provider_grpc_requests_total{method=\"NodeGroupTargetSize\",code=\"OK\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
    }

    /// CA asks for a group's template every loop: the template is encoded on the first call, and
    /// every answer after it (both fields) shares those bytes.
    #[tokio::test]
    async fn a_groups_template_is_encoded_once_and_every_answer_shares_the_bytes() {
        let mut md = md(2);
        md["metadata"]["annotations"][crate::capi::capacity::CPU] = json!("2");
        md["metadata"]["annotations"][crate::capi::capacity::MEMORY] = json!("4Gi");
        let (service, backend) = service(Fixed::of(md));
        let request = || Request::new(NodeGroupTemplateNodeInfoRequest { id: ID.into() });
        let first = service.node_group_template_node_info(request()).await;
        let second = service.node_group_template_node_info(request()).await;
        let (first, second) = (first.unwrap().into_inner(), second.unwrap().into_inner());

        let node = backend
            .snapshot
            .group(ID)
            .unwrap()
            .template
            .clone()
            .unwrap();
        assert_eq!(
            <k8s_pb::api::core::v1::Node as prost::Message>::decode(&first.node_bytes[..]).unwrap(),
            super::super::convert::to_pb(&node.node)
        );
        for bytes in [&first.node_info, &second.node_bytes, &second.node_info] {
            assert_eq!(bytes.as_ptr(), first.node_bytes.as_ptr(), "encoded again");
            assert_eq!(bytes.len(), first.node_bytes.len());
        }
    }

    #[tokio::test]
    async fn nothing_but_cleanup_is_answered_before_the_view_is_complete() {
        let (service, backend) = service(Fixed {
            complete: false,
            ..Fixed::new()
        });
        let groups = service
            .node_groups(Request::new(NodeGroupsRequest {}))
            .await
            .unwrap_err();
        assert_eq!(groups.code(), tonic::Code::Unavailable, "{groups:?}");
        assert_eq!(
            target_size(&service, ID).await.unwrap_err().code(),
            tonic::Code::Unavailable
        );
        assert_eq!(
            calls::increase(&service, ID).await.unwrap_err().code(),
            tonic::Code::Unavailable
        );
        assert!(backend.writes().is_empty(), "{:?}", backend.writes());
        service
            .cleanup(Request::new(CleanupRequest {}))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_stale_watch_refuses_writes_before_the_writer_and_reads_go_on() {
        let reason = "Machines (cluster.x-k8s.io): watch failing for 40s";
        let (service, backend) = service(Fixed {
            stale: vec![reason.into()],
            ..Fixed::new()
        });
        let refused = calls::increase(&service, ID).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable);
        assert!(
            refused.message().contains(ID) && refused.message().contains(reason),
            "{}",
            refused.message()
        );
        let decrease = calls::decrease(&service, ID).await.unwrap_err();
        assert_eq!(decrease.code(), tonic::Code::Unavailable);
        let delete = service
            .node_group_delete_nodes(Request::new(NodeGroupDeleteNodesRequest {
                id: ID.into(),
                nodes: vec![ExternalGrpcNode {
                    name: "a".into(),
                    ..Default::default()
                }],
            }))
            .await
            .unwrap_err();
        assert_eq!(delete.code(), tonic::Code::Unavailable);
        assert!(backend.writes().is_empty(), "{:?}", backend.writes());
        assert_eq!(target_size(&service, ID).await.unwrap(), 2);
    }

    #[tokio::test]
    async fn writer_errors_reach_ca_as_the_codes_it_acts_on() {
        let (service, backend) = service(Fixed::new());
        let cases = [
            (
                ActuatorError::GroupNotFound { id: "g".into() },
                tonic::Code::NotFound,
            ),
            (ActuatorError::NotFound("m".into()), tonic::Code::NotFound),
            (
                ActuatorError::BadRequest("b".into()),
                tonic::Code::InvalidArgument,
            ),
            (
                ActuatorError::OutOfBounds {
                    group: "g".into(),
                    operation: "size increase".into(),
                    desired: 4,
                    min: 0,
                    max: 3,
                },
                tonic::Code::FailedPrecondition,
            ),
            (
                ActuatorError::Refused("r".into()),
                tonic::Code::FailedPrecondition,
            ),
            (
                ActuatorError::Api {
                    cause: ApiCause::Unreachable,
                    message: "u".into(),
                },
                tonic::Code::Unavailable,
            ),
            (
                ActuatorError::Api {
                    cause: ApiCause::Forbidden,
                    message: "f".into(),
                },
                tonic::Code::PermissionDenied,
            ),
            (
                ActuatorError::Api {
                    cause: ApiCause::Failed,
                    message: "a".into(),
                },
                tonic::Code::Internal,
            ),
            (ActuatorError::Conflict("c".into()), tonic::Code::Aborted),
            (ActuatorError::Internal("i".into()), tonic::Code::Internal),
        ];
        for (error, code) in cases {
            let message = error.to_string();
            *backend.answer.lock().unwrap() = Some(error);
            let status = calls::increase(&service, ID).await.unwrap_err();
            assert_eq!((status.code(), status.message()), (code, message.as_str()));
        }
        calls::increase(&service, ID).await.unwrap();
        assert_eq!(backend.writes().len(), 11);
        assert!(
            backend
                .writes()
                .iter()
                .all(|w| w == &format!("increase {ID} 1"))
        );
    }

    #[tokio::test]
    async fn writes_carry_the_request_and_unknown_groups_are_not_found() {
        let (service, backend) = service(Fixed::new());
        service
            .node_group_delete_nodes(Request::new(NodeGroupDeleteNodesRequest {
                id: ID.into(),
                nodes: ["a", "b"]
                    .map(|name| ExternalGrpcNode {
                        name: name.into(),
                        provider_id: format!("e2e:///ns/{name}"),
                        ..Default::default()
                    })
                    .to_vec(),
            }))
            .await
            .unwrap();
        assert_eq!(backend.writes(), [format!("delete {ID} [\"a\", \"b\"]")]);

        let unknown = "MachineDeployment/ns/nope";
        assert_eq!(
            target_size(&service, unknown).await.unwrap_err().code(),
            tonic::Code::NotFound
        );
        let nodes = service
            .node_group_nodes(Request::new(NodeGroupNodesRequest { id: unknown.into() }))
            .await
            .unwrap_err();
        assert_eq!(nodes.code(), tonic::Code::NotFound);
        assert!(nodes.message().contains(unknown), "{}", nodes.message());
        let listed = service
            .node_group_nodes(Request::new(NodeGroupNodesRequest { id: ID.into() }))
            .await
            .unwrap()
            .into_inner()
            .instances;
        let ids: Vec<&str> = listed.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(ids, ["e2e:///ns/a", "e2e:///ns/b"]);
    }
}

const GROUP: &str = "MachineDeployment/default/md-0";

/// The template bytes decode to exactly what the template holds.
#[test]
fn template_bytes_carry_every_field_the_template_sets() {
    use crate::capi::{ScalableResource, capacity};
    use crate::template::{InfraSource, TemplateInputs};
    let keys = Keys::default();
    let md = serde_json::json!({
        "kind": "MachineDeployment",
        "metadata": {
            "namespace": "default", "name": "md-0", "resourceVersion": "1",
            "annotations": {
                capacity::CPU: "500m",
                capacity::MEMORY: "2Gi",
                capacity::GPU_TYPE: "nvidia.com/gpu",
                capacity::GPU_COUNT: "1",
                capacity::TAINTS: "a=b:NoSchedule,c:NoExecute",
            },
        },
        "spec": {
            "replicas": 0,
            "template": {"metadata": {"labels": {"node-role.kubernetes.io/worker": ""}}},
        },
    });
    let r = ScalableResource::from_json(ScalableKind::MachineDeployment, &keys, &md).unwrap();
    let t = crate::template::build(&TemplateInputs {
        group_id: GROUP,
        resource: &r,
        infra: InfraSource::NoReference,
        node_labels: None,
        default_arch: None,
        failure_domain_zone: None,
    })
    .template
    .expect("template");
    let bytes = template_bytes(&t);
    assert!(!bytes.is_empty());
    assert!(!bytes.starts_with(b"k8s\0"));
    let decoded = k8s_pb::api::core::v1::Node::decode(&bytes[..]).expect("decodes");
    assert_eq!(decoded, to_pb(&t.node));

    let md = decoded.metadata.clone().unwrap_or_default();
    assert_eq!(md.name.as_deref(), Some(t.summary.name.as_str()));
    assert_eq!(md.labels, t.summary.labels);
    assert_eq!(
        md.annotations
            .get(NODE_GROUP_ANNOTATION)
            .map(String::as_str),
        Some(GROUP)
    );
    let spec = decoded.spec.clone().unwrap_or_default();
    let taints: Vec<(Option<&str>, Option<&str>, Option<&str>)> = spec
        .taints
        .iter()
        .map(|t| (t.key.as_deref(), t.value.as_deref(), t.effect.as_deref()))
        .collect();
    assert_eq!(
        taints,
        vec![
            (Some("a"), Some("b"), Some("NoSchedule")),
            (Some("c"), None, Some("NoExecute"))
        ]
    );
    assert_eq!(spec.provider_id, None);
    let status = decoded.status.clone().unwrap_or_default();
    let cap: std::collections::BTreeMap<String, String> = status
        .capacity
        .iter()
        .map(|(k, q)| (k.clone(), q.string.clone().unwrap_or_default()))
        .collect();
    assert_eq!(
        cap,
        [
            ("cpu", "500m"),
            ("memory", "2Gi"),
            ("nvidia.com/gpu", "1"),
            ("pods", "110")
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .into()
    );
    assert_eq!(status.capacity, status.allocatable);
    assert_eq!(status.conditions.len(), 5);
    assert_eq!(status.conditions[0].r#type.as_deref(), Some("Ready"));
    assert_eq!(status.conditions[0].status.as_deref(), Some("True"));
    let info = status.node_info.unwrap_or_default();
    assert_eq!(info.architecture.as_deref(), Some("amd64"));
    assert_eq!(info.operating_system.as_deref(), Some("linux"));
}
