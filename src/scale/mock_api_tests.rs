//! The write path and the repair against a mock management-cluster API, as kube-rs's controller-rs
//! tests its reconciler: the client is `kube::Client::new` over a `tower_test` mock service, and a
//! task answers its requests. Here that task is a small API server ([`FakeApi`]): it keeps the
//! objects, applies JSON merge patches under their `metadata.resourceVersion` precondition (409
//! when it is stale, as the real API server does), lists, and records every request; a test
//! queues faults for single requests ([`Fault`]: a refusal, an answer lost after the write landed, a
//! request lost before it did, one that lands late, one never answered, another writer first).
//! Tests assert the requests sent, in order, with their exact bodies, and the objects the fake
//! holds afterwards.
//!
//! Group `MachineDeployment/ns/md` (min 1, max 5) has MachineSet md-1 and its Machines (one test
//! uses MachinePool mp instead); the provider's cache starts as the fake's objects are, unless a
//! test changes the fake "meanwhile" (another writer the watch has not delivered yet). The fake
//! bumps an object's generation when its spec changes; [`Fixture::capi_acts`] plays Cluster API's
//! MachineDeployment and MachineSet controllers once (replicas copied, observedGeneration set,
//! surplus Machines deleted in its order), so a test puts them exactly where an interleaving needs.
//! Each of the findings of the protocol's review (issue 28) has its test here, named after what
//! it guards.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use kube::client::Body;
use serde_json::{Value, json};
use tower_test::mock::{Handle, SendResponse};

use crate::apis::CapiApis;
use crate::backend::{ActuatorError, ApiCause, NodeToDelete};
use crate::cache::Index;
use crate::cache::writer::Watched;
use crate::capi::{DEFAULT_GROUP, Keys, Machine, ScalableKind, ScalableResource};
use crate::lock;
use crate::metrics::Metrics;
use crate::object::ApiObject;
use crate::protocol::ledger::{
    CLAIMS_ANNOTATION, LEDGER_ANNOTATION, RESIZES_ANNOTATION, TAKING_BACK_ANNOTATION, mark_entry,
};
use crate::protocol::{our_mark, our_mark_stamp};
use crate::scale::Actuator;
use crate::snapshot::Settings;
use crate::watch::Store;

// ===== fixtures: objects, the fake API, the actuator over it =====

const NS: &str = "ns";
const GROUP: &str = "MachineDeployment/ns/md";
const API_PREFIX: &str = "/apis/cluster.x-k8s.io/v1beta2/namespaces/ns/";
/// Bound on every operation a test awaits: a request the fake never gets fails the test, it does
/// not hang it.
const PATIENCE: Duration = Duration::from_secs(30);

fn keys() -> Keys {
    Keys::default()
}

/// MachineDeployment md (min 1, max 5) with `replicas` and extra annotations.
fn deployment(replicas: i32, annotations: &[(&str, String)]) -> Value {
    let keys = keys();
    let mut object = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "MachineDeployment",
        "metadata": {
            "namespace": NS, "name": "md", "uid": "uid-md", "resourceVersion": "1", "generation": 1,
            "annotations": {keys.min_size.as_str(): "1", keys.max_size.as_str(): "5"},
        },
        "spec": {"clusterName": "c1", "replicas": replicas, "template": {"spec": {"clusterName": "c1"}}},
        "status": {"observedGeneration": 1},
    });
    for (key, value) in annotations {
        object["metadata"]["annotations"][*key] = json!(value);
    }
    object
}

/// MachineSet md-1 of md (its only revision, so md is not rolling out).
fn machine_set(replicas: i32) -> Value {
    json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "MachineSet",
        "metadata": {
            "namespace": NS, "name": "md-1", "uid": "uid-md-1", "resourceVersion": "1", "generation": 1,
            "annotations": {"machinedeployment.clusters.x-k8s.io/revision": "1"},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment", "name": "md", "uid": "uid-md"}],
        },
        "spec": {"clusterName": "c1", "replicas": replicas},
        "status": {"replicas": replicas, "observedGeneration": 1},
    })
}

/// Machine `name` of md-1: with a Node of its name (`registered`), else pending (no providerID,
/// no Node); with `mark` as its delete-machine annotation.
fn machine(name: &str, registered: bool, mark: Option<String>) -> Value {
    let mut object = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "Machine",
        "metadata": {
            "namespace": NS, "name": name, "uid": format!("uid-{name}"), "resourceVersion": "1",
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet", "name": "md-1", "uid": "uid-md-1"}],
        },
        "spec": {"clusterName": "c1"},
    });
    if registered {
        object["spec"]["providerID"] = json!(format!("e2e:///ns/{name}"));
        object["status"] = json!({"nodeRef": {"name": name}});
    }
    if let Some(mark) = mark {
        object["metadata"]["annotations"] = json!({keys().delete_machine: mark});
    }
    object
}

/// MachinePool mp (min 0, max 5) with `replicas` and these instances in its providerIDList, none
/// with a Machine (an infrastructure provider without MachinePool Machines).
fn machine_pool(replicas: i32, instances: &[&str]) -> Value {
    let keys = keys();
    json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "MachinePool",
        "metadata": {
            "namespace": NS, "name": "mp", "uid": "uid-mp", "resourceVersion": "1", "generation": 1,
            "annotations": {keys.min_size.as_str(): "0", keys.max_size.as_str(): "5"},
        },
        "status": {"observedGeneration": 1},
        "spec": {
            "clusterName": "c1", "replicas": replicas,
            "providerIDList": instances.iter().map(|i| format!("e2e:///ns/{i}")).collect::<Vec<_>>(),
            "template": {"spec": {"clusterName": "c1"}},
        },
    })
}

/// The node CA names for Machine `name`.
fn node(name: &str) -> NodeToDelete {
    NodeToDelete {
        provider_id: format!("e2e:///ns/{name}"),
        name: name.into(),
        ..NodeToDelete::default()
    }
}

/// Where the API serves `object`, under [`API_PREFIX`]: `machinedeployments/md`.
fn object_path(object: &Value) -> String {
    let kind = object["kind"].as_str().unwrap_or_default();
    let plural = match ScalableKind::from_kind(kind) {
        Some(kind) => kind.plural(),
        None => "machines",
    };
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    format!("{plural}/{name}")
}

/// What the fake does with one request a test singled out.
#[derive(Clone, Debug)]
enum Fault {
    /// Answers this Status code (a Status object), writes nothing.
    Refuse(u16),
    /// Applies the request, then the connection drops: the client never gets the answer.
    LoseAnswer,
    /// The connection drops before the request reaches the server: nothing applied.
    LoseRequest,
    /// The connection drops at once, and the request reaches the server later, just before the
    /// second request after it (a proxy delivering it late).
    ArriveLate,
    /// Applies the request and never answers.
    Hang,
    /// Cluster API acts ([`FakeApi::capi_acts`]) just before the request is served: where an
    /// interleaving puts the MachineSet controller between two writes.
    CapiFirst,
    /// Another writer changes the object just before the request is served (a new
    /// resourceVersion, an annotation of its own), so a request guarded by the version before
    /// conflicts.
    OtherWriterFirst,
    /// Served at once, answered only once the gate is opened (a slow answer, while the test
    /// changes things).
    Held(Arc<tokio::sync::Notify>),
}

/// The annotation [`Fault::OtherWriterFirst`] writes: a write over it must keep it.
const OTHER_WRITER: &str = "example.com/other-writer";

/// A fault for the `nth` (from 0) request `method` `path` from now on.
#[derive(Clone, Debug)]
struct Rule {
    method: Method,
    path: String,
    nth: usize,
    fault: Fault,
}

/// What the fake was asked: `method` `path` (under [`API_PREFIX`]), with its body.
#[derive(Clone, Debug)]
struct Seen {
    method: Method,
    path: String,
    /// A LIST's `labelSelector` (`key=value`, the one form the actuator sends).
    selector: Option<String>,
    /// A LIST's `resourceVersion` when asked `resourceVersionMatch=NotOlderThan` (`None`: the
    /// newest there is).
    not_older_than: Option<String>,
    body: Option<Value>,
}

impl Seen {
    /// `PATCH_C`, `LIST_MACHINES`, `LIST machines labelled key=value`.
    fn summary(&self) -> String {
        let verb = if self.method == Method::GET && !self.path.contains('/') {
            "LIST"
        } else {
            self.method.as_str()
        };
        match &self.selector {
            Some(selector) => format!("{verb} {} labelled {selector}", self.path),
            None => format!("{verb} {}", self.path),
        }
    }

