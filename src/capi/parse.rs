//! JSON of Cluster API objects (v1beta1 or v1beta2) → the typed views in `capi`.
//!
//! Pure: no I/O. Every function takes the object as the API serves it (`serde_json::Value`) and never
//! panics, whatever its shape. An error names the field path (`spec.replicas`,
//! `metadata.ownerReferences[0].kind`, `metadata.labels[cluster.x-k8s.io/cluster-name]`) and says what
//! was expected and what was found.
//!
//! Absent and `null` are the same: an optional field that is absent or `null` takes its default. A field
//! of the wrong type is an error, except where noted (template taints and infrastructure-template
//! capacity entries are read item by item, and a bad infrastructure reference is kept as `Some(Err)` so
//! that it only costs the group its scale-from-zero template).
use std::collections::BTreeMap;
use std::fmt;

use serde_json::{Map, Value};

use super::{
    ClusterTopology, InfraRef, InfraTemplate, Keys, Machine, MachineFailure, MachineTemplate, Node,
    ObjectKey, OwnerRef, PAUSED_ANNOTATION, ScalableKind, ScalableResource, Taint, TopologyWorker,
};

/// A field of an object that could not be read.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParseError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for ParseError {}

impl ParseError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        ParseError {
            field: field.into(),
            message: message.into(),
        }
    }

    fn missing(field: impl Into<String>) -> Self {
        ParseError::new(field, "missing required field")
    }

    fn empty(field: impl Into<String>) -> Self {
        ParseError::new(field, "must not be empty")
    }

    fn wrong_type(field: impl Into<String>, expected: &str, found: &Value) -> Self {
        ParseError::new(
            field,
            format!("expected {expected}, found {}", describe(found)),
        )
    }
}

/// The field name used when the object itself is not a JSON object.
const ROOT: &str = "object";

/// Label on objects managed by a ClusterClass topology.
/// A copy of the whole object that `kubectl apply` leaves; never read, often the largest annotation.
const LAST_APPLIED_ANNOTATION: &str = "kubectl.kubernetes.io/last-applied-configuration";
const TOPOLOGY_OWNED_LABEL: &str = "topology.cluster.x-k8s.io/owned";
const TOPOLOGY_DEPLOYMENT_LABEL: &str = "topology.cluster.x-k8s.io/deployment-name";
const TOPOLOGY_POOL_LABEL: &str = "topology.cluster.x-k8s.io/pool-name";

/// v1beta2 Machine condition type that mirrors the infrastructure machine's readiness.
const INFRASTRUCTURE_READY_CONDITION: &str = "InfrastructureReady";
/// v1beta2 reason of `InfrastructureReady` once the infrastructure machine is gone.
const OBJECT_DELETED_REASON: &str = "ObjectDeleted";
/// `failure.reason` reported for the condition above.
const INFRASTRUCTURE_DELETED: &str = "InfrastructureDeleted";
const FAILED_PHASE: &str = "Failed";

// ---------------------------------------------------------------------------------------------------
// Scalable resources

impl ScalableResource {
    /// Reads a MachineDeployment, MachineSet or MachinePool, v1beta1 or v1beta2.
    ///
    /// `keys` supplies the cluster-name label (it follows `CAPI_GROUP`). When the object names its
    /// `kind`, it must be `kind`; objects without type information are accepted.
    pub fn from_json(kind: ScalableKind, keys: &Keys, obj: &Value) -> Result<Self, ParseError> {
        root(obj)?;
        if let Some(found) = opt_str(obj, &["kind"])?
            && found != kind.as_str()
        {
            return Err(ParseError::new(
                "kind",
                format!("expected {:?}, found {}", kind.as_str(), quote(found)),
            ));
        }
        let mut meta = Meta::read(obj)?;
        meta.annotations.remove(LAST_APPLIED_ANNOTATION);
        let cluster_name = cluster_name(obj, keys, &meta.labels)?;
        let replicas = opt_i32(obj, &["spec", "replicas"])?;
        let paused = opt_bool(obj, &["spec", "paused"])?.unwrap_or(false)
            || meta.annotations.contains_key(PAUSED_ANNOTATION);
        let template = MachineTemplate {
            labels: string_map(obj, &["spec", "template", "metadata", "labels"])?,
            infrastructure_ref: infra_ref(obj)?,
            taints: taints(obj)?,
            failure_domain: opt_str(obj, &["spec", "template", "spec", "failureDomain"])?
                .filter(|s| !s.is_empty())
                .map(str::to_string),
        };
        let provider_id_list = match kind {
            ScalableKind::MachinePool => string_list(obj, &["spec", "providerIDList"])?,
            _ => Vec::new(),
        };
        let topology = meta.labels.contains_key(TOPOLOGY_OWNED_LABEL).then(|| {
            let name_label = match kind {
                ScalableKind::MachinePool => TOPOLOGY_POOL_LABEL,
                _ => TOPOLOGY_DEPLOYMENT_LABEL,
            };
            meta.labels.get(name_label).cloned().unwrap_or_default()
        });
        Ok(ScalableResource {
            kind,
            key: meta.key,
            uid: meta.uid,
            resource_version: meta.resource_version,
            labels: meta.labels,
            annotations: meta.annotations,
            cluster_name,
            replicas,
            paused,
            owners: meta.owners,
            template,
            provider_id_list,
            topology,
        })
    }
}

/// `spec.template.spec.infrastructureRef`: `None` when absent; `Some(Err)` when present but unusable.
/// The outer `Err` is reserved for a `spec`/`spec.template`/`spec.template.spec` that is not an object.
fn infra_ref(obj: &Value) -> Result<Option<Result<InfraRef, ParseError>>, ParseError> {
    const PATH: [&str; 4] = ["spec", "template", "spec", "infrastructureRef"];
    let Some(r) = lookup(obj, &PATH)? else {
        return Ok(None);
    };
    Ok(Some(read_infra_ref(r, &PATH)))
}

fn read_infra_ref(r: &Value, path: &[&str]) -> Result<InfraRef, ParseError> {
    if !r.is_object() {
        return Err(ParseError::wrong_type(dotted(path), "an object", r));
    }
    let field = |name: &str| format!("{}.{name}", dotted(path));
    let required = |name: &str| -> Result<String, ParseError> {
        match opt_str(r, &[name]).map_err(|e| rebase(e, path))? {
            None => Err(ParseError::missing(field(name))),
            Some("") => Err(ParseError::empty(field(name))),
            Some(s) => Ok(s.to_string()),
        }
    };
    let kind = required("kind")?;
    let name = required("name")?;
    let api_group = opt_str(r, &["apiGroup"]).map_err(|e| rebase(e, path))?;
    let api_version = opt_str(r, &["apiVersion"]).map_err(|e| rebase(e, path))?;
    // v1beta2 names the group; v1beta1 names group/version. A reference carrying both (a v1beta1
    // object written by a client that knows v1beta2) takes the group from `apiGroup`.
    let (version_group, version) = match api_version {
        None | Some("") => (None, None),
        Some(v) => {
            let (g, _) = split_api_version(v).ok_or_else(|| {
                ParseError::new(
                    field("apiVersion"),
                    format!("expected \"group/version\", found {}", quote(v)),
                )
            })?;
            (Some(g), Some(v.to_string()))
        }
    };
    let (api_group, api_version) = match (api_group.filter(|g| !g.is_empty()), version_group) {
        // An apiVersion of another group says nothing about this group's versions: leave the version
        // to discovery.
        (Some(g), vg) => (g.to_string(), version.filter(|_| vg == Some(g))),
        (None, Some(g)) => (g.to_string(), version),
        (None, None) => {
            return Err(ParseError::new(
                dotted(path),
                "names neither apiGroup nor apiVersion",
            ));
        }
    };
    Ok(InfraRef {
        api_group,
        api_version,
        kind,
        name,
    })
}

/// `group/version` → (group, version); a bare `version` is the core group. `None` when malformed.
fn split_api_version(v: &str) -> Option<(&str, &str)> {
    match v.split_once('/') {
        None if !v.is_empty() => Some(("", v)),
        Some((group, version))
            if !group.is_empty() && !version.is_empty() && !version.contains('/') =>
        {
            Some((group, version))
        }
        _ => None,
    }
}

/// `spec.template.spec.taints`: items that are not objects, or whose key/value/effect are not strings,
/// are skipped (as upstream); missing fields read as "".
fn taints(obj: &Value) -> Result<Vec<Taint>, ParseError> {
    const PATH: [&str; 4] = ["spec", "template", "spec", "taints"];
    let Some(items) = opt_array(obj, &PATH)? else {
        return Ok(Vec::new());
    };
    let text = |item: &Map<String, Value>, name: &str| -> Option<String> {
        match item.get(name) {
            None | Some(Value::Null) => Some(String::new()),
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => None,
        }
    };
    Ok(items
        .iter()
        .filter_map(Value::as_object)
        .filter_map(|item| {
            Some(Taint {
                key: text(item, "key")?,
                value: text(item, "value")?,
                effect: text(item, "effect")?,
            })
        })
        .collect())
}

/// `spec.clusterName` when set, else the `<group>/cluster-name` label, else "".
fn cluster_name(
    obj: &Value,
    keys: &Keys,
    labels: &BTreeMap<String, String>,
) -> Result<String, ParseError> {
    Ok(match opt_str(obj, &["spec", "clusterName"])? {
        Some(name) if !name.is_empty() => name.to_string(),
        _ => labels
            .get(&keys.cluster_name_label)
            .cloned()
            .unwrap_or_default(),
    })
}

// ---------------------------------------------------------------------------------------------------
// Machines

impl Machine {
    pub fn from_json(keys: &Keys, obj: &Value) -> Result<Self, ParseError> {
        root(obj)?;
        if let Some(found) = opt_str(obj, &["kind"])?
            && found != "Machine"
        {
            return Err(ParseError::new(
                "kind",
                format!("expected \"Machine\", found {}", quote(found)),
            ));
        }
        let meta = Meta::read(obj)?;
        let cluster_name = cluster_name(obj, keys, &meta.labels)?;
        let provider_id = non_empty(opt_str(obj, &["spec", "providerID"])?);
        // v1beta1: a corev1.ObjectReference; v1beta2: {name}. Either way the name is what we need.
        let node_ref = non_empty(opt_str(obj, &["status", "nodeRef", "name"])?);
        let phase = non_empty(opt_str(obj, &["status", "phase"])?);
        let failure = machine_failure(obj, meta.deleting, phase.as_deref())?;
        // Machines are the many objects: keep only the keys decisions read (all under the group), so
        // e.g. a kubectl last-applied-configuration annotation is not cached ten thousand times.
        let prefix = format!("{}/", keys.group);
        let mut labels = meta.labels;
        labels.retain(|k, _| k.starts_with(&prefix));
        let mut annotations = meta.annotations;
        annotations.retain(|k, _| k.starts_with(&prefix));
        Ok(Machine {
            key: meta.key,
            uid: meta.uid,
            resource_version: meta.resource_version,
            labels,
            annotations,
            cluster_name,
            provider_id,
            node_ref,
            deleting: meta.deleting,
            owners: meta.owners,
            phase,
            failure,
        })
    }
}

