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
//! test changes the fake "meanwhile" (another writer the watch has not delivered yet).

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
use crate::capi::{DEFAULT_GROUP, Keys, Machine, ScalableKind, ScalableResource};
use crate::lock;
use crate::metrics::Metrics;
use crate::removal::{
    LEDGER_ANNOTATION, RAISED_ANNOTATION, TAKING_BACK_ANNOTATION, mark_entry, our_mark,
    our_mark_time, pool_node_entry,
};
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

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// MachineDeployment md (min 1, max 5) with `replicas` and extra annotations.
fn deployment(replicas: i32, annotations: &[(&str, String)]) -> Value {
    let keys = keys();
    let mut object = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "MachineDeployment",
        "metadata": {
            "namespace": NS, "name": "md", "uid": "uid-md", "resourceVersion": "1",
            "annotations": {keys.min_size.as_str(): "1", keys.max_size.as_str(): "5"},
        },
        "spec": {"clusterName": "c1", "replicas": replicas, "template": {"spec": {"clusterName": "c1"}}},
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
            "namespace": NS, "name": "md-1", "uid": "uid-md-1", "resourceVersion": "1",
            "annotations": {"machinedeployment.clusters.x-k8s.io/revision": "1"},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment", "name": "md", "uid": "uid-md"}],
        },
        "spec": {"clusterName": "c1", "replicas": replicas},
        "status": {"replicas": replicas},
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
            "namespace": NS, "name": "mp", "uid": "uid-mp", "resourceVersion": "1",
            "annotations": {keys.min_size.as_str(): "0", keys.max_size.as_str(): "5"},
        },
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
#[derive(Clone, Copy, Debug)]
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
    /// Another writer changes the object just before the request is served (a new
    /// resourceVersion, an annotation of its own), so a request guarded by the version before
    /// conflicts.
    OtherWriterFirst,
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

/// What the fake was asked: `method` `path` (under [`API_PREFIX`]), with its query and body.
#[derive(Clone, Debug)]
struct Seen {
    method: Method,
    path: String,
    query: String,
    body: Option<Value>,
}

impl Seen {
    /// `PATCH_C`, `LIST_MACHINES`.
    fn summary(&self) -> String {
        let verb = if self.method == Method::GET && !self.path.contains('/') {
            "LIST"
        } else {
            self.method.as_str()
        };
        format!("{verb} {}", self.path)
    }
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
}

/// What the serving task does with a request.
enum Answer {
    Respond(StatusCode, Value),
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

