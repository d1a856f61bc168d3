//! Cluster API objects for the node-group tests, and the tools those tests share:
//!
//! - [`Capi`]: builders for MachineDeployments, MachineSets, MachinePools and Machines in one
//!   namespace, v1beta2 or v1beta1 shaped, in any API group (`CAPI_GROUP`). No CAPI controller runs,
//!   so labels, ownerReferences, providerIDs and status are set here, status through the status
//!   subresource.
//! - [`Rpc`]: a thin wrapper over the generated CloudProvider client.
//! - [`TcpProxy`]: a TCP forwarder to put between the provider and the apiserver and pull away.
//! - [`request_counts`]: the apiserver's `apiserver_request_total` series.
//! - [`start_provider_with_env`]: the provider with extra environment variables (`CAPI_GROUP`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::cloud_provider_client::CloudProviderClient;
use capi_autoscaler_provider::proto::{
    ExternalGrpcNode, Instance, NodeGroup, NodeGroupDecreaseTargetSizeRequest,
    NodeGroupDeleteNodesRequest, NodeGroupForNodeRequest, NodeGroupIncreaseSizeRequest,
    NodeGroupNodesRequest, NodeGroupTargetSizeRequest, NodeGroupsRequest,
};
use k8s_openapi::api::events::v1::Event;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tonic::Status;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;

use super::procs::{self, Check, poll_until};
use super::provider::{PROVIDER_BIN, health_status};

/// The group of infrastructure objects (the test's `E2EMachineTemplate` CRD lives there).
pub const INFRA_GROUP: &str = "infrastructure.cluster.x-k8s.io";
/// A finalizer nobody removes: a deleted Machine that carries it stays, with a deletionTimestamp.
pub const HOLD_FINALIZER: &str = "e2e.capi-autoscaler-provider.test/hold";
/// The cluster name objects get unless a test says otherwise.
pub const DEFAULT_CLUSTER: &str = "e2e";

/// The Cluster API kinds the tests create.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    MachineDeployment,
    MachineSet,
    MachinePool,
    Machine,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::MachineDeployment => "MachineDeployment",
            Kind::MachineSet => "MachineSet",
            Kind::MachinePool => "MachinePool",
            Kind::Machine => "Machine",
        }
    }

    pub fn plural(self) -> &'static str {
        match self {
            Kind::MachineDeployment => "machinedeployments",
            Kind::MachineSet => "machinesets",
            Kind::MachinePool => "machinepools",
            Kind::Machine => "machines",
        }
    }
}

/// A MachineDeployment, MachineSet or MachinePool to create.
#[derive(Clone, Debug)]
pub struct Scalable {
    pub kind: Kind,
    pub name: String,
    pub replicas: Option<i64>,
    /// Raw annotation values (so malformed ones can be written), keys derived from the group.
    pub min: Option<String>,
    pub max: Option<String>,
    pub annotations: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub cluster: Option<String>,
    /// For a MachineSet: the MachineDeployment that owns it (ownerReference).
    pub owner_deployment: Option<String>,
    /// For a MachinePool: `spec.providerIDList`.
    pub provider_ids: Vec<String>,
    /// `spec.paused: true` (only MachineDeployments have the field).
    pub spec_paused: bool,
}

impl Scalable {
    fn new(kind: Kind, name: &str) -> Self {
        Scalable {
            kind,
            name: name.to_string(),
            replicas: Some(1),
            min: None,
            max: None,
            annotations: BTreeMap::new(),
            labels: BTreeMap::new(),
            cluster: None,
            owner_deployment: None,
            provider_ids: Vec::new(),
            spec_paused: false,
        }
    }
    pub fn md(name: &str) -> Self {
        Self::new(Kind::MachineDeployment, name)
    }
    pub fn ms(name: &str) -> Self {
        Self::new(Kind::MachineSet, name)
    }
    pub fn mp(name: &str) -> Self {
        Self::new(Kind::MachinePool, name)
    }
    pub fn replicas(mut self, n: i64) -> Self {
        self.replicas = Some(n);
        self
    }
    pub fn no_replicas(mut self) -> Self {
        self.replicas = None;
        self
    }
    /// Both bound annotations, as integers.
    pub fn bounds(self, min: i64, max: i64) -> Self {
        self.raw_bounds(Some(&min.to_string()), Some(&max.to_string()))
    }
    /// Bound annotations with any text (or absent).
    pub fn raw_bounds(mut self, min: Option<&str>, max: Option<&str>) -> Self {
        self.min = min.map(str::to_string);
        self.max = max.map(str::to_string);
        self
    }
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.into(), value.into());
        self
    }
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }
    pub fn cluster(mut self, name: &str) -> Self {
        self.cluster = Some(name.into());
        self
    }
    pub fn owned_by(mut self, deployment: &str) -> Self {
        self.owner_deployment = Some(deployment.into());
        self
    }
    pub fn provider_ids(mut self, ids: &[String]) -> Self {
        self.provider_ids = ids.to_vec();
        self
    }
    pub fn spec_paused(mut self) -> Self {
        self.spec_paused = true;
        self
    }
}

/// Which scalable resource a Machine belongs to.
#[derive(Clone, Debug)]
pub enum Owner {
    /// A MachineDeployment created with [`Capi::create_deployment`]: the Machine is owned by its
    /// MachineSet [`Capi::set_of`]`(md)`.
    Deployment(String),
    MachineSet(String),
    MachinePool(String),
}