/// Why a Machine counts as failed, first match wins:
///
/// 1. v1beta1 `status.failureReason` / `status.failureMessage` (either one set).
/// 2. v1beta2 `status.deprecated.v1beta1.failureReason` / `failureMessage`: where CAPI ≥ 1.11 keeps the
///    terminal failure an infrastructure provider reports under the deprecated v1beta1 contract
///    (`docs/book/src/developer/providers/contracts/infra-machine.md`, "InfraMachine: terminal failures").
/// 3. v1beta2 condition `InfrastructureReady` with status `False` and reason `ObjectDeleted`, on a Machine
///    that is not being deleted (in `status.conditions` of v1beta2 objects, `status.v1beta2.conditions`
///    of v1beta1 objects as CAPI v1.14 serves them).
///
///    Why this condition: the v1beta2 contract drops terminal failures ("there is no more special
///    treatment for provider's terminal failures within Cluster API … surfaced using conditions, with a
///    well documented type/reason; it is up to consumers to treat them accordingly", same page and
///    `docs/proposals/20240916-improve-status-in-CAPI-resources.md`), and CAPI defines no generic
///    "terminal" condition type or reason. The only terminal state core CAPI itself reports with a v1beta2
///    condition is this one: CAPI v1.14 `core/reconcilers/machine/machine_controller_status.go`
///    (`setInfrastructureReadyCondition`) sets `InfrastructureReady=False`, reason
///    `MachineInfrastructureDeletedReason` (= `ObjectDeletedReason` = "ObjectDeleted",
///    `api/core/v1beta2/condition_consts.go`, `machine_types.go`) when the infrastructure machine
///    disappears after provisioning while the Machine still exists — the same event for which
///    `machine_controller_phases.go` writes the deprecated failureReason `InvalidConfiguration`. It stays
///    available once `status.deprecated` is dropped (v1beta1 removal, tentatively April 2027). During
///    deletion the same condition is routine, hence the `deleting` guard. Provider-specific reasons
///    mirrored from the InfraMachine's Ready condition are not treated as terminal: none is documented
///    as such by CAPI, and most (e.g. `NotReady`) are transient.
/// 4. `status.phase == "Failed"`: set by pre-v1beta2 controllers together with the failure fields; the
///    CAPI v1.14 controller never sets it (`setMachinePhaseAndLastUpdated`).
///
/// Note: upstream's clusterapi provider (kubernetes/autoscaler#10001, after #9961) requires
/// `failureMessage` *and* phase `Failed`; `phase` is kept in the view so a consumer can apply that rule.
fn machine_failure(
    obj: &Value,
    deleting: bool,
    phase: Option<&str>,
) -> Result<Option<MachineFailure>, ParseError> {
    for base in [&["status"][..], &["status", "deprecated", "v1beta1"][..]] {
        let at = |name: &'static str| -> Vec<&str> { base.iter().copied().chain([name]).collect() };
        let reason = non_empty(opt_str(obj, &at("failureReason"))?);
        let message = non_empty(opt_str(obj, &at("failureMessage"))?);
        if reason.is_some() || message.is_some() {
            return Ok(Some(MachineFailure {
                reason: reason.unwrap_or_default(),
                message: message.unwrap_or_default(),
            }));
        }
    }
    if !deleting {
        for path in [
            &["status", "conditions"][..],
            &["status", "v1beta2", "conditions"][..],
        ] {
            let Some(conditions) = opt_array(obj, path)? else {
                continue;
            };
            let infra_deleted = conditions.iter().filter_map(Value::as_object).find(|c| {
                c.get("type").and_then(Value::as_str) == Some(INFRASTRUCTURE_READY_CONDITION)
                    && c.get("status").and_then(Value::as_str) == Some("False")
                    && c.get("reason").and_then(Value::as_str) == Some(OBJECT_DELETED_REASON)
            });
            if let Some(c) = infra_deleted {
                let message = c
                    .get("message")
                    .and_then(Value::as_str)
                    .filter(|m| !m.is_empty())
                    .unwrap_or(
                        "the infrastructure machine was deleted while the Machine still exists",
                    );
                return Ok(Some(MachineFailure {
                    reason: INFRASTRUCTURE_DELETED.to_string(),
                    message: message.to_string(),
                }));
            }
        }
    }
    if phase == Some(FAILED_PHASE) {
        return Ok(Some(MachineFailure {
            reason: FAILED_PHASE.to_string(),
            message: "status.phase is Failed".to_string(),
        }));
    }
    Ok(None)
}

// ---------------------------------------------------------------------------------------------------
// Infrastructure machine templates

impl ClusterTopology {
    /// A v1beta1 or v1beta2 Cluster: the workers of `spec.topology.workers` (absent: none).
    pub fn from_json(obj: &Value) -> Result<Self, ParseError> {
        root(obj)?;
        let meta = Meta::read(obj)?;
        let mut workers = Vec::new();
        for (kind, list) in [
            (ScalableKind::MachineDeployment, "machineDeployments"),
            (ScalableKind::MachinePool, "machinePools"),
        ] {
            let path = ["spec", "topology", "workers", list];
            for (i, entry) in opt_array(obj, &path)?.into_iter().flatten().enumerate() {
                let at = |field: &str| format!("{}[{i}].{field}", dotted(&path));
                let name = opt_str(entry, &["name"])
                    .map_err(|e| ParseError::new(at("name"), e.message))?;
                let replicas = opt_i32(entry, &["replicas"])
                    .map_err(|e| ParseError::new(at("replicas"), e.message))?;
                if let Some(name) = name {
                    workers.push(TopologyWorker {
                        kind,
                        name: name.to_string(),
                        replicas,
                    });
                }
            }
        }
        Ok(ClusterTopology {
            key: meta.key,
            workers,
        })
    }
}

impl InfraTemplate {
    /// Reads an infrastructure machine template (any provider). `apiVersion` and `kind` are required:
    /// they are how a scalable resource's `infrastructureRef` finds the template.
    ///
    /// `status.capacity` entries whose value is not a string are skipped (upstream ignores the whole map).
    pub fn from_json(obj: &Value) -> Result<Self, ParseError> {
        root(obj)?;
        let api_version = required_str(obj, &["apiVersion"])?;
        let (api_group, _) = split_api_version(api_version).ok_or_else(|| {
            ParseError::new(
                "apiVersion",
                format!("expected \"group/version\", found {}", quote(api_version)),
            )
        })?;
        let kind = required_str(obj, &["kind"])?.to_string();
        let meta = Meta::read(obj)?;
        let capacity = match lookup(obj, &["status", "capacity"])? {
            None => BTreeMap::new(),
            Some(Value::Object(m)) => m
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect(),
            Some(other) => {
                return Err(ParseError::wrong_type(
                    "status.capacity",
                    "an object",
                    other,
                ));
            }
        };
        Ok(InfraTemplate {
            key: meta.key,
            api_group: api_group.to_string(),
            kind,
            capacity,
            architecture: non_empty(opt_str(obj, &["status", "nodeInfo", "architecture"])?),
            operating_system: non_empty(opt_str(obj, &["status", "nodeInfo", "operatingSystem"])?),
        })
    }
}

// ---------------------------------------------------------------------------------------------------
// Nodes

impl Node {
    /// Name, `spec.providerID` (empty → `None`) and labels of a workload-cluster Node.
    pub fn from_k8s(node: &k8s_openapi::api::core::v1::Node) -> Self {
        Node {
            name: node.metadata.name.clone().unwrap_or_default(),
            provider_id: node
                .spec
                .as_ref()
                .and_then(|s| s.provider_id.clone())
                .filter(|p| !p.is_empty()),
            labels: node.metadata.labels.clone().unwrap_or_default(),
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Metadata

struct Meta {
    key: ObjectKey,
    uid: String,
    resource_version: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    owners: Vec<OwnerRef>,
    deleting: bool,
}

impl Meta {
    /// `metadata`: namespace and name are required; uid and resourceVersion default to "".
    fn read(obj: &Value) -> Result<Self, ParseError> {
        match obj.get("metadata") {
            None | Some(Value::Null) => return Err(ParseError::missing("metadata")),
            Some(Value::Object(_)) => {}
            Some(other) => return Err(ParseError::wrong_type("metadata", "an object", other)),
        }
        let namespace = required_str(obj, &["metadata", "namespace"])?;
        let name = required_str(obj, &["metadata", "name"])?;
        Ok(Meta {
            key: ObjectKey::new(namespace, name),
            uid: opt_str(obj, &["metadata", "uid"])?
                .unwrap_or_default()
                .to_string(),
            resource_version: opt_str(obj, &["metadata", "resourceVersion"])?
                .unwrap_or_default()
                .to_string(),
            labels: string_map(obj, &["metadata", "labels"])?,
            annotations: string_map(obj, &["metadata", "annotations"])?,
            owners: owners(obj)?,
            deleting: opt_str(obj, &["metadata", "deletionTimestamp"])?
                .is_some_and(|t| !t.is_empty()),
        })
    }
}

/// `metadata.ownerReferences`: kind and name of each (both required by the API).
fn owners(obj: &Value) -> Result<Vec<OwnerRef>, ParseError> {
    let Some(items) = opt_array(obj, &["metadata", "ownerReferences"])? else {
        return Ok(Vec::new());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let base = format!("metadata.ownerReferences[{i}]");
            let Value::Object(m) = item else {
                return Err(ParseError::wrong_type(base, "an object", item));
            };
            let text = |name: &str| -> Result<String, ParseError> {
                match m.get(name) {
                    None | Some(Value::Null) => Err(ParseError::missing(format!("{base}.{name}"))),
                    Some(Value::String(s)) if s.is_empty() => {
                        Err(ParseError::empty(format!("{base}.{name}")))
                    }
                    Some(Value::String(s)) => Ok(s.clone()),
                    Some(other) => Err(ParseError::wrong_type(
                        format!("{base}.{name}"),
                        "a string",
                        other,
                    )),
                }
            };
            Ok(OwnerRef {
                kind: text("kind")?,
                name: text("name")?,
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------------
// Typed access by path. A path is a list of object keys from the root; absent and null read as `None`.

fn root(obj: &Value) -> Result<(), ParseError> {
    if obj.is_object() {
        Ok(())
    } else {
        Err(ParseError::wrong_type(ROOT, "an object", obj))
    }
}

fn dotted(path: &[&str]) -> String {
    path.join(".")
}

/// Prefixes an error found under a sub-object with the sub-object's path.
fn rebase(e: ParseError, base: &[&str]) -> ParseError {
    ParseError::new(format!("{}.{}", dotted(base), e.field), e.message)
}

/// The value at `path`; `Ok(None)` when a segment is absent or null; an error when a segment on the way
/// is not an object.
fn lookup<'a>(obj: &'a Value, path: &[&str]) -> Result<Option<&'a Value>, ParseError> {
    let mut current = obj;
    for (i, segment) in path.iter().enumerate() {
        let Value::Object(map) = current else {
            return Err(ParseError::wrong_type(
                dotted(&path[..i]),
                "an object",
                current,
            ));
        };
        match map.get(*segment) {
            None | Some(Value::Null) => return Ok(None),
            Some(v) => current = v,
        }
    }
    Ok(Some(current))
}

fn opt_str<'a>(obj: &'a Value, path: &[&str]) -> Result<Option<&'a str>, ParseError> {
    match lookup(obj, path)? {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(ParseError::wrong_type(dotted(path), "a string", other)),
    }
}

/// A string that must be present and non-empty.
fn required_str<'a>(obj: &'a Value, path: &[&str]) -> Result<&'a str, ParseError> {
    match opt_str(obj, path)? {
        None => Err(ParseError::missing(dotted(path))),
        Some("") => Err(ParseError::empty(dotted(path))),
        Some(s) => Ok(s),
    }
}

fn opt_bool(obj: &Value, path: &[&str]) -> Result<Option<bool>, ParseError> {
    match lookup(obj, path)? {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(ParseError::wrong_type(dotted(path), "a boolean", other)),
    }
}

fn opt_i32(obj: &Value, path: &[&str]) -> Result<Option<i32>, ParseError> {
    match lookup(obj, path)? {
        None => Ok(None),
        Some(v @ Value::Number(n)) => match n.as_i64() {
            Some(i) => i32::try_from(i)
                .map(Some)
                .map_err(|_| ParseError::wrong_type(dotted(path), "a 32-bit integer", v)),
            None if n.is_u64() => Err(ParseError::wrong_type(dotted(path), "a 32-bit integer", v)),
            None => Err(ParseError::wrong_type(dotted(path), "an integer", v)),
        },
        Some(other) => Err(ParseError::wrong_type(dotted(path), "an integer", other)),
    }
}

fn opt_array<'a>(obj: &'a Value, path: &[&str]) -> Result<Option<&'a Vec<Value>>, ParseError> {
    match lookup(obj, path)? {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(other) => Err(ParseError::wrong_type(dotted(path), "a list", other)),
    }
}

