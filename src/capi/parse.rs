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

use super::rollout::ROLLING_OUT_CONDITION;
use super::{
    ClusterTopology, InfraRef, InfraTemplate, Keys, Machine, MachineFailure, MachineTemplate, Name,
    Node, ObjectKey, OwnerRef, PAUSED_ANNOTATION, ScalableKind, ScalableResource, Taint,
    TopologyWorker,
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
/// A copy of the whole object that `kubectl apply` leaves; never read, often the largest annotation.
const LAST_APPLIED_ANNOTATION: &str = "kubectl.kubernetes.io/last-applied-configuration";
/// Label on objects managed by a ClusterClass topology.
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
        let status_replicas = opt_i32(obj, &["status", "replicas"])?;
        let generation = opt_i64(obj, &["metadata", "generation"])?;
        let observed_generation = opt_i64(obj, &["status", "observedGeneration"])?;
        let rolling_out = kind == ScalableKind::MachineDeployment
            && condition_has_status(obj, ROLLING_OUT_CONDITION, "True")?;
        let preflight = match kind {
            ScalableKind::MachineSet => preflight_hold(obj)?,
            _ => None,
        };
        // A MachineDeployment's own `spec.paused` pauses only its rollouts: Cluster API still
        // scales it, so it is no pause of the group.
        let paused = meta.annotations.contains_key(PAUSED_ANNOTATION);
        let template = MachineTemplate {
            labels: string_map(obj, &["spec", "template", "metadata", "labels"])?
                .into_iter()
                .collect(),
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
            labels: meta.labels.into_iter().collect(),
            annotations: meta.annotations.into_iter().collect(),
            cluster_name,
            replicas,
            status_replicas,
            generation,
            observed_generation,
            rolling_out,
            preflight,
            paused,
            owners: meta.owners,
            template,
            provider_id_list,
            topology,
        })
    }
}

/// Whether the v1beta2 condition `type` has `status` (`"True"`, `"False"`): in `status.conditions` of
/// v1beta2 objects, in `status.v1beta2.conditions` of v1beta1 objects as CAPI ≥ 1.9 serves them
/// (v1beta1 `status.conditions` use the same type names for the ones read here). Entries that are
/// not objects are skipped.
fn condition_has_status(obj: &Value, type_: &str, status: &str) -> Result<bool, ParseError> {
    for path in [
        &["status", "conditions"][..],
        &["status", "v1beta2", "conditions"][..],
    ] {
        let Some(conditions) = opt_array(obj, path)? else {
            continue;
        };
        if conditions.iter().filter_map(Value::as_object).any(|c| {
            c.get("type").and_then(Value::as_str) == Some(type_)
                && c.get("status").and_then(Value::as_str) == Some(status)
        }) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The preflight hold a MachineSet's conditions report (see `crate::capi::preflight`): v1beta2 conditions
/// in `status.conditions` (v1beta2) or `status.v1beta2.conditions` (v1beta1), the deprecated v1beta1
/// ones in `status.deprecated.v1beta1.conditions` (v1beta2) or `status.conditions` (v1beta1). Entries
/// that are not objects, or whose fields are not strings, are skipped.
fn preflight_hold(
    obj: &Value,
) -> Result<Option<crate::capi::preflight::PreflightHold>, ParseError> {
    let mut conditions = Vec::new();
    for path in [
        &["status", "conditions"][..],
        &["status", "v1beta2", "conditions"][..],
        &["status", "deprecated", "v1beta1", "conditions"][..],
    ] {
        let Some(list) = opt_array(obj, path)? else {
            continue;
        };
        for c in list.iter().filter_map(Value::as_object) {
            let text = |key: &str| c.get(key).and_then(Value::as_str).unwrap_or_default();
            conditions.push(crate::capi::preflight::Condition {
                type_: text("type"),
                status: text("status"),
                reason: text("reason"),
                message: text("message"),
            });
        }
    }
    Ok(crate::capi::preflight::hold_of(&conditions))
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
        let provider_id = non_empty(opt_str(obj, &["spec", "providerID"])?).map(Name::from);
        // v1beta1: a corev1.ObjectReference; v1beta2: {name}. Either way the name is what we need.
        let node_ref = non_empty(opt_str(obj, &["status", "nodeRef", "name"])?);
        let failure_domain = non_empty(opt_str(obj, &["spec", "failureDomain"])?);
        let phase = non_empty(opt_str(obj, &["status", "phase"])?);
        let failure = machine_failure(obj, meta.deleting, phase.as_deref())?;
        // What Cluster API's MachineSet deletion order reads besides the nodeRef
        // (`isMachineHealthy`, machineset_deletion_order.go).
        let conditions_unhealthy = condition_has_status(obj, "NodeHealthy", "False")?
            || condition_has_status(obj, "HealthCheckSucceeded", "False")?;
        // Machines are the many objects: keep only the keys decisions read (all under the group), so
        // e.g. a kubectl last-applied-configuration annotation is not cached ten thousand times.
        let prefix = format!("{}/", keys.group);
        let labels = meta
            .labels
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .collect();
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
            failure_domain,
            deleting: meta.deleting,
            owners: meta.owners,
            phase,
            failure,
            conditions_unhealthy,
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
            paused: opt_bool(obj, &["spec", "paused"])?.unwrap_or(false)
                || meta.annotations.contains_key(PAUSED_ANNOTATION),
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
    /// Name, `spec.providerID` (empty → `None`), the labels named in `kept` and Cluster of a
    /// workload-cluster Node, from its JSON: only these fields are read, the rest of the Node (its
    /// status above all) is never decoded.
    pub fn from_json(keys: &Keys, kept: &[&str], obj: &Value) -> Result<Self, ParseError> {
        root(obj)?;
        let annotation = |key: &str| {
            opt_str(obj, &["metadata", "annotations", key])
                .ok()
                .flatten()
                .filter(|v| !v.is_empty())
        };
        let cluster = match (
            annotation(&keys.node_cluster_namespace),
            annotation(&keys.node_cluster_name),
        ) {
            (Some(namespace), Some(name)) => Some(ObjectKey::new(namespace, Name::interned(name))),
            _ => None,
        };
        let kept_labels = string_map(obj, &["metadata", "labels"])?
            .into_iter()
            .filter(|(k, _)| kept.contains(&k.as_str()));
        Ok(Node {
            name: Name::from(opt_str(obj, &["metadata", "name"])?.unwrap_or_default()),
            provider_id: non_empty(opt_str(obj, &["spec", "providerID"])?).map(Name::from),
            labels: kept_labels.collect(),
            cluster,
        })
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
                kind: Name::interned(&text("kind")?),
                name: Name::interned(&text("name")?),
            })
        })
        .collect()
}

mod path;
use path::{
    describe, dotted, lookup, non_empty, opt_array, opt_bool, opt_i32, opt_i64, opt_str, quote,
    rebase, required_str, root, string_list, string_map,
};

#[cfg(test)]
mod tests;