    /// Whether `object` is one this request's selector selects (every one without a selector).
    fn selects(&self, object: &Value) -> bool {
        self.selector.as_deref().is_none_or(|selector| {
            selector.split_once('=').is_some_and(|(key, value)| {
                object["metadata"]["labels"][key].as_str() == Some(value)
            })
        })
    }
}

/// A query parameter's value, percent-decoded.
fn query_value(query: &str, name: &str) -> Option<String> {
    let raw = query
        .split('&')
        .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))?;
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The management cluster's API as far as the actuator uses it (see the module docs).
struct FakeApi {
    /// Objects by path under [`API_PREFIX`].
    objects: BTreeMap<String, Value>,
    /// The last resourceVersion handed out (every object starts at "1").
    version: u64,
    faults: Vec<Rule>,
    /// A request that arrives late, and how many requests until it does.
    late: Option<(usize, Seen)>,
    seen: Vec<Seen>,
    /// The Machines watch: each Machine a write changed, as the watch would bring it.
    watch: Option<tokio::sync::mpsc::UnboundedSender<Value>>,
}

/// What the serving task does with a request.
enum Answer {
    Respond(StatusCode, Value),
    /// This answer, once the gate is opened.
    Held(Arc<tokio::sync::Notify>, StatusCode, Value),
    Drop,
    Hang,
}

fn status(code: u16, reason: &str, message: String) -> (StatusCode, Value) {
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason, "code": code,
        }),
    )
}