    /// Serves a request as the API server would.
    fn apply(&mut self, request: &Seen, content_type: Option<String>) -> (StatusCode, Value) {
        let path = request.path.as_str();
        match request.method {
            Method::GET if !path.contains('/') => {
                let prefix = format!("{path}/");
                let items: Vec<Value> = self
                    .objects
                    .iter()
                    .filter(|(p, _)| p.starts_with(&prefix))
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
                merge(object, &patch);
                object["metadata"]["resourceVersion"] = json!(version);
                (StatusCode::OK, object.clone())
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
            query: parts.uri.query().unwrap_or_default().to_string(),
            body: serde_json::from_slice(&bytes).ok(),
        };
        let content_type = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let answer = lock(&api).answer(seen, content_type);
        match answer {
            Answer::Respond(code, body) => {
                let response = Response::builder()
                    .status(code)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Body::from(serde_json::to_vec(&body).unwrap_or_default()))
                    .expect("a response of a status and a JSON body");
                respond.send_response(response);
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

    /// The bodies of the PATCH requests to `path`, in order.
    fn patches(&self, path: &str) -> Vec<Value> {
        self.seen()
            .into_iter()
            .filter(|s| s.method == Method::PATCH && s.path == path)
            .map(|s| s.body.unwrap_or_default())
            .collect()
    }
}

/// `operation`, failing the test if it does not finish within [`PATIENCE`].
async fn within<T>(operation: impl Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, operation)
        .await
        .expect("the operation did not finish: the mock API was not asked what the test expects")
}

/// The value of a raise annotation the write carries, checked to be a time of this test.
fn raised_in(patch: &Value, from: u64) -> u64 {
    let raised = patch["metadata"]["annotations"][RAISED_ANNOTATION]
        .as_str()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no raise time in {patch}"));
    assert!(
        (from..=now_unix() + 1).contains(&raised),
        "raise time {raised} is not of this test"
    );
    raised
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

/// The repair's grace period in these tests (the default `--mark-grace-period`).
const GRACE: Duration = Duration::from_secs(30);

/// md at `replicas` with `ledger`, Machines a, b and c, c carrying our mark of `mark_age` ago.
fn marked_c(replicas: i32, ledger: bool, mark_age: u64) -> (Vec<Value>, u64) {
    let time = now_unix() - mark_age;
    let annotations: Vec<(&str, String)> = if ledger {
        vec![(LEDGER_ANNOTATION, mark_entry("c", time))]
    } else {
        Vec::new()
    };
    let objects = vec![
        deployment(replicas, &annotations),
        machine_set(replicas),
        machine("a", true, None),
        machine("b", true, None),
        machine("c", true, Some(our_mark(time))),
    ];
    (objects, time)
}

const MD: &str = "machinedeployments/md";
/// The requests as [`Fixture::requests`] lists them.
const GET_MD: &str = "GET machinedeployments/md";
const PATCH_MD: &str = "PATCH machinedeployments/md";
const LIST_MACHINES: &str = "LIST machines";
const PATCH_C: &str = "PATCH machines/c";

// ===== IncreaseSize =====

#[tokio::test]
async fn increase_size_patches_replicas_guarded_by_the_cached_resource_version() {
    let fixture = Fixture::new(&three_running(3, &[]));
    let from = now_unix();

    within(fixture.actuator.increase_size(GROUP, 2))
        .await
        .unwrap();

    assert_eq!(fixture.requests(), [PATCH_MD]);
    let seen = &fixture.seen()[0];
    assert!(
        seen.query.contains("fieldManager=capi-autoscaler-provider"),
        "{}",
        seen.query
    );
    let patch = fixture.patches(MD).remove(0);
    let raised = raised_in(&patch, from);
    assert_eq!(
        patch,
        json!({
            "metadata": {"resourceVersion": "1", "annotations": {RAISED_ANNOTATION: raised.to_string()}},
            "spec": {"replicas": 5},
        })
    );
    assert_eq!(fixture.replicas(), 5);
}

#[tokio::test]
async fn increase_size_after_a_conflict_rereads_and_lands_once_over_the_other_writers_replicas() {
    let fixture = Fixture::new(&three_running(3, &[]));
    // Someone raised md to 4 since the cache read it at version 1.
    fixture.meanwhile(MD, |md| md["spec"]["replicas"] = json!(4));

    within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap();

    assert_eq!(fixture.requests(), [PATCH_MD, GET_MD, PATCH_MD]);
    let guarded: Vec<(Value, Value)> = fixture
        .patches(MD)
        .iter()
        .map(|p| (p["metadata"]["resourceVersion"].clone(), p["spec"].clone()))
        .collect();
    assert_eq!(
        guarded,
        [
            (json!("1"), json!({"replicas": 4})),
            (json!("2"), json!({"replicas": 5}))
        ]
    );
    // The other writer's raise and ours, each once.
    assert_eq!(fixture.replicas(), 5);
}

#[tokio::test]
async fn increase_size_whose_answer_is_lost_after_it_landed_is_read_back_and_not_applied_twice() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.fault(Method::PATCH, MD, Fault::LoseAnswer);

    within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap();

    assert_eq!(fixture.requests(), [PATCH_MD, GET_MD]);
    assert_eq!(fixture.replicas(), 4);
}

#[tokio::test(start_paused = true)]
async fn increase_size_never_answered_times_out_reads_back_and_is_not_applied_twice() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.fault(Method::PATCH, MD, Fault::Hang);
    let started = tokio::time::Instant::now();

    within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap();

    // Given up on after the call timeout (4 s, below CA's 5 s gRPC deadline), then looked up.
    assert!(started.elapsed() >= Duration::from_secs(4));
    assert_eq!(fixture.requests(), [PATCH_MD, GET_MD]);
    assert_eq!(fixture.replicas(), 4);
}

#[tokio::test]
async fn increase_size_lost_before_it_landed_is_read_back_and_written_once_more() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.fault(Method::PATCH, MD, Fault::LoseRequest);

