//! The MachinePool scenario with the real cluster-autoscaler, on the test reconciler (the imitation
//! of Cluster API's controllers, tests/support/reconciler.rs): TODO
pub mod support;

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use support::Setup;
use support::capi::{Kind, Scalable};
use support::scenario::{CAPACITY, Scenario};
use support::workload::{self, PodSpec};

const UP: Duration = Duration::from_secs(60);
const DOWN: Duration = Duration::from_secs(90);
/// A MachinePool group: scaled up from zero for a pod (replicas through the scale subresource, the
/// new instance in `providerIDList`), then back down when the pod goes.
#[tokio::test]
async fn machine_pool_scales_up_and_down() {
    let mut s = Scenario::new("machinepool", Setup::shipped()).await;
    let mp = Scalable::mp("pool").bounds(0, 3).replicas(0).annotation(
        &format!("{CAPACITY}/labels"),
        &workload::scenario_labels(&s.ns, &[]),
    );
    let mp = Scenario::capacity(mp, "2", "4Gi");
    s.capi.create(&mp).await;
    s.start_provider(&[]).await;
    s.start_ca(s.autoscaler()).await;

    workload::create_pod(&s.client, &s.ns, &PodSpec::new("web", "1500m", "1Gi")).await;
    s.wait_replicas(Kind::MachinePool, "pool", 1, UP).await;
    let node = workload::wait_bound(&s.client, &s.ns, "web", UP).await;
    let pool = s
        .capi
        .api(Kind::MachinePool)
        .get("pool")
        .await
        .expect("get MachinePool");
    let ids = pool.data["spec"]["providerIDList"]
        .as_array()
        .map_or(0, Vec::len);
    s.check(ids == 1, &format!("one entry in providerIDList: {ids}"));

    workload::delete_pod(&s.client, &s.ns, "web").await;
    s.wait_replicas(Kind::MachinePool, "pool", 0, DOWN).await;
    s.wait_nodes(&[]).await;
    let gone = Api::<Node>::all(s.client.clone())
        .get_opt(&node)
        .await
        .ok()
        .flatten();
    s.check(gone.is_none(), &format!("Node {node} is gone"));
    s.passed();
}
