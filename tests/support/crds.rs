//! Installs CRDs by server-side apply and waits until every served version really serves.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionCondition,
};
use kube::api::{ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Api, Client};
use serde::Deserialize as _;

use super::control_plane::{CrdSet, Setup};
use super::procs::{Check, poll_until};

const FIELD_MANAGER: &str = "capi-e2e";

/// The CRD files of `setup` in the upstream cache dir (the e2e template CRD not included).
pub fn files(upstream: &Path, setup: Setup) -> Vec<PathBuf> {
    let mut sets = match setup.crds {
        CrdSet::Shipped => vec!["shipped"],
        CrdSet::V1beta1 => vec!["v1beta1"],
        CrdSet::RealCapi => vec![],
    };
    if setup.renamed_group {
        sets.push("renamed");
    }
    let mut files = Vec::new();
    for set in sets {
        let dir = upstream.join("crds").join(set);
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("read CRD dir {}: {e}", dir.display()));
        let mut found: Vec<PathBuf> = entries
            .map(|e| e.expect("read a CRD dir entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        assert!(!found.is_empty(), "no CRDs in {}", dir.display());
        found.sort();
        files.extend(found);
    }
    files
}

/// The project's test infrastructure template CRD (`E2EMachineTemplate`).
pub fn e2e_template_crd() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/e2emachinetemplates.yaml")
}

/// The `ApiResource` of every served version of `crd`.
pub fn served_resources(crd: &CustomResourceDefinition) -> Vec<ApiResource> {
    let spec = &crd.spec;
    spec.versions
        .iter()
        .filter(|v| v.served)
        .map(|v| ApiResource {
            group: spec.group.clone(),
            version: v.name.clone(),
            api_version: format!("{}/{}", spec.group, v.name),
            kind: spec.names.kind.clone(),
            plural: spec.names.plural.clone(),
        })
        .collect()
}

/// Reads every CRD document in `file`.
pub fn read(file: &Path) -> Result<Vec<serde_json::Value>, String> {
    let text =
        std::fs::read_to_string(file).map_err(|e| format!("read {}: {e}", file.display()))?;
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(&text) {
        let value = serde_norway::Value::deserialize(doc)
            .map_err(|e| format!("parse {}: {e}", file.display()))?;
        if value.is_null() {
            continue;
        }
        let json =
            serde_json::to_value(value).map_err(|e| format!("convert {}: {e}", file.display()))?;
        docs.push(json);
    }
    Ok(docs)
}

/// Server-side applies the CRDs in `files` (all at once) and waits until each is Established and
/// a list of each served version succeeds.
///
/// Then it waits out the apiserver's "just created" window: a *create* of a custom resource within
/// 2 s of its CRD's Established transition sleeps 2 s in the apiserver (apiextensions-apiserver
/// `customresource_handler.go`, `justCreated`, kept for HA setups). That window is only visible
/// as the condition's lastTransitionTime (whole seconds), so the harness waits until the
/// apiserver's own rule says it is over; otherwise the first create of every test binary would
/// silently take 2 s longer and distort timing assertions.
pub async fn install(client: &Client, files: &[PathBuf]) -> Result<(), String> {
    let mut docs = Vec::new();
    for file in files {
        docs.extend(read(file)?);
    }
    let jobs = docs.into_iter().map(|doc| install_one(client.clone(), doc));
    let established = futures::future::try_join_all(jobs).await?;
    if let Some(latest) = established.into_iter().flatten().max() {
        let window_end = std::time::UNIX_EPOCH
            + Duration::from_secs(u64::try_from(latest.as_second()).unwrap_or(0))
            + Duration::from_secs(2)
            + Duration::from_millis(50);
        if let Ok(remaining) = window_end.duration_since(std::time::SystemTime::now()) {
            tokio::time::sleep(remaining).await;
        }
    }
    Ok(())
}

/// Applies one CRD and waits until it serves; returns when it became Established.
async fn install_one(
    client: Client,
    doc: serde_json::Value,
) -> Result<Option<k8s_openapi::jiff::Timestamp>, String> {
    let name = doc["metadata"]["name"]
        .as_str()
        .ok_or("a CRD document without metadata.name")?
        .to_string();
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&doc),
    )
    .await
    .map_err(|e| format!("apply CRD {name}: {e}"))?;
    let crd = poll_until(
        &format!("CRD {name} Established"),
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            match crds.get(&name).await {
                Ok(crd) if established(&crd) => Check::Done(crd),
                Ok(crd) => Check::Wait(format!("conditions {:?}", crd.status)),
                Err(e) => Check::Wait(e.to_string()),
            }
        },
    )
    .await?;
    for resource in served_resources(&crd) {
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        poll_until(
            &format!("list {} {}", resource.api_version, resource.plural),
            Duration::from_secs(60),
            Duration::from_millis(100),
            || async {
                match api.list(&ListParams::default().limit(1)).await {
                    Ok(_) => Check::Done(()),
                    Err(e) => Check::Wait(e.to_string()),
                }
            },
        )
        .await?;
    }
    Ok(established_condition(&crd).and_then(|c| c.last_transition_time.map(|t| t.0)))
}

fn established_condition(
    crd: &CustomResourceDefinition,
) -> Option<CustomResourceDefinitionCondition> {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|conditions| {
            conditions
                .iter()
                .find(|c| c.type_ == "Established" && c.status == "True")
                .cloned()
        })
}

fn established(crd: &CustomResourceDefinition) -> bool {
    established_condition(crd).is_some()
}