    within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap();

    assert_eq!(
        fixture.requests(),
        [
            PATCH_MD, // Looked up: not applied.
            GET_MD,   // The next attempt, from a fresh read.
            GET_MD, PATCH_MD,
        ]
    );
    assert_eq!(fixture.replicas(), 4);
}

#[tokio::test]
async fn increase_size_that_lands_after_it_was_read_back_as_lost_is_taken_as_the_write() {
    let fixture = Fixture::new(&three_running(3, &[]));
    // Dropped, read back as not applied, then delivered before the retry's read.
    fixture.fault(Method::PATCH, MD, Fault::ArriveLate);

    within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap();

    assert_eq!(fixture.requests(), [PATCH_MD, GET_MD, GET_MD,]);
    assert_eq!(fixture.replicas(), 4, "the raise was applied twice");
}

#[tokio::test]
async fn increase_size_refusals_come_back_as_their_error_with_nothing_written() {
    for code in [403, 422, 400] {
        let fixture = Fixture::new(&three_running(3, &[]));
        let before = fixture.object(MD);
        fixture.fault(Method::PATCH, MD, Fault::Refuse(code));

        let error = within(fixture.actuator.increase_size(GROUP, 1))
            .await
            .unwrap_err();

        match (code, &error) {
            (
                403,
                ActuatorError::Api {
                    cause: ApiCause::Forbidden,
                    message,
                },
            ) => assert!(message.contains("forbidden"), "{message}"),
            (422 | 400, ActuatorError::Refused(message)) => {
                assert!(message.contains("rejected"), "{message}")
            }
            _ => panic!("{code} answered as {error:?}"),
        }
        // Not retried, not looked up: a refusal is final.
        assert_eq!(fixture.requests(), [PATCH_MD], "{code}");
        assert_eq!(fixture.object(MD), before, "{code}");
    }
}