/// RFC 7386 JSON merge patch: `null` removes, objects merge, anything else replaces.
fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(fields) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(target) = target {
        for (key, value) in fields {
            if value.is_null() {
                target.remove(key);
            } else {
                merge(target.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

impl FakeApi {
    fn new(objects: &[Value]) -> Self {
        FakeApi {
            objects: objects
                .iter()
                .map(|o| (object_path(o), o.clone()))
                .collect(),
            version: 1,
            faults: Vec::new(),
            late: None,
            seen: Vec::new(),
            watch: None,
        }
    }

    fn next_version(&mut self) -> String {
        self.version += 1;
        self.version.to_string()
    }

    fn answer(&mut self, request: Seen, content_type: Option<String>) -> Answer {
        self.seen.push(request.clone());
        if let Some((left, late)) = self.late.take() {
            if left <= 1 {
                let _ = self.apply(&late, Some("application/merge-patch+json".into()));
            } else {
                self.late = Some((left - 1, late));
            }
        }
        let matches = |r: &Rule| r.method == request.method && r.path == request.path;
        let fault = self
            .faults
            .iter()
            .position(|r| matches(r) && r.nth == 0)
            .map(|i| self.faults.remove(i).fault);
        for rule in self.faults.iter_mut().filter(|r| matches(r)) {
            rule.nth = rule.nth.saturating_sub(1);
        }
        match fault {
            None => {
                let (code, body) = self.apply(&request, content_type);
                Answer::Respond(code, body)
            }
            Some(Fault::Refuse(code)) => {
                let (code, body) = status(code, "Refused", format!("refused {}", request.path));
                Answer::Respond(code, body)
            }
            Some(Fault::LoseAnswer) => {
                let _ = self.apply(&request, content_type);
                Answer::Drop
            }
            Some(Fault::LoseRequest) => Answer::Drop,
            Some(Fault::ArriveLate) => {
                self.late = Some((2, request));
                Answer::Drop
            }
            Some(Fault::Hang) => {
                let _ = self.apply(&request, content_type);
                Answer::Hang
            }
            Some(Fault::CapiFirst) => {
                self.capi_acts();
                let (code, body) = self.apply(&request, content_type);
                Answer::Respond(code, body)
            }
            Some(Fault::Held(gate)) => {
                let (code, body) = self.apply(&request, content_type);
                Answer::Held(gate, code, body)
            }
            Some(Fault::OtherWriterFirst) => {
                let version = self.next_version();
                if let Some(object) = self.objects.get_mut(&request.path) {
                    object["metadata"]["annotations"][OTHER_WRITER] = json!(version);
                    object["metadata"]["resourceVersion"] = json!(version);
                }
                let (code, body) = self.apply(&request, content_type);
                Answer::Respond(code, body)
            }
        }
    }

    /// Cluster API acts once, as its MachineDeployment and MachineSet controllers would on what the
    /// fake holds: md's replicas copied to md-1, each generation observed, and Machines beyond the
    /// replicas deleted in the MachineSet's order (being deleted, then marked, then without a
    /// Node, ties by name). Returns the Machines it began deleting.
    fn capi_acts(&mut self) -> Vec<String> {
        let api = self;
        let replicas = api.objects[MD]["spec"]["replicas"].clone();
        for path in [MD, MS] {
            let generation = api.objects[path]["metadata"]["generation"].clone();
            let version = api.next_version();
            let object = api.objects.get_mut(path).expect("md and md-1");
            if path == MS {
                object["spec"]["replicas"] = replicas.clone();
            }
            object["status"]["observedGeneration"] = generation;
            object["metadata"]["resourceVersion"] = json!(version);
        }
        let delete_key = keys().delete_machine;
        let mut order: Vec<(u8, String)> = api
            .objects
            .iter()
            .filter(|(p, _)| p.starts_with("machines/"))
            .map(|(p, m)| {
                let rank = if !m["metadata"]["deletionTimestamp"].is_null() {
                    0
                } else if !m["metadata"]["annotations"][delete_key.as_str()].is_null() {
                    1
                } else if m["status"]["nodeRef"].is_null() {
                    2
                } else {
                    3
                };
                (rank, p.clone())
            })
            .collect();
        order.sort();
        let surplus = order
            .len()
            .saturating_sub(replicas.as_u64().unwrap_or(0) as usize);
        let mut deleted = Vec::new();
        for (rank, path) in order.into_iter().take(surplus) {
            if rank == 0 {
                continue;
            }
            let version = api.next_version();
            let machine = api.objects.get_mut(&path).expect("listed");
            machine["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            machine["metadata"]["resourceVersion"] = json!(version);
            deleted.push(path.trim_start_matches("machines/").to_string());
        }
        deleted
    }

    /// Serves a request as the API server would.
    fn apply(&mut self, request: &Seen, content_type: Option<String>) -> (StatusCode, Value) {
        let path = request.path.as_str();
        match request.method {
            Method::GET if !path.contains('/') => {
                let prefix = format!("{path}/");
                let items: Vec<Value> = self
                    .objects
                    .iter()
                    .filter(|(p, o)| p.starts_with(&prefix) && request.selects(o))
                    .map(|(_, o)| o.clone())
                    .collect();
                (
                    StatusCode::OK,
                    json!({
                        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineList",
                        "metadata": {"resourceVersion": self.version.to_string()},
                        "items": items,
                    }),
                )
            }
            Method::GET => match self.objects.get(path) {
                Some(object) => (StatusCode::OK, object.clone()),
                None => status(404, "NotFound", format!("{path} not found")),
            },
            Method::PATCH => {
                if content_type.as_deref() != Some("application/merge-patch+json") {
                    return status(415, "UnsupportedMediaType", format!("{content_type:?}"));
                }
                let Some(patch) = request.body.clone() else {
                    return status(400, "BadRequest", "no body".into());
                };
                let version = self.next_version();
                let Some(object) = self.objects.get_mut(path) else {
                    return status(404, "NotFound", format!("{path} not found"));
                };
                let current = object["metadata"]["resourceVersion"].clone();
                let guard = &patch["metadata"]["resourceVersion"];
                if !guard.is_null() && *guard != current {
                    return status(
                        409,
                        "Conflict",
                        format!("{path}: the object has been modified ({guard} is not {current})"),
                    );
                }
                let spec = object["spec"].clone();
                merge(object, &patch);
                object["metadata"]["resourceVersion"] = json!(version);
                if object["spec"] != spec {
                    let generation = object["metadata"]["generation"].as_i64().unwrap_or(1);
                    object["metadata"]["generation"] = json!(generation + 1);
                }
                let object = object.clone();
                if path.starts_with("machines/")
                    && let Some(watch) = &self.watch
                {
                    let _ = watch.send(object.clone());
                }
                (StatusCode::OK, object)
            }
            _ => status(
                405,
                "MethodNotAllowed",
                format!("{} {path}", request.method),
            ),
        }
    }
}

/// The task that answers the client's requests from `api` until the client is gone. Requests it
/// hangs on are kept (never answered, never closed).
async fn serve(mut handle: Handle<Request<Body>, Response<Body>>, api: Arc<Mutex<FakeApi>>) {
    let mut hanging: Vec<SendResponse<Response<Body>>> = Vec::new();
    while let Some((request, respond)) = handle.next_request().await {
        let (parts, body) = request.into_parts();
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let seen = Seen {
            method: parts.method.clone(),
            path: parts
                .uri
                .path()
                .strip_prefix(API_PREFIX)
                .unwrap_or(parts.uri.path())
                .to_string(),
            selector: parts
                .uri
                .query()
                .and_then(|q| query_value(q, "labelSelector")),
            not_older_than: parts.uri.query().and_then(|q| {
                (query_value(q, "resourceVersionMatch").as_deref() == Some("NotOlderThan"))
                    .then(|| query_value(q, "resourceVersion"))
                    .flatten()
            }),
            body: serde_json::from_slice(&bytes).ok(),
        };
        let content_type = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let answer = lock(&api).answer(seen, content_type);
        let response = |code, body: Value| {
            Response::builder()
                .status(code)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Body::from(serde_json::to_vec(&body).unwrap_or_default()))
                .expect("a response of a status and a JSON body")
        };
        match answer {
            Answer::Respond(code, body) => respond.send_response(response(code, body)),
            Answer::Held(gate, code, body) => {
                let response = response(code, body);
                tokio::spawn(async move {
                    gate.notified().await;
                    respond.send_response(response);
                });
            }
            Answer::Drop => respond.send_error("connection reset by peer"),
            Answer::Hang => hanging.push(respond),
        }
    }
}

/// The actuator over a store whose cache holds `objects`, writing to a [`FakeApi`] that holds them too.
struct Fixture {
    actuator: Arc<Actuator>,
    api: Arc<Mutex<FakeApi>>,
}

impl Fixture {
    fn new(objects: &[Value]) -> Self {
        let keys = keys();
        let mut index = Index::default();
        for object in objects {
            let kind = object["kind"].as_str().unwrap_or_default();
            match ScalableKind::from_kind(kind) {
                Some(kind) => {
                    let r = ScalableResource::from_json(kind, &keys, object).unwrap();
                    index.apply_resource(kind, r.key.clone(), Ok(Arc::new(r)));
                }
                None => {
                    let m = Machine::from_json(&keys, object).unwrap();
                    index.apply_machine(m.key.clone(), Ok(Arc::new(m)));
                }
            }
        }
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let api = Arc::new(Mutex::new(FakeApi::new(objects)));
        tokio::spawn(serve(handle, Arc::clone(&api)));
        let metrics = Arc::new(Metrics::new());
        let store = Store::fixed(
            kube::Client::new(service, NS),
            CapiApis::assume(DEFAULT_GROUP, "v1beta2"),
            Settings::default(),
            index,
            Arc::clone(&metrics),
        );
        Fixture {
            actuator: Arc::new(Actuator::new(store, metrics)),
            api,
        }
    }

    /// With the watches of Machines and MachineSets: they have listed the fake's, and the Machines
    /// watch brings each Machine a write changes a moment after the write is answered.
    fn watching(self) -> Self {
        self.watching_after(Duration::from_millis(2))
    }

    /// As [`Fixture::watching`], the Machines watch bringing each change `lag` after the write.
    fn watching_after(self, lag: Duration) -> Self {
        let (send, mut changed) = tokio::sync::mpsc::unbounded_channel::<Value>();
        let store = Arc::clone(&self.actuator.store);
        let listed: Vec<(Watched, Value)> = {
            let mut api = lock(&self.api);
            api.watch = Some(send);
            api.objects
                .iter()
                .filter_map(|(path, o)| {
                    let what = match path.split('/').next() {
                        Some("machines") => Watched::Machine,
                        Some("machinesets") => Watched::Scalable(ScalableKind::MachineSet),
                        _ => return None,
                    };
                    Some((what, o.clone()))
                })
                .collect()
        };
        for (what, listed) in listed {
            store.take_event(&what, object(listed), false);
        }
        tokio::spawn(async move {
            while let Some(machine) = changed.recv().await {
                tokio::time::sleep(lag).await;
                store.take_event(&Watched::Machine, object(machine), false);
            }
        });
        self
    }

    /// The actuator waiting at most `wait` (and marking within twice that of a call's arrival).
    fn waiting(self, wait: Duration) -> Self {
        let actuator = Arc::try_unwrap(self.actuator)
            .unwrap_or_else(|_| panic!("the fixture's actuator is shared already"));
        Fixture {
            actuator: Arc::new(actuator.with_wait(wait)),
            api: self.api,
        }
    }

    /// The API server's clock reads `unix` seconds, as the `Date` of an answer would say.
    fn server_time(&self, unix: u64) {
        let mut headers = http::HeaderMap::new();
        let date = httpdate::fmt_http_date(std::time::UNIX_EPOCH + Duration::from_secs(unix));
        headers.insert(http::header::DATE, date.parse().expect("an HTTP date"));
        self.actuator.store.server_clock().saw(&headers);
    }

    /// Makes the next `method` request to `path` meet `fault`.
    fn fault(&self, method: Method, path: &str, fault: Fault) {
        self.fault_at(method, path, 0, fault);
    }

    /// Makes the `nth` (from 0) next `method` request to `path` meet `fault`.
    fn fault_at(&self, method: Method, path: &str, nth: usize, fault: Fault) {
        lock(&self.api).faults.push(Rule {
            method,
            path: path.to_string(),
            nth,
            fault,
        });
    }

    /// Another writer changes the object at `path` (a new resourceVersion) without the provider's
    /// cache seeing it.
    fn meanwhile(&self, path: &str, change: impl FnOnce(&mut Value)) {
        let mut api = lock(&self.api);
        let version = api.next_version();
        let object = api.objects.get_mut(path).expect("an object of the fixture");
        change(object);
        object["metadata"]["resourceVersion"] = json!(version);
    }

    /// Someone else (a user, another tool) marks Machine `name` for deletion, their decrement
    /// still to come: a removal of ours waits for the group to balance meanwhile.
    fn marked_by_someone_else(&self, name: &str) {
        self.meanwhile(&format!("machines/{name}"), |m| {
            m["metadata"]["annotations"][keys().delete_machine.as_str()] = json!("yes");
        });
    }

    fn object(&self, path: &str) -> Value {
        lock(&self.api).objects[path].clone()
    }

    fn replicas(&self) -> i64 {
        self.object("machinedeployments/md")["spec"]["replicas"]
            .as_i64()
            .unwrap_or(-1)
    }

    fn annotation(&self, path: &str, key: &str) -> Option<String> {
        self.object(path)["metadata"]["annotations"][key]
            .as_str()
            .map(str::to_string)
    }

    /// The resourceVersion of the object at `path` as the API has it.
    fn version(&self, path: &str) -> Option<u64> {
        self.object(path)["metadata"]["resourceVersion"]
            .as_str()
            .and_then(|v| v.parse().ok())
    }

    /// The delete-machine mark on Machine `name` as the API has it.
    fn mark(&self, name: &str) -> Option<String> {
        self.annotation(&format!("machines/{name}"), &keys().delete_machine)
    }

    fn seen(&self) -> Vec<Seen> {
        lock(&self.api).seen.clone()
    }

    /// Every request so far, as `PATCH_C`.
    fn requests(&self) -> Vec<String> {
        self.seen().iter().map(Seen::summary).collect()
    }

    /// Returns once the fake has been asked `request` (as [`Fixture::requests`] names it).
    async fn asked(&self, request: &str) {
        within(async {
            while !self.requests().iter().any(|r| r == request) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
    }

    /// The revision each LIST of `path` was asked not to be older than, in order (`None`: the
    /// newest there is).
    fn list_floors(&self, path: &str) -> Vec<Option<u64>> {
        self.seen()
            .into_iter()
            .filter(|s| s.method == Method::GET && s.path == path)
            .map(|s| s.not_older_than.and_then(|v| v.parse().ok()))
            .collect()
    }

    /// The bodies of the PATCH requests to `path`, in order.
    fn patches(&self, path: &str) -> Vec<Value> {
        self.seen()
            .into_iter()
            .filter(|s| s.method == Method::PATCH && s.path == path)
            .map(|s| s.body.unwrap_or_default())
            .collect()
    }
}

fn object(json: Value) -> ApiObject {
    ApiObject::from_json(json).expect("an object of the fixture")
}

/// `operation`, failing the test if it does not finish within [`PATIENCE`].
async fn within<T>(operation: impl Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, operation)
        .await
        .expect("the operation did not finish: the mock API was not asked what the test expects")
}

impl Fixture {
    /// Cluster API acts once (see [`FakeApi::capi_acts`]).
    fn capi_acts(&self) -> Vec<String> {
        lock(&self.api).capi_acts()
    }

    fn deleting(&self, name: &str) -> bool {
        lock(&self.api)
            .objects
            .get(&format!("machines/{name}"))
            .is_none_or(|m| !m["metadata"]["deletionTimestamp"].is_null())
    }

    fn records(&self, key: &str) -> Option<String> {
        self.annotation(MD, key)
    }

    /// Whether the provider sent no PATCH at all (a refusal that wrote nothing).
    fn wrote_nothing(&self) -> bool {
        self.seen().iter().all(|s| s.method != Method::PATCH)
    }

    /// The PATCH requests to `path` that landed (answered 2xx), in order, with their bodies.
    fn landed(&self, path: &str) -> usize {
        self.patches(path).len()
    }
}

/// The three registered Machines a, b, c and md at `replicas` with `annotations`.
fn three_running(replicas: i32, annotations: &[(&str, String)]) -> Vec<Value> {
    vec![
        deployment(replicas, annotations),
        machine_set(replicas),
        machine("a", true, None),
        machine("b", true, None),
        machine("c", true, None),
    ]
}

const MD: &str = "machinedeployments/md";
const MS: &str = "machinesets/md-1";
/// The requests as [`Fixture::requests`] lists them.
const GET_MD: &str = "GET machinedeployments/md";
const PATCH_MD: &str = "PATCH machinedeployments/md";
const LIST_SETS: &str = "LIST machinesets";
const GET_MS: &str = "GET machinesets/md-1";
const GET_CLUSTER: &str = "GET clusters/c1";
const LIST_MACHINES: &str = "LIST machines";
/// One fresh read: the group and its Cluster, then its MachineSets and its Machines (listed side by
/// side, asked in this order).
const READ: [&str; 4] = [GET_MD, GET_CLUSTER, LIST_SETS, LIST_MACHINES];
/// A later read of the same operation, the MachineDeployment controller having observed the same
/// generation as at the first: the MachineSets that read listed are read one by one.
const READ_AGAIN: [&str; 4] = [GET_MD, GET_CLUSTER, GET_MS, LIST_MACHINES];
/// A later read right after a landed write of the operation's own to the group: the group as that
/// write returned it (no GET of it nor of its Cluster), the rest as [`READ_AGAIN`].
const READ_AFTER_GROUP_WRITE: [&str; 2] = [GET_MS, LIST_MACHINES];

fn reads_then(writes: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = READ.iter().map(|s| s.to_string()).collect();
    out.extend(writes.iter().map(|s| s.to_string()));
    out
}

// ===== IncreaseSize =====

/// A raise decides from the group object and its Cluster alone: neither its MachineSets nor its
/// Machines are listed (the API server answers a list only once its cache has caught up).
#[tokio::test]
async fn increase_size_writes_replicas_and_its_token_guarded_by_the_version_read() {
    let fixture = Fixture::new(&three_running(3, &[]));

    within(fixture.actuator.increase_size(GROUP, 2))
        .await
        .unwrap();

    assert_eq!(
        fixture.requests(),
        [GET_MD, GET_CLUSTER, PATCH_MD].map(String::from)
    );
    let patch = &fixture.patches(MD)[0];
    assert_eq!(patch["metadata"]["resourceVersion"], json!("1"));
    assert_eq!(patch["spec"]["replicas"], json!(5));
    assert!(patch["metadata"]["annotations"][RESIZES_ANNOTATION].is_string());
    assert_eq!(fixture.replicas(), 5);
}

#[tokio::test]
async fn increase_size_after_a_conflict_reads_again_and_lands_once() {
    let fixture = Fixture::new(&three_running(2, &[]));
    fixture.fault(Method::PATCH, MD, Fault::OtherWriterFirst);

    within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap();

    assert_eq!(
        fixture.landed(MD),
        2,
        "the guarded write conflicted once, then landed"
    );
    assert_eq!(fixture.replicas(), 3);
}

#[tokio::test]
async fn increase_size_whose_answer_is_lost_is_read_back_by_its_token_and_not_applied_twice() {
    for fault in [Fault::LoseAnswer, Fault::ArriveLate] {
        let fixture = Fixture::new(&three_running(2, &[]));
        fixture.fault(Method::PATCH, MD, fault.clone());

        within(fixture.actuator.increase_size(GROUP, 1))
            .await
            .unwrap();
        // A request that arrives late lands before the next one: give it its turn.
        let _ = within(fixture.actuator.increase_size(GROUP, 0)).await;

        assert_eq!(fixture.replicas(), 3, "{fault:?}: raised once");
    }
}

#[tokio::test]
async fn increase_size_lost_before_it_landed_is_read_back_and_written_once_more() {
    let fixture = Fixture::new(&three_running(2, &[]));
    fixture.fault(Method::PATCH, MD, Fault::LoseRequest);

    within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap();

    assert_eq!(fixture.replicas(), 3);
    assert_eq!(fixture.landed(MD), 2, "sent twice, applied once");
}

#[tokio::test(start_paused = true)]
async fn increase_size_never_answered_times_out_reads_back_and_is_not_applied_twice() {
    let fixture = Fixture::new(&three_running(2, &[]));
    fixture.fault(Method::PATCH, MD, Fault::Hang);

    within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap();

    assert_eq!(fixture.replicas(), 3);
    assert_eq!(
        fixture.landed(MD),
        1,
        "found landed when read back: not sent again"
    );
}

#[tokio::test]
async fn increase_size_refusals_come_back_as_their_error_with_nothing_written() {
    for (code, forbidden) in [(403, true), (422, false)] {
        let fixture = Fixture::new(&three_running(2, &[]));
        fixture.fault(Method::PATCH, MD, Fault::Refuse(code));
        let error = within(fixture.actuator.increase_size(GROUP, 1))
            .await
            .unwrap_err();
        assert_eq!(
            matches!(
                error,
                ActuatorError::Api {
                    cause: ApiCause::Forbidden,
                    ..
                }
            ),
            forbidden,
            "{code}: {error:?}"
        );
        assert_eq!(fixture.replicas(), 2);
    }
}

#[tokio::test]
async fn increase_size_still_conflicting_after_every_attempt_gives_up_after_a_last_read() {
    let fixture = Fixture::new(&three_running(2, &[]));
    for nth in 0..crate::protocol::MAX_ATTEMPTS as usize {
        fixture.fault_at(Method::PATCH, MD, nth, Fault::OtherWriterFirst);
    }
    let error = within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap_err();
    assert!(matches!(error, ActuatorError::Conflict(_)), "{error:?}");
    assert_eq!(fixture.replicas(), 2);
    assert!(
        fixture.requests().ends_with(&[GET_CLUSTER.to_string()]),
        "a last read before giving up: {:?}",
        fixture.requests()
    );
}

// ===== DeleteNodes =====

#[tokio::test]
async fn delete_nodes_claims_marks_then_settles_with_one_guarded_decrement() {
    let fixture = Fixture::new(&three_running(3, &[]));

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    // The mark right after the claim landed (guarded by c's version as read), and the answer
    // right after the settlement that settled every claim: two reads, the second with the group
    // as the claim returned it.
    let mut want = reads_then(&[PATCH_MD, "PATCH machines/c"]);
    want.extend(READ_AFTER_GROUP_WRITE.map(String::from));
    want.push(PATCH_MD.to_string());
    assert_eq!(fixture.requests(), want);
    let mark = fixture.mark("c").expect("c is marked");
    let stamp = our_mark_stamp(&mark).expect("our mark");
    let entry = mark_entry("c", stamp);
    let md = fixture.patches(MD);
    assert_eq!(
        md[0]["metadata"]["annotations"][CLAIMS_ANNOTATION],
        json!(entry),
        "claimed first"
    );
    assert!(md[0]["spec"].is_null(), "nothing lowered before the mark");
    assert_eq!(md[1]["spec"]["replicas"], json!(2));
    assert_eq!(
        md[1]["metadata"]["annotations"][LEDGER_ANNOTATION],
        json!(entry)
    );
    assert!(md[1]["metadata"]["annotations"][CLAIMS_ANNOTATION].is_null());
    assert_eq!(fixture.replicas(), 2);
    assert_eq!((fixture.mark("a"), fixture.mark("b")), (None, None));
}

/// The settlement's read takes the group from the claim's answer, so another writer's change after
/// it is not in that read: the settlement, guarded by the claim's version, conflicts, and the read
/// after the conflict is of the group again (GETs), where the change is.
#[tokio::test]
async fn a_group_changed_after_the_claims_answer_is_read_again_once_the_settlement_conflicts() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.fault_at(Method::PATCH, MD, 1, Fault::OtherWriterFirst);

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    let mut want = reads_then(&[PATCH_MD, "PATCH machines/c"]);
    want.extend(READ_AFTER_GROUP_WRITE.map(String::from));
    want.push(PATCH_MD.to_string());
    want.extend(READ_AGAIN.map(String::from));
    want.push(PATCH_MD.to_string());
    assert_eq!(fixture.requests(), want);
    let md = fixture.patches(MD);
    assert_eq!(
        md.len(),
        3,
        "claim, the settlement that conflicted, the settlement"
    );
    assert_ne!(
        md[1]["metadata"]["resourceVersion"], md[2]["metadata"]["resourceVersion"],
        "the last settlement is guarded by the version read after the change"
    );
    assert_eq!(fixture.replicas(), 2);
    assert!(fixture.mark("c").is_some());
}

/// A removal's lists need not wait for the API server's cache to reach the newest revision there
/// is: they are asked not to be older than the group as read (its resourceVersion) and, in the
/// settlement's read, than the mark the removal wrote.
#[tokio::test]
async fn a_removals_lists_are_not_older_than_the_group_read_nor_its_own_mark() {
    let fixture = Fixture::new(&three_running(3, &[]));

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    let marked_at = fixture.version("machines/c");
    assert!(marked_at > Some(1), "the mark made a new revision");
    assert_eq!(
        fixture.list_floors("machines"),
        [Some(1), marked_at],
        "the group as read first, then the removal's own mark"
    );
    assert_eq!(fixture.list_floors("machinesets"), [Some(1)]);
}

/// Where the watch of Machines (of MachineSets) has brought every event up to a read's floor, the
/// cache's Machines (MachineSets) are that read's list: a removal whose watch brings its mark lists
/// neither, and decides as one that listed them. The settlement's read, whose floor is the mark
/// (no MachineSet event comes after it), reads the MachineSets the first read took from the cache
/// one by one, and the group as the removal's claim returned it.
#[tokio::test]
async fn a_removal_whose_watch_brings_its_mark_reads_the_machines_from_it_and_lists_none() {
    let fixture = Fixture::new(&three_running(3, &[])).watching();

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    let mut want: Vec<String> = [GET_MD, GET_CLUSTER, PATCH_MD, "PATCH machines/c"]
        .map(String::from)
        .to_vec();
    want.extend([GET_MS, PATCH_MD].map(String::from));
    assert_eq!(fixture.requests(), want);
    assert!(
        fixture
            .mark("c")
            .is_some_and(|m| our_mark_stamp(&m).is_some())
    );
    assert_eq!(fixture.replicas(), 2);
    let settled = &fixture.patches(MD)[1];
    assert_eq!(settled["spec"]["replicas"], json!(2));
    assert!(settled["metadata"]["annotations"][LEDGER_ANNOTATION].is_string());
}

/// A watch that does not bring the removal's own mark in time: the settlement's read lists the
/// Machines, not older than the mark, rather than deciding over Machines without it.
#[tokio::test]
async fn a_removal_whose_watch_lags_behind_its_mark_lists_the_machines_not_older_than_it() {
    let fixture = Fixture::new(&three_running(3, &[])).watching();
    lock(&fixture.api).watch = None;

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    let marked_at = fixture.version("machines/c");
    assert_eq!(
        fixture.list_floors("machines"),
        [marked_at],
        "the first read from the watch, the settlement's listed"
    );
    assert_eq!(fixture.replicas(), 2);
}

/// A watch later than the read waits for it: the Machines are listed, and the watch still answers
/// the read when it brings the mark before the list's answer (here never given).
#[tokio::test]
async fn a_removal_whose_watch_brings_its_mark_while_the_list_is_pending_reads_it_from_the_watch() {
    let fixture = Fixture::new(&three_running(3, &[])).watching_after(Duration::from_millis(200));
    let never = Arc::new(tokio::sync::Notify::new());
    fixture.fault(Method::GET, "machines", Fault::Held(Arc::clone(&never)));

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    let mut want: Vec<String> = [GET_MD, GET_CLUSTER, PATCH_MD, "PATCH machines/c"]
        .map(String::from)
        .to_vec();
    want.extend([GET_MS, LIST_MACHINES, PATCH_MD].map(String::from));
    assert_eq!(fixture.requests(), want);
    assert_eq!(fixture.replicas(), 2);
    assert!(fixture.mark("c").is_some());
}

/// A mark that met a change it did not make (a conflict) leaves no revision to read from: the
/// next read lists at the newest revision there is, where the change is.
#[tokio::test]
async fn after_a_conflicting_mark_the_next_read_lists_the_newest_revision() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.fault(Method::PATCH, "machines/c", Fault::OtherWriterFirst);

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    let floors = fixture.list_floors("machines");
    assert_eq!(floors.first(), Some(&Some(1)), "{floors:?}");
    assert_eq!(floors.get(1), Some(&None), "after the conflict: {floors:?}");
    assert!(
        floors[2..].iter().all(Option::is_some),
        "from a known revision again: {floors:?}"
    );
    assert_eq!(fixture.replicas(), 2);
    assert!(fixture.mark("c").is_some());
}

/// The group's watch brings a version newer than the Machines list answered at (the group changed
/// after the GET, the list came from before): members older than the group are no read the rules
/// allow for, so the read is made again, its lists not older than that version.
#[tokio::test]
async fn a_group_newer_than_its_listed_machines_is_read_again() {
    let fixture = Fixture::new(&three_running(3, &[]));
    let gate = Arc::new(tokio::sync::Notify::new());
    fixture.fault(Method::GET, "machines", Fault::Held(Arc::clone(&gate)));
    let actuator = Arc::clone(&fixture.actuator);
    let ours = tokio::spawn(async move { actuator.delete_nodes(GROUP, &[node("c")]).await });
    fixture.asked(LIST_MACHINES).await;
    // Someone else writes the group; its watch event reaches the cache before the list's answer.
    fixture.meanwhile(MD, |md| {
        md["metadata"]["labels"]["example.com/touched"] = json!("yes")
    });
    let newer = lock(&fixture.api).objects[MD].clone();
    let newer_at = newer["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|v| v.parse::<u64>().ok());
    fixture.actuator.store.record(
        Some(ScalableKind::MachineDeployment),
        serde_json::from_value(newer).unwrap(),
    );
    gate.notify_one();

    within(ours).await.unwrap().unwrap();

    // The read again reads the MachineSets the first listed one by one: the generation is the same.
    let mut want = READ.map(String::from).to_vec();
    want.extend(READ_AGAIN.map(String::from));
    want.extend([PATCH_MD, "PATCH machines/c"].map(String::from));
    want.extend(READ_AFTER_GROUP_WRITE.map(String::from));
    want.push(PATCH_MD.to_string());
    assert_eq!(fixture.requests(), want);
    let floors = fixture.list_floors("machines");
    assert!(
        floors[1] >= newer_at,
        "{floors:?}, the group at {newer_at:?}"
    );
    assert_eq!(fixture.replicas(), 2);
}

/// A MachineSet read one by one that is gone: only a list shows what replaced it, so the
/// MachineSets are listed again in the same read, and the removal goes on.
#[tokio::test]
async fn a_machine_set_gone_since_the_first_read_makes_the_next_read_list_them_again() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.fault(Method::GET, MS, Fault::Refuse(404));

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    let mut want = reads_then(&[PATCH_MD, "PATCH machines/c"]);
    // The Machines are listed once the watch has not brought the mark in time (there is none).
    want.extend([GET_MS, LIST_SETS, LIST_MACHINES].map(String::from));
    want.push(PATCH_MD.to_string());
    assert_eq!(fixture.requests(), want);
    assert_eq!(fixture.replicas(), 2);
}

#[tokio::test]
async fn delete_nodes_retried_after_it_landed_writes_nothing_more() {
    let fixture = Fixture::new(&three_running(3, &[]));
    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();
    let after_first = fixture.requests().len();

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    assert_eq!(fixture.requests()[after_first..], READ.map(str::to_string));
    assert_eq!(fixture.replicas(), 2);
}

#[tokio::test]
async fn delete_nodes_whose_settlement_is_refused_takes_its_mark_back_through_the_record() {
    let fixture = Fixture::new(&three_running(3, &[]));
    // The claims write, then the settlement (refused).
    fixture.fault_at(Method::PATCH, MD, 1, Fault::Refuse(422));

    let error = within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap_err();

    assert!(matches!(error, ActuatorError::Refused(_)), "{error:?}");
    assert_eq!(fixture.replicas(), 3);
    assert_eq!(fixture.mark("c"), None, "taken back");
    let md = fixture.patches(MD);
    assert!(
        md[2]["metadata"]["annotations"][TAKING_BACK_ANNOTATION].is_string(),
        "recorded as being taken back before the unmark: {md:?}"
    );
    let unmark = &fixture.patches("machines/c")[1];
    assert!(
        unmark["metadata"]["resourceVersion"].is_string(),
        "the unmark is guarded"
    );
}

#[tokio::test]
async fn delete_nodes_whose_settlement_answer_is_lost_reads_it_back_and_lowers_once() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.fault_at(Method::PATCH, MD, 1, Fault::LoseAnswer);

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    assert_eq!(fixture.replicas(), 2);
    assert!(fixture.mark("c").is_some());
}

/// Finding 1 (CA's own concurrency): CA sends one DeleteNodes per empty node back to back; the
/// MachineSet, woken by the second mark, takes the later-marked Machine (b sorts first) for the
/// first decrement before the second settles. Both nodes must go, both calls answered OK, no
/// mark left uncovered: the second settles its removal though its Machine is already going.
#[tokio::test]
async fn finding_1_a_mark_the_machine_set_takes_for_an_earlier_decrement_is_still_settled() {
    let fixture = Fixture::new(&three_running(3, &[]));
    // The group's writes: c's claim (0) and settlement (1), b's claim (2) and settlement (3).
    // Cluster API acts on c's decrement just before b's settlement is served, b marked by then.
    fixture.fault_at(Method::PATCH, MD, 3, Fault::CapiFirst);
    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    within(fixture.actuator.delete_nodes(GROUP, &[node("b")]))
        .await
        .unwrap();

    assert!(
        fixture.deleting("b"),
        "the MachineSet took b (by name) for c's decrement"
    );
    assert!(!fixture.deleting("c"), "c not yet");
    assert_eq!(
        fixture.replicas(),
        1,
        "b settled with its own decrement all the same"
    );
    assert_eq!(fixture.capi_acts(), ["c"], "so c goes as well");
    assert!(!fixture.deleting("a"));
}

/// Finding 3: a user's "annotate + scale down" in flight beside a removal: their mark on a is
/// not taken as paying for ours (which would leave one marked Machine behind).
#[tokio::test]
async fn finding_3_someone_elses_mark_and_decrement_are_not_credited_to_our_removal() {
    let fixture = Fixture::new(&three_running(3, &[]));
    // The user marks a (their decrement still to come) before our removal reads.
    fixture.marked_by_someone_else("a");
    let actuator = Arc::clone(&fixture.actuator);
    let ours = tokio::spawn(async move { actuator.delete_nodes(GROUP, &[node("c")]).await });
    // The user's decrement lands while ours waits for the group to balance.
    tokio::task::yield_now().await;
    fixture.meanwhile(MD, |md| md["spec"]["replicas"] = json!(2));
    within(ours).await.unwrap().unwrap();

    assert_eq!(fixture.replicas(), 1, "our removal paid its own decrement");
    let mut deleted = fixture.capi_acts();
    deleted.sort();
    assert_eq!(
        deleted,
        ["a", "c"],
        "both marked Machines go, none stays marked"
    );
}

/// A removal waiting for the group to balance has written nothing, so it lets the group's lock go
/// while it waits: CA's other calls on the group (its raise here) are answered meanwhile instead of
/// queueing behind the wait until their deadlines pass.
#[tokio::test]
async fn a_removal_waiting_with_nothing_written_lets_the_groups_other_calls_run() {
    let fixture = Fixture::new(&three_running(3, &[]));
    // Someone else's mark without its decrement: our removal waits for the group to balance.
    fixture.marked_by_someone_else("a");
    let actuator = Arc::clone(&fixture.actuator);
    let ours = tokio::spawn(async move { actuator.delete_nodes(GROUP, &[node("c")]).await });
    fixture.asked(LIST_MACHINES).await;

    within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap();
    assert!(
        !ours.is_finished(),
        "the raise was answered while the removal still waits"
    );
    assert_eq!(fixture.replicas(), 4);

    let error = within(ours).await.unwrap().unwrap_err();
    assert!(
        matches!(&error, ActuatorError::Refused(m) if m.contains("other Machines")),
        "{error:?}"
    );
    assert_eq!(fixture.mark("c"), None, "nothing of the removal written");
    assert_eq!(fixture.replicas(), 4, "only the raise written");
}

/// CA asks again for a node whose removal is still under way (its deadline passed, or its next
/// loop came): the call is answered by that removal, which runs once and answers both with its
/// settlement: no request follows it.
#[tokio::test]
async fn delete_nodes_asked_again_while_its_removal_runs_is_answered_by_that_removal() {
    let fixture = Fixture::new(&three_running(3, &[]));
    // Someone else's mark, their decrement to come: the removal of c waits meanwhile.
    fixture.marked_by_someone_else("a");
    let api = Arc::clone(&fixture.api);
    let decrement = tokio::spawn(async move {
        while !lock(&api).seen.iter().any(|s| s.summary() == LIST_MACHINES) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut api = lock(&api);
        let version = api.next_version();
        if let Some(md) = api.objects.get_mut(MD) {
            md["spec"]["replicas"] = json!(2);
            md["metadata"]["resourceVersion"] = json!(version);
        }
    });

    let c = [node("c")];
    let (first, again) = within(async {
        tokio::join!(
            fixture.actuator.delete_nodes(GROUP, &c),
            fixture.actuator.delete_nodes(GROUP, &c),
        )
    })
    .await;
    decrement.await.unwrap();

    assert_eq!((first, again), (Ok(()), Ok(())));
    assert_eq!(fixture.replicas(), 1, "one decrement of ours, once");
    let requests = fixture.requests();
    let settled = requests
        .iter()
        .rposition(|r| r == PATCH_MD)
        .expect("the settlement");
    assert!(
        requests[settled + 1..].is_empty(),
        "no second removal ran: {requests:?}"
    );
}

/// A removal whose time to mark ran out (the API answered its claim too slowly: here, no time at
/// all) writes no mark: past it, a repair of another provider may take its claim back, and a mark
/// written then could be deleted for another removal's decrement with nothing recording it. Its
/// claim is taken back through the record, nothing else written, the call answered UNAVAILABLE.
#[tokio::test]
async fn a_removal_out_of_time_to_mark_takes_its_claim_back_without_marking() {
    let fixture = Fixture::new(&three_running(3, &[])).waiting(Duration::ZERO);

    let error = within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap_err();

    assert!(
        matches!(&error, ActuatorError::Api { message, .. } if message.contains("too slowly")),
        "{error:?}"
    );
    assert_eq!(fixture.mark("c"), None, "no mark written");
    assert!(
        fixture.patches("machines/c").is_empty(),
        "{:?}",
        fixture.requests()
    );
    assert_eq!(fixture.replicas(), 3, "no decrement");
    assert_eq!(
        fixture.records(CLAIMS_ANNOTATION).unwrap_or_default(),
        "",
        "claim taken back"
    );
    assert!(
        fixture
            .records(TAKING_BACK_ANNOTATION)
            .is_some_and(|t| t.starts_with("c@")),
        "the claim recorded as being taken back: {:?}",
        fixture.records(TAKING_BACK_ANNOTATION)
    );
}

/// Finding 5: a rollout that began after the snapshot CA's call was checked against is seen by
/// the removal's own fresh read: refused, nothing written.
#[tokio::test]
async fn finding_5_a_rollout_begun_since_the_snapshot_refuses_the_removal_from_its_fresh_read() {
    let mut objects = three_running(3, &[]);
    let mut old = machine_set(1);
    old["metadata"]["name"] = json!("md-0");
    old["metadata"]["annotations"]["machinedeployment.clusters.x-k8s.io/revision"] = json!("0");
    let fixture = Fixture::new(&objects);
    lock(&fixture.api)
        .objects
        .insert("machinesets/md-0".into(), old);
    objects.clear();

    let error = within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap_err();

    assert!(
        matches!(&error, ActuatorError::Refused(m) if m.contains("rolling out")),
        "{error:?}"
    );
    assert_eq!(fixture.landed(MD), 0);
    assert_eq!(fixture.mark("c"), None);
}

/// Finding 5: a pending Machine CA names by its made-up id that got its Node before the removal
/// marked it is not removed (CA never drained it).
#[tokio::test]
async fn finding_5_a_pending_machine_that_got_its_node_is_not_removed() {
    let objects = vec![
        deployment(3, &[]),
        machine_set(3),
        machine("a", true, None),
        machine("b", true, None),
        machine("p", false, None),
    ];
    let fixture = Fixture::new(&objects);
    fixture.meanwhile("machines/p", |m| {
        m["spec"]["providerID"] = json!("e2e:///ns/p");
        m["status"] = json!({"nodeRef": {"name": "p"}});
    });
    let pending = NodeToDelete {
        provider_id: format!("{}ns-p", crate::snapshot::PENDING_PREFIX),
        name: format!("{}ns-p", crate::snapshot::PENDING_PREFIX),
        ..NodeToDelete::default()
    };
    let nodes = [pending];
    let error = within(fixture.actuator.delete_nodes(GROUP, &nodes)).await;
    if let Err(e) = &error {
        assert!(
            matches!(e, ActuatorError::Refused(_) | ActuatorError::NotFound(_)),
            "{e:?}"
        );
    }
    assert_eq!(
        fixture.replicas(),
        3,
        "nothing lowered for a Machine that has a Node now"
    );
    assert_eq!(fixture.mark("p"), None);
}

/// Finding 7: a group whose replicas the Cluster's topology sets is not served, so no write can
/// reach it (the topology controller would revert every decrement and keep the marked node).
#[tokio::test]
async fn finding_7_a_group_whose_topology_sets_replicas_is_never_written() {
    let mut objects = three_running(3, &[]);
    objects[0]["metadata"]["labels"] = json!({
        "topology.cluster.x-k8s.io/owned": "",
        "topology.cluster.x-k8s.io/deployment-name": "md-0",
    });
    let fixture = Fixture::new(&objects);
    let cluster = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
        "metadata": {"namespace": NS, "name": "c1", "resourceVersion": "1"},
        "spec": {"topology": {"workers": {"machineDeployments": [{"name": "md-0", "replicas": 3}]}}},
    });
    fixture
        .actuator
        .store
        .record_cluster(serde_json::from_value(cluster).expect("an object"));
    fixture.actuator.store.refresh();

    let error = within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap_err();

    assert!(
        matches!(error, ActuatorError::GroupNotFound { .. }),
        "{error:?}"
    );
    assert!(fixture.wrote_nothing());
}

