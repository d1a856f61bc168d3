//! The compatibility matrix: every pinned cluster-autoscaler release (tests/upstream/
//! cluster-autoscaler.versions) scales a group up from zero and removes the empty node again through
//! the provider, with the real Cluster API manager (v1.14.2, one for the binary) and the stand-in
//! cloud and kubelets: on v1beta2, and for the default CA on v1beta1 as well, the provider reading
//! `--capi-version v1beta1` through CAPI's conversion webhook while storage is v1beta2 (a management
//! cluster upgraded to CAPI 1.14). CA 1.33 reads only the legacy wire fields, 1.35+ only the new
//! ones, 1.34.5 both: every cell must pass. The cells run side by side; the table of results and
//! times is printed before the verdict.
//!
//! Beside it the Cluster API matrix: every Cluster API release pinned in tests/upstream/capi (v1.14.2,
//! v1.13.6), each its real manager on a control plane of its own, with the default (newest) CA, in
//! two cells: a scale-up from zero whose node size only the infrastructure template's
//! `status.capacity` gives, and the removal of an empty Node beside a busy one.
//!
//! And the Kubernetes matrix: the management cluster on the oldest and the newest Kubernetes Cluster
//! API v1.14 supports (kube-apiserver and kube-scheduler of every release pinned in
//! tests/upstream/k8s: 1.33, 1.37; the default 1.36 runs every other scenario), each a control plane
//! of its own with the default Cluster API manager, in the same two cells. The control plane is the
//! workload cluster too, so CA is the newest pinned release not newer than its Kubernetes minor, as
//! CA's version policy asks (CA 1.36 on 1.33 waits forever for the `resource.k8s.io/v1` informers
//! that 1.33 does not serve).

pub mod support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;

use support::autoscaler::{default_version, versions};
use support::capi_manager::{CapiManager, capi_manager_apart, capi_manager_of, pinned_releases};
use support::control_plane::{Setup, pinned_kubernetes};
use support::real_capi_scenario::{RealCapiScenario, scale_up_and_down};
use support::workload::{self, PodSpec};

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

/// A cell of the Cluster API matrix.
#[derive(Clone, Copy, Debug)]
enum CapiCell {
    ScaleUpFromZero,
    EmptyNodeScaleDown,
}