#[tokio::test(start_paused = true)]
async fn increase_size_whose_outcome_cannot_be_read_back_is_unavailable_and_says_so() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.fault(Method::PATCH, MD, Fault::LoseRequest);
    for nth in 0..3 {
        fixture.fault_at(Method::GET, MD, nth, Fault::Refuse(503));
    }

    let error = within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap_err();

    match &error {
        ActuatorError::Api {
            cause: ApiCause::Unreachable,
            message,
        } => assert!(
            message.contains("whether the write landed is unknown"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    // Looked up three times, never written again blind.
    assert_eq!(fixture.requests(), [PATCH_MD, GET_MD, GET_MD, GET_MD]);
    assert_eq!(fixture.replicas(), 3);
}

#[tokio::test]
async fn increase_size_still_conflicting_after_eight_attempts_gives_up_with_a_conflict() {
    let fixture = Fixture::new(&three_running(3, &[]));
    for nth in 0..8 {
        fixture.fault_at(Method::PATCH, MD, nth, Fault::Refuse(409));
    }

    let error = within(fixture.actuator.increase_size(GROUP, 1))
        .await
        .unwrap_err();

    assert!(matches!(error, ActuatorError::Conflict(_)), "{error:?}");
    let mut expected = vec![PATCH_MD];
    for _ in 1..8 {
        expected.extend([GET_MD, PATCH_MD]);
    }
    assert_eq!(fixture.requests(), expected);
    assert_eq!(fixture.replicas(), 3);
}

// ===== DeleteNodes =====

#[tokio::test]
async fn delete_nodes_marks_the_machine_then_lowers_replicas_paying_that_mark_in_the_ledger() {
    let fixture = Fixture::new(&three_running(3, &[]));
    let from = now_unix();

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    assert_eq!(
        fixture.requests(),
        [
            // Decided from the group and its Machines as the API has them.
            GET_MD,
            LIST_MACHINES,
            PATCH_C,
            PATCH_MD,
        ]
    );
    let mark = fixture.mark("c").expect("c is marked");
    let time = our_mark_time(&mark).expect("our mark");
    assert!((from..=now_unix()).contains(&time), "{mark}");
    assert_eq!(
        fixture.patches("machines/c"),
        [json!({"metadata": {
            "resourceVersion": "1",
            "annotations": {keys().delete_machine: our_mark(time)},
        }})]
    );
    assert_eq!(
        fixture.patches(MD),
        [json!({
            "metadata": {"resourceVersion": "1", "annotations": {LEDGER_ANNOTATION: mark_entry("c", time)}},
            "spec": {"replicas": 2},
        })]
    );
    assert_eq!(fixture.replicas(), 2);
    assert_eq!(fixture.mark("a"), None);
    assert_eq!(fixture.mark("b"), None);
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

    assert_eq!(fixture.requests()[after_first..], [GET_MD, LIST_MACHINES]);
    assert_eq!(fixture.replicas(), 2);
}

#[tokio::test]
async fn delete_nodes_whose_replicas_write_is_refused_takes_its_mark_back() {
    for code in [422, 403] {
        let fixture = Fixture::new(&three_running(3, &[]));
        fixture.fault(Method::PATCH, MD, Fault::Refuse(code));

        let error = within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
            .await
            .unwrap_err();

        match (code, &error) {
            (422, ActuatorError::Refused(_))
            | (
                403,
                ActuatorError::Api {
                    cause: ApiCause::Forbidden,
                    ..
                },
            ) => {}
            _ => panic!("{code} answered as {error:?}"),
        }
        assert_eq!(
            fixture.requests(),
            [GET_MD, LIST_MACHINES, PATCH_C, PATCH_MD, PATCH_C,],
            "{code}"
        );
        // The unmark restores what c carried before (nothing), unguarded: the mark is ours.
        assert_eq!(
            fixture.patches("machines/c")[1],
            json!({"metadata": {"annotations": {keys().delete_machine: null}}}),
            "{code}"
        );
        assert_eq!(fixture.mark("c"), None, "{code}");
        assert_eq!(fixture.replicas(), 3, "{code}");
        assert_eq!(fixture.annotation(MD, LEDGER_ANNOTATION), None, "{code}");
    }
}

#[tokio::test]
async fn delete_nodes_whose_decrement_answer_is_lost_after_it_landed_keeps_the_mark_and_lowers_once()
 {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.fault(Method::PATCH, MD, Fault::LoseAnswer);

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    assert_eq!(
        fixture.requests(),
        [
            GET_MD,
            LIST_MACHINES,
            PATCH_C,
            PATCH_MD,
            // Looked up: the ledger entry is there, so it landed.
            GET_MD,
        ]
    );
    let time = fixture.mark("c").as_deref().and_then(our_mark_time);
    assert!(time.is_some(), "the mark was taken back");
    assert_eq!(fixture.replicas(), 2);
    assert_eq!(
        fixture.annotation(MD, LEDGER_ANNOTATION),
        time.map(|t| mark_entry("c", t))
    );
}

#[tokio::test]
async fn delete_nodes_whose_mark_answer_is_lost_leaves_the_mark_for_a_retry_to_pay_once() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.fault(Method::PATCH, "machines/c", Fault::LoseAnswer);

    let error = within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap_err();

    assert!(
        matches!(
            error,
            ActuatorError::Api {
                cause: ApiCause::Unreachable,
                ..
            }
        ),
        "{error:?}"
    );
    // Replicas untouched; the mark landed unseen and stays (owed a decrement).
    assert_eq!(fixture.requests(), [GET_MD, LIST_MACHINES, PATCH_C]);
    assert_eq!(fixture.replicas(), 3);
    let time = fixture
        .mark("c")
        .as_deref()
        .and_then(our_mark_time)
        .expect("the mark landed");

    // CA asks again: the mark is found and paid, not written again.
    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    assert_eq!(fixture.requests()[3..], [GET_MD, LIST_MACHINES, PATCH_MD]);
    assert_eq!(fixture.replicas(), 2);
    assert_eq!(
        fixture.annotation(MD, LEDGER_ANNOTATION),
        Some(mark_entry("c", time))
    );
}

#[tokio::test]
async fn delete_nodes_after_a_conflict_rereads_the_group_and_its_machines_and_lowers_once() {
    let fixture = Fixture::new(&three_running(3, &[]));
    // Another writer changes md between the mark and the decrement.
    fixture.fault(Method::PATCH, MD, Fault::OtherWriterFirst);

    within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap();

    assert_eq!(
        fixture.requests(),
        [
            GET_MD,
            LIST_MACHINES,
            PATCH_C,
            PATCH_MD,
            // Conflict: decided again from the group and its Machines as they are now.
            GET_MD,
            LIST_MACHINES,
            PATCH_MD,
        ]
    );
    let time = fixture
        .mark("c")
        .as_deref()
        .and_then(our_mark_time)
        .expect("c is marked");
    let guards: Vec<Value> = fixture
        .patches(MD)
        .iter()
        .map(|p| p["metadata"]["resourceVersion"].clone())
        .collect();
    assert_eq!(guards, [json!("1"), json!("3")]);
    assert_eq!(fixture.replicas(), 2);
    assert_eq!(
        fixture.annotation(MD, LEDGER_ANNOTATION),
        Some(mark_entry("c", time))
    );
    assert!(fixture.annotation(MD, OTHER_WRITER).is_some());
}

#[tokio::test]
async fn delete_nodes_whose_take_back_is_lost_leaves_the_mark_to_the_repair() {
    let fixture = Fixture::new(&three_running(3, &[]));
    fixture.fault(Method::PATCH, MD, Fault::Refuse(422));
    // The second PATCH of c, the unmark, never arrives.
    fixture.fault_at(Method::PATCH, "machines/c", 1, Fault::LoseRequest);

    let error = within(fixture.actuator.delete_nodes(GROUP, &[node("c")]))
        .await
        .unwrap_err();

    assert!(matches!(error, ActuatorError::Refused(_)), "{error:?}");
    assert_eq!(
        fixture.requests(),
        [GET_MD, LIST_MACHINES, PATCH_C, PATCH_MD, PATCH_C]
    );
    assert!(fixture.mark("c").is_some());
    assert_eq!(fixture.replicas(), 3);

    // Unpaid and past the grace period (none here): the repair takes it back.
    assert_eq!(within(fixture.actuator.repair(Duration::ZERO)).await, 1);
    assert_eq!(fixture.mark("c"), None);
    assert_eq!(fixture.replicas(), 3);
}

#[tokio::test]
async fn delete_nodes_of_a_pool_node_without_a_machine_pays_it_once_through_a_lost_answer_and_a_retry()
 {
    const POOL: &str = "MachinePool/ns/mp";
    let fixture = Fixture::new(&[machine_pool(2, &["p1", "p2"])]);
    fixture.fault(Method::PATCH, "machinepools/mp", Fault::LoseAnswer);

    within(fixture.actuator.delete_nodes(POOL, &[node("p2")]))
        .await
        .unwrap();

    // Over the cached version, guarded; the answer lost, read back: its ledger entry is there.
    assert_eq!(
        fixture.requests(),
        ["PATCH machinepools/mp", "GET machinepools/mp"]
    );
    let entry = pool_node_entry("e2e:///ns/p2");
    assert_eq!(
        fixture.patches("machinepools/mp"),
        [json!({
            "metadata": {"resourceVersion": "1", "annotations": {LEDGER_ANNOTATION: entry.clone()}},
            "spec": {"replicas": 1},
        })]
    );

    // CA asks again: paid already, nothing written.
    within(fixture.actuator.delete_nodes(POOL, &[node("p2")]))
        .await
        .unwrap();

    assert_eq!(fixture.requests().len(), 2);
    let pool = fixture.object("machinepools/mp");
    assert_eq!(pool["spec"]["replicas"], json!(1));
    assert_eq!(
        pool["metadata"]["annotations"][LEDGER_ANNOTATION],
        json!(entry)
    );
}

// ===== DecreaseTargetSize =====

#[tokio::test]
async fn decrease_target_size_cancels_replicas_without_a_machine_by_a_guarded_decrement() {
    // Three replicas, two Machines: one replica never got a Machine.
    let fixture = Fixture::new(&[
        deployment(3, &[]),
        machine_set(3),
        machine("a", true, None),
        machine("b", true, None),
    ]);

    within(fixture.actuator.decrease_target_size(GROUP, -1))
        .await
        .unwrap();

    assert_eq!(fixture.requests(), [GET_MD, LIST_MACHINES, PATCH_MD]);
    assert_eq!(
        fixture.patches(MD),
        [json!({"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 2}})]
    );
    assert_eq!(fixture.replicas(), 2);
}

#[tokio::test]
async fn decrease_target_size_pins_a_pending_machine_with_a_mark_and_pays_it() {
    // c has no Node yet: cancelling it is allowed, and pinned so Cluster API removes exactly c.
    let fixture = Fixture::new(&[
        deployment(3, &[]),
        machine_set(3),
        machine("a", true, None),
        machine("b", true, None),
        machine("c", false, None),
    ]);

    within(fixture.actuator.decrease_target_size(GROUP, -1))
        .await
        .unwrap();

    assert_eq!(
        fixture.requests(),
        [
            GET_MD,
            LIST_MACHINES,
            GET_MD,
            LIST_MACHINES,
            PATCH_C,
            PATCH_MD,
        ]
    );
    let time = fixture
        .mark("c")
        .as_deref()
        .and_then(our_mark_time)
        .expect("c is marked");
    assert_eq!(
        fixture.patches(MD),
        [json!({
            "metadata": {"resourceVersion": "1", "annotations": {LEDGER_ANNOTATION: mark_entry("c", time)}},
            "spec": {"replicas": 2},
        })]
    );
    assert_eq!((fixture.mark("a"), fixture.mark("b")), (None, None));
}

#[tokio::test]
async fn decrease_target_size_whose_decrement_is_refused_takes_its_pin_back() {
    let fixture = Fixture::new(&[
        deployment(3, &[]),
        machine_set(3),
        machine("a", true, None),
        machine("b", true, None),
        machine("c", false, None),
    ]);
    fixture.fault(Method::PATCH, MD, Fault::Refuse(422));

    let error = within(fixture.actuator.decrease_target_size(GROUP, -1))
        .await
        .unwrap_err();

    assert!(matches!(error, ActuatorError::Refused(_)), "{error:?}");
    assert_eq!(
        fixture.requests(),
        [
            GET_MD,
            LIST_MACHINES,
            GET_MD,
            LIST_MACHINES,
            PATCH_C,
            PATCH_MD,
            PATCH_C
        ]
    );
    assert_eq!(fixture.mark("c"), None);
    assert_eq!(
        fixture.object(MD)["metadata"]["resourceVersion"],
        json!("1")
    );
}

#[tokio::test]
async fn decrease_target_size_that_would_remove_a_registered_node_is_refused_without_a_write() {
    let fixture = Fixture::new(&[
        deployment(2, &[]),
        machine_set(2),
        machine("a", true, None),
        machine("b", true, None),
    ]);
    let before = fixture.object(MD);

    let error = within(fixture.actuator.decrease_target_size(GROUP, -1))
        .await
        .unwrap_err();

    match &error {
        ActuatorError::Refused(message) => {
            assert!(
                message.contains("attempt to delete existing nodes"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fixture.requests(), [GET_MD, LIST_MACHINES]);
    assert_eq!(fixture.object(MD), before);
}

#[tokio::test]
async fn decrease_target_size_within_the_grace_after_a_raise_is_refused_without_a_write() {
    // Raised just now: Cluster API may still be creating the Machine of the third replica.
    let fixture = Fixture::new(&[
        deployment(3, &[(RAISED_ANNOTATION, now_unix().to_string())]),
        machine_set(3),
        machine("a", true, None),
        machine("b", true, None),
    ]);

    let error = within(fixture.actuator.decrease_target_size(GROUP, -1))
        .await
        .unwrap_err();

    match &error {
        ActuatorError::Refused(message) => {
            assert!(message.contains("--mark-grace-period"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fixture.requests(), [GET_MD, LIST_MACHINES]);
    assert_eq!(fixture.replicas(), 3);
}

// ===== repair =====

#[tokio::test]
async fn repair_takes_back_an_orphaned_mark_past_the_grace_period_recording_it_first() {
    // Three replicas do not pay for c's mark (a removal interrupted between its two writes).
    let (objects, time) = marked_c(3, false, 3600);
    let fixture = Fixture::new(&objects);

    let repaired = within(fixture.actuator.repair(GRACE)).await;

    assert_eq!(repaired, 1);
    assert_eq!(
        fixture.requests(),
        [
            // Confirmed from the API before anything is taken back.
            GET_MD,
            LIST_MACHINES,
            PATCH_MD,
            PATCH_C,
        ]
    );
    assert_eq!(
        fixture.patches(MD),
        [json!({"metadata": {
            "resourceVersion": "1",
            "annotations": {TAKING_BACK_ANNOTATION: mark_entry("c", time)},
        }})]
    );
    // Guarded by the version decided from: a mark written again meanwhile is left alone.
    assert_eq!(
        fixture.patches("machines/c"),
        [json!({"metadata": {
            "resourceVersion": "1",
            "annotations": {keys().delete_machine: null},
        }})]
    );
    assert_eq!(fixture.mark("c"), None);
    assert_eq!(fixture.replicas(), 3);
}

#[tokio::test]
async fn repair_leaves_a_paid_mark_and_a_young_orphan_alone_without_asking_the_api() {
    // Paid: two replicas and c's mark in the ledger.
    let (paid, _) = marked_c(2, true, 3600);
    // Unpaid, but within the grace period: its removal may still be under way.
    let (young, _) = marked_c(3, false, 5);
    for objects in [paid, young] {
        let fixture = Fixture::new(&objects);

        assert_eq!(within(fixture.actuator.repair(GRACE)).await, 0);

        assert_eq!(fixture.requests(), Vec::<String>::new());
        assert!(fixture.mark("c").is_some());
    }
}

#[tokio::test]
async fn repair_keeps_a_mark_the_api_shows_paid_though_the_cache_does_not() {
    let (objects, time) = marked_c(3, false, 3600);
    let fixture = Fixture::new(&objects);
    // Another provider's decrement paid c's mark; the watch has not delivered it yet.
    fixture.meanwhile(MD, |md| {
        md["spec"]["replicas"] = json!(2);
        md["metadata"]["annotations"][LEDGER_ANNOTATION] = json!(mark_entry("c", time));
    });

    assert_eq!(within(fixture.actuator.repair(GRACE)).await, 0);

    assert_eq!(fixture.requests(), [GET_MD, LIST_MACHINES]);
    assert_eq!(fixture.mark("c"), Some(our_mark(time)));
}

#[tokio::test]
async fn repair_whose_record_conflicts_takes_nothing_back() {
    // The group changes between the repair's read and its record (another provider's decrement
    // landing): the mark may be paid now, so it stays.
    let (objects, time) = marked_c(3, false, 3600);
    let fixture = Fixture::new(&objects);
    fixture.fault(Method::PATCH, MD, Fault::Refuse(409));

    assert_eq!(within(fixture.actuator.repair(GRACE)).await, 0);

    assert_eq!(fixture.requests(), [GET_MD, LIST_MACHINES, PATCH_MD]);
    assert_eq!(fixture.mark("c"), Some(our_mark(time)));
}

#[tokio::test]
async fn repair_leaves_a_mark_whose_machine_changed_since_it_decided() {
    let (objects, time) = marked_c(3, false, 3600);
    let fixture = Fixture::new(&objects);
    // c changes between the repair's listing and its unmark: the guarded unmark conflicts.
    fixture.fault(Method::PATCH, "machines/c", Fault::OtherWriterFirst);

    assert_eq!(within(fixture.actuator.repair(GRACE)).await, 0);

    assert_eq!(
        fixture.requests(),
        [GET_MD, LIST_MACHINES, PATCH_MD, PATCH_C]
    );
    assert_eq!(fixture.mark("c"), Some(our_mark(time)));
}