/// A Machine to create.
#[derive(Clone, Debug)]
pub struct MachineSpec {
    pub name: String,
    pub owner: Owner,
    pub provider_id: Option<String>,
    /// `status.nodeRef` names this Node.
    pub node: Option<String>,
    /// Failure message: v1beta2 `status.deprecated.v1beta1.failureMessage`, v1beta1
    /// `status.failureMessage` (with phase `Failed`).
    pub failure: Option<String>,
    /// Created with a finalizer, then deleted: it stays with a deletionTimestamp.
    pub deleting: bool,
    pub annotations: BTreeMap<String, String>,
}

impl MachineSpec {
    pub fn provider_id(mut self, id: Option<&str>) -> Self {
        self.provider_id = id.map(str::to_string);
        self
    }
    pub fn node(mut self, name: Option<&str>) -> Self {
        self.node = name.map(str::to_string);
        self
    }
    pub fn failed(mut self, message: &str) -> Self {
        self.failure = Some(message.into());
        self
    }
    pub fn deleting(mut self) -> Self {
        self.deleting = true;
        self
    }
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.into(), value.into());
        self
    }
}

/// Stops [`Capi::keep_observing`] when dropped.
pub struct Observing(tokio::task::JoinHandle<()>);

impl Drop for Observing {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Cluster API objects of one API group and version in one namespace, through one client.
#[derive(Clone)]
pub struct Capi {
    pub client: Client,
    pub ns: String,
    pub group: String,
    /// `v1beta2` or `v1beta1`: the shape of the objects written.
    pub version: String,
}

impl Capi {
    pub fn new(client: Client, ns: &str, group: &str, version: &str) -> Self {
        Capi {
            client,
            ns: ns.to_string(),
            group: group.to_string(),
            version: version.to_string(),
        }
    }

    fn v1beta1(&self) -> bool {
        self.version == "v1beta1"
    }

    pub fn resource(&self, kind: Kind) -> ApiResource {
        super::capi_resource(&self.group, &self.version, kind.as_str(), kind.plural())
    }

