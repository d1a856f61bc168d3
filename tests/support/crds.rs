//! Installs CRDs by server-side apply and waits until every served version really serves.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Api, Client};
use serde::Deserialize as _;

use super::control_plane::{CrdSet, Setup};
use super::procs::{Check, poll_until};

const FIELD_MANAGER: &str = "capi-e2e";

/// The CRD files of `setup` in the upstream cache dir (the e2e template CRD not included).
pub fn files(upstream: &Path, setup: Setup) -> Vec<PathBuf> {
    let mut sets = vec![match setup.crds {
        CrdSet::Shipped => "shipped",
        CrdSet::V1beta1 => "v1beta1",
    }];
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
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value = serde_yaml::Value::deserialize(doc)
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
pub async fn install(client: &Client, files: &[PathBuf]) -> Result<(), String> {
    let mut docs = Vec::new();
    for file in files {
        docs.extend(read(file)?);
    }
    let jobs = docs.into_iter().map(|doc| install_one(client.clone(), doc));
    futures::future::try_join_all(jobs).await?;
    Ok(())
}

async fn install_one(client: Client, doc: serde_json::Value) -> Result<(), String> {
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
    Ok(())
}

fn established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}