/// A map of strings (labels, annotations); a value that is not a string is an error naming its key.
fn string_map(obj: &Value, path: &[&str]) -> Result<BTreeMap<String, String>, ParseError> {
    match lookup(obj, path)? {
        None => Ok(BTreeMap::new()),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                other => Err(ParseError::wrong_type(
                    format!("{}[{k}]", dotted(path)),
                    "a string",
                    other,
                )),
            })
            .collect(),
        Some(other) => Err(ParseError::wrong_type(
            dotted(path),
            "a map of strings",
            other,
        )),
    }
}

/// A list of strings; an item that is not a string is an error naming its index.
fn string_list(obj: &Value, path: &[&str]) -> Result<Vec<String>, ParseError> {
    let Some(items) = opt_array(obj, path)? else {
        return Ok(Vec::new());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(ParseError::wrong_type(
                format!("{}[{i}]", dotted(path)),
                "a string",
                other,
            )),
        })
        .collect()
}

fn non_empty(s: Option<&str>) -> Option<String> {
    s.filter(|s| !s.is_empty()).map(str::to_string)
}

/// How a value reads in an error message: strings quoted (and shortened), numbers and booleans as
/// written, containers by their type.
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => quote(s),
        Value::Array(_) => "a list".to_string(),
        Value::Object(_) => "an object".to_string(),
    }
}