// ===== DecreaseTargetSize =====

#[tokio::test]
async fn decrease_target_size_cancels_capacity_without_a_machine_once_cluster_api_has_acted() {
    let mut objects = three_running(4, &[]);
    // Cluster API has acted on 4 and holds the fourth Machine back (a preflight check).
    objects[1]["status"]["conditions"] = json!([{
        "type": "ScalingUp", "status": "True", "reason": "PreflightCheckFailed",
        "message": "Scaling up from 3 to 4 replicas is blocked because:\n* ControlPlaneIsStable (\"ControlPlaneIsStable\" preflight check failed)",
    }]);
    let fixture = Fixture::new(&objects);

    within(fixture.actuator.decrease_target_size(GROUP, -1))
        .await
        .unwrap();

    assert_eq!(fixture.replicas(), 3);
    assert_eq!(
        (fixture.mark("a"), fixture.mark("b"), fixture.mark("c")),
        (None, None, None)
    );
}

#[tokio::test]
async fn decrease_target_size_waits_for_cluster_api_to_observe_the_last_change() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.meanwhile(MD, |md| {
        md["spec"]["replicas"] = json!(4);
        md["metadata"]["generation"] = json!(2);
    });

    let error = within(fixture.actuator.decrease_target_size(GROUP, -1))
        .await
        .unwrap_err();

    assert!(
        matches!(&error, ActuatorError::Refused(m) if m.contains("has not yet acted")),
        "{error:?}"
    );
    assert_eq!(fixture.replicas(), 4, "nothing written");
}