    pub fn api(&self, kind: Kind) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &self.ns, &self.resource(kind))
    }

    /// `<group>/<suffix>`: the keys that follow `CAPI_GROUP`.
    pub fn key(&self, suffix: &str) -> String {
        format!("{}/{suffix}", self.group)
    }
    pub fn min_key(&self) -> String {
        self.key("cluster-api-autoscaler-node-group-min-size")
    }
    pub fn max_key(&self) -> String {
        self.key("cluster-api-autoscaler-node-group-max-size")
    }
    pub fn delete_key(&self) -> String {
        self.key("delete-machine")
    }

    /// The node group id of a resource in this namespace.
    pub fn id(&self, kind: Kind, name: &str) -> String {
        format!("{}/{}/{}", kind.as_str(), self.ns, name)
    }

    /// The providerID the builders give Machine `name`; its last segment is unique across
    /// namespaces, so normalised lookups never collide between tests.
    pub fn provider_id(&self, name: &str) -> String {
        format!("e2e:///{}/{}-{name}", self.ns, self.ns)
    }

    /// The Node name the builders give Machine `name`.
    pub fn node_name(&self, name: &str) -> String {
        format!("{}-{name}", self.ns)
    }

    /// The MachineSet [`create_deployment`](Self::create_deployment) makes for MachineDeployment `md`.
    pub fn set_of(md: &str) -> String {
        format!("{md}-ms")
    }

    /// A Machine with a providerID and a Node.
    pub fn running(&self, name: &str, owner: Owner) -> MachineSpec {
        MachineSpec {
            name: name.into(),
            owner,
            provider_id: Some(self.provider_id(name)),
            node: Some(self.node_name(name)),
            failure: None,
            deleting: false,
            annotations: BTreeMap::new(),
        }
    }

    /// A Machine with neither providerID nor Node.
    pub fn pending(&self, name: &str, owner: Owner) -> MachineSpec {
        self.running(name, owner).provider_id(None).node(None)
    }

    /// The node CA would send for a running Machine of the builders.
    pub fn grpc_node(&self, machine: &str) -> ExternalGrpcNode {
        grpc_node(&self.provider_id(machine), &self.node_name(machine))
    }

    fn infrastructure_ref(&self, kind: &str, name: &str) -> Value {
        if self.v1beta1() {
            json!({"apiVersion": format!("{INFRA_GROUP}/v1beta1"), "kind": kind, "name": name})
        } else {
            json!({"apiGroup": INFRA_GROUP, "kind": kind, "name": name})
        }
    }

    /// An empty `E2EMachineTemplate` (so the provider finds the template it is pointed at).
    pub async fn create_infra_template(&self, name: &str) {
        let ar = super::infra::template_resource("v1beta1");
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &self.ns, &ar);
        let object =
            DynamicObject::new(name, &ar).data(json!({"spec": {"template": {"spec": {}}}}));
        match api.create(&PostParams::default(), &object).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("create E2EMachineTemplate {}/{name}: {e}", self.ns),
        }
    }

    /// Creates `s` (and its infrastructure template) and returns it as stored.
    pub async fn create(&self, s: &Scalable) -> DynamicObject {
        let cluster = s
            .cluster
            .clone()
            .unwrap_or_else(|| DEFAULT_CLUSTER.to_string());
        let mut labels: BTreeMap<String, String> = s.labels.clone();
        labels.insert(self.key("cluster-name"), cluster.clone());
        let mut annotations = s.annotations.clone();
        if let Some(min) = &s.min {
            annotations.insert(self.min_key(), min.clone());
        }
        if let Some(max) = &s.max {
            annotations.insert(self.max_key(), max.clone());
        }
        let mut selector: BTreeMap<String, String> = BTreeMap::new();
        selector.insert(self.key("cluster-name"), cluster.clone());
        match s.kind {
            Kind::MachineDeployment => {
                selector.insert(self.key("deployment-name"), s.name.clone());
            }
            Kind::MachineSet => {
                if let Some(md) = &s.owner_deployment {
                    selector.insert(self.key("deployment-name"), md.clone());
                }
                selector.insert(self.key("set-name"), s.name.clone());
            }
            Kind::MachinePool => {
                selector.insert(self.key("pool-name"), s.name.clone());
            }
            Kind::Machine => panic!("use create_machine for Machines"),
        }
        let template_name = format!("{}-tmpl", s.name);
        self.create_infra_template(&template_name).await;
        let mut spec = json!({
            "clusterName": cluster,
            "template": {
                "metadata": {"labels": selector},
                "spec": {
                    "clusterName": cluster,
                    "bootstrap": {"dataSecretName": format!("{}-bootstrap", s.name)},
                    "infrastructureRef": self.infrastructure_ref("E2EMachineTemplate", &template_name),
                },
            },
        });
        if s.kind != Kind::MachinePool {
            spec["selector"] = json!({"matchLabels": selector});
        }
        if let Some(n) = s.replicas {
            spec["replicas"] = json!(n);
        }
        if s.kind == Kind::MachinePool && !s.provider_ids.is_empty() {
            spec["providerIDList"] = json!(s.provider_ids);
        }
        if s.spec_paused {
            spec["paused"] = json!(true);
        }
        let mut metadata = json!({
            "name": s.name,
            "labels": labels,
            "annotations": annotations,
        });
        if let Some(md) = &s.owner_deployment {
            let uid = self.uid(Kind::MachineDeployment, md).await;
            metadata["ownerReferences"] = json!([{
                "apiVersion": format!("{}/{}", self.group, self.version),
                "kind": "MachineDeployment",
                "name": md,
                "uid": uid,
                "controller": true,
            }]);
        }
        let ar = self.resource(s.kind);
        let mut object = DynamicObject::new(&s.name, &ar).data(json!({"spec": spec}));
        object.metadata = serde_json::from_value(metadata).expect("object metadata");
        self.api(s.kind)
            .create(&PostParams::default(), &object)
            .await
            .unwrap_or_else(|e| panic!("create {} {}/{}: {e}", s.kind.as_str(), self.ns, s.name));
        // Created as Cluster API would have it once its controllers saw it.
        self.mark_observed(s.kind, &s.name).await
    }

    /// Stands in for Cluster API's controllers taking in `name`'s spec (none run in these tests):
    /// a MachineDeployment's replicas go to its MachineSet, then each object's
    /// `status.observedGeneration` reaches its generation. No Machine is created or deleted.
    pub async fn observe(&self, kind: Kind, name: &str) {
        if kind == Kind::MachineDeployment {
            let replicas = self.replicas(kind, name).await;
            let set = Self::set_of(name);
            let exists = self
                .api(Kind::MachineSet)
                .get_opt(&set)
                .await
                .unwrap_or_else(|e| panic!("get MachineSet {}/{set}: {e}", self.ns))
                .is_some();
            if exists {
                self.patch(
                    Kind::MachineSet,
                    &set,
                    json!({"spec": {"replicas": replicas}}),
                )
                .await;
                self.mark_observed(Kind::MachineSet, &set).await;
            }
        }
        self.mark_observed(kind, name).await;
    }

    /// Observes every group of the namespace ([`observe`](Self::observe)) every 50 ms until the
    /// returned guard is dropped: Cluster API keeping up, for tests of many operations at once.
    pub fn keep_observing(&self) -> Observing {
        let capi = self.clone();
        Observing(tokio::spawn(async move {
            loop {
                for kind in [Kind::MachineDeployment, Kind::MachinePool] {
                    let Ok(list) = capi.api(kind).list(&Default::default()).await else {
                        continue;
                    };
                    for object in list.items {
                        if let Some(name) = object.metadata.name.as_deref() {
                            capi.observe(kind, name).await;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }))
    }

    async fn mark_observed(&self, kind: Kind, name: &str) -> DynamicObject {
        let api = self.api(kind);
        let what = || format!("{} {}/{name}", kind.as_str(), self.ns);
        let object = api
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("get {}: {e}", what()));
        let generation = object.metadata.generation.unwrap_or(1);
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"observedGeneration": generation}})),
        )
        .await
        .unwrap_or_else(|e| panic!("observe {}: {e}", what()))
    }

    /// A MachineDeployment and the MachineSet it owns ([`set_of`](Self::set_of)) with the same
    /// replicas. With `set_bounds` the MachineSet carries the same bound annotations (which must not
    /// make it a group of its own).
    pub async fn create_deployment(&self, md: &Scalable, set_bounds: bool) -> DynamicObject {
        let created = self.create(md).await;
        // CAPI gives every MachineSet of a MachineDeployment its revision.
        let mut ms = Scalable::ms(&Self::set_of(&md.name))
            .owned_by(&md.name)
            .annotation("machinedeployment.clusters.x-k8s.io/revision", "1");
        ms.replicas = md.replicas;
        ms.cluster = md.cluster.clone();
        if set_bounds {
            ms = ms.raw_bounds(md.min.as_deref(), md.max.as_deref());
        }
        self.create(&ms).await;
        created
    }

    async fn uid(&self, kind: Kind, name: &str) -> String {
        self.api(kind)
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("get {} {}/{name}: {e}", kind.as_str(), self.ns))
            .metadata
            .uid
            .expect("a stored object has a uid")
    }

    /// Creates a Machine: object, then status, then (for `deleting`) the delete that leaves it
    /// held by its finalizer.
    pub async fn create_machine(&self, m: &MachineSpec) -> DynamicObject {
        let mut labels: BTreeMap<String, String> = BTreeMap::new();
        labels.insert(self.key("cluster-name"), DEFAULT_CLUSTER.to_string());
        let (owner_kind, owner_name) = match &m.owner {
            Owner::Deployment(md) => {
                labels.insert(self.key("deployment-name"), md.clone());
                labels.insert(self.key("set-name"), Self::set_of(md));
                (Kind::MachineSet, Self::set_of(md))
            }
            Owner::MachineSet(ms) => {
                labels.insert(self.key("set-name"), ms.clone());
                (Kind::MachineSet, ms.clone())
            }
            Owner::MachinePool(mp) => {
                labels.insert(self.key("pool-name"), mp.clone());
                (Kind::MachinePool, mp.clone())
            }
        };
        let owner_uid = self.uid(owner_kind, &owner_name).await;
        let mut metadata = json!({
            "name": m.name,
            "labels": labels,
            "annotations": m.annotations,
            "ownerReferences": [{
                "apiVersion": format!("{}/{}", self.group, self.version),
                "kind": owner_kind.as_str(),
                "name": owner_name,
                "uid": owner_uid,
                "controller": true,
            }],
        });
        if m.deleting {
            metadata["finalizers"] = json!([HOLD_FINALIZER]);
        }
        let mut spec = json!({
            "clusterName": DEFAULT_CLUSTER,
            "bootstrap": {"dataSecretName": format!("{}-bootstrap", m.name)},
            "infrastructureRef": self.infrastructure_ref("E2EMachine", &m.name),
        });
        if let Some(p) = &m.provider_id {
            spec["providerID"] = json!(p);
        }
        let ar = self.resource(Kind::Machine);
        let mut object = DynamicObject::new(&m.name, &ar).data(json!({"spec": spec}));
        object.metadata = serde_json::from_value(metadata).expect("machine metadata");
        let api = self.api(Kind::Machine);
        api.create(&PostParams::default(), &object)
            .await
            .unwrap_or_else(|e| panic!("create Machine {}/{}: {e}", self.ns, m.name));

        let mut status = serde_json::Map::new();
        let phase = match (&m.failure, &m.node) {
            (Some(_), _) if self.v1beta1() => "Failed",
            (_, Some(_)) => "Running",
            (_, None) if m.provider_id.is_some() => "Provisioned",
            _ => "Provisioning",
        };
        status.insert("phase".into(), json!(phase));
        if let Some(node) = &m.node {
            let node_ref = if self.v1beta1() {
                json!({"apiVersion": "v1", "kind": "Node", "name": node, "uid": format!("uid-{node}")})
            } else {
                json!({"name": node})
            };
            status.insert("nodeRef".into(), node_ref);
        }
        if let Some(message) = &m.failure {
            if self.v1beta1() {
                status.insert("failureReason".into(), json!("CreateError"));
                status.insert("failureMessage".into(), json!(message));
            } else {
                status.insert(
                    "deprecated".into(),
                    json!({"v1beta1": {"failureReason": "CreateError", "failureMessage": message}}),
                );
            }
        }
        let mut stored = api
            .patch_status(
                &m.name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": status})),
            )
            .await
            .unwrap_or_else(|e| panic!("write the status of Machine {}/{}: {e}", self.ns, m.name));
        if m.deleting {
            api.delete(&m.name, &DeleteParams::default())
                .await
                .unwrap_or_else(|e| panic!("delete Machine {}/{}: {e}", self.ns, m.name));
            stored = api
                .get(&m.name)
                .await
                .expect("the held Machine is still there");
            assert!(
                stored.metadata.deletion_timestamp.is_some(),
                "Machine {} should be deleting",
                m.name
            );
        }
        stored
    }

    /// `spec.replicas` as the API has it now.
    pub async fn replicas(&self, kind: Kind, name: &str) -> i64 {
        let object = self
            .api(kind)
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("get {} {}/{name}: {e}", kind.as_str(), self.ns));
        object.data["spec"]["replicas"]
            .as_i64()
            .unwrap_or_else(|| panic!("{} {name} has no spec.replicas", kind.as_str()))
    }

    /// Sets `spec.replicas` through the scale subresource (as an admin would).
    pub async fn scale(&self, kind: Kind, name: &str, replicas: i64) {
        self.api(kind)
            .patch_scale(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"replicas": replicas}})),
            )
            .await
            .unwrap_or_else(|e| panic!("scale {} {name}: {e}", kind.as_str()));
    }

    /// Merge-patches an object's metadata/spec.
    pub async fn patch(&self, kind: Kind, name: &str, patch: Value) -> DynamicObject {
        self.api(kind)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_or_else(|e| panic!("patch {} {name}: {e}", kind.as_str()))
    }

    /// Waits (reading every 20 ms, up to `timeout`) until some Machine carries the delete mark;
    /// returns the marked ones.
    pub async fn wait_marked(
        &self,
        what: &str,
        timeout: Duration,
    ) -> Result<BTreeSet<String>, String> {
        poll_until(what, timeout, Duration::from_millis(20), || async {
            let marked = self.marked_machines().await;
            if marked.is_empty() {
                Check::Wait("no mark yet".into())
            } else {
                Check::Done(marked)
            }
        })
        .await
    }

    /// The Machines in the namespace that carry the delete annotation.
    pub async fn marked_machines(&self) -> BTreeSet<String> {
        let key = self.delete_key();
        self.api(Kind::Machine)
            .list(&ListParams::default())
            .await
            .expect("list Machines")
            .items
            .into_iter()
            .filter(|m| {
                m.metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(&key))
            })
            .map(|m| m.metadata.name.unwrap_or_default())
            .collect()
    }

    /// The Events (events.k8s.io/v1) in the namespace about object `name`.
    pub async fn events_about(&self, name: &str) -> Vec<Event> {
        Api::<Event>::namespaced(self.client.clone(), &self.ns)
            .list(&ListParams::default())
            .await
            .expect("list events.k8s.io Events")
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .collect()
    }
}