/// A string quoted for a message, cut at 64 characters.
fn quote(s: &str) -> String {
    const MAX: usize = 64;
    match s.char_indices().nth(MAX) {
        None => format!("{s:?}"),
        Some((cut, _)) => format!("{:?}…", &s[..cut]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn machines_keep_only_the_group_keys_and_resources_drop_the_last_applied_copy() {
        let keys = Keys::default();
        let machine = json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": {"name": "m", "namespace": "ns",
                "labels": {"cluster.x-k8s.io/set-name": "ms", "app": "x"},
                "annotations": {"cluster.x-k8s.io/delete-machine": "t", "kubectl.kubernetes.io/last-applied-configuration": "{}"}},
            "spec": {"clusterName": "c"}
        });
        let m = Machine::from_json(&keys, &machine).unwrap();
        assert_eq!(
            m.labels.keys().collect::<Vec<_>>(),
            ["cluster.x-k8s.io/set-name"]
        );
        assert_eq!(
            m.annotations.keys().collect::<Vec<_>>(),
            ["cluster.x-k8s.io/delete-machine"]
        );
        let md = json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
            "metadata": {"name": "md", "namespace": "ns", "labels": {"team": "a"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "capacity.cluster-autoscaler.kubernetes.io/cpu": "2"}},
            "spec": {"clusterName": "c", "replicas": 1}
        });
        let r = ScalableResource::from_json(ScalableKind::MachineDeployment, &keys, &md).unwrap();
        assert_eq!(
            r.annotations.keys().collect::<Vec<_>>(),
            ["capacity.cluster-autoscaler.kubernetes.io/cpu"]
        );
        assert_eq!(
            r.labels.get("team").map(String::as_str),
            Some("a"),
            "labels feed discovery selectors"
        );
    }

    #[test]
    fn cluster_topology_workers_and_their_replicas() {
        let cluster = json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": {"name": "c1", "namespace": "ns"},
            "spec": {"topology": {"classRef": {"name": "cc"}, "workers": {
                "machineDeployments": [{"class": "default", "name": "md-0", "replicas": 3}, {"class": "default", "name": "md-1"}],
                "machinePools": [{"class": "default", "name": "mp-0", "replicas": 1}]
            }}}
        });
        let t = ClusterTopology::from_json(&cluster).unwrap();
        assert_eq!(t.key, ObjectKey::new("ns", "c1"));
        assert_eq!(
            t.workers,
            vec![
                TopologyWorker {
                    kind: ScalableKind::MachineDeployment,
                    name: "md-0".into(),
                    replicas: Some(3)
                },
                TopologyWorker {
                    kind: ScalableKind::MachineDeployment,
                    name: "md-1".into(),
                    replicas: None
                },
                TopologyWorker {
                    kind: ScalableKind::MachinePool,
                    name: "mp-0".into(),
                    replicas: Some(1)
                },
            ]
        );
        let plain = json!({"metadata": {"name": "c2", "namespace": "ns"}, "spec": {}});
        assert!(
            ClusterTopology::from_json(&plain)
                .unwrap()
                .workers
                .is_empty()
        );
        let bad = json!({"metadata": {"name": "c3", "namespace": "ns"},
            "spec": {"topology": {"workers": {"machineDeployments": [{"name": "md-0", "replicas": "three"}]}}}});
        let e = ClusterTopology::from_json(&bad).unwrap_err();
        assert_eq!(
            e.field,
            "spec.topology.workers.machineDeployments[0].replicas"
        );
    }

    macro_rules! fixtures {
        ($($name:literal),* $(,)?) => {
            &[$(($name, include_str!(concat!("../../tests/fixtures/objects/", $name)))),*]
        };
    }

    /// Every object fixture, by file name.
    const FIXTURES: &[(&str, &str)] = fixtures![
        "awsmachinetemplate-v1beta2.json",
        "dockermachinetemplate-v1beta2.json",
        "machine-v1beta1-failed.json",
        "machine-v1beta1-running.json",
        "machine-v1beta2-deleting.json",
        "machine-v1beta2-failed-deprecated.json",
        "machine-v1beta2-infra-deleted.json",
        "machine-v1beta2-pending.json",
        "machine-v1beta2-running.json",
        "machinedeployment-v1beta1.json",
        "machinedeployment-v1beta2-topology-paused.json",
        "machinedeployment-v1beta2.json",
        "machinepool-v1beta1.json",
        "machinepool-v1beta2.json",
        "machineset-v1beta1-standalone.json",
        "machineset-v1beta2-owned.json",
    ];

    #[test]
    fn every_fixture_is_listed() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/objects");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".json"))
            .collect();
        on_disk.sort();
        let listed: Vec<&str> = FIXTURES.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            on_disk, listed,
            "list new fixtures in FIXTURES (sorted) so the fuzz tests see them"
        );
    }

    fn fixture(name: &str) -> Value {
        let (_, text) = FIXTURES
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("no fixture {name}"));
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    fn keys() -> Keys {
        Keys::default()
    }

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn owner(kind: &str, name: &str) -> OwnerRef {
        OwnerRef {
            kind: kind.into(),
            name: name.into(),
        }
    }

    fn taint(key: &str, value: &str, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: value.into(),
            effect: effect.into(),
        }
    }

    fn infra(group: &str, version: Option<&str>, kind: &str, name: &str) -> InfraRef {
        InfraRef {
            api_group: group.into(),
            api_version: version.map(Into::into),
            kind: kind.into(),
            name: name.into(),
        }
    }

    /// Sets (or with `None`, removes) the value at `path`, creating objects on the way.
    fn set(obj: &mut Value, path: &[&str], value: Option<Value>) {
        let (last, parents) = path.split_last().expect("non-empty path");
        let mut current = obj;
        for p in parents {
            if !current.get(*p).is_some_and(Value::is_object) {
                current[*p] = json!({});
            }
            current = &mut current[*p];
        }
        let m = current.as_object_mut().expect("object");
        match value {
            Some(v) => {
                m.insert(last.to_string(), v);
            }
            None => {
                m.remove(*last);
            }
        }
    }

    fn with(mut obj: Value, path: &[&str], value: Value) -> Value {
        set(&mut obj, path, Some(value));
        obj
    }

    fn without(mut obj: Value, path: &[&str]) -> Value {
        set(&mut obj, path, None);
        obj
    }

    // -----------------------------------------------------------------------------------------------
    // Scalable resources

    #[test]
    fn machinedeployment_v1beta2_fixture() {
        let md = ScalableResource::from_json(
            ScalableKind::MachineDeployment,
            &keys(),
            &fixture("machinedeployment-v1beta2.json"),
        )
        .unwrap();
        assert_eq!(
            md,
            ScalableResource {
                kind: ScalableKind::MachineDeployment,
                key: ObjectKey::new("team-a", "workers-md-0"),
                uid: "3f0d2c1e-5b7a-4c1d-9e2f-0a1b2c3d4e01".into(),
                resource_version: "48213".into(),
                labels: map(&[
                    ("cluster.x-k8s.io/cluster-name", "prod"),
                    ("nodepool", "general")
                ]),
                annotations: map(&[
                    (
                        "cluster.x-k8s.io/cluster-api-autoscaler-node-group-min-size",
                        "1"
                    ),
                    (
                        "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size",
                        "10"
                    ),
                    (
                        "capacity.cluster-autoscaler.kubernetes.io/labels",
                        "tier=general"
                    ),
                    ("machinedeployment.clusters.x-k8s.io/revision", "2"),
                ]),
                cluster_name: "prod".into(),
                replicas: Some(3),
                paused: false,
                owners: vec![owner("Cluster", "prod")],
                template: MachineTemplate {
                    labels: map(&[
                        ("cluster.x-k8s.io/cluster-name", "prod"),
                        ("cluster.x-k8s.io/deployment-name", "workers-md-0"),
                        ("node-role.kubernetes.io/worker", ""),
                        ("nodepool", "general"),
                    ]),
                    infrastructure_ref: Some(Ok(infra(
                        "infrastructure.cluster.x-k8s.io",
                        None,
                        "DockerMachineTemplate",
                        "workers-md-0-7d9f4"
                    ))),
                    taints: vec![
                        taint("dedicated", "general", "NoSchedule"),
                        taint("example.com/initializing", "", "NoExecute"),
                    ],
                    failure_domain: Some("fd-a".into()),
                },
                provider_id_list: vec![],
                topology: None,
            }
        );
    }

    /// What each scalable fixture reads as, field by field.
    #[test]
    fn scalable_fixtures() {
        struct Row {
            file: &'static str,
            kind: ScalableKind,
            key: (&'static str, &'static str),
            cluster: &'static str,
            replicas: Option<i32>,
            paused: bool,
            owners: Vec<OwnerRef>,
            infra: Option<InfraRef>,
            template_labels: usize,
            provider_ids: usize,
            topology: Option<&'static str>,
        }
        let rows = [
            Row {
                file: "machinedeployment-v1beta1.json",
                kind: ScalableKind::MachineDeployment,
                key: ("team-b", "legacy-md"),
                cluster: "legacy",
                replicas: Some(0),
                // The paused annotation pauses whatever its value, even "false" (as upstream).
                paused: true,
                owners: vec![],
                infra: Some(infra(
                    "infrastructure.cluster.x-k8s.io",
                    Some("infrastructure.cluster.x-k8s.io/v1beta2"),
                    "AWSMachineTemplate",
                    "legacy-md-m5large",
                )),
                template_labels: 1,
                provider_ids: 0,
                topology: None,
            },
            Row {
                file: "machinedeployment-v1beta2-topology-paused.json",
                kind: ScalableKind::MachineDeployment,
                key: ("tenants", "cc-md-gpu-8xk2p"),
                cluster: "cc",
                replicas: None,
                paused: true,
                owners: vec![],
                infra: Some(infra(
                    "infrastructure.cluster.x-k8s.io",
                    None,
                    "DockerMachineTemplate",
                    "cc-md-gpu-infra-4f2k9",
                )),
                template_labels: 0,
                provider_ids: 0,
                topology: Some("gpu"),
            },
            Row {
                file: "machineset-v1beta2-owned.json",
                kind: ScalableKind::MachineSet,
                key: ("team-a", "workers-md-0-5f8c9"),
                cluster: "prod",
                replicas: Some(3),
                paused: false,
                owners: vec![owner("MachineDeployment", "workers-md-0")],
                infra: Some(infra(
                    "infrastructure.cluster.x-k8s.io",
                    None,
                    "DockerMachineTemplate",
                    "workers-md-0-7d9f4",
                )),
                template_labels: 2,
                provider_ids: 0,
                topology: None,
            },
            Row {
                file: "machineset-v1beta1-standalone.json",
                kind: ScalableKind::MachineSet,
                key: ("team-b", "standalone-ms"),
                cluster: "legacy",
                replicas: None,
                paused: false,
                owners: vec![],
                infra: Some(infra(
                    "infrastructure.cluster.x-k8s.io",
                    Some("infrastructure.cluster.x-k8s.io/v1beta1"),
                    "VSphereMachineTemplate",
                    "standalone",
                )),
                template_labels: 1,
                provider_ids: 0,
                topology: None,
            },
            Row {
                file: "machinepool-v1beta2.json",
                kind: ScalableKind::MachinePool,
                key: ("team-a", "pool-0"),
                cluster: "prod",
                replicas: Some(2),
                paused: false,
                owners: vec![],
                infra: Some(infra(
                    "infrastructure.cluster.x-k8s.io",
                    None,
                    "AWSMachinePool",
                    "pool-0",
                )),
                template_labels: 1,
                provider_ids: 2,
                topology: None,
            },
            Row {
                file: "machinepool-v1beta1.json",
                kind: ScalableKind::MachinePool,
                key: ("team-c", "azure-pool"),
                cluster: "az",
                replicas: Some(1),
                paused: false,
                owners: vec![],
                infra: Some(infra(
                    "infrastructure.cluster.x-k8s.io",
                    Some("infrastructure.cluster.x-k8s.io/v1beta1"),
                    "AzureMachinePool",
                    "azure-pool",
                )),
                template_labels: 0,
                provider_ids: 1,
                topology: None,
            },
        ];
        for row in rows {
            let r = ScalableResource::from_json(row.kind, &keys(), &fixture(row.file))
                .unwrap_or_else(|e| panic!("{}: {e}", row.file));
            let f = row.file;
            assert_eq!(r.kind, row.kind, "{f}");
            assert_eq!(r.key, ObjectKey::new(row.key.0, row.key.1), "{f}");
            assert!(!r.uid.is_empty() && !r.resource_version.is_empty(), "{f}");
            assert_eq!(r.cluster_name, row.cluster, "{f}");
            assert_eq!(r.replicas, row.replicas, "{f}");
            assert_eq!(r.paused, row.paused, "{f}");
            assert_eq!(r.owners, row.owners, "{f}");
            assert_eq!(r.template.infrastructure_ref, row.infra.map(Ok), "{f}");
            assert_eq!(r.template.labels.len(), row.template_labels, "{f}");
            assert_eq!(r.provider_id_list.len(), row.provider_ids, "{f}");
            assert_eq!(r.topology.as_deref(), row.topology, "{f}");
        }
    }

    fn base_md() -> Value {
        json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2",
            "kind": "MachineDeployment",
            "metadata": {"namespace": "ns", "name": "md"},
            "spec": {"clusterName": "c", "template": {"spec": {}}},
        })
    }

    /// Field by field: what a change to a minimal MachineDeployment does to the view, or the exact error.
    #[test]
    fn scalable_field_cases() {
        type Check = fn(&ScalableResource) -> bool;
        let ok = |c: Check| Ok::<Check, &str>(c);
        let cases: Vec<(&str, Value, Result<Check, &str>)> = vec![
            (
                "minimal",
                base_md(),
                ok(|r| {
                    r.replicas.is_none()
                        && !r.paused
                        && r.template == MachineTemplate::default()
                        && r.uid.is_empty()
                        && r.cluster_name == "c"
                }),
            ),
            (
                "replicas",
                with(base_md(), &["spec", "replicas"], json!(5)),
                ok(|r| r.replicas == Some(5)),
            ),
            (
                "replicas zero",
                with(base_md(), &["spec", "replicas"], json!(0)),
                ok(|r| r.replicas == Some(0)),
            ),
            (
                "replicas null",
                with(base_md(), &["spec", "replicas"], Value::Null),
                ok(|r| r.replicas.is_none()),
            ),
            (
                "replicas string",
                with(base_md(), &["spec", "replicas"], json!("three")),
                Err(r#"spec.replicas: expected an integer, found "three""#),
            ),
            (
                "replicas float",
                with(base_md(), &["spec", "replicas"], json!(1.5)),
                Err("spec.replicas: expected an integer, found 1.5"),
            ),
            (
                "replicas too large",
                with(base_md(), &["spec", "replicas"], json!(3_000_000_000_i64)),
                Err("spec.replicas: expected a 32-bit integer, found 3000000000"),
            ),
            (
                "replicas above i64",
                with(base_md(), &["spec", "replicas"], json!(u64::MAX)),
                Err("spec.replicas: expected a 32-bit integer, found 18446744073709551615"),
            ),
            (
                "replicas negative beyond i32",
                with(base_md(), &["spec", "replicas"], json!(-3_000_000_000_i64)),
                Err("spec.replicas: expected a 32-bit integer, found -3000000000"),
            ),
            (
                "replicas object",
                with(base_md(), &["spec", "replicas"], json!({"value": 1})),
                Err("spec.replicas: expected an integer, found an object"),
            ),
            (
                "spec not an object",
                with(base_md(), &["spec"], json!("x")),
                Err(r#"spec: expected an object, found "x""#),
            ),
            (
                "no spec",
                without(base_md(), &["spec"]),
                ok(|r| r.cluster_name.is_empty() && r.replicas.is_none()),
            ),
            (
                "no metadata",
                without(base_md(), &["metadata"]),
                Err("metadata: missing required field"),
            ),
            (
                "metadata list",
                with(base_md(), &["metadata"], json!([])),
                Err("metadata: expected an object, found a list"),
            ),
            (
                "no name",
                without(base_md(), &["metadata", "name"]),
                Err("metadata.name: missing required field"),
            ),
            (
                "empty name",
                with(base_md(), &["metadata", "name"], json!("")),
                Err("metadata.name: must not be empty"),
            ),
            (
                "name number",
                with(base_md(), &["metadata", "name"], json!(5)),
                Err("metadata.name: expected a string, found 5"),
            ),
            (
                "no namespace",
                without(base_md(), &["metadata", "namespace"]),
                Err("metadata.namespace: missing required field"),
            ),
            (
                "uid and resourceVersion",
                with(
                    with(base_md(), &["metadata", "uid"], json!("u")),
                    &["metadata", "resourceVersion"],
                    json!("7"),
                ),
                ok(|r| r.uid == "u" && r.resource_version == "7"),
            ),
            (
                "uid number",
                with(base_md(), &["metadata", "uid"], json!(1)),
                Err("metadata.uid: expected a string, found 1"),
            ),
            (
                "label not a string",
                with(
                    base_md(),
                    &["metadata", "labels"],
                    json!({"a": "b", "x.io/n": 1}),
                ),
                Err("metadata.labels[x.io/n]: expected a string, found 1"),
            ),
            (
                "labels a list",
                with(base_md(), &["metadata", "labels"], json!(["a"])),
                Err("metadata.labels: expected a map of strings, found a list"),
            ),
            (
                "annotation null",
                with(base_md(), &["metadata", "annotations"], json!({"a": null})),
                Err("metadata.annotations[a]: expected a string, found null"),
            ),
            (
                "owners",
                with(
                    base_md(),
                    &["metadata", "ownerReferences"],
                    json!([{"kind": "Cluster", "name": "c", "uid": "1"}]),
                ),
                ok(|r| r.owners == [owner("Cluster", "c")]),
            ),
            (
                "owners not a list",
                with(base_md(), &["metadata", "ownerReferences"], json!({})),
                Err("metadata.ownerReferences: expected a list, found an object"),
            ),
            (
                "owner without kind",
                with(
                    base_md(),
                    &["metadata", "ownerReferences"],
                    json!([{"kind": "A", "name": "a"}, {"name": "b"}]),
                ),
                Err("metadata.ownerReferences[1].kind: missing required field"),
            ),
            (
                "owner not an object",
                with(
                    base_md(),
                    &["metadata", "ownerReferences"],
                    json!(["Cluster/c"]),
                ),
                Err(r#"metadata.ownerReferences[0]: expected an object, found "Cluster/c""#),
            ),
            (
                "owner name empty",
                with(
                    base_md(),
                    &["metadata", "ownerReferences"],
                    json!([{"kind": "A", "name": ""}]),
                ),
                Err("metadata.ownerReferences[0].name: must not be empty"),
            ),
            (
                "spec.paused",
                with(base_md(), &["spec", "paused"], json!(true)),
                ok(|r| r.paused),
            ),
            (
                "spec.paused false",
                with(base_md(), &["spec", "paused"], json!(false)),
                ok(|r| !r.paused),
            ),
            (
                "spec.paused string",
                with(base_md(), &["spec", "paused"], json!("true")),
                Err(r#"spec.paused: expected a boolean, found "true""#),
            ),
            (
                "paused annotation, empty value",
                with(
                    base_md(),
                    &["metadata", "annotations"],
                    json!({"cluster.x-k8s.io/paused": ""}),
                ),
                ok(|r| r.paused),
            ),
            (
                "cluster name from label",
                with(
                    without(base_md(), &["spec", "clusterName"]),
                    &["metadata", "labels"],
                    json!({"cluster.x-k8s.io/cluster-name": "from-label"}),
                ),
                ok(|r| r.cluster_name == "from-label"),
            ),
            (
                "empty spec.clusterName falls back to the label",
                with(
                    with(base_md(), &["spec", "clusterName"], json!("")),
                    &["metadata", "labels"],
                    json!({"cluster.x-k8s.io/cluster-name": "from-label"}),
                ),
                ok(|r| r.cluster_name == "from-label"),
            ),
            (
                "spec.clusterName wins over the label",
                with(
                    base_md(),
                    &["metadata", "labels"],
                    json!({"cluster.x-k8s.io/cluster-name": "other"}),
                ),
                ok(|r| r.cluster_name == "c"),
            ),
            (
                "no cluster name at all",
                without(base_md(), &["spec", "clusterName"]),
                ok(|r| r.cluster_name.is_empty()),
            ),
            (
                "clusterName number",
                with(base_md(), &["spec", "clusterName"], json!(7)),
                Err("spec.clusterName: expected a string, found 7"),
            ),
            (
                "template labels",
                with(
                    base_md(),
                    &["spec", "template", "metadata", "labels"],
                    json!({"a": "1"}),
                ),
                ok(|r| r.template.labels == map(&[("a", "1")])),
            ),
            (
                "template labels wrong type",
                with(
                    base_md(),
                    &["spec", "template", "metadata", "labels"],
                    json!("a=1"),
                ),
                Err(r#"spec.template.metadata.labels: expected a map of strings, found "a=1""#),
            ),
            (
                "template spec not an object",
                with(base_md(), &["spec", "template", "spec"], json!(["x"])),
                Err("spec.template.spec: expected an object, found a list"),
            ),
            (
                "taints: non-object items and items with non-string fields are skipped",
                with(
                    base_md(),
                    &["spec", "template", "spec", "taints"],
                    json!([
                        "a=b:NoSchedule",
                        {"key": "k", "value": "v", "effect": "NoSchedule", "propagation": "Always"},
                        7,
                        {"key": "only-key"},
                        {"key": "bad", "effect": 1},
                        null,
                        {"key": "n", "value": null, "effect": "PreferNoSchedule"}
                    ]),
                ),
                ok(|r| {
                    r.template.taints
                        == [
                            taint("k", "v", "NoSchedule"),
                            taint("only-key", "", ""),
                            taint("n", "", "PreferNoSchedule"),
                        ]
                }),
            ),
            (
                "taints not a list",
                with(
                    base_md(),
                    &["spec", "template", "spec", "taints"],
                    json!("k=v:NoSchedule"),
                ),
                Err(r#"spec.template.spec.taints: expected a list, found "k=v:NoSchedule""#),
            ),
            (
                "failure domain",
                with(
                    base_md(),
                    &["spec", "template", "spec", "failureDomain"],
                    json!("us-east-1a"),
                ),
                ok(|r| r.template.failure_domain.as_deref() == Some("us-east-1a")),
            ),
            (
                "empty failure domain",
                with(
                    base_md(),
                    &["spec", "template", "spec", "failureDomain"],
                    json!(""),
                ),
                ok(|r| r.template.failure_domain.is_none()),
            ),
            (
                "failure domain number",
                with(
                    base_md(),
                    &["spec", "template", "spec", "failureDomain"],
                    json!(1),
                ),
                Err("spec.template.spec.failureDomain: expected a string, found 1"),
            ),
            (
                "providerIDList is read only for MachinePools",
                with(base_md(), &["spec", "providerIDList"], json!([1])),
                ok(|r| r.provider_id_list.is_empty()),
            ),
            (
                "topology owned",
                with(
                    base_md(),
                    &["metadata", "labels"],
                    json!({"topology.cluster.x-k8s.io/owned": ""}),
                ),
                ok(|r| r.topology.as_deref() == Some("")),
            ),
            (
                "no kind is fine",
                without(base_md(), &["kind"]),
                ok(|r| r.key.name == "md"),
            ),
            (
                "other kind",
                with(base_md(), &["kind"], json!("MachineSet")),
                Err(r#"kind: expected "MachineDeployment", found "MachineSet""#),
            ),
            (
                "kind number",
                with(base_md(), &["kind"], json!(1)),
                Err("kind: expected a string, found 1"),
            ),
            (
                "not an object",
                json!([base_md()]),
                Err("object: expected an object, found a list"),
            ),
            (
                "null",
                Value::Null,
                Err("object: expected an object, found null"),
            ),
        ];
        for (name, obj, want) in cases {
            let got = ScalableResource::from_json(ScalableKind::MachineDeployment, &keys(), &obj);
            match (want, got) {
                (Ok(check), Ok(r)) => assert!(check(&r), "{name}: unexpected view {r:#?}"),
                (Err(want), Err(e)) => assert_eq!(e.to_string(), want, "{name}"),
                (want, got) => panic!("{name}: want {:?}, got {got:?}", want.map(|_| "Ok")),
            }
        }
    }

    #[test]
    fn cluster_name_label_follows_the_group() {
        let obj = with(
            without(base_md(), &["spec", "clusterName"]),
            &["metadata", "labels"],
            json!({"cluster.x-k8s.io/cluster-name": "default-group", "cluster.example.dev/cluster-name": "renamed"}),
        );
        let default =
            ScalableResource::from_json(ScalableKind::MachineDeployment, &keys(), &obj).unwrap();
        assert_eq!(default.cluster_name, "default-group");
        let renamed = Keys::new("cluster.example.dev");
        let r =
            ScalableResource::from_json(ScalableKind::MachineDeployment, &renamed, &obj).unwrap();
        assert_eq!(r.cluster_name, "renamed");
        let m = Machine::from_json(&renamed, &with(obj, &["kind"], json!("Machine"))).unwrap();
        assert_eq!(m.cluster_name, "renamed");
    }

    #[test]
    fn machinepool_provider_id_list() {
        let mp = |list: Value| {
            let obj = with(
                with(base_md(), &["kind"], json!("MachinePool")),
                &["spec", "providerIDList"],
                list,
            );
            ScalableResource::from_json(ScalableKind::MachinePool, &keys(), &obj)
        };
        let ids = json!(["aws:///us-east-1a/i-1", "", "aws:///us-east-1b/i-2"]);
        assert_eq!(
            mp(ids).unwrap().provider_id_list,
            ["aws:///us-east-1a/i-1", "", "aws:///us-east-1b/i-2"],
            "verbatim, empty entries included"
        );
        assert_eq!(
            mp(Value::Null).unwrap().provider_id_list,
            Vec::<String>::new()
        );
        assert_eq!(
            mp(json!(["a", 1])).unwrap_err().to_string(),
            "spec.providerIDList[1]: expected a string, found 1"
        );
        assert_eq!(
            mp(json!("a")).unwrap_err().to_string(),
            r#"spec.providerIDList: expected a list, found "a""#
        );
    }

    /// `spec.template.spec.infrastructureRef`: v1beta2 `apiGroup`, v1beta1 `apiVersion`, and each way it
    /// can be unusable (kept as `Some(Err)`: the group survives without a template).
    #[test]
    fn infrastructure_ref_cases() {
        const REF: [&str; 4] = ["spec", "template", "spec", "infrastructureRef"];
        let g = "infrastructure.cluster.x-k8s.io";
        type Want = Option<Result<InfraRef, &'static str>>;
        let cases: Vec<(&str, Option<Value>, Want)> = vec![
            ("absent", None, None),
            ("null", Some(Value::Null), None),
            (
                "v1beta2",
                Some(json!({"apiGroup": g, "kind": "DockerMachineTemplate", "name": "t"})),
                Some(Ok(infra(g, None, "DockerMachineTemplate", "t"))),
            ),
            (
                "v1beta1",
                Some(
                    json!({"apiVersion": format!("{g}/v1beta1"), "kind": "AWSMachineTemplate", "name": "t", "namespace": "ns"}),
                ),
                Some(Ok(infra(
                    g,
                    Some("infrastructure.cluster.x-k8s.io/v1beta1"),
                    "AWSMachineTemplate",
                    "t",
                ))),
            ),
            (
                "both: the group comes from apiGroup, the version only if it is of that group",
                Some(
                    json!({"apiGroup": "a.example.com", "apiVersion": "b.example.com/v1", "kind": "K", "name": "t"}),
                ),
                Some(Ok(infra("a.example.com", None, "K", "t"))),
            ),
            (
                "both, same group",
                Some(
                    json!({"apiGroup": "a.example.com", "apiVersion": "a.example.com/v2", "kind": "K", "name": "t"}),
                ),
                Some(Ok(infra(
                    "a.example.com",
                    Some("a.example.com/v2"),
                    "K",
                    "t",
                ))),
            ),
            (
                "empty apiGroup falls back to apiVersion",
                Some(
                    json!({"apiGroup": "", "apiVersion": "b.example.com/v1", "kind": "K", "name": "t"}),
                ),
                Some(Ok(infra(
                    "b.example.com",
                    Some("b.example.com/v1"),
                    "K",
                    "t",
                ))),
            ),
            (
                "no kind",
                Some(json!({"apiGroup": g, "name": "t"})),
                Some(Err(
                    "spec.template.spec.infrastructureRef.kind: missing required field",
                )),
            ),
            (
                "empty kind",
                Some(json!({"apiGroup": g, "kind": "", "name": "t"})),
                Some(Err(
                    "spec.template.spec.infrastructureRef.kind: must not be empty",
                )),
            ),
            (
                "kind number",
                Some(json!({"apiGroup": g, "kind": 5, "name": "t"})),
                Some(Err(
                    "spec.template.spec.infrastructureRef.kind: expected a string, found 5",
                )),
            ),
            (
                "no name",
                Some(json!({"apiGroup": g, "kind": "K"})),
                Some(Err(
                    "spec.template.spec.infrastructureRef.name: missing required field",
                )),
            ),
            (
                "neither group nor version",
                Some(json!({"kind": "K", "name": "t"})),
                Some(Err(
                    "spec.template.spec.infrastructureRef: names neither apiGroup nor apiVersion",
                )),
            ),
            (
                "apiGroup number",
                Some(json!({"apiGroup": 1, "kind": "K", "name": "t"})),
                Some(Err(
                    "spec.template.spec.infrastructureRef.apiGroup: expected a string, found 1",
                )),
            ),
            (
                "malformed apiVersion",
                Some(json!({"apiVersion": "a/b/c", "kind": "K", "name": "t"})),
                Some(Err(
                    r#"spec.template.spec.infrastructureRef.apiVersion: expected "group/version", found "a/b/c""#,
                )),
            ),
            (
                "apiVersion without version",
                Some(json!({"apiVersion": "example.com/", "kind": "K", "name": "t"})),
                Some(Err(
                    r#"spec.template.spec.infrastructureRef.apiVersion: expected "group/version", found "example.com/""#,
                )),
            ),
            (
                "not an object",
                Some(json!("DockerMachineTemplate/t")),
                Some(Err(
                    r#"spec.template.spec.infrastructureRef: expected an object, found "DockerMachineTemplate/t""#,
                )),
            ),
        ];
        for (name, r, want) in cases {
            let obj = match r {
                Some(v) => with(base_md(), &REF, v),
                None => base_md(),
            };
            let got = ScalableResource::from_json(ScalableKind::MachineDeployment, &keys(), &obj)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .template
                .infrastructure_ref
                .map(|r| r.map_err(|e| e.to_string()));
            assert_eq!(got, want.map(|w| w.map_err(str::to_string)), "{name}");
        }
    }

    #[test]
    fn split_api_version_cases() {
        let cases = [
            (
                "infrastructure.cluster.x-k8s.io/v1beta2",
                Some(("infrastructure.cluster.x-k8s.io", "v1beta2")),
            ),
            ("v1", Some(("", "v1"))),
            ("", None),
            ("/v1", None),
            ("g/", None),
            ("a/b/c", None),
        ];
        for (input, want) in cases {
            assert_eq!(split_api_version(input), want, "{input:?}");
        }
    }

    // -----------------------------------------------------------------------------------------------
    // Machines

    #[test]
    fn machine_fixtures() {
        struct Row {
            file: &'static str,
            key: (&'static str, &'static str),
            cluster: &'static str,
            provider_id: Option<&'static str>,
            node_ref: Option<&'static str>,
            deleting: bool,
            phase: Option<&'static str>,
            failure: Option<(&'static str, &'static str)>,
        }
        let rows = [
            Row {
                file: "machine-v1beta2-running.json",
                key: ("team-a", "workers-md-0-5f8c9-abcde"),
                cluster: "prod",
                provider_id: Some("docker:////prod-workers-md-0-5f8c9-abcde"),
                node_ref: Some("prod-workers-md-0-5f8c9-abcde"),
                deleting: false,
                phase: Some("Running"),
                failure: None,
            },
            Row {
                file: "machine-v1beta2-failed-deprecated.json",
                key: ("team-a", "workers-md-0-5f8c9-fffff"),
                cluster: "prod",
                provider_id: None,
                node_ref: None,
                deleting: false,
                phase: Some("Provisioning"),
                failure: Some((
                    "InsufficientResources",
                    "Failure detected from referenced resource infrastructure.cluster.x-k8s.io/v1beta2, \
                     Kind=AWSMachine with name \"workers-md-0-5f8c9-fffff\": InsufficientInstanceCapacity",
                )),
            },
            Row {
                file: "machine-v1beta2-infra-deleted.json",
                key: ("team-a", "workers-md-0-5f8c9-ggggg"),
                cluster: "prod",
                provider_id: Some("docker:////prod-workers-md-0-5f8c9-ggggg"),
                node_ref: Some("prod-workers-md-0-5f8c9-ggggg"),
                deleting: false,
                phase: Some("Running"),
                failure: Some((
                    "InfrastructureDeleted",
                    "DockerMachine has been deleted while the Machine still exists",
                )),
            },
            Row {
                // InfrastructureReady=False/ObjectDoesNotExist is where every new Machine starts: not a failure.
                file: "machine-v1beta2-pending.json",
                key: ("team-a", "pool-less-xyz12"),
                cluster: "prod",
                provider_id: None,
                node_ref: None,
                deleting: false,
                phase: Some("Pending"),
                failure: None,
            },
            Row {
                // InfrastructureReady=False/ObjectDeleted during deletion is routine: not a failure.
                file: "machine-v1beta2-deleting.json",
                key: ("team-a", "workers-md-0-5f8c9-hhhhh"),
                cluster: "prod",
                provider_id: Some("docker:////prod-workers-md-0-5f8c9-hhhhh"),
                node_ref: Some("prod-workers-md-0-5f8c9-hhhhh"),
                deleting: true,
                phase: Some("Deleting"),
                failure: None,
            },
            Row {
                file: "machine-v1beta1-running.json",
                key: ("team-b", "legacy-md-7c6b5-q2w3e"),
                cluster: "legacy",
                provider_id: Some("aws:///us-west-2a/i-0aaaabbbbccccdddd"),
                node_ref: Some("ip-10-1-2-3.us-west-2.compute.internal"),
                deleting: false,
                phase: Some("Running"),
                failure: None,
            },
            Row {
                file: "machine-v1beta1-failed.json",
                key: ("team-b", "legacy-md-7c6b5-zzzzz"),
                cluster: "legacy",
                provider_id: None,
                node_ref: None,
                deleting: false,
                phase: Some("Failed"),
                failure: Some((
                    "CreateError",
                    "Failure detected from referenced resource infrastructure.cluster.x-k8s.io/v1beta2, \
                     Kind=AWSMachine with name \"legacy-md-7c6b5-zzzzz\": instance i-0dead terminated",
                )),
            },
        ];
        for row in rows {
            let f = row.file;
            let m = Machine::from_json(&keys(), &fixture(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
            assert_eq!(m.key, ObjectKey::new(row.key.0, row.key.1), "{f}");
            assert!(!m.uid.is_empty() && !m.resource_version.is_empty(), "{f}");
            assert_eq!(m.cluster_name, row.cluster, "{f}");
            assert_eq!(m.provider_id.as_deref(), row.provider_id, "{f}");
            assert_eq!(m.node_ref.as_deref(), row.node_ref, "{f}");
            assert_eq!(m.deleting, row.deleting, "{f}");
            assert_eq!(m.phase.as_deref(), row.phase, "{f}");
            assert_eq!(
                m.failure,
                row.failure.map(|(reason, message)| MachineFailure {
                    reason: reason.into(),
                    message: message.into()
                }),
                "{f}"
            );
            assert_eq!(m.owners.len(), 1, "{f}");
            assert_eq!(m.owners[0].kind, "MachineSet", "{f}");
        }
    }

    fn base_machine() -> Value {
        json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2",
            "kind": "Machine",
            "metadata": {"namespace": "ns", "name": "m", "labels": {"cluster.x-k8s.io/cluster-name": "c"}},
            "spec": {"clusterName": "c"},
        })
    }

    #[test]
    fn machine_field_cases() {
        type Check = fn(&Machine) -> bool;
        let ok = |c: Check| Ok::<Check, &str>(c);
        fn failure(m: &Machine, reason: &str, message: &str) -> bool {
            m.failure
                == Some(MachineFailure {
                    reason: reason.into(),
                    message: message.into(),
                })
        }
        let cond = |t: &str, s: &str, r: &str| json!({"type": t, "status": s, "reason": r, "message": "gone", "lastTransitionTime": "2026-01-01T00:00:00Z"});
        let cases: Vec<(&str, Value, Result<Check, &str>)> = vec![
            (
                "minimal",
                base_machine(),
                ok(|m| {
                    m.provider_id.is_none()
                        && m.node_ref.is_none()
                        && !m.deleting
                        && m.phase.is_none()
                        && m.failure.is_none()
                        && m.cluster_name == "c"
                }),
            ),
            (
                "providerID",
                with(base_machine(), &["spec", "providerID"], json!("p://1")),
                ok(|m| m.provider_id.as_deref() == Some("p://1")),
            ),
            (
                "empty providerID",
                with(base_machine(), &["spec", "providerID"], json!("")),
                ok(|m| m.provider_id.is_none()),
            ),
            (
                "providerID number",
                with(base_machine(), &["spec", "providerID"], json!(1)),
                Err("spec.providerID: expected a string, found 1"),
            ),
            (
                "v1beta1 nodeRef",
                with(
                    base_machine(),
                    &["status", "nodeRef"],
                    json!({"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "u"}),
                ),
                ok(|m| m.node_ref.as_deref() == Some("n1")),
            ),
            (
                "v1beta2 nodeRef",
                with(
                    base_machine(),
                    &["status", "nodeRef"],
                    json!({"name": "n2"}),
                ),
                ok(|m| m.node_ref.as_deref() == Some("n2")),
            ),
            (
                "nodeRef without name",
                with(base_machine(), &["status", "nodeRef"], json!({})),
                ok(|m| m.node_ref.is_none()),
            ),
            (
                "nodeRef string",
                with(base_machine(), &["status", "nodeRef"], json!("n1")),
                Err(r#"status.nodeRef: expected an object, found "n1""#),
            ),
            (
                "nodeRef name number",
                with(base_machine(), &["status", "nodeRef", "name"], json!(3)),
                Err("status.nodeRef.name: expected a string, found 3"),
            ),
            (
                "status not an object",
                with(base_machine(), &["status"], json!(true)),
                Err("status: expected an object, found true"),
            ),
            (
                "deleting",
                with(
                    base_machine(),
                    &["metadata", "deletionTimestamp"],
                    json!("2026-01-01T00:00:00Z"),
                ),
                ok(|m| m.deleting),
            ),
            (
                "deletionTimestamp null",
                with(
                    base_machine(),
                    &["metadata", "deletionTimestamp"],
                    Value::Null,
                ),
                ok(|m| !m.deleting),
            ),
            (
                "deletionTimestamp number",
                with(base_machine(), &["metadata", "deletionTimestamp"], json!(0)),
                Err("metadata.deletionTimestamp: expected a string, found 0"),
            ),
            (
                "phase",
                with(base_machine(), &["status", "phase"], json!("Provisioned")),
                ok(|m| m.phase.as_deref() == Some("Provisioned") && m.failure.is_none()),
            ),
            (
                "phase Failed alone",
                with(base_machine(), &["status", "phase"], json!("Failed")),
                ok(|m| failure(m, "Failed", "status.phase is Failed")),
            ),
            (
                "phase number",
                with(base_machine(), &["status", "phase"], json!(1)),
                Err("status.phase: expected a string, found 1"),
            ),
            (
                "v1beta1 failureMessage alone",
                with(base_machine(), &["status", "failureMessage"], json!("boom")),
                ok(|m| failure(m, "", "boom")),
            ),
            (
                "v1beta1 failureReason alone",
                with(
                    base_machine(),
                    &["status", "failureReason"],
                    json!("CreateError"),
                ),
                ok(|m| failure(m, "CreateError", "")),
            ),
            (
                "v1beta1 failure fields empty",
                with(
                    with(base_machine(), &["status", "failureReason"], json!("")),
                    &["status", "failureMessage"],
                    json!(""),
                ),
                ok(|m| m.failure.is_none()),
            ),
            (
                "failureMessage number",
                with(base_machine(), &["status", "failureMessage"], json!(1)),
                Err("status.failureMessage: expected a string, found 1"),
            ),
            (
                "v1beta2 deprecated failure",
                with(
                    base_machine(),
                    &["status", "deprecated", "v1beta1"],
                    json!({"failureReason": "UpdateError", "failureMessage": "m"}),
                ),
                ok(|m| failure(m, "UpdateError", "m")),
            ),
            (
                "deprecated wrong type",
                with(base_machine(), &["status", "deprecated"], json!([])),
                Err("status.deprecated: expected an object, found a list"),
            ),
            (
                "v1beta1 fields win over the deprecated ones",
                with(
                    with(base_machine(), &["status", "failureReason"], json!("A")),
                    &["status", "deprecated", "v1beta1", "failureReason"],
                    json!("B"),
                ),
                ok(|m| failure(m, "A", "")),
            ),
            (
                "a failure on a deleting Machine is kept",
                with(
                    with(base_machine(), &["status", "failureMessage"], json!("boom")),
                    &["metadata", "deletionTimestamp"],
                    json!("2026-01-01T00:00:00Z"),
                ),
                ok(|m| m.deleting && failure(m, "", "boom")),
            ),
            (
                "InfrastructureReady=False/ObjectDeleted",
                with(
                    base_machine(),
                    &["status", "conditions"],
                    json!([cond("InfrastructureReady", "False", "ObjectDeleted")]),
                ),
                ok(|m| failure(m, "InfrastructureDeleted", "gone")),
            ),
            (
                "... without a message",
                with(
                    base_machine(),
                    &["status", "conditions"],
                    json!([{"type": "InfrastructureReady", "status": "False", "reason": "ObjectDeleted", "message": ""}]),
                ),
                ok(|m| {
                    failure(
                        m,
                        "InfrastructureDeleted",
                        "the infrastructure machine was deleted while the Machine still exists",
                    )
                }),
            ),
            (
                "... in status.v1beta2.conditions of a v1beta1 Machine",
                with(
                    base_machine(),
                    &["status", "v1beta2", "conditions"],
                    json!([cond("InfrastructureReady", "False", "ObjectDeleted")]),
                ),
                ok(|m| failure(m, "InfrastructureDeleted", "gone")),
            ),
            (
                "... but not while deleting",
                with(
                    with(
                        base_machine(),
                        &["status", "conditions"],
                        json!([cond("InfrastructureReady", "False", "ObjectDeleted")]),
                    ),
                    &["metadata", "deletionTimestamp"],
                    json!("2026-01-01T00:00:00Z"),
                ),
                ok(|m| m.deleting && m.failure.is_none()),
            ),
            (
                "InfrastructureReady=Unknown/ObjectDeleted is not a failure",
                with(
                    base_machine(),
                    &["status", "conditions"],
                    json!([cond("InfrastructureReady", "Unknown", "ObjectDeleted")]),
                ),
                ok(|m| m.failure.is_none()),
            ),
            (
                "InfrastructureReady=False/ObjectDoesNotExist is not a failure",
                with(
                    base_machine(),
                    &["status", "conditions"],
                    json!([cond("InfrastructureReady", "False", "ObjectDoesNotExist")]),
                ),
                ok(|m| m.failure.is_none()),
            ),
            (
                "BootstrapConfigReady=False/ObjectDeleted is not a failure",
                with(
                    base_machine(),
                    &["status", "conditions"],
                    json!([cond("BootstrapConfigReady", "False", "ObjectDeleted")]),
                ),
                ok(|m| m.failure.is_none()),
            ),
            (
                "malformed condition items are skipped",
                with(
                    base_machine(),
                    &["status", "conditions"],
                    json!(["x", 1, null, {"type": 1}, cond("InfrastructureReady", "False", "ObjectDeleted")]),
                ),
                ok(|m| failure(m, "InfrastructureDeleted", "gone")),
            ),
            (
                "conditions not a list",
                with(
                    base_machine(),
                    &["status", "conditions"],
                    json!({"InfrastructureReady": "False"}),
                ),
                Err("status.conditions: expected a list, found an object"),
            ),
            (
                "a condition wins over phase Failed",
                with(
                    with(
                        base_machine(),
                        &["status", "conditions"],
                        json!([cond("InfrastructureReady", "False", "ObjectDeleted")]),
                    ),
                    &["status", "phase"],
                    json!("Failed"),
                ),
                ok(|m| failure(m, "InfrastructureDeleted", "gone")),
            ),
            (
                "owners",
                with(
                    base_machine(),
                    &["metadata", "ownerReferences"],
                    json!([{"kind": "MachineSet", "name": "ms"}]),
                ),
                ok(|m| m.owners == [owner("MachineSet", "ms")]),
            ),
            (
                "other kind",
                with(base_machine(), &["kind"], json!("MachineSet")),
                Err(r#"kind: expected "Machine", found "MachineSet""#),
            ),
            (
                "no metadata",
                without(base_machine(), &["metadata"]),
                Err("metadata: missing required field"),
            ),
            (
                "not an object",
                json!("m"),
                Err(r#"object: expected an object, found "m""#),
            ),
        ];
        for (name, obj, want) in cases {
            match (want, Machine::from_json(&keys(), &obj)) {
                (Ok(check), Ok(m)) => assert!(check(&m), "{name}: unexpected view {m:#?}"),
                (Err(want), Err(e)) => assert_eq!(e.to_string(), want, "{name}"),
                (want, got) => panic!("{name}: want {:?}, got {got:?}", want.map(|_| "Ok")),
            }
        }
    }

    // -----------------------------------------------------------------------------------------------
    // Infrastructure templates

    #[test]
    fn infra_template_fixtures() {
        let docker =
            InfraTemplate::from_json(&fixture("dockermachinetemplate-v1beta2.json")).unwrap();
        assert_eq!(
            docker,
            InfraTemplate {
                key: ObjectKey::new("team-a", "workers-md-0-7d9f4"),
                api_group: "infrastructure.cluster.x-k8s.io".into(),
                kind: "DockerMachineTemplate".into(),
                capacity: map(&[
                    ("cpu", "2"),
                    ("memory", "4Gi"),
                    ("ephemeral-storage", "20Gi"),
                    ("nvidia.com/gpu", "1")
                ]),
                architecture: Some("arm64".into()),
                operating_system: Some("linux".into()),
            }
        );
        let aws = InfraTemplate::from_json(&fixture("awsmachinetemplate-v1beta2.json")).unwrap();
        assert_eq!(aws.key, ObjectKey::new("team-b", "legacy-md-m5large"));
        assert_eq!(aws.kind, "AWSMachineTemplate");
        assert_eq!(aws.capacity, map(&[("cpu", "2"), ("memory", "8Gi")]));
        assert_eq!((aws.architecture, aws.operating_system), (None, None));
    }

    #[test]
    fn infra_template_field_cases() {
        let base = || {
            json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
                "kind": "FooMachineTemplate",
                "metadata": {"namespace": "ns", "name": "t"},
            })
        };
        type Check = fn(&InfraTemplate) -> bool;
        let ok = |c: Check| Ok::<Check, &str>(c);
        let cases: Vec<(&str, Value, Result<Check, &str>)> = vec![
            (
                "minimal",
                base(),
                ok(|t| {
                    t.capacity.is_empty()
                        && t.architecture.is_none()
                        && t.api_group == "infrastructure.cluster.x-k8s.io"
                        && t.kind == "FooMachineTemplate"
                }),
            ),
            (
                "non-string capacity values are skipped",
                with(
                    base(),
                    &["status", "capacity"],
                    json!({"cpu": 4, "memory": "8Gi", "pods": null, "x": {}}),
                ),
                ok(|t| t.capacity == map(&[("memory", "8Gi")])),
            ),
            (
                "capacity a list",
                with(base(), &["status", "capacity"], json!(["cpu=4"])),
                Err("status.capacity: expected an object, found a list"),
            ),
            (
                "capacity null",
                with(base(), &["status", "capacity"], Value::Null),
                ok(|t| t.capacity.is_empty()),
            ),
            (
                "nodeInfo",
                with(
                    base(),
                    &["status", "nodeInfo"],
                    json!({"architecture": "s390x", "operatingSystem": "linux", "kernel": 6}),
                ),
                ok(|t| {
                    t.architecture.as_deref() == Some("s390x")
                        && t.operating_system.as_deref() == Some("linux")
                }),
            ),
            (
                "empty architecture",
                with(base(), &["status", "nodeInfo", "architecture"], json!("")),
                ok(|t| t.architecture.is_none()),
            ),
            (
                "architecture number",
                with(base(), &["status", "nodeInfo", "architecture"], json!(64)),
                Err("status.nodeInfo.architecture: expected a string, found 64"),
            ),
            (
                "nodeInfo a string",
                with(base(), &["status", "nodeInfo"], json!("linux/amd64")),
                Err(r#"status.nodeInfo: expected an object, found "linux/amd64""#),
            ),
            (
                "no apiVersion",
                without(base(), &["apiVersion"]),
                Err("apiVersion: missing required field"),
            ),
            (
                "bad apiVersion",
                with(
                    base(),
                    &["apiVersion"],
                    json!("infrastructure.cluster.x-k8s.io/"),
                ),
                Err(
                    r#"apiVersion: expected "group/version", found "infrastructure.cluster.x-k8s.io/""#,
                ),
            ),
            (
                "no kind",
                without(base(), &["kind"]),
                Err("kind: missing required field"),
            ),
            (
                "no metadata",
                without(base(), &["metadata"]),
                Err("metadata: missing required field"),
            ),
            (
                "not an object",
                json!(1),
                Err("object: expected an object, found 1"),
            ),
        ];
        for (name, obj, want) in cases {
            match (want, InfraTemplate::from_json(&obj)) {
                (Ok(check), Ok(t)) => assert!(check(&t), "{name}: unexpected view {t:#?}"),
                (Err(want), Err(e)) => assert_eq!(e.to_string(), want, "{name}"),
                (want, got) => panic!("{name}: want {:?}, got {got:?}", want.map(|_| "Ok")),
            }
        }
    }

    // -----------------------------------------------------------------------------------------------
    // Nodes

    #[test]
    fn node_from_k8s() {
        use k8s_openapi::api::core::v1::{Node as K8sNode, NodeSpec};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        let node = |name: Option<&str>,
                    pid: Option<&str>,
                    labels: Option<&[(&str, &str)]>,
                    spec: bool| K8sNode {
            metadata: ObjectMeta {
                name: name.map(Into::into),
                labels: labels.map(map),
                ..Default::default()
            },
            spec: spec.then(|| NodeSpec {
                provider_id: pid.map(Into::into),
                ..Default::default()
            }),
            status: None,
        };
        let cases = [
            (
                node(
                    Some("n1"),
                    Some("aws:///a/i-1"),
                    Some(&[("kubernetes.io/arch", "amd64")]),
                    true,
                ),
                Node {
                    name: "n1".into(),
                    provider_id: Some("aws:///a/i-1".into()),
                    labels: map(&[("kubernetes.io/arch", "amd64")]),
                },
            ),
            (
                node(Some("n2"), Some(""), None, true),
                Node {
                    name: "n2".into(),
                    provider_id: None,
                    labels: BTreeMap::new(),
                },
            ),
            (
                node(Some("n3"), None, None, false),
                Node {
                    name: "n3".into(),
                    ..Node::default()
                },
            ),
            (node(None, None, None, false), Node::default()),
        ];
        for (input, want) in cases {
            assert_eq!(Node::from_k8s(&input), want);
        }
    }

    // -----------------------------------------------------------------------------------------------
    // Malformed shapes: no panic, and every error names the field that is wrong.

    /// A segment of a path into a JSON value.
    #[derive(Clone, Debug)]
    enum Seg {
        Key(String),
        Index(usize),
    }

    /// Every path to a value inside `v` (not the root itself).
    fn paths(v: &Value, prefix: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
        match v {
            Value::Object(m) => {
                for (k, child) in m {
                    prefix.push(Seg::Key(k.clone()));
                    out.push(prefix.clone());
                    paths(child, prefix, out);
                    prefix.pop();
                }
            }
            Value::Array(a) => {
                for (i, child) in a.iter().enumerate() {
                    prefix.push(Seg::Index(i));
                    out.push(prefix.clone());
                    paths(child, prefix, out);
                    prefix.pop();
                }
            }
            _ => {}
        }
    }

    /// Replaces (`Some`) or removes (`None`) the value at `path`.
    fn mutate(root: &Value, path: &[Seg], new: Option<&Value>) -> Value {
        let mut out = root.clone();
        let (last, parents) = path.split_last().unwrap();
        let mut current = &mut out;
        for seg in parents {
            current = match seg {
                Seg::Key(k) => &mut current[k.as_str()],
                Seg::Index(i) => &mut current[*i],
            };
        }
        match (last, new) {
            (Seg::Key(k), Some(v)) => current[k.as_str()] = v.clone(),
            (Seg::Key(k), None) => {
                current.as_object_mut().unwrap().remove(k);
            }
            (Seg::Index(i), Some(v)) => current[*i] = v.clone(),
            (Seg::Index(i), None) => {
                current.as_array_mut().unwrap().remove(*i);
            }
        }
        out
    }

    /// The segments of an error's field path: `a.b[key.with.dots][0].c` → a, b, key.with.dots, 0, c.
    fn field_segments(field: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = field;
        while !rest.is_empty() {
            if let Some(inner) = rest.strip_prefix('[') {
                let end = inner.find(']').expect("closing bracket");
                out.push(inner[..end].to_string());
                rest = &inner[end + 1..];
            } else {
                let rest_trimmed = rest.strip_prefix('.').unwrap_or(rest);
                let end = rest_trimmed.find(['.', '[']).unwrap_or(rest_trimmed.len());
                out.push(rest_trimmed[..end].to_string());
                rest = &rest_trimmed[end..];
            }
        }
        out
    }

    fn seg_strings(path: &[Seg]) -> Vec<String> {
        path.iter()
            .map(|s| match s {
                Seg::Key(k) => k.clone(),
                Seg::Index(i) => i.to_string(),
            })
            .collect()
    }

    #[test]
    fn field_segments_cases() {
        assert_eq!(field_segments("spec.replicas"), ["spec", "replicas"]);
        assert_eq!(
            field_segments("metadata.labels[cluster.x-k8s.io/cluster-name]"),
            ["metadata", "labels", "cluster.x-k8s.io/cluster-name"]
        );
        assert_eq!(
            field_segments("metadata.ownerReferences[1].kind"),
            ["metadata", "ownerReferences", "1", "kind"]
        );
    }

    /// All three parsers on one value; every error (including a kept infrastructureRef error) must be
    /// well formed. Returns the error fields.
    fn parse_all(v: &Value) -> Vec<String> {
        let mut fields = Vec::new();
        let mut record = |e: &ParseError| {
            assert!(
                !e.field.is_empty() && !e.message.is_empty(),
                "bad error {e:?}"
            );
            assert_eq!(e.to_string(), format!("{}: {}", e.field, e.message));
            fields.push(e.field.clone());
        };
        for kind in ScalableKind::ALL {
            match ScalableResource::from_json(kind, &keys(), v) {
                Ok(r) => {
                    if let Some(Err(e)) = &r.template.infrastructure_ref {
                        record(e);
                    }
                }
                Err(e) => record(&e),
            }
        }
        if let Err(e) = Machine::from_json(&keys(), v) {
            record(&e);
        }
        if let Err(e) = InfraTemplate::from_json(v) {
            record(&e);
        }
        fields
    }

    /// Every fixture, every value inside it replaced by each of a set of odd values (or removed): no
    /// panic, and any error that was not there before names the changed field, a field inside it, or
    /// the object holding it.
    #[test]
    fn fuzzish_single_mutations() {
        let odd = [
            Value::Null,
            json!(true),
            json!(0),
            json!(-1),
            json!(1.5),
            json!(1_u64 << 40),
            json!(u64::MAX),
            json!(""),
            json!("three"),
            json!("ünïcødé/🚀:="),
            json!("x".repeat(300)),
            json!([]),
            json!([1, "a", null, {}]),
            json!({}),
            json!({"a": 1, "name": [], "kind": {}}),
        ];
        let mut parsed = 0usize;
        for (name, text) in FIXTURES {
            let original: Value = serde_json::from_str(text).unwrap();
            let before: std::collections::BTreeSet<String> =
                parse_all(&original).into_iter().collect();
            let mut all = Vec::new();
            paths(&original, &mut Vec::new(), &mut all);
            for path in &all {
                let changed = seg_strings(path);
                for new in odd.iter().map(Some).chain([None]) {
                    let v = mutate(&original, path, new);
                    for field in parse_all(&v) {
                        parsed += 1;
                        if before.contains(&field) {
                            continue;
                        }
                        let got = field_segments(&field);
                        let related = got.starts_with(&changed) || changed.starts_with(&got);
                        assert!(
                            related || (field == "kind" && changed == ["kind"]),
                            "{name}: changing {changed:?} to {new:?} gave an error about {field}"
                        );
                    }
                }
            }
        }
        assert!(parsed > 1000, "only {parsed} errors seen");
    }

    /// Deterministic pseudo-random JSON made of the keys the parsers look for: no panic, well-formed
    /// errors.
    #[test]
    fn fuzzish_random_shapes() {
        struct Rng(u64);
        impl Rng {
            fn next(&mut self) -> u64 {
                // xorshift64*
                self.0 ^= self.0 >> 12;
                self.0 ^= self.0 << 25;
                self.0 ^= self.0 >> 27;
                self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
            }
            fn below(&mut self, n: usize) -> usize {
                (self.next() % n as u64) as usize
            }
        }
        const KEYS: &[&str] = &[
            "apiVersion",
            "kind",
            "metadata",
            "name",
            "namespace",
            "uid",
            "resourceVersion",
            "labels",
            "annotations",
            "ownerReferences",
            "deletionTimestamp",
            "spec",
            "status",
            "replicas",
            "paused",
            "clusterName",
            "template",
            "infrastructureRef",
            "apiGroup",
            "taints",
            "key",
            "value",
            "effect",
            "failureDomain",
            "providerIDList",
            "providerID",
            "nodeRef",
            "phase",
            "failureReason",
            "failureMessage",
            "deprecated",
            "v1beta1",
            "v1beta2",
            "conditions",
            "type",
            "reason",
            "message",
            "capacity",
            "nodeInfo",
            "architecture",
            "operatingSystem",
            "cluster.x-k8s.io/paused",
            "cluster.x-k8s.io/cluster-name",
            "topology.cluster.x-k8s.io/owned",
        ];
        const STRINGS: &[&str] = &[
            "",
            "x",
            "Failed",
            "False",
            "InfrastructureReady",
            "ObjectDeleted",
            "MachineDeployment",
            "Machine",
            "MachinePool",
            "MachineSet",
            "g/v",
            "a/b/c",
            "/",
            "v1",
            "2026-01-01T00:00:00Z",
            "💥",
        ];
        fn random_value(rng: &mut Rng, depth: usize) -> Value {
            let choice = if depth == 0 {
                rng.below(6)
            } else {
                rng.below(9)
            };
            match choice {
                0 => Value::Null,
                1 => json!(rng.below(2) == 0),
                2 => json!(rng.next() as i64),
                3 => json!((rng.next() % 1000) as f64 / 7.0),
                4 | 5 => json!(STRINGS[rng.below(STRINGS.len())]),
                6 => Value::Array(
                    (0..rng.below(4))
                        .map(|_| random_value(rng, depth - 1))
                        .collect(),
                ),
                _ => Value::Object(
                    (0..rng.below(6))
                        .map(|_| {
                            (
                                KEYS[rng.below(KEYS.len())].to_string(),
                                random_value(rng, depth - 1),
                            )
                        })
                        .collect(),
                ),
            }
        }
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut ok = 0;
        for _ in 0..20_000 {
            let mut v = random_value(&mut rng, 6);
            // Often give it a readable skeleton so that the parsers get past metadata.
            if rng.below(2) == 0 && v.is_object() {
                v["metadata"] = json!({"namespace": "ns", "name": "n"});
                if rng.below(2) == 0 {
                    v["apiVersion"] = json!("g/v1");
                    v["kind"] = json!("K");
                }
            }
            if parse_all(&v).len() < 5 {
                ok += 1;
            }
        }
        assert!(
            ok > 100,
            "the generator should reach successful parses too ({ok})"
        );
    }
}