/// A Machine being deleted still counts toward its MachineSet's replicas, and once it is gone
/// Cluster API creates its replacement: a decrement then races the replacement (seen with the real
/// manager: a replacement got its providerID 0.1 s after the MachineSet deleted it, unmarked, for
/// such a decrement; registered a moment sooner, a registered Machine would have gone). So the
/// cancellation waits for the replacement, to pin it, and out of time refuses without a write.
#[tokio::test]
async fn decrease_target_size_does_not_race_the_replacement_of_a_machine_being_deleted() {
    let mut going = machine("c", true, None);
    going["metadata"]["deletionTimestamp"] = json!("2026-11-29T00:00:00Z");
    let objects = vec![
        deployment(3, &[]),
        machine_set(3),
        machine("a", true, None),
        machine("b", true, None),
        going,
    ];
    let fixture = Fixture::new(&objects);

    let error = within(fixture.actuator.decrease_target_size(GROUP, -1))
        .await
        .unwrap_err();

    assert!(
        matches!(&error, ActuatorError::Refused(m) if m.contains("replacements of Machines being deleted")),
        "{error:?}"
    );
    assert!(fixture.wrote_nothing());
    assert_eq!(fixture.replicas(), 3);
}

#[tokio::test]
async fn decrease_target_size_pins_a_pending_machine_and_settles_it() {
    let objects = vec![
        deployment(3, &[]),
        machine_set(3),
        machine("a", true, None),
        machine("b", true, None),
        machine("p", false, None),
    ];
    let fixture = Fixture::new(&objects);

    within(fixture.actuator.decrease_target_size(GROUP, -1))
        .await
        .unwrap();

    assert_eq!(fixture.replicas(), 2);
    assert!(
        fixture.mark("p").is_some(),
        "pinned: it goes even if it registers meanwhile"
    );
    assert_eq!(fixture.capi_acts(), ["p"]);
}