impl CapiCell {
    fn label(self) -> &'static str {
        match self {
            CapiCell::ScaleUpFromZero => "scale-up from zero",
            CapiCell::EmptyNodeScaleDown => "empty-node scale-down",
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pinned_cluster_api_release_scales_up_from_zero_and_removes_an_empty_node() {
    // The managers start side by side, off the runtime's workers (a start blocks its thread).
    let starts: Vec<_> = pinned_releases()
        .into_iter()
        .map(|pin| tokio::task::spawn_blocking(move || capi_manager_of(pin.as_deref())))
        .collect();
    let mut rows = Vec::new();
    for start in starts {
        let manager = start.await.expect("a Cluster API manager starts");
        rows.push(Row {
            label: format!("CAPI {}", manager.version),
            prefix: format!("capi-matrix-{}", manager.version),
            manager,
            autoscaler: default_version(),
        });
    }
    run_capi_cells(rows).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pinned_kubernetes_release_scales_up_from_zero_and_removes_an_empty_node() {
    let starts: Vec<_> = pinned_kubernetes()
        .into_iter()
        .map(|pin| {
            tokio::task::spawn_blocking(move || {
                capi_manager_apart(&format!("k8s-{pin}"), Setup::real_capi().on_kubernetes(pin))
            })
        })
        .collect();
    let mut rows = Vec::new();
    for start in starts {
        let manager = start
            .await
            .expect("a control plane and its CAPI manager start");
        let version = &manager.cp.kubernetes_version;
        rows.push(Row {
            label: format!("Kubernetes {version} (CAPI {})", manager.version),
            prefix: format!("k8s-matrix-{version}"),
            manager,
            autoscaler: autoscaler_for(version),
        });
    }
    run_capi_cells(rows).await;
}

/// The newest pinned CA whose minor is not newer than Kubernetes `version`'s (`v1.33.13` → 1.33.6).
fn autoscaler_for(version: &str) -> String {
    let minor = |v: &str| {
        v.trim_start_matches('v')
            .split('.')
            .nth(1)
            .and_then(|m| m.parse::<u32>().ok())
    };
    let wanted = minor(version);
    versions()
        .into_iter()
        .filter(|ca| minor(ca) <= wanted)
        .max_by_key(|ca| {
            ca.split('.')
                .map(|p| p.parse::<u32>().unwrap_or(0))
                .collect::<Vec<_>>()
        })
        .unwrap_or_else(|| panic!("no pinned cluster-autoscaler for Kubernetes {version}"))
}

/// A row of a matrix: its label, its scenarios' name prefix, the manager and the CA it runs.
struct Row {
    label: String,
    prefix: String,
    manager: &'static CapiManager,
    autoscaler: String,
}

/// Both cells on each row's manager, side by side; a line per cell, then the verdict.
async fn run_capi_cells(rows: Vec<Row>) {
    let mut cells = Vec::new();
    for row in rows {
        for cell in [CapiCell::ScaleUpFromZero, CapiCell::EmptyNodeScaleDown] {
            let label = format!("{} {}, CA {}", row.label, cell.label(), row.autoscaler);
            let name = format!("{}-{cell:?}", row.prefix);
            let (manager, ca) = (row.manager, row.autoscaler.clone());
            cells.push((
                label,
                tokio::spawn(async move {
                    let started = Instant::now();
                    let s = RealCapiScenario::on(&name, manager).await;
                    let phases = match cell {
                        CapiCell::ScaleUpFromZero => scale_up_from_template_capacity(s, &ca).await,
                        CapiCell::EmptyNodeScaleDown => remove_the_empty_node(s, &ca).await,
                    };
                    (phases, started.elapsed())
                }),
            ));
        }
    }
    let mut failed = Vec::new();
    for (label, cell) in cells {
        let line = match cell.await {
            Ok((phases, wall)) => format!("pass ({phases}, wall {:.1}s)", wall.as_secs_f64()),
            Err(e) => {
                failed.push(format!("{label}: {e}"));
                "FAIL".to_string()
            }
        };
        support::procs::announce(&format!("e2e: matrix {label}: {line}"));
    }
    assert!(failed.is_empty(), "cells failed:\n{}", failed.join("\n"));
}

/// A group at zero whose size only its stand-in template's `status.capacity` gives (2 CPUs, 4Gi, 110
/// pods; no capacity annotations): its `spec.replicas` defaulted to 0 by CAPI's webhook from the
/// min-size annotation, a pending pod that fits only it makes CA raise it to 1, CAPI makes the
/// Machine, the stand-in its Node of the template's size, and the scheduler binds the pod there.
/// Returns its phase times.
async fn scale_up_from_template_capacity(mut s: RealCapiScenario, ca: &str) -> String {
    s.template("small", "2", "4Gi", true).await;
    let mut md = s.md("pool", "small", 0, 3, 0);
    if let Some(spec) = md["spec"].as_object_mut() {
        spec.remove("replicas");
    }
    s.create_md(&md).await;
    let defaulted = s.replicas("pool").await;
    s.check(
        defaulted == 0,
        &format!("CAPI's webhook defaults replicas to the min size 0: {defaulted}"),
    );
    s.start_provider(&[]).await;
    let ca = s.autoscaler().version(ca);
    s.start_ca(ca).await;

    let t0 = Instant::now();
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas("pool", 1, Duration::from_secs(90)).await;
    let up = t0.elapsed();
    let machines = s.wait_machines_with_nodes("pool", 1).await;
    let node = workload::wait_bound(&s.client, &s.ns, "web", Duration::from_secs(90)).await;
    let bound = t0.elapsed();
    s.check(
        machines == vec![node.clone()],
        &format!("the pod runs on the Node of pool's one Machine: {node}, Machines {machines:?}"),
    );
    let capacity = Api::<Node>::all(s.client.clone())
        .get(&node)
        .await
        .unwrap_or_else(|e| s.fail(&format!("get Node {node}: {e}")))
        .status
        .and_then(|st| st.capacity)
        .unwrap_or_default();
    let size: Vec<Option<&str>> = ["cpu", "memory", "pods"]
        .iter()
        .map(|r| capacity.get(*r).map(|q| q.0.as_str()))
        .collect();
    s.check(
        size == [Some("2"), Some("4Gi"), Some("110")],
        &format!("Node {node} has the template's capacity: {size:?}"),
    );
    s.check(
        s.deletions.all().is_empty(),
        &format!("nothing deleted: {:?}", s.deletions.all()),
    );
    s.passed();
    format!(
        "pod -> replicas 1 {:.1}s, pod -> bound {:.1}s",
        up.as_secs_f64(),
        bound.as_secs_f64()
    )
}

/// A group of two Nodes (min 1; size from the template's status) where a pod uses 75% of one and the
/// other is empty: CA removes the empty one through this provider, and CAPI deletes exactly its
/// Machine (carrying the mark) and Node; replicas 2 → 1, the busy Node and its pod stay. Returns its
/// phase times.
async fn remove_the_empty_node(mut s: RealCapiScenario, ca: &str) -> String {
    s.template("small", "2", "4Gi", true).await;
    let md = s.md("pool", "small", 1, 3, 2);
    s.create_md(&md).await;
    let machines = s.wait_machines_with_nodes("pool", 2).await;
    workload::create_pod(&s.client, &s.ns, &PodSpec::new("busy", "1500m", "1Gi")).await;
    let busy = workload::wait_bound(&s.client, &s.ns, "busy", Duration::from_secs(90)).await;
    let empty: Vec<String> = machines.into_iter().filter(|m| *m != busy).collect();
    s.check(
        empty.len() == 1,
        &format!("one Machine's Node besides the busy {busy}: {empty:?}"),
    );
    s.start_provider(&[]).await;
    let ca = s.autoscaler().version(ca);
    s.start_ca(ca).await;

    let t0 = Instant::now();
    s.wait_replicas("pool", 1, Duration::from_secs(120)).await;
    let lowered = t0.elapsed();
    s.wait_nodes(std::slice::from_ref(&busy)).await;
    s.wait_deletions_done().await;
    let gone = t0.elapsed();
    let deleted = s.deleted_marked();
    s.check(
        deleted == empty,
        &format!(
            "CAPI deleted the empty Node's Machine for its mark: {deleted:?}, empty {empty:?}"
        ),
    );
    s.check_every_deletion_marked();
    let still = workload::node_of(&s.client, &s.ns, "busy").await;
    s.check(
        still.as_deref() == Some(busy.as_str()),
        &format!("the busy pod stays on {busy}: {still:?}"),
    );
    s.passed();
    format!(
        "CA start -> replicas 1 {:.1}s, -> Machine and Node gone {:.1}s",
        lowered.as_secs_f64(),
        gone.as_secs_f64()
    )
}
