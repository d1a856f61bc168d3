//! The test-only fake CAPI / fake kubelet reconciler (tests/support/reconciler.rs) does what it says:
//! MachineDeployment → MachineSet → Machines → Ready Nodes, delete-annotated Machines removed first
//! and then the newest, MachinePools through providerIDList, the Node delay and the
//! provisioning-failure knob. No provider runs here.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{DynamicObject, ListParams};
use serde_json::json;
use support::capi::{Capi, DEFAULT_CLUSTER, INFRA_GROUP, Kind, Scalable};
use support::reconciler::{
    CREATED_ANNOTATION, NAMESPACE_LABEL, REVISION_ANNOTATION, Reconciler, ReconcilerConfig,
};
use support::{CAPI_GROUP, Check, Setup, poll_until};

const CAP: &str = "capacity.cluster-autoscaler.kubernetes.io";

async fn capi() -> Capi {
    let cp = support::control_plane(Setup::shipped());
    let ns = cp.fresh_namespace().await;
    Capi::new(cp.admin_client().await, &ns, CAPI_GROUP, "v1beta2")
}

fn nodes(capi: &Capi) -> Api<Node> {
    Api::all(capi.client.clone())
}

/// Polls `f` every 50 ms for 30 s until it returns `Some`.
async fn wait_for<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    poll_until(
        what,
        Duration::from_secs(30),
        Duration::from_millis(50),
        || {
            let fut = f();
            async move {
                match fut.await {
                    Ok(v) => Check::Done(v),
                    Err(why) => Check::Wait(why),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

async fn machines(capi: &Capi) -> Vec<DynamicObject> {
    capi.api(Kind::Machine)
        .list(&ListParams::default())
        .await
        .expect("list Machines")
        .items
}

fn name(o: &DynamicObject) -> String {
    o.metadata.name.clone().unwrap_or_default()
}

fn created_nanos(o: &DynamicObject) -> u128 {
    o.metadata.annotations.as_ref().expect("annotations")[CREATED_ANNOTATION]
        .parse()
        .expect("a number")
}

fn ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Waits until exactly `n` Machines exist, each Running with a nodeRef and a Ready Node; returns
/// them sorted by creation.
async fn wait_running(capi: &Capi, n: usize) -> Vec<DynamicObject> {
    wait_for(
        &format!("{n} running Machines with Ready Nodes"),
        || async {
            let mut list = machines(capi).await;
            if list.len() != n {
                return Err(format!("{} Machines", list.len()));
            }
            for m in &list {
                let node_ref = m.data["status"]["nodeRef"]["name"].as_str();
                if node_ref != Some(name(m).as_str()) || m.data["status"]["phase"] != "Running" {
                    return Err(format!("{} status {}", name(m), m.data["status"]));
                }
                match nodes(capi).get_opt(&name(m)).await {
                    Ok(Some(node)) if ready(&node) => {}
                    other => return Err(format!("Node {}: {other:?}", name(m))),
                }
            }
            list.sort_by_key(created_nanos);
            Ok(list)
        },
    )
    .await
}

async fn wait_gone(capi: &Capi, node: &str) {
    wait_for(&format!("Node {node} deleted"), || async {
        match nodes(capi).get_opt(node).await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await
}

#[tokio::test]
async fn deployment_scales_up_and_removes_the_marked_machine_first() {
    let capi = capi().await;
    let md = Scalable::md("md")
        .replicas(0)
        .bounds(0, 5)
        .annotation(&format!("{CAP}/cpu"), "3")
        .annotation(&format!("{CAP}/memory"), "6Gi")
        .annotation(&format!("{CAP}/labels"), "pool=a,tier=web")
        .annotation(&format!("{CAP}/taints"), "dedicated=x:NoSchedule");
    let md_object = capi.create(&md).await;
    let reconciler = Reconciler::start(capi.client.clone(), &capi.ns);

    // MachineDeployment → MachineSet <md>-<hash>.
    let ms_name = Reconciler::set_name(&capi.ns, "md");
    let ms = wait_for("the MachineSet", || async {
        capi.api(Kind::MachineSet)
            .get(&ms_name)
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let owner = &ms.metadata.owner_references.as_ref().expect("owner")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("MachineDeployment", "md", Some(true))
    );
    assert_eq!(owner.uid, md_object.metadata.uid.clone().unwrap());
    let labels = ms.metadata.labels.clone().unwrap();
    assert_eq!(labels[&capi.key("cluster-name")], DEFAULT_CLUSTER);
    assert_eq!(labels[&capi.key("deployment-name")], "md");
    assert_eq!(
        ms.metadata.annotations.clone().unwrap()[REVISION_ANNOTATION],
        "1"
    );
    assert_eq!(ms.data["spec"]["replicas"], json!(0));

    // 0 → 2.
    capi.scale(Kind::MachineDeployment, "md", 2).await;
    let running = wait_running(&capi, 2).await;
    for m in &running {
        let n = name(m);
        let labels = m.metadata.labels.clone().unwrap();
        assert_eq!(labels[&capi.key("cluster-name")], DEFAULT_CLUSTER);
        assert_eq!(labels[&capi.key("set-name")], ms_name);
        assert_eq!(labels[&capi.key("deployment-name")], "md");
        let owner = &m.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str()),
            ("MachineSet", ms_name.as_str())
        );
        let provider_id = format!("e2e:///{}/{n}", capi.ns);
        assert_eq!(m.data["spec"]["providerID"], json!(provider_id));

        let node = nodes(&capi).get(&n).await.unwrap();
        assert_eq!(
            node.spec.as_ref().unwrap().provider_id.as_deref(),
            Some(provider_id.as_str())
        );
        let node_labels = node.metadata.labels.clone().unwrap();
        for (k, v) in [
            ("pool", "a"),
            ("tier", "web"),
            ("kubernetes.io/hostname", n.as_str()),
            ("kubernetes.io/os", "linux"),
            (capi.key("deployment-name").as_str(), "md"),
            (NAMESPACE_LABEL, capi.ns.as_str()),
        ] {
            assert_eq!(node_labels.get(k).map(String::as_str), Some(v), "label {k}");
        }
        let annotations = node.metadata.annotations.clone().unwrap();
        assert_eq!(annotations[&capi.key("machine")], n);
        assert_eq!(annotations[&capi.key("cluster-namespace")], capi.ns);
        assert_eq!(annotations[&capi.key("cluster-name")], DEFAULT_CLUSTER);
        let taints = node.spec.as_ref().unwrap().taints.clone().unwrap();
        assert_eq!(
            (
                taints[0].key.as_str(),
                taints[0].value.as_deref(),
                taints[0].effect.as_str()
            ),
            ("dedicated", Some("x"), "NoSchedule")
        );
        let status = node.status.clone().unwrap();
        let quantities = |m: Option<
            BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
        >| {
            m.unwrap()
                .into_iter()
                .map(|(k, q)| (k, q.0))
                .collect::<BTreeMap<_, _>>()
        };
        let want: BTreeMap<String, String> = [("cpu", "3"), ("memory", "6Gi"), ("pods", "110")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(quantities(status.capacity), want);
        assert_eq!(quantities(status.allocatable), want);
    }
    wait_for(
        "MachineSet and MachineDeployment status.replicas 2",
        || async {
            let ms = capi
                .api(Kind::MachineSet)
                .get(&ms_name)
                .await
                .map_err(|e| e.to_string())?;
            let md = capi
                .api(Kind::MachineDeployment)
                .get("md")
                .await
                .map_err(|e| e.to_string())?;
            let got = (
                &ms.data["status"]["replicas"],
                &md.data["status"]["replicas"],
            );
            if got == (&json!(2), &json!(2)) {
                Ok(())
            } else {
                Err(format!("{got:?}"))
            }
        },
    )
    .await;

    // 2 → 1 with the *older* Machine marked: the mark wins over "newest first".
    let (older, newer) = (name(&running[0]), name(&running[1]));
    capi.patch(
        Kind::Machine,
        &older,
        json!({"metadata": {"annotations": {capi.delete_key(): "yes"}}}),
    )
    .await;
    capi.scale(Kind::MachineDeployment, "md", 1).await;
    wait_gone(&capi, &older).await;
    let left = wait_running(&capi, 1).await;
    assert_eq!(name(&left[0]), newer);
    assert_eq!(capi.replicas(Kind::MachineSet, &ms_name).await, 1);

    // 1 → 2 → 1 without a mark: the newest goes.
    capi.scale(Kind::MachineDeployment, "md", 2).await;
    let two = wait_running(&capi, 2).await;
    let newest = name(&two[1]);
    assert_eq!(name(&two[0]), newer);
    capi.scale(Kind::MachineDeployment, "md", 1).await;
    wait_gone(&capi, &newest).await;
    let left = wait_running(&capi, 1).await;
    assert_eq!(name(&left[0]), newer);

    assert!(reconciler.errors().is_empty(), "{:?}", reconciler.errors());
}

#[tokio::test]
async fn machine_pool_scales_from_zero_and_back() {
    let capi = capi().await;
    capi.create(
        &Scalable::mp("mp")
            .replicas(0)
            .annotation(&format!("{CAP}/cpu"), "4")
            .annotation(&format!("{CAP}/memory"), "16Gi"),
    )
    .await;
    let reconciler = Reconciler::start(capi.client.clone(), &capi.ns);
    reconciler.wait_passes(2).await;
    capi.scale(Kind::MachinePool, "mp", 1).await;

    let (id, node) = wait_for("one MachinePool instance with a Ready Node", || async {
        let mp = capi
            .api(Kind::MachinePool)
            .get("mp")
            .await
            .map_err(|e| e.to_string())?;
        let ids = mp.data["spec"]["providerIDList"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if ids.len() != 1 || mp.data["status"]["replicas"] != json!(1) {
            return Err(format!(
                "providerIDList {ids:?}, status {}",
                mp.data["status"]
            ));
        }
        let id = ids[0].as_str().unwrap_or_default().to_string();
        let node_name = id.rsplit('/').next().unwrap_or_default().to_string();
        match nodes(&capi).get_opt(&node_name).await {
            Ok(Some(node)) if ready(&node) => Ok((id, node)),
            other => Err(format!("Node {node_name}: {other:?}")),
        }
    })
    .await;
    assert!(id.starts_with(&format!("e2e:///{}/mp-", capi.ns)), "{id}");
    assert_eq!(
        node.spec.as_ref().unwrap().provider_id.as_deref(),
        Some(id.as_str())
    );
    let annotations = node.metadata.annotations.clone().unwrap();
    assert_eq!(annotations[&capi.key("owner-kind")], "MachinePool");
    assert_eq!(annotations[&capi.key("owner-name")], "mp");
    let cpu = &node.status.as_ref().unwrap().capacity.as_ref().unwrap()["cpu"];
    assert_eq!(cpu.0, "4");
    assert!(
        machines(&capi).await.is_empty(),
        "MachinePools get no Machines here"
    );

    capi.scale(Kind::MachinePool, "mp", 0).await;
    let node_name = node.metadata.name.clone().unwrap();
    wait_gone(&capi, &node_name).await;
    wait_for("an empty MachinePool", || async {
        let mp = capi
            .api(Kind::MachinePool)
            .get("mp")
            .await
            .map_err(|e| e.to_string())?;
        let ids = mp.data["spec"]["providerIDList"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if ids.is_empty() && mp.data["status"]["replicas"] == json!(0) {
            Ok(())
        } else {
            Err(format!("{ids:?} {}", mp.data["status"]))
        }
    })
    .await;
    assert!(reconciler.errors().is_empty(), "{:?}", reconciler.errors());
}

#[tokio::test]
async fn node_delay_and_provisioning_failure() {
    let capi = capi().await;
    capi.create(&Scalable::md("slow").replicas(1)).await;
    capi.create(&Scalable::md("broken").replicas(1)).await;
    let delay = Duration::from_millis(700);
    let reconciler = Reconciler::start_with(
        capi.client.clone(),
        &capi.ns,
        ReconcilerConfig::default()
            .node_delay(delay)
            .never_provision("broken"),
    );
    let slow_set = Reconciler::set_name(&capi.ns, "slow");
    let broken_set = Reconciler::set_name(&capi.ns, "broken");
    let by_set = |set: String| {
        let capi = capi.clone();
        async move {
            machines(&capi)
                .await
                .into_iter()
                .find(|m| {
                    m.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(&capi.key("set-name")))
                        == Some(&set)
                })
                .ok_or_else(|| format!("no Machine of {set} yet"))
        }
    };
    let slow = wait_for("the Node of slow's Machine", || async {
        let m = by_set(slow_set.clone()).await?;
        match nodes(&capi).get_opt(&name(&m)).await {
            Ok(Some(_)) => Ok(m),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let actions = reconciler.take_actions();
    let at = |prefix: String| {
        actions
            .iter()
            .find(|(_, a)| a.starts_with(&prefix))
            .map(|(t, _)| *t)
            .unwrap_or_else(|| panic!("no action {prefix:?} in {actions:?}"))
    };
    let created = at(format!("created Machine {}", name(&slow)));
    let node = at(format!("Node {} Ready", name(&slow)));
    assert!(node - created >= delay, "Node after {:?}", node - created);

    // broken: a Machine with a providerID but no Node, long after the delay.
    let broken = by_set(broken_set.clone()).await.unwrap();
    assert!(broken.data["spec"]["providerID"].is_string());
    reconciler.wait_passes(3).await;
    assert!(
        nodes(&capi)
            .get_opt(&name(&broken))
            .await
            .unwrap()
            .is_none()
    );
    let broken = by_set(broken_set.clone()).await.unwrap();
    assert!(
        broken.data["status"]["nodeRef"].is_null(),
        "{}",
        broken.data["status"]
    );

    // Switched off: the same Machine registers.
    reconciler.never_provision("broken", false);
    wait_running(&capi, 2).await;
    assert!(reconciler.errors().is_empty(), "{:?}", reconciler.errors());
}

#[tokio::test]
async fn adopts_the_machine_set_a_deployment_already_controls() {
    let capi = capi().await;
    capi.create_deployment(&Scalable::md("adopt").replicas(1), false)
        .await;
    let reconciler = Reconciler::start(capi.client.clone(), &capi.ns);
    let running = wait_running(&capi, 1).await;
    let labels = running[0].metadata.labels.clone().unwrap();
    assert_eq!(labels[&capi.key("set-name")], Capi::set_of("adopt"));
    reconciler.wait_passes(2).await;
    let sets: BTreeSet<String> = capi
        .api(Kind::MachineSet)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(name)
        .collect();
    assert_eq!(sets, BTreeSet::from([Capi::set_of("adopt")]));
    assert!(reconciler.errors().is_empty(), "{:?}", reconciler.errors());
}

/// A MachineSet seen before its MachineDeployment (the MachineDeployment is created between the two
/// lists of a pass, or later, as here) gets Machines but no Node until the MachineDeployment is
/// seen: the Node's labels come from the MachineDeployment's capacity annotations.
#[tokio::test]
async fn machine_set_seen_before_its_deployment_waits_for_it_to_shape_the_node() {
    let capi = capi().await;
    let set = json!({
        "apiVersion": format!("{CAPI_GROUP}/v1beta2"),
        "kind": "MachineSet",
        "metadata": {
            "name": "late-ms",
            "namespace": capi.ns,
            "ownerReferences": [{
                "apiVersion": format!("{CAPI_GROUP}/v1beta2"),
                "kind": "MachineDeployment",
                "name": "late",
                "uid": "00000000-0000-0000-0000-000000000001",
                "controller": true,
            }],
        },
        "spec": {
            "clusterName": DEFAULT_CLUSTER,
            "replicas": 1,
            "selector": {"matchLabels": {"set": "late-ms"}},
            "template": {
                "metadata": {"labels": {"set": "late-ms"}},
                "spec": {
                    "clusterName": DEFAULT_CLUSTER,
                    "bootstrap": {"dataSecretName": "late-bootstrap"},
                    "infrastructureRef": {"apiGroup": INFRA_GROUP, "kind": "E2EMachineTemplate", "name": "late"},
                },
            },
        },
    });
    let set: DynamicObject = serde_json::from_value(set).unwrap();
    capi.api(Kind::MachineSet)
        .create(&Default::default(), &set)
        .await
        .unwrap();
    let reconciler = Reconciler::start(capi.client.clone(), &capi.ns);
    wait_for("the MachineSet's Machine", || {
        let capi = &capi;
        async move {
            match machines(capi).await.len() {
                1 => Ok(()),
                n => Err(format!("{n} Machines")),
            }
        }
    })
    .await;
    reconciler.wait_passes(3).await;
    let ours = ListParams::default().labels(&format!("{NAMESPACE_LABEL}={}", capi.ns));
    let early = nodes(&capi).list(&ours).await.unwrap().items;
    assert!(
        early.is_empty(),
        "no Node before its MachineDeployment is seen: {early:?}"
    );

    let md = Scalable::md("late")
        .replicas(1)
        .annotation(&format!("{CAP}/labels"), "e2e-shape=from-md");
    capi.create(&md).await;
    let node = wait_for("a Node shaped by the MachineDeployment", || {
        let (capi, ours) = (&capi, &ours);
        async move {
            match nodes(capi)
                .list(ours)
                .await
                .map_err(|e| e.to_string())?
                .items
                .as_slice()
            {
                [node] => Ok(node.clone()),
                other => Err(format!("{} Nodes", other.len())),
            }
        }
    })
    .await;
    let labels = node.metadata.labels.unwrap_or_default();
    assert_eq!(
        labels.get("e2e-shape").map(String::as_str),
        Some("from-md"),
        "{labels:?}"
    );
    assert!(reconciler.errors().is_empty(), "{:?}", reconciler.errors());
}
