//! The compatibility matrix's v1beta1 cell: the default cluster-autoscaler on a control plane that
//! serves only Cluster API v1beta1 (as stored by CAPI before v1.11): a scale-up from zero and the
//! removal of the empty node, through the provider's v1beta1 code paths.

use crate::support;

use support::Setup;
use support::autoscaler::default_version;
use support::scenario::{Scenario, scale_up_and_down};

#[tokio::test]
async fn default_autoscaler_scales_up_from_zero_and_down_on_v1beta1() {
    let mut s = Scenario::new("matrix-v1beta1", Setup::v1beta1()).await;
    let t = scale_up_and_down(&mut s, |ca| ca).await;
    support::procs::announce(&format!(
        "e2e: matrix CA {} on v1beta1: pass (up {:.1}s, bound {:.1}s, down {:.1}s)",
        default_version(),
        t.up.as_secs_f64(),
        t.bound.as_secs_f64(),
        t.down.as_secs_f64()
    ));
    s.passed();
}
