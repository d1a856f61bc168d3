//! The compatibility matrix: every pinned cluster-autoscaler release (tests/upstream/
//! cluster-autoscaler.versions) scales a group up from zero and removes the empty node again through
//! the provider, on Cluster API v1beta2. CA 1.33 reads only the legacy wire fields, 1.35+ only the new
//! ones, 1.34.5 both: every cell must pass. The cells run side by side; the table of results and
//! times is printed before the verdict. (CA on v1beta1-only CRDs: tests/e2e_v1beta1/autoscaler.rs.)

pub mod support;

use std::time::Instant;

use support::Setup;
use support::autoscaler::versions;
use support::scenario::{Scenario, scale_up_and_down};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pinned_autoscaler_scales_up_from_zero_and_down_on_v1beta2() {
    let mut cells = Vec::new();
    for version in versions() {
        cells.push((
            version.clone(),
            tokio::spawn(async move {
                let started = Instant::now();
                let name = format!("matrix-{version}-v1beta2");
                let mut s = Scenario::new(&name, Setup::shipped()).await;
                let times = scale_up_and_down(&mut s, |ca| ca.version(&version)).await;
                s.passed();
                (times, started.elapsed())
            }),
        ));
    }
    let mut failed = Vec::new();
    for (version, cell) in cells {
        let line = match cell.await {
            Ok((t, wall)) => format!(
                "pass (up {:.1}s, bound {:.1}s, down {:.1}s, wall {:.1}s)",
                t.up.as_secs_f64(),
                t.bound.as_secs_f64(),
                t.down.as_secs_f64(),
                wall.as_secs_f64()
            ),
            Err(e) => {
                failed.push(format!("{version}: {e}"));
                "FAIL".to_string()
            }
        };
        support::procs::announce(&format!("e2e: matrix CA {version} on v1beta2: {line}"));
    }
    assert!(failed.is_empty(), "cells failed:\n{}", failed.join("\n"));
}