/// An `ExternalGrpcNode` with just providerID and name.
pub fn grpc_node(provider_id: &str, name: &str) -> ExternalGrpcNode {
    ExternalGrpcNode {
        provider_id: provider_id.into(),
        name: name.into(),
        labels: HashMap::new(),
        annotations: HashMap::new(),
    }
}

/// The CloudProvider client with shorthands; cheap to clone.
#[derive(Clone)]
pub struct Rpc {
    pub client: CloudProviderClient<Channel>,
}

impl Rpc {
    /// Connects once the CloudProvider service reports SERVING (every watch has listed).
    pub async fn connect(provider: &impl HasEndpoint) -> Rpc {
        wait_serving(&provider.endpoint(), CLOUD_PROVIDER_SERVICE).await;
        Rpc::connect_unready(provider).await
    }

    /// Connects at once, without waiting for SERVING: for a provider that is not ready on purpose
    /// (its RPCs answer once every watch has listed all the same).
    pub async fn connect_unready(provider: &impl HasEndpoint) -> Rpc {
        let channel = tonic::transport::Endpoint::from_shared(provider.endpoint())
            .expect("provider endpoint URI")
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(10))
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connect to the provider at {}: {e}", provider.endpoint()));
        Rpc {
            client: CloudProviderClient::new(channel),
        }
    }

    pub async fn groups(&mut self) -> Vec<NodeGroup> {
        self.client
            .node_groups(NodeGroupsRequest {})
            .await
            .expect("NodeGroups")
            .into_inner()
            .node_groups
    }

    /// The ids NodeGroups answers that are in namespace `ns`.
    pub async fn ids_in(&mut self, ns: &str) -> BTreeSet<String> {
        self.groups()
            .await
            .into_iter()
            .map(|g| g.id)
            .filter(|id| id.split('/').nth(1) == Some(ns))
            .collect()
    }

    /// The group NodeGroups answers with `id`.
    pub async fn group(&mut self, id: &str) -> Option<NodeGroup> {
        self.groups().await.into_iter().find(|g| g.id == id)
    }

    /// NodeGroupForNode; panics unless OK with a node group message.
    pub async fn for_node(&mut self, node: ExternalGrpcNode) -> NodeGroup {
        let what = format!("NodeGroupForNode({node:?})");
        self.client
            .node_group_for_node(NodeGroupForNodeRequest { node: Some(node) })
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"))
            .into_inner()
            .node_group
            .unwrap_or_else(|| panic!("{what}: no nodeGroup in the answer"))
    }

    pub async fn target(&mut self, id: &str) -> Result<i32, Status> {
        self.client
            .node_group_target_size(NodeGroupTargetSizeRequest { id: id.into() })
            .await
            .map(|r| r.into_inner().target_size)
    }

    pub async fn increase(&mut self, id: &str, delta: i32) -> Result<(), Status> {
        self.client
            .node_group_increase_size(NodeGroupIncreaseSizeRequest {
                delta,
                id: id.into(),
            })
            .await
            .map(drop)
    }

    pub async fn decrease(&mut self, id: &str, delta: i32) -> Result<(), Status> {
        self.client
            .node_group_decrease_target_size(NodeGroupDecreaseTargetSizeRequest {
                delta,
                id: id.into(),
            })
            .await
            .map(drop)
    }

    pub async fn delete_nodes(
        &mut self,
        id: &str,
        nodes: Vec<ExternalGrpcNode>,
    ) -> Result<(), Status> {
        self.client
            .node_group_delete_nodes(NodeGroupDeleteNodesRequest {
                nodes,
                id: id.into(),
            })
            .await
            .map(drop)
    }

    pub async fn nodes(&mut self, id: &str) -> Result<Vec<Instance>, Status> {
        self.client
            .node_group_nodes(NodeGroupNodesRequest { id: id.into() })
            .await
            .map(|r| r.into_inner().instances)
    }

    /// Instances by id.
    pub async fn instances(&mut self, id: &str) -> BTreeMap<String, Instance> {
        self.nodes(id)
            .await
            .unwrap_or_else(|e| panic!("NodeGroupNodes({id}): {e}"))
            .into_iter()
            .map(|i| (i.id.clone(), i))
            .collect()
    }

    /// Polls NodeGroupTargetSize until it is `want` (for changes made behind the provider's back).
    pub async fn wait_target(&mut self, id: &str, want: i32) {
        let rpc = self.clone();
        poll_until(
            &format!("NodeGroupTargetSize({id}) == {want}"),
            Duration::from_secs(30),
            Duration::from_millis(50),
            || {
                let mut rpc = rpc.clone();
                async move {
                    match rpc.target(id).await {
                        Ok(n) if n == want => Check::Done(()),
                        Ok(n) => Check::Wait(format!("target size {n}")),
                        Err(e) => Check::Wait(e.to_string()),
                    }
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Polls NodeGroups until the ids in `ns` are exactly `want`.
    pub async fn wait_ids(&mut self, ns: &str, want: &BTreeSet<String>) {
        let rpc = self.clone();
        poll_until(
            &format!("node groups in {ns} == {want:?}"),
            Duration::from_secs(30),
            Duration::from_millis(50),
            || {
                let mut rpc = rpc.clone();
                async move {
                    let ids = rpc.ids_in(ns).await;
                    if &ids == want {
                        Check::Done(())
                    } else {
                        Check::Wait(format!("{ids:?}"))
                    }
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The grpc.health.v1 service name of the CloudProvider service.
pub const CLOUD_PROVIDER_SERVICE: &str =
    "clusterautoscaler.cloudprovider.v1.externalgrpc.CloudProvider";

/// Polls grpc.health.v1 `Check(service)` at `endpoint` until SERVING (60 s).
pub async fn wait_serving(endpoint: &str, service: &str) {
    let endpoint = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .expect("endpoint URI")
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(2));
    poll_until(
        &format!("health of {service:?} at {} is SERVING", endpoint.uri()),
        Duration::from_secs(60),
        Duration::from_millis(25),
        || {
            let endpoint = endpoint.clone();
            async move {
                match health_status(endpoint, service).await {
                    Ok(ServingStatus::Serving) => Check::Done(()),
                    Ok(other) => Check::Wait(format!("status {other:?}")),
                    Err(e) => Check::Wait(e),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// What has a gRPC endpoint: the harness's provider or [`EnvProvider`].
pub trait HasEndpoint {
    fn endpoint(&self) -> String;
}

impl HasEndpoint for super::ProviderProcess {
    fn endpoint(&self) -> String {
        super::ProviderProcess::endpoint(self)
    }
}

/// Asserts a gRPC result failed with `code`; returns the message.
#[track_caller]
pub fn expect_code<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, Status>,
    code: tonic::Code,
) -> String {
    match result {
        Err(status) if status.code() == code => status.message().to_string(),
        other => panic!("{what}: expected {code:?}, got {other:?}"),
    }
}

/// The name of the provider's ClusterRole in deploy/base/rbac.yaml.
pub const SHIPPED_ROLE: &str = "capi-autoscaler-provider";

/// The ClusterRole [`SHIPPED_ROLE`] exactly as deploy/base/rbac.yaml has it.
pub fn shipped_cluster_role() -> k8s_openapi::api::rbac::v1::ClusterRole {
    use k8s_openapi::api::rbac::v1::ClusterRole;
    use serde::Deserialize as _;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/base/rbac.yaml");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_norway::Deserializer::from_str(&text)
        .filter_map(|doc| serde_norway::Value::deserialize(doc).ok())
        .filter(|v| v["kind"].as_str() == Some("ClusterRole"))
        .map(|v| serde_norway::from_value::<ClusterRole>(v).expect("a ClusterRole in rbac.yaml"))
        .find(|r| r.metadata.name.as_deref() == Some(SHIPPED_ROLE))
        .unwrap_or_else(|| panic!("{} has no ClusterRole {SHIPPED_ROLE}", path.display()))
}

/// Creates (or updates) `role` under `name`.
pub async fn apply_cluster_role(
    admin: &Client,
    name: &str,
    mut role: k8s_openapi::api::rbac::v1::ClusterRole,
) {
    role.metadata.name = Some(name.to_string());
    Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(admin.clone())
        .patch(
            name,
            &PatchParams::apply("e2e").force(),
            &Patch::Apply(&role),
        )
        .await
        .unwrap_or_else(|e| panic!("apply ClusterRole {name}: {e}"));
}

/// Creates (or updates) the ClusterRole [`SHIPPED_ROLE`] exactly as deploy/base/rbac.yaml has it.
pub async fn apply_shipped_cluster_role(admin: &Client) {
    apply_cluster_role(admin, SHIPPED_ROLE, shipped_cluster_role()).await;
}

// ---------------------------------------------------------------------------------------------------
// A TCP proxy to the apiserver that can be pulled away.

/// Forwards every connection accepted on `addr` to `target`. [`stop`](Self::stop) closes the
/// listener and every forwarded connection, so the other side sees the API go away.
pub struct TcpProxy {
    pub addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl TcpProxy {
    /// Listens on `listen` (port 0: any free one).
    pub async fn start(listen: SocketAddr, target: SocketAddr) -> std::io::Result<TcpProxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (shutdown, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut pipes = JoinSet::new();
            loop {
                tokio::select! {
                    _ = stopped.changed() => break,
                    accepted = listener.accept() => {
                        let Ok((mut inbound, _)) = accepted else { continue };
                        pipes.spawn(async move {
                            if let Ok(mut outbound) = TcpStream::connect(target).await {
                                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                            }
                        });
                    }
                }
                while pipes.try_join_next().is_some() {}
            }
            drop(listener);
            // Abort every pipe and wait until each one (and its sockets) is gone.
            pipes.shutdown().await;
        });
        Ok(TcpProxy {
            addr,
            shutdown,
            task: Some(task),
        })
    }

    /// Listens on `listen` again after an earlier proxy there stopped (the port may take a moment to
    /// be free); panics after 10 s.
    pub async fn restart(listen: SocketAddr, target: SocketAddr) -> TcpProxy {
        poll_until(
            &format!("listen on {listen} again"),
            Duration::from_secs(10),
            Duration::from_millis(100),
            || async move {
                match TcpProxy::start(listen, target).await {
                    Ok(p) => Check::Done(p),
                    Err(e) => Check::Wait(e.to_string()),
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Closes the listener and every forwarded connection; returns when all are closed.
    pub async fn stop(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The `host:port` of an `https://host:port` URL.
pub fn socket_addr_of(server: &str) -> SocketAddr {
    server
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .parse()
        .unwrap_or_else(|e| panic!("{server} is not https://ip:port: {e}"))
}

/// A copy of `kubeconfig` whose server is `server` (the credentials stay), in the work dir.
pub fn kubeconfig_with_server(kubeconfig: &Path, old_server: &str, server: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let text = std::fs::read_to_string(kubeconfig)
        .unwrap_or_else(|e| panic!("read {}: {e}", kubeconfig.display()));
    let needle = format!("server: {old_server}");
    assert!(
        text.contains(&needle),
        "{} does not name {old_server}",
        kubeconfig.display()
    );
    let path = procs::work_dir().join(format!(
        "proxied-{}.kubeconfig",
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::write(&path, text.replace(&needle, &format!("server: {server}")))
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

// ---------------------------------------------------------------------------------------------------
// apiserver metrics

/// Every `apiserver_request_total` series (its label set as written) and its value.
pub async fn request_counts(admin: &Client) -> BTreeMap<String, f64> {
    let request = http::Request::get("/metrics")
        .body(Vec::new())
        .expect("a GET request");
    let text = admin
        .request_text(request)
        .await
        .expect("scrape the apiserver's /metrics");
    text.lines()
        .filter_map(|line| line.strip_prefix("apiserver_request_total{"))
        .filter_map(|rest| {
            let (labels, value) = rest.rsplit_once("} ")?;
            Some((labels.to_string(), value.trim().parse::<f64>().ok()?))
        })
        .collect()
}

/// The value of label `name` in a series' label text.
pub fn label_of<'a>(series: &'a str, name: &str) -> Option<&'a str> {
    let needle = format!("{name}=\"");
    let start = series
        .match_indices(&needle)
        .find(|(i, _)| *i == 0 || series.as_bytes()[i - 1] == b',')
        .map(|(i, _)| i + needle.len())?;
    let len = series[start..].find('"')?;
    Some(&series[start..start + len])
}

/// The series that grew from `before` to `after`, by how much.
pub fn growth(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0.0);
            (d > 0.0).then(|| (k.clone(), d))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------------
// The provider with extra environment variables.

/// A provider started by [`start_provider_with_env`]; killed and reaped on drop.
pub struct EnvProvider {
    child: Child,
    pub address: String,
    /// `127.0.0.1:<port>` of /metrics, /healthz, /readyz.
    pub metrics_address: String,
    pub log: PathBuf,
}

impl EnvProvider {
    pub fn log_contents(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl HasEndpoint for EnvProvider {
    fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }
}

impl Drop for EnvProvider {
    fn drop(&mut self) {
        procs::kill_and_reap(&mut self.child);
    }
}

/// Starts the provider (`serve` on free ports, log in the work dir) with `env` added to its
/// environment, and returns at once: nothing is known about its health yet.
pub fn spawn_provider(args: &[&str], kubeconfig: &Path, env: &[(&str, &str)]) -> EnvProvider {
    static N: AtomicU32 = AtomicU32::new(0);
    let log = procs::work_dir().join(format!(
        "spawned-provider-{}.log",
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let address = format!("127.0.0.1:{}", procs::free_port());
    let metrics = format!("127.0.0.1:{}", procs::free_port());
    let out = std::fs::File::options()
        .create(true)
        .append(true)
        .open(&log)
        .expect("open the provider log");
    let mut command = Command::new(PROVIDER_BIN);
    command
        .args([
            "serve",
            "--address",
            &address,
            "--metrics-address",
            &metrics,
            "--cloud-config",
        ])
        .arg(kubeconfig)
        .args(args)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone().expect("clone the log handle"))
        .stderr(out);
    let child = procs::spawn(command).unwrap_or_else(|e| panic!("start {PROVIDER_BIN}: {e}"));
    EnvProvider {
        child,
        address,
        metrics_address: metrics,
        log,
    }
}

impl EnvProvider {
    /// grpc.health.v1 `Check(service)` once, or why it could not be asked.
    /// (The future borrows nothing, so it can be returned from a polling closure.)
    pub fn health(
        &self,
        service: &str,
    ) -> impl Future<Output = Result<ServingStatus, String>> + use<> {
        let endpoint = tonic::transport::Endpoint::from_shared(self.endpoint())
            .expect("endpoint URI")
            .connect_timeout(Duration::from_millis(500))
            .timeout(Duration::from_secs(2));
        let service = service.to_string();
        async move { health_status(endpoint, &service).await }
    }

    /// The HTTP status of `GET <path>` on the metrics listener (a plain HTTP/1.0 request).
    pub fn http_status(&self, path: &str) -> impl Future<Output = Result<u16, String>> + use<> {
        let address = self.metrics_address.clone();
        let path = path.to_string();
        async move { procs::http_get(&address, &path).await.map(|(code, _)| code) }
    }

    /// Whether the process has exited (and how).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits (30 s at most) for the process to exit on its own; panics when it keeps running.
    pub async fn wait_exit(&mut self) -> std::process::ExitStatus {
        procs::wait_exit(
            &mut self.child,
            "the provider to exit",
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Like [`super::start_provider`], with `env` added to the provider's environment: returns once
/// grpc.health.v1 answers SERVING for the CloudProvider service.
pub async fn start_provider_with_env(
    args: &[&str],
    kubeconfig: &Path,
    env: &[(&str, &str)],
) -> EnvProvider {
    for attempt in 1..=3 {
        let started = Instant::now();
        let mut provider = spawn_provider(args, kubeconfig, env);
        let result = poll_until(
            &format!("provider health at {}", provider.address),
            Duration::from_secs(60),
            Duration::from_millis(50),
            || {
                let gone = provider.exited();
                let endpoint = provider.endpoint();
                async move {
                    if let Some(status) = gone {
                        return Check::Fatal(format!("the provider exited with {status}"));
                    }
                    let endpoint = tonic::transport::Endpoint::from_shared(endpoint)
                        .expect("endpoint URI")
                        .connect_timeout(Duration::from_millis(500))
                        .timeout(Duration::from_secs(2));
                    match health_status(endpoint, CLOUD_PROVIDER_SERVICE).await {
                        Ok(ServingStatus::Serving) => Check::Done(()),
                        Ok(other) => Check::Wait(format!("status {other:?}")),
                        Err(e) => Check::Wait(e),
                    }
                }
            },
        )
        .await;
        match result {
            Ok(()) => {
                eprintln!(
                    "e2e: provider {} (env {env:?}) serving after {:.2}s (log {})",
                    provider.address,
                    started.elapsed().as_secs_f64(),
                    provider.log.display()
                );
                return provider;
            }
            Err(e) => {
                let tail = procs::log_tail(&provider.log, 6000);
                drop(provider);
                if attempt < 3 && tail.contains("in use") {
                    continue;
                }
                panic!(
                    "provider with env {env:?} did not become healthy: {e}\n--- log ---\n{tail}"
                );
            }
        }
    }
    unreachable!("three attempts either return or panic")
}

/// A MachineDeployment of Cluster `e2e` on E2EMachineTemplate `name`, with the autoscaler bounds
/// `min`/`max`, `replicas` and `infrastructure_ref` (its shape differs between v1beta1 and
/// v1beta2): every field either schema requires.
pub fn e2e_machine_deployment(
    name: &str,
    (min, max): (&str, &str),
    replicas: i64,
    infrastructure_ref: Value,
) -> Value {
    let labels = json!({
        "cluster.x-k8s.io/cluster-name": "e2e",
        "cluster.x-k8s.io/deployment-name": name,
    });
    json!({
        "metadata": {
            "name": name,
            "annotations": {
                "cluster.x-k8s.io/cluster-api-autoscaler-node-group-min-size": min,
                "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size": max,
            },
        },
        "spec": {
            "clusterName": "e2e",
            "replicas": replicas,
            "selector": { "matchLabels": labels },
            "template": {
                "metadata": { "labels": labels },
                "spec": {
                    "clusterName": "e2e",
                    "bootstrap": { "dataSecretName": format!("{name}-bootstrap") },
                    "infrastructureRef": infrastructure_ref,
                },
            },
        },
    })
}

/// A test's environment: the shared control plane and a fresh namespace of it, with builders for
/// `cluster.x-k8s.io` at one version.
pub struct Env {
    pub cp: &'static super::ControlPlane,
    pub capi: Capi,
}

impl Env {
    /// [`fresh_capi`] as an [`Env`].
    pub async fn fresh(setup: super::Setup, version: &str) -> Env {
        let (cp, capi) = fresh_capi(setup, version).await;
        Env { cp, capi }
    }
}

/// A fresh namespace on the shared control plane of `setup`, with builders for `cluster.x-k8s.io` at
/// `version`.
pub async fn fresh_capi(
    setup: super::Setup,
    version: &str,
) -> (&'static super::ControlPlane, Capi) {
    let cp = super::control_plane(setup);
    let ns = cp.fresh_namespace().await;
    let capi = Capi::new(cp.admin_client().await, &ns, super::CAPI_GROUP, version);
    (cp, capi)
}

/// A provider (admin identity) that only looks at namespace `ns`, and a client for it.
pub async fn provider_for_namespace(
    cp: &super::ControlPlane,
    ns: &str,
) -> (super::ProviderProcess, Rpc) {
    let discovery = format!("clusterapi:namespace={ns}");
    let provider = super::start_provider(
        &["--node-group-auto-discovery", &discovery],
        cp.admin_kubeconfig(),
    )
    .await;
    let rpc = Rpc::connect(&provider).await;
    (provider, rpc)
}

/// A set of ids, for comparing with what the provider answers.
pub fn ids(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}