#[tokio::test]
async fn decrease_target_size_that_would_remove_a_registered_node_is_refused_without_a_write() {
    let fixture = Fixture::new(&three_running(3, &[]));
    let error = within(fixture.actuator.decrease_target_size(GROUP, -1))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, ActuatorError::Refused(m) if m.contains("attempt to delete existing nodes")),
        "{error:?}"
    );
    assert!(fixture.wrote_nothing());
}

/// Finding 6: a MachinePool with MachinePool Machines pins its pending Machine like a
/// MachineDeployment, instead of a bare decrement the infrastructure may take a registered node
/// for.
#[tokio::test]
async fn finding_6_decrease_target_size_pins_a_pending_machine_pool_machine() {
    let mut pool = machine_pool(3, &["a", "b"]);
    pool["status"]["observedGeneration"] = json!(1);
    let pool_machine = |name: &str, registered: bool| {
        let mut m = machine(name, registered, None);
        m["metadata"]["ownerReferences"] = json!([{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachinePool", "name": "mp", "uid": "uid-mp"}]);
        m
    };
    let fixture = Fixture::new(&[
        pool,
        pool_machine("a", true),
        pool_machine("b", true),
        pool_machine("p", false),
    ]);

    within(
        fixture
            .actuator
            .decrease_target_size("MachinePool/ns/mp", -1),
    )
    .await
    .unwrap();

    assert!(
        fixture.mark("p").is_some(),
        "the pending MachinePool Machine is pinned"
    );
    assert_eq!(fixture.mark("a"), None);
    assert_eq!(
        fixture.object("machinepools/mp")["spec"]["replicas"],
        json!(2)
    );
}

/// A MachinePool whose infrastructure makes no Machines: nothing can be pinned, the infrastructure
/// picks which instance a decrement removes. Capacity never listed is cancelled; a removal is one
/// decrement; once the infrastructure removed another instance instead, CA's retry of the node is
/// answered OK and writes nothing (its removal was paid).
#[tokio::test]
async fn a_machine_pool_without_machines_cancels_removes_and_answers_a_retry_without_a_write() {
    let fixture = Fixture::new(&[machine_pool(3, &["a", "b"])]);
    const POOL: &str = "MachinePool/ns/mp";
    const PATH: &str = "machinepools/mp";
    let replicas = || fixture.object(PATH)["spec"]["replicas"].clone();

    within(fixture.actuator.decrease_target_size(POOL, -1))
        .await
        .unwrap();
    assert_eq!(
        replicas(),
        json!(2),
        "the instance never listed is cancelled"
    );

    within(fixture.actuator.delete_nodes(POOL, &[node("a")]))
        .await
        .unwrap();
    assert_eq!(replicas(), json!(1));
    // The infrastructure removes b, not a.
    fixture.meanwhile(PATH, |pool| {
        pool["spec"]["providerIDList"] = json!(["e2e:///ns/a"]);
    });
    let writes = fixture.patches(PATH).len();
    within(fixture.actuator.delete_nodes(POOL, &[node("a")]))
        .await
        .unwrap();
    assert_eq!(replicas(), json!(1), "the retry does not lower again");
    assert_eq!(fixture.patches(PATH).len(), writes, "nor writes anything");
}

/// A read the API does not answer changes nothing: it is read again (on a new connection) while
/// the operation has time, and the operation completes.
#[tokio::test]
async fn a_read_lost_on_the_way_is_read_again_and_the_operation_completes() {
    let fixture = Fixture::new(&three_running(2, &[]));
    fixture.fault(Method::GET, MD, Fault::LoseRequest);

    within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap();

    assert_eq!(fixture.replicas(), 3);
    assert_eq!(fixture.landed(MD), 1, "written once");
}

/// A group's fresh read lists its MachineSets and Machines by the label Cluster API gives them
/// (the namespace may hold thousands of others), and a Machine of another group that the listing
/// does not return stays in the cache.
#[tokio::test]
async fn a_groups_fresh_read_lists_only_what_carries_its_label_and_keeps_the_others_cached() {
    let keys = keys();
    let own = |mut object: Value| {
        object["metadata"]["labels"] = json!({keys.deployment_name_label.as_str(): "md"});
        object
    };
    let mut other = machine("x", true, None);
    other["metadata"]["labels"] = json!({keys.deployment_name_label.as_str(): "other"});
    other["metadata"]["ownerReferences"][0]["name"] = json!("other-1");
    let objects = vec![
        deployment(2, &[]),
        own(machine_set(2)),
        own(machine("a", true, None)),
        own(machine("b", true, None)),
        other,
    ];
    let fixture = Fixture::new(&objects);

    within(fixture.actuator.delete_nodes(GROUP, &[node("a")]))
        .await
        .unwrap();

    let selector = format!("{}=md", keys.deployment_name_label);
    let lists: Vec<String> = fixture
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("LIST"))
        .collect();
    assert!(
        lists.contains(&format!("{LIST_SETS} labelled {selector}"))
            && lists.contains(&format!("{LIST_MACHINES} labelled {selector}"))
            && lists.iter().all(|r| r.ends_with(&selector)),
        "{lists:?}"
    );
    assert_eq!(fixture.replicas(), 1);
    assert!(
        fixture
            .actuator
            .store
            .cached_machine(&crate::capi::ObjectKey::new(NS, "x"))
            .is_some(),
        "another group's Machine is not gone for being outside the selection"
    );
}

/// A member the cache holds without the group's label (made by someone other than Cluster API):
/// the namespace's Machines are listed, so the read still sees every member.
#[tokio::test]
async fn a_member_without_the_groups_label_makes_the_fresh_read_list_the_namespace() {
    let keys = keys();
    let mut a = machine("a", true, None);
    a["metadata"]["labels"] = json!({keys.deployment_name_label.as_str(): "md"});
    let objects = vec![
        deployment(2, &[]),
        machine_set(2),
        a,
        machine("b", true, None),
    ];
    let fixture = Fixture::new(&objects);

    within(fixture.actuator.delete_nodes(GROUP, &[node("a")]))
        .await
        .unwrap();

    let requests = fixture.requests();
    assert!(
        requests.iter().any(|r| r == LIST_MACHINES) && requests.iter().any(|r| r == LIST_SETS),
        "{requests:?}"
    );
    assert_eq!(fixture.replicas(), 1);
}

// ===== the repair =====

/// 2026-01-01T00:00:00Z: the API server's clock in the tests that set it, months behind this
/// machine's.
const NEW_YEAR: u64 = 1_767_225_600;

/// A crashed removal: claimed and marked, never settled. A repair leaves it alone while it is
/// younger than the grace period on the API server's clock (it may be in flight on another
/// provider), without asking the API, whatever this machine's clock says; once the server's clock
/// is past it, the first round takes it back (no waiting from first sight: a provider that just
/// started ages it as one that saw it written), recording it first, then unmarking.
#[tokio::test]
async fn repair_takes_back_a_stopped_removal_once_the_api_servers_clock_is_past_its_grace_recording_it_first()
 {
    let stamp = NEW_YEAR - 10;
    let objects = vec![
        deployment(3, &[(CLAIMS_ANNOTATION, mark_entry("c", stamp))]),
        machine_set(3),
        machine("a", true, None),
        machine("b", true, None),
        machine("c", true, Some(our_mark(stamp))),
    ];
    let fixture = Fixture::new(&objects);
    fixture.server_time(NEW_YEAR);
    let grace = Duration::from_secs(3600);

    assert_eq!(within(fixture.actuator.repair(grace)).await, 0);
    assert!(
        fixture.requests().is_empty(),
        "decided from the cache: no API call"
    );
    assert!(fixture.mark("c").is_some());

    fixture.server_time(stamp + 3600);
    within(fixture.actuator.repair(grace)).await;
    assert_eq!(fixture.mark("c"), None);
    let md = fixture.patches(MD);
    assert_eq!(
        md[0]["metadata"]["annotations"][TAKING_BACK_ANNOTATION],
        json!(mark_entry("c", stamp))
    );
    assert!(md[0]["metadata"]["annotations"][CLAIMS_ANNOTATION].is_null());
    assert_eq!(fixture.replicas(), 3);
}

/// The repair looks only at groups with records or a marked member: a mark of ours with no record
/// left on its group (a stale claim dropped under a mark still on its way) is one of them, and
/// once ripe it is taken back through the record like any other.
#[tokio::test]
async fn repair_takes_back_a_ripe_mark_of_ours_that_no_record_names() {
    let stamp = NEW_YEAR - 10;
    let objects = vec![
        deployment(3, &[]),
        machine_set(3),
        machine("a", true, None),
        machine("b", true, None),
        machine("c", true, Some(our_mark(stamp))),
    ];
    let fixture = Fixture::new(&objects);
    fixture.server_time(stamp + 3600);

    within(fixture.actuator.repair(Duration::from_secs(3600))).await;

    assert_eq!(fixture.mark("c"), None);
    let md = fixture.patches(MD);
    assert_eq!(
        md[0]["metadata"]["annotations"][TAKING_BACK_ANNOTATION],
        json!(mark_entry("c", stamp)),
        "recorded before the unmark"
    );
    assert_eq!(fixture.replicas(), 3);
}

/// A removal's records carry its start on the API server's clock (rounded up: a `Date` is cut
/// down to the second), not this machine's.
#[tokio::test]
async fn a_removal_stamps_its_records_with_the_api_servers_time() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.server_time(NEW_YEAR);

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    let mark = fixture.mark("c").expect("c is marked");
    let stamp = our_mark_stamp(&mark).expect("our mark");
    assert!(
        (NEW_YEAR + 1..=NEW_YEAR + 3).contains(&stamp),
        "stamp {stamp}, the server's clock {NEW_YEAR}"
    );
    assert_eq!(
        fixture.records(LEDGER_ANNOTATION).as_deref(),
        Some(mark_entry("c", stamp).as_str())
    );
}

/// Finding 4 (clocks): an absorbed mark (settled, then a raise) is taken back once Cluster API
/// has observed the raise, not after a time computed from anyone's clock: the mark's stamp may be
/// far in the future or the past, it changes nothing.
#[tokio::test]
async fn finding_4_an_absorbed_mark_is_taken_back_once_cluster_api_observed_the_raise_whatever_its_stamp()
 {
    for stamp in [1, u64::from(u32::MAX) * 4] {
        let objects = vec![
            deployment(3, &[(LEDGER_ANNOTATION, mark_entry("c", stamp))]),
            machine_set(3),
            machine("a", true, None),
            machine("b", true, None),
            machine("c", true, Some(our_mark(stamp))),
        ];
        let fixture = Fixture::new(&objects);
        fixture.meanwhile(MD, |md| md["metadata"]["generation"] = json!(2));
        fixture.actuator.store.record(
            Some(ScalableKind::MachineDeployment),
            serde_json::from_value(fixture.object(MD)).expect("an object"),
        );
        within(fixture.actuator.repair(Duration::ZERO)).await;
        assert!(
            fixture.mark("c").is_some(),
            "stamp {stamp}: Cluster API has not observed the raise"
        );

        fixture.capi_acts();
        // The watch delivers the observed generation.
        fixture.actuator.store.record(
            Some(ScalableKind::MachineDeployment),
            serde_json::from_value(fixture.object(MD)).expect("an object"),
        );
        within(fixture.actuator.repair(Duration::ZERO)).await;
        assert_eq!(
            fixture.mark("c"),
            None,
            "stamp {stamp}: observed, taken back"
        );
    }
}

/// A removal that stopped after Cluster API took its Machine for another removal's decrement
/// (c went for b's): the repair settles it, so b goes too.
#[tokio::test]
async fn repair_settles_a_claimed_removal_whose_machine_cluster_api_already_took() {
    let objects = vec![
        deployment(
            2,
            &[
                (CLAIMS_ANNOTATION, mark_entry("c", 7)),
                (LEDGER_ANNOTATION, mark_entry("b", 5)),
            ],
        ),
        machine_set(2),
        machine("a", true, None),
        machine("b", true, Some(our_mark(5))),
    ];
    let fixture = Fixture::new(&objects);
    within(fixture.actuator.repair(Duration::from_secs(3600))).await;
    assert_eq!(
        fixture.replicas(),
        1,
        "c's removal settled with its decrement"
    );
    assert_eq!(fixture.capi_acts(), ["b"]);
    assert!(fixture.records(CLAIMS_ANNOTATION).is_none());
}
