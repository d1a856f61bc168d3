//! The fleet: N Machines with Ready Nodes over G MachineDeployments (each with its MachineSet), about
//! 10% of the groups at zero replicas, plus about 5% Nodes that belong to no group. Created through
//! the API with many calls in flight; removed the same way before the next size.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::ExternalGrpcNode;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Api, Client};
use serde_json::{Value, json};

use crate::support;

/// API calls in flight while the fleet is created or removed.
const IN_FLIGHT: usize = 48;
/// Attempts per API call (transient errors: throttling, timeouts, 5xx).
const ATTEMPTS: u32 = 8;
pub const CLUSTER: &str = "bench";
const CAPI_VERSION: &str = "v1beta2";
/// Label on every Node of a fleet (its namespace), for removal.
pub const FLEET_LABEL: &str = "bench.capi-autoscaler-provider.test/fleet";
/// Label on every Node of a group and on its template: the MachineDeployment's name. Pending pods
/// select it to pick the one group they fit.
pub const GROUP_LABEL: &str = "bench.capi-autoscaler-provider.test/group";
pub const CPU: &str = "4";
pub const MEMORY: &str = "16Gi";
pub const PODS: &str = "110";

#[derive(Clone, Debug)]
pub struct Group {
    pub name: String,
    /// `MachineDeployment/<ns>/<name>`.
    pub id: String,
    pub min: i32,
    pub max: i32,
    pub replicas: i32,
    /// Indexes into `Fleet::nodes` of the group's Machines.
    pub members: Vec<usize>,
}

impl Group {
    pub fn zero(&self) -> bool {
        self.replicas == 0
    }
}

