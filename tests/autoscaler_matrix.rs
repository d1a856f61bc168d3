//! The compatibility matrix: every pinned cluster-autoscaler release (tests/upstream/
//! cluster-autoscaler.versions) scales a group up from zero and removes the empty node again through
//! the provider, with the real Cluster API manager (v1.14.2, one for the binary) and the stand-in
//! cloud and kubelets: on v1beta2, and for the default CA on v1beta1 as well, the provider reading
//! `--capi-version v1beta1` through CAPI's conversion webhook while storage is v1beta2 (a management
//! cluster upgraded to CAPI 1.14). CA 1.33 reads only the legacy wire fields, 1.35+ only the new
//! ones, 1.34.5 both: every cell must pass. The cells run side by side; the table of results and
//! times is printed before the verdict.

pub mod support;

use std::time::Instant;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;

use support::autoscaler::{default_version, versions};
use support::real_capi_scenario::{RealCapiScenario, scale_up_and_down};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pinned_autoscaler_scales_up_from_zero_and_down_through_real_capi() {
    let mut cells = Vec::new();
    let mut wanted: Vec<(String, &'static str)> =
        versions().into_iter().map(|v| (v, "v1beta2")).collect();
    wanted.push((default_version(), "v1beta1"));
    for (version, capi_version) in wanted {
        let label = format!("CA {version} on {capi_version}");
        cells.push((
            label,
            tokio::spawn(async move {
                let started = Instant::now();
                let name = format!("matrix-{version}-{capi_version}");
                let mut s = RealCapiScenario::new(&name).await;
                if capi_version == "v1beta1" {
                    served_by_conversion(&s).await;
                }
                let args = ["--capi-version", capi_version];
                let times = scale_up_and_down(&mut s, &args, |ca| ca.version(&version)).await;
                s.passed();
                (times, started.elapsed())
            }),
        ));
    }
    let mut failed = Vec::new();
    for (label, cell) in cells {
        let line = match cell.await {
            Ok((t, wall)) => format!(
                "pass (up {:.1}s, bound {:.1}s, down {:.1}s, wall {:.1}s)",
                t.up.as_secs_f64(),
                t.bound.as_secs_f64(),
                t.down.as_secs_f64(),
                wall.as_secs_f64()
            ),
            Err(e) => {
                failed.push(format!("{label}: {e}"));
                "FAIL".to_string()
            }
        };
        support::procs::announce(&format!("e2e: matrix {label}, real CAPI: {line}"));
    }
    assert!(failed.is_empty(), "cells failed:\n{}", failed.join("\n"));
}

/// Fails unless MachineDeployments are stored at v1beta2 and served at v1beta1 through CAPI's
/// conversion webhook, as in a management cluster upgraded to CAPI 1.14.
async fn served_by_conversion(s: &RealCapiScenario) {
    let crds: Api<CustomResourceDefinition> = Api::all(s.client.clone());
    let crd = crds
        .get(&format!("machinedeployments.{}", support::CAPI_GROUP))
        .await
        .unwrap_or_else(|e| s.fail(&format!("get the MachineDeployment CRD: {e}")));
    let versions: Vec<(String, bool, bool)> = crd
        .spec
        .versions
        .iter()
        .map(|v| (v.name.clone(), v.served, v.storage))
        .collect();
    let strategy = crd.spec.conversion.map(|c| c.strategy).unwrap_or_default();
    s.check(
        strategy == "Webhook"
            && versions.contains(&("v1beta1".into(), true, false))
            && versions.contains(&("v1beta2".into(), true, true)),
        &format!("v1beta1 served through the conversion webhook ({strategy}), v1beta2 stored: {versions:?}"),
    );
}