#[derive(Clone, Debug)]
pub struct FleetNode {
    pub name: String,
    pub provider_id: String,
    /// The Machine's name (same as the Node's), for grouped Nodes.
    pub machine: Option<String>,
    pub group: Option<usize>,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

impl FleetNode {
    /// The node as CA sends it.
    pub fn grpc(&self) -> ExternalGrpcNode {
        ExternalGrpcNode {
            provider_id: self.provider_id.clone(),
            name: self.name.clone(),
            labels: self.labels.clone().into_iter().collect(),
            annotations: self.annotations.clone().into_iter().collect(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Fleet {
    pub ns: String,
    pub machines: usize,
    pub groups: Vec<Group>,
    pub nodes: Vec<FleetNode>,
    /// How long creating it took, and how many API objects that was.
    pub created_in: Duration,
    pub objects: usize,
}

impl Fleet {
    /// The plan: names, sizes and membership (nothing created yet).
    pub fn plan(ns: &str, machines: usize, groups: usize) -> Fleet {
        let groups = groups.max(1);
        let zero = |g: usize| groups >= 10 && g % 10 == 9;
        let mut list: Vec<Group> = (0..groups)
            .map(|g| {
                let name = format!("md-{g:05}");
                Group {
                    id: format!("MachineDeployment/{ns}/{name}"),
                    name,
                    min: if zero(g) { 0 } else { 1 },
                    max: 1000,
                    replicas: 0,
                    members: Vec::new(),
                }
            })
            .collect();
        let filled: Vec<usize> = (0..groups).filter(|g| !zero(*g)).collect();
        let mut nodes = Vec::with_capacity(machines + machines / 20);
        for i in 0..machines {
            let g = filled[i % filled.len()];
            let name = format!("{ns}-m{i:06}");
            let group = &mut list[g];
            group.members.push(nodes.len());
            group.replicas += 1;
            let mut labels = base_labels(ns, &name, g);
            labels.insert(GROUP_LABEL.into(), group.name.clone());
            let annotations = [
                ("cluster.x-k8s.io/machine", name.as_str()),
                ("cluster.x-k8s.io/cluster-namespace", ns),
                ("cluster.x-k8s.io/cluster-name", CLUSTER),
                ("cluster.x-k8s.io/owner-kind", "MachineSet"),
                ("cluster.x-k8s.io/owner-name", &set_name(&group.name)),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
            nodes.push(FleetNode {
                provider_id: format!("bench:///{ns}/{name}"),
                machine: Some(name.clone()),
                name,
                group: Some(g),
                labels,
                annotations,
            });
        }
        for j in 0..machines / 20 {
            let name = format!("{ns}-u{j:05}");
            nodes.push(FleetNode {
                provider_id: format!("bench:///{ns}/{name}"),
                labels: base_labels(ns, &name, j),
                name,
                machine: None,
                group: None,
                annotations: BTreeMap::new(),
            });
        }
        Fleet {
            ns: ns.to_string(),
            machines,
            groups: list,
            nodes,
            created_in: Duration::ZERO,
            objects: 0,
        }
    }

    pub fn zero_groups(&self) -> impl Iterator<Item = &Group> {
        self.groups.iter().filter(|g| g.zero())
    }

    /// The last Machine's Node: once a server maps it, it has seen every Machine.
    pub fn probe(&self) -> Option<(&FleetNode, &Group)> {
        self.nodes
            .iter()
            .rev()
            .find_map(|n| n.group.map(|g| (n, &self.groups[g])))
    }

    /// Creates everything in the API: one infrastructure template, the MachineDeployments, their
    /// MachineSets, the Machines (object, then status) and the Nodes.
    pub async fn create(&mut self, client: &Client) {
        let started = Instant::now();
        let capi =
            support::capi::Capi::new(client.clone(), &self.ns, support::CAPI_GROUP, CAPI_VERSION);
        capi.create_infra_template(TEMPLATE).await;
        let ns = self.ns.clone();
        let mds = api(client, &ns, "MachineDeployment", "machinedeployments");
        let sets = api(client, &ns, "MachineSet", "machinesets");
        let md_uids: Vec<String> = futures::stream::iter(self.groups.iter())
            .map(|g| {
                let mds = mds.clone();
                let object = deployment(&ns, g);
                async move { create_observed(&mds, object, g.replicas).await }
            })
            .buffered(IN_FLIGHT)
            .collect()
            .await;
        let set_uids: Vec<String> = futures::stream::iter(self.groups.iter().zip(md_uids))
            .map(|(g, uid)| {
                let sets = sets.clone();
                let object = machine_set(&ns, g, &uid);
                async move { create_observed(&sets, object, g.replicas).await }
            })
            .buffered(IN_FLIGHT)
            .collect()
            .await;
        let machines = api(client, &ns, "Machine", "machines");
        let machine_work = futures::stream::iter(self.nodes.iter().filter(|n| n.group.is_some()))
            .map(|n| {
                let machines = machines.clone();
                let g = n.group.unwrap_or_default();
                let object = machine(&ns, n, &self.groups[g], &set_uids[g]);
                let status = json!({"status": {"phase": "Running", "nodeRef": {"name": n.name}}});
                let name = n.machine.clone().unwrap_or_default();
                async move {
                    create(&machines, object).await;
                    retry(&format!("status of Machine {name}"), || async {
                        machines
                            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                            .await
                    })
                    .await;
                }
            })
            .buffer_unordered(IN_FLIGHT)
            .collect::<Vec<()>>();
        let nodes: Api<Node> = Api::all(client.clone());
        let node_work = futures::stream::iter(self.nodes.iter())
            .map(|n| {
                let nodes = nodes.clone();
                let object = node(n);
                async move {
                    retry(&format!("create Node {}", n.name), || async {
                        match nodes.create(&PostParams::default(), &object).await {
                            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                            other => other.map(drop),
                        }
                    })
                    .await;
                }
            })
            .buffer_unordered(IN_FLIGHT)
            .collect::<Vec<()>>();
        futures::join!(machine_work, node_work);
        self.created_in = started.elapsed();
        self.objects = 1 + 2 * self.groups.len() + self.machines + self.nodes.len();
    }

    /// Removes every object of the fleet (collections by namespace; Nodes by label).
    pub async fn delete(&self, client: &Client) {
        let ns = &self.ns;
        for (kind, plural) in [
            ("Machine", "machines"),
            ("MachineSet", "machinesets"),
            ("MachineDeployment", "machinedeployments"),
        ] {
            let api = api(client, ns, kind, plural);
            retry(&format!("delete the {plural} of {ns}"), || async {
                api.delete_collection(&DeleteParams::default(), &ListParams::default())
                    .await
                    .map(drop)
            })
            .await;
        }
        let nodes: Api<Node> = Api::all(client.clone());
        let selector = format!("{FLEET_LABEL}={ns}");
        retry(&format!("delete the Nodes of {ns}"), || async {
            nodes
                .delete_collection(
                    &DeleteParams::default(),
                    &ListParams::default().labels(&selector),
                )
                .await
                .map(drop)
        })
        .await;
    }
}

const TEMPLATE: &str = "bench-template";

fn set_name(md: &str) -> String {
    format!("{md}-ms")
}

fn base_labels(ns: &str, name: &str, zone: usize) -> BTreeMap<String, String> {
    [
        ("kubernetes.io/hostname", name.to_string()),
        ("kubernetes.io/os", "linux".into()),
        ("kubernetes.io/arch", "amd64".into()),
        ("node.kubernetes.io/instance-type", "bench-4x16".into()),
        ("topology.kubernetes.io/zone", format!("zone-{}", zone % 3)),
        (FLEET_LABEL, ns.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn api(client: &Client, ns: &str, kind: &str, plural: &str) -> Api<DynamicObject> {
    let ar: ApiResource = support::capi_resource(support::CAPI_GROUP, CAPI_VERSION, kind, plural);
    Api::namespaced_with(client.clone(), ns, &ar)
}

fn key(suffix: &str) -> String {
    format!("{}/{suffix}", support::CAPI_GROUP)
}

fn template_spec(ns: &str, md: &str) -> Value {
    json!({
        "metadata": {"labels": selector(md, None)},
        "spec": {
            "clusterName": CLUSTER,
            "bootstrap": {"dataSecretName": format!("{ns}-bootstrap")},
            "infrastructureRef": {
                "apiGroup": support::capi::INFRA_GROUP,
                "kind": support::infra::TEMPLATE_KIND,
                "name": TEMPLATE,
            },
        },
    })
}

fn selector(md: &str, set: Option<&str>) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        (key("cluster-name"), CLUSTER.to_string()),
        (key("deployment-name"), md.to_string()),
    ]);
    if let Some(set) = set {
        labels.insert(key("set-name"), set.to_string());
    }
    labels
}

fn object(ar_kind: &str, plural: &str, metadata: Value, spec: Value) -> DynamicObject {
    let ar = support::capi_resource(support::CAPI_GROUP, CAPI_VERSION, ar_kind, plural);
    let mut object = DynamicObject::new("", &ar).data(json!({ "spec": spec }));
    object.metadata = serde_json::from_value(metadata).unwrap_or_default();
    object
}

fn deployment(ns: &str, g: &Group) -> DynamicObject {
    let labels = format!("e2e-scenario={ns},{GROUP_LABEL}={}", g.name);
    let annotations = BTreeMap::from([
        (
            key("cluster-api-autoscaler-node-group-min-size"),
            g.min.to_string(),
        ),
        (
            key("cluster-api-autoscaler-node-group-max-size"),
            g.max.to_string(),
        ),
        (
            "capacity.cluster-autoscaler.kubernetes.io/cpu".into(),
            CPU.to_string(),
        ),
        (
            "capacity.cluster-autoscaler.kubernetes.io/memory".into(),
            MEMORY.to_string(),
        ),
        (
            "capacity.cluster-autoscaler.kubernetes.io/maxPods".into(),
            PODS.to_string(),
        ),
        (
            "capacity.cluster-autoscaler.kubernetes.io/labels".into(),
            labels,
        ),
    ]);
    object(
        "MachineDeployment",
        "machinedeployments",
        json!({
            "name": g.name,
            "labels": {key("cluster-name"): CLUSTER},
            "annotations": annotations,
        }),
        json!({
            "clusterName": CLUSTER,
            "replicas": g.replicas,
            "selector": {"matchLabels": selector(&g.name, None)},
            "template": template_spec(ns, &g.name),
        }),
    )
}

fn machine_set(ns: &str, g: &Group, md_uid: &str) -> DynamicObject {
    let set = set_name(&g.name);
    let mut template = template_spec(ns, &g.name);
    template["metadata"]["labels"] = json!(selector(&g.name, Some(&set)));
    object(
        "MachineSet",
        "machinesets",
        json!({
            "name": set,
            "labels": selector(&g.name, None),
            "annotations": {"machinedeployment.clusters.x-k8s.io/revision": "1"},
            "ownerReferences": [{
                "apiVersion": format!("{}/{CAPI_VERSION}", support::CAPI_GROUP),
                "kind": "MachineDeployment", "name": g.name, "uid": md_uid, "controller": true,
            }],
        }),
        json!({
            "clusterName": CLUSTER,
            "replicas": g.replicas,
            "selector": {"matchLabels": selector(&g.name, Some(&set))},
            "template": template,
        }),
    )
}

fn machine(ns: &str, n: &FleetNode, g: &Group, set_uid: &str) -> DynamicObject {
    let set = set_name(&g.name);
    object(
        "Machine",
        "machines",
        json!({
            "name": n.machine,
            "labels": selector(&g.name, Some(&set)),
            "ownerReferences": [{
                "apiVersion": format!("{}/{CAPI_VERSION}", support::CAPI_GROUP),
                "kind": "MachineSet", "name": set, "uid": set_uid, "controller": true,
            }],
        }),
        json!({
            "clusterName": CLUSTER,
            "providerID": n.provider_id,
            "bootstrap": {"dataSecretName": format!("{ns}-bootstrap")},
            "infrastructureRef": {
                "apiGroup": support::capi::INFRA_GROUP,
                "kind": "E2EMachine",
                "name": n.name,
            },
        }),
    )
}

fn node(n: &FleetNode) -> Node {
    let now = k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now())
        .to_string();
    let capacity = json!({"cpu": CPU, "memory": MEMORY, "pods": PODS});
    serde_json::from_value(json!({
        "metadata": {"name": n.name, "labels": n.labels, "annotations": n.annotations},
        "spec": {"providerID": n.provider_id},
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "bench fleet", "lastHeartbeatTime": now, "lastTransitionTime": now,
            }],
            "addresses": [{"type": "Hostname", "address": n.name}],
            "nodeInfo": {
                "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "",
                "osImage": "bench", "containerRuntimeVersion": "bench://0",
                "kubeletVersion": "v1.36.2", "kubeProxyVersion": "",
                "operatingSystem": "linux", "architecture": "amd64",
            },
        },
    }))
    .unwrap_or_default()
}

/// Creates `object` (an existing one of the same name counts) and returns its uid.
async fn create(api: &Api<DynamicObject>, object: DynamicObject) -> String {
    let name = object.metadata.name.clone().unwrap_or_default();
    let created = retry(&format!("create {name}"), || async {
        match api.create(&PostParams::default(), &object).await {
            Err(kube::Error::Api(s)) if s.code == 409 => api.get(&name).await,
            other => other,
        }
    })
    .await;
    created.metadata.uid.unwrap_or_default()
}

/// Creates a MachineDeployment or MachineSet with the status Cluster API's controller gives it
/// once it has acted on it (its generation observed, `replicas` Machines): a management cluster's
/// groups are reconciled, and a removal reads what Cluster API observed. Returns its uid.
async fn create_observed(api: &Api<DynamicObject>, object: DynamicObject, replicas: i32) -> String {
    let name = object.metadata.name.clone().unwrap_or_default();
    let uid = create(api, object).await;
    let status = json!({"status": {"observedGeneration": 1, "replicas": replicas}});
    retry(&format!("status of {name}"), || async {
        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await
    })
    .await;
    uid
}

/// Calls `f` until it succeeds, at most [`ATTEMPTS`] times with a growing pause; panics after that
/// (the fleet is the benchmark's own setup: a half-made one measures nothing).
pub async fn retry<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let mut pause = Duration::from_millis(100);
    for attempt in 1..=ATTEMPTS {
        match f().await {
            Ok(v) => return v,
            Err(e) if attempt == ATTEMPTS => panic!("{what}: {e}"),
            Err(_) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
        }
    }
    unreachable!("the last attempt returns or panics")
}

/// `spec.replicas` of MachineDeployment `name`.
pub async fn replicas(client: &Client, ns: &str, name: &str) -> Option<i64> {
    let mds = api(client, ns, "MachineDeployment", "machinedeployments");
    mds.get(name).await.ok()?.data["spec"]["replicas"].as_i64()
}

/// Sets `spec.replicas` of MachineDeployment `name` (scale subresource).
pub async fn set_replicas(client: &Client, ns: &str, name: &str, replicas: i64) {
    let mds = api(client, ns, "MachineDeployment", "machinedeployments");
    let patch = json!({"spec": {"replicas": replicas}});
    retry(&format!("scale {name}"), || async {
        mds.patch_scale(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
    })
    .await;
}

/// Whether Machine `name` carries the delete-machine annotation.
pub async fn marked(client: &Client, ns: &str, name: &str) -> bool {
    let machines = api(client, ns, "Machine", "machines");
    machines.get(name).await.ok().is_some_and(|m| {
        m.metadata
            .annotations
            .is_some_and(|a| a.contains_key(&key("delete-machine")))
    })
}

/// Sets annotation `key=value` on MachineDeployment `name` (makes the provider rebuild its snapshot).
pub async fn touch(client: &Client, ns: &str, name: &str, value: &str) {
    let mds = api(client, ns, "MachineDeployment", "machinedeployments");
    let patch =
        json!({"metadata": {"annotations": {"bench.capi-autoscaler-provider.test/touch": value}}});
    retry(&format!("annotate {name}"), || async {
        mds.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
    })
    .await;
}

/// How many Machines the namespace has (a check that the fleet is all there).
pub async fn count_machines(client: &Client, ns: &str) -> usize {
    let machines = api(client, ns, "Machine", "machines");
    let mut count = 0;
    let mut params = ListParams::default().limit(5000);
    loop {
        let Ok(page) = machines.list_metadata(&params).await else {
            return count;
        };
        count += page.items.len();
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return count,
        }
    }
}
